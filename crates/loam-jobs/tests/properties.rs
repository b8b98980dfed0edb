//! Property tests of the delivery guarantees through the public API: random interleavings
//! of enqueue, lease, extend, complete (every outcome), the stalled sweep, the
//! delayed promoter, clock moves and crashes (close and reopen the same redb
//! file), checked after every step against a model of the queue.
//!
//! What is checked after every step:
//! * no acknowledged job is lost: every job whose `enqueue` returned `Ok` is
//!   listed in exactly one state index (a raw scan of all seven), `get_job`
//!   finds it, and its record matches the model (state, epoch, attempts, due
//!   time, lease deadline);
//! * `counts` equals the model's count per state, and the counts add up to the
//!   number of acknowledged jobs;
//! * no job has two outcomes: once a job is seen completed or failed, later
//!   reads show the same state, finish time, attempts and result;
//! * fencing: a write with the current epoch succeeds (even after the lease
//!   deadline, until the sweep reclaims it), and a complete or extend with any
//!   older epoch is refused with `Fenced` (reason and current epoch checked);
//! * ordering: each `lease` returns exactly the jobs the model says are best,
//!   in order (band 0 first, then lower priority; FIFO within a band; LIFO
//!   jobs, stalled, released and rate-limited jobs to the front; new, retried
//!   and promoted jobs to the back), and no job before its due time. The ready,
//!   delayed and active indexes are also compared in full with the model.
//!
//! `queue_keeps_its_guarantees` restarts cleanly (close, reopen the file).
//! `fencing_survives_a_hard_crash` also reopens a copy of the file and its
//! write-ahead log taken while the core runs (a kill -9): writes acknowledged before they were durable
//! (lease, extend) may be lost, so the store may be in the state after any
//! write since the last durable one; the workers keep the leases they got, and
//! a lost lease must stay fenced. (The copy is taken right after the step;
//! the writer's idle flush, 100 ms later, could in theory race it.)
//!
//! Failures shrink to a short list of steps. `PROPTEST_CASES=n` runs more than
//! the default 64 cases.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use loam_jobs::keys::QueueKeys;
use loam_jobs::ops::query;
use loam_jobs::store::redb::{RedbOptions, RedbStore};
use loam_jobs::*;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

#[path = "support/cases.rs"]
mod cases;

const NS: &str = "ns";
const Q: &str = "q";
const START_MS: u64 = 1_000_000;

// ---- steps ------------------------------------------------------------------

#[derive(Clone, Debug)]
enum BackoffSpec {
    Fixed(u64),
    Exponential { delay_ms: u64, max_ms: Option<u64> },
}

impl BackoffSpec {
    fn to_backoff(&self) -> Backoff {
        match self {
            BackoffSpec::Fixed(d) => Backoff::Fixed { delay_ms: *d, jitter: 0.0 },
            BackoffSpec::Exponential { delay_ms, max_ms } => {
                Backoff::Exponential { delay_ms: *delay_ms, jitter: 0.0, max_ms: *max_ms }
            }
        }
    }

    /// BullMQ's formulas, written out independently: the delay before the
    /// next attempt when `made` attempts were made before the failing one.
    fn delay_after(&self, made: u32) -> u64 {
        match self {
            BackoffSpec::Fixed(d) => *d,
            BackoffSpec::Exponential { delay_ms, max_ms } => {
                let d = delay_ms << made;
                max_ms.map_or(d, |m| d.min(m))
            }
        }
    }
}

#[derive(Clone, Debug)]
enum OutcomeSpec {
    Ok,
    Retry(Option<u64>),
    Fail,
    Release(Option<u64>),
    /// `Delay { until: now + offset }`; the offset may be negative.
    Delay(i64),
    RateLimited(u64),
}

impl OutcomeSpec {
    fn to_outcome(&self, now: u64) -> Outcome {
        match self {
            OutcomeSpec::Ok => Outcome::Ok { result: Some(b"\"done\"".to_vec()) },
            OutcomeSpec::Retry(after_ms) => Outcome::Retry { error: Some(JobError::new("boom")), after_ms: *after_ms },
            OutcomeSpec::Fail => Outcome::Fail { error: JobError::new("fatal"), dead_letter: false },
            OutcomeSpec::Release(after_ms) => Outcome::Release { after_ms: *after_ms },
            OutcomeSpec::Delay(offset) => Outcome::Delay { until: now.saturating_add_signed(*offset), delay_ms: None },
            OutcomeSpec::RateLimited(ms) => Outcome::RateLimited { for_ms: *ms },
        }
    }
}

#[derive(Clone, Debug)]
enum Step {
    Enqueue {
        priority: u32,
        lifo: bool,
        delay_ms: u64,
        attempts: u32,
        backoff: Option<BackoffSpec>,
    },
    /// `lock_ms` 0 = the core's default lease length. With `fail_deferred`
    /// the lease fails the jobs marked to fail that it meets, instead of
    /// handing them out.
    Lease {
        max: u32,
        lock_ms: u64,
        fail_deferred: bool,
    },
    /// Extends a lease that is still held (a no-op when none is).
    /// (`lease` picks one, modulo how many there are.)
    Extend {
        lease: usize,
        ms: u64,
    },
    /// Completes a lease that is still held (a no-op when none is).
    Complete {
        lease: usize,
        outcome: OutcomeSpec,
    },
    /// Completes with a lease that is no longer held: must be fenced.
    StaleComplete {
        lease: usize,
        outcome: OutcomeSpec,
    },
    /// Extends a lease that is no longer held: must be fenced.
    StaleExtend {
        lease: usize,
    },
    Sweep,
    Promote,
    Advance(u64),
    /// Moves the clock to just before, at, or just after (`offset` -1, 0, 1)
    /// one of the coming lease deadlines, due times or rate-limit ends
    /// (`pick`, modulo how many), where the boundaries are.
    AdvanceTo {
        pick: usize,
        offset: i8,
    },
    /// Close the core and reopen it on the same file.
    Crash,
    /// Kill the process: reopen a copy of the file taken while the core is
    /// still running, so writes not yet flushed to disk may be lost. Only in
    /// [`fencing_survives_a_hard_crash`].
    HardCrash,
}

fn backoff_strategy() -> impl Strategy<Value = Option<BackoffSpec>> {
    prop_oneof![
        2 => Just(None),
        1 => (0u64..2_000).prop_map(|d| Some(BackoffSpec::Fixed(d))),
        1 => (100u64..1_000, proptest::option::of(500u64..2_000))
            .prop_map(|(delay_ms, max_ms)| Some(BackoffSpec::Exponential { delay_ms, max_ms })),
    ]
}

/// Delays and clock moves are often drawn from the same few values, so due
/// times and lease deadlines often fall exactly on "now" (the boundaries).
fn aligned_ms() -> impl Strategy<Value = u64> {
    proptest::sample::select(vec![1u64, 500, 1_000])
}

fn outcome_strategy() -> impl Strategy<Value = OutcomeSpec> {
    let after = || prop_oneof![Just(None), Just(Some(0u64)), aligned_ms().prop_map(Some), (1u64..3_000).prop_map(Some)];
    prop_oneof![
        3 => Just(OutcomeSpec::Ok),
        3 => after().prop_map(OutcomeSpec::Retry),
        1 => Just(OutcomeSpec::Fail),
        2 => after().prop_map(OutcomeSpec::Release),
        1 => prop_oneof![proptest::sample::select(vec![-500i64, 0, 500]), -2_000i64..5_000].prop_map(OutcomeSpec::Delay),
        1 => prop_oneof![aligned_ms(), 1u64..3_000].prop_map(OutcomeSpec::RateLimited),
    ]
}

fn step_strategy(hard_crashes: bool) -> impl Strategy<Value = Step> {
    // Without hard crashes, that slot is one more clean restart.
    let crash = if hard_crashes { Step::HardCrash } else { Step::Crash };
    prop_oneof![
        3 => (
            prop_oneof![2 => Just(0u32), 2 => 1u32..4],
            proptest::bool::weighted(0.3),
            prop_oneof![4 => Just(0u64), 1 => aligned_ms(), 1 => 1u64..5_000],
            1u32..=3,
            backoff_strategy(),
        )
            .prop_map(|(priority, lifo, delay_ms, attempts, backoff)| Step::Enqueue {
                priority,
                lifo,
                delay_ms,
                attempts,
                backoff
            }),
        4 => (1u32..=4, proptest::sample::select(vec![0u64, 500, 1_000, 10_000]), proptest::bool::weighted(0.3))
            .prop_map(|(max, lock_ms, fail_deferred)| Step::Lease { max, lock_ms, fail_deferred }),
        1 => (0usize..8, proptest::sample::select(vec![500u64, 1_000, 10_000, 40_000]))
            .prop_map(|(lease, ms)| Step::Extend { lease, ms }),
        4 => (0usize..8, outcome_strategy()).prop_map(|(lease, outcome)| Step::Complete { lease, outcome }),
        1 => (0usize..8, outcome_strategy()).prop_map(|(lease, outcome)| Step::StaleComplete { lease, outcome }),
        1 => (0usize..8).prop_map(|lease| Step::StaleExtend { lease }),
        1 => Just(Step::Sweep),
        1 => Just(Step::Promote),
        2 => prop_oneof![
            proptest::sample::select(vec![1u64, 499, 500, 999, 1_000, 1_001, 30_000]),
            0u64..5_000,
            25_000u64..35_000,
        ]
        .prop_map(Step::Advance),
        2 => (0usize..4, -1i8..=1).prop_map(|(pick, offset)| Step::AdvanceTo { pick, offset }),
        1 => Just(Step::Crash),
        1 => Just(crash),
    ]
}

// ---- the model --------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MState {
    Ready,
    Delayed,
    Active,
    Completed,
    Failed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EpochIs {
    /// `MJob::epoch`.
    Known,
    /// Above `MJob::epoch` (it was raised since).
    Above,
    /// Not known yet (a new job).
    Unknown,
}

#[derive(Clone, Debug)]
struct MJob {
    id: String,
    priority: u32,
    lifo: bool,
    attempts: u32,
    backoff: Option<BackoffSpec>,
    state: MState,
    /// Place in line: negative = joined at the front (later joiners first),
    /// positive = joined at the back. Also the tiebreak of the delayed and
    /// active indexes, as the core's sequence is.
    pos: i128,
    due: u64,
    deadline: u64,
    lock_ms: u64,
    /// The job's fencing epoch. Only its order is specified (every lease and
    /// every reclaim raises it), so the model learns the values: from each
    /// lease, and from the next read after enqueue or a reclaim.
    epoch: u64,
    epoch_is: EpochIs,
    /// The lease (index into `Model::leases`) that holds the job while active.
    holder: Option<usize>,
    attempts_made: u32,
    attempts_started: u32,
    stalled: u32,
    /// Marked to fail: it stalled more often than `max_stalled` allows.
    marked: bool,
    finished_on: Option<u64>,
}

impl MJob {
    fn job_state(&self) -> JobState {
        match self.state {
            MState::Ready if self.priority > 0 => JobState::Prioritized,
            MState::Ready => JobState::Waiting,
            MState::Delayed => JobState::Delayed,
            MState::Active => JobState::Active,
            MState::Completed => JobState::Completed,
            MState::Failed => JobState::Failed,
        }
    }
}

#[derive(Clone, Default)]
struct Model {
    jobs: Vec<MJob>,
    tick: i128,
    /// A `RateLimited` outcome stops leases until this time.
    limited_until: u64,
    /// Every lease handed out: (job index, epoch). What the workers know, so
    /// a hard crash does not roll it back.
    leases: Vec<(usize, u64)>,
    max_stalled: u32,
    default_lock_ms: u64,
}

impl Model {
    fn next_tick(&mut self) -> i128 {
        self.tick += 1;
        self.tick
    }

    /// Into the ready band: at the front (stalled, released, rate limited) or
    /// the back (new, retried); a LIFO job without a priority at the front.
    fn make_ready(&mut self, j: usize, front: bool) {
        let job = &self.jobs[j];
        self.place(j, front || job.lifo && job.priority == 0);
    }

    /// Into the ready band, at the front or the back whatever the job's LIFO
    /// flag (promoted jobs go to the back: Redis LPUSHes them all).
    fn place(&mut self, j: usize, front: bool) {
        let t = self.next_tick();
        let job = &mut self.jobs[j];
        job.pos = if front { -t } else { t };
        job.state = MState::Ready;
    }

    fn park(&mut self, j: usize, due: u64) {
        let t = self.next_tick();
        let job = &mut self.jobs[j];
        job.pos = t;
        job.due = due;
        job.state = MState::Delayed;
    }

    fn finish(&mut self, j: usize, state: MState, now: u64) {
        let job = &mut self.jobs[j];
        job.attempts_made += 1;
        job.state = state;
        job.finished_on = Some(now);
        job.marked = false;
    }

    /// Jobs of one state in the order the core lists them (ready jobs in
    /// lease order, delayed by due time, active by deadline).
    fn in_order(&self, state: JobState) -> Vec<usize> {
        let mut out: Vec<usize> = (0..self.jobs.len()).filter(|&j| self.jobs[j].job_state() == state).collect();
        match state {
            JobState::Waiting | JobState::Prioritized => {
                out.sort_by_key(|&j| (self.jobs[j].priority, self.jobs[j].pos))
            }
            JobState::Delayed => out.sort_by_key(|&j| (self.jobs[j].due, self.jobs[j].pos)),
            JobState::Active => out.sort_by_key(|&j| (self.jobs[j].deadline, self.jobs[j].pos)),
            _ => {}
        }
        out
    }

    /// Every ready job, best first.
    fn ready_order(&self) -> Vec<usize> {
        let mut out = self.in_order(JobState::Waiting);
        out.extend(self.in_order(JobState::Prioritized));
        out
    }

    fn promote(&mut self, now: u64) {
        let due: Vec<usize> =
            self.in_order(JobState::Delayed).into_iter().filter(|&j| self.jobs[j].due <= now).collect();
        for j in due {
            self.place(j, false);
        }
    }

    fn next_due(&self) -> Option<u64> {
        self.in_order(JobState::Delayed).first().map(|&j| self.jobs[j].due)
    }

    fn is_held(&self, lease: usize) -> bool {
        let j = self.leases[lease].0;
        self.jobs[j].state == MState::Active && self.jobs[j].holder == Some(lease)
    }

    fn held(&self) -> Vec<usize> {
        (0..self.leases.len()).filter(|&l| self.is_held(l)).collect()
    }

    fn stale(&self) -> Vec<usize> {
        (0..self.leases.len()).filter(|&l| !self.is_held(l)).collect()
    }

    fn ids(&self, js: &[usize]) -> Vec<String> {
        js.iter().map(|&j| self.jobs[j].id.clone()).collect()
    }

    /// Applies a completion of a held lease; returns the state it leaves the job in.
    fn complete(&mut self, j: usize, outcome: &OutcomeSpec, now: u64) -> MState {
        match outcome {
            OutcomeSpec::Ok => self.finish(j, MState::Completed, now),
            OutcomeSpec::Fail => self.finish(j, MState::Failed, now),
            OutcomeSpec::Retry(after_ms) => {
                let job = &self.jobs[j];
                let delay = match after_ms {
                    // The caller decided: retried whatever the attempts left.
                    Some(ms) => Some(*ms),
                    None if job.attempts_made + 1 < job.attempts => {
                        Some(job.backoff.as_ref().map_or(0, |b| b.delay_after(job.attempts_made)))
                    }
                    None => None,
                };
                match delay {
                    None => self.finish(j, MState::Failed, now),
                    Some(d) => {
                        self.jobs[j].attempts_made += 1;
                        if d > 0 {
                            self.park(j, now + d)
                        } else {
                            // Behind the delayed jobs due by now (BullMQ's retryJob promotes first).
                            self.promote(now);
                            self.make_ready(j, false)
                        }
                    }
                }
            }
            OutcomeSpec::Release(after_ms) => match after_ms.filter(|a| *a > 0) {
                Some(a) => self.park(j, now + a),
                None => self.make_ready(j, true),
            },
            OutcomeSpec::Delay(offset) => self.park(j, now.saturating_add_signed(*offset).max(now)),
            OutcomeSpec::RateLimited(ms) => {
                self.limited_until = now + ms;
                self.make_ready(j, true);
            }
        }
        self.jobs[j].state
    }
}

// ---- the harness ------------------------------------------------------------

/// How the store runs writes: the default, or as a Node host has it under
/// relaxed durability, every write on the caller's thread whenever the
/// executor is idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writes {
    OnTheExecutor,
    OnTheCallersThread,
}

fn open(path: &Path, clock: &ManualClock, writes: Writes) -> Jobs {
    let options = match writes {
        Writes::OnTheExecutor => RedbOptions::default(),
        Writes::OnTheCallersThread => RedbOptions {
            durability: Durability::Relaxed { flush_interval_ms: 100 },
            run_on_callers_thread: Some(|| true),
            ..RedbOptions::default()
        },
    };
    let store = RedbStore::open(path, options).expect("open the redb file");
    Jobs::with_store(Box::new(store), Arc::new(clock.clone()), Config { background: false, ..Config::default() })
        .expect("open the core")
}

fn ok<T>(what: &str, r: Result<T, JobsError>) -> Result<T, TestCaseError> {
    r.map_err(|e| TestCaseError::fail(format!("{what} failed: {e:?}")))
}

/// What was first seen of a finished job.
#[derive(Clone, Debug, PartialEq)]
struct Finished {
    state: JobState,
    finished_on: Option<u64>,
    attempts_made: u32,
    epoch: u64,
    return_value: Option<Vec<u8>>,
    failed_reason: Option<String>,
}

/// What a step wrote, for the hard crash: a write acknowledged as durable
/// (enqueue, complete, sweep, promote) makes every earlier write durable too;
/// a lease or extend is acknowledged before it is durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wrote {
    Nothing,
    Durable,
    NotDurable,
}

struct Harness {
    dir: tempfile::TempDir,
    path: PathBuf,
    clock: ManualClock,
    jobs: Option<Jobs>,
    model: Model,
    finished: HashMap<String, Finished>,
    /// The model before each write since the last durable one, oldest first:
    /// the states a hard crash may roll the store back to.
    unflushed: Vec<Model>,
    hard_crashes: u32,
    writes: Writes,
}

impl Harness {
    fn new(writes: Writes) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("jobs.redb");
        let clock = ManualClock::new(START_MS);
        let jobs = open(&path, &clock, writes);
        let config = Config::default();
        let max_stalled =
            ok("read queue config", jobs.query(NS, Q, |tx, q| tx.queue_config(q))).expect("queue config").max_stalled;
        let model = Model { max_stalled, default_lock_ms: config.default_lock_ms, ..Model::default() };
        Self {
            dir,
            path,
            clock,
            jobs: Some(jobs),
            model,
            finished: HashMap::new(),
            unflushed: Vec::new(),
            hard_crashes: 0,
            writes,
        }
    }

    fn jobs(&self) -> &Jobs {
        self.jobs.as_ref().expect("the core is open")
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Runs one step and checks what it returned; the world is checked after.
    fn run(&mut self, step: &Step) -> Result<(), TestCaseError> {
        let before = self.model.clone();
        match self.run_step(step)? {
            Wrote::Nothing => {}
            Wrote::Durable => self.unflushed.clear(),
            Wrote::NotDurable => self.unflushed.push(before),
        }
        Ok(())
    }

    fn run_step(&mut self, step: &Step) -> Result<Wrote, TestCaseError> {
        let now = self.now();
        match step {
            Step::Enqueue { priority, lifo, delay_ms, attempts, backoff } => {
                let req = EnqueueRequest {
                    name: "job".into(),
                    data: b"{}".to_vec(),
                    priority: *priority,
                    lifo: *lifo,
                    delay_ms: *delay_ms,
                    attempts: *attempts,
                    backoff: backoff.as_ref().map(BackoffSpec::to_backoff),
                    ..Default::default()
                };
                let got = self.jobs().enqueue(NS, Q, req).wait();
                let e = ok("enqueue", got)?;
                let j = self.model.jobs.len();
                self.model.jobs.push(MJob {
                    id: (j + 1).to_string(),
                    priority: *priority,
                    lifo: *lifo,
                    attempts: *attempts,
                    backoff: backoff.clone(),
                    state: MState::Ready,
                    pos: 0,
                    due: now + delay_ms,
                    deadline: 0,
                    lock_ms: 0,
                    epoch: 0,
                    epoch_is: EpochIs::Unknown,
                    holder: None,
                    attempts_made: 0,
                    attempts_started: 0,
                    stalled: 0,
                    marked: false,
                    finished_on: None,
                });
                if *delay_ms > 0 {
                    let t = self.model.next_tick();
                    let job = &mut self.model.jobs[j];
                    // LIFO or not: delayed jobs due together keep the order they were added in.
                    job.pos = t;
                    job.state = MState::Delayed;
                } else {
                    self.model.make_ready(j, false);
                }
                let want = &self.model.jobs[j];
                prop_assert_eq!(&e.id, &want.id);
                prop_assert!(e.created);
                prop_assert_eq!(e.state, want.job_state());
                Ok(Wrote::Durable)
            }

            Step::Lease { max, lock_ms, fail_deferred } => {
                let req = LeaseRequest {
                    max: *max,
                    lock_duration_ms: *lock_ms,
                    fail_deferred: *fail_deferred,
                    ..Default::default()
                };
                let got = ok("lease", self.jobs().lease(NS, Q, req).wait())?;
                self.model.promote(now);
                let got_ids: Vec<String> = got.leases.iter().map(|l| l.job.id.clone()).collect();
                if self.model.limited_until > now {
                    prop_assert!(
                        got_ids.is_empty(),
                        "leased {got_ids:?} while rate limited until {}",
                        self.model.limited_until
                    );
                    prop_assert_eq!(got.info.rate_limit_ms, self.model.limited_until - now);
                    return Ok(Wrote::NotDurable);
                }
                // The ready jobs in order until `max` are taken: with
                // `fail_deferred`, those marked to fail are failed on the way.
                let mut take = Vec::new();
                // A lease that failed a job waits for its fsync, as any
                // recorded outcome does.
                let mut wrote = Wrote::NotDurable;
                for j in self.model.ready_order() {
                    if take.len() == *max as usize {
                        break;
                    }
                    if *fail_deferred && self.model.jobs[j].marked {
                        self.model.finish(j, MState::Failed, now);
                        wrote = Wrote::Durable;
                    } else {
                        take.push(j);
                    }
                }
                let ready = self.model.ready_order();
                // Weak form first, for a readable failure: nothing early, nothing
                // leased past a strictly better ready job.
                for l in &got.leases {
                    let j = self.model.jobs.iter().position(|m| m.id == l.job.id);
                    prop_assert!(j.is_some(), "leased unknown job {}", l.job.id);
                    let m = &self.model.jobs[j.unwrap_or_default()];
                    prop_assert!(
                        m.state == MState::Ready,
                        "leased job {} which the model has {:?} (due {}, now {now})",
                        m.id,
                        m.state,
                        m.due
                    );
                    let better = ready
                        .iter()
                        .map(|&k| &self.model.jobs[k])
                        .find(|r| r.priority < m.priority && !got_ids.contains(&r.id));
                    prop_assert!(
                        better.is_none(),
                        "leased job {} (priority {}) past ready job {:?}",
                        m.id,
                        m.priority,
                        better.map(|r| (&r.id, r.priority))
                    );
                }
                prop_assert_eq!(
                    &got_ids,
                    &self.model.ids(&take),
                    "lease(max {}) order; ready jobs best first: {:?}",
                    max,
                    ready
                        .iter()
                        .map(|&j| (&self.model.jobs[j].id, self.model.jobs[j].priority, self.model.jobs[j].pos))
                        .collect::<Vec<_>>()
                );
                let lock = if *lock_ms > 0 { *lock_ms } else { self.model.default_lock_ms };
                for (l, &j) in got.leases.iter().zip(&take) {
                    // A fencing token is never handed out twice, and the epoch
                    // only goes up.
                    let reused = self.model.leases.iter().any(|&(k, e)| k == j && e == l.epoch);
                    prop_assert!(
                        !reused,
                        "job {} leased again with epoch {} that an earlier lease holds",
                        l.job.id,
                        l.epoch
                    );
                    let holder = self.model.leases.len();
                    let job = &mut self.model.jobs[j];
                    prop_assert!(
                        l.epoch > job.epoch,
                        "lease of job {} with epoch {}, not above {}",
                        job.id,
                        l.epoch,
                        job.epoch
                    );
                    job.holder = Some(holder);
                    job.state = MState::Active;
                    job.epoch = l.epoch;
                    job.epoch_is = EpochIs::Known;
                    job.deadline = now + lock;
                    job.lock_ms = lock;
                    job.attempts_started += 1;
                    prop_assert_eq!(l.epoch, job.epoch, "epoch of the lease of {}", job.id);
                    prop_assert_eq!(l.job.epoch, job.epoch);
                    prop_assert_eq!(l.deadline, job.deadline);
                    self.model.leases.push((j, job.epoch));
                }
                if take.is_empty() {
                    prop_assert_eq!(got.info.next_due, self.model.next_due(), "next_due of an empty lease");
                }
                Ok(wrote)
            }

            Step::Extend { lease, ms } => {
                let held = self.model.held();
                if held.is_empty() {
                    return Ok(Wrote::Nothing);
                }
                let (j, epoch) = self.model.leases[held[lease % held.len()]];
                let id = self.model.jobs[j].id.clone();
                let got = ok(
                    "extend with the current epoch",
                    self.jobs().extend(NS, Q, &id, Fence::Epoch(epoch), *ms).wait(),
                )?;
                let job = &mut self.model.jobs[j];
                job.deadline = now + ms;
                job.lock_ms = *ms;
                prop_assert_eq!(got, job.deadline);
                Ok(Wrote::NotDurable)
            }

            Step::Complete { lease, outcome } => {
                let held = self.model.held();
                if held.is_empty() {
                    return Ok(Wrote::Nothing);
                }
                let (j, epoch) = self.model.leases[held[lease % held.len()]];
                let id = self.model.jobs[j].id.clone();
                let got = self
                    .jobs()
                    .complete(NS, Q, &id, Fence::Epoch(epoch), outcome.to_outcome(now), CompleteOptions::default())
                    .wait();
                let done = ok(&format!("complete {id} ({outcome:?}) with the current epoch {epoch}"), got)?;
                self.model.complete(j, outcome, now);
                let want = &self.model.jobs[j];
                prop_assert_eq!(done.state, Some(want.job_state()), "state after {:?}", outcome);
                prop_assert_eq!(
                    done.finished_on,
                    want.finished_on.filter(|_| matches!(want.state, MState::Completed | MState::Failed))
                );
                Ok(Wrote::Durable)
            }

            Step::StaleComplete { lease, outcome } => {
                let stale = self.model.stale();
                if stale.is_empty() {
                    return Ok(Wrote::Nothing);
                }
                let (j, epoch) = self.model.leases[stale[lease % stale.len()]];
                let id = self.model.jobs[j].id.clone();
                let got = self
                    .jobs()
                    .complete(NS, Q, &id, Fence::Epoch(epoch), outcome.to_outcome(now), CompleteOptions::default())
                    .wait()
                    .map(|c| c.state);
                self.expect_fenced(j, epoch, &format!("complete ({outcome:?})"), got)?;
                Ok(Wrote::Nothing)
            }

            Step::StaleExtend { lease } => {
                let stale = self.model.stale();
                if stale.is_empty() {
                    return Ok(Wrote::Nothing);
                }
                let (j, epoch) = self.model.leases[stale[lease % stale.len()]];
                let id = self.model.jobs[j].id.clone();
                let got = self.jobs().extend(NS, Q, &id, Fence::Epoch(epoch), 60_000).wait();
                self.expect_fenced(j, epoch, "extend", got)?;
                Ok(Wrote::Nothing)
            }

            Step::Sweep => {
                let got = ok("sweep_stalled", self.jobs().sweep_stalled(NS, Q).wait())?;
                let expired: Vec<usize> = self
                    .model
                    .in_order(JobState::Active)
                    .into_iter()
                    .filter(|&j| self.model.jobs[j].deadline < now)
                    .collect();
                prop_assert_eq!(&got, &self.model.ids(&expired), "reclaimed jobs, in deadline order");
                for j in expired {
                    // Raised: the next read must show an epoch above this one.
                    self.model.jobs[j].epoch_is = EpochIs::Above;
                    self.model.jobs[j].stalled += 1;
                    self.model.jobs[j].marked = self.model.jobs[j].stalled > self.model.max_stalled;
                    // Past the limit the job still goes back to the front, marked
                    // with a deferred failure for the next worker (BullMQ 6.7).
                    self.model.make_ready(j, true);
                    let id = self.model.jobs[j].id.clone();
                    let record = ok("read a swept job", self.jobs().get_job(NS, Q, &id))?;
                    let marked = record.and_then(|r| r.deferred_failure).is_some();
                    prop_assert_eq!(
                        marked,
                        self.model.jobs[j].stalled > self.model.max_stalled,
                        "deferred failure of {}",
                        id
                    );
                }
                Ok(Wrote::Durable)
            }

            Step::Promote => {
                let got = ok("promote_due", self.jobs().promote_due(NS, Q).wait())?;
                self.model.promote(now);
                prop_assert_eq!(got, self.model.next_due(), "next due time after promoting");
                Ok(Wrote::Durable)
            }

            Step::Advance(ms) => {
                self.clock.advance(*ms);
                Ok(Wrote::Nothing)
            }

            Step::AdvanceTo { pick, offset } => {
                let mut times: Vec<u64> = self
                    .model
                    .jobs
                    .iter()
                    .filter_map(|m| match m.state {
                        MState::Active => Some(m.deadline),
                        MState::Delayed => Some(m.due),
                        _ => None,
                    })
                    .chain([self.model.limited_until])
                    .map(|t| t.saturating_add_signed(i64::from(*offset)))
                    .filter(|&t| t > now)
                    .collect();
                times.sort_unstable();
                times.dedup();
                if !times.is_empty() {
                    self.clock.set(times[pick % times.len()]);
                }
                Ok(Wrote::Nothing)
            }

            Step::Crash => {
                let jobs = self.jobs.take().expect("open");
                jobs.close();
                drop(jobs);
                self.jobs = Some(open(&self.path, &self.clock, self.writes));
                // Nothing in the model changes: every acknowledged write survives.
                // Spot-check through the plain handle too.
                for m in &self.model.jobs {
                    let rec = ok("get_job after reopening", self.jobs().get_job(NS, Q, &m.id))?;
                    prop_assert!(rec.is_some_and(|r| r.state == m.job_state()), "job {} after reopening", m.id);
                }
                Ok(Wrote::Durable)
            }

            Step::HardCrash => {
                // What a kill -9 right now would leave on disk.
                self.hard_crashes += 1;
                let copy = self.dir.path().join(format!("crashed-{}.redb", self.hard_crashes));
                // The write-ahead log first: a checkpoint between the two
                // copies then only makes the log's records redundant.
                let log = |path: &std::path::Path| {
                    let mut name = path.as_os_str().to_owned();
                    name.push(".wal");
                    std::path::PathBuf::from(name)
                };
                std::fs::copy(log(&self.path), log(&copy))
                    .map_err(|e| TestCaseError::fail(format!("copy the log: {e}")))?;
                std::fs::copy(&self.path, &copy).map_err(|e| TestCaseError::fail(format!("copy the store: {e}")))?;
                if let Some(jobs) = self.jobs.take() {
                    jobs.close();
                }
                self.path = copy;
                self.jobs = Some(open(&self.path, &self.clock, self.writes));
                // Writes not acknowledged as durable may be lost: the store is
                // in the state after one of the writes since the last durable
                // one. The workers keep the leases they were given.
                let leases = self.model.leases.clone();
                let mut candidates = std::mem::take(&mut self.unflushed);
                candidates.push(self.model.clone());
                let mut first_error = None;
                for mut candidate in candidates.into_iter().rev() {
                    candidate.leases = leases.clone();
                    self.model = candidate;
                    match self.check() {
                        Ok(()) => return Ok(Wrote::Durable),
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
                Err(TestCaseError::fail(format!(
                    "the store after a hard crash is in none of the states since the last durable write; against the newest: {}",
                    first_error.map_or_else(String::new, |e| e.to_string())
                )))
            }
        }
    }

    fn expect_fenced<T: std::fmt::Debug>(
        &self,
        j: usize,
        epoch: u64,
        what: &str,
        got: Result<T, JobsError>,
    ) -> Result<(), TestCaseError> {
        let m = &self.model.jobs[j];
        let reason = if m.state == MState::Active { FenceFailure::Mismatch } else { FenceFailure::NoLease };
        match got {
            Err(JobsError::Fenced { job, current_epoch, reason: r }) => {
                prop_assert_eq!(&job, &m.id);
                prop_assert_eq!(current_epoch, m.epoch, "current epoch reported for {}", m.id);
                prop_assert_eq!(r, reason, "fence reason for {} ({:?})", m.id, m.state);
                Ok(())
            }
            other => Err(TestCaseError::fail(format!(
                "{what} of job {} with stale epoch {epoch} (current {}, {:?}) was not fenced: {other:?}",
                m.id, m.epoch, m.state
            ))),
        }
    }

    /// The world checks, after every step.
    fn check(&mut self) -> Result<(), TestCaseError> {
        let jobs = self.jobs();
        let model = &self.model;

        // Counts per state, and they add up to every acknowledged job.
        let counts = ok("counts", jobs.counts(NS, Q, &JobState::ALL))?;
        let want: Vec<u64> =
            JobState::ALL.iter().map(|s| model.jobs.iter().filter(|m| m.job_state() == *s).count() as u64).collect();
        prop_assert_eq!(&counts, &want, "counts per state {:?}", JobState::ALL);
        prop_assert_eq!(counts.iter().sum::<u64>(), model.jobs.len() as u64);

        // One snapshot: every state index, raw, and every acknowledged job.
        let ids: Vec<String> = model.jobs.iter().map(|m| m.id.clone()).collect();
        let (indexes, records) = ok(
            "read the indexes",
            jobs.query(NS, Q, |tx, q| {
                let keys = QueueKeys::new(q);
                let mut indexes = Vec::new();
                for state in JobState::ALL {
                    let entries = tx.scan(&query::state_range(&keys, state), usize::MAX, false)?;
                    let ids: Vec<String> =
                        entries.into_iter().map(|(_, v)| String::from_utf8_lossy(&v).into_owned()).collect();
                    indexes.push((state, ids));
                }
                let records = ids.iter().map(|id| query::get_job(tx, q, id)).collect::<Result<Vec<_>, _>>()?;
                Ok((indexes, records))
            }),
        )?;

        // Exactly one index lists each job, the one of its state; no stray entries.
        let mut listed: HashMap<&str, Vec<JobState>> = HashMap::new();
        for (state, ids) in &indexes {
            for id in ids {
                listed.entry(id.as_str()).or_default().push(*state);
            }
        }
        for m in &model.jobs {
            prop_assert_eq!(listed.get(m.id.as_str()), Some(&vec![m.job_state()]), "indexes listing job {}", m.id);
        }
        prop_assert_eq!(
            listed.len(),
            model.jobs.len(),
            "index entries of unknown jobs: {:?}",
            listed.keys().collect::<Vec<_>>()
        );

        // The ready, delayed and active indexes in the model's order.
        for (state, ids) in &indexes {
            if matches!(state, JobState::Waiting | JobState::Prioritized | JobState::Delayed | JobState::Active) {
                prop_assert_eq!(ids, &model.ids(&model.in_order(*state)), "{} index order", state);
            }
        }

        // Each record as the model has it.
        for (m, rec) in model.jobs.iter().zip(&records) {
            let Some(rec) = rec else {
                return Err(TestCaseError::fail(format!("acknowledged job {} is lost", m.id)));
            };
            prop_assert_eq!(rec.state, m.job_state(), "state of job {}", m.id);
            match m.epoch_is {
                EpochIs::Known => prop_assert_eq!(rec.epoch, m.epoch, "epoch of job {}", m.id),
                EpochIs::Above => {
                    prop_assert!(
                        rec.epoch > m.epoch,
                        "epoch of job {} is {}, not raised above {}",
                        m.id,
                        rec.epoch,
                        m.epoch
                    )
                }
                EpochIs::Unknown => {}
            }
            prop_assert_eq!(rec.attempts_made, m.attempts_made, "attempts made by job {}", m.id);
            prop_assert_eq!(rec.attempts_started, m.attempts_started, "attempts started by job {}", m.id);
            prop_assert_eq!(rec.stalled_counter, m.stalled, "stalls of job {}", m.id);
            prop_assert_eq!(rec.priority, m.priority);
            prop_assert_eq!(rec.lifo, m.lifo);
            if m.state == MState::Delayed {
                prop_assert_eq!(rec.due, m.due, "due time of job {}", m.id);
            }
            match (&rec.lock, m.state) {
                (Some(lock), MState::Active) => {
                    prop_assert_eq!(lock.deadline, m.deadline, "lease deadline of job {}", m.id);
                    prop_assert_eq!(lock.duration_ms, m.lock_ms, "lease length of job {}", m.id);
                }
                (None, MState::Active) => return Err(TestCaseError::fail(format!("active job {} has no lock", m.id))),
                (Some(lock), s) => {
                    return Err(TestCaseError::fail(format!("job {} is {s:?} but holds a lock {lock:?}", m.id)));
                }
                (None, _) => {}
            }
            if matches!(m.state, MState::Completed | MState::Failed) {
                prop_assert_eq!(rec.finished_on, m.finished_on, "finish time of job {}", m.id);
            }
        }

        // Learn the epochs raised by reclaims (checked above to have gone up).
        for (m, rec) in self.model.jobs.iter_mut().zip(&records) {
            if let Some(rec) = rec {
                m.epoch = rec.epoch;
                m.epoch_is = EpochIs::Known;
            }
        }

        // Outcomes are recorded once: what a finished job looked like the
        // first time it was seen finished never changes (observed, not modelled).
        for rec in records.iter().flatten() {
            let now = Finished {
                state: rec.state,
                finished_on: rec.finished_on,
                attempts_made: rec.attempts_made,
                epoch: rec.epoch,
                return_value: rec.return_value.clone(),
                failed_reason: rec.failed_reason.clone(),
            };
            match self.finished.get(&rec.id) {
                Some(first) => prop_assert_eq!(first, &now, "finished job {} changed", rec.id),
                None if rec.state.is_finished() => {
                    self.finished.insert(rec.id.clone(), now);
                }
                None => {}
            }
        }
        Ok(())
    }

    fn close(mut self) {
        if let Some(jobs) = self.jobs.take() {
            jobs.close();
        }
    }
}

fn run_steps(steps: &[Step], writes: Writes) -> Result<(), TestCaseError> {
    let mut h = Harness::new(writes);
    let result = (|| {
        for (i, step) in steps.iter().enumerate() {
            h.run(step).map_err(|e| TestCaseError::fail(format!("step {i} {step:?}: {e}")))?;
            h.check().map_err(|e| TestCaseError::fail(format!("after step {i} {step:?}: {e}")))?;
        }
        Ok(())
    })();
    h.close();
    result
}

proptest! {
    #![proptest_config(cases::config())]

    /// Design 26 §6 over random interleavings, with clean restarts.
    #[test]
    fn queue_keeps_its_guarantees(steps in proptest::collection::vec(step_strategy(false), 1..60)) {
        run_steps(&steps, Writes::OnTheExecutor)?;
    }

    /// The same, with each write run on the caller's thread (the Node host's
    /// way under relaxed durability; clean restarts lose nothing under it).
    #[test]
    fn queue_keeps_its_guarantees_with_writes_on_the_callers_thread(
        steps in proptest::collection::vec(step_strategy(false), 1..60)
    ) {
        run_steps(&steps, Writes::OnTheCallersThread)?;
    }

    /// The same, with hard crashes too: a lease is acknowledged before it is
    /// durable (a lost lease is a stalled one), so a crash may
    /// lose it. The worker that got it still holds its epoch, which must
    /// never be handed out again nor pass the fence.
    #[test]
    fn fencing_survives_a_hard_crash(steps in proptest::collection::vec(step_strategy(true), 1..60)) {
        run_steps(&steps, Writes::OnTheExecutor)?;
    }
}

// ---- checks that the checks can fail --------------------------------------

/// A hand-written history passes, and the same history checked against a
/// model with one rule wrong (stalled jobs to the back) fails.
#[test]
fn a_known_history_passes_and_a_wrong_model_fails() {
    use Step::*;
    let history = vec![
        Enqueue { priority: 2, lifo: false, delay_ms: 0, attempts: 2, backoff: None },
        Enqueue { priority: 0, lifo: false, delay_ms: 0, attempts: 1, backoff: None },
        Enqueue { priority: 0, lifo: true, delay_ms: 0, attempts: 1, backoff: None },
        Enqueue { priority: 1, lifo: false, delay_ms: 500, attempts: 1, backoff: None },
        Lease { max: 2, lock_ms: 1_000, fail_deferred: false },
        Enqueue { priority: 0, lifo: false, delay_ms: 0, attempts: 1, backoff: None },
        Advance(1_001),
        Sweep,
        Crash,
        StaleComplete { lease: 0, outcome: OutcomeSpec::Ok },
        Lease { max: 4, lock_ms: 0, fail_deferred: false },
        Complete { lease: 0, outcome: OutcomeSpec::Retry(None) },
        Complete { lease: 0, outcome: OutcomeSpec::Ok },
        StaleExtend { lease: 0 },
        // A job stalls twice (past max_stalled 1), and a lease that fails
        // deferred failures fails it and takes the job behind it.
        Enqueue { priority: 0, lifo: false, delay_ms: 0, attempts: 1, backoff: None },
        Lease { max: 1, lock_ms: 500, fail_deferred: false },
        Advance(1_001),
        Sweep,
        Lease { max: 1, lock_ms: 500, fail_deferred: false },
        Advance(1_001),
        Sweep,
        Enqueue { priority: 0, lifo: false, delay_ms: 0, attempts: 1, backoff: None },
        Lease { max: 1, lock_ms: 0, fail_deferred: true },
    ];
    run_steps(&history, Writes::OnTheExecutor).unwrap();
    run_steps(&history, Writes::OnTheCallersThread).unwrap();

    // The same history against a model that forgot the stalled sweep's front
    // placement must fail: the checks are not tautologies.
    let mut h = Harness::new(Writes::OnTheExecutor);
    let mut failed = false;
    for step in &history {
        h.run(step).unwrap();
        if matches!(step, Sweep) {
            // Corrupt the model: move the reclaimed jobs to the back.
            let ready = h.model.ready_order();
            for j in ready {
                if h.model.jobs[j].stalled > 0 {
                    h.model.tick += 1;
                    h.model.jobs[j].pos = h.model.tick;
                }
            }
        }
        if h.check().is_err() {
            failed = true;
            break;
        }
    }
    h.close();
    assert!(failed, "a model with the wrong order was not caught");
}
