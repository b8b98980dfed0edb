//! The embedded engine: one redb file, group commit, pipelined over three threads.
//!
//! Callers on any thread submit operations to a channel. The **executor**
//! thread takes every operation waiting there (a batch), runs each in its own
//! [`Overlay`] over the batch's overlay (so a failed operation leaves nothing
//! behind), and hands the batch's net writes to the **committer** thread,
//! which makes every batch waiting for it durable with one record and one
//! fsync in the write-ahead log, acknowledges their operations, and hands the
//! group to the **file writer** thread, which writes the groups waiting for it
//! into one redb transaction; reads see the snapshot under the acknowledged
//! batches the file writer has not written yet. Under relaxed durability the
//! operations are acknowledged as soon as their batch is handed over instead.
//! Without a log (a store in memory), the committer writes redb itself before
//! acknowledging.
//!
//! The threads overlap: the executor runs each batch as soon as it comes,
//! over the last committed snapshot and the writes of every batch not yet in
//! it ([`PendingBatches`]), and never waits for a commit; the committer logs
//! every batch that ran while it logged the previous group, so the busier the
//! store, the more operations one fsync carries; and redb's commit is off
//! both. If a commit fails, its batches fail, and so does every batch that
//! ran on top of them, since what it read never reached the store.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::placement::{CallerWaits, Placement};
use super::wal::Wal;
use super::{Durability, Durable, OpDone, OpOutput, Store, WriteOp};
use crate::error::{JobsError, StoreError};
use crate::kv::{Key, KeyRange, KvRead, Memo, Overlay, PendingBatches, ReadAhead, Stacked, Value, Writes, net_writes};

const TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("loam_jobs");
/// The write-ahead log's generation (see [`super::wal`]), set by each checkpoint.
const LOG_TABLE: TableDefinition<&str, u64> = TableDefinition::new("loam_jobs_log");
const LOG_GENERATION: &str = "generation";

/// The write-ahead log's size. A checkpoint starts it over once it is half
/// full, or [`CHECKPOINT_INTERVAL`] after the last one.
const LOG_CAPACITY: u64 = 16 << 20;
/// How long the redb file may go without a durable commit while the log
/// carries durability: bounds the replay after a crash, and how long redb
/// keeps pages freed since the last durable commit from being reused.
const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);

/// Most operations one batch takes by default; bounds the latency a large
/// backlog adds to the first operation of a batch.
const MAX_BATCH: usize = 4096;

/// How long non-durable commits (leases) may stay unflushed under immediate
/// durability, when no durable commit comes along to carry them.
const IMMEDIATE_MODE_IDLE_FLUSH: Duration = Duration::from_millis(100);

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
    /// Most operations the executor runs as one batch. Large batches spread
    /// each batch's fixed costs when callers only wait for their answers (a
    /// server's clients); smaller ones hand answers back sooner to callers
    /// that must process them on the same cores (a Node host in-process,
    /// where 100 concurrent jobs otherwise move in one wave and the stages
    /// take turns instead of overlapping).
    pub max_batch: usize,
    /// How long the file may go without a durable commit while the log
    /// carries durability (a crash test shortens it, to be killed during
    /// checkpoints).
    pub checkpoint_interval: Duration,
    /// Lets a caller run its write on its own thread, when the executor is
    /// idle and the function says the caller would otherwise wait idle for
    /// the answer (see [`super::placement`]). A host with an event loop of
    /// its own (Node) saves a round trip between threads per write; without
    /// it (a server, whose callers only wait) every write goes to the
    /// executor, which batches them.
    pub run_on_callers_thread: Option<CallerWaits>,
}

impl Default for RedbOptions {
    fn default() -> Self {
        Self {
            durability: Durability::Immediate,
            cache_size: 256 << 20,
            max_batch: MAX_BATCH,
            checkpoint_interval: CHECKPOINT_INTERVAL,
            run_on_callers_thread: None,
        }
    }
}

pub struct RedbStore {
    /// Taken by `close`, which releases the file for another opener.
    db: Mutex<Option<Arc<Database>>>,
    /// The committer's progress: reads start from its latest snapshot.
    progress: Arc<Progress>,
    sender: Mutex<Option<Sender<WriteOp>>>,
    executor: Arc<Executor>,
    /// Set when callers may run their writes (see [`RedbOptions::run_on_callers_thread`]).
    placement: Option<Placement>,
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
        let wal = recover(&db, &log_path(path))?;
        Self::start(db, &options, Some(wal))
    }

    /// [`open`](RedbStore::open), with a log whose appends and fsyncs fail
    /// while `failing` is set: a disk that fails under the log only.
    #[cfg(test)]
    fn open_with_failing_log(
        path: &Path,
        options: RedbOptions,
        failing: Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<Self, StoreError> {
        let db = Database::builder().create(path).map_err(io)?;
        let mut wal = recover(&db, &log_path(path))?;
        wal.fail_while(failing);
        Self::start(db, &options, Some(wal))
    }

    /// A store that lives in memory only, for tests.
    pub fn in_memory() -> Result<Self, StoreError> {
        let db = Database::builder().create_with_backend(redb::backends::InMemoryBackend::new()).map_err(io)?;
        Self::start(db, &RedbOptions::default(), None)
    }

    /// Starts the threads over an open file. Without a log (a store in
    /// memory), redb's own commits are made durable where needed.
    fn start(db: Database, options: &RedbOptions, wal: Option<Wal>) -> Result<Self, StoreError> {
        let durability = options.durability;
        let txn = db.begin_write().map_err(io)?;
        txn.open_table(TABLE).map_err(io)?;
        txn.commit().map_err(io)?;
        let db = Arc::new(db);
        let progress = Arc::new(Progress::new(RedbSnapshot::new(&db)?));
        let (sender, receiver) = mpsc::channel();
        let (to_committer, from_executor) = mpsc::channel();
        let relaxed = matches!(durability, Durability::Relaxed { .. });
        let file_writer = FileWriter { db: Arc::clone(&db), progress: Arc::clone(&progress), relaxed };
        let mut threads = Vec::new();
        // With a log, redb is written on a thread of its own, behind the log;
        // without one, its commits are what makes writes durable, before
        // they are acknowledged.
        let file = match wal {
            Some(wal) => {
                let (to_file, from_committer) = mpsc::channel();
                threads.push(
                    std::thread::Builder::new()
                        .name("loam-jobs-file".into())
                        .spawn(move || file_writer.run(from_committer))
                        .map_err(io)?,
                );
                File::Logged { wal, to_file }
            }
            None => File::Inline(file_writer),
        };
        let committer = Committer {
            progress: Arc::clone(&progress),
            durability,
            unflushed_since: None,
            last_failed: 0,
            file,
            checkpoint_interval: options.checkpoint_interval,
            last_checkpoint: Instant::now(),
            checkpointing: None,
            broken: None,
        };
        let committer = std::thread::Builder::new()
            .name("loam-jobs-commit".into())
            .spawn(move || committer.run(from_executor))
            .map_err(io)?;
        let lingering_committer = relaxed.then(|| committer.thread().clone());
        threads.push(committer);
        let executor = Arc::new(Executor {
            progress: Arc::clone(&progress),
            lingering_committer,
            durability,
            max_batch: options.max_batch.max(1),
            queued: AtomicUsize::new(0),
            state: Mutex::new(ExecutorState {
                uncommitted: Uncommitted::default(),
                number: 0,
                to_committer: Some(to_committer),
            }),
        });
        let running = Arc::clone(&executor);
        threads.push(
            std::thread::Builder::new()
                .name("loam-jobs-writer".into())
                .spawn(move || running.run(receiver))
                .map_err(io)?,
        );
        Ok(Self {
            db: Mutex::new(Some(db)),
            progress,
            sender: Mutex::new(Some(sender)),
            executor,
            placement: options.run_on_callers_thread.map(Placement::new),
            threads: Mutex::new(threads),
        })
    }
}

/// The log beside the file at `path`.
fn log_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".wal");
    name.into()
}

/// Replays what the log holds beyond the file's last durable commit (what a
/// crash left only in the log), in one durable commit that also starts the
/// log's generation after the two it may have replayed (the second's records
/// stay in their region, and must not pass for a later generation's).
fn recover(db: &Database, path: &Path) -> Result<Wal, StoreError> {
    let generation = {
        let txn = db.begin_read().map_err(io)?;
        match txn.open_table(LOG_TABLE) {
            Ok(table) => table.get(LOG_GENERATION).map_err(io)?.map_or(0, |g| g.value()),
            Err(redb::TableError::TableDoesNotExist(_)) => 0,
            Err(e) => return Err(io(e)),
        }
    };
    let (mut wal, records) = Wal::open(path, generation, LOG_CAPACITY).map_err(io)?;
    let txn = db.begin_write().map_err(io)?;
    {
        let mut table = txn.open_table(TABLE).map_err(io)?;
        for writes in &records {
            apply(&mut table, writes)?;
        }
    }
    store_generation(&txn, generation + 2)?;
    txn.commit().map_err(io)?;
    wal.restart(generation + 2).map_err(io)?;
    Ok(wal)
}

/// Records in `txn` the log generation that starts when it commits durably.
fn store_generation(txn: &redb::WriteTransaction, generation: u64) -> Result<(), StoreError> {
    txn.open_table(LOG_TABLE).map_err(io)?.insert(LOG_GENERATION, generation).map_err(io)?;
    Ok(())
}

fn apply<'a>(
    table: &mut redb::Table<&'static [u8], &'static [u8]>,
    writes: impl IntoIterator<Item = (&'a Key, &'a Option<Value>)>,
) -> Result<(), StoreError> {
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
    Ok(())
}

impl Store for RedbStore {
    fn submit(&self, op: WriteOp) {
        let op = match &self.placement {
            Some(placement) if op.brief && placement.here() => match self.executor.run_here(op) {
                Some(op) => op,
                None => return placement.ran_here(),
            },
            Some(placement) if op.brief => {
                placement.sent();
                op
            }
            _ => op,
        };
        let rejected = match self.sender.lock().as_ref() {
            Some(sender) => {
                self.executor.queued.fetch_add(1, Ordering::AcqRel);
                sender.send(op).err().map(|e| {
                    self.executor.queued.fetch_sub(1, Ordering::AcqRel);
                    e.0
                })
            }
            None => Some(op),
        };
        if let Some(op) = rejected {
            (op.done)(Err(StoreError::Closed.into()));
        }
    }

    /// The state as of now, with every write acknowledged so far: a caller
    /// always reads what it was told was written, and never waits for it.
    fn snapshot(&self) -> Result<Box<dyn KvRead + Send>, StoreError> {
        if self.db.lock().is_none() {
            return Err(StoreError::Closed);
        }
        // Every acknowledged batch is readable: published before it was
        // answered (see `Progress::publish`), or (a store in memory, a
        // checkpoint) in the file. The file writer drops the batches it wrote
        // under this lock as it swaps in the snapshot, so none is in both.
        let state = self.progress.state.lock();
        if let Some(e) = &state.unreadable {
            return Err(e.clone());
        }
        let unapplied = state.unapplied.iter().map(|(_, writes)| Arc::clone(writes)).collect();
        Ok(Box::new(PublishedReader { snapshot: SnapshotReader(Arc::clone(&state.snapshot)), unapplied }))
    }

    fn close(&self) {
        drop(self.sender.lock().take());
        let threads = std::mem::take(&mut *self.threads.lock());
        // The last handle can be dropped by an operation's completion
        // callback, which runs on one of the store's threads: each of them
        // then finishes its queue (the committer flushes and checkpoints) on
        // its own, and none may wait for another that waits for it.
        let current = std::thread::current().id();
        if threads.iter().all(|t| t.thread().id() != current) {
            for thread in threads {
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

/// What a read sees: the file's snapshot, under the published batches the
/// file writer has not written into it yet.
struct PublishedReader {
    snapshot: SnapshotReader,
    unapplied: Vec<Arc<Writes>>,
}

impl KvRead for PublishedReader {
    fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        Stacked::new(&self.unapplied, &mut self.snapshot).get(key)
    }
    fn scan(&mut self, range: &KeyRange, limit: usize, reverse: bool) -> Result<Vec<(Key, Value)>, StoreError> {
        Stacked::new(&self.unapplied, &mut self.snapshot).scan(range, limit, reverse)
    }
}

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

/// What the committer has done, for the executor and for readers.
struct Progress {
    state: Mutex<Committed>,
    changed: Condvar,
    /// Tests: how many times the committer's loop went round.
    #[cfg(test)]
    committer_turns: std::sync::atomic::AtomicU64,
    /// Tests: held, it keeps the file writer from writing.
    #[cfg(test)]
    file_gate: Mutex<()>,
}

impl Progress {
    /// Nothing committed or acknowledged yet; reads start from `snapshot`.
    fn new(snapshot: RedbSnapshot) -> Self {
        let state = Committed {
            batch: 0,
            unreadable: None,
            snapshot: Arc::new(snapshot),
            snapshot_batch: 0,
            published: 0,
            unapplied: VecDeque::new(),
        };
        Self {
            state: Mutex::new(state),
            changed: Condvar::new(),
            #[cfg(test)]
            committer_turns: std::sync::atomic::AtomicU64::new(0),
            #[cfg(test)]
            file_gate: Mutex::new(()),
        }
    }

    /// `batches` (up to `last`, the failed ones left out) are about to be
    /// acknowledged: readers see them from now on, over the snapshot, until
    /// the file writer has written them into the file. The executor publishes
    /// a batch it acknowledges early (relaxed durability), so a read never
    /// waits for its commit; the committer publishes the rest once logged.
    /// The marks never move back: under relaxed durability the committer
    /// logs a batch after the executor published newer ones.
    fn publish(&self, batches: &[(u64, Arc<Writes>)], last: u64) {
        let mut state = self.state.lock();
        for (number, writes) in batches {
            if *number > state.published {
                state.unapplied.push_back((*number, Arc::clone(writes)));
            }
        }
        state.published = state.published.max(last);
    }
}

/// Hands each operation its result. A completion that panics (a bug in the
/// caller's callback) is contained: the store's thread that ran it goes on,
/// or every later commit and read would wait for it for ever.
fn deliver(acks: impl IntoIterator<Item = Ack>) {
    for (done, result) in acks {
        let _ = catch_unwind(AssertUnwindSafe(move || done(result)));
    }
}

struct Committed {
    /// The last batch that is done with: in the file, or failed.
    batch: u64,
    /// Why the file lacks writes that were acknowledged (their commit failed
    /// after they were logged, or under relaxed durability): reads fail from
    /// then on rather than show older state than callers were told of.
    /// Reopening replays what the log holds.
    unreadable: Option<StoreError>,
    /// The file as of the last successful commit.
    snapshot: Arc<RedbSnapshot>,
    /// The batch that `snapshot` ends with.
    snapshot_batch: u64,
    /// The last batch published to readers (see [`Progress::publish`]):
    /// logged, or acknowledged early under relaxed durability. A batch is
    /// published before its operations are answered.
    published: u64,
    /// The published batches the file writer has not written yet, in order:
    /// a read sees them over the snapshot instead of waiting for redb's
    /// commit (or, acknowledged early, for the log).
    unapplied: VecDeque<(u64, Arc<Writes>)>,
}

/// An executed batch on its way to the file.
struct Batch {
    number: u64,
    /// The batch whose writes this one read last: its predecessor while that
    /// was still uncommitted, else the batch the committed snapshot ended with.
    /// A batch that read a failed batch's writes fails too.
    read_through: u64,
    writes: Arc<Writes>,
    sync: bool,
    /// Acknowledgements that wait for the commit (the rest went out early).
    acks: Vec<Ack>,
}

/// Most executed batches that may wait for the committer at once; past it the
/// executor waits, so a slow disk slows callers down instead of growing memory.
const MAX_UNCOMMITTED_BATCHES: usize = 64;

struct Executor {
    progress: Arc<Progress>,
    /// Under relaxed durability, the committer's thread, woken from its
    /// linger once enough batches wait for it.
    lingering_committer: Option<std::thread::Thread>,
    durability: Durability,
    max_batch: usize,
    /// Operations sent down the channel and not yet run. A caller runs its
    /// operation on its own thread only while there are none (see
    /// [`Executor::run_here`]), so no operation overtakes one submitted
    /// before it.
    queued: AtomicUsize,
    /// Held while a batch runs and is handed over, by the executor's thread
    /// or by a caller running its operation itself.
    state: Mutex<ExecutorState>,
}

struct ExecutorState {
    uncommitted: Uncommitted,
    /// The last batch's number.
    number: u64,
    /// Taken once the executor's thread has run every operation sent to it
    /// (the store is closing): the committer then finishes.
    to_committer: Option<Sender<Batch>>,
}

/// The latest committed snapshot, the batch it ends with, and whether the
/// store lost acknowledged writes.
type View = (Arc<RedbSnapshot>, u64, bool);

/// What a batch leaves to deliver once the executor's state is let go (an
/// answer's callback may submit again).
struct Handed {
    answers: Vec<Ack>,
    /// The committer is gone: the executor stops.
    closed: bool,
}

impl Handed {
    /// `ops` refused: the committer is gone.
    fn refused(ops: Vec<WriteOp>) -> Self {
        let answers = ops.into_iter().map(|op| (op.done, Err(StoreError::Closed.into()))).collect();
        Self { answers, closed: true }
    }
}

impl Executor {
    /// Runs batches as they come, each over the last committed snapshot and
    /// the writes of every batch not yet committed, and never waits for a
    /// commit (short of [`MAX_UNCOMMITTED_BATCHES`]): the committer takes all
    /// the batches that ran while it wrote the previous ones in one commit.
    fn run(&self, receiver: Receiver<WriteOp>) {
        while let Ok(first) = self.next(&receiver) {
            let mut state = self.state.lock();
            let ops = with_waiting(&receiver, first, self.max_batch);
            let count = ops.len();
            // Without a committer no room comes: refuse, rather than wait.
            let handed = if state.to_committer.is_some() {
                let view = self.view(&mut state.uncommitted);
                self.run_batch(&mut state, ops, view)
            } else {
                Handed::refused(ops)
            };
            self.queued.fetch_sub(count, Ordering::Release);
            drop(state);
            deliver(handed.answers);
            if handed.closed {
                break;
            }
        }
        // Every operation sent was run: without its sender, the committer
        // finishes once it has the batches before.
        self.state.lock().to_committer = None;
    }

    /// Runs `op` on the calling thread, as a batch of its own, when the
    /// executor is idle: nothing queued for it, no batch running, and room for
    /// one more uncommitted batch (so the caller never waits for the disk).
    /// A caller with an event loop of its own (Node's) then gets an answer
    /// that needs no commit before the call returns, instead of a round trip
    /// to the executor's thread and back. Gives `op` back otherwise, to be
    /// sent to the executor.
    fn run_here(&self, op: WriteOp) -> Option<WriteOp> {
        let Some(mut state) = self.state.try_lock() else { return Some(op) };
        if self.queued.load(Ordering::Acquire) != 0 || state.to_committer.is_none() {
            return Some(op);
        }
        let Some(view) = state.uncommitted.view(&self.progress.state.lock()) else { return Some(op) };
        // An operation's own panic fails that operation (see `execute`); one
        // in the batch's bookkeeping is a bug of the store, which must not
        // unwind into the caller (a Node host aborts): the store then takes
        // no more writes, and this one is answered as unavailable.
        let handed = catch_unwind(AssertUnwindSafe(|| self.run_batch(&mut state, vec![op], view)));
        let handed = handed.unwrap_or_else(|_| {
            state.to_committer = None;
            Handed { answers: Vec::new(), closed: true }
        });
        drop(state);
        deliver(handed.answers);
        None
    }

    /// Runs `ops` as the next batch over `view` (see [`Uncommitted::view`]) and
    /// hands it to the committer. Returns the answers to deliver now: under
    /// relaxed durability all of them unless an operation is
    /// [`Durable::Always`], else those that wrote nothing and need no fsync.
    fn run_batch(&self, state: &mut ExecutorState, ops: Vec<WriteOp>, view: View) -> Handed {
        let ExecutorState { uncommitted, number, to_committer } = state;
        let Some(to_committer) = to_committer.as_ref() else { return Handed::refused(ops) };
        *number += 1;
        let number = *number;
        let (snapshot, snapshot_batch, failed) = view;
        let read_through = uncommitted.batches.newest().unwrap_or(snapshot_batch);
        let sync = match self.durability {
            Durability::Immediate => ops.iter().any(|op| op.durable != Durable::No),
            Durability::Relaxed { .. } => ops.iter().any(|op| op.durable == Durable::Always),
        };
        let (writes, acks, mut unchanged) = {
            // A batch's leases scan the waiting index one after another:
            // one entry ahead for each operation after the first.
            let mut committed = ReadAhead::new(SnapshotReader(snapshot), ops.len().min(64).saturating_sub(1));
            let Uncommitted { batches, memo } = uncommitted;
            if batches.is_empty() {
                execute(ops, &mut committed, memo)
            } else {
                execute(ops, &mut batches.over(&mut committed), memo)
            }
        };
        // Under relaxed durability, acknowledgements go out once the batch
        // is with the committer (a reader they wake then waits for that
        // commit, see `RedbStore::snapshot`). Under immediate durability
        // even leases wait for their commit: acknowledged early, a worker
        // would see a job before the producer saw its `add` resolve, which
        // BullMQ callers (and Redis, answering in order) never show. A
        // lease that found nothing is answered at once either way: waiting
        // for the batch's fsync only kept an idle worker from starting to
        // wait for the next job.
        // A store that lost acknowledged writes acknowledges no more
        // early: the committer refuses these, as it refuses every commit.
        let (early, late) = match self.durability {
            Durability::Relaxed { .. } if !failed && !sync => (acks, Vec::new()),
            _ => (Vec::new(), acks),
        };
        let writes = Arc::new(writes);
        uncommitted.batches.push(number, Arc::clone(&writes));
        // Under relaxed durability a batch whose answers wait for its fsync
        // (`Durable::Always`) is published as it runs too, in order: a later
        // batch, answered early, moves the published mark past it, and the
        // committer publishes only batches above the mark.
        let waits_in_order = sync && matches!(self.durability, Durability::Relaxed { .. }) && !failed;
        let published = (waits_in_order || !early.is_empty()).then(|| Arc::clone(&writes));
        // The batch goes on, and is published to readers, before anyone is
        // answered: an answer's callback may read the store.
        if let Err(mpsc::SendError(batch)) = to_committer.send(Batch { number, read_through, writes, sync, acks: late })
        {
            state.to_committer = None;
            let refused = batch.acks.into_iter().chain(early).map(|(done, _)| (done, Err(StoreError::Closed.into())));
            unchanged.extend(refused);
            return Handed { answers: unchanged, closed: true };
        }
        if let Some(writes) = published {
            self.progress.publish(&[(number, writes)], number);
        }
        if let Some(committer) = &self.lingering_committer
            && uncommitted.batches.len() % LINGER_BATCHES == 0
        {
            committer.unpark();
        }
        unchanged.extend(early);
        Handed { answers: unchanged, closed: false }
    }

    /// The next operation. Under relaxed durability the executor first spins
    /// for [`EXECUTOR_SPIN`]: with the committer lingering, its thread is
    /// often the only busy one besides its callers', and a thread woken on an
    /// idle core (a halted virtual CPU) took long enough that a one-at-a-time
    /// `add` ran at half speed; spinning, it ran as fast as before with a
    /// fifth less CPU.
    fn next(&self, receiver: &Receiver<WriteOp>) -> Result<WriteOp, mpsc::RecvError> {
        if self.lingering_committer.is_some() {
            let until = Instant::now() + EXECUTOR_SPIN;
            while Instant::now() < until {
                match receiver.try_recv() {
                    Ok(op) => return Ok(op),
                    Err(mpsc::TryRecvError::Disconnected) => return Err(mpsc::RecvError),
                    Err(mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
                }
            }
        }
        receiver.recv()
    }

    /// The view the next batch runs over (see [`Uncommitted::view`]); waits
    /// while too many batches are uncommitted.
    fn view(&self, uncommitted: &mut Uncommitted) -> View {
        let mut state = self.progress.state.lock();
        loop {
            if let Some(view) = uncommitted.view(&state) {
                return view;
            }
            self.progress.changed.wait(&mut state);
        }
    }
}

/// The batches the executor handed over whose commit is not done yet, which
/// the next batches read through.
#[derive(Default)]
struct Uncommitted {
    batches: PendingBatches,
    /// What operations remembered (`KvTxn::remember`), kept from batch to
    /// batch: every write the store takes is a successful operation's, which
    /// forgets what it touches, so a value stays right until a batch is given
    /// up (then the file lacks writes it was read through, and all is
    /// forgotten). Kept per batch, each batch's first operation read and
    /// decoded its queue's meta hash again: with the few operations a batch
    /// holds at low concurrency, that was a scan for every second operation.
    memo: Memo,
}

impl Uncommitted {
    /// The view the next batch runs over, after forgetting the batches the
    /// committer is done with (committed, or failed and so never to be
    /// read); none while [`MAX_UNCOMMITTED_BATCHES`] remain.
    fn view(&mut self, committed: &Committed) -> Option<View> {
        while let Some(n) = self.batches.oldest()
            && n <= committed.batch
        {
            if n > committed.snapshot_batch {
                self.memo.clear();
            }
            self.batches.forget_oldest();
        }
        if committed.unreadable.is_some() {
            self.memo.clear();
        }
        (self.batches.len() < MAX_UNCOMMITTED_BATCHES)
            .then(|| (Arc::clone(&committed.snapshot), committed.snapshot_batch, committed.unreadable.is_some()))
    }
}

/// `first` and what else is waiting in `receiver` already, up to `max` in all.
fn with_waiting<T>(receiver: &Receiver<T>, first: T, max: usize) -> Vec<T> {
    let mut items = vec![first];
    while items.len() < max {
        match receiver.try_recv() {
            Ok(item) => items.push(item),
            Err(_) => break,
        }
    }
    items
}

/// Runs a batch's operations one after another in the batch's overlay (a
/// failed one is taken back whole). Returns the batch's writes, the
/// acknowledgements that must wait for its commit, and those that need not:
/// an operation that needs no fsync ([`Durable::No`]: a lease, a lock extension) and wrote
/// nothing (a lease that found no job) told its caller nothing a crash could
/// take back.
fn execute(ops: Vec<WriteOp>, base: &mut dyn KvRead, memo: &mut Memo) -> (Writes, Vec<Ack>, Vec<Ack>) {
    let mut acks = Vec::with_capacity(ops.len());
    let mut unchanged = Vec::new();
    let mut batch = Overlay::caching(base).remembering(memo);
    for op in ops {
        let WriteOp { mut body, done, durable, .. } = op;
        // A bug in an operation must fail that operation, not the writer
        // thread and with it every caller (and a Node host).
        let result =
            catch_unwind(AssertUnwindSafe(|| body(&mut batch))).unwrap_or_else(|panic| Err(JobsError::panicked(panic)));
        let wrote = batch.end_operation(result.is_ok());
        if durable == Durable::No && !wrote {
            unchanged.push((done, result));
            continue;
        }
        acks.push((done, result));
    }
    (batch.into_writes(), acks, unchanged)
}

/// Most batches one commit takes.
const MAX_BATCHES_PER_COMMIT: usize = 256;

/// Under relaxed durability, how long the committer may wait for more batches
/// to commit with the first one, and how many end the wait (well under
/// [`MAX_UNCOMMITTED_BATCHES`], so the executor never waits for a linger).
const COMMIT_LINGER: Duration = Duration::from_millis(2);
const LINGER_BATCHES: usize = 16;

/// Under relaxed durability, how long the executor spins for the next
/// operation before it sleeps (see `Executor::next`).
const EXECUTOR_SPIN: Duration = Duration::from_micros(50);

/// How often the committer looks for the outcome of a checkpoint under way
/// while no batch comes.
const CHECKPOINT_POLL: Duration = Duration::from_millis(5);

/// Most groups the file writer takes into one redb transaction.
const MAX_GROUPS_PER_FILE_COMMIT: usize = 64;

struct Committer {
    progress: Arc<Progress>,
    durability: Durability,
    /// When the oldest commit not yet flushed to disk was made.
    unflushed_since: Option<Instant>,
    /// The last batch whose commit failed: a batch that read its writes fails too.
    last_failed: u64,
    /// How commits are made durable and reach redb.
    file: File,
    checkpoint_interval: Duration,
    last_checkpoint: Instant,
    /// The checkpoint the file writer is making, if any: commits go on in
    /// the log's other region meanwhile.
    checkpointing: Option<mpsc::Receiver<Result<(), StoreError>>>,
    /// Why the log failed: from then on every commit fails, as redb's own do
    /// after an I/O error, so nothing is acknowledged that may not survive.
    broken: Option<StoreError>,
}

/// How the committer's groups are made durable and reach the redb file.
enum File {
    /// Without a log (a store in memory): redb's own commits make them
    /// durable, on the committer's thread, before acknowledging.
    Inline(FileWriter),
    /// The write-ahead log makes them durable; the file writer's thread
    /// writes them into redb after acknowledging.
    Logged { wal: Wal, to_file: Sender<ToFile> },
}

/// A committed group on its way into the file: the writes of its batches that
/// did not fail (each with its number), and the last batch of the group, done
/// with once the group is written (or at once, when nothing of it is left).
struct Group {
    batches: Vec<(u64, Arc<Writes>)>,
    last: u64,
}

enum ToFile {
    /// Written without fsync: the log answers for it.
    Group(Group),
    /// A durable commit that also stores the log's next `generation`, with a
    /// group too large for the log, or none; answered on `done` once made.
    Checkpoint { group: Option<Group>, generation: u64, done: mpsc::SyncSender<Result<(), StoreError>> },
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
            #[cfg(test)]
            self.progress.committer_turns.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let first = match self.next_wake() {
                None => match receiver.recv() {
                    Ok(b) => b,
                    Err(_) => break,
                },
                Some(wait) => match receiver.recv_timeout(wait) {
                    Ok(b) => b,
                    Err(RecvTimeoutError::Timeout) => {
                        self.checkpoint_done(false);
                        if self.flush_due() {
                            self.flush();
                        }
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                },
            };
            let batches = self.gather(&receiver, first);
            self.checkpoint_done(false);
            self.commit(batches);
            if self.flush_due() {
                self.flush();
            }
            if self.checkpoint_due() {
                self.start_checkpoint();
            }
        }
        self.flush();
        // Closed cleanly, the file holds everything by itself.
        let _ = self.checkpoint(None);
    }

    /// Group commit: `first` and every batch that ran while the last commit
    /// was written. Under relaxed durability, whose callers were answered
    /// already, also those that come within [`COMMIT_LINGER`], until
    /// [`LINGER_BATCHES`] are in (the executor then unparks this thread; a
    /// read does not wait for them, see [`Progress::publish`]): each commit
    /// costs a log append and a redb transaction (copied and checksummed
    /// pages) that are much the same for one small batch as for many, and
    /// committed one at a time the batches of a one-at-a-time `add` took a
    /// third of its CPU. The committer sleeps
    /// rather than wait on the channel, so a batch sent meanwhile wakes
    /// nobody.
    fn gather(&self, receiver: &Receiver<Batch>, first: Batch) -> Vec<Batch> {
        let mut batches = with_waiting(receiver, first, MAX_BATCHES_PER_COMMIT);
        if let Durability::Relaxed { .. } = self.durability {
            let until = Instant::now() + COMMIT_LINGER;
            loop {
                let now = Instant::now();
                if batches.len() >= LINGER_BATCHES || now >= until {
                    break;
                }
                std::thread::park_timeout(until - now);
                match receiver.try_recv() {
                    Ok(batch) => batches.push(batch),
                    Err(mpsc::TryRecvError::Empty) => continue,
                    Err(mpsc::TryRecvError::Disconnected) => break,
                }
                while batches.len() < MAX_BATCHES_PER_COMMIT
                    && let Ok(batch) = receiver.try_recv()
                {
                    batches.push(batch);
                }
            }
        }
        batches
    }

    /// Makes every commit so far durable: an fsync of the log, or without a
    /// log an empty durable commit, which makes every earlier one durable.
    fn flush(&mut self) {
        if self.broken.is_some() {
            // Nothing can be made durable any more: waking to try again
            // would only spin the committer.
            self.unflushed_since = None;
            return;
        }
        if self.unflushed_since.is_none() {
            return;
        }
        let result = match &mut self.file {
            File::Logged { wal, .. } => wal.sync().map_err(io),
            File::Inline(file) => file.write(&[], true, None),
        };
        match result {
            Ok(()) => self.unflushed_since = None,
            Err(e) => self.break_store(e),
        }
    }

    /// How long the committer may wait for a batch: until the oldest
    /// unflushed commit is due a flush, and no longer than
    /// [`CHECKPOINT_POLL`] while a checkpoint is under way (a failed one must
    /// stop the store at once, not at the next commit).
    fn next_wake(&self) -> Option<Duration> {
        let flush = self.unflushed_since.map(|since| self.flush_interval().saturating_sub(since.elapsed()));
        let checkpoint = self.checkpointing.as_ref().map(|_| CHECKPOINT_POLL);
        match (flush, checkpoint) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn flush_due(&self) -> bool {
        self.unflushed_since.is_some_and(|since| since.elapsed() >= self.flush_interval())
    }

    /// Asks the file writer for a durable redb commit, which makes every
    /// record of the log's current generation redundant once made (the file
    /// writer has written every group sent before it by then, since it takes
    /// them in order), and goes on at once under the next generation, in the
    /// log's other region. Commits do not wait for the checkpoint: a second
    /// of writes made durable took 12-43 ms at 40k jobs/s, every commit
    /// stopped meanwhile. The next checkpoint, which writes this one's region
    /// again, is not due until this one is done (see `checkpoint_due`).
    fn start_checkpoint(&mut self) {
        self.checkpoint_done(true);
        if self.broken.is_some() {
            return;
        }
        let File::Logged { wal, to_file } = &mut self.file else { return };
        let generation = wal.generation() + 1;
        // Before anything of the next generation is written (see `Wal::restart`).
        if let Err(e) = wal.restart(generation) {
            self.break_store(io(e));
            return;
        }
        self.unflushed_since = None;
        let (done, answer) = mpsc::sync_channel(1);
        if to_file.send(ToFile::Checkpoint { group: None, generation, done }).is_err() {
            self.broken = Some(StoreError::Closed);
            return;
        }
        self.last_checkpoint = Instant::now();
        self.checkpointing = Some(answer);
    }

    /// Takes the outcome of the checkpoint under way, if it is in (or,
    /// `waiting`, once it is). A failed one breaks the store: every later
    /// commit says so.
    fn checkpoint_done(&mut self, waiting: bool) {
        let Some(answer) = &self.checkpointing else { return };
        let result = if waiting {
            answer.recv().map_err(|_| StoreError::Closed).and_then(|r| r)
        } else {
            match answer.try_recv() {
                Ok(r) => r,
                Err(mpsc::TryRecvError::Empty) => return,
                Err(mpsc::TryRecvError::Disconnected) => Err(StoreError::Closed),
            }
        };
        self.checkpointing = None;
        if let Err(e) = result {
            self.break_store(e);
        }
    }

    /// A durable redb commit (with `group`, when it does not fit in the log)
    /// made before this returns, after any under way: the log starts over
    /// under the next generation.
    fn checkpoint(&mut self, group: Option<Group>) -> Result<(), StoreError> {
        self.checkpoint_done(true);
        if let Some(e) = self.broken.clone() {
            // The file writer is done with the group's batches, which fail.
            if let Some(group) = group {
                self.done_with(group.last);
            }
            return Err(e);
        }
        let File::Logged { wal, to_file } = &mut self.file else { return Ok(()) };
        let generation = wal.generation() + 1;
        let (done, answer) = mpsc::sync_channel(1);
        let committed = to_file
            .send(ToFile::Checkpoint { group, generation, done })
            .map_err(|_| StoreError::Closed)
            .and_then(|()| answer.recv().map_err(|_| StoreError::Closed)?);
        if let Err(e) = committed {
            self.break_store(e.clone());
            return Err(e);
        }
        self.last_checkpoint = Instant::now();
        self.unflushed_since = None;
        // redb now holds the generation durably, the group with it: what the
        // log's records were to make durable is, and the fsync `restart`
        // makes is all but free. Should it fail, later commits are refused,
        // but the group is in, and succeeded.
        if let Err(e) = wal.restart(generation) {
            self.break_store(io(e));
        }
        Ok(())
    }

    /// Not while one is under way: starting the next waits for it, and the
    /// committer would stop appending and flushing the log for as long as
    /// redb's durable commit takes (relaxed writes acknowledged meanwhile
    /// unlogged past the flush interval). The region being written still has
    /// room (a checkpoint starts at half of it), and a group that does not
    /// fit waits for the checkpoint anyway.
    fn checkpoint_due(&self) -> bool {
        self.checkpointing.is_none()
            && matches!(&self.file, File::Logged { wal, .. }
                if !wal.is_empty() && (wal.half_full() || self.last_checkpoint.elapsed() >= self.checkpoint_interval))
    }

    /// Makes `batches` durable and hands them to the file. With a log, the
    /// group's record goes to the log (fsynced when `sync` asks for it), the
    /// batches' operations are acknowledged here, and the file writer commits
    /// them to redb without fsync on its own thread, behind the log: a crash
    /// in between is what the log's replay redoes, so redb's commit is off
    /// the operations' latency and off the next group's. A group too large for
    /// what is left of the log is committed durably to redb instead, as a
    /// checkpoint, and acknowledged by the caller afterwards. Without a log,
    /// redb's commit (durable when `sync`) is made here, before acknowledging.
    fn write(&mut self, batches: &mut [Batch], sync: bool, last: u64) -> Result<(), StoreError> {
        let group = Group { batches: batches.iter().map(|b| (b.number, Arc::clone(&b.writes))).collect(), last };
        let broken = self.broken.clone().or_else(|| self.progress.state.lock().unreadable.clone());
        if let Some(e) = broken {
            return Err(self.fail(e, last));
        }
        let wal = match &mut self.file {
            File::Inline(file) => return file.write(&[group], sync, None),
            File::Logged { wal, .. } => wal,
        };
        let record = Wal::encode(net_writes(batches.iter().map(|b| b.writes.as_ref())));
        if !wal.fits(&record) {
            return self.checkpoint(Some(group));
        }
        if let Err(e) = wal.append(record).and_then(|()| if sync { wal.sync() } else { Ok(()) }) {
            // The record may be partly written: nothing more may follow it.
            return Err(self.fail(io(e), last));
        }
        // Acknowledged before the file writer has the group (it refuses
        // reads if it then fails to write what was acknowledged), and
        // readable from here on; answered after (an answer's callback may
        // read it).
        self.progress.publish(&group.batches, group.last);
        self.to_file(ToFile::Group(group));
        deliver(batches.iter_mut().flat_map(|b| b.acks.drain(..)));
        Ok(())
    }

    /// The log failed (or had): every later commit fails with `e`, and the
    /// batches up to `last` are given up. Under relaxed durability they were
    /// acknowledged already, so the store refuses reads from now on rather
    /// than show a state without them, and the executor acknowledges nothing
    /// early any more; reopening replays what the log kept.
    fn fail(&mut self, e: StoreError, last: u64) -> StoreError {
        self.break_store(e.clone());
        self.done_with(last);
        e
    }

    /// A log append or fsync, or a checkpoint, failed: every later commit
    /// fails with `e`, as redb's own do after an I/O error. Under relaxed
    /// durability the writes since the last flush were acknowledged already
    /// and will now not be made durable, so reads fail too.
    fn break_store(&mut self, e: StoreError) {
        if matches!(self.durability, Durability::Relaxed { .. }) {
            self.progress.state.lock().unreadable.get_or_insert_with(|| e.clone());
        }
        self.broken = Some(e);
    }

    /// Tells the file writer that the batches up to `last` failed: it is done
    /// with them once it has written what came before.
    fn done_with(&self, last: u64) {
        let group = Group { batches: Vec::new(), last };
        match &self.file {
            File::Inline(file) => {
                let _ = file.write(&[group], false, None);
            }
            File::Logged { .. } => self.to_file(ToFile::Group(group)),
        }
    }

    fn to_file(&self, message: ToFile) {
        if let File::Logged { to_file, .. } = &self.file {
            // The file writer ends only after the committer does.
            let _ = to_file.send(message);
        }
    }

    /// Commits `batches` (in order) as one group, except those that read a
    /// failed batch's writes, which fail with its error.
    fn commit(&mut self, batches: Vec<Batch>) {
        let last = batches.last().map_or(0, |b| b.number);
        let mut doomed = Vec::new();
        let mut good = Vec::with_capacity(batches.len());
        for batch in batches {
            if batch.read_through != 0 && batch.read_through == self.last_failed {
                self.last_failed = batch.number;
                doomed.push(batch);
            } else {
                good.push(batch);
            }
        }
        let sync = good.iter().any(|b| b.sync);
        let result = if good.is_empty() {
            self.done_with(last);
            Ok(())
        } else {
            self.write(&mut good, sync, last)
        };
        let failure = match result {
            Ok(()) => {
                if !good.is_empty() {
                    if sync {
                        self.unflushed_since = None;
                    } else if self.unflushed_since.is_none() {
                        self.unflushed_since = Some(Instant::now());
                    }
                }
                deliver(good.into_iter().flat_map(|b| b.acks));
                None
            }
            Err(e) => {
                self.last_failed = good.last().map_or(self.last_failed, |b| b.number);
                deliver(good.into_iter().flat_map(|b| b.acks).map(|(done, _)| (done, Err(JobsError::from(e.clone())))));
                Some(e)
            }
        };
        if !doomed.is_empty() {
            let e = failure.unwrap_or_else(|| StoreError::Io("an earlier commit failed".into()));
            deliver(doomed.into_iter().flat_map(|b| b.acks).map(|(done, _)| (done, Err(JobsError::from(e.clone())))));
        }
    }
}

/// Writes groups into the redb file and publishes each new snapshot, which
/// readers and the executor go on from.
struct FileWriter {
    db: Arc<Database>,
    progress: Arc<Progress>,
    /// Under relaxed durability a failed checkpoint refuses reads at once:
    /// the committer, which learns of it within `CHECKPOINT_POLL`, then
    /// refuses the writes acknowledged early meanwhile.
    relaxed: bool,
}

impl FileWriter {
    /// Behind a log: takes every group waiting in one transaction; a
    /// checkpoint is made in its turn and answered.
    fn run(self, receiver: Receiver<ToFile>) {
        let mut next = None;
        loop {
            let first = match next.take() {
                Some(message) => message,
                None => match receiver.recv() {
                    Ok(message) => message,
                    Err(_) => return,
                },
            };
            match first {
                ToFile::Checkpoint { group, generation, done } => {
                    let groups: Vec<Group> = group.into_iter().collect();
                    let _ = done.send(self.write(&groups, true, Some(generation)));
                }
                ToFile::Group(group) => {
                    let mut groups = vec![group];
                    while groups.len() < MAX_GROUPS_PER_FILE_COMMIT {
                        match receiver.try_recv() {
                            Ok(ToFile::Group(group)) => groups.push(group),
                            Ok(checkpoint) => {
                                next = Some(checkpoint);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    // A failure is published (reads and the committer stop on it).
                    let _ = self.write(&groups, false, None);
                }
            }
        }
    }

    /// One redb transaction with the groups' writes (and the log generation
    /// a checkpoint starts), fsynced when `durable`; then the groups are done
    /// with. If it fails after any of their operations were acknowledged
    /// (their record is in the log), the store refuses reads from then on.
    fn write(&self, groups: &[Group], durable: bool, generation: Option<u64>) -> Result<(), StoreError> {
        #[cfg(test)]
        let _gate = self.progress.file_gate.lock();
        let batches: Vec<&(u64, Arc<Writes>)> = groups.iter().flat_map(|g| &g.batches).collect();
        let result = if batches.is_empty() && !durable && generation.is_none() {
            Ok(None)
        } else {
            self.commit(&batches, durable, generation).and_then(|()| RedbSnapshot::new(&self.db)).map(Some)
        };
        let outcome = {
            let mut state = self.progress.state.lock();
            if let Some(last) = groups.iter().map(|g| g.last).max() {
                state.batch = state.batch.max(last);
                while state.unapplied.front().is_some_and(|(n, _)| *n <= last) {
                    state.unapplied.pop_front();
                }
            }
            match result {
                Ok(Some(snapshot)) => {
                    state.snapshot = Arc::new(snapshot);
                    if let Some((newest, _)) = batches.last() {
                        state.snapshot_batch = *newest;
                    }
                    Ok(())
                }
                Ok(None) => Ok(()),
                Err(e) => {
                    if batches.first().is_some_and(|(first, _)| state.published >= *first) || durable && self.relaxed {
                        state.unreadable = Some(e.clone());
                    }
                    Err(e)
                }
            }
        };
        self.progress.changed.notify_all();
        outcome
    }

    fn commit(
        &self,
        batches: &[&(u64, Arc<Writes>)],
        durable: bool,
        generation: Option<u64>,
    ) -> Result<(), StoreError> {
        let mut txn = self.db.begin_write().map_err(io)?;
        txn.set_durability(if durable { redb::Durability::Immediate } else { redb::Durability::None }).map_err(io)?;
        {
            let mut table = txn.open_table(TABLE).map_err(io)?;
            apply(&mut table, net_writes(batches.iter().map(|(_, writes)| writes.as_ref())))?;
        }
        if let Some(generation) = generation {
            store_generation(&txn, generation)?;
        }
        txn.commit().map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, Ordering};

    use redb::StorageBackend;
    use redb::backends::InMemoryBackend;

    use super::*;
    use crate::kv::KvTxn;

    /// Memory that starts failing every write and sync once told to, as a
    /// full or dying disk does.
    #[derive(Debug)]
    pub(super) struct FailingDisk {
        /// Shared, so the store can be reopened over what the disk kept.
        pub(super) memory: Arc<InMemoryBackend>,
        pub(super) failing: Arc<AtomicBool>,
    }

    impl FailingDisk {
        fn check(&self) -> std::io::Result<()> {
            if self.failing.load(Ordering::SeqCst) { Err(std::io::Error::other("disk failed")) } else { Ok(()) }
        }
    }

    impl StorageBackend for FailingDisk {
        fn len(&self) -> std::io::Result<u64> {
            self.memory.len()
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            self.memory.read(offset, out)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.check()?;
            self.memory.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            self.check()?;
            self.memory.sync_data()
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.check()?;
            self.memory.write(offset, data)
        }
    }

    /// Memory whose syncs wait while its gate is held: an fsync that takes as
    /// long as the test wants.
    #[derive(Debug)]
    pub(super) struct GatedDisk {
        pub(super) memory: InMemoryBackend,
        pub(super) held: Arc<(parking_lot::Mutex<bool>, parking_lot::Condvar)>,
    }

    /// Holds a `GatedDisk`'s syncs until released, or dropped (a failing test
    /// must not leave the committer waiting for ever).
    pub(super) struct Gate(pub(super) Arc<(parking_lot::Mutex<bool>, parking_lot::Condvar)>);

    impl Gate {
        pub(super) fn release(&self) {
            *self.0.0.lock() = false;
            self.0.1.notify_all();
        }
    }

    impl Drop for Gate {
        fn drop(&mut self) {
            self.release();
        }
    }

    impl StorageBackend for GatedDisk {
        fn len(&self) -> std::io::Result<u64> {
            self.memory.len()
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            self.memory.read(offset, out)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.memory.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            let (held, released) = &*self.held;
            let mut held = held.lock();
            while *held {
                released.wait(&mut held);
            }
            self.memory.sync_data()
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.memory.write(offset, data)
        }
    }

    /// The executor publishes a batch (relaxed durability) before the
    /// committer publishes the older group it logs: the mark stays at the
    /// newest, and no batch is published twice.
    #[test]
    fn the_published_mark_never_moves_back() {
        let db = Database::builder().create_with_backend(InMemoryBackend::new()).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(TABLE).unwrap();
        txn.commit().unwrap();
        let progress = Progress::new(RedbSnapshot::new(&db).unwrap());
        let writes = Arc::new(Writes::new());
        progress.publish(&[(4, Arc::clone(&writes)), (5, Arc::clone(&writes))], 5);
        progress.publish(&[(3, Arc::clone(&writes)), (4, Arc::clone(&writes))], 4);
        let state = progress.state.lock();
        assert_eq!(state.published, 5);
        // Published once each, in order.
        assert_eq!(state.unapplied.iter().map(|(n, _)| *n).collect::<Vec<_>>(), [4, 5]);
    }

    /// Under immediate durability an operation that needs no fsync and wrote
    /// nothing (a lease that found no job) is answered without waiting for
    /// the commit of a write before it; one that wrote, or that asked for
    /// fsync, waits.
    #[test]
    fn an_operation_that_wrote_nothing_and_needs_no_fsync_is_answered_before_the_commit() {
        let held = Arc::new((parking_lot::Mutex::new(false), parking_lot::Condvar::new()));
        let disk = GatedDisk { memory: InMemoryBackend::new(), held: Arc::clone(&held) };
        let db = Database::builder().create_with_backend(disk).unwrap();
        let store = RedbStore::start(db, &RedbOptions::default(), None).unwrap();
        *held.0.lock() = true;
        let gate = Gate(held);
        let (sender, answers) = mpsc::channel();
        let submit = |name: &'static str, sync: bool, writes: bool| {
            let sender = sender.clone();
            let body: super::super::OpBody = Box::new(move |txn: &mut dyn KvTxn| {
                if writes {
                    txn.put(name.as_bytes(), b"v".to_vec())?;
                } else {
                    txn.get(b"write")?;
                }
                Ok(Box::new(()) as OpOutput)
            });
            let done: OpDone = Box::new(move |result| {
                let _ = sender.send((name, result.is_ok()));
            });
            store.submit(WriteOp { body, durable: Durable::needed(sync), brief: true, done });
        };
        submit("write", true, true);
        submit("lease that found nothing", false, false);
        submit("lease that took a job", false, true);
        submit("read-only, fsync asked", true, false);
        assert_eq!(answers.recv_timeout(Duration::from_secs(5)).unwrap(), ("lease that found nothing", true));
        assert!(answers.recv_timeout(Duration::from_millis(300)).is_err(), "the others wait for the held fsync");
        gate.release();
        let mut rest: Vec<_> = (0..3).map(|_| answers.recv_timeout(Duration::from_secs(5)).unwrap().0).collect();
        rest.sort_unstable();
        assert_eq!(rest, ["lease that took a job", "read-only, fsync asked", "write"]);
    }

    fn read_u64(txn: &mut dyn KvRead, key: &[u8]) -> u64 {
        txn.get(key).unwrap().map_or(0, |v| u64::from_be_bytes(v.try_into().unwrap()))
    }

    /// A commit that fails takes down its batches and every batch that read
    /// their writes: no operation acknowledged as done read a write that was
    /// lost, and every one acknowledged is in the store once it is reopened
    /// on a healed disk.
    #[test]
    fn failed_commit_fails_what_ran_on_it_and_keeps_what_was_acknowledged() {
        failing_disk_keeps_what_was_acknowledged(false);
    }

    /// The same, with the log making commits durable: redb's own writes fail
    /// at the next checkpoint, or after a group was logged and acknowledged
    /// (the store then refuses reads too, and reopening replays the log).
    #[test]
    fn failed_checkpoint_keeps_what_was_acknowledged() {
        failing_disk_keeps_what_was_acknowledged(true);
    }

    fn failing_disk_keeps_what_was_acknowledged(logged: bool) {
        let failing = Arc::new(AtomicBool::new(false));
        let memory = Arc::new(InMemoryBackend::new());
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        let open = |failing: &Arc<AtomicBool>| {
            let disk = FailingDisk { memory: Arc::clone(&memory), failing: Arc::clone(failing) };
            let db = Database::builder().create_with_backend(disk).unwrap();
            let wal = logged.then(|| recover(&db, &log).unwrap());
            RedbStore::start(db, &RedbOptions::default(), wal).unwrap()
        };
        let store = open(&failing);
        let (sender, outcomes) = mpsc::channel();
        let mut settled = BTreeMap::new();
        for i in 0u64..3000 {
            if i == 1000 {
                // The first thousand are in; the disk fails while the next run.
                settled.extend(outcomes.iter().take(1000));
                assert!(settled.values().all(Option::is_some), "the disk was fine for the first thousand");
            }
            if i == 1200 {
                failing.store(true, Ordering::SeqCst);
                if logged {
                    // With the log, redb's own writes reach the disk at a
                    // checkpoint: the next commit after this is followed by one.
                    std::thread::sleep(CHECKPOINT_INTERVAL + Duration::from_millis(100));
                }
            }
            if logged && i == 1201 {
                // Operation 1200 is settled, so that checkpoint has started
                // before the rest are committed (in one group with 1200, they
                // would all be acknowledged, durable in the log).
                settled.extend(outcomes.iter().take(201));
            }
            // Each operation takes the next number of a counter, so one that
            // read a lost write would record a number that is taken twice.
            let body: super::super::OpBody = Box::new(move |txn: &mut dyn KvTxn| {
                let next = read_u64(txn, b"counter") + 1;
                txn.put(b"counter", next.to_be_bytes().to_vec())?;
                txn.put(format!("op/{i:05}").as_bytes(), next.to_be_bytes().to_vec())?;
                Ok(Box::new(next) as OpOutput)
            });
            let sender = sender.clone();
            let done: OpDone = Box::new(move |result| {
                let _ = sender.send((i, result.map(|out| *out.downcast::<u64>().unwrap()).ok()));
            });
            store.submit(WriteOp { body, durable: Durable::UnlessRelaxed, brief: true, done });
        }
        drop(sender);
        settled.extend(outcomes.iter());
        let outcomes = settled;
        assert_eq!(outcomes.len(), 3000, "every operation is settled");
        let acknowledged: Vec<u64> = outcomes.values().flatten().copied().collect();
        assert!(acknowledged.len() < 3000, "the failing disk failed some (logged: {logged})");
        let mut numbers = acknowledged.clone();
        numbers.sort_unstable();
        assert_eq!(numbers, (1..=acknowledged.len() as u64).collect::<Vec<_>>(), "no number taken twice or skipped");
        drop(store);
        let store = open(&Arc::new(AtomicBool::new(false)));
        let mut snapshot = store.snapshot().unwrap();
        for (i, outcome) in &outcomes {
            let stored = snapshot.get(format!("op/{i:05}").as_bytes()).unwrap();
            assert_eq!(stored.map(|v| u64::from_be_bytes(v.try_into().unwrap())), *outcome, "operation {i}");
        }
        assert_eq!(read_u64(&mut *snapshot, b"counter"), acknowledged.len() as u64);
    }
}

#[cfg(test)]
mod log_tests {
    use super::*;
    use crate::kv::KvTxn;

    fn put(store: &RedbStore, key: &'static str) {
        put_value(store, key.to_string(), b"v".to_vec());
    }

    fn put_value(store: &RedbStore, key: String, value: Vec<u8>) {
        assert!(try_put_value(store, key.clone(), value), "the write of {key} is acknowledged");
    }

    /// Whether the write was acknowledged.
    fn try_put_value(store: &RedbStore, key: String, value: Vec<u8>) -> bool {
        submit_put(store, key, value, true).recv().unwrap()
    }

    /// Submits a write of `key`; the receiver tells whether it was acknowledged.
    pub(super) fn submit_put(store: &RedbStore, key: String, value: Vec<u8>, sync: bool) -> mpsc::Receiver<bool> {
        submit_put_durable(store, key, value, Durable::needed(sync))
    }

    /// [`submit_put`] of a write as durable as `durable` asks.
    pub(super) fn submit_put_durable(
        store: &RedbStore,
        key: String,
        value: Vec<u8>,
        durable: Durable,
    ) -> mpsc::Receiver<bool> {
        let (sender, receiver) = mpsc::channel();
        let body: super::super::OpBody = Box::new(move |txn: &mut dyn KvTxn| {
            txn.put(key.as_bytes(), value.clone())?;
            Ok(Box::new(()) as OpOutput)
        });
        let done: OpDone = Box::new(move |result| {
            let _ = sender.send(result.is_ok());
        });
        store.submit(WriteOp { body, durable, brief: true, done });
        receiver
    }

    fn relaxed() -> RedbOptions {
        RedbOptions { durability: Durability::Relaxed { flush_interval_ms: 100 }, ..Default::default() }
    }

    /// Under relaxed durability the executor acknowledges a batch before the
    /// committer has logged the batches before it: the committer must not
    /// then take the acknowledged mark back, or a read that follows an
    /// acknowledged write can miss it. Eight writers each read back every
    /// key they put.
    #[test]
    fn a_read_after_a_relaxed_write_sees_it() {
        reads_after_relaxed_writes_see_them(relaxed());
    }

    #[test]
    fn a_read_after_an_immediate_write_sees_it() {
        reads_after_relaxed_writes_see_them(RedbOptions::default());
    }

    /// A read sees an acknowledged write without waiting for the file writer
    /// to write it into redb: it reads the logged batches over the snapshot.
    #[test]
    fn a_read_does_not_wait_for_the_file_writer() {
        for options in [RedbOptions::default(), relaxed()] {
            let dir = tempfile::tempdir().unwrap();
            let store = Arc::new(RedbStore::open(&dir.path().join("jobs.redb"), options).unwrap());
            put_value(&store, "a/before".into(), b"1".to_vec());
            put_value(&store, "a/replaced".into(), b"1".to_vec());
            // Let the file writer write those, then hold it.
            wait_for_file(&store);
            let gate = store.progress.file_gate.lock();
            put_value(&store, "a/held".into(), b"2".to_vec());
            put_value(&store, "a/replaced".into(), b"2".to_vec());
            let (sender, receiver) = mpsc::channel();
            let reader = Arc::clone(&store);
            std::thread::spawn(move || {
                let mut read = reader.snapshot().unwrap();
                let held = read.get(b"a/held").unwrap();
                let scanned = read.scan(&KeyRange::new(b"a/".to_vec(), b"a0".to_vec()), 10, false).unwrap();
                let _ = sender.send((held, scanned));
            });
            let (held, scanned) =
                receiver.recv_timeout(Duration::from_secs(5)).expect("the read waited for the file writer");
            assert_eq!(held, Some(b"2".to_vec()));
            let scanned: Vec<(&[u8], &[u8])> = scanned.iter().map(|(k, v)| (k.as_slice(), v.as_slice())).collect();
            assert_eq!(scanned, [(&b"a/before"[..], &b"1"[..]), (b"a/held", b"2"), (b"a/replaced", b"2")]);
            drop(gate);
            // Once written, the file has them.
            wait_for_file(&store);
            let state = store.progress.state.lock();
            assert!(state.unapplied.is_empty());
            assert_eq!(SnapshotReader(Arc::clone(&state.snapshot)).get(b"a/held").unwrap(), Some(b"2".to_vec()));
        }
    }

    /// Waits until the file writer has written every batch handed to it.
    fn wait_for_file(store: &RedbStore) {
        let mut state = store.progress.state.lock();
        while state.batch < state.published {
            store.progress.changed.wait(&mut state);
        }
    }

    /// The same, with writes run on their callers' threads when the executor
    /// is idle (as a Node host has it).
    #[test]
    fn a_read_after_a_relaxed_write_run_on_its_callers_thread_sees_it() {
        reads_after_relaxed_writes_see_them(RedbOptions { run_on_callers_thread: Some(|| true), ..relaxed() });
    }

    fn reads_after_relaxed_writes_see_them(options: RedbOptions) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(RedbStore::open(&dir.path().join("jobs.redb"), options).unwrap());
        let missing = Arc::new(AtomicUsize::new(0));
        let writers: Vec<_> = (0..8)
            .map(|t| {
                let (store, missing) = (Arc::clone(&store), Arc::clone(&missing));
                std::thread::spawn(move || {
                    for i in 0..3000 {
                        let key = format!("t{t}/k{i}");
                        put_value(&store, key.clone(), b"v".to_vec());
                        if store.snapshot().unwrap().get(key.as_bytes()).unwrap().is_none() {
                            missing.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        for writer in writers {
            writer.join().unwrap();
        }
        assert_eq!(missing.load(Ordering::SeqCst), 0, "reads that lacked a write acknowledged before them");
    }

    /// Callers may run their writes on their own threads, but no write runs
    /// before one submitted earlier: four threads each submit 2,000
    /// increments of their own counter, in turns of 50 without waiting for
    /// the answers and 50 waiting for each, and each increment must find its
    /// predecessor's value. Both ways of running a write must have been taken.
    #[test]
    fn writes_run_on_callers_threads_keep_their_order() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let options = RedbOptions { run_on_callers_thread: Some(|| true), ..relaxed() };
        let store = Arc::new(RedbStore::open(&dir.path().join("jobs.redb"), options).unwrap());
        let out_of_order = Arc::new(AtomicUsize::new(0));
        let on_executor = Arc::new(AtomicUsize::new(0));
        let on_callers = Arc::new(AtomicUsize::new(0));
        const WRITES: u64 = 2000;
        let callers: Vec<_> = (0..4)
            .map(|t| {
                let store = Arc::clone(&store);
                let counters = [&out_of_order, &on_executor, &on_callers].map(Arc::clone);
                std::thread::spawn(move || {
                    let (sender, answers) = mpsc::channel::<bool>();
                    let mut unanswered = 0;
                    for i in 1..=WRITES {
                        if i % 100 >= 50 {
                            for _ in 0..unanswered {
                                assert!(answers.recv().unwrap(), "every write is acknowledged");
                            }
                            unanswered = 0;
                        }
                        unanswered += 1;
                        let [out_of_order, on_executor, on_callers] = counters.clone();
                        let caller = std::thread::current().id();
                        let body: super::super::OpBody = Box::new(move |txn: &mut dyn KvTxn| {
                            let key = format!("counter{t}");
                            let before = txn.get(key.as_bytes())?.map_or(0, |v| read_u64(&v));
                            if before != i - 1 {
                                out_of_order.fetch_add(1, Ordering::SeqCst);
                            }
                            let ran = if std::thread::current().id() == caller { &on_callers } else { &on_executor };
                            ran.fetch_add(1, Ordering::SeqCst);
                            txn.put(key.as_bytes(), i.to_be_bytes().to_vec())?;
                            Ok(Box::new(()) as OpOutput)
                        });
                        let sender = sender.clone();
                        let done: OpDone = Box::new(move |result| {
                            let _ = sender.send(result.is_ok());
                        });
                        store.submit(WriteOp { body, durable: Durable::UnlessRelaxed, brief: true, done });
                    }
                    assert!(answers.iter().take(unanswered).all(|ok| ok), "every write is acknowledged");
                })
            })
            .collect();
        for caller in callers {
            caller.join().unwrap();
        }
        assert_eq!(out_of_order.load(Ordering::SeqCst), 0, "writes that ran before one submitted earlier");
        let mut snapshot = store.snapshot().unwrap();
        for t in 0..4 {
            let value = snapshot.get(format!("counter{t}").as_bytes()).unwrap().map(|v| read_u64(&v));
            assert_eq!(value, Some(WRITES));
        }
        assert!(on_executor.load(Ordering::SeqCst) > 0, "no write ran on the executor");
        assert!(on_callers.load(Ordering::SeqCst) > 0, "no write ran on its caller's thread");
    }

    /// A write that is not brief (a bulk add, a drain) runs on the executor
    /// whatever its caller, while brief ones from the same caller run there.
    #[test]
    fn only_brief_writes_run_on_their_callers_thread() {
        let dir = tempfile::tempdir().unwrap();
        let options = RedbOptions { run_on_callers_thread: Some(|| true), ..relaxed() };
        let store = RedbStore::open(&dir.path().join("jobs.redb"), options).unwrap();
        let caller = std::thread::current().id();
        let ran_here = |brief: bool| {
            let (sender, receiver) = mpsc::channel();
            let body: super::super::OpBody = Box::new(move |txn: &mut dyn KvTxn| {
                txn.put(b"k", b"v".to_vec())?;
                Ok(Box::new(std::thread::current().id() == caller) as OpOutput)
            });
            let done: OpDone = Box::new(move |result| {
                let _ = sender.send(*result.unwrap().downcast::<bool>().unwrap());
            });
            store.submit(WriteOp { body, durable: Durable::UnlessRelaxed, brief, done });
            receiver.recv().unwrap()
        };
        for _ in 0..50 {
            assert!(!ran_here(false), "a write that is not brief ran on its caller's thread");
        }
        assert!((0..50).any(|_| ran_here(true)), "no brief write ran on its caller's thread");
    }

    fn read_u64(value: &[u8]) -> u64 {
        u64::from_be_bytes(value.try_into().expect("eight bytes"))
    }

    /// Under relaxed durability, a failed checkpoint (the redb file fails, the
    /// log does not) leaves writes acknowledged that will not be made durable:
    /// the store refuses reads, and a later write is refused, not
    /// acknowledged and dropped.
    #[test]
    fn a_failed_checkpoint_under_relaxed_durability_refuses_later_writes() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let memory = Arc::new(redb::backends::InMemoryBackend::new());
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        let open = |failing: &Arc<AtomicBool>| {
            let disk = super::tests::FailingDisk { memory: Arc::clone(&memory), failing: Arc::clone(failing) };
            let db = Database::builder().create_with_backend(disk).unwrap();
            let wal = recover(&db, &log).unwrap();
            RedbStore::start(db, &relaxed(), Some(wal)).unwrap()
        };
        let failing = Arc::new(AtomicBool::new(false));
        let store = open(&failing);
        put(&store, "before");
        std::thread::sleep(CHECKPOINT_INTERVAL + Duration::from_millis(100));
        failing.store(true, Ordering::SeqCst);
        // Logged; the checkpoint due after its commit fails on the file.
        put(&store, "trigger");
        std::thread::sleep(Duration::from_millis(300));
        assert!(store.snapshot().is_err(), "reads are refused once acknowledged writes cannot be made durable");
        assert!(!try_put_value(&store, "after".into(), b"v".to_vec()), "a write after the failure is refused");
        drop(store);
        let store = open(&Arc::new(AtomicBool::new(false)));
        let mut snapshot = store.snapshot().unwrap();
        assert!(snapshot.get(b"before").unwrap().is_some());
        assert!(snapshot.get(b"trigger").unwrap().is_some(), "replayed from the log");
        assert!(snapshot.get(b"after").unwrap().is_none(), "a refused write left nothing");
    }

    /// A broken store's committer sleeps: it spun a whole core once a failed
    /// log or checkpoint left a flush due that it could no longer make.
    fn assert_a_broken_store_sleeps(store: &RedbStore) {
        use std::sync::atomic::Ordering;
        std::thread::sleep(Duration::from_millis(300));
        assert!(store.snapshot().is_err(), "the store is broken");
        let before = store.progress.committer_turns.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(500));
        let turns = store.progress.committer_turns.load(Ordering::Relaxed) - before;
        assert!(turns < 10, "an idle broken store's committer went round {turns} times in 500 ms");
    }

    #[test]
    fn a_store_whose_log_failed_sleeps() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let failing = Arc::new(AtomicBool::new(false));
        let store =
            RedbStore::open_with_failing_log(&dir.path().join("jobs.redb"), relaxed(), Arc::clone(&failing)).unwrap();
        put(&store, "before");
        // The flush due 100 ms after that commit fails.
        failing.store(true, Ordering::SeqCst);
        assert_a_broken_store_sleeps(&store);
    }

    #[test]
    fn a_store_whose_checkpoint_failed_sleeps() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let memory = Arc::new(redb::backends::InMemoryBackend::new());
        let dir = tempfile::tempdir().unwrap();
        let failing = Arc::new(AtomicBool::new(false));
        let disk = super::tests::FailingDisk { memory, failing: Arc::clone(&failing) };
        let db = Database::builder().create_with_backend(disk).unwrap();
        let wal = recover(&db, &dir.path().join("log")).unwrap();
        let options = RedbOptions { checkpoint_interval: Duration::from_millis(1), ..relaxed() };
        let store = RedbStore::start(db, &options, Some(wal)).unwrap();
        put(&store, "before");
        std::thread::sleep(Duration::from_millis(50));
        failing.store(true, Ordering::SeqCst);
        put(&store, "trigger");
        assert_a_broken_store_sleeps(&store);
    }

    /// A completion callback that panics (a bug in a host's callback, run on a
    /// store thread) is contained: later commits and reads go on.
    #[test]
    fn a_panicking_completion_callback_stops_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(RedbStore::open(&dir.path().join("jobs.redb"), RedbOptions::default()).unwrap());
        let body: super::super::OpBody = Box::new(|txn: &mut dyn KvTxn| {
            txn.put(b"k", b"v".to_vec())?;
            Ok(Box::new(()) as OpOutput)
        });
        let (panicking, panicked) = mpsc::channel();
        let done: OpDone = Box::new(move |_| {
            let _ = panicking.send(());
            panic!("a bug in the caller's callback");
        });
        store.submit(WriteOp { body, durable: Durable::UnlessRelaxed, brief: true, done });
        panicked.recv().unwrap();
        let (sender, read) = mpsc::channel();
        let reader = Arc::clone(&store);
        std::thread::spawn(move || {
            let _ = sender.send(reader.snapshot().map(|mut s| s.get(b"k").unwrap().is_some()));
        });
        let outcome = read.recv_timeout(Duration::from_secs(5));
        if outcome.is_err() {
            std::mem::forget(store); // its threads are stuck; dropping it would join them
            panic!("a read after the panic still waits after 5 s");
        }
        assert!(matches!(outcome, Ok(Ok(true))), "the write is read back: {outcome:?}");
        put(&store, "later");
    }

    /// A completion callback that reads the store (say, loads the job its
    /// `add` just made) gets its read: the group it waits for was handed on
    /// before the callback ran.
    fn a_read_in_a_completion_callback(durability: Durability) {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(
            RedbStore::open(&dir.path().join("jobs.redb"), RedbOptions { durability, ..Default::default() }).unwrap(),
        );
        let (sender, answer) = mpsc::channel();
        let reader = Arc::clone(&store);
        let body: super::super::OpBody = Box::new(|txn: &mut dyn KvTxn| {
            txn.put(b"k", b"v".to_vec())?;
            Ok(Box::new(()) as OpOutput)
        });
        let done: OpDone = Box::new(move |_| {
            let _ = sender.send(reader.snapshot().map(|mut s| s.get(b"k").unwrap().is_some()));
        });
        store.submit(WriteOp { body, durable: Durable::UnlessRelaxed, brief: true, done });
        let outcome = answer.recv_timeout(Duration::from_secs(5));
        if outcome.is_err() {
            std::mem::forget(store); // its threads are stuck; dropping it would join them
            panic!("{durability:?}: the read in the callback still waits after 5 s");
        }
        assert!(matches!(outcome, Ok(Ok(true))), "{durability:?}: the callback reads its write: {outcome:?}");
    }

    #[test]
    fn a_read_in_a_completion_callback_under_immediate_durability() {
        a_read_in_a_completion_callback(Durability::Immediate);
    }

    #[test]
    fn a_read_in_a_completion_callback_under_relaxed_durability() {
        a_read_in_a_completion_callback(Durability::Relaxed { flush_interval_ms: 100 });
    }

    /// Under relaxed durability the committer waits a little for more
    /// batches before it commits, and a read does not wait for it: a read
    /// right after each acknowledged write sees it without sitting out the
    /// linger (200 of them would take 400 ms if each did).
    #[test]
    fn a_read_after_a_relaxed_write_does_not_wait_for_the_committers_linger() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(&dir.path().join("jobs.redb"), relaxed()).unwrap();
        const PAIRS: u32 = 200;
        let started = Instant::now();
        for i in 0..PAIRS {
            let key = format!("k{i}");
            put_value(&store, key.clone(), b"v".to_vec());
            assert!(store.snapshot().unwrap().get(key.as_bytes()).unwrap().is_some(), "{key} is read back");
        }
        let took = started.elapsed();
        assert!(took < COMMIT_LINGER * PAIRS / 2, "{PAIRS} writes, each read back, took {took:?}");
    }

    /// Under relaxed durability a write is acknowledged before the log has
    /// it. When appending to the log then fails, a read must not show a
    /// state without that write, and a later write must be refused, not
    /// acknowledged and dropped.
    #[test]
    fn a_failed_log_under_relaxed_durability_refuses_reads_and_later_writes() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jobs.redb");
        let failing = Arc::new(AtomicBool::new(false));
        let store = RedbStore::open_with_failing_log(&path, relaxed(), Arc::clone(&failing)).unwrap();
        put(&store, "before");
        assert!(store.snapshot().unwrap().get(b"before").unwrap().is_some());
        // Logged (a read no longer waits for that).
        wait_for_file(&store);
        failing.store(true, Ordering::SeqCst);
        assert!(try_put_value(&store, "lost".into(), b"v".to_vec()), "acknowledged before the log has it");
        // Reads see it until the committer finds the log failed, and are
        // refused from then on: the file would lack an acknowledged write.
        let deadline = Instant::now() + Duration::from_secs(5);
        while let Ok(mut read) = store.snapshot() {
            assert!(read.get(b"lost").unwrap().is_some(), "a read lacks an acknowledged write");
            assert!(Instant::now() < deadline, "reads are still served after the log failed");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!try_put_value(&store, "after".into(), b"v".to_vec()), "a write after the failure is refused");
        drop(store);
        let store = RedbStore::open(&path, relaxed()).unwrap();
        let mut snapshot = store.snapshot().unwrap();
        assert!(snapshot.get(b"before").unwrap().is_some(), "what the log had is replayed");
        assert!(snapshot.get(b"after").unwrap().is_none(), "a refused write left nothing");
        assert!(try_put_value(&store, "reopened".into(), b"v".to_vec()), "the reopened store takes writes");
    }

    /// With batches of one operation, each batch runs over the writes of the
    /// many batches still being committed before it: 300 increments of one
    /// counter submitted at once each see the count the one before left.
    #[test]
    fn small_batches_read_the_uncommitted_writes_before_them() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            RedbStore::open(&dir.path().join("jobs.redb"), RedbOptions { max_batch: 1, ..Default::default() }).unwrap();
        const INCREMENTS: u64 = 300;
        let (sender, receiver) = mpsc::channel();
        for _ in 0..INCREMENTS {
            let sender = sender.clone();
            let body: super::super::OpBody = Box::new(|txn: &mut dyn KvTxn| {
                let seen = txn.get(b"count")?.map_or(0, |v| u64::from_be_bytes(v.try_into().unwrap_or_default()));
                txn.put(b"count", (seen + 1).to_be_bytes().to_vec())?;
                Ok(Box::new(seen) as OpOutput)
            });
            let done: OpDone = Box::new(move |result| {
                let _ = sender.send(result.ok().and_then(|seen| seen.downcast::<u64>().ok()).map(|seen| *seen));
            });
            store.submit(WriteOp { body, durable: Durable::UnlessRelaxed, brief: true, done });
        }
        let mut seen: Vec<u64> = (0..INCREMENTS).map(|_| receiver.recv().unwrap().expect("acknowledged")).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..INCREMENTS).collect::<Vec<_>>());
        let count = store.snapshot().unwrap().get(b"count").unwrap().unwrap();
        assert_eq!(count, INCREMENTS.to_be_bytes().to_vec());
    }

    /// Across checkpoints: writes that fill the log past half start it over
    /// under a new generation, the older records left behind in the file, and
    /// a kill after more writes brings every write back while the stale records
    /// are not replayed over them. (Eight keys written in turn with equal-sized
    /// values, so a stale record lines up right after the new ones, and each of
    /// its keys has a newer value since.)
    #[test]
    fn writes_after_a_checkpoint_are_replayed_and_stale_records_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jobs.redb");
        let store = RedbStore::open(&path, RedbOptions::default()).unwrap();
        let value = |n: usize| {
            let mut v = vec![0u8; 256 << 10];
            v[..8].copy_from_slice(&(n as u64).to_be_bytes());
            v
        };
        const WRITES: usize = 80;
        for n in 0..WRITES {
            put_value(&store, format!("k{}", n % 8), value(n));
        }
        let copy = dir.path().join("killed.redb");
        std::fs::copy(log_path(&path), log_path(&copy)).unwrap();
        std::fs::copy(&path, &copy).unwrap();
        drop(store);
        let reopened = RedbStore::open(&copy, RedbOptions::default()).unwrap();
        let mut snapshot = reopened.snapshot().unwrap();
        for key in 0..8 {
            let last = (0..WRITES).filter(|n| n % 8 == key).max().unwrap();
            assert_eq!(snapshot.get(format!("k{key}").as_bytes()).unwrap(), Some(value(last)), "k{key}");
        }
    }

    /// What a kill -9 leaves: the file and its log as they are on disk while
    /// the store runs. Every acknowledged write is there after reopening.
    #[test]
    fn acknowledged_writes_are_replayed_from_the_log_after_a_kill() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jobs.redb");
        let store = RedbStore::open(&path, RedbOptions::default()).unwrap();
        for key in ["a", "b", "c"] {
            put(&store, key);
        }
        let copy = dir.path().join("killed.redb");
        std::fs::copy(log_path(&path), log_path(&copy)).unwrap();
        std::fs::copy(&path, &copy).unwrap();
        let bare = dir.path().join("bare.redb");
        std::fs::copy(&path, &bare).unwrap();
        drop(store);
        let reopened = RedbStore::open(&copy, RedbOptions::default()).unwrap();
        let mut snapshot = reopened.snapshot().unwrap();
        for key in ["a", "b", "c"] {
            assert_eq!(snapshot.get(key.as_bytes()).unwrap(), Some(b"v".to_vec()), "{key}");
        }
        // The file alone lacks them (its commits were not fsynced): the log
        // is what kept them.
        let bare = RedbStore::open(&bare, RedbOptions::default()).unwrap();
        let mut snapshot = bare.snapshot().unwrap();
        assert!(["a", "b", "c"].iter().any(|k| snapshot.get(k.as_bytes()).unwrap().is_none()));
    }
}

#[cfg(test)]
mod checkpoint_tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use redb::backends::InMemoryBackend;

    use super::log_tests::{submit_put, submit_put_durable};
    use super::tests::{Gate, GatedDisk};
    use super::*;

    fn submit(store: &RedbStore, key: &str, value: Vec<u8>, sync: bool) -> mpsc::Receiver<bool> {
        submit_put(store, key.to_string(), value, sync)
    }

    /// Relaxed durability loses at most the last flush interval (100 ms) of
    /// acknowledged writes, however slow a checkpoint's durable redb commit:
    /// the committer goes on appending and flushing the log meanwhile (it
    /// used to stop, waiting for it, when the next checkpoint came due).
    fn slow_checkpoint(kill: bool) {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        let held = Arc::new((parking_lot::Mutex::new(false), parking_lot::Condvar::new()));
        let disk = GatedDisk { memory: InMemoryBackend::new(), held: Arc::clone(&held) };
        let db = Database::builder().create_with_backend(disk).unwrap();
        let mut wal = recover(&db, &log).unwrap();
        let failing = Arc::new(AtomicBool::new(false));
        wal.fail_while(Arc::clone(&failing));
        let options = RedbOptions {
            durability: Durability::Relaxed { flush_interval_ms: 100 },
            checkpoint_interval: Duration::from_millis(1),
            ..Default::default()
        };
        let store = RedbStore::start(db, &options, Some(wal)).unwrap();
        // From now on redb's fsync takes as long as the test wants (a slow disk).
        *held.0.lock() = true;
        let gate = Gate(held);
        assert!(submit(&store, "a", b"1".to_vec(), true).recv().unwrap());
        std::thread::sleep(Duration::from_millis(50)); // logged; its checkpoint waits on redb's fsync
        assert!(submit(&store, "b", b"2".to_vec(), true).recv().unwrap());
        std::thread::sleep(Duration::from_millis(50)); // logged, unsynced; the next checkpoint is due
        let outcome = if kill {
            assert!(submit(&store, "c", b"3".to_vec(), true).recv().unwrap());
            std::thread::sleep(Duration::from_millis(400)); // four flush intervals
            // What a kill -9 leaves now: the log as it is.
            let copy = dir.path().join("copy");
            std::fs::copy(&log, &copy).unwrap();
            let (_, records) = super::super::wal::Wal::open(&copy, 2, LOG_CAPACITY).unwrap();
            let logged: Vec<&[u8]> = records.iter().flat_map(|w| w.keys().map(Vec::as_slice)).collect();
            (logged.contains(&&b"c"[..]), format!("c, acknowledged 400 ms ago, is in the log (logged keys {logged:?})"))
        } else {
            // From here a log fsync fails: if the committer tries one, the
            // relaxed store breaks and refuses reads.
            failing.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(400)); // four flush intervals
            (store.snapshot().is_err(), "a log fsync was attempted for b within 450 ms of its acknowledgement".into())
        };
        gate.release();
        drop(store);
        assert!(outcome.0, "{}", outcome.1);
    }

    #[test]
    fn relaxed_ack_is_appended_to_the_log_during_a_slow_checkpoint() {
        slow_checkpoint(true);
    }

    #[test]
    fn relaxed_ack_is_fsynced_within_the_flush_interval_during_a_slow_checkpoint() {
        slow_checkpoint(false);
    }

    /// Under relaxed durability a write that waits for its fsync, followed by
    /// one answered at once, is readable once it is answered: published in
    /// the order the batches ran, not left behind the later one's mark.
    #[test]
    fn a_write_durable_always_is_readable_once_answered_after_a_later_relaxed_one() {
        let dir = tempfile::tempdir().unwrap();
        let options = RedbOptions { durability: Durability::Relaxed { flush_interval_ms: 100 }, ..Default::default() };
        let store = RedbStore::open(&dir.path().join("jobs.redb"), options).unwrap();
        // The file writer waits: reads see only what was published.
        let gate = store.progress.file_gate.lock();
        let always = submit_put_durable(&store, "always".into(), b"1".to_vec(), Durable::Always);
        // Long enough for it to run as a batch of its own.
        std::thread::sleep(Duration::from_millis(1));
        assert!(submit(&store, "relaxed", b"2".to_vec(), true).recv().unwrap());
        assert!(always.recv().unwrap());
        let seen = store.snapshot().unwrap().get(b"always").unwrap();
        drop(gate);
        assert!(seen.is_some(), "an answered Durable::Always write is not readable");
    }

    /// A store under relaxed durability (a flush a minute) over a log whose
    /// fsyncs fail, appends not, until the flag is cleared.
    fn relaxed_with_failing_fsyncs(path: &Path) -> (RedbStore, Arc<AtomicBool>) {
        let db = Database::builder().create(path).unwrap();
        let mut wal = recover(&db, &log_path(path)).unwrap();
        let failing = Arc::new(AtomicBool::new(true));
        wal.fail_syncs_while(Arc::clone(&failing));
        let options = RedbOptions { durability: Durability::relaxed(60_000), ..Default::default() };
        (RedbStore::start(db, &options, Some(wal)).unwrap(), failing)
    }

    /// Under relaxed durability a write that must be durable whatever the
    /// durability (the store's open count) is answered after its fsync, so
    /// an fsync that fails fails it; the others are answered before theirs.
    #[test]
    fn a_write_durable_always_waits_for_its_fsync_under_relaxed_durability() {
        let dir = tempfile::tempdir().unwrap();
        let (store, failing) = relaxed_with_failing_fsyncs(&dir.path().join("jobs.redb"));
        assert!(submit(&store, "relaxed", b"1".to_vec(), true).recv().unwrap(), "answered before its fsync");
        let answer = submit_put_durable(&store, "always".into(), b"2".to_vec(), Durable::Always);
        assert!(!answer.recv().unwrap(), "answered only after its fsync, which failed");
        failing.store(false, Ordering::SeqCst);
    }

    /// The queue core's open count is such a write: under relaxed durability
    /// an open whose count cannot be made durable fails.
    #[test]
    fn a_relaxed_open_waits_for_its_open_count_to_be_durable() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _failing) = relaxed_with_failing_fsyncs(&dir.path().join("jobs.redb"));
        let config = crate::Config { durability: Durability::relaxed(60_000), background: false, ..Default::default() };
        let opened = crate::Jobs::with_store(Box::new(store), Arc::new(crate::SystemClock), config);
        assert!(opened.is_err(), "opened with its open count not durable");
    }

    /// A group too large for the log is committed durably to redb as a
    /// checkpoint: once that succeeded its operations succeeded, whatever the
    /// log's restart after it does (its fsync of records the checkpoint made
    /// redundant failing breaks the store for later commits only). They were
    /// answered as failed, with their writes durable and visible.
    #[test]
    fn an_operation_answered_as_failed_leaves_no_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jobs.redb");
        let failing = Arc::new(AtomicBool::new(false));
        let store = RedbStore::open_with_failing_log(&path, RedbOptions::default(), Arc::clone(&failing)).unwrap();
        // A write that needs no fsync (a lease): logged, acknowledged, unsynced.
        assert!(submit(&store, "lease", b"l".to_vec(), false).recv().unwrap());
        failing.store(true, Ordering::SeqCst);
        // Larger than a region: checkpointed into redb instead of logged.
        let big = vec![7u8; (LOG_CAPACITY + 1024) as usize];
        let acked = submit(&store, "big", big, true).recv().unwrap();
        let visible = store.snapshot().unwrap().get(b"big").unwrap().is_some();
        drop(store);
        let reopened = RedbStore::open(&path, RedbOptions::default()).unwrap();
        let after_reopen = reopened.snapshot().unwrap().get(b"big").unwrap().is_some();
        assert!(
            acked || (!visible && !after_reopen),
            "answered failed (acked={acked}) yet visible to reads: {visible}, in the file after reopen: {after_reopen}"
        );
    }
}
