/**
 * Errors from the native addon carry their code as a tag at the start of the
 * message (napi can only reject async calls with a fixed set of statuses):
 * `[bullmq:-3] Job 1 is not in the active state. moveToFinished` or
 * `[loam:store_locked] ...`. This turns them into the errors BullMQ's callers
 * expect: `error.code` is BullMQ's numeric code (-1..-11) or a `LOAM_*`
 * string, and -9 is an `UnrecoverableError`, as BullMQ's `finishedErrors()`
 * makes it.
 */
import { UnrecoverableError } from 'bullmq';

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
    return err;
  }
  const [whole, family, code] = tag;
  const message = err.message.slice(whole.length);
  if (family === 'bullmq') {
    const numeric = Number(code);
    const error =
      numeric === JOB_HAS_FAILED_CHILDREN ? new UnrecoverableError(message) : new Error(message);
    (error as Error & { code: LoamErrorCode }).code = numeric;
    return error;
  }
  const error = new Error(message);
  (error as Error & { code: LoamErrorCode }).code = `LOAM_${code.toUpperCase()}`;
  return error;
}

/** Awaits a native call, rethrowing its error in BullMQ's form. */
export async function call<T>(promise: Promise<T>): Promise<T> {
  try {
    return await promise;
  } catch (err) {
    throw fromNative(err);
  }
}

/** Runs a synchronous native call, rethrowing its error in BullMQ's form. */
export function callSync<T>(fn: () => T): T {
  try {
    return fn();
  } catch (err) {
    throw fromNative(err);
  }
}
