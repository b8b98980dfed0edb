//! One open core per data dir per process.
//!
//! redb takes an exclusive lock on its file, so a process can open a store
//! once; every backend (every Queue, Worker, QueueEvents and FlowProducer)
//! that names the same data dir shares that one open [`Jobs`]. The store is
//! closed when the last backend using it closes, so a later open (in this
//! process or another) finds it free.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use loam_jobs::store::placement::CallerWaits;
use loam_jobs::store::redb::{RedbOptions, RedbStore};
use loam_jobs::{Config, Durability, FollowingClock, Jobs, StoreError};

use crate::error::store_error;

/// The store file inside a data dir.
pub const STORE_FILE: &str = "jobs.redb";

/// How long an open waits for this process's own previous use of a data dir
/// to let go of the file (operations still in flight when it was closed).
const REOPEN_GRACE: Duration = Duration::from_secs(2);

/// The executor's batch limit in a Node host, whose main thread processes
/// every answer on the same cores as the store's threads: BullMQ at
/// concurrency 100 went from 32,400 to 35,350 jobs/s (medians of 14
/// interleaved pairs, 10 won) with 48 instead of the store's default 4,096,
/// which suits a server's waiting clients better (its core bench at 64
/// threads lost 5-20% with 48).
const IN_PROCESS_MAX_BATCH: usize = 48;

/// One open store, shared by the backends that use its data dir.
pub struct SharedStore {
    /// None once the last backend closed it. Callers take a clone per call,
    /// so dropping this one (and the clones of calls in flight) drops the
    /// core and with it the file lock.
    jobs: Mutex<Option<Jobs>>,
    /// The core's time, which follows the host's `Date.now()` (BullMQ's Redis
    /// scripts take their time from the caller, and its tests fake it).
    clock: Arc<FollowingClock>,
    pub dir: PathBuf,
}

thread_local! {
    /// The `Date.now()` the call under way on this thread reported (0 = none
    /// yet): its operations run at exactly that time, as Redis scripts do.
    /// Per thread, not per store: writes report theirs on the JavaScript
    /// thread, but reads on napi's runtime threads, and one store-wide value
    /// let a read's time land between a write's report and its use.
    static CALL_NOW_MS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

impl SharedStore {
    /// JavaScript's `Date.now()` at the call; every call reports it.
    pub fn observe(&self, host_now_ms: f64) {
        if host_now_ms.is_finite() && host_now_ms >= 0.0 {
            self.clock.observe(host_now_ms as u64);
            CALL_NOW_MS.set(host_now_ms as u64);
        }
    }

    /// The core, for one call; an error once the store was closed.
    pub fn jobs(&self) -> napi::Result<Jobs> {
        let jobs = self
            .jobs
            .lock()
            .clone()
            .ok_or_else(|| napi::Error::from_reason("[loam:unavailable] the backend is closed"))?;
        // Every call reports its time before it asks for the core, on the
        // thread it asks on, with no await between: this is its time.
        Ok(match CALL_NOW_MS.get() {
            0 => jobs,
            now => jobs.at(now),
        })
    }
}

struct Entry {
    store: Arc<SharedStore>,
    users: usize,
    /// What it was opened with: a store has one durability, whoever joins it.
    durability: Durability,
}

fn registry() -> &'static Mutex<HashMap<PathBuf, Entry>> {
    static REGISTRY: OnceLock<Mutex<HashMap<PathBuf, Entry>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Data dirs this process opened and closed again.
fn closed_here() -> &'static Mutex<HashSet<PathBuf>> {
    static CLOSED: OnceLock<Mutex<HashSet<PathBuf>>> = OnceLock::new();
    CLOSED.get_or_init(Default::default)
}

/// Opens the redb file. When this process itself closed the store a moment
/// ago, the file stays locked until that core's last in-flight call drops
/// it; wait for that rather than reporting another process.
fn open_file(dir: &Path, shown: &str, durability: Durability) -> napi::Result<RedbStore> {
    let file = dir.join(STORE_FILE);
    let retry_until = closed_here().lock().contains(dir).then(|| Instant::now() + REOPEN_GRACE);
    // Under relaxed durability a write is answered as soon as it has run, so
    // one that runs on the JavaScript thread is answered before the call
    // returns: no round trip to the store's threads and back, which bounded
    // a one-at-a-time add. Under immediate durability the answer waits for
    // the fsync and comes through the committer either way; running the
    // write here measured no gain there.
    let relaxed = matches!(durability, Durability::Relaxed { .. });
    let options = || RedbOptions {
        durability,
        max_batch: IN_PROCESS_MAX_BATCH,
        run_on_callers_thread: relaxed.then_some(crate::promise::caller_waits as CallerWaits),
        ..Default::default()
    };
    loop {
        match RedbStore::open(&file, options()) {
            Ok(store) => return Ok(store),
            Err(StoreError::Locked(_)) if retry_until.is_some_and(|t| Instant::now() < t) => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(store_error(shown, e)),
        }
    }
}

/// Settings used when a data dir is opened for the first time in the process.
#[derive(Clone, Copy, Debug)]
pub struct OpenOptions {
    pub durability: Durability,
}

/// Why `dir` could not be made: a path that is no directory, or not the
/// process's to write, is the caller's setting to fix (retrying changes
/// nothing); a failing disk may pass.
fn data_dir_error(shown: &str, e: &std::io::Error) -> napi::Error {
    use std::io::ErrorKind::{
        AlreadyExists, InvalidFilename, InvalidInput, NotADirectory, PermissionDenied, ReadOnlyFilesystem,
    };
    let code = match e.kind() {
        AlreadyExists | NotADirectory | PermissionDenied | ReadOnlyFilesystem | InvalidInput | InvalidFilename => {
            "invalid_argument"
        }
        _ => "unavailable",
    };
    napi::Error::from_reason(format!("[loam:{code}] cannot create data dir {shown}: {e}"))
}

/// Opens the store in `dir` (creating the dir), or joins the process's open one.
pub fn acquire(dir: &Path, options: OpenOptions) -> napi::Result<Arc<SharedStore>> {
    let shown = dir.display().to_string();
    std::fs::create_dir_all(dir).map_err(|e| data_dir_error(&shown, &e))?;
    let canonical = dir
        .canonicalize()
        .map_err(|e| napi::Error::from_reason(format!("[loam:unavailable] cannot resolve data dir {shown}: {e}")))?;
    let mut open = registry().lock();
    if let Some(entry) = open.get_mut(&canonical) {
        // Joined silently, a backend asking for immediate durability would
        // get a relaxed store's, and could lose writes it was told were safe.
        if entry.durability != options.durability {
            return Err(napi::Error::from_reason(format!(
                "[loam:failed_precondition] the store in {shown} is open in this process with {}; this backend asks \
                 for {}. Every backend of one data directory must use the same durability (and flush interval)",
                describe(entry.durability),
                describe(options.durability),
            )));
        }
        entry.users += 1;
        return Ok(Arc::clone(&entry.store));
    }
    let redb = open_file(&canonical, &shown, options.durability)?;
    let config = Config { durability: options.durability, ..Config::default() };
    let clock = Arc::new(FollowingClock::new());
    // Job times follow the host (BullMQ passes its own); leases run in real
    // time, as Redis lock TTLs do, so a host that fakes time keeps its locks.
    let jobs = Jobs::with_clocks(
        Box::new(redb),
        Arc::clone(&clock) as Arc<dyn loam_jobs::Clock>,
        Arc::new(loam_jobs::SystemClock),
        config,
    )
    .map_err(|e| napi::Error::from_reason(format!("[loam:unavailable] cannot start the queue core in {shown}: {e}")))?;
    let store = Arc::new(SharedStore { jobs: Mutex::new(Some(jobs)), clock, dir: canonical.clone() });
    open.insert(canonical, Entry { store: Arc::clone(&store), users: 1, durability: options.durability });
    Ok(store)
}

fn describe(durability: Durability) -> String {
    match durability {
        Durability::Immediate => "durability 'immediate'".into(),
        Durability::Relaxed { flush_interval_ms } => {
            format!("durability 'relaxed' (flushIntervalMs {flush_interval_ms})")
        }
    }
}

/// Gives back one use of `store`; the last one closes it. Runs the close
/// under the registry lock so a concurrent open waits for the file lock to
/// be released instead of failing on it.
pub fn release(store: &SharedStore) {
    let mut open = registry().lock();
    let Some(entry) = open.get_mut(&store.dir) else {
        return;
    };
    entry.users = entry.users.saturating_sub(1);
    if entry.users == 0
        && let Some(entry) = open.remove(&store.dir)
        && let Some(jobs) = entry.store.jobs.lock().take()
    {
        jobs.close();
        closed_here().lock().insert(store.dir.clone());
    }
}
