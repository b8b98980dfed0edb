import { afterAll, describe, expect, inject, it } from 'vitest';
import { randomUUID } from 'node:crypto';
import { Queue, getDefaultBackendFactory, setDefaultBackendFactory, withBackend } from 'bullmq';
import { backendKind, clientNameOf, until } from './helpers.js';
import { loamBackend, RemoteQueueBackend } from '../src/index.js';
import { INTERRUPTED_WAIT } from '../src/common.js';
import { startLoamServer } from './remote-server.js';

/** What only the remote backend has: the factory's LOAM_URL, namespaces, interrupts, stream limits. */
const describeRemote = backendKind === 'remote' ? describe : describe.skip;

describeRemote('remote backend', () => {
  afterAll(() => setDefaultBackendFactory());

  it('the factory subpath connects to $LOAM_URL', async () => {
    process.env.LOAM_URL = inject('loamServerUrl');
    process.env.LOAM_NAMESPACE = `t-${randomUUID()}`;
    const { default: factory } = await import('../src/factory.js');
    setDefaultBackendFactory(factory);
    expect(getDefaultBackendFactory()).toBe(factory);
    const queue = new Queue('plain-bullmq-import');
    expect(queue.getBackend()).toBeInstanceOf(RemoteQueueBackend);
    const job = await queue.add('x', { a: 1 });
    expect(await queue.getJobCounts('waiting')).toEqual({ waiting: 1 });
    expect((await queue.getJob(job.id!))?.data).toEqual({ a: 1 });
    await queue.close();
  });

  it('namespaces keep queues of the same name apart', async () => {
    const url = inject('loamServerUrl');
    const a = new (withBackend(loamBackend({ url, namespace: `t-${randomUUID()}` })).Queue)('same', { connection: {} });
    const b = new (withBackend(loamBackend({ url, namespace: `t-${randomUUID()}` })).Queue)('same', { connection: {} });
    await a.add('only-in-a', {});
    expect(await a.getJobCounts('waiting')).toEqual({ waiting: 1 });
    expect(await b.getJobCounts('waiting')).toEqual({ waiting: 0 });
    await a.close();
    await b.close();
  });

  it('sends the token; the token decides the namespace', async () => {
    const server = await startLoamServer({
      LOAM_JOBS_TOKENS: 'token-alpha-0123456789=alpha,token-beta-01234567890=beta',
    });
    try {
      const alpha = new (withBackend(loamBackend({ url: server.url, token: 'token-alpha-0123456789' })).Queue)('q', {
        connection: {},
      });
      const beta = new (withBackend(loamBackend({ url: server.url, token: 'token-beta-01234567890' })).Queue)('q', {
        connection: {},
      });
      await alpha.add('a', {});
      expect(await alpha.getJobCounts('waiting')).toEqual({ waiting: 1 });
      expect(await beta.getJobCounts('waiting')).toEqual({ waiting: 0 });

      const stranger = new (withBackend(loamBackend({ url: server.url, token: 'not-a-known-token-000' })).Queue)('q', {
        connection: {},
      });
      await expect(stranger.add('x', {})).rejects.toMatchObject({ code: 'LOAM_UNAUTHENTICATED' });
      const trespasser = new (
        withBackend(loamBackend({ url: server.url, token: 'token-beta-01234567890', namespace: 'alpha' })).Queue
      )('q', { connection: {} });
      await expect(trespasser.getJobCounts('waiting')).rejects.toMatchObject({ code: 'LOAM_PERMISSION_DENIED' });
      await Promise.all([alpha, beta, stranger, trespasser].map(q => q.close()));
    } finally {
      await server.stop();
    }
  });

  it('a read starts after the writes issued before it, awaited or not (as on one Redis connection)', async () => {
    const url = inject('loamServerUrl');
    const { Queue: RemoteQueue } = withBackend(loamBackend({ url, namespace: `t-${randomUUID()}` }));
    const queue = new RemoteQueue(`q-${randomUUID()}`, { connection: {} });
    const written = queue.setGlobalConcurrency(3);
    const added = queue.add('a', {});
    expect(await queue.getGlobalConcurrency()).toBe(3);
    expect(await queue.getJobCounts('waiting')).toEqual({ waiting: 1 });
    await Promise.all([written, added]);
    await queue.close();
  });

  it('lists two unnamed workers of a queue as two clients, as Redis does', async () => {
    const url = inject('loamServerUrl');
    const { Queue: RemoteQueue, Worker: RemoteWorker } = withBackend(loamBackend({ url, namespace: `t-${randomUUID()}` }));
    const name = `q-${randomUUID()}`;
    const queue = new RemoteQueue(name, { connection: {} });
    const workers = [1, 2].map(() => new RemoteWorker(name, async () => 1, { connection: {} }));
    await Promise.all(workers.map(w => w.waitUntilReady()));
    const listed = await queue.getWorkers();
    expect(listed.map(w => w.rawname)).toEqual([clientNameOf(queue), clientNameOf(queue)]);
    await Promise.all(workers.map(w => w.close()));
    await queue.close();
  });

  it.each(['session', 'unary'] as const)('disconnectBlocking and close cut a long-poll short (calls: %s)', async calls => {
    const url = inject('loamServerUrl');
    const factory = loamBackend({ url, namespace: `t-${randomUUID()}`, calls });
    const backend = factory('idle', { connection: {} }, { withBlockingConnection: true });
    await backend.waitUntilReady();
    let started = Date.now();
    const waiting = backend.waitForJob(20);
    await new Promise(r => setTimeout(r, 100));
    await backend.disconnectBlocking();
    expect(await waiting).toEqual(INTERRUPTED_WAIT);
    expect(Date.now() - started).toBeLessThan(2_000);

    await backend.reconnectBlocking();
    const events = factory('idle', { connection: {} }, { blocking: true });
    await events.waitUntilReady();
    started = Date.now();
    const reading = events.readEvents('$', 20_000);
    await new Promise(r => setTimeout(r, 100));
    await events.close();
    expect(await reading).toBeNull();
    expect(Date.now() - started).toBeLessThan(2_000);
    await backend.close();
  });

  it('a call too large for a session goes on its own stream: a refusal fails it alone', async () => {
    const server = await startLoamServer({}, { args: ['--max-request-bytes', String(3 << 20)] });
    try {
      const factory = loamBackend({ url: server.url, namespace: `t-${randomUUID()}` });
      const { Queue: RemoteQueue } = withBackend(factory);
      const queue = new RemoteQueue('large', { connection: {} });
      const waiter = factory('large', { connection: {} }, { withBlockingConnection: true });
      await waiter.waitUntilReady();
      // A long-poll on the session while the large calls go.
      const waiting = waiter.waitForJob(10);
      const large = await queue.add('large', { blob: 'x'.repeat(2 << 20) });
      await expect(queue.add('too-large', { blob: 'x'.repeat(4 << 20) })).rejects.toMatchObject({
        code: 'LOAM_RESOURCE_EXHAUSTED',
      });
      // The long-poll saw the first add; the session lived through the refusal.
      expect(await waiting).toEqual({ member: '0', score: 0 });
      expect((await queue.getJob(large.id!))?.data.blob.length).toBe(2 << 20);
      expect(await queue.getJobCounts('waiting')).toEqual({ waiting: 1 });
      await waiter.close();
      await queue.close();
    } finally {
      await server.stop();
    }
  });

  // On a session, 300 calls in flight on one stream; one stream per call, within the per-connection limit.
  // Under 2 s on an idle machine. The wait for the 600 jobs is given 30 s, and the
  // test more, so that a slow run fails with the wait's message, not the test's timeout.
  it.each(['session', 'unary'] as const)('a worker at concurrency 300 works (calls: %s)', async calls => {
    const url = inject('loamServerUrl');
    const { Queue: RemoteQueue, Worker: RemoteWorker } = withBackend(
      loamBackend({ url, namespace: `t-${randomUUID()}`, calls }),
    );
    const name = `q-${randomUUID()}`;
    const queue = new RemoteQueue(name, { connection: {} });
    await queue.addBulk(Array.from({ length: 600 }, (_, i) => ({ name: 'n', data: { i } })));
    let done = 0;
    const worker = new RemoteWorker(name, () => new Promise(r => setTimeout(r, 20)), {
      connection: {},
      concurrency: 300,
    });
    const errors: Error[] = [];
    worker.on('error', err => errors.push(err));
    worker.on('completed', () => done++);
    await until(() => done === 600, 30_000);
    expect(errors).toEqual([]);
    expect(await queue.getJobCounts('completed')).toEqual({ completed: 600 });
    await worker.close();
    await queue.close();
  }, 45_000);
});
