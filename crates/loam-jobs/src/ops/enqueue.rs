//! Adding jobs: one job, many, or a whole flow tree, each in one transaction.

use crate::error::{JobsError, Missing, Precondition};
use crate::keys::{QueueId, QueueKeys};
use crate::model::{
    self, BulkAdded, DedupRecord, Dependency, DependencyStatus, EnqueueRequest, Enqueued, Idempotency, JobRecord,
    JobState, MAX_PRIORITY, ParentRef, validate_name,
};
use crate::ops::idempotency::{self, CallHash};
use crate::tx::Tx;

/// Longest job name, job id, dedup id or idempotency key, in bytes.
pub const MAX_NAME_BYTES: usize = 1024;

pub fn validate(tx: &Tx, req: &EnqueueRequest) -> Result<(), JobsError> {
    if req.name.len() > MAX_NAME_BYTES {
        return Err(JobsError::invalid(format!("job name is over {MAX_NAME_BYTES} bytes")));
    }
    if let Some(id) = &req.job_id {
        validate_name("job id", id, MAX_NAME_BYTES)?;
    }
    let headers: usize = req.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    tx.check_payload(req.data.len() + req.opts.len() + headers)?;
    if req.priority > MAX_PRIORITY {
        return Err(JobsError::invalid(format!("priority must be between 0 and {MAX_PRIORITY}")));
    }
    if let Some(d) = &req.dedup {
        validate_name("deduplication id", &d.id, MAX_NAME_BYTES)?;
    }
    if req.parent.is_some() && req.dedup.as_ref().is_some_and(|d| d.keep_last_if_active) {
        return Err(JobsError::invalid("keepLastIfActive cannot be used on a job with a parent"));
    }
    if let Some(dl) = &req.dead_letter {
        validate_name("dead-letter queue", dl, MAX_NAME_BYTES)?;
    }
    Ok(())
}

/// Whether `id` reads as an integer that prints back the same (`"7"`,
/// `"-2"`, not `"07"`): BullMQ's test for "Custom Id cannot be integers".
/// A job added without an id takes the queue's next number as its id, so a
/// custom id of that form could take a number's place (the later job with
/// that number would overwrite it) or stand in for another job.
fn is_integer_text(id: &str) -> bool {
    let digits = id.strip_prefix('-').unwrap_or(id);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && (!digits.starts_with('0') || id == "0")
}

/// What an idempotency key's repeats must agree on: the whole request, its
/// key taken out (version 1). Version 0 ([`request_hash_0`]) covered the
/// name, payload, options, delay and priority only, so a key reused for
/// another job id, parent or attempts answered the first job instead of a
/// conflict, and a parent never got the child its caller was told was added.
fn request_hash(req: &EnqueueRequest) -> CallHash {
    debug_assert!(req.idempotency.is_none(), "the key is not part of the request");
    CallHash { hash: idempotency::hash_of(req), version: 1 }
}

/// An add's hash as version 0 made it, for its records from before version 1.
fn request_hash_0(req: &EnqueueRequest) -> u64 {
    idempotency::hash_of(&(&req.name, serde_bytes::Bytes::new(&req.data), &req.opts, req.delay_ms, req.priority))
}

/// What the caller wants done with a new job's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Waiting, prioritized or delayed, by its options.
    Normal,
    /// A flow parent: waits for the children that are added with it.
    WaitChildren,
}

/// Enqueues a fresh copy of `job` on `q` under `headers`: its name, payload,
/// options, attempts, backoff and priority, as a new job with a new id (a
/// job moved into a dead-letter queue, and back out of it).
pub fn enqueue_copy(
    tx: &mut Tx,
    q: &QueueId,
    job: &JobRecord,
    headers: std::collections::BTreeMap<String, String>,
) -> Result<Enqueued, JobsError> {
    let req = EnqueueRequest {
        name: job.name.clone(),
        data: job.data.clone(),
        opts: job.opts.clone(),
        headers,
        attempts: job.attempts,
        backoff: job.backoff.clone(),
        priority: job.priority,
        ..Default::default()
    };
    enqueue(tx, q, req, Placement::Normal)
}

/// Every refusal comes before the first write: `Jobs::enqueue_bulk` runs its
/// items on one transaction, and a refused item must leave nothing behind.
pub fn enqueue(tx: &mut Tx, q: &QueueId, req: EnqueueRequest, placement: Placement) -> Result<Enqueued, JobsError> {
    if let Some(id) = &req.job_id
        && is_integer_text(id)
    {
        return Err(JobsError::invalid(format!(
            "job id {id:?} is an integer: a queue numbers the jobs added without an id, so a custom id cannot be one"
        )));
    }
    add(tx, q, req, placement)
}

/// The add `keepLastIfActive` kept, made now under the number it took then.
/// Its job is stamped now, and a delay counts from now, as Redis makes it
/// when the job before it finishes.
pub fn enqueue_kept(tx: &mut Tx, q: &QueueId, mut kept: EnqueueRequest) -> Result<Enqueued, JobsError> {
    kept.timestamp = None;
    // Its key answers the job that held the id: the add was answered so when
    // it was kept. (Kept adds are stored without their key; those stored by
    // earlier builds still hold it.)
    kept.idempotency = None;
    add(tx, q, kept, Placement::Normal)
}

/// Adds `reqs`, each on its own (a refused job leaves the others in), or,
/// `all_or_nothing`, failing at the first refusal (the caller's transaction
/// then keeps nothing). Under `key`, a key for the whole call, a repeat
/// answers each job the first call made, as its own key would, and tries
/// again those it refused; one record keeps the call, where a key for each
/// job wrote one for each.
pub fn bulk(
    tx: &mut Tx,
    q: &QueueId,
    reqs: &[EnqueueRequest],
    all_or_nothing: bool,
    key: Option<&Idempotency>,
) -> Result<Vec<Result<Enqueued, JobsError>>, JobsError> {
    let keyed = key.map(|idem| (idem, CallHash { hash: idempotency::hash_of(&(all_or_nothing, reqs)), version: 1 }));
    let before = match keyed {
        Some((idem, hash)) => idempotency::recall(tx, q, idem, hash, None)?.map(|rec| rec.bulk),
        None => None,
    };
    if let (Some((idem, _)), Some(before)) = (keyed, &before)
        && before.len() != reqs.len()
    {
        // Another kind of call's record (an add's) under the same key.
        return Err(JobsError::IdempotencyConflict { key: idem.key.clone() });
    }
    let mut results = Vec::with_capacity(reqs.len());
    for (at, req) in reqs.iter().enumerate() {
        let result = match before.as_ref().and_then(|made| made[at].clone()) {
            Some(BulkAdded { job_id, deduplicated }) => made_before(tx, q, job_id, deduplicated),
            None => enqueue(tx, q, req.clone(), Placement::Normal),
        };
        if all_or_nothing && let Err(e) = result {
            return Err(e);
        }
        results.push(result);
    }
    if let Some((idem, hash)) = keyed {
        let made: Vec<Option<BulkAdded>> = results
            .iter()
            .map(|r| {
                let e = r.as_ref().ok()?;
                Some(BulkAdded { job_id: e.id.clone(), deduplicated: e.deduplicated_by.is_some() })
            })
            .collect();
        // A repeat that made nothing new leaves the record as it was.
        if before.as_ref() != Some(&made) {
            let answer = idempotency::Answer { bulk: made, ..Default::default() };
            idempotency::remember(tx, q, idem, hash, "", answer)?;
        }
    }
    Ok(results)
}

/// The answer to an add made again under its key: the job the first made,
/// in its state now (completed once it is gone: retention removed it).
fn made_before(tx: &mut Tx, q: &QueueId, job_id: String, deduplicated: bool) -> Result<Enqueued, JobsError> {
    let state = tx.load_job(q, &job_id)?.map_or(JobState::Completed, |j| j.state);
    let deduplicated_by = deduplicated.then(|| job_id.clone());
    Ok(Enqueued { id: job_id, created: false, state, deduplicated_by })
}

fn add(tx: &mut Tx, q: &QueueId, mut req: EnqueueRequest, placement: Placement) -> Result<Enqueued, JobsError> {
    validate(tx, &req)?;
    let keyed = req.idempotency.take().map(|idem| (idem, request_hash(&req)));
    if let Some((idem, hash)) = &keyed
        && let Some(rec) = idempotency::recall(tx, q, idem, *hash, Some(&|| request_hash_0(&req)))?
    {
        return made_before(tx, q, rec.job_id, rec.deduplicated);
    }

    if let Some(id) = &req.job_id
        && let Some(existing) = tx.load_job(q, id)?
    {
        // An existing flow parent stands, and the children added with it
        // join its others (BullMQ's addParentJob answers "duplicated").
        if let Some(parent) = &req.parent {
            adopt(tx, q, existing.clone(), parent, req.on_child_failure)?;
        }
        return duplicated(tx, q, &existing);
    }

    if let Some(parent) = &req.parent {
        require_parent(tx, parent)?;
    }
    // Every add takes a number, as Redis's `INCR` of the id counter does,
    // whether or not its job gets it: auto ids then run as they do there.
    let stats = tx.stats_mut(q)?;
    stats.last_id += 1;
    let id = match &req.job_id {
        Some(id) => id.clone(),
        None => stats.last_id.to_string(),
    };

    if let Some(existing) = deduplicate(tx, q, &req, &id)? {
        // Sent again, the add answers the same job, where it would be
        // deduplicated anew (or, its job gone meanwhile, added).
        if let Some((idem, hash)) = &keyed {
            let answer = idempotency::Answer { deduplicated: existing.deduplicated_by.is_some(), ..Default::default() };
            idempotency::remember(tx, q, idem, *hash, &existing.id, answer)?;
        }
        return Ok(existing);
    }

    if let Some(parent) = &req.parent {
        link_parent(tx, parent, (q, &id), &keys_node(q, &id, parent))?;
    }

    let timestamp = req.timestamp.unwrap_or(tx.now);
    let due = timestamp.saturating_add(req.delay_ms);
    // The request is this run's own (a write's body may run again, on a
    // copy): its payload moves into the record rather than being copied.
    let mut job = JobRecord {
        id: id.clone(),
        name: req.name.clone(),
        data: std::mem::take(&mut req.data),
        opts: std::mem::take(&mut req.opts),
        state: JobState::Waiting,
        priority: req.priority,
        lifo: req.lifo,
        seq: 0,
        timestamp,
        delay: req.delay_ms,
        due,
        attempts: req.attempts.max(1),
        attempts_made: 0,
        attempts_started: 0,
        stalled_counter: 0,
        backoff: req.backoff.clone(),
        epoch: 0,
        lock: None,
        lock_duration_ms: req.lock_duration_ms,
        timeout_ms: req.timeout_ms,
        expires: req.expires,
        processed_on: None,
        finished_on: None,
        processed_by: None,
        progress: None,
        return_value: None,
        failed_reason: None,
        stacktrace: Vec::new(),
        deferred_failure: None,
        parent: req.parent.clone(),
        on_child_failure: req.on_child_failure,
        pending_children: 0,
        failed_children: 0,
        dedup: req.dedup.clone(),
        scheduler_id: req.scheduler_id.clone(),
        remove_on_complete: req.remove_on_complete,
        remove_on_fail: req.remove_on_fail,
        keep_logs: req.keep_logs,
        log_seq: 0,
        log_count: 0,
        dead_letter: req.dead_letter.clone(),
        headers: req.headers.clone(),
        children_counted: matches!(placement, Placement::WaitChildren),
        ended_by: None,
        data_apart: false,
        return_value_event: None,
        data_changed: true,
    };
    job.state = match placement {
        Placement::WaitChildren => JobState::WaitingChildren,
        Placement::Normal if req.delay_ms > 0 => JobState::Delayed,
        Placement::Normal => Tx::ready_state(&job),
    };
    // Only a job ready at once goes in front: delayed jobs due in the same
    // millisecond keep the order they were added in, LIFO or not, as in
    // Redis's delayed set (each gets a new place when it becomes ready).
    let waits = matches!(job.state, JobState::Delayed | JobState::WaitingChildren);
    job.seq = tx.next_seq(q, job.queues_lifo() && !waits)?;
    tx.save_job(q, &mut job)?;
    tx.index(q, &job)?;
    tx.event(q, "added", &[("jobId", &id), ("name", &job.name)])?;
    match job.state {
        JobState::Delayed => {
            tx.event(q, "delayed", &[("jobId", &id), ("delay", &due.to_string())])?;
        }
        JobState::Waiting | JobState::Prioritized => {
            tx.event(q, "waiting", &[("jobId", &id)])?;
        }
        JobState::WaitingChildren => {
            tx.event(q, "waiting-children", &[("jobId", &id)])?;
        }
        _ => {}
    }
    if let Some((idem, hash)) = &keyed {
        idempotency::remember(tx, q, idem, *hash, &id, idempotency::Answer::default())?;
    }
    Ok(Enqueued { id, created: true, state: job.state, deduplicated_by: None })
}

/// The node key BullMQ gives a child: `<parent prefix>:<queue>:<id>`.
fn keys_node(q: &QueueId, id: &str, parent: &ParentRef) -> String {
    model::node_key(&parent.prefix, &q.name, id)
}

/// Records a new child under its parent: a pending dependency and one more
/// pending child. The parent must exist (BullMQ's ParentJobNotExist).
fn link_parent(tx: &mut Tx, parent: &ParentRef, child: (&QueueId, &str), child_key: &str) -> Result<(), JobsError> {
    let dep = Dependency {
        status: DependencyStatus::Pending,
        child_queue: child.0.name.clone(),
        child_id: child.1.to_string(),
        value: None,
    };
    record_child(tx, parent, child_key, dep)
}

/// Puts `dep` under `parent` (which must exist) unless the child is there
/// already, and counts it among the parent's pending children when it is
/// pending. Refuses a child whose key is another child's: a node key joins
/// queue and id with `:`, which a queue name or job id may hold (queue `a:b`
/// id `c`, and queue `a` id `b:c`), and linked under one key the second child
/// went uncounted, so the parent ran before it ended.
fn record_child(tx: &mut Tx, parent: &ParentRef, child_key: &str, dep: Dependency) -> Result<(), JobsError> {
    let pq = parent_queue(tx, parent);
    let dep_key = QueueKeys::new(&pq).dependency(&parent.id, child_key);
    if let Some(linked) = tx.get_record::<Dependency>(&dep_key)? {
        if linked.is_of(&dep.child_queue, &dep.child_id) {
            return Ok(());
        }
        return Err(JobsError::invalid(format!(
            "job {} of queue {} cannot be a child of {}: its key {child_key} is already that of its child {} of queue \
             {} (a ':' in a queue name or job id can make two keys one)",
            dep.child_id,
            dep.child_queue,
            parent.node_key(),
            linked.child_id,
            linked.child_queue,
        )));
    }
    if dep.status == DependencyStatus::Pending {
        tx.count_children(&pq, &parent.id, |c| c.pending += 1)?.ok_or_else(|| missing_parent(parent))?;
    }
    tx.put_record(&dep_key, &dep)
}

/// Refuses an add whose parent does not exist (BullMQ's ParentJobNotExist),
/// before anything is written, without decoding the parent (a flow links ten
/// children to one parent, and decoding it twice a child was a tenth of the
/// flow's cost; `link_parent` now counts them without decoding it at all).
fn require_parent(tx: &mut Tx, parent: &ParentRef) -> Result<(), JobsError> {
    let key = QueueKeys::new(&parent_queue(tx, parent)).job(&parent.id);
    tx.get_for_update(&key)?.map(|_| ()).ok_or_else(|| missing_parent(parent))
}

/// The queue a parent reference names: in the namespace of the operation,
/// since a flow never crosses namespaces.
fn parent_queue(tx: &Tx, parent: &ParentRef) -> QueueId {
    QueueId::new(tx.ns.clone(), parent.queue.clone())
}

fn missing_parent(parent: &ParentRef) -> JobsError {
    JobsError::NotFound(Missing::ParentJob(parent.node_key()))
}

/// Refuses to make `job` a child of `parent` when `parent` is `job` itself or
/// one of its descendants: the tree would become a cycle, which every walk
/// over it (removal, lock checks) would follow forever.
fn refuse_cycle(tx: &mut Tx, q: &QueueId, job: &JobRecord, parent: &ParentRef) -> Result<(), JobsError> {
    let mut above = Some((parent_queue(tx, parent), parent.id.clone()));
    let mut seen = std::collections::HashSet::new();
    while let Some((aq, id)) = above {
        if aq == *q && id == job.id {
            return Err(JobsError::invalid(format!(
                "job {} cannot become a child of {}: that job is itself or below it in its flow",
                job.id,
                parent.node_key()
            )));
        }
        if !seen.insert((aq.clone(), id.clone())) {
            break; // a cycle left by an older version; not ours to follow
        }
        above = tx.load_job(&aq, &id)?.and_then(|j| j.parent).map(|p| (parent_queue(tx, &p), p.id.clone()));
    }
    Ok(())
}

/// The answer to an add that names an existing job: that job stands (BullMQ's
/// `duplicated` event), and the add still takes a number, as Redis's `INCR`.
fn duplicated(tx: &mut Tx, q: &QueueId, existing: &JobRecord) -> Result<Enqueued, JobsError> {
    tx.stats_mut(q)?.last_id += 1;
    tx.event(q, "duplicated", &[("jobId", &existing.id)])?;
    Ok(Enqueued { id: existing.id.clone(), created: false, state: existing.state, deduplicated_by: None })
}

/// Whether `job` belongs to a parent other than `parent` that still exists:
/// such a job cannot be taken over.
fn held_by_another_parent(tx: &mut Tx, job: &JobRecord, parent: &ParentRef) -> Result<bool, JobsError> {
    match &job.parent {
        Some(old) if old != parent => Ok(tx.load_job(&parent_queue(tx, old), &old.id)?.is_some()),
        _ => Ok(false),
    }
}

/// An add that names an existing job id and a parent makes the existing job
/// that parent's child (BullMQ's flow re-use of a job id): a finished child
/// counts as processed at once, an unfinished one as pending. A job that
/// already belongs to another parent that still exists cannot be taken over.
fn adopt(
    tx: &mut Tx,
    q: &QueueId,
    mut job: JobRecord,
    parent: &ParentRef,
    policy: crate::model::OnChildFailure,
) -> Result<(), JobsError> {
    if held_by_another_parent(tx, &job, parent)? {
        return Err(JobsError::Precondition(Precondition::ParentCannotBeReplaced { job: parent.node_key() }));
    }
    require_parent(tx, parent)?;
    refuse_cycle(tx, q, &job, parent)?;
    let completed = job.state == JobState::Completed;
    let dep = Dependency {
        status: if completed { DependencyStatus::Processed } else { DependencyStatus::Pending },
        child_queue: q.name.clone(),
        child_id: job.id.clone(),
        value: if completed {
            job.return_value.as_deref().map(|v| crate::model::as_text(v).into_owned())
        } else {
            None
        },
    };
    record_child(tx, parent, &keys_node(q, &job.id, parent), dep)?;
    job.parent = Some(parent.clone());
    job.on_child_failure = policy;
    tx.save_job(q, &mut job)
}

/// Applies BullMQ's deduplication; returns the existing job when the add is
/// absorbed by it.
fn deduplicate(tx: &mut Tx, q: &QueueId, req: &EnqueueRequest, new_id: &str) -> Result<Option<Enqueued>, JobsError> {
    let Some(d) = &req.dedup else { return Ok(None) };
    let keys = QueueKeys::new(q);
    let dkey = keys.dedup(&d.id);
    // The key's ttl runs in the store's time, as a Redis key's does.
    let ttl_now = tx.ttl_now();
    // The key, if a job still holds the id, and else the add kept for later,
    // which waits on for a job of the id to finish: Redis keeps it apart
    // (`dn:<id>`), and it outlives a key removed or expired (`de:<id>`).
    let (held, kept) = match tx.get_record::<DedupRecord>(&dkey)? {
        None => (None, None),
        Some(rec) if rec.key_removed => (None, rec.next),
        Some(rec) => match tx.load_job(q, &rec.job_id)? {
            Some(job) if rec.is_live(&job, ttl_now) => (Some((rec, Some(job))), None),
            Some(_) => (None, rec.next),
            // A key with an expiry outlives a job removed before it (on
            // completion, or by retention), as a Redis key lives out its TTL
            // whatever becomes of its job: a throttle holds for its ttl.
            None if rec.expires_at.is_some_and(|e| e > ttl_now) => (Some((rec, None)), None),
            None if rec.expires_at.is_some() => (None, rec.next),
            // One without an expiry goes with its job; left behind, it is
            // stale, and the add kept with it goes too (Redis's
            // recoverStaleDeduplicationKey deletes both).
            None => (None, None),
        },
    };
    // A keepLastIfActive key has no expiry, its ttl notwithstanding: it lasts
    // until its job finishes, as Redis sets it without one.
    let ttl_expiry = d.ttl_ms.filter(|t| *t > 0 && !d.keep_last_if_active).map(|t| ttl_now.saturating_add(t));
    let Some((mut rec, mut job)) = held else {
        tx.put_record(&dkey, &DedupRecord::held_by(new_id, ttl_expiry, kept))?;
        return Ok(None);
    };
    let state = job.as_ref().map(|j| j.state);
    // A finished job holds a simple (ttl-less) dedup key no longer.
    if state.is_some_and(JobState::is_finished) && rec.expires_at.is_none() {
        tx.put_record(&dkey, &DedupRecord::held_by(new_id, None, rec.next))?;
        return Ok(None);
    }

    if d.replace
        && let Some(replaced) = job.as_ref().filter(|j| j.state == JobState::Delayed)
    {
        // Debounce with replace: the pending delayed job gives way to the new one.
        super::admin::remove_replaced(tx, q, replaced, req.parent.as_ref())?;
        tx.event(
            q,
            "deduplicated",
            &[("jobId", new_id), ("deduplicationId", &d.id), ("deduplicatedJobId", &replaced.id)],
        )?;
        let expires_at = if d.extend { ttl_expiry } else { rec.expires_at.or(ttl_expiry) };
        tx.put_record(&dkey, &DedupRecord::held_by(new_id, expires_at, None))?;
        return Ok(None);
    }

    let keep_next = d.keep_last_if_active && state == Some(JobState::Active);
    if keep_next {
        // The kept add runs later under the id it was given now.
        let mut next = req.clone();
        next.job_id = Some(new_id.to_string());
        rec.next = Some(Box::new(next));
        rec.expires_at = None; // held until the active job finishes
    } else if d.extend {
        rec.expires_at = ttl_expiry;
    }
    let mut rescheduled_to = None;
    if let Some(job) = job.as_mut().filter(|j| d.reschedule && j.state == JobState::Delayed) {
        tx.unindex(q, job)?;
        job.delay = req.delay_ms;
        // From the incoming add's timestamp, as a delayed add counts its delay.
        job.due = req.timestamp.unwrap_or(tx.now).saturating_add(req.delay_ms);
        tx.index(q, job)?;
        tx.save_job(q, job)?;
        rescheduled_to = Some(job.due);
    }
    tx.put_record(&dkey, &rec)?;
    let holder = rec.job_id;
    // BullMQ's replace mode absorbs an add silently unless it kept it for later.
    if !d.replace || keep_next {
        tx.event(q, "deduplicated", &[("jobId", &holder), ("deduplicationId", &d.id), ("deduplicatedJobId", new_id)])?;
    }
    if let Some(due) = rescheduled_to {
        tx.event(q, "delayed", &[("jobId", &holder), ("delay", &due.to_string())])?;
    }
    // A holder removed before its key expired finished (only finishing
    // leaves its key behind).
    let state = state.unwrap_or(JobState::Completed);
    Ok(Some(Enqueued { id: holder.clone(), created: false, state, deduplicated_by: Some(holder) }))
}

/// One node of a flow: a job, its queue, and whether it waits for children
/// that are added in the same flow.
#[derive(Clone, Debug)]
pub struct FlowNode {
    pub queue: String,
    pub request: EnqueueRequest,
    pub wait_children: bool,
}

/// Splits the nodes of several flows into their trees, in order: a node whose
/// parent is an earlier node of the batch joins that node's tree, any other
/// node starts one. Returns, per tree, the positions of its nodes.
pub fn flow_trees(nodes: &[FlowNode]) -> Vec<Vec<usize>> {
    let mut tree_of: std::collections::HashMap<(&str, &str), usize> = std::collections::HashMap::new();
    let mut trees: Vec<Vec<usize>> = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let parent_tree =
            node.request.parent.as_ref().and_then(|p| tree_of.get(&(p.queue.as_str(), p.id.as_str())).copied());
        let tree = parent_tree.unwrap_or_else(|| {
            trees.push(Vec::new());
            trees.len() - 1
        });
        trees[tree].push(i);
        if let Some(id) = &node.request.job_id {
            tree_of.insert((node.queue.as_str(), id.as_str()), tree);
        }
    }
    trees
}

/// Inserts a flow tree; parents come before their children. Parents whose
/// children all turned out to exist already (or that got none) are released
/// once the whole tree is in (BullMQ's deferred parent release).
///
/// A child whose id another existing parent holds stays that parent's, and
/// the rest of the flow goes in: BullMQ's flows answer only for their root.
/// Its new parent is then not released here ("flowAttachmentFailed" in
/// BullMQ's scripts), only once its other children finish.
pub fn flow(tx: &mut Tx, nodes: Vec<FlowNode>) -> Result<Vec<Enqueued>, JobsError> {
    let ns = tx.ns.clone();
    let mut out = Vec::with_capacity(nodes.len());
    let mut parents = Vec::new();
    let mut in_flow = std::collections::HashSet::new();
    let mut held_back = std::collections::HashSet::new();
    for node in nodes {
        validate_name("queue name", &node.queue, MAX_NAME_BYTES)?;
        let q = QueueId::new(ns.clone(), node.queue.clone());
        if let (Some(parent), Some(id)) = (&node.request.parent, &node.request.job_id)
            && in_flow.contains(&(parent.queue.clone(), parent.id.clone()))
            && let Some(existing) = tx.load_job(&q, id)?
            && held_by_another_parent(tx, &existing, parent)?
        {
            held_back.insert((parent.queue.clone(), parent.id.clone()));
            // It takes a number, and no `duplicated` event: Redis's script
            // answers -7 before it writes one.
            tx.stats_mut(&q)?.last_id += 1;
            out.push(Enqueued { id: existing.id, created: false, state: existing.state, deduplicated_by: None });
            continue;
        }
        let placement = if node.wait_children { Placement::WaitChildren } else { Placement::Normal };
        let e = enqueue(tx, &q, node.request, placement)?;
        in_flow.insert((node.queue, e.id.clone()));
        if node.wait_children && e.created {
            parents.push((q, e.id.clone(), out.len()));
        }
        out.push(e);
    }
    for (q, id, answer) in parents.into_iter().rev() {
        if held_back.contains(&(q.name.clone(), id.clone())) {
            continue;
        }
        let job = tx.require_job(&q, &id)?;
        if job.state == JobState::WaitingChildren && job.pending_children == 0 {
            // Its answer gives the state it was released to.
            out[answer].state = super::complete::release_parent(tx, &q, job)?.state;
        }
    }
    Ok(out)
}
