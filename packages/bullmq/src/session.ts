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
import { codeFromHttpStatus, codeFromString } from '@connectrpc/connect/protocol-connect';
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
/** A Connect envelope's header: a flags byte and the message's length. */
const HEADER_BYTES = 5;
/** The Connect envelope flag of a compressed message (the session asks for none). */
const COMPRESSED = 0b01;
/** The most of a refusal's body read. */
const MAX_ERROR_BODY_BYTES = 64 << 10;

/**
 * How long a connection may take to be made, and how a made one is found
 * dead when it died without a word (no FIN, no RST).
 */
export interface ConnectionTimeouts {
  /** A connection not made within this long (name lookup, TCP, TLS) is given up; its calls were never sent. */
  connectTimeoutMs: number;
  /** A PING is sent once nothing was received for between one and two of these. */
  pingIntervalMs: number;
  /** A PING not answered within this long ends the connection (its calls fail, the next call reconnects). */
  pingTimeoutMs: number;
}

/**
 * Why a call failed that the server never read, so never applied: its
 * session ended cleanly with the call unanswered (a server shutting down
 * stops reading, answers every call it read, then ends the stream), or
 * HTTP/2 refused its stream. It is tried again as a call never sent is
 * (see `neverSent`).
 */
export class NotRead extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'NotRead';
  }
}

interface Waiter {
  resolve(answer: unknown): void;
  reject(err: unknown): void;
}

export class Session {
  private connection?: http2.ClientHttp2Session;
  private stream?: http2.ClientHttp2Stream;
  private readonly waiting = new Map<bigint, Waiter>();
  private nextId = 1n;
  /**
   * Received chunks of a message not yet whole, their total length, and the
   * length of the message they start (a header's worth until the header is
   * in): they are joined once, when the message is complete, so reading a
   * large message costs its size, not its size times its chunks.
   */
  private partial: Buffer[] = [];
  private partialBytes = 0;
  private partialNeeds = 0;
  /** Whether the stream received anything since the keepalive last looked. */
  private heard = false;
  /** How many streams were opened (see `liveStream`). */
  private streams = 0;

  constructor(
    private readonly url: string,
    private readonly headers: Record<string, string>,
    private readonly timeouts: ConnectionTimeouts,
  ) {}

  /** Whether calls are in flight (the channel stays open while they are). */
  get busy(): boolean {
    return this.waiting.size > 0;
  }

  /**
   * The number of the stream a call sent now goes on, if its connection is
   * made (else `undefined`). The server starts the calls of one stream in the
   * order they came, so a call sent on stream `n` is behind every call sent
   * on it before; a call sent while connecting may yet fail unsent. Each new
   * stream gets a new number: a call on a stream that failed is not behind
   * anything sent on the next.
   */
  get liveStream(): number | undefined {
    const connection = this.connection;
    const stream = this.stream;
    if (!connection || connection.connecting || connection.closed || connection.destroyed) return undefined;
    if (!stream || stream.closed || stream.destroyed) return undefined;
    return this.streams;
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
      let stream: http2.ClientHttp2Stream;
      try {
        stream = this.open();
      } catch (err) {
        // A connection that is closing (GOAWAY) or gone refuses new streams;
        // nothing of the call was written.
        this.connection = undefined;
        reject(notRead(`the session could not open a stream: ${String(err)}`));
        return;
      }
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
          // The server stops a read or a long-poll (a write it has begun runs to
          // its end); either answer finds nobody waiting.
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
    if (this.stream) {
      if (!this.stream.closed && !this.stream.destroyed) return this.stream;
      // Over, but its close not heard yet: its calls fail now, as its close would fail them.
      this.end(this.stream, new ConnectError('the session closed', Code.Unavailable));
    }
    if (!this.connection || this.connection.closed || this.connection.destroyed) this.connection = this.connect();
    const connection = this.connection;
    const stream = connection.request({
      ':method': 'POST',
      ':path': PATH,
      'content-type': 'application/connect+proto',
      'connect-protocol-version': '1',
      ...this.headers,
    });
    this.stream = stream;
    this.streams++;
    this.partial = [];
    this.partialBytes = 0;
    let status = 200;
    const wasRefused = refusalOf(stream, connection);
    const errorBody: Buffer[] = [];
    let errorBytes = 0;
    const refusedWith = () => httpError(status, Buffer.concat(errorBody));
    stream.on('response', headers => {
      status = Number(headers[':status'] ?? 200);
      const type = headers['content-type'] ?? '';
      // A proxy's page answered with 200 is no session: read as one, its
      // first bytes made a length of gigabytes, and every call waited for it.
      if (status === 200 && !type.startsWith('application/connect+proto')) {
        const hint = 'is url a loam-jobs serve?';
        this.end(stream, new ConnectError(`the server answered the session with ${type || 'no content-type'}; ${hint}`, Code.Unimplemented));
      } else if (status !== 200) {
        // A refusal whose body does not end within a PING's time (a proxy's
        // page left open) is read as far as it came, rather than held for.
        const { pingTimeoutMs } = this.timeouts;
        const cutOff = setTimeout(() => this.end(stream, refusedWith()), pingTimeoutMs);
        cutOff.unref();
        // Not holding the body read so far once the stream is gone.
        stream.once('close', () => clearTimeout(cutOff));
      }
    });
    stream.on('data', (chunk: Buffer) => {
      if (this.stream !== stream) return;
      this.heard = true;
      if (status === 200) this.read(stream, chunk);
      else {
        errorBody.push(chunk);
        errorBytes += chunk.length;
        // A Connect error is short: a longer refusal is not waited out (a
        // proxy's page that never ended held every call).
        if (errorBytes >= MAX_ERROR_BODY_BYTES) this.end(stream, refusedWith());
      }
    });
    stream.on('end', () => {
      this.end(stream, status !== 200 ? refusedWith() : new ConnectError('the session ended', Code.Unavailable));
    });
    const refusal = () => (wasRefused() ? notRead('the server refused the stream') : undefined);
    stream.on('error', err => this.end(stream, refusal() ?? ConnectError.from(err, Code.Unavailable)));
    stream.on('close', () => this.end(stream, refusal() ?? new ConnectError('the session closed', Code.Unavailable)));
    return stream;
  }

  /** A new HTTP/2 connection, kept alive by PINGs while nothing else arrives on it. */
  private connect(): http2.ClientHttp2Session {
    const connection = http2.connect(this.url);
    // A connection error also ends its stream, whose handlers fail the calls.
    connection.on('error', () => undefined);
    // PINGs cannot go until the connection is made: one whose SYNs (or TLS
    // handshake) get no answer held its calls until the kernel gave up, some
    // two minutes, far past `reconnectTimeoutMs`. Its calls were never sent:
    // the connection is the session's own, and nothing goes on it unmade.
    const { connectTimeoutMs, pingIntervalMs, pingTimeoutMs } = this.timeouts;
    const connectTimer = setTimeout(() => connection.destroy(connectTimedOut(connectTimeoutMs)), connectTimeoutMs);
    connectTimer.unref();
    connection.once('connect', () => clearTimeout(connectTimer));
    // A server going away (GOAWAY) takes no new streams: the next call opens a new connection.
    noteGoaway(connection);
    connection.on('goaway', () => {
      if (this.connection === connection) this.connection = undefined;
    });
    let pingTimer: NodeJS.Timeout | undefined;
    const idleCheck = setInterval(() => {
      if (this.heard || pingTimer) {
        this.heard = false;
        return;
      }
      // Nothing came for a whole interval: a connection that died without a
      // word would hold its calls forever, so ask the server to answer.
      pingTimer = setTimeout(() => {
        connection.destroy(new Error(`no answer to an HTTP/2 PING in ${pingTimeoutMs} ms`));
      }, pingTimeoutMs);
      pingTimer.unref();
      const answered = () => {
        clearTimeout(pingTimer);
        pingTimer = undefined;
      };
      try {
        if (!connection.ping(answered)) answered();
      } catch {
        // Destroyed since: its close handler cleans up.
        answered();
      }
    }, pingIntervalMs);
    idleCheck.unref();
    connection.on('close', () => {
      clearTimeout(connectTimer);
      clearInterval(idleCheck);
      clearTimeout(pingTimer);
      if (this.connection === connection) this.connection = undefined;
    });
    return connection;
  }

  /**
   * The stream is over (its end message, its end, an error, its close): its
   * calls fail with `err`, and the next call opens a new stream rather than
   * writing into one the server no longer reads. Later events of a stream
   * already over are ignored.
   */
  private end(stream: http2.ClientHttp2Stream, err: ConnectError): void {
    if (this.stream !== stream) return;
    this.stream = undefined;
    this.partial = [];
    this.partialBytes = 0;
    this.fail(err);
    if (!stream.closed) stream.close();
  }

  /** Reads the whole messages among the bytes received so far. */
  private read(stream: http2.ClientHttp2Stream, chunk: Buffer): void {
    let bytes = chunk;
    if (this.partialBytes > 0) {
      this.partial.push(chunk);
      this.partialBytes += chunk.length;
      if (this.partialBytes < this.partialNeeds) return;
      try {
        bytes = Buffer.concat(this.partial, this.partialBytes);
      } catch (err) {
        // An answer this process cannot hold (its memory, or past what a
        // Buffer holds): thrown in this handler, it would end the process.
        this.end(stream, new ConnectError(`an answer of ${this.partialBytes} bytes could not be held: ${String(err)}`, Code.ResourceExhausted));
        return;
      }
      this.partial = [];
      this.partialBytes = 0;
    }
    while (bytes.length >= HEADER_BYTES) {
      const flags = bytes[0];
      const length = bytes.readUInt32BE(1);
      // Asked for none, a compressed message is not the server's: the
      // stream cannot be trusted.
      if (flags & COMPRESSED) {
        this.end(stream, new ConnectError('the server sent a compressed message on the session', Code.Internal));
        return;
      }
      if (bytes.length < HEADER_BYTES + length) break;
      const message = bytes.subarray(HEADER_BYTES, HEADER_BYTES + length);
      bytes = bytes.subarray(HEADER_BYTES + length);
      if (flags & END_STREAM) {
        // Nothing follows the end message; calls sent from now on go on a new
        // stream. An end without an error answered every call the server
        // read. An end with one (a request it could not read) stays that
        // error for every call: which of them was at fault is not known, and
        // sent again, it would end the next session too.
        this.end(stream, endError(message) ?? notRead('the session ended before the server read the call'));
        return;
      }
      let response: SessionResponse;
      try {
        response = decodeMessage(SessionResponseSchema, message);
      } catch (err) {
        // The stream cannot be trusted past a message it cannot read.
        this.end(stream, new ConnectError(`the server sent an unreadable message: ${String(err)}`, Code.Internal));
        return;
      }
      this.answer(response);
    }
    if (bytes.length > 0) {
      this.partial.push(bytes);
      this.partialBytes = bytes.length;
      this.partialNeeds = bytes.length >= HEADER_BYTES ? HEADER_BYTES + bytes.readUInt32BE(1) : HEADER_BYTES;
    }
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

/**
 * The error a connection not made within `ms` is given up with (the
 * session's destroyed, a unary call's connecting attempt aborted): a failed
 * connect, as the kernel's own timeout reads, so its calls count as never
 * sent (see `neverSent`).
 */
export function connectTimedOut(ms: number): Error {
  return Object.assign(new Error(`the connection was not made in ${ms} ms`), { code: 'ETIMEDOUT', syscall: 'connect' });
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

/**
 * The last stream id of each connection's GOAWAY whose code was a refusal:
 * Node gives that code to every stream of the connection, to those the
 * server took (at or below it) too.
 */
const refusingGoawayAfter = new WeakMap<http2.Http2Session, number>();

/** Keeps what `refusalOf` needs of `connection`'s GOAWAYs. */
export function noteGoaway(connection: http2.Http2Session): void {
  connection.on('goaway', (code: number, lastStreamId: number) => {
    if (code === http2.constants.NGHTTP2_REFUSED_STREAM) refusingGoawayAfter.set(connection, lastStreamId);
  });
}

/**
 * Whether HTTP/2 refused `stream`, asked once it has failed: closed with
 * REFUSED_STREAM, which says the server took none of it (RFC 9113, 8.7):
 * hyper refuses a stream past its concurrent streams, and Node one above a
 * GOAWAY's last stream id, or one still queued to go when a GOAWAY came
 * (seen at a server's graceful shutdown). Not one answered, nor one that
 * carries the code of a refusing GOAWAY (`noteGoaway`) at or below its last
 * stream id. A graceful GOAWAY (no error, last stream 2^31-1, then the
 * last one taken) says nothing of a stream refused on its own.
 */
export function refusalOf(stream: http2.ClientHttp2Stream, connection: http2.Http2Session): () => boolean {
  let responded = false;
  stream.once('response', () => (responded = true));
  return () => {
    if (responded || stream.rstCode !== http2.constants.NGHTTP2_REFUSED_STREAM) return false;
    const last = refusingGoawayAfter.get(connection);
    return last === undefined || stream.id === undefined || stream.id > last;
  };
}

/** A call's failure, unavailable, whose cause says the server never read the call. */
function notRead(message: string): ConnectError {
  return new ConnectError(message, Code.Unavailable, undefined, undefined, new NotRead(message));
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

/**
 * A refusal before the stream started: a Connect error body's code, else
 * the HTTP status's, as Connect maps it (a proxy's 404 for a wrong path is
 * `unimplemented`, not a connection to retry for ever; 502, 503 and 504 are
 * `unavailable`), as connect-node's unary calls read the same refusal.
 */
function httpError(status: number, body: Buffer): ConnectError {
  let error: { code?: unknown; message?: unknown } | undefined;
  try {
    error = JSON.parse(body.toString('utf8')) as typeof error;
  } catch {
    error = undefined;
  }
  const message = typeof error?.message === 'string' ? error.message : `HTTP ${status}`;
  const code = typeof error?.code === 'string' ? codeFromString(error.code) : undefined;
  return new ConnectError(message, code ?? codeFromHttpStatus(status));
}
