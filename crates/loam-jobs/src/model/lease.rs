//! Leases: what a worker asks for, what it gets, and the fence its writes carry.

use serde::Serialize;

use super::job::JobRecord;

/// A fencing proof for a write to a leased job.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Fence {
    /// The lease epoch handed out by `lease`.
    Epoch(u64),
    /// The lock token the lease was taken with (BullMQ's worker token).
    Token(String),
    /// No lease is held: the write is an admin action (BullMQ's token "0").
    Unchecked,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RateLimit {
    pub max: u64,
    pub duration_ms: u64,
}

#[derive(Clone, Debug, Default)]
pub struct LeaseRequest {
    pub max: u32,
    /// Lock token for the leases; unique per lease. Empty = generate one.
    pub token: String,
    pub worker: Option<String>,
    pub lock_duration_ms: u64,
    /// Only jobs with these names (Celery routing by name).
    pub names: Option<Vec<String>>,
    /// The worker's limiter, used when the queue has no global one.
    pub limiter: Option<RateLimit>,
    /// Most bytes of job data the leases may carry together (the first job is
    /// always taken): a server bounds its answer with it. None = no bound.
    pub max_bytes: Option<u64>,
    /// Fail, in the lease's transaction and without handing them out, the
    /// jobs marked with a [`JobRecord::deferred_failure`]: a client that died
    /// between taking such a job and failing it would leave it held until
    /// its lock lapsed. Off for BullMQ, whose Worker takes them and fails
    /// them itself.
    pub fail_deferred: bool,
}

/// A job handed to a worker.
#[derive(Clone, Debug)]
pub struct Lease {
    pub job: JobRecord,
    pub epoch: u64,
    pub token: String,
    pub deadline: u64,
}

/// Why a lease returned fewer jobs than asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseInfo {
    /// The queue is rate limited for this many more ms.
    pub rate_limit_ms: u64,
    /// The next delayed job is due at this time.
    pub next_due: Option<u64>,
    pub paused: bool,
    /// Global concurrency is exhausted.
    pub maxed: bool,
    /// Jobs the lease failed instead of handing them out: expired before
    /// they started, or marked to fail (`LeaseRequest::fail_deferred`).
    pub failed: u32,
}

#[derive(Clone, Debug, Default)]
pub struct Leased {
    pub leases: Vec<Lease>,
    pub info: LeaseInfo,
}
