//! The embedded engine: one redb file, one writer thread, group commit.
//!
//! Callers on any thread submit operations to a channel. The writer takes every
//! operation waiting in the channel, runs each in its own [`Overlay`] over the
//! batch's overlay (so a failed operation leaves nothing behind), writes the
//! batch's net changes into one redb write transaction, commits it with one
//! fsync, and only then acknowledges the operations. While one batch is being
//! fsynced, the next one queues up, so the fsync cost is shared by every caller
//! that arrived during it.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::{Durability, OpOutput, Store, WriteOp};
use crate::error::{JobsError, StoreError};
use crate::kv::{Key, KeyRange, KvRead, Overlay, Value};

const TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("loam_jobs");

/// Most operations one write transaction takes; bounds the latency a large
/// backlog adds to the first operation of a batch.
const MAX_BATCH: usize = 4096;

/// How long non-durable commits (leases) may stay unflushed under immediate
/// durability, when no durable commit comes along to carry them.
const IMMEDIATE_MODE_IDLE_FLUSH: Duration = Duration::from_millis(100);

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
    db: Arc<Database>,
    sender: Mutex<Option<Sender<WriteOp>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
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
        let (sender, receiver) = mpsc::channel();
        let writer_db = Arc::clone(&db);
        let writer = std::thread::Builder::new()
            .name("loam-jobs-writer".into())
            .spawn(move || Writer { db: writer_db, durability, unflushed_since: None }.run(receiver))
            .map_err(io)?;
        Ok(Self { db, sender: Mutex::new(Some(sender)), writer: Mutex::new(Some(writer)) })
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

    fn snapshot(&self) -> Result<Box<dyn KvRead + Send>, StoreError> {
        let txn = self.db.begin_read().map_err(io)?;
        let table = txn.open_table(TABLE).map_err(io)?;
        Ok(Box::new(RedbSnapshot { table }))
    }

    fn close(&self) {
        drop(self.sender.lock().take());
        if let Some(writer) = self.writer.lock().take() {
            // The last handle can be dropped by an operation's completion
            // callback, which runs on the writer thread itself: that thread
            // then finishes its queue and flushes on its own.
            if writer.thread().id() != std::thread::current().id() {
                let _ = writer.join();
            }
        }
    }
}

impl Drop for RedbStore {
    fn drop(&mut self) {
        self.close();
    }
}

type RawEntry<'a> = (redb::AccessGuard<'a, &'static [u8]>, redb::AccessGuard<'a, &'static [u8]>);

struct RedbSnapshot {
    table: redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
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

impl KvRead for RedbSnapshot {
    fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        Ok(self.table.get(key).map_err(io)?.map(|v| v.value().to_vec()))
    }
    fn scan(&mut self, range: &KeyRange, limit: usize, reverse: bool) -> Result<Vec<(Key, Value)>, StoreError> {
        scan_table(&self.table, range, limit, reverse)
    }
}

struct WriteTable<'a, 'txn>(&'a mut redb::Table<'txn, &'static [u8], &'static [u8]>);

impl KvRead for WriteTable<'_, '_> {
    fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        Ok(self.0.get(key).map_err(io)?.map(|v| v.value().to_vec()))
    }
    fn scan(&mut self, range: &KeyRange, limit: usize, reverse: bool) -> Result<Vec<(Key, Value)>, StoreError> {
        scan_table(&*self.0, range, limit, reverse)
    }
}

struct Writer {
    db: Arc<Database>,
    durability: Durability,
    /// When the oldest commit not yet flushed to disk was made.
    unflushed_since: Option<Instant>,
}

impl Writer {
    fn flush_interval(&self) -> Duration {
        match self.durability {
            Durability::Immediate => IMMEDIATE_MODE_IDLE_FLUSH,
            Durability::Relaxed { flush_interval_ms } => Duration::from_millis(flush_interval_ms),
        }
    }

    fn run(mut self, receiver: Receiver<WriteOp>) {
        loop {
            let first = match self.unflushed_since {
                None => match receiver.recv() {
                    Ok(op) => op,
                    Err(_) => break,
                },
                Some(since) => {
                    let wait = self.flush_interval().saturating_sub(since.elapsed());
                    match receiver.recv_timeout(wait) {
                        Ok(op) => op,
                        Err(RecvTimeoutError::Timeout) => {
                            self.flush();
                            continue;
                        }
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
            };
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match receiver.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(_) => break,
                }
            }
            self.commit_batch(batch);
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

    fn commit_batch(&mut self, batch: Vec<WriteOp>) {
        let needs_sync = match self.durability {
            Durability::Immediate => batch.iter().any(|op| op.sync),
            Durability::Relaxed { .. } => false,
        };
        let mut results: Vec<Result<OpOutput, JobsError>> = Vec::with_capacity(batch.len());
        let (bodies, dones): (Vec<_>, Vec<_>) = batch.into_iter().map(|op| (op.body, op.done)).unzip();
        let outcome = (|| -> Result<(), StoreError> {
            let mut txn = self.db.begin_write().map_err(io)?;
            txn.set_durability(if needs_sync { redb::Durability::Immediate } else { redb::Durability::None })
                .map_err(io)?;
            {
                let mut table = txn.open_table(TABLE).map_err(io)?;
                let writes = {
                    let mut base = WriteTable(&mut table);
                    let mut group = Overlay::caching(&mut base);
                    for mut body in bodies {
                        let mut local = Overlay::new(&mut group);
                        // A bug in an operation must fail that operation, not the
                        // writer thread and with it every caller (and a Node host).
                        let result = catch_unwind(AssertUnwindSafe(|| body(&mut local)))
                            .unwrap_or_else(|panic| Err(JobsError::Internal(panic_message(panic))));
                        let local = local.into_writes();
                        if result.is_ok() {
                            group.absorb(local);
                        }
                        results.push(result);
                    }
                    group.into_writes()
                };
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
            txn.commit().map_err(io)?;
            Ok(())
        })();
        match outcome {
            Ok(()) => {
                if needs_sync {
                    self.unflushed_since = None;
                } else if self.unflushed_since.is_none() {
                    self.unflushed_since = Some(Instant::now());
                }
                for (done, result) in dones.into_iter().zip(results) {
                    done(result);
                }
            }
            Err(e) => {
                let err = JobsError::from(e);
                for done in dones {
                    done(Err(err.clone()));
                }
            }
        }
    }
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string());
    format!("operation panicked: {text}")
}
