/**
 * The native addon settles each write from the store's committer thread, in
 * commit order, but Node runs those settlements in an order of its own (one
 * thread-safe callback per promise). A worker could then see a job before its
 * producer's `add` resolved, which Redis, answering in order, never shows.
 * So the promises of one store's writes resolve here in the order the writes
 * were submitted (which is the order the core applied them).
 */

/** The native methods that submit a write (the rest are reads and waits). */
export const WRITE_METHODS = [
  'addJob', 'addJobs', 'addFlow', 'moveToActive', 'extendLock', 'extendLocks', 'moveStalledJobsToWait',
  'moveToCompleted', 'moveToFailed', 'moveToDelayed', 'retryJob', 'moveJobFromActiveToWait',
  'moveToWaitingChildren', 'retryFinishedJob', 'promote', 'changeDelay', 'changePriority', 'remove',
  'removeUnprocessedChildren', 'removeChildDependency', 'updateData', 'updateProgress', 'addLog', 'clearLogs',
  'pause', 'drain', 'cleanJobsByState', 'obliterate', 'retryFinishedJobs', 'promoteJobs', 'setQueueMeta',
  'removeQueueMetaFields', 'setRateLimit', 'removeRateLimitKey', 'removeDeduplicationKey', 'publishEvent',
  'trimEvents', 'addJobScheduler', 'updateJobSchedulerNextMillis', 'removeJobScheduler',
] as const;

/** The last write of each store (by data dir), settled or not. */
const tails = new Map<string, Promise<unknown>>();

const settled = (): undefined => undefined;

/** `write`, resolving (or rejecting) only after every earlier write of `store`. */
function inOrder<T>(store: string, write: Promise<T>): Promise<T> {
  const before = tails.get(store);
  const ordered = before ? before.then(() => write) : write;
  const tail = ordered.then(settled, settled);
  tails.set(store, tail);
  // Forget a store's chain once its last write settled.
  void tail.then(() => {
    if (tails.get(store) === tail) tails.delete(store);
  });
  return ordered;
}

/** Makes the write methods of a native queue resolve in submission order. */
export function orderWrites<N extends object>(native: N, store: string): N {
  const methods = native as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
  for (const name of WRITE_METHODS) {
    const submit = methods[name];
    if (typeof submit !== 'function') {
      throw new Error(`the native addon has no write method ${name}`);
    }
    methods[name] = (...args: unknown[]) => inOrder(store, submit.apply(native, args));
  }
  return native;
}
