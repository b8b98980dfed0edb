//! A scan through a layer of writes: the layer's entries in the range merged
//! with the scan of what lies below it, with the scan floors that let later
//! scans skip what the layer's deletes cover.

use std::collections::BTreeMap;
use std::ops::Bound;

use super::{Key, KeyRange, KvRead, Value, Writes};
use crate::error::StoreError;

/// Which side the next entry of a merge comes from.
enum Take {
    Local,
    Base,
    /// The write, over the base entry with its key.
    Shadowed,
}

/// Merges writes (in scan order, `None` = deleted) over base entries (in scan
/// order), up to `limit` entries. Also returns the last base key of the
/// leading run of base entries that the writes shadow (forward scans only),
/// which is what scan floors are made of. Base entries are moved, not copied:
/// every layer of a lease's scan passes its result up through here.
fn merge(
    local: &[(&Key, &Option<Value>)],
    base: Vec<(Key, Value)>,
    limit: usize,
    reverse: bool,
) -> (Vec<(Key, Value)>, Option<Key>) {
    let before = |a: &[u8], b: &[u8]| if reverse { a > b } else { a < b };
    let mut out = Vec::with_capacity(limit.min(base.len() + local.len()));
    let mut base = base.into_iter().peekable();
    let mut local = local.iter().peekable();
    let mut shadowed_prefix: Option<Key> = None;
    let mut prefix_open = !reverse;
    while out.len() < limit {
        let take = match (base.peek(), local.peek()) {
            (Some((bk, _)), Some((lk, _))) if bk == *lk => Take::Shadowed,
            (Some((bk, _)), Some((lk, _))) if before(lk, bk) => Take::Local,
            (Some(_), _) => Take::Base,
            (None, Some(_)) => Take::Local,
            (None, None) => break,
        };
        if let Take::Base = take {
            prefix_open = false;
            out.extend(base.next());
            continue;
        }
        if let Take::Shadowed = take
            && let Some((bk, _)) = base.next()
            && prefix_open
        {
            shadowed_prefix = Some(bk);
        }
        if let Some((k, Some(v))) = local.next() {
            out.push(((*k).clone(), v.clone()));
        }
    }
    (out, shadowed_prefix)
}

/// Scans `base` under `local`, the writes over it in `range` (in scan order):
/// a forward scan reads the base from the floor remembered for its start, and
/// remembers a higher one when the writes shadow the base entries it reads
/// first. A floor says every base key in `[start, floor)` has a write over it,
/// so it holds while the base stays the same and no write is taken back.
pub(super) fn scan_under(
    local: Vec<(&Key, &Option<Value>)>,
    floors: &mut BTreeMap<Key, Key>,
    base: &mut dyn KvRead,
    range: &KeyRange,
    limit: usize,
    reverse: bool,
) -> Result<Vec<(Key, Value)>, StoreError> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    if local.is_empty() {
        return base.scan(range, limit, reverse);
    }
    let floor = if reverse { None } else { floors.get(&range.start) };
    let floored;
    let base_range = match floor {
        Some(f) => {
            floored = KeyRange::new(f.min(&range.end).clone(), range.end.clone());
            &floored
        }
        None => range,
    };
    // Only a delete can hide a base entry (a put over one replaces it one for
    // one), so asking the base for `limit + hiding` entries always yields
    // enough survivors. Counting every write asked a lease's scan, under the
    // jobs added by the batches in flight, for hundreds of entries it dropped.
    let hiding = local.iter().filter(|(k, v)| v.is_none() && floor.is_none_or(|f| *k >= f)).count();
    let base = base.scan(base_range, limit.saturating_add(hiding), reverse)?;
    let (out, shadowed) = merge(&local, base, limit, reverse);
    if let Some(mut next) = shadowed {
        next.push(0); // the smallest key after the last shadowed one
        floors.insert(range.start.clone(), next);
    }
    Ok(out)
}

pub(super) fn local_range<'w>(
    writes: &'w Writes,
    range: &KeyRange,
    reverse: bool,
) -> Vec<(&'w Key, &'w Option<Value>)> {
    let entries = writes.range::<[u8], _>(bounds(range));
    if reverse { entries.rev().collect() } else { entries.collect() }
}

/// `range` as bounds a map of keys takes, borrowed: a scan passes through
/// several maps, and cloning the bounds for each cost two allocations.
fn bounds(range: &KeyRange) -> (Bound<&[u8]>, Bound<&[u8]>) {
    (Bound::Included(&range.start), Bound::Excluded(&range.end))
}
