//! Ending a lease: every outcome, and what a finished job does to its
//! parent, its dedup key, its queue's retention and metrics.

use std::borrow::Cow;
use std::collections::VecDeque;

use crate::error::{JobsError, Precondition};
use crate::keys::{QueueId, QueueKeys};
use crate::model::{
    self, AttemptRun, CompleteOptions, Completed, DedupRecord, Dependency, DependencyStatus, Fence, Idempotency,
    JobError, JobRecord, JobState, Keep, Lease, LeaseInfo, Leased, LimiterWindow, MAX_METRICS_POINTS, MetricsKind,
    MetricsRecord, OnChildFailure, Outcome, RateLimit, Retention,
};
use crate::ops::idempotency::CallHash;
use crate::ops::lease::{self, Line};
use crate::ops::{enqueue, idempotency};
use crate::tx::Tx;

/// Default for BullMQ's `KeepJobs.limit`: most jobs one completion removes by age.
const AGE_REMOVAL_LIMIT: u64 = 1000;

/// Parents refuse to complete while a child is pending or has failed them.
pub fn check_children(job: &JobRecord) -> Result<(), JobsError> {
    if job.pending_children > 0 {
        return Err(JobsError::Precondition(Precondition::PendingChildren { job: job.id.clone() }));
    }
    if job.failed_children > 0 {
        return Err(JobsError::Precondition(Precondition::FailedChildren { job: job.id.clone() }));
    }
    Ok(())
}

/// Ends the lease of job `id` with `outcome`.
///
/// With an idempotency key in `opts`, a completion sent again after its
/// answer was lost answers what it first did: the key stays on the job it
/// ended (`ended_by`, through later leases, until another keyed completion
/// ends the job) and on the leases it took for the next jobs (`taken_by`),
/// records written anyway. So the worker gets its next job back instead of
/// leaving it to stall, and a retry or delay sent again after the job was
/// leased anew is not applied twice (with BullMQ's manual processing the new
/// lease may have the old one's token, which the fence would let through).
/// The key moves to an idempotency record of its own, for the key's ttl,
/// when the job goes (retention removed it at once) or when a later keyed
/// completion takes its place on the job. (One that a later completion's
/// retention trimmed before the repeat came is known only by the next jobs
/// its completion took; if it took none, the repeat is answered as any call
/// on a missing job is.)
pub fn complete(
    tx: &mut Tx,
    q: &QueueId,
    id: &str,
    fence: &Fence,
    outcome: Outcome,
    opts: &CompleteOptions,
) -> Result<Completed, JobsError> {
    let limit = tx.config.max_payload_bytes;
    let outcome = match outcome {
        Outcome::Fail { error, dead_letter } => Outcome::Fail { error: error.bounded(limit), dead_letter },
        Outcome::Retry { error, after_ms } => Outcome::Retry { error: error.map(|e| e.bounded(limit)), after_ms },
        other => other,
    };
    let job = tx.load_job(q, id)?;
    if let Some(idem) = &opts.idempotency {
        idempotency::check_key(&idem.key)?;
        if let Some(done) = completed_before(tx, q, id, job.as_ref(), idem)? {
            return Ok(done);
        }
    }
    let mut job = job.ok_or_else(|| JobsError::job_missing(id))?;
    let key = opts.idempotency.as_ref().map(|i| i.key.as_str());
    let earlier = std::mem::replace(&mut job.ended_by, key.map(str::to_string));
    let done = complete_job(tx, q, job, fence, outcome, opts, key)?;
    if let (Some(earlier), Some(idem)) = (earlier, &opts.idempotency)
        && earlier != idem.key
    {
        // The earlier completion may still be sent again (its answer lost).
        let earlier = Idempotency { key: earlier, ttl_ms: idem.ttl_ms };
        let answer = idempotency::Answer { finished_on: done.finished_on, ..Default::default() };
        idempotency::remember(tx, q, &earlier, CallHash::of(completion_hash(id)), id, answer)?;
    }
    Ok(done)
}

/// [`complete`], then, in the same transaction, how long the queue stays rate
/// limited under `limiter` (the worker's, used when the queue has no global
/// limit): how a remote worker with a limiter learns it as its job ends.
///
/// BullMQ's `moveJobFromActiveToWait` (a processor's RateLimitError) is such
/// a release: the job goes back to the front of its band. Unchecked (BullMQ's
/// token "0"), a release of a job that is not active leaves it where it is,
/// as Redis's script finds nothing to take off its active list, and answers
/// the ttl; every other release of such a job is refused, here as in
/// [`complete`].
pub fn complete_then_rate_limit_ttl(
    tx: &mut Tx,
    q: &QueueId,
    id: &str,
    fence: &Fence,
    outcome: Outcome,
    opts: &CompleteOptions,
    limiter: Option<&RateLimit>,
) -> Result<(Completed, u64), JobsError> {
    // A job this completion's own key ended is a repeat's: `complete` answers
    // what it first did.
    let ended_by_this_call =
        |job: &JobRecord| opts.idempotency.as_ref().is_some_and(|i| job.ended_by.as_deref() == Some(i.key.as_str()));
    let left_alone = match (&outcome, fence) {
        (Outcome::Release { after_ms: None }, Fence::Unchecked) => {
            tx.load_job(q, id)?.filter(|job| job.state != JobState::Active && !ended_by_this_call(job))
        }
        _ => None,
    };
    let done = match left_alone {
        Some(job) => Completed { state: Some(job.state), moved: false, ..Default::default() },
        None => complete(tx, q, id, fence, outcome, opts)?,
    };
    let limit = lease::limiter(tx, q, limiter)?;
    Ok((done, lease::rate_limit_ttl(tx, q, limit.as_ref())?))
}

/// What tells a completion's key apart from another call's under it.
fn completion_hash(id: &str) -> u64 {
    idempotency::hash_of(&("complete", id))
}

/// The first answer of the completion keyed `idem`, if it was applied: `job`
/// ended by it (or removed, with its key's record), or a job leased by it.
fn completed_before(
    tx: &mut Tx,
    q: &QueueId,
    id: &str,
    job: Option<&JobRecord>,
    idem: &Idempotency,
) -> Result<Option<Completed>, JobsError> {
    let key = idem.key.as_str();
    let call = CallHash::of(completion_hash(id));
    // The job holds the key of the keyed completion that ended it last; an
    // earlier one's key is in a record of its own, as a removed job's is.
    let (ended, removed) = match job {
        Some(j) if j.ended_by.as_deref() == Some(key) => (true, None),
        Some(j) if j.ended_by.is_none() => return Ok(None),
        Some(_) => match idempotency::recall(tx, q, idem, call, None)? {
            Some(_) => (true, None),
            None => return Ok(None),
        },
        None => (false, idempotency::recall(tx, q, idem, call, None)?),
    };
    let mut leases = Vec::new();
    for (_, id) in tx.scan(&QueueKeys::new(q).active_all(), usize::MAX, false)? {
        let Some(next) = tx.load_job(q, &String::from_utf8_lossy(&id))? else { continue };
        if let Some(lock) = next.lock.clone().filter(|l| l.taken_by.as_deref() == Some(key)) {
            leases.push(Lease { epoch: next.epoch, token: lock.token, deadline: lock.deadline, job: next });
        }
    }
    if !ended && removed.is_none() && leases.is_empty() {
        return Ok(None);
    }
    let next = Some(Leased { leases, info: LeaseInfo::default() });
    Ok(Some(Completed {
        state: job.map(|j| j.state),
        finished_on: job.and_then(|j| j.finished_on).or(removed.as_ref().and_then(|r| r.finished_on)),
        removed: removed.is_some(),
        moved: true,
        next,
        attempt: None,
        replayed: true,
    }))
}

#[allow(clippy::too_many_arguments, reason = "complete's arguments, the job loaded and its key")]
fn complete_job(
    tx: &mut Tx,
    q: &QueueId,
    job: JobRecord,
    fence: &Fence,
    outcome: Outcome,
    opts: &CompleteOptions,
    key: Option<&str>,
) -> Result<Completed, JobsError> {
    let id = job.id.clone();
    let id = id.as_str();
    if matches!(outcome, Outcome::Ok { .. }) {
        check_children(&job)?;
    }
    // BullMQ decides these before it looks at the lock: a failed child
    // refuses, and a parent with nothing (or not that child) to wait for stays.
    if let Outcome::WaitChildren { child } = &outcome {
        if job.failed_children > 0 {
            return Err(JobsError::Precondition(Precondition::FailedChildren { job: job.id.clone() }));
        }
        let waits = match child {
            Some(key) => tx
                .get_record::<Dependency>(&QueueKeys::new(q).dependency(&job.id, key))?
                .is_some_and(|d| d.status == DependencyStatus::Pending),
            None => job.pending_children > 0,
        };
        if !waits {
            return Ok(Completed { state: Some(job.state), moved: false, ..Default::default() });
        }
    }
    lease::check_fence(&job, fence)?;
    if job.state != JobState::Active {
        return Err(JobsError::not_in_state(id, job.state, JobState::Active));
    }
    let removed_if_completed = removes_at_once(&retention(&job, opts, JobState::Completed));
    let removed_if_failed = removes_at_once(&retention(&job, opts, JobState::Failed));
    let ends_attempt = matches!(outcome, Outcome::Ok { .. } | Outcome::Fail { .. } | Outcome::Retry { .. });
    let attempt = job
        .processed_on
        .filter(|_| ends_attempt)
        .map(|started| AttemptRun { task: job.name.clone(), ran_ms: tx.now.saturating_sub(started) });
    let mut done = Completed { moved: true, attempt, ..Default::default() };
    let finishing = matches!(outcome, Outcome::Ok { .. } | Outcome::Fail { .. });
    let fetch = match outcome {
        Outcome::Ok { result } => {
            tx.check_payload(result.as_ref().map_or(0, Vec::len))?;
            let job = finish_ok(tx, q, job, result, opts)?;
            done.state = Some(job.state);
            done.finished_on = job.finished_on;
            true
        }
        Outcome::Fail { error, dead_letter } => {
            let job = fail_with(tx, q, job, &error, dead_letter, opts)?;
            done.state = Some(job.state);
            done.finished_on = job.finished_on;
            true
        }
        Outcome::Retry { error, after_ms } => {
            let job = retry_or_fail_with(tx, q, job, error.as_ref(), after_ms, opts)?;
            done.state = Some(job.state);
            done.finished_on = job.finished_on;
            after_ms.is_some_and(|a| a > 0)
        }
        Outcome::Release { after_ms } => {
            let job = release(tx, q, job, after_ms)?;
            done.state = Some(job.state);
            false
        }
        Outcome::Delay { until, delay_ms } => {
            let job = delay_until(tx, q, job, until, delay_ms)?;
            done.state = Some(job.state);
            true
        }
        Outcome::WaitChildren { .. } => {
            let job = park_for_children(tx, q, job)?;
            done.state = Some(job.state);
            false
        }
        Outcome::RateLimited { for_ms } => {
            let window = LimiterWindow { count: u64::MAX, window_end: tx.ttl_now().saturating_add(for_ms) };
            tx.put_record(&QueueKeys::new(q).limiter(), &window)?;
            let job = release(tx, q, job, None)?;
            done.state = Some(job.state);
            false
        }
    };
    let removed = match done.state {
        Some(JobState::Completed) => removed_if_completed,
        Some(JobState::Failed) => removed_if_failed,
        _ => false,
    };
    if removed {
        // Retention removed the job: the answer says so, and a keyed
        // completion keeps its key where a repeat finds it (see `complete`).
        done.removed = true;
        if let Some(idem) = &opts.idempotency {
            let answer = idempotency::Answer { finished_on: done.finished_on, ..Default::default() };
            idempotency::remember(tx, q, idem, CallHash::of(completion_hash(id)), id, answer)?;
        }
    }
    if fetch && let Some(req) = &opts.fetch_next {
        done.next = Some(lease::lease_taken_by(tx, q, req, key)?);
    }
    // Redis's moveToFinished emits `drained` only when it fetched nothing and
    // nothing holds the next fetch back: a delayed job still to come, a rate
    // limit, a paused or maxed queue each answer the fetch instead.
    let fetch_answered = done.next.as_ref().is_some_and(|n| {
        !n.leases.is_empty() || n.info.rate_limit_ms > 0 || n.info.paused || n.info.maxed || n.info.next_due.is_some()
    });
    if finishing && !fetch_answered {
        let s = tx.stats(q)?;
        if s.waiting + s.prioritized + s.active == 0 {
            tx.event(q, "drained", &[])?;
        }
    }
    Ok(done)
}

fn finish_ok(
    tx: &mut Tx,
    q: &QueueId,
    mut job: JobRecord,
    result: Option<Vec<u8>>,
    opts: &CompleteOptions,
) -> Result<JobRecord, JobsError> {
    let prev = job.state;
    tx.unindex(q, &job)?;
    let value = result.unwrap_or_else(|| b"null".to_vec());
    release_dedup_on_finish(tx, q, &job)?;
    child_finished(tx, q, &job, ChildEnd::Completed(&value))?;
    job.attempts_made += 1;
    job.state = JobState::Completed;
    job.finished_on = Some(tx.now);
    job.lock = None;
    let kept = retention(&job, opts, JobState::Completed);
    // A large value of a job that stays is written once, in its record, and
    // lent to the event: in both, it was half of what such a completion wrote.
    let lend = !removes_at_once(&kept) && value.len() > model::INLINE_EVENT_BYTES;
    job.return_value = Some(value);
    if lend {
        job.return_value_event = Some(tx.completed_event_lent_value(q, &job.id, prev.as_str())?);
        keep_or_purge(tx, q, &mut job, kept)?;
    } else {
        keep_or_purge(tx, q, &mut job, kept)?;
        let value = model::as_text(job.return_value.as_deref().unwrap_or_default());
        tx.event(q, "completed", &[("jobId", &job.id), (model::RETURN_VALUE_FIELD, &value), ("prev", prev.as_str())])?;
    }
    collect_metrics(tx, q, MetricsKind::Completed, opts.metrics_max_points)?;
    Ok(job)
}

/// Fails a job for good, whatever its state (a worker's failure, a stalled or
/// expired job, a parent failed by its child).
pub fn fail(
    tx: &mut Tx,
    q: &QueueId,
    job: JobRecord,
    error: &JobError,
    dead_letter: bool,
) -> Result<JobRecord, JobsError> {
    fail_with(tx, q, job, error, dead_letter, &CompleteOptions::default())
}

fn record_error(job: &mut JobRecord, error: &JobError) {
    job.failed_reason = Some(error.message.clone());
    if let Some(all) = &error.stacktraces {
        job.stacktrace.clone_from(all);
        return;
    }
    if let Some(stack) = &error.stacktrace {
        job.stacktrace.push(stack.clone());
    }
    if let Some(limit) = error.stacktrace_limit {
        let excess = job.stacktrace.len().saturating_sub(limit);
        job.stacktrace.drain(..excess);
    }
}

fn fail_with(
    tx: &mut Tx,
    q: &QueueId,
    mut job: JobRecord,
    error: &JobError,
    dead_letter: bool,
    opts: &CompleteOptions,
) -> Result<JobRecord, JobsError> {
    let prev = if job.state == JobState::Prioritized { JobState::Waiting } else { job.state };
    // A failure is an outcome, also when a lease records it (a job that
    // expired before it started, or was marked to fail): readers may see it,
    // so a crash must not take it back.
    tx.require_durable();
    tx.unindex(q, &job)?;
    record_error(&mut job, error);
    release_dedup_on_finish(tx, q, &job)?;
    child_finished(tx, q, &job, ChildEnd::Failed(&error.message))?;
    job.attempts_made += 1;
    job.state = JobState::Failed;
    job.finished_on = Some(tx.now);
    job.lock = None;
    job.deferred_failure = None;
    let config = tx.queue_config(q)?;
    let exhausted = job.attempts_made >= job.attempts;
    let dlq = job.dead_letter.clone().or(config.dead_letter_queue);
    if let Some(dlq) = dlq
        && (dead_letter || (exhausted && config.dead_letter_on_exhausted))
    {
        send_to_dead_letter(tx, q, &job, &dlq, &error.message)?;
    }
    let kept = retention(&job, opts, JobState::Failed);
    keep_or_purge(tx, q, &mut job, kept)?;
    let reason = error.message.clone();
    tx.event(q, "failed", &[("jobId", &job.id), ("failedReason", &reason), ("prev", prev.as_str())])?;
    if exhausted {
        tx.event(q, "retries-exhausted", &[("jobId", &job.id), ("attemptsMade", &job.attempts_made.to_string())])?;
    }
    collect_metrics(tx, q, MetricsKind::Failed, opts.metrics_max_points)?;
    Ok(job)
}

/// A failed attempt: retried after `after_ms` when given (the caller already
/// decided), else by the job's attempts and backoff, else failed for good.
pub fn retry_or_fail(
    tx: &mut Tx,
    q: &QueueId,
    job: JobRecord,
    error: Option<&JobError>,
    after_ms: Option<u64>,
) -> Result<JobRecord, JobsError> {
    retry_or_fail_with(tx, q, job, error, after_ms, &CompleteOptions::default())
}

fn retry_or_fail_with(
    tx: &mut Tx,
    q: &QueueId,
    mut job: JobRecord,
    error: Option<&JobError>,
    after_ms: Option<u64>,
    opts: &CompleteOptions,
) -> Result<JobRecord, JobsError> {
    let delay = match after_ms {
        Some(ms) => ms,
        None if job.attempts_made + 1 < job.attempts => {
            job.backoff.as_ref().map_or(0, |b| b.delay_ms(job.attempts_made + 1, rand::random::<f64>()))
        }
        None => {
            let error = error.cloned().unwrap_or_else(|| JobError::new(job.failed_reason.clone().unwrap_or_default()));
            return fail_with(tx, q, job, &error, false, opts);
        }
    };
    if let Some(error) = error {
        record_error(&mut job, error);
    }
    job.attempts_made += 1;
    if delay > 0 {
        job.delay = delay;
        park_delayed(tx, q, job, tx.now.saturating_add(delay))
    } else {
        // Behind the delayed jobs that fell due while it ran, as BullMQ's
        // retryJob promotes them first: the store's promoter may not have yet.
        lease::promote_due(tx, q, lease::PROMOTE_BATCH)?;
        lease::make_ready(tx, q, job, Some("active"), Line::Back)
    }
}

fn park_delayed(tx: &mut Tx, q: &QueueId, mut job: JobRecord, due: u64) -> Result<JobRecord, JobsError> {
    tx.unindex(q, &job)?;
    job.state = JobState::Delayed;
    job.lock = None;
    job.due = due;
    job.seq = tx.next_seq(q, false)?;
    tx.index(q, &job)?;
    tx.save_job(q, &mut job)?;
    tx.event(q, "delayed", &[("jobId", &job.id), ("delay", &due.to_string())])?;
    Ok(job)
}

/// Gives a job back without spending an attempt (a nack, a rate limit).
fn release(tx: &mut Tx, q: &QueueId, mut job: JobRecord, after_ms: Option<u64>) -> Result<JobRecord, JobsError> {
    match after_ms.filter(|a| *a > 0) {
        Some(after) => {
            job.delay = after;
            park_delayed(tx, q, job, tx.now.saturating_add(after))
        }
        None => lease::make_ready(tx, q, job, Some("active"), Line::Front),
    }
}

/// BullMQ's manual moveToDelayed: no attempt is spent.
fn delay_until(
    tx: &mut Tx,
    q: &QueueId,
    mut job: JobRecord,
    until: u64,
    delay_ms: Option<u64>,
) -> Result<JobRecord, JobsError> {
    job.delay = delay_ms.unwrap_or_else(|| until.saturating_sub(tx.now));
    park_delayed(tx, q, job, until.max(tx.now))
}

fn park_for_children(tx: &mut Tx, q: &QueueId, mut job: JobRecord) -> Result<JobRecord, JobsError> {
    tx.unindex(q, &job)?;
    job.state = JobState::WaitingChildren;
    job.lock = None;
    tx.index(q, &job)?;
    tx.save_job(q, &mut job)?;
    tx.event(q, "waiting-children", &[("jobId", &job.id), ("prev", "active")])?;
    Ok(job)
}

/// What becomes of `job` once it ends in `state` (completed, else failed):
/// its own removeOnComplete / removeOnFail, else the worker's.
fn retention(job: &JobRecord, opts: &CompleteOptions, state: JobState) -> Retention {
    let (own, worker) = if state == JobState::Completed {
        (job.remove_on_complete, opts.remove_on_complete)
    } else {
        (job.remove_on_fail, opts.remove_on_fail)
    };
    own.or(worker).unwrap_or_default()
}

/// Whether `retention` deletes a job as it finishes.
fn removes_at_once(retention: &Retention) -> bool {
    matches!(retention, Retention::RemoveImmediately | Retention::Keep(Keep { count: Some(0), .. }))
}

/// Keeps a finished job in its state's index under `retention`, or deletes it;
/// then trims older finished jobs of the same state.
fn keep_or_purge(tx: &mut Tx, q: &QueueId, job: &mut JobRecord, retention: Retention) -> Result<(), JobsError> {
    if removes_at_once(&retention) {
        super::admin::detach_from_parent(tx, q, job)?;
        super::admin::purge_job(tx, q, job)?;
        return Ok(());
    }
    let keep = match retention {
        Retention::Keep(k) => k,
        _ => Keep::default(),
    };
    tx.index(q, job)?;
    tx.save_job(q, job)?;
    let keys = QueueKeys::new(q);
    let range = if job.state == JobState::Completed { keys.completed_all() } else { keys.failed_all() };
    let mut old: Vec<String> = Vec::new();
    if let Some(age) = keep.age_ms {
        let cutoff = tx.now.saturating_sub(age);
        let limit = keep.limit.unwrap_or(AGE_REMOVAL_LIMIT) as usize;
        let upto = if job.state == JobState::Completed {
            keys.completed(cutoff, u64::MAX)
        } else {
            keys.failed(cutoff, u64::MAX)
        };
        let expired = crate::kv::KeyRange::new(range.start.clone(), upto);
        // The newest expired first, as Redis's removal by age takes them: past
        // `limit`, the oldest wait for a later finish.
        old.extend(tx.scan(&expired, limit, true)?.into_iter().map(|(_, v)| String::from_utf8_lossy(&v).into_owned()));
    }
    if let Some(count) = keep.count
        && let excess = tx.stats(q)?.count(job.state).saturating_sub(old.len() as u64).saturating_sub(count) as usize
        && excess > 0
    {
        // Then, as in Redis, the oldest of what the age left, past `count`.
        // This job stays, and may sort among the oldest (finished in the same
        // millisecond as jobs added after it): the scan reads past it and past
        // every job the age took, so that `count` are still all that is kept.
        let oldest = tx.scan(&range, excess + old.len() + 1, false)?;
        let others: Vec<String> = oldest
            .into_iter()
            .map(|(_, v)| String::from_utf8_lossy(&v).into_owned())
            .filter(|id| *id != job.id && !old.contains(id))
            .take(excess)
            .collect();
        old.extend(others);
    }
    // The removal by age takes this job too when it finished at or before the
    // cutoff (an age of 0), as Redis's does; the one by count never does.
    for id in old {
        if let Some(stale) = tx.load_job(q, &id)? {
            tx.unindex(q, &stale)?;
            super::admin::detach_from_parent(tx, q, &stale)?;
            super::admin::purge_job(tx, q, &stale)?;
        }
    }
    Ok(())
}

/// Frees a finished job's dedup key when the key is held until the job
/// finishes, and enqueues the add kept by `keepLastIfActive`. As Redis's
/// moveToFinished makes the add under `dn:<id>`, the kept add is made when
/// any job of the id finishes, whether or not it holds the key (it may no
/// longer: the key was removed, and maybe taken by a later add).
fn release_dedup_on_finish(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<(), JobsError> {
    let Some(d) = &job.dedup else { return Ok(()) };
    let key = QueueKeys::new(q).dedup(&d.id);
    let Some(rec) = tx.get_record::<DedupRecord>(&key)? else { return Ok(()) };
    let expired = rec.expires_at.is_some_and(|e| e <= tx.ttl_now());
    if rec.holder() == Some(job.id.as_str()) && (rec.expires_at.is_none() || expired) {
        tx.delete(&key)?;
    }
    if let Some(next) = rec.next {
        tx.delete(&key)?;
        enqueue::enqueue_kept(tx, q, *next)?;
    }
    Ok(())
}

enum ChildEnd<'a> {
    /// The return value, made text only for a parent waiting on it.
    Completed(&'a [u8]),
    Failed(&'a str),
}

/// Updates the parent of a child that finished, by the child's failure policy,
/// and releases (or fails) the parent when that is due.
fn child_finished(tx: &mut Tx, q: &QueueId, child: &JobRecord, end: ChildEnd<'_>) -> Result<(), JobsError> {
    let Some(super::admin::ChildLink { parent, parent_queue: pq, child_key, dep_key, dep }) =
        super::admin::child_link(tx, q, child)?
    else {
        return Ok(());
    };
    let Some(dep) = dep.filter(|d| d.status == DependencyStatus::Pending) else { return Ok(()) };
    let (status, value, release_now) = match end {
        ChildEnd::Completed(v) => (Some(DependencyStatus::Processed), Some(crate::model::as_text(v)), false),
        ChildEnd::Failed(reason) => match child.on_child_failure {
            OnChildFailure::Wait => {
                if tx.load_job(&pq, &parent.id)?.is_none() {
                    tx.delete(&dep_key)?;
                }
                return Ok(());
            }
            OnChildFailure::FailParent => (Some(DependencyStatus::Failed), Some(reason.into()), false),
            OnChildFailure::ContinueParent => (Some(DependencyStatus::Ignored), Some(reason.into()), true),
            OnChildFailure::Ignore => (Some(DependencyStatus::Ignored), Some(reason.into()), false),
            OnChildFailure::Remove => (None, None, false),
        },
    };
    let failed = status == Some(DependencyStatus::Failed);
    // The parent's record is read only when it is to move: most children end
    // with their parent still waiting for others.
    let counted = tx.count_children(&pq, &parent.id, |c| {
        c.pending = c.pending.saturating_sub(1);
        if failed {
            c.failed += 1;
        }
    })?;
    let Some(counts) = counted else {
        tx.delete(&dep_key)?;
        return Ok(());
    };
    match status {
        Some(status) => tx.put_record(&dep_key, &Dependency { status, value: value.map(Cow::into_owned), ..dep })?,
        None => tx.delete(&dep_key)?,
    }
    if failed {
        // failParentOnFailure, as BullMQ 6.7: the parent is marked with a
        // deferred failure and, if it was waiting (for children, or for a
        // delay, which ends now), released; the worker that claims it fails it, and the parent's
        // own policy carries the failure further up. A running parent is
        // refused completion (FailedChildren) instead.
        let mut pjob = tx.require_job(&pq, &parent.id)?;
        let reason = format!("child {child_key} failed");
        match pjob.state {
            // Released as when its children are done: after its own delay.
            JobState::WaitingChildren => {
                pjob.deferred_failure = Some(reason);
                release_parent(tx, &pq, pjob)?;
            }
            // Its delay is cut short.
            JobState::Delayed => {
                pjob.delay = 0;
                pjob.deferred_failure = Some(reason);
                let line = released_line(&pjob);
                lease::make_ready(tx, &pq, pjob, Some("delayed"), line)?;
            }
            JobState::Failed | JobState::Completed => {}
            _ => {
                pjob.deferred_failure = Some(reason);
                tx.save_job(&pq, &mut pjob)?;
            }
        }
        return Ok(());
    }
    if release_now || counts.pending == 0 {
        let pjob = tx.require_job(&pq, &parent.id)?;
        if pjob.state == JobState::WaitingChildren {
            release_parent(tx, &pq, pjob)?;
        }
    }
    Ok(())
}

/// A parent whose children are done runs next (Redis's `moveParentToWait`
/// RPUSHes it), or after its own delay. One with a priority goes behind the
/// jobs of its priority: Redis adds it to its band with a new counter. A
/// delayed parent whose child fails it is released the same way.
pub fn release_parent(tx: &mut Tx, q: &QueueId, job: JobRecord) -> Result<JobRecord, JobsError> {
    if job.delay > 0 {
        let due = tx.now.saturating_add(job.delay);
        return park_delayed(tx, q, job, due);
    }
    let line = released_line(&job);
    lease::make_ready(tx, q, job, Some("waiting-children"), line)
}

/// Where Redis's `moveParentToWait` puts a parent: next to run, or with a
/// priority behind the jobs of its priority.
fn released_line(parent: &JobRecord) -> Line {
    if parent.is_prioritized() { Line::Back } else { Line::Front }
}

fn send_to_dead_letter(tx: &mut Tx, q: &QueueId, job: &JobRecord, dlq: &str, reason: &str) -> Result<(), JobsError> {
    // Stores written before names were checked here may hold one no call can
    // reach: the failure is refused (the job stays where it is) instead.
    crate::model::validate_name("dead-letter queue", dlq, enqueue::MAX_NAME_BYTES)?;
    let target = QueueId::new(q.ns.clone(), dlq.to_string());
    let mut headers = job.headers.clone();
    headers.insert("x-dead-letter-queue".into(), q.name.clone());
    headers.insert("x-dead-letter-job".into(), job.id.clone());
    headers.insert("x-dead-letter-reason".into(), reason.to_string());
    enqueue::enqueue_copy(tx, &target, job, headers)?;
    Ok(())
}

/// BullMQ's per-minute metrics of finished jobs.
fn collect_metrics(tx: &mut Tx, q: &QueueId, kind: MetricsKind, max_points: Option<u64>) -> Result<(), JobsError> {
    let Some(max) = max_points.filter(|m| *m > 0).map(|m| m.min(MAX_METRICS_POINTS)) else { return Ok(()) };
    let keys = QueueKeys::new(q);
    let key = keys.metrics(kind);
    let mut rec: MetricsRecord = tx.get_record(&key)?.unwrap_or_default();
    let before = rec.count;
    rec.count += 1;
    if rec.prev_ts == 0 {
        rec.prev_ts = tx.now;
        rec.prev_count = 0;
    } else {
        let minutes = (tx.now / 60_000).saturating_sub(rec.prev_ts / 60_000).min(max);
        if minutes > 0 {
            let points_key = keys.metrics_points(kind);
            let mut points: VecDeque<u64> = match tx.get_record(&points_key)? {
                Some(points) => points,
                None => std::mem::take(&mut rec.data),
            };
            points.push_front(before.saturating_sub(rec.prev_count));
            for _ in 1..minutes {
                points.push_front(0);
            }
            points.truncate(max as usize);
            tx.put_record(&points_key, &points)?;
            rec.prev_count = before;
            rec.prev_ts = tx.now;
        }
    }
    tx.put_record(&key, &rec)
}
