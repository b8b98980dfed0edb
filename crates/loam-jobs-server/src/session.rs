//! `Session`: many calls on one stream. Each request is run at once, beside
//! the others (a 30 s Lease must not hold up a Complete), and its answer goes
//! out when it is done, with the request's id.
//!
//! The stream ends when the client has closed its side and every call it made
//! is answered, or at shutdown once the calls in flight are answered (their
//! waits end at shutdown, as a single call's do). If the client goes away, the
//! calls it left in flight are stopped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use base64::Engine;
use connectrpc::{ConnectError, InboundStream, RequestContext, ServiceStream};
use futures::StreamExt;
use loam_jobs_proto::loam::jobs::v1 as pb;
use pb::__buffa::oneof;
use tokio::sync::mpsc;
use futures::future::AbortHandle;

use crate::errors::{DETAIL_TYPE, invalid};
use crate::service::{JobsSvc, NOW_HEADER};

type Answers = mpsc::UnboundedSender<Result<pb::SessionResponse, ConnectError>>;

/// Opens a session: checks the caller once, then reads requests until the
/// client is done.
pub async fn open(
    svc: JobsSvc,
    ctx: RequestContext,
    requests: InboundStream<pb::SessionRequest>,
) -> Result<ServiceStream<pb::SessionResponse>, ConnectError> {
    svc.authorize(&ctx)?;
    let (answers, out) = mpsc::unbounded_channel();
    tokio::spawn(read(svc, ctx, requests, answers));
    Ok(Box::pin(futures::stream::unfold(out, |mut out| async move { out.recv().await.map(|a| (a, out)) })))
}

async fn read(svc: JobsSvc, ctx: RequestContext, mut requests: InboundStream<pb::SessionRequest>, answers: Answers) {
    let in_flight: Arc<Mutex<HashMap<u64, AbortHandle>>> = Arc::default();
    loop {
        let next = tokio::select! {
            next = requests.next() => next,
            () = answers.closed() => {
                // The client is gone: nobody waits for what it left running.
                for (_, call) in in_flight.lock().map(|mut m| std::mem::take(&mut *m)).unwrap_or_default() {
                    call.abort();
                }
                return;
            }
            () = svc.shutdown().fired() => return,
        };
        let request = match next {
            None => return,
            Some(Err(e)) => {
                let _ = answers.send(Err(e));
                return;
            }
            Some(Ok(message)) => message.to_owned_message(),
        };
        let id = request.id;
        match request.call {
            None => answer(&answers, id, Err(invalid("a session request names no call"))),
            Some(oneof::session_request::Call::Cancel(_)) => {
                let call = in_flight.lock().ok().and_then(|mut m| m.remove(&id));
                if let Some(call) = call {
                    call.abort();
                    answer(&answers, id, Err(ConnectError::canceled("the call was canceled")));
                }
            }
            Some(call) => {
                let ctx = at_time(&ctx, request.now_ms);
                let (svc, answers, registry) = (svc.clone(), answers.clone(), Arc::clone(&in_flight));
                let (call, stop) = futures::future::abortable(async move {
                    let result = svc.dispatch(ctx, call).await;
                    // Removed by a cancel, the call was answered already.
                    let cancelled = registry.lock().map(|mut m| m.remove(&id).is_none()).unwrap_or(false);
                    if !cancelled {
                        answer(&answers, id, result);
                    }
                });
                if let Ok(mut m) = in_flight.lock() {
                    m.insert(id, stop);
                }
                tokio::spawn(call);
            }
        }
    }
}

/// The session's context for one call: its own clock, as a single call's
/// `loam-now-ms` header would give it.
fn at_time(ctx: &RequestContext, now_ms: i64) -> RequestContext {
    let mut ctx = ctx.clone();
    let headers = ctx.headers_mut();
    headers.remove(NOW_HEADER);
    if now_ms > 0
        && let Ok(value) = http::HeaderValue::from_str(&now_ms.to_string())
    {
        headers.insert(NOW_HEADER, value);
    }
    ctx
}

fn answer(answers: &Answers, id: u64, result: Result<oneof::session_response::Result, ConnectError>) {
    let result = match result {
        Ok(r) => r,
        Err(e) => oneof::session_response::Result::from(error(&e)),
    };
    let _ = answers.send(Ok(pb::SessionResponse { id, result: Some(result), ..Default::default() }));
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
