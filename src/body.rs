//! Request and backend bodies: a client's request body from either server ([`ClientBody`]), read
//! up to the retry limit ([`RequestBody`]) and sent to a backend ([`UpstreamBody`]); a backend's
//! response body from either client ([`BackendBody`]).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Either;
use hyper::body::Incoming;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::h1::drop_underscore_fields;
use crate::h1::server::IncomingBody as H1Body;
use crate::h1::{Connection, ResponseStream, StallTimer};

/// A backend's response body: read from a pooled plain-HTTP connection ([`crate::h1`], on the
/// left), or from the TLS client (on the right).
pub type BackendBody = Either<ResponseStream, Incoming>;

/// What a pooled connection's body says beyond its bytes.
pub trait Pooled {
    /// A plain-HTTP backend's field lines, when they were left as lines.
    fn passthrough(&self) -> Option<&crate::h1::client::Passthrough>;

    /// The pooled connection, once the body was read to its end and the connection is reusable.
    fn take_connection(&mut self) -> Option<Connection>;
}

impl Pooled for BackendBody {
    fn passthrough(&self) -> Option<&crate::h1::client::Passthrough> {
        match self {
            Either::Left(stream) => stream.passthrough(),
            Either::Right(_) => None,
        }
    }

    fn take_connection(&mut self) -> Option<Connection> {
        match self {
            Either::Left(stream) => stream.take_connection(),
            Either::Right(_) => None,
        }
    }
}

pub use crate::h1::{BodyFailure, BoxError};

/// A body held whole in memory, handed out as one frame (none when empty).
#[derive(Debug, Default)]
pub struct Whole(Option<Bytes>);

impl Whole {
    /// A body of `bytes`.
    pub fn new(bytes: Bytes) -> Self {
        Self(Some(bytes))
    }

    /// The bytes, until they were handed out.
    pub fn bytes(&self) -> Option<&Bytes> {
        self.0.as_ref()
    }
}

impl Body for Whole {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let bytes = self.get_mut().0.take();
        Poll::Ready(bytes.filter(|b| !b.is_empty()).map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.as_ref().is_none_or(Bytes::is_empty)
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.0.as_ref().map_or(0, |bytes| bytes.len() as u64))
    }
}

/// A client's request body: from the HTTP/1 server (on the left: read whole with the head, or
/// from the connection as polled), or from hyper (HTTP/2 connections, on the right).
pub type ClientBody = Either<H1Body, H2Body>;

/// An HTTP/2 client's request body, held to `limits.body_read_timeout` as the HTTP/1 server
/// holds its request streams: it fails with [`std::io::ErrorKind::TimedOut`] when the client
/// sends nothing for that long while it is read.
#[derive(Debug)]
pub struct H2Body {
    inner: Incoming,
    stall: StallTimer,
    /// Whether trailer fields whose names contain `_` are kept, as those of the head are.
    allow_underscore_headers: bool,
}

impl H2Body {
    /// `inner`, failing after `timeout` without a frame; its trailers lose the fields whose
    /// names contain `_` unless `allow_underscore_headers`.
    pub fn new(inner: Incoming, timeout: Duration, allow_underscore_headers: bool) -> Self {
        Self {
            inner,
            stall: StallTimer::new(timeout),
            allow_underscore_headers,
        }
    }
}

impl Body for H2Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            // hyper ends the body of a stream the client reset with NO_ERROR as if the client
            // had ended it: without END_STREAM, the body was cut short.
            Poll::Ready(None) if !this.inner.is_end_stream() => {
                let error = std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "the client reset the stream before the end of the body",
                );
                Poll::Ready(Some(Err(Box::new(error))))
            }
            Poll::Ready(mut frame) => {
                this.stall.progressed();
                if let Some(Ok(frame)) = frame.as_mut() {
                    match frame.trailers_mut() {
                        Some(trailers) if !this.allow_underscore_headers => {
                            drop_underscore_fields(trailers);
                        }
                        _ => {}
                    }
                }
                Poll::Ready(frame.map(|frame| frame.map_err(Into::into)))
            }
            Poll::Pending if this.stall.stalled(cx) => {
                let failure = BodyFailure::TimedOut;
                let error = std::io::Error::new(std::io::ErrorKind::TimedOut, failure.message());
                Poll::Ready(Some(Err(Box::new(error))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body sent to a backend: bytes kept in memory (replayable for a retry), or the
/// client's body streamed through after the part already read.
#[derive(Debug)]
pub enum UpstreamBody {
    /// The whole body, in memory.
    Full(Whole),
    /// What was read so far, then the rest as the client sends it.
    Streaming {
        /// Read before the request was sent.
        prefix: Option<Bytes>,
        /// The rest.
        rest: ClientBody,
    },
}

impl UpstreamBody {
    /// A body of `bytes`.
    pub fn full(bytes: Bytes) -> Self {
        UpstreamBody::Full(Whole::new(bytes))
    }

    /// The bytes of a body in memory, until they were sent.
    pub fn in_memory(&self) -> Option<&Bytes> {
        match self {
            UpstreamBody::Full(whole) => whole.bytes(),
            UpstreamBody::Streaming { .. } => None,
        }
    }
}

impl crate::h1::OutgoingBody for UpstreamBody {
    fn is_whole(&self) -> bool {
        matches!(self, UpstreamBody::Full(_))
    }

    fn in_memory(&self) -> Option<&Bytes> {
        UpstreamBody::in_memory(self)
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            UpstreamBody::Full(whole) => Pin::new(whole)
                .poll_frame(cx)
                .map_err(|never| match never {}),
            UpstreamBody::Streaming { prefix, rest } => match prefix.take() {
                Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                None => Pin::new(rest).poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Full(whole) => whole.is_end_stream(),
            UpstreamBody::Streaming { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Full(whole) => whole.size_hint(),
            UpstreamBody::Streaming { prefix, rest } => {
                let read = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + read);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + read);
                }
                hint
            }
        }
    }
}

/// What was read of a request body: nothing, one frame's bytes as they came, or a copy of
/// several frames.
enum Read {
    Nothing,
    One(Bytes),
    Many(BytesMut),
}

impl Read {
    fn len(&self) -> usize {
        match self {
            Read::Nothing => 0,
            Read::One(bytes) => bytes.len(),
            Read::Many(buffer) => buffer.len(),
        }
    }

    /// Adds `data`; a copy starts with room for `announced` bytes.
    fn push(self, data: Bytes, announced: usize) -> Self {
        match self {
            Read::Nothing => Read::One(data),
            Read::One(first) => {
                let mut buffer = BytesMut::with_capacity(announced.max(first.len() + data.len()));
                buffer.extend_from_slice(&first);
                buffer.extend_from_slice(&data);
                Read::Many(buffer)
            }
            Read::Many(mut buffer) => {
                buffer.extend_from_slice(&data);
                Read::Many(buffer)
            }
        }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Read::Nothing => Bytes::new(),
            Read::One(bytes) => bytes,
            Read::Many(buffer) => buffer.freeze(),
        }
    }
}

/// A client's request body, read up to the retry limit.
#[derive(Debug)]
pub enum RequestBody {
    /// The whole body is in memory: it can be sent again. The permit holds its share of the
    /// buffering budget until the request is done.
    Replayable(Bytes, Option<OwnedSemaphorePermit>),
    /// Larger than the limit: sent once, streamed.
    Streaming(Option<Bytes>, ClientBody),
    /// The stream was handed to an attempt; there is nothing left to send.
    Consumed,
}

impl RequestBody {
    /// Reads `body` whole if it is at most `limit` bytes and the buffering `budget` (permits are
    /// KiB) has room; otherwise keeps what was read and streams the rest. Of a body announced
    /// larger than `limit` only the first frame is read.
    pub async fn read(
        mut body: ClientBody,
        limit: usize,
        budget: &Arc<Semaphore>,
    ) -> Result<Self, BoxError> {
        if body.is_end_stream() {
            return Ok(RequestBody::Replayable(Bytes::new(), None));
        }
        let announced = body.size_hint().lower();
        if announced > limit as u64 {
            // Not read whole, but its first frame is read, so that what routes on the body's
            // first bytes (`affinity`'s body key) sees them.
            let first = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
            let first = match first {
                Some(frame) => frame?.into_data().ok(),
                None => None,
            };
            return Ok(RequestBody::Streaming(first, body));
        }
        let mut permit: Option<OwnedSemaphorePermit> = None;
        // A body that arrives in one frame (the usual small request) is kept as that frame's
        // bytes; a copy is made only when a second frame comes.
        let mut read = Read::Nothing;
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
        {
            let Ok(data) = frame?.into_data() else {
                continue;
            };
            let total = read.len() + data.len();
            let needed = total.div_ceil(1024) as u32;
            let held = permit.as_ref().map_or(0, |p| p.num_permits() as u32);
            let more = needed.saturating_sub(held);
            let granted = more == 0
                || match Arc::clone(budget).try_acquire_many_owned(more) {
                    Ok(extra) => {
                        match permit.as_mut() {
                            Some(held) => held.merge(extra),
                            None => permit = Some(extra),
                        }
                        true
                    }
                    Err(_) => false,
                };
            read = read.push(data, announced as usize);
            if !granted || total > limit {
                return Ok(RequestBody::Streaming(Some(read.into_bytes()), body));
            }
        }
        Ok(RequestBody::Replayable(read.into_bytes(), permit))
    }

    /// The bytes read so far (the whole body when replayable).
    pub fn prefix(&self) -> &[u8] {
        match self {
            RequestBody::Replayable(bytes, _) | RequestBody::Streaming(Some(bytes), _) => bytes,
            _ => &[],
        }
    }

    /// Whether the body can be sent again.
    pub fn is_replayable(&self) -> bool {
        matches!(self, RequestBody::Replayable(..))
    }

    /// The body for one attempt: a copy of the bytes, or the stream (once; `None` after).
    pub fn for_attempt(&mut self) -> Option<UpstreamBody> {
        if let RequestBody::Replayable(bytes, _) = self {
            return Some(UpstreamBody::full(bytes.clone()));
        }
        match std::mem::replace(self, RequestBody::Consumed) {
            RequestBody::Streaming(prefix, rest) => Some(UpstreamBody::Streaming { prefix, rest }),
            _ => None,
        }
    }
}
