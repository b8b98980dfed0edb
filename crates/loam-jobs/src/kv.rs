//! The ordered, transactional key-value interface every engine implements.
//!
//! The queue logic is written once against [`KvTxn`]; redb runs it now, TiKV and
//! etcd run the same code later. The interface is deliberately the intersection
//! of what those stores offer: point reads, a locking read, puts, deletes and a
//! bounded range scan, all inside one transaction that commits or leaves nothing.

use std::collections::BTreeMap;
use std::ops::Bound;

use crate::error::StoreError;

pub type Key = Vec<u8>;
pub type Value = Vec<u8>;

/// A half-open key range `[start, end)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRange {
    pub start: Key,
    pub end: Key,
}

impl KeyRange {
    pub fn new(start: Key, end: Key) -> Self {
        Self { start, end }
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        key >= self.start.as_slice() && key < self.end.as_slice()
    }
}

pub trait KvRead {
    fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError>;

    /// At most `limit` entries in `range`, ascending, or descending when `reverse`.
    fn scan(
        &mut self,
        range: &KeyRange,
        limit: usize,
        reverse: bool,
    ) -> Result<Vec<(Key, Value)>, StoreError>;
}

pub trait KvTxn: KvRead {
    /// A read that also locks the key until the transaction ends. Engines with a
    /// single writer get this for free; pessimistic engines lock the key.
    fn get_for_update(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        self.get(key)
    }
    fn put(&mut self, key: &[u8], value: Value) -> Result<(), StoreError>;
    fn delete(&mut self, key: &[u8]) -> Result<(), StoreError>;
}

/// Uncommitted writes layered over a base reader. Group commit runs every
/// operation in its own overlay over the batch's overlay, so a failed operation
/// is dropped whole while the others in its batch still commit, and hot keys
/// written by many operations of one batch reach the engine once.
pub struct Overlay<'a> {
    base: &'a mut dyn KvRead,
    writes: BTreeMap<Key, Option<Value>>,
}

impl<'a> Overlay<'a> {
    pub fn new(base: &'a mut dyn KvRead) -> Self {
        Self { base, writes: BTreeMap::new() }
    }

    pub fn into_writes(self) -> BTreeMap<Key, Option<Value>> {
        self.writes
    }

    pub fn absorb(&mut self, writes: BTreeMap<Key, Option<Value>>) {
        self.writes.extend(writes);
    }
}

impl KvRead for Overlay<'_> {
    fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        match self.writes.get(key) {
            Some(v) => Ok(v.clone()),
            None => self.base.get(key),
        }
    }

    fn scan(
        &mut self,
        range: &KeyRange,
        limit: usize,
        reverse: bool,
    ) -> Result<Vec<(Key, Value)>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let bounds = (Bound::Included(range.start.clone()), Bound::Excluded(range.end.clone()));
        let local: Vec<(&Key, &Option<Value>)> = if reverse {
            self.writes.range(bounds).rev().collect()
        } else {
            self.writes.range(bounds).collect()
        };
        if local.is_empty() {
            return self.base.scan(range, limit, reverse);
        }
        // Every local write may hide one base entry, so asking the base for
        // `limit + local.len()` entries always yields enough survivors.
        let base = self.base.scan(range, limit.saturating_add(local.len()), reverse)?;
        let before = |a: &[u8], b: &[u8]| if reverse { a > b } else { a < b };
        let mut out = Vec::with_capacity(limit.min(base.len() + local.len()));
        let (mut i, mut j) = (0, 0);
        while out.len() < limit && (i < base.len() || j < local.len()) {
            let take_local = match (base.get(i), local.get(j)) {
                (Some((bk, _)), Some((lk, _))) => {
                    if bk == *lk {
                        i += 1; // the local write shadows the base entry
                        true
                    } else {
                        before(lk, bk)
                    }
                }
                (None, Some(_)) => true,
                _ => false,
            };
            if take_local {
                let (k, v) = local[j];
                j += 1;
                if let Some(v) = v {
                    out.push((k.clone(), v.clone()));
                }
            } else {
                out.push(base[i].clone());
                i += 1;
            }
        }
        Ok(out)
    }
}

impl KvTxn for Overlay<'_> {
    fn put(&mut self, key: &[u8], value: Value) -> Result<(), StoreError> {
        self.writes.insert(key.to_vec(), Some(value));
        Ok(())
    }

    fn delete(&mut self, key: &[u8]) -> Result<(), StoreError> {
        self.writes.insert(key.to_vec(), None);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct MapRead(BTreeMap<Key, Value>);
    impl KvRead for MapRead {
        fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
            Ok(self.0.get(key).cloned())
        }
        fn scan(&mut self, r: &KeyRange, limit: usize, rev: bool) -> Result<Vec<(Key, Value)>, StoreError> {
            let it = self.0.range(r.start.clone()..r.end.clone()).map(|(k, v)| (k.clone(), v.clone()));
            Ok(if rev { it.rev().take(limit).collect() } else { it.take(limit).collect() })
        }
    }

    proptest::proptest! {
        /// A scan through an overlay equals a scan of the base with the writes applied.
        #[test]
        fn overlay_scan_matches_applied_map(
            base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..20),
            writes in proptest::collection::vec((0u8..32, proptest::option::of(0u8..4)), 0..20),
            lo in 0u8..32, width in 0u8..32, limit in 0usize..40, rev in proptest::bool::ANY,
        ) {
            let base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
            let mut expected = base.clone();
            for (k, v) in &writes {
                match v { Some(v) => { expected.insert(vec![*k], vec![*v]); } None => { expected.remove(&vec![*k]); } }
            }
            let mut reader = MapRead(base);
            let mut overlay = Overlay::new(&mut reader);
            for (k, v) in &writes {
                match v { Some(v) => overlay.put(&[*k], vec![*v]).unwrap(), None => overlay.delete(&[*k]).unwrap() }
            }
            let range = KeyRange::new(vec![lo], vec![lo.saturating_add(width)]);
            let got = overlay.scan(&range, limit, rev).unwrap();
            let mut want = MapRead(expected).scan(&range, limit, rev).unwrap();
            want.truncate(limit);
            proptest::prop_assert_eq!(got, want);
        }
    }
}
