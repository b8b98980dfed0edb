//! The ordered, transactional key-value interface every engine implements.
//!
//! The queue logic is written once against [`KvTxn`]; redb runs it now, TiKV and
//! etcd run the same code later. The interface is deliberately the intersection
//! of what those stores offer: point reads, a locking read, puts, deletes and a
//! bounded range scan, all inside one transaction that commits or leaves nothing.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::StoreError;

mod memo;
mod merge;
mod net_writes;
mod overlay;
mod pending;
mod read_ahead;
#[cfg(test)]
mod tests;

pub use memo::Memo;
pub use net_writes::{NetWrites, net_writes};
pub use overlay::{OperationEnd, Overlay};
pub use pending::{PendingBatches, Stacked};
pub use read_ahead::ReadAhead;

pub type Key = Vec<u8>;
pub type Value = Vec<u8>;
/// Net writes to apply in key order: `None` deletes the key.
pub type Writes = BTreeMap<Key, Option<Value>>;

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
    fn scan(&mut self, range: &KeyRange, limit: usize, reverse: bool) -> Result<Vec<(Key, Value)>, StoreError>;
}

pub trait KvTxn: KvRead {
    /// A read that also locks the key until the transaction ends. Engines with a
    /// single writer get this for free; pessimistic engines lock the key.
    fn get_for_update(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        self.get(key)
    }
    fn put(&mut self, key: &[u8], value: Value) -> Result<(), StoreError>;
    fn delete(&mut self, key: &[u8]) -> Result<(), StoreError>;

    /// Lets `extend` add to the end of `key`'s value (an absent key's starts
    /// empty). An engine that holds the value may extend it where it is: a
    /// queue's event page grows by an event or two per operation, and read,
    /// copied and written back whole it was the largest cost of an add.
    fn append(&mut self, key: &[u8], extend: &mut dyn FnMut(&mut Value)) -> Result<(), StoreError> {
        let mut value = self.get(key)?.unwrap_or_default();
        extend(&mut value);
        self.put(key, value)
    }

    /// What was remembered of `range` (see [`KvTxn::remember`]) by this
    /// transaction or an earlier operation, if nothing in the range was
    /// written since. Engines without batches remember nothing.
    fn recall(&mut self, _range: &KeyRange) -> Option<Decoded> {
        None
    }

    /// Remembers `value` as what the keys in `range` hold now, decoded, so
    /// that later operations need not read and decode them again (every
    /// operation reads its queue's settings). A write in the range forgets it.
    fn remember(&mut self, _range: &KeyRange, _value: Decoded) {}

    /// The operation under way recorded an outcome, so its acknowledgement
    /// waits for its fsync even if it was submitted as one that needs none
    /// (a lease that failed a job on the way). Engines whose every commit is
    /// durable need nothing more.
    fn require_durable(&mut self) {}
}

/// A value decoded from what a range of keys holds (see [`KvTxn::remember`]).
pub type Decoded = Arc<dyn Any + Send + Sync>;
