//! The one place where the core's errors become Connect errors, each with an
//! [`ErrorDetail`] that names the reason and, where one applies, BullMQ's
//! error code, so a client can rebuild BullMQ's own errors without parsing
//! messages.

use connectrpc::{ConnectError, ErrorCode};
use loam_jobs::{FenceFailure, JobsError, Missing, Precondition};
use loam_jobs_proto::loam::jobs::v1 as pb;

/// Full name of the detail message, as Connect carries it.
pub(crate) const DETAIL_TYPE: &str = "loam.jobs.v1.ErrorDetail";

/// Failures of the server itself, before or after serving.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{0}")]
    Config(String),
    #[error("cannot read the tokens file {path}: {source}")]
    Tokens { path: String, source: std::io::Error },
    #[error("cannot open the store: {0}")]
    Store(#[from] JobsError),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: std::net::SocketAddr, source: std::io::Error },
    #[error("serving failed: {0}")]
    Serve(std::io::Error),
}

/// A stable, machine-readable name of the error, and what it is about.
fn reason(err: &JobsError) -> (&'static str, String) {
    match err {
        JobsError::InvalidArgument(_) => ("invalid_argument", String::new()),
        JobsError::NotFound(m) => match m {
            Missing::Job(id) => ("not_found.job", id.clone()),
            Missing::ParentJob(key) => ("not_found.parent_job", key.clone()),
            Missing::Queue(q) => ("not_found.queue", q.clone()),
            Missing::Scheduler(id) => ("not_found.scheduler", id.clone()),
        },
        JobsError::AlreadyExists { existing } => ("already_exists", existing.clone()),
        JobsError::IdempotencyConflict { key } => ("idempotency_conflict", key.clone()),
        JobsError::Fenced { job, reason: FenceFailure::NoLease, .. } => ("fenced.no_lease", job.clone()),
        JobsError::Fenced { job, reason: FenceFailure::Mismatch, .. } => ("fenced.mismatch", job.clone()),
        JobsError::Precondition(p) => match p {
            Precondition::NotInState { job, .. } => ("precondition.not_in_state", job.clone()),
            Precondition::PendingChildren { job } => ("precondition.pending_children", job.clone()),
            Precondition::FailedChildren { job } => ("precondition.failed_children", job.clone()),
            Precondition::ParentCannotBeReplaced { job } => ("precondition.parent_cannot_be_replaced", job.clone()),
            Precondition::BelongsToScheduler { job } => ("precondition.belongs_to_scheduler", job.clone()),
            Precondition::SchedulerIdCollision { scheduler } => {
                ("precondition.scheduler_id_collision", scheduler.clone())
            }
            Precondition::SchedulerSlotsBusy { scheduler } => ("precondition.scheduler_slots_busy", scheduler.clone()),
            Precondition::QueueNotPaused { queue } => ("precondition.queue_not_paused", queue.clone()),
            Precondition::QueueHasActiveJobs { queue } => ("precondition.queue_has_active_jobs", queue.clone()),
        },
        JobsError::QueuePaused(q) => ("queue_paused", q.clone()),
        JobsError::RateLimited { .. } => ("rate_limited", String::new()),
        JobsError::PayloadTooLarge { .. } => ("payload_too_large", String::new()),
        JobsError::Unavailable(_) => ("unavailable", String::new()),
        JobsError::DeadlineExceeded => ("deadline_exceeded", String::new()),
        JobsError::Internal(_) => ("internal", String::new()),
    }
}

/// The Connect code of the core's name for it ([`JobsError::connect_code`]),
/// which `every_connect_code_is_one_connectrpc_knows` checks.
fn code(err: &JobsError) -> ErrorCode {
    err.connect_code().parse().unwrap_or(ErrorCode::Internal)
}

/// The detail message of a core error.
pub fn detail(err: &JobsError) -> pb::ErrorDetail {
    let (reason, subject) = reason(err);
    let retry_after_ms = match err {
        JobsError::RateLimited { retry_after_ms } => *retry_after_ms,
        _ => 0,
    };
    pb::ErrorDetail {
        reason: reason.into(),
        bullmq_code: err.bullmq_code().map_or(0, |c| c as i32),
        subject,
        retry_after_ms,
        ..Default::default()
    }
}

/// A core error as the client sees it.
pub fn to_connect(err: &JobsError) -> ConnectError {
    if matches!(err, JobsError::Internal(_)) {
        tracing::error!(error = %err, "internal error");
    }
    let detail = detail(err);
    ConnectError::new(code(err), err.to_string())
        .with_detail(connectrpc::ErrorDetail::from_message(DETAIL_TYPE, &detail))
}

/// The Connect code name of a core error (for bulk results).
pub fn code_name(err: &JobsError) -> &'static str {
    err.connect_code()
}

/// A request the server refuses before it reaches the core.
pub fn invalid(msg: impl Into<String>) -> ConnectError {
    to_connect(&JobsError::InvalidArgument(msg.into()))
}

/// A caller without a valid credential.
pub fn unauthenticated(msg: &str) -> ConnectError {
    let detail = pb::ErrorDetail { reason: "unauthenticated".into(), ..Default::default() };
    ConnectError::new(ErrorCode::Unauthenticated, msg)
        .with_detail(connectrpc::ErrorDetail::from_message(DETAIL_TYPE, &detail))
}

/// A caller whose credential does not cover the namespace it named.
pub fn permission_denied(msg: &str) -> ConnectError {
    let detail = pb::ErrorDetail { reason: "permission_denied".into(), ..Default::default() };
    ConnectError::new(ErrorCode::PermissionDenied, msg)
        .with_detail(connectrpc::ErrorDetail::from_message(DETAIL_TYPE, &detail))
}

/// A call refused for want of memory to hold it: see [`crate::budget`].
/// `unavailable` with a pause, as a store that cannot take a call now
/// answers: clients send it again.
pub fn overloaded(o: &crate::budget::Overloaded) -> ConnectError {
    busy(
        format!(
            "the server is busy: calls holding {} bytes of requests already wait for --max-request-bytes-in-flight; \
             try again",
            o.waiting_bytes
        ),
        OVERLOADED_PAUSE_MS,
    )
}

/// A call refused for now: `unavailable`, asking for a pause of `pause_ms`
/// before it is sent again.
pub fn busy(message: String, pause_ms: u64) -> ConnectError {
    let detail = pb::ErrorDetail { reason: "unavailable".into(), retry_after_ms: pause_ms, ..Default::default() };
    ConnectError::new(ErrorCode::Unavailable, message)
        .with_detail(connectrpc::ErrorDetail::from_message(DETAIL_TYPE, &detail))
}

/// The pause an overloaded server asks for before a call is sent again.
const OVERLOADED_PAUSE_MS: u64 = 100;

/// A read whose answer, `used` bytes so far, is over `--max-response-bytes`.
pub fn response_too_large(cap: u64, used: u64) -> ConnectError {
    let detail = pb::ErrorDetail { reason: "response_too_large".into(), ..Default::default() };
    ConnectError::new(
        ErrorCode::ResourceExhausted,
        format!(
            "the answer is over --max-response-bytes ({cap} bytes, {used} so far): ask for fewer jobs or keys at a time"
        ),
    )
    .with_detail(connectrpc::ErrorDetail::from_message(DETAIL_TYPE, &detail))
}

/// A watch ended by the server's shutdown, as `unavailable`: a watch never
/// ends of itself, so a clean end would read as the queue's events being
/// over. `cursor` is where the client resumes.
pub fn shutting_down(cursor: u64) -> ConnectError {
    let detail = pb::ErrorDetail { reason: "unavailable".into(), ..Default::default() };
    ConnectError::new(ErrorCode::Unavailable, format!("the server is shutting down; resume after event {cursor}"))
        .with_detail(connectrpc::ErrorDetail::from_message(DETAIL_TYPE, &detail))
}

/// A watch cursor older than the oldest event the log still holds: the
/// events in between are gone, so the client must resynchronise.
pub fn events_trimmed(cursor: u64, oldest: u64) -> ConnectError {
    let detail = pb::ErrorDetail { reason: "events_trimmed".into(), subject: oldest.to_string(), ..Default::default() };
    ConnectError::new(
        ErrorCode::OutOfRange,
        format!("events after {cursor} were trimmed from the log; the oldest kept is {oldest}"),
    )
    .with_detail(connectrpc::ErrorDetail::from_message(DETAIL_TYPE, &detail))
}

/// A watch cursor past the newest event of the log: no event the server
/// wrote carries it (a queue's event numbers go on across an obliterate), so
/// waiting for it would skip every event up to it.
pub fn cursor_ahead(cursor: u64, newest: u64) -> ConnectError {
    let detail = pb::ErrorDetail { reason: "cursor_ahead".into(), subject: newest.to_string(), ..Default::default() };
    ConnectError::new(ErrorCode::OutOfRange, format!("cursor {cursor} is past the newest event, {newest}"))
        .with_detail(connectrpc::ErrorDetail::from_message(DETAIL_TYPE, &detail))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Clients match on `ErrorDetail.reason`; the proto's comment is where
    /// they learn the names, so it lists exactly those this module gives:
    /// the core errors' (`reason`) and the server's own (`reason: "..."`).
    #[test]
    fn the_proto_lists_every_reason() {
        let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let source = std::fs::read_to_string(manifest.join("src/errors.rs")).unwrap();
        let code = &source[..source.find("#[cfg(test)]").unwrap()];
        let core = &code[code.find("fn reason(").unwrap()..code.find("fn code(").unwrap()];
        let quoted_after = |text: &str, marker: &str| -> Vec<String> {
            text.split(marker).skip(1).filter_map(|s| s.split('"').next()).map(str::to_string).collect()
        };
        let given: std::collections::BTreeSet<String> =
            quoted_after(core, "(\"").into_iter().chain(quoted_after(code, "reason: \"")).collect();
        let proto = std::fs::read_to_string(manifest.join("../../proto/loam/jobs/v1/jobs.proto")).unwrap();
        let detail = &proto[proto.find("message ErrorDetail").unwrap()..proto.find("string reason = 1;").unwrap()];
        let listed: std::collections::BTreeSet<String> =
            detail.split('`').skip(1).step_by(2).map(str::to_string).collect();
        assert_eq!(listed, given);
        assert!(given.len() >= 25, "found {} reasons; has errors.rs changed shape?", given.len());
    }

    #[test]
    fn codes_follow_the_design_table() {
        let fenced = JobsError::Fenced { job: "1".into(), current_epoch: 3, reason: FenceFailure::Mismatch };
        assert_eq!(code(&fenced), ErrorCode::FailedPrecondition);
        assert_eq!(detail(&fenced).bullmq_code, -6);
        assert_eq!(detail(&fenced).reason, "fenced.mismatch");
        let big = JobsError::PayloadTooLarge { size: 10, limit: 5 };
        assert_eq!(code(&big), ErrorCode::ResourceExhausted);
        assert_eq!(code(&JobsError::job_missing("x")), ErrorCode::NotFound);
        assert_eq!(detail(&JobsError::job_missing("x")).bullmq_code, -1);
        assert_eq!(code_name(&JobsError::QueuePaused("q".into())), "unavailable");
    }

    /// `code` reads the core's name of each error's Connect code; a name
    /// connectrpc did not know would send the error as `internal`.
    #[test]
    fn every_connect_code_is_one_connectrpc_knows() {
        let every = [
            JobsError::invalid("x"),
            JobsError::job_missing("x"),
            JobsError::AlreadyExists { existing: "1".into() },
            JobsError::IdempotencyConflict { key: "k".into() },
            JobsError::Fenced { job: "1".into(), current_epoch: 1, reason: FenceFailure::NoLease },
            JobsError::Precondition(Precondition::PendingChildren { job: "1".into() }),
            JobsError::QueuePaused("q".into()),
            JobsError::RateLimited { retry_after_ms: 1 },
            JobsError::PayloadTooLarge { size: 2, limit: 1 },
            JobsError::Unavailable("u".into()),
            JobsError::DeadlineExceeded,
            JobsError::Internal("i".into()),
        ];
        for err in &every {
            let parsed = err.connect_code().parse::<ErrorCode>();
            assert_eq!(parsed.ok().map(|c| c.as_str()), Some(err.connect_code()), "{err:?}");
        }
        assert_eq!(code(&JobsError::Internal("i".into())), ErrorCode::Internal);
    }
}
