//! The command line.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(name = "loam-jobs", version, about = "Loam Jobs: the queue core served over the network as loam.jobs.v1")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve loam.jobs.v1 (Connect, gRPC and gRPC-Web on one port), with
    /// /metrics (OpenMetrics text, which Prometheus reads) and /healthz on
    /// the same port.
    ///
    /// SIGTERM or Ctrl-C stops accepting connections, ends long-polls and
    /// watches, lets in-flight calls finish (up to --shutdown-grace-secs) and
    /// closes the store cleanly.
    Serve(ServeArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// One redb file, DATA_DIR/jobs.redb, owned by this process.
    Redb,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DurabilityArg {
    /// Every acknowledged write is fsynced first (group commit shares the fsync).
    Immediate,
    /// Writes are acknowledged before fsync and flushed every --flush-interval-ms;
    /// a crash can lose the last interval.
    Relaxed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address and port to listen on. An address other than loopback
    /// (127.0.0.0/8, ::1) is refused unless token authentication is
    /// configured (--tokens or LOAM_JOBS_TOKENS).
    #[arg(long, env = "LOAM_JOBS_LISTEN", default_value = "127.0.0.1:7720")]
    pub listen: SocketAddr,

    /// Directory of the store; created if missing. One process owns it at a time.
    #[arg(long, env = "LOAM_JOBS_DATA_DIR", default_value = ".loam")]
    pub data_dir: PathBuf,

    /// The store engine.
    #[arg(long, value_enum, default_value_t = StoreKind::Redb)]
    pub store: StoreKind,

    /// File of bearer tokens, one `TOKEN NAMESPACE` per line (`#` starts a
    /// comment; tokens are at least 16 characters). With tokens, every call
    /// needs `Authorization: Bearer TOKEN` and acts in the token's namespace
    /// only. More tokens can come from the LOAM_JOBS_TOKENS environment
    /// variable as `TOKEN=NAMESPACE` pairs separated by commas (split at the
    /// last `=`, so a token may end in base64 padding). Without any,
    /// calls name their namespace in the `loam-namespace` header (default
    /// `default`).
    #[arg(long, env = "LOAM_JOBS_TOKENS_FILE")]
    pub tokens: Option<PathBuf>,

    /// Largest job payload (data, options and headers together), result,
    /// result-store value, published event or queue-meta write, in bytes. A
    /// failure's message and stack trace are cut to it.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_payload_bytes: usize,

    /// Largest request body (one message, or one streamed message), in bytes.
    /// Larger requests are refused with resource_exhausted before they are decoded.
    #[arg(long, default_value_t = 80 << 20)]
    pub max_request_bytes: usize,

    /// Most bytes of requests the server works on at once, across every
    /// connection: a call takes its request's bytes before it starts and
    /// gives them back once it has answered. Past it, calls wait, their
    /// request read, while the calls under way finish; a request larger than
    /// this runs alone. The server's memory for requests is several times
    /// this figure (a payload is copied as it is decoded, converted and
    /// written).
    #[arg(long, default_value_t = 128 << 20)]
    pub max_request_bytes_in_flight: usize,

    /// Largest answer to a read (Query, ResultMGet), in bytes. A read whose
    /// answer would be larger (many large jobs at once) is refused with
    /// resource_exhausted: ask for fewer at a time; an event read or a lease
    /// is cut short instead. At least twice --max-payload-bytes plus 64 KiB
    /// (2 x 64 MiB + 64 KiB with the default --max-payload-bytes), so that
    /// any one job can be answered.
    #[arg(long, default_value_t = 256 << 20)]
    pub max_response_bytes: usize,

    /// Most bytes of requests read and waiting for --max-request-bytes-in-flight.
    /// Past it, a call is refused at once as unavailable (clients send it
    /// again after a pause). Defaults to --max-request-bytes-in-flight.
    #[arg(long)]
    pub max_request_bytes_waiting: Option<usize>,

    /// Most long-polls (leases, event reads, waits for a job that wait) and
    /// Watch streams one namespace may have open at once, across every
    /// connection. Past it one is refused as unavailable. Each long-poll holds
    /// a few KB while it waits, up to 30 s.
    #[arg(long, default_value_t = crate::waits::DEFAULT_MAX_PER_NAMESPACE)]
    pub max_waiting_calls_per_namespace: usize,

    /// Most calls one HTTP/2 connection may have in flight (long-polls and
    /// watches included). A client that opens more has its connection closed.
    #[arg(long, default_value_t = 1000)]
    pub max_concurrent_streams: u32,

    /// A connection silent this long is probed: HTTP/2 connections get a
    /// PING, HTTP/1.1 ones TCP keepalive probes. A client that went away
    /// without closing (a machine lost, a network cut) has its connection
    /// closed and its calls cancelled, so a long-poll of it takes no job.
    /// 0 turns probing off.
    #[arg(long, default_value_t = 30)]
    pub keepalive_secs: u64,

    /// How long a probed connection may stay silent before it is closed.
    #[arg(long, default_value_t = 20)]
    pub keepalive_timeout_secs: u64,

    /// Most connections open at once. One more is closed as soon as it is
    /// accepted. Lowered, with a warning, to what the open-file limit allows
    /// (the server raises its soft limit to the hard one at start).
    #[arg(long, default_value_t = 10_000)]
    pub max_connections: usize,

    /// A new connection must start its first call within this many seconds;
    /// a connection that sends nothing, or half a request, is closed.
    #[arg(long, default_value_t = 10)]
    pub first_call_timeout_secs: u64,

    /// A connection with no call in flight for this many seconds is closed
    /// (HTTP/2 with a GOAWAY; clients open a new connection for their next
    /// call), and an HTTP/1.1 request's head must arrive within it. A
    /// worker's connection always has its long-poll in flight. 0 keeps idle
    /// connections open.
    #[arg(long, default_value_t = 300)]
    pub idle_timeout_secs: u64,

    /// A request whose body sends nothing for this many seconds, while the
    /// server waits for the rest of it, fails and what was read of it is
    /// dropped; the clock starts again at each piece that arrives. A
    /// Session's stream may pause between its messages, not inside one.
    /// 0 waits for ever.
    #[arg(long, default_value_t = 30)]
    pub request_body_timeout_secs: u64,

    /// When writes are acknowledged.
    #[arg(long, value_enum, default_value_t = DurabilityArg::Immediate)]
    pub durability: DurabilityArg,

    /// With --durability relaxed: the longest time between flushes.
    #[arg(long, default_value_t = 100)]
    pub flush_interval_ms: u64,

    /// How long a graceful shutdown waits for in-flight calls before it
    /// closes the store anyway.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_secs: u64,

    /// Let the core's background clock (delayed-job wake-ups, long-poll waits) follow the
    /// `loam-now-ms` header of the latest call, as the in-process binding
    /// follows its host. For test suites that fake time (BullMQ's); not for
    /// a server shared by clients whose clocks disagree (refused with
    /// token authentication, where it would let one namespace move every
    /// namespace's clock).
    #[arg(long)]
    pub follow_client_clock: bool,

    /// Log format on stderr. The level comes from RUST_LOG (default `info`).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}
