/**
 * Producers and workers in Node (BullMQ's classes over `loamBackend({ url })`)
 * and in Python (`loam_jobs`), each in its own process, on one queue of a real
 * `loam-jobs serve`: every job either language added is completed exactly
 * once, by whichever worker leased it.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { withBackend } from 'bullmq';
import { loamBackend } from '@loam/bullmq';
import { startLoamServer, type LoamServer } from '../../packages/bullmq/test/remote-server.js';

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, '../..');
const python = path.join(process.env.LOAM_PY_VENV ?? path.join(repo, 'packages/python/.venv'), 'bin/python');

/** A child process whose stdout lines are collected. */
interface Child {
  process: ChildProcess;
  lines: string[];
  exited: Promise<number | null>;
}

function run(command: string, args: string[]): Child {
  const child = spawn(command, args, { cwd: here, stdio: ['ignore', 'pipe', 'inherit'] });
  const lines: string[] = [];
  let partial = '';
  child.stdout!.on('data', (chunk: Buffer) => {
    const text = partial + chunk.toString();
    const parts = text.split('\n');
    partial = parts.pop() ?? '';
    lines.push(...parts);
  });
  const exited = new Promise<number | null>(resolve => child.once('exit', code => resolve(code)));
  return { process: child, lines, exited };
}

async function until(what: string, predicate: () => boolean, timeoutMs = 60_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!predicate()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise(r => setTimeout(r, 50));
  }
}

/** The `index`-th word of each line of `children` that starts with `tag` (`added`, `done`, ...). */
function field(children: Child[], tag: string, index = 1): string[] {
  return children.flatMap(c => c.lines.filter(l => l.startsWith(`${tag} `)).map(l => l.split(' ')[index]));
}

/** Two Node and two Python workers on `queue`, ready; then a Node and a Python producer of `perProducer` jobs each. */
async function startLoad(url: string, queue: string, perProducer: number): Promise<{ workers: Child[]; producers: Child[] }> {
  const workers = [
    run('node', ['node-worker.mjs', url, queue]),
    run('node', ['node-worker.mjs', url, queue]),
    run(python, ['py_worker.py', url, queue]),
    run(python, ['py_worker.py', url, queue]),
  ];
  await until('the workers', () => workers.every(w => w.lines.includes('ready')));
  const producers = [
    run('node', ['node-producer.mjs', url, queue, String(perProducer)]),
    run(python, ['py_producer.py', url, queue, String(perProducer)]),
  ];
  return { workers, producers };
}

let server: LoamServer;

beforeAll(async () => {
  if (!existsSync(python)) {
    throw new Error(`no Python client at ${python}: run ./scripts/install.sh (or set LOAM_PY_VENV)`);
  }
  server = await startLoamServer();
});

afterAll(async () => {
  await server?.stop();
});

/** Jobs a Python producer describes with the client's own fields, and bytes that are not JSON. */
const PYTHON_JOBS = `
import sys
from loam_jobs import Client, ParentRef, Success, flow_node, job
url, queue, done_queue = sys.argv[1:4]
jobs = Client(url)
jobs.enqueue(queue, "retried", {"n": 1}, job_id="retried", attempts=3, backoff=50, keep_logs=2)
jobs.enqueue(queue, "bytes", b"raw \\x00 bytes", job_id="bytes")
jobs.enqueue(done_queue, "c", None, job_id="c")
leased = jobs.lease(done_queue)
jobs.complete(leased[0], Success(b"raw \\x00 result"))
parent = ParentRef(queue=queue + "-parents", id="P")
jobs.flow([
    flow_node(queue + "-parents", job("parent", None, job_id="P"), wait_children=True),
    flow_node(queue + "-kids", job("kid", 1, job_id="K1", parent=parent)),
    flow_node(queue + "-kids", job("kid", 2, job_id="K2", parent=parent)),
])
for kid in jobs.lease(queue + "-kids", max_jobs=2):
    jobs.complete(kid, Success(kid.json() * 10))
print("ready", flush=True)
`;

describe('Node and Python on one queue of loam-jobs serve', () => {
  it("runs a Python job under BullMQ's Worker with the job's attempts, backoff and kept logs, and reads bytes that are not JSON as text", async () => {
    // BullMQ read none of those fields (it reads job.opts, which Python leaves
    // empty), so the job failed at its first error; data or a return value that
    // is not JSON failed the Worker's fetch, every getter listing the job, and
    // stopped QueueEvents for good.
    const queue = `py-opts-${Date.now()}`;
    const doneQueue = `${queue}-done`;
    const producer = run(python, ['-c', PYTHON_JOBS, server.url, queue, doneQueue]);
    expect(await producer.exited).toBe(0);
    expect(producer.lines).toEqual(['ready']);

    const { Queue, Worker, QueueEvents, FlowProducer } = withBackend(loamBackend({ url: server.url }));
    const events = new QueueEvents(doneQueue, { connection: {}, lastEventId: '0-0' });
    const completions: [string, unknown][] = [];
    events.on('completed', ({ jobId, returnvalue }) => completions.push([jobId, returnvalue]));
    const runs: string[] = [];
    const worker = new Worker(
      queue,
      async job => {
        runs.push(job.name);
        if (job.name === 'bytes') return job.data;
        for (const row of ['l1', 'l2', 'l3', 'l4']) await job.log(row);
        if (job.attemptsMade < 2) throw new Error(`attempt ${job.attemptsMade + 1}`);
        return 'third time';
      },
      { connection: {} },
    );
    const q = new Queue(queue, { connection: {} });
    await until('both jobs to complete', () => runs.length >= 4, 20_000);
    await new Promise(r => setTimeout(r, 200));
    expect(runs.sort()).toEqual(['bytes', 'retried', 'retried', 'retried']);
    const retried = (await q.getJob('retried'))!;
    expect([retried.attemptsMade, retried.returnvalue, retried.opts.attempts]).toEqual([3, 'third time', 3]);
    expect(retried.opts.backoff).toEqual({ type: 'fixed', delay: 50 });
    expect(await q.getJobLogs('retried')).toEqual({ logs: ['l3', 'l4'], count: 2 });
    expect((await q.getJob('bytes'))!.returnvalue).toBe('raw \x00 bytes');
    expect((await q.getCompleted()).map(j => j.id).sort()).toEqual(['bytes', 'retried']);

    // QueueEvents read the bytes result, and goes on to the next completion.
    const d = new Queue(doneQueue, { connection: {} });
    const after = new Worker(doneQueue, async () => 'next', { connection: {} });
    await d.add('next', {});
    await until('both completions', () => completions.length >= 2, 20_000);
    expect(completions[0]).toEqual(['c', 'raw \x00 result']);
    expect(completions[1][1]).toBe('next');
    expect((await d.getJob('c'))!.returnvalue).toBe('raw \x00 result');
    await Promise.all([after.close(), worker.close(), events.close()]);
    await Promise.all([q.close(), d.close()]);

    // A Python flow's keys are BullMQ's (`bull:<queue>:<id>`): getFlow found no children.
    const flows = new FlowProducer({ connection: {} });
    const tree = await flows.getFlow({ id: 'P', queueName: `${queue}-parents` });
    expect(tree.children?.map(child => child?.job.id).sort()).toEqual(['K1', 'K2']);
    expect(await tree.job.getChildrenValues()).toEqual({ [`bull:${queue}-kids:K1`]: 10, [`bull:${queue}-kids:K2`]: 20 });
    await flows.close();
  });

  it('completes every job of both producers exactly once, across both kinds of worker', async () => {
    const queue = `mixed-${Date.now()}`;
    const perProducer = 60;
    const { workers, producers } = await startLoad(server.url, queue, perProducer);
    expect(await Promise.all(producers.map(p => p.exited))).toEqual([0, 0]);
    const added = field(producers, 'added');
    expect(added).toHaveLength(2 * perProducer);
    expect(new Set(added).size).toBe(2 * perProducer);

    await until('every job to be done', () => field(workers, 'done').length >= added.length);
    for (const w of workers) w.process.kill('SIGTERM');
    expect(await Promise.all(workers.map(w => w.exited))).toEqual([0, 0, 0, 0]);

    const completed = field(workers, 'done');
    expect(completed).toHaveLength(added.length);
    expect(new Set(completed)).toEqual(new Set(added));
    expect(field(workers, 'failed')).toEqual([]);
    // Both origins reached the workers intact (each worker checks the data).
    expect(new Set(field(workers, 'done', 3))).toEqual(new Set(['node', 'python']));

    const { Queue } = withBackend(loamBackend({ url: server.url }));
    const q = new Queue(queue, { connection: {} });
    const counts = await q.getJobCounts('completed', 'failed', 'active', 'wait');
    expect(counts).toEqual({ completed: added.length, failed: 0, active: 0, wait: 0 });
    await q.close();
  });

  it('loses no acknowledged job and records each outcome once when the server is SIGKILLed under load', async () => {
    const queue = `crash-${Date.now()}`;
    const perProducer = 150;
    const { workers, producers } = await startLoad(server.url, queue, perProducer);
    const acknowledged = () => field(producers, 'added');
    const done = () => field(workers, 'done');

    // Mid-load: some jobs added, some completed, the rest still to come.
    await until('the load to be under way', () => acknowledged().length >= 60 && done().length >= 10);
    const beforeCrash = new Set(acknowledged());
    await server.kill();
    await new Promise(r => setTimeout(r, 300));
    server = await startLoamServer({}, { listen: new URL(server.url).host, dataDir: server.dataDir });

    expect(await Promise.all(producers.map(p => p.exited))).toEqual([0, 0]);
    const all = acknowledged();
    expect(new Set(all).size).toBe(2 * perProducer);
    for (const id of beforeCrash) expect(all).toContain(id);

    const { Queue } = withBackend(loamBackend({ url: server.url }));
    const q = new Queue(queue, { connection: {} });
    // The store, not the workers' output, says when all is done: a completion
    // committed just before the kill may never have reached its worker.
    let counts: Record<string, number> = {};
    const deadline = Date.now() + 60_000;
    try {
      while ((counts = await q.getJobCounts('completed', 'failed', 'active', 'wait', 'delayed')).completed < all.length) {
        if (Date.now() > deadline) throw new Error(`not every job completed in time: ${JSON.stringify(counts)}`);
        await new Promise(r => setTimeout(r, 100));
      }
    } finally {
      for (const w of workers) w.process.kill('SIGTERM');
    }
    expect(await Promise.all(workers.map(w => w.exited))).toEqual([0, 0, 0, 0]);
    expect(counts).toEqual({ completed: all.length, failed: 0, active: 0, wait: 0, delayed: 0 });

    // No completion was acknowledged twice, and only acknowledged jobs were completed.
    expect(done()).toHaveLength(new Set(done()).size);
    for (const id of done()) expect(all).toContain(id);
    const completed = await q.getJobs(['completed'], 0, -1);
    expect(new Set(completed.map(j => j.id))).toEqual(new Set(all));
    await q.close();
  });
});
