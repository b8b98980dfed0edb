//! `loam-jobs-bench`: how fast the queue core is on a redb file.
//!
//! ```text
//! cargo run --release -p loam-jobs-bench -- [--seconds 3] [--callers 1,16,128]
//!     [--scenarios enqueue,cycle,flow,flowcycle] [--mode threads|async|both]
//!     [--durability immediate|relaxed|both] [--warmup-ms 300] [--dir PATH] [--json PATH]
//! ```
//!
//! Scenarios, each on a fresh store file:
//! - `enqueue`: every caller loops on `enqueue(..).wait()`;
//! - `cycle`: every caller loops on enqueue, lease (one job), complete Ok;
//! - `flow`: every caller loops on adding one flow tree, a parent and ten
//!   children in another queue (what BullMQ's `FlowProducer.add` sends);
//! - `flowcycle`: every caller loops on adding one flow tree, leasing and
//!   completing ten children (any flow's: callers share the queues), then
//!   leasing and completing one released parent. Operations are whole loops.
//!
//! Callers are OS threads on the blocking `.wait()` API (`threads`), or tokio
//! tasks awaiting the same `Pending` futures on one current-thread runtime
//! (`async`). Each caller runs for `--seconds` after a warm-up; the table shows
//! operations (cycles) per second, p50 / p99 latency of one operation (cycle),
//! and the process's CPU time (user + system, every thread, the store's writer
//! included) per 1,000 operations.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark: a failure to set up ends it with a message, which is all an unwrap would add"
)]

// As the addon and the server do (see the workspace Cargo.toml).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use loam_jobs::{
    CompleteOptions, Config, Durability, EnqueueRequest, Fence, FlowNode, Jobs, JobsError, LeaseRequest, Outcome,
    ParentRef,
};
use serde::Serialize;

const NS: &str = "bench";
const QUEUE: &str = "q";
/// The queues of the flow scenarios: parents wait in one for their children in the other.
const PARENTS: &str = "parents";
const CHILDREN: &str = "children";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Scenario {
    Enqueue,
    Cycle,
    Flow,
    FlowCycle,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Mode {
    Threads,
    Async,
}

struct Options {
    seconds: f64,
    warmup: Duration,
    callers: Vec<usize>,
    scenarios: Vec<Scenario>,
    modes: Vec<Mode>,
    durabilities: Vec<(&'static str, Durability)>,
    dir: Option<PathBuf>,
    json: Option<PathBuf>,
}

const USAGE: &str = "usage: loam-jobs-bench [--seconds S] [--callers 1,16,128] [--scenarios enqueue,cycle,flow,flowcycle] \
                     [--mode threads|async|both] [--durability immediate|relaxed|both] [--warmup-ms MS] \
                     [--dir PATH] [--json PATH]";

const RELAXED: Durability = Durability::Relaxed { flush_interval_ms: 100 };

fn parse_options() -> Result<Options, String> {
    let mut o = Options {
        seconds: 3.0,
        warmup: Duration::from_millis(300),
        callers: vec![1, 16, 128],
        scenarios: vec![Scenario::Enqueue, Scenario::Cycle],
        modes: vec![Mode::Threads],
        durabilities: vec![("immediate", Durability::Immediate)],
        dir: None,
        json: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            return Err(USAGE.into());
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}\n{USAGE}");
        match flag.as_str() {
            "--seconds" => o.seconds = value.parse().map_err(|e| bad(&e))?,
            "--warmup-ms" => o.warmup = Duration::from_millis(value.parse().map_err(|e| bad(&e))?),
            "--callers" => {
                o.callers = value
                    .split(',')
                    .map(|c| c.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .map_err(|e| bad(&e))?;
                if o.callers.contains(&0) {
                    return Err(bad(&"callers must be at least 1"));
                }
            }
            "--scenarios" => {
                o.scenarios = value
                    .split(',')
                    .map(|s| match s.trim() {
                        "enqueue" => Ok(Scenario::Enqueue),
                        "cycle" => Ok(Scenario::Cycle),
                        "flow" => Ok(Scenario::Flow),
                        "flowcycle" => Ok(Scenario::FlowCycle),
                        other => Err(bad(&format!("unknown scenario {other}"))),
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--mode" => {
                o.modes = match value.as_str() {
                    "threads" => vec![Mode::Threads],
                    "async" => vec![Mode::Async],
                    "both" => vec![Mode::Threads, Mode::Async],
                    _ => return Err(bad(&"expected threads, async or both")),
                }
            }
            "--durability" => {
                o.durabilities = match value.as_str() {
                    "immediate" => vec![("immediate", Durability::Immediate)],
                    "relaxed" => vec![("relaxed", RELAXED)],
                    "both" => vec![("immediate", Durability::Immediate), ("relaxed", RELAXED)],
                    _ => return Err(bad(&"expected immediate, relaxed or both")),
                }
            }
            "--dir" => o.dir = Some(PathBuf::from(value)),
            "--json" => o.json = Some(PathBuf::from(value)),
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    if o.seconds <= 0.0 {
        return Err(format!("--seconds must be positive\n{USAGE}"));
    }
    Ok(o)
}

/// User + system CPU seconds of this process so far, every thread (live or
/// joined) included, from /proc/self/stat (in USER_HZ = 100 ticks).
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state); utime and stime are fields 14 and 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

/// CPU seconds of the store's writer thread so far: the one thread every
/// write passes through, so its time per operation bounds throughput, and it
/// is steadier than wall-clock rates on a shared machine.
fn writer_cpu_seconds() -> Option<f64> {
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let dir = task.ok()?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim() == "loam-jobs-write" {
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            let rest = &stat[stat.rfind(')')? + 1..];
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let utime: u64 = fields.get(11)?.parse().ok()?;
            let stime: u64 = fields.get(12)?.parse().ok()?;
            return Some((utime + stime) as f64 / 100.0);
        }
    }
    None
}

fn load_average() -> Option<String> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(text.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn job() -> EnqueueRequest {
    EnqueueRequest { name: "bench".into(), data: br#"{"n":1}"#.to_vec(), attempts: 1, ..Default::default() }
}

/// Ids unique across callers and runs of one process, as BullMQ's uuids are.
static FLOW_IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A parent in `parents` and ten children in `children`, parent first.
fn flow_tree() -> Vec<FlowNode> {
    let tree = FLOW_IDS.fetch_add(1, Ordering::Relaxed);
    let parent_id = format!("p{tree}");
    let parent = FlowNode {
        queue: PARENTS.into(),
        request: EnqueueRequest { job_id: Some(parent_id.clone()), ..job() },
        wait_children: true,
    };
    let children = (0..10).map(|i| FlowNode {
        queue: CHILDREN.into(),
        request: EnqueueRequest {
            job_id: Some(format!("c{tree}-{i}")),
            parent: Some(ParentRef { queue: PARENTS.into(), id: parent_id.clone(), prefix: "bull".into() }),
            ..job()
        },
        wait_children: false,
    });
    std::iter::once(parent).chain(children).collect()
}

/// Settles once every node of the tree is in.
fn all_added(added: Vec<Result<loam_jobs::Enqueued, JobsError>>) -> Result<(), JobsError> {
    added.into_iter().try_for_each(|r| r.map(drop))
}

fn lease_request() -> LeaseRequest {
    LeaseRequest { max: 1, lock_duration_ms: 30_000, ..Default::default() }
}

/// What one caller measured.
#[derive(Default)]
struct Tally {
    /// Latency of each operation (cycle) that started in the measured window, ns.
    latencies: Vec<u64>,
    /// Leases that came back empty and were retried (cycle only).
    empty_leases: u64,
    errors: u64,
    first_error: Option<String>,
}

impl Tally {
    /// Records an operation that started at `t0` and just ended: its latency
    /// if it ran inside the window, or its error (past 100 errors every
    /// caller stops).
    fn record(&mut self, r: Result<(), JobsError>, t0: Instant, window: Window, stop: &AtomicBool) {
        let t1 = Instant::now();
        match r {
            Ok(()) if t0 >= window.start && t1 <= window.end => self.latencies.push((t1 - t0).as_nanos() as u64),
            Ok(()) => {}
            Err(e) => {
                self.errors += 1;
                if self.first_error.is_none() {
                    self.first_error = Some(e.to_string());
                }
                if self.errors > 100 {
                    stop.store(true, Ordering::Relaxed);
                }
            }
        }
    }
}

/// The measured window, shared by every caller.
#[derive(Clone, Copy)]
struct Window {
    start: Instant,
    end: Instant,
}

fn blocking_cycle(jobs: &Jobs, tally: &mut Tally) -> Result<(), JobsError> {
    jobs.enqueue(NS, QUEUE, job()).wait()?;
    loop {
        let leased = jobs.lease(NS, QUEUE, lease_request()).wait()?;
        let Some(lease) = leased.leases.into_iter().next() else {
            tally.empty_leases += 1;
            continue;
        };
        jobs.complete(NS, QUEUE, &lease.job.id, Fence::Epoch(lease.epoch), ok_outcome(), CompleteOptions::default())
            .wait()?;
        return Ok(());
    }
}

async fn async_cycle(jobs: &Jobs, tally: &mut Tally) -> Result<(), JobsError> {
    jobs.enqueue(NS, QUEUE, job()).await?;
    loop {
        let leased = jobs.lease(NS, QUEUE, lease_request()).await?;
        let Some(lease) = leased.leases.into_iter().next() else {
            tally.empty_leases += 1;
            continue;
        };
        let fence = Fence::Epoch(lease.epoch);
        jobs.complete(NS, QUEUE, &lease.job.id, fence, ok_outcome(), CompleteOptions::default()).await?;
        return Ok(());
    }
}

/// What every bench job returns.
fn ok_outcome() -> Outcome {
    Outcome::Ok { result: Some(b"1".to_vec()) }
}

fn blocking_flow_cycle(jobs: &Jobs, tally: &mut Tally, stop: &AtomicBool) -> Result<(), JobsError> {
    jobs.flows(NS, flow_tree()).wait().and_then(all_added)?;
    for (queue, mut left) in [(CHILDREN, 10), (PARENTS, 1)] {
        while left > 0 && !stop.load(Ordering::Relaxed) {
            let leased = jobs.lease(NS, queue, LeaseRequest { max: left, ..lease_request() }).wait()?;
            if leased.leases.is_empty() {
                tally.empty_leases += 1;
            }
            for lease in leased.leases {
                let fence = Fence::Epoch(lease.epoch);
                jobs.complete(NS, queue, &lease.job.id, fence, ok_outcome(), CompleteOptions::default()).wait()?;
                left -= 1;
            }
        }
    }
    Ok(())
}

async fn async_flow_cycle(jobs: &Jobs, tally: &mut Tally, stop: &AtomicBool) -> Result<(), JobsError> {
    jobs.flows(NS, flow_tree()).await.and_then(all_added)?;
    for (queue, mut left) in [(CHILDREN, 10), (PARENTS, 1)] {
        while left > 0 && !stop.load(Ordering::Relaxed) {
            let leased = jobs.lease(NS, queue, LeaseRequest { max: left, ..lease_request() }).await?;
            if leased.leases.is_empty() {
                tally.empty_leases += 1;
                // Another caller's children hold this parent back: let it run.
                tokio::task::yield_now().await;
            }
            for lease in leased.leases {
                let fence = Fence::Epoch(lease.epoch);
                jobs.complete(NS, queue, &lease.job.id, fence, ok_outcome(), CompleteOptions::default()).await?;
                left -= 1;
            }
        }
    }
    Ok(())
}

fn caller_thread(jobs: &Jobs, scenario: Scenario, window: Window, stop: &AtomicBool) -> Tally {
    let mut tally = Tally::default();
    while !stop.load(Ordering::Relaxed) {
        let t0 = Instant::now();
        if t0 >= window.end {
            break;
        }
        let r = match scenario {
            Scenario::Enqueue => jobs.enqueue(NS, QUEUE, job()).wait().map(drop),
            Scenario::Cycle => blocking_cycle(jobs, &mut tally),
            Scenario::Flow => jobs.flows(NS, flow_tree()).wait().and_then(all_added),
            Scenario::FlowCycle => blocking_flow_cycle(jobs, &mut tally, stop),
        };
        tally.record(r, t0, window, stop);
    }
    tally
}

async fn caller_task(jobs: Jobs, scenario: Scenario, window: Window, stop: Arc<AtomicBool>) -> Tally {
    let mut tally = Tally::default();
    while !stop.load(Ordering::Relaxed) {
        let t0 = Instant::now();
        if t0 >= window.end {
            break;
        }
        let r = match scenario {
            Scenario::Enqueue => jobs.enqueue(NS, QUEUE, job()).await.map(drop),
            Scenario::Cycle => async_cycle(&jobs, &mut tally).await,
            Scenario::Flow => jobs.flows(NS, flow_tree()).await.and_then(all_added),
            Scenario::FlowCycle => async_flow_cycle(&jobs, &mut tally, &stop).await,
        };
        tally.record(r, t0, window, &stop);
    }
    tally
}

#[derive(Serialize)]
struct Row {
    durability: &'static str,
    mode: Mode,
    scenario: Scenario,
    callers: usize,
    seconds: f64,
    /// Operations (cycles for `cycle`) finished inside the measured window.
    ops: u64,
    ops_per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    cpu_seconds: Option<f64>,
    cpu_seconds_per_1k_ops: Option<f64>,
    /// CPU time of the writer thread per operation (per cycle for `cycle`).
    writer_us_per_op: Option<f64>,
    empty_leases: u64,
    errors: u64,
    first_error: Option<String>,
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1e6
}

fn run_one(
    o: &Options,
    (dname, durability): (&'static str, Durability),
    mode: Mode,
    scenario: Scenario,
    callers: usize,
) -> Row {
    let dir = match &o.dir {
        Some(d) => tempfile::tempdir_in(d),
        None => tempfile::tempdir(),
    }
    .expect("create a temp dir for the store");
    let jobs =
        Jobs::open(&dir.path().join("bench.redb"), Config { durability, ..Config::default() }).expect("open the store");
    let measure = Duration::from_secs_f64(o.seconds);
    let stop = Arc::new(AtomicBool::new(false));

    let (tallies, cpu, writer_cpu) = match mode {
        Mode::Threads => {
            // Callers start at once and warm up until the window opens.
            let start = Instant::now() + o.warmup;
            let window = Window { start, end: start + measure };
            let handles: Vec<_> = (0..callers)
                .map(|_| {
                    let (jobs, stop) = (jobs.clone(), Arc::clone(&stop));
                    std::thread::spawn(move || caller_thread(&jobs, scenario, window, &stop))
                })
                .collect();
            std::thread::sleep(start.saturating_duration_since(Instant::now()));
            let cpu0 = cpu_seconds();
            let writer0 = writer_cpu_seconds();
            let tallies: Vec<Tally> = handles.into_iter().map(|h| h.join().expect("caller thread")).collect();
            let cpu1 = cpu_seconds();
            let writer1 = writer_cpu_seconds();
            (tallies, cpu0.zip(cpu1).map(|(a, b)| b - a), writer0.zip(writer1).map(|(a, b)| b - a))
        }
        Mode::Async => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("tokio runtime");
            let start = Instant::now() + o.warmup;
            let window = Window { start, end: start + measure };
            let mut cpu0 = None;
            let mut writer0 = None;
            let tallies = rt.block_on(async {
                let tasks: Vec<_> = (0..callers)
                    .map(|_| tokio::spawn(caller_task(jobs.clone(), scenario, window, Arc::clone(&stop))))
                    .collect();
                tokio::time::sleep(start.saturating_duration_since(Instant::now())).await;
                cpu0 = cpu_seconds();
                writer0 = writer_cpu_seconds();
                let mut out = Vec::new();
                for t in tasks {
                    out.push(t.await.expect("caller task"));
                }
                out
            });
            let cpu1 = cpu_seconds();
            let writer1 = writer_cpu_seconds();
            (tallies, cpu0.zip(cpu1).map(|(a, b)| b - a), writer0.zip(writer1).map(|(a, b)| b - a))
        }
    };
    jobs.close();
    drop(jobs);

    let mut latencies: Vec<u64> = Vec::new();
    let (mut empty_leases, mut errors, mut first_error) = (0, 0, None);
    for t in tallies {
        latencies.extend(t.latencies);
        empty_leases += t.empty_leases;
        errors += t.errors;
        first_error = first_error.or(t.first_error);
    }
    latencies.sort_unstable();
    let ops = latencies.len() as u64;
    let ops_per_sec = ops as f64 / o.seconds;
    Row {
        durability: dname,
        mode,
        scenario,
        callers,
        seconds: o.seconds,
        ops,
        ops_per_sec,
        p50_ms: percentile(&latencies, 50.0),
        p99_ms: percentile(&latencies, 99.0),
        max_ms: latencies.last().map_or(f64::NAN, |&l| l as f64 / 1e6),
        cpu_seconds: cpu,
        cpu_seconds_per_1k_ops: cpu.filter(|_| ops > 0).map(|c| c / (ops as f64 / 1000.0)),
        writer_us_per_op: writer_cpu.filter(|_| ops > 0).map(|c| c * 1e6 / ops as f64),
        empty_leases,
        errors,
        first_error,
    }
}

fn print_header() {
    println!(
        "{:<10} {:<8} {:<8} {:>7} {:>10} {:>9} {:>9} {:>9} {:>12} {:>12}",
        "durability",
        "mode",
        "scenario",
        "callers",
        "ops/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "cpu s/1k ops",
        "writer us/op"
    );
}

fn print_row(r: &Row) {
    let cpu = r.cpu_seconds_per_1k_ops.map_or_else(|| "n/a".to_string(), |c| format!("{c:.3}"));
    let writer = r.writer_us_per_op.map_or_else(|| "n/a".to_string(), |c| format!("{c:.1}"));
    let mode = match r.mode {
        Mode::Threads => "threads",
        Mode::Async => "async",
    };
    let scenario = match r.scenario {
        Scenario::Enqueue => "enqueue",
        Scenario::Cycle => "cycle",
        Scenario::Flow => "flow",
        Scenario::FlowCycle => "flowcycle",
    };
    println!(
        "{:<10} {:<8} {:<8} {:>7} {:>10.0} {:>9.3} {:>9.3} {:>9.3} {:>12} {:>12}",
        r.durability, mode, scenario, r.callers, r.ops_per_sec, r.p50_ms, r.p99_ms, r.max_ms, cpu, writer
    );
    if r.errors > 0 {
        println!("    {} errors, first: {}", r.errors, r.first_error.as_deref().unwrap_or("?"));
    }
}

#[derive(Serialize)]
struct Report<'a> {
    cpus: usize,
    load_average_before: Option<String>,
    load_average_after: Option<String>,
    seconds: f64,
    warmup_ms: u64,
    dir: String,
    results: &'a [Row],
}

fn main() -> std::process::ExitCode {
    let o = match parse_options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let load_before = load_average();
    let dir = o.dir.clone().unwrap_or_else(std::env::temp_dir);
    println!(
        "loam-jobs-bench: {cpus} CPUs, load average {}, store files in {}, {} s per run after {} ms warm-up",
        load_before.as_deref().unwrap_or("?"),
        dir.display(),
        o.seconds,
        o.warmup.as_millis()
    );
    println!("ops/s and latency are per operation for `enqueue`, per enqueue+lease+complete cycle for `cycle`");
    print_header();
    let mut rows = Vec::new();
    for &durability in &o.durabilities {
        for &mode in &o.modes {
            for &scenario in &o.scenarios {
                for &callers in &o.callers {
                    let row = run_one(&o, durability, mode, scenario, callers);
                    print_row(&row);
                    rows.push(row);
                }
            }
        }
    }
    let load_after = load_average();
    println!("load average after: {}", load_after.as_deref().unwrap_or("?"));
    if let Some(path) = &o.json {
        let report = Report {
            cpus,
            load_average_before: load_before,
            load_average_after: load_after,
            seconds: o.seconds,
            warmup_ms: o.warmup.as_millis() as u64,
            dir: dir.display().to_string(),
            results: &rows,
        };
        let text = match serde_json::to_string_pretty(&report) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("encode the results: {e}");
                return std::process::ExitCode::FAILURE;
            }
        };
        if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("write {}: {e}", path.display());
            return std::process::ExitCode::FAILURE;
        }
        println!("results written to {}", path.display());
    }
    if rows.iter().any(|r| r.errors > 0) {
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}
