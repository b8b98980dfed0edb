//! A reader that reads further ahead than a forward scan asks.

use super::{Key, KeyRange, KvRead, Value};
use crate::error::StoreError;

/// A reader that reads further ahead than a forward scan asks, and answers
/// later scans of the same range from what it read, for a batch's life over a
/// base that does not change under it. A batch's leases scan the waiting index
/// one after another, each from the head the one before took: answered by the
/// snapshot each time, every lease paid a B-tree descent and a range for one or
/// two entries (about 5,900 instructions).
pub struct ReadAhead<R> {
    inner: R,
    /// How many entries past what a scan asks to read.
    extra: usize,
    /// What scans read ahead, a few ranges at most.
    kept: Vec<ReadAheadRange>,
}

/// Every entry of a base in `[start, end)` up to the last key of `entries`,
/// or up to `end` when `whole`.
struct ReadAheadRange {
    start: Key,
    end: Key,
    entries: Vec<(Key, Value)>,
    whole: bool,
}

/// How many ranges a [`ReadAhead`] keeps.
const READ_AHEAD_RANGES: usize = 4;

impl<R: KvRead> ReadAhead<R> {
    /// Reads `extra` entries past what each forward scan asks (none: a plain reader).
    pub fn new(inner: R, extra: usize) -> Self {
        Self { inner, extra, kept: Vec::new() }
    }
}

impl<R: KvRead> KvRead for ReadAhead<R> {
    fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        self.inner.get(key)
    }

    fn scan(&mut self, range: &KeyRange, limit: usize, reverse: bool) -> Result<Vec<(Key, Value)>, StoreError> {
        if reverse || limit == 0 || self.extra == 0 {
            return self.inner.scan(range, limit, reverse);
        }
        for kept in &self.kept {
            if kept.end != range.end || kept.start > range.start {
                continue;
            }
            let from = kept.entries.partition_point(|(key, _)| *key < range.start);
            let left = &kept.entries[from..];
            if left.len() >= limit || kept.whole {
                return Ok(left[..limit.min(left.len())].to_vec());
            }
        }
        let asked = limit.saturating_add(self.extra);
        let entries = self.inner.scan(range, asked, false)?;
        let out = entries[..limit.min(entries.len())].to_vec();
        let whole = entries.len() < asked;
        self.kept.retain(|kept| kept.end != range.end);
        if self.kept.len() == READ_AHEAD_RANGES {
            self.kept.remove(0);
        }
        self.kept.push(ReadAheadRange { start: range.start.clone(), end: range.end.clone(), entries, whole });
        Ok(out)
    }
}
