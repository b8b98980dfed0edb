//! Examples of the job lifecycle through the public API.

#![allow(clippy::unwrap_used, reason = "a test: a failed unwrap is a failed check, with its message")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use loam_jobs::store::redb::RedbStore;
use loam_jobs::*;

mod support;
use support::{core, job};

fn take(jobs: &Jobs, q: &str) -> Vec<Lease> {
    jobs.lease("ns", q, LeaseRequest { max: 10, token: "w".into(), ..Default::default() }).wait().unwrap().leases
}

#[test]
fn enqueue_lease_complete() {
    let (jobs, _) = core();
    let e = jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    assert_eq!(e.id, "1");
    assert!(e.created);
    let leases = take(&jobs, "q");
    assert_eq!(leases.len(), 1);
    let l = &leases[0];
    let done = jobs
        .complete(
            "ns",
            "q",
            &l.job.id,
            Fence::Epoch(l.epoch),
            Outcome::Ok { result: Some(b"42".to_vec()) },
            CompleteOptions::default(),
        )
        .wait()
        .unwrap();
    assert_eq!(done.state, Some(JobState::Completed));
    let stored = jobs.get_job("ns", "q", "1").unwrap().unwrap();
    assert_eq!(stored.return_value.as_deref(), Some(&b"42"[..]));
    assert_eq!(
        jobs.counts("ns", "q", &[JobState::Waiting, JobState::Active, JobState::Completed]).unwrap(),
        vec![0, 0, 1]
    );
    // A second completion is fenced.
    let again = jobs
        .complete("ns", "q", "1", Fence::Epoch(l.epoch), Outcome::Ok { result: None }, CompleteOptions::default())
        .wait();
    assert!(matches!(again, Err(JobsError::Fenced { .. })), "{again:?}");
}

#[test]
fn priorities_lifo_and_delays_order_the_queue() {
    let (jobs, clock) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { priority: 5, ..job("p5") }).wait().unwrap();
    jobs.enqueue("ns", "q", EnqueueRequest { priority: 1, ..job("p1") }).wait().unwrap();
    jobs.enqueue("ns", "q", job("fifo1")).wait().unwrap();
    jobs.enqueue("ns", "q", job("fifo2")).wait().unwrap();
    jobs.enqueue("ns", "q", EnqueueRequest { lifo: true, ..job("lifo") }).wait().unwrap();
    jobs.enqueue("ns", "q", EnqueueRequest { delay_ms: 500, ..job("later") }).wait().unwrap();
    let names: Vec<String> = take(&jobs, "q").into_iter().map(|l| l.job.name).collect();
    assert_eq!(names, ["lifo", "fifo1", "fifo2", "p1", "p5"]);
    clock.advance(500);
    let names: Vec<String> = take(&jobs, "q").into_iter().map(|l| l.job.name).collect();
    assert_eq!(names, ["later"]);
}

/// A delayed job due by the core's clock is leased by a caller whose clock is
/// a few ms behind (a remote worker's, woken by the core's timers for that
/// job): it takes the job, which never shows as started before it was due;
/// one promoted by hand before its time starts when it is leased.
#[test]
fn a_delayed_job_never_starts_before_it_is_due() {
    let (jobs, clock) = core();
    let start = clock.now_ms();
    jobs.enqueue("ns", "q", EnqueueRequest { delay_ms: 500, ..job("later") }).wait().unwrap();
    clock.advance(500);
    let behind = jobs.at(start + 497);
    let leased = take(&behind, "q").remove(0);
    assert_eq!(leased.job.processed_on, Some(start + 500));

    jobs.enqueue("ns", "q", EnqueueRequest { delay_ms: 10_000, ..job("promoted") }).wait().unwrap();
    jobs.admin("ns", "q", |tx, q| ops::admin::promote(tx, q, "2")).wait().unwrap();
    let leased = take(&jobs, "q").remove(0);
    assert_eq!(leased.job.processed_on, Some(start + 500));
}

/// A job retried at once goes behind the delayed jobs that fell due while it
/// ran, as BullMQ's retryJob promotes them first, whether or not a lease
/// promoted them yet.
#[test]
fn an_immediate_retry_goes_behind_the_delayed_jobs_that_fell_due() {
    let (jobs, clock) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { attempts: 2, ..job("flaky") }).wait().unwrap();
    jobs.enqueue("ns", "q", EnqueueRequest { delay_ms: 200, ..job("later") }).wait().unwrap();
    let flaky = take(&jobs, "q").remove(0);
    clock.advance(300);
    let retry = Outcome::Retry { error: None, after_ms: None };
    jobs.complete("ns", "q", &flaky.job.id, Fence::Epoch(flaky.epoch), retry, CompleteOptions::default())
        .wait()
        .unwrap();
    let names: Vec<String> = take(&jobs, "q").into_iter().map(|l| l.job.name).collect();
    assert_eq!(names, ["later", "flaky"]);
}

#[test]
fn stalled_job_is_redelivered_then_marked_to_fail() {
    let (jobs, clock) = core();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    let first = take(&jobs, "q").remove(0);
    clock.advance(31_000);
    assert_eq!(jobs.sweep_stalled("ns", "q").wait().unwrap(), vec!["1".to_string()]);
    // The old holder is fenced; the job is delivered again.
    let late = jobs
        .complete("ns", "q", "1", Fence::Epoch(first.epoch), Outcome::Ok { result: None }, CompleteOptions::default())
        .wait();
    assert!(matches!(late, Err(JobsError::Fenced { .. })));
    let second = take(&jobs, "q").remove(0);
    assert_eq!(second.job.stalled_counter, 1);
    clock.advance(31_000);
    jobs.sweep_stalled("ns", "q").wait().unwrap();
    // Past maxStalledCount the job goes back marked, and its next worker fails it (BullMQ 6.7).
    let marked = jobs.get_job("ns", "q", "1").unwrap().unwrap();
    assert_eq!(marked.state, JobState::Waiting);
    assert_eq!(marked.deferred_failure.as_deref(), Some("job stalled more than allowable limit"));
}

#[test]
fn a_scan_without_limit_sees_writes_of_its_own_batch() {
    let (jobs, _) = core();
    let q = QueueId::new("ns", "q");
    let drained = jobs
        .write("ns", true, move |tx| {
            loam_jobs::ops::enqueue::enqueue(tx, &q, job("a"), loam_jobs::ops::enqueue::Placement::Normal)?;
            loam_jobs::ops::admin::drain(tx, &q, false)
        })
        .wait()
        .unwrap();
    assert_eq!(drained, 1);
}

#[test]
fn dropping_the_last_handle_without_close_is_clean() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static WRITER_PANICS: AtomicUsize = AtomicUsize::new(0);
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if matches!(std::thread::current().name(), Some("loam-jobs-writer" | "loam-jobs-commit")) {
            WRITER_PANICS.fetch_add(1, Ordering::SeqCst);
        }
        default_hook(info);
    }));
    for _ in 0..200 {
        let (jobs, _) = core();
        jobs.enqueue("ns", "q", job("a")).wait().unwrap();
        drop(jobs);
    }
    // Give writer threads that outlived their handles time to finish.
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(WRITER_PANICS.load(Ordering::SeqCst), 0);
}

/// The background timers wake a worker waiting on a queue when a job delayed
/// while they were busy (here sweeping the queues that their first writes
/// registered) falls due, instead of sleeping through that wake-up until
/// their idle second is over. Nothing else moves the job: it stays delayed
/// until a lease takes it, as on Redis, where only a worker's moveToActive
/// promotes delayed jobs.
#[test]
fn a_waiting_worker_is_woken_when_a_job_delayed_while_the_timers_were_busy_falls_due() {
    let store = Box::new(RedbStore::in_memory().unwrap());
    let jobs = Jobs::with_store(store, Arc::new(SystemClock), Config::default()).unwrap();
    for round in 0..10 {
        // A queue's first write has it swept at once: keep the timers busy.
        for n in 0..50 {
            jobs.enqueue("ns", &format!("q{round}-{n}"), job("first")).wait().unwrap();
        }
        let q = format!("q{round}-0");
        assert_eq!(take(&jobs, &q).len(), 1);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
                let started = Instant::now();
                let woken = rt.block_on(jobs.wait_for_job("ns", &q, Duration::from_secs(5), None, None)).unwrap();
                (woken, started.elapsed())
            });
            std::thread::sleep(Duration::from_millis(20));
            let id = jobs.enqueue("ns", &q, EnqueueRequest { delay_ms: 50, ..job("later") }).wait().unwrap().id;
            let (woken, after) = waiter.join().unwrap();
            assert_eq!(woken, Some(0), "round {round}");
            // Missed, the wake-up comes once the timers' idle second is over,
            // a second or more after the wait began; woken as it should, at
            // the job's due time (70 ms in) plus what a loaded machine adds.
            assert!(after < Duration::from_millis(900), "round {round}: woken {after:?} after it began waiting");
            assert_eq!(jobs.get_job("ns", &q, &id).unwrap().unwrap().state, JobState::Delayed);
            assert_eq!(take(&jobs, &q).into_iter().map(|l| l.job.id).collect::<Vec<_>>(), [id]);
        });
    }
}

/// A wait handed an interrupt taken with `from_now` is cut short by a fire
/// made after that, even when a reset follows before the wait begins (the
/// Node binding takes it in the call and starts the wait later, and BullMQ
/// may disconnect and reconnect its blocking connection in between).
#[test]
fn an_interrupt_fired_and_reset_before_a_wait_begins_still_cuts_it_short() {
    let (jobs, _) = core();
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let interrupt = Interrupt::new();
    let asked = interrupt.from_now();
    interrupt.fire();
    interrupt.reset();
    let started = Instant::now();
    let woken = rt.block_on(jobs.wait_for_job("ns", "idle", Duration::from_secs(5), Some(&asked), None)).unwrap();
    assert_eq!(woken, None);
    assert!(started.elapsed() < Duration::from_secs(2), "waited {:?}", started.elapsed());
    // Once reset, a wait asked for after it waits again (here until its end).
    let later = interrupt.from_now();
    let started = Instant::now();
    let woken = rt.block_on(jobs.wait_for_job("ns", "idle", Duration::from_millis(200), Some(&later), None)).unwrap();
    assert_eq!(woken, None);
    assert!(started.elapsed() >= Duration::from_millis(190), "cut short after {:?}", started.elapsed());
}

/// The writes a store was given: whether each was marked brief (see
/// `WriteOp::brief`), and the thread that submitted it.
type Submitted = Arc<std::sync::Mutex<Vec<(std::thread::ThreadId, bool)>>>;

/// A store in memory that records what [`Submitted`] holds.
struct BriefRecorder {
    inner: RedbStore,
    submitted: Submitted,
}

impl store::Store for BriefRecorder {
    fn submit(&self, op: store::WriteOp) {
        self.submitted.lock().unwrap().push((std::thread::current().id(), op.brief));
        self.inner.submit(op);
    }
    fn snapshot(&self) -> Result<Box<dyn kv::KvRead + Send>, StoreError> {
        self.inner.snapshot()
    }
    fn close(&self) {
        self.inner.close();
    }
    fn failure(&self) -> Option<StoreError> {
        self.inner.failure()
    }
}

/// A flow or bulk add of up to `store::BRIEF_JOBS` jobs may run on its
/// caller's thread, a larger one never; a FlowProducer.addBulk of several
/// trees counts them all together.
#[test]
fn flows_and_bulk_adds_are_brief_up_to_sixteen_jobs() {
    let submitted = Submitted::default();
    let recorder = BriefRecorder { inner: RedbStore::in_memory().unwrap(), submitted: Arc::clone(&submitted) };
    let jobs = Jobs::with_store(Box::new(recorder), Arc::new(SystemClock), Config::default()).unwrap();
    let tree = |parent: &str, children: usize| -> Vec<FlowNode> {
        let root = FlowNode {
            queue: "parents".into(),
            request: EnqueueRequest { job_id: Some(parent.into()), ..job("parent") },
            wait_children: true,
        };
        let of = ParentRef { queue: "parents".into(), id: parent.into(), prefix: "bull".into() };
        std::iter::once(root)
            .chain((0..children).map(|i| FlowNode {
                queue: "children".into(),
                request: EnqueueRequest { job_id: Some(format!("{parent}-{i}")), parent: Some(of.clone()), ..job("c") },
                wait_children: false,
            }))
            .collect()
    };
    // The writes this thread submitted (the core's maintenance submits its own).
    let caller = std::thread::current().id();
    let brief_of = |write: &dyn Fn()| {
        let before = submitted.lock().unwrap().len();
        write();
        let recorded = submitted.lock().unwrap();
        recorded[before..].iter().filter(|(by, _)| *by == caller).map(|(_, brief)| *brief).collect::<Vec<_>>()
    };
    assert_eq!(brief_of(&|| drop(jobs.flow("ns", tree("a", 15)).wait().unwrap())), [true]);
    assert_eq!(brief_of(&|| drop(jobs.flow("ns", tree("b", 16)).wait().unwrap())), [false]);
    let bulk = |n: usize| (0..n).map(|_| job("j")).collect::<Vec<_>>();
    assert_eq!(brief_of(&|| drop(jobs.enqueue_bulk("ns", "bulk", bulk(16), None).wait().unwrap())), [true]);
    assert_eq!(brief_of(&|| drop(jobs.enqueue_bulk("ns", "bulk", bulk(17), None).wait().unwrap())), [false]);
    // Two trees of 8 and 9 jobs: 17 in one write, not brief.
    let two: Vec<FlowNode> = tree("c", 7).into_iter().chain(tree("d", 8)).collect();
    assert_eq!(brief_of(&|| drop(jobs.flows("ns", two.clone()).wait().unwrap())), [false]);
    let small: Vec<FlowNode> = tree("e", 3).into_iter().chain(tree("f", 3)).collect();
    assert_eq!(brief_of(&|| drop(jobs.flows("ns", small.clone()).wait().unwrap())), [true]);
}

/// A write run on its caller's thread that adds events tells a waiting
/// `read_events` there, before the write is answered (the Node binding then
/// hands a QueueEvents its events in the write's own turn of the event loop).
#[test]
fn a_write_on_the_callers_thread_tells_a_waiting_event_read_there() {
    use loam_jobs::store::redb::RedbOptions;
    let dir = tempfile::tempdir().unwrap();
    let options = RedbOptions {
        durability: Durability::Relaxed { flush_interval_ms: 100 },
        run_on_callers_thread: Some(|| true),
        ..Default::default()
    };
    let store = RedbStore::open(&dir.path().join("jobs.redb"), options).unwrap();
    let jobs = Jobs::with_store(Box::new(store), Arc::new(SystemClock), Config::default()).unwrap();
    jobs.enqueue("ns", "q", job("first")).wait().unwrap();
    let caller = std::thread::current().id();
    let told_here = (0..50).any(|_| {
        let (sender, told) = std::sync::mpsc::channel();
        let tell: notify::Tell = Arc::new(move || {
            let _ = sender.send(std::thread::current().id());
        });
        let after = jobs.query("ns", "q", ops::query::last_event_seq).unwrap();
        let reader = jobs.clone();
        let waiting = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            rt.block_on(reader.read_events("ns", "q", Some(after), 10, Duration::from_secs(5), None, Some(&tell)))
        });
        // Let the read start waiting (it reads nothing new until the add).
        std::thread::sleep(Duration::from_millis(20));
        jobs.enqueue("ns", "q", job("j")).wait().unwrap();
        let by = told.try_recv();
        assert!(!waiting.join().unwrap().unwrap().is_empty(), "the read got the add's events");
        by == Ok(caller)
    });
    assert!(told_here, "no add told the waiting read on the adding thread before it was answered");
}

/// A queue's stalled-job interval made shorter takes effect at once: the
/// sweep the old interval had set (30 s off) does not hold an expired lease
/// until then.
#[test]
fn a_shorter_stalled_interval_sweeps_at_once() {
    let store = Box::new(RedbStore::in_memory().unwrap());
    let jobs = Jobs::with_store(store, Arc::new(SystemClock), Config::default()).unwrap();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    // The queue's first write had it swept at once; the next is 30 s off.
    std::thread::sleep(Duration::from_millis(200));
    let leased = jobs.lease("ns", "q", LeaseRequest { max: 1, lock_duration_ms: 100, ..Default::default() });
    assert_eq!(leased.wait().unwrap().leases.len(), 1);
    std::thread::sleep(Duration::from_millis(150));
    let config = QueueConfig { stalled_interval_ms: 200, ..QueueConfig::defaults(&Config::default()) };
    jobs.set_queue_config("ns", "q", config).wait().unwrap();
    let started = Instant::now();
    while jobs.get_job("ns", "q", "1").unwrap().unwrap().state == JobState::Active {
        assert!(started.elapsed() < Duration::from_secs(5), "the expired lease is still held");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(jobs.get_job("ns", "q", "1").unwrap().unwrap().stalled_counter, 1);
}

/// A reopened store sweeps its queues' expired leases by itself: a queue
/// nobody writes to after the open still has its stalled job handed back
/// (the sweep was armed only by a queue's next write).
#[test]
fn a_reopened_store_sweeps_stalled_jobs_of_queues_nobody_writes_to() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.redb");
    {
        let jobs = Jobs::open(&path, Config { background: false, ..Config::default() }).unwrap();
        let config = QueueConfig { stalled_interval_ms: 200, ..QueueConfig::defaults(&Config::default()) };
        jobs.set_queue_config("ns", "q", config).wait().unwrap();
        jobs.enqueue("ns", "q", job("a")).wait().unwrap();
        let leased = jobs.lease("ns", "q", LeaseRequest { max: 1, lock_duration_ms: 100, ..Default::default() });
        assert_eq!(leased.wait().unwrap().leases.len(), 1);
        jobs.close();
    }
    let jobs = Jobs::open(&path, Config::default()).unwrap();
    let started = Instant::now();
    while jobs.get_job("ns", "q", "1").unwrap().unwrap().state == JobState::Active {
        assert!(started.elapsed() < Duration::from_secs(5), "the expired lease is still held after the reopen");
        std::thread::sleep(Duration::from_millis(20));
    }
    let job = jobs.get_job("ns", "q", "1").unwrap().unwrap();
    assert_eq!((job.state, job.stalled_counter), (JobState::Waiting, 1));
}
