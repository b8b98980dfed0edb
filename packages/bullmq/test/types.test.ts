import { execFileSync } from 'node:child_process';
import { createRequire } from 'node:module';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';

const here = path.dirname(fileURLToPath(import.meta.url));
const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc');

// Types do not depend on the backend: checked once, in the in-process run.
const describeOnce = process.env.LOAM_TEST_BACKEND === 'remote' ? describe.skip : describe;

describeOnce('types', () => {
  it("the README's TypeScript usage compiles: options may be left out, the factory module is a BackendFactory", () => {
    let output = '';
    try {
      execFileSync(process.execPath, [tsc, '-p', path.join(here, 'types', 'tsconfig.json')], { encoding: 'utf8' });
    } catch (err) {
      output = String((err as { stdout?: string }).stdout ?? err);
    }
    expect(output).toBe('');
  }, 60_000);
});
