"""Leases and completes jobs of QUEUE until SIGTERM; prints `done <id> <name> <origin>` per job."""

import signal
import sys

from loam_jobs import Client, Success

url, queue = sys.argv[1], sys.argv[2]
jobs = Client(url)
stopping = False


def stop(*_: object) -> None:
    global stopping
    stopping = True


signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while not stopping:
    for leased in jobs.lease(queue, max_jobs=5, wait_ms=200):
        data = leased.json()
        jobs.complete(leased, Success({"by": "python"}))
        print(f"done {leased.id} {leased.name} {data['origin']}", flush=True)
