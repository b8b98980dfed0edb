"""Several producer and worker processes on one queue: every job completes exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loam_jobs import Client, JobState

from .conftest import Server

HELPER = str(Path(__file__).with_name("processes.py"))
PRODUCERS = 3
WORKERS = 4
JOBS_PER_PRODUCER = 100


def test_many_producers_and_workers_complete_each_job_once(
    server: Server, client: Client, queue: str
) -> None:
    total = PRODUCERS * JOBS_PER_PRODUCER
    workers = [
        subprocess.Popen(
            [sys.executable, HELPER, "work", server.url, queue, f"w{i}", str(total)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(WORKERS)
    ]
    producers = [
        subprocess.Popen(
            [sys.executable, HELPER, "produce", server.url, queue, f"p{i}", str(JOBS_PER_PRODUCER)]
        )
        for i in range(PRODUCERS)
    ]
    for producer in producers:
        assert producer.wait(timeout=60) == 0
    completed_by: dict[str, list[str]] = {}
    for i, worker in enumerate(workers):
        out, _ = worker.communicate(timeout=60)
        assert worker.returncode == 0
        completed_by[f"w{i}"] = json.loads(out)

    all_done = [job_id for ids in completed_by.values() for job_id in ids]
    assert len(all_done) == total, "a job was completed twice, or not at all"
    assert len(set(all_done)) == total
    assert client.counts(queue, "completed", "wait", "active") == {"completed": total, "wait": 0, "active": 0}

    # Each stored result names the one worker whose completion was accepted,
    # and every producer's every input was processed.
    inputs = set()
    for worker, ids in completed_by.items():
        for stored in client.get_jobs(queue, ids):
            assert stored is not None and stored.state == JobState.COMPLETED
            result = json.loads(stored.return_value)
            assert result["worker"] == worker
            inputs.add((result["input"]["producer"], result["input"]["i"]))
    assert inputs == {(f"p{p}", i) for p in range(PRODUCERS) for i in range(JOBS_PER_PRODUCER)}
    # More than one worker took part.
    assert sum(1 for ids in completed_by.values() if ids) > 1
