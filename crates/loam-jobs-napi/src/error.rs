//! Core errors → the errors BullMQ's callers expect, in one place.
//!
//! BullMQ reports failed operations with numeric codes (`enums/error-code`)
//! and the texts of its `finishedErrors()`. napi rejects async functions with
//! a fixed set of statuses only, so the code travels as a tag at the start of
//! the message, `[bullmq:-3] {...}` or `[loam:<kind>] ...`, which the
//! JavaScript side strips into `error.code` (see `src/errors.ts`). A BullMQ
//! code comes with the command and the arguments its text names, as JSON:
//! `src/errors.ts` writes BullMQ's texts, for this backend and the remote one
//! alike, so they are kept in one place.

use loam_jobs::{JobsError, Missing, Precondition, StoreError};
use serde::Serialize;

/// The BullMQ command an error is reported for, with the arguments its
/// message names (as the Redis adapter passes them to `finishedErrors`).
/// Serialized as `src/errors.ts`'s `BullmqCommand`; an argument left out
/// prints as `undefined` there, as it does in BullMQ.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Op {
    pub command: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_key: Option<String>,
}

impl Op {
    pub fn new(command: &'static str) -> Self {
        Self { command, ..Self::default() }
    }
    pub fn job(mut self, id: &str) -> Self {
        self.job_id = Some(id.to_string());
        self
    }
    pub fn state(mut self, state: &'static str) -> Self {
        self.state = Some(state);
        self
    }
    pub fn parent(mut self, key: Option<String>) -> Self {
        self.parent_key = key;
        self
    }

    /// The JavaScript error for a core error raised by this operation. An
    /// operation on many jobs (addJobs) knows the parent only from the error.
    pub fn error(&self, err: JobsError) -> napi::Error {
        let text = match err.bullmq_code() {
            Some(code) => {
                let parent_key = self.parent_key.clone().or_else(|| parent_named(&err).map(str::to_string));
                let op = Op { parent_key, ..self.clone() };
                // Serializing strings into a map cannot fail; were it to, the
                // JavaScript side shows BullMQ's code with the text as sent.
                format!("[bullmq:{}] {}", code as i32, serde_json::to_string(&op).unwrap_or_default())
            }
            None => loam_message(&err),
        };
        napi::Error::from_reason(text)
    }
}

/// The parent key a refusal about a parent names (none for a job without a
/// parent, whose message says `undefined`, as BullMQ's does).
fn parent_named(err: &JobsError) -> Option<&str> {
    match err {
        JobsError::NotFound(Missing::ParentJob(key)) => Some(key.as_str()),
        JobsError::Precondition(Precondition::ParentCannotBeReplaced { job }) => Some(job.as_str()),
        _ => None,
    }
    .filter(|key| !key.is_empty())
}

/// Errors BullMQ has no code for keep the core's own text, tagged with the
/// core's error kind. Obliterate's two refusals use BullMQ's texts.
fn loam_message(err: &JobsError) -> String {
    match err {
        JobsError::Precondition(Precondition::QueueNotPaused { .. }) => {
            "[loam:failed_precondition] Cannot obliterate non-paused queue".to_string()
        }
        JobsError::Precondition(Precondition::QueueHasActiveJobs { .. }) => {
            "[loam:failed_precondition] Cannot obliterate queue with active jobs".to_string()
        }
        other => format!("[loam:{}] {other}", other.connect_code()),
    }
}

/// The error for a data dir another process holds: embedded stores are
/// single-process, so point at the server that shares one.
pub fn store_locked(data_dir: &str) -> napi::Error {
    napi::Error::from_reason(format!(
        "[loam:store_locked] The Loam Jobs store in {data_dir} is already open in another process. \
         An embedded store belongs to one process; to share queues between processes, run \
         `loam-jobs serve --data-dir {data_dir}` and connect every process to it with \
         `loamBackend({{ url }})` (if the process holding it is that server already, connect to it)."
    ))
}

pub fn store_error(data_dir: &str, err: StoreError) -> napi::Error {
    match err {
        StoreError::Locked(_) => store_locked(data_dir),
        other => napi::Error::from_reason(format!(
            "[loam:unavailable] cannot open the Loam Jobs store in {data_dir}: {other}"
        )),
    }
}

pub fn invalid(message: impl std::fmt::Display) -> napi::Error {
    napi::Error::from_reason(format!("[loam:invalid_argument] {message}"))
}

/// The error a panic inside the addon becomes: a rejected call, never a
/// crash of the host process.
pub fn panicked(panic: Box<dyn std::any::Any + Send>) -> napi::Error {
    let text = loam_jobs::error::panic_text(panic.as_ref());
    napi::Error::from_reason(format!("[loam:internal] panic in the Loam addon: {text}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use loam_jobs::FenceFailure;

    #[test]
    fn a_bullmq_code_carries_the_arguments_its_text_names() {
        let op = Op::new("moveToFinished").job("7").state("active");
        assert_eq!(
            op.error(JobsError::job_missing("7")).reason,
            r#"[bullmq:-1] {"command":"moveToFinished","jobId":"7","state":"active"}"#
        );
        let fenced = JobsError::Fenced { job: "7".into(), current_epoch: 2, reason: FenceFailure::Mismatch };
        let sent = r#"{"command":"moveToFinished","jobId":"7","state":"active"}"#;
        assert_eq!(op.error(fenced).reason, format!("[bullmq:-6] {sent}"));
        let not_in_state = JobsError::not_in_state("7", loam_jobs::JobState::Waiting, loam_jobs::JobState::Active);
        assert_eq!(op.error(not_in_state).reason, format!("[bullmq:-3] {sent}"));
        // The parent a refusal names, where the operation did not know it.
        let add = Op::new("addJob");
        let missing_parent = JobsError::NotFound(Missing::ParentJob("bull:p:1".into()));
        assert_eq!(add.error(missing_parent).reason, r#"[bullmq:-5] {"command":"addJob","parentKey":"bull:p:1"}"#);
        assert!(op.error(JobsError::invalid("x")).reason.starts_with("[loam:invalid_argument] "));
    }
}
