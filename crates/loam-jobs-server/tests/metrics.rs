//! `/metrics` counts what happened, whichever call made it happen.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

mod support;

use support::*;

fn retry() -> pb::Outcome {
    pb::Outcome::from_kind(pb::outcome::Retry {
        error: pb::JobError { message: "boom".into(), ..Default::default() }.into(),
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_no_attempts_left_counts_as_a_failure() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let mut twice = job("t", b"{}");
    twice.attempts = 2;
    c.enqueue(enqueue_req("m", twice)).await.unwrap();
    // The first retry sends the job back; the second, its last attempt, fails it.
    for _ in 0..2 {
        let leased = c.lease(lease_req("m", 1, 2_000, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
        let l = &leased.leases[0];
        c.complete(complete_req("m", &l.job.as_option().unwrap().id, epoch(l.epoch), retry())).await.unwrap();
    }
    let text = server.metrics();
    assert!(text.contains("loam_jobs_completed_total{ns=\"default\",queue=\"m\",outcome=\"retry\"} 1"), "{text}");
    assert!(text.contains("loam_jobs_completed_total{ns=\"default\",queue=\"m\",outcome=\"fail\"} 1"), "{text}");
}

/// A lease that fails a job instead of handing it out (here one whose
/// `expires` passed before it started) counts it as a failure, as a
/// worker's failing it would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_a_lease_fails_counts_as_a_failure() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let mut expired = job("x", b"{}");
    expired.expires = Some(1);
    c.enqueue(enqueue_req("e", expired)).await.unwrap();
    c.enqueue(enqueue_req("e", job("y", b"{}"))).await.unwrap();
    let leased = c.lease(lease_req("e", 1, 0, 0)).await.unwrap().into_owned().leased.into_option().unwrap();
    assert_eq!(leased.leases[0].job.as_option().unwrap().name, "y");
    let text = server.metrics();
    assert!(text.contains("loam_jobs_completed_total{ns=\"default\",queue=\"e\",outcome=\"fail\"} 1"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_of_bullmq_schedulers_are_counted_as_enqueued() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let c = server.client();
    let spec = pb::SchedulerSpec {
        id: "s".into(),
        name: "n".into(),
        every_ms: Some(60_000),
        template_data: "{}".into(),
        template_opts: "{}".into(),
        ..Default::default()
    };
    let upserted = c.schedule(schedule_req("b", spec)).await.unwrap().into_owned();
    // A worker that started the iteration enqueues the next one.
    let advance = pb::SchedulerAdvance {
        id: "s".into(),
        producer_id: upserted.job_id.unwrap(),
        job: job("n", b"{}").into(),
        ..Default::default()
    };
    let advanced = c.schedule(schedule_req("b", advance)).await.unwrap().into_owned();
    assert!(advanced.job_id.is_some());
    let text = server.metrics();
    assert!(text.contains("loam_jobs_enqueued_total{ns=\"default\",queue=\"b\"} 2"), "{text}");
}
