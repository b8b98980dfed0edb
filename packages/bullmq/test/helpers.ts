import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { randomUUID } from 'node:crypto';
import { withBackend } from 'bullmq';
import { loamBackend } from '../src/index.js';

/** BullMQ's classes bound to a fresh store in a temporary directory. */
export function freshLoam() {
  const dataDir = mkdtempSync(path.join(tmpdir(), 'loam-bullmq-'));
  const factory = loamBackend({ dataDir });
  const classes = withBackend(factory);
  return {
    ...classes,
    factory,
    dataDir,
    queueName: () => `q-${randomUUID()}`,
    cleanup: () => rmSync(dataDir, { recursive: true, force: true }),
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
