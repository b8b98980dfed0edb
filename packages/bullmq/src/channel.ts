/**
 * `RemoteChannel`: the connections of the remote backend to one
 * `loam-jobs serve`, shared by every backend a `loamBackend({ url })` factory
 * makes. Calls use the Connect protocol (binary) over HTTP/2; each
 * connection carries at most `maxStreamsPerConnection` calls at once (below
 * the server's HTTP/2 limit, `--max-concurrent-streams`, 1,000 by default: a
 * client over it gets its connection closed), further calls open another
 * connection, up to `maxConnections`, then wait for a free stream.
 *
 * Errors are converted here, once: a refused call becomes the error the
 * in-process backend throws for the same BullMQ command, and a call the
 * connection failed becomes BullMQ's `ConnectionClosedError`, which BullMQ
 * retries (as it retries a Redis command cut by a dropped connection).
 *
 * A connection that died without a word (no FIN, no RST: a NAT or load
 * balancer that forgot it, a server host that lost power) is found by HTTP/2
 * PINGs, sent only when nothing was received for `pingIntervalMs`, and by a
 * long poll's deadline.
 */
import type * as http2 from 'node:http2';
import { ConnectionClosedError } from 'bullmq';
import { Code, ConnectError, createClient, type CallOptions, type Client } from '@connectrpc/connect';
import { createConnectTransport, Http2SessionManager } from '@connectrpc/connect-node';
import { ErrorDetailSchema, JobsService, type ErrorDetail } from './gen/loam/jobs/v1/jobs_pb.js';
import { fromServer, loamError, type BullmqCommand } from './errors.js';
import {
  connectTimedOut,
  NotRead,
  noteGoaway,
  refusalOf,
  Session,
  SESSION_MAX_MESSAGE_BYTES,
  type ConnectionTimeouts,
  type SessionCall,
} from './session.js';

type UnaryMethod = (request: unknown, options?: CallOptions) => Promise<unknown>;

export type JobsClient = Client<typeof JobsService>;

/** How to reach a server (see `loamBackend({ url })`). */
export interface RemoteSettings {
  /** `http://host:port` of `loam-jobs serve` (`https://` for TLS). */
  url: string;
  /** Bearer token, when the server has authentication on. */
  token?: string;
  /** Namespace to work in, when the server has no tokens (with tokens the token decides it). */
  namespace?: string;
  /** Concurrent calls per HTTP/2 connection (default 100). */
  maxStreamsPerConnection?: number;
  /** HTTP/2 connections to open at most (default 4). */
  maxConnections?: number;
  /**
   * `session` (the default): every call is a message on one `Session` stream.
   * `unary`: one HTTP/2 stream per call, for proxies that carry no
   * bidirectional streams.
   */
  calls?: 'session' | 'unary';
  /**
   * A connection that received nothing for one to two of these (the
   * keepalive looks once per interval) is sent an HTTP/2 PING (default
   * 10 s): it costs nothing while calls are answered.
   */
  pingIntervalMs?: number;
  /** A PING not answered within this long ends its connection (default 5 s); the next call reconnects. */
  pingTimeoutMs?: number;
  /**
   * A connection not made within this long (name lookup, TCP and TLS;
   * default 10 s, as ioredis's `connectTimeout`) is given up, and its calls,
   * never sent, are tried again.
   */
  connectTimeoutMs?: number;
  /**
   * The largest request to send (default 80 MiB, the server's default
   * `--max-request-bytes`): a larger one fails at once with
   * `LOAM_RESOURCE_EXHAUSTED`. Node's HTTP/2 client sent a request of about
   * 90 MB on and on after the server had refused it, and the call (and every
   * call ordered behind it) never settled.
   */
  maxRequestBytes?: number;
  /**
   * How long calls wait for a server they cannot reach, from when it was
   * first found away (default 20 s): a
   * call whose connection could not be made was never sent, so it is sent
   * again once the server is back, as ioredis holds Redis commands while it
   * reconnects. A call cut while it was on its way fails at once (BullMQ's
   * `ConnectionClosedError`): it may have been carried out.
   */
  reconnectTimeoutMs?: number;
}

/**
 * connect-node's session manager, with an `error` listener on every
 * connection that carries a call. The manager destroys a connection whose
 * PING timed out with an error, and once it has let go of the connection no
 * listener of its own takes that error: Node then ends the process
 * (uncaught). The connection's calls fail through their streams anyway.
 */
class QuietSessionManager extends Http2SessionManager {
  private readonly heard = new WeakSet<http2.Http2Session>();
  /** The connecting attempt seen last, and since when (see `giveUpSlowConnect`). */
  private connecting?: { attempt: object; since: number };

  constructor(
    url: string,
    private readonly timeouts: ConnectionTimeouts,
  ) {
    super(url, timeouts);
  }

  override async request(...args: Parameters<Http2SessionManager['request']>): Promise<http2.ClientHttp2Stream> {
    // connect-node waits for a connection as long as the kernel does (some
    // two minutes when SYNs get no answer): one not made in time is given
    // up. Looked at four times a timeout while the call waits, so that an
    // attempt begun later (after a PING found an idle connection dead) is
    // timed from its own start.
    const ms = this.timeouts.connectTimeoutMs;
    const connectTimer = setInterval(() => this.giveUpSlowConnect(ms), Math.max(1, Math.floor(ms / 4)));
    connectTimer.unref();
    let stream;
    try {
      stream = await super.request(...args);
    } catch (err) {
      // No stream was made: nothing of the call was sent.
      throw neverSent(err) ? err : new NotSent('no stream was made for the call', { cause: err });
    } finally {
      clearInterval(connectTimer);
    }
    const connection = stream.session;
    if (connection) {
      if (!this.heard.has(connection)) {
        this.heard.add(connection);
        connection.on('error', () => undefined);
        noteGoaway(connection);
      }
      // Heard before connect-node's own listener, which fails the call with
      // this error: marked never read, the call is sent again (as on a
      // session). Only an error of this stream's own: a GOAWAY's error is one
      // object, given to every stream of its connection, those the server
      // took too.
      const wasRefused = refusalOf(stream, connection);
      stream.once('error', (err: NodeJS.ErrnoException) => {
        const ownError = err.code === 'ERR_HTTP2_STREAM_ERROR';
        if (ownError && wasRefused()) err.cause ??= new NotRead('the server refused the stream');
      });
    }
    return stream;
  }

  /**
   * Aborts the connecting attempt once it has been connecting for `ms`.
   * Only that attempt: the manager's own `abort` also destroys its
   * connections that got a GOAWAY, with calls on them the server read.
   * connect-node keeps its state in `s` (pinned version; a test of the
   * timeout fails if that changes).
   */
  private giveUpSlowConnect(ms: number): void {
    const state = (this as unknown as { s?: { t?: string; abort?: (reason: Error) => void } }).s;
    if (!state || state.t !== 'connecting') return;
    const now = Date.now();
    if (this.connecting?.attempt !== state) this.connecting = { attempt: state, since: now };
    else if (now - this.connecting.since >= ms) {
      state.abort?.(connectTimedOut(ms));
    }
  }
}

/** What a call may be given besides its signal. */
export interface CallHooks {
  /** Learns the connection a unary call goes on. */
  carriedBy?: (connection: Connection) => void;
  /**
   * Told, after each attempt is sent, the number of the session stream it
   * went on when that stream's connection is made (see `Session.liveStream`),
   * else `undefined`: a call that must follow this one may be sent behind it
   * on that stream, without waiting for its answer.
   */
  sentOn?: (stream: number | undefined) => void;
  /** Awaited before each attempt: what must be sent before the call is. */
  sendAfter?: () => Promise<void>;
  /**
   * Awaited, after `sendAfter`, before an attempt that goes on an HTTP/2
   * stream of its own (too large for the session): nothing sent before it
   * on the session stream is ahead of it there, so a write that must follow
   * another waits for that one's answer.
   */
  unaryAfter?: () => Promise<void>;
  /**
   * The server recognizes the call made again (an add under an idempotency
   * key): one cut on its way, which may or may not have been applied, is
   * tried again as one that never left is, rather than failed.
   */
  resendable?: boolean;
  /**
   * Once aborted, a call that could not reach its server is not tried again:
   * its backend closed, or its Worker is closing (BullMQ's Worker cuts its
   * blocking calls first, then waits for its main loop; waiting each of the
   * loop's calls out, closing a Worker while its server was away took 38 s).
   */
  stopRetrying?: AbortSignal;
}

/** Why a unary call failed that never left the client: no HTTP/2 stream was made for it (see `neverSent`). */
class NotSent extends Error {
  constructor(message: string, options: ErrorOptions) {
    super(message, options);
    this.name = 'NotSent';
  }
}

/** A call the caller itself cut short (disconnectBlocking, close). */
export class CallAborted extends Error {
  constructor() {
    super('the call was interrupted');
    this.name = 'CallAborted';
  }
}

interface Connection {
  session: Http2SessionManager;
  client: JobsClient;
  inFlight: number;
}

const DEFAULT_STREAMS = 100;
const DEFAULT_CONNECTIONS = 4;
const DEFAULT_PING_INTERVAL_MS = 10_000;
const DEFAULT_PING_TIMEOUT_MS = 5_000;
const DEFAULT_CONNECT_TIMEOUT_MS = 10_000;
const DEFAULT_MAX_REQUEST_BYTES = 80 << 20;
const DEFAULT_RECONNECT_TIMEOUT_MS = 20_000;
/** The first and the longest wait between attempts to reach a server that is away. */
const RECONNECT_FIRST_WAIT_MS = 50;
const RECONNECT_MAX_WAIT_MS = 1_000;
/**
 * How many times a resendable call cut on its way is sent again. Other calls
 * reset the unreachable window each time one gets through, so a call whose
 * every attempt kills its connection (or its server) would go on forever.
 */
const MAX_RESENDS = 5;
/**
 * What a resendable call's key outlives its last attempt by, at least: for
 * slow clocks and servers. Without a bound of its own, a call whose
 * attempts each hung on a silent connection, while other calls' answers
 * kept resetting the unreachable window, went again 131 s after its first,
 * past its key's 95 s, and could be applied twice.
 */
const RESEND_SPARE_MS = 60_000;

/**
 * How long calls wait once the server refused the token (unauthenticated,
 * permission denied). BullMQ's Worker asks for its next job again at once
 * after an error that is not a lost connection: with a wrong token that was
 * some 2,500 refused calls a second and a whole core, where ioredis with a
 * wrong password tries again on its reconnect schedule.
 */
const REFUSED_TOKEN_WAIT_MS = 1_000;

export class RemoteChannel {
  private readonly connections: Connection[] = [];
  /** Calls waiting for a free stream, oldest first. */
  private readonly waiting: (() => void)[] = [];
  private readonly fixedHeaders: Record<string, string> = {};
  private readonly maxStreams: number;
  private readonly maxConnections: number;
  private readonly timeouts: ConnectionTimeouts;
  /** Backends using the channel; with none and no call in flight, the connections close. */
  private users = 0;
  /** Ordered writes of every backend on this channel not answered yet (see `track`). */
  private readonly pendingWrites = new Set<Promise<void>>();
  /** Whether a tracked write was answered in this turn of the event loop (see `writesAnswered`). */
  private answeredThisTurn = false;
  /** With `calls: 'session'`: the stream every call goes on, and a client whose methods use it. */
  private readonly session?: Session;
  private readonly sessionClient?: JobsClient;
  /** The session stream the call just made went on, if its connection is made (see `CallHooks.sentOn`). */
  private sentOn: number | undefined;
  /** The `CallHooks.unaryAfter` of the call being made, for the session's methods. */
  private unaryAfter: (() => Promise<void>) | undefined;
  /** Until when calls wait, after the server refused the token. */
  private refusedUntil = 0;
  /**
   * Since when the server could not be reached (0: it answers). Calls give up
   * `reconnectTimeoutMs` after it, together: counted per call, writes queued
   * in order each waited a whole window after the one before (the fifth add
   * of an outage failed after five windows).
   */
  private unreachableSince = 0;
  /**
   * Whether the server said it keeps a bulk add's key for the whole call
   * (`EnqueueBulkResponse.keyKept`). Until then each job goes under a key of
   * its own too: a server from before such keys ignores them, and a bulk sent
   * again there would add its jobs twice.
   */
  bulkKeysKept = false;

  /**
   * `unused` is told each time the channel closes, no backend using it and
   * no call in flight (a factory then forgets it: one made per namespace
   * used stayed for good).
   */
  constructor(
    readonly settings: RemoteSettings,
    private readonly unused?: () => void,
  ) {
    checkSettings(settings);
    this.maxStreams = Math.max(1, settings.maxStreamsPerConnection ?? DEFAULT_STREAMS);
    this.maxConnections = Math.max(1, settings.maxConnections ?? DEFAULT_CONNECTIONS);
    if (settings.token) this.fixedHeaders.authorization = `Bearer ${settings.token}`;
    if (settings.namespace) this.fixedHeaders['loam-namespace'] = settings.namespace;
    this.timeouts = {
      connectTimeoutMs: Math.max(1, settings.connectTimeoutMs ?? DEFAULT_CONNECT_TIMEOUT_MS),
      pingIntervalMs: Math.max(1, settings.pingIntervalMs ?? DEFAULT_PING_INTERVAL_MS),
      pingTimeoutMs: Math.max(1, settings.pingTimeoutMs ?? DEFAULT_PING_TIMEOUT_MS),
    };
    if ((settings.calls ?? 'session') === 'session') {
      const session = new Session(settings.url, this.fixedHeaders, this.timeouts);
      this.session = session;
      // A message over the server's request limit ends the session, failing
      // every call behind it: a larger call goes on its own stream, whose
      // transport refuses one over `maxRequestBytes` before it is sent.
      const sessionMaxBytes = Math.min(SESSION_MAX_MESSAGE_BYTES, settings.maxRequestBytes ?? DEFAULT_MAX_REQUEST_BYTES);
      // The same methods as a Connect client's, each a message on the session
      // (a large one a unary call of its own).
      this.sessionClient = new Proxy({} as JobsClient, {
        get: (_, method: string) => (request: never, options?: CallOptions) => {
          const encoded = session.encode(method as SessionCall, request, Date.now());
          if (encoded.framed.length <= sessionMaxBytes) {
            const answer = session.send(encoded, options?.signal);
            this.sentOn = session.liveStream;
            return answer;
          }
          this.sentOn = undefined;
          const unary = () => this.unary(client => (client[method as keyof JobsClient] as UnaryMethod)(request, options));
          const after = this.unaryAfter;
          return after ? after().then(unary) : unary();
        },
      });
    }
  }

  /** The session stream a call sent now goes on, if its connection is made (see `Session.liveStream`). */
  get liveStream(): number | undefined {
    return this.session?.liveStream;
  }

  /**
   * How long the server keeps a resendable call's key (its idempotency TTL):
   * the answer may be lost on a connection that died without a word (found
   * out within two ping intervals, the keepalive looking once per interval,
   * and a ping timeout), and the call is then tried until the server has
   * been unreachable for `reconnectTimeoutMs`. Plus `RESEND_SPARE_MS`: a
   * call is not sent again past this window less the spare, counted from
   * its first attempt that may have been applied (see `call`).
   */
  get resendWindowMs(): number {
    return (
      2 * this.timeouts.pingIntervalMs +
      this.timeouts.pingTimeoutMs +
      Math.max(0, this.settings.reconnectTimeoutMs ?? DEFAULT_RECONNECT_TIMEOUT_MS) +
      RESEND_SPARE_MS
    );
  }

  /** A backend starts using the channel. */
  retain(): void {
    this.users++;
  }

  /**
   * A backend stops using it. Once the last one has, the connections close
   * as soon as the calls still in flight have finished (BullMQ's `close`
   * waits for in-flight work; blocking calls were interrupted before).
   */
  release(): void {
    this.users = Math.max(0, this.users - 1);
    this.closeIfUnused();
  }

  /** Tracks an ordered write (an add, an admin write) of any backend on this channel. */
  track<T>(write: Promise<T>): Promise<T> {
    const answered = write.then(
      () => undefined,
      () => undefined,
    );
    this.pendingWrites.add(answered);
    void answered.then(() => {
      this.pendingWrites.delete(answered);
      this.closeIfUnused();
      if (!this.answeredThisTurn) {
        this.answeredThisTurn = true;
        setImmediate(() => {
          this.answeredThisTurn = false;
        });
      }
    });
    return write;
  }

  /**
   * Settles once every write tracked so far was answered. A lease that returns
   * a job waits for it: HTTP/2 calls have no order, and the job may come from an
   * add whose answer is still on its way, which BullMQ callers (and Redis,
   * answering in order) never see resolve after the job started.
   */
  writesAnswered(): Promise<void> {
    // A write answered in this turn is out of the set, but its caller's chain
    // of awaits may not have seen it resolve yet (it and the lease's answer
    // came in one read, and the lease's chain got here first).
    if (this.pendingWrites.size === 0 && !this.answeredThisTurn) return Promise.resolve();
    // Then one turn of the event loop, so the callers of those writes (their
    // chains of awaits) see them resolve before anyone sees the job.
    return Promise.all([...this.pendingWrites]).then(() => new Promise<void>(resolve => setImmediate(resolve)));
  }

  /**
   * Runs one RPC for `command`, at the caller's clock (`loam-now-ms`: BullMQ's
   * operations run at the client's time, as its Redis scripts do, and its
   * tests fake that clock). A refusal becomes BullMQ's error for `command`.
   */
  async call<T>(
    command: BullmqCommand,
    rpc: (client: JobsClient, options: CallOptions) => Promise<T>,
    signal?: AbortSignal,
    { carriedBy, stopRetrying, sentOn, sendAfter, unaryAfter, resendable = false }: CallHooks = {},
  ): Promise<T> {
    const session = this.sessionClient;
    let resends = 0;
    /** When the first attempt that may have been applied was sent: its key lives from then on, at the earliest. */
    let mayBeAppliedSince: number | undefined;
    const keyLapsesAt = () =>
      mayBeAppliedSince === undefined ? Infinity : mayBeAppliedSince + this.resendWindowMs - RESEND_SPARE_MS;
    let failure: unknown;
    for (let wait = RECONNECT_FIRST_WAIT_MS; ; wait = Math.min(2 * wait, RECONNECT_MAX_WAIT_MS)) {
      if (this.refusedUntil !== 0) {
        // A closing backend's call is tried at once: it ends either way.
        const refused = this.refusedUntil - Date.now();
        if (refused > 0) await sleepUnless(refused, signal, stopRetrying);
        else this.refusedUntil = 0;
      }
      if (sendAfter) await sendAfter();
      if (signal?.aborted) throw new CallAborted();
      const sentAt = Date.now();
      // What was waited for before may have taken it past its key's life.
      if (sentAt > keyLapsesAt()) throw toBullmqError(failure, command);
      try {
        let answering: Promise<T>;
        if (session) {
          this.sentOn = undefined;
          this.unaryAfter = unaryAfter;
          try {
            answering = rpc(session, { signal });
          } finally {
            this.unaryAfter = undefined;
          }
          // The session's methods send at once, before they return.
          sentOn?.(this.sentOn);
        } else {
          answering = this.unary(client => rpc(client, { signal }), carriedBy);
          sentOn?.(undefined);
        }
        const answer = await answering;
        this.unreachableSince = 0;
        return answer;
      } catch (err) {
        if (signal?.aborted) throw new CallAborted();
        if (err instanceof ConnectError && (err.code === Code.Unauthenticated || err.code === Code.PermissionDenied)) {
          this.refusedUntil = Date.now() + REFUSED_TOKEN_WAIT_MS;
        }
        // Tried again while its backend is open, and the server may yet come
        // back in time.
        // A call the server never read counts as sent again too: a server
        // that kept ending its sessions would otherwise have it go on for ever.
        const cut = cutOnItsWay(err);
        const triedAgain = neverSent(err)
          ? !neverRead(err) || ++resends <= MAX_RESENDS
          : resendable && cut && ++resends <= MAX_RESENDS;
        if (!triedAgain) {
          // Only an answer says the server is there: a cut leaves the window running.
          if (!cut) this.unreachableSince = 0;
          throw toBullmqError(err, command);
        }
        if (!neverSent(err)) mayBeAppliedSince ??= sentAt;
        const now = Date.now();
        if (this.unreachableSince === 0) this.unreachableSince = now;
        const giveUpAt =
          this.unreachableSince + Math.max(0, this.settings.reconnectTimeoutMs ?? DEFAULT_RECONNECT_TIMEOUT_MS);
        if (stopRetrying?.aborted || this.users === 0 || now + wait > Math.min(giveUpAt, keyLapsesAt())) {
          throw toBullmqError(err, command);
        }
        failure = err;
      } finally {
        if (session) this.closeIfUnused();
      }
      await sleepUnless(wait, signal, stopRetrying);
      if (signal?.aborted) throw new CallAborted();
      if (stopRetrying?.aborted) throw toBullmqError(failure, command);
    }
  }

  /**
   * A long-poll: [`call`](RemoteChannel.call) with a signal that `interrupt`
   * aborts, as does a deadline `deadlineMs` after it was sent (BullMQ's Redis
   * backend has the same watchdog on BZPOPMIN). A poll not answered by then
   * ends as interrupted. On a session that is all: the session's PINGs find a
   * dead connection, and resetting it here would fail every other call on it,
   * which a test's fake clock jumping past the deadline did (BullMQ's
   * metrics tests). A unary call's connection is reset (its other calls fail
   * as connection errors, which BullMQ retries): connect-node could leave the
   * next call on it waiting for a PING answer forever.
   */
  async longPoll<T>(
    command: BullmqCommand,
    rpc: (client: JobsClient, options: CallOptions) => Promise<T>,
    interrupt: AbortSignal,
    deadlineMs: number,
    stopRetrying?: AbortSignal,
  ): Promise<T> {
    const cut = new AbortController();
    const abort = () => cut.abort();
    if (interrupt.aborted) abort();
    else interrupt.addEventListener('abort', abort, { once: true });
    let carrier: Connection | undefined;
    const deadline = setTimeout(() => {
      abort();
      if (!this.session) {
        carrier?.session.abort(new ConnectError(`a long-poll was not answered in ${deadlineMs} ms`, Code.Unavailable));
      }
    }, deadlineMs);
    deadline.unref();
    try {
      return await this.call(command, rpc, cut.signal, {
        stopRetrying,
        carriedBy: connection => {
          carrier = connection;
        },
      });
    } finally {
      clearTimeout(deadline);
      interrupt.removeEventListener('abort', abort);
    }
  }

  /** One call on an HTTP/2 stream of its own; `carriedBy` learns the connection it goes on. */
  private async unary<T>(
    rpc: (client: JobsClient) => Promise<T>,
    carriedBy?: (connection: Connection) => void,
  ): Promise<T> {
    const connection = await this.acquire();
    carriedBy?.(connection);
    try {
      return await rpc(connection.client);
    } finally {
      this.releaseStream(connection);
    }
  }

  private async acquire(): Promise<Connection> {
    for (;;) {
      let best: Connection | undefined;
      for (const c of this.connections) {
        if (c.inFlight < this.maxStreams && (!best || c.inFlight < best.inFlight)) best = c;
      }
      if (!best && this.connections.length < this.maxConnections) best = this.open();
      if (best) {
        best.inFlight++;
        return best;
      }
      await new Promise<void>(resolve => this.waiting.push(resolve));
    }
  }

  private releaseStream(connection: Connection): void {
    connection.inFlight--;
    this.waiting.shift()?.();
    this.closeIfUnused();
  }

  private open(): Connection {
    // PINGs while calls are open on the connection, and before a call on one idle for longer.
    const session = new QuietSessionManager(this.settings.url, this.timeouts);
    // The Connect protocol, binary, on HTTP/2: unary calls have no trailers to
    // parse, which measured about 10% less client CPU per call than gRPC here.
    const fixed = Object.entries(this.fixedHeaders);
    const transport = createConnectTransport({
      baseUrl: this.settings.url,
      httpVersion: '2',
      useBinaryFormat: true,
      sessionManager: session,
      writeMaxBytes: Math.max(1, this.settings.maxRequestBytes ?? DEFAULT_MAX_REQUEST_BYTES),
      // Every call carries the caller's clock (`loam-now-ms`): BullMQ's
      // operations run at the client's time, as its Redis scripts do, and its
      // tests fake that clock.
      interceptors: [
        next => request => {
          for (const [name, value] of fixed) request.header.set(name, value);
          request.header.set('loam-now-ms', String(Date.now()));
          return next(request);
        },
      ],
    });
    const connection = { session, client: createClient(JobsService, transport), inFlight: 0 };
    this.connections.push(connection);
    return connection;
  }

  /** Closes the connections when no backend uses them and no call is in flight (a later call reopens one). */
  private closeIfUnused(): void {
    // Writes tracked but not yet sent (each behind the one before) count as in flight.
    if (this.users > 0 || this.waiting.length > 0 || this.pendingWrites.size > 0) return;
    if (this.connections.some(c => c.inFlight > 0)) return;
    if (this.session?.busy) return;
    this.session?.close();
    for (const c of this.connections.splice(0)) c.session.abort();
    // Forgotten only now: a backend made while writes were still on their
    // way on it gets it, and its leases wait for those writes' answers.
    this.unused?.();
  }
}

/**
 * Whether a call failed because its connection could not be made (refused,
 * unreachable, a name not found), or the server never read it (`NotRead`):
 * then it never reached the server, or was not applied there. A name
 * with several addresses (IPv6 and IPv4) fails with an `AggregateError` of
 * one such error per address.
 */
export function neverSent(err: unknown): boolean {
  for (let e: unknown = err; e instanceof Error; e = e.cause) {
    if (e instanceof AggregateError) return e.errors.length > 0 && e.errors.every(neverSent);
    if (e instanceof NotRead || e instanceof NotSent) return true;
    const { syscall } = e as NodeJS.ErrnoException;
    if (syscall === 'connect' || syscall === 'getaddrinfo') return true;
  }
  return false;
}

/** Whether the server never read the call (`NotRead`): sent, but not applied. */
function neverRead(err: unknown): boolean {
  for (let e: unknown = err; e instanceof Error; e = e.cause) if (e instanceof NotRead) return true;
  return false;
}

/** Whether a call sent failed on its way, not refused by the server (see `isTransportFailure`). */
function cutOnItsWay(err: unknown): boolean {
  if (!(err instanceof ConnectError)) return false;
  const [detail] = err.findDetails(ErrorDetailSchema);
  return isTransportFailure(err, detail);
}

/** Connect code names as the server's bulk results spell them (`invalid_argument`). */
function codeName(code: Code): string {
  return (Code[code] ?? 'unknown').replace(/([a-z])([A-Z])/g, '$1_$2').toLowerCase();
}

/**
 * Connect codes that, on an error the server did not describe, mean the
 * call's transport failed: the connection or stream broke (`unavailable`,
 * `aborted`, `internal`, `unknown` for a stream reset or a Node error), an
 * HTTP/2 stream was canceled that the caller did not cancel (`canceled`),
 * a proxy gave up waiting (`deadline_exceeded`).
 */
const TRANSPORT_FAILURES: ReadonlySet<Code> = new Set([
  Code.Unavailable,
  Code.Aborted,
  Code.Internal,
  Code.Unknown,
  Code.Canceled,
  Code.DeadlineExceeded,
]);

/**
 * Whether a call failed on its way rather than being refused. Every refusal
 * of the server carries an `ErrorDetail`; among those, only `unavailable`
 * (its store cannot take the call now, as while it shuts down) is no answer
 * to the call itself. A caller's own cancel never gets here (`CallAborted`).
 */
function isTransportFailure(err: ConnectError, detail: ErrorDetail | undefined): boolean {
  if (detail) return detail.reason === 'unavailable';
  return TRANSPORT_FAILURES.has(err.code);
}

/**
 * A failed call's error in BullMQ's form: BullMQ's `ConnectionClosedError`
 * when the call failed on its way (BullMQ then retries it, as it retries a
 * Redis command on a dropped connection, rather than failing the job), else
 * the server's refusal (see `fromServer`).
 */
export function toBullmqError(err: unknown, command: BullmqCommand): Error {
  if (!(err instanceof ConnectError)) return err instanceof Error ? err : new Error(String(err));
  const [detail] = err.findDetails(ErrorDetailSchema);
  if (isTransportFailure(err, detail)) {
    return new ConnectionClosedError(`the connection to loam-jobs serve failed: ${err.rawMessage}`, err);
  }
  return fromServer(
    {
      code: codeName(err.code),
      message: err.rawMessage,
      reason: detail?.reason,
      bullmqCode: detail?.bullmqCode,
      subject: detail?.subject,
    },
    command,
  );
}

/**
 * Sleeps `ms`, or until either signal aborts, and leaves no listener behind.
 * `AbortSignal.any` would do it in one line, but on Node 20 each composite
 * stays registered on its sources for good: one for every long-poll on the
 * backend's long-lived `blocking` signal, 500,000 of them 28 MiB.
 */
function sleepUnless(ms: number, a?: AbortSignal, b?: AbortSignal): Promise<void> {
  if (a?.aborted || b?.aborted) return Promise.resolve();
  return new Promise<void>(resolve => {
    const wake = () => {
      clearTimeout(timer);
      a?.removeEventListener('abort', wake);
      b?.removeEventListener('abort', wake);
      resolve();
    };
    const timer = setTimeout(wake, ms);
    a?.addEventListener('abort', wake, { once: true });
    b?.addEventListener('abort', wake, { once: true });
  });
}

/** The longest delay Node's timers take; past it they fire after 1 ms. */
const MAX_TIMER_MS = 2 ** 31 - 1;

/**
 * Refuses settings the channel cannot use as given, when the backend is made:
 * a url that is not `http://` or `https://` (`localhost:7720`) failed every
 * call as a lost connection (Node's HTTP/2 client threw at each connect); a
 * fraction or `Infinity` in a duration made every keyed write (add, report,
 * completion) throw a bare `RangeError` (its key's TTL is a 64-bit integer),
 * and a timer past `MAX_TIMER_MS` fired every millisecond.
 */
function checkSettings(settings: RemoteSettings): void {
  let protocol;
  try {
    protocol = new URL(settings.url).protocol;
  } catch {
    protocol = undefined;
  }
  if (protocol !== 'http:' && protocol !== 'https:') {
    throw loamError('invalid_argument', `url must be http://host:port or https://host:port; got ${JSON.stringify(settings.url)}`);
  }
  const given: [string, number | undefined, number, number][] = [
    ['pingIntervalMs', settings.pingIntervalMs, 1, MAX_TIMER_MS],
    ['pingTimeoutMs', settings.pingTimeoutMs, 1, MAX_TIMER_MS],
    ['connectTimeoutMs', settings.connectTimeoutMs, 1, MAX_TIMER_MS],
    ['reconnectTimeoutMs', settings.reconnectTimeoutMs, 0, MAX_TIMER_MS],
    ['maxRequestBytes', settings.maxRequestBytes, 1, Number.MAX_SAFE_INTEGER],
  ];
  for (const [name, value, least, most] of given) {
    if (value !== undefined && !(Number.isInteger(value) && value >= least && value <= most)) {
      throw loamError('invalid_argument', `${name} must be a whole number from ${least} to ${most}; got ${value}`);
    }
  }
}
