//! The workers a server has seen, by queue: BullMQ's `getWorkers`, which on
//! Redis lists the connections that named themselves.

use super::*;

/// How long a worker name stays listed after it was last seen.
const WORKER_TTL: Duration = Duration::from_secs(300);

/// Per (namespace, queue): the worker names seen, and when.
#[derive(Default)]
pub(super) struct WorkersSeen {
    by_queue: HashMap<(String, String), HashMap<String, Seen>>,
    /// When names gone quiet were last dropped from every queue: a queue
    /// whose workers left (or any name a caller tried) is not kept for good.
    swept: Option<Instant>,
}

/// A worker name: when it was first and last seen (it is forgotten once
/// unseen for `WORKER_TTL`), and on which connection last.
struct Seen {
    first: Instant,
    last: Instant,
    peer: Option<SocketAddr>,
}

impl JobsSvc {
    /// Lists worker `name` for `queue`, once both names are ones the core
    /// takes (a Lease's worker name is kept with every job it takes, so the
    /// same bound holds here).
    pub(super) fn saw_worker(&self, c: &Caller, queue: &str, name: &str) -> Result<(), JobsError> {
        Jobs::check_queue_name(&c.ns, queue)?;
        lease::check_worker_name(name)?;
        let mut w = self.workers.lock();
        let now = Instant::now();
        if w.swept.is_none_or(|at| now.duration_since(at) >= WORKER_TTL) {
            w.by_queue.retain(|_, names| {
                names.retain(|_, seen| now.duration_since(seen.last) < WORKER_TTL);
                !names.is_empty()
            });
            w.swept = Some(now);
        }
        let names = w.by_queue.entry((c.ns.clone(), queue.to_string())).or_default();
        names.retain(|_, seen| now.duration_since(seen.last) < WORKER_TTL);
        let seen = names.entry(name.to_string()).or_insert(Seen { first: now, last: now, peer: None });
        seen.last = now;
        seen.peer = c.peer.or(seen.peer);
        Ok(())
    }

    /// Whether `name` was listed.
    pub(super) fn forget_worker(&self, ns: &str, queue: &str, name: &str) -> bool {
        let mut w = self.workers.lock();
        let key = (ns.to_string(), queue.to_string());
        let Some(names) = w.by_queue.get_mut(&key) else { return false };
        let listed = names.remove(name).is_some();
        if names.is_empty() {
            w.by_queue.remove(&key);
        }
        listed
    }

    /// The queue's workers, oldest first (Redis lists clients in the order they connected).
    pub(super) fn workers_of(&self, ns: &str, queue: &str) -> Vec<pb::WorkerSeen> {
        let now = Instant::now();
        let w = self.workers.lock();
        let Some(names) = w.by_queue.get(&(ns.to_string(), queue.to_string())) else { return Vec::new() };
        let mut seen: Vec<(&String, &Seen)> =
            names.iter().filter(|(_, seen)| now.duration_since(seen.last) < WORKER_TTL).collect();
        seen.sort_by(|a, b| a.1.first.cmp(&b.1.first).then_with(|| a.0.cmp(b.0)));
        let ms = |since: Instant| u64::try_from(now.duration_since(since).as_millis()).unwrap_or(u64::MAX);
        seen.into_iter()
            .map(|(name, seen)| pb::WorkerSeen {
                name: name.clone(),
                addr: seen.peer.map(|p| p.to_string()).unwrap_or_default(),
                age_ms: ms(seen.first),
                idle_ms: ms(seen.last),
                ..Default::default()
            })
            .collect()
    }
}
