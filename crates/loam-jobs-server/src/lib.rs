//! `loam-jobs serve`: the queue core behind loam.jobs.v1 (Connect, gRPC and
//! gRPC-Web on one port), with `/metrics` and `/healthz` beside it.
//!
//! One process owns the store. Calls resolve their namespace from the
//! bearer token (or a header on loopback without tokens), convert their
//! message and run one core operation; the core's errors become Connect
//! errors in one place (`errors`). Server-owned schedules tick in a
//! background task (`schedules`).

pub mod auth;
pub mod budget;
pub mod cli;
pub mod convert;
pub mod errors;
pub mod health;
pub mod listen;
pub mod metrics;
pub mod request_body;
pub mod schedules;
pub mod service;
pub mod session;
pub mod waits;

use std::sync::Arc;
use std::time::Duration;

use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use connectrpc::{ConnectRpcService, Limits};
use futures::FutureExt;
use loam_jobs::store::redb::{RedbOptions, RedbStore};
use loam_jobs::{Config, Durability, FollowingClock, Interrupt, Jobs, SystemClock};
use loam_jobs_proto::loam::jobs::v1::JobsServiceExt;

use crate::cli::{DurabilityArg, ServeArgs, StoreKind};
use crate::errors::ServerError;

/// Environment variable with extra `TOKEN=NAMESPACE` pairs.
pub const TOKENS_ENV: &str = "LOAM_JOBS_TOKENS";

/// Opens the store, serves until SIGTERM or Ctrl-C, then shuts down cleanly.
pub async fn serve(args: ServeArgs) -> Result<(), ServerError> {
    let env_tokens = std::env::var(TOKENS_ENV).ok().filter(|t| !t.trim().is_empty());
    let auth = auth::Auth::load(args.tokens.as_deref(), env_tokens.as_deref())?;
    if !args.listen.ip().is_loopback() && !auth.is_on() {
        return Err(ServerError::Config(format!(
            "refusing to listen on {} without token authentication: anyone who can reach it could add and take jobs. \
             Configure --tokens FILE or {TOKENS_ENV}, or listen on a loopback address",
            args.listen
        )));
    }
    if args.follow_client_clock && auth.is_on() {
        return Err(ServerError::Config(
            "--follow-client-clock with token authentication would let one namespace's callers move the clock of \
             every other's (their delays, leases, schedules): it is for test suites that fake time, on a server of \
             their own"
                .into(),
        ));
    }
    if args.max_request_bytes < 1024 {
        return Err(ServerError::Config("--max-request-bytes must be at least 1024".into()));
    }
    // A job carries its data and its return value, each up to the payload
    // limit, and the encoding adds its framing.
    let fits_a_job = args.max_payload_bytes.saturating_mul(2).saturating_add(RESPONSE_FRAMING_BYTES);
    if args.max_response_bytes < fits_a_job {
        return Err(ServerError::Config(format!(
            "--max-response-bytes must be at least twice --max-payload-bytes and 64 KiB more ({fits_a_job}): a job \
             it could not answer would be refused for ever"
        )));
    }
    if args.max_request_bytes_in_flight < 1024 {
        return Err(ServerError::Config("--max-request-bytes-in-flight must be at least 1024".into()));
    }
    let durability = match args.durability {
        DurabilityArg::Immediate => Durability::Immediate,
        DurabilityArg::Relaxed => Durability::relaxed(args.flush_interval_ms),
    };
    let config = Config { max_payload_bytes: args.max_payload_bytes, durability, ..Config::default() };
    std::fs::create_dir_all(&args.data_dir)
        .map_err(|e| ServerError::Config(format!("cannot create {}: {e}", args.data_dir.display())))?;
    let path = match args.store {
        StoreKind::Redb => args.data_dir.join("jobs.redb"),
    };
    let following = args.follow_client_clock.then(|| Arc::new(FollowingClock::new()));
    // Said before and timed: an open after a crash replays the log (and, on a
    // file an older build left after a crash, redb walks all of it), which
    // can take a while.
    tracing::info!(store = %path.display(), "opening the store");
    let opening = std::time::Instant::now();
    let jobs = {
        let (path, following) = (path.clone(), following.clone());
        tokio::task::spawn_blocking(move || open_store(&path, config, following))
            .await
            .map_err(|e| ServerError::Config(format!("opening the store panicked: {e}")))??
    };
    let store_open_ms = u64::try_from(opening.elapsed().as_millis()).unwrap_or(u64::MAX);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|source| ServerError::Listen { addr: args.listen, source })?;
    let local = listener.local_addr().map_err(ServerError::Serve)?;

    let metrics = Arc::new(metrics::Metrics::new());
    let waiting_room = args.max_request_bytes_waiting.unwrap_or(args.max_request_bytes_in_flight);
    let budget = metrics.request_budget(args.max_request_bytes_in_flight, waiting_room);
    let shutdown = Interrupt::new();
    let index = Arc::new(schedules::Index::default());
    let found = index.load(&jobs)?;
    let svc = service::JobsSvc::new(
        jobs.clone(),
        auth.clone(),
        Arc::clone(&metrics),
        shutdown.clone(),
        Arc::clone(&index),
        budget,
    )
    .following(following)
    .max_response_bytes(args.max_response_bytes)
    .max_waiting_calls_per_namespace(args.max_waiting_calls_per_namespace);
    let router = Arc::new(svc).register(connectrpc::Router::new());
    let limits = Limits::default()
        .with_max_request_body_size(args.max_request_bytes)
        .with_max_message_size(args.max_request_bytes);
    let rpc = ConnectRpcService::new(router).with_limits(limits);

    let scrape = {
        let (jobs, metrics, auth) = (jobs.clone(), Arc::clone(&metrics), auth.clone());
        move |headers: axum::http::HeaderMap| {
            let (jobs, metrics) = (jobs.clone(), Arc::clone(&metrics));
            // With tokens, a scrape needs one too and sees only its namespace's series.
            let only = if auth.is_on() {
                match auth.namespace(&headers) {
                    Ok(ns) => Some(ns),
                    Err(e) => return std::future::ready(e.http_status().into_response()).boxed(),
                }
            } else {
                None
            };
            async move {
                let render = move || {
                    let text = metrics.render(&jobs, only.as_deref());
                    match only {
                        Some(ns) => metrics::only_namespace(&text, &ns),
                        None => text,
                    }
                };
                match tokio::task::spawn_blocking(render).await {
                    Ok(text) => {
                        ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text)
                            .into_response()
                    }
                    Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                }
            }
            .boxed()
        }
    };
    let health = {
        let health = Arc::new(health::Health::new(jobs.clone()));
        move || std::future::ready(health.check().into_response())
    };
    let app = axum::Router::new().route("/metrics", get(scrape)).route("/healthz", get(health)).fallback_service(rpc);

    let ticker = tokio::spawn(schedules::run(jobs.clone(), index, Arc::clone(&metrics), shutdown.clone()));
    let purger = tokio::spawn(service::purge_expired(jobs.clone(), shutdown.clone()));
    tracing::info!(
        listen = %local,
        store = %path.display(),
        store_open_ms,
        auth = auth.is_on(),
        server_schedules = found,
        "loam-jobs serving loam.jobs.v1 (Connect, gRPC, gRPC-Web), /metrics and /healthz"
    );

    let stopping = {
        let shutdown = shutdown.clone();
        async move {
            wait_for_signal().await;
            tracing::info!("shutting down: no new connections; ending long-polls and watches");
            // Long-polls and watches return now, so their calls can finish.
            shutdown.fire();
        }
    };
    let grace = Duration::from_secs(args.shutdown_grace_secs);
    let probing = (args.keepalive_secs > 0).then(|| listen::Probing {
        idle: Duration::from_secs(args.keepalive_secs),
        timeout: Duration::from_secs(args.keepalive_timeout_secs.max(1)),
    });
    let limits = listen::ConnectionLimits {
        max_streams: args.max_concurrent_streams,
        max_connections: connections_allowed(args.max_connections),
        first_call_within: Duration::from_secs(args.first_call_timeout_secs.max(1)),
        idle: (args.idle_timeout_secs > 0).then(|| Duration::from_secs(args.idle_timeout_secs)),
        request_body_within: (args.request_body_timeout_secs > 0)
            .then(|| Duration::from_secs(args.request_body_timeout_secs)),
        probing,
    };
    if !listen::serve(listener, app, auth, limits, stopping, grace).await {
        tracing::warn!(
            grace_secs = args.shutdown_grace_secs,
            "calls still in flight after the grace period; closing anyway"
        );
    }
    shutdown.fire();
    // Both end at `shutdown`, a write under way finishing first.
    let _ = ticker.await;
    let _ = purger.await;
    // Pending writes finish, the maintenance thread stops, the store closes.
    let closing = jobs.clone();
    let _ = tokio::task::spawn_blocking(move || closing.close()).await;
    tracing::info!("store closed; bye");
    Ok(())
}

/// Room for the rest of a job's record and the answer's framing, beside its
/// data and return value (see `--max-response-bytes`).
const RESPONSE_FRAMING_BYTES: usize = 64 << 10;

/// Descriptors kept for the store, the listener and the runtime, beside
/// one a connection.
const RESERVED_FILES: u64 = 64;

/// `asked` connections, or fewer if the open-file limit (raised to its hard
/// limit first) would run out before them.
fn connections_allowed(asked: usize) -> usize {
    let Some(files) = listen::raise_open_file_limit() else { return asked };
    let fit = usize::try_from(files.saturating_sub(RESERVED_FILES)).unwrap_or(usize::MAX).max(1);
    if fit < asked {
        tracing::warn!(
            max_connections = fit,
            asked,
            open_file_limit = files,
            "--max-connections lowered to what the open-file limit allows (raise it with ulimit -n)"
        );
    }
    asked.min(fit)
}

/// Opens the redb store. With a following clock, job times follow the
/// clients' `loam-now-ms` while leases keep real time (as Redis lock TTLs do).
fn open_store(
    path: &std::path::Path,
    config: Config,
    following: Option<Arc<FollowingClock>>,
) -> Result<Jobs, ServerError> {
    match following {
        None => Ok(Jobs::open(path, config)?),
        Some(clock) => {
            let store = RedbStore::open(path, RedbOptions { durability: config.durability, ..Default::default() })
                .map_err(loam_jobs::JobsError::from)?;
            Ok(Jobs::with_clocks(Box::new(store), clock, Arc::new(SystemClock), config)?)
        }
    }
}

async fn wait_for_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {},
                    () = ctrl_c => {},
                }
            }
            Err(_) => ctrl_c.await,
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await;
}
