/**
 * `RemoteQueueBackend`: BullMQ 6.7's `IQueueBackend` over `loam-jobs serve`.
 * Every member that touches queue state is one loam.jobs.v1 call (one
 * transaction or one snapshot read on the server); this file adapts
 * arguments and results, as `backend.ts` does for the in-process addon, and
 * `wire.ts` converts between BullMQ's shapes and the messages.
 *
 * Blocking reads (`waitForJob`, a QueueEvents' `readEvents`) are long-polls
 * of at most 30 s (the server's cap) that `disconnectBlocking`, `disconnect`
 * and `close` cut short by aborting the call, as does a deadline a little
 * past the wait (BullMQ's Redis backend has the same watchdog on BZPOPMIN).
 *
 * A server that cannot be reached fails calls with BullMQ's
 * `ConnectionClosedError`, which BullMQ retries; what a backend does on its
 * own (its worker name, a QueueEvents' start) it retries itself, so a backend
 * made before its server came up works once it has.
 */
import { randomBytes } from 'node:crypto';
import { EventEmitter, setMaxListeners } from 'node:events';
import { setTimeout as sleep } from 'node:timers/promises';
import type {
  DependenciesOpts,
  FinishedStatus,
  IQueueBackend,
  JobJson,
  JobProgress,
  JobsOptions,
  JobState as BullmqJobState,
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
import type { MessageInitShape } from '@bufbuild/protobuf';
import type { FactoryOptions } from './backend.js';
import type { CallOptions } from '@connectrpc/connect';
import { CallAborted, type CallHooks, type JobsClient, type RemoteChannel } from './channel.js';
import {
  disconnectedRead,
  clientListText,
  dependenciesPage,
  finishedNext,
  INTERRUPTED_WAIT,
  isFinishedAnswer,
  metricsAnswer,
  logRowText,
  keptCount,
  logRowsKept,
  checkWorkerNumbers,
  cleanBefore,
  newJobJson,
  rateLimitMs,
  paginateItem,
  paginateTarget,
  progressText,
  parseNodeKey,
  reportBackgroundError,
  schedulerRepeat,
  Siblings,
  WORKER_DEFAULTS,
  type ClientSeen,
  type NextJobTuple,
} from './common.js';
import { fromServer, isConnectionError, loamError, type BullmqCommand, type LoamErrorCode } from './errors.js';
import type {
  EnqueueResult,
  JobAdminRequestSchema,
  QueryRequestSchema,
  QueueAdminRequestSchema,
  ReportRequestSchema,
} from './gen/loam/jobs/v1/jobs_pb.js';
import {
  DependencyStatus,
  JobState,
  type CompleteOptionsSchema,
  type FenceSchema,
  type Job,
  type LeaseOptionsSchema,
  type OutcomeSchema,
  type RateLimitSchema,
  type RetentionSchema,
} from './gen/loam/jobs/v1/types_pb.js';
import {
  asJsonText,
  bytes,
  childrenByCategory,
  jobError,
  jobJson,
  jobSpec,
  nextJob,
  optionsSpec,
  retention,
  schedulerSpec,
  stateName,
  stateOf,
  streamEntry,
  text,
  u32,
  priority as wirePriority,
  priorityBand,
  u64,
  u64Sum,
  i64,
} from './wire.js';

type FenceInit = MessageInitShape<typeof FenceSchema>;
type LeaseOptionsInit = MessageInitShape<typeof LeaseOptionsSchema>;
/** Plain (not a message made with `create`): `complete` adds its key to it. */
type CompleteOptionsInit = Exclude<MessageInitShape<typeof CompleteOptionsSchema>, { $typeName: string }>;
type OutcomeInit = MessageInitShape<typeof OutcomeSchema>;
type QueryInit = NonNullable<MessageInitShape<typeof QueryRequestSchema>['query']>;
type QueueAdminInit = NonNullable<MessageInitShape<typeof QueueAdminRequestSchema>['op']>;
type JobAdminInit = NonNullable<MessageInitShape<typeof JobAdminRequestSchema>['op']>;
type ReportInit = NonNullable<MessageInitShape<typeof ReportRequestSchema>['report']>;

/** The server's longest wait for a long-poll, in ms. */
const MAX_WAIT_MS = 30_000;
/** Most events one `readEvents` returns. */
const EVENTS_PER_READ = 1000;
/**
 * How often a named client (a worker, `setName`) tells the server it is
 * still there: the server lists names seen in the last 5 minutes.
 */
const NAME_REFRESH_MS = 60_000;
/** How long a closing worker waits for the server to forget its name. */
const UNREGISTER_WAIT_MS = 1_000;
/**
 * How long past its wait a long-poll may go unanswered before it is given up
 * (see `RemoteChannel.longPoll`; BullMQ's watchdog on BZPOPMIN allows 1 s).
 */
const LONG_POLL_MARGIN_MS = 5_000;
/** The first and the longest pause between attempts of a backend's own call while the server cannot be reached. */
const RETRY_FIRST_MS = 100;
const RETRY_MOST_MS = 5_000;

/** The pause after `failures` failed attempts: doubling from the first, up to the longest. */
function retryDelay(failures: number): number {
  return Math.min(RETRY_MOST_MS, RETRY_FIRST_MS * 2 ** Math.min(failures, 16));
}

const ignore = (): undefined => undefined;

/** The worker settings BullMQ keeps out of the per-call arguments, read once from the factory options. */
interface WorkerSettings {
  lockDurationMs: bigint;
  limiter: MessageInitShape<typeof RateLimitSchema> | undefined;
  maxStalled: number;
  metricsMaxPoints: bigint | undefined;
  removeOnComplete: MessageInitShape<typeof RetentionSchema> | undefined;
  removeOnFail: MessageInitShape<typeof RetentionSchema> | undefined;
  name: string | undefined;
}

export function workerSettings(opts: FactoryOptions): WorkerSettings {
  checkWorkerNumbers(opts);
  const maxPoints = u64(opts.metrics?.maxDataPoints);
  return {
    lockDurationMs: u64(opts.lockDuration ?? WORKER_DEFAULTS.lockDuration),
    limiter:
      opts.limiter && u64(opts.limiter.max) > 0n
        ? { max: u64(opts.limiter.max), durationMs: u64(opts.limiter.duration) }
        : undefined,
    maxStalled: u32(opts.maxStalledCount ?? WORKER_DEFAULTS.maxStalledCount),
    metricsMaxPoints: maxPoints > 0n ? maxPoints : undefined,
    removeOnComplete: retention(opts.removeOnComplete),
    removeOnFail: retention(opts.removeOnFail),
    name: opts.name,
  };
}

/**
 * Redis lists one client per connection, so two workers of one queue with no
 * name both appear under the same client name and BullMQ counts two. The
 * server keeps a set of names; each backend registers its name with this
 * process-unique tag appended, and the tag is dropped again when listing.
 */
const INSTANCE_TAG = /#[0-9a-f]{12}$/;

function taggedName(name: string): string {
  return `${name}#${randomBytes(6).toString('hex')}`;
}

function untaggedName(name: string): string {
  return name.replace(INSTANCE_TAG, '');
}

/** BullMQ's way of acting without a lock: no token, or `"0"`. */
function isUnchecked(token: string | undefined): token is undefined | '' | '0' {
  return !token || token === '0';
}

/** BullMQ's token `"0"` (and no token) is an admin write with no lease check. */
function fence(token: string | undefined): FenceInit {
  return isUnchecked(token)
    ? { kind: { case: 'unchecked', value: true } }
    : { kind: { case: 'token', value: token } };
}

/**
 * The fence of a move made as the lease's holder (moveToFinished): only
 * `"0"` acts without a lock, as Redis's scripts skip the check for it; no
 * token is Redis's `""` (ioredis sends `undefined` so), which holds no
 * lock, so another worker's lock is refused (-6), not taken over. The
 * addon's `holder_fence` is the same.
 */
function holderFence(token: string | undefined): FenceInit {
  return token === '0' ? fence(token) : lockFence(token);
}

/**
 * The fence of a lock extension: Redis's extendLock compares the token as
 * it is, `"0"` too, so only the lock's holder extends it (the addon's
 * `lock_fence`).
 */
function lockFence(token: string | undefined): FenceInit {
  return { kind: { case: 'token', value: token ?? '' } };
}

function hasCode(err: unknown): err is Error & { code: LoamErrorCode } {
  return err instanceof Error && 'code' in err;
}

/**
 * A stop signal that every call of a backend may wait on at once: each call
 * waiting for a server that is away, and each long-poll, holds a listener on
 * it until its wait ends. Node warns of a leak past 10 listeners on one
 * signal, which every server restart under load printed.
 */
function sharedStop(): AbortController {
  const stop = new AbortController();
  setMaxListeners(0, stop.signal);
  return stop;
}

/**
 * A lease that expired, a job gone or not active: `extendLock` reports these
 * as "not extended" (0), as Redis does; anything else is a real failure.
 */
function isLockRefusal(err: unknown): boolean {
  if (!hasCode(err)) return false;
  return (
    typeof err.code === 'number' ||
    err.code === 'LOAM_NOT_FOUND' ||
    err.code === 'LOAM_FAILED_PRECONDITION' ||
    err.code === 'LOAM_DEADLINE_EXCEEDED'
  );
}

/**
 * A completion in flight. Plain, so that tracking one costs no promise on a
 * worker's hot path; `answered` is set only while a refused lease waits for it.
 */
interface InFlight {
  answered?: () => void;
}

export class RemoteQueueBackend extends EventEmitter implements IQueueBackend {
  closing: Promise<void> | undefined;
  /** The backend whose siblings this one is of (see the constructor's `family`). */
  private readonly family: RemoteQueueBackend | undefined;
  readonly keys: KeysMap = {};
  /** The server wakes waiters on its own notifications; any timeout works. */
  readonly minimumBlockTimeout = 0.001;
  /** The server caps a long-poll at 30 s; BullMQ then simply asks again. */
  readonly maximumBlockTimeout = MAX_WAIT_MS / 1000;

  /**
   * Cuts `waitForJob` short (`disconnectBlocking`, `close`), and stops the
   * calls waiting for a server that is away; replaced by `reconnectBlocking`.
   */
  private blocking = sharedStop();
  /** Cuts `readEvents` short (`disconnect`, `close`). */
  private readonly events = sharedStop();
  private readonly ready: Promise<void>;
  /** Where a QueueEvents started reading (`'$'` resolved at construction, or once the server answered). */
  private eventsStart: Promise<string> | undefined;
  private readonly siblings = new Siblings<RemoteQueueBackend>();
  /** This backend's completions in flight (see `completionsAnswered`). */
  private readonly completing = new Set<InFlight>();
  /** The next registration of the name this backend reports to the server's client list. */
  private clientNameTimer: NodeJS.Timeout | undefined;
  /** The name this backend registered, while it is registered. */
  private announced: string | undefined;
  /** Settles once every ordered write issued so far has been answered (see `send`). */
  private orderedWrites: Promise<void> = Promise.resolve();
  private orderedInFlight = 0;
  /** What this backend's keyed writes are told apart by on the server (see `keyed`): a prefix, then a count. */
  private readonly keyPrefix = `bullmq:${randomBytes(12).toString('base64url')}:`;
  private keyedWrites = 0;
  /** Settles once every resendable ordered write (add, report, queue setting) issued so far has been answered (see `send`). */
  private resendsAnswered: Promise<void> = Promise.resolve();
  /** The last ordered write issued: what the next one is sent behind (see `send`). */
  private lastOrdered: OrderedWrite = OrderedWrite.answered();

  constructor(
    private readonly channel: RemoteChannel,
    private readonly queueName: string,
    private readonly prefix: string,
    private readonly owner: boolean,
    private readonly settings: WorkerSettings,
    options: {
      blocking?: boolean;
      withBlockingConnection?: boolean;
      workerName?: string;
      /** A sibling's (`forQueue`): closed with it, as on Redis, where siblings share their owner's connection. */
      family?: RemoteQueueBackend;
    } = {},
  ) {
    super();
    if (owner) channel.retain();
    this.family = options.family;
    const started: Promise<unknown>[] = [];
    if (options.withBlockingConnection) {
      // Redis names a worker's blocking connection so getWorkers finds it.
      // Only getWorkers needs the name: ready once the server was asked,
      // whatever it answered (a failed registration is retried).
      const suffix = options.workerName ? `:w:${options.workerName}` : '';
      started.push(this.announce(this.clientName(suffix)));
    }
    if (options.blocking) {
      // A QueueEvents reads from "now": fix that point when it is created (and
      // be ready only then), so events written between its creation and its
      // first read are not lost. A server not up yet is asked again until it is.
      this.eventsStart = this.startOfEvents();
      started.push(this.eventsStart);
    }
    // Never rejects: BullMQ awaits it before finishing every job.
    this.ready = Promise.all(started.map(p => p.then(ignore, ignore))).then(ignore);
    queueMicrotask(() => this.emit('ready'));
  }

  // ---- calls ------------------------------------------------------------------

  /**
   * Runs one RPC. Over one Redis connection BullMQ's commands apply in call
   * order, awaited or not: a Queue's constructor writes its meta without
   * waiting, jobs added in a loop wait in that order. Concurrent calls on
   * HTTP/2 streams have no order, so writes that callers issue and leave
   * behind (adds, queue and job admin, schedulers, progress and logs) are
   * `ordered`: they reach the server in call order, and every other call
   * starts after the ordered writes issued before it were answered (a read
   * runs on the server at once, ahead of writes still queued there). A
   * worker's own calls (lease, extend, complete) do not wait for one another.
   *
   * An ordered write is sent as soon as the one before it was answered or
   * is on the session stream it goes on itself (one too large for the
   * session waits for the answer): the server starts a
   * stream's calls in the order they came, so `Promise.all` of adds costs
   * about one round trip, not one each. If the stream fails, the adds and
   * reports on it (`resendable`: the server knows one again by its key, see
   * `keyed`) and the queue settings (`setQueueMeta`, pause, a rate limit,
   * the chunks of retryJobs and promoteJobs: the same again) are
   * sent again, each behind the one before; the other writes
   * on it fail with `ConnectionClosedError` (their callers cannot know
   * whether they were applied). So any other write also waits for the
   * answers of the resendable ones before it: one of them sent again could
   * land after it. Calls that are not ordered are sent again when
   * `resendable` too: completions (keyed) and reads.
   *
   * A call of a Worker that cut its blocking calls (to close or pause) does
   * not wait for a server that is away, unless it records the outcome of the
   * job in hand (`recordsOutcome`): BullMQ's close and pause wait for that
   * job, and a completion given up at once left it active, to be run again
   * once its lock lapsed, where ioredis holds the command until Redis is
   * back. It waits as any call does, up to `reconnectTimeoutMs`.
   */
  private send<T>(
    command: BullmqCommand,
    rpc: (client: JobsClient, options: CallOptions) => Promise<T>,
    {
      ordered = false,
      resendable = false,
      signal,
      deadlineMs,
      recordsOutcome = false,
    }: { ordered?: boolean; resendable?: boolean; signal?: AbortSignal; deadlineMs?: number; recordsOutcome?: boolean } = {},
  ): Promise<T> {
    // As the in-process backend's closed store refuses it (a shutdown race in
    // the caller's code would otherwise still add work: the channel reconnects).
    if (this.closing ?? this.family?.closing) return Promise.reject(loamError('unavailable', 'the backend is closed'));
    const start = (hooks: CallHooks = {}) => {
      const stopRetrying = recordsOutcome ? undefined : this.blocking.signal;
      return deadlineMs === undefined || !signal
        ? this.channel.call(command, rpc, signal, { resendable, ...hooks, stopRetrying })
        : this.channel.longPoll(command, rpc, signal, deadlineMs, stopRetrying);
    };
    if (!ordered) return this.orderedInFlight === 0 ? start() : this.orderedWrites.then(() => start());
    this.orderedInFlight++;
    const before = this.lastOrdered;
    const write = new OrderedWrite();
    this.lastOrdered = write;
    const behind = () => before.followable(() => this.channel.liveStream);
    const addsAnswered = this.resendsAnswered;
    const sent = start({
      sentOn: stream => write.sentOn(stream),
      sendAfter: resendable ? behind : () => addsAnswered.then(behind),
      // Sent on a stream of its own, it is behind nothing on the session.
      unaryAfter: () => before.settled(),
      resendable,
    });
    const answered = () => {
      this.orderedInFlight--;
      write.answer();
    };
    const settled = sent.then(answered, answered);
    this.orderedWrites = Promise.all([this.orderedWrites, settled]).then(ignore);
    if (resendable) this.resendsAnswered = Promise.all([this.resendsAnswered, settled]).then(ignore);
    return this.channel.track(sent);
  }

  /**
   * One Query call; returns its result oneof. A long-poll (waiting `waitMs`)
   * is given up `LONG_POLL_MARGIN_MS` past its wait (see `RemoteChannel.longPoll`).
   * A read that does not wait is sent again when its connection is cut:
   * it changes nothing (ioredis sends a cut command again too).
   */
  private async query(command: BullmqCommand, query: QueryInit, signal?: AbortSignal, waitMs?: number) {
    const deadlineMs = waitMs === undefined ? undefined : waitMs + LONG_POLL_MARGIN_MS;
    const response = await this.send(command, (c, o) => c.query({ queue: this.queueName, query }, o), {
      signal,
      deadlineMs,
      resendable: waitMs === undefined,
    });
    return response.result;
  }

  /**
   * A key for one write, under which the server recognizes it sent again
   * after its connection was cut on its way (the answer may have been lost
   * after it was applied): it is not applied twice, and the first answer is
   * given again. The server keeps it as long as this client may send again.
   */
  private keyed() {
    return { key: `${this.keyPrefix}${++this.keyedWrites}`, ttlMs: BigInt(this.channel.resendWindowMs) };
  }

  /** The job `entry` as the server adds it, under a key of its own (see `keyed`). */
  private keyedSpec(entry: Parameters<typeof jobSpec>[0]) {
    return { ...jobSpec(entry), idempotency: this.keyed() };
  }

  /** A queue admin call, `ordered` unless it says otherwise (see `send`). */
  private async queueAdmin(command: BullmqCommand, op: QueueAdminInit, { ordered = true, resendable = false } = {}) {
    return this.send(command, (c, o) => c.queueAdmin({ queue: this.queueName, op }, o), { ordered, resendable });
  }

  private async jobAdmin(
    command: BullmqCommand & { jobId: string },
    op: JobAdminInit,
  ): Promise<boolean> {
    const response = await this.send(
      command,
      (c, o) => c.jobAdmin({ queue: this.queueName, jobId: command.jobId, op }, o),
      { ordered: true },
    );
    return response.done;
  }

  /** Ends the lease of `command.jobId` with `outcome`. */
  private async complete(
    command: BullmqCommand & { jobId: string },
    fence: FenceInit,
    outcome: OutcomeInit['kind'],
    options?: CompleteOptionsInit,
  ) {
    const inFlight: InFlight = {};
    this.completing.add(inFlight);
    // Keyed: a completion whose answer was lost is sent again, and the
    // server gives its first answer again, with the next job it leased
    // (else that job waited out its lock, stalled, and BullMQ reported the
    // job in hand's lock missing).
    const keyedOptions = { ...options, idempotency: this.keyed() };
    let r;
    try {
      r = await this.send(
        command,
        (c, o) =>
          c.complete(
            { queue: this.queueName, jobId: command.jobId, fence, outcome: { kind: outcome }, options: keyedOptions },
            o,
          ),
        { recordsOutcome: true, resendable: true },
      );
    } finally {
      this.completing.delete(inFlight);
      inFlight.answered?.();
    }
    // A next job (fetchNext) waits for the adds still on their way, as a lease does.
    if (r.completed?.next?.leases.length) await this.channel.writesAnswered();
    return r;
  }

  /** The job `id`, read in one snapshot, or undefined. */
  private async job(command: BullmqCommand, id: string): Promise<Job | undefined> {
    const r = await this.query(command, { case: 'jobs', value: { ids: [id] } });
    return r.case === 'jobs' ? r.value.slots[0]?.job : undefined;
  }

  private leaseOptions(token: string, name?: string): LeaseOptionsInit {
    return {
      max: 1,
      token,
      worker: name ?? this.settings.name,
      lockDurationMs: this.settings.lockDurationMs,
      limiter: this.settings.limiter,
    };
  }

  private completeOptions(token: string, fetchNext: boolean): CompleteOptionsInit {
    return {
      fetchNext: fetchNext ? this.leaseOptions(token) : undefined,
      removeOnComplete: this.settings.removeOnComplete,
      removeOnFail: this.settings.removeOnFail,
      metricsMaxPoints: this.settings.metricsMaxPoints,
    };
  }

  /**
   * Registers `name` in the server's client list, and again every minute
   * while open; a registration that failed is tried again, backing off.
   * Resolves (never rejects) once the first attempt was answered or failed.
   */
  private announce(name: string): Promise<void> {
    const previous = this.stopAnnouncing();
    const tagged = taggedName(name);
    this.announced = tagged;
    return Promise.all([previous, this.register(tagged, 0)]).then(ignore);
  }

  /** One registration of `name`, the next one scheduled when it settles; `failures` before it in a row. */
  private register(name: string, failures: number): Promise<void> {
    return this.queueAdmin({ command: 'setName' }, { case: 'registerWorker', value: { name } }).then(
      () => this.registerLater(name, NAME_REFRESH_MS, 0),
      err => {
        // An unreachable server is no news to the app; a refusal is.
        if (!isConnectionError(err)) reportBackgroundError(this, err);
        this.registerLater(name, retryDelay(failures), failures + 1);
      },
    );
  }

  private registerLater(name: string, afterMs: number, failures: number): void {
    // Not once the backend stopped announcing `name` (closed, or renamed).
    if (this.announced !== name) return;
    this.clientNameTimer = setTimeout(() => void this.register(name, failures), afterMs);
    this.clientNameTimer.unref();
  }

  /**
   * Stops refreshing the announced name and has the server forget it (as
   * Redis forgets a closed connection's name). A server that cannot be
   * reached forgets it within five minutes anyway, so that is no error.
   */
  private stopAnnouncing(): Promise<void> {
    clearTimeout(this.clientNameTimer);
    this.clientNameTimer = undefined;
    const name = this.announced;
    this.announced = undefined;
    if (name === undefined) return Promise.resolve();
    return this.queueAdmin({ command: 'setName' }, { case: 'unregisterWorker', value: { name } }).then(
      () => undefined,
      () => undefined,
    );
  }

  // ---- lifecycle ------------------------------------------------------------

  waitUntilReady(): Promise<void> {
    return this.ready;
  }

  close(_force?: boolean): Promise<void> {
    if (!this.closing) {
      // Closed once the server forgot this worker's name, so getWorkers no
      // longer lists it, but not held up long by a server that is gone.
      const forgotten = Promise.race([this.stopAnnouncing(), sleep(UNREGISTER_WAIT_MS, undefined, { ref: false })]);
      this.blocking.abort();
      this.events.abort();
      if (this.owner) this.channel.release();
      this.closing = forgotten.then(() => {
        this.emit('close');
      });
    }
    return this.closing;
  }

  async disconnect(): Promise<void> {
    this.blocking.abort();
    this.events.abort();
  }

  async setName(name: string): Promise<void> {
    await this.announce(name);
  }

  async disconnectBlocking(_wait?: boolean): Promise<void> {
    this.blocking.abort();
  }

  async reconnectBlocking(): Promise<void> {
    if (!this.closing && this.blocking.signal.aborted) this.blocking = sharedStop();
  }

  // ---- identity -------------------------------------------------------------

  forQueue(queueName: string, prefix?: string): IQueueBackend {
    const p = prefix ?? this.prefix;
    // Made once its owner is closed (BullMQ makes them for the Jobs of a
    // FlowProducer closed right after an add), a sibling's calls are refused.
    return this.siblings.get(
      queueName,
      p,
      () => new RemoteQueueBackend(this.channel, queueName, p, false, this.settings, { family: this.family ?? this }),
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

  async addJob(job: JobJson, jobId: string, parentKeyOpts?: ParentKeyOpts): Promise<string> {
    const entry = newJobJson(job, jobId, parentKeyOpts);
    const command = { command: 'addJob', parentKey: entry.parentKey };
    if (entry.addToWaitingChildren) {
      // Only a flow node is stored waiting for children; a one-node flow is that.
      const job = this.keyedSpec(entry);
      const r = await this.send(
        command,
        (c, o) => c.flow({ nodes: [{ queue: this.queueName, job, waitChildren: true }] }, o),
        { ordered: true, resendable: true },
      );
      return r.enqueued[0]?.id ?? '';
    }
    // Under a key of its own, the add may be sent again when its connection
    // fails on the way: the server answers a repeat with the job the first
    // made, so no add is lost or made twice, and adds left un-awaited need
    // not wait for each other's answers (see `send`).
    const spec = this.keyedSpec(entry);
    const r = await this.send(command, (c, o) => c.enqueue({ queue: this.queueName, job: spec }, o), {
      ordered: true,
      resendable: true,
    });
    return r.enqueued?.id ?? '';
  }

  /**
   * Every job or none; the first job refused fails the call, as in-process.
   * Under one key for the call (the server keeps one record for it, where a
   * key for each job cost one a job): sent again after its connection failed
   * on the way, the bulk adds none twice. Each job under a key of its own too
   * until the server has said it keeps the call's (`bulkKeysKept`).
   */
  async addJobs(entries: { job: JobJson; jobId: string; parentKeyOpts?: ParentKeyOpts }[]): Promise<string[]> {
    const jobs = entries.map(e => newJobJson(e.job, e.jobId, e.parentKeyOpts));
    const specs = this.channel.bulkKeysKept ? jobs.map(jobSpec) : jobs.map(entry => this.keyedSpec(entry));
    const bulk = { queue: this.queueName, jobs: specs, allOrNothing: true, idempotency: this.keyed() };
    const r = await this.send({ command: 'addJob' }, (c, o) => c.enqueueBulk(bulk, o), {
      ordered: true,
      resendable: true,
    });
    if (r.keyKept) this.channel.bulkKeysKept = true;
    return r.results.map((result, i) => {
      if (result.result.case === 'enqueued') return result.result.value.id;
      throw refusal(result, jobs[i].parentKey);
    });
  }

  async addFlow(
    entries: { jobData: JobJson; jobId: string; parentKeyOpts: ParentKeyOpts; prefix: string; queueName: string }[],
  ): Promise<[Error | null, string | number][]> {
    const jobs = entries.map(e => newJobJson(e.jobData, e.jobId, e.parentKeyOpts, e.queueName));
    const nodes = jobs.map((entry, i) => ({
      queue: entries[i].queueName || this.queueName,
      job: this.keyedSpec(entry),
      waitChildren: entry.addToWaitingChildren,
    }));
    // Every tree goes in at once, in BullMQ's order; a refused one leaves the
    // others in and answers, per node, BullMQ's code (or an error when BullMQ
    // has none), as Redis does.
    // Each node under a key of its own, as an add: sent again, the flow adds
    // none twice.
    const r = await this.send({ command: 'addJob' }, (c, o) => c.flow({ nodes, eachTree: true }, o), {
      ordered: true,
      resendable: true,
    });
    return r.results.map((result, i): [Error | null, string | number] => {
      if (result.result.case === 'enqueued') return [null, result.result.value.id];
      const error = refusal(result, jobs[i].parentKey);
      return hasCode(error) && typeof error.code === 'number' ? [null, error.code] : [error, 0];
    });
  }

  // ---- worker: fetch, locks, stalled ------------------------------------------

  async moveToActive(token: string, name?: string): Promise<any[]> {
    // Sent again when its connection is cut, as ioredis sends a cut command
    // again: failed, it made BullMQ's Worker wait out its runRetryDelay (15 s)
    // after every restart of the server. A job a lost answer took stays
    // active until its lock lapses and it is found stalled, as it would if
    // this call failed.
    const r = await this.send(
      { command: 'moveToActive' },
      (c, o) => c.lease({ queue: this.queueName, options: this.leaseOptions(token, name), waitMs: 0 }, o),
      { resendable: true },
    );
    if (r.leased?.leases.length) await this.channel.writesAnswered();
    else if (r.leased?.info && r.leased.info.rateLimitMs > 0n) await this.completionsAnswered();
    return nextJob(r.leased);
  }

  /**
   * Settles once the completions in flight when it was called were answered,
   * and then a turn of the event loop, so their callers see any job their
   * fetchNext took first. The server answers a lease refused by the rate
   * limiter at once, before an earlier completion whose fetchNext took the
   * window's last job (it waits for its commit), where Redis answers in
   * order; BullMQ's worker, seeing the refusal with nothing else ready,
   * sleeps out the window with that job in hand (BullMQ's suite, "should
   * respect processing time without adding limiter delay").
   */
  private completionsAnswered(): Promise<void> {
    if (this.completing.size === 0) return Promise.resolve();
    const waitingFor = [...this.completing];
    return new Promise<void>(resolve => {
      let left = waitingFor.length;
      const one = () => {
        if (--left === 0) setImmediate(resolve);
      };
      for (const inFlight of waitingFor) {
        const before = inFlight.answered;
        inFlight.answered = before
          ? () => {
              before();
              one();
            }
          : one;
      }
    });
  }

  /** Resolves once a job may be ready, or null on timeout, interrupt or deadline. */
  async waitForJob(blockTimeout: number): Promise<{ member: string; score: number } | null> {
    if (this.blocking.signal.aborted && !this.closing) throw disconnectedRead('waitForJob');
    const waitMs = Math.min(MAX_WAIT_MS, u32(blockTimeout * 1000));
    try {
      const r = await this.query(
        { command: 'waitForJob' },
        { case: 'waitForJob', value: { waitMs } },
        this.blocking.signal,
        waitMs,
      );
      // Redis' marker member "0" with score 0: a job is ready now.
      return r.case === 'flag' && r.value ? { member: '0', score: 0 } : null;
    } catch (err) {
      if (err instanceof CallAborted) return INTERRUPTED_WAIT;
      throw err;
    }
  }

  async extendLock(jobId: string, token: string, duration: number): Promise<number> {
    try {
      await this.send({ command: 'extendLock', jobId }, (c, o) =>
        c.extend({ queue: this.queueName, items: [{ jobId, fence: lockFence(token) }], durationMs: u64(Number(duration)) }, o),
      );
      return 1;
    } catch (err) {
      if (isLockRefusal(err)) return 0;
      throw err;
    }
  }

  /** The ids whose lock could not be extended. */
  async extendLocks(jobIds: string[], tokens: string[], duration: number): Promise<string[]> {
    if (jobIds.length === 0) return [];
    if (jobIds.length === 1) {
      // With one item the server answers with that item's error, not a list.
      return (await this.extendLock(jobIds[0], tokens[0], duration)) ? [] : [jobIds[0]];
    }
    const items = jobIds.map((jobId, i) => ({ jobId, fence: lockFence(tokens[i]) }));
    const r = await this.send({ command: 'extendLocks' }, (c, o) =>
      c.extend({ queue: this.queueName, items, durationMs: u64(Number(duration)) }, o),
    );
    return r.failedJobIds;
  }

  /**
   * Applies the worker's `maxStalledCount` to the queue, then reclaims
   * expired leases and returns their ids (the Worker emits `stalled` for them).
   */
  async moveStalledJobsToWait(): Promise<string[]> {
    // A worker's own, and awaited: not ordered, so that a worker's first
    // fetch, issued as its first sweep, does not wait a write's fsync behind
    // it. (Jobs added meanwhile would all come to its first fetches, and
    // BullMQ's loop takes every job it finds before it runs any.)
    const r = await this.queueAdmin(
      { command: 'moveStalledJobsToWait' },
      { case: 'sweepStalled', value: { maxStalled: this.settings.maxStalled } },
      { ordered: false },
    );
    return r.jobIds;
  }

  async isMaxed(): Promise<boolean> {
    const r = await this.query({ command: 'isMaxed' }, { case: 'isMaxed', value: true });
    return r.case === 'flag' && r.value;
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
    // travels in the options. Both are applied on the server.
    const value = JSON.stringify(returnValue) ?? 'null';
    const r = await this.complete(
      { command: 'moveToFinished', jobId: job.id!, state: 'active' },
      holderFence(token),
      { case: 'success', value: { result: bytes(value) } },
      this.completeOptions(token, fetchNext),
    );
    return this.finished(r.completed, fetchNext);
  }

  async moveToFailed<T = any, R = any, N extends string = string>(
    job: MinimalJob<T, R, N>,
    failedReason: string,
    _removeOnFail: boolean | number | KeepJobs,
    token: string,
    fetchNext: boolean,
    fieldsToUpdate?: Record<string, any>,
  ): Promise<{ result: void | any[]; finishedOn: number }> {
    const r = await this.complete(
      { command: 'moveToFinished', jobId: job.id!, state: 'active' },
      holderFence(token),
      { case: 'fail', value: { error: jobError(failedReason ?? '', fieldsToUpdate), deadLetter: false } },
      this.completeOptions(token, fetchNext),
    );
    return this.finished(r.completed, fetchNext);
  }

  private finished(
    completed: { finishedOn?: bigint; next?: Parameters<typeof nextJob>[0] } | undefined,
    fetchNext: boolean,
  ): { result: NextJobTuple | []; finishedOn: number } {
    return {
      result: finishedNext(fetchNext && completed?.next ? nextJob(completed.next) : undefined),
      finishedOn: completed?.finishedOn !== undefined ? Number(completed.finishedOn) : Date.now(),
    };
  }

  /**
   * A retry after a backoff (an attempt is spent) or, with `skipAttempt`, a
   * manual delay. Returns the next-job tuple when `fetchNext` claimed one,
   * else `[]` (what the Redis adapter returns).
   */
  async moveToDelayed(
    jobId: string,
    timestamp: number,
    delay: number,
    token?: string,
    opts: MoveToDelayedOpts = {},
  ): Promise<void | any[]> {
    const outcome: OutcomeInit['kind'] = opts.skipAttempt
      ? { case: 'delay', value: { until: u64Sum(u64(timestamp), u64(delay)), delayMs: u64(delay) } }
      : {
          case: 'retry',
          value: {
            error: opts.fieldsToUpdate ? jobError(undefined, opts.fieldsToUpdate) : undefined,
            afterMs: u64(delay),
          },
        };
    const r = await this.complete(
      { command: 'moveToDelayed', jobId, state: 'active' },
      fence(token),
      outcome,
      this.completeOptions(token ?? '', !!opts.fetchNext),
    );
    const next = r.completed?.next;
    return next && next.leases.length > 0 ? nextJob(next) : [];
  }

  /** True when the job now waits for children (with `opts.child`, for that one). */
  async moveToWaitingChildren(jobId: string, token: string, opts: MoveToWaitingChildrenOpts = {}): Promise<boolean> {
    const child = opts.child ? `${opts.child.queue}:${opts.child.id}` : undefined;
    const r = await this.complete({ command: 'moveToWaitingChildren', jobId, state: 'active' }, fence(token), {
      case: 'waitChildren',
      value: { child },
    });
    return !!r.completed?.moved;
  }

  /** A processor's RateLimitError: the job goes back; returns the queue's rate-limit ttl. */
  async moveJobFromActiveToWait(jobId: string, token?: string): Promise<number> {
    // A limiter with max 0 is "none": only a global or manual limit counts.
    const limiter = this.settings.limiter ?? { max: 0n, durationMs: 0n };
    // Without a lock token, a job that is not active is left where it is and
    // the ttl answered, in the same call (the core's rule for such a release).
    const r = await this.send({ command: 'moveJobFromActiveToWait', jobId, state: 'active' }, (c, o) =>
      c.complete(
        {
          queue: this.queueName,
          jobId,
          fence: fence(token),
          outcome: { kind: { case: 'release', value: {} } },
          rateLimitTtlFor: limiter,
        },
        o,
      ),
    );
    return Number(r.rateLimitTtlMs ?? 0n);
  }

  /** An immediate retry (an attempt is spent). */
  async retryJob(jobId: string, _lifo: boolean, token?: string, opts?: RetryJobOpts): Promise<void> {
    const error = opts?.fieldsToUpdate ? jobError(undefined, opts.fieldsToUpdate) : undefined;
    await this.complete({ command: 'retryJob', jobId, state: 'active' }, fence(token), {
      case: 'retry',
      value: { error, afterMs: 0n },
    });
  }

  async retryFinishedJob<T = any, R = any, N extends string = string>(
    job: MinimalJob<T, R, N>,
    state: 'failed' | 'completed',
    opts: RetryOptions = {},
  ): Promise<void> {
    // Any other state is sent as it is, for the core to refuse, as the addon does.
    const from = stateOf(state) ?? JobState.UNSPECIFIED;
    await this.jobAdmin(
      { command: 'reprocessJob', jobId: job.id!, state },
      {
        case: 'retryFinished',
        value: {
          state: from,
          resetAttemptsMade: !!opts.resetAttemptsMade,
          resetAttemptsStarted: !!opts.resetAttemptsStarted,
        },
      },
    );
  }

  async promote(jobId: string): Promise<void> {
    await this.jobAdmin({ command: 'promote', jobId, state: 'delayed' }, { case: 'promote', value: true });
  }

  async changeDelay(jobId: string, delay: number): Promise<void> {
    await this.jobAdmin(
      { command: 'changeDelay', jobId, state: 'delayed' },
      { case: 'changeDelay', value: { delayMs: u64(delay) } },
    );
  }

  async changePriority(jobId: string, priority = 0, lifo = false): Promise<void> {
    await this.jobAdmin(
      { command: 'changePriority', jobId },
      { case: 'changePriority', value: { priority: wirePriority(priority), lifo } },
    );
  }

  /** 1 when removed (or already gone), 0 when it or a child is locked. */
  async remove(jobId: string, removeChildren: boolean): Promise<number> {
    const done = await this.jobAdmin({ command: 'removeJob', jobId }, { case: 'remove', value: { removeChildren } });
    return done ? 1 : 0;
  }

  async removeUnprocessedChildren(jobId: string): Promise<void> {
    await this.jobAdmin(
      { command: 'removeUnprocessedChildren', jobId },
      { case: 'removeUnprocessedChildren', value: true },
    );
  }

  /** `parentKey` is the job's own, undefined when it has none (BullMQ's -5 then). */
  removeChildDependency(jobId: string, parentKey: string | undefined): Promise<boolean> {
    return this.jobAdmin(
      { command: 'removeChildDependency', jobId, parentKey },
      { case: 'removeChildDependency', value: { parentKey } },
    );
  }

  // ---- job data --------------------------------------------------------------------

  /**
   * BullMQ's token-less writes to a job: no lease is checked. Keyed, so one
   * cut on its way is sent again, not failed (a processor's updateProgress
   * throwing failed its job), and a log line is not added twice.
   */
  private async report(
    command: BullmqCommand & { jobId: string },
    report: ReportInit,
  ): Promise<number> {
    const idempotency = this.keyed();
    const r = await this.send(
      command,
      (c, o) =>
        c.report({ queue: this.queueName, jobId: command.jobId, fence: fence(undefined), report, idempotency }, o),
      { ordered: true, resendable: true },
    );
    return Number(r.logCount);
  }

  async updateData<T = any, R = any, N extends string = string>(job: MinimalJob<T, R, N>, data: T): Promise<void> {
    await this.report({ command: 'updateData', jobId: job.id! }, { case: 'data', value: bytes(JSON.stringify(data) ?? '{}') });
  }

  async updateProgress(jobId: string, progress: JobProgress): Promise<void> {
    await this.report({ command: 'updateProgress', jobId }, { case: 'progress', value: progressText(progress) });
  }

  async addLog(jobId: string, logRow: string, keepLogs?: number): Promise<number> {
    return this.report({ command: 'addLog', jobId }, { case: 'log', value: { row: logRowText(logRow), keep: u64(logRowsKept(keepLogs)) } });
  }

  async clearLogs(jobId: string, keepLogs?: number): Promise<void> {
    const keep = keepLogs === undefined ? undefined : u64(keptCount(keepLogs, 'keepLogs'));
    await this.jobAdmin({ command: 'clearLogs', jobId }, { case: 'clearLogs', value: { keep } });
  }

  // ---- queue admin ---------------------------------------------------------------------

  // Pausing, resuming, a rate limit and each chunk of retryJobs and
  // promoteJobs are sent again when their answer is lost: a repeat leaves
  // what the first try did (a chunk acts on what is left, and its `more` says
  // so), as ioredis sends a cut command again. Drain and clean are not: a
  // repeat would remove jobs added since. Nor is obliterate: its last chunk
  // removes the queue, its pause with it, and a repeat is refused as a queue
  // not paused (BullMQ's obliterate pauses first, so calling it again works).

  async pause(pause: boolean): Promise<void> {
    await this.queueAdmin(
      { command: 'pause' },
      pause ? { case: 'pause', value: true } : { case: 'resume', value: true },
      { resendable: true },
    );
  }

  async drain(delayed: boolean): Promise<void> {
    await this.queueAdmin({ command: 'drain' }, { case: 'drain', value: { delayed } });
  }

  async cleanJobsByState(state: string, timestamp: number, limit?: number): Promise<string[]> {
    const r = await this.queueAdmin(
      { command: 'cleanJobsByState' },
      { case: 'clean', value: { state, before: u64(cleanBefore(timestamp)), limit: u64(limit) } },
    );
    return r.jobIds;
  }

  /** 1 while jobs remain (call again), 0 once the queue is gone. */
  async obliterate(opts: { force: boolean; count: number }): Promise<number> {
    const r = await this.queueAdmin(
      { command: 'obliterate' },
      { case: 'obliterate', value: { force: !!opts.force, count: u64(opts.count) } },
    );
    return r.more ? 1 : 0;
  }

  async retryFinishedJobs(state: FinishedStatus = 'failed', count = 1000, timestamp = Date.now()): Promise<number> {
    const from = state === 'completed' ? JobState.COMPLETED : JobState.FAILED;
    const r = await this.queueAdmin(
      { command: 'retryJobs' },
      { case: 'retryJobs', value: { state: from, count: u64(count), before: u64(timestamp) } },
      { resendable: true },
    );
    return r.more ? 1 : 0;
  }

  async promoteJobs(count = 1000): Promise<number> {
    const r = await this.queueAdmin(
      { command: 'promoteJobs' },
      { case: 'promoteJobs', value: { count: u64(count) } },
      { resendable: true },
    );
    return r.more ? 1 : 0;
  }

  /** Redis keyspace repair; the core's store has no orphaned keys. */
  async removeOrphanedJobs(_count?: number, _limit?: number): Promise<number> {
    return 0;
  }

  /** The pre-v6 Redis `priority` key never exists here. */
  async removeDeprecatedPriorityKey(): Promise<number> {
    return 0;
  }

  // ---- getters ---------------------------------------------------------------------------

  async getState(jobId: string): Promise<BullmqJobState | 'unknown'> {
    const job = await this.job({ command: 'getState', jobId }, jobId);
    return (job ? stateName(job.state) : 'unknown') as BullmqJobState | 'unknown';
  }

  /** BullMQ's `code` or `[code, value]`: -1 missing, 0 not finished, 1 completed, 2 failed. */
  async isFinished(jobId: string, returnValue = false): Promise<number | [number, string]> {
    const job = await this.job({ command: 'isFinished', jobId }, jobId);
    const finished = job && {
      state: stateName(job.state),
      returnValue: job.returnValue !== undefined ? asJsonText(text(job.returnValue)) : undefined,
      failedReason: job.failedReason,
    };
    return isFinishedAnswer(finished, returnValue, `${this.qualifiedName}:${jobId}`);
  }

  async isJobInState(state: string, jobId: string): Promise<boolean> {
    // BullMQ 6 never fills the legacy `paused` list.
    if (state === 'paused') return false;
    const wanted = stateOf(state);
    if (wanted === undefined) throw loamError('invalid_argument', `Unknown job state: ${state}`);
    const job = await this.job({ command: 'isJobInState', jobId }, jobId);
    return job?.state === wanted;
  }

  async getJobData(jobId: string): Promise<JobJson | undefined> {
    const job = await this.job({ command: 'getJobData', jobId }, jobId);
    return job ? jobJson(job) : undefined;
  }

  async getJobLogs(jobId: string, start: number, end: number, asc: boolean): Promise<{ logs: string[]; count: number }> {
    const r = await this.query(
      { command: 'getJobLogs', jobId },
      { case: 'logs', value: { jobId, start: i64(start), end: i64(end), asc } },
    );
    return r.case === 'logs' ? { logs: r.value.logs, count: Number(r.value.count) } : { logs: [], count: 0 };
  }

  async getCounts(types: JobType[], delayedTimestamp?: number): Promise<number[]> {
    const delayedBefore = delayedTimestamp === undefined ? undefined : u64(delayedTimestamp);
    const r = await this.query({ command: 'getCounts' }, { case: 'counts', value: { types, delayedBefore } });
    return r.case === 'counts' ? r.value.counts.map(Number) : types.map(() => 0);
  }

  async getCountsPerPriority(priorities: number[]): Promise<number[]> {
    const r = await this.query(
      { command: 'getCountsPerPriority' },
      // A priority no job can have (below 0, not whole) counts none, as on Redis.
      { case: 'countsPerPriority', value: { priorities: priorities.map(priorityBand) } },
    );
    return r.case === 'counts' ? r.value.counts.map(Number) : priorities.map(() => 0);
  }

  /**
   * Ids per type. For BullMQ's list types (`wait`, `active`) an ascending
   * page is returned newest-first, because its caller reverses those (Redis
   * LRANGE order).
   */
  async getRanges(types: JobType[], start = 0, end = 1, asc = false): Promise<[string][]> {
    const r = await this.query(
      { command: 'getRanges' },
      { case: 'ranges', value: { types, start: i64(start), end: i64(end), asc } },
    );
    const lists = r.case === 'ranges' ? r.value.ranges : [];
    return types.map((type, i) => {
      const ids = [...(lists[i]?.ids ?? [])];
      const state = stateOf(type);
      if (asc && (state === JobState.WAITING || state === JobState.ACTIVE)) ids.reverse();
      return ids;
    }) as unknown as [string][];
  }

  /**
   * A parent's children, read in one snapshot: every one, or a page of those
   * of one status (positions `start..=end` as `paginate` takes them) with how
   * many there are of it.
   */
  private async dependencies(
    command: BullmqCommand,
    jobId: string,
    page: { status?: DependencyStatus; start?: number; end?: number; withJobs?: boolean } = {},
  ) {
    const { status, start, end, withJobs = false } = page;
    const r = await this.query(command, {
      case: 'dependencies',
      value: {
        jobId,
        withJobs,
        status,
        start: start === undefined ? undefined : i64(start),
        end: end === undefined ? undefined : i64(end),
      },
    });
    return r.case === 'dependencies' ? r.value : { dependencies: [], jobs: [], total: 0n };
  }

  async getDependencyCounts(jobId: string, types: string[]): Promise<number[]> {
    const { dependencies } = await this.dependencies({ command: 'getDependencyCounts', jobId }, jobId);
    const count = (status: DependencyStatus) => dependencies.filter(d => d.status === status).length;
    return types.map(type => {
      switch (type) {
        case 'processed':
          return count(DependencyStatus.PROCESSED);
        case 'unprocessed':
          return count(DependencyStatus.PENDING);
        case 'ignored':
          return count(DependencyStatus.IGNORED);
        default:
          return count(DependencyStatus.FAILED);
      }
    });
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
    const { dependencies } = await this.dependencies({ command: 'getDependencies', jobId }, jobId);
    return dependenciesPage(childrenByCategory(dependencies), opts);
  }

  /** Child key → value of the children in `status`, keys in order. */
  private async childrenValues(command: string, jobId: string, status: DependencyStatus): Promise<Record<string, string>> {
    const { dependencies } = await this.dependencies({ command, jobId }, jobId, { status });
    // The status filtered again: a server older than the filter sends every child.
    const entries = dependencies
      .filter(d => d.status === status)
      .map(d => [d.key, d.value ?? 'null'] as [string, string])
      .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
    return Object.fromEntries(entries);
  }

  getProcessedChildrenValues(jobId: string): Promise<Record<string, string>> {
    return this.childrenValues('getProcessedChildrenValues', jobId, DependencyStatus.PROCESSED);
  }

  getIgnoredChildrenFailures(jobId: string): Promise<Record<string, string>> {
    return this.childrenValues('getIgnoredChildrenFailures', jobId, DependencyStatus.IGNORED);
  }

  async getDeduplicationJobId(deduplicationId: string): Promise<string | null> {
    const r = await this.query(
      { command: 'getDeduplicationJobId' },
      { case: 'dedupJob', value: { dedupId: deduplicationId } },
    );
    return r.case === 'dedupJob' && r.value ? r.value : null;
  }

  async getRateLimitTtl(maxJobs?: number): Promise<number> {
    const r = await this.query(
      { command: 'getRateLimitTtl' },
      { case: 'rateLimitTtl', value: { maxJobs: maxJobs === undefined ? undefined : u64(maxJobs) } },
    );
    return r.case === 'ttlMs' ? Number(r.value) : -2;
  }

  /** `[[count, prevTS, prevCount], data[start..=end], total]`. */
  async getMetrics(type: 'completed' | 'failed', start = 0, end = -1): Promise<[string[], string[], number]> {
    // No other kind is ever recorded: Redis and the in-process backend answer
    // one with no metrics, where the server refuses it.
    if (type !== 'completed' && type !== 'failed') return metricsAnswer(undefined);
    const value = { kind: type, start: i64(Number(start)), end: i64(Number(end)) };
    const r = await this.query({ command: 'getMetrics' }, { case: 'metrics', value });
    return metricsAnswer(r.case === 'metrics' ? r.value : undefined);
  }

  /** The names the server saw recently for this queue, as one CLIENT LIST text. */
  async getClientList(): Promise<string[]> {
    const r = await this.query({ command: 'getClientList' }, { case: 'workers', value: true });
    if (r.case !== 'names') return clientListText([]);
    // A server without `workers` gives the names alone.
    const clients: ClientSeen[] =
      r.value.workers.length > 0
        ? r.value.workers.map(w => ({
            name: untaggedName(w.name),
            addr: w.addr || undefined,
            ageMs: Number(w.ageMs),
            idleMs: Number(w.idleMs),
          }))
        : r.value.names.map(name => ({ name: untaggedName(name) }));
    return clientListText(clients);
  }

  /** `paginate` of a parent's pending (`:dependencies`) or processed (`:processed`) children. */
  async paginate(
    key: string,
    opts: { start: number; end: number; fetchJobs?: boolean },
  ): Promise<{ cursor: string; items: { id: string; v?: any; err?: string }[]; total: number; jobs?: JobJson[] }> {
    const { parentId, processed } = paginateTarget(key, this.qualifiedName);
    const fetchJobs = !!opts.fetchJobs;
    const { dependencies, jobs, total } = await this.dependencies({ command: 'paginate', jobId: parentId }, parentId, {
      status: processed ? DependencyStatus.PROCESSED : DependencyStatus.PENDING,
      start: opts.start,
      end: opts.end,
      withJobs: fetchJobs,
    });
    return {
      cursor: '0',
      total: Number(total),
      items: dependencies.map(d => paginateItem(d.key, d.value, processed)),
      jobs: fetchJobs ? jobs.flatMap(({ job }) => (job ? [jobJson(job)] : [])) : undefined,
    };
  }

  // ---- queue meta ----------------------------------------------------------------------------

  async setQueueMeta(values: Record<string, string | number>): Promise<number> {
    const strings = Object.fromEntries(
      Object.entries(values).map(([k, v]) => [k, typeof v === 'string' ? v : JSON.stringify(v)]),
    );
    // Setting the same values again changes nothing, so a cut one is sent
    // again, as ioredis sends a cut command again (only the count of fields
    // new to the hash may then read 0, and BullMQ does not use it).
    const r = await this.queueAdmin(
      { command: 'setQueueMeta' },
      { case: 'setMeta', value: { values: strings } },
      { resendable: true },
    );
    return Number(r.count);
  }

  /** The meta fields asked for (an empty list asks for all of them). */
  private async meta(fields: string[]): Promise<Record<string, string>> {
    const r = await this.query({ command: 'getQueueMeta' }, { case: 'meta', value: { fields } });
    return r.case === 'meta' ? r.value.values : {};
  }

  async getQueueMetaField(field: string): Promise<string | null> {
    return (await this.meta([field]))[field] ?? null;
  }

  async getQueueMetaFields(fields: string[]): Promise<(string | null)[]> {
    if (fields.length === 0) return [];
    const values = await this.meta(fields);
    return fields.map(f => values[f] ?? null);
  }

  getQueueMeta(): Promise<Record<string, string>> {
    return this.meta([]);
  }

  async removeQueueMetaFields(fields: string[]): Promise<number> {
    const r = await this.queueAdmin({ command: 'removeQueueMetaFields' }, { case: 'removeMetaFields', value: { fields } });
    return Number(r.count);
  }

  async hasQueueMetaField(field: string): Promise<boolean> {
    return (await this.getQueueMetaField(field)) !== null;
  }

  // ---- rate limit, dedup ---------------------------------------------------------------------

  async setRateLimit(expireTimeMs: number): Promise<void> {
    await this.queueAdmin(
      { command: 'setRateLimit' },
      { case: 'setRateLimit', value: { ms: u64(rateLimitMs(expireTimeMs)) } },
      { resendable: true },
    );
  }

  async removeRateLimitKey(): Promise<number> {
    const r = await this.queueAdmin({ command: 'removeRateLimitKey' }, { case: 'removeRateLimitKey', value: true });
    return Number(r.count);
  }

  /** Removes the dedup key only while it still names `jobId`. */
  async removeDeduplicationKey(deduplicationId: string, jobId: string): Promise<number> {
    const r = await this.queueAdmin(
      { command: 'removeDeduplicationKey' },
      { case: 'removeDedupKey', value: { dedupId: deduplicationId, jobId } },
    );
    return Number(r.count);
  }

  async deleteDeduplicationKey(deduplicationId: string): Promise<number> {
    const r = await this.queueAdmin(
      { command: 'removeDeduplicationKey' },
      { case: 'removeDedupKey', value: { dedupId: deduplicationId } },
    );
    return Number(r.count);
  }

  // ---- events -----------------------------------------------------------------------------------

  /**
   * Where a QueueEvents starts reading: the newest event's id now. Asked
   * again, backing off, while the server cannot be reached (so a QueueEvents
   * made before its server came up works once it has); `close` ends that.
   */
  private async startOfEvents(): Promise<string> {
    for (let failures = 0; ; failures++) {
      try {
        const r = await this.query({ command: 'readEvents' }, { case: 'lastEvent', value: true }, this.events.signal);
        return `0-${r.case === 'number' ? r.value : 0n}`;
      } catch (err) {
        if (!isConnectionError(err)) throw err;
      }
      await sleep(retryDelay(failures), undefined, { signal: this.events.signal, ref: false }).catch(() => {
        throw new CallAborted();
      });
    }
  }

  /** The start fixed at construction; one that failed (a refusal) is asked for again by the next read. */
  private async eventsFrom(start: Promise<string>): Promise<string> {
    try {
      return await start;
    } catch (err) {
      if (this.eventsStart === start && !(err instanceof CallAborted)) {
        this.eventsStart = this.startOfEvents();
        this.eventsStart.catch(ignore);
      }
      throw err;
    }
  }

  /** The entries after `id` (`$` = from now), in XREAD's shape, or null when none came in time. */
  async readEvents(id: string, blockTimeout: number): Promise<StreamReadRaw> {
    if (this.events.signal.aborted && !this.closing) throw disconnectedRead('readEvents');
    // 0 (or less) waits until an event comes, as Redis's `XREAD BLOCK 0`
    // does (here the longest wait, asked again); a read answered at once had
    // the QueueEvents ask again at once, for ever.
    const waitMs = blockTimeout > 0 ? Math.min(MAX_WAIT_MS, u32(blockTimeout)) : MAX_WAIT_MS;
    let events;
    try {
      const from = id === '$' && this.eventsStart ? await this.eventsFrom(this.eventsStart) : id;
      const r = await this.query(
        { command: 'readEvents' },
        { case: 'events', value: { afterId: from, limit: EVENTS_PER_READ, waitMs } },
        this.events.signal,
        waitMs,
      );
      events = r.case === 'events' ? r.value.events : [];
    } catch (err) {
      if (err instanceof CallAborted) return null;
      throw err;
    }
    if (events.length === 0) return null;
    this.eventsStart = undefined;
    return [[this.toKey('events'), events.map(streamEntry)]] as unknown as StreamReadRaw;
  }

  async publishEvent(fields: Record<string, string | number>, maxEvents: number): Promise<string> {
    let name = '';
    const rest: { key: string; value: string }[] = [];
    for (const [key, raw] of Object.entries(fields)) {
      const value = typeof raw === 'string' ? raw : JSON.stringify(raw);
      if (key === 'event') name = value;
      else rest.push({ key, value });
    }
    const r = await this.queueAdmin(
      { command: 'publishEvent' },
      { case: 'publishEvent', value: { name, fields: rest, maxEvents: u64(keptCount(maxEvents, 'maxEvents')) } },
    );
    return r.eventId;
  }

  async trimEvents(maxLength: number): Promise<number> {
    const r = await this.queueAdmin({ command: 'trimEvents' }, { case: 'trimEvents', value: { maxLength: u64(keptCount(maxLength, 'maxLength')) } });
    return Number(r.count);
  }

  // ---- job schedulers -----------------------------------------------------------------------------

  /** `[jobId, delay]` of the next iteration, or `[undefined, 0]` when the scheduler has run out. */
  async addJobScheduler(
    jobSchedulerId: string,
    nextMillis: number,
    templateData: string,
    templateOpts: JobsOptions,
    opts: RepeatableOptions,
    delayedJobOpts: JobsOptions,
    _producerId?: string,
  ): Promise<[string, number]> {
    const spec = schedulerSpec(
      jobSchedulerId,
      nextMillis ?? undefined,
      templateData,
      (templateOpts ?? {}) as Record<string, any>,
      schedulerRepeat(opts, delayedJobOpts, templateOpts),
    );
    const r = await this.send(
      { command: 'addJobScheduler', jobId: jobSchedulerId },
      (c, o) => c.schedule({ queue: this.queueName, schedule: { case: 'upsert', value: spec } }, o),
      { ordered: true },
    );
    return r.jobId !== undefined ? [r.jobId, Number(r.delayMs)] : [undefined as unknown as string, 0];
  }

  /** The next iteration's id, or null (the scheduler ran out, or `producerId` was not current). */
  async updateJobSchedulerNextMillis(
    jobSchedulerId: string,
    nextMillis: number,
    _templateData: string,
    delayedJobOpts: JobsOptions,
    producerId?: string,
  ): Promise<string | null> {
    const advance = {
      id: jobSchedulerId,
      nextMillis: nextMillis === undefined || nextMillis === null ? undefined : u64(nextMillis),
      producerId: producerId ?? '',
      job: optionsSpec((delayedJobOpts ?? {}) as Record<string, any>),
    };
    const r = await this.send(
      { command: 'updateJobScheduler', jobId: jobSchedulerId },
      (c, o) => c.schedule({ queue: this.queueName, schedule: { case: 'advance', value: advance } }, o),
      { ordered: true },
    );
    return r.jobId ?? null;
  }

  /** 0 when the scheduler existed, 1 when it did not (the Lua script's convention). */
  async removeJobScheduler(jobSchedulerId: string): Promise<number> {
    const r = await this.send(
      { command: 'removeJobScheduler' },
      (c, o) => c.unschedule({ queue: this.queueName, schedulerId: jobSchedulerId }, o),
      { ordered: true },
    );
    return r.removed ? 0 : 1;
  }

  /** A scheduler as BullMQ reads its Redis hash `repeat:<id>`, with its next run. */
  private async schedulerHash(id: string): Promise<[Record<string, string> | null, string | null]> {
    const r = await this.query({ command: 'getJobScheduler' }, { case: 'scheduler', value: { id } });
    const s = r.case === 'scheduler' ? r.value.scheduler : undefined;
    if (!s) return [null, null];
    const hash: Record<string, string> = { name: s.name, ic: String(s.iterationCount) };
    if (s.limit !== undefined) hash.limit = String(s.limit);
    if (s.startDate !== undefined) hash.startDate = String(s.startDate);
    if (s.endDate !== undefined) hash.endDate = String(s.endDate);
    if (s.tz !== undefined) hash.tz = s.tz;
    if (s.pattern !== undefined) hash.pattern = s.pattern;
    if (s.everyMs !== undefined) hash.every = String(s.everyMs);
    if (s.offsetMs !== undefined) hash.offset = String(s.offsetMs);
    if (s.templateData && s.templateData !== '{}') hash.data = s.templateData;
    if (s.templateOpts && s.templateOpts !== '{}') hash.opts = s.templateOpts;
    return [hash, String(s.nextMillis)];
  }

  async getJobScheduler(id: string): Promise<[any, string | null]> {
    const [hash, next] = await this.schedulerHash(id);
    return [hash ? Object.entries(hash).flat() : null, next];
  }

  async isJobScheduler(id: string): Promise<boolean> {
    return (await this.schedulerHash(id))[0] !== null;
  }

  async getJobSchedulerData(key: string): Promise<Record<string, string>> {
    return (await this.schedulerHash(key))[0] ?? {};
  }

  /** `[id, next, id, next, ...]` by next run. */
  async getJobSchedulersRange(start: number, end: number, asc: boolean): Promise<string[]> {
    const r = await this.query(
      { command: 'getJobSchedulersRange' },
      { case: 'schedulers', value: { start: i64(start), end: i64(end), asc } },
    );
    const list = r.case === 'schedulers' ? r.value.schedulers : [];
    return list.flatMap(s => [s.id, String(s.nextMillis)]);
  }

  async getJobSchedulersCount(): Promise<number> {
    const r = await this.query({ command: 'getJobSchedulersCount' }, { case: 'schedulerCount', value: true });
    return r.case === 'number' ? Number(r.value) : 0;
  }
}

/**
 * An ordered write as the next one sees it (see `RemoteQueueBackend.send`):
 * that one may be sent once this one is answered, or while this one's last
 * attempt is on the session stream it would go on itself, since the server
 * starts the calls of a stream in the order they came.
 */
class OrderedWrite {
  private done = false;
  /** The session stream this write's last attempt went on, if its connection was made. */
  private stream: number | undefined;
  private wake!: () => void;
  private changed = this.next();

  static answered(): OrderedWrite {
    const write = new OrderedWrite();
    write.answer();
    return write;
  }

  sentOn(stream: number | undefined): void {
    this.stream = stream;
    this.wake();
  }

  answer(): void {
    this.done = true;
    this.wake();
  }

  /** Settles once this write was answered. */
  async settled(): Promise<void> {
    while (!this.done) await this.changed;
  }

  /** Settles once a write may be sent behind this one on the session; `liveStream` says where it would go now. */
  async followable(liveStream: () => number | undefined): Promise<void> {
    // A stream that failed fails this write too, which then answers or is
    // sent again: either wakes this loop.
    while (!this.done && (this.stream === undefined || this.stream !== liveStream())) await this.changed;
  }

  private next(): Promise<void> {
    return new Promise<void>(resolve => {
      this.wake = () => {
        this.changed = this.next();
        resolve();
      };
    });
  }
}

/** The error of a job a per-job call (EnqueueBulk, a Flow of several trees) did not add. */
function refusal(result: EnqueueResult, parentKey: string | undefined): Error {
  const failure = result.result.case === 'error' ? result.result.value : undefined;
  const detail = failure?.detail;
  return fromServer(
    {
      code: failure?.code ?? 'unknown',
      message: failure?.message ?? 'the job was not added',
      reason: detail?.reason,
      bullmqCode: detail?.bullmqCode,
      subject: detail?.subject,
    },
    { command: 'addJob', parentKey },
  );
}
