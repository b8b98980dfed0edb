//! Property tests of the layers together: every view reads as the writes applied in order would.

use super::*;

/// A base held in a map.
pub(super) struct MapRead(pub(super) BTreeMap<Key, Value>);
impl KvRead for MapRead {
    fn get(&mut self, key: &[u8]) -> Result<Option<Value>, StoreError> {
        Ok(self.0.get(key).cloned())
    }
    fn scan(&mut self, r: &KeyRange, limit: usize, rev: bool) -> Result<Vec<(Key, Value)>, StoreError> {
        let it = self.0.range(r.start.clone()..r.end.clone()).map(|(k, v)| (k.clone(), v.clone()));
        Ok(if rev { it.rev().take(limit).collect() } else { it.take(limit).collect() })
    }
}

/// A generated batch (one-byte keys and values) as writes.
fn writes_of(batch: BTreeMap<u8, Option<u8>>) -> Writes {
    batch.into_iter().map(|(k, v)| (vec![k], v.map(|v| vec![v]))).collect()
}

fn apply(map: &mut BTreeMap<Key, Value>, writes: &Writes) {
    for (k, v) in writes {
        match v {
            Some(v) => {
                map.insert(k.clone(), v.clone());
            }
            None => {
                map.remove(k);
            }
        }
    }
}

/// `reader` scans `range` as `expected` does, and gets every one-byte key as it has it.
fn reads_match(
    reader: &mut dyn KvRead,
    expected: &BTreeMap<Key, Value>,
    range: KeyRange,
    limit: usize,
    rev: bool,
) -> Result<(), proptest::test_runner::TestCaseError> {
    let got = reader.scan(&range, limit, rev).unwrap();
    let want = MapRead(expected.clone()).scan(&range, limit, rev).unwrap();
    proptest::prop_assert_eq!(got, want, "scan {:?}", range);
    for k in 0u8..32 {
        proptest::prop_assert_eq!(reader.get(&[k]).unwrap(), expected.get(&vec![k]).cloned(), "get {}", k);
    }
    Ok(())
}

#[derive(Debug, Clone)]
enum Step {
    Put(u8, u8),
    Delete(u8),
    /// A byte appended to the key's value.
    Append(u8, u8),
    Scan {
        lo: u8,
        width: u8,
        limit: usize,
        rev: bool,
    },
}

impl Step {
    fn writes(&self) -> bool {
        !matches!(self, Step::Scan { .. })
    }
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        (0u8..32, 0u8..4).prop_map(|(k, v)| Step::Put(k, v)),
        (0u8..32).prop_map(Step::Delete),
        (0u8..32, 0u8..4).prop_map(|(k, v)| Step::Append(k, v)),
        (0u8..8, 0u8..40, 0usize..12, any::<bool>()).prop_map(|(lo, width, limit, rev)| Step::Scan {
            lo,
            width,
            limit,
            rev
        }),
    ]
}

/// Takes `step` in `overlay` and in `model` (the reads it should give);
/// a scan must read as the model does.
fn run_step(
    overlay: &mut Overlay,
    model: &mut BTreeMap<Key, Value>,
    step: Step,
) -> Result<(), proptest::test_runner::TestCaseError> {
    match step {
        Step::Put(k, v) => {
            overlay.put(&[k], vec![v]).unwrap();
            model.insert(vec![k], vec![v]);
        }
        Step::Delete(k) => {
            overlay.delete(&[k]).unwrap();
            model.remove(&vec![k]);
        }
        Step::Append(k, v) => {
            overlay.append(&[k], &mut |value| value.push(v)).unwrap();
            model.entry(vec![k]).or_default().push(v);
        }
        Step::Scan { lo, width, limit, rev } => {
            let range = KeyRange::new(vec![lo], vec![lo.saturating_add(width)]);
            let got = overlay.scan(&range, limit, rev).unwrap();
            let want = MapRead(model.clone()).scan(&range, limit, rev).unwrap();
            proptest::prop_assert_eq!(got, want, "scan {:?}", range);
        }
    }
    Ok(())
}

proptest::proptest! {
    /// The net writes of several sets are each key once, ascending, with
    /// the last set's write of it: what applying the sets in order leaves.
    #[test]
    fn net_writes_are_the_sets_applied_in_order(
        sets in proptest::collection::vec(
            proptest::collection::btree_map(0u8..24, proptest::option::of(0u8..4), 0..12),
            0..8,
        ),
    ) {
        let sets: Vec<Writes> = sets.into_iter().map(writes_of).collect();
        let mut applied = Writes::new();
        for set in &sets {
            applied.extend(set.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        let net: Vec<_> = net_writes(&sets).collect();
        let want: Vec<_> = applied.iter().collect();
        proptest::prop_assert_eq!(net, want);
    }
}

proptest::proptest! {
    /// Every scan through an overlay, interleaved with writes (so the scan
    /// floors come into play), equals a scan of the base with the writes applied.
    #[test]
    fn overlay_scans_match_applied_map(
        base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..24),
        steps in proptest::collection::vec(step(), 0..40),
    ) {
        let base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
        let mut expected = base.clone();
        let mut reader = MapRead(base);
        let mut overlay = Overlay::new(&mut reader);
        for s in steps {
            run_step(&mut overlay, &mut expected, s)?;
        }
    }
}

proptest::proptest! {
    /// Batches stacked over a base read like the base with every batch
    /// applied in order.
    #[test]
    fn stacked_batches_read_like_the_applied_map(
        base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..24),
        batches in proptest::collection::vec(
            proptest::collection::btree_map(0u8..32, proptest::option::of(0u8..4), 0..12), 0..6),
        lo in 0u8..32, width in 0u8..40, limit in 0usize..40, rev in proptest::bool::ANY,
    ) {
        let base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
        let mut expected = base.clone();
        let batches: Vec<Arc<Writes>> = batches.into_iter().map(|b| Arc::new(writes_of(b))).collect();
        for writes in &batches {
            apply(&mut expected, writes);
        }
        let mut below = MapRead(base);
        let mut stacked = Stacked::new(&batches, &mut below);
        reads_match(&mut stacked, &expected, KeyRange::new(vec![lo], vec![lo.saturating_add(width)]), limit, rev)?;
    }
}

proptest::proptest! {
    /// A batch of operations in one overlay, some failing: every read
    /// (gets, and forward scans, whose floors a failed operation may have
    /// raised) sees the base with the successful operations' writes and
    /// the failing one's own so far, and the batch's writes are the
    /// successful operations' alone.
    #[test]
    fn a_failed_operation_is_taken_back_whole(
        base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..24),
        ops in proptest::collection::vec((proptest::collection::vec(step(), 0..10), proptest::bool::ANY), 0..10),
    ) {
        let base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
        let mut kept = base.clone();
        let mut reader = MapRead(base.clone());
        let mut overlay = Overlay::caching(&mut reader);
        for (steps, succeeds) in ops {
            let mut now = kept.clone();
            let writes = steps.iter().any(Step::writes);
            for step in steps {
                run_step(&mut overlay, &mut now, step)?;
                reads_match(&mut overlay, &now, KeyRange::new(vec![0], vec![32]), 32, false)?;
            }
            proptest::prop_assert_eq!(overlay.end_operation(succeeds).wrote, writes, "whether it wrote");
            if succeeds {
                kept = now;
            }
            reads_match(&mut overlay, &kept, KeyRange::new(vec![0], vec![32]), 32, false)?;
        }
        let mut applied = base;
        apply(&mut applied, &overlay.into_writes());
        proptest::prop_assert_eq!(applied, kept);
    }
}

proptest::proptest! {
    /// Scans through a read-ahead reader, in any order and of any
    /// ranges, read as the base does.
    #[test]
    fn read_ahead_scans_read_like_the_base(
        base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..32),
        extra in 0usize..6,
        scans in proptest::collection::vec((0u8..32, 0u8..40, 0usize..6, proptest::bool::ANY), 0..30),
    ) {
        let base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
        let mut ahead = ReadAhead::new(MapRead(base.clone()), extra);
        for (lo, width, limit, rev) in scans {
            // Ends from a few values, so that ranges share them.
            let range = KeyRange::new(vec![lo], vec![(lo.saturating_add(width) / 8 * 8).max(lo)]);
            reads_match(&mut ahead, &base, range, limit, rev)?;
        }
    }
}

#[derive(Debug, Clone)]
enum MemoStep {
    Put(u8, u8),
    Delete(u8),
    Remember(usize),
    Recall(usize),
}

/// Overlapping on purpose: a range that would overlap a remembered one
/// must not be remembered, or a write could miss forgetting it.
const MEMO_RANGES: [(u8, u8); 5] = [(0, 4), (4, 8), (2, 6), (8, 9), (9, 16)];

fn memo_step() -> impl proptest::strategy::Strategy<Value = MemoStep> {
    use proptest::prelude::*;
    prop_oneof![
        (0u8..16, 0u8..4).prop_map(|(k, v)| MemoStep::Put(k, v)),
        (0u8..16).prop_map(MemoStep::Delete),
        (0..MEMO_RANGES.len()).prop_map(MemoStep::Remember),
        (0..MEMO_RANGES.len()).prop_map(MemoStep::Recall),
    ]
}

proptest::proptest! {
    /// In a batch of operations (some failing, so their writes and what
    /// they remembered are dropped), whatever an operation recalls of a
    /// range is what the range holds as it reads it then.
    #[test]
    fn recalled_values_match_what_the_range_holds(
        base in proptest::collection::btree_map(0u8..16, 0u8..4, 0..12),
        batches in proptest::collection::vec(
            proptest::collection::vec((proptest::collection::vec(memo_step(), 0..12), proptest::bool::ANY), 0..8),
            0..5,
        ),
    ) {
        // One memo for every batch, as the executor keeps it; each batch
        // is committed to the base before the next runs.
        let mut base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
        let mut memo = Memo::default();
        for ops in batches {
            let mut reader = MapRead(base.clone());
            let mut local = Overlay::caching(&mut reader).remembering(&mut memo);
            for (steps, succeeds) in ops {
                for step in steps {
                    match step {
                        MemoStep::Put(k, v) => local.put(&[k], vec![v]).unwrap(),
                        MemoStep::Delete(k) => local.delete(&[k]).unwrap(),
                        MemoStep::Remember(r) => {
                            let range = KeyRange::new(vec![MEMO_RANGES[r].0], vec![MEMO_RANGES[r].1]);
                            let now = local.scan(&range, usize::MAX, false).unwrap();
                            local.remember(&range, Arc::new(now));
                        }
                        MemoStep::Recall(r) => {
                            let range = KeyRange::new(vec![MEMO_RANGES[r].0], vec![MEMO_RANGES[r].1]);
                            if let Some(known) = local.recall(&range) {
                                let known = known.downcast::<Vec<(Key, Value)>>().unwrap();
                                let now = local.scan(&range, usize::MAX, false).unwrap();
                                proptest::prop_assert_eq!(known.as_ref(), &now, "recall of {:?}", range);
                            }
                        }
                    }
                }
                local.end_operation(succeeds);
            }
            let writes = local.into_writes();
            apply(&mut base, &writes);
        }
    }
}

proptest::proptest! {
    /// Pending batches over a base that has the committed batches' writes
    /// read like the base with every batch applied.
    #[test]
    fn pending_batches_read_like_the_applied_map(
        base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..24),
        batches in proptest::collection::vec(
            proptest::collection::btree_map(0u8..32, proptest::option::of(0u8..4), 0..12), 0..5),
        committed in 0usize..5,
        lo in 0u8..32, width in 0u8..40, limit in 0usize..40, rev in proptest::bool::ANY,
    ) {
        let batches: Vec<Writes> = batches.into_iter().map(writes_of).collect();
        let committed = committed.min(batches.len());
        let mut base: BTreeMap<Key, Value> = base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect();
        let mut expected = base.clone();
        let mut pending = PendingBatches::default();
        for (n, writes) in batches.iter().enumerate() {
            pending.push(n as u64 + 1, Arc::new(writes.clone()));
            apply(&mut expected, writes);
            if n < committed {
                apply(&mut base, writes);
            }
        }
        for _ in 0..committed {
            pending.forget_oldest();
        }
        let mut below = MapRead(base);
        reads_match(&mut pending.over(&mut below), &expected, KeyRange::new(vec![lo], vec![lo.saturating_add(width)]), limit, rev)?;
    }
}

#[derive(Debug, Clone)]
enum Life {
    /// A batch of writes runs (through a layer) and is handed over.
    Run(BTreeMap<u8, Option<u8>>),
    /// The oldest batch in flight reaches the base.
    Commit,
    Scan {
        lo: u8,
        width: u8,
        limit: usize,
    },
}

fn life() -> impl proptest::strategy::Strategy<Value = Life> {
    use proptest::prelude::*;
    prop_oneof![
        proptest::collection::btree_map(0u8..32, proptest::option::weighted(0.3, 0u8..4), 0..6).prop_map(Life::Run),
        Just(Life::Commit),
        (0u8..8, 0u8..40, 1usize..6).prop_map(|(lo, width, limit)| Life::Scan { lo, width, limit }),
    ]
}

proptest::proptest! {
    /// The executor's life: batches handed over one after another, forward
    /// scans between them (as leases read the head of the waiting index,
    /// mostly deleted by the batches in flight), the oldest batch committed
    /// into the base now and then. The batches' floors outlive a scan but
    /// not a commit; every scan and get reads like the base with every
    /// batch applied.
    #[test]
    fn pending_reads_stay_right_across_batches_and_commits(
        base in proptest::collection::btree_map(0u8..32, 0u8..4, 0..32),
        steps in proptest::collection::vec(life(), 0..60),
    ) {
        let apply = |map: &mut BTreeMap<Key, Value>, writes: &Writes| {
            for (k, v) in writes {
                match v { Some(v) => { map.insert(k.clone(), v.clone()); } None => { map.remove(k); } }
            }
        };
        let mut base = MapRead(base.into_iter().map(|(k, v)| (vec![k], vec![v])).collect());
        let mut expected = base.0.clone();
        let mut pending = PendingBatches::default();
        let mut in_flight = std::collections::VecDeque::new();
        let mut number = 0;
        for step in steps {
            match step {
                Life::Run(writes) => {
                    let writes: Writes = writes.into_iter().map(|(k, v)| (vec![k], v.map(|v| vec![v]))).collect();
                    number += 1;
                    pending.push(number, Arc::new(writes.clone()));
                    apply(&mut expected, &writes);
                    in_flight.push_back(writes);
                }
                Life::Commit => {
                    if let Some(writes) = in_flight.pop_front() {
                        apply(&mut base.0, &writes);
                        pending.forget_oldest();
                    }
                }
                Life::Scan { lo, width, limit } => {
                    let range = KeyRange::new(vec![lo], vec![lo.saturating_add(width)]);
                    let got = pending.over(&mut base).scan(&range, limit, false).unwrap();
                    let want = MapRead(expected.clone()).scan(&range, limit, false).unwrap();
                    proptest::prop_assert_eq!(got, want, "scan {:?}", range);
                }
            }
            for k in 0u8..32 {
                let got = pending.over(&mut base).get(&[k]).unwrap();
                proptest::prop_assert_eq!(got, expected.get(&vec![k]).cloned());
            }
        }
    }
}
