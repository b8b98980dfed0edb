//! Property test of `completed` events' return values over random
//! interleavings: a large value of a job that is kept is written once, in the
//! job's record, and lent to its event; a record that goes or forgets its
//! value first gives it to the event. Whatever the jobs become (removed,
//! retried, completed again, added again under their id, dropped by
//! retention) and however the log is trimmed or the store reopened, every
//! `completed` event in the log reads the value of its own completion.
//!
//! Failures shrink to a short list of steps. `PROPTEST_CASES=n` runs more than
//! the default 64 cases.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use loam_jobs::ops::admin;
use loam_jobs::store::redb::{RedbOptions, RedbStore};
use loam_jobs::*;
use proptest::prelude::*;

#[path = "support/cases.rs"]
mod cases;

const NS: &str = "ns";
const Q: &str = "q";
const IDS: [&str; 3] = ["a", "b", "c"];

#[derive(Clone, Debug)]
enum Step {
    /// Adds the job of that id, unless it exists.
    Add(usize),
    /// Leases the next job and completes it with a value of that many bytes,
    /// kept as the retention says.
    Complete {
        size: usize,
        retention: RetentionSpec,
    },
    Remove(usize),
    /// Retries the job when it is completed.
    Retry(usize),
    /// Publishes an event and trims the log to its newest `n`.
    Trim(u64),
    /// Closes the store and opens it again.
    Reopen,
}

#[derive(Clone, Copy, Debug)]
enum RetentionSpec {
    Keep,
    KeepNewest(u64),
    RemoveAtOnce,
}

impl RetentionSpec {
    fn retention(self) -> Option<Retention> {
        match self {
            RetentionSpec::Keep => None,
            RetentionSpec::KeepNewest(n) => Some(Retention::Keep(Keep { count: Some(n), ..Default::default() })),
            RetentionSpec::RemoveAtOnce => Some(Retention::RemoveImmediately),
        }
    }
}

fn step_strategy() -> impl Strategy<Value = Step> {
    let id = 0..IDS.len();
    // Sizes each side of what an event keeps in its page (2 KiB).
    let size = prop_oneof![Just(4usize), Just(2_100), Just(20_000)];
    let retention = prop_oneof![
        3 => Just(RetentionSpec::Keep),
        1 => (0u64..3).prop_map(RetentionSpec::KeepNewest),
        1 => Just(RetentionSpec::RemoveAtOnce),
    ];
    prop_oneof![
        3 => id.clone().prop_map(Step::Add),
        3 => (size, retention).prop_map(|(size, retention)| Step::Complete { size, retention }),
        1 => id.clone().prop_map(Step::Remove),
        1 => id.prop_map(Step::Retry),
        1 => (1u64..12).prop_map(Step::Trim),
        1 => Just(Step::Reopen),
    ]
}

struct Harness {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    clock: ManualClock,
    jobs: Option<Jobs>,
    /// The value each completion gave, by its event's sequence number.
    given: BTreeMap<u64, String>,
    completions: u64,
}

impl Harness {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.redb");
        let clock = ManualClock::new(1_000_000);
        let mut h = Harness { _dir: dir, path, clock, jobs: None, given: BTreeMap::new(), completions: 0 };
        h.open();
        h
    }

    fn open(&mut self) {
        let config = Config { background: false, ..Config::default() };
        let store = RedbStore::open(&self.path, RedbOptions::default()).unwrap();
        self.jobs = Some(Jobs::with_store(Box::new(store), Arc::new(self.clock.clone()), config).unwrap());
    }

    fn jobs(&self) -> &Jobs {
        self.jobs.as_ref().unwrap()
    }

    fn run(&mut self, step: &Step) -> Result<(), JobsError> {
        self.clock.advance(1);
        let jobs = self.jobs().clone();
        match *step {
            Step::Add(i) => {
                let req = EnqueueRequest { job_id: Some(IDS[i].into()), attempts: 1, ..Default::default() };
                jobs.enqueue(NS, Q, req).wait()?;
            }
            Step::Complete { size, retention } => {
                let request = LeaseRequest { max: 1, token: "w".into(), ..Default::default() };
                let Some(lease) = jobs.lease(NS, Q, request).wait()?.leases.pop() else { return Ok(()) };
                self.completions += 1;
                // Each completion's value is its own.
                let tag = format!("{}:{}:", lease.job.id, self.completions);
                let value = format!("\"{tag}{}\"", "x".repeat(size.saturating_sub(tag.len() + 2)));
                let options = CompleteOptions { remove_on_complete: retention.retention(), ..Default::default() };
                let outcome = Outcome::Ok { result: Some(value.clone().into_bytes()) };
                jobs.complete(NS, Q, &lease.job.id, Fence::Epoch(lease.epoch), outcome, options).wait()?;
                let seq = jobs.query(NS, Q, ops::query::last_event_seq)?;
                // The completion's own event is its last but `drained`, when that came after it.
                let events = jobs.read_events_blocking(NS, Q, Some(seq.saturating_sub(2)), 10, Duration::ZERO)?;
                let own = events.iter().rev().find(|e| e.name == "completed").expect("the completion's event");
                self.given.insert(own.seq, value);
            }
            Step::Remove(i) => {
                jobs.admin(NS, Q, move |tx, q| admin::remove_job(tx, q, IDS[i], false)).wait()?;
            }
            Step::Retry(i) => {
                if jobs.get_job(NS, Q, IDS[i])?.is_some_and(|j| j.state == JobState::Completed) {
                    jobs.admin(NS, Q, move |tx, q| {
                        admin::retry_finished(tx, q, IDS[i], JobState::Completed, false, false)
                    })
                    .wait()?;
                }
            }
            Step::Trim(n) => {
                jobs.admin(NS, Q, move |tx, q| admin::publish_event(tx, q, "mine", &[], n)).wait()?;
            }
            Step::Reopen => {
                self.jobs.take().unwrap().close();
                self.open();
            }
        }
        Ok(())
    }

    /// Every `completed` event in the log reads its completion's value.
    fn check(&self) -> Result<(), String> {
        let events =
            self.jobs().read_events_blocking(NS, Q, Some(0), 10_000, Duration::ZERO).map_err(|e| e.to_string())?;
        for e in events.iter().filter(|e| e.name == "completed") {
            let read = e.fields.iter().find(|(k, _)| k == "returnvalue").map(|(_, v)| v.as_str());
            let given = self.given.get(&e.seq).map(String::as_str);
            if read != given {
                let short = |v: Option<&str>| v.map(|v| v.chars().take(24).collect::<String>());
                return Err(format!("event {} reads {:?}, its completion gave {:?}", e.seq, short(read), short(given)));
            }
        }
        Ok(())
    }
}

fn run_steps(steps: &[Step]) -> Result<(), TestCaseError> {
    let mut h = Harness::new();
    for (i, step) in steps.iter().enumerate() {
        h.run(step).map_err(|e| TestCaseError::fail(format!("step {i} {step:?}: {e}")))?;
        h.check().map_err(|e| TestCaseError::fail(format!("after step {i} {step:?}: {e}")))?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases::config())]

    #[test]
    fn completed_events_read_their_completions_value(steps in proptest::collection::vec(step_strategy(), 1..80)) {
        run_steps(&steps)?;
    }
}

/// The check can fail: a value given to the wrong completion is found.
#[test]
fn a_wrong_value_is_found() {
    let mut h = Harness::new();
    let steps = [Step::Add(0), Step::Complete { size: 20_000, retention: RetentionSpec::Keep }];
    for step in &steps {
        h.run(step).unwrap();
    }
    h.check().unwrap();
    let seq = *h.given.keys().next().unwrap();
    h.given.insert(seq, "\"other\"".into());
    assert!(h.check().is_err());
}
