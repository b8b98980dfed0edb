//! The records the core stores and the types its callers pass.
//!
//! Records are MessagePack arrays of their fields in declaration order
//! (3.7 times smaller than maps with names, and twice as fast to read, and
//! the job record is read and written several times per job). So fields are
//! only ever appended, each new one with `#[serde(default)]`, so a newer
//! build still reads an older file. Decoding also accepts the map form.

use std::borrow::Cow;
use std::hash::Hasher;

use serde::{Deserialize, Serialize};

use crate::error::{JobsError, StoreError};

mod dedup;
mod enqueue;
mod event;
mod flow;
mod idempotency;
mod job;
mod lease;
mod outcome;
mod queue;
mod scheduler;
#[cfg(test)]
mod tests;

pub use dedup::*;
pub use enqueue::*;
pub use event::*;
pub use flow::*;
pub use idempotency::*;
pub use job::*;
pub use lease::*;
pub use outcome::*;
pub use queue::*;
pub use scheduler::*;

/// A job's data or return value as text. From BullMQ it is JSON, so UTF-8,
/// and is checked that way first: `String::from_utf8_lossy` alone checks byte
/// by byte, and at 100 KB it was half of the executor's time a completion.
/// Other clients' bytes may be anything, and are mended (U+FFFD) in the text
/// only; the stored bytes stay as they are.
pub fn as_text(bytes: &[u8]) -> Cow<'_, str> {
    std::str::from_utf8(bytes).map_or_else(|_| String::from_utf8_lossy(bytes), Cow::Borrowed)
}

/// BullMQ's largest priority (2^21 - 1).
pub const MAX_PRIORITY: u32 = (1 << 21) - 1;

/// Sequence numbers start here: FIFO jobs count up from it, LIFO jobs count
/// down, so a LIFO job sorts before every FIFO job of its priority.
pub const SEQ_ORIGIN: u64 = 1 << 63;

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    encode_with_capacity(value, 256)
}

/// [`encode`] into a buffer of `capacity` bytes to start with.
fn encode_with_capacity<T: Serialize>(value: &T, capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(capacity);
    encode_into(&mut out, value);
    out
}

/// Appends `value`'s encoding to `out`.
fn encode_into<T: Serialize>(out: &mut Vec<u8>, value: &T) {
    // Serializing plain structs into a Vec cannot fail.
    let _ = rmp_serde::encode::write(out, value);
}

/// Feeds `value`'s encoding to `hasher`, the same bytes [`encode`] returns,
/// without holding them whole: an idempotency key's hash covers the whole
/// request, and built first, the encoding of a 64 MiB payload took 128 MiB
/// more for a moment. A `BufWriter` gathers the encoder's small writes (fed
/// one by one, they made a small request's hash half as slow again) and
/// passes a large one through as it is; the hash is the same however its
/// input is cut.
pub(crate) fn hash_encoding<T: Serialize>(hasher: &mut impl Hasher, value: &T) {
    struct Feed<'a, H>(&'a mut H);
    impl<H: Hasher> std::io::Write for Feed<'_, H> {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.write(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut feed = std::io::BufWriter::with_capacity(4096, Feed(hasher));
    // Serializing plain structs into a hasher cannot fail, nor can flushing
    // what was gathered into it.
    let _ = rmp_serde::encode::write(&mut feed, value);
    let _ = std::io::Write::flush(&mut feed);
}

pub fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, StoreError> {
    rmp_serde::from_slice(bytes).map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// Which of `len` items positions `start..=end` take, as Redis's `LRANGE`
/// reads them (BullMQ's range getters take theirs so): a negative position
/// counts from the end (-1 is the last), and the range is clipped to the
/// items; `None` when it holds none.
pub(crate) fn lrange(len: usize, start: i64, end: i64) -> Option<std::ops::RangeInclusive<usize>> {
    let len = i64::try_from(len).unwrap_or(i64::MAX);
    let at = |i: i64| if i < 0 { len.saturating_add(i) } else { i };
    let (from, to) = (at(start).max(0), at(end).min(len - 1));
    (from <= to).then_some(from as usize..=to as usize)
}

pub(crate) fn validate_name(kind: &str, value: &str, max: usize) -> Result<(), JobsError> {
    if value.is_empty() || value.len() > max {
        return Err(JobsError::invalid(format!("{kind} must be 1 to {max} bytes, got {}", value.len())));
    }
    // Any other bytes are fine: keys escape every byte they need to.
    Ok(())
}
