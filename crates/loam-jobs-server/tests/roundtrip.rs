//! The basic life of jobs through a real `loam-jobs serve`: enqueue, lease,
//! complete, watch, the result store, schedules, metrics, and many producers
//! and workers at once.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

mod support;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_lease_complete_watch_and_results() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();

    // Watch from the start of the log, before anything happens.
    let mut watch =
        c.watch(pb::WatchRequest { queue: "emails".into(), after: Some(0), ..Default::default() }).await.unwrap();

    let mut ids = Vec::new();
    for i in 0..3 {
        let r = c.enqueue(enqueue_req("emails", job("send", format!("{{\"n\":{i}}}").as_bytes()))).await.unwrap();
        let e = r.into_owned().enqueued.into_option().unwrap();
        assert!(e.created);
        ids.push(e.id);
    }
    // The same job id twice returns the first job.
    let mut keyed = job("send", b"{}");
    keyed.job_id = Some("k1".into());
    let first =
        c.enqueue(enqueue_req("emails", keyed.clone())).await.unwrap().into_owned().enqueued.into_option().unwrap();
    let again = c.enqueue(enqueue_req("emails", keyed)).await.unwrap().into_owned().enqueued.into_option().unwrap();
    assert!(first.created && !again.created && first.id == again.id);
    ids.push(first.id);

    let leased = c.lease(lease_req("emails", 10, 1000, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    assert_eq!(leased.leases.len(), 4);
    for (l, id) in leased.leases.iter().zip(&ids) {
        let j = l.job.as_option().unwrap();
        assert_eq!(&j.id, id, "FIFO order");
        let done = c
            .complete(complete_req("emails", &j.id, epoch(l.epoch), success(b"\"ok\"")))
            .await
            .unwrap()
            .into_owned()
            .completed
            .into_option()
            .unwrap();
        assert_eq!(done.state.as_known(), Some(pb::JobState::JOB_STATE_COMPLETED));
        // A second completion under the same lease is refused: one outcome per job.
        let e = assert_code(
            c.complete(complete_req("emails", &j.id, epoch(l.epoch), success(b"\"again\""))).await,
            connectrpc::ErrorCode::FailedPrecondition,
            Some("fenced.no_lease"),
        );
        assert_eq!(detail(&e).bullmq_code, -2);
    }
    assert_eq!(counts(&c, "emails", &["completed", "wait", "active"]).await, vec![4, 0, 0]);

    // The watch saw every added and completed event, in order.
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.iter().filter(|(n, _): &&(String, String)| n == "completed").count() < 4 && Instant::now() < deadline {
        let e = next_event(&mut watch).await.unwrap().expect("the stream stays open");
        seen.push((e.name.clone(), field(&e, "jobId").unwrap_or("").to_string()));
    }
    let completed: Vec<&str> = seen.iter().filter(|(n, _)| n == "completed").map(|(_, id)| id.as_str()).collect();
    assert_eq!(completed, ids.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(seen.iter().any(|(n, _)| n == "added"));

    // The result store: values, counters counted once per member, expiry.
    c.result_set(pb::ResultSetRequest {
        key: "r1".into(),
        value: b"v".to_vec(),
        ttl_ms: Some(60_000),
        ..Default::default()
    })
    .await
    .unwrap();
    let got = c.result_get(pb::ResultGetRequest { key: "r1".into(), ..Default::default() }).await.unwrap().into_owned();
    assert_eq!(got.value.as_deref(), Some(&b"v"[..]));
    let incr = |m: &str| pb::ResultIncrRequest { key: "chord".into(), member: m.into(), ..Default::default() };
    assert_eq!(c.result_incr(incr("t1")).await.unwrap().into_owned().count, 1);
    let twice = c.result_incr(incr("t1")).await.unwrap().into_owned();
    assert_eq!((twice.count, twice.added), (1, false));
    assert_eq!(c.result_incr(incr("t2")).await.unwrap().into_owned().count, 2);
    let many = c
        .result_m_get(pb::ResultMGetRequest {
            keys: vec!["r1".into(), "chord".into(), "nope".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_owned();
    let values: Vec<Option<Vec<u8>>> = many.values.into_iter().map(|v| v.value).collect();
    assert_eq!(values, vec![Some(b"v".to_vec()), Some(b"2".to_vec()), None]);
    let expire = pb::ResultExpireRequest { key: "r1".into(), ttl_ms: 1, ..Default::default() };
    assert!(c.result_expire(expire).await.unwrap().into_owned().found);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let gone =
        c.result_get(pb::ResultGetRequest { key: "r1".into(), ..Default::default() }).await.unwrap().into_owned();
    assert_eq!(gone.value, None);
    let del = pb::ResultDeleteRequest { key: "chord".into(), ..Default::default() };
    assert!(c.result_delete(del).await.unwrap().into_owned().deleted);

    // /metrics and /healthz on the same port.
    let text = server.metrics();
    assert!(text.contains("loam_jobs_enqueued_total{ns=\"default\",queue=\"emails\"} 4"), "{text}");
    assert!(text.contains("loam_jobs_completed_total{ns=\"default\",queue=\"emails\",outcome=\"ok\"} 4"), "{text}");
    assert!(
        text.contains(
            "loam_jobs_rpc_requests_total{ns=\"default\",method=\"Complete\",code=\"failed_precondition\"} 4"
        ),
        "{text}"
    );
    assert!(text.contains("loam_jobs_active{ns=\"default\",queue=\"emails\"} 0"), "{text}");
    assert!(server.healthy());
}

/// A bulk add's key for the whole call travels: sent again, the call adds
/// nothing and answers the jobs it made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_add_sent_again_under_its_key_adds_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    for all_or_nothing in [false, true] {
        let request = pb::EnqueueBulkRequest {
            queue: "bulk".into(),
            jobs: vec![job("a", b"{}"); 3],
            all_or_nothing,
            idempotency: pb::Idempotency { key: format!("call-{all_or_nothing}"), ..Default::default() }.into(),
            ..Default::default()
        };
        let answered = |r: pb::EnqueueBulkResponse| -> Vec<(String, bool)> {
            r.results
                .into_iter()
                .map(|r| match r.result {
                    Some(oneof::enqueue_result::Result::Enqueued(e)) => (e.id.clone(), e.created),
                    other => panic!("a job refused: {other:?}"),
                })
                .collect()
        };
        let first = c.enqueue_bulk(request.clone()).await.unwrap().into_owned();
        assert!(first.key_kept, "a client keys each job too until the server says it keeps the call's key");
        let first = answered(first);
        let again = answered(c.enqueue_bulk(request).await.unwrap().into_owned());
        assert!(first.iter().all(|(_, created)| *created));
        assert_eq!(again, first.iter().map(|(id, _)| (id.clone(), false)).collect::<Vec<_>>());
    }
    assert_eq!(counts(&c, "bulk", &["wait"]).await, vec![6]);
    let unkeyed = pb::EnqueueBulkRequest { queue: "bulk".into(), jobs: vec![job("a", b"{}")], ..Default::default() };
    assert!(!c.enqueue_bulk(unkeyed).await.unwrap().into_owned().key_kept);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_producers_and_workers_share_a_queue() {
    const PRODUCERS: usize = 4;
    const PER_PRODUCER: usize = 150;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let done = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut tasks = Vec::new();
    for p in 0..PRODUCERS {
        let c = server.client();
        tasks.push(tokio::spawn(async move {
            for n in 0..PER_PRODUCER {
                let mut j = job("work", b"{}");
                j.job_id = Some(format!("p{p}-{n}"));
                c.enqueue(enqueue_req("shared", j)).await.unwrap();
            }
        }));
    }
    let mut workers = Vec::new();
    for _ in 0..4 {
        let c = server.client();
        let done = Arc::clone(&done);
        workers.push(tokio::spawn(async move {
            let mut next: Option<pb::Leased> = None;
            loop {
                let leased = match next.take() {
                    Some(l) if !l.leases.is_empty() => l,
                    _ => c
                        .lease(lease_req("shared", 1, 1500, 0))
                        .await
                        .unwrap()
                        .into_owned()
                        .leased
                        .into_option()
                        .unwrap(),
                };
                let Some(l) = leased.leases.first() else { return };
                let id = l.job.as_option().unwrap().id.clone();
                // Complete and take the next job in the same call (BullMQ's fetchNext).
                let mut req = complete_req("shared", &id, epoch(l.epoch), success(b"1"));
                req.options = pb::CompleteOptions {
                    fetch_next: pb::LeaseOptions { max: 1, ..Default::default() }.into(),
                    ..Default::default()
                }
                .into();
                let out = c.complete(req).await.unwrap().into_owned().completed.into_option().unwrap();
                done.lock().unwrap().push(id);
                next = out.next.into_option();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for w in workers {
        w.await.unwrap();
    }
    let done = done.lock().unwrap().clone();
    let unique: HashSet<&String> = done.iter().collect();
    assert_eq!(done.len(), PRODUCERS * PER_PRODUCER, "each job is processed once");
    assert_eq!(unique.len(), done.len());
    assert_eq!(counts(&server.client(), "shared", &["completed", "wait", "active"]).await, vec![600, 0, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_schedule_enqueues_each_tick_once_across_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let every = 200u64;
    let limit = 10u64;
    let spec = pb::ServerSchedule {
        id: "beat".into(),
        name: "tick".into(),
        every_ms: Some(every),
        limit: Some(limit),
        job: job("tick", b"{}").into(),
        ..Default::default()
    };
    let first = c.schedule(schedule_req("cron", spec)).await.unwrap().into_owned();
    assert!(first.job_id.as_deref().is_some_and(|id| id.starts_with("repeat:beat:")));
    // Bad cron expressions and time zones are refused.
    for (cron, tz) in [("61 * * * *", None), ("0 9 * * *", Some("Mars/Olympus"))] {
        let bad = pb::ServerSchedule {
            id: "bad".into(),
            cron: Some(cron.into()),
            tz: tz.map(String::from),
            ..Default::default()
        };
        let r = c.schedule(schedule_req("cron", bad)).await;
        assert_code(r, connectrpc::ErrorCode::InvalidArgument, Some("invalid_argument"));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    server.kill();
    // Down for several ticks (for less than the server's MISSED_AFTER); the
    // restart catches up on each of them.
    tokio::time::sleep(Duration::from_millis(900)).await;
    server.restart();
    let c = server.client();
    let deadline = Instant::now() + Duration::from_secs(10);
    let ids = loop {
        let q = oneof::query_request::Query::from(pb::query_request::Ranges {
            types: vec!["wait".into(), "delayed".into()],
            start: 0,
            end: -1,
            asc: true,
            ..Default::default()
        });
        let r = c.query(query_req("cron", q)).await.unwrap().into_owned();
        let Some(oneof::query_response::Result::Ranges(r)) = r.result else { panic!("ranges") };
        let ids: Vec<String> = r.ranges.into_iter().flat_map(|l| l.ids).collect();
        if ids.len() as u64 >= limit || Instant::now() > deadline {
            break ids;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut ticks: Vec<u64> = ids.iter().map(|id| id.rsplit(':').next().unwrap().parse().unwrap()).collect();
    ticks.sort();
    assert_eq!(ticks.len() as u64, limit, "one job per tick, up to the limit: {ids:?}");
    for w in ticks.windows(2) {
        assert_eq!(w[1] - w[0], every, "no tick skipped or repeated: {ticks:?}");
    }
    // The limit holds: no eleventh tick.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(counts(&c, "cron", &["wait", "delayed"]).await.iter().sum::<u64>(), limit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_grpc_web_and_connect_share_one_port_and_watch_resumes() {
    use connectrpc::Protocol;
    use connectrpc::client::{ClientConfig, HttpClient};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let url: http::Uri = server.url().parse().unwrap();
    let grpc = pb::JobsServiceClient::new(
        HttpClient::plaintext_http2_only(),
        ClientConfig::new(url.clone()).with_protocol(Protocol::Grpc),
    );
    let grpc_web = pb::JobsServiceClient::new(
        HttpClient::plaintext(),
        ClientConfig::new(url.clone()).with_protocol(Protocol::GrpcWeb),
    );
    let connect_json = pb::JobsServiceClient::new(HttpClient::plaintext(), ClientConfig::new(url).json());
    grpc.enqueue(enqueue_req("multi", job("a", b"{}"))).await.unwrap();
    grpc_web.enqueue(enqueue_req("multi", job("b", b"{}"))).await.unwrap();
    connect_json.enqueue(enqueue_req("multi", job("c", b"{}"))).await.unwrap();
    // Errors carry their detail on every protocol.
    for c in [&grpc, &grpc_web, &connect_json] {
        let e = assert_code(
            c.complete(complete_req("multi", "ghost", epoch(1), success(b"1"))).await,
            connectrpc::ErrorCode::NotFound,
            Some("not_found.job"),
        );
        assert_eq!(detail(&e).bullmq_code, -1);
    }
    assert_eq!(counts(&server.client(), "multi", &["wait"]).await, vec![3]);

    // Watch over gRPC, then resume from the last cursor seen: nothing is missed or repeated.
    let mut first =
        grpc.watch(pb::WatchRequest { queue: "multi".into(), after: Some(0), ..Default::default() }).await.unwrap();
    let mut seqs = Vec::new();
    while seqs.len() < 3 {
        seqs.push(next_event(&mut first).await.unwrap().unwrap().seq);
    }
    drop(first);
    let cursor = *seqs.last().unwrap();
    let mut resumed = grpc_web
        .watch(pb::WatchRequest { queue: "multi".into(), after: Some(cursor), ..Default::default() })
        .await
        .unwrap();
    let all: Vec<u64> = all_events(&server.client(), "multi").await.iter().map(|e| e.seq).collect();
    while seqs.len() < all.len() {
        seqs.push(next_event(&mut resumed).await.unwrap().unwrap().seq);
    }
    assert_eq!(seqs, all);
    // A new event reaches the open stream.
    server.client().enqueue(enqueue_req("multi", job("d", b"{}"))).await.unwrap();
    let e = tokio::time::timeout(Duration::from_secs(5), next_event(&mut resumed)).await.unwrap().unwrap().unwrap();
    assert!(e.seq > cursor);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_parent_waits_for_children_in_another_queue() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let mut parent = job("parent", b"{}");
    parent.job_id = Some("p1".into());
    let child = |id: &str| {
        let mut j = job("child", b"{}");
        j.job_id = Some(id.into());
        j.parent = pb::ParentRef { queue: "parents".into(), id: "p1".into(), ..Default::default() }.into();
        pb::FlowNode { queue: "kids".into(), job: j.into(), ..Default::default() }
    };
    let nodes = vec![
        pb::FlowNode { queue: "parents".into(), job: parent.into(), wait_children: true, ..Default::default() },
        child("c1"),
        child("c2"),
    ];
    let out = c.flow(pb::FlowRequest { nodes, ..Default::default() }).await.unwrap().into_owned().enqueued;
    assert_eq!(out[0].state.as_known(), Some(pb::JobState::JOB_STATE_WAITING_CHILDREN));
    let leased = c.lease(lease_req("kids", 2, 1000, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    assert_eq!(leased.leases.len(), 2);
    let first = &leased.leases[0];
    c.complete(complete_req("kids", &first.job.as_option().unwrap().id, epoch(first.epoch), success(b"42")))
        .await
        .unwrap();
    let deps = |with_jobs| {
        query_req(
            "parents",
            oneof::query_request::Query::from(pb::query_request::Dependencies {
                job_id: "p1".into(),
                with_jobs,
                ..Default::default()
            }),
        )
    };
    let Some(oneof::query_response::Result::Dependencies(list)) =
        c.query(deps(true)).await.unwrap().into_owned().result
    else {
        panic!("dependencies")
    };
    assert_eq!(list.dependencies.len(), 2);
    assert_eq!(list.jobs.len(), 2);
    let processed: Vec<_> = list
        .dependencies
        .iter()
        .filter(|d| d.status.as_known() == Some(pb::DependencyStatus::DEPENDENCY_STATUS_PROCESSED))
        .collect();
    assert_eq!(processed.len(), 1);
    assert_eq!(processed[0].value.as_deref(), Some("42"));
    assert!(list.jobs.iter().all(|s| s.job.as_option().is_some_and(|j| j.name == "child")));
    assert_eq!(list.total, 2);
    // A page of the pending children: the second child alone, with its job, of one pending.
    let page = query_req(
        "parents",
        oneof::query_request::Query::from(pb::query_request::Dependencies {
            job_id: "p1".into(),
            with_jobs: true,
            status: pb::DependencyStatus::DEPENDENCY_STATUS_PENDING.into(),
            start: Some(0),
            end: Some(0),
            ..Default::default()
        }),
    );
    let Some(oneof::query_response::Result::Dependencies(pending)) = c.query(page).await.unwrap().into_owned().result
    else {
        panic!("dependencies")
    };
    let second = &leased.leases[1];
    let second_id = &second.job.as_option().unwrap().id;
    assert_eq!(pending.dependencies.iter().map(|d| &d.child_id).collect::<Vec<_>>(), [second_id]);
    assert_eq!(pending.jobs.iter().map(|s| &s.job.as_option().unwrap().id).collect::<Vec<_>>(), [second_id]);
    assert_eq!(pending.total, 1);
    c.complete(complete_req("kids", &second.job.as_option().unwrap().id, epoch(second.epoch), success(b"1")))
        .await
        .unwrap();
    // Both children done: the parent runs.
    let parent = c.lease(lease_req("parents", 1, 2000, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    assert_eq!(parent.leases[0].job.as_option().unwrap().id, "p1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_background_clock_can_follow_the_clients_time() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--follow-client-clock"], &[]);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let c = server.client_with(&[("loam-now-ms", &now.to_string())]);
    let mut delayed = job("later", b"{}");
    delayed.delay_ms = 3_600_000;
    c.enqueue(enqueue_req("faked", delayed)).await.unwrap();
    assert_eq!(counts(&c, "faked", &["delayed", "wait"]).await, vec![1, 0]);
    // A worker that sends no time long-polls on the server's clock.
    let poll = tokio::spawn({
        let worker = server.client();
        async move { worker.lease(lease_req("faked", 1, 10_000, 0)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A client that says it is two hours later moves that clock: the job is
    // due now, the background timers wake the poll, and its lease takes it.
    let started = Instant::now();
    let later = server.client_with(&[("loam-now-ms", &(now + 7_200_000).to_string())]);
    assert_eq!(counts(&later, "faked", &["delayed"]).await, vec![1], "reading it does not move it");
    let leased = poll.await.unwrap().unwrap().into_owned().leased.into_option().unwrap();
    assert_eq!(leased.leases.len(), 1, "the poll ended empty instead of taking the job due on the followed clock");
    assert!(started.elapsed() < Duration::from_secs(5), "woken after {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_cursor_behind_the_trimmed_log_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    for _ in 0..5 {
        c.enqueue(enqueue_req("short", job("x", b"{}"))).await.unwrap();
    }
    let trim = pb::queue_admin_request::TrimEvents { max_length: 2, ..Default::default() };
    c.queue_admin(queue_admin_req("short", trim)).await.unwrap();
    let mut stale =
        c.watch(pb::WatchRequest { queue: "short".into(), after: Some(1), ..Default::default() }).await.unwrap();
    let e = stale.message::<pb::WatchResponse>().await.unwrap_err();
    assert_eq!((e.code, detail(&e).reason.as_str()), (connectrpc::ErrorCode::OutOfRange, "events_trimmed"));
    // From 0: whatever the log still holds.
    let mut from_start =
        c.watch(pb::WatchRequest { queue: "short".into(), after: Some(0), ..Default::default() }).await.unwrap();
    let first = next_event(&mut from_start).await.unwrap().unwrap();
    assert_eq!(first.seq, all_events(&c, "short").await[0].seq);
    // Past the newest event: a cursor no event carries (u64::MAX must not wrap
    // round to "trimmed").
    let newest = all_events(&c, "short").await.last().unwrap().seq;
    for after in [newest + 1, u64::MAX] {
        let mut ahead = c
            .watch(pb::WatchRequest { queue: "short".into(), after: Some(after), ..Default::default() })
            .await
            .unwrap();
        let e = ahead.message::<pb::WatchResponse>().await.unwrap_err();
        assert_eq!(
            (e.code, detail(&e).reason.as_str()),
            (connectrpc::ErrorCode::OutOfRange, "cursor_ahead"),
            "{after}"
        );
    }
    assert!(server.healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_of_one_job_moves_its_cursor_past_other_jobs_events() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let mine = c.enqueue(enqueue_req("busy", job("mine", b"{}"))).await.unwrap().into_owned();
    let mine = mine.enqueued.into_option().unwrap().id;
    let start = all_events(&c, "busy").await.last().unwrap().seq;
    let watch_mine = |after| pb::WatchRequest {
        queue: "busy".into(),
        after: Some(after),
        job_id: Some(mine.clone()),
        ..Default::default()
    };
    let mut watch = c.watch(watch_mine(start)).await.unwrap();
    for _ in 0..20 {
        c.enqueue(enqueue_req("busy", job("other", b"{}"))).await.unwrap();
    }
    let last = all_events(&c, "busy").await.last().unwrap().seq;
    // The server reads the others' events and says how far it got, in heartbeats.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut cursor = start;
    while cursor < last {
        let m = tokio::time::timeout(
            deadline.saturating_duration_since(Instant::now()),
            watch.message::<pb::WatchResponse>(),
        )
        .await
        .unwrap_or_else(|_| panic!("no heartbeat reached sequence {last}"))
        .unwrap()
        .unwrap()
        .to_owned_message();
        assert!(m.event.is_unset(), "an event of another job reached a watch of job {mine}");
        assert!(m.cursor >= cursor);
        cursor = m.cursor;
    }
    drop(watch);
    // With the log trimmed past where the last event of `mine` was, a watch
    // resuming from the heartbeat's cursor is not refused as having lost events;
    // an idle one still hears from the server.
    let trim = pb::queue_admin_request::TrimEvents { max_length: 5, ..Default::default() };
    c.queue_admin(queue_admin_req("busy", trim)).await.unwrap();
    let mut resumed = c.watch(watch_mine(cursor)).await.unwrap();
    let heartbeat = tokio::time::timeout(Duration::from_secs(8), resumed.message::<pb::WatchResponse>())
        .await
        .expect("an idle watch gets a heartbeat")
        .unwrap()
        .unwrap()
        .to_owned_message();
    assert!(heartbeat.event.is_unset());
    assert_eq!(heartbeat.cursor, cursor);
    assert!(server.healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_schedules_follow_cron_in_a_time_zone_and_their_end_date() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    // Every second, by a six-field cron in Paris time; three ticks.
    let cron = pb::ServerSchedule {
        id: "secs".into(),
        name: "s".into(),
        cron: Some("* * * * * *".into()),
        tz: Some("Europe/Paris".into()),
        limit: Some(3),
        ..Default::default()
    };
    c.schedule(schedule_req("tz", cron)).await.unwrap();
    // Every 100 ms from a start date until an end date 350 ms later: ticks at +0, +100, +200, +300.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64 + 500;
    let until = pb::ServerSchedule {
        id: "until".into(),
        name: "u".into(),
        every_ms: Some(100),
        start_date: Some(now),
        end_date: Some(now + 350),
        ..Default::default()
    };
    c.schedule(schedule_req("tz", until)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3600)).await;
    let q = oneof::query_request::Query::from(pb::query_request::Ranges {
        types: vec!["wait".into(), "delayed".into()],
        start: 0,
        end: -1,
        asc: true,
        ..Default::default()
    });
    let Some(oneof::query_response::Result::Ranges(r)) = c.query(query_req("tz", q)).await.unwrap().into_owned().result
    else {
        panic!("ranges")
    };
    let ids: Vec<String> = r.ranges.into_iter().flat_map(|l| l.ids).collect();
    let ticks = |prefix: &str| {
        let mut t: Vec<u64> = ids.iter().filter_map(|id| id.strip_prefix(prefix)).map(|t| t.parse().unwrap()).collect();
        t.sort();
        t
    };
    let secs = ticks("repeat:secs:");
    assert_eq!(secs.len(), 3, "{ids:?}");
    assert!(secs.iter().all(|t| t % 1000 == 0) && secs.windows(2).all(|w| w[1] - w[0] == 1000), "{secs:?}");
    let until_ticks = ticks("repeat:until:");
    assert_eq!(until_ticks, vec![now, now + 100, now + 200, now + 300]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immediately_runs_the_first_tick_now() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let yearly = |id: &str, immediately: bool| {
        let s = pb::ServerSchedule {
            id: id.into(),
            name: "y".into(),
            cron: Some("0 0 1 1 *".into()),
            immediately,
            ..Default::default()
        };
        schedule_req("yearly", s)
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let tick = |r: pb::ScheduleResponse| -> (u64, u64) {
        (r.job_id.unwrap().rsplit(':').next().unwrap().parse().unwrap(), r.delay_ms)
    };
    let (t, delay) = tick(c.schedule(yearly("now", true)).await.unwrap().into_owned());
    assert!(t.abs_diff(now) < 5_000 && delay == 0, "{t} {now}");
    let (t, delay) = tick(c.schedule(yearly("later", false)).await.unwrap().into_owned());
    assert!(t > now && t - now <= 366 * 86_400_000 && delay > 0);
    assert_eq!(t % 86_400_000, 0, "midnight UTC");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_http2_connection_carries_hundreds_of_long_polls() {
    use connectrpc::client::{ClientConfig, HttpClient};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let client = Arc::new(pb::JobsServiceClient::new(
        HttpClient::plaintext_http2_only(),
        ClientConfig::new(server.url().parse().unwrap()).with_protocol(connectrpc::Protocol::Grpc),
    ));
    // 500 workers long-poll an empty queue for three seconds, all at once:
    // past hyper's default of 200 streams they would queue in three waves,
    // nine seconds; together they take three, plus what setting up 500 calls
    // takes a debug build on a loaded machine.
    let started = Instant::now();
    let polls: Vec<_> = (0..500)
        .map(|_| {
            let c = Arc::clone(&client);
            tokio::spawn(async move { c.lease(lease_req("idle", 1, 3000, 0)).await })
        })
        .collect();
    for p in polls {
        assert!(p.await.unwrap().unwrap().into_owned().leased.into_option().unwrap().leases.is_empty());
    }
    assert!(started.elapsed() < Duration::from_millis(6000), "took {:?}", started.elapsed());
}

/// Scrapes at once each see every queue's depth gauges (a scrape clears and
/// fills them again), and leasing from names that hold no job makes no
/// series (the exposition would grow with every name a caller tried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_hold_every_gauge_under_concurrent_scrapes_and_no_series_for_names_only_tried() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    const QUEUES: usize = 100;
    for i in 0..QUEUES {
        c.enqueue(enqueue_req(&format!("q{i}"), job("x", b"{}"))).await.unwrap();
    }
    for i in 0..200 {
        c.lease(lease_req(&format!("ghost-{i}"), 1, 0, 0)).await.unwrap();
    }
    let port = server.port;
    let scrapers: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                (0..10)
                    .map(|_| {
                        use std::io::{Read, Write};
                        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
                        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
                        let mut text = String::new();
                        s.read_to_string(&mut text).unwrap();
                        (text.matches("loam_jobs_delayed{").count(), text.contains("ghost-"))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for scraper in scrapers {
        for (gauges, ghosts) in scraper.join().unwrap() {
            assert_eq!(gauges, QUEUES, "a scrape lost depth gauges to another");
            assert!(!ghosts, "series for queues that never held a job");
        }
    }
}

/// `/metrics` has each task's run times (lease to outcome) and the depth of
/// each dead-letter queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_give_run_times_by_task_and_dead_letter_depth() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let config = pb::QueueConfig {
        max_stalled: 1,
        stalled_interval_ms: 30_000,
        dead_letter_queue: Some("dead".into()),
        dead_letter_on_exhausted: true,
        ..Default::default()
    };
    c.queue_admin(queue_admin_req("work", config)).await.unwrap();
    for _ in 0..2 {
        c.enqueue(enqueue_req("work", job("resize", b"{}"))).await.unwrap();
    }
    let leased = c.lease(lease_req("work", 2, 0, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    let ids: Vec<(String, u64)> =
        leased.leases.iter().map(|l| (l.job.as_option().unwrap().id.clone(), l.epoch)).collect();
    c.complete(complete_req("work", &ids[0].0, epoch(ids[0].1), success(b"1"))).await.unwrap();
    let fail = pb::Outcome::from_kind(pb::outcome::Fail {
        error: pb::JobError { message: "boom".into(), ..Default::default() }.into(),
        ..Default::default()
    });
    c.complete(complete_req("work", &ids[1].0, epoch(ids[1].1), fail)).await.unwrap();
    let text = server.metrics();
    assert!(text.contains(r#"loam_jobs_run_seconds_count{ns="default",queue="work",task="resize"} 2"#), "{text}");
    assert!(text.contains(r#"loam_jobs_dlq_depth{ns="default",queue="dead"} 1"#), "{text}");
}

/// `loam_jobs_stalled_total` counts reclaims by the core's own sweep too
/// (it is read from the store), not only workers' stalled checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_the_background_sweeps_reclaims() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let config = pb::QueueConfig { max_stalled: 5, stalled_interval_ms: 100, ..Default::default() };
    c.queue_admin(queue_admin_req("work", config)).await.unwrap();
    c.enqueue(enqueue_req("work", job("resize", b"{}"))).await.unwrap();
    let leased = c.lease(lease_req("work", 1, 0, 100)).await.unwrap().into_owned().leased.into_option().unwrap();
    assert_eq!(leased.leases.len(), 1);
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let text = server.metrics();
        if text.contains(r#"loam_jobs_stalled_total{ns="default",queue="work"} 1"#) {
            break;
        }
        assert!(Instant::now() < until, "no reclaim counted: {text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A watch reads ahead of its client by a few megabytes, not 256 events: over
/// a backlog of large and small events, read from the oldest, it brings
/// every one once and in order, whatever the sizes do from one to the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_over_a_backlog_of_mixed_sizes_brings_every_event_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let mut published = Vec::new();
    for i in 0..36u32 {
        // Runs of small events, then of 600 KB ones: the read-ahead (4 MB)
        // shrinks and grows.
        let size = if (i / 6) % 2 == 1 { 600 << 10 } else { 100 };
        let ev = pb::queue_admin_request::PublishEvent {
            name: format!("e{i}"),
            fields: vec![pb::EventField { key: "pad".into(), value: "x".repeat(size), ..Default::default() }],
            max_events: 10_000,
            ..Default::default()
        };
        let answer = c.queue_admin(queue_admin_req("big", ev)).await.unwrap().into_owned();
        published.push(answer.event_id);
    }
    let mut watch =
        c.watch(pb::WatchRequest { queue: "big".into(), after: Some(0), ..Default::default() }).await.unwrap();
    let mut names = Vec::new();
    while names.len() < published.len() {
        let event = tokio::time::timeout(Duration::from_secs(20), next_event(&mut watch)).await.unwrap().unwrap();
        names.push(event.expect("the watch ended").name);
    }
    let expected: Vec<String> = (0..36).map(|i| format!("e{i}")).collect();
    assert_eq!(names, expected);
}
