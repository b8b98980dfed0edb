import { afterAll, describe, expect, it } from 'vitest';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { Queue, getDefaultBackendFactory, setDefaultBackendFactory } from 'bullmq';

// Not from helpers.js: importing the package before LOAM_DATA_DIR is set below
// would bind its classes to the default directory.
const describeInProcess = process.env.LOAM_TEST_BACKEND === 'remote' ? describe.skip : describe;

const dataDir = mkdtempSync(path.join(tmpdir(), 'loam-factory-'));
process.env.LOAM_DATA_DIR = dataDir;

afterAll(() => {
  setDefaultBackendFactory();
  rmSync(dataDir, { recursive: true, force: true });
});

describeInProcess('factory entry points', () => {
  it('the factory subpath is a ready BackendFactory usable as the process default', async () => {
    const { default: factory } = await import('../src/factory.js');
    setDefaultBackendFactory(factory);
    expect(getDefaultBackendFactory()).toBe(factory);
    const queue = new Queue('plain-bullmq-import');
    const job = await queue.add('x', { a: 1 });
    expect(await queue.getJobCounts('waiting')).toEqual({ waiting: 1 });
    expect((await queue.getJob(job.id!))?.data).toEqual({ a: 1 });
    expect(queue.qualifiedName).toBe('bull:plain-bullmq-import');
    await queue.close();
  });

  it('the bound classes share the default store of the process', async () => {
    const { Queue: LoamQueue, loamBackend } = await import('../src/index.js');
    const a = new LoamQueue('shared', { connection: {} });
    const b = new Queue('shared', { connection: {} }, loamBackend());
    await a.add('from-a', {});
    expect(await b.getJobCounts('waiting')).toEqual({ waiting: 1 });
    await a.close();
    await b.close();
  });

  it('a bound Worker needs no connection option, and can be subclassed', async () => {
    const { Queue: LoamQueue, Worker: LoamWorker } = await import('../src/index.js');
    class Doubler extends LoamWorker {
      describe(): string {
        return `doubler of ${this.name}`;
      }
    }
    const queue = new LoamQueue('no-connection');
    const worker = new Doubler('no-connection', async job => job.data.n * 2);
    expect(worker).toBeInstanceOf(LoamWorker);
    expect(worker.describe()).toBe('doubler of no-connection');
    const done = new Promise(resolve => worker.on('completed', (_job, value) => resolve(value)));
    await queue.add('double', { n: 21 });
    expect(await done).toBe(42);
    await worker.close();
    await queue.close();
  });
});

const describeRemote = process.env.LOAM_TEST_BACKEND === 'remote' ? describe : describe.skip;

describeRemote('a queue connection naming a server', () => {
  it("takes the ready-made classes' queue to that server, not in-process", async () => {
    // They are bound to loamBackend(), which took a `connection: { url }` in-process without a word.
    const { inject } = await import('vitest');
    const { Queue: LoamQueue, Worker: LoamWorker, RemoteQueueBackend, loamBackend } = await import('../src/index.js');
    const connection = { url: inject('loamServerUrl'), namespace: `t-${process.pid}-url` };
    const queue = new LoamQueue('named-server', { connection });
    expect(queue.getBackend()).toBeInstanceOf(RemoteQueueBackend);
    await queue.add('over-the-network', { n: 1 });
    const sameServer = new Queue('named-server', { connection }, loamBackend({ url: connection.url }));
    expect(await sameServer.getJobCounts('waiting')).toEqual({ waiting: 1 });
    const worker = new LoamWorker('named-server', async job => job.data.n + 1, { connection });
    const done = new Promise(resolve => worker.on('completed', (_job, value) => resolve(value)));
    expect(await done).toBe(2);
    await worker.close();
    await sameServer.close();
    await queue.close();
  });
});
