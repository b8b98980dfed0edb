//! What the committer has done, for the executor and for readers: the last
//! batch done with, the file's snapshot, and the batches published to readers
//! that the file writer has not written yet.

use super::*;

/// What the committer has done, for the executor and for readers.
pub(super) struct Progress {
    pub(super) state: Mutex<Committed>,
    pub(super) changed: Condvar,
    pub(super) log_room: LogRoom,
    /// Tests: how many times the committer's loop went round.
    #[cfg(test)]
    pub(super) committer_turns: std::sync::atomic::AtomicU64,
    /// Tests: held, it keeps the file writer from writing.
    #[cfg(test)]
    pub(super) file_gate: Mutex<()>,
    /// Tests: held, it keeps the committer from committing.
    #[cfg(test)]
    pub(super) committer_gate: Mutex<()>,
    /// Tests: set, the file writer panics at the next message it takes.
    #[cfg(test)]
    pub(super) file_writer_faulty: std::sync::atomic::AtomicBool,
}

/// What the executor knows of the log's room, under relaxed durability: a
/// batch is answered as it runs only if the log will take its record, with
/// those of every batch handed on before it, without waiting for a
/// checkpoint. A committer that waits for one (a group found no room while
/// the last checkpoint was under way) logs nothing meanwhile, and the writes
/// answered before it stayed unsynced for as long as redb's durable commit
/// took, past the flush interval.
pub(super) struct LogRoom {
    /// The room left in the log's region being written, as of the
    /// committer's last append or new region (all of it without a log).
    room: AtomicU64,
    /// The record bytes of the batches handed to the committer that it has
    /// not taken yet (logged, committed to redb, or failed).
    unlogged: AtomicU64,
}

impl LogRoom {
    /// Whether the log takes a record of `len` bytes behind those handed on.
    pub(super) fn takes(&self, len: u64) -> bool {
        // `unlogged` first: the committer lowers `room` before `unlogged`,
        // so an `unlogged` that no longer counts a record comes with a room
        // that no longer has it.
        let unlogged = self.unlogged.load(Ordering::Acquire);
        unlogged.saturating_add(len) <= self.room.load(Ordering::Acquire)
    }

    /// A batch with a record of `len` bytes goes to the committer.
    pub(super) fn hand(&self, len: u64) {
        self.unlogged.fetch_add(len, Ordering::AcqRel);
    }

    /// A batch [handed](Self::hand) on did not reach the committer after all.
    pub(super) fn take_back(&self, len: u64) {
        self.unlogged.fetch_sub(len, Ordering::AcqRel);
    }

    /// The room last published, and what is handed on and not taken (tests).
    #[cfg(test)]
    pub(super) fn room_and_unlogged(&self) -> (u64, u64) {
        (self.room.load(Ordering::Acquire), self.unlogged.load(Ordering::Acquire))
    }

    /// The committer took batches whose records came to `len` bytes, and
    /// its log's region has `room` left.
    pub(super) fn taken(&self, len: u64, room: u64) {
        self.room.store(room, Ordering::Release);
        self.unlogged.fetch_sub(len, Ordering::AcqRel);
    }
}

impl Progress {
    /// Nothing committed or acknowledged yet; reads start from `snapshot`.
    pub(super) fn new(snapshot: RedbSnapshot) -> Self {
        let state = Committed {
            batch: 0,
            unreadable: None,
            broken: None,
            snapshot: Arc::new(snapshot),
            snapshot_batch: 0,
            published: 0,
            unapplied: VecDeque::new(),
        };
        Self {
            state: Mutex::new(state),
            changed: Condvar::new(),
            // None until the store, as it starts, says what its log has.
            log_room: LogRoom { room: AtomicU64::new(0), unlogged: AtomicU64::new(0) },
            #[cfg(test)]
            committer_turns: std::sync::atomic::AtomicU64::new(0),
            #[cfg(test)]
            file_gate: Mutex::new(()),
            #[cfg(test)]
            committer_gate: Mutex::new(()),
            #[cfg(test)]
            file_writer_faulty: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// `batches` (up to `last`, the failed ones left out) are about to be
    /// acknowledged: readers see them from now on, over the snapshot, until
    /// the file writer has written them into the file. The executor publishes
    /// a batch it acknowledges early (relaxed durability), so a read never
    /// waits for its commit; the committer publishes the rest once logged.
    /// The marks never move back: under relaxed durability the committer
    /// logs a batch after the executor published newer ones.
    pub(super) fn publish(&self, batches: &[(u64, Arc<Writes>)], last: u64) {
        let mut state = self.state.lock();
        for (number, writes) in batches {
            if *number > state.published {
                state.unapplied.push_back((*number, Arc::clone(writes)));
            }
        }
        state.published = state.published.max(last);
    }

    /// The file writer ended by a fault of its own (it panicked): nothing
    /// will write what was logged into the file, nor be done with any batch,
    /// queued for it or to come. The store refuses commits and reads (the
    /// writes the file lacks are in the log, which a reopen replays), and
    /// every batch is done with from here: the executor would otherwise wait
    /// for room for ever, and every write with it.
    pub(super) fn file_writer_ended(&self) {
        let mut state = self.state.lock();
        state.broken.get_or_insert(StoreError::Stopped);
        state.unreadable.get_or_insert(StoreError::Stopped);
        state.done_through(u64::MAX);
        drop(state);
        self.changed.notify_all();
    }
}

/// Hands each operation its result. A completion that panics (a bug in the
/// caller's callback) is contained: the store's thread that ran it goes on,
/// or every later commit and read would wait for it for ever.
pub(super) fn deliver(acks: impl IntoIterator<Item = Ack>) {
    for (done, result) in acks {
        let _ = catch_unwind(AssertUnwindSafe(move || done(result)));
    }
}

pub(super) struct Committed {
    /// The last batch that is done with: in the file, or failed.
    pub(super) batch: u64,
    /// Why the file lacks writes that were acknowledged (their commit failed
    /// after they were logged, or under relaxed durability): reads fail from
    /// then on rather than show older state than callers were told of.
    /// Reopening replays what the log holds.
    pub(super) unreadable: Option<StoreError>,
    /// Why commits are refused (the log or a checkpoint failed, or the file
    /// writer is gone): from then on every commit fails, as redb's own do
    /// after an I/O error, so nothing is acknowledged that may not survive.
    pub(super) broken: Option<StoreError>,
    /// The file as of the last successful commit.
    pub(super) snapshot: Arc<RedbSnapshot>,
    /// The batch that `snapshot` ends with.
    pub(super) snapshot_batch: u64,
    /// The last batch published to readers (see [`Progress::publish`]):
    /// logged, or acknowledged early under relaxed durability. A batch is
    /// published before its operations are answered.
    pub(super) published: u64,
    /// The published batches the file writer has not written yet, in order:
    /// a read sees them over the snapshot instead of waiting for redb's
    /// commit (or, acknowledged early, for the log).
    pub(super) unapplied: VecDeque<(u64, Arc<Writes>)>,
}

impl Committed {
    /// Why no commit may be made: the log or a checkpoint failed, the file
    /// writer failed to write a group that was acknowledged, or it ended.
    pub(super) fn refusal(&self) -> Option<StoreError> {
        self.broken.clone().or_else(|| self.unreadable.clone())
    }

    /// The batches up to `last` are done with (written into the file, or
    /// given up): the executor forgets them, and reads stop looking for them
    /// over the snapshot.
    pub(super) fn done_through(&mut self, last: u64) {
        self.batch = self.batch.max(last);
        while self.unapplied.front().is_some_and(|(n, _)| *n <= last) {
            self.unapplied.pop_front();
        }
    }
}
