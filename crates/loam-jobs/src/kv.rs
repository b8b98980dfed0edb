//! The ordered, transactional key-value interface every engine implements.
//!
//! The queue logic is written once against [`KvTxn`]; redb runs it now, TiKV and
//! etcd run the same code later. The interface is deliberately the intersection
//! of what those stores offer: point reads, a locking read, puts, deletes and a
//! bounded range scan, all inside one transaction that commits or leaves nothing.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::Arc;

use crate::error::StoreError;

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

    fn get(&self, range: &KeyRange) -> Option<Decoded> {
        match self.entries.get(&range.start) {
            Some((end, value)) if *end == range.end => Some(Arc::clone(value)),
            _ => None,
        }
    }

    fn forget_key(&mut self, key: &[u8]) {
        let holder = self.entries.range::<[u8], _>((Bound::Unbounded, Bound::Included(key))).next_back();
        if let Some((start, _)) = holder.filter(|(_, (end, _))| key < end.as_slice()) {
            let start = start.clone();
            self.entries.remove(&start);
        }
    }

    fn insert(&mut self, range: KeyRange, value: Decoded) {
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

/// Which side the next entry of a merge comes from.
enum Take {
    Local,
    Base,
    /// The write, over the base entry with its key.
    Shadowed,
}

/// Merges writes (in scan order, `None` = deleted) over base entries (in scan
/// order), up to `limit` entries. Also returns the last base key of the
/// leading run of base entries that the writes shadow (forward scans only),
/// which is what scan floors are made of. Base entries are moved, not copied:
/// every layer of a lease's scan passes its result up through here.
fn merge(
    local: &[(&Key, &Option<Value>)],
    base: Vec<(Key, Value)>,
    limit: usize,
    reverse: bool,
) -> (Vec<(Key, Value)>, Option<Key>) {
    let before = |a: &[u8], b: &[u8]| if reverse { a > b } else { a < b };
    let mut out = Vec::with_capacity(limit.min(base.len() + local.len()));
    let mut base = base.into_iter().peekable();
    let mut local = local.iter().peekable();
    let mut shadowed_prefix: Option<Key> = None;
    let mut prefix_open = !reverse;
    while out.len() < limit {
        let take = match (base.peek(), local.peek()) {
            (Some((bk, _)), Some((lk, _))) if bk == *lk => Take::Shadowed,
            (Some((bk, _)), Some((lk, _))) if before(lk, bk) => Take::Local,
            (Some(_), _) => Take::Base,
            (None, Some(_)) => Take::Local,
            (None, None) => break,
        };
        if let Take::Base = take {
            prefix_open = false;
            out.extend(base.next());
            continue;
        }
        if let Take::Shadowed = take
            && let Some((bk, _)) = base.next()
            && prefix_open
        {
            shadowed_prefix = Some(bk);
        }
        if let Some((k, Some(v))) = local.next() {
            out.push(((*k).clone(), v.clone()));
        }
    }
    (out, shadowed_prefix)
}

/// Scans `base` under `local`, the writes over it in `range` (in scan order):
/// a forward scan reads the base from the floor remembered for its start, and
/// remembers a higher one when the writes shadow the base entries it reads
/// first. A floor says every base key in `[start, floor)` has a write over it,
/// so it holds while the base stays the same and no write is taken back.
fn scan_under(
    local: Vec<(&Key, &Option<Value>)>,
    floors: &mut BTreeMap<Key, Key>,
    base: &mut dyn KvRead,
    range: &KeyRange,
    limit: usize,
    reverse: bool,
) -> Result<Vec<(Key, Value)>, StoreError> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    if local.is_empty() {
        return base.scan(range, limit, reverse);
    }
    let floor = if reverse { None } else { floors.get(&range.start) };
    let floored;
    let base_range = match floor {
        Some(f) => {
            floored = KeyRange::new(f.min(&range.end).clone(), range.end.clone());
            &floored
        }
        None => range,
    };
    // Only a delete can hide a base entry (a put over one replaces it one for
    // one), so asking the base for `limit + hiding` entries always yields
    // enough survivors. Counting every write asked a lease's scan, under the
    // jobs added by the batches in flight, for hundreds of entries it dropped.
    let hiding = local.iter().filter(|(k, v)| v.is_none() && floor.is_none_or(|f| *k >= f)).count();
    let base = base.scan(base_range, limit.saturating_add(hiding), reverse)?;
    let (out, shadowed) = merge(&local, base, limit, reverse);
    if let Some(mut next) = shadowed {
        next.push(0); // the smallest key after the last shadowed one
        floors.insert(range.start.clone(), next);
    }
    Ok(out)
}

fn local_range<'w>(writes: &'w Writes, range: &KeyRange, reverse: bool) -> Vec<(&'w Key, &'w Option<Value>)> {
    let entries = writes.range::<[u8], _>(bounds(range));
    if reverse { entries.rev().collect() } else { entries.collect() }
}

/// `range` as bounds a map of keys takes, borrowed: a scan passes through
/// several maps, and cloning the bounds for each cost two allocations.
fn bounds(range: &KeyRange) -> (Bound<&[u8]>, Bound<&[u8]>) {
    (Bound::Included(&range.start), Bound::Excluded(&range.end))
}

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

    /// A generated batch (one-byte keys and values) as writes.
    fn writes_of(batch: BTreeMap<u8, Option<u8>>) -> Writes {
        batch.into_iter().map(|(k, v)| (vec![k], v.map(|v| vec![v]))).collect()
    }

    fn apply(map: &mut BTreeMap<Key, Value>, writes: &Writes) {
        for (k, v) in writes {
            match v {
                Some(v) => {
                    map.insert(k.clone(), v.clone());
                }
                None => {
                    map.remove(k);
                }
            }
        }
    }

    /// `reader` scans `range` as `expected` does, and gets every one-byte key as it has it.
    fn reads_match(
        reader: &mut dyn KvRead,
        expected: &BTreeMap<Key, Value>,
        range: KeyRange,
        limit: usize,
        rev: bool,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        let got = reader.scan(&range, limit, rev).unwrap();
        let want = MapRead(expected.clone()).scan(&range, limit, rev).unwrap();
        proptest::prop_assert_eq!(got, want, "scan {:?}", range);
        for k in 0u8..32 {
            proptest::prop_assert_eq!(reader.get(&[k]).unwrap(), expected.get(&vec![k]).cloned(), "get {}", k);
        }
        Ok(())
    }

    #[derive(Debug, Clone)]
    enum Step {
        Put(u8, u8),
        Delete(u8),
        /// A byte appended to the key's value.
        Append(u8, u8),
        Scan {
            lo: u8,
            width: u8,
            limit: usize,
            rev: bool,
        },
    }

    impl Step {
        fn writes(&self) -> bool {
            !matches!(self, Step::Scan { .. })
        }
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            (0u8..32, 0u8..4).prop_map(|(k, v)| Step::Put(k, v)),
            (0u8..32).prop_map(Step::Delete),
            (0u8..32, 0u8..4).prop_map(|(k, v)| Step::Append(k, v)),
            (0u8..8, 0u8..40, 0usize..12, any::<bool>()).prop_map(|(lo, width, limit, rev)| Step::Scan {
                lo,
                width,
                limit,
                rev
            }),
        ]
    }

    /// Takes `step` in `overlay` and in `model` (the reads it should give);
    /// a scan must read as the model does.
    fn run_step(
        overlay: &mut Overlay,
        model: &mut BTreeMap<Key, Value>,
        step: Step,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        match step {
            Step::Put(k, v) => {
                overlay.put(&[k], vec![v]).unwrap();
                model.insert(vec![k], vec![v]);
            }
            Step::Delete(k) => {
                overlay.delete(&[k]).unwrap();
                model.remove(&vec![k]);
            }
            Step::Append(k, v) => {
                overlay.append(&[k], &mut |value| value.push(v)).unwrap();
                model.entry(vec![k]).or_default().push(v);
            }
            Step::Scan { lo, width, limit, rev } => {
                let range = KeyRange::new(vec![lo], vec![lo.saturating_add(width)]);
                let got = overlay.scan(&range, limit, rev).unwrap();
                let want = MapRead(model.clone()).scan(&range, limit, rev).unwrap();
                proptest::prop_assert_eq!(got, want, "scan {:?}", range);
            }
        }
        Ok(())
    }

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

    proptest::proptest! {
        /// The net writes of several sets are each key once, ascending, with
        /// the last set's write of it: what applying the sets in order leaves.
        #[test]
        fn net_writes_are_the_sets_applied_in_order(
            sets in proptest::collection::vec(
                proptest::collection::btree_map(0u8..24, proptest::option::of(0u8..4), 0..12),
                0..8,
            ),
        ) {
            let sets: Vec<Writes> = sets.into_iter().map(writes_of).collect();
            let mut applied = Writes::new();
            for set in &sets {
                applied.extend(set.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
            let net: Vec<_> = net_writes(&sets).collect();
            let want: Vec<_> = applied.iter().collect();
            proptest::prop_assert_eq!(net, want);
        }
    }

    proptest::proptest! {
        /// Every scan through an overlay, interleaved with writes (so the scan
        /// floors come into play), equals a scan of the base with the writes applied.
        #[test]
        fn overlay_scans_match_applied_map(
            base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..24),
            steps in proptest::collection::vec(step(), 0..40),
        ) {
            let base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
            let mut expected = base.clone();
            let mut reader = MapRead(base);
            let mut overlay = Overlay::new(&mut reader);
            for s in steps {
                run_step(&mut overlay, &mut expected, s)?;
            }
        }
    }

    proptest::proptest! {
        /// Batches stacked over a base read like the base with every batch
        /// applied in order.
        #[test]
        fn stacked_batches_read_like_the_applied_map(
            base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..24),
            batches in proptest::collection::vec(
                proptest::collection::btree_map(0u8..32, proptest::option::of(0u8..4), 0..12), 0..6),
            lo in 0u8..32, width in 0u8..40, limit in 0usize..40, rev in proptest::bool::ANY,
        ) {
            let base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
            let mut expected = base.clone();
            let batches: Vec<Arc<Writes>> = batches.into_iter().map(|b| Arc::new(writes_of(b))).collect();
            for writes in &batches {
                apply(&mut expected, writes);
            }
            let mut below = MapRead(base);
            let mut stacked = Stacked::new(&batches, &mut below);
            reads_match(&mut stacked, &expected, KeyRange::new(vec![lo], vec![lo.saturating_add(width)]), limit, rev)?;
        }
    }

    proptest::proptest! {
        /// A batch of operations in one overlay, some failing: every read
        /// (gets, and forward scans, whose floors a failed operation may have
        /// raised) sees the base with the successful operations' writes and
        /// the failing one's own so far, and the batch's writes are the
        /// successful operations' alone.
        #[test]
        fn a_failed_operation_is_taken_back_whole(
            base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..24),
            ops in proptest::collection::vec((proptest::collection::vec(step(), 0..10), proptest::bool::ANY), 0..10),
        ) {
            let base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
            let mut kept = base.clone();
            let mut reader = MapRead(base.clone());
            let mut overlay = Overlay::caching(&mut reader);
            for (steps, succeeds) in ops {
                let mut now = kept.clone();
                let writes = steps.iter().any(Step::writes);
                for step in steps {
                    run_step(&mut overlay, &mut now, step)?;
                    reads_match(&mut overlay, &now, KeyRange::new(vec![0], vec![32]), 32, false)?;
                }
                proptest::prop_assert_eq!(overlay.end_operation(succeeds).wrote, writes, "whether it wrote");
                if succeeds {
                    kept = now;
                }
                reads_match(&mut overlay, &kept, KeyRange::new(vec![0], vec![32]), 32, false)?;
            }
            let mut applied = base;
            apply(&mut applied, &overlay.into_writes());
            proptest::prop_assert_eq!(applied, kept);
        }
    }

    proptest::proptest! {
        /// Scans through a read-ahead reader, in any order and of any
        /// ranges, read as the base does.
        #[test]
        fn read_ahead_scans_read_like_the_base(
            base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..32),
            extra in 0usize..6,
            scans in proptest::collection::vec((0u8..32, 0u8..40, 0usize..6, proptest::bool::ANY), 0..30),
        ) {
            let base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
            let mut ahead = ReadAhead::new(MapRead(base.clone()), extra);
            for (lo, width, limit, rev) in scans {
                // Ends from a few values, so that ranges share them.
                let range = KeyRange::new(vec![lo], vec![(lo.saturating_add(width) / 8 * 8).max(lo)]);
                reads_match(&mut ahead, &base, range, limit, rev)?;
            }
        }
    }

    #[derive(Debug, Clone)]
    enum MemoStep {
        Put(u8, u8),
        Delete(u8),
        Remember(usize),
        Recall(usize),
    }

    /// Overlapping on purpose: a range that would overlap a remembered one
    /// must not be remembered, or a write could miss forgetting it.
    const MEMO_RANGES: [(u8, u8); 5] = [(0, 4), (4, 8), (2, 6), (8, 9), (9, 16)];

    fn memo_step() -> impl proptest::strategy::Strategy<Value = MemoStep> {
        use proptest::prelude::*;
        prop_oneof![
            (0u8..16, 0u8..4).prop_map(|(k, v)| MemoStep::Put(k, v)),
            (0u8..16).prop_map(MemoStep::Delete),
            (0..MEMO_RANGES.len()).prop_map(MemoStep::Remember),
            (0..MEMO_RANGES.len()).prop_map(MemoStep::Recall),
        ]
    }

    proptest::proptest! {
        /// In a batch of operations (some failing, so their writes and what
        /// they remembered are dropped), whatever an operation recalls of a
        /// range is what the range holds as it reads it then.
        #[test]
        fn recalled_values_match_what_the_range_holds(
            base in proptest::collection::btree_map(0u8..16, 0u8..4, 0..12),
            batches in proptest::collection::vec(
                proptest::collection::vec((proptest::collection::vec(memo_step(), 0..12), proptest::bool::ANY), 0..8),
                0..5,
            ),
        ) {
            // One memo for every batch, as the executor keeps it; each batch
            // is committed to the base before the next runs.
            let mut base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
            let mut memo = Memo::default();
            for ops in batches {
                let mut reader = MapRead(base.clone());
                let mut local = Overlay::caching(&mut reader).remembering(&mut memo);
                for (steps, succeeds) in ops {
                    for step in steps {
                        match step {
                            MemoStep::Put(k, v) => local.put(&[k], vec![v]).unwrap(),
                            MemoStep::Delete(k) => local.delete(&[k]).unwrap(),
                            MemoStep::Remember(r) => {
                                let range = KeyRange::new(vec![MEMO_RANGES[r].0], vec![MEMO_RANGES[r].1]);
                                let now = local.scan(&range, usize::MAX, false).unwrap();
                                local.remember(&range, Arc::new(now));
                            }
                            MemoStep::Recall(r) => {
                                let range = KeyRange::new(vec![MEMO_RANGES[r].0], vec![MEMO_RANGES[r].1]);
                                if let Some(known) = local.recall(&range) {
                                    let known = known.downcast::<Vec<(Key, Value)>>().unwrap();
                                    let now = local.scan(&range, usize::MAX, false).unwrap();
                                    proptest::prop_assert_eq!(known.as_ref(), &now, "recall of {:?}", range);
                                }
                            }
                        }
                    }
                    local.end_operation(succeeds);
                }
                let writes = local.into_writes();
                apply(&mut base, &writes);
            }
        }
    }

    proptest::proptest! {
        /// Pending batches over a base that has the committed batches' writes
        /// read like the base with every batch applied.
        #[test]
        fn pending_batches_read_like_the_applied_map(
            base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..24),
            batches in proptest::collection::vec(
                proptest::collection::btree_map(0u8..32, proptest::option::of(0u8..4), 0..12), 0..5),
            committed in 0usize..5,
            lo in 0u8..32, width in 0u8..40, limit in 0usize..40, rev in proptest::bool::ANY,
        ) {
            let batches: Vec<Writes> = batches.into_iter().map(writes_of).collect();
            let committed = committed.min(batches.len());
            let mut base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
            let mut expected = base.clone();
            let mut pending = PendingBatches::default();
            for (n, writes) in batches.iter().enumerate() {
                pending.push(n as u64 + 1, Arc::new(writes.clone()));
                apply(&mut expected, writes);
                if n < committed {
                    apply(&mut base, writes);
                }
            }
            for _ in 0..committed {
                pending.forget_oldest();
            }
            let mut below = MapRead(base);
            reads_match(&mut pending.over(&mut below), &expected, KeyRange::new(vec![lo], vec![lo.saturating_add(width)]), limit, rev)?;
        }
    }

    #[derive(Debug, Clone)]
    enum Life {
        /// A batch of writes runs (through a layer) and is handed over.
        Run(BTreeMap<u8, Option<u8>>),
        /// The oldest batch in flight reaches the base.
        Commit,
        Scan {
            lo: u8,
            width: u8,
            limit: usize,
        },
    }

    fn life() -> impl proptest::strategy::Strategy<Value = Life> {
        use proptest::prelude::*;
        prop_oneof![
            proptest::collection::btree_map(0u8..32, proptest::option::weighted(0.3, 0u8..4), 0..6).prop_map(Life::Run),
            Just(Life::Commit),
            (0u8..8, 0u8..40, 1usize..6).prop_map(|(lo, width, limit)| Life::Scan { lo, width, limit }),
        ]
    }

    proptest::proptest! {
        /// The executor's life: batches handed over one after another, forward
        /// scans between them (as leases read the head of the waiting index,
        /// mostly deleted by the batches in flight), the oldest batch committed
        /// into the base now and then. The batches' floors outlive a scan but
        /// not a commit; every scan and get reads like the base with every
        /// batch applied.
        #[test]
        fn pending_reads_stay_right_across_batches_and_commits(
            base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..32),
            steps in proptest::collection::vec(life(), 0..60),
        ) {
            let apply = |map: &mut BTreeMap<Key, Value>, writes: &Writes| {
                for (k, v) in writes {
                    match v { Some(v) => { map.insert(k.clone(), v.clone()); } None => { map.remove(k); } }
                }
            };
            let mut base = MapRead(base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect());
            let mut expected = base.0.clone();
            let mut pending = PendingBatches::default();
            let mut in_flight = std::collections::VecDeque::new();
            let mut number = 0;
            for step in steps {
                match step {
                    Life::Run(writes) => {
                        let writes: Writes = writes.into_iter().map(|(k, v)| (vec![k], v.map(|v| vec![v]))).collect();
                        number += 1;
                        pending.push(number, Arc::new(writes.clone()));
                        apply(&mut expected, &writes);
                        in_flight.push_back(writes);
                    }
                    Life::Commit => {
                        if let Some(writes) = in_flight.pop_front() {
                            apply(&mut base.0, &writes);
                            pending.forget_oldest();
                        }
                    }
                    Life::Scan { lo, width, limit } => {
                        let range = KeyRange::new(vec![lo], vec![lo.saturating_add(width)]);
                        let got = pending.over(&mut base).scan(&range, limit, false).unwrap();
                        let want = MapRead(expected.clone()).scan(&range, limit, false).unwrap();
                        proptest::prop_assert_eq!(got, want, "scan {:?}", range);
                    }
                }
                for k in 0u8..32 {
                    let got = pending.over(&mut base).get(&[k]).unwrap();
                    proptest::prop_assert_eq!(got, expected.get(&vec![k]).cloned());
                }
            }
        }
    }
}
