//! The request budget: how many bytes of requests the server works on at
//! once, across every connection and call.
//!
//! `--max-request-bytes` bounds one request. Without a bound across them, a
//! few clients sending large enqueues at once could take the server's
//! memory: a request's bytes are decoded, converted and written to the store
//! (several copies of its payload) until its call ends, and four 60 MB
//! enqueues in flight took it to 1.5 GB. A call takes its request's bytes
//! from the budget before it starts and gives them back when it has
//! answered. Past the budget, calls wait with only their request's bytes
//! read, while the calls under way finish.
//!
//! Long-polls (a Lease, an event read, a wait for a job) take no bytes: their
//! requests are small, and holding bytes for a wait of up to 30 s held up the
//! calls that would end it.
//!
//! The calls waiting are bounded too: their bytes, read and held while they
//! wait, may add up to `--max-request-bytes-waiting` (by default the budget
//! again). Past that a call is refused at once as `unavailable`, which
//! clients send again after a pause. Without this bound, thirty gzipped
//! requests of 61 KB, each inflating to 60 MB, waited with 1.8 GB read and
//! took the server to 3.6 GB.
//!
//! A call never waits once it holds bytes (it waits before it starts, and a
//! started call never waits on the budget again), so calls cannot wait for
//! one another. Bodies are read before their call waits: a request waiting
//! unread would hold its connection's HTTP/2 flow-control window, and with
//! it the other calls on that connection, which may be the ones to give
//! bytes back. A Session's calls come one message at a time on one stream:
//! while one waits, the session reads no further message and starts no later
//! call, so its calls still start in the order they were sent.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes of requests held by calls under way, shared by every connection.
#[derive(Clone)]
pub struct Budget {
    bytes: Arc<Semaphore>,
    /// The whole budget: one request larger than it takes all of it and runs alone.
    total: u32,
    /// Bytes held now (for `/metrics`).
    held: Gauge,
    /// Times a request waited for bytes (for `/metrics`).
    waits: Counter,
    /// Bytes of the requests waiting now.
    waiting: Arc<AtomicU64>,
    /// The most `waiting` may reach.
    room: u64,
    /// Times a request was refused, the calls waiting holding `room` (for `/metrics`).
    refusals: Counter,
}

/// A call refused: the budget and the room to wait for it are both full.
#[derive(Debug)]
pub struct Overloaded {
    pub waiting_bytes: u64,
}

/// A waiting call's bytes, counted until it stops waiting.
struct WaitingBytes {
    of: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for WaitingBytes {
    fn drop(&mut self) {
        self.of.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Bytes a request holds; given back when dropped.
pub struct Held {
    permit: Option<OwnedSemaphorePermit>,
    gauge: Gauge,
}

impl Budget {
    /// A budget of `bytes` (at most 4 GiB, as a request is), with up to
    /// `room` bytes of requests allowed to wait for it.
    pub fn new(bytes: usize, room: usize, held: Gauge, waits: Counter, refusals: Counter) -> Self {
        let total = u32::try_from(bytes).unwrap_or(u32::MAX).max(1);
        let (waiting, room) = (Arc::default(), u64::try_from(room).unwrap_or(u64::MAX));
        Self { bytes: Arc::new(Semaphore::new(total as usize)), total, held, waits, waiting, room, refusals }
    }

    fn share(&self, bytes: usize) -> u32 {
        u32::try_from(bytes).unwrap_or(u32::MAX).clamp(1, self.total)
    }

    fn held(&self, permit: OwnedSemaphorePermit) -> Held {
        self.held.inc_by(permit.num_permits() as i64);
        Held { permit: Some(permit), gauge: self.held.clone() }
    }

    /// `bytes` now, if the budget has them.
    pub fn try_take(&self, bytes: usize) -> Option<Held> {
        Arc::clone(&self.bytes).try_acquire_many_owned(self.share(bytes)).ok().map(|p| self.held(p))
    }

    /// `bytes`, once the budget has them. Waiters are served in the order
    /// they asked, so a large request is not passed over for ever. Refused
    /// if it would take the calls waiting past their room; with none
    /// waiting, any request may wait (one larger than the budget runs alone).
    pub fn take(&self, bytes: usize) -> impl Future<Output = Result<Held, Overloaded>> + Send + 'static {
        let budget = self.clone();
        let share = self.share(bytes);
        async move {
            if let Some(held) = budget.try_take(share as usize) {
                return Ok(held);
            }
            let before = budget.waiting.fetch_add(u64::from(share), Ordering::AcqRel);
            let waiting = WaitingBytes { of: Arc::clone(&budget.waiting), bytes: u64::from(share) };
            if before > 0 && before + u64::from(share) > budget.room {
                drop(waiting);
                budget.refusals.inc();
                return Err(Overloaded { waiting_bytes: before });
            }
            budget.waits.inc();
            let held = match Arc::clone(&budget.bytes).acquire_many_owned(share).await {
                Ok(permit) => budget.held(permit),
                // The semaphore is never closed.
                Err(_) => Held { permit: None, gauge: budget.held.clone() },
            };
            drop(waiting);
            Ok(held)
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(p) = self.permit.take() {
            self.gauge.dec_by(p.num_permits() as i64);
        }
    }
}
