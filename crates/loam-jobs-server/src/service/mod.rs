//! `JobsService` over the queue core: each call resolves its namespace,
//! converts its message, runs one core operation (one transaction, or one
//! snapshot read) and converts the result back. The `Watch` stream, the
//! workers seen by queue and the purge of expired records have modules of
//! their own.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use buffa::view::HasMessageView;
use connectrpc::{ConnectError, InboundStream, RequestContext, Response, ServiceRequest, ServiceResult, ServiceStream};
use loam_jobs::ops::{admin, idempotency, lease, query, results, schedule};
use loam_jobs::{
    CompleteOptions, Enqueued, Event, Fence, FlowNode, Interrupt, JobState, Jobs, JobsError, LeaseRequest, MetricsKind,
    Outcome, QueueId,
};
use loam_jobs_proto::loam::jobs::v1 as pb;
use parking_lot::Mutex;
use pb::__buffa::oneof;

use crate::budget::Budget;
use crate::convert;
use crate::errors::{
    code_name, cursor_ahead, detail, events_trimmed, invalid, overloaded, response_too_large, shutting_down, to_connect,
};
use crate::metrics::Metrics;
use crate::schedules;

mod purge;
mod watch;
mod workers;

pub use purge::purge_expired;
use workers::WorkersSeen;

/// The longest a Lease, an event read or a wait may block.
const MAX_WAIT: Duration = Duration::from_secs(30);
/// Events per Watch read and the default for Query's `events`.
const EVENT_BATCH: usize = 256;
/// Most events one `Query.events` returns.
const MAX_EVENTS_PER_READ: usize = 10_000;
/// Header that runs an operation at the caller's time (BullMQ's tests fake it).
pub(crate) const NOW_HEADER: &str = "loam-now-ms";

/// Every queue of every namespace.
pub fn all_queues(jobs: &Jobs) -> Result<Vec<QueueId>, JobsError> {
    jobs.read("", loam_jobs::ops::query::all_queues)
}

fn core_err(e: JobsError) -> ConnectError {
    to_connect(&e)
}

fn wait_of(ms: u32) -> Duration {
    Duration::from_millis(u64::from(ms)).min(MAX_WAIT)
}

fn outcome_name(o: &Outcome) -> &'static str {
    match o {
        Outcome::Ok { .. } => "ok",
        Outcome::Retry { .. } => "retry",
        Outcome::Fail { .. } => "fail",
        Outcome::Release { .. } => "release",
        Outcome::Delay { .. } => "delay",
        Outcome::WaitChildren { .. } => "wait_children",
        Outcome::RateLimited { .. } => "rate_limited",
    }
}

/// The namespace and core handle a call runs with.
pub(crate) struct Caller {
    ns: String,
    jobs: Jobs,
    /// The connection's address, when the transport gave it.
    peer: Option<SocketAddr>,
}

#[derive(Clone)]
pub struct JobsSvc {
    jobs: Jobs,
    auth: crate::auth::Auth,
    metrics: Arc<Metrics>,
    /// Fired at shutdown: ends long-polls, event waits and watches.
    shutdown: Interrupt,
    schedules: Arc<schedules::Index>,
    workers: Arc<Mutex<WorkersSeen>>,
    /// With --follow-client-clock: the core's clock, moved by `loam-now-ms`.
    following: Option<Arc<loam_jobs::FollowingClock>>,
    /// Bytes of requests held at once; a Session counts its calls here.
    budget: Budget,
    /// The largest answer a read builds (`--max-response-bytes`).
    max_response_bytes: u64,
    /// Long-polls waiting, by namespace (`--max-waiting-calls-per-namespace`).
    waiting: Arc<crate::waits::WaitingCalls>,
}

impl JobsSvc {
    pub fn new(
        jobs: Jobs,
        auth: crate::auth::Auth,
        metrics: Arc<Metrics>,
        shutdown: Interrupt,
        schedules: Arc<schedules::Index>,
        budget: Budget,
    ) -> Self {
        Self {
            jobs,
            auth,
            metrics,
            shutdown,
            schedules,
            workers: Arc::default(),
            following: None,
            budget,
            max_response_bytes: u64::MAX,
            waiting: crate::waits::WaitingCalls::new(crate::waits::DEFAULT_MAX_PER_NAMESPACE),
        }
    }

    /// Long-polls past `n` waiting in one namespace are refused.
    pub fn max_waiting_calls_per_namespace(self, n: usize) -> Self {
        Self { waiting: crate::waits::WaitingCalls::new(n), ..self }
    }

    /// Reads whose answer would be larger than `bytes` are refused.
    pub fn max_response_bytes(self, bytes: usize) -> Self {
        Self { max_response_bytes: u64::try_from(bytes).unwrap_or(u64::MAX), ..self }
    }

    /// `lease` taking no more jobs than fit in an answer: a batch of large
    /// jobs stops at --max-response-bytes of their data (the first is always
    /// taken), where 1,000 jobs of 64 MB each asked for 64 GB.
    fn bounded(&self, lease: LeaseRequest) -> LeaseRequest {
        LeaseRequest { max_bytes: Some(self.max_response_bytes), ..lease }
    }

    fn answer_size(&self) -> AnswerSize {
        AnswerSize { used: 0, cap: self.max_response_bytes }
    }

    pub(crate) fn budget(&self) -> &Budget {
        &self.budget
    }

    pub fn following(self, following: Option<Arc<loam_jobs::FollowingClock>>) -> Self {
        Self { following, ..self }
    }

    fn caller(&self, ctx: &RequestContext) -> Result<Caller, ConnectError> {
        let ns = self.auth.namespace(ctx.headers())?;
        let now_ms = match ctx.headers().get(NOW_HEADER) {
            Some(v) => Some(v.to_str().ok().and_then(|s| s.parse::<u64>().ok()).ok_or_else(bad_now)?),
            None => None,
        };
        Ok(self.at(ns, now_ms, ctx.peer_addr()))
    }

    /// A session call's caller: the session's namespace (checked when it
    /// opened) and the call's own clock, as a single call's `loam-now-ms`
    /// header would give them.
    pub(crate) fn session_caller(
        &self,
        ns: &str,
        now_ms: Option<i64>,
        peer: Option<SocketAddr>,
    ) -> Result<Caller, ConnectError> {
        let now_ms = now_ms.map(|n| u64::try_from(n).map_err(|_| bad_now())).transpose()?;
        Ok(self.at(ns.to_string(), now_ms, peer))
    }

    fn at(&self, ns: String, now_ms: Option<u64>, peer: Option<SocketAddr>) -> Caller {
        let jobs = match now_ms {
            Some(at) => {
                if let Some(clock) = &self.following {
                    clock.observe(at);
                }
                self.jobs.at(at)
            }
            None => self.jobs.clone(),
        };
        Caller { ns, jobs, peer }
    }

    /// Runs a unary call: checks its caller (token and clock), takes its
    /// request's bytes of the budget (held until it has answered) before it
    /// converts the request, runs it, and counts it by method and code. A
    /// call that may wait long (`long_poll`, see [`lease_waits`]) is converted
    /// first, to tell, and holds no budget if it does. The caller comes first,
    /// so a request without a valid token is refused holding none of the
    /// budget, and does not queue for it ahead of calls that would run.
    async fn unary<'a, M, T, F>(
        &'a self,
        method: &'static str,
        ctx: &RequestContext,
        r: ServiceRequest<'_, M>,
        long_poll: Option<fn(&M) -> bool>,
        call: impl FnOnce(Caller, M) -> F,
    ) -> ServiceResult<T>
    where
        M: HasMessageView,
        F: Future<Output = Result<T, ConnectError>> + 'a,
    {
        let caller = self.caller(ctx);
        let ns = caller.as_ref().map_or_else(|_| String::new(), |c| c.ns.clone());
        self.observe(&ns, method, async {
            let caller = caller?;
            let size = r.bytes().len();
            let (r, _held) = match long_poll {
                None => {
                    let held = self.budget.take(size).await.map_err(|o| overloaded(&o))?;
                    (r.to_owned_message(), Some(held))
                }
                Some(waits) => {
                    let r = r.to_owned_message();
                    let held =
                        if waits(&r) { None } else { Some(self.budget.take(size).await.map_err(|o| overloaded(&o))?) };
                    (r, held)
                }
            };
            call(caller, r).await
        })
        .await
    }

    /// Runs a call of namespace `ns`, counting it and its time by method and
    /// code.
    async fn observe<T>(
        &self,
        ns: &str,
        method: &'static str,
        call: impl Future<Output = Result<T, ConnectError>>,
    ) -> ServiceResult<T> {
        self.timed(ns, method, call).await.map(Response::new)
    }

    async fn timed<T>(
        &self,
        ns: &str,
        method: &'static str,
        call: impl Future<Output = Result<T, ConnectError>>,
    ) -> Result<T, ConnectError> {
        let started = Instant::now();
        let result = call.await;
        let code = match &result {
            Ok(_) => "ok",
            Err(e) => e.code.as_str(),
        };
        self.metrics.rpc(ns, method, code, started.elapsed());
        if let Err(e) = &result {
            tracing::debug!(method, code, message = e.message.as_deref().unwrap_or(""), "call refused");
        }
        result
    }

    fn count_fenced(&self, ns: &str, queue: &str, e: &JobsError) {
        if matches!(e, JobsError::Fenced { .. }) {
            self.metrics.fenced(ns, queue);
        }
    }

    // ---- calls ------------------------------------------------------------------

    async fn do_enqueue(&self, c: Caller, req: pb::EnqueueRequest) -> Result<pb::EnqueueResponse, ConnectError> {
        let job =
            convert::job_spec(req.job.into_option().ok_or_else(|| invalid("job is required"))?).map_err(core_err)?;
        let done = c.jobs.enqueue(&c.ns, &req.queue, job).await.map_err(core_err)?;
        if done.created {
            self.metrics.enqueued(&c.ns, &req.queue, 1);
        }
        Ok(pb::EnqueueResponse { enqueued: convert::enqueued(&done).into(), ..Default::default() })
    }

    async fn do_enqueue_bulk(
        &self,
        c: Caller,
        req: pb::EnqueueBulkRequest,
    ) -> Result<pb::EnqueueBulkResponse, ConnectError> {
        let key = convert::idempotency(req.idempotency.into_option());
        let key_kept = key.is_some();
        let done = if req.all_or_nothing {
            let jobs = req.jobs.into_iter().map(convert::job_spec).collect::<Result<Vec<_>, _>>().map_err(core_err)?;
            c.jobs.enqueue_all(&c.ns, &req.queue, jobs, key).await.map_err(core_err)?.into_iter().map(Ok).collect()
        } else {
            // A job that does not convert is refused alone, as one the core refuses.
            let (mut jobs, mut refused) = (Vec::new(), Vec::new());
            for (at, job) in req.jobs.into_iter().enumerate() {
                match convert::job_spec(job) {
                    Ok(job) => jobs.push(job),
                    Err(e) => refused.push((at, e)),
                }
            }
            let mut done = c.jobs.enqueue_bulk(&c.ns, &req.queue, jobs, key).await.map_err(core_err)?;
            for (at, e) in refused {
                done.insert(at, Err(e));
            }
            done
        };
        let created = done.iter().filter(|r| r.as_ref().is_ok_and(|e| e.created)).count() as u64;
        self.metrics.enqueued(&c.ns, &req.queue, created);
        Ok(pb::EnqueueBulkResponse {
            results: done.iter().map(enqueue_result).collect(),
            key_kept,
            ..Default::default()
        })
    }

    async fn do_lease(&self, c: Caller, req: pb::LeaseRequest) -> Result<pb::LeaseResponse, ConnectError> {
        let started = Instant::now();
        let options = self.bounded(convert::lease_options(req.options.into_option().unwrap_or_default()));
        if options.max == 0 {
            // Zero would wait out the whole long-poll for nothing.
            return Err(invalid("lease options.max must be at least 1"));
        }
        if let Some(w) = options.worker.as_deref().filter(|w| !w.is_empty()) {
            self.saw_worker(&c, &req.queue, w).map_err(core_err)?;
        }
        let wait = wait_of(req.wait_ms);
        let leased = if wait.is_zero() {
            c.jobs.lease(&c.ns, &req.queue, options).await
        } else {
            let _waiting = self.waiting.take(&c.ns)?;
            c.jobs.lease_wait(&c.ns, &req.queue, options, wait, Some(&self.shutdown)).await
        }
        .map_err(core_err)?;
        self.metrics.leased(&c.ns, &req.queue, leased.leases.len() as u64, started.elapsed());
        self.metrics.failed_by_lease(&c.ns, &req.queue, &leased.info);
        Ok(pb::LeaseResponse { leased: convert::leased(leased).into(), ..Default::default() })
    }

    async fn do_extend(&self, c: Caller, req: pb::ExtendRequest) -> Result<pb::ExtendResponse, ConnectError> {
        let mut items = Vec::with_capacity(req.items.len());
        for item in req.items {
            items.push((item.job_id, convert::fence(item.fence.into_option()).map_err(core_err)?));
        }
        match items.len() {
            0 => Err(invalid("extend needs at least one item")),
            1 => {
                let Some((id, fence)) = items.pop() else { return Err(invalid("extend needs at least one item")) };
                let deadline = c.jobs.extend(&c.ns, &req.queue, &id, fence, req.duration_ms).await.map_err(|e| {
                    self.count_fenced(&c.ns, &req.queue, &e);
                    core_err(e)
                })?;
                Ok(pb::ExtendResponse { deadline, ..Default::default() })
            }
            _ => {
                let failed = c.jobs.extend_many(&c.ns, &req.queue, items, req.duration_ms).await.map_err(core_err)?;
                Ok(pb::ExtendResponse { failed_job_ids: failed, ..Default::default() })
            }
        }
    }

    async fn do_complete(&self, c: Caller, req: pb::CompleteRequest) -> Result<pb::CompleteResponse, ConnectError> {
        let fence = convert::fence(req.fence.into_option()).map_err(core_err)?;
        let outcome = convert::outcome(req.outcome.into_option()).map_err(core_err)?;
        let mut opts = convert::complete_options(req.options.into_option()).map_err(core_err)?;
        opts.fetch_next = opts.fetch_next.map(|next| self.bounded(next));
        let name = outcome_name(&outcome);
        let ttl_for = req.rate_limit_ttl_for.into_option().map(convert::rate_limit);
        let id = req.job_id.clone();
        let result = match ttl_for {
            None => c.jobs.complete(&c.ns, &req.queue, &id, fence, outcome, opts).await.map(|done| (done, None)),
            Some(limiter) => c
                .jobs
                .complete_then_rate_limit_ttl(&c.ns, &req.queue, &id, fence, outcome, opts, limiter)
                .await
                .map(|(done, ttl)| (done, Some(ttl))),
        };
        let (done, ttl) = result.map_err(|e| {
            self.count_fenced(&c.ns, &req.queue, &e);
            core_err(e)
        })?;
        // A retry with no attempts left failed its job: counted as one.
        let name = if done.state == Some(JobState::Failed) { "fail" } else { name };
        if done.replayed || !done.moved {
            // Counted when it was done, or nothing was done (a job BullMQ's
            // moveJobFromActiveToWait found not active, a parent with no
            // children left to wait for).
            return Ok(pb::CompleteResponse {
                completed: convert::completed(done).into(),
                rate_limit_ttl_ms: ttl,
                ..Default::default()
            });
        }
        self.metrics.completed(&c.ns, &req.queue, name);
        if let Some(attempt) = &done.attempt {
            self.metrics.ran(&c.ns, &req.queue, attempt);
        }
        if let Some(next) = &done.next {
            self.metrics.leased(&c.ns, &req.queue, next.leases.len() as u64, Duration::ZERO);
            self.metrics.failed_by_lease(&c.ns, &req.queue, &next.info);
        }
        Ok(pb::CompleteResponse {
            completed: convert::completed(done).into(),
            rate_limit_ttl_ms: ttl,
            ..Default::default()
        })
    }

    async fn do_report(&self, c: Caller, req: pb::ReportRequest) -> Result<pb::ReportResponse, ConnectError> {
        use oneof::report_request::Report;
        let fence = convert::fence(req.fence.into_option()).map_err(core_err)?;
        let (ns, queue, id) = (&c.ns, &req.queue, &req.job_id);
        let report = match req.report {
            Some(Report::Progress(p)) => loam_jobs::Report::Progress(p),
            Some(Report::Log(l)) => loam_jobs::Report::Log { row: l.row, keep: l.keep },
            Some(Report::Data(d)) => loam_jobs::Report::Data(d),
            None => return Err(invalid("a report (progress, log or data) is required")),
        };
        let idempotency = convert::idempotency(req.idempotency.into_option());
        let log_count = c.jobs.report(ns, queue, id, fence, report, idempotency).await.map_err(|e| {
            self.count_fenced(ns, queue, &e);
            core_err(e)
        })?;
        Ok(pb::ReportResponse { log_count, ..Default::default() })
    }

    async fn do_schedule(&self, c: Caller, req: pb::ScheduleRequest) -> Result<pb::ScheduleResponse, ConnectError> {
        use oneof::schedule_request::Schedule;
        let queue = req.queue;
        let (job_id, delay_ms) = match req.schedule {
            Some(Schedule::Upsert(spec)) => {
                let spec = convert::scheduler_spec(*spec).map_err(core_err)?;
                let id = spec.id.clone();
                // A worker's scheduler replaces a server schedule of the same
                // id (`schedule::upsert` drops the server's marks).
                let done = c
                    .jobs
                    .admin(&c.ns, &queue, move |tx, q| schedule::upsert(tx, q, spec.clone()))
                    .await
                    .map_err(core_err)?;
                self.schedules.remove(&c.ns, &queue, &id);
                done.map_or((None, 0), |(j, d)| (Some(j), d))
            }
            Some(Schedule::Advance(mut a)) => {
                let template = convert::job_spec(a.job.take().unwrap_or_default()).map_err(core_err)?;
                let next = c
                    .jobs
                    .admin(&c.ns, &queue, move |tx, q| {
                        schedule::advance(tx, q, &a.id, a.next_millis, &a.producer_id, &template)
                    })
                    .await
                    .map_err(core_err)?;
                (next, 0)
            }
            Some(Schedule::Server(s)) => {
                // On the server's clock, not the caller's `loam-now-ms`: the
                // server ticks it from then on, and a schedule started in
                // 1970 would enqueue every tick since (with
                // --follow-client-clock the server's clock is the callers').
                let now = self.jobs.now_ms();
                let (spec, extra) = schedules::prepare(*s, now).map_err(core_err)?;
                let id = spec.id.clone();
                let done = self
                    .jobs
                    .admin(&c.ns, &queue, move |tx, q| {
                        schedules::catch_up(tx, q, &spec.id, now)?;
                        let done = schedule::upsert(tx, q, spec.clone())?;
                        schedule::set_extra(tx, q, &spec.id, extra.clone())?;
                        Ok(done)
                    })
                    .await
                    .map_err(core_err)?;
                self.schedules.add(&c.ns, &queue, &id);
                done.map_or((None, 0), |(j, d)| (Some(j), d))
            }
            None => return Err(invalid("a schedule (upsert, advance or server) is required")),
        };
        // Each kind enqueues the job it answers with, if any.
        if job_id.is_some() {
            self.metrics.enqueued(&c.ns, &queue, 1);
        }
        Ok(pb::ScheduleResponse { job_id, delay_ms, ..Default::default() })
    }

    async fn do_unschedule(
        &self,
        c: Caller,
        req: pb::UnscheduleRequest,
    ) -> Result<pb::UnscheduleResponse, ConnectError> {
        let id = req.scheduler_id.clone();
        let removed =
            c.jobs.admin(&c.ns, &req.queue, move |tx, q| schedule::remove(tx, q, &id)).await.map_err(core_err)?;
        self.schedules.remove(&c.ns, &req.queue, &req.scheduler_id);
        Ok(pb::UnscheduleResponse { removed, ..Default::default() })
    }

    async fn do_flow(&self, c: Caller, req: pb::FlowRequest) -> Result<pb::FlowResponse, ConnectError> {
        let mut nodes = Vec::with_capacity(req.nodes.len());
        for n in req.nodes {
            let request = convert::job_spec(n.job.into_option().ok_or_else(|| invalid("every flow node needs a job"))?)
                .map_err(core_err)?;
            nodes.push(FlowNode { queue: n.queue, request, wait_children: n.wait_children });
        }
        let queues: Vec<String> = nodes.iter().map(|n| n.queue.clone()).collect();
        if req.each_tree {
            let done = c.jobs.flows(&c.ns, nodes).await.map_err(core_err)?;
            for (q, r) in queues.iter().zip(&done) {
                if r.as_ref().is_ok_and(|e| e.created) {
                    self.metrics.enqueued(&c.ns, q, 1);
                }
            }
            return Ok(pb::FlowResponse { results: done.iter().map(enqueue_result).collect(), ..Default::default() });
        }
        let done = c.jobs.flow(&c.ns, nodes).await.map_err(core_err)?;
        for (q, e) in queues.iter().zip(&done) {
            if e.created {
                self.metrics.enqueued(&c.ns, q, 1);
            }
        }
        Ok(pb::FlowResponse { enqueued: done.iter().map(convert::enqueued).collect(), ..Default::default() })
    }

    async fn do_queue_admin(
        &self,
        c: Caller,
        req: pb::QueueAdminRequest,
    ) -> Result<pb::QueueAdminResponse, ConnectError> {
        use oneof::queue_admin_request::Op;
        let (ns, queue, jobs) = (c.ns.as_str(), req.queue.as_str(), &c.jobs);
        let mut out = pb::QueueAdminResponse::default();
        let op = req.op.ok_or_else(|| invalid("an operation is required"))?;
        let r: Result<(), JobsError> = async {
            match op {
                // The case names what to do; a false flag is a caller's mistake, not the other one.
                Op::Pause(false) | Op::Resume(false) => Err(JobsError::invalid("pause and resume take true")),
                Op::Pause(true) => jobs.admin(ns, queue, |tx, q| admin::set_paused(tx, q, true)).await,
                Op::Resume(true) => jobs.admin(ns, queue, |tx, q| admin::set_paused(tx, q, false)).await,
                Op::Drain(d) => {
                    out.count = jobs.admin(ns, queue, move |tx, q| admin::drain(tx, q, d.delayed)).await?;
                    Ok(())
                }
                Op::Clean(cl) => {
                    let (state, before, limit) = (cl.state.clone(), cl.before, cl.limit);
                    out.job_ids =
                        jobs.admin(ns, queue, move |tx, q| admin::clean(tx, q, &state, before, limit)).await?;
                    out.count = out.job_ids.len() as u64;
                    Ok(())
                }
                Op::Obliterate(o) => {
                    let (force, count) = (o.force, o.count);
                    out.more = jobs.admin(ns, queue, move |tx, q| admin::obliterate(tx, q, force, count)).await?;
                    Ok(())
                }
                Op::RetryJobs(r) => {
                    let state = convert::state_from_pb(&r.state)?;
                    let (count, before) = (r.count, r.before);
                    out.more = jobs
                        .admin(ns, queue, move |tx, q| admin::retry_finished_jobs(tx, q, state, count, before))
                        .await?;
                    Ok(())
                }
                Op::PromoteJobs(p) => {
                    let count = p.count;
                    out.more = jobs.admin(ns, queue, move |tx, q| admin::promote_jobs(tx, q, count)).await?;
                    Ok(())
                }
                Op::SetMeta(m) => {
                    let values = m.values.into_iter().collect();
                    out.count = jobs.set_meta(ns, queue, values).await?;
                    Ok(())
                }
                Op::RemoveMetaFields(m) => {
                    let fields = m.fields;
                    out.count = jobs.admin(ns, queue, move |tx, q| admin::remove_meta_fields(tx, q, &fields)).await?;
                    Ok(())
                }
                Op::SetRateLimit(s) => {
                    let ms = s.ms;
                    jobs.admin(ns, queue, move |tx, q| admin::set_rate_limit(tx, q, ms)).await
                }
                Op::RemoveRateLimitKey(_) => {
                    out.count = jobs.admin(ns, queue, admin::remove_rate_limit_key).await?;
                    Ok(())
                }
                Op::SweepStalled(s) => {
                    let max_stalled = s.max_stalled;
                    out.job_ids =
                        jobs.admin(ns, queue, move |tx, q| lease::sweep_stalled_as_worker(tx, q, max_stalled)).await?;
                    out.count = out.job_ids.len() as u64;
                    Ok(())
                }
                Op::SetConfig(cfg) => jobs.set_queue_config(ns, queue, convert::queue_config_from(*cfg)).await,
                Op::PublishEvent(p) => {
                    let fields: Vec<(String, String)> = p.fields.into_iter().map(|f| (f.key, f.value)).collect();
                    // An empty name is taken, as Redis's XADD and the in-process backend take it.
                    let (name, max) = (p.name, p.max_events);
                    out.event_id =
                        jobs.admin(ns, queue, move |tx, q| admin::publish_event(tx, q, &name, &fields, max)).await?;
                    Ok(())
                }
                Op::TrimEvents(t) => {
                    let max = t.max_length;
                    out.count = jobs.admin(ns, queue, move |tx, q| tx.trim_events(q, max)).await?;
                    Ok(())
                }
                Op::RemoveDedupKey(d) => {
                    let (id, job) = (d.dedup_id, d.job_id);
                    out.count =
                        jobs.admin(ns, queue, move |tx, q| admin::remove_dedup_key(tx, q, &id, job.as_deref())).await?;
                    Ok(())
                }
                Op::RedriveDeadLetters(r) => {
                    let limit = r.limit;
                    out.count = jobs.admin(ns, queue, move |tx, q| admin::redrive_dead_letters(tx, q, limit)).await?;
                    Ok(())
                }
                Op::RegisterWorker(w) => {
                    if w.name.is_empty() {
                        return Err(JobsError::invalid("a worker name must not be empty"));
                    }
                    self.saw_worker(&c, queue, &w.name)
                }
                Op::UnregisterWorker(w) => {
                    Jobs::check_queue_name(ns, queue)?;
                    out.count = u64::from(self.forget_worker(ns, queue, &w.name));
                    Ok(())
                }
            }
        }
        .await;
        r.map_err(core_err)?;
        Ok(out)
    }

    async fn do_job_admin(&self, c: Caller, req: pb::JobAdminRequest) -> Result<pb::JobAdminResponse, ConnectError> {
        use oneof::job_admin_request::Op;
        let (ns, queue, jobs) = (c.ns.as_str(), req.queue.as_str(), &c.jobs);
        let id = req.job_id;
        let op = req.op.ok_or_else(|| invalid("an operation is required"))?;
        let done = match op {
            Op::Remove(r) => {
                let children = r.remove_children;
                jobs.admin(ns, queue, move |tx, q| admin::remove_job(tx, q, &id, children)).await
            }
            Op::RemoveUnprocessedChildren(_) => {
                jobs.admin(ns, queue, move |tx, q| admin::remove_unprocessed_children(tx, q, &id).map(|_| true)).await
            }
            Op::RemoveChildDependency(r) => {
                let parent = r.parent_key;
                jobs.admin(ns, queue, move |tx, q| admin::remove_child_dependency(tx, q, &id, &parent)).await
            }
            Op::RetryFinished(r) => {
                let from = convert::state_from_pb(&r.state).map_err(core_err)?;
                let (made, started) = (r.reset_attempts_made, r.reset_attempts_started);
                jobs.admin(ns, queue, move |tx, q| admin::retry_finished(tx, q, &id, from, made, started).map(|_| true))
                    .await
            }
            Op::Promote(_) => jobs.admin(ns, queue, move |tx, q| admin::promote(tx, q, &id).map(|_| true)).await,
            Op::ChangeDelay(d) => {
                let delay = d.delay_ms;
                jobs.admin(ns, queue, move |tx, q| admin::change_delay(tx, q, &id, delay).map(|_| true)).await
            }
            Op::ChangePriority(p) => {
                let (priority, lifo) = (p.priority, p.lifo);
                jobs.admin(ns, queue, move |tx, q| admin::change_priority(tx, q, &id, priority, lifo).map(|_| true))
                    .await
            }
            Op::ClearLogs(l) => {
                let keep = l.keep;
                jobs.admin(ns, queue, move |tx, q| admin::clear_logs(tx, q, &id, keep).map(|_| true)).await
            }
        }
        .map_err(core_err)?;
        Ok(pb::JobAdminResponse { done, ..Default::default() })
    }

    async fn do_query(&self, c: Caller, req: pb::QueryRequest) -> Result<pb::QueryResponse, ConnectError> {
        use oneof::query_request::Query;
        use oneof::query_response::Result as R;
        let _waiting = if query_waits(&req) { Some(self.waiting.take(&c.ns)?) } else { None };
        let (ns, queue, jobs) = (c.ns.as_str(), req.queue.as_str(), &c.jobs);
        let q = req.query.ok_or_else(|| invalid("a query is required"))?;
        // Reads that gather jobs stop at the cap; every answer is checked
        // against it, but an event read, which is cut short instead.
        let mut size = self.answer_size();
        let cut_short = matches!(q, Query::Events(_));
        // No result where there is nothing to answer (metrics never kept).
        let result: Result<Option<R>, JobsError> = async {
            Ok(Some(match q {
                Query::Jobs(j) => {
                    let slots = jobs.query(ns, queue, |tx, q| {
                        let mut slots = Vec::with_capacity(j.ids.len().min(1024));
                        for id in &j.ids {
                            let job = query::get_job(tx, q, id)?;
                            let slot = pb::JobSlot { job: job.map(convert::job).into(), ..Default::default() };
                            if !size.fits(&slot) {
                                break;
                            }
                            slots.push(slot);
                        }
                        Ok(slots)
                    })?;
                    R::from(pb::JobSlots { slots, ..Default::default() })
                }
                Query::Counts(cnt) => {
                    let counts =
                        jobs.query(ns, queue, |tx, q| query::counts_by_type(tx, q, &cnt.types, cnt.delayed_before))?;
                    R::from(pb::CountList { counts, ..Default::default() })
                }
                Query::CountsPerPriority(p) => {
                    let counts = jobs.query(ns, queue, |tx, q| query::counts_per_priority(tx, q, &p.priorities))?;
                    R::from(pb::CountList { counts, ..Default::default() })
                }
                Query::Ranges(r) => {
                    let ranges = jobs.query(ns, queue, |tx, q| {
                        let mut out = Vec::with_capacity(r.types.len());
                        for t in &r.types {
                            let ids = match JobState::parse(t) {
                                Some(state) => query::range(tx, q, state, r.start, r.end, r.asc)?,
                                None => Vec::new(),
                            };
                            out.push(pb::IdList { ids, ..Default::default() });
                        }
                        Ok(out)
                    })?;
                    R::from(pb::IdRanges { ranges, ..Default::default() })
                }
                Query::Logs(l) => {
                    let (logs, count) =
                        jobs.query(ns, queue, |tx, q| query::logs(tx, q, &l.job_id, l.start, l.end, l.asc))?;
                    R::from(pb::LogPage { logs, count, ..Default::default() })
                }
                Query::Dependencies(d) => {
                    let status = convert::dependency_status_from(&d.status)?;
                    let (start, end) = (d.start.unwrap_or(0), d.end.unwrap_or(-1));
                    jobs.query(ns, queue, |tx, q| {
                        let (deps, total) = query::dependency_page(tx, q, &d.job_id, status, start, end)?;
                        let mut slots = Vec::new();
                        if d.with_jobs {
                            for child in query::dependency_jobs(tx, q, &deps) {
                                let slot = pb::JobSlot { job: child?.map(convert::job).into(), ..Default::default() };
                                if !size.fits(&slot) {
                                    break;
                                }
                                slots.push(slot);
                            }
                        }
                        let dependencies = deps.iter().map(|(k, d)| convert::dependency(k, d)).collect();
                        Ok(R::from(pb::DependencyList { dependencies, jobs: slots, total, ..Default::default() }))
                    })?
                }
                Query::Metrics(m) => {
                    let kind = MetricsKind::parse(&m.kind)
                        .ok_or_else(|| JobsError::invalid("metrics kind must be completed or failed"))?;
                    match jobs.query(ns, queue, |tx, q| query::metrics(tx, q, kind))? {
                        Some(rec) => R::from(convert::metrics(&rec, m.start.unwrap_or(0), m.end.unwrap_or(-1))),
                        None => return Ok(None),
                    }
                }
                Query::Meta(m) => {
                    let all = jobs.query(ns, queue, query::meta)?;
                    let values = if m.fields.is_empty() {
                        all.into_iter().collect()
                    } else {
                        all.into_iter().filter(|(k, _)| m.fields.contains(k)).collect()
                    };
                    R::from(pb::MetaValues { values, ..Default::default() })
                }
                Query::DedupJob(d) => R::DedupJob(
                    jobs.query(ns, queue, |tx, q| query::dedup_job_id(tx, q, &d.dedup_id))?.unwrap_or_default(),
                ),
                Query::RateLimitTtl(r) => {
                    R::TtlMs(jobs.query(ns, queue, |tx, q| query::rate_limit_ttl_or_missing(tx, q, r.max_jobs))?)
                }
                Query::IsMaxed(_) => R::Flag(jobs.query(ns, queue, query::is_maxed)?),
                Query::LastEvent(_) => R::Number(jobs.query(ns, queue, query::last_event_seq)?),
                Query::Events(e) => {
                    let limit = if e.limit == 0 { EVENT_BATCH } else { (e.limit as usize).min(MAX_EVENTS_PER_READ) };
                    let cursor = e
                        .after_id
                        .as_deref()
                        .map(|id| jobs.query(ns, queue, |tx, q| query::event_cursor(tx, q, id)))
                        .transpose()?;
                    let after = cursor.map_or(e.after, |c| Some(c.after));
                    let mut events = jobs
                        .read_events(ns, queue, after, limit, wait_of(e.wait_ms), Some(&self.shutdown), None)
                        .await?;
                    // Events a foreign id does not read: none, as a wait with none answers.
                    if let Some(cursor) = cursor {
                        events = cursor.keep(events);
                    }
                    // Fewer events rather than a refusal, which the reader
                    // would meet again each time it asked: it reads on from
                    // the last event it got. One at least, whatever its size.
                    let mut list = Vec::with_capacity(events.len());
                    for e in &events {
                        let event = convert::event(e);
                        if !size.room_for(&event) && !list.is_empty() {
                            break;
                        }
                        list.push(event);
                    }
                    R::from(pb::EventList { events: list, ..Default::default() })
                }
                Query::WaitForJob(w) => R::Flag(
                    jobs.wait_for_job(ns, queue, wait_of(w.wait_ms), Some(&self.shutdown), None).await?.is_some(),
                ),
                Query::Scheduler(s) => {
                    let rec = jobs.query(ns, queue, |tx, q| schedule::get(tx, q, &s.id))?;
                    R::from(pb::SchedulerSlot {
                        scheduler: rec.as_ref().map(convert::scheduler).into(),
                        ..Default::default()
                    })
                }
                Query::Schedulers(s) => {
                    let recs = jobs.query(ns, queue, |tx, q| schedule::list(tx, q, s.start, s.end, s.asc))?;
                    R::from(pb::SchedulerList {
                        schedulers: recs.iter().map(convert::scheduler).collect(),
                        ..Default::default()
                    })
                }
                Query::SchedulerCount(_) => R::Number(jobs.query(ns, queue, schedule::count)?),
                Query::Workers(_) => {
                    Jobs::check_queue_name(ns, queue)?;
                    let workers = self.workers_of(ns, queue);
                    let names = workers.iter().map(|w| w.name.clone()).collect();
                    R::from(pb::NameList { names, workers, ..Default::default() })
                }
                Query::Queues(_) => {
                    let names = jobs.read(ns, |tx| query::queues(tx, ns))?.into_iter().map(|q| q.name).collect();
                    R::from(pb::NameList { names, ..Default::default() })
                }
                Query::Config(_) => {
                    R::from(convert::queue_config_to(&jobs.query(ns, queue, |tx, q| tx.queue_config(q))?))
                }
            }))
        }
        .await;
        let answer = pb::QueryResponse { result: result.map_err(core_err)?, ..Default::default() };
        if !cut_short {
            size.whole(&answer)?;
        }
        Ok(answer)
    }

    // ---- the result store ------------------------------------------------------------

    async fn do_result_get(&self, c: Caller, req: pb::ResultGetRequest) -> Result<pb::ResultGetResponse, ConnectError> {
        let value = c.jobs.read(&c.ns, |tx| results::get(tx, &req.key)).map_err(core_err)?;
        Ok(pb::ResultGetResponse { value, ..Default::default() })
    }

    async fn do_result_mget(
        &self,
        c: Caller,
        req: pb::ResultMGetRequest,
    ) -> Result<pb::ResultMGetResponse, ConnectError> {
        let mut size = self.answer_size();
        let values = c
            .jobs
            .read(&c.ns, |tx| {
                let mut values = Vec::with_capacity(req.keys.len().min(1024));
                for key in &req.keys {
                    let value = pb::ResultValue { value: results::get(tx, key)?, ..Default::default() };
                    if !size.fits(&value) {
                        break;
                    }
                    values.push(value);
                }
                Ok(values)
            })
            .map_err(core_err)?;
        let answer = pb::ResultMGetResponse { values, ..Default::default() };
        size.whole(&answer)?;
        Ok(answer)
    }

    async fn do_result_set(&self, c: Caller, req: pb::ResultSetRequest) -> Result<pb::ResultSetResponse, ConnectError> {
        let (key, value, ttl) = (req.key, req.value, req.ttl_ms);
        c.jobs.write(&c.ns, true, move |tx| results::set(tx, &key, value.clone(), ttl)).await.map_err(core_err)?;
        Ok(pb::ResultSetResponse::default())
    }

    async fn do_result_delete(
        &self,
        c: Caller,
        req: pb::ResultDeleteRequest,
    ) -> Result<pb::ResultDeleteResponse, ConnectError> {
        let key = req.key;
        let deleted = c.jobs.write(&c.ns, true, move |tx| results::delete(tx, &key)).await.map_err(core_err)?;
        Ok(pb::ResultDeleteResponse { deleted, ..Default::default() })
    }

    async fn do_result_incr(
        &self,
        c: Caller,
        req: pb::ResultIncrRequest,
    ) -> Result<pb::ResultIncrResponse, ConnectError> {
        let (key, member, ttl) = (req.key, req.member, req.ttl_ms);
        let counted =
            c.jobs.write(&c.ns, true, move |tx| results::incr(tx, &key, &member, ttl)).await.map_err(core_err)?;
        Ok(pb::ResultIncrResponse { count: counted.count, added: counted.added, ..Default::default() })
    }

    async fn do_result_expire(
        &self,
        c: Caller,
        req: pb::ResultExpireRequest,
    ) -> Result<pb::ResultExpireResponse, ConnectError> {
        let (key, ttl) = (req.key, req.ttl_ms);
        let found = c.jobs.write(&c.ns, true, move |tx| results::expire(tx, &key, ttl)).await.map_err(core_err)?;
        Ok(pb::ResultExpireResponse { found, ..Default::default() })
    }
}

impl JobsSvc {
    /// One call of a Session: the unary RPC its request names, with its
    /// answer in the session's oneof. Counted by method like a single call.
    pub(crate) async fn dispatch(
        &self,
        c: Result<Caller, ConnectError>,
        call: oneof::session_request::Call,
    ) -> Result<oneof::session_response::Result, ConnectError> {
        use oneof::session_request::Call as C;
        use oneof::session_response::Result as R;
        let ns = c.as_ref().map_or_else(|_| String::new(), |c| c.ns.clone());
        Ok(match call {
            C::Enqueue(r) => R::from(self.timed(&ns, "Enqueue", async { self.do_enqueue(c?, *r).await }).await?),
            C::EnqueueBulk(r) => {
                R::from(self.timed(&ns, "EnqueueBulk", async { self.do_enqueue_bulk(c?, *r).await }).await?)
            }
            C::Lease(r) => R::from(self.timed(&ns, "Lease", async { self.do_lease(c?, *r).await }).await?),
            C::Extend(r) => R::from(self.timed(&ns, "Extend", async { self.do_extend(c?, *r).await }).await?),
            C::Complete(r) => R::from(self.timed(&ns, "Complete", async { self.do_complete(c?, *r).await }).await?),
            C::Report(r) => R::from(self.timed(&ns, "Report", async { self.do_report(c?, *r).await }).await?),
            C::Schedule(r) => R::from(self.timed(&ns, "Schedule", async { self.do_schedule(c?, *r).await }).await?),
            C::Unschedule(r) => {
                R::from(self.timed(&ns, "Unschedule", async { self.do_unschedule(c?, *r).await }).await?)
            }
            C::Flow(r) => R::from(self.timed(&ns, "Flow", async { self.do_flow(c?, *r).await }).await?),
            C::QueueAdmin(r) => {
                R::from(self.timed(&ns, "QueueAdmin", async { self.do_queue_admin(c?, *r).await }).await?)
            }
            C::JobAdmin(r) => R::from(self.timed(&ns, "JobAdmin", async { self.do_job_admin(c?, *r).await }).await?),
            C::Query(r) => R::from(self.timed(&ns, "Query", async { self.do_query(c?, *r).await }).await?),
            C::ResultGet(r) => R::from(self.timed(&ns, "ResultGet", async { self.do_result_get(c?, *r).await }).await?),
            C::ResultMGet(r) => {
                R::from(self.timed(&ns, "ResultMGet", async { self.do_result_mget(c?, *r).await }).await?)
            }
            C::ResultSet(r) => R::from(self.timed(&ns, "ResultSet", async { self.do_result_set(c?, *r).await }).await?),
            C::ResultDelete(r) => {
                R::from(self.timed(&ns, "ResultDelete", async { self.do_result_delete(c?, *r).await }).await?)
            }
            C::ResultIncr(r) => {
                R::from(self.timed(&ns, "ResultIncr", async { self.do_result_incr(c?, *r).await }).await?)
            }
            C::ResultExpire(r) => {
                R::from(self.timed(&ns, "ResultExpire", async { self.do_result_expire(c?, *r).await }).await?)
            }
            C::Cancel(_) => return Err(invalid("a cancel is not a call")),
        })
    }

    /// The jobs a session's call leased for a caller that cancelled it while
    /// it ran (a Lease that does not wait, or a Complete's next job): its
    /// write runs to its end (see `session`), and these go back at once, as a
    /// dropped lease's do, and out of its answer.
    pub(crate) fn give_back_leased(&self, ns: &str, queue: &str, answer: &mut oneof::session_response::Result) {
        use oneof::session_response::Result as R;
        let leased = match answer {
            R::Lease(r) => r.leased.as_option_mut(),
            R::Complete(r) => r.completed.as_option_mut().and_then(|c| c.next.as_option_mut()),
            _ => None,
        };
        for lease in leased.map(|l| std::mem::take(&mut l.leases)).unwrap_or_default() {
            let Some(job) = lease.job.into_option() else { continue };
            // Fenced by the lease's epoch: a job the sweep took back is left alone.
            let back = Outcome::Release { after_ms: None };
            self.jobs
                .complete(ns, queue, &job.id, Fence::Epoch(lease.epoch), back, CompleteOptions::default())
                .then(|_| {});
        }
    }

    /// The namespace of a session, checked once when it opens.
    pub(crate) fn session_namespace(&self, ctx: &RequestContext) -> Result<String, ConnectError> {
        self.caller(ctx).map(|c| c.ns)
    }

    pub(crate) fn shutdown(&self) -> &Interrupt {
        &self.shutdown
    }
}

#[allow(refining_impl_trait, reason = "each call returns its concrete response message")]
impl pb::JobsService for JobsSvc {
    async fn enqueue(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::EnqueueRequest>,
    ) -> ServiceResult<pb::EnqueueResponse> {
        self.unary("Enqueue", &ctx, r, None, |c, r| self.do_enqueue(c, r)).await
    }

    async fn enqueue_bulk(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::EnqueueBulkRequest>,
    ) -> ServiceResult<pb::EnqueueBulkResponse> {
        self.unary("EnqueueBulk", &ctx, r, None, |c, r| self.do_enqueue_bulk(c, r)).await
    }

    async fn lease(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::LeaseRequest>,
    ) -> ServiceResult<pb::LeaseResponse> {
        self.unary("Lease", &ctx, r, Some(lease_waits), |c, r| self.do_lease(c, r)).await
    }

    async fn extend(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::ExtendRequest>,
    ) -> ServiceResult<pb::ExtendResponse> {
        self.unary("Extend", &ctx, r, None, |c, r| self.do_extend(c, r)).await
    }

    async fn complete(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::CompleteRequest>,
    ) -> ServiceResult<pb::CompleteResponse> {
        self.unary("Complete", &ctx, r, None, |c, r| self.do_complete(c, r)).await
    }

    async fn report(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::ReportRequest>,
    ) -> ServiceResult<pb::ReportResponse> {
        self.unary("Report", &ctx, r, None, |c, r| self.do_report(c, r)).await
    }

    async fn schedule(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::ScheduleRequest>,
    ) -> ServiceResult<pb::ScheduleResponse> {
        self.unary("Schedule", &ctx, r, None, |c, r| self.do_schedule(c, r)).await
    }

    async fn unschedule(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::UnscheduleRequest>,
    ) -> ServiceResult<pb::UnscheduleResponse> {
        self.unary("Unschedule", &ctx, r, None, |c, r| self.do_unschedule(c, r)).await
    }

    async fn flow(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::FlowRequest>,
    ) -> ServiceResult<pb::FlowResponse> {
        self.unary("Flow", &ctx, r, None, |c, r| self.do_flow(c, r)).await
    }

    async fn queue_admin(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::QueueAdminRequest>,
    ) -> ServiceResult<pb::QueueAdminResponse> {
        self.unary("QueueAdmin", &ctx, r, None, |c, r| self.do_queue_admin(c, r)).await
    }

    async fn job_admin(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::JobAdminRequest>,
    ) -> ServiceResult<pb::JobAdminResponse> {
        self.unary("JobAdmin", &ctx, r, None, |c, r| self.do_job_admin(c, r)).await
    }

    async fn query(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::QueryRequest>,
    ) -> ServiceResult<pb::QueryResponse> {
        self.unary("Query", &ctx, r, Some(query_waits), |c, r| self.do_query(c, r)).await
    }

    async fn result_get(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::ResultGetRequest>,
    ) -> ServiceResult<pb::ResultGetResponse> {
        self.unary("ResultGet", &ctx, r, None, |c, r| self.do_result_get(c, r)).await
    }

    async fn result_m_get(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::ResultMGetRequest>,
    ) -> ServiceResult<pb::ResultMGetResponse> {
        self.unary("ResultMGet", &ctx, r, None, |c, r| self.do_result_mget(c, r)).await
    }

    async fn result_set(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::ResultSetRequest>,
    ) -> ServiceResult<pb::ResultSetResponse> {
        self.unary("ResultSet", &ctx, r, None, |c, r| self.do_result_set(c, r)).await
    }

    async fn result_delete(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::ResultDeleteRequest>,
    ) -> ServiceResult<pb::ResultDeleteResponse> {
        self.unary("ResultDelete", &ctx, r, None, |c, r| self.do_result_delete(c, r)).await
    }

    async fn result_incr(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::ResultIncrRequest>,
    ) -> ServiceResult<pb::ResultIncrResponse> {
        self.unary("ResultIncr", &ctx, r, None, |c, r| self.do_result_incr(c, r)).await
    }

    async fn result_expire(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::ResultExpireRequest>,
    ) -> ServiceResult<pb::ResultExpireResponse> {
        self.unary("ResultExpire", &ctx, r, None, |c, r| self.do_result_expire(c, r)).await
    }

    async fn watch(
        &self,
        ctx: RequestContext,
        r: ServiceRequest<'_, pb::WatchRequest>,
    ) -> ServiceResult<ServiceStream<pb::WatchResponse>> {
        self.unary("Watch", &ctx, r, None, |c, r| self.do_watch(c, r)).await
    }

    async fn session(
        &self,
        ctx: RequestContext,
        requests: InboundStream<pb::SessionRequest>,
    ) -> ServiceResult<ServiceStream<pb::SessionResponse>> {
        let ns = self.caller(&ctx).map(|c| c.ns).unwrap_or_default();
        self.observe(&ns, "Session", crate::session::open(self.clone(), ctx, requests)).await
    }
}

/// An answer's size as a read builds it, against `--max-response-bytes`.
/// Without a cap, a Query for one 10 MB job's id a hundred times built a
/// 1 GB answer (3 GB at its peak).
struct AnswerSize {
    used: u64,
    cap: u64,
}

impl AnswerSize {
    /// Counts `part` of the answer; false once the answer is over the cap,
    /// when the read should stop gathering.
    fn fits(&mut self, part: &impl buffa::Message) -> bool {
        self.used = self.used.saturating_add(u64::from(part.encoded_len()));
        self.used <= self.cap
    }

    /// Counts `part` if the answer has room for it; false, counting
    /// nothing, if not: for reads whose answer may be cut short.
    fn room_for(&mut self, part: &impl buffa::Message) -> bool {
        let used = self.used.saturating_add(u64::from(part.encoded_len()));
        let room = used <= self.cap;
        if room {
            self.used = used;
        }
        room
    }

    /// The whole answer, refused if it, or the parts counted on the way, is
    /// over the cap.
    fn whole(&self, answer: &impl buffa::Message) -> Result<(), ConnectError> {
        let used = self.used.max(u64::from(answer.encoded_len()));
        if used <= self.cap { Ok(()) } else { Err(response_too_large(self.cap, used)) }
    }
}

/// Whether a Lease may wait for a job. Long-polls hold no request budget:
/// their requests are small, and a wait of up to 30 s holding bytes held up
/// the calls that would end it (a request needing the whole budget waited for
/// every long-poll, and every call behind it with it).
pub(crate) fn lease_waits(r: &pb::LeaseRequest) -> bool {
    r.wait_ms > 0
}

/// Whether a Query may wait (an event read or a wait for a job); see [`lease_waits`].
pub(crate) fn query_waits(r: &pb::QueryRequest) -> bool {
    use oneof::query_request::Query;
    match &r.query {
        Some(Query::Events(e)) => e.wait_ms > 0,
        Some(Query::WaitForJob(w)) => w.wait_ms > 0,
        _ => false,
    }
}

/// One job's answer in a call that answers per job (EnqueueBulk, a Flow of
/// several trees): what was enqueued, or why not.
fn enqueue_result(r: &Result<Enqueued, JobsError>) -> pb::EnqueueResult {
    let result = match r {
        Ok(e) => oneof::enqueue_result::Result::from(convert::enqueued(e)),
        Err(e) => oneof::enqueue_result::Result::from(pb::BulkError {
            code: code_name(e).into(),
            message: e.to_string(),
            detail: detail(e).into(),
            ..Default::default()
        }),
    };
    pb::EnqueueResult { result: Some(result), ..Default::default() }
}

fn bad_now() -> ConnectError {
    invalid("loam-now-ms must be milliseconds since the epoch")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_are_capped() {
        assert_eq!(wait_of(120_000), MAX_WAIT);
        assert_eq!(wait_of(5), Duration::from_millis(5));
    }
}
