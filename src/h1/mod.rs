//! HTTP/1.1 written for proxying, on both sides of the router: [`client`] speaks to plain-HTTP
//! backends, [`server`] to clients. The two share what this module holds: the limits every
//! buffer is held to, reading a body as it is polled (by length, chunked, or to the end of the
//! connection), writing field lines and chunks, reading `Content-Length`, `Transfer-Encoding`
//! and `Connection`, and the hop-by-hop field names.

use std::future::Future;
use std::io;
use std::pin::pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

mod buffers;
pub mod client;
pub mod fields;
pub mod idle;
pub mod server;
pub mod stall;

pub use client::{Connection, OutgoingHead, ResponseStream, SendError};
pub use stall::StallTimer;

/// A body error, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a client's request body could not be read to its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFailure {
    /// The client sent nothing for `body_read_timeout` (answered 408).
    TimedOut,
    /// The client left mid-body or sent a malformed body (answered 400).
    Broken,
}

impl BodyFailure {
    /// What a request body's error says: a timeout anywhere among its causes is
    /// [`BodyFailure::TimedOut`].
    pub fn of(error: &(dyn std::error::Error + 'static)) -> Self {
        let mut cause = Some(error);
        while let Some(error) = cause {
            if error
                .downcast_ref::<io::Error>()
                .is_some_and(|io| io.kind() == io::ErrorKind::TimedOut)
            {
                return BodyFailure::TimedOut;
            }
            cause = error.source();
        }
        BodyFailure::Broken
    }

    /// The name used in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            BodyFailure::TimedOut => "client_body_timeout",
            BodyFailure::Broken => "client_body_error",
        }
    }

    /// The status the client is answered with.
    pub fn status(self) -> http::StatusCode {
        match self {
            BodyFailure::TimedOut => http::StatusCode::REQUEST_TIMEOUT,
            BodyFailure::Broken => http::StatusCode::BAD_REQUEST,
        }
    }

    /// The message the client is answered with.
    pub fn message(self) -> &'static str {
        match self {
            BodyFailure::TimedOut => "the client sent no request body bytes for body_read_timeout",
            BodyFailure::Broken => "could not read the request body",
        }
    }
}

/// A request body the client side sends: whole in memory (it goes out with its length, in the
/// same write as the head when small), or streamed (chunked unless the head gives a length).
pub trait OutgoingBody: http_body::Body<Data = Bytes, Error = BoxError> + Unpin {
    /// Whether the whole body is in memory.
    fn is_whole(&self) -> bool;

    /// The bytes of a whole body, unless it is empty or was sent.
    fn in_memory(&self) -> Option<&Bytes>;
}
pub use fields::{Captured, CapturedField, FieldLines, Fields, Repeated};

/// Largest response head (or trailer block) accepted from a backend, in bytes.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most header fields accepted in a response head or trailer block.
pub const MAX_HEADERS: usize = 100;
/// Longest chunk-size line accepted (extensions included).
pub const MAX_LINE_BYTES: usize = 4096;

/// The size a connection's read buffer starts with, and the least a read asks for: a request
/// head, a streamed event or a small answer fit (nginx's `client_header_buffer_size` is 1 KiB
/// too); larger messages grow it ([`ReadSize`]).
pub(crate) const READ_BUFFER: usize = 1024;
/// The most a read asks for.
pub(crate) const MAX_READ: usize = 64 * 1024;
/// Messages this size or smaller are copied into the connection's write buffer behind their
/// head or chunk line and go out in one write; larger ones are written from where they are
/// with one vectored write.
pub(crate) const COALESCE: usize = 1024;

/// How much a connection's next read asks for. It doubles while reads fill all they were given
/// (a large body arriving), and halves back towards [`READ_BUFFER`] when they take less than a
/// quarter (a stream of small events). Where a connection waits ([`ReadSize::shrink`]: before a
/// body's next read, while a client waits for its answer, an idle connection), a buffer left
/// empty and more than twice that size is given up for one of that size, so a large message does
/// not leave its connection holding a large buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadSize(u32);

impl ReadSize {
    pub(crate) const fn new() -> Self {
        Self(READ_BUFFER as u32)
    }

    /// A connection's read buffer before its first read: none yet ([`buffers`] hands one out
    /// when a read is tried).
    pub(crate) fn buffer() -> BytesMut {
        BytesMut::new()
    }

    /// Gives up an empty buffer more than twice the size reads now ask for.
    pub(crate) fn shrink(&self, buffer: &mut BytesMut) {
        let want = self.0 as usize;
        if buffer.is_empty() && buffer.capacity() > 2 * want {
            *buffer = BytesMut::with_capacity(want);
        }
    }

    /// Reads once into `buffer` (see the type's documentation); `Ok(0)` at the end of the stream.
    pub(crate) fn poll_fill<R: AsyncRead + Unpin + ?Sized>(
        &mut self,
        reader: &mut R,
        buffer: &mut BytesMut,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<usize>> {
        let want = self.0 as usize;
        if buffer.capacity() == 0 {
            *buffer = buffers::read_buffer();
        }
        if buffer.capacity() - buffer.len() < want / 2 {
            buffer.reserve(want);
        }
        let offered = buffer.capacity() - buffer.len();
        let Poll::Ready(read) = pin!(reader.read_buf(buffer)).poll(cx) else {
            // Nothing to read: a connection that waits holds no empty buffer.
            buffers::give_read(buffer);
            return Poll::Pending;
        };
        let read = read?;
        if read == offered {
            self.0 = (want * 2).min(MAX_READ) as u32;
        } else if read < want / 4 {
            self.0 = (want / 2).max(READ_BUFFER) as u32;
        }
        Poll::Ready(Ok(read))
    }

    /// [`ReadSize::poll_fill`] as a future.
    pub(crate) async fn fill<R: AsyncRead + Unpin + ?Sized>(
        &mut self,
        reader: &mut R,
        buffer: &mut BytesMut,
    ) -> io::Result<usize> {
        std::future::poll_fn(|cx| self.poll_fill(reader, buffer, cx)).await
    }
}

/// Writes all of `parts`, in as few (vectored) writes as the writer takes.
pub(crate) async fn write_all_vectored<W: AsyncWrite + Unpin + ?Sized>(
    writer: &mut W,
    mut parts: &mut [io::IoSlice<'_>],
) -> io::Result<()> {
    io::IoSlice::advance_slices(&mut parts, 0);
    while !parts.is_empty() {
        let written = writer.write_vectored(parts).await?;
        if written == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        io::IoSlice::advance_slices(&mut parts, written);
    }
    Ok(())
}

/// The text of `value` in base `RADIX` (10 for a `Content-Length`, 16 for a chunk size), without
/// allocating.
pub(crate) fn digits<const RADIX: u64>(value: u64) -> Digits {
    let mut buffer = Digits {
        digits: [0; 20],
        start: 20,
    };
    let mut rest = value;
    loop {
        buffer.start -= 1;
        buffer.digits[buffer.start] = b"0123456789abcdef"[(rest % RADIX) as usize];
        rest /= RADIX;
        if rest == 0 {
            return buffer;
        }
    }
}

pub(crate) struct Digits {
    digits: [u8; 20],
    start: usize,
}

impl Digits {
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.digits[self.start..]
    }
}

/// Appends the field line `name: value`.
pub(crate) fn append_field(out: &mut impl bytes::BufMut, name: &[u8], value: &[u8]) {
    out.put_slice(name);
    out.put_slice(b": ");
    out.put_slice(value);
    out.put_slice(b"\r\n");
}

/// Appends the size line of a chunk of `length` bytes.
pub(crate) fn append_chunk_size(out: &mut Vec<u8>, length: usize) {
    out.extend_from_slice(digits::<16>(length as u64).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends `data` as one chunk.
pub(crate) fn append_chunk(out: &mut Vec<u8>, data: &[u8]) {
    append_chunk_size(out, data.len());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// Appends the last chunk and the trailer block (the fields a trailer may carry, see
/// [`allowed_in_trailers`]: trailers from an HTTP/2 peer are not decoded here).
pub(crate) fn append_last_chunk(out: &mut Vec<u8>, trailers: Option<&HeaderMap>) {
    out.extend_from_slice(b"0\r\n");
    for (name, value) in trailers.into_iter().flatten() {
        if !allowed_in_trailers(name.as_str().as_bytes()) {
            continue;
        }
        append_field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

/// Removes the request fields whose names contain `_` (unless `limits.allow_underscore_headers`
/// keeps them): CGI/WSGI backends read `X_A` and `X-A` as one name, so `X_Api_Key` could stand
/// in for `X-Api-Key` (nginx's `underscores_in_headers off`). The HTTP/1 server drops them
/// from a head as it parses it; this serves the fields it keeps in a map (trailers, HTTP/2
/// requests). Allocates only when there is one to remove.
pub fn drop_underscore_fields(headers: &mut HeaderMap) {
    if !headers.keys().any(|name| name.as_str().contains('_')) {
        return;
    }
    let names: Vec<_> = headers
        .keys()
        .filter(|name| name.as_str().contains('_'))
        .cloned()
        .collect();
    for name in names {
        headers.remove(name);
    }
}

/// Applies a `Connection` value's tokens, in order, to `keep_alive`: `close` ends the
/// connection, `keep-alive` keeps an HTTP/1.0 one. Returns whether the value names other fields.
pub(crate) fn apply_connection(value: &[u8], http10: bool, keep_alive: &mut bool) -> bool {
    let mut names_fields = false;
    for token in value.split(|&b| b == b',') {
        let token = token.trim_ascii();
        if token.eq_ignore_ascii_case(b"close") {
            *keep_alive = false;
        } else if token.eq_ignore_ascii_case(b"keep-alive") {
            if http10 {
                *keep_alive = true;
            }
        } else if !token.is_empty() {
            names_fields = true;
        }
    }
    names_fields
}

/// Where a parsed field's name and value lie in the head: start and end of each, as offsets
/// from the head's first byte (a head is far below 4 GiB).
pub(crate) type Span = (u32, u32, u32, u32);

/// Fills `spans` with where each of `fields` lies in `head` (what httparse parsed them from).
pub(crate) fn field_spans(head: &[u8], fields: &[httparse::Header<'_>], spans: &mut [Span]) {
    let base = head.as_ptr() as usize;
    for (span, field) in spans.iter_mut().zip(fields) {
        let name = field.name.as_ptr() as usize - base;
        let value = field.value.as_ptr() as usize - base;
        *span = (
            name as u32,
            (name + field.name.len()) as u32,
            value as u32,
            (value + field.value.len()) as u32,
        );
    }
}

/// Polls the next frame of a body delimited by `framing` out of `buffer`, reading from `reader`
/// when more is needed; `None` at the body's end. A body that is not delimited by the end of the
/// connection fails if the connection ends first.
pub(crate) fn poll_body<R: AsyncRead + Unpin>(
    framing: &mut Framing,
    reader: &mut R,
    buffer: &mut BytesMut,
    size: &mut ReadSize,
    cx: &mut Context<'_>,
) -> Poll<io::Result<Option<Frame<Bytes>>>> {
    loop {
        match framing.decode(buffer)? {
            Step::Data(data) => return Poll::Ready(Ok(Some(Frame::data(data)))),
            Step::Trailers(trailers) => return Poll::Ready(Ok(Some(Frame::trailers(trailers)))),
            Step::End => return Poll::Ready(Ok(None)),
            Step::More => {}
        }
        size.shrink(buffer);
        if ready!(size.poll_fill(reader, buffer, cx))? == 0 {
            if framing.ends_at_eof() {
                return Poll::Ready(Ok(None));
            }
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed before the body ended",
            )));
        }
    }
}

pub(crate) fn invalid(message: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// The hop-by-hop fields (RFC 9110 §7.6.1, and those the proxy also drops).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hop {
    Connection,
    TransferEncoding,
    Other,
}

pub(crate) fn hop_by_hop(name: &[u8]) -> Option<Hop> {
    const OTHERS: [&[u8]; 6] = [
        b"keep-alive",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-connection",
        b"proxy-authorization",
    ];
    // Lengths first: most names are ruled out without comparing them.
    if !matches!(name.len(), 2 | 7 | 10 | 16 | 17 | 19) {
        return None;
    }
    if name.eq_ignore_ascii_case(b"connection") {
        Some(Hop::Connection)
    } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
        Some(Hop::TransferEncoding)
    } else if OTHERS.iter().any(|hop| name.eq_ignore_ascii_case(hop)) {
        Some(Hop::Other)
    } else {
        None
    }
}

/// A `Content-Length` value: digits only (leading zeros allowed). A list, even of equal values
/// (`5, 5`), a sign or any other byte is refused, as nginx does: a proxy that read the list
/// differently from the next hop would disagree about where the message ends.
///
/// More than 19 digits is refused too, leading zeros or not: some parsers read at most that
/// many, and a length two hops read differently is a desync.
pub(crate) fn parse_content_length(value: &[u8]) -> io::Result<u64> {
    if value.is_empty() || value.len() > 19 || !value.iter().all(u8::is_ascii_digit) {
        return Err(invalid("invalid content-length"));
    }
    value.iter().try_fold(0u64, |total, digit| {
        total
            .checked_mul(10)
            .and_then(|total| total.checked_add(u64::from(digit - b'0')))
            .filter(|&total| total <= MAX_BODY_LENGTH)
            .ok_or_else(|| invalid("content-length too large"))
    })
}

/// Largest body length (or chunk size) accepted: what a signed 64-bit offset holds, as in nginx.
pub(crate) const MAX_BODY_LENGTH: u64 = i64::MAX as u64;

/// Whether a `Transfer-Encoding` value is exactly `chunked` (the only coding the router reads;
/// nginx answers any other with 501 to a client and 502 from a backend).
pub fn is_chunked(value: &[u8]) -> bool {
    value.trim_ascii().eq_ignore_ascii_case(b"chunked")
}

/// The size in a chunk-size line (`line` without its line end): one or more hex digits, then
/// nothing or an extension (`;`, or whitespace then `;`) of visible characters and whitespace.
/// A leading space, a bare CR, a control byte or a size past [`MAX_BODY_LENGTH`] is refused.
pub(crate) fn parse_chunk_size(line: &[u8]) -> io::Result<u64> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 {
        return Err(invalid("invalid chunk size"));
    }
    let size = line[..digits].iter().try_fold(0u64, |total, &digit| {
        let value = u64::from((digit as char).to_digit(16).unwrap_or(0));
        total
            .checked_mul(16)
            .map(|total| total + value)
            .filter(|&total| total <= MAX_BODY_LENGTH)
            .ok_or_else(|| invalid("chunk size too large"))
    })?;
    let extension = &line[digits..];
    let after_blanks = extension.trim_ascii_start();
    let well_formed = extension.is_empty()
        || (after_blanks.first() == Some(&b';')
            && extension
                .iter()
                .all(|&b| b == b'\t' || (b' '..=b'~').contains(&b) || b >= 0x80));
    if !well_formed {
        return Err(invalid("invalid chunk extension"));
    }
    Ok(size)
}

/// How the rest of a message body is delimited, and how far it was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// This many bytes are left.
    Length(u64),
    /// Chunked transfer coding, at this point of a chunk.
    Chunked(Chunked),
    /// Everything up to the end of the connection (responses only).
    Close,
    /// The body ended.
    Done,
    /// The body failed; the connection is not reused.
    Failed,
}

/// The next piece of a body, as [`Framing::decode`] finds it in the read buffer.
#[derive(Debug)]
pub(crate) enum Step {
    Data(Bytes),
    Trailers(HeaderMap),
    End,
    /// More bytes are needed.
    More,
}

impl Framing {
    /// Takes the next piece of the body from `buffer` (the body's bytes and whatever follows
    /// them, which stays there).
    pub(crate) fn decode(&mut self, buffer: &mut BytesMut) -> io::Result<Step> {
        match self {
            Framing::Done | Framing::Failed => Ok(Step::End),
            Framing::Length(0) => {
                *self = Framing::Done;
                Ok(Step::End)
            }
            Framing::Length(left) => {
                if buffer.is_empty() {
                    return Ok(Step::More);
                }
                let taken = buffer
                    .len()
                    .min(usize::try_from(*left).unwrap_or(usize::MAX));
                *left -= taken as u64;
                if *left == 0 {
                    *self = Framing::Done;
                }
                Ok(Step::Data(buffer.split_to(taken).freeze()))
            }
            Framing::Chunked(state) => match decode_chunked(state, buffer)? {
                Decoded::Data(data) => Ok(Step::Data(data)),
                Decoded::Trailers(trailers) => {
                    *self = Framing::Done;
                    Ok(Step::Trailers(trailers))
                }
                Decoded::End => {
                    *self = Framing::Done;
                    Ok(Step::End)
                }
                Decoded::More => Ok(Step::More),
            },
            Framing::Close if buffer.is_empty() => Ok(Step::More),
            Framing::Close => Ok(Step::Data(buffer.split().freeze())),
        }
    }

    /// The connection ended: whether that ends the body (it is delimited by the end of the
    /// connection) rather than cutting it short.
    pub(crate) fn ends_at_eof(&mut self) -> bool {
        if *self == Framing::Close {
            *self = Framing::Done;
            return true;
        }
        false
    }

    /// Whether nothing is left to read (a body known to be empty may never be polled).
    pub(crate) fn is_end(&self) -> bool {
        matches!(self, Framing::Done | Framing::Length(0))
    }

    pub(crate) fn size_hint(&self) -> SizeHint {
        match *self {
            Framing::Length(left) => SizeHint::with_exact(left),
            Framing::Done | Framing::Failed => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

/// Where the chunked decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Chunked {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk, with this many bytes left.
    Data(u64),
    /// After a chunk's data, at its line end.
    DataEnd,
    /// After the last chunk, at the trailer block.
    Trailers,
}

/// What the chunked decoder found in the buffer.
#[derive(Debug)]
pub(crate) enum Decoded {
    Data(Bytes),
    Trailers(HeaderMap),
    End,
    /// More bytes are needed.
    More,
}

/// Decodes the next piece of a chunked body from `buffer`.
pub(crate) fn decode_chunked(state: &mut Chunked, buffer: &mut BytesMut) -> io::Result<Decoded> {
    loop {
        match *state {
            Chunked::Size => {
                let Some(end) = memchr::memchr(b'\n', buffer) else {
                    if buffer.len() > MAX_LINE_BYTES {
                        return Err(invalid("chunk-size line too long"));
                    }
                    return Ok(Decoded::More);
                };
                if end > MAX_LINE_BYTES {
                    return Err(invalid("chunk-size line too long"));
                }
                let line = &buffer[..end];
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                let size = parse_chunk_size(line)?;
                buffer.advance(end + 1);
                *state = if size == 0 {
                    Chunked::Trailers
                } else {
                    Chunked::Data(size)
                };
            }
            Chunked::Data(left) => {
                if buffer.is_empty() {
                    return Ok(Decoded::More);
                }
                let taken = buffer
                    .len()
                    .min(usize::try_from(left).unwrap_or(usize::MAX));
                *state = if taken as u64 == left {
                    Chunked::DataEnd
                } else {
                    Chunked::Data(left - taken as u64)
                };
                return Ok(Decoded::Data(buffer.split_to(taken).freeze()));
            }
            Chunked::DataEnd => match buffer.first() {
                None => return Ok(Decoded::More),
                Some(b'\n') => {
                    buffer.advance(1);
                    *state = Chunked::Size;
                }
                Some(b'\r') => match buffer.get(1) {
                    None => return Ok(Decoded::More),
                    Some(b'\n') => {
                        buffer.advance(2);
                        *state = Chunked::Size;
                    }
                    Some(_) => return Err(invalid("chunk data longer than its size")),
                },
                Some(_) => return Err(invalid("chunk data longer than its size")),
            },
            Chunked::Trailers => return decode_trailers(buffer),
        }
    }
}

/// Whether a trailer field is passed on: not a hop-by-hop field, nor one that frames or routes
/// a message (`Content-Length`, `Host`), which a trailer must not carry (RFC 9110 §6.5.1) and
/// which an HTTP/2 peer treats as a malformed message, resetting the stream. Dropped, as nginx
/// drops them.
fn allowed_in_trailers(name: &[u8]) -> bool {
    hop_by_hop(name).is_none()
        && !name.eq_ignore_ascii_case(b"content-length")
        && !name.eq_ignore_ascii_case(b"host")
}

/// The trailer block after the last chunk: nothing (an empty line) or header fields (those a
/// trailer may carry, see [`allowed_in_trailers`]).
pub(crate) fn decode_trailers(buffer: &mut BytesMut) -> io::Result<Decoded> {
    match buffer.first() {
        None => return Ok(Decoded::More),
        Some(b'\n') => {
            buffer.advance(1);
            return Ok(Decoded::End);
        }
        Some(b'\r') => match buffer.get(1) {
            None => return Ok(Decoded::More),
            Some(b'\n') => {
                buffer.advance(2);
                return Ok(Decoded::End);
            }
            Some(_) => return Err(invalid("malformed trailers")),
        },
        Some(_) => {}
    }
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    match httparse::parse_headers(buffer, &mut fields) {
        Ok(httparse::Status::Complete((length, _))) if length > MAX_HEAD_BYTES => {
            Err(invalid("trailers too large"))
        }
        Ok(httparse::Status::Complete((length, fields))) => {
            let mut trailers = HeaderMap::with_capacity(fields.len());
            for field in fields.iter() {
                if !allowed_in_trailers(field.name.as_bytes()) {
                    continue;
                }
                let name = HeaderName::from_bytes(field.name.as_bytes())
                    .map_err(|_| invalid("invalid trailer name"))?;
                let value = HeaderValue::from_bytes(field.value)
                    .map_err(|_| invalid("invalid trailer value"))?;
                trailers.append(name, value);
            }
            buffer.advance(length);
            Ok(Decoded::Trailers(trailers))
        }
        Ok(httparse::Status::Partial) if buffer.len() < MAX_HEAD_BYTES => Ok(Decoded::More),
        Ok(httparse::Status::Partial) => Err(invalid("trailers too large")),
        Err(_) => Err(invalid("malformed trailers")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailers_keep_their_own_fields_and_drop_framing_routing_and_hop_by_hop_ones() {
        let mut block = BytesMut::from(
            &b"x-sum: 42\r\nConnection: close\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nTransfer-Encoding: chunked\r\nContent-Length: 40\r\nHost: elsewhere\r\nTrailer: x-sum\r\nUpgrade: h2c\r\nProxy-Connection: close\r\nGrpc-Status: 0\r\n\r\nnext"[..],
        );
        let Decoded::Trailers(trailers) = decode_trailers(&mut block).unwrap() else {
            panic!("trailers expected");
        };
        let names: Vec<_> = trailers.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-sum", "grpc-status"]);
        assert_eq!(&block[..], b"next", "the whole block is consumed");
        // Trailers written (those of an HTTP/2 peer) are held to the same rule.
        let mut written = HeaderMap::new();
        written.insert("x-sum", HeaderValue::from_static("42"));
        written.insert("content-length", HeaderValue::from_static("40"));
        written.insert("host", HeaderValue::from_static("elsewhere"));
        let mut out = Vec::new();
        append_last_chunk(&mut out, Some(&written));
        assert_eq!(out, b"0\r\nx-sum: 42\r\n\r\n");
    }

    #[tokio::test]
    async fn reads_grow_while_they_fill_and_an_idle_buffer_is_given_back() {
        // A large body arriving: each read fills what it was given, and the next asks for twice
        // as much, up to MAX_READ.
        let large = vec![b'x'; 512 * 1024];
        let mut reader = &large[..];
        let mut size = ReadSize::new();
        let mut buffer = ReadSize::buffer();
        let mut reads = Vec::new();
        for _ in 0..9 {
            let read = size.fill(&mut reader, &mut buffer).await.unwrap();
            reads.push(read);
            buffer.clear();
        }
        assert_eq!(reads[0], READ_BUFFER);
        assert!(reads.windows(2).all(|pair| pair[1] >= pair[0]), "{reads:?}");
        assert_eq!(*reads.last().unwrap(), MAX_READ, "{reads:?}");
        // Small events: the size halves back to the least.
        let small = [b'y'; 100];
        for _ in 0..8 {
            let mut reader = &small[..];
            assert_eq!(size.fill(&mut reader, &mut buffer).await.unwrap(), 100);
            buffer.clear();
        }
        assert_eq!(size.0 as usize, READ_BUFFER);
        // Empty and much larger than reads need: given back for a small one.
        assert!(buffer.capacity() > 2 * READ_BUFFER);
        size.shrink(&mut buffer);
        assert_eq!(buffer.capacity(), READ_BUFFER);
        // Never while it holds bytes.
        let mut holding = BytesMut::with_capacity(MAX_READ);
        holding.extend_from_slice(b"pipelined");
        size.shrink(&mut holding);
        assert!(holding.capacity() >= MAX_READ);
    }

    #[tokio::test]
    async fn vectored_writes_go_on_until_every_part_is_written() {
        // A pipe of 7 bytes: every write is partial, some end inside a part.
        let (mut near, mut far) = tokio::io::duplex(7);
        let reading = tokio::spawn(async move {
            let mut all = Vec::new();
            far.read_to_end(&mut all).await.unwrap();
            all
        });
        let mut parts = [
            io::IoSlice::new(b"5\r\n"),
            io::IoSlice::new(b""),
            io::IoSlice::new(b"hello"),
            io::IoSlice::new(b"\r\n0\r\n\r\n"),
        ];
        write_all_vectored(&mut near, &mut parts).await.unwrap();
        drop(near);
        assert_eq!(reading.await.unwrap(), b"5\r\nhello\r\n0\r\n\r\n");
    }

    fn decode_all(input: &[u8], split: usize) -> io::Result<(Vec<u8>, Option<HeaderMap>, bool)> {
        let mut state = Chunked::Size;
        let mut buffer = BytesMut::new();
        let mut body = Vec::new();
        let mut trailers = None;
        for piece in input.chunks(split.max(1)) {
            buffer.extend_from_slice(piece);
            loop {
                match decode_chunked(&mut state, &mut buffer)? {
                    Decoded::Data(data) => body.extend_from_slice(&data),
                    Decoded::Trailers(map) => {
                        trailers = Some(map);
                        return Ok((body, trailers, true));
                    }
                    Decoded::End => return Ok((body, trailers, true)),
                    Decoded::More => break,
                }
            }
        }
        Ok((body, trailers, false))
    }

    #[test]
    fn chunked_bodies_decode_however_they_are_split() {
        let input = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n";
        for split in 1..input.len() {
            let (body, trailers, ended) = decode_all(input, split).unwrap();
            assert_eq!(body, b"hello, world", "split {split}");
            assert!(trailers.is_none());
            assert!(ended);
        }
    }

    #[test]
    fn chunk_sizes_take_sixteen_digits_and_extensions() {
        for input in [
            &b"0000000000000005\r\nhello\r\n0\r\n\r\n"[..],
            b"5;name=value\r\nhello\r\n0\r\n\r\n",
            b"5 ; name=\"quoted value\"\r\nhello\r\n0\r\n\r\n",
            b"5\t;x\r\nhello\r\n0\r\n\r\n",
        ] {
            let (body, _, ended) = decode_all(input, input.len()).unwrap();
            assert_eq!(body, b"hello", "{}", String::from_utf8_lossy(input));
            assert!(ended);
        }
        assert_eq!(
            parse_chunk_size(b"7fffffffffffffff").unwrap(),
            i64::MAX as u64
        );
    }

    #[test]
    fn chunked_trailers_and_bare_line_feeds_are_read() {
        let input = b"3\nabc\n0\r\nx-checksum: 42\r\nx-other: y\r\n\r\n";
        for split in 1..input.len() {
            let (body, trailers, ended) = decode_all(input, split).unwrap();
            assert_eq!(body, b"abc");
            let trailers = trailers.expect("trailers");
            assert_eq!(trailers["x-checksum"], "42");
            assert_eq!(trailers["x-other"], "y");
            assert!(ended);
        }
    }

    #[test]
    fn malformed_chunked_bodies_are_errors() {
        for input in [
            &b"zz\r\n"[..],
            b"\r\n",
            b"+5\r\nhello\r\n0\r\n\r\n",
            b"3\r\nabcd\r\n0\r\n\r\n",
            // Past a signed 64-bit size.
            b"8000000000000000\r\n",
            b"10000000000000000\r\n",
            // A leading space, a bare CR in an extension, a size with no `;` before its
            // extension, `0x`, a control byte.
            b" 5\r\nhello\r\n0\r\n\r\n",
            b"5;a\rb\r\nhello\r\n0\r\n\r\n",
            b"5 x\r\nhello\r\n0\r\n\r\n",
            b"0x5\r\nhello\r\n0\r\n\r\n",
            b"5;a\x01\r\nhello\r\n0\r\n\r\n",
        ] {
            assert!(decode_all(input, input.len()).is_err(), "{input:?}");
        }
        let long_line = vec![b'1'; MAX_LINE_BYTES + 2];
        assert!(decode_all(&long_line, long_line.len()).is_err());
    }

    #[test]
    fn numbers_are_written_without_allocating() {
        for value in [0u64, 7, 10, 1234567890, u64::MAX] {
            assert_eq!(digits::<10>(value).as_bytes(), value.to_string().as_bytes());
            assert_eq!(
                digits::<16>(value).as_bytes(),
                format!("{:x}", value as usize).as_bytes()
            );
        }
    }
}
