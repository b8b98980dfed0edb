/**
 * `loam-jobs serve` spoken to over gRPC by an implementation that shares no
 * code with it: `@grpc/grpc-js`, with stubs `@grpc/proto-loader` builds from
 * the repository's own `proto/`. The server's other gRPC tests use connectrpc
 * at both ends, where a mistake in framing, trailers, status codes or error
 * details would be made the same way by both and never show.
 */
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import protobuf from 'protobufjs';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startLoamServer, type LoamServer } from '../../packages/bullmq/test/remote-server.js';

const here = path.dirname(fileURLToPath(import.meta.url));
const protoDir = path.resolve(here, '../../proto');

// Stubs as a grpc-js user would build them. 64-bit fields as strings, as a
// JS number would round off any value past 2^53; `oneofs` names the member
// set, and `defaults` fills unset scalars, so an absent field reads as the
// server meant it (0, '') rather than as undefined.
const definition = protoLoader.loadSync('loam/jobs/v1/jobs.proto', {
  includeDirs: [protoDir],
  longs: String,
  enums: String,
  oneofs: true,
  defaults: true,
});
const JobsService = (grpc.loadPackageDefinition(definition) as any).loam.jobs.v1
  .JobsService as grpc.ServiceClientConstructor;

// grpc-js hands `grpc-status-details-bin` over undecoded; a client decodes it
// with google.rpc.Status, which `proto/` does not hold.
const types = new protobuf.Root();
types.resolvePath = (_origin, target) => path.join(protoDir, target);
types.loadSync('loam/jobs/v1/jobs.proto');
protobuf.parse(
  `syntax = "proto3"; package google.protobuf;
   message Any { string type_url = 1; bytes value = 2; }`,
  types,
);
protobuf.parse(
  `syntax = "proto3"; package google.rpc;
   message Status { int32 code = 1; string message = 2; repeated google.protobuf.Any details = 3; }`,
  types,
);
types.resolveAll();
const RpcStatus = types.lookupType('google.rpc.Status');
const ErrorDetail = types.lookupType('loam.jobs.v1.ErrorDetail');
const DETAIL_TYPE_URL = 'type.googleapis.com/loam.jobs.v1.ErrorDetail';

/** 2^53 + 1: the first integer a JS number cannot hold. */
const PAST_DOUBLE = '9007199254740993';
/** A call that hangs fails the test in this long, not at the test's timeout. */
const CALL_MS = 15_000;

let server: LoamServer;
let client: grpc.Client & Record<string, any>;

beforeAll(async () => {
  server = await startLoamServer();
  // Plain h2c, as `serve` listens without TLS.
  client = new JobsService(new URL(server.url).host, grpc.credentials.createInsecure()) as any;
});

afterAll(async () => {
  client?.close();
  await server?.stop();
});

function metadataOf(headers: Record<string, string> = {}): grpc.Metadata {
  const m = new grpc.Metadata();
  for (const [k, v] of Object.entries(headers)) m.set(k, v);
  return m;
}

function unary(method: string, request: object, headers: Record<string, string> = {}): Promise<any> {
  return new Promise((resolve, reject) => {
    const options = { deadline: Date.now() + CALL_MS };
    client[method](request, metadataOf(headers), options, (err: grpc.ServiceError | null, res: any) =>
      err ? reject(err) : resolve(res),
    );
  });
}

/** The error a call must end with; a success fails the test. */
async function failure(call: Promise<unknown>): Promise<grpc.ServiceError> {
  try {
    const res = await call;
    throw new Error(`expected the call to fail, it answered ${JSON.stringify(res)}`);
  } catch (err: any) {
    if (typeof err?.code !== 'number' || !(err.metadata instanceof grpc.Metadata)) throw err;
    return err as grpc.ServiceError;
  }
}

/** The error's google.rpc.Status, with every detail decoded as the project's ErrorDetail. */
function statusDetails(err: grpc.ServiceError): { code: number; message: string; details: any[] } {
  const bin = err.metadata.get('grpc-status-details-bin');
  expect(bin, 'grpc-status-details-bin trailer').toHaveLength(1);
  const status = RpcStatus.toObject(RpcStatus.decode(bin[0] as Buffer)) as any;
  const details = (status.details ?? []).map((any: any) => {
    expect(any.typeUrl).toBe(DETAIL_TYPE_URL);
    return ErrorDetail.toObject(ErrorDetail.decode(any.value), { longs: String, defaults: true });
  });
  return { code: status.code ?? 0, message: status.message ?? '', details };
}

/** Checks a failure end to end: the gRPC status, its readable text, and the typed detail in the trailer. */
function expectFailure(err: grpc.ServiceError, code: grpc.status, detail: Record<string, unknown>, text: RegExp) {
  expect({ code: err.code, details: err.details }).toEqual({ code, details: expect.stringMatching(text) });
  const status = statusDetails(err);
  // gRPC requires the Status in the trailer to agree with grpc-status and grpc-message.
  expect(status.code).toBe(code);
  expect(status.message).toBe(err.details);
  expect(status.details).toHaveLength(1);
  expect(status.details[0]).toMatchObject(detail);
}

function fieldsOf(event: any): Record<string, string> {
  return Object.fromEntries(event.fields.map((f: any) => [f.key, f.value]));
}

/** Watches until `enough` says so, then cancels; the events seen (heartbeats left out). */
function watchUntil(request: object, enough: (events: any[]) => boolean): Promise<any[]> {
  return new Promise((resolve, reject) => {
    const events: any[] = [];
    const stream = client.Watch(request, new grpc.Metadata(), { deadline: Date.now() + CALL_MS });
    let done = false;
    stream.on('data', (m: any) => {
      if (m.event) events.push(m.event);
      if (!done && enough(events)) {
        done = true;
        stream.cancel();
        resolve(events);
      }
    });
    stream.on('error', (err: grpc.ServiceError) => {
      if (!done) reject(err);
    });
    // A watch never ends of itself; an OK end here is a bug.
    stream.on('end', () => {
      if (!done) reject(new Error(`the watch ended cleanly after ${JSON.stringify(events)}`));
    });
  });
}

/** The error a watch must end with, and what it sent before it. */
function watchFailure(request: object): Promise<{ err: grpc.ServiceError; sent: any[] }> {
  return new Promise((resolve, reject) => {
    const sent: any[] = [];
    const stream = client.Watch(request, new grpc.Metadata(), { deadline: Date.now() + CALL_MS });
    stream.on('data', (m: any) => sent.push(m));
    stream.on('error', (err: grpc.ServiceError) => resolve({ err, sent }));
    stream.on('status', (s: grpc.StatusObject) => {
      if (s.code === grpc.status.OK) reject(new Error(`the watch ended OK after ${JSON.stringify(sent)}`));
    });
  });
}

describe('@grpc/grpc-js against loam-jobs serve', () => {
  it('enqueues a job and reads it back with its bytes, 64-bit fields and headers intact', async () => {
    const queue = `grpc-unary-${Date.now()}`;
    const ns = { 'loam-namespace': 'grpc-interop' };
    // Bytes that are not UTF-8, so a text conversion anywhere would show.
    const data = Buffer.from([0x00, 0xff, 0xfe, 0x80, 0x7b, 0x22, 0x00]);
    const added = await unary(
      'Enqueue',
      {
        queue,
        job: { name: 'résumé', data, timestamp: PAST_DOUBLE, headers: { trace: 'abc' }, priority: 7 },
      },
      ns,
    );
    expect(added.enqueued).toMatchObject({ created: true, state: 'JOB_STATE_PRIORITIZED' });
    const id: string = added.enqueued.id;
    expect(id).not.toBe('');

    const read = await unary('Query', { queue, jobs: { ids: [id, 'no-such-job'] } }, ns);
    expect(read.result).toBe('jobs');
    const [slot, missing] = read.jobs.slots;
    expect(missing.job).toBeNull();
    const job = slot.job;
    expect(job).toMatchObject({
      id,
      name: 'résumé',
      state: 'JOB_STATE_PRIORITIZED',
      priority: 7,
      timestamp: PAST_DOUBLE,
      due: PAST_DOUBLE,
      attempts: 1,
      headers: { trace: 'abc' },
    });
    expect(Buffer.isBuffer(job.data)).toBe(true);
    expect(job.data.equals(data)).toBe(true);

    // The namespace is a request header: one the server did not read would
    // have put the job in `default`, where this finds it.
    const elsewhere = await unary('Query', { queue, jobs: { ids: [id] } });
    expect(elsewhere.jobs.slots[0].job).toBeNull();
  });

  it('fails a bad request with INVALID_ARGUMENT, a text and the ErrorDetail in grpc-status-details-bin', async () => {
    // Only the trailers are checked. connectrpc 0.9.1 answers a call that
    // fails before any message with response headers that already hold
    // grpc-status and grpc-message (no END_STREAM), then trailers with both
    // again and the details; gRPC's Trailers-Only is one HEADERS frame that
    // ends the stream. grpc-js reads the status from the trailers and hands
    // the reserved keys on as the call's initial metadata.
    const err = await failure(unary('Enqueue', { queue: '', job: { name: 'x', data: Buffer.from('{}') } }));
    expectFailure(
      err,
      grpc.status.INVALID_ARGUMENT,
      { reason: 'invalid_argument', bullmqCode: 0, subject: '' },
      /queue name must be 1 to \d+ bytes, got 0/,
    );

    // A refusal the server makes before the core sees the call takes the same form.
    const noJob = await failure(unary('Enqueue', { queue: 'q' }));
    expectFailure(noJob, grpc.status.INVALID_ARGUMENT, { reason: 'invalid_argument' }, /job is required/);
  });

  it("refuses a stale lease on Complete and Extend with FAILED_PRECONDITION, keeping the holder's result", async () => {
    const queue = `grpc-fence-${Date.now()}`;
    const { enqueued } = await unary('Enqueue', { queue, job: { name: 'fenced', data: Buffer.from('{"n":1}') } });
    const leased = await unary('Lease', { queue, options: { max: 1, token: 'worker-a', lockDurationMs: '30000' } });
    expect(leased.leased.leases).toHaveLength(1);
    const lease = leased.leased.leases[0];
    expect(lease).toMatchObject({ token: 'worker-a', job: { id: enqueued.id, state: 'JOB_STATE_ACTIVE' } });
    expect(lease.job.data.toString()).toBe('{"n":1}');
    expect(BigInt(lease.deadline)).toBeGreaterThan(BigInt(Date.now()));

    // Another worker's token: the job is leased, but not to it.
    const mismatch = await failure(
      unary('Complete', {
        queue,
        jobId: enqueued.id,
        fence: { token: 'worker-b' },
        outcome: { success: { result: Buffer.from('"theirs"') } },
      }),
    );
    expectFailure(
      mismatch,
      grpc.status.FAILED_PRECONDITION,
      { reason: 'fenced.mismatch', bullmqCode: -6, subject: enqueued.id },
      /./,
    );

    const done = await unary('Complete', {
      queue,
      jobId: enqueued.id,
      fence: { epoch: lease.epoch },
      outcome: { success: { result: Buffer.from('"mine"') } },
    });
    expect(done.completed.state).toBe('JOB_STATE_COMPLETED');
    expect(BigInt(done.completed.finishedOn)).toBeGreaterThan(0n);

    // The lease is over: its own token is stale now.
    const stale = await failure(
      unary('Extend', { queue, items: [{ jobId: enqueued.id, fence: { token: 'worker-a' } }], durationMs: '30000' }),
    );
    expectFailure(
      stale,
      grpc.status.FAILED_PRECONDITION,
      { reason: 'fenced.no_lease', bullmqCode: -2, subject: enqueued.id },
      /./,
    );

    const read = await unary('Query', { queue, jobs: { ids: [enqueued.id] } });
    expect(read.jobs.slots[0].job.state).toBe('JOB_STATE_COMPLETED');
    expect(read.jobs.slots[0].job.returnValue.toString()).toBe('"mine"');
  });

  it("streams a queue's events with Watch from cursor 0, in order", async () => {
    const queue = `grpc-watch-${Date.now()}`;
    const { enqueued } = await unary('Enqueue', { queue, job: { name: 'watched', data: Buffer.from('{}') } });
    const events = await watchUntil({ queue, after: '0' }, seen => seen.some(e => e.name === 'waiting'));
    expect(events.map(e => [e.name, fieldsOf(e).jobId])).toEqual([
      ['added', enqueued.id],
      ['waiting', enqueued.id],
    ]);
    expect(fieldsOf(events[0]).name).toBe('watched');
    expect(BigInt(events[1].seq)).toBeGreaterThan(BigInt(events[0].seq));
    expect(BigInt(events[0].ts)).toBeGreaterThan(0n);
  });

  it('ends a Watch with a bad argument with INVALID_ARGUMENT and a bad cursor with OUT_OF_RANGE', async () => {
    // Unset `after` reads the newest event before the stream starts, so the
    // call fails before it has answered anything.
    const before = await watchFailure({ queue: '' });
    expect(before.sent).toEqual([]);
    expectFailure(before.err, grpc.status.INVALID_ARGUMENT, { reason: 'invalid_argument' }, /queue name/);

    // With a cursor the stream is under way (its headers sent) when the
    // queue name is refused: the error comes in the trailers that end it.
    const during = await watchFailure({ queue: '', after: '0' });
    expect(during.sent).toEqual([]);
    expectFailure(during.err, grpc.status.INVALID_ARGUMENT, { reason: 'invalid_argument' }, /queue name/);

    const queue = `grpc-watch-ahead-${Date.now()}`;
    await unary('Enqueue', { queue, job: { name: 'x', data: Buffer.from('{}') } });
    const ahead = await watchFailure({ queue, after: PAST_DOUBLE });
    // The queue's two events are `added` and `waiting`: the newest is 2.
    expectFailure(
      ahead.err,
      grpc.status.OUT_OF_RANGE,
      { reason: 'cursor_ahead', subject: '2' },
      /past the newest event/,
    );
  });

  it('answers several calls on one Session stream, each by its id', async () => {
    const queue = `grpc-session-${Date.now()}`;
    const session = client.Session(new grpc.Metadata(), { deadline: Date.now() + CALL_MS });
    const answers = new Map<string, any>();
    session.on('data', (r: any) => answers.set(r.id, r));
    const ended = new Promise<grpc.StatusObject>((resolve, reject) => {
      session.on('error', reject);
      session.on('status', resolve);
    });
    // The largest uint64 id shows ids are not read as doubles on either side.
    const bigId = '18446744073709551615';
    const job = (jobId: string, name: string, data: string) => ({ jobId, name, data: Buffer.from(data) });
    session.write({ id: '1', enqueue: { queue, job: job('j1', 'first', '{"a":1}') } });
    session.write({ id: bigId, enqueue: { queue, job: job('j2', 'second', '{"b":2}') } });
    session.write({ id: '3', enqueue: { queue: '', job: { name: 'x' } } });
    session.end();

    // The server ends the stream once it has answered every call of a closed session.
    const status = await ended;
    expect(status.code).toBe(grpc.status.OK);
    expect([...answers.keys()].sort()).toEqual(['1', '3', bigId].sort());
    expect(answers.get('1')).toMatchObject({ result: 'enqueue', enqueue: { enqueued: { id: 'j1', created: true } } });
    expect(answers.get(bigId)).toMatchObject({ result: 'enqueue', enqueue: { enqueued: { id: 'j2', created: true } } });
    // A failed call is an answer on the stream, not the stream's end.
    expect(answers.get('3')).toMatchObject({
      result: 'error',
      error: {
        code: 'invalid_argument',
        message: expect.stringMatching(/queue name/),
        detail: { reason: 'invalid_argument' },
      },
    });

    // Read once answered: a read sent behind a write on the same session
    // does not wait for it (reads take a snapshot at once; writes queue for
    // the store's writer), so it may miss the job.
    const read = await unary('Query', { queue, jobs: { ids: ['j1', 'j2'] } });
    expect(read.jobs.slots.map((s: any) => [s.job.name, s.job.data.toString()])).toEqual([
      ['first', '{"a":1}'],
      ['second', '{"b":2}'],
    ]);
  });
});
