// Processes QUEUE with a BullMQ Worker on loamBackend({ url }) until SIGTERM;
// prints `done <id> <name> <origin>` per job it completed.
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
  { connection: {}, concurrency: 5 },
);
worker.on('completed', (job) => console.log(`done ${job.id} ${job.name} ${job.data.origin}`));
worker.on('failed', (job, err) => console.log(`failed ${job?.id} ${err.message}`));
await worker.waitUntilReady();
console.log('ready');
process.on('SIGTERM', async () => {
  await worker.close();
  process.exit(0);
});
