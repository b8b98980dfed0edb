/**
 * The protobuf binary format for the session's messages, from protobuf-es's
 * own descriptors, without its reflection.
 *
 * `toBinary`, `fromBinary` and `create` walk a message through a reflection
 * layer (a field lookup, a presence check and a boxed get or set per field,
 * a reflective wrapper per nested message): at a worker's rate of calls that
 * was about 40% of the remote backend's CPU, and most of its garbage. Here a
 * message type is turned once into a table of its fields, each with its
 * writer and reader picked in advance, and messages are read into the plain
 * objects protobuf-es itself creates, so the generated types and every
 * caller stay as they are. Only what our proto3 files use is supported
 * (checked when a type is first used; the tests cover every type of the
 * package against protobuf-es, both ways).
 */
import { ScalarType, type DescField, type DescMessage, type MessageInitShape, type MessageShape } from '@bufbuild/protobuf';
import { BinaryReader, WireType } from '@bufbuild/protobuf/wire';
import { Edition, FeatureSet_FieldPresence } from '@bufbuild/protobuf/wkt';
import { ProtoWriter } from './proto-writer.js';

/** How deep messages may nest in what we read (protobuf-es's own limit). */
const RECURSION_LIMIT = 100;

type Value = any;
type Write = (writer: ProtoWriter, value: Value) => void;
type Read = (reader: Reader, depth: number) => Value;

interface FieldPlan {
  number: number;
  /** The property: the field's, or its oneof's. */
  property: string;
  /** Set when the field is a member of a oneof: the case that selects it. */
  oneofCase?: string;
  kind: DescField['fieldKind'];
  /** Implicit presence: a zero value is not written. */
  implicit: boolean;
  /** Writes the tag and the value (each item's, for a list). */
  write: Write;
  /** Reads one value (one item, one map entry as [key, value]). */
  read: Read;
  /** A list of numbers or bools, which may come packed. */
  packable: boolean;
  /** Appends the items of a packed list to `into` (a list may hold more items than a call may take arguments). */
  readPacked?: (reader: Reader, depth: number, into: Value[]) => void;
  isZero: (value: Value) => boolean;
  /** A message field's type, to merge a second occurrence into the first. */
  message?: DescMessage;
}

interface MessagePlan {
  typeName: string;
  /**
   * A message's properties, each at its zero value (`undefined` for those in
   * `fresh`), copied by spread for each message read: one allocation in one
   * shape, where adding the properties one by one grew the object each time.
   */
  zero: Record<string, Value>;
  /** Sorted by number, the order protobuf-es writes in. */
  fields: FieldPlan[];
  /** Its properties that get a fresh value each (lists, maps, bytes, oneofs). */
  fresh: [string, () => Value][];
  /** Its reader and writer, compiled at their first use (below). */
  read?: CompiledRead;
  write?: CompiledWrite;
}

/** Reads a message's fields up to `end`, into `into` (a message read before, merged) or a new message. */
type CompiledRead = (reader: Reader, end: number, depth: number, into: Value) => Value;
type CompiledWrite = (writer: ProtoWriter, message: Value) => void;

const plans = new WeakMap<DescMessage, MessagePlan>();

/** One writer for every message: encoding runs to its end before anything else runs. */
const writer = new ProtoWriter();

/** `message` (a message or an init object of `schema`) in the binary format. */
export function encodeMessage<Desc extends DescMessage>(schema: Desc, message: MessageInitShape<Desc>): Uint8Array {
  writer.reset();
  writeFields(writer, plan(schema), message);
  return writer.finish();
}

/** A message of `schema` read from `bytes`, as protobuf-es's `fromBinary` makes it (unknown fields dropped). */
export function decodeMessage<Desc extends DescMessage>(schema: Desc, bytes: Uint8Array): MessageShape<Desc> {
  const reader = new Reader(bytes);
  return readFields(reader, plan(schema), reader.len, 0, undefined) as MessageShape<Desc>;
}

/**
 * ASCII strings up to this long are built by hand; longer ones go to
 * `TextDecoder`, whose call into Node costs about as much as building 8
 * characters (Node 20), and which leaves no garbage of its own behind.
 */
const SHORT_TEXT = 8;
const lenient = new TextDecoder();
const strict = new TextDecoder('utf-8', { fatal: true });

/** protobuf-es's reader, with string fields read where they lie in its buffer. */
class Reader extends BinaryReader {
  /**
   * A string field's value, as protobuf-es decodes it (`validate`: invalid
   * UTF-8 throws). The reader's own `string()` makes a view of the bytes for
   * each string, then decodes it: a third of what reading a job left for the
   * garbage collector.
   */
  text(validate: boolean): string {
    const length = this.uint32();
    const start = this.pos;
    const end = start + length;
    if (end > this.len) throw new RangeError('premature EOF');
    this.pos = end;
    const buf = this.buf;
    if (length <= SHORT_TEXT) {
      let text = '';
      let i = start;
      for (; i < end && buf[i] < 0x80; i++) text += String.fromCharCode(buf[i]);
      if (i === end) return text;
    }
    return (validate ? strict : lenient).decode(buf.subarray(start, end));
  }
}

function plan(desc: DescMessage): MessagePlan {
  let made = plans.get(desc);
  if (!made) {
    // Stored before its fields are planned: a message may contain itself.
    made = { typeName: desc.typeName, zero: { $typeName: desc.typeName }, fields: [], fresh: [] };
    plans.set(desc, made);
    fill(made, desc);
  }
  return made;
}

function fill(made: MessagePlan, desc: DescMessage): void {
  if (desc.file.edition !== Edition.EDITION_PROTO3) {
    throw new Error(`${desc.typeName}: only proto3 messages are supported by the session codec`);
  }
  for (const member of desc.members) {
    if (member.kind === 'oneof') made.fresh.push([member.localName, () => ({ case: undefined })]);
    else if (member.presence === FeatureSet_FieldPresence.IMPLICIT) {
      const zero = zeroOf(member);
      if ('make' in zero) made.fresh.push([member.localName, zero.make]);
      else made.zero[member.localName] = zero.value;
    }
  }
  for (const [name] of made.fresh) made.zero[name] = undefined;
  for (const field of [...desc.fields].sort((a, b) => a.number - b.number)) {
    const p = fieldPlan(field);
    made.fields.push(p);
  }
}

function fieldPlan(field: DescField): FieldPlan {
  const base = {
    number: field.number,
    property: field.oneof ? field.oneof.localName : field.localName,
    oneofCase: field.oneof ? field.localName : undefined,
    kind: field.fieldKind,
    implicit: field.presence === FeatureSet_FieldPresence.IMPLICIT && !field.oneof,
    packable: false,
  };
  switch (field.fieldKind) {
    case 'scalar': {
      const s = scalar(field.scalar, field.number, field.longAsString, field.utf8Validation);
      return { ...base, ...s };
    }
    case 'enum': {
      const s = scalar(ScalarType.INT32, field.number, false, false);
      return { ...base, ...s };
    }
    case 'message': {
      if (field.delimitedEncoding) throw new Error(`${field.parent.typeName}.${field.name}: groups are not supported`);
      const m = messageIo(field.message, field.number);
      return { ...base, ...m, message: field.message, isZero: v => v === undefined };
    }
    case 'list': {
      if (field.listKind === 'message') {
        if (field.delimitedEncoding) throw new Error(`${field.parent.typeName}.${field.name}: groups are not supported`);
        const m = messageIo(field.message, field.number);
        return { ...base, write: eachOf(m.write), read: m.read, isZero: isEmptyList };
      }
      const type = field.listKind === 'enum' ? ScalarType.INT32 : field.scalar;
      const long = field.listKind === 'scalar' && field.longAsString;
      const utf8 = field.listKind === 'scalar' && field.utf8Validation;
      const one = scalar(type, field.number, long, utf8);
      const packable = type !== ScalarType.STRING && type !== ScalarType.BYTES;
      const write: Write = field.packed
        ? (writer, list: Value[]) => {
            writer.tag(field.number, WireType.LengthDelimited).fork();
            for (const item of list) one.value(writer, item);
            writer.join();
          }
        : eachOf(one.write);
      const readPacked = (reader: Reader, depth: number, into: Value[]): void => {
        const end = reader.uint32() + reader.pos;
        while (reader.pos < end) into.push(one.read(reader, depth));
      };
      return { ...base, packable, write, read: one.read, readPacked, isZero: isEmptyList };
    }
    case 'map': {
      const key = scalar(field.mapKey, 1, false, field.utf8Validation);
      const value =
        field.mapKind === 'message'
          ? messageIo(field.message, 2)
          : scalar(field.mapKind === 'enum' ? ScalarType.INT32 : field.scalar, 2, false, field.utf8Validation);
      const zeroValue: () => Value =
        field.mapKind === 'message'
          ? () => readFields(new Reader(new Uint8Array(0)), plan(field.message), 0, 0, undefined)
          : field.mapKind === 'enum'
            ? () => field.enum.values[0].number
            : () => scalarZero(field.scalar, false);
      const zeroKey = scalarZero(field.mapKey, false);
      const write: Write = (writer, map: Record<string, Value>) => {
        for (const k of Object.keys(map)) {
          writer.tag(field.number, WireType.LengthDelimited).fork();
          key.write(writer, mapKeyValue(field.mapKey, k));
          value.write(writer, map[k]);
          writer.join();
        }
      };
      const read: Read = (reader, depth) => {
        const end = reader.uint32() + reader.pos;
        let k: Value = zeroKey;
        let v: Value;
        while (reader.pos < end) {
          const { number, wireType } = tag(reader);
          if (number === 1) k = key.read(reader, depth);
          else if (number === 2) v = value.read(reader, depth);
          else reader.skip(wireType, number);
        }
        return [String(k), v === undefined ? zeroValue() : v];
      };
      return { ...base, write, read, isZero: v => Object.keys(v).length === 0 };
    }
  }
}

function messageIo(desc: DescMessage, number: number): { write: Write; read: Read } {
  // Looked up at the first use (a message may contain itself), not at each.
  let p: MessagePlan | undefined;
  return {
    write: (writer, value) => {
      writer.tag(number, WireType.LengthDelimited).fork();
      writeFields(writer, (p ??= plan(desc)), value);
      writer.join();
    },
    read: (reader, depth) => {
      const length = reader.uint32();
      return readFields(reader, (p ??= plan(desc)), reader.pos + length, depth + 1, undefined);
    },
  };
}

function eachOf(write: Write): Write {
  return (writer, list: Value[]) => {
    for (const item of list) write(writer, item);
  };
}

function isEmptyList(list: Value[]): boolean {
  return list.length === 0;
}

/** A map key as the wire has it: protobuf-es keys maps by the key's string form. */
function mapKeyValue(type: ScalarType, key: string): Value {
  switch (type) {
    case ScalarType.BOOL:
      return key === 'true';
    case ScalarType.STRING:
      return key;
    case ScalarType.INT64:
    case ScalarType.UINT64:
    case ScalarType.SINT64:
    case ScalarType.FIXED64:
    case ScalarType.SFIXED64:
      return BigInt(key);
    default:
      return Number(key);
  }
}

function writeFields(writer: ProtoWriter, p: MessagePlan, message: Value): void {
  (p.write ??= compileWrite(p))(writer, message);
}

function readFields(reader: Reader, p: MessagePlan, end: number, depth: number, into: Value): Value {
  return (p.read ??= compileRead(p))(reader, end, depth, into);
}

/*
 * Each message type's reader and writer are compiled into a function of
 * their own, with its property names written out. One generic loop over
 * every type's fields (`message[field.property]`) made each of its property
 * reads and writes megamorphic (a lookup in V8's stub cache, a runtime call
 * to add a property), and a message copied from its type's zero object by
 * spread kept that object's map after V8 had replaced it (a double field
 * whose zero is the small integer 0), so each message read was migrated to
 * the new map: together about a third of reading a job. The functions call
 * the same field plans as before, so the wire format is decided in one
 * place; what is generated is only the walk over the fields.
 */

/** `name` as a constant property key in generated code. */
const key = (name: string): string => `[${JSON.stringify(name)}]`;

function compileWrite(p: MessagePlan): CompiledWrite {
  const lines = p.fields.map((f, i) => {
    if (f.oneofCase !== undefined) {
      return `v = message${key(f.property)}; if (v !== undefined && v.case === ${JSON.stringify(f.oneofCase)}) F[${i}].write(writer, v.value);`;
    }
    const skip = f.implicit ? ` && !F[${i}].isZero(v)` : '';
    return `v = message${key(f.property)}; if (v !== undefined${skip}) F[${i}].write(writer, v);`;
  });
  const body = `return function write(writer, message) {\n  let v;\n  ${lines.join('\n  ')}\n};`;
  // eslint-disable-next-line @typescript-eslint/no-implied-eval -- the point: a writer compiled per message type (benchmarks.md, The session's codec)
  return new Function('F', body)(p.fields) as CompiledWrite;
}

function compileRead(p: MessagePlan): CompiledRead {
  const fresh = new Map(p.fresh);
  const properties = Object.keys(p.zero);
  const init = properties.map((name, i) => `${JSON.stringify(name)}: ${fresh.has(name) ? `M[${i}]()` : `Z[${i}]`}`);
  const cases = p.fields.map((f, i) => `case ${f.number}: {\n${readField(f, `F[${i}]`)}\n  break;\n}`);
  const body = `return function read(reader, end, depth, into) {
  if (depth > LIMIT) throw new Error(TOO_DEEP);
  const m = into !== undefined ? into : { ${init.join(', ')} };
  while (reader.pos < end) {
    const t = reader.uint32();
    const number = t >>> 3;
    const wireType = t & 7;
    checkTag(number, wireType);
    switch (number) {
${cases.join('\n')}
default:
  reader.skip(wireType, number);
    }
  }
  if (reader.pos !== end) throw new Error(PAST_END);
  return m;
};`;
  const zero = properties.map(name => p.zero[name]);
  const makers = properties.map(name => fresh.get(name));
  // eslint-disable-next-line @typescript-eslint/no-implied-eval -- as compileWrite's
  return new Function('Z', 'M', 'F', 'LIMIT', 'TOO_DEEP', 'PAST_END', 'checkTag', 'merge', body)(
    zero,
    makers,
    p.fields,
    RECURSION_LIMIT,
    `cannot decode ${p.typeName}: messages nest too deep`,
    `cannot decode ${p.typeName}: a field runs past the message's end`,
    checkTag,
    mergeMessage,
  ) as CompiledRead;
}

/** The statements that read one occurrence of field `f` (the plan `at`) into `m`. */
function readField(f: FieldPlan, at: string): string {
  const property = `m${key(f.property)}`;
  // A oneof member (a scalar, an enum or a message) replaces the oneof's case.
  if (f.oneofCase !== undefined) return `${property} = { case: ${JSON.stringify(f.oneofCase)}, value: ${at}.read(reader, depth) };`;
  switch (f.kind) {
    case 'list':
      return f.packable
        ? `if (wireType === ${WireType.LengthDelimited}) ${at}.readPacked(reader, depth, ${property}); else ${property}.push(${at}.read(reader, depth));`
        : `${property}.push(${at}.read(reader, depth));`;
    case 'map':
      return `const entry = ${at}.read(reader, depth); ${property}[entry[0]] = entry[1];`;
    case 'message':
      // A message field that comes twice is merged, as protobuf-es does.
      return `const previous = ${property}; ${property} = previous ? merge(reader, ${at}.message, depth, previous) : ${at}.read(reader, depth);`;
    default:
      return `${property} = ${at}.read(reader, depth);`;
  }
}

/** Reads a second occurrence of a message field into the first. */
function mergeMessage(reader: Reader, desc: DescMessage, depth: number, previous: Value): Value {
  return readFields(reader, plan(desc), reader.uint32() + reader.pos, depth + 1, previous);
}

function tag(reader: Reader): { number: number; wireType: WireType } {
  const t = reader.uint32();
  const number = t >>> 3;
  const wireType = t & 7;
  checkTag(number, wireType);
  return { number, wireType };
}

function checkTag(number: number, wireType: number): void {
  if (number <= 0 || wireType > 5) throw new Error(`illegal tag: field no ${number} wire type ${wireType}`);
}

interface ScalarIo {
  /** The tag, then the value. */
  write: Write;
  /** The value alone (an item of a packed list). */
  value: Write;
  read: Read;
  isZero: (value: Value) => boolean;
}

function scalar(type: ScalarType, number: number, longAsString: boolean, utf8: boolean): ScalarIo {
  const wire = wireTypeOf(type);
  const value = valueWriter(type);
  const read = valueReader(type, longAsString, utf8);
  return {
    write: (writer, v) => value(writer.tag(number, wire), v),
    value,
    read,
    isZero: zeroTest(type),
  };
}

function wireTypeOf(type: ScalarType): WireType {
  switch (type) {
    case ScalarType.BYTES:
    case ScalarType.STRING:
      return WireType.LengthDelimited;
    case ScalarType.DOUBLE:
    case ScalarType.FIXED64:
    case ScalarType.SFIXED64:
      return WireType.Bit64;
    case ScalarType.FIXED32:
    case ScalarType.SFIXED32:
    case ScalarType.FLOAT:
      return WireType.Bit32;
    default:
      return WireType.Varint;
  }
}

function valueWriter(type: ScalarType): Write {
  switch (type) {
    case ScalarType.STRING:
      // As ioredis sends any argument: a job id given as a number (plain
      // JavaScript, an id from a route's params) goes as its digits.
      return (w, v) => w.string(typeof v === 'string' ? v : String(v));
    case ScalarType.BOOL:
      return (w, v) => w.bool(v);
    case ScalarType.DOUBLE:
      return (w, v) => w.double(v);
    case ScalarType.FLOAT:
      return (w, v) => w.float(v);
    case ScalarType.INT32:
      return (w, v) => w.int32(v);
    case ScalarType.INT64:
      return (w, v) => w.int64(v);
    case ScalarType.UINT64:
      return (w, v) => w.uint64(v);
    case ScalarType.FIXED64:
      return (w, v) => w.fixed64(v);
    case ScalarType.BYTES:
      return (w, v) => w.bytes(v);
    case ScalarType.FIXED32:
      return (w, v) => w.fixed32(v);
    case ScalarType.SFIXED32:
      return (w, v) => w.sfixed32(v);
    case ScalarType.SFIXED64:
      return (w, v) => w.sfixed64(v);
    case ScalarType.SINT64:
      return (w, v) => w.sint64(v);
    case ScalarType.UINT32:
      return (w, v) => w.uint32(v);
    case ScalarType.SINT32:
      return (w, v) => w.sint32(v);
  }
}

function valueReader(type: ScalarType, longAsString: boolean, utf8: boolean): Read {
  const long = (read: (r: Reader) => bigint | string): Read =>
    longAsString ? r => String(read(r)) : r => read(r);
  switch (type) {
    case ScalarType.STRING:
      return r => r.text(utf8);
    case ScalarType.BOOL:
      return r => r.bool();
    case ScalarType.DOUBLE:
      return r => r.double();
    case ScalarType.FLOAT:
      return r => r.float();
    case ScalarType.INT32:
      return r => r.int32();
    case ScalarType.INT64:
      return long(r => r.int64());
    case ScalarType.UINT64:
      return long(r => r.uint64());
    case ScalarType.FIXED64:
      return long(r => r.fixed64());
    case ScalarType.BYTES:
      return r => r.bytes();
    case ScalarType.FIXED32:
      return r => r.fixed32();
    case ScalarType.SFIXED32:
      return r => r.sfixed32();
    case ScalarType.SFIXED64:
      return long(r => r.sfixed64());
    case ScalarType.SINT64:
      return long(r => r.sint64());
    case ScalarType.UINT32:
      return r => r.uint32();
    case ScalarType.SINT32:
      return r => r.sint32();
  }
}

function zeroTest(type: ScalarType): (value: Value) => boolean {
  switch (type) {
    case ScalarType.STRING:
      return v => v === '';
    case ScalarType.BOOL:
      return v => v === false;
    case ScalarType.BYTES:
      return v => v.length === 0;
    default:
      // Numbers, and 64-bit values as bigint, number or string.
      return v => v == 0; // loose: 0, 0n and '0' alike
  }
}

function scalarZero(type: ScalarType, longAsString: boolean): Value {
  switch (type) {
    case ScalarType.STRING:
      return '';
    case ScalarType.BOOL:
      return false;
    case ScalarType.BYTES:
      return new Uint8Array(0);
    case ScalarType.INT64:
    case ScalarType.UINT64:
    case ScalarType.SINT64:
    case ScalarType.FIXED64:
    case ScalarType.SFIXED64:
      return longAsString ? '0' : 0n;
    default:
      return 0;
  }
}

/** A field's zero value: the value, when it cannot be changed, else a maker of a fresh one. */
function zeroOf(field: DescField): { value: Value } | { make: () => Value } {
  switch (field.fieldKind) {
    case 'list':
      return { make: () => [] };
    case 'map':
      return { make: () => ({}) };
    case 'enum':
      return { value: field.enum.values[0].number };
    case 'scalar':
      if (field.scalar === ScalarType.BYTES) return { make: () => new Uint8Array(0) };
      return { value: scalarZero(field.scalar, field.longAsString) };
    case 'message':
      return { value: undefined };
  }
}
