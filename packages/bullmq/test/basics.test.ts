import { afterAll, describe, expect, it } from 'vitest';
import type { Job } from 'bullmq';
import { freshLoam, until } from './helpers.js';

const loam = freshLoam();
const { Queue, Worker, QueueEvents } = loam;
const connection = {};

afterAll(() => loam.cleanup());

describe('Queue and Worker on Loam', () => {
  it("never shows a worker a job before the producer's add resolved", async () => {
    for (let round = 0; round < 20; round++) {
      const name = loam.queueName();
      const queue = new Queue(name, { connection });
      await queue.waitUntilReady();
      const order: string[] = [];
      const worker = new Worker(name, async () => {}, { connection });
      worker.on('active', () => order.push('active'));
      await queue.add('job', {});
      order.push('added');
      await until(() => order.includes('active'));
      expect(order).toEqual(['added', 'active']);
      await worker.close();
      await queue.close();
    }
  });

  it('adds jobs and reports counts', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const job = await queue.add('greet', { who: 'world' });
    expect(job.id).toBe('1');
    const [a, b] = await queue.addBulk([
      { name: 'x', data: { n: 1 } },
      { name: 'y', data: { n: 2 }, opts: { priority: 3 } },
    ]);
    expect([a.id, b.id]).toEqual(['2', '3']);
    await queue.add('later', {}, { delay: 60_000 });
    const counts = await queue.getJobCounts();
    expect(counts).toMatchObject({ waiting: 2, prioritized: 1, delayed: 1, active: 0, completed: 0, failed: 0 });

    const stored = await queue.getJob('1');
    expect(stored?.name).toBe('greet');
    expect(stored?.data).toEqual({ who: 'world' });
    expect(await stored?.getState()).toBe('waiting');
    expect((await queue.getWaiting()).map(j => j.id)).toEqual(['1', '2']);
    await queue.close();
  });

  it('takes what ioredis would: a job id given as a number, a progress of undefined, a log row that is no string', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const job = await queue.add('a', {});
    expect(job.id).toBe('1');
    // Plain JavaScript, an id from a route's params: ioredis sends a number's digits.
    const byNumber = 1 as unknown as string;
    expect((await queue.getJob(byNumber))?.name).toBe('a');
    expect(await queue.getJobState(byNumber)).toBe('waiting');
    expect(await queue.addJobLog(byNumber, 'by number')).toBe(1);
    const namedByNumber = await queue.add(7 as unknown as string, {});
    expect((await queue.getJob(namedByNumber.id!))?.name).toBe('7');
    await namedByNumber.remove();
    // JSON.stringify(undefined) is undefined: Redis keeps '', read back as 0.
    await job.updateProgress(undefined as never);
    expect((await queue.getJob(job.id!))?.progress).toBe(0);
    expect(await job.log(42 as never)).toBe(2);
    expect((await queue.getJobLogs(job.id!)).logs).toEqual(['by number', '42']);
    // Type names passed as one array: ioredis sends the array's text, a type no job is in.
    const asArray = ['waiting', 'delayed'] as never;
    expect(await queue.getJobCounts(asArray)).toEqual({ 'waiting,delayed': 0 });
    expect(await queue.remove(byNumber)).toBe(1);
    expect(await queue.getJob('1')).toBeUndefined();
    await queue.close();
  });

  it('adds every job of an addBulk or none: one refused job fails the call and adds nothing', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const orphan = { name: 'orphan', data: {}, opts: { parent: { id: 'nope', queue: `bull:${name}` } } };
    await expect(
      queue.addBulk([{ name: 'g1', data: {} }, orphan, { name: 'g2', data: {} }]),
    ).rejects.toMatchObject({ code: -5, message: `Missing key for parent job bull:${name}:nope. addJob` });
    expect(await queue.count()).toBe(0);
    await queue.close();
  });

  it('records the delay BullMQ counted when a job is moved to delayed, not one counted again by the store', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const worker = new Worker(name, null, { connection, autorun: false });
    await queue.add('later', {});
    const job = await worker.getNextJob('tok');
    const realNow = Date.now;
    const due = realNow() + 5_000;
    // A clock that moves 7 ms at each reading, so that the store's now (the
    // backend reads the clock again) is not the one BullMQ counted from.
    let readings = 0;
    Date.now = () => realNow() + 7 * readings++;
    try {
      await job.moveToDelayed(due, 'tok');
    } finally {
      Date.now = realNow;
    }
    expect(readings).toBeGreaterThan(1);
    const stored = (await queue.getJob(job.id!))!;
    expect(stored.delay).toBe(job.delay);
    expect(await stored.getState()).toBe('delayed');
    await worker.close();
    await queue.close();
  });

  it("keeps a job's repeatJobKey (the scheduler it belongs to)", async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const job = await queue.add('tick', {}, { repeatJobKey: 'every-minute' });
    expect((await queue.getJob(job.id!))?.repeatJobKey).toBe('every-minute');
    const [bulk] = await queue.addBulk([{ name: 'tick', data: {}, opts: { repeatJobKey: 'nightly' } }]);
    expect((await queue.getJob(bulk.id!))?.repeatJobKey).toBe('nightly');
    await queue.close();
  });

  it('applies writes in call order, awaited or not (like one Redis connection)', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const adds = Array.from({ length: 50 }, (_, n) => queue.add('ordered', { n }));
    await Promise.all(adds);
    const waiting = await queue.getWaiting(0, -1);
    expect(waiting.map(j => j.data.n)).toEqual(Array.from({ length: 50 }, (_, n) => n));
    await queue.close();
  });

  it('answers a read with the writes made before it, awaited or not (like one Redis connection)', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    for (let n = 0; n < 50; n++) {
      const added = queue.add('x', { n }, { jobId: `j${n}` });
      const [job, state, counts] = await Promise.all([
        queue.getJob(`j${n}`),
        queue.getJobState(`j${n}`),
        queue.getJobCounts('waiting'),
      ]);
      expect(job?.data).toEqual({ n });
      expect(state).toBe('waiting');
      expect(counts.waiting).toBe(n + 1);
      await added;
    }
    await queue.close();
  });

  it('processes jobs with concurrency and fires QueueEvents completed', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const events = new QueueEvents(name, { connection });
    await events.waitUntilReady();
    const completedIds: string[] = [];
    events.on('completed', ({ jobId }) => completedIds.push(jobId));

    let running = 0;
    let peak = 0;
    const worker = new Worker(
      name,
      async (job: Job) => {
        running++;
        peak = Math.max(peak, running);
        await new Promise(r => setTimeout(r, 30));
        running--;
        return job.data.n * 2;
      },
      { connection, concurrency: 4 },
    );
    const jobs = await queue.addBulk(Array.from({ length: 12 }, (_, n) => ({ name: 'double', data: { n } })));
    const last = jobs[jobs.length - 1];
    expect(await last.waitUntilFinished(events, 10_000)).toBe(22);
    await until(() => completedIds.length === 12);
    expect(peak).toBeGreaterThan(1);
    expect(peak).toBeLessThanOrEqual(4);
    const counts = await queue.getJobCounts('completed', 'active', 'waiting');
    expect(counts).toEqual({ completed: 12, active: 0, waiting: 0 });
    const done = await queue.getJob(jobs[3].id!);
    expect(done?.returnvalue).toBe(6);
    expect(done?.finishedOn).toBeGreaterThan(0);
    expect(done?.attemptsMade).toBe(1);
    await worker.close();
    await events.close();
    await queue.close();
  });

  it("gives QueueEvents each large return value of its completion, after its job was retried and removed", async () => {
    // A large value of a kept job is stored once, with the job, and lent to its
    // event: the event must still read its own value once the job has moved on.
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const returned: [string, string][] = [];
    const worker = new Worker(
      name,
      async (job: Job) => {
        const value = `${job.id}:${returned.length}:${'x'.repeat(10_000)}`;
        returned.push([job.id!, value]);
        return value;
      },
      { connection },
    );
    const [a, b] = await queue.addBulk([{ name: 'a', data: {} }, { name: 'b', data: {} }]);
    await until(async () => (await queue.getJobCounts('completed')).completed === 2);
    await (await queue.getJob(a.id!))!.retry('completed');
    await until(async () => returned.length === 3 && (await queue.getJobCounts('completed')).completed === 2);
    await (await queue.getJob(b.id!))!.remove();
    expect((await queue.getJob(a.id!))?.returnvalue).toBe(returned[2][1]);

    const events = new QueueEvents(name, { connection, lastEventId: '0-0' });
    const heard: [string, string][] = [];
    events.on('completed', ({ jobId, returnvalue }) => heard.push([jobId, returnvalue as unknown as string]));
    await until(() => heard.length === 3);
    expect(heard).toEqual(returned);
    await worker.close();
    await events.close();
    await queue.close();
  });

  it('answers waitUntilFinished for a job already finished, or gone, as Redis does', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const events = new QueueEvents(name, { connection });
    await events.waitUntilReady();
    const worker = new Worker(
      name,
      async (job: Job) => {
        if (job.name === 'bad') throw new Error('bad job');
        return { n: 1 };
      },
      { connection },
    );
    const good = await queue.add('good', {});
    const bad = await queue.add('bad', {});
    const gone = await queue.add('gone', {}, { delay: 60_000 });
    await until(async () => (await good.getState()) === 'completed' && (await bad.getState()) === 'failed');
    await gone.remove();
    // Each finished before the wait began: the answer comes from isFinished.
    expect(await good.waitUntilFinished(events, 1_000)).toEqual({ n: 1 });
    await expect(bad.waitUntilFinished(events, 1_000)).rejects.toMatchObject({ message: 'bad job' });
    await expect(gone.waitUntilFinished(events, 1_000)).rejects.toMatchObject({
      message: `Missing key for job ${queue.qualifiedName}:${gone.id}. isFinished`,
    });
    await worker.close();
    await events.close();
    await queue.close();
  });

  it('retries failed jobs with backoff, then fails them for good', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const attempts: number[] = [];
    const worker = new Worker(
      name,
      async (job: Job) => {
        attempts.push(Date.now());
        if (job.attemptsMade < 2) throw new Error(`boom ${job.attemptsMade}`);
        return 'ok';
      },
      { connection },
    );
    const retried = await queue.add('flaky', {}, { attempts: 3, backoff: { type: 'fixed', delay: 200 } });
    const doomed = await queue.add('doomed', {}, { attempts: 2, backoff: { type: 'exponential', delay: 50 } });
    await until(async () => (await retried.getState()) === 'completed' && (await doomed.getState()) === 'failed');
    const ok = await queue.getJob(retried.id!);
    expect(ok?.attemptsMade).toBe(3);
    expect(ok?.returnvalue).toBe('ok');
    const failed = await queue.getJob(doomed.id!);
    expect(failed?.failedReason).toBe('boom 1');
    expect(failed?.attemptsMade).toBe(2);
    expect(failed?.stacktrace?.length).toBe(2);
    await worker.close();
    await queue.close();
  });

  it("stores the Job's own list of stack traces, as Redis does", async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const firstLine = (traces: string[] | null | undefined) => traces?.map((t) => t.split('\n')[0]);
    // An error without a stack adds no trace to the Job's list.
    const worker = new Worker(
      name,
      async (job: Job) => {
        const error = new Error(`fail ${job.attemptsMade + 1}`);
        if (job.attemptsMade === 2) error.stack = undefined;
        throw error;
      },
      { connection },
    );
    const retried = await queue.add('thrice', {}, { attempts: 3 });
    await until(async () => (await retried.getState()) === 'failed');
    await worker.close();
    expect(firstLine((await queue.getJob(retried.id!))?.stacktrace)).toEqual(['Error: fail 1', 'Error: fail 2']);
    // A failure refused for its token stays in the Job's list, and the next one
    // saves both.
    const manual = new Worker(name, null, { connection });
    const added = await queue.add('manual', {});
    const job = await manual.getNextJob('tok');
    expect(job.id).toBe(added.id);
    await expect(job.moveToFailed(new Error('first'), 'wrong', false)).rejects.toThrow();
    await job.moveToFailed(new Error('second'), 'tok', false);
    expect(firstLine((await queue.getJob(job.id!))?.stacktrace)).toEqual(['Error: first', 'Error: second']);
    await manual.close();
    await queue.close();
  });

  it('runs delayed jobs once they are due', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const ranAt: number[] = [];
    const worker = new Worker(name, async () => void ranAt.push(Date.now()), { connection });
    const added = Date.now();
    const job = await queue.add('soon', {}, { delay: 400 });
    expect(await job.getState()).toBe('delayed');
    await until(() => ranAt.length === 1);
    expect(ranAt[0] - added).toBeGreaterThanOrEqual(390);
    expect(ranAt[0] - added).toBeLessThan(2_000);
    await worker.close();
    await queue.close();
  });
});
