//! The long-polls and Watch streams each namespace may have waiting at once.
//!
//! A long-poll (a Lease, an event read, a wait for a job) holds no request
//! budget (`budget.rs`), but it holds memory while it waits, up to 30 s: about
//! 6 KB on a Session and 18 KB as a call of its own. A Session carries 4,096
//! calls and a connection 1,000 streams, so one client with a token could hold
//! millions of them, gigabytes of every tenant's server; a Watch holds its
//! read-ahead for as long as it is open. Each namespace may have
//! `--max-waiting-calls-per-namespace` of them at once; past that one is
//! refused as `unavailable` (with a retry-after in its detail), and one
//! tenant's waits never take another's room. A Session's long-poll gives its
//! place back once the session takes its answer: a client that stops reading
//! its session keeps its places, in its own namespace only.

use std::collections::HashMap;
use std::sync::Arc;

use connectrpc::ConnectError;
use parking_lot::Mutex;

/// `--max-waiting-calls-per-namespace` unless given.
pub const DEFAULT_MAX_PER_NAMESPACE: usize = 10_000;

pub struct WaitingCalls {
    max_per_namespace: usize,
    by_namespace: Mutex<HashMap<String, usize>>,
}

/// One waiting call's place, given back when it is dropped.
pub struct Waiting {
    calls: Arc<WaitingCalls>,
    ns: String,
}

/// The pause a refused long-poll asks for before it is sent again.
const REFUSED_PAUSE_MS: u64 = 1000;

impl WaitingCalls {
    pub fn new(max_per_namespace: usize) -> Arc<Self> {
        Arc::new(Self { max_per_namespace, by_namespace: Mutex::default() })
    }

    /// A place for one more waiting call of `ns`, or the error that refuses it.
    pub fn take(self: &Arc<Self>, ns: &str) -> Result<Waiting, ConnectError> {
        let mut by_namespace = self.by_namespace.lock();
        let waiting = by_namespace.get(ns).copied().unwrap_or(0);
        if waiting >= self.max_per_namespace {
            return Err(crate::errors::busy(
                format!(
                    "namespace {ns:?} has {waiting} calls waiting (leases, event reads, waits for a job, watches), \
                     --max-waiting-calls-per-namespace; try again"
                ),
                REFUSED_PAUSE_MS,
            ));
        }
        *by_namespace.entry(ns.to_string()).or_default() += 1;
        Ok(Waiting { calls: Arc::clone(self), ns: ns.to_string() })
    }

    #[cfg(test)]
    fn waiting(&self, ns: &str) -> usize {
        self.by_namespace.lock().get(ns).copied().unwrap_or(0)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut by_namespace = self.calls.by_namespace.lock();
        if let Some(n) = by_namespace.get_mut(&self.ns) {
            *n -= 1;
            if *n == 0 {
                by_namespace.remove(&self.ns);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use connectrpc::ErrorCode;

    #[test]
    fn each_namespace_has_its_own_places_given_back_on_drop() {
        let calls = WaitingCalls::new(2);
        let a1 = calls.take("a").unwrap();
        let _a2 = calls.take("a").unwrap();
        let refused = calls.take("a").err().unwrap();
        assert_eq!(refused.code, ErrorCode::Unavailable);
        assert!(refused.message.as_deref().unwrap().contains("--max-waiting-calls-per-namespace"));
        let _b = calls.take("b").unwrap();
        drop(a1);
        assert_eq!(calls.waiting("a"), 1);
        let _a3 = calls.take("a").unwrap();
        assert_eq!(calls.waiting("b"), 1);
    }
}
