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
//!
//! Each thread has its module: [`executor`], [`committer`], [`file_writer`];
//! [`progress`] is what they and the readers share of the committed state.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::placement::{CallerWaits, Placement};
#[cfg(test)]
use super::wal::LogFile;
use super::wal::Wal;
use super::{Durability, Durable, OpDone, OpOutput, Store, WriteOp};
use crate::error::{JobsError, StoreError};
use crate::kv::{Key, KeyRange, KvRead, Memo, Overlay, PendingBatches, ReadAhead, Stacked, Value, Writes, net_writes};

#[cfg(test)]
mod checkpoint_tests;
mod committer;
mod executor;
mod file_writer;
#[cfg(test)]
mod log_tests;
#[cfg(test)]
mod power_cut_tests;
mod progress;
#[cfg(test)]
mod tests;

use committer::{Committer, File, Group, ToFile};
use executor::{Batch, Executor, ExecutorState, Uncommitted};
use file_writer::FileWriter;
use progress::{Committed, Progress, deliver};

const TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("loam_jobs");
/// The write-ahead log's generation (see [`super::wal`]), set by each checkpoint.
const LOG_TABLE: TableDefinition<&str, u64> = TableDefinition::new("loam_jobs_log");
const LOG_GENERATION: &str = "generation";
/// The log's salt (see [`super::wal`]), drawn at each open; a file from
/// before salts has none.
const LOG_SALT: &str = "salt";

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

/// A write transaction whose commit is durable, and saves redb's allocator
/// state with it ("quick repair"), so that an open after a crash loads that
/// state instead of walking the whole file to rebuild it: after a `kill -9`
/// that walk held the open (on a Node host's event loop, where the store was
/// opened then) for 6 s at 4 GB of jobs and 38 s at 12 GB. Every
/// durable commit must save it: one that does not drops the saved state.
fn begin_durable_write(db: &Database) -> Result<redb::WriteTransaction, StoreError> {
    let mut txn = db.begin_write().map_err(io)?;
    txn.set_durability(redb::Durability::Immediate).map_err(io)?;
    txn.set_quick_repair(true);
    Ok(txn)
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

    /// A logged store on `db` and `log_file` as they are: what a power cut
    /// left of them, in tests.
    #[cfg(test)]
    fn open_on(db: Database, log_file: Box<dyn LogFile>, options: RedbOptions) -> Result<Self, StoreError> {
        let wal = recover_with(&db, |log| log.open_on(log_file))?;
        Self::start(db, &options, Some(wal))
    }

    /// [`open`](RedbStore::open), with a log that `set_up` prepares: to
    /// fail on cue, a disk that fails under the log only.
    #[cfg(test)]
    fn open_with_log(path: &Path, options: RedbOptions, set_up: impl FnOnce(&mut Wal)) -> Result<Self, StoreError> {
        let db = Database::builder().create(path).map_err(io)?;
        let mut wal = recover(&db, &log_path(path))?;
        set_up(&mut wal);
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
        let txn = begin_durable_write(&db)?;
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
            log_broken: false,
            file,
            checkpoint_interval: options.checkpoint_interval,
            last_checkpoint: Instant::now(),
            checkpointing: None,
        };
        // Before any batch can run: the executor answers early only what
        // the log's room takes.
        progress.log_room.taken(0, committer.room());
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
            stopped_by_itself: AtomicBool::new(false),
            #[cfg(test)]
            faulty: AtomicBool::new(false),
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

/// Which log [`recover`] asks for: its generation and salt, as the file
/// stores them, or a fresh log.
struct LogToOpen {
    generation: u64,
    salt: Option<u64>,
    /// The file never logged (its first open stores a generation durably
    /// before anything is logged), so a log beside it is another store's
    /// (a `jobs.redb` deleted to start over, its log left), whose records
    /// pass for this file's generations, which every file counts from the
    /// same start: replayed, the deleted store's writes came back. It goes,
    /// and a log is made afresh.
    stale: bool,
}

impl LogToOpen {
    fn open(&self, path: &Path) -> std::io::Result<(Wal, Vec<Writes>)> {
        if self.stale {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Wal::open(path, self.generation, self.salt, LOG_CAPACITY)
    }

    #[cfg(test)]
    fn open_on(&self, file: Box<dyn LogFile>) -> std::io::Result<(Wal, Vec<Writes>)> {
        if self.stale {
            file.set_len(0)?;
        }
        Wal::open_on(file, self.generation, self.salt, LOG_CAPACITY)
    }
}

/// Replays what the log at `path` holds beyond the file's last durable
/// commit (what a crash left only in the log), in one durable commit that
/// also starts the log's generation after the two it may have replayed (the
/// second's records stay in their region, and must not pass for a later
/// generation's).
fn recover(db: &Database, path: &Path) -> Result<Wal, StoreError> {
    recover_with(db, |log| log.open(path))
}

/// [`recover`] with the log that `open_log` opens.
fn recover_with(
    db: &Database,
    open_log: impl FnOnce(LogToOpen) -> std::io::Result<(Wal, Vec<Writes>)>,
) -> Result<Wal, StoreError> {
    let (generation, salt) = {
        let txn = db.begin_read().map_err(io)?;
        match txn.open_table(LOG_TABLE) {
            Ok(table) => {
                let get = |key| Ok::<_, StoreError>(table.get(key).map_err(io)?.map(|v| v.value()));
                (get(LOG_GENERATION)?, get(LOG_SALT)?)
            }
            Err(redb::TableError::TableDoesNotExist(_)) => (None, None),
            Err(e) => return Err(io(e)),
        }
    };
    let stale = generation.is_none();
    let generation = generation.unwrap_or(0);
    let (mut wal, records) = open_log(LogToOpen { generation, salt, stale }).map_err(io)?;
    let salt = rand::random::<u64>();
    let txn = begin_durable_write(db)?;
    {
        let mut table = txn.open_table(TABLE).map_err(io)?;
        for writes in &records {
            apply(&mut table, writes)?;
        }
    }
    store_generation(&txn, generation + 2)?;
    txn.open_table(LOG_TABLE).map_err(io)?.insert(LOG_SALT, salt).map_err(io)?;
    txn.commit().map_err(io)?;
    wal.restart_salted(generation + 2, Some(salt)).map_err(io)?;
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
        // Refused once closed, or when the executor's thread is gone while
        // the store is open (it stopped by itself).
        let rejected = match self.sender.lock().as_ref() {
            Some(sender) => {
                self.executor.queued.fetch_add(1, Ordering::AcqRel);
                sender.send(op).err().map(|e| {
                    self.executor.queued.fetch_sub(1, Ordering::AcqRel);
                    (e.0, StoreError::Stopped)
                })
            }
            None => Some((op, StoreError::Closed)),
        };
        if let Some((op, e)) = rejected {
            (op.done)(Err(e.into()));
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

    fn failure(&self) -> Option<StoreError> {
        // Held throughout: a close under way takes it first, and its threads
        // then end as they should.
        let sender = self.sender.lock();
        sender.as_ref()?;
        if let Some(e) = self.progress.state.lock().refusal() {
            return Some(e);
        }
        // Open, yet the executor took no more batches or a thread of the
        // store ended: every write is refused.
        let stopped = self.executor.stopped_by_itself.load(Ordering::Acquire)
            || self.threads.lock().iter().any(JoinHandle::is_finished);
        stopped.then_some(StoreError::Stopped)
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
