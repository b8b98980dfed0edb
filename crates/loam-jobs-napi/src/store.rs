//! One open core per data dir per process.
//!
//! redb takes an exclusive lock on its file, so a process can open a store
//! once; every backend (every Queue, Worker, QueueEvents and FlowProducer)
//! that names the same data dir shares that one open [`Jobs`]. The store is
//! closed when the last backend using it closes, so a later open (in this
//! process or another) finds it free.
//!
//! The open itself runs on a thread of its own: after a crash it replays the
//! log and loads redb's allocator state (42-366 ms on a 6.4 GB file, a full
//! repair of a file an older build left 37 s), and a reopen of a dir this
//! process just closed waits for that close; none of it may hold up Node's
//! event loop. A backend is made at once; its calls wait for the open
//! ([`SharedStore::opened`]) and fail with its error if it failed.
//!
//! A store that failed, at its open (another process held the file) or
//! later (a full disk under it; redb then refuses every write until the
//! file is reopened), is opened again on the same thread of its own when a
//! call finds it so ([`SharedStore::reopen`]), at most once a second, or
//! at once for a backend made on it: as Redis's client reconnects by
//! itself, an app's Queue and Worker go on once the cause is gone. The open
//! replays the log, as after a crash: under immediate durability nothing
//! acknowledged is lost (under relaxed, what a crash loses), and a job whose
//! lease the failure cut short is redelivered once it expires.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use event_listener::Event;
use parking_lot::Mutex;

use loam_jobs::store::placement::CallerWaits;
use loam_jobs::store::redb::{RedbOptions, RedbStore};
use loam_jobs::{Config, Durability, FollowingClock, Jobs, StoreError};

use crate::error::store_error;

/// The store file inside a data dir.
pub const STORE_FILE: &str = "jobs.redb";

/// How long an open waits, once this process's own close of the data dir
/// has ended, for the operations still in flight on that core to let go of
/// the file.
const REOPEN_GRACE: Duration = Duration::from_secs(2);

/// The least time from the end of one open of a store (or its start, while
/// under way) to the start of the next that a call asks for: a store that
/// fails as it opens, or soon after, is not opened in a loop by a stream of
/// calls.
const REOPEN_INTERVAL: Duration = Duration::from_secs(1);

/// How long an open waits for a close of the same store by this process to
/// let go of the file: a close that hangs (a disk that no longer answers an
/// fsync) fails the open instead of keeping it, and every call held behind
/// it, waiting for good.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// The executor's batch limit in a Node host, whose main thread processes
/// every answer on the same cores as the store's threads: BullMQ at
/// concurrency 100 went from 32,400 to 35,350 jobs/s (medians of 14
/// interleaved pairs, 10 won) with 48 instead of the store's default 4,096,
/// which suits a server's waiting clients better (its core bench at 64
/// threads lost 5-20% with 48).
const IN_PROCESS_MAX_BATCH: usize = 48;

/// Where a shared store stands.
enum Core {
    /// Its open runs on a thread of its own.
    Opening,
    Open(Jobs),
    /// The open failed: every call fails with this (tagged) message until
    /// a reopen succeeds.
    Failed(String),
    /// The last backend closed it.
    Closed,
}

/// A store's core, and when its last open started, or ended if it has (see
/// [`REOPEN_INTERVAL`]).
struct Held {
    core: Core,
    last_open: Instant,
}

/// One store, shared by the backends that use its data dir.
pub struct SharedStore {
    /// Callers take a clone of an open core per call; closing the core
    /// lets go of the file, whatever clones calls in flight still hold.
    held: Mutex<Held>,
    /// Told once the open has ended, either way.
    open_ended: Event,
    /// The core's time, which follows the host's `Date.now()` (BullMQ's Redis
    /// scripts take their time from the caller, and its tests fake it).
    clock: Arc<FollowingClock>,
    pub dir: PathBuf,
    /// What it opens with: a store has one durability, whoever joins it.
    durability: Durability,
    /// Which store of its dir in this process it is: the package tells the
    /// calls of a store the last backend closed from those of the next
    /// store of the dir by it.
    pub serial: u32,
}

thread_local! {
    /// The `Date.now()` the call under way on this thread reported (0 = none
    /// yet): its operations run at exactly that time, as Redis scripts do.
    /// Per thread, not per store: writes report theirs on the JavaScript
    /// thread, but reads on napi's runtime threads, and one store-wide value
    /// let a read's time land between a write's report and its use.
    static CALL_NOW_MS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn closed_error() -> napi::Error {
    napi::Error::from_reason("[loam:unavailable] the backend is closed")
}

impl SharedStore {
    /// JavaScript's `Date.now()` at the call; every call reports it.
    pub fn observe(&self, host_now_ms: f64) {
        if host_now_ms.is_finite() && host_now_ms >= 0.0 {
            self.clock.observe(host_now_ms as u64);
            CALL_NOW_MS.set(host_now_ms as u64);
        }
    }

    /// The core, for one call: an error while it opens (the package makes
    /// no call before [`SharedStore::opened`]), if its open failed, or once
    /// it was closed.
    pub fn jobs(&self) -> napi::Result<Jobs> {
        let jobs = match &self.held.lock().core {
            Core::Open(jobs) => jobs.clone(),
            Core::Opening => {
                return Err(napi::Error::from_reason(format!(
                    "[loam:unavailable] the store in {} is opening (or reopening after a failure): wait for the \
                     backend to be ready",
                    self.dir.display()
                )));
            }
            Core::Failed(message) => return Err(napi::Error::from_reason(message.clone())),
            Core::Closed => return Err(closed_error()),
        };
        // Every call reports its time before it asks for the core, on the
        // thread it asks on, with no await between: this is its time.
        Ok(match CALL_NOW_MS.get() {
            0 => jobs,
            now => jobs.at(now),
        })
    }

    /// Whether its open is still under way.
    pub fn is_opening(&self) -> bool {
        matches!(self.held.lock().core, Core::Opening)
    }

    /// Resolves once the open has ended: with its error if it failed.
    pub async fn opened(&self) -> napi::Result<()> {
        loop {
            // Listening before looking: an end told in between is not missed.
            let ended = self.open_ended.listen();
            match &self.held.lock().core {
                Core::Opening => {}
                Core::Open(_) => return Ok(()),
                Core::Failed(message) => return Err(napi::Error::from_reason(message.clone())),
                Core::Closed => return Err(closed_error()),
            }
            ended.await;
        }
    }

    /// Opens the store again if it failed (its open, or its disk since) and
    /// its last open ended at least [`REOPEN_INTERVAL`] ago, or at once if
    /// `now`; returns whether an open is under way. The package calls it when
    /// a call finds the store unreachable, and then holds its next calls
    /// until the open ends, as it does for the first.
    pub fn reopen(self: &Arc<Self>, now: bool) -> bool {
        let mut held = self.held.lock();
        match &held.core {
            Core::Opening => return true,
            Core::Closed => return false,
            Core::Open(jobs) if jobs.failure().is_none() => return false,
            Core::Open(_) | Core::Failed(_) => {}
        }
        if !now && held.last_open.elapsed() < REOPEN_INTERVAL {
            return false;
        }
        held.last_open = Instant::now();
        let old = match &held.core {
            Core::Open(jobs) => Some(jobs.clone()),
            _ => None,
        };
        // Started under the lock, which its end takes.
        match start_open(self, old) {
            Ok(()) => {
                held.core = Core::Opening;
                true
            }
            Err(e) => {
                // An open store stays open (and failed); a failed one says
                // why it was not opened again.
                if let Core::Failed(message) = &mut held.core {
                    *message = e.reason;
                }
                false
            }
        }
    }
}

struct Entry {
    store: Arc<SharedStore>,
    users: usize,
}

fn registry() -> &'static Mutex<HashMap<PathBuf, Entry>> {
    static REGISTRY: OnceLock<Mutex<HashMap<PathBuf, Entry>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// This process's closes of a data dir's store: how many are under way, and
/// when the last one ended. An open that finds the file locked waits for
/// these rather than reporting another process.
#[derive(Default)]
struct Closes {
    under_way: usize,
    last_ended: Option<Instant>,
}

fn closes() -> &'static Mutex<HashMap<PathBuf, Closes>> {
    static CLOSES: OnceLock<Mutex<HashMap<PathBuf, Closes>>> = OnceLock::new();
    CLOSES.get_or_init(Default::default)
}

/// Whether a lock on `dir`'s file may be this process's own, let go soon:
/// a close of it under way, or one that ended within [`REOPEN_GRACE`]
/// (its calls still in flight hold the core until they end).
fn closing_here(dir: &Path) -> bool {
    closes()
        .lock()
        .get(dir)
        .is_some_and(|closes| closes.under_way > 0 || closes.last_ended.is_some_and(|at| at.elapsed() < REOPEN_GRACE))
}

/// A close of `dir`'s store under way, counted in [`closes`] until it is
/// dropped (a close that panicked has ended too).
struct Closing {
    dir: PathBuf,
}

impl Closing {
    fn start(dir: PathBuf) -> Self {
        closes().lock().entry(dir.clone()).or_default().under_way += 1;
        Closing { dir }
    }
}

impl Drop for Closing {
    fn drop(&mut self) {
        if let Some(closes) = closes().lock().get_mut(&self.dir) {
            closes.under_way -= 1;
            closes.last_ended = Some(Instant::now());
        }
    }
}

/// Opens the redb file, waiting while the lock on it is this process's own.
fn open_file(dir: &Path, shown: &str, durability: Durability) -> napi::Result<RedbStore> {
    let file = dir.join(STORE_FILE);
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
    let started = Instant::now();
    loop {
        match RedbStore::open(&file, options()) {
            Ok(store) => return Ok(store),
            Err(StoreError::Locked(_)) if closing_here(dir) => {
                if started.elapsed() >= CLOSE_WAIT {
                    return Err(napi::Error::from_reason(format!(
                        "[loam:unavailable] cannot open the Loam Jobs store in {shown}: this process's close of it \
                         has not let go of the file after {} s (a disk that does not answer?)",
                        CLOSE_WAIT.as_secs()
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(store_error(shown, e)),
        }
    }
}

/// Opens the core of `store` (on the thread [`start_open`] started for it).
fn open_core(store: &SharedStore, shown: &str) -> napi::Result<Jobs> {
    #[cfg(feature = "test-hooks")]
    test_hooks::before_open();
    let durability = store.durability;
    let redb = open_file(&store.dir, shown, durability)?;
    let config = Config { durability, ..Config::default() };
    // Job times follow the host (BullMQ passes its own); leases run in real
    // time, as Redis lock TTLs do, so a host that fakes time keeps its locks.
    Jobs::with_clocks(
        Box::new(redb),
        Arc::clone(&store.clock) as Arc<dyn loam_jobs::Clock>,
        Arc::new(loam_jobs::SystemClock),
        config,
    )
    .map_err(|e| napi::Error::from_reason(format!("[loam:unavailable] cannot start the queue core in {shown}: {e}")))
}

/// Ends the open of `store`. A failed one leaves the store in the registry,
/// failed: the backends that use it open it again ([`SharedStore::reopen`]).
fn finish_open(store: &SharedStore, opened: napi::Result<Jobs>) {
    {
        let mut held = store.held.lock();
        held.core = match opened {
            Ok(jobs) => Core::Open(jobs),
            Err(e) => Core::Failed(e.reason),
        };
        held.last_open = Instant::now();
    }
    store.open_ended.notify(usize::MAX);
}

/// Starts the open of `store` on a thread of its own, closing `failed`
/// first (the same store's core, which failed since it opened).
fn start_open(store: &Arc<SharedStore>, failed: Option<Jobs>) -> napi::Result<()> {
    let opening = Arc::clone(store);
    let shown = store.dir.display().to_string();
    std::thread::Builder::new()
        .name("loam-jobs-open".into())
        .spawn(move || {
            if let Some(failed) = failed {
                // Counted as a close of this process, so the open waits for
                // the file's lock to be let go; on a thread of its own, so a
                // close that hangs fails the open (`CLOSE_WAIT`) rather than
                // keep it under way for good. (Should the thread not start,
                // the core closes as it is dropped here.)
                let closing = Closing::start(opening.dir.clone());
                let _ = std::thread::Builder::new().name("loam-jobs-close".into()).spawn(move || {
                    let _closing = closing;
                    failed.close();
                });
            }
            // A panic in the open (redb's, the log's replay) fails it, as any
            // error does: left to end the thread, it left the store opening
            // for good, and every call and close of it waiting. Unavailable,
            // as a failed open is: not a fault of the call that finds it.
            let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| open_core(&opening, &shown)))
                .unwrap_or_else(|panic| {
                    let text = loam_jobs::error::panic_text(panic.as_ref());
                    Err(napi::Error::from_reason(format!(
                        "[loam:unavailable] cannot open the Loam Jobs store in {shown}: its open panicked: {text}"
                    )))
                });
            finish_open(&opening, opened);
        })
        .map(drop)
        .map_err(|e| napi::Error::from_reason(format!("[loam:unavailable] cannot start opening the store: {e}")))
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

/// Joins the process's store of `dir`, or starts opening it (creating the
/// dir) on a thread of its own: returns at once either way. What the open
/// finds (another process holding the file, a failing disk) is the error of
/// [`SharedStore::opened`] and of every call. Joining a store that failed
/// opens it again at once.
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
        if entry.store.durability != options.durability {
            return Err(napi::Error::from_reason(format!(
                "[loam:failed_precondition] the store in {shown} is open in this process with {}; this backend asks \
                 for {}. Every backend of one data directory must use the same durability (and flush interval)",
                describe(entry.store.durability),
                describe(options.durability),
            )));
        }
        entry.users += 1;
        entry.store.reopen(true);
        return Ok(Arc::clone(&entry.store));
    }
    static SERIAL: AtomicU32 = AtomicU32::new(0);
    let store = Arc::new(SharedStore {
        serial: SERIAL.fetch_add(1, Ordering::Relaxed),
        held: Mutex::new(Held { core: Core::Opening, last_open: Instant::now() }),
        open_ended: Event::new(),
        clock: Arc::new(FollowingClock::new()),
        dir: canonical.clone(),
        durability: options.durability,
    });
    start_open(&store, None)?;
    open.insert(canonical, Entry { store: Arc::clone(&store), users: 1 });
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

/// Gives back one use of `store` once its open has ended; the last one
/// closes it. The close (pending writes committed, the log checkpointed)
/// runs on the caller's thread, not under the registry's lock, which Node's
/// thread takes to make a backend: an open of the dir meanwhile waits for it
/// on its own thread (`closes`).
pub async fn release(store: &Arc<SharedStore>) {
    let (_closing, jobs) = loop {
        // Failed or not: a backend of a store that failed still gives its
        // use back.
        let _ = store.opened().await;
        let mut open = registry().lock();
        let Some(entry) = open.get_mut(&store.dir).filter(|entry| Arc::ptr_eq(&entry.store, store)) else {
            return;
        };
        let mut held = store.held.lock();
        // Another backend's call found it failed and opens it again since.
        if matches!(held.core, Core::Opening) {
            continue;
        }
        entry.users = entry.users.saturating_sub(1);
        if entry.users > 0 {
            return;
        }
        open.remove(&store.dir);
        let Core::Open(jobs) = std::mem::replace(&mut held.core, Core::Closed) else {
            return;
        };
        break (Closing::start(store.dir.clone()), jobs);
    };
    jobs.close();
}

/// Hooks for the package's own tests (see `backend::LoamQueue`'s).
#[cfg(feature = "test-hooks")]
pub mod test_hooks {
    use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
    use std::time::Duration;

    /// How long each open waits before it starts: a slow open (a long log
    /// replay) on demand.
    pub static OPEN_DELAY_MS: AtomicU64 = AtomicU64::new(0);
    /// Whether each open panics (after its delay): a bug of redb's or of the
    /// log's replay, on demand.
    pub static OPEN_PANICS: AtomicBool = AtomicBool::new(false);
    /// How many opens have started.
    pub static OPENS: AtomicU32 = AtomicU32::new(0);

    pub(super) fn before_open() {
        OPENS.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(OPEN_DELAY_MS.load(Ordering::Relaxed)));
        assert!(!OPEN_PANICS.load(Ordering::Relaxed), "an open that panics (a test's)");
    }
}
