/**
 * vitest globalSetup of the `remote` project: starts `loam-jobs serve` on a
 * free loopback port with a temporary data dir, provides its URL to the
 * tests (`inject('loamServerUrl')`), and stops it (SIGTERM) afterwards.
 *
 * The binary is `$LOAM_JOBS_BIN`, else `<target dir>/debug/loam-jobs` (the
 * target dir is `$CARGO_TARGET_DIR` or the repository's `target/`), as
 * `cargo build -p loam-jobs-server` leaves it.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
import type { TestProject } from 'vitest/node';

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../..');

function serverBinary(): string {
  const bin =
    process.env.LOAM_JOBS_BIN ??
    path.join(process.env.CARGO_TARGET_DIR ?? path.join(repo, 'target'), 'debug', 'loam-jobs');
  if (!existsSync(bin)) {
    throw new Error(
      `loam-jobs not found at ${bin}: build it with \`cargo build -p loam-jobs-server\` or set LOAM_JOBS_BIN`,
    );
  }
  return bin;
}

/** Waits for the server's start-up line and reads the port it bound. */
function listening(server: ChildProcess): Promise<string> {
  return new Promise((resolve, reject) => {
    let log = '';
    let started = false;
    const timer = setTimeout(() => reject(new Error(`loam-jobs did not start in time:\n${log}`)), 30_000);
    // Both pipes stay drained for the server's lifetime (a full pipe would block it).
    const read = (chunk: Buffer) => {
      if (started) return;
      log += chunk.toString();
      // eslint-disable-next-line no-control-regex -- colour codes (ESC [ ... m) stripped from the log
      const bound = /listen=(\S+:\d+)/.exec(log.replace(/\x1b\[[0-9;]*m/g, ''));
      if (bound) {
        started = true;
        clearTimeout(timer);
        resolve(bound[1]);
      }
    };
    server.stdout?.on('data', read);
    server.stderr?.on('data', read);
    server.once('exit', code => {
      if (started) return;
      clearTimeout(timer);
      reject(new Error(`loam-jobs exited with ${code} before listening:\n${log}`));
    });
  });
}

/** A running `loam-jobs serve`. */
export interface LoamServer {
  url: string;
  dataDir: string;
  /** SIGTERM, wait for the exit, remove the data dir. */
  stop(): Promise<void>;
  /** SIGKILL, wait for the exit; the data dir stays for a restart. */
  kill(): Promise<void>;
}

/**
 * Starts a server: `env` adds settings such as LOAM_JOBS_TOKENS; `listen` and
 * `dataDir` restart one where another was (default: a free port, a new dir).
 */
export async function startLoamServer(
  env: Record<string, string> = {},
  options: { listen?: string; dataDir?: string; args?: string[] } = {},
): Promise<LoamServer> {
  const dataDir = options.dataDir ?? mkdtempSync(path.join(tmpdir(), 'loam-remote-test-'));
  const args = ['serve', '--listen', options.listen ?? '127.0.0.1:0', '--data-dir', dataDir, ...(options.args ?? [])];
  const server = spawn(serverBinary(), args, {
    env: { ...process.env, NO_COLOR: '1', RUST_LOG: process.env.RUST_LOG ?? 'info', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  const address = await listening(server);
  const ended = (signal: NodeJS.Signals) => {
    const exited = new Promise(resolve => server.once('exit', resolve));
    server.kill(signal);
    return exited;
  };
  return {
    url: `http://${address}`,
    dataDir,
    stop: async () => {
      await ended('SIGTERM');
      rmSync(dataDir, { recursive: true, force: true });
    },
    kill: async () => {
      await ended('SIGKILL');
    },
  };
}

export default async function setup(project: TestProject) {
  const server = await startLoamServer();
  project.provide('loamServerUrl', server.url);
  return () => server.stop();
}
