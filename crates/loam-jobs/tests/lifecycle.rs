//! Examples of the job lifecycle through the public API.

// A failed unwrap is a failed test, which is what it should be.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use loam_jobs::store::redb::RedbStore;
use loam_jobs::*;

fn core() -> (Jobs, ManualClock) {
    let clock = ManualClock::new(1_000_000);
    let config = Config { background: false, ..Config::default() };
    let jobs = Jobs::with_store(Box::new(RedbStore::in_memory().unwrap()), Arc::new(clock.clone()), config).unwrap();
    (jobs, clock)
}

fn job(name: &str) -> EnqueueRequest {
    EnqueueRequest { name: name.into(), data: b"{}".to_vec(), attempts: 1, ..Default::default() }
}

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
        .complete("ns", "q", &l.job.id, Fence::Epoch(l.epoch), Outcome::Ok { result: Some(b"42".to_vec()) }, CompleteOptions::default())
        .wait()
        .unwrap();
    assert_eq!(done.state, Some(JobState::Completed));
    let stored = jobs.get_job("ns", "q", "1").unwrap().unwrap();
    assert_eq!(stored.return_value.as_deref(), Some(&b"42"[..]));
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting, JobState::Active, JobState::Completed]).unwrap(), vec![0, 0, 1]);
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

#[test]
fn stalled_job_is_redelivered_then_failed() {
    let (jobs, clock) = core();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    let first = take(&jobs, "q").remove(0);
    clock.advance(31_000);
    assert_eq!(jobs.sweep_stalled("ns", "q").wait().unwrap(), vec!["1".to_string()]);
    // The old holder is fenced; the job is delivered again.
    let late = jobs.complete("ns", "q", "1", Fence::Epoch(first.epoch), Outcome::Ok { result: None }, CompleteOptions::default()).wait();
    assert!(matches!(late, Err(JobsError::Fenced { .. })));
    let second = take(&jobs, "q").remove(0);
    assert_eq!(second.job.stalled_counter, 1);
    clock.advance(31_000);
    jobs.sweep_stalled("ns", "q").wait().unwrap();
    let failed = jobs.get_job("ns", "q", "1").unwrap().unwrap();
    assert_eq!(failed.state, JobState::Failed);
    assert_eq!(failed.failed_reason.as_deref(), Some("job stalled more than allowable limit"));
}
