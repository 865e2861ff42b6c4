//! The HTTP/1.1 server side of the router, built for proxying.
//!
//! [`serve`] runs one client connection in the task that accepted it: it reads a request head
//! (within the header timeout, at most `max_header_bytes`), hands the request to the handler and
//! writes the handler's response, then does the same for the next request while the connection
//! is kept alive. Nothing else runs per connection or per request: no dispatcher, no channel.
//!
//! - **Request fields** are kept as the lines the client sent ([`super::FieldLines`], hop-by-hop
//!   fields and those the caller sets itself left out: the [`Captured`] fields `serve` is given,
//!   their values set aside) and the request's map left empty, unless the lines cannot carry the
//!   caller's rules (see [`super::fields`]): then every field goes into the map.
//! - **Request bodies.** A body of known length up to [`READ_WHOLE`] bytes is read with its head
//!   and handed over whole; a larger or chunked one is a [`RequestStream`] that reads from the
//!   connection as the handler polls it, and gives the connection back at its end. A request
//!   with both `Transfer-Encoding` and `Content-Length`, or a transfer coding other than chunked,
//!   is refused with 400 and the connection closed (RFC 9112 §6.1, §6.3): a front proxy that read
//!   the other length would disagree about where the request ends.
//! - **Responses** keep their `Content-Length`, or get one when the body's length is known;
//!   otherwise they are sent chunked (to an HTTP/1.0 client: delimited by closing). The head and
//!   a body that is ready at once go out in one write; a streamed body is written frame by frame
//!   as it arrives, so an SSE event is not held back. `HEAD`, 1xx, 204 and 304 responses have no
//!   body. A `Date` is added when the response has none.
//! - **A client that leaves** while its request waits (queued, or for the backend's answer) is
//!   noticed by the end of its connection, and the handler's future is dropped, which withdraws
//!   the request.
//! - **Keep-alive** ends when the client asks (`Connection: close`, or HTTP/1.0 without
//!   `keep-alive`), the response says `Connection: close`, the request body was not read to its
//!   end, the router drains, or a malformed request arrives (answered 400, or 431 for a head over
//!   the limit, then closed). A connection waiting for its next request closes at once when the
//!   router starts draining, and after the header timeout (give or take a tenth of it: one timer
//!   per connection, set again only when it was set more than a tenth of the timeout ago).
//!
//! This file holds the connection: its loop, its timers and the watch for a client that leaves.
//! Reading a request head is `head.rs`'s, a request body `body.rs`'s, writing an answer
//! `response.rs`'s.

mod body;
mod head;
mod response;

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::Body;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

use crate::h1::client::Passthrough;
use crate::h1::fields::{Captured, FieldLines};
use crate::h1::{BodyFailure, Chunked, Framing, ReadSize};

use body::read_whole;
pub use body::{IncomingBody, RequestStream};
use head::{BodyLength, Head, Refusal, parse_head};
pub use head::{host_refusal, target_form_refusal, valid_host};
use response::{Outgoing, Written, encode_response_head, refusal, write_body};

/// Request bodies of known length up to this many bytes are read with their head.
pub const READ_WHOLE: u64 = 64 * 1024;

/// What a client connection is held to: the `[limits]` section of the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// How long a client may take to send a request head (and how long an idle connection
    /// waits for the next one).
    #[serde(with = "crate::forms::seconds")]
    pub header_read_timeout: Duration,
    /// How long a client may leave its request body without sending a byte (then 408).
    #[serde(with = "crate::forms::seconds")]
    pub body_read_timeout: Duration,
    /// How long a write to the client may wait for the client to take any of it (nginx's
    /// `send_timeout`); exceeded, the connection is closed and the answer dropped.
    #[serde(with = "crate::forms::seconds")]
    pub send_timeout: Duration,
    /// Largest request head accepted (for HTTP/2, the largest header list).
    pub max_header_bytes: usize,
    /// Whether header fields whose names contain `_` are kept (by default they are dropped, as
    /// nginx does: CGI-style backends read `X_A` and `X-A` as the same name).
    pub allow_underscore_headers: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            max_header_bytes: 64 * 1024,
            allow_underscore_headers: false,
        }
    }
}

impl Limits {
    /// Checks what the types leave open: a request head limit from 8 KiB to 1 MiB. The error
    /// names the key within `[limits]`.
    pub fn check(&self) -> Result<(), crate::forms::Invalid> {
        if !(8 * 1024..=1024 * 1024).contains(&self.max_header_bytes) {
            return Err(crate::forms::Invalid::new(
                "max_header_bytes",
                format!(
                    "expected 8192 to 1048576 bytes, found {}",
                    self.max_header_bytes
                ),
            ));
        }
        Ok(())
    }
}

/// The reading side of a client connection and what was read from it.
struct Inbound {
    half: ReadSide,
    buffer: BytesMut,
    read_size: ReadSize,
}

impl std::fmt::Debug for Inbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbound")
            .field("buffered", &self.buffer.len())
            .finish_non_exhaustive()
    }
}

impl Inbound {
    /// Reads more; `Ok(0)` at the end of the connection.
    async fn fill(&mut self) -> io::Result<usize> {
        self.read_size.fill(&mut self.half, &mut self.buffer).await
    }
}

/// Where a streamed request body leaves the connection's reading side once it was read to its
/// end, and who waits for it (the connection, to watch the client while the answer is awaited).
#[derive(Debug, Default)]
struct Slot {
    state: Mutex<(Option<Inbound>, Option<Waker>)>,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, (Option<Inbound>, Option<Waker>)> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Leaves the reading side here and wakes whoever waits for it.
    fn put(&self, input: Inbound) {
        let waker = {
            let mut state = self.lock();
            state.0 = Some(input);
            state.1.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    fn take(&self) -> Option<Inbound> {
        self.lock().0.take()
    }

    /// Waits until the reading side is left here.
    async fn returned(&self) -> Inbound {
        std::future::poll_fn(|cx| {
            let mut state = self.lock();
            match state.0.take() {
                Some(input) => Poll::Ready(input),
                None => {
                    state.1 = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
        .await
    }
}

/// What answers the requests of a connection.
///
/// The answer's future may borrow the handler, which lives as long as the connection: it is
/// built right in the connection's state, with no future of its own around it.
pub trait Handler {
    /// The answers' body.
    type Body: Answer;

    /// The answer to `request`; its map is empty when its `fields` are kept as lines.
    fn call(
        &self,
        request: Request<IncomingBody>,
        fields: Option<FieldLines>,
    ) -> impl Future<Output = Response<Self::Body>>;

    /// The answer to a request that expects `100 Continue`, when the handler refuses it
    /// whatever its body holds (`declared`: its `Content-Length`): it goes out instead of the
    /// `100`, the body is never read and the connection closes after it (nginx checks
    /// `client_max_body_size` before its `100` too). `None`: the `100` goes out and the body is
    /// read.
    fn refuse_unread(
        &self,
        _request: &Request<()>,
        _fields: Option<&FieldLines>,
        _declared: Option<u64>,
    ) -> Option<Response<Self::Body>> {
        None
    }

    /// A request the server refused itself, before any handler saw it (a malformed or
    /// oversized head), answered `status` and closed: for the access log.
    fn refused(&self, _status: StatusCode) {}
}

/// A response body, and the field lines it carries when it relays a plain-HTTP backend's answer
/// ([`Passthrough`]): they are written after the response map's fields, as the backend sent
/// them.
pub trait Answer: Body<Data = Bytes> + Unpin {
    /// The backend's field lines, if any.
    fn passthrough(&self) -> Option<&Passthrough> {
        None
    }
}

impl Answer for http_body_util::Full<Bytes> {}

/// The reading side of a client connection, whatever carries it (a TCP stream's read half, an
/// in-memory pipe in tests).
pub type ReadSide = Box<dyn AsyncRead + Send + Unpin>;

/// A client connection's writing side, which may also tell whether the client closed its side
/// without anything being read: while a streamed request body holds the reading side unread
/// (the request waits in the router queue), that is how its leaving is seen.
pub trait ClientWrite: AsyncWrite + Unpin {
    /// Whether the client closed its side of the connection (or reset it); `false` when that
    /// cannot be told without reading.
    fn hung_up(&self) -> bool {
        false
    }
}

/// A TCP connection: the socket's readiness carries the peer's close (`EPOLLRDHUP`) even
/// while unread bytes come before it, as nginx reads it (`ngx_http_test_reading`).
impl ClientWrite for tokio::net::tcp::OwnedWriteHalf {
    fn hung_up(&self) -> bool {
        use futures_util::FutureExt;
        matches!(
            self.ready(tokio::io::Interest::READABLE).now_or_never(),
            Some(Ok(ready)) if ready.is_read_closed()
        )
    }
}

impl<T: AsyncRead + AsyncWrite> ClientWrite for tokio::io::WriteHalf<T> {}

/// Serves one client connection, read from `reader` and written to `writer`, with `handler`
/// until it ends (see the module documentation). The fields the handler sets itself on what it
/// forwards are `captured`: they are left out of each head's lines, their values set aside.
///
/// Each request is two steps, each its own future inside this one: `receive` (the head, the
/// body when it is read whole, the handler's answer and its head) and `write_body`. Their states
/// share one place in the connection's task, so a connection whose answer streams holds the
/// response writer's state and the connection's own (buffers, timers), not the request's.
pub async fn serve<H: Handler, W: ClientWrite>(
    reader: ReadSide,
    writer: W,
    limits: Limits,
    captured: Captured,
    draining: watch::Receiver<bool>,
    handler: H,
) {
    let mut writer = Sending::new(writer, limits.send_timeout);
    let mut connection = ConnectionState {
        slot: None,
        // Taken when a response is written and given back when it waits.
        out: Vec::new(),
        header_timer: HeaderTimer::new(limits.header_read_timeout),
        draining: DrainWatch::new(draining),
        limits,
        captured,
    };
    let mut inbound = Some(Inbound {
        half: reader,
        buffer: ReadSize::buffer(),
        read_size: ReadSize::new(),
    });
    while let Some(input) = inbound.take() {
        let Some(Answered {
            body,
            framing,
            close,
            mut held,
        }) = receive(input, &mut writer, &mut connection, &handler).await
        else {
            return;
        };
        let out = &mut connection.out;
        let kept = write_body(&mut writer, out, body, framing, close, held.as_mut()).await;
        if !matches!(kept, Ok(true)) {
            return;
        }
        if held.is_none() {
            held = connection.slot.as_ref().and_then(|slot| slot.take());
        }
        inbound = held;
    }
}

/// The writing side of a client connection: a write the client takes nothing of for
/// `send_timeout` fails (nginx's `send_timeout`), so that a client that stops reading does not
/// hold its answer, and the backend behind it, forever. The clock runs only while a write
/// waits; the timer is made on the first write that waits and set again on the next.
struct Sending<W> {
    inner: W,
    stall: super::stall::WriteStall,
}

impl<W> Sending<W> {
    fn new(inner: W, timeout: Duration) -> Self {
        Self {
            inner,
            stall: super::stall::WriteStall::new(
                timeout,
                "the client took nothing for send_timeout",
            ),
        }
    }

    /// `written` as it is, unless it waited for the timeout: then an error.
    fn bounded<T>(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        self.stall.bounded(cx, written)
    }
}

impl<W: ClientWrite> ClientWrite for Sending<W> {
    fn hung_up(&self) -> bool {
        self.inner.hung_up()
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Sending<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.bounded(cx, written)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.bounded(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let flushed = Pin::new(&mut this.inner).poll_flush(cx);
        this.bounded(cx, flushed)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let shut = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.bounded(cx, shut)
    }
}

/// A request's answer, its head already in the connection's write buffer.
struct Answered<B> {
    body: B,
    framing: Outgoing,
    /// The connection ends after this response.
    close: bool,
    /// The reading side, when it is back.
    held: Option<Inbound>,
}

impl<B: Answer> Answered<B> {
    /// `answer`, its head encoded into `out` as `written` says.
    fn encoded(
        out: &mut Vec<u8>,
        answer: Response<B>,
        written: Written,
        held: Option<Inbound>,
    ) -> Self {
        let (parts, body) = answer.into_parts();
        let (framing, close) = encode_response_head(out, &parts, &body, written);
        Self {
            body,
            framing,
            close,
            held,
        }
    }
}

/// What a client connection keeps from one request to the next.
struct ConnectionState {
    /// Where a streamed request body leaves the reading side.
    slot: Option<Arc<Slot>>,
    out: Vec<u8>,
    header_timer: HeaderTimer,
    draining: DrainWatch,
    limits: Limits,
    /// The fields the handler sets itself.
    captured: Captured,
}

/// Reads the next request from `input`, awaits the handler's answer to it and encodes the
/// answer's head into the write buffer: the answer's body, how it is to be written, and the
/// reading side when it is back (a streamed request body keeps it until its end). `None` when
/// the connection ends without an answer (refusals are written here). Only the body leaves
/// this future: the response's head is not moved again.
async fn receive<H: Handler, W: ClientWrite>(
    mut input: Inbound,
    writer: &mut W,
    connection: &mut ConnectionState,
    handler: &H,
) -> Option<Answered<H::Body>> {
    let ConnectionState {
        slot,
        out,
        header_timer,
        draining,
        limits,
        captured,
    } = connection;
    let limits = *limits;
    let head = match read_head(&mut input, limits, *captured, header_timer, draining).await {
        Ok(head) => head,
        Err(Refusal::Quiet) => return None,
        Err(Refusal::Answer(status, message)) => {
            handler.refused(status);
            refusal(out, status, message);
            let _ = writer.write_all(out).await;
            return None;
        }
    };
    let Head {
        request,
        fields,
        body,
        mut keep_alive,
        expects_continue,
    } = head;
    let head_request = request.method() == Method::HEAD;
    let http10 = request.version() == Version::HTTP_10;
    if expects_continue && body != BodyLength::Length(0) {
        let declared = match body {
            BodyLength::Length(length) => Some(length),
            BodyLength::Chunked => None,
        };
        if let Some(answer) = handler.refuse_unread(&request, fields.as_ref(), declared) {
            let written = Written {
                head_request,
                http10,
                close: true,
            };
            return Some(Answered::encoded(out, answer, written, None));
        }
        if writer
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .is_err()
        {
            return None;
        }
    }
    // The reading side stays here when the body was read with the head; a streamed body takes
    // it and leaves it in the slot at its end.
    let (body, mut held) = match body {
        BodyLength::Length(0) => (IncomingBody::Whole(None), Some(input)),
        BodyLength::Length(length) if length <= READ_WHOLE => {
            match read_whole(&mut input, length as usize, limits.body_read_timeout).await {
                Ok(bytes) => (IncomingBody::Whole(Some(bytes)), Some(input)),
                // The handler answers 408 (and logs it); the connection closes after it.
                Err(BodyFailure::TimedOut) => (IncomingBody::TimedOut, None),
                Err(BodyFailure::Broken) => return None,
            }
        }
        length => {
            let slot = Arc::clone(slot.get_or_insert_with(Arc::default));
            let framing = match length {
                BodyLength::Length(length) => Framing::Length(length),
                BodyLength::Chunked => Framing::Chunked(Chunked::Size),
            };
            let stream = RequestStream::new(input, framing, slot, limits);
            (IncomingBody::Streaming(stream), None)
        }
    };
    // The handler's future is boxed: it is done once the answer's head is here, and a
    // stream then holds only the response writer's state in the connection's task, not
    // the larger state of the handler (one allocation a request, freed at the answer).
    let answer = {
        let mut answer = Box::pin(handler.call(request.map(|()| body), fields));
        answer_unless_gone(answer.as_mut(), &mut held, slot.as_deref(), &*writer).await
    };
    // None: the client left, and dropping the handler's future withdrew the request.
    let answer = answer?;
    if held.is_none() {
        held = slot.as_ref().and_then(|slot| slot.take());
    }
    // An answer given before the request's body was read to its end closes the connection (the
    // rest of the body is never read): it says so (RFC 9112 §9.6), so that the client does not
    // send its next request on it.
    if draining.started() || held.is_none() {
        keep_alive = false;
    }
    let written = Written {
        head_request,
        http10,
        close: !keep_alive,
    };
    Some(Answered::encoded(out, answer, written, held))
}

/// Awaits `answer` while watching the client's connection: `None` if the client closed it
/// first. The reading side is `input`, or, while a streamed request body holds it, is watched
/// from when the body leaves it in `slot`. Bytes the client sends meanwhile (a pipelined
/// request, a stray line end after a body) are kept for later, and the watch goes on up to
/// [`MAX_SENT_AHEAD`] of them ([`still_watched`]). While the body holds the reading side
/// unread (the request waits in the router queue, or for its backend), the client's leaving is
/// told by `writer` ([`ClientWrite::hung_up`]), checked every [`HANG_UP_CHECK`].
async fn answer_unless_gone<F, B, W: ClientWrite>(
    mut answer: Pin<&mut F>,
    input: &mut Option<Inbound>,
    slot: Option<&Slot>,
    writer: &W,
) -> Option<Response<B>>
where
    F: Future<Output = Response<B>>,
{
    let mut watching = true;
    loop {
        let watch = async {
            if input.is_none() {
                match slot {
                    Some(slot) => tokio::select! {
                        returned = slot.returned() => *input = Some(returned),
                        () = hang_up(writer) => return true,
                    },
                    None => std::future::pending::<()>().await,
                }
            }
            match input.as_mut() {
                Some(input) => client_gone(input).await,
                None => false,
            }
        };
        tokio::select! {
            biased;
            answer = answer.as_mut() => return Some(answer),
            gone = watch, if watching => {
                if gone {
                    return None;
                }
                watching = still_watched(input.as_ref());
            }
        }
    }
}

/// How often a client whose streamed body waits unread is checked for having left.
const HANG_UP_CHECK: Duration = Duration::from_secs(1);

/// Returns once `writer` tells that the client closed its side, checked every
/// [`HANG_UP_CHECK`].
async fn hang_up<W: ClientWrite>(writer: &W) {
    loop {
        tokio::time::sleep(HANG_UP_CHECK).await;
        if writer.hung_up() {
            return;
        }
    }
}

/// Bytes a client may send ahead of its answer (pipelined requests) while the router still
/// watches its connection for its leaving: as much as a head may take. A client that sends
/// more is watched no longer (its leaving is seen at the next write), and what it sent waits
/// in the buffer for its turn.
const MAX_SENT_AHEAD: usize = 64 * 1024;

/// Whether a client that sent bytes ahead of its answer is still watched: with nginx, a
/// client that pipelines a request (or ends a body with a stray line end, RFC 9112 §2.2) and
/// then leaves still frees its backend at once.
fn still_watched(input: Option<&Inbound>) -> bool {
    input.is_some_and(|input| input.buffer.len() < MAX_SENT_AHEAD)
}

/// Waits until the client sends something (`false`: it is kept in the buffer) or closes the
/// connection (`true`). A read that waits registers on the connection's own read waker.
async fn client_gone(input: &mut Inbound) -> bool {
    input.read_size.shrink(&mut input.buffer);
    !matches!(input.fill().await, Ok(read) if read > 0)
}

/// The header timeout of one connection: one timer for the connection's life, set again only
/// when it was set more than a tenth of the timeout ago, so that waiting for the next request
/// does not register a timer each time. A client thus gets between nine tenths of the timeout
/// and the whole of it to send a head.
struct HeaderTimer {
    sleep: Pin<Box<tokio::time::Sleep>>,
    set_at: tokio::time::Instant,
    timeout: Duration,
}

impl HeaderTimer {
    fn new(timeout: Duration) -> Self {
        let now = tokio::time::Instant::now();
        Self {
            sleep: Box::pin(tokio::time::sleep_until(now + timeout)),
            set_at: now,
            timeout,
        }
    }

    /// Starts a wait for a head.
    fn start(&mut self) {
        let now = tokio::time::Instant::now();
        if now.saturating_duration_since(self.set_at) > self.timeout / 10 {
            self.sleep.as_mut().reset(now + self.timeout);
            self.set_at = now;
        }
    }
}

/// Whether the router started draining, watched by one wait that lasts as long as the
/// connection: waiting for each request's head does not register (and withdraw) a wait of its
/// own.
struct DrainWatch {
    receiver: watch::Receiver<bool>,
    changed: Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl DrainWatch {
    fn new(receiver: watch::Receiver<bool>) -> Self {
        let mut watching = receiver.clone();
        Self {
            receiver,
            changed: Box::pin(async move {
                let _ = watching.changed().await;
            }),
        }
    }

    fn started(&self) -> bool {
        *self.receiver.borrow()
    }

    /// Ready once draining starts (or the router is gone); not to be polled after that.
    fn changed(&mut self) -> Pin<&mut (dyn Future<Output = ()> + Send)> {
        self.changed.as_mut()
    }
}

/// Reads the next request head: what is already buffered first, then from the connection.
async fn read_head(
    input: &mut Inbound,
    limits: Limits,
    captured: Captured,
    timer: &mut HeaderTimer,
    draining: &mut DrainWatch,
) -> Result<Head, Refusal> {
    let mut started = false;
    loop {
        if !input.buffer.is_empty() {
            if let Some(head) = parse_head(&mut input.buffer, limits, captured)? {
                return Ok(head);
            }
        }
        let idle = input.buffer.iter().all(|&b| b == b'\r' || b == b'\n');
        if idle && draining.started() {
            return Err(Refusal::Quiet);
        }
        if !started {
            timer.start();
            started = true;
            // Between requests the connection keeps a small buffer, whatever the last one
            // grew it to.
            input.read_size = ReadSize::new();
            input.read_size.shrink(&mut input.buffer);
        }
        tokio::select! {
            biased;
            read = input.fill() => match read {
                Ok(0) | Err(_) => return Err(Refusal::Quiet),
                Ok(_) => {}
            },
            () = timer.sleep.as_mut() => return Err(Refusal::Quiet),
            () = draining.changed(), if idle => return Err(Refusal::Quiet),
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body::Frame;
    use tokio::io::AsyncReadExt;

    use super::*;
    use crate::h1::fields::{CapturedField, Repeated};
    use crate::h1::{COALESCE, buffers};

    /// Two fields the handler sets itself, named as no client field this layer knows: the first
    /// a list (sent twice, every field goes into the map), the second replaced (its first value
    /// set aside).
    pub(super) const TEST_CAPTURED: Captured = Captured::new(&[
        CapturedField {
            name: "x-chain",
            repeated: Repeated::Mapped,
        },
        CapturedField {
            name: "x-scheme",
            repeated: Repeated::FirstKept,
        },
    ]);

    pub(super) fn test_limits() -> Limits {
        Limits {
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 8192,
            body_read_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            allow_underscore_headers: false,
        }
    }

    struct Answer;

    impl Handler for Answer {
        type Body = http_body_util::Full<Bytes>;

        fn call(
            &self,
            _request: Request<IncomingBody>,
            _fields: Option<FieldLines>,
        ) -> impl Future<Output = Response<Self::Body>> {
            std::future::ready(Response::new(http_body_util::Full::new(Bytes::from(
                "answered",
            ))))
        }
    }

    #[tokio::test]
    async fn an_idle_connection_closes_when_draining_starts() {
        let (drain, draining) = watch::channel(false);
        let limits = Limits {
            header_read_timeout: Duration::from_secs(600),
            ..test_limits()
        };
        let (mut client, served) = scripted(limits, draining, Answer);
        let script = async {
            client
                .write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
                .await
                .unwrap();
            let mut answer = vec![0; 4096];
            let read = client.read(&mut answer).await.unwrap();
            assert!(answer[..read].starts_with(b"HTTP/1.1 200"));
            // The connection now waits for the next request, kept alive.
            drain.send(true).unwrap();
            let closed = tokio::time::timeout(Duration::from_secs(10), client.read(&mut answer));
            assert_eq!(closed.await.expect("still open").unwrap(), 0);
        };
        tokio::join!(served, script);
    }

    /// Serves `handler` on one end of an in-memory pipe (the future to drive beside the
    /// client's script); the other end is the client.
    fn scripted<H: Handler + 'static>(
        limits: Limits,
        draining: watch::Receiver<bool>,
        handler: H,
    ) -> (tokio::io::DuplexStream, Pin<Box<dyn Future<Output = ()>>>) {
        scripted_capturing(limits, TEST_CAPTURED, draining, handler)
    }

    /// [`scripted`], the handler setting the `captured` fields itself.
    fn scripted_capturing<H: Handler + 'static>(
        limits: Limits,
        captured: Captured,
        draining: watch::Receiver<bool>,
        handler: H,
    ) -> (tokio::io::DuplexStream, Pin<Box<dyn Future<Output = ()>>>) {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let (reader, writer) = tokio::io::split(server);
        let served = Box::pin(serve(
            Box::new(reader),
            writer,
            limits,
            captured,
            draining,
            handler,
        ));
        (client, served)
    }

    /// Answers every request with what it got of the fields: the lines, then each field it
    /// reads through [`crate::h1::Fields`] (`name=value`, one a line), or `map` and the map's.
    struct FieldsEcho(&'static [&'static str]);

    impl Handler for FieldsEcho {
        type Body = http_body_util::Full<Bytes>;

        async fn call(
            &self,
            request: Request<IncomingBody>,
            fields: Option<FieldLines>,
        ) -> Response<Self::Body> {
            let mut text = Vec::new();
            let view = match &fields {
                Some(fields) => {
                    text.extend_from_slice(fields.lines());
                    crate::h1::Fields::Lines(fields)
                }
                None => {
                    text.extend_from_slice(b"map\r\n");
                    crate::h1::Fields::Map(request.headers())
                }
            };
            for name in self.0 {
                text.extend_from_slice(name.as_bytes());
                text.push(b'=');
                text.extend_from_slice(view.get(name).unwrap_or(b"-"));
                text.extend_from_slice(b"\r\n");
            }
            Response::new(http_body_util::Full::new(Bytes::from(text)))
        }
    }

    #[tokio::test]
    async fn the_fields_set_aside_are_those_the_caller_names_on_scripted_bytes() {
        let request = "GET / HTTP/1.1\r\nHost: a\r\nX-Chain: 10.0.0.1\r\nX-Scheme: https\r\n\
                       X-Id: 7\r\nX-Trace: t1\r\nx-scheme: ftp\r\nConnection: close\r\n\r\n";
        let names = &["x-chain", "x-scheme", "x-trace"];
        let answer_with = |captured: Captured| async move {
            let (_drain, draining) = watch::channel(false);
            let (mut client, served) =
                scripted_capturing(test_limits(), captured, draining, FieldsEcho(names));
            let script = async {
                client.write_all(request.as_bytes()).await.unwrap();
                read_all(&mut client).await
            };
            let ((), answer) = tokio::join!(served, script);
            answer
                .split("\r\n\r\n")
                .nth(1)
                .unwrap_or_default()
                .to_owned()
        };
        // Two fields set aside, read through the view as the client sent them (the first of a
        // replaced one), never written in the lines.
        assert_eq!(
            answer_with(TEST_CAPTURED).await,
            "Host: a\r\nX-Id: 7\r\nX-Trace: t1\r\n\
             x-chain=10.0.0.1\r\nx-scheme=https\r\nx-trace=t1\r\n"
        );
        // Another caller sets aside another field, and none of those.
        const TRACE: Captured = Captured::new(&[CapturedField {
            name: "x-trace",
            repeated: Repeated::FirstKept,
        }]);
        assert_eq!(
            answer_with(TRACE).await,
            "Host: a\r\nX-Chain: 10.0.0.1\r\nX-Scheme: https\r\nX-Id: 7\r\nx-scheme: ftp\r\n\
             x-chain=10.0.0.1\r\nx-scheme=https\r\nx-trace=t1\r\n"
        );
        // A caller that sets none keeps every end-to-end field in the lines.
        assert_eq!(
            answer_with(Captured::NONE).await,
            "Host: a\r\nX-Chain: 10.0.0.1\r\nX-Scheme: https\r\nX-Id: 7\r\nX-Trace: t1\r\n\
             x-scheme: ftp\r\nx-chain=10.0.0.1\r\nx-scheme=https\r\nx-trace=t1\r\n"
        );
        // The caller's list sent twice: the map, every value in it.
        const LIST: Captured = Captured::new(&[CapturedField {
            name: "x-scheme",
            repeated: Repeated::Mapped,
        }]);
        assert_eq!(
            answer_with(LIST).await,
            "map\r\nx-chain=10.0.0.1\r\nx-scheme=https\r\nx-trace=t1\r\n"
        );
    }

    /// Everything the server writes until it closes the pipe.
    async fn read_all(client: &mut tokio::io::DuplexStream) -> String {
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.unwrap();
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// Answers every request with its path and body.
    struct Echo;

    impl Handler for Echo {
        type Body = http_body_util::Full<Bytes>;

        async fn call(
            &self,
            request: Request<IncomingBody>,
            _fields: Option<FieldLines>,
        ) -> Response<Self::Body> {
            let path = request.uri().path().to_owned();
            let mut body = request.into_body();
            let mut text = path.into_bytes();
            while let Some(frame) =
                std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
            {
                match frame.map(Frame::into_data) {
                    Ok(Ok(data)) => text.extend_from_slice(&data),
                    Ok(Err(_)) => {}
                    Err(_) => text.extend_from_slice(b"!body failed"),
                }
            }
            Response::new(http_body_util::Full::new(Bytes::from(text)))
        }
    }

    #[tokio::test]
    async fn pipelined_requests_are_answered_in_order_on_scripted_bytes() {
        let (_drain, draining) = watch::channel(false);
        let (mut client, served) = scripted(test_limits(), draining, Echo);
        let script = async {
            client
            .write_all(
                b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhiGET /b HTTP/1.1\r\nHost: x\r\n\r\n\
                  POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
                  3\r\nabc\r\n0\r\n\r\n",
            )
            .await
            .unwrap();
            read_all(&mut client).await
        };
        let ((), answer) = tokio::join!(served, script);
        let bodies: Vec<&str> = answer
            .split("HTTP/1.1 200 OK\r\n")
            .skip(1)
            .map(|response| response.split("\r\n\r\n").nth(1).unwrap_or(""))
            .collect();
        assert_eq!(bodies.len(), 3, "{answer}");
        assert_eq!(bodies[0], "/ahi");
        assert_eq!(bodies[1], "/b");
        assert!(bodies[2].starts_with("/cabc"), "{answer}");
        assert!(answer.contains("connection: close"), "{answer}");
    }

    /// Answers with the frames it was made with, of no known length (chunked).
    #[derive(Clone)]
    struct Frames(Vec<Bytes>);

    struct FramesBody(std::collections::VecDeque<Bytes>);

    impl Body for FramesBody {
        type Data = Bytes;
        type Error = io::Error;

        fn poll_frame(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
            Poll::Ready(
                self.get_mut()
                    .0
                    .pop_front()
                    .map(|data| Ok(Frame::data(data))),
            )
        }

        fn is_end_stream(&self) -> bool {
            self.0.is_empty()
        }
    }

    impl super::Answer for FramesBody {}

    impl Handler for Frames {
        type Body = FramesBody;

        async fn call(
            &self,
            _request: Request<IncomingBody>,
            _fields: Option<FieldLines>,
        ) -> Response<Self::Body> {
            Response::new(FramesBody(self.0.iter().cloned().collect()))
        }
    }

    /// Answers with a `Content-Length` of `.0` and the frames `.1`, whatever their length.
    struct Declared(u64, Vec<Bytes>);

    impl Handler for Declared {
        type Body = FramesBody;

        async fn call(
            &self,
            _request: Request<IncomingBody>,
            _fields: Option<FieldLines>,
        ) -> Response<Self::Body> {
            let mut response = Response::new(FramesBody(self.1.iter().cloned().collect()));
            response
                .headers_mut()
                .insert(http::header::CONTENT_LENGTH, self.0.into());
            response
        }
    }

    #[tokio::test]
    async fn a_body_longer_than_its_length_is_cut_at_the_length_and_the_connection_closed() {
        let poison = Bytes::from_static(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nPOISON");
        for frames in [
            vec![Bytes::from_static(b"hello"), poison.clone()],
            vec![[&b"hello"[..], &poison].concat().into()],
            vec![[&b"hello"[..], &vec![b'x'; 4 * COALESCE]].concat().into()],
        ] {
            let (_drain, draining) = watch::channel(false);
            let (mut client, served) = scripted(test_limits(), draining, Declared(5, frames));
            let script = async {
                // A second request pipelined: it must get its own answer or none.
                client
                    .write_all(
                        b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n",
                    )
                    .await
                    .unwrap();
                read_all(&mut client).await
            };
            let ((), answer) = tokio::join!(served, script);
            assert!(answer.ends_with("\r\n\r\nhello"), "{answer}");
            assert_eq!(answer.matches("HTTP/1.1").count(), 1, "{answer}");
        }
    }

    #[tokio::test]
    async fn large_frames_are_written_from_where_they_are_with_their_framing() {
        let large: Bytes = (0..3000u32).map(|i| b'a' + (i % 26) as u8).collect();
        // A large body of known length (echoed), then large and small chunks.
        let (_drain, draining) = watch::channel(false);
        let (mut client, served) = scripted(test_limits(), draining, Echo);
        let request = [
            &b"POST /e HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 3000\r\n\r\n"[..],
            &large,
        ]
        .concat();
        let script = async {
            client.write_all(&request).await.unwrap();
            read_all(&mut client).await
        };
        let ((), answer) = tokio::join!(served, script);
        assert!(answer.contains("content-length: 3002\r\n"), "{answer}");
        assert!(answer.ends_with(&format!("\r\n\r\n/e{}", String::from_utf8_lossy(&large))));

        for frames in [
            vec![large.clone()],
            vec![large.clone(), Bytes::from_static(b"tail")],
            vec![Bytes::from_static(b"head"), large.clone(), large.clone()],
        ] {
            let (_drain, draining) = watch::channel(false);
            let (mut client, served) = scripted(test_limits(), draining, Frames(frames.clone()));
            let script = async {
                client
                    .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    .await
                    .unwrap();
                read_all(&mut client).await
            };
            let ((), answer) = tokio::join!(served, script);
            let mut chunked = String::new();
            for frame in &frames {
                chunked.push_str(&format!(
                    "{:x}\r\n{}\r\n",
                    frame.len(),
                    String::from_utf8_lossy(frame)
                ));
            }
            chunked.push_str("0\r\n\r\n");
            assert!(
                answer.contains("transfer-encoding: chunked\r\n"),
                "{answer}"
            );
            assert!(answer.ends_with(&format!("\r\n\r\n{chunked}")), "{answer}");
        }
    }

    /// Counts the writes made to the pipe.
    struct Counted {
        inner: tokio::io::WriteHalf<tokio::io::DuplexStream>,
        writes: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl ClientWrite for Counted {}

    impl AsyncWrite for Counted {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            this.writes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Pin::new(&mut this.inner).poll_write(cx, buf)
        }

        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_flush(cx)
        }

        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
        }
    }

    #[tokio::test]
    async fn frames_ready_at_once_go_out_in_one_write() {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let (reader, writer) = tokio::io::split(server);
        let writes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let writer = Counted {
            inner: writer,
            writes: Arc::clone(&writes),
        };
        let (_drain, draining) = watch::channel(false);
        let events: Vec<Bytes> = (0..20)
            .map(|i| Bytes::from(format!("data: {{\"token\": {i}}}\n\n")))
            .collect();
        let served = serve(
            Box::new(reader),
            writer,
            test_limits(),
            TEST_CAPTURED,
            draining,
            Frames(events.clone()),
        );
        let script = async {
            client
                .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .unwrap();
            read_all(&mut client).await
        };
        let ((), answer) = tokio::join!(served, script);
        for event in &events {
            let chunk = format!(
                "{:x}\r\n{}\r\n",
                event.len(),
                String::from_utf8_lossy(event)
            );
            assert!(answer.contains(&chunk), "{answer}");
        }
        assert!(answer.ends_with("\r\n0\r\n\r\n"), "{answer}");
        // The head, twenty events and the last chunk: one write.
        assert_eq!(writes.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    /// Answers with a stream whose events are sent through a channel.
    struct Channel(Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<Bytes>>>);

    struct ChannelBody(tokio::sync::mpsc::UnboundedReceiver<Bytes>);

    impl Body for ChannelBody {
        type Data = Bytes;
        type Error = io::Error;

        fn poll_frame(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
            self.get_mut()
                .0
                .poll_recv(cx)
                .map(|event| event.map(|data| Ok(Frame::data(data))))
        }
    }

    impl super::Answer for ChannelBody {}

    impl Handler for Channel {
        type Body = ChannelBody;

        async fn call(
            &self,
            _request: Request<IncomingBody>,
            _fields: Option<FieldLines>,
        ) -> Response<Self::Body> {
            Response::new(ChannelBody(self.0.lock().unwrap().take().unwrap()))
        }
    }

    /// Reads from `client` until `text` has come.
    async fn read_until(client: &mut tokio::io::DuplexStream, seen: &mut Vec<u8>, text: &str) {
        let mut chunk = [0u8; 4096];
        while !String::from_utf8_lossy(seen).contains(text) {
            let read = client.read(&mut chunk).await.unwrap();
            assert!(
                read > 0,
                "closed before {text:?}: {}",
                String::from_utf8_lossy(seen)
            );
            seen.extend_from_slice(&chunk[..read]);
        }
    }

    #[tokio::test]
    async fn a_stream_between_two_events_holds_no_buffer() {
        buffers::clear();
        let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
        let (_drain, draining) = watch::channel(false);
        let (mut client, served) =
            scripted(test_limits(), draining, Channel(Mutex::new(Some(receiver))));
        let script = async {
            client
                .write_all(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let mut seen = Vec::new();
            for i in 0..3 {
                let event = format!("data: {{\"token\": {i}}}\n\n");
                events.send(Bytes::from(event.clone())).unwrap();
                read_until(&mut client, &mut seen, &event).await;
                // The event is out and the stream waits for the next one and watches its client:
                // both of the connection's buffers are back with the thread, and the same two
                // serve every event.
                assert_eq!(buffers::kept(), (1, 1), "after event {i}");
            }
            drop(events);
            read_until(&mut client, &mut seen, "\r\n0\r\n\r\n").await;
            // The answer is complete and the connection waits for the next request.
            tokio::task::yield_now().await;
            assert_eq!(buffers::kept(), (1, 1));
            drop(client);
            String::from_utf8_lossy(&seen).into_owned()
        };
        let ((), answer) = tokio::join!(served, script);
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.contains("transfer-encoding: chunked"), "{answer}");
    }

    #[tokio::test]
    async fn a_malformed_head_is_refused_with_json_and_the_connection_closed() {
        let (_drain, draining) = watch::channel(false);
        let (mut client, served) = scripted(test_limits(), draining, Echo);
        let script = async {
            client
                .write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 5\r\n\r\nhello")
                .await
                .unwrap();
            read_all(&mut client).await
        };
        let ((), answer) = tokio::join!(served, script);
        assert!(
            answer.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{answer}"
        );
        assert!(
            answer.contains("content-type: application/json"),
            "{answer}"
        );
        assert!(
            answer.ends_with("{\"error\":\"duplicate Content-Length\"}")
                || answer.ends_with("{\"error\":\"invalid Content-Length\"}"),
            "{answer}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_is_answered_408_after_the_body_timeout_on_paused_time() {
        let (_drain, draining) = watch::channel(false);
        let limits = Limits {
            body_read_timeout: Duration::from_secs(30),
            ..test_limits()
        };
        // A body read with its head, and a streamed one (larger than READ_WHOLE).
        for (head, part) in [
            (
                "POST /small HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n",
                10,
            ),
            (
                "POST /large HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n",
                10,
            ),
        ] {
            let (mut client, served) = scripted(limits, draining.clone(), Echo);
            let script = async {
                client.write_all(head.as_bytes()).await.unwrap();
                client.write_all(&vec![b'x'; part]).await.unwrap();
                let started = tokio::time::Instant::now();
                let answer = read_all(&mut client).await;
                (answer, started.elapsed())
            };
            let ((), (answer, waited)) = tokio::join!(served, script);
            assert!(
                waited >= Duration::from_secs(30) && waited < Duration::from_secs(31),
                "{head}: {waited:?}"
            );
            // The handler saw its body fail (and answers, and logs, as it chooses); the
            // connection ends after the answer, which says so.
            assert!(answer.contains("!body failed"), "{head}: {answer}");
            assert!(answer.contains("connection: close\r\n"), "{head}: {answer}");
        }
    }

    /// Answers every request with a body that never ends, ready at once; the count of `held`
    /// tells whether the body is still alive.
    struct Endless(Arc<()>);

    struct EndlessBody(#[allow(dead_code)] Arc<()>);

    impl Body for EndlessBody {
        type Data = Bytes;
        type Error = io::Error;

        fn poll_frame(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; 16 * 1024])))))
        }
    }

    impl super::Answer for EndlessBody {}

    impl Handler for Endless {
        type Body = EndlessBody;

        async fn call(
            &self,
            _request: Request<IncomingBody>,
            _fields: Option<FieldLines>,
        ) -> Response<Self::Body> {
            Response::new(EndlessBody(Arc::clone(&self.0)))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_reads_slowly_but_keeps_reading_is_not_cut_off() {
        let (_drain, draining) = watch::channel(false);
        let limits = Limits {
            send_timeout: Duration::from_secs(30),
            ..test_limits()
        };
        let held = Arc::new(());
        let (mut client, mut served) = scripted(limits, draining, Endless(Arc::clone(&held)));
        client
            .write_all(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        // A read every 20 s, 2 minutes long: each write waits less than the timeout.
        let reader = async {
            let mut chunk = vec![0u8; 16 * 1024];
            for _ in 0..6 {
                tokio::time::sleep(Duration::from_secs(20)).await;
                assert!(client.read(&mut chunk).await.unwrap() > 0);
            }
        };
        tokio::select! {
            () = &mut served => panic!("the connection was closed while its client kept reading"),
            () = reader => {}
        }
        // The test's count, the handler's and the answer's: the answer is still being sent.
        assert_eq!(Arc::strong_count(&held), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_stops_reading_is_cut_off_after_the_send_timeout() {
        let (_drain, draining) = watch::channel(false);
        let limits = Limits {
            send_timeout: Duration::from_secs(30),
            ..test_limits()
        };
        let held = Arc::new(());
        let (mut client, served) = scripted(limits, draining, Endless(Arc::clone(&held)));
        client
            .write_all(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        // The client reads nothing: the pipe fills and the server's writes wait.
        let started = tokio::time::Instant::now();
        tokio::time::timeout(Duration::from_secs(600), served)
            .await
            .expect("the connection is closed while the client reads nothing");
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(30) && waited < Duration::from_secs(31),
            "{waited:?}"
        );
        // The answer (and whatever it held upstream) is gone with the connection.
        assert_eq!(Arc::strong_count(&held), 1);
        drop(client);
    }
}
