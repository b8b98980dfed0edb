//! Schedules the server owns: cron with time zones
//! or `every`, start and end dates, a limit, `immediately`.
//!
//! A schedule is stored as the core's job scheduler, marked as the server's
//! in its `extra` map, so BullMQ's getters list it and one transaction moves
//! it. Its pending tick is a delayed job `repeat:<id>:<tick ms>`: the tick
//! time is in the job id, so a tick is enqueued at most once however often it
//! is processed. When a tick falls due, the ticker advances the schedule to
//! the tick after it in one transaction that also enqueues that tick's job,
//! so no tick is enqueued twice. Ticks that came by up to [`MISSED_AFTER`]
//! ago are each enqueued in turn (the ticker's passes come every 200 ms, so
//! a schedule of every 50 ms is always a few ticks behind). Ticks missed for
//! longer, while the server was down or the ticker far behind, are not made
//! up one by one: the pending tick, whose job is already enqueued, runs late
//! once and the schedule goes on from the first tick at or after now, as a Celery
//! beat entry or a BullMQ job scheduler does. Made up one by one, a schedule
//! of every second down for a day enqueued 86,400 jobs at restart.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::TimeZone;
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use futures::StreamExt;
use loam_jobs::ops::schedule;
use loam_jobs::{EnqueueRequest, Interrupt, Jobs, JobsError, QueueId, SERVER_OWNED, SchedulerRecord, SchedulerSpec};
use loam_jobs_proto::loam::jobs::v1 as pb;
use parking_lot::Mutex;

use crate::convert;

/// Where a server schedule keeps the options of each tick's job (under
/// `SERVER_EXTRA_PREFIX`, so a worker's scheduler of the same id drops it).
const TEMPLATE: &str = "loam.job";
/// Most ticks one schedule catches up per pass, so one long-stopped
/// schedule cannot hold up the others.
const CATCH_UP_PER_PASS: usize = 100;

/// Most schedules that tick at once.
const TICKING: usize = 64;

/// A cron expression of 5 fields, or 6 with seconds first, as BullMQ's
/// cron-parser and Celery's crontab read them. croner's default also took a
/// seventh, a year, which neither of them knows.
fn parse_cron(pattern: &str) -> Result<Cron, JobsError> {
    CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Disallowed)
        .build()
        .parse(pattern)
        .map_err(|e| JobsError::invalid(format!("bad cron expression {pattern:?}: {e}")))
}

fn parse_tz(tz: Option<&str>) -> Result<Tz, JobsError> {
    match tz {
        None => Ok(Tz::UTC),
        Some(name) => Tz::from_str(name).map_err(|_| JobsError::invalid(format!("unknown time zone {name:?}"))),
    }
}

/// The first cron time at or after `at` (strictly after when not `inclusive`).
fn cron_next(pattern: &str, tz: Option<&str>, at: u64, inclusive: bool) -> Result<u64, JobsError> {
    let cron = parse_cron(pattern)?;
    let tz = parse_tz(tz)?;
    // croner searches whole seconds, dropping `at`'s milliseconds: an
    // inclusive search from 12:00:00.800 found 12:00:00, a tick before `at`
    // (before the start date, or one already run, enqueued again).
    let at = if inclusive { at.div_ceil(1000).saturating_mul(1000) } else { at };
    let ms = i64::try_from(at).map_err(|_| JobsError::invalid("time out of range"))?;
    let start = tz.timestamp_millis_opt(ms).single().ok_or_else(|| JobsError::invalid("time out of range"))?;
    let next = cron
        .find_next_occurrence(&start, inclusive)
        .map_err(|e| JobsError::invalid(format!("cron expression {pattern:?} has no next time: {e}")))?;
    u64::try_from(next.timestamp_millis()).map_err(|_| JobsError::invalid("time out of range"))
}

/// The first tick after `at` (no earlier than `prev`) of the schedule whose
/// tick `prev` was: an `every` schedule's on its own grid from `prev`, so its
/// ticks keep their times.
fn tick_after(rec: &SchedulerRecord, prev: u64, at: u64) -> Result<u64, JobsError> {
    match (&rec.pattern, rec.every_ms) {
        (_, Some(every)) => {
            let every = every.max(1);
            let steps = at.saturating_sub(prev) / every + 1;
            Ok(prev.saturating_add(steps.saturating_mul(every)))
        }
        (Some(p), None) => cron_next(p, rec.tz.as_deref(), at.max(prev), false),
        (None, None) => Err(JobsError::invalid("a schedule needs cron or every")),
    }
}

/// How long ago a tick must have come to count as missed (see the module's doc).
pub const MISSED_AFTER: Duration = Duration::from_secs(60);

/// The tick to follow `prev`: the tick after it, or, when that one came by
/// more than [`MISSED_AFTER`] before `now`, the first tick at or after `now`.
fn next_tick(rec: &SchedulerRecord, prev: u64, now: u64) -> Result<u64, JobsError> {
    let next = tick_after(rec, prev, prev)?;
    if next.saturating_add(MISSED_AFTER.as_millis() as u64) > now {
        Ok(next)
    } else {
        // At or after now: one falling on now is not missed.
        tick_after(rec, prev, now.saturating_sub(1))
    }
}

/// A ServerSchedule as the core's scheduler spec and the server's
/// bookkeeping, with its first tick.
pub fn prepare(s: pb::ServerSchedule, now: u64) -> Result<(SchedulerSpec, BTreeMap<String, String>), JobsError> {
    if s.cron.is_some() == s.every_ms.is_some() {
        return Err(JobsError::invalid("a schedule needs exactly one of cron and every_ms"));
    }
    if s.every_ms == Some(0) {
        return Err(JobsError::invalid("every_ms must be at least 1"));
    }
    if s.limit == Some(0) {
        return Err(JobsError::invalid("limit must be at least 1: a schedule with limit 0 never ticks"));
    }
    parse_tz(s.tz.as_deref())?;
    if let (Some(start), Some(end)) = (s.start_date, s.end_date)
        && end < start
    {
        return Err(JobsError::invalid("end_date is before start_date"));
    }
    if let Some(end) = s.end_date
        && end < now
    {
        return Err(JobsError::invalid(format!(
            "end_date {end} has passed (now is {now}): the schedule would never tick; Unschedule ends one"
        )));
    }
    let mut job = match s.job.into_option() {
        Some(j) => convert::job_spec(j)?,
        None => EnqueueRequest { attempts: 1, ..Default::default() },
    };
    // Each tick's job is keyed by its tick already; one key for every tick
    // would refuse every tick after the first.
    if job.idempotency.is_some() {
        return Err(JobsError::invalid(
            "a schedule's job cannot have an idempotency key: each tick's job is keyed by its tick",
        ));
    }
    if job.job_id.is_some() {
        return Err(JobsError::invalid(
            "a schedule's job cannot have a job_id: each tick's job is `repeat:<schedule id>:<tick ms>`",
        ));
    }
    let data = String::from_utf8(std::mem::take(&mut job.data))
        .map_err(|_| JobsError::invalid("a schedule's job data must be UTF-8 text"))?;
    let opts = std::mem::take(&mut job.opts);
    let base = now.max(s.start_date.unwrap_or(0));
    // `every` starts at once (BullMQ's rule); cron at its first time, or at
    // once with `immediately`.
    let next_millis = match &s.cron {
        // Parsed either way: a pattern that cannot tick is refused now, not
        // after its first job.
        Some(p) => {
            // At or after a start date still ahead; strictly after now
            // otherwise: replaced at the very millisecond of a tick it had
            // just run (as the upsert caught up), a schedule started again
            // at that tick, under a second id, and ran it twice.
            let first = cron_next(p, s.tz.as_deref(), base, base > now)?;
            Some(if s.immediately { base } else { first })
        }
        None => None,
    };
    let template = serde_json::to_string(&job).map_err(|e| JobsError::Internal(e.to_string()))?;
    let spec = SchedulerSpec {
        id: s.id,
        name: s.name,
        pattern: s.cron,
        every_ms: s.every_ms,
        offset_ms: None,
        tz: s.tz,
        start_date: s.start_date,
        end_date: s.end_date,
        limit: s.limit,
        next_millis,
        template_data: data,
        template_opts: opts,
        job,
        start_resets: true,
        count: None,
    };
    let extra = BTreeMap::from([(SERVER_OWNED.to_string(), "server".to_string()), (TEMPLATE.to_string(), template)]);
    Ok((spec, extra))
}

type Key = (String, String, String);

/// The server schedules it knows of, (namespace, queue, id), each with the
/// time of its pending tick once read, so a pass reads only the schedules
/// that are due.
#[derive(Default)]
pub struct Index {
    entries: Mutex<Entries>,
}

#[derive(Default)]
struct Entries {
    by_key: BTreeMap<Key, Entry>,
    /// Numbers each `add`, so that what a pass learnt from a read made before
    /// it does not stand over it.
    added: u64,
}

struct Entry {
    /// Its pending tick's time; None until read.
    due: Option<u64>,
    /// The `add` that made it what it is.
    added: u64,
}

/// A schedule a pass reads, as the index had it then.
struct Seen {
    key: Key,
    added: u64,
}

impl Index {
    /// A new or changed schedule: read it on the next pass.
    pub fn add(&self, ns: &str, queue: &str, id: &str) {
        let mut e = self.entries.lock();
        e.added += 1;
        let entry = Entry { due: None, added: e.added };
        e.by_key.insert((ns.into(), queue.into(), id.into()), entry);
    }

    pub fn remove(&self, ns: &str, queue: &str, id: &str) {
        self.entries.lock().by_key.remove(&(ns.to_string(), queue.to_string(), id.to_string()));
    }

    /// What a pass read of `seen`, unless the schedule was added (changed)
    /// since: a pass whose read came before an upsert's commit would
    /// otherwise put off the new schedule's next read to the old one's tick,
    /// or drop from the index one the upsert had started again.
    fn after_read(&self, seen: &Seen, due: Option<u64>) {
        let mut e = self.entries.lock();
        let Some(entry) = e.by_key.get_mut(&seen.key).filter(|entry| entry.added == seen.added) else { return };
        match due {
            Some(due) => entry.due = Some(due),
            None => {
                e.by_key.remove(&seen.key);
            }
        }
    }

    /// The schedules whose tick may have come by `now`.
    fn due(&self, now: u64) -> Vec<Seen> {
        let e = self.entries.lock();
        e.by_key
            .iter()
            .filter(|(_, entry)| entry.due.is_none_or(|d| d <= now))
            .map(|(key, entry)| Seen { key: key.clone(), added: entry.added })
            .collect()
    }

    /// Finds the server schedules in the store (at start).
    pub fn load(&self, jobs: &Jobs) -> Result<usize, JobsError> {
        let mut n = 0;
        for q in crate::service::all_queues(jobs)? {
            let recs = jobs.query(&q.ns, &q.name, |tx, q| schedule::list(tx, q, 0, -1, true))?;
            for rec in recs.iter().filter(|r| r.server_owned()) {
                self.add(&q.ns, &q.name, &rec.id);
                n += 1;
            }
        }
        Ok(n)
    }
}

/// Advances every server schedule whose pending tick has come, until
/// `stop` fires.
pub async fn run(jobs: Jobs, index: Arc<Index>, metrics: Arc<crate::metrics::Metrics>, stop: Interrupt) {
    const PASS: Duration = Duration::from_millis(200);
    while !stop.is_fired() {
        // The schedules due tick side by side, their writes sharing commits.
        // Ticked one after another, each write waiting for the last, a
        // tenant's hundred schedules of every_ms 1 made another tenant's
        // ticks up to 4 s late. At most TICKING at a time: after a restart
        // every schedule is due, and all of them at once would queue their
        // writes ahead of every caller's.
        let due = index.due(jobs.now_ms());
        futures::stream::iter(&due).for_each_concurrent(TICKING, |seen| tick_due(&jobs, &index, &metrics, seen)).await;
        tokio::time::sleep(PASS).await;
    }
}

/// Makes the ticks of one schedule that are due, up to [`CATCH_UP_PER_PASS`].
async fn tick_due(jobs: &Jobs, index: &Index, metrics: &crate::metrics::Metrics, seen: &Seen) {
    let (ns, queue, id) = &seen.key;
    let q = QueueId::new(ns.clone(), queue.clone());
    for _ in 0..CATCH_UP_PER_PASS {
        match tick(jobs, &q, id).await {
            Ok(Tick::Advanced) => metrics.enqueued(ns, queue, 1),
            Ok(Tick::Idle(due)) => {
                index.after_read(seen, Some(due));
                break;
            }
            Ok(Tick::Gone) => {
                index.after_read(seen, None);
                break;
            }
            // A schedule stored before its pattern was checked can never
            // tick: said once, and left stored (Unschedule or a new
            // Schedule replaces it), instead of failing every pass.
            Err(e @ JobsError::InvalidArgument(_)) => {
                tracing::error!(ns, queue, schedule = id, error = %e, "schedule cannot tick; not run until replaced");
                index.after_read(seen, None);
                break;
            }
            Err(e) => {
                tracing::warn!(ns, queue, schedule = id, error = %e, "schedule tick failed");
                break;
            }
        }
    }
}

enum Tick {
    /// The next tick's job was enqueued.
    Advanced,
    /// Nothing is due before this time.
    Idle(u64),
    /// The schedule was removed, replaced by a worker's, or has run out.
    Gone,
}

async fn tick(jobs: &Jobs, q: &QueueId, id: &str) -> Result<Tick, JobsError> {
    let Some(rec) = jobs.query(&q.ns, &q.name, |tx, q| schedule::get(tx, q, id))? else { return Ok(Tick::Gone) };
    if !ticking(&rec) {
        return Ok(Tick::Gone);
    }
    if rec.next_millis > jobs.now_ms() {
        return Ok(Tick::Idle(rec.next_millis));
    }
    // Worked out here, off the store's writer, which only applies it.
    let step = Step::after(&rec, jobs.now_ms())?;
    let id = id.to_string();
    let advanced = jobs.admin(&q.ns, &q.name, move |tx, q| step.apply(tx, q, &id)).await?;
    // Not advanced: another caller moved it first; read it again next pass.
    Ok(if advanced.is_some() { Tick::Advanced } else { Tick::Idle(0) })
}

/// Whether `rec` is a schedule of the server's that has ticks left.
fn ticking(rec: &SchedulerRecord) -> bool {
    rec.server_owned() && !schedule::has_finished(rec)
}

/// A schedule's move past its pending tick, whose time has come: the tick
/// to follow it ([`next_tick`]), and the job it enqueues (see
/// [`schedule::advance_to`]).
struct Step {
    next: u64,
    pending: String,
    template: EnqueueRequest,
}

impl Step {
    fn after(rec: &SchedulerRecord, now: u64) -> Result<Self, JobsError> {
        let template = rec
            .extra
            .get(TEMPLATE)
            .and_then(|t| serde_json::from_str(t).ok())
            .unwrap_or_else(|| EnqueueRequest { attempts: 1, ..Default::default() });
        let next = next_tick(rec, rec.next_millis, now)?;
        Ok(Self { next, pending: schedule::pending_iteration_id(rec), template })
    }

    fn apply(&self, tx: &mut loam_jobs::tx::Tx, q: &QueueId, id: &str) -> Result<Option<String>, JobsError> {
        schedule::advance_to(tx, q, id, self.next, &self.pending, &self.template)
    }
}

/// Most ticks an upsert enqueues for the ticker (see [`catch_up`]).
const CATCH_UP_ON_UPSERT: usize = 1_000;

/// Moves schedule `id` of the server's past the ticks that came by `now`
/// and that the ticker has not taken yet, as it would (up to
/// [`CATCH_UP_ON_UPSERT`]), before an upsert replaces it: the upsert drops
/// its pending iteration as one not started, and that iteration's tick,
/// come but not yet followed by the next one's job, would be lost (Celery
/// beat upserts every entry each time it starts).
pub fn catch_up(tx: &mut loam_jobs::tx::Tx, q: &QueueId, id: &str, now: u64) -> Result<(), JobsError> {
    for _ in 0..CATCH_UP_ON_UPSERT {
        let Some(rec) = schedule::get(tx, q, id)? else { return Ok(()) };
        if !ticking(&rec) || rec.next_millis > now || Step::after(&rec, now)?.apply(tx, q, id)?.is_none() {
            return Ok(());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a pass read before an upsert's commit does not stand over the
    /// upsert's `add`: the changed schedule is read on the next pass, and
    /// one the pass found finished but the upsert started again stays.
    #[test]
    fn a_read_from_before_an_add_does_not_undo_it() {
        let index = Index::default();
        index.add("ns", "q", "s");
        let [seen] = <[Seen; 1]>::try_from(index.due(0)).ok().unwrap();
        index.add("ns", "q", "s");
        index.after_read(&seen, Some(u64::MAX));
        assert_eq!(index.due(0).len(), 1, "still read on the next pass");
        index.after_read(&seen, None);
        let [again] = <[Seen; 1]>::try_from(index.due(0)).ok().unwrap();
        // A read made since the last add stands.
        index.after_read(&again, Some(1_000));
        assert!(index.due(999).is_empty());
        assert_eq!(index.due(1_000).len(), 1);
        index.after_read(&again, None);
        assert!(index.due(u64::MAX).is_empty());
    }

    /// A worker's scheduler of the same id drops every server mark by this
    /// prefix (`schedule::upsert`), the job template among them.
    #[test]
    fn the_template_is_a_server_mark() {
        assert!(
            TEMPLATE.starts_with(loam_jobs::SERVER_EXTRA_PREFIX)
                && SERVER_OWNED.starts_with(loam_jobs::SERVER_EXTRA_PREFIX)
        );
    }

    #[test]
    fn cron_follows_the_time_zone() {
        // 2026-01-01T00:00:00Z; 09:00 in New York (UTC-5) is 14:00 UTC.
        let t0 = 1_767_225_600_000;
        let next = cron_next("0 9 * * *", Some("America/New_York"), t0, true).unwrap();
        assert_eq!(next, t0 + 14 * 3_600_000);
        let utc = cron_next("0 9 * * *", None, t0, true).unwrap();
        assert_eq!(utc, t0 + 9 * 3_600_000);
        assert!(cron_next("61 * * * *", None, t0, true).is_err());
        // Seconds first are read; a year is not.
        assert_eq!(cron_next("30 0 9 * * *", None, t0, true).unwrap(), t0 + 9 * 3_600_000 + 30_000);
        assert!(cron_next("0 0 9 * * * 2027", None, t0, true).is_err());
        assert!(cron_next("0 9 * * *", Some("Mars/Olympus"), t0, true).is_err());
    }

    #[test]
    fn ticks_missed_are_not_made_up_one_by_one() {
        let missed = MISSED_AFTER.as_millis() as u64;
        let rec = SchedulerRecord { every_ms: Some(1000), ..Default::default() };
        // Ticks behind by less than MISSED_AFTER are each made.
        assert_eq!(next_tick(&rec, 5000, 5500).unwrap(), 6000);
        assert_eq!(next_tick(&rec, 5000, 9500).unwrap(), 6000);
        // 6000 came by MISSED_AFTER ago: on from the first tick at or after
        // now, on the grid (one falling on now is not missed).
        assert_eq!(next_tick(&rec, 5000, 6000 + missed).unwrap(), 6000 + missed);
        assert_eq!(next_tick(&rec, 5000, 6500 + missed).unwrap(), 7000 + missed);
        let rec = SchedulerRecord { pattern: Some("*/10 * * * * *".into()), ..Default::default() };
        let t0 = 1_767_225_600_000;
        assert_eq!(next_tick(&rec, t0, t0 + 35_000).unwrap(), t0 + 10_000);
        assert_eq!(next_tick(&rec, t0, t0 + 10_000 + missed + 5_000).unwrap(), t0 + 20_000 + missed);
    }

    #[test]
    fn ticks_follow_the_previous_tick_not_now() {
        let rec = SchedulerRecord { every_ms: Some(1000), ..Default::default() };
        assert_eq!(tick_after(&rec, 5000, 5000).unwrap(), 6000);
        let rec = SchedulerRecord { pattern: Some("*/10 * * * * *".into()), ..Default::default() };
        assert_eq!(tick_after(&rec, 1_767_225_600_000, 1_767_225_600_000).unwrap(), 1_767_225_610_000);
    }
}
