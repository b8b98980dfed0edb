//! `/healthz`: whether the server can serve calls, for a supervisor that
//! restarts it when it cannot.
//!
//! A store that failed (a write it could not make durable, a disk full
//! under its file, a fault of its own that stopped it) refuses every write
//! from then on, and only reopening it mends it: the open replays its log.
//! The server goes on answering each call with the error, so a health check
//! that looked only at shutdown said `ok` while nothing could be written. It
//! says 503 instead, without the error itself (`/healthz` takes no token, and
//! the error can name paths); the first check that finds the failure logs it.

use std::sync::atomic::{AtomicBool, Ordering};

use axum::http::StatusCode;
use loam_jobs::Jobs;

pub struct Health {
    jobs: Jobs,
    /// Whether the store's failure was logged already.
    reported: AtomicBool,
}

impl Health {
    pub fn new(jobs: Jobs) -> Self {
        Self { jobs, reported: AtomicBool::new(false) }
    }

    /// The answer to a check: its status and its body.
    pub fn check(&self) -> (StatusCode, &'static str) {
        if self.jobs.is_closed() {
            return (StatusCode::SERVICE_UNAVAILABLE, "closing\n");
        }
        let Some(failure) = self.jobs.failure() else {
            return (StatusCode::OK, "ok\n");
        };
        if !self.reported.swap(true, Ordering::Relaxed) {
            tracing::error!(error = %failure, "the store refuses writes until the server is restarted");
        }
        (StatusCode::SERVICE_UNAVAILABLE, "the store failed: restart the server (its open replays the log)\n")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "a test: a failed unwrap is a failed check")]

    use std::sync::Arc;

    use loam_jobs::kv::KvRead;
    use loam_jobs::store::redb::RedbStore;
    use loam_jobs::store::{Store, WriteOp};
    use loam_jobs::{Config, StoreError, SystemClock};

    use super::*;

    /// A store in memory whose failure the test sets.
    struct Failing {
        inner: RedbStore,
        failure: Arc<parking_lot::Mutex<Option<StoreError>>>,
    }

    impl Store for Failing {
        fn submit(&self, op: WriteOp) {
            self.inner.submit(op);
        }
        fn snapshot(&self) -> Result<Box<dyn KvRead + Send>, StoreError> {
            self.inner.snapshot()
        }
        fn close(&self) {
            self.inner.close();
        }
        fn failure(&self) -> Option<StoreError> {
            self.failure.lock().clone()
        }
    }

    #[test]
    fn a_failed_store_is_unhealthy_and_a_closed_one_closing() {
        let failure = Arc::new(parking_lot::Mutex::new(None));
        let store = Failing { inner: RedbStore::in_memory().unwrap(), failure: Arc::clone(&failure) };
        let jobs = Jobs::with_store(Box::new(store), Arc::new(SystemClock), Config::default()).unwrap();
        let health = Health::new(jobs.clone());
        assert_eq!(health.check(), (StatusCode::OK, "ok\n"));
        *failure.lock() = Some(StoreError::Io("/data/jobs.redb.wal: No space left on device".into()));
        let (status, body) = health.check();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        // The store's error can name paths, and /healthz takes no token.
        assert!(body.contains("restart") && !body.contains("/data"), "{body}");
        jobs.close();
        assert_eq!(health.check(), (StatusCode::SERVICE_UNAVAILABLE, "closing\n"));
    }
}
