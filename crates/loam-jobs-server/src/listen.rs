//! The accept loop: HTTP/1.1 and h2c on one port, each connection served
//! until a graceful shutdown asks it to finish. It replaces axum's `serve` to
//! set HTTP/2's concurrent-stream limit (hyper's default, 200, is below what
//! one client multiplexing many long-polls and workers can use, and a client
//! that goes over it gets its connection closed) and to probe silent
//! connections: a peer gone without a FIN or RST otherwise keeps its calls,
//! and a long-poll among them could take a job for it, until the job's lock
//! expires.

use std::future::Future;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use socket2::{SockRef, TcpKeepalive};
use tokio::net::{TcpListener, TcpStream};

/// How silent connections are probed: after `idle` without a frame, an HTTP/2
/// connection gets a PING that must be answered within `timeout`, and an
/// HTTP/1.1 one TCP keepalive probes that give up after about as long.
#[derive(Clone, Copy, Debug)]
pub struct Probing {
    pub idle: Duration,
    pub timeout: Duration,
}

/// TCP keepalive probes a silent connection gets before the kernel drops it.
const TCP_PROBES: u32 = 3;

impl Probing {
    fn tcp(&self) -> TcpKeepalive {
        let between = (self.timeout / TCP_PROBES).max(Duration::from_secs(1));
        TcpKeepalive::new().with_time(self.idle).with_interval(between).with_retries(TCP_PROBES)
    }
}

/// Serves `app` on `listener` until `stop` resolves, then waits up to
/// `grace` for open connections to finish their calls. Returns whether they
/// all did.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    max_streams: u32,
    probing: Option<Probing>,
    stop: impl Future<Output = ()>,
    grace: Duration,
) -> bool {
    let mut builder = Builder::new(TokioExecutor::new());
    builder.http2().max_concurrent_streams(max_streams);
    if let Some(p) = probing {
        builder.http2().timer(TokioTimer::new()).keep_alive_interval(p.idle).keep_alive_timeout(p.timeout);
    }
    let graceful = GracefulShutdown::new();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                tune(&stream, probing);
                // The connection's address, for calls that record who made them (`RequestContext::peer_addr`).
                let service = TowerToHyperService::new(app.clone().layer(axum::Extension(connectrpc::PeerAddr(peer))));
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                });
            }
            () = &mut stop => break,
        }
    }
    // New connections are refused from here on.
    drop(listener);
    tokio::time::timeout(grace, graceful.shutdown()).await.is_ok()
}

fn tune(stream: &TcpStream, probing: Option<Probing>) {
    // Small replies must not wait for Nagle's algorithm.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY not set");
    }
    if let Some(p) = probing
        && let Err(e) = SockRef::from(stream).set_tcp_keepalive(&p.tcp())
    {
        tracing::debug!(error = %e, "TCP keepalive not set");
    }
}
