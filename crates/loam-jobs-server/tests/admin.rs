//! The admin, report and query operations over the wire: each one reaches
//! the core and comes back converted.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

mod support;

use connectrpc::ErrorCode;
use oneof::job_admin_request::Op as J;
use oneof::query_request::Query as Q;
use oneof::query_response::Result as R;
use support::*;

async fn qa(c: &Client, queue: &str, op: impl Into<oneof::queue_admin_request::Op>) -> pb::QueueAdminResponse {
    c.queue_admin(queue_admin_req(queue, op)).await.unwrap().into_owned()
}

async fn ja(c: &Client, queue: &str, id: &str, op: impl Into<J>) -> Result<bool, connectrpc::ConnectError> {
    let req = pb::JobAdminRequest { queue: queue.into(), job_id: id.into(), op: Some(op.into()), ..Default::default() };
    c.job_admin(req).await.map(|r| r.into_owned().done)
}

async fn q(c: &Client, queue: &str, query: impl Into<Q>) -> R {
    c.query(query_req(queue, query.into())).await.unwrap().into_owned().result.expect("a result")
}

async fn get_job(c: &Client, queue: &str, id: &str) -> Option<pb::Job> {
    let R::Jobs(s) = q(c, queue, pb::query_request::Jobs { ids: vec![id.into()], ..Default::default() }).await else {
        panic!("jobs")
    };
    s.slots.into_iter().next().and_then(|s| s.job.into_option())
}

async fn add(c: &Client, queue: &str, id: &str, f: impl FnOnce(&mut pb::JobSpec)) -> String {
    let mut j = job("n", b"{}");
    j.job_id = Some(id.into());
    f(&mut j);
    c.enqueue(enqueue_req(queue, j)).await.unwrap().into_owned().enqueued.into_option().unwrap().id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_and_job_admin_reports_and_queries() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let qn = "adm";

    // Delayed and prioritized jobs; promote, change delay and priority.
    add(&c, qn, "d1", |j| j.delay_ms = 60_000).await;
    add(&c, qn, "d2", |j| j.delay_ms = 60_000).await;
    add(&c, qn, "p1", |j| j.priority = 5).await;
    assert_eq!(counts(&c, qn, &["delayed", "prioritized"]).await, vec![2, 1]);
    assert!(ja(&c, qn, "d1", J::Promote(true)).await.unwrap());
    ja(&c, qn, "d2", pb::job_admin_request::ChangeDelay { delay_ms: 120_000, ..Default::default() }).await.unwrap();
    assert!(get_job(&c, qn, "d2").await.unwrap().delay == 120_000);
    ja(&c, qn, "p1", pb::job_admin_request::ChangePriority { priority: 9, ..Default::default() }).await.unwrap();
    assert_eq!(get_job(&c, qn, "p1").await.unwrap().priority, 9);
    let R::Counts(per) =
        q(&c, qn, pb::query_request::CountsPerPriority { priorities: vec![0, 9], ..Default::default() }).await
    else {
        panic!("counts")
    };
    assert_eq!(per.counts, vec![1, 1]);
    let R::Ranges(r) = q(
        &c,
        qn,
        pb::query_request::Ranges {
            types: vec!["wait".into(), "bogus".into()],
            start: 0,
            end: -1,
            asc: true,
            ..Default::default()
        },
    )
    .await
    else {
        panic!("ranges")
    };
    assert_eq!(r.ranges[0].ids, vec!["d1".to_string()]);
    assert!(r.ranges[1].ids.is_empty());

    // Pause: a lease gets nothing and says why; resume.
    qa(&c, qn, oneof::queue_admin_request::Op::Pause(true)).await;
    let leased = c.lease(lease_req(qn, 5, 0, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    assert!(leased.leases.is_empty() && leased.info.as_option().unwrap().paused);
    qa(&c, qn, oneof::queue_admin_request::Op::Resume(true)).await;

    // Report progress, logs and data under the lease; extend many; the query side sees them.
    let leased = c.lease(lease_req(qn, 1, 0, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    let l = &leased.leases[0];
    let id = l.job.as_option().unwrap().id.clone();
    let report = |r: oneof::report_request::Report| pb::ReportRequest {
        queue: qn.into(),
        job_id: id.clone(),
        fence: epoch(l.epoch).into(),
        report: Some(r),
        ..Default::default()
    };
    c.report(report(oneof::report_request::Report::Progress("{\"pct\":50}".into()))).await.unwrap();
    for row in ["one", "two", "three"] {
        let log = pb::report_request::Log { row: row.into(), ..Default::default() };
        c.report(report(oneof::report_request::Report::from(log))).await.unwrap();
    }
    c.report(report(oneof::report_request::Report::Data(b"{\"new\":1}".to_vec()))).await.unwrap();
    let j = get_job(&c, qn, &id).await.unwrap();
    assert_eq!((j.progress.as_deref(), j.data.as_slice(), j.log_count), (Some("{\"pct\":50}"), &b"{\"new\":1}"[..], 3));
    let R::Logs(logs) =
        q(&c, qn, pb::query_request::Logs { job_id: id.clone(), start: 0, end: -1, asc: true, ..Default::default() })
            .await
    else {
        panic!("logs")
    };
    assert_eq!((logs.logs, logs.count), (vec!["one".to_string(), "two".into(), "three".into()], 3));
    ja(&c, qn, &id, pb::job_admin_request::ClearLogs { keep: Some(1), ..Default::default() }).await.unwrap();
    let ext = pb::ExtendRequest {
        queue: qn.into(),
        items: vec![
            pb::ExtendItem { job_id: id.clone(), fence: epoch(l.epoch).into(), ..Default::default() },
            pb::ExtendItem { job_id: "ghost".into(), fence: epoch(1).into(), ..Default::default() },
        ],
        duration_ms: 60_000,
        ..Default::default()
    };
    assert_eq!(c.extend(ext).await.unwrap().into_owned().failed_job_ids, vec!["ghost".to_string()]);
    let R::Flag(maxed) = q(&c, qn, Q::IsMaxed(true)).await else { panic!("flag") };
    assert!(!maxed);

    // No metrics kept yet: the answer has no result, as Redis's is all nulls.
    let none = query_req(qn, pb::query_request::MetricsOf { kind: "failed".into(), ..Default::default() }.into());
    assert!(c.query(none).await.unwrap().into_owned().result.is_none());

    // Fail it, then retry the failed job; metrics count it; clean the completed one.
    let fail = pb::Outcome::from_kind(pb::outcome::Fail {
        error: pb::JobError { message: "boom".into(), ..Default::default() }.into(),
        ..Default::default()
    });
    let mut req = complete_req(qn, &id, epoch(l.epoch), fail);
    req.options = pb::CompleteOptions { metrics_max_points: Some(10), ..Default::default() }.into();
    c.complete(req).await.unwrap();
    assert_eq!(get_job(&c, qn, &id).await.unwrap().failed_reason.as_deref(), Some("boom"));
    let R::Metrics(m) = q(&c, qn, pb::query_request::MetricsOf { kind: "failed".into(), ..Default::default() }).await
    else {
        panic!("metrics")
    };
    assert_eq!(m.count, 1);
    let retry =
        pb::job_admin_request::RetryFinished { state: pb::JobState::JOB_STATE_FAILED.into(), ..Default::default() };
    ja(&c, qn, &id, retry).await.unwrap();
    assert_eq!(get_job(&c, qn, &id).await.unwrap().state.as_known(), Some(pb::JobState::JOB_STATE_WAITING));

    // Meta, rate limits, events, dedup keys, workers, config.
    let set = pb::queue_admin_request::SetMeta {
        values: [("concurrency".to_string(), "1".to_string()), ("x".to_string(), "y".to_string())]
            .into_iter()
            .collect(),
        ..Default::default()
    };
    assert_eq!(qa(&c, qn, set).await.count, 2);
    let R::Meta(meta) =
        q(&c, qn, pb::query_request::Meta { fields: vec!["x".into(), "nope".into()], ..Default::default() }).await
    else {
        panic!("meta")
    };
    assert_eq!(meta.values.get("x").map(String::as_str), Some("y"));
    assert_eq!(meta.values.len(), 1);
    assert_eq!(
        qa(
            &c,
            qn,
            pb::queue_admin_request::RemoveMetaFields {
                fields: vec!["x".into(), "concurrency".into()],
                ..Default::default()
            }
        )
        .await
        .count,
        2
    );
    qa(&c, qn, pb::queue_admin_request::SetRateLimit { ms: 5_000, ..Default::default() }).await;
    let R::TtlMs(ttl) = q(&c, qn, pb::query_request::RateLimitTtl { max_jobs: Some(1), ..Default::default() }).await
    else {
        panic!("ttl")
    };
    assert!(ttl > 0 && ttl <= 5_000, "{ttl}");
    // Without a limiter, the manual limit's window still counts (BullMQ's getRateLimitTtl).
    let R::TtlMs(ttl) = q(&c, qn, pb::query_request::RateLimitTtl::default()).await else { panic!("ttl") };
    assert!(ttl > 0 && ttl <= 5_000, "{ttl}");
    assert_eq!(qa(&c, qn, oneof::queue_admin_request::Op::RemoveRateLimitKey(true)).await.count, 1);
    let R::TtlMs(ttl) = q(&c, qn, pb::query_request::RateLimitTtl::default()).await else { panic!("ttl") };
    assert_eq!(ttl, -2, "no window: Redis' PTTL of a missing key");
    let ev = pb::queue_admin_request::PublishEvent {
        name: "custom".into(),
        fields: vec![pb::EventField { key: "k".into(), value: "v".into(), ..Default::default() }],
        max_events: 1000,
        ..Default::default()
    };
    let event_id = qa(&c, qn, ev).await.event_id;
    let R::Number(last) = q(&c, qn, Q::LastEvent(true)).await else { panic!("last") };
    assert!(event_id.ends_with(&format!("-{last}")));
    assert!(qa(&c, qn, pb::queue_admin_request::TrimEvents { max_length: 2, ..Default::default() }).await.count > 0);
    assert_eq!(all_events(&c, qn).await.len(), 2);
    add(&c, qn, "dd", |j| j.dedup = pb::Dedup { id: "dedup-1".into(), ..Default::default() }.into()).await;
    let R::DedupJob(holder) =
        q(&c, qn, pb::query_request::DedupJob { dedup_id: "dedup-1".into(), ..Default::default() }).await
    else {
        panic!("dedup")
    };
    assert_eq!(holder, "dd");
    let rm = pb::queue_admin_request::RemoveDedupKey { dedup_id: "dedup-1".into(), ..Default::default() };
    assert_eq!(qa(&c, qn, rm).await.count, 1);
    qa(&c, qn, pb::queue_admin_request::RegisterWorker { name: "host-1:42".into(), ..Default::default() }).await;
    let R::Names(w) = q(&c, qn, Q::Workers(true)).await else { panic!("workers") };
    assert_eq!(w.names, vec!["host-1:42".to_string()]);
    // With what CLIENT LIST tells of a Redis client: the connection's address, its age and idle time.
    let [seen] = w.workers.as_slice() else { panic!("one worker: {:?}", w.workers) };
    let addr: std::net::SocketAddr = seen.addr.parse().expect("the connection's address");
    assert!(addr.ip().is_loopback(), "{addr}");
    assert!(seen.age_ms < 60_000 && seen.idle_ms <= seen.age_ms, "{seen:?}");
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    qa(&c, qn, pb::queue_admin_request::RegisterWorker { name: "host-1:42".into(), ..Default::default() }).await;
    let R::Names(again) = q(&c, qn, Q::Workers(true)).await else { panic!("workers") };
    let [seen_again] = again.workers.as_slice() else { panic!("one worker: {:?}", again.workers) };
    assert!(seen_again.age_ms >= seen.age_ms + 30, "its age counts from when it was first seen: {seen_again:?}");
    assert!(seen_again.idle_ms < seen_again.age_ms, "its idle time from when it was last seen: {seen_again:?}");
    let forget = || pb::queue_admin_request::UnregisterWorker { name: "host-1:42".into(), ..Default::default() };
    assert_eq!(qa(&c, qn, forget()).await.count, 1);
    assert_eq!(qa(&c, qn, forget()).await.count, 0, "forgotten once");
    let R::Names(w) = q(&c, qn, Q::Workers(true)).await else { panic!("workers") };
    assert!(w.names.is_empty(), "{:?}", w.names);
    let cfg = pb::QueueConfig { max_stalled: 3, stalled_interval_ms: 5_000, ..Default::default() };
    qa(&c, qn, oneof::queue_admin_request::Op::from(cfg)).await;
    let R::Config(got) = q(&c, qn, Q::Config(true)).await else { panic!("config") };
    assert_eq!((got.max_stalled, got.stalled_interval_ms), (3, 5_000));
    let sweep = qa(&c, qn, pb::queue_admin_request::SweepStalled { max_stalled: Some(2), ..Default::default() }).await;
    assert!(sweep.job_ids.is_empty());
    let R::Names(queues) = q(&c, "", Q::Queues(true)).await else { panic!("queues") };
    assert_eq!(queues.names, vec![qn.to_string()]);

    // Promote all, drain, remove, clean, obliterate.
    assert!(!qa(&c, qn, pb::queue_admin_request::PromoteJobs { count: 100, ..Default::default() }).await.more);
    assert_eq!(counts(&c, qn, &["delayed"]).await, vec![0]);
    assert!(
        ja(&c, qn, "p1", pb::job_admin_request::Remove { remove_children: true, ..Default::default() }).await.unwrap()
    );
    assert!(get_job(&c, qn, "p1").await.is_none());
    let drained = qa(&c, qn, pb::queue_admin_request::Drain { delayed: true, ..Default::default() }).await;
    assert!(drained.count >= 1, "{drained:?}");
    assert_eq!(counts(&c, qn, &["wait", "prioritized", "delayed"]).await, vec![0, 0, 0]);
    add(&c, qn, "c1", |_| {}).await;
    let l = c.lease(lease_req(qn, 1, 0, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    c.complete(complete_req(qn, "c1", epoch(l.leases[0].epoch), success(b"1"))).await.unwrap();
    let far = u64::MAX / 2;
    let cleaned =
        qa(&c, qn, pb::queue_admin_request::Clean { state: "completed".into(), before: far, ..Default::default() })
            .await;
    assert_eq!(cleaned.job_ids, vec!["c1".to_string()]);
    let ob = pb::queue_admin_request::Obliterate { force: true, count: 1000, ..Default::default() };
    assert_code(
        c.queue_admin(queue_admin_req(qn, ob.clone())).await,
        ErrorCode::FailedPrecondition,
        Some("precondition.queue_not_paused"),
    );
    qa(&c, qn, oneof::queue_admin_request::Op::Pause(true)).await;
    assert!(!qa(&c, qn, ob).await.more);
    assert_eq!(counts(&c, qn, &["completed", "failed", "wait"]).await, vec![0, 0, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bullmq_job_schedulers_and_dead_letters() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let qn = "sched";
    let spec = pb::SchedulerSpec {
        id: "every-min".into(),
        name: "tick".into(),
        every_ms: Some(60_000),
        template_data: "{\"a\":1}".into(),
        ..Default::default()
    };
    let req = schedule_req(qn, spec);
    let first = c.schedule(req).await.unwrap().into_owned().job_id.unwrap();
    let R::Scheduler(s) =
        q(&c, qn, pb::query_request::SchedulerOf { id: "every-min".into(), ..Default::default() }).await
    else {
        panic!("scheduler")
    };
    let s = s.scheduler.into_option().unwrap();
    assert!(!s.server_owned);
    assert_eq!(s.next_job_id.as_deref(), Some(first.as_str()));
    let R::Number(n) = q(&c, qn, Q::SchedulerCount(true)).await else { panic!("count") };
    assert_eq!(n, 1);
    // The worker that ran iteration `first` advances the scheduler.
    let adv = pb::SchedulerAdvance { id: "every-min".into(), producer_id: first.clone(), ..Default::default() };
    let req = schedule_req(qn, adv);
    let next = c.schedule(req).await.unwrap().into_owned().job_id.unwrap();
    assert_ne!(next, first);
    let R::Schedulers(list) =
        q(&c, qn, pb::query_request::Schedulers { start: 0, end: -1, asc: true, ..Default::default() }).await
    else {
        panic!("schedulers")
    };
    assert_eq!(list.schedulers.len(), 1);
    let un = pb::UnscheduleRequest { queue: qn.into(), scheduler_id: "every-min".into(), ..Default::default() };
    assert!(c.unschedule(un).await.unwrap().into_owned().removed);

    // A dead-lettered job is redriven back to its queue.
    let cfg = pb::QueueConfig {
        max_stalled: 1,
        stalled_interval_ms: 30_000,
        dead_letter_queue: Some("dlq".into()),
        ..Default::default()
    };
    qa(&c, "work", oneof::queue_admin_request::Op::from(cfg)).await;
    add(&c, "work", "bad", |_| {}).await;
    let l = c.lease(lease_req("work", 1, 0, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    let fail = pb::Outcome::from_kind(pb::outcome::Fail {
        error: pb::JobError { message: "poison".into(), ..Default::default() }.into(),
        dead_letter: true,
        ..Default::default()
    });
    c.complete(complete_req("work", "bad", epoch(l.leases[0].epoch), fail)).await.unwrap();
    assert_eq!(counts(&c, "dlq", &["wait"]).await, vec![1]);
    let moved = qa(&c, "dlq", pb::queue_admin_request::RedriveDeadLetters { limit: 10, ..Default::default() }).await;
    assert_eq!(moved.count, 1);
    assert_eq!(counts(&c, "work", &["wait"]).await, vec![1]);
}

/// An obliterate asked for "all" takes on at most 10,000 jobs a call and
/// says there are more: one transaction over every job of a large queue held
/// every other write of the server behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_obliterate_of_all_goes_in_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let qn = "big";
    for _ in 0..3 {
        let jobs = vec![job("x", b"{}"); 4_000];
        c.enqueue_bulk(pb::EnqueueBulkRequest { queue: qn.into(), jobs, ..Default::default() }).await.unwrap();
    }
    qa(&c, qn, oneof::queue_admin_request::Op::Pause(true)).await;
    let all = pb::queue_admin_request::Obliterate { force: true, count: u64::MAX, ..Default::default() };
    assert!(qa(&c, qn, all.clone()).await.more, "10,000 of 12,000 in the first call");
    assert_eq!(counts(&c, qn, &["wait"]).await, vec![2_000]);
    assert!(!qa(&c, qn, all).await.more);
    assert_eq!(counts(&c, qn, &["wait"]).await, vec![0]);
}
