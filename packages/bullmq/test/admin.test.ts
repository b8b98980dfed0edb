import { afterAll, describe, expect, it, vi } from 'vitest';
import type { Job, JobSchedulerJobOptions } from 'bullmq';
import { freshLoam, until } from './helpers.js';

const loam = freshLoam();
const { Queue, Worker, QueueEvents } = loam;
const connection = {};

afterAll(() => loam.cleanup());

describe('queue and job admin', () => {
  it('pauses and resumes', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const events = new QueueEvents(name, { connection });
    const seen: string[] = [];
    events.on('paused', () => seen.push('paused'));
    events.on('resumed', () => seen.push('resumed'));
    await events.waitUntilReady();
    await queue.pause();
    expect(await queue.isPaused()).toBe(true);
    const ran: string[] = [];
    const worker = new Worker(name, async (job: Job) => void ran.push(job.id!), { connection });
    await queue.add('a', {});
    await new Promise(r => setTimeout(r, 200));
    expect(ran).toEqual([]);
    expect(await queue.getJobCounts('waiting')).toEqual({ waiting: 1 });
    await queue.resume();
    await until(() => ran.length === 1);
    await until(() => seen.length === 2);
    expect(seen).toEqual(['paused', 'resumed']);
    await worker.close();
    await events.close();
    await queue.close();
  });

  it("resumes a QueueEvents from a lastEventId as Redis's XREAD reads one", async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    await queue.add('a', {});
    await queue.add('b', {});
    /** The `waiting` events a QueueEvents from `lastEventId` hears (job ids), and their event ids. */
    const listen = async (lastEventId: string) => {
      const events = new QueueEvents(name, { connection, lastEventId });
      const heard: { jobId: string; id: string }[] = [];
      const errors: Error[] = [];
      events.on('waiting', ({ jobId }, id) => heard.push({ jobId, id }));
      events.on('error', err => errors.push(err));
      await events.waitUntilReady();
      return { events, heard, errors };
    };
    const all = await listen('0-0');
    await until(() => all.heard.length === 2);
    expect(all.heard.map(e => e.jobId)).toEqual(['1', '2']);
    // An id this queue issued resumes right after its event.
    const afterA = await listen(all.heard[0].id);
    // A foreign id is placed by its time: one later than every event replays nothing.
    const future = await listen('9999999999999-0');
    // An id from before the first event (Redis's `<ms>` form) replays everything.
    const past = await listen('1');
    const garbage = await listen('garbage');
    await queue.add('c', {});
    await until(() => afterA.heard.length === 2 && past.heard.length === 3);
    await until(() => garbage.errors.length > 0);
    expect(afterA.heard.map(e => e.jobId)).toEqual(['2', '3']);
    expect(past.heard.map(e => e.jobId)).toEqual(['1', '2', '3']);
    // Nor the events written since: their ids are older than it, as on Redis.
    await new Promise(r => setTimeout(r, 200));
    expect(future.heard).toEqual([]);
    expect(garbage.heard).toEqual([]);
    expect(garbage.errors[0].message).toMatch(/invalid stream id "garbage"/);
    for (const l of [all, afterA, future, past, garbage]) await l.events.close();
    await queue.close();
  });

  it('publishes an event with an empty name, as Redis does', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const backend = queue.getBackend() as unknown as {
      publishEvent(fields: Record<string, string | number>, maxEvents: number): Promise<string>;
    };
    // Before: the server refused it ("an event needs a name"); the addon took it.
    const unnamed = await backend.publishEvent({ event: '', n: 1 }, 100);
    const named = await backend.publishEvent({ event: 'custom', n: 2 }, 100);
    expect(typeof unnamed).toBe('string');
    expect(named).not.toBe(unnamed);
    await queue.close();
  });

  it('progress, logs, data and removal', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const events = new QueueEvents(name, { connection });
    const progress: unknown[] = [];
    events.on('progress', ({ data }) => progress.push(data));
    await events.waitUntilReady();
    const job = await queue.add('a', { v: 1 });
    await job.updateProgress({ pct: 50 });
    await job.log('first');
    await job.log('second');
    await job.updateData({ v: 2 });
    const stored = await queue.getJob(job.id!);
    expect(stored?.progress).toEqual({ pct: 50 });
    expect(stored?.data).toEqual({ v: 2 });
    expect(await queue.getJobLogs(job.id!)).toEqual({ logs: ['first', 'second'], count: 2 });
    // In Redis's order, which JSON.stringify and snapshots show.
    expect(JSON.stringify(await queue.getJobLogs(job.id!))).toBe('{"logs":["first","second"],"count":2}');
    expect(await queue.getJobLogs(job.id!, 0, 0, false)).toEqual({ logs: ['second'], count: 2 });
    await until(() => progress.length === 1);
    expect(progress).toEqual([{ pct: 50 }]);
    await job.remove();
    expect(await queue.getJob(job.id!)).toBeUndefined();
    expect(await job.getState()).toBe('unknown');
    await events.close();
    await queue.close();
  });

  it("trims a job's logs only when given a keepLogs, as Redis does", async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const kept = await queue.add('kept', {}, { keepLogs: 2 });
    // job.log passes the job's own keepLogs.
    for (const row of ['l0', 'l1', 'l2']) await kept.log(row);
    expect(await queue.getJobLogs(kept.id!)).toEqual({ logs: ['l1', 'l2'], count: 2 });
    expect(await queue.addJobLog(kept.id!, 'l3')).toBe(3);
    const zero = await queue.add('zero', {}, { keepLogs: 0 });
    expect(await Promise.all(['z0', 'z1', 'z2'].map(row => zero.log(row)))).toEqual([1, 2, 3]);
    const many = await queue.add('many', {});
    await Promise.all(Array.from({ length: 1005 }, (_, i) => many.log(`row${i}`)));
    expect(await queue.getJobLogs(many.id!, 0, 0)).toEqual({ logs: ['row0'], count: 1005 });
    await queue.close();
  });

  it('promotes, changes priority, drains, cleans and obliterates', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const delayed = await queue.add('d', {}, { delay: 60_000 });
    await delayed.promote();
    expect(await delayed.getState()).toBe('waiting');
    const p = await queue.add('p', {}, { priority: 5 });
    await p.changePriority({ priority: 1 });
    expect((await queue.getJob(p.id!))?.priority).toBe(1);
    expect(await queue.getCountsPerPriority([0, 1, 5])).toEqual({ '0': 1, '1': 1, '5': 0 });
    await queue.add('late', {}, { delay: 60_000 });
    await queue.drain();
    expect(await queue.getJobCounts('waiting', 'prioritized', 'delayed')).toEqual({
      waiting: 0,
      prioritized: 0,
      delayed: 1,
    });
    await queue.drain(true);
    expect(await queue.count()).toBe(0);

    await queue.addBulk([{ name: 'x', data: {} }, { name: 'y', data: {} }]);
    const cleaned = await queue.clean(0, 10, 'wait');
    expect(cleaned.length).toBe(2);
    await queue.add('z', {});
    await queue.obliterate();
    expect(await queue.getJobCounts('waiting')).toEqual({ waiting: 0 });
    await queue.close();
  });

  it("keeps a job's delay through queue.promoteJobs, and zeroes it through job.promote, as Redis does", async () => {
    const queue = new Queue(loam.queueName(), { connection });
    await queue.add('bulk', {}, { delay: 60_000 });
    const own = await queue.add('own', {}, { delay: 60_000 });
    await own.promote();
    await queue.promoteJobs();
    const delays = Object.fromEntries((await queue.getWaiting()).map(job => [job.name, job.delay]));
    expect(delays).toEqual({ bulk: 60_000, own: 0 });
    await queue.close();
  });


  it('leaves a job that is not active where it is on moveToWait without a token, as Redis does', async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const waiting = await queue.add('waiting', {});
    const delayed = await queue.add('delayed', {}, { delay: 60_000 });
    expect([await waiting.moveToWait(), await delayed.moveToWait('0')]).toEqual([0, 0]);
    expect([await waiting.getState(), await delayed.getState()]).toEqual(['waiting', 'delayed']);
    // A worker's token still needs the job's lock.
    await expect(waiting.moveToWait('a-token')).rejects.toThrow(/Missing lock/);
    await queue.close();
  });
  it('retries a failed job and bulk-retries', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    let fail = true;
    const worker = new Worker(name, async () => {
      if (fail) throw new Error('nope');
      return 'fine';
    }, { connection });
    const job = await queue.add('a', {});
    await queue.add('b', {});
    await until(async () => (await queue.getJobCounts('failed')).failed === 2);
    fail = false;
    await (await queue.getJob(job.id!))!.retry();
    await until(async () => (await job.getState()) === 'completed');
    await queue.retryJobs({ state: 'failed' });
    await until(async () => (await queue.getJobCounts('completed')).completed === 2);
    await worker.close();
    await queue.close();
  });

  it('deduplicates adds while the first job exists', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const events = new QueueEvents(name, { connection });
    const dups: string[] = [];
    events.on('deduplicated', ({ jobId }) => dups.push(jobId));
    await events.waitUntilReady();
    const first = await queue.add('a', { n: 1 }, { deduplication: { id: 'same' } });
    const second = await queue.add('a', { n: 2 }, { deduplication: { id: 'same' } });
    expect(second.id).toBe(first.id);
    expect(await queue.getDeduplicationJobId('same')).toBe(first.id);
    expect(await queue.getJobCounts('waiting')).toEqual({ waiting: 1 });
    await until(() => dups.length === 1);
    expect(await queue.removeDeduplicationKey('same')).toBe(1);
    const third = await queue.add('a', { n: 3 }, { deduplication: { id: 'same' } });
    expect(third.id).not.toBe(first.id);
    await events.close();
    await queue.close();
  });

  it('keeps finished jobs by removeOnComplete and collects metrics', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const worker = new Worker(name, async () => 'ok', {
      connection,
      removeOnComplete: { count: 2 },
      metrics: { maxDataPoints: 10 },
    });
    await queue.addBulk(Array.from({ length: 5 }, () => ({ name: 'x', data: {} })));
    await until(async () => (await queue.getJobCounts('waiting', 'active')).waiting === 0);
    await until(async () => (await queue.getJobCounts('active')).active === 0);
    expect(await queue.getJobCounts('completed')).toEqual({ completed: 2 });
    const metrics = await queue.getMetrics('completed');
    expect(metrics.meta.count).toBe(5);
    await worker.close();
    await queue.close();
  });

  it("answers the backend's getMetrics in Redis's raw shape, nulls where no metrics are kept", async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const backend = queue['backend'];
    const none = [[null, null, null], [], 0];
    expect(await backend.getMetrics('completed')).toEqual(none);
    expect(await backend.getMetrics('Completed' as never)).toEqual(none);
    const worker = new Worker(name, async () => 'ok', { connection, metrics: { maxDataPoints: 10 } });
    await queue.addBulk(Array.from({ length: 3 }, () => ({ name: 'x', data: {} })));
    await until(async () => (await queue.getJobCounts('completed')).completed === 3);
    const [meta, points, total] = await backend.getMetrics('completed');
    expect(meta[0]).toBe('3');
    expect(meta.every(field => typeof field === 'string')).toBe(true);
    expect(points).toHaveLength(total);
    expect(await backend.getMetrics('failed')).toEqual(none);
    await worker.close();
    await queue.close();
  });

  it("pages getMetrics' points as Redis's LRANGE does, positions read as the other getters read them", async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const backend = queue['backend'];
    const worker = new Worker(name, async () => 'ok', { connection, metrics: { maxDataPoints: 10 } });
    // A point is kept for each minute that saw completions: a job a minute.
    vi.useFakeTimers({ toFake: ['Date'] });
    try {
      const first = Date.UTC(2026, 0, 1, 0, 0, 30);
      for (let minute = 0; minute < 5; minute++) {
        vi.setSystemTime(first + minute * 60_000);
        await queue.add('x', {});
        await until(async () => (await queue.getJobCounts('completed')).completed === minute + 1);
      }
    } finally {
      vi.useRealTimers();
    }
    const [meta, all, total] = await backend.getMetrics('completed');
    expect(meta[0]).toBe('5');
    expect(total).toBeGreaterThanOrEqual(4);
    expect(all).toHaveLength(total);
    const page = async (start: number, end: number) => (await backend.getMetrics('completed', start, end))[1];
    expect(await page(1, 2)).toEqual(all.slice(1, 3));
    expect(await page(-2, -1)).toEqual(all.slice(-2));
    expect(await page(2, 1)).toEqual([]);
    expect(await page(total, total + 5)).toEqual([]);
    expect(await page(-100, 0)).toEqual(all.slice(0, 1));
    expect(await page(0.9, 1.9)).toEqual(all.slice(0, 2));
    expect(await page(NaN, -1)).toEqual(all);
    expect(await page(0, NaN)).toEqual(all.slice(0, 1));
    expect(await page(-Infinity, Infinity)).toEqual(all);
    expect(await page(Infinity, -1)).toEqual([]);
    expect((await backend.getMetrics('completed', 1, 1))[2]).toBe(total);
    await worker.close();
    await queue.close();
  });

  it('rate limits a worker', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const ran: number[] = [];
    const worker = new Worker(name, async () => void ran.push(Date.now()), {
      connection,
      limiter: { max: 2, duration: 500 },
    });
    // The limiter's window opens at the first job's lease, after the add:
    // the third job cannot start before a window has passed since then.
    // Timed from the first job's start instead, the gap shrank by however
    // late that job's processor began.
    const added = Date.now();
    await queue.addBulk(Array.from({ length: 4 }, () => ({ name: 'x', data: {} })));
    await until(() => ran.length === 4, 5_000);
    expect(ran[2] - added).toBeGreaterThanOrEqual(490);
    await worker.close();
    await queue.close();
  });

  it('never holds a fetched job through a rate-limit wait', async () => {
    // A lease refused by the limiter because a completion had just fetched the
    // window's last job must not be answered before that job: BullMQ's worker
    // would sleep out the limit with the job in hand.
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const started = new Map<string, number>();
    const worker = new Worker(
      name,
      async (job: Job) => {
        started.set(job.id!, performance.now());
        await new Promise(resolve => setTimeout(resolve, 1 + Math.random() * 4));
      },
      { connection, concurrency: 5, limiter: { max: 4, duration: 250 } },
    );
    // BullMQ's worker sleeps out a rate limit with `delay`.
    const waits: { since: number; start: number; end: number }[] = [];
    const delay = worker.delay.bind(worker);
    vi.spyOn(worker, 'delay').mockImplementation(async (ms, abort) => {
      const wait = { since: Date.now(), start: performance.now(), end: Infinity };
      waits.push(wait);
      await delay(ms, abort);
      wait.end = performance.now();
    });
    const done: Job[] = [];
    worker.on('completed', (job: Job) => void done.push(job));
    await queue.addBulk(Array.from({ length: 60 }, () => ({ name: 'x', data: {} })));
    await until(() => done.length === 60, 15_000);
    // A job is in hand from its lease (processedOn: when the call was made)
    // until its processor starts. One in hand when a wait begins starts
    // before the wait's timer fires (a few microtasks on); one held through
    // the wait starts only after it ends. Checked by order, not by how long
    // a job was held, so a busy machine that stretches the waits and the
    // holds alike cannot fail it. Waits under 20 ms are left out: a lease
    // made in the millisecond a wait begins may be after it.
    const held = done.filter(job =>
      waits.some(
        wait => wait.end - wait.start >= 20 && job.processedOn! < wait.since && started.get(job.id!)! > wait.end,
      ),
    );
    expect(held.map(job => job.id)).toEqual([]);
    // The limiter did make the worker wait, 60 jobs at 4 a window.
    expect(waits.filter(wait => wait.end - wait.start >= 20).length).toBeGreaterThan(5);
    await worker.close();
    await queue.close();
  });

  it('runs a job scheduler every interval', async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const ran: string[] = [];
    const worker = new Worker(name, async (job: Job) => void ran.push(job.id!), { connection });
    await queue.upsertJobScheduler('tick', { every: 300 }, { name: 'tick', data: { a: 1 } });
    const scheduler = await queue.getJobScheduler('tick');
    expect(scheduler?.every).toBe(300);
    expect(await queue.getJobSchedulersCount()).toBe(1);
    await until(() => ran.length >= 2, 5_000);
    expect(ran.every(id => id.startsWith('repeat:tick:'))).toBe(true);
    expect(await queue.removeJobScheduler('tick')).toBe(true);
    expect(await queue.getJobSchedulersCount()).toBe(0);
    await worker.close();
    await queue.close();
  });

  it("gives a scheduler's job the attempts of its template, 0 when it has none, as Redis does", async () => {
    const queue = new Queue(loam.queueName(), { connection });
    const plain = await queue.upsertJobScheduler('plain', { every: 60_000 }, { name: 'plain' });
    const retried = await queue.upsertJobScheduler('retried', { every: 60_000 }, { name: 'r', opts: { attempts: 3 } });
    const read = async (id: string) => (await queue.getJob(id))?.opts.attempts;
    expect([await read(plain.id!), await read(retried.id!)]).toEqual([0, 3]);
    await queue.close();
  });

  it("restarts a job scheduler's limit at each upsert, as Redis does", async () => {
    const name = loam.queueName();
    const queue = new Queue(name, { connection });
    const ran: string[] = [];
    const worker = new Worker(name, async (job: Job) => void ran.push(job.id!), { connection });
    const upsert = () => queue.upsertJobScheduler('capped', { every: 100, limit: 1 }, { name: 'capped' });
    await upsert();
    await until(() => ran.length === 1, 5_000);
    await new Promise(resolve => setTimeout(resolve, 500));
    expect(ran.length).toBe(1);
    const again = await upsert();
    // A scheduler's job carries its repeat settings (BullMQ types them apart from JobsOptions).
    expect((again?.opts as JobSchedulerJobOptions | undefined)?.repeat?.count).toBe(1);
    await until(() => ran.length === 2, 5_000);
    await new Promise(resolve => setTimeout(resolve, 500));
    expect(ran.length).toBe(2);
    await worker.close();
    await queue.close();
  });
});
