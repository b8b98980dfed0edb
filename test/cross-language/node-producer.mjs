// Adds COUNT jobs named `node-<i>` to QUEUE through BullMQ on loamBackend({ url }).
import { withBackend } from 'bullmq';
import { loamBackend } from '@loam/bullmq';

const [url, queueName, count] = process.argv.slice(2);
const { Queue } = withBackend(loamBackend({ url }));
const queue = new Queue(queueName, { connection: {} });
for (let i = 0; i < Number(count); i++) {
  const job = await queue.add(`node-${i}`, { origin: 'node', i });
  console.log(`added ${job.id} node-${i}`);
}
await queue.close();
