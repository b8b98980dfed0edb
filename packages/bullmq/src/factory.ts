/**
 * `@loam/bullmq/factory`: a ready BullMQ `BackendFactory`, for tools that take
 * a factory module, e.g.
 * `setDefaultBackendFactory((await import('@loam/bullmq/factory')).default)`.
 * With `$LOAM_URL` set it is a client of that `loam-jobs serve` (with
 * `$LOAM_TOKEN` and `$LOAM_NAMESPACE` when set, and `$LOAM_CALLS=unary` for one
 * HTTP/2 stream per call); otherwise data lives in `./.loam` or `$LOAM_DATA_DIR`.
 */
import type { BackendFactory, IQueueBackend } from 'bullmq';
import { loamBackend, type LoamConnectionOptions } from './index.js';

const url = process.env.LOAM_URL;
const factory: BackendFactory<IQueueBackend, LoamConnectionOptions> = url
  ? loamBackend({
      url,
      token: process.env.LOAM_TOKEN || undefined,
      namespace: process.env.LOAM_NAMESPACE || undefined,
      calls: process.env.LOAM_CALLS === 'unary' ? 'unary' : 'session',
    })
  : loamBackend();
export default factory;
