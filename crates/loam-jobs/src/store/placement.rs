//! Where a write runs: on the thread that submits it, or on the executor's.
//!
//! A caller that would sit idle until its answer comes (a Node host awaiting
//! one write at a time) gains from running the write itself: it saves a round
//! trip between threads, whose two wake-ups cost more than a small write. A
//! caller with other work meanwhile (a Node host with a hundred jobs in
//! flight) loses from it: the executor's thread would run the write on the
//! other core while the caller goes on. The host tells which it is from its
//! side (see [`CallerWaits`]), but only while its writes go to the executor:
//! a write run on the caller's thread is answered before the next one is
//! made, so every caller then looks as if it waited. So while callers run
//! their writes, the next ones go to the executor again now and then, and the
//! host's answers over a window of [`WINDOW`] writes decide which way they go
//! on. The windows come after [`FIRST_PROBE`] writes on callers' threads,
//! twice as many after each window that keeps them there, up to
//! [`LAST_PROBE`]: a host that turns busy is found out soon, and one that
//! stays idle pays for few windows.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// Called on the submitting thread: whether that thread would wait idle for
/// the answer of the write it submits, having nothing else to do meanwhile.
/// False on threads that should not run writes.
pub type CallerWaits = fn() -> bool;

/// Writes a window takes to decide.
const WINDOW: u32 = 32;
/// Of a window's writes, how many must come from callers that waited for
/// writes to run on the caller's thread (nine in ten).
const WAITED: u32 = WINDOW * 9 / 10;
/// Writes run on callers' threads before the next window, at first and at
/// most.
const FIRST_PROBE: u32 = 256;
const LAST_PROBE: u32 = 4096;

pub(crate) struct Placement {
    caller_waits: CallerWaits,
    /// Whether callers run their writes now (the executor permitting).
    on_callers: AtomicBool,
    /// Writes run on callers' threads since the last window, and how many
    /// bring the next one (half of the first stint's while writes stay on
    /// the executor).
    run_on_callers: AtomicU32,
    probe_after: AtomicU32,
    /// The current window's writes sent to the executor, and how many of
    /// them came from a caller that waited.
    sent: AtomicU32,
    waited: AtomicU32,
}

impl Placement {
    /// Starts with writes on callers' threads, for the first stint.
    pub(crate) fn new(caller_waits: CallerWaits) -> Self {
        Self {
            caller_waits,
            on_callers: AtomicBool::new(true),
            run_on_callers: AtomicU32::new(0),
            probe_after: AtomicU32::new(FIRST_PROBE),
            sent: AtomicU32::new(0),
            waited: AtomicU32::new(0),
        }
    }

    /// Whether the calling thread should try to run its write itself.
    pub(crate) fn here(&self) -> bool {
        self.on_callers.load(Ordering::Relaxed) && (self.caller_waits)()
    }

    /// A write ran on its caller's thread.
    pub(crate) fn ran_here(&self) {
        if self.run_on_callers.fetch_add(1, Ordering::Relaxed) + 1 >= self.probe_after.load(Ordering::Relaxed) {
            self.run_on_callers.store(0, Ordering::Relaxed);
            self.on_callers.store(false, Ordering::Relaxed);
        }
    }

    /// A write goes to the executor (call before sending it, on the caller's
    /// thread). Counts toward the window only while callers do not run their
    /// writes: otherwise it was sent because the executor was busy.
    pub(crate) fn sent(&self) {
        if self.on_callers.load(Ordering::Relaxed) {
            return;
        }
        if (self.caller_waits)() {
            self.waited.fetch_add(1, Ordering::Relaxed);
        }
        // Concurrent callers may count a write into the next window; the
        // decision only needs to be about right.
        if self.sent.fetch_add(1, Ordering::Relaxed) + 1 >= WINDOW {
            self.sent.store(0, Ordering::Relaxed);
            let waited = self.waited.swap(0, Ordering::Relaxed);
            if waited >= WAITED {
                let after = (self.probe_after.load(Ordering::Relaxed) * 2).clamp(FIRST_PROBE, LAST_PROBE);
                self.probe_after.store(after, Ordering::Relaxed);
                self.on_callers.store(true, Ordering::Relaxed);
            } else {
                self.probe_after.store(FIRST_PROBE / 2, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    static WAITS: AtomicBool = AtomicBool::new(true);

    fn waits() -> bool {
        WAITS.load(Ordering::Relaxed)
    }

    /// Runs writes on callers' threads until a window comes; returns how many ran.
    fn stint(placement: &Placement) -> u32 {
        let mut ran = 0;
        while placement.here() {
            placement.ran_here();
            ran += 1;
            assert!(ran <= LAST_PROBE, "a window comes at the latest after LAST_PROBE writes");
        }
        ran
    }

    fn window(placement: &Placement) {
        for _ in 0..WINDOW {
            placement.sent();
        }
    }

    #[test]
    fn callers_that_wait_run_their_writes_and_busy_ones_go_back_to_the_executor() {
        WAITS.store(true, Ordering::Relaxed);
        let placement = Placement::new(waits);
        assert_eq!(stint(&placement), FIRST_PROBE, "a first stint, then a window");
        window(&placement);
        assert_eq!(stint(&placement), FIRST_PROBE * 2, "each window that keeps writes here doubles the stint");
        window(&placement);
        assert_eq!(stint(&placement), FIRST_PROBE * 4);
        for _ in 0..8 {
            window(&placement);
            stint(&placement);
        }
        window(&placement);
        assert_eq!(stint(&placement), LAST_PROBE);
        WAITS.store(false, Ordering::Relaxed);
        for _ in 0..3 {
            window(&placement);
        }
        WAITS.store(true, Ordering::Relaxed);
        assert!(!placement.here(), "busy callers keep writes on the executor");
        // A window with a few busy writes among waiting ones still counts as waiting.
        for i in 0..WINDOW {
            WAITS.store(i % 16 != 0, Ordering::Relaxed);
            placement.sent();
        }
        WAITS.store(true, Ordering::Relaxed);
        assert_eq!(stint(&placement), FIRST_PROBE, "a busy window starts the stints over");
    }

    #[test]
    fn threads_that_cannot_wait_never_run_writes() {
        let placement = Placement::new(|| false);
        assert!(!placement.here());
        for _ in 0..10 {
            window(&placement);
        }
        assert!(!placement.here());
    }
}
