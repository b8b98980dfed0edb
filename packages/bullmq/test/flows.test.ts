import { afterAll, describe, expect, it } from 'vitest';
import { WaitingChildrenError, type IQueueBackend, type Job } from 'bullmq';
import { freshLoam, until } from './helpers.js';

const loam = freshLoam();
const { Queue, Worker, FlowProducer } = loam;
const connection = {};

afterAll(() => loam.cleanup());

describe('flows', () => {
  it('runs children first, then the parent with their values', async () => {
    const parents = loam.queueName();
    const children = loam.queueName();
    const flow = new FlowProducer({ connection });
    const tree = await flow.add({
      name: 'sum',
      queueName: parents,
      children: [1, 2, 3].map(n => ({ name: 'n', queueName: children, data: { n } })),
    });
    expect(await tree.job.getState()).toBe('waiting-children');
    const parentQueue = new Queue(parents, { connection });
    expect(await tree.job.getDependenciesCount()).toEqual({ processed: 0, unprocessed: 3, ignored: 0, failed: 0 });

    const childWorker = new Worker(children, async (job: Job) => job.data.n * 10, { connection });
    let seen: Record<string, number> = {};
    const parentWorker = new Worker(
      parents,
      async (job: Job) => {
        seen = await job.getChildrenValues();
        return Object.values(seen).reduce((a, b) => a + b, 0);
      },
      { connection },
    );
    await until(async () => (await tree.job.getState()) === 'completed');
    const parent = await parentQueue.getJob(tree.job.id!);
    expect(parent?.returnvalue).toBe(60);
    expect(Object.keys(seen).every(k => k.startsWith(`bull:${children}:`))).toBe(true);
    const deps = await parent!.getDependencies();
    expect(Object.values(deps.processed ?? {}).sort()).toEqual([10, 20, 30]);
    expect(deps.unprocessed).toEqual([]);
    const page = await parentQueue.getDependencies(tree.job.id!, 'processed', 0, 1);
    expect(page.total).toBe(3);
    expect(page.items.length).toBe(2);

    await childWorker.close();
    await parentWorker.close();
    await parentQueue.close();
    await flow.close();
  });

  it("pages a parent's pending and processed children, with their jobs", async () => {
    const parents = loam.queueName();
    const children = loam.queueName();
    const flow = new FlowProducer({ connection });
    const tree = await flow.add({
      name: 'parent',
      queueName: parents,
      children: [0, 1, 2, 3, 4].map(n => ({ name: 'n', queueName: children, data: { n }, opts: { jobId: `c${n}` } })),
    });
    const worker = new Worker(children, null, { connection });
    for (const _ of [0, 1]) {
      const job = await worker.getNextJob('tok');
      await job.moveToCompleted(job.data.n * 10, 'tok', false);
    }
    const parentQueue = new Queue(parents, { connection });
    const key = (id: string) => `bull:${children}:${id}`;
    const ids = (page: { items: { id: string }[] }) => page.items.map(i => i.id);

    const pending = await parentQueue.getDependencies(tree.job.id!, 'pending', 1, 2);
    expect(pending.total).toBe(3);
    expect(ids(pending)).toEqual([key('c3'), key('c4')]);
    expect(pending.jobs.map(j => j.id)).toEqual(['c3', 'c4']);
    expect(pending.jobs.map(j => JSON.parse(j.data).n)).toEqual([3, 4]);

    const processed = await parentQueue.getDependencies(tree.job.id!, 'processed', 1, -1);
    expect(processed.total).toBe(2);
    expect(processed.items).toEqual([{ id: key('c1'), v: 10 }]);
    expect(processed.jobs.map(j => j.id)).toEqual(['c1']);

    const beyond = await parentQueue.getDependencies(tree.job.id!, 'processed', 5, 9);
    expect(beyond).toMatchObject({ total: 2, items: [], jobs: [] });
    // -1 runs to the last; a lower end gives none, as BullMQ's Redis script.
    expect(ids(await parentQueue.getDependencies(tree.job.id!, 'pending', 1, -1))).toEqual([key('c3'), key('c4')]);
    expect(await parentQueue.getDependencies(tree.job.id!, 'pending', 0, -2)).toMatchObject({ total: 3, items: [] });

    await worker.close();
    await parentQueue.close();
    await flow.close();
  });

  it("keeps one backend per queue for a FlowProducer's nodes", async () => {
    const flow = new FlowProducer({ connection });
    await flow.waitUntilReady();
    const backend = (flow as unknown as { backend: IQueueBackend }).backend;
    const [a, b] = [loam.queueName(), loam.queueName()];
    const first = backend.forQueue(a);
    expect(backend.forQueue(a)).toBe(first);
    expect(backend.forQueue(b)).not.toBe(first);
    expect(backend.forQueue(a, 'other')).not.toBe(first);
    expect(backend.forQueue(a, 'other').qualifiedName).toBe(`other:${a}`);
    // A sibling someone closed is not handed out again.
    await first.close();
    const second = backend.forQueue(a);
    expect(second).not.toBe(first);
    expect(second.qualifiedName).toBe(`bull:${a}`);
    await flow.close();
  });

  it('a sibling made after its FlowProducer closed fails quietly, not with an unhandled rejection', async () => {
    const unhandled: unknown[] = [];
    const onUnhandled = (err: unknown) => unhandled.push(err);
    process.on('unhandledRejection', onUnhandled);
    try {
      const flow = new FlowProducer({ connection });
      await flow.waitUntilReady();
      const backend = (flow as unknown as { backend: IQueueBackend }).backend;
      await flow.close();
      // What a FlowProducer closed right after an add leaves: siblings whose
      // ready check runs after their owner closed (no one listens to them).
      const sibling = backend.forQueue(loam.queueName());
      await sibling.waitUntilReady().catch(() => undefined);
      await new Promise(resolve => setTimeout(resolve, 50));
      expect(unhandled).toEqual([]);
    } finally {
      process.off('unhandledRejection', onUnhandled);
    }
  });

  it("adds a FlowProducer.addBulk's flows at once, in BullMQ's order: every root, then their children", async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const flow = new FlowProducer({ connection });
    await flow.addBulk([
      { name: 'B1', queueName: name },
      { name: 'B2', queueName: name, children: ['bc', 'bd'].map(kid => ({ name: kid, queueName: name })) },
      { name: 'B3', queueName: name },
    ]);
    // As Redis's MULTI adds the nodes: B1, B2, B3, then B2's children.
    const waiting = await queue.getJobs(['waiting'], 0, -1, true);
    expect(waiting.map(job => job.name)).toEqual(['B1', 'B3', 'bc', 'bd']);
    await flow.close();
    await queue.close();
  });

  it('adds the other trees of a FlowProducer.addBulk when one is refused, as Redis does', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const flow = new FlowProducer({ connection });
    const [valid, orphan] = await flow.addBulk([
      { name: 'valid', queueName: name, children: [{ name: 'kid', queueName: name }] },
      { name: 'orphan', queueName: name, opts: { parent: { id: 'missing', queue: `bull:${name}` } } },
    ]);
    expect(await queue.getJobState(valid.job.id!)).toBe('waiting-children');
    expect(await queue.getJob(orphan.job.id!)).toBeUndefined();
    await expect(
      flow.add({ name: 'orphan', queueName: name, opts: { parent: { id: 'missing', queue: `bull:${name}` } } }),
    ).rejects.toThrow('Missing key for parent job');
    await flow.close();
    await queue.close();
  });

  it('adds a flow onto an existing parent: the parent stands and waits for the new children too', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const flow = new FlowProducer({ connection });
    const root = { name: 'root', queueName: name, opts: { jobId: 'root' } };
    await flow.add({ ...root, children: [{ name: 'first', queueName: name }] });
    const again = await flow.add({ ...root, children: [{ name: 'second', queueName: name }] });
    expect(again.job.id).toBe('root');
    expect(await queue.getJobState('root')).toBe('waiting-children');
    expect(await again.job.getDependenciesCount()).toEqual({ processed: 0, unprocessed: 2, ignored: 0, failed: 0 });
    const worker = new Worker(name, async (job: Job) => job.name, { connection });
    await until(async () => (await queue.getJobState('root')) === 'completed');
    const values = Object.values(await (await queue.getJob('root'))!.getChildrenValues());
    expect(values.sort()).toEqual(['first', 'second']);
    await worker.close();
    await flow.close();
    await queue.close();
  });

  it('parks a running parent until the children it added finish (moveToWaitingChildren)', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const steps: string[] = [];
    const worker = new Worker(
      name,
      async (job: Job, token?: string) => {
        if (job.name === 'child') return 'child-done';
        if (job.data.step === 'start') {
          await queue.add('child', {}, { parent: { id: job.id!, queue: job.queueQualifiedName } });
          await job.updateData({ step: 'waiting' });
          steps.push('added child');
          if (await job.moveToWaitingChildren(token!)) throw new WaitingChildrenError();
        }
        steps.push('resumed');
        return Object.values(await job.getChildrenValues());
      },
      { connection },
    );
    const parent = await queue.add('parent', { step: 'start' });
    await until(async () => (await parent.getState()) === 'completed');
    expect(steps).toEqual(['added child', 'resumed']);
    expect((await queue.getJob(parent.id!))?.returnvalue).toEqual(['child-done']);
    await worker.close();
    await queue.close();
  });
});
