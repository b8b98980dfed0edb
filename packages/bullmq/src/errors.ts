/**
 * Errors from the native addon carry their code as a tag at the start of the
 * message (napi can only reject async calls with a fixed set of statuses):
 * `[bullmq:-3] {"command":"moveToFinished","jobId":"1","state":"active"}`
 * (BullMQ's code, and the command and arguments its text names) or
 * `[loam:store_locked] ...`. This turns them into the errors BullMQ's callers
 * expect: `error.code` is BullMQ's numeric code (-1..-11) or a `LOAM_*`
 * string, the text is BullMQ's `finishedErrors()` text (`finishedErrorText`,
 * which the remote backend uses too), and -9 is an `UnrecoverableError`, as
 * `finishedErrors()` makes it.
 */
import { ConnectionClosedError, isNotConnectionError, UnrecoverableError } from 'bullmq';

const TAG = /^\[(bullmq|loam):([^\]]+)\] /;

/** BullMQ's JobHasFailedChildren, which it raises as an UnrecoverableError. */
const JOB_HAS_FAILED_CHILDREN = -9;

export type LoamErrorCode = number | `LOAM_${string}`;

export function fromNative(err: unknown): Error {
  if (!(err instanceof Error)) {
    return new Error(String(err));
  }
  const tag = TAG.exec(err.message);
  if (!tag) {
    return untaggedNative(err);
  }
  const [whole, family, code] = tag;
  const message = err.message.slice(whole.length);
  if (family === 'bullmq') {
    const command = nativeCommand(message);
    return bullmqError(Number(code), command ? finishedErrorText(Number(code), command) : message);
  }
  return loamError(code, message);
}

/**
 * The command and arguments the addon sends with a BullMQ code (its
 * `error::Op`), or none when the text is not that JSON (an addon built before
 * it sent JSON, or a message made by hand), whose text is then the message
 * itself: converting an error must never throw, since the write queue
 * (`native-calls.ts`) settles callers with it.
 */
function nativeCommand(text: string): BullmqCommand | undefined {
  let parsed: unknown;
  try {
    parsed = JSON.parse(text);
  } catch {
    return undefined;
  }
  const command = (parsed as { command?: unknown } | null)?.command;
  return typeof command === 'string' ? (parsed as BullmqCommand) : undefined;
}

/**
 * napi-rs's own errors, which the addon's code never saw: an argument of the
 * wrong type (`'10'` where a number goes), and a `GenericFailure`: a panic
 * napi-rs caught (in an async call it keeps only that it was one; in a
 * synchronous call, the panic's message) or a failure of N-API itself. Every
 * error of the addon's own carries a tag, so an untagged `GenericFailure` is
 * internal. Typed as the addon's own refusals are.
 */
function untaggedNative(err: Error): Error {
  const { code } = err as Error & { code?: unknown };
  if (typeof code === 'string' && NAPI_WRONG_TYPE.has(code)) {
    return loamError('invalid_argument', `an argument has the wrong type: ${err.message}`);
  }
  if (code === 'GenericFailure') {
    return loamError('internal', `panic or N-API failure in the Loam addon: ${err.message}`);
  }
  return err;
}

const NAPI_WRONG_TYPE: ReadonlySet<string> = new Set([
  'InvalidArg',
  'ObjectExpected',
  'StringExpected',
  'NameExpected',
  'FunctionExpected',
  'NumberExpected',
  'BooleanExpected',
  'ArrayExpected',
  'BigintExpected',
  'DateExpected',
  'ArrayBufferExpected',
]);

/** BullMQ's error for a numeric code, as its `finishedErrors()` makes it. */
export function bullmqError(code: number, message: string): Error {
  const error = code === JOB_HAS_FAILED_CHILDREN ? new UnrecoverableError(message) : new Error(message);
  (error as Error & { code: LoamErrorCode }).code = code;
  return error;
}

/**
 * The kinds that say the store cannot be reached now (a failed or stopped
 * store, one whose open failed, a server saying so): BullMQ's
 * `ConnectionClosedError`, as a lost Redis connection is. Its Worker waits
 * `runRetryDelay` before it asks again; any other error it reports and asks
 * again at once, at a full core for as long as the store stays down (a
 * failed open's refusals, thrown at once, ran microtasks only: no timer
 * fired).
 */
const UNREACHABLE: ReadonlySet<string> = new Set(['unavailable', 'store_locked']);

/** An error BullMQ has no code for: `kind` is the Connect code name (`invalid_argument`). */
export function loamError(kind: string, message: string): Error {
  const error = UNREACHABLE.has(kind) ? new ConnectionClosedError(message) : new Error(message);
  (error as Error & { code: LoamErrorCode }).code = `LOAM_${kind.toUpperCase()}`;
  return error;
}

/**
 * Whether BullMQ takes `err` for a lost connection, which its Worker and
 * QueueEvents retry rather than report (a remote call's transport failure
 * is BullMQ's `ConnectionClosedError`, see `toBullmqError`).
 */
export function isConnectionError(err: unknown): boolean {
  return err instanceof Error && !isNotConnectionError(err);
}

/** Runs a synchronous native call, rethrowing its error in BullMQ's form. */
export function callSync<T>(fn: () => T): T {
  try {
    return fn();
  } catch (err) {
    throw fromNative(err);
  }
}

/**
 * The BullMQ command a call runs for, with the arguments BullMQ's
 * `finishedErrors()` names in its texts: the addon sends it as JSON beside
 * the code (its `error::Op`); for a remote call the server sends the code and
 * the caller knows the rest. Either way the text is written here.
 */
export interface BullmqCommand {
  command: string;
  jobId?: string;
  state?: string;
  parentKey?: string;
}

/** BullMQ's `finishedErrors()` text for `code` (a missing argument prints as `undefined`, as in BullMQ). */
export function finishedErrorText(code: number, { command, jobId, state, parentKey }: BullmqCommand): string {
  switch (code) {
    case -1:
      return `Missing key for job ${jobId}. ${command}`;
    case -2:
      return `Missing lock for job ${jobId}. ${command}`;
    case -3:
      return `Job ${jobId} is not in the ${state} state. ${command}`;
    case -4:
      return `Job ${jobId} has pending dependencies. ${command}`;
    case -5:
      return `Missing key for parent job ${parentKey}. ${command}`;
    case -6:
      return `Lock mismatch for job ${jobId}. Cmd ${command} from ${state}`;
    case -7:
      return `The parent job ${parentKey} cannot be replaced. ${command}`;
    case -8:
      return `Job ${jobId} belongs to a job scheduler and cannot be removed directly. ${command}`;
    case -9:
      return `Cannot complete job ${jobId} because it has at least one failed child. ${command}`;
    case -10:
      return `Cannot create job scheduler iteration - job ID already exists. ${command}`;
    case -11:
      return `Cannot create job scheduler iteration - current and next time slots already have jobs. ${command}`;
    default:
      return `Unknown code ${code} error for ${jobId}. ${command}`;
  }
}

/** What the server says about a refused call (`loam.jobs.v1.ErrorDetail`), when it says it. */
export interface ServerRefusal {
  /** The Connect code name: `not_found`, `failed_precondition`, ... */
  code: string;
  message: string;
  reason?: string;
  bullmqCode?: number;
  subject?: string;
}

/**
 * A server refusal as the in-process backend would have thrown it: BullMQ's
 * coded error when the server names a BullMQ code (the subject fills in a
 * job or parent the caller did not know), else `LOAM_<CODE>`. Obliterate's
 * two refusals keep BullMQ's texts.
 */
export function fromServer(refusal: ServerRefusal, call: BullmqCommand): Error {
  if (refusal.bullmqCode) {
    const subject = refusal.subject || undefined;
    const named: BullmqCommand = {
      ...call,
      jobId: call.jobId ?? subject,
      parentKey: call.parentKey ?? (refusal.bullmqCode === -5 || refusal.bullmqCode === -7 ? subject : undefined),
    };
    return bullmqError(refusal.bullmqCode, finishedErrorText(refusal.bullmqCode, named));
  }
  if (refusal.reason === 'precondition.queue_not_paused') {
    return loamError('failed_precondition', 'Cannot obliterate non-paused queue');
  }
  if (refusal.reason === 'precondition.queue_has_active_jobs') {
    return loamError('failed_precondition', 'Cannot obliterate queue with active jobs');
  }
  return loamError(refusal.code, refusal.message);
}
