import { defineConfig } from 'vitest/config';

// src/native.cts is TypeScript too: Vite strips types from .ts, .mts and .tsx only.
const typescript = { oxc: { include: /\.[cm]?tsx?$/ } };

const shared = {
  include: ['test/**/*.test.ts'],
  testTimeout: 20_000,
  hookTimeout: 20_000,
};

/**
 * The same tests twice: against the in-process backend, and against a
 * `loam-jobs serve` that `test/remote-server.ts` starts (`loamBackend({ url })`).
 * `vitest run --project in-process` (or `remote`) runs one of them.
 */
export default defineConfig({
  test: {
    projects: [
      { ...typescript, test: { ...shared, name: 'in-process' } },
      {
        ...typescript,
        test: {
          ...shared,
          name: 'remote',
          // Pure conversions, no backend: they run once, in the other project.
          exclude: ['test/wire.test.ts', 'test/codec.test.ts', 'test/channel.test.ts'],
          env: { LOAM_TEST_BACKEND: 'remote' },
          globalSetup: ['test/remote-server.ts'],
        },
      },
    ],
  },
});
