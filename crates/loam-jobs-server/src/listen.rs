//! The accept loop: HTTP/1.1 and h2c on one port, each connection served
//! until a graceful shutdown asks it to finish. It replaces axum's `serve`
//! only to set HTTP/2's concurrent-stream limit: hyper's default (200) is
//! below what one client multiplexing many long-polls and workers can use,
//! and a client that goes over it gets its connection closed.

use std::future::Future;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// Serves `app` on `listener` until `stop` resolves, then waits up to
/// `grace` for open connections to finish their calls. Returns whether they
/// all did.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    max_streams: u32,
    stop: impl Future<Output = ()>,
    grace: Duration,
) -> bool {
    let mut builder = Builder::new(TokioExecutor::new());
    builder.http2().max_concurrent_streams(max_streams);
    let graceful = GracefulShutdown::new();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // Small replies must not wait for Nagle's algorithm.
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(error = %e, "TCP_NODELAY not set");
                }
                let service = TowerToHyperService::new(app.clone());
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
