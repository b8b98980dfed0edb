import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { randomUUID } from 'node:crypto';
import { withBackend, type IQueueBackend, type QueueBase } from 'bullmq';
import { describe, inject, it } from 'vitest';
import { loamBackend, type LoamConnectionOptions } from '../src/index.js';

/**
 * Which backend the suite runs against: `in-process` (the addon over a store
 * in a temporary directory) or `remote` (a `loam-jobs serve` that the
 * `remote` vitest project starts, see `remote-server.ts`).
 */
export const backendKind: 'in-process' | 'remote' =
  process.env.LOAM_TEST_BACKEND === 'remote' ? 'remote' : 'in-process';

/** Tests of what only the in-process backend has (the addon, the store's file lock). */
export const describeInProcess = backendKind === 'in-process' ? describe : describe.skip;
export const itInProcess = backendKind === 'in-process' ? it : it.skip;

/**
 * BullMQ's classes bound to a fresh store: a temporary directory in-process,
 * a namespace of its own on the test server when remote.
 */
export function freshLoam() {
  const settings: LoamConnectionOptions =
    backendKind === 'remote'
      ? { url: inject('loamServerUrl'), namespace: `t-${randomUUID()}` }
      : { dataDir: mkdtempSync(path.join(tmpdir(), 'loam-bullmq-')) };
  const factory = settings.url ? loamBackend({ ...settings, url: settings.url }) : loamBackend(settings);
  const classes = withBackend(factory);
  return {
    ...classes,
    factory,
    /** The settings that reach the same store, for `loamBackend()` in a child process. */
    settings,
    queueName: () => `q-${randomUUID()}`,
    cleanup: () => {
      if (settings.dataDir) rmSync(settings.dataDir, { recursive: true, force: true });
    },
  };
}

/** Resolves once `predicate` holds, polling every 10 ms. */
export async function until(predicate: () => boolean | Promise<boolean>, timeoutMs = 10_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await predicate())) {
    if (Date.now() > deadline) throw new Error('condition not met in time');
    await new Promise(r => setTimeout(r, 10));
  }
}

/**
 * `queue.clientName()`: the name a queue's backend gives its clients (the
 * prefix of `getWorkers()`' `rawname`s). BullMQ declares it `protected`;
 * element access is TypeScript's sanctioned way past that, and still
 * type-checks the call.
 */
export function clientNameOf<B extends IQueueBackend, C>(queue: QueueBase<B, C>): string {
  return queue['clientName']();
}

declare module 'vitest' {
  export interface ProvidedContext {
    /** `http://127.0.0.1:<port>` of the server the remote project runs against. */
    loamServerUrl: string;
  }
}

/**
 * The addon's methods for the tests (panics on purpose, a slow open) of
 * `queue`'s backend. They exist only in a build with the napi crate's
 * `test-hooks` feature (`pnpm run build:native`); after a release build
 * (`pnpm run build`, `pnpm bench`) this says so, where calling a missing
 * method would fail with a bare TypeError.
 */
export function testHooks<Hooks extends object>(queue: { getBackend(): unknown }): Hooks {
  const native = (queue.getBackend() as { native: Hooks & { panicForTest?: unknown } }).native;
  if (typeof native.panicForTest !== 'function') {
    throw new Error('the addon was built without its test hooks: run `pnpm run build:native` (the debug build)');
  }
  return native;
}
