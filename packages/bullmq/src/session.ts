/**
 * A `Session` of `loam-jobs serve`: the unary calls of `JobsService` as
 * messages on one HTTP/2 stream (the Connect streaming protocol, binary),
 * each with an id that its answer carries back, in any order.
 *
 * A unary call costs an HTTP/2 stream, a Connect call object, an abort
 * controller and its clean-up; at a worker's rate of calls that was most of
 * the client's CPU. On a session a call is one framed message each way.
 */
import * as http2 from 'node:http2';
import { Code, ConnectError } from '@connectrpc/connect';
import { codeFromString } from '@connectrpc/connect/protocol-connect';
import {
  ErrorDetailSchema,
  SessionRequestSchema,
  SessionResponseSchema,
  type SessionRequest,
  type SessionResponse,
} from './gen/loam/jobs/v1/jobs_pb.js';
import { decodeMessage, encodeMessage } from './codec.js';

/** The calls a session carries: a `JobsService` unary method name each. */
export type SessionCall = Exclude<SessionRequest['call']['case'], 'cancel' | undefined>;

/** A call framed for the stream, with the id its answer will carry. */
export interface EncodedCall {
  id: bigint;
  framed: Buffer;
}

/**
 * The largest call a session carries. A larger one goes on its own HTTP/2
 * stream: a message over the server's request limit ends the whole session
 * (its framing cannot be trusted past it), which would fail every call on it.
 */
export const SESSION_MAX_MESSAGE_BYTES = 1 << 20;

const PATH = '/loam.jobs.v1.JobsService/Session';
/** The Connect envelope flag of the stream's last message (its end, maybe an error). */
const END_STREAM = 0b10;

interface Waiter {
  resolve(answer: unknown): void;
  reject(err: unknown): void;
}

export class Session {
  private connection?: http2.ClientHttp2Session;
  private stream?: http2.ClientHttp2Stream;
  private readonly waiting = new Map<bigint, Waiter>();
  private nextId = 1n;
  /** Received bytes not yet read as whole messages. */
  private received: Buffer = Buffer.alloc(0);

  constructor(
    private readonly url: string,
    private readonly headers: Record<string, string>,
  ) {}

  /** Whether calls are in flight (the channel stays open while they are). */
  get busy(): boolean {
    return this.waiting.size > 0;
  }

  /**
   * `request` (a message or its init object) as the unary call `call`, at the
   * caller's clock `nowMs`, framed for the stream; see [`send`](Session.send).
   */
  encode(call: SessionCall, request: unknown, nowMs: number): EncodedCall {
    const id = this.nextId++;
    const message = { id, nowMs: BigInt(nowMs), call: { case: call, value: request } } as never;
    return { id, framed: envelope(encodeMessage(SessionRequestSchema, message)) };
  }

  /** Sends an encoded call; resolves with the call's response message. */
  send({ id, framed }: EncodedCall, signal?: AbortSignal): Promise<unknown> {
    return new Promise<unknown>((resolve, reject) => {
      const stream = this.open();
      let onAbort: (() => void) | undefined;
      this.waiting.set(id, {
        resolve: answer => {
          if (onAbort) signal?.removeEventListener('abort', onAbort);
          resolve(answer);
        },
        reject: err => {
          if (onAbort) signal?.removeEventListener('abort', onAbort);
          reject(err);
        },
      });
      stream.write(framed);
      if (signal) {
        onAbort = () => {
          // The server stops the call; its answer (canceled) finds nobody waiting.
          const waiter = this.waiting.get(id);
          if (!waiter) return;
          this.waiting.delete(id);
          if (this.stream === stream && !stream.closed) {
            const cancel = encodeMessage(SessionRequestSchema, { id, call: { case: 'cancel', value: {} } });
            stream.write(envelope(cancel));
          }
          waiter.reject(new ConnectError('the call was canceled', Code.Canceled));
        };
        signal.addEventListener('abort', onAbort, { once: true });
      }
    });
  }

  /** Ends the stream and the connection; calls in flight fail. */
  close(): void {
    this.fail(new ConnectError('the session was closed', Code.Canceled));
    this.stream?.close();
    this.connection?.close();
    this.stream = undefined;
    this.connection = undefined;
  }

  private open(): http2.ClientHttp2Stream {
    if (this.stream && !this.stream.closed && !this.stream.destroyed) return this.stream;
    if (!this.connection || this.connection.closed || this.connection.destroyed) {
      const connection = http2.connect(this.url);
      // A connection error also ends its stream, whose handlers fail the calls.
      connection.on('error', () => undefined);
      connection.on('close', () => {
        if (this.connection === connection) this.connection = undefined;
      });
      this.connection = connection;
    }
    const stream = this.connection.request({
      ':method': 'POST',
      ':path': PATH,
      'content-type': 'application/connect+proto',
      'connect-protocol-version': '1',
      ...this.headers,
    });
    this.stream = stream;
    this.received = Buffer.alloc(0);
    let status = 200;
    stream.on('response', headers => {
      status = Number(headers[':status'] ?? 200);
    });
    stream.on('data', (chunk: Buffer) => {
      if (this.stream !== stream) return;
      if (status !== 200) {
        this.received = Buffer.concat([this.received, chunk]);
        return;
      }
      this.read(chunk);
    });
    stream.on('end', () => {
      if (this.stream !== stream) return;
      if (status !== 200) this.fail(httpError(status, this.received));
      else this.fail(new ConnectError('the session ended', Code.Unavailable));
    });
    stream.on('error', err => {
      if (this.stream === stream) this.fail(ConnectError.from(err, Code.Unavailable));
    });
    stream.on('close', () => {
      if (this.stream !== stream) return;
      this.stream = undefined;
      this.fail(new ConnectError('the session closed', Code.Unavailable));
    });
    return stream;
  }

  /** Reads the whole messages among the bytes received so far. */
  private read(chunk: Buffer): void {
    let bytes = this.received.length === 0 ? chunk : Buffer.concat([this.received, chunk]);
    while (bytes.length >= 5) {
      const flags = bytes[0]!;
      const length = bytes.readUInt32BE(1);
      if (bytes.length < 5 + length) break;
      const message = bytes.subarray(5, 5 + length);
      bytes = bytes.subarray(5 + length);
      if (flags & END_STREAM) {
        this.fail(endError(message) ?? new ConnectError('the session ended', Code.Unavailable));
        continue;
      }
      let response: SessionResponse;
      try {
        response = decodeMessage(SessionResponseSchema, message);
      } catch (err) {
        // The stream cannot be trusted past a message it cannot read.
        this.fail(new ConnectError(`the server sent an unreadable message: ${String(err)}`, Code.Internal));
        this.stream?.close();
        this.stream = undefined;
        return;
      }
      this.answer(response);
    }
    this.received = bytes;
  }

  private answer(response: SessionResponse): void {
    const waiter = this.waiting.get(response.id);
    if (!waiter) return;
    this.waiting.delete(response.id);
    const result = response.result;
    if (result.case === 'error') {
      const { code, message, detail } = result.value;
      const details = detail ? [{ desc: ErrorDetailSchema, value: detail }] : undefined;
      waiter.reject(connectError(code, message, details));
    } else if (result.case === undefined) {
      waiter.reject(new ConnectError('the session answered with nothing', Code.Internal));
    } else {
      waiter.resolve(result.value);
    }
  }

  /** Fails every call in flight with `err`. */
  private fail(err: ConnectError): void {
    const waiters = [...this.waiting.values()];
    this.waiting.clear();
    for (const w of waiters) w.reject(err);
  }
}

function envelope(message: Uint8Array): Buffer {
  const framed = Buffer.allocUnsafe(5 + message.length);
  framed[0] = 0;
  framed.writeUInt32BE(message.length, 1);
  framed.set(message, 5);
  return framed;
}

/** An error as Connect names its code (`invalid_argument`), with its details. */
function connectError(
  code: string | undefined,
  message: string,
  details?: ConstructorParameters<typeof ConnectError>[3],
): ConnectError {
  return new ConnectError(message, codeFromString(code ?? '') ?? Code.Unknown, undefined, details);
}

/** The error of the stream's end message (JSON), if it carries one. */
function endError(message: Uint8Array): ConnectError | undefined {
  try {
    const end = JSON.parse(Buffer.from(message).toString('utf8')) as { error?: { code?: string; message?: string } };
    return end.error && connectError(end.error.code, end.error.message ?? '');
  } catch {
    return new ConnectError('the session ended with an unreadable message', Code.Internal);
  }
}

/** A refusal before the stream started (an HTTP status, a Connect error body). */
function httpError(status: number, body: Buffer): ConnectError {
  try {
    const error = JSON.parse(body.toString('utf8')) as { code?: string; message?: string };
    return connectError(error.code, error.message ?? `HTTP ${status}`);
  } catch {
    return new ConnectError(`HTTP ${status}`, status === 401 ? Code.Unauthenticated : Code.Unavailable);
  }
}
