//! A job as a caller adds it, and what the add did.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::flow::{OnChildFailure, ParentRef};
use super::idempotency::Idempotency;
use super::job::{Backoff, Dedup, JobState, Retention};

/// A job as a caller describes it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EnqueueRequest {
    pub name: String,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// Opaque options document kept with the job (BullMQ's `opts` JSON).
    pub opts: String,
    pub headers: BTreeMap<String, String>,
    /// Unique in the queue while the job exists (BullMQ `jobId`).
    pub job_id: Option<String>,
    pub idempotency: Option<Idempotency>,
    pub dedup: Option<Dedup>,
    pub delay_ms: u64,
    /// 0 = the FIFO band; otherwise 1..=2^21-1, lower first.
    pub priority: u32,
    pub lifo: bool,
    /// Total attempts, at least 1.
    pub attempts: u32,
    pub backoff: Option<Backoff>,
    pub lock_duration_ms: Option<u64>,
    pub timeout_ms: Option<u64>,
    /// Absolute expiry in ms since the epoch.
    pub expires: Option<u64>,
    pub parent: Option<ParentRef>,
    pub on_child_failure: OnChildFailure,
    pub remove_on_complete: Option<Retention>,
    pub remove_on_fail: Option<Retention>,
    pub keep_logs: Option<u64>,
    pub dead_letter: Option<String>,
    /// Timestamp to record instead of now (BullMQ passes its own `timestamp`).
    pub timestamp: Option<u64>,
    /// The scheduler this job is an iteration of.
    pub scheduler_id: Option<String>,
}

/// What `enqueue` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Enqueued {
    pub id: String,
    /// False when an existing job was returned (same job id, idempotency key
    /// or dedup id).
    pub created: bool,
    /// The job's state; for a dedup key that outlived its job (removed when
    /// it finished, before the key's ttl ran out), completed.
    pub state: JobState,
    /// Set when a dedup id matched: the job that holds the dedup key.
    pub deduplicated_by: Option<String>,
}
