import { describe, expect, it, onTestFinished, vi } from 'vitest';
import { ConnectionClosedError } from 'bullmq';
import { Code, ConnectError } from '@connectrpc/connect';
import * as http2 from 'node:http2';
import type * as net from 'node:net';
import { neverSent, RemoteChannel } from '../src/channel.js';
import { decodeMessage, encodeMessage } from '../src/codec.js';
import { SessionRequestSchema, SessionResponseSchema } from '../src/gen/loam/jobs/v1/jobs_pb.js';

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

/**
 * A fake `loam-jobs serve` session endpoint: the first stream gets `first`
 * (it reads nothing), later ones answer every JobAdmin call `done`.
 */
async function fakeSessionServer(first: (stream: http2.ServerHttp2Stream) => void) {
  let streams = 0;
  const server = http2.createServer();
  server.on('stream', stream => {
    streams++;
    stream.on('error', () => undefined);
    if (streams === 1) {
      first(stream);
      return;
    }
    stream.respond({ ':status': 200, 'content-type': 'application/connect+proto' });
    let bytes = Buffer.alloc(0);
    stream.on('data', (chunk: Buffer) => {
      bytes = Buffer.concat([bytes, chunk]);
      while (bytes.length >= 5 && bytes.length >= 5 + bytes.readUInt32BE(1)) {
        const length = bytes.readUInt32BE(1);
        const request = decodeMessage(SessionRequestSchema, bytes.subarray(5, 5 + length));
        bytes = bytes.subarray(5 + length);
        const response = { id: request.id, result: { case: 'jobAdmin', value: { done: true } } } as never;
        stream.write(envelope(0, encodeMessage(SessionResponseSchema, response)));
      }
    });
  });
  await new Promise<void>(resolve => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as net.AddressInfo;
  onTestFinished(async () => {
    await new Promise(resolve => server.close(resolve));
  });
  return { url: `http://127.0.0.1:${port}`, streams: () => streams };
}

function envelope(flags: number, message: Uint8Array): Buffer {
  const framed = Buffer.alloc(5 + message.length);
  framed[0] = flags;
  framed.writeUInt32BE(message.length, 1);
  framed.set(message, 5);
  return framed;
}

/** A job removal (not resendable: whether a cut one was applied is not known) on `channel`. */
function removal(channel: RemoteChannel) {
  return channel.call({ command: 'removeJob', jobId: '1' }, (c, o) =>
    c.jobAdmin({ queue: 'q', jobId: '1', op: { case: 'remove', value: {} } }, o),
  );
}

/** A channel to `url`, released when the test ends. */
function channelTo(url: string): RemoteChannel {
  const channel = new RemoteChannel({ url, reconnectTimeoutMs: 2_000 });
  channel.retain();
  onTestFinished(() => channel.release());
  return channel;
}

describe('calls on a session that ends or is refused: sent again if the server never read them, else failed with why', () => {
  it('a call unanswered when the server ended the session cleanly (as it does at shutdown)', async () => {
    // Before: failed with ConnectionClosedError ("may have been applied").
    const server = await fakeSessionServer(stream => {
      stream.respond({ ':status': 200, 'content-type': 'application/connect+proto' });
      stream.once('data', () => stream.end(envelope(0b10, Buffer.from('{}'))));
    });
    await expect(removal(channelTo(server.url))).resolves.toMatchObject({ done: true });
    expect(server.streams()).toBe(2);
  });

  it('a call whose stream HTTP/2 refused', async () => {
    const server = await fakeSessionServer(stream => stream.close(http2.constants.NGHTTP2_REFUSED_STREAM));
    await expect(removal(channelTo(server.url))).resolves.toMatchObject({ done: true });
    expect(server.streams()).toBe(2);
  });

  it('but not a call on a session the server ended with an error: that error is the answer', async () => {
    const server = await fakeSessionServer(stream => {
      stream.respond({ ':status': 200, 'content-type': 'application/connect+proto' });
      const end = JSON.stringify({ error: { code: 'resource_exhausted', message: 'message over the limit' } });
      stream.once('data', () => stream.end(envelope(0b10, Buffer.from(end))));
    });
    await expect(removal(channelTo(server.url))).rejects.toMatchObject({ code: 'LOAM_RESOURCE_EXHAUSTED' });
    expect(server.streams()).toBe(1);
  });

  it.each([
    // Before: every status but 401 was `unavailable`, so a wrong path behind
    // a proxy (404) was retried as a lost connection, for ever by a Worker.
    ['refused with an HTTP status (as Connect maps it, and a unary call reads it)', 404, true],
    // Before: "<htm" read as a message of 1.7 GB, and the call waited for it.
    ['answered with 200 and a page that is no Connect stream', 200, false],
  ])('nor one whose session a proxy %s', async (_, status, ends) => {
    const server = await fakeSessionServer(stream => {
      stream.respond({ ':status': status, 'content-type': 'text/html' });
      if (ends) stream.end('<html>not here</html>');
      else stream.write('<html><body>a proxy page</body>');
    });
    await expect(removal(channelTo(server.url))).rejects.toMatchObject({ code: 'LOAM_UNIMPLEMENTED' });
    expect(server.streams()).toBe(1);
  }, 5_000);

  it('a compressed message on the session (it asks for none) ends it: its call fails rather than take it for its answer', async () => {
    const server = await fakeSessionServer(stream => {
      stream.respond({ ':status': 200, 'content-type': 'application/connect+proto' });
      // A well-formed answer to the call, but flagged compressed: read as it
      // is, a compressed one would be garbage or, as here, a wrong answer.
      stream.once('data', (chunk: Buffer) => {
        const { id } = decodeMessage(SessionRequestSchema, chunk.subarray(5));
        const response = { id, result: { case: 'jobAdmin', value: { done: true } } } as never;
        stream.write(envelope(0b01, encodeMessage(SessionResponseSchema, response)));
      });
    });
    await expect(removal(channelTo(server.url))).rejects.toBeInstanceOf(ConnectionClosedError);
  }, 5_000);
});

describe('a resendable call is not sent again once its key may have lapsed on the server', () => {
  it('even while the answers of other calls keep the unreachable window open', async () => {
    vi.useFakeTimers();
    onTestFinished(() => {
      vi.useRealTimers();
    });
    const channel = new RemoteChannel({ url: 'http://127.0.0.1:9' });
    channel.retain();
    onTestFinished(() => channel.release());
    // Each attempt of the add hangs 26 s on a silent connection, then is cut:
    // any of them may have been applied.
    const sent: number[] = [];
    const add = channel
      .call(
        { command: 'addJob' },
        () => {
          sent.push(Date.now());
          return new Promise<never>((_, reject) =>
            setTimeout(() => reject(new ConnectError('cut', Code.Unavailable)), 26_000),
          );
        },
        undefined,
        { resendable: true },
      )
      .catch((err: unknown) => err);
    const others = setInterval(() => void channel.call({ command: 'getCounts' }, () => Promise.resolve({})), 5_000);
    await vi.advanceTimersByTimeAsync(300_000);
    clearInterval(others);
    expect(await add).toBeInstanceOf(ConnectionClosedError);
    // Before: six attempts, the last 131 s after the first, past the key's 95 s.
    expect(sent.length).toBeGreaterThan(1);
    expect(sent.at(-1)! - sent[0]).toBeLessThanOrEqual(channel.resendWindowMs - 60_000);
  });
});

describe('a channel tells its factory when nothing uses it', () => {
  it('once the last backend using it lets go, each time', () => {
    // Before: a factory kept one channel for every namespace ever used.
    let unused = 0;
    const channel = new RemoteChannel({ url: 'http://127.0.0.1:9' }, () => unused++);
    channel.retain();
    channel.retain();
    channel.release();
    expect(unused).toBe(0);
    channel.release();
    expect(unused).toBe(1);
    channel.retain();
    channel.release();
    expect(unused).toBe(2);
  });
});
