//! A queue's event log: its events, and the pages that hold them.

use serde::{Deserialize, Serialize};

use super::encode_into;
use crate::error::StoreError;

/// One entry of a queue's event log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub seq: u64,
    /// Milliseconds since the epoch when it was written.
    pub ts: u64,
    /// BullMQ's event name (`added`, `completed`, ...).
    pub name: String,
    /// Other fields, in order (BullMQ's `jobId`, `prev`, `returnvalue`, ...).
    pub fields: Vec<(String, String)>,
}

/// An event as it is written: the same encoding as [`Event`], from borrowed
/// fields, and after them where the fields are kept ([`EventPlacement`]): nothing
/// for fields in the page, as events were written before the others existed.
pub(crate) struct EventRef<'a> {
    pub seq: u64,
    pub ts: u64,
    pub name: &'a str,
    pub fields: &'a [(&'a str, &'a str)],
    pub placement: EventPlacement,
}

/// Where an event's fields are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EventPlacement {
    /// In its page.
    Inline,
    /// Under their own key (`QueueKeys::event_body`), the whole record there
    /// and in the page a record without them. A page is written whole at
    /// each append, so pages of large events (a completed job's return
    /// value, a progress report with data) made each event copy up to 64 of
    /// them. For fields larger than [`INLINE_EVENT_BYTES`].
    Body,
    /// In its page, but for [`RETURN_VALUE_FIELD`], which is the job's
    /// record's value, lent while the record holds it
    /// ([`super::JobRecord::return_value_event`]), and after that under the
    /// event's own key as text. For a large return value of a job that is
    /// kept: written once, not in the record and again in the event.
    LentValue,
}

impl Serialize for EventRef<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        // An array, as the derived encoding of `PagedEvent`'s fields; the
        // flags that are false at its end are left out.
        let flags: &[bool] = match self.placement {
            EventPlacement::Inline => &[],
            EventPlacement::Body => &[true],
            EventPlacement::LentValue => &[false, true],
        };
        let mut record = serializer.serialize_tuple(4 + flags.len())?;
        record.serialize_element(&self.seq)?;
        record.serialize_element(&self.ts)?;
        record.serialize_element(self.name)?;
        record.serialize_element(self.fields)?;
        for flag in flags {
            record.serialize_element(flag)?;
        }
        record.end()
    }
}

/// Most bytes of fields an event keeps in its page (see [`EventPlacement`]).
pub(crate) const INLINE_EVENT_BYTES: usize = 2048;

/// The field of a `completed` event that holds the job's return value.
pub(crate) const RETURN_VALUE_FIELD: &str = "returnvalue";

/// The field of a job's event that holds its id: a lent return value is read
/// from the record it names.
pub(crate) const JOB_ID_FIELD: &str = "jobId";

/// An event's record as its page holds it (see [`EventRef`]); records
/// written before `body` or `lent_value` existed read as inline.
#[derive(Deserialize)]
pub(crate) struct PagedEvent {
    pub seq: u64,
    pub ts: u64,
    pub name: String,
    pub fields: Vec<(String, String)>,
    /// [`EventPlacement::Body`].
    #[serde(default)]
    pub body: bool,
    /// [`EventPlacement::LentValue`].
    #[serde(default)]
    pub lent_value: bool,
}

impl From<PagedEvent> for Event {
    fn from(e: PagedEvent) -> Self {
        Event { seq: e.seq, ts: e.ts, name: e.name, fields: e.fields }
    }
}

/// Appends one record to a page of records (a length, then its encoding),
/// encoded in place.
pub(crate) fn append_to_page<T: Serialize>(page: &mut Vec<u8>, record: &T) {
    let at = page.len();
    page.extend_from_slice(&[0; 4]);
    encode_into(page, record);
    let len = (page.len() - at - 4) as u32;
    page[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

/// The records of a page, oldest first; a truncated page is a corrupt record.
pub(crate) fn page_records(page: &[u8]) -> impl Iterator<Item = Result<&[u8], StoreError>> {
    let mut rest = page;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let record = rest
            .get(..4)
            .map(|n| u32::from_be_bytes([n[0], n[1], n[2], n[3]]) as usize)
            .and_then(|len| rest.get(4..4 + len).map(|r| (r, 4 + len)));
        match record {
            Some((r, used)) => {
                rest = &rest[used..];
                Some(Ok(r))
            }
            None => {
                rest = &[];
                Some(Err(StoreError::Corrupt("an event page ends inside a record".into())))
            }
        }
    })
}

impl Event {
    /// The Redis-stream-shaped id BullMQ shows: `<ms>-<seq>`.
    pub fn id(&self) -> String {
        Self::id_of(self.ts, self.seq)
    }

    /// The id of the event written at `ts` with sequence `seq`.
    pub fn id_of(ts: u64, seq: u64) -> String {
        format!("{ts}-{seq}")
    }

    /// A Redis stream id, `<ms>-<seq>` or `<ms>` (sequence 0), as XREAD
    /// reads one; None for anything else.
    pub fn parse_id(id: &str) -> Option<(u64, u64)> {
        let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
        let number = |s: &str| if s.bytes().all(|b| b.is_ascii_digit()) { s.parse().ok() } else { None };
        Some((number(ms)?, number(seq)?))
    }
}
