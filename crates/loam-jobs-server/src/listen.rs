//! The accept loop: HTTP/1.1 and h2c on one port, each connection served
//! until it ends, falls idle, or a graceful shutdown asks it to finish. It
//! replaces axum's `serve` to:
//! - set HTTP/2's concurrent-stream limit (hyper's default, 200, is below what
//!   one client multiplexing many long-polls and workers can use, and a client
//!   that goes over it gets its connection closed);
//! - probe silent connections: a peer gone without a FIN or RST otherwise keeps
//!   its calls, and a long-poll among them could take a job for it, until the
//!   job's lock expires;
//! - bound what connections that make no calls can hold. Without it, a client
//!   that opened connections and sent nothing (or half a request) kept each open
//!   for ever, and a few thousand of them took every file descriptor and made
//!   the server unreachable.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use socket2::{SockRef, TcpKeepalive};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};

use crate::auth::Auth;
use crate::request_body::{self, RequestBody, TimedBody};

/// How silent connections are probed: after `idle` without a frame, an HTTP/2
/// connection gets a PING that must be answered within `timeout`, and an
/// HTTP/1.1 one TCP keepalive probes that give up after about as long.
#[derive(Clone, Copy, Debug)]
pub struct Probing {
    pub idle: Duration,
    pub timeout: Duration,
}

/// What a client may send on one HTTP/2 stream before the server reads it
/// (hyper's default).
const STREAM_WINDOW: u32 = 1 << 20;
/// What it may send on all of a connection's streams together: room for a few
/// streams the server is not reading. With hyper's default, the stream
/// window's size, one stream the server stopped reading (a Session waiting
/// for request budget, or one whose client reads no answers) took the whole
/// connection's window, and every other call on it could send nothing more,
/// until `--request-body-timeout-secs` cut it.
const CONNECTION_WINDOW: u32 = 4 * STREAM_WINDOW;

/// TCP keepalive probes a silent connection gets before the kernel drops it.
const TCP_PROBES: u32 = 3;

impl Probing {
    fn tcp(&self) -> TcpKeepalive {
        let between = (self.timeout / TCP_PROBES).max(Duration::from_secs(1));
        TcpKeepalive::new().with_time(self.idle).with_interval(between).with_retries(TCP_PROBES)
    }
}

/// What the accept loop allows each connection, and all of them together.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Calls one HTTP/2 connection may have in flight.
    pub max_streams: u32,
    /// Connections open at once; one more is closed as soon as it is accepted.
    pub max_connections: usize,
    /// A new connection's first call must start within this.
    pub first_call_within: Duration,
    /// A connection with no call in flight for this long is closed (HTTP/2
    /// with a GOAWAY, which clients answer by opening a new one).
    pub idle: Option<Duration>,
    /// A request whose body sends nothing for this long, while the server
    /// waits for the rest of it, fails (`request_body`).
    pub request_body_within: Option<Duration>,
    pub probing: Option<Probing>,
}

/// Serves `app` on `listener` until `stop` resolves, then waits up to
/// `grace` for open connections to finish their calls. Returns whether they
/// all did.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    auth: Auth,
    limits: ConnectionLimits,
    stop: impl Future<Output = ()>,
    grace: Duration,
) -> bool {
    let auth = Arc::new(auth);
    let mut builder = Builder::new(TokioExecutor::new());
    // hyper times every request head with this, the wait for the next one on
    // a kept-alive connection too: the idle timeout's length, not the first
    // call's (which `Activity::idle` enforces, for both protocols).
    let head_within = limits.idle.map(|idle| idle.max(limits.first_call_within));
    builder.http1().timer(TokioTimer::new()).header_read_timeout(head_within);
    builder
        .http2()
        .max_concurrent_streams(limits.max_streams)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW);
    if let Some(p) = limits.probing {
        builder.http2().timer(TokioTimer::new()).keep_alive_interval(p.idle).keep_alive_timeout(p.timeout);
    }
    let open = Arc::new(Semaphore::new(limits.max_connections.clamp(1, Semaphore::MAX_PERMITS)));
    // Each connection holds a receiver: `closed()` is when every one has ended.
    let (stopping, stop_seen) = watch::channel(false);
    let mut refused = Refusals::default();
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
                let Ok(slot) = Arc::clone(&open).try_acquire_owned() else {
                    // Closed at once, so the client hears it rather than waiting in the backlog.
                    drop(stream);
                    refused.count(limits.max_connections);
                    continue;
                };
                tune(&stream, limits.probing);
                let activity = Arc::new(Activity::new());
                // The connection's address, for calls that record who made them (`RequestContext::peer_addr`).
                let app = app.clone().layer(axum::Extension(connectrpc::PeerAddr(peer)));
                let service = Counted {
                    inner: TowerToHyperService::new(app),
                    activity: Arc::clone(&activity),
                    body_within: limits.request_body_within,
                    auth: Arc::clone(&auth),
                };
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
                let stop_seen = stop_seen.clone();
                tokio::spawn(async move {
                    drive(conn, &activity, limits, stop_seen).await;
                    drop(slot);
                });
            }
            () = &mut stop => break,
        }
    }
    // New connections are refused from here on.
    drop(listener);
    drop(stop_seen);
    let _ = stopping.send(true);
    tokio::time::timeout(grace, stopping.closed()).await.is_ok()
}

/// One accepted connection, served over either protocol.
type Connection = hyper_util::server::conn::auto::UpgradeableConnection<
    'static,
    TokioIo<TcpStream>,
    Counted<TowerToHyperService<axum::Router>>,
    TokioExecutor,
>;

/// Serves one connection to its end. It is asked to finish (a GOAWAY for
/// HTTP/2; HTTP/1.1 closes after the call under way) when the server stops or
/// when it has been idle too long, and then ends once its calls have. One
/// that has not ended `first_call_within` later is dropped once it has no
/// call in flight: HTTP/2's graceful close waits for the client to answer
/// a PING, which a client that sends nothing never does.
async fn drive(conn: Connection, activity: &Activity, limits: ConnectionLimits, mut stop: watch::Receiver<bool>) {
    tokio::pin!(conn);
    // Set once the connection was asked to finish.
    let mut drop_at: Option<tokio::time::Instant> = None;
    loop {
        let dropping = async {
            match drop_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = stop.changed(), if drop_at.is_none() => {
                conn.as_mut().graceful_shutdown();
                drop_at = Some(tokio::time::Instant::now() + limits.first_call_within);
            }
            () = activity.idle(limits.first_call_within, limits.idle), if drop_at.is_none() => {
                tracing::debug!("closing an idle connection");
                conn.as_mut().graceful_shutdown();
                drop_at = Some(tokio::time::Instant::now() + limits.first_call_within);
            }
            () = dropping => {
                if activity.in_flight.load(Ordering::Acquire) == 0 {
                    return;
                }
                drop_at = Some(tokio::time::Instant::now() + limits.first_call_within);
            }
        }
    }
}

/// Calls under way on one connection, and when its last call ended.
struct Activity {
    opened: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds from `opened` to the end of the latest call.
    quiet_since_ms: AtomicU64,
    called: AtomicBool,
}

impl Activity {
    fn new() -> Self {
        Self {
            opened: Instant::now(),
            in_flight: AtomicUsize::new(0),
            quiet_since_ms: AtomicU64::new(0),
            called: AtomicBool::new(false),
        }
    }

    fn begin(self: &Arc<Self>) -> Call {
        self.called.store(true, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Call(Arc::clone(self))
    }

    /// Resolves once the connection has had no call in flight for `idle`
    /// (for `first_call` before its first call). Checked at the deadlines
    /// only, so a call costs two atomic updates and a clock read.
    async fn idle(&self, first_call: Duration, idle: Option<Duration>) {
        loop {
            let called = self.called.load(Ordering::Acquire);
            let limit = if called {
                match idle {
                    Some(limit) => limit,
                    None => return std::future::pending().await,
                }
            } else {
                first_call
            };
            let now = self.opened.elapsed();
            let due = if self.in_flight.load(Ordering::Acquire) == 0 {
                let quiet_since = Duration::from_millis(self.quiet_since_ms.load(Ordering::Acquire));
                if now >= quiet_since + limit {
                    return;
                }
                quiet_since + limit
            } else {
                now + limit
            };
            // Before the first call, also look again within the idle limit: a
            // first call made meanwhile switches to it, and a check only at
            // the first call's deadline closed a connection whose first call
            // had ended long before that at the later of the two.
            let look_again = if called { due } else { due.min(now + idle.unwrap_or(first_call)) };
            tokio::time::sleep_until((self.opened + look_again).into()).await;
        }
    }
}

/// One call in flight, from its request until its response body has ended
/// (a Watch or a server stream is a call for as long as it streams).
struct Call(Arc<Activity>);

impl Drop for Call {
    fn drop(&mut self) {
        let a = &self.0;
        let ms = u64::try_from(a.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        // The time first, so a check that sees no call in flight sees this end.
        a.quiet_since_ms.fetch_max(ms, Ordering::AcqRel);
        a.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The connection's service, counting its calls into `activity`, timing
/// their request bodies, and reading none of a request without a known token
/// (`request_body`).
#[derive(Clone)]
struct Counted<S> {
    inner: S,
    activity: Arc<Activity>,
    body_within: Option<Duration>,
    auth: Arc<Auth>,
}

/// The path prefix of the RPCs (the rest, `/metrics` and `/healthz`, have no body).
const RPC_PATHS: &str = "/loam.jobs.v1.";

impl<S, B> hyper::service::Service<http::Request<Incoming>> for Counted<S>
where
    S: hyper::service::Service<http::Request<RequestBody<Incoming>>, Response = http::Response<B>>,
{
    type Response = http::Response<CountedBody<B>>;
    type Error = S::Error;
    type Future = CountedFuture<S::Future>;

    fn call(&self, req: http::Request<Incoming>) -> Self::Future {
        let call = Some(self.activity.begin());
        let (mut parts, body) = req.into_parts();
        let body = if parts.uri.path().starts_with(RPC_PATHS) && !self.auth.knows_caller(&parts.headers) {
            RequestBody::Stub { message: Some(request_body::stub(&mut parts.headers)) }
        } else {
            RequestBody::Read { body: TimedBody::new(body, parts.uri.path(), self.body_within) }
        };
        CountedFuture { inner: self.inner.call(http::Request::from_parts(parts, body)), call }
    }
}

pin_project_lite::pin_project! {
    /// A call's response on its way: the call moves into its body.
    struct CountedFuture<F> {
        #[pin]
        inner: F,
        call: Option<Call>,
    }
}

impl<F, B, E> Future for CountedFuture<F>
where
    F: Future<Output = Result<http::Response<B>, E>>,
{
    type Output = Result<http::Response<CountedBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let me = self.project();
        let response = std::task::ready!(me.inner.poll(cx));
        let call = me.call.take();
        Poll::Ready(response.map(|r| r.map(|body| CountedBody { inner: body, _call: call })))
    }
}

pin_project_lite::pin_project! {
    /// A response body that holds its call until it is dropped.
    struct CountedBody<B> {
        #[pin]
        inner: B,
        _call: Option<Call>,
    }
}

impl<B: Body> Body for CountedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Connections refused over the limit, logged at most every ten seconds.
#[derive(Default)]
struct Refusals {
    since_logged: u64,
    logged_at: Option<Instant>,
}

impl Refusals {
    fn count(&mut self, max_connections: usize) {
        self.since_logged += 1;
        if self.logged_at.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
            tracing::warn!(
                refused = self.since_logged,
                max_connections,
                "connections refused: as many as --max-connections are open"
            );
            self.since_logged = 0;
            self.logged_at = Some(Instant::now());
        }
    }
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

/// Raises this process's open-file limit to its hard limit, as a server that
/// holds a descriptor per connection should, and returns the limit now in
/// force (None where it cannot be read).
pub fn raise_open_file_limit() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if let (Some(current), Some(hard)) = (limit.current, limit.maximum)
        && current < hard
    {
        let raised = rustix::process::Rlimit { current: Some(hard), maximum: Some(hard) };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => limit.current = Some(hard),
            Err(e) => tracing::debug!(error = %e, "open-file limit not raised"),
        }
    }
    limit.current
}
