//! A queue's own records: its counters, what an obliterated queue leaves, its rate limiter's window, its
//! metrics.

use serde::{Deserialize, Serialize};

use super::job::JobState;
use super::{decode, lrange};
use crate::error::StoreError;

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

        pub(super) fn fields(&self) -> [u64; Self::FIELDS] {
            let Self { $($field),+ } = *self;
            [$($field),+]
        }

        pub(super) fn fields_mut(&mut self) -> [&mut u64; Self::FIELDS] {
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

/// The fixed-window counter behind a queue's rate limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimiterWindow {
    pub count: u64,
    pub window_end: u64,
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

/// The most per-minute points a queue's metrics keep, whatever a worker
/// asks for: 91 days of minutes, past BullMQ's longest `MetricsTime` (8
/// weeks). An unbounded count let one completion, its clock far ahead, write
/// a point for every minute in between.
pub const MAX_METRICS_POINTS: u64 = 1 << 17;
