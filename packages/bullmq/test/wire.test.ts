import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { UnrecoverableError } from 'bullmq';
import { metricsAnswer, newJobJson, paginateItem } from '../src/common.js';
import { fromServer } from '../src/errors.js';
import { JobSchema, JobState, OnChildFailure, BackoffKind } from '../src/gen/loam/jobs/v1/types_pb.js';
import { i64, jobError, jobJson, jobSpec, nextJob, priorityBand, retention, streamEntry, u32, u64 } from '../src/wire.js';
import { EventSchema } from '../src/gen/loam/jobs/v1/events_pb.js';

/** The conversions of the remote backend, which follow the addon's convert.rs. */
describe('wire conversions', () => {
  it('reads numbers as the addon does: saturating, NaN as 0, Infinity as the largest', () => {
    const U64_MAX = 2n ** 64n - 1n;
    expect([u64(-5), u64(NaN), u64(1.9), u64(2 ** 53), u64(2 ** 64), u64(1e300), u64(Infinity)]).toEqual([
      0n, 0n, 1n, 2n ** 53n, U64_MAX, U64_MAX, U64_MAX,
    ]);
    expect([u32(-1), u32(2 ** 40), u32(Infinity)]).toEqual([0, 0xffff_ffff, 0xffff_ffff]);
    expect([i64(NaN), i64(-3.7), i64(2 ** 63), i64(-Infinity), i64(Infinity)]).toEqual([
      0n, -3n, 2n ** 63n - 1n, -(2n ** 63n), 2n ** 63n - 1n,
    ]);
    expect(() => u64('5')).toThrow(/expected a number/);
    expect([0, 3, -1, 1.5, NaN].map(priorityBand)).toEqual([0, 3, 0xffff_ffff, 0xffff_ffff, 0xffff_ffff]);
  });

  it('maps a stored progress that is not JSON to JSON text, as QueueEvents parses it', () => {
    const e = create(EventSchema, { seq: 3n, ts: 7n, name: 'progress', fields: [{ key: 'jobId', value: '1' }, { key: 'data', value: '50%' }] });
    expect(streamEntry(e)).toEqual(['7-3', ['event', 'progress', 'jobId', '1', 'data', '"50%"']]);
  });

  it('maps BullMQ job options onto a JobSpec', () => {
    const opts = {
      jobId: 'j',
      delay: 10,
      priority: 3,
      attempts: 4,
      backoff: { type: 'exponential', delay: 100, jitter: 0.5 },
      removeOnComplete: { age: 60, count: 5 },
      removeOnFail: true,
      keepLogs: 7,
      deduplication: { id: 'd', ttl: 1000, extend: true },
      parent: { id: 'p', queue: 'bull:pq' },
      ignoreDependencyOnFailure: true,
      telemetry: { x: 1 },
    };
    const spec = jobSpec(newJobJson({ name: 'n', data: '{}', opts, timestamp: 5 } as any, ''));
    expect(spec).toMatchObject({
      name: 'n',
      jobId: 'j',
      delayMs: 10n,
      priority: 3,
      attempts: 4,
      timestamp: 5n,
      keepLogs: 7n,
      backoff: { kind: BackoffKind.EXPONENTIAL, delayMs: 100n, jitter: 0.5 },
      removeOnComplete: { policy: { case: 'keep', value: { count: 5n, ageMs: 60_000n } } },
      removeOnFail: { policy: { case: 'removeImmediately', value: true } },
      dedup: { id: 'd', ttlMs: 1000n, extend: true, replace: false },
      parent: { prefix: 'bull', queue: 'pq', id: 'p' },
      onChildFailure: OnChildFailure.IGNORE,
    });
    expect(JSON.parse(spec.opts!)).toEqual(opts);
    expect(jobSpec(newJobJson({ name: 'n', data: '{}', opts: { jobId: '' } } as any, '')).jobId).toBeUndefined();
    expect(retention(false)).toEqual({ policy: { case: 'keepAll', value: true } });
    expect(retention(-1)).toEqual({ policy: { case: 'keepAll', value: true } });
    expect(retention(3)).toEqual({ policy: { case: 'keep', value: { count: 3n } } });
    expect(retention(undefined)).toBeUndefined();
  });

  it('rebuilds the stack array and reason of a failure', () => {
    expect(jobError(undefined, { failedReason: 'boom', stacktrace: '["a","b"]' })).toEqual({
      message: 'boom',
      stacktraces: { traces: ['a', 'b'] },
    });
    expect(jobError('r', { stacktrace: '[]' })).toEqual({ message: 'r', stacktraces: { traces: [] } });
    expect(jobError('r', {})).toEqual({ message: 'r', stacktraces: undefined });
  });

  it('shapes a stored job as BullMQ JobJson and next-job tuple', () => {
    const job = create(JobSchema, {
      id: '7',
      name: 'n',
      data: new TextEncoder().encode('{"a":1}'),
      opts: '{"attempts":2}',
      state: JobState.ACTIVE,
      timestamp: 100n,
      attemptsMade: 1,
      processedOn: 150n,
      returnValue: new TextEncoder().encode('"ok"'),
      stacktrace: ['s1'],
      parent: { queue: 'pq', id: 'p', prefix: 'bull' },
      onChildFailure: OnChildFailure.FAIL_PARENT,
      schedulerId: 'sched',
      dedup: { id: 'd' },
    });
    expect(jobJson(job)).toEqual({
      id: '7',
      name: 'n',
      data: '{"a":1}',
      opts: { attempts: 2 },
      progress: 0,
      delay: 0,
      priority: 0,
      timestamp: 100,
      attemptsMade: 1,
      attemptsStarted: 0,
      stalledCounter: 0,
      processedOn: 150,
      returnvalue: '"ok"',
      stacktrace: '["s1"]',
      parentKey: 'bull:pq:p',
      parent: { id: 'p', queueKey: 'bull:pq', fpof: true },
      repeatJobKey: 'sched',
      deduplicationId: 'd',
    });
    expect(nextJob(undefined)).toEqual([null, 0, 0, 0]);
    expect(nextJob({ leases: [], info: { rateLimitMs: 40n, nextDue: 9n } } as any)).toEqual([null, 0, 40, 0]);
    expect(nextJob({ leases: [], info: { rateLimitMs: 0n, nextDue: 9n } } as any)).toEqual([null, 0, 0, 9]);
  });

  it('shapes events as XREAD entries', () => {
    const e = create(EventSchema, { seq: 7n, ts: 100n, name: 'completed', fields: [{ key: 'jobId', value: '1' }] });
    expect(streamEntry(e)).toEqual(['100-7', ['event', 'completed', 'jobId', '1']]);
  });

  it("rebuilds BullMQ's errors from the server's detail", () => {
    const mismatch = fromServer(
      { code: 'failed_precondition', message: 'fenced', reason: 'fenced.mismatch', bullmqCode: -6, subject: '7' },
      { command: 'moveToFinished', jobId: '7', state: 'active' },
    );
    expect(mismatch).toMatchObject({ code: -6, message: 'Lock mismatch for job 7. Cmd moveToFinished from active' });
    const parent = fromServer(
      { code: 'not_found', message: 'x', reason: 'not_found.parent_job', bullmqCode: -5, subject: 'bull:p:1' },
      { command: 'addJob' },
    );
    expect(parent).toMatchObject({ code: -5, message: 'Missing key for parent job bull:p:1. addJob' });
    expect(
      fromServer({ code: 'failed_precondition', message: 'x', bullmqCode: -9 }, { command: 'moveToFinished', jobId: '1' }),
    ).toBeInstanceOf(UnrecoverableError);
    expect(fromServer({ code: 'invalid_argument', message: 'bad' }, { command: 'addJob' })).toMatchObject({
      code: 'LOAM_INVALID_ARGUMENT',
      message: 'bad',
    });
    expect(
      fromServer({ code: 'failed_precondition', message: 'x', reason: 'precondition.queue_not_paused' }, { command: 'obliterate' }),
    ).toMatchObject({ message: 'Cannot obliterate non-paused queue' });
  });
});

/** The core pages the points (`MetricsRecord::page`); both backends give the answer Redis's shape here. */
describe('paginate items', () => {
  it("parses a processed child's value, and gives a value that is not JSON the parse's message, as Redis's adapter", () => {
    expect(paginateItem('bull:q:1', null, false)).toEqual({ id: 'bull:q:1' });
    expect(paginateItem('bull:q:1', '{"a":1}', true)).toEqual({ id: 'bull:q:1', v: { a: 1 } });
    expect(paginateItem('bull:q:1', null, true)).toEqual({ id: 'bull:q:1', v: null });
    const bad = paginateItem('bull:q:1', 'not json', true);
    expect(bad.id).toBe('bull:q:1');
    expect(bad.v).toBeUndefined();
    expect(bad.err).toMatch(/JSON/);
  });
});

describe('getMetrics answer', () => {
  it("gives the wire's 64-bit integers the same text as numbers, and Redis's nulls with no record", () => {
    const answer = [['15', '1700000000000', '2'], ['2', '1'], 5];
    expect(metricsAnswer({ count: 15, prevTs: 1_700_000_000_000, prevCount: 2, data: [2, 1], total: 5 })).toEqual(answer);
    expect(metricsAnswer({ count: 15n, prevTs: 1_700_000_000_000n, prevCount: 2n, data: [2n, 1n], total: 5n })).toEqual(answer);
    expect(metricsAnswer(undefined)).toEqual([[null, null, null], [], 0]);
  });
});
