//! `LoamQueue`: one BullMQ queue backend over the shared core. Every method is
//! one call into the core (one transaction for writes, one snapshot for reads)
//! and returns BullMQ's shapes (JSON text where the shape is nested, see
//! [`crate::convert`]). Writes are submitted on the JavaScript thread, in call
//! order, and settled by the core's committing thread itself (see
//! [`settle_with`]); reads and waits are async functions on napi's tokio
//! runtime. Every method but the lifecycle ones takes the host's `Date.now()`
//! first, which the core's clock follows.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use napi::bindgen_prelude::*;
use napi_derive::napi;
use serde::Deserialize;

use loam_jobs::keys::QueueId;
use loam_jobs::notify::Tell;
use loam_jobs::ops::{admin, complete, enqueue, lease, query, schedule};
use loam_jobs::tx::Tx;
use loam_jobs::{
    CompleteOptions, Completed, DependencyStatus, Durability, Event, FlowNode, Interrupt, JobState, Jobs, JobsError,
    LeaseRequest, MetricsKind, Outcome, Pending, RateLimit, Retention, SchedulerSpec, as_text,
};

use crate::convert::{self, FailureFields, Finished, KeepOpt, NewJob, NextJob, StreamEntry, whole};
use crate::error::{Op, invalid};
use crate::promise::FirstSettles;
use crate::store::{self, OpenOptions, SharedStore};

/// The id a flow node got, or the BullMQ code of its refusal.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum FlowId {
    Id(String),
    Code(i32),
}

/// One `addFlow` result, `[error message | null, id | code]` (BullMQ's shape,
/// with the error as its tagged message, see `src/errors.ts`).
type FlowResult = (Option<String>, FlowId);

/// `readEvents`'s answer: the events as BullMQ's stream entries in JSON, or
/// null for none.
fn stream_entries(events: Vec<Event>) -> Option<String> {
    if events.is_empty() {
        return None;
    }
    let entries: Vec<StreamEntry> = events.into_iter().map(StreamEntry::from).collect();
    Some(json(&entries))
}

/// Most events one `readEvents` returns.
const EVENTS_PER_READ: usize = 1000;

#[derive(Deserialize, Debug, Clone, Copy)]
struct LimiterOpt {
    max: f64,
    duration: f64,
}

#[derive(Deserialize, Debug, Clone, Copy, Default)]
#[serde(rename_all = "camelCase")]
struct MetricsOpt {
    max_data_points: Option<f64>,
}

/// What `loamBackend()` and BullMQ's factory options give a backend: where the
/// store is, which queue, and the worker settings BullMQ keeps out of the
/// per-call arguments (`lockDuration`, `limiter`, `maxStalledCount`, ...).
#[derive(Deserialize, Debug, Default)]
#[serde(rename_all = "camelCase")]
struct BackendOptions {
    data_dir: String,
    namespace: Option<String>,
    /// `"immediate"` (fsync per acknowledged write, the default) or `"relaxed"`.
    durability: Option<String>,
    flush_interval_ms: Option<f64>,
    queue: String,
    /// With BullMQ's default where a backend has none (`WORKER_DEFAULTS`, in
    /// `src/common.ts`).
    lock_duration: f64,
    limiter: Option<LimiterOpt>,
    max_stalled_count: f64,
    metrics: Option<MetricsOpt>,
    remove_on_complete: Option<KeepOpt>,
    remove_on_fail: Option<KeepOpt>,
    /// The worker's `name` (BullMQ's `processedBy`).
    name: Option<String>,
}

/// The worker settings, shared by a backend and its `forQueue` siblings.
#[derive(Debug, Clone)]
struct WorkerSettings {
    lock_duration_ms: u64,
    limiter: Option<RateLimit>,
    max_stalled: u32,
    metrics_max_points: Option<u64>,
    remove_on_complete: Option<Retention>,
    remove_on_fail: Option<Retention>,
    name: Option<String>,
}

/// `flushIntervalMs`, 100 by default: a whole number of milliseconds, as
/// `loam-jobs serve --flush-interval-ms` takes it. Read leniently, like a
/// BullMQ setting, -1 meant flushing at every commit and 1.5 one millisecond.
fn flush_interval_ms(given: Option<f64>) -> Result<u64> {
    match given {
        None => Ok(100),
        Some(n) if n >= 0.0 && n.fract() == 0.0 && n <= u64::MAX as f64 => Ok(n as u64),
        Some(n) => Err(invalid(format!("flushIntervalMs must be a whole number of milliseconds, 0 or more; got {n}"))),
    }
}

impl WorkerSettings {
    fn from_options(o: &BackendOptions) -> Self {
        Self {
            lock_duration_ms: whole(o.lock_duration),
            limiter: o
                .limiter
                .map(|l| RateLimit { max: whole(l.max), duration_ms: whole(l.duration) })
                .filter(|l| l.max > 0),
            max_stalled: whole(o.max_stalled_count).min(u64::from(u32::MAX)) as u32,
            metrics_max_points: o.metrics.and_then(|m| m.max_data_points).map(whole).filter(|n| *n > 0),
            remove_on_complete: o.remove_on_complete.map(KeepOpt::to_core),
            remove_on_fail: o.remove_on_fail.map(KeepOpt::to_core),
            name: o.name.clone(),
        }
    }
}

/// BullMQ's token `"0"` (and no token) is an admin write with no lease check.
fn fence(token: Option<&str>) -> loam_jobs::Fence {
    match token {
        None | Some("") | Some("0") => loam_jobs::Fence::Unchecked,
        Some(t) => loam_jobs::Fence::Token(t.to_string()),
    }
}

/// The fence of a move made as the lease's holder (moveToFinished): only
/// `"0"` acts without a lock, as Redis's scripts skip the check for it; no
/// token is Redis's `""` (ioredis sends `undefined` so), which holds no
/// lock, so another worker's lock is refused (-6), not taken over.
fn holder_fence(token: &str) -> loam_jobs::Fence {
    match token {
        "0" => loam_jobs::Fence::Unchecked,
        t => lock_fence(t),
    }
}

/// The fence of a lock extension: Redis's extendLock compares the token as
/// it is, `"0"` too, so only the lock's holder extends it.
fn lock_fence(token: &str) -> loam_jobs::Fence {
    loam_jobs::Fence::Token(token.to_string())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The promise of a write already submitted to the core. Write methods are
/// synchronous napi functions that submit on the JavaScript thread, so the
/// core applies writes in the order JavaScript issued them, awaited or not
/// (as Redis does for the commands of one connection). The core's committer
/// settles the promise itself (see [`crate::promise`]), with no hop through
/// an async runtime; a panic while shaping the result rejects it.
fn settle_with<'env, R, T>(
    env: &'env Env,
    pending: Pending<R>,
    finish: impl FnOnce(std::result::Result<R, JobsError>) -> Result<T> + Send + 'static,
) -> Result<PromiseRaw<'env, T>>
where
    R: Send + 'static,
    T: ToNapiValue + Send + 'static,
{
    let (resolver, promise) = crate::promise::promise(env, crate::promise::Kind::Write)?;
    pending.then(move |result| {
        let shaped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| finish(result)))
            .unwrap_or_else(|panic| Err(crate::error::panicked(panic)));
        resolver.settle(shaped);
    });
    Ok(promise)
}

/// [`settle_with`] for a write whose errors are `op`'s BullMQ errors.
fn settle<'env, R, T>(
    env: &'env Env,
    op: Op,
    pending: Pending<R>,
    map: impl FnOnce(R) -> T + Send + 'static,
) -> Result<PromiseRaw<'env, T>>
where
    R: Send + 'static,
    T: ToNapiValue + Send + 'static,
{
    settle_with(env, pending, move |r| r.map(map).map_err(|e| op.error(e)))
}

/// `{result?, finishedOn}` of moveToCompleted / moveToFailed, as JSON.
fn finished_json(done: &Completed, fetch_next: bool) -> String {
    let finished = Finished {
        result: if fetch_next { done.next.as_ref().map(NextJob::new) } else { None },
        finished_on: done.finished_on.unwrap_or_else(now_ms),
    };
    json(&finished)
}

fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "null".into())
}

fn parse<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> Result<T> {
    convert::from_json(text).map_err(|e| invalid(format!("{what} is not valid JSON of the expected shape: {e}")))
}

/// A lease expiring, a job gone or not active: `extendLock` reports these as
/// "not extended" (0), as Redis does; anything else is a real failure.
fn is_lock_refusal(e: &JobsError) -> bool {
    matches!(
        e,
        JobsError::Fenced { .. } | JobsError::NotFound(_) | JobsError::Precondition(_) | JobsError::DeadlineExceeded
    )
}

#[napi]
pub struct LoamQueue {
    store: Arc<SharedStore>,
    ns: String,
    queue: String,
    settings: Arc<WorkerSettings>,
    /// Siblings made by `forQueue` share their creator's store use.
    owns_store: bool,
    /// Closed: its calls are refused, as Redis refuses a closed connection's,
    /// though another backend of the process keeps the store open.
    closed: Arc<AtomicBool>,
    /// A sibling's (`forQueue`) owner's: closed with it, as on Redis, where
    /// the siblings share their owner's connection.
    owner_closed: Option<Arc<AtomicBool>>,
    /// Cuts `waitForJob` short (BullMQ's `disconnectBlocking`).
    blocking: Interrupt,
    /// Cuts `readEvents` short (`disconnect` / `close` of a QueueEvents).
    events: Interrupt,
}

impl LoamQueue {
    fn jobs(&self) -> Result<Jobs> {
        if self.is_closed() {
            return Err(napi::Error::from_reason("[loam:unavailable] the backend is closed"));
        }
        self.store.jobs()
    }

    /// One write transaction on this queue, submitted now (see [`settle`]).
    fn write<'env, T, F>(&self, env: &'env Env, op: Op, body: F) -> Result<PromiseRaw<'env, T>>
    where
        T: ToNapiValue + Send + 'static,
        F: FnMut(&mut Tx, &QueueId) -> std::result::Result<T, JobsError> + Send + 'static,
    {
        self.write_map(env, op, body, |v| v)
    }

    /// [`Self::write`], with the committed result turned into what JavaScript gets.
    fn write_map<'env, R, T, F>(
        &self,
        env: &'env Env,
        op: Op,
        body: F,
        map: impl FnOnce(R) -> T + Send + 'static,
    ) -> Result<PromiseRaw<'env, T>>
    where
        R: Send + 'static,
        T: ToNapiValue + Send + 'static,
        F: FnMut(&mut Tx, &QueueId) -> std::result::Result<R, JobsError> + Send + 'static,
    {
        settle(env, op, self.jobs()?.admin(&self.ns, &self.queue, body), map)
    }

    /// Ends the lease of the job `op` names with `outcome`, submitted now.
    fn complete<'env, T: ToNapiValue + Send + 'static>(
        &self,
        env: &'env Env,
        op: Op,
        fence: loam_jobs::Fence,
        outcome: Outcome,
        opts: CompleteOptions,
        map: impl FnOnce(Completed) -> T + Send + 'static,
    ) -> Result<PromiseRaw<'env, T>> {
        let job_id = op.job_id.clone().unwrap_or_default();
        let pending = self.jobs()?.complete(&self.ns, &self.queue, &job_id, fence, outcome, opts);
        settle(env, op, pending, map)
    }

    /// moveToCompleted / moveToFailed: ends the active job `job_id` with
    /// `outcome` and answers `{result?, finishedOn}` as JSON.
    fn finish_active<'env>(
        &self,
        env: &'env Env,
        job_id: &str,
        token: &str,
        fetch_next: bool,
        outcome: Outcome,
    ) -> Result<PromiseRaw<'env, String>> {
        let op = Op::new("moveToFinished").job(job_id).state("active");
        let opts = self.complete_options(token, fetch_next);
        self.complete(env, op, holder_fence(token), outcome, opts, move |done| finished_json(&done, fetch_next))
    }

    /// One read on a snapshot of this queue.
    fn read<T>(&self, op: Op, f: impl FnOnce(&mut Tx, &QueueId) -> std::result::Result<T, JobsError>) -> Result<T> {
        self.jobs()?.query(&self.ns, &self.queue, f).map_err(|e| op.error(e))
    }

    fn lease_request(&self, token: &str, name: Option<String>) -> LeaseRequest {
        LeaseRequest {
            max: 1,
            token: token.to_string(),
            worker: name.or_else(|| self.settings.name.clone()),
            lock_duration_ms: self.settings.lock_duration_ms,
            names: None,
            limiter: self.settings.limiter.clone(),
            max_bytes: None,
            // BullMQ's Worker fails a job marked to fail itself.
            fail_deferred: false,
        }
    }

    fn complete_options(&self, token: &str, fetch_next: bool) -> CompleteOptions {
        CompleteOptions {
            fetch_next: fetch_next.then(|| self.lease_request(token, None)),
            remove_on_complete: self.settings.remove_on_complete,
            remove_on_fail: self.settings.remove_on_fail,
            metrics_max_points: self.settings.metrics_max_points,
            // In-process, an answer is never lost on its way.
            idempotency: None,
        }
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst) || self.owner_closed.as_ref().is_some_and(|o| o.load(Ordering::SeqCst))
    }

    fn sibling(&self, queue: String) -> Self {
        LoamQueue {
            store: Arc::clone(&self.store),
            ns: self.ns.clone(),
            queue,
            settings: Arc::clone(&self.settings),
            owns_store: false,
            closed: Arc::new(AtomicBool::new(false)),
            owner_closed: Some(self.owner_closed.clone().unwrap_or_else(|| Arc::clone(&self.closed))),
            blocking: Interrupt::new(),
            events: Interrupt::new(),
        }
    }
}

#[napi]
impl LoamQueue {
    /// Joins the store of `options.dataDir`, or starts opening it on a thread
    /// of its own, and binds `options.queue`; returns at once. Fails here for
    /// options it refuses; what the open finds (another process holding the
    /// store, say) fails [`LoamQueue::opened`] and every call.
    #[napi(factory, catch_unwind)]
    pub fn open(options: String) -> Result<LoamQueue> {
        let o: BackendOptions = parse("backend options", &options)?;
        let durability = match o.durability.as_deref() {
            None | Some("immediate") => Durability::Immediate,
            Some("relaxed") => Durability::relaxed(flush_interval_ms(o.flush_interval_ms)?),
            Some(other) => {
                return Err(invalid(format!("unknown durability {other:?}: use \"immediate\" or \"relaxed\"")));
            }
        };
        let ns = o.namespace.clone().unwrap_or_else(|| "default".into());
        // Refused here, as the Queue or Worker is made: a Worker refused by each
        // fetch instead asked again at once, in microtasks only, and starved
        // the event loop for good (or, for its name, raised thousands of errors
        // a second). A FlowProducer has no queue of its own ("").
        let names = if o.queue.is_empty() { Jobs::check_namespace(&ns) } else { Jobs::check_queue_name(&ns, &o.queue) };
        names
            .and_then(|()| o.name.as_deref().map_or(Ok(()), lease::check_worker_name))
            .map_err(|e| Op::new("open").error(e))?;
        let store = store::acquire(std::path::Path::new(&o.data_dir), OpenOptions { durability })?;
        Ok(LoamQueue {
            store,
            ns,
            queue: o.queue.clone(),
            settings: Arc::new(WorkerSettings::from_options(&o)),
            owns_store: true,
            closed: Arc::new(AtomicBool::new(false)),
            owner_closed: None,
            blocking: Interrupt::new(),
            events: Interrupt::new(),
        })
    }

    /// A backend for another queue on the same store (FlowProducer); closing
    /// it does not close the store, closing this one closes it (made once
    /// this one is closed, as BullMQ makes them for the Jobs of a
    /// FlowProducer closed right after an add, its calls are refused). The
    /// core names queues without BullMQ's prefix, which only the JavaScript
    /// side's keys carry.
    #[napi(catch_unwind)]
    pub fn for_queue(&self, queue: String) -> LoamQueue {
        self.sibling(queue)
    }

    /// Whether the store's open (on a thread of its own) is still under way.
    #[napi(getter, catch_unwind)]
    pub fn opening(&self) -> bool {
        self.store.is_opening()
    }

    /// Which store of its data dir, of those this process made, this backend uses.
    #[napi(getter, catch_unwind)]
    pub fn store_id(&self) -> u32 {
        self.store.serial
    }

    /// The canonical data dir this backend's store lives in.
    #[napi(getter, catch_unwind)]
    pub fn data_dir(&self) -> String {
        self.store.dir.display().to_string()
    }

    /// Resolves once the store answers a read (Redis' PING after connecting):
    /// `waitUntilReady`. Not a read of this queue: a FlowProducer's backend
    /// has no queue of its own.
    #[napi]
    pub async fn ready(&self) -> Result<()> {
        self.jobs()?.read(&self.ns, |_| Ok(())).map_err(|e| Op::new("waitUntilReady").error(e))
    }

    /// Resolves once the store's open (on a thread of its own) has ended;
    /// rejects with what it found if it failed. The package makes no other
    /// call before.
    #[napi]
    pub async fn opened(&self) -> Result<()> {
        self.store.opened().await
    }

    /// Opens the store again if it failed and its last open started a second
    /// ago or more; returns whether an open is under way (`opened` then
    /// resolves once it has ended). The package calls it when a call finds
    /// the store unreachable.
    #[napi(catch_unwind)]
    pub fn reopen(&self) -> bool {
        !self.is_closed() && self.store.reopen(false)
    }

    /// Ends blocking waits and gives back this backend's use of the store,
    /// once its open has ended.
    #[napi]
    pub async fn close(&self) -> Result<()> {
        self.blocking.fire();
        self.events.fire();
        if !self.closed.swap(true, Ordering::SeqCst) && self.owns_store {
            store::release(&self.store).await;
        }
        Ok(())
    }

    #[napi(catch_unwind)]
    pub fn interrupt_blocking(&self) {
        self.blocking.fire();
    }

    #[napi(catch_unwind)]
    pub fn reset_blocking(&self) {
        self.blocking.reset();
    }

    #[napi(catch_unwind)]
    pub fn interrupt_events(&self) {
        self.events.fire();
    }

    // ---- adding ------------------------------------------------------------

    /// `addJob`: `job` is BullMQ's JobJson plus `jobId`/`parentKey`/`addToWaitingChildren`.
    #[napi(catch_unwind)]
    pub fn add_job<'env>(&self, env: &'env Env, host_now: f64, job: String) -> Result<PromiseRaw<'env, String>> {
        self.store.observe(host_now);
        let job: NewJob = parse("job", &job)?;
        let op = Op::new("addJob").parent(job.parent_key.clone());
        let req = job.to_request().map_err(invalid)?;
        let placement =
            if job.add_to_waiting_children { enqueue::Placement::WaitChildren } else { enqueue::Placement::Normal };
        let pending =
            self.jobs()?.job_admin(&self.ns, &self.queue, move |tx, q| enqueue::enqueue(tx, q, req.clone(), placement));
        settle(env, op, pending, |added| added.id)
    }

    /// `addJobs`: every job or none; the first job refused fails the call.
    #[napi(catch_unwind)]
    pub fn add_jobs<'env>(&self, env: &'env Env, host_now: f64, jobs: String) -> Result<PromiseRaw<'env, Vec<String>>> {
        self.store.observe(host_now);
        let jobs: Vec<NewJob> = parse("jobs", &jobs)?;
        let reqs = jobs.iter().map(NewJob::to_request).collect::<std::result::Result<Vec<_>, _>>().map_err(invalid)?;
        let pending = self.jobs()?.enqueue_all(&self.ns, &self.queue, reqs, None);
        settle(env, Op::new("addJob"), pending, |added| added.into_iter().map(|e| e.id).collect())
    }

    /// `addFlow`: every tree of the call in one transaction, in BullMQ's
    /// order ([`Jobs::flows`]). Returns BullMQ's `[error, idOrCode][]` as
    /// JSON; a refusal BullMQ has a code for is reported as that code on
    /// every entry of the refused tree (nothing of it was inserted).
    #[napi(catch_unwind)]
    pub fn add_flow<'env>(&self, env: &'env Env, host_now: f64, entries: String) -> Result<PromiseRaw<'env, String>> {
        self.store.observe(host_now);
        let entries: Vec<NewJob> = parse("flow", &entries)?;
        let mut nodes = Vec::with_capacity(entries.len());
        for e in &entries {
            nodes.push(FlowNode {
                queue: e.queue_name.clone().unwrap_or_else(|| self.queue.clone()),
                request: e.to_request().map_err(invalid)?,
                wait_children: e.add_to_waiting_children,
            });
        }
        let added = self.jobs()?.flows(&self.ns, nodes);
        settle(env, Op::new("addFlow"), added, |added| {
            let results: Vec<FlowResult> = added
                .into_iter()
                .map(|r| match r {
                    Ok(a) => (None, FlowId::Id(a.id)),
                    // Redis answers a refused insert with its code, not an error.
                    Err(e) => match e.bullmq_code() {
                        Some(code) => (None, FlowId::Code(code as i32)),
                        None => (Some(Op::new("addJob").error(e).reason), FlowId::Code(0)),
                    },
                })
                .collect();
            json(&results)
        })
    }

    // ---- worker: fetch, locks, stalled ---------------------------------------

    /// `moveToActive`: the next-job tuple as JSON.
    #[napi(catch_unwind)]
    pub fn move_to_active<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        token: String,
        name: Option<String>,
    ) -> Result<PromiseRaw<'env, String>> {
        self.store.observe(host_now);
        let req = self.lease_request(&token, name);
        let pending = self.jobs()?.lease(&self.ns, &self.queue, req);
        settle(env, Op::new("moveToActive"), pending, |leased| convert::next_job_json(&leased))
    }

    /// `waitForJob`: resolves with the marker score 0 once a job may be ready
    /// (the core also wakes when a delayed job falls due), or null on timeout
    /// or interrupt (`disconnectBlocking`, `close`).
    ///
    /// The wait runs on napi's runtime, but the write that wakes it settles
    /// the promise itself, on its own thread (see `loam_jobs::notify::Telling`):
    /// an add run on the JavaScript thread starts the worker's next call in
    /// the same turn of the event loop, where the runtime's wake-up and the
    /// hop back took two thread wake-ups (add-to-start latency).
    #[napi(ts_return_type = "Promise<number | null>", catch_unwind)]
    pub fn wait_for_job<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        block_timeout_seconds: f64,
    ) -> Result<PromiseRaw<'env, Option<f64>>> {
        self.store.observe(host_now);
        // NaN (from a caller's arithmetic) waits not at all, as zero does.
        let wait = Duration::try_from_secs_f64(block_timeout_seconds.clamp(0.0, 86_400.0)).unwrap_or_default();
        let jobs = self.jobs()?;
        let (resolver, promise) = crate::promise::promise(env, crate::promise::Kind::Wait)?;
        // Settled by whichever comes first: the wake-up, or the wait's end.
        let answer = FirstSettles::new(resolver);
        let told = answer.clone();
        // Not called for a wait cut short, which answers null itself.
        let tell: Tell = Arc::new(move || told.settle(Ok(Some(0.0))));
        // Taken now: an interrupt fired after this call and reset before the wait
        // starts still cuts it short.
        let (ns, queue, blocking) = (self.ns.clone(), self.queue.clone(), self.blocking.from_now());
        napi::bindgen_prelude::spawn(async move {
            let ready = jobs.wait_for_job(&ns, &queue, wait, Some(&blocking), Some(&tell)).await;
            let ready = ready.map(|ready| ready.map(|score| score as f64));
            answer.settle(ready.map_err(|e| Op::new("waitForJob").error(e)));
        });
        Ok(promise)
    }

    #[napi(catch_unwind)]
    pub fn extend_lock<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        token: String,
        duration: f64,
    ) -> Result<PromiseRaw<'env, u32>> {
        self.store.observe(host_now);
        let pending = self.jobs()?.extend(&self.ns, &self.queue, &job_id, lock_fence(&token), whole(duration));
        settle_with(env, pending, move |extended| match extended {
            Ok(_) => Ok(1),
            Err(e) if is_lock_refusal(&e) => Ok(0),
            Err(e) => Err(Op::new("extendLock").job(&job_id).error(e)),
        })
    }

    /// `extendLocks`: the ids whose lock could not be extended. An id past the
    /// end of `tokens` is compared with an empty token, so it is not extended
    /// and is listed (Redis's script compares it with nil).
    #[napi(catch_unwind)]
    pub fn extend_locks<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_ids: Vec<String>,
        tokens: Vec<String>,
        duration: f64,
    ) -> Result<PromiseRaw<'env, Vec<String>>> {
        self.store.observe(host_now);
        let tokens = tokens.into_iter().chain(std::iter::repeat(String::new()));
        let items = job_ids.into_iter().zip(tokens).map(|(id, t)| (id, lock_fence(&t))).collect();
        let pending = self.jobs()?.extend_many(&self.ns, &self.queue, items, whole(duration));
        settle(env, Op::new("extendLocks"), pending, |failed| failed)
    }

    /// `moveStalledJobsToWait`: applies the worker's `maxStalledCount` to the
    /// queue, then reclaims expired leases and returns their ids (the Worker
    /// emits its local `stalled` events for them). The queue's own background
    /// sweep keeps its slower interval, as a fallback for workers that skip
    /// the check, so it rarely takes these jobs first.
    #[napi(catch_unwind)]
    pub fn move_stalled_jobs_to_wait<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
    ) -> Result<PromiseRaw<'env, Vec<String>>> {
        self.store.observe(host_now);
        let max_stalled = self.settings.max_stalled;
        self.write(env, Op::new("moveStalledJobsToWait"), move |tx, q| {
            lease::sweep_stalled_as_worker(tx, q, Some(max_stalled))
        })
    }

    #[napi]
    pub async fn is_maxed(&self, host_now: f64) -> Result<bool> {
        self.store.observe(host_now);
        self.read(Op::new("isMaxed"), query::is_maxed)
    }

    // ---- finishing -----------------------------------------------------------

    /// `moveToCompleted`: `{result?, finishedOn}` as JSON.
    #[napi(catch_unwind)]
    pub fn move_to_completed<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        return_value: String,
        token: Option<String>,
        fetch_next: bool,
    ) -> Result<PromiseRaw<'env, String>> {
        self.store.observe(host_now);
        let outcome = Outcome::Ok { result: Some(return_value.into_bytes()) };
        self.finish_active(env, &job_id, &token.unwrap_or_default(), fetch_next, outcome)
    }

    /// `moveToFailed`: the final failure (BullMQ decided not to retry).
    #[napi(catch_unwind)]
    #[allow(
        clippy::too_many_arguments,
        reason = "mirrors IQueueBackend's positional arguments, plus env and the host time"
    )]
    pub fn move_to_failed<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        failed_reason: String,
        token: Option<String>,
        fetch_next: bool,
        fields_to_update: Option<String>,
    ) -> Result<PromiseRaw<'env, String>> {
        self.store.observe(host_now);
        let fields: FailureFields =
            fields_to_update.as_deref().map_or(Ok(FailureFields::default()), |f| parse("fieldsToUpdate", f))?;
        let outcome = Outcome::Fail { error: fields.to_error(Some(&failed_reason)), dead_letter: false };
        self.finish_active(env, &job_id, &token.unwrap_or_default(), fetch_next, outcome)
    }

    /// `moveToDelayed`: a retry after a backoff (an attempt is spent) or, with
    /// `skipAttempt`, a manual delay. Returns the next-job tuple when
    /// `fetchNext` claimed one, else `[]` (what the Redis adapter returns).
    #[napi(catch_unwind)]
    #[allow(
        clippy::too_many_arguments,
        reason = "mirrors IQueueBackend's positional arguments, plus env and the host time"
    )]
    pub fn move_to_delayed<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        timestamp: f64,
        delay: f64,
        token: Option<String>,
        opts: Option<String>,
    ) -> Result<PromiseRaw<'env, String>> {
        self.store.observe(host_now);
        #[derive(Deserialize, Default)]
        #[serde(rename_all = "camelCase")]
        struct MoveToDelayedOpts {
            #[serde(default)]
            skip_attempt: bool,
            #[serde(default)]
            fetch_next: bool,
            fields_to_update: Option<FailureFields>,
        }
        let o: MoveToDelayedOpts =
            opts.as_deref().map_or(Ok(MoveToDelayedOpts::default()), |t| parse("moveToDelayed options", t))?;
        let op = Op::new("moveToDelayed").job(&job_id).state("active");
        let token = token.unwrap_or_default();
        let outcome = if o.skip_attempt {
            Outcome::Delay { until: whole(timestamp).saturating_add(whole(delay)), delay_ms: Some(whole(delay)) }
        } else {
            Outcome::Retry { error: o.fields_to_update.map(|f| f.to_error(None)), after_ms: Some(whole(delay)) }
        };
        let opts = self.complete_options(&token, o.fetch_next);
        self.complete(env, op, fence(Some(&token)), outcome, opts, |done| {
            done.next.as_ref().filter(|n| !n.leases.is_empty()).map_or_else(|| "[]".into(), convert::next_job_json)
        })
    }

    /// `retryJob`: an immediate retry (an attempt is spent).
    #[napi(catch_unwind)]
    pub fn retry_job<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        token: Option<String>,
        fields_to_update: Option<String>,
    ) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        let op = Op::new("retryJob").job(&job_id).state("active");
        let fields: Option<FailureFields> =
            fields_to_update.as_deref().map(|f| parse("fieldsToUpdate", f)).transpose()?;
        let outcome = Outcome::Retry { error: fields.map(|f| f.to_error(None)), after_ms: Some(0) };
        self.complete(env, op, fence(token.as_deref()), outcome, CompleteOptions::default(), |_| ())
    }

    /// `moveJobFromActiveToWait` (a processor's RateLimitError): the job goes
    /// back to the front of its band; returns the queue's rate-limit ttl.
    #[napi(catch_unwind)]
    pub fn move_job_from_active_to_wait<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        token: Option<String>,
    ) -> Result<PromiseRaw<'env, f64>> {
        self.store.observe(host_now);
        let op = Op::new("moveJobFromActiveToWait").job(&job_id).state("active");
        let fence = fence(token.as_deref());
        let limiter = self.settings.limiter.clone();
        let id = job_id.clone();
        let release = move |tx: &mut Tx, q: &QueueId| {
            let release = Outcome::Release { after_ms: None };
            let opts = CompleteOptions::default();
            complete::complete_then_rate_limit_ttl(tx, q, &id, &fence, release, &opts, limiter.as_ref())
        };
        self.write_map(env, op, release, |(_, ttl)| ttl as f64)
    }

    /// `moveToWaitingChildren`: true when the job now waits for children.
    /// With `child_key` (BullMQ's `opts.child` as `<queue qualified name>:<id>`)
    /// only that child still pending counts, checked in the same transaction.
    #[napi(catch_unwind)]
    pub fn move_to_waiting_children<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        token: String,
        child_key: Option<String>,
    ) -> Result<PromiseRaw<'env, bool>> {
        self.store.observe(host_now);
        let op = Op::new("moveToWaitingChildren").job(&job_id).state("active");
        let fence = fence(Some(&token));
        let park = move |tx: &mut Tx, q: &QueueId| {
            let outcome = Outcome::WaitChildren { child: child_key.clone() };
            complete::complete(tx, q, &job_id, &fence, outcome, &CompleteOptions::default()).map(|done| done.moved)
        };
        self.write(env, op, park)
    }

    // ---- single-job admin ------------------------------------------------------

    #[napi(catch_unwind)]
    pub fn retry_finished_job<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        state: String,
        reset_attempts_made: bool,
        reset_attempts_started: bool,
    ) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        let from = JobState::parse(&state).ok_or_else(|| invalid(format!("unknown job state {state:?}")))?;
        let op = Op::new("reprocessJob").job(&job_id).state(from.as_str());
        self.write(env, op, move |tx, q| {
            admin::retry_finished(tx, q, &job_id, from, reset_attempts_made, reset_attempts_started)
        })
    }

    #[napi(catch_unwind)]
    pub fn promote<'env>(&self, env: &'env Env, host_now: f64, job_id: String) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        let op = Op::new("promote").job(&job_id).state("delayed");
        self.write(env, op, move |tx, q| admin::promote(tx, q, &job_id))
    }

    #[napi(catch_unwind)]
    pub fn change_delay<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        delay: f64,
    ) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        let op = Op::new("changeDelay").job(&job_id).state("delayed");
        self.write(env, op, move |tx, q| admin::change_delay(tx, q, &job_id, whole(delay)))
    }

    #[napi(catch_unwind)]
    pub fn change_priority<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        priority: f64,
        lifo: bool,
    ) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        let op = Op::new("changePriority").job(&job_id);
        let priority = convert::priority(priority).map_err(invalid)?;
        self.write(env, op, move |tx, q| admin::change_priority(tx, q, &job_id, priority, lifo))
    }

    /// `remove`: 1 when removed (or already gone), 0 when it or a child is locked.
    #[napi(catch_unwind)]
    pub fn remove<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        remove_children: bool,
    ) -> Result<PromiseRaw<'env, u32>> {
        self.store.observe(host_now);
        let op = Op::new("removeJob").job(&job_id);
        self.write_map(env, op, move |tx, q| admin::remove_job(tx, q, &job_id, remove_children), u32::from)
    }

    #[napi(catch_unwind)]
    pub fn remove_unprocessed_children<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
    ) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        let op = Op::new("removeUnprocessedChildren").job(&job_id);
        self.write(env, op, move |tx, q| admin::remove_unprocessed_children(tx, q, &job_id))
    }

    #[napi(catch_unwind)]
    pub fn remove_child_dependency<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        parent_key: Option<String>,
    ) -> Result<PromiseRaw<'env, bool>> {
        self.store.observe(host_now);
        let op = Op::new("removeChildDependency").job(&job_id).parent(parent_key.clone());
        let parent_key = parent_key.unwrap_or_default();
        self.write(env, op, move |tx, q| admin::remove_child_dependency(tx, q, &job_id, &parent_key))
    }

    /// `updateData`: `data` is the payload's JSON text.
    #[napi(catch_unwind)]
    pub fn update_data<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        data: String,
    ) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        let op = Op::new("updateData").job(&job_id);
        let data = data.into_bytes();
        self.write(env, op, move |tx, q| admin::update_data(tx, q, &job_id, &loam_jobs::Fence::Unchecked, data.clone()))
    }

    /// `updateProgress`: `progress` is its JSON text.
    #[napi(catch_unwind)]
    pub fn update_progress<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        progress: String,
    ) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        let op = Op::new("updateProgress").job(&job_id);
        self.write(env, op, move |tx, q| {
            admin::update_progress(tx, q, &job_id, &loam_jobs::Fence::Unchecked, progress.clone())
        })
    }

    #[napi(catch_unwind)]
    pub fn add_log<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        row: String,
        keep_logs: Option<f64>,
    ) -> Result<PromiseRaw<'env, f64>> {
        self.store.observe(host_now);
        let op = Op::new("addLog").job(&job_id);
        let keep = keep_logs.map(whole);
        let append = move |tx: &mut Tx, q: &QueueId| {
            admin::add_log(tx, q, &job_id, &loam_jobs::Fence::Unchecked, row.clone(), keep)
        };
        self.write_map(env, op, append, |count| count as f64)
    }

    #[napi(catch_unwind)]
    pub fn clear_logs<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        job_id: String,
        keep_logs: Option<f64>,
    ) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        let op = Op::new("clearLogs").job(&job_id);
        let keep = keep_logs.map(whole);
        self.write(env, op, move |tx, q| admin::clear_logs(tx, q, &job_id, keep))
    }

    // ---- queue admin -------------------------------------------------------------

    #[napi(catch_unwind)]
    pub fn pause<'env>(&self, env: &'env Env, host_now: f64, paused: bool) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        self.write(env, Op::new("pause"), move |tx, q| admin::set_paused(tx, q, paused))
    }

    #[napi(catch_unwind)]
    pub fn drain<'env>(&self, env: &'env Env, host_now: f64, delayed: bool) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        self.write(env, Op::new("drain"), move |tx, q| admin::drain(tx, q, delayed).map(|_| ()))
    }

    #[napi(catch_unwind)]
    pub fn clean_jobs_by_state<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        state: String,
        timestamp: f64,
        limit: Option<f64>,
    ) -> Result<PromiseRaw<'env, Vec<String>>> {
        self.store.observe(host_now);
        let limit = limit.map_or(0, whole);
        self.write(env, Op::new("cleanJobsByState"), move |tx, q| admin::clean(tx, q, &state, whole(timestamp), limit))
    }

    /// `obliterate`: 1 while jobs remain (call again), 0 once the queue is gone.
    #[napi(catch_unwind)]
    pub fn obliterate<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        force: bool,
        count: f64,
    ) -> Result<PromiseRaw<'env, u32>> {
        self.store.observe(host_now);
        let count = whole(count);
        self.write_map(env, Op::new("obliterate"), move |tx, q| admin::obliterate(tx, q, force, count), u32::from)
    }

    #[napi(catch_unwind)]
    pub fn retry_finished_jobs<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        state: String,
        count: f64,
        timestamp: f64,
    ) -> Result<PromiseRaw<'env, u32>> {
        self.store.observe(host_now);
        let from = if state == "completed" { JobState::Completed } else { JobState::Failed };
        let (count, before) = (whole(count), whole(timestamp));
        let retry = move |tx: &mut Tx, q: &QueueId| admin::retry_finished_jobs(tx, q, from, count, before);
        self.write_map(env, Op::new("retryJobs"), retry, u32::from)
    }

    #[napi(catch_unwind)]
    pub fn promote_jobs<'env>(&self, env: &'env Env, host_now: f64, count: f64) -> Result<PromiseRaw<'env, u32>> {
        self.store.observe(host_now);
        let count = whole(count);
        self.write_map(env, Op::new("promoteJobs"), move |tx, q| admin::promote_jobs(tx, q, count), u32::from)
    }

    // ---- getters -------------------------------------------------------------------

    /// `getJobData`: BullMQ's JobJson as JSON, or null.
    #[napi]
    pub async fn get_job_data(&self, host_now: f64, job_id: String) -> Result<Option<String>> {
        self.store.observe(host_now);
        let job = self.read(Op::new("getJobData").job(&job_id), |tx, q| query::get_job(tx, q, &job_id))?;
        Ok(job.as_ref().map(convert::job_json))
    }

    #[napi]
    pub async fn get_state(&self, host_now: f64, job_id: String) -> Result<String> {
        self.store.observe(host_now);
        let job = self.read(Op::new("getState").job(&job_id), |tx, q| query::get_job(tx, q, &job_id))?;
        Ok(job.map_or("unknown", |j| j.state.as_str()).to_string())
    }

    #[napi]
    pub async fn is_job_in_state(&self, host_now: f64, state: String, job_id: String) -> Result<bool> {
        self.store.observe(host_now);
        let wanted = match state.as_str() {
            "paused" => return Ok(false),
            s => JobState::parse(s).ok_or_else(|| invalid(format!("Unknown job state: {s}")))?,
        };
        let job = self.read(Op::new("isJobInState").job(&job_id), |tx, q| query::get_job(tx, q, &job_id))?;
        Ok(job.is_some_and(|j| j.state == wanted))
    }

    /// `isFinished`: JSON of the job's state, return value and failure
    /// reason, or `null` for a job missing; `src/common.ts`'s
    /// `isFinishedAnswer` makes BullMQ's `code` or `[code, value]` of them,
    /// for both backends.
    #[napi]
    pub async fn is_finished(&self, host_now: f64, job_id: String) -> Result<String> {
        self.store.observe(host_now);
        let job = self.read(Op::new("isFinished").job(&job_id), |tx, q| query::get_job(tx, q, &job_id))?;
        let fields = job.map(|j| {
            serde_json::json!({
                "state": j.state.as_str(),
                "returnValue": j.return_value.as_deref().map(as_text),
                "failedReason": j.failed_reason,
            })
        });
        Ok(json(&fields))
    }

    /// `getCounts`: one count per type; delayed jobs only when due before
    /// `delayedTimestamp` if given.
    #[napi]
    pub async fn get_counts(
        &self,
        host_now: f64,
        types: Vec<String>,
        delayed_timestamp: Option<f64>,
    ) -> Result<Vec<i64>> {
        self.store.observe(host_now);
        let before = delayed_timestamp.map(whole);
        let counts = self.read(Op::new("getCounts"), |tx, q| query::counts_by_type(tx, q, &types, before))?;
        Ok(counts.into_iter().map(|n| n as i64).collect())
    }

    #[napi]
    pub async fn get_counts_per_priority(&self, host_now: f64, priorities: Vec<f64>) -> Result<Vec<i64>> {
        self.store.observe(host_now);
        // A priority no job can have (below 0, not whole) counts none, as on
        // Redis; read as 0, it counted the waiting jobs.
        let priorities: Vec<u32> =
            priorities.into_iter().map(|p| if p >= 0.0 && p.fract() == 0.0 { p as u32 } else { u32::MAX }).collect();
        let counts =
            self.read(Op::new("getCountsPerPriority"), |tx, q| query::counts_per_priority(tx, q, &priorities))?;
        Ok(counts.into_iter().map(|n| n as i64).collect())
    }

    /// `getRanges`: ids per type. For BullMQ's list types (`wait`, `active`,
    /// `paused`) an ascending page is returned newest-first, because its
    /// caller reverses those (Redis LRANGE order).
    #[napi]
    pub async fn get_ranges(
        &self,
        host_now: f64,
        types: Vec<String>,
        start: f64,
        end: f64,
        asc: bool,
    ) -> Result<Vec<Vec<String>>> {
        self.store.observe(host_now);
        let (start, end) = (start as i64, end as i64);
        self.read(Op::new("getRanges"), |tx, q| {
            let mut out = Vec::with_capacity(types.len());
            for t in &types {
                let Some(state) = JobState::parse(t) else {
                    out.push(Vec::new());
                    continue;
                };
                let mut ids = query::range(tx, q, state, start, end, asc)?;
                if asc && matches!(state, JobState::Waiting | JobState::Active) {
                    ids.reverse();
                }
                out.push(ids);
            }
            Ok(out)
        })
    }

    /// `getJobLogs`: `{logs, count}` as JSON.
    #[napi]
    pub async fn get_job_logs(&self, host_now: f64, job_id: String, start: f64, end: f64, asc: bool) -> Result<String> {
        self.store.observe(host_now);
        let (logs, count) = self.read(Op::new("getJobLogs").job(&job_id), |tx, q| {
            query::logs(tx, q, &job_id, start as i64, end as i64, asc)
        })?;
        // In Redis's order (a `json!` object sorts its keys): it reaches the
        // app as it is.
        #[derive(serde::Serialize)]
        struct LogPage {
            logs: Vec<String>,
            count: u64,
        }
        Ok(json(&LogPage { logs, count }))
    }

    #[napi]
    pub async fn get_deduplication_job_id(&self, host_now: f64, deduplication_id: String) -> Result<Option<String>> {
        self.store.observe(host_now);
        self.read(Op::new("getDeduplicationJobId"), |tx, q| query::dedup_job_id(tx, q, &deduplication_id))
    }

    /// `getRateLimitTtl`: with `maxJobs`, or a global `max` in the meta, the ms
    /// the limiter stays closed for that many jobs (0 when open); with neither,
    /// the raw ttl of the limiter window as Redis' PTTL reports it (-2: none).
    #[napi]
    pub async fn get_rate_limit_ttl(&self, host_now: f64, max_jobs: Option<f64>) -> Result<f64> {
        self.store.observe(host_now);
        self.read(Op::new("getRateLimitTtl"), |tx, q| {
            query::rate_limit_ttl_or_missing(tx, q, max_jobs.map(whole)).map(|ttl| ttl as f64)
        })
    }

    /// `getMetrics`: the queue's metrics of that kind as JSON (`count`,
    /// `prevTs`, `prevCount`, the points `start..=end` as `data`, and how
    /// many are kept as `total`), or `null` where none are kept;
    /// `src/common.ts`'s `metricsAnswer` gives it BullMQ's shape.
    #[napi]
    pub async fn get_metrics(&self, host_now: f64, kind: String, start: f64, end: f64) -> Result<String> {
        self.store.observe(host_now);
        // BullMQ keeps no metrics under another name: Redis answers none.
        let rec = match MetricsKind::parse(&kind) {
            Some(kind) => self.read(Op::new("getMetrics"), |tx, q| query::metrics(tx, q, kind))?,
            None => None,
        };
        // A position reads as the other range getters read theirs: NaN as 0,
        // a fraction toward 0, an infinity as the far end (`as` saturates).
        Ok(json(&rec.map(|rec| {
            serde_json::json!({
                "count": rec.count,
                "prevTs": rec.prev_ts,
                "prevCount": rec.prev_count,
                "data": rec.page(start as i64, end as i64),
                "total": rec.data.len(),
            })
        })))
    }

    // ---- flows: children ------------------------------------------------------------

    /// `getDependencyCounts`: counts per BullMQ child category.
    #[napi]
    pub async fn get_dependency_counts(&self, host_now: f64, job_id: String, types: Vec<String>) -> Result<Vec<i64>> {
        self.store.observe(host_now);
        let deps =
            self.read(Op::new("getDependencyCounts").job(&job_id), |tx, q| query::dependencies(tx, q, &job_id))?;
        let count = |status: DependencyStatus| deps.iter().filter(|(_, d)| d.status == status).count() as i64;
        Ok(types
            .iter()
            .map(|t| match t.as_str() {
                "processed" => count(DependencyStatus::Processed),
                "unprocessed" => count(DependencyStatus::Pending),
                "ignored" => count(DependencyStatus::Ignored),
                _ => count(DependencyStatus::Failed),
            })
            .collect())
    }

    /// Child key → value of the children in `status` (processed: return
    /// values as JSON text; ignored: failure reasons), as a JSON object.
    fn children_values(&self, command: &'static str, job_id: &str, status: DependencyStatus) -> Result<String> {
        let deps = self.read(Op::new(command).job(job_id), |tx, q| query::dependencies(tx, q, job_id))?;
        let map: BTreeMap<String, String> = deps
            .into_iter()
            .filter(|(_, d)| d.status == status)
            .map(|(k, d)| (k, d.value.unwrap_or_else(|| "null".into())))
            .collect();
        Ok(json(&map))
    }

    #[napi]
    pub async fn get_processed_children_values(&self, host_now: f64, job_id: String) -> Result<String> {
        self.store.observe(host_now);
        self.children_values("getProcessedChildrenValues", &job_id, DependencyStatus::Processed)
    }

    #[napi]
    pub async fn get_ignored_children_failures(&self, host_now: f64, job_id: String) -> Result<String> {
        self.store.observe(host_now);
        self.children_values("getIgnoredChildrenFailures", &job_id, DependencyStatus::Ignored)
    }

    /// Every child of a job by category, as JSON `{processed: [[key, value]],
    /// unprocessed: [key], ignored: [[key, reason]], failed: [key]}` (the
    /// JavaScript side pages it for `getDependencies`).
    #[napi]
    pub async fn get_dependencies(&self, host_now: f64, job_id: String) -> Result<String> {
        self.store.observe(host_now);
        let deps = self.read(Op::new("getDependencies").job(&job_id), |tx, q| query::dependencies(tx, q, &job_id))?;
        let mut processed = Vec::new();
        let mut unprocessed = Vec::new();
        let mut ignored = Vec::new();
        let mut failed = Vec::new();
        for (key, dep) in deps {
            match dep.status {
                DependencyStatus::Processed => processed.push((key, dep.value.unwrap_or_else(|| "null".into()))),
                DependencyStatus::Pending => unprocessed.push(key),
                DependencyStatus::Ignored => ignored.push((key, dep.value.unwrap_or_default())),
                DependencyStatus::Failed => failed.push(key),
            }
        }
        Ok(json(&serde_json::json!({
            "processed": processed, "unprocessed": unprocessed, "ignored": ignored, "failed": failed,
        })))
    }

    /// `paginate` of a parent's pending (`<parent>:dependencies`) or processed
    /// (`<parent>:processed`) children, positions `start..=end`, with the
    /// children's JobJson when `fetch_jobs`. JSON `{cursor, items, total, jobs?}`,
    /// processed values as JSON text for the caller to parse.
    #[napi]
    pub async fn paginate_children(
        &self,
        host_now: f64,
        parent_id: String,
        processed: bool,
        start: f64,
        end: f64,
        fetch_jobs: bool,
    ) -> Result<String> {
        self.store.observe(host_now);
        let wanted = if processed { DependencyStatus::Processed } else { DependencyStatus::Pending };
        let (total, items, jobs) = self.read(Op::new("paginate").job(&parent_id), |tx, q| {
            let (page, total) = query::dependency_page(tx, q, &parent_id, Some(wanted), start as i64, end as i64)?;
            let mut jobs = Vec::new();
            if fetch_jobs {
                for child in query::dependency_jobs(tx, q, &page) {
                    jobs.extend(child?.as_ref().map(convert::job_json));
                }
            }
            let items: Vec<(String, Option<String>)> = page
                .into_iter()
                .map(|(k, d)| (k, processed.then(|| d.value.unwrap_or_else(|| "null".into()))))
                .collect();
            Ok((total, items, jobs))
        })?;
        Ok(json(
            &serde_json::json!({ "cursor": "0", "items": items, "total": total, "jobs": fetch_jobs.then_some(jobs) }),
        ))
    }

    // ---- meta, rate limit, dedup ---------------------------------------------------------

    /// `setQueueMeta`: `values` is a JSON object; returns how many fields were new.
    #[napi(catch_unwind)]
    pub fn set_queue_meta<'env>(&self, env: &'env Env, host_now: f64, values: String) -> Result<PromiseRaw<'env, f64>> {
        self.store.observe(host_now);
        let raw: BTreeMap<String, serde_json::Value> = parse("queue meta", &values)?;
        let values: BTreeMap<String, String> = raw
            .into_iter()
            .map(|(k, v)| {
                (
                    k,
                    match v {
                        serde_json::Value::String(s) => s,
                        other => other.to_string(),
                    },
                )
            })
            .collect();
        self.write_map(env, Op::new("setQueueMeta"), move |tx, q| admin::set_meta(tx, q, &values), |n| n as f64)
    }

    /// `getQueueMeta`: the meta fields as a JSON object.
    #[napi]
    pub async fn get_queue_meta(&self, host_now: f64) -> Result<String> {
        self.store.observe(host_now);
        Ok(json(&self.read(Op::new("getQueueMeta"), query::meta)?))
    }

    #[napi]
    pub async fn get_queue_meta_fields(&self, host_now: f64, fields: Vec<String>) -> Result<Vec<Option<String>>> {
        self.store.observe(host_now);
        self.read(Op::new("getQueueMetaFields"), |tx, q| fields.iter().map(|f| tx.meta(q, f)).collect())
    }

    #[napi(catch_unwind)]
    pub fn remove_queue_meta_fields<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        fields: Vec<String>,
    ) -> Result<PromiseRaw<'env, f64>> {
        self.store.observe(host_now);
        let remove = move |tx: &mut Tx, q: &QueueId| admin::remove_meta_fields(tx, q, &fields);
        self.write_map(env, Op::new("removeQueueMetaFields"), remove, |n| n as f64)
    }

    #[napi(catch_unwind)]
    pub fn set_rate_limit<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        expire_time_ms: f64,
    ) -> Result<PromiseRaw<'env, ()>> {
        self.store.observe(host_now);
        self.write(env, Op::new("setRateLimit"), move |tx, q| admin::set_rate_limit(tx, q, whole(expire_time_ms)))
    }

    #[napi(catch_unwind)]
    pub fn remove_rate_limit_key<'env>(&self, env: &'env Env, host_now: f64) -> Result<PromiseRaw<'env, f64>> {
        self.store.observe(host_now);
        self.write_map(env, Op::new("removeRateLimitKey"), admin::remove_rate_limit_key, |n| n as f64)
    }

    /// `removeDeduplicationKey` (only while it still names `jobId`) and, with
    /// no job id, `deleteDeduplicationKey`.
    #[napi(catch_unwind)]
    pub fn remove_deduplication_key<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        deduplication_id: String,
        job_id: Option<String>,
    ) -> Result<PromiseRaw<'env, f64>> {
        self.store.observe(host_now);
        let remove =
            move |tx: &mut Tx, q: &QueueId| admin::remove_dedup_key(tx, q, &deduplication_id, job_id.as_deref());
        self.write_map(env, Op::new("removeDeduplicationKey"), remove, |n| n as f64)
    }

    // ---- events ---------------------------------------------------------------------

    /// The id of the newest event (`"0-0"` when there is none), so a
    /// QueueEvents started now reads from here.
    #[napi]
    pub async fn last_event_id(&self, host_now: f64) -> Result<String> {
        self.store.observe(host_now);
        let seq = self.read(Op::new("readEvents"), query::last_event_seq)?;
        Ok(format!("0-{seq}"))
    }

    /// `readEvents`: the entries after `id` (`$` = from now) as JSON
    /// `[[id, [k, v, ...]], ...]`, or null when none came within `block_ms`.
    /// The write that adds events reads them and answers, on its own thread
    /// (as it answers `waitForJob`): a QueueEvents gets them in that write's
    /// own turn of the event loop (or, from a store thread, in the same
    /// delivery as the write's own answer), as Redis pushes them to a blocked
    /// XREAD, instead of after a worker running on that thread has gone on to
    /// its next jobs (its completions could then come before the events that
    /// led to them). The read moves from napi's runtime to that thread; it
    /// happens once per answer, since a QueueEvents asks again only after.
    #[napi(ts_return_type = "Promise<string | null>", catch_unwind)]
    pub fn read_events<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        id: String,
        block_ms: f64,
    ) -> Result<PromiseRaw<'env, Option<String>>> {
        self.store.observe(host_now);
        let jobs = self.jobs()?;
        // Resolved now (a read never waits): the write's thread reads after it.
        let cursor = self.read(Op::new("readEvents"), |tx, q| query::event_cursor(tx, q, &id))?;
        let after = cursor.after;
        // 0 (or less) waits until an event comes, as Redis's `XREAD BLOCK 0`
        // does: answered at once, a QueueEvents asked again at once, for ever.
        let wait = if block_ms > 0.0 { Duration::from_millis(whole(block_ms)) } else { Duration::MAX };
        let (resolver, promise) = crate::promise::promise(env, crate::promise::Kind::Wait)?;
        // Settled by whichever comes first with events: the write's thread,
        // or the wait itself (which also answers none at its end).
        let answer = FirstSettles::new(resolver);
        let told = answer.clone();
        let (ns, queue) = (self.ns.clone(), self.queue.clone());
        let reader = (jobs.clone(), ns.clone(), queue.clone());
        let tell: Tell = Arc::new(move || {
            let (jobs, ns, queue) = &reader;
            let read = jobs.query(ns, queue, |tx, q| query::events_after(tx, q, after, EVENTS_PER_READ));
            if let Ok(events) = read.map(|events| cursor.keep(events))
                && !events.is_empty()
            {
                told.settle(Ok(stream_entries(events)));
            }
        });
        let interrupt = self.events.clone();
        napi::bindgen_prelude::spawn(async move {
            let events =
                jobs.read_events(&ns, &queue, Some(after), EVENTS_PER_READ, wait, Some(&interrupt), Some(&tell)).await;
            // Events a foreign id does not read answer null, as a wait with none
            // would: BullMQ asks again with the same id.
            answer.settle(events.map(|e| stream_entries(cursor.keep(e))).map_err(|e| Op::new("readEvents").error(e)));
        });
        Ok(promise)
    }

    /// `publishEvent`: `fields` is a JSON object with `event` and the rest.
    #[napi(catch_unwind)]
    pub fn publish_event<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        fields: String,
        max_events: f64,
    ) -> Result<PromiseRaw<'env, String>> {
        self.store.observe(host_now);
        let raw: serde_json::Map<String, serde_json::Value> = parse("event fields", &fields)?;
        let mut name = String::new();
        let mut rest = Vec::with_capacity(raw.len());
        for (k, v) in raw {
            let v = match v {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            if k == "event" { name = v } else { rest.push((k, v)) }
        }
        let max = whole(max_events);
        self.write(env, Op::new("publishEvent"), move |tx, q| admin::publish_event(tx, q, &name, &rest, max))
    }

    #[napi(catch_unwind)]
    pub fn trim_events<'env>(&self, env: &'env Env, host_now: f64, max_length: f64) -> Result<PromiseRaw<'env, f64>> {
        self.store.observe(host_now);
        let max = whole(max_length);
        self.write_map(env, Op::new("trimEvents"), move |tx, q| tx.trim_events(q, max), |n| n as f64)
    }

    // ---- job schedulers ------------------------------------------------------------------

    /// `addJobScheduler`: `[jobId, delay]` as JSON, or null when the scheduler
    /// has run out (limit or end date).
    #[napi(catch_unwind)]
    #[allow(
        clippy::too_many_arguments,
        reason = "mirrors IQueueBackend's positional arguments, plus env and the host time"
    )]
    pub fn add_job_scheduler<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        scheduler_id: String,
        next_millis: Option<f64>,
        template_data: String,
        template_opts: String,
        repeat_opts: String,
    ) -> Result<PromiseRaw<'env, Option<String>>> {
        self.store.observe(host_now);
        #[derive(Deserialize, Default)]
        #[serde(rename_all = "camelCase")]
        struct RepeatOpts {
            name: Option<String>,
            pattern: Option<String>,
            every: Option<f64>,
            offset: Option<f64>,
            tz: Option<String>,
            /// Milliseconds; the JavaScript side turns dates into numbers.
            start_date: Option<f64>,
            end_date: Option<f64>,
            limit: Option<f64>,
            /// The first iteration's `repeat.count`, which BullMQ computed.
            count: Option<f64>,
        }
        let r: RepeatOpts = parse("repeat options", &repeat_opts)?;
        let template = NewJob::template(&template_opts).map_err(invalid)?;
        let spec = SchedulerSpec {
            id: scheduler_id.clone(),
            name: r.name.unwrap_or_default(),
            pattern: r.pattern,
            every_ms: r.every.map(whole),
            offset_ms: r.offset.map(whole),
            tz: r.tz,
            start_date: r.start_date.map(whole),
            end_date: r.end_date.map(whole),
            limit: r.limit.map(whole),
            next_millis: next_millis.map(whole),
            template_data,
            template_opts,
            job: template,
            // BullMQ's rule: a replaced `every` scheduler keeps its phase.
            start_resets: false,
            count: r.count.map(whole),
        };
        let op = Op::new("addJobScheduler").job(&scheduler_id);
        let upsert = move |tx: &mut Tx, q: &QueueId| schedule::upsert(tx, q, spec.clone());
        self.write_map(env, op, upsert, |added| added.map(|(id, delay)| json(&(id, delay))))
    }

    /// `updateJobSchedulerNextMillis`: the next iteration's id, or null.
    #[napi(catch_unwind)]
    pub fn update_job_scheduler_next_millis<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        scheduler_id: String,
        next_millis: Option<f64>,
        delayed_job_opts: String,
        producer_id: Option<String>,
    ) -> Result<PromiseRaw<'env, Option<String>>> {
        self.store.observe(host_now);
        let template = NewJob::template(&delayed_job_opts).map_err(invalid)?;
        let producer = producer_id.unwrap_or_default();
        let next = next_millis.map(whole);
        let op = Op::new("updateJobScheduler").job(&scheduler_id);
        self.write(env, op, move |tx, q| schedule::advance(tx, q, &scheduler_id, next, &producer, &template))
    }

    /// `removeJobScheduler`: 0 when the scheduler existed, 1 when it did not
    /// (the Lua script's convention, which `Queue.removeJobScheduler` inverts).
    #[napi(catch_unwind)]
    pub fn remove_job_scheduler<'env>(
        &self,
        env: &'env Env,
        host_now: f64,
        scheduler_id: String,
    ) -> Result<PromiseRaw<'env, u32>> {
        self.store.observe(host_now);
        let remove = move |tx: &mut Tx, q: &QueueId| schedule::remove(tx, q, &scheduler_id);
        self.write_map(env, Op::new("removeJobScheduler"), remove, |existed| if existed { 0 } else { 1 })
    }

    /// `getJobScheduler`: `[hash, next]` as JSON (`[null, null]` when absent).
    #[napi]
    pub async fn get_job_scheduler(&self, host_now: f64, scheduler_id: String) -> Result<String> {
        self.store.observe(host_now);
        let rec = self.read(Op::new("getJobScheduler"), |tx, q| schedule::get(tx, q, &scheduler_id))?;
        Ok(match rec {
            Some(r) => json(&(convert::scheduler_hash(&r), r.next_millis.to_string())),
            None => "[null,null]".into(),
        })
    }

    /// `getJobSchedulersRange`: `[id, next, id, next, ...]` by next run.
    #[napi]
    pub async fn get_job_schedulers_range(
        &self,
        host_now: f64,
        start: f64,
        end: f64,
        asc: bool,
    ) -> Result<Vec<String>> {
        self.store.observe(host_now);
        let recs =
            self.read(Op::new("getJobSchedulersRange"), |tx, q| schedule::list(tx, q, start as i64, end as i64, asc))?;
        Ok(recs.iter().flat_map(|r| [r.id.clone(), r.next_millis.to_string()]).collect())
    }

    #[napi]
    pub async fn get_job_schedulers_count(&self, host_now: f64) -> Result<i64> {
        self.store.observe(host_now);
        Ok(self.read(Op::new("getJobSchedulersCount"), schedule::count)? as i64)
    }
}

/// Hooks for the package's own tests, built only with the `test-hooks`
/// feature (`pnpm run build:native` sets it; the release build that ships
/// does not), so a user's addon has no method that panics on purpose.
#[cfg(feature = "test-hooks")]
#[napi]
impl LoamQueue {
    /// Panics inside a read of the core; used by the tests to check that a
    /// Rust panic rejects the promise, with its message, instead of crashing
    /// the process.
    #[napi]
    pub async fn panic_for_test(&self, message: String) -> Result<()> {
        self.read(Op::new("panicForTest"), |_, _| std::panic::panic_any(message))
    }

    /// Panics in the method itself, on the JavaScript thread; used by the tests
    /// to check that a synchronous method's panic is thrown as an error. Left
    /// to unwind out of the method, it would cross napi's `extern "C"` frame,
    /// where Rust aborts the process.
    #[napi(catch_unwind)]
    pub fn panic_in_call_for_test(&self, message: String) {
        std::panic::panic_any(message)
    }

    /// Makes every open from now on wait `ms` before it starts, as a long
    /// log replay would.
    #[napi(catch_unwind)]
    pub fn set_open_delay_for_test(ms: u32) {
        crate::store::test_hooks::OPEN_DELAY_MS.store(u64::from(ms), Ordering::Relaxed);
    }

    /// Makes every open from now on panic (or, with `false`, no longer).
    #[napi(catch_unwind)]
    pub fn set_open_panics_for_test(panics: bool) {
        crate::store::test_hooks::OPEN_PANICS.store(panics, Ordering::Relaxed);
    }

    /// How many opens of a store this process has started (a reopen counts).
    #[napi(catch_unwind)]
    pub fn opens_for_test() -> u32 {
        crate::store::test_hooks::OPENS.load(Ordering::Relaxed)
    }
}
