//! BullMQ's semantics through the core: flows and their failure policies,
//! deduplication, retention, rate limits, concurrency, events, schedulers,
//! idempotency and bad input.

#![allow(clippy::unwrap_used, reason = "a test: a failed unwrap is a failed check, with its message")]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use loam_jobs::ops::{admin, lease, query, schedule};
use loam_jobs::store::redb::RedbStore;
use loam_jobs::*;

mod support;
use support::{core, job};

fn lease_one(jobs: &Jobs, q: &str) -> Option<Lease> {
    jobs.lease("ns", q, LeaseRequest { max: 1, token: "w".into(), ..Default::default() }).wait().unwrap().leases.pop()
}

/// The names of the next `n` jobs leased from `q`, one at a time.
fn leased_names(jobs: &Jobs, q: &str, n: usize) -> Vec<String> {
    (0..n).map(|_| lease_one(jobs, q).unwrap_or_else(|| panic!("no job left in {q}")).job.name).collect()
}

fn finish(jobs: &Jobs, q: &str, l: &Lease, outcome: Outcome) -> Result<Completed, JobsError> {
    jobs.complete("ns", q, &l.job.id, Fence::Epoch(l.epoch), outcome, CompleteOptions::default()).wait()
}

fn ok(jobs: &Jobs, q: &str, l: &Lease, value: &str) {
    finish(jobs, q, l, Outcome::Ok { result: Some(value.as_bytes().to_vec()) }).unwrap();
}

fn fail(jobs: &Jobs, q: &str, l: &Lease) {
    finish(jobs, q, l, Outcome::Fail { error: JobError::new("boom"), dead_letter: false }).unwrap();
}

fn state(jobs: &Jobs, q: &str, id: &str) -> Option<JobState> {
    jobs.get_job("ns", q, id).unwrap().map(|j| j.state)
}

fn events(jobs: &Jobs, q: &str) -> Vec<(String, Vec<(String, String)>)> {
    jobs.read_events_blocking("ns", q, Some(0), 10_000, Duration::ZERO)
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.fields))
        .collect()
}

/// How many events of `q` keep their fields, or a given-back return value,
/// under a key of their own.
fn event_bodies(jobs: &Jobs, q: &str) -> usize {
    let range = keys::QueueKeys::new(&QueueId::new("ns", q)).event_bodies(0, u64::MAX);
    jobs.read("ns", |tx| tx.scan(&range, 10_000, false)).unwrap().len()
}

fn event_names(jobs: &Jobs, q: &str) -> Vec<String> {
    events(jobs, q).into_iter().map(|(n, _)| n).collect()
}

fn parent(queue: &str, id: &str) -> ParentRef {
    ParentRef { queue: queue.into(), id: id.into(), prefix: "bull".into() }
}

/// A flow node: job `id` (named as its id) in `queue`, under `parent`.
fn flow_node(queue: &str, id: &str, parent: Option<ParentRef>, wait_children: bool) -> FlowNode {
    FlowNode {
        queue: queue.into(),
        request: EnqueueRequest { job_id: Some(id.into()), parent, ..job(id) },
        wait_children,
    }
}

/// A parent in `parents` with two children in `kids`, the children failing by `policy`.
fn family(jobs: &Jobs, policy: OnChildFailure) {
    let nodes = vec![
        FlowNode {
            queue: "parents".into(),
            request: EnqueueRequest { job_id: Some("p".into()), ..job("parent") },
            wait_children: true,
        },
        FlowNode {
            queue: "kids".into(),
            request: EnqueueRequest {
                job_id: Some("a".into()),
                parent: Some(parent("parents", "p")),
                on_child_failure: policy,
                ..job("a")
            },
            wait_children: false,
        },
        FlowNode {
            queue: "kids".into(),
            request: EnqueueRequest {
                job_id: Some("b".into()),
                parent: Some(parent("parents", "p")),
                on_child_failure: policy,
                ..job("b")
            },
            wait_children: false,
        },
    ];
    jobs.flow("ns", nodes).wait().unwrap();
}

#[test]
fn flow_parent_waits_for_children_and_reads_their_results() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::Wait);
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::WaitingChildren));
    assert!(lease_one(&jobs, "parents").is_none());
    let a = lease_one(&jobs, "kids").unwrap();
    ok(&jobs, "kids", &a, "\"ra\"");
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::WaitingChildren));
    let b = lease_one(&jobs, "kids").unwrap();
    ok(&jobs, "kids", &b, "\"rb\"");
    let p = lease_one(&jobs, "parents").unwrap();
    assert_eq!(p.job.id, "p");
    let deps = jobs.query("ns", "parents", |tx, q| query::dependencies(tx, q, "p")).unwrap();
    let values: BTreeMap<String, Option<String>> = deps.into_iter().map(|(k, d)| (k, d.value)).collect();
    assert_eq!(values.get("bull:kids:a"), Some(&Some("\"ra\"".to_string())));
    assert_eq!(values.get("bull:kids:b"), Some(&Some("\"rb\"".to_string())));
}

/// A page of a parent's children of one status counts them all and holds
/// positions `start..=end`; an end of -1 runs to the last and a lower one
/// gives none, as BullMQ's Redis script; their jobs are read beside them.
#[test]
fn a_page_of_a_parents_children_is_taken_from_those_of_its_status() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::Wait);
    let a = lease_one(&jobs, "kids").unwrap();
    ok(&jobs, "kids", &a, "\"ra\"");
    let page = |status, start, end| {
        let (deps, total) =
            jobs.query("ns", "parents", |tx, q| query::dependency_page(tx, q, "p", status, start, end)).unwrap();
        (deps.into_iter().map(|(k, _)| k).collect::<Vec<_>>(), total)
    };
    let (processed, pending) = (Some(DependencyStatus::Processed), Some(DependencyStatus::Pending));
    assert_eq!(page(None, 0, -1), (vec!["bull:kids:a".to_string(), "bull:kids:b".into()], 2));
    assert_eq!(page(None, 1, 1), (vec!["bull:kids:b".to_string()], 2));
    assert_eq!(page(None, 1, -1), (vec!["bull:kids:b".to_string()], 2));
    assert_eq!(page(None, 0, -2), (vec![], 2));
    assert_eq!(page(None, 0, i64::MIN), (vec![], 2));
    assert_eq!(page(None, -3, 0), (vec!["bull:kids:a".to_string()], 2));
    assert_eq!(page(None, 2, 10), (vec![], 2));
    assert_eq!(page(None, 1, 0), (vec![], 2));
    assert_eq!(page(None, i64::MAX, i64::MAX), (vec![], 2));
    assert_eq!(page(processed, 0, 0), (vec!["bull:kids:a".to_string()], 1));
    assert_eq!(page(pending, 0, -1), (vec!["bull:kids:b".to_string()], 1));
    assert_eq!(page(Some(DependencyStatus::Failed), 0, -1), (vec![], 0));

    // A processed child's value stays with its parent once the child is removed.
    jobs.admin("ns", "kids", |tx, q| admin::remove_job(tx, q, "a", false)).wait().unwrap();
    let (deps, children) = jobs
        .query("ns", "parents", |tx, q| {
            let (deps, _) = query::dependency_page(tx, q, "p", None, 0, -1)?;
            let children = query::dependency_jobs(tx, q, &deps).collect::<Result<Vec<_>, _>>()?;
            Ok((deps, children))
        })
        .unwrap();
    assert_eq!(deps[0].1.value.as_deref(), Some("\"ra\""));
    let ids: Vec<Option<String>> = children.into_iter().map(|job| job.map(|j| j.id)).collect();
    assert_eq!(ids, [None, Some("b".to_string())], "a removed child has no job");
}

fn child_counts(jobs: &Jobs, id: &str) -> (u32, u32) {
    let p = jobs.get_job("ns", "parents", id).unwrap().unwrap();
    (p.pending_children, p.failed_children)
}

/// The sizes of job `id`'s record and of its data's own key (0 when absent).
fn stored_sizes(jobs: &Jobs, queue: &str, id: &str) -> (usize, usize) {
    let (queue, id) = (queue.to_string(), id.to_string());
    jobs.write("ns", false, move |tx| {
        let keys = keys::QueueKeys::new(&QueueId::new("ns".to_string(), queue.clone()));
        let size = |v: Option<Vec<u8>>| v.map_or(0, |v| v.len());
        Ok((size(tx.get(&keys.job(&id))?), size(tx.get(&keys.job_data(&id))?)))
    })
    .wait()
    .unwrap()
}

/// Large data lives under a key of its own, so a lease and a completion
/// rewrite a small record; whatever reads the job sees the data as before.
#[test]
fn large_data_is_kept_apart_from_its_record_through_a_jobs_life() {
    let (jobs, _) = core();
    let big = vec![b'x'; DATA_APART_BYTES];
    let data = |jobs: &Jobs| jobs.get_job("ns", "q", "1").unwrap().unwrap().data;
    jobs.enqueue("ns", "q", EnqueueRequest { data: big.clone(), ..job("a") }).wait().unwrap();
    let (record, apart) = stored_sizes(&jobs, "q", "1");
    assert!(record < 1024 && apart == big.len(), "record {record} bytes, data apart {apart}");
    let l = lease_one(&jobs, "q").unwrap();
    assert_eq!(l.job.data, big);
    assert_eq!(data(&jobs), big);
    assert!(stored_sizes(&jobs, "q", "1").0 < 1024);
    let fence = || Fence::Epoch(l.epoch);
    // Made small, the data goes back into the record; made large, out again.
    jobs.report("ns", "q", "1", fence(), Report::Data(b"{}".to_vec()), None).wait().unwrap();
    assert_eq!((data(&jobs), stored_sizes(&jobs, "q", "1").1), (b"{}".to_vec(), 0));
    let bigger = vec![b'y'; 2 * DATA_APART_BYTES];
    jobs.report("ns", "q", "1", fence(), Report::Data(bigger.clone()), None).wait().unwrap();
    assert_eq!((data(&jobs), stored_sizes(&jobs, "q", "1").1), (bigger.clone(), bigger.len()));
    let options = CompleteOptions { remove_on_complete: Some(Retention::RemoveImmediately), ..Default::default() };
    jobs.complete("ns", "q", "1", fence(), Outcome::Ok { result: None }, options).wait().unwrap();
    assert_eq!(stored_sizes(&jobs, "q", "1"), (0, 0));
}

/// A record an older build wrote holds its data, however large: it still
/// reads, leases and completes with it.
#[test]
fn large_data_in_a_record_of_an_older_build_still_reads() {
    let (jobs, _) = core();
    let big = vec![b'x'; 2 * DATA_APART_BYTES];
    jobs.enqueue("ns", "q", EnqueueRequest { data: big.clone(), ..job("a") }).wait().unwrap();
    jobs.write("ns", true, |tx| {
        let q = QueueId::new("ns".to_string(), "q".to_string());
        let keys = keys::QueueKeys::new(&q);
        let mut old = tx.require_job(&q, "1")?;
        old.data_apart = false;
        tx.put(&keys.job("1"), old.encode())?;
        tx.delete(&keys.job_data("1"))
    })
    .wait()
    .unwrap();
    assert_eq!(stored_sizes(&jobs, "q", "1").1, 0);
    let l = lease_one(&jobs, "q").unwrap();
    assert_eq!(l.job.data, big);
    ok(&jobs, "q", &l, "1");
    assert_eq!(jobs.get_job("ns", "q", "1").unwrap().unwrap().data, big);
}

/// A parent that an older build wrote (its children's counts in its record,
/// not in a key of their own) waits for its children as before: the first
/// child to end moves the counts to the key, the last releases it.
#[test]
fn a_parent_counting_children_in_its_record_still_waits_for_them() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::FailParent);
    jobs.write("ns", true, |tx| {
        let q = QueueId::new("ns".to_string(), "parents".to_string());
        let mut p = tx.require_job(&q, "p")?;
        p.children_counted = false;
        tx.save_job(&q, &mut p)?;
        tx.delete(&keys::QueueKeys::new(&q).child_counts("p"))
    })
    .wait()
    .unwrap();
    let old = jobs.get_job("ns", "parents", "p").unwrap().unwrap();
    assert_eq!((old.children_counted, old.pending_children), (false, 2));

    let a = lease_one(&jobs, "kids").unwrap();
    ok(&jobs, "kids", &a, "1");
    let moved = jobs.get_job("ns", "parents", "p").unwrap().unwrap();
    assert_eq!((moved.children_counted, moved.pending_children), (true, 1));
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::WaitingChildren));
    let b = lease_one(&jobs, "kids").unwrap();
    ok(&jobs, "kids", &b, "2");
    assert_eq!(child_counts(&jobs, "p"), (0, 0));
    let p = lease_one(&jobs, "parents").unwrap();
    ok(&jobs, "parents", &p, "3");
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::Completed));
}

/// What a parent reports of its children follows them: each add counts one
/// pending, each end one fewer, a failure under failParentOnFailure one
/// failed; removing the parent takes its counts with it.
#[test]
fn a_parent_reports_its_pending_and_failed_children() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::FailParent);
    assert_eq!(child_counts(&jobs, "p"), (2, 0));
    let a = lease_one(&jobs, "kids").unwrap();
    ok(&jobs, "kids", &a, "1");
    assert_eq!(child_counts(&jobs, "p"), (1, 0));
    let b = lease_one(&jobs, "kids").unwrap();
    fail(&jobs, "kids", &b);
    assert_eq!(child_counts(&jobs, "p"), (0, 1));
    assert!(jobs.admin("ns", "parents", |tx, q| admin::remove_job(tx, q, "p", false)).wait().unwrap());
    let left = jobs.query("ns", "parents", |tx, q| tx.get(&keys::QueueKeys::new(q).child_counts("p"))).unwrap();
    assert_eq!(left, None, "the counts went with the parent");
}

/// A failed child retried is pending for its parent again, and no longer
/// counts as having failed it.
#[test]
fn a_retried_child_is_pending_for_its_parent_again() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::FailParent);
    let a = lease_one(&jobs, "kids").unwrap();
    fail(&jobs, "kids", &a);
    assert_eq!(child_counts(&jobs, "p"), (1, 1));
    jobs.admin("ns", "kids", |tx, q| admin::retry_finished(tx, q, "a", JobState::Failed, false, false)).wait().unwrap();
    assert_eq!(child_counts(&jobs, "p"), (2, 0));
}

/// A child whose dependency its failure removed (removeDependencyOnFailure)
/// is not its parent's when retried: the parent is not held for it again.
#[test]
fn a_retried_child_whose_dependency_was_removed_stays_off_its_parent() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::Remove);
    let a = lease_one(&jobs, "kids").unwrap();
    assert_eq!(a.job.id, "a");
    fail(&jobs, "kids", &a);
    assert_eq!(child_counts(&jobs, "p"), (1, 0));
    jobs.admin("ns", "kids", |tx, q| admin::retry_finished(tx, q, "a", JobState::Failed, false, false)).wait().unwrap();
    assert_eq!(child_counts(&jobs, "p"), (1, 0));
    let b = lease_one(&jobs, "kids").unwrap();
    assert_eq!(b.job.id, "b");
    ok(&jobs, "kids", &b, "1");
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::Waiting));
}

/// Removing a parent's pending children releases it once none is left.
#[test]
fn removing_the_last_pending_child_releases_its_parent() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::Wait);
    let remove = |id: &'static str| jobs.admin("ns", "kids", move |tx, q| admin::remove_job(tx, q, id, false)).wait();
    assert!(remove("a").unwrap());
    assert_eq!(child_counts(&jobs, "p"), (1, 0));
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::WaitingChildren));
    assert!(remove("b").unwrap());
    assert_eq!(child_counts(&jobs, "p"), (0, 0));
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::Waiting));
}

#[test]
fn flow_without_policy_keeps_parent_waiting_after_child_failure() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::Wait);
    let a = lease_one(&jobs, "kids").unwrap();
    fail(&jobs, "kids", &a);
    let b = lease_one(&jobs, "kids").unwrap();
    ok(&jobs, "kids", &b, "1");
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::WaitingChildren));
}

#[test]
fn fail_parent_on_failure_releases_the_parent_to_fail() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::FailParent);
    let a = lease_one(&jobs, "kids").unwrap();
    fail(&jobs, "kids", &a);
    // The parent runs next, marked: its worker fails it with the reason (BullMQ 6.7).
    let p = lease_one(&jobs, "parents").unwrap();
    assert_eq!(p.job.deferred_failure.as_deref(), Some("child bull:kids:a failed"));
    // Child b is still pending, which BullMQ checks first (-4 before -9).
    let refused = finish(&jobs, "parents", &p, Outcome::Ok { result: None });
    assert!(matches!(refused, Err(JobsError::Precondition(Precondition::PendingChildren { .. }))), "{refused:?}");
    finish(
        &jobs,
        "parents",
        &p,
        Outcome::Fail { error: JobError::new("child bull:kids:a failed"), dead_letter: false },
    )
    .unwrap();
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::Failed));
}

#[test]
fn drain_removes_a_same_queue_parent_with_its_last_child() {
    let (jobs, _) = core();
    let nodes = vec![
        FlowNode {
            queue: "q".into(),
            request: EnqueueRequest { job_id: Some("p".into()), ..job("p") },
            wait_children: true,
        },
        FlowNode {
            queue: "q".into(),
            request: EnqueueRequest { parent: Some(parent("q", "p")), ..job("c") },
            wait_children: false,
        },
    ];
    jobs.flow("ns", nodes).wait().unwrap();
    assert_eq!(jobs.admin("ns", "q", |tx, q| admin::drain(tx, q, false)).wait().unwrap(), 1);
    assert_eq!(state(&jobs, "q", "p"), None, "the parent went with its last child");
}

/// Flows P1 <- c1, P2 <- c2, P3 <- c3, added in that order: parents in
/// queue `parents`, children waiting in queue `kids`.
fn three_parents_of_a_child_each() -> Jobs {
    let (jobs, _) = core();
    for i in 1..=3 {
        let nodes = vec![
            flow_node("parents", &format!("P{i}"), None, true),
            flow_node("kids", &format!("c{i}"), Some(parent("parents", &format!("P{i}"))), false),
        ];
        jobs.flow("ns", nodes).wait().unwrap();
    }
    jobs
}

/// Parents in another queue that a drain releases run in the order Redis
/// gives them: it walks its wait list from the job to run last, and puts each
/// released parent in front.
#[test]
fn parents_a_drain_releases_run_in_the_order_of_their_children() {
    let jobs = three_parents_of_a_child_each();
    assert_eq!(jobs.admin("ns", "kids", |tx, q| admin::drain(tx, q, false)).wait().unwrap(), 3);
    assert_eq!(leased_names(&jobs, "parents", 3), ["P1", "P2", "P3"]);
}

#[test]
fn parents_a_clean_of_waiting_jobs_releases_run_in_the_order_of_their_children() {
    // Redis's clean walks its wait list newest first, within the `limit`
    // oldest jobs; each parent released goes to the front of its queue.
    for (limit, cleaned, runs) in [(0, 3, vec!["P1", "P2", "P3"]), (2, 2, vec!["P1", "P2"])] {
        let jobs = three_parents_of_a_child_each();
        let removed =
            jobs.admin("ns", "kids", move |tx, q| admin::clean(tx, q, "wait", u64::MAX, limit)).wait().unwrap();
        let expected: Vec<String> = (1..=cleaned).rev().map(|i| format!("c{i}")).collect();
        assert_eq!(removed, expected, "clean answers newest first, as Redis's list order");
        assert_eq!(leased_names(&jobs, "parents", runs.len()), runs);
    }
}

#[test]
fn continue_parent_on_failure_releases_the_parent_at_once() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::ContinueParent);
    let a = lease_one(&jobs, "kids").unwrap();
    fail(&jobs, "kids", &a);
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::Waiting));
}

#[test]
fn ignore_and_remove_dependency_release_the_parent_when_the_rest_is_done() {
    for policy in [OnChildFailure::Ignore, OnChildFailure::Remove] {
        let (jobs, _) = core();
        family(&jobs, policy);
        let a = lease_one(&jobs, "kids").unwrap();
        fail(&jobs, "kids", &a);
        assert_eq!(state(&jobs, "parents", "p"), Some(JobState::WaitingChildren), "{policy:?}");
        let b = lease_one(&jobs, "kids").unwrap();
        ok(&jobs, "kids", &b, "1");
        assert_eq!(state(&jobs, "parents", "p"), Some(JobState::Waiting), "{policy:?}");
        let deps = jobs.query("ns", "parents", |tx, q| query::dependencies(tx, q, "p")).unwrap();
        let ignored = deps.iter().filter(|(_, d)| d.status == DependencyStatus::Ignored).count();
        assert_eq!(ignored, usize::from(policy == OnChildFailure::Ignore), "{policy:?}");
    }
}

#[test]
fn a_parent_with_pending_children_cannot_complete() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { job_id: Some("p".into()), ..job("p") }).wait().unwrap();
    let p = lease_one(&jobs, "q").unwrap();
    jobs.enqueue("ns", "q", EnqueueRequest { parent: Some(parent("q", "p")), ..job("c") }).wait().unwrap();
    let refused = finish(&jobs, "q", &p, Outcome::Ok { result: None });
    assert!(matches!(refused, Err(JobsError::Precondition(Precondition::PendingChildren { .. }))), "{refused:?}");
    let parked = finish(&jobs, "q", &p, Outcome::WaitChildren { child: None }).unwrap();
    assert!(parked.moved);
    assert_eq!(state(&jobs, "q", "p"), Some(JobState::WaitingChildren));
}

#[test]
fn a_child_of_a_missing_parent_is_refused() {
    let (jobs, _) = core();
    let e = jobs.enqueue("ns", "q", EnqueueRequest { parent: Some(parent("q", "nope")), ..job("c") }).wait();
    assert!(matches!(e, Err(JobsError::NotFound(Missing::ParentJob(_)))), "{e:?}");
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting]).unwrap(), vec![0]);
}

#[test]
fn a_tree_counts_each_parents_children_new_nested_and_adopted() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { job_id: Some("x".into()), ..job("x") }).wait().unwrap();
    let child =
        |id: &str, of: &str| EnqueueRequest { job_id: Some(id.into()), parent: Some(parent("q", of)), ..job(id) };
    let node = |request: EnqueueRequest, wait_children: bool| FlowNode { queue: "q".into(), request, wait_children };
    let nodes = vec![
        node(EnqueueRequest { job_id: Some("p".into()), ..job("p") }, true),
        node(child("a", "p"), false),
        node(child("m", "p"), true),
        node(child("g1", "m"), false),
        node(child("x", "p"), false),
        node(child("g2", "m"), false),
        node(child("b", "p"), false),
    ];
    jobs.flow("ns", nodes).wait().unwrap();
    let pending = |id: &str| jobs.get_job("ns", "q", id).unwrap().map(|j| j.pending_children);
    // a, m, x (an existing job adopted) and b; g1 and g2.
    assert_eq!(pending("p"), Some(4));
    assert_eq!(pending("m"), Some(2));
    // The parents are released only as their last children finish.
    let mut finished = Vec::new();
    while let Some(l) = lease_one(&jobs, "q") {
        finished.push(l.job.id.clone());
        ok(&jobs, "q", &l, "1");
    }
    let at = |id: &str| finished.iter().position(|f| f == id).unwrap();
    assert_eq!(finished.len(), 7, "{finished:?}");
    assert!(at("m") > at("g1").max(at("g2")), "{finished:?}");
    assert_eq!(at("p"), 6, "{finished:?}");
    assert_eq!(pending("p"), Some(0));
}

#[test]
fn a_flow_is_all_or_nothing() {
    let (jobs, _) = core();
    let nodes = vec![
        FlowNode {
            queue: "q".into(),
            request: EnqueueRequest { job_id: Some("p".into()), ..job("p") },
            wait_children: true,
        },
        FlowNode {
            queue: "q".into(),
            request: EnqueueRequest { priority: 99_999_999, parent: Some(parent("q", "p")), ..job("bad") },
            wait_children: false,
        },
    ];
    assert!(matches!(jobs.flow("ns", nodes).wait(), Err(JobsError::InvalidArgument(_))));
    assert_eq!(state(&jobs, "q", "p"), None);
}

/// A parent released by its last child runs next when it has no priority
/// (Redis RPUSHes it), and behind the jobs of its priority when it has one
/// (Redis adds it to its band with a new counter).
#[test]
fn a_released_parent_runs_next_or_behind_its_priority() {
    for priority in [0, 1] {
        let (jobs, _) = core();
        let add = |name: &str| jobs.enqueue("ns", "a", EnqueueRequest { priority, ..job(name) }).wait().unwrap();
        add("early");
        let parent_node = FlowNode {
            queue: "a".into(),
            request: EnqueueRequest { job_id: Some("P".into()), priority, ..job("P") },
            wait_children: true,
        };
        jobs.flow("ns", vec![parent_node, flow_node("kids", "c", Some(parent("a", "P")), false)]).wait().unwrap();
        add("late");
        let c = lease_one(&jobs, "kids").unwrap();
        ok(&jobs, "kids", &c, "1");
        let expected = if priority == 0 { ["P", "early", "late"] } else { ["early", "late", "P"] };
        assert_eq!(leased_names(&jobs, "a", 3), expected, "priority {priority}");
    }
}

/// Queue `a:b` id `c` and queue `a` id `b:c` share a node key (`bull:a:b:c`):
/// the second child is refused, with its flow, rather than left uncounted,
/// which let the parent run before it ended.
#[test]
fn a_child_whose_key_is_another_childs_is_refused() {
    let (jobs, _) = core();
    let tree = |second: FlowNode| {
        vec![flow_node("parents", "p", None, true), flow_node("a:b", "c", Some(parent("parents", "p")), false), second]
    };
    let e = jobs.flow("ns", tree(flow_node("a", "b:c", Some(parent("parents", "p")), false))).wait();
    match e {
        Err(JobsError::InvalidArgument(m)) => assert!(m.contains("already that of its child c of queue a:b"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(state(&jobs, "parents", "p"), None);
    // The same tree without the clash goes in; adding its child again changes nothing.
    jobs.flow("ns", tree(flow_node("a", "d", Some(parent("parents", "p")), false))).wait().unwrap();
    let again = EnqueueRequest { job_id: Some("c".into()), parent: Some(parent("parents", "p")), ..job("c") };
    jobs.enqueue("ns", "a:b", again).wait().unwrap();
    assert_eq!(child_counts(&jobs, "p"), (2, 0));
    let clash = EnqueueRequest { job_id: Some("b:c".into()), parent: Some(parent("parents", "p")), ..job("b:c") };
    assert!(matches!(jobs.enqueue("ns", "a", clash).wait(), Err(JobsError::InvalidArgument(_))));
    assert_eq!(state(&jobs, "a", "b:c"), None);
}

fn dedup(id: &str, ttl: Option<u64>) -> Dedup {
    Dedup { id: id.into(), ttl_ms: ttl, ..Default::default() }
}

/// BullMQ's `keepLastIfActive` dedup of id "d".
fn keep_last(ttl: Option<u64>) -> Dedup {
    Dedup { keep_last_if_active: true, ..dedup("d", ttl) }
}

/// Adds a job under `d` and leases it: the job holding the dedup id, active.
fn active_holder(jobs: &Jobs, d: &Dedup) -> Lease {
    jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(d.clone()), ..job("a") }).wait().unwrap();
    lease_one(jobs, "q").unwrap()
}

#[test]
fn simple_dedup_holds_until_the_job_finishes() {
    let (jobs, _) = core();
    let first = jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(dedup("d", None)), ..job("a") }).wait().unwrap();
    let second = jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(dedup("d", None)), ..job("a") }).wait().unwrap();
    assert!(!second.created);
    assert_eq!(second.id, first.id);
    assert!(event_names(&jobs, "q").contains(&"deduplicated".to_string()));
    let l = lease_one(&jobs, "q").unwrap();
    ok(&jobs, "q", &l, "1");
    let third = jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(dedup("d", None)), ..job("a") }).wait().unwrap();
    assert!(third.created);
}

#[test]
fn throttle_holds_for_its_ttl() {
    let (jobs, clock) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(dedup("d", Some(1000))), ..job("a") }).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    ok(&jobs, "q", &l, "1");
    let again =
        jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(dedup("d", Some(1000))), ..job("a") }).wait().unwrap();
    assert!(!again.created, "a throttle key outlives the job");
    clock.advance(1001);
    let later =
        jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(dedup("d", Some(1000))), ..job("a") }).wait().unwrap();
    assert!(later.created);
}

#[test]
fn debounce_replace_swaps_the_delayed_job() {
    let (jobs, _) = core();
    let d = Dedup { replace: true, extend: true, ..dedup("d", Some(5000)) };
    let first = jobs
        .enqueue("ns", "q", EnqueueRequest { dedup: Some(d.clone()), delay_ms: 1000, data: b"1".to_vec(), ..job("a") })
        .wait()
        .unwrap();
    let second = jobs
        .enqueue("ns", "q", EnqueueRequest { dedup: Some(d), delay_ms: 1000, data: b"2".to_vec(), ..job("a") })
        .wait()
        .unwrap();
    assert!(second.created);
    assert_eq!(state(&jobs, "q", &first.id), None);
    assert_eq!(jobs.get_job("ns", "q", &second.id).unwrap().unwrap().data, b"2");
    let id = jobs.query("ns", "q", |tx, q| query::dedup_job_id(tx, q, "d")).unwrap();
    assert_eq!(id, Some(second.id));
}

#[test]
fn keep_last_if_active_enqueues_the_newest_add_after_the_active_job() {
    let (jobs, _) = core();
    let d = keep_last(None);
    let l = active_holder(&jobs, &d);
    for data in [b"2", b"3"] {
        let e = jobs
            .enqueue("ns", "q", EnqueueRequest { dedup: Some(d.clone()), data: data.to_vec(), ..job("a") })
            .wait()
            .unwrap();
        assert!(!e.created);
    }
    ok(&jobs, "q", &l, "1");
    let next = lease_one(&jobs, "q").unwrap();
    assert_eq!(next.job.data, b"3");
    assert!(lease_one(&jobs, "q").is_none());
}

#[test]
fn removing_a_dedup_key_leaves_the_add_keep_last_if_active_kept() {
    let (jobs, _) = core();
    let d = keep_last(None);
    let add = |data: &[u8]| {
        jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(d.clone()), data: data.to_vec(), ..job("a") })
            .wait()
            .unwrap()
    };
    let owner = || jobs.query("ns", "q", |tx, q| query::dedup_job_id(tx, q, "d")).unwrap();
    let remove = || jobs.admin("ns", "q", |tx, q| admin::remove_dedup_key(tx, q, "d", None)).wait().unwrap();
    let holder = add(b"1");
    let l = lease_one(&jobs, "q").unwrap();
    let kept = add(b"2");
    assert_eq!((kept.created, kept.id.as_str()), (false, holder.id.as_str()));
    assert_eq!(remove(), 1);
    assert_eq!(owner(), None, "the key is gone");
    assert_eq!(remove(), 0, "and cannot be removed twice");
    // With the key gone the next add takes it; the kept add waits on.
    let after = add(b"3");
    assert!(after.created);
    assert_eq!(owner(), Some(after.id.clone()));
    ok(&jobs, "q", &l, "1");
    // The first job's end makes the kept add, which takes the key (Redis's
    // requeueDeduplicatedJob sets it to the new job).
    let mut made: Vec<_> = std::iter::from_fn(|| lease_one(&jobs, "q")).map(|l| (l.job.data, l.job.id)).collect();
    made.sort();
    assert_eq!(made.iter().map(|(data, _)| data.clone()).collect::<Vec<_>>(), [b"2".to_vec(), b"3".to_vec()]);
    assert_eq!(owner(), Some(made[0].1.clone()));
}

#[test]
fn a_kept_add_outlives_the_keys_that_expire_while_it_waits() {
    let (jobs, clock) = core();
    let add =
        |name: &str, d: Dedup| jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(d), ..job(name) }).wait().unwrap();
    let keep_last = keep_last(Some(1000));
    add("A", keep_last.clone());
    let l = lease_one(&jobs, "q").unwrap();
    assert!(!add("X", keep_last).created);
    jobs.admin("ns", "q", |tx, q| admin::remove_dedup_key(tx, q, "d", None)).wait().unwrap();
    // A throttle takes the key, and another once that one's ttl ran out:
    // the add kept for later waits on through both (Redis's `dn:<id>` has
    // no ttl of its own).
    assert!(add("B", dedup("d", Some(1000))).created);
    clock.advance(1300);
    assert!(add("E", dedup("d", Some(1000))).created);
    ok(&jobs, "q", &l, "1");
    let mut made = leased_names(&jobs, "q", 3);
    made.sort();
    assert_eq!(made, ["B", "E", "X"]);
}

#[test]
fn a_keep_last_if_active_key_lasts_until_its_job_finishes_whatever_its_ttl() {
    let (jobs, clock) = core();
    let d = keep_last(Some(100));
    let add = || jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(d.clone()), ..job("a") }).wait().unwrap();
    let first = add();
    clock.advance(500);
    let waiting = add();
    assert_eq!((waiting.created, waiting.id), (false, first.id.clone()), "its job has not run yet");
    let l = lease_one(&jobs, "q").unwrap();
    ok(&jobs, "q", &l, "1");
    assert!(add().created, "its job finished, well within the ttl of the add after it");
}

#[test]
fn a_kept_add_is_stamped_and_delayed_from_when_it_is_made() {
    let (jobs, clock) = core();
    let d = keep_last(None);
    let l = active_holder(&jobs, &d);
    let added_at = clock.now_ms();
    // BullMQ stamps each add itself.
    let kept = EnqueueRequest { dedup: Some(d), delay_ms: 1000, timestamp: Some(added_at), ..job("b") };
    jobs.enqueue("ns", "q", kept).wait().unwrap();
    clock.advance(1500);
    ok(&jobs, "q", &l, "1");
    let made = jobs.get_job("ns", "q", &(l.job.id.parse::<u64>().unwrap() + 1).to_string()).unwrap().unwrap();
    assert_eq!((made.name.as_str(), made.timestamp, made.due), ("b", added_at + 1500, added_at + 2500));
    clock.advance(700);
    assert!(lease_one(&jobs, "q").is_none(), "its delay runs from when it was made");
    clock.advance(300);
    assert_eq!(lease_one(&jobs, "q").map(|l| l.job.name), Some("b".into()));
}

#[test]
fn a_rescheduling_add_counts_its_delay_from_its_own_timestamp() {
    let (jobs, clock) = core();
    let now = clock.now_ms();
    let d = Dedup { reschedule: true, ..dedup("d", None) };
    let held = jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(d.clone()), delay_ms: 60_000, ..job("a") });
    let held = held.wait().unwrap();
    let incoming = EnqueueRequest { dedup: Some(d), delay_ms: 30_000, timestamp: Some(now - 25_000), ..job("a") };
    let absorbed = jobs.enqueue("ns", "q", incoming).wait().unwrap();
    assert_eq!(absorbed.id, held.id);
    assert_eq!(jobs.get_job("ns", "q", &held.id).unwrap().unwrap().due, now + 5_000);
}

#[test]
fn retention_keeps_the_newest_finished_jobs() {
    let (jobs, clock) = core();
    for i in 0..5 {
        let keep = Retention::Keep(Keep { count: Some(2), ..Default::default() });
        jobs.enqueue("ns", "q", EnqueueRequest { remove_on_complete: Some(keep), ..job(&format!("j{i}")) })
            .wait()
            .unwrap();
        let l = lease_one(&jobs, "q").unwrap();
        clock.advance(10);
        ok(&jobs, "q", &l, "1");
    }
    let done = jobs.query("ns", "q", |tx, q| query::range(tx, q, JobState::Completed, 0, -1, true)).unwrap();
    assert_eq!(done, ["4", "5"]);
    jobs.enqueue("ns", "q", EnqueueRequest { remove_on_complete: Some(Retention::RemoveImmediately), ..job("gone") })
        .wait()
        .unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    ok(&jobs, "q", &l, "1");
    assert_eq!(state(&jobs, "q", &l.job.id), None);
    assert_eq!(jobs.counts("ns", "q", &[JobState::Completed]).unwrap(), vec![2]);
}

#[test]
fn retries_back_off_then_exhaust() {
    let (jobs, clock) = core();
    let backoff = Backoff::Exponential { delay_ms: 100, jitter: 0.0, max_ms: None };
    jobs.enqueue("ns", "q", EnqueueRequest { attempts: 3, backoff: Some(backoff), ..job("a") }).wait().unwrap();
    for expected_delay in [100, 200] {
        let l = lease_one(&jobs, "q").unwrap();
        finish(&jobs, "q", &l, Outcome::Retry { error: Some(JobError::new("again")), after_ms: None }).unwrap();
        assert_eq!(state(&jobs, "q", "1"), Some(JobState::Delayed));
        clock.advance(expected_delay - 1);
        assert!(lease_one(&jobs, "q").is_none(), "not due yet");
        clock.advance(1);
    }
    let l = lease_one(&jobs, "q").unwrap();
    finish(&jobs, "q", &l, Outcome::Retry { error: Some(JobError::new("last")), after_ms: None }).unwrap();
    let j = jobs.get_job("ns", "q", "1").unwrap().unwrap();
    assert_eq!((j.state, j.attempts_made), (JobState::Failed, 3));
    assert!(event_names(&jobs, "q").contains(&"retries-exhausted".to_string()));
}

#[test]
fn rate_limit_and_global_concurrency_bound_leases() {
    let (jobs, clock) = core();
    for i in 0..5 {
        jobs.enqueue("ns", "q", job(&format!("j{i}"))).wait().unwrap();
    }
    let limiter = Some(RateLimit { max: 2, duration_ms: 1000 });
    let req = LeaseRequest { max: 5, limiter, ..Default::default() };
    let got = jobs.lease("ns", "q", req.clone()).wait().unwrap();
    assert_eq!(got.leases.len(), 2);
    let again = jobs.lease("ns", "q", req.clone()).wait().unwrap();
    assert!(again.leases.is_empty());
    assert!(again.info.rate_limit_ms > 0 && again.info.rate_limit_ms <= 1000);
    clock.advance(1000);
    jobs.set_meta("ns", "q", BTreeMap::from([("concurrency".to_string(), "3".to_string())])).wait().unwrap();
    let third = jobs.lease("ns", "q", LeaseRequest { max: 5, ..Default::default() }).wait().unwrap();
    assert_eq!(third.leases.len(), 1, "2 active + 1 = the global concurrency of 3");
    assert!(jobs.lease("ns", "q", LeaseRequest { max: 5, ..Default::default() }).wait().unwrap().info.maxed);
}

/// As on Redis: a global concurrency of 0 holds every job (the queue reads
/// as maxed), until it is raised or removed.
#[test]
fn a_global_concurrency_of_zero_holds_every_job() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    jobs.set_meta("ns", "q", BTreeMap::from([("concurrency".to_string(), "0".to_string())])).wait().unwrap();
    let held = jobs.lease("ns", "q", LeaseRequest::default()).wait().unwrap();
    assert!(held.leases.is_empty() && held.info.maxed);
    assert!(jobs.query("ns", "q", query::is_maxed).unwrap());
    jobs.set_meta("ns", "q", BTreeMap::from([("concurrency".to_string(), "1".to_string())])).wait().unwrap();
    assert_eq!(jobs.lease("ns", "q", LeaseRequest::default()).wait().unwrap().leases.len(), 1);
}

/// As Redis's moveToActive reads them: the global max, else the worker's;
/// the worker's window length, else the global one.
#[test]
fn a_global_rate_limit_beside_a_workers_limiter_takes_its_max_and_the_workers_window() {
    let (jobs, clock) = core();
    for i in 0..8 {
        jobs.enqueue("ns", "q", job(&format!("j{i}"))).wait().unwrap();
    }
    let global = BTreeMap::from([("max".to_string(), "3".to_string()), ("duration".to_string(), "400".to_string())]);
    jobs.set_meta("ns", "q", global).wait().unwrap();
    let worker = LeaseRequest { max: 8, limiter: Some(RateLimit { max: 1, duration_ms: 1000 }), ..Default::default() };
    assert_eq!(jobs.lease("ns", "q", worker.clone()).wait().unwrap().leases.len(), 3, "the global max");
    clock.advance(400);
    let held = jobs.lease("ns", "q", worker.clone()).wait().unwrap();
    assert_eq!((held.leases.len(), held.info.rate_limit_ms), (0, 600), "the worker's window of 1,000 ms");
    clock.advance(600);
    assert_eq!(jobs.lease("ns", "q", worker).wait().unwrap().leases.len(), 3);
    // Without a limiter of its own, a worker gets the global window.
    let plain = LeaseRequest { max: 8, ..Default::default() };
    assert!(jobs.lease("ns", "q", plain.clone()).wait().unwrap().leases.is_empty());
    clock.advance(1000);
    assert_eq!(jobs.lease("ns", "q", plain.clone()).wait().unwrap().leases.len(), 2, "the 2 jobs left");
}

/// BullMQ's getRateLimitTtl of a manual rate limit: what is left of it, the
/// longest an i64 holds for one set "for ever", and -2 with none.
#[test]
fn a_manual_rate_limit_reads_back_its_time_left_never_a_negative_one() {
    let (jobs, _) = core();
    let ttl = |jobs: &Jobs| jobs.query("ns", "q", |tx, q| query::rate_limit_ttl_or_missing(tx, q, None)).unwrap();
    assert_eq!(ttl(&jobs), -2);
    jobs.admin("ns", "q", |tx, q| admin::set_rate_limit(tx, q, 5_000)).wait().unwrap();
    assert_eq!(ttl(&jobs), 5_000);
    jobs.admin("ns", "q", |tx, q| admin::set_rate_limit(tx, q, u64::MAX)).wait().unwrap();
    assert_eq!(ttl(&jobs), i64::MAX);
}

#[test]
fn paused_queue_gives_nothing_and_keeps_jobs_waiting() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    jobs.admin("ns", "q", |tx, q| admin::set_paused(tx, q, true)).wait().unwrap();
    let got = jobs.lease("ns", "q", LeaseRequest::default()).wait().unwrap();
    assert!(got.leases.is_empty() && got.info.paused);
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting]).unwrap(), vec![1]);
    jobs.admin("ns", "q", |tx, q| admin::set_paused(tx, q, false)).wait().unwrap();
    assert!(lease_one(&jobs, "q").is_some());
}

#[test]
fn events_have_bullmq_names_fields_and_a_resumable_cursor() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    ok(&jobs, "q", &l, "42");
    let all = events(&jobs, "q");
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["added", "waiting", "active", "completed", "drained"]);
    assert_eq!(
        all[3].1,
        vec![("jobId".into(), "1".into()), ("returnvalue".into(), "42".into()), ("prev".into(), "active".into())]
    );
    let after_two = jobs.read_events_blocking("ns", "q", Some(2), 100, Duration::ZERO).unwrap();
    assert_eq!(after_two.first().map(|e| e.name.as_str()), Some("active"));
}

/// A client other than BullMQ may complete with any bytes: the job keeps them
/// as they are, and only the event's text (which must be text) is mended.
#[test]
fn a_result_that_is_not_utf8_is_kept_whole_and_mended_in_its_event() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    let result = vec![b'"', 0xff, b'x', b'"'];
    finish(&jobs, "q", &l, Outcome::Ok { result: Some(result.clone()) }).unwrap();
    assert_eq!(jobs.get_job("ns", "q", "1").unwrap().unwrap().return_value, Some(result));
    let completed = events(&jobs, "q").into_iter().find(|(name, _)| name == "completed").unwrap();
    assert_eq!(completed.1[1], ("returnvalue".into(), "\"\u{fffd}x\"".into()));
}

#[test]
fn a_lastevent_id_is_read_as_xread_reads_a_stream_id() {
    let (jobs, clock) = core();
    for name in ["a", "b", "c"] {
        jobs.enqueue("ns", "q", job(name)).wait().unwrap();
        clock.advance(10);
    }
    // added and waiting for each: sequences 1 to 6, two to a millisecond.
    let all = jobs.read_events_blocking("ns", "q", Some(0), 100, Duration::ZERO).unwrap();
    assert_eq!(
        all.iter().map(|e| (e.seq, e.ts)).collect::<Vec<_>>()[..3],
        [(1, 1_000_000), (2, 1_000_000), (3, 1_000_010)]
    );
    let resolve = |id: &str| jobs.query("ns", "q", |tx, q| query::event_cursor(tx, q, id));
    let cursor = |id: &str| resolve(id).map(|c| c.after);
    // From now on; a QueueEvents' own start (`0-<seq>`) and `0-0` by sequence.
    assert_eq!(cursor("$").unwrap(), 6);
    assert_eq!(cursor("0-0").unwrap(), 0);
    assert_eq!(cursor("0-4").unwrap(), 4);
    // An id this queue issued resumes right after its event.
    assert_eq!(cursor(&all[2].id()).unwrap(), 3);
    // Foreign ids by time, as (ms, seq) compare: before every event, between
    // two milliseconds, within one, and later than every event.
    assert_eq!(cursor("1").unwrap(), 0);
    assert_eq!(cursor("1000005-0").unwrap(), 2);
    assert_eq!(cursor("1000010").unwrap(), 2);
    assert_eq!(cursor("1000010-99").unwrap(), 4);
    assert_eq!(cursor("9999999999999-0").unwrap(), 6);
    // A foreign id that names a sequence of ours at another time is placed by its time.
    assert_eq!(cursor("1000020-2").unwrap(), 4);
    for bad in ["garbage", "", "-1", "1-", "1-x", "1-2-3", "+5"] {
        assert!(matches!(cursor(bad), Err(JobsError::InvalidArgument(_))), "{bad:?} was read");
    }
    // A foreign id ahead of every event reads the events written later only
    // once their id is greater; ids of ours and `0-<seq>` read every later event.
    let ahead = resolve("1000040-0").unwrap();
    let own = resolve(&all[5].id()).unwrap();
    jobs.enqueue("ns", "q", job("d")).wait().unwrap();
    clock.set(1_000_041);
    jobs.enqueue("ns", "q", job("e")).wait().unwrap();
    let later = jobs.read_events_blocking("ns", "q", Some(ahead.after), 100, Duration::ZERO).unwrap();
    let seqs = |events: Vec<Event>| events.iter().map(|e| e.seq).collect::<Vec<_>>();
    assert_eq!(seqs(ahead.keep(later.clone())), [9, 10]);
    assert_eq!(seqs(own.keep(later)), [7, 8, 9, 10]);
}

#[test]
fn event_log_is_trimmed_to_its_length() {
    let (jobs, _) = core();
    jobs.set_meta("ns", "q", BTreeMap::from([("opts.maxLenEvents".to_string(), "5".to_string())])).wait().unwrap();
    for i in 0..10 {
        jobs.enqueue("ns", "q", job(&format!("j{i}"))).wait().unwrap();
    }
    let kept = jobs.read_events_blocking("ns", "q", Some(0), 100, Duration::ZERO).unwrap();
    assert_eq!(kept.len(), 5);
    assert_eq!(kept.last().map(|e| e.seq), Some(20));
}

/// A length that is not a whole number (BullMQ's `streams.events.maxLen` of
/// -1, 1.5) leaves the default, as an unset one does: read as 0, it trimmed
/// every event as it was written, and no QueueEvents saw any.
#[test]
fn an_event_log_length_that_is_not_a_whole_number_keeps_the_default() {
    for length in ["-1", "1.5", "NaN", "inf"] {
        let (jobs, _) = core();
        jobs.set_meta("ns", "q", BTreeMap::from([("opts.maxLenEvents".to_string(), length.to_string())]))
            .wait()
            .unwrap();
        jobs.enqueue("ns", "q", job("a")).wait().unwrap();
        let kept = jobs.read_events_blocking("ns", "q", Some(0), 100, Duration::ZERO).unwrap();
        assert_eq!(kept.len(), 2, "{length}: added and waiting");
    }
}

#[test]
fn event_pages_read_in_order_across_trims_and_limits() {
    let (jobs, _) = core();
    jobs.set_meta("ns", "q", BTreeMap::from([("opts.maxLenEvents".to_string(), "150".to_string())])).wait().unwrap();
    // 2 events per add (added, waiting): 600 events over many pages.
    for i in 0..300 {
        jobs.enqueue("ns", "q", job(&format!("j{i}"))).wait().unwrap();
    }
    let all = jobs.read_events_blocking("ns", "q", Some(0), 10_000, Duration::ZERO).unwrap();
    let seqs: Vec<u64> = all.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (451..=600).collect::<Vec<_>>(), "the newest 150, in order, none trimmed");
    // Paging through with small limits from a cursor gives the same events.
    let mut cursor = 0;
    let mut paged = Vec::new();
    loop {
        let page = jobs.read_events_blocking("ns", "q", Some(cursor), 7, Duration::ZERO).unwrap();
        let Some(last) = page.last() else { break };
        assert!(page.len() <= 7);
        cursor = last.seq;
        paged.extend(page.into_iter().map(|e| e.seq));
    }
    assert_eq!(paged, seqs);
    assert_eq!(jobs.read_events_blocking("ns", "q", Some(590), 100, Duration::ZERO).unwrap().len(), 10);
}

#[test]
fn one_operation_writing_many_events_keeps_them_in_order_and_trimmed() {
    // An operation appends to an event page in memory and writes it back once;
    // here one addBulk writes 600 events across ten pages and trims as it goes.
    let (jobs, _) = core();
    jobs.set_meta("ns", "q", BTreeMap::from([("opts.maxLenEvents".to_string(), "150".to_string())])).wait().unwrap();
    let bulk = (0..300).map(|i| job(&format!("j{i}"))).collect();
    assert!(jobs.enqueue_bulk("ns", "q", bulk, None).wait().unwrap().iter().all(Result::is_ok));
    let seqs: Vec<u64> =
        jobs.read_events_blocking("ns", "q", Some(0), 10_000, Duration::ZERO).unwrap().iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (451..=600).collect::<Vec<_>>());
    // The next operation appends to the page the bulk left open.
    jobs.enqueue("ns", "q", job("after")).wait().unwrap();
    let tail = jobs.read_events_blocking("ns", "q", Some(598), 100, Duration::ZERO).unwrap();
    assert_eq!(tail.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![599, 600, 601, 602]);
    assert_eq!(tail[2].name, "added");

    // A log of length 1 keeps only the newest event, even within one operation.
    jobs.set_meta("ns", "r", BTreeMap::from([("opts.maxLenEvents".to_string(), "1".to_string())])).wait().unwrap();
    let bulk = (0..100).map(|i| job(&format!("k{i}"))).collect();
    jobs.enqueue_bulk("ns", "r", bulk, None).wait().unwrap();
    let kept = jobs.read_events_blocking("ns", "r", Some(0), 100, Duration::ZERO).unwrap();
    assert_eq!(kept.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![200]);
}

/// A lease with a byte bound stops taking jobs once their data would pass it,
/// but always takes one: a server bounds its answer so.
#[test]
fn a_lease_stops_at_its_byte_bound_and_takes_one_job_at_least() {
    let (jobs, _) = core();
    for i in 0..5 {
        let data = format!("\"{}\"", "x".repeat(98)).into_bytes();
        jobs.enqueue("ns", "q", EnqueueRequest { name: format!("j{i}"), data, ..job("x") }).wait().unwrap();
    }
    let req = |max_bytes| LeaseRequest { max: 10, max_bytes: Some(max_bytes), ..Default::default() };
    let names = |leased: Leased| leased.leases.into_iter().map(|l| l.job.name).collect::<Vec<_>>();
    assert_eq!(names(jobs.lease("ns", "q", req(250)).wait().unwrap()), ["j0", "j1"]);
    assert_eq!(names(jobs.lease("ns", "q", req(10)).wait().unwrap()), ["j2"], "one job at least");
    let unbounded = LeaseRequest { max: 10, ..Default::default() };
    assert_eq!(names(jobs.lease("ns", "q", unbounded).wait().unwrap()), ["j3", "j4"]);
}

/// An event whose fields are large keeps them under a key of its own, not
/// in its page (which every append writes whole): it reads back whole and in
/// order among small ones, across pages and limits, and its fields go with
/// its page when the log is trimmed.
#[test]
fn large_events_read_back_whole_and_go_with_their_page() {
    let (jobs, _) = core();
    jobs.set_meta("ns", "q", BTreeMap::from([("opts.maxLenEvents".to_string(), "100".to_string())])).wait().unwrap();
    let publish = |i: usize| {
        // Every third event is large.
        let value = if i.is_multiple_of(3) { format!("{i}:{}", "x".repeat(10_000)) } else { i.to_string() };
        let fields = vec![("value".to_string(), value)];
        jobs.admin("ns", "q", move |tx, q| admin::publish_event(tx, q, "mine", &fields, 100)).wait().unwrap();
    };
    for i in 0..300 {
        publish(i);
    }
    let kept = jobs.read_events_blocking("ns", "q", Some(0), 10_000, Duration::ZERO).unwrap();
    assert_eq!(kept.iter().map(|e| e.seq).collect::<Vec<_>>(), (201..=300).collect::<Vec<_>>());
    for e in &kept {
        let i = e.seq as usize - 1;
        let value = &e.fields[0].1;
        assert!(value == &i.to_string() || value.starts_with(&format!("{i}:")) && value.len() > 10_000, "{}", e.seq);
    }
    // Paged through by small limits, the same events.
    let (mut cursor, mut paged) = (200, Vec::new());
    while let Some(last) = jobs.read_events_blocking("ns", "q", Some(cursor), 7, Duration::ZERO).unwrap().last() {
        paged.push(last.seq);
        cursor = last.seq;
    }
    assert_eq!(paged.last(), Some(&300));
    // The trimmed pages (events 1 to 191, three pages) took their bodies with
    // them: what is left are those of the pages still read (192 to 300).
    let left = event_bodies(&jobs, "q");
    assert_eq!(left, (192..=300).filter(|s: &usize| (s - 1).is_multiple_of(3)).count(), "bodies of trimmed pages kept");
    // Obliterate takes the rest.
    jobs.admin("ns", "q", |tx, q| admin::set_paused(tx, q, true)).wait().unwrap();
    jobs.admin("ns", "q", |tx, q| admin::obliterate(tx, q, true, u64::MAX)).wait().unwrap();
    assert_eq!(event_bodies(&jobs, "q"), 0);
}

/// A large return value of a job that is kept is written once, in the job's
/// record, and its `completed` event reads it from there; a record that goes
/// or forgets its value (removed, retried, dropped by retention, its queue
/// obliterated) gives it to the event first, which reads the same after.
#[test]
fn a_large_return_value_is_written_once_and_its_event_reads_it_whatever_the_job_becomes() {
    let (jobs, _) = core();
    let value = |tag: &str| format!("\"{tag}{}\"", "x".repeat(10_000));
    let run = |id: &str, result: &[u8], retention: Option<Retention>| {
        let req = EnqueueRequest { job_id: Some(id.into()), remove_on_complete: retention, ..job(id) };
        jobs.enqueue("ns", "q", req).wait().unwrap();
        let l = lease_one(&jobs, "q").unwrap();
        finish(&jobs, "q", &l, Outcome::Ok { result: Some(result.to_vec()) }).unwrap();
    };
    // Each `completed` event's job id and return value.
    let completed = |jobs: &Jobs| -> Vec<(String, String)> {
        let all = events(jobs, "q").into_iter().filter(|(name, _)| name == "completed");
        all.map(|(_, mut fields)| (std::mem::take(&mut fields[0].1), std::mem::take(&mut fields[1].1))).collect()
    };
    for id in ["kept", "removed", "retried", "readded"] {
        run(id, value(id).as_bytes(), None);
    }
    // Not one copy in an event: the values are the records'.
    assert_eq!(event_bodies(&jobs, "q"), 0);
    let first: Vec<(String, String)> =
        ["kept", "removed", "retried", "readded"].iter().map(|id| (id.to_string(), value(id))).collect();
    assert_eq!(completed(&jobs), first);

    assert!(jobs.admin("ns", "q", |tx, q| admin::remove_job(tx, q, "removed", false)).wait().unwrap());
    jobs.admin("ns", "q", |tx, q| admin::retry_finished(tx, q, "retried", JobState::Completed, false, false))
        .wait()
        .unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    finish(&jobs, "q", &l, Outcome::Ok { result: Some(value("again").into_bytes()) }).unwrap();
    assert!(jobs.admin("ns", "q", |tx, q| admin::remove_job(tx, q, "readded", false)).wait().unwrap());
    run("readded", value("anew").as_bytes(), None);
    // Given to their events: the removed job's, the retried job's first and
    // the readded job's first.
    assert_eq!(event_bodies(&jobs, "q"), 3);
    // Kept by count: this completion drops every older job but itself, each
    // giving its value to its event (kept's, retried's second, readded's second).
    let keep_one = Retention::Keep(Keep { count: Some(1), ..Default::default() });
    // Not valid UTF-8: the record keeps the bytes, the event reads them mended.
    let mut raw = value("raw").into_bytes();
    raw[1] = 0xff;
    run("raw", &raw, Some(keep_one));
    assert_eq!(event_bodies(&jobs, "q"), 6);
    assert_eq!(jobs.get_job("ns", "q", "raw").unwrap().unwrap().return_value, Some(raw.clone()));
    let mended = String::from_utf8_lossy(&raw).into_owned();
    let mut want = first;
    want.extend([("retried", value("again")), ("readded", value("anew")), ("raw", mended)].map(|(k, v)| (k.into(), v)));
    assert_eq!(completed(&jobs), want);
    // Removed at once: the value goes in its event, as any large event's fields.
    run("gone", value("gone").as_bytes(), Some(Retention::RemoveImmediately));
    assert_eq!(event_bodies(&jobs, "q"), 7);
    want.push(("gone".into(), value("gone")));
    assert_eq!(completed(&jobs), want);

    // An event that left the log takes nothing with it; a job that goes after
    // its event did gives nothing back.
    jobs.set_meta("ns", "q", BTreeMap::from([("opts.maxLenEvents".to_string(), "1".to_string())])).wait().unwrap();
    run("late", value("late").as_bytes(), None);
    jobs.admin("ns", "q", |tx, q| admin::publish_event(tx, q, "mine", &[], 1)).wait().unwrap();
    assert!(completed(&jobs).is_empty());
    let before = event_bodies(&jobs, "q");
    assert!(jobs.admin("ns", "q", |tx, q| admin::remove_job(tx, q, "late", false)).wait().unwrap());
    assert_eq!(event_bodies(&jobs, "q"), before);
    assert_eq!(jobs.get_job("ns", "q", "raw").unwrap().unwrap().return_value, Some(raw));
    jobs.admin("ns", "q", |tx, q| admin::set_paused(tx, q, true)).wait().unwrap();
    jobs.admin("ns", "q", |tx, q| admin::obliterate(tx, q, true, u64::MAX)).wait().unwrap();
    assert_eq!(event_bodies(&jobs, "q"), 0);
}

/// A read of the log takes about 8 MiB of events at most, one at least,
/// however many it may take: readers go on from the last one they got.
#[test]
fn a_read_of_large_events_stops_at_its_byte_bound() {
    let (jobs, _) = core();
    for (i, size) in [3 << 20, 3 << 20, 3 << 20, 9 << 20, 100].into_iter().enumerate() {
        let fields = vec![("pad".to_string(), "x".repeat(size))];
        jobs.admin("ns", "q", move |tx, q| admin::publish_event(tx, q, &format!("e{i}"), &fields, 100)).wait().unwrap();
    }
    let read = |after| {
        let events = jobs.read_events_blocking("ns", "q", Some(after), 100, Duration::ZERO).unwrap();
        events.into_iter().map(|e| e.seq).collect::<Vec<_>>()
    };
    assert_eq!(read(0), [1, 2], "two of 3 MiB fit in 8 MiB, three do not");
    assert_eq!(read(2), [3], "the next is 9 MiB");
    assert_eq!(read(3), [4], "one at least, even past the bound");
    assert_eq!(read(4), [5]);
    assert_eq!(query::MAX_EVENT_BYTES_PER_READ, 8 << 20);
}

/// A return value lent to its event counts toward a read's bound as any
/// large event's fields: two of 3 MiB fit in 8 MiB, the third is read next.
#[test]
fn a_read_of_lent_return_values_stops_at_its_byte_bound() {
    let (jobs, _) = core();
    let value = |i: usize| format!("\"{i}{}\"", "x".repeat(3 << 20));
    for i in 0..3 {
        jobs.enqueue("ns", "q", job(&format!("j{i}"))).wait().unwrap();
    }
    for i in 0..3 {
        let l = lease_one(&jobs, "q").unwrap();
        ok(&jobs, "q", &l, &value(i));
    }
    let values = |events: &[Event]| -> Vec<String> {
        let completed = events.iter().filter(|e| e.name == "completed");
        completed.map(|e| e.fields[1].1.clone()).collect()
    };
    let first = jobs.read_events_blocking("ns", "q", Some(0), 1_000, Duration::ZERO).unwrap();
    assert_eq!(values(&first), [value(0), value(1)]);
    let after = first.last().unwrap().seq;
    let rest = jobs.read_events_blocking("ns", "q", Some(after), 1_000, Duration::ZERO).unwrap();
    assert_eq!(values(&rest), [value(2)]);
}

#[test]
fn read_events_waits_for_the_next_event() {
    let (jobs, _) = core();
    let producer = jobs.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        producer.enqueue("ns", "q", job("a")).wait().unwrap();
    });
    let got = jobs.read_events_blocking("ns", "q", None, 10, Duration::from_secs(5)).unwrap();
    t.join().unwrap();
    assert_eq!(got.first().map(|e| e.name.as_str()), Some("added"));
}

#[test]
fn lease_wait_is_woken_by_an_enqueue() {
    let (jobs, _) = core();
    let producer = jobs.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        producer.enqueue("ns", "q", job("a")).wait().unwrap();
    });
    let started = std::time::Instant::now();
    let got = jobs.lease_wait_blocking("ns", "q", LeaseRequest::default(), Duration::from_secs(10)).unwrap();
    t.join().unwrap();
    assert_eq!(got.leases.len(), 1);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn every_scheduler_enqueues_one_job_per_tick() {
    let (jobs, clock) = core();
    let spec = SchedulerSpec {
        id: "s".into(),
        name: "tick".into(),
        every_ms: Some(1000),
        job: job("tick"),
        ..Default::default()
    };
    let (first, delay) = jobs.upsert_scheduler("ns", "q", spec.clone()).wait().unwrap().unwrap();
    assert_eq!((first.as_str(), delay), ("repeat:s:1000000", 0));
    // Upserting again does not add a second job for the same tick.
    jobs.upsert_scheduler("ns", "q", spec).wait().unwrap();
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting, JobState::Delayed]).unwrap().iter().sum::<u64>(), 1);
    let l = lease_one(&jobs, "q").unwrap();
    let next = jobs
        .admin("ns", "q", move |tx, q| {
            loam_jobs::ops::schedule::advance(tx, q, "s", None, "repeat:s:1000000", &job("tick"))
        })
        .wait()
        .unwrap();
    assert_eq!(next.as_deref(), Some("repeat:s:1001000"));
    ok(&jobs, "q", &l, "1");
    clock.advance(1000);
    assert_eq!(lease_one(&jobs, "q").unwrap().job.id, "repeat:s:1001000");
}

#[test]
fn idempotency_key_returns_the_first_result() {
    let (jobs, _) = core();
    let idem = Some(Idempotency { key: "k".into(), ttl_ms: None });
    let a = jobs.enqueue("ns", "q", EnqueueRequest { idempotency: idem.clone(), ..job("a") }).wait().unwrap();
    let b = jobs.enqueue("ns", "q", EnqueueRequest { idempotency: idem.clone(), ..job("a") }).wait().unwrap();
    assert_eq!((a.id.as_str(), a.created, b.id.as_str(), b.created), ("1", true, "1", false));
    let c = jobs.enqueue("ns", "q", EnqueueRequest { idempotency: idem.clone(), ..job("other") }).wait();
    assert!(matches!(c, Err(JobsError::IdempotencyConflict { .. })));
    // Any other field differing is another request too: a job id, a parent,
    // attempts. The key's own ttl is not part of the request.
    let others = [
        EnqueueRequest { job_id: Some("b".into()), ..job("a") },
        EnqueueRequest { parent: Some(parent("p", "p1")), ..job("a") },
        EnqueueRequest { attempts: 9, ..job("a") },
    ];
    for other in others {
        let d = jobs.enqueue("ns", "q", EnqueueRequest { idempotency: idem.clone(), ..other.clone() }).wait();
        assert!(matches!(d, Err(JobsError::IdempotencyConflict { .. })), "{other:?}: {d:?}");
    }
    let longer = Some(Idempotency { key: "k".into(), ttl_ms: Some(5_000) });
    let e = jobs.enqueue("ns", "q", EnqueueRequest { idempotency: longer, ..job("a") }).wait().unwrap();
    assert_eq!((e.id.as_str(), e.created), ("1", false));
}

/// A keyed add that a deduplication id absorbed answers the same when sent
/// again: the job that held the id, even after that job is gone, and with
/// `keepLastIfActive` after the add kept for later was made.
#[test]
fn a_deduplicated_keyed_add_sent_again_answers_the_same() {
    let (jobs, _) = core();
    let keyed = |key: &str, d: &Dedup, data: &[u8]| EnqueueRequest {
        idempotency: Some(Idempotency { key: key.into(), ttl_ms: None }),
        dedup: Some(d.clone()),
        data: data.to_vec(),
        ..job("a")
    };
    let simple = dedup("s", None);
    let first = jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(simple.clone()), ..job("a") }).wait().unwrap();
    let absorbed = jobs.enqueue("ns", "q", keyed("k1", &simple, b"x")).wait().unwrap();
    assert_eq!((absorbed.id.as_str(), absorbed.created), (first.id.as_str(), false));
    let l = lease_one(&jobs, "q").unwrap();
    ok(&jobs, "q", &l, &first.id);
    let again = jobs.enqueue("ns", "q", keyed("k1", &simple, b"x")).wait().unwrap();
    assert_eq!((again.id.as_str(), again.created), (first.id.as_str(), false), "not a new job once the holder is gone");
    assert_eq!(
        (absorbed.deduplicated_by.as_deref(), again.deduplicated_by),
        (Some(first.id.as_str()), absorbed.deduplicated_by.clone())
    );

    let d = keep_last(None);
    let holder = active_holder(&jobs, &d);
    let kept = jobs.enqueue("ns", "q", keyed("k2", &d, b"later")).wait().unwrap();
    assert!(!kept.created);
    ok(&jobs, "q", &holder, &holder.job.id);
    let made = lease_one(&jobs, "q").unwrap();
    assert_eq!(made.job.data, b"later");
    let resent = jobs.enqueue("ns", "q", keyed("k2", &d, b"later")).wait().unwrap();
    assert_eq!((resent.id.as_str(), resent.created), (kept.id.as_str(), false), "the kept add's first answer");
}

#[test]
fn expired_idempotency_records_are_purged_and_live_ones_kept() {
    let (jobs, clock) = core();
    let keyed = |key: &str, ttl_ms| EnqueueRequest {
        idempotency: Some(Idempotency { key: key.into(), ttl_ms: Some(ttl_ms) }),
        ..job("a")
    };
    let purge = || jobs.write("", true, |tx| loam_jobs::ops::idempotency::purge_expired(tx, 100)).wait();
    jobs.enqueue("ns", "q", keyed("short", 1_000)).wait().unwrap();
    jobs.enqueue("ns", "q", keyed("long", 60_000)).wait().unwrap();
    jobs.enqueue("ns", "q", keyed("reused", 1_000)).wait().unwrap();
    assert_eq!(purge().unwrap(), 0, "nothing has expired yet");
    clock.advance(2_000);
    // Expired but not purged yet: the key is free, and its new record lives on.
    assert!(jobs.enqueue("ns", "q", keyed("reused", 60_000)).wait().unwrap().created);
    assert_eq!(purge().unwrap(), 1, "only `short` went: `reused` was written again");
    assert!(!jobs.enqueue("ns", "q", keyed("long", 60_000)).wait().unwrap().created, "a live key still answers");
    assert!(!jobs.enqueue("ns", "q", keyed("reused", 60_000)).wait().unwrap().created);
    clock.advance(120_000);
    assert_eq!(purge().unwrap(), 2);
    assert_eq!(purge().unwrap(), 0, "each record is purged once");
}

/// A key's ttl runs on the core's clock, as a key's TTL does on Redis, not
/// on its caller's: a remote client five minutes behind had its add's record
/// purged as soon as it was written, and its repeat added the job twice.
#[test]
fn an_idempotency_key_lives_its_ttl_whatever_its_callers_clock_says() {
    let (jobs, clock) = core();
    let purge = || jobs.write("", true, |tx| loam_jobs::ops::idempotency::purge_expired(tx, 100)).wait().unwrap();
    let keyed = EnqueueRequest { idempotency: Some(Idempotency { key: "k".into(), ttl_ms: Some(60_000) }), ..job("a") };
    let behind = jobs.at(clock.now_ms() - 300_000);
    assert!(behind.enqueue("ns", "q", keyed.clone()).wait().unwrap().created);
    assert_eq!(purge(), 0, "the key is a minute old by nobody's clock");
    clock.advance(30_000);
    assert!(!jobs.at(clock.now_ms() - 300_000).enqueue("ns", "q", keyed.clone()).wait().unwrap().created);
    // Nor does a caller's clock ahead end it early.
    assert!(!jobs.at(clock.now_ms() + 300_000).enqueue("ns", "q", keyed.clone()).wait().unwrap().created);
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting]).unwrap(), vec![1]);
    clock.advance(31_000);
    assert_eq!(purge(), 1);
}

/// A bulk add under a key for the whole call, sent again, answers each job
/// the first call made and adds none twice; a job it refused is tried again,
/// and answered as made from then on. One record keeps the call.
#[test]
fn a_bulk_add_made_again_under_its_key_answers_the_jobs_it_made() {
    let (jobs, clock) = core();
    let key = || Some(Idempotency { key: "k".into(), ttl_ms: Some(60_000) });
    let orphan = EnqueueRequest { parent: Some(parent("p", "p1")), ..job("child") };
    let bulk = vec![job("a"), orphan, EnqueueRequest { job_id: Some("c".into()), ..job("c") }];
    let created = |r: &Result<Enqueued, JobsError>| r.as_ref().map(|e| (e.id.clone(), e.created)).ok();
    let first = jobs.enqueue_bulk("ns", "q", bulk.clone(), key()).wait().unwrap();
    assert_eq!(
        first.iter().map(created).collect::<Vec<_>>(),
        [Some(("1".into(), true)), None, Some(("c".into(), true))]
    );
    let again = jobs.enqueue_bulk("ns", "q", bulk.clone(), key()).wait().unwrap();
    assert_eq!(
        again.iter().map(created).collect::<Vec<_>>(),
        [Some(("1".into(), false)), None, Some(("c".into(), false))]
    );
    assert!(matches!(again[1], Err(JobsError::NotFound(Missing::ParentJob(_)))), "{:?}", again[1]);

    jobs.enqueue("ns", "p", EnqueueRequest { job_id: Some("p1".into()), ..job("p") }).wait().unwrap();
    let third = jobs.enqueue_bulk("ns", "q", bulk.clone(), key()).wait().unwrap();
    assert_eq!(
        third.iter().map(created).collect::<Vec<_>>(),
        [Some(("1".into(), false)), Some(("3".into(), true)), Some(("c".into(), false))]
    );
    let fourth = jobs.enqueue_bulk("ns", "q", bulk.clone(), key()).wait().unwrap();
    assert_eq!(
        fourth.iter().map(created).collect::<Vec<_>>(),
        [Some(("1".into(), false)), Some(("3".into(), false)), Some(("c".into(), false))]
    );
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting]).unwrap(), vec![3]);

    // A finished job is answered completed, as a job's own key answers it.
    let l = lease_one(&jobs, "q").unwrap();
    ok(&jobs, "q", &l, "1");
    let states: Vec<JobState> = jobs
        .enqueue_bulk("ns", "q", bulk.clone(), key())
        .wait()
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap().state)
        .collect();
    assert_eq!(states, [JobState::Completed, JobState::Waiting, JobState::Waiting]);

    // Other jobs, or the same jobs all or nothing, under the key: another call.
    let other = jobs.enqueue_bulk("ns", "q", vec![job("a"), job("b")], key()).wait();
    assert!(matches!(other, Err(JobsError::IdempotencyConflict { .. })), "{other:?}");
    let all = jobs.enqueue_all("ns", "q", bulk, key()).wait();
    assert!(matches!(all, Err(JobsError::IdempotencyConflict { .. })), "{all:?}");
    // A single add under the key is another call too.
    let single = jobs.enqueue("ns", "q", EnqueueRequest { idempotency: key(), ..job("a") }).wait();
    assert!(matches!(single, Err(JobsError::IdempotencyConflict { .. })), "{single:?}");

    let purge = || jobs.write("", true, |tx| loam_jobs::ops::idempotency::purge_expired(tx, 100)).wait().unwrap();
    clock.advance(120_000);
    assert_eq!(purge(), 1, "one record for the call, not one for each job");
}

/// All or nothing under a key for the call: a call refused keeps no record
/// (nothing was added), and one that went through answers its jobs again.
#[test]
fn an_all_or_nothing_bulk_add_made_again_under_its_key_answers_the_jobs_it_made() {
    let (jobs, _) = core();
    let key = |k: &str| Some(Idempotency { key: k.into(), ttl_ms: None });
    let orphan = EnqueueRequest { parent: Some(parent("p", "p1")), ..job("child") };
    let refused = jobs.enqueue_all("ns", "q", vec![job("a"), orphan.clone()], key("k1")).wait();
    assert!(matches!(refused, Err(JobsError::NotFound(Missing::ParentJob(_)))), "{refused:?}");
    jobs.enqueue("ns", "p", EnqueueRequest { job_id: Some("p1".into()), ..job("p") }).wait().unwrap();
    let made = jobs.enqueue_all("ns", "q", vec![job("a"), orphan.clone()], key("k1")).wait().unwrap();
    assert!(made.iter().all(|e| e.created));
    let again = jobs.enqueue_all("ns", "q", vec![job("a"), orphan], key("k1")).wait().unwrap();
    let ids = |v: &[Enqueued]| v.iter().map(|e| (e.id.clone(), e.created)).collect::<Vec<_>>();
    assert_eq!(ids(&again), made.iter().map(|e| (e.id.clone(), false)).collect::<Vec<_>>());
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting, JobState::WaitingChildren]).unwrap(), vec![2, 0]);
}

/// A remote worker whose connection was cut while its completion was on its
/// way sends it again under the same key: the job is not completed twice,
/// and the next job the first one leased is handed over again, not left to
/// stall until its lock lapses. Whether or not retention removed the job.
#[test]
fn a_completion_made_again_under_its_key_gives_its_first_answer() {
    for removed in [false, true] {
        let (jobs, clock) = core();
        let retention = removed.then_some(Retention::RemoveImmediately);
        for name in ["a", "b"] {
            jobs.enqueue("ns", "q", EnqueueRequest { remove_on_complete: retention, ..job(name) }).wait().unwrap();
        }
        let a = lease_one(&jobs, "q").unwrap();
        let keyed = |key: Option<&str>| CompleteOptions {
            fetch_next: Some(LeaseRequest { max: 1, token: "w".into(), lock_duration_ms: 5_000, ..Default::default() }),
            idempotency: key.map(|key| Idempotency { key: key.into(), ttl_ms: None }),
            ..Default::default()
        };
        let complete_a = |key| {
            jobs.complete("ns", "q", &a.job.id, Fence::Token("w".into()), Outcome::Ok { result: None }, keyed(key))
                .wait()
        };
        let first = complete_a(Some("k1")).unwrap();
        let b = first.next.as_ref().and_then(|n| n.leases.first()).cloned().unwrap();
        assert_eq!((b.job.name.as_str(), first.replayed), ("b", false));

        let again = complete_a(Some("k1")).unwrap();
        assert!(again.replayed && again.attempt.is_none());
        // The job removed, its state is gone with it; the key's own record
        // keeps when it finished.
        assert_eq!(first.removed, removed);
        let first_state = if removed { None } else { first.state };
        assert_eq!((again.state, again.finished_on, again.removed), (first_state, first.finished_on, removed));
        let b_again = again.next.and_then(|n| n.leases.into_iter().next()).unwrap();
        assert_eq!((b_again.job.id, b_again.epoch, b_again.token), (b.job.id.clone(), b.epoch, b.token.clone()));
        assert_eq!(event_names(&jobs, "q").iter().filter(|n| *n == "completed").count(), 1, "completed once");
        assert_eq!(jobs.counts("ns", "q", &[JobState::Active]).unwrap(), vec![1]);

        // Another key, or none, is another completion: the lease is gone.
        for key in [Some("k2"), None] {
            let refused = complete_a(key).unwrap_err();
            assert!(matches!(refused, JobsError::Fenced { .. } | JobsError::NotFound(_)), "{refused:?}");
        }
        // Once `b`'s lease lapsed and it was reclaimed, the answer leaves it
        // out; `a`, removed, is still known by its key's record.
        clock.advance(10_000);
        assert_eq!(jobs.sweep_stalled("ns", "q").wait().unwrap(), std::slice::from_ref(&b.job.id));
        let late = complete_a(Some("k1")).unwrap();
        assert!(late.replayed && late.removed == removed && late.next.is_some_and(|n| n.leases.is_empty()));
        if removed {
            // Past the key's ttl (the core's default, a day), nothing is left
            // to recognize it by.
            clock.advance(24 * 3600 * 1000);
            assert!(matches!(complete_a(Some("k1")), Err(JobsError::NotFound(Missing::Job(_)))));
        }
        if !removed {
            // Run again and leased by another worker, `a` still knows the key
            // (its completion was applied), and any other completion is fenced.
            jobs.admin("ns", "q", |tx, q| admin::retry_finished(tx, q, "1", JobState::Completed, false, false))
                .wait()
                .unwrap();
            let other = LeaseRequest { max: 2, token: "w2".into(), ..Default::default() };
            let leased = jobs.lease("ns", "q", other).wait().unwrap().leases;
            let a_again = leased.iter().find(|l| l.job.id == "1").unwrap();
            // Still its first answer: it was applied, and it is not again.
            let late = complete_a(Some("k1")).unwrap();
            assert!(late.replayed && late.state == Some(JobState::Active), "{late:?}");
            let a_now = jobs.get_job("ns", "q", "1").unwrap().unwrap();
            assert_eq!((a_now.state, a_now.epoch), (JobState::Active, a_again.epoch));
            assert!(matches!(complete_a(Some("k3")), Err(JobsError::Fenced { .. })));
        }
    }
}

/// A retry or delay sent again under its key after its job was leased anew
/// (its answer was lost, and the worker's resend came later) answers what it
/// first did and is not applied again: the attempt is counted once and the
/// new lease stands. With BullMQ's manual processing the new lease may carry
/// the old one's token (`lease_one` always takes "w"), which the fence lets
/// through, and a token-less `moveToDelayed` is not fenced at all. So too
/// when another keyed completion ended the job in between.
#[test]
fn a_completion_made_again_after_its_job_was_leased_anew_is_not_applied_twice() {
    let retry = || Outcome::Retry { error: Some(JobError::new("again")), after_ms: Some(0) };
    for delay in [false, true] {
        let case = if delay { "delay, unfenced" } else { "retry, same token" };
        let fence = if delay { Fence::Unchecked } else { Fence::Token("w".into()) };
        let outcome = |now: u64| {
            if delay {
                Outcome::Delay { until: now + 100, delay_ms: None }
            } else {
                Outcome::Retry { error: None, after_ms: Some(0) }
            }
        };
        for ended_between in [false, true] {
            let (jobs, clock) = core();
            jobs.enqueue("ns", "q", EnqueueRequest { attempts: 5, ..job("a") }).wait().unwrap();
            let keyed = |key: &str| CompleteOptions {
                idempotency: Some(Idempotency { key: key.into(), ttl_ms: None }),
                ..Default::default()
            };
            let first_lease = lease_one(&jobs, "q").unwrap();
            let complete =
                |fence: Fence, outcome, key| jobs.complete("ns", "q", "1", fence, outcome, keyed(key)).wait();
            let first = complete(fence.clone(), outcome(clock.now_ms()), "k1").unwrap();
            assert!(!first.replayed, "{case}");
            clock.advance(200);
            let mut lease = lease_one(&jobs, "q").unwrap();
            if ended_between {
                // Another keyed completion ends the job, and it is leased again.
                complete(Fence::Epoch(lease.epoch), retry(), "k2").unwrap();
                lease = lease_one(&jobs, "q").unwrap();
            }
            assert!(lease.epoch > first_lease.epoch);
            let before = jobs.get_job("ns", "q", "1").unwrap().unwrap();
            let again = complete(fence.clone(), outcome(clock.now_ms()), "k1").unwrap();
            assert!(again.replayed, "{case}, ended between {ended_between}");
            assert_eq!(again.state, Some(JobState::Active), "{case}, ended between {ended_between}");
            let after = jobs.get_job("ns", "q", "1").unwrap().unwrap();
            assert_eq!(
                (after.state, after.epoch, after.attempts_made, after.attempts_started),
                (JobState::Active, lease.epoch, before.attempts_made, before.attempts_started),
                "{case}, ended between {ended_between}: applied again"
            );
            // The lease it did not disturb ends as usual.
            finish(&jobs, "q", &lease, Outcome::Ok { result: None }).unwrap();
            assert_eq!(state(&jobs, "q", "1"), Some(JobState::Completed), "{case}");
        }
    }
}

/// A report sent again under its key is not made again: one log line, one
/// progress event.
#[test]
fn a_report_made_again_under_its_key_is_made_once() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    let key = |k: &str| Some(Idempotency { key: k.into(), ttl_ms: None });
    let report = |r: Report, k: &str| jobs.report("ns", "q", "1", Fence::Epoch(l.epoch), r, key(k)).wait();
    let line = || Report::Log { row: "once".into(), keep: None };
    assert_eq!((report(line(), "log").unwrap(), report(line(), "log").unwrap()), (1, 1));
    assert_eq!(report(line(), "log 2").unwrap(), 2, "another key is another line");
    let (lines, _) = jobs.query("ns", "q", |tx, q| query::logs(tx, q, "1", 0, -1, true)).unwrap();
    assert_eq!(lines, ["once", "once"]);
    for _ in 0..2 {
        report(Report::Progress("50".into()), "progress").unwrap();
    }
    assert_eq!(event_names(&jobs, "q").iter().filter(|n| *n == "progress").count(), 1);
    assert!(matches!(report(Report::Progress("60".into()), "progress"), Err(JobsError::IdempotencyConflict { .. })));
}

#[test]
fn bad_input_gets_typed_errors_and_changes_nothing() {
    let clock = ManualClock::new(1_000_000);
    let config = Config { background: false, max_payload_bytes: 1024, ..Config::default() };
    let jobs = Jobs::with_store(Box::new(RedbStore::in_memory().unwrap()), Arc::new(clock), config).unwrap();
    let big = jobs.enqueue("ns", "q", EnqueueRequest { data: vec![b'x'; 2048], ..job("a") }).wait();
    assert!(matches!(big, Err(JobsError::PayloadTooLarge { limit: 1024, .. })));
    let bad_queue = jobs.enqueue("ns", "", job("a")).wait();
    assert!(matches!(bad_queue, Err(JobsError::InvalidArgument(_))));
    let bad_prio = jobs.enqueue("ns", "q", EnqueueRequest { priority: 1 << 22, ..job("a") }).wait();
    assert!(matches!(bad_prio, Err(JobsError::InvalidArgument(_))));
    // An integer id could take the place of a job the queue numbers itself.
    for id in ["1", "2", "-3", "0", "18446744073709551615"] {
        let taken = jobs.enqueue("ns", "q", EnqueueRequest { job_id: Some(id.into()), ..job("a") }).wait();
        assert!(matches!(taken, Err(JobsError::InvalidArgument(_))), "{id}: {taken:?}");
    }
    let missing = jobs
        .complete("ns", "q", "nope", Fence::Epoch(1), Outcome::Ok { result: None }, CompleteOptions::default())
        .wait();
    assert!(matches!(missing, Err(JobsError::NotFound(Missing::Job(_)))));
    let bulk = jobs
        .enqueue_bulk(
            "ns",
            "q",
            vec![job("ok"), EnqueueRequest { data: vec![0; 4096], ..job("big") }, job("ok2")],
            None,
        )
        .wait()
        .unwrap();
    assert!(bulk[0].is_ok() && bulk[1].is_err() && bulk[2].is_ok());
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting]).unwrap(), vec![2]);
    // All or nothing: one job refused (its parent is missing) keeps the others out.
    let orphan = EnqueueRequest { parent: Some(parent("q", "nope")), ..job("orphan") };
    let all = jobs.enqueue_all("ns", "q", vec![job("g1"), orphan, job("g2")], None).wait();
    assert!(matches!(all, Err(JobsError::NotFound(Missing::ParentJob(_)))), "{all:?}");
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting]).unwrap(), vec![2]);
    for id in ["01", "-0", "1a", "+1", " 1"] {
        jobs.enqueue("ns", "q", EnqueueRequest { job_id: Some(id.into()), ..job("a") }).wait().unwrap();
    }
}

/// `max_payload_bytes` bounds what a caller stores beside a job's data:
/// headers, a published event and queue meta are refused past it; a
/// failure's message and stack trace are cut to it (refused, the worker's
/// job would stay active until its lock ran out, then fail as stalled).
#[test]
fn the_payload_limit_covers_headers_events_meta_and_failures() {
    let clock = ManualClock::new(1_000_000);
    let config = Config { background: false, max_payload_bytes: 1024, ..Config::default() };
    let jobs = Jobs::with_store(Box::new(RedbStore::in_memory().unwrap()), Arc::new(clock), config).unwrap();
    let large = || "x".repeat(2048);
    let headers = BTreeMap::from([("h".to_string(), large())]);
    let added = jobs.enqueue("ns", "q", EnqueueRequest { headers, ..job("a") }).wait();
    assert!(matches!(added, Err(JobsError::PayloadTooLarge { limit: 1024, .. })), "{added:?}");
    let fields = vec![("pad".to_string(), large())];
    let published = jobs.admin("ns", "q", move |tx, q| admin::publish_event(tx, q, "mine", &fields, 100)).wait();
    assert!(matches!(published, Err(JobsError::PayloadTooLarge { .. })), "{published:?}");
    let meta = jobs.set_meta("ns", "q", BTreeMap::from([("k".to_string(), large())])).wait();
    assert!(matches!(meta, Err(JobsError::PayloadTooLarge { .. })), "{meta:?}");

    jobs.enqueue("ns", "q", job("f")).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    // Two-byte characters, so the cut falls inside one unless it minds them.
    let error = JobError { message: "é".repeat(1000), stacktrace: Some("s".repeat(5000)), ..Default::default() };
    finish(&jobs, "q", &l, Outcome::Fail { error, dead_letter: false }).unwrap();
    let failed = jobs.get_job("ns", "q", &l.job.id).unwrap().unwrap();
    let reason = failed.failed_reason.unwrap();
    assert!(reason.len() <= 1024 && reason.ends_with(" [cut]") && reason.starts_with("éé"), "{}", reason.len());
    let stack = &failed.stacktrace[0];
    assert!(stack.len() <= 1024 && stack.ends_with(" [cut]"), "{}", stack.len());
}

/// A failure may carry the job's whole list of stack traces (BullMQ keeps it
/// in its Job), which replaces the stored list, each trace cut as one
/// appended is; one appended goes after the stored ones and trims to its limit.
#[test]
fn a_failure_sets_the_stack_traces_whole_or_appends_one() {
    let clock = ManualClock::new(1_000_000);
    let config = Config { background: false, max_payload_bytes: 1024, ..Config::default() };
    let jobs = Jobs::with_store(Box::new(RedbStore::in_memory().unwrap()), Arc::new(clock), config).unwrap();
    jobs.enqueue("ns", "q", EnqueueRequest { attempts: 3, ..job("a") }).wait().unwrap();
    let trace = |s: &str| JobError { message: "m".into(), stacktrace: Some(s.into()), ..Default::default() };
    for (stack, limit) in [("one", None), ("two", Some(1))] {
        let l = lease_one(&jobs, "q").unwrap();
        let error = JobError { stacktrace_limit: limit, ..trace(stack) };
        finish(&jobs, "q", &l, Outcome::Retry { error: Some(error), after_ms: Some(0) }).unwrap();
    }
    assert_eq!(jobs.get_job("ns", "q", "1").unwrap().unwrap().stacktrace, ["two"]);
    let l = lease_one(&jobs, "q").unwrap();
    let whole = vec!["x".to_string(), "y".repeat(5000)];
    let error = JobError { stacktraces: Some(whole), ..trace("ignored") };
    finish(&jobs, "q", &l, Outcome::Fail { error, dead_letter: false }).unwrap();
    let stored = jobs.get_job("ns", "q", "1").unwrap().unwrap().stacktrace;
    assert_eq!((stored.len(), stored[0].as_str()), (2, "x"));
    assert!(stored[1].len() <= 1024 && stored[1].ends_with(" [cut]"), "{}", stored[1].len());
}

#[test]
fn dead_lettered_jobs_can_be_redriven() {
    let (jobs, _) = core();
    let config = QueueConfig { dead_letter_queue: Some("dlq".into()), ..QueueConfig::defaults(&Config::default()) };
    jobs.set_queue_config("ns", "q", config).wait().unwrap();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    finish(&jobs, "q", &l, Outcome::Fail { error: JobError::new("poison"), dead_letter: true }).unwrap();
    let dl = lease_one(&jobs, "dlq").unwrap();
    assert_eq!(dl.job.headers.get("x-dead-letter-reason").map(String::as_str), Some("poison"));
    finish(&jobs, "dlq", &dl, Outcome::Release { after_ms: None }).unwrap();
    let moved = jobs.admin("ns", "dlq", |tx, q| admin::redrive_dead_letters(tx, q, 10)).wait().unwrap();
    assert_eq!(moved, 1);
    assert_eq!(lease_one(&jobs, "q").unwrap().job.name, "a");
}

#[test]
fn metrics_count_finished_jobs_per_minute() {
    let (jobs, clock) = core();
    let opts = CompleteOptions { metrics_max_points: Some(10), ..Default::default() };
    for minute in 0..3 {
        for _ in 0..=minute {
            jobs.enqueue("ns", "q", job("a")).wait().unwrap();
            let l = lease_one(&jobs, "q").unwrap();
            jobs.complete("ns", "q", &l.job.id, Fence::Epoch(l.epoch), Outcome::Ok { result: None }, opts.clone())
                .wait()
                .unwrap();
        }
        clock.advance(60_000);
    }
    let m = jobs.query("ns", "q", |tx, q| query::metrics(tx, q, MetricsKind::Completed)).unwrap().unwrap();
    assert_eq!(m.count, 6);
    assert_eq!(m.data.iter().copied().collect::<Vec<_>>(), vec![2, 1]);
}

fn complete_with_metrics(jobs: &Jobs, max_points: u64) {
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    let l = lease_one(jobs, "q").unwrap();
    let opts = CompleteOptions { metrics_max_points: Some(max_points), ..Default::default() };
    jobs.complete("ns", "q", &l.job.id, Fence::Epoch(l.epoch), Outcome::Ok { result: None }, opts).wait().unwrap();
}

fn stored_len(jobs: &Jobs, key: fn(&loam_jobs::keys::QueueKeys) -> Vec<u8>) -> usize {
    jobs.query("ns", "q", move |tx, q| tx.get(&key(&loam_jobs::keys::QueueKeys::new(q))))
        .unwrap()
        .map_or(0, |v| v.len())
}

/// However many points a worker asks for and however far its clock jumps,
/// one completion writes at most `MAX_METRICS_POINTS`.
#[test]
fn metrics_keep_a_bounded_number_of_points() {
    let (jobs, clock) = core();
    complete_with_metrics(&jobs, u64::MAX);
    clock.advance(20_000_000 * 60_000);
    complete_with_metrics(&jobs, u64::MAX);
    let m = jobs.query("ns", "q", |tx, q| query::metrics(tx, q, MetricsKind::Completed)).unwrap().unwrap();
    assert_eq!(m.data.len() as u64, loam_jobs::model::MAX_METRICS_POINTS);
    // As on Redis: the finished job's point, then a zero for each minute
    // since, as many as fit.
    assert_eq!((m.data.back(), m.data.iter().sum::<u64>()), (Some(&1), 1));
}

/// The points are written once a minute, apart from the counters every
/// finished job writes: a week of points is not rewritten per job.
#[test]
fn a_finished_job_does_not_rewrite_the_metrics_points() {
    let (jobs, clock) = core();
    complete_with_metrics(&jobs, 10_080);
    clock.advance(5_000 * 60_000);
    complete_with_metrics(&jobs, 10_080);
    let points = stored_len(&jobs, |k| k.metrics_points(MetricsKind::Completed));
    assert!(points >= 5_000, "5,000 minutes of points: {points} bytes");
    complete_with_metrics(&jobs, 10_080);
    assert!(stored_len(&jobs, |k| k.metrics(MetricsKind::Completed)) < 64);
    assert_eq!(stored_len(&jobs, |k| k.metrics_points(MetricsKind::Completed)), points);
    let m = jobs.query("ns", "q", |tx, q| query::metrics(tx, q, MetricsKind::Completed)).unwrap().unwrap();
    assert_eq!((m.count, m.data.len(), m.data[4_999]), (3, 5_000, 1));
}

/// A store written when the points were kept with the counters reads them
/// there, and moves them to their own key with the next minute's point.
#[test]
fn metrics_points_kept_with_their_counters_are_read_and_moved() {
    let (jobs, clock) = core();
    complete_with_metrics(&jobs, 10);
    let old = MetricsRecord { count: 9, prev_ts: clock.now_ms(), prev_count: 7, data: [5, 4].into() };
    jobs.admin("ns", "q", move |tx, q| {
        tx.put_record(&loam_jobs::keys::QueueKeys::new(q).metrics(MetricsKind::Completed), &old)
    })
    .wait()
    .unwrap();
    let m = jobs.query("ns", "q", |tx, q| query::metrics(tx, q, MetricsKind::Completed)).unwrap().unwrap();
    assert_eq!(Vec::from(m.data), [5, 4]);
    clock.advance(60_000);
    complete_with_metrics(&jobs, 10);
    let m = jobs.query("ns", "q", |tx, q| query::metrics(tx, q, MetricsKind::Completed)).unwrap().unwrap();
    assert_eq!((m.count, Vec::from(m.data)), (10, vec![2, 5, 4]));
    assert!(stored_len(&jobs, |k| k.metrics(MetricsKind::Completed)) < 64);
}

#[test]
fn stores_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.redb");
    {
        let jobs = Jobs::open(&path, Config { background: false, ..Config::default() }).unwrap();
        jobs.enqueue("ns", "q", job("a")).wait().unwrap();
        jobs.close();
    }
    let jobs = Jobs::open(&path, Config { background: false, ..Config::default() }).unwrap();
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting]).unwrap(), vec![1]);
    let second = Jobs::open(&path, Config { background: false, ..Config::default() });
    assert!(matches!(second, Err(JobsError::Unavailable(_))), "a second open of one file is refused");
}

/// A lease a crash lost (leases are acknowledged before their fsync: a lost
/// one is a stalled one) must never have its epoch handed out again: its
/// holder, still running, would otherwise complete the job under the next
/// lease's. Each open starts epochs above every earlier open's.
#[test]
fn a_lease_lost_in_a_crash_never_has_its_epoch_handed_out_again() {
    let dir = tempfile::tempdir().unwrap();
    let (path, crashed) = (dir.path().join("jobs.redb"), dir.path().join("crashed.redb"));
    let log = |p: &std::path::Path| p.with_extension("redb.wal");
    let config = || Config { background: false, ..Config::default() };
    let jobs = Jobs::open(&path, config()).unwrap();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    // What a kill -9 right after the lease leaves: the add, not the lease
    // (the log first, as a running store's files are copied).
    std::fs::copy(log(&path), log(&crashed)).unwrap();
    std::fs::copy(&path, &crashed).unwrap();
    let lost = lease_one(&jobs, "q").unwrap();
    jobs.close();
    let jobs = Jobs::open(&crashed, config()).unwrap();
    let again = lease_one(&jobs, "q").expect("the job is leased again");
    assert!(again.epoch > lost.epoch, "epoch {} handed out again after {}", again.epoch, lost.epoch);
    let stale = finish(&jobs, "q", &lost, Outcome::Ok { result: None });
    assert!(matches!(stale, Err(JobsError::Fenced { .. })), "the lost lease completed the job: {stale:?}");
    let extended = jobs.extend("ns", "q", &lost.job.id, Fence::Epoch(lost.epoch), 1_000).wait();
    assert!(matches!(extended, Err(JobsError::Fenced { .. })), "the lost lease was extended: {extended:?}");
    ok(&jobs, "q", &again, "\"done\"");
}

#[test]
fn an_existing_job_id_joins_a_new_parent() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { job_id: Some("c".into()), ..job("c") }).wait().unwrap();
    let c = lease_one(&jobs, "q").unwrap();
    ok(&jobs, "q", &c, "\"done\"");
    jobs.enqueue("ns", "q", EnqueueRequest { job_id: Some("pending".into()), ..job("pending") }).wait().unwrap();
    let nodes = vec![
        FlowNode {
            queue: "q".into(),
            request: EnqueueRequest { job_id: Some("p".into()), ..job("p") },
            wait_children: true,
        },
        FlowNode {
            queue: "q".into(),
            request: EnqueueRequest { job_id: Some("c".into()), parent: Some(parent("q", "p")), ..job("c") },
            wait_children: false,
        },
        FlowNode {
            queue: "q".into(),
            request: EnqueueRequest { job_id: Some("pending".into()), parent: Some(parent("q", "p")), ..job("x") },
            wait_children: false,
        },
    ];
    let added = jobs.flow("ns", nodes).wait().unwrap();
    assert_eq!(added.iter().map(|e| e.created).collect::<Vec<_>>(), [true, false, false]);
    // The finished child counts as processed; the waiting one holds the parent.
    assert_eq!(state(&jobs, "q", "p"), Some(JobState::WaitingChildren));
    let deps = jobs.query("ns", "q", |tx, q| query::dependencies(tx, q, "p")).unwrap();
    let statuses: BTreeMap<String, DependencyStatus> = deps.into_iter().map(|(k, d)| (k, d.status)).collect();
    assert_eq!(statuses.get("bull:q:c"), Some(&DependencyStatus::Processed));
    assert_eq!(statuses.get("bull:q:pending"), Some(&DependencyStatus::Pending));
    // A job of another live parent cannot be taken over.
    jobs.enqueue("ns", "q", EnqueueRequest { job_id: Some("p2".into()), ..job("p2") }).wait().unwrap();
    let stolen = jobs
        .enqueue(
            "ns",
            "q",
            EnqueueRequest { job_id: Some("pending".into()), parent: Some(parent("q", "p2")), ..job("x") },
        )
        .wait();
    assert!(matches!(stolen, Err(JobsError::Precondition(Precondition::ParentCannotBeReplaced { .. }))), "{stolen:?}");
}

#[test]
fn a_names_filter_leases_only_those_tasks() {
    let (jobs, _) = core();
    for name in ["a", "b", "a", "c"] {
        jobs.enqueue("ns", "q", job(name)).wait().unwrap();
    }
    let req = LeaseRequest { max: 10, names: Some(vec!["a".into()]), ..Default::default() };
    let got: Vec<String> = jobs.lease("ns", "q", req).wait().unwrap().leases.into_iter().map(|l| l.job.id).collect();
    assert_eq!(got, ["1", "3"]);
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting]).unwrap(), vec![2]);
}

#[test]
fn logs_are_capped_and_progress_is_an_event() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { keep_logs: Some(3), ..job("a") }).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    for i in 0..5 {
        let line = Report::Log { row: format!("line {i}"), keep: None };
        jobs.report("ns", "q", "1", Fence::Epoch(l.epoch), line, None).wait().unwrap();
    }
    let (lines, count) = jobs.query("ns", "q", |tx, q| query::logs(tx, q, "1", 0, -1, true)).unwrap();
    assert_eq!((lines, count), (vec!["line 2".to_string(), "line 3".into(), "line 4".into()], 3));
    jobs.report("ns", "q", "1", Fence::Epoch(l.epoch), Report::Progress("50".into()), None).wait().unwrap();
    assert!(events(&jobs, "q").iter().any(|(n, f)| n == "progress" && f.contains(&("data".into(), "50".into()))));
    let stale = jobs.report("ns", "q", "1", Fence::Epoch(l.epoch + 1), Report::Progress("60".into()), None).wait();
    assert!(matches!(stale, Err(JobsError::Fenced { .. })));
}

#[test]
fn admin_moves_jobs_between_states() {
    let (jobs, clock) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { delay_ms: 10_000, ..job("d") }).wait().unwrap();
    jobs.admin("ns", "q", |tx, q| admin::promote(tx, q, "1")).wait().unwrap();
    assert_eq!(state(&jobs, "q", "1"), Some(JobState::Waiting));
    let again = jobs.admin("ns", "q", |tx, q| admin::promote(tx, q, "1")).wait();
    let not_delayed =
        Precondition::NotInState { job: "1".into(), state: JobState::Waiting, expected: JobState::Delayed };
    assert_eq!(again.map(|_| ()), Err(JobsError::Precondition(not_delayed)));
    jobs.admin("ns", "q", |tx, q| admin::change_priority(tx, q, "1", 7, false)).wait().unwrap();
    assert_eq!(state(&jobs, "q", "1"), Some(JobState::Prioritized));
    jobs.enqueue("ns", "q", EnqueueRequest { delay_ms: 10_000, ..job("d2") }).wait().unwrap();
    jobs.admin("ns", "q", |tx, q| admin::change_delay(tx, q, "2", 5)).wait().unwrap();
    clock.advance(5);
    assert_eq!(lease_one(&jobs, "q").unwrap().job.id, "2", "a ready FIFO job runs before a prioritized one");
    let l = lease_one(&jobs, "q").unwrap();
    fail(&jobs, "q", &l);
    jobs.admin("ns", "q", |tx, q| admin::retry_finished(tx, q, "1", JobState::Failed, true, false)).wait().unwrap();
    let retried = jobs.get_job("ns", "q", "1").unwrap().unwrap();
    assert_eq!((retried.state, retried.attempts_made, retried.failed_reason), (JobState::Prioritized, 0, None));
}

/// BullMQ's flows answer for their root only: a child whose id another
/// existing parent holds stays that parent's and the rest of the flow goes
/// in; its new parent is not released by the flow, only once its other
/// children finish ("flowAttachmentFailed" in BullMQ's scripts).
#[test]
fn a_flow_child_held_by_another_parent_stays_there_and_the_flow_goes_in() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::Wait); // parents/p with kids a and b
    let child = |id: &str, of: &str| FlowNode {
        queue: "kids".into(),
        request: EnqueueRequest { job_id: Some(id.into()), parent: Some(parent("parents", of)), ..job(id) },
        wait_children: false,
    };
    let root = |id: &str| FlowNode {
        queue: "parents".into(),
        request: EnqueueRequest { job_id: Some(id.into()), ..job(id) },
        wait_children: true,
    };
    let added = jobs.flow("ns", vec![root("p2"), child("a", "p2"), child("other", "p2")]).wait().unwrap();
    assert_eq!(added.iter().map(|e| e.created).collect::<Vec<_>>(), [true, false, true]);
    assert_eq!(jobs.get_job("ns", "kids", "a").unwrap().unwrap().parent, Some(parent("parents", "p")));
    let p2 = jobs.get_job("ns", "parents", "p2").unwrap().unwrap();
    assert_eq!((p2.state, p2.pending_children), (JobState::WaitingChildren, 1));
    assert!(!event_names(&jobs, "kids").contains(&"duplicated".to_string()), "as Redis: -7 before the event");
    // Its only child held elsewhere, a parent is not released by the flow.
    jobs.flow("ns", vec![root("p3"), child("b", "p3")]).wait().unwrap();
    assert_eq!(state(&jobs, "parents", "p3"), Some(JobState::WaitingChildren));
    // The root itself is refused, and nothing of its flow goes in.
    let refused = jobs.flow("ns", vec![child("a", "p3"), child("c", "p3")]).wait();
    assert!(matches!(refused, Err(JobsError::Precondition(Precondition::ParentCannotBeReplaced { .. }))));
    assert_eq!(state(&jobs, "kids", "c"), None);
    for _ in 0..3 {
        let l = lease_one(&jobs, "kids").expect("a kid");
        ok(&jobs, "kids", &l, "1");
    }
    assert_eq!(state(&jobs, "parents", "p2"), Some(JobState::Waiting), "released once `other` finished");
}

/// A flow whose root exists stands on it: the root is "duplicated" and the
/// flow's children join the ones it waits for, as BullMQ's addParentJob does.
#[test]
fn a_flow_onto_an_existing_parent_adds_its_children_to_that_parent() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::Wait); // parents/p with kids a and b
    let root = FlowNode {
        queue: "parents".into(),
        request: EnqueueRequest { job_id: Some("p".into()), ..job("p") },
        wait_children: true,
    };
    let added =
        jobs.flow("ns", vec![root, flow_node("kids", "c", Some(parent("parents", "p")), false)]).wait().unwrap();
    assert_eq!(added.iter().map(|e| e.created).collect::<Vec<_>>(), [false, true]);
    assert!(event_names(&jobs, "parents").contains(&"duplicated".to_string()));
    let p = jobs.get_job("ns", "parents", "p").unwrap().unwrap();
    assert_eq!((p.state, p.pending_children), (JobState::WaitingChildren, 3));
    for _ in 0..2 {
        let l = lease_one(&jobs, "kids").expect("a kid");
        ok(&jobs, "kids", &l, "1");
    }
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::WaitingChildren), "c is still pending");
    let c = lease_one(&jobs, "kids").expect("kid c");
    assert_eq!(c.job.id, "c");
    ok(&jobs, "kids", &c, "1");
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::Waiting));
}

#[test]
fn remove_refuses_a_leased_job_and_takes_children_along() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::Wait);
    let a = lease_one(&jobs, "kids").unwrap();
    let refused = jobs.admin("ns", "parents", |tx, q| admin::remove_job(tx, q, "p", true)).wait().unwrap();
    assert!(!refused, "a leased child keeps its parent");
    ok(&jobs, "kids", &a, "1");
    let removed = jobs.admin("ns", "parents", |tx, q| admin::remove_job(tx, q, "p", true)).wait().unwrap();
    assert!(removed);
    assert_eq!(
        (state(&jobs, "parents", "p"), state(&jobs, "kids", "a"), state(&jobs, "kids", "b")),
        (None, None, None)
    );
    assert!(
        events(&jobs, "parents")
            .iter()
            .any(|(n, f)| n == "removed" && f.contains(&("prev".into(), "waiting-children".into())))
    );
}

/// Redis keeps `wait` as a list, newest first: a clean with a limit takes the
/// oldest jobs, and answers newest first, as the list holds them.
#[test]
fn clean_of_waiting_jobs_takes_the_oldest_and_answers_newest_first() {
    let (jobs, clock) = core();
    for i in 1..=5 {
        jobs.enqueue("ns", "q", job(&format!("w{i}"))).wait().unwrap();
    }
    clock.advance(1000);
    let now = clock.now_ms();
    let two = jobs.admin("ns", "q", move |tx, q| admin::clean(tx, q, "wait", now, 2)).wait().unwrap();
    assert_eq!(two, ["2", "1"]);
    let rest = jobs.admin("ns", "q", move |tx, q| admin::clean(tx, q, "wait", now, 0)).wait().unwrap();
    assert_eq!(rest, ["5", "4", "3"]);
}

/// The chunked admin writes take at most `MAX_JOBS_PER_CHUNK` jobs a call,
/// whatever count they are given, and say that more remain: one call over a
/// large queue would hold every other write behind its transaction. BullMQ
/// calls again while more remain.
#[test]
fn chunked_admin_writes_stop_at_the_chunk_and_say_more_remain() {
    let (jobs, _) = core();
    let total = admin::MAX_JOBS_PER_CHUNK + 5;
    let delayed = (0..total).map(|i| EnqueueRequest { delay_ms: 60_000, ..job(&format!("j{i}")) }).collect();
    jobs.enqueue_bulk("ns", "q", delayed, None).wait().unwrap();
    assert!(jobs.admin("ns", "q", |tx, q| admin::promote_jobs(tx, q, u64::MAX)).wait().unwrap(), "more remain");
    assert_eq!(jobs.counts("ns", "q", &[JobState::Delayed]).unwrap(), vec![5]);
    assert!(!jobs.admin("ns", "q", |tx, q| admin::promote_jobs(tx, q, u64::MAX)).wait().unwrap());
    jobs.admin("ns", "q", |tx, q| admin::set_paused(tx, q, true)).wait().unwrap();
    assert!(jobs.admin("ns", "q", |tx, q| admin::obliterate(tx, q, true, u64::MAX)).wait().unwrap(), "more remain");
    assert!(!jobs.admin("ns", "q", |tx, q| admin::obliterate(tx, q, true, u64::MAX)).wait().unwrap());
    assert!(jobs.query("ns", "q", |tx, _| query::queues(tx, "ns")).unwrap().is_empty());
}

#[test]
fn clean_drain_and_obliterate() {
    let (jobs, clock) = core();
    for i in 0..4 {
        jobs.enqueue("ns", "q", job(&format!("j{i}"))).wait().unwrap();
    }
    for _ in 0..2 {
        let l = lease_one(&jobs, "q").unwrap();
        ok(&jobs, "q", &l, "1");
    }
    clock.advance(1000);
    let cleaned = jobs.admin("ns", "q", |tx, q| admin::clean(tx, q, "completed", tx.now - 500, 0)).wait().unwrap();
    assert_eq!(cleaned, ["1", "2"]);
    assert!(events(&jobs, "q").iter().any(|(n, f)| n == "cleaned" && f == &[("count".to_string(), "2".to_string())]));
    jobs.enqueue("ns", "q", EnqueueRequest { delay_ms: 100, ..job("later") }).wait().unwrap();
    assert_eq!(jobs.admin("ns", "q", |tx, q| admin::drain(tx, q, false)).wait().unwrap(), 2);
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting, JobState::Delayed]).unwrap(), vec![0, 1]);
    let unpaused = jobs.admin("ns", "q", |tx, q| admin::obliterate(tx, q, false, 100)).wait();
    assert!(matches!(unpaused, Err(JobsError::Precondition(Precondition::QueueNotPaused { .. }))));
    jobs.admin("ns", "q", |tx, q| admin::set_paused(tx, q, true)).wait().unwrap();
    let cursor = jobs.query("ns", "q", query::last_event_seq).unwrap();
    assert!(!jobs.admin("ns", "q", |tx, q| admin::obliterate(tx, q, false, 100)).wait().unwrap());
    assert_eq!(jobs.counts("ns", "q", &[JobState::Delayed]).unwrap(), vec![0]);
    assert!(jobs.query("ns", "q", |tx, _| query::queues(tx, "ns")).unwrap().is_empty());
    assert!(events(&jobs, "q").is_empty());
    // A queue made again under the name numbers its jobs from 1, and its
    // events go on from the last one: a reader's cursor from before sees them.
    assert_eq!(jobs.enqueue("ns", "q", job("again")).wait().unwrap().id, "1");
    let seen = jobs.read_events_blocking("ns", "q", Some(cursor), 100, Duration::ZERO).unwrap();
    assert_eq!(
        seen.iter().map(|e| (e.seq, e.name.as_str())).collect::<Vec<_>>(),
        [(cursor + 1, "added"), (cursor + 2, "waiting")]
    );
}

#[test]
fn retention_by_age_removes_old_finished_jobs() {
    let (jobs, clock) = core();
    let keep = Retention::Keep(Keep { age_ms: Some(1000), ..Default::default() });
    for i in 0..3 {
        jobs.enqueue("ns", "q", EnqueueRequest { remove_on_complete: Some(keep), ..job(&format!("j{i}")) })
            .wait()
            .unwrap();
        let l = lease_one(&jobs, "q").unwrap();
        ok(&jobs, "q", &l, "1");
        clock.advance(600);
    }
    // Finished at t, t+600, t+1200; the third completion (now t+1200) drops the one older than 1000 ms.
    let kept = jobs.query("ns", "q", |tx, q| query::range(tx, q, JobState::Completed, 0, -1, true)).unwrap();
    assert_eq!(kept, ["2", "3"]);
}

/// Past its `limit`, the removal by age takes the newest expired jobs first
/// and leaves the oldest for a later finish, as Redis's does (a reverse range
/// of the expired ones); a `count` then trims the oldest of what it left.
#[test]
fn retention_by_age_with_a_limit_removes_the_newest_expired_first_then_the_count_the_oldest() {
    for (state, count, kept) in [
        (JobState::Completed, None, ["1", "2", "4"].as_slice()),
        (JobState::Failed, None, &["1", "2", "4"]),
        (JobState::Completed, Some(2), &["2", "4"]),
        (JobState::Failed, Some(2), &["2", "4"]),
    ] {
        let (jobs, clock) = core();
        let keep = Retention::Keep(Keep { age_ms: Some(1000), limit: Some(1), count });
        let end = |l: &Lease| if state == JobState::Completed { ok(&jobs, "q", l, "1") } else { fail(&jobs, "q", l) };
        for i in 0..4 {
            if i == 3 {
                clock.advance(1100);
            }
            let request =
                EnqueueRequest { remove_on_complete: Some(keep), remove_on_fail: Some(keep), ..job(&format!("j{i}")) };
            jobs.enqueue("ns", "q", request).wait().unwrap();
            end(&lease_one(&jobs, "q").unwrap());
            clock.advance(10);
        }
        let left = jobs.query("ns", "q", |tx, q| query::range(tx, q, state, 0, -1, true)).unwrap();
        assert_eq!(left, kept, "{state:?}, count {count:?}");
    }
}

/// An age of 0 keeps no finished job, the one finishing included, as Redis
/// removes every job finished at or before now; a limit of 0 removes none.
#[test]
fn retention_by_an_age_of_0_removes_the_job_as_it_finishes_and_those_before() {
    let (jobs, clock) = core();
    for state in [JobState::Completed, JobState::Failed] {
        let end = |l: &Lease| if state == JobState::Completed { ok(&jobs, "q", l, "1") } else { fail(&jobs, "q", l) };
        let kept_before = jobs.enqueue("ns", "q", job("kept")).wait().unwrap().id;
        end(&lease_one(&jobs, "q").unwrap());
        clock.advance(10);
        let keep = |limit| Retention::Keep(Keep { age_ms: Some(0), limit, ..Default::default() });
        let none =
            EnqueueRequest { remove_on_complete: Some(keep(Some(0))), remove_on_fail: Some(keep(Some(0))), ..job("j") };
        let id = jobs.enqueue("ns", "q", none).wait().unwrap().id;
        end(&lease_one(&jobs, "q").unwrap());
        assert_eq!(jobs.counts("ns", "q", &[state]).unwrap(), vec![2], "{state:?}: a limit of 0 removes none");
        clock.advance(10);
        let all = EnqueueRequest { remove_on_complete: Some(keep(None)), remove_on_fail: Some(keep(None)), ..job("j") };
        let last = jobs.enqueue("ns", "q", all).wait().unwrap().id;
        end(&lease_one(&jobs, "q").unwrap());
        for gone in [&kept_before, &id, &last] {
            assert!(jobs.get_job("ns", "q", gone).unwrap().is_none(), "{state:?} {gone}");
        }
        assert_eq!(jobs.counts("ns", "q", &[state]).unwrap(), vec![0], "{state:?}");
    }
}

/// BullMQ's `job.moveToDelayed(ts)` counts the delay from its own clock; a
/// server's clock is another (skewed, and read after the call's travel).
#[test]
fn a_job_moved_to_delayed_records_the_delay_its_caller_counted() {
    let (jobs, clock) = core();
    for (id, delay_ms, recorded) in [("given", Some(5_000), 5_000), ("counted", None, 4_990)] {
        jobs.enqueue("ns", "q", EnqueueRequest { job_id: Some(id.into()), ..job(id) }).wait().unwrap();
        let l = lease_one(&jobs, "q").unwrap();
        // The caller's clock read 10 ms before the store's.
        let until = clock.now_ms() - 10 + 5_000;
        finish(&jobs, "q", &l, Outcome::Delay { until, delay_ms }).unwrap();
        let job = jobs.get_job("ns", "q", id).unwrap().unwrap();
        assert_eq!((job.state, job.delay, job.due), (JobState::Delayed, recorded, until), "{id}");
    }
}

/// Delayed jobs due in the same millisecond run in the order they were
/// added, a LIFO one among them too, as Redis's delayed set orders them.
#[test]
fn delayed_jobs_due_together_keep_their_order_lifo_or_not() {
    let (jobs, clock) = core();
    for (name, lifo) in [("d1", false), ("d2", true), ("d3", false)] {
        jobs.enqueue("ns", "q", EnqueueRequest { delay_ms: 1000, lifo, ..job(name) }).wait().unwrap();
    }
    let delayed = jobs.query("ns", "q", |tx, q| query::range(tx, q, JobState::Delayed, 0, -1, true)).unwrap();
    assert_eq!(delayed, ["1", "2", "3"]);
    clock.advance(1000);
    assert_eq!(leased_names(&jobs, "q", 3), ["d1", "d2", "d3"]);
}

#[test]
fn an_expired_job_is_failed_instead_of_leased() {
    let (jobs, clock) = core();
    let expires = jobs.now_ms() + 100;
    jobs.enqueue("ns", "q", EnqueueRequest { expires: Some(expires), ..job("a") }).wait().unwrap();
    clock.advance(100);
    assert!(lease_one(&jobs, "q").is_none());
    let j = jobs.get_job("ns", "q", "1").unwrap().unwrap();
    assert_eq!((j.state, j.failed_reason.as_deref()), (JobState::Failed, Some("job expired before it started")));
}

#[test]
fn a_hard_timeout_caps_the_lease_and_fails_the_attempt() {
    let (jobs, clock) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { timeout_ms: Some(5_000), attempts: 2, ..job("a") }).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    // The lease itself (30 s by default) ends at the timeout, unextended.
    assert_eq!(l.deadline, l.job.processed_on.unwrap() + 5_000, "the lease never passes the timeout");
    let deadline = jobs.extend("ns", "q", "1", Fence::Epoch(l.epoch), 60_000).wait().unwrap();
    assert_eq!(deadline, l.job.processed_on.unwrap() + 5_000, "extend never passes the timeout");
    clock.advance(5_000);
    assert!(matches!(
        jobs.extend("ns", "q", "1", Fence::Epoch(l.epoch), 1_000).wait(),
        Err(JobsError::DeadlineExceeded)
    ));
    clock.advance(1);
    jobs.sweep_stalled("ns", "q").wait().unwrap();
    let j = jobs.get_job("ns", "q", "1").unwrap().unwrap();
    assert_eq!((j.state, j.attempts_made, j.failed_reason.as_deref()), (JobState::Waiting, 1, Some("timeout")));
}

/// A lock extended by 0 ms would be released at once, and a `remove` could
/// then take the job its worker is still processing: refused, lock kept.
#[test]
fn a_lock_is_not_extended_by_zero_ms() {
    let (jobs, clock) = core();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    let by_zero = jobs.extend("ns", "q", "1", Fence::Epoch(l.epoch), 0).wait();
    assert!(matches!(by_zero, Err(JobsError::InvalidArgument(_))), "{by_zero:?}");
    let many = jobs.extend_many("ns", "q", vec![("1".into(), Fence::Epoch(l.epoch))], 0).wait();
    assert!(matches!(many, Err(JobsError::InvalidArgument(_))), "{many:?}");
    clock.advance(1);
    let removed = jobs.admin("ns", "q", |tx, q| admin::remove_job(tx, q, "1", false)).wait().unwrap();
    assert!(!removed, "the lock still holds");
    ok(&jobs, "q", &l, "1");
    assert_eq!(state(&jobs, "q", "1"), Some(JobState::Completed));
}

#[test]
fn retried_finished_jobs_leave_their_finished_index() {
    let (jobs, _) = core();
    for i in 0..3 {
        jobs.enqueue("ns", "q", job(&format!("j{i}"))).wait().unwrap();
        let l = lease_one(&jobs, "q").unwrap();
        fail(&jobs, "q", &l);
    }
    let more =
        jobs.admin("ns", "q", |tx, q| admin::retry_finished_jobs(tx, q, JobState::Failed, 2, u64::MAX)).wait().unwrap();
    assert!(more);
    let rest =
        jobs.admin("ns", "q", |tx, q| admin::retry_finished_jobs(tx, q, JobState::Failed, 2, u64::MAX)).wait().unwrap();
    assert!(!rest);
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting, JobState::Failed]).unwrap(), vec![3, 0]);
    let failed_index = jobs.query("ns", "q", |tx, q| query::range(tx, q, JobState::Failed, 0, -1, true)).unwrap();
    assert!(failed_index.is_empty());
    let l = lease_one(&jobs, "q").unwrap();
    fail(&jobs, "q", &l);
    jobs.admin("ns", "q", move |tx, q| admin::retry_finished(tx, q, "1", JobState::Failed, false, false))
        .wait()
        .unwrap();
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting, JobState::Failed]).unwrap(), vec![3, 0]);
}

#[test]
fn operations_can_run_at_the_callers_time() {
    let (jobs, _) = core();
    let at = jobs.at(1_486_439_000_000);
    at.enqueue("ns", "q", job("a")).wait().unwrap();
    assert_eq!(jobs.get_job("ns", "q", "1").unwrap().unwrap().timestamp, 1_486_439_000_000);
    let l = at
        .lease("ns", "q", LeaseRequest { lock_duration_ms: 1000, ..Default::default() })
        .wait()
        .unwrap()
        .leases
        .remove(0);
    assert_eq!(l.job.processed_on, Some(1_486_439_000_000), "job times follow the caller");
    assert_eq!(l.deadline, jobs.now_ms() + 1000, "lease deadlines follow the core's lease clock, like a Redis TTL");
}

/// A rate-limit window and a deduplication ttl, Redis key TTLs, run in the
/// core's own time whatever the caller's time: a caller whose clock was faked
/// a day ahead and then put back is not limited, or deduplicated, for that day.
#[test]
fn rate_limit_windows_and_dedup_ttls_run_in_the_cores_time() {
    let (jobs, clock) = core();
    let ahead = jobs.at(clock.now_ms() + 86_400_000);
    let limited = LeaseRequest { limiter: Some(RateLimit { max: 1, duration_ms: 1000 }), ..Default::default() };
    for name in ["a", "b"] {
        jobs.enqueue("ns", "q", job(name)).wait().unwrap();
    }
    let first = ahead.lease("ns", "q", limited.clone()).wait().unwrap();
    assert_eq!(first.leases.len(), 1);
    let held = jobs.lease("ns", "q", limited.clone()).wait().unwrap();
    assert!(held.leases.is_empty() && held.info.rate_limit_ms <= 1000, "{:?}", held.info);
    clock.advance(1001);
    assert_eq!(jobs.lease("ns", "q", limited).wait().unwrap().leases.len(), 1, "the window ended in the core's time");

    let d = Some(dedup("d", Some(500)));
    let one = ahead.enqueue("ns", "q", EnqueueRequest { dedup: d.clone(), ..job("c") }).wait().unwrap();
    clock.advance(501);
    let two = jobs.enqueue("ns", "q", EnqueueRequest { dedup: d, ..job("c") }).wait().unwrap();
    assert!(two.created && two.id != one.id, "the ttl ended in the core's time");
}

#[test]
fn a_removed_child_keeps_its_result_on_the_parent() {
    let (jobs, _) = core();
    family(&jobs, OnChildFailure::Wait);
    let a = lease_one(&jobs, "kids").unwrap();
    jobs.complete(
        "ns",
        "kids",
        "a",
        Fence::Epoch(a.epoch),
        Outcome::Ok { result: Some(b"1".to_vec()) },
        CompleteOptions { remove_on_complete: Some(Retention::RemoveImmediately), ..Default::default() },
    )
    .wait()
    .unwrap();
    assert_eq!(state(&jobs, "kids", "a"), None);
    let deps = jobs.query("ns", "parents", |tx, q| query::dependencies(tx, q, "p")).unwrap();
    assert!(deps.iter().any(|(k, d)| k == "bull:kids:a" && d.status == DependencyStatus::Processed));
}

#[test]
fn wait_children_can_wait_for_one_named_child() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { job_id: Some("p".into()), ..job("p") }).wait().unwrap();
    let p = lease_one(&jobs, "q").unwrap();
    jobs.enqueue("ns", "q", EnqueueRequest { job_id: Some("c".into()), parent: Some(parent("q", "p")), ..job("c") })
        .wait()
        .unwrap();
    let other = Outcome::WaitChildren { child: Some("bull:q:nope".into()) };
    assert!(!finish(&jobs, "q", &p, other).unwrap().moved, "not a pending child: the parent keeps running");
    let named = Outcome::WaitChildren { child: Some("bull:q:c".into()) };
    assert!(finish(&jobs, "q", &p, named).unwrap().moved);
    assert_eq!(state(&jobs, "q", "p"), Some(JobState::WaitingChildren));
}

#[test]
fn a_retry_without_an_error_keeps_the_jobs_error_fields() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { attempts: 3, ..job("a") }).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    finish(&jobs, "q", &l, Outcome::Retry { error: Some(JobError::new("first")), after_ms: Some(0) }).unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    finish(&jobs, "q", &l, Outcome::Retry { error: None, after_ms: Some(0) }).unwrap();
    let j = jobs.get_job("ns", "q", "1").unwrap().unwrap();
    assert_eq!((j.attempts_made, j.failed_reason.as_deref()), (2, Some("first")));
}

#[test]
fn removing_a_parent_removes_its_grandchildren_without_releasing_anything() {
    let (jobs, _) = core();
    let nodes = vec![
        FlowNode {
            queue: "parents".into(),
            request: EnqueueRequest { job_id: Some("p".into()), ..job("parent") },
            wait_children: true,
        },
        FlowNode {
            queue: "kids".into(),
            request: EnqueueRequest { job_id: Some("c".into()), parent: Some(parent("parents", "p")), ..job("c") },
            wait_children: true,
        },
        FlowNode {
            queue: "kids".into(),
            request: EnqueueRequest { job_id: Some("g".into()), parent: Some(parent("kids", "c")), ..job("g") },
            wait_children: false,
        },
    ];
    jobs.flow("ns", nodes).wait().unwrap();
    assert!(jobs.admin("ns", "parents", |tx, q| admin::remove_job(tx, q, "p", true)).wait().unwrap());
    for (q, id) in [("parents", "p"), ("kids", "c"), ("kids", "g")] {
        assert_eq!(state(&jobs, q, id), None, "{id} is gone");
    }
    // The middle job was never released to waiting on its way out.
    assert_eq!(jobs.counts("ns", "kids", &[JobState::Waiting, JobState::WaitingChildren]).unwrap(), vec![0, 0]);
}

/// BullMQ's FlowProducer.addBulk hands its trees level by level (every root,
/// then every root's children): Redis adds them in that order, in one MULTI.
#[test]
fn a_batch_of_flows_goes_in_as_one_write_in_its_nodes_order() {
    let (jobs, _) = core();
    let of_b2 = || Some(parent("q", "B2"));
    let nodes = vec![
        flow_node("q", "B1", None, false),
        flow_node("q", "B2", None, true),
        flow_node("q", "B3", None, false),
        flow_node("q", "bc", of_b2(), false),
        flow_node("q", "bd", of_b2(), false),
    ];
    let results = jobs.flows("ns", nodes).wait().unwrap();
    let ids: Vec<String> = results.into_iter().map(|r| r.unwrap().id).collect();
    assert_eq!(ids, ["B1", "B2", "B3", "bc", "bd"]);
    let added: Vec<String> = events(&jobs, "q")
        .into_iter()
        .filter(|(name, _)| name == "added")
        .filter_map(|(_, fields)| fields.into_iter().find(|(k, _)| k == "jobId").map(|(_, v)| v))
        .collect();
    assert_eq!(added, ["B1", "B2", "B3", "bc", "bd"]);
    assert_eq!(leased_names(&jobs, "q", 4), ["B1", "B3", "bc", "bd"]);
    assert_eq!(state(&jobs, "q", "B2"), Some(JobState::WaitingChildren));
}

#[test]
fn a_batch_of_flows_with_a_refused_tree_inserts_each_other_tree_on_its_own() {
    let (jobs, _) = core();
    let nodes = vec![
        FlowNode {
            queue: "q".into(),
            request: EnqueueRequest { job_id: Some("good".into()), ..job("good") },
            wait_children: false,
        },
        FlowNode {
            queue: "q".into(),
            request: EnqueueRequest {
                job_id: Some("orphan".into()),
                parent: Some(parent("q", "missing")),
                ..job("orphan")
            },
            wait_children: false,
        },
    ];
    let results = jobs.flows("ns", nodes).wait().unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0].as_ref().unwrap().id, "good");
    assert!(matches!(results[1], Err(JobsError::NotFound(_))), "{:?}", results[1]);
    assert_eq!(state(&jobs, "q", "good"), Some(JobState::Waiting));
    assert_eq!(state(&jobs, "q", "orphan"), None);
}

#[test]
fn an_expired_dedup_key_is_not_removed_and_no_longer_deduplicates() {
    let (jobs, clock) = core();
    let first =
        jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(dedup("d", Some(100))), ..job("a") }).wait().unwrap();
    clock.advance(101);
    let removed =
        jobs.admin("ns", "q", move |tx, q| admin::remove_dedup_key(tx, q, "d", Some(&first.id))).wait().unwrap();
    assert_eq!(removed, 0, "a key past its ttl is gone already");
}

#[test]
fn keep_last_if_active_holds_the_key_past_its_ttl_while_the_job_runs() {
    let (jobs, clock) = core();
    let d = keep_last(Some(200));
    let first = jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(d.clone()), ..job("a") }).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    clock.advance(300);
    let second = jobs.enqueue("ns", "q", EnqueueRequest { dedup: Some(d), ..job("a") }).wait().unwrap();
    assert!(!second.created);
    assert_eq!(second.id, first.id, "the running job still owns the key");
    ok(&jobs, "q", &l, "1");
    // The kept add runs once the first finished.
    assert!(lease_one(&jobs, "q").is_some());
}

/// BullMQ's `getJobCounts` names: a state (`wait` too), `repeat` for the job
/// schedulers, and `paused` (a list BullMQ 6 never fills) or an unknown name
/// for 0; both bindings answer through `counts_by_type`.
#[test]
fn job_counts_by_bullmq_type_name() {
    let (jobs, _) = core();
    for _ in 0..2 {
        jobs.enqueue("ns", "q", job("q")).wait().unwrap();
    }
    jobs.upsert_scheduler("ns", "q", every_scheduler(60_000)).wait().unwrap();
    let types: Vec<String> = ["wait", "waiting", "repeat", "paused", "bogus"].map(String::from).to_vec();
    let counts = jobs.query("ns", "q", |tx, q| query::counts_by_type(tx, q, &types, None)).unwrap();
    // The scheduler's first iteration waits too.
    assert_eq!(counts, vec![3, 3, 1, 0, 0]);
}

/// A worker's stalled check sets the queue's `max_stalled` to the worker's,
/// when it gives one, in the transaction of the sweep.
#[test]
fn a_workers_stalled_check_sets_the_queues_max_stalled() {
    let (jobs, _) = core();
    let max = |jobs: &Jobs| jobs.query("ns", "q", |tx, q| tx.queue_config(q)).unwrap().max_stalled;
    jobs.admin("ns", "q", |tx, q| lease::sweep_stalled_as_worker(tx, q, Some(4))).wait().unwrap();
    assert_eq!(max(&jobs), 4);
    jobs.admin("ns", "q", |tx, q| lease::sweep_stalled_as_worker(tx, q, None)).wait().unwrap();
    assert_eq!(max(&jobs), 4, "no worker setting leaves the queue's");
}

#[test]
fn a_replaced_every_iteration_keeps_the_scheduler_phase() {
    let (jobs, clock) = core();
    // 1 s past a 60 s boundary: the scheduler's phase (offset) is 1000.
    clock.set(60_000 * 1000 + 1000);
    jobs.upsert_scheduler("ns", "q", every_scheduler(60_000)).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    jobs.admin("ns", "q", {
        let id = l.job.id.clone();
        move |tx, q| schedule::advance(tx, q, "s", None, &id, &job("tick"))
    })
    .wait()
    .unwrap();
    clock.advance(1);
    jobs.upsert_scheduler("ns", "q", every_scheduler(120_000)).wait().unwrap();
    let rec = jobs.query("ns", "q", |tx, q| schedule::get(tx, q, "s")).unwrap().unwrap();
    assert_eq!(rec.offset_ms, Some(1000));
    assert_eq!(rec.every_ms, Some(120_000));
    // The replaced iteration went without a `removed` event, as on Redis.
    assert!(!event_names(&jobs, "q").contains(&"removed".to_string()), "{:?}", event_names(&jobs, "q"));
    let pending = jobs.counts("ns", "q", &[JobState::Waiting, JobState::Delayed]).unwrap();
    assert_eq!(pending.iter().sum::<u64>(), 1, "one iteration waits: {pending:?}");
}

/// BullMQ counts a scheduler's iterations toward `limit` from 1 at each upsert
/// (`repeat.count`, in JavaScript), while `ic` goes on; a server schedule,
/// upserted with no count, keeps counting its ticks.
#[test]
fn an_upsert_with_a_count_restarts_the_limit_and_one_without_keeps_it() {
    let (jobs, clock) = core();
    clock.set(1_000_000);
    let every = |count| SchedulerSpec {
        id: "s".into(),
        name: "tick".into(),
        every_ms: Some(1000),
        limit: Some(2),
        count,
        job: job("tick"),
        ..Default::default()
    };
    let run_and_advance = |jobs: &Jobs| {
        let l = lease_one(jobs, "q").expect("an iteration is due");
        let next = jobs
            .admin("ns", "q", {
                let id = l.job.id.clone();
                move |tx, q| schedule::advance(tx, q, "s", None, &id, &job("tick"))
            })
            .wait()
            .unwrap();
        ok(jobs, "q", &l, "1");
        next
    };
    let stored = |jobs: &Jobs| jobs.query("ns", "q", |tx, q| schedule::get(tx, q, "s")).unwrap().unwrap();
    jobs.upsert_scheduler("ns", "q", every(Some(1))).wait().unwrap();
    clock.advance(1000);
    assert!(run_and_advance(&jobs).is_some(), "iteration 2 of 2");
    clock.advance(1000);
    assert!(run_and_advance(&jobs).is_none(), "the limit is reached");
    // The iterations counted are the two added (BullMQ on Redis: 2), not the
    // tick past the limit.
    assert_eq!((stored(&jobs).iteration_count, stored(&jobs).repeat_count()), (2, 3));

    jobs.upsert_scheduler("ns", "q", every(Some(1))).wait().unwrap();
    let rec = stored(&jobs);
    assert_eq!((rec.iteration_count, rec.repeat_count()), (2, 1), "ic stays, the count restarts");
    let pending = jobs.get_job("ns", "q", &schedule::pending_iteration_id(&rec)).unwrap().unwrap();
    assert!(pending.opts.contains(r#""count":1"#), "{}", pending.opts);
    clock.advance(1000);
    assert!(run_and_advance(&jobs).is_some(), "two more runs after the upsert");

    // Upserted with no count, the scheduler keeps its count of 2: no third run.
    jobs.upsert_scheduler("ns", "q", every(None)).wait().unwrap();
    assert_eq!(stored(&jobs).repeat_count(), 2);
    clock.advance(1000);
    assert!(run_and_advance(&jobs).is_none());
}

#[test]
fn a_cron_upsert_onto_the_tick_of_a_running_iteration_adds_one_under_its_own_id() {
    // BullMQ's "updates scheduler and creates next iteration": the pending
    // iteration is promoted and runs, its worker schedules the tick after,
    // and the processor upserts the scheduler with new data while the clock
    // still says the running job's tick is next.
    let (jobs, clock) = core();
    let now = 1_000_000;
    clock.set(now);
    let tick = now + 10_000;
    let cron = |data: &str| SchedulerSpec {
        id: "s".into(),
        name: "tick".into(),
        pattern: Some("*/10 * * * * *".into()),
        next_millis: Some(tick),
        template_data: data.into(),
        job: job("tick"),
        ..Default::default()
    };
    let (first, delay) = jobs.upsert_scheduler("ns", "q", cron(r#"{"foo":"bar"}"#)).wait().unwrap().unwrap();
    assert_eq!((first.as_str(), delay), ("repeat:s:1010000", 10_000));
    jobs.admin("ns", "q", |tx, q| admin::promote(tx, q, "repeat:s:1010000")).wait().unwrap();
    let running = lease_one(&jobs, "q").unwrap();
    // What BullMQ's worker does with a scheduler's job it took.
    let advance = |producer: &str| {
        let producer = producer.to_string();
        jobs.admin("ns", "q", move |tx, q| schedule::advance(tx, q, "s", Some(tick + 10_000), &producer, &job("tick")))
            .wait()
            .unwrap()
    };
    assert_eq!(advance("repeat:s:1010000").as_deref(), Some("repeat:s:1020000"));

    let (id, delay) = jobs.upsert_scheduler("ns", "q", cron(r#"{"foo":"baz"}"#)).wait().unwrap().unwrap();
    assert_eq!((id.as_str(), delay), ("repeat:s:1010000:1", 10_000));
    assert_eq!(state(&jobs, "q", "repeat:s:1020000"), None, "the replaced iteration is removed");
    assert_eq!(state(&jobs, "q", "repeat:s:1010000"), Some(JobState::Active), "the running job is left alone");
    let pending = jobs.get_job("ns", "q", &id).unwrap().unwrap();
    assert_eq!((pending.state, pending.data.as_slice()), (JobState::Delayed, br#"{"foo":"baz"}"#.as_slice()));
    let rec = jobs.query("ns", "q", |tx, q| schedule::get(tx, q, "s")).unwrap().unwrap();
    assert_eq!((rec.next_millis, rec.iteration_count, rec.next_job_id.as_deref()), (tick, 2, Some(id.as_str())));

    // The running job finishes as itself; the new iteration, once it runs,
    // is the scheduler's producer and moves it on.
    ok(&jobs, "q", &running, "1");
    assert_eq!(state(&jobs, "q", "repeat:s:1010000"), Some(JobState::Completed));
    clock.set(tick);
    jobs.promote_due("ns", "q").wait().unwrap();
    let next = lease_one(&jobs, "q").unwrap();
    assert_eq!(next.job.id, id);
    assert_eq!(advance("repeat:s:1010000"), None, "the finished job of that tick no longer produces");
    assert_eq!(advance(&next.job.id).as_deref(), Some("repeat:s:1020000"));
}

#[test]
fn raising_or_removing_a_maxed_queues_concurrency_wakes_its_waiting_workers() {
    let (jobs, _) = core();
    let concurrency = |c: &str| BTreeMap::from([("concurrency".to_string(), c.to_string())]);
    jobs.set_meta("ns", "q", concurrency("1")).wait().unwrap();
    for name in ["a", "b", "c"] {
        jobs.enqueue("ns", "q", job(name)).wait().unwrap();
    }
    let _running = lease_one(&jobs, "q").unwrap();
    assert_wakes_a_waiting_worker(&jobs, "raising the concurrency", || {
        jobs.set_meta("ns", "q", concurrency("2")).wait().unwrap();
    });
    // Maxed again: the queue allows as many as run.
    assert!(lease_one(&jobs, "q").is_some());
    jobs.set_meta("ns", "q", concurrency("2")).wait().unwrap();
    assert_wakes_a_waiting_worker(&jobs, "removing the concurrency", || {
        let fields = vec!["concurrency".to_string()];
        jobs.admin("ns", "q", move |tx, q| admin::remove_meta_fields(tx, q, &fields)).wait().unwrap();
    });
}

#[test]
fn removing_the_rate_limit_key_wakes_waiting_workers() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    jobs.admin("ns", "q", |tx, q| admin::set_rate_limit(tx, q, 60_000)).wait().unwrap();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| jobs.lease_wait_blocking("ns", "q", LeaseRequest::default(), Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(50));
        let started = std::time::Instant::now();
        assert_eq!(jobs.admin("ns", "q", admin::remove_rate_limit_key).wait().unwrap(), 1);
        assert_eq!(waiter.join().unwrap().unwrap().leases.len(), 1);
        assert!(started.elapsed() < Duration::from_secs(2), "woken by the removal, not the timeout");
    });
}

/// Runs `change` while a worker waits up to 5 s for a job of queue "q", and
/// checks that it woke the worker (within 2 s, not by the timeout).
fn assert_wakes_a_waiting_worker(jobs: &Jobs, what: &str, change: impl FnOnce()) {
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            rt.block_on(jobs.wait_for_job("ns", "q", Duration::from_secs(5), None, None))
        });
        std::thread::sleep(Duration::from_millis(50));
        let started = std::time::Instant::now();
        change();
        assert_eq!(waiter.join().unwrap().unwrap(), Some(0), "{what}");
        assert!(started.elapsed() < Duration::from_secs(2), "woken by {what}, not the timeout");
    });
}

#[test]
fn a_job_leaving_active_wakes_workers_of_a_maxed_queue() {
    let (jobs, _) = core();
    jobs.set_meta("ns", "q", BTreeMap::from([("concurrency".to_string(), "1".to_string())])).wait().unwrap();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    jobs.enqueue("ns", "q", job("b")).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    assert_wakes_a_waiting_worker(&jobs, "the freed slot", || ok(&jobs, "q", &l, "1"));
}

/// A lease with the core's own token (`token` empty), as the server's and
/// Python's workers take them.
fn lease_default_token(jobs: &Jobs, q: &str, lock_ms: u64) -> Lease {
    let req = LeaseRequest { max: 1, lock_duration_ms: lock_ms, ..Default::default() };
    jobs.lease("ns", q, req).wait().unwrap().leases.pop().unwrap()
}

/// A worker may still complete after its lease expired, until the sweep
/// (docs/design.md, "Leases and fencing"). If the job was deleted meanwhile and another
/// added under its id, that worker's epoch and token must not fit the new
/// job's lease: ids come back by name (removal) and by counter (obliterate).
#[test]
fn a_lease_on_a_deleted_job_is_fenced_out_of_a_new_job_with_its_id() {
    let (jobs, clock) = core();
    let named = || EnqueueRequest { job_id: Some("order-1".into()), ..job("a") };
    jobs.enqueue("ns", "q", named()).wait().unwrap();
    let old = lease_default_token(&jobs, "q", 1_000);
    clock.advance(2_000);
    assert!(jobs.admin("ns", "q", |tx, q| admin::remove_job(tx, q, "order-1", false)).wait().unwrap());
    jobs.enqueue("ns", "q", named()).wait().unwrap();
    let new = lease_default_token(&jobs, "q", 60_000);
    assert!(
        new.epoch > old.epoch && new.token != old.token,
        "{} {} / {} {}",
        old.epoch,
        old.token,
        new.epoch,
        new.token
    );
    for fence in [Fence::Epoch(old.epoch), Fence::Token(old.token.clone())] {
        let late = jobs.complete("ns", "q", "order-1", fence, Outcome::Ok { result: None }, CompleteOptions::default());
        assert!(matches!(late.wait(), Err(JobsError::Fenced { .. })));
    }

    // Obliterated with `force` while leased: the counters start over, ids from 1.
    let first = jobs.enqueue("ns", "o", job("a")).wait().unwrap();
    let old = lease_default_token(&jobs, "o", 60_000);
    jobs.admin("ns", "o", |tx, q| admin::set_paused(tx, q, true)).wait().unwrap();
    while jobs.admin("ns", "o", |tx, q| admin::obliterate(tx, q, true, 1)).wait().unwrap() {}
    let again = jobs.enqueue("ns", "o", job("b")).wait().unwrap();
    assert_eq!(again.id, first.id);
    let new = lease_default_token(&jobs, "o", 60_000);
    assert!(new.epoch > old.epoch && new.token != old.token);
    let late = jobs.complete(
        "ns",
        "o",
        &again.id,
        Fence::Epoch(old.epoch),
        Outcome::Ok { result: None },
        CompleteOptions::default(),
    );
    assert!(matches!(late.wait(), Err(JobsError::Fenced { .. })));
    let done = finish(&jobs, "o", &new, Outcome::Ok { result: None }).unwrap();
    assert_eq!(done.state, Some(JobState::Completed));
}

/// Re-adding a job under its id with a parent adopts it; a parent that is
/// the job itself or below it would close a cycle, which is refused. A
/// removal with children then ends (it walked a cycle forever and overflowed
/// the writer thread's stack).
#[test]
fn a_job_cannot_be_adopted_by_itself_or_its_descendant() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { job_id: Some("x".into()), ..job("x") }).wait().unwrap();
    let own_child = EnqueueRequest { job_id: Some("x".into()), parent: Some(parent("q", "x")), ..job("x") };
    assert!(matches!(jobs.enqueue("ns", "q", own_child).wait(), Err(JobsError::InvalidArgument(_))));

    let tree = vec![
        flow_node("q", "p", None, true),
        flow_node("kids", "c", Some(parent("q", "p")), true),
        flow_node("kids", "g", Some(parent("kids", "c")), false),
    ];
    jobs.flow("ns", tree).wait().unwrap();
    let under_grandchild = EnqueueRequest { job_id: Some("p".into()), parent: Some(parent("kids", "g")), ..job("p") };
    assert!(matches!(jobs.enqueue("ns", "q", under_grandchild).wait(), Err(JobsError::InvalidArgument(_))));
    assert_eq!(jobs.get_job("ns", "kids", "g").unwrap().unwrap().pending_children, 0);

    assert!(jobs.admin("ns", "q", |tx, q| admin::remove_job(tx, q, "x", true)).wait().unwrap());
    assert!(jobs.admin("ns", "q", |tx, q| admin::remove_job(tx, q, "p", true)).wait().unwrap());
    assert_eq!(state(&jobs, "kids", "c"), None);
    assert_eq!(state(&jobs, "kids", "g"), None);
}

/// Obliterating a queue takes its jobs out of their parents' pending
/// children, as on Redis: a parent in another queue does not wait forever.
#[test]
fn obliterating_a_childs_queue_releases_its_parent_in_another_queue() {
    let (jobs, _) = core();
    let tree = vec![flow_node("parents", "p", None, true), flow_node("kids", "c", Some(parent("parents", "p")), false)];
    jobs.flow("ns", tree).wait().unwrap();
    jobs.admin("ns", "kids", |tx, q| admin::set_paused(tx, q, true)).wait().unwrap();
    while jobs.admin("ns", "kids", |tx, q| admin::obliterate(tx, q, false, 100)).wait().unwrap() {}
    let p = jobs.get_job("ns", "parents", "p").unwrap().unwrap();
    assert_eq!((p.state, p.pending_children), (JobState::Waiting, 0));
    assert_eq!(lease_one(&jobs, "parents").unwrap().job.id, "p");
}

/// addBulk runs its items in one transaction: an item refused (here for a
/// missing parent) must not have done part of its work, such as replacing
/// the delayed job its debounce key holds.
#[test]
fn a_refused_bulk_item_leaves_nothing_behind() {
    let (jobs, _) = core();
    let debounce = Dedup { id: "d".into(), ttl_ms: Some(60_000), replace: true, extend: true, ..Default::default() };
    let kept = EnqueueRequest { delay_ms: 10_000, dedup: Some(debounce.clone()), ..job("first") };
    let kept = jobs.enqueue("ns", "q", kept).wait().unwrap().id;
    let refused = EnqueueRequest {
        delay_ms: 10_000,
        dedup: Some(debounce),
        parent: Some(parent("nowhere", "missing")),
        ..job("second")
    };
    let results = jobs.enqueue_bulk("ns", "q", vec![refused, job("third")], None).wait().unwrap();
    assert!(matches!(results[0], Err(JobsError::NotFound(_))), "{results:?}");
    assert!(results[1].is_ok());
    assert_eq!(state(&jobs, "q", &kept), Some(JobState::Delayed), "the acknowledged job was replaced by a refused add");
    assert_eq!(jobs.counts("ns", "q", &[JobState::Delayed, JobState::Waiting]).unwrap(), [1, 1]);
}

/// Cleaning waiting-children removes a parent whose last child it removed
/// (BullMQ's hard removal); the parent, further on in the same scan, is
/// then skipped instead of failing the clean.
#[test]
fn clean_passes_over_a_parent_it_removed_with_its_last_child() {
    let (jobs, clock) = core();
    let first = vec![flow_node("q", "c", None, true), flow_node("other", "g", Some(parent("q", "c")), false)];
    jobs.flow("ns", first).wait().unwrap();
    clock.advance(10);
    let second = vec![flow_node("q", "p", None, true), flow_node("q", "c", Some(parent("q", "p")), false)];
    jobs.flow("ns", second).wait().unwrap();
    let now = clock.now_ms();
    let cleaned = jobs.admin("ns", "q", move |tx, q| admin::clean(tx, q, "waiting-children", now, 0)).wait().unwrap();
    assert_eq!(cleaned, ["c"]);
    assert_eq!((state(&jobs, "q", "c"), state(&jobs, "q", "p")), (None, None));
}

/// Times and durations a caller may give as "forever" (u64::MAX) saturate
/// instead of wrapping past the clock: the key keeps its job, the lease does
/// not expire at once, and a wait beside a job due at the end of time ends.
#[test]
fn ttls_and_durations_past_the_end_of_the_clock_saturate() {
    let (jobs, clock) = core();
    let keyed =
        || EnqueueRequest { idempotency: Some(Idempotency { key: "k".into(), ttl_ms: Some(u64::MAX) }), ..job("a") };
    let first = jobs.enqueue("ns", "q", keyed()).wait().unwrap();
    let again = jobs.enqueue("ns", "q", keyed()).wait().unwrap();
    assert_eq!((again.id, again.created), (first.id, false));

    let held = lease_default_token(&jobs, "q", u64::MAX);
    clock.advance(3_600_000);
    assert!(jobs.sweep_stalled("ns", "q").wait().unwrap().is_empty());
    assert!(held.deadline > clock.now_ms());

    jobs.enqueue("ns", "late", EnqueueRequest { delay_ms: u64::MAX, ..job("never") }).wait().unwrap();
    let req = LeaseRequest { max: 1, ..Default::default() };
    let got = jobs.at(clock.now_ms()).lease_wait_blocking("ns", "late", req, Duration::from_millis(20)).unwrap();
    assert!(got.leases.is_empty());
}

/// Listing schedulers takes any range, as BullMQ's getJobSchedulers(start,
/// end) passes it through: the extremes of i64 neither overflow nor panic.
#[test]
fn schedulers_list_by_any_range() {
    let (jobs, _) = core();
    for id in ["a", "b"] {
        let spec = SchedulerSpec {
            id: id.into(),
            name: "tick".into(),
            every_ms: Some(1000),
            job: job("tick"),
            ..Default::default()
        };
        jobs.upsert_scheduler("ns", "q", spec).wait().unwrap();
    }
    let list = |start, end| jobs.query("ns", "q", move |tx, q| schedule::list(tx, q, start, end, true)).unwrap().len();
    assert_eq!(list(i64::MIN, i64::MAX), 2);
    assert_eq!(list(0, -1), 2);
    assert_eq!(list(i64::MAX, i64::MIN), 0);
    assert_eq!(list(-1, i64::MAX), 1);
}

/// Polls until `cond` holds, for up to two seconds.
fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let until = std::time::Instant::now() + Duration::from_secs(2);
    while std::time::Instant::now() < until {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    cond()
}

/// A lease whose caller went away before taking the result (a cancelled
/// call, a dropped long-poll) still committed; its jobs go back to the front
/// of the queue at once, without a stall counted, instead of waiting out the
/// lock.
#[test]
fn jobs_of_a_lease_nobody_took_go_back_at_once() {
    let (jobs, _) = core();
    for name in ["a", "b"] {
        jobs.enqueue("ns", "q", job(name)).wait().unwrap();
    }
    drop(jobs.lease("ns", "q", LeaseRequest { max: 1, lock_duration_ms: 600_000, ..Default::default() }));
    // The lease commits after the drop: its `active` event, then the job back.
    let back = eventually(|| {
        event_names(&jobs, "q").contains(&"active".to_string())
            && jobs.counts("ns", "q", &[JobState::Active, JobState::Waiting]).unwrap() == [0, 2]
    });
    assert!(back, "still leased: {:?}", jobs.counts("ns", "q", &[JobState::Active, JobState::Waiting]));
    let again = lease_one(&jobs, "q").unwrap();
    assert_eq!((again.job.name.as_str(), again.job.stalled_counter), ("a", 0));

    // Taken, it stays leased.
    let taken = jobs.lease("ns", "q", LeaseRequest { max: 1, ..Default::default() }).wait().unwrap();
    assert_eq!(taken.leases.len(), 1);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(jobs.counts("ns", "q", &[JobState::Active]).unwrap(), [2]);
}

/// A queue's dead-letter queue must be a name calls can reach; a job whose
/// failure would go to one they cannot is not failed out of sight.
#[test]
fn a_dead_letter_queue_must_be_a_name_calls_can_reach() {
    let (jobs, _) = core();
    for bad in [String::new(), "x".repeat(2000)] {
        let config = QueueConfig {
            dead_letter_queue: Some(bad),
            dead_letter_on_exhausted: true,
            ..QueueConfig::defaults(&Config::default())
        };
        assert!(matches!(jobs.set_queue_config("ns", "q", config).wait(), Err(JobsError::InvalidArgument(_))));
    }
    let config = QueueConfig {
        dead_letter_queue: Some("dead".into()),
        dead_letter_on_exhausted: true,
        ..QueueConfig::defaults(&Config::default())
    };
    jobs.set_queue_config("ns", "q", config).wait().unwrap();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    fail(&jobs, "q", &l);
    assert_eq!(jobs.counts("ns", "dead", &[JobState::Waiting]).unwrap(), [1]);
}

/// An outcome that ends an attempt says which task ran and for how long
/// (job time, from the lease), for run-time metrics; one that only parks
/// the job says nothing.
#[test]
fn an_outcome_that_ends_an_attempt_says_how_long_it_ran() {
    let (jobs, clock) = core();
    for name in ["resize", "resize"] {
        jobs.enqueue("ns", "q", job(name)).wait().unwrap();
    }
    let first = lease_one(&jobs, "q").unwrap();
    clock.advance(250);
    let done = finish(&jobs, "q", &first, Outcome::Ok { result: None }).unwrap();
    assert_eq!(done.attempt, Some(AttemptRun { task: "resize".into(), ran_ms: 250 }));
    let second = lease_one(&jobs, "q").unwrap();
    let parked = finish(&jobs, "q", &second, Outcome::Release { after_ms: None }).unwrap();
    assert_eq!(parked.attempt, None);
}

/// Redis's promote-9.lua moves the job to wait and moveToActive sets
/// processedOn to the caller's timestamp: a caller whose clock is behind the
/// core's (a remote worker's) promotes by hand and leases, and the job must
/// not show as started in that caller's future.
#[test]
fn a_job_promoted_by_hand_starts_at_its_callers_time() {
    let (jobs, clock) = core();
    let core_now = clock.now_ms();
    let behind = jobs.at(core_now - 1_000);
    let id = behind.enqueue("ns", "q", EnqueueRequest { delay_ms: 10_000, ..job("promoted") }).wait().unwrap().id;
    let promoted = id.clone();
    behind.admin("ns", "q", move |tx, q| admin::promote(tx, q, &promoted)).wait().unwrap();
    let l = lease_one(&behind, "q").expect("the promoted job is leased");
    assert_eq!(l.job.id, id);
    assert_eq!(l.job.processed_on, Some(core_now - 1_000), "started at the caller's time, as moveToActive sets it");
}

/// Redis's promotions (promoteDelayedJobs, promote-9.lua) LPUSH every job
/// without a priority, LIFO or not: a LIFO job that falls due goes behind the
/// jobs already waiting, and so does one promoted by hand.
#[test]
fn a_promoted_lifo_job_goes_behind_the_waiting_jobs() {
    let (jobs, clock) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { lifo: true, delay_ms: 100, ..job("lifo-due") }).wait().unwrap();
    let by_hand = jobs.enqueue("ns", "q", EnqueueRequest { lifo: true, delay_ms: 60_000, ..job("lifo-by-hand") });
    let by_hand = by_hand.wait().unwrap().id;
    jobs.enqueue("ns", "q", job("fifo")).wait().unwrap();
    jobs.admin("ns", "q", move |tx, q| admin::promote(tx, q, &by_hand)).wait().unwrap();
    clock.advance(100);
    assert_eq!(leased_names(&jobs, "q", 3), ["fifo", "lifo-by-hand", "lifo-due"]);
}

/// BullMQ's addJob files a job with a priority by its priority alone, LIFO
/// or not (many apps set `lifo` in `defaultJobOptions`): it is accepted and
/// runs FIFO within its priority, also when it is retried.
#[test]
fn a_prioritized_job_asked_for_lifo_runs_fifo_within_its_priority() {
    let (jobs, _) = core();
    for name in ["first", "second"] {
        let e = jobs.enqueue("ns", "q", EnqueueRequest { priority: 3, lifo: true, attempts: 2, ..job(name) });
        assert_eq!(e.wait().unwrap().state, JobState::Prioritized);
    }
    jobs.enqueue("ns", "q", EnqueueRequest { priority: 3, ..job("third") }).wait().unwrap();
    let first = lease_one(&jobs, "q").unwrap();
    assert_eq!(first.job.name, "first");
    let retry = Outcome::Retry { error: Some(JobError::new("boom")), after_ms: Some(0) };
    finish(&jobs, "q", &first, retry).unwrap(); // its second attempt goes to the back of its priority
    assert_eq!(leased_names(&jobs, "q", 3), ["second", "third", "first"]);
}

/// BullMQ's reprocessJob and moveJobsToWait delete only the field of the
/// state a job is retried from: a job that failed an attempt and then
/// completed keeps that attempt's reason when it is retried from completed.
#[test]
fn a_retried_completed_job_keeps_the_reason_an_earlier_attempt_failed_with() {
    let (jobs, _) = core();
    for name in ["one", "all"] {
        jobs.enqueue("ns", name, EnqueueRequest { attempts: 2, ..job(name) }).wait().unwrap();
        let l = lease_one(&jobs, name).unwrap();
        finish(&jobs, name, &l, Outcome::Retry { error: Some(JobError::new("boom")), after_ms: Some(0) }).unwrap();
        let l = lease_one(&jobs, name).unwrap();
        ok(&jobs, name, &l, "done");
    }
    jobs.admin("ns", "one", |tx, q| admin::retry_finished(tx, q, "1", JobState::Completed, false, false))
        .wait()
        .unwrap();
    jobs.admin("ns", "all", |tx, q| admin::retry_finished_jobs(tx, q, JobState::Completed, 10, u64::MAX))
        .wait()
        .unwrap();
    for name in ["one", "all"] {
        let j = jobs.get_job("ns", name, "1").unwrap().unwrap();
        assert_eq!((j.state, j.return_value, j.failed_reason.as_deref()), (JobState::Waiting, None, Some("boom")));
    }
}

/// A job is retried from completed or failed only: from active, the state
/// given matching, it would be requeued while its worker still holds it.
#[test]
fn a_job_is_retried_only_from_a_finished_state() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", job("q")).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    for from in [JobState::Active, JobState::Waiting] {
        let err = jobs
            .admin("ns", "q", move |tx, q| admin::retry_finished(tx, q, "1", from, false, false))
            .wait()
            .unwrap_err();
        assert!(matches!(err, JobsError::InvalidArgument(_)), "{err:?}");
    }
    assert_eq!(jobs.get_job("ns", "q", "1").unwrap().unwrap().state, JobState::Active);
    ok(&jobs, "q", &l, "done");
    jobs.admin("ns", "q", |tx, q| admin::retry_finished(tx, q, "1", JobState::Completed, false, false)).wait().unwrap();
    assert_eq!(jobs.get_job("ns", "q", "1").unwrap().unwrap().state, JobState::Waiting);
}

/// Redis's moveToFinished emits `drained` only when the fetch of the next job
/// found nothing and nothing to wait for: a delayed job still to come answers
/// the fetch instead (its due time), and a completion that fetches nothing
/// checks the lists alone.
#[test]
fn a_delayed_job_still_to_come_keeps_a_fetching_completion_from_draining() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { delay_ms: 60_000, ..job("later") }).wait().unwrap();
    jobs.enqueue("ns", "q", job("now")).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    let fetch = CompleteOptions {
        fetch_next: Some(LeaseRequest { max: 1, token: "w".into(), ..Default::default() }),
        ..Default::default()
    };
    let done =
        jobs.complete("ns", "q", &l.job.id, Fence::Epoch(l.epoch), Outcome::Ok { result: None }, fetch).wait().unwrap();
    assert!(done.next.is_some_and(|n| n.leases.is_empty() && n.info.next_due.is_some()));
    assert!(!event_names(&jobs, "q").contains(&"drained".to_string()), "the delayed job answered the fetch");

    jobs.enqueue("ns", "q", job("again")).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    ok(&jobs, "q", &l, "1");
    assert_eq!(event_names(&jobs, "q").last().map(String::as_str), Some("drained"), "no fetch: the lists alone");
}

/// BullMQ 6 keeps a paused queue's jobs in `wait`, and Redis's clean of
/// `paused` reads the old paused list, always empty: it removes nothing (and
/// says so with a `cleaned` event of count 0).
#[test]
fn cleaning_paused_removes_nothing_as_on_redis() {
    let (jobs, clock) = core();
    jobs.enqueue("ns", "q", job("a")).wait().unwrap();
    jobs.admin("ns", "q", |tx, q| admin::set_paused(tx, q, true)).wait().unwrap();
    clock.advance(10);
    let now = clock.now_ms();
    let cleaned = jobs.admin("ns", "q", move |tx, q| admin::clean(tx, q, "paused", now, 0)).wait().unwrap();
    assert!(cleaned.is_empty());
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting]).unwrap(), vec![1]);
    assert_eq!(event_names(&jobs, "q").last().map(String::as_str), Some("cleaned"));
}

/// Redis's add scripts `INCR` the id counter on every add, whatever id the
/// job ends up with (a custom one, a duplicate, a deduplicated add): auto
/// ids run on from there.
#[test]
fn every_add_takes_a_number_of_the_auto_id_counter_as_on_redis() {
    let (jobs, _) = core();
    let add = |req: EnqueueRequest| jobs.enqueue("ns", "q", req).wait().unwrap().id;
    assert_eq!(add(job("auto")), "1");
    add(EnqueueRequest { job_id: Some("custom".into()), ..job("custom") });
    add(EnqueueRequest { job_id: Some("custom".into()), ..job("custom") });
    add(EnqueueRequest { dedup: Some(dedup("d", None)), ..job("first") });
    add(EnqueueRequest { dedup: Some(dedup("d", None)), ..job("deduplicated") });
    assert_eq!(add(job("auto")), "6");
}

// ---- found in review: dedup keys that outlive their jobs, replaced flow children, stalled
// iterations of removed schedulers, a failing child's delayed parent, retention count ties

fn lease_for(jobs: &Jobs, q: &str, token: &str, lock_ms: u64) -> Option<Lease> {
    let req = LeaseRequest { max: 1, token: token.into(), lock_duration_ms: lock_ms, ..Default::default() };
    jobs.lease("ns", q, req).wait().unwrap().leases.pop()
}

/// Throttling (a ttl) with removeOnComplete, the usual pair: on Redis the
/// dedup key lives out its ttl whatever becomes of its job.
#[test]
fn a_throttle_holds_for_its_ttl_after_its_job_is_removed_on_completion() {
    let (jobs, clock) = core();
    let add = || EnqueueRequest {
        dedup: Some(dedup("d", Some(60_000))),
        remove_on_complete: Some(Retention::RemoveImmediately),
        ..job("a")
    };
    let first = jobs.enqueue("ns", "q", add()).wait().unwrap();
    let l = lease_one(&jobs, "q").unwrap();
    finish(&jobs, "q", &l, Outcome::Ok { result: None }).unwrap();
    assert!(jobs.get_job("ns", "q", &first.id).unwrap().is_none());
    let held = jobs.query("ns", "q", |tx, q| query::dedup_job_id(tx, q, "d")).unwrap();
    assert_eq!(held.as_deref(), Some(first.id.as_str()));
    let again = jobs.enqueue("ns", "q", add()).wait().unwrap();
    assert!(!again.created, "throttled within its ttl, but job {} was created", again.id);
    assert_eq!((again.id.as_str(), again.deduplicated_by.as_deref()), (first.id.as_str(), Some(first.id.as_str())));
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting]).unwrap(), [0]);
    assert!(event_names(&jobs, "q").ends_with(&["deduplicated".to_string()]));
    // Past the ttl the next add gets a job of its own.
    clock.advance(60_001);
    assert!(jobs.enqueue("ns", "q", add()).wait().unwrap().created);
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting]).unwrap(), [1]);
}

/// A key without a ttl goes with its job: one left behind by a job that is
/// gone no longer deduplicates (BullMQ's recoverStaleDeduplicationKey).
#[test]
fn a_simple_dedup_key_whose_job_is_gone_is_taken_by_the_next_add() {
    let (jobs, _) = core();
    let add = || EnqueueRequest { dedup: Some(dedup("d", None)), ..job("a") };
    let first = jobs.enqueue("ns", "q", add()).wait().unwrap();
    // The job's record gone without its key (as an outage leaves it on Redis).
    let id = first.id.clone();
    jobs.admin("ns", "q", move |tx, q| {
        let key = loam_jobs::keys::QueueKeys::new(q).job(&id);
        tx.delete(&key)
    })
    .wait()
    .unwrap();
    let again = jobs.enqueue("ns", "q", add()).wait().unwrap();
    assert!(again.created);
    let held = jobs.query("ns", "q", |tx, q| query::dedup_job_id(tx, q, "d")).unwrap();
    assert_eq!(held.as_deref(), Some(again.id.as_str()));
}

/// A debounced child (replace) replaced by a newer add for the same parent:
/// the parent waits on, for the replacement, instead of being released
/// between the removal and the add.
#[test]
fn a_debounced_child_replaced_under_the_same_parent_keeps_the_parent_waiting() {
    let (jobs, clock) = core();
    let d = Dedup { replace: true, ..dedup("d", Some(60_000)) };
    let child = |data: &[u8]| EnqueueRequest {
        parent: Some(parent("parents", "p")),
        dedup: Some(d.clone()),
        delay_ms: 10_000,
        data: data.to_vec(),
        ..job("c")
    };
    let nodes = vec![
        flow_node("parents", "p", None, true),
        FlowNode { queue: "kids".into(), request: child(b"1"), wait_children: false },
    ];
    jobs.flow("ns", nodes).wait().unwrap();
    let replacement = jobs.enqueue("ns", "kids", child(b"2")).wait().unwrap();
    assert!(replacement.created);
    assert_eq!(jobs.counts("ns", "kids", &[JobState::Delayed]).unwrap(), [1]);
    let p = jobs.get_job("ns", "parents", "p").unwrap().unwrap();
    assert_eq!((p.state, p.pending_children), (JobState::WaitingChildren, 1));
    assert!(lease_one(&jobs, "parents").is_none());
    // The replacement's end releases it.
    clock.advance(10_001);
    let l = lease_one(&jobs, "kids").unwrap();
    assert_eq!(l.job.id, replacement.id);
    ok(&jobs, "kids", &l, "2");
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::Waiting));
}

/// Replaced by an add under another parent (or none), the old child's parent
/// is released as by a removal.
#[test]
fn a_debounced_child_replaced_under_no_parent_releases_its_parent() {
    let (jobs, _) = core();
    let d = Dedup { replace: true, ..dedup("d", Some(60_000)) };
    let nodes = vec![
        flow_node("parents", "p", None, true),
        FlowNode {
            queue: "kids".into(),
            request: EnqueueRequest {
                parent: Some(parent("parents", "p")),
                dedup: Some(d.clone()),
                delay_ms: 10_000,
                ..job("c")
            },
            wait_children: false,
        },
    ];
    jobs.flow("ns", nodes).wait().unwrap();
    let orphan = EnqueueRequest { dedup: Some(d), delay_ms: 10_000, ..job("c") };
    assert!(jobs.enqueue("ns", "kids", orphan).wait().unwrap().created);
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::Waiting));
}

/// Scheduler `s`, adding a job `tick` every `ms`.
fn every_scheduler(ms: u64) -> SchedulerSpec {
    SchedulerSpec { id: "s".into(), name: "tick".into(), every_ms: Some(ms), job: job("tick"), ..Default::default() }
}

/// The first iteration of an hourly scheduler `s` in `q`, leased for a second.
fn hourly_iteration_leased(jobs: &Jobs) -> Lease {
    jobs.upsert_scheduler("ns", "q", every_scheduler(3_600_000)).wait().unwrap();
    lease_for(jobs, "q", "w1", 1_000).unwrap()
}

/// BullMQ exempts a stalled job from maxStalledCount only while its
/// scheduler exists: an iteration whose scheduler was removed while it ran
/// gets the stall limit like any job.
#[test]
fn an_iteration_of_a_removed_scheduler_is_not_exempt_from_max_stalled() {
    let (jobs, clock) = core();
    let first = hourly_iteration_leased(&jobs);
    assert!(jobs.admin("ns", "q", |tx, q| schedule::remove(tx, q, "s")).wait().unwrap());
    for round in 1..=2u32 {
        clock.advance(2_000);
        assert_eq!(jobs.sweep_stalled("ns", "q").wait().unwrap(), std::slice::from_ref(&first.job.id));
        let j = jobs.get_job("ns", "q", &first.job.id).unwrap().unwrap();
        assert_eq!(j.stalled_counter, round);
        if round == 1 {
            assert_eq!(j.deferred_failure, None);
            lease_for(&jobs, "q", "w2", 1_000).unwrap();
        } else {
            assert_eq!(j.deferred_failure.as_deref(), Some("job stalled more than allowable limit"));
        }
    }
}

/// An iteration of a scheduler that still exists stalls without limit.
#[test]
fn an_iteration_of_a_live_scheduler_is_exempt_from_max_stalled() {
    let (jobs, clock) = core();
    let first = hourly_iteration_leased(&jobs);
    for _ in 0..3 {
        clock.advance(2_000);
        assert_eq!(jobs.sweep_stalled("ns", "q").wait().unwrap(), std::slice::from_ref(&first.job.id));
        lease_for(&jobs, "q", "w", 1_000).unwrap();
    }
    let j = jobs.get_job("ns", "q", &first.job.id).unwrap().unwrap();
    assert_eq!((j.stalled_counter, j.deferred_failure), (3, None));
}

/// A schedule the server owns moves only by the server's `advance_to`: a
/// caller's `advance` (a BullMQ worker's, remote or in-process) leaves it;
/// a caller's scheduler of the same id takes it over, without the server's
/// marks.
#[test]
fn a_server_schedule_is_advanced_by_the_server_alone() {
    let (jobs, _) = core();
    jobs.upsert_scheduler("ns", "q", every_scheduler(1_000)).wait().unwrap();
    let marks = BTreeMap::from([
        (SERVER_OWNED.to_string(), "server".to_string()),
        ("loam.job".to_string(), "{}".to_string()),
        ("mine".to_string(), "kept".to_string()),
    ]);
    assert!(jobs.admin("ns", "q", move |tx, q| schedule::set_extra(tx, q, "s", marks.clone())).wait().unwrap());
    let stored = || jobs.query("ns", "q", |tx, q| schedule::get(tx, q, "s")).unwrap().unwrap();
    let first = stored();
    assert!(first.server_owned());
    let producer = schedule::pending_iteration_id(&first);
    let by_caller = {
        let producer = producer.clone();
        jobs.admin("ns", "q", move |tx, q| schedule::advance(tx, q, "s", None, &producer, &job("tick"))).wait().unwrap()
    };
    assert_eq!(by_caller, None);
    assert_eq!(stored().next_millis, first.next_millis);
    let tick = first.next_millis + 1_000;
    let by_server = jobs
        .admin("ns", "q", move |tx, q| schedule::advance_to(tx, q, "s", tick, &producer, &job("tick")))
        .wait()
        .unwrap();
    assert_eq!(by_server, Some(schedule::iteration_id("s", tick)));
    jobs.upsert_scheduler("ns", "q", every_scheduler(1_000)).wait().unwrap();
    let taken_over = stored();
    assert!(!taken_over.server_owned());
    assert_eq!(taken_over.extra, BTreeMap::from([("mine".to_string(), "kept".to_string())]));
    let producer = schedule::pending_iteration_id(&taken_over);
    // The server's ticker, which read the schedule before the takeover, no
    // longer moves it.
    let (tick, by_ticker) = (taken_over.next_millis + 1_000, producer.clone());
    let late_tick = jobs
        .admin("ns", "q", move |tx, q| schedule::advance_to(tx, q, "s", tick, &by_ticker, &job("tick")))
        .wait()
        .unwrap();
    assert_eq!(late_tick, None);
    let next = jobs
        .admin("ns", "q", move |tx, q| schedule::advance(tx, q, "s", None, &producer, &job("tick")))
        .wait()
        .unwrap();
    assert!(next.is_some(), "the caller's scheduler advances");
}

/// A lease with `fail_deferred` fails a job marked to fail (here, one that
/// stalled more often than `max_stalled` allows) in its own transaction and
/// hands out the next runnable job in its place; without it the marked job
/// is handed out, for the worker to fail (BullMQ's way).
#[test]
fn a_lease_that_fails_deferred_jobs_hands_out_the_next_ones() {
    let (jobs, clock) = core();
    let marked_to_fail = |jobs: &Jobs| {
        let first = lease_for(jobs, "q", "w1", 1_000).unwrap();
        for round in 1..=2 {
            clock.advance(2_000);
            assert_eq!(jobs.sweep_stalled("ns", "q").wait().unwrap(), std::slice::from_ref(&first.job.id));
            if round == 1 {
                lease_for(jobs, "q", "w2", 1_000).unwrap();
            }
        }
        let j = jobs.get_job("ns", "q", &first.job.id).unwrap().unwrap();
        assert_eq!(j.deferred_failure.as_deref(), Some("job stalled more than allowable limit"));
        first.job.id
    };
    let lease = |fail_deferred| LeaseRequest { max: 2, token: "w3".into(), fail_deferred, ..Default::default() };

    jobs.enqueue("ns", "q", job("stalls")).wait().unwrap();
    let stalled = marked_to_fail(&jobs);
    jobs.enqueue("ns", "q", job("runs")).wait().unwrap();
    let leased = jobs.lease("ns", "q", lease(true)).wait().unwrap();
    assert_eq!(leased.leases.iter().map(|l| l.job.name.as_str()).collect::<Vec<_>>(), ["runs"]);
    assert_eq!(leased.info.failed, 1);
    let failed = jobs.get_job("ns", "q", &stalled).unwrap().unwrap();
    assert_eq!(failed.state, JobState::Failed);
    assert_eq!(failed.failed_reason.as_deref(), Some("job stalled more than allowable limit"));
    assert_eq!(failed.deferred_failure, None);
    let failed_events =
        events(&jobs, "q").into_iter().filter(|(name, fields)| name == "failed" && fields[0].1 == stalled).count();
    assert_eq!(failed_events, 1);

    jobs.enqueue("ns", "q", job("stalls")).wait().unwrap();
    let stalled = marked_to_fail(&jobs);
    let leased = jobs.lease("ns", "q", lease(false)).wait().unwrap();
    assert_eq!(leased.leases.len(), 1);
    assert_eq!(leased.leases[0].job.id, stalled);
    assert!(leased.leases[0].job.deferred_failure.is_some());
}

/// failParentOnFailure releases a parent waiting for children as their end
/// would: after the parent's own delay (BullMQ's moveParentToWait); a parent
/// already delayed has its delay cut short.
#[test]
fn fail_parent_on_failure_keeps_a_waiting_parents_own_delay() {
    let (jobs, clock) = core();
    let nodes = vec![
        FlowNode {
            queue: "parents".into(),
            request: EnqueueRequest { job_id: Some("p".into()), delay_ms: 5_000, ..job("p") },
            wait_children: true,
        },
        FlowNode {
            queue: "kids".into(),
            request: EnqueueRequest {
                on_child_failure: OnChildFailure::FailParent,
                ..flow_node("kids", "c", Some(parent("parents", "p")), false).request
            },
            wait_children: false,
        },
    ];
    jobs.flow("ns", nodes).wait().unwrap();
    let c = lease_one(&jobs, "kids").unwrap();
    fail(&jobs, "kids", &c);
    let p = jobs.get_job("ns", "parents", "p").unwrap().unwrap();
    assert_eq!(p.deferred_failure.as_deref(), Some("child bull:kids:c failed"));
    assert_eq!(p.state, JobState::Delayed);
    assert!(lease_one(&jobs, "parents").is_none());
    clock.advance(5_001);
    let l = lease_one(&jobs, "parents").expect("due after its delay");
    assert_eq!(l.job.id, "p");
}

/// A delayed parent that a second failing child releases at once goes, with a
/// priority, behind the jobs of its priority, as Redis's moveParentToWait puts it.
#[test]
fn a_delayed_prioritized_parent_released_by_a_failing_child_goes_behind_its_priority() {
    let (jobs, _) = core();
    jobs.enqueue("ns", "parents", EnqueueRequest { priority: 1, ..job("other") }).wait().unwrap();
    let child = |id: &str| FlowNode {
        queue: "kids".into(),
        request: EnqueueRequest {
            on_child_failure: OnChildFailure::FailParent,
            ..flow_node("kids", id, Some(parent("parents", "p")), false).request
        },
        wait_children: false,
    };
    let nodes = vec![
        FlowNode {
            queue: "parents".into(),
            request: EnqueueRequest { job_id: Some("p".into()), delay_ms: 5_000, priority: 1, ..job("p") },
            wait_children: true,
        },
        child("c1"),
        child("c2"),
    ];
    jobs.flow("ns", nodes).wait().unwrap();
    fail(&jobs, "kids", &lease_one(&jobs, "kids").unwrap());
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::Delayed));
    fail(&jobs, "kids", &lease_one(&jobs, "kids").unwrap());
    assert_eq!(leased_names(&jobs, "parents", 2), ["other", "p"]);
}

/// removeOnComplete {count: 1}: two jobs finishing in the same millisecond,
/// the later one added first to finish. One stays, as on Redis.
#[test]
fn a_retention_count_holds_when_finish_times_tie() {
    let (jobs, _) = core();
    let keep1 = || EnqueueRequest {
        remove_on_complete: Some(Retention::Keep(Keep { count: Some(1), ..Default::default() })),
        ..job("a")
    };
    jobs.enqueue("ns", "q", keep1()).wait().unwrap();
    jobs.enqueue("ns", "q", keep1()).wait().unwrap();
    let first = lease_one(&jobs, "q").unwrap();
    let second = lease_one(&jobs, "q").unwrap();
    finish(&jobs, "q", &second, Outcome::Ok { result: None }).unwrap();
    finish(&jobs, "q", &first, Outcome::Ok { result: None }).unwrap();
    let listed = jobs.query("ns", "q", |tx, q| query::range(tx, q, JobState::Completed, 0, -1, true)).unwrap();
    assert_eq!(jobs.counts("ns", "q", &[JobState::Completed]).unwrap(), [1], "kept {listed:?}");
    assert_eq!(state(&jobs, "q", &first.job.id), Some(JobState::Completed), "the job just finished stays");
}

/// Every write that takes a lease refuses a stale one: after a stall and a
/// re-lease, and after the job finished.
#[test]
fn stale_leases_are_fenced_on_every_write() {
    let (jobs, clock) = core();
    jobs.enqueue("ns", "q", EnqueueRequest { attempts: 5, ..job("a") }).wait().unwrap();
    let old = lease_for(&jobs, "q", "old", 1_000).unwrap();
    clock.advance(2_000);
    jobs.sweep_stalled("ns", "q").wait().unwrap();
    let new = lease_for(&jobs, "q", "new", 60_000).unwrap();
    let id = old.job.id.clone();
    let outcomes = [
        Outcome::Ok { result: None },
        Outcome::Fail { error: JobError::new("x"), dead_letter: false },
        Outcome::Retry { error: None, after_ms: Some(0) },
        Outcome::Retry { error: None, after_ms: Some(10) },
        Outcome::Release { after_ms: None },
        Outcome::Delay { until: clock.now_ms() + 10, delay_ms: None },
        Outcome::RateLimited { for_ms: 10 },
    ];
    for stale in [Fence::Epoch(old.epoch), Fence::Token(old.token.clone())] {
        for o in &outcomes {
            let r = jobs.complete("ns", "q", &id, stale.clone(), o.clone(), CompleteOptions::default()).wait();
            assert!(matches!(r, Err(JobsError::Fenced { .. })), "{o:?} {r:?}");
        }
        assert!(jobs.extend("ns", "q", &id, stale.clone(), 1000).wait().is_err());
        assert!(jobs.report("ns", "q", &id, stale.clone(), Report::Progress("1".into()), None).wait().is_err());
        assert!(
            jobs.report("ns", "q", &id, stale.clone(), Report::Log { row: "x".into(), keep: None }, None)
                .wait()
                .is_err()
        );
        assert_eq!(
            jobs.extend_many("ns", "q", vec![(id.clone(), stale.clone())], 1000).wait().unwrap(),
            std::slice::from_ref(&id)
        );
    }
    finish(&jobs, "q", &new, Outcome::Ok { result: None }).unwrap();
    for f in [Fence::Epoch(new.epoch), Fence::Token(new.token.clone())] {
        let r = jobs.complete("ns", "q", &id, f.clone(), Outcome::Ok { result: None }, CompleteOptions::default());
        assert!(r.wait().is_err());
        assert!(jobs.extend("ns", "q", &id, f.clone(), 1000).wait().is_err());
        assert!(jobs.report("ns", "q", &id, f, Report::Progress("1".into()), None).wait().is_err());
    }
    let j = jobs.get_job("ns", "q", &id).unwrap().unwrap();
    assert_eq!((j.state, j.attempts_made), (JobState::Completed, 1));
}

/// BullMQ's removeUnprocessedChildren: each pending child goes with its
/// pending descendants, skipping a leased job (only its own lease counts)
/// and a failed one; a leased grandchild stays, and its end, with its parent
/// gone, is still recorded.
#[test]
fn remove_unprocessed_children_skips_only_leased_and_failed_jobs() {
    let (jobs, _) = core();
    let nodes = vec![
        flow_node("q", "P", None, true),
        flow_node("q", "A", Some(parent("q", "P")), true),
        flow_node("q", "AA", Some(parent("q", "A")), false),
        flow_node("q", "AB", Some(parent("q", "A")), false),
        flow_node("q", "B", Some(parent("q", "P")), false),
    ];
    jobs.flow("ns", nodes).wait().unwrap();
    let leased = lease_one(&jobs, "q").unwrap();
    assert_eq!(leased.job.id, "AA");
    jobs.admin("ns", "q", |tx, q| admin::remove_unprocessed_children(tx, q, "P")).wait().unwrap();
    for gone in ["A", "AB", "B"] {
        assert_eq!(state(&jobs, "q", gone), None, "{gone}");
    }
    assert_eq!(state(&jobs, "q", "AA"), Some(JobState::Active), "a leased job stays");
    // P waits for nothing now, as on Redis.
    assert_eq!(state(&jobs, "q", "P"), Some(JobState::Waiting));
    let removed: Vec<String> = events(&jobs, "q")
        .into_iter()
        .filter(|(name, _)| name == "removed")
        .filter_map(|(_, fields)| fields.into_iter().find(|(k, _)| k == "jobId").map(|(_, v)| v))
        .collect();
    let at = |id: &str| removed.iter().position(|r| r == id);
    assert!(at("AB").is_some() && at("AB") < at("A"), "a child goes after its own: {removed:?}");
    ok(&jobs, "q", &leased, "done");
    assert_eq!(state(&jobs, "q", "AA"), Some(JobState::Completed));
    assert_eq!(jobs.counts("ns", "q", &[JobState::Waiting, JobState::Active]).unwrap(), [1, 0]);
}

/// A parent whose flow gave it no children is released as the flow goes in,
/// and its answer says so, not the state it waited in for a moment.
#[test]
fn a_flow_parent_with_no_children_is_answered_as_released() {
    let (jobs, _) = core();
    let added = jobs.flow("ns", vec![flow_node("parents", "p", None, true)]).wait().unwrap();
    assert_eq!(added[0].state, JobState::Waiting);
    assert_eq!(state(&jobs, "parents", "p"), Some(JobState::Waiting));
}

/// BullMQ's `moveJobFromActiveToWait` (a release that asks for the rate
/// limit's ttl) without a lock token leaves a job that is not active where it
/// is, as Redis's script does, and answers the ttl; a plain release of that
/// job, unchecked or not, is still refused, and so is the move with a token.
#[test]
fn only_bullmqs_unchecked_move_to_wait_leaves_a_job_that_is_not_active_alone() {
    let (jobs, clock) = core();
    let id = jobs.enqueue("ns", "q", job("w")).wait().unwrap().id;
    let limiter = RateLimit { max: 1, duration_ms: 60_000 };
    let keyed = |key: &str| CompleteOptions {
        idempotency: Some(Idempotency { key: key.into(), ttl_ms: None }),
        ..Default::default()
    };
    let move_to_wait_with = |fence: Fence, opts: CompleteOptions| {
        let release = Outcome::Release { after_ms: None };
        jobs.complete_then_rate_limit_ttl("ns", "q", &id, fence, release, opts, limiter.clone()).wait()
    };
    let move_to_wait = |fence: Fence| move_to_wait_with(fence, CompleteOptions::default());
    // Rate limited for 5 s from now: the ttl is answered with the job left alone.
    jobs.admin("ns", "q", |tx, q| admin::set_rate_limit(tx, q, 5_000)).wait().unwrap();
    let (done, ttl) = move_to_wait(Fence::Unchecked).unwrap();
    assert_eq!((done.state, done.moved, ttl), (Some(JobState::Waiting), false, 5_000));
    assert_eq!(state(&jobs, "q", &id), Some(JobState::Waiting));
    let with_token = move_to_wait(Fence::Token("w".into()));
    assert!(matches!(with_token, Err(JobsError::Fenced { .. })), "{with_token:?}");
    let release = Outcome::Release { after_ms: None };
    let refused = jobs.complete("ns", "q", &id, Fence::Unchecked, release, CompleteOptions::default()).wait();
    assert!(matches!(refused, Err(JobsError::Precondition(Precondition::NotInState { .. }))), "{refused:?}");
    // A keyed release sent again after it was made (its answer lost) answers
    // what it did, not that the job it released is not active.
    clock.advance(5_001);
    lease_one(&jobs, "q").unwrap();
    let (first, _) = move_to_wait_with(Fence::Unchecked, keyed("k")).unwrap();
    let (again, _) = move_to_wait_with(Fence::Unchecked, keyed("k")).unwrap();
    assert_eq!((first.moved, first.replayed), (true, false));
    assert_eq!((again.moved, again.replayed), (true, true));
}

/// A job record is encoded into a buffer of its size: grown by doubling, a
/// large payload's record kept up to twice its size in memory, in every
/// batch and snapshot layer that holds it. Long texts and many small ones
/// (headers) count too.
#[test]
fn a_job_record_is_encoded_into_a_buffer_of_its_size() {
    let (jobs, _) = core();
    let data = vec![7u8; 1 << 20];
    jobs.enqueue("ns", "q", EnqueueRequest { data: data.clone(), ..job("big") }).wait().unwrap();
    let plain = jobs.get_job("ns", "q", "1").unwrap().unwrap();
    assert_eq!(plain.data, data);
    let finished = JobRecord { return_value: Some(vec![1u8; 1 << 19]), ..plain.clone() };
    let named = JobRecord { name: "n".repeat(1000), id: "i".repeat(1000), ..plain.clone() };
    let headers = (0..300).map(|i| (format!("h{i}"), format!("v{i}"))).collect();
    let with_headers = JobRecord { headers, ..plain.clone() };
    for record in [plain, finished, named, with_headers] {
        let bytes = record.encode();
        assert_eq!(bytes, model::encode(&record));
        let spare = bytes.capacity() - bytes.len();
        assert!(spare < 64 * 1024, "{} bytes in a buffer of {}", bytes.len(), bytes.capacity());
    }
}
