"""Queue and job administration, schedules and the result store."""

from __future__ import annotations

import time

import pytest

from loam_jobs import (
    Client,
    Fail,
    FailedPreconditionError,
    InvalidArgumentError,
    InvalidJsonError,
    JobState,
    LoamJobsError,
    Success,
)


def now_ms() -> int:
    return int(time.time() * 1000)


def test_pause_resume_and_counts(client: Client, queue: str) -> None:
    client.enqueue(queue, "a", 1)
    client.pause(queue)
    assert client.is_paused(queue)
    batch = client.lease(queue)
    assert len(batch) == 0 and batch.paused
    client.resume(queue)
    assert not client.is_paused(queue)
    assert len(client.lease(queue)) == 1
    assert queue in client.queues()


def test_drain_clean_and_obliterate(client: Client, queue: str) -> None:
    for i in range(3):
        client.enqueue(queue, "w", i)
    client.enqueue(queue, "later", None, delay_ms=60_000)
    assert client.counts(queue, "wait", "delayed") == {"wait": 3, "delayed": 1}
    assert client.drain(queue) == 3
    assert client.counts(queue, "wait", "delayed") == {"wait": 0, "delayed": 1}
    assert client.drain(queue, delayed=True) == 1

    for i in range(2):
        client.enqueue(queue, "done", i)
    for leased in client.lease(queue, max_jobs=2):
        client.complete(leased, Success())
    cleaned = client.clean(queue, "completed", before_ms=now_ms() + 1_000)
    assert len(cleaned) == 2
    assert client.counts(queue, "completed")["completed"] == 0

    client.enqueue(queue, "x", None)
    held = client.lease(queue)[0]
    # Without force, a queue with active jobs is not obliterated.
    with pytest.raises(FailedPreconditionError) as busy:
        client.obliterate(queue)
    assert busy.value.reason == "precondition.queue_has_active_jobs"
    client.complete(held, Success())
    client.enqueue(queue, "y", None)
    client.obliterate(queue)
    assert sum(client.counts(queue).values()) == 0
    # Keyed as BullMQ's getJobCounts() answers with no types named.
    assert sorted(client.counts(queue)) == [
        "active",
        "completed",
        "delayed",
        "failed",
        "paused",
        "prioritized",
        "waiting",
        "waiting-children",
    ]


def test_job_admin(client: Client, queue: str) -> None:
    delayed = client.enqueue(queue, "d", None, delay_ms=60_000)
    client.change_delay(queue, delayed.id, 120_000)
    assert client.get_job(queue, delayed.id).state == JobState.DELAYED
    client.promote_jobs(queue)
    assert client.get_job(queue, delayed.id).state == JobState.WAITING

    prioritized = client.enqueue(queue, "p", None, priority=5)
    assert client.get_job(queue, prioritized.id).state == JobState.PRIORITIZED
    client.change_priority(queue, prioritized.id, 1)
    assert client.counts_per_priority(queue, [1, 5]) == {1: 1, 5: 0}
    # The FIFO band (no priority) comes first, as in BullMQ.
    assert client.lease(queue)[0].id == delayed.id

    ranges = client.ranges(queue, ["prioritized", "active"], asc=True)
    assert ranges == {"prioritized": [prioritized.id], "active": [delayed.id]}

    # A locked job is not removed; a waiting one is.
    assert client.remove(queue, delayed.id) is False
    assert client.remove(queue, prioritized.id) is True
    assert client.get_job(queue, prioritized.id) is None

    leased = client.lease(queue, wait_ms=100)
    assert len(leased) == 0
    failing = client.enqueue(queue, "f", None)
    client.complete(client.lease(queue)[0], Fail("broken"))
    client.retry_jobs(queue, state=JobState.FAILED)
    assert client.get_job(queue, failing.id).state == JobState.WAITING
    client.report(failing.id, queue=queue, log="one", unchecked=True)
    client.clear_logs(queue, failing.id)
    assert client.logs(queue, failing.id).count == 0


def test_meta_config_events_and_workers(client: Client, queue: str) -> None:
    assert client.set_meta(queue, {"owner": "team-a", "tier": "gold"}) == 2
    assert client.get_meta(queue, ["owner"]) == {"owner": "team-a"}
    assert client.remove_meta_fields(queue, ["tier"]) == 1
    assert "tier" not in client.get_meta(queue)

    client.set_config(queue, max_stalled=3, stalled_interval_ms=10_000)
    config = client.get_config(queue)
    assert config.max_stalled == 3 and config.stalled_interval_ms == 10_000

    event_id = client.publish_event(queue, "custom", {"k": "v"})
    assert "-" in event_id
    names = [e.name for e in client.events(queue, after=0)]
    assert "custom" in names

    client.register_worker(queue, "worker-1")
    client.lease(queue, worker="worker-2")
    assert {"worker-1", "worker-2"} <= set(client.workers(queue))
    seen = {w.name: w for w in client.workers_seen(queue)}
    assert seen["worker-1"].addr.startswith("127.0.0.1:"), seen
    assert all(w.idle_ms <= w.age_ms < 60_000 for w in seen.values()), seen
    assert client.unregister_worker(queue, "worker-1")
    assert not client.unregister_worker(queue, "worker-1")
    assert "worker-1" not in client.workers(queue)

    client.enqueue(queue, "d", None, dedup="once")
    assert client.dedup_job(queue, "once") is not None
    assert client.remove_dedup_key(queue, "once") == 1
    assert client.dedup_job(queue, "once") is None


def test_server_schedule_every(client: Client, queue: str) -> None:
    result = client.schedule(queue, "tick", "tick", {"n": 1}, every_ms=100, limit=3)
    assert result.job_id is not None
    scheduler = client.get_scheduler(queue, "tick")
    assert scheduler is not None and scheduler.server_owned and scheduler.every_ms == 100
    assert client.scheduler_count(queue) == 1

    seen = []
    deadline = time.monotonic() + 5
    while len(seen) < 3 and time.monotonic() < deadline:
        for leased in client.lease(queue, max_jobs=3, wait_ms=500):
            assert leased.json() == {"n": 1}
            seen.append(leased.id)
            client.complete(leased, Success())
    assert len(seen) == 3 and len(set(seen)) == 3
    # The limit is reached: no fourth tick.
    assert len(client.lease(queue, wait_ms=300)) == 0


def test_server_schedule_cron_with_time_zone(client: Client, queue: str) -> None:
    result = client.schedule(
        queue, "nightly", "report", None, cron="0 3 * * *", tz="America/New_York", start_ms=now_ms()
    )
    assert result.job_id is not None and result.job_id.startswith("repeat:nightly:")
    assert 0 < result.delay_ms <= 24 * 3600 * 1000
    scheduler = client.get_scheduler(queue, "nightly")
    assert scheduler.tz == "America/New_York" and scheduler.pattern == "0 3 * * *"
    assert [s.id for s in client.get_schedulers(queue)] == ["nightly"]

    immediate = client.schedule(queue, "now", "report", None, cron="0 3 * * *", immediately=True, limit=1)
    assert immediate.delay_ms == 0
    assert client.lease(queue, wait_ms=1_000)[0].id == immediate.job_id

    assert client.unschedule(queue, "nightly") is True
    assert client.unschedule(queue, "nightly") is False
    assert client.get_scheduler(queue, "nightly") is None


def test_a_schedule_with_no_data_ticks_jobs_whose_data_is_null(client: Client, queue: str) -> None:
    # The server gives a template with no data `{}`: None must reach it as null.
    tick = client.schedule(queue, "none", "tick", None, every_ms=60_000, limit=1)
    leased = client.lease(queue, wait_ms=1_000)[0]
    assert leased.id == tick.job_id
    assert (leased.data, leased.json()) == (b"null", None)


def test_bad_schedules_are_invalid_arguments(client: Client, queue: str) -> None:
    with pytest.raises(InvalidArgumentError):
        client.schedule(queue, "bad", "x", None, cron="not a cron")
    with pytest.raises(InvalidArgumentError):
        client.schedule(queue, "bad", "x", None, cron="0 3 * * *", tz="Mars/Olympus_Mons")
    with pytest.raises(InvalidArgumentError):
        client.schedule(queue, "bad", "x", None)  # neither cron nor every_ms


def test_result_store(client: Client, queue: str) -> None:
    key = f"{queue}:result"
    assert client.result_get(key) is None
    client.result_set(key, {"answer": 42})
    assert client.result_get(key) == b'{"answer":42}'
    client.result_set(f"{key}:raw", b"\x00\x01")
    assert client.result_mget([key, f"{key}:raw", f"{key}:missing"]) == [b'{"answer":42}', b"\x00\x01", None]

    # An empty value is a value, not a missing key.
    client.result_set(f"{key}:empty", b"")
    assert client.result_get(f"{key}:empty") == b""

    assert client.result_delete(key) is True
    assert client.result_delete(key) is False

    counter = f"{queue}:chord"
    assert client.result_incr(counter, "task-1").count == 1
    repeat = client.result_incr(counter, "task-1")
    assert repeat.count == 1 and not repeat.added
    assert client.result_incr(counter, "task-2").count == 2

    client.result_set(f"{key}:short", b"v", ttl_ms=100)
    assert client.result_expire(f"{key}:raw", 100) is True
    assert client.result_expire(f"{key}:missing", 100) is False
    time.sleep(0.25)
    assert client.result_get(f"{key}:short") is None
    assert client.result_get(f"{key}:raw") is None


def test_a_result_ttl_of_0_is_refused_before_sending(client: Client, queue: str) -> None:
    # The server counts a ttl from the write: 0 stored a value already
    # expired, read back as missing.
    key = f"{queue}:ttl"
    with pytest.raises(InvalidArgumentError, match="ttl_ms must be at least 1"):
        client.result_set(key, "v", ttl_ms=0)
    with pytest.raises(InvalidArgumentError, match="ttl_ms must be at least 1"):
        client.result_incr(key, "member", ttl_ms=0)
    assert client.result_get(key) is None
    client.result_set(key, "v", ttl_ms=60_000)
    assert client.result_get_json(key) == "v"


def test_result_store_json_round_trip(client: Client, queue: str) -> None:
    values = [{"answer": 42}, [1, "two"], "text", 3.5, True, None]
    keys = [f"{queue}:{i}" for i in range(len(values))]
    for key, value in zip(keys, values, strict=True):
        client.result_set(key, value)
        assert client.result_get_json(key) == value
    assert client.result_mget_json([*keys, f"{queue}:missing"]) == [*values, None]

    # A stored null is None; a missing key is the default, which tells them apart.
    missing = object()
    assert client.result_get(keys[-1]) == b"null"
    assert client.result_get_json(keys[-1], default=missing) is None
    assert client.result_get_json(f"{queue}:missing", default=missing) is missing
    assert client.result_mget_json([keys[-1], f"{queue}:missing"], default=missing) == [None, missing]

    # Bytes are stored as they are: result_get reads them back, result_get_json
    # refuses them unless they are JSON text.
    client.result_set(f"{queue}:raw", b'{"raw":1}')
    assert client.result_get_json(f"{queue}:raw") == {"raw": 1}
    for raw in (b"\x00\x01", b"", b"{'single': 1}"):
        client.result_set(f"{queue}:raw", raw)
        assert client.result_get(f"{queue}:raw") == raw
        with pytest.raises(InvalidJsonError) as not_json:
            client.result_get_json(f"{queue}:raw")
        assert not_json.value.subject == f"{queue}:raw" and "is not JSON" in not_json.value.message
        assert isinstance(not_json.value, ValueError) and isinstance(not_json.value, LoamJobsError)
        with pytest.raises(InvalidJsonError):
            client.result_mget_json([keys[0], f"{queue}:raw"])
