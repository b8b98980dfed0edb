// Compiled, not run, by types.test.ts: what the README shows a TypeScript
// user writing must type-check against the package's exports.
import { setDefaultBackendFactory } from 'bullmq';
import factory from '../../src/factory.js';
import { FlowProducer, Queue, QueueEvents, QueueEventsProducer, Worker, loamBackend } from '../../src/index.js';

export async function usage(): Promise<void> {
  const queue = new Queue<{ to: string }>('emails');
  await queue.add('welcome', { to: 'ada@example.com' });
  const worker = new Worker<{ to: string }>('emails', async job => job.data.to, { concurrency: 8 });
  const events = new QueueEvents('emails');
  const flows = new FlowProducer();
  const producer = new QueueEventsProducer('emails', { prefix: 'bull' });
  setDefaultBackendFactory(factory);
  setDefaultBackendFactory(loamBackend({ dataDir: './.loam' }));
  await Promise.all([worker.close(), events.close(), flows.close(), producer.close(), queue.close()]);
}
