//! The committer: makes each group of batches durable (one record and one
//! fsync in the write-ahead log), answers their operations, and hands the
//! group to the file writer; it also starts checkpoints and flushes.

use super::executor::with_waiting;
use super::*;

/// Most batches one commit takes.
pub(super) const MAX_BATCHES_PER_COMMIT: usize = 256;

/// Under relaxed durability, how long the committer may wait for more batches
/// to commit with the first one, and how many end the wait (well under
/// [`MAX_UNCOMMITTED_BATCHES`], so the executor never waits for a linger).
pub(super) const COMMIT_LINGER: Duration = Duration::from_millis(2);
pub(super) const LINGER_BATCHES: usize = 16;

/// How often the committer looks for the outcome of a checkpoint under way
/// while no batch comes.
pub(super) const CHECKPOINT_POLL: Duration = Duration::from_millis(5);

pub(super) struct Committer {
    pub(super) progress: Arc<Progress>,
    pub(super) durability: Durability,
    /// When the oldest commit not yet flushed to disk was made.
    pub(super) unflushed_since: Option<Instant>,
    /// The last batch whose commit failed: a batch that read its writes fails too.
    pub(super) last_failed: u64,
    /// The log failed (an append, an fsync, a restart): nothing more may be
    /// made durable through it. The store may break for other reasons (redb
    /// failed, the file writer ended) with its log sound, and then still
    /// flushes what relaxed durability answered.
    pub(super) log_broken: bool,
    /// How commits are made durable and reach redb.
    pub(super) file: File,
    pub(super) checkpoint_interval: Duration,
    pub(super) last_checkpoint: Instant,
    /// The checkpoint the file writer is making, if any: commits go on in
    /// the log's other region meanwhile.
    pub(super) checkpointing: Option<mpsc::Receiver<Result<(), StoreError>>>,
}

/// How the committer's groups are made durable and reach the redb file.
pub(super) enum File {
    /// Without a log (a store in memory): redb's own commits make them
    /// durable, on the committer's thread, before acknowledging.
    Inline(FileWriter),
    /// The write-ahead log makes them durable; the file writer's thread
    /// writes them into redb after acknowledging.
    Logged { wal: Wal, to_file: Sender<ToFile> },
}

/// A committed group on its way into the file: the writes of its batches that
/// did not fail (each with its number), and the last batch of the group, done
/// with once the group is written (or at once, when nothing of it is left).
pub(super) struct Group {
    pub(super) batches: Vec<(u64, Arc<Writes>)>,
    pub(super) last: u64,
}

pub(super) enum ToFile {
    /// Written without fsync: the log answers for it.
    Group(Group),
    /// A durable commit that also stores the log's next `generation`, with a
    /// group too large for the log, or none; answered on `done` once made.
    Checkpoint { group: Option<Group>, generation: u64, done: mpsc::SyncSender<Result<(), StoreError>> },
}

impl Committer {
    pub(super) fn flush_interval(&self) -> Duration {
        match self.durability {
            Durability::Immediate => IMMEDIATE_MODE_IDLE_FLUSH,
            Durability::Relaxed { flush_interval_ms } => Duration::from_millis(flush_interval_ms),
        }
    }

    pub(super) fn run(mut self, receiver: Receiver<Batch>) {
        loop {
            #[cfg(test)]
            self.progress.committer_turns.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let first = match self.next_wake() {
                None => match receiver.recv() {
                    Ok(b) => b,
                    Err(_) => break,
                },
                Some(wait) => match receiver.recv_timeout(wait) {
                    Ok(b) => b,
                    Err(RecvTimeoutError::Timeout) => {
                        self.checkpoint_done(false);
                        if self.flush_due() {
                            self.flush();
                        }
                        if self.checkpoint_due() {
                            self.start_checkpoint();
                            self.progress.log_room.taken(0, self.room());
                        }
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                },
            };
            let batches = self.gather(&receiver, first);
            let record_len = batches.iter().map(|b| b.record_len).sum();
            self.checkpoint_done(false);
            #[cfg(test)]
            let progress = Arc::clone(&self.progress);
            #[cfg(test)]
            let gate = progress.committer_gate.lock();
            self.commit(batches);
            #[cfg(test)]
            drop(gate);
            if self.flush_due() {
                self.flush();
            }
            if self.checkpoint_due() {
                self.start_checkpoint();
            }
            self.progress.log_room.taken(record_len, self.room());
        }
        self.flush();
        // Closed cleanly, the file holds everything by itself.
        let _ = self.checkpoint(None);
    }

    /// Group commit: `first` and every batch that ran while the last commit
    /// was written. Under relaxed durability, whose callers were answered
    /// already, also those that come within [`COMMIT_LINGER`], until
    /// [`LINGER_BATCHES`] are in (the executor then unparks this thread; a
    /// read does not wait for them, see [`Progress::publish`]): each commit
    /// costs a log append and a redb transaction (copied and checksummed
    /// pages) that are much the same for one small batch as for many, and
    /// committed one at a time the batches of a one-at-a-time `add` took a
    /// third of its CPU. The committer sleeps
    /// rather than wait on the channel, so a batch sent meanwhile wakes
    /// nobody.
    pub(super) fn gather(&self, receiver: &Receiver<Batch>, first: Batch) -> Vec<Batch> {
        let mut batches = with_waiting(receiver, first, MAX_BATCHES_PER_COMMIT);
        if let Durability::Relaxed { .. } = self.durability {
            let until = Instant::now() + COMMIT_LINGER;
            loop {
                let now = Instant::now();
                if batches.len() >= LINGER_BATCHES || now >= until {
                    break;
                }
                std::thread::park_timeout(until - now);
                match receiver.try_recv() {
                    Ok(batch) => batches.push(batch),
                    Err(mpsc::TryRecvError::Empty) => continue,
                    Err(mpsc::TryRecvError::Disconnected) => break,
                }
                while batches.len() < MAX_BATCHES_PER_COMMIT
                    && let Ok(batch) = receiver.try_recv()
                {
                    batches.push(batch);
                }
            }
        }
        batches
    }

    /// Makes every commit so far durable: an fsync of the log, or without a
    /// log an empty durable commit, which makes every earlier one durable.
    pub(super) fn flush(&mut self) {
        if self.unflushed_since.is_none() {
            return;
        }
        if self.log_broken {
            // Nothing can be made durable any more: waking to try again
            // would only spin the committer.
            self.unflushed_since = None;
            return;
        }
        let result = match &mut self.file {
            File::Logged { wal, .. } => wal.sync().map_err(io),
            File::Inline(file) => file.write(&[], true, None),
        };
        match result {
            Ok(()) => self.unflushed_since = None,
            Err(e) => self.break_log(e),
        }
    }

    /// How long the committer may wait for a batch: until the oldest
    /// unflushed commit is due a flush, and no longer than
    /// [`CHECKPOINT_POLL`] while a checkpoint is under way (a failed one must
    /// stop the store at once, not at the next commit).
    pub(super) fn next_wake(&self) -> Option<Duration> {
        let flush = self.unflushed_since.map(|since| self.flush_interval().saturating_sub(since.elapsed()));
        let checkpoint = match &self.file {
            _ if self.checkpointing.is_some() => Some(CHECKPOINT_POLL),
            // An idle store checkpoints too, a second after the last: its
            // log's records are not replayed for ever after a crash, and
            // redb's freed pages are not held from reuse until the next write
            // (not once the store refuses commits: it would wake at once, for
            // ever; asked only then, off the busy path).
            File::Logged { wal, .. } if !wal.is_empty() => {
                let left = self.checkpoint_interval.saturating_sub(self.last_checkpoint.elapsed());
                (!left.is_zero() || self.refusal().is_none()).then_some(left)
            }
            _ => None,
        };
        match (flush, checkpoint) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The room left in the log's region being written (all of it without a log).
    pub(super) fn room(&self) -> u64 {
        match &self.file {
            File::Logged { wal, .. } => wal.room(),
            File::Inline(_) => u64::MAX,
        }
    }

    pub(super) fn flush_due(&self) -> bool {
        self.unflushed_since.is_some_and(|since| since.elapsed() >= self.flush_interval())
    }

    /// Asks the file writer for a durable redb commit, which makes every
    /// record of the log's current generation redundant once made (the file
    /// writer has written every group sent before it by then, since it takes
    /// them in order), and goes on at once under the next generation, in the
    /// log's other region. Commits do not wait for the checkpoint: a second
    /// of writes made durable took 12-43 ms at 40k jobs/s, every commit
    /// stopped meanwhile. The next checkpoint, which writes this one's region
    /// again, is not due until this one is done (see `checkpoint_due`).
    pub(super) fn start_checkpoint(&mut self) {
        self.checkpoint_done(true);
        if self.refusal().is_some() {
            return;
        }
        let File::Logged { wal, to_file } = &mut self.file else { return };
        let generation = wal.generation() + 1;
        // Before anything of the next generation is written (see `Wal::restart`).
        if let Err(e) = wal.restart(generation) {
            self.break_log(io(e));
            return;
        }
        self.unflushed_since = None;
        let (done, answer) = mpsc::sync_channel(1);
        if to_file.send(ToFile::Checkpoint { group: None, generation, done }).is_err() {
            self.file_writer_gone();
            return;
        }
        self.last_checkpoint = Instant::now();
        self.checkpointing = Some(answer);
    }

    /// Takes the outcome of the checkpoint under way, if it is in (or,
    /// `waiting`, once it is). A failed one breaks the store: every later
    /// commit says so.
    pub(super) fn checkpoint_done(&mut self, waiting: bool) {
        let Some(answer) = &self.checkpointing else { return };
        let answered = if waiting {
            answer.recv().ok()
        } else {
            match answer.try_recv() {
                Ok(r) => Some(r),
                Err(mpsc::TryRecvError::Empty) => return,
                Err(mpsc::TryRecvError::Disconnected) => None,
            }
        };
        self.checkpointing = None;
        match answered {
            None => self.file_writer_gone(),
            Some(Err(e)) => self.break_store(e),
            Some(Ok(())) => {}
        }
    }

    /// A durable redb commit (with `group`, when it does not fit in the log)
    /// made before this returns, after any under way: the log starts over
    /// under the next generation.
    pub(super) fn checkpoint(&mut self, group: Option<Group>) -> Result<(), StoreError> {
        // What relaxed durability answered is made durable first: the waits
        // below (a checkpoint under way, then this one's durable commit) may
        // outlast the flush interval, and nobody flushes the log meanwhile.
        if matches!(self.file, File::Logged { .. }) {
            self.flush();
        }
        self.checkpoint_done(true);
        if let Some(e) = self.refusal() {
            // The file writer is done with the group's batches, which fail.
            if let Some(group) = group {
                self.done_with(group.last);
            }
            return Err(e);
        }
        let File::Logged { wal, to_file } = &mut self.file else { return Ok(()) };
        let generation = wal.generation() + 1;
        let (done, answer) = mpsc::sync_channel(1);
        let answered =
            to_file.send(ToFile::Checkpoint { group, generation, done }).ok().and_then(|()| answer.recv().ok());
        let Some(committed) = answered else {
            self.file_writer_gone();
            return Err(StoreError::Stopped);
        };
        if let Err(e) = committed {
            self.break_store(e.clone());
            return Err(e);
        }
        self.last_checkpoint = Instant::now();
        self.unflushed_since = None;
        // redb now holds the generation durably, the group with it: what the
        // log's records were to make durable is, and the fsync `restart`
        // makes is all but free. Should it fail, later commits are refused,
        // but the group is in, and succeeded.
        if let Err(e) = wal.restart(generation) {
            self.break_log(io(e));
        }
        Ok(())
    }

    /// Why no commit may be made: the store broke, or the file writer failed
    /// to write a group that was acknowledged. A checkpoint then would retire
    /// the log generation that holds the group, and lose it for good if redb
    /// took the commit (redb 4.6 refuses every commit after an I/O error, but
    /// not every error is one).
    fn refusal(&self) -> Option<StoreError> {
        self.progress.state.lock().refusal()
    }

    /// Not while one is under way: starting the next waits for it, and the
    /// committer would stop appending and flushing the log for as long as
    /// redb's durable commit takes (relaxed writes acknowledged meanwhile
    /// unlogged past the flush interval). The region being written still has
    /// room (a checkpoint starts at half of it), and a group that does not
    /// fit waits for the checkpoint anyway.
    pub(super) fn checkpoint_due(&self) -> bool {
        self.checkpointing.is_none()
            && matches!(&self.file, File::Logged { wal, .. }
                if !wal.is_empty() && (wal.half_full() || self.last_checkpoint.elapsed() >= self.checkpoint_interval))
    }

    /// Makes `batches` durable and hands them to the file. With a log, the
    /// group's record goes to the log (fsynced when `sync` asks for it), the
    /// batches' operations are acknowledged here, and the file writer commits
    /// them to redb without fsync on its own thread, behind the log: a crash
    /// in between is what the log's replay redoes, so redb's commit is off
    /// the operations' latency and off the next group's. A group too large
    /// for what is left of the log is committed durably to redb instead, as a
    /// checkpoint, and acknowledged by the caller afterwards; the longest run
    /// of its batches from the first that fits is logged first, fsynced.
    /// Under relaxed durability those were answered already: committed with
    /// the rest, they stayed unsynced for as long as redb's durable commit
    /// took, past the flush interval, whenever they were gathered with a
    /// large batch into one group. Without a log, redb's commit (durable when
    /// `sync`) is made here, before acknowledging.
    pub(super) fn write(&mut self, batches: &mut [Batch], sync: bool, last: u64) -> Result<(), StoreError> {
        if let Some(e) = self.refusal() {
            return Err(self.fail(e, last));
        }
        let wal = match &mut self.file {
            File::Inline(file) => return file.write(&[group_of(batches, last)], sync, None),
            File::Logged { wal, .. } => wal,
        };
        let room = wal.room();
        let Some(record) = Wal::encode_within(net_writes(batches.iter().map(|b| b.writes.as_ref())), room) else {
            let Some((n, record)) = longest_run_that_fits(batches, room) else {
                return self.checkpoint(Some(group_of(batches, last)));
            };
            if let Err(e) = append(wal, record, true) {
                return Err(self.fail_log(e, last));
            }
            self.unflushed_since = None;
            let (logged, rest) = batches.split_at_mut(n);
            self.hand_on_logged(logged, logged[n - 1].number);
            return self.checkpoint(Some(group_of(rest, last)));
        };
        if let Err(e) = append(wal, record, sync) {
            return Err(self.fail_log(e, last));
        }
        self.hand_on_logged(batches, last);
        Ok(())
    }

    /// Publishes `batches` (up to batch `last`), whose record the log took,
    /// hands them to the file writer and answers their operations.
    fn hand_on_logged(&mut self, batches: &mut [Batch], last: u64) {
        // Acknowledged before the file writer has the group (it refuses
        // reads if it then fails to write what was acknowledged), and
        // readable from here on; answered after (an answer's callback may
        // read it).
        let group = group_of(batches, last);
        self.progress.publish(&group.batches, group.last);
        self.to_file(ToFile::Group(group));
        deliver(batches.iter_mut().flat_map(|b| b.acks.drain(..)));
    }

    /// The log failed (or had): every later commit fails with `e`, and the
    /// batches up to `last` are given up. Under relaxed durability they were
    /// acknowledged already, so the store refuses reads from now on rather
    /// than show a state without them, and the executor acknowledges nothing
    /// early any more; reopening replays what the log kept.
    pub(super) fn fail(&mut self, e: StoreError, last: u64) -> StoreError {
        self.break_store(e.clone());
        self.done_with(last);
        e
    }

    /// An append to the log failed: [`Committer::fail`], and nothing more is
    /// flushed through it.
    fn fail_log(&mut self, e: StoreError, last: u64) -> StoreError {
        self.log_broken = true;
        self.fail(e, last)
    }

    /// The log failed: [`Committer::break_store`], and nothing more is
    /// flushed through it.
    fn break_log(&mut self, e: StoreError) {
        self.log_broken = true;
        self.break_store(e);
    }

    /// A log append or fsync, or a checkpoint, failed: every later commit
    /// fails with `e`, as redb's own do after an I/O error. Under relaxed
    /// durability the writes since the last flush were acknowledged already
    /// and will now not be made durable, so reads fail too.
    pub(super) fn break_store(&self, e: StoreError) {
        let mut state = self.progress.state.lock();
        if matches!(self.durability, Durability::Relaxed { .. }) {
            state.unreadable.get_or_insert_with(|| e.clone());
        }
        // The first cause stays: a checkpoint failing after the log did
        // would hide why the store broke.
        state.broken.get_or_insert(e);
    }

    /// Tells the file writer that the batches up to `last` failed: it is done
    /// with them once it has written what came before.
    pub(super) fn done_with(&self, last: u64) {
        let group = Group { batches: Vec::new(), last };
        match &self.file {
            File::Inline(file) => {
                let _ = file.write(&[group], false, None);
            }
            File::Logged { .. } => self.to_file(ToFile::Group(group)),
        }
    }

    pub(super) fn to_file(&self, message: ToFile) {
        // The file writer ends only after the committer does, unless a fault
        // of its own ended it.
        if let File::Logged { to_file, .. } = &self.file
            && to_file.send(message).is_err()
        {
            self.file_writer_gone();
        }
    }

    /// A send to the file writer failed: it ended by a fault of its own,
    /// and told the store so as it did.
    fn file_writer_gone(&self) {
        self.progress.file_writer_ended();
    }

    /// Commits `batches` (in order) as one group, except those that read a
    /// failed batch's writes, which fail with its error.
    pub(super) fn commit(&mut self, batches: Vec<Batch>) {
        let last = batches.last().map_or(0, |b| b.number);
        let mut doomed = Vec::new();
        let mut good = Vec::with_capacity(batches.len());
        for batch in batches {
            if batch.read_through != 0 && batch.read_through == self.last_failed {
                self.last_failed = batch.number;
                doomed.push(batch);
            } else {
                good.push(batch);
            }
        }
        let sync = good.iter().any(|b| b.sync);
        let result = if good.is_empty() {
            self.done_with(last);
            Ok(())
        } else {
            self.write(&mut good, sync, last)
        };
        let failure = match result {
            Ok(()) => {
                if !good.is_empty() {
                    if sync {
                        self.unflushed_since = None;
                    } else if self.unflushed_since.is_none() {
                        self.unflushed_since = Some(Instant::now());
                    }
                }
                deliver(good.into_iter().flat_map(|b| b.acks));
                None
            }
            Err(e) => {
                self.last_failed = good.last().map_or(self.last_failed, |b| b.number);
                deliver(good.into_iter().flat_map(|b| b.acks).map(|(done, _)| (done, Err(JobsError::from(e.clone())))));
                Some(e)
            }
        };
        if !doomed.is_empty() {
            let e = failure.unwrap_or_else(|| StoreError::Io("an earlier commit failed".into()));
            deliver(doomed.into_iter().flat_map(|b| b.acks).map(|(done, _)| (done, Err(JobsError::from(e.clone())))));
        }
    }
}

/// The group `batches` make, up to batch `last`.
fn group_of(batches: &[Batch], last: u64) -> Group {
    Group { batches: batches.iter().map(|b| (b.number, Arc::clone(&b.writes))).collect(), last }
}

/// The longest run of `batches` from the first, short of all of them, whose
/// record fits in `room`, with that record; none when not even the first
/// batch's does. Tried from the longest down, each run only sized (a run's
/// net writes need not grow with its length), and only the run found
/// encoded; groups this large are rare.
fn longest_run_that_fits(batches: &[Batch], room: u64) -> Option<(usize, Vec<u8>)> {
    let run = |n: usize| net_writes(batches[..n].iter().map(|b| b.writes.as_ref()));
    let fits = |n: usize| Wal::record_len(run(n)) as u64 <= room;
    let n = (1..batches.len()).rev().find(|&n| fits(n))?;
    Wal::encode_within(run(n), room).map(|record| (n, record))
}

/// Appends `record` to the log, fsynced when `sync`.
fn append(wal: &mut Wal, record: Vec<u8>, sync: bool) -> Result<(), StoreError> {
    let Err(e) = wal.append(record).and_then(|()| if sync { wal.sync() } else { Ok(()) }) else { return Ok(()) };
    // The record may be written, whole or in part: unwritten, the group's
    // failure is what a reopen finds; nothing more may follow it either way.
    Err(match wal.retract_last() {
        Ok(()) => io(e),
        Err(again) => StoreError::Io(format!(
            "{e}; the write may still take effect (its log record could not be taken back: {again})"
        )),
    })
}
