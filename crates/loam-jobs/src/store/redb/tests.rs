use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use redb::StorageBackend;
use redb::backends::InMemoryBackend;

use super::*;
use crate::kv::KvTxn;

/// Whether `happened` comes true within `limit`, asked every 10 ms. Tests
/// wait for what they expect with a loose bound, so that a loaded machine
/// does not fail them: what they guard against does not come at all, or
/// takes far longer.
pub(super) fn comes_true_within(limit: Duration, mut happened: impl FnMut() -> bool) -> bool {
    let asked = Instant::now();
    loop {
        if happened() {
            return true;
        }
        if asked.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

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

/// A `GatedDisk`'s gate before it is held (see [`GatedDisk::database`]).
pub(super) struct GateSwitch(Arc<(parking_lot::Mutex<bool>, parking_lot::Condvar)>);

impl GateSwitch {
    /// From now on the disk's syncs wait until the gate is released or
    /// dropped. Bound after the store, the gate is dropped first when a test
    /// fails, so the store's close does not wait for a held fsync for ever.
    pub(super) fn hold(self) -> Gate {
        *self.0.0.lock() = true;
        Gate(self.0)
    }
}

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

impl GatedDisk {
    /// A database on a gated disk, and its gate, open: starting a store
    /// syncs, so a test holds it (`GateSwitch::hold`) once its store is
    /// started.
    pub(super) fn database() -> (Database, GateSwitch) {
        let held = Arc::new((parking_lot::Mutex::new(false), parking_lot::Condvar::new()));
        let disk = GatedDisk { memory: InMemoryBackend::new(), held: Arc::clone(&held) };
        (Database::builder().create_with_backend(disk).unwrap(), GateSwitch(held))
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
    let (db, switch) = GatedDisk::database();
    let store = RedbStore::start(db, &RedbOptions::default(), None).unwrap();
    let gate = switch.hold();
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

/// Under immediate durability an operation submitted as needing no fsync
/// that recorded an outcome as it ran (`KvTxn::require_durable`: a lease
/// that failed a job) is answered after its fsync; one that did not is
/// answered after its commit alone.
#[test]
fn an_operation_that_asks_for_its_fsync_as_it_runs_waits_for_it() {
    let (db, switch) = GatedDisk::database();
    let store = RedbStore::start(db, &RedbOptions::default(), None).unwrap();
    let gate = switch.hold();
    let submit = |name: &'static str, require_durable: bool| {
        let (sender, answer) = mpsc::channel();
        let body: super::super::OpBody = Box::new(move |txn: &mut dyn KvTxn| {
            txn.put(name.as_bytes(), b"v".to_vec())?;
            if require_durable {
                txn.require_durable();
            }
            Ok(Box::new(()) as OpOutput)
        });
        let done: OpDone = Box::new(move |result| {
            let _ = sender.send(result.is_ok());
        });
        store.submit(WriteOp { body, durable: Durable::No, brief: true, done });
        answer
    };
    let lease = submit("a lease", false);
    assert_eq!(lease.recv_timeout(Duration::from_secs(5)), Ok(true), "answered with the fsync held");
    let failing = submit("a lease that failed a job", true);
    assert!(failing.recv_timeout(Duration::from_millis(300)).is_err(), "answered before its fsync");
    gate.release();
    assert_eq!(failing.recv_timeout(Duration::from_secs(5)), Ok(true));
}

/// The core's failures ask for it: a lease that fails a job on the way
/// (here one that expired before it started) is answered after its fsync;
/// a lease that only took jobs is not held up by it.
#[test]
fn a_lease_that_fails_a_job_waits_for_its_fsync() {
    let (db, switch) = GatedDisk::database();
    let store = RedbStore::start(db, &RedbOptions::default(), None).unwrap();
    let clock = crate::ManualClock::new(1_000_000);
    let config = crate::Config { background: false, ..Default::default() };
    let jobs = crate::Jobs::with_store(Box::new(store), Arc::new(clock.clone()), config).unwrap();
    let add = |name: &str, expires: Option<u64>| {
        let req = crate::EnqueueRequest { name: name.into(), attempts: 1, expires, ..Default::default() };
        jobs.enqueue("ns", "q", req).wait().unwrap()
    };
    add("runs", None);
    let expiring = add("expires", Some(1_000_010));
    add("runs too", None);
    clock.advance(20);
    let gate = switch.hold();
    let lease = |jobs: &crate::Jobs| {
        let (sender, answer) = mpsc::channel();
        let pending = jobs.lease("ns", "q", crate::LeaseRequest { max: 1, ..Default::default() });
        std::thread::spawn(move || {
            let _ =
                sender.send(pending.wait().map(|l| l.leases.iter().map(|l| l.job.name.clone()).collect::<Vec<_>>()));
        });
        answer
    };
    let first = lease(&jobs);
    assert_eq!(first.recv_timeout(Duration::from_secs(5)).unwrap().unwrap(), ["runs"], "answered with the fsync held");
    let second = lease(&jobs);
    assert!(second.recv_timeout(Duration::from_millis(300)).is_err(), "answered before the failure's fsync");
    gate.release();
    assert_eq!(second.recv_timeout(Duration::from_secs(5)).unwrap().unwrap(), ["runs too"]);
    let failed = jobs.get_job("ns", "q", &expiring.id).unwrap().unwrap();
    assert_eq!(failed.state, crate::JobState::Failed);
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
