//! Taking jobs: lease, extend, the delayed promoter and the stalled sweep.

use crate::error::{FenceFailure, JobsError};
use crate::keys::{self, QueueId, QueueKeys};
use crate::kv::KeyRange;
use crate::model::{Fence, JobError, JobRecord, JobState, Lease, LeaseRequest, Leased, LimiterWindow, Lock, RateLimit};
use crate::tx::Tx;

/// Most delayed jobs one call promotes; the rest wait for the next call.
pub(crate) const PROMOTE_BATCH: usize = 1000;
/// Most expired leases one sweep reclaims.
const SWEEP_BATCH: usize = 1000;
/// BullMQ's message for a job that stalled too often.
pub const STALLED_TOO_OFTEN: &str = "job stalled more than allowable limit";

/// Refuses a write unless `fence` proves the caller holds the job's lease.
pub fn check_fence(job: &JobRecord, fence: &Fence) -> Result<(), JobsError> {
    let fenced = |reason| JobsError::Fenced { job: job.id.clone(), current_epoch: job.epoch, reason };
    if matches!(fence, Fence::Unchecked) {
        return Ok(());
    }
    let Some(lock) = job.lock.as_ref().filter(|_| job.state == JobState::Active) else {
        return Err(fenced(FenceFailure::NoLease));
    };
    let holds = match fence {
        Fence::Epoch(e) => *e == job.epoch,
        Fence::Token(t) => *t == lock.token,
        Fence::Unchecked => true,
    };
    if holds { Ok(()) } else { Err(fenced(FenceFailure::Mismatch)) }
}

/// The queue's rate limit, as Redis's moveToActive reads it: the global max
/// in its meta, else the worker's; the worker's window length, else the
/// global one. So a worker with a limiter of its own beside a global rate
/// limit lets the global max through per its own window.
pub fn limiter(tx: &mut Tx, q: &QueueId, worker: Option<&RateLimit>) -> Result<Option<RateLimit>, JobsError> {
    let worker = worker.filter(|l| l.max > 0);
    let max = tx.meta_u64(q, "max")?.or(worker.map(|l| l.max));
    let duration = match worker {
        Some(l) => Some(l.duration_ms),
        None => tx.meta_u64(q, "duration")?,
    };
    Ok(match (max, duration) {
        (Some(max), Some(duration_ms)) if max > 0 => Some(RateLimit { max, duration_ms }),
        _ => None,
    })
}

/// The current window of the queue's rate limiter.
pub fn limiter_window(tx: &mut Tx, q: &QueueId) -> Result<LimiterWindow, JobsError> {
    let w: LimiterWindow = tx.get_record(&QueueKeys::new(q).limiter())?.unwrap_or_default();
    Ok(if w.window_end <= tx.ttl_now() { LimiterWindow::default() } else { w })
}

/// Milliseconds until the limiter lets a job through (0 = now).
pub fn rate_limit_ttl(tx: &mut Tx, q: &QueueId, limit: Option<&RateLimit>) -> Result<u64, JobsError> {
    let w = limiter_window(tx, q)?;
    Ok(window_ttl(&w, limit, tx.ttl_now()))
}

/// [`rate_limit_ttl`] of the window `w` at `now`.
fn window_ttl(w: &LimiterWindow, limit: Option<&RateLimit>, now: u64) -> u64 {
    let limited = match limit {
        Some(l) => w.count >= l.max,
        // Without a limit only a manual rate limit (count = u64::MAX) holds.
        None => w.count == u64::MAX,
    };
    if limited { w.window_end.saturating_sub(now) } else { 0 }
}

/// The longest worker name and lock token a lease takes: both are kept with
/// each job it takes (and a server lists its queues' workers by name).
pub const MAX_WORKER_NAME_BYTES: usize = 1024;

/// Refuses a worker name longer than [`MAX_WORKER_NAME_BYTES`].
pub fn check_worker_name(name: &str) -> Result<(), JobsError> {
    if name.len() > MAX_WORKER_NAME_BYTES {
        return Err(JobsError::invalid(format!("a worker name must be at most {MAX_WORKER_NAME_BYTES} bytes")));
    }
    Ok(())
}

/// Takes up to `req.max` ready jobs.
pub fn lease(tx: &mut Tx, q: &QueueId, req: &LeaseRequest) -> Result<Leased, JobsError> {
    lease_taken_by(tx, q, req, None)
}

/// [`lease`], for the completion keyed `taken_by` (its fetch_next): the
/// leases carry the key (see `complete::complete`).
pub fn lease_taken_by(
    tx: &mut Tx,
    q: &QueueId,
    req: &LeaseRequest,
    taken_by: Option<&str>,
) -> Result<Leased, JobsError> {
    if let Some(w) = &req.worker {
        check_worker_name(w)?;
    }
    if req.token.len() > MAX_WORKER_NAME_BYTES {
        return Err(JobsError::invalid(format!("a lock token must be at most {MAX_WORKER_NAME_BYTES} bytes")));
    }
    promote_due(tx, q, PROMOTE_BATCH)?;
    let mut out = Leased::default();
    let keys = QueueKeys::new(q);
    if tx.is_paused(q)? {
        out.info.paused = true;
        return Ok(out);
    }
    let mut room = u64::from(req.max.max(1));
    // A global concurrency of 0 holds every job, as on Redis.
    if let Some(concurrency) = tx.meta_u64(q, "concurrency")? {
        let active = tx.stats(q)?.active;
        if active >= concurrency {
            out.info.maxed = true;
            return Ok(out);
        }
        room = room.min(concurrency - active);
    }
    let limit = limiter(tx, q, req.limiter.as_ref())?;
    let mut window = limiter_window(tx, q)?;
    let ttl = window_ttl(&window, limit.as_ref(), tx.ttl_now());
    if ttl > 0 {
        out.info.rate_limit_ms = ttl;
        return Ok(out);
    }
    if let Some(l) = &limit {
        if window.window_end <= tx.ttl_now() {
            window = LimiterWindow { count: 0, window_end: tx.ttl_now().saturating_add(l.duration_ms) };
        }
        room = room.min(l.max - window.count);
    }

    let duration = if req.lock_duration_ms > 0 { req.lock_duration_ms } else { tx.config.default_lock_ms };
    let mut cursor = keys.waiting_all();
    let mut taken_bytes = 0u64;
    'scan: while (out.leases.len() as u64) < room {
        let want = (room as usize - out.leases.len()).max(if req.names.is_some() { 64 } else { 1 });
        let batch = tx.scan(&cursor, want, false)?;
        if batch.is_empty() {
            break;
        }
        if let Some((last, _)) = batch.last() {
            cursor.start = keys::prefix_end(last);
        }
        for (_, id) in batch {
            if (out.leases.len() as u64) >= room {
                break;
            }
            let id = String::from_utf8_lossy(&id).into_owned();
            let mut job = tx.require_job(q, &id)?;
            if let Some(names) = &req.names
                && !names.contains(&job.name)
            {
                continue;
            }
            // Failed here instead of handed out: a job that expired before it
            // started, and under `fail_deferred` one marked to fail.
            let failure = if job.expires.is_some_and(|e| e <= tx.now) {
                Some("job expired before it started".to_string())
            } else if req.fail_deferred {
                job.deferred_failure.take()
            } else {
                None
            };
            if let Some(reason) = failure {
                super::complete::fail(tx, q, job, &JobError::new(reason), false)?;
                out.info.failed += 1;
                continue;
            }
            let size = job.data.len() as u64;
            if !out.leases.is_empty() && req.max_bytes.is_some_and(|max| taken_bytes.saturating_add(size) > max) {
                break 'scan;
            }
            taken_bytes = taken_bytes.saturating_add(size);
            let prev = job.state;
            tx.unindex(q, &job)?;
            // Above every epoch handed out before: this record's, a lost
            // lease's from before a crash (generation), and those of deleted
            // records that had this job's id (the queue's floor).
            let epoch = job.epoch.max(tx.generation << 32).max(tx.stats(q)?.epoch_floor) + 1;
            let token = if req.token.is_empty() { format!("loam:{}:{}", job.id, epoch) } else { req.token.clone() };
            let lock_ms = job.lock_duration_ms.unwrap_or(duration);
            // A lease never outlasts the job's hard timeout, so the sweep
            // finds it expired and fails the attempt (extensions are capped
            // the same way).
            let held_ms = job.timeout_ms.map_or(lock_ms, |t| lock_ms.min(t));
            job.state = JobState::Active;
            job.epoch = epoch;
            job.lock = Some(Lock {
                token: token.clone(),
                deadline: tx.lease_now.saturating_add(held_ms),
                duration_ms: lock_ms,
                taken_by: taken_by.map(str::to_string),
            });
            // Never before it was due: a job made ready by the core's clock,
            // or by a caller whose clock runs ahead, may be leased by a caller
            // whose clock is behind (a remote worker's, by its message's time
            // in transit or its machine's skew).
            job.processed_on = Some(tx.now.max(job.due));
            job.attempts_started += 1;
            if let Some(w) = &req.worker {
                job.processed_by = Some(w.clone());
            }
            tx.index(q, &job)?;
            tx.save_job(q, &mut job)?;
            tx.event(q, "active", &[("jobId", &job.id), ("prev", prev_name(prev))])?;
            window.count += 1;
            out.leases.push(Lease { epoch: job.epoch, token, deadline: tx.lease_now.saturating_add(held_ms), job });
        }
    }
    if limit.is_some() && !out.leases.is_empty() {
        tx.put_record(&keys.limiter(), &window)?;
    }
    if out.leases.is_empty() {
        out.info.next_due = next_due(tx, q)?;
    }
    Ok(out)
}

/// BullMQ's `prev` field: waiting and prioritized jobs both come from "waiting".
fn prev_name(state: JobState) -> &'static str {
    match state {
        JobState::Prioritized => "waiting",
        s => s.as_str(),
    }
}

/// When the first delayed job falls due (or fell: it may be due already).
pub fn next_due(tx: &mut Tx, q: &QueueId) -> Result<Option<u64>, JobsError> {
    first_due(tx, q, QueueKeys::new(q).delayed_all())
}

/// When the first delayed job not due at `now` falls due.
pub fn next_due_after(tx: &mut Tx, q: &QueueId, now: u64) -> Result<Option<u64>, JobsError> {
    first_due(tx, q, QueueKeys::new(q).delayed_later(now))
}

fn first_due(tx: &mut Tx, q: &QueueId, range: KeyRange) -> Result<Option<u64>, JobsError> {
    if tx.stats(q)?.delayed == 0 {
        return Ok(None);
    }
    let head = tx.scan(&range, 1, false)?;
    Ok(head.first().and_then(|(k, _)| {
        let suffix = k.get(k.len().checked_sub(16)?..)?;
        keys::read_u64(suffix).map(|(due, _)| due)
    }))
}

/// Moves delayed jobs that are due ([`Tx::due_by`]) to waiting; returns the
/// next due time. (A job that starts before its caller's time says it is due
/// still shows as started at its due time.)
pub fn promote_due(tx: &mut Tx, q: &QueueId, limit: usize) -> Result<Option<u64>, JobsError> {
    // Every lease comes here first; the counter spares most of them two scans.
    if tx.stats(q)?.delayed == 0 {
        return Ok(None);
    }
    let keys = QueueKeys::new(q);
    let due = tx.scan(&keys.delayed_due(tx.due_by()), limit, false)?;
    for (_, id) in due {
        let id = String::from_utf8_lossy(&id).into_owned();
        let job = tx.require_job(q, &id)?;
        make_ready(tx, q, job, Some("delayed"), Line::Promoted)?;
    }
    next_due(tx, q)
}

/// Where a job rejoins its ready band.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Line {
    /// Behind every waiting job, or in front for LIFO jobs (new, retried and
    /// reprocessed jobs).
    Back,
    /// Behind every waiting job, LIFO or not: promoted delayed jobs (Redis's
    /// promotions, on time or by hand, LPUSH every job without a priority).
    Promoted,
    /// Next to run: stalled, rate-limited and released jobs (BullMQ's RPUSH).
    Front,
}

/// Puts a job (already loaded, in any unfinished state) into its ready band,
/// with a `waiting` event naming the state it came from (`prev`), or none.
pub fn make_ready(
    tx: &mut Tx,
    q: &QueueId,
    job: JobRecord,
    prev: Option<&str>,
    line: Line,
) -> Result<JobRecord, JobsError> {
    tx.unindex(q, &job)?;
    requeue(tx, q, job, prev, line)
}

/// [`make_ready`] for a job already taken out of its index (its fields may
/// have changed since, so its old index key cannot be derived any more).
pub fn requeue(
    tx: &mut Tx,
    q: &QueueId,
    mut job: JobRecord,
    prev: Option<&str>,
    line: Line,
) -> Result<JobRecord, JobsError> {
    let front = match line {
        Line::Back => job.queues_lifo(),
        Line::Promoted => false,
        Line::Front => true,
    };
    job.seq = tx.next_seq(q, front)?;
    job.delay = 0;
    // Ready now at the latest. A job not due yet (promoted by hand) is due at
    // its caller's time, when Redis's moveToActive would start it; one due by
    // the clock `promote_due` reads keeps its due time, which may be ahead of
    // its caller's (a remote worker's clock behind the core's).
    if job.due > tx.due_by() {
        job.due = tx.now;
    }
    job.state = Tx::ready_state(&job);
    job.lock = None;
    tx.index(q, &job)?;
    tx.save_job(q, &mut job)?;
    if let Some(prev) = prev {
        tx.event(q, "waiting", &[("jobId", &job.id), ("prev", prev)])?;
    }
    Ok(job)
}

/// Refuses extending a lock by 0 ms (or by a negative or fractional duration
/// a caller rounded to 0): that would release it at once, and another
/// worker, or a `remove`, could take the job while it is being processed.
/// Redis refuses it too ("invalid expire time").
pub fn check_extension(duration_ms: u64) -> Result<(), JobsError> {
    if duration_ms == 0 {
        return Err(JobsError::invalid("a lock is extended by at least 1 ms"));
    }
    Ok(())
}

pub fn extend(tx: &mut Tx, q: &QueueId, id: &str, fence: &Fence, duration_ms: u64) -> Result<u64, JobsError> {
    check_extension(duration_ms)?;
    let mut job = tx.require_job(q, id)?;
    check_fence(&job, fence)?;
    if matches!(fence, Fence::Unchecked) && job.state != JobState::Active {
        return Err(JobsError::not_in_state(id, job.state, JobState::Active));
    }
    let mut deadline = tx.lease_now.saturating_add(duration_ms);
    if let (Some(timeout), Some(started)) = (job.timeout_ms, job.processed_on) {
        let cap = started.saturating_add(timeout);
        if cap <= tx.now {
            return Err(JobsError::DeadlineExceeded);
        }
        // The cap is in job time; the deadline in lease time.
        deadline = deadline.min(tx.lease_now.saturating_add(cap - tx.now));
    }
    tx.unindex(q, &job)?;
    if let Some(lock) = job.lock.as_mut() {
        lock.deadline = deadline;
        lock.duration_ms = duration_ms;
    }
    tx.index(q, &job)?;
    tx.save_job(q, &mut job)?;
    Ok(deadline)
}

/// Whether `job` is an iteration of a scheduler that still exists: those
/// stall without limit, as in BullMQ, whose exemption ends with the scheduler.
fn of_a_live_scheduler(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<bool, JobsError> {
    let Some(id) = &job.scheduler_id else { return Ok(false) };
    Ok(tx.get(&QueueKeys::new(q).scheduler(id))?.is_some())
}

/// A worker's stalled check (BullMQ's `moveStalledJobsToWait`): the worker's
/// `maxStalledCount`, when it gives one, becomes the queue's, then
/// [`sweep_stalled`] runs under it, in the same transaction.
pub fn sweep_stalled_as_worker(tx: &mut Tx, q: &QueueId, max_stalled: Option<u32>) -> Result<Vec<String>, JobsError> {
    if let Some(max_stalled) = max_stalled {
        let current = tx.queue_config(q)?;
        if current.max_stalled != max_stalled {
            tx.set_queue_config(q, crate::config::QueueConfig { max_stalled, ..current })?;
        }
    }
    sweep_stalled(tx, q)
}

/// Reclaims jobs whose lease expired: back to the front of waiting with one
/// more stall. Past the queue's `max_stalled` (iterations of a scheduler that
/// still exists are exempt) it goes back marked with a deferred failure, which the worker that
/// claims it next applies, as BullMQ 6.7 does. A job past its hard timeout
/// fails its attempt instead.
pub fn sweep_stalled(tx: &mut Tx, q: &QueueId) -> Result<Vec<String>, JobsError> {
    let config = tx.queue_config(q)?;
    let expired = tx.scan(&QueueKeys::new(q).active_expired(tx.lease_now), SWEEP_BATCH, false)?;
    let mut reclaimed = Vec::new();
    for (_, id) in expired {
        let id = String::from_utf8_lossy(&id).into_owned();
        let mut job = tx.require_job(q, &id)?;
        let timed_out = match (job.timeout_ms, job.processed_on) {
            (Some(t), Some(p)) => p.saturating_add(t) <= tx.now,
            _ => false,
        };
        job.epoch += 1; // a late write of the old holder is now fenced
        if timed_out {
            super::complete::retry_or_fail(tx, q, job, Some(&JobError::new("timeout")), None)?;
        } else {
            job.stalled_counter += 1;
            if job.stalled_counter > config.max_stalled && !of_a_live_scheduler(tx, q, &job)? {
                job.deferred_failure = Some(STALLED_TOO_OFTEN.to_string());
            }
            make_ready(tx, q, job, Some("active"), Line::Front)?;
        }
        tx.event(q, "stalled", &[("jobId", &id)])?;
        reclaimed.push(id);
    }
    if !reclaimed.is_empty() {
        tx.stats_mut(q)?.stalled_total += reclaimed.len() as u64;
    }
    Ok(reclaimed)
}
