import { Queue, Worker, setDefaultBackendFactory } from 'bullmq';
import { loamBackend } from '@loam/bullmq';
import { mkdtempSync } from 'node:fs';
setDefaultBackendFactory(process.env.LOAM_URL ? loamBackend({ url: process.env.LOAM_URL }) : loamBackend({ dataDir: mkdtempSync('/tmp/cx-') }));
const name = 'c' + process.pid;
const queue = new Queue(name, { connection: {} });
const t0 = performance.now();
const log = (...a) => console.log((performance.now() - t0).toFixed(2).padStart(8), ...a);
const worker = new Worker(name, async (job, token, signal) => {
  log('start', job.id);
  for (let i = 0; i < 100; i++) { if (signal?.aborted) { log('cancelled', job.id); throw new Error('Cancelled'); } await new Promise(r => setTimeout(r, 5)); }
  return 1;
}, { connection: {}, concurrency: 10 });
await worker.waitUntilReady();
let active = 0;
const allActive = new Promise(r => worker.on('active', (job) => { log('active', job.id); if (++active === 10) r(); }));
const jobs = await Promise.all(Array.from({ length: 10 }, (_, i) => queue.add('test', { i })));
log('added');
await allActive;
log('all active');
for (const j of jobs.slice(0, 5)) log('cancelJob', j.id, worker.cancelJob(j.id));
await new Promise(r => setTimeout(r, 700));
await worker.close(); await queue.close(); process.exit(0);
