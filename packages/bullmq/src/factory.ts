/**
 * `@loam/bullmq/factory`: a ready BullMQ `BackendFactory` (data in `./.loam`
 * or `$LOAM_DATA_DIR`), for tools that take a factory module, e.g.
 * `setDefaultBackendFactory((await import('@loam/bullmq/factory')).default)`.
 */
import { loamBackend } from './index.js';

const factory = loamBackend();
export default factory;
