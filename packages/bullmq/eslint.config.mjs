// The TypeScript lint policy of @loam/bullmq (`pnpm run lint`, part of `pnpm
// test`, after the build that generates src/gen, which the type-aware rules
// read): typescript-eslint's type-checked recommendations, which catch the
// mistakes that matter in a backend made of promises (a promise not awaited or
// passed where a callback is expected, a value awaited that is no promise),
// less the rules below, each off for the reason given. Warnings fail the run
// (`--max-warnings 0`). vitest.config.ts and bench/ are plain set-up and are
// left out.
import js from '@eslint/js';
import { defineConfig } from 'eslint/config';
import tseslint from 'typescript-eslint';

export default defineConfig(
  { ignores: ['dist/**', 'native/**', 'src/gen/**'] },
  js.configs.recommended,
  tseslint.configs.recommendedTypeChecked,
  {
    languageOptions: {
      // The tests' config covers src/ and test/ alike.
      parserOptions: { project: ['./tsconfig.test.json'], tsconfigRootDir: import.meta.dirname },
    },
    rules: {
      // BullMQ's IQueueBackend types job data, options and raw job hashes as
      // `any`, and so do its classes' members that the tests read; the
      // backend takes such values as BullMQ gives them and checks them where
      // they meet the wire (wire.ts) or the addon. Every use of one would need
      // a cast that checks nothing.
      '@typescript-eslint/no-explicit-any': 'off',
      '@typescript-eslint/no-unsafe-argument': 'off',
      '@typescript-eslint/no-unsafe-assignment': 'off',
      '@typescript-eslint/no-unsafe-member-access': 'off',
      '@typescript-eslint/no-unsafe-return': 'off',
      '@typescript-eslint/no-unsafe-call': 'off',
      // An `async` member with no `await` still turns a throw into a rejected
      // promise, which is what BullMQ's callers handle; a plain function would
      // throw at them instead.
      '@typescript-eslint/require-await': 'off',
      // A parameter BullMQ passes and a backend has no use for (`close(force)`)
      // keeps its name, marked with `_`.
      '@typescript-eslint/no-unused-vars': ['error', { argsIgnorePattern: '^_', varsIgnorePattern: '^_' }],
      // A caught value passed on as it was (`catch (err) { return Promise.reject(err) }`)
      // is no new reason to type.
      '@typescript-eslint/prefer-promise-reject-errors': ['error', { allowThrowingUnknown: true }],
    },
  },
);
