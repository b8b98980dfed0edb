//! Bad input on every RPC gets a typed error, and the server stays up and
//! keeps its jobs; tokens keep namespaces apart; SIGTERM shuts down cleanly.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

mod support;

use std::time::{Duration, Instant};

use connectrpc::ErrorCode;
use support::*;

const METHODS: [&str; 20] = [
    "Enqueue",
    "EnqueueBulk",
    "Lease",
    "Extend",
    "Complete",
    "Report",
    "Schedule",
    "Unschedule",
    "Flow",
    "QueueAdmin",
    "JobAdmin",
    "Query",
    "ResultGet",
    "ResultMGet",
    "ResultSet",
    "ResultDelete",
    "ResultIncr",
    "ResultExpire",
    "Watch",
    "Session",
];

fn job_admin(queue: &str, id: &str, op: impl Into<oneof::job_admin_request::Op>) -> pb::JobAdminRequest {
    pb::JobAdminRequest { queue: queue.into(), job_id: id.into(), op: Some(op.into()), ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_refuses_bad_input_with_a_typed_error() {
    use ErrorCode::*;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--max-payload-bytes", "1024", "--max-request-bytes", "65536"], &[]);
    let c = server.client();
    let inv = Some("invalid_argument");

    // A job that must survive everything below.
    let keep =
        c.enqueue(enqueue_req("q", job("keep", b"{}"))).await.unwrap().into_owned().enqueued.into_option().unwrap();

    // Enqueue: invalid names, no job, oversized payload, oversized request, bad priority.
    assert_code(c.enqueue(enqueue_req("", job("x", b"{}"))).await, InvalidArgument, inv);
    assert_code(c.enqueue(pb::EnqueueRequest { queue: "q".into(), ..Default::default() }).await, InvalidArgument, inv);
    let mut long_id = job("x", b"{}");
    long_id.job_id = Some("i".repeat(2000));
    assert_code(c.enqueue(enqueue_req("q", long_id)).await, InvalidArgument, inv);
    assert_code(
        c.enqueue(enqueue_req("q", job("x", &[b'a'; 2000]))).await,
        ResourceExhausted,
        Some("payload_too_large"),
    );
    let huge = c.enqueue(enqueue_req("q", job("x", &vec![b'a'; 100_000]))).await;
    assert_eq!(huge.unwrap_err().code, ResourceExhausted);
    let mut prio = job("x", b"{}");
    prio.priority = 1 << 22;
    assert_code(c.enqueue(enqueue_req("q", prio)).await, InvalidArgument, inv);
    let mut numbered = job("x", b"{}");
    numbered.job_id = Some("42".into());
    assert_code(c.enqueue(enqueue_req("q", numbered)).await, InvalidArgument, inv);
    // Options that are not a JSON object: BullMQ could read no such job back.
    for opts in ["null", "5", "[1]", "\"s\"", " true", "not json"] {
        let odd = pb::JobSpec { opts: opts.into(), ..job("x", b"{}") };
        assert_code(c.enqueue(enqueue_req("q", odd)).await, InvalidArgument, inv);
    }
    let kept = pb::JobSpec { opts: r#"{"attempts":2}"#.into(), ..job("x", b"{}") };
    c.enqueue(enqueue_req("opts", kept)).await.unwrap();

    // EnqueueBulk: each job has its own result.
    // One that does not convert (a backoff with no kind) is refused alone too.
    let no_kind = pb::JobSpec { backoff: pb::Backoff { delay_ms: 10, ..Default::default() }.into(), ..job("c", b"{}") };
    let bulk = pb::EnqueueBulkRequest {
        queue: "q".into(),
        jobs: vec![job("a", b"{}"), job("b", &[0; 4096]), no_kind.clone(), job("d", b"{}")],
        ..Default::default()
    };
    let results = c.enqueue_bulk(bulk).await.unwrap().into_owned().results;
    assert_eq!(results.len(), 4);
    for at in [0, 3] {
        assert!(matches!(results[at].result, Some(oneof::enqueue_result::Result::Enqueued(_))), "{at}");
    }
    let Some(oneof::enqueue_result::Result::Error(e)) = &results[1].result else { panic!("bulk error") };
    assert_eq!(
        (e.code.as_str(), e.detail.as_option().unwrap().reason.as_str()),
        ("resource_exhausted", "payload_too_large")
    );
    let Some(oneof::enqueue_result::Result::Error(e)) = &results[2].result else { panic!("bulk error") };
    assert_eq!(e.code, "invalid_argument");
    // All or nothing: the first job refused fails the call, and none is added.
    for (refused, code) in [(job("b", &[0; 4096]), ResourceExhausted), (no_kind.clone(), InvalidArgument)] {
        let all = pb::EnqueueBulkRequest {
            queue: "aon".into(),
            jobs: vec![job("a", b"{}"), refused, job("d", b"{}")],
            all_or_nothing: true,
            ..Default::default()
        };
        assert_eq!(c.enqueue_bulk(all).await.unwrap_err().code, code);
    }
    let none = c.lease(lease_req("aon", 1, 0, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    assert!(none.leases.is_empty(), "nothing of a refused all-or-nothing bulk was added");
    assert_code(
        c.enqueue_bulk(pb::EnqueueBulkRequest { queue: "\u{0}".repeat(0), ..Default::default() }).await,
        InvalidArgument,
        inv,
    );

    // Lease: invalid queue; asking for nothing; a worker name or lock token
    // over 1,024 bytes (each is kept with every job the lease takes, and the
    // name in the queue's list of workers). A worker's name on a refused
    // queue is not listed anywhere.
    assert_code(c.lease(lease_req("", 1, 0, 0)).await, InvalidArgument, inv);
    assert_code(c.lease(lease_req("q", 0, 1000, 0)).await, InvalidArgument, inv);
    let with_options = |queue: &str, options: pb::LeaseOptions| pb::LeaseRequest {
        options: pb::LeaseOptions { max: 1, ..options }.into(),
        ..lease_req(queue, 1, 0, 0)
    };
    for queue in ["q", ""] {
        let long_name = pb::LeaseOptions { worker: Some("w".repeat(1025)), ..Default::default() };
        assert_code(c.lease(with_options(queue, long_name)).await, InvalidArgument, inv);
    }
    let long_token = pb::LeaseOptions { token: "t".repeat(1025), ..Default::default() };
    assert_code(c.lease(with_options("q", long_token)).await, InvalidArgument, inv);
    let named = pb::LeaseOptions { worker: Some("w".into()), ..Default::default() };
    assert_code(c.lease(with_options("", named)).await, InvalidArgument, inv);
    let workers = pb::QueryRequest {
        queue: "q".into(),
        query: Some(oneof::query_request::Query::Workers(true)),
        ..Default::default()
    };
    let Some(oneof::query_response::Result::Names(listed)) = c.query(workers).await.unwrap().into_owned().result else {
        panic!("workers")
    };
    assert!(listed.names.is_empty(), "{:?}", listed.names);

    // Extend, Complete, Report: stale lease tokens and epochs, missing fences and outcomes.
    let leased = c.lease(lease_req("q", 1, 0, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    let l = &leased.leases[0];
    let id = l.job.as_option().unwrap().id.clone();
    assert_eq!(id, keep.id);
    let stale_token = pb::Fence { kind: Some(oneof::fence::Kind::Token("stale".into())), ..Default::default() };
    let extend = |fence: Option<pb::Fence>| pb::ExtendRequest {
        queue: "q".into(),
        items: vec![pb::ExtendItem { job_id: id.clone(), fence: fence.into(), ..Default::default() }],
        duration_ms: 1000,
        ..Default::default()
    };
    let e = assert_code(c.extend(extend(Some(stale_token.clone()))).await, FailedPrecondition, Some("fenced.mismatch"));
    assert_eq!(detail(&e).bullmq_code, -6);
    assert_code(c.extend(extend(None)).await, InvalidArgument, inv);
    assert_code(c.extend(pb::ExtendRequest { queue: "q".into(), ..Default::default() }).await, InvalidArgument, inv);
    assert_code(
        c.complete(complete_req("q", &id, epoch(l.epoch + 1), success(b"1"))).await,
        FailedPrecondition,
        Some("fenced.mismatch"),
    );
    let e = assert_code(
        c.complete(complete_req("q", "no-such-job", epoch(1), success(b"1"))).await,
        NotFound,
        Some("not_found.job"),
    );
    assert_eq!(detail(&e).bullmq_code, -1);
    let no_outcome = pb::CompleteRequest {
        queue: "q".into(),
        job_id: id.clone(),
        fence: epoch(l.epoch).into(),
        ..Default::default()
    };
    assert_code(c.complete(no_outcome).await, InvalidArgument, inv);
    // An unchecked fence of false is no fence: it once let any caller's completion through.
    let not_unchecked = pb::Fence { kind: Some(oneof::fence::Kind::Unchecked(false)), ..Default::default() };
    assert_code(c.complete(complete_req("q", &id, not_unchecked.clone(), success(b"1"))).await, InvalidArgument, inv);
    assert_code(c.extend(extend(Some(not_unchecked))).await, InvalidArgument, inv);
    let report = |fence: Option<pb::Fence>| pb::ReportRequest {
        queue: "q".into(),
        job_id: id.clone(),
        fence: fence.into(),
        report: Some(oneof::report_request::Report::Progress("50".into())),
        ..Default::default()
    };
    assert_code(c.report(report(Some(stale_token))).await, FailedPrecondition, Some("fenced.mismatch"));
    assert_code(c.report(report(None)).await, InvalidArgument, inv);

    // Schedule: bad cron, bad time zone, cron and every together, nothing at all.
    let bad_cron = pb::ServerSchedule { id: "s".into(), cron: Some("* * *".into()), ..Default::default() };
    assert_code(c.schedule(schedule_req("q", bad_cron.clone())).await, InvalidArgument, inv);
    // `immediately` runs the first tick now, but the pattern must still parse.
    let at_once = pb::ServerSchedule { immediately: true, ..bad_cron };
    assert_code(c.schedule(schedule_req("q", at_once)).await, InvalidArgument, inv);
    let bad_tz = pb::ServerSchedule {
        id: "s".into(),
        cron: Some("0 * * * *".into()),
        tz: Some("Nowhere/Else".into()),
        ..Default::default()
    };
    assert_code(c.schedule(schedule_req("q", bad_tz)).await, InvalidArgument, inv);
    let two =
        pb::ServerSchedule { id: "s".into(), cron: Some("0 * * * *".into()), every_ms: Some(5), ..Default::default() };
    assert_code(c.schedule(schedule_req("q", two)).await, InvalidArgument, inv);
    let no_id = pb::ServerSchedule { every_ms: Some(1000), ..Default::default() };
    assert_code(c.schedule(schedule_req("q", no_id)).await, InvalidArgument, inv);
    assert_code(
        c.schedule(pb::ScheduleRequest { queue: "q".into(), ..Default::default() }).await,
        InvalidArgument,
        inv,
    );
    // Unschedule: an unknown id removes nothing; an invalid queue is refused.
    let un = |q: &str| pb::UnscheduleRequest { queue: q.into(), scheduler_id: "nope".into(), ..Default::default() };
    assert!(!c.unschedule(un("q")).await.unwrap().into_owned().removed);
    assert_code(c.unschedule(un("")).await, InvalidArgument, inv);

    // Flow: a node without a job; a child of a missing parent.
    let node =
        |queue: &str, j: Option<pb::JobSpec>| pb::FlowNode { queue: queue.into(), job: j.into(), ..Default::default() };
    assert_code(
        c.flow(pb::FlowRequest { nodes: vec![node("q", None)], ..Default::default() }).await,
        InvalidArgument,
        inv,
    );
    let mut orphan = job("child", b"{}");
    orphan.parent = pb::ParentRef { queue: "q".into(), id: "ghost".into(), ..Default::default() }.into();
    let e = assert_code(
        c.flow(pb::FlowRequest { nodes: vec![node("q", Some(orphan))], ..Default::default() }).await,
        NotFound,
        Some("not_found.parent_job"),
    );
    assert_eq!(detail(&e).bullmq_code, -5);

    // QueueAdmin: no operation; obliterating a queue that is not paused; a bad clean state.
    assert_code(
        c.queue_admin(pb::QueueAdminRequest { queue: "q".into(), ..Default::default() }).await,
        InvalidArgument,
        inv,
    );
    // A dead-letter queue no call could name would hide what is sent there.
    for dlq in [String::new(), "d".repeat(5000)] {
        let config = pb::QueueConfig {
            max_stalled: 1,
            stalled_interval_ms: 30_000,
            dead_letter_queue: Some(dlq),
            dead_letter_on_exhausted: true,
            ..Default::default()
        };
        assert_code(c.queue_admin(queue_admin_req("q", config)).await, InvalidArgument, inv);
    }
    let ob = pb::queue_admin_request::Obliterate { force: false, count: 100, ..Default::default() };
    assert_code(
        c.queue_admin(queue_admin_req("q", ob)).await,
        FailedPrecondition,
        Some("precondition.queue_not_paused"),
    );
    let retry = pb::queue_admin_request::RetryJobs {
        state: pb::JobState::JOB_STATE_ACTIVE.into(),
        count: 1,
        ..Default::default()
    };
    assert_code(c.queue_admin(queue_admin_req("q", retry)).await, InvalidArgument, inv);
    let unknown = pb::queue_admin_request::RetryJobs { count: 1, ..Default::default() };
    let e = assert_code(c.queue_admin(queue_admin_req("q", unknown)).await, InvalidArgument, inv);
    assert_eq!(e.message.as_deref(), Some("invalid argument: a job state is required, got 0"));
    // `pause: false` is neither a pause nor a resume.
    for op in [oneof::queue_admin_request::Op::Pause(false), oneof::queue_admin_request::Op::Resume(false)] {
        let r = c.queue_admin(pb::QueueAdminRequest { queue: "q".into(), op: Some(op), ..Default::default() }).await;
        assert_code(r, InvalidArgument, inv);
    }

    // JobAdmin: unknown job; a job in the wrong state; no operation.
    assert_code(
        c.job_admin(job_admin("q", "ghost", oneof::job_admin_request::Op::Promote(true))).await,
        NotFound,
        Some("not_found.job"),
    );
    let e = assert_code(
        c.job_admin(job_admin("q", &id, oneof::job_admin_request::Op::Promote(true))).await,
        FailedPrecondition,
        Some("precondition.not_in_state"),
    );
    assert_eq!(detail(&e).bullmq_code, -3);
    let retry =
        pb::job_admin_request::RetryFinished { state: pb::JobState::JOB_STATE_WAITING.into(), ..Default::default() };
    assert_code(c.job_admin(job_admin("q", &id, retry)).await, InvalidArgument, inv);
    assert_code(
        c.job_admin(pb::JobAdminRequest { queue: "q".into(), job_id: id.clone(), ..Default::default() }).await,
        InvalidArgument,
        inv,
    );

    // Query: no query; a bad metrics kind; an unknown dependency status; an invalid queue.
    assert_code(c.query(pb::QueryRequest { queue: "q".into(), ..Default::default() }).await, InvalidArgument, inv);
    let m = pb::query_request::MetricsOf { kind: "sideways".into(), ..Default::default() };
    assert_code(c.query(query_req("q", oneof::query_request::Query::from(m))).await, InvalidArgument, inv);
    let d =
        pb::query_request::Dependencies { job_id: id.clone(), status: buffa::EnumValue::from(9), ..Default::default() };
    assert_code(c.query(query_req("q", oneof::query_request::Query::from(d))).await, InvalidArgument, inv);
    assert_code(c.query(query_req("", oneof::query_request::Query::IsMaxed(true))).await, InvalidArgument, inv);

    // The result store: empty keys, oversized values, a counter on a value.
    assert_code(c.result_get(pb::ResultGetRequest::default()).await, InvalidArgument, inv);
    assert_code(
        c.result_m_get(pb::ResultMGetRequest { keys: vec!["ok".into(), String::new()], ..Default::default() }).await,
        InvalidArgument,
        inv,
    );
    let big = pb::ResultSetRequest { key: "k".into(), value: vec![0; 4096], ..Default::default() };
    assert_code(c.result_set(big).await, ResourceExhausted, Some("payload_too_large"));
    assert_code(c.result_delete(pb::ResultDeleteRequest::default()).await, InvalidArgument, inv);
    c.result_set(pb::ResultSetRequest { key: "v".into(), value: b"x".to_vec(), ..Default::default() }).await.unwrap();
    let incr = pb::ResultIncrRequest { key: "v".into(), member: "m".into(), ..Default::default() };
    assert_code(c.result_incr(incr).await, InvalidArgument, inv);
    assert_code(c.result_expire(pb::ResultExpireRequest::default()).await, InvalidArgument, inv);
    // A zero ttl (Redis refuses `PX 0`); the value before it stays.
    let zero = pb::ResultSetRequest { key: "v".into(), value: b"y".to_vec(), ttl_ms: Some(0), ..Default::default() };
    assert_code(c.result_set(zero).await, InvalidArgument, inv);
    let zero = pb::ResultIncrRequest { key: "n".into(), member: "m".into(), ttl_ms: Some(0), ..Default::default() };
    assert_code(c.result_incr(zero).await, InvalidArgument, inv);
    let v = c.result_get(pb::ResultGetRequest { key: "v".into(), ..Default::default() }).await.unwrap();
    assert_eq!(v.into_owned().value, Some(b"x".to_vec()));

    // Watch: an invalid queue.
    assert_code(watch_first(&c, pb::WatchRequest::default()).await, InvalidArgument, inv);

    // Garbage bodies on every method, as JSON and as protobuf; an unknown method.
    for m in METHODS {
        let path = format!("/loam.jobs.v1.JobsService/{m}");
        let (status, body) = server.http("POST", &path, "application/json", b"{not json").unwrap();
        let text = String::from_utf8_lossy(&body);
        if m == "Watch" || m == "Session" {
            // Streams are refused for unary content types.
            assert!(status >= 400, "{m}: {status} {text}");
        } else {
            assert_eq!(status, 400, "{m}: {text}");
            assert!(text.contains("invalid_argument"), "{m}: {text}");
        }
        let (status, _) = server.http("POST", &path, "application/proto", &[0xff, 0xff, 0xff, 0x0f, 0x01]).unwrap();
        assert!(status >= 400, "{m}: garbage protobuf got {status}");
    }
    let (status, _) = server.http("POST", "/loam.jobs.v1.JobsService/Nope", "application/json", b"{}").unwrap();
    assert_eq!(status, 404);
    // A session whose message is garbage ends with an error, not a crash.
    let garbage = [0u8, 0, 0, 0, 5, 0xff, 0xff, 0xff, 0x0f, 0x01];
    let (status, body) =
        server.http("POST", "/loam.jobs.v1.JobsService/Session", "application/connect+proto", &garbage).unwrap();
    let text = String::from_utf8_lossy(&body);
    assert!(status >= 400 || text.contains("invalid_argument"), "a garbage session message got {status} {text}");
    // Calls read before it are still answered: each may have been applied.
    let mut stream = Vec::new();
    for id in 1..=5u64 {
        let call = pb::__buffa::oneof::session_request::Call::from(enqueue_req("before-garbage", job("x", b"{}")));
        let message = buffa::Message::encode_to_vec(&pb::SessionRequest { id, call: Some(call), ..Default::default() });
        stream.extend_from_slice(&envelope(&message));
    }
    stream.extend_from_slice(&garbage);
    let (_, body) =
        server.http("POST", "/loam.jobs.v1.JobsService/Session", "application/connect+proto", &stream).unwrap();
    let (mut answered, mut rest) = (Vec::new(), body.as_slice());
    while rest.len() >= 5 {
        let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
        let (flags, message) = (rest[0], &rest[5..5 + len]);
        if flags & 0b10 == 0 {
            let answer: pb::SessionResponse = buffa::Message::decode_from_slice(message).unwrap();
            answered.push(answer.id);
        } else {
            assert!(String::from_utf8_lossy(message).contains("invalid_argument"), "the session's end");
        }
        rest = &rest[5 + len..];
    }
    answered.sort_unstable();
    assert_eq!(answered, [1, 2, 3, 4, 5]);

    // Still up, and the leased job is intact.
    assert!(server.healthy());
    let q = oneof::query_request::Query::from(pb::query_request::Jobs { ids: vec![id.clone()], ..Default::default() });
    let Some(oneof::query_response::Result::Jobs(slots)) =
        c.query(query_req("q", q)).await.unwrap().into_owned().result
    else {
        panic!("jobs")
    };
    assert_eq!(slots.slots[0].job.as_option().unwrap().state.as_known(), Some(pb::JobState::JOB_STATE_ACTIVE));
    c.complete(complete_req("q", &id, epoch(l.epoch), success(b"1"))).await.unwrap();
}

const TOKEN_A: &str = "alpha-token-0123456789";
const TOKEN_B: &str = "beta-token-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_namespaces_apart() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("# token namespace\n{TOKEN_A} alpha\n")).unwrap();
    let server = Server::start_in(
        dir.path(),
        &["--tokens", tokens.to_str().unwrap()],
        &[("LOAM_JOBS_TOKENS", &format!("{TOKEN_B}=beta"))],
    );
    let bearer = |t: &str| format!("Bearer {t}");
    let a = server.client_with(&[("authorization", &bearer(TOKEN_A))]);
    let b = server.client_with(&[("authorization", &bearer(TOKEN_B))]);
    let done = a.enqueue(enqueue_req("shared", job("secret", b"{}"))).await.unwrap().into_owned();
    let id = done.enqueued.into_option().unwrap().id;

    // No token, an unknown token, a namespace the token does not grant.
    let none = server.client();
    assert_code(
        none.enqueue(enqueue_req("shared", job("x", b"{}"))).await,
        ErrorCode::Unauthenticated,
        Some("unauthenticated"),
    );
    let wrong = server.client_with(&[("authorization", "Bearer not-a-real-token-at-all")]);
    assert_code(wrong.lease(lease_req("shared", 1, 0, 0)).await, ErrorCode::Unauthenticated, Some("unauthenticated"));
    let sneaky = server.client_with(&[("authorization", &bearer(TOKEN_B)), ("loam-namespace", "alpha")]);
    assert_code(
        sneaky.lease(lease_req("shared", 1, 0, 0)).await,
        ErrorCode::PermissionDenied,
        Some("permission_denied"),
    );
    assert_code(
        watch_first(&sneaky, pb::WatchRequest { queue: "shared".into(), ..Default::default() }).await,
        ErrorCode::PermissionDenied,
        None,
    );

    // Two Authorization headers (a client's and a proxy's, say) are refused,
    // whichever of them would pass alone; so are two namespace headers.
    let unary = |headers: &[(&str, &str)]| {
        let counts = br#"{"queue":"shared","counts":{"types":["wait"]}}"#;
        server.http_with("POST", "/loam.jobs.v1.JobsService/Query", headers, "application/json", counts)
    };
    let (status, body) = unary(&[("Authorization", &bearer(TOKEN_A)), ("Authorization", &bearer(TOKEN_B))]).unwrap();
    assert_eq!(status, 401, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("one Authorization header"), "{}", String::from_utf8_lossy(&body));
    let (status, body) =
        unary(&[("Authorization", &bearer(TOKEN_A)), ("loam-namespace", "alpha"), ("loam-namespace", "beta")]).unwrap();
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    assert!(
        String::from_utf8_lossy(&body).contains("several loam-namespace headers"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    // One of each is served as before.
    let (status, body) = unary(&[("Authorization", &bearer(TOKEN_A)), ("loam-namespace", "alpha")]).unwrap();
    assert_eq!((status, String::from_utf8_lossy(&body).as_ref()), (200, r#"{"counts":{"counts":["1"]}}"#));

    // B sees nothing of A's queue of the same name, and cannot take or touch A's job.
    assert_eq!(counts(&b, "shared", &["wait"]).await, vec![0]);
    let leased = b.lease(lease_req("shared", 10, 0, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    assert!(leased.leases.is_empty());
    let q = oneof::query_request::Query::from(pb::query_request::Jobs { ids: vec![id.clone()], ..Default::default() });
    let Some(oneof::query_response::Result::Jobs(slots)) =
        b.query(query_req("shared", q)).await.unwrap().into_owned().result
    else {
        panic!("jobs")
    };
    assert!(slots.slots[0].job.is_unset());
    let rm = pb::job_admin_request::Remove { remove_children: true, ..Default::default() };
    // Removing a job that does not exist succeeds (BullMQ's rule), in B's namespace only.
    b.job_admin(job_admin("shared", &id, rm)).await.unwrap();
    let Some(oneof::query_response::Result::Names(names)) =
        b.query(query_req("", oneof::query_request::Query::Queues(true))).await.unwrap().into_owned().result
    else {
        panic!("names")
    };
    assert!(names.names.is_empty(), "{:?}", names.names);
    // A still has its job.
    assert_eq!(counts(&a, "shared", &["wait"]).await, vec![1]);
    b.enqueue(enqueue_req("b-only", job("x", b"{}"))).await.unwrap();

    // /metrics needs a token too, and shows only the token's namespace: not
    // the other's calls (beta made ResultSet calls, alpha none); the
    // server-wide series have no namespace.
    for n in 0..3 {
        let set = pb::ResultSetRequest { key: format!("k{n}"), value: b"v".to_vec(), ..Default::default() };
        b.result_set(set).await.unwrap();
    }
    assert_eq!(server.http("GET", "/metrics", "", b"").unwrap().0, 401);
    let (status, body) = server.http_with("GET", "/metrics", &[("Authorization", &bearer(TOKEN_A))], "", b"").unwrap();
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200);
    assert!(text.contains("ns=\"alpha\"") && !text.contains("beta") && !text.contains("b-only"), "{text}");
    assert!(text.contains("loam_jobs_rpc_requests_total{ns=\"alpha\",method=\"Enqueue\""), "{text}");
    assert!(!text.contains("ResultSet"), "{text}");
    let samples = text.lines().filter(|l| !l.starts_with('#') && l.contains("ns=\""));
    assert!(samples.clone().all(|l| l.contains("ns=\"alpha\"")), "{:?}", samples.collect::<Vec<_>>());
    assert!(server.healthy());
}

#[test]
fn refuses_a_public_address_without_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_loam-jobs"))
        .args(["serve", "--listen", &format!("0.0.0.0:{}", free_port()), "--data-dir"])
        .arg(dir.path())
        .env_remove("LOAM_JOBS_TOKENS")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("without token authentication"));
}

#[test]
fn refuses_a_clock_that_follows_callers_with_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_loam-jobs"))
        .args(["serve", "--follow-client-clock", "--listen", &format!("127.0.0.1:{}", free_port()), "--data-dir"])
        .arg(dir.path())
        .env("LOAM_JOBS_TOKENS", "aaaaaaaaaaaaaaaa=alpha")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--follow-client-clock"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_long_polls_and_closes_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    c.enqueue(enqueue_req("q", job("kept", b"{}"))).await.unwrap();
    // A worker long-polls an empty queue, over a connection it has made
    // already, so that its call is with the server well before the SIGTERM
    // (one still connecting then would be refused) on a loaded machine too.
    let poller = server.client();
    poller.lease(lease_req("empty", 1, 0, 0)).await.unwrap();
    let poll = tokio::spawn(async move { poller.lease(lease_req("empty", 1, 30_000, 0)).await });
    // And a client watches a queue.
    let mut watch = c.watch(pb::WatchRequest { queue: "q".into(), ..Default::default() }).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let status = server.terminate(Duration::from_secs(10)).expect("exits after SIGTERM");
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "the long-poll did not hold up shutdown");
    let leased = poll.await.unwrap().unwrap().into_owned().leased.into_option().unwrap();
    assert!(leased.leases.is_empty());
    // The watch ended rather than hanging, as unavailable (a clean end
    // would say the queue's events are over).
    let end = tokio::time::timeout(Duration::from_secs(5), watch.message::<pb::WatchResponse>()).await.unwrap();
    assert!(matches!(&end, Err(e) if e.code == ErrorCode::Unavailable), "{end:?}");
    assert!(server.log_text().contains("store closed"));
    // The store reopens (it was closed, not left locked) with its job.
    server.restart();
    assert_eq!(counts(&server.client(), "q", &["wait"]).await, vec![1]);
}

/// A read whose answer would be over --max-response-bytes is refused, and
/// stops gathering once it is: the same large job asked for a hundred times
/// answered a gigabyte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_over_max_response_bytes_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // The largest payload that a 1 MiB answer still fits twice, with room.
    let server =
        Server::start_in(dir.path(), &["--max-response-bytes", "1048576", "--max-payload-bytes", "409600"], &[]);
    let c = server.client();
    let data = format!("\"{}\"", "x".repeat(300 << 10));
    let added = c.enqueue(enqueue_req("q", job("big", data.as_bytes()))).await.unwrap().into_owned();
    let id = added.enqueued.into_option().unwrap().id;
    let jobs = |n: usize| {
        let ids = pb::query_request::Jobs { ids: vec![id.clone(); n], ..Default::default() };
        query_req("q", oneof::query_request::Query::from(ids))
    };
    c.query(jobs(3)).await.unwrap();
    let refused = assert_code(c.query(jobs(100)).await, ErrorCode::ResourceExhausted, Some("response_too_large"));
    assert!(refused.message.as_deref().unwrap_or("").contains("--max-response-bytes"), "{refused:?}");

    // A parent's children with their jobs: a page of two fits, every child
    // does not, and the page is refused rather than sent without some jobs.
    let mut parent = job("parent", b"{}");
    parent.job_id = Some("p".into());
    let mut nodes =
        vec![pb::FlowNode { queue: "q".into(), job: parent.into(), wait_children: true, ..Default::default() }];
    for n in 0..4 {
        let mut child = job(&format!("c{n}"), data.as_bytes());
        child.parent = pb::ParentRef { queue: "q".into(), id: "p".into(), ..Default::default() }.into();
        nodes.push(pb::FlowNode { queue: "q".into(), job: child.into(), ..Default::default() });
    }
    c.flow(pb::FlowRequest { nodes, ..Default::default() }).await.unwrap();
    let children = |end: i64| {
        let deps = pb::query_request::Dependencies {
            job_id: "p".into(),
            with_jobs: true,
            end: Some(end),
            ..Default::default()
        };
        query_req("q", oneof::query_request::Query::from(deps))
    };
    let Some(oneof::query_response::Result::Dependencies(page)) =
        c.query(children(1)).await.unwrap().into_owned().result
    else {
        panic!("dependencies")
    };
    assert_eq!((page.dependencies.len(), page.jobs.len(), page.total), (2, 2, 4));
    assert_code(c.query(children(-1)).await, ErrorCode::ResourceExhausted, Some("response_too_large"));

    let value = vec![b'v'; 300 << 10];
    c.result_set(pb::ResultSetRequest { key: "r".into(), value, ..Default::default() }).await.unwrap();
    let mget = |n: usize| pb::ResultMGetRequest { keys: vec!["r".into(); n], ..Default::default() };
    assert_eq!(c.result_m_get(mget(3)).await.unwrap().into_owned().values.len(), 3);
    assert_code(c.result_m_get(mget(100)).await, ErrorCode::ResourceExhausted, Some("response_too_large"));

    // A lease takes no more jobs than fit (and one at least).
    for i in 0..4 {
        c.enqueue(enqueue_req("work", job(&format!("w{i}"), data.as_bytes()))).await.unwrap();
    }
    let leased = c.lease(lease_req("work", 10, 0, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    assert_eq!(leased.leases.len(), 3, "of four jobs of 300 KB, those that fit a 1 MB answer");

    // An event read is cut short instead: refused, its reader would ask again
    // for ever. It reads on from the last event it got.
    for i in 0..10 {
        let ev = pb::queue_admin_request::PublishEvent {
            name: format!("e{i}"),
            fields: vec![pb::EventField { key: "pad".into(), value: "x".repeat(300 << 10), ..Default::default() }],
            max_events: 1_000,
            ..Default::default()
        };
        c.queue_admin(queue_admin_req("ev", ev)).await.unwrap();
    }
    let (mut after, mut names, mut reads) = (0, Vec::new(), 0);
    while names.len() < 10 {
        let q = pb::query_request::Events { after: Some(after), limit: 100, ..Default::default() };
        let r = c.query(query_req("ev", oneof::query_request::Query::from(q))).await.unwrap().into_owned();
        let Some(oneof::query_response::Result::Events(list)) = r.result else { panic!("events") };
        assert!((1..=3).contains(&list.events.len()), "{} events of 300 KB in a 1 MB answer", list.events.len());
        after = list.events.last().unwrap().seq;
        names.extend(list.events.into_iter().map(|e| e.name));
        reads += 1;
    }
    assert_eq!(names, (0..10).map(|i| format!("e{i}")).collect::<Vec<_>>());
    assert!(reads >= 4, "{reads}");
    // A response cap that could not hold one job of the largest payloads
    // (data and return value) could never answer some reads.
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_loam-jobs"))
        .args(["serve", "--max-payload-bytes", "1048576", "--max-response-bytes", "2097152", "--data-dir"])
        .arg(dir.path().join("other"))
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--max-response-bytes must be at least twice"));
    assert!(server.healthy());
}
