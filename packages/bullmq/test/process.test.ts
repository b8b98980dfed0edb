import { afterAll, describe, expect, it } from 'vitest';
import { execFileSync, spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import * as path from 'node:path';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { ConnectionClosedError, withBackend, type Job } from 'bullmq';
import { loamBackend } from '../src/index.js';
import { INTERRUPTED_WAIT } from '../src/common.js';
import { freshLoam, itInProcess, testHooks, until } from './helpers.js';

const loam = freshLoam();
const { Queue, Worker } = loam;
const connection = {};
const here = path.dirname(fileURLToPath(import.meta.url));
const entry = path.resolve(here, '../dist/index.js');
const examples = path.resolve(here, '../../../examples');

afterAll(() => loam.cleanup());

/**
 * Runs Node with `args` in a fresh process; resolves with its output.
 * `onLine` sees each line of its output, with a way to signal it (SIGKILL
 * unless told); a process still running after `killAfterMs` is killed.
 */
function runProcess(
  args: string[],
  opts: {
    onLine?: (line: string, kill: (signal?: NodeJS.Signals) => void) => void;
    env?: NodeJS.ProcessEnv;
    killAfterMs?: number;
  } = {},
) {
  return new Promise<{ out: string; signal: NodeJS.Signals | null; code: number | null }>(resolve => {
    const child = spawn(process.execPath, args, { stdio: ['ignore', 'pipe', 'inherit'], env: opts.env });
    const deadline = opts.killAfterMs === undefined ? undefined : setTimeout(() => child.kill('SIGKILL'), opts.killAfterMs);
    let out = '';
    child.stdout.on('data', chunk => {
      out += chunk;
      for (const line of String(chunk).split('\n').filter(Boolean)) {
        opts.onLine?.(line, signal => child.kill(signal ?? 'SIGKILL'));
      }
    });
    child.on('exit', (code, signal) => {
      clearTimeout(deadline);
      resolve({ out, signal, code });
    });
  });
}

/** Runs an ES module snippet in a fresh Node process; resolves with its output. */
function runNode(code: string, onLine?: (line: string, kill: () => void) => void) {
  return runProcess(['--input-type=module', '-e', code], { onLine });
}

describe('processes', () => {
  // The store opens on a thread of its own, so the backend is made at once;
  // what the open finds fails its readiness and every call.
  itInProcess('a second process fails at once, pointing to loam-jobs serve', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    try {
      await queue.add('held', {});
      const started = Date.now();
      const { out } = await runNode(`
        const { loamBackend } = await import(${JSON.stringify(entry)});
        const backend = loamBackend(${JSON.stringify(loam.settings)})('other', {}, {});
        const outcome = p => p.then(() => ({ opened: true }), e => ({ code: e.code, message: e.message }));
        const [ready, add] = await Promise.all([
          outcome(backend.waitUntilReady()),
          outcome(backend.addJob({ name: 'job', data: '{}', opts: {}, timestamp: Date.now() }, 'a')),
        ]);
        await backend.close();
        console.log(JSON.stringify({ ready, add }));
      `);
      const { ready, add } = JSON.parse(out.trim());
      expect(ready.code).toBe('LOAM_STORE_LOCKED');
      expect(ready.message).toContain('already open in another process');
      expect(ready.message).toContain('loam-jobs serve');
      expect(ready.message).toContain('loamBackend({ url })');
      expect(add).toEqual(ready);
      expect(Date.now() - started).toBeLessThan(5_000);
      expect(await queue.count()).toBe(1);
    } finally {
      await queue.close();
    }
  });

  // BullMQ's Worker makes its backend before it checks its options: one whose
  // constructor threw left the store open, and locked to other processes,
  // for the life of the process.
  itInProcess('a backend BullMQ made and let go of unclosed gives the store back once collected', async () => {
    const dir = mkdtempSync(path.join(tmpdir(), 'loam-abandoned-'));
    try {
      let opened: Promise<string> | undefined;
      await runProcess(
        [
          '--expose-gc',
          '--input-type=module',
          '-e',
          `
          const { withBackend, loamBackend } = await import(${JSON.stringify(entry)});
          const { Queue, Worker } = withBackend(loamBackend({ dataDir: ${JSON.stringify(dir)} }));
          try { new Worker('q', async () => {}, { connection: {}, stalledInterval: 0 }); } catch { console.log('threw'); }
          // The store opens on a thread of its own, and the calls made
          // meanwhile hold the backend until it has: wait for that open by
          // joining it, then let go.
          const joined = new Queue('q', { connection: {} });
          await joined.waitUntilReady();
          await joined.close();
          for (let i = 0; i < 5; i++) { globalThis.gc(); await new Promise(r => setTimeout(r, 50)); }
          console.log('collected');
          await new Promise(r => setTimeout(r, 10_000));
          `,
        ],
        {
          killAfterMs: 20_000,
          onLine: (line, kill) => {
            if (line !== 'collected') return;
            // The child's store opens on a thread of its own, and the
            // collected backend's close waits for that open: asked again
            // for a while while the child still holds it.
            opened = (async () => {
              const { Queue } = withBackend(loamBackend({ dataDir: dir }));
              const deadline = Date.now() + 5_000;
              try {
                for (;;) {
                  const queue = new Queue('q', { connection: {} });
                  queue.on('error', () => undefined);
                  try {
                    return String(await queue.count());
                  } catch (err) {
                    const code = (err as { code?: string }).code ?? String(err);
                    if (code !== 'LOAM_STORE_LOCKED' || Date.now() > deadline) return code;
                  } finally {
                    await queue.close().catch(() => undefined);
                  }
                  await new Promise(resolve => setTimeout(resolve, 50));
                }
              } finally {
                kill();
              }
            })();
          },
        },
      );
      expect(await opened).toBe('0');
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  itInProcess('a data dir that is a file is a setting to fix, not a store that is away', () => {
    const dir = mkdtempSync(path.join(tmpdir(), 'loam-file-dir-'));
    try {
      const file = path.join(dir, 'not-a-dir');
      writeFileSync(file, '');
      const misplaced = withBackend(loamBackend({ dataDir: file }));
      expect(() => new misplaced.Queue('d', { connection })).toThrow(
        expect.objectContaining({ code: 'LOAM_INVALID_ARGUMENT', message: expect.stringContaining('cannot create data dir') }),
      );
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  itInProcess('refuses a flushIntervalMs that is not a whole number of milliseconds, 0 or more, as the server does', () => {
    const dataDir = mkdtempSync(path.join(tmpdir(), 'loam-durability-'));
    try {
      for (const flushIntervalMs of [-1, 1.5]) {
        const relaxed = withBackend(loamBackend({ dataDir, durability: 'relaxed', flushIntervalMs }));
        expect(() => new relaxed.Queue('d', { connection })).toThrow(
          expect.objectContaining({ code: 'LOAM_INVALID_ARGUMENT', message: expect.stringContaining('flushIntervalMs') }),
        );
      }
    } finally {
      rmSync(dataDir, { recursive: true, force: true });
    }
  });

  itInProcess('a backend asking for another durability than its open store is refused, naming both', async () => {
    const dataDir = mkdtempSync(path.join(tmpdir(), 'loam-durability-'));
    try {
      const relaxed = withBackend(loamBackend({ dataDir, durability: 'relaxed' }));
      const immediate = withBackend(loamBackend({ dataDir }));
      const first = new relaxed.Queue('d', { connection });
      await first.add('a', {});
      // Before: it joined the relaxed store, and its adds were not fsynced.
      let refused: unknown;
      try {
        new immediate.Queue('d', { connection });
      } catch (err) {
        refused = err;
      }
      expect(refused).toMatchObject({ code: 'LOAM_FAILED_PRECONDITION' });
      expect(String((refused as Error).message)).toContain("durability 'relaxed' (flushIntervalMs 100)");
      expect(String((refused as Error).message)).toContain("asks for durability 'immediate'");
      // The same settings join it; once closed, the store opens with others.
      const second = new relaxed.Queue('d', { connection });
      expect(await second.count()).toBe(1);
      await Promise.all([first.close(), second.close()]);
      const reopened = new immediate.Queue('d', { connection });
      expect(await reopened.count()).toBe(1);
      await reopened.close();
    } finally {
      rmSync(dataDir, { recursive: true, force: true });
    }
  });

  itInProcess("closing a store's last backend answers its pending waitForJob as cut short", async () => {
    for (const durability of ['immediate', 'relaxed'] as const) {
      for (let i = 0; i < 10; i++) {
        const dataDir = mkdtempSync(path.join(tmpdir(), 'loam-close-wait-'));
        try {
          const backend = loamBackend({ dataDir, durability })('idle', { connection }, { withBlockingConnection: true });
          await backend.waitUntilReady();
          const waiting = backend.waitForJob(5);
          await new Promise(resolve => setTimeout(resolve, 2));
          await backend.close();
          // Before: close wakes every waiter, and the wake-up answered 0 ("a
          // job may be ready") in every round; nothing is ready.
          expect([durability, i, await waiting]).toEqual([durability, i, INTERRUPTED_WAIT]);
        } finally {
          rmSync(dataDir, { recursive: true, force: true });
        }
      }
    }
  });

  itInProcess('a write in flight keeps Node running until it settles, and lets it exit after', async () => {
    // Nothing but the addon's promise keeps this process's loop alive while
    // the add is in flight; once everything settled, nothing may keep it.
    const dataDir = mkdtempSync(path.join(tmpdir(), 'loam-alive-'));
    try {
      const { out, code } = await runNode(`
        const { withBackend } = await import('bullmq');
        const { loamBackend } = await import(${JSON.stringify(entry)});
        const { Queue } = withBackend(loamBackend({ dataDir: ${JSON.stringify(dataDir)} }));
        const queue = new Queue('alive', { connection: {} });
        const job = await queue.add('job', {});
        console.log('added ' + job.id);
        await queue.close();
        console.log('closed');
      `);
      expect(out.trim().split('\n')).toEqual(['added 1', 'closed']);
      expect(code).toBe(0);
    } finally {
      rmSync(dataDir, { recursive: true, force: true });
    }
  });

  itInProcess('worker threads use the backend one after another', async () => {
    // Each thread opens a store, adds, closes and ends; the next one starts
    // after (mimalloc 3, the addon's allocator before, crashed the process as
    // the second thread allocated). The last is terminated with its adds in
    // flight: the store settles them after the thread's environment is gone.
    const dataDir = mkdtempSync(path.join(tmpdir(), 'loam-threads-'));
    try {
      const thread = `
        const { workerData, parentPort } = await import('node:worker_threads');
        const { withBackend } = await import('bullmq');
        const { loamBackend } = await import(${JSON.stringify(entry)});
        const { Queue } = withBackend(loamBackend({ dataDir: workerData }));
        const queue = new Queue('threads', { connection: {} });
        const adds = Array.from({ length: 200 }, (_, i) => queue.add('job', { i }));
        parentPort.postMessage('adding');
        await Promise.all(adds);
        parentPort.postMessage(await queue.count());
        await queue.close();
      `;
      const { out, code, signal } = await runNode(`
        const { Worker } = await import('node:worker_threads');
        for (let i = 0; i < 5; i++) {
          const thread = new Worker(${JSON.stringify(thread)}, { eval: true, workerData: ${JSON.stringify(dataDir)} });
          thread.on('message', message => {
            if (message !== 'adding') console.log('count ' + message);
            else if (i === 4) thread.terminate();
          });
          await new Promise((resolve, reject) => thread.on('exit', resolve).on('error', reject));
        }
        console.log('done');
      `);
      expect({ code, signal }).toEqual({ code: 0, signal: null });
      expect(out.trim().split('\n')).toEqual(['count 200', 'count 400', 'count 600', 'count 800', 'done']);
    } finally {
      rmSync(dataDir, { recursive: true, force: true });
    }
  });

  itInProcess("the README's quick start: the example producer, then the example worker, each with one command", async () => {
    const dataDir = mkdtempSync(path.join(tmpdir(), 'loam-examples-'));
    try {
      const env = { ...process.env, LOAM_DATA_DIR: dataDir };
      const produced = await runProcess([path.join(examples, 'producer.mjs')], { env, killAfterMs: 10_000 });
      expect({ code: produced.code, signal: produced.signal }).toEqual({ code: 0, signal: null });
      const added = produced.out.trim().split('\n');
      expect(added.slice(0, 4)).toEqual([
        'added job 1 for ada@example.com',
        'added job 2 for grace@example.com',
        'added job 3 for edsger@example.com',
        'added job 4, due in 2 s',
      ]);
      expect(added[4]).toBe('counts: {');
      expect(produced.out).toMatch(/delayed: 1,\s+failed: 0,\s+prioritized: 0,\s+waiting: 3,/);

      // Ctrl-C once the delayed job is done too: the worker closes and exits 0.
      const done: string[] = [];
      const worked = await runProcess([path.join(examples, 'worker.mjs')], {
        onLine: (line, signal) => {
          if (!line.includes(' done: ')) return;
          done.push(line);
          if (done.length === 4) signal('SIGINT');
        },
        env,
        killAfterMs: 15_000,
      });
      expect({ code: worked.code, signal: worked.signal }).toEqual({ code: 0, signal: null });
      expect(worked.out).toContain('worker waiting for jobs on "emails"');
      expect(done.sort()).toEqual([
        "job 1 done: { sent: true, to: 'ada@example.com' }",
        "job 2 done: { sent: true, to: 'grace@example.com' }",
        "job 3 done: { sent: true, to: 'edsger@example.com' }",
        "job 4 done: { sent: true, to: 'later@example.com' }",
      ]);
      expect(worked.out).not.toContain('failed');
    } finally {
      rmSync(dataDir, { recursive: true, force: true });
    }
  });

  it('recovers the jobs of a worker process killed mid-job', async () => {
    const name = loam.queueName();
    const settings = JSON.stringify(loam.settings);
    const held: string[] = [];
    const { signal } = await runNode(
      `
      const { withBackend } = await import('bullmq');
      const { loamBackend } = await import(${JSON.stringify(entry)});
      const { Queue, Worker } = withBackend(loamBackend(${settings}));
      const queue = new Queue(${JSON.stringify(name)}, { connection: {} });
      await queue.addBulk([1, 2, 3, 4, 5].map(n => ({ name: 'job', data: { n } })));
      new Worker(${JSON.stringify(name)}, async job => {
        // A durable write after the claim, so the lease is on disk when killed.
        await job.updateProgress(1);
        console.log('active ' + job.id);
        await new Promise(() => {});
      }, { connection: {}, concurrency: 2, lockDuration: 800 });
      `,
      (line, kill) => {
        if (!line.startsWith('active ')) return;
        held.push(line.slice('active '.length));
        kill();
      },
    );
    expect(signal).toBe('SIGKILL');
    expect(held.length).toBeGreaterThan(0);

    // Whether the lease of a job the process held has lapsed by the time
    // this process opens the store (in-process) depends on how long the
    // kill and the open take: if it has, the open's sweep reclaims the job,
    // else this worker's stalled check does, later. Either way the job comes
    // back once, as stalled (a lease lost with the process would have left
    // it waiting, its stalledCounter 0), and completes.
    const queue = new Queue(name, { connection });
    const done: Job[] = [];
    const worker = new Worker(name, async (job: Job) => job.data.n, {
      connection,
      lockDuration: 800,
      stalledInterval: 300,
    });
    worker.on('completed', job => done.push(job));
    await until(() => done.length === 5, 15_000);
    const recovered = done.filter(j => held.includes(j.id!));
    expect(Object.fromEntries(recovered.map(j => [j.id, j.stalledCounter]))).toEqual(
      Object.fromEntries(held.map(id => [id, 1])),
    );
    const values = done.map(j => j.returnvalue).sort();
    expect(values).toEqual([1, 2, 3, 4, 5]);
    expect(await queue.getJobCounts('completed', 'active', 'waiting', 'failed')).toEqual({
      completed: 5,
      active: 0,
      waiting: 0,
      failed: 0,
    });
    await worker.close();
    await queue.close();
  });

  it('keeps every job whose add resolved when the producer is killed', async () => {
    const name = loam.queueName();
    const acked: string[] = [];
    const { signal } = await runNode(
      `
      const { withBackend } = await import('bullmq');
      const { loamBackend } = await import(${JSON.stringify(entry)});
      const { Queue } = withBackend(loamBackend(${JSON.stringify(loam.settings)}));
      const queue = new Queue(${JSON.stringify(name)}, { connection: {} });
      for (let i = 0; ; i++) {
        const job = await queue.add('job', { i });
        console.log('added ' + job.id);
      }
      `,
      (line, kill) => {
        if (!line.startsWith('added ')) return;
        acked.push(line.slice('added '.length));
        if (acked.length === 200) kill();
      },
    );
    expect(signal).toBe('SIGKILL');
    expect(acked.length).toBeGreaterThanOrEqual(200);
    const queue = new Queue(name, { connection });
    for (const id of acked) {
      expect(await queue.getJobState(id)).toBe('waiting');
    }
    await queue.close();
  });
});

/** The addon's hooks for opens (see `crates/loam-jobs-napi`'s `test_hooks`). */
interface OpenHooks {
  setOpenDelayForTest(ms: number): void;
  setOpenPanicsForTest(panics: boolean): void;
  opensForTest(): number;
}

function openHooks(): OpenHooks {
  const probe = new Queue(loam.queueName(), { connection });
  const hooks = testHooks<{ constructor: OpenHooks }>(probe).constructor;
  void probe.close();
  return hooks;
}

/** Makes every open of a store wait `ms` before it starts, as a long log replay would, until `slowOpens(0)`. */
function slowOpens(ms: number): void {
  openHooks().setOpenDelayForTest(ms);
}

describe('opening a store', () => {
  itInProcess(
    'runs off the event loop: the Queue is made at once, and its calls made meanwhile run after the open, in order',
    async () => {
      const dir = mkdtempSync(path.join(tmpdir(), 'loam-slow-open-'));
      try {
        slowOpens(400);
        const { Queue: SlowQueue } = withBackend(loamBackend({ dataDir: dir }));
        let turns = 0;
        const timer = setInterval(() => turns++, 10);
        const started = performance.now();
        const queue = new SlowQueue('q', { connection });
        const made = performance.now() - started;
        const adds = Promise.all([queue.add('a', {}), queue.add('b', {}), queue.addBulk([{ name: 'c', data: {} }])]);
        const counted = queue.count();
        await queue.waitUntilReady();
        const opened = performance.now() - started;
        clearInterval(timer);
        expect(made).toBeLessThan(200);
        expect(opened).toBeGreaterThanOrEqual(350);
        // Blocked for the open, the loop would have run the timer once.
        expect(turns).toBeGreaterThanOrEqual(10);
        const [a, b, [c]] = await adds;
        expect([a.id, b.id, c.id]).toEqual(['1', '2', '3']);
        expect(await counted).toBe(3);
        await queue.close();
      } finally {
        slowOpens(0);
        rmSync(dir, { recursive: true, force: true });
      }
    },
  );

  itInProcess('closed while it opens, a store closes once the open has ended, its writes kept, and is free again', async () => {
    const dir = mkdtempSync(path.join(tmpdir(), 'loam-slow-open-'));
    try {
      slowOpens(300);
      const { Queue: SlowQueue } = withBackend(loamBackend({ dataDir: dir }));
      // Closed with nothing asked of it, then with a write in flight.
      await new SlowQueue('q', { connection }).close();
      const queue = new SlowQueue('q', { connection });
      const added = queue.add('a', {});
      await queue.close();
      expect((await added).id).toBe('1');
      slowOpens(0);
      const { out } = await runNode(`
        const { withBackend } = await import('bullmq');
        const { loamBackend } = await import(${JSON.stringify(entry)});
        const { Queue } = withBackend(loamBackend({ dataDir: ${JSON.stringify(dir)} }));
        const queue = new Queue('q', { connection: {} });
        console.log(await queue.count());
        await queue.close();
      `);
      expect(out.trim()).toBe('1');
    } finally {
      slowOpens(0);
      rmSync(dir, { recursive: true, force: true });
    }
  });

  // BullMQ's Worker asks again at once after an error it does not take for
  // a lost connection: in-process, a store that could not be reached had it
  // run microtasks only, at a full core, and no timer ever fired.
  itInProcess(
    'that failed fails every call as a lost connection would, a Worker waits before it asks again, and it opens again once it can',
    async () => {
      const dir = mkdtempSync(path.join(tmpdir(), 'loam-bad-open-'));
      const file = path.join(dir, 'jobs.redb');
      writeFileSync(file, 'not a store '.repeat(1_000));
      try {
        const { Queue: BadQueue, QueueEvents: BadQueueEvents } = withBackend(loamBackend({ dataDir: dir }));
        const queue = new BadQueue('q', { connection });
        const events = new BadQueueEvents('q', { connection });
        events.on('error', () => undefined);
        const heard: string[] = [];
        events.on('completed', ({ jobId }) => heard.push(jobId));
        const queueErrors: Error[] = [];
        queue.on('error', e => queueErrors.push(e));
        const err = await queue.add('a', {}).catch((e: unknown) => e as Error & { code?: string });
        expect(err).toBeInstanceOf(ConnectionClosedError);
        expect(err).toMatchObject({ code: 'LOAM_UNAVAILABLE', message: expect.stringContaining('cannot open') });
        await expect(queue.waitUntilReady()).rejects.toMatchObject({ code: 'LOAM_UNAVAILABLE' });

        // The Worker's asks for a job, counted at its backend.
        let asks = 0;
        const counting: typeof loam.factory = (name, opts, options) => {
          const backend = loamBackend({ dataDir: dir })(name, opts, options);
          for (const method of ['waitForJob', 'moveToActive'] as const) {
            const ask = backend[method].bind(backend) as (...args: unknown[]) => Promise<never>;
            (backend as unknown as Record<string, unknown>)[method] = (...args: unknown[]) => {
              asks++;
              return ask(...args);
            };
          }
          return backend;
        };
        const { Worker: CountedWorker } = withBackend(counting);
        const errors: Error[] = [];
        // BullMQ's close waits out the retry's delay (a down Redis's as well).
        const worker = new CountedWorker('q', async () => 'done', { connection, runRetryDelay: 100 });
        worker.on('error', e => errors.push(e));
        // The store's opens counted from once those its backends' joins
        // started (at once, each) have ended.
        const native = testHooks<{ constructor: OpenHooks; opening: boolean }>(queue);
        await until(() => !native.opening);
        const opensBefore = native.constructor.opensForTest();
        let turns = 0;
        const timer = setInterval(() => turns++, 10);
        const cpu = process.cpuUsage();
        await new Promise(resolve => setTimeout(resolve, 1_500));
        clearInterval(timer);
        const { user, system } = process.cpuUsage(cpu);
        // Opened again while the Worker asked, at most once a second after the last open ended.
        const reopens = native.constructor.opensForTest() - opensBefore;
        expect(reopens).toBeGreaterThanOrEqual(1);
        expect(reopens).toBeLessThanOrEqual(2);
        expect(turns).toBeGreaterThanOrEqual(50);
        // It goes on asking, 100 ms apart: not at once, nor never again.
        expect(asks).toBeGreaterThanOrEqual(4);
        expect(asks).toBeLessThanOrEqual(20);
        // Reported as ioredis reports a lost connection: at once, then at most once a second.
        expect(errors.length).toBeGreaterThanOrEqual(2);
        expect(errors.length).toBeLessThanOrEqual(4);
        expect(errors.every(e => (e as Error & { code?: string }).code === 'LOAM_UNAVAILABLE')).toBe(true);
        // Once: its readiness and its add failed within a second.
        expect(queueErrors.map(e => (e as Error & { code?: string }).code)).toEqual(['LOAM_UNAVAILABLE']);
        expect((user + system) / 1000).toBeLessThan(600);

        // Once the cause is gone, the next call a second after the last
        // open opens it again, and the same Queue and Worker go on.
        rmSync(file);
        let added: Job | undefined;
        await until(async () => (added = await queue.add('a', {}).catch(() => undefined)) !== undefined, 5_000);
        await until(async () => (await queue.getJobState(added!.id!)) === 'completed', 5_000);
        // The QueueEvents asks again 5 s after an error (BullMQ's delay), from
        // then on: jobs completed since are heard.
        let probe: Job | undefined;
        await until(async () => {
          probe = await queue.add('probe', {});
          const heardBy = Date.now() + 500;
          while (Date.now() < heardBy && !heard.includes(probe.id!)) await new Promise(r => setTimeout(r, 10));
          return heard.includes(probe.id!);
        }, 10_000);
        expect(heard.at(-1)).toBe(probe!.id);
        await Promise.all([worker.close(), events.close()]);
        await queue.close();
      } finally {
        rmSync(dir, { recursive: true, force: true });
      }
    },
  );

  itInProcess('that panicked fails like one that failed, closes, and a later open tries afresh', async () => {
    const hooks = openHooks();
    const dir = mkdtempSync(path.join(tmpdir(), 'loam-panicked-open-'));
    try {
      hooks.setOpenPanicsForTest(true);
      const { Queue: PanickyQueue } = withBackend(loamBackend({ dataDir: dir }));
      const queue = new PanickyQueue('q', { connection });
      queue.on('error', () => undefined);
      const err = await queue.add('a', {}).catch((e: unknown) => e as Error & { code?: string });
      expect(err).toBeInstanceOf(ConnectionClosedError);
      expect(err).toMatchObject({ code: 'LOAM_UNAVAILABLE', message: expect.stringContaining('its open panicked') });
      await queue.close();
      hooks.setOpenPanicsForTest(false);
      const fresh = new PanickyQueue('q', { connection });
      await fresh.add('a', {});
      expect(await fresh.count()).toBe(1);
      await fresh.close();
    } finally {
      hooks.setOpenPanicsForTest(false);
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

// A disk that fails under the store (full, or a file over its size limit):
// redb refuses every write until its file is reopened. Redis's client
// reconnects by itself; so does the store, once a call finds it failed.
describe('a store whose disk failed', () => {
  itInProcess(
    'opens itself again once the disk works, losing no acknowledged job, and its Queue and Worker go on',
    async () => {
      const dir = mkdtempSync(path.join(tmpdir(), 'loam-failing-disk-'));
      const limitFileSize = (pid: string, limit: string) =>
        execFileSync('prlimit', ['--pid', pid, `--fsize=${limit}:unlimited`]);
      let pid = '';
      try {
        const { out, code } = await runProcess(
          [
            '--input-type=module',
            '-e',
            `
            const { withBackend, loamBackend } = await import(${JSON.stringify(entry)});
            // A write past the file size limit then fails with EFBIG, as on
            // a full disk, instead of killing the process.
            process.on('SIGXFSZ', () => {});
            let told = 0;
            process.on('SIGUSR2', () => told++);
            const toldTimes = n => new Promise(resolve => { const t = setInterval(() => told >= n && (clearInterval(t), resolve()), 10); });
            const { Queue, Worker } = withBackend(loamBackend({ dataDir: ${JSON.stringify(dir)} }));
            const connection = {};
            const queue = new Queue('q', { connection });
            let queueErrors = 0;
            queue.on('error', () => queueErrors++);
            const worker = new Worker('q', async job => job.id, {
              connection, concurrency: 5, runRetryDelay: 100, lockDuration: 1000, stalledInterval: 500,
            });
            const workerErrors = new Set();
            worker.on('error', e => workerErrors.add(e.code ?? e.message));
            await Promise.all([queue.waitUntilReady(), worker.waitUntilReady()]);
            console.log('ready ' + process.pid);
            await toldTimes(1);
            // Adds until the disk fails: 20 KB each, under a 2 MB limit.
            const acked = [];
            const data = { pad: 'x'.repeat(20_000) };
            let failure;
            for (let i = 0; i < 1_000 && !failure; i++) {
              await queue.add('j', data).then(job => acked.push(job.id), e => (failure = e));
            }
            console.log('failed ' + JSON.stringify({ name: failure?.name, code: failure?.code }));
            await toldTimes(2);
            const lifted = Date.now();
            let recoveredMs;
            while (recoveredMs === undefined && Date.now() - lifted < 15_000) {
              await queue.add('j', data).then(
                job => { acked.push(job.id); recoveredMs = Date.now() - lifted; },
                () => new Promise(resolve => setTimeout(resolve, 50)),
              );
            }
            const after = [];
            for (let i = 0; i < 20; i++) after.push((await queue.add('after', {})).id);
            const states = async ids => Promise.all(ids.map(id => queue.getJobState(id)));
            const deadline = Date.now() + 20_000;
            while (Date.now() < deadline) {
              const all = await states([...acked, ...after]);
              if (all.every(s => s === 'completed' || s === 'failed')) break;
              await new Promise(resolve => setTimeout(resolve, 100));
            }
            const finished = {};
            for (const s of await states(acked)) finished[s] = (finished[s] ?? 0) + 1;
            const afterStates = [...new Set(await states(after))];
            await worker.close();
            await queue.close();
            console.log(JSON.stringify({ acked: acked.length, finished, afterStates, recoveredMs, queueErrors, workerErrors: [...workerErrors] }));
            `,
          ],
          {
            killAfterMs: 50_000,
            onLine: (line, kill) => {
              if (line.startsWith('ready ')) {
                pid = line.slice('ready '.length);
                limitFileSize(pid, '2000000');
                kill('SIGUSR2');
              } else if (line.startsWith('failed ')) {
                // Reopens are tried, and fail, while the limit holds.
                setTimeout(() => {
                  limitFileSize(pid, 'unlimited');
                  kill('SIGUSR2');
                }, 1_500);
              }
            },
          },
        );
        expect(code).toBe(0);
        const lines = out.trim().split('\n');
        expect(JSON.parse(lines.find(l => l.startsWith('failed '))!.slice('failed '.length))).toEqual({
          name: 'ConnectionClosedError',
          code: 'LOAM_UNAVAILABLE',
        });
        const outcome = JSON.parse(lines.at(-1)!);
        // Every add that resolved is there, with one outcome: completed by the
        // worker that went on (a job whose completion the failing disk
        // refused ran again once its lock expired), or failed, by a
        // completion the disk refused and a failure the store took.
        expect(outcome.acked).toBeGreaterThan(5);
        expect((outcome.finished.completed ?? 0) + (outcome.finished.failed ?? 0)).toBe(outcome.acked);
        expect(outcome.afterStates).toEqual(['completed']);
        // Its next open starts at most a second after the last ended.
        expect(outcome.recoveredMs).toBeLessThan(5_000);
        expect(outcome.queueErrors).toBeGreaterThan(0);
        expect(outcome.workerErrors).toContain('LOAM_UNAVAILABLE');
      } finally {
        rmSync(dir, { recursive: true, force: true });
      }
    },
    60_000,
  );
});
