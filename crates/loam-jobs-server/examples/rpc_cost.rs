//! The server's own cost per call: runs Enqueue, Lease and Complete against
//! a running `loam-jobs serve` and reads the server process's CPU time from
//! /proc before and after each phase.
//!
//! cargo run --release -p loam-jobs-server --example rpc_cost -- --url http://127.0.0.1:7720 --pid PID

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a measuring tool: a failure should stop it loudly")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use connectrpc::client::{ClientConfig, HttpClient};
use loam_jobs_proto::loam::jobs::v1 as pb;
use pb::__buffa::oneof;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "http://127.0.0.1:7720")]
    url: String,
    /// The server's process id, to read its CPU time.
    #[arg(long)]
    pid: u32,
    /// Jobs per phase.
    #[arg(long, default_value_t = 5000)]
    jobs: usize,
    /// Concurrent callers in the concurrent phases.
    #[arg(long, default_value_t = 100)]
    concurrency: usize,
    /// Completions carry an idempotency key, as the BullMQ remote client's do.
    #[arg(long)]
    keyed: bool,
}

type Client = pb::JobsServiceClient<HttpClient>;

/// User plus system CPU seconds of a process.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the server's /proc stat");
    let after_name = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields 14 and 15 of stat (utime, stime) are 12 and 13 after the name.
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

fn report(name: &str, calls: usize, wall: Duration, cpu: f64, client_cpu: f64) {
    println!(
        "{name:<44} {calls:>7} calls  {:>9.0} calls/s  server CPU {:>6.1} µs/call  client CPU {:>6.1} µs/call",
        calls as f64 / wall.as_secs_f64(),
        cpu * 1e6 / calls as f64,
        client_cpu * 1e6 / calls as f64
    );
}

async fn phase<F, Fut>(args: &Args, name: &str, calls: usize, f: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let me = std::process::id();
    let (t0, c0, m0) = (Instant::now(), cpu_seconds(args.pid), cpu_seconds(me));
    f().await;
    report(name, calls, t0.elapsed(), cpu_seconds(args.pid) - c0, cpu_seconds(me) - m0);
}

fn job(queue: &str) -> pb::EnqueueRequest {
    pb::EnqueueRequest {
        queue: queue.into(),
        job: pb::JobSpec { name: "bench".into(), data: b"{\"n\":1}".to_vec(), attempts: 1, ..Default::default() }
            .into(),
        ..Default::default()
    }
}

/// Tells this worker's keys apart from every other's.
fn rand_suffix() -> String {
    use std::hash::{BuildHasher, RandomState};
    format!("{:x}", RandomState::new().hash_one(Instant::now()))
}

fn success() -> pb::Outcome {
    pb::Outcome { kind: Some(oneof::outcome::Kind::from(pb::outcome::Success::default())), ..Default::default() }
}

/// Leases one job at a time and completes it, taking the next in the same call.
async fn worker(c: Arc<Client>, queue: String, until_empty: bool, keyed: bool) -> usize {
    let mut done = 0;
    let key_prefix = format!("rpc-cost:{}:", rand_suffix());
    let mut next: Option<pb::Leased> = None;
    loop {
        let leased = match next.take() {
            Some(l) if !l.leases.is_empty() => l,
            _ => {
                let req = pb::LeaseRequest {
                    queue: queue.clone(),
                    options: pb::LeaseOptions { max: 1, ..Default::default() }.into(),
                    wait_ms: if until_empty { 0 } else { 200 },
                    ..Default::default()
                };
                c.lease(req).await.unwrap().into_owned().leased.into_option().unwrap_or_default()
            }
        };
        let Some(l) = leased.leases.first() else { return done };
        let req = pb::CompleteRequest {
            queue: queue.clone(),
            job_id: l.job.as_option().unwrap().id.clone(),
            fence: pb::Fence { kind: Some(oneof::fence::Kind::Epoch(l.epoch)), ..Default::default() }.into(),
            outcome: success().into(),
            options: pb::CompleteOptions {
                fetch_next: pb::LeaseOptions { max: 1, ..Default::default() }.into(),
                idempotency: keyed
                    .then(|| pb::Idempotency {
                        key: format!("{key_prefix}{done}"),
                        ttl_ms: Some(95_000),
                        ..Default::default()
                    })
                    .into(),
                ..Default::default()
            }
            .into(),
            ..Default::default()
        };
        next = c.complete(req).await.unwrap().into_owned().completed.into_option().unwrap().next.into_option();
        done += 1;
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let client =
        Arc::new(pb::JobsServiceClient::new(HttpClient::plaintext(), ClientConfig::new(args.url.parse().unwrap())));
    let n = args.jobs;
    let run = format!("bench-{}", std::process::id());

    phase(&args, "Query (a snapshot read), one caller", n, || async {
        for _ in 0..n {
            let q = pb::QueryRequest {
                queue: run.clone(),
                query: Some(oneof::query_request::Query::IsMaxed(true)),
                ..Default::default()
            };
            client.query(q).await.unwrap();
        }
    })
    .await;
    phase(&args, "Enqueue, one caller", n, || async {
        for _ in 0..n {
            client.enqueue(job(&format!("{run}-seq"))).await.unwrap();
        }
    })
    .await;
    phase(&args, "Lease + Complete(fetch_next), one caller", n, || async {
        let done = worker(Arc::clone(&client), format!("{run}-seq"), true, args.keyed).await;
        assert_eq!(done, n);
    })
    .await;
    phase(&args, "EnqueueBulk of 100", n / 100, || async {
        for _ in 0..n / 100 {
            let jobs = (0..100).map(|_| job("x").job.into_option().unwrap()).collect();
            let req = pb::EnqueueBulkRequest { queue: format!("{run}-conc"), jobs, ..Default::default() };
            client.enqueue_bulk(req).await.unwrap();
        }
    })
    .await;
    let conc = args.concurrency;
    phase(&args, &format!("processing at concurrency {conc} (jobs)"), (n / 100) * 100, || async {
        let tasks: Vec<_> = (0..conc)
            .map(|_| tokio::spawn(worker(Arc::clone(&client), format!("{run}-conc"), true, args.keyed)))
            .collect();
        let mut total = 0;
        for t in tasks {
            total += t.await.unwrap();
        }
        assert_eq!(total, (n / 100) * 100);
    })
    .await;
    phase(&args, &format!("Enqueue at concurrency {conc}"), n, || async {
        let per = n / conc;
        let tasks: Vec<_> = (0..conc)
            .map(|_| {
                let (c, q) = (Arc::clone(&client), format!("{run}-par"));
                tokio::spawn(async move {
                    for _ in 0..per {
                        c.enqueue(job(&q)).await.unwrap();
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    })
    .await;
}
