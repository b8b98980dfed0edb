//! `/metrics`: the server's counters and gauges, in the OpenMetrics text
//! format (which Prometheus reads). Counters move as calls succeed; the
//! gauges of queue depth are read from the store's counters when scraped, so
//! they cannot drift from the truth.

use std::time::Duration;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use loam_jobs::{JobState, Jobs, QueueStats};
use parking_lot::RwLock;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;

fn queue_labels(ns: &str, queue: &str) -> Labels {
    vec![("ns", ns.to_string()), ("queue", queue.to_string())]
}

/// One queue's members of the per-queue families, each looked up the first
/// time it is used (so `/metrics` shows the same series as without them);
/// they share their values with the family, which is what `/metrics` renders.
struct QueueHandles {
    labels: Labels,
    enqueued: OnceLock<Counter>,
    leased: OnceLock<Counter>,
    lease_seconds: OnceLock<Histogram>,
    fenced: OnceLock<Counter>,
    /// By outcome.
    completed: ByLabel<Counter>,
    /// Attempts' run times, by task (job name).
    runs: ByLabel<Histogram>,
}

/// One queue's members of a family with one label more (an outcome, a
/// task), each made the first time its value occurs.
struct ByLabel<M> {
    label: &'static str,
    members: RwLock<HashMap<String, M>>,
}

impl<M: Clone> ByLabel<M> {
    fn new(label: &'static str) -> Self {
        Self { label, members: RwLock::default() }
    }

    fn member(&self, queue: &Labels, family: &Family<Labels, M>, value: &str) -> M
    where
        fn() -> M: prometheus_client::metrics::family::MetricConstructor<M>,
    {
        if let Some(known) = self.members.read().get(value) {
            return known.clone();
        }
        let mut labels = queue.clone();
        labels.push((self.label, value.to_string()));
        let made = family.get_or_create(&labels).clone();
        self.members.write().insert(value.to_string(), made.clone());
        made
    }
}

impl QueueHandles {
    fn member<'a, M: Clone>(&self, cell: &'a OnceLock<M>, family: &Family<Labels, M>) -> &'a M
    where
        fn() -> M: prometheus_client::metrics::family::MetricConstructor<M>,
    {
        cell.get_or_init(|| family.get_or_create(&self.labels).clone())
    }
}

/// A call's count by method and code, and its method's durations.
type RpcHandles = (Counter, Histogram);
/// A namespace's [`RpcHandles`], by (method, code).
type RpcHandlesByMethod = HashMap<(&'static str, &'static str), RpcHandles>;

pub struct Metrics {
    /// What calls move, and the server-wide gauges: registered once, read by
    /// any number of scrapes at a time (the depth gauges are each scrape's
    /// own, see [`Depths`]).
    registry: Registry,
    /// One scrape at a time per namespace (the whole server's, unnamed, for a
    /// scrape of every namespace): each reads every queue it shows, and a
    /// client scraping in a loop from many connections would otherwise hold
    /// as many reads and texts at once.
    scraping: RwLock<HashMap<String, Arc<parking_lot::Mutex<()>>>>,
    /// By namespace, then queue.
    queue_handles: RwLock<HashMap<String, HashMap<String, Arc<QueueHandles>>>>,
    /// By namespace.
    rpc_handles: RwLock<HashMap<String, RpcHandlesByMethod>>,
    enqueued: Family<Labels, Counter>,
    leased: Family<Labels, Counter>,
    completed: Family<Labels, Counter>,
    fenced: Family<Labels, Counter>,
    rpcs: Family<Labels, Counter>,
    rpc_seconds: Family<Labels, Histogram>,
    lease_seconds: Family<Labels, Histogram>,
    run_seconds: Family<Labels, Histogram>,
    request_bytes: Gauge,
    request_waits: Counter,
    request_refusals: Counter,
}

fn run_histogram() -> Histogram {
    // 1 ms to about 35 minutes: what a job's attempt takes.
    Histogram::new(exponential_buckets(0.001, 2.0, 22))
}

fn latency_histogram() -> Histogram {
    // 50 µs to about 27 s: unary calls, and long-polls that waited.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 20))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::default(),
            scraping: RwLock::default(),
            queue_handles: RwLock::default(),
            rpc_handles: RwLock::default(),
            enqueued: Family::default(),
            leased: Family::default(),
            completed: Family::default(),
            fenced: Family::default(),
            rpcs: Family::default(),
            rpc_seconds: Family::new_with_constructor(latency_histogram),
            lease_seconds: Family::new_with_constructor(latency_histogram),
            run_seconds: Family::new_with_constructor(run_histogram),
            request_bytes: Gauge::default(),
            request_waits: Counter::default(),
            request_refusals: Counter::default(),
        };
        {
            let r = &mut m.registry;
            r.register(
                "loam_jobs_enqueued",
                "Jobs created by Enqueue, EnqueueBulk, Flow and schedules",
                m.enqueued.clone(),
            );
            r.register("loam_jobs_leased", "Jobs handed to workers", m.leased.clone());
            r.register(
                "loam_jobs_completed",
                "Completions by what they did to the job (ok, retry, fail, release, delay, wait_children, rate_limited); a retry with no attempts left failed its job and counts as fail",
                m.completed.clone(),
            );
            r.register("loam_jobs_fenced", "Writes refused because the lease had moved", m.fenced.clone());
            r.register("loam_jobs_rpc_requests", "Calls by method and Connect code", m.rpcs.clone());
            r.register("loam_jobs_rpc_duration_seconds", "Time to answer a call, by method", m.rpc_seconds.clone());
            r.register(
                "loam_jobs_lease_latency_seconds",
                "Time a Lease call that handed out jobs took, its wait included",
                m.lease_seconds.clone(),
            );
            r.register(
                "loam_jobs_run_seconds",
                "Time an attempt ran, from its lease to its outcome (completed, failed or retried), by task (job name)",
                m.run_seconds.clone(),
            );
            r.register(
                "loam_jobs_request_bytes_in_flight",
                "Bytes of requests that calls under way hold, of the --max-request-bytes-in-flight budget",
                m.request_bytes.clone(),
            );
            r.register(
                "loam_jobs_request_budget_waits",
                "Calls that waited for the --max-request-bytes-in-flight budget before they started",
                m.request_waits.clone(),
            );
            r.register(
                "loam_jobs_request_budget_refusals",
                "Calls refused as unavailable: the --max-request-bytes-in-flight budget was taken, and calls holding --max-request-bytes-waiting waited for it",
                m.request_refusals.clone(),
            );
        }
        m
    }

    /// The server's budget of request bytes, `bytes` in all with `waiting`
    /// more allowed to wait for it, shown here.
    pub fn request_budget(&self, bytes: usize, waiting: usize) -> crate::budget::Budget {
        crate::budget::Budget::new(
            bytes,
            waiting,
            self.request_bytes.clone(),
            self.request_waits.clone(),
            self.request_refusals.clone(),
        )
    }

    pub fn enqueued(&self, ns: &str, queue: &str, n: u64) {
        if n > 0 {
            let of = self.of_queue(ns, queue);
            of.member(&of.enqueued, &self.enqueued).inc_by(n);
        }
    }

    /// Only a lease that handed out jobs counts: an empty one says nothing of
    /// latency (a long-poll that timed out), and a queue that never had a job
    /// (any name a caller tries) gets no series.
    pub fn leased(&self, ns: &str, queue: &str, n: u64, took: Duration) {
        if n > 0 {
            let of = self.of_queue(ns, queue);
            of.member(&of.leased, &self.leased).inc_by(n);
            of.member(&of.lease_seconds, &self.lease_seconds).observe(took.as_secs_f64());
        }
    }

    pub fn completed(&self, ns: &str, queue: &str, outcome: &'static str) {
        let of = self.of_queue(ns, queue);
        of.completed.member(&of.labels, &self.completed, outcome).inc();
    }

    /// The jobs a lease failed instead of handing out count as failures, as
    /// when a worker fails them.
    pub fn failed_by_lease(&self, ns: &str, queue: &str, info: &loam_jobs::LeaseInfo) {
        if info.failed > 0 {
            let of = self.of_queue(ns, queue);
            of.completed.member(&of.labels, &self.completed, "fail").inc_by(u64::from(info.failed));
        }
    }

    pub fn ran(&self, ns: &str, queue: &str, attempt: &loam_jobs::AttemptRun) {
        let of = self.of_queue(ns, queue);
        of.runs.member(&of.labels, &self.run_seconds, &attempt.task).observe(attempt.ran_ms as f64 / 1000.0);
    }

    pub fn fenced(&self, ns: &str, queue: &str) {
        let of = self.of_queue(ns, queue);
        of.member(&of.fenced, &self.fenced).inc();
    }

    /// A call of `ns` (empty for one refused before its namespace was
    /// known), counted by method and code.
    pub fn rpc(&self, ns: &str, method: &'static str, code: &'static str, took: Duration) {
        let known = self.rpc_handles.read().get(ns).and_then(|by_method| by_method.get(&(method, code)).cloned());
        let (count, seconds) = known.unwrap_or_else(|| {
            let (ns_label, method_label) = (("ns", ns.to_string()), ("method", method.to_string()));
            let made = (
                self.rpcs
                    .get_or_create(&vec![ns_label.clone(), method_label.clone(), ("code", code.to_string())])
                    .clone(),
                self.rpc_seconds.get_or_create(&vec![ns_label, method_label]).clone(),
            );
            self.rpc_handles.write().entry(ns.to_string()).or_default().insert((method, code), made.clone());
            made
        });
        count.inc();
        seconds.observe(took.as_secs_f64());
    }

    /// The counters of one queue. A family finds its member by its labels,
    /// which costs building (allocating) and hashing them; a server's calls
    /// did that several times each.
    fn of_queue(&self, ns: &str, queue: &str) -> Arc<QueueHandles> {
        if let Some(of) = self.queue_handles.read().get(ns).and_then(|q| q.get(queue)) {
            return Arc::clone(of);
        }
        let made = Arc::new(QueueHandles {
            labels: queue_labels(ns, queue),
            enqueued: OnceLock::new(),
            leased: OnceLock::new(),
            lease_seconds: OnceLock::new(),
            fenced: OnceLock::new(),
            completed: ByLabel::new("outcome"),
            runs: ByLabel::new("task"),
        });
        let mut handles = self.queue_handles.write();
        Arc::clone(handles.entry(ns.to_string()).or_default().entry(queue.to_string()).or_insert(made))
    }

    /// The text exposition, with the depth gauges read from the store now:
    /// of namespace `only`'s queues, or of every queue. A tenant's scrape
    /// reads its own queues only: reading all of them took another tenant's
    /// 200,000 queues into every scrape (1 ms became 5 s). Different
    /// namespaces' scrapes run side by side: each fills depth gauges of its
    /// own, where they once shared theirs under one lock held through every
    /// queue's reads, so one tenant's scrapes of 100,000 queues (1.8 s each)
    /// held another's for seconds.
    pub fn render(&self, jobs: &Jobs, only: Option<&str>) -> String {
        let turn = self.scraping.write().entry(only.unwrap_or_default().to_string()).or_default().clone();
        let _turn = turn.lock();
        let queues = match only {
            Some(ns) => jobs.read(ns, |tx| loam_jobs::ops::query::queues(tx, ns)),
            None => jobs.read("", loam_jobs::ops::query::all_queues),
        };
        let depths = Depths::default();
        if let Ok(queues) = queues {
            depths.read(jobs, queues);
        }
        let mut out = String::new();
        let _ = encode_registry(&mut out, &self.registry);
        let _ = encode_registry(&mut out, &depths.registry());
        let _ = encode_eof(&mut out);
        out
    }
}

/// The gauges of queue depth, and the stalled count the store keeps: read
/// from the store by one scrape, for that scrape alone.
#[derive(Default)]
struct Depths {
    waiting: Family<Labels, Gauge>,
    delayed: Family<Labels, Gauge>,
    active: Family<Labels, Gauge>,
    waiting_children: Family<Labels, Gauge>,
    finished: Family<Labels, Gauge>,
    oldest_waiting: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    dlq_depth: Family<Labels, Gauge>,
    stalled: Family<Labels, Counter>,
}

impl Depths {
    fn read(&self, jobs: &Jobs, queues: Vec<loam_jobs::QueueId>) {
        let now = jobs.now_ms();
        let unfinished = |stats: &QueueStats| {
            [JobState::Waiting, JobState::Prioritized, JobState::Delayed].map(|s| stats.count(s)).iter().sum::<u64>()
        };
        // Each queue's counters and settings are read once; the depth of
        // the dead-letter queues they name comes from the same reads.
        let mut unfinished_of = HashMap::new();
        let mut dead_letter_queues = std::collections::BTreeSet::new();
        for q in queues {
            let Ok((stats, dlq)) =
                jobs.query(&q.ns, &q.name, |tx, q| Ok((tx.stats(q)?.clone(), tx.queue_config(q)?.dead_letter_queue)))
            else {
                continue;
            };
            if let Some(dlq) = dlq {
                dead_letter_queues.insert((q.ns.clone(), dlq));
            }
            unfinished_of.insert((q.ns.clone(), q.name.clone()), unfinished(&stats));
            let labels = queue_labels(&q.ns, &q.name);
            let with = |k: &'static str, v: &str| {
                let mut l = labels.clone();
                l.push((k, v.to_string()));
                l
            };
            let set = |family: &Family<Labels, Gauge>, l: &Labels, v: u64| {
                family.get_or_create(l).set(i64::try_from(v).unwrap_or(i64::MAX));
            };
            set(&self.waiting, &with("band", "fifo"), stats.count(JobState::Waiting));
            set(&self.waiting, &with("band", "prioritized"), stats.count(JobState::Prioritized));
            set(&self.delayed, &labels, stats.count(JobState::Delayed));
            set(&self.active, &labels, stats.count(JobState::Active));
            set(&self.waiting_children, &labels, stats.count(JobState::WaitingChildren));
            set(&self.finished, &with("state", "completed"), stats.count(JobState::Completed));
            set(&self.finished, &with("state", "failed"), stats.count(JobState::Failed));
            if stats.stalled_total > 0 {
                self.stalled.get_or_create(&labels).inc_by(stats.stalled_total);
            }
            let head = jobs.query(&q.ns, &q.name, |tx, q| {
                let Some(id) = loam_jobs::ops::query::range(tx, q, JobState::Waiting, 0, 0, true)?.into_iter().next()
                else {
                    return Ok(None);
                };
                Ok(loam_jobs::ops::query::get_job(tx, q, &id)?.map(|j| j.timestamp))
            });
            if let Ok(Some(ts)) = head {
                self.oldest_waiting.get_or_create(&labels).set(now.saturating_sub(ts) as f64 / 1000.0);
            }
        }
        for (ns, dlq) in dead_letter_queues {
            let depth = match unfinished_of.get(&(ns.clone(), dlq.clone())) {
                Some(n) => *n,
                // Named, never written to: its (empty) counters.
                None => match jobs.query(&ns, &dlq, |tx, q| Ok(tx.stats(q)?.clone())) {
                    Ok(stats) => unfinished(&stats),
                    Err(_) => continue,
                },
            };
            self.dlq_depth.get_or_create(&queue_labels(&ns, &dlq)).set(i64::try_from(depth).unwrap_or(i64::MAX));
        }
    }

    fn registry(&self) -> Registry {
        let mut r = Registry::default();
        r.register(
            "loam_jobs_stalled",
            "Jobs reclaimed from expired leases, by workers' stalled checks or the core's own sweep (read from the store)",
            self.stalled.clone(),
        );
        r.register(
            "loam_jobs_dlq_depth",
            "Unfinished jobs (waiting, prioritized, delayed) in a queue that is another queue's dead-letter queue",
            self.dlq_depth.clone(),
        );
        r.register("loam_jobs_waiting", "Ready jobs, by band (fifo, prioritized)", self.waiting.clone());
        r.register("loam_jobs_delayed", "Delayed jobs", self.delayed.clone());
        r.register("loam_jobs_active", "Leased jobs", self.active.clone());
        r.register("loam_jobs_waiting_children", "Parents waiting for children", self.waiting_children.clone());
        r.register(
            "loam_jobs_finished",
            "Finished jobs still kept, by state (completed, failed)",
            self.finished.clone(),
        );
        r.register(
            "loam_jobs_oldest_waiting_seconds",
            "Age of the job that runs next (FIFO band)",
            self.oldest_waiting.clone(),
        );
        r
    }
}

/// The exposition without the series of other namespaces (calls included:
/// one tenant does not see how another uses the server) but with the
/// server-wide ones, which have no namespace (the request budget).
/// Namespaces hold no quote, backslash or newline (auth refuses them), so the
/// label matches exactly as written.
pub fn only_namespace(text: &str, ns: &str) -> String {
    let mine = format!("ns=\"{ns}\"");
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        if line.starts_with('#') || !line.contains("ns=\"") || line.contains(&mine) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_sees_only_its_series() {
        let text = "# HELP x\nx_total{ns=\"a\",queue=\"q\"} 1\nx_total{ns=\"ab\",queue=\"q\"} 2\n\
                    y_total{ns=\"b\",method=\"Lease\"} 3\nz 4\n# EOF\n";
        let only = only_namespace(text, "a");
        assert_eq!(only, "# HELP x\nx_total{ns=\"a\",queue=\"q\"} 1\nz 4\n# EOF\n");
    }

    /// Names holding a quote, a backslash or a newline stay inside their
    /// label (prometheus-client escapes them): each series is one line, as
    /// `only_namespace`, which filters by line, needs.
    #[test]
    fn label_values_are_escaped() {
        let m = Metrics::new();
        m.enqueued("ns1", "a\"b\\c\nd_total 99", 1);
        let text = exposition(&m);
        let line = r#"loam_jobs_enqueued_total{ns="ns1",queue="a\"b\\c\nd_total 99"} 1"#;
        assert!(text.lines().any(|l| l == line), "{text}");
        assert!(!text.lines().any(|l| l.starts_with("d_total")), "{text}");
    }

    /// A tenant's scrape reads the depths of its own queues only.
    #[tokio::test]
    async fn a_namespaces_scrape_reads_only_its_queues() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = Jobs::open(&dir.path().join("jobs.redb"), loam_jobs::Config::default()).unwrap();
        let job = || loam_jobs::EnqueueRequest { name: "x".into(), data: b"{}".to_vec(), ..Default::default() };
        jobs.enqueue("a", "mine", job()).await.unwrap();
        jobs.enqueue("b", "theirs", job()).await.unwrap();
        jobs.enqueue("ab", "theirs", job()).await.unwrap();
        jobs.enqueue("\0a", "theirs", job()).await.unwrap();
        let m = Metrics::new();
        let text = m.render(&jobs, Some("a"));
        assert!(text.contains(r#"loam_jobs_waiting{ns="a",queue="mine",band="fifo"} 1"#), "{text}");
        assert!(!text.contains(r#"queue="theirs""#), "another namespace's queues were read:\n{text}");
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        let all = m.render(&jobs, None);
        assert!(all.contains(r#"loam_jobs_waiting{ns="b",queue="theirs",band="fifo"} 1"#), "{all}");
        jobs.close();
    }

    fn exposition(m: &Metrics) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &m.registry).unwrap();
        out
    }

    /// A queue's handle is made on its first call, but each series of it
    /// only when that series first moves: a queue that was only enqueued to
    /// shows no leased, fenced or stalled series, as a family would show it.
    #[test]
    fn a_queue_shows_only_the_series_it_used() {
        let m = Metrics::new();
        m.enqueued("ns1", "q", 3);
        let text = exposition(&m);
        assert!(text.contains(r#"loam_jobs_enqueued_total{ns="ns1",queue="q"} 3"#), "{text}");
        for unused in [
            "loam_jobs_leased_total{",
            "loam_jobs_fenced_total{",
            "loam_jobs_stalled_total{",
            "loam_jobs_lease_latency_seconds_count{",
            "loam_jobs_completed_total{",
        ] {
            assert!(!text.contains(unused), "{unused} shown before it moved:\n{text}");
        }
        m.completed("ns1", "q", "ok");
        m.completed("ns1", "q", "ok");
        m.fenced("ns1", "q");
        let text = exposition(&m);
        assert!(text.contains(r#"loam_jobs_completed_total{ns="ns1",queue="q",outcome="ok"} 2"#), "{text}");
        assert!(text.contains(r#"loam_jobs_fenced_total{ns="ns1",queue="q"} 1"#), "{text}");
        assert!(!text.contains("loam_jobs_leased_total{"), "{text}");
    }
}
