"""The asyncio client: the same operations, awaited, and an async watch."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from loam_jobs import (
    AsyncClient,
    Client,
    ClientClosedError,
    DeadlineExceededError,
    FencedError,
    InvalidArgumentError,
    InvalidJsonError,
    JobState,
    LeasedJob,
    LoamJobsError,
    Retry,
    Success,
    UnavailableError,
)

from .conftest import Server, free_port, start_server, stop_server

pytestmark = pytest.mark.asyncio

# How long a job given back may take to be waiting again: generous, for a
# busy machine, and still well short of the 30 s lock that holds a job
# nobody gave back.
SETTLE_SECONDS = 10


async def test_async_round_trip_and_errors(server: Server, queue: str) -> None:
    async with AsyncClient(server.url) as client:
        enqueued = await client.enqueue(queue, "send", {"n": 1}, attempts=2)
        batch = await client.lease(queue, wait_ms=1_000)
        leased = batch[0]
        assert leased.id == enqueued.id and leased.json() == {"n": 1}
        await client.report(leased, progress=10)
        await client.extend(leased, 5_000)
        await client.complete(leased, Retry("again"))
        leased = (await client.lease(queue, wait_ms=1_000))[0]
        result = await client.complete(leased, Success("done"))
        assert result.state == JobState.COMPLETED
        with pytest.raises(FencedError):
            await client.complete(leased, Success("twice"))
        with pytest.raises(InvalidArgumentError):
            await client.enqueue("", "a", None)
        assert await client.counts(queue, "completed") == {"completed": 1}
        await client.pause(queue)
        assert await client.is_paused(queue)
        await client.result_set(f"{queue}:k", {"v": 1}, ttl_ms=60_000)
        assert await client.result_get(f"{queue}:k") == b'{"v":1}'


async def test_async_result_json_helpers(server: Server, queue: str) -> None:
    async with AsyncClient(server.url) as client:
        await client.result_set(f"{queue}:k", {"v": [1, None]})
        assert await client.result_get_json(f"{queue}:k") == {"v": [1, None]}
        assert await client.result_mget_json([f"{queue}:k", f"{queue}:missing"], default=0) == [
            {"v": [1, None]},
            0,
        ]
        await client.result_set(f"{queue}:raw", b"\xff")
        with pytest.raises(InvalidJsonError):
            await client.result_get_json(f"{queue}:raw")


async def test_async_lease_long_poll_wakes_on_enqueue(server: Server, queue: str) -> None:
    async with AsyncClient(server.url) as worker, AsyncClient(server.url) as producer:
        waiting = asyncio.create_task(worker.lease(queue, wait_ms=5_000))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await producer.enqueue(queue, "a", None)
        batch = await asyncio.wait_for(waiting, 3)
        assert len(batch) == 1


async def test_async_watch_resumes_from_cursor(server: Server, queue: str) -> None:
    async with AsyncClient(server.url) as client:
        async with client.watch(queue) as watch:
            first = await client.enqueue(queue, "a", None)
            event = await anext(watch)
            assert event.name == "added" and event.job_id == first.id
            cursor = watch.cursor
        second = await client.enqueue(queue, "b", None)
        async with client.watch(queue, after=cursor) as watch:
            names = [(await anext(watch)).name for _ in range(3)]
            assert names == ["waiting", "added", "waiting"]
            assert watch.cursor == cursor + 3
        assert (await client.get_job(queue, second.id)).name == "b"


async def test_cancelling_a_call_cancels_it_rather_than_failing_it(server: Server, queue: str) -> None:
    async with AsyncClient(server.url) as client:
        # asyncio's own timeouts work: they see the cancellation they caused.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.lease(queue, wait_ms=10_000), timeout=0.3)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await client.lease(queue, wait_ms=10_000)

        # A worker loop that logs the client's errors still stops when cancelled.
        polls = 0

        async def worker() -> None:
            nonlocal polls
            while polls < 5:
                polls += 1
                try:
                    await client.lease(queue, wait_ms=2_000)
                except LoamJobsError:
                    continue

        task = asyncio.create_task(worker())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert polls == 1


async def test_a_cancelled_lease_gives_back_the_job_it_took(server: Server, queue: str) -> None:
    async with AsyncClient(server.url) as client:
        await client.enqueue(queue, "only", attempts=5)
        task = asyncio.create_task(client.lease(queue, max_jobs=1))
        for _ in range(3):
            await asyncio.sleep(0)  # the request goes out
        # The event loop is held while the server answers: the answer is in
        # when the task is cancelled, and the caller never sees it.
        time.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        counts: dict[str, int] = {}
        deadline = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < deadline:
            counts = await client.counts(queue, "wait", "active")
            if counts["active"] == 0:
                break
            await asyncio.sleep(0.05)
        assert counts == {"wait": 1, "active": 0}, "the job was given back, not left to its lock"
        leased = (await client.lease(queue, wait_ms=1_000))[0]
        assert leased.job.attempts_made == 0, "giving back spends no attempt"


@contextlib.contextmanager
def _server_with_room_for(places: int, tmp_path: Path) -> Iterator[Server]:
    """A server of its own that lets a namespace have `places` long-polls
    waiting at once, and refuses one more; stopped on leaving."""
    server = start_server(tmp_path / "data", args=["--max-waiting-calls-per-namespace", str(places)])
    try:
        yield server
    finally:
        stop_server(server)


async def _until_there_is_room_for(places: int, server: Server) -> None:
    """Returns once `server` (`_server_with_room_for(places)`) lets
    `places` long-polls wait at once: it holds none of those a test left
    waiting there. Fails after 4 s, well before a poll of 10 s ends."""
    deadline = time.monotonic() + 4
    async with AsyncClient(server.url, retry_for_ms=0) as probe:
        while True:
            # Each waits 1 s on a queue nobody uses, so that they wait side by side.
            polls = [probe.wait_for_job("room", wait_ms=1_000) for _ in range(places)]
            outcomes = await asyncio.gather(*polls, return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, UnavailableError)]
            if not refused:
                for outcome in outcomes:
                    if isinstance(outcome, BaseException):
                        raise outcome
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the server still holds the long-polls given up: {refused[0]}")
            await asyncio.sleep(0.05)


async def _a_job_added_once_there_is_room_is_left_alone(
    places: int, server: Server, client: AsyncClient, queue: str
) -> None:
    """Once `server` holds none of the long-polls a test gave up (see
    `_until_there_is_room_for`), a job added to `queue` stays waiting, never
    leased, for as long as a poll still held would take to take it."""
    await _until_there_is_room_for(places, server)
    added = await client.enqueue(queue, "after")
    await asyncio.sleep(0.5)
    job = await client.get_job(queue, added.id)
    assert job is not None
    assert (job.state, job.attempts_started) == (JobState.WAITING, 0)


async def test_a_cancelled_long_poll_that_caught_nothing_stops_waiting(tmp_path: Path, queue: str) -> None:
    with _server_with_room_for(3, tmp_path) as server:
        async with AsyncClient(server.url) as client:
            for _ in range(3):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(client.lease(queue, wait_ms=10_000), timeout=0.1)
            # Past the grace a cancelled long-poll gets to answer, the server
            # lets the three polls go, long before their 10 s wait ends; left
            # waiting, they would take the next job and give it back, a lease each.
            await _a_job_added_once_there_is_room_is_left_alone(3, server, client, queue)


async def test_closing_an_async_client_ends_a_lease_waiting_in_another_task_and_takes_no_job(
    tmp_path: Path, queue: str
) -> None:
    # The lease waited on after close(): the job that came next was handed to
    # a caller whose complete() raised ClientClosedError, and stayed active
    # until its lock expired.
    with _server_with_room_for(1, tmp_path) as server:
        async with AsyncClient(server.url) as other:
            closing = AsyncClient(server.url)
            waiting = asyncio.create_task(closing.lease(queue, wait_ms=10_000))
            await asyncio.sleep(0.5)  # into the long-poll
            closed = time.monotonic()
            await asyncio.wait_for(closing.close(), 2)
            with pytest.raises(ClientClosedError):
                await asyncio.wait_for(waiting, 1)
            assert time.monotonic() - closed < 1
            # The server lets the lease go once the client has given it up; a
            # job added before it has would still be taken.
            await _a_job_added_once_there_is_room_is_left_alone(1, server, other, queue)
            assert await other.counts(queue, "wait", "active") == {"wait": 1, "active": 0}


async def test_closing_an_async_client_gives_back_what_a_waiting_lease_took_as_it_closed(
    server: Server, queue: str
) -> None:
    # The answer is in (the event loop is held while the server answers)
    # when close() gives the lease up: its job goes back, not to the caller.
    async with AsyncClient(server.url) as other:
        closing = AsyncClient(server.url)
        waiting = asyncio.create_task(closing.lease(queue, wait_ms=10_000))
        await asyncio.sleep(0.5)  # into the long-poll
        with Client(server.url) as producer:
            added = producer.enqueue(queue, "as-it-closes")
            # The lease has taken the job once it is active (how soon depends
            # on how busy the machine is); its answer is then on its way.
            deadline = time.monotonic() + 5
            taken = producer.get_job(queue, added.id)
            while taken is not None and taken.state != JobState.ACTIVE and time.monotonic() < deadline:
                time.sleep(0.02)
                taken = producer.get_job(queue, added.id)
            assert taken is not None and taken.state == JobState.ACTIVE, "the waiting lease took no job"
        time.sleep(0.3)  # for the answer to come in
        await asyncio.wait_for(closing.close(), 5)
        with pytest.raises(ClientClosedError):
            await asyncio.wait_for(waiting, 1)
        job = await other.get_job(queue, added.id)
        assert job is not None
        assert (job.state, job.attempts_made) == (JobState.WAITING, 0)
        assert await other.counts(queue, "wait", "active") == {"wait": 1, "active": 0}


async def test_a_lease_fails_a_stalled_job_on_the_server_in_its_own_call(server: Server, queue: str) -> None:
    async with AsyncClient(server.url) as client:
        poison = await client.enqueue(queue, "poison")
        # The default max_stalled is 1: the second stall marks the job to fail.
        for _ in range(2):
            assert len(await client.lease(queue, lock_duration_ms=50)) == 1
            await asyncio.sleep(0.1)
            await client.sweep_stalled(queue)
        runnable = await client.enqueue(queue, "runnable")
        send = client._call
        rpcs: list[str] = []

        async def recorded(call: Any) -> Any:
            rpcs.append(call.rpc)
            return await send(call)

        client._call = recorded  # type: ignore[method-assign]
        batch = await client.lease(queue, max_jobs=2)
        client._call = send  # type: ignore[method-assign]
        # One call: no client-side failure for a cancellation or a crash to
        # cut short, leaving the marked job held until its lock lapsed.
        assert rpcs == ["lease"]
        assert [leased.id for leased in batch] == [runnable.id]
        failed = await client.get_job(queue, poison.id)
        assert failed is not None
        assert (failed.state, failed.failed_reason) == (
            JobState.FAILED,
            "job stalled more than allowable limit",
        )


async def test_an_async_watch_closed_from_another_task_stops_waiting(server: Server, queue: str) -> None:
    async with AsyncClient(server.url) as client:
        watch = client.watch(queue)
        await watch.__aenter__()
        seen = []

        async def consume() -> None:
            async for event in watch:
                seen.append(event)

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        await asyncio.wait_for(watch.close(), 2)
        await asyncio.wait_for(consumer, 2)  # ended, without an event or an error
        assert seen == []

        # Cancelling the task that iterates a watch cancels it.
        async with client.watch(queue) as other:
            reader = asyncio.create_task(anext(other))
            await asyncio.sleep(0.3)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader


async def test_an_event_read_as_an_async_watch_is_closed_is_not_skipped_by_its_cursor(
    server: Server, queue: str
) -> None:
    # The event was read, and the iterating task not yet back, when close()
    # ran: the task moved the cursor past the event, then dropped it, and a
    # watch resumed from the cursor never saw it.
    async with AsyncClient(server.url) as client:
        watch = client.watch(queue)
        await watch.__aenter__()
        consumer = asyncio.create_task(anext(watch, None))
        await asyncio.sleep(0.3)  # into its read
        read = watch._read
        assert read is not None
        # What close() does first, as the read ends: the iterating task only
        # runs after this callback (a close() task of its own would run after
        # it, so the moment cannot be met otherwise).
        read.add_done_callback(lambda _: setattr(watch, "_closed", True))
        added = await client.enqueue(queue, "as-it-closes")
        await asyncio.wait_for(asyncio.wait([read]), 5)
        await watch.close()
        assert await asyncio.wait_for(consumer, 2) is None
        async with client.watch(queue, after=watch.cursor) as resumed:
            event = await asyncio.wait_for(anext(resumed), 5)
        assert (event.name, event.job_id) == ("added", added.id)


async def test_tasks_iterating_one_async_watch_take_each_event_once(server: Server, queue: str) -> None:
    count = 40
    taken: list[tuple[int, str, str]] = []
    async with AsyncClient(server.url) as client, client.watch(queue) as watch:

        async def take() -> None:
            async for event in watch:
                taken.append((event.seq, event.name, event.job_id))
                if sum(name == "added" for _, name, _ in taken) >= count:
                    await watch.close()

        readers = [asyncio.create_task(take()) for _ in range(2)]
        ids = [(await client.enqueue(queue, "a", i)).id for i in range(count)]
        await asyncio.wait_for(asyncio.gather(*readers), 10)
    seqs = sorted(seq for seq, _, _ in taken)
    # Each event once, none skipped, in one task or the other.
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert {job_id for _, name, job_id in taken if name == "added"} == set(ids)


async def test_operations_are_coroutine_functions_that_raise_when_awaited(server: Server) -> None:
    async with AsyncClient(server.url) as client:
        assert inspect.iscoroutinefunction(client.complete)
        call = client.complete("job-1")  # no queue and no fence: refused, but only when awaited
        with pytest.raises(InvalidArgumentError):
            await call


async def test_an_async_watch_takes_a_silent_stream_for_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As the blocking watch's test: a stopped server has no heartbeat to wait for.
    monkeypatch.setattr("loam_jobs.client.MIN_WATCH_IDLE_TIMEOUT_MS", 1)
    server = start_server(tmp_path / "data")
    try:
        async with AsyncClient(server.url) as client:
            watch = client.watch("frozen", max_reconnects=1, idle_timeout_ms=500)
            await watch.__aenter__()
            # A server that stops answering without closing anything: SIGSTOP.
            server.process.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(UnavailableError):
                    await asyncio.wait_for(anext(watch), 10)
            finally:
                server.process.send_signal(signal.SIGCONT)
            await watch.close()
    finally:
        stop_server(server)


async def test_an_async_watch_closed_between_reconnects_stops_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As `Watch`: the pause before a reconnect ran its course first. Each
    # pause is a minute here, so that waiting one out cannot pass for stopping.
    monkeypatch.setattr("loam_jobs.client.retry_pause", lambda pause, err: 60.0)
    server = start_server(tmp_path / "data")
    async with AsyncClient(server.url) as client:
        watch = client.watch("gone", after=0, max_reconnects=None)
        stop_server(server)

        async def read() -> list[Any]:
            return [e async for e in watch]

        reader = asyncio.create_task(read())
        deadline = time.monotonic() + 10
        while not watch._reconnect.failures and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert watch._reconnect.failures == 1, "the watch is not in its pause before a reconnect"
        closed = time.monotonic()
        await watch.close()
        assert await asyncio.wait_for(reader, 10) == []
        assert time.monotonic() - closed < 5


async def test_a_closed_async_client_refuses_every_later_call(server: Server, queue: str) -> None:
    async with AsyncClient(server.url) as closed:
        await closed.enqueue(queue, "before", None)
    with pytest.raises(ClientClosedError, match="closed"):
        await closed.enqueue(queue, "after", None)
    with pytest.raises(ClientClosedError):
        await anext(closed.watch(queue, after=0))
    async with AsyncClient(server.url) as open_client:
        assert await open_client.counts(queue, "wait") == {"wait": 1}


async def test_an_async_extend_of_no_leases_is_an_empty_list(server: Server, queue: str) -> None:
    # As the blocking client answers: nothing to extend, nothing asked.
    async with AsyncClient(server.url) as client:
        assert await client.extend([], 1_000) == []
        assert await client.extend(await client.lease(queue), 1_000) == []


async def test_timeouts_around_an_async_watch_are_not_reconnect_failures(server: Server, queue: str) -> None:
    # A caller polling with a timeout gives up on a read, not on the stream:
    # with one reconnect allowed, the third timeout took the watch for dead.
    async with AsyncClient(server.url) as client:
        async with client.watch(queue, max_reconnects=1) as watch:
            for _ in range(4):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(anext(watch), 0.3)
            added = await client.enqueue(queue, "a")
            event = await asyncio.wait_for(anext(watch), 5)
            assert event.job_id == added.id


async def test_an_async_watch_closed_before_its_first_read_ends_its_iteration(
    server: Server, queue: str
) -> None:
    # The read of a fresh stream cancelled before it ran: the iteration ends,
    # and the task that iterates is not taken for cancelled.
    async with AsyncClient(server.url) as client:
        watch = client.watch(queue, after=0)
        consumer = asyncio.create_task(anext(watch))
        await asyncio.sleep(0)
        await watch.close()
        with pytest.raises(StopAsyncIteration):
            await consumer


async def test_an_async_watch_closed_while_it_pins_its_cursor_opens_no_stream(
    server: Server, queue: str
) -> None:
    async with AsyncClient(server.url) as client:
        watch = client.watch(queue)  # after=None: the first iteration asks for the log's end
        consumer = asyncio.create_task(anext(watch))
        await asyncio.sleep(0)  # it is asking
        await watch.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(consumer, 2)
        assert watch._stream is None


async def test_an_async_watch_pinning_its_cursor_on_a_server_that_is_down_stops_at_close() -> None:
    # Without `async with`, the first iteration pins the cursor; it did so
    # with a retried call, which held each try for the client's whole retry
    # budget (about 20 s) while the server was down, and `close()` waited.
    async with AsyncClient(f"http://127.0.0.1:{free_port()}") as client:
        watch = client.watch("down", max_reconnects=None)

        async def read() -> list[Any]:
            return [e async for e in watch]

        reader = asyncio.create_task(read())
        await asyncio.sleep(1)
        closed = time.monotonic()
        await watch.close()
        assert await asyncio.wait_for(reader, 10) == []
        # Slack for a busy machine; a pin retried as a call held close() up to 20 s.
        assert time.monotonic() - closed < 3
        assert watch.cursor is None


def _losing_the_first_answer(client: AsyncClient, rpc: str, error: LoamJobsError) -> list[Any]:
    """Makes `client` lose the answer to its first `rpc` call, which the
    server applied, and fail that call with `error`; returns the answers to
    every `rpc` call, as they come."""
    send = client._call
    answers: list[Any] = []

    async def losing(call: Any) -> Any:
        answer = await send(call)
        if call.rpc == rpc:
            answers.append(answer)
            if len(answers) == 1:
                raise error
        return answer

    client._call = losing  # type: ignore[method-assign]
    return answers


async def _in_the_pause_before_the_retry(answers: list[Any]) -> None:
    """Returns once the first answer was lost (`_losing_the_first_answer`):
    the operation then pauses at least 0.05 s before its retry. A fixed
    sleep missed the pause whenever the first try took longer than it."""
    for _ in range(1_000):
        if answers:
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the first try was not made")


async def test_a_completion_cancelled_while_it_waits_to_resend_gives_back_what_it_fetched(
    server: Server, queue: str
) -> None:
    # The first try completed the job and fetched the next, and its answer was
    # lost; the caller is cancelled in the pause before the retry. The next job
    # goes back to waiting rather than to nobody until its lock expires.
    async with AsyncClient(server.url) as client:
        lost = _losing_the_first_answer(client, "complete", DeadlineExceededError("the answer was lost"))
        await client.enqueue(queue, "first")
        await client.enqueue(queue, "second")
        first = (await client.lease(queue, max_jobs=1))[0]
        task = asyncio.create_task(client.complete(first, Success(), fetch_next=1))
        await _in_the_pause_before_the_retry(lost)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _counts_once_settled(client, queue) == {"wait": 1, "active": 0, "completed": 1}


async def _counts_once_settled(client: AsyncClient, queue: str) -> dict[str, int]:
    """The queue's counts once no job is active, or after `SETTLE_SECONDS`."""
    counts: dict[str, int] = {}
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        counts = await client.counts(queue, "wait", "active", "completed")
        if counts["active"] == 0:
            break
        await asyncio.sleep(0.05)
    return counts


async def _first_of_two_leased(client: AsyncClient, queue: str) -> LeasedJob:
    """Two jobs added, and the first leased."""
    await client.enqueue(queue, "first")
    await client.enqueue(queue, "second")
    return (await client.lease(queue, max_jobs=1))[0]


async def _complete_fetching_next_cancelled_once(
    client: AsyncClient, first: LeasedJob, when: asyncio.Event
) -> None:
    """`first` completed, fetching the next job, in a task cancelled once `when` is set."""
    task = asyncio.create_task(
        client.complete(first, Success(), fetch_next=1, fetch_next_lock_duration_ms=60_000)
    )
    await when.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_completion_cancelled_in_its_retry_pause_as_the_server_restarts_gives_back_its_next_job(
    tmp_path: Path,
) -> None:
    # As above, with the server away when the answer was lost (why it was),
    # as a restart does: the completion sent again to learn what it fetched
    # is retried until the server is back. Sent once, it failed, and the
    # next job stayed with nobody until its lock expired.
    data_dir = tmp_path / "data"
    server = start_server(data_dir)
    port = int(server.url.rsplit(":", 1)[1])
    try:
        async with AsyncClient(server.url) as client:
            first = await _first_of_two_leased(client, "q")
            send = client._call
            lost = asyncio.Event()

            async def losing_as_the_server_stops(call: Any) -> Any:
                if call.rpc != "complete" or lost.is_set():
                    return await send(call)
                await send(call)
                await asyncio.to_thread(stop_server, server)
                lost.set()
                raise UnavailableError("the connection was reset")

            client._call = losing_as_the_server_stops  # type: ignore[method-assign]
            await _complete_fetching_next_cancelled_once(client, first, lost)
            await asyncio.sleep(0.5)
            server = await asyncio.to_thread(start_server, data_dir, None, port)
            assert await _counts_once_settled(client, "q") == {"wait": 1, "active": 0, "completed": 1}
    finally:
        stop_server(server)


async def test_a_completion_cancelled_in_flight_whose_answer_is_then_lost_gives_back_what_it_fetched(
    server: Server, queue: str
) -> None:
    # Cancelled while its request is out, the completion runs on to give back
    # the job it fetches; its answer lost, it is sent again to learn which.
    async with AsyncClient(server.url) as client:
        first = await _first_of_two_leased(client, queue)
        send = client.stub.complete
        applied = asyncio.Event()

        async def answer_lost_later(*args: Any, **kwargs: Any) -> Any:
            answer = await send(*args, **kwargs)
            if applied.is_set():
                return answer
            applied.set()
            await asyncio.sleep(0.3)
            raise ConnectError(Code.UNAVAILABLE, "the connection was reset")

        client.stub.complete = answer_lost_later  # type: ignore[method-assign]
        await _complete_fetching_next_cancelled_once(client, first, applied)
        await asyncio.sleep(0.5)
        assert await _counts_once_settled(client, queue) == {"wait": 1, "active": 0, "completed": 1}


async def test_closing_an_async_client_lets_a_cancelled_completion_answer_and_gives_back_its_next_job(
    server: Server, queue: str
) -> None:
    # Cancel the workers, then close the client: a completion fetching the
    # next job, in flight as its task was cancelled, is not cancelled by
    # `close()` (only long-polls still waiting are); it answers, and the job
    # it fetched goes back. Cancelled, it left that job with nobody.
    client = AsyncClient(server.url)
    first = await _first_of_two_leased(client, queue)
    send = client.stub.complete
    applied = asyncio.Event()

    async def answer_on_its_way(*args: Any, **kwargs: Any) -> Any:
        answer = await send(*args, **kwargs)
        applied.set()
        await asyncio.sleep(0.3)
        return answer

    client.stub.complete = answer_on_its_way  # type: ignore[method-assign]
    await _complete_fetching_next_cancelled_once(client, first, applied)
    await client.close()
    async with AsyncClient(server.url) as check:
        assert await _counts_once_settled(check, queue) == {"wait": 1, "active": 0, "completed": 1}


async def test_a_lease_cancelled_while_it_waits_to_resend_is_not_sent_again(
    server: Server, queue: str
) -> None:
    # The first try leased the job and its answer was lost; the caller is
    # cancelled in the pause before the retry. A lease has no key: sent again
    # to give back what it took, it took another job for nobody.
    async with AsyncClient(server.url) as client:
        await client.enqueue(queue, "first")
        await client.enqueue(queue, "second")
        leases = _losing_the_first_answer(client, "lease", UnavailableError("the answer was lost"))
        task = asyncio.create_task(client.lease(queue, max_jobs=1, lock_duration_ms=60_000))
        await _in_the_pause_before_the_retry(leases)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)
        assert len(leases) == 1
        # The lost try's job waits out its lock; the other was never taken.
        assert await client.counts(queue, "wait", "active") == {"wait": 1, "active": 1}
        second = await client.get_job(queue, "2")
        assert second is not None and second.attempts_started == 0


async def test_an_async_watchs_idle_timeout_is_checked_too(server: Server, queue: str) -> None:
    async with AsyncClient(server.url) as client:
        with pytest.raises(InvalidArgumentError, match="idle_timeout_ms"):
            client.watch(queue, idle_timeout_ms=-1)
        with pytest.raises(InvalidArgumentError, match="heartbeat"):
            client.watch(queue, idle_timeout_ms=5_000)
