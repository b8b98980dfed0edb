use super::*;

#[test]
fn a_metrics_page_is_lranges() {
    let rec = MetricsRecord { data: [5, 4, 3, 2, 1].into(), ..Default::default() };
    let all = vec![5, 4, 3, 2, 1];
    assert_eq!(rec.page(0, -1), all);
    assert_eq!(rec.page(1, 2), [4, 3]);
    assert_eq!(rec.page(-2, -1), [2, 1]);
    assert_eq!(rec.page(3, 1), [0u64; 0]);
    assert_eq!(rec.page(10, 20), [0u64; 0]);
    assert_eq!(rec.page(-100, 0), [5]);
    assert_eq!(rec.page(0, 100), all);
    assert_eq!(rec.page(i64::MIN, i64::MAX), all);
    assert_eq!(rec.page(i64::MAX, -1), [0u64; 0]);
    assert_eq!(rec.page(0, i64::MIN), [0u64; 0]);
    assert_eq!(MetricsRecord::default().page(0, -1), [0u64; 0]);
}

/// A dependency record names its child; one from before names nobody and is taken as anyone's.
#[test]
fn a_dependency_is_its_named_childs_only() {
    let dep = |queue: &str, id: &str| Dependency {
        status: DependencyStatus::Pending,
        child_queue: queue.into(),
        child_id: id.into(),
        value: None,
    };
    assert!(dep("a:b", "c").is_of("a:b", "c"));
    assert!(!dep("a:b", "c").is_of("a", "b:c"));
    assert!(dep("", "").is_of("a", "b:c"));
}

/// An event kept in its page is written as before `body` existed, and
/// records written then read as such.
#[test]
fn inline_events_keep_the_encoding_from_before_bodies() {
    #[derive(Serialize)]
    struct Before<'a>(u64, u64, &'a str, &'a [(&'a str, &'a str)]);
    let fields = [("jobId", "7")];
    let now = EventRef { seq: 3, ts: 9, name: "added", fields: &fields, placement: EventPlacement::Inline };
    let before = encode(&Before(3, 9, "added", &fields));
    assert_eq!(encode(&now), before);
    let read: PagedEvent = decode(&before).unwrap_or_else(|e| panic!("old record: {e}"));
    assert!(!read.body && !read.lent_value);
    assert_eq!(Event::from(read).fields, vec![("jobId".to_string(), "7".to_string())]);
    let stub: PagedEvent = decode(&encode(&EventRef { fields: &[], placement: EventPlacement::Body, ..now }))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(stub.body && !stub.lent_value && stub.fields.is_empty());
    let lent: PagedEvent =
        decode(&encode(&EventRef { placement: EventPlacement::LentValue, ..now })).unwrap_or_else(|e| panic!("{e}"));
    assert!(!lent.body && lent.lent_value && lent.fields.len() == 1);
}

/// An idempotency record written before `hash_version` existed reads as
/// one of version 0, whose add hash covered less of the request.
#[test]
fn idempotency_records_from_before_hash_versions_still_read() {
    #[derive(Serialize)]
    struct Before<'a>(u64, &'a str, u64, Option<u64>, Option<u64>);
    let read: IdempotencyRecord = decode(&encode(&Before(5, "7", 9, None, Some(3)))).unwrap();
    let want = IdempotencyRecord {
        request_hash: 5,
        job_id: "7".into(),
        expires_at: 9,
        finished_on: Some(3),
        ..Default::default()
    };
    assert_eq!((read, want.hash_version), (want.clone(), 0));
}

/// An idempotency record of any call but a keyed bulk add is written as
/// before `bulk` existed, so a build from before it (a rollback) still
/// reads it; records from then read with no bulk answers.
#[test]
fn idempotency_records_keep_the_encoding_from_before_bulk_answers() {
    #[derive(Serialize)]
    struct Before<'a>(u64, &'a str, u64, Option<u64>, Option<u64>, u8, bool);
    let now = IdempotencyRecord {
        request_hash: 5,
        job_id: "7".into(),
        expires_at: 9,
        log_count: Some(2),
        hash_version: 1,
        deduplicated: true,
        ..Default::default()
    };
    let before = encode(&Before(5, "7", 9, Some(2), None, 1, true));
    assert_eq!(encode(&now), before);
    assert_eq!(decode::<IdempotencyRecord>(&before).unwrap(), now);
    let bulk = IdempotencyRecord {
        bulk: vec![Some(BulkAdded { job_id: "1".into(), deduplicated: false }), None],
        ..Default::default()
    };
    assert_eq!(decode::<IdempotencyRecord>(&encode(&bulk)).unwrap(), bulk);
}

/// A dedup record written before `key_removed` existed reads as a key
/// that was not removed.
#[test]
fn dedup_records_from_before_removed_keys_still_read() {
    #[derive(Serialize)]
    struct Before<'a>(&'a str, Option<u64>, Option<Box<EnqueueRequest>>);
    let kept = Box::new(EnqueueRequest { name: "next".into(), ..Default::default() });
    let old = encode(&Before("7", None, Some(kept.clone())));
    let read: DedupRecord = decode(&old).unwrap_or_else(|e| panic!("old record: {e}"));
    assert_eq!(read, DedupRecord::held_by("7", None, Some(kept)));
    assert_eq!(read.holder(), Some("7"));
}

/// Counters written before `epoch_floor` existed (an array one field
/// shorter) still read, with a floor of zero.
#[test]
fn counters_from_before_the_epoch_floor_still_read() {
    #[derive(Serialize)]
    struct Before(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64);
    let old = encode(&Before(7, 8, 1, 2, 3, 4, 5, 6, 9, 10, 11));
    let stats: QueueStats = decode(&old).unwrap_or_else(|e| panic!("old counters: {e}"));
    assert_eq!((stats.last_id, stats.first_event, stats.epoch_floor), (7, 11, 0));
    let now: QueueStats = decode(&encode(&QueueStats { epoch_floor: 5, ..stats })).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(now.epoch_floor, 5);
}

/// Counters written as MessagePack (every store before the fixed form)
/// still read; the fixed form reads back what was written, and one
/// written with fewer counters (an older version's) or more (a later
/// version's) reads the ones it shares.
#[test]
fn counters_read_in_either_form() {
    let stats = QueueStats {
        last_id: 1,
        last_seq: 2,
        waiting: 3,
        prioritized: 4,
        delayed: 5,
        active: 6,
        waiting_children: 7,
        completed: 8,
        failed: 9,
        last_event: 10,
        first_event: 11,
        epoch_floor: 12,
        stalled_total: u64::MAX,
    };
    let read = |bytes: &[u8]| QueueStats::decode(bytes).unwrap_or_else(|e| panic!("{e}")).fields();
    assert_eq!(read(&encode(&stats)), stats.fields(), "MessagePack");
    let fixed = stats.encode();
    assert_eq!(fixed.len(), 1 + 13 * 8);
    assert_eq!(read(&fixed), stats.fields(), "fixed");
    let mut expected = stats.fields();
    expected[12] = 0;
    assert_eq!(read(&fixed[..fixed.len() - 8]), expected, "one counter fewer");
    let mut longer = fixed.clone();
    longer.extend_from_slice(&7u64.to_le_bytes());
    assert_eq!(read(&longer), stats.fields(), "one counter more");
    assert!(QueueStats::decode(&fixed[..fixed.len() - 3]).is_err(), "a torn number is corrupt");
}

/// What an obliterated queue left before its last event was kept (its
/// epoch floor, a number) still reads.
#[test]
fn remains_from_before_the_event_sequence_still_read() {
    let old = QueueRemains::decode(&encode(&7u64)).unwrap_or_else(|e| panic!("old remains: {e}"));
    assert_eq!(old, QueueRemains { epoch_floor: 7, last_event: 0 });
    let now = QueueRemains { epoch_floor: 7, last_event: 9 };
    assert_eq!(QueueRemains::decode(&encode(&now)).unwrap_or_else(|e| panic!("{e}")), now);
}
