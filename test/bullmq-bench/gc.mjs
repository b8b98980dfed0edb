import { Queue, Worker, setDefaultBackendFactory } from 'bullmq';
import { loamBackend } from '@loam/bullmq';
setDefaultBackendFactory(loamBackend({ url: process.env.LOAM_URL, calls: process.env.CALLS ?? 'session' }));
for (let round = 0; round < Number(process.env.ROUNDS ?? 5); round++) {
  const name = `gc-${process.pid}-${round}`;
  const queue = new Queue(name, { connection: {} });
  await queue.addBulk(Array.from({ length: 15 }, (_, j) => ({ name: 'test', data: { j } })));
  await queue.setGlobalConcurrency(1);
  const order = []; let parallel = 0, maxParallel = 0, count = 0;
  let resolve; const done = new Promise(r => (resolve = r));
  const worker = new Worker(name, async job => {
    order.push(job.id); parallel++; maxParallel = Math.max(maxParallel, parallel);
    await new Promise(r => setTimeout(r, 100));
    parallel--; if (++count === 15) resolve();
  }, { connection: {}, concurrency: 10, drainDelay: 10 });
  await done;
  console.log(`round ${round}: order ${order.join(',')} maxParallel ${maxParallel}`);
  await worker.close(); await queue.close();
}
process.exit(0);
