//! Idempotency keys: what a caller sends, and the record a keyed call leaves.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    pub request_hash: u64,
    /// The job the call made (an add) or was about.
    pub job_id: String,
    pub expires_at: u64,
    /// For a report: the log lines it kept, its answer. None for an add
    /// (its answer is its job), and in records written before reports were keyed.
    #[serde(default)]
    pub log_count: Option<u64>,
    /// For a completion whose job retention removed (the job's record, which
    /// keeps a completion's key otherwise, is gone): when the job finished.
    #[serde(default)]
    pub finished_on: Option<u64>,
    /// How `request_hash` was made (`idempotency::CallHash`): 0 in records
    /// written before an add's hash covered its whole request.
    #[serde(default)]
    pub hash_version: u8,
    /// For an add a deduplication id absorbed: `job_id` held the id.
    #[serde(default)]
    pub deduplicated: bool,
    /// For a bulk add under a key for the whole call: what became of each
    /// of its jobs, in its order; None for one refused, which a repeat tries
    /// again (a refusal writes nothing). Empty for any other call, and then
    /// left out of the encoding: a build from before this field reads a
    /// record as long as the fields it knows, and refuses a longer one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bulk: Vec<Option<BulkAdded>>,
}

/// A job a keyed bulk add made (or found: an id, a deduplication id).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BulkAdded {
    pub job_id: String,
    /// A deduplication id absorbed the add: `job_id` held the id.
    pub deduplicated: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Idempotency {
    pub key: String,
    /// Default 24 hours.
    pub ttl_ms: Option<u64>,
}
