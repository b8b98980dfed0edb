/**
 * `RemoteChannel`: the connections of the remote backend to one
 * `loam-jobs serve`, shared by every backend a `loamBackend({ url })` factory
 * makes. Calls use the Connect protocol (binary) over HTTP/2; each
 * connection carries at most `maxStreamsPerConnection` calls at once (the
 * server's HTTP/2 limit is 200 concurrent streams, and Node's client is sent
 * GOAWAY ENHANCE_YOUR_CALM near it), further calls open another connection,
 * up to `maxConnections`, then wait for a free stream.
 *
 * Errors are converted here, once: a refused call becomes the error the
 * in-process backend throws for the same BullMQ command.
 */
import { Code, ConnectError, createClient, type CallOptions, type Client } from '@connectrpc/connect';
import { createConnectTransport, Http2SessionManager } from '@connectrpc/connect-node';
import { ErrorDetailSchema, JobsService } from './gen/loam/jobs/v1/jobs_pb.js';
import { fromServer, type BullmqCommand } from './errors.js';
import { Session, SESSION_MAX_MESSAGE_BYTES, type SessionCall } from './session.js';

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

export class RemoteChannel {
  private readonly connections: Connection[] = [];
  /** Calls waiting for a free stream, oldest first. */
  private readonly waiting: (() => void)[] = [];
  private readonly fixedHeaders: Record<string, string> = {};
  private readonly maxStreams: number;
  private readonly maxConnections: number;
  /** Backends using the channel; with none and no call in flight, the connections close. */
  private users = 0;
  /** Ordered writes of every backend on this channel not answered yet (see `track`). */
  private readonly pendingWrites = new Set<Promise<void>>();
  /** With `calls: 'session'`: the stream every call goes on, and a client whose methods use it. */
  private readonly session?: Session;
  private readonly sessionClient?: JobsClient;

  constructor(readonly settings: RemoteSettings) {
    this.maxStreams = Math.max(1, settings.maxStreamsPerConnection ?? DEFAULT_STREAMS);
    this.maxConnections = Math.max(1, settings.maxConnections ?? DEFAULT_CONNECTIONS);
    if (settings.token) this.fixedHeaders.authorization = `Bearer ${settings.token}`;
    if (settings.namespace) this.fixedHeaders['loam-namespace'] = settings.namespace;
    if ((settings.calls ?? 'session') === 'session') {
      const session = new Session(settings.url, this.fixedHeaders);
      this.session = session;
      // The same methods as a Connect client's, each a message on the session
      // (a large one a unary call of its own).
      this.sessionClient = new Proxy({} as JobsClient, {
        get: (_, method: string) => (request: never, options?: CallOptions) => {
          const encoded = session.encode(method as SessionCall, request, Date.now());
          if (encoded.framed.length <= SESSION_MAX_MESSAGE_BYTES) return session.send(encoded, options?.signal);
          return this.unary(client => (client[method as keyof JobsClient] as UnaryMethod)(request, options));
        },
      });
    }
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
    void answered.then(() => this.pendingWrites.delete(answered));
    return write;
  }

  /**
   * Settles once every write tracked so far was answered. A lease that returns
   * a job waits for it: HTTP/2 calls have no order, and the job may come from an
   * add whose answer is still on its way, which BullMQ callers (and Redis,
   * answering in order) never see resolve after the job started.
   */
  writesAnswered(): Promise<void> {
    if (this.pendingWrites.size === 0) return Promise.resolve();
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
  ): Promise<T> {
    if (signal?.aborted) throw new CallAborted();
    const session = this.sessionClient;
    try {
      return await (session ? rpc(session, { signal }) : this.unary(client => rpc(client, { signal })));
    } catch (err) {
      if (signal?.aborted) throw new CallAborted();
      throw toBullmqError(err, command);
    } finally {
      if (session) this.closeIfUnused();
    }
  }

  /** One call on an HTTP/2 stream of its own. */
  private async unary<T>(rpc: (client: JobsClient) => Promise<T>): Promise<T> {
    const connection = await this.acquire();
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
    const session = new Http2SessionManager(this.settings.url);
    // The Connect protocol, binary, on HTTP/2: unary calls have no trailers to
    // parse, which measured about 10% less client CPU per call than gRPC here.
    const fixed = Object.entries(this.fixedHeaders);
    const transport = createConnectTransport({
      baseUrl: this.settings.url,
      httpVersion: '2',
      useBinaryFormat: true,
      sessionManager: session,
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
    if (this.users > 0 || this.waiting.length > 0 || this.connections.some(c => c.inFlight > 0)) return;
    if (this.session?.busy) return;
    this.session?.close();
    for (const c of this.connections.splice(0)) c.session.abort();
  }
}

/** Connect code names as the server's bulk results spell them (`invalid_argument`). */
function codeName(code: Code): string {
  return (Code[code] ?? 'unknown').replace(/([a-z])([A-Z])/g, '$1_$2').toLowerCase();
}

/** A failed call's error in BullMQ's form (see `fromServer`). */
export function toBullmqError(err: unknown, command: BullmqCommand): Error {
  if (!(err instanceof ConnectError)) return err instanceof Error ? err : new Error(String(err));
  const [detail] = err.findDetails(ErrorDetailSchema);
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
