import { describe, expect, it } from 'vitest';
import { neverSent } from '../src/channel.js';

/** A Node error of a system call, as `net` raises them. */
function sysError(code: string, syscall: string): Error {
  return Object.assign(new Error(`${syscall} ${code}`), { code, syscall });
}

describe('which failed calls never reached the server', () => {
  it('a refused or unresolved connection, however deep in the causes', () => {
    expect(neverSent(sysError('ECONNREFUSED', 'connect'))).toBe(true);
    expect(neverSent(new Error('the pending stream has been canceled', { cause: sysError('ENOTFOUND', 'getaddrinfo') }))).toBe(true);
    expect(neverSent(sysError('ECONNRESET', 'read'))).toBe(false);
    expect(neverSent(new Error('the session ended'))).toBe(false);
  });

  it('a name with several addresses, each refused (Node tries IPv6 and IPv4 alike)', () => {
    // Before: an AggregateError has no syscall of its own, so the call failed at once.
    const both = new AggregateError([sysError('ECONNREFUSED', 'connect'), sysError('ECONNREFUSED', 'connect')]);
    expect(neverSent(new Error('canceled', { cause: both }))).toBe(true);
    const oneReached = new AggregateError([sysError('ECONNREFUSED', 'connect'), sysError('ECONNRESET', 'read')]);
    expect(neverSent(oneReached)).toBe(false);
  });
});
