//! Engines behind the [`Store`] interface.
//!
//! An engine runs write operations as transactions and hands out read
//! snapshots. It knows nothing of queues: an operation is an opaque closure over
//! a [`KvTxn`]. Engines with optimistic transactions may run a body more than
//! once, so bodies are `FnMut` and keep no effects outside the transaction.

use std::any::Any;

use crate::error::{JobsError, StoreError};
use crate::kv::{KvRead, KvTxn};

pub mod placement;
pub mod redb;
mod wal;

pub type OpOutput = Box<dyn Any + Send>;
pub type OpBody = Box<dyn FnMut(&mut dyn KvTxn) -> Result<OpOutput, JobsError> + Send>;
pub type OpDone = Box<dyn FnOnce(Result<OpOutput, JobsError>) + Send>;

/// The most jobs a brief write (see [`WriteOp::brief`]) may add. A flow of a
/// parent and ten children, BullMQ's usual tree, runs in about 100 us; 16 jobs
/// keep a write run on a host's event loop near the cost of the host's own
/// code that asked for it.
pub const BRIEF_JOBS: usize = 16;

/// One write operation: its transaction body, whether its acknowledgement must
/// wait for the commit to reach disk, and what to do once it is settled.
pub struct WriteOp {
    pub body: OpBody,
    pub durable: Durable,
    /// A write of at most [`BRIEF_JOBS`] jobs (an add, a lease, a completion,
    /// a lock extension, a small flow or bulk add), whose cost is bounded: it
    /// may run on its caller's thread (see
    /// `redb::RedbOptions::run_on_callers_thread`). A write of more (a large
    /// bulk add or flow, a drain, a clean) runs on the store's own thread
    /// whatever the caller, so a host's event loop never runs it.
    pub brief: bool,
    pub done: OpDone,
}

/// Whether a write's acknowledgement waits for its commit to reach disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durable {
    /// No: its loss after a crash breaks no guarantee (a lost lease is the
    /// same as a stalled one).
    No,
    /// Under [`Durability::Immediate`]: an add, a completion, an admin write.
    UnlessRelaxed,
    /// Under either durability: a write whose loss would break a guarantee
    /// that relaxed durability keeps too (the store's open count, which keeps
    /// a lease epoch lost in a crash from being handed out again).
    Always,
}

impl Durable {
    /// [`Durable::UnlessRelaxed`] for a write that needs its fsync, else [`Durable::No`].
    pub fn needed(sync: bool) -> Self {
        if sync { Durable::UnlessRelaxed } else { Durable::No }
    }
}

/// How commits reach disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Every acknowledged write that needs it has been fsynced (the default).
    Immediate,
    /// Commits are flushed at least every `flush_interval_ms`; a crash may lose
    /// the writes of that window, like Redis with `appendfsync everysec`.
    Relaxed { flush_interval_ms: u64 },
}

impl Durability {
    /// Relaxed durability flushing every `flush_interval_ms`, counted as at
    /// least 1 ms, as every host (the server's flag, the Node binding) takes it.
    pub fn relaxed(flush_interval_ms: u64) -> Self {
        Durability::Relaxed { flush_interval_ms: flush_interval_ms.max(1) }
    }
}

pub trait Store: Send + Sync + 'static {
    /// Runs `op` in a transaction and calls its `done` once the transaction is
    /// committed (and durable, as its [`Durable`] asks under the store's
    /// [`Durability`]).
    fn submit(&self, op: WriteOp);

    /// A consistent snapshot of everything committed so far.
    fn snapshot(&self) -> Result<Box<dyn KvRead + Send>, StoreError>;

    /// Stops accepting writes and waits for the ones already submitted.
    fn close(&self);

    /// Why the store refuses every commit from now on, if it does: a write it
    /// could not make durable, or could not carry from its log into its
    /// file, or a fault of its own (a bug) that stopped it. Only reopening
    /// it, once the cause is gone (a full disk), mends that: the open replays
    /// the log. A host says so where it reports its health. Nothing once the
    /// store is closing.
    fn failure(&self) -> Option<StoreError>;
}
