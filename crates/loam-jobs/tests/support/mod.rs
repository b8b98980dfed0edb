//! What the example tests share: a core on an in-memory store and a manual
//! clock, and a plain job.

use std::sync::Arc;

use loam_jobs::store::redb::RedbStore;
use loam_jobs::*;

/// A core with no background thread, on a clock that moves only when told.
pub fn core() -> (Jobs, ManualClock) {
    let clock = ManualClock::new(1_000_000);
    let config = Config { background: false, ..Config::default() };
    let jobs = Jobs::with_store(Box::new(RedbStore::in_memory().unwrap()), Arc::new(clock.clone()), config).unwrap();
    (jobs, clock)
}

pub fn job(name: &str) -> EnqueueRequest {
    EnqueueRequest { name: name.into(), data: b"{}".to_vec(), attempts: 1, ..Default::default() }
}
