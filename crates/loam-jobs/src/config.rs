//! Settings of the core and of each queue.

use serde::{Deserialize, Serialize};

use crate::store::Durability;

/// Settings of one open core.
#[derive(Clone, Debug)]
pub struct Config {
    /// Largest payload accepted, in bytes: a job's data, options and headers
    /// together, a return value, a result-store value, a published event, a
    /// queue-meta write. A failure's message and stack trace are cut to it.
    pub max_payload_bytes: usize,
    /// Default length of a queue's event log (BullMQ's 10,000).
    pub max_events: u64,
    /// Lease length when neither the job nor the lease request sets one.
    pub default_lock_ms: u64,
    /// How long an idempotency key is remembered by default.
    pub idempotency_ttl_ms: u64,
    /// Log lines kept per job when the job does not say.
    pub max_logs_per_job: u64,
    /// Run the delayed-job timers (which wake waiting workers) and the stalled
    /// sweep on a background thread.
    pub background: bool,
    pub durability: Durability,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_payload_bytes: 64 << 20,
            max_events: 10_000,
            default_lock_ms: 30_000,
            idempotency_ttl_ms: 24 * 3600 * 1000,
            max_logs_per_job: 1000,
            background: true,
            durability: Durability::Immediate,
        }
    }
}

/// Settings stored with a queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueConfig {
    /// Times a job may stall before it fails (BullMQ's `maxStalledCount`).
    pub max_stalled: u32,
    /// How often the stalled sweep visits the queue.
    pub stalled_interval_ms: u64,
    /// Queue that receives dead-lettered jobs.
    pub dead_letter_queue: Option<String>,
    /// Send jobs that exhaust their attempts to the dead-letter queue.
    pub dead_letter_on_exhausted: bool,
}

impl QueueConfig {
    pub fn defaults(_config: &Config) -> Self {
        Self { max_stalled: 1, stalled_interval_ms: 30_000, dead_letter_queue: None, dead_letter_on_exhausted: false }
    }
}
