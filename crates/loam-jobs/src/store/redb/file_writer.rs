//! The file writer: writes the logged groups into one redb transaction
//! without fsync (with one at a checkpoint), and publishes the new snapshot.

use super::*;

/// Most groups the file writer takes into one redb transaction.
pub(super) const MAX_GROUPS_PER_FILE_COMMIT: usize = 64;

/// Writes groups into the redb file and publishes each new snapshot, which
/// readers and the executor go on from.
pub(super) struct FileWriter {
    pub(super) db: Arc<Database>,
    pub(super) progress: Arc<Progress>,
    /// Under relaxed durability a failed checkpoint refuses reads at once:
    /// the committer, which learns of it within `CHECKPOINT_POLL`, then
    /// refuses the writes acknowledged early meanwhile.
    pub(super) relaxed: bool,
}

impl FileWriter {
    /// Behind a log: takes every group waiting in one transaction; a
    /// checkpoint is made in its turn and answered.
    pub(super) fn run(self, receiver: Receiver<ToFile>) {
        // Dropped before the receiver, so the store knows before any send to
        // this thread fails, and messages already queued are done with too.
        let _ending = Ending(&self.progress);
        let mut next = None;
        loop {
            let first = match next.take() {
                Some(message) => message,
                None => match receiver.recv() {
                    Ok(message) => message,
                    Err(_) => return,
                },
            };
            #[cfg(test)]
            assert!(!self.progress.file_writer_faulty.load(std::sync::atomic::Ordering::Relaxed), "a fault (a test's)");
            match first {
                ToFile::Checkpoint { group, generation, done } => {
                    let groups: Vec<Group> = group.into_iter().collect();
                    let _ = done.send(self.write(&groups, true, Some(generation)));
                }
                ToFile::Group(group) => {
                    let mut groups = vec![group];
                    while groups.len() < MAX_GROUPS_PER_FILE_COMMIT {
                        match receiver.try_recv() {
                            Ok(ToFile::Group(group)) => groups.push(group),
                            Ok(checkpoint) => {
                                next = Some(checkpoint);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    // A failure is published (reads and the committer stop on it).
                    let _ = self.write(&groups, false, None);
                }
            }
        }
    }

    /// One redb transaction with the groups' writes (and the log generation
    /// a checkpoint starts), fsynced when `durable`; then the groups are done
    /// with. If it fails after any of their operations were acknowledged
    /// (their record is in the log), the store refuses reads from then on.
    pub(super) fn write(&self, groups: &[Group], durable: bool, generation: Option<u64>) -> Result<(), StoreError> {
        #[cfg(test)]
        let _gate = self.progress.file_gate.lock();
        let batches: Vec<&(u64, Arc<Writes>)> = groups.iter().flat_map(|g| &g.batches).collect();
        // A checkpoint retires the log generation before it: not once the
        // store refuses commits, since this thread may have failed to write a
        // group of it, whose record only the log then holds (the committer
        // looked before that group's turn came).
        let refused = generation.and_then(|_| self.progress.state.lock().refusal());
        let result = if let Some(e) = refused {
            Err(e)
        } else if batches.is_empty() && !durable && generation.is_none() {
            Ok(None)
        } else {
            self.commit(&batches, durable, generation).and_then(|()| RedbSnapshot::new(&self.db)).map(Some)
        };
        let outcome = {
            let mut state = self.progress.state.lock();
            if let Some(last) = groups.iter().map(|g| g.last).max() {
                state.done_through(last);
            }
            match result {
                Ok(Some(snapshot)) => {
                    state.snapshot = Arc::new(snapshot);
                    if let Some((newest, _)) = batches.last() {
                        state.snapshot_batch = *newest;
                    }
                    Ok(())
                }
                Ok(None) => Ok(()),
                Err(e) => {
                    if batches.first().is_some_and(|(first, _)| state.published >= *first) || durable && self.relaxed {
                        state.unreadable = Some(e.clone());
                    }
                    Err(e)
                }
            }
        };
        self.progress.changed.notify_all();
        outcome
    }

    pub(super) fn commit(
        &self,
        batches: &[&(u64, Arc<Writes>)],
        durable: bool,
        generation: Option<u64>,
    ) -> Result<(), StoreError> {
        let txn = if durable {
            begin_durable_write(&self.db)?
        } else {
            let mut txn = self.db.begin_write().map_err(io)?;
            txn.set_durability(redb::Durability::None).map_err(io)?;
            txn
        };
        {
            let mut table = txn.open_table(TABLE).map_err(io)?;
            apply(&mut table, net_writes(batches.iter().map(|(_, writes)| writes.as_ref())))?;
        }
        if let Some(generation) = generation {
            store_generation(&txn, generation)?;
        }
        txn.commit().map_err(io)
    }
}

/// Held while the file writer runs: a panic's unwinding drops it, and the
/// store learns that its file writer ended (see [`Progress::file_writer_ended`]).
struct Ending<'a>(&'a Progress);

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.file_writer_ended();
        }
    }
}
