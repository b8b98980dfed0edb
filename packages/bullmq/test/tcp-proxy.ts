/**
 * A TCP proxy in front of a `loam-jobs serve`, for tests of what the remote
 * backend does when its connection fails: cut every connection when the
 * client next sends something, or leave the connections open but silent;
 * and for tests of what it sends before it hears back: hold the server's
 * replies.
 */
import * as net from 'node:net';

export interface TcpProxy {
  /** `http://127.0.0.1:<port>` of the proxy. */
  url: string;
  /** The next bytes a client sends are not passed on: every connection is cut instead. */
  cutOnNextSend(): void;
  /** Every connection is cut now (replies held back are dropped). */
  cut(): void;
  /** From now on, whatever a client sends cuts every connection instead of passing on. */
  cutOnEverySend(): void;
  /** The connections open now pass nothing more, either way, and stay open (a half-open link); new ones work. */
  silence(): void;
  /** As `silence`, and new connections are taken but pass nothing either (a host that stopped answering). */
  silenceAll(): void;
  /** What the server sends is kept back, until `passReplies`; what clients send still passes. */
  holdReplies(): void;
  /** Sends on what was kept back, and lets replies pass again. */
  passReplies(): void;
  close(): Promise<void>;
}

export async function startTcpProxy(target: string): Promise<TcpProxy> {
  const { hostname, port } = new URL(target);
  const sockets = new Set<net.Socket>();
  const silenced = new Set<net.Socket>();
  let cutArmed = false;
  let cutAlways = false;
  let silentAlways = false;
  let held: [net.Socket, Buffer][] | undefined;
  const cutAll = () => {
    for (const socket of sockets) socket.destroy();
    sockets.clear();
  };
  const server = net.createServer(client => {
    const upstream = net.connect(Number(port), hostname);
    sockets.add(client);
    sockets.add(upstream);
    if (silentAlways) silenced.add(client);
    client.on('data', data => {
      if (cutArmed || cutAlways) {
        cutArmed = false;
        cutAll();
      } else if (!silenced.has(client)) upstream.write(data);
    });
    upstream.on('data', data => {
      if (held) held.push([client, data]);
      else if (!silenced.has(client)) client.write(data);
    });
    const end = () => {
      client.destroy();
      upstream.destroy();
      sockets.delete(client);
      sockets.delete(upstream);
      silenced.delete(client);
    };
    for (const socket of [client, upstream]) {
      socket.on('close', end);
      socket.on('error', end);
    }
  });
  await new Promise<void>(resolve => server.listen(0, '127.0.0.1', resolve));
  const { port: own } = server.address() as net.AddressInfo;
  return {
    url: `http://127.0.0.1:${own}`,
    cutOnNextSend: () => {
      cutArmed = true;
    },
    cutOnEverySend: () => {
      cutAlways = true;
    },
    cut: () => {
      held = held && [];
      cutAll();
    },
    silence: () => {
      for (const socket of sockets) silenced.add(socket);
    },
    silenceAll: () => {
      silentAlways = true;
      for (const socket of sockets) silenced.add(socket);
    },
    holdReplies: () => {
      held ??= [];
    },
    passReplies: () => {
      const kept = held ?? [];
      held = undefined;
      for (const [client, data] of kept) if (!client.destroyed && !silenced.has(client)) client.write(data);
    },
    close: () => {
      cutAll();
      return new Promise(resolve => server.close(() => resolve()));
    },
  };
}
