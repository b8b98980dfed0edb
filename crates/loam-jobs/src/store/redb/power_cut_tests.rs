//! Power cuts: the store on a simulated disk that keeps, of what was written
//! since each file's last fsync, only what a power cut would.
//!
//! A `kill -9` (the stress crate's crash test) leaves the kernel's page cache
//! to be written back, so it cannot see a missing or misordered fsync. Here
//! the redb file and the log are held in memory as the kernel holds them:
//! what reads see, and for every page written since the file's last sync its
//! content on the disk. A cut keeps, sector by sector, either the new bytes or
//! the disk's, and either length of a file whose length changed: any
//! write-back order the kernel might have reached. The store is opened again
//! on what the cut left, and must hold every write it acknowledged as
//! durable, each operation whole or not at all, in the order they ran.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redb::StorageBackend;
use std::collections::{BTreeMap, HashMap};

use super::super::wal::LogFile;
use super::*;
use crate::kv::KvTxn;

const PAGE: u64 = 4096;
const SECTOR: u64 = 512;
const REDB_FILE: usize = 0;
const LOG_FILE: usize = 1;

/// One file: what reads see, and the disk's content of each page written
/// since the last sync.
#[derive(Default)]
struct SimFile {
    bytes: Vec<u8>,
    on_disk: BTreeMap<u64, Vec<u8>>,
    synced_len: u64,
}

impl SimFile {
    /// From a cut's image: all of it on the disk.
    fn durable(bytes: Vec<u8>) -> Self {
        Self { synced_len: bytes.len() as u64, bytes, on_disk: BTreeMap::new() }
    }

    /// Notes the disk's content of the pages `from..to` touches before they change.
    fn dirty(&mut self, from: u64, to: u64) {
        for page in from / PAGE..to.div_ceil(PAGE) {
            self.on_disk.entry(page).or_insert_with(|| {
                let mut content = vec![0u8; PAGE as usize];
                let start = (page * PAGE).min(self.bytes.len() as u64) as usize;
                let end = ((page + 1) * PAGE).min(self.bytes.len() as u64) as usize;
                content[..end - start].copy_from_slice(&self.bytes[start..end]);
                content
            });
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let end = offset + data.len() as u64;
        self.dirty(offset, end);
        if end > self.bytes.len() as u64 {
            self.bytes.resize(end as usize, 0);
        }
        self.bytes[offset as usize..end as usize].copy_from_slice(data);
    }

    fn set_len(&mut self, len: u64) {
        let old = self.bytes.len() as u64;
        self.dirty(len.min(old), len.max(old));
        self.bytes.resize(len as usize, 0);
    }

    fn sync(&mut self) {
        self.on_disk.clear();
        self.synced_len = self.bytes.len() as u64;
    }

    /// What a power cut leaves: each sector written since the last sync kept
    /// with probability `kept`, and the new length or the synced one.
    fn image(&self, rng: &mut StdRng, kept: f64) -> Vec<u8> {
        let len = if rng.random_bool(0.5) { self.synced_len } else { self.bytes.len() as u64 };
        let mut image = self.bytes.clone();
        let full = self.on_disk.keys().next_back().map_or(0, |p| (p + 1) * PAGE);
        if (image.len() as u64) < full {
            image.resize(full as usize, 0);
        }
        for (page, disk) in &self.on_disk {
            for sector in 0..PAGE / SECTOR {
                if !rng.random_bool(kept) {
                    let at = (page * PAGE + sector * SECTOR) as usize;
                    let from = (sector * SECTOR) as usize;
                    image[at..at + SECTOR as usize].copy_from_slice(&disk[from..from + SECTOR as usize]);
                }
            }
        }
        image.resize(len as usize, 0);
        image
    }
}

/// The redb file and the log, cut together.
#[derive(Default)]
struct Disk {
    state: parking_lot::Mutex<DiskState>,
}

#[derive(Default)]
struct DiskState {
    files: [SimFile; 2],
    /// The power is cut: every write and sync fails.
    cut: bool,
}

impl Disk {
    fn from_images(images: [Vec<u8>; 2]) -> Arc<Self> {
        let [redb, log] = images;
        let files = [SimFile::durable(redb), SimFile::durable(log)];
        Arc::new(Self { state: parking_lot::Mutex::new(DiskState { files, cut: false }) })
    }

    /// Cuts the power: from now on every write and sync fails, and what the
    /// disk holds is returned.
    fn cut(&self, rng: &mut StdRng) -> [Vec<u8>; 2] {
        let mut state = self.state.lock();
        state.cut = true;
        let kept = [0.0, 0.3, 0.7, 1.0][rng.random_range(0..4)];
        [state.files[REDB_FILE].image(rng, kept), state.files[LOG_FILE].image(rng, kept)]
    }

    fn change(&self, file: usize, change: impl FnOnce(&mut SimFile)) -> std::io::Result<()> {
        let mut state = self.state.lock();
        if state.cut {
            return Err(std::io::Error::other("the power is cut"));
        }
        change(&mut state.files[file]);
        Ok(())
    }
}

/// One of a [`Disk`]'s files.
struct OnDisk {
    disk: Arc<Disk>,
    file: usize,
}

impl std::fmt::Debug for OnDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OnDisk({})", self.file)
    }
}

impl OnDisk {
    fn len(&self) -> u64 {
        self.disk.state.lock().files[self.file].bytes.len() as u64
    }

    fn read(&self, at: u64, out: &mut [u8]) -> std::io::Result<()> {
        let state = self.disk.state.lock();
        let bytes = &state.files[self.file].bytes;
        let end = at as usize + out.len();
        if end > bytes.len() {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "read past the end"));
        }
        out.copy_from_slice(&bytes[at as usize..end]);
        Ok(())
    }
}

impl StorageBackend for OnDisk {
    fn len(&self) -> std::io::Result<u64> {
        Ok(OnDisk::len(self))
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        OnDisk::read(self, offset, out)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.disk.change(self.file, |f| f.set_len(len))
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.disk.change(self.file, SimFile::sync)
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.disk.change(self.file, |f| f.write(offset, data))
    }
}

impl LogFile for OnDisk {
    fn len(&self) -> std::io::Result<u64> {
        Ok(OnDisk::len(self))
    }
    fn read_bytes(&self, buf: &mut [u8], at: u64) -> std::io::Result<()> {
        OnDisk::read(self, at, buf)
    }
    fn write_bytes(&self, buf: &[u8], at: u64) -> std::io::Result<()> {
        self.disk.change(self.file, |f| f.write(at, buf))
    }
    fn sync(&self) -> std::io::Result<()> {
        self.disk.change(self.file, SimFile::sync)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.disk.change(self.file, |f| f.set_len(len))
    }
}

/// Opens the store on what the disk holds. redb is told to refuse a full
/// repair (a walk of the whole file, which took 6 s and more at a few GB):
/// every durable commit saves its allocator state, so whatever a cut leaves
/// opens from the last one.
fn open_store(disk: &Arc<Disk>, options: RedbOptions) -> Result<RedbStore, StoreError> {
    let db = Database::builder()
        .set_repair_callback(|session| session.abort())
        .create_with_backend(OnDisk { disk: Arc::clone(disk), file: REDB_FILE })
        .map_err(|e| match e {
            redb::DatabaseError::RepairAborted => {
                panic!("the open needed a full repair: the last durable commit did not save redb's allocator state")
            }
            e => io(e),
        })?;
    RedbStore::open_on(db, Box::new(OnDisk { disk: Arc::clone(disk), file: LOG_FILE }), options)
}

const WRITERS: usize = 4;
/// Operations a writer has sent and not yet seen answered, at most.
const IN_FLIGHT: usize = 8;

fn key(family: char, writer: usize, n: i64) -> String {
    format!("{family}/{writer}/{n:08}")
}

/// How many of a writer's latest operations keep their `d/` value: the
/// values make records that span sectors and pages, and a file that outgrows
/// its pages, without the file growing round after round.
const VALUES_KEPT: i64 = 32;

/// Operation `n`'s value of `d/`, checkable.
fn value(writer: usize, n: i64) -> Vec<u8> {
    let len = 16 + (n as usize * 7919 + writer * 131) % 1500;
    (0..len).map(|i| (i as i64 ^ n ^ writer as i64) as u8).collect()
}

/// How durable operation `n` asks to be: a mix, as a host's adds, leases
/// and the store's own bookkeeping are.
fn durable(n: i64) -> Durable {
    match n % 64 {
        1 | 5 | 9 => Durable::No,
        3 => Durable::Always,
        _ => Durable::UnlessRelaxed,
    }
}

/// Whether operation `n`'s acknowledgement says it survives a cut.
fn survives(n: i64, immediate: bool) -> bool {
    match durable(n) {
        Durable::No => false,
        Durable::UnlessRelaxed => immediate,
        Durable::Always => true,
    }
}

/// Operation `n` of `writer`: puts `a/w/n` and `b/w/n`, moves the single
/// `c/w/` key from `n - 1` to `n`, and the window of `d/w/` values one on,
/// in one write.
fn submit(store: &RedbStore, writer: usize, n: i64) -> mpsc::Receiver<bool> {
    let (sender, receiver) = mpsc::channel();
    let body: super::super::OpBody = Box::new(move |txn: &mut dyn KvTxn| {
        txn.put(key('a', writer, n).as_bytes(), n.to_le_bytes().to_vec())?;
        txn.put(key('b', writer, n).as_bytes(), n.to_le_bytes().to_vec())?;
        txn.delete(key('c', writer, n - 1).as_bytes())?;
        txn.put(key('c', writer, n).as_bytes(), Vec::new())?;
        txn.put(key('d', writer, n).as_bytes(), value(writer, n))?;
        txn.delete(key('d', writer, n - VALUES_KEPT).as_bytes())?;
        Ok(Box::new(()) as OpOutput)
    });
    let done: OpDone = Box::new(move |result| {
        let _ = sender.send(result.is_ok());
    });
    store.submit(WriteOp { body, durable: durable(n), brief: true, done });
    receiver
}

/// The last operation of each writer the store holds, checking that it holds
/// every one before it, whole, and no part of any after it.
fn last_held(store: &RedbStore, context: &str) -> [i64; WRITERS] {
    let mut read = store.snapshot().unwrap();
    let mut last = [-1; WRITERS];
    for (writer, last) in last.iter_mut().enumerate() {
        let scan = |read: &mut Box<dyn KvRead + Send>, family: char| {
            let from = format!("{family}/{writer}/");
            let to = format!("{family}/{writer}0");
            read.scan(&KeyRange::new(from.into_bytes(), to.into_bytes()), usize::MAX, false).unwrap()
        };
        let a = scan(&mut read, 'a');
        let b = scan(&mut read, 'b');
        let c = scan(&mut read, 'c');
        let d = scan(&mut read, 'd');
        *last = a.len() as i64 - 1;
        for (n, (k, v)) in a.iter().enumerate() {
            let n = n as i64;
            assert_eq!(text(k), key('a', writer, n), "{context}: writer {writer}'s operations have a gap");
            assert_eq!(v[..], n.to_le_bytes(), "{context}: {} holds another value", key('a', writer, n));
        }
        let kept = (*last - VALUES_KEPT + 1).max(0);
        let d_keys: Vec<_> = d.iter().map(|(k, _)| text(k)).collect();
        let expected: Vec<_> = (kept..=*last).map(|n| key('d', writer, n)).collect();
        assert_eq!(d_keys, expected, "{context}: writer {writer}'s d keys are not its last operations'");
        for ((_, v), n) in d.iter().zip(kept..) {
            assert!(*v == value(writer, n), "{context}: {} holds another value", key('d', writer, n));
        }
        let b_keys: Vec<_> = b.iter().map(|(k, _)| text(k)).collect();
        let expected: Vec<_> = (0..=*last).map(|n| key('b', writer, n)).collect();
        assert_eq!(b_keys, expected, "{context}: writer {writer}'s b keys are not its a keys'");
        let c_keys: Vec<_> = c.iter().map(|(k, _)| text(k)).collect();
        let expected: Vec<_> = (*last >= 0).then(|| key('c', writer, *last)).into_iter().collect();
        assert_eq!(c_keys, expected, "{context}: writer {writer}'s c key is not its last operation's");
    }
    last
}

fn text(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

/// Writers send operations until the power is cut; returns, for each, the
/// last operation acknowledged that must survive it.
fn write_until_cut(
    store: &Arc<RedbStore>,
    first: [i64; WRITERS],
    immediate: bool,
) -> Vec<std::thread::JoinHandle<i64>> {
    (0..WRITERS)
        .map(|writer| {
            let store = Arc::clone(store);
            let first = first[writer];
            std::thread::spawn(move || {
                let mut answers = VecDeque::new();
                let mut acknowledged = -1;
                let mut n = first;
                loop {
                    while answers.len() < IN_FLIGHT {
                        answers.push_back((n, submit(&store, writer, n)));
                        n += 1;
                    }
                    let (sent, answer) = answers.pop_front().expect("one in flight");
                    match answer.recv() {
                        Ok(true) if survives(sent, immediate) => acknowledged = sent,
                        Ok(true) => {}
                        _ => return acknowledged,
                    }
                }
            })
        })
        .collect()
}

/// A random source and its seed: `LOAM_POWER_CUT_SEED` replays a failure's
/// cuts (the store's threads still interleave as they will).
fn seeded() -> (u64, StdRng) {
    let seed = std::env::var("LOAM_POWER_CUT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    (seed, StdRng::seed_from_u64(seed))
}

/// `LOAM_POWER_CUT_ROUNDS`, or `default`: how many cuts a test makes.
fn rounds(default: u64) -> u64 {
    std::env::var("LOAM_POWER_CUT_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(default)
}

/// Rounds of: open what the last cut left (checking it), write from several
/// threads, cut at a random moment (now and then during the open instead).
fn power_cuts(durability: Durability) {
    let immediate = durability == Durability::Immediate;
    let rounds = rounds(24);
    let (seed, mut rng) = seeded();
    let mut disk = Arc::new(Disk::default());
    // Each writer's last operation the store held at an open (durable: the
    // open's recovery commits durably), and the last acknowledged that must
    // survive a cut.
    let mut held = [-1i64; WRITERS];
    let mut acknowledged = [-1i64; WRITERS];
    for round in 0..=rounds {
        let context = format!("seed {seed}, round {round}");
        let checkpoint_interval = Duration::from_millis(rng.random_range(1..40));
        let options = RedbOptions { durability, checkpoint_interval, ..Default::default() };
        if round > 0 && rng.random_ratio(1, 6) {
            // Cut during the open, its recovery or its first commits.
            let opening = Arc::clone(&disk);
            let open = std::thread::spawn(move || open_store(&opening, options).map(drop));
            std::thread::sleep(Duration::from_micros(rng.random_range(0..3000)));
            let images = disk.cut(&mut rng);
            let _ = open.join().expect("the open does not panic");
            disk = Disk::from_images(images);
            continue;
        }
        let store = Arc::new(open_store(&disk, options).unwrap_or_else(|e| panic!("{context}: {e}")));
        let now = last_held(&store, &context);
        for writer in 0..WRITERS {
            assert!(
                now[writer] >= held[writer],
                "{context}: writer {writer} held {}, now {}",
                held[writer],
                now[writer]
            );
            assert!(
                now[writer] >= acknowledged[writer],
                "{context}: writer {writer}'s operation {} was acknowledged, the store holds up to {}",
                acknowledged[writer],
                now[writer],
            );
        }
        held = now;
        if round == rounds {
            break;
        }
        let writers = write_until_cut(&store, held.map(|n| n + 1), immediate);
        std::thread::sleep(Duration::from_millis(rng.random_range(0..150)));
        let images = disk.cut(&mut rng);
        for (writer, acked) in writers.into_iter().enumerate() {
            acknowledged[writer] = acked.join().unwrap().max(held[writer]);
        }
        drop(store);
        disk = Disk::from_images(images);
    }
}

/// Under immediate durability every acknowledged write survives any cut,
/// checkpoints and the log's reuse of its regions included.
#[test]
fn a_power_cut_loses_no_acknowledged_write() {
    power_cuts(Durability::Immediate);
}

/// Under relaxed durability a cut may lose the last writes, but what it
/// leaves is what the store held at some moment: every operation whole, and
/// none without those before it. A write that asks to be durable whatever the
/// durability is never lost.
#[test]
fn a_power_cut_under_relaxed_durability_leaves_a_state_that_was() {
    power_cuts(Durability::Relaxed { flush_interval_ms: 20 });
}

/// The log alone, many times over with cuts at random steps: what a reopen
/// replays is a prefix of the records appended since the generation the
/// redb file stores, and holds every record appended before a sync. The
/// store-wide tests above reach a cut between a checkpoint's start and its
/// commit rarely; here it is one step among others.
#[test]
fn a_power_cut_leaves_the_log_a_prefix_of_its_records() {
    const REGION: u64 = 16 << 10;
    const SALT: Option<u64> = Some(0x0c07);
    let (seed, mut rng) = seeded();
    let record = |i: u64, pad: usize| {
        let writes: Writes = [(b"i".to_vec(), Some(i.to_le_bytes().to_vec())), (b"pad".to_vec(), Some(vec![7; pad]))]
            .into_iter()
            .collect();
        Wal::encode(writes.iter())
    };
    let number = |writes: &Writes| u64::from_le_bytes(writes[&b"i".to_vec()].as_deref().unwrap().try_into().unwrap());
    for case in 0..2000 {
        let context = format!("seed {seed}, case {case}");
        let disk = Arc::new(Disk::default());
        let open = |disk: &Arc<Disk>, generation| {
            Wal::open_on(Box::new(OnDisk { disk: Arc::clone(disk), file: LOG_FILE }), generation, SALT, REGION).unwrap()
        };
        let (mut wal, _) = open(&disk, 1);
        // The generation the file stores (its last checkpoint's), whether the
        // next one's checkpoint is under way, each record appended (its
        // generation and number), and how many of them a sync made durable.
        let mut stored = 1;
        let mut checkpointing = false;
        let mut appended: Vec<(u64, u64)> = Vec::new();
        let mut durable = 0;
        for i in 0..rng.random_range(1..80) {
            if checkpointing && rng.random_ratio(1, 3) {
                // The checkpoint's durable commit.
                stored += 1;
                checkpointing = false;
            }
            let next = record(i, rng.random_range(0..3000));
            if !wal.fits(&next) || (!checkpointing && rng.random_ratio(1, 8)) {
                // A group that does not fit waits for the checkpoint under way.
                if checkpointing {
                    stored += 1;
                }
                wal.restart(wal.generation() + 1).unwrap();
                durable = appended.len();
                checkpointing = true;
            }
            wal.append(next).unwrap();
            appended.push((wal.generation(), i));
            if rng.random_bool(0.4) {
                wal.sync().unwrap();
                durable = appended.len();
            }
        }
        // What a reopen must replay from: the records of the stored
        // generation on, those a sync made durable at least.
        let since_stored: Vec<u64> = appended.iter().filter(|(g, _)| *g >= stored).map(|(_, i)| *i).collect();
        let durable = appended[..durable].iter().filter(|(g, _)| *g >= stored).count();
        let images = disk.cut(&mut rng);
        let (_, records) = open(&Disk::from_images(images), stored);
        let replayed: Vec<u64> = records.iter().map(number).collect();
        assert!(
            since_stored.starts_with(&replayed),
            "{context}: replayed {replayed:?}, not a prefix of {since_stored:?} (generation {stored})"
        );
        assert!(
            replayed.len() >= durable,
            "{context}: replayed {replayed:?}, {durable} of {since_stored:?} were synced"
        );
    }
}

/// Jobs through power cuts, with workers that outlive them (a server's remote
/// workers do): producers add jobs and workers lease and finish them on
/// several threads until the cut; the store is opened on what is left, and
/// the workers' leases in hand at the cut are finished after it, beside the
/// next round's; now and then a round only leases, so that leases, never
/// fsynced, are lost. Every job whose add was acknowledged is there, every
/// acknowledged outcome stays, no job is acknowledged two outcomes, and no
/// lease's epoch is handed out twice (a lease lost in the cut must be fenced,
/// not finished beside its job's next one).
#[test]
fn a_power_cut_keeps_every_acknowledged_job_and_outcome() {
    use crate::{CompleteOptions, EnqueueRequest, Fence, JobError, JobState, Jobs, LeaseRequest, Outcome, SystemClock};

    const NS: &str = "cut";
    const QUEUE: &str = "q";
    /// Short, so leases from before a cut lapse and their jobs come back.
    const LOCK_MS: u64 = 150;

    #[derive(Default)]
    struct Promises {
        added: Vec<String>,
        /// Job id -> its acknowledged outcome; a second one fails the test.
        finished: HashMap<String, JobState>,
        twice: Vec<String>,
        /// Leases in hand: finished (or fenced) after the cut.
        in_hand: HashMap<String, u64>,
        /// Every lease handed out (job id, epoch): one handed out again
        /// (an epoch reused after a cut) fails the test.
        leased: std::collections::HashSet<(String, u64)>,
        errors: Vec<String>,
    }

    impl Promises {
        fn finished(&mut self, id: &str, state: JobState) {
            if self.finished.insert(id.to_string(), state).is_some() {
                self.twice.push(format!("{id} finished"));
            }
        }

        fn leased(&mut self, id: &str, epoch: u64) {
            self.in_hand.insert(id.to_string(), epoch);
            if !self.leased.insert((id.to_string(), epoch)) {
                self.twice.push(format!("{id} leased at epoch {epoch}"));
            }
        }
    }

    fn finish(jobs: &Jobs, id: &str, epoch: u64, fail: bool, promises: &Mutex<Promises>) {
        let outcome = if fail {
            Outcome::Fail { error: JobError::new("power cut test"), dead_letter: false }
        } else {
            Outcome::Ok { result: Some(id.as_bytes().to_vec()) }
        };
        let done = jobs.complete(NS, QUEUE, id, Fence::Epoch(epoch), outcome, CompleteOptions::default()).wait();
        // An error (fenced: a lease lost in a cut; or the cut itself)
        // acknowledged nothing.
        let Ok(done) = done else { return };
        let mut promises = promises.lock();
        match done.state {
            Some(state @ (JobState::Completed | JobState::Failed)) => promises.finished(id, state),
            other => promises.errors.push(format!("{id}: finished as {other:?}")),
        }
    }

    let (seed, mut rng) = seeded();
    let rounds = rounds(12);
    let mut disk = Arc::new(Disk::default());
    let mut promises = Promises::default();
    for round in 0..=rounds {
        let context = format!("seed {seed}, round {round}");
        let options =
            RedbOptions { checkpoint_interval: Duration::from_millis(rng.random_range(1..40)), ..Default::default() };
        let store = open_store(&disk, options).unwrap_or_else(|e| panic!("{context}: {e}"));
        let jobs = Jobs::with_store(Box::new(store), Arc::new(SystemClock), crate::Config::default()).unwrap();
        for id in &promises.added {
            assert!(jobs.get_job(NS, QUEUE, id).unwrap().is_some(), "{context}: job {id} was added, and is gone");
        }
        for (id, state) in &promises.finished {
            let job = jobs.get_job(NS, QUEUE, id).unwrap().unwrap_or_else(|| panic!("{context}: {id} is gone"));
            assert_eq!(job.state, *state, "{context}: job {id} was acknowledged {state:?}");
            if *state == JobState::Completed {
                assert_eq!(job.return_value.as_deref(), Some(id.as_bytes()), "{context}: job {id}'s result");
            }
        }
        assert!(promises.twice.is_empty(), "{context}: acknowledged twice: {:?}", promises.twice);
        assert!(promises.errors.is_empty(), "{context}: {:?}", promises.errors);
        if round == rounds {
            break;
        }
        let promises_now = Arc::new(Mutex::new(std::mem::take(&mut promises)));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut threads = Vec::new();
        // Now and then the workers only lease, each job kept until the cut
        // (long jobs), and nobody adds: the leases are the round's only
        // writes, and none of them is fsynced.
        let only_leases = rng.random_ratio(1, 4);
        // The leases the last rounds' workers held at their cuts, finished
        // now (but in a round that only leases).
        if !only_leases {
            let in_hand: Vec<(String, u64)> = promises_now.lock().in_hand.drain().collect();
            let (jobs, promises) = (jobs.clone(), Arc::clone(&promises_now));
            threads.push(std::thread::spawn(move || {
                for (id, epoch) in in_hand {
                    finish(&jobs, &id, epoch, false, &promises);
                }
            }));
        }
        for producer in (0..2).filter(|_| !only_leases) {
            let (jobs, promises, stop) = (jobs.clone(), Arc::clone(&promises_now), Arc::clone(&stop));
            threads.push(std::thread::spawn(move || {
                for n in 0.. {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    let id = format!("r{round}-p{producer}-{n}");
                    let req = EnqueueRequest {
                        name: "cut".into(),
                        data: id.as_bytes().to_vec(),
                        job_id: Some(id.clone()),
                        attempts: 2,
                        ..Default::default()
                    };
                    match jobs.enqueue(NS, QUEUE, req).wait() {
                        Ok(added) if added.created => promises.lock().added.push(id),
                        Ok(added) => promises.lock().errors.push(format!("{id}: added as {added:?}")),
                        Err(_) => break,
                    }
                }
            }));
        }
        for worker in 0..2 {
            let (jobs, promises, stop) = (jobs.clone(), Arc::clone(&promises_now), Arc::clone(&stop));
            threads.push(std::thread::spawn(move || {
                let req = LeaseRequest {
                    max: 4,
                    worker: Some(format!("w{worker}")),
                    lock_duration_ms: LOCK_MS,
                    ..Default::default()
                };
                let mut turn = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let Ok(leased) = jobs.lease(NS, QUEUE, req.clone()).wait() else { break };
                    if leased.leases.is_empty() {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    for lease in leased.leases {
                        let id = lease.job.id.clone();
                        promises.lock().leased(&id, lease.epoch);
                        turn += 1;
                        // One lease in seven is kept past the cut, as a worker
                        // still busy with its job when the server went down.
                        if only_leases || turn.is_multiple_of(7) {
                            continue;
                        }
                        finish(&jobs, &id, lease.epoch, turn.is_multiple_of(5), &promises);
                        promises.lock().in_hand.remove(&id);
                    }
                }
            }));
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(0..150)));
        let images = disk.cut(&mut rng);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for thread in threads {
            thread.join().unwrap();
        }
        jobs.close();
        promises = std::mem::take(&mut *promises_now.lock());
        disk = Disk::from_images(images);
    }
}
