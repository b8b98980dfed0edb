//! A job's stored record, and the options it keeps.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::encode_with_capacity;
use super::flow::{OnChildFailure, ParentRef};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JobState {
    /// Ready, in the FIFO band (no priority).
    Waiting,
    /// Ready, with a priority.
    Prioritized,
    Delayed,
    Active,
    WaitingChildren,
    Completed,
    Failed,
}

impl JobState {
    /// BullMQ's name for the state.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Waiting => "waiting",
            JobState::Prioritized => "prioritized",
            JobState::Delayed => "delayed",
            JobState::Active => "active",
            JobState::WaitingChildren => "waiting-children",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "waiting" | "wait" => JobState::Waiting,
            "prioritized" => JobState::Prioritized,
            "delayed" => JobState::Delayed,
            "active" => JobState::Active,
            "waiting-children" => JobState::WaitingChildren,
            "completed" => JobState::Completed,
            "failed" => JobState::Failed,
            _ => return None,
        })
    }

    pub fn is_finished(self) -> bool {
        matches!(self, JobState::Completed | JobState::Failed)
    }

    pub const ALL: [JobState; 7] = [
        JobState::Waiting,
        JobState::Prioritized,
        JobState::Delayed,
        JobState::Active,
        JobState::WaitingChildren,
        JobState::Completed,
        JobState::Failed,
    ];
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum Backoff {
    Fixed {
        delay_ms: u64,
        #[serde(default)]
        jitter: f64,
    },
    Exponential {
        delay_ms: u64,
        #[serde(default)]
        jitter: f64,
        #[serde(default)]
        max_ms: Option<u64>,
    },
}

impl Backoff {
    /// Delay before attempt `attempts_made + 1`, BullMQ's formulas: fixed is
    /// `delay`, exponential is `2^(attempts_made - 1) * delay`; a jitter `j`
    /// draws uniformly from `[(1 - j) * d, d]`.
    pub fn delay_ms(&self, attempts_made: u32, random_unit: f64) -> u64 {
        let (base, jitter) = match self {
            Backoff::Fixed { delay_ms, jitter } => (*delay_ms as f64, *jitter),
            Backoff::Exponential { delay_ms, jitter, max_ms } => {
                let exp = attempts_made.saturating_sub(1).min(62);
                let d = (*delay_ms as f64) * 2f64.powi(exp as i32);
                (max_ms.map_or(d, |m| d.min(m as f64)), *jitter)
            }
        };
        let jitter = jitter.clamp(0.0, 1.0);
        let d = if jitter > 0.0 { base * (1.0 - jitter) + base * jitter * random_unit } else { base };
        d.round().clamp(0.0, u64::MAX as f64) as u64
    }
}

/// How many finished jobs to keep (BullMQ's `KeepJobs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Keep {
    /// Keep at most this many jobs in the state (None = no count limit).
    pub count: Option<u64>,
    /// Keep jobs finished at most this many milliseconds ago.
    pub age_ms: Option<u64>,
    /// Most jobs one completion removes by age (BullMQ's default 1000).
    pub limit: Option<u64>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Retention {
    /// Keep every finished job (the default).
    #[default]
    KeepAll,
    /// Remove the job as soon as it finishes.
    RemoveImmediately,
    Keep(Keep),
}

/// BullMQ's deduplication options.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dedup {
    pub id: String,
    /// Throttle / debounce window; None = until the job finishes (simple mode).
    pub ttl_ms: Option<u64>,
    /// Debounce: a new add restarts the ttl.
    pub extend: bool,
    /// Debounce: a new add replaces the pending (delayed) job's data and options.
    pub replace: bool,
    /// While the deduplicated job is active, keep the newest add and enqueue it
    /// when the active job finishes.
    pub keep_last_if_active: bool,
    /// A duplicate add moves the pending delayed job to the new delay.
    pub reschedule: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lock {
    /// The caller's lock token (BullMQ's worker token), unique per lease.
    pub token: String,
    pub deadline: u64,
    /// The lease duration it was taken or last extended with.
    pub duration_ms: u64,
    /// The idempotency key of the completion that took this lease for its
    /// next job (fetch_next): sent again, that completion finds it by it.
    #[serde(default)]
    pub taken_by: Option<String>,
}

/// The stored job.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: String,
    pub name: String,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// The caller's own options document (BullMQ's `opts` JSON), kept verbatim.
    pub opts: String,
    pub state: JobState,
    pub priority: u32,
    /// Asked for LIFO: it places the job only while it has no priority
    /// (BullMQ on Redis files a prioritized job FIFO within its priority).
    pub lifo: bool,
    /// Order within the priority band; see [`SEQ_ORIGIN`].
    pub seq: u64,
    pub timestamp: u64,
    pub delay: u64,
    /// When a delayed job becomes ready.
    pub due: u64,
    pub attempts: u32,
    pub attempts_made: u32,
    pub attempts_started: u32,
    pub stalled_counter: u32,
    pub backoff: Option<Backoff>,
    /// Fencing epoch: raised by every lease and every reclaim.
    pub epoch: u64,
    pub lock: Option<Lock>,
    /// Lease length for this job (None = the lease request's).
    pub lock_duration_ms: Option<u64>,
    /// Hard cap on a lease from `processed_on`.
    pub timeout_ms: Option<u64>,
    /// Not started after this time: discarded as failed.
    pub expires: Option<u64>,
    pub processed_on: Option<u64>,
    pub finished_on: Option<u64>,
    pub processed_by: Option<String>,
    /// JSON text.
    pub progress: Option<String>,
    #[serde(with = "serde_bytes")]
    pub return_value: Option<Vec<u8>>,
    pub failed_reason: Option<String>,
    pub stacktrace: Vec<String>,
    /// Failure deferred by a stalled sweep, reported when the job next moves.
    pub deferred_failure: Option<String>,
    pub parent: Option<ParentRef>,
    pub on_child_failure: OnChildFailure,
    /// Children not yet finished (parents only).
    pub pending_children: u32,
    /// Children that failed with failParentOnFailure (parents only).
    #[serde(default)]
    pub failed_children: u32,
    pub dedup: Option<Dedup>,
    pub scheduler_id: Option<String>,
    /// None = the completing worker's default.
    pub remove_on_complete: Option<Retention>,
    pub remove_on_fail: Option<Retention>,
    pub keep_logs: Option<u64>,
    pub log_seq: u64,
    pub log_count: u64,
    pub dead_letter: Option<String>,
    pub headers: BTreeMap<String, String>,
    /// The counts of its children live in their own key
    /// ([`crate::keys::QueueKeys::child_counts`]), which `Tx::load_job` reads
    /// into `pending_children` and `failed_children` and `Tx::save_job`
    /// writes, so that a child's add or end updates eight bytes instead of
    /// rewriting its parent's record. A record written before (false) keeps
    /// its counts in those fields until its next child moves them out.
    #[serde(default)]
    pub children_counted: bool,
    /// The idempotency key of the last keyed completion that ended a lease of
    /// it, kept through later leases: that completion, sent again, is
    /// recognized by it (see `complete::complete`).
    #[serde(default)]
    pub ended_by: Option<String>,
    /// `data` lives under a key of its own ([`crate::keys::QueueKeys::job_data`]),
    /// which `Tx::load_job` reads into `data`, and the record holds none: a
    /// lease and a completion rewrite the record, and with the data in it
    /// they rewrote (logged, wrote and checksummed) a large payload twice a
    /// job for nothing. Set for data of [`DATA_APART_BYTES`] or more, when it
    /// is stored; a record of an older build (false) holds its data.
    #[serde(default)]
    pub data_apart: bool,
    /// The `completed` event that reads its return value from this record
    /// (see [`super::EventPlacement::LentValue`]): a large value of a job that is
    /// kept is written once, here. A record that goes, or forgets its value
    /// (a retry), gives the value to that event first, if the event is still
    /// in the log (`Tx::give_back_lent_value`).
    #[serde(default)]
    pub return_value_event: Option<u64>,
    /// `data` was set since the record was read, and `Tx::save_job` stores
    /// it (see [`JobRecord::set_data`]). Not stored.
    #[serde(skip)]
    pub data_changed: bool,
}

/// The size from which a job's data is kept apart from its record (see
/// [`JobRecord::data_apart`]). Below it a key of its own costs more than the
/// rewrites it saves: one more write an add, read a load and delete a purge.
pub const DATA_APART_BYTES: usize = 4 << 10;

impl JobRecord {
    /// The record's encoding, in a buffer of its size at once: grown by
    /// doubling from a small one, the record of a 64 MiB job ended in a
    /// 128 MiB buffer, and copied its payload on the way.
    pub fn encode(&self) -> Vec<u8> {
        // Each text's bytes, and a few more for its length and for what is
        // not text (numbers take at most 9 bytes each).
        const EACH: usize = 9;
        let text = |t: &str| t.len() + EACH;
        let some = |t: &Option<String>| t.as_deref().map_or(EACH, text);
        let texts = [&self.id, &self.name, &self.opts].map(|t| text(t)).iter().sum::<usize>()
            + [
                &self.processed_by,
                &self.progress,
                &self.failed_reason,
                &self.deferred_failure,
                &self.scheduler_id,
                &self.dead_letter,
                &self.ended_by,
            ]
            .map(some)
            .iter()
            .sum::<usize>();
        let payloads = self.data.len() + self.return_value.as_ref().map_or(0, Vec::len);
        let lists = self.stacktrace.iter().map(|t| text(t)).sum::<usize>()
            + self.headers.iter().map(|(k, v)| text(k) + text(v)).sum::<usize>();
        let links = self.lock.as_ref().map_or(0, |l| text(&l.token) + l.taken_by.as_deref().map_or(0, text))
            + self.parent.as_ref().map_or(0, |p| text(&p.queue) + text(&p.id) + text(&p.prefix))
            + self.dedup.as_ref().map_or(0, |d| text(&d.id));
        // The numbers and flags: about forty fields.
        encode_with_capacity(self, payloads + texts + lists + links + 40 * EACH)
    }

    /// Sets the job's data, stored by the next `Tx::save_job`.
    pub fn set_data(&mut self, data: Vec<u8>) {
        self.data = data;
        self.data_changed = true;
    }

    pub fn is_prioritized(&self) -> bool {
        self.priority > 0
    }

    /// Whether the job goes to the front of its line when it is queued.
    pub fn queues_lifo(&self) -> bool {
        self.lifo && !self.is_prioritized()
    }
}
