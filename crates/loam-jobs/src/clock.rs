//! Time, injectable so tests can move it. Deadlines are judged by the store's
//! clock (this one), never by a worker's (docs/design.md, "Leases and fencing").

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
    }
}

/// A clock that moves only when told to.
#[derive(Clone)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    pub fn new(start_ms: u64) -> Self {
        Self(Arc::new(AtomicU64::new(start_ms)))
    }
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
    pub fn set(&self, ms: u64) {
        self.0.store(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A clock that follows the host's clock: the system clock plus the offset the
/// host last reported. The in-process Node binding reports `Date.now()` with
/// its calls, so BullMQ's JavaScript (and its tests, which fake `Date.now()`)
/// and the core agree on what time it is, as they do on Redis, where BullMQ
/// passes its own timestamps to every script. Between reports it advances
/// with real time.
#[derive(Default)]
pub struct FollowingClock {
    offset_ms: std::sync::atomic::AtomicI64,
}

impl FollowingClock {
    pub fn new() -> Self {
        Self::default()
    }

    /// The host says it is `host_now_ms` now.
    pub fn observe(&self, host_now_ms: u64) {
        let offset = host_now_ms as i64 - SystemClock.now_ms() as i64;
        self.offset_ms.store(offset, Ordering::SeqCst);
    }
}

impl Clock for FollowingClock {
    fn now_ms(&self) -> u64 {
        (SystemClock.now_ms() as i64 + self.offset_ms.load(Ordering::SeqCst)).max(0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_following_clock_keeps_the_host_offset() {
        let clock = FollowingClock::new();
        let system = SystemClock.now_ms();
        assert!(clock.now_ms().abs_diff(system) < 1_000);
        clock.observe(1_486_439_000_000); // a test that fakes 2017
        assert!(clock.now_ms().abs_diff(1_486_439_000_000) < 1_000);
        clock.observe(system + 3_600_000);
        assert!(clock.now_ms().abs_diff(system + 3_600_000) < 1_000);
    }
}
