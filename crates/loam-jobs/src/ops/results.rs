//! The result store: Celery's key-value result backend, per namespace, each
//! entry with an optional expiry.
//!
//! An entry holds either a value or a counter. A counter is the set of
//! members that counted (Celery's chord counter: one member per header task),
//! so a redelivered task that counts again adds nothing. Expired entries read
//! as missing at once and are deleted by [`purge_expired`], which walks an
//! expiry index instead of every entry. Expiry runs on the core's real-time
//! clock (`Tx::ttl_now`), not a caller's, as a key's TTL does on Redis.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::error::JobsError;
use crate::keys;
use crate::model::validate_name;
use crate::ops::enqueue::MAX_NAME_BYTES;
use crate::tx::Tx;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct ResultRecord {
    #[serde(with = "serde_bytes")]
    value: Vec<u8>,
    /// Some for a counter: the members that counted.
    members: Option<BTreeSet<String>>,
    expires_at: Option<u64>,
}

impl ResultRecord {
    /// What a read returns: the value, or a counter's size as decimal text
    /// (what Redis's INCR leaves for a GET).
    fn visible(&self) -> Vec<u8> {
        match &self.members {
            Some(m) => m.len().to_string().into_bytes(),
            None => self.value.clone(),
        }
    }
}

/// What `incr` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counted {
    /// Members counted so far.
    pub count: u64,
    /// Whether this call added its member.
    pub added: bool,
}

fn check_key(tx: &Tx, key: &str) -> Result<(), JobsError> {
    validate_name("namespace", &tx.ns, 128)?;
    validate_name("result key", key, MAX_NAME_BYTES)
}

/// The live entry at `key`, or None when it is missing or expired.
fn load(tx: &mut Tx, key: &str) -> Result<Option<ResultRecord>, JobsError> {
    check_key(tx, key)?;
    let now = tx.ttl_now();
    let rec: Option<ResultRecord> = tx.get_record(&keys::result_entry(&tx.ns.clone(), key))?;
    Ok(rec.filter(|r| r.expires_at.is_none_or(|at| at > now)))
}

/// Writes `rec`, moving its expiry index entry from `old_expiry`.
fn store(tx: &mut Tx, key: &str, old_expiry: Option<u64>, rec: &ResultRecord) -> Result<(), JobsError> {
    let ns = tx.ns.clone();
    if let Some(old) = old_expiry
        && Some(old) != rec.expires_at
    {
        tx.delete(&keys::result_expiry(old, &ns, key))?;
    }
    if let Some(at) = rec.expires_at {
        tx.put(&keys::result_expiry(at, &ns, key), Vec::new())?;
    }
    tx.put_record(&keys::result_entry(&ns, key), rec)
}

/// The stored expiry of `key`, live or not, so a rewrite can drop its index entry.
fn stored_expiry(tx: &mut Tx, key: &str) -> Result<Option<u64>, JobsError> {
    let ns = tx.ns.clone();
    Ok(tx.get_record::<ResultRecord>(&keys::result_entry(&ns, key))?.and_then(|r| r.expires_at))
}

fn expiry(tx: &Tx, ttl_ms: Option<u64>) -> Option<u64> {
    ttl_ms.map(|t| tx.ttl_now().saturating_add(t))
}

/// A value stored with a ttl of zero would be gone before anyone read it:
/// refused, as Redis refuses `SET ... PX 0` (unset keeps it until deleted).
fn check_ttl(ttl_ms: Option<u64>) -> Result<(), JobsError> {
    match ttl_ms {
        Some(0) => Err(JobsError::invalid("a result's ttl must be positive; leave it unset to keep the entry")),
        _ => Ok(()),
    }
}

pub fn get(tx: &mut Tx, key: &str) -> Result<Option<Vec<u8>>, JobsError> {
    Ok(load(tx, key)?.map(|r| r.visible()))
}

pub fn mget(tx: &mut Tx, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, JobsError> {
    keys.iter().map(|k| get(tx, k)).collect()
}

/// Stores a value; `ttl_ms` None keeps it until deleted.
pub fn set(tx: &mut Tx, key: &str, value: Vec<u8>, ttl_ms: Option<u64>) -> Result<(), JobsError> {
    check_key(tx, key)?;
    check_ttl(ttl_ms)?;
    tx.check_payload(value.len())?;
    let old = stored_expiry(tx, key)?;
    let rec = ResultRecord { value, members: None, expires_at: expiry(tx, ttl_ms) };
    store(tx, key, old, &rec)
}

/// Deletes an entry; false when there was none (or it had expired).
pub fn delete(tx: &mut Tx, key: &str) -> Result<bool, JobsError> {
    let live = load(tx, key)?.is_some();
    let ns = tx.ns.clone();
    if let Some(at) = stored_expiry(tx, key)? {
        tx.delete(&keys::result_expiry(at, &ns, key))?;
    }
    tx.delete(&keys::result_entry(&ns, key))?;
    Ok(live)
}

/// Counts `member` once at `key`, creating the counter if needed; a ttl
/// (re)sets the expiry. A key holding a plain value is refused.
pub fn incr(tx: &mut Tx, key: &str, member: &str, ttl_ms: Option<u64>) -> Result<Counted, JobsError> {
    validate_name("counter member", member, MAX_NAME_BYTES)?;
    check_ttl(ttl_ms)?;
    let old = stored_expiry(tx, key)?;
    let mut rec =
        load(tx, key)?.unwrap_or_else(|| ResultRecord { members: Some(BTreeSet::new()), ..Default::default() });
    let Some(members) = rec.members.as_mut() else {
        return Err(JobsError::invalid(format!("result key {key} holds a value, not a counter")));
    };
    let added = members.insert(member.to_string());
    let count = members.len() as u64;
    if ttl_ms.is_some() {
        rec.expires_at = expiry(tx, ttl_ms);
    }
    store(tx, key, old, &rec)?;
    Ok(Counted { count, added })
}

/// Sets a live entry to expire `ttl_ms` from now; false when there is none.
pub fn expire(tx: &mut Tx, key: &str, ttl_ms: u64) -> Result<bool, JobsError> {
    let Some(mut rec) = load(tx, key)? else { return Ok(false) };
    let old = rec.expires_at;
    rec.expires_at = expiry(tx, Some(ttl_ms));
    store(tx, key, old, &rec)?;
    Ok(true)
}

/// Deletes up to `limit` expired entries of every namespace; returns how
/// many. Runs in any namespace's transaction.
pub fn purge_expired(tx: &mut Tx, limit: usize) -> Result<u64, JobsError> {
    let due = tx.scan(&keys::result_expiry_due(tx.ttl_now()), limit, false)?;
    let mut n = 0;
    for (k, _) in due {
        tx.delete(&k)?;
        if let Some((ns, key)) = keys::parse_result_expiry(&k) {
            let entry = keys::result_entry(&ns, &key);
            // A rewrite with a later expiry left this index entry behind only
            // if it failed to delete it; the entry's own expiry decides.
            let rec: Option<ResultRecord> = tx.get_record(&entry)?;
            if rec.is_some_and(|r| r.expires_at.is_some_and(|at| at <= tx.ttl_now())) {
                tx.delete(&entry)?;
                n += 1;
            }
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::redb::RedbStore;
    use crate::{Config, Jobs, ManualClock};

    fn core() -> (Jobs, ManualClock) {
        let clock = ManualClock::new(1_000_000);
        let config = Config { background: false, max_payload_bytes: 16, ..Config::default() };
        let store = RedbStore::in_memory().unwrap();
        (Jobs::with_store(Box::new(store), Arc::new(clock.clone()), config).unwrap(), clock)
    }

    fn get_in(jobs: &Jobs, ns: &str, key: &str) -> Option<Vec<u8>> {
        jobs.read(ns, |tx| get(tx, key)).unwrap()
    }

    #[test]
    fn set_get_delete_and_namespaces_apart() {
        let (jobs, _) = core();
        jobs.write("a", true, |tx| set(tx, "k", b"v1".to_vec(), None)).wait().unwrap();
        assert_eq!(get_in(&jobs, "a", "k"), Some(b"v1".to_vec()));
        assert_eq!(get_in(&jobs, "b", "k"), None);
        let got = jobs.read("a", |tx| mget(tx, &["k".into(), "missing".into()])).unwrap();
        assert_eq!(got, vec![Some(b"v1".to_vec()), None]);
        assert!(jobs.write("a", true, |tx| delete(tx, "k")).wait().unwrap());
        assert!(!jobs.write("a", true, |tx| delete(tx, "k")).wait().unwrap());
        assert_eq!(get_in(&jobs, "a", "k"), None);
    }

    #[test]
    fn ttl_expires_and_purge_removes_entries() {
        let (jobs, clock) = core();
        jobs.write("a", true, |tx| set(tx, "k", b"v".to_vec(), Some(1000))).wait().unwrap();
        jobs.write("a", true, |tx| set(tx, "keep", b"v".to_vec(), None)).wait().unwrap();
        clock.advance(999);
        assert!(get_in(&jobs, "a", "k").is_some());
        assert!(jobs.write("a", true, |tx| expire(tx, "k", 5000)).wait().unwrap());
        clock.advance(4000);
        assert!(get_in(&jobs, "a", "k").is_some());
        clock.advance(1001);
        assert_eq!(get_in(&jobs, "a", "k"), None);
        assert!(!jobs.write("a", true, |tx| expire(tx, "k", 10)).wait().unwrap());
        assert_eq!(jobs.write("x", true, |tx| purge_expired(tx, 100)).wait().unwrap(), 1);
        let raw = jobs.read("a", |tx| tx.get(&keys::result_entry("a", "k"))).unwrap();
        assert!(raw.is_none());
        assert!(get_in(&jobs, "a", "keep").is_some());
        assert_eq!(jobs.write("x", true, |tx| purge_expired(tx, 100)).wait().unwrap(), 0);
    }

    /// An entry's ttl runs on the core's clock, as a key's TTL does on
    /// Redis: counted from a remote caller's clock minutes behind, the
    /// expiry was already past, and the purge took the entry at once.
    #[test]
    fn a_ttl_runs_on_the_cores_clock_whatever_its_callers_clock_says() {
        let (jobs, clock) = core();
        let behind = jobs.at(jobs.now_ms() - 300_000);
        behind.write("a", true, |tx| set(tx, "k", b"v".to_vec(), Some(60_000))).wait().unwrap();
        assert_eq!(jobs.write("x", true, |tx| purge_expired(tx, 100)).wait().unwrap(), 0);
        clock.advance(59_000);
        assert!(get_in(&jobs.at(jobs.now_ms() + 300_000), "a", "k").is_some(), "nor does a clock ahead end it");
        clock.advance(1_000);
        assert_eq!(get_in(&jobs, "a", "k"), None);
        assert_eq!(jobs.write("x", true, |tx| purge_expired(tx, 100)).wait().unwrap(), 1);
    }

    #[test]
    fn incr_counts_each_member_once() {
        let (jobs, _) = core();
        let c1 = jobs.write("a", true, |tx| incr(tx, "chord", "t1", Some(60_000))).wait().unwrap();
        let again = jobs.write("a", true, |tx| incr(tx, "chord", "t1", None)).wait().unwrap();
        let c2 = jobs.write("a", true, |tx| incr(tx, "chord", "t2", None)).wait().unwrap();
        assert_eq!(c1, Counted { count: 1, added: true });
        assert_eq!(again, Counted { count: 1, added: false });
        assert_eq!(c2, Counted { count: 2, added: true });
        assert_eq!(get_in(&jobs, "a", "chord"), Some(b"2".to_vec()));
        jobs.write("a", true, |tx| set(tx, "plain", b"x".to_vec(), None)).wait().unwrap();
        let err = jobs.write("a", true, |tx| incr(tx, "plain", "t1", None)).wait().unwrap_err();
        assert!(matches!(err, JobsError::InvalidArgument(_)));
    }

    #[test]
    fn bad_keys_and_large_values_are_refused() {
        let (jobs, _) = core();
        let err = jobs.write("a", true, |tx| set(tx, "", b"v".to_vec(), None)).wait().unwrap_err();
        assert!(matches!(err, JobsError::InvalidArgument(_)));
        let err = jobs.write("a", true, |tx| set(tx, "k", vec![0; 17], None)).wait().unwrap_err();
        assert!(matches!(err, JobsError::PayloadTooLarge { .. }));
        let err = jobs.read("", |tx| get(tx, "k")).unwrap_err();
        assert!(matches!(err, JobsError::InvalidArgument(_)));
    }
}
