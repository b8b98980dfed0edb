import { afterAll, describe, expect, it } from 'vitest';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { ConnectionClosedError, UnrecoverableError, withBackend } from 'bullmq';
import { backendKind, clientNameOf, freshLoam, itInProcess, testHooks, until } from './helpers.js';
import { loamBackend, type LoamQueueBackend } from '../src/index.js';
import { INTERRUPTED_WAIT } from '../src/common.js';

const loam = freshLoam();
const { Queue, Worker } = loam;
const connection = {};

afterAll(() => loam.cleanup());

/** A job of a new queue, taken by a worker holding `token`, as the Job a caller reads back. */
async function activeJob(token: string) {
  const queue = new Queue(loam.queueName(), { connection });
  const added = await queue.add('a', {});
  const backend = queue.getBackend() as LoamQueueBackend;
  await backend.moveToActive(token);
  return { queue, backend, active: (await queue.getJob(added.id!))! };
}

describe('errors', () => {
  it('reports BullMQ codes and finishedErrors texts', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const job = await queue.add('a', {});
    const backend = queue.getBackend() as LoamQueueBackend;

    const token = 'token-1';
    const [claimed] = await backend.moveToActive(token);
    expect(claimed.id).toBe(job.id);

    await expect(job.moveToCompleted('x', 'other-token', false)).rejects.toMatchObject({
      code: -6,
      message: `Lock mismatch for job ${job.id}. Cmd moveToFinished from active`,
    });
    await expect(backend.promote(job.id!)).rejects.toMatchObject({
      code: -3,
      message: `Job ${job.id} is not in the delayed state. promote`,
    });
    await expect(backend.updateProgress('nope', 5)).rejects.toMatchObject({
      code: -1,
      message: 'Missing key for job nope. updateProgress',
    });
    await expect(
      queue.add('child', {}, { parent: { id: 'missing', queue: queue.qualifiedName } }),
    ).rejects.toMatchObject({ code: -5, message: `Missing key for parent job ${queue.qualifiedName}:missing. addJob` });

    await job.moveToCompleted('done', token, false);
    expect(await job.getState()).toBe('completed');
    await queue.close();
  });

  it("refuses removeChildDependency of a job with no parent with BullMQ's -5, as Redis does", async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const job = await queue.add('a', {});
    await expect(job.removeChildDependency()).rejects.toMatchObject({
      code: -5,
      message: 'Missing key for parent job undefined. removeChildDependency',
    });
    await queue.close();
  });

  it('answers moveToCompleted and moveToFailed in the shapes Redis does, for manual processing', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const worker = new Worker(queue.name, null, { connection, lockDuration: 60_000 });
    const take = async () => await worker.getNextJob('t');
    await queue.add('a', {});
    // Nothing asked for: Redis's adapter gives [] (manual loops destructure it).
    expect(await (await take()).moveToCompleted(1, 't', false)).toEqual([]);
    await queue.add('b', {});
    // Asked for, and nothing there: [] as well.
    expect(await (await take()).moveToFailed(new Error('x'), 't', true)).toEqual([]);
    await queue.add('c', {});
    const delayed = await queue.add('d', {}, { delay: 60_000 });
    // A delayed job pending: no job, id 0, and when it falls due.
    const next = await (await take()).moveToCompleted(1, 't', true);
    expect(next).toEqual([null, 0, 0, delayed.timestamp + 60_000]);
    await worker.close();
    await queue.close();
  });

  it('refuses job options of the wrong types alike in both backends, adding nothing', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const bad = [
      { attempts: '3' },
      { delay: '100' },
      { removeOnComplete: 'yes' },
      { removeOnFail: { count: '5' } },
      { backoff: { type: 'fixed', delay: '5' } },
      { lifo: 'yes' },
      { failParentOnFailure: null },
    ];
    for (const opts of bad) {
      await expect(queue.add('bad', {}, opts as never), JSON.stringify(opts)).rejects.toMatchObject({
        code: 'LOAM_INVALID_ARGUMENT',
        message: expect.stringContaining('job options are not valid BullMQ options'),
      });
    }
    await expect(queue.addBulk([{ name: 'ok', data: {} }, { name: 'bad', data: {}, opts: { attempts: '3' } as never }])).rejects.toMatchObject({
      code: 'LOAM_INVALID_ARGUMENT',
    });
    expect(await queue.count()).toBe(0);
    // What is right still goes in: numbers, null for an option, KeepJobs.
    await queue.add('good', {}, { attempts: 3, delay: null as never, removeOnFail: { age: 3600 } });
    expect(await queue.count()).toBe(1);
    await queue.close();
  });

  it('refuses a priority below 0, which BullMQ lets through, rather than take it as 0', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const FlowProducer = loam.FlowProducer;
    const refused = { code: 'LOAM_INVALID_ARGUMENT', message: expect.stringContaining('priority must be between 0 and 2097151') };
    await expect(queue.add('a', {}, { priority: -1 })).rejects.toMatchObject(refused);
    await expect(queue.addBulk([{ name: 'b', data: {}, opts: { priority: -2 } }])).rejects.toMatchObject(refused);
    const flows = new FlowProducer({ connection });
    await expect(flows.add({ name: 'p', queueName: queue.name, opts: { priority: -1 } })).rejects.toMatchObject(refused);
    await flows.close();
    expect(await queue.count()).toBe(0);
    const job = await queue.add('c', {}, { priority: 3 });
    await expect(job.changePriority({ priority: -1 })).rejects.toMatchObject(refused);
    expect(await queue.getCountsPerPriority([3])).toEqual({ 3: 1 });
    await queue.close();
  });

  it('refuses a number given as a string, on both backends, rather than take it as 0', async () => {
    // Through the server such a number travelled as 0: a worker's limiter or a delay was dropped without a word.
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const job = await queue.add('d', {}, { delay: 60_000, priority: 2 });
    const refused = { code: 'LOAM_INVALID_ARGUMENT' };
    await expect(job.changeDelay('200000' as unknown as number)).rejects.toMatchObject(refused);
    await expect(queue.rateLimit('100000' as unknown as number)).rejects.toMatchObject(refused);
    await expect(queue.getCountsPerPriority(['2' as unknown as number])).rejects.toMatchObject(refused);
    await expect(queue.promoteJobs({ count: '2' as unknown as number })).rejects.toMatchObject(refused);
    expect((await queue.getJob(job.id!))!.delay).toBe(60_000);
    expect(await queue.getRateLimitTtl()).toBeLessThanOrEqual(0);
    const limiter = { max: '1', duration: '1000' } as unknown as { max: number; duration: number };
    expect(() => new Worker(name, async () => 'ok', { connection, limiter, autorun: false })).toThrow(
      expect.objectContaining(refused),
    );
    await queue.close();
  });

  it('refuses a global concurrency or rate limit that is not a whole number, 0 or more, and keeps the one set', async () => {
    // Redis stores anything: -1 then holds every job back for ever, 1.5 lets two run. Loam applied no limit.
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    await queue.setGlobalConcurrency(1);
    for (const bad of [-1, 1.5, Number.NaN, Infinity]) {
      await expect(queue.setGlobalConcurrency(bad)).rejects.toMatchObject({
        code: 'LOAM_INVALID_ARGUMENT',
        message: expect.stringContaining('concurrency (setGlobalConcurrency) must be a whole number, 0 or more'),
      });
    }
    await expect(queue.setGlobalRateLimit(2, -5)).rejects.toMatchObject({
      code: 'LOAM_INVALID_ARGUMENT',
      message: expect.stringContaining('duration (setGlobalRateLimit)'),
    });
    expect(await queue.getGlobalConcurrency()).toBe(1);
    expect(await queue.getGlobalRateLimit()).toBeNull();
    await queue.setGlobalConcurrency(0);
    expect(await queue.getGlobalConcurrency()).toBe(0);
    await queue.close();
  });

  it("runs a job scheduler whose template's priority is below 0, as before: its iterations read it as 0", async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    await queue.upsertJobScheduler('below-zero', { every: 100 }, { name: 'tick', opts: { priority: -1 } });
    let done = 0;
    const worker = new Worker(name, async () => 'ok', { connection });
    worker.on('completed', () => done++);
    await until(() => done >= 3);
    await worker.close();
    await queue.close();
  });

  it("refuses a completion or lock extension without a token on another worker's job, as Redis does", async () => {
    const { queue, backend, active } = await activeJob('tok-4');
    const noToken = undefined as unknown as string;
    // Before: in-process failed converting undefined to a string; remote
    // failed the job, overriding tok-4's lock.
    const mismatch = { code: -6, message: `Lock mismatch for job ${active.id}. Cmd moveToFinished from active` };
    await expect(active.moveToFailed(new Error('e3'), noToken, false)).rejects.toMatchObject(mismatch);
    await expect(active.moveToCompleted('x', noToken, false)).rejects.toMatchObject(mismatch);
    await expect(active.moveToCompleted('x', '', false)).rejects.toMatchObject(mismatch);
    expect(await backend.extendLock(active.id!, '', 1_000)).toBe(0);
    // Redis's extendLock compares the token as it is: "0" skips the check of a move, not of an extension.
    expect(await active.extendLock('0', 1_000)).toBe(0);
    expect(await backend.extendLocks([active.id!], ['0'], 1_000)).toEqual([active.id]);
    expect(await active.getState()).toBe('active');
    await active.moveToCompleted('x', 'tok-4', false);
    expect(await active.getState()).toBe('completed');
    await queue.close();
  });

  it('refuses an unknown state name in isJobInState as an invalid argument', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const job = await queue.add('a', {});
    const backend = queue.getBackend() as LoamQueueBackend;
    // Before: in-process, an untagged error (then read as internal); remote, an Error with no code.
    await expect(backend.isJobInState('bogus', job.id!)).rejects.toMatchObject({
      code: 'LOAM_INVALID_ARGUMENT',
      message: 'Unknown job state: bogus',
    });
    expect(await backend.isJobInState('wait', job.id!)).toBe(true);
    await queue.close();
  });

  it('lists as not extended an id that extendLocks got no token for, as Redis does', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const backend = queue.getBackend() as LoamQueueBackend;
    const [a, b] = await queue.addBulk([
      { name: 'a', data: {} },
      { name: 'b', data: {} },
    ]);
    await backend.moveToActive('tok-a');
    await backend.moveToActive('tok-b');
    // Before: in-process paired the lists, so b was neither extended nor listed.
    expect(await backend.extendLocks([a.id!, b.id!], ['tok-a'], 60_000)).toEqual([b.id]);
    expect(await backend.extendLocks([a.id!, b.id!], ['tok-a', 'tok-b'], 60_000)).toEqual([]);
    await queue.close();
  });

  it('refuses to extend a lock by 0 ms or less, keeping it, as Redis refuses the expire time', async () => {
    const { queue, backend, active } = await activeJob('tok-5');
    for (const duration of [0, -1_000]) {
      await expect(active.extendLock('tok-5', duration)).rejects.toThrow('a lock is extended by at least 1 ms');
      await expect(backend.extendLocks([active.id!], ['tok-5'], duration)).rejects.toThrow('at least 1 ms');
    }
    await new Promise(resolve => setTimeout(resolve, 5));
    // Released, the lock would let remove take the job its worker still has.
    await expect(active.remove()).rejects.toThrow('locked');
    await active.moveToCompleted('x', 'tok-5', false);
    expect(await active.getState()).toBe('completed');
    await queue.close();
  });

  it('a closed Queue refuses calls, as a closed Redis connection does, while another keeps the store open', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const other = new Queue(queue.name, { connection });
    await Promise.all([queue.add('a', {}), other.waitUntilReady()]);
    await queue.close();
    await expect(queue.add('b', {})).rejects.toMatchObject({ code: 'LOAM_UNAVAILABLE' });
    await expect(queue.count()).rejects.toMatchObject({ code: 'LOAM_UNAVAILABLE' });
    expect(await other.count()).toBe(1);
    await other.close();
    const reopened = new Queue(queue.name, { connection });
    expect(await reopened.count()).toBe(1);
    await reopened.close();
  });

  // As Redis answers the commands sent before a QUIT; in-process the close
  // ran at once and refused such a read (LOAM_UNAVAILABLE), 40 times in 40.
  it('answers a read called just before close(), and refuses one called after it', async () => {
    const name = loam.queueName();
    const other = new Queue(name, { connection });
    await other.add('a', {});
    for (let i = 0; i < 20; i++) {
      const queue = new Queue(name, { connection });
      await queue.waitUntilReady();
      const added = queue.add('b', {});
      const counted = queue.count();
      const closed = queue.close();
      const late = queue.count().then(
        () => 'answered',
        (err: Error & { code?: string }) => err.code,
      );
      await added;
      expect(await counted).toBe(i + 2);
      await closed;
      expect(await late).toBe('LOAM_UNAVAILABLE');
    }
    await other.close();
  });

  // On Redis the Jobs a FlowProducer returns share its connection, closed
  // with it; in-process they went on writing to the store.
  it('refuses the calls of the Jobs a FlowProducer returned once it is closed', async () => {
    const keeper = new Queue(loam.queueName(), { connection });
    await keeper.waitUntilReady();
    const flows = new loam.FlowProducer({ connection });
    const { job, children } = await flows.add({
      name: 'parent',
      queueName: loam.queueName(),
      children: [{ name: 'child', queueName: loam.queueName() }],
    });
    await flows.close();
    await expect(job.updateProgress(42)).rejects.toMatchObject({ code: 'LOAM_UNAVAILABLE' });
    await expect(children![0].job.remove()).rejects.toMatchObject({ code: 'LOAM_UNAVAILABLE' });
    await expect(job.getState()).rejects.toMatchObject({ code: 'LOAM_UNAVAILABLE' });
    await keeper.close();
  });

  // As Redis's `XREAD BLOCK 0`; answered at once, an idle QueueEvents with
  // blockingTimeout 0 asked again at once, about 5,800 times a second.
  it('waits for an event when a read of events blocks for 0 ms', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const backend = queue.getBackend() as LoamQueueBackend;
    let answered = false;
    const read = backend.readEvents('$', 0).then(entries => {
      answered = true;
      return entries;
    });
    await new Promise(resolve => setTimeout(resolve, 300));
    expect(answered).toBe(false);
    await queue.add('a', {});
    expect(await read).not.toBeNull();
    await queue.close();
  });

  it('closing a Queue as soon as it is made raises no error', async () => {
    const errors: Error[] = [];
    // It came from the backend's own readiness check, about once in 40.
    for (let i = 0; i < 200; i++) {
      const queue = new Queue(loam.queueName(), { connection });
      queue.on('error', err => errors.push(err));
      await queue.close();
    }
    await new Promise(resolve => setTimeout(resolve, 100));
    expect(errors).toEqual([]);
  });

  it('refuses a queue name, namespace or worker name the core cannot hold as the Queue or Worker is made', () => {
    // Refused on each fetch instead, a Worker asked again at once, forever:
    // in-process that starved the event loop for good.
    const refused = { code: 'LOAM_INVALID_ARGUMENT' };
    expect(() => new Worker('q'.repeat(1025), async () => 'done', { connection, autorun: false })).toThrow(
      expect.objectContaining(refused),
    );
    expect(() => new Queue('q', { connection: { namespace: '' } })).toThrow(expect.objectContaining(refused));
    expect(() => new Worker('q', async () => 'done', { connection, name: 'w'.repeat(1025), autorun: false })).toThrow(
      expect.objectContaining(refused),
    );
  });

  it('takes any namespace in-process; over the network refuses one an HTTP header cannot carry, as the Queue is made', async () => {
    for (const namespace of ['équipe', '世界', 'a b']) {
      if (backendKind === 'remote') {
        expect(() => new Queue('q', { connection: { namespace } })).toThrow(
          expect.objectContaining({ code: 'LOAM_INVALID_ARGUMENT', message: expect.stringContaining('HTTP header') }),
        );
      } else {
        const queue = new Queue(loam.queueName(), { connection: { namespace } });
        await queue.add('a', {});
        expect(await queue.count()).toBe(1);
        await queue.close();
      }
    }
  });

  it('refuses a job name that is neither a string nor a number alike in both backends, and answers getMetrics of an unknown type with none', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    // A number goes as its digits, as ioredis sends it (basics.test.ts).
    for (const name of [undefined, null, {}]) {
      await expect(queue.add(name as never, {})).rejects.toMatchObject({ code: 'LOAM_INVALID_ARGUMENT' });
    }
    expect(await queue.count()).toBe(0);
    const none = await queue.getMetrics('Completed' as never);
    expect(none).toMatchObject({ meta: { count: 0, prevTS: 0, prevCount: 0 }, data: [], count: 0 });
    await queue.close();
  });

  it('keeps a log row of undefined or null as an empty row, as Redis does', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const job = await queue.add('a', {});
    await job.log(undefined as never);
    await job.log(null as never);
    expect((await queue.getJobLogs(job.id!)).logs).toEqual(['', '']);
    await queue.close();
  });

  it('refuses a count to keep that is not a whole number, and keeps every log row for Infinity', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const job = await queue.add('a', {});
    const backend = queue.getBackend() as LoamQueueBackend;
    const refused = { code: 'LOAM_INVALID_ARGUMENT' };
    // Read as 0, each of these removed every row or event.
    for (const keep of [-1, 0.5]) await expect(backend.addLog(job.id!, 'row', keep)).rejects.toMatchObject(refused);
    for (const keep of [-1, 0.5, NaN]) await expect(queue.trimEvents(keep)).rejects.toMatchObject(refused);
    await expect(backend.addLog(job.id!, 'a', Infinity)).resolves.toBe(1);
    await expect(backend.addLog(job.id!, 'b', Infinity)).resolves.toBe(2);
    await expect(backend.clearLogs(job.id!, -1)).rejects.toMatchObject(refused);
    expect(await queue.getJobLogs(job.id!)).toEqual({ logs: ['a', 'b'], count: 2 });
    expect(await queue.trimEvents(0)).toBeGreaterThan(0); // the refused trims removed none
    await queue.close();
  });

  it("records a failure whose reason holds a lone surrogate, as Redis does, with U+FFFD in its place", async () => {
    const queue = new Queue(loam.queueName(), { connection });
    // Text cut inside an emoji: JSON.stringify escapes the lone half.
    const reason = `could not notify ${'Zoë 😀'.slice(0, 5)}`;
    const worker = new Worker(queue.name, async () => { throw new Error(reason); }, { connection });
    // Its stack trace, which holds the reason too, is kept (it was dropped whole
    // in-process), and so is a deduplication id cut the same way (it was refused).
    const job = await queue.add('a', {}, { attempts: 2, deduplication: { id: reason } });
    await until(async () => (await queue.getJobState(job.id!)) === 'failed');
    const failed = await queue.getJob(job.id!);
    expect(failed?.failedReason).toBe('could not notify Zoë \ufffd');
    expect(failed?.stacktrace).toHaveLength(2);
    expect(failed?.stacktrace?.[1]).toContain('could not notify Zoë \ufffd');
    await Promise.all([worker.close(), queue.close()]);
  });

  it("refuses a parent named by its queue without the prefix with BullMQ's -5, as Redis does", async () => {
    const parents = new Queue(loam.queueName(), { connection });
    const parent = await parents.add('p', {}, { jobId: 'top' });
    const children = new Queue(loam.queueName(), { connection });
    // Redis looks for the key `<queue>:top`, which no BullMQ queue has.
    await expect(children.add('c', {}, { parent: { id: parent.id!, queue: parents.name } })).rejects.toMatchObject({
      code: -5,
      message: `Missing key for parent job ${parents.name}:top. addJob`,
    });
    expect(await children.count()).toBe(0);
    await children.add('c', {}, { parent: { id: parent.id!, queue: parents.qualifiedName } });
    expect(await parent.getDependenciesCount()).toMatchObject({ unprocessed: 1 });
    await Promise.all([parents.close(), children.close()]);
  });

  it('raises JobHasFailedChildren as an UnrecoverableError', async () => {
    const { fromNative } = await import('../src/errors.js');
    const err = fromNative(new Error('[bullmq:-9] {"command":"moveToFinished","jobId":"1"}'));
    expect(err).toBeInstanceOf(UnrecoverableError);
    expect((err as Error & { code: number }).code).toBe(-9);
    expect(err.message).toBe('Cannot complete job 1 because it has at least one failed child. moveToFinished');
  });

  it("writes BullMQ's text for each code the addon sends, an argument it left out as undefined", async () => {
    const { fromNative } = await import('../src/errors.js');
    const texts = [
      [-1, { command: 'moveToFinished', jobId: '7' }, 'Missing key for job 7. moveToFinished'],
      [-2, { command: 'extendLock', jobId: '7' }, 'Missing lock for job 7. extendLock'],
      [-3, { command: 'moveToFinished', jobId: '7', state: 'active' }, 'Job 7 is not in the active state. moveToFinished'],
      [-4, { command: 'moveToFinished', jobId: '7' }, 'Job 7 has pending dependencies. moveToFinished'],
      [-5, { command: 'addJob', parentKey: 'bull:p:1' }, 'Missing key for parent job bull:p:1. addJob'],
      [-5, { command: 'addJob' }, 'Missing key for parent job undefined. addJob'],
      [-6, { command: 'moveToFinished', jobId: '7', state: 'active' }, 'Lock mismatch for job 7. Cmd moveToFinished from active'],
      [-7, { command: 'addJob', parentKey: 'bull:p:1' }, 'The parent job bull:p:1 cannot be replaced. addJob'],
      [-8, { command: 'removeJob', jobId: '7' }, 'Job 7 belongs to a job scheduler and cannot be removed directly. removeJob'],
      [-10, { command: 'addJobScheduler' }, 'Cannot create job scheduler iteration - job ID already exists. addJobScheduler'],
      [
        -11,
        { command: 'addJobScheduler' },
        'Cannot create job scheduler iteration - current and next time slots already have jobs. addJobScheduler',
      ],
    ] as const;
    for (const [code, call, text] of texts) {
      const err = fromNative(new Error(`[bullmq:${code}] ${JSON.stringify(call)}`)) as Error & { code: number };
      expect([err.code, err.message]).toEqual([code, text]);
    }
  });

  it('keeps a BullMQ code whose text is not the JSON it expects as the message itself, never throwing', async () => {
    const { fromNative } = await import('../src/errors.js');
    for (const text of ['Missing key for job 7. addJob', '', 'null', '{"jobId":"7"}', '[1, 2]']) {
      const err = fromNative(new Error(`[bullmq:-1] ${text}`)) as Error & { code: number };
      expect([err.code, err.message]).toEqual([-1, text]);
    }
  });

  itInProcess('turns a Rust panic in a synchronous call into an internal error', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    // The backend's wrapper of the addon turns a synchronous throw into a
    // rejection; without `catch_unwind` the panic would abort the process.
    const native = testHooks<{ panicInCallForTest(m: string): Promise<void> }>(queue);
    const err = await native.panicInCallForTest('deliberate').catch((e: unknown) => e as Error & { code?: unknown });
    expect(err).toBeInstanceOf(Error);
    expect((err as Error).message).toMatch(/panic or N-API failure in the Loam addon: deliberate/);
    expect((err as Error & { code?: unknown }).code).toBe('LOAM_INTERNAL');
    // The process and the store are still fine.
    const job = await queue.add('after-panic', {});
    expect(await job.getState()).toBe('waiting');
    await queue.close();
  });

  itInProcess('turns a Rust panic into a rejected promise', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const native = testHooks<{ panicForTest(m: string): Promise<void> }>(queue);
    await expect(native.panicForTest('deliberate')).rejects.toThrow(/operation panicked: deliberate/);
    // The process and the store are still fine.
    const job = await queue.add('after-panic', {});
    expect(await job.getState()).toBe('waiting');
    await queue.close();
  });

  it('a block timeout that is not a number waits not at all, and the backend stays usable', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const backend = queue.getBackend() as LoamQueueBackend;
    const started = Date.now();
    expect(await backend.waitForJob(Number.NaN)).toBeNull();
    expect(Date.now() - started).toBeLessThan(2_000);
    await queue.add('a', {});
    expect(await queue.getJobCounts('waiting')).toEqual({ waiting: 1 });
    await queue.close();
  });

  it('disconnectBlocking cuts short a waitForJob asked for in the same turn, even with reconnectBlocking after', async () => {
    const name = loam.queueName();
    const backend = loam.factory(name, { connection }, { withBlockingConnection: true });
    await backend.waitUntilReady();
    const started = Date.now();
    // No await between the three: the wait may not have begun when the
    // interrupt is fired and re-armed. Before: it ran its whole 5 s.
    const waiting = backend.waitForJob(5);
    void backend.disconnectBlocking();
    void backend.reconnectBlocking();
    // Cut short: nothing is ready (a null would have BullMQ's worker fetch).
    expect(await waiting).toEqual(INTERRUPTED_WAIT);
    expect(Date.now() - started).toBeLessThan(2_000);
    // Re-armed: the next wait waits, and a job ends it.
    const next = backend.waitForJob(5);
    const queue = new Queue(name, { connection });
    await queue.add('a', {});
    expect(await next).not.toBeNull();
    await Promise.all([queue.close(), backend.close()]);
  });

  it('blocking reads asked for after disconnect() fail as on a closed connection; the blocking one waits again once reconnected', async () => {
    const name = loam.queueName();
    const backend = loam.factory(name, { connection }, { withBlockingConnection: true });
    await backend.waitUntilReady();
    await backend.disconnect();
    // Before, each answered "interrupted" at once, every time: BullMQ's
    // loops asked again without pause (through the server, without a turn of
    // the event loop). A closed connection has them wait, as on Redis.
    await expect(backend.waitForJob(0.05)).rejects.toBeInstanceOf(ConnectionClosedError);
    await expect(backend.readEvents('0-0', 50)).rejects.toBeInstanceOf(ConnectionClosedError);
    await backend.reconnectBlocking();
    expect(await backend.waitForJob(0.05)).toBeNull();
    await expect(backend.readEvents('0-0', 50)).rejects.toBeInstanceOf(ConnectionClosedError);
    await backend.close();
  });

  it('lists workers through getClientList', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const worker = new Worker(name, async () => 1, { connection, name: 'w1' });
    await worker.waitUntilReady();
    const workers = await queue.getWorkers();
    expect(workers.map(w => w.rawname)).toContain(`${clientNameOf(queue)}:w:w1`);
    // Age and idle time in whole seconds, as Redis's CLIENT LIST gives them;
    // through the server also the address of the worker's connection.
    const [listed] = workers;
    expect(Number(listed.age)).toBeGreaterThanOrEqual(0);
    expect(Number(listed.idle)).toBeGreaterThanOrEqual(0);
    expect(Number(listed.idle)).toBeLessThanOrEqual(Number(listed.age));
    if (backendKind === 'remote') expect(listed.addr).toMatch(/^127\.0\.0\.1:\d+$/);
    else expect(listed.addr).toBeUndefined();
    // A closed worker is not listed (as Redis forgets a closed connection).
    await worker.close();
    expect(await queue.getWorkersCount()).toBe(0);
    await queue.close();
  });

  itInProcess('lists only the workers of its own store and namespace', async () => {
    const name = loam.queueName();
    const tenantA = withBackend(loamBackend({ dataDir: loam.settings.dataDir, namespace: 'tenant-a' }));
    const tenantB = withBackend(loamBackend({ dataDir: loam.settings.dataDir, namespace: 'tenant-b' }));
    const elsewhere = mkdtempSync(path.join(tmpdir(), 'loam-bullmq-other-'));
    const otherStore = withBackend(loamBackend({ dataDir: elsewhere }));
    const worker = new tenantA.Worker(name, async () => 1, { connection, name: 'a-worker' });
    await worker.waitUntilReady();
    const [inA, inB, inOther, inDefault] = [tenantA, tenantB, otherStore, loam].map(
      classes => new classes.Queue(name, { connection }),
    );
    expect((await inA.getWorkers()).map(w => w.rawname)).toEqual([`${clientNameOf(inA)}:w:a-worker`]);
    expect(await inB.getWorkersCount()).toBe(0);
    expect(await inOther.getWorkersCount()).toBe(0);
    expect(await inDefault.getWorkersCount()).toBe(0);
    await worker.close();
    await Promise.all([inA, inB, inOther, inDefault].map(q => q.close()));
    rmSync(elsewhere, { recursive: true, force: true });
  });

  it('reads numbers given as text (a query string\'s) in ranges and lock durations, as Redis does', async () => {
    const { queue, active, backend } = await activeJob('tok-text');
    const asText = (n: number) => String(n) as unknown as number;
    await queue.add('b', {});
    expect(await queue.getJobs(['waiting'], asText(0), asText(10))).toHaveLength(1);
    expect((await queue.getJobLogs(active.id!, asText(0), asText(10))).count).toBe(0);
    expect(await backend.extendLock(active.id!, 'tok-text', asText(60_000))).toBe(1);
    await queue.close();
  });

  itInProcess('an argument of the wrong type is refused as invalid, not with napi-rs\'s own code', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    await expect(queue.getCountsPerPriority([{} as unknown as number])).rejects.toMatchObject({ code: 'LOAM_INVALID_ARGUMENT' });
    await queue.close();
  });

  itInProcess('a call the addon refuses before it starts rejects in BullMQ\'s form, as one it refuses later does', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const backend = queue.getBackend() as LoamQueueBackend;
    await queue.add('a', {});
    await queue.close();
    // The addon throws these synchronously: they still reject, untagged, with the Loam code.
    let added: Promise<string> | undefined;
    expect(() => {
      added = backend.addJob({ name: 'a', data: '{}', opts: {} } as never, '');
    }).not.toThrow();
    await expect(added).rejects.toMatchObject({ code: 'LOAM_UNAVAILABLE', message: 'the backend is closed' });
    await expect(queue.add('a', {})).rejects.toMatchObject({ code: 'LOAM_UNAVAILABLE', message: 'the backend is closed' });
    await expect(backend.getCounts(['waiting'])).rejects.toMatchObject({ code: 'LOAM_UNAVAILABLE' });

    const open = new Queue(loam.queueName(), { connection });
    await expect(open.add('a', {}, { attempts: '3' as never })).rejects.toMatchObject({
      code: 'LOAM_INVALID_ARGUMENT',
      message: expect.stringMatching(/^job options are not valid BullMQ options/),
    });
    await open.close();
  });

  it('refuses NaN and infinite numbers in job options, as Redis does; elsewhere Infinity means for ever', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const refused = { code: 'LOAM_INVALID_ARGUMENT', message: expect.stringContaining('must be a finite number') };
    for (const opts of [
      { delay: Infinity },
      { attempts: NaN },
      { backoff: { type: 'fixed', delay: Infinity } },
      { removeOnComplete: { age: Infinity } },
      { deduplication: { id: 'd', ttl: -Infinity } },
    ]) {
      await expect(queue.add('bad', {}, opts as never), JSON.stringify(opts)).rejects.toMatchObject(refused);
    }
    await expect(queue.addBulk([{ name: 'ok', data: {} }, { name: 'bad', data: {}, opts: { delay: NaN } }])).rejects.toMatchObject(refused);
    const flows = new loam.FlowProducer({ connection });
    const child = { name: 'c', queueName: queue.name, opts: { delay: Infinity } };
    await expect(flows.add({ name: 'p', queueName: queue.name, children: [child] })).rejects.toMatchObject(refused);
    await flows.close();
    for (const repeat of [{ every: 1000, limit: NaN }, { every: Infinity }]) {
      await expect(queue.upsertJobScheduler('s', repeat), JSON.stringify(repeat)).rejects.toMatchObject({
        code: 'LOAM_INVALID_ARGUMENT',
        message: expect.stringContaining('scheduler options are not valid'),
      });
    }
    expect(await queue.getJobSchedulersCount()).toBe(0);
    expect(await queue.count()).toBe(0);

    // A rate limit or a priority that is not a number of milliseconds or a band is refused, as on Redis.
    await expect(queue.rateLimit(Infinity)).rejects.toMatchObject({ code: 'LOAM_INVALID_ARGUMENT' });
    await expect(queue.rateLimit(NaN)).rejects.toMatchObject({ code: 'LOAM_INVALID_ARGUMENT' });
    expect(await queue.getRateLimitTtl()).toBeLessThanOrEqual(0);

    // Infinity as an argument, or a finite age that is infinite in milliseconds, is "for ever".
    const delayed = await queue.add('later', {}, { delay: 60_000 });
    await expect(delayed.changePriority({ priority: NaN })).rejects.toMatchObject({ code: 'LOAM_INVALID_ARGUMENT' });
    await delayed.changeDelay(Infinity);
    expect(await delayed.getState()).toBe('delayed');
    const { backend, active } = await activeJob('tok-delayed');
    await backend.moveToDelayed(active.id!, Date.now(), Infinity, 'tok-delayed', { skipAttempt: true });
    expect(await active.getState()).toBe('delayed');
    await queue.add('kept', {}, { removeOnComplete: false });
    await queue.add('aged', {}, { removeOnComplete: { age: Number.MAX_VALUE } });
    const worker = new Worker(queue.name, async () => 'ok', { connection });
    await until(async () => (await queue.getCompletedCount()) === 2);
    await worker.close();
    expect((await queue.getCompleted()).map(j => j.name).sort()).toEqual(['aged', 'kept']);

    // A worker's lock held for ever, or a setting that is NaN, is refused; an infinite count is no limit.
    for (const bad of [{ lockDuration: Infinity }, { lockDuration: 2 ** 64 }, { maxStalledCount: NaN }, { limiter: { max: 1, duration: NaN } }]) {
      expect(() => loam.factory(queue.name, { connection, ...bad }), JSON.stringify(bad)).toThrow(
        expect.objectContaining({ code: 'LOAM_INVALID_ARGUMENT' }),
      );
    }
    await expect(queue.rateLimit(1e300)).rejects.toMatchObject({ code: 'LOAM_INVALID_ARGUMENT' });
    await expect(queue.rateLimit(-1)).rejects.toMatchObject({ code: 'LOAM_INVALID_ARGUMENT' });
    const negative = loam.factory(queue.name, { connection, limiter: { max: 1, duration: -Infinity } } as never);
    await negative.close();
    await expect(queue.upsertJobScheduler('t', { every: 1000 }, { opts: { attempts: NaN } })).rejects.toMatchObject({
      code: 'LOAM_INVALID_ARGUMENT',
    });
    const stalls = new Worker(queue.name, async () => 'ok', { connection, autorun: false, maxStalledCount: Infinity });
    await stalls.close();

    // A priority no job can have counts none; ranges take any number.
    await queue.add('waiting', {});
    expect(await queue.getCountsPerPriority([0, -1, 1.5, NaN])).toEqual({ 0: 1, '-1': 0, 1.5: 0, NaN: 0 });
    expect((await queue.getJobs(['completed'], 0, 1e300)).length).toBe(2);
    expect((await queue.getJobs(['completed'], NaN, Infinity)).length).toBe(2);
    // A clean with no grace is refused, where it cleaned nothing without a word.
    await expect(queue.clean(undefined as never, 10, 'completed')).rejects.toMatchObject({ code: 'LOAM_INVALID_ARGUMENT' });
    expect(await queue.getCompletedCount()).toBe(2);
    await queue.close();
  });
});
