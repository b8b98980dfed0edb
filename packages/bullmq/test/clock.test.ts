import { afterAll, describe, expect, it, vi } from 'vitest';
import { freshLoam, itInProcess } from './helpers.js';
import type { LoamQueueBackend } from '../src/index.js';

const loam = freshLoam();
afterAll(() => {
  vi.useRealTimers();
  loam.cleanup();
});

describe("the core's clock", () => {
  // In-process the core's clock, background sweeps included, follows the
  // host's. A server runs each call at the caller's time (`loam-now-ms`) but
  // promotes delayed jobs on its own clock, so a job delayed from a faked
  // 2017 is due at once there.
  itInProcess("follows the host's Date.now(), as BullMQ's scripts do on Redis", async () => {
    const queue = new loam.Queue(loam.queueName(), { connection: {} });
    vi.useFakeTimers({ toFake: ['Date'] });
    const faked = Date.UTC(2017, 1, 7, 4, 3, 0);
    vi.setSystemTime(faked);
    const job = await queue.add('then', {}, { delay: 5_000 });
    const backend = queue.getBackend() as LoamQueueBackend;
    expect(await queue.getDelayedCount(faked + 5_001)).toBe(1);
    expect(await queue.getDelayedCount(faked + 4_000)).toBe(0);
    vi.setSystemTime(faked + 6_000);
    const [claimed] = await backend.moveToActive('token');
    expect(claimed.id).toBe(job.id);
    expect(Math.abs(claimed.processedOn - (faked + 6_000))).toBeLessThan(1_000);
    vi.useRealTimers();
    await queue.close();
  });

  // A test's fake clock may stand at the epoch: 0 is a time too, in process
  // and over a session alike.
  it("runs a call at the caller's time, even at the epoch", async () => {
    const queue = new loam.Queue(loam.queueName(), { connection: {} });
    await queue.waitUntilReady();
    vi.useFakeTimers({ toFake: ['Date'] });
    vi.setSystemTime(0);
    const job = await queue.add('at-the-epoch', {});
    const [claimed] = await queue.getBackend().moveToActive('token');
    vi.useRealTimers();
    expect(claimed.id).toBe(job.id);
    expect(claimed.processedOn).toBeLessThan(1_000);
    await queue.close();
  });
});
