//! `Watch`: a stream of a queue's events from a cursor, read ahead of the
//! client by a bounded number of bytes, with a heartbeat while nothing comes.

use super::*;

/// The longest a watch goes without a message (see `WatchResponse`).
const WATCH_HEARTBEAT: Duration = Duration::from_secs(5);
/// Most bytes of events a watch reads ahead of its client (at least one
/// event). A watch reads the log only when the connection takes its next
/// message, so this is what a client that stops reading holds here per
/// watch; 256 events whatever their size held 256 MB of 1 MB payloads.
const WATCH_READ_AHEAD: usize = 4 << 20;

impl JobsSvc {
    pub(super) async fn do_watch(
        &self,
        c: Caller,
        req: pb::WatchRequest,
    ) -> Result<ServiceStream<pb::WatchResponse>, ConnectError> {
        let waiting = self.waiting.take(&c.ns)?;
        let (ns, queue) = (c.ns, req.queue);
        // "From now" is pinned before the stream starts, so nothing written
        // after this call returns can be missed.
        let cursor = match req.after {
            Some(a) => a,
            None => c.jobs.query(&ns, &queue, query::last_event_seq).map_err(core_err)?,
        };
        let state = WatchState {
            jobs: self.jobs.clone(),
            ns,
            queue,
            cursor,
            job: req.job_id,
            stop: self.shutdown.clone(),
            buffered: std::collections::VecDeque::new(),
            failed: false,
            limit: 1,
            _waiting: waiting,
        };
        let stream = futures::stream::unfold(state, |mut st| async move {
            loop {
                if let Some(e) = st.buffered.pop_front() {
                    let msg =
                        pb::WatchResponse { event: convert::event(&e).into(), cursor: e.seq, ..Default::default() };
                    return Some((Ok(msg), st));
                }
                if st.failed {
                    return None;
                }
                if st.stop.is_fired() || st.jobs.is_closed() {
                    // Not a clean end: the client should resume elsewhere or
                    // once the server is back, from the cursor it last heard.
                    st.failed = true;
                    return Some((Err(shutting_down(st.cursor)), st));
                }
                let bounds = st.jobs.query(&st.ns, &st.queue, |tx, q| {
                    let stats = tx.stats(q)?;
                    Ok((stats.first_event, stats.last_event))
                });
                match bounds {
                    Ok((_, newest)) if st.cursor > newest => {
                        st.failed = true;
                        return Some((Err(cursor_ahead(st.cursor, newest)), st));
                    }
                    Ok((oldest, _)) if st.cursor > 0 && oldest > st.cursor + 1 => {
                        st.failed = true;
                        return Some((Err(events_trimmed(st.cursor, oldest)), st));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        st.failed = true;
                        return Some((Err(core_err(e)), st));
                    }
                }
                let read = st
                    .jobs
                    .read_events(&st.ns, &st.queue, Some(st.cursor), st.limit, WATCH_HEARTBEAT, Some(&st.stop), None)
                    .await;
                match read {
                    Ok(events) => {
                        // Keep WATCH_READ_AHEAD bytes of what was read; the
                        // rest is read again when the client has taken these.
                        let (mut kept, mut bytes) = (0, 0);
                        for e in events {
                            let size = event_bytes(&e);
                            if kept > 0 && bytes + size > WATCH_READ_AHEAD {
                                break;
                            }
                            (kept, bytes) = (kept + 1, bytes + size);
                            st.cursor = e.seq;
                            if st.wanted(&e) {
                                st.buffered.push_back(e);
                            }
                        }
                        // Next, as many events of this size as the bound
                        // holds, growing at most twofold a read.
                        if let Some(each) = bytes.checked_div(kept) {
                            let fit = WATCH_READ_AHEAD / each.max(1);
                            st.limit = fit.clamp(1, (st.limit * 2).min(EVENT_BATCH));
                        }
                        if st.buffered.is_empty() && !st.stop.is_fired() {
                            // Nothing for this watch: a heartbeat with how far the
                            // server read, so a client resuming after it neither
                            // reads those events again nor finds them trimmed.
                            let msg = pb::WatchResponse { cursor: st.cursor, ..Default::default() };
                            return Some((Ok(msg), st));
                        }
                    }
                    Err(e) => {
                        st.failed = true;
                        return Some((Err(core_err(e)), st));
                    }
                }
            }
        });
        Ok(Box::pin(stream))
    }
}

struct WatchState {
    jobs: Jobs,
    ns: String,
    queue: String,
    cursor: u64,
    job: Option<String>,
    stop: Interrupt,
    buffered: std::collections::VecDeque<Event>,
    failed: bool,
    /// Events the next read takes (see `WATCH_READ_AHEAD`).
    limit: usize,
    /// The stream's place among its namespace's waiting calls, for as long as it is open.
    _waiting: crate::waits::Waiting,
}

/// About what an event holds in memory.
fn event_bytes(e: &Event) -> usize {
    64 + e.name.len() + e.fields.iter().map(|(k, v)| 48 + k.len() + v.len()).sum::<usize>()
}

impl WatchState {
    fn wanted(&self, e: &Event) -> bool {
        match &self.job {
            None => true,
            Some(id) => e.fields.iter().any(|(k, v)| k == "jobId" && v == id),
        }
    }
}
