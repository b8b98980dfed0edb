//! The net effect of several batches' writes, merged in key order.

use super::{Key, Value, Writes};

/// The net effect of write sets applied in order: each key once, in key
/// order, with its last set's write. A group of batches is logged and written
/// to redb this way, not batch after batch: one-at-a-time adds, a batch each,
/// rewrite the same event page and counters in every batch, and applied one by
/// one a group of them wrote its page and counters again for each add.
pub fn net_writes<'a>(sets: impl IntoIterator<Item = &'a Writes>) -> NetWrites<'a> {
    let mut sets: Vec<_> = sets.into_iter().map(|writes| writes.iter()).collect();
    let mut heads = std::collections::BinaryHeap::with_capacity(sets.len());
    for (set, writes) in sets.iter_mut().enumerate() {
        if let Some((key, value)) = writes.next() {
            heads.push(Head { key, value, set });
        }
    }
    NetWrites { sets, heads }
}

/// See [`net_writes`]: a merge of the sets' sorted writes.
pub struct NetWrites<'a> {
    sets: Vec<std::collections::btree_map::Iter<'a, Key, Option<Value>>>,
    heads: std::collections::BinaryHeap<Head<'a>>,
}

/// A set's next write; the greatest head is the smallest key, and among equal
/// keys the latest set's.
struct Head<'a> {
    key: &'a Key,
    value: &'a Option<Value>,
    set: usize,
}

impl PartialEq for Head<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl Eq for Head<'_> {}

impl PartialOrd for Head<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Head<'_> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.key.cmp(self.key).then(self.set.cmp(&other.set))
    }
}

impl<'a> NetWrites<'a> {
    fn advance(&mut self, set: usize) {
        if let Some((key, value)) = self.sets[set].next() {
            self.heads.push(Head { key, value, set });
        }
    }
}

impl<'a> Iterator for NetWrites<'a> {
    type Item = (&'a Key, &'a Option<Value>);

    fn next(&mut self) -> Option<Self::Item> {
        let newest = self.heads.pop()?;
        self.advance(newest.set);
        // Older sets' writes of the same key are overwritten.
        while self.heads.peek().is_some_and(|older| older.key == newest.key) {
            if let Some(older) = self.heads.pop() {
                self.advance(older.set);
            }
        }
        Some((newest.key, newest.value))
    }
}
