//! loam.jobs.v1 messages to the core's types and back. The messages mirror
//! the core's model field for field, so each conversion is a move; the checks
//! here are the ones the wire format cannot express (a missing oneof, an
//! unknown enum value, an unchecked fence of `false`, `opts` that is not a
//! JSON object).

use buffa::EnumValue;
use loam_jobs::{
    Backoff, CompleteOptions, Completed, Dedup, Dependency, DependencyStatus, EnqueueRequest, Enqueued, Event, Fence,
    Idempotency, JobError, JobRecord, JobState, JobsError, Keep, Lease, LeaseInfo, LeaseRequest, Leased, MetricsRecord,
    OnChildFailure, Outcome, ParentRef, QueueConfig, RateLimit, Retention, SchedulerRecord, SchedulerSpec,
};
use loam_jobs_proto::loam::jobs::v1 as pb;
use pb::__buffa::oneof;

/// Conversions refuse with the core's own error, which each handler turns
/// into the caller's once.
type Res<T> = Result<T, JobsError>;

// ---- enums -----------------------------------------------------------------

pub fn state_to_pb(s: JobState) -> EnumValue<pb::JobState> {
    EnumValue::from(match s {
        JobState::Waiting => pb::JobState::JOB_STATE_WAITING,
        JobState::Prioritized => pb::JobState::JOB_STATE_PRIORITIZED,
        JobState::Delayed => pb::JobState::JOB_STATE_DELAYED,
        JobState::Active => pb::JobState::JOB_STATE_ACTIVE,
        JobState::WaitingChildren => pb::JobState::JOB_STATE_WAITING_CHILDREN,
        JobState::Completed => pb::JobState::JOB_STATE_COMPLETED,
        JobState::Failed => pb::JobState::JOB_STATE_FAILED,
    })
}

pub fn state_from_pb(s: &EnumValue<pb::JobState>) -> Res<JobState> {
    Ok(match s.as_known() {
        Some(pb::JobState::JOB_STATE_WAITING) => JobState::Waiting,
        Some(pb::JobState::JOB_STATE_PRIORITIZED) => JobState::Prioritized,
        Some(pb::JobState::JOB_STATE_DELAYED) => JobState::Delayed,
        Some(pb::JobState::JOB_STATE_ACTIVE) => JobState::Active,
        Some(pb::JobState::JOB_STATE_WAITING_CHILDREN) => JobState::WaitingChildren,
        Some(pb::JobState::JOB_STATE_COMPLETED) => JobState::Completed,
        Some(pb::JobState::JOB_STATE_FAILED) => JobState::Failed,
        _ => return Err(JobsError::invalid(format!("a job state is required, got {}", s.to_i32()))),
    })
}

fn on_child_failure_from(v: &EnumValue<pb::OnChildFailure>) -> Res<OnChildFailure> {
    Ok(match v.as_known() {
        Some(pb::OnChildFailure::ON_CHILD_FAILURE_UNSPECIFIED) => OnChildFailure::Wait,
        Some(pb::OnChildFailure::ON_CHILD_FAILURE_FAIL_PARENT) => OnChildFailure::FailParent,
        Some(pb::OnChildFailure::ON_CHILD_FAILURE_CONTINUE_PARENT) => OnChildFailure::ContinueParent,
        Some(pb::OnChildFailure::ON_CHILD_FAILURE_IGNORE) => OnChildFailure::Ignore,
        Some(pb::OnChildFailure::ON_CHILD_FAILURE_REMOVE) => OnChildFailure::Remove,
        None => return Err(JobsError::invalid(format!("unknown on_child_failure {}", v.to_i32()))),
    })
}

fn on_child_failure_to(v: OnChildFailure) -> EnumValue<pb::OnChildFailure> {
    EnumValue::from(match v {
        OnChildFailure::Wait => pb::OnChildFailure::ON_CHILD_FAILURE_UNSPECIFIED,
        OnChildFailure::FailParent => pb::OnChildFailure::ON_CHILD_FAILURE_FAIL_PARENT,
        OnChildFailure::ContinueParent => pb::OnChildFailure::ON_CHILD_FAILURE_CONTINUE_PARENT,
        OnChildFailure::Ignore => pb::OnChildFailure::ON_CHILD_FAILURE_IGNORE,
        OnChildFailure::Remove => pb::OnChildFailure::ON_CHILD_FAILURE_REMOVE,
    })
}

// ---- options ---------------------------------------------------------------

fn backoff_from(b: pb::Backoff) -> Res<Backoff> {
    Ok(match b.kind.as_known() {
        Some(pb::BackoffKind::BACKOFF_KIND_FIXED) => Backoff::Fixed { delay_ms: b.delay_ms, jitter: b.jitter },
        Some(pb::BackoffKind::BACKOFF_KIND_EXPONENTIAL) => {
            Backoff::Exponential { delay_ms: b.delay_ms, jitter: b.jitter, max_ms: b.max_ms }
        }
        _ => return Err(JobsError::invalid("backoff needs a kind (fixed or exponential)")),
    })
}

fn backoff_to(b: &Backoff) -> pb::Backoff {
    match b {
        Backoff::Fixed { delay_ms, jitter } => pb::Backoff {
            kind: pb::BackoffKind::BACKOFF_KIND_FIXED.into(),
            delay_ms: *delay_ms,
            jitter: *jitter,
            ..Default::default()
        },
        Backoff::Exponential { delay_ms, jitter, max_ms } => pb::Backoff {
            kind: pb::BackoffKind::BACKOFF_KIND_EXPONENTIAL.into(),
            delay_ms: *delay_ms,
            jitter: *jitter,
            max_ms: *max_ms,
            ..Default::default()
        },
    }
}

pub fn retention_from(r: pb::Retention) -> Res<Retention> {
    Ok(match r.policy {
        Some(oneof::retention::Policy::KeepAll(_)) => Retention::KeepAll,
        Some(oneof::retention::Policy::RemoveImmediately(_)) => Retention::RemoveImmediately,
        Some(oneof::retention::Policy::Keep(k)) => {
            Retention::Keep(Keep { count: k.count, age_ms: k.age_ms, limit: k.limit })
        }
        None => return Err(JobsError::invalid("retention needs a policy")),
    })
}

fn retention_to(r: &Retention) -> pb::Retention {
    let policy = match r {
        Retention::KeepAll => oneof::retention::Policy::KeepAll(true),
        Retention::RemoveImmediately => oneof::retention::Policy::RemoveImmediately(true),
        Retention::Keep(k) => oneof::retention::Policy::from(pb::Keep {
            count: k.count,
            age_ms: k.age_ms,
            limit: k.limit,
            ..Default::default()
        }),
    };
    pb::Retention { policy: Some(policy), ..Default::default() }
}

fn opt_retention(r: Option<pb::Retention>) -> Res<Option<Retention>> {
    r.map(retention_from).transpose()
}

fn dedup_from(d: pb::Dedup) -> Dedup {
    Dedup {
        id: d.id,
        ttl_ms: d.ttl_ms,
        extend: d.extend,
        replace: d.replace,
        keep_last_if_active: d.keep_last_if_active,
        reschedule: d.reschedule,
    }
}

fn dedup_to(d: &Dedup) -> pb::Dedup {
    pb::Dedup {
        id: d.id.clone(),
        ttl_ms: d.ttl_ms,
        extend: d.extend,
        replace: d.replace,
        keep_last_if_active: d.keep_last_if_active,
        reschedule: d.reschedule,
        ..Default::default()
    }
}

fn parent_from(p: pb::ParentRef) -> ParentRef {
    ParentRef { queue: p.queue, id: p.id, prefix: p.prefix }
}

fn parent_to(p: &ParentRef) -> pb::ParentRef {
    pb::ParentRef { queue: p.queue.clone(), id: p.id.clone(), prefix: p.prefix.clone(), ..Default::default() }
}

/// A job's `opts`: empty, or BullMQ's job options as a JSON object. Other
/// JSON (`null`, a number) made BullMQ's `Job` throw on every read of the
/// job, and a Worker fail on it at each lease, for ever. Only the start is
/// looked at: JavaScript writes a lone surrogate as an escape a strict JSON
/// parser refuses, and BullMQ reads an object it cannot parse as no options.
fn job_opts(opts: String) -> Res<String> {
    if opts.is_empty() || opts.trim_start().starts_with('{') {
        Ok(opts)
    } else {
        Err(JobsError::invalid("opts must be empty or a JSON object (BullMQ's job options)"))
    }
}

/// A producer's job description as the core's request.
pub fn job_spec(j: pb::JobSpec) -> Res<EnqueueRequest> {
    Ok(EnqueueRequest {
        name: j.name,
        data: j.data,
        opts: job_opts(j.opts)?,
        headers: j.headers.into_iter().collect(),
        job_id: j.job_id,
        idempotency: idempotency(j.idempotency.into_option()),
        dedup: j.dedup.into_option().map(dedup_from),
        delay_ms: j.delay_ms,
        priority: j.priority,
        lifo: j.lifo,
        attempts: j.attempts.max(1),
        backoff: j.backoff.into_option().map(backoff_from).transpose()?,
        lock_duration_ms: j.lock_duration_ms,
        timeout_ms: j.timeout_ms,
        expires: j.expires,
        parent: j.parent.into_option().map(parent_from),
        on_child_failure: on_child_failure_from(&j.on_child_failure)?,
        remove_on_complete: opt_retention(j.remove_on_complete.into_option())?,
        remove_on_fail: opt_retention(j.remove_on_fail.into_option())?,
        keep_logs: j.keep_logs,
        dead_letter: j.dead_letter,
        timestamp: j.timestamp,
        scheduler_id: j.scheduler_id,
    })
}

pub fn enqueued(e: &Enqueued) -> pb::Enqueued {
    pb::Enqueued {
        id: e.id.clone(),
        created: e.created,
        state: state_to_pb(e.state),
        deduplicated_by: e.deduplicated_by.clone(),
        ..Default::default()
    }
}

/// The job as the wire carries it, moved: a lease or a read answers each job
/// once, so its payload and texts go over rather than being copied.
pub fn job(j: JobRecord) -> pb::Job {
    pb::Job {
        id: j.id,
        name: j.name,
        data: j.data,
        opts: j.opts,
        state: state_to_pb(j.state),
        priority: j.priority,
        lifo: j.lifo,
        seq: j.seq,
        timestamp: j.timestamp,
        delay: j.delay,
        due: j.due,
        attempts: j.attempts,
        attempts_made: j.attempts_made,
        attempts_started: j.attempts_started,
        stalled_counter: j.stalled_counter,
        backoff: j.backoff.as_ref().map(backoff_to).into(),
        epoch: j.epoch,
        lock: j
            .lock
            .as_ref()
            .map(|l| pb::Lock {
                token: l.token.clone(),
                deadline: l.deadline,
                duration_ms: l.duration_ms,
                ..Default::default()
            })
            .into(),
        lock_duration_ms: j.lock_duration_ms,
        timeout_ms: j.timeout_ms,
        expires: j.expires,
        processed_on: j.processed_on,
        finished_on: j.finished_on,
        processed_by: j.processed_by,
        progress: j.progress,
        return_value: j.return_value,
        failed_reason: j.failed_reason,
        stacktrace: j.stacktrace,
        deferred_failure: j.deferred_failure,
        parent: j.parent.as_ref().map(parent_to).into(),
        on_child_failure: on_child_failure_to(j.on_child_failure),
        pending_children: j.pending_children,
        failed_children: j.failed_children,
        dedup: j.dedup.as_ref().map(dedup_to).into(),
        scheduler_id: j.scheduler_id,
        remove_on_complete: j.remove_on_complete.as_ref().map(retention_to).into(),
        remove_on_fail: j.remove_on_fail.as_ref().map(retention_to).into(),
        keep_logs: j.keep_logs,
        log_count: j.log_count,
        dead_letter: j.dead_letter,
        headers: j.headers.into_iter().collect(),
        ..Default::default()
    }
}

// ---- consuming ---------------------------------------------------------------

pub fn lease_options(o: pb::LeaseOptions) -> LeaseRequest {
    LeaseRequest {
        max: o.max,
        token: o.token,
        worker: o.worker,
        lock_duration_ms: o.lock_duration_ms,
        names: if o.names.is_empty() { None } else { Some(o.names) },
        limiter: o.limiter.into_option().map(rate_limit),
        // Set by the service, from --max-response-bytes.
        max_bytes: None,
        fail_deferred: o.fail_deferred,
    }
}

pub fn rate_limit(r: pb::RateLimit) -> RateLimit {
    RateLimit { max: r.max, duration_ms: r.duration_ms }
}

fn lease(l: Lease) -> pb::Lease {
    pb::Lease { job: job(l.job).into(), epoch: l.epoch, token: l.token, deadline: l.deadline, ..Default::default() }
}

fn lease_info(i: &LeaseInfo) -> pb::LeaseInfo {
    pb::LeaseInfo {
        rate_limit_ms: i.rate_limit_ms,
        next_due: i.next_due,
        paused: i.paused,
        maxed: i.maxed,
        ..Default::default()
    }
}

pub fn leased(l: Leased) -> pb::Leased {
    pb::Leased {
        leases: l.leases.into_iter().map(lease).collect(),
        info: lease_info(&l.info).into(),
        ..Default::default()
    }
}

/// A fence is required: a write to a leased job must say whose lease it holds.
pub fn fence(f: Option<pb::Fence>) -> Res<Fence> {
    match f.and_then(|f| f.kind) {
        Some(oneof::fence::Kind::Epoch(e)) => Ok(Fence::Epoch(e)),
        Some(oneof::fence::Kind::Token(t)) => Ok(Fence::Token(t)),
        Some(oneof::fence::Kind::Unchecked(true)) => Ok(Fence::Unchecked),
        // Taken as unchecked, `false` let a stale holder's write through.
        Some(oneof::fence::Kind::Unchecked(false)) => Err(JobsError::invalid("an unchecked fence takes true")),
        None => Err(JobsError::invalid("a fence (epoch, token or unchecked) is required")),
    }
}

fn job_error(e: Option<pb::JobError>) -> Option<JobError> {
    e.map(|e| JobError {
        message: e.message,
        stacktrace: e.stacktrace,
        stacktrace_limit: e.stacktrace_limit.map(|n| n as usize),
        stacktraces: e.stacktraces.into_option().map(|s| s.traces),
    })
}

pub fn outcome(o: Option<pb::Outcome>) -> Res<Outcome> {
    use oneof::outcome::Kind;
    Ok(match o.and_then(|o| o.kind) {
        Some(Kind::Success(s)) => Outcome::Ok { result: s.result },
        Some(Kind::Retry(r)) => Outcome::Retry { error: job_error(r.error.into_option()), after_ms: r.after_ms },
        Some(Kind::Fail(f)) => {
            Outcome::Fail { error: job_error(f.error.into_option()).unwrap_or_default(), dead_letter: f.dead_letter }
        }
        Some(Kind::Release(r)) => Outcome::Release { after_ms: r.after_ms },
        Some(Kind::Delay(d)) => Outcome::Delay { until: d.until, delay_ms: d.delay_ms },
        Some(Kind::WaitChildren(w)) => Outcome::WaitChildren { child: w.child },
        Some(Kind::RateLimited(r)) => Outcome::RateLimited { for_ms: r.for_ms },
        None => return Err(JobsError::invalid("an outcome is required")),
    })
}

pub fn idempotency(i: Option<pb::Idempotency>) -> Option<Idempotency> {
    i.map(|i| Idempotency { key: i.key, ttl_ms: i.ttl_ms })
}

pub fn complete_options(o: Option<pb::CompleteOptions>) -> Res<CompleteOptions> {
    let Some(o) = o else { return Ok(CompleteOptions::default()) };
    Ok(CompleteOptions {
        fetch_next: o.fetch_next.into_option().map(lease_options),
        remove_on_complete: opt_retention(o.remove_on_complete.into_option())?,
        remove_on_fail: opt_retention(o.remove_on_fail.into_option())?,
        metrics_max_points: o.metrics_max_points,
        idempotency: idempotency(o.idempotency.into_option()),
    })
}

pub fn completed(c: Completed) -> pb::Completed {
    pb::Completed {
        // Unspecified when retention removed the job (the proto's contract).
        state: c.state.filter(|_| !c.removed).map(state_to_pb).unwrap_or_default(),
        finished_on: c.finished_on,
        moved: c.moved,
        next: c.next.map(leased).into(),
        ..Default::default()
    }
}

// ---- reads -------------------------------------------------------------------

/// A status asked for: unspecified is any.
pub fn dependency_status_from(v: &EnumValue<pb::DependencyStatus>) -> Res<Option<DependencyStatus>> {
    Ok(match v.as_known() {
        Some(pb::DependencyStatus::DEPENDENCY_STATUS_UNSPECIFIED) => None,
        Some(pb::DependencyStatus::DEPENDENCY_STATUS_PENDING) => Some(DependencyStatus::Pending),
        Some(pb::DependencyStatus::DEPENDENCY_STATUS_PROCESSED) => Some(DependencyStatus::Processed),
        Some(pb::DependencyStatus::DEPENDENCY_STATUS_FAILED) => Some(DependencyStatus::Failed),
        Some(pb::DependencyStatus::DEPENDENCY_STATUS_IGNORED) => Some(DependencyStatus::Ignored),
        None => return Err(JobsError::invalid(format!("unknown dependency status {}", v.to_i32()))),
    })
}

pub fn dependency(key: &str, d: &Dependency) -> pb::Dependency {
    let status = match d.status {
        DependencyStatus::Pending => pb::DependencyStatus::DEPENDENCY_STATUS_PENDING,
        DependencyStatus::Processed => pb::DependencyStatus::DEPENDENCY_STATUS_PROCESSED,
        DependencyStatus::Failed => pb::DependencyStatus::DEPENDENCY_STATUS_FAILED,
        DependencyStatus::Ignored => pb::DependencyStatus::DEPENDENCY_STATUS_IGNORED,
    };
    pb::Dependency {
        key: key.to_string(),
        status: status.into(),
        child_queue: d.child_queue.clone(),
        child_id: d.child_id.clone(),
        value: d.value.clone(),
        ..Default::default()
    }
}

/// A queue's metrics with the points at `start..=end` (`MetricsRecord::page`).
pub fn metrics(m: &MetricsRecord, start: i64, end: i64) -> pb::Metrics {
    pb::Metrics {
        count: m.count,
        prev_ts: m.prev_ts,
        prev_count: m.prev_count,
        data: m.page(start, end),
        total: m.data.len() as u64,
        ..Default::default()
    }
}

pub fn scheduler(r: &SchedulerRecord) -> pb::Scheduler {
    pb::Scheduler {
        id: r.id.clone(),
        name: r.name.clone(),
        pattern: r.pattern.clone(),
        every_ms: r.every_ms,
        offset_ms: r.offset_ms,
        tz: r.tz.clone(),
        start_date: r.start_date,
        end_date: r.end_date,
        limit: r.limit,
        iteration_count: r.iteration_count,
        next_millis: r.next_millis,
        template_data: r.template_data.clone(),
        template_opts: r.template_opts.clone(),
        next_job_id: r.next_job_id.clone(),
        extra: r.extra.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        server_owned: r.server_owned(),
        ..Default::default()
    }
}

pub fn scheduler_spec(s: pb::SchedulerSpec) -> Res<SchedulerSpec> {
    Ok(SchedulerSpec {
        id: s.id,
        name: s.name,
        pattern: s.pattern,
        every_ms: s.every_ms,
        offset_ms: s.offset_ms,
        tz: s.tz,
        start_date: s.start_date,
        end_date: s.end_date,
        limit: s.limit,
        next_millis: s.next_millis,
        template_data: s.template_data,
        template_opts: s.template_opts,
        job: s.job.into_option().map(job_spec).transpose()?.unwrap_or_default(),
        // A BullMQ scheduler, over the wire: BullMQ's rule.
        start_resets: false,
        count: s.count,
    })
}

pub fn queue_config_from(c: pb::QueueConfig) -> QueueConfig {
    QueueConfig {
        max_stalled: c.max_stalled,
        stalled_interval_ms: c.stalled_interval_ms,
        dead_letter_queue: c.dead_letter_queue,
        dead_letter_on_exhausted: c.dead_letter_on_exhausted,
    }
}

pub fn queue_config_to(c: &QueueConfig) -> pb::QueueConfig {
    pb::QueueConfig {
        max_stalled: c.max_stalled,
        stalled_interval_ms: c.stalled_interval_ms,
        dead_letter_queue: c.dead_letter_queue.clone(),
        dead_letter_on_exhausted: c.dead_letter_on_exhausted,
        ..Default::default()
    }
}

pub fn event(e: &Event) -> pb::Event {
    pb::Event {
        seq: e.seq,
        ts: e.ts,
        name: e.name.clone(),
        fields: e
            .fields
            .iter()
            .map(|(k, v)| pb::EventField { key: k.clone(), value: v.clone(), ..Default::default() })
            .collect(),
        ..Default::default()
    }
}
