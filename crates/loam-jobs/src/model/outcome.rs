//! How a leased job ends: a worker's reports and outcomes, and what a completion answers.

use serde::Serialize;

use super::idempotency::Idempotency;
use super::job::{JobState, Retention};
use super::lease::{LeaseRequest, Leased};

/// What a worker reports about the job it holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Report {
    /// JSON text; emits `progress`.
    Progress(String),
    /// A log line; the newest `keep` are kept (else the job's `keep_logs`,
    /// else the core's cap).
    Log { row: String, keep: Option<u64> },
    /// The job's new payload.
    Data(#[serde(with = "serde_bytes")] Vec<u8>),
}

/// How a leased job ends.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Ok {
        result: Option<Vec<u8>>,
    },
    /// Try again: after `after_ms`, or the job's backoff when None. `error`
    /// is recorded on the job (None leaves its error fields as they are).
    Retry {
        error: Option<JobError>,
        after_ms: Option<u64>,
    },
    /// No more attempts. `dead_letter` sends it to the queue's dead-letter queue.
    Fail {
        error: JobError,
        dead_letter: bool,
    },
    /// Give the job back without spending an attempt.
    Release {
        after_ms: Option<u64>,
    },
    /// Park the job until `until` (BullMQ moveToDelayed), recording
    /// `delay_ms` as its delay (BullMQ counts it from its own clock), or,
    /// without it, `until` less the transaction's now.
    Delay {
        until: u64,
        delay_ms: Option<u64>,
    },
    /// Park a parent until its children finish (BullMQ moveToWaitingChildren),
    /// or, with `child` (its node key), until that one child finishes.
    WaitChildren {
        child: Option<String>,
    },
    /// Give the job back and stop the whole queue for `for_ms`.
    RateLimited {
        for_ms: u64,
    },
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobError {
    pub message: String,
    pub stacktrace: Option<String>,
    /// Keep at most this many stack traces (BullMQ's `stackTraceLimit`).
    pub stacktrace_limit: Option<usize>,
    /// The job's whole list of stack traces, replacing the stored one; the
    /// two fields above are then unused. BullMQ's Job keeps its list itself
    /// and saves it whole: an error without a stack adds nothing to it, and
    /// a failure the store refused stays in it, so appending its newest
    /// entry would not give its list.
    pub stacktraces: Option<Vec<String>>,
}

impl JobError {
    pub fn new(message: impl Into<String>) -> Self {
        Self { message: message.into(), ..Default::default() }
    }

    /// The error with its message and stack trace cut to `max` bytes each.
    /// Cut rather than refused: refusing a worker's failure would leave its
    /// job active until its lock ran out, and then failed as stalled.
    pub fn bounded(mut self, max: usize) -> Self {
        cut(&mut self.message, max);
        for stack in self.stacktrace.iter_mut().chain(self.stacktraces.iter_mut().flatten()) {
            cut(stack, max);
        }
        self
    }
}

/// Cuts `text` to at most `max` bytes, at a character boundary, saying so.
fn cut(text: &mut String, max: usize) {
    const MARK: &str = " [cut]";
    if text.len() <= max {
        return;
    }
    let mut at = max.saturating_sub(MARK.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    text.truncate(at);
    text.push_str(MARK);
}

/// What a completion needs besides the outcome: the worker's settings.
#[derive(Clone, Debug, Default)]
pub struct CompleteOptions {
    /// Lease the next job in the same transaction.
    pub fetch_next: Option<LeaseRequest>,
    /// Retention when the job does not set its own.
    pub remove_on_complete: Option<Retention>,
    pub remove_on_fail: Option<Retention>,
    /// Keep per-minute metrics with this many data points (BullMQ's `metrics.maxDataPoints`).
    pub metrics_max_points: Option<u64>,
    /// Sent again under this key, the completion answers what it first did
    /// (see `complete::complete`); only the key is used, not its ttl.
    pub idempotency: Option<Idempotency>,
}

#[derive(Clone, Debug, Default)]
pub struct Completed {
    /// The state the job ended in (None in a repeat's answer when retention
    /// removed the job).
    pub state: Option<JobState>,
    /// Retention removed the job as it finished.
    pub removed: bool,
    pub finished_on: Option<u64>,
    /// For WaitChildren: whether the job now waits (false = no pending children).
    pub moved: bool,
    /// The next job, when the completion asked for one.
    pub next: Option<Leased>,
    /// The attempt this outcome ended (completed, failed or to be retried):
    /// for run-time metrics by task.
    pub attempt: Option<AttemptRun>,
    /// The completion was made before under its idempotency key: this is
    /// that first answer, and nothing was done now.
    pub replayed: bool,
}

/// One attempt of a job, from its lease to its outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttemptRun {
    /// The job's name: BullMQ's job name, Celery's task.
    pub task: String,
    /// Job time from the lease to the outcome.
    pub ran_ms: u64,
}
