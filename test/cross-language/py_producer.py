"""Adds COUNT jobs named `py-<i>` to QUEUE with the Python client."""

import sys

from loam_jobs import Client

url, queue, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
jobs = Client(url)
for i in range(count):
    added = jobs.enqueue(queue, f"py-{i}", {"origin": "python", "i": i})
    print(f"added {added.id} py-{i}", flush=True)
