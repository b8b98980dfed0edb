//! `Session`: many calls on one HTTP/2 stream, answered by id in any order.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

mod support;

use std::collections::HashMap;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use connectrpc::client::{ClientConfig, HttpClient};
use pb::__buffa::oneof::{session_request::Call, session_response::Result as Answer};
use support::*;

/// A client whose calls go over HTTP/2, as a session's must.
fn http2_client(server: &Server) -> Client {
    pb::JobsServiceClient::new(HttpClient::plaintext_http2_only(), ClientConfig::new(server.url().parse().unwrap()))
}

fn request(id: u64, call: impl Into<Call>) -> pb::SessionRequest {
    pb::SessionRequest { id, call: Some(call.into()), ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_on_one_stream_are_answered_by_id_and_a_wait_can_be_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let client = http2_client(&server);
    let mut session = client.session().await.unwrap();

    // A long poll on an empty queue first: the calls after it do not wait for it.
    session.send(request(1, lease_req("idle", 1, 20_000, 0))).await.unwrap();
    for i in 0..20u64 {
        session.send(request(10 + i, enqueue_req("mail", job("send", b"{}")))).await.unwrap();
    }
    // A bad call answers with the error a single call would end with; a
    // request that names no call is refused the same way.
    session.send(request(2, enqueue_req("", job("send", b"{}")))).await.unwrap();
    session.send(pb::SessionRequest { id: 4, ..Default::default() }).await.unwrap();
    let started = Instant::now();
    let mut answers = HashMap::new();
    while answers.len() < 22 {
        let answer = session.message().await.unwrap().unwrap().to_owned_message();
        answers.insert(answer.id, answer.result.unwrap());
    }
    assert!(started.elapsed() < Duration::from_secs(5), "the long poll held the others up");
    for i in 0..20u64 {
        assert!(
            matches!(answers.get(&(10 + i)), Some(Answer::Enqueue(e)) if e.enqueued.as_option().is_some_and(|e| e.created))
        );
    }
    match answers.get(&2) {
        Some(Answer::Error(e)) => {
            assert_eq!(e.code, "invalid_argument");
            assert!(
                e.detail.as_option().is_some_and(|d| !d.reason.is_empty()),
                "the error's detail comes along: {e:?}"
            );
        }
        other => panic!("expected an error, got {other:?}"),
    }
    assert!(matches!(answers.get(&4), Some(Answer::Error(e)) if e.code == "invalid_argument"));
    // Cancelling the long poll answers it at once.
    session.send(request(1, pb::SessionCancel::default())).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), session.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
        .to_owned_message();
    assert_eq!(answer.id, 1);
    assert!(matches!(answer.result, Some(Answer::Error(e)) if e.code == "canceled"));

    // A lease at the caller's clock, and the jobs are there for it.
    let leased = pb::SessionRequest { now_ms: Some(1_700_000_000_000), ..request(3, lease_req("mail", 20, 0, 0)) };
    session.send(leased).await.unwrap();
    let answer = session.message().await.unwrap().unwrap().to_owned_message();
    assert_eq!(answer.id, 3);
    match answer.result {
        Some(Answer::Lease(l)) => assert_eq!(l.leased.as_option().unwrap().leases.len(), 20),
        other => panic!("expected leases, got {other:?}"),
    }
    // A clock before 1970 is refused like any bad argument, and counted as
    // a failed call of its method, as a unary call's would be (refused with
    // its caller, under no namespace).
    let bad_clock = pb::SessionRequest { now_ms: Some(-1), ..request(5, lease_req("mail", 1, 0, 0)) };
    session.send(bad_clock).await.unwrap();
    let answer = session.message().await.unwrap().unwrap().to_owned_message();
    assert_eq!(answer.id, 5);
    assert!(matches!(answer.result, Some(Answer::Error(ref e)) if e.code == "invalid_argument"), "{:?}", answer.result);
    let text = server.metrics();
    assert!(text.contains(r#"loam_jobs_rpc_requests_total{ns="",method="Lease",code="invalid_argument"} 1"#), "{text}");
    // Closing our side ends the stream once everything is answered.
    session.close_send();
    assert!(session.message().await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_needs_a_token_like_any_call() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[("LOAM_JOBS_TOKENS", "team-a-token-0123456789=a")]);
    let client = http2_client(&server);
    let mut session = client.session().await.unwrap();
    session.send(request(1, enqueue_req("mail", job("send", b"{}")))).await.unwrap();
    let e = session.message().await.expect_err("refused");
    assert_eq!(e.code, connectrpc::ErrorCode::Unauthenticated);
}

/// The core applies a session's calls in the order they were sent, as Redis
/// does the commands of one connection: jobs added in one burst get their
/// ids in that order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_apply_in_the_order_they_were_sent() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let client = http2_client(&server);
    let mut session = client.session().await.unwrap();
    for round in 0..5u64 {
        for i in 0..200u64 {
            session.send(request(round * 1000 + i, enqueue_req("ordered", job("n", b"{}")))).await.unwrap();
        }
        let mut ids = Vec::new();
        while ids.len() < 200 {
            let answer = session.message().await.unwrap().unwrap().to_owned_message();
            match answer.result {
                Some(Answer::Enqueue(e)) => {
                    ids.push((answer.id, e.enqueued.into_option().unwrap().id.parse::<u64>().unwrap()))
                }
                other => panic!("expected an enqueue, got {other:?}"),
            }
        }
        ids.sort_unstable();
        let job_ids: Vec<u64> = ids.iter().map(|(_, job)| *job).collect();
        let mut sorted = job_ids.clone();
        sorted.sort_unstable();
        assert_eq!(job_ids, sorted, "round {round}: job ids follow the order the calls were sent");
    }
}

/// A message over the server's request size ends the session with
/// resource_exhausted (the stream's framing cannot be trusted past it), and
/// the server stays up. So a client sends such calls on their own streams
/// (`@loam/bullmq` does, past 1 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_ends_the_session_with_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--max-request-bytes", "65536"], &[]);
    let client = http2_client(&server);
    let mut session = client.session().await.unwrap();
    session.send(request(1, enqueue_req("big", job("small", b"{}")))).await.unwrap();
    let answer = session.message().await.unwrap().unwrap().to_owned_message();
    assert!(matches!(answer.result, Some(Answer::Enqueue(_))));
    let _ = session.send(request(2, enqueue_req("big", job("huge", &vec![b'a'; 100_000])))).await;
    let ended = tokio::time::timeout(Duration::from_secs(5), session.message()).await.unwrap();
    assert_eq!(ended.err().map(|e| e.code), Some(connectrpc::ErrorCode::ResourceExhausted));
    assert!(server.healthy());
}

/// A long-poll Lease cancelled as a job arrives may have leased it already:
/// the job goes back to the queue at once rather than staying active with
/// nobody holding it until its lock expires (and counting as a stall).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_lease_leaves_no_job_without_a_holder() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let client = http2_client(&server);
    let plain = server.client();
    let mut session = client.session().await.unwrap();
    let (mut cancelled, mut raced) = (0, 0);
    for i in 0..60u64 {
        let q = format!("q{i}");
        session.send(request(i * 10 + 1, lease_req(&q, 1, 10_000, 600_000))).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
        session.send(request(i * 10 + 2, enqueue_req(&q, job("x", b"{}")))).await.unwrap();
        session.send(request(i * 10 + 1, pb::SessionCancel::default())).await.unwrap();
        let mut lease_answer = None;
        for _ in 0..2 {
            let answer = session.message().await.unwrap().unwrap().to_owned_message();
            if answer.id == i * 10 + 1 {
                lease_answer = answer.result;
            }
        }
        if !matches!(lease_answer, Some(Answer::Error(ref e)) if e.code == "canceled") {
            continue; // the lease was answered first: that job is ours
        }
        cancelled += 1;
        if counts(&plain, &q, &["active"]).await[0] == 1 {
            raced += 1;
        }
        let until = Instant::now() + Duration::from_secs(5);
        while counts(&plain, &q, &["active", "wait"]).await != [0, 1] {
            assert!(Instant::now() < until, "round {i}: a cancelled lease left its job active");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    eprintln!("{cancelled} leases cancelled, {raced} of them after they had leased");
    assert!(cancelled > 0);
}

async fn lease_one(c: &Client, q: &str) -> (String, u64) {
    let r = c.lease(lease_req(q, 1, 0, 600_000)).await.unwrap().into_owned();
    let l = r.leased.into_option().unwrap().leases.remove(0);
    (l.job.into_option().unwrap().id, l.epoch)
}

fn complete_fetch_next(q: &str, id: &str, epoch_: u64) -> pb::CompleteRequest {
    let mut req = complete_req(q, id, epoch(epoch_), success(b"1"));
    req.options = pb::CompleteOptions {
        fetch_next: pb::LeaseOptions { max: 1, lock_duration_ms: 600_000, ..Default::default() }.into(),
        ..Default::default()
    }
    .into();
    req
}

/// A Lease that does not wait is a write: cancelled while it runs, it is not
/// dropped but answered as it ends, and the job it took goes back at once
/// and out of its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_lease_that_does_not_wait_gives_back_its_job_and_says_so() {
    cancelled_writes_give_back_what_they_leased(Leasing::Lease).await;
}

/// The next job a Complete fetched is a lease too: when that call is
/// cancelled after the server took it, the job it completed stays done (a
/// write runs to its end, and is answered so), and the one it leased goes
/// back at once instead of staying active with nobody holding it (as a
/// cancelled Lease's does), and out of its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_completion_gives_back_the_job_it_fetched() {
    cancelled_writes_give_back_what_they_leased(Leasing::Complete(|req| req)).await;
}

/// The same for a Complete that also asks for the rate limiter's ttl (as a
/// BullMQ worker with a limiter sends it), which the server answered by
/// another way that did not give the job back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_rate_limited_completion_gives_back_the_job_it_fetched() {
    cancelled_writes_give_back_what_they_leased(Leasing::Complete(|mut req| {
        req.rate_limit_ttl_for = pb::RateLimit { max: 1000, duration_ms: 1000, ..Default::default() }.into();
        req
    }))
    .await;
}

/// A write that leases jobs for its caller.
#[derive(Clone, Copy)]
enum Leasing {
    /// A Lease that does not wait.
    Lease,
    /// A Complete fetching the next job, shaped.
    Complete(fn(pb::CompleteRequest) -> pb::CompleteRequest),
}

/// Rounds of two jobs and a `leasing` write cancelled as it is sent: each
/// one the cancel reached in flight answers with no job leased, and leaves
/// none active.
async fn cancelled_writes_give_back_what_they_leased(leasing: Leasing) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let client = http2_client(&server);
    let plain = server.client();
    let mut session = client.session().await.unwrap();
    let mut cancelled = 0;
    for i in 0..30u64 {
        let q = format!("f{i}");
        for _ in 0..2 {
            plain.enqueue(enqueue_req(&q, job("x", b"{}"))).await.unwrap();
        }
        let (call, settled) = match leasing {
            Leasing::Lease => (Call::from(lease_req(&q, 1, 0, 600_000)), [0, 0, 2]),
            Leasing::Complete(shape) => {
                let (id, ep) = lease_one(&plain, &q).await;
                (Call::from(shape(complete_fetch_next(&q, &id, ep))), [1, 0, 1])
            }
        };
        session.send(request(i, call)).await.unwrap();
        session.send(request(i, pb::SessionCancel::default())).await.unwrap();
        let answer = session.message().await.unwrap().unwrap().to_owned_message();
        let leased = match answer.result {
            Some(Answer::Lease(l)) => l.leased.as_option().map(|l| l.leases.len()),
            Some(Answer::Complete(done)) => {
                done.completed.as_option().and_then(|c| c.next.as_option()).map(|n| n.leases.len())
            }
            other => panic!("round {i}: {other:?}"),
        };
        if leased == Some(1) {
            continue; // answered before the cancel came: the job is ours
        }
        cancelled += 1;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let c = counts(&plain, &q, &["completed", "active", "wait"]).await;
            if c == settled {
                break; // what it leased given back
            }
            assert!(Instant::now() < deadline, "round {i}: completed/active/wait {c:?}: a leased job has no holder");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert!(cancelled > 0, "no write was cancelled in flight");
}

/// A client that sends calls and reads none of their answers cannot make the
/// server keep the answers without end: past a few dozen unread, the session
/// stops taking calls until the client reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_keeps_few_unread_answers() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let pid = server.child.as_ref().unwrap().id();
    let rss_mib = || {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
    };
    let plain = server.client();
    let added = plain.enqueue(enqueue_req("big", job("x", &vec![b'a'; 4 << 20]))).await.unwrap().into_owned();
    let id = added.enqueued.into_option().unwrap().id;
    let before = rss_mib();
    let client = http2_client(&server);
    let mut session = client.session().await.unwrap();
    let query =
        pb::__buffa::oneof::query_request::Query::from(pb::query_request::Jobs { ids: vec![id], ..Default::default() });
    // 300 answers of 4 MiB: 1.2 GiB if the server kept them all.
    let sending = tokio::spawn(async move {
        for i in 0..300u64 {
            if session.send(request(i, query_req("big", query.clone()))).await.is_err() {
                break;
            }
        }
        session
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = rss_mib();
    assert!(after < before + 512, "server RSS grew from {before} to {after} MiB for one session's unread answers");
    sending.abort();
    drop(client);
    plain.enqueue(enqueue_req("after", job("x", b"{}"))).await.expect("the server is still up");
}

/// Ids must be unique among a session's calls in flight: a second call under
/// an id in flight is refused, and the first still gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_reusing_an_id_in_flight_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let client = http2_client(&server);
    let plain = server.client();
    let mut session = client.session().await.unwrap();
    session.send(request(7, lease_req("dup", 1, 10_000, 600_000))).await.unwrap();
    session.send(request(7, enqueue_req("other", job("x", b"{}")))).await.unwrap();
    let refused = session.message().await.unwrap().unwrap().to_owned_message();
    assert!(
        matches!(refused.result, Some(Answer::Error(ref e)) if e.code == "invalid_argument"),
        "{:?}",
        refused.result
    );
    assert_eq!(counts(&plain, "other", &["wait"]).await, [0], "the refused call did nothing");
    plain.enqueue(enqueue_req("dup", job("x", b"{}"))).await.unwrap();
    let leased = tokio::time::timeout(Duration::from_secs(5), session.message()).await.expect("the lease answers");
    let leased = leased.unwrap().unwrap().to_owned_message();
    assert_eq!(leased.id, 7);
    assert!(matches!(leased.result, Some(Answer::Lease(_))), "{:?}", leased.result);
}

/// A read sent right behind a write on the same session sees it, as one
/// Redis connection's commands do: reads run on the latest snapshot at once,
/// and one behind an add missed the job about half the time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_sees_the_writes_sent_before_it_on_its_session() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let client = http2_client(&server);
    let mut session = client.session().await.unwrap();
    // A long poll first: reads do not wait for it.
    session.send(request(1, lease_req("idle", 1, 20_000, 0))).await.unwrap();
    let started = Instant::now();
    for i in 0..30u64 {
        let id = format!("j{i}");
        let add = pb::JobSpec { job_id: Some(id.clone()), ..job("send", b"{}") };
        session.send(request(100 + 2 * i, enqueue_req("own", add))).await.unwrap();
        let jobs = pb::query_request::Jobs { ids: vec![id], ..Default::default() };
        session.send(request(101 + 2 * i, query_req("own", jobs.into()))).await.unwrap();
    }
    let mut seen = 0;
    for _ in 0..60 {
        let answer = session.message().await.unwrap().unwrap().to_owned_message();
        if let Some(Answer::Query(q)) = answer.result {
            let Some(oneof::query_response::Result::Jobs(jobs)) = q.result else { panic!("jobs") };
            assert!(jobs.slots[0].job.as_option().is_some(), "call {} read before the add sent ahead of it", answer.id);
            seen += 1;
        }
    }
    assert_eq!(seen, 30);
    assert!(started.elapsed() < Duration::from_secs(10), "the reads waited for the long poll");
}

/// A cancel of a write in flight does not stop it: the core has it from its
/// first poll, so a `canceled` answer hid that it was applied, and a read
/// sent behind it, no longer waiting for it, missed it (30 of 30 before).
/// The write is answered as it ends, and the read sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_in_flight_is_not_cancelled_and_a_read_behind_it_sees_it() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let client = http2_client(&server);
    let mut session = client.session().await.unwrap();
    for i in 0..30u64 {
        let id = format!("j{i}");
        let add = pb::JobSpec { job_id: Some(id.clone()), ..job("send", b"{}") };
        session.send(request(100 + 2 * i, enqueue_req("own", add))).await.unwrap();
        session.send(request(100 + 2 * i, pb::SessionCancel::default())).await.unwrap();
        let jobs = pb::query_request::Jobs { ids: vec![id], ..Default::default() };
        session.send(request(101 + 2 * i, query_req("own", jobs.into()))).await.unwrap();
    }
    let (mut added, mut seen) = (0, 0);
    for _ in 0..60 {
        let answer = session.message().await.unwrap().unwrap().to_owned_message();
        match answer.result {
            Some(Answer::Enqueue(e)) => {
                assert!(e.enqueued.as_option().is_some_and(|e| e.created), "call {}", answer.id);
                added += 1;
            }
            Some(Answer::Query(q)) => {
                let Some(oneof::query_response::Result::Jobs(jobs)) = q.result else { panic!("jobs") };
                assert!(jobs.slots[0].job.as_option().is_some(), "call {} missed the add sent ahead of it", answer.id);
                seen += 1;
            }
            other => panic!("call {}: expected its add or its read, got {other:?}", answer.id),
        }
    }
    assert_eq!((added, seen), (30, 30));
    session.close_send();
    assert!(session.message().await.unwrap().is_none(), "no answer beyond the calls'");
}

/// A session whose long-poll is ended by the shutdown answers it, then ends:
/// the answer came in before the session saw the shutdown, and the turn after
/// it (nothing in flight, no more reading) once waited for the client to go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_ends_at_shutdown_once_the_long_poll_it_held_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--shutdown-grace-secs", "60"], &[]);
    let client = http2_client(&server);
    let mut session = client.session().await.unwrap();
    session.send(request(1, lease_req("idle", 1, 30_000, 0))).await.unwrap();
    // The lease is waiting once a call sent after it is answered.
    session.send(request(2, enqueue_req("other", job("a", b"{}")))).await.unwrap();
    let answer = session.message().await.unwrap().unwrap().to_owned_message();
    assert_eq!(answer.id, 2);

    let stopping = terminating(server);
    let answer = tokio::time::timeout(Duration::from_secs(10), session.message())
        .await
        .expect("the long-poll is answered at shutdown")
        .unwrap()
        .unwrap()
        .to_owned_message();
    assert_eq!(answer.id, 1);
    assert!(matches!(answer.result, Some(Answer::Lease(_))), "{:?}", answer.result);
    let end = tokio::time::timeout(Duration::from_secs(10), session.message())
        .await
        .expect("the session ends once nothing is in flight");
    assert!(matches!(end, Ok(None)), "a clean end: {end:?}");
    let (status, took, _) = stopping.await.unwrap();
    assert!(status.is_some_and(|s| s.success()), "the server exits: {status:?}");
    assert!(took < Duration::from_secs(10), "the server exits without waiting out its grace: {took:?}");
}

/// A session still waiting for its client to read when the shutdown's grace
/// runs out: the server exits anyway, and the client sees its stream cut,
/// never ended cleanly (a clean end says every call read was answered, and
/// the client would send the others again as never read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_cut_by_the_end_of_the_grace_does_not_end_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--shutdown-grace-secs", "1"], &[]);
    let plain = server.client();
    // Letters that gzip cannot shrink much, so the answers fill the window.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let data: Vec<u8> = (0..1 << 20)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            b'a' + (state % 26) as u8
        })
        .collect();
    let added = plain.enqueue(enqueue_req("big", job("x", &data))).await.unwrap().into_owned();
    let id = added.enqueued.into_option().unwrap().id;
    let client = http2_client(&server);
    let mut session = client.session().await.unwrap();
    let query =
        pb::__buffa::oneof::query_request::Query::from(pb::query_request::Jobs { ids: vec![id], ..Default::default() });
    // Answers of 1 MiB that the client does not read: the session fills its
    // flow-control window and its 64 unsent answers, and waits for a read.
    for i in 0..100u64 {
        session.send(request(i, query_req("big", query.clone()))).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, took, log) = terminating(server).await.unwrap();
    assert!(status.is_some_and(|s| s.success()), "the server exits: {status:?}");
    assert!(took < Duration::from_secs(10), "after its grace: {took:?}");
    assert!(log.contains("calls still in flight after the grace period"), "{log}");
    let mut answered = 0;
    let end = loop {
        match tokio::time::timeout(Duration::from_secs(10), session.message()).await.expect("the stream ends") {
            Ok(Some(_)) => answered += 1,
            other => break other.map(|_| ()),
        }
    };
    assert!(answered < 100, "some calls were left unanswered ({answered} answered)");
    assert!(end.is_err(), "the stream was cut, not ended cleanly ({answered} answered)");
}

/// SIGTERM to `server`, waited for on a thread of its own (up to 20 s): its
/// exit status, how long it took to exit, and its log.
fn terminating(mut server: Server) -> tokio::task::JoinHandle<(Option<ExitStatus>, Duration, String)> {
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let status = server.terminate(Duration::from_secs(20));
        (status, started.elapsed(), server.log_text())
    })
}
