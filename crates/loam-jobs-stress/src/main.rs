//! `loam-jobs-stress writer`: a process that writes to a Loam Jobs store as
//! fast as it can until it is killed, and logs what the store acknowledged.
//!
//! Producers enqueue jobs with unique ids and, only once `enqueue` has returned
//! `Ok` (the commit is durable), append the id to the *acked* log. Workers lease,
//! sometimes extend, sometimes abandon (the lease stalls), and end each job with
//! Ok / Retry / Fail / Release; once `complete` returns `Ok` with a finished
//! state they append `<id> <completed|failed> <epoch>` to the *finished* log.
//! Both logs are fsynced line by line, so after a SIGKILL each line is a promise
//! the store must have kept. Unexpected errors go to the *errors* log, which the
//! crash test expects to be empty.
//!
//! `tests/crash.rs` runs this binary, kills it, and checks the store.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use loam_jobs::store::redb::{RedbOptions, RedbStore};
use loam_jobs::{
    CompleteOptions, Config, EnqueueRequest, Fence, JobError, JobState, Jobs, JobsError, LeaseRequest, Outcome,
    QueueConfig, SystemClock,
};
use loam_jobs_stress::{data_of, result_of};
use parking_lot::Mutex;
use rand::Rng;

/// The store's checkpoint interval in the writer (1 s by default).
const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(5);

/// Namespace and queue the writer uses; the crash test reads the same.
const NS: &str = "stress";
const QUEUE: &str = "crash";

struct Args {
    db: PathBuf,
    acked: PathBuf,
    finished: PathBuf,
    errors: PathBuf,
    /// Prefix of every job id, unique per writer run.
    run: String,
    producers: usize,
    workers: usize,
    lock_ms: u64,
    /// Stop after this long (0 = run until killed).
    seconds: f64,
}

const USAGE: &str = "usage: loam-jobs-stress writer --db PATH --acked PATH --finished PATH --errors PATH \
                     [--run TAG] [--producers N] [--workers M] [--lock-ms MS] [--seconds S]";

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    match it.next().as_deref() {
        Some("writer") => {}
        _ => return Err(USAGE.into()),
    }
    let (mut db, mut acked, mut finished, mut errors) = (None, None, None, None);
    let mut args = Args {
        db: PathBuf::new(),
        acked: PathBuf::new(),
        finished: PathBuf::new(),
        errors: PathBuf::new(),
        run: "r0-".into(),
        producers: 4,
        workers: 4,
        lock_ms: 2000,
        seconds: 0.0,
    };
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let num = |v: &str| v.parse::<f64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--db" => db = Some(PathBuf::from(value)),
            "--acked" => acked = Some(PathBuf::from(value)),
            "--finished" => finished = Some(PathBuf::from(value)),
            "--errors" => errors = Some(PathBuf::from(value)),
            "--run" => args.run = value,
            "--producers" => args.producers = num(&value)? as usize,
            "--workers" => args.workers = num(&value)? as usize,
            "--lock-ms" => args.lock_ms = num(&value)? as u64,
            "--seconds" => args.seconds = num(&value)?,
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    let need = |p: Option<PathBuf>, name: &str| p.ok_or_else(|| format!("{name} is required\n{USAGE}"));
    args.db = need(db, "--db")?;
    args.acked = need(acked, "--acked")?;
    args.finished = need(finished, "--finished")?;
    args.errors = need(errors, "--errors")?;
    Ok(args)
}

/// An append-only log whose every line is on disk before `append` returns.
struct SyncLog {
    file: Mutex<File>,
}

impl SyncLog {
    fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self { file: Mutex::new(file) })
    }

    /// One `write` call per line, so a kill leaves at most a torn last line.
    fn append(&self, line: &str) -> std::io::Result<()> {
        let mut file = self.file.lock();
        file.write_all(format!("{line}\n").as_bytes())?;
        file.sync_data()
    }
}

struct Shared {
    jobs: Jobs,
    acked: SyncLog,
    finished: SyncLog,
    errors: SyncLog,
    run: String,
    lock_ms: u64,
    stop: AtomicBool,
}

impl Shared {
    fn error(&self, what: &str) {
        eprintln!("loam-jobs-stress: {what}");
        let _ = self.errors.append(what);
    }
}

fn producer(shared: &Shared, thread: usize) {
    let mut rng = rand::rng();
    let mut n = 0u64;
    while !shared.stop.load(Ordering::Relaxed) {
        let id = format!("{}p{thread}-{n}", shared.run);
        n += 1;
        let roll = rng.random_range(0..100u32);
        let req = EnqueueRequest {
            name: "stress".into(),
            data: data_of(&id),
            job_id: Some(id.clone()),
            attempts: 3,
            // Some jobs take the prioritized band, some start delayed.
            priority: if roll < 15 { rng.random_range(1..=5) } else { 0 },
            delay_ms: if (15..25).contains(&roll) { rng.random_range(1..100) } else { 0 },
            ..Default::default()
        };
        match shared.jobs.enqueue(NS, QUEUE, req).wait() {
            Ok(e) if e.created && e.id == id => {
                if let Err(err) = shared.acked.append(&id) {
                    shared.error(&format!("acked log: {err}"));
                    return;
                }
            }
            Ok(e) => shared.error(&format!("enqueue {id}: unexpected result {e:?}")),
            Err(e) => shared.error(&format!("enqueue {id}: {e}")),
        }
        // Keep the backlog from running far ahead of the workers.
        if rng.random_range(0..4u32) == 0 {
            std::thread::sleep(Duration::from_millis(rng.random_range(0..3)));
        }
    }
}

/// A refusal a worker must expect: its lease was reclaimed (or the job moved
/// on) while it worked.
fn expected(err: &JobsError) -> bool {
    matches!(err, JobsError::Fenced { .. })
}

fn worker(shared: &Shared, thread: usize) {
    let mut rng = rand::rng();
    let req = LeaseRequest {
        max: 4,
        worker: Some(format!("{}w{thread}", shared.run)),
        lock_duration_ms: shared.lock_ms,
        ..Default::default()
    };
    while !shared.stop.load(Ordering::Relaxed) {
        let leased = match shared.jobs.lease_wait_blocking(NS, QUEUE, req.clone(), Duration::from_millis(200)) {
            Ok(l) => l,
            Err(e) => {
                shared.error(&format!("lease: {e}"));
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        for lease in leased.leases {
            let id = lease.job.id.clone();
            if lease.job.data != data_of(&id) {
                shared.error(&format!("job {id}: leased with {} bytes of data not its own", lease.job.data.len()));
            }
            let fence = Fence::Epoch(lease.epoch);
            let roll = rng.random_range(0..100u32);
            if roll < 3 {
                continue; // abandon: the lease stalls and the sweep reclaims it
            }
            if roll < 15 {
                match shared.jobs.extend(NS, QUEUE, &id, fence.clone(), shared.lock_ms).wait() {
                    Ok(_) => {}
                    Err(e) if expected(&e) => continue,
                    Err(e) => shared.error(&format!("extend {id}: {e}")),
                }
            }
            let outcome = match rng.random_range(0..100u32) {
                0..70 => Outcome::Ok { result: Some(result_of(&id)) },
                70..80 => Outcome::Retry { error: Some(JobError::new("stress retry")), after_ms: None },
                80..85 => Outcome::Retry {
                    error: Some(JobError::new("stress retry later")),
                    after_ms: Some(rng.random_range(1..50)),
                },
                85..95 => Outcome::Fail { error: JobError::new("stress fail"), dead_letter: false },
                _ => Outcome::Release { after_ms: None },
            };
            match shared.jobs.complete(NS, QUEUE, &id, fence, outcome, CompleteOptions::default()).wait() {
                Ok(done) => {
                    let word = match done.state {
                        Some(JobState::Completed) => Some("completed"),
                        Some(JobState::Failed) => Some("failed"),
                        _ => None,
                    };
                    if let Some(word) = word
                        && let Err(err) = shared.finished.append(&format!("{id} {word} {}", lease.epoch))
                    {
                        shared.error(&format!("finished log: {err}"));
                        return;
                    }
                }
                Err(e) if expected(&e) => {}
                Err(e) => shared.error(&format!("complete {id}: {e}")),
            }
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    // Checkpoints many times a second, so kills land while one is under way
    // (commits going on in the log's other region).
    let options = RedbOptions { checkpoint_interval: CHECKPOINT_INTERVAL, ..RedbOptions::default() };
    let store = RedbStore::open(&args.db, options).map_err(|e| format!("open {}: {e}", args.db.display()))?;
    let jobs = Jobs::with_store(Box::new(store), Arc::new(SystemClock), Config::default())
        .map_err(|e| format!("open {}: {e}", args.db.display()))?;
    // Short sweeps, so leases left by a killed writer come back quickly; a job
    // may stall twice before it fails; no event is ever trimmed, so the test
    // can count each job's terminal events over the whole history.
    let qc = QueueConfig { max_stalled: 2, stalled_interval_ms: 300, ..QueueConfig::defaults(jobs.config()) };
    jobs.set_queue_config(NS, QUEUE, qc).wait().map_err(|e| format!("queue config: {e}"))?;
    let meta = [("opts.maxLenEvents".to_string(), u64::MAX.to_string())].into_iter().collect();
    jobs.set_meta(NS, QUEUE, meta).wait().map_err(|e| format!("meta: {e}"))?;
    let log = |p: &Path| SyncLog::open(p).map_err(|e| format!("open {}: {e}", p.display()));
    let shared = Arc::new(Shared {
        jobs: jobs.clone(),
        acked: log(&args.acked)?,
        finished: log(&args.finished)?,
        errors: log(&args.errors)?,
        run: args.run.clone(),
        lock_ms: args.lock_ms,
        stop: AtomicBool::new(false),
    });
    let mut handles = Vec::new();
    for t in 0..args.producers {
        let s = Arc::clone(&shared);
        handles.push(std::thread::spawn(move || producer(&s, t)));
    }
    for t in 0..args.workers {
        let s = Arc::clone(&shared);
        handles.push(std::thread::spawn(move || worker(&s, t)));
    }
    // The test starts its kill timer on this line.
    println!("ready");
    let _ = std::io::stdout().flush();
    let started = Instant::now();
    while args.seconds <= 0.0 || started.elapsed().as_secs_f64() < args.seconds {
        std::thread::sleep(Duration::from_millis(20));
    }
    shared.stop.store(true, Ordering::Relaxed);
    for h in handles {
        let _ = h.join();
    }
    jobs.close();
    Ok(())
}

fn main() -> ExitCode {
    match parse_args().and_then(run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("loam-jobs-stress: {e}");
            ExitCode::FAILURE
        }
    }
}
