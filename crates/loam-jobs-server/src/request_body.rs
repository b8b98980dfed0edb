//! How the server reads request bodies: timed, so that one that stops half
//! way fails, and not at all for a request refused on its headers.
//!
//! **Bodies that stop arriving.** A call is in flight from its request until
//! its answer has gone, so a connection with a call whose body stopped half
//! way was never idle (`listen`): a client could send part of a request and
//! nothing more, and the server held the stream, and what it had read of the
//! body, for ever. The server gives up on a request whose body sends nothing
//! for `--request-body-timeout-secs` while the server waits for the rest of
//! it, as nginx's `client_body_timeout` does: the call fails, and what was
//! read is dropped. The clock runs only while the server is reading (it does
//! not while the call waits for the request budget: HTTP/2 flow control then
//! holds the client back) and starts again at each piece that arrives, so a
//! slow link that keeps sending is never cut. A Session's request stream is
//! many messages, and a client with nothing to ask sends nothing between
//! them: there only a message begun and not finished is timed.
//!
//! **Requests without a known token.** connectrpc reads a request's whole
//! body before any code of ours runs (its interceptors too), and the handler
//! checks the caller only then: a client with no token could make the server
//! read and hold bodies of up to `--max-request-bytes` each. A request that
//! carries no token the server knows has its body replaced, unread, by an
//! empty message in the request's own format (`stub`); connectrpc decodes
//! that, and the handler refuses the caller exactly as it would have, in the
//! protocol the client spoke.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::body::{Body, Bytes, Frame, SizeHint};

/// The request path of the `Session` call, whose stream is many messages.
const SESSION_PATH: &str = "/loam.jobs.v1.JobsService/Session";

/// A streamed message's header (Connect and gRPC alike): a flags byte and a
/// 32-bit big-endian length.
const HEADER_BYTES: usize = 5;

/// Why a request body ended before its end.
#[derive(Debug)]
pub enum BodyError {
    /// The connection's own error (reset, closed).
    Read(hyper::Error),
    /// Nothing arrived for this long while the server waited for the rest.
    Stalled(Duration),
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BodyError::Read(e) => e.fmt(f),
            BodyError::Stalled(after) => write!(
                f,
                "the request sent nothing for {} s before its end (--request-body-timeout-secs)",
                after.as_secs()
            ),
        }
    }
}

impl std::error::Error for BodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BodyError::Read(e) => Some(e),
            BodyError::Stalled(_) => None,
        }
    }
}

/// Where a body stands between its messages: what is left of the current one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    /// The whole body is one request: waiting anywhere before its end is
    /// waiting inside it.
    Whole,
    /// A stream of messages: `header` bytes of the next header seen (its
    /// length read into `length` as they come), or `payload` bytes of a
    /// message still to come.
    Messages { header: usize, length: u32, payload: u64 },
}

impl Framing {
    fn for_path(path: &str) -> Self {
        if path == SESSION_PATH { Framing::Messages { header: 0, length: 0, payload: 0 } } else { Framing::Whole }
    }

    /// Whether the body is inside a message (a wait now is a stall).
    fn inside(&self) -> bool {
        match *self {
            Framing::Whole => true,
            Framing::Messages { header, payload, .. } => header > 0 || payload > 0,
        }
    }

    /// Follows the message boundaries through `data`.
    fn advance(&mut self, mut data: &[u8]) {
        let Framing::Messages { header, length, payload } = self else { return };
        while !data.is_empty() {
            if *payload > 0 {
                let taken = usize::try_from(*payload).unwrap_or(usize::MAX).min(data.len());
                *payload -= taken as u64;
                data = &data[taken..];
                continue;
            }
            // The flags byte, then the length's four bytes.
            if *header > 0 {
                *length = (*length << 8) | u32::from(data[0]);
            }
            *header += 1;
            data = &data[1..];
            if *header == HEADER_BYTES {
                *payload = u64::from(*length);
                *header = 0;
                *length = 0;
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// A request body that fails once it has sent nothing for `within`
    /// while the server waits inside a request.
    pub struct TimedBody<B> {
        #[pin]
        inner: B,
        #[pin]
        timer: Option<tokio::time::Sleep>,
        within: Option<Duration>,
        framing: Framing,
    }
}

impl<B> TimedBody<B> {
    /// `body` of a request to `path`; `within` None leaves it untimed.
    pub fn new(body: B, path: &str, within: Option<Duration>) -> Self {
        TimedBody { inner: body, timer: None, within, framing: Framing::for_path(path) }
    }
}

impl<B> Body for TimedBody<B>
where
    B: Body<Data = Bytes, Error = hyper::Error>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut me = self.project();
        match me.inner.poll_frame(cx) {
            Poll::Ready(frame) => {
                me.timer.set(None);
                if let Some(Ok(frame)) = &frame
                    && let Some(data) = frame.data_ref()
                {
                    me.framing.advance(data);
                }
                Poll::Ready(frame.map(|r| r.map_err(BodyError::Read)))
            }
            Poll::Pending => {
                let Some(within) = *me.within else { return Poll::Pending };
                if !me.framing.inside() {
                    return Poll::Pending;
                }
                if me.timer.is_none() {
                    me.timer.set(Some(tokio::time::sleep(within)));
                }
                match me.timer.as_pin_mut().map(|t| t.poll(cx)) {
                    Some(Poll::Ready(())) => Poll::Ready(Some(Err(BodyError::Stalled(within)))),
                    _ => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project_lite::pin_project! {
    /// A request's body as the RPC service reads it: from the connection,
    /// timed, or a stand-in for a request refused on its headers.
    #[project = RequestBodyProj]
    pub enum RequestBody<B> {
        Read { #[pin] body: TimedBody<B> },
        Stub { message: Option<Bytes> },
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes, Error = hyper::Error>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project() {
            RequestBodyProj::Read { body } => body.poll_frame(cx),
            RequestBodyProj::Stub { message } => Poll::Ready(message.take().map(|m| Ok(Frame::data(m)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Read { body } => body.is_end_stream(),
            RequestBody::Stub { message } => message.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Read { body } => body.size_hint(),
            RequestBody::Stub { message } => SizeHint::with_exact(message.as_ref().map_or(0, |m| m.len() as u64)),
        }
    }
}

/// The stand-in body of a request refused on its headers: an empty message
/// in the request's format (`{}` for JSON; inside one message envelope for
/// gRPC, gRPC-Web and Connect's streams), its length and compression headers
/// dropped to match. The body the client sends is never read.
pub fn stub(headers: &mut http::HeaderMap) -> Bytes {
    for name in [CONTENT_LENGTH, CONTENT_ENCODING] {
        headers.remove(name);
    }
    headers.remove("connect-content-encoding");
    headers.remove("grpc-encoding");
    // The media type without its parameters, as connectrpc picks its codec by.
    let media_type = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let json = media_type == "application/json" || media_type.ends_with("+json");
    let message: &[u8] = if json { b"{}" } else { b"" };
    let enveloped = media_type.starts_with("application/grpc") || media_type.starts_with("application/connect+");
    if !enveloped {
        return Bytes::from_static(message);
    }
    let mut framed = Vec::with_capacity(HEADER_BYTES + message.len());
    framed.push(0);
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(message);
    Bytes::from(framed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages() -> Framing {
        Framing::for_path(SESSION_PATH)
    }

    #[test]
    fn a_session_is_inside_a_message_from_its_first_byte_to_its_last() {
        let mut f = messages();
        assert!(!f.inside());
        // A header split over two pieces, then a 3-byte payload in two.
        f.advance(&[0, 0, 0]);
        assert!(f.inside());
        f.advance(&[0, 3, b'a']);
        assert!(f.inside());
        f.advance(b"bc");
        assert!(!f.inside());
        // Two whole messages and the start of a third in one piece.
        f.advance(&[0, 0, 0, 0, 1, b'x', 0, 0, 0, 0, 0, 2]);
        assert!(f.inside());
        assert_eq!(f, Framing::Messages { header: 1, length: 0, payload: 0 });
        f.advance(&[0, 0, 0, 0]);
        // An empty message ends with its header.
        assert!(!f.inside());
    }

    #[test]
    fn a_length_is_read_big_endian_across_pieces() {
        let mut f = messages();
        f.advance(&[0, 0x01]);
        f.advance(&[0x02, 0x03, 0x04]);
        assert_eq!(f, Framing::Messages { header: 0, length: 0, payload: 0x0102_0304 });
    }

    #[test]
    fn a_stub_is_an_empty_message_in_the_request_s_format() {
        let stub_for = |content_type: &str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(CONTENT_TYPE, content_type.parse().unwrap());
            headers.insert(CONTENT_LENGTH, "80000000".parse().unwrap());
            headers.insert("grpc-encoding", "gzip".parse().unwrap());
            let body = stub(&mut headers);
            assert!(!headers.contains_key(CONTENT_LENGTH) && !headers.contains_key("grpc-encoding"));
            body
        };
        assert_eq!(&stub_for("application/json")[..], b"{}");
        assert_eq!(&stub_for("application/proto")[..], b"");
        assert_eq!(&stub_for("application/grpc")[..], &[0, 0, 0, 0, 0]);
        assert_eq!(&stub_for("application/grpc-web+proto")[..], &[0, 0, 0, 0, 0]);
        assert_eq!(&stub_for("application/connect+json")[..], &[0, 0, 0, 0, 2, b'{', b'}']);
        // The format is the media type's, not its parameters'.
        assert_eq!(&stub_for("application/json; charset=utf-8")[..], b"{}");
        assert_eq!(&stub_for("application/proto; x=json")[..], b"");
        assert_eq!(&stub_for("application/grpc+json")[..], &[0, 0, 0, 0, 2, b'{', b'}']);
    }

    #[test]
    fn any_other_call_is_one_request_inside_until_its_end() {
        let mut f = Framing::for_path("/loam.jobs.v1.JobsService/Enqueue");
        assert!(f.inside());
        f.advance(&[0, 0, 0, 0, 0]);
        assert!(f.inside());
    }
}
