//! Admin writes on queues and single jobs.

use std::collections::BTreeMap;

use crate::error::{JobsError, Precondition};
use crate::keys::{self, QueueId, QueueKeys};
use crate::kv::Key;
use crate::model::{
    self, DedupRecord, Dependency, DependencyStatus, Fence, Idempotency, JobRecord, JobState, LimiterWindow, ParentRef,
    Report,
};
use crate::ops::idempotency::CallHash;
use crate::ops::lease::{self, Line};
use crate::ops::{enqueue, idempotency, query};
use crate::tx::Tx;

/// Deletes a job's record, logs and dependency records; a return value it
/// lent to its `completed` event goes to the event. The caller has
/// already taken it out of its index. Its epoch stays behind as the queue's
/// floor, so a job added again under its id never hands out a lease epoch
/// (and default token) that a worker of the old one may still hold.
pub fn purge_job(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<(), JobsError> {
    tx.give_back_lent_value(q, job)?;
    if job.epoch > tx.stats(q)?.epoch_floor {
        tx.stats_mut(q)?.epoch_floor = job.epoch;
    }
    let keys = QueueKeys::new(q);
    tx.delete(&keys.job(&job.id))?;
    if job.children_counted {
        tx.delete(&keys.child_counts(&job.id))?;
    }
    if job.data_apart {
        tx.delete(&keys.job_data(&job.id))?;
    }
    tx.delete_range(&keys.logs(&job.id))?;
    tx.delete_range(&keys.dependencies(&job.id))?;
    Ok(())
}

/// A scheduler's iteration that has not started, which an upsert of the
/// scheduler replaces: gone without a `removed` event, as BullMQ's
/// addJobScheduler replaces it (its listeners hear of jobs removed by hand).
pub fn drop_replaced_iteration(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<(), JobsError> {
    drop_job(tx, q, job)
}

/// A delayed job that a debounced add replaces (deduplication with
/// `replace`), gone with a `removed` event. When the add that replaces it
/// joins the same parent, that parent is not released in between: it goes on
/// waiting, for the replacement.
pub fn remove_replaced(
    tx: &mut Tx,
    q: &QueueId,
    job: &JobRecord,
    successor_parent: Option<&model::ParentRef>,
) -> Result<(), JobsError> {
    if job.parent.is_some() && job.parent.as_ref() == successor_parent {
        unlink_pending_child(tx, q, job)?;
    } else {
        detach_from_parent(tx, q, job)?;
    }
    drop_detached(tx, q, job)?;
    removed_event(tx, q, job)?;
    Ok(())
}

/// Removes a job from everything: its index, its parent's pending children,
/// its dedup key, its record.
fn drop_job(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<(), JobsError> {
    detach_from_parent(tx, q, job)?;
    drop_detached(tx, q, job)
}

/// [`drop_job`] without the parent's side: for a job whose parent is going
/// too (unlinking it would release that parent to waiting just before its
/// own removal), or whose caller settles the parent itself.
fn drop_detached(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<(), JobsError> {
    tx.unindex(q, job)?;
    release_dedup_key(tx, q, job)?;
    purge_job(tx, q, job)
}

/// A removed child no longer holds up its parent; a parent left with no
/// pending child runs next.
pub(crate) fn detach_from_parent(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<bool, JobsError> {
    let (unlinked, idle_parent) = unlink_pending_child(tx, q, job)?;
    if let Some((pq, pjob)) = idle_parent {
        lease::make_ready(tx, &pq, pjob, Some("waiting-children"), Line::Front)?;
    }
    Ok(unlinked)
}

/// Takes `job` out of its parent's pending children. Only a pending child is
/// unlinked: a finished child's record (its value, or its failure) stays with
/// the parent, as in BullMQ. Returns whether it was unlinked, and the parent
/// when that left it waiting for children with none pending.
fn unlink_pending_child(
    tx: &mut Tx,
    q: &QueueId,
    job: &JobRecord,
) -> Result<(bool, Option<(QueueId, JobRecord)>), JobsError> {
    let Some(ChildLink { parent, parent_queue: pq, dep_key, dep, .. }) = child_link(tx, q, job)? else {
        return Ok((false, None));
    };
    if dep.is_none_or(|d| d.status != DependencyStatus::Pending) {
        return Ok((false, None));
    }
    tx.delete(&dep_key)?;
    let counted = tx.count_children(&pq, &parent.id, |c| c.pending = c.pending.saturating_sub(1))?;
    if counted.is_none_or(|c| c.pending > 0) {
        return Ok((true, None));
    }
    let pjob = tx.require_job(&pq, &parent.id)?;
    let idle = pjob.state == JobState::WaitingChildren;
    Ok((true, idle.then_some((pq, pjob))))
}

/// Where a child's dependency record lies under its parent, and the record,
/// when it is that child's (see [`Dependency::is_of`]).
pub(crate) struct ChildLink<'a> {
    pub parent: &'a ParentRef,
    pub parent_queue: QueueId,
    /// The child's node key, `<prefix>:<queue>:<id>`.
    pub child_key: String,
    pub dep_key: Key,
    pub dep: Option<Dependency>,
}

/// `child`'s link to its parent (see [`ChildLink`]); None for a job with no parent.
pub(crate) fn child_link<'a>(
    tx: &mut Tx,
    q: &QueueId,
    child: &'a JobRecord,
) -> Result<Option<ChildLink<'a>>, JobsError> {
    let Some(parent) = &child.parent else { return Ok(None) };
    let parent_queue = QueueId::new(tx.ns.clone(), parent.queue.clone());
    let child_key = model::node_key(&parent.prefix, &q.name, &child.id);
    let dep_key = QueueKeys::new(&parent_queue).dependency(&parent.id, &child_key);
    let dep = tx.get_record::<Dependency>(&dep_key)?.filter(|d| d.is_of(&q.name, &child.id));
    Ok(Some(ChildLink { parent, parent_queue, child_key, dep_key, dep }))
}

fn release_dedup_key(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<(), JobsError> {
    let Some(d) = &job.dedup else { return Ok(()) };
    let key = QueueKeys::new(q).dedup(&d.id);
    if tx.get_record::<DedupRecord>(&key)?.is_some_and(|r| r.holder() == Some(job.id.as_str())) {
        tx.delete(&key)?;
    }
    Ok(())
}

/// Removes a job as drain and clean do (BullMQ's hard removal): when it was
/// its parent's last pending child, a parent in the same queue is removed too
/// (and so on upwards); a parent in another queue is released without an event.
fn drop_job_hard(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<(), JobsError> {
    let mut next = drop_one_hard(tx, q, job)?;
    while let Some(parent) = next {
        next = drop_one_hard(tx, q, &parent)?;
    }
    Ok(())
}

/// One step of [`drop_job_hard`]: returns the parent in the same queue that
/// is to go next (a loop, not recursion: a chain of parents may be long).
fn drop_one_hard(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<Option<JobRecord>, JobsError> {
    drop_detached(tx, q, job)?;
    release_parent_of_purged(tx, q, job)
}

/// Unlinks a purged job from its parent. A parent in another queue left with
/// no pending child runs next; one in the same queue is returned to the
/// caller, which is removing that queue's jobs.
fn release_parent_of_purged(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<Option<JobRecord>, JobsError> {
    match unlink_pending_child(tx, q, job)? {
        (_, Some((pq, pjob))) if pq == *q => Ok(Some(pjob)),
        (_, Some((pq, pjob))) => {
            lease::make_ready(tx, &pq, pjob, None, Line::Front)?;
            Ok(None)
        }
        (_, None) => Ok(None),
    }
}

/// The `removed` event of `job`, with the state it left.
fn removed_event(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<u64, JobsError> {
    tx.event(q, "removed", &[("jobId", &job.id), ("prev", removed_prev(job.state))])
}

/// BullMQ's name of a state in `removed` events (`wait`, not `waiting`).
fn removed_prev(state: JobState) -> &'static str {
    match state {
        JobState::Waiting => "wait",
        s => s.as_str(),
    }
}

/// Whether a job is the pending iteration of a scheduler.
fn is_scheduler_iteration(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<bool, JobsError> {
    let Some(sid) = &job.scheduler_id else { return Ok(false) };
    let rec: Option<model::SchedulerRecord> = tx.get_record(&QueueKeys::new(q).scheduler(sid))?;
    Ok(rec.is_some_and(|r| r.next_job_id.as_deref() == Some(job.id.as_str())))
}

fn children(tx: &mut Tx, q: &QueueId, id: &str) -> Result<Vec<(QueueId, Dependency)>, JobsError> {
    let deps = tx.scan(&QueueKeys::new(q).dependencies(id), usize::MAX, false)?;
    let ns = tx.ns.clone();
    deps.into_iter()
        .map(|(_, v)| {
            let dep: Dependency = model::decode(&v)?;
            Ok((QueueId::new(ns.clone(), dep.child_queue.clone()), dep))
        })
        .collect()
}

/// Whether a job or, with `with_children`, a descendant holds a live lease
/// (an expired one, not yet swept, is no lock, as in BullMQ). The tree is
/// walked with a list, not recursion, and each job once: a tree may be deep.
fn locked(tx: &mut Tx, q: &QueueId, job: &JobRecord, with_children: bool) -> Result<bool, JobsError> {
    let leased = |tx: &Tx, job: &JobRecord| {
        job.state == JobState::Active && job.lock.as_ref().is_some_and(|l| l.deadline > tx.lease_now)
    };
    if leased(tx, job) {
        return Ok(true);
    }
    if !with_children {
        return Ok(false);
    }
    let mut seen = std::collections::HashSet::from([(q.clone(), job.id.clone())]);
    let mut parents = vec![(q.clone(), job.id.clone())];
    while let Some((pq, id)) = parents.pop() {
        for (cq, dep) in children(tx, &pq, &id)? {
            if !seen.insert((cq.clone(), dep.child_id.clone())) {
                continue;
            }
            if let Some(child) = tx.load_job(&cq, &dep.child_id)? {
                if leased(tx, &child) {
                    return Ok(true);
                }
                parents.push((cq, child.id));
            }
        }
    }
    Ok(false)
}

/// Removes a job (and with `remove_children` its whole subtree). Returns false,
/// removing nothing, when the job or a descendant is leased.
pub fn remove_job(tx: &mut Tx, q: &QueueId, id: &str, remove_children: bool) -> Result<bool, JobsError> {
    let Some(job) = tx.load_job(q, id)? else { return Ok(true) };
    if is_scheduler_iteration(tx, q, &job)? {
        return Err(JobsError::Precondition(Precondition::BelongsToScheduler { job: id.to_string() }));
    }
    if locked(tx, q, &job, remove_children)? {
        return Ok(false);
    }
    remove_tree(tx, q, job, remove_children)?;
    Ok(true)
}

fn remove_tree(tx: &mut Tx, q: &QueueId, job: JobRecord, remove_children: bool) -> Result<(), JobsError> {
    let children = if remove_children { children(tx, q, &job.id)? } else { Vec::new() };
    drop_job(tx, q, &job)?;
    removed_event(tx, q, &job)?;
    remove_descendants_of(tx, children)
}

/// Removes the subtree under a job that is itself being removed, depth
/// first, each child before its own children (with a list, not recursion: a
/// tree may be deep). The children are read before the job's dependency
/// records go (see [`purge_job`]); a job already removed is not found again.
fn remove_descendants_of(tx: &mut Tx, mut children: Vec<(QueueId, Dependency)>) -> Result<(), JobsError> {
    children.reverse();
    while let Some((cq, dep)) = children.pop() {
        if let Some(child) = tx.load_job(&cq, &dep.child_id)? {
            let grandchildren = self::children(tx, &cq, &child.id)?;
            drop_detached(tx, &cq, &child)?;
            removed_event(tx, &cq, &child)?;
            children.extend(grandchildren.into_iter().rev());
        }
    }
    Ok(())
}

/// Removes a job's unprocessed children as BullMQ does: each pending child
/// with its own pending descendants, depth first, skipping a leased or failed
/// job and what is under it. A leased job below a child that goes stays,
/// without that parent (its end then finds none to tell).
pub fn remove_unprocessed_children(tx: &mut Tx, q: &QueueId, id: &str) -> Result<(), JobsError> {
    for (cq, child) in unprocessed_children(tx, q, id)? {
        // Its pending descendants go before it, each after its own (a list,
        // not recursion: a tree may be deep).
        let mut below = Vec::new();
        let mut pending = unprocessed_children(tx, &cq, &child.id)?;
        while let Some((jq, job)) = pending.pop() {
            pending.extend(unprocessed_children(tx, &jq, &job.id)?);
            below.push((jq, job));
        }
        for (jq, job) in below.into_iter().rev() {
            // Its parent goes too: unlinking it would release that parent.
            drop_detached(tx, &jq, &job)?;
            removed_event(tx, &jq, &job)?;
        }
        drop_job(tx, &cq, &child)?;
        removed_event(tx, &cq, &child)?;
    }
    Ok(())
}

/// A job's pending children that may be removed: neither leased nor failed.
fn unprocessed_children(tx: &mut Tx, q: &QueueId, id: &str) -> Result<Vec<(QueueId, JobRecord)>, JobsError> {
    let mut out = Vec::new();
    for (cq, dep) in children(tx, q, id)? {
        if dep.status != DependencyStatus::Pending {
            continue;
        }
        if let Some(child) = tx.load_job(&cq, &dep.child_id)?
            && child.state != JobState::Failed
            && !locked(tx, &cq, &child, false)?
        {
            out.push((cq, child));
        }
    }
    Ok(out)
}

pub fn set_paused(tx: &mut Tx, q: &QueueId, paused: bool) -> Result<(), JobsError> {
    let key = QueueKeys::new(q).meta("paused");
    tx.forget_queue(q);
    if paused {
        tx.put(&key, b"1".to_vec())?;
        tx.event(q, "paused", &[])?;
    } else {
        tx.delete(&key)?;
        tx.event(q, "resumed", &[])?;
        tx.effects.wake_jobs.insert(q.clone());
    }
    Ok(())
}

/// Ids of the jobs listed in one state's index, oldest first.
fn ids_in(tx: &mut Tx, range: &crate::kv::KeyRange, limit: usize) -> Result<Vec<String>, JobsError> {
    Ok(tx.scan(range, limit, false)?.into_iter().map(|(_, v)| String::from_utf8_lossy(&v).into_owned()).collect())
}

/// Removes every waiting job, and the delayed ones when asked; scheduler
/// iterations stay.
pub fn drain(tx: &mut Tx, q: &QueueId, delayed: bool) -> Result<u64, JobsError> {
    let keys = QueueKeys::new(q);
    // In Redis's order, which decides where the parents they release in other
    // queues go (each to the front of its queue, so the last released runs
    // first): its wait list from the job to run last, then its sets in order.
    let mut ranges = vec![(keys.waiting_band(false), true), (keys.waiting_band(true), false)];
    if delayed {
        ranges.push((keys.delayed_all(), false));
    }
    let mut n = 0;
    for (range, last_first) in ranges {
        let mut ids = ids_in(tx, &range, usize::MAX)?;
        if last_first {
            ids.reverse();
        }
        for id in ids {
            // A parent removed with its last child earlier in this loop.
            let Some(job) = tx.load_job(q, &id)? else { continue };
            if !is_scheduler_iteration(tx, q, &job)? {
                drop_job_hard(tx, q, &job)?;
                n += 1;
            }
        }
    }
    Ok(n)
}

/// Removes up to `limit` jobs (0 = no limit) of `state` that finished, or
/// were created, at or before `before`. Emits one `cleaned` event.
pub fn clean(tx: &mut Tx, q: &QueueId, state: &str, before: u64, limit: u64) -> Result<Vec<String>, JobsError> {
    let keys = QueueKeys::new(q);
    let limit = if limit == 0 { usize::MAX } else { limit as usize };
    let state = match state {
        // BullMQ 6 keeps a paused queue's jobs in `wait`; its `paused` list,
        // which Redis cleans here, is always empty.
        "paused" => {
            tx.event(q, "cleaned", &[("count", "0")])?;
            return Ok(Vec::new());
        }
        other => {
            JobState::parse(other).ok_or_else(|| JobsError::invalid(format!("cannot clean unknown state {other:?}")))?
        }
    };
    let range = query::state_range(&keys, state);
    // The finished and waiting-children indexes are ordered by the stamp
    // compared with `before`.
    let by_score = matches!(state, JobState::Completed | JobState::Failed | JobState::WaitingChildren);
    // Redis keeps these two as lists, newest first: it removes in list order
    // (which decides where the parents the removals release in other queues
    // go: each to the front of its queue) and answers in it. The scan below
    // goes oldest first, as `limit` counts from the oldest, so their jobs are
    // picked first and removed after it, newest first. (Active jobs are
    // ordered by lock deadline here, by start on Redis.)
    let newest_first = matches!(state, JobState::Waiting | JobState::Active);
    let mut removed = Vec::new();
    let mut picked = Vec::new();
    let mut cursor = range.clone();
    'scan: loop {
        let chunk = tx.scan(&cursor, 512, false)?;
        let Some((last, _)) = chunk.last() else { break };
        cursor.start = keys::prefix_end(last);
        for (_, id) in chunk {
            if removed.len() + picked.len() >= limit {
                break 'scan;
            }
            let id = String::from_utf8_lossy(&id).into_owned();
            // A parent removed with its last child earlier in this loop.
            let Some(job) = tx.load_job(q, &id)? else { continue };
            let stamp = if by_score {
                job.finished_on.unwrap_or(job.timestamp)
            } else {
                job.finished_on.or(job.processed_on).unwrap_or(job.timestamp)
            };
            if stamp > before {
                if by_score {
                    break 'scan; // the index is ordered by this stamp
                }
                continue;
            }
            let leased = job.lock.as_ref().is_some_and(|l| l.deadline > tx.lease_now);
            if leased || is_scheduler_iteration(tx, q, &job)? {
                continue;
            }
            if newest_first {
                picked.push(id);
                continue;
            }
            drop_job_hard(tx, q, &job)?;
            removed.push(id);
        }
    }
    for id in picked.into_iter().rev() {
        // A job removed with another one picked before it stays removed.
        let Some(job) = tx.load_job(q, &id)? else { continue };
        drop_job_hard(tx, q, &job)?;
        removed.push(id);
    }
    tx.event(q, "cleaned", &[("count", &removed.len().to_string())])?;
    Ok(removed)
}

/// The most jobs one call of a chunked admin write ([`obliterate`],
/// [`retry_finished_jobs`], [`promote_jobs`]: each says whether more remain,
/// and BullMQ calls again) takes on, whatever count it is given. Each call is
/// one transaction, which every other write to the store waits behind: asked
/// for "all" of a million jobs, one obliterate held every write (through a
/// server, every tenant's) for minutes.
pub const MAX_JOBS_PER_CHUNK: u64 = 10_000;

/// A chunked admin write's count: at least 1, at most [`MAX_JOBS_PER_CHUNK`].
fn chunk(count: u64) -> u64 {
    count.clamp(1, MAX_JOBS_PER_CHUNK)
}

/// Destroys a paused queue, `count` jobs per call (see [`MAX_JOBS_PER_CHUNK`]).
/// Returns true when more remain (call again), false once everything is gone.
pub fn obliterate(tx: &mut Tx, q: &QueueId, force: bool, count: u64) -> Result<bool, JobsError> {
    if !tx.is_paused(q)? {
        return Err(JobsError::Precondition(Precondition::QueueNotPaused { queue: q.name.clone() }));
    }
    if !force && tx.stats(q)?.active > 0 {
        return Err(JobsError::Precondition(Precondition::QueueHasActiveJobs { queue: q.name.clone() }));
    }
    let keys = QueueKeys::new(q);
    let budget = chunk(count) as usize;
    let jobs = tx.scan(&keys.jobs(), budget, false)?;
    for (_, v) in &jobs {
        let job: JobRecord = model::decode(v)?;
        tx.unindex(q, &job)?;
        purge_job(tx, q, &job)?;
        // A parent in another queue stops waiting for it, as on Redis; one
        // in this queue goes with it.
        release_parent_of_purged(tx, q, &job)?;
    }
    if jobs.len() == budget {
        return Ok(true);
    }
    // The counters go with the queue (the ids start from 1 again), but for
    // what outlives it, `QueueRemains`.
    let remains = model::QueueRemains::of(tx.stats(q)?);
    tx.delete_range(&keys.all())?;
    tx.delete(&keys::registry(q))?;
    if remains != model::QueueRemains::default() {
        tx.put_record(&keys::queue_remains(q), &remains)?;
    }
    tx.drop_queue(q);
    Ok(false)
}

/// `job.retry()`: a finished job runs again. `from` is the state it finished
/// in, completed or failed; any other is refused, since a job in it is still
/// on its way (an active one is a worker's).
pub fn retry_finished(
    tx: &mut Tx,
    q: &QueueId,
    id: &str,
    from: JobState,
    reset_attempts_made: bool,
    reset_attempts_started: bool,
) -> Result<(), JobsError> {
    if !from.is_finished() {
        return Err(JobsError::invalid(format!("only completed or failed jobs can be retried, not {from}")));
    }
    let mut job = tx.require_job(q, id)?;
    if job.state != from {
        return Err(JobsError::not_in_state(id, job.state, from));
    }
    reattach_to_parent(tx, q, &job)?;
    tx.unindex(q, &job)?; // before the finish time that names its index entry is cleared
    forget_finish(tx, q, &mut job, from)?;
    if reset_attempts_made {
        job.attempts_made = 0;
    }
    if reset_attempts_started {
        job.attempts_started = 0;
    }
    lease::requeue(tx, q, job, Some(from.as_str()), Line::Back)?;
    Ok(())
}

/// Clears what a finished job's end in `state` recorded, before it runs again:
/// its times and the result of that state only. A completed job that had
/// failed an attempt first keeps that attempt's reason, as BullMQ's scripts
/// delete only the finished state's own field.
fn forget_finish(tx: &mut Tx, q: &QueueId, job: &mut JobRecord, state: JobState) -> Result<(), JobsError> {
    job.finished_on = None;
    job.processed_on = None;
    match state {
        JobState::Completed => {
            tx.give_back_lent_value(q, job)?;
            (job.return_value, job.return_value_event) = (None, None);
        }
        _ => job.failed_reason = None,
    }
    Ok(())
}

/// A child that runs again is pending for its parent again, if its parent
/// still lists it: one whose dependency was removed (removeDependencyOnFailure,
/// removeChildDependency) is not its parent's any more, and Redis's
/// `moveChildBackToParentDependencies` leaves it out too (the parent was
/// held for it again).
fn reattach_to_parent(tx: &mut Tx, q: &QueueId, job: &JobRecord) -> Result<(), JobsError> {
    let Some(ChildLink { parent, parent_queue: pq, dep_key, dep, .. }) = child_link(tx, q, job)? else {
        return Ok(());
    };
    let previous = match dep {
        Some(d) if d.status != DependencyStatus::Pending => d.status,
        _ => return Ok(()),
    };
    let counted = tx.count_children(&pq, &parent.id, |c| {
        if previous == DependencyStatus::Failed {
            c.failed = c.failed.saturating_sub(1);
        }
        c.pending += 1;
    })?;
    if counted.is_some() {
        let dep = Dependency {
            status: DependencyStatus::Pending,
            child_queue: q.name.clone(),
            child_id: job.id.clone(),
            value: None,
        };
        tx.put_record(&dep_key, &dep)?;
    }
    Ok(())
}

/// `queue.retryJobs`: up to `count` finished jobs of `state` finished at or
/// before `before` go back to waiting. True when `count` were moved (more may remain).
pub fn retry_finished_jobs(
    tx: &mut Tx,
    q: &QueueId,
    state: JobState,
    count: u64,
    before: u64,
) -> Result<bool, JobsError> {
    if !state.is_finished() {
        return Err(JobsError::invalid(format!("cannot retry jobs that are {state}")));
    }
    let range = query::state_range(&QueueKeys::new(q), state);
    let count = chunk(count);
    let ids = ids_in(tx, &range, count as usize)?;
    let mut moved = 0;
    for id in ids {
        let mut job = tx.require_job(q, &id)?;
        if job.finished_on.is_some_and(|f| f > before) {
            break;
        }
        reattach_to_parent(tx, q, &job)?;
        tx.unindex(q, &job)?;
        forget_finish(tx, q, &mut job, state)?;
        lease::requeue(tx, q, job, Some(state.as_str()), Line::Back)?;
        moved += 1;
    }
    Ok(moved == count)
}

pub fn promote(tx: &mut Tx, q: &QueueId, id: &str) -> Result<(), JobsError> {
    let job = tx.require_job(q, id)?;
    if job.state != JobState::Delayed {
        return Err(JobsError::not_in_state(id, job.state, JobState::Delayed));
    }
    lease::make_ready(tx, q, job, Some("delayed"), Line::Promoted)?;
    Ok(())
}

/// `queue.promoteJobs`: up to `count` delayed jobs become ready (see
/// [`MAX_JOBS_PER_CHUNK`]). True when that many were moved.
pub fn promote_jobs(tx: &mut Tx, q: &QueueId, count: u64) -> Result<bool, JobsError> {
    let count = chunk(count);
    let ids = ids_in(tx, &QueueKeys::new(q).delayed_all(), count as usize)?;
    let moved = ids.len() as u64;
    for id in ids {
        let job = tx.require_job(q, &id)?;
        let delay = job.delay;
        let mut job = lease::make_ready(tx, q, job, Some("delayed"), Line::Promoted)?;
        // Redis's moveJobsToWait leaves a job's `delay` as it was, where a
        // job's own promotion and a due one set it to 0.
        if job.delay != delay {
            job.delay = delay;
            tx.save_job(q, &mut job)?;
        }
    }
    Ok(moved == count)
}

pub fn change_delay(tx: &mut Tx, q: &QueueId, id: &str, delay_ms: u64) -> Result<(), JobsError> {
    let mut job = tx.require_job(q, id)?;
    if job.state != JobState::Delayed {
        return Err(JobsError::not_in_state(id, job.state, JobState::Delayed));
    }
    tx.unindex(q, &job)?;
    job.delay = delay_ms;
    job.due = tx.now.saturating_add(delay_ms);
    tx.index(q, &job)?;
    tx.save_job(q, &mut job)?;
    tx.event(q, "delayed", &[("jobId", id), ("delay", &job.due.to_string())])?;
    Ok(())
}

pub fn change_priority(tx: &mut Tx, q: &QueueId, id: &str, priority: u32, lifo: bool) -> Result<(), JobsError> {
    if priority > model::MAX_PRIORITY {
        return Err(JobsError::invalid(format!("priority must be between 0 and {}", model::MAX_PRIORITY)));
    }
    let mut job = tx.require_job(q, id)?;
    let ready = matches!(job.state, JobState::Waiting | JobState::Prioritized);
    if ready {
        tx.unindex(q, &job)?;
    }
    job.priority = priority;
    if ready {
        job.seq = tx.next_seq(q, lifo)?;
        job.state = Tx::ready_state(&job);
        tx.index(q, &job)?;
    }
    tx.save_job(q, &mut job)
}

pub fn update_data(tx: &mut Tx, q: &QueueId, id: &str, fence: &Fence, data: Vec<u8>) -> Result<(), JobsError> {
    tx.check_payload(data.len())?;
    let mut job = tx.require_job(q, id)?;
    lease::check_fence(&job, fence)?;
    job.set_data(data);
    tx.save_job(q, &mut job)
}

/// Applies `report` to job `id`; returns the log lines kept (0 for progress
/// and data). Sent again under `idem`, it is not applied again and answers
/// what it first did (see [`idempotency`]).
pub fn report(
    tx: &mut Tx,
    q: &QueueId,
    id: &str,
    fence: &Fence,
    report: Report,
    idem: Option<&Idempotency>,
) -> Result<u64, JobsError> {
    let keyed = idem.map(|idem| (idem, CallHash::of(idempotency::hash_of(&("report", id, fence, &report)))));
    if let Some((idem, hash)) = keyed
        && let Some(rec) = idempotency::recall(tx, q, idem, hash, None)?
    {
        return rec.log_count.ok_or_else(|| JobsError::IdempotencyConflict { key: idem.key.clone() });
    }
    let log_count = match report {
        Report::Progress(progress) => update_progress(tx, q, id, fence, progress).map(|()| 0),
        Report::Log { row, keep } => add_log(tx, q, id, fence, row, keep),
        Report::Data(data) => update_data(tx, q, id, fence, data).map(|()| 0),
    }?;
    if let Some((idem, hash)) = keyed {
        let answer = idempotency::Answer { log_count: Some(log_count), ..Default::default() };
        idempotency::remember(tx, q, idem, hash, id, answer)?;
    }
    Ok(log_count)
}

/// Sets a job's progress (JSON text) and emits `progress`.
pub fn update_progress(tx: &mut Tx, q: &QueueId, id: &str, fence: &Fence, progress: String) -> Result<(), JobsError> {
    tx.check_payload(progress.len())?;
    let mut job = tx.require_job(q, id)?;
    lease::check_fence(&job, fence)?;
    tx.event(q, "progress", &[("jobId", id), ("data", &progress)])?;
    job.progress = Some(progress);
    tx.save_job(q, &mut job)
}

/// Appends a log line, keeping the newest `keep` (or the job's `keepLogs`, or
/// the core's cap). Returns the number of lines kept.
pub fn add_log(
    tx: &mut Tx,
    q: &QueueId,
    id: &str,
    fence: &Fence,
    row: String,
    keep: Option<u64>,
) -> Result<u64, JobsError> {
    tx.check_payload(row.len())?;
    let mut job = tx.require_job(q, id)?;
    lease::check_fence(&job, fence)?;
    let keys = QueueKeys::new(q);
    tx.put(&keys.log(id, job.log_seq), row.into_bytes())?;
    job.log_seq += 1;
    job.log_count += 1;
    let cap = keep.or(job.keep_logs).unwrap_or(tx.config.max_logs_per_job);
    trim_logs(tx, &keys, &mut job, cap)?;
    tx.save_job(q, &mut job)?;
    Ok(job.log_count)
}

fn trim_logs(tx: &mut Tx, keys: &QueueKeys, job: &mut JobRecord, keep: u64) -> Result<(), JobsError> {
    let excess = job.log_count.saturating_sub(keep);
    if excess > 0 {
        for (k, _) in tx.scan(&keys.logs(&job.id), excess as usize, false)? {
            tx.delete(&k)?;
        }
        job.log_count -= excess;
    }
    Ok(())
}

pub fn clear_logs(tx: &mut Tx, q: &QueueId, id: &str, keep: Option<u64>) -> Result<(), JobsError> {
    let Some(mut job) = tx.load_job(q, id)? else { return Ok(()) };
    let keys = QueueKeys::new(q);
    trim_logs(tx, &keys, &mut job, keep.unwrap_or(0))?;
    tx.save_job(q, &mut job)
}

/// `job.removeChildDependency()`: detaches the job from the parent BullMQ
/// names by its node key; false when it was not that parent's pending child.
/// As Redis's script: a missing job is an error, then a missing parent (BullMQ
/// passes the job's `parentKey`, empty when it has none), and only then a
/// parent that is not this job's is `false`.
pub fn remove_child_dependency(tx: &mut Tx, q: &QueueId, id: &str, parent_key: &str) -> Result<bool, JobsError> {
    let mut job = tx.require_job(q, id)?;
    if parent_key.is_empty() {
        return Err(JobsError::NotFound(crate::error::Missing::ParentJob(String::new())));
    }
    let Some(parent) = job.parent.clone() else { return Ok(false) };
    if parent.node_key() != parent_key {
        return Ok(false);
    }
    let pq = QueueId::new(tx.ns.clone(), parent.queue.clone());
    if tx.load_job(&pq, &parent.id)?.is_none() {
        return Err(JobsError::NotFound(crate::error::Missing::ParentJob(parent_key.to_string())));
    }
    if !detach_from_parent(tx, q, &job)? {
        return Ok(false);
    }
    job.parent = None;
    tx.save_job(q, &mut job)?;
    Ok(true)
}

/// The meta fields the store reads as limits (global concurrency and rate
/// limit), and the call that sets each. (The events log's length is not
/// refused: BullMQ sets it with the queue's version as each `Queue` starts,
/// and swallows a refusal; one that is not a count keeps the default.)
const LIMIT_FIELDS: [(&str, &str); 3] =
    [("concurrency", "setGlobalConcurrency"), ("max", "setGlobalRateLimit"), ("duration", "setGlobalRateLimit")];

/// Sets meta fields; returns how many were new. A limit must be a
/// whole number, 0 or more: Redis stores anything, and then a global
/// concurrency of -1 holds every job back for ever, and one of 1.5 lets two
/// run.
pub fn set_meta(tx: &mut Tx, q: &QueueId, values: &BTreeMap<String, String>) -> Result<u64, JobsError> {
    let keys = QueueKeys::new(q);
    tx.check_payload(values.iter().map(|(k, v)| k.len() + v.len()).sum())?;
    for (field, setter) in LIMIT_FIELDS {
        if let Some(value) = values.get(field)
            && crate::tx::meta_count(value).is_none()
        {
            return Err(JobsError::invalid(format!(
                "{field} ({setter}) must be a whole number, 0 or more; got {value:?}"
            )));
        }
    }
    let mut new = 0;
    for (field, value) in values {
        let key = keys.meta(field);
        if tx.get(&key)?.is_none() {
            new += 1;
        }
        tx.put(&key, value.as_bytes().to_vec())?;
    }
    tx.forget_queue(q);
    // A raised global concurrency (or any setting a waiting worker was held
    // back by) may let a worker waiting on a maxed queue take a job now.
    tx.effects.wake_jobs.insert(q.clone());
    Ok(new)
}

pub fn remove_meta_fields(tx: &mut Tx, q: &QueueId, fields: &[String]) -> Result<u64, JobsError> {
    let keys = QueueKeys::new(q);
    let mut n = 0;
    for field in fields {
        let key = keys.meta(field);
        if tx.get(&key)?.is_some() {
            tx.delete(&key)?;
            n += 1;
        }
    }
    tx.forget_queue(q);
    if n > 0 {
        // A global concurrency removed: as in `set_meta`.
        tx.effects.wake_jobs.insert(q.clone());
    }
    Ok(n)
}

/// `queue.rateLimit(ms)`: the limiter refuses every job for `ms`.
pub fn set_rate_limit(tx: &mut Tx, q: &QueueId, ms: u64) -> Result<(), JobsError> {
    let window = LimiterWindow { count: u64::MAX, window_end: tx.ttl_now().saturating_add(ms) };
    tx.put_record(&QueueKeys::new(q).limiter(), &window)
}

pub fn remove_rate_limit_key(tx: &mut Tx, q: &QueueId) -> Result<u64, JobsError> {
    let key = QueueKeys::new(q).limiter();
    let existed = tx.get(&key)?.is_some();
    tx.delete(&key)?;
    if existed {
        // Workers waiting out the limit may take jobs now.
        tx.effects.wake_jobs.insert(q.clone());
    }
    Ok(u64::from(existed))
}

/// Deletes a dedup key if it still points at `job_id` (or unconditionally
/// when `job_id` is None). Returns 1 if a key was deleted. An add kept by
/// `keepLastIfActive` stays, to be made when a job of the id finishes: Redis
/// deletes the key alone.
pub fn remove_dedup_key(tx: &mut Tx, q: &QueueId, dedup_id: &str, job_id: Option<&str>) -> Result<u64, JobsError> {
    let key = QueueKeys::new(q).dedup(dedup_id);
    let Some(mut rec) = tx.get_record::<DedupRecord>(&key)?.filter(|r| !r.key_removed) else { return Ok(0) };
    let live = match tx.load_job(q, &rec.job_id)? {
        Some(job) => rec.is_live(&job, tx.ttl_now()),
        None => rec.expires_at.is_none_or(|e| e > tx.ttl_now()),
    };
    // An expired key is gone already (a Redis key past its TTL): nothing to remove.
    if !live || job_id.is_some_and(|j| j != rec.job_id) {
        return Ok(0);
    }
    if rec.next.is_some() {
        rec.key_removed = true;
        tx.put_record(&key, &rec)?;
    } else {
        tx.delete(&key)?;
    }
    Ok(1)
}

/// A caller's own event (BullMQ's QueueEventsProducer); trims to `max`.
pub fn publish_event(
    tx: &mut Tx,
    q: &QueueId,
    name: &str,
    fields: &[(String, String)],
    max: u64,
) -> Result<String, JobsError> {
    tx.check_payload(name.len() + fields.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>())?;
    let fields: Vec<(&str, &str)> = fields.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let seq = tx.event(q, name, &fields)?;
    tx.trim_events(q, max)?;
    Ok(crate::model::Event::id_of(tx.now, seq))
}

/// Moves up to `limit` dead-lettered jobs of `dlq` back to the queues they
/// came from. Returns how many moved.
pub fn redrive_dead_letters(tx: &mut Tx, dlq: &QueueId, limit: u64) -> Result<u64, JobsError> {
    let ids = ids_in(tx, &QueueKeys::new(dlq).waiting_all(), limit.max(1) as usize)?;
    let mut moved = 0;
    for id in ids {
        let job = tx.require_job(dlq, &id)?;
        let Some(origin) = job.headers.get("x-dead-letter-queue").cloned() else { continue };
        let mut headers = job.headers.clone();
        headers.retain(|k, _| !k.starts_with("x-dead-letter-"));
        enqueue::enqueue_copy(tx, &QueueId::new(dlq.ns.clone(), origin), &job, headers)?;
        drop_job(tx, dlq, &job)?;
        moved += 1;
    }
    Ok(moved)
}
