//! The purge of expired result-store entries and idempotency records, a
//! background task of the server.

use super::*;

type Purge = fn(&mut loam_jobs::tx::Tx, usize) -> Result<u64, JobsError>;

/// Deletes expired result-store entries and idempotency records now and
/// then, until `stop` fires.
pub async fn purge_expired(jobs: Jobs, stop: Interrupt) {
    const EVERY: Duration = Duration::from_secs(30);
    const PER_WRITE: usize = 10_000;
    let purges: [(&str, Purge); 2] =
        [("expired results", results::purge_expired), ("expired idempotency records", idempotency::purge_expired)];
    while !stop.is_fired() {
        for (what, purge) in purges {
            purge_due(&jobs, what, purge, PER_WRITE, &stop).await;
        }
        tokio::select! {
            () = tokio::time::sleep(EVERY) => {}
            () = stop.fired() => {}
        }
    }
}

/// Runs `purge` in writes of up to `per_write` until one finds fewer due (or
/// `stop` fires): one write per round fell behind any client adding more
/// than a write's worth of keyed jobs between two rounds (every remote BullMQ
/// add has a key). Returns how many went.
pub(super) async fn purge_due(jobs: &Jobs, what: &str, purge: Purge, per_write: usize, stop: &Interrupt) -> u64 {
    let mut total = 0;
    loop {
        match jobs.write("", true, move |tx| purge(tx, per_write)).await {
            Ok(n) => {
                if n > 0 {
                    tracing::debug!(purged = n, "{what} removed");
                }
                total += n;
                if (n as usize) < per_write || stop.is_fired() {
                    return total;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "purging {what} failed");
                return total;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_purge_round_takes_every_expired_record_not_one_write_of_them() {
        use loam_jobs::{EnqueueRequest, Idempotency};
        let clock = loam_jobs::ManualClock::new(1_000_000);
        let config = loam_jobs::Config { background: false, ..loam_jobs::Config::default() };
        let store = loam_jobs::store::redb::RedbStore::in_memory().unwrap();
        let jobs = Jobs::with_store(Box::new(store), std::sync::Arc::new(clock.clone()), config).unwrap();
        for n in 0..10 {
            let request = EnqueueRequest {
                name: "a".into(),
                idempotency: Some(Idempotency { key: format!("k{n}"), ttl_ms: Some(1_000) }),
                ..EnqueueRequest::default()
            };
            jobs.enqueue("ns", "q", request).await.unwrap();
        }
        clock.advance(2_000);
        let stop = Interrupt::new();
        let purged = purge_due(&jobs, "records", idempotency::purge_expired, 3, &stop).await;
        assert_eq!(purged, 10, "writes of 3 until one found fewer");
        assert_eq!(purge_due(&jobs, "records", idempotency::purge_expired, 3, &stop).await, 0);
    }
}
