use std::sync::atomic::{AtomicBool, Ordering};

use super::log_tests::{copy_as_killed, submit_put, submit_put_durable};
use super::tests::{GateSwitch, GatedDisk, comes_true_within};
use super::*;

fn submit(store: &RedbStore, key: &str, value: Vec<u8>, sync: bool) -> mpsc::Receiver<bool> {
    submit_put(store, key.to_string(), value, sync)
}

/// A store under relaxed durability (a flush every `flush_interval_ms`) on a
/// disk whose redb fsyncs the test holds with the switch, over the log at
/// `log`, whose fsyncs fail while the flag is set; with the log's salt, to
/// read it back.
fn relaxed_on_a_gated_disk(
    log: &Path,
    flush_interval_ms: u64,
    checkpoint_interval: Duration,
) -> (RedbStore, GateSwitch, Arc<AtomicBool>, Option<u64>) {
    let (db, switch) = GatedDisk::database();
    let mut wal = recover(&db, log).unwrap();
    let salt = wal.salt();
    let failing = Arc::new(AtomicBool::new(false));
    wal.fail_syncs_while(Arc::clone(&failing));
    let options = RedbOptions {
        durability: Durability::Relaxed { flush_interval_ms },
        checkpoint_interval,
        ..Default::default()
    };
    (RedbStore::start(db, &options, Some(wal)).unwrap(), switch, failing, salt)
}

/// Relaxed durability loses at most the last flush interval (100 ms) of
/// acknowledged writes, however slow a checkpoint's durable redb commit:
/// the committer goes on appending and flushing the log meanwhile (it
/// used to stop, waiting for it, when the next checkpoint came due).
fn slow_checkpoint(kill: bool) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let (store, switch, failing, salt) = relaxed_on_a_gated_disk(&log, 100, Duration::from_millis(1));
    // From now on redb's fsync takes as long as the test wants (a slow disk).
    let gate = switch.hold();
    assert!(submit(&store, "a", b"1".to_vec(), true).recv().unwrap());
    std::thread::sleep(Duration::from_millis(50)); // logged; its checkpoint waits on redb's fsync
    let outcome = if kill {
        assert!(submit(&store, "b", b"2".to_vec(), true).recv().unwrap());
        std::thread::sleep(Duration::from_millis(50)); // logged, unsynced; the next checkpoint is due
        assert!(submit(&store, "c", b"3".to_vec(), true).recv().unwrap());
        // What a kill -9 leaves: the log as it is.
        let copy = dir.path().join("copy");
        let mut logged = Vec::new();
        let in_log = comes_true_within(Duration::from_secs(2), || {
            std::fs::copy(&log, &copy).unwrap();
            let (_, records) = super::super::wal::Wal::open(&copy, 2, salt, LOG_CAPACITY).unwrap();
            logged = records.iter().flat_map(|w| w.keys().cloned()).collect();
            logged.iter().any(|k| k == b"c")
        });
        (in_log, format!("c, acknowledged, is in the log within 2 s (logged keys {logged:?})"))
    } else {
        // From here a log fsync fails: if the committer tries one, the
        // relaxed store breaks and refuses reads. (On a loaded machine the
        // fsync that a's checkpoint makes as it begins may come after this
        // and fail first: the test then passes without showing anything.)
        failing.store(true, Ordering::SeqCst);
        assert!(submit(&store, "b", b"2".to_vec(), true).recv().unwrap());
        let attempted = comes_true_within(Duration::from_secs(2), || store.snapshot().is_err());
        (attempted, "a log fsync was attempted for b within 2 s of its acknowledgement".into())
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

/// The same on the other way to a checkpoint: a group too large for the
/// log's room is committed durably to redb, and the committer waits for that
/// commit (and for any checkpoint under way before it). It flushes the log
/// first: it waited unflushed, and the writes relaxed durability had
/// answered before the group stayed unsynced for as long as redb's commit
/// took, past the flush interval. The flush interval is a minute here, so
/// that the only fsync the test can see is the one before the group's
/// commit (with a short one, a due flush of `a` could come first and leave
/// nothing to flush; this test once failed that way on a loaded machine).
#[test]
fn relaxed_acks_are_fsynced_before_a_group_too_large_for_the_log_is_checkpointed() {
    let dir = tempfile::tempdir().unwrap();
    let (store, switch, failing, _) =
        relaxed_on_a_gated_disk(&dir.path().join("log"), 60_000, Duration::from_secs(3600));
    let gate = switch.hold();
    // From here a log fsync fails: if the committer tries one, the relaxed
    // store breaks and refuses reads.
    failing.store(true, Ordering::SeqCst);
    assert!(submit(&store, "a", b"1".to_vec(), true).recv().unwrap());
    assert!(store.snapshot().is_ok(), "a was answered, unsynced, and the store still reads");
    let _big = submit(&store, "big", vec![7u8; (LOG_CAPACITY + 1024) as usize], true);
    // redb's commit is held: without the flush before it, a would stay
    // unsynced for as long as the test holds it.
    let attempted = comes_true_within(Duration::from_secs(2), || store.snapshot().is_err());
    gate.release();
    drop(store);
    assert!(attempted, "no log fsync for a within 2 s of the large group, while redb's commit was held");
}

/// Under relaxed durability a batch that may not fit in the log is answered
/// once it is durable: it goes to redb as a checkpoint, and answered as it
/// ran (as every relaxed write was) it stayed unsynced for as long as redb's
/// durable commit took, past the flush interval. So is a small write behind
/// it, which the log takes only once that commit is made (answered as it
/// ran, it stayed unsynced as long).
#[test]
fn a_relaxed_batch_too_large_for_the_log_is_answered_once_durable() {
    let dir = tempfile::tempdir().unwrap();
    let (store, switch, _, _) = relaxed_on_a_gated_disk(&dir.path().join("log"), 100, Duration::from_secs(3600));
    let gate = switch.hold();
    let big = submit(&store, "big", vec![7u8; (LOG_CAPACITY + 1024) as usize], true);
    // It has run (published as it runs) before its answer is looked for:
    // on a loaded machine it might otherwise not have, and pass unshown.
    let ran = comes_true_within(Duration::from_secs(10), || store.snapshot().unwrap().get(b"big").unwrap().is_some());
    let early = big.recv_timeout(Duration::from_millis(300));
    let small = submit(&store, "small", b"1".to_vec(), true);
    let small_early = small.recv_timeout(Duration::from_millis(300));
    gate.release();
    let answered = big.recv_timeout(Duration::from_secs(10));
    let small_answered = small.recv_timeout(Duration::from_secs(10));
    drop(store);
    assert!(ran, "the large batch ran within 10 s");
    assert!(early.is_err(), "answered while its durable commit was held: {early:?}");
    assert!(small_early.is_err(), "a small write behind it answered while its commit was held: {small_early:?}");
    assert_eq!(answered, Ok(true), "answered once its commit was let through");
    assert_eq!(small_answered, Ok(true), "the small write answered once the commit was let through");
}

/// What a stand-in for the file writer saw of one group that held a small
/// batch and one too large for the log: the groups and checkpoints it got
/// (by their batches' keys and last batch), the log as a kill -9 would have
/// left it when the checkpoint came, and whether the small batch had been
/// answered by then; with whether it was acknowledged.
struct SplitGroup {
    seen: Vec<String>,
    logged_at_checkpoint: Vec<Key>,
    small_answered_at_checkpoint: bool,
    small_acknowledged: bool,
}

/// Commits batch 1 (`a`) and batch 2 (`big`, too large for the log) as one
/// group under `durability`, as the committer gathers them when `big` comes
/// within its linger (on a loaded machine, often), over a log whose fsyncs
/// fail if `failing_fsync`.
fn commit_split_group(durability: Durability, failing_fsync: bool) -> SplitGroup {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let db = Database::builder().create(dir.path().join("jobs.redb")).unwrap();
    let mut wal = recover(&db, &log).unwrap();
    let salt = wal.salt();
    wal.fail_syncs_while(Arc::new(AtomicBool::new(failing_fsync)));
    let (to_file, from_committer) = mpsc::channel();
    let keys = |writes: &[(u64, Arc<Writes>)]| -> Vec<String> {
        writes.iter().flat_map(|(_, w)| w.keys().map(|k| String::from_utf8_lossy(k).into_owned())).collect()
    };
    let copy = dir.path().join("copy");
    let answered = Arc::new(AtomicBool::new(false));
    let answered_seen = Arc::clone(&answered);
    let file_writer = std::thread::spawn(move || {
        let (mut seen, mut logged_at_checkpoint, mut answered_at_checkpoint) = (Vec::new(), Vec::new(), false);
        for message in from_committer {
            match message {
                ToFile::Group(group) => seen.push(format!("group {:?} last {}", keys(&group.batches), group.last)),
                ToFile::Checkpoint { group, done, .. } => {
                    std::fs::copy(&log, &copy).unwrap();
                    let (_, records) = super::super::wal::Wal::open(&copy, 2, salt, LOG_CAPACITY).unwrap();
                    logged_at_checkpoint = records.iter().flat_map(|w| w.keys().cloned()).collect();
                    answered_at_checkpoint = answered_seen.load(Ordering::SeqCst);
                    let group = group.map(|g| format!("{:?} last {}", keys(&g.batches), g.last));
                    seen.push(format!("checkpoint {}", group.unwrap_or_default()));
                    done.send(Ok(())).unwrap();
                }
            }
        }
        (seen, logged_at_checkpoint, answered_at_checkpoint)
    });
    let mut committer = Committer {
        progress: Arc::new(Progress::new(RedbSnapshot::new(&Arc::new(db)).unwrap())),
        durability,
        unflushed_since: None,
        last_failed: 0,
        log_broken: false,
        file: File::Logged { wal, to_file },
        checkpoint_interval: Duration::from_secs(3600),
        last_checkpoint: Instant::now(),
        checkpointing: None,
    };
    let (acked, small_ack) = mpsc::channel();
    let sync = durability == Durability::Immediate;
    let batch = |number: u64, key: &str, value: Vec<u8>, acks: Vec<Ack>| Batch {
        number,
        read_through: 0,
        writes: Arc::new(Writes::from([(key.as_bytes().to_vec(), Some(value))])),
        sync,
        record_len: 0,
        acks,
    };
    let done: OpDone = Box::new(move |result| {
        answered.store(true, Ordering::SeqCst);
        acked.send(result.is_ok()).unwrap();
    });
    committer.commit(vec![
        batch(1, "a", b"1".to_vec(), vec![(done, Ok(Box::new(()) as OpOutput))]),
        batch(2, "big", vec![7u8; (LOG_CAPACITY + 1024) as usize], Vec::new()),
    ]);
    drop(committer);
    let (seen, logged_at_checkpoint, small_answered_at_checkpoint) = file_writer.join().unwrap();
    SplitGroup {
        seen,
        logged_at_checkpoint,
        small_answered_at_checkpoint,
        small_acknowledged: small_ack.recv().unwrap(),
    }
}

/// The batches of a group gathered before one too large for the log are
/// logged, and fsynced, before the rest goes to redb as a checkpoint: under
/// relaxed durability they were answered already, and committed with the
/// large one they stayed unsynced for as long as redb's durable commit took.
#[test]
fn batches_gathered_with_one_too_large_for_the_log_are_logged_before_its_checkpoint() {
    for durability in [Durability::Relaxed { flush_interval_ms: 60_000 }, Durability::Immediate] {
        let split = commit_split_group(durability, false);
        assert_eq!(split.seen, ["group [\"a\"] last 1", "checkpoint [\"big\"] last 2"], "{durability:?}");
        assert_eq!(split.logged_at_checkpoint, [b"a".to_vec()], "a is in the log when the checkpoint comes");
        assert!(split.small_answered_at_checkpoint && split.small_acknowledged, "{durability:?}");
        // Its fsync comes before the checkpoint: failing, it fails the group,
        // and the file writer hears only that it is done with its batches.
        let failed = commit_split_group(durability, true);
        assert_eq!(failed.seen, ["group [] last 2"], "{durability:?}: a group whose log fsync failed reached the file");
        assert!(!failed.small_acknowledged, "{durability:?}");
    }
}

/// Under relaxed durability a read right after an acknowledged write sees
/// it without waiting for the committer (its linger, its log append): here
/// the test holds the committer before it commits.
#[test]
fn a_read_after_a_relaxed_write_does_not_wait_for_the_committer() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _switch, _, _) = relaxed_on_a_gated_disk(&dir.path().join("log"), 100, Duration::from_secs(3600));
    let store = Arc::new(store);
    let gate = store.progress.committer_gate.lock();
    let (read, seen) = mpsc::channel();
    let reader = Arc::clone(&store);
    std::thread::spawn(move || {
        let sees = |key: &str| reader.snapshot().unwrap().get(key.as_bytes()).unwrap().is_some();
        for key in ["a", "b", "c"] {
            assert!(submit(&reader, key, b"1".to_vec(), true).recv().unwrap());
            let _ = read.send(sees(key));
        }
    });
    for key in ["a", "b", "c"] {
        let answer = seen.recv_timeout(Duration::from_secs(10));
        assert_eq!(answer, Ok(true), "a read of {key}, acknowledged, with the committer held");
    }
    drop(gate);
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
    let store =
        RedbStore::open_with_log(&path, RedbOptions::default(), |wal| wal.fail_while(Arc::clone(&failing))).unwrap();
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

/// A checkpoint is committed after every group sent to the file writer
/// before it. Taken first (found while the writer gathered the groups
/// queued ahead of it), it retired the log generation that held them, which
/// the file then had only through commits without fsync: a kill lost them.
#[test]
fn a_checkpoint_is_committed_after_the_groups_sent_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.redb");
    let quiet = RedbOptions { checkpoint_interval: Duration::from_secs(3600), ..Default::default() };
    let store = RedbStore::open(&path, quiet).unwrap();
    // The file writer takes the first group and waits at the gate; the next
    // group, then the checkpoint of one too large for the log, queue up
    // behind it.
    let gate = store.progress.file_gate.lock();
    assert!(submit(&store, "first", b"1".to_vec(), true).recv().unwrap());
    std::thread::sleep(Duration::from_millis(50));
    assert!(submit(&store, "queued", b"2".to_vec(), true).recv().unwrap());
    let big = submit(&store, "big", vec![7u8; (LOG_CAPACITY + 1024) as usize], true);
    std::thread::sleep(Duration::from_millis(100));
    drop(gate);
    assert!(big.recv().unwrap());
    let copy = dir.path().join("killed.redb");
    copy_as_killed(&path, &copy);
    drop(store);
    let reopened = RedbStore::open(&copy, RedbOptions::default()).unwrap();
    let mut snapshot = reopened.snapshot().unwrap();
    for key in ["first", "queued", "big"] {
        assert!(snapshot.get(key.as_bytes()).unwrap().is_some(), "{key}, acknowledged, is lost after a kill");
    }
}

/// Under relaxed durability a batch is answered as it runs only if the log
/// will take it, with every batch handed on before it, without waiting for a
/// checkpoint. Writes of 1 MiB (each under the quarter-region rule) while
/// redb's fsync is held: half a region in, a checkpoint starts and cannot
/// end; the log's other region takes 16 more; then a group finds no room and
/// the committer waits for the checkpoint, logging nothing. Writes answered
/// as they ran until then stayed unlogged for as long as it took, past the
/// flush interval. Now every write answered while the checkpoint is held is
/// in the log, and the first the log cannot take is answered once durable.
#[test]
fn relaxed_writes_that_fill_the_log_during_a_checkpoint_are_answered_once_durable() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let (store, switch, _, salt) = relaxed_on_a_gated_disk(&log, 100, Duration::from_secs(3600));
    let gate = switch.hold();
    let value = vec![7u8; 1 << 20];
    let mut answered = Vec::new();
    let mut waiting = None;
    let mut started = true;
    // 40 MiB: more than both regions take.
    for i in 0..40 {
        if i == 9 {
            // Half a region and more is logged: the committer starts the
            // checkpoint (held) and goes on in the other region, all of it
            // free (in one group with the next, the first region could
            // otherwise have taken them all).
            let switched = || store.progress.log_room.room_and_unlogged() == (LOG_CAPACITY, 0);
            started = comes_true_within(Duration::from_secs(5), switched);
        }
        let key = format!("w{i:02}");
        let answer = submit(&store, &key, value.clone(), true);
        match answer.recv_timeout(Duration::from_secs(2)) {
            Ok(true) => answered.push(key.into_bytes()),
            other => {
                waiting = Some((key, answer, other));
                break;
            }
        }
    }
    // What a kill -9 would leave now: the log as it is (a record is read
    // back once appended, fsynced or not; the flush is another test's).
    let copy = dir.path().join("copy");
    let mut unlogged = Vec::new();
    let mut in_second_region = 0;
    let all_logged = comes_true_within(Duration::from_secs(2), || {
        std::fs::copy(&log, &copy).unwrap();
        let (_, records) = super::super::wal::Wal::open(&copy, 2, salt, LOG_CAPACITY).unwrap();
        let logged: Vec<&Key> = records.iter().flat_map(|w| w.keys()).collect();
        unlogged =
            answered.iter().filter(|k| !logged.contains(k)).map(|k| String::from_utf8_lossy(k).into_owned()).collect();
        // Generation 3, the other region: written while the checkpoint that
        // started it was held.
        let (_, records) = super::super::wal::Wal::open(&copy, 3, salt, LOG_CAPACITY).unwrap();
        in_second_region = records.iter().flat_map(|w| w.keys()).filter(|k| answered.contains(k)).count();
        unlogged.is_empty()
    });
    gate.release();
    let late = waiting.as_ref().map(|(_, answer, _)| answer.recv_timeout(Duration::from_secs(10)));
    drop(store);
    assert!(started, "no checkpoint began within 5 s of 9 MiB written");
    assert!(all_logged, "answered while the checkpoint was held, and not in the log: {unlogged:?}");
    let (key, _, early) = waiting.expect("all 40 MiB answered while the checkpoint was held");
    // Writes went on being answered as they ran while the checkpoint was held.
    assert!(
        in_second_region > 0,
        "none of the {} answered at once was logged after the checkpoint began",
        answered.len()
    );
    assert!(early.is_err(), "{key} was refused while the checkpoint was held: {early:?}");
    assert_eq!(late, Some(Ok(true)), "{key} answered once the checkpoint was let through");
}
