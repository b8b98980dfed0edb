//! The context an operation runs in: one store transaction, one `now`, the
//! queues' counters read once and written back once, and the effects
//! (wake-ups, timers) to apply after the commit.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::config::{Config, QueueConfig};
use crate::error::JobsError;
use crate::keys::EVENTS_PER_PAGE;
use crate::keys::{self, QueueId, QueueKeys};
use crate::kv::{Key, KeyRange, KvTxn, Value};
use crate::model::{self, ChildCounts, EventPlacement, EventRef, JobRecord, JobState, QueueRemains, QueueStats};

/// A meta field's text as a count: a whole number, 0 or more (BullMQ writes
/// some as floats, `5.0`); None for anything else. What the store reads a
/// limit as, and what `set_meta` lets a limit be.
pub(crate) fn meta_count(text: &str) -> Option<u64> {
    text.trim().parse::<f64>().ok().filter(|n| *n >= 0.0 && n.fract() == 0.0).map(|n| n as u64)
}

/// What to do once the transaction has committed.
#[derive(Default, Debug)]
pub struct Effects {
    pub wake_jobs: BTreeSet<QueueId>,
    pub wake_events: BTreeSet<QueueId>,
    /// Queues with a delayed job due at this time.
    pub timers: Vec<(QueueId, u64)>,
    /// Queues seen for the first time.
    pub new_queues: Vec<QueueId>,
    /// Queues whose stalled-job interval changed: swept at once, and on at
    /// the new interval (the next sweep was set by the old one).
    pub sweep_now: Vec<QueueId>,
}

struct QueueCache {
    /// The queue's key prefix, built once: an operation makes a dozen keys.
    keys: QueueKeys,
    stats: QueueStats,
    dirty: bool,
    /// The queue had no counters yet: its first write registers it.
    new: bool,
    /// It had been obliterated: its counters start from what it left
    /// (`keys::queue_remains`), which its first write takes over.
    reborn: bool,
    config: Option<QueueConfig>,
    max_events: Option<u64>,
    /// The meta hash, read with one scan on first use (or recalled from an
    /// earlier operation).
    meta: Option<Arc<MetaMap>>,
}

type MetaMap = std::collections::BTreeMap<String, String>;

pub struct Tx<'a> {
    kv: &'a mut dyn KvTxn,
    /// The namespace the operation runs in; flows and parents stay inside it.
    pub ns: String,
    pub now: u64,
    /// The store's open count. Leases are not fsynced, so a crash can lose
    /// one; epochs handed out after a reopen start above `generation << 32`,
    /// so a lost lease's epoch is never handed out again.
    pub generation: u64,
    /// The time leases are judged by: their deadlines and their expiry. Like a
    /// lock's TTL on Redis it runs in real time even when `now` is a caller's
    /// (faked) time; by default it is `now`.
    pub lease_now: u64,
    /// The core's own clock, which `now` is unless the caller gave its time.
    /// Delayed jobs due by either are promoted (see [`Tx::due_by`]).
    pub core_now: u64,
    pub config: &'a Config,
    /// The queues the operation touched: one or two, rarely more (flows), so
    /// a list beats hashing queue names on every counter update.
    queues: Vec<(QueueId, QueueCache)>,
    pub effects: Effects,
}

impl<'a> Tx<'a> {
    pub fn new(kv: &'a mut dyn KvTxn, ns: &str, now: u64, config: &'a Config) -> Self {
        Self {
            kv,
            ns: ns.to_string(),
            now,
            generation: 0,
            lease_now: now,
            core_now: now,
            config,
            queues: Vec::new(),
            effects: Effects::default(),
        }
    }

    // ---- raw access -------------------------------------------------------

    pub fn get(&mut self, key: &[u8]) -> Result<Option<Value>, JobsError> {
        Ok(self.kv.get(key)?)
    }
    pub fn get_for_update(&mut self, key: &[u8]) -> Result<Option<Value>, JobsError> {
        Ok(self.kv.get_for_update(key)?)
    }
    pub fn put(&mut self, key: &[u8], value: Value) -> Result<(), JobsError> {
        Ok(self.kv.put(key, value)?)
    }
    pub fn delete(&mut self, key: &[u8]) -> Result<(), JobsError> {
        Ok(self.kv.delete(key)?)
    }
    /// This operation recorded an outcome: its acknowledgement waits for its
    /// fsync whatever it was submitted as (see [`KvTxn::require_durable`]).
    pub fn require_durable(&mut self) {
        self.kv.require_durable();
    }
    pub fn scan(&mut self, range: &KeyRange, limit: usize, reverse: bool) -> Result<Vec<(Key, Value)>, JobsError> {
        Ok(self.kv.scan(range, limit, reverse)?)
    }
    pub fn get_record<T: for<'de> serde::Deserialize<'de>>(&mut self, key: &[u8]) -> Result<Option<T>, JobsError> {
        match self.get(key)? {
            Some(bytes) => Ok(Some(model::decode(&bytes)?)),
            None => Ok(None),
        }
    }
    /// Refuses a value of `size` bytes past `Config::max_payload_bytes`, the
    /// most a caller may store in one value (a job's data, a result, ...).
    pub fn check_payload(&self, size: usize) -> Result<(), JobsError> {
        let limit = self.config.max_payload_bytes;
        if size > limit { Err(JobsError::PayloadTooLarge { size, limit }) } else { Ok(()) }
    }

    pub fn put_record<T: serde::Serialize>(&mut self, key: &[u8], value: &T) -> Result<(), JobsError> {
        self.put(key, model::encode(value))
    }

    /// Deletes every key in `range`, in chunks; returns how many.
    pub fn delete_range(&mut self, range: &KeyRange) -> Result<u64, JobsError> {
        let mut n = 0;
        loop {
            let chunk = self.scan(range, 1024, false)?;
            if chunk.is_empty() {
                return Ok(n);
            }
            for (k, _) in &chunk {
                self.delete(k)?;
            }
            n += chunk.len() as u64;
        }
    }

    // ---- queues -----------------------------------------------------------

    fn cache(&mut self, q: &QueueId) -> Result<&mut QueueCache, JobsError> {
        let at = self.cache_at(q)?;
        Ok(&mut self.queues[at].1)
    }

    /// Where `q`'s cache is in `queues`, loaded on first use. Indices stay
    /// put until [`Tx::drop_queue`].
    fn cache_at(&mut self, q: &QueueId) -> Result<usize, JobsError> {
        Ok(match self.queues.iter().position(|(known, _)| known == q) {
            Some(at) => at,
            None => {
                let keys = QueueKeys::new(q);
                let (stats, new, reborn) = match self.kv.get(&keys.stats())? {
                    Some(bytes) => (QueueStats::decode(&bytes)?, false, false),
                    None => match self.kv.get(&keys::queue_remains(q))? {
                        Some(remains) => (QueueRemains::decode(&remains)?.stats(), true, true),
                        None => (QueueStats::default(), true, false),
                    },
                };
                let cache =
                    QueueCache { keys, stats, dirty: false, new, reborn, config: None, max_events: None, meta: None };
                self.queues.push((q.clone(), cache));
                self.queues.len() - 1
            }
        })
    }

    pub fn stats(&mut self, q: &QueueId) -> Result<&QueueStats, JobsError> {
        Ok(&self.cache(q)?.stats)
    }

    pub fn stats_mut(&mut self, q: &QueueId) -> Result<&mut QueueStats, JobsError> {
        Ok(&mut self.counted(q)?.stats)
    }

    /// The queue's cache, its counters to be written back: the hot helpers
    /// take its keys and counters with one lookup (each compares queue names).
    fn counted(&mut self, q: &QueueId) -> Result<&mut QueueCache, JobsError> {
        let c = self.cache(q)?;
        c.dirty = true;
        Ok(c)
    }

    pub fn queue_config(&mut self, q: &QueueId) -> Result<QueueConfig, JobsError> {
        if let Some(c) = self.cache(q)?.config.clone() {
            return Ok(c);
        }
        let key = self.cache(q)?.keys.config();
        let config: QueueConfig = self.get_record(&key)?.unwrap_or_else(|| QueueConfig::defaults(self.config));
        self.cache(q)?.config = Some(config.clone());
        Ok(config)
    }

    pub fn set_queue_config(&mut self, q: &QueueId, config: QueueConfig) -> Result<(), JobsError> {
        // A dead-letter queue that no call could name would hide the jobs sent there.
        if let Some(dlq) = &config.dead_letter_queue {
            model::validate_name("dead-letter queue", dlq, crate::ops::enqueue::MAX_NAME_BYTES)?;
        }
        let key = self.cache(q)?.keys.config();
        self.put_record(&key, &config)?;
        self.cache(q)?.config = Some(config);
        self.effects.sweep_now.push(q.clone());
        Ok(())
    }

    /// The queue's meta hash (BullMQ's `meta` key), read with one scan on
    /// first use, or recalled from an earlier operation.
    fn loaded_meta(&mut self, q: &QueueId) -> Result<&MetaMap, JobsError> {
        let at = self.cache_at(q)?;
        if self.queues[at].1.meta.is_none() {
            let range = self.queues[at].1.keys.meta_all();
            let recalled = self.kv.recall(&range).and_then(|known| known.downcast::<MetaMap>().ok());
            let map = match recalled {
                Some(map) => map,
                None => {
                    let prefix_len = range.start.len();
                    let map: Arc<MetaMap> = Arc::new(
                        self.scan(&range, usize::MAX, false)?
                            .into_iter()
                            .filter_map(|(k, v)| {
                                let (field, _) = keys::read_str(k.get(prefix_len..)?)?;
                                Some((field, String::from_utf8_lossy(&v).into_owned()))
                            })
                            .collect(),
                    );
                    self.kv.remember(&range, map.clone());
                    map
                }
            };
            self.queues[at].1.meta = Some(map);
        }
        self.queues[at].1.meta.as_deref().ok_or_else(|| JobsError::Internal("the meta hash was not loaded".into()))
    }

    /// A field of the queue's meta hash, as text.
    pub fn meta(&mut self, q: &QueueId, field: &str) -> Result<Option<String>, JobsError> {
        Ok(self.loaded_meta(q)?.get(field).cloned())
    }

    /// The whole meta hash.
    pub fn meta_map(&mut self, q: &QueueId) -> Result<MetaMap, JobsError> {
        Ok(self.loaded_meta(q)?.clone())
    }

    /// A whole number in the queue's meta ([`meta_count`]). Anything else
    /// (`-1`, `1.5`, `NaN`) reads as unset, so the default holds: read as 0,
    /// a `maxLenEvents` of -1 trimmed every event as it was written.
    pub fn meta_u64(&mut self, q: &QueueId, field: &str) -> Result<Option<u64>, JobsError> {
        Ok(self.loaded_meta(q)?.get(field).and_then(|v| meta_count(v)))
    }

    pub fn is_paused(&mut self, q: &QueueId) -> Result<bool, JobsError> {
        Ok(self.loaded_meta(q)?.get("paused").is_some_and(|v| v == "1" || v == "true"))
    }

    /// Drops cached settings (meta, config) of a queue after they changed.
    pub fn forget_queue(&mut self, q: &QueueId) {
        if let Some((_, c)) = self.queues.iter_mut().find(|(known, _)| known == q) {
            c.config = None;
            c.max_events = None;
            c.meta = None;
        }
    }

    /// Drops everything cached of a queue that was deleted, counters included.
    pub fn drop_queue(&mut self, q: &QueueId) {
        self.queues.retain(|(known, _)| known != q);
    }

    /// Writes the queues' counters back. Called once, at the end of the body.
    pub fn finish(mut self) -> Result<Effects, JobsError> {
        let Self { queues, kv, effects, .. } = &mut self;
        for (q, c) in queues.iter().filter(|(_, c)| c.dirty) {
            kv.put(&c.keys.stats(), c.stats.encode())?;
            if c.new {
                // First write to this queue: register it for sweeps and listings.
                kv.put(&keys::registry(q), Vec::new())?;
                effects.new_queues.push(q.clone());
            }
            if c.reborn {
                // Its counters carry what it left now.
                kv.delete(&keys::queue_remains(q))?;
            }
        }
        Ok(self.effects)
    }

    // ---- jobs -------------------------------------------------------------

    pub fn load_job(&mut self, q: &QueueId, id: &str) -> Result<Option<JobRecord>, JobsError> {
        let key = self.cache(q)?.keys.job(id);
        let Some(bytes) = self.kv.get_for_update(&key)? else { return Ok(None) };
        let mut job: JobRecord = model::decode(&bytes)?;
        if job.children_counted {
            let counts_key = self.cache(q)?.keys.child_counts(id);
            if let Some(counts) = self.get_record::<ChildCounts>(&counts_key)? {
                (job.pending_children, job.failed_children) = (counts.pending, counts.failed);
            }
        }
        if job.data_apart {
            let data_key = self.cache(q)?.keys.job_data(id);
            job.data = self.get(&data_key)?.unwrap_or_default();
        }
        Ok(Some(job))
    }

    pub fn require_job(&mut self, q: &QueueId, id: &str) -> Result<JobRecord, JobsError> {
        self.load_job(q, id)?.ok_or_else(|| JobsError::job_missing(id))
    }

    /// Writes the record, its children's counts, and its data when it was
    /// set (see [`JobRecord::data_apart`]).
    pub fn save_job(&mut self, q: &QueueId, job: &mut JobRecord) -> Result<(), JobsError> {
        if job.children_counted {
            let counts = ChildCounts { pending: job.pending_children, failed: job.failed_children };
            let counts_key = self.cache(q)?.keys.child_counts(&job.id);
            self.put_record(&counts_key, &counts)?;
        }
        if job.data_changed {
            let was_apart = job.data_apart;
            job.data_apart = job.data.len() >= model::DATA_APART_BYTES;
            let data_key = self.cache(q)?.keys.job_data(&job.id);
            if job.data_apart {
                self.put(&data_key, job.data.clone())?;
            } else if was_apart {
                self.delete(&data_key)?;
            }
            job.data_changed = false;
        }
        let key = self.cache(q)?.keys.job(&job.id);
        let record = if job.data_apart {
            // Encoded without its data, which is put back after.
            let data = std::mem::take(&mut job.data);
            let record = job.encode();
            job.data = data;
            record
        } else {
            job.encode()
        };
        self.put(&key, record)
    }

    /// Changes the counts of a parent's children with `change` and returns
    /// them, without reading or writing the parent's record once they have
    /// their own key (a record from before that gets it now). None when the
    /// parent does not exist.
    pub fn count_children(
        &mut self,
        q: &QueueId,
        parent: &str,
        change: impl FnOnce(&mut ChildCounts),
    ) -> Result<Option<ChildCounts>, JobsError> {
        // Not through `cache`: that would read the parent's queue's counters,
        // which a child's end leaves alone unless it releases the parent.
        let counts_key = QueueKeys::new(q).child_counts(parent);
        if let Some(bytes) = self.get_for_update(&counts_key)? {
            let mut counts: ChildCounts = model::decode(&bytes)?;
            change(&mut counts);
            self.put_record(&counts_key, &counts)?;
            return Ok(Some(counts));
        }
        let Some(mut job) = self.load_job(q, parent)? else { return Ok(None) };
        let mut counts = ChildCounts { pending: job.pending_children, failed: job.failed_children };
        change(&mut counts);
        job.children_counted = true;
        (job.pending_children, job.failed_children) = (counts.pending, counts.failed);
        self.save_job(q, &mut job)?;
        Ok(Some(counts))
    }

    /// The index entry that lists the job under its current state.
    pub fn index_key(keys: &QueueKeys, job: &JobRecord) -> Key {
        match job.state {
            JobState::Waiting | JobState::Prioritized => keys.waiting(job.priority, job.seq),
            JobState::Delayed => keys.delayed(job.due, job.seq),
            JobState::Active => keys.active(job.lock.as_ref().map_or(0, |l| l.deadline), job.seq),
            JobState::WaitingChildren => keys.waiting_children(job.timestamp, job.seq),
            JobState::Completed => keys.completed(job.finished_on.unwrap_or(0), job.seq),
            JobState::Failed => keys.failed(job.finished_on.unwrap_or(0), job.seq),
        }
    }

    /// Removes the job from its state's index and count.
    pub fn unindex(&mut self, q: &QueueId, job: &JobRecord) -> Result<(), JobsError> {
        let c = self.counted(q)?;
        let key = Self::index_key(&c.keys, job);
        let count = c.stats.count_mut(job.state);
        *count = count.saturating_sub(1);
        self.delete(&key)?;
        // A job leaving active frees a slot of a queue's global concurrency:
        // workers waiting on a maxed queue may take the next job.
        if job.state == JobState::Active && self.meta_u64(q, "concurrency")?.is_some() {
            self.effects.wake_jobs.insert(q.clone());
        }
        Ok(())
    }

    /// Lists the job under its (new) state and records the effects of that state.
    pub fn index(&mut self, q: &QueueId, job: &JobRecord) -> Result<(), JobsError> {
        let c = self.counted(q)?;
        let key = Self::index_key(&c.keys, job);
        *c.stats.count_mut(job.state) += 1;
        self.put(&key, job.id.as_bytes().to_vec())?;
        match job.state {
            JobState::Waiting | JobState::Prioritized => {
                self.effects.wake_jobs.insert(q.clone());
            }
            JobState::Delayed => self.effects.timers.push((q.clone(), job.due)),
            _ => {}
        }
        Ok(())
    }

    /// The time delayed jobs are due by: the later of the caller's and the
    /// core's clock. The core's background timers wake workers by its clock,
    /// and a worker whose clock is behind (a remote one's) must then find the
    /// job it was woken for, not wake again and again until its own clock
    /// catches up.
    pub fn due_by(&self) -> u64 {
        self.now.max(self.core_now)
    }

    /// The time what Redis keeps as a key TTL runs out by (a rate-limit
    /// window, a deduplication ttl): the leases' clock, which runs in real
    /// time however a caller's `now` jumps. In the caller's time, a worker
    /// that ran a job with its clock faked a day ahead (sinon) left the queue
    /// limited, or the deduplication id held, for that day once the clock was
    /// put back; on Redis the key expires in its own time.
    pub fn ttl_now(&self) -> u64 {
        self.lease_now
    }

    /// Moves a job to the ready state that fits it: waiting or prioritized.
    pub fn ready_state(job: &JobRecord) -> JobState {
        if job.is_prioritized() { JobState::Prioritized } else { JobState::Waiting }
    }

    /// A new sequence number: FIFO counts up from the origin, LIFO down.
    pub fn next_seq(&mut self, q: &QueueId, lifo: bool) -> Result<u64, JobsError> {
        let stats = self.stats_mut(q)?;
        stats.last_seq += 1;
        let n = stats.last_seq;
        Ok(if lifo { model::SEQ_ORIGIN - n } else { model::SEQ_ORIGIN + n })
    }

    // ---- events -----------------------------------------------------------

    fn max_events(&mut self, q: &QueueId) -> Result<u64, JobsError> {
        let at = self.cache_at(q)?;
        if let Some(m) = self.queues[at].1.max_events {
            return Ok(m);
        }
        let m = self.meta_u64(q, "opts.maxLenEvents")?.unwrap_or(self.config.max_events);
        self.queues[at].1.max_events = Some(m);
        Ok(m)
    }

    /// Appends an event to the queue's log, trimming the log to its length.
    /// Returns its sequence number (its id is [`model::Event::id_of`] it and `now`).
    pub fn event(&mut self, q: &QueueId, name: &str, fields: &[(&str, &str)]) -> Result<u64, JobsError> {
        let size: usize = fields.iter().map(|(k, v)| k.len() + v.len()).sum();
        let placement = if size > model::INLINE_EVENT_BYTES { EventPlacement::Body } else { EventPlacement::Inline };
        self.append_event(q, name, fields, placement)
    }

    /// The `completed` event of a kept job whose return value is larger than
    /// an event keeps in its page: the value is read from the job's record
    /// ([`EventPlacement::LentValue`]), which the caller points at the
    /// returned sequence number and saves.
    pub fn completed_event_lent_value(&mut self, q: &QueueId, id: &str, prev: &str) -> Result<u64, JobsError> {
        let fields = [(model::JOB_ID_FIELD, id), (model::RETURN_VALUE_FIELD, ""), ("prev", prev)];
        self.append_event(q, "completed", &fields, EventPlacement::LentValue)
    }

    /// Gives the return value `job` lent to its `completed` event to that
    /// event, as the record is deleted or forgets the value: the event keeps
    /// it under its own key, as text. Nothing to do when the value was not
    /// lent, or when the event has left the log.
    pub fn give_back_lent_value(&mut self, q: &QueueId, job: &JobRecord) -> Result<(), JobsError> {
        let Some(seq) = job.return_value_event else { return Ok(()) };
        if seq < self.stats(q)?.first_event {
            return Ok(());
        }
        let value = model::as_text(job.return_value.as_deref().unwrap_or(b"null")).into_owned();
        let key = self.cache(q)?.keys.event_body(seq);
        self.put(&key, value.into_bytes())
    }

    fn append_event(
        &mut self,
        q: &QueueId,
        name: &str,
        fields: &[(&str, &str)],
        placement: EventPlacement,
    ) -> Result<u64, JobsError> {
        let now = self.now;
        let max = self.max_events(q)?;
        let c = self.counted(q)?;
        let stats = &mut c.stats;
        stats.last_event += 1;
        if stats.first_event == 0 {
            stats.first_event = stats.last_event;
        }
        let seq = stats.last_event;
        let over = stats.events_over(max) > 0;
        let (key, body) = (c.keys.event_page(seq), c.keys.event_body(seq));
        let event = EventRef { seq, ts: now, name, fields, placement };
        if placement == EventPlacement::Body {
            self.kv.put(&body, model::encode(&EventRef { placement: EventPlacement::Inline, ..event }))?;
            let stub = EventRef { fields: &[], ..event };
            self.kv.append(&key, &mut |page| model::append_to_page(page, &stub))?;
        } else {
            self.kv.append(&key, &mut |page| model::append_to_page(page, &event))?;
        }
        if over {
            self.trim_events(q, max)?;
        }
        if !self.effects.wake_events.contains(q) {
            self.effects.wake_events.insert(q.clone());
        }
        Ok(seq)
    }

    /// Keeps the newest `max` events; returns how many were dropped. Pages
    /// whose events are all dropped are deleted; readers skip the dropped
    /// events of a page still in use (see [`crate::ops::query::events_after`]).
    pub fn trim_events(&mut self, q: &QueueId, max: u64) -> Result<u64, JobsError> {
        let stats = self.stats(q)?;
        let (first_event, excess) = (stats.first_event, stats.events_over(max));
        if excess == 0 {
            return Ok(0);
        }
        let first = first_event + excess;
        let (old_page, new_page) = (first_event / EVENTS_PER_PAGE, first / EVENTS_PER_PAGE);
        for page in old_page..new_page {
            let keys = &self.cache(q)?.keys;
            let (key, bodies) = (
                keys.event_page(page * EVENTS_PER_PAGE),
                keys.event_bodies(page * EVENTS_PER_PAGE, (page + 1) * EVENTS_PER_PAGE),
            );
            self.delete(&key)?;
            // With their page, not one by one as events drop: readers skip
            // the dropped events of a page still in use, bodies or not.
            self.delete_range(&bodies)?;
        }
        self.stats_mut(q)?.first_event = first;
        Ok(excess)
    }
}
