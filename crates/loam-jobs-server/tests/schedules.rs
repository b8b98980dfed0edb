//! Server-owned schedules: one job per tick, on the
//! server's clock.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a failed unwrap is a failed check, with its message"
)]

mod support;

use std::time::Duration;

use support::*;

/// 2026-12-01T12:00:30Z.
const T: u64 = 1_796_126_430_000;

/// A client whose calls say it is `at` (the server follows it with
/// --follow-client-clock).
fn client_at(server: &Server, at: u64) -> Client {
    server.client_with(&[("loam-now-ms", &at.to_string())])
}

/// The ticks of the jobs of schedule `id` in `queue`, in any state, sorted;
/// a tick enqueued under a variant id (`repeat:id:tick:n`) shows twice.
async fn ticks(c: &Client, queue: &str, id: &str) -> Vec<String> {
    let q = oneof::query_request::Query::from(pb::query_request::Ranges {
        types: ["wait", "delayed", "active", "completed", "failed"].map(String::from).to_vec(),
        start: 0,
        end: -1,
        asc: true,
        ..Default::default()
    });
    let Some(oneof::query_response::Result::Ranges(r)) =
        c.query(query_req(queue, q)).await.unwrap().into_owned().result
    else {
        panic!("ranges")
    };
    let prefix = format!("repeat:{id}:");
    let mut t: Vec<String> =
        r.ranges.into_iter().flat_map(|l| l.ids).filter_map(|i| i.strip_prefix(&prefix).map(String::from)).collect();
    t.sort();
    t
}

/// Lets the ticker (a pass every 200 ms) see the clock a call moved, before
/// a check that nothing more was enqueued.
async fn let_it_tick() {
    tokio::time::sleep(Duration::from_millis(700)).await;
}

/// [`ticks`] once `enough` holds for them, or as they are after 10 s: the
/// ticker passes every 200 ms, but on a loaded machine a pass of a debug
/// build can come late.
async fn ticks_once(c: &Client, queue: &str, id: &str, enough: impl Fn(&[String]) -> bool) -> Vec<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let seen = ticks(c, queue, id).await;
        if enough(&seen) || std::time::Instant::now() >= deadline {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A schedule whose ticks could not be keyed by their tick, or that would
/// never tick, is refused rather than stored silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_that_could_not_key_its_ticks_or_never_ticks_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let every = |job: pb::JobSpec| pb::ServerSchedule {
        id: "x".into(),
        every_ms: Some(300),
        job: job.into(),
        ..Default::default()
    };
    let mut keyed = job("tick", b"{}");
    keyed.idempotency = pb::Idempotency { key: "k1".into(), ..Default::default() }.into();
    let mut named = job("tick", b"{}");
    named.job_id = Some("mine".into());
    let cases = [
        (every(keyed), "idempotency"),
        (every(named), "job_id"),
        (pb::ServerSchedule { limit: Some(0), ..every(job("tick", b"{}")) }, "limit"),
        (pb::ServerSchedule { end_date: Some(1_000), ..every(job("tick", b"{}")) }, "has passed"),
    ];
    let c = server.client();
    for (schedule, says) in cases {
        let e = assert_code(
            c.schedule(schedule_req("refused", schedule)).await,
            connectrpc::ErrorCode::InvalidArgument,
            Some("invalid_argument"),
        );
        assert!(e.message.as_deref().unwrap_or("").contains(says), "{says}: {e:?}");
    }
    assert!(ticks(&c, "refused", "x").await.is_empty(), "nothing was enqueued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cron_schedule_never_starts_at_a_tick_before_its_time() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--follow-client-clock"], &[]);
    let minutely = pb::ServerSchedule { id: "m".into(), cron: Some("* * * * *".into()), ..Default::default() };
    client_at(&server, T).schedule(schedule_req("q", minutely.clone())).await.unwrap();
    // The 12:01 tick falls due and is enqueued; 12:02 is pending.
    client_at(&server, T + 30_300).query(query_req("q", oneof::query_request::Query::LastEvent(true))).await.unwrap();
    let (t1, t2) = ((T + 30_000).to_string(), (T + 90_000).to_string());
    let seen = ticks_once(&server.client(), "q", "m", |t| t.len() >= 2).await;
    assert_eq!(seen, vec![t1.clone(), t2.clone()]);
    // Replaced 800 ms into 12:01: its first tick is 12:02, not 12:01 again
    // (enqueued a second time as `repeat:m:<12:01>:1`).
    client_at(&server, T + 30_800).schedule(schedule_req("q", minutely.clone())).await.unwrap();
    assert_eq!(ticks(&server.client(), "q", "m").await, vec![t1.clone(), t2.clone()]);
    // Removed and added again at the same moment: the same (before, refused
    // as a collision with the 12:01 job).
    let c = client_at(&server, T + 30_900);
    c.unschedule(pb::UnscheduleRequest { queue: "q".into(), scheduler_id: "m".into(), ..Default::default() })
        .await
        .unwrap();
    c.schedule(schedule_req("q", minutely)).await.unwrap();
    assert_eq!(ticks(&server.client(), "q", "m").await, vec![t1, t2]);
    // A start date with milliseconds: the first tick is the whole second after it.
    let secondly = pb::ServerSchedule {
        id: "s".into(),
        cron: Some("* * * * * *".into()),
        start_date: Some(T + 50_750),
        ..Default::default()
    };
    let first = client_at(&server, T + 31_000).schedule(schedule_req("q", secondly)).await.unwrap().into_owned();
    assert_eq!(first.job_id.as_deref(), Some(format!("repeat:s:{}", T + 51_000).as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_start_date_ahead_restarts_an_every_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--follow-client-clock"], &[]);
    let every = pb::ServerSchedule { id: "e".into(), every_ms: Some(300), ..Default::default() };
    client_at(&server, T).schedule(schedule_req("q", every.clone())).await.unwrap();
    let later = pb::ServerSchedule { start_date: Some(T + 3_000), ..every };
    let r = client_at(&server, T + 100).schedule(schedule_req("q", later)).await.unwrap().into_owned();
    assert_eq!(r.job_id.as_deref(), Some(format!("repeat:e:{}", T + 3_000).as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_starts_on_the_servers_clock_not_the_callers() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &[], &[]);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    // A caller whose clock says 1970: before, the ticker caught up every
    // minute since (hundreds of jobs a second, for ever).
    let s = pb::ServerSchedule { id: "b".into(), every_ms: Some(60_000), ..Default::default() };
    let r = client_at(&server, 1_000).schedule(schedule_req("q", s)).await.unwrap().into_owned();
    let tick: u64 = r.job_id.unwrap().rsplit(':').next().unwrap().parse().unwrap();
    assert!(tick.abs_diff(now) < 60_000, "first tick {tick}, now {now}");
    ticks_once(&server.client(), "q", "b", |t| t.len() >= 2).await;
    let_it_tick().await;
    let seen = ticks(&server.client(), "q", "b").await;
    assert_eq!(seen.len(), 2, "the tick now and the next one: {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_whose_id_a_job_holds_is_that_jobs_and_the_schedule_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--follow-client-clock"], &[]);
    let c = client_at(&server, T);
    // Ticks from a start date, so they do not move with the ms the calls take.
    let first = T + 500;
    // A job already holds the second tick's id.
    let mut holder = job("mine", b"{}");
    holder.job_id = Some(format!("repeat:h:{}", first + 1_000));
    c.enqueue(enqueue_req("q", holder)).await.unwrap();
    let s = pb::ServerSchedule { id: "h".into(), every_ms: Some(1_000), start_date: Some(first), ..Default::default() };
    c.schedule(schedule_req("q", s)).await.unwrap();
    // Past the held tick: the schedule moves on to the third (before, it
    // stayed at the second, a `duplicated` event every pass, for ever).
    client_at(&server, first + 1_100)
        .query(query_req("q", oneof::query_request::Query::LastEvent(true)))
        .await
        .unwrap();
    let expected: Vec<String> = [first, first + 1_000, first + 2_000].iter().map(u64::to_string).collect();
    let seen = ticks_once(&server.client(), "q", "h", |t| t.len() >= expected.len()).await;
    assert_eq!(seen, expected);
}

/// Celery beat upserts every entry each time it starts, and running it
/// twice must neither duplicate nor miss a tick. An unchanged upsert just
/// after a tick fell due, before the ticker's pass, keeps that tick's job:
/// the schedule is moved past it first, as the ticker would. It used to be
/// dropped as a replaced iteration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upsert_just_after_a_tick_fell_due_keeps_that_tick() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--follow-client-clock"], &[]);
    let hourly = pb::ServerSchedule { id: "h".into(), cron: Some("0 * * * *".into()), ..Default::default() };
    // 12:00:30: the first tick is 13:00.
    client_at(&server, T).schedule(schedule_req("q", hourly.clone())).await.unwrap();
    let tick = T - 30_000 + 3_600_000;
    assert_eq!(ticks(&server.client(), "q", "h").await, vec![tick.to_string()]);
    // 50 ms into 13:00 (the ticker passes every 200 ms): the same entry again.
    client_at(&server, tick + 50).schedule(schedule_req("q", hourly)).await.unwrap();
    assert_eq!(ticks(&server.client(), "q", "h").await, vec![tick.to_string(), (tick + 3_600_000).to_string()]);
    let_it_tick().await;
    assert_eq!(ticks(&server.client(), "q", "h").await, vec![tick.to_string(), (tick + 3_600_000).to_string()]);
}

/// The same upsert at the very millisecond of the tick: the first tick it
/// looked for was at or after now, which found the tick just run (as the
/// upsert caught up with it), and enqueued it again under a second id (39
/// schedules in 40 before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upsert_at_the_very_millisecond_of_a_tick_runs_that_tick_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--follow-client-clock"], &[]);
    for i in 0..5u64 {
        let (id, queue) = (format!("m{i}"), format!("q{i}"));
        let minutely = pb::ServerSchedule { id: id.clone(), cron: Some("* * * * *".into()), ..Default::default() };
        // 12:01:00 plus i hours: a whole minute, ten seconds on.
        let tick = T + 30_000 + i * 3_600_000;
        client_at(&server, tick - 10_000).schedule(schedule_req(&queue, minutely.clone())).await.unwrap();
        client_at(&server, tick).schedule(schedule_req(&queue, minutely)).await.unwrap();
        assert_eq!(
            ticks(&server.client(), &queue, &id).await,
            vec![tick.to_string(), (tick + 60_000).to_string()],
            "schedule {id}"
        );
    }
}

/// Ticks missed for longer than a minute (a server down, here a clock moved
/// on a day) are not made up one by one: the pending tick runs late once and
/// the schedule goes on from the first tick after now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ticks_missed_for_a_day_are_not_made_up_one_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), &["--follow-client-clock"], &[]);
    let every = pb::ServerSchedule { id: "s".into(), every_ms: Some(1_000), ..Default::default() };
    let first = client_at(&server, T).schedule(schedule_req("q", every)).await.unwrap().into_owned();
    let first: u64 = first.job_id.unwrap().rsplit(':').next().unwrap().parse().unwrap();
    let day = T + 86_400_000;
    client_at(&server, day)
        .query(query_req("q", oneof::query_request::Query::from(pb::query_request::Counts::default())))
        .await
        .unwrap();
    ticks_once(&client_at(&server, day), "q", "s", |t| t.len() >= 2).await;
    let_it_tick().await;
    let seen = ticks(&client_at(&server, day), "q", "s").await;
    // The first tick, and the first tick after the day (on the schedule's grid).
    assert_eq!(seen.len(), 2, "{} ticks: {seen:?}", seen.len());
    assert_eq!(seen[0], first.to_string());
    // The first tick after the ticker's now, which runs on from the day by
    // the time the test takes, on the schedule's grid.
    let next: u64 = seen[1].parse().unwrap();
    assert!(next > day && next < day + 10_000 && (next - first).is_multiple_of(1_000), "{seen:?}");
}
