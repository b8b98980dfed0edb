//! The batches handed over and not yet committed, and the view of them over
//! the snapshot that the executor and readers read through.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::merge::{local_range, scan_under};
use super::{Key, KeyRange, KvRead, Value, Writes};
use crate::error::StoreError;

/// The batches that ran but whose commit is not done yet, oldest first, each
/// batch's writes where they are, and the scan floors of each over what lies
/// below it. The executor runs every batch over them (see [`Stacked`]).
/// Merged into one map, every write went into it as its batch was handed
/// over and out again once committed: a fifth of the executor's instructions
/// at concurrency 100, where one to three batches are pending at a time.
#[derive(Default)]
pub struct PendingBatches {
    numbers: Vec<u64>,
    writes: Vec<Arc<Writes>>,
    /// Per batch, as in [`Overlay`]: every lease's scan of the waiting index
    /// would otherwise read again the heads that the batches in flight deleted.
    /// What lies below a batch changes only when the oldest batch is done
    /// with: committed, the snapshot reads as it did with the batch on top;
    /// failed, it does not, and neither can the batches above, which fail
    /// with it. Both drop every floor, as the merged map's commit did.
    floors: Vec<BTreeMap<Key, Key>>,
}

impl PendingBatches {
    pub fn push(&mut self, number: u64, writes: Arc<Writes>) {
        self.numbers.push(number);
        self.writes.push(writes);
        self.floors.push(BTreeMap::new());
    }

    /// The oldest batch's number.
    pub fn oldest(&self) -> Option<u64> {
        self.numbers.first().copied()
    }

    /// The newest batch's number.
    pub fn newest(&self) -> Option<u64> {
        self.numbers.last().copied()
    }

    /// Forgets the oldest batch: once committed the base has its writes; once
    /// it failed, nobody may read them.
    pub fn forget_oldest(&mut self) {
        if self.numbers.is_empty() {
            return;
        }
        self.numbers.remove(0);
        self.writes.remove(0);
        self.floors.remove(0);
        self.floors.iter_mut().for_each(BTreeMap::clear);
    }

    pub fn len(&self) -> usize {
        self.numbers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.numbers.is_empty()
    }

    /// The batches over `base`, the snapshot they are not in yet, keeping
    /// their scan floors.
    pub fn over<'a>(&'a mut self, base: &'a mut dyn KvRead) -> Stacked<'a> {
        Stacked { batches: &self.writes, floors: &mut self.floors, base }
    }
}

/// The writes of several batches (oldest first) over a base they are not in
/// yet: what a reader sees of batches on their way into the file, and what the
/// executor's next batch runs over. Each batch's writes are read where they
/// are, not merged into one map first.
pub struct Stacked<'a> {
    batches: &'a [Arc<Writes>],
    /// Each batch's scan floors, when the view is kept for more than one read
    /// ([`PendingBatches::over`]); else none.
    floors: &'a mut [BTreeMap<Key, Key>],
    base: &'a mut dyn KvRead,
}

impl<'a> Stacked<'a> {
    /// A view for one read, which keeps no scan floors.
    pub fn new(batches: &'a [Arc<Writes>], base: &'a mut dyn KvRead) -> Self {
        Self { batches, floors: &mut [], base }
    }
}

impl KvRead for Stacked<'_> {
    fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        match self.batches.iter().rev().find_map(|writes| writes.get(key)) {
            Some(v) => Ok(v.clone()),
            None => self.base.get(key),
        }
    }

    fn scan(&mut self, range: &KeyRange, limit: usize, reverse: bool) -> Result<Vec<(Key, Value)>, StoreError> {
        let Some((newest, older)) = self.batches.split_last() else {
            return self.base.scan(range, limit, reverse);
        };
        let mut none = BTreeMap::new();
        let (floors, older_floors) = match self.floors.split_last_mut() {
            Some((floors, older_floors)) => (floors, older_floors),
            None => (&mut none, &mut [][..]),
        };
        let mut below = Stacked { batches: older, floors: older_floors, base: &mut *self.base };
        scan_under(local_range(newest, range, reverse), floors, &mut below, range, limit, reverse)
    }
}
