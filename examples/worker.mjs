// Processes the "emails" queue until interrupted (Ctrl-C). Run it after the
// producer has exited, in the same directory: one process at a time owns the
// data directory, and a second one fails at once with LOAM_STORE_LOCKED (use
// `loam-jobs serve` to share queues between processes).
//
//   node examples/worker.mjs
import { Worker } from '@loam/bullmq';

const worker = new Worker(
  'emails',
  async (job) => {
    await job.updateProgress(50);
    await job.log(`sending to ${job.data.to}`);
    return { sent: true, to: job.data.to };
  },
  { concurrency: 10 },
);
worker.on('completed', (job, result) => console.log(`job ${job.id} done:`, result));
worker.on('failed', (job, err) => console.log(`job ${job?.id} failed: ${err.message}`));
process.on('SIGINT', async () => {
  await worker.close();
  process.exit(0);
});
console.log('worker waiting for jobs on "emails" (Ctrl-C to stop)');
