//! A deduplication id's record.

use serde::{Deserialize, Serialize};

use super::enqueue::EnqueueRequest;
use super::job::{JobRecord, JobState};

/// A dedup id's record: its key (the job holding the id, and until when) and
/// the add `keepLastIfActive` kept, which Redis keeps apart from the key
/// (`de:<id>` and `dn:<id>`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DedupRecord {
    pub job_id: String,
    /// None = held until the job finishes.
    pub expires_at: Option<u64>,
    /// keepLastIfActive: the newest add, made when a job of the id finishes.
    pub next: Option<Box<EnqueueRequest>>,
    /// The key was removed (BullMQ's `removeDeduplicationKey`) while an add
    /// was kept: the record deduplicates nothing and holds `next` alone.
    #[serde(default)]
    pub key_removed: bool,
}

impl DedupRecord {
    /// The key of a job that holds the id from now on, with the add kept so far.
    pub fn held_by(job_id: &str, expires_at: Option<u64>, next: Option<Box<EnqueueRequest>>) -> Self {
        Self { job_id: job_id.to_string(), expires_at, next, key_removed: false }
    }

    /// The job holding the id, unless the key was removed.
    pub fn holder(&self) -> Option<&str> {
        (!self.key_removed).then_some(self.job_id.as_str())
    }

    /// Whether the key still deduplicates at `now`: before its ttl, or, with
    /// keepLastIfActive, for as long as its job is active (so a long job
    /// never runs twice in parallel).
    pub fn is_live(&self, job: &JobRecord, now: u64) -> bool {
        let held = job.state == JobState::Active && job.dedup.as_ref().is_some_and(|d| d.keep_last_if_active);
        held || self.expires_at.is_none_or(|e| e > now)
    }
}
