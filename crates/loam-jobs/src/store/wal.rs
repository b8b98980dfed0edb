//! The write-ahead log beside the redb file: what makes a commit durable.
//!
//! redb makes a commit durable by writing every page the commit touched and
//! fsyncing the file, about 0.7 ms for the few dozen scattered pages of a group
//! of job operations on these machines. Appending the group's net writes to a
//! zero-filled log and fsyncing that costs about 0.13 ms. So the committer
//! appends each group here, commits it to redb without an fsync, and fsyncs the
//! log before it acknowledges; a checkpoint (a durable redb commit) now and
//! then makes the log's records redundant, and the log starts over.
//!
//! A record is `len: u32, generation: u64, seq: u64, crc32: u32` (little
//! endian), then `len` bytes of writes. Each checkpoint starts a new
//! generation, stored in the redb file with the checkpoint, and only records of
//! a generation with consecutive sequence numbers from the start of its region
//! are replayed: what follows a torn record, or is left over from an earlier
//! generation, is ignored. Replaying a record that redb already has is
//! harmless: records are replayed in order and each sets keys to the values
//! they had after it.
//!
//! The crc also covers the log's salt, a random number stored in the redb
//! file with the generation and drawn afresh at every open. Generation and
//! sequence numbers are predictable, and the bytes past a generation's last
//! record can be anything an earlier pass over the region wrote there,
//! including a job's data, which a client chooses: without the salt, a client
//! could put a well-formed next record inside a job and have it replayed as a
//! commit after a crash. The salt is in no record and never leaves the files,
//! so a record made by anyone but this log fails the crc (but for a chance of
//! one in 2^32), whatever its bytes. A log written before the salt (a file with
//! a generation and no salt) is read without it once, and the open that
//! replays it starts the salted log.
//!
//! The log has two regions, and generation `g` writes region `g % 2`, so a
//! checkpoint need not stop the commits behind it: the committer asks for it
//! and goes on appending the next generation in the other region while the
//! file writer makes redb durable. A generation's region is written again two
//! generations later, once the checkpoint between has succeeded. After a
//! crash, the file's generation `g` is replayed, then `g + 1`: the records
//! committed while the checkpoint that would have started it was under way.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::kv::{Key, Value, Writes};

const HEADER: usize = 4 + 8 + 8 + 4;
const DELETE: u8 = 0;
const PUT: u8 = 1;

/// What the log is written to: its file, or in tests a disk that loses what
/// a power cut would (`power_cut_tests`).
pub(crate) trait LogFile: Send {
    fn len(&self) -> io::Result<u64>;
    fn read_bytes(&self, buf: &mut [u8], at: u64) -> io::Result<()>;
    fn write_bytes(&self, buf: &[u8], at: u64) -> io::Result<()>;
    /// Makes what was written durable, the file's length included.
    fn sync(&self) -> io::Result<()>;
    /// Drops what is past `len` (a stale log, in tests).
    #[cfg(test)]
    fn set_len(&self, len: u64) -> io::Result<()>;
}

impl LogFile for File {
    fn len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn read_bytes(&self, buf: &mut [u8], at: u64) -> io::Result<()> {
        self.read_exact_at(buf, at)
    }
    fn write_bytes(&self, buf: &[u8], at: u64) -> io::Result<()> {
        self.write_all_at(buf, at)
    }
    fn sync(&self) -> io::Result<()> {
        self.sync_data()
    }
    #[cfg(test)]
    fn set_len(&self, len: u64) -> io::Result<()> {
        File::set_len(self, len)
    }
}

pub(crate) struct Wal {
    file: Box<dyn LogFile>,
    /// The size of each of the two regions.
    region: u64,
    /// Where the next record goes, from the start of the generation's region.
    end: u64,
    /// Where the last record whose write was started starts (see
    /// [`Wal::retract_last`]); None when none since the last restart.
    last_start: Option<u64>,
    /// Whether records were appended since the last fsync.
    unsynced: bool,
    generation: u64,
    /// What the crc covers besides the record (None: a log from before salts).
    salt: Option<u64>,
    next_seq: u64,
    #[cfg(test)]
    failing: Option<Failing>,
}

/// Tests: appends and fsyncs (or fsyncs only) fail while `flag` is set; the
/// first failure clears it when `once`.
#[cfg(test)]
struct Failing {
    flag: std::sync::Arc<std::sync::atomic::AtomicBool>,
    syncs_only: bool,
    once: bool,
}

impl Wal {
    /// Opens the log at `path` (creating it zero-filled, two regions of
    /// `region` bytes), and reads the writes of its records of `generation`
    /// and then of `generation + 1` under `salt`, oldest first. It goes on
    /// in `generation` (to be [restarted](Wal::restart_salted) once they are
    /// applied).
    pub(crate) fn open(
        path: &Path,
        generation: u64,
        salt: Option<u64>,
        region: u64,
    ) -> io::Result<(Self, Vec<Writes>)> {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
        let created = file.metadata()?.len() == 0;
        let opened = Self::open_on(Box::new(file), generation, salt, region)?;
        if created {
            sync_parent_dir(path)?;
        }
        Ok(opened)
    }

    /// [`Wal::open`] on a file already open.
    pub(crate) fn open_on(
        file: Box<dyn LogFile>,
        generation: u64,
        salt: Option<u64>,
        region: u64,
    ) -> io::Result<(Self, Vec<Writes>)> {
        let len = file.len()?;
        let capacity = 2 * region;
        if len < capacity {
            // Zero-filled ahead of time, an append overwrites allocated blocks
            // and its fsync need not also commit the file's new size.
            let zeros = vec![0u8; 1 << 20];
            let mut at = len;
            while at < capacity {
                let n = (capacity - at).min(zeros.len() as u64) as usize;
                file.write_bytes(&zeros[..n], at)?;
                at += n as u64;
            }
            file.sync()?;
        }
        let start = |g: u64| region_start(g, region);
        let mut records = read_records(file.as_ref(), start(generation), region, generation, salt)?;
        if records.is_empty() {
            // A log of one region (before the log had two) holds every
            // generation at its start.
            records = read_records(file.as_ref(), start(generation + 1), region, generation, salt)?;
        }
        records.extend(read_records(file.as_ref(), start(generation + 1), region, generation + 1, salt)?);
        let wal = Self {
            file,
            region,
            end: 0,
            last_start: None,
            unsynced: false,
            generation,
            salt,
            next_seq: 1,
            #[cfg(test)]
            failing: None,
        };
        Ok((wal, records))
    }

    /// How many bytes the record of `writes` takes.
    pub(crate) fn record_len<'a>(writes: impl IntoIterator<Item = (&'a Key, &'a Option<Value>)>) -> usize {
        HEADER
            + writes
                .into_iter()
                .map(|(key, value)| 1 + 4 + key.len() + value.as_ref().map_or(0, |v| 4 + v.len()))
                .sum::<usize>()
    }

    /// Encodes `writes`, applied in order, as one record of at most `room`
    /// bytes ([`Wal::room`]), or None when it would be longer: a group too
    /// large for the log goes to redb whole (a checkpoint), and encoding it
    /// first held one more copy of its values (a 64 MiB job's, through the
    /// whole checkpoint) for nothing. The record is sized before it is
    /// written: grown as it went, a group of ten 100 KB results was copied
    /// over again at every doubling, a fifth of the committer's time.
    pub(crate) fn encode_within<'a>(
        writes: impl IntoIterator<Item = (&'a Key, &'a Option<Value>)>,
        room: u64,
    ) -> Option<Vec<u8>> {
        let writes: Vec<_> = writes.into_iter().collect();
        let len = Self::record_len(writes.iter().copied());
        if len as u64 > room {
            return None;
        }
        let mut record = Vec::with_capacity(len);
        record.resize(HEADER, 0);
        for (key, value) in writes {
            match value {
                Some(v) => {
                    record.push(PUT);
                    put_bytes(&mut record, key);
                    put_bytes(&mut record, v);
                }
                None => {
                    record.push(DELETE);
                    put_bytes(&mut record, key);
                }
            }
        }
        Some(record)
    }

    /// The record of `writes` a log under `salt` writes as `seq` of
    /// `generation`: what a log left, or what anyone who knew the salt (or
    /// that there was none) could write.
    #[cfg(test)]
    pub(crate) fn forge(salt: Option<u64>, generation: u64, seq: u64, writes: &Writes) -> Vec<u8> {
        let mut record = Self::encode(writes.iter());
        seal(&mut record, salt, generation, seq).expect("a small record");
        record
    }

    /// [`Wal::encode_within`] with no bound.
    #[cfg(test)]
    pub(crate) fn encode<'a>(writes: impl IntoIterator<Item = (&'a Key, &'a Option<Value>)>) -> Vec<u8> {
        Self::encode_within(writes, u64::MAX).expect("no bound")
    }

    /// What is left of the generation's region, in bytes.
    pub(crate) fn room(&self) -> u64 {
        self.region.saturating_sub(self.end)
    }

    /// Whether `record` fits in what is left of the generation's region.
    pub(crate) fn fits(&self, record: &[u8]) -> bool {
        record.len() as u64 <= self.room()
    }

    /// Appends an encoded record that [fits](Wal::fits) (not yet durable:
    /// see [`Wal::sync`]).
    pub(crate) fn append(&mut self, mut record: Vec<u8>) -> io::Result<()> {
        if !self.fits(&record) {
            return Err(io::Error::other("the record does not fit in the log"));
        }
        seal(&mut record, self.salt, self.generation, self.next_seq)?;
        self.last_start = Some(self.end);
        self.check(false)?;
        self.file.write_bytes(&record, region_start(self.generation, self.region) + self.end)?;
        self.end += record.len() as u64;
        self.next_seq += 1;
        self.unsynced = true;
        Ok(())
    }

    /// Makes every record appended so far durable.
    pub(crate) fn sync(&mut self) -> io::Result<()> {
        self.check(true)?;
        self.file.sync()?;
        self.unsynced = false;
        Ok(())
    }

    /// Unwrites the last record appended, whose append or fsync failed: its
    /// header is zeroed, which ends a replay before it, and the zeros are
    /// fsynced. The kernel keeps a record whose fsync failed in its cache,
    /// to be written back later or not: replayed after a reopen, a write
    /// answered as failed took effect (an add retried by its caller made a
    /// second job). Ok means it will not be replayed; an error, that it may.
    /// The store takes no more writes either way.
    pub(crate) fn retract_last(&mut self) -> io::Result<()> {
        let Some(start) = self.last_start else { return Ok(()) };
        self.check(true)?;
        // Inside the region: the record, at least a header long, fitted.
        self.file.write_bytes(&[0u8; HEADER], region_start(self.generation, self.region) + start)?;
        self.file.sync()?;
        self.end = start;
        self.unsynced = false;
        Ok(())
    }

    /// Makes appends and fsyncs fail while `failing` is set.
    #[cfg(test)]
    pub(crate) fn fail_while(&mut self, failing: std::sync::Arc<std::sync::atomic::AtomicBool>) {
        self.failing = Some(Failing { flag: failing, syncs_only: false, once: false });
    }

    /// Makes fsyncs fail while `failing` is set; appends go on.
    #[cfg(test)]
    pub(crate) fn fail_syncs_while(&mut self, failing: std::sync::Arc<std::sync::atomic::AtomicBool>) {
        self.failing = Some(Failing { flag: failing, syncs_only: true, once: false });
    }

    /// Makes the first fsync after `failing` is set fail, which clears it.
    #[cfg(test)]
    pub(crate) fn fail_a_sync_once(&mut self, failing: std::sync::Arc<std::sync::atomic::AtomicBool>) {
        self.failing = Some(Failing { flag: failing, syncs_only: true, once: true });
    }

    #[cfg(test)]
    fn check(&self, sync: bool) -> io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        match &self.failing {
            Some(f)
                if (sync || !f.syncs_only) && if f.once { f.flag.swap(false, SeqCst) } else { f.flag.load(SeqCst) } =>
            {
                Err(io::Error::other("disk failed"))
            }
            _ => Ok(()),
        }
    }

    #[cfg(not(test))]
    fn check(&self, _sync: bool) -> io::Result<()> {
        Ok(())
    }

    /// Goes on under `generation`, at the start of its region: once a
    /// checkpoint is asked for (which makes every record of the generation
    /// before redundant once it succeeds), or made. The records so far are
    /// made durable first: recovery replays the next generation after
    /// whatever of this one it finds, so a record of the next on the disk
    /// without this one's last (written back later by the kernel, or not at
    /// all before a power cut) would replay a state no commits made.
    pub(crate) fn restart(&mut self, generation: u64) -> io::Result<()> {
        self.restart_salted(generation, self.salt)
    }

    /// [`Wal::restart`] under a new salt: at an open, once the redb file
    /// holds both durably, so every record of an earlier open fails the crc.
    pub(crate) fn restart_salted(&mut self, generation: u64, salt: Option<u64>) -> io::Result<()> {
        if self.unsynced {
            self.sync()?;
        }
        self.generation = generation;
        self.salt = salt;
        self.end = 0;
        self.last_start = None;
        self.next_seq = 1;
        Ok(())
    }

    #[cfg(test)]
    pub(crate) fn salt(&self) -> Option<u64> {
        self.salt
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether more than half of the generation's region is used.
    pub(crate) fn half_full(&self) -> bool {
        self.end > self.region / 2
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.end == 0
    }
}

/// Makes a new file's directory entry durable: its own fsync covers its
/// data, not the name that finds it after a power cut.
fn sync_parent_dir(path: &Path) -> io::Result<()> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => File::open(dir)?.sync_all(),
        None => File::open(".")?.sync_all(),
    }
}

/// Where generation `generation`'s region starts: the log's two regions take
/// turns.
fn region_start(generation: u64, region: u64) -> u64 {
    (generation % 2) * region
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Fills in an encoded record's header: its length, `generation`, `seq`, and
/// the crc over them, `salt` and the writes.
fn seal(record: &mut [u8], salt: Option<u64>, generation: u64, seq: u64) -> io::Result<()> {
    let payload_len = u32::try_from(record.len() - HEADER).map_err(|_| io::Error::other("log record too large"))?;
    record[0..4].copy_from_slice(&payload_len.to_le_bytes());
    record[4..12].copy_from_slice(&generation.to_le_bytes());
    record[12..20].copy_from_slice(&seq.to_le_bytes());
    let crc = checksum(salt, generation, seq, &record[HEADER..]);
    record[20..24].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

fn checksum(salt: Option<u64>, generation: u64, seq: u64, payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    if let Some(salt) = salt {
        hasher.update(&salt.to_le_bytes());
    }
    hasher.update(&generation.to_le_bytes());
    hasher.update(&seq.to_le_bytes());
    hasher.update(payload);
    hasher.finalize()
}

/// The writes of the records of `generation` under `salt` that follow each
/// other from the start of the region at `base`, each intact.
fn read_records(
    file: &dyn LogFile,
    base: u64,
    region: u64,
    generation: u64,
    salt: Option<u64>,
) -> io::Result<Vec<Writes>> {
    let mut records = Vec::new();
    let mut at = base;
    let capacity = base + region;
    let mut header = [0u8; HEADER];
    while at + HEADER as u64 <= capacity {
        file.read_bytes(&mut header, at)?;
        let len = u64::from(u32::from_le_bytes(header[0..4].try_into().unwrap_or_default()));
        let record_generation = u64::from_le_bytes(header[4..12].try_into().unwrap_or_default());
        let seq = u64::from_le_bytes(header[12..20].try_into().unwrap_or_default());
        let crc = u32::from_le_bytes(header[20..24].try_into().unwrap_or_default());
        if record_generation != generation || seq != records.len() as u64 + 1 || at + HEADER as u64 + len > capacity {
            break;
        }
        let mut payload = vec![0u8; len as usize];
        file.read_bytes(&mut payload, at + HEADER as u64)?;
        if checksum(salt, record_generation, seq, &payload) != crc {
            break;
        }
        match decode_writes(&payload) {
            Some(writes) => records.push(writes),
            None => break,
        }
        at += HEADER as u64 + len;
    }
    Ok(records)
}

fn decode_writes(mut payload: &[u8]) -> Option<Writes> {
    fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = bytes.split_at_checked(n)?;
        *bytes = rest;
        Some(head)
    }
    fn take_bytes(bytes: &mut &[u8]) -> Option<Vec<u8>> {
        let len = u32::from_le_bytes(take(bytes, 4)?.try_into().ok()?) as usize;
        Some(take(bytes, len)?.to_vec())
    }
    let mut writes = Writes::new();
    while let Some(tag) = take(&mut payload, 1) {
        let key = take_bytes(&mut payload)?;
        let value = match tag[0] {
            PUT => Some(take_bytes(&mut payload)?),
            DELETE => None,
            _ => return None,
        };
        writes.insert(key, value);
    }
    Some(writes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SALT: Option<u64> = Some(0x5a17_5a17);

    fn writes(pairs: &[(&str, Option<&str>)]) -> Writes {
        pairs.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.map(|v| v.as_bytes().to_vec()))).collect()
    }

    #[test]
    fn records_of_the_generation_read_back_in_order_until_a_torn_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let (mut wal, none) = Wal::open(&path, 7, SALT, 4096).unwrap();
        assert!(none.is_empty());
        let a = writes(&[("a", Some("1")), ("b", None)]);
        let b = writes(&[("a", Some("2"))]);
        let c = writes(&[("c", Some("3"))]);
        assert!(wal.append(Wal::encode(a.iter())).is_ok());
        assert!(wal.append(Wal::encode(b.iter())).is_ok());
        let torn_at = wal.end;
        assert!(wal.append(Wal::encode(c.iter())).is_ok());
        wal.sync().unwrap();
        drop(wal);
        let (_, records) = Wal::open(&path, 7, SALT, 4096).unwrap();
        assert_eq!(records, vec![a.clone(), b.clone(), c]);
        // Another generation's records are not this one's.
        let (_, records) = Wal::open(&path, 8, SALT, 4096).unwrap();
        assert!(records.is_empty());
        // A record torn by a crash ends the log (generation 7 is in region 1).
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(b"x", 4096 + torn_at + HEADER as u64 + 3).unwrap();
        let (_, records) = Wal::open(&path, 7, SALT, 4096).unwrap();
        assert_eq!(records, vec![a, b]);
    }

    #[test]
    fn a_restarted_log_ignores_what_the_last_generation_left_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let (mut wal, _) = Wal::open(&path, 1, SALT, 4096).unwrap();
        let long = writes(&[("old", Some("a long value from before the checkpoint"))]);
        let later = writes(&[("old2", Some("x"))]);
        assert!(wal.append(Wal::encode(long.iter())).is_ok());
        assert!(wal.append(Wal::encode(later.iter())).is_ok());
        // Generation 3 writes generation 1's region again.
        wal.restart(2).unwrap();
        wal.restart(3).unwrap();
        let short = writes(&[("new", Some("b"))]);
        assert!(wal.append(Wal::encode(short.iter())).is_ok());
        wal.sync().unwrap();
        drop(wal);
        let (_, records) = Wal::open(&path, 3, SALT, 4096).unwrap();
        assert_eq!(records, vec![short]);
    }

    #[test]
    fn the_generation_after_the_files_is_replayed_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let (mut wal, _) = Wal::open(&path, 4, SALT, 4096).unwrap();
        let before = writes(&[("a", Some("1"))]);
        let during = writes(&[("a", Some("2")), ("b", Some("3"))]);
        assert!(wal.append(Wal::encode(before.iter())).is_ok());
        // A checkpoint to generation 5 is asked for; commits go on in the
        // other region before it is made, and the process dies.
        wal.restart(5).unwrap();
        assert!(wal.append(Wal::encode(during.iter())).is_ok());
        wal.sync().unwrap();
        drop(wal);
        let (_, records) = Wal::open(&path, 4, SALT, 4096).unwrap();
        assert_eq!(records, vec![before, during.clone()]);
        // The checkpoint made it: generation 4's records are redundant.
        let (_, records) = Wal::open(&path, 5, SALT, 4096).unwrap();
        assert_eq!(records, vec![during]);
    }

    /// The next generation is written only once this one's records are
    /// durable: a disk that fails the fsync keeps the log where it was.
    #[test]
    fn a_generation_is_made_durable_before_the_next_is_written() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let (mut wal, _) = Wal::open(&dir.path().join("log"), 4, SALT, 4096).unwrap();
        let failing = Arc::new(AtomicBool::new(false));
        wal.fail_while(Arc::clone(&failing));
        assert!(wal.append(Wal::encode(writes(&[("lease", Some("active"))]).iter())).is_ok());
        failing.store(true, Ordering::SeqCst);
        assert!(wal.restart(5).is_err(), "switched regions with the record unsynced");
        assert_eq!(wal.generation(), 4);
        failing.store(false, Ordering::SeqCst);
        assert!(wal.restart(5).is_ok());
        assert_eq!(wal.generation(), 5);
    }

    /// A record is this log's only under its salt: one of another open, or
    /// made by anyone else, is not read whatever its bytes.
    #[test]
    fn records_are_read_under_their_salt_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let (mut wal, _) = Wal::open(&path, 2, SALT, 4096).unwrap();
        let first = writes(&[("a", Some("1"))]);
        assert!(wal.append(Wal::encode(first.iter())).is_ok());
        wal.sync().unwrap();
        drop(wal);
        for other in [None, Some(1), SALT.map(|s| s ^ 1)] {
            let (_, records) = Wal::open(&path, 2, other, 4096).unwrap();
            assert!(records.is_empty(), "read under {other:?}");
        }
        // A new salt from the restart on: what the old one wrote is stale.
        let (mut wal, records) = Wal::open(&path, 2, SALT, 4096).unwrap();
        assert_eq!(records, vec![first]);
        wal.restart_salted(4, Some(7)).unwrap();
        let second = writes(&[("b", Some("2"))]);
        assert!(wal.append(Wal::encode(second.iter())).is_ok());
        wal.sync().unwrap();
        drop(wal);
        let (_, records) = Wal::open(&path, 4, Some(7), 4096).unwrap();
        assert_eq!(records, vec![second]);
        let (_, records) = Wal::open(&path, 4, SALT, 4096).unwrap();
        assert!(records.is_empty());
    }

    /// Records follow each other by sequence number: a well-formed record
    /// of the generation, under its salt, that is not the next one ends the
    /// replay (one the crc alone lets through).
    #[test]
    fn a_record_out_of_sequence_ends_the_replay() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let (mut wal, _) = Wal::open(&path, 2, SALT, 4096).unwrap();
        let (a, b) = (writes(&[("a", Some("1"))]), writes(&[("b", Some("2"))]));
        assert!(wal.append(Wal::encode(a.iter())).is_ok());
        assert!(wal.append(Wal::encode(b.iter())).is_ok());
        wal.sync().unwrap();
        let next = region_start(2, 4096) + wal.end;
        drop(wal);
        for seq in [4, 2, 1] {
            let record = Wal::forge(SALT, 2, seq, &writes(&[("out of sequence", Some("x"))]));
            OpenOptions::new().write(true).open(&path).unwrap().write_all_at(&record, next).unwrap();
            let (_, records) = Wal::open(&path, 2, SALT, 4096).unwrap();
            assert_eq!(records, vec![a.clone(), b.clone()], "a record numbered {seq} after the second was read");
        }
    }

    #[test]
    fn a_log_of_one_region_is_still_replayed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let old = writes(&[("a", Some("1"))]);
        // What a log of one region left, at its start, under an odd generation.
        let mut bytes = Wal::forge(SALT, 3, 1, &old);
        bytes.resize(4096, 0);
        std::fs::write(&path, &bytes).unwrap();
        let (_, records) = Wal::open(&path, 3, SALT, 4096).unwrap();
        assert_eq!(records, vec![old]);
    }

    #[test]
    fn a_record_that_does_not_fit_is_refused_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (mut wal, _) = Wal::open(&dir.path().join("log"), 1, SALT, 64).unwrap();
        let big = writes(&[("k", Some(&"v".repeat(100)))]);
        let record = Wal::encode(big.iter());
        assert!(!wal.fits(&record));
        assert!(wal.append(record).is_err());
        assert!(wal.is_empty());
    }

    /// A record is encoded only if it fits the room given, and then as
    /// without a bound; one that does not is given up before its values are
    /// copied whole.
    #[test]
    fn a_record_is_encoded_only_within_its_room() {
        let small = writes(&[("a", Some("1")), ("b", None)]);
        let record = Wal::encode(small.iter());
        let len = record.len() as u64;
        assert_eq!(Wal::encode_within(small.iter(), len), Some(record));
        assert_eq!(Wal::encode_within(small.iter(), len - 1), None);
        let big = writes(&[("k", Some(&"v".repeat(100)))]);
        assert_eq!(Wal::encode_within(big.iter(), 64), None);
        let dir = tempfile::tempdir().unwrap();
        let (wal, _) = Wal::open(&dir.path().join("log"), 1, SALT, 64).unwrap();
        assert_eq!(wal.room(), 64);
    }
}
