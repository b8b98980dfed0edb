/**
 * BullMQ's shapes ⇄ loam.jobs.v1 messages, for the remote backend. The
 * in-process addon does the same conversions in Rust
 * (`crates/loam-jobs-napi/src/convert.rs`); the rules here are the same, so a
 * job added through either backend is stored alike.
 *
 * 64-bit fields are `bigint` in the generated code; BullMQ's are numbers
 * (milliseconds and counts, well inside 2^53), converted at this edge.
 */
import type { MessageInitShape } from '@bufbuild/protobuf';
import type { JobJson, KeepJobs } from 'bullmq';
import type { NewJobJson, NextJobTuple } from './common.js';
import type { Event } from './gen/loam/jobs/v1/events_pb.js';
import {
  BackoffKind,
  DependencyStatus,
  JobState,
  OnChildFailure,
  type Dependency,
  type Job,
  type JobSpec,
  type JobSpecSchema,
  type Leased,
  type RetentionSchema,
  type SchedulerSpecSchema,
} from './gen/loam/jobs/v1/types_pb.js';
import type { ChildrenByCategory } from './common.js';
import { loamError } from './errors.js';

/** A JobSpec as a plain init object (never a built message, so it can be spread). */
export type JobSpecInit = Exclude<MessageInitShape<typeof JobSpecSchema>, JobSpec>;
type RetentionInit = MessageInitShape<typeof RetentionSchema>;

/**
 * A number BullMQ passes as a uint64, read as the in-process addon reads it:
 * a float is floored, one that is negative or NaN becomes 0 (none: 0), and
 * `Infinity` or one past the largest uint64 becomes the largest, so "for
 * ever" or "keep all" stays that (read as 0, `Infinity` turned a retention
 * into "remove at once"; past the largest, the call failed with no code).
 * Anything else, a string of digits too, is refused, as the in-process addon
 * refuses it: taken as 0 it dropped a worker's limiter or a job's delay
 * without a word.
 */
export function u64(n: unknown): bigint {
  const whole = wholeOrZero(n);
  return whole >= 2 ** 64 ? U64_MAX : BigInt(whole);
}

/** `a + b` as a uint64, at most the largest (a time plus an infinite delay is "for ever"). */
export function u64Sum(a: bigint, b: bigint): bigint {
  const sum = a + b;
  return sum > U64_MAX ? U64_MAX : sum;
}

/** As [`u64`], for uint32 fields. */
export function u32(n: unknown): number {
  return Math.min(wholeOrZero(n), 0xffff_ffff);
}

/**
 * A position in a range as an int64, as the in-process addon reads it: NaN
 * is 0, a float is truncated, and one past either end of the int64s is that
 * end (`BigInt` threw on NaN, and the encoder on one past the end, with no code).
 */
export function i64(n: number): bigint {
  if (Number.isNaN(n)) return 0n;
  if (n >= 2 ** 63) return I64_MAX;
  if (n < -(2 ** 63)) return -I64_MAX - 1n;
  return BigInt(Math.trunc(n));
}

const U64_MAX = 2n ** 64n - 1n;
const I64_MAX = 2n ** 63n - 1n;

function wholeOrZero(n: unknown): number {
  if (n === undefined || n === null) return 0;
  if (typeof n !== 'number') {
    const given = typeof n === 'string' ? `the string ${JSON.stringify(n)}` : `a value of type ${typeof n}`;
    throw loamError('invalid_argument', `expected a number, got ${given}`);
  }
  return n > 0 ? Math.floor(n) : 0;
}

function optU64(n: unknown): bigint | undefined {
  return n === undefined || n === null ? undefined : u64(n);
}

const utf8 = new TextEncoder();
const fromUtf8 = new TextDecoder();

export function bytes(text: string): Uint8Array {
  return utf8.encode(text);
}

export function text(data: Uint8Array): string {
  return fromUtf8.decode(data);
}

// ---- inputs ----------------------------------------------------------------

/** BullMQ's `removeOnComplete` / `removeOnFail`: `true`, `false`, a count or `KeepJobs` (age in seconds). */
export function retention(keep: boolean | number | KeepJobs | null | undefined): RetentionInit | undefined {
  if (keep === undefined || keep === null) return undefined;
  if (keep === true) return { policy: { case: 'removeImmediately', value: true } };
  if (keep === false) return { policy: { case: 'keepAll', value: true } };
  if (typeof keep === 'number') {
    // BullMQ's `-1` (any negative count) keeps everything.
    return keep < 0 ? { policy: { case: 'keepAll', value: true } } : { policy: { case: 'keep', value: { count: u64(keep) } } };
  }
  if (typeof keep !== 'object') return undefined;
  const { age, limit: most } = keep as { age?: number; limit?: number };
  const count = typeof keep.count === 'number' && keep.count >= 0 ? u64(keep.count) : undefined;
  const ageMs = typeof age === 'number' ? u64(age * 1000) : undefined;
  const limit = typeof most === 'number' ? u64(most) : undefined;
  if (count === undefined && ageMs === undefined && limit === undefined) {
    return { policy: { case: 'keepAll', value: true } };
  }
  return { policy: { case: 'keep', value: { count, ageMs, limit } } };
}

/** BullMQ's `backoff`; custom strategies have none here (their delays arrive with each retry). */
function backoff(opt: unknown): JobSpecInit['backoff'] {
  if (typeof opt === 'number') return { kind: BackoffKind.FIXED, delayMs: u64(opt) };
  if (!opt || typeof opt !== 'object') return undefined;
  const { type, delay, jitter } = opt as { type?: string; delay?: number; jitter?: number };
  const kind = type === 'fixed' ? BackoffKind.FIXED : type === 'exponential' ? BackoffKind.EXPONENTIAL : undefined;
  return kind === undefined ? undefined : { kind, delayMs: u64(delay), jitter: jitter ?? 0 };
}

function onChildFailure(opts: Record<string, any>): OnChildFailure {
  if (opts.failParentOnFailure) return OnChildFailure.FAIL_PARENT;
  if (opts.continueParentOnFailure) return OnChildFailure.CONTINUE_PARENT;
  if (opts.ignoreDependencyOnFailure) return OnChildFailure.IGNORE;
  if (opts.removeDependencyOnFailure) return OnChildFailure.REMOVE;
  return OnChildFailure.UNSPECIFIED;
}

/** `<prefix>:<queue>` → its parts (queue names cannot hold `:`, so the last one splits). */
/** As the addon's `split_qualified`: a key with no `:` is all prefix, and names no queue. */
function splitQualified(queueKey: string): { prefix: string; queue: string } {
  const at = queueKey.lastIndexOf(':');
  return at === -1 ? { prefix: queueKey, queue: '' } : { prefix: queueKey.slice(0, at), queue: queueKey.slice(at + 1) };
}

type Check = (value: any) => boolean;
const isNumber: Check = v => typeof v === 'number';
const isBool: Check = v => typeof v === 'boolean';
const isString: Check = v => typeof v === 'string';
const isObject: Check = v => typeof v === 'object' && v !== null && !Array.isArray(v);
/** Absent, null, or what `check` wants. */
const optional = (check: Check): Check => v => v === undefined || v === null || check(v);
/** Absent, or what `check` wants (null refused: a field with a default, not an option). */
const defaulted = (check: Check): Check => v => v === undefined || check(v);
const fields =
  (shape: Record<string, Check>): Check =>
  v =>
    isObject(v) && Object.entries(shape).every(([key, check]) => check(v[key]));
const keep: Check = v =>
  isBool(v) || isNumber(v) || fields({ age: optional(isNumber), count: optional(isNumber), limit: optional(isNumber) })(v);

/**
 * The types of the job options the backend acts on, as the in-process addon
 * reads them (`JobOpts` in `crates/loam-jobs-napi/src/convert.rs`): an option
 * of another type (`attempts: '3'`) is refused there, and here, instead of
 * being read as 0.
 */
const OPTION_TYPES: Record<string, Check> = {
  jobId: optional(isString),
  delay: optional(isNumber),
  priority: optional(isNumber),
  lifo: optional(isBool),
  attempts: optional(isNumber),
  backoff: optional(
    v => isNumber(v) || fields({ type: isString, delay: optional(isNumber), jitter: optional(isNumber) })(v),
  ),
  removeOnComplete: optional(keep),
  removeOnFail: optional(keep),
  deduplication: optional(
    fields({
      id: optional(isString),
      ttl: optional(isNumber),
      extend: defaulted(isBool),
      replace: defaulted(isBool),
      keepLastIfActive: defaulted(isBool),
      reschedule: defaulted(isBool),
    }),
  ),
  parent: optional(fields({ id: isString, queue: isString })),
  failParentOnFailure: defaulted(isBool),
  continueParentOnFailure: defaulted(isBool),
  ignoreDependencyOnFailure: defaulted(isBool),
  removeDependencyOnFailure: defaulted(isBool),
  keepLogs: optional(isNumber),
  timestamp: optional(isNumber),
};

/** Refuses job options of the wrong types, as the in-process backend does (`LOAM_INVALID_ARGUMENT`). */
function checkOptionTypes(opts: Record<string, any>): void {
  for (const [name, check] of Object.entries(OPTION_TYPES)) {
    if (!check(opts[name])) {
      throw loamError(
        'invalid_argument',
        `job options are not valid BullMQ options: ${name} cannot be ${JSON.stringify(opts[name])}`,
      );
    }
  }
}

/** Whole priorities, BullMQ's PRIORITY_LIMIT at most: the core refuses more. */
const MAX_PRIORITY = 2 ** 21 - 1;

/**
 * A priority a caller gives now (an add, a change of priority), as the server
 * takes it. BullMQ's own check stops only those above its limit; one below 0
 * is refused here, as in-process, rather than sent as 0. Options stored
 * earlier (a scheduler's template, `optionsSpec`) are read as before, below 0
 * as 0: refusing them would stop the scheduler at its next iteration.
 */
export function priority(n: number | undefined | null): number {
  // NaN too: Redis refuses it, and read as 0 it dropped the priority.
  if (typeof n === 'number' && !(n >= 0)) {
    throw loamError('invalid_argument', `priority must be between 0 and ${MAX_PRIORITY}, got ${n}`);
  }
  return u32(n);
}

/** The band `getCountsPerPriority` counts for `p`: one no job is in for a priority no job can have (below 0, not whole). */
export function priorityBand(p: number): number {
  const band = u32(p);
  return Number.isInteger(p) && p >= 0 ? band : 0xffff_ffff;
}

/** Everything BullMQ's job options alone decide (a scheduler's template too). */
export function optionsSpec(opts: Record<string, any>): JobSpecInit & { delayMs: bigint; priority: number } {
  checkOptionTypes(opts);
  const dedup = opts.deduplication;
  return {
    opts: JSON.stringify(opts),
    delayMs: u64(opts.delay),
    priority: u32(opts.priority),
    lifo: !!opts.lifo,
    attempts: u32(opts.attempts),
    backoff: backoff(opts.backoff),
    onChildFailure: onChildFailure(opts),
    removeOnComplete: retention(opts.removeOnComplete),
    removeOnFail: retention(opts.removeOnFail),
    keepLogs: optU64(opts.keepLogs),
    timestamp: optU64(opts.timestamp),
    dedup:
      dedup && typeof dedup.id === 'string'
        ? {
            id: dedup.id,
            ttlMs: u64(dedup.ttl) > 0n ? u64(dedup.ttl) : undefined,
            extend: !!dedup.extend,
            replace: !!dedup.replace,
            keepLastIfActive: !!dedup.keepLastIfActive,
            reschedule: !!dedup.reschedule,
          }
        : undefined,
  };
}

/** A new job as the server's Enqueue takes it. */
export function jobSpec(job: NewJobJson): JobSpecInit {
  // As in-process: BullMQ's JavaScript passes on any value, and the name of
  // `add(undefined)` would travel as "".
  if (typeof job.name !== 'string') {
    throw loamError('invalid_argument', `a job name must be a string, got ${job.name === null ? 'null' : typeof job.name}`);
  }
  const opts = job.opts ?? {};
  priority(opts.priority);
  const base = optionsSpec(opts);
  // An empty custom id means "no custom id" (the core makes one).
  const jobId = job.jobId || (typeof opts.jobId === 'string' ? opts.jobId : '') || undefined;
  const parentOf = job.parent
    ? { ...splitQualified(job.parent.queueKey), id: job.parent.id ?? '' }
    : opts.parent
      ? { ...splitQualified(String(opts.parent.queue)), id: String(opts.parent.id) }
      : undefined;
  return {
    ...base,
    name: job.name,
    data: bytes(job.data ?? '{}'),
    jobId,
    delayMs: job.delay !== undefined && job.delay !== null ? u64(job.delay) : base.delayMs,
    priority: job.priority !== undefined && job.priority !== null ? priority(job.priority) : base.priority,
    timestamp: job.timestamp !== undefined && job.timestamp !== null ? u64(job.timestamp) : base.timestamp,
    parent: parentOf,
    schedulerId: job.repeatJobKey || undefined,
  };
}

/** BullMQ's repeat options and template as a scheduler upsert. */
export function schedulerSpec(
  id: string,
  nextMillis: number | undefined,
  templateData: string,
  templateOpts: Record<string, any>,
  repeat: Record<string, any>,
): MessageInitShape<typeof SchedulerSpecSchema> {
  const date = (d: unknown) => (d === undefined || d === null ? undefined : u64(new Date(d as string | number).getTime()));
  const optsText = JSON.stringify(templateOpts ?? {});
  return {
    id,
    name: typeof repeat.name === 'string' ? repeat.name : '',
    pattern: repeat.pattern ?? undefined,
    everyMs: optU64(repeat.every),
    offsetMs: optU64(repeat.offset),
    tz: repeat.tz ?? undefined,
    startDate: date(repeat.startDate),
    endDate: date(repeat.endDate),
    limit: optU64(repeat.limit),
    count: optU64(repeat.count),
    nextMillis: optU64(nextMillis),
    templateData,
    templateOpts: optsText,
    job: optionsSpec(templateOpts ?? {}),
  };
}

/** BullMQ's `fieldsToUpdate` on a failure or retry: the reason and the whole stack array. */
export function jobError(
  reason: string | undefined,
  fields: Record<string, any> | undefined,
): { message: string; stacktraces?: { traces: string[] } } {
  // BullMQ's array replaces the job's stack traces whole, as on Redis.
  let traces: string[] | undefined;
  if (typeof fields?.stacktrace === 'string') {
    try {
      const parsed: unknown = JSON.parse(fields.stacktrace);
      traces = Array.isArray(parsed) ? parsed.filter((t): t is string => typeof t === 'string') : [];
    } catch {
      traces = [];
    }
  }
  return {
    message: reason ?? (typeof fields?.failedReason === 'string' ? fields.failedReason : ''),
    stacktraces: traces && { traces },
  };
}

// ---- outputs ---------------------------------------------------------------

const STATE_NAMES: Record<JobState, string> = {
  [JobState.UNSPECIFIED]: 'unknown',
  [JobState.WAITING]: 'waiting',
  [JobState.PRIORITIZED]: 'prioritized',
  [JobState.DELAYED]: 'delayed',
  [JobState.ACTIVE]: 'active',
  [JobState.WAITING_CHILDREN]: 'waiting-children',
  [JobState.COMPLETED]: 'completed',
  [JobState.FAILED]: 'failed',
};

export function stateName(state: JobState): string {
  return STATE_NAMES[state] ?? 'unknown';
}

/** BullMQ's state names (and its `wait` alias) back to the enum. */
const STATE_OF: ReadonlyMap<string, JobState> = new Map([
  ['wait', JobState.WAITING],
  ...Object.entries(STATE_NAMES)
    .map(([state, name]) => [name, Number(state) as JobState] as const)
    .filter(([, state]) => state !== JobState.UNSPECIFIED),
]);

/** BullMQ's state name (`wait` too) as the enum, or undefined. */
export function stateOf(name: string): JobState | undefined {
  return STATE_OF.get(name);
}

/** Stored JSON text as a value, or `fallback` when it is missing or not JSON. */
function jsonOr(source: string | undefined, fallback: unknown): unknown {
  if (source === undefined || source === '') return fallback;
  try {
    return JSON.parse(source);
  } catch {
    return fallback;
  }
}

function nodeKey(p: { prefix: string; queue: string; id: string }): string {
  return p.prefix ? `${p.prefix}:${p.queue}:${p.id}` : `${p.queue}:${p.id}`;
}

/**
 * Stored text as JSON text: as it is when it is JSON, else as a JSON string
 * of it. A producer other than BullMQ (the Python client) may store bytes
 * that are not JSON, and BullMQ parses a job's data and return value as
 * JSON: a Worker failed such a job's every fetch, and one such job failed
 * every getter listing it.
 */
export function asJsonText(stored: string): string {
  try {
    JSON.parse(stored);
    return stored;
  } catch {
    return JSON.stringify(stored);
  }
}

/**
 * A job's BullMQ options: its stored options document, with the settings a
 * producer other than BullMQ (the Python client, a schedule the server
 * runs) gave only as the job's own fields filled in, since BullMQ's Worker
 * reads retries, backoff and kept logs from `job.opts`.
 */
function bullmqOpts(job: Job): unknown {
  // BullMQ's Job reads fields of its options: anything but an object (from a
  // server older than the check on Enqueue) reads as none.
  const opts = jsonOr(job.opts, {});
  if (typeof opts !== 'object' || opts === null || Array.isArray(opts)) return {};
  const o = opts as Record<string, unknown>;
  // One attempt is what a job without `attempts` gets, and BullMQ reads it as 0.
  if (o.attempts === undefined && job.attempts > 1) o.attempts = job.attempts;
  const b = job.backoff;
  if (o.backoff === undefined && b && b.kind !== BackoffKind.UNSPECIFIED) {
    const type = b.kind === BackoffKind.FIXED ? 'fixed' : 'exponential';
    o.backoff = { type, delay: Number(b.delayMs), ...(b.jitter > 0 && { jitter: b.jitter }) };
  }
  if (o.keepLogs === undefined && job.keepLogs !== undefined) o.keepLogs = Number(job.keepLogs);
  return o;
}

/** BullMQ's `JobJson` of a stored job (what `getJobData` and next-job tuples carry). */
export function jobJson(job: Job): JobJson {
  const out: Record<string, unknown> = {
    id: job.id,
    name: job.name,
    data: job.data.length === 0 ? '' : asJsonText(text(job.data)),
    opts: bullmqOpts(job),
    progress: jsonOr(job.progress, 0),
    delay: Number(job.delay),
    priority: job.priority,
    timestamp: Number(job.timestamp),
    attemptsMade: job.attemptsMade,
    attemptsStarted: job.attemptsStarted,
    stalledCounter: job.stalledCounter,
    stacktrace: JSON.stringify(job.stacktrace),
  };
  if (job.finishedOn !== undefined) out.finishedOn = Number(job.finishedOn);
  if (job.processedOn !== undefined) out.processedOn = Number(job.processedOn);
  if (job.processedBy !== undefined) out.processedBy = job.processedBy;
  if (job.failedReason !== undefined) out.failedReason = job.failedReason;
  if (job.returnValue !== undefined) out.returnvalue = asJsonText(text(job.returnValue));
  if (job.parent) {
    const policy = job.onChildFailure;
    out.parentKey = nodeKey(job.parent);
    out.parent = {
      id: job.parent.id,
      queueKey: job.parent.prefix ? `${job.parent.prefix}:${job.parent.queue}` : job.parent.queue,
      ...(policy === OnChildFailure.FAIL_PARENT && { fpof: true }),
      ...(policy === OnChildFailure.CONTINUE_PARENT && { cpof: true }),
      ...(policy === OnChildFailure.IGNORE && { idof: true }),
      ...(policy === OnChildFailure.REMOVE && { rdof: true }),
    };
  }
  if (job.schedulerId !== undefined) out.repeatJobKey = job.schedulerId;
  if (job.dedup) out.deduplicationId = job.dedup.id;
  if (job.deferredFailure !== undefined) out.deferredFailure = job.deferredFailure;
  return out as unknown as JobJson;
}

/** The next-job tuple for the first lease of `leased` (BullMQ fetches one job at a time). */
export function nextJob(leased: Leased | undefined): NextJobTuple {
  const lease = leased?.leases[0];
  if (lease?.job) return [jobJson(lease.job), lease.job.id, 0, 0];
  const info = leased?.info;
  if (info && info.rateLimitMs > 0n) return [null, 0, Number(info.rateLimitMs), 0];
  return [null, 0, 0, info?.nextDue !== undefined ? Number(info.nextDue) : 0];
}

/** A parent's children by BullMQ category (values as JSON text, as the core keeps them). */
export function childrenByCategory(deps: Dependency[]): ChildrenByCategory {
  const all: ChildrenByCategory = { processed: [], unprocessed: [], ignored: [], failed: [] };
  for (const d of deps) {
    switch (d.status) {
      case DependencyStatus.PROCESSED:
        all.processed.push([d.key, d.value ?? 'null']);
        break;
      case DependencyStatus.PENDING:
        all.unprocessed.push(d.key);
        break;
      case DependencyStatus.IGNORED:
        all.ignored.push([d.key, d.value ?? '']);
        break;
      case DependencyStatus.FAILED:
        all.failed.push(d.key);
        break;
    }
  }
  return all;
}

/** One event as Redis XREAD shapes a stream entry: `[id, [k1, v1, ...]]`, `event` first. */
export function streamEntry(e: Event): [string, string[]] {
  const fields = ['event', e.name];
  // QueueEvents parses a completion's return value and a progress, and stops
  // for good on one that is not JSON (a progress stored before the core
  // refused such; a return value from another client).
  const parsed = e.name === 'completed' ? 'returnvalue' : e.name === 'progress' ? 'data' : undefined;
  for (const f of e.fields) fields.push(f.key, f.key === parsed ? asJsonText(f.value) : f.value);
  return [`${e.ts}-${e.seq}`, fields];
}
