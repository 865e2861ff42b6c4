//! A client's request body as the server hands it to the handler: read whole with the head, or
//! read from the connection as the handler polls it, giving the connection's reading side back
//! at its end.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::h1::{BodyFailure, Framing, StallTimer, drop_underscore_fields, poll_body};

use super::{Inbound, Limits, Slot};

/// A client's request body as the server hands it to the handler: read whole with the head, or
/// read from the connection as it is polled.
#[derive(Debug)]
pub enum IncomingBody {
    /// The whole body (`None` once handed out, or when there is none).
    Whole(Option<Bytes>),
    /// Read from the connection as it is polled.
    Streaming(RequestStream),
    /// A body read with the head that the client left unsent for `body_read_timeout`: its
    /// first poll fails with [`io::ErrorKind::TimedOut`], so that the handler answers (and logs)
    /// it as it answers a streamed body that stalls.
    TimedOut,
}

impl Body for IncomingBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        match this {
            IncomingBody::Whole(bytes) => Poll::Ready(
                bytes
                    .take()
                    .filter(|bytes| !bytes.is_empty())
                    .map(|bytes| Ok(Frame::data(bytes))),
            ),
            IncomingBody::Streaming(stream) => Pin::new(stream).poll_frame(cx),
            IncomingBody::TimedOut => {
                // Failed once; nothing after.
                *this = IncomingBody::Whole(None);
                Poll::Ready(Some(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "request body timed out",
                ))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            IncomingBody::Whole(bytes) => bytes.as_ref().is_none_or(Bytes::is_empty),
            IncomingBody::Streaming(stream) => stream.is_end_stream(),
            IncomingBody::TimedOut => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            IncomingBody::Whole(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |bytes| bytes.len() as u64))
            }
            IncomingBody::Streaming(stream) => stream.size_hint(),
            IncomingBody::TimedOut => SizeHint::default(),
        }
    }
}

/// Reads a body of `length` bytes that follows the head, each read within `timeout`.
pub(super) async fn read_whole(
    input: &mut Inbound,
    length: usize,
    timeout: Duration,
) -> Result<Bytes, BodyFailure> {
    while input.buffer.len() < length {
        if input.buffer.capacity() < length {
            input.buffer.reserve(length - input.buffer.len());
        }
        match tokio::time::timeout(timeout, input.fill()).await {
            Err(_) => return Err(BodyFailure::TimedOut),
            Ok(Ok(0) | Err(_)) => return Err(BodyFailure::Broken),
            Ok(Ok(_)) => {}
        }
    }
    Ok(input.buffer.split_to(length).freeze())
}

/// A request body read from the client's connection as it is polled. At its end it leaves the
/// connection's reading side for the next request; dropped before its end, the connection
/// closes after the response. It fails with [`io::ErrorKind::TimedOut`] when the client sends
/// nothing for `timeout` (the timer is made on the first wait and moved only when it fires).
#[derive(Debug)]
pub struct RequestStream {
    inbound: Option<Inbound>,
    framing: Framing,
    slot: Arc<Slot>,
    stall: StallTimer,
    /// Whether trailer fields whose names contain `_` are kept, as those of the head are.
    allow_underscore_headers: bool,
}

impl RequestStream {
    /// The body delimited by `framing` that follows a head on `input`, held to `limits`; it
    /// leaves the reading side in `slot` at its end.
    pub(super) fn new(input: Inbound, framing: Framing, slot: Arc<Slot>, limits: Limits) -> Self {
        Self {
            inbound: Some(input),
            framing,
            slot,
            stall: StallTimer::new(limits.body_read_timeout),
            allow_underscore_headers: limits.allow_underscore_headers,
        }
    }

    /// Leaves the reading side for the next request (the body was read to its end).
    fn finish(&mut self) {
        if let Some(input) = self.inbound.take() {
            self.slot.put(input);
        }
    }

    fn fail(&mut self, error: io::Error) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.framing = Framing::Failed;
        self.inbound = None;
        Poll::Ready(Some(Err(error)))
    }
}

impl Body for RequestStream {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        let Some(input) = this.inbound.as_mut() else {
            return Poll::Ready(None);
        };
        let Inbound {
            half,
            buffer,
            read_size,
        } = input;
        let polled = poll_body(&mut this.framing, half, buffer, read_size, cx);
        let Poll::Ready(polled) = polled else {
            if this.stall.stalled(cx) {
                let error = io::Error::new(io::ErrorKind::TimedOut, "request body timed out");
                return this.fail(error);
            }
            return Poll::Pending;
        };
        match polled {
            Ok(mut frame) => {
                this.stall.progressed();
                if this.framing.is_end() {
                    this.finish();
                }
                if !this.allow_underscore_headers {
                    if let Some(trailers) = frame.as_mut().and_then(Frame::trailers_mut) {
                        drop_underscore_fields(trailers);
                    }
                }
                Poll::Ready(frame.map(Ok))
            }
            Err(error) => this.fail(error),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing.is_end()
    }

    fn size_hint(&self) -> SizeHint {
        self.framing.size_hint()
    }
}
