"""Adds COUNT jobs with ids `py-<i>` to QUEUE; prints `added <id>` once an add
is acknowledged. An add refused while the server is down is sent again (same
id, so a retry of an add that did land returns the job it made)."""

import sys
import time

from loam_jobs import Client, UnavailableError

url, queue, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
jobs = Client(url)
for i in range(count):
    while True:
        try:
            added = jobs.enqueue(queue, f"py-{i}", {"origin": "python", "i": i}, job_id=f"py-{i}")
            print(f"added {added.id}", flush=True)
            break
        except UnavailableError as err:
            print(f"add py-{i}: {err}; retrying", file=sys.stderr, flush=True)
            time.sleep(0.1)
