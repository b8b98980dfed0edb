// Processes QUEUE with a BullMQ Worker on loamBackend({ url }) until SIGTERM;
// prints `done <id> <name> <origin>` per completion the server acknowledged.
// Short locks, so a job whose lease a server crash lost comes back soon.
import { withBackend } from 'bullmq';
import { loamBackend } from '@loam/bullmq';

const [url, queueName] = process.argv.slice(2);
const { Worker } = withBackend(loamBackend({ url }));
const worker = new Worker(
  queueName,
  async (job) => {
    if (typeof job.data?.origin !== 'string') throw new Error(`job ${job.id} has no origin: ${JSON.stringify(job.data)}`);
    return { by: 'node' };
  },
  { connection: {}, concurrency: 5, lockDuration: 2_000, stalledInterval: 1_000 },
);
worker.on('completed', (job) => console.log(`done ${job.id} ${job.name} ${job.data.origin}`));
worker.on('failed', (job, err) => console.log(`failed ${job?.id} ${err.message}`));
// Calls refused while the server restarts: BullMQ retries them.
worker.on('error', () => {});
await worker.waitUntilReady();
console.log('ready');
process.on('SIGTERM', async () => {
  await worker.close();
  process.exit(0);
});
