//! Job schedulers (BullMQ's `upsertJobScheduler`).
//!
//! A scheduler keeps one pending iteration job, `repeat:<id>:<millis>`; the
//! tick time is in the job id, so a tick is enqueued once however often it is
//! processed. (One exception, in [`upsert`]: a cron tick whose id a job that
//! ran early still holds gets `repeat:<id>:<millis>:<n>`.) Cron times are
//! computed by the caller (BullMQ computes them in JavaScript); `every` times
//! are computed here.

use serde_json::{Map, Value as Json};

use crate::error::{JobsError, Precondition};
use crate::keys::{QueueId, QueueKeys};
use crate::model::{EnqueueRequest, JobState, SERVER_EXTRA_PREFIX, SchedulerRecord};
use crate::ops::admin;
use crate::ops::enqueue::{self, Placement};
use crate::tx::Tx;

/// Slots an `every` scheduler tries past a taken one before giving up.
const MAX_SLOT_ADVANCE: u64 = 32;

/// A scheduler as the caller describes it.
#[derive(Clone, Debug, Default)]
pub struct SchedulerSpec {
    pub id: String,
    pub name: String,
    pub pattern: Option<String>,
    pub every_ms: Option<u64>,
    pub offset_ms: Option<u64>,
    pub tz: Option<String>,
    pub start_date: Option<u64>,
    pub end_date: Option<u64>,
    pub limit: Option<u64>,
    /// Next run, required for cron patterns.
    pub next_millis: Option<u64>,
    pub template_data: String,
    pub template_opts: String,
    /// Options of each iteration job (priority, attempts, retention, ...).
    pub job: EnqueueRequest,
    /// An `every` scheduler given a start date still ahead starts over at
    /// it, as a new one would. BullMQ keeps a replaced `every` scheduler's
    /// phase and ignores a new start date; a server schedule
    /// (`Schedule{server}`) honours it.
    pub start_resets: bool,
    /// The pending iteration's `repeat.count` (BullMQ counts iterations in
    /// JavaScript, from 1 at each upsert unless the options give a start).
    /// None keeps the stored count: a server schedule's `limit` counts its
    /// ticks across upserts.
    pub count: Option<u64>,
}

pub fn iteration_id(scheduler: &str, millis: u64) -> String {
    format!("repeat:{scheduler}:{millis}")
}

/// The id of a scheduler's pending iteration: its tick's id, or the one
/// [`upsert`] gave it when a job that started early held that.
pub fn pending_iteration_id(rec: &SchedulerRecord) -> String {
    rec.next_job_id.clone().unwrap_or_else(|| iteration_id(&rec.id, rec.next_millis))
}

/// An id for a tick whose own id `taken` is held: `taken:1`, `taken:2`, ...
/// the first free one.
fn free_variant(tx: &mut Tx, q: &QueueId, taken: &str, scheduler: &str) -> Result<String, JobsError> {
    for k in 1..=MAX_SLOT_ADVANCE {
        let candidate = format!("{taken}:{k}");
        if tx.load_job(q, &candidate)?.is_none() {
            return Ok(candidate);
        }
    }
    Err(JobsError::Precondition(Precondition::SchedulerSlotsBusy { scheduler: scheduler.to_string() }))
}

/// BullMQ's rule for the next `every` tick. Past the largest time it stays
/// at the largest (never due), where wrapping put it in 1970, due at once.
fn every_next(now: u64, every: u64, offset: u64, prev: Option<u64>, start: Option<u64>) -> u64 {
    let aligned = || {
        let t = (now / every * every).saturating_add(offset);
        if t <= now { t.saturating_add(every) } else { t }
    };
    match prev {
        None if start.is_some() => start.unwrap_or(now).max(now),
        None if offset > 0 => aligned(),
        None => now,
        Some(p) if p.saturating_add(every) < now => aligned(),
        Some(p) => p.saturating_add(every),
    }
}

fn save(tx: &mut Tx, q: &QueueId, old_next: Option<u64>, rec: &SchedulerRecord) -> Result<(), JobsError> {
    let keys = QueueKeys::new(q);
    if let Some(old) = old_next {
        tx.delete(&keys.scheduler_next(old, &rec.id))?;
    }
    tx.put(&keys.scheduler_next(rec.next_millis, &rec.id), Vec::new())?;
    tx.put_record(&keys.scheduler(&rec.id), rec)
}

/// The options document of an iteration job: the template plus BullMQ's
/// repeat bookkeeping.
fn iteration_opts(rec: &SchedulerRecord, job_id: &str, delay: u64, now: u64) -> String {
    let mut opts: Map<String, Json> = serde_json::from_str(&rec.template_opts).unwrap_or_default();
    let mut repeat = Map::new();
    if let Some(p) = &rec.pattern {
        repeat.insert("pattern".into(), Json::from(p.clone()));
    }
    if let Some(e) = rec.every_ms {
        repeat.insert("every".into(), Json::from(e));
    }
    if let Some(l) = rec.limit {
        repeat.insert("limit".into(), Json::from(l));
    }
    if let Some(tz) = &rec.tz {
        repeat.insert("tz".into(), Json::from(tz.clone()));
    }
    if let Some(s) = rec.start_date {
        repeat.insert("startDate".into(), Json::from(s));
    }
    if let Some(e) = rec.end_date {
        repeat.insert("endDate".into(), Json::from(e));
    }
    repeat.insert("offset".into(), Json::from(rec.offset_ms.unwrap_or(0)));
    repeat.insert("count".into(), Json::from(rec.repeat_count()));
    opts.insert("jobId".into(), Json::from(job_id));
    opts.insert("delay".into(), Json::from(delay));
    opts.insert("timestamp".into(), Json::from(now));
    opts.insert("prevMillis".into(), Json::from(rec.next_millis));
    opts.insert("repeatJobKey".into(), Json::from(rec.id.clone()));
    opts.insert("repeat".into(), Json::Object(repeat));
    Json::Object(opts).to_string()
}

fn add_iteration(
    tx: &mut Tx,
    q: &QueueId,
    rec: &SchedulerRecord,
    template: &EnqueueRequest,
) -> Result<(String, u64), JobsError> {
    let job_id = pending_iteration_id(rec);
    let delay = rec.next_millis.saturating_sub(tx.now);
    let req = EnqueueRequest {
        name: rec.name.clone(),
        data: if rec.template_data.is_empty() { b"{}".to_vec() } else { rec.template_data.clone().into_bytes() },
        opts: iteration_opts(rec, &job_id, delay, tx.now),
        job_id: Some(job_id.clone()),
        delay_ms: delay,
        timestamp: Some(tx.now),
        scheduler_id: Some(rec.id.clone()),
        // Each iteration is keyed by its tick: a template's own key would
        // refuse every iteration after the first.
        idempotency: None,
        dedup: None,
        parent: None,
        ..template.clone()
    };
    enqueue::enqueue(tx, q, req, Placement::Normal)?;
    Ok((job_id, delay))
}

fn finished_scheduling(rec: &SchedulerRecord) -> bool {
    rec.limit.is_some_and(|l| rec.repeat_count() > l) || rec.end_date.is_some_and(|e| rec.next_millis > e)
}

/// Creates or replaces a scheduler and enqueues its next iteration. Returns
/// the iteration's job id and delay.
pub fn upsert(tx: &mut Tx, q: &QueueId, spec: SchedulerSpec) -> Result<Option<(String, u64)>, JobsError> {
    crate::model::validate_name("job scheduler id", &spec.id, enqueue::MAX_NAME_BYTES)?;
    if spec.pattern.is_some() == spec.every_ms.is_some() {
        return Err(JobsError::invalid("a job scheduler needs exactly one of pattern and every"));
    }
    if spec.every_ms == Some(0) {
        return Err(JobsError::invalid("every must be at least 1 ms"));
    }
    let keys = QueueKeys::new(q);
    let old: Option<SchedulerRecord> = tx.get_record(&keys.scheduler(&spec.id))?;
    let mut prev = old.as_ref().map(|r| r.next_millis);
    if let (Some(o), Some(every)) = (&old, spec.every_ms)
        && (o.every_ms != Some(every) || spec.start_resets && spec.start_date.is_some_and(|s| s > tx.now))
    {
        prev = None;
    }
    let offset = spec.offset_ms.unwrap_or(0);
    let mut next = match (spec.every_ms, spec.next_millis) {
        (Some(every), _) => every_next(tx.now, every, offset, prev, spec.start_date),
        (None, Some(n)) => n,
        (None, None) => return Err(JobsError::invalid("a cron scheduler needs its next run time")),
    };
    // The previous iteration gives way if it has not started. As in BullMQ,
    // a waiting one of a paused queue is not found where Redis looks for it
    // (its legacy paused list), so it stays and a new iteration is added.
    let paused = tx.is_paused(q)?;
    let mut removed_prev = false;
    if let Some(o) = &old
        && let Some(pid) = &o.next_job_id
        && let Some(pjob) = tx.load_job(q, pid)?
        && match pjob.state {
            JobState::Delayed | JobState::Prioritized => true,
            JobState::Waiting => !paused,
            _ => false,
        }
    {
        admin::drop_replaced_iteration(tx, q, &pjob)?;
        removed_prev = true;
        if spec.every_ms.is_some() && o.every_ms == spec.every_ms && prev.is_some() {
            next = o.next_millis;
        }
    }
    let mut job_id = iteration_id(&spec.id, next);
    if tx.load_job(q, &job_id)?.is_some() {
        match spec.every_ms {
            Some(every) => {
                let mut tries = 0;
                while tx.load_job(q, &job_id)?.is_some() {
                    tries += 1;
                    if tries > MAX_SLOT_ADVANCE {
                        return Err(JobsError::Precondition(Precondition::SchedulerSlotsBusy { scheduler: spec.id }));
                    }
                    next = next.saturating_add(every);
                    job_id = iteration_id(&spec.id, next);
                }
            }
            None if !removed_prev => {
                return Err(JobsError::Precondition(Precondition::SchedulerIdCollision { scheduler: spec.id }));
            }
            // The tick's id is held by a job that ran early (a promoted
            // iteration, still active or finished) and the replaced
            // iteration is gone, so the scheduler must have a new one.
            // Redis writes it over the job that holds the id, leaving one
            // id in two states; this iteration gets an id of its own.
            None => job_id = free_variant(tx, q, &job_id, &spec.id)?,
        }
    }
    // An `every` scheduler keeps the phase it was given or first found; a
    // replaced iteration keeps the stored one (BullMQ's offset rule).
    let offset = match spec.every_ms {
        Some(_) if removed_prev => spec.offset_ms.or(old.as_ref().and_then(|o| o.offset_ms)).unwrap_or(0),
        Some(every) if offset == 0 => next - (next / every) * every,
        _ => offset,
    };
    // A caller's scheduler replaces a server schedule of the same id: the
    // server's marks go (`Schedule{server}` sets its own after this).
    let mut extra = old.as_ref().map(|o| o.extra.clone()).unwrap_or_default();
    extra.retain(|k, _| !k.starts_with(SERVER_EXTRA_PREFIX));
    let rec = SchedulerRecord {
        id: spec.id.clone(),
        name: spec.name.clone(),
        pattern: spec.pattern.clone(),
        every_ms: spec.every_ms,
        offset_ms: Some(offset),
        tz: spec.tz.clone(),
        start_date: spec.start_date,
        end_date: spec.end_date,
        limit: spec.limit,
        iteration_count: old.as_ref().map_or(1, |o| o.iteration_count),
        next_millis: next,
        template_data: spec.template_data.clone(),
        template_opts: spec.template_opts.clone(),
        next_job_id: Some(job_id),
        extra,
        repeat_count: Some(spec.count.unwrap_or_else(|| old.as_ref().map_or(1, SchedulerRecord::repeat_count))),
    };
    save(tx, q, old.as_ref().map(|o| o.next_millis), &rec)?;
    if finished_scheduling(&rec) {
        return Ok(None);
    }
    add_iteration(tx, q, &rec, &spec.job).map(Some)
}

/// After iteration `producer_id` started: enqueue the next one. Returns its
/// job id, or None when the scheduler is gone or the server's, the producer
/// is not the current iteration, or the slot is taken.
pub fn advance(
    tx: &mut Tx,
    q: &QueueId,
    id: &str,
    next_millis: Option<u64>,
    producer_id: &str,
    template: &EnqueueRequest,
) -> Result<Option<String>, JobsError> {
    let keys = QueueKeys::new(q);
    let Some(rec) = tx.get_record::<SchedulerRecord>(&keys.scheduler(id))? else { return Ok(None) };
    // The server alone moves its own schedules ([`advance_to`]).
    if rec.server_owned() || producer_id != pending_iteration_id(&rec) {
        return Ok(None);
    }
    let prev = rec.next_millis;
    let next = match (rec.every_ms, next_millis) {
        (Some(every), _) => every_next(tx.now, every, rec.offset_ms.unwrap_or(0), Some(prev), rec.start_date),
        (None, Some(n)) => n,
        (None, None) => return Err(JobsError::invalid("a cron scheduler needs its next run time")),
    };
    move_to_tick(tx, q, rec, next, template, WhenTaken::Stay)
}

/// What moving a scheduler to a tick whose id a job holds already does
/// (besides a `duplicated` event).
#[derive(Clone, Copy, PartialEq, Eq)]
enum WhenTaken {
    /// BullMQ's rule: the scheduler stays where it is.
    Stay,
    /// A server schedule's: that job is the tick's, and the scheduler moves
    /// past it (staying, its ticker would find the same tick due for ever).
    MovePast,
}

/// Moves a scheduler on to tick `next` and enqueues that tick's iteration,
/// unless a job holds its id already (see [`WhenTaken`]) or the scheduler is
/// past its limit or end date.
fn move_to_tick(
    tx: &mut Tx,
    q: &QueueId,
    mut rec: SchedulerRecord,
    next: u64,
    template: &EnqueueRequest,
    when_taken: WhenTaken,
) -> Result<Option<String>, JobsError> {
    let prev = rec.next_millis;
    let next_id = iteration_id(&rec.id, next);
    let taken = tx.load_job(q, &next_id)?.is_some();
    if taken {
        tx.event(q, "duplicated", &[("jobId", &next_id)])?;
        if when_taken == WhenTaken::Stay {
            return Ok(None);
        }
    }
    rec.next_millis = next;
    rec.repeat_count = Some(rec.repeat_count() + 1);
    rec.next_job_id = Some(next_id.clone());
    // The iterations counted are those added, as Redis counts them: a tick
    // whose job was there already, or past the limit or end date, moves the
    // scheduler on without one.
    let adds = !taken && !finished_scheduling(&rec);
    if adds {
        rec.iteration_count += 1;
    }
    save(tx, q, Some(prev), &rec)?;
    if !adds {
        return Ok(None);
    }
    add_iteration(tx, q, &rec, template)?;
    Ok(Some(next_id))
}

/// Removes a scheduler and its pending iteration. False if there was none.
pub fn remove(tx: &mut Tx, q: &QueueId, id: &str) -> Result<bool, JobsError> {
    let keys = QueueKeys::new(q);
    let Some(rec) = tx.get_record::<SchedulerRecord>(&keys.scheduler(id))? else { return Ok(false) };
    tx.delete(&keys.scheduler(id))?;
    tx.delete(&keys.scheduler_next(rec.next_millis, id))?;
    if let Some(jid) = &rec.next_job_id
        && tx.load_job(q, jid)?.is_some_and(|j| j.state == JobState::Delayed)
    {
        admin::remove_job(tx, q, jid, false)?;
    }
    Ok(true)
}

pub fn get(tx: &mut Tx, q: &QueueId, id: &str) -> Result<Option<SchedulerRecord>, JobsError> {
    tx.get_record(&QueueKeys::new(q).scheduler(id))
}

/// Schedulers by next run time, positions `start..=end`.
pub fn list(tx: &mut Tx, q: &QueueId, start: i64, end: i64, asc: bool) -> Result<Vec<SchedulerRecord>, JobsError> {
    let keys = QueueKeys::new(q);
    let all = tx.scan(&keys.scheduler_nexts(), usize::MAX, !asc)?;
    let Some(at) = crate::model::lrange(all.len(), start, end) else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    for (k, _) in all.into_iter().take(at.end() + 1).skip(*at.start()) {
        let suffix = keys.suffix(&k);
        if let Some((_, rest)) = crate::keys::read_u64(suffix)
            && let Some((id, _)) = crate::keys::read_str(rest)
            && let Some(rec) = get(tx, q, &id)?
        {
            out.push(rec);
        }
    }
    Ok(out)
}

pub fn count(tx: &mut Tx, q: &QueueId) -> Result<u64, JobsError> {
    Ok(tx.scan(&QueueKeys::new(q).schedulers(), usize::MAX, false)?.len() as u64)
}

/// Like [`advance`], with the next tick chosen by the caller for `every`
/// schedulers too: a server that owns a schedule moves it tick by tick, so
/// ticks missed while it was down are each enqueued once instead of skipped.
/// A tick whose id a job holds already is that job's: the scheduler moves
/// past it without enqueuing. Returns the next iteration's job id, or None as
/// [`advance`] does.
pub fn advance_to(
    tx: &mut Tx,
    q: &QueueId,
    id: &str,
    next: u64,
    producer_id: &str,
    template: &EnqueueRequest,
) -> Result<Option<String>, JobsError> {
    let keys = QueueKeys::new(q);
    let Some(rec) = tx.get_record::<SchedulerRecord>(&keys.scheduler(id))? else { return Ok(None) };
    // A worker's scheduler may have taken it over since the server read it.
    if !rec.server_owned() || producer_id != pending_iteration_id(&rec) || next <= rec.next_millis {
        return Ok(None);
    }
    move_to_tick(tx, q, rec, next, template, WhenTaken::MovePast)
}

/// Stores `extra` with scheduler `id` (the server's own bookkeeping).
pub fn set_extra(
    tx: &mut Tx,
    q: &QueueId,
    id: &str,
    extra: std::collections::BTreeMap<String, String>,
) -> Result<bool, JobsError> {
    let keys = QueueKeys::new(q);
    let Some(mut rec) = tx.get_record::<SchedulerRecord>(&keys.scheduler(id))? else { return Ok(false) };
    rec.extra = extra;
    tx.put_record(&keys.scheduler(id), &rec)?;
    Ok(true)
}

/// Whether a scheduler has run out (its limit or end date passed).
pub fn has_finished(rec: &SchedulerRecord) -> bool {
    finished_scheduling(rec)
}

#[cfg(test)]
mod tests {
    use super::every_next;

    #[test]
    fn an_every_tick_past_the_largest_time_is_never_due() {
        let now = 1_700_000_000_000;
        // Aligned with an offset, and the next slot after one passed.
        assert_eq!(every_next(now, u64::MAX, 5, None, None), u64::MAX);
        assert_eq!(every_next(now, u64::MAX - 100, now - 1, None, None), u64::MAX);
        assert_eq!(every_next(now, u64::MAX / 2, 0, Some(now), None), u64::MAX / 2 + now);
        assert_eq!(every_next(now, u64::MAX - now / 2, 0, Some(now), None), u64::MAX);
        // Ordinary ones are BullMQ's.
        assert_eq!(every_next(now, 1_000, 0, Some(now - 1_000), None), now);
        assert_eq!(every_next(now + 10, 1_000, 5, None, None), now + 1_005);
    }
}
