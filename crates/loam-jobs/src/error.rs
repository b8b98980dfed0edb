//! Errors. [`StoreError`] is what an engine can report; [`JobsError`] is what a
//! caller of the core sees, one variant per Connect code family, with enough
//! detail that the BullMQ binding can map each to BullMQ's own error codes
//! without parsing messages.

use std::fmt;

use crate::model::JobState;

/// Failures of the storage engine itself.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum StoreError {
    #[error("storage I/O failed: {0}")]
    Io(String),
    #[error("a stored record is corrupt: {0}")]
    Corrupt(String),
    #[error("the store is already open in another process: {0}")]
    Locked(String),
    #[error("the store is closed")]
    Closed,
    /// The store stopped taking writes by itself, while open: a fault of its
    /// own (a bug), which it survived without taking its host down.
    #[error("the store stopped after an internal fault: reopening it replays its log")]
    Stopped,
    /// A write reached a snapshot that only reads (a query's): a fault in the
    /// core, not in the storage, so it is not worth asking again.
    #[error("a write in a read-only query")]
    ReadOnly,
    /// An optimistic transaction lost a race; the engine retries it.
    #[error("transaction conflict")]
    Conflict,
}

/// Which kind of thing was not found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    Job(String),
    ParentJob(String),
    Queue(String),
    Scheduler(String),
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Missing::Job(id) => write!(f, "job {id}"),
            Missing::ParentJob(key) => write!(f, "parent job {key}"),
            Missing::Queue(q) => write!(f, "queue {q}"),
            Missing::Scheduler(id) => write!(f, "job scheduler {id}"),
        }
    }
}

/// Why a fenced write was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceFailure {
    /// The job holds no lease (it was reclaimed, or never leased).
    NoLease,
    /// The job is leased under another token or epoch.
    Mismatch,
}

/// A precondition of the operation did not hold (Connect `failed_precondition`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Precondition {
    /// The job is in `state`, where the operation needs it `expected`.
    NotInState { job: String, state: JobState, expected: JobState },
    /// The job still has unfinished children.
    PendingChildren { job: String },
    /// A child failed and the parent may not continue.
    FailedChildren { job: String },
    /// A job with this id exists and is a flow parent that cannot be replaced.
    ParentCannotBeReplaced { job: String },
    /// The job is the current iteration of a job scheduler.
    BelongsToScheduler { job: String },
    /// A scheduler's next job id is taken by a job that is not the scheduler's.
    SchedulerIdCollision { scheduler: String },
    /// The scheduler already has a job waiting for that slot.
    SchedulerSlotsBusy { scheduler: String },
    /// Obliterate needs a paused queue.
    QueueNotPaused { queue: String },
    /// Obliterate without force refuses a queue with active jobs.
    QueueHasActiveJobs { queue: String },
}

impl fmt::Display for Precondition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Precondition::NotInState { job, state, expected } => {
                write!(f, "job {job} is {state}, not {expected}")
            }
            Precondition::PendingChildren { job } => write!(f, "job {job} has pending children"),
            Precondition::FailedChildren { job } => write!(f, "job {job} has failed children"),
            Precondition::ParentCannotBeReplaced { job } => {
                write!(f, "job {job} is a parent and cannot be replaced")
            }
            Precondition::BelongsToScheduler { job } => {
                write!(f, "job {job} belongs to a job scheduler")
            }
            Precondition::SchedulerIdCollision { scheduler } => {
                write!(f, "the next job id of scheduler {scheduler} is taken")
            }
            Precondition::SchedulerSlotsBusy { scheduler } => {
                write!(f, "scheduler {scheduler} already has a job for that slot")
            }
            Precondition::QueueNotPaused { queue } => write!(f, "cannot obliterate non-paused queue {queue}"),
            Precondition::QueueHasActiveJobs { queue } => {
                write!(f, "cannot obliterate queue {queue} with active jobs")
            }
        }
    }
}

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum JobsError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("not found: {0}")]
    NotFound(Missing),
    #[error("job {existing} already exists with other parameters")]
    AlreadyExists { existing: String },
    #[error("idempotency key {key} was used for another request")]
    IdempotencyConflict { key: String },
    #[error("lease of job {job} is fenced ({reason:?}); current epoch {current_epoch}")]
    Fenced { job: String, current_epoch: u64, reason: FenceFailure },
    #[error("{0}")]
    Precondition(Precondition),
    #[error("queue {0} is paused")]
    QueuePaused(String),
    #[error("rate limited; retry after {retry_after_ms} ms")]
    RateLimited { retry_after_ms: u64 },
    #[error("payload of {size} bytes is over the limit of {limit} bytes")]
    PayloadTooLarge { size: usize, limit: usize },
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("deadline exceeded")]
    DeadlineExceeded,
    #[error("internal error: {0}")]
    Internal(String),
}

/// BullMQ's error codes (its `ErrorCode` enum), which BullMQ's callers read
/// from a failed call: the Node addon sets them, and the server sends them in
/// its error detail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum BullmqCode {
    JobNotExist = -1,
    JobLockNotExist = -2,
    JobNotInState = -3,
    JobPendingChildren = -4,
    ParentJobNotExist = -5,
    JobLockMismatch = -6,
    ParentJobCannotBeReplaced = -7,
    JobBelongsToJobScheduler = -8,
    JobHasFailedChildren = -9,
    SchedulerJobIdCollision = -10,
    SchedulerJobSlotsBusy = -11,
}

impl JobsError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        JobsError::InvalidArgument(msg.into())
    }

    /// An operation that panicked (a bug): it fails with the panic's
    /// message, and the store and its host go on.
    pub fn panicked(payload: Box<dyn std::any::Any + Send>) -> Self {
        JobsError::Internal(format!("operation panicked: {}", panic_text(payload.as_ref())))
    }

    pub fn job_missing(id: &str) -> Self {
        JobsError::NotFound(Missing::Job(id.to_string()))
    }

    pub fn not_in_state(job: &str, state: JobState, expected: JobState) -> Self {
        JobsError::Precondition(Precondition::NotInState { job: job.to_string(), state, expected })
    }

    /// BullMQ's code for this error, when BullMQ has one.
    pub fn bullmq_code(&self) -> Option<BullmqCode> {
        Some(match self {
            JobsError::NotFound(Missing::Job(_)) => BullmqCode::JobNotExist,
            JobsError::NotFound(Missing::ParentJob(_)) => BullmqCode::ParentJobNotExist,
            JobsError::Fenced { reason: FenceFailure::NoLease, .. } => BullmqCode::JobLockNotExist,
            JobsError::Fenced { reason: FenceFailure::Mismatch, .. } => BullmqCode::JobLockMismatch,
            JobsError::Precondition(p) => match p {
                Precondition::NotInState { .. } => BullmqCode::JobNotInState,
                Precondition::PendingChildren { .. } => BullmqCode::JobPendingChildren,
                Precondition::FailedChildren { .. } => BullmqCode::JobHasFailedChildren,
                Precondition::ParentCannotBeReplaced { .. } => BullmqCode::ParentJobCannotBeReplaced,
                Precondition::BelongsToScheduler { .. } => BullmqCode::JobBelongsToJobScheduler,
                Precondition::SchedulerIdCollision { .. } => BullmqCode::SchedulerJobIdCollision,
                Precondition::SchedulerSlotsBusy { .. } => BullmqCode::SchedulerJobSlotsBusy,
                Precondition::QueueNotPaused { .. } | Precondition::QueueHasActiveJobs { .. } => return None,
            },
            _ => return None,
        })
    }

    /// The Connect code this error travels as.
    pub fn connect_code(&self) -> &'static str {
        match self {
            JobsError::InvalidArgument(_) => "invalid_argument",
            JobsError::NotFound(_) => "not_found",
            JobsError::AlreadyExists { .. } => "already_exists",
            JobsError::IdempotencyConflict { .. } | JobsError::Fenced { .. } | JobsError::Precondition(_) => {
                "failed_precondition"
            }
            JobsError::QueuePaused(_) | JobsError::Unavailable(_) => "unavailable",
            JobsError::RateLimited { .. } | JobsError::PayloadTooLarge { .. } => "resource_exhausted",
            JobsError::DeadlineExceeded => "deadline_exceeded",
            JobsError::Internal(_) => "internal",
        }
    }
}

impl From<StoreError> for JobsError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Corrupt(m) => JobsError::Internal(format!("corrupt record: {m}")),
            e @ StoreError::ReadOnly => JobsError::Internal(e.to_string()),
            other => JobsError::Unavailable(other.to_string()),
        }
    }
}

/// The message a panic carried (`panic!` with a literal or a formatted
/// string), for turning a caught panic into an error.
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}
