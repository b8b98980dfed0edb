//! `--max-request-bytes-in-flight`: requests past the budget wait to be read
//! and then run, and the bytes come back. Past `--max-request-bytes-waiting`
//! more are refused as unavailable, and run when sent again.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

mod support;

use std::collections::HashMap;

use connectrpc::ErrorCode;
use connectrpc::client::{ClientConfig, HttpClient};
use pb::__buffa::oneof::session_response::Result as Answer;
use support::*;

const BUDGET: usize = 1 << 20;
/// Two of these do not fit the budget at once.
const PAYLOAD: usize = 600 << 10;

/// A server whose waiting room holds every request these tests send at once.
fn start(dir: &std::path::Path) -> Server {
    let room = (64 * BUDGET).to_string();
    Server::start_in(
        dir,
        &["--max-request-bytes-in-flight", &BUDGET.to_string(), "--max-request-bytes-waiting", &room],
        &[],
    )
}

fn big_job(i: usize) -> pb::JobSpec {
    let mut data = format!("{{\"i\":{i},\"pad\":\"").into_bytes();
    data.resize(PAYLOAD, b'x');
    data.extend_from_slice(b"\"}");
    job("big", &data)
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
        .parse()
        .unwrap()
}

/// Waits, then checks the budget is whole again.
async fn assert_budget_returned(server: &Server) {
    // A call's bytes come back just after its answer is sent.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let text = server.metrics();
        if metric(&text, "loam_jobs_request_bytes_in_flight") == 0.0 {
            return;
        }
        assert!(std::time::Instant::now() < until, "bytes still held: {text}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_requests_past_the_budget_wait_and_all_run() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    let c = server.client();
    let calls: Vec<_> = (0..8)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move { c.enqueue(enqueue_req("big", big_job(i))).await.map(|_| ()) })
        })
        .collect();
    for call in calls {
        call.await.unwrap().unwrap();
    }
    assert_eq!(counts(&c, "big", &["wait"]).await, vec![8]);
    let text = server.metrics();
    assert!(metric(&text, "loam_jobs_request_budget_waits_total") > 0.0, "no request waited: {text}");
    assert_budget_returned(&server).await;

    // One request larger than the whole budget runs alone.
    let mut huge = big_job(99);
    huge.data = vec![b'1'; 3 * BUDGET];
    c.enqueue(enqueue_req("big", huge)).await.unwrap();
    assert_eq!(counts(&c, "big", &["wait"]).await, vec![9]);
    assert_budget_returned(&server).await;
}

/// With the waiting room full, a call is refused at once as unavailable,
/// with a pause to wait, and nothing of it is kept; sent again, it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_waiting_room_calls_are_refused_as_unavailable_and_run_when_sent_again() {
    let dir = tempfile::tempdir().unwrap();
    // The default room: as many bytes as the budget.
    let server = Server::start_in(dir.path(), &["--max-request-bytes-in-flight", &BUDGET.to_string()], &[]);
    let c = server.client();
    let calls: Vec<_> = (0..12)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move { (i, c.enqueue(enqueue_req("big", big_job(i))).await.map(|_| ())) })
        })
        .collect();
    let mut refused = Vec::new();
    for call in calls {
        let (i, result) = call.await.unwrap();
        if let Err(e) = result {
            assert_eq!(e.code, ErrorCode::Unavailable, "{e:?}");
            let d = detail(&e);
            assert_eq!((d.reason.as_str(), d.retry_after_ms), ("unavailable", 100));
            refused.push(i);
        }
    }
    // One runs, one waits: at least one of the twelve found the room full.
    assert!(!refused.is_empty(), "none was refused");
    assert_eq!(counts(&c, "big", &["wait"]).await, vec![12 - refused.len() as u64]);
    let text = server.metrics();
    assert_eq!(metric(&text, "loam_jobs_request_budget_refusals_total"), refused.len() as f64, "{text}");
    for i in refused {
        c.enqueue(enqueue_req("big", big_job(i))).await.unwrap();
    }
    assert_eq!(counts(&c, "big", &["wait"]).await, vec![12]);
    assert_budget_returned(&server).await;
}

/// A request without a valid token is refused before it takes any of the
/// budget: refused callers neither hold it nor queue for it ahead of calls
/// that would run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_takes_no_budget() {
    const TOKEN: &str = "alpha-token-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("{TOKEN} alpha\n")).unwrap();
    // The smallest budget, and requests larger than it: each takes all of it,
    // so two holding it at once would make one wait.
    let server = Server::start_in(
        dir.path(),
        &["--tokens", tokens.to_str().unwrap(), "--max-request-bytes-in-flight", "1024"],
        &[],
    );
    let stranger = server.client_with(&[("authorization", "Bearer not-a-real-token-at-all")]);
    let calls: Vec<_> = (0..64)
        .map(|i| {
            let c = stranger.clone();
            let data = format!("{{\"i\":{i},\"pad\":\"{}\"}}", "x".repeat(2048));
            tokio::spawn(async move { c.enqueue(enqueue_req("q", job("x", data.as_bytes()))).await })
        })
        .collect();
    for call in calls {
        assert_code(call.await.unwrap(), ErrorCode::Unauthenticated, Some("unauthenticated"));
    }
    let bearer = format!("Bearer {TOKEN}");
    let (status, body) = server.http_with("GET", "/metrics", &[("Authorization", &bearer)], "", b"").unwrap();
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    assert_eq!(metric(&text, "loam_jobs_request_budget_waits_total"), 0.0, "{text}");
    // A call with the token still runs.
    let alpha = server.client_with(&[("authorization", &bearer)]);
    alpha.enqueue(enqueue_req("q", job("x", b"{}"))).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_calls_past_the_budget_wait_in_order_and_all_run() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    let client = pb::JobsServiceClient::new(
        HttpClient::plaintext_http2_only(),
        ClientConfig::new(server.url().parse().unwrap()),
    );
    let mut session = client.session().await.unwrap();
    let sent = 8usize;
    for i in 0..sent {
        let call = enqueue_req("big", big_job(i));
        session.send(pb::SessionRequest { id: i as u64, call: Some(call.into()), ..Default::default() }).await.unwrap();
    }
    let mut answers = HashMap::new();
    while answers.len() < sent {
        let answer = session.message().await.unwrap().unwrap().to_owned_message();
        answers.insert(answer.id, answer.result.unwrap());
    }
    let mut ids = Vec::new();
    for i in 0..sent as u64 {
        match answers.remove(&i) {
            Some(Answer::Enqueue(e)) => ids.push(e.enqueued.as_option().unwrap().id.clone()),
            other => panic!("call {i}: {other:?}"),
        }
    }
    let text = server.metrics();
    assert!(metric(&text, "loam_jobs_request_budget_waits_total") > 0.0, "no call waited: {text}");
    // Calls that waited for the budget still ran in the order they were sent.
    let c = server.client();
    let query = oneof::query_request::Query::from(pb::query_request::Ranges {
        types: vec!["wait".into()],
        start: 0,
        end: -1,
        asc: true,
        ..Default::default()
    });
    let listed = c.query(query_req("big", query)).await.unwrap().into_owned();
    let Some(oneof::query_response::Result::Ranges(r)) = listed.result else { panic!("ranges") };
    let in_queue: Vec<String> = r.ranges.into_iter().flat_map(|l| l.ids).collect();
    assert_eq!(in_queue, ids);
    session.close_send();
    assert!(session.message().await.unwrap().is_none());
    assert_budget_returned(&server).await;
}

/// A long-poll holds no budget while it waits: calls that need the whole
/// budget, or the bytes left beside it, go on, and a cancel of the long-poll
/// sent behind such a call is answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_poll_holds_no_budget_while_it_waits() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    let plain = server.client();
    let client = pb::JobsServiceClient::new(
        HttpClient::plaintext_http2_only(),
        ClientConfig::new(server.url().parse().unwrap()),
    );
    let mut session = client.session().await.unwrap();
    // A long-poll whose request is more than half the budget (its name filter).
    let names: Vec<String> = (0..6_000).map(|i| format!("{i:0>100}")).collect();
    let lease = pb::LeaseRequest {
        options: pb::LeaseOptions { max: 1, names, ..Default::default() }.into(),
        ..lease_req("idle", 1, 30_000, 0)
    };
    session.send(pb::SessionRequest { id: 1, call: Some(lease.into()), ..Default::default() }).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;

    // Before: each waited for the long-poll's 30 s.
    let quick = std::time::Duration::from_secs(10);
    let mut whole = big_job(1);
    whole.data = vec![b'1'; BUDGET];
    tokio::time::timeout(quick, plain.enqueue(enqueue_req("big", whole))).await.expect("the whole budget").unwrap();
    tokio::time::timeout(quick, plain.enqueue(enqueue_req("big", big_job(2)))).await.expect("most of it").unwrap();

    // On the session: a call needing the whole budget, then a cancel of the long-poll.
    let mut whole = big_job(3);
    whole.data = vec![b'1'; BUDGET];
    let call = enqueue_req("big", whole);
    session.send(pb::SessionRequest { id: 2, call: Some(call.into()), ..Default::default() }).await.unwrap();
    let cancel = pb::SessionRequest { id: 1, call: Some(pb::SessionCancel::default().into()), ..Default::default() };
    session.send(cancel).await.unwrap();
    let mut answers = HashMap::new();
    while answers.len() < 2 {
        let answer = tokio::time::timeout(quick, session.message()).await.expect("answers").unwrap().unwrap();
        let answer = answer.to_owned_message();
        answers.insert(answer.id, answer.result.unwrap());
    }
    assert!(matches!(answers.get(&1), Some(Answer::Error(e)) if e.code == "canceled"), "{:?}", answers.get(&1));
    assert!(matches!(answers.get(&2), Some(Answer::Enqueue(_))), "{:?}", answers.get(&2));
    assert_eq!(counts(&plain, "big", &["wait"]).await, vec![3]);
    session.close_send();
    assert!(session.message().await.unwrap().is_none());
    assert_budget_returned(&server).await;
}

/// Each namespace may have `--max-waiting-calls-per-namespace` long-polls
/// waiting at once: past that a long-poll is refused as unavailable, while
/// another namespace's wait as before, and a place given back is taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_past_its_waiting_calls_is_refused_and_no_other_is() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--max-waiting-calls-per-namespace", "2"], &[]);
    let a = server.client_with(&[("loam-namespace", "a")]);
    let b = server.client_with(&[("loam-namespace", "b")]);
    let wait = || {
        let a = a.clone();
        tokio::spawn(async move { a.lease(lease_req("q", 1, 20_000, 0)).await.map(|r| r.into_owned()) })
    };
    // Two long waits, and a short one beside them, until it is refused: only
    // the two can hold the places then. A long one may be refused itself,
    // when the short one held a place as it came; it is sent again.
    let mut waits = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let refused = loop {
        assert!(std::time::Instant::now() < deadline, "no long-poll was refused");
        waits.retain(|w: &tokio::task::JoinHandle<_>| !w.is_finished());
        while waits.len() < 2 {
            waits.push(wait());
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        if let Err(e) = a.lease(lease_req("q", 1, 50, 0)).await {
            break e;
        }
    };
    assert_eq!(refused.code, ErrorCode::Unavailable, "{refused:?}");
    assert!(refused.message.as_deref().unwrap_or("").contains("--max-waiting-calls-per-namespace"), "{refused:?}");
    assert!(detail(&refused).retry_after_ms > 0);
    // The same count holds the namespace's other waits, and a call that does not wait runs.
    let wait_for_job = oneof::query_request::Query::WaitForJob(Box::new(pb::query_request::WaitForJob {
        wait_ms: 50,
        ..Default::default()
    }));
    assert_code(a.query(query_req("q", wait_for_job.clone())).await, ErrorCode::Unavailable, Some("unavailable"));
    let watch = || pb::WatchRequest { queue: "q".into(), ..Default::default() };
    assert_code(watch_first(&a, watch()).await, ErrorCode::Unavailable, Some("unavailable"));
    watch_first(&b, watch()).await.unwrap();
    a.lease(lease_req("q", 1, 0, 0)).await.unwrap();
    b.query(query_req("q", wait_for_job)).await.unwrap();
    // A job ends one of the two waits; its place is taken again.
    a.enqueue(enqueue_req("q", job("x", b"{}"))).await.unwrap();
    let mut ended = 0;
    while ended == 0 {
        assert!(std::time::Instant::now() < deadline, "the job ended no wait");
        ended = waits.iter().filter(|w| w.is_finished()).count();
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    a.lease(lease_req("q", 1, 50, 0)).await.unwrap();
    for w in waits {
        w.abort();
    }
}
