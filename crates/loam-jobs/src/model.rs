//! The records the core stores and the types its callers pass.
//!
//! Records are MessagePack arrays of their fields in declaration order
//! (3.7 times smaller than maps with names, and twice as fast to read, and
//! the job record is read and written several times per job). So fields are
//! only ever appended, each new one with `#[serde(default)]`, so a newer
//! build still reads an older file. Decoding also accepts the map form.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{JobsError, StoreError};

/// BullMQ's largest priority (2^21 - 1).
pub const MAX_PRIORITY: u32 = (1 << 21) - 1;

/// Sequence numbers start here: FIFO jobs count up from it, LIFO jobs count
/// down, so a LIFO job sorts before every FIFO job of its priority.
pub const SEQ_ORIGIN: u64 = 1 << 63;

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    encode_into(&mut out, value);
    out
}

/// Appends `value`'s encoding to `out`.
fn encode_into<T: Serialize>(out: &mut Vec<u8>, value: &T) {
    // Serializing plain structs into a Vec cannot fail.
    let _ = rmp_serde::encode::write(out, value);
}

pub fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, StoreError> {
    rmp_serde::from_slice(bytes).map_err(|e| StoreError::Corrupt(e.to_string()))
}

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

/// A child's behaviour when it fails (BullMQ's four flow policies).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum OnChildFailure {
    /// The parent keeps waiting; the failure is recorded (BullMQ's default).
    #[default]
    Wait,
    /// `failParentOnFailure`: the parent fails too.
    FailParent,
    /// `continueParentOnFailure`: the parent is released to run now.
    ContinueParent,
    /// `ignoreDependencyOnFailure`: the failure counts as done, and is listed as ignored.
    Ignore,
    /// `removeDependencyOnFailure`: the dependency is removed.
    Remove,
}

/// A link from a child to its parent, which may live in another queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParentRef {
    pub queue: String,
    pub id: String,
    /// The prefix of the parent's queue, as BullMQ names it in node keys.
    #[serde(default)]
    pub prefix: String,
}

impl ParentRef {
    /// BullMQ's node key of the parent: `<prefix>:<queue>:<id>`.
    pub fn node_key(&self) -> String {
        node_key(&self.prefix, &self.queue, &self.id)
    }
}

pub fn node_key(prefix: &str, queue: &str, id: &str) -> String {
    match (prefix.is_empty(), queue.is_empty()) {
        (true, _) => format!("{queue}:{id}"),
        // A BullMQ queue key with no `:` names no queue (see the BullMQ
        // backends' `split_qualified`): its job's key is `<key>:<id>`.
        (false, true) => format!("{prefix}:{id}"),
        (false, false) => format!("{prefix}:{queue}:{id}"),
    }
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
    /// The idempotency key of the completion that ended its last lease, until
    /// it is leased again: that completion, sent again, is recognized by it.
    #[serde(default)]
    pub ended_by: Option<String>,
}

impl JobRecord {
    pub fn is_prioritized(&self) -> bool {
        self.priority > 0
    }

    /// Whether the job goes to the front of its line when it is queued.
    pub fn queues_lifo(&self) -> bool {
        self.lifo && !self.is_prioritized()
    }
}

/// Counters kept per queue, so counts and ids cost one read.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct QueueStats {
    /// Last auto-assigned job id.
    pub last_id: u64,
    /// Last FIFO sequence handed out (LIFO uses the same counter downwards).
    pub last_seq: u64,
    pub waiting: u64,
    pub prioritized: u64,
    pub delayed: u64,
    pub active: u64,
    pub waiting_children: u64,
    pub completed: u64,
    pub failed: u64,
    /// Event log bounds: sequence of the newest event and of the oldest kept.
    pub last_event: u64,
    pub first_event: u64,
    /// The highest lease epoch of any job of this queue whose record was
    /// deleted. A job created again under a deleted one's id starts its
    /// epochs above it, so a worker still holding a lease on the old record
    /// is fenced out of the new one's. (Missing in stores written before it:
    /// zero.)
    #[serde(default)]
    pub epoch_floor: u64,
    /// Jobs reclaimed from expired leases, by any sweep (a worker's stalled
    /// check or the core's own), since the queue was made. (Missing in
    /// stores written before it: zero.)
    #[serde(default)]
    pub stalled_total: u64,
}

/// What an obliterated queue leaves for a queue of the same name: a worker
/// may still hold a lease on a job obliterated with `force` (the epoch floor
/// fences it out of a new job under the same id), and a reader's event
/// cursor must not point into the new queue's events (the sequence goes on
/// from the last event, as Redis's stream ids, which are times, go on).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueRemains {
    pub epoch_floor: u64,
    pub last_event: u64,
}

impl QueueRemains {
    pub fn of(stats: &QueueStats) -> Self {
        Self { epoch_floor: stats.epoch_floor, last_event: stats.last_event }
    }

    /// Stores written before the event sequence was kept hold the epoch
    /// floor alone, as a number.
    pub fn decode(bytes: &[u8]) -> Result<Self, StoreError> {
        decode(bytes).or_else(|_| decode(bytes).map(|epoch_floor| Self { epoch_floor, last_event: 0 }))
    }

    /// The counters a queue starts from: none of its jobs, no event kept.
    pub fn stats(&self) -> QueueStats {
        QueueStats { epoch_floor: self.epoch_floor, last_event: self.last_event, ..Default::default() }
    }
}

/// The tag byte of [`QueueStats::encode`]: MessagePack never uses it, so
/// counters written before, as MessagePack, are told apart.
const FIXED_STATS_TAG: u8 = 0xc1;

/// `QueueStats::fields` and `fields_mut` from one list of the counters, in
/// declaration order: the stored form's order. The struct is destructured
/// without `..`, so a counter added to it does not build until it is listed
/// here, and so stored.
macro_rules! stats_fields {
    ($($field:ident),+ $(,)?) => {
        const FIELDS: usize = [$(stringify!($field)),+].len();

        fn fields(&self) -> [u64; Self::FIELDS] {
            let Self { $($field),+ } = *self;
            [$($field),+]
        }

        fn fields_mut(&mut self) -> [&mut u64; Self::FIELDS] {
            let Self { $($field),+ } = self;
            [$($field),+]
        }
    };
}

impl QueueStats {
    stats_fields!(
        last_id,
        last_seq,
        waiting,
        prioritized,
        delayed,
        active,
        waiting_children,
        completed,
        failed,
        last_event,
        first_event,
        epoch_floor,
        stalled_total,
    );

    /// The counters as a tag byte and fixed-width little-endian numbers, in
    /// field order. Every operation on a queue reads and writes them once;
    /// as MessagePack, through serde, that took about 1,450 of the 21,600
    /// instructions of a one-at-a-time add on the executor's thread.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + 8 * Self::FIELDS);
        out.push(FIXED_STATS_TAG);
        for field in self.fields() {
            out.extend_from_slice(&field.to_le_bytes());
        }
        out
    }

    /// Reads [`QueueStats::encode`]'s form, or the MessagePack of stores
    /// written before it. A shorter fixed form (from before a counter was
    /// added) reads the missing counters as zero; a longer one (written by a
    /// later version) keeps the counters this one knows.
    pub fn decode(bytes: &[u8]) -> Result<Self, StoreError> {
        let Some((&FIXED_STATS_TAG, numbers)) = bytes.split_first() else { return decode(bytes) };
        if numbers.len() % 8 != 0 {
            return Err(StoreError::Corrupt(format!("queue counters of {} bytes", bytes.len())));
        }
        let mut stats = Self::default();
        for (field, number) in stats.fields_mut().into_iter().zip(numbers.chunks_exact(8)) {
            let mut le = [0u8; 8];
            le.copy_from_slice(number);
            *field = u64::from_le_bytes(le);
        }
        Ok(stats)
    }

    /// How many of the oldest events are past the newest `max` the log keeps.
    pub fn events_over(&self, max: u64) -> u64 {
        if self.first_event == 0 {
            return 0;
        }
        (self.last_event + 1 - self.first_event).saturating_sub(max)
    }

    pub fn count(&self, state: JobState) -> u64 {
        match state {
            JobState::Waiting => self.waiting,
            JobState::Prioritized => self.prioritized,
            JobState::Delayed => self.delayed,
            JobState::Active => self.active,
            JobState::WaitingChildren => self.waiting_children,
            JobState::Completed => self.completed,
            JobState::Failed => self.failed,
        }
    }

    pub fn count_mut(&mut self, state: JobState) -> &mut u64 {
        match state {
            JobState::Waiting => &mut self.waiting,
            JobState::Prioritized => &mut self.prioritized,
            JobState::Delayed => &mut self.delayed,
            JobState::Active => &mut self.active,
            JobState::WaitingChildren => &mut self.waiting_children,
            JobState::Completed => &mut self.completed,
            JobState::Failed => &mut self.failed,
        }
    }
}

/// One entry of a queue's event log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub seq: u64,
    /// Milliseconds since the epoch when it was written.
    pub ts: u64,
    /// BullMQ's event name (`added`, `completed`, ...).
    pub name: String,
    /// Other fields, in order (BullMQ's `jobId`, `prev`, `returnvalue`, ...).
    pub fields: Vec<(String, String)>,
}

/// An event as it is written: the same encoding as [`Event`], from borrowed
/// fields. In its page, an event whose fields are larger than
/// [`INLINE_EVENT_BYTES`] is this record without them and with `body` set;
/// its fields, the whole record, are kept under their own key
/// (`QueueKeys::event_body`). A page is written whole at each append, so
/// pages of large events (a completed job's return value, a progress report
/// with data) made each event copy up to 64 of them.
#[derive(Serialize)]
pub(crate) struct EventRef<'a> {
    pub seq: u64,
    pub ts: u64,
    pub name: &'a str,
    pub fields: &'a [(&'a str, &'a str)],
    /// Only the last field may be skipped: the record is an array.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub body: bool,
}

/// Most bytes of fields an event keeps in its page (see [`EventRef`]).
pub(crate) const INLINE_EVENT_BYTES: usize = 2048;

/// An event's record as its page holds it (see [`EventRef`]); records
/// written before `body` existed read as inline.
#[derive(Deserialize)]
pub(crate) struct PagedEvent {
    pub seq: u64,
    pub ts: u64,
    pub name: String,
    pub fields: Vec<(String, String)>,
    #[serde(default)]
    pub body: bool,
}

impl From<PagedEvent> for Event {
    fn from(e: PagedEvent) -> Self {
        Event { seq: e.seq, ts: e.ts, name: e.name, fields: e.fields }
    }
}

/// Appends one record to a page of records (a length, then its encoding),
/// encoded in place.
pub(crate) fn append_to_page<T: Serialize>(page: &mut Vec<u8>, record: &T) {
    let at = page.len();
    page.extend_from_slice(&[0; 4]);
    encode_into(page, record);
    let len = (page.len() - at - 4) as u32;
    page[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

/// The records of a page, oldest first; a truncated page is a corrupt record.
pub(crate) fn page_records(page: &[u8]) -> impl Iterator<Item = Result<&[u8], StoreError>> {
    let mut rest = page;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let record = rest
            .get(..4)
            .map(|n| u32::from_be_bytes([n[0], n[1], n[2], n[3]]) as usize)
            .and_then(|len| rest.get(4..4 + len).map(|r| (r, 4 + len)));
        match record {
            Some((r, used)) => {
                rest = &rest[used..];
                Some(Ok(r))
            }
            None => {
                rest = &[];
                Some(Err(StoreError::Corrupt("an event page ends inside a record".into())))
            }
        }
    })
}

impl Event {
    /// The Redis-stream-shaped id BullMQ shows: `<ms>-<seq>`.
    pub fn id(&self) -> String {
        Self::id_of(self.ts, self.seq)
    }

    /// The id of the event written at `ts` with sequence `seq`.
    pub fn id_of(ts: u64, seq: u64) -> String {
        format!("{ts}-{seq}")
    }

    /// A Redis stream id, `<ms>-<seq>` or `<ms>` (sequence 0), as XREAD
    /// reads one; None for anything else.
    pub fn parse_id(id: &str) -> Option<(u64, u64)> {
        let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
        let number = |s: &str| if s.bytes().all(|b| b.is_ascii_digit()) { s.parse().ok() } else { None };
        Some((number(ms)?, number(seq)?))
    }
}

/// How many of a parent's children are pending, and how many failed it
/// (failParentOnFailure): see [`JobRecord::children_counted`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildCounts {
    pub pending: u32,
    pub failed: u32,
}

/// A parent's record of one child.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dependency {
    pub status: DependencyStatus,
    /// Where the child lives.
    #[serde(default)]
    pub child_queue: String,
    #[serde(default)]
    pub child_id: String,
    /// The child's return value (processed) or failure reason (failed, ignored).
    pub value: Option<String>,
}

impl Dependency {
    /// Whether this is the record of child `id` of queue `queue`. A node key
    /// joins queue and id with `:`, which both may hold, so a store written
    /// before such clashes were refused (`enqueue::record_child`) may hold
    /// another child's record under this child's key. Records from before
    /// children's queues and ids were kept name nobody, and are anyone's.
    pub fn is_of(&self, queue: &str, id: &str) -> bool {
        (self.child_queue.is_empty() && self.child_id.is_empty()) || (self.child_queue == queue && self.child_id == id)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DependencyStatus {
    Pending,
    Processed,
    Failed,
    Ignored,
}

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

/// The fixed-window counter behind a queue's rate limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimiterWindow {
    pub count: u64,
    pub window_end: u64,
}

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

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Idempotency {
    pub key: String,
    /// Default 24 hours.
    pub ttl_ms: Option<u64>,
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
    /// Park the job until `until` (BullMQ moveToDelayed).
    Delay {
        until: u64,
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

/// Which jobs a queue's metrics count: BullMQ keeps them for these two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricsKind {
    Completed,
    Failed,
}

impl MetricsKind {
    /// BullMQ's name of it, also its key's.
    pub fn as_str(self) -> &'static str {
        match self {
            MetricsKind::Completed => "completed",
            MetricsKind::Failed => "failed",
        }
    }

    /// None for a name BullMQ keeps no metrics under.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "completed" => Some(MetricsKind::Completed),
            "failed" => Some(MetricsKind::Failed),
            _ => None,
        }
    }
}

/// BullMQ's per-minute counters of completed or failed jobs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricsRecord {
    pub count: u64,
    pub prev_ts: u64,
    pub prev_count: u64,
    /// Jobs per minute, newest first. Stored under a key of its own
    /// ([`crate::keys::QueueKeys::metrics_points`]); stores written before
    /// that keep them here until the next minute's point moves them.
    pub data: std::collections::VecDeque<u64>,
}

impl MetricsRecord {
    /// The points at positions `start..=end` ([`lrange`]), as Redis's
    /// `LRANGE` answers BullMQ's `getMetrics`: 0 is the newest, -1 the oldest.
    pub fn page(&self, start: i64, end: i64) -> Vec<u64> {
        lrange(self.data.len(), start, end).map_or_else(Vec::new, |at| self.data.range(at).copied().collect())
    }
}

/// Which of `len` items positions `start..=end` take, as Redis's `LRANGE`
/// reads them (BullMQ's range getters take theirs so): a negative position
/// counts from the end (-1 is the last), and the range is clipped to the
/// items; `None` when it holds none.
pub(crate) fn lrange(len: usize, start: i64, end: i64) -> Option<std::ops::RangeInclusive<usize>> {
    let len = i64::try_from(len).unwrap_or(i64::MAX);
    let at = |i: i64| if i < 0 { len.saturating_add(i) } else { i };
    let (from, to) = (at(start).max(0), at(end).min(len - 1));
    (from <= to).then_some(from as usize..=to as usize)
}

/// The most per-minute points a queue's metrics keep, whatever a worker
/// asks for: 91 days of minutes, past BullMQ's longest `MetricsTime` (8
/// weeks). An unbounded count let one completion, its clock far ahead, write
/// a point for every minute in between.
pub const MAX_METRICS_POINTS: u64 = 1 << 17;

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

pub(crate) fn validate_name(kind: &str, value: &str, max: usize) -> Result<(), JobsError> {
    if value.is_empty() || value.len() > max {
        return Err(JobsError::invalid(format!("{kind} must be 1 to {max} bytes, got {}", value.len())));
    }
    // Any other bytes are fine: keys escape every byte they need to.
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metrics_page_is_lranges() {
        let rec = MetricsRecord { data: [5, 4, 3, 2, 1].into(), ..Default::default() };
        let all = vec![5, 4, 3, 2, 1];
        assert_eq!(rec.page(0, -1), all);
        assert_eq!(rec.page(1, 2), [4, 3]);
        assert_eq!(rec.page(-2, -1), [2, 1]);
        assert_eq!(rec.page(3, 1), [0u64; 0]);
        assert_eq!(rec.page(10, 20), [0u64; 0]);
        assert_eq!(rec.page(-100, 0), [5]);
        assert_eq!(rec.page(0, 100), all);
        assert_eq!(rec.page(i64::MIN, i64::MAX), all);
        assert_eq!(rec.page(i64::MAX, -1), [0u64; 0]);
        assert_eq!(rec.page(0, i64::MIN), [0u64; 0]);
        assert_eq!(MetricsRecord::default().page(0, -1), [0u64; 0]);
    }

    /// A dependency record names its child; one from before names nobody and is taken as anyone's.
    #[test]
    fn a_dependency_is_its_named_childs_only() {
        let dep = |queue: &str, id: &str| Dependency {
            status: DependencyStatus::Pending,
            child_queue: queue.into(),
            child_id: id.into(),
            value: None,
        };
        assert!(dep("a:b", "c").is_of("a:b", "c"));
        assert!(!dep("a:b", "c").is_of("a", "b:c"));
        assert!(dep("", "").is_of("a", "b:c"));
    }

    /// An event kept in its page is written as before `body` existed, and
    /// records written then read as such.
    #[test]
    fn inline_events_keep_the_encoding_from_before_bodies() {
        #[derive(Serialize)]
        struct Before<'a>(u64, u64, &'a str, &'a [(&'a str, &'a str)]);
        let fields = [("jobId", "7")];
        let now = EventRef { seq: 3, ts: 9, name: "added", fields: &fields, body: false };
        let before = encode(&Before(3, 9, "added", &fields));
        assert_eq!(encode(&now), before);
        let read: PagedEvent = decode(&before).unwrap_or_else(|e| panic!("old record: {e}"));
        assert!(!read.body);
        assert_eq!(Event::from(read).fields, vec![("jobId".to_string(), "7".to_string())]);
        let stub: PagedEvent =
            decode(&encode(&EventRef { fields: &[], body: true, ..now })).unwrap_or_else(|e| panic!("{e}"));
        assert!(stub.body && stub.fields.is_empty());
    }

    /// An idempotency record written before `hash_version` existed reads as
    /// one of version 0, whose add hash covered less of the request.
    #[test]
    fn idempotency_records_from_before_hash_versions_still_read() {
        #[derive(Serialize)]
        struct Before<'a>(u64, &'a str, u64, Option<u64>, Option<u64>);
        let read: IdempotencyRecord = decode(&encode(&Before(5, "7", 9, None, Some(3)))).unwrap();
        let want = IdempotencyRecord {
            request_hash: 5,
            job_id: "7".into(),
            expires_at: 9,
            finished_on: Some(3),
            ..Default::default()
        };
        assert_eq!((read, want.hash_version), (want.clone(), 0));
    }

    /// An idempotency record of any call but a keyed bulk add is written as
    /// before `bulk` existed, so a build from before it (a rollback) still
    /// reads it; records from then read with no bulk answers.
    #[test]
    fn idempotency_records_keep_the_encoding_from_before_bulk_answers() {
        #[derive(Serialize)]
        struct Before<'a>(u64, &'a str, u64, Option<u64>, Option<u64>, u8, bool);
        let now = IdempotencyRecord {
            request_hash: 5,
            job_id: "7".into(),
            expires_at: 9,
            log_count: Some(2),
            hash_version: 1,
            deduplicated: true,
            ..Default::default()
        };
        let before = encode(&Before(5, "7", 9, Some(2), None, 1, true));
        assert_eq!(encode(&now), before);
        assert_eq!(decode::<IdempotencyRecord>(&before).unwrap(), now);
        let bulk = IdempotencyRecord {
            bulk: vec![Some(BulkAdded { job_id: "1".into(), deduplicated: false }), None],
            ..Default::default()
        };
        assert_eq!(decode::<IdempotencyRecord>(&encode(&bulk)).unwrap(), bulk);
    }

    /// A dedup record written before `key_removed` existed reads as a key
    /// that was not removed.
    #[test]
    fn dedup_records_from_before_removed_keys_still_read() {
        #[derive(Serialize)]
        struct Before<'a>(&'a str, Option<u64>, Option<Box<EnqueueRequest>>);
        let kept = Box::new(EnqueueRequest { name: "next".into(), ..Default::default() });
        let old = encode(&Before("7", None, Some(kept.clone())));
        let read: DedupRecord = decode(&old).unwrap_or_else(|e| panic!("old record: {e}"));
        assert_eq!(read, DedupRecord::held_by("7", None, Some(kept)));
        assert_eq!(read.holder(), Some("7"));
    }

    /// Counters written before `epoch_floor` existed (an array one field
    /// shorter) still read, with a floor of zero.
    #[test]
    fn counters_from_before_the_epoch_floor_still_read() {
        #[derive(Serialize)]
        struct Before(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64);
        let old = encode(&Before(7, 8, 1, 2, 3, 4, 5, 6, 9, 10, 11));
        let stats: QueueStats = decode(&old).unwrap_or_else(|e| panic!("old counters: {e}"));
        assert_eq!((stats.last_id, stats.first_event, stats.epoch_floor), (7, 11, 0));
        let now: QueueStats =
            decode(&encode(&QueueStats { epoch_floor: 5, ..stats })).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(now.epoch_floor, 5);
    }

    /// Counters written as MessagePack (every store before the fixed form)
    /// still read; the fixed form reads back what was written, and one
    /// written with fewer counters (an older version's) or more (a later
    /// version's) reads the ones it shares.
    #[test]
    fn counters_read_in_either_form() {
        let stats = QueueStats {
            last_id: 1,
            last_seq: 2,
            waiting: 3,
            prioritized: 4,
            delayed: 5,
            active: 6,
            waiting_children: 7,
            completed: 8,
            failed: 9,
            last_event: 10,
            first_event: 11,
            epoch_floor: 12,
            stalled_total: u64::MAX,
        };
        let read = |bytes: &[u8]| QueueStats::decode(bytes).unwrap_or_else(|e| panic!("{e}")).fields();
        assert_eq!(read(&encode(&stats)), stats.fields(), "MessagePack");
        let fixed = stats.encode();
        assert_eq!(fixed.len(), 1 + 13 * 8);
        assert_eq!(read(&fixed), stats.fields(), "fixed");
        let mut expected = stats.fields();
        expected[12] = 0;
        assert_eq!(read(&fixed[..fixed.len() - 8]), expected, "one counter fewer");
        let mut longer = fixed.clone();
        longer.extend_from_slice(&7u64.to_le_bytes());
        assert_eq!(read(&longer), stats.fields(), "one counter more");
        assert!(QueueStats::decode(&fixed[..fixed.len() - 3]).is_err(), "a torn number is corrupt");
    }

    /// What an obliterated queue left before its last event was kept (its
    /// epoch floor, a number) still reads.
    #[test]
    fn remains_from_before_the_event_sequence_still_read() {
        let old = QueueRemains::decode(&encode(&7u64)).unwrap_or_else(|e| panic!("old remains: {e}"));
        assert_eq!(old, QueueRemains { epoch_floor: 7, last_event: 0 });
        let now = QueueRemains { epoch_floor: 7, last_event: 9 };
        assert_eq!(QueueRemains::decode(&encode(&now)).unwrap_or_else(|e| panic!("{e}")), now);
    }
}
