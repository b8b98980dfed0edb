//! [`Jobs`]: the queue core's public handle. Every write is one transaction
//! in the store; every method has a blocking and an awaitable form through
//! [`Pending`]; waits (lease, events) are woken in-process, never polled.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use event_listener::{Event as Signal, Listener};
use parking_lot::{Condvar, Mutex};

use crate::clock::{Clock, SystemClock};
use crate::config::{Config, QueueConfig};
use crate::error::{JobsError, StoreError};
use crate::keys::QueueId;
use crate::model::*;
use crate::notify::{Channel, Notifier, Tell, Telling};
use crate::ops::{admin, complete, enqueue, lease, query, schedule};
use crate::store::redb::{RedbOptions, RedbStore};
use crate::store::{BRIEF_JOBS, Durable, Store, WriteOp};
use crate::tx::{Effects, Tx};

pub use crate::pending::Pending;

/// Lets a caller cut its own waits short (BullMQ's `disconnectBlocking`).
#[derive(Clone, Default)]
pub struct Interrupt {
    signal: Arc<Signal>,
    fired: Arc<AtomicBool>,
    /// How many times it was fired, reset or not.
    fires: Arc<AtomicU64>,
    /// For a handle from [`Interrupt::from_now`]: `fires` when it was made.
    since: Option<u64>,
}

impl Interrupt {
    pub fn new() -> Self {
        Self::default()
    }
    /// Ends every wait that uses this interrupt, now and until `reset`.
    pub fn fire(&self) {
        self.fires.fetch_add(1, Ordering::SeqCst);
        self.fired.store(true, Ordering::SeqCst);
        self.signal.notify(usize::MAX);
    }
    pub fn reset(&self) {
        self.fired.store(false, Ordering::SeqCst);
    }
    /// The same interrupt, for a wait asked for now: a `fire` from now on
    /// ends it even if a `reset` follows before the wait begins (BullMQ's
    /// `disconnectBlocking(); reconnectBlocking()` in one turn of Node's loop,
    /// while the wait it asked for earlier in that turn has not started).
    pub fn from_now(&self) -> Self {
        Self { since: Some(self.fires.load(Ordering::SeqCst)), ..self.clone() }
    }
    pub fn is_fired(&self) -> bool {
        self.fired.load(Ordering::SeqCst) || self.since.is_some_and(|since| self.fires.load(Ordering::SeqCst) != since)
    }
    /// Resolves once the interrupt is fired.
    pub async fn fired(&self) {
        loop {
            if self.is_fired() {
                return;
            }
            let listener = self.signal.listen();
            if self.is_fired() {
                return;
            }
            listener.await;
        }
    }
}

struct Timers {
    heap: Mutex<BinaryHeap<Reverse<(u64, QueueId)>>>,
    changed: Condvar,
}

struct Inner {
    store: Box<dyn Store>,
    clock: Arc<dyn Clock>,
    /// What leases are judged by (see `Tx::lease_now`); usually `clock`.
    lease_clock: Arc<dyn Clock>,
    config: Config,
    notifier: Notifier,
    timers: Timers,
    /// Next stalled sweep per known queue (real time).
    sweeps: Mutex<HashMap<QueueId, Instant>>,
    closed: AtomicBool,
    /// This open's generation (see `Tx::generation`), set once at open.
    generation: AtomicU64,
}

impl Inner {
    fn apply(&self, effects: Effects) {
        for q in &effects.wake_jobs {
            self.notifier.notify(q, Channel::Jobs);
        }
        for q in &effects.wake_events {
            self.notifier.notify(q, Channel::Events);
        }
        if !effects.timers.is_empty() || !effects.new_queues.is_empty() || !effects.sweep_now.is_empty() {
            {
                let mut heap = self.timers.heap.lock();
                for (q, due) in effects.timers {
                    heap.push(Reverse((due, q)));
                }
            }
            {
                let mut sweeps = self.sweeps.lock();
                for q in effects.new_queues {
                    sweeps.entry(q).or_insert_with(Instant::now);
                }
                for q in effects.sweep_now {
                    sweeps.insert(q, Instant::now());
                }
            }
            self.timers.changed.notify_all();
        }
    }
}

/// The queue core over one store.
#[derive(Clone)]
pub struct Jobs {
    inner: Arc<Inner>,
    maintenance: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
    /// The time the operations of this handle run at, when the caller says
    /// (see [`Jobs::at`]); else the core's clock.
    at: Option<u64>,
}

impl Jobs {
    /// Opens (or creates) the redb store file at `path`.
    pub fn open(path: &Path, config: Config) -> Result<Self, JobsError> {
        let store = RedbStore::open(path, RedbOptions { durability: config.durability, ..Default::default() })?;
        Self::with_store(Box::new(store), Arc::new(SystemClock), config)
    }

    pub fn with_store(store: Box<dyn Store>, clock: Arc<dyn Clock>, config: Config) -> Result<Self, JobsError> {
        let lease_clock = Arc::clone(&clock);
        Self::with_clocks(store, clock, lease_clock, config)
    }

    /// A core whose leases are judged by `lease_clock` (real time) while
    /// everything else follows `clock` and the callers' times, as BullMQ on
    /// Redis: job timestamps come from the client, lock TTLs run in real time.
    pub fn with_clocks(
        store: Box<dyn Store>,
        clock: Arc<dyn Clock>,
        lease_clock: Arc<dyn Clock>,
        config: Config,
    ) -> Result<Self, JobsError> {
        let background = config.background;
        let inner = Arc::new(Inner {
            store,
            clock,
            lease_clock,
            config,
            notifier: Notifier::default(),
            timers: Timers { heap: Mutex::new(BinaryHeap::new()), changed: Condvar::new() },
            sweeps: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            generation: AtomicU64::new(0),
        });
        let jobs = Self { inner, maintenance: Arc::new(Mutex::new(None)), at: None };
        // Durable even under relaxed durability: lost in a crash, it would let
        // the next open hand out the epochs of this one's leases again.
        let generation = jobs
            .submit_write("", Durable::Always, false, |tx| {
                let key = crate::keys::generation();
                let g = tx.get_record::<u64>(&key)?.unwrap_or(0) + 1;
                tx.put_record(&key, &g)?;
                Ok(g)
            })
            .wait()?;
        jobs.inner.generation.store(generation, Ordering::SeqCst);
        jobs.load_timers()?;
        if background {
            let weak = Arc::downgrade(&jobs.inner);
            let handle = std::thread::Builder::new()
                .name("loam-jobs-maintenance".into())
                .spawn(move || maintenance_loop(weak))
                .map_err(|e| JobsError::Internal(e.to_string()))?;
            *jobs.maintenance.lock() = Some(handle);
        }
        Ok(jobs)
    }

    /// Arms the delayed-job timers and the stalled sweep for every stored queue.
    fn load_timers(&self) -> Result<(), JobsError> {
        let queues = self.read("", |tx| {
            let qs = query::all_queues(tx)?;
            let mut out = Vec::new();
            for q in qs {
                let due = lease::next_due(tx, &q)?;
                out.push((q, due));
            }
            Ok(out)
        })?;
        let mut effects = Effects::default();
        for (q, due) in queues {
            if let Some(due) = due {
                effects.timers.push((q.clone(), due));
            }
            effects.new_queues.push(q);
        }
        self.inner.apply(effects);
        Ok(())
    }

    /// A handle whose operations run at `now_ms`, the caller's time, as
    /// BullMQ's Redis scripts run at the time the client passes them (its
    /// tests fake it). Deadlines of leases taken through it count from that
    /// time; the background sweeps keep the core's own clock.
    pub fn at(&self, now_ms: u64) -> Jobs {
        Jobs { at: Some(now_ms), ..self.clone() }
    }

    pub fn now_ms(&self) -> u64 {
        self.at.unwrap_or_else(|| self.inner.clock.now_ms())
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Stops the background work and the store; pending writes finish first.
    pub fn close(&self) {
        if self.inner.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.inner.timers.changed.notify_all();
        self.inner.notifier.notify_all();
        if let Some(h) = self.maintenance.lock().take() {
            let _ = h.join();
        }
        self.inner.store.close();
    }

    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::SeqCst)
    }

    /// Why the store refuses every write from now on, if it does (see
    /// [`Store::failure`]): reopening it, once the cause is gone, replays its
    /// log and mends it.
    pub fn failure(&self) -> Option<StoreError> {
        self.inner.store.failure()
    }

    // ---- plumbing --------------------------------------------------------

    /// Runs `body` as one write transaction in namespace `ns`. `sync` = its
    /// acknowledgement waits for the commit to be durable.
    pub fn write<T, F>(&self, ns: &str, sync: bool, body: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnMut(&mut Tx) -> Result<T, JobsError> + Send + 'static,
    {
        self.submit_write(ns, Durable::needed(sync), false, body)
    }

    /// [`Self::write`]; `brief` marks a write of a few jobs (see [`WriteOp::brief`]).
    fn submit_write<T, F>(&self, ns: &str, durable: Durable, brief: bool, mut body: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnMut(&mut Tx) -> Result<T, JobsError> + Send + 'static,
    {
        if self.is_closed() {
            return Pending::settled(Err(JobsError::Unavailable("the queue core is closed".into())));
        }
        let (settle, pending) = crate::pending::pending();
        let inner = Arc::clone(&self.inner);
        let ns = ns.to_string();
        let now_clock = Arc::clone(&self.inner.clock);
        let lease_clock = Arc::clone(&self.inner.lease_clock);
        let at = self.at;
        let config = self.inner.config.clone();
        let generation = self.inner.generation.load(Ordering::SeqCst);
        let early = Arc::clone(&self.inner);
        let op = WriteOp {
            durable,
            brief,
            body: Box::new(move |kv| {
                let core_now = now_clock.now_ms();
                let mut tx = Tx::new(kv, &ns, at.unwrap_or(core_now), &config);
                tx.generation = generation;
                tx.lease_now = lease_clock.now_ms();
                tx.core_now = core_now;
                let value = body(&mut tx)?;
                let effects = tx.finish()?;
                // Workers waiting for a job are woken as soon as one is added,
                // while its commit is being made durable: the lease they come
                // for runs over the uncommitted writes and is acknowledged
                // only after them, so no job starts before its add is durable,
                // and the wake-up, the worker's call and the lease overlap the
                // fsync instead of following it. (They are woken again with
                // the acknowledgement; a wake-up is only a hint.)
                for q in &effects.wake_jobs {
                    early.notifier.notify(q, Channel::Jobs);
                }
                Ok(Box::new((value, effects)))
            }),
            done: Box::new(move |result| {
                let result = result.and_then(|out| {
                    out.downcast::<(T, Effects)>()
                        .map(|b| *b)
                        .map_err(|_| JobsError::Internal("operation output type".into()))
                });
                let value = result.map(|(value, effects)| {
                    inner.apply(effects);
                    value
                });
                settle.settle(value);
            }),
        };
        self.inner.store.submit(op);
        pending
    }

    /// Runs `f` on a snapshot of everything committed so far.
    pub fn read<T>(&self, ns: &str, f: impl FnOnce(&mut Tx) -> Result<T, JobsError>) -> Result<T, JobsError> {
        let mut snapshot = query::ReadOnly(self.inner.store.snapshot()?);
        let mut tx = Tx::new(&mut snapshot, ns, self.now_ms(), &self.inner.config);
        tx.lease_now = self.inner.lease_clock.now_ms();
        tx.core_now = self.inner.clock.now_ms();
        // A read runs on its caller's thread (a server task, the addon's
        // async runtime): its panic fails it with the panic's message, as a
        // write's does, where the runtime would report only that it panicked.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut tx)))
            .unwrap_or_else(|p| Err(JobsError::panicked(p)))
    }

    /// Refuses a namespace or queue name no call would take.
    pub fn check_queue_name(ns: &str, queue: &str) -> Result<(), JobsError> {
        Self::queue(ns, queue).map(|_| ())
    }

    /// Refuses a namespace the core cannot hold (empty, over 128 bytes).
    pub fn check_namespace(ns: &str) -> Result<(), JobsError> {
        validate_name("namespace", ns, 128)
    }

    fn queue(ns: &str, queue: &str) -> Result<QueueId, JobsError> {
        Self::check_namespace(ns)?;
        validate_name("queue name", queue, enqueue::MAX_NAME_BYTES)?;
        Ok(QueueId::new(ns, queue))
    }

    fn queue_write<T, F>(&self, ns: &str, queue: &str, sync: bool, body: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnMut(&mut Tx, &QueueId) -> Result<T, JobsError> + Send + 'static,
    {
        self.queue_submit(ns, queue, sync, false, body)
    }

    /// [`Self::queue_write`] of a write of one job (see [`WriteOp::brief`]).
    fn job_write<T, F>(&self, ns: &str, queue: &str, sync: bool, body: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnMut(&mut Tx, &QueueId) -> Result<T, JobsError> + Send + 'static,
    {
        self.queue_submit(ns, queue, sync, true, body)
    }

    fn queue_submit<T, F>(&self, ns: &str, queue: &str, sync: bool, brief: bool, mut body: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnMut(&mut Tx, &QueueId) -> Result<T, JobsError> + Send + 'static,
    {
        match Self::queue(ns, queue) {
            Ok(q) => self.submit_write(ns, Durable::needed(sync), brief, move |tx| body(tx, &q)),
            Err(e) => Pending::settled(Err(e)),
        }
    }

    fn queue_read<T>(
        &self,
        ns: &str,
        queue: &str,
        f: impl FnOnce(&mut Tx, &QueueId) -> Result<T, JobsError>,
    ) -> Result<T, JobsError> {
        let q = Self::queue(ns, queue)?;
        self.read(ns, |tx| f(tx, &q))
    }

    // ---- producing -------------------------------------------------------

    pub fn enqueue(&self, ns: &str, queue: &str, req: EnqueueRequest) -> Pending<Enqueued> {
        self.job_write(ns, queue, true, move |tx, q| enqueue::enqueue(tx, q, req.clone(), enqueue::Placement::Normal))
    }

    /// Adds many jobs in one transaction; each gets its own result, and a
    /// failed one leaves the others in place. `key`, a key for the whole
    /// call, makes a repeat answer the jobs the first made (`enqueue::bulk`).
    pub fn enqueue_bulk(
        &self,
        ns: &str,
        queue: &str,
        reqs: Vec<EnqueueRequest>,
        key: Option<Idempotency>,
    ) -> Pending<Vec<Result<Enqueued, JobsError>>> {
        let brief = reqs.len() <= BRIEF_JOBS;
        self.queue_submit(ns, queue, true, brief, move |tx, q| enqueue::bulk(tx, q, &reqs, false, key.as_ref()))
    }

    /// Adds every job or none: the first refusal fails the write, which then
    /// keeps nothing (BullMQ's addBulk answers one error for the call).
    pub fn enqueue_all(
        &self,
        ns: &str,
        queue: &str,
        reqs: Vec<EnqueueRequest>,
        key: Option<Idempotency>,
    ) -> Pending<Vec<Enqueued>> {
        let brief = reqs.len() <= BRIEF_JOBS;
        self.queue_submit(ns, queue, true, brief, move |tx, q| {
            enqueue::bulk(tx, q, &reqs, true, key.as_ref())?.into_iter().collect()
        })
    }

    /// Inserts a flow tree atomically: all of it, or none of it.
    pub fn flow(&self, ns: &str, nodes: Vec<enqueue::FlowNode>) -> Pending<Vec<Enqueued>> {
        let brief = nodes.len() <= BRIEF_JOBS;
        self.flow_write(ns, Arc::new(nodes), brief)
    }

    fn flow_write(&self, ns: &str, nodes: Arc<Vec<enqueue::FlowNode>>, brief: bool) -> Pending<Vec<Enqueued>> {
        self.submit_write(ns, Durable::UnlessRelaxed, brief, move |tx| enqueue::flow(tx, nodes.to_vec()))
    }

    /// Inserts several flows (BullMQ's `FlowProducer.addBulk`): all of them
    /// in one write, in the nodes' order, as Redis's MULTI adds them (a
    /// worker sees none of them before it sees all, and the jobs queue in
    /// that order, not tree after tree). If a tree is refused, that write
    /// keeps nothing, and each tree is then written on its own, so that the
    /// others go in (on Redis one refused add leaves the rest in). Resolves
    /// to one result per node, in the nodes' order.
    pub fn flows(&self, ns: &str, nodes: Vec<enqueue::FlowNode>) -> Pending<Vec<Result<Enqueued, JobsError>>> {
        let count = nodes.len();
        let brief = count <= BRIEF_JOBS;
        let nodes = Arc::new(nodes);
        let whole = self.flow_write(ns, Arc::clone(&nodes), brief);
        let (settle, out) = crate::pending::pending();
        let jobs = self.clone();
        let ns = ns.to_string();
        whole.then(move |result| match result {
            Ok(added) => settle.settle(Ok(added.into_iter().map(Ok).collect())),
            Err(refused) => {
                let trees = enqueue::flow_trees(&nodes);
                if trees.len() <= 1 {
                    settle.settle(Ok((0..count).map(|_| Err(refused.clone())).collect()));
                } else {
                    // Not brief: this runs on the thread that settled the
                    // write, the store's own.
                    jobs.each_flow_tree(&ns, &nodes, trees).then(move |each| settle.settle(each));
                }
            }
        });
        out
    }

    /// Writes each of `trees` (positions in `nodes`) on its own; one result
    /// per node, in the nodes' order.
    fn each_flow_tree(
        &self,
        ns: &str,
        nodes: &[enqueue::FlowNode],
        trees: Vec<Vec<usize>>,
    ) -> Pending<Vec<Result<Enqueued, JobsError>>> {
        let count = nodes.len();
        let (positions, writes): (Vec<Vec<usize>>, Vec<Pending<Vec<Enqueued>>>) = trees
            .into_iter()
            .map(|positions| {
                let tree = positions.iter().map(|&i| nodes[i].clone()).collect();
                let write = self.flow_write(ns, Arc::new(tree), false);
                (positions, write)
            })
            .unzip();
        Pending::all(writes).map(move |trees| {
            let mut out: Vec<Option<Result<Enqueued, JobsError>>> = (0..count).map(|_| None).collect();
            for (positions, tree) in positions.into_iter().zip(trees) {
                match tree {
                    Ok(added) => {
                        for (i, e) in positions.into_iter().zip(added) {
                            out[i] = Some(Ok(e));
                        }
                    }
                    Err(e) => {
                        for i in positions {
                            out[i] = Some(Err(e.clone()));
                        }
                    }
                }
            }
            out.into_iter()
                .map(|r| r.unwrap_or_else(|| Err(JobsError::Internal("a flow node got no result".into()))))
                .collect()
        })
    }

    // ---- consuming -------------------------------------------------------

    /// Takes up to `req.max` jobs now. A lost lease is a stalled one, so the
    /// lease does not wait for fsync, unless it failed a job on the way (one
    /// that expired, or one marked to fail under `req.fail_deferred`): a
    /// failure is an outcome (see [`Tx::require_durable`]). If the caller
    /// drops the result before taking it (a call cancelled, or its client
    /// gone, while the lease committed), the jobs go back to the front of the
    /// queue at once instead of waiting out their leases and counting as
    /// stalled.
    pub fn lease(&self, ns: &str, queue: &str, req: LeaseRequest) -> Pending<Leased> {
        let give_back = self.give_back(ns, queue);
        self.job_write(ns, queue, false, move |tx, q| lease::lease(tx, q, &req))
            .if_abandoned(move |leased| give_back(leased.leases))
    }

    /// Releases leases nobody received, at once, instead of leaving them to
    /// run out and count as stalled.
    fn give_back(&self, ns: &str, queue: &str) -> impl FnOnce(Vec<Lease>) + Send + 'static {
        let jobs = self.clone();
        let (ns, queue) = (ns.to_string(), queue.to_string());
        move |leases| {
            for l in leases {
                let back = Outcome::Release { after_ms: None };
                // Fenced by the lease's epoch: a job the sweep already took
                // back is left alone.
                jobs.complete(&ns, &queue, &l.job.id, Fence::Epoch(l.epoch), back, CompleteOptions::default())
                    .then(|_| {});
            }
        }
    }

    /// This handle without a caller's time: waits run on the core's clock,
    /// since a fixed time would never see a delayed job fall due.
    fn clocked(&self) -> Jobs {
        Jobs { at: None, ..self.clone() }
    }

    /// Takes jobs, waiting up to `wait` for one to be ready.
    pub async fn lease_wait(
        &self,
        ns: &str,
        queue: &str,
        req: LeaseRequest,
        wait: Duration,
        interrupt: Option<&Interrupt>,
    ) -> Result<Leased, JobsError> {
        if self.at.is_some() {
            return Box::pin(self.clocked().lease_wait(ns, queue, req, wait, interrupt)).await;
        }
        let q = Self::queue(ns, queue)?;
        let deadline = deadline_after(wait);
        // Jobs failed by the tries that found nothing to hand out.
        let mut failed = 0;
        loop {
            let listener = self.inner.notifier.listen(&q, Channel::Jobs);
            let mut got = self.lease(ns, queue, req.clone()).await?;
            failed += got.info.failed;
            got.info.failed = failed;
            let now = Instant::now();
            if !got.leases.is_empty() || now >= deadline || self.is_closed() || interrupt.is_some_and(|i| i.is_fired())
            {
                return Ok(got);
            }
            let until = self.wake_time(&got.info, deadline);
            let sleep = until.saturating_duration_since(now);
            if sleep_until_woken(listener, sleep, interrupt).await == Wake::Interrupted {
                return Ok(got);
            }
        }
    }

    /// The blocking form of [`Jobs::lease_wait`].
    pub fn lease_wait_blocking(
        &self,
        ns: &str,
        queue: &str,
        req: LeaseRequest,
        wait: Duration,
    ) -> Result<Leased, JobsError> {
        if self.at.is_some() {
            return self.clocked().lease_wait_blocking(ns, queue, req, wait);
        }
        let q = Self::queue(ns, queue)?;
        let deadline = deadline_after(wait);
        let mut failed = 0;
        loop {
            let listener = self.inner.notifier.listen(&q, Channel::Jobs);
            let mut got = self.lease(ns, queue, req.clone()).wait()?;
            failed += got.info.failed;
            got.info.failed = failed;
            let now = Instant::now();
            if !got.leases.is_empty() || now >= deadline || self.is_closed() {
                return Ok(got);
            }
            listener.wait_deadline(self.wake_time(&got.info, deadline));
        }
    }

    /// When an empty lease is worth retrying: at the deadline, when the next
    /// delayed job is due, or when the rate limit lifts.
    fn wake_time(&self, info: &LeaseInfo, deadline: Instant) -> Instant {
        let now_ms = self.now_ms();
        let mut until = deadline;
        let mut consider = |ms: u64| {
            let t = deadline_after(Duration::from_millis(ms));
            if t < until {
                until = t;
            }
        };
        if let Some(due) = info.next_due {
            consider(due.saturating_sub(now_ms));
        }
        if info.rate_limit_ms > 0 {
            consider(info.rate_limit_ms);
        }
        until
    }

    /// Waits until a job may be ready, without taking it (BullMQ's
    /// `waitForJob`): Some(0) once one is ready (now, or when a delayed job
    /// falls due within the wait), None on timeout or interrupt. `tell`, if
    /// given, is also called the moment a write wakes this wait, on that
    /// write's thread (see [`Telling`]); the result that follows is Some(0).
    /// A wait cut short (interrupted, or the core closed, which wakes every
    /// waiter too) answers None and does not tell.
    pub async fn wait_for_job(
        &self,
        ns: &str,
        queue: &str,
        wait: Duration,
        interrupt: Option<&Interrupt>,
        tell: Option<&Tell>,
    ) -> Result<Option<u64>, JobsError> {
        if self.at.is_some() {
            return Box::pin(self.clocked().wait_for_job(ns, queue, wait, interrupt, tell)).await;
        }
        let q = Self::queue(ns, queue)?;
        let deadline = deadline_after(wait);
        let (cut_short, tell) = self.unless_cut_short(interrupt, tell);
        loop {
            let listener = self.inner.notifier.listen(&q, Channel::Jobs);
            let (ready, due, paused) = self.read(ns, |tx| {
                let s = tx.stats(&q)?.clone();
                let paused = tx.is_paused(&q)? || query::is_maxed(tx, &q)?;
                Ok((s.waiting + s.prioritized > 0, lease::next_due(tx, &q)?, paused))
            })?;
            let now_ms = self.now_ms();
            if !paused && (ready || due.is_some_and(|d| d <= now_ms)) {
                return Ok(Some(0));
            }
            let now = Instant::now();
            if now >= deadline || cut_short() {
                return Ok(None);
            }
            // Sleep until woken, or until the next delayed job falls due.
            let mut until = deadline;
            if let Some(d) = due.filter(|_| !paused) {
                until = until.min(now.checked_add(Duration::from_millis(d.saturating_sub(now_ms))).unwrap_or(until));
            }
            let sleep = until.saturating_duration_since(now);
            match sleep_until_woken(Telling::new(listener, tell.as_ref()), sleep, interrupt).await {
                // Woken by a write that may have made a job ready: the
                // snapshot may not show it yet (its commit may still be on
                // its way to disk), while the lease BullMQ now asks for
                // sees it. Unless the wait was cut short meanwhile.
                Wake::Notified if cut_short() => return Ok(None),
                Wake::Notified => return Ok(Some(0)),
                Wake::TimedOut => {}
                Wake::Interrupted => return Ok(None),
            }
        }
    }

    /// Whether a wait was cut short (the core closed, or `interrupt` fired),
    /// and `tell` made to do nothing for a wait cut short.
    fn unless_cut_short(
        &self,
        interrupt: Option<&Interrupt>,
        tell: Option<&Tell>,
    ) -> (impl Fn() -> bool + Clone + Send + Sync + 'static, Option<Tell>) {
        let cut_short = {
            let (inner, interrupt) = (Arc::clone(&self.inner), interrupt.cloned());
            move || inner.closed.load(Ordering::SeqCst) || interrupt.as_ref().is_some_and(Interrupt::is_fired)
        };
        let tell = tell.map(|tell| {
            let (tell, cut_short) = (Arc::clone(tell), cut_short.clone());
            Arc::new(move || {
                if !cut_short() {
                    tell();
                }
            }) as Tell
        });
        (cut_short, tell)
    }

    pub fn extend(&self, ns: &str, queue: &str, id: &str, fence: Fence, duration_ms: u64) -> Pending<u64> {
        let id = id.to_string();
        self.job_write(ns, queue, false, move |tx, q| lease::extend(tx, q, &id, &fence, duration_ms))
    }

    /// Extends many leases; returns the ids that could not be extended.
    pub fn extend_many(
        &self,
        ns: &str,
        queue: &str,
        items: Vec<(String, Fence)>,
        duration_ms: u64,
    ) -> Pending<Vec<String>> {
        self.queue_write(ns, queue, false, move |tx, q| {
            lease::check_extension(duration_ms)?;
            let mut failed = Vec::new();
            for (id, fence) in &items {
                if lease::extend(tx, q, id, fence, duration_ms).is_err() {
                    failed.push(id.clone());
                }
            }
            Ok(failed)
        })
    }

    pub fn complete(
        &self,
        ns: &str,
        queue: &str,
        id: &str,
        fence: Fence,
        outcome: Outcome,
        opts: CompleteOptions,
    ) -> Pending<Completed> {
        let id = id.to_string();
        let give_back = self.give_back_next(ns, queue);
        self.job_write(ns, queue, true, move |tx, q| complete::complete(tx, q, &id, &fence, outcome.clone(), &opts))
            .if_abandoned(give_back)
    }

    /// [`complete::complete_then_rate_limit_ttl`]: [`Self::complete`], then,
    /// in the same transaction, how long the queue is rate limited for under
    /// `limiter` (or the queue's own limit), with BullMQ's rule for a release
    /// of a job that is not active.
    #[allow(clippy::too_many_arguments, reason = "complete's arguments and the limiter")]
    pub fn complete_then_rate_limit_ttl(
        &self,
        ns: &str,
        queue: &str,
        id: &str,
        fence: Fence,
        outcome: Outcome,
        opts: CompleteOptions,
        limiter: RateLimit,
    ) -> Pending<(Completed, u64)> {
        let id = id.to_string();
        let give_back = self.give_back_next(ns, queue);
        self.job_write(ns, queue, true, move |tx, q| {
            complete::complete_then_rate_limit_ttl(tx, q, &id, &fence, outcome.clone(), &opts, Some(&limiter))
        })
        .if_abandoned(move |(done, _)| give_back(done))
    }

    /// The next job a completion fetched is a lease too: if its caller is
    /// gone, it goes back as `lease` gives back its jobs.
    fn give_back_next(&self, ns: &str, queue: &str) -> impl FnOnce(Completed) + Send + 'static {
        let give_back = self.give_back(ns, queue);
        move |done| give_back(done.next.map(|n| n.leases).unwrap_or_default())
    }

    // ---- reporting -------------------------------------------------------

    /// A worker's report on the job it holds (see [`admin::report`]).
    pub fn report(
        &self,
        ns: &str,
        queue: &str,
        id: &str,
        fence: Fence,
        report: Report,
        idempotency: Option<Idempotency>,
    ) -> Pending<u64> {
        let id = id.to_string();
        self.job_write(ns, queue, true, move |tx, q| {
            admin::report(tx, q, &id, &fence, report.clone(), idempotency.as_ref())
        })
    }

    // ---- maintenance -----------------------------------------------------

    /// Moves due delayed jobs to waiting; returns the next due time.
    pub fn promote_due(&self, ns: &str, queue: &str) -> Pending<Option<u64>> {
        self.queue_write(ns, queue, true, |tx, q| lease::promote_due(tx, q, usize::MAX))
    }

    /// Reclaims expired leases now; returns the reclaimed job ids.
    pub fn sweep_stalled(&self, ns: &str, queue: &str) -> Pending<Vec<String>> {
        self.queue_write(ns, queue, true, lease::sweep_stalled)
    }

    /// A transaction on one queue, for admin operations (see [`admin`] and [`schedule`]).
    pub fn admin<T, F>(&self, ns: &str, queue: &str, body: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnMut(&mut Tx, &QueueId) -> Result<T, JobsError> + Send + 'static,
    {
        self.queue_write(ns, queue, true, body)
    }

    /// [`Self::admin`] for a write of one job, whose cost is bounded (see
    /// [`WriteOp::brief`]): a host's event loop may run it.
    pub fn job_admin<T, F>(&self, ns: &str, queue: &str, body: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnMut(&mut Tx, &QueueId) -> Result<T, JobsError> + Send + 'static,
    {
        self.job_write(ns, queue, true, body)
    }

    /// A read on one queue (see [`query`]).
    pub fn query<T>(
        &self,
        ns: &str,
        queue: &str,
        f: impl FnOnce(&mut Tx, &QueueId) -> Result<T, JobsError>,
    ) -> Result<T, JobsError> {
        self.queue_read(ns, queue, f)
    }

    pub fn set_queue_config(&self, ns: &str, queue: &str, config: QueueConfig) -> Pending<()> {
        self.queue_write(ns, queue, true, move |tx, q| tx.set_queue_config(q, config.clone()))
    }

    pub fn get_job(&self, ns: &str, queue: &str, id: &str) -> Result<Option<JobRecord>, JobsError> {
        self.queue_read(ns, queue, |tx, q| query::get_job(tx, q, id))
    }

    pub fn counts(&self, ns: &str, queue: &str, states: &[JobState]) -> Result<Vec<u64>, JobsError> {
        self.queue_read(ns, queue, |tx, q| query::counts(tx, q, states, None))
    }

    pub fn set_meta(&self, ns: &str, queue: &str, values: BTreeMap<String, String>) -> Pending<u64> {
        self.queue_write(ns, queue, true, move |tx, q| admin::set_meta(tx, q, &values))
    }

    // ---- events ----------------------------------------------------------

    /// Events after sequence `after` (None = from now on), at most `limit`,
    /// waiting up to `wait` for the first. `tell`, if given, is also called
    /// the moment a write that added events wakes this wait, on that write's
    /// thread (see [`Telling`]), unless the wait was cut short; the events
    /// are then read here too.
    #[allow(
        clippy::too_many_arguments,
        reason = "the read (from where, how many) and the wait (how long, what cuts it short, whom it tells), as wait_for_job"
    )]
    pub async fn read_events(
        &self,
        ns: &str,
        queue: &str,
        after: Option<u64>,
        limit: usize,
        wait: Duration,
        interrupt: Option<&Interrupt>,
        tell: Option<&Tell>,
    ) -> Result<Vec<Event>, JobsError> {
        let q = Self::queue(ns, queue)?;
        let after = self.events_start(ns, &q, after)?;
        let deadline = deadline_after(wait);
        let (cut_short, tell) = self.unless_cut_short(interrupt, tell);
        loop {
            let listener = self.inner.notifier.listen(&q, Channel::Events);
            let events = self.read(ns, |tx| query::events_after(tx, &q, after, limit))?;
            let now = Instant::now();
            if !events.is_empty() || now >= deadline || cut_short() {
                return Ok(events);
            }
            let sleep = deadline - now;
            if sleep_until_woken(Telling::new(listener, tell.as_ref()), sleep, interrupt).await == Wake::Interrupted {
                return Ok(events);
            }
        }
    }

    /// Where a read of events starts: after `after`, or after the newest
    /// event when it is None (from now on).
    fn events_start(&self, ns: &str, q: &QueueId, after: Option<u64>) -> Result<u64, JobsError> {
        match after {
            Some(a) => Ok(a),
            None => self.read(ns, |tx| query::last_event_seq(tx, q)),
        }
    }

    /// The blocking form of [`Jobs::read_events`].
    pub fn read_events_blocking(
        &self,
        ns: &str,
        queue: &str,
        after: Option<u64>,
        limit: usize,
        wait: Duration,
    ) -> Result<Vec<Event>, JobsError> {
        let q = Self::queue(ns, queue)?;
        let after = self.events_start(ns, &q, after)?;
        let deadline = deadline_after(wait);
        loop {
            let listener = self.inner.notifier.listen(&q, Channel::Events);
            let events = self.read(ns, |tx| query::events_after(tx, &q, after, limit))?;
            if !events.is_empty() || Instant::now() >= deadline || self.is_closed() {
                return Ok(events);
            }
            listener.wait_deadline(deadline);
        }
    }

    // ---- schedulers --------------------------------------------------------

    pub fn upsert_scheduler(
        &self,
        ns: &str,
        queue: &str,
        spec: schedule::SchedulerSpec,
    ) -> Pending<Option<(String, u64)>> {
        self.queue_write(ns, queue, true, move |tx, q| schedule::upsert(tx, q, spec.clone()))
    }
}

/// How a sleep in [`sleep_until_woken`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wake {
    Notified,
    TimedOut,
    Interrupted,
}

/// Sleeps until `listener` fires, `sleep` passes, or `interrupt` fires;
/// `Interrupted` at once when the interrupt had already fired.
async fn sleep_until_woken(
    listener: impl std::future::Future<Output = ()> + Unpin,
    sleep: Duration,
    interrupt: Option<&Interrupt>,
) -> Wake {
    match interrupt {
        Some(i) => {
            let stop = i.signal.listen();
            if i.is_fired() {
                return Wake::Interrupted;
            }
            let woken = tokio::time::timeout(sleep, async {
                tokio::select! { _ = listener => Wake::Notified, _ = stop => Wake::Interrupted }
            })
            .await;
            woken.unwrap_or(Wake::TimedOut)
        }
        None => match tokio::time::timeout(sleep, listener).await {
            Ok(_) => Wake::Notified,
            Err(_) => Wake::TimedOut,
        },
    }
}

/// Wakes a queue's waiting workers when its delayed jobs fall due and sweeps
/// each queue's expired leases every stalled interval. Holds only a weak
/// handle, so dropping the last [`Jobs`] ends it.
fn maintenance_loop(weak: std::sync::Weak<Inner>) {
    const IDLE: Duration = Duration::from_secs(1);
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.closed.load(Ordering::SeqCst) {
            return;
        }
        let now_ms = inner.clock.now_ms();
        let mut due = Vec::new();
        {
            let mut heap = inner.timers.heap.lock();
            while heap.peek().is_some_and(|Reverse((at, _))| *at <= now_ms) {
                if let Some(Reverse((_, q))) = heap.pop() {
                    due.push(q);
                }
            }
        }
        due.sort();
        due.dedup();
        let jobs = Jobs { inner: Arc::clone(&inner), maintenance: Arc::new(Mutex::new(None)), at: None };
        for q in due {
            // A delayed job fell due: wake the workers waiting on its queue.
            // Their lease moves it to waiting, at their time, as BullMQ's
            // moveToActive promotes on Redis; with no worker asking it stays
            // delayed, as on Redis (BullMQ's tests count on that, and a
            // promotion here would run on this thread's clock, not the
            // caller's). Each delayed job armed its own timer; the next one
            // is armed here too, for the queues only their first due time
            // was armed for at open.
            inner.notifier.notify(&q, Channel::Jobs);
            if let Ok(Some(next)) = jobs.read(&q.ns, |tx| lease::next_due_after(tx, &q, now_ms)) {
                inner.apply(Effects { timers: vec![(q.clone(), next)], ..Default::default() });
            }
        }
        let now = Instant::now();
        let sweep_due: Vec<QueueId> =
            inner.sweeps.lock().iter().filter(|(_, at)| **at <= now).map(|(q, _)| q.clone()).collect();
        for q in sweep_due {
            let interval = jobs
                .read(&q.ns, |tx| tx.queue_config(&q))
                .map(|c| Duration::from_millis(c.stalled_interval_ms.max(100)))
                .unwrap_or(Duration::from_secs(30));
            let _ = jobs.sweep_stalled(&q.ns, &q.name).wait();
            inner.sweeps.lock().insert(q, now.checked_add(interval).unwrap_or_else(|| deadline_after(interval)));
        }
        let mut wait = IDLE;
        if let Some(next_sweep) = inner.sweeps.lock().values().min() {
            wait = wait.min(next_sweep.saturating_duration_since(Instant::now()));
        }
        let mut heap = inner.timers.heap.lock();
        // The next timer is read here, under the lock the wait releases, and
        // not before promoting and sweeping: one armed meanwhile was notified
        // when nobody waited, and would be slept through.
        if let Some(Reverse((at, _))) = heap.peek() {
            wait = wait.min(Duration::from_millis(at.saturating_sub(inner.clock.now_ms())));
        }
        if !inner.closed.load(Ordering::SeqCst) {
            inner.timers.changed.wait_for(&mut heap, wait.max(Duration::from_millis(1)));
        }
    }
}

/// When a wait of `wait` ends; a wait too long for the clock (a caller's
/// "forever") ends in about a century instead of overflowing.
fn deadline_after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}
