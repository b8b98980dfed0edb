/**
 * What the in-process backend (`backend.ts`) and the remote one (`remote.ts`)
 * share: the shapes BullMQ hands a backend and expects back, independent of
 * how the core is reached.
 */
import type { EventEmitter } from 'node:events';
import type { FactoryOptions } from './backend.js';
import { finishedErrorText, loamError } from './errors.js';
import { ConnectionClosedError } from 'bullmq';
import type { DependenciesOpts, IQueueBackend, JobJson, JobsOptions, ParentKeyOpts, RepeatableOptions, RepeatOptions } from 'bullmq';

/** BullMQ's next-job tuple: `[jobJson | null, id (0 without a job), rateLimitDelayMs, delayUntilMs]`. */
export type NextJobTuple = [JobJson | null, string | 0, number, number];
export type FinishedResult = { result?: NextJobTuple; finishedOn: number };

/**
 * The `result` of `moveToCompleted` / `moveToFailed` as Redis's adapter
 * returns it: `[]` when no next job was asked for, or none was there and
 * nothing holds the worker back (no rate limit, no delayed job due later);
 * else the next-job tuple. Manual processing destructures it.
 */
export function finishedNext(next: NextJobTuple | undefined): NextJobTuple | [] {
  if (!next || (next[0] === null && next[2] === 0 && next[3] === 0)) return [];
  return next;
}

/** What `isFinished` needs of a job: its state (BullMQ's name), its return value's JSON, its failure reason. */
export interface FinishedFields {
  state: string;
  returnValue?: string | null;
  failedReason?: string | null;
}

/**
 * BullMQ's `isFinished` answer for `job` (undefined when missing): `code`,
 * or `[code, value]` when the value is asked for (-1 missing, with Redis's
 * text naming `key`; 0 not finished, with no value; 1 completed, with the
 * return value's JSON; 2 failed, with the reason).
 */
export function isFinishedAnswer(
  job: FinishedFields | undefined,
  returnValue: boolean,
  key: string,
): number | [number, string] {
  const [code, value]: [number, string | undefined] = !job
    ? [-1, finishedErrorText(-1, { command: 'isFinished', jobId: key })]
    : job.state === 'completed'
      ? [1, job.returnValue ?? 'null']
      : job.state === 'failed'
        ? [2, job.failedReason ?? '']
        : [0, undefined];
  if (!returnValue) return code;
  return (value === undefined ? [code] : [code, value]) as [number, string];
}

/** A queue's metrics of one kind, with the points asked for (numbers, or the wire's 64-bit integers). */
export interface MetricsRecord {
  count: number | bigint;
  prevTs: number | bigint;
  prevCount: number | bigint;
  /** Jobs a minute, newest first: the page the call asked for, paged by the core. */
  data: readonly (number | bigint)[];
  /** How many points are kept. */
  total: number | bigint;
}

/**
 * BullMQ's raw `getMetrics` answer, as Redis's adapter returns it:
 * `[[count, prevTS, prevCount], the points asked for, how many points there
 * are]`; with no metrics kept, the three are `null`, as Redis's `HMGET` of a
 * missing hash answers.
 */
export function metricsAnswer(rec: MetricsRecord | undefined): [string[], string[], number] {
  if (!rec) return [[null, null, null] as unknown as string[], [], 0];
  return [[String(rec.count), String(rec.prevTs), String(rec.prevCount)], rec.data.map(String), Number(rec.total)];
}

/** A parent's children, by BullMQ category, in the core's order. */
export interface ChildrenByCategory {
  /** Child key and its return value as JSON text. */
  processed: [string, string][];
  unprocessed: string[];
  /** Child key and its failure reason. */
  ignored: [string, string][];
  failed: string[];
}

/**
 * Reports an error of a backend's own background work (its ready check, a
 * refresh on a timer) to its `error` listeners. With none, the error is
 * dropped: an EventEmitter throws an unheard `error`, and thrown from a
 * promise handler that becomes an unhandled rejection, which ends a Node
 * process. A `forQueue` sibling has no listeners, and its ready check fails
 * whenever its owner closes first (a FlowProducer closed right after an add);
 * the failure still reaches the next call that needs the backend.
 */
export function reportBackgroundError(emitter: EventEmitter, err: unknown): void {
  if (emitter.listenerCount('error') > 0) emitter.emit('error', err);
}

/**
 * Names set through `setName` (and the names workers' blocking connections
 * get in Redis), so `getClientList` can report the workers and QueueEvents of
 * this process, which are all the clients an embedded store has. Kept per
 * store and namespace (see `clientsKey`): a queue lists only the clients of
 * its own, as a Redis server lists only its own connections. Each holder
 * once, in the order they took their names (Redis lists clients by id).
 */
const clientNames = new Map<string, Set<NameHolder>>();

/** When a client last called the store (epoch ms), kept up to date by its backend. */
export interface Activity {
  at: number;
}

interface NameHolder {
  name: string;
  since: number;
  activity: Activity;
}

/** A client as `getClientList` reports it (Redis's CLIENT LIST fields that a queue backend knows). */
export interface ClientSeen {
  name: string;
  /** `host:port` of its connection; none in-process. */
  addr?: string;
  /** Since it took its name, when known. */
  ageMs?: number;
  /** Since it last called the store, when known. */
  idleMs?: number;
}

/** Which clients a backend's `getClientList` sees: those of its data dir and namespace. */
export function clientsKey(dataDir: string, namespace: string): string {
  return `${dataDir}\u0000${namespace}`;
}

/**
 * Holds `name` among the clients of `clients` (a `clientsKey`) for a client
 * whose calls `activity` follows; returns its release.
 */
export function holdName(clients: string, name: string, activity: Activity): () => void {
  let holders = clientNames.get(clients);
  if (!holders) clientNames.set(clients, (holders = new Set()));
  const holder: NameHolder = { name, since: Date.now(), activity };
  holders.add(holder);
  return () => {
    if (holders.delete(holder) && holders.size === 0 && clientNames.get(clients) === holders) {
      clientNames.delete(clients);
    }
  };
}

/** The clients of `clients` that hold a name. */
export function namedClients(clients: string): ClientSeen[] {
  const now = Date.now();
  return [...(clientNames.get(clients) ?? [])].map(h => {
    const ageMs = now - h.since;
    // Never idle for longer than it has held its name (as Redis's idle is never over its age).
    return { name: h.name, ageMs, idleMs: Math.max(0, Math.min(ageMs, now - h.activity.at)) };
  });
}

/**
 * Clients as one Redis CLIENT LIST text, the shape BullMQ's getWorkers
 * parses: age and idle in whole seconds, as Redis gives them.
 */
export function clientListText(clients: ClientSeen[]): string[] {
  const seconds = (ms: number) => String(Math.floor(ms / 1000));
  const line = (c: ClientSeen, i: number) =>
    [
      `id=${i + 1}`,
      ...(c.addr ? [`addr=${c.addr}`] : []),
      `name=${c.name}`,
      ...(c.ageMs !== undefined ? [`age=${seconds(c.ageMs)}`] : []),
      ...(c.idleMs !== undefined ? [`idle=${seconds(c.idleMs)}`] : []),
    ].join(' ');
  return [clients.map(line).join('\n')];
}

export function parseJob(text: string | null | undefined): JobJson | undefined {
  return text ? (JSON.parse(text) as JobJson) : undefined;
}

/** A new job as the core reads it: BullMQ's JobJson plus the backend arguments. */
export interface NewJobJson {
  name: string;
  /** The payload's JSON text. */
  data: string;
  opts: Record<string, any>;
  jobId: string | undefined;
  timestamp: number | undefined;
  delay: number | undefined;
  priority: number | undefined;
  parent: JobJson['parent'];
  parentKey: string | undefined;
  repeatJobKey: string | undefined;
  addToWaitingChildren: boolean;
  queueName: string | undefined;
}

/** The JSON text the core's job parser reads (BullMQ's JobJson + backend args). */
export function newJobJson(
  job: JobJson,
  jobId: string | undefined,
  parentKeyOpts?: ParentKeyOpts,
  queueName?: string,
): NewJobJson {
  const opts = job.opts ?? {};
  refuseNonFinite(opts);
  return {
    // A name given as a number (plain JavaScript) is sent as its digits, as ioredis sends it.
    name: typeof job.name === 'number' ? String(job.name) : job.name,
    data: job.data,
    opts,
    jobId: jobId || job.id || undefined,
    timestamp: job.timestamp,
    delay: (job as { delay?: number }).delay,
    priority: (job as { priority?: number }).priority,
    parent: job.parent,
    parentKey: parentKeyOpts?.parentKey ?? job.parentKey,
    repeatJobKey: job.repeatJobKey,
    addToWaitingChildren: parentKeyOpts?.addToWaitingChildren ?? false,
    queueName,
  };
}

/**
 * The time a queue is rate-limited for (`queue.rateLimit`, a processor's
 * `worker.rateLimit`): refused unless a finite number, as Redis refuses it;
 * `Infinity` would stop the queue for ever.
 */
export function rateLimitMs(ms: number): number {
  if (typeof ms === 'number' && !(ms >= 0 && ms <= Number.MAX_SAFE_INTEGER)) {
    throw loamError('invalid_argument', `a rate limit must be 0 to 2^53 milliseconds, got ${ms}`);
  }
  return ms;
}

/**
 * BullMQ's defaults for the Worker settings a backend applies, where its
 * factory options give none (a Queue's or a FlowProducer's backend): the
 * lock a lease takes, and how often a job may stall before it fails.
 */
export const WORKER_DEFAULTS = Object.freeze({ lockDuration: 30_000, maxStalledCount: 1 });

/**
 * Refuses Worker settings that are NaN, and a lock duration past 2^53 ms,
 * as Redis refuses them: a lock held for ever would keep a dead worker's
 * job active for ever. The others may be `Infinity` (no limit), which both
 * backends read as the largest number, and `-Infinity`, read as 0.
 */
export function checkWorkerNumbers(
  opts: Pick<FactoryOptions, 'lockDuration' | 'limiter' | 'maxStalledCount' | 'metrics'>,
): void {
  const given: [string, unknown][] = [
    ['lockDuration', opts.lockDuration],
    ['maxStalledCount', opts.maxStalledCount],
    ['limiter.max', opts.limiter?.max],
    ['limiter.duration', opts.limiter?.duration],
    ['metrics.maxDataPoints', opts.metrics?.maxDataPoints],
  ];
  for (const [name, n] of given) {
    if (typeof n === 'number' && (Number.isNaN(n) || (name === 'lockDuration' && !(n <= Number.MAX_SAFE_INTEGER)))) {
      throw loamError('invalid_argument', `worker options are not valid: ${name} cannot be ${n}`);
    }
  }
}

/**
 * The time `clean` removes jobs finished before: BullMQ passes `Date.now()`
 * less the grace, so a grace left out is NaN. Refused, where it read as 0
 * and cleaned nothing without a word (Redis refuses it for the sorted sets,
 * and removes every job of the lists).
 */
export function cleanBefore(timestamp: number): number {
  if (Number.isNaN(timestamp)) {
    throw loamError('invalid_argument', 'clean needs a grace period in milliseconds (a number), got none');
  }
  return timestamp;
}

/**
 * Refuses job options that hold NaN or an infinite number (a top-level
 * option, or a field of one: `backoff.delay`, `removeOnComplete.age`), as
 * Redis refuses them (BullMQ packs options with msgpack there, which cannot
 * hold them). JSON would carry one as null, "not set": `delay: Infinity` ran
 * the job at once. The job's `delay`, `priority` and `timestamp` come from
 * these options.
 */
function refuseNonFinite(opts: object, what = 'job options'): void {
  for (const name in opts) {
    const value = (opts as Record<string, unknown>)[name];
    if (typeof value === 'number') {
      if (!Number.isFinite(value)) refuseOption(what, name, value);
    } else if (typeof value === 'object' && value !== null) {
      for (const field in value) {
        const inner = (value as Record<string, unknown>)[field];
        if (typeof inner === 'number' && !Number.isFinite(inner)) refuseOption(what, `${name}.${field}`, inner);
      }
    }
  }
}

function refuseOption(what: string, name: string, value: number): never {
  throw loamError('invalid_argument', `${what} are not valid: ${name} must be a finite number, got ${value}`);
}

/** Splits a flow node key `<prefix>:<queue>:<id>` (the prefix may hold colons). */
export function parseNodeKey(key: string): { prefix: string; queueName: string; id: string } {
  const last = key.lastIndexOf(':');
  const prev = key.lastIndexOf(':', last - 1);
  if (last === -1 || prev === -1) {
    const [prefix = '', queueName = '', id = ''] = key.split(':');
    return { prefix, queueName, id };
  }
  return { prefix: key.slice(0, prev), queueName: key.slice(prev + 1, last), id: key.slice(last + 1) };
}

type DependenciesPage = Awaited<ReturnType<IQueueBackend['getDependencies']>>;

/** `getDependencies`: every category at once, or the pages `opts` asks for. */
export function dependenciesPage(all: ChildrenByCategory, opts: DependenciesOpts): DependenciesPage {
  const processedValues = (entries: [string, string][]) =>
    Object.fromEntries(entries.map(([key, value]) => [key, JSON.parse(value)]));
  if (!opts.processed && !opts.unprocessed && !opts.ignored && !opts.failed) {
    return {
      processed: processedValues(all.processed),
      unprocessed: all.unprocessed,
      failed: all.failed,
      ignored: Object.fromEntries(all.ignored),
    };
  }
  // Cursors are offsets into the category; 0 = no more (as Redis' SCAN).
  const page = <T>(items: T[], o: { cursor?: number; count?: number }): [T[], number] => {
    const from = o.cursor ?? 0;
    const to = from + (o.count ?? 20);
    return [items.slice(from, to), to < items.length ? to : 0];
  };
  const out: DependenciesPage = {};
  if (opts.processed) {
    const [items, next] = page(all.processed, opts.processed);
    out.processed = processedValues(items);
    out.nextProcessedCursor = next;
  }
  if (opts.unprocessed) {
    [out.unprocessed, out.nextUnprocessedCursor] = page(all.unprocessed, opts.unprocessed);
  }
  if (opts.ignored) {
    const [items, next] = page(all.ignored, opts.ignored);
    out.ignored = Object.fromEntries(items);
    out.nextIgnoredCursor = next;
  }
  if (opts.failed) {
    const [items, next] = page(all.failed, opts.failed);
    out.failed = items;
    if (next) out.nextFailedCursor = next;
  }
  return out;
}

/**
 * One of `paginate`'s items: a pending child's key, or a processed child's
 * key and value, parsed (`v`); a value that is not JSON (a result another
 * client stored) gets the parse's message (`err`) instead, as Redis's adapter
 * answers it, rather than failing the page.
 */
export function paginateItem(
  id: string,
  value: string | null | undefined,
  processed: boolean,
): { id: string; v?: any; err?: string } {
  if (!processed) return { id };
  try {
    return { id, v: JSON.parse(value ?? 'null') };
  } catch (err) {
    return { id, err: (err as Error).message };
  }
}

/** `paginate` keys: `<qualifiedName>:<parentId>:dependencies` or `:processed`. */
export function paginateTarget(key: string, qualifiedName: string): { parentId: string; processed: boolean } {
  const match = /^(.*):(dependencies|processed)$/.exec(key);
  const own = `${qualifiedName}:`;
  if (!match || !match[1].startsWith(own)) {
    throw loamError(
      'invalid_argument',
      `cannot paginate key ${key}: only a parent's dependencies or processed children of this queue`,
    );
  }
  return { parentId: match[1].slice(own.length), processed: match[2] === 'processed' };
}

/**
 * The `forQueue` siblings a backend made, by prefix and queue. A FlowProducer
 * asks for one per node of every flow it adds; building a backend costs more
 * than adding the node (a native handle, its ordered-write wrappers, a ready
 * check), so a queue's sibling is made once. Bounded, oldest first out, for
 * producers that spread flows over very many queues.
 */
export class Siblings<B extends { closing: Promise<void> | undefined }> {
  private readonly made = new Map<string, B>();

  constructor(private readonly max = 256) {}

  get(queueName: string, prefix: string, make: () => B): B {
    const key = `${prefix}\u0000${queueName}`;
    const known = this.made.get(key);
    if (known && !known.closing) return known;
    const sibling = make();
    this.made.delete(key);
    this.made.set(key, sibling);
    if (this.made.size > this.max) this.made.delete(this.made.keys().next().value as string);
    return sibling;
  }
}

/** The longest queue name, job id or worker name the core takes, and the longest namespace, in bytes. */
const MAX_NAME_BYTES = 1024;
const MAX_NAMESPACE_BYTES = 128;

/**
 * Refuses, as a Queue or Worker is made, the names the server would refuse
 * on every call (the in-process addon checks the same as it opens): a Worker
 * refused by each fetch asks again at once, thousands of times a second. A
 * FlowProducer has no queue of its own (`''`).
 */
export function checkNames(queueName: string, namespace: string | undefined, workerName: string | undefined): void {
  const bytes = (text: string) => Buffer.byteLength(text);
  if (bytes(queueName) > MAX_NAME_BYTES) {
    throw loamError('invalid_argument', `queue name must be 1 to ${MAX_NAME_BYTES} bytes, got ${bytes(queueName)}`);
  }
  if (namespace !== undefined && (namespace === '' || bytes(namespace) > MAX_NAMESPACE_BYTES)) {
    throw loamError('invalid_argument', `namespace must be 1 to ${MAX_NAMESPACE_BYTES} bytes, got ${bytes(namespace)}`);
  }
  if (workerName !== undefined && bytes(workerName) > MAX_NAME_BYTES) {
    throw loamError('invalid_argument', `a worker name must be at most ${MAX_NAME_BYTES} bytes`);
  }
}

/**
 * Refuses a namespace or token that cannot travel in an HTTP header (visible
 * ASCII only). Sent as it was, each call failed: refused as "not text", or
 * lost in Node's HTTP/2 with a Worker retrying for ever.
 */
export function checkHeaderValues(namespace: string | undefined, token: string | undefined): void {
  const visibleAscii = /^[\x21-\x7e]+$/;
  if (namespace !== undefined && !visibleAscii.test(namespace)) {
    throw loamError(
      'invalid_argument',
      `namespace ${JSON.stringify(namespace)} cannot be sent to the server: it travels in an HTTP header, which takes letters, digits and punctuation of ASCII only`,
    );
  }
  if (token !== undefined && !visibleAscii.test(token)) {
    throw loamError('invalid_argument', 'the token cannot be sent to the server: an HTTP header takes visible ASCII only');
  }
}

/**
 * The log rows an `addLog` keeps, in the core's terms. BullMQ's Redis backend
 * trims a job's logs only when it is given a `keepLogs` (`job.log` passes the
 * job's own); 0 or none keeps every row. Given none, the core would fall back
 * to the job's `keepLogs`, then to a cap of its own.
 */
export function logRowsKept(keepLogs: number | undefined): number {
  return keepLogs ? keptCount(keepLogs, 'keepLogs') : Number.MAX_SAFE_INTEGER;
}

/**
 * How many items (log rows, events) to keep: a whole number of at least 0,
 * or Infinity for all. Redis refuses anything else; read as 0, `-1`, `0.5`
 * or `NaN` removed every row or event.
 */
export function keptCount(n: number, what: string): number {
  if (n === Infinity) return Number.MAX_SAFE_INTEGER;
  if (Number.isSafeInteger(n) && n >= 0) return n;
  throw loamError('invalid_argument', `${what} must be a whole number of at least 0, or Infinity; got ${n}`);
}

/**
 * What `waitForJob` answers when `close()` or `disconnectBlocking()` cut it
 * short: nothing is ready before forever, so BullMQ's worker fetches
 * nothing. A null reads as "a job may be ready", and the lease that followed
 * could hand a job to a closing worker (or, through the server, wait out a
 * dead link before `close()` returned); on Redis the cut blocking command
 * throws, and the worker fetches nothing either.
 */
export const INTERRUPTED_WAIT: { member: string; score: number } = Object.freeze({ member: '1', score: Infinity });

/**
 * A progress as Redis keeps it: its JSON, or '' for `undefined`, which
 * `JSON.stringify` drops (the job's progress then reads back as 0).
 */
export function progressText(progress: unknown): string {
  return JSON.stringify(progress) ?? '';
}

/** A log row as Redis keeps it: ioredis sends whatever it is given as its string, and nothing (null, undefined) as empty. */
export function logRowText(row: unknown): string {
  // eslint-disable-next-line @typescript-eslint/no-base-to-string -- an object logs as ioredis sends it: '[object Object]'
  return row === undefined || row === null ? '' : String(row);
}

/**
 * A scheduler's repeat options as the core takes them: BullMQ's own, plus the
 * `repeat.count` it gave the first iteration. BullMQ counts iterations in
 * JavaScript, from 1 at each upsert, so an upsert restarts its `limit`.
 * Refused, as a job's options are (`refuseNonFinite`), when they or the
 * scheduler's job template hold NaN or an infinite number: a `limit: NaN`
 * read as 0 made a scheduler that never fired, and Redis refuses it. (The
 * iteration's own options are not looked at: BullMQ puts `delay: NaN` there.)
 */
export function schedulerRepeat(
  opts: RepeatableOptions | undefined,
  delayedJobOpts: JobsOptions | undefined,
  templateOpts: JobsOptions | undefined,
) {
  refuseNonFinite(templateOpts ?? {}, 'scheduler template options');
  // BullMQ types the iteration's options as JobsOptions; they carry `repeat`.
  const repeat = (delayedJobOpts as { repeat?: RepeatOptions } | undefined)?.repeat;
  const given = { ...(opts ?? {}), count: repeat?.count };
  refuseNonFinite(given, 'scheduler options');
  return given;
}

/**
 * What a blocking read (`waitForJob`, `readEvents`) asked for after
 * `disconnect()` or `disconnectBlocking()` (and no `reconnectBlocking()`)
 * throws, on either backend: Redis's closed connection. BullMQ then waits and
 * asks again (a Worker reconnects its blocking connection first, a QueueEvents
 * asks every 5 s), where a read answered "interrupted" at once, each time,
 * kept its loop asking without pause: at 100% CPU, and through the remote
 * backend without a turn of the event loop, so no timer or `close()` ran.
 */
export function disconnectedRead(command: 'waitForJob' | 'readEvents'): ConnectionClosedError {
  return new ConnectionClosedError(`${command} after disconnect(): the connection is closed until reconnected`);
}
