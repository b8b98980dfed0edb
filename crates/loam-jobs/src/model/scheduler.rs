//! Job schedulers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A job scheduler (BullMQ's `upsertJobScheduler`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerRecord {
    pub id: String,
    /// Job name of each iteration.
    pub name: String,
    pub pattern: Option<String>,
    pub every_ms: Option<u64>,
    pub offset_ms: Option<u64>,
    pub tz: Option<String>,
    pub start_date: Option<u64>,
    pub end_date: Option<u64>,
    pub limit: Option<u64>,
    /// Iterations created so far (BullMQ's `ic`).
    pub iteration_count: u64,
    pub next_millis: u64,
    /// Template data and options for each iteration's job.
    pub template_data: String,
    pub template_opts: String,
    /// The job of the pending iteration.
    pub next_job_id: Option<String>,
    /// Anything else the caller keeps with the scheduler.
    pub extra: BTreeMap<String, String>,
    /// The pending iteration's number among those `limit` bounds (BullMQ's
    /// `repeat.count`): unlike `iteration_count`, an upsert may restart it.
    /// None in records written before it was kept: `iteration_count` then.
    #[serde(default)]
    pub repeat_count: Option<u64>,
}

/// The key of [`SchedulerRecord::extra`] that marks a schedule the server
/// owns and ticks itself (`loam-jobs serve`'s `Schedule{server}`).
pub const SERVER_OWNED: &str = "loam.owner";

/// The prefix of the `extra` keys a server schedule keeps (its owner and its
/// job template); a caller's scheduler of the same id replaces them.
pub const SERVER_EXTRA_PREFIX: &str = "loam.";

impl SchedulerRecord {
    pub fn repeat_count(&self) -> u64 {
        self.repeat_count.unwrap_or(self.iteration_count)
    }

    /// Whether the server owns this schedule: a caller's `advance` leaves it
    /// alone, so a BullMQ worker, remote or in-process on a data directory
    /// the server once served, never moves a tick the server enqueues.
    pub fn server_owned(&self) -> bool {
        self.extra.contains_key(SERVER_OWNED)
    }
}
