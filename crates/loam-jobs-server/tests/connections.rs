//! What a connection may hold: one that makes no call, or half of one, is
//! closed; an idle one is closed; calls in flight keep theirs open; a request
//! whose body stops half way fails, and one without a known token has its body
//! left unread; past --max-connections a new one is closed at once.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

mod support;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use connectrpc::client::{ClientConfig, HttpClient};
use support::*;

/// The HTTP/2 connection preface (RFC 9113 3.4) and an empty SETTINGS frame.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// Reads `conn` until the server closes it, or panics after `within`.
/// Returns how long that took.
fn closed_within(conn: &mut TcpStream, within: Duration) -> Duration {
    let started = Instant::now();
    conn.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return started.elapsed(),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return started.elapsed(),
        }
        assert!(started.elapsed() < within, "the server kept the connection open for {within:?}");
    }
}

fn connect(server: &Server) -> TcpStream {
    TcpStream::connect(("127.0.0.1", server.port)).unwrap()
}

#[test]
fn a_connection_that_sends_nothing_or_half_a_request_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--first-call-timeout-secs", "1"], &[]);

    // Timed from before the connection, so that a pause of the test's
    // thread cannot make the server's wait look shorter than it was.
    let asked = Instant::now();
    let mut silent = connect(&server);
    closed_within(&mut silent, Duration::from_secs(5));
    let took = asked.elapsed();
    assert!(took >= Duration::from_millis(800), "closed before its time: {took:?}");

    let mut half_head = connect(&server);
    half_head.write_all(b"POST /loam.jobs.v1.JobsService/Enqueue HTTP/1.1\r\nHost: x\r\n").unwrap();
    closed_within(&mut half_head, Duration::from_secs(5));

    // An HTTP/2 preface and nothing more: answered with the server's
    // SETTINGS, then a GOAWAY, then closed.
    let mut preface_only = connect(&server);
    preface_only.write_all(H2_PREFACE).unwrap();
    closed_within(&mut preface_only, Duration::from_secs(5));

    // The first bytes of the preface only.
    let mut half_preface = connect(&server);
    half_preface.write_all(&H2_PREFACE[..10]).unwrap();
    closed_within(&mut half_preface, Duration::from_secs(5));

    assert!(server.healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_and_the_client_goes_on_over_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--idle-timeout-secs", "1"], &[]);
    let c = pb::JobsServiceClient::new(
        HttpClient::plaintext_http2_only(),
        ClientConfig::new(server.url().parse().unwrap()),
    );
    c.enqueue(enqueue_req("mail", job("send", b"{}"))).await.unwrap();
    // Idle past the timeout: the server sends a GOAWAY and closes.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    c.enqueue(enqueue_req("mail", job("send", b"{}"))).await.unwrap();
    assert_eq!(counts(&c, "mail", &["waiting"]).await, vec![2]);

    // The same over raw HTTP/1.1 keep-alive: closed once idle.
    let mut conn = connect(&server);
    conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let took = closed_within(&mut conn, Duration::from_secs(15));
    assert!(took < Duration::from_secs(12), "an idle HTTP/1.1 connection stayed open {took:?}");
}

/// A connection whose first call came before it was first checked is closed
/// once idle for the idle timeout, not at the (later) first call's deadline:
/// it was, in most runs.
#[test]
fn a_connection_idle_after_its_first_call_is_closed_at_the_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--idle-timeout-secs", "1", "--first-call-timeout-secs", "10"], &[]);
    for _ in 0..3 {
        let mut conn = connect(&server);
        conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let took = closed_within(&mut conn, Duration::from_secs(15));
        assert!(took < Duration::from_secs(4), "closed after {took:?}, not about 1 s");
    }
}

/// An HTTP/1.1 connection kept alive between requests waits for the idle
/// timeout, not the first call's: hyper's header-read timeout, which also
/// times the wait for the next request, had cut it at the first call's.
#[test]
fn a_kept_alive_http1_connection_outlives_the_first_call_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--first-call-timeout-secs", "1", "--idle-timeout-secs", "30"], &[]);
    let mut conn = connect(&server);
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 512];
    for _ in 0..2 {
        conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let n = conn.read(&mut buf).unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"), "{:?}", &buf[..n]);
        std::thread::sleep(Duration::from_millis(2_500));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_flight_keep_their_connection_open() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--idle-timeout-secs", "1", "--first-call-timeout-secs", "1"], &[]);
    let c = pb::JobsServiceClient::new(
        HttpClient::plaintext_http2_only(),
        ClientConfig::new(server.url().parse().unwrap()),
    );
    // A long-poll three times the idle timeout: answered, not cut.
    let started = Instant::now();
    let waited = c.lease(lease_req("mail", 1, 3_000, 0)).await.unwrap().into_owned();
    assert!(waited.leased.into_option().unwrap().leases.is_empty());
    assert!(started.elapsed() >= Duration::from_millis(2_900));

    // A watch that hears nothing but heartbeats for longer than the idle
    // timeout still brings the next event.
    let mut watch = c.watch(pb::WatchRequest { queue: "mail".into(), ..Default::default() }).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let other = server.client();
    other.enqueue(enqueue_req("mail", job("send", b"{}"))).await.unwrap();
    let event = tokio::time::timeout(Duration::from_secs(10), next_event(&mut watch)).await.unwrap().unwrap();
    assert!(event.is_some(), "the watch ended");
}

#[test]
fn past_max_connections_a_new_connection_is_closed_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--max-connections", "2"], &[]);
    // Two kept open. The readiness probes of the start may still hold their
    // places for a moment after they closed, so a refused one is tried again.
    let keep = |server: &Server| {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut conn = connect(server);
            conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut buf = [0u8; 512];
            if matches!(conn.read(&mut buf), Ok(n) if n > 0) {
                return conn;
            }
            assert!(Instant::now() < deadline, "no place for a connection");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let first = keep(&server);
    let _second = keep(&server);
    let mut third = connect(&server);
    let took = closed_within(&mut third, Duration::from_secs(5));
    assert!(took < Duration::from_secs(1), "the connection over the limit waited {took:?}");
    assert!(!server.healthy(), "a third connection was served");

    drop(first);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !server.healthy() {
        assert!(Instant::now() < deadline, "a connection closed did not free its place");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(server.log_text().contains("connections refused"), "the refusal is not logged");
}

/// A request whose body stops half way held its stream, and with it its
/// connection (a call in flight is not idle), for ever.
#[test]
fn a_request_whose_body_stops_half_way_fails() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--request-body-timeout-secs", "1"], &[]);
    let message = buffa::Message::encode_to_vec(&enqueue_req("half", job("x", b"{}")));
    let head = format!(
        "POST /loam.jobs.v1.JobsService/Enqueue HTTP/1.1\r\nHost: x\r\nContent-Type: application/proto\r\n\
         Content-Length: {}\r\n\r\n",
        message.len()
    );

    let started = Instant::now(); // before the server's wait begins
    let mut half = connect(&server);
    half.write_all(head.as_bytes()).unwrap();
    half.write_all(&message[..message.len() / 2]).unwrap();
    half.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = Vec::new();
    let _ = half.read_to_end(&mut answer);
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(800) && took < Duration::from_secs(5), "answered after {took:?}");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("--request-body-timeout-secs"), "{text}");

    // One that keeps sending, each piece well within the timeout, is not
    // cut, though the whole body takes longer than it.
    let mut slow = connect(&server);
    slow.write_all(head.as_bytes()).unwrap();
    for piece in message.chunks(message.len().div_ceil(6)) {
        std::thread::sleep(Duration::from_millis(300));
        slow.write_all(piece).unwrap();
    }
    slow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 512];
    let n = slow.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"), "{:?}", String::from_utf8_lossy(&buf[..n]));
    assert!(server.healthy());
}

/// A Session's client may have nothing to ask for a long time: only a
/// message begun and not finished is timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_may_pause_between_its_messages_but_not_inside_one() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--request-body-timeout-secs", "1"], &[]);
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", server.port)).await.unwrap();
    let (mut h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let request = http::Request::post(format!("{}/loam.jobs.v1.JobsService/Session", server.url()))
        .header("content-type", "application/connect+proto")
        .body(())
        .unwrap();
    let (response, mut sending) = h2.send_request(request, false).unwrap();
    let call = |id: u64| {
        let call = oneof::session_request::Call::from(enqueue_req("paused", job("x", b"{}")));
        envelope(&buffa::Message::encode_to_vec(&pb::SessionRequest { id, call: Some(call), ..Default::default() }))
    };
    sending.send_data(call(1).into(), false).unwrap();
    let mut answers = response.await.unwrap().into_body();
    // The next message: an answer's id, or the end message's text.
    let mut received = Vec::new();
    let mut next = async || loop {
        if received.len() >= 5 {
            let len = u32::from_be_bytes(received[1..5].try_into().unwrap()) as usize;
            if received.len() >= 5 + len {
                let flags = received[0];
                let message: Vec<u8> = received.drain(..5 + len).skip(5).collect();
                if flags & 0b10 != 0 {
                    return Err(String::from_utf8_lossy(&message).into_owned());
                }
                let answer: pb::SessionResponse = buffa::Message::decode_from_slice(&message).unwrap();
                return Ok(answer.id);
            }
        }
        let Some(chunk) = answers.data().await else { return Err("no end message".into()) };
        let chunk = chunk.unwrap();
        let _ = answers.flow_control().release_capacity(chunk.len());
        received.extend_from_slice(&chunk);
    };
    assert_eq!(next().await, Ok(1));
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    sending.send_data(call(2).into(), false).unwrap();
    assert_eq!(next().await, Ok(2), "the session was cut while it sent nothing between messages");

    // Half a message, then nothing: the session ends, and says why.
    let started = Instant::now();
    sending.send_data(call(3)[..3].to_vec().into(), false).unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), next()).await.unwrap();
    let took = started.elapsed();
    assert!(ended.as_ref().is_err_and(|end| end.contains("--request-body-timeout-secs")), "{ended:?}");
    assert!(took >= Duration::from_millis(800), "ended after {took:?}");
    assert!(server.healthy());
}

/// A request without a known token is refused before its body is read: the
/// server read whole bodies (up to --max-request-bytes each) before its
/// handler looked at the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_known_token_is_refused_before_its_body_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[("LOAM_JOBS_TOKENS", "alpha-token-0123456789=alpha")]);
    let declared = 50_000_000;

    // Connect over HTTP/1.1: 1 KB of a 50 MB body, then nothing.
    for auth in ["", "Authorization: Bearer not-a-known-token-at-all\r\n"] {
        let mut conn = connect(&server);
        let head = format!(
            "POST /loam.jobs.v1.JobsService/Enqueue HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             {auth}Content-Length: {declared}\r\n\r\n"
        );
        conn.write_all(head.as_bytes()).unwrap();
        conn.write_all(&[b' '; 1024]).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 2048];
        let n = conn.read(&mut buf).unwrap();
        let answer = String::from_utf8_lossy(&buf[..n]);
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
        assert!(answer.contains("\"unauthenticated\""), "{answer}");
    }

    // gRPC over HTTP/2: the first piece of a large message, the stream left open.
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", server.port)).await.unwrap();
    let (mut h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let request = http::Request::post(format!("{}/loam.jobs.v1.JobsService/Enqueue", server.url()))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut sending) = h2.send_request(request, false).unwrap();
    let mut first = vec![0u8];
    first.extend_from_slice(&u32::try_from(declared).unwrap().to_be_bytes());
    first.extend_from_slice(&[0u8; 1024]);
    sending.send_data(first.into(), false).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(5), response).await.unwrap().unwrap();
    let status = |headers: &http::HeaderMap| headers.get("grpc-status").map(|v| v.to_str().unwrap().to_owned());
    let mut status_seen = status(response.headers());
    let mut body = response.into_body();
    while status_seen.is_none() {
        if tokio::time::timeout(Duration::from_secs(5), body.data()).await.unwrap().is_none() {
            status_seen =
                status(&tokio::time::timeout(Duration::from_secs(5), body.trailers()).await.unwrap().unwrap().unwrap());
        }
    }
    // 16: UNAUTHENTICATED.
    assert_eq!(status_seen.as_deref(), Some("16"));

    // A known token's request is read as before.
    let c = server.client_with(&[("authorization", "Bearer alpha-token-0123456789")]);
    c.enqueue(enqueue_req("mail", job("send", b"{}"))).await.unwrap();
}

/// A stream the server stops reading (a Session whose client reads no
/// answers) must not take its connection's whole flow-control window: it did
/// (both were hyper's 1 MiB), and every other call on the connection could
/// send nothing more, until the request-body timeout cut it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_server_stops_reading_leaves_room_for_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--request-body-timeout-secs", "1"], &[]);
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", server.port)).await.unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut h2 = h2.ready().await.unwrap();
    let post = |method: &str, content_type: &str| {
        http::Request::post(format!("{}/loam.jobs.v1.JobsService/{method}", server.url()))
            .header("content-type", content_type)
            .body(())
            .unwrap()
    };
    // Calls of 1 KB each, 6 MiB in all, on a session whose answers are never read: the
    // server stops reading them once its answers fill the client's window.
    let (_unread, mut session) = h2.send_request(post("Session", "application/connect+proto"), false).unwrap();
    for id in 1..=6_000u64 {
        let call = oneof::session_request::Call::from(enqueue_req("stalled", job("x", &[b'1'; 1024])));
        let message = buffa::Message::encode_to_vec(&pb::SessionRequest { id, call: Some(call), ..Default::default() });
        session.send_data(envelope(&message).into(), false).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;

    // Another call on the same connection still gets its body through.
    let mut h2 = h2.ready().await.unwrap();
    let (response, mut sending) = h2.send_request(post("Enqueue", "application/proto"), false).unwrap();
    let message = buffa::Message::encode_to_vec(&enqueue_req("other", job("y", b"{}")));
    sending.send_data(message.into(), true).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), response).await.unwrap().unwrap();
    assert_eq!(response.status(), 200);
    let c = server.client();
    assert_eq!(counts(&c, "other", &["waiting"]).await, vec![1]);
}
