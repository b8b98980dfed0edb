/**
 * `@loam/bullmq`: BullMQ 6.7 on the Loam Jobs core, in-process or over the
 * network (`loamBackend({ url })`, a `loam-jobs serve`).
 *
 * ```ts
 * import { Queue, Worker } from '@loam/bullmq';          // BullMQ's classes, bound to Loam
 * // or keep `from 'bullmq'` and set the backend once:
 * import { setDefaultBackendFactory } from 'bullmq';
 * import { loamBackend } from '@loam/bullmq';
 * setDefaultBackendFactory(loamBackend());
 * ```
 *
 * Data lives in `./.loam` (or `$LOAM_DATA_DIR`, or `loamBackend({ dataDir })`,
 * or a queue's `connection: { dataDir }`). Every queue, worker and
 * QueueEvents of the process that names the same directory shares one open
 * store; a second process opening it fails at once (use `loam-jobs serve`).
 *
 * With a `url`, every backend is a client of that server instead:
 * `loamBackend({ url: 'http://127.0.0.1:7720', token, namespace })`.
 */
import * as path from 'node:path';
import {
  withBackend,
  type BackendFactory,
  type FlowProducerOptions,
  type JobProgress,
  type Processor,
  type QueueBaseOptions,
  type QueueEventsOptions,
  type QueueEventsProducerOptions,
  type QueueOptions,
  type WorkerOptions,
} from 'bullmq';
import { backendOptionsJson, LoamQueueBackend, type FactoryOptions, type LoamBackendSettings } from './backend.js';
import { RemoteChannel, type RemoteSettings } from './channel.js';
import { checkHeaderValues, checkNames } from './common.js';
import { callSync, loamError } from './errors.js';
import { loadAddon, type Addon } from './native.cjs';
import { RemoteQueueBackend, workerSettings } from './remote.js';

/**
 * The native addon. A platform without it can still use the package over a
 * server (`loamBackend({ url })`); only the in-process backend needs it.
 */
const addon = loadAddon();

function nativeAddon(): Addon {
  if (addon instanceof Error) {
    throw new Error(
      `@loam/bullmq: the native addon did not load (${addon.message}). The in-process backend needs it; ` +
        'loamBackend({ url }) with a loam-jobs serve does not.',
    );
  }
  return addon;
}

// Everything else of BullMQ's (Job, UnrecoverableError, DelayedError, ...),
// so that swapping `from 'bullmq'` for `from '@loam/bullmq'` keeps an import
// line that names more than the classes bound below, which take precedence.
export * from 'bullmq';
export { LoamQueueBackend } from './backend.js';
export type { LoamBackendSettings } from './backend.js';
export { RemoteQueueBackend } from './remote.js';
export type { RemoteSettings } from './channel.js';
export { fromNative } from './errors.js';

/** A queue's `connection` option: settings that override the factory's. */
export type LoamConnectionOptions = Partial<LoamBackendSettings> & Partial<RemoteSettings>;

/** Where data lives when nothing says otherwise. */
export const DEFAULT_DATA_DIR = '.loam';

/**
 * A BullMQ `BackendFactory`: over a `loam-jobs serve` when `settings.url` is
 * given, else over the embedded store (relative directories are resolved
 * against the working directory when `loamBackend()` is called). A queue's
 * `connection: { url }` makes its backend a client of that server either
 * way: the ready-made classes, bound to `loamBackend()`, took it in-process
 * without a word.
 */
export function loamBackend(settings: RemoteSettings): BackendFactory<RemoteQueueBackend, LoamConnectionOptions>;
export function loamBackend(
  settings?: Partial<LoamBackendSettings>,
): BackendFactory<LoamQueueBackend | RemoteQueueBackend, LoamConnectionOptions>;
export function loamBackend(
  settings: LoamConnectionOptions = {},
): BackendFactory<LoamQueueBackend | RemoteQueueBackend, LoamConnectionOptions> {
  const remote = remoteBackend(settings);
  if (settings.url) return remote;
  const embedded = embeddedBackend(settings);
  return (name, opts: QueueBaseOptions<LoamConnectionOptions>, options) =>
    connectionOf(opts).url ? remote(name, opts, options) : embedded(name, opts, options);
}

function embeddedBackend(settings: Partial<LoamBackendSettings>): BackendFactory<LoamQueueBackend, LoamConnectionOptions> {
  const base: LoamBackendSettings = {
    ...settings,
    dataDir: path.resolve(settings.dataDir ?? process.env.LOAM_DATA_DIR ?? DEFAULT_DATA_DIR),
  };
  return (name, opts: QueueBaseOptions<LoamConnectionOptions>, options = {}) => {
    const connection = connectionOf(opts);
    const resolved: LoamBackendSettings = {
      ...base,
      ...connection,
      dataDir: connection.dataDir ? path.resolve(connection.dataDir) : base.dataDir,
    };
    const factoryOpts = opts as FactoryOptions;
    const { LoamQueue } = nativeAddon();
    const native = callSync(() => LoamQueue.open(backendOptionsJson(resolved, name, factoryOpts)));
    return new LoamQueueBackend(native, name, factoryOpts.prefix ?? 'bull', true, {
      blocking: options.blocking,
      withBlockingConnection: options.withBlockingConnection,
      workerName: factoryOpts.name,
      namespace: resolved.namespace,
    });
  };
}

/**
 * Backends that are clients of one server. Backends with the same url, token
 * and namespace share a channel (its HTTP/2 connections), which closes, and
 * is forgotten, when the last of them does.
 */
function remoteBackend(settings: LoamConnectionOptions): BackendFactory<RemoteQueueBackend, LoamConnectionOptions> {
  const channels = new Map<string, RemoteChannel>();
  return (name, opts: QueueBaseOptions<LoamConnectionOptions>, options = {}) => {
    const connection = connectionOf(opts);
    const url = connection.url ?? settings.url;
    if (!url) throw loamError('invalid_argument', 'a remote backend needs a url');
    const resolved: RemoteSettings = {
      ...settings,
      url,
      token: connection.token ?? settings.token,
      namespace: connection.namespace ?? settings.namespace,
    };
    const factoryOpts = opts as FactoryOptions;
    checkNames(name, resolved.namespace, factoryOpts.name);
    checkHeaderValues(resolved.namespace, resolved.token);
    // Read (and refused) before a channel is opened that nothing would close.
    const worker = workerSettings(factoryOpts);
    const key = JSON.stringify([resolved.url, resolved.token ?? '', resolved.namespace ?? '']);
    let channel = channels.get(key);
    if (!channel) {
      const made: RemoteChannel = new RemoteChannel(resolved, () => {
        // Its calls in flight still finish on it; a backend made now gets a new one.
        if (channels.get(key) === made) channels.delete(key);
      });
      channel = made;
      channels.set(key, channel);
    }
    return new RemoteQueueBackend(channel, name, factoryOpts.prefix ?? 'bull', true, worker, {
      blocking: options.blocking,
      withBlockingConnection: options.withBlockingConnection,
      workerName: factoryOpts.name,
    });
  };
}

/** A queue's `connection` option, when it is Loam's settings (anything else is ignored). */
function connectionOf(opts: QueueBaseOptions<LoamConnectionOptions>): LoamConnectionOptions {
  const connection: unknown = opts.connection;
  return typeof connection === 'object' && connection !== null && !Array.isArray(connection) ? connection : {};
}

const bound = withBackend(loamBackend());

/** A class's options with `connection` left optional. */
type LoamOptions<T extends { connection?: unknown }> = Omit<T, 'connection'> & { connection?: T['connection'] };

/**
 * BullMQ's classes, bound to `loamBackend()` with the default data dir
 * (resolved when this module is loaded). Their options may be left out: the
 * backend is the connection. A Worker, which BullMQ refuses to make without a
 * `connection`, is given an empty one. (The type arguments' `any` defaults
 * are BullMQ's.)
 */
export const Queue = bound.Queue as new <D = any, R = any, N extends string = string>(
  name: string,
  opts?: LoamOptions<QueueOptions<LoamConnectionOptions>>,
) => InstanceType<typeof bound.Queue<D, R, N>>;
export const Worker = new Proxy(bound.Worker, {
  construct(target, [name, processor, opts, ...rest]: unknown[], newTarget) {
    const withConnection = { connection: {}, ...(opts as object | undefined) };
    return Reflect.construct(target, [name, processor, withConnection, ...rest], newTarget);
  },
}) as {
  new <D = any, R = any, N extends string = string, P extends JobProgress = JobProgress>(
    name: string,
    processor?: string | URL | null | Processor<D, R, N, P>,
    opts?: LoamOptions<WorkerOptions<LoamConnectionOptions>>,
  ): InstanceType<typeof bound.Worker<D, R, N, P>>;
  RateLimitError: typeof bound.Worker.RateLimitError;
};
export const QueueEvents = bound.QueueEvents as new <R = any>(
  name: string,
  opts?: LoamOptions<QueueEventsOptions<LoamConnectionOptions>>,
) => InstanceType<typeof bound.QueueEvents<R>>;
export const QueueEventsProducer = bound.QueueEventsProducer as new (
  name: string,
  opts?: LoamOptions<QueueEventsProducerOptions<LoamConnectionOptions>>,
) => InstanceType<typeof bound.QueueEventsProducer>;
export const FlowProducer = bound.FlowProducer as new (
  opts?: LoamOptions<FlowProducerOptions<LoamConnectionOptions>>,
) => InstanceType<typeof bound.FlowProducer>;

// The classes are types too, as BullMQ's are (`constructor(private queue:
// Queue)`): the instance types of BullMQ's own classes. `export *` above
// brings none of these names, which the bound classes take.
export type Queue<D = any, R = any, N extends string = string> = InstanceType<typeof bound.Queue<D, R, N>>;
export type Worker<D = any, R = any, N extends string = string, P extends JobProgress = JobProgress> = InstanceType<
  typeof bound.Worker<D, R, N, P>
>;
export type QueueEvents<R = any> = InstanceType<typeof bound.QueueEvents<R>>;
export type QueueEventsProducer = InstanceType<typeof bound.QueueEventsProducer>;
export type FlowProducer = InstanceType<typeof bound.FlowProducer>;
