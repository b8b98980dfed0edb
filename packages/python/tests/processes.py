"""Producer and worker processes for test_processes.py (run as scripts).

    python processes.py produce URL QUEUE PRODUCER_ID COUNT
    python processes.py work URL QUEUE WORKER_ID TOTAL

A worker prints, as JSON, the ids of the jobs whose completion the server
accepted from it, once the queue has TOTAL completed jobs.
"""

from __future__ import annotations

import json
import sys
import time

from loam_jobs import Client, Success, job


def produce(url: str, queue: str, producer: str, count: int) -> None:
    with Client(url) as client:
        half = count // 2
        # Half one at a time, half in bulk, so both paths meet the workers.
        for i in range(half):
            client.enqueue(queue, "work", {"producer": producer, "i": i})
        specs = [job("work", {"producer": producer, "i": i}) for i in range(half, count)]
        for result in client.enqueue_bulk(queue, specs):
            if isinstance(result, Exception):
                raise result


def work(url: str, queue: str, worker: str, total: int) -> None:
    done: list[str] = []
    deadline = time.monotonic() + 45
    with Client(url) as client:
        while time.monotonic() < deadline:
            batch = client.lease(queue, max_jobs=5, wait_ms=300, worker=worker)
            for leased in batch:
                client.complete(leased, Success({"worker": worker, "input": leased.json()}))
                done.append(leased.id)
            if not batch and client.counts(queue, "completed")["completed"] >= total:
                break
    print(json.dumps(done))


if __name__ == "__main__":
    mode, url, queue, name, number = sys.argv[1:6]
    if mode == "produce":
        produce(url, queue, name, int(number))
    else:
        work(url, queue, name, int(number))
