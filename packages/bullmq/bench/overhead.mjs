// Per-call cost of the binding, and end-to-end Worker throughput.
// Run after `pnpm run build` (release addon + dist):  node bench/overhead.mjs
// LOAM_BENCH_DIST=<dir> loads the package from another build (default ../dist).
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { pathToFileURL } from 'node:url';
import { withBackend } from 'bullmq';

const dist = process.env.LOAM_BENCH_DIST ? pathToFileURL(path.resolve(process.env.LOAM_BENCH_DIST, 'index.js')).href : '../dist/index.js';
const { loamBackend } = await import(dist);

const durability = process.env.LOAM_BENCH_DURABILITY ?? 'immediate';
const dataDir = mkdtempSync(path.join(tmpdir(), 'loam-bench-'));
const { Queue, Worker } = withBackend(loamBackend({ dataDir, durability }));
const N = Number(process.env.LOAM_BENCH_N ?? 2000);

async function timed(label, n, fn) {
  const t0 = process.hrtime.bigint();
  await fn();
  const s = Number(process.hrtime.bigint() - t0) / 1e9;
  console.log(`${label.padEnd(44)} ${String(Math.round(n / s)).padStart(8)} /s  ${((s / n) * 1e6).toFixed(1).padStart(8)} µs each`);
}

const queue = new Queue('bench', { connection: {} });
const backend = queue.getBackend();
await queue.add('warm', {});

await timed('read, sequential (getRateLimitTtl)', N, async () => {
  for (let i = 0; i < N; i++) await backend.getRateLimitTtl();
});
await timed('read, 100 in flight (getState)', N, async () => {
  for (let i = 0; i < N; i += 100) await Promise.all(Array.from({ length: 100 }, () => backend.getState('1')));
});
await timed(`queue.add, sequential (${durability})`, N, async () => {
  for (let i = 0; i < N; i++) await queue.add('j', { i });
});
await timed(`queue.add, 100 in flight (${durability})`, N, async () => {
  for (let i = 0; i < N; i += 100) await Promise.all(Array.from({ length: 100 }, (_, k) => queue.add('j', { k })));
});
await timed('queue.addBulk of 100', N, async () => {
  for (let i = 0; i < N; i += 100) await queue.addBulk(Array.from({ length: 100 }, (_, k) => ({ name: 'j', data: { k } })));
});
for (const concurrency of [1, 16]) {
  const waiting = (await queue.getJobCounts('waiting')).waiting;
  const target = concurrency === 1 ? Math.min(waiting, N) : waiting;
  let done = 0;
  let finish;
  const finished = new Promise(r => (finish = r));
  await timed(`worker, concurrency ${concurrency}, ${target} jobs`, target, async () => {
    const worker = new Worker('bench', async () => {
      if (++done === target) finish();
    }, { connection: {}, concurrency });
    await finished;
    await worker.close();
  });
}
await queue.close();
rmSync(dataDir, { recursive: true, force: true });
