//! Calls made again under the key they were first made with. A client whose
//! connection was cut while a write was on its way cannot know whether the
//! server applied it; it sends the write again under the same key, and what
//! the first one left answers it: what was done is not done twice (an add,
//! a log line), and the answer the client lost (the job an add made) is
//! given again.
//!
//! Adds and reports leave a record under their key (a bulk add under a key
//! for the whole call, one record for all its jobs), which lives for the
//! key's ttl (the client sets it to the time it may still send again);
//! [`purge_expired`] takes the space back after. The ttl runs on the core's
//! real-time clock (`Tx::ttl_now`), as a key's TTL runs on Redis: counted
//! from a remote caller's clock minutes behind, a record's expiry was already
//! past by the core's clock, which the purge goes by, and the caller's
//! repeat added its job twice. A completion, on the hot
//! path, leaves its key in the job records it writes anyway instead (see
//! `complete::complete`): a record of its own was two more B-tree inserts
//! and, later, two deletes per job.

use std::hash::Hasher;

use serde::Serialize;
use siphasher::sip::SipHasher13;

use crate::error::JobsError;
use crate::keys::{QueueId, QueueKeys};
use crate::model::{BulkAdded, Idempotency, IdempotencyRecord, validate_name};
use crate::ops::enqueue::MAX_NAME_BYTES;
use crate::tx::Tx;

/// Refuses a key the core does not take (empty, or longer than a job id).
pub fn check_key(key: &str) -> Result<(), JobsError> {
    validate_name("idempotency key", key, MAX_NAME_BYTES)
}

/// What a call sent again under its key is compared by: its hash, made the
/// way `version` says. A record a build before that version kept holds the
/// hash made the old way, and a call sent again across the upgrade (a client
/// resending while the server restarts) is compared with that one instead.
#[derive(Clone, Copy, Debug)]
pub struct CallHash {
    pub hash: u64,
    pub version: u8,
}

/// The call's hash as version 0 made it, for a call whose hash changed
/// since: made only when a record of version 0 is found.
pub type Version0<'a> = Option<&'a dyn Fn() -> u64>;

impl CallHash {
    /// A call whose hash has been made one way only.
    pub fn of(hash: u64) -> Self {
        Self { hash, version: 0 }
    }

    fn matches(&self, rec: &IdempotencyRecord, version_0: Version0) -> bool {
        match rec.hash_version {
            v if v == self.version => rec.request_hash == self.hash,
            // Records without a version were written by builds that hashed an
            // add the old way, and by a few that already hashed it whole.
            0 => rec.request_hash == self.hash || version_0.is_some_and(|old| old() == rec.request_hash),
            _ => false,
        }
    }
}

/// The live record of `idem`, if the call was made before; an error if that
/// call was a different one (its hash differs).
pub fn recall(
    tx: &mut Tx,
    q: &QueueId,
    idem: &Idempotency,
    call: CallHash,
    version_0: Version0,
) -> Result<Option<IdempotencyRecord>, JobsError> {
    check_key(&idem.key)?;
    let Some(rec) = tx.get_record::<IdempotencyRecord>(&QueueKeys::new(q).idempotency(&idem.key))? else {
        return Ok(None);
    };
    if rec.expires_at <= tx.ttl_now() {
        return Ok(None);
    }
    if !call.matches(&rec, version_0) {
        return Err(JobsError::IdempotencyConflict { key: idem.key.clone() });
    }
    Ok(Some(rec))
}

/// What a call keyed `idem` answered besides its job, kept for a repeat.
#[derive(Clone, Debug, Default)]
pub struct Answer {
    /// A report's: the log lines it kept.
    pub log_count: Option<u64>,
    /// A completion's whose job retention removed: when the job finished.
    pub finished_on: Option<u64>,
    /// An add's that a deduplication id absorbed: its job is the one that held the id.
    pub deduplicated: bool,
    /// A bulk add's under a key for the call: what became of each job.
    pub bulk: Vec<Option<BulkAdded>>,
}

/// Records that the call keyed `idem` (about job `job_id`) was made, and
/// what it answered.
pub fn remember(
    tx: &mut Tx,
    q: &QueueId,
    idem: &Idempotency,
    call: CallHash,
    job_id: &str,
    answer: Answer,
) -> Result<(), JobsError> {
    let ttl = idem.ttl_ms.unwrap_or(tx.config.idempotency_ttl_ms);
    let expires_at = tx.ttl_now().saturating_add(ttl);
    let Answer { log_count, finished_on, deduplicated, bulk } = answer;
    let rec = IdempotencyRecord {
        request_hash: call.hash,
        job_id: job_id.to_string(),
        expires_at,
        log_count,
        finished_on,
        hash_version: call.version,
        deduplicated,
        bulk,
    };
    let key = QueueKeys::new(q).idempotency(&idem.key);
    tx.put_record(&key, &rec)?;
    tx.put(&crate::keys::idempotency_expiry(rec.expires_at, &key), Vec::new())
}

/// What tells two calls under one key apart: a fixed hash (SipHash-1-3 under
/// zero keys) of the call's MessagePack encoding, both fixed formats, so a
/// record kept by one build still matches the call sent again to the next.
/// (std's `DefaultHasher`, and how `Hash` feeds it a `str`, may change between
/// Rust releases: an upgrade under a client's resends would have refused them
/// as conflicts.)
pub fn hash_of(request: &impl Serialize) -> u64 {
    let mut h = SipHasher13::new();
    crate::model::hash_encoding(&mut h, request);
    h.finish()
}

/// Deletes up to `limit` idempotency records whose ttl has passed: `recall`
/// already ignores them, and this takes back their space. A record written
/// again under its key since (a later expiry) stays. Returns how many went.
pub fn purge_expired(tx: &mut Tx, limit: usize) -> Result<u64, JobsError> {
    let due = tx.scan(&crate::keys::idempotency_expiry_due(tx.ttl_now()), limit, false)?;
    let mut purged = 0;
    for (entry, _) in due {
        tx.delete(&entry)?;
        let Some(record) = crate::keys::idempotency_record_of(&entry) else { continue };
        let rec: Option<IdempotencyRecord> = tx.get_record(record)?;
        if rec.is_some_and(|r| r.expires_at <= tx.ttl_now()) {
            tx.delete(record)?;
            purged += 1;
        }
    }
    Ok(purged)
}

#[cfg(test)]
mod tests {
    use std::hash::Hasher;

    use siphasher::sip::SipHasher13;

    use super::{CallHash, hash_of};
    use crate::model::{EnqueueRequest, Fence, IdempotencyRecord, Report};

    /// The hashes kept in records must not change from one build to the next:
    /// these are the values the first build with a fixed hash gave, and for
    /// an add's whole request (version 1) the first build that hashed it. A
    /// field added to `EnqueueRequest` changes version 1's hashes: that takes
    /// a new version, with this one kept for the records made before it.
    #[test]
    fn hashes_stay_what_earlier_builds_kept() {
        let add = hash_of(&("email", serde_bytes::Bytes::new(b"{\"to\":1}"), "{}", 0u64, 0u32));
        let report =
            hash_of(&("report", "7", &Fence::Token("t".into()), &Report::Log { row: "hi".into(), keep: Some(3) }));
        let whole = hash_of(&EnqueueRequest {
            name: "email".into(),
            data: b"{\"to\":1}".to_vec(),
            opts: "{}".into(),
            job_id: Some("j".into()),
            attempts: 3,
            ..Default::default()
        });
        assert_eq!((add, report, whole), (10024672349652522726, 9076688982668741003, 8672131837815774137));
        // A bulk add under a key for the call (`enqueue::bulk`): the first
        // build that kept one record for it.
        let jobs = [EnqueueRequest { name: "a".into(), ..Default::default() }, EnqueueRequest::default()];
        assert_eq!(
            (hash_of(&(false, &jobs[..])), hash_of(&(true, &jobs[..]))),
            (15351058395378063372, 12092297394819814703)
        );
    }

    /// The hash is made as the encoding is, in pieces: the same as of the
    /// whole encoding at once, for a payload larger than any piece and for
    /// many small fields that fill several.
    #[test]
    fn a_hash_made_in_pieces_is_the_hash_of_the_whole_encoding() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let headers = (0..500).map(|i| (format!("header-{i}"), format!("value {i}"))).collect();
        let big = EnqueueRequest { name: "big".into(), data, opts: "{}".into(), ..Default::default() };
        let many = EnqueueRequest { name: "many".into(), headers, ..Default::default() };
        for request in [big, many] {
            let mut whole = SipHasher13::new();
            whole.write(&crate::model::encode(&request));
            assert_eq!(hash_of(&request), whole.finish(), "{}", request.name);
        }
    }

    /// A record is compared the way it was made: one written before an add's
    /// hash covered its whole request, by the hash made then.
    #[test]
    fn a_call_is_compared_with_a_record_the_way_it_was_made() {
        let call = CallHash { hash: 11, version: 1 };
        let old: &dyn Fn() -> u64 = &|| 22;
        let matches = |request_hash, hash_version| {
            call.matches(&IdempotencyRecord { request_hash, hash_version, ..Default::default() }, Some(old))
        };
        assert!(matches(11, 1));
        assert!(matches(22, 0) && matches(11, 0));
        assert!(!matches(22, 1) && !matches(33, 0) && !matches(11, 2));
        let record = |request_hash| IdempotencyRecord { request_hash, ..Default::default() };
        assert!(CallHash::of(33).matches(&record(33), None) && !CallHash::of(33).matches(&record(44), None));
    }
}
