"""Leases and completes jobs of QUEUE until SIGTERM; prints `done <id> <name>
<origin>` per completion the server acknowledged. Rides out a server restart:
a refused call is tried again, and a lease lost in the crash (fenced) is
dropped, since the job is delivered again."""

import signal
import sys
import time

from loam_jobs import Client, FencedError, LoamJobsError, Success, UnavailableError

url, queue = sys.argv[1], sys.argv[2]
jobs = Client(url)
stopping = False


def stop(*_: object) -> None:
    global stopping
    stopping = True


signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while not stopping:
    try:
        batch = jobs.lease(queue, max_jobs=5, wait_ms=200, lock_duration_ms=2_000)
    except UnavailableError:
        time.sleep(0.1)
        continue
    for leased in batch:
        data = leased.json()
        try:
            jobs.complete(leased, Success({"by": "python"}))
        except (FencedError, UnavailableError):
            continue
        except LoamJobsError as err:
            print(f"failed {leased.id} {err}", flush=True)
            continue
        print(f"done {leased.id} {leased.name} {data['origin']}", flush=True)
