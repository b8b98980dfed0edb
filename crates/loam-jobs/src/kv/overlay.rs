//! A batch's uncommitted writes over the reader below them, with an undo log
//! per operation.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::memo::Memo;
use super::merge::{local_range, scan_under};
use super::{Decoded, Key, KeyRange, KvRead, KvTxn, Value, Writes};
use crate::error::StoreError;

/// Uncommitted writes layered over a base reader: a batch's, under group
/// commit. The batch's operations write into it one after another, each
/// leaving an undo log ([`Overlay::end_operation`]), so a failed operation is
/// taken back whole while the others in its batch still commit, and hot keys
/// written by many operations of one batch reach the engine once. (Each
/// operation had its own overlay over the batch's once, merged into it when
/// it succeeded: every read went through one more map, every write was
/// inserted twice, and every append to the event page copied the page.)
pub struct Overlay<'a> {
    base: &'a mut dyn KvRead,
    writes: Writes,
    /// How to take back the writes of the operation under way, oldest first.
    undo: Vec<Undo>,
    /// Per forward-scan start: every base key in `[start, floor)` has a write
    /// here. The base does not change under an overlay, so a later scan from
    /// the same start can read the base from the floor. This keeps the many
    /// leases of one batch, each of which deletes the head of the waiting
    /// index, from rescanning every head deleted before them.
    floors: BTreeMap<Key, Key>,
    /// Per forward-scan start: the overlay over its base holds no key in
    /// `[start, end)`, found by the last scan from that start (the range up
    /// to the first key it returned). A later scan from the same start begins
    /// at `end`, in the writes as in the base: a batch's leases each delete
    /// the head of the waiting index, and each one's scan went through every
    /// head deleted before it, in this batch and in every batch below. A
    /// put in the range ends the entry (a delete cannot break it); so does
    /// an operation taken back. Few scan starts per batch, so a list, kept
    /// to the latest used [`EMPTY_RANGES_KEPT`]: a clean of 40,000 jobs scans each
    /// job's logs and children from a start of its own, and looking through
    /// (and, at every put, trimming) a list of all of them took 53 s.
    empty: Vec<(Key, Key)>,
    /// Base gets remembered for the overlay's life (the base does not change
    /// under it): a batch's operations read the same settings keys again and
    /// again. Off for short-lived overlays, where it would only cost. Scans
    /// are not remembered: the batch's own writes move their start (see
    /// `floors`), so under BullMQ at concurrency 100 not one scan in 80,000
    /// was asked twice, and keeping each result cost a copy of it.
    cache: Option<HashMap<Key, Option<Value>, foldhash::fast::RandomState>>,
    /// What earlier operations remembered (the executor's, lent to the
    /// batch), and what the operation under way remembered since (taken in
    /// when it succeeds).
    memo: Option<&'a mut Memo>,
    remembered: Vec<(KeyRange, Decoded)>,
    /// The operation under way asked for its fsync ([`KvTxn::require_durable`]).
    durable_required: bool,
}

/// What an operation left in an [`Overlay`] (see [`Overlay::end_operation`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OperationEnd {
    /// It wrote something (and kept it, or took it back when it failed).
    pub wrote: bool,
    /// It succeeded and asked for its fsync ([`KvTxn::require_durable`]).
    pub durable_required: bool,
}

/// The most scan starts an overlay remembers an empty range for (see `Overlay::empty`).
const EMPTY_RANGES_KEPT: usize = 32;

/// A step back to what `writes` held before a write of the operation under way.
enum Undo {
    /// The key's entry before (`None`: it had none).
    Restore(Key, Option<Option<Value>>),
    /// The key's value before it was appended to was this long.
    Truncate(Key, usize),
}

impl<'a> Overlay<'a> {
    pub fn new(base: &'a mut dyn KvRead) -> Self {
        Self {
            base,
            writes: BTreeMap::new(),
            undo: Vec::new(),
            floors: BTreeMap::new(),
            empty: Vec::new(),
            cache: None,
            memo: None,
            remembered: Vec::new(),
            durable_required: false,
        }
    }

    /// An overlay that also remembers what it read from the base.
    pub fn caching(base: &'a mut dyn KvRead) -> Self {
        Self { cache: Some(HashMap::default()), ..Self::new(base) }
    }

    /// Lets operations recall what earlier ones remembered in `memo`, and
    /// remember more there (see [`KvTxn::remember`]).
    pub fn remembering(self, memo: &'a mut Memo) -> Self {
        Self { memo: Some(memo), ..self }
    }

    fn base_get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        let Some(cache) = self.cache.as_mut() else { return self.base.get(key) };
        if let Some(v) = cache.get(key) {
            return Ok(v.clone());
        }
        let v = self.base.get(key)?;
        cache.insert(key.to_vec(), v.clone());
        Ok(v)
    }

    pub fn into_writes(self) -> Writes {
        self.writes
    }

    /// Ends the operation whose writes began after the last call: keeps them
    /// (and what it remembered) if it `succeeded`, else takes them back.
    /// Returns what it left: whether it wrote anything, and whether it asked
    /// for its fsync.
    pub fn end_operation(&mut self, succeeded: bool) -> OperationEnd {
        let end = OperationEnd {
            wrote: !self.undo.is_empty(),
            durable_required: std::mem::take(&mut self.durable_required) && succeeded,
        };
        if succeeded {
            self.undo.clear();
            if let Some(memo) = self.memo.as_deref_mut() {
                for (range, value) in self.remembered.drain(..) {
                    memo.insert(range, value);
                }
            }
            return end;
        }
        self.remembered.clear();
        if end.wrote {
            // A floor says the writes cover the base up to it, an empty
            // range that nothing is there; the writes taken back may have
            // been what covered it, or what hid it.
            self.floors.clear();
            self.empty.clear();
        }
        while let Some(step) = self.undo.pop() {
            match step {
                Undo::Restore(key, Some(before)) => {
                    self.writes.insert(key, before);
                }
                Undo::Restore(key, None) => {
                    self.writes.remove(&key);
                }
                Undo::Truncate(key, len) => {
                    if let Some(Some(value)) = self.writes.get_mut(&key) {
                        value.truncate(len);
                    }
                }
            }
        }
        end
    }

    /// A write to `key` makes what was remembered of its range stale.
    fn forget(&mut self, key: &[u8]) {
        if !self.remembered.is_empty() {
            self.remembered.retain(|(range, _)| !range.contains(key));
        }
        if let Some(memo) = self.memo.as_deref_mut() {
            memo.forget_key(key);
        }
    }

    fn write(&mut self, key: &[u8], value: Option<Value>) {
        self.forget(key);
        if value.is_some() && !self.empty.is_empty() {
            self.empty.retain(|(start, end)| !(start.as_slice() <= key && key < end.as_slice()));
        }
        let before = self.writes.insert(key.to_vec(), value);
        self.undo.push(Undo::Restore(key.to_vec(), before));
    }
}

impl KvRead for Overlay<'_> {
    fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        match self.writes.get(key) {
            Some(v) => Ok(v.clone()),
            None => self.base_get(key),
        }
    }

    fn scan(&mut self, range: &KeyRange, limit: usize, reverse: bool) -> Result<Vec<(Key, Value)>, StoreError> {
        // Only a forward scan that may return something learns where the
        // view's keys begin.
        let forward = !reverse && limit > 0;
        let known = if forward { self.empty.iter().position(|(start, _)| *start == range.start) } else { None };
        let narrowed;
        let from = match known {
            Some(i) if self.empty[i].1 >= range.end => return Ok(Vec::new()),
            Some(i) => {
                narrowed = KeyRange::new(self.empty[i].1.clone(), range.end.clone());
                &narrowed
            }
            None => range,
        };
        let out =
            scan_under(local_range(&self.writes, from, reverse), &mut self.floors, self.base, from, limit, reverse)?;
        if forward {
            let first = out.first().map_or(&range.end, |(key, _)| key).clone();
            // The list is kept newest last, a start scanned again moved there:
            // the waiting index's head, scanned by every lease, is never the
            // one let go.
            match known {
                Some(i) => {
                    self.empty[i..].rotate_left(1);
                    if let Some(last) = self.empty.last_mut() {
                        last.1 = first;
                    }
                }
                None => {
                    if self.empty.len() == EMPTY_RANGES_KEPT {
                        self.empty.remove(0);
                    }
                    self.empty.push((range.start.clone(), first));
                }
            }
        }
        Ok(out)
    }
}

impl KvTxn for Overlay<'_> {
    fn put(&mut self, key: &[u8], value: Value) -> Result<(), StoreError> {
        self.write(key, Some(value));
        Ok(())
    }

    fn delete(&mut self, key: &[u8]) -> Result<(), StoreError> {
        self.write(key, None);
        Ok(())
    }

    fn append(&mut self, key: &[u8], extend: &mut dyn FnMut(&mut Value)) -> Result<(), StoreError> {
        if let Some(Some(value)) = self.writes.get_mut(key) {
            // The undo goes first: `extend` may panic (the operation then fails).
            self.undo.push(Undo::Truncate(key.to_vec(), value.len()));
            extend(value);
            self.forget(key);
            return Ok(());
        }
        let mut value = match self.writes.get(key) {
            Some(_) => Vec::new(), // deleted by this batch
            None => self.base_get(key)?.unwrap_or_default(),
        };
        extend(&mut value);
        self.write(key, Some(value));
        Ok(())
    }

    fn recall(&mut self, range: &KeyRange) -> Option<Decoded> {
        if let Some((_, value)) = self.remembered.iter().find(|(r, _)| r == range) {
            return Some(Arc::clone(value));
        }
        // Every write forgets what the memo held of its key's range.
        self.memo.as_deref()?.get(range)
    }

    fn remember(&mut self, range: &KeyRange, value: Decoded) {
        if self.memo.is_some() {
            self.remembered.retain(|(r, _)| r != range);
            self.remembered.push((range.clone(), value));
        }
    }

    fn require_durable(&mut self) {
        self.durable_required = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::tests::MapRead;

    /// A batch that scans from thousands of starts (a clean scans each job's
    /// logs and children) keeps only the latest used few: looking through
    /// all of them at every scan and put made a clean of 40,000 jobs take
    /// 53 s. A start scanned again and again stays remembered.
    #[test]
    fn an_overlay_remembers_few_scan_starts_and_keeps_the_busy_one() {
        let base: BTreeMap<Key, Value> = (0u16..2000).map(|k| (k.to_be_bytes().to_vec(), vec![1])).collect();
        let mut reader = MapRead(base);
        let mut overlay = Overlay::new(&mut reader);
        let busy = KeyRange::new(vec![0, 0], vec![0xff, 0xff]);
        for k in 0u16..2000 {
            let start = k.to_be_bytes().to_vec();
            let end = (k + 1).to_be_bytes().to_vec();
            overlay.scan(&KeyRange::new(start, end), 1, false).unwrap();
            overlay.scan(&busy, 1, false).unwrap();
            assert!(overlay.empty.len() <= EMPTY_RANGES_KEPT);
        }
        assert!(overlay.empty.iter().any(|(start, _)| *start == busy.start));
    }
}
