import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { ConnectionClosedError } from 'bullmq';
import { nativeCalls, ReadsAfterWrites, WRITE_METHODS } from '../src/native-calls.js';

/** A write's promise and the hands that settle it. */
interface Settleable {
  promise: Promise<unknown>;
  resolve(value: unknown): void;
  reject(err: unknown): void;
}

function settleable(): Settleable {
  let resolve!: (value: unknown) => void;
  let reject!: (err: unknown) => void;
  const promise = new Promise<unknown>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  return { promise, resolve, reject };
}

/**
 * A stand-in for a native queue: every write method hands out a promise the
 * test settles (in `calls`, in call order); `getState` is a read,
 * `waitForJob` a blocking wait and `close` a lifecycle call; the
 * interrupts of the waits are counted in `interrupts`; a write called with
 * `'refuse'` throws at once, as the addon does with arguments it cannot read.
 * Made with `open`, its store is still opening until the test settles it;
 * `storeId` is the addon's number for that open store, and each call's name
 * goes into `started` as it reaches the fake. `reopen` opens it again with
 * the next of `reopens` (none: it answers that no open is under way), and
 * `reopened` counts its calls.
 */
function fakeNative(
  open?: Settleable,
  storeId = 0,
  started: string[] = [],
  reopens: Settleable[] = [],
): {
  native: Record<string, (...args: unknown[]) => Promise<unknown>>;
  calls: Settleable[];
  interrupts: string[];
  reopened: () => number;
} {
  const calls: Settleable[] = [];
  const interrupts: string[] = [];
  let opening = false;
  let current: Settleable | undefined;
  // As the addon's: once the open failed, every call fails with its error.
  let failed: Error | undefined;
  const start = (next: Settleable) => {
    opening = true;
    current = next;
    void next.promise.then(
      () => {
        opening = false;
        failed = undefined;
      },
      (err: Error) => {
        opening = false;
        failed = err;
      },
    );
  };
  if (open) start(open);
  let reopened = 0;
  class FakeQueue {
    get opening(): boolean {
      return opening;
    }
    get storeId(): number {
      return storeId;
    }
  }
  const prototype = FakeQueue.prototype as unknown as Record<string, unknown>;
  prototype.opened = () => current?.promise ?? Promise.resolve();
  prototype.reopen = () => {
    reopened++;
    const next = reopens.shift();
    if (next) start(next);
    return next !== undefined;
  };
  for (const name of ['interruptBlocking', 'interruptEvents']) {
    prototype[name] = () => {
      interrupts.push(name);
    };
  }
  for (const name of [...WRITE_METHODS, 'getState', 'waitForJob', 'close']) {
    prototype[name] = (...args: unknown[]) => {
      if (args[0] === 'refuse') throw new Error('[bullmq:-1] {"command":"addJob","jobId":"1"}');
      if (failed && name !== 'close') throw failed;
      started.push(name);
      const call = settleable();
      calls.push(call);
      return call.promise;
    };
  }
  return { native: new FakeQueue() as never, calls, interrupts, reopened: () => reopened };
}

/** Lets every pending promise reaction run. */
const drain = () => new Promise(resolve => setImmediate(resolve));

describe("native calls' writes", () => {
  it('settle in the order they were made, whatever order the store settles them in', async () => {
    const { native, calls } = fakeNative();
    const queue = nativeCalls(native, 'store-a');
    const order: string[] = [];
    // Writes that hand out no job (those that do may also wait a turn, below).
    const writes = ['addJob', 'extendLock', 'moveToDelayed', 'updateProgress', 'retryJob'].map((name, i) =>
      queue[name]().then(
        value => order.push(`${i}:${String(value)}`),
        (err: Error & { code?: number }) => order.push(`${i}:error ${err.code}`),
      ),
    );
    calls[3].resolve('d');
    calls[1].resolve('b');
    await drain();
    expect(order).toEqual([]);
    calls[0].resolve('a');
    await drain();
    expect(order).toEqual(['0:a', '1:b']);
    calls[4].reject(new Error('[bullmq:-3] {"command":"retryJob","jobId":"5","state":"active"}'));
    await drain();
    expect(order).toEqual(['0:a', '1:b']);
    calls[2].resolve('c');
    await Promise.all(writes);
    expect(order).toEqual(['0:a', '1:b', '2:c', '3:d', '4:error -3']);
  });

  it('keep a refused write in its place, and leave other stores out of the order', async () => {
    const { native, calls } = fakeNative();
    const queue = nativeCalls(native, 'store-b');
    const otherStore = fakeNative();
    const other = nativeCalls(otherStore.native, 'store-c');
    const order: string[] = [];
    const first = queue.addJob().then(() => order.push('first write'));
    const refused = queue.addJob('refuse').catch((err: Error & { code?: number }) => order.push(`refused ${err.code}`));
    const elsewhere = other.addJob().then(() => order.push("other store's write"));
    otherStore.calls[0].resolve(undefined);
    await elsewhere;
    expect(order).toEqual(["other store's write"]);
    calls[0].resolve(undefined);
    await Promise.all([first, refused]);
    expect(order).toEqual(["other store's write", 'first write', 'refused -1']);
  });

  it('start a read once every write its backend made before it has settled, and no later', async () => {
    const { native, calls } = fakeNative();
    const queue = nativeCalls(native, 'store-h');
    const order: string[] = [];
    const first = queue.addJob().then(() => order.push('first write'));
    const read = queue.getState().then(value => order.push(`read ${String(value)}`));
    const second = queue.addJob().then(() => order.push('second write'));
    await drain();
    // Not asked yet: the write before it is in flight.
    expect(calls).toHaveLength(2);
    // A blocking wait does not wait for writes.
    void queue.waitForJob();
    expect(calls).toHaveLength(3);
    calls[0].resolve(undefined);
    await drain();
    // Asked now, while the write made after it is still in flight.
    expect(calls).toHaveLength(4);
    calls[3].resolve('waiting');
    await read;
    expect(order).toEqual(['first write', 'read waiting']);
    calls[1].resolve(undefined);
    await second;
    // With nothing in flight, a read is asked at once.
    void queue.getState();
    expect(calls).toHaveLength(5);
    // A refused write counts as settled.
    const refused = queue.addJob('refuse').catch(() => order.push('refused'));
    const after = queue.getState();
    await refused;
    await drain();
    expect(calls).toHaveLength(6);
    calls[5].resolve('done');
    expect(await after).toBe('done');
    await first;
  });

  // As Redis answers the commands sent before a QUIT: closed at once, a read
  // called just before it was refused (`LOAM_UNAVAILABLE`), 40 times in 40.
  it('close the backend once the calls made before it are answered, its blocking waits ended at once', async () => {
    const { native, calls, interrupts } = fakeNative();
    const queue = nativeCalls(native, 'store-c');
    const write = queue.addJob();
    const read = queue.getState();
    void queue.waitForJob();
    const closed = queue.close();
    await drain();
    expect(interrupts).toEqual(['interruptBlocking', 'interruptEvents']);
    // The write, and the wait; the read waits for the write, and the close for both.
    expect(calls).toHaveLength(2);
    calls[0].resolve(undefined);
    await write;
    await drain();
    expect(calls).toHaveLength(3);
    calls[2].resolve('waiting');
    expect(await read).toBe('waiting');
    await drain();
    expect(calls).toHaveLength(4);
    calls[3].resolve(undefined);
    await closed;
  });

  it("share one connection's order between a backend and its siblings", async () => {
    const owner = fakeNative();
    const sibling = fakeNative();
    const reads = new ReadsAfterWrites();
    const a = nativeCalls(owner.native, 'store-s', undefined, reads);
    const b = nativeCalls(sibling.native, 'store-s', undefined, reads);
    const write = a.addJob();
    const read = b.getState();
    await drain();
    expect(sibling.calls).toHaveLength(0);
    owner.calls[0].resolve(undefined);
    await write;
    await drain();
    expect(sibling.calls).toHaveLength(1);
    sibling.calls[0].resolve('waiting');
    expect(await read).toBe('waiting');
  });

  it("hand a worker a job no earlier than the turn after a producer's write resolved", async () => {
    const { native, calls } = fakeNative();
    const queue = nativeCalls(native, 'store-e');
    const seen: string[] = [];
    // The producer's await returns many microtasks after its write resolves.
    const producer = (async () => {
      let added = await queue.addJob();
      for (let hop = 0; hop < 50; hop++) added = await Promise.resolve(added);
      seen.push('add returned');
    })();
    const lease = queue.moveToActive().then(() => seen.push('job handed out'));
    calls[0].resolve('added');
    calls[1].resolve('job');
    await Promise.all([producer, lease]);
    expect(seen).toEqual(['add returned', 'job handed out']);
  });

  it('hand a worker a job at once when its write was made after the producer\'s was answered', async () => {
    const { native, calls } = fakeNative();
    const queue = nativeCalls(native, 'store-g');
    const added = queue.addJob();
    calls[0].resolve('added');
    await added;
    // Same turn: a worker woken by the add asks for its job now.
    let turned = false;
    setImmediate(() => (turned = true));
    const lease = queue.moveToActive();
    calls[1].resolve('job');
    await lease;
    expect(turned).toBe(false);
  });

  it('hand out jobs one after another in one turn when no other write resolved in it', async () => {
    const { native, calls } = fakeNative();
    const queue = nativeCalls(native, 'store-f');
    const seen: string[] = [];
    const completions = ['moveToCompleted', 'moveToFailed', 'moveToCompleted'].map((name, i) =>
      queue[name]().then(() => seen.push(`job ${i}`)),
    );
    let turned = false;
    setImmediate(() => (turned = true));
    for (const call of calls) call.resolve('next');
    await Promise.all(completions);
    expect(turned).toBe(false);
    expect(seen).toEqual(['job 0', 'job 1', 'job 2']);
  });

  it('start afresh once every write of a store has settled', async () => {
    const { native, calls } = fakeNative();
    const queue = nativeCalls(native, 'store-d');
    const a = queue.addJob();
    calls[0].resolve(1);
    expect(await a).toBe(1);
    // A later write is not held behind anything.
    const b = queue.addJob();
    calls[1].resolve(2);
    expect(await b).toBe(2);
  });
});

describe("native calls of a store that is opening", () => {
  it('wait for the open, then start in the order they were made, whichever backend made them', async () => {
    const open = settleable();
    const started: string[] = [];
    const owner = fakeNative(open, 1, started);
    const queue = nativeCalls(owner.native, 'store-o');
    // Another backend of the same store, made while it opens.
    const other = fakeNative(open, 1, started);
    const second = nativeCalls(other.native, 'store-o');
    const order: string[] = [];
    const otherRead = second.getState();
    const write = queue.addJob().then(value => order.push(`write ${String(value)}`));
    const wait = queue.waitForJob().then(value => order.push(`wait ${String(value)}`));
    const otherWrite = second.moveToDelayed().then(value => order.push(`other write ${String(value)}`));
    await drain();
    expect(started).toEqual([]);
    open.resolve(undefined);
    await drain();
    // Started in call order across both backends.
    expect(started).toEqual(['getState', 'addJob', 'waitForJob', 'moveToDelayed']);
    other.calls[0].resolve('waiting');
    expect(await otherRead).toBe('waiting');
    other.calls.shift();
    other.calls[0].resolve('b');
    owner.calls[1].resolve('w');
    owner.calls[0].resolve('a');
    await Promise.all([write, wait, otherWrite]);
    expect(order).toEqual(['wait w', 'write a', 'other write b']);
    // Once open, a call starts at once.
    void queue.addJob();
    expect(owner.calls).toHaveLength(3);
  });

  it("fail with the open's error if it failed, in BullMQ's form; close does not wait for it", async () => {
    const open = settleable();
    const { native, calls } = fakeNative(open);
    const queue = nativeCalls(native, 'store-f');
    // A backend closed while the open is under way: the addon's close has it.
    const idle = fakeNative(open);
    const closedEarly = nativeCalls(idle.native, 'store-f').close();
    await drain();
    expect(idle.calls).toHaveLength(1);
    idle.calls[0].resolve(undefined);
    await closedEarly;
    const write = queue.addJob().catch((err: Error & { code?: string }) => err);
    const read = queue.getState().catch((err: Error & { code?: string }) => err);
    open.reject(new Error('[loam:store_locked] the store in /d is already open in another process'));
    for (const err of [await write, await read]) {
      expect(err).toBeInstanceOf(ConnectionClosedError);
      expect(err).toMatchObject({ code: 'LOAM_STORE_LOCKED', message: expect.stringContaining('another process') });
    }
    // The read started once the write had failed, when the open had ended.
    expect(calls).toHaveLength(0);
    await expect(queue.addJob()).rejects.toMatchObject({ code: 'LOAM_STORE_LOCKED' });
    const closed = queue.close();
    await drain();
    expect(calls).toHaveLength(1);
    calls[0].resolve(undefined);
    await closed;
  });

  it("wait for their own open, not for a failed one of the same data dir whose failure is not heard yet", async () => {
    const failing = settleable();
    const first = nativeCalls(fakeNative(failing, 1).native, 'store-n');
    const refused = first.addJob().catch((err: Error & { code?: string }) => err.code);
    failing.reject(new Error('[loam:unavailable] cannot open the store'));
    // Made before the failure reached JavaScript: the addon started another open.
    const open = settleable();
    const next = fakeNative(open, 2);
    const second = nativeCalls(next.native, 'store-n');
    const write = second.addJob();
    expect(await refused).toBe('LOAM_UNAVAILABLE');
    await drain();
    expect(next.calls).toHaveLength(0);
    open.resolve(undefined);
    await drain();
    next.calls[0].resolve('1');
    expect(await write).toBe('1');
  });

  it("settle apart from a failed open's writes of the same data dir", async () => {
    const failing = settleable();
    const first = fakeNative(failing, 3);
    const failed = nativeCalls(first.native, 'store-w');
    const next = fakeNative(undefined, 4);
    const second = nativeCalls(next.native, 'store-w');
    // A write of the failed store, still waiting for its open, and one of the next store's.
    const refused = failed.addJob().catch((err: Error & { code?: string }) => err.code);
    const written = second.addJob();
    next.calls[0].resolve('1');
    expect(await written).toBe('1');
    failing.reject(new Error('[loam:unavailable] cannot open the store'));
    expect(await refused).toBe('LOAM_UNAVAILABLE');
  });

  it('tell their connection of an error that says the store cannot be reached, not of others, nor once closing', async () => {
    const { native, calls } = fakeNative();
    const reads = new ReadsAfterWrites();
    const told: string[] = [];
    reads.unreachable = err => told.push((err as Error & { code?: string }).code!);
    const queue = nativeCalls(native, 'store-u', undefined, reads);
    const write = queue.addJob().catch(() => undefined);
    calls[0].reject(new Error('[loam:unavailable] the store stopped'));
    await write;
    const read = queue.getState().catch(() => undefined);
    calls[1].reject(new Error('[bullmq:-1] {"command":"getState","jobId":"1"}'));
    await read;
    const refused = queue.addJob('refuse').catch(() => undefined);
    await refused;
    expect(told).toEqual(['LOAM_UNAVAILABLE']);
    const closing = queue.close();
    await drain();
    calls[2].reject(new Error('[loam:unavailable] the backend is closed'));
    await closing.catch(() => undefined);
    expect(told).toEqual(['LOAM_UNAVAILABLE']);
  });
});

describe('native calls of a store that cannot be reached', () => {
  it('ask for it to be opened again, and the calls made meanwhile wait for that open, in order', async () => {
    const failing = settleable();
    const reopen = settleable();
    const started: string[] = [];
    const { native, calls, reopened } = fakeNative(failing, 5, started, [reopen]);
    const queue = nativeCalls(native, 'store-r');
    const refused = queue.addJob().catch((err: Error & { code?: string }) => err.code);
    failing.reject(new Error('[loam:unavailable] cannot open the store'));
    expect(await refused).toBe('LOAM_UNAVAILABLE');
    // The failure asked for another open, which the calls made since wait for.
    expect(reopened()).toBe(1);
    const write = queue.addJob();
    const read = queue.getState();
    await drain();
    expect(started).toEqual([]);
    reopen.resolve(undefined);
    await drain();
    expect(started).toEqual(['addJob']);
    calls[0].resolve('1');
    expect(await write).toBe('1');
    await drain();
    calls[1].resolve('waiting');
    expect(await read).toBe('waiting');
    // Errors that do not say the store is unreachable ask for nothing.
    const missing = queue.getState().catch((err: Error & { code?: number }) => err.code);
    calls[2].reject(new Error('[bullmq:-1] {"command":"getState","jobId":"1"}'));
    expect(await missing).toBe(-1);
    expect(reopened()).toBe(1);
  });

  it('fail at once while no open is under way (the addon opens again at most once a second)', async () => {
    const { native, calls, reopened } = fakeNative();
    const queue = nativeCalls(native, 'store-s');
    const first = queue.addJob().catch((err: Error & { code?: string }) => err.code);
    calls[0].reject(new Error('[loam:unavailable] storage I/O failed'));
    expect(await first).toBe('LOAM_UNAVAILABLE');
    const second = queue.addJob().catch((err: Error & { code?: string }) => err.code);
    await drain();
    expect(calls).toHaveLength(2);
    calls[1].reject(new Error('[loam:unavailable] storage I/O failed'));
    expect(await second).toBe('LOAM_UNAVAILABLE');
    expect(reopened()).toBe(2);
  });
});

describe('WRITE_METHODS', () => {
  // A write missing from the list would be taken for a read: not ordered
  // with the other writes, and not waited for by the reads after it.
  it("names every write of the addon: its synchronous methods that return a promise, but the two waits", () => {
    const source = readFileSync(new URL('../../../crates/loam-jobs-napi/src/backend.rs', import.meta.url), 'utf8');
    const writes = new Set<string>();
    for (const [, name] of source.matchAll(/pub fn (\w+)<'env>\([^{]*?\) -> Result<PromiseRaw/g)) {
      writes.add(name.replace(/_(\w)/g, (_, c: string) => c.toUpperCase()));
    }
    expect(writes.has('waitForJob') && writes.has('readEvents')).toBe(true);
    writes.delete('waitForJob');
    writes.delete('readEvents');
    expect(writes.size).toBeGreaterThan(30);
    expect([...WRITE_METHODS].sort()).toEqual([...writes].sort());
  });
});
