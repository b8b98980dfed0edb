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
 */
import { callSync, fromNative } from './errors.js';

/** The native methods that answer synchronously; every other one returns a promise. */
const SYNC_METHODS: ReadonlySet<string> = new Set([
  'forQueue',
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

type Method = (...args: unknown[]) => unknown;

/** The last write of each store (by data dir), settled or not. */
const tails = new Map<string, Promise<unknown>>();

const settled = (): undefined => undefined;

const inBullmqForm = (err: unknown): never => {
  throw fromNative(err);
};

/** `write`, resolving (or rejecting) only after every earlier write of `store`. */
function inOrder<T>(store: string, write: Promise<T>): Promise<T> {
  const before = tails.get(store);
  let ordered = write;
  if (before) {
    // Its rejection is handled, once the earlier writes settled.
    write.catch(settled);
    ordered = before.then(() => write);
  }
  const tail = ordered.then(settled, settled);
  tails.set(store, tail);
  // Forget a store's chain once its last write settled.
  void tail.then(() => {
    if (tails.get(store) === tail) tails.delete(store);
  });
  return ordered;
}

/** Wraps the methods of a native queue (in place) as the module comment says; `store` is its data dir. */
export function nativeCalls<N extends object>(native: N, store: string): N {
  const methods = native as unknown as Record<string, Method>;
  const prototype = Object.getPrototypeOf(native) as object;
  for (const name of WRITE_METHODS) {
    if (typeof methods[name] !== 'function') throw new Error(`the native addon has no write method ${name}`);
  }
  for (const name of Object.getOwnPropertyNames(prototype)) {
    const method = Object.getOwnPropertyDescriptor(prototype, name)?.value as Method | undefined;
    if (name === 'constructor' || typeof method !== 'function') continue;
    if (SYNC_METHODS.has(name)) {
      methods[name] = (...args) => callSync(() => method.apply(native, args));
      continue;
    }
    const write = WRITE_METHODS.has(name);
    methods[name] = (...args) => {
      let answer: Promise<unknown>;
      try {
        answer = method.apply(native, args) as Promise<unknown>;
      } catch (err) {
        answer = Promise.reject(err);
      }
      return (write ? inOrder(store, answer) : answer).catch(inBullmqForm);
    };
  }
  return native;
}
