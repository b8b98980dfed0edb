//! `Session`: many calls on one stream. Each request is started at once, in
//! the order the requests came, and runs beside the others (a 30 s Lease must
//! not hold up a Complete); its answer goes out when it is done, with the
//! request's id.
//!
//! The stream ends when the client has closed its side and every call it made
//! is answered, or at shutdown once the calls in flight are answered (their
//! waits end at shutdown, as a single call's do). If the client goes away, the
//! calls it left in flight are stopped.
//!
//! A session sends at most [`MAX_UNSENT_ANSWERS`] answers the client has not
//! read yet. Past them it reads no request (HTTP/2 flow control then holds
//! the client back); the calls in flight run to their end and their answers
//! wait in the session (long-polls excepted: they run on only while the
//! client reads), so a client that never reads makes the server keep no more
//! than the answers of the calls it had in flight, at most [`MAX_CALLS`].
//!
//! Writes reach the core in the order they were sent, and a read waits until
//! every write sent before it on the session has been answered (long-polls
//! excepted), so a session reads its own writes, as one Redis connection
//! does: reads run on the latest snapshot at once, and one sent right behind
//! an add missed the job about half the time.
//!
//! Each call holds its request's bytes of the server's request budget
//! ([`crate::budget`]) until it has finished. While a call waits for them,
//! the session reads no further request and starts no later call, so calls
//! still start in the order they were sent.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use base64::Engine;
use connectrpc::{ConnectError, InboundStream, RequestContext, ServiceStream};
use futures::future::{AbortHandle, Aborted};
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use loam_jobs_proto::loam::jobs::v1 as pb;
use pb::__buffa::oneof;
use tokio::sync::{mpsc, watch};

use crate::budget::{Held, Overloaded};
use crate::errors::{DETAIL_TYPE, invalid, overloaded};
use crate::service::{Caller, JobsSvc};

type Answers = mpsc::Sender<Result<pb::SessionResponse, ConnectError>>;
type CallResult = Result<oneof::session_response::Result, ConnectError>;

/// Most answers a session keeps that its client has not read.
const MAX_UNSENT_ANSWERS: usize = 64;
/// Most calls in flight on one session, long-polls included.
const MAX_CALLS: usize = 4096;

/// Opens a session: checks the caller once, then reads requests until the
/// client is done.
pub async fn open(
    svc: JobsSvc,
    ctx: RequestContext,
    requests: InboundStream<pb::SessionRequest>,
) -> Result<ServiceStream<pb::SessionResponse>, ConnectError> {
    let ns = svc.session_namespace(&ctx)?;
    let (answers, out) = mpsc::channel(MAX_UNSENT_ANSWERS);
    tokio::spawn(failing_on_panic(read(svc, ns, ctx.peer_addr(), requests, answers.clone()), answers));
    Ok(Box::pin(futures::stream::unfold(out, |mut out| async move { out.recv().await.map(|a| (a, out)) })))
}

async fn read(
    svc: JobsSvc,
    ns: String,
    peer: Option<SocketAddr>,
    mut requests: InboundStream<pb::SessionRequest>,
    answers: Answers,
) {
    // Every call runs on this task. A call's first poll hands its operation to
    // the core, and FuturesUnordered polls new futures in the order they were
    // pushed; the next request is read only once both sets below were polled
    // and had nothing ready, so every call read was first polled before it.
    // So the core applies the writes of a session in the order they were
    // sent, and a read waits for the writes sent before it (`Writes`), as
    // Redis runs the commands of one connection; answers then go out as the
    // calls finish.
    let mut calls = FuturesUnordered::new();
    // Long-polls (a Lease, an event read or a wait for a job that may wait):
    // they hold no budget, and run on only while the client reads answers, so
    // a client that stops reading is handed no job it would not see.
    let mut polls = FuturesUnordered::new();
    let mut stops: HashMap<u64, Stop> = HashMap::new();
    let mut reading = true;
    let mut waiting: Option<Waiting> = None;
    // Answers of calls that finished while the client read none. Other calls
    // run to their end whatever the client reads, so they give their bytes of
    // the budget back (a client that stops reading must not hold up every
    // other). Nothing is read or started while any wait here, so they are at
    // most the calls in flight when the client stopped.
    let mut unsent: VecDeque<(u64, CallResult)> = VecDeque::new();
    // A request that could not be read ends the session with its error, once
    // the calls started before it are answered: each may have been applied,
    // and its caller must learn of it. Calls not answered when the session
    // ends were not applied (a long-poll's lease goes back when it is dropped).
    let mut unreadable = None;
    let mut writes = Writes::new();
    while reading || !calls.is_empty() || !polls.is_empty() || waiting.is_some() || !unsent.is_empty() {
        // Each turn below sends at most one answer: a finished call's, or a
        // refusal or cancel of the request read. Nothing goes on without a
        // place for it.
        let room = answers.capacity() > 0 && unsent.is_empty();
        // Checked first: the branch below is reached only when no request
        // is at hand, which a busy session put off past its shutdown. Then
        // the loop's condition again: with nothing in flight, the select
        // below would wait for the client to go.
        if reading && svc.shutdown().is_fired() {
            reading = false;
            continue;
        }
        tokio::select! {
            biased;
            // The client is gone: dropping the calls stops them.
            () = answers.closed() => return,
            // The client read an answer: the oldest kept goes out.
            Ok(place) = answers.reserve(), if !room => {
                if let Some((id, result)) = unsent.pop_front() {
                    place.send(Ok(response(id, result)));
                }
            }
            Some((id, write, result)) = calls.next(), if !calls.is_empty() => {
                writes.finish(write);
                finish(&answers, &mut stops, &mut unsent, room, id, result);
            }
            Some((id, write, result)) = polls.next(), if room && !polls.is_empty() => {
                writes.finish(write);
                finish(&answers, &mut stops, &mut unsent, room, id, result);
            }
            held = async {
                match waiting.as_mut() {
                    Some(w) => w.taking.as_mut().await,
                    None => std::future::pending().await,
                }
            }, if waiting.is_some() => {
                if let Some(Waiting { id, call, .. }) = waiting.take() {
                    match held {
                        Ok(held) => calls.push(start(&svc, &ns, &mut stops, &mut writes, id, call, Some(held))),
                        Err(o) if room => answer(&answers, id, Err(overloaded(&o))),
                        Err(o) => unsent.push_back((id, Err(overloaded(&o)))),
                    }
                }
            }
            next = requests.next(), if reading && waiting.is_none() && room && calls.len() + polls.len() < MAX_CALLS => match next {
                None => reading = false,
                Some(Err(e)) => {
                    reading = false;
                    polls = FuturesUnordered::new();
                    waiting = None;
                    unreadable = Some(e);
                }
                Some(Ok(message)) => {
                    let size = message.bytes().len();
                    let request = message.to_owned_message();
                    let id = request.id;
                    match request.call {
                        None => answer(&answers, id, Err(invalid("a session request names no call"))),
                        Some(oneof::session_request::Call::Cancel(_)) => match stops.get(&id) {
                            Some(Stop::Abort(_)) => {
                                if let Some(Stop::Abort(stop)) = stops.remove(&id) {
                                    stop.abort();
                                }
                                answer(&answers, id, Err(ConnectError::canceled("the call was canceled")));
                            }
                            Some(Stop::Abandon(abandoned)) => abandoned.store(true, Ordering::Relaxed),
                            None => {}
                        },
                        Some(_) if stops.contains_key(&id) => {
                            answer(&answers, id, Err(invalid(format!("call id {id} is already in flight on this session"))));
                        }
                        Some(call) => {
                            // A bad clock fails this call only, counted like any failed call.
                            let long_poll = is_long_poll(&call);
                            let call = Call { caller: svc.session_caller(&ns, request.now_ms, peer), call, long_poll };
                            if long_poll {
                                polls.push(start(&svc, &ns, &mut stops, &mut writes, id, call, None));
                            } else if let Some(held) = svc.budget().try_take(size) {
                                calls.push(start(&svc, &ns, &mut stops, &mut writes, id, call, Some(held)));
                            } else {
                                waiting = Some(Waiting { id, taking: Box::pin(svc.budget().take(size)), call });
                            }
                        }
                    }
                }
            },
            // At shutdown, no new calls; the waits of those in flight end.
            () = svc.shutdown().fired(), if reading => reading = false,
        }
    }
    if let Some(e) = unreadable {
        let _ = answers.send(Err(e)).await;
    }
}

/// Runs a session's `reading`. A panic in it (a bug in a call's handler: the
/// calls run on its task) ends the session with `internal`, never cleanly:
/// a client takes a clean end for "every call read was answered", and sends
/// the calls left unanswered again as never read, which some of these, handed
/// to the core before the panic, were not.
async fn failing_on_panic(reading: impl Future<Output = ()>, answers: Answers) {
    if let Err(panic) = std::panic::AssertUnwindSafe(reading).catch_unwind().await {
        let what = panic.downcast_ref::<&str>().copied().or_else(|| panic.downcast_ref::<String>().map(String::as_str));
        tracing::error!(panic = what.unwrap_or("?"), "a session's task panicked; the session ends with an error");
        let failed = ConnectError::internal("the session failed: the calls it had not answered may have been applied");
        let _ = answers.send(Err(failed)).await;
    }
}

/// A call read, waiting for its bytes of the budget.
struct Waiting {
    id: u64,
    taking: Pin<Box<dyn Future<Output = Result<Held, Overloaded>> + Send>>,
    call: Call,
}

/// A call read and not started yet.
struct Call {
    caller: Result<Caller, ConnectError>,
    call: oneof::session_request::Call,
    /// It may wait long (`is_long_poll`): it holds no budget and is no write a read waits for.
    long_poll: bool,
}

/// A call's answer, to send now or to keep until the client reads; none for
/// a call cancelled (answered when it was cancelled).
fn finish(
    answers: &Answers,
    stops: &mut HashMap<u64, Stop>,
    unsent: &mut VecDeque<(u64, CallResult)>,
    room: bool,
    id: u64,
    result: Result<CallResult, Aborted>,
) {
    if let Ok(result) = result
        && stops.remove(&id).is_some()
    {
        if room {
            answer(answers, id, result);
        } else {
            unsent.push_back((id, result));
        }
    }
}

/// A call that may wait for something to happen (up to 30 s). Its request is
/// small and its wait long: holding budget while it waits would hold up the
/// calls that end it.
fn is_long_poll(call: &oneof::session_request::Call) -> bool {
    use oneof::session_request::Call as C;
    match call {
        C::Lease(l) => crate::service::lease_waits(l),
        C::Query(q) => crate::service::query_waits(q),
        _ => false,
    }
}

/// The queue a write leases jobs from for its caller, if it may.
fn leasing_queue(call: &oneof::session_request::Call) -> Option<String> {
    use oneof::session_request::Call as C;
    match call {
        C::Lease(l) => Some(l.queue.clone()),
        C::Complete(c) if c.options.as_option().is_some_and(|o| o.fetch_next.is_set()) => Some(c.queue.clone()),
        _ => None,
    }
}

/// A call that reads what the writes before it left (a Query, ResultGet or
/// ResultMGet); every other call goes through the core's writer in order.
fn is_read(call: &oneof::session_request::Call) -> bool {
    use oneof::session_request::Call as C;
    matches!(call, C::Query(_) | C::ResultGet(_) | C::ResultMGet(_))
}

/// The session's writes in flight, numbered as they started, so that a read
/// can wait for those started before it. Long-polls are left out: a read
/// behind a Lease waiting 30 s for a job would wait as long.
struct Writes {
    started: u64,
    unfinished: BTreeSet<u64>,
    /// Every write numbered up to this one has finished.
    done: watch::Sender<u64>,
}

impl Writes {
    fn new() -> Self {
        Self { started: 0, unfinished: BTreeSet::new(), done: watch::Sender::new(0) }
    }

    /// Numbers a write starting now.
    fn start(&mut self) -> u64 {
        self.started += 1;
        self.unfinished.insert(self.started);
        self.started
    }

    fn finish(&mut self, write: Option<u64>) {
        let Some(write) = write else { return };
        self.unfinished.remove(&write);
        let through = self.unfinished.first().map_or(self.started, |first| first - 1);
        self.done.send_if_modified(|done| std::mem::replace(done, through) != through);
    }

    /// What a read starting now must wait for: the writes started before it.
    fn before_read(&self) -> Option<(watch::Receiver<u64>, u64)> {
        let after = self.started;
        (*self.done.borrow() < after).then(|| (self.done.subscribe(), after))
    }
}

/// How a cancel stops a call in flight.
enum Stop {
    /// A read or a long-poll: dropped, and answered `canceled` at once; a
    /// long-poll's lease goes back as it is dropped.
    Abort(AbortHandle),
    /// A write: its first poll handed it to the core, so it runs to its end
    /// and is answered then, with the jobs it leased for its caller (a Lease
    /// that does not wait, a Complete's next job) given back, since the
    /// caller will not run them. Dropped and answered `canceled`, as it once
    /// was, it was applied all the same, and a read sent behind it no longer
    /// waited for it and missed it.
    Abandon(Arc<AtomicBool>),
}

/// `call` made ready to run: it holds `held` of the budget until it has
/// answered, and stops as its entry in `stops` says. A write is numbered in
/// `writes` (returned with its answer, to be finished there); a read waits
/// for the writes started before it.
fn start<'a>(
    svc: &'a JobsSvc,
    ns: &'a str,
    stops: &mut HashMap<u64, Stop>,
    writes: &mut Writes,
    id: u64,
    call: Call,
    held: Option<Held>,
) -> impl Future<Output = (u64, Option<u64>, Result<CallResult, Aborted>)> + 'a {
    let read = is_read(&call.call);
    let write = (!read && !call.long_poll).then(|| writes.start());
    let before = if read { writes.before_read() } else { None };
    let abandoned = write.map(|_| Arc::new(AtomicBool::new(false)));
    let leases_in = abandoned.as_ref().and_then(|_| leasing_queue(&call.call));
    let abandoned_here = abandoned.clone();
    let run = async move {
        if let Some((mut done, after)) = before {
            // Its sender goes only with the session, whose calls go with it.
            let _ = done.wait_for(|done| *done >= after).await;
        }
        let mut result = svc.dispatch(call.caller, call.call).await;
        if let (Some(queue), Ok(answer)) = (leases_in, result.as_mut())
            && abandoned_here.is_some_and(|a| a.load(Ordering::Relaxed))
        {
            svc.give_back_leased(ns, &queue, answer);
        }
        result
    };
    let (run, stop) = futures::future::abortable(run);
    stops.insert(id, abandoned.map_or(Stop::Abort(stop), Stop::Abandon));
    run.map(move |result| {
        drop(held);
        (id, write, result)
    })
}

fn answer(answers: &Answers, id: u64, result: CallResult) {
    // Never full: `read` sends only with a place for the answer.
    let _ = answers.try_send(Ok(response(id, result)));
}

fn response(id: u64, result: CallResult) -> pb::SessionResponse {
    let result = match result {
        Ok(r) => r,
        Err(e) => oneof::session_response::Result::from(error(&e)),
    };
    pb::SessionResponse { id, result: Some(result), ..Default::default() }
}

/// A failed call's error as a message: the code, the message and the detail a
/// single call's error carries.
fn error(e: &ConnectError) -> pb::BulkError {
    let detail = e
        .details
        .iter()
        .find(|d| d.type_url.ends_with(DETAIL_TYPE))
        .and_then(|d| d.value.as_deref())
        .and_then(|v| base64::engine::general_purpose::STANDARD_NO_PAD.decode(v.trim_end_matches('=')).ok())
        .and_then(|bytes| buffa::Message::decode_from_slice(&bytes).ok());
    pb::BulkError {
        code: e.code.as_str().into(),
        message: e.message.clone().unwrap_or_default(),
        detail: detail.into(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use connectrpc::ErrorCode;

    use super::*;

    /// A session whose task panicked ends with an error, not cleanly: its
    /// client would send the calls it left unanswered again (some of which
    /// may have been applied) as never read.
    #[tokio::test]
    async fn a_session_whose_task_panics_ends_with_an_error() {
        let (answers, mut out) = mpsc::channel(MAX_UNSENT_ANSWERS);
        let sent = answers.clone();
        let reading = async move {
            let _ = sent.send(Ok(response(1, Err(ConnectError::canceled("answered"))))).await;
            panic!("a bug in a call's handler");
        };
        tokio::spawn(failing_on_panic(reading, answers)).await.unwrap();
        assert!(matches!(out.recv().await, Some(Ok(_))));
        let end = out.recv().await.expect("an end with an error, not a clean end");
        assert_eq!(end.unwrap_err().code, ErrorCode::Internal);
        assert!(out.recv().await.is_none());
    }

    #[tokio::test]
    async fn a_session_that_ends_well_ends_cleanly() {
        let (answers, mut out) = mpsc::channel(MAX_UNSENT_ANSWERS);
        tokio::spawn(failing_on_panic(async {}, answers)).await.unwrap();
        assert!(out.recv().await.is_none());
    }
}
