//! HTTP/1.1 client connections to plain-HTTP backends, built for proxying.
//!
//! A [`Connection`] is a byte stream (a TCP socket, or any [`Transport`]) with a read buffer and
//! a write buffer, taken from the thread's free list while bytes move and given back while the
//! connection waits (`h1/buffers.rs`). [`Connection::send`] writes the request (head and, for a
//! body in memory, the body in one write), reads the response head, and returns the response
//! with a [`ResponseStream`] that owns the connection and reads the body from the socket as the
//! client's side polls it, in the task that serves the client: no task per connection, no
//! channel between the two sides.
//! Once the body was read to its end, [`ResponseStream::take_connection`] hands the connection
//! back for the next request, if the exchange left it reusable.
//!
//! Framing follows RFC 9112: a request body goes out with its `Content-Length`, or chunked when
//! the request says `Transfer-Encoding: chunked`; a response body is delimited by the request
//! method and status (`HEAD`, 1xx, 204 and 304 have none), `Transfer-Encoding` (chunked is
//! decoded, trailers included; any other coding is read to the end of the connection),
//! `Content-Length`, or the end of the connection. Interim (1xx) responses are skipped. A
//! connection is reused only when both messages were complete, the response did not ask to close,
//! and no byte followed the response. Every buffer is bounded: a response head by
//! [`MAX_HEAD_BYTES`] and [`MAX_HEADERS`], a chunk-size
//! line and a trailer block by [`MAX_LINE_BYTES`](super::MAX_LINE_BYTES) and `MAX_HEAD_BYTES`.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use super::buffers;
use super::{
    BoxError, COALESCE, Chunked, Framing, Hop, MAX_HEAD_BYTES, MAX_HEADERS, OutgoingBody, ReadSize,
    Span, append_chunk, append_chunk_size, append_field, append_last_chunk, apply_connection,
    digits, field_spans, hop_by_hop, invalid, is_chunked, parse_content_length, poll_body,
    write_all_vectored,
};

/// The byte stream a client [`Connection`] runs over: any `AsyncRead + AsyncWrite` whose read and
/// write sides can be borrowed at once (a request body may still be going out while the answer
/// comes in). TCP sockets are one; tests script the backend's bytes over in-memory pipes.
pub trait Transport: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// The read side, borrowed.
    type Reader<'a>: AsyncRead + Unpin + Send
    where
        Self: 'a;
    /// The write side, borrowed.
    type Writer<'a>: AsyncWrite + Unpin + Send
    where
        Self: 'a;

    /// Borrows the two sides at once.
    fn split(&mut self) -> (Self::Reader<'_>, Self::Writer<'_>);
}

impl Transport for TcpStream {
    type Reader<'a> = tokio::net::tcp::ReadHalf<'a>;
    type Writer<'a> = tokio::net::tcp::WriteHalf<'a>;

    fn split(&mut self) -> (Self::Reader<'_>, Self::Writer<'_>) {
        TcpStream::split(self)
    }
}

/// An HTTP/1.1 connection to a backend, idle between exchanges.
#[derive(Debug)]
pub struct Connection<S = TcpStream> {
    stream: S,
    read: BytesMut,
    read_size: ReadSize,
    write: Vec<u8>,
    /// The last response's end-to-end header lines, as the backend sent them.
    fields: BytesMut,
}

/// Why a request got no response.
#[derive(Debug)]
pub enum SendError<B> {
    /// Not a byte of the request could be written: the connection had been closed. The body
    /// is handed back untouched, to be sent on another connection.
    Unsent(B),
    /// The exchange failed (the request may have reached the backend).
    Failed(io::Error),
    /// The request body failed (the client left, stalled or sent a malformed body): the
    /// exchange was abandoned at once and the connection closed.
    Body(BoxError),
}

impl<S: Transport> Connection<S> {
    /// Wraps a connected stream.
    pub fn new(stream: S) -> Self {
        Self {
            stream,
            read: ReadSize::buffer(),
            read_size: ReadSize::new(),
            write: Vec::new(),
            fields: BytesMut::with_capacity(512),
        }
    }

    /// Whether the idle connection may carry a request: the backend sent nothing since its last
    /// response ended, not a byte and not the end of the stream. Anything it sent now would be
    /// read as the answer to the next request, so a connection with unread input is closed.
    ///
    /// Like hyper's client ("unexpected message on idle connection") and nginx's keepalive
    /// close handler, this polls the stream once for input without waiting. On a TCP socket the
    /// runtime answers from the readiness its reactor keeps: when nothing came since the last
    /// read, no system call is made; otherwise one non-blocking `recv` tells a byte or the end
    /// of the stream (the connection is then dropped, so a byte read here is not lost to
    /// anyone) from stale readiness (which it clears).
    pub fn is_clean(&mut self) -> bool {
        if !self.read.is_empty() {
            return false;
        }
        let mut context = Context::from_waker(std::task::Waker::noop());
        let mut byte = [MaybeUninit::<u8>::uninit(); 1];
        let mut probe = ReadBuf::uninit(&mut byte);
        // Ready means a byte, the end of the stream, or an error.
        Pin::new(&mut self.stream)
            .poll_read(&mut context, &mut probe)
            .is_pending()
    }

    /// Sends the request `head` with `body` and reads the response head. The response body
    /// owns the connection until it was read to its end.
    ///
    /// Writes after the first must make progress within `stall`, when set.
    pub async fn send<B: OutgoingBody>(
        mut self,
        head: &OutgoingHead<'_>,
        mut body: B,
        stall: Option<Duration>,
    ) -> Result<Response<ResponseStream<S>>, SendError<B>> {
        // The write buffer is taken for the request and given back once it is sent.
        buffers::ensure_write(&mut self.write);
        let chunked = encode_head(&mut self.write, head, &body);
        let head_request = *head.method == Method::HEAD;
        // A body in memory goes out with the head: copied behind it when small, else in the
        // same vectored write from where it is.
        let mut rest_of_body = None;
        if let Some(bytes) = body.in_memory() {
            if bytes.len() <= COALESCE {
                self.write.extend_from_slice(bytes);
            } else {
                rest_of_body = Some(bytes.clone());
            }
        }
        // The first write tells whether the connection still takes requests; most requests
        // fit in it whole, and then only the answer is left to wait for.
        // A write that does not wait: polled once, with a waker that is never woken.
        let first = {
            let mut context = Context::from_waker(std::task::Waker::noop());
            let stream = Pin::new(&mut self.stream);
            match &rest_of_body {
                None => stream.poll_write(&mut context, &self.write),
                Some(rest) => {
                    let parts = [io::IoSlice::new(&self.write), io::IoSlice::new(rest)];
                    stream.poll_write_vectored(&mut context, &parts)
                }
            }
        };
        let written = match first {
            Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Err(SendError::Unsent(body)),
            Poll::Ready(Ok(written)) => written,
            Poll::Pending => 0,
        };
        let written = consume_written(written, self.write.len(), &mut rest_of_body);
        let whole = written == self.write.len() && rest_of_body.is_none() && body.is_whole();
        let outcome = if whole {
            let Connection {
                stream,
                read,
                read_size,
                fields,
                ..
            } = &mut self;
            let (mut reader, _) = stream.split();
            let answer = read_head(&mut reader, read, read_size, fields, head_request).await;
            Outcome::Answered(answer, true)
        } else {
            let Connection {
                stream,
                read,
                read_size,
                write,
                fields,
            } = &mut self;
            let (mut reader, mut writer) = stream.split();
            let pending = Pending {
                head: &write[written..],
                rest_of_body,
                first: written == 0,
            };
            let sending = write_request(&mut writer, pending, &mut body, chunked, stall);
            let receiving = read_head(&mut reader, read, read_size, fields, head_request);
            tokio::pin!(sending, receiving);
            tokio::select! {
                biased;
                sent = &mut sending => match sent {
                    Ok(()) => Outcome::Answered(receiving.await, true),
                    Err(WriteError::Unsent) => Outcome::Unsent,
                    // The client's side failed: no answer is waited for, the connection closes.
                    Err(WriteError::Body(error)) => Outcome::BodyFailed(error),
                    Err(WriteError::Stalled) => Outcome::Answered(
                        Err(io::Error::new(io::ErrorKind::TimedOut, "the backend stopped reading the request")),
                        false,
                    ),
                    // The backend may have answered before it stopped reading (413, say);
                    // without an answer, the write's error says what went wrong.
                    Err(WriteError::Io(error)) => match receiving.await {
                        Ok(head) => Outcome::Answered(Ok(head), false),
                        Err(_) => Outcome::Answered(Err(error), false),
                    },
                },
                // An answer before the whole request was sent: the connection is not reused.
                answer = &mut receiving => Outcome::Answered(answer, false),
            }
        };
        buffers::give_write(&mut self.write);
        match outcome {
            Outcome::Unsent => Err(SendError::Unsent(body)),
            Outcome::BodyFailed(error) => Err(SendError::Body(error)),
            Outcome::Answered(Err(error), _) => Err(SendError::Failed(error)),
            Outcome::Answered(Ok(answer), sent) => {
                let keep_alive = answer.keep_alive && sent;
                let mut response = Response::new(ResponseStream {
                    connection: Some(self),
                    framing: answer.framing,
                    keep_alive,
                    passthrough: answer.passthrough,
                });
                *response.status_mut() = answer.status;
                *response.version_mut() = answer.version;
                *response.headers_mut() = answer.headers;
                Ok(response)
            }
        }
    }
}

// Made and matched once per exchange: boxing the head would allocate per request.
#[allow(clippy::large_enum_variant)]
enum Outcome {
    Unsent,
    /// The request body failed.
    BodyFailed(BoxError),
    /// The response head (or why there is none), and whether the whole request was sent.
    Answered(io::Result<Head>, bool),
}

enum WriteError {
    /// The first write failed: nothing reached the backend.
    Unsent,
    /// Part of the request may have been sent.
    Io(io::Error),
    /// The request body (the client's side) failed.
    Body(BoxError),
    /// The backend took nothing of the request for the stall limit.
    Stalled,
}

/// What a request head is made of, borrowed from the proxy's copy of the client's request (so
/// that another attempt can send it again without a copy).
#[derive(Debug, Clone, Copy)]
pub struct OutgoingHead<'a> {
    /// The method.
    pub method: &'a Method,
    /// The request target: a path and query (origin form), or `host:port` for `CONNECT`.
    pub target: &'a str,
    /// The header fields, hop-by-hop ones already removed.
    pub fields: OutgoingFields<'a>,
    /// A `Host` to add (the fields have none).
    pub host: Option<&'a str>,
}

/// The fields of an [`OutgoingHead`].
#[derive(Debug, Clone, Copy)]
pub enum OutgoingFields<'a> {
    /// A map, the fields the caller sets itself in it.
    Map(&'a HeaderMap),
    /// A client's lines ([`super::FieldLines`]), written as they are, then the fields the caller
    /// sets itself (those it had set aside, [`super::fields::Captured`]), in order.
    Lines {
        /// `name: value\r\n` each.
        lines: &'a [u8],
        /// The fields written after the lines.
        appended: &'a [(HeaderName, HeaderValue)],
        /// Whether the lines hold a `Content-Length`.
        has_content_length: bool,
    },
}

/// Writes the request head into `out`; returns whether the body goes out chunked.
fn encode_head(out: &mut Vec<u8>, head: &OutgoingHead<'_>, body: &impl OutgoingBody) -> bool {
    out.clear();
    out.extend_from_slice(head.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(head.target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    if let Some(host) = head.host {
        append_field(out, b"host", host.as_bytes());
    }
    let mut chunked = false;
    let mut sized = false;
    match head.fields {
        OutgoingFields::Map(headers) => {
            for (name, value) in headers {
                if name == header::TRANSFER_ENCODING {
                    chunked = true;
                } else if name == header::CONTENT_LENGTH {
                    sized = true;
                }
                append_field(out, name.as_str().as_bytes(), value.as_bytes());
            }
        }
        OutgoingFields::Lines {
            lines,
            appended,
            has_content_length,
        } => {
            out.extend_from_slice(lines);
            for (name, value) in appended {
                append_field(out, name.as_str().as_bytes(), value.as_bytes());
            }
            sized = has_content_length;
        }
    }
    if !chunked && !sized {
        if body.is_whole() {
            let length = body.in_memory().map_or(0, Bytes::len);
            if length > 0 {
                let length = digits::<10>(length as u64);
                append_field(out, b"content-length", length.as_bytes());
            }
        } else {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
            chunked = true;
        }
    }
    out.extend_from_slice(b"\r\n");
    chunked
}

/// What is left to write of a request after the first write.
struct Pending<'a> {
    /// The rest of the encoded head (and of the body, when it was copied behind it).
    head: &'a [u8],
    /// A body in memory too large to copy behind the head.
    rest_of_body: Option<Bytes>,
    /// Whether nothing was written yet (the first write then tells whether the connection still
    /// takes requests).
    first: bool,
}

/// Splits `written` bytes of a write of a head of `head_length` bytes followed by `rest_of_body`:
/// what went past the head is taken off the body (and a body sent whole is `None` after it);
/// returns how much of the head was written.
fn consume_written(written: usize, head_length: usize, rest_of_body: &mut Option<Bytes>) -> usize {
    if let Some(rest) = rest_of_body.as_mut() {
        rest.advance(written.saturating_sub(head_length));
        if rest.is_empty() {
            *rest_of_body = None;
        }
    }
    written.min(head_length)
}

/// Writes what is left of the head, then the body.
///
/// Every write after the first must make progress within `stall` (when set): a backend that
/// stops reading the request must not hold the exchange, and the client's connection, forever.
async fn write_request(
    writer: &mut (impl AsyncWrite + Unpin),
    pending: Pending<'_>,
    body: &mut impl OutgoingBody,
    chunked: bool,
    stall: Option<Duration>,
) -> Result<(), WriteError> {
    let mut head = pending.head;
    let mut rest_of_body = pending.rest_of_body;
    if pending.first {
        let written = match &rest_of_body {
            None => writer.write(head).await,
            Some(rest) => {
                let parts = [io::IoSlice::new(head), io::IoSlice::new(rest)];
                writer.write_vectored(&parts).await
            }
        };
        match written {
            Ok(0) | Err(_) => return Err(WriteError::Unsent),
            Ok(written) => head = &head[consume_written(written, head.len(), &mut rest_of_body)..],
        }
    }
    if let Some(bytes) = rest_of_body {
        let mut parts = [io::IoSlice::new(head), io::IoSlice::new(&bytes)];
        return bounded(stall, write_all_vectored(writer, &mut parts)).await;
    }
    bounded(stall, writer.write_all(head)).await?;
    if body.is_whole() {
        return Ok(());
    }
    // Chunk framing is written into its own small buffer (streamed bodies are rare).
    let mut framing: Vec<u8> = Vec::new();
    // A streamed body: each frame as it comes, chunk-framed when the length is not known.
    let mut trailers = None;
    loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await;
        let frame = match frame {
            None => break,
            Some(Ok(frame)) => frame,
            Some(Err(error)) => return Err(WriteError::Body(error)),
        };
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                trailers = frame.into_trailers().ok();
                continue;
            }
        };
        if data.is_empty() {
            continue;
        }
        if chunked {
            framing.clear();
            if data.len() <= COALESCE {
                append_chunk(&mut framing, &data);
                bounded(stall, writer.write_all(&framing)).await?;
                continue;
            }
            append_chunk_size(&mut framing, data.len());
            let mut parts = [
                io::IoSlice::new(&framing),
                io::IoSlice::new(&data),
                io::IoSlice::new(b"\r\n"),
            ];
            bounded(stall, write_all_vectored(writer, &mut parts)).await?;
        } else {
            bounded(stall, writer.write_all(&data)).await?;
        }
    }
    if chunked {
        framing.clear();
        append_last_chunk(&mut framing, trailers.as_ref());
        bounded(stall, writer.write_all(&framing)).await?;
    }
    Ok(())
}

/// `write` within `stall` (when set): a stall is [`WriteError::Stalled`], a failure
/// [`WriteError::Io`].
async fn bounded(
    stall: Option<Duration>,
    write: impl Future<Output = io::Result<()>>,
) -> Result<(), WriteError> {
    let written = match stall {
        Some(limit) => tokio::time::timeout(limit, write)
            .await
            .map_err(|_| WriteError::Stalled)?,
        None => write.await,
    };
    written.map_err(WriteError::Io)
}

/// A parsed response head.
struct Head {
    status: StatusCode,
    version: Version,
    /// The end-to-end fields, unless they were left as lines.
    headers: HeaderMap,
    /// What the lines say, when the fields were left as lines.
    passthrough: Option<Passthrough>,
    framing: Framing,
    keep_alive: bool,
}

/// A response's end-to-end fields as the lines the backend sent (hop-by-hop ones and the length
/// left out), split off the connection's buffer without a copy and carried by the response body
/// ([`ResponseStream::passthrough`]): the server side writes them as they are, after the map's
/// fields ([`super::server::Answer`]), and the proxy reads what it needs of them here. (An
/// `http` extension would cost two allocations per response.)
#[derive(Debug, Clone, Default)]
pub struct Passthrough {
    /// `name: value\r\n` each.
    pub lines: Bytes,
    /// The lines include a `Date`.
    pub has_date: bool,
    /// The `Content-Type` value.
    pub content_type: Option<Bytes>,
    /// The `Retry-After` value.
    pub retry_after: Option<Bytes>,
}

/// Reads until a final response head is complete; interim (1xx) responses are passed over.
async fn read_head(
    reader: &mut (impl AsyncRead + Unpin),
    buffer: &mut BytesMut,
    size: &mut ReadSize,
    lines: &mut BytesMut,
    head_request: bool,
) -> io::Result<Head> {
    loop {
        if !buffer.is_empty() {
            let before = buffer.len();
            if let Some(head) = parse_head(buffer, head_request, Some(&mut *lines))? {
                return Ok(head);
            }
            if buffer.len() < before {
                // An interim response was passed over: what follows may already be here.
                continue;
            }
            if buffer.len() >= MAX_HEAD_BYTES {
                return Err(invalid("response head too large"));
            }
        }
        if size.fill(reader, buffer).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed before a response",
            ));
        }
    }
}

/// Parses a final response head at the start of `buffer` and removes it from there; `None` when
/// the head is not complete yet (an interim response is removed and `None` returned as well, so
/// the caller reads on).
///
/// With `lines`, the end-to-end fields are left as the backend's lines there (hop-by-hop ones
/// left out, and `Content-Length` too unless the response has no body), for the client side to
/// write as they are, and the map stays empty; without it, or when `Connection` names other
/// fields, they go into the map.
fn parse_head(
    buffer: &mut BytesMut,
    head_request: bool,
    mut lines: Option<&mut BytesMut>,
) -> io::Result<Option<Head>> {
    let mut fields = [MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_HEADERS];
    let mut spans: [Span; MAX_HEADERS] = [(0, 0, 0, 0); MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    let parser = httparse::ParserConfig::default();
    let status = match parser.parse_response_with_uninit_headers(&mut parsed, buffer, &mut fields) {
        Ok(status) => status,
        Err(httparse::Error::TooManyHeaders) => return Err(invalid("too many response headers")),
        Err(_) => return Err(invalid("malformed response head")),
    };
    let httparse::Status::Complete(length) = status else {
        return Ok(None);
    };
    if length > MAX_HEAD_BYTES {
        // One read can complete a head past the limit.
        return Err(invalid("response head too large"));
    }
    let code = parsed.code.unwrap_or_default();
    let version = if parsed.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    let count = parsed.headers.len();
    field_spans(buffer, parsed.headers, &mut spans);
    if code == 101 {
        // The router never forwards `Upgrade`, so a switch is never asked for (nginx: 502).
        return Err(invalid(
            "101 Switching Protocols to a request that asked for no upgrade",
        ));
    }
    if (100..200).contains(&code) {
        buffer.advance(length);
        return Ok(None);
    }
    let status = StatusCode::from_u16(code).map_err(|_| invalid("invalid status code"))?;
    let head = buffer.split_to(length).freeze();
    let spans = &spans[..count];
    let field = |start: u32, end: u32| &head[start as usize..end as usize];
    let bodiless = head_request || code == 204 || code == 304;
    // A `Content-Length` on a bodiless answer is passed on where it means the length the body
    // would have had (a HEAD's, a 304's); a 204 must not carry one (RFC 9110 §8.6), and an
    // HTTP/2 client may treat one that is not 0 as malformed: dropped, as nginx drops it.
    let keeps_length = bodiless && code != 204;
    // One pass reads the framing and connection fields and, with `lines`, writes the others
    // there (undone below in the rare case that `Connection` names fields).
    let mut content_length: Option<u64> = None;
    let mut transfer_encoding: Option<bool> = None;
    let http10 = version == Version::HTTP_10;
    let mut keep_alive = !http10;
    let mut connection_names_fields = false;
    if let Some(lines) = lines.as_deref_mut() {
        lines.clear();
    }
    let mut seen = Passthrough::default();
    let (mut content_type_at, mut retry_after_at) = (None, None);
    for &(name_start, name_end, value_start, value_end) in spans {
        let (raw_name, raw_value) = (field(name_start, name_end), field(value_start, value_end));
        match hop_by_hop(raw_name) {
            Some(Hop::Connection) => {
                connection_names_fields |= apply_connection(raw_value, http10, &mut keep_alive);
                continue;
            }
            // Only `chunked`, once: any other coding leaves the end of the body to guesswork.
            Some(Hop::TransferEncoding) => {
                if transfer_encoding.is_some() {
                    return Err(invalid("duplicate transfer-encoding"));
                }
                if !is_chunked(raw_value) {
                    return Err(invalid("unsupported transfer-encoding"));
                }
                transfer_encoding = Some(true);
                continue;
            }
            Some(Hop::Other) => continue,
            None if raw_name.eq_ignore_ascii_case(b"content-length") => {
                if content_length.is_some() {
                    return Err(invalid("duplicate content-length"));
                }
                content_length = Some(parse_content_length(raw_value)?);
                if !keeps_length {
                    continue;
                }
            }
            None => {}
        }
        let Some(lines) = lines.as_deref_mut() else {
            continue;
        };
        // Where the value will be in the lines: the proxy's copies are slices of the lines, not
        // of the head, so that the head's read buffer is not held while the body streams.
        let value_at = lines.len() + raw_name.len() + 2;
        let value_at = value_at..value_at + raw_value.len();
        if raw_name.eq_ignore_ascii_case(b"date") {
            seen.has_date = true;
        } else if raw_name.eq_ignore_ascii_case(b"content-type") {
            content_type_at = Some(value_at);
        } else if raw_name.eq_ignore_ascii_case(b"retry-after") {
            retry_after_at = Some(value_at);
        }
        append_field(lines, raw_name, raw_value);
    }
    let mut headers = HeaderMap::new();
    let mut passthrough = None;
    match lines {
        Some(lines) if !connection_names_fields => {
            seen.lines = lines.split().freeze();
            seen.content_type = content_type_at.map(|at| seen.lines.slice(at));
            seen.retry_after = retry_after_at.map(|at| seen.lines.slice(at));
            passthrough = Some(seen);
        }
        _ => {
            // Hop-by-hop fields are left out of the map, unless `Connection` names other fields:
            // then it stays, for the proxy to remove it and the fields it names.
            headers.reserve(count);
            for &(name_start, name_end, value_start, value_end) in spans {
                let raw_name = field(name_start, name_end);
                if hop_by_hop(raw_name)
                    .is_some_and(|hop| hop != Hop::Connection || !connection_names_fields)
                    || (code == 204 && raw_name.eq_ignore_ascii_case(b"content-length"))
                {
                    continue;
                }
                let name = HeaderName::from_bytes(raw_name)
                    .map_err(|_| invalid("invalid response header name"))?;
                let value = HeaderValue::from_maybe_shared(
                    head.slice(value_start as usize..value_end as usize),
                )
                .map_err(|_| invalid("invalid response header value"))?;
                headers.append(name, value);
            }
        }
    }
    if transfer_encoding.is_some() && content_length.is_some() {
        // Two ways to delimit the body: which one the backend meant is unknowable (nginx: 502).
        return Err(invalid("both transfer-encoding and content-length"));
    }
    let framing = if bodiless {
        // A backend that announces a body where none is allowed may well send one: the
        // connection is not reused, so those bytes can never be read as the next answer.
        if transfer_encoding.is_some() || content_length.is_some_and(|length| length > 0) {
            keep_alive = false;
        }
        Framing::Length(0)
    } else if transfer_encoding.is_some() {
        // HTTP/1.0 has no transfer codings: a sender that uses one may have framed the body
        // wrongly, so the connection ends with it (RFC 9112 §6.1).
        if http10 {
            keep_alive = false;
        }
        Framing::Chunked(Chunked::Size)
    } else if let Some(length) = content_length {
        Framing::Length(length)
    } else {
        Framing::Close
    };
    let keep_alive = keep_alive && framing != Framing::Close;
    Ok(Some(Head {
        status,
        version,
        headers,
        passthrough,
        framing,
        keep_alive,
    }))
}

/// A response body read from its connection as it is polled.
#[derive(Debug)]
pub struct ResponseStream<S = TcpStream> {
    connection: Option<Connection<S>>,
    framing: Framing,
    keep_alive: bool,
    passthrough: Option<Passthrough>,
}

impl<S: Transport> ResponseStream<S> {
    /// The response's fields as the lines the backend sent, when they were left as lines (the
    /// response head's map is then empty).
    pub fn passthrough(&self) -> Option<&Passthrough> {
        self.passthrough.as_ref()
    }

    /// The connection, once the body was read to its end and the exchange left it reusable.
    pub fn take_connection(&mut self) -> Option<Connection<S>> {
        // A body known to be empty (`HEAD`, 204, 304, `Content-Length: 0`) may never be polled.
        let reusable = self.framing.is_end()
            && self.keep_alive
            && self
                .connection
                .as_ref()
                .is_some_and(|connection| connection.read.is_empty());
        if reusable {
            let mut connection = self.connection.take()?;
            // An idle connection holds no read buffer, whatever the answer grew it to (one its
            // last frame still shares stays until the next read).
            connection.read_size = ReadSize::new();
            connection.read_size.shrink(&mut connection.read);
            buffers::give_read(&mut connection.read);
            Some(connection)
        } else {
            None
        }
    }

    fn fail(&mut self, error: io::Error) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.framing = Framing::Failed;
        self.connection = None;
        Poll::Ready(Some(Err(error)))
    }
}

impl<S: Transport> Body for ResponseStream<S> {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        let Some(connection) = this.connection.as_mut() else {
            return Poll::Ready(None);
        };
        let Connection {
            stream,
            read,
            read_size,
            ..
        } = connection;
        match ready!(poll_body(&mut this.framing, stream, read, read_size, cx)) {
            Ok(frame) => Poll::Ready(frame.map(Ok)),
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

#[cfg(test)]
#[path = "client_scripted.rs"]
mod scripted;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_heads_say_how_the_body_is_delimited() {
        let cases: [(&[u8], bool, Framing, bool); 10] = [
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
                false,
                Framing::Length(2),
                true,
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                false,
                Framing::Chunked(Chunked::Size),
                true,
            ),
            (b"HTTP/1.1 200 OK\r\n\r\n", false, Framing::Close, false),
            (
                b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
                false,
                Framing::Length(0),
                false,
            ),
            (
                b"HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n",
                false,
                Framing::Length(1),
                false,
            ),
            (
                b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\ncontent-length: 1\r\n\r\n",
                false,
                Framing::Length(1),
                true,
            ),
            // No body where a body is announced: the connection is not reused.
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n",
                true,
                Framing::Length(0),
                false,
            ),
            (
                b"HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n",
                false,
                Framing::Length(0),
                false,
            ),
            (
                b"HTTP/1.1 204 No Content\r\ntransfer-encoding: chunked\r\n\r\n",
                false,
                Framing::Length(0),
                false,
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
                true,
                Framing::Length(0),
                true,
            ),
        ];
        for (input, head_request, framing, keep_alive) in cases {
            let mut buffer = BytesMut::from(input);
            let head = parse_head(&mut buffer, head_request, None)
                .unwrap()
                .unwrap();
            assert_eq!(head.framing, framing, "{}", String::from_utf8_lossy(input));
            assert_eq!(
                head.keep_alive,
                keep_alive,
                "{}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn hop_by_hop_fields_are_left_out_unless_connection_names_others() {
        let mut buffer = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nTransfer-Encoding: chunked\r\nx-a: 1\r\nUpgrade: h2c\r\n\r\n"[..],
        );
        let head = parse_head(&mut buffer, false, None).unwrap().unwrap();
        let names: Vec<_> = head.headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-a"]);
        assert_eq!(head.framing, Framing::Chunked(Chunked::Size));
        assert!(head.keep_alive);

        let mut buffer = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nconnection: keep-alive\r\nconnection: x-secret\r\nx-secret: 1\r\nx-a: 1\r\ncontent-length: 0\r\n\r\n"[..],
        );
        // `Connection` stays, with the field it names, for the proxy to remove both.
        let head = parse_head(&mut buffer, false, None).unwrap().unwrap();
        let names: Vec<_> = head.headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["connection", "x-secret", "x-a", "content-length"]);
    }

    #[test]
    fn fields_left_as_lines_drop_hop_by_hop_and_framing_and_say_what_the_proxy_reads() {
        let head = b"HTTP/1.1 429 Too Many Requests\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nContent-Length: 5\r\nDate: Mon, 30 Nov 2026 10:00:00 GMT\r\nContent-Type: text/event-stream\r\nRetry-After: 3\r\nX-A: 1\r\n\r\n";
        let mut lines = BytesMut::new();
        let parsed = parse_head(&mut BytesMut::from(&head[..]), false, Some(&mut lines))
            .unwrap()
            .unwrap();
        assert!(parsed.headers.is_empty());
        let fields = parsed.passthrough.unwrap();
        assert_eq!(
            String::from_utf8(fields.lines.to_vec()).unwrap(),
            "Date: Mon, 30 Nov 2026 10:00:00 GMT\r\nContent-Type: text/event-stream\r\nRetry-After: 3\r\nX-A: 1\r\n"
        );
        assert!(fields.has_date);
        assert_eq!(
            fields.content_type.as_deref(),
            Some(&b"text/event-stream"[..])
        );
        assert_eq!(fields.retry_after.as_deref(), Some(&b"3"[..]));
        assert_eq!(parsed.framing, Framing::Length(5));
        // Without a body the length stays; a `Connection` naming a field puts all in the map.
        let parsed = parse_head(&mut BytesMut::from(&head[..]), true, Some(&mut lines))
            .unwrap()
            .unwrap();
        let fields = parsed.passthrough.unwrap();
        assert!(String::from_utf8_lossy(&fields.lines).contains("Content-Length: 5\r\n"));
        assert_eq!(parsed.framing, Framing::Length(0));
        let named = b"HTTP/1.1 200 OK\r\nConnection: x-a\r\nX-A: 1\r\ncontent-length: 0\r\n\r\n";
        let parsed = parse_head(&mut BytesMut::from(&named[..]), false, Some(&mut lines))
            .unwrap()
            .unwrap();
        assert!(parsed.passthrough.is_none());
        assert_eq!(parsed.headers.len(), 3);
    }

    #[test]
    fn a_204_loses_its_content_length_and_a_304_or_head_answer_keeps_it() {
        let kept = |head: &[u8], head_request: bool| {
            let mut lines = BytesMut::new();
            let as_lines = parse_head(&mut BytesMut::from(head), head_request, Some(&mut lines))
                .unwrap()
                .unwrap();
            let lines = as_lines.passthrough.unwrap().lines;
            let as_map = parse_head(&mut BytesMut::from(head), head_request, None)
                .unwrap()
                .unwrap();
            let in_lines = String::from_utf8_lossy(&lines).contains("content-length: 5");
            assert_eq!(in_lines, as_map.headers.contains_key("content-length"));
            in_lines
        };
        assert!(!kept(
            b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n",
            false
        ));
        assert!(!kept(
            b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n",
            true
        ));
        assert!(kept(
            b"HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\n\r\n",
            false
        ));
        assert!(kept(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", true));
    }

    #[test]
    fn interim_responses_are_skipped_and_partial_heads_wait() {
        let mut buffer =
            BytesMut::from(&b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\n"[..]);
        assert!(parse_head(&mut buffer, false, None).unwrap().is_none());
        assert!(parse_head(&mut buffer, false, None).unwrap().is_none());
        buffer.extend_from_slice(b"x-a: 1\r\nx-a: 2\r\ncontent-length: 0\r\n\r\n");
        let head = parse_head(&mut buffer, false, None).unwrap().unwrap();
        assert_eq!(head.status, StatusCode::CREATED);
        assert_eq!(head.headers.get_all("x-a").iter().count(), 2);
        assert!(buffer.is_empty());
    }

    #[test]
    fn bad_lengths_are_errors() {
        for input in [
            &b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 1, 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: +1\r\n\r\n",
            // As nginx: duplicates and lists, even of one value, are refused.
            b"HTTP/1.1 200 OK\r\ncontent-length: 4, 4\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\ncontent-length: 4\r\n\r\n",
            // Two framings, a coding other than chunked, two codings fields.
            b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
            // A switch the router never asked for.
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n",
        ] {
            assert!(
                parse_head(&mut BytesMut::from(input), false, None).is_err(),
                "{}",
                String::from_utf8_lossy(input)
            );
        }
        let head = parse_head(
            &mut BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-length: 0004\r\n\r\n"[..]),
            false,
            None,
        )
        .unwrap()
        .unwrap();
        assert_eq!(head.framing, Framing::Length(4));
    }
}
