import { afterAll, describe, expect, inject, it, onTestFinished, vi } from 'vitest';
import { randomUUID } from 'node:crypto';
import * as net from 'node:net';
import { ConnectionClosedError, withBackend, type Job } from 'bullmq';
import { backendKind } from './helpers.js';
import { loamBackend, type RemoteSettings } from '../src/index.js';
import { startLoamServer } from './remote-server.js';
import { startTcpProxy, type TcpProxy } from './tcp-proxy.js';

/** What the remote backend does when its server is away, or its connection fails. */
const describeRemote = backendKind === 'remote' ? describe : describe.skip;

/** BullMQ's classes on the test server, through `url` (a proxy) when given, in a namespace of their own. */
function classes(settings: Partial<RemoteSettings> = {}) {
  const namespace = `t-${randomUUID()}`;
  const url = inject('loamServerUrl');
  return {
    through: withBackend(loamBackend({ url, namespace, ...settings })),
    direct: withBackend(loamBackend({ url, namespace })),
  };
}

async function freePort(): Promise<number> {
  const server = net.createServer();
  await new Promise<void>(resolve => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as net.AddressInfo;
  await new Promise(resolve => server.close(resolve));
  return port;
}

const proxies: TcpProxy[] = [];
afterAll(async () => {
  await Promise.all(proxies.map(p => p.close()));
});

/**
 * How `vi.waitFor` polls for what a call or a job brings about: vitest's
 * default gives it 1 s, which a loaded machine can take to carry out a few
 * calls; a missing outcome still fails, after 10 s.
 */
const settled = { timeout: 10_000, interval: 20 };

async function proxy(): Promise<TcpProxy> {
  const p = await startTcpProxy(inject('loamServerUrl'));
  proxies.push(p);
  return p;
}

describeRemote('remote connection failures', () => {
  it('a Worker and a QueueEvents made before their server is up work once it is', async () => {
    const port = await freePort();
    const { Queue, Worker, QueueEvents } = withBackend(loamBackend({ url: `http://127.0.0.1:${port}` }));
    const worker = new Worker('early', async () => 'ok', { connection: {}, runRetryDelay: 50 });
    const events = new QueueEvents('early', { connection: {} });
    // Both were asked of a server that is not there: ready anyway, as Redis
    // clients are once they have connected, and retrying in the background.
    const server = await startLoamServer({}, { listen: `127.0.0.1:${port}` });
    try {
      await worker.waitUntilReady();
      await events.waitUntilReady();
      const queue = new Queue('early', { connection: {} });
      const job = await queue.add('a', {});
      await job.waitUntilFinished(events, 10_000);
      expect(await queue.getJobState(job.id!)).toBe('completed');
      await Promise.all([worker.close(), events.close(), queue.close()]);
    } finally {
      await server.stop();
    }
  });

  it.each(['session', 'unary'] as const)(
    'writes across a restart of the server are sent again, not failed: the ones it never read were not applied (%s)',
    async calls => {
      // A removal is not resendable: one cut on its way may have been applied.
      // But a server shutting down stops reading its sessions, answers what it
      // read, and ends them; before, the calls it never read failed as cut
      // (19 to 40 of these removals in three runs, on the session).
      const port = await freePort();
      let server = await startLoamServer({}, { listen: `127.0.0.1:${port}` });
      const { Queue } = withBackend(loamBackend({ url: `http://127.0.0.1:${port}`, reconnectTimeoutMs: 10_000, calls }));
      const queue = new Queue(`q-${randomUUID()}`, { connection: {} });
      try {
        await queue.add('a', {});
        let restarted = false;
        const failed: unknown[] = [];
        let removals = 0;
        const loops = Array.from({ length: 20 }, async (_, i) => {
          while (!restarted) {
            await queue.remove(`absent-${i}`).then(
              () => removals++,
              (err: unknown) => failed.push(err),
            );
          }
        });
        // Counted, not timed: a slow machine made 88 removals in the 0.6 s this once waited.
        const served = { timeout: 8_000, interval: 10 };
        await vi.waitFor(() => expect(removals).toBeGreaterThanOrEqual(50), served);
        await server.stop();
        server = await startLoamServer({}, { listen: `127.0.0.1:${port}` });
        const beforeRestart = removals;
        await vi.waitFor(() => expect(removals - beforeRestart).toBeGreaterThanOrEqual(50), served);
        restarted = true;
        await Promise.all(loops);
        expect(failed).toEqual([]);
      } finally {
        await queue.close();
        await server.stop();
      }
    },
  );

  it.each(['session', 'unary'] as const)(
    'a connection cut while a job completes is retried, not taken for a failure of the job (%s)',
    async calls => {
      const cut = await proxy();
      const { through, direct } = classes({ url: cut.url, calls });
      const name = `q-${randomUUID()}`;
      const queue = new direct.Queue(name, { connection: {} });
      await queue.add('a', {}, { jobId: 'J' });
      const worker = new through.Worker(
        name,
        async () => {
          // The completion this returns to is what the client sends next.
          cut.cutOnNextSend();
          return 'done';
        },
        { connection: {}, runRetryDelay: 50 },
      );
      onTestFinished(() => worker.close());
      const outcome = await new Promise<string>(resolve => {
        worker.on('failed', (_job, err) => resolve(`failed: ${err.message}`));
        worker.on('completed', job => resolve(`completed ${job.id}`));
      });
      expect(outcome).toBe('completed J');
      const job = await queue.getJob('J');
      expect(await job!.getState()).toBe('completed');
      expect(job!.returnvalue).toBe('done');
      expect(job!.attemptsMade).toBe(1);
      await queue.close();
    },
  );

  it.each(['session', 'unary'] as const)(
    'a connection that goes silent (no FIN, no RST) is found and replaced (%s)',
    async calls => {
      const link = await proxy();
      const { through, direct } = classes({ url: link.url, calls, pingIntervalMs: 100, pingTimeoutMs: 200 });
      const name = `q-${randomUUID()}`;
      const worker = new through.Worker(name, async () => 'done', { connection: {}, runRetryDelay: 50 });
      // Found the queue empty: its long-poll for a job goes on the connection that goes silent.
      await new Promise<void>(resolve => worker.once('drained', resolve));
      link.silence();
      const queue = new direct.Queue(name, { connection: {} });
      const done = new Promise<Job>(resolve => worker.on('completed', resolve));
      await queue.add('a', {}, { jobId: 'after-silence' });
      expect((await done).id).toBe('after-silence');
      const closing = Date.now();
      await worker.close();
      expect(Date.now() - closing).toBeLessThan(2_000);
      await queue.close();
    },
  );

  it.each(['session', 'unary'] as const)(
    'a call made while its server is away waits for it, and is carried out once it is back (%s)',
    async calls => {
      const port = await freePort();
      const listen = `127.0.0.1:${port}`;
      const first = await startLoamServer({}, { listen });
      const { Queue, Worker } = withBackend(loamBackend({ url: first.url, calls }));
      const name = `q-${randomUUID()}`;
      const queue = new Queue(name, { connection: {} });
      await queue.add('before', {});
      await first.kill();
      // Before: rejected at once with ECONNREFUSED (ConnectionClosedError),
      // where ioredis holds a command until Redis is back.
      const during = queue.add('during', {});
      await new Promise(resolve => setTimeout(resolve, 700));
      const second = await startLoamServer({}, { listen, dataDir: first.dataDir });
      try {
        expect((await during).name).toBe('during');
        const worker = new Worker(name, async job => job.name, { connection: {} });
        const done: string[] = [];
        await new Promise<void>(resolve => {
          worker.on('completed', job => {
            done.push(job.name);
            if (done.length === 2) resolve();
          });
        });
        expect(done.sort()).toEqual(['before', 'during']);
        await Promise.all([worker.close(), queue.close()]);
      } finally {
        await second.stop();
      }
    },
  );

  it('many calls waiting at once for a server that is away print no listener-leak warning', async () => {
    const port = await freePort();
    const listen = `127.0.0.1:${port}`;
    const first = await startLoamServer({}, { listen });
    const { Queue } = withBackend(loamBackend({ url: first.url }));
    const queue = new Queue(`q-${randomUUID()}`, { connection: {} });
    await queue.add('before', {});
    const warnings: Error[] = [];
    const onWarning = (warning: Error) => warnings.push(warning);
    process.on('warning', onWarning);
    onTestFinished(() => {
      process.off('warning', onWarning);
    });
    await first.kill();
    // Each waits on the backend's stop signal; Node warned past 10 of them.
    const during = Array.from({ length: 25 }, (_, i) => queue.add('during', { i }));
    await new Promise(resolve => setTimeout(resolve, 500));
    const second = await startLoamServer({}, { listen, dataDir: first.dataDir });
    try {
      expect((await Promise.all(during)).length).toBe(25);
      expect(await queue.count()).toBe(26);
      await queue.close();
    } finally {
      await second.stop();
    }
    expect(warnings.map(w => `${w.name}: ${w.message}`)).toEqual([]);
  });

  it.each(['close', 'pause'] as const)(
    'a Worker told to %s while its server is away records the outcome of the job in hand once the server is back',
    async end => {
      const port = await freePort();
      const listen = `127.0.0.1:${port}`;
      const first = await startLoamServer({}, { listen });
      const { Queue, Worker } = withBackend(loamBackend({ url: first.url }));
      const name = `q-${randomUUID()}`;
      const queue = new Queue(name, { connection: {} });
      let release!: () => void;
      const gate = new Promise<void>(resolve => (release = resolve));
      let runs = 0;
      const worker = new Worker(
        name,
        async () => {
          runs++;
          await gate;
          return 'done';
        },
        { connection: {} },
      );
      worker.on('error', () => undefined);
      await queue.add('a', {}, { jobId: 'in-hand' });
      await vi.waitFor(() => expect(runs).toBe(1), { timeout: 10_000 });
      await first.kill();
      // Once the client has seen the connection close: a completion sent on
      // a connection that then fails may have been applied, and is not sent
      // again (BullMQ's own retry, 15 s later, finds out).
      await new Promise(resolve => setTimeout(resolve, 200));
      // BullMQ cuts the Worker's blocking calls, then waits for the job in
      // hand. Before: its completion was given up at once, and the job stayed
      // active, to run again once its lock lapsed (BullMQ's own retry, 15 s
      // later, saved a pause but not a close).
      const ending = end === 'close' ? worker.close() : worker.pause();
      release();
      await new Promise(resolve => setTimeout(resolve, 700));
      const second = await startLoamServer({}, { listen, dataDir: first.dataDir });
      try {
        const started = Date.now();
        await ending;
        expect(Date.now() - started).toBeLessThan(10_000);
        expect(await queue.getJobState('in-hand')).toBe('completed');
        expect(runs).toBe(1);
        await Promise.all([worker.close(), queue.close()]);
      } finally {
        await second.stop();
      }
    },
  );

  it('a drained Worker closes at once when its connection went silent, and sends no lease once closing', async () => {
    const link = await proxy();
    const { through } = classes({ url: link.url });
    const worker = new through.Worker(`q-${randomUUID()}`, async () => 'done', { connection: {} });
    worker.on('error', () => undefined);
    await new Promise<void>(resolve => worker.once('drained', resolve));
    await new Promise(resolve => setTimeout(resolve, 200));
    const { RemoteQueueBackend } = await import('../src/remote.js');
    const leases = vi.spyOn(RemoteQueueBackend.prototype, 'moveToActive');
    onTestFinished(() => leases.mockRestore());
    link.silence();
    const started = Date.now();
    await worker.close();
    // Its cut wait answered that nothing is ready: no lease to wait out on
    // the dead link (about 25 s of PINGs before).
    expect(Date.now() - started).toBeLessThan(3_000);
    expect(leases).not.toHaveBeenCalled();
  }, 60_000);

  it('a Worker, QueueEvents and Queue close at once while their server is away', async () => {
    const port = await freePort();
    const { Queue, Worker, QueueEvents } = withBackend(loamBackend({ url: `http://127.0.0.1:${port}` }));
    const worker = new Worker('away', async () => 'ok', { connection: {} });
    const events = new QueueEvents('away', { connection: {} });
    const queue = new Queue('away', { connection: {} });
    worker.on('error', () => undefined);
    events.on('error', () => undefined);
    const adding = queue.add('a', {}).catch((err: Error) => err);
    await new Promise(resolve => setTimeout(resolve, 500));
    const started = Date.now();
    // The worker's main loop has calls waiting for the server; each would
    // wait out reconnectTimeoutMs in turn (38 s in all).
    await Promise.all([worker.close(), events.close(), queue.close()]);
    expect(Date.now() - started).toBeLessThan(3_000);
    expect(await adding).toBeInstanceOf(ConnectionClosedError);
  });

  it('calls queued in order behind each other give up together, reconnectTimeoutMs after the server went away', async () => {
    const port = await freePort();
    const { Queue } = withBackend(loamBackend({ url: `http://127.0.0.1:${port}`, reconnectTimeoutMs: 1_000 }));
    const queue = new Queue(`q-${randomUUID()}`, { connection: {} });
    const started = Date.now();
    // Adds reach the server one after another; each waited a whole window
    // after the one before (the fifth failed after about 5 s).
    const calls = [1, 2, 3, 4, 5].map(i => queue.add('a', { i }).catch((err: Error) => err));
    const counts = queue.getJobCounts().catch((err: Error) => err);
    for (const failed of [...(await Promise.all(calls)), await counts]) {
      expect(failed).toBeInstanceOf(ConnectionClosedError);
    }
    expect(Date.now() - started).toBeLessThan(3_000);
    await queue.close();
  });

  /**
   * A Queue through a proxy whose session is made (it added a first job, `n`
   * -1), and a watcher on the same queue straight to the server.
   */
  async function addsThroughProxy() {
    const link = await proxy();
    const { through, direct } = classes({ url: link.url });
    const name = `q-${randomUUID()}`;
    const queue = new through.Queue(name, { connection: {} });
    const watcher = new direct.Queue(name, { connection: {} });
    await queue.add('first', { n: -1 });
    onTestFinished(async () => {
      await Promise.all([queue.close(), watcher.close()]);
    });
    return { link, queue, watcher };
  }

  /** The queue holds the first job, then one for each of `jobs` (`n` 0, 1, ...), in call order and made once. */
  async function expectAddedOnceInOrder(
    watcher: Awaited<ReturnType<typeof addsThroughProxy>>['watcher'],
    jobs: Job[],
  ) {
    const waiting = await watcher.getWaiting(0, -1);
    expect(waiting.map(j => j.data.n)).toEqual(Array.from({ length: jobs.length + 1 }, (_, n) => n - 1));
    // Each add resolved with the job the server made for it the first time.
    expect(jobs.map(j => j.id)).toEqual(waiting.slice(1).map(j => j.id));
  }

  it('un-awaited adds are sent without waiting for answers, and the server applies them in call order', async () => {
    const { link, queue, watcher } = await addsThroughProxy();
    link.holdReplies();
    const adds = Array.from({ length: 20 }, (_, n) => queue.add('pipelined', { n }));
    try {
      // No answer has come back, yet every add reached the server. Sent
      // each once the one before was answered, at most one of them would.
      await vi.waitFor(async () => expect(await watcher.count()).toBe(21), { timeout: 5_000, interval: 20 });
    } finally {
      link.passReplies();
    }
    await expectAddedOnceInOrder(watcher, await Promise.all(adds));
  });

  it('adds whose connection is cut after the server applied them are sent again and added once, in call order', async () => {
    const { link, queue, watcher } = await addsThroughProxy();
    link.holdReplies();
    const adds = Array.from({ length: 20 }, (_, n) => queue.add('cut', { n }));
    await vi.waitFor(async () => expect(await watcher.count()).toBe(21), { timeout: 5_000, interval: 20 });
    // The answers are lost with the connection; the adds are sent again.
    link.cut();
    link.passReplies();
    await expectAddedOnceInOrder(watcher, await Promise.all(adds));
  });

  it('a bulk add whose connection is cut after the server applied it is sent again and adds each job once', async () => {
    const { link, queue, watcher } = await addsThroughProxy();
    // A read goes after the writes before it were answered (the Queue's meta).
    await queue.getJobCounts();
    link.holdReplies();
    const bulk = queue.addBulk(Array.from({ length: 20 }, (_, n) => ({ name: 'bulk', data: { n } })));
    await vi.waitFor(async () => expect(await watcher.count()).toBe(21), { timeout: 5_000, interval: 20 });
    // Before: it failed with ConnectionClosedError, and a caller who tried
    // again added the 20 jobs twice.
    link.cut();
    link.passReplies();
    await expectAddedOnceInOrder(watcher, await bulk);
  });

  it('a flow whose connection is cut after the server applied it is sent again and adds each job once', async () => {
    const link = await proxy();
    const { through, direct } = classes({ url: link.url });
    const name = `q-${randomUUID()}`;
    const flows = new through.FlowProducer({ connection: {} });
    const watcher = new direct.Queue(name, { connection: {} });
    onTestFinished(async () => {
      await Promise.all([flows.close(), watcher.close()]);
    });
    await flows.add({ name: 'first', queueName: name });
    link.holdReplies();
    const children = Array.from({ length: 5 }, (_, n) => ({ name: 'child', queueName: name, data: { n } }));
    const flow = flows.add({ name: 'parent', queueName: name, children });
    // The first job, the parent and its five children.
    await vi.waitFor(async () => expect(await watcher.count()).toBe(7), { timeout: 5_000, interval: 20 });
    // Before: it failed with ConnectionClosedError.
    link.cut();
    link.passReplies();
    const tree = await flow;
    expect(await watcher.getJobCounts('waiting', 'waiting-children')).toEqual({ waiting: 6, 'waiting-children': 1 });
    expect((await watcher.getWaitingChildren()).map(j => j.id)).toEqual([tree.job.id]);
  });

  it('adds made while cut adds wait to be sent again go after them', async () => {
    const { link, queue, watcher } = await addsThroughProxy();
    // None of these reaches the server: the proxy cuts the connection when
    // the first comes, and the rest go on the dying stream.
    link.cutOnNextSend();
    const cut = Array.from({ length: 10 }, (_, n) => queue.add('cut', { n }));
    // The client has seen the connection close by now; the cut adds are
    // sent again only after a first wait of 50 ms. Sent at once on a new
    // connection, these would land before them.
    await new Promise(resolve => setTimeout(resolve, 15));
    const after = Array.from({ length: 10 }, (_, n) => queue.add('after', { n: 10 + n }));
    await expectAddedOnceInOrder(watcher, await Promise.all([...cut, ...after]));
  });

  it('an add too large for the session does not overtake the add before it, held on a silent session', async () => {
    const link = await proxy();
    const { through, direct } = classes({ url: link.url, pingIntervalMs: 100, pingTimeoutMs: 200 });
    const name = `q-${randomUUID()}`;
    const queue = new through.Queue(name, { connection: {} });
    const watcher = new direct.Queue(name, { connection: {} });
    onTestFinished(async () => {
      await Promise.all([queue.close(), watcher.close()]);
    });
    await queue.add('first', { n: -1 });
    // The session's connection goes half-open: `small` sits on it until the
    // PING finds it dead, then is sent again. `big`, over 1 MiB, goes on a
    // stream of its own; sent once `small` was on the session, it landed first.
    link.silence();
    const small = queue.add('small', { n: 0 });
    const big = queue.add('big', { n: 1, s: 'x'.repeat(2 << 20) });
    await expectAddedOnceInOrder(watcher, await Promise.all([small, big]));
  });

  it('a read whose answer is lost with its connection is asked again', async () => {
    const { link, queue } = await addsThroughProxy();
    // A read goes after the writes before it were answered (the Queue's meta).
    await queue.getJobCounts();
    link.holdReplies();
    const counts = queue.getJobCounts('waiting');
    const job = queue.getJob('1');
    // Both reached the server, which answered; the answers are lost.
    await new Promise(resolve => setTimeout(resolve, 200));
    link.cut();
    link.passReplies();
    expect(await counts).toEqual({ waiting: 1 });
    expect((await job)?.data).toEqual({ n: -1 });
  });

  it("a queue setting whose answer is lost is sent again", async () => {
    const { link, queue, watcher } = await addsThroughProxy();
    await queue.getJobCounts();
    link.holdReplies();
    const set = queue.setGlobalConcurrency(3);
    await vi.waitFor(async () => expect(await watcher.getGlobalConcurrency()).toBe(3), { timeout: 5_000, interval: 20 });
    link.cut();
    link.passReplies();
    await set;
    expect(await watcher.getGlobalConcurrency()).toBe(3);
  });

  it('a pause, a resume and a promotion whose answers are lost are sent again', async () => {
    const { link, queue, watcher } = await addsThroughProxy();
    await queue.getJobCounts();
    const cutAfterApplied = async <T>(call: () => Promise<T>, applied: () => Promise<boolean>) => {
      link.holdReplies();
      const answer = call();
      await vi.waitFor(async () => expect(await applied()).toBe(true), { timeout: 5_000, interval: 20 });
      link.cut();
      link.passReplies();
      return answer;
    };
    await cutAfterApplied(() => queue.pause(), () => watcher.isPaused());
    expect(await watcher.isPaused()).toBe(true);
    await cutAfterApplied(() => queue.resume(), async () => !(await watcher.isPaused()));
    expect(await watcher.isPaused()).toBe(false);
    await queue.add('later', { n: 0 }, { delay: 60_000 });
    await cutAfterApplied(() => queue.promoteJobs(), async () => (await watcher.getDelayedCount()) === 0);
    expect(await watcher.getJobCounts('delayed', 'waiting')).toEqual({ delayed: 0, waiting: 2 });
  });

  it("a processor's progress and log whose answers are lost are sent again, and made once", async () => {
    const link = await proxy();
    const { through, direct } = classes({ url: link.url });
    const name = `q-${randomUUID()}`;
    const queue = new direct.Queue(name, { connection: {} });
    const events = new direct.QueueEvents(name, { connection: {} });
    await events.waitUntilReady();
    const progressEvents: unknown[] = [];
    events.on('progress', ({ data }) => progressEvents.push(data));
    const worker = new through.Worker(
      name,
      async job => {
        link.holdReplies();
        const reports = Promise.all([job.updateProgress(50), job.log('once')]);
        // Applied, and the answers lost with the connection.
        await vi.waitFor(async () => expect((await queue.getJobLogs(job.id!)).count).toBe(1), settled);
        await vi.waitFor(async () => expect((await queue.getJob(job.id!))?.progress).toBe(50), settled);
        link.cut();
        link.passReplies();
        await reports;
        return 'done';
      },
      { connection: {} },
    );
    onTestFinished(async () => {
      await Promise.all([worker.close(), events.close(), queue.close()]);
    });
    const job = await queue.add('reports', {});
    await job.waitUntilFinished(events, 10_000);
    expect(await queue.getJobState(job.id!)).toBe('completed');
    expect(await queue.getJobLogs(job.id!)).toEqual({ logs: ['once'], count: 1 });
    await vi.waitFor(() => expect(progressEvents).toEqual([50]), settled);
  });

  /** A queue holding jobs `first` and `second` (added straight to the server), and classes that reach it through a proxy. */
  async function twoJobsBehindProxy() {
    const link = await proxy();
    const { through, direct } = classes({ url: link.url });
    const name = `q-${randomUUID()}`;
    const queue = new direct.Queue(name, { connection: {} });
    const [first, second] = await queue.addBulk([
      { name: 'first', data: {} },
      { name: 'second', data: {} },
    ]);
    return { link, through, name, queue, first, second };
  }

  it('a completion whose answer is lost is sent again: the next job it leased is handed over, and each job completes once', async () => {
    const { link, through, name, queue, first, second } = await twoJobsBehindProxy();
    const errors: Error[] = [];
    const completed: string[] = [];
    const worker = new through.Worker(
      name,
      async job => {
        // The completion goes with these replies held: the server applies
        // it and leases the second job to this worker, and the answer is lost.
        if (job.id === first.id) link.holdReplies();
        return job.name;
      },
      { connection: {}, lockDuration: 30_000, autorun: false },
    );
    worker.on('error', err => errors.push(err));
    worker.on('completed', job => completed.push(job.id!));
    onTestFinished(async () => {
      await Promise.all([worker.close(), queue.close()]);
    });
    void worker.run();
    await vi.waitFor(async () => expect(await queue.getJobState(first.id!)).toBe('completed'), settled);
    expect(await queue.getJobState(second.id!)).toBe('active');
    link.cut();
    link.passReplies();
    // Not after its 30 s lock lapsed and it stalled.
    await vi.waitFor(async () => expect(await queue.getJobState(second.id!)).toBe('completed'), {
      timeout: 5_000,
      interval: 20,
    });
    // The worker hears the second completion's answer after the store has it.
    await vi.waitFor(() => expect(completed).toEqual([first.id, second.id]), settled);
    expect(errors).toEqual([]);
    expect((await queue.getJob(second.id!))?.stalledCounter).toBe(0);
  });

  // Its answer lost, a retry or delay is sent again once the connection is
  // back, by when its job may have been leased anew: the job's record keeps
  // the completion's key through the new lease, so the repeat is its first
  // answer again. Before, BullMQ's manual processing (one token for every
  // job) had the attempt counted twice, another worker's token had the
  // applied retry reported as a lock mismatch, and a token-less
  // `moveToDelayed` took the job from the worker that held it.
  it.each([
    ['a retry, the job leased anew under the same token', 'same token'],
    ['a retry, the job leased anew by another worker', 'other token'],
    ['a token-less delay, the job leased anew when due', 'delay'],
  ] as const)('%s: sent again, it gives its first answer and is not applied twice', async (_, kind) => {
    const link = await proxy();
    const { through, direct } = classes({ url: link.url });
    const name = `q-${randomUUID()}`;
    const queue = new direct.Queue(name, { connection: {} });
    const held = new through.Worker(name, null, { connection: {}, autorun: false });
    const next = new direct.Worker(name, null, { connection: {}, autorun: false });
    onTestFinished(async () => {
      await Promise.all([held.close(), next.close(), queue.close()]);
    });
    await Promise.all([held.waitUntilReady(), next.waitUntilReady()]);
    const added = await queue.add('j', {}, { attempts: 3 });
    const token = 'manual';
    const job = await held.getNextJob(token, { block: false });
    expect(job?.id).toBe(added.id);
    link.holdReplies();
    const ending =
      kind === 'delay' ? job.moveToDelayed(Date.now() + 200) : job.moveToFailed(new Error('again'), token);
    ending.catch(() => undefined);
    const parked = kind === 'delay' ? 'delayed' : 'waiting';
    await vi.waitFor(async () => expect(await queue.getJobState(added.id!)).toBe(parked), settled);
    const attemptsMade = (await queue.getJob(added.id!))?.attemptsMade;
    await vi.waitFor(
      async () => expect((await next.getNextJob(kind === 'other token' ? 'other' : token, { block: false }))?.id).toBe(added.id),
      { timeout: 5_000, interval: 50 },
    );
    link.cut();
    link.passReplies();
    await ending;
    const after = await queue.getJob(added.id!);
    expect({ state: await queue.getJobState(added.id!), attemptsMade: after?.attemptsMade }).toEqual({
      state: 'active',
      attemptsMade,
    });
  });

  it("a lease whose connection is cut is sent again, not failed (BullMQ's Worker then waited 15 s)", async () => {
    const { link, through, name, queue, first, second } = await twoJobsBehindProxy();
    const worker = new through.Worker(name, null, { connection: {}, autorun: false });
    onTestFinished(async () => {
      await Promise.all([worker.close(), queue.close()]);
    });
    await worker.waitUntilReady();
    link.holdReplies();
    const fetching = worker.getNextJob('manual-token', { block: false });
    // The server leases the first job; the answer is lost with the connection.
    await vi.waitFor(async () => expect(await queue.getJobState(first.id!)).toBe('active'), settled);
    link.cut();
    link.passReplies();
    const job = await fetching;
    expect(job?.id).toBe(second.id);
    // The first stays active under its lock, to be found stalled once it lapses, as if the call had failed.
    expect(await queue.getJobState(first.id!)).toBe('active');
  });

  it('an add cut on its way every time it is sent gives up after a few attempts', async () => {
    const link = await proxy();
    // A long window: what ends the add is the count of its attempts.
    const { through } = classes({ url: link.url, reconnectTimeoutMs: 60_000 });
    const queue = new through.Queue(`q-${randomUUID()}`, { connection: {} });
    onTestFinished(() => queue.close());
    await queue.add('first', {});
    link.cutOnEverySend();
    const started = Date.now();
    await expect(queue.add('doomed', {})).rejects.toBeInstanceOf(ConnectionClosedError);
    // Five resends, after waits of 50 to 800 ms.
    expect(Date.now() - started).toBeLessThan(10_000);
  });

  it('other un-awaited writes go without waiting for answers, but not ahead of an add not yet answered', async () => {
    const { link, queue, watcher } = await addsThroughProxy();
    const jobs = await Promise.all(Array.from({ length: 20 }, (_, n) => queue.add('a', { n })));
    link.holdReplies();
    try {
      const removals = jobs.map(job => queue.remove(job.id!));
      // No answer has come back, yet every removal reached the server.
      await vi.waitFor(async () => expect(await watcher.count()).toBe(1), { timeout: 5_000, interval: 20 });
      const add = queue.add('b', { n: 0 });
      await vi.waitFor(async () => expect(await watcher.count()).toBe(2), { timeout: 5_000, interval: 20 });
      // Were the add's connection to fail, it would be sent again, and could
      // land after a write sent behind it: that write waits for its answer.
      const draining = queue.drain();
      await new Promise(resolve => setTimeout(resolve, 200));
      expect(await watcher.count()).toBe(2);
      link.passReplies();
      await Promise.all([add, draining]);
      expect(await watcher.count()).toBe(0);
      expect(await Promise.all(removals)).toEqual(jobs.map(() => 1));
    } finally {
      link.passReplies();
    }
  });

  it('a bulk add keys each job too until the server says it keeps the call\'s key', async () => {
    // A server from before keys for a whole call ignores them: a bulk sent
    // again there would add its jobs twice without keys of their own.
    const factory = loamBackend({ url: inject('loamServerUrl'), namespace: `t-${randomUUID()}` });
    const backend = factory(`q-${randomUUID()}`, { connection: {} });
    const internals = backend as unknown as { channel: { bulkKeysKept: boolean }; keyedSpec: () => unknown };
    const keyedSpec = vi.spyOn(internals, 'keyedSpec');
    const bulk = (n: number) =>
      backend.addJobs(
        Array.from({ length: n }, (_, i) => ({ job: { name: 'j', data: JSON.stringify({ i }), opts: {} } as never, jobId: '' })),
      );
    expect(internals.channel.bulkKeysKept).toBe(false);
    expect(await bulk(3)).toHaveLength(3);
    expect(keyedSpec).toHaveBeenCalledTimes(3);
    expect(internals.channel.bulkKeysKept).toBe(true);
    expect(await bulk(2)).toHaveLength(2);
    expect(keyedSpec).toHaveBeenCalledTimes(3);
    await backend.close();
  });

  it("long-polls leave nothing behind on the backend's long-lived signal", async () => {
    // Node 20 keeps every `AbortSignal.any` made of a signal among that
    // signal's dependants for good (`kDependantSignals`, made at its first
    // use): one for every waitForJob and readEvents.
    const factory = loamBackend({ url: inject('loamServerUrl'), namespace: `t-${randomUUID()}` });
    const backend = factory(`q-${randomUUID()}`, { connection: {} }, { withBlockingConnection: true });
    await backend.waitUntilReady();
    const blocking = (backend as unknown as { blocking: AbortController }).blocking.signal;
    for (let i = 0; i < 200; i++) await backend.waitForJob(0.001);
    const dependants = Object.getOwnPropertySymbols(blocking).find(s => s.description === 'kDependantSignals');
    const kept = dependants ? ((blocking as unknown as Record<symbol, Set<unknown> | undefined>)[dependants]?.size ?? 0) : 0;
    expect(kept).toBeLessThan(5);
    await backend.close();
  });

  it('a url that is not http:// or https:// is refused when the backend is made', () => {
    // Before: made, and every call failed as a lost connection.
    for (const url of ['localhost:7720', '127.0.0.1:7720', 'ftp://127.0.0.1:7720', 'not a url']) {
      expect(() => loamBackend({ url })(`q-${randomUUID()}`, { connection: {} })).toThrow(
        expect.objectContaining({ code: 'LOAM_INVALID_ARGUMENT', message: expect.stringContaining('url must be') }),
      );
    }
  });

  it('durations the channel cannot use are refused when the backend is made', () => {
    // Before: Infinity or a fraction made every add, report and completion
    // throw a bare RangeError (a key's TTL is a 64-bit integer), and a timer
    // past 2^31 - 1 ms fired every millisecond.
    const url = inject('loamServerUrl');
    for (const bad of [{ reconnectTimeoutMs: Infinity }, { pingIntervalMs: 2500.5 }, { pingTimeoutMs: 2 ** 31 }, { connectTimeoutMs: 0 }, { maxRequestBytes: 0.5 }]) {
      const factory = loamBackend({ url, namespace: `t-${randomUUID()}`, ...bad });
      expect(() => factory(`q-${randomUUID()}`, { connection: {} })).toThrow(
        expect.objectContaining({ code: 'LOAM_INVALID_ARGUMENT', message: expect.stringContaining(Object.keys(bad)[0]) }),
      );
    }
  });

  it('a call gives up on a server that stays away after reconnectTimeoutMs', async () => {
    const port = await freePort();
    const { Queue } = withBackend(loamBackend({ url: `http://127.0.0.1:${port}`, reconnectTimeoutMs: 300 }));
    const queue = new Queue(`q-${randomUUID()}`, { connection: {} });
    const started = Date.now();
    await expect(queue.add('a', {})).rejects.toBeInstanceOf(ConnectionClosedError);
    expect(Date.now() - started).toBeLessThan(3_000);
    await queue.close();
  });

  it('a connection never made (its TLS handshake unanswered) is given up after connectTimeoutMs, and its calls were never sent', async () => {
    // A listener that takes connections and never says a word: the client's
    // connection stays "connecting", where PINGs cannot go. Before, its calls
    // waited as long as the kernel's connect (here: for ever), far past
    // reconnectTimeoutMs.
    const silent = new Set<net.Socket>();
    const hole = net.createServer(socket => {
      silent.add(socket);
      socket.on('error', () => undefined);
    });
    await new Promise<void>(resolve => hole.listen(0, '127.0.0.1', resolve));
    onTestFinished(async () => {
      for (const socket of silent) socket.destroy();
      await new Promise(resolve => hole.close(resolve));
    });
    const { port } = hole.address() as net.AddressInfo;
    for (const calls of ['session', 'unary'] as const) {
      // A window of 2 s has room for five attempts (each 200 ms, then a
      // wait of 50 ms, doubling), so three come even on a busy machine.
      const { Queue } = withBackend(
        loamBackend({ url: `https://127.0.0.1:${port}`, calls, connectTimeoutMs: 200, reconnectTimeoutMs: 2_000 }),
      );
      const queue = new Queue(`q-${randomUUID()}`, { connection: {} });
      const before = silent.size;
      const started = Date.now();
      await expect(queue.add('a', {})).rejects.toBeInstanceOf(ConnectionClosedError);
      expect(Date.now() - started).toBeLessThan(8_000);
      // Never sent, so tried again on new connections until the window closed.
      expect(silent.size - before).toBeGreaterThan(2);
      await queue.close();
    }
  }, 30_000);

  it('a request over the size limit fails at once, and the calls after it go on', async () => {
    const { direct } = classes();
    const queue = new direct.Queue(`q-${randomUUID()}`, { connection: {} });
    const started = Date.now();
    // Node's HTTP/2 client sent about 90 MB on and on after the server had
    // refused it: the add never settled, nor did any call of the Queue after it.
    await expect(queue.add('big', { s: 'z'.repeat(95 << 20) })).rejects.toMatchObject({
      code: 'LOAM_RESOURCE_EXHAUSTED',
    });
    expect(Date.now() - started).toBeLessThan(10_000);
    await queue.add('small', {});
    expect(await queue.count()).toBe(1);
    await queue.close();
  });

  it('under a request limit below 1 MiB, a call over it fails at once and the calls on the session go on', async () => {
    // Sent on the session, it ended the session, and every call behind it
    // failed with it (a Worker's completion, its waitForJob).
    const server = await startLoamServer({}, { args: ['--max-request-bytes', '262144'] });
    const { Queue } = withBackend(loamBackend({ url: server.url, maxRequestBytes: 262_144 }));
    const queue = new Queue(`q-${randomUUID()}`, { connection: {} });
    try {
      await queue.waitUntilReady();
      expect(await queue.count()).toBe(0); // the session is up: the calls below go on it at once
      const big = queue.add('big', { s: 'z'.repeat(300_000) });
      const small = queue.add('small', {});
      // A write that is not sent again (its outcome unknown, it may not be).
      const paused = queue.pause();
      await expect(big).rejects.toMatchObject({ code: 'LOAM_RESOURCE_EXHAUSTED' });
      await expect(small).resolves.toMatchObject({ name: 'small' });
      await expect(paused).resolves.toBeUndefined();
      expect(await queue.count()).toBe(1);
      expect(await queue.isPaused()).toBe(true);
    } finally {
      await queue.close();
      await server.stop();
    }
  });

  it('a Worker whose token the server refuses asks again once a second, not at once', async () => {
    const server = await startLoamServer({ LOAM_JOBS_TOKENS: 'aaaaaaaaaaaaaaaa=alpha' });
    try {
      const { Worker } = withBackend(loamBackend({ url: server.url, token: 'bbbbbbbbbbbbbbbb' }));
      const worker = new Worker('refused', async () => 'ok', { connection: {}, autorun: false });
      let errors = 0;
      worker.on('error', () => errors++);
      void worker.run().catch(() => undefined);
      await new Promise(resolve => setTimeout(resolve, 2_000));
      await worker.close();
      // Before: some 5,000 refused calls in these 2 s, a whole core busy.
      expect(errors).toBeGreaterThan(0);
      expect(errors).toBeLessThan(10);
    } finally {
      await server.stop();
    }
  });

  it('closing a Queue ends the wait a refused token started at once', async () => {
    const server = await startLoamServer({ LOAM_JOBS_TOKENS: 'aaaaaaaaaaaaaaaa=alpha' });
    try {
      const { Queue } = withBackend(loamBackend({ url: server.url, token: 'bbbbbbbbbbbbbbbb' }));
      const queue = new Queue(`q-${randomUUID()}`, { connection: {} });
      await expect(queue.add('a', {})).rejects.toThrow();
      // The refusal makes the calls after it wait a second before asking again.
      const refused = Date.now();
      const waiting = queue.add('b', {}).then(
        () => ({ outcome: 'added', after: Date.now() - refused }),
        () => ({ outcome: 'refused', after: Date.now() - refused }),
      );
      await new Promise(resolve => setTimeout(resolve, 50));
      await queue.close();
      const { outcome, after } = await waiting;
      expect(outcome).toBe('refused');
      // Before: the add waited out the rest of the second, and settled a
      // second after the refusal at the earliest. Timed from the refusal, not
      // from the close, the bound leaves the close most of that second.
      expect(after).toBeLessThan(900);
    } finally {
      await server.stop();
    }
  });

  it('joins the chunks of a large answer on the session once, not once per chunk', async () => {
    const { direct } = classes();
    const queue = new direct.Queue(`q-${randomUUID()}`, { connection: {} });
    const size = 4_000_000;
    const job = await queue.add('big', { s: 'x'.repeat(size) });
    await queue.getJobCounts();
    const concat = vi.spyOn(Buffer, 'concat');
    try {
      const back = await queue.getJob(job.id!);
      expect(back!.data.s.length).toBe(size);
      // Some 250 chunks of 16 KiB: joined once per chunk, reading was quadratic.
      expect(concat.mock.calls.length).toBeLessThanOrEqual(2);
    } finally {
      concat.mockRestore();
    }
    await queue.close();
  });
});
