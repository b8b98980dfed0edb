/**
 * The protobuf binary format written straight into one growing buffer.
 *
 * protobuf-es's `BinaryWriter` collects bytes in arrays of numbers, one
 * array and one chunk list per nested message, and copies them all again at
 * the end; strings go through `TextEncoder.encode`, a fresh array each. At a
 * remote worker's rate of calls that writer was a fifth of its CPU and much
 * of its garbage. This one writes every byte once, into a buffer it keeps
 * from one message to the next, and reserves one byte for a nested
 * message's length, moving the message up in the rare case its length needs
 * more. It takes and checks values as protobuf-es's writer does (the codec
 * tests compare the two on every message type of the package).
 */
import { protoInt64 } from '@bufbuild/protobuf';

/** UTF-16 units of a string whose UTF-8 form is sure to fit a one-byte length (3 bytes a unit at most). */
const SHORT_STRING = 42;
/** A buffer that grew past this is not kept for the next message. */
const KEEP_AT_MOST = 1 << 20;

export class ProtoWriter {
  private buf = new Uint8Array(0);
  /** The same memory, for Node's UTF-8 writer. */
  private text = Buffer.alloc(0);
  private view = new DataView(this.buf.buffer);
  private pos = 0;
  /** Where each open fork's length goes. */
  private readonly forks: number[] = [];

  constructor(size = 4096) {
    this.grow(size);
  }

  /** The bytes written, copied out; the writer is empty again. */
  finish(): Uint8Array {
    if (this.forks.length > 0) throw new Error('invalid state, fork stack empty');
    const out = this.buf.slice(0, this.pos);
    this.pos = 0;
    if (this.buf.length > KEEP_AT_MOST) this.grow(4096);
    return out;
  }

  /** Drops whatever a failed message left. */
  reset(): void {
    this.pos = 0;
    this.forks.length = 0;
  }

  tag(fieldNo: number, type: number): this {
    return this.uint32(((fieldNo << 3) | type) >>> 0);
  }

  /** Starts a length-delimited part (a message, a packed list); `join` ends it. */
  fork(): this {
    this.room(1);
    this.forks.push(this.pos);
    this.pos += 1;
    return this;
  }

  join(): this {
    const at = this.forks.pop();
    if (at === undefined) throw new Error('invalid state, fork stack empty');
    const length = this.pos - at - 1;
    if (length < 0x80) {
      this.buf[at] = length;
      return this;
    }
    const size = varintSize(length);
    this.room(size - 1);
    this.buf.copyWithin(at + size, at + 1, this.pos);
    this.pos += size - 1;
    writeVarint32(this.buf, at, length);
    return this;
  }

  uint32(value: number): this {
    assertUInt32(value);
    this.room(5);
    this.pos = writeVarint32(this.buf, this.pos, value);
    return this;
  }

  int32(value: number): this {
    assertInt32(value);
    if (value >= 0) {
      this.room(5);
      this.pos = writeVarint32(this.buf, this.pos, value);
    } else {
      // Sign-extended to 64 bits: ten bytes.
      this.varint64(value >>> 0, 0xffffffff);
    }
    return this;
  }

  sint32(value: number): this {
    assertInt32(value);
    this.room(5);
    this.pos = writeVarint32(this.buf, this.pos, ((value << 1) ^ (value >> 31)) >>> 0);
    return this;
  }

  bool(value: boolean): this {
    this.room(1);
    this.buf[this.pos++] = value ? 1 : 0;
    return this;
  }

  int64(value: string | number | bigint): this {
    const { lo, hi } = protoInt64.enc(value);
    this.varint64(lo >>> 0, hi >>> 0);
    return this;
  }

  uint64(value: string | number | bigint): this {
    const { lo, hi } = protoInt64.uEnc(value);
    this.varint64(lo >>> 0, hi >>> 0);
    return this;
  }

  sint64(value: string | number | bigint): this {
    const { lo, hi } = protoInt64.enc(value);
    const sign = hi >> 31;
    this.varint64(((lo << 1) ^ sign) >>> 0, (((hi << 1) | (lo >>> 31)) ^ sign) >>> 0);
    return this;
  }

  fixed32(value: number): this {
    assertUInt32(value);
    this.room(4);
    this.view.setUint32(this.pos, value, true);
    this.pos += 4;
    return this;
  }

  sfixed32(value: number): this {
    assertInt32(value);
    this.room(4);
    this.view.setInt32(this.pos, value, true);
    this.pos += 4;
    return this;
  }

  fixed64(value: string | number | bigint): this {
    const { lo, hi } = protoInt64.uEnc(value);
    return this.bits64(lo, hi);
  }

  sfixed64(value: string | number | bigint): this {
    const { lo, hi } = protoInt64.enc(value);
    return this.bits64(lo, hi);
  }

  float(value: number): this {
    assertFloat32(value);
    this.room(4);
    this.view.setFloat32(this.pos, value, true);
    this.pos += 4;
    return this;
  }

  double(value: number): this {
    this.room(8);
    this.view.setFloat64(this.pos, value, true);
    this.pos += 8;
    return this;
  }

  bytes(value: Uint8Array): this {
    this.uint32(value.byteLength);
    this.room(value.byteLength);
    this.buf.set(value, this.pos);
    this.pos += value.byteLength;
    return this;
  }

  string(value: string): this {
    const units = value.length;
    if (units < SHORT_STRING) {
      // A one-byte length, then the text: ASCII by hand, the rest by Node.
      this.room(1 + 3 * units);
      const buf = this.buf;
      const start = this.pos + 1;
      let i = 0;
      for (; i < units; i++) {
        const c = value.charCodeAt(i);
        if (c >= 0x80) break;
        buf[start + i] = c;
      }
      const length = i === units ? units : this.text.write(value, start);
      buf[this.pos] = length;
      this.pos = start + length;
      return this;
    }
    const length = Buffer.byteLength(value);
    this.uint32(length);
    this.room(length);
    this.pos += this.text.write(value, this.pos);
    return this;
  }

  private bits64(lo: number, hi: number): this {
    this.room(8);
    this.view.setInt32(this.pos, lo, true);
    this.view.setInt32(this.pos + 4, hi, true);
    this.pos += 8;
    return this;
  }

  private varint64(lo: number, hi: number): void {
    this.room(10);
    const buf = this.buf;
    let pos = this.pos;
    while (hi !== 0 || lo > 0x7f) {
      buf[pos++] = (lo & 0x7f) | 0x80;
      lo = ((lo >>> 7) | (hi << 25)) >>> 0;
      hi >>>= 7;
    }
    buf[pos++] = lo;
    this.pos = pos;
  }

  /** Makes room for `bytes` more. */
  private room(bytes: number): void {
    if (this.pos + bytes > this.buf.length) this.grow(Math.max(this.buf.length * 2, this.pos + bytes));
  }

  private grow(size: number): void {
    const next = new Uint8Array(size);
    next.set(this.buf.subarray(0, Math.min(this.pos, size)));
    this.buf = next;
    this.text = Buffer.from(next.buffer, next.byteOffset, next.byteLength);
    this.view = new DataView(next.buffer, next.byteOffset, next.byteLength);
  }
}

function varintSize(value: number): number {
  return value < 0x80 ? 1 : value < 0x4000 ? 2 : value < 0x200000 ? 3 : value < 0x10000000 ? 4 : 5;
}

/** Writes `value` (a uint32) as a varint at `pos`; returns the position after it. */
function writeVarint32(buf: Uint8Array, pos: number, value: number): number {
  while (value > 0x7f) {
    buf[pos++] = (value & 0x7f) | 0x80;
    value >>>= 7;
  }
  buf[pos++] = value;
  return pos;
}

// The checks of protobuf-es's writer, with its messages.
function assertUInt32(value: number): void {
  if (typeof value !== 'number') throw new Error('invalid uint32: ' + typeof value);
  if (!Number.isInteger(value) || value > 0xffffffff || value < 0) throw new Error('invalid uint32: ' + value);
}

function assertInt32(value: number): void {
  if (typeof value !== 'number') throw new Error('invalid int32: ' + typeof value);
  if (!Number.isInteger(value) || value > 0x7fffffff || value < -0x80000000) throw new Error('invalid int32: ' + value);
}

function assertFloat32(value: number): void {
  if (typeof value !== 'number') throw new Error('invalid float32: ' + typeof value);
  if (Number.isFinite(value) && (value > 3.4028234663852886e38 || value < -3.4028234663852886e38)) {
    throw new Error('invalid float32: ' + value);
  }
}
