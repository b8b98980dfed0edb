//! A server killed with SIGKILL under load and restarted on the same data
//! directory loses no job whose Enqueue returned, and every job ends with
//! exactly one outcome.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::*;

const QUEUE: &str = "load";
/// Short leases, so jobs that were active at the crash come back quickly.
const LOCK_MS: u64 = 800;

async fn setup(c: &Client) {
    let cfg = pb::QueueConfig { max_stalled: 1000, stalled_interval_ms: 300, ..Default::default() };
    let admin = |op: oneof::queue_admin_request::Op| queue_admin_req(QUEUE, op);
    c.queue_admin(admin(oneof::queue_admin_request::Op::from(cfg))).await.unwrap();
    // Keep every event, so the test can count each job's outcomes.
    let meta = pb::queue_admin_request::SetMeta {
        values: [("opts.maxLenEvents".to_string(), "1000000".to_string())].into_iter().collect(),
        ..Default::default()
    };
    c.queue_admin(admin(oneof::queue_admin_request::Op::from(meta))).await.unwrap();
}

/// Leases and completes until `stop`; records the ids whose Complete returned.
async fn work(c: Client, stop: Arc<AtomicBool>, completed: Arc<Mutex<Vec<String>>>) {
    while !stop.load(Ordering::SeqCst) {
        let Ok(r) = c.lease(lease_req(QUEUE, 8, 200, LOCK_MS)).await else { return };
        let leased = r.into_owned().leased.into_option().unwrap_or_default();
        for l in leased.leases {
            let id = l.job.as_option().map(|j| j.id.clone()).unwrap_or_default();
            match c.complete(complete_req(QUEUE, &id, epoch(l.epoch), success(b"1"))).await {
                Ok(_) => completed.lock().unwrap().push(id),
                Err(e) if e.code == connectrpc::ErrorCode::FailedPrecondition => {}
                Err(_) => return,
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_under_load_loses_no_acknowledged_job() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start_in(dir.path(), &[], &[]);
    setup(&server.client()).await;

    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let completed = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for p in 0..3 {
        let (c, acked, stop) = (server.client(), Arc::clone(&acked), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let mut j = job("work", b"{}");
                let id = format!("p{p}-{n}");
                j.job_id = Some(id.clone());
                match c.enqueue(enqueue_req(QUEUE, j)).await {
                    Ok(_) => acked.lock().unwrap().push(id),
                    Err(_) => return,
                }
                n += 1;
            }
        }));
    }
    for _ in 0..3 {
        tasks.push(tokio::spawn(work(server.client(), Arc::clone(&stop), Arc::clone(&completed))));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.kill();
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    let acked: Vec<String> = acked.lock().unwrap().clone();
    let before_crash = completed.lock().unwrap().len();
    assert!(acked.len() > 50, "the load was real: {} enqueues acknowledged", acked.len());

    // Restart on the same directory and drain the queue.
    server.restart();
    let c = server.client();
    let stop = Arc::new(AtomicBool::new(false));
    let drainers: Vec<_> =
        (0..2).map(|_| tokio::spawn(work(server.client(), Arc::clone(&stop), Arc::clone(&completed)))).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let n = counts(&c, QUEUE, &["wait", "active", "delayed", "failed"]).await;
        if n.iter().all(|&x| x == 0) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for d in drainers {
        let _ = tokio::time::timeout(Duration::from_secs(5), d).await;
    }

    // Every acknowledged job exists and is completed.
    let q = oneof::query_request::Query::from(pb::query_request::Jobs { ids: acked.clone(), ..Default::default() });
    let Some(oneof::query_response::Result::Jobs(slots)) =
        c.query(query_req(QUEUE, q)).await.unwrap().into_owned().result
    else {
        panic!("jobs")
    };
    for (id, slot) in acked.iter().zip(&slots.slots) {
        let j = slot.job.as_option().unwrap_or_else(|| panic!("acknowledged job {id} was lost"));
        assert_eq!(j.state.as_known(), Some(pb::JobState::JOB_STATE_COMPLETED), "job {id}");
    }
    // Exactly one outcome each: one `completed` event, no `failed`.
    let mut outcomes: HashMap<String, (u32, u32)> = HashMap::new();
    for e in all_events(&c, QUEUE).await {
        let Some(id) = field(&e, "jobId") else { continue };
        let slot = outcomes.entry(id.to_string()).or_default();
        match e.name.as_str() {
            "completed" => slot.0 += 1,
            "failed" => slot.1 += 1,
            _ => {}
        }
    }
    let acked_set: HashSet<&String> = acked.iter().collect();
    for id in &acked {
        assert_eq!(outcomes.get(id), Some(&(1, 0)), "job {id} must end with exactly one outcome");
    }
    // A Complete that returned before the crash was not undone.
    let done = completed.lock().unwrap().clone();
    let unique: HashSet<&String> = done.iter().collect();
    assert_eq!(unique.len(), done.len(), "no job completed twice");
    assert!(before_crash > 0);
    eprintln!(
        "acknowledged enqueues {}, completions acknowledged before the crash {before_crash}, after {}",
        acked.len(),
        done.len() - before_crash
    );
    // Jobs created but not acknowledged (the crash cut their reply) may
    // exist too; they also end with one outcome.
    for (id, o) in &outcomes {
        if !acked_set.contains(id) {
            assert_eq!(o.0 + o.1, 1, "unacknowledged job {id}");
        }
    }
}
