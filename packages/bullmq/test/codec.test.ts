import { describe, expect, it } from 'vitest';
import { create, fromBinary, ScalarType, toBinary, type DescField, type DescMessage } from '@bufbuild/protobuf';
import { decodeMessage, encodeMessage } from '../src/codec.js';
import { file_loam_jobs_v1_events } from '../src/gen/loam/jobs/v1/events_pb.js';
import {
  ErrorDetailSchema,
  file_loam_jobs_v1_jobs,
  SessionRequestSchema,
  SessionResponseSchema,
} from '../src/gen/loam/jobs/v1/jobs_pb.js';
import { file_loam_jobs_v1_types, MetricsSchema } from '../src/gen/loam/jobs/v1/types_pb.js';

/** Every message type of the package, nested ones included. */
function allMessages(): DescMessage[] {
  const out: DescMessage[] = [];
  const visit = (m: DescMessage) => {
    out.push(m);
    m.nestedMessages.forEach(visit);
  };
  for (const file of [file_loam_jobs_v1_jobs, file_loam_jobs_v1_types, file_loam_jobs_v1_events]) {
    file.messages.forEach(visit);
  }
  return out;
}

/** A small seeded generator, so a failure names the seed that shows it. */
function rng(seed: number) {
  let s = seed >>> 0 || 1;
  const next = () => {
    s ^= s << 13;
    s >>>= 0;
    s ^= s >>> 17;
    s ^= s << 5;
    s >>>= 0;
    return s / 2 ** 32;
  };
  return {
    next,
    int: (n: number) => Math.floor(next() * n),
    chance: (p: number) => next() < p,
  };
}
type Rng = ReturnType<typeof rng>;

// Around the writer's one-byte-length limit (42 units, 3 bytes each at most) and the reader's ASCII one (8 bytes),
// astral and lone surrogates (written as U+FFFD), long ones.
const TEXTS = [
  '',
  'a',
  'job-1',
  'x'.repeat(8),
  'x'.repeat(9),
  'aé',
  'é✓ unicode',
  'x'.repeat(41),
  '✓'.repeat(41),
  '✓'.repeat(43),
  'x'.repeat(48),
  'x'.repeat(49),
  'a\u{1F600}b',
  'lone \ud800 surrogate',
  'x'.repeat(300),
  '✓'.repeat(5000),
];

function randomScalar(r: Rng, type: ScalarType): unknown {
  const zero = r.chance(0.2);
  switch (type) {
    case ScalarType.STRING:
      return zero ? '' : TEXTS[r.int(TEXTS.length)];
    case ScalarType.BOOL:
      return zero ? false : r.chance(0.5);
    case ScalarType.BYTES:
      return zero ? new Uint8Array(0) : Uint8Array.from({ length: r.int(40) + 1 }, () => r.int(256));
    case ScalarType.DOUBLE:
      return zero ? 0 : (r.next() - 0.5) * 1e6;
    case ScalarType.FLOAT:
      return zero ? 0 : Math.fround(r.next() * 100);
    case ScalarType.INT32:
    case ScalarType.SINT32:
    case ScalarType.SFIXED32:
      return zero ? 0 : r.int(2 ** 31) * (r.chance(0.5) ? -1 : 1);
    case ScalarType.UINT32:
    case ScalarType.FIXED32:
      return zero ? 0 : r.int(2 ** 32);
    case ScalarType.UINT64:
    case ScalarType.FIXED64:
      return zero ? 0n : BigInt(r.int(2 ** 32)) * BigInt(r.int(2 ** 31) + 1);
    default:
      // INT64, SINT64, SFIXED64.
      return zero ? 0n : BigInt(r.int(2 ** 32)) * BigInt(r.int(2 ** 31) + 1) * (r.chance(0.5) ? -1n : 1n);
  }
}

function randomValue(r: Rng, field: DescField, depth: number): unknown {
  switch (field.fieldKind) {
    case 'scalar':
      return randomScalar(r, field.scalar);
    case 'enum':
      return field.enum.values[r.int(field.enum.values.length)].number;
    case 'message':
      return randomMessage(r, field.message, depth + 1);
    case 'list': {
      const items = Array.from({ length: r.chance(0.3) ? 0 : r.int(4) + 1 }, () =>
        field.listKind === 'message'
          ? randomMessage(r, field.message, depth + 1)
          : field.listKind === 'enum'
            ? field.enum.values[r.int(field.enum.values.length)].number
            : randomScalar(r, field.scalar),
      );
      return items;
    }
    case 'map': {
      const map: Record<string, unknown> = {};
      for (let i = r.int(3); i > 0; i--) {
        const key = String(randomScalar(r, field.mapKey));
        map[key] =
          field.mapKind === 'message'
            ? randomMessage(r, field.message, depth + 1)
            : field.mapKind === 'enum'
              ? field.enum.values[0].number
              : randomScalar(r, field.scalar);
      }
      return map;
    }
  }
}

/** A message of `desc` with random fields set (oneofs to a random member). */
function randomMessage(r: Rng, desc: DescMessage, depth = 0): any {
  const init: Record<string, unknown> = {};
  if (depth > 4) return create(desc);
  for (const member of desc.members) {
    if (member.kind === 'oneof') {
      if (r.chance(0.25)) continue;
      const field = member.fields[r.int(member.fields.length)];
      init[member.localName] = { case: field.localName, value: randomValue(r, field, depth) };
    } else if (r.chance(0.7)) {
      init[member.localName] = randomValue(r, member, depth);
    }
  }
  return create(desc, init as never);
}

describe('session codec', () => {
  const messages = allMessages();

  it('covers the package', () => {
    expect(messages.length).toBeGreaterThan(60);
  });

  it('writes every message type byte for byte as protobuf-es does', () => {
    for (let seed = 1; seed <= 30; seed++) {
      const r = rng(seed);
      for (const desc of messages) {
        const message = randomMessage(r, desc);
        const expected = toBinary(desc, message);
        expect(Buffer.from(encodeMessage(desc, message)).toString('hex'), `${desc.typeName}, seed ${seed}`).toBe(
          Buffer.from(expected).toString('hex'),
        );
      }
    }
  });

  it('reads every message type into what protobuf-es reads', () => {
    for (let seed = 100; seed <= 130; seed++) {
      const r = rng(seed);
      for (const desc of messages) {
        const bytes = toBinary(desc, randomMessage(r, desc));
        expect(decodeMessage(desc, bytes), `${desc.typeName}, seed ${seed}`).toStrictEqual(fromBinary(desc, bytes, { readUnknownFields: false }));
      }
    }
  });

  it('writes init objects as create() would make them', () => {
    const init = {
      id: 7n,
      nowMs: 0n,
      call: {
        case: 'complete' as const,
        value: {
          queue: 'q',
          jobId: 'j',
          fence: { kind: { case: 'token' as const, value: 't' } },
          outcome: { kind: { case: 'success' as const, value: { result: new Uint8Array([1, 2]) } } },
          options: { fetchNext: { max: 1, token: 't', names: [], lockDurationMs: 30_000n } },
        },
      },
    };
    expect(encodeMessage(SessionRequestSchema, init)).toEqual(toBinary(SessionRequestSchema, create(SessionRequestSchema, init)));
  });

  it('writes correctly after a message past what its buffer keeps, and after one that failed half-way', () => {
    const small = { id: 1n, nowMs: 5n };
    const expected = toBinary(SessionRequestSchema, create(SessionRequestSchema, small));
    const huge = {
      id: 2n,
      call: {
        case: 'complete' as const,
        value: { queue: 'q', jobId: 'j', outcome: { kind: { case: 'success' as const, value: { result: new Uint8Array(3 << 20).fill(7) } } } },
      },
    };
    const hugeBytes = Buffer.from(encodeMessage(SessionRequestSchema, huge));
    expect(hugeBytes.equals(toBinary(SessionRequestSchema, create(SessionRequestSchema, huge)))).toBe(true);
    expect(encodeMessage(SessionRequestSchema, small)).toEqual(expected);
    // A bad value inside a nested message throws with a fork open.
    const bad = { id: 3n, call: { case: 'lease' as const, value: { queue: 'q', waitMs: -1 } } };
    expect(() => encodeMessage(SessionRequestSchema, bad as never)).toThrow(/invalid uint32/);
    expect(encodeMessage(SessionRequestSchema, small)).toEqual(expected);
  });

  it('skips fields it does not know, and refuses what is not a message', () => {
    const bytes = toBinary(SessionResponseSchema, create(SessionResponseSchema, { id: 3n }));
    // Field 99, a varint, from a newer server.
    const withUnknown = Uint8Array.from([...bytes, (99 << 3) | 0, 1]);
    expect(decodeMessage(SessionResponseSchema, withUnknown).id).toBe(3n);
    expect(() => decodeMessage(SessionResponseSchema, Uint8Array.from([0x0a, 0x05, 0x01]))).toThrow();
    expect(() => decodeMessage(SessionResponseSchema, Uint8Array.from([0x07]))).toThrow();
  });

  it('refuses a string that runs past its message, and invalid UTF-8, as protobuf-es does', () => {
    for (const reason of ['abc', 'x'.repeat(30)]) {
      const bytes = toBinary(ErrorDetailSchema, create(ErrorDetailSchema, { reason }));
      expect(() => decodeMessage(ErrorDetailSchema, bytes.subarray(0, bytes.length - 1))).toThrow();
      expect(() => fromBinary(ErrorDetailSchema, bytes.subarray(0, bytes.length - 1))).toThrow();
      // The last byte of the text made invalid: a lone continuation byte.
      const invalid = Uint8Array.from(bytes);
      invalid[invalid.length - 1] = 0x80;
      expect(() => fromBinary(ErrorDetailSchema, invalid)).toThrow();
      expect(() => decodeMessage(ErrorDetailSchema, invalid)).toThrow();
    }
  });

  it('reads a packed list of any length (more items than a call takes arguments)', () => {
    // A year of per-minute metrics: more than half a million points.
    const data = Array.from({ length: 600_000 }, (_, i) => BigInt(i % 7));
    const bytes = toBinary(MetricsSchema, create(MetricsSchema, { count: 3n, data }));
    const metrics = decodeMessage(MetricsSchema, bytes);
    expect(metrics.data.length).toBe(data.length);
    expect(metrics.data.slice(0, 8)).toEqual(data.slice(0, 8));
    expect(metrics.count).toBe(3n);
  });
});
