//! What operations remembered of ranges of keys, decoded, kept across batches.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;

use super::{Decoded, Key, KeyRange};

/// What operations remembered, by range (the redb engine keeps one for as
/// long as its executor runs). Ranges never overlap (one that would is not
/// remembered), so the one range a written key can fall in is the last one
/// starting at or before it.
#[derive(Default)]
pub struct Memo {
    entries: BTreeMap<Key, (Key, Decoded)>,
}

/// Most ranges a memo keeps: one per queue in use, each its meta hash. Past
/// it the memo starts over, so a store with many queues holds no more than
/// this many decoded hashes.
const MAX_REMEMBERED: usize = 1024;

impl Memo {
    /// Forgets everything: what it held may no longer be what the store holds.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    pub(super) fn get(&self, range: &KeyRange) -> Option<Decoded> {
        match self.entries.get(&range.start) {
            Some((end, value)) if *end == range.end => Some(Arc::clone(value)),
            _ => None,
        }
    }

    pub(super) fn forget_key(&mut self, key: &[u8]) {
        let holder = self.entries.range::<[u8], _>((Bound::Unbounded, Bound::Included(key))).next_back();
        if let Some((start, _)) = holder.filter(|(_, (end, _))| key < end.as_slice()) {
            let start = start.clone();
            self.entries.remove(&start);
        }
    }

    pub(super) fn insert(&mut self, range: KeyRange, value: Decoded) {
        if self.entries.len() >= MAX_REMEMBERED {
            self.entries.clear();
        }
        self.entries.remove(&range.start);
        // The ranges are disjoint, so the last one starting before this one
        // ends is the only one that can overlap it.
        let overlaps = self
            .entries
            .range::<[u8], _>((Bound::Unbounded, Bound::Excluded(range.end.as_slice())))
            .next_back()
            .is_some_and(|(_, (end, _))| end.as_slice() > range.start.as_slice());
        if !overlaps {
            self.entries.insert(range.start, (range.end, value));
        }
    }
}
