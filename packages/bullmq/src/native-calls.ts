/**
 * The methods of a native queue as the in-process backend calls them: every
 * error in BullMQ's form (see `fromNative`), and the writes of one store
 * settled in the order they were submitted.
 *
 * Errors: the addon rejects an async call's promise, but it throws
 * synchronously when it refuses the call before starting it (arguments it
 * cannot read, a closed queue). Such a throw becomes a rejected promise here,
 * converted like a rejection, so every caller sees one kind of failure.
 *
 * Order: the addon settles writes from two of the store's threads: most from
 * the committer, in commit order, but some from the executor before their
 * batch is committed (a lease that found no job; every write under relaxed
 * durability). A later write's result could then reach Node before an
 * earlier one's, which Redis, answering one connection's commands in order,
 * never shows. So the promises of one store's writes resolve here in the
 * order the writes were submitted (which is the order the core applied them).
 *
 * And a read starts only once every write its backend made before it has
 * settled, as a command queued behind others on one Redis connection runs
 * after them: reads run on the store's latest snapshot at once, and
 * `getJob` called right behind an un-awaited `add` missed the job 198 times
 * in 200. A backend and its siblings (`forQueue`: a FlowProducer's, for the
 * Jobs it returns) count as one connection, as on Redis they share one. The
 * blocking waits (`waitForJob`, `readEvents`) wait for something to happen
 * instead, and neither they nor `ready` wait for writes. `close` ends the
 * blocking waits at once and closes once the backend's other calls made
 * before it are answered, as Redis answers the commands sent before a
 * `QUIT` (closed at once, it had a read called just before it refused), and
 * a call made after it is refused at once.
 *
 * Opening: the addon opens a store on a thread of its own (after a crash
 * that replays its log), so a backend is made at once. Every call of a store
 * made while it opens, by any of its backends, waits for the open and then
 * starts, in the order the calls were made; if the open failed, each fails
 * with its error (another process holding the store, say). `close` does not
 * wait here: the addon's waits for the open itself, and resolves either way.
 *
 * Reopening: a call that finds the store unreachable (its open failed, or its
 * disk since) asks the addon to open it again (`reopen`: at most once a
 * second), and the calls made while that open runs wait for it as for the
 * first, so an app goes on once the cause is gone, as Redis's client
 * reconnects by itself.
 */
import type { Activity } from './common.js';
import { callSync, fromNative, isConnectionError, loamError } from './errors.js';

/** The native methods that answer synchronously; every other one returns a promise. */
const SYNC_METHODS: ReadonlySet<string> = new Set([
  'forQueue',
  'reopen',
  'interruptBlocking',
  'resetBlocking',
  'interruptEvents',
]);

/** The native methods that submit a write (the rest are reads and waits). */
export const WRITE_METHODS: ReadonlySet<string> = new Set([
  'addJob', 'addJobs', 'addFlow', 'moveToActive', 'extendLock', 'extendLocks', 'moveStalledJobsToWait',
  'moveToCompleted', 'moveToFailed', 'moveToDelayed', 'retryJob', 'moveJobFromActiveToWait',
  'moveToWaitingChildren', 'retryFinishedJob', 'promote', 'changeDelay', 'changePriority', 'remove',
  'removeUnprocessedChildren', 'removeChildDependency', 'updateData', 'updateProgress', 'addLog', 'clearLogs',
  'pause', 'drain', 'cleanJobsByState', 'obliterate', 'retryFinishedJobs', 'promoteJobs', 'setQueueMeta',
  'removeQueueMetaFields', 'setRateLimit', 'removeRateLimitKey', 'removeDeduplicationKey', 'publishEvent',
  'trimEvents', 'addJobScheduler', 'updateJobSchedulerNextMillis', 'removeJobScheduler',
]);

/**
 * The native methods not ordered behind writes: the blocking waits, which
 * wait for something to happen, and `ready`, which reads nothing the writes
 * leave. (`close` has an order of its own: see the module comment.)
 */
const UNORDERED: ReadonlySet<string> = new Set(['waitForJob', 'readEvents', 'ready']);

type Method = (...args: unknown[]) => unknown;

/**
 * One connection's calls (a backend's, with its siblings'): its writes,
 * counted as they are made and as they settle, the reads waiting for those
 * made before them, and the reads in flight. Writes settle in the order they
 * were made (`WriteOrder`), so a read waits for a count, not for each write:
 * under a steady stream of writes (a worker at concurrency 100) it waits for
 * those before it only, never for the stream to stop.
 */
export class ReadsAfterWrites {
  /** `close` was called: later calls are refused at once, as a closing Redis connection's are. */
  closing = false;
  /**
   * Told of a call's error that says the store cannot be reached (BullMQ's
   * `ConnectionClosedError`), unless closing: BullMQ's Worker retries those
   * without a word, as it does a Redis command on a dropped connection,
   * where ioredis reports the connection's errors itself.
   */
  unreachable: ((err: Error) => void) | undefined;
  /** Asks for the store to be opened again, told of the same errors first. */
  reconnect: (() => void) | undefined;

  /** `err`, once `reconnect` and `unreachable` were told of it if it is such an error. */
  failed(err: Error): Error {
    if (!this.closing && isConnectionError(err)) {
      this.reconnect?.();
      this.unreachable?.(err);
    }
    return err;
  }
  private made = 0;
  private settled = 0;
  /** Reads waiting, each for `settled` to reach its count, in the order they were made. */
  private readonly waiting: { until: number; start: () => void }[] = [];
  /** Reads called and not settled. */
  private reading = 0;
  /** Closes waiting, each for `settled` to reach its count with no read in flight. */
  private readonly drains: { until: number; resolve: () => void }[] = [];

  made1(): void {
    this.made++;
  }

  settled1(): void {
    this.settled++;
    while (this.waiting.length > 0 && this.waiting[0].until <= this.settled) this.waiting.shift()!.start();
    if (this.drains.length > 0) this.drain();
  }

  /** Runs `read` now, or once every write made before it has settled. */
  after<T>(read: () => Promise<T>): Promise<T> {
    this.reading++;
    const started =
      this.settled === this.made ? read() : new Promise<void>(start => this.waiting.push({ until: this.made, start })).then(read);
    return started.finally(() => {
      this.reading--;
      if (this.drains.length > 0) this.drain();
    });
  }

  /** Resolves once every write made so far has settled and no read is in flight. */
  drained(): Promise<void> {
    return new Promise<void>(resolve => {
      this.drains.push({ until: this.made, resolve });
      this.drain();
    });
  }

  private drain(): void {
    if (this.reading > 0) return;
    while (this.drains.length > 0 && this.drains[0].until <= this.settled) this.drains.shift()!.resolve();
  }
}

/** The writes whose answer may hand a worker a job (see `WriteOrder`). */
const HANDS_OUT_JOBS: ReadonlySet<string> = new Set(['moveToActive', 'moveToCompleted', 'moveToFailed']);

/** A write's settlement, kept until its turn, and the backend told once it is released. */
interface Held {
  settle(): void;
  handsOutJob: boolean;
  reads: ReadsAfterWrites;
}

/**
 * The writes of one store in flight, each settled once it and every write
 * submitted before it have settled. Each settles into `settled` under its
 * number, and the run of settled writes from the next one due is released
 * (the committer settles them in commit order, so mostly at once). (A chain of
 * promises, each write's after the one before, cost every write about five
 * promises more and the adoption of one by another, on the JavaScript thread
 * that at concurrency 100 completes a job per write.)
 *
 * A write that may hand a worker a job, made while an earlier write that
 * hands out none (an add, say) was unanswered, is also released no earlier
 * than the turn of the event loop after that one: both answers come in one
 * turn (the lease, woken by the add, waits for the add's commit), the add's
 * caller sees its `await` return in that turn's microtasks, but its chain of
 * awaits may be longer than the worker's way to its `active` event, and on
 * Redis (the add's answer and the job coming on two connections, so in two
 * turns) a producer never sees a worker start the job before its add
 * returned. A lease made after the add was answered (a worker woken in the
 * add's own call, under relaxed durability) is not held back.
 */
class WriteOrder {
  /** Writes settled and not released yet, by the number they were made under. */
  private readonly settled = new Map<number, Held>();
  private submitted = 0;
  /** The number of the next write to release. */
  private released = 0;
  /** A write that hands out no job was released in this turn of the event loop. */
  private releasedThisTurn = false;
  /** How many writes had been made when the last of those was released. */
  private madeBeforeRelease = 0;
  /** Releasing waits for the next turn (see the class comment). */
  private waitingForTurn = false;

  constructor(private readonly store: string) {}

  /** `write` (a native promise), in BullMQ's error form, in order; told to `reads` once settled. */
  add<T>(write: Promise<T>, handsOutJob: boolean, reads: ReadsAfterWrites): Promise<T> {
    const number = this.submitted++;
    reads.made1();
    return new Promise<T>((resolve, reject) => {
      write.then(
        value => this.settle(number, { settle: () => resolve(value), handsOutJob, reads }),
        (err: unknown) => {
          const error = reads.failed(fromNative(err));
          this.settle(number, { settle: () => reject(error), handsOutJob, reads });
        },
      );
    });
  }

  private settle(number: number, held: Held): void {
    this.settled.set(number, held);
    this.release();
  }

  /** Releases the settled writes due, in order, until one is missing or must wait for the next turn. */
  private release(): void {
    if (this.waitingForTurn) return;
    for (let next = this.settled.get(this.released); next; next = this.settled.get(this.released)) {
      if (next.handsOutJob && this.releasedThisTurn && this.released < this.madeBeforeRelease) {
        this.waitingForTurn = true;
        setImmediate(() => {
          this.waitingForTurn = false;
          this.releasedThisTurn = false;
          this.release();
        });
        return;
      }
      this.settled.delete(this.released);
      this.released++;
      if (!next.handsOutJob) {
        this.madeBeforeRelease = this.submitted;
        if (!this.releasedThisTurn) {
          this.releasedThisTurn = true;
          setImmediate(() => {
            this.releasedThisTurn = false;
            this.forgetIfIdle();
          });
        }
      }
      next.settle();
      next.reads.settled1();
    }
    this.forgetIfIdle();
  }

  /** Forgets a store with nothing in flight or held (its next write starts afresh). */
  private forgetIfIdle(): void {
    const idle = this.released === this.submitted && !this.releasedThisTurn && !this.waitingForTurn;
    if (idle && orders.get(this.store) === this) orders.delete(this.store);
  }
}

/**
 * Each store's writes in flight (by `storeKey`: the writes of a store its
 * last backend closed are not held behind those of the next store of its dir).
 */
const orders = new Map<string, WriteOrder>();

/**
 * Opens under way (a store's first, or one after it failed): their calls
 * wait for them. By store, not by data dir, as `orders`.
 */
const openings = new Map<string, Promise<void>>();

/** The store `native` uses: its data dir and the addon's number for it. */
function storeKey(store: string, native: object): string {
  return `${String((native as { storeId?: number }).storeId)}:${store}`;
}

/** Makes the calls of the store `key` wait for its open, if `native` says it is under way. */
function awaitOpen(key: string, native: object, opened: Method): void {
  if (openings.has(key) || !(native as { opening?: boolean }).opening) return;
  const open = opened.call(native) as Promise<void>;
  openings.set(key, open);
  // Registered first, so it runs before the calls that waited: a call made
  // after them no longer waits, and cannot start before them.
  const forget = (): void => {
    if (openings.get(key) === open) openings.delete(key);
  };
  open.then(forget, forget);
}

/** A call made once its backend's `close` was called. */
const closed = (): Promise<never> => Promise.reject(loamError('unavailable', 'the backend is closed'));

/** `write`, resolving (or rejecting) only after every earlier write of the store `store` (its `storeKey`). */
function inOrder<T>(store: string, write: Promise<T>, handsOutJob: boolean, reads: ReadsAfterWrites): Promise<T> {
  let order = orders.get(store);
  if (!order) orders.set(store, (order = new WriteOrder(store)));
  return order.add(write, handsOutJob, reads);
}

/**
 * Wraps the methods of a native queue (in place) as the module comment says;
 * `store` is its data dir, `reads` its connection's calls (a sibling shares
 * its owner's). Each call sets `activity.at` to its time (a named client's
 * idle time in `getWorkers`).
 */
export function nativeCalls<N extends object>(
  native: N,
  store: string,
  activity: Activity = { at: 0 },
  reads: ReadsAfterWrites = new ReadsAfterWrites(),
): N {
  const methods = native as unknown as Record<string, Method>;
  const prototype = Object.getPrototypeOf(native) as object;
  for (const name of [...WRITE_METHODS, 'opened', 'reopen']) {
    if (typeof methods[name] !== 'function') throw new Error(`the native addon has no method ${name}`);
  }
  const key = storeKey(store, native);
  const { opened, reopen } = methods;
  awaitOpen(key, native, opened);
  // Siblings share their owner's connection, and so its store.
  reads.reconnect ??= () => {
    try {
      if (reopen.call(native)) awaitOpen(key, native, opened);
    } catch {
      // The call's own error is what its caller sees; the store stays as it
      // was, and the next call that finds it unreachable asks again.
    }
  };
  const inBullmqForm = (err: unknown): never => {
    throw reads.failed(fromNative(err));
  };
  for (const name of Object.getOwnPropertyNames(prototype)) {
    const method = Object.getOwnPropertyDescriptor(prototype, name)?.value as Method | undefined;
    if (name === 'constructor' || typeof method !== 'function') continue;
    if (SYNC_METHODS.has(name)) {
      methods[name] = (...args) => {
        activity.at = Date.now();
        return callSync(() => method.apply(native, args));
      };
      continue;
    }
    const write = WRITE_METHODS.has(name);
    const handsOutJob = HANDS_OUT_JOBS.has(name);
    const callNow = (args: unknown[]): Promise<unknown> => {
      try {
        return method.apply(native, args) as Promise<unknown>;
      } catch (err) {
        return Promise.reject(err);
      }
    };
    const call = (args: unknown[]): Promise<unknown> => {
      const open = openings.get(key);
      return open ? open.then(() => callNow(args)) : callNow(args);
    };
    if (write) {
      methods[name] = (...args) => {
        if (reads.closing) return closed();
        activity.at = Date.now();
        return inOrder(key, call(args), handsOutJob, reads);
      };
    } else if (name === 'close') {
      methods[name] = (...args) => {
        activity.at = Date.now();
        reads.closing = true;
        methods.interruptBlocking();
        methods.interruptEvents();
        return reads
          .drained()
          .then(() => callNow(args))
          .catch(inBullmqForm);
      };
    } else if (UNORDERED.has(name)) {
      methods[name] = (...args) => {
        if (reads.closing) return closed();
        activity.at = Date.now();
        return call(args).catch(inBullmqForm);
      };
    } else {
      methods[name] = (...args) => {
        if (reads.closing) return closed();
        activity.at = Date.now();
        return reads.after(() => call(args)).catch(inBullmqForm);
      };
    }
  }
  return native;
}
