/**
 * `LoamQueueBackend`: BullMQ 6.7's `IQueueBackend` over the Loam Jobs core,
 * in-process. Every member that touches queue state is one call into the
 * native addon, which runs it as one transaction (or one snapshot read) in
 * the core; this file only adapts argument and result shapes. Nested results
 * cross the boundary as JSON text (one `JSON.parse` here, no reshaping).
 *
 * Every call passes `Date.now()` first: the core's clock follows the host's
 * (BullMQ's Redis scripts take their time from the caller, and its tests fake
 * it), at the cost of one number per call rather than another crossing.
 */
import { EventEmitter } from 'node:events';
import type {
  DependenciesOpts,
  FinishedStatus,
  IQueueBackend,
  JobJson,
  JobProgress,
  JobsOptions,
  JobState,
  JobType,
  KeepJobs,
  KeysMap,
  MinimalJob,
  MoveToDelayedOpts,
  MoveToWaitingChildrenOpts,
  ParentKeyOpts,
  RepeatableOptions,
  RetryJobOpts,
  RetryOptions,
  StreamReadRaw,
} from 'bullmq';
import type { LoamQueue } from '../native/index.js';
import {
  disconnectedRead,
  clientListText,
  clientsKey,
  dependenciesPage,
  finishedNext,
  INTERRUPTED_WAIT,
  holdName,
  isFinishedAnswer,
  metricsAnswer,
  logRowText,
  keptCount,
  logRowsKept,
  namedClients,
  checkWorkerNumbers,
  cleanBefore,
  newJobJson,
  rateLimitMs,
  paginateItem,
  paginateTarget,
  progressText,
  parseJob,
  parseNodeKey,
  reportBackgroundError,
  schedulerRepeat,
  Siblings,
  WORKER_DEFAULTS,
  type Activity,
  type ChildrenByCategory,
  type FinishedFields,
  type FinishedResult,
  type MetricsRecord,
} from './common.js';
import { fromNative, isConnectionError } from './errors.js';
import { nativeCalls, ReadsAfterWrites } from './native-calls.js';

/** The core namespace of a backend whose settings name none. */
export const DEFAULT_NAMESPACE = 'default';

/** What a backend needs to open its queue (see `loamBackend()`). */
export interface LoamBackendSettings {
  /** Directory of the embedded store. */
  dataDir: string;
  /** Core namespace the queues live in (default `default`). */
  namespace?: string;
  /** `immediate` (fsync per acknowledged write, the default) or `relaxed`. */
  durability?: 'immediate' | 'relaxed';
  /** With `relaxed`: longest time a write may wait for its flush, in ms. */
  flushIntervalMs?: number;
}

/** The BullMQ factory options the core reads (worker settings and naming). */
interface FactoryOptions {
  prefix?: string;
  name?: string;
  lockDuration?: number;
  limiter?: { max: number; duration: number };
  maxStalledCount?: number;
  metrics?: { maxDataPoints?: number };
  removeOnComplete?: boolean | number | KeepJobs;
  removeOnFail?: boolean | number | KeepJobs;
}

/** How often a backend reports, at most, that its store cannot be reached. */
const UNREACHABLE_REPORT_MS = 1_000;

/**
 * Reports a backend's errors that say its store cannot be reached, at most
 * once a second: a Worker retries every `runRetryDelay`, but an app's own
 * adds may fail by the thousand. The backend is held weakly, and from a
 * function of its own (a closure made in the constructor would share the
 * constructor's context, which holds `this`): the native queue's methods
 * hold `reads`, and `unclosed` holds the native queue, so a strong hold kept
 * every backend it watches from being collected.
 */
function reportingTo(backend: WeakRef<EventEmitter>): (err: Error) => void {
  let reported = 0;
  return err => {
    const target = backend.deref();
    if (!target || Date.now() - reported < UNREACHABLE_REPORT_MS) return;
    reported = Date.now();
    reportBackgroundError(target, err);
  };
}

/**
 * Owners BullMQ made and let go of unclosed: a Worker whose constructor
 * threw after it made its backend (`stalledInterval: 0`, a missing processor
 * file) left the store open, and locked to other processes, for the life of
 * the process. Each gives its use back once collected.
 */
const unclosed = new FinalizationRegistry<LoamQueue>(native => {
  native.close().catch(() => undefined);
});

export class LoamQueueBackend extends EventEmitter implements IQueueBackend {
  closing: Promise<void> | undefined;
  readonly keys: KeysMap = {};
  /** Redis' smallest block unit; the core wakes on in-process notifications. */
  readonly minimumBlockTimeout = 0.001;
  /**
   * Waits are woken in-process and re-armed to the next delayed job, so there
   * is no connection to keep fresh: an idle worker may block for long.
   */
  readonly maximumBlockTimeout = 3600;

  private readonly native: LoamQueue;
  /** The core namespace the queue lives in. */
  private readonly namespace: string;
  /** Whose names `getClientList` lists: this store's and namespace's (see `clientsKey`). */
  private readonly clients: string;
  private releaseName: (() => void) | undefined;
  /** How many times a blocking wait was cut short (`close`, `disconnect`, `disconnectBlocking`). */
  private blockingCuts = 0;
  /** Whether `disconnect()` or `disconnectBlocking()` cut the blocking reads, and no `reconnectBlocking()` since. */
  private blockingDisconnected = false;
  /** Whether `disconnect()` cut the event reads (nothing reconnects them: Redis's connection stays closed). */
  private eventsDisconnected = false;
  /** When this backend last called the store: a named client's idle time. */
  private readonly activity: Activity = { at: Date.now() };
  private ready: Promise<void>;
  /** Set once `ready` resolved; a worker takes jobs only from then on. */
  private isReady = false;
  /** `ready` failed: the next `waitUntilReady` asks again. */
  private readyFailed = false;
  /** A QueueEvents' backend, which reads events from where it was made. */
  private readonly readsEvents: boolean;
  /** Where a QueueEvents started reading (`'$'` resolved at construction). */
  private eventsStart: Promise<string> | undefined;
  private readonly siblings = new Siblings<LoamQueueBackend>();
  /** This backend's calls, and its siblings': one connection's, as on Redis. */
  private readonly reads: ReadsAfterWrites;

  constructor(
    native: LoamQueue,
    private readonly queueName: string,
    private readonly prefix: string,
    private readonly owner: boolean,
    options: {
      blocking?: boolean;
      withBlockingConnection?: boolean;
      workerName?: string;
      namespace?: string;
      reads?: ReadsAfterWrites;
    } = {},
  ) {
    super();
    this.namespace = options.namespace ?? DEFAULT_NAMESPACE;
    this.clients = clientsKey(native.dataDir, this.namespace);
    if (options.reads) {
      this.reads = options.reads;
    } else {
      this.reads = new ReadsAfterWrites();
      this.reads.unreachable = reportingTo(new WeakRef(this));
    }
    // Every call of `this.native` fails in BullMQ's form, its writes settle in order.
    this.native = nativeCalls(native, native.dataDir, this.activity, this.reads);
    if (owner) unclosed.register(this, this.native, this);
    if (options.withBlockingConnection) {
      // Redis names a worker's blocking connection so getWorkers finds it.
      const suffix = options.workerName ? `:w:${options.workerName}` : '';
      this.releaseName = holdName(this.clients, this.clientName(suffix), this.activity);
    }
    this.readsEvents = options.blocking ?? false;
    this.ready = this.askReady();
  }

  /**
   * Asks the store whether it answers (Redis' PING after connecting). A
   * QueueEvents reads from "now": that point is fixed here (and the backend
   * ready only then), so events written between its creation and its first
   * read are not lost.
   */
  private askReady(): Promise<void> {
    let ready: Promise<void>;
    if (this.readsEvents) {
      const start = this.native.lastEventId(Date.now());
      this.eventsStart = start;
      ready = start.then(() => undefined);
    } else {
      ready = this.native.ready();
    }
    ready.then(
      () => {
        this.isReady = true;
        this.emit('ready');
      },
      // Closed before it was ready, it is not an error that it never was;
      // a store that cannot be reached was reported as the call failed
      // (`reportingTo`).
      (err) => {
        this.readyFailed = true;
        if (!this.closing && !isConnectionError(err)) reportBackgroundError(this, err);
      },
    );
    return ready;
  }

  // ---- lifecycle ------------------------------------------------------------

  waitUntilReady(): Promise<void> {
    // A store that could not be reached is asked again: the call may find it
    // opened again since (see `nativeCalls`), as a Redis client that
    // reconnected is ready again. BullMQ's Job and Worker wait for this
    // before their calls, so a failed readiness kept failed them for good.
    if (this.readyFailed && !this.closing) {
      this.readyFailed = false;
      this.ready = this.askReady();
    }
    return this.ready;
  }

  close(_force?: boolean): Promise<void> {
    if (!this.closing) {
      this.blockingCuts++;
      this.releaseName?.();
      unclosed.unregister(this);
      this.closing = (this.owner ? this.native.close() : Promise.resolve()).then(() => {
        this.emit('close');
      });
    }
    return this.closing;
  }

  async disconnect(): Promise<void> {
    this.blockingCuts++;
    this.blockingDisconnected = true;
    this.eventsDisconnected = true;
    this.native.interruptBlocking();
    this.native.interruptEvents();
  }

  async setName(name: string): Promise<void> {
    this.releaseName?.();
    this.releaseName = holdName(this.clients, name, this.activity);
  }

  async disconnectBlocking(_wait?: boolean): Promise<void> {
    this.blockingCuts++;
    this.blockingDisconnected = true;
    this.native.interruptBlocking();
  }

  async reconnectBlocking(): Promise<void> {
    if (this.closing) return;
    this.blockingDisconnected = false;
    this.native.resetBlocking();
  }

  // ---- identity -------------------------------------------------------------

  forQueue(queueName: string, prefix?: string): IQueueBackend {
    const p = prefix ?? this.prefix;
    return this.siblings.get(queueName, p, () =>
      new LoamQueueBackend(this.native.forQueue(queueName), queueName, p, false, {
        namespace: this.namespace,
        reads: this.reads,
      }),
    );
  }

  get qualifiedName(): string {
    return `${this.prefix}:${this.queueName}`;
  }

  toKey(type: string): string {
    return `${this.qualifiedName}:${type}`;
  }

  parseNodeKey(key: string): { prefix: string; queueName: string; id: string } {
    return parseNodeKey(key);
  }

  clientName(suffix = ''): string {
    return `${this.prefix}:${Buffer.from(this.queueName).toString('base64')}${suffix}`;
  }

  // ---- adding ---------------------------------------------------------------

  addJob(job: JobJson, jobId: string, parentKeyOpts?: ParentKeyOpts): Promise<string> {
    return this.native.addJob(Date.now(), JSON.stringify(newJobJson(job, jobId, parentKeyOpts)));
  }

  addJobs(entries: { job: JobJson; jobId: string; parentKeyOpts?: ParentKeyOpts }[]): Promise<string[]> {
    const jobs = entries.map(e => newJobJson(e.job, e.jobId, e.parentKeyOpts));
    return this.native.addJobs(Date.now(), JSON.stringify(jobs));
  }

  async addFlow(
    entries: { jobData: JobJson; jobId: string; parentKeyOpts: ParentKeyOpts; prefix: string; queueName: string }[],
  ): Promise<[Error | null, string | number][]> {
    const nodes = entries.map(e => newJobJson(e.jobData, e.jobId, e.parentKeyOpts, e.queueName));
    // Each tree goes in atomically on its own; a refused one answers, per
    // node, BullMQ's code (or an error when BullMQ has none), as Redis does.
    const results: [string | null, string | number][] = JSON.parse(
      await this.native.addFlow(Date.now(), JSON.stringify(nodes)),
    );
    return results.map(([message, id]) => [message === null ? null : fromNative(new Error(message)), id]);
  }

  // ---- worker: fetch, locks, stalled ------------------------------------------

  async moveToActive(token: string, name?: string): Promise<any[]> {
    // Like a Redis connection still being set up, a new backend fetches only
    // once ready: a worker already waiting gets a just-added job first. One
    // that never became ready asks anyway: the store fails the call as it
    // failed the readiness, and that failure is reported as the others are.
    // (Awaited in a `try`, not through a `.catch()`: the promise that makes
    // is one more turn of the microtask queue before the first fetch, and
    // BullMQ's Worker then fetched every job of a burst before it started
    // any, so `cancelJob` right after their 'active' events found none it
    // tracked: BullMQ's "should handle rapid cancellations with high
    // concurrency".)
    if (!this.isReady) {
      try {
        await this.waitUntilReady();
      } catch {
        // Asked anyway, as said above.
      }
    }
    return JSON.parse(await this.native.moveToActive(Date.now(), token, name));
  }

  async waitForJob(blockTimeout: number): Promise<{ member: string; score: number } | null> {
    if (this.blockingDisconnected && !this.closing) throw disconnectedRead('waitForJob');
    const cuts = this.blockingCuts;
    const score = await this.native.waitForJob(Date.now(), blockTimeout);
    // The addon answers null for a wait that ran out and for one cut short.
    if (score === null || score === undefined) return this.blockingCuts === cuts ? null : INTERRUPTED_WAIT;
    // Redis marker members: "0" = a job is ready, "1" = next delayed due time.
    return { member: score === 0 ? '0' : '1', score };
  }

  extendLock(jobId: string, token: string, duration: number): Promise<number> {
    return this.native.extendLock(Date.now(), String(jobId), token, Number(duration));
  }

  extendLocks(jobIds: string[], tokens: string[], duration: number): Promise<string[]> {
    return this.native.extendLocks(Date.now(), jobIds, tokens, Number(duration));
  }

  moveStalledJobsToWait(): Promise<string[]> {
    return this.native.moveStalledJobsToWait(Date.now());
  }

  isMaxed(): Promise<boolean> {
    return this.native.isMaxed(Date.now());
  }

  // ---- finishing ---------------------------------------------------------------

  async moveToCompleted<T = any, R = any, N extends string = string>(
    job: MinimalJob<T, R, N>,
    returnValue: R,
    _removeOnComplete: boolean | number | KeepJobs,
    token: string,
    fetchNext: boolean,
  ): Promise<{ result: void | any[]; finishedOn: number }> {
    // The job's own removeOnComplete is stored with it; the worker's default
    // comes from the factory options. Both are applied in the core.
    const value = JSON.stringify(returnValue) ?? 'null';
    const done: FinishedResult = JSON.parse(
      await this.native.moveToCompleted(Date.now(), job.id!, value, token, fetchNext),
    );
    return { result: finishedNext(done.result), finishedOn: done.finishedOn };
  }

  async moveToFailed<T = any, R = any, N extends string = string>(
    job: MinimalJob<T, R, N>,
    failedReason: string,
    _removeOnFail: boolean | number | KeepJobs,
    token: string,
    fetchNext: boolean,
    fieldsToUpdate?: Record<string, any>,
  ): Promise<{ result: void | any[]; finishedOn: number }> {
    const fields = fieldsToUpdate ? JSON.stringify(fieldsToUpdate) : undefined;
    const done: FinishedResult = JSON.parse(
      await this.native.moveToFailed(Date.now(), job.id!, failedReason ?? '', token, fetchNext, fields),
    );
    return { result: finishedNext(done.result), finishedOn: done.finishedOn };
  }

  async moveToDelayed(
    jobId: string,
    timestamp: number,
    delay: number,
    token?: string,
    opts?: MoveToDelayedOpts,
  ): Promise<void | any[]> {
    const options = opts ? JSON.stringify(opts) : undefined;
    return JSON.parse(await this.native.moveToDelayed(Date.now(), String(jobId), timestamp, delay, token, options));
  }

  moveToWaitingChildren(jobId: string, token: string, opts: MoveToWaitingChildrenOpts = {}): Promise<boolean> {
    const child = opts.child ? `${opts.child.queue}:${opts.child.id}` : undefined;
    return this.native.moveToWaitingChildren(Date.now(), String(jobId), token, child);
  }

  moveJobFromActiveToWait(jobId: string, token?: string): Promise<number> {
    return this.native.moveJobFromActiveToWait(Date.now(), String(jobId), token);
  }

  async retryJob(jobId: string, _lifo: boolean, token?: string, opts?: RetryJobOpts): Promise<void> {
    const fields = opts?.fieldsToUpdate ? JSON.stringify(opts.fieldsToUpdate) : undefined;
    await this.native.retryJob(Date.now(), String(jobId), token, fields);
  }

  async retryFinishedJob<T = any, R = any, N extends string = string>(
    job: MinimalJob<T, R, N>,
    state: 'failed' | 'completed',
    opts: RetryOptions = {},
  ): Promise<void> {
    await this.native.retryFinishedJob(
      Date.now(),
      job.id!,
      state,
      !!opts.resetAttemptsMade,
      !!opts.resetAttemptsStarted,
    );
  }

  promote(jobId: string): Promise<void> {
    return this.native.promote(Date.now(), String(jobId));
  }

  changeDelay(jobId: string, delay: number): Promise<void> {
    return this.native.changeDelay(Date.now(), String(jobId), delay);
  }

  changePriority(jobId: string, priority = 0, lifo = false): Promise<void> {
    return this.native.changePriority(Date.now(), String(jobId), priority, lifo);
  }

  remove(jobId: string, removeChildren: boolean): Promise<number> {
    return this.native.remove(Date.now(), String(jobId), removeChildren);
  }

  removeUnprocessedChildren(jobId: string): Promise<void> {
    return this.native.removeUnprocessedChildren(Date.now(), String(jobId));
  }

  /** `parentKey` is the job's own, undefined when it has none (BullMQ's -5 then). */
  removeChildDependency(jobId: string, parentKey: string | undefined): Promise<boolean> {
    return this.native.removeChildDependency(Date.now(), String(jobId), parentKey);
  }

  // ---- job data --------------------------------------------------------------------

  updateData<T = any, R = any, N extends string = string>(job: MinimalJob<T, R, N>, data: T): Promise<void> {
    return this.native.updateData(Date.now(), job.id!, JSON.stringify(data) ?? '{}');
  }

  updateProgress(jobId: string, progress: JobProgress): Promise<void> {
    return this.native.updateProgress(Date.now(), String(jobId), progressText(progress));
  }

  async addLog(jobId: string, logRow: string, keepLogs?: number): Promise<number> {
    return this.native.addLog(Date.now(), String(jobId), logRowText(logRow), logRowsKept(keepLogs));
  }

  async clearLogs(jobId: string, keepLogs?: number): Promise<void> {
    const keep = keepLogs === undefined ? undefined : keptCount(keepLogs, 'keepLogs');
    return this.native.clearLogs(Date.now(), String(jobId), keep);
  }

  // ---- queue admin ---------------------------------------------------------------------

  pause(pause: boolean): Promise<void> {
    return this.native.pause(Date.now(), pause);
  }

  drain(delayed: boolean): Promise<void> {
    return this.native.drain(Date.now(), delayed);
  }

  cleanJobsByState(state: string, timestamp: number, limit?: number): Promise<string[]> {
    return this.native.cleanJobsByState(Date.now(), state, cleanBefore(timestamp), limit);
  }

  obliterate(opts: { force: boolean; count: number }): Promise<number> {
    return this.native.obliterate(Date.now(), !!opts.force, opts.count);
  }

  retryFinishedJobs(state: FinishedStatus = 'failed', count = 1000, timestamp = Date.now()): Promise<number> {
    return this.native.retryFinishedJobs(Date.now(), state, count, timestamp);
  }

  promoteJobs(count = 1000): Promise<number> {
    return this.native.promoteJobs(Date.now(), count);
  }

  /** Redis keyspace repair; an embedded store has no orphaned keys. */
  async removeOrphanedJobs(_count?: number, _limit?: number): Promise<number> {
    return 0;
  }

  /** The pre-v6 Redis `priority` key never exists here. */
  async removeDeprecatedPriorityKey(): Promise<number> {
    return 0;
  }

  // ---- getters ---------------------------------------------------------------------------

  async getState(jobId: string): Promise<JobState | 'unknown'> {
    return (await this.native.getState(Date.now(), String(jobId))) as JobState | 'unknown';
  }

  async isFinished(jobId: string, returnValue = false): Promise<number | [number, string]> {
    const job = JSON.parse(await this.native.isFinished(Date.now(), String(jobId))) as FinishedFields | null;
    return isFinishedAnswer(job ?? undefined, returnValue, `${this.qualifiedName}:${jobId}`);
  }

  isJobInState(state: string, jobId: string): Promise<boolean> {
    return this.native.isJobInState(Date.now(), state, String(jobId));
  }

  async getJobData(jobId: string): Promise<JobJson | undefined> {
    return parseJob(await this.native.getJobData(Date.now(), String(jobId)));
  }

  async getJobLogs(jobId: string, start: number, end: number, asc: boolean): Promise<{ logs: string[]; count: number }> {
    return JSON.parse(await this.native.getJobLogs(Date.now(), String(jobId), Number(start), Number(end), asc));
  }

  getCounts(types: JobType[], delayedTimestamp?: number): Promise<number[]> {
    // A type passed as an array (`getJobCounts(['waiting'])`) reads as its
    // text, as the remote backend's protobuf strings read it.
    return this.native.getCounts(Date.now(), types.map(String), delayedTimestamp);
  }

  getCountsPerPriority(priorities: number[]): Promise<number[]> {
    return this.native.getCountsPerPriority(Date.now(), priorities);
  }

  async getRanges(types: JobType[], start = 0, end = 1, asc = false): Promise<[string][]> {
    // Numbers given as text (a query string's) read as Redis reads them.
    const names = types.map(String) as JobType[];
    return (await this.native.getRanges(Date.now(), names, Number(start), Number(end), asc)) as unknown as [string][];
  }

  getDependencyCounts(jobId: string, types: string[]): Promise<number[]> {
    return this.native.getDependencyCounts(Date.now(), String(jobId), types);
  }

  async getDependencies(
    jobId: string,
    opts: DependenciesOpts = {},
  ): Promise<{
    nextFailedCursor?: number;
    failed?: string[];
    nextIgnoredCursor?: number;
    ignored?: Record<string, any>;
    nextProcessedCursor?: number;
    processed?: Record<string, any>;
    nextUnprocessedCursor?: number;
    unprocessed?: string[];
  }> {
    const all: ChildrenByCategory = JSON.parse(await this.native.getDependencies(Date.now(), String(jobId)));
    return dependenciesPage(all, opts);
  }

  async getProcessedChildrenValues(jobId: string): Promise<Record<string, string>> {
    return JSON.parse(await this.native.getProcessedChildrenValues(Date.now(), String(jobId)));
  }

  async getIgnoredChildrenFailures(jobId: string): Promise<Record<string, string>> {
    return JSON.parse(await this.native.getIgnoredChildrenFailures(Date.now(), String(jobId)));
  }

  getDeduplicationJobId(deduplicationId: string): Promise<string | null> {
    return this.native.getDeduplicationJobId(Date.now(), String(deduplicationId)).then(id => id ?? null);
  }

  getRateLimitTtl(maxJobs?: number): Promise<number> {
    return this.native.getRateLimitTtl(Date.now(), maxJobs);
  }

  async getMetrics(type: 'completed' | 'failed', start = 0, end = -1): Promise<[string[], string[], number]> {
    const rec = JSON.parse(await this.native.getMetrics(Date.now(), type, Number(start), Number(end))) as MetricsRecord | null;
    return metricsAnswer(rec ?? undefined);
  }

  /** One CLIENT LIST text with the names this process's backends of this store and namespace hold. */
  async getClientList(): Promise<string[]> {
    return clientListText(namedClients(this.clients));
  }

  /** `paginate` of `<qualifiedName>:<parentId>:dependencies` or `:processed`. */
  async paginate(
    key: string,
    opts: { start: number; end: number; fetchJobs?: boolean },
  ): Promise<{ cursor: string; items: { id: string; v?: any; err?: string }[]; total: number; jobs?: JobJson[] }> {
    const { parentId, processed } = paginateTarget(key, this.qualifiedName);
    const page: { cursor: string; items: [string, string | null][]; total: number; jobs?: string[] } = JSON.parse(
      await this.native.paginateChildren(Date.now(), parentId, processed, opts.start, opts.end, !!opts.fetchJobs),
    );
    return {
      cursor: page.cursor,
      total: page.total,
      items: page.items.map(([id, value]) => paginateItem(id, value, processed)),
      jobs: page.jobs?.map(job => JSON.parse(job) as JobJson),
    };
  }

  // ---- queue meta ----------------------------------------------------------------------------

  setQueueMeta(values: Record<string, string | number>): Promise<number> {
    return this.native.setQueueMeta(Date.now(), JSON.stringify(values));
  }

  async getQueueMetaField(field: string): Promise<string | null> {
    const [value] = await this.native.getQueueMetaFields(Date.now(), [field]);
    return value ?? null;
  }

  async getQueueMetaFields(fields: string[]): Promise<(string | null)[]> {
    return (await this.native.getQueueMetaFields(Date.now(), fields)).map(v => v ?? null);
  }

  async getQueueMeta(): Promise<Record<string, string>> {
    return JSON.parse(await this.native.getQueueMeta(Date.now()));
  }

  removeQueueMetaFields(fields: string[]): Promise<number> {
    return this.native.removeQueueMetaFields(Date.now(), fields);
  }

  async hasQueueMetaField(field: string): Promise<boolean> {
    return (await this.getQueueMetaField(field)) !== null;
  }

  // ---- rate limit, dedup ---------------------------------------------------------------------

  setRateLimit(expireTimeMs: number): Promise<void> {
    return this.native.setRateLimit(Date.now(), rateLimitMs(expireTimeMs));
  }

  removeRateLimitKey(): Promise<number> {
    return this.native.removeRateLimitKey(Date.now());
  }

  removeDeduplicationKey(deduplicationId: string, jobId: string): Promise<number> {
    return this.native.removeDeduplicationKey(Date.now(), String(deduplicationId), String(jobId));
  }

  deleteDeduplicationKey(deduplicationId: string): Promise<number> {
    return this.native.removeDeduplicationKey(Date.now(), String(deduplicationId), undefined);
  }

  // ---- events -----------------------------------------------------------------------------------

  async readEvents(id: string, blockTimeout: number): Promise<StreamReadRaw> {
    if (this.eventsDisconnected && !this.closing) throw disconnectedRead('readEvents');
    let from = id;
    if (id === '$' && this.eventsStart) {
      if (!this.isReady) await this.waitUntilReady();
      from = await this.eventsStart;
    }
    const entries = await this.native.readEvents(Date.now(), from, blockTimeout);
    if (!entries) return null;
    this.eventsStart = undefined;
    return [[this.toKey('events'), JSON.parse(entries)]] as unknown as StreamReadRaw;
  }

  async publishEvent(fields: Record<string, string | number>, maxEvents: number): Promise<string> {
    return this.native.publishEvent(Date.now(), JSON.stringify(fields), keptCount(maxEvents, 'maxEvents'));
  }

  async trimEvents(maxLength: number): Promise<number> {
    return this.native.trimEvents(Date.now(), keptCount(maxLength, 'maxLength'));
  }

  // ---- job schedulers -----------------------------------------------------------------------------

  async addJobScheduler(
    jobSchedulerId: string,
    nextMillis: number,
    templateData: string,
    templateOpts: JobsOptions,
    opts: RepeatableOptions,
    delayedJobOpts: JobsOptions,
    _producerId?: string,
  ): Promise<[string, number]> {
    const added = await this.native.addJobScheduler(
      Date.now(),
      jobSchedulerId,
      nextMillis ?? undefined,
      templateData,
      JSON.stringify(templateOpts ?? {}),
      JSON.stringify(schedulerRepeat(opts, delayedJobOpts, templateOpts)),
    );
    return added ? JSON.parse(added) : [undefined as unknown as string, 0];
  }

  async updateJobSchedulerNextMillis(
    jobSchedulerId: string,
    nextMillis: number,
    _templateData: string,
    delayedJobOpts: JobsOptions,
    producerId?: string,
  ): Promise<string | null> {
    const id = await this.native.updateJobSchedulerNextMillis(
      Date.now(),
      jobSchedulerId,
      nextMillis ?? undefined,
      JSON.stringify(delayedJobOpts ?? {}),
      producerId,
    );
    return id ?? null;
  }

  removeJobScheduler(jobSchedulerId: string): Promise<number> {
    return this.native.removeJobScheduler(Date.now(), jobSchedulerId);
  }

  async getJobScheduler(id: string): Promise<[any, string | null]> {
    const [hash, next] = JSON.parse(await this.native.getJobScheduler(Date.now(), id));
    return [hash ? Object.entries(hash).flat() : null, next];
  }

  async isJobScheduler(id: string): Promise<boolean> {
    const [hash] = JSON.parse(await this.native.getJobScheduler(Date.now(), id));
    return hash !== null;
  }

  async getJobSchedulerData(key: string): Promise<Record<string, string>> {
    const [hash] = JSON.parse(await this.native.getJobScheduler(Date.now(), key));
    return hash ?? {};
  }

  getJobSchedulersRange(start: number, end: number, asc: boolean): Promise<string[]> {
    return this.native.getJobSchedulersRange(Date.now(), Number(start), Number(end), asc);
  }

  getJobSchedulersCount(): Promise<number> {
    return this.native.getJobSchedulersCount(Date.now());
  }
}

/** Reads the factory options the core needs into the JSON the addon parses. */
export function backendOptionsJson(
  settings: LoamBackendSettings,
  queue: string,
  opts: FactoryOptions,
): string {
  checkWorkerNumbers(opts);
  // JSON has no Infinity (it writes null, "not set"): the largest number
  // reads as the largest count or time, and its negative as 0, as the remote
  // backend reads them.
  const finite = (_key: string, v: unknown) => (v === Infinity ? Number.MAX_VALUE : v === -Infinity ? -Number.MAX_VALUE : v);
  return JSON.stringify({
    ...settings,
    queue,
    name: opts.name,
    lockDuration: opts.lockDuration ?? WORKER_DEFAULTS.lockDuration,
    limiter: opts.limiter,
    maxStalledCount: opts.maxStalledCount ?? WORKER_DEFAULTS.maxStalledCount,
    metrics: opts.metrics,
    removeOnComplete: opts.removeOnComplete,
    removeOnFail: opts.removeOnFail,
  }, finite);
}

export type { FactoryOptions };
