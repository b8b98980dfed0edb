//! The embedded engine: one redb file, group commit, pipelined over two threads.
//!
//! Callers on any thread submit operations to a channel. The **executor**
//! thread takes every operation waiting there (a batch), runs each in its own
//! [`Overlay`] over the batch's overlay (so a failed operation leaves nothing
//! behind), and hands the batch's net writes to the **committer** thread,
//! which writes them into one redb transaction, commits it with one fsync, and
//! only then acknowledges the batch's operations. Under relaxed durability the
//! operations are acknowledged as soon as their batch is handed over instead,
//! and reads wait for that batch's commit, so nobody reads older state than
//! they were told of.
//!
//! The two threads overlap: while batch N is written and fsynced, batch N+1
//! runs on top of N's writes (a [`Layer`] over the last committed snapshot).
//! At most one batch is being committed while the next one runs. If a commit
//! fails, the batch that ran on top of it fails too, since what it read never
//! reached the store.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::{Durability, OpDone, OpOutput, Store, WriteOp};
use crate::error::{JobsError, StoreError};
use crate::kv::{Key, KeyRange, KvRead, Layer, Overlay, Value};

const TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("loam_jobs");

/// Most operations one batch takes; bounds the latency a large backlog adds
/// to the first operation of a batch.
const MAX_BATCH: usize = 4096;

/// How long non-durable commits (leases) may stay unflushed under immediate
/// durability, when no durable commit comes along to carry them.
const IMMEDIATE_MODE_IDLE_FLUSH: Duration = Duration::from_millis(100);

type Writes = BTreeMap<Key, Option<Value>>;
/// An operation's completion and its result, to be delivered after the commit.
type Ack = (OpDone, Result<OpOutput, JobsError>);
type RawEntry<'a> = (redb::AccessGuard<'a, &'static [u8]>, redb::AccessGuard<'a, &'static [u8]>);

fn io<E: std::fmt::Display>(e: E) -> StoreError {
    StoreError::Io(e.to_string())
}

pub struct RedbOptions {
    pub durability: Durability,
    /// redb's page cache, in bytes.
    pub cache_size: usize,
}

impl Default for RedbOptions {
    fn default() -> Self {
        Self { durability: Durability::Immediate, cache_size: 256 << 20 }
    }
}

pub struct RedbStore {
    /// Taken by `close`, which releases the file for another opener.
    db: Mutex<Option<Arc<Database>>>,
    /// The committer's progress: reads start from its latest snapshot.
    progress: Arc<Progress>,
    sender: Mutex<Option<Sender<WriteOp>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl RedbStore {
    /// Opens (or creates) the store file at `path`.
    pub fn open(path: &Path, options: RedbOptions) -> Result<Self, StoreError> {
        let mut builder = Database::builder();
        builder.set_cache_size(options.cache_size);
        let db = builder.create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => StoreError::Locked(path.display().to_string()),
            other => io(other),
        })?;
        Self::start(db, options.durability)
    }

    /// A store that lives in memory only, for tests.
    pub fn in_memory() -> Result<Self, StoreError> {
        let db = Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .map_err(io)?;
        Self::start(db, Durability::Immediate)
    }

    fn start(db: Database, durability: Durability) -> Result<Self, StoreError> {
        let txn = db.begin_write().map_err(io)?;
        txn.open_table(TABLE).map_err(io)?;
        txn.commit().map_err(io)?;
        let db = Arc::new(db);
        let progress = Arc::new(Progress {
            state: Mutex::new(Committed { batch: 0, failed: None, acked: 0, snapshot: Arc::new(RedbSnapshot::new(&db)?) }),
            changed: Condvar::new(),
        });
        let (sender, receiver) = mpsc::channel();
        // Capacity 1: the executor hands over a batch only when the committer is free.
        let (to_committer, from_executor) = mpsc::sync_channel(1);
        let executor = Executor { progress: Arc::clone(&progress), to_committer, durability };
        let committer = Committer { db: Arc::clone(&db), progress: Arc::clone(&progress), durability, unflushed_since: None };
        let threads = vec![
            std::thread::Builder::new()
                .name("loam-jobs-writer".into())
                .spawn(move || executor.run(receiver))
                .map_err(io)?,
            std::thread::Builder::new()
                .name("loam-jobs-commit".into())
                .spawn(move || committer.run(from_executor))
                .map_err(io)?,
        ];
        Ok(Self { db: Mutex::new(Some(db)), progress, sender: Mutex::new(Some(sender)), threads: Mutex::new(threads) })
    }
}

impl Store for RedbStore {
    fn submit(&self, op: WriteOp) {
        let rejected = match self.sender.lock().as_ref() {
            Some(sender) => sender.send(op).err().map(|e| e.0),
            None => Some(op),
        };
        if let Some(op) = rejected {
            (op.done)(Err(StoreError::Closed.into()));
        }
    }

    /// The state as of the last acknowledged write: a write acknowledged
    /// before its commit (see [`Executor::ack_early`]) is waited for, so a
    /// caller always reads what it was told was written.
    fn snapshot(&self) -> Result<Box<dyn KvRead + Send>, StoreError> {
        if self.db.lock().is_none() {
            return Err(StoreError::Closed);
        }
        let mut state = self.progress.state.lock();
        while state.batch < state.acked {
            self.progress.changed.wait(&mut state);
        }
        Ok(Box::new(SnapshotReader(Arc::clone(&state.snapshot))))
    }

    fn close(&self) {
        drop(self.sender.lock().take());
        let threads = std::mem::take(&mut *self.threads.lock());
        for thread in threads {
            // The last handle can be dropped by an operation's completion
            // callback, which runs on the committer thread: that thread then
            // finishes its queue and flushes on its own.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
        drop(self.db.lock().take());
    }
}

impl Drop for RedbStore {
    fn drop(&mut self) {
        self.close();
    }
}

/// A committed state of the file.
struct RedbSnapshot {
    table: redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
}

impl RedbSnapshot {
    fn new(db: &Database) -> Result<Self, StoreError> {
        let txn = db.begin_read().map_err(io)?;
        Ok(Self { table: txn.open_table(TABLE).map_err(io)? })
    }

    fn get(&self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        Ok(self.table.get(key).map_err(io)?.map(|v| v.value().to_vec()))
    }
}

/// A shared snapshot as a reader.
struct SnapshotReader(Arc<RedbSnapshot>);

impl KvRead for SnapshotReader {
    fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        self.0.get(key)
    }
    fn scan(&mut self, range: &KeyRange, limit: usize, reverse: bool) -> Result<Vec<(Key, Value)>, StoreError> {
        scan_table(&self.0.table, range, limit, reverse)
    }
}

fn scan_table<T: ReadableTable<&'static [u8], &'static [u8]>>(
    table: &T,
    range: &KeyRange,
    limit: usize,
    reverse: bool,
) -> Result<Vec<(Key, Value)>, StoreError> {
    if range.start >= range.end || limit == 0 {
        return Ok(Vec::new());
    }
    let iter = table.range::<&[u8]>(range.start.as_slice()..range.end.as_slice()).map_err(io)?;
    let owned = |entry: Result<RawEntry<'_>, redb::StorageError>| {
        entry.map(|(k, v)| (k.value().to_vec(), v.value().to_vec())).map_err(io)
    };
    if reverse { iter.rev().take(limit).map(owned).collect() } else { iter.take(limit).map(owned).collect() }
}

/// What the committer has done, for the executor.
struct Progress {
    state: Mutex<Committed>,
    changed: Condvar,
}

struct Committed {
    /// The last batch the committer finished, committed or failed.
    batch: u64,
    /// The last batch whose commit failed, and why.
    failed: Option<(u64, StoreError)>,
    /// The last batch whose writes were acknowledged before their commit.
    acked: u64,
    /// The file as of the last successful commit.
    snapshot: Arc<RedbSnapshot>,
}

/// An executed batch on its way to the file.
struct Batch {
    number: u64,
    writes: Arc<Writes>,
    sync: bool,
    /// Acknowledgements that wait for the commit (the rest went out early).
    acks: Vec<Ack>,
}

struct Executor {
    progress: Arc<Progress>,
    to_committer: SyncSender<Batch>,
    durability: Durability,
}

impl Executor {
    fn run(self, receiver: Receiver<WriteOp>) {
        let mut in_flight: Option<(u64, Arc<Writes>)> = None;
        let mut number = 0;
        while let Ok(first) = receiver.recv() {
            let mut ops = vec![first];
            while ops.len() < MAX_BATCH {
                match receiver.try_recv() {
                    Ok(op) => ops.push(op),
                    Err(_) => break,
                }
            }
            number += 1;
            // A failed in-flight batch only matters to the batch that ran on
            // top of it; this one runs on the last good snapshot.
            let (snapshot, _) = self.view(&mut in_flight, false);
            let sync = match self.durability {
                Durability::Immediate => ops.iter().any(|op| op.sync),
                Durability::Relaxed { .. } => false,
            };
            let (writes, acks) = {
                let mut committed = SnapshotReader(snapshot);
                match &in_flight {
                    Some((_, below)) => execute(ops, &mut Layer { below: &mut committed, writes: below }),
                    None => execute(ops, &mut committed),
                }
            };
            // Hand over once the committer is done with the batch this one ran on.
            if in_flight.is_some() {
                let (_, failed) = self.view(&mut in_flight, true);
                if let Some(e) = failed {
                    for (done, _) in acks {
                        done(Err(JobsError::from(e.clone())));
                    }
                    continue;
                }
            }
            // Under relaxed durability, acknowledgements go out once the batch
            // is with the committer (a reader they wake then waits for that
            // commit, see `RedbStore::snapshot`). Under immediate durability
            // even leases wait for their commit: acknowledged early, a worker
            // would see a job before the producer saw its `add` resolve, which
            // BullMQ callers (and Redis, answering in order) never show.
            let (early, late) = match self.durability {
                Durability::Relaxed { .. } => (acks, Vec::new()),
                Durability::Immediate => (Vec::new(), acks),
            };
            if !early.is_empty() {
                self.progress.state.lock().acked = number;
            }
            let writes = Arc::new(writes);
            in_flight = Some((number, Arc::clone(&writes)));
            if let Err(mpsc::SendError(batch)) = self.to_committer.send(Batch { number, writes, sync, acks: late }) {
                for (done, _) in batch.acks.into_iter().chain(early) {
                    done(Err(StoreError::Closed.into()));
                }
                return;
            }
            for (done, result) in early {
                done(result);
            }
        }
    }

    /// The latest committed snapshot, dropping the in-flight batch once it is
    /// committed. With `wait`, first waits until the in-flight batch is done.
    /// Returns the error if the in-flight batch failed.
    fn view(&self, in_flight: &mut Option<(u64, Arc<Writes>)>, wait: bool) -> (Arc<RedbSnapshot>, Option<StoreError>) {
        let mut state = self.progress.state.lock();
        if wait && let Some((n, _)) = in_flight {
            while state.batch < *n {
                self.progress.changed.wait(&mut state);
            }
        }
        let mut failed = None;
        if let Some((n, _)) = in_flight
            && state.batch >= *n
        {
            if let Some((f, e)) = &state.failed
                && f == n
            {
                failed = Some(e.clone());
            }
            *in_flight = None;
        }
        (Arc::clone(&state.snapshot), failed)
    }
}

/// Runs a batch's operations, each in its own overlay over the batch's.
fn execute(ops: Vec<WriteOp>, base: &mut dyn KvRead) -> (Writes, Vec<Ack>) {
    let mut acks = Vec::with_capacity(ops.len());
    let mut group = Overlay::caching(base);
    for op in ops {
        let WriteOp { mut body, done, .. } = op;
        let mut local = Overlay::new(&mut group);
        // A bug in an operation must fail that operation, not the writer
        // thread and with it every caller (and a Node host).
        let result = catch_unwind(AssertUnwindSafe(|| body(&mut local)))
            .unwrap_or_else(|panic| Err(JobsError::Internal(panic_message(panic))));
        let local = local.into_writes();
        if result.is_ok() {
            group.absorb(local);
        }
        acks.push((done, result));
    }
    (group.into_writes(), acks)
}

struct Committer {
    db: Arc<Database>,
    progress: Arc<Progress>,
    durability: Durability,
    /// When the oldest commit not yet flushed to disk was made.
    unflushed_since: Option<Instant>,
}

impl Committer {
    fn flush_interval(&self) -> Duration {
        match self.durability {
            Durability::Immediate => IMMEDIATE_MODE_IDLE_FLUSH,
            Durability::Relaxed { flush_interval_ms } => Duration::from_millis(flush_interval_ms),
        }
    }

    fn run(mut self, receiver: Receiver<Batch>) {
        loop {
            let batch = match self.unflushed_since {
                None => match receiver.recv() {
                    Ok(b) => b,
                    Err(_) => break,
                },
                Some(since) => match receiver.recv_timeout(self.flush_interval().saturating_sub(since.elapsed())) {
                    Ok(b) => b,
                    Err(RecvTimeoutError::Timeout) => {
                        self.flush();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                },
            };
            self.commit(batch);
            if let Some(since) = self.unflushed_since
                && since.elapsed() >= self.flush_interval()
            {
                self.flush();
            }
        }
        self.flush();
    }

    /// An empty durable commit makes every earlier non-durable commit durable.
    fn flush(&mut self) {
        if self.unflushed_since.is_none() {
            return;
        }
        let result = self.db.begin_write().map_err(io).and_then(|t| t.commit().map_err(io));
        if result.is_ok() {
            self.unflushed_since = None;
        }
    }

    fn write(&self, writes: &Writes, sync: bool) -> Result<(), StoreError> {
        let mut txn = self.db.begin_write().map_err(io)?;
        txn.set_durability(if sync { redb::Durability::Immediate } else { redb::Durability::None }).map_err(io)?;
        {
            let mut table = txn.open_table(TABLE).map_err(io)?;
            for (key, value) in writes {
                match value {
                    Some(v) => {
                        table.insert(key.as_slice(), v.as_slice()).map_err(io)?;
                    }
                    None => {
                        table.remove(key.as_slice()).map_err(io)?;
                    }
                }
            }
        }
        txn.commit().map_err(io)
    }

    fn commit(&mut self, batch: Batch) {
        let result = self.write(&batch.writes, batch.sync).and_then(|()| RedbSnapshot::new(&self.db));
        let result = {
            let mut state = self.progress.state.lock();
            state.batch = batch.number;
            match result {
                Ok(snapshot) => {
                    state.snapshot = Arc::new(snapshot);
                    Ok(())
                }
                Err(e) => {
                    state.failed = Some((batch.number, e.clone()));
                    Err(e)
                }
            }
        };
        self.progress.changed.notify_all();
        match result {
            Ok(()) => {
                if batch.sync {
                    self.unflushed_since = None;
                } else if self.unflushed_since.is_none() {
                    self.unflushed_since = Some(Instant::now());
                }
                for (done, r) in batch.acks {
                    done(r);
                }
            }
            Err(e) => {
                for (done, _) in batch.acks {
                    done(Err(JobsError::from(e.clone())));
                }
            }
        }
    }
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    format!("operation panicked: {}", crate::error::panic_text(panic.as_ref()))
}
