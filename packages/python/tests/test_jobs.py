"""Producing and working: enqueue, lease, complete, retries, leases and fencing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import pytest
from protobuf import Oneof

from loam_jobs import (
    Client,
    DeadlineExceededError,
    Delay,
    DependencyStatus,
    Enqueued,
    Fail,
    FencedError,
    InvalidArgumentError,
    JobState,
    LoamJobsError,
    NotFoundError,
    ParentRef,
    PayloadTooLargeError,
    Release,
    Retry,
    Success,
    UnavailableError,
    fixed_backoff,
    flow_node,
    job,
    models,
)
from loam_jobs import _ops as ops
from loam_jobs._gen.loam.jobs.v1.jobs_pb import (
    EnqueueBulkResponse,
    JobAdminRequest,
    QueueAdminRequest,
    ReportRequest,
)

from .conftest import MAX_PAYLOAD_BYTES, Server


def test_the_package_exports_every_model_type() -> None:
    # The types the methods take and return (Retention for remove_on_complete,
    # Metrics from metrics(), ...) are importable from the package itself.
    import loam_jobs

    assert set(models.__all__) <= set(loam_jobs.__all__)
    assert all(hasattr(loam_jobs, name) for name in loam_jobs.__all__)


def test_enqueue_lease_complete_round_trip(client: Client, queue: str) -> None:
    enqueued = client.enqueue(queue, "send", {"to": "a@b.c"}, attempts=3)
    assert enqueued.created and enqueued.state == JobState.WAITING

    batch = client.lease(queue, max_jobs=5, wait_ms=1_000)
    assert len(batch) == 1
    leased = batch[0]
    assert leased.id == enqueued.id and leased.name == "send"
    assert leased.json() == {"to": "a@b.c"}

    result = client.complete(leased, Success({"sent": True}))
    assert result.state == JobState.COMPLETED
    assert result.finished_on is not None

    stored = client.get_job(queue, enqueued.id)
    assert stored is not None
    assert stored.state == JobState.COMPLETED
    assert stored.return_value == b'{"sent":true}'
    assert client.counts(queue, "completed", "wait") == {"completed": 1, "wait": 0}
    assert client.get_job(queue, "no-such-job") is None


def test_job_id_and_bulk_results(client: Client, queue: str) -> None:
    first = client.enqueue(queue, "a", b"raw bytes", job_id="fixed")
    again = client.enqueue(queue, "a", b"other", job_id="fixed")
    assert first.created and not again.created and again.id == "fixed"

    too_big = b"x" * (MAX_PAYLOAD_BYTES + 1)
    results = client.enqueue_bulk(queue, [job("b", 1), job("big", too_big), job("c", 3)])
    assert isinstance(results[0], Enqueued) and isinstance(results[2], Enqueued)
    # An oversized job is refused on its own; the others are added.
    assert isinstance(results[1], PayloadTooLargeError)
    assert results[1].reason == "payload_too_large"
    assert client.counts(queue, "wait")["wait"] == 3
    assert client.get_job(queue, "fixed").data == b"raw bytes"


def test_enqueue_bulk_takes_mappings_of_enqueues_parameters(client: Client, queue: str) -> None:
    results = client.enqueue_bulk(
        queue,
        [
            {"name": "a", "data": {"n": 1}, "job_id": "m1", "priority": 2, "attempts": 3, "backoff": 500},
            job("b", 2, job_id="s1"),
            {"name": "c", "job_id": "m2"},
        ],
    )
    assert all(isinstance(r, Enqueued) for r in results)
    built = client.get_job(queue, "m1")
    assert (built.name, built.data, built.priority, built.attempts) == ("a", b'{"n":1}', 2, 3)
    assert built.backoff == fixed_backoff(500)
    assert client.get_job(queue, "s1").data == b"2"
    assert client.get_job(queue, "m2").name == "c"


def test_enqueue_bulk_all_or_nothing_raises_the_refusal_and_adds_nothing(client: Client, queue: str) -> None:
    jobs = [{"name": "a"}, {"name": "b", "data": b"x" * (MAX_PAYLOAD_BYTES + 1)}, {"name": "c"}]
    assert isinstance(client.enqueue_bulk(queue, jobs)[1], PayloadTooLargeError)
    assert client.counts(queue, "wait") == {"wait": 2}, "per job, the others go in"
    with pytest.raises(PayloadTooLargeError):
        client.enqueue_bulk(queue, jobs, all_or_nothing=True)
    assert client.counts(queue, "wait") == {"wait": 2}, "all or nothing: none of the three"


def test_a_bad_bulk_mapping_is_refused_like_enqueues_keywords_and_nothing_is_sent(
    client: Client, queue: str
) -> None:
    good = {"name": "ok", "data": 1}
    # enqueue refuses an unknown keyword with TypeError and a value the wire
    # cannot carry with InvalidArgumentError: so does enqueue_bulk, naming the job and the key.
    with pytest.raises(TypeError):
        client.enqueue(queue, "a", delay=5)
    with pytest.raises(TypeError, match=r"job 1 has an unknown key 'delay'"):
        client.enqueue_bulk(queue, [good, {"name": "a", "delay": 5}])
    with pytest.raises(TypeError, match=r"job 0 has no 'name'"):
        client.enqueue_bulk(queue, [{"data": 1}])
    with pytest.raises(TypeError, match=r"job 1 is a tuple"):
        client.enqueue_bulk(queue, [good, ("a", 1)])  # type: ignore[list-item]

    with pytest.raises(InvalidArgumentError, match="request not sent"):
        client.enqueue(queue, "a", delay_ms="soon")
    for index, key, value in [
        (1, "delay_ms", "soon"),
        (2, "attempts", 2**40),
        (1, "name", 5),
        (2, "data", float("nan")),
        (1, "remove_on_complete", "always"),
    ]:
        bad = {"name": "bad", key: value}
        items = [good, bad] if index == 1 else [good, good, bad]
        with pytest.raises(InvalidArgumentError, match=rf"request not sent: .*job {index}, key '{key}'"):
            client.enqueue_bulk(queue, items)
    assert client.counts(queue, "wait") == {"wait": 0}


def test_none_is_json_null_wherever_a_value_is_written(client: Client, queue: str) -> None:
    # As BullMQ's JSON.stringify: a Node worker reads `job.data === null`.
    omitted = client.enqueue(queue, "omitted")
    given = client.enqueue(queue, "none", None)
    bulk = client.enqueue_bulk(queue, [{"name": "bulk"}, job("spec")])
    for enqueued in [omitted, given, *bulk]:
        assert isinstance(enqueued, Enqueued)
        assert client.get_job(queue, enqueued.id).data == b"null"

    leased = client.lease(queue)[0]
    assert leased.json() is None
    client.report(leased, progress=None)
    client.report(leased, data=None)
    reported = client.get_job(queue, leased.id)
    assert (reported.progress, reported.data) == ("null", b"null")
    with pytest.raises(InvalidArgumentError):
        client.report(leased)  # nothing to report
    with pytest.raises(InvalidArgumentError):
        client.report(leased, progress=1, data=None)

    # A return value of None is null, as a BullMQ processor that returns nothing.
    client.complete(leased, Success())
    assert client.get_job(queue, leased.id).return_value == b"null"
    assert not client.get_job(queue, given.id).has_field("return_value")  # no result yet

    # Data stored empty (no data at all) still reads as None.
    empty = client.enqueue(queue, "empty", b"")
    assert client.get_job(queue, empty.id).data == b""
    assert [j.json() for j in client.lease(queue, max_jobs=10)] == [None] * 4


def test_a_job_names_its_scheduler(client: Client, queue: str) -> None:
    enqueued = client.enqueue(queue, "tick", scheduler_id="every-minute")
    assert client.get_job(queue, enqueued.id).scheduler_id == "every-minute"
    assert client.get_job(queue, client.enqueue(queue, "plain").id).scheduler_id == ""


def test_lease_waits_for_a_job_and_fetch_next(client: Client, queue: str) -> None:
    started = time.monotonic()
    assert len(client.lease(queue, wait_ms=300)) == 0
    assert time.monotonic() - started >= 0.25

    for i in range(3):
        client.enqueue(queue, "n", i)
    first = client.lease(queue)[0]
    # Finish one job and take the next in the same transaction.
    result = client.complete(first, Success(), fetch_next=1)
    assert len(result.next) == 1
    second = result.next[0]
    assert second.json() == 1
    client.complete(second, Success())


def test_retries_then_failure(client: Client, queue: str) -> None:
    enqueued = client.enqueue(queue, "flaky", None, attempts=2)

    leased = client.lease(queue, wait_ms=1_000)[0]
    client.complete(leased, Retry("first try failed"))
    after_retry = client.get_job(queue, enqueued.id)
    assert after_retry.attempts_made == 1
    assert after_retry.state in (JobState.WAITING, JobState.DELAYED)

    leased = client.lease(queue, wait_ms=2_000)[0]
    assert leased.job.attempts_made == 1
    # Without after_ms the job's attempts decide: the last attempt's retry is a failure.
    try:
        raise RuntimeError("second try failed")
    except RuntimeError as err:
        result = client.complete(leased, Retry(err))
    assert result.state == JobState.FAILED
    failed = client.get_job(queue, enqueued.id)
    assert failed.failed_reason == "second try failed"
    # An exception's traceback is kept as its stack trace (a string error has none).
    [trace] = failed.stacktrace
    assert trace.startswith("Traceback (most recent call last):")
    assert trace.endswith("RuntimeError: second try failed") and "test_retries_then_failure" in trace

    # An admin retry brings it back.
    client.retry(queue, enqueued.id, reset_attempts_made=True)
    leased = client.lease(queue, wait_ms=1_000)[0]
    assert leased.id == enqueued.id
    # With after_ms the retry happens whatever the attempts (BullMQ's retryJob).
    client.complete(leased, Retry("once more", after_ms=0))
    leased = client.lease(queue, wait_ms=1_000)[0]
    client.complete(leased, Fail("gave up"))
    assert client.get_job(queue, enqueued.id).state == JobState.FAILED


def test_release_and_delay_spend_no_attempt(client: Client, queue: str) -> None:
    enqueued = client.enqueue(queue, "x", None, attempts=1)
    leased = client.lease(queue)[0]
    client.complete(leased, Release())
    released = client.get_job(queue, enqueued.id)
    assert released.state == JobState.WAITING and released.attempts_made == 0

    leased = client.lease(queue)[0]
    client.complete(leased, Delay(until_ms=int(time.time() * 1000) + 60_000))
    assert client.get_job(queue, enqueued.id).state == JobState.DELAYED
    client.promote(queue, enqueued.id)
    assert client.get_job(queue, enqueued.id).state == JobState.WAITING


def test_extend_and_a_stale_lease_is_fenced(client: Client, queue: str) -> None:
    client.enqueue(queue, "slow", None)
    leased = client.lease(queue, lock_duration_ms=200)[0]
    old_deadline = leased.deadline
    new_deadline = client.extend(leased, 5_000)
    assert new_deadline > old_deadline and leased.deadline == new_deadline

    # Let the lease lapse and have the stalled sweep hand the job to another worker.
    client.extend(leased, 100)
    time.sleep(0.3)
    assert client.sweep_stalled(queue, max_stalled=5) == [leased.id]
    taker = client.lease(queue, wait_ms=1_000)[0]
    assert taker.id == leased.id and taker.epoch > leased.epoch

    # The first worker's writes are refused: its lease is gone.
    with pytest.raises(FencedError) as refused:
        client.complete(leased, Success("late"))
    assert refused.value.reason.startswith("fenced.")
    assert refused.value.bullmq_code in (-2, -6)
    assert refused.value.subject == leased.id
    with pytest.raises(FencedError):
        client.extend(leased, 1_000)
    with pytest.raises(FencedError):
        client.report(leased, progress=50)

    # The second worker's outcome is the one recorded.
    client.complete(taker, Success("on time"))
    assert client.get_job(queue, leased.id).return_value == b'"on time"'
    with pytest.raises(FencedError) as again:
        client.complete(taker, Success("twice"))
    assert again.value.reason == "fenced.no_lease"


def test_extend_many_reports_the_lost_ones(client: Client, queue: str) -> None:
    for i in range(2):
        client.enqueue(queue, "x", i)
    held = list(client.lease(queue, max_jobs=2))
    client.complete(held[1], Success())
    assert client.extend(held, 5_000) == [held[1].id]


def test_report_progress_logs_and_data(client: Client, queue: str) -> None:
    enqueued = client.enqueue(queue, "x", {"v": 1})
    leased = client.lease(queue)[0]
    client.report(leased, progress={"done": 3, "of": 10})
    assert client.report(leased, log="line 1") == 1
    assert client.report(leased, log="line 2") == 2
    client.report(leased, data={"v": 2})
    stored = client.get_job(queue, enqueued.id)
    assert stored.progress == '{"done":3,"of":10}'
    assert stored.data == b'{"v":2}'
    page = client.logs(queue, enqueued.id)
    assert page.logs == ["line 1", "line 2"] and page.count == 2
    # An admin write by id, with no lease.
    assert client.report(enqueued.id, queue=queue, log="admin", unchecked=True) == 3
    with pytest.raises(InvalidArgumentError):
        client.report(leased, progress=1, log="both")
    with pytest.raises(InvalidArgumentError):
        client.complete(enqueued.id, Success())  # a job id needs its queue and a fence


def test_metrics_count_completions_and_page_their_points(client: Client, queue: str) -> None:
    assert client.metrics(queue, "completed").total == 0
    for _ in range(2):
        client.enqueue(queue, "a")
        client.complete(client.lease(queue)[0], metrics_max_points=10)
    kept = client.metrics(queue, "completed")
    assert kept.count == 2 and kept.total == len(kept.data)
    # Positions past the points kept answer none, and the count still.
    past = client.metrics(queue, "completed", kept.total, kept.total + 5)
    assert (past.count, list(past.data), past.total) == (2, [], kept.total)


def test_flow_parent_waits_for_children(client: Client, queue: str) -> None:
    children_queue = f"{queue}-children"
    parent = job("parent", None, job_id="p1")
    parent_ref = ParentRef(queue=queue, id="p1")
    nodes = [
        flow_node(queue, parent, wait_children=True),
        flow_node(children_queue, job("child", 1, parent=parent_ref)),
        flow_node(children_queue, job("child", 2, parent=parent_ref)),
    ]
    enqueued = client.flow(nodes)
    assert len(enqueued) == 3
    assert enqueued[0].state == JobState.WAITING_CHILDREN
    deps = client.dependencies(queue, "p1", with_jobs=True)
    assert len(deps.dependencies) == 2 and all(j is not None for j in deps.jobs)
    assert deps.total == 2
    # A page of one status holds its positions only, and counts them all.
    second = client.dependencies(queue, "p1", with_jobs=True, status=DependencyStatus.PENDING, start=1)
    assert [d.key for d in second.dependencies] == [deps.dependencies[1].key]
    assert [j.id for j in second.jobs if j] == [deps.dependencies[1].child_id]
    assert second.total == 2
    assert client.dependencies(queue, "p1", status=DependencyStatus.PROCESSED).total == 0

    for leased in client.lease(children_queue, max_jobs=2):
        client.complete(leased, Success())
    assert client.get_job(queue, "p1").state == JobState.WAITING
    first = client.dependencies(queue, "p1", status=DependencyStatus.PROCESSED, end=0)
    assert ([d.key for d in first.dependencies], first.total) == ([deps.dependencies[0].key], 2)
    assert client.dependencies(queue, "p1", status=DependencyStatus.PENDING).total == 0
    parent_lease = client.lease(queue, wait_ms=1_000)[0]
    assert parent_lease.id == "p1"
    client.complete(parent_lease, Success())


def test_a_flow_retries_an_unknown_outcome_under_a_key_for_each_node(client: Client, queue: str) -> None:
    parent_ref = ParentRef(queue=queue, id="p")
    nodes = [
        flow_node(queue, job("parent", None, job_id="p"), wait_children=True),
        flow_node(queue, job("child", 1, parent=parent_ref)),
        flow_node(queue, job("child", 2, parent=parent_ref, idempotency_key=f"{queue}-own")),
    ]
    op = ops.flow(nodes)
    first = next(op)
    assert isinstance(first, ops.Call)
    keys = [node.job.idempotency.key for node in first.request.nodes]
    assert all(keys) and len(set(keys)) == 3 and keys[2] == f"{queue}-own"
    assert not nodes[0].job.has_field("idempotency"), "the caller's nodes are left as they were"
    assert isinstance(op.throw(UnavailableError("connection reset")), ops.Pause)
    again = op.send(None)
    assert isinstance(again, ops.Call) and again.request == first.request
    # Its answer lost, the flow sent again adds none of its jobs twice.
    made, resent = client._run(_sent_twice(first))
    assert [(e.id, e.created) for e in resent.enqueued] == [(e.id, False) for e in made.enqueued]
    assert all(e.created for e in made.enqueued)
    assert client.counts(queue, "waiting", "waiting-children") == {"waiting": 2, "waiting-children": 1}


def test_missing_job_is_not_found_with_bullmq_code(client: Client, queue: str) -> None:
    with pytest.raises(NotFoundError) as missing:
        client.promote(queue, "nope")
    assert missing.value.reason == "not_found.job"
    assert missing.value.bullmq_code == -1
    assert missing.value.subject == "nope"
    assert isinstance(missing.value, LoamJobsError)


def test_gzip_requests(server: Server, queue: str) -> None:
    with Client(server.url, compress_requests=True) as gzipping:
        payload = {"text": "compressible " * 1_000}
        enqueued = gzipping.enqueue(queue, "big", payload)
        assert gzipping.lease(queue)[0].json() == payload
        assert gzipping.get_job(queue, enqueued.id).state == JobState.ACTIVE


def test_set_config_changes_only_the_settings_given(client: Client, queue: str) -> None:
    before = client.get_config(queue)
    client.set_config(queue, dead_letter_queue=f"{queue}-dead")
    after = client.get_config(queue)
    assert after.dead_letter_queue == f"{queue}-dead"
    assert (after.max_stalled, after.stalled_interval_ms) == (before.max_stalled, before.stalled_interval_ms)
    client.set_config(queue, max_stalled=3)
    assert client.get_config(queue).dead_letter_queue == f"{queue}-dead"
    client.set_config(queue, dead_letter_queue="")
    assert not client.get_config(queue).has_field("dead_letter_queue")


def _marked_to_fail(client: Client, queue: str) -> str:
    """A job of `queue`, its only one, stalled twice: past the default
    max_stalled of 1, so marked to fail."""
    enqueued = client.enqueue(queue, "poison", None)
    for _ in range(2):
        assert [leased.id for leased in client.lease(queue, lock_duration_ms=50)] == [enqueued.id]
        time.sleep(0.1)
        assert client.sweep_stalled(queue) == [enqueued.id]
    return enqueued.id


def test_a_job_past_max_stalled_is_failed_not_handed_out(client: Client, queue: str) -> None:
    poison = _marked_to_fail(client, queue)
    assert len(client.lease(queue)) == 0
    job = client.get_job(queue, poison)
    assert job is not None and job.state == JobState.FAILED
    assert job.failed_reason == "job stalled more than allowable limit"


def test_fetch_next_fails_a_job_past_max_stalled_and_takes_the_next(client: Client, queue: str) -> None:
    poison = _marked_to_fail(client, queue)
    first = client.enqueue(queue, "first", None)
    # Leased past the marked job, which is at the front: behind it, a job to fetch.
    leased = client.lease(queue, names=["first"])[0]
    assert leased.id == first.id
    runnable = client.enqueue(queue, "runnable", None)
    result = client.complete(leased, Success(), fetch_next=1)
    assert [following.id for following in result.next] == [runnable.id]
    failed = client.get_job(queue, poison)
    assert failed is not None and failed.state == JobState.FAILED
    assert failed.failed_reason == "job stalled more than allowable limit"


def test_extend_takes_any_list_of_one_queues_leases(client: Client, queue: str) -> None:
    assert client.extend([], 1_000) == []
    for i in range(2):
        client.enqueue(queue, "a", i)
    batch = client.lease(queue, max_jobs=2)
    assert client.extend(batch, 10_000) == []
    lost = batch[0]
    client.complete(lost, Success())
    assert client.extend([lost], 10_000) == [lost.id]
    assert client.extend(batch, 10_000) == [lost.id]
    with pytest.raises(InvalidArgumentError):
        client.extend(batch, 10_000, epoch=1)  # type: ignore[call-overload]


def test_fetch_next_leases_with_the_workers_options(client: Client, queue: str) -> None:
    client.enqueue(queue, "email", job_id="e1")
    client.enqueue(queue, "pdf", job_id="p1")
    client.enqueue(queue, "email", job_id="e2")
    first = client.lease(queue, names=["email"], lock_duration_ms=300_000)[0]
    result = client.complete(
        first, Success(), fetch_next=1, fetch_next_names=["email"], fetch_next_lock_duration_ms=300_000
    )
    following = result.next[0]
    assert (following.id, following.job.lock.duration_ms) == ("e2", 300_000)


def test_enqueue_retries_an_unknown_outcome_under_one_idempotency_key() -> None:
    spec = job("a", {"n": 1})
    op = ops.enqueue("q", spec)
    first = next(op)
    assert isinstance(first, ops.Call)
    key = first.request.job.idempotency.key
    assert key and not spec.has_field("idempotency"), "the caller's spec is left as it was"
    assert isinstance(op.throw(UnavailableError("connection refused")), ops.Pause)
    again = op.send(None)
    assert isinstance(again, ops.Call) and again.request.job.idempotency.key == key
    # A refusal is not retried.
    with pytest.raises(InvalidArgumentError):
        op.throw(InvalidArgumentError("bad"))


def test_retry_pauses_are_drawn_at_random_from_the_upper_half_of_each() -> None:
    # Clients refused together (a server restart, an overload) must not all
    # send again at the same moment, three times over.
    drawn: list[list[float]] = [[] for _ in ops.RETRY_PAUSES]
    for _ in range(1_000):
        op = ops.enqueue("q", job("a"))
        next(op)
        for pauses in drawn:
            pause = op.throw(UnavailableError("connection refused"))
            assert isinstance(pause, ops.Pause)
            pauses.append(pause.seconds)
            assert isinstance(op.send(None), ops.Call)
    for bound, pauses in zip(ops.RETRY_PAUSES, drawn, strict=True):
        assert bound / 2 <= min(pauses) and max(pauses) <= bound
        # Spread over that half (1,000 draws all missing a fifth of it: 1e-97).
        assert min(pauses) < bound * 0.6 and max(pauses) > bound * 0.9


def test_retries_go_on_at_the_longest_pause_until_the_client_ends_them() -> None:
    op = ops.enqueue("q", job("a"))
    first = next(op)
    assert isinstance(first, ops.Call)
    for bound in (*ops.RETRY_PAUSES, *[ops.LATER_RETRY_PAUSE] * 10):
        pause = op.throw(UnavailableError("connection refused"))
        assert isinstance(pause, ops.Pause) and bound / 2 <= pause.seconds <= bound
        assert isinstance(pause.cause, UnavailableError) and pause.since <= time.monotonic()
        assert isinstance(op.send(None), ops.Call)
    # The client's budget is spent: it throws the failure back, which the
    # operation raises as the last, with its tries and key.
    pause = op.throw(UnavailableError("connection refused"))
    assert isinstance(pause, ops.Pause) and pause.cause is not None
    with pytest.raises(UnavailableError) as given_up:
        op.throw(pause.cause)
    assert given_up.value.tries == 14
    assert given_up.value.idempotency_key == first.request.job.idempotency.key
    assert "gave up after 14 tries" in str(given_up.value)
    assert f"idempotency_key={given_up.value.idempotency_key!r} within a day" in str(given_up.value)


Send = Callable[[ops.Call], Any]


def _each_try(client: Client, answer: Callable[[int, ops.Call, Send], Any]) -> list[tuple[float, ops.Call]]:
    """Has `answer(n, call, send)` answer each call `client` makes (its `n`th,
    from 1; `send` sends it for real); returns the tries, when each was made
    and its call, as they are made."""
    send = client._call
    tries: list[tuple[float, ops.Call]] = []

    def answered(call: ops.Call) -> Any:
        tries.append((time.monotonic(), call))
        return answer(len(tries), call, send)

    client._call = answered  # type: ignore[method-assign]
    return tries


def test_the_retry_budget_counts_from_the_first_failure_not_the_first_try(client: Client, queue: str) -> None:
    # A first try that ran out its own timeout still gets its retries.
    hasty = Client(client.url, retry_for_ms=200)

    def slow_then_answered(n: int, call: ops.Call, send: Send) -> Any:
        if n == 1:
            time.sleep(0.5)
            raise DeadlineExceededError("no answer in time")
        return send(call)

    tried = _each_try(hasty, slow_then_answered)
    with hasty:
        assert hasty.counts(queue, "waiting") == {"waiting": 0}
    assert len(tried) == 2


def test_an_enqueue_given_up_on_is_sent_again_under_its_key_and_added_once(
    client: Client, queue: str
) -> None:
    # Its first try is applied and its answer lost; every later try is refused.
    hasty = Client(client.url, retry_for_ms=1_000)
    failed: list[float] = []

    def lost_then_refused(n: int, call: ops.Call, send: Send) -> Any:
        if n == 1:
            send(call)
        failed.append(time.monotonic())
        raise UnavailableError("connection refused")

    tried = _each_try(hasty, lost_then_refused)
    with hasty, pytest.raises(UnavailableError) as given_up:
        hasty.enqueue(queue, "a", {"n": 1})
    assert given_up.value.tries == len(tried) > 1
    # The last try at the end of the budget, counted from the first failure
    # (the real send before it takes a while on a busy machine). The slack is
    # for waking up; a last pause drawn in full, not cut to the budget's end,
    # is 0.8 to 1.6 s, and ends 1.05 to 2.1 s after the first failure.
    assert 0.95 <= tried[-1][0] - failed[0] < 1.5
    key = given_up.value.idempotency_key
    assert key
    # How long the key lets it be sent again: what is left of its TTL.
    assert "within" in str(given_up.value) and "(the server then forgets the key)" in str(given_up.value)
    again = client.enqueue(queue, "a", {"n": 1}, idempotency_key=key)
    assert not again.created
    assert client.counts(queue, "waiting") == {"waiting": 1}


def test_a_client_with_no_retry_budget_sends_each_call_once(client: Client, queue: str) -> None:
    once = Client(client.url, retry_for_ms=0)

    def refused(n: int, call: ops.Call, send: Send) -> Any:
        raise UnavailableError("connection refused")

    calls = _each_try(once, refused)
    with once, pytest.raises(UnavailableError) as refusal:
        once.enqueue(queue, "a")
    assert (len(calls), refusal.value.tries) == (1, 1)
    with pytest.raises(InvalidArgumentError):
        Client(client.url, retry_for_ms=-1)


def test_a_retry_waits_at_least_the_servers_retry_after_up_to_a_bound() -> None:
    op = ops.enqueue("q", job("a"))
    next(op)
    for _ in ops.RETRY_PAUSES:
        pause = op.throw(UnavailableError("the server is busy", retry_after_ms=1_000))
        assert isinstance(pause, ops.Pause) and pause.seconds >= 1.0
        op.send(None)
    # An hour asked for is more than a write's retries wait (and than its
    # idempotency key, whose TTL counts the longest pauses, outlives).
    op = ops.enqueue("q", job("a"))
    next(op)
    pause = op.throw(UnavailableError("the server is busy", retry_after_ms=3_600_000))
    assert isinstance(pause, ops.Pause) and pause.seconds == ops.MAX_RETRY_AFTER


def test_an_enqueue_refused_as_busy_is_sent_again_after_the_servers_retry_after(
    client: Client, queue: str
) -> None:
    def busy_once(n: int, call: ops.Call, send: Send) -> Any:
        if n == 1:
            raise UnavailableError("the server is busy", retry_after_ms=700)
        return send(call)

    tried = _each_try(client, busy_once)
    added = client.enqueue(queue, "a", None)
    assert time.monotonic() - tried[0][0] >= 0.7
    assert client.get_job(queue, added.id) is not None


def test_a_retried_enqueue_with_a_job_id_does_not_add_a_removed_job_again(client: Client, queue: str) -> None:
    # The first try's answer was lost; by the retry its job ran and was removed.
    tried = next(ops.enqueue(queue, job("a", {"n": 1}, job_id="once", remove_on_complete=True)))
    assert isinstance(tried, ops.Call)
    sent = tried.request.job
    assert sent.idempotency.key, "an enqueue with a job id gets a key of its own too"
    assert client.enqueue_job(queue, sent).created
    client.complete(client.lease(queue)[0], Success())
    assert client.get_job(queue, "once") is None
    retried = client.enqueue_job(queue, sent)
    assert (retried.id, retried.created) == ("once", False)
    assert len(client.lease(queue, wait_ms=0)) == 0


def test_an_enqueues_own_key_outlives_its_retries_and_no_more() -> None:
    class FirstCall(ops.Operations):
        """Answers each operation with the first call it makes."""

        def __init__(self, timeout_ms: int | None) -> None:
            self._timeout_ms = timeout_ms
            self._retry_for_ms = 20_000
            self._bulk_keys = ops.BulkKeys()

        def _run(self, op: ops.Op[Any]) -> Any:
            return next(op)

    # The first try fails within 5 s, the last starts within the retry budget
    # (20 s) of that, reaches the server within 5 s more, and a minute more.
    assert ops.own_key_ttl_ms(5_000, 20_000) == 5_000 + 20_000 + 5_000 + 60_000
    call = FirstCall(5_000).enqueue("q", "a")
    assert call.request.job.idempotency.ttl_ms == 90_000
    bulk = FirstCall(5_000).enqueue_bulk("q", [job("a"), job("b")])
    assert bulk.request.idempotency.ttl_ms == 90_000
    assert [j.idempotency.ttl_ms for j in bulk.request.jobs] == [90_000, 90_000], (
        "until the server keeps call keys"
    )
    # Calls without a bound: the server's default (a day).
    unbounded = FirstCall(None).enqueue_job("q", job("a"))
    assert unbounded.request.job.idempotency.key and not unbounded.request.job.idempotency.has_field("ttl_ms")
    # A key of the caller's own keeps the caller's ttl.
    keyed = FirstCall(5_000).enqueue_job("q", job("a", idempotency_key="k", idempotency_ttl_ms=7))
    assert keyed.request.job.idempotency.ttl_ms == 7


def test_a_bulk_enqueue_retries_an_unknown_outcome_under_one_key_for_the_call(
    client: Client, queue: str
) -> None:
    specs = [job("a", 1), job("b", 2, job_id="own-id"), job("c", 3, idempotency_key=f"{queue}-own-key")]
    op = ops.enqueue_bulk(queue, specs, keys=ops.BulkKeys(kept=True))
    first = next(op)
    assert isinstance(first, ops.Call) and first.request.idempotency.key
    # To a server that keeps the call's key, jobs carry no key but the caller's.
    assert [j.idempotency.key if j.has_field("idempotency") else None for j in first.request.jobs] == [
        None,
        None,
        f"{queue}-own-key",
    ]
    assert isinstance(op.throw(UnavailableError("connection reset")), ops.Pause)
    again = op.send(None)
    assert isinstance(again, ops.Call) and again.request == first.request
    # Its answer lost, the call sent again adds none of its jobs twice.
    made, resent = client._run(_sent_twice(first))
    created = [(r.result.value.id, r.result.value.created) for r in made.results]
    assert [(r.result.value.id, r.result.value.created) for r in resent.results] == [
        (i, False) for i, _ in created
    ]
    assert all(c for _, c in created) and client.counts(queue, "waiting") == {"waiting": 3}


def test_a_bulk_enqueue_keys_each_job_too_until_the_server_says_it_keeps_the_calls_key(
    server: Server, queue: str
) -> None:
    # A server from before keys for a whole call ignores them: a bulk sent
    # again there would add its jobs twice without keys of their own.
    with Client(server.url) as fresh:
        sent = _each_try(fresh, lambda _, call, send: send(call))
        fresh.enqueue_bulk(queue, [job("a"), job("b")])
        assert all(j.has_field("idempotency") for j in sent[0][1].request.jobs)
        assert fresh._bulk_keys.kept
        fresh.enqueue_bulk(queue, [job("c")])
        assert not any(j.has_field("idempotency") for j in sent[1][1].request.jobs)
        assert sent[1][1].request.idempotency.key
    keys = ops.BulkKeys()
    op = ops.enqueue_bulk(queue, [job("d")], keys=keys)
    next(op)
    with pytest.raises(StopIteration):
        op.send(EnqueueBulkResponse(results=[]))
    assert not keys.kept, "an older server's answer (key_kept unset) leaves the next bulk's jobs keyed"


def test_each_enqueue_of_one_spec_adds_a_job(client: Client, queue: str) -> None:
    spec = job("a", {"n": 1})
    ids = {client.enqueue_job(queue, spec).id for _ in range(3)}
    assert len(ids) == 3
    keyed = job("a", None, idempotency_key=f"{queue}-k")
    assert len({client.enqueue_job(queue, keyed).id for _ in range(3)}) == 1


def test_completions_and_reports_retry_an_unknown_outcome_under_one_key() -> None:
    fence = ops._fence("1", 1, None, False)
    log = Oneof[Literal["log"], ReportRequest.Log]("log", ReportRequest.Log(row="hi"))
    for op in (ops.complete("q", "1", fence, Success()), ops.report("q", "1", fence, log)):
        first = next(op)
        assert isinstance(first, ops.Call)
        key = _key_of(first)
        assert key
        assert isinstance(op.throw(UnavailableError("connection reset")), ops.Pause)
        again = op.send(None)
        assert isinstance(again, ops.Call) and _key_of(again) == key
        # A refusal is an answer, not an unknown outcome.
        with pytest.raises(FencedError):
            op.throw(FencedError("lease lost"))


def test_calls_a_repeat_cannot_do_twice_retry_an_unknown_outcome_and_other_writes_do_not() -> None:
    fence = ops._fence("1", 1, None, False)
    repeatable = {
        "counts": ops.counts("q", ["waiting"], None),
        "get_jobs": ops.get_jobs("q", ["1"]),
        "result_get": ops.result_get("k"),
        "result_mget": ops.result_mget(["k"]),
        "extend": ops.extend_many("q", [("1", fence)], 1_000),
        "lease": ops.lease("q", ops.lease_options(1), 0),
        "pause": ops.queue_admin("q", "pause", True),
        "resume": ops.queue_admin("q", "resume", True),
        "set_rate_limit": ops.queue_admin("q", "set_rate_limit", QueueAdminRequest.SetRateLimit(ms=10)),
        "a chunk of promote_jobs": ops.queue_admin_until_done(
            "q", "promote_jobs", QueueAdminRequest.PromoteJobs(count=10)
        ),
        "result_set": ops.result_set("k", 1, None),
        "result_expire": ops.result_expire("k", 1_000),
    }
    for name, op in repeatable.items():
        first = next(op)
        assert isinstance(first, ops.Call), name
        assert isinstance(op.throw(UnavailableError("connection refused")), ops.Pause), name
        again = op.send(None)
        assert isinstance(again, ops.Call) and again.request == first.request, name
    # Each would answer, repeated, for what the repeat did rather than the
    # lost try (0 removed, not deleted, not added), or act on what came since.
    once = {
        "drain": ops.queue_admin("q", "drain", QueueAdminRequest.Drain()),
        "obliterate": ops.queue_admin("q", "obliterate", QueueAdminRequest.Obliterate(count=10)),
        "set_meta": ops.queue_admin("q", "set_meta", QueueAdminRequest.SetMeta(values={"a": "1"})),
        "publish_event": ops.queue_admin("q", "publish_event", QueueAdminRequest.PublishEvent(name="e")),
        "remove": ops.job_admin("q", "1", "remove", JobAdminRequest.Remove()),
        "result_delete": ops.result_delete("k"),
        "result_incr": ops.result_incr("k", "m", None),
        "a waiting read": ops.events("q", 0, 10, 1_000),
    }
    for name, op in once.items():
        assert isinstance(next(op), ops.Call), name
        with pytest.raises(UnavailableError):
            op.throw(UnavailableError("connection refused"))


def test_a_lease_that_timed_out_is_not_sent_again() -> None:
    # The server was most likely slow, not gone, and leased the jobs anyway.
    op = ops.lease("q", ops.lease_options(1), 0)
    next(op)
    with pytest.raises(DeadlineExceededError):
        op.throw(DeadlineExceededError("no answer in time"))


def test_a_retried_lease_waits_only_for_what_is_left_of_its_wait() -> None:
    op = ops.lease("q", ops.lease_options(1), 5_000)
    first = next(op)
    # All of it, less the moment since the operation began (a busy machine
    # can stall a thread between two statements).
    assert isinstance(first, ops.Call) and 4_000 <= first.wait_ms <= 5_000
    time.sleep(0.3)
    op.throw(UnavailableError("connection refused"))
    again = op.send(None)
    assert isinstance(again, ops.Call) and again.wait_ms <= 4_700
    assert again.request.wait_ms == again.wait_ms


def _key_of(call: ops.Call) -> str:
    request = call.request
    keyed = request.options if call.rpc == "complete" else request
    return str(keyed.idempotency.key)


def _sent_twice(call: ops.Call) -> Any:
    """Sends `call` twice, as a retry after a lost answer does."""
    first = yield call
    second = yield call
    return first, second


def test_a_completion_sent_again_is_answered_as_first_made(client: Client, queue: str) -> None:
    for name in ("a", "b", "c"):
        client.enqueue(queue, name)
    leased = client.lease(queue)[0]
    call = next(ops.complete(queue, leased.id, leased.fence(), Success(), ops.lease_options(1)))
    first, second = client._run(_sent_twice(call))
    assert [lease.job.id for lease in first.completed.next.leases] == ["2"]
    # The same job handed over again, not a third one leased, nor an error
    # for a lease that is gone.
    assert second.completed.state == first.completed.state
    assert [lease.job.id for lease in second.completed.next.leases] == ["2"]
    assert client.get_job(queue, "3").state == JobState.WAITING


def test_a_log_line_sent_again_is_kept_once(client: Client, queue: str) -> None:
    client.enqueue(queue, "a")
    leased = client.lease(queue)[0]
    log = Oneof[Literal["log"], ReportRequest.Log]("log", ReportRequest.Log(row="once"))
    call = next(ops.report(queue, leased.id, leased.fence(), log))
    first, second = client._run(_sent_twice(call))
    assert (first.log_count, second.log_count) == (1, 1)
    assert client.logs(queue, leased.id).logs == ["once"]


def test_a_completion_sent_again_after_retention_removed_its_job_is_answered_as_first_made(
    client: Client, queue: str
) -> None:
    client.enqueue(queue, "a", remove_on_complete=True)
    leased = client.lease(queue)[0]
    call = next(ops.complete(queue, leased.id, leased.fence(), Success()))
    first, second = client._run(_sent_twice(call))
    # Removed by retention: no state, as the answer's docs say; the repeat
    # finds the key's record, not a missing job.
    assert first.completed.state == second.completed.state == JobState.UNSPECIFIED
    assert second.completed.finished_on == first.completed.finished_on
    assert client.get_job(queue, leased.id) is None
