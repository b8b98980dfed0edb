//! The executor: runs each batch of operations over the batches not yet
//! committed, on its own thread or, when it is idle, on a caller's, and hands
//! the batch's net writes to the committer.

use super::committer::LINGER_BATCHES;
use super::*;

/// An executed batch on its way to the file.
pub(super) struct Batch {
    pub(super) number: u64,
    /// The batch whose writes this one read last: its predecessor while that
    /// was still uncommitted, else the batch the committed snapshot ended with.
    /// A batch that read a failed batch's writes fails too.
    pub(super) read_through: u64,
    pub(super) writes: Arc<Writes>,
    pub(super) sync: bool,
    /// The length of its writes' log record, counted in the log's room
    /// (under relaxed durability only: see [`LogRoom`]).
    pub(super) record_len: u64,
    /// Acknowledgements that wait for the commit (the rest went out early).
    pub(super) acks: Vec<Ack>,
}

/// Most executed batches that may wait for the committer at once; past it the
/// executor waits, so a slow disk slows callers down instead of growing memory.
pub(super) const MAX_UNCOMMITTED_BATCHES: usize = 64;

pub(super) struct Executor {
    pub(super) progress: Arc<Progress>,
    /// Under relaxed durability, the committer's thread, woken from its
    /// linger once enough batches wait for it.
    pub(super) lingering_committer: Option<std::thread::Thread>,
    pub(super) durability: Durability,
    pub(super) max_batch: usize,
    /// Operations sent down the channel and not yet run. A caller runs its
    /// operation on its own thread only while there are none (see
    /// [`Executor::run_here`]), so no operation overtakes one submitted
    /// before it.
    pub(super) queued: AtomicUsize,
    /// Held while a batch runs and is handed over, by the executor's thread
    /// or by a caller running its operation itself.
    pub(super) state: Mutex<ExecutorState>,
    /// Set once the store stopped taking batches while open (see
    /// [`Executor::run_batch_caught`]): read without the state's lock, which
    /// the executor holds while it waits for room for its next batch.
    pub(super) stopped_by_itself: AtomicBool,
    /// Tests: batches panic in their bookkeeping while set.
    #[cfg(test)]
    pub(super) faulty: AtomicBool,
}

pub(super) struct ExecutorState {
    pub(super) uncommitted: Uncommitted,
    /// The last batch's number.
    pub(super) number: u64,
    /// Taken once the executor's thread has run every operation sent to it
    /// (the store is closing): the committer then finishes.
    pub(super) to_committer: Option<Sender<Batch>>,
}

/// The latest committed snapshot, the batch it ends with, and whether the
/// store lost acknowledged writes.
pub(super) type View = (Arc<RedbSnapshot>, u64, bool);

/// What a batch leaves to deliver once the executor's state is let go (an
/// answer's callback may submit again).
pub(super) struct Handed {
    pub(super) answers: Vec<Ack>,
}

impl Handed {
    /// `ops` refused: the committer is gone, while the store was open.
    pub(super) fn refused(ops: Vec<WriteOp>) -> Self {
        Self { answers: ops.into_iter().map(|op| (op.done, Err(StoreError::Stopped.into()))).collect() }
    }
}

impl Executor {
    /// Runs batches as they come, each over the last committed snapshot and
    /// the writes of every batch not yet committed, and never waits for a
    /// commit (short of [`MAX_UNCOMMITTED_BATCHES`]): the committer takes all
    /// the batches that ran while it wrote the previous ones in one commit.
    pub(super) fn run(&self, receiver: Receiver<WriteOp>) {
        while let Ok(first) = self.next(&receiver) {
            let mut state = self.state.lock();
            let ops = with_waiting(&receiver, first, self.max_batch);
            let count = ops.len();
            // Without a committer no room comes: refuse, rather than wait.
            let handed = if state.to_committer.is_some() {
                let view = self.view(&mut state.uncommitted);
                self.run_batch_caught(&mut state, ops, view)
            } else {
                Handed::refused(ops)
            };
            self.queued.fetch_sub(count, Ordering::Release);
            drop(state);
            // Stopped by itself, the executor goes on refusing what is sent
            // to it, as stopped, until the store is closed.
            deliver(handed.answers);
        }
        // Every operation sent was run: without its sender, the committer
        // finishes once it has the batches before.
        self.state.lock().to_committer = None;
    }

    /// Runs `op` on the calling thread, as a batch of its own, when the
    /// executor is idle: nothing queued for it, no batch running, and room for
    /// one more uncommitted batch (so the caller never waits for the disk).
    /// A caller with an event loop of its own (Node's) then gets an answer
    /// that needs no commit before the call returns, instead of a round trip
    /// to the executor's thread and back. Gives `op` back otherwise, to be
    /// sent to the executor.
    pub(super) fn run_here(&self, op: WriteOp) -> Option<WriteOp> {
        let Some(mut state) = self.state.try_lock() else { return Some(op) };
        if self.queued.load(Ordering::Acquire) != 0 || state.to_committer.is_none() {
            return Some(op);
        }
        let Some(view) = state.uncommitted.view(&self.progress.state.lock()) else { return Some(op) };
        let handed = self.run_batch_caught(&mut state, vec![op], view);
        drop(state);
        deliver(handed.answers);
        None
    }

    /// [`Executor::run_batch`], which stops the store should it panic. An
    /// operation's own panic fails that operation (see `execute`); one in the
    /// batch's bookkeeping is a bug of the store, which must not unwind into
    /// a caller running its write (a Node host aborts) nor end the executor's
    /// thread with the store still taking writes it never answers: the store
    /// then takes no more, says so in [`Store::failure`], and the batch's
    /// operations, their answers dropped, settle as unavailable.
    fn run_batch_caught(&self, state: &mut ExecutorState, ops: Vec<WriteOp>, view: View) -> Handed {
        catch_unwind(AssertUnwindSafe(|| self.run_batch(state, ops, view))).unwrap_or_else(|_| {
            self.stop_by_itself(state);
            Handed { answers: Vec::new() }
        })
    }

    /// The store takes no more batches, while open: a fault of its own, or
    /// its committer gone.
    fn stop_by_itself(&self, state: &mut ExecutorState) {
        state.to_committer = None;
        self.stopped_by_itself.store(true, Ordering::Release);
    }

    /// Runs `ops` as the next batch over `view` (see [`Uncommitted::view`]) and
    /// hands it to the committer. Returns the answers to deliver now: under
    /// relaxed durability all of them unless an operation is
    /// [`Durable::Always`] or the batch may outgrow the log
    /// ([`Executor::may_outgrow_the_log`]), else those that wrote nothing and
    /// need no fsync.
    pub(super) fn run_batch(&self, state: &mut ExecutorState, ops: Vec<WriteOp>, view: View) -> Handed {
        #[cfg(test)]
        assert!(!self.faulty.load(Ordering::Relaxed), "a fault in the batch's bookkeeping (a test's)");
        let ExecutorState { uncommitted, number, to_committer } = state;
        let Some(to_committer) = to_committer.as_ref() else { return Handed::refused(ops) };
        *number += 1;
        let number = *number;
        let (snapshot, snapshot_batch, failed) = view;
        let read_through = uncommitted.batches.newest().unwrap_or(snapshot_batch);
        let submitted_durable = match self.durability {
            Durability::Immediate => ops.iter().any(|op| op.durable != Durable::No),
            Durability::Relaxed { .. } => ops.iter().any(|op| op.durable == Durable::Always),
        };
        let (writes, acks, mut unchanged, durable_required) = {
            // A batch's leases scan the waiting index one after another:
            // one entry ahead for each operation after the first.
            let mut committed = ReadAhead::new(SnapshotReader(snapshot), ops.len().min(64).saturating_sub(1));
            let Uncommitted { batches, memo } = uncommitted;
            if batches.is_empty() {
                execute(ops, &mut committed, memo)
            } else {
                execute(ops, &mut batches.over(&mut committed), memo)
            }
        };
        // An operation submitted as needing no fsync that recorded an outcome
        // on the way (a lease that failed a job) makes its batch durable, as
        // an outcome submitted as one would.
        let record_len = match self.durability {
            Durability::Relaxed { .. } => Wal::record_len(writes.iter()) as u64,
            Durability::Immediate => 0,
        };
        let sync = submitted_durable
            || durable_required && self.durability == Durability::Immediate
            || self.may_outgrow_the_log(record_len);
        // Under relaxed durability, acknowledgements go out once the batch
        // is with the committer (a reader they wake then waits for that
        // commit, see `RedbStore::snapshot`). Under immediate durability
        // even leases wait for their commit: acknowledged early, a worker
        // would see a job before the producer saw its `add` resolve, which
        // BullMQ callers (and Redis, answering in order) never show. A
        // lease that found nothing is answered at once either way: waiting
        // for the batch's fsync only kept an idle worker from starting to
        // wait for the next job.
        // A store that lost acknowledged writes acknowledges no more
        // early: the committer refuses these, as it refuses every commit.
        let (early, late) = match self.durability {
            Durability::Relaxed { .. } if !failed && !sync => (acks, Vec::new()),
            _ => (Vec::new(), acks),
        };
        let writes = Arc::new(writes);
        uncommitted.batches.push(number, Arc::clone(&writes));
        // Under relaxed durability a batch whose answers wait for its fsync
        // (`Durable::Always`, or one that may outgrow the log) is published as
        // it runs too, in order: a later batch, answered early, moves the
        // published mark past it, and the committer publishes only batches
        // above the mark.
        let waits_in_order = sync && matches!(self.durability, Durability::Relaxed { .. }) && !failed;
        let published = (waits_in_order || !early.is_empty()).then(|| Arc::clone(&writes));
        // The batch goes on, and is published to readers, before anyone is
        // answered: an answer's callback may read the store.
        self.progress.log_room.hand(record_len);
        let batch = Batch { number, read_through, writes, sync, record_len, acks: late };
        if let Err(mpsc::SendError(batch)) = to_committer.send(batch) {
            self.progress.log_room.take_back(record_len);
            self.stop_by_itself(state);
            let refused = batch.acks.into_iter().chain(early).map(|(done, _)| (done, Err(StoreError::Stopped.into())));
            unchanged.extend(refused);
            return Handed { answers: unchanged };
        }
        if let Some(writes) = published {
            self.progress.publish(&[(number, writes)], number);
        }
        if let Some(committer) = &self.lingering_committer
            && uncommitted.batches.len() % LINGER_BATCHES == 0
        {
            committer.unpark();
        }
        unchanged.extend(early);
        Handed { answers: unchanged }
    }

    /// Under relaxed durability, whether a batch whose record is `record_len`
    /// bytes may find too little room in the log, behind the batches handed
    /// on before it ([`LogRoom`]): then it goes to redb as a checkpoint, or
    /// waits for one, durable only once that commit is, which a slow disk
    /// can take past the flush interval; such a batch is answered once it is
    /// durable, as an immediate one is.
    fn may_outgrow_the_log(&self, record_len: u64) -> bool {
        matches!(self.durability, Durability::Relaxed { .. }) && !self.progress.log_room.takes(record_len)
    }

    /// The next operation. Under relaxed durability the executor first spins
    /// for [`EXECUTOR_SPIN`]: with the committer lingering, its thread is
    /// often the only busy one besides its callers', and a thread woken on an
    /// idle core (a halted virtual CPU) took long enough that a one-at-a-time
    /// `add` ran at half speed; spinning, it ran as fast as before with a
    /// fifth less CPU.
    pub(super) fn next(&self, receiver: &Receiver<WriteOp>) -> Result<WriteOp, mpsc::RecvError> {
        if self.lingering_committer.is_some() {
            let until = Instant::now() + EXECUTOR_SPIN;
            while Instant::now() < until {
                match receiver.try_recv() {
                    Ok(op) => return Ok(op),
                    Err(mpsc::TryRecvError::Disconnected) => return Err(mpsc::RecvError),
                    Err(mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
                }
            }
        }
        receiver.recv()
    }

    /// The view the next batch runs over (see [`Uncommitted::view`]); waits
    /// while too many batches are uncommitted.
    pub(super) fn view(&self, uncommitted: &mut Uncommitted) -> View {
        let mut state = self.progress.state.lock();
        loop {
            if let Some(view) = uncommitted.view(&state) {
                return view;
            }
            self.progress.changed.wait(&mut state);
        }
    }
}

/// The batches the executor handed over whose commit is not done yet, which
/// the next batches read through.
#[derive(Default)]
pub(super) struct Uncommitted {
    pub(super) batches: PendingBatches,
    /// What operations remembered (`KvTxn::remember`), kept from batch to
    /// batch: every write the store takes is a successful operation's, which
    /// forgets what it touches, so a value stays right until a batch is given
    /// up (then the file lacks writes it was read through, and all is
    /// forgotten). Kept per batch, each batch's first operation read and
    /// decoded its queue's meta hash again: with the few operations a batch
    /// holds at low concurrency, that was a scan for every second operation.
    pub(super) memo: Memo,
}

impl Uncommitted {
    /// The view the next batch runs over, after forgetting the batches the
    /// committer is done with (committed, or failed and so never to be
    /// read); none while [`MAX_UNCOMMITTED_BATCHES`] remain.
    pub(super) fn view(&mut self, committed: &Committed) -> Option<View> {
        while let Some(n) = self.batches.oldest()
            && n <= committed.batch
        {
            if n > committed.snapshot_batch {
                self.memo.clear();
            }
            self.batches.forget_oldest();
        }
        if committed.unreadable.is_some() {
            self.memo.clear();
        }
        (self.batches.len() < MAX_UNCOMMITTED_BATCHES)
            .then(|| (Arc::clone(&committed.snapshot), committed.snapshot_batch, committed.unreadable.is_some()))
    }
}

/// `first` and what else is waiting in `receiver` already, up to `max` in all.
pub(super) fn with_waiting<T>(receiver: &Receiver<T>, first: T, max: usize) -> Vec<T> {
    let mut items = vec![first];
    while items.len() < max {
        match receiver.try_recv() {
            Ok(item) => items.push(item),
            Err(_) => break,
        }
    }
    items
}

/// Runs a batch's operations one after another in the batch's overlay (a
/// failed one is taken back whole). Returns the batch's writes, the
/// acknowledgements that must wait for its commit, and those that need not:
/// an operation that needs no fsync ([`Durable::No`]: a lease, a lock extension) and wrote
/// nothing (a lease that found no job) told its caller nothing a crash could
/// take back. Also returns whether an operation asked for its fsync as it
/// ran ([`KvTxn::require_durable`]).
pub(super) fn execute(ops: Vec<WriteOp>, base: &mut dyn KvRead, memo: &mut Memo) -> (Writes, Vec<Ack>, Vec<Ack>, bool) {
    let mut acks = Vec::with_capacity(ops.len());
    let mut unchanged = Vec::new();
    let mut durable_required = false;
    let mut batch = Overlay::caching(base).remembering(memo);
    for op in ops {
        let WriteOp { mut body, done, durable, .. } = op;
        // A bug in an operation must fail that operation, not the writer
        // thread and with it every caller (and a Node host).
        let result =
            catch_unwind(AssertUnwindSafe(|| body(&mut batch))).unwrap_or_else(|panic| Err(JobsError::panicked(panic)));
        let end = batch.end_operation(result.is_ok());
        durable_required |= end.durable_required;
        if durable == Durable::No && !end.wrote {
            unchanged.push((done, result));
            continue;
        }
        acks.push((done, result));
    }
    (batch.into_writes(), acks, unchanged, durable_required)
}

/// Under relaxed durability, how long the executor spins for the next
/// operation before it sleeps (see `Executor::next`).
pub(super) const EXECUTOR_SPIN: Duration = Duration::from_micros(50);
