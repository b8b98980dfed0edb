//! Connections whose client went away without closing them: probed, closed,
//! and their calls cancelled.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

mod support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use connectrpc::client::{ClientConfig, HttpClient};
use support::*;

/// One connection passed through to the server until `freeze`: from then on
/// no byte crosses either way, as when the client's machine is gone, while
/// the proxy still reads the server's side to see it closed.
struct FreezingProxy {
    port: u16,
    frozen: Arc<AtomicBool>,
    server_closed: Arc<AtomicBool>,
}

impl FreezingProxy {
    fn to(server_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let frozen = Arc::new(AtomicBool::new(false));
        let server_closed = Arc::new(AtomicBool::new(false));
        let (f, closed) = (Arc::clone(&frozen), Arc::clone(&server_closed));
        std::thread::spawn(move || {
            let (client, _) = listener.accept().unwrap();
            let server = TcpStream::connect(("127.0.0.1", server_port)).unwrap();
            let (client_in, server_out) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            let f_up = Arc::clone(&f);
            std::thread::spawn(move || pass(client_in, server_out, &f_up, None));
            pass(server, client, &f, Some(&closed));
        });
        Self { port, frozen, server_closed }
    }

    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to` until `from` ends; frozen, it reads and drops.
fn pass(mut from: TcpStream, mut to: TcpStream, frozen: &AtomicBool, ended: Option<&AtomicBool>) {
    let mut buf = [0u8; 16 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) if !frozen.load(Ordering::SeqCst) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Ok(_) => {}
        }
    }
    if let Some(ended) = ended {
        ended.store(true, Ordering::SeqCst);
    }
    if !frozen.load(Ordering::SeqCst) {
        let _ = to.shutdown(Shutdown::Write);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_clients_connection_is_closed_and_its_long_poll_takes_no_job() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--keepalive-secs", "1", "--keepalive-timeout-secs", "1"], &[]);
    let proxy = FreezingProxy::to(server.port);
    let gone = pb::JobsServiceClient::new(
        HttpClient::plaintext_http2_only(),
        ClientConfig::new(format!("http://127.0.0.1:{}", proxy.port).parse().unwrap()),
    );
    // A worker's long-poll, then its machine goes away.
    let waiting = tokio::spawn(async move { gone.lease(lease_req("mail", 1, 30_000, 60_000)).await.map(drop) });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "the long-poll is waiting");
    proxy.freeze();

    let frozen_at = Instant::now();
    while !proxy.server_closed.load(Ordering::SeqCst) {
        assert!(
            frozen_at.elapsed() < Duration::from_secs(15),
            "the server still holds a connection silent for 15 s (keepalive 1 s, timeout 1 s)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Its long-poll went with it: a job added now goes to a live worker.
    let c = server.client();
    c.enqueue(enqueue_req("mail", job("send", b"{}"))).await.unwrap();
    let leased = c.lease(lease_req("mail", 1, 2_000, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    assert_eq!(leased.leases.len(), 1, "the vanished worker's long-poll took the job");
    waiting.abort();
}

/// HTTP/1.1 calls get TCP keepalive instead: the kernel's probes, which a
/// vanished peer leaves unanswered. Read back from /proc/net/tcp, where an
/// idle socket with keepalive on has its keepalive timer (2) running.
#[cfg(target_os = "linux")]
#[test]
fn http1_connections_get_tcp_keepalive() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let mut conn = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut buf = [0u8; 256];
    assert!(conn.read(&mut buf).unwrap() > 0);
    let client_port = conn.local_addr().unwrap().port();
    let timer_of_servers_side = || {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        table.lines().skip(1).find_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next().unwrap(), 16).unwrap();
            (port(f[1]) == server.port && port(f[2]) == client_port).then(|| f[5].split(':').next().unwrap().to_owned())
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let timer = timer_of_servers_side().expect("the server's side of the connection is in /proc/net/tcp");
        if timer == "02" {
            break;
        }
        assert!(Instant::now() < deadline, "no keepalive timer on the server's socket (timer {timer})");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(conn);
}
