//! Reads: state, counts, ranges, logs, children, events, metrics, meta. They
//! run on a snapshot through the same [`Tx`] helpers the writes use.

use std::collections::BTreeMap;

use crate::error::JobsError;
use crate::error::StoreError;
use crate::keys::{self, QueueId, QueueKeys};
use crate::kv::{Key, KeyRange, KvRead, KvTxn, Value};
use crate::model::{
    self, Dependency, DependencyStatus, Event, JobRecord, JobState, MetricsKind, MetricsRecord, RateLimit,
};
use crate::ops::{lease, schedule};
use crate::tx::Tx;

/// A snapshot that refuses writes, so queries can run through [`Tx`].
pub struct ReadOnly(pub Box<dyn KvRead + Send>);

impl KvRead for ReadOnly {
    fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        self.0.get(key)
    }
    fn scan(&mut self, range: &KeyRange, limit: usize, reverse: bool) -> Result<Vec<(Key, Value)>, StoreError> {
        self.0.scan(range, limit, reverse)
    }
}

impl KvTxn for ReadOnly {
    fn put(&mut self, _: &[u8], _: Value) -> Result<(), StoreError> {
        Err(StoreError::ReadOnly)
    }
    fn delete(&mut self, _: &[u8]) -> Result<(), StoreError> {
        Err(StoreError::ReadOnly)
    }
}

/// BullMQ's `getJobCounts` by its type names: a state's name (`wait` too),
/// `repeat` (the job schedulers), and `paused` (a list BullMQ 6 never fills)
/// or an unknown name, which count 0. Delayed jobs count only when due
/// before `delayed_before`.
pub fn counts_by_type(
    tx: &mut Tx,
    q: &QueueId,
    types: &[String],
    delayed_before: Option<u64>,
) -> Result<Vec<u64>, JobsError> {
    let mut out = Vec::with_capacity(types.len());
    for t in types {
        out.push(match (t.as_str(), JobState::parse(t)) {
            ("repeat", _) => schedule::count(tx, q)?,
            (_, Some(state)) => counts(tx, q, &[state], delayed_before)?[0],
            (_, None) => 0,
        });
    }
    Ok(out)
}

pub fn state_range(keys: &QueueKeys, state: JobState) -> KeyRange {
    match state {
        JobState::Waiting => keys.waiting_band(false),
        JobState::Prioritized => keys.waiting_band(true),
        JobState::Delayed => keys.delayed_all(),
        JobState::Active => keys.active_all(),
        JobState::WaitingChildren => keys.waiting_children_all(),
        JobState::Completed => keys.completed_all(),
        JobState::Failed => keys.failed_all(),
    }
}

/// Jobs in each state; delayed jobs only when due before `delayed_before`.
pub fn counts(
    tx: &mut Tx,
    q: &QueueId,
    states: &[JobState],
    delayed_before: Option<u64>,
) -> Result<Vec<u64>, JobsError> {
    let stats = tx.stats(q)?.clone();
    let mut out = Vec::with_capacity(states.len());
    for &state in states {
        let n = match (state, delayed_before) {
            (JobState::Delayed, Some(before)) => {
                let keys = QueueKeys::new(q);
                let range = KeyRange::new(keys.delayed_all().start, keys.delayed(before, 0));
                tx.scan(&range, usize::MAX, false)?.len() as u64
            }
            _ => stats.count(state),
        };
        out.push(n);
    }
    Ok(out)
}

/// Ready jobs per priority (0 = the FIFO band).
pub fn counts_per_priority(tx: &mut Tx, q: &QueueId, priorities: &[u32]) -> Result<Vec<u64>, JobsError> {
    let keys = QueueKeys::new(q);
    priorities.iter().map(|&p| Ok(tx.scan(&keys.waiting_priority(p), usize::MAX, false)?.len() as u64)).collect()
}

/// Ids of one state in index order (the order they run or finished in),
/// positions `start..=end` (`end < 0` counts from the end), ascending or not.
pub fn range(
    tx: &mut Tx,
    q: &QueueId,
    state: JobState,
    start: i64,
    end: i64,
    asc: bool,
) -> Result<Vec<String>, JobsError> {
    let keys = QueueKeys::new(q);
    let total = usize::try_from(tx.stats(q)?.count(state)).unwrap_or(usize::MAX);
    let Some(at) = model::lrange(total, start, end) else { return Ok(Vec::new()) };
    let entries = tx.scan(&state_range(&keys, state), at.end() + 1, !asc)?;
    Ok(entries.into_iter().skip(*at.start()).map(|(_, v)| String::from_utf8_lossy(&v).into_owned()).collect())
}

/// A job's log lines, positions `start..=end`, oldest first when `asc`; and the total.
pub fn logs(
    tx: &mut Tx,
    q: &QueueId,
    id: &str,
    start: i64,
    end: i64,
    asc: bool,
) -> Result<(Vec<String>, u64), JobsError> {
    let Some(job) = tx.load_job(q, id)? else { return Ok((Vec::new(), 0)) };
    let total = usize::try_from(job.log_count).unwrap_or(usize::MAX);
    let Some(at) = model::lrange(total, start, end) else { return Ok((Vec::new(), job.log_count)) };
    let rows = tx.scan(&QueueKeys::new(q).logs(id), at.end() + 1, !asc)?;
    let lines = rows.into_iter().skip(*at.start()).map(|(_, v)| String::from_utf8_lossy(&v).into_owned()).collect();
    Ok((lines, job.log_count))
}

/// A parent's children: node key and record, in key order.
pub fn dependencies(tx: &mut Tx, q: &QueueId, id: &str) -> Result<Vec<(String, Dependency)>, JobsError> {
    let keys = QueueKeys::new(q);
    let prefix_len = keys.dependencies(id).start.len();
    tx.scan(&keys.dependencies(id), usize::MAX, false)?
        .into_iter()
        .map(|(k, v)| {
            let child_key = keys::read_str(k.get(prefix_len..).unwrap_or(&[])).map(|(s, _)| s).unwrap_or_default();
            Ok((child_key, model::decode(&v)?))
        })
        .collect()
}

/// A page of a parent's children: those of `status` (of any status when
/// `None`) in key order, positions `start..=end` of them, and how many there
/// are of that status. As BullMQ's `paginate` script takes a page: an `end`
/// of -1 runs to the last, a lower one makes the page empty, and a negative
/// `start` is 0.
pub fn dependency_page(
    tx: &mut Tx,
    q: &QueueId,
    id: &str,
    status: Option<DependencyStatus>,
    start: i64,
    end: i64,
) -> Result<(Vec<(String, Dependency)>, u64), JobsError> {
    let mut of_status = dependencies(tx, q, id)?;
    of_status.retain(|(_, d)| status.is_none_or(|s| d.status == s));
    let total = of_status.len();
    let first = usize::try_from(start.max(0)).unwrap_or(usize::MAX);
    let past_last = match end {
        -1 => total,
        ..-1 => 0,
        _ => usize::try_from(end).map_or(total, |e| e.saturating_add(1).min(total)),
    };
    let page = of_status.into_iter().take(past_last).skip(first).collect();
    Ok((page, total as u64))
}

/// The child job of each of a parent's `dependencies`, read in the same
/// transaction as they are taken (a caller may stop early): `None` for a
/// child removed since.
pub fn dependency_jobs<'a>(
    tx: &'a mut Tx,
    q: &'a QueueId,
    dependencies: &'a [(String, Dependency)],
) -> impl Iterator<Item = Result<Option<JobRecord>, JobsError>> + 'a {
    dependencies
        .iter()
        .map(move |(_, dep)| get_job(tx, &QueueId::new(q.ns.clone(), dep.child_queue.clone()), &dep.child_id))
}

/// Most bytes of events one read of the log takes; it takes one event at
/// least. Readers ask for up to thousands of events, and with large ones
/// (return values, progress data) a read held gigabytes before anything
/// could bound it: a watch's read-ahead, an events query's answer.
pub const MAX_EVENT_BYTES_PER_READ: usize = 8 << 20;

/// Events with a sequence above `after`, oldest first: at most `limit` of
/// them and about [`MAX_EVENT_BYTES_PER_READ`] of their records.
pub fn events_after(tx: &mut Tx, q: &QueueId, after: u64, limit: usize) -> Result<Vec<Event>, JobsError> {
    // Trimmed events may linger in the oldest page: start past them.
    let after = after.max(tx.stats(q)?.first_event.saturating_sub(1));
    // The pages from the one holding the next event to the one holding the
    // `limit`th (sequences have no gaps): a page of large events is big.
    let (first, last) = (after.saturating_add(1), after.saturating_add(limit as u64));
    let pages = (last / keys::EVENTS_PER_PAGE).saturating_sub(first / keys::EVENTS_PER_PAGE).saturating_add(1);
    let pages = usize::try_from(pages).unwrap_or(usize::MAX);
    let (mut out, mut bytes) = (Vec::new(), 0usize);
    for (_, page) in tx.scan(&QueueKeys::new(q).event_pages_after(after), pages, false)? {
        for record in model::page_records(&page) {
            let record = record?;
            let event: model::PagedEvent = model::decode(record)?;
            if event.seq <= after {
                continue;
            }
            // One event at least, whatever its size.
            let room = if out.is_empty() { usize::MAX } else { MAX_EVENT_BYTES_PER_READ.saturating_sub(bytes) };
            let Some((event, size)) = read_event(tx, q, event, record.len(), room)? else { return Ok(out) };
            bytes = bytes.saturating_add(size);
            out.push(event);
            if out.len() == limit {
                return Ok(out);
            }
        }
    }
    Ok(out)
}

/// An event whole, from its record in its page, and its size: the bytes read
/// for it (see [`model::EventPlacement`]). None when it is larger than `room`:
/// sized before its fields are decoded, an event past a read's bound stays unread.
fn read_event(
    tx: &mut Tx,
    q: &QueueId,
    event: model::PagedEvent,
    in_page: usize,
    room: usize,
) -> Result<Option<(Event, usize)>, JobsError> {
    let lost = |what: &str| JobsError::Internal(format!("event {} of queue {} has lost its {what}", event.seq, q.name));
    let keys = QueueKeys::new(q);
    if event.body {
        let body = tx.get(&keys.event_body(event.seq))?.ok_or_else(|| lost("fields"))?;
        if body.len() > room {
            return Ok(None);
        }
        return Ok(Some((model::decode::<model::PagedEvent>(&body)?.into(), body.len())));
    }
    if !event.lent_value {
        return Ok((in_page <= room).then(|| (event.into(), in_page)));
    }
    // Given back to the event under its own key once the job went or forgot
    // it; until then, the job's record's.
    let value = match tx.get(&keys.event_body(event.seq))? {
        Some(given) => given,
        None => {
            let id = event
                .fields
                .iter()
                .find(|(k, _)| k == model::JOB_ID_FIELD)
                .map(|(_, v)| v.as_str())
                .unwrap_or_default();
            let job = tx.get_record::<JobRecord>(&keys.job(id))?;
            let value = job.filter(|j| j.return_value_event == Some(event.seq)).and_then(|j| j.return_value);
            value.ok_or_else(|| lost("return value"))?
        }
    };
    let size = in_page + value.len();
    if size > room {
        return Ok(None);
    }
    let value = String::from_utf8(value).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
    let mut event: Event = event.into();
    if let Some((_, field)) = event.fields.iter_mut().find(|(k, _)| k == model::RETURN_VALUE_FIELD) {
        *field = value;
    }
    Ok(Some((event, size)))
}

pub fn last_event_seq(tx: &mut Tx, q: &QueueId) -> Result<u64, JobsError> {
    Ok(tx.stats(q)?.last_event)
}

/// Where a QueueEvents' `lastEventId` reads from (`event_cursor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventCursor {
    /// The sequence to read events after.
    pub after: u64,
    /// For a foreign id, its `(ms, seq)`: only events whose own is greater
    /// are its, as Redis's XREAD compares stream ids.
    pub newer_than: Option<(u64, u64)>,
}

impl EventCursor {
    /// Whether `event` is one the id reads.
    pub fn admits(&self, event: &Event) -> bool {
        self.newer_than.is_none_or(|id| (event.ts, event.seq) > id)
    }

    /// The events of `read` the id reads.
    pub fn keep(&self, mut read: Vec<Event>) -> Vec<Event> {
        read.retain(|e| self.admits(e));
        read
    }
}

/// Where a QueueEvents' `lastEventId` reads from: `$` is the newest event;
/// otherwise the events after `id` are those whose `(ms, seq)` is greater, as
/// Redis's XREAD compares stream ids. An id this queue issued (`Event::id`)
/// resumes right after its event; `0-<seq>` (the start a QueueEvents is
/// given, `0-0` included) reads by sequence alone. A foreign id, from Redis or
/// another queue, is placed by its time among the events kept, and the
/// events written later are its only once their id is greater (one from a
/// clock ahead of ours hears nothing until then, as on Redis). Anything else
/// is refused, as Redis refuses an invalid stream id.
pub fn event_cursor(tx: &mut Tx, q: &QueueId, id: &str) -> Result<EventCursor, JobsError> {
    let by_sequence = |after| Ok(EventCursor { after, newer_than: None });
    if id == "$" {
        return by_sequence(last_event_seq(tx, q)?);
    }
    let (ms, seq) =
        Event::parse_id(id).ok_or_else(|| JobsError::invalid(format!("invalid stream id {id:?}: not <ms>-<seq>")))?;
    if ms == 0 {
        return by_sequence(seq);
    }
    if seq > 0 && events_after(tx, q, seq - 1, 1)?.first().is_some_and(|e| e.seq == seq && e.ts == ms) {
        return by_sequence(seq);
    }
    // The events kept are few (trimmed to the queue's maxLen), and only a
    // foreign id's reads come here: once it hears an event, it resumes from
    // that event's id.
    let mut cursor = EventCursor { after: 0, newer_than: Some((ms, seq)) };
    loop {
        let page = events_after(tx, q, cursor.after, EVENT_CURSOR_PAGE)?;
        let Some(last) = page.last() else {
            cursor.after = cursor.after.max(last_event_seq(tx, q)?);
            return Ok(cursor);
        };
        if let Some(newer) = page.iter().find(|e| cursor.admits(e)) {
            cursor.after = newer.seq - 1;
            return Ok(cursor);
        }
        cursor.after = last.seq;
    }
}

/// Events read at a time while placing a foreign id (`event_cursor`).
const EVENT_CURSOR_PAGE: usize = 512;

pub fn metrics(tx: &mut Tx, q: &QueueId, kind: MetricsKind) -> Result<Option<MetricsRecord>, JobsError> {
    let keys = QueueKeys::new(q);
    let Some(mut rec) = tx.get_record::<MetricsRecord>(&keys.metrics(kind))? else { return Ok(None) };
    if let Some(points) = tx.get_record(&keys.metrics_points(kind))? {
        rec.data = points;
    }
    Ok(Some(rec))
}

pub fn meta(tx: &mut Tx, q: &QueueId) -> Result<BTreeMap<String, String>, JobsError> {
    tx.meta_map(q)
}

pub fn dedup_job_id(tx: &mut Tx, q: &QueueId, dedup_id: &str) -> Result<Option<String>, JobsError> {
    let now = tx.ttl_now();
    Ok(tx
        .get_record::<model::DedupRecord>(&QueueKeys::new(q).dedup(dedup_id))?
        .filter(|r| !r.key_removed && r.expires_at.is_none_or(|e| e > now))
        .map(|r| r.job_id))
}

/// Milliseconds the queue stays rate limited for a limit of `max` jobs (the
/// queue's global limit when None): [`lease::rate_limit_ttl`] for a limit
/// given by its count alone.
fn rate_limit_ttl_for_max(tx: &mut Tx, q: &QueueId, max: Option<u64>) -> Result<u64, JobsError> {
    let limit = match max {
        Some(max) => Some(RateLimit { max, duration_ms: 0 }),
        None => lease::limiter(tx, q, None)?,
    };
    lease::rate_limit_ttl(tx, q, limit.as_ref())
}

/// BullMQ's `getRateLimitTtl`: the milliseconds left for a limit of `max`
/// jobs, or, with no limit given and none configured, what is left of a
/// window a manual rate limit opened; -2 when there is no window at all
/// (Redis' PTTL of a missing key).
pub fn rate_limit_ttl_or_missing(tx: &mut Tx, q: &QueueId, max: Option<u64>) -> Result<i64, JobsError> {
    // A window set for longer than i64 can count (`rateLimit(u64::MAX)`)
    // reads as the longest, not as a negative number.
    let signed = |ms: u64| i64::try_from(ms).unwrap_or(i64::MAX);
    if max.is_none() && lease::limiter(tx, q, None)?.is_none() {
        let window = lease::limiter_window(tx, q)?;
        return Ok(if window.window_end == 0 { -2 } else { signed(window.window_end.saturating_sub(tx.ttl_now())) });
    }
    Ok(signed(rate_limit_ttl_for_max(tx, q, max)?))
}

pub fn is_maxed(tx: &mut Tx, q: &QueueId) -> Result<bool, JobsError> {
    let active = tx.stats(q)?.active;
    Ok(tx.meta_u64(q, "concurrency")?.is_some_and(|c| active >= c))
}

pub fn get_job(tx: &mut Tx, q: &QueueId, id: &str) -> Result<Option<JobRecord>, JobsError> {
    tx.load_job(q, id)
}

/// Every queue of a namespace.
pub fn queues(tx: &mut Tx, ns: &str) -> Result<Vec<QueueId>, JobsError> {
    registered(tx, keys::registry_of(ns))
}

/// Every queue of every namespace.
pub fn all_queues(tx: &mut Tx) -> Result<Vec<QueueId>, JobsError> {
    registered(tx, keys::registry_prefix())
}

fn registered(tx: &mut Tx, prefix: crate::kv::Key) -> Result<Vec<QueueId>, JobsError> {
    let range = keys::prefix_range(prefix);
    Ok(tx.scan(&range, usize::MAX, false)?.into_iter().filter_map(|(k, _)| keys::parse_registry(&k)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;

    impl KvRead for Nothing {
        fn get(&mut self, _: &[u8]) -> Result<Option<Value>, StoreError> {
            Ok(None)
        }
        fn scan(&mut self, _: &KeyRange, _: usize, _: bool) -> Result<Vec<(Key, Value)>, StoreError> {
            Ok(Vec::new())
        }
    }

    /// A query that writes is the core's fault: callers get `internal`, which
    /// they do not retry, not the `unavailable` of a storage failure.
    #[test]
    fn a_write_in_a_query_is_an_internal_error() {
        let mut snapshot = ReadOnly(Box::new(Nothing));
        let put = snapshot.put(b"k", Vec::new()).unwrap_err();
        let delete = snapshot.delete(b"k").unwrap_err();
        for e in [put, delete] {
            assert_eq!(e, StoreError::ReadOnly);
            assert_eq!(JobsError::from(e).connect_code(), "internal");
        }
    }
}
