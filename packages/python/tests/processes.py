"""Producer and worker processes for test_processes.py (run as scripts).

    python processes.py produce URL QUEUE PRODUCER_ID COUNT
    python processes.py work URL QUEUE WORKER_ID TOTAL
    python processes.py async-then-exit URL QUEUE - COUNT
    python processes.py watch-cancelled URL QUEUE - -

A worker prints, as JSON, the ids of the jobs whose completion the server
accepted from it, once the queue has TOTAL completed jobs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from loam_jobs import AsyncClient, Client, Success, job


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


async def async_then_exit(url: str, queue: str, count: int) -> None:
    """Adds and works `count` jobs through two AsyncClients, rests, reads,
    and returns: the process exits right after its last call."""
    async with AsyncClient(url) as producer, AsyncClient(url) as worker:
        for _ in range(count):
            await producer.enqueue(queue, "work")
            for leased in await worker.lease(queue):
                await worker.complete(leased)
        await asyncio.sleep(0.2)
        await producer.counts(queue, "wait")
        await producer.ranges(queue, ["active"])


async def watch_cancelled(url: str, queue: str) -> None:
    """Iterates a watch in a task, cancels the task, and returns."""
    async with AsyncClient(url) as client:

        async def iterate() -> None:
            async for _ in client.watch(queue):
                pass

        task = asyncio.create_task(iterate())
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


if __name__ == "__main__":
    mode, url, queue, name, number = sys.argv[1:6]
    if mode == "produce":
        produce(url, queue, name, int(number))
    elif mode == "work":
        work(url, queue, name, int(number))
    elif mode == "async-then-exit":
        asyncio.run(async_then_exit(url, queue, int(number)))
    else:
        asyncio.run(watch_cancelled(url, queue))
