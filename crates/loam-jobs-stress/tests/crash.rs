//! Crash test: a real writer process (`loam-jobs-stress writer`) is killed with
//! SIGKILL while it enqueues, leases and completes; the store is reopened and
//! checked after every kill, and finally drained to the end.
//!
//! What a kill must never break:
//! - every job whose `enqueue` returned (the *acked* log) exists;
//! - every completion or failure that was acknowledged (the *finished* log)
//!   is still there, with the same outcome and lease epoch;
//! - each job is listed in exactly one state index, the one its record names,
//!   and the per-state counters equal both the records and the index entries;
//! - each finished job has exactly one terminal event (`completed` or
//!   `failed`) in the queue's event log, which the writer never trims, so no
//!   job finished twice, and no unfinished job has one.
//!
//! The run ends with a core on a clock far in the future: the stalled sweep
//! reclaims every lease the dead writers left, then every job is leased and
//! completed; each acked job must reach exactly one final outcome.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use loam_jobs::keys::QueueKeys;
use loam_jobs::model::{Event, decode};
use loam_jobs::ops::query::state_range;
use loam_jobs::store::redb::{RedbOptions, RedbStore};
use loam_jobs::tx::Tx;
use loam_jobs::*;
use loam_jobs_stress::{data_of, result_of};
use rand::Rng;

const NS: &str = "stress";
const QUEUE: &str = "crash";
/// Kill rounds; `LOAM_CRASH_ROUNDS` overrides (a longer soak).
const ROUNDS: usize = 8;
/// The writer's lease length: short, so leases of a killed writer expire
/// during the next rounds and its stalled sweep hands them out again.
const LOCK_MS: u64 = 1000;

struct Files {
    db: PathBuf,
    acked: PathBuf,
    finished: PathBuf,
    errors: PathBuf,
}

impl Files {
    fn new(dir: &Path) -> Self {
        Self {
            db: dir.join("jobs.redb"),
            acked: dir.join("acked.log"),
            finished: dir.join("finished.log"),
            errors: dir.join("errors.log"),
        }
    }
}

/// Whole lines of a log; a line torn by the kill (no newline yet) is ignored,
/// since it was never a promise: the writer appends it after the ack.
fn lines(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut lines: Vec<String> = text.split('\n').map(str::to_string).collect();
    lines.pop(); // the part after the last newline: empty, or a torn line
    lines
}

struct Logs {
    acked: Vec<String>,
    /// id -> (outcome, lease epoch)
    finished: HashMap<String, (JobState, u64)>,
}

fn read_logs(files: &Files) -> Logs {
    let errors = lines(&files.errors);
    assert!(errors.is_empty(), "the writer reported unexpected errors:\n{}", errors.join("\n"));
    let acked = lines(&files.acked);
    let unique: HashSet<&String> = acked.iter().collect();
    assert_eq!(unique.len(), acked.len(), "an id was acked twice");
    let mut finished = HashMap::new();
    for line in lines(&files.finished) {
        let parts: Vec<&str> = line.split(' ').collect();
        assert_eq!(parts.len(), 3, "bad finished line {line:?}");
        let state = JobState::parse(parts[1]).expect("outcome");
        let epoch: u64 = parts[2].parse().expect("epoch");
        let prev = finished.insert(parts[0].to_string(), (state, epoch));
        assert!(prev.is_none(), "two acknowledged final outcomes for {}: {prev:?} and {line:?}", parts[0]);
    }
    Logs { acked, finished }
}

/// Everything the checks look at, read from one snapshot.
struct Snapshot {
    jobs: HashMap<String, JobRecord>,
    /// Per state (in `JobState::ALL` order): the index entries (key, id).
    index: Vec<Vec<(Vec<u8>, String)>>,
    stats: QueueStats,
    events: Vec<Event>,
    /// `Jobs::counts` for `JobState::ALL`.
    counts: Vec<u64>,
}

fn snapshot(jobs: &Jobs) -> Snapshot {
    let mut snap = jobs
        .query(NS, QUEUE, |tx, q| {
            let keys = QueueKeys::new(q);
            let mut records = HashMap::new();
            for (_, v) in tx.scan(&keys.jobs(), usize::MAX, false)? {
                // Read again as the core reads a job, its data with it.
                let id = decode::<JobRecord>(&v)?.id;
                let job = tx.require_job(q, &id)?;
                records.insert(id, job);
            }
            let mut index = Vec::new();
            for state in JobState::ALL {
                let entries = tx.scan(&state_range(&keys, state), usize::MAX, false)?;
                index.push(entries.into_iter().map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned())).collect());
            }
            // Page by page: a read stops at about `MAX_EVENT_BYTES_PER_READ`,
            // and a long soak's log outgrew one (its last events went unread,
            // and their jobs looked finished without a terminal event).
            let mut events: Vec<Event> = Vec::new();
            loop {
                let after = events.last().map_or(0, |e| e.seq);
                let page = loam_jobs::ops::query::events_after(tx, q, after, usize::MAX)?;
                if page.is_empty() {
                    break;
                }
                events.extend(page);
            }
            Ok(Snapshot { jobs: records, index, stats: tx.stats(q)?.clone(), events, counts: Vec::new() })
        })
        .expect("read the queue");
    snap.counts = jobs.counts(NS, QUEUE, &JobState::ALL).expect("counts");
    snap
}

/// Checks every invariant of the module doc; returns the snapshot for more.
fn check(jobs: &Jobs, logs: &Logs, when: &str) -> Snapshot {
    let snap = snapshot(jobs);
    let keys = QueueKeys::new(&QueueId::new(NS, QUEUE));

    // Indexes: each entry names an existing job in that state, at the key its
    // record implies; each job is listed exactly once.
    let mut listed: HashMap<&str, usize> = HashMap::new();
    for (state, entries) in JobState::ALL.iter().zip(&snap.index) {
        for (key, id) in entries {
            let job = snap.jobs.get(id).unwrap_or_else(|| panic!("{when}: {state} index lists missing job {id}"));
            assert_eq!(job.state, *state, "{when}: job {id} is {} but listed as {state}", job.state);
            assert_eq!(&Tx::index_key(&keys, job), key, "{when}: job {id} listed at a stale key");
            *listed.entry(id.as_str()).or_default() += 1;
        }
    }
    for (id, job) in &snap.jobs {
        let n = listed.get(id.as_str()).copied().unwrap_or(0);
        assert_eq!(n, 1, "{when}: job {id} ({}) is listed in {n} indexes", job.state);
        assert_eq!(job.data, data_of(id), "{when}: job {id} data");
        match job.state {
            JobState::Active => assert!(job.lock.is_some(), "{when}: active job {id} has no lock"),
            JobState::Completed | JobState::Failed => {
                assert!(job.lock.is_none() && job.finished_on.is_some(), "{when}: finished job {id} {job:?}");
            }
            _ => assert!(job.lock.is_none(), "{when}: {} job {id} holds a lock", job.state),
        }
        if job.state == JobState::Completed {
            assert_eq!(job.return_value, Some(result_of(id)), "{when}: job {id} return value");
        }
    }

    // Counters = records = index entries, state by state.
    for (i, state) in JobState::ALL.iter().enumerate() {
        let records = snap.jobs.values().filter(|j| j.state == *state).count() as u64;
        let entries = snap.index[i].len() as u64;
        assert_eq!(snap.counts[i], records, "{when}: counts({state}) vs records");
        assert_eq!(snap.stats.count(*state), entries, "{when}: stats({state}) vs index");
    }

    // Acknowledged enqueues and outcomes survive.
    for id in &logs.acked {
        assert!(snap.jobs.contains_key(id), "{when}: acked job {id} is lost");
    }
    for (id, (state, epoch)) in &logs.finished {
        let job = snap.jobs.get(id).unwrap_or_else(|| panic!("{when}: finished job {id} is lost"));
        assert_eq!(job.state, *state, "{when}: job {id} was acknowledged {state}, is {}", job.state);
        assert_eq!(job.epoch, *epoch, "{when}: job {id} epoch moved after it finished");
    }

    // Exactly one terminal event per finished job, none for the others.
    assert!(snap.stats.first_event <= 1, "{when}: the event log was trimmed (first {})", snap.stats.first_event);
    let mut terminal: HashMap<&str, Vec<&str>> = HashMap::new();
    for e in &snap.events {
        if e.name == "completed" || e.name == "failed" {
            let field = |name: &str| e.fields.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
            let id = field("jobId").expect("jobId");
            terminal.entry(id).or_default().push(e.name.as_str());
            // A large one comes back whole from its own key.
            if e.name == "completed" {
                let expected = String::from_utf8(result_of(id)).unwrap();
                assert_eq!(field("returnvalue"), Some(expected.as_str()), "{when}: completed event of {id}");
            }
        }
    }
    for (id, job) in &snap.jobs {
        let got = terminal.remove(id.as_str()).unwrap_or_default();
        if job.state.is_finished() {
            assert_eq!(got, [job.state.as_str()], "{when}: terminal events of {} job {id}", job.state);
        } else {
            assert!(got.is_empty(), "{when}: {} job {id} has terminal events {got:?}", job.state);
        }
    }
    assert!(terminal.is_empty(), "{when}: terminal events of unknown jobs: {terminal:?}");
    snap
}

fn summary(snap: &Snapshot) -> String {
    JobState::ALL
        .iter()
        .zip(&snap.counts)
        .filter(|(_, n)| **n > 0)
        .map(|(s, n)| format!("{s}={n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Starts a writer, waits for it to be writing, lets it run, kills it.
fn run_and_kill(files: &Files, round: usize, run_ms: u64) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_loam-jobs-stress"))
        .arg("writer")
        .args(["--db".as_ref(), files.db.as_os_str()])
        .args(["--acked".as_ref(), files.acked.as_os_str()])
        .args(["--finished".as_ref(), files.finished.as_os_str()])
        .args(["--errors".as_ref(), files.errors.as_os_str()])
        .args(["--run", &format!("r{round}-"), "--producers", "4", "--workers", "3"])
        .args(["--lock-ms", &LOCK_MS.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the writer");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("read the writer");
    if line.trim() != "ready" {
        let status = child.wait().expect("wait");
        panic!("round {round}: the writer did not start ({status}), said {line:?}");
    }
    std::thread::sleep(Duration::from_millis(run_ms));
    // `Child::kill` is SIGKILL on unix: no destructor, no flush, no close.
    child.kill().expect("kill the writer");
    let status = child.wait().expect("reap the writer");
    assert!(status.code().is_none(), "round {round}: the writer exited by itself ({status}) before the kill");
}

#[test]
fn acknowledged_writes_survive_sigkill() {
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let files = Files::new(dir.path());
    let mut rng = rand::rng();
    let mut reclaimed_between = 0;

    let rounds = std::env::var("LOAM_CRASH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(ROUNDS);
    for round in 0..rounds {
        let run_ms = rng.random_range(200..=800);
        run_and_kill(&files, round, run_ms);
        let logs = read_logs(&files);

        // Reopen in this process: the file must open (redb repairs it), hold
        // every promise, and accept writes again.
        let jobs =
            Jobs::open(&files.db, Config { background: false, ..Config::default() }).expect("reopen after SIGKILL");
        let snap = check(&jobs, &logs, &format!("round {round} after kill"));
        let reclaimed = jobs.sweep_stalled(NS, QUEUE).wait().expect("sweep after reopen");
        reclaimed_between += reclaimed.len();
        check(&jobs, &logs, &format!("round {round} after sweep"));
        eprintln!(
            "round {round}: ran {run_ms} ms; acked {} finished {}; {} ; swept {}",
            logs.acked.len(),
            logs.finished.len(),
            summary(&snap),
            reclaimed.len()
        );
        jobs.close();
    }

    // The end: time jumps far ahead, every lease left behind expires, and
    // everything still open is leased and completed.
    let logs = read_logs(&files);
    assert!(
        logs.acked.len() > 100,
        "the writers made too little progress to test anything ({} acked)",
        logs.acked.len()
    );
    assert!(!logs.finished.is_empty(), "no acknowledged outcome to test");
    let far_future = SystemClock.now_ms() + 30 * 24 * 3600 * 1000;
    let store = RedbStore::open(&files.db, RedbOptions::default()).expect("open the store");
    let jobs = Jobs::with_store(
        Box::new(store),
        Arc::new(ManualClock::new(far_future)),
        Config { background: false, ..Config::default() },
    )
    .expect("open the core");
    check(&jobs, &logs, "final open");
    let mut swept = 0;
    loop {
        let reclaimed = jobs.sweep_stalled(NS, QUEUE).wait().expect("final sweep");
        if reclaimed.is_empty() {
            break;
        }
        swept += reclaimed.len();
    }
    let before_drain = check(&jobs, &logs, "after the final sweep");
    assert_eq!(before_drain.counts[3], 0, "active jobs left after the final sweep");

    let mut drained: HashSet<String> = HashSet::new();
    let mut last_fence = None;
    loop {
        let req =
            LeaseRequest { max: 256, worker: Some("drain".into()), lock_duration_ms: 600_000, ..Default::default() };
        let leased = jobs.lease(NS, QUEUE, req).wait().expect("drain lease");
        if leased.leases.is_empty() {
            let open = jobs
                .counts(NS, QUEUE, &[JobState::Waiting, JobState::Prioritized, JobState::Delayed, JobState::Active])
                .unwrap();
            assert_eq!(open, [0, 0, 0, 0], "jobs left that cannot be leased: {:?}", leased.info);
            break;
        }
        // Submit the batch's completions together so they share commits.
        let pending: Vec<_> = leased
            .leases
            .iter()
            .map(|l| {
                let outcome = Outcome::Ok { result: Some(result_of(&l.job.id)) };
                (
                    l.job.id.clone(),
                    l.epoch,
                    jobs.complete(NS, QUEUE, &l.job.id, Fence::Epoch(l.epoch), outcome, CompleteOptions::default()),
                )
            })
            .collect();
        for (id, epoch, p) in pending {
            let done = p.wait().unwrap_or_else(|e| panic!("drain complete {id}: {e}"));
            assert_eq!(done.state, Some(JobState::Completed), "drain complete {id}");
            assert!(!logs.finished.contains_key(&id), "job {id} was leased again after its acknowledged outcome");
            assert!(drained.insert(id.clone()), "job {id} was handed out twice in the drain");
            last_fence = Some((id, epoch));
        }
    }
    // Completing twice with the same lease is refused.
    if let Some((id, epoch)) = last_fence {
        let again = jobs
            .complete(NS, QUEUE, &id, Fence::Epoch(epoch), Outcome::Ok { result: None }, CompleteOptions::default())
            .wait();
        assert!(
            matches!(again, Err(JobsError::Fenced { .. })),
            "a second completion of {id} was not fenced: {again:?}"
        );
    }

    let end = check(&jobs, &logs, "after the drain");
    for id in &logs.acked {
        assert!(end.jobs[id].state.is_finished(), "acked job {id} did not finish");
    }
    assert!(end.jobs.values().all(|j| j.state.is_finished()), "unfinished jobs after the drain");
    let completed = end.counts[5];
    let failed = end.counts[6];
    assert_eq!(completed + failed, end.jobs.len() as u64);
    jobs.close();
    eprintln!(
        "done in {:.1} s: {} jobs ({} acked, {} acknowledged outcomes); swept {reclaimed_between} between rounds, {swept} at the end; \
         drained {}; completed {completed}, failed {failed}",
        started.elapsed().as_secs_f64(),
        end.jobs.len(),
        logs.acked.len(),
        logs.finished.len(),
        drained.len(),
    );
}
