"""Watching a queue's events, and resuming from a cursor."""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from pyqwest import SyncClient, SyncHTTPTransport

from loam_jobs import (
    Client,
    ClientClosedError,
    EventsTrimmedError,
    InvalidArgumentError,
    LoamJobsError,
    Success,
    UnavailableError,
    Watch,
)

from .conftest import Server, free_port, start_server, stop_server


def test_watch_iterates_live_events(client: Client, queue: str) -> None:
    with client.watch(queue) as watch:
        enqueued = client.enqueue(queue, "a", None)
        first = next(watch)
        assert first.name == "added" and first.job_id == enqueued.id
        assert watch.cursor == first.seq


def test_watch_resumes_from_its_cursor_without_gaps_or_repeats(client: Client, queue: str) -> None:
    start = client.last_event_seq(queue)
    ids = [client.enqueue(queue, "a", i).id for i in range(3)]

    # Each enqueue writes `added` then `waiting`: read the first three events only.
    with client.watch(queue, after=start) as watch:
        first_part = list(islice(watch, 3))
        cursor = watch.cursor
    assert [e.name for e in first_part] == ["added", "waiting", "added"]

    # More events happen while nobody watches.
    leased = client.lease(queue)[0]
    client.complete(leased, Success())

    with client.watch(queue, after=cursor) as watch:
        rest = list(islice(watch, 5))
    seqs = [e.seq for e in first_part + rest]
    assert seqs == list(range(start + 1, start + 9))
    assert [(e.name, e.job_id) for e in rest] == [
        ("waiting", ids[1]),
        ("added", ids[2]),
        ("waiting", ids[2]),
        ("active", ids[0]),
        ("completed", ids[0]),
    ]


def test_watch_one_job(client: Client, queue: str) -> None:
    other = client.enqueue(queue, "other", None)
    mine = client.enqueue(queue, "mine", None)
    with client.watch(queue, after=0, job_id=mine.id) as watch:
        events = list(islice(watch, 2))
    assert [e.name for e in events] == ["added", "waiting"]
    assert all(e.job_id == mine.id for e in events)
    assert other.id != mine.id


def test_events_long_poll(client: Client, queue: str) -> None:
    start = client.last_event_seq(queue)
    assert client.events(queue, after=start, wait_ms=100) == []
    client.enqueue(queue, "a", None)
    events = client.events(queue, after=start, limit=1)
    assert len(events) == 1 and events[0].seq == start + 1


def test_watch_survives_a_server_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    server = start_server(data_dir)
    port = int(server.url.rsplit(":", 1)[1])
    try:
        with Client(server.url) as client, client.watch("restarts") as watch:
            first = client.enqueue("restarts", "a", None)
            before = list(islice(watch, 2))
            assert [(e.name, e.job_id) for e in before] == [("added", first.id), ("waiting", first.id)]

            # SIGTERM ends the stream; the watch reconnects from its cursor
            # once the server is back on the same port and data.
            stop_server(server)
            server = start_server(data_dir, port=port)
            second = client.enqueue("restarts", "b", None)
            after = list(islice(watch, 2))
            assert [(e.name, e.job_id) for e in after] == [("added", second.id), ("waiting", second.id)]
            assert [e.seq for e in before + after] == list(range(before[0].seq, before[0].seq + 4))
    finally:
        stop_server(server)


def test_watch_gives_up_on_a_server_that_stays_down(tmp_path: Path) -> None:
    server = start_server(tmp_path / "data")
    with Client(server.url) as client:
        watch = client.watch("gone", max_reconnects=2)
        stop_server(server)
        with pytest.raises(UnavailableError):
            next(watch)


def test_watching_an_invalid_queue_is_refused(client: Client) -> None:
    with pytest.raises(InvalidArgumentError):
        client.watch("")
    with pytest.raises(InvalidArgumentError):
        next(client.watch("", after=0))


def test_a_cursor_behind_the_trimmed_log_is_refused(client: Client, queue: str) -> None:
    start = client.last_event_seq(queue)
    for i in range(5):
        client.enqueue(queue, "a", i)
    assert client.trim_events(queue, 2) == 8
    with pytest.raises(EventsTrimmedError) as trimmed:
        next(client.watch(queue, after=start + 1))
    assert trimmed.value.code == "out_of_range"
    oldest = int(trimmed.value.subject)
    assert oldest == start + 9
    # From the oldest kept event on, nothing is missing.
    with client.watch(queue, after=0) as watch:
        assert [e.seq for e in islice(watch, 2)] == [oldest, oldest + 1]


def _read_in_a_thread(watch: Watch) -> tuple[threading.Thread, list[object]]:
    """A thread that iterates `watch` to its end: its events, then "ended" or the error that ended it."""
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.extend(watch)
            outcome.append("ended")
        except Exception as err:  # noqa: BLE001 - the test reports whatever ended it
            outcome.append(err)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader, outcome


def _closed_from_another_thread_stops_at_once(watch: Watch) -> None:
    reader, outcome = _read_in_a_thread(watch)
    time.sleep(0.3)  # into its read
    closed = time.monotonic()
    watch.close()
    reader.join(timeout=8)
    assert not reader.is_alive(), "close() did not stop the reading thread"
    assert time.monotonic() - closed < 1
    assert outcome == ["ended"]


def test_a_watch_closed_from_another_thread_stops_at_once(client: Client, queue: str) -> None:
    # The reader went on waiting for the server's next message, a heartbeat
    # up to 5 s away on an idle queue.
    _closed_from_another_thread_stops_at_once(client.watch(queue))


def test_a_watch_closed_between_reconnects_stops_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its server gone, the watch pauses before each reconnect, longer each
    # time (up to 2 s): `close()` ended the iteration only once the pause
    # under way was over. Each pause is a minute here, so that waiting one
    # out cannot pass for stopping at once.
    monkeypatch.setattr("loam_jobs.client.retry_pause", lambda pause, err: 60.0)
    server = start_server(tmp_path / "data")
    with Client(server.url) as client:
        watch = client.watch("gone", max_reconnects=None)
        stop_server(server)
        reader, outcome = _read_in_a_thread(watch)
        deadline = time.monotonic() + 10
        while not watch._reconnect.failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch._reconnect.failures == 1, "the watch is not in its pause before a reconnect"
        closed = time.monotonic()
        watch.close()
        reader.join(timeout=10)
        assert not reader.is_alive(), "close() did not stop the reading thread"
        assert time.monotonic() - closed < 5
        assert outcome == ["ended"]


def test_a_watch_of_a_frozen_server_closed_from_another_thread_stops_at_once(tmp_path: Path) -> None:
    # With no idle timeout, the reader waited for as long as the server was frozen.
    server = start_server(tmp_path / "data")
    try:
        with Client(server.url) as client:
            watch = client.watch("frozen", idle_timeout_ms=None)
            # A server that stops answering without closing anything: SIGSTOP.
            server.process.send_signal(signal.SIGSTOP)
            try:
                _closed_from_another_thread_stops_at_once(watch)
            finally:
                server.process.send_signal(signal.SIGCONT)
    finally:
        stop_server(server)


def test_a_watch_left_with_break_and_dropped_stops_reading_its_stream(client: Client, queue: str) -> None:
    # Its stream is read on a thread of its own: dropped without close(), the
    # watch must stop that thread as it is collected (its stream was closed then).
    client.enqueue(queue, "one")
    watch = client.watch(queue, after=0)
    for _event in watch:
        break
    pump = watch._pump
    assert pump is not None
    del watch, _event
    gc.collect()
    assert pump._stopped.is_set()


def test_an_event_that_comes_as_a_watch_is_closed_is_not_skipped_by_its_cursor(
    client: Client, queue: str
) -> None:
    # The reader, still in its read when close() returned, moved the cursor
    # past the event that ended the read, then dropped it: a watch resumed
    # from the cursor never saw it.
    watch = client.watch(queue)
    reader, outcome = _read_in_a_thread(watch)
    time.sleep(0.3)  # into its read
    watch.close()
    added = client.enqueue(queue, "as-it-closes")
    reader.join(timeout=8)
    assert outcome == ["ended"]
    with client.watch(queue, after=watch.cursor) as resumed:
        event = next(resumed)
    assert (event.name, event.job_id) == ("added", added.id)


def test_threads_iterating_one_watch_take_each_event_once(client: Client, queue: str) -> None:
    count = 40
    taken: list[list[tuple[int, str, str]]] = [[], []]
    errors: list[BaseException] = []
    with client.watch(queue) as watch:

        def take(mine: list[tuple[int, str, str]]) -> None:
            try:
                for event in watch:
                    mine.append((event.seq, event.name, event.job_id))
                    if sum(name == "added" for _, name, _ in taken[0] + taken[1]) >= count:
                        watch.close()
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=take, args=(mine,)) for mine in taken]
        for thread in threads:
            thread.start()
        ids = [client.enqueue(queue, "a", i).id for i in range(count)]
        for thread in threads:
            thread.join(timeout=30)
    assert errors == []
    assert not any(thread.is_alive() for thread in threads)
    seqs = sorted(seq for seq, _, _ in taken[0] + taken[1])
    # Each event once, none skipped, in one thread or the other.
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert {job_id for _, name, job_id in taken[0] + taken[1] if name == "added"} == set(ids)


def test_a_watch_takes_a_silent_stream_for_dead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stopped server sends no heartbeat either: the floor under idle
    # timeouts, there for the heartbeat, would only make this test wait 12 s.
    monkeypatch.setattr("loam_jobs.client.MIN_WATCH_IDLE_TIMEOUT_MS", 1)
    server = start_server(tmp_path / "data")
    try:
        client = Client(server.url)
        with client, client.watch("frozen", max_reconnects=1, idle_timeout_ms=500) as watch:
            outcome: list[object] = []

            def read() -> None:
                try:
                    outcome.append(next(watch))
                except Exception as err:  # noqa: BLE001 - the test reports whatever ended it
                    outcome.append(err)

            # A server that stops answering without closing anything: SIGSTOP.
            server.process.send_signal(signal.SIGSTOP)
            try:
                reader = threading.Thread(target=read, daemon=True)
                reader.start()
                reader.join(timeout=10)
                assert not reader.is_alive(), "the watch waited on a silent stream for ever"
            finally:
                server.process.send_signal(signal.SIGCONT)
            assert len(outcome) == 1 and isinstance(outcome[0], UnavailableError), outcome
    finally:
        stop_server(server)


def test_a_watch_of_one_job_resumes_past_other_jobs_events_the_log_dropped(
    client: Client, queue: str
) -> None:
    mine = client.enqueue(queue, "mine", None)
    watch = client.watch(queue, after=0, job_id=mine.id)
    assert [e.name for e in islice(watch, 2)] == ["added", "waiting"]
    reader = threading.Thread(target=lambda: list(watch), daemon=True)
    reader.start()
    for i in range(20):
        client.enqueue(queue, "other", i)
    last = client.last_event_seq(queue)
    # Heartbeats carry the watch's cursor past the other jobs' events.
    deadline = time.monotonic() + 8
    while (watch.cursor or 0) < last and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch.cursor == last
    watch.close()
    client.trim_events(queue, 5)
    # Resuming from that cursor misses nothing of `mine` and is not refused.
    with client.watch(queue, after=watch.cursor, job_id=mine.id) as resumed:
        client.complete(client.lease(queue)[0], Success())
        assert [e.name for e in islice(resumed, 2)] == ["active", "completed"]
    reader.join(timeout=8)


# Three restarts, each followed by a wait of up to 7 s for the server's
# heartbeat: past the 30 s every other test gets (pyproject.toml) on a busy machine.
@pytest.mark.timeout(60)
def test_a_watch_that_reconnected_counts_its_failures_afresh(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    server = start_server(data_dir)
    port = int(server.url.rsplit(":", 1)[1])
    try:
        with Client(server.url) as client:
            # Tries enough to outlast a slow restart (5.6 to 11.2 s of pauses).
            watch = client.watch("quiet", max_reconnects=10)
            reconnect = watch._reconnect
            # The failures in a row that each pause before a reconnect follows.
            counted: list[int] = []
            pause_after = reconnect.pause_after

            def counting(err: LoamJobsError) -> float:
                pause = pause_after(err)
                counted.append(reconnect.failures)
                return pause

            reconnect.pause_after = counting  # type: ignore[method-assign]
            seen: list[object] = []

            def read() -> None:
                try:
                    seen.extend(islice(watch, 1))
                except Exception as err:  # noqa: BLE001 - the test reports whatever ended it
                    seen.append(err)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            # Each restart costs the watch failed reconnects; once back, the
            # server's heartbeat (within 5 s) shows the stream works again,
            # and the count starts over: the next restart's first failure is
            # the first in a row. Counted on, three restarts ended a watch that
            # each alone left alive. (Checked on the count: whether three
            # restarts use up the watch's tries depends on how many each costs,
            # which depends on how busy the machine is.)
            for _ in range(3):
                before = len(counted)
                stop_server(server)
                server = start_server(data_dir, port=port)
                deadline = time.monotonic() + 15
                while (len(counted) == before or reconnect.failures) and time.monotonic() < deadline:
                    assert seen == [], f"the watch ended after a restart it survived: {seen}"
                    time.sleep(0.05)
                assert len(counted) > before, "the restart cost the watch no failed reconnect"
                assert counted[before] == 1, f"failures counted on from before the restart: {counted}"
                assert reconnect.failures == 0, "no message from the server started the count over"
            client.enqueue("quiet", "a", None)
            reader.join(timeout=5)
            assert [e.name for e in seen] == ["added"]  # type: ignore[attr-defined]
    finally:
        stop_server(server)


def test_a_long_lease_cut_short_by_a_server_shutdown_returns_empty(tmp_path: Path) -> None:
    # A wait past the server's 30 s goes in slices; the shutdown ends the
    # first early, and the lease answers empty, as a wait of one slice does,
    # instead of sending the next slice into a server going away.
    server = start_server(tmp_path / "data")
    with Client(server.url) as client:
        results: list[object] = []
        waiting = threading.Thread(target=lambda: results.append(_lease_or_error(client, 60_000)))
        waiting.start()
        time.sleep(0.5)
        started = time.monotonic()
        stop_server(server)
        waiting.join(timeout=15)
        assert not waiting.is_alive()
        assert time.monotonic() - started < 10
        assert len(results) == 1 and not isinstance(results[0], Exception), results
        assert results[0].jobs == []  # type: ignore[attr-defined]


def _lease_or_error(client: Client, wait_ms: int) -> object:
    try:
        return client.lease("slices", wait_ms=wait_ms)
    except Exception as err:  # noqa: BLE001 - the test reports what came back
        return err


def test_an_idle_timeout_is_a_whole_number_of_ms_above_0(client: Client, queue: str) -> None:
    for bad in (0, -1, 1.5, True, "20000"):
        with pytest.raises(InvalidArgumentError, match="idle_timeout_ms"):
            client.watch(queue, after=0, idle_timeout_ms=bad)  # type: ignore[arg-type]
    client.watch(queue, after=0, idle_timeout_ms=None).close()
    client.watch(queue, after=0, idle_timeout_ms=6_000).close()


def test_an_idle_timeout_the_servers_heartbeat_would_not_meet_is_refused(client: Client, queue: str) -> None:
    # On an idle queue the server's first message is a heartbeat after 5 s: a
    # shorter timeout took every stream for dead, and the watch gave up on a
    # healthy server after max_reconnects + 1 silent streams.
    for short in (1, 1_000, 5_000, 5_999):
        with pytest.raises(InvalidArgumentError, match="heartbeat"):
            client.watch(queue, after=0, idle_timeout_ms=short)


def test_a_watch_at_the_shortest_idle_timeout_outlasts_an_idle_queue(client: Client, queue: str) -> None:
    # With no reconnect allowed, one stream taken for dead would raise.
    with client.watch(queue, max_reconnects=0, idle_timeout_ms=6_000) as watch:
        late = threading.Timer(7.5, lambda: client.enqueue(queue, "late", None))
        late.start()
        try:
            event = next(watch)
        finally:
            late.join()
        assert event.name == "added"


def _closed(transport: SyncHTTPTransport, server: Server) -> bool:
    """Whether `transport` was closed: it has no public state that says so,
    but a closed one refuses to send."""
    try:
        SyncClient(transport).get(f"{server.url}/healthz")
    except RuntimeError as err:
        return "closed" in str(err)
    return False


def test_a_watch_ended_by_an_error_closes_its_connections(
    server: Server, client: Client, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A watch's own connections are nowhere public: the transports it makes
    # are recorded as the client module makes them.
    made: list[SyncHTTPTransport] = []

    def recorded(**settings: Any) -> SyncHTTPTransport:
        made.append(SyncHTTPTransport(**settings))
        return made[-1]

    monkeypatch.setattr("loam_jobs.client.SyncHTTPTransport", recorded)
    start = client.last_event_seq(queue)
    for i in range(5):
        client.enqueue(queue, "a", i)
    client.trim_events(queue, 2)
    closed_client = Client(server.url)
    closed_client.close()
    unreachable = Client(f"http://127.0.0.1:{free_port()}")
    ended: list[tuple[Callable[[], Watch], type[LoamJobsError], int]] = [
        (lambda: client.watch(queue, after=start + 1), EventsTrimmedError, 1),
        (lambda: unreachable.watch(queue, after=0, max_reconnects=0), UnavailableError, 1),
        # Refused before a stream opens: no connections are made.
        (lambda: closed_client.watch(queue, after=0), ClientClosedError, 0),
    ]
    with unreachable:
        for make, error, opened in ended:
            made.clear()
            watch = make()
            with pytest.raises(error):
                next(watch)
            # Before, they were held until the watch was collected.
            assert len(made) == opened and all(_closed(transport, server) for transport in made), error
            # Iterated again, it opens new ones, meets the same end, and lets go again.
            with pytest.raises(error):
                next(watch)
            assert len(made) == 2 * opened and all(_closed(transport, server) for transport in made), error
            watch.close()
            watch.close()


def test_a_failure_to_let_go_does_not_hide_the_error_that_ended_a_watch(
    client: Client, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = client.last_event_seq(queue)
    for i in range(5):
        client.enqueue(queue, "a", i)
    client.trim_events(queue, 2)

    def failing(self: Watch) -> None:
        raise RuntimeError("closing the connections failed")

    monkeypatch.setattr(Watch, "_let_go", failing)
    # Before: the RuntimeError stood in for it (the trim survived only as its context).
    with pytest.raises(EventsTrimmedError):
        next(client.watch(queue, after=start + 1))


def test_a_watch_refused_for_want_of_room_waits_as_long_as_the_server_asks(tmp_path: Path) -> None:
    server = start_server(tmp_path / "data", args=["--max-waiting-calls-per-namespace", "1"])
    try:
        with Client(server.url) as client:
            client.enqueue("full", "a", None)
            with client.watch("full", after=0) as holder:
                next(holder)  # its stream stays open: the namespace's one place
                refused = client.watch("full", after=0, max_reconnects=2)
                started = time.monotonic()
                with pytest.raises(UnavailableError) as busy:
                    next(refused)
                assert busy.value.retry_after_ms == 1_000
                # Two pauses of at least the 1 s asked for, where a watch
                # reconnected after 50 and 100 ms, into the same refusal.
                assert time.monotonic() - started >= 2.0
    finally:
        stop_server(server)
