//! The key layout, the same on every engine (docs/design.md has the table).
//!
//! Keys are tuples: a tag byte, then components. A string component is its
//! bytes with 0x00 escaped as 0x00 0xFF and closed by 0x00 0x01, so tuple order
//! is byte order and no string is a prefix of another's encoding. Integers are
//! big-endian, so they sort numerically.

use crate::kv::{Key, KeyRange};
use crate::model::MetricsKind;

/// Events per key of a queue's event log. A queue writes several events per
/// job; one page per batch of them keeps the log to a few B-tree writes per
/// commit, where a key per event cost an insert and (once trimming) a delete
/// per event.
pub const EVENTS_PER_PAGE: u64 = 64;

/// Every queue's keys start with `Q ns queue`.
const QUEUE: u8 = b'Q';
/// `R ns queue` registers a queue, so sweeps and listings can find it.
const REGISTRY: u8 = b'R';
/// `G`: how many times the store has been opened (see `Tx::generation`).
const GENERATION: u8 = b'G';
/// `V ns key`: a result-store entry, per namespace.
const RESULT_ENTRY: u8 = b'V';
/// `X expires-at ns key`: result-store entries by expiry, for the purge.
const RESULT_EXPIRY: u8 = b'X';
/// `K expires-at record-key`: idempotency records by expiry, for the purge.
const IDEMPOTENCY_EXPIRY: u8 = b'K';
/// `E ns queue`: what an obliterated queue leaves for its next life (its
/// epoch floor and its last event, `model::QueueRemains`), kept until the
/// queue is written again.
const QUEUE_REMAINS: u8 = b'E';

// Per-queue sub-tags.
const JOB: u8 = b'j';
const WAITING: u8 = b'w';
const DELAYED: u8 = b'd';
const ACTIVE: u8 = b'a';
const WAITING_CHILDREN: u8 = b'p';
const COMPLETED: u8 = b'c';
const FAILED: u8 = b'f';
const EVENT: u8 = b'e';
/// The fields of an event too large for its page (see `Tx::event`).
const EVENT_BODY: u8 = b'b';
const META: u8 = b'm';
const STATS: u8 = b's';
const LOG: u8 = b'l';
const DEPENDENCY: u8 = b'D';
const CHILD_COUNTS: u8 = b'n';
const JOB_DATA: u8 = b'P';
const DEDUP: u8 = b'x';
const IDEMPOTENCY: u8 = b'k';
const SCHEDULER: u8 = b'S';
const SCHEDULER_NEXT: u8 = b'T';
const METRICS: u8 = b'M';
const LIMITER: u8 = b'r';
const CONFIG: u8 = b'C';

fn push_str(out: &mut Vec<u8>, s: &str) {
    // Copied a run at a time: keys are built on every access, and names
    // almost never hold a 0x00.
    out.reserve(s.len() + 2);
    let mut rest = s.as_bytes();
    while let Some(at) = rest.iter().position(|&b| b == 0) {
        out.extend_from_slice(&rest[..=at]);
        out.push(0xFF);
        rest = &rest[at + 1..];
    }
    out.extend_from_slice(rest);
    out.extend_from_slice(&[0, 1]);
}

/// Reads a string component at the start of `bytes`; returns it and the rest.
pub fn read_str(bytes: &[u8]) -> Option<(String, &[u8])> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match (bytes[i], bytes.get(i + 1)) {
            (0, Some(0xFF)) => {
                out.push(0);
                i += 2;
            }
            (0, Some(1)) => return Some((String::from_utf8(out).ok()?, &bytes[i + 2..])),
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    None
}

pub fn read_u64(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let head: [u8; 8] = bytes.get(..8)?.try_into().ok()?;
    Some((u64::from_be_bytes(head), &bytes[8..]))
}

/// The smallest key greater than every key that starts with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Key {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xFF {
            end.push(last + 1);
            return end;
        }
    }
    vec![0xFF; prefix.len() + 1]
}

pub fn prefix_range(prefix: Key) -> KeyRange {
    let end = prefix_end(&prefix);
    KeyRange::new(prefix, end)
}

/// A queue's identity: namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueId {
    pub ns: String,
    pub name: String,
}

impl QueueId {
    pub fn new(ns: impl Into<String>, name: impl Into<String>) -> Self {
        Self { ns: ns.into(), name: name.into() }
    }
}

impl std::fmt::Display for QueueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.ns, self.name)
    }
}

pub fn generation() -> Key {
    vec![GENERATION]
}

pub fn queue_remains(q: &QueueId) -> Key {
    let mut k = vec![QUEUE_REMAINS];
    push_str(&mut k, &q.ns);
    push_str(&mut k, &q.name);
    k
}

pub fn registry_prefix() -> Key {
    vec![REGISTRY]
}

/// The registry's keys of namespace `ns`'s queues.
pub fn registry_of(ns: &str) -> Key {
    let mut k = vec![REGISTRY];
    push_str(&mut k, ns);
    k
}

pub fn registry(q: &QueueId) -> Key {
    let mut k = registry_of(&q.ns);
    push_str(&mut k, &q.name);
    k
}

pub fn parse_registry(key: &[u8]) -> Option<QueueId> {
    let rest = key.strip_prefix(&[REGISTRY])?;
    let (ns, rest) = read_str(rest)?;
    let (name, _) = read_str(rest)?;
    Some(QueueId { ns, name })
}

/// Builds the keys of one queue.
#[derive(Clone, Debug)]
pub struct QueueKeys {
    prefix: Key,
}

impl QueueKeys {
    pub fn new(q: &QueueId) -> Self {
        let mut prefix = Vec::with_capacity(q.ns.len() + q.name.len() + 5);
        prefix.push(QUEUE);
        push_str(&mut prefix, &q.ns);
        push_str(&mut prefix, &q.name);
        Self { prefix }
    }

    fn with(&self, tag: u8) -> Key {
        let mut k = Vec::with_capacity(self.prefix.len() + 24);
        k.extend_from_slice(&self.prefix);
        k.push(tag);
        k
    }

    fn tagged_str(&self, tag: u8, s: &str) -> Key {
        let mut k = self.with(tag);
        push_str(&mut k, s);
        k
    }

    fn tagged_u64s(&self, tag: u8, a: u64, b: u64) -> Key {
        let mut k = self.with(tag);
        k.extend_from_slice(&a.to_be_bytes());
        k.extend_from_slice(&b.to_be_bytes());
        k
    }

    fn range(&self, tag: u8) -> KeyRange {
        prefix_range(self.with(tag))
    }

    /// Everything the queue owns.
    pub fn all(&self) -> KeyRange {
        prefix_range(self.prefix.clone())
    }

    /// The part of `key` after the queue prefix and the tag byte.
    pub fn suffix<'k>(&self, key: &'k [u8]) -> &'k [u8] {
        key.get(self.prefix.len() + 1..).unwrap_or(&[])
    }

    pub fn job(&self, id: &str) -> Key {
        self.tagged_str(JOB, id)
    }
    pub fn jobs(&self) -> KeyRange {
        self.range(JOB)
    }

    /// Waiting index: priority 0 (no priority) sorts before every prioritized
    /// job, lower priorities first, then by sequence.
    pub fn waiting(&self, priority: u32, seq: u64) -> Key {
        self.tagged_u64s(WAITING, u64::from(priority), seq)
    }
    pub fn waiting_all(&self) -> KeyRange {
        self.range(WAITING)
    }
    pub fn waiting_band(&self, prioritized: bool) -> KeyRange {
        let all = self.waiting_all();
        let split = self.tagged_u64s(WAITING, 1, 0);
        if prioritized { KeyRange::new(split, all.end) } else { KeyRange::new(all.start, split) }
    }
    pub fn waiting_priority(&self, priority: u32) -> KeyRange {
        KeyRange::new(
            self.tagged_u64s(WAITING, u64::from(priority), 0),
            self.tagged_u64s(WAITING, u64::from(priority) + 1, 0),
        )
    }

    pub fn delayed(&self, due: u64, seq: u64) -> Key {
        self.tagged_u64s(DELAYED, due, seq)
    }
    pub fn delayed_all(&self) -> KeyRange {
        self.range(DELAYED)
    }
    /// Delayed jobs due at or before `now`.
    pub fn delayed_due(&self, now: u64) -> KeyRange {
        KeyRange::new(self.with(DELAYED), self.tagged_u64s(DELAYED, now.saturating_add(1), 0))
    }
    /// Delayed jobs not due yet at `now`.
    pub fn delayed_later(&self, now: u64) -> KeyRange {
        KeyRange::new(self.tagged_u64s(DELAYED, now.saturating_add(1), 0), self.range(DELAYED).end)
    }

    /// Active index, by lease deadline, so the stalled sweep reads expired leases first.
    pub fn active(&self, deadline: u64, seq: u64) -> Key {
        self.tagged_u64s(ACTIVE, deadline, seq)
    }
    pub fn active_all(&self) -> KeyRange {
        self.range(ACTIVE)
    }
    pub fn active_expired(&self, now: u64) -> KeyRange {
        KeyRange::new(self.with(ACTIVE), self.tagged_u64s(ACTIVE, now, 0))
    }

    pub fn waiting_children(&self, ts: u64, seq: u64) -> Key {
        self.tagged_u64s(WAITING_CHILDREN, ts, seq)
    }
    pub fn waiting_children_all(&self) -> KeyRange {
        self.range(WAITING_CHILDREN)
    }

    pub fn completed(&self, finished_on: u64, seq: u64) -> Key {
        self.tagged_u64s(COMPLETED, finished_on, seq)
    }
    pub fn completed_all(&self) -> KeyRange {
        self.range(COMPLETED)
    }
    pub fn failed(&self, finished_on: u64, seq: u64) -> Key {
        self.tagged_u64s(FAILED, finished_on, seq)
    }
    pub fn failed_all(&self) -> KeyRange {
        self.range(FAILED)
    }

    /// The page of the event log that holds event `seq` (see [`EVENTS_PER_PAGE`]).
    pub fn event_page(&self, seq: u64) -> Key {
        let mut k = self.with(EVENT);
        k.extend_from_slice(&(seq / EVENTS_PER_PAGE).to_be_bytes());
        k
    }
    pub fn events(&self) -> KeyRange {
        self.range(EVENT)
    }
    /// Where event `seq` keeps its fields when they are too large for its page.
    pub fn event_body(&self, seq: u64) -> Key {
        let mut k = self.with(EVENT_BODY);
        k.extend_from_slice(&seq.to_be_bytes());
        k
    }
    /// The bodies of the events `from..to`.
    pub fn event_bodies(&self, from: u64, to: u64) -> KeyRange {
        KeyRange::new(self.event_body(from), self.event_body(to))
    }
    /// The pages that may hold events with a sequence number above `after`.
    pub fn event_pages_after(&self, after: u64) -> KeyRange {
        KeyRange::new(self.event_page(after.saturating_add(1)), self.range(EVENT).end)
    }

    pub fn meta(&self, field: &str) -> Key {
        self.tagged_str(META, field)
    }
    pub fn meta_all(&self) -> KeyRange {
        self.range(META)
    }

    pub fn stats(&self) -> Key {
        self.with(STATS)
    }

    pub fn log(&self, job: &str, index: u64) -> Key {
        let mut k = self.tagged_str(LOG, job);
        k.extend_from_slice(&index.to_be_bytes());
        k
    }
    pub fn logs(&self, job: &str) -> KeyRange {
        prefix_range(self.tagged_str(LOG, job))
    }

    /// A parent's dependency on one child, keyed by the child's node key.
    pub fn dependency(&self, parent: &str, child_key: &str) -> Key {
        let mut k = self.tagged_str(DEPENDENCY, parent);
        push_str(&mut k, child_key);
        k
    }
    pub fn dependencies(&self, parent: &str) -> KeyRange {
        prefix_range(self.tagged_str(DEPENDENCY, parent))
    }
    /// How many of a parent's children are pending and have failed it.
    pub fn child_counts(&self, parent: &str) -> Key {
        self.tagged_str(CHILD_COUNTS, parent)
    }
    /// A job's data, when it is kept apart from its record (see
    /// [`crate::model::JobRecord::data_apart`]).
    pub fn job_data(&self, id: &str) -> Key {
        self.tagged_str(JOB_DATA, id)
    }

    pub fn dedup(&self, id: &str) -> Key {
        self.tagged_str(DEDUP, id)
    }
    pub fn idempotency(&self, key: &str) -> Key {
        self.tagged_str(IDEMPOTENCY, key)
    }

    pub fn scheduler(&self, id: &str) -> Key {
        self.tagged_str(SCHEDULER, id)
    }
    pub fn schedulers(&self) -> KeyRange {
        self.range(SCHEDULER)
    }
    pub fn scheduler_next(&self, next: u64, id: &str) -> Key {
        let mut k = self.with(SCHEDULER_NEXT);
        k.extend_from_slice(&next.to_be_bytes());
        push_str(&mut k, id);
        k
    }
    pub fn scheduler_nexts(&self) -> KeyRange {
        self.range(SCHEDULER_NEXT)
    }

    pub fn metrics(&self, kind: MetricsKind) -> Key {
        self.tagged_str(METRICS, kind.as_str())
    }
    /// The per-minute points of [`Self::metrics`], apart from its counters:
    /// those change with every finished job, the points once a minute.
    pub fn metrics_points(&self, kind: MetricsKind) -> Key {
        let mut k = self.metrics(kind);
        k.push(b'p');
        k
    }
    pub fn limiter(&self) -> Key {
        self.with(LIMITER)
    }

    pub fn config(&self) -> Key {
        self.with(CONFIG)
    }
}

/// A result-store entry of namespace `ns`.
pub fn result_entry(ns: &str, key: &str) -> Key {
    let mut k = vec![RESULT_ENTRY];
    push_str(&mut k, ns);
    push_str(&mut k, key);
    k
}

/// The expiry index entry of a result-store entry.
pub fn result_expiry(expires_at: u64, ns: &str, key: &str) -> Key {
    let mut k = expiry_prefix(RESULT_EXPIRY, expires_at);
    push_str(&mut k, ns);
    push_str(&mut k, key);
    k
}

/// Expiry index entries due at or before `now`.
pub fn result_expiry_due(now: u64) -> KeyRange {
    expiry_due(RESULT_EXPIRY, now)
}

/// The start of an expiry index entry: its tag, then when it expires.
fn expiry_prefix(tag: u8, expires_at: u64) -> Key {
    let mut k = vec![tag];
    k.extend_from_slice(&expires_at.to_be_bytes());
    k
}

/// The entries of expiry index `tag` due at or before `now`.
fn expiry_due(tag: u8, now: u64) -> KeyRange {
    KeyRange::new(vec![tag], expiry_prefix(tag, now.saturating_add(1)))
}

/// The namespace and key of an expiry index entry.
pub fn parse_result_expiry(key: &[u8]) -> Option<(String, String)> {
    let rest = key.strip_prefix(&[RESULT_EXPIRY])?;
    let (_, rest) = read_u64(rest)?;
    let (ns, rest) = read_str(rest)?;
    let (k, _) = read_str(rest)?;
    Some((ns, k))
}

/// The expiry index entry of the idempotency record at key `record`.
pub fn idempotency_expiry(expires_at: u64, record: &[u8]) -> Key {
    let mut k = expiry_prefix(IDEMPOTENCY_EXPIRY, expires_at);
    k.extend_from_slice(record);
    k
}

/// Idempotency expiry entries due at or before `now`.
pub fn idempotency_expiry_due(now: u64) -> KeyRange {
    expiry_due(IDEMPOTENCY_EXPIRY, now)
}

/// The record key an idempotency expiry entry points at.
pub fn idempotency_record_of(entry: &[u8]) -> Option<&[u8]> {
    entry.strip_prefix(&[IDEMPOTENCY_EXPIRY])?.get(8..)
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Tuple order equals byte order, and strings round-trip.
        #[test]
        fn string_components_keep_order(a in ".{0,8}", b in ".{0,8}", c in "[\\x00-\\x02a]{0,4}") {
            let q = QueueKeys::new(&QueueId::new("ns", "q"));
            let (ka, kb) = (q.job(&a), q.job(&b));
            proptest::prop_assert_eq!(a.cmp(&b), ka.cmp(&kb));
            let mut k = Vec::new();
            push_str(&mut k, &c);
            let (back, rest) = read_str(&k).unwrap();
            proptest::prop_assert_eq!(back, c);
            proptest::prop_assert!(rest.is_empty());
        }
    }

    #[test]
    fn queues_do_not_overlap() {
        let a = QueueKeys::new(&QueueId::new("ns", "a"));
        let ab = QueueKeys::new(&QueueId::new("ns", "a\0b"));
        assert!(!a.all().contains(&ab.job("x")));
        assert!(!ab.all().contains(&a.job("x")));
    }
}
