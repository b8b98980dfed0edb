"""Watching a queue's events, and resuming from a cursor."""

from __future__ import annotations

from itertools import islice

from loam_jobs import Client, Success


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
