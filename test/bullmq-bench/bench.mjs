// BullMQ on @loam/bullmq beside BullMQ on Redis: the same scenarios, in one
// run, with the ratios printed. Not a test: figures vary with machine load.
//
//   node bench.mjs [--only loam|remote|redis|ceiling[,...]] [--scenarios 'name;...'] [--rounds 3] [--warmup 2]
//                  [--scale 0.5] [--remote 'name;...'] [--json out.json] [--help]
//
// Each round runs every scenario on every backend back to back; the tables
// give each backend's median and the median (and range) of the ratios of
// runs made in the same round. The first --warmup rounds run the same way
// and are printed but not counted: they are where V8 compiles BullMQ's code
// (and each backend's) on its way to the code a long-running process runs.
// A fresh process's first thousands of `Queue.add` calls ran at about two
// thirds of the speed of the later ones, and Redis's one-at-a-time adds sped
// up for their first 12,000 or so; two warm-up rounds add 20,000.
//
// Each backend runs in a Node process of its own (this script, forked, told
// its backend in LOAM_BENCH_BACKEND), which this one drives scenario by
// scenario, as an application runs BullMQ over one backend. Run together in
// one process, sharing V8's compiled BullMQ code and one heap, BullMQ on
// Redis and on Loam in-process ran slower than either runs alone
// (docs/benchmarks.md, How to run).
//
// Redis is started here (redis-server from the machine, on a free loopback
// port, with no persistence: no RDB snapshots, no AOF). Loam uses its default
// immediate durability unless LOAM_DURABILITY=relaxed, in-process and in the
// server alike.
//
// `ceiling` is BullMQ over a backend that costs nothing (ceiling.mjs), for
// the scenarios it serves: what BullMQ's own JavaScript allows on this
// machine in this hour, beside the backends measured against it.
//
// `remote` is BullMQ through `loamBackend({ url })` on a `loam-jobs serve`
// started here ($LOAM_JOBS_BIN, else target/release/loam-jobs; build it with
// `cargo build --release -p loam-jobs-server`), for the scenarios named in
// --remote (default: process at concurrency 100). It runs when the binary
// exists, or when --only names it.
import { fork, spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir, loadavg, cpus } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { performance } from 'node:perf_hooks';
import { FlowProducer, Queue, Worker, setDefaultBackendFactory } from 'bullmq';
import { loamBackend } from '@loam/bullmq';
import { ceilingBackend, ceilingScenarios, forgetCeilingJobs } from './ceiling.mjs';

const usage = `usage: node bench.mjs [--only loam|remote|redis|ceiling[,...]] [--scenarios 'name;...'] [--rounds 3] [--warmup 2]
                      [--scale 1] [--remote 'name;...'] [--json out.json] [--help]
  --only       the backends to run (default: all; remote when target/release/loam-jobs exists)
  --scenarios  the scenarios to run, by their printed names, separated by ';' (default: all)
  --rounds     counted rounds (default 3); --warmup: rounds before them, printed, not counted (default 2)
  --scale      multiplies every scenario's job count (default 1)
  --remote     the scenarios that also run through loamBackend({ url }), separated by ';', '' for none (default: process at concurrency 100)
  --json       writes every run and the medians to this file
LOAM_DURABILITY=relaxed runs Loam relaxed, in-process and in the server; LOAM_CALLS=unary sends the remote backend's
calls each on an HTTP/2 stream of its own (its \`calls\` setting; default: one session); LOAM_JOBS_BIN names the server binary.`;
let options;
try {
  ({ values: options } = parseArgs({
    options: {
      only: { type: 'string', default: '' },
      scenarios: { type: 'string', default: '' },
      rounds: { type: 'string', default: '3' },
      warmup: { type: 'string', default: '2' },
      scale: { type: 'string', default: '1' },
      remote: { type: 'string', default: 'process at concurrency 100' },
      json: { type: 'string', default: '' },
      help: { type: 'boolean', default: false },
    },
  }));
} catch (e) {
  refuse(e.message);
}
if (options.help) {
  console.log(usage);
  process.exit(0);
}
const scale = Number(options.scale);
const only = options.only;
/** The backends to run: all by default, or those --only lists. */
const wants = (backend) => only === '' || only.split(',').includes(backend);
const jsonOut = options.json;
const remoteScenarios = options.remote === '' ? [] : options.remote.split(';');
/** The scenarios to run (their names as printed), all by default. */
const chosen = options.scenarios;
const serverBin =
  process.env.LOAM_JOBS_BIN ?? resolve(dirname(fileURLToPath(import.meta.url)), '../../target/release/loam-jobs');
const n = (count) => Math.max(1, Math.round(count * scale));
/** Loam's durability, in-process and in the server: immediate unless LOAM_DURABILITY=relaxed. */
const durability = process.env.LOAM_DURABILITY === 'relaxed' ? 'relaxed' : 'immediate';
/** How the remote backend sends its calls: on one session unless LOAM_CALLS=unary. */
const calls = process.env.LOAM_CALLS === 'unary' ? 'unary' : 'session';

/**
 * What the bench started (servers, data directories), undone however it ends:
 * a Ctrl-C, or a closed pipe (`| head`), left redis-server and loam-jobs serve
 * running before. Each undo runs once, from `finally` or from the exit.
 */
const undos = new Set();
function undoOnExit(undo) {
  const once = () => {
    if (undos.delete(once)) undo();
  };
  undos.add(once);
  return once;
}
process.on('exit', () => {
  // Newest first: a backend's process is killed before its server stops and
  // its data directory goes. One that fails does not keep the rest from running.
  for (const undo of [...undos].reverse()) {
    try {
      undo();
    } catch (e) {
      console.error(e);
    }
  }
});
for (const [signal, code] of [['SIGINT', 130], ['SIGTERM', 143], ['SIGHUP', 129]]) {
  process.on(signal, () => process.exit(code));
}
process.stdout.on('error', (e) => process.exit(e.code === 'EPIPE' ? 141 : 1));

/** Stops a server the bench started and removes its data directory, once (see `undoOnExit`). */
const stopOnExit = (child, dir) => undoOnExit(() => (child.kill('SIGTERM'), rmSync(dir, { recursive: true, force: true })));

function freePort() {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
    srv.on('error', reject);
  });
}

/** CPU milliseconds a process has used (user + system), from /proc. */
function processCpuMs(pid) {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return ((Number(fields[11]) + Number(fields[12])) * 1000) / 100;
}

async function startRedis() {
  const port = await freePort();
  const dir = mkdtempSync(join(tmpdir(), 'bench-redis-'));
  const child = spawn('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--dir', dir, '--save', '', '--appendonly', 'no'], {
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const stop = stopOnExit(child, dir);
  await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('redis-server did not start')), 10000);
    child.stdout.on('data', (d) => {
      if (String(d).includes('Ready to accept connections')) {
        clearTimeout(timer);
        resolve();
      }
    });
    child.on('exit', (code) => reject(new Error(`redis-server exited with ${code}`)));
  });
  return { port, pid: child.pid, stop };
}

/** Starts `loam-jobs serve` on a free loopback port with a fresh data dir. */
async function startLoamServer() {
  const port = await freePort();
  const dir = mkdtempSync(join(tmpdir(), 'bench-loam-serve-'));
  const child = spawn(serverBin, ['serve', '--listen', `127.0.0.1:${port}`, '--data-dir', dir, '--durability', durability], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, NO_COLOR: '1' },
  });
  const stop = stopOnExit(child, dir);
  await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('loam-jobs serve did not start')), 30000);
    const ready = (d) => {
      if (String(d).includes('listen=')) {
        clearTimeout(timer);
        resolve();
      }
    };
    child.stdout.on('data', ready);
    child.stderr.on('data', ready);
    child.on('exit', (code) => reject(new Error(`loam-jobs serve exited with ${code}`)));
  });
  return {
    url: `http://127.0.0.1:${port}`,
    pid: child.pid,
    stop,
  };
}

/**
 * The machine's busy time so far, in ms, from /proc/stat: every core's CPU
 * time, and its time idle waiting for this machine's own I/O (a store's
 * fsync is work under way too); steal, other machines' time, left out.
 */
function machineBusyMs() {
  const [, ...ticks] = readFileSync('/proc/stat', 'utf8').split('\n', 1)[0].trim().split(/\s+/);
  const [user, nice, system, , iowait, irq, softirq] = ticks.map(Number);
  return (user + nice + system + iowait + irq + softirq) * 10;
}

// The quiet-machine wait (`settle`): at most this long, looking at windows of
// this length, until one shows at most this much busy time (a fifth of a core).
const SETTLE_MAX_MS = 5000;
const SETTLE_WINDOW_MS = 100;
const SETTLE_QUIET_BUSY_MS = 20;

/**
 * Waits, up to 5 s, until the machine is quiet: a fifth of a core or less
 * busy over 100 ms (/proc/stat counts in 10 ms ticks). A backend may still
 * be working on what a scenario's set-up gave it when the set-up's last call
 * returned: Loam under relaxed durability answers an add before the store
 * has written it into its file, and after an `addBulk` of 2,000 jobs of
 * 100 KB the store went on writing for about a second, which the measure
 * then counted as processing (and so would the next backend's measure, on
 * the same two cores). Every backend gets the same wait; Redis, which keeps
 * nothing to do after an answer, ends it at the first look. Returns the
 * milliseconds waited.
 */
async function settle() {
  const start = performance.now();
  let busy = machineBusyMs();
  while (performance.now() - start < SETTLE_MAX_MS) {
    await new Promise((resolve) => setTimeout(resolve, SETTLE_WINDOW_MS));
    const now = machineBusyMs();
    if (now - busy <= SETTLE_QUIET_BUSY_MS) break;
    busy = now;
  }
  return performance.now() - start;
}

/** Measures one scenario from a quiet machine: wall time, jobs, and the CPU of this process and the server. */
async function measure(backend, jobs, body) {
  const settleMs = await settle();
  const cpu0 = process.cpuUsage();
  const server0 = backend.serverPid ? processCpuMs(backend.serverPid) : 0;
  const t0 = performance.now();
  const extra = (await body()) ?? {};
  const seconds = (performance.now() - t0) / 1000;
  const cpu = process.cpuUsage(cpu0);
  const serverMs = backend.serverPid ? processCpuMs(backend.serverPid) - server0 : 0;
  return {
    seconds,
    jobsPerSec: jobs / seconds,
    nodeCpuMsPerJob: (cpu.user + cpu.system) / 1000 / jobs,
    serverCpuMsPerJob: serverMs / jobs,
    settleMs,
    ...extra,
  };
}

let queueSeq = 0;
const queueName = (what) => `bench-${what}-${process.pid}-${++queueSeq}`;

function percentile(sorted, p) {
  if (sorted.length === 0) return NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

/** Resolves once `count` jobs have completed on `worker`. */
function completions(worker, count) {
  return new Promise((resolve, reject) => {
    let done = 0;
    worker.on('completed', () => {
      if (++done === count) resolve();
    });
    worker.on('failed', (_job, err) => reject(err));
  });
}

/**
 * 2,000 jobs of `data(i)`, added in bulk and then processed by `processor` at
 * concurrency 10, every job kept as it finishes; the queue is obliterated
 * after the measure.
 */
async function processKept(b, label, data, processor) {
  const name = queueName(label);
  const q = new Queue(name, b.opts);
  const count = n(2000);
  await q.addBulk(Array.from({ length: count }, (_, i) => ({ name: 'job', data: data(i) })));
  let worker;
  const r = await measure(b, count, async () => {
    worker = new Worker(name, processor, { ...b.opts, concurrency: 10 });
    await completions(worker, count);
  });
  await worker.close();
  await q.obliterate({ force: true });
  await q.close();
  return r;
}

const scenarios = {
  async 'add one at a time'(b) {
    const q = new Queue(queueName('add'), b.opts);
    const count = n(10000);
    const r = await measure(b, count, async () => {
      for (let i = 0; i < count; i++) await q.add('job', { i });
    });
    await q.close();
    return r;
  },

  async addBulk(b) {
    const q = new Queue(queueName('bulk'), b.opts);
    const batches = n(40);
    const r = await measure(b, batches * 500, async () => {
      for (let i = 0; i < batches; i++) {
        await q.addBulk(Array.from({ length: 500 }, (_, j) => ({ name: 'job', data: { i, j } })));
      }
    });
    await q.close();
    return r;
  },

  ...Object.fromEntries(
    [1, 10, 100].map((concurrency) => [
      `process at concurrency ${concurrency}`,
      async (b) => {
        const name = queueName(`c${concurrency}`);
        const q = new Queue(name, b.opts);
        const count = n(concurrency === 1 ? 3000 : 20000);
        for (let i = 0; i < count; i += 1000) {
          await q.addBulk(Array.from({ length: Math.min(1000, count - i) }, (_, j) => ({ name: 'job', data: { i: i + j } })));
        }
        let worker;
        const r = await measure(b, count, async () => {
          worker = new Worker(name, async () => 'ok', { ...b.opts, concurrency });
          await completions(worker, count);
        });
        await worker.close();
        await q.close();
        return r;
      },
    ]),
  ),

  // Large results: each completion stores its return value and emits it in
  // its `completed` event. Loam once copied a page of up to 64 such events at
  // every completion (0.4 times Redis at 100 KB).
  async 'process at concurrency 10, 100 KB results'(b) {
    const result = 'r'.repeat(100 << 10);
    return processKept(b, 'results', (i) => ({ i }), async () => result);
  },

  // Large data: each lease hands the job's data over, and a lease and a
  // completion rewrite the job. Loam rewrote the data with the record each
  // time (0.5 times Redis at 100 KB) until it kept large data apart.
  async 'process at concurrency 10, 100 KB data'(b) {
    const pad = 'd'.repeat(100 << 10);
    return processKept(b, 'data', (i) => ({ i, pad }), async (job) => job.data.i);
  },

  async 'add-to-start latency at 200 jobs/s'(b) {
    const name = queueName('latency');
    const q = new Queue(name, b.opts);
    const count = n(1000);
    const latencies = [];
    const worker = new Worker(
      name,
      async (job) => {
        latencies.push(performance.now() - job.data.t);
      },
      { ...b.opts, concurrency: 10 },
    );
    await worker.waitUntilReady();
    const done = completions(worker, count);
    const r = await measure(b, count, async () => {
      const start = performance.now();
      for (let i = 0; i < count; i++) {
        const due = start + (i * 1000) / 200;
        const wait = due - performance.now();
        if (wait > 0) await new Promise((res) => setTimeout(res, wait));
        await q.add('job', { t: performance.now() });
      }
      await done;
      latencies.sort((a, c) => a - c);
      return { p50Ms: percentile(latencies, 50), p99Ms: percentile(latencies, 99) };
    });
    await worker.close();
    await q.close();
    return r;
  },

  async '5,000 delayed jobs'(b) {
    const name = queueName('delayed');
    const q = new Queue(name, b.opts);
    const count = n(5000);
    const delay = 1000;
    // The first jobs fall due `delay` after the add began (BullMQ stamps each
    // job as it adds it): measuring from the end of the add instead credited a
    // slow add with the jobs it processed before that point.
    const dueAt = performance.now() + delay;
    await q.addBulk(Array.from({ length: count }, (_, i) => ({ name: 'job', data: { i }, opts: { delay } })));
    let worker;
    const r = await measure(b, count, async () => {
      worker = new Worker(name, async () => 'ok', { ...b.opts, concurrency: 100 });
      await completions(worker, count);
      // Rate from the moment the first jobs fell due: the delay itself is not work.
      const afterDueSeconds = (performance.now() - dueAt) / 1000;
      return { afterDueSeconds, jobsPerSec: count / afterDueSeconds };
    });
    await worker.close();
    await q.close();
    return r;
  },

  async '1,000 flows of 1 parent + 10 children'(b) {
    const parents = queueName('parents');
    const children = queueName('children');
    const flows = new FlowProducer(b.opts);
    const count = n(1000);
    const jobs = count * 11;
    let childWorker;
    let parentWorker;
    const r = await measure(b, jobs, async () => {
      childWorker = new Worker(children, async (job) => job.data.i, { ...b.opts, concurrency: 100 });
      parentWorker = new Worker(parents, async (job) => Object.keys(await job.getChildrenValues()).length, {
        ...b.opts,
        concurrency: 100,
      });
      const parentsDone = completions(parentWorker, count);
      for (let f = 0; f < count; f++) {
        await flows.add({
          name: 'parent',
          queueName: parents,
          children: Array.from({ length: 10 }, (_, i) => ({ name: 'child', queueName: children, data: { i } })),
        });
      }
      await parentsDone;
    });
    await childWorker.close();
    await parentWorker.close();
    await flows.close();
    return r;
  },
};

function printRun(label, name, x) {
  const lat = x.p50Ms !== undefined ? `  p50 ${x.p50Ms.toFixed(2)} ms  p99 ${x.p99Ms.toFixed(2)} ms` : '';
  // A machine that never went quiet (another load on it) is worth knowing of beside the figure.
  const busy = x.settleMs >= SETTLE_MAX_MS ? `  (machine still busy after ${SETTLE_MAX_MS / 1000} s)` : '';
  console.log(
    `${label.padEnd(7)} ${name.padEnd(40)} ${x.jobsPerSec.toFixed(0).padStart(8)} jobs/s  ` +
      `cpu/job node ${x.nodeCpuMsPerJob.toFixed(3)} ms + server ${x.serverCpuMsPerJob.toFixed(3)} ms${lat}${busy}`,
  );
}

function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

/** The median of each figure over the rounds. */
function medians(runs) {
  return Object.fromEntries(
    Object.keys(runs[0])
      .filter((k) => typeof runs[0][k] === 'number')
      .map((k) => [k, median(runs.map((r) => r[k]))]),
  );
}

/**
 * `ours` against `theirs` (Redis, or the ceiling), per scenario: the medians
 * of both, and the median and range of the ratios of the runs made back to
 * back in the same round.
 */
function printComparison(title, ours, theirsByName, against = 'redis') {
  console.log(`\n| ${title} | jobs/s | ${against} jobs/s | ratio, median (range) | cpu ms/job (node + server) | ${against} cpu ms/job |`);
  console.log('|---|---:|---:|---:|---:|---:|');
  for (const [name, runs] of Object.entries(ours)) {
    const theirs = theirsByName[name];
    if (!theirs) continue;
    const ratios = runs.map((x, i) => x.jobsPerSec / theirs[i].jobsPerSec);
    const [l, r] = [medians(runs), medians(theirs)];
    const lat = l.p99Ms !== undefined ? `; p99 ${l.p99Ms.toFixed(1)} vs ${r.p99Ms.toFixed(1)} ms` : '';
    const range = ratios.length > 1 ? ` (${Math.min(...ratios).toFixed(2)}-${Math.max(...ratios).toFixed(2)})` : '';
    console.log(
      `| ${name} | ${l.jobsPerSec.toFixed(0)} | ${r.jobsPerSec.toFixed(0)} | ${median(ratios).toFixed(2)}${range}${lat} | ` +
        `${(l.nodeCpuMsPerJob + l.serverCpuMsPerJob).toFixed(3)} | ${(r.nodeCpuMsPerJob + r.serverCpuMsPerJob).toFixed(3)} |`,
    );
  }
}

function refuse(message) {
  console.error(`${message}\n${usage}`);
  process.exit(2);
}

function refuseUnknown(flag, given, known) {
  const unknown = given.filter((name) => !known.includes(name));
  if (unknown.length > 0) refuse(`${flag}: unknown ${unknown.map((u) => `'${u}'`).join(', ')}; known: ${known.join('; ')}`);
}

/**
 * Forks this script to run one backend's scenarios in a process of its own
 * (see the header), and waits until that process has its backend ready.
 * `target` names the backend (`label`) and where it is; `stopTarget` stops
 * what the backend used (its server, its data directory) once the process
 * has exited.
 */
async function startBackend(target, names, stopTarget) {
  const child = fork(fileURLToPath(import.meta.url), process.argv.slice(2), {
    env: { ...process.env, LOAM_BENCH_BACKEND: JSON.stringify(target) },
    // Node's own flags carry over, but not an inspector's port, which only one process can hold.
    execArgv: process.execArgv.filter((flag) => !flag.startsWith('--inspect')),
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
    // Figures such as NaN cross as they are (JSON would make them null).
    serialization: 'advanced',
  });
  const kill = undoOnExit(() => child.kill('SIGKILL'));
  let exitedWith = null;
  const exited = new Promise((resolve) =>
    child.once('exit', (code, signal) => {
      exitedWith = signal ?? code;
      resolve();
    }),
  );
  /** The next message from the child, or a rejection once it has exited. */
  const reply = () =>
    new Promise((resolve, reject) => {
      exited.then(() => reject(new Error(`the ${target.label} backend's process exited (${exitedWith})`)));
      child.once('message', (message) => {
        if (message.error) reject(new Error(`${target.label}: ${message.error}`));
        else resolve(message.result);
      });
    });
  await reply();
  return {
    label: target.label,
    names,
    run: (scenario) => {
      const answer = reply();
      // A send to a process that has exited fails here; `answer` says why.
      if (child.connected) child.send({ scenario }, () => {});
      return answer;
    },
    stop: async () => {
      if (child.connected) child.disconnect();
      await exited;
      kill();
      stopTarget();
    },
  };
}

/**
 * The forked side of `startBackend`: points BullMQ at this process's backend,
 * says it is ready, then runs each scenario the parent names and answers its
 * figures, until the parent disconnects.
 */
async function serveBackend(target) {
  let opts = { connection: {} };
  let after = () => {};
  if (target.label === 'loam') {
    // BullMQ's own classes, unchanged, over the Loam backend.
    setDefaultBackendFactory(loamBackend({ dataDir: target.dataDir, durability }));
  } else if (target.label === 'remote') {
    setDefaultBackendFactory(loamBackend({ url: target.url, calls }));
  } else if (target.label === 'redis') {
    opts = { connection: { host: '127.0.0.1', port: target.port, maxRetriesPerRequest: null } };
  } else {
    setDefaultBackendFactory(ceilingBackend());
    after = forgetCeilingJobs;
  }
  const b = { opts, serverPid: target.serverPid ?? 0 };
  process.on('disconnect', () => process.exit(0));
  process.on('message', async ({ scenario }) => {
    try {
      const result = await scenarios[scenario](b);
      after();
      process.send({ result });
    } catch (e) {
      process.send({ error: e instanceof Error ? (e.stack ?? e.message) : String(e) });
    }
  });
  process.send({ result: 'ready' });
}

async function main() {
  const rounds = Math.max(1, Number(options.rounds));
  const warmup = Math.max(0, Number(options.warmup));
  const names = chosen === '' ? Object.keys(scenarios) : chosen.split(';');
  // A misspelt name would otherwise run nothing and print an empty table.
  refuseUnknown('--scenarios', names, Object.keys(scenarios));
  refuseUnknown('--remote', remoteScenarios, Object.keys(scenarios));
  if (only !== '') refuseUnknown('--only', only.split(','), ['loam', 'remote', 'redis', 'ceiling']);
  for (const [flag, value] of [['--rounds', rounds], ['--warmup', warmup], ['--scale', scale]]) {
    if (!Number.isFinite(value)) refuse(`${flag}: not a number`);
  }
  console.log(
    `bullmq bench: ${cpus().length} CPUs, load ${loadavg().map((l) => l.toFixed(2)).join(' ')}, scale ${scale}, ` +
      `${rounds} rounds after ${warmup} warm-up round${warmup === 1 ? '' : 's'}, Loam durability ${durability}, ` +
      `remote calls on ${calls === 'unary' ? 'streams of their own' : 'a session'}`,
  );
  const report = { cpus: cpus().length, loadBefore: loadavg(), scale, rounds, warmup, durability, calls, results: {}, warmups: {}, medians: {} };
  /** Each backend: its process, and the scenarios it runs. */
  const backends = [];
  try {
    if (wants('loam')) {
      const dataDir = mkdtempSync(join(tmpdir(), 'bench-loam-'));
      const removeDir = undoOnExit(() => rmSync(dataDir, { recursive: true, force: true }));
      backends.push(await startBackend({ label: 'loam', dataDir }, names, removeDir));
    }
    const remoteNames = names.filter((name) => remoteScenarios.includes(name));
    if (wants('remote') && (only !== '' || existsSync(serverBin)) && remoteNames.length > 0) {
      const server = await startLoamServer();
      backends.push(await startBackend({ label: 'remote', url: server.url, serverPid: server.pid }, remoteNames, server.stop));
    }
    if (wants('redis')) {
      const redis = await startRedis();
      backends.push(await startBackend({ label: 'redis', port: redis.port, serverPid: redis.pid }, names, redis.stop));
    }
    if (wants('ceiling')) {
      const ceilingNames = names.filter((name) => ceilingScenarios.includes(name));
      if (ceilingNames.length > 0) backends.push(await startBackend({ label: 'ceiling' }, ceilingNames, () => {}));
    }
    for (const backend of backends) {
      report.results[backend.label] = {};
      report.warmups[backend.label] = {};
    }
    // Each scenario runs on every backend back to back, in an order that turns
    // with each round: these machines' speed drifts within minutes, and a
    // ratio of runs made minutes apart measured the drift as much as the code.
    for (let round = 0; round < warmup + rounds; round++) {
      const counted = round >= warmup;
      for (const name of names) {
        for (let k = 0; k < backends.length; k++) {
          const backend = backends[(k + round) % backends.length];
          if (!backend.names.includes(name)) continue;
          const x = await backend.run(name);
          ((counted ? report.results : report.warmups)[backend.label][name] ??= []).push(x);
          printRun(counted ? backend.label : `${backend.label} (warm-up)`, name, x);
        }
      }
    }
  } finally {
    for (const backend of backends) await backend.stop().catch((e) => console.error(e));
  }
  for (const [label, byName] of Object.entries(report.results)) {
    report.medians[label] = Object.fromEntries(Object.entries(byName).map(([name, runs]) => [name, medians(runs)]));
  }
  const { loam, remote, redis, ceiling } = report.results;
  if (loam && redis) printComparison('scenario (in-process)', loam, redis);
  if (remote && redis) printComparison('scenario (loamBackend({ url }))', remote, redis);
  if (ceiling && redis) printComparison('scenario (a backend that costs nothing: the ceiling)', ceiling, redis);
  if (loam && ceiling) printComparison('scenario (in-process / the ceiling)', loam, ceiling, 'ceiling');
  report.loadAfter = loadavg();
  if (jsonOut) writeFileSync(jsonOut, JSON.stringify(report, null, 2));
  process.exit(0);
}

// A process forked by `startBackend` has an IPC channel; one started by hand
// with LOAM_BENCH_BACKEND in its environment is the bench itself.
const forked = process.send !== undefined ? process.env.LOAM_BENCH_BACKEND : undefined;
(forked ? serveBackend(JSON.parse(forked)) : main()).catch((e) => {
  console.error(e);
  process.exit(1);
});
