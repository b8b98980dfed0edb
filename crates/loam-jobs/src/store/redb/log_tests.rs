use super::tests::comes_true_within;
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
    failing.store(true, Ordering::SeqCst);
    // Logged; the checkpoint due a checkpoint interval after the open
    // fails on the file.
    put(&store, "trigger");
    let refused = comes_true_within(CHECKPOINT_INTERVAL + Duration::from_secs(10), || store.snapshot().is_err());
    assert!(refused, "reads are refused once acknowledged writes cannot be made durable");
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
    assert!(comes_true_within(Duration::from_secs(10), || store.snapshot().is_err()), "the store is broken");
    assert!(store.failure().is_some(), "and says so");
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
        RedbStore::open_with_log(&dir.path().join("jobs.redb"), relaxed(), |wal| wal.fail_while(Arc::clone(&failing)))
            .unwrap();
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

/// A fault in a batch's bookkeeping (a bug of the store) stops the store, not
/// the thread that ran the batch: a caller running its own write (a Node
/// host aborts on a panic), or the executor's, whose end left the writes
/// sent to it unanswered. The store then says why where a host reports its
/// health, refuses later writes as stopped (not as closed: nobody closed
/// it), still reads, and closes cleanly with what it acknowledged.
fn a_fault_in_the_bookkeeping(on_callers_thread: bool) {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.redb");
    let caller_waits: CallerWaits = || true;
    let options = RedbOptions { run_on_callers_thread: on_callers_thread.then_some(caller_waits), ..relaxed() };
    let store = RedbStore::open(&path, options).unwrap();
    put(&store, "before");
    assert!(store.failure().is_none());
    store.executor.faulty.store(true, Ordering::Relaxed);
    let faulted = submit_put(&store, "faulted".into(), b"v".to_vec(), true).recv();
    store.executor.faulty.store(false, Ordering::Relaxed);
    assert_ne!(faulted, Ok(true), "the write whose batch faulted was acknowledged");
    // On the executor's thread the faulted write is answered (its answer
    // dropped) while the panic unwinds, before the store is marked stopped.
    let stopped = comes_true_within(Duration::from_secs(10), || matches!(store.failure(), Some(StoreError::Stopped)));
    assert!(stopped, "failure: {:?}", store.failure());
    let refusal = put_answer(&store, "after");
    assert_eq!(refusal, Err(JobsError::from(StoreError::Stopped).to_string()), "a later write is refused as stopped");
    assert!(store.snapshot().unwrap().get(b"before").unwrap().is_some());
    drop(store);
    let reopened = RedbStore::open(&path, relaxed()).unwrap();
    let mut read = reopened.snapshot().unwrap();
    assert!(read.get(b"before").unwrap().is_some(), "an acknowledged write was lost");
    assert!(read.get(b"after").unwrap().is_none());
}

#[test]
fn a_fault_in_a_batch_run_by_the_executor_stops_the_store() {
    a_fault_in_the_bookkeeping(false);
}

#[test]
fn a_fault_in_a_batch_run_on_its_callers_thread_stops_the_store() {
    a_fault_in_the_bookkeeping(true);
}

/// The file writer ended by a fault of its own: the store says so, refuses
/// later writes without waiting for room that never comes (more are sent
/// than the executor keeps uncommitted), closes, and its reopen replays from
/// the log every write it acknowledged. Under relaxed durability, those
/// answered early after the fault are not kept: as when a checkpoint fails,
/// the committer refuses them and the store refuses reads from then on
/// (`docs/design.md`); what was answered before it is.
fn a_store_whose_file_writer_ended(options: fn() -> RedbOptions) {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.redb");
    let store = RedbStore::open(&path, options()).unwrap();
    put(&store, "before");
    store.progress.file_writer_faulty.store(true, Ordering::Relaxed);
    let mut acknowledged = vec!["before".to_string()];
    let mut refused = None;
    for n in 0..2 * executor::MAX_UNCOMMITTED_BATCHES {
        let key = format!("k{n}");
        let answer = submit_put(&store, key.clone(), b"v".to_vec(), true).recv_timeout(Duration::from_secs(10));
        match answer {
            Ok(true) => {
                assert!(refused.is_none(), "{key} was acknowledged after {refused:?} was refused");
                acknowledged.push(key);
            }
            Ok(false) => {
                refused.get_or_insert(key);
            }
            Err(_) => panic!("the write of {key} was not answered"),
        }
    }
    assert!(refused.is_some(), "every write was acknowledged");
    assert!(matches!(store.failure(), Some(StoreError::Stopped)), "failure: {:?}", store.failure());
    assert!(store.snapshot().is_err(), "reads are refused: the file lacks acknowledged writes");
    drop(store);
    let reopened = RedbStore::open(&path, options()).unwrap();
    let mut read = reopened.snapshot().unwrap();
    let kept = if options().durability == Durability::Immediate { &acknowledged[..] } else { &acknowledged[..1] };
    for key in kept {
        assert!(read.get(key.as_bytes()).unwrap().is_some(), "{key}, acknowledged, was lost");
    }
}

#[test]
fn a_store_whose_file_writer_ended_refuses_writes_and_keeps_what_it_acknowledged() {
    a_store_whose_file_writer_ended(RedbOptions::default);
}

#[test]
fn a_relaxed_store_whose_file_writer_ended_refuses_writes_and_keeps_what_it_acknowledged() {
    a_store_whose_file_writer_ended(relaxed);
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
    let store = RedbStore::open_with_log(&path, relaxed(), |wal| wal.fail_while(Arc::clone(&failing))).unwrap();
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
    copy_as_killed(&path, &copy);
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
    // No checkpoint before the copies (one would put the writes in the file).
    let options = RedbOptions { checkpoint_interval: Duration::from_secs(3600), ..Default::default() };
    let store = RedbStore::open(&path, options).unwrap();
    for key in ["a", "b", "c"] {
        put(&store, key);
    }
    let copy = dir.path().join("killed.redb");
    copy_as_killed(&path, &copy);
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

/// A `jobs.redb` deleted to start over, its log left beside it: the new file
/// replayed the old store's records (every file counts its log's generations
/// from the same start), after a crash right after its open, and even after a
/// clean close once the old store had reached the generation the new one
/// closed at. A file that never logged now starts with a log of its own.
#[test]
fn a_new_file_does_not_replay_a_log_left_by_another_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.redb");
    let eager = RedbOptions { checkpoint_interval: Duration::ZERO, ..Default::default() };
    let store = RedbStore::open(&path, eager).unwrap();
    put_value(&store, "first".into(), b"1".to_vec()); // generation 2; a checkpoint to 3 starts
    std::thread::sleep(Duration::from_millis(50));
    put_value(&store, "old".into(), b"from the deleted store".to_vec()); // generation 3
    drop(store);
    std::fs::remove_file(&path).unwrap();
    for reopen in 0..2 {
        let store = RedbStore::open(&path, RedbOptions::default()).unwrap();
        let old = store.snapshot().unwrap().get(b"old").unwrap();
        assert_eq!(old, None, "open {reopen}: the deleted store's write came back");
        drop(store); // a clean close: the next open starts at generation 3
    }
}

/// What a kill -9 of the store at `path` leaves, copied to `to`: the log
/// first, as it is on the disk while the store runs, then the file.
pub(super) fn copy_as_killed(path: &Path, to: &Path) {
    std::fs::copy(log_path(path), log_path(to)).unwrap();
    std::fs::copy(path, to).unwrap();
}

/// A job's data is written into the log, and a region is written over
/// again two generations later: after a crash, the bytes past the newest
/// record can be an old job's, which a client chose. A well-formed next
/// record hidden in a job was replayed as a commit nobody made; the log's
/// salt, under every record's crc, fails it now.
#[test]
fn a_record_hidden_in_a_jobs_data_is_not_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.redb");
    let quiet = || RedbOptions { checkpoint_interval: Duration::from_secs(3600), ..Default::default() };
    // Open 1 logs generation 2 in region 0: `A`'s record is a 24-byte
    // header, a tag, `A` with its length, and the value's length; its value
    // starts 34 bytes in, and the forged record 100 bytes later.
    let store = RedbStore::open(&path, quiet()).unwrap();
    let mut value = vec![b'.'; 100];
    // As the log wrote them before its salt: what anyone knows of one, since
    // generations and sequence numbers are predictable.
    let forged: crate::kv::Writes = [(b"forged".to_vec(), Some(b"nobody wrote this".to_vec()))].into_iter().collect();
    value.extend(Wal::forge(None, 8, 2, &forged));
    value.resize(4096, b'.');
    put_value(&store, "A".into(), value);
    drop(store); // checkpointed: generation 3
    // Open 2 logs generation 5 and closes at 6; open 3 logs generation 8,
    // region 0 again, where `B`'s record of 134 bytes ends where the
    // forged one starts.
    drop(RedbStore::open(&path, quiet()).unwrap());
    let store = RedbStore::open(&path, quiet()).unwrap();
    put_value(&store, "B".into(), vec![b'b'; 100]);
    let copy = dir.path().join("killed.redb");
    copy_as_killed(&path, &copy);
    drop(store);
    let reopened = RedbStore::open(&copy, quiet()).unwrap();
    let mut snapshot = reopened.snapshot().unwrap();
    assert_eq!(snapshot.get(b"B").unwrap(), Some(vec![b'b'; 100]), "the acknowledged write is replayed");
    assert_eq!(snapshot.get(b"forged").unwrap(), None, "a record forged in a job's data was replayed");
}

/// A file and log from before the log's salt: the open replays the log as
/// it was written (its crcs cover no salt), and the log it starts is salted,
/// replayed after a kill in turn.
#[test]
fn a_log_from_before_its_salt_is_replayed_and_the_next_is_salted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.redb");
    {
        let db = Database::builder().create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(TABLE).unwrap();
        store_generation(&txn, 4).unwrap();
        txn.commit().unwrap();
        let (mut wal, _) = Wal::open(&log_path(&path), 4, None, LOG_CAPACITY).unwrap();
        let writes: crate::kv::Writes = [(b"old".to_vec(), Some(b"logged unsalted".to_vec()))].into_iter().collect();
        wal.append(Wal::encode(writes.iter())).unwrap();
        wal.sync().unwrap();
    }
    let store = RedbStore::open(&path, RedbOptions::default()).unwrap();
    assert_eq!(store.snapshot().unwrap().get(b"old").unwrap(), Some(b"logged unsalted".to_vec()));
    put(&store, "new");
    let copy = dir.path().join("killed.redb");
    copy_as_killed(&path, &copy);
    drop(store);
    let db = Database::open(&path).unwrap();
    let txn = db.begin_read().unwrap();
    assert!(txn.open_table(LOG_TABLE).unwrap().get(LOG_SALT).unwrap().is_some(), "the file holds the log's salt");
    let reopened = RedbStore::open(&copy, RedbOptions::default()).unwrap();
    let mut snapshot = reopened.snapshot().unwrap();
    assert_eq!(snapshot.get(b"old").unwrap(), Some(b"logged unsalted".to_vec()));
    assert_eq!(snapshot.get(b"new").unwrap(), Some(b"v".to_vec()), "the salted log's write is replayed");
}

/// A store whose file writer failed to write an acknowledged group keeps
/// that group in the log only: neither the checkpoint due a checkpoint
/// interval later nor the close's may be made, which would retire the log
/// generation that holds the group; and the committer sleeps meanwhile.
#[test]
fn a_store_that_failed_to_write_a_group_does_not_retire_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.redb");
    // Long enough that the checkpoint does not come before the failure is
    // set, on a loaded machine too.
    let interval = Duration::from_secs(2);
    let options = RedbOptions { checkpoint_interval: interval, ..Default::default() };
    let store = RedbStore::open(&path, options).unwrap();
    put(&store, "a");
    store.progress.state.lock().unreadable = Some(io(std::io::Error::other("the file writer's commit failed")));
    std::thread::sleep(interval + Duration::from_millis(300)); // the checkpoint is due
    assert_a_broken_store_sleeps(&store);
    drop(store);
    let db = Database::open(&path).unwrap();
    let generation =
        db.begin_read().unwrap().open_table(LOG_TABLE).unwrap().get(LOG_GENERATION).unwrap().unwrap().value();
    assert_eq!(generation, 2, "a checkpoint was made over a group the file lacks");
}

/// An idle store checkpoints a checkpoint interval after the last, as a busy
/// one does: its file holds its writes by itself (it waited for the next
/// write, or the close).
#[test]
fn an_idle_store_checkpoints_after_the_interval() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.redb");
    let options = RedbOptions { checkpoint_interval: Duration::from_millis(100), ..Default::default() };
    let store = RedbStore::open(&path, options).unwrap();
    for key in ["a", "b", "c"] {
        put(&store, key);
    }
    let mut copies = 0;
    let in_the_file = comes_true_within(Duration::from_secs(10), || {
        copies += 1;
        let bare = dir.path().join(format!("bare-{copies}.redb"));
        std::fs::copy(&path, &bare).unwrap();
        // A copy taken while the file writer wrote may not open: not yet.
        let Ok(bare) = RedbStore::open(&bare, RedbOptions::default()) else { return false };
        let Ok(mut snapshot) = bare.snapshot() else { return false };
        ["a", "b", "c"].iter().all(|key| snapshot.get(key.as_bytes()).is_ok_and(|v| v.is_some()))
    });
    drop(store);
    assert!(in_the_file, "the writes are in the file alone within 10 s");
}

/// What an immediate write of `key` was answered: Ok, or the error's text.
fn put_answer(store: &RedbStore, key: &'static str) -> Result<(), String> {
    let (sender, receiver) = mpsc::channel();
    let body: super::super::OpBody = Box::new(move |txn: &mut dyn KvTxn| {
        txn.put(key.as_bytes(), b"v".to_vec())?;
        Ok(Box::new(()) as OpOutput)
    });
    let done: OpDone = Box::new(move |result| {
        let _ = sender.send(result.map(|_| ()).map_err(|e| e.to_string()));
    });
    store.submit(WriteOp { body, durable: Durable::needed(true), brief: true, done });
    receiver.recv().unwrap()
}

/// A write whose log fsync failed is answered as failed; its record, whole
/// in the kernel's cache, was replayed at the next open all the same (an
/// add its caller retried made two jobs). It is taken back now.
#[test]
fn a_write_whose_log_fsync_failed_is_not_replayed() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.redb");
    let failing = Arc::new(AtomicBool::new(false));
    let store =
        RedbStore::open_with_log(&path, RedbOptions::default(), |wal| wal.fail_a_sync_once(Arc::clone(&failing)))
            .unwrap();
    put(&store, "before");
    assert!(store.failure().is_none(), "a store that took every write is not failed");
    failing.store(true, Ordering::SeqCst);
    let answer = put_answer(&store, "failed");
    assert!(answer.is_err_and(|e| !e.contains("may still take effect")), "answered as failed, for sure");
    // Reads go on (nothing acknowledged is missing), writes do not: the
    // store says why, for a host's health check.
    assert!(store.snapshot().is_ok());
    assert!(store.failure().is_some_and(|e| e.to_string().contains("fail")), "{:?}", store.failure());
    drop(store);
    let reopened = RedbStore::open(&path, RedbOptions::default()).unwrap();
    assert!(reopened.failure().is_none(), "reopening mends it");
    let mut snapshot = reopened.snapshot().unwrap();
    assert_eq!(snapshot.get(b"before").unwrap(), Some(b"v".to_vec()));
    assert_eq!(snapshot.get(b"failed").unwrap(), None, "a write answered as failed took effect");
}

/// When the record cannot be taken back either (the disk fails on), the
/// answer says the write may still take effect.
#[test]
fn a_write_whose_record_cannot_be_taken_back_says_it_may_take_effect() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let failing = Arc::new(AtomicBool::new(false));
    let store = RedbStore::open_with_log(&dir.path().join("jobs.redb"), RedbOptions::default(), |wal| {
        wal.fail_syncs_while(Arc::clone(&failing))
    })
    .unwrap();
    failing.store(true, Ordering::SeqCst);
    let answer = put_answer(&store, "unknown");
    assert!(answer.as_ref().is_err_and(|e| e.contains("may still take effect")), "{answer:?}");
}
