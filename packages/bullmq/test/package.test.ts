// The package as npm installs it: `pnpm pack`ed, unpacked into a fresh
// project's node_modules beside only its runtime dependencies and peer, and
// imported by name from there. The other tests import src/ or go through the
// workspace link, where a file missing from `files`, a broken `exports` map, a
// binary the loader does not find in the package, or a runtime import of a
// devDependency would all still work.
import { execFileSync } from 'node:child_process';
import {
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  realpathSync,
  rmSync,
  symlinkSync,
  writeFileSync,
} from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';

// Packaging does not depend on the backend: checked once, in the in-process run.
const describeOnce = process.env.LOAM_TEST_BACKEND === 'remote' ? describe.skip : describe;

type Manifest = {
  name: string;
  main: string;
  types: string;
  exports: Record<string, unknown>;
  dependencies: Record<string, string>;
  peerDependencies: Record<string, string>;
};

const packageDir = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const fromPackage = createRequire(path.join(packageDir, 'package.json'));
const tsc = fromPackage.resolve('typescript/bin/tsc');

/** The directory of a package as this package's own node_modules resolves it (pnpm's store, symlinks followed). */
function installedRoot(name: string): string {
  let file: string;
  try {
    file = fromPackage.resolve(`${name}/package.json`);
  } catch {
    file = fromPackage.resolve(name); // its exports map does not expose package.json
  }
  for (let dir = path.dirname(file); dir !== path.dirname(dir); dir = path.dirname(dir)) {
    const candidate = path.join(dir, 'package.json');
    if (existsSync(candidate) && JSON.parse(readFileSync(candidate, 'utf8')).name === name) return realpathSync(dir);
  }
  throw new Error(`no package root above ${file}`);
}

let root = '';
let app = '';
let files: string[] = [];
let installed = '';
/** The package.json in the tarball, as npm reads it. */
let manifest: Manifest;

/** Runs an ES module in the test project, with nothing of this process's Loam or Node settings; returns its stdout. */
function runInApp(file: string, code: string, env: Record<string, string> = {}): string {
  writeFileSync(path.join(app, file), code);
  return execFileSync(process.execPath, [file], { cwd: app, env: { PATH: process.env.PATH ?? '', ...env }, encoding: 'utf8' });
}

describeOnce('the packed package', () => {
  beforeAll(() => {
    // Real path: the addon's path that Node reports is one.
    root = realpathSync(mkdtempSync(path.join(tmpdir(), 'loam-pack-')));
    app = path.join(root, 'app');
    // Node looks for packages in every ancestor's node_modules: one there would
    // resolve what the installed package failed to bring.
    for (let dir = root; dir !== path.dirname(dir); dir = path.dirname(dir)) {
      if (existsSync(path.join(dir, 'node_modules'))) throw new Error(`${dir}/node_modules would leak into the test project`);
    }
    execFileSync('pnpm', ['pack', '--pack-destination', root], { cwd: packageDir, stdio: 'pipe' });
    const [tarball] = readdirSync(root).filter(f => f.endsWith('.tgz'));
    files = execFileSync('tar', ['tzf', path.join(root, tarball)], { encoding: 'utf8' })
      .split('\n')
      .filter(Boolean)
      .map(f => f.replace(/^package\//, ''));

    installed = path.join(app, 'node_modules', '@loam', 'bullmq');
    mkdirSync(installed, { recursive: true });
    execFileSync('tar', ['xzf', path.join(root, tarball), '-C', installed, '--strip-components=1']);
    manifest = JSON.parse(readFileSync(path.join(installed, 'package.json'), 'utf8'));
    writeFileSync(path.join(app, 'package.json'), JSON.stringify({ name: 'app', private: true, type: 'module' }));
    // What npm would install beside it, taken from pnpm's store instead of the
    // network; their own dependencies resolve from their real paths there.
    // @types/node is the TypeScript user's own: the declarations name Node's types.
    const beside = [...Object.keys(manifest.dependencies), ...Object.keys(manifest.peerDependencies), '@types/node'];
    for (const name of beside) {
      const link = path.join(app, 'node_modules', name);
      mkdirSync(path.dirname(link), { recursive: true });
      symlinkSync(installedRoot(name), link, 'dir');
    }
  }, 60_000);

  afterAll(() => {
    if (root) rmSync(root, { recursive: true, force: true });
  });

  it('holds the built code, its declarations, the native addon with its loader and the license, and no tests or sources', () => {
    // Source maps ship too, each with the TypeScript it maps to inside it:
    // src/ itself does not ship. pnpm packs the workspace's LICENSE.
    expect(files).toContain('LICENSE');
    const shipped =
      /^(package\.json|README\.md|LICENSE|dist\/(cjs\/)?[^/]+\.(js|cjs|d\.ts|d\.cts|js\.map|cjs\.map)|dist\/(cjs\/)?gen\/.+\.(js|d\.ts|js\.map)|dist\/cjs\/package\.json|native\/(index\.cjs|index\.d\.ts|[^/]+\.node))$/;
    expect(files.filter(f => !shipped.test(f))).toEqual([]);
    expect(files).toEqual(
      expect.arrayContaining([
        'dist/index.js',
        'dist/factory.js',
        'dist/cjs/index.js',
        'dist/cjs/factory.js',
        'dist/cjs/package.json',
        'native/index.cjs',
        'native/index.d.ts',
      ]),
    );
    expect(files.filter(f => /^native\/[^/]+\.node$/.test(f)).length).toBeGreaterThan(0);
    // Every entry point that package.json names is in the tarball.
    const targets = (entry: unknown): string[] =>
      typeof entry === 'string' ? [entry] : Object.values(entry as Record<string, unknown>).flatMap(targets);
    const entries = [manifest.main, manifest.types, ...targets(manifest.exports)];
    expect(entries.map(e => e.replace(/^\.\//, '')).filter(e => !files.includes(e))).toEqual([]);
    const maps = files.filter(f => f.endsWith('.js.map'));
    expect(maps.length).toBeGreaterThan(0);
    const withoutSources = maps.filter(f => {
      const map = JSON.parse(readFileSync(path.join(installed, f), 'utf8'));
      return map.sourcesContent?.length !== map.sources.length || map.sourcesContent.some((s: unknown) => typeof s !== 'string');
    });
    expect(withoutSources).toEqual([]);
  });

  it("a job goes through the package's bound Queue and Worker, on the addon inside the installed package", () => {
    const out = runInApp(
      'bound.mjs',
      `
      import { createRequire } from 'node:module';
      import { Queue as PlainQueue } from 'bullmq';
      import { Queue, Worker, loamBackend } from '@loam/bullmq';
      const queue = new Queue('packed');
      const worker = new Worker('packed', async job => job.data.n * 2);
      const done = new Promise(resolve => worker.on('completed', (_job, value) => resolve(value)));
      await queue.add('double', { n: 21 });
      const result = await done;
      const plain = new PlainQueue('packed', {}, loamBackend());
      const counts = await plain.getJobCounts('completed', 'waiting');
      await Promise.all([worker.close(), queue.close(), plain.close()]);
      const addons = Object.keys(createRequire(import.meta.url).cache).filter(f => /loam-jobs[^/]*\\.node$/.test(f));
      console.log(JSON.stringify({ result, counts, addons }));
      `,
    );
    const { result, counts, addons } = JSON.parse(out);
    expect(result).toBe(42);
    expect(counts).toEqual({ completed: 1, waiting: 0 });
    expect(addons).toHaveLength(1);
    expect(path.dirname(addons[0])).toBe(path.join(installed, 'native'));
    // The default store, ./.loam of the process's working directory.
    expect(existsSync(path.join(app, '.loam'))).toBe(true);
  });

  it('the factory subpath is the backend of a plain bullmq Queue and Worker, in $LOAM_DATA_DIR', () => {
    const dataDir = path.join(root, 'factory-data');
    const out = runInApp(
      'factory.mjs',
      `
      import { Queue, Worker, setDefaultBackendFactory } from 'bullmq';
      import factory from '@loam/bullmq/factory';
      setDefaultBackendFactory(factory);
      const queue = new Queue('via-factory');
      // BullMQ's own Worker asks for a connection whatever the backend (README).
      const worker = new Worker('via-factory', async job => job.data.to.toUpperCase(), { connection: {} });
      const done = new Promise(resolve => worker.on('completed', (_job, value) => resolve(value)));
      const job = await queue.add('shout', { to: 'ada' });
      const result = await done;
      const stored = await queue.getJob(job.id);
      await Promise.all([worker.close(), queue.close()]);
      console.log(JSON.stringify({ result, returnvalue: stored.returnvalue, qualifiedName: queue.qualifiedName }));
      `,
      { LOAM_DATA_DIR: dataDir },
    );
    expect(JSON.parse(out)).toEqual({ result: 'ADA', returnvalue: 'ADA', qualifiedName: 'bull:via-factory' });
    expect(readdirSync(dataDir)).toContain('jobs.redb');
  });

  it('a CommonJS app requires the package and its factory, and gets BullMQ\'s own CommonJS classes from it', () => {
    writeFileSync(
      path.join(app, 'required.cjs'),
      `
      const bullmq = require('bullmq');
      const { Queue, Worker, Job, UnrecoverableError, loamBackend } = require('@loam/bullmq');
      const factory = require('@loam/bullmq/factory').default;
      (async () => {
        const options = { connection: { dataDir: './.loam-cjs' } };
        const queue = new Queue('required', options);
        const worker = new Worker('required', async job => {
          if (job.data.n < 0) throw new UnrecoverableError('negative');
          return job.data.n * 2;
        }, options);
        const done = new Promise(resolve => worker.on('completed', (job, value) => resolve([job instanceof bullmq.Job, value])));
        await queue.add('double', { n: 21 });
        const [isJob, result] = await done;
        await Promise.all([worker.close(), queue.close()]);
        bullmq.setDefaultBackendFactory(factory);
        const plain = new bullmq.Queue('required-plain');
        const added = await plain.add('a', {});
        await plain.close();
        const same = Job === bullmq.Job && UnrecoverableError === bullmq.UnrecoverableError;
        console.log(JSON.stringify({ isJob, result, same, added: added.id, loamBackend: typeof loamBackend }));
      })();
      `,
    );
    const out = execFileSync(process.execPath, ['required.cjs'], {
      cwd: app,
      env: { PATH: process.env.PATH ?? '', LOAM_DATA_DIR: path.join(root, 'required-data') },
      encoding: 'utf8',
    });
    expect(JSON.parse(out)).toEqual({ isJob: true, result: 42, same: true, added: '1', loamBackend: 'function' });
  });

  it("an import line naming BullMQ's other exports keeps working with '@loam/bullmq' in place of 'bullmq'", () => {
    const out = runInApp(
      'swapped.mjs',
      `
      import * as bullmq from 'bullmq';
      import { Queue, Worker, Job, UnrecoverableError, DelayedError, WaitingChildrenError, RateLimitError, JobScheduler } from '@loam/bullmq';
      const borrowed = { Job, UnrecoverableError, DelayedError, WaitingChildrenError, RateLimitError, JobScheduler };
      const same = Object.entries(borrowed).filter(([name, value]) => value !== bullmq[name]).map(([name]) => name);
      console.log(JSON.stringify({ same, bound: Queue !== bullmq.Queue && Worker !== bullmq.Worker }));
      `,
    );
    expect(JSON.parse(out)).toEqual({ same: [], bound: true });
  });

  it("a TypeScript user's code type-checks against the installed declarations, themselves checked too", () => {
    writeFileSync(
      path.join(app, 'usage.ts'),
      `
      import { setDefaultBackendFactory } from 'bullmq';
      import factory from '@loam/bullmq/factory';
      import { Queue, Worker, loamBackend, type LoamConnectionOptions } from '@loam/bullmq';
      setDefaultBackendFactory(factory);
      const connection: LoamConnectionOptions = { dataDir: './.loam' };
      setDefaultBackendFactory(loamBackend(connection));
      const queue = new Queue<{ n: number }>('typed');
      const worker = new Worker<{ n: number }, number>('typed', async job => job.data.n * 2);
      // The bound classes are types too, as BullMQ's are.
      class Mailer {
        constructor(private readonly queue: Queue<{ n: number }>, readonly worker: Worker) {}
        send(n: number) { return this.queue.add('mail', { n }); }
      }
      export const mailer = new Mailer(queue, worker);
      export const closed: Promise<void[]> = Promise.all([worker.close(), queue.close()]);
      `,
    );
    // skipLibCheck off: with it on, a declaration importing a file left out of
    // the package silently becomes \`any\`.
    const compilerOptions = {
      module: 'NodeNext',
      moduleResolution: 'NodeNext',
      target: 'ES2022',
      strict: true,
      skipLibCheck: false,
      noEmit: true,
      types: ['node'],
    };
    // The same in CommonJS: a .cts file resolves the "require" declarations.
    writeFileSync(
      path.join(app, 'usage-required.cts'),
      `
      import { Queue, Worker, Job, loamBackend } from '@loam/bullmq';
      import factory = require('@loam/bullmq/factory');
      const queue = new Queue<{ n: number }>('typed', { connection: loamBackend() ? {} : {} });
      const worker = new Worker<{ n: number }, number>('typed', async (job: Job<{ n: number }>) => job.data.n * 2);
      export const backend = factory.default;
      export const closed: Promise<void[]> = Promise.all([worker.close(), queue.close()]);
      `,
    );
    writeFileSync(
      path.join(app, 'tsconfig.json'),
      JSON.stringify({ compilerOptions, files: ['usage.ts', 'usage-required.cts'] }),
    );
    // And a CommonJS project on TypeScript's default resolution for it
    // (node10, NestJS's), which reads `types` and `typesVersions`, not `exports`.
    writeFileSync(
      path.join(app, 'usage-node10.ts'),
      `
      import { Queue, Job, loamBackend } from '@loam/bullmq';
      import factory from '@loam/bullmq/factory';
      export const backend = factory;
      export class Mailer {
        constructor(private readonly queue: Queue) {}
        send(): Promise<Job> { return this.queue.add('mail', {}); }
      }
      export const made = loamBackend;
      `,
    );
    const node10 = { ...compilerOptions, module: 'CommonJS', moduleResolution: 'Node10', esModuleInterop: true };
    writeFileSync(path.join(app, 'tsconfig.node10.json'), JSON.stringify({ compilerOptions: node10, files: ['usage-node10.ts'] }));
    const check = (project: string) => {
      try {
        execFileSync(process.execPath, [tsc, '-p', project], { encoding: 'utf8' });
        return '';
      } catch (err) {
        return String((err as { stdout?: string }).stdout ?? err);
      }
    };
    expect(check(app)).toBe('');
    expect(check(path.join(app, 'tsconfig.node10.json'))).toBe('');
  }, 60_000);
});
