// Adds COUNT jobs with ids `node-<i>` to QUEUE through BullMQ on
// loamBackend({ url }); prints `added <id>` once an add is acknowledged. An
// add refused while the server is down is sent again (same id, so a retry of
// an add that did land returns the job it made).
import { withBackend } from 'bullmq';
import { loamBackend } from '@loam/bullmq';

const [url, queueName, count] = process.argv.slice(2);
const { Queue } = withBackend(loamBackend({ url }));
const queue = new Queue(queueName, { connection: {} });
queue.on('error', () => {});
for (let i = 0; i < Number(count); i++) {
  for (;;) {
    try {
      const job = await queue.add(`node-${i}`, { origin: 'node', i }, { jobId: `node-${i}` });
      console.log(`added ${job.id}`);
      break;
    } catch (err) {
      console.error(`add node-${i}: ${err.message}; retrying`);
      await new Promise((r) => setTimeout(r, 100));
    }
  }
}
await queue.close();
