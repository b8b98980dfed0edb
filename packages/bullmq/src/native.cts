/**
 * The native addon, loaded synchronously with CommonJS's `require`, from
 * either build of this package: loaded with a top-level `await import`, the
 * package could not be `require()`d at all (Node refuses an ES module graph
 * with top-level await), which a CommonJS app (TypeScript compiled to
 * CommonJS, NestJS) needs. A platform without the addon still gets the
 * package: only the in-process backend needs it.
 */
import * as path from 'node:path';

export type Addon = typeof import('../native/index.js');

/** The package's root: this file is in `src/` or `dist/` (the ES module build), or in `dist/cjs/`. */
const packageRoot = path.resolve(__dirname, path.basename(__dirname) === 'cjs' ? '../..' : '..');

/** The addon, or why it did not load. */
export function loadAddon(): Addon | Error {
  try {
    // eslint-disable-next-line @typescript-eslint/no-require-imports -- loaded synchronously, by design (above)
    return require(path.join(packageRoot, 'native', 'index.cjs')) as Addon;
  } catch (err) {
    return err instanceof Error ? err : new Error(String(err));
  }
}
