//! Starts the real `loam-jobs` binary on a free loopback port and talks to
//! it with the generated client and with raw HTTP.

#![allow(dead_code, reason = "each test file uses part of the support")]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use buffa::Message as _;
use connectrpc::client::{ClientConfig, HttpClient};
use connectrpc::{ConnectError, ErrorCode};
pub use loam_jobs_proto::loam::jobs::v1 as pb;
pub use pb::__buffa::oneof;

pub type Client = pb::JobsServiceClient<HttpClient>;

pub struct Server {
    pub child: Option<Child>,
    pub port: u16,
    pub dir: PathBuf,
    pub log: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap()
}

impl Server {
    /// Starts a server on `dir` with extra flags and environment.
    pub fn start_in(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut s = Server {
            child: None,
            port: free_port(),
            dir: dir.to_path_buf(),
            log: dir.join(format!("server-{}.log", std::process::id())),
            args: args.iter().map(|a| a.to_string()).collect(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_loam-jobs"));
        cmd.arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--data-dir")
            .arg(self.dir.join("data"))
            .args(&self.args)
            .env_remove("LOAM_JOBS_TOKENS")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn().unwrap());
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok((200, _)) = self.http("GET", "/healthz", "", b"") {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("server did not start; log:\n{}", self.log_text());
    }

    pub fn restart(&mut self) {
        self.spawn();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A client with the given extra headers on every call.
    pub fn client_with(&self, headers: &[(&'static str, &str)]) -> Client {
        let mut config = ClientConfig::new(self.url().parse().unwrap());
        for (k, v) in headers {
            config = config.with_default_header(*k, v.to_string());
        }
        pb::JobsServiceClient::new(HttpClient::plaintext(), config)
    }

    pub fn client(&self) -> Client {
        self.client_with(&[])
    }

    /// SIGKILL: no chance to clean up.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits up to `within` for the process to exit.
    pub fn terminate(&mut self, within: Duration) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        let _ = Command::new("kill").arg("-TERM").arg(c.id().to_string()).status();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = c.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }

    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// One HTTP/1.1 request on a fresh connection: (status, body).
    pub fn http(&self, method: &str, path: &str, content_type: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        self.http_with(method, path, &[], content_type, body)
    }

    /// [`Server::http`] with extra request headers.
    pub fn http_with(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        content_type: &str,
        body: &[u8],
    ) -> std::io::Result<(u16, Vec<u8>)> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        if !content_type.is_empty() {
            head.push_str(&format!("Content-Type: {content_type}\r\n"));
        }
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes())?;
        s.write_all(body)?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        let text_end = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(out.len());
        let head = String::from_utf8_lossy(&out[..text_end]).to_string();
        let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let mut body = out.get(text_end + 4..).unwrap_or(&[]).to_vec();
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
            body = dechunk(&body);
        }
        Ok((status, body))
    }

    /// `/metrics`, as text.
    pub fn metrics(&self) -> String {
        let (status, body) = self.http("GET", "/metrics", "", b"").unwrap();
        assert_eq!(status, 200);
        String::from_utf8(body).unwrap()
    }

    pub fn healthy(&self) -> bool {
        matches!(self.http("GET", "/healthz", "", b""), Ok((200, _)))
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else { return out };
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 {
            return out;
        }
        let start = eol + 2;
        out.extend_from_slice(&b[start..start + size]);
        b = &b[start + size + 2..];
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The loam.jobs.v1.ErrorDetail of an error.
pub fn detail(e: &ConnectError) -> pb::ErrorDetail {
    let d = e.details.iter().find(|d| d.type_url.ends_with("loam.jobs.v1.ErrorDetail")).expect("an ErrorDetail");
    let raw = d.value.as_deref().unwrap_or("");
    let bytes =
        base64::engine::general_purpose::STANDARD_NO_PAD.decode(raw.trim_end_matches('=')).expect("base64 detail");
    pb::ErrorDetail::decode_from_slice(&bytes).expect("ErrorDetail")
}

/// Asserts a call failed with `code` (and, when given, the detail reason).
pub fn assert_code<T>(r: Result<T, ConnectError>, code: ErrorCode, reason: Option<&str>) -> ConnectError {
    let e = match r {
        Ok(_) => panic!("expected {code:?}, the call succeeded"),
        Err(e) => e,
    };
    assert_eq!(e.code, code, "{e:?}");
    if let Some(reason) = reason {
        assert_eq!(detail(&e).reason, reason, "{e:?}");
    }
    e
}

/// The Connect envelope of `message`, as a stream carries it: a flags byte,
/// its length, itself.
pub fn envelope(message: &[u8]) -> Vec<u8> {
    let mut framed = vec![0];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(message);
    framed
}

pub fn job(name: &str, data: &[u8]) -> pb::JobSpec {
    pb::JobSpec { name: name.into(), data: data.to_vec(), attempts: 1, ..Default::default() }
}

pub fn queue_admin_req(queue: &str, op: impl Into<oneof::queue_admin_request::Op>) -> pb::QueueAdminRequest {
    pb::QueueAdminRequest { queue: queue.into(), op: Some(op.into()), ..Default::default() }
}

pub fn enqueue_req(queue: &str, job: pb::JobSpec) -> pb::EnqueueRequest {
    pb::EnqueueRequest { queue: queue.into(), job: job.into(), ..Default::default() }
}

pub fn lease_req(queue: &str, max: u32, wait_ms: u32, lock_ms: u64) -> pb::LeaseRequest {
    pb::LeaseRequest {
        queue: queue.into(),
        options: pb::LeaseOptions { max, lock_duration_ms: lock_ms, ..Default::default() }.into(),
        wait_ms,
        ..Default::default()
    }
}

pub fn epoch(e: u64) -> pb::Fence {
    pb::Fence { kind: Some(oneof::fence::Kind::Epoch(e)), ..Default::default() }
}

pub fn success(result: &[u8]) -> pb::Outcome {
    pb::Outcome::from_kind(pb::outcome::Success { result: Some(result.to_vec()), ..Default::default() })
}

pub fn complete_req(queue: &str, id: &str, fence: pb::Fence, outcome: pb::Outcome) -> pb::CompleteRequest {
    pb::CompleteRequest {
        queue: queue.into(),
        job_id: id.into(),
        fence: fence.into(),
        outcome: outcome.into(),
        ..Default::default()
    }
}

pub fn schedule_req(queue: &str, s: impl Into<oneof::schedule_request::Schedule>) -> pb::ScheduleRequest {
    pb::ScheduleRequest { queue: queue.into(), schedule: Some(s.into()), ..Default::default() }
}

pub fn query_req(queue: &str, q: oneof::query_request::Query) -> pb::QueryRequest {
    pb::QueryRequest { queue: queue.into(), query: Some(q), ..Default::default() }
}

pub trait OutcomeExt {
    fn from_kind(k: impl Into<oneof::outcome::Kind>) -> Self;
}

impl OutcomeExt for pb::Outcome {
    fn from_kind(k: impl Into<oneof::outcome::Kind>) -> Self {
        pb::Outcome { kind: Some(k.into()), ..Default::default() }
    }
}

pub async fn counts(c: &Client, queue: &str, types: &[&str]) -> Vec<u64> {
    let q = oneof::query_request::Query::from(pb::query_request::Counts {
        types: types.iter().map(|t| t.to_string()).collect(),
        ..Default::default()
    });
    match c.query(query_req(queue, q)).await.unwrap().into_owned().result {
        Some(oneof::query_response::Result::Counts(c)) => c.counts,
        other => panic!("unexpected {other:?}"),
    }
}

/// Every event of a queue from the start of its log.
pub async fn all_events(c: &Client, queue: &str) -> Vec<pb::Event> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let q = oneof::query_request::Query::from(pb::query_request::Events {
            after: Some(after),
            limit: 1000,
            wait_ms: 0,
            ..Default::default()
        });
        let batch = match c.query(query_req(queue, q)).await.unwrap().into_owned().result {
            Some(oneof::query_response::Result::Events(e)) => e.events,
            other => panic!("unexpected {other:?}"),
        };
        let Some(last) = batch.last() else { return out };
        after = last.seq;
        out.extend(batch);
    }
}

pub fn field<'a>(e: &'a pb::Event, key: &str) -> Option<&'a str> {
    e.fields.iter().find(|f| f.key == key).map(|f| f.value.as_str())
}

/// The next event of a watch, passing over its heartbeats (messages with no
/// event); `None` once the stream ended.
pub async fn next_event<B>(
    stream: &mut connectrpc::client::ServerStream<B, pb::__buffa::view::WatchResponseView<'static>>,
) -> Result<Option<pb::Event>, ConnectError>
where
    B: http_body::Body<Data = bytes::Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    while let Some(m) = stream.message::<pb::WatchResponse>().await? {
        if let Some(event) = m.to_owned_message().event.into_option() {
            return Ok(Some(event));
        }
    }
    Ok(None)
}

/// Opens a watch and reads its first message: a refused watch fails there
/// (the stream's headers are sent before the handler runs).
pub async fn watch_first(c: &Client, req: pb::WatchRequest) -> Result<(), connectrpc::ConnectError> {
    let mut stream = c.watch(req).await?;
    let first = tokio::time::timeout(std::time::Duration::from_secs(5), stream.message::<pb::WatchResponse>()).await;
    match first {
        Ok(r) => r.map(|_| ()),
        Err(_) => Ok(()),
    }
}
