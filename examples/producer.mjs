// Adds a few jobs to the "emails" queue. BullMQ's own Queue, on Loam: the
// data lives in ./.loam (or $LOAM_DATA_DIR); nothing else to run.
//
//   node examples/producer.mjs
import { Queue } from '@loam/bullmq';

const queue = new Queue('emails');
for (const to of ['ada@example.com', 'grace@example.com', 'edsger@example.com']) {
  const job = await queue.add('send', { to, subject: 'hello' }, { attempts: 3, backoff: { type: 'exponential', delay: 500 } });
  console.log(`added job ${job.id} for ${to}`);
}
const delayed = await queue.add('send', { to: 'later@example.com', subject: 'in two seconds' }, { delay: 2000 });
console.log(`added job ${delayed.id}, due in 2 s`);
console.log('counts:', await queue.getJobCounts());
await queue.close();
