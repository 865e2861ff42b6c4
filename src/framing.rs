//! Request-smuggling guard: spots HTTP/1 request heads that carry both `Transfer-Encoding` and
//! `Content-Length`.
//!
//! hyper resolves such a request by RFC 9112 §6.3 (chunked wins, `Content-Length` is dropped) and
//! closes the connection after it, but it does not say so to the service, and a front proxy that
//! read the other length would disagree about where the request ends. The router refuses them
//! instead: [`Inspected`] wraps a client connection, scans what hyper reads for request heads, and
//! raises a flag the service checks before routing (400).
//!
//! The scan follows the connection's framing as hyper does: a head is the block of lines up to
//! the first empty line (lines end with LF or CRLF; empty lines before a request line are
//! skipped), and a request with a `Content-Length` is followed by that many body bytes, passed
//! over without being looked at. After a head whose body length is not known that way (chunked,
//! or not a request head) every block that ends with an empty line is looked at, as a head would
//! be. A block longer than the header limit is not looked at (hyper refuses it anyway). An HTTP/2
//! connection (its preface opens the connection) is not scanned. Line ends are found with
//! `memchr`, and a head that arrives in one read is inspected where it lies, without a copy.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Set once a request head with conflicting framing was read on the connection.
#[derive(Debug, Default)]
pub struct Conflict(AtomicBool);

impl Conflict {
    /// Whether a conflicting head was seen.
    pub fn seen(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A connection whose incoming bytes are scanned for conflicting request framing.
#[derive(Debug)]
pub struct Inspected<S> {
    inner: S,
    /// Body bytes still to pass over (the last head's `Content-Length`).
    skip: u64,
    /// The current block so far, when it spans reads (up to `limit` bytes).
    block: Vec<u8>,
    /// Whether the current block has started (leading empty lines are not part of it).
    started: bool,
    /// Whether the current block went past `limit` (it is then not inspected).
    overflowed: bool,
    /// The current block's last two bytes, to find an empty line that spans reads.
    tail: [u8; 2],
    /// Bytes of the current block so far.
    length: usize,
    /// Whether no block was finished yet on this connection.
    first: bool,
    /// Nothing more to scan: a conflict was seen, or the connection speaks HTTP/2.
    done: bool,
    limit: usize,
    conflict: Arc<Conflict>,
}

/// What a finished block says about the bytes that follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// A request head with both lengths.
    Conflict,
    /// A request head with a body of this many bytes (0: none); a head follows it.
    Body(u64),
    /// Unknown framing (chunked body, or the block was no request head): look at every block.
    Blocks,
    /// The HTTP/2 preface: the connection is not HTTP/1.
    Http2,
}

impl<S> Inspected<S> {
    /// Wraps `inner`; blocks longer than `limit` bytes are not inspected.
    pub fn new(inner: S, limit: usize) -> (Self, Arc<Conflict>) {
        let conflict = Arc::new(Conflict::default());
        let inspected = Self {
            inner,
            skip: 0,
            block: Vec::new(),
            started: false,
            overflowed: false,
            tail: [0; 2],
            length: 0,
            first: true,
            done: false,
            limit,
            conflict: Arc::clone(&conflict),
        };
        (inspected, conflict)
    }

    fn scan(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while !self.done && !rest.is_empty() {
            if self.skip > 0 {
                let passed = rest
                    .len()
                    .min(usize::try_from(self.skip).unwrap_or(usize::MAX));
                self.skip -= passed as u64;
                rest = &rest[passed..];
                continue;
            }
            if !self.started {
                // Empty lines before a request line are ignored by the parser.
                let Some(start) = rest.iter().position(|&b| b != b'\r' && b != b'\n') else {
                    return;
                };
                rest = &rest[start..];
                self.started = true;
            }
            let Some(end) = block_end(self.tail, rest) else {
                self.extend(rest);
                return;
            };
            let next = if self.length == 0 {
                // The whole block is in this read: inspect it where it lies.
                (end <= self.limit).then(|| inspect(&rest[..end], self.first))
            } else {
                self.extend(&rest[..end]);
                (!self.overflowed).then(|| inspect(&self.block, self.first))
            };
            rest = &rest[end..];
            self.block.clear();
            self.started = false;
            self.overflowed = false;
            self.tail = [0; 2];
            self.length = 0;
            self.first = false;
            match next.unwrap_or(Next::Blocks) {
                Next::Conflict => {
                    self.conflict.0.store(true, Ordering::Relaxed);
                    self.done = true;
                }
                Next::Http2 => self.done = true,
                Next::Body(length) => self.skip = length,
                Next::Blocks => {}
            }
        }
    }

    /// Adds `bytes` to the current block, keeping at most `limit` bytes.
    fn extend(&mut self, bytes: &[u8]) {
        self.length = self.length.saturating_add(bytes.len());
        match bytes {
            [.., a, b] => self.tail = [*a, *b],
            [b] => self.tail = [self.tail[1], *b],
            [] => {}
        }
        if self.overflowed {
            return;
        }
        if self.length > self.limit {
            self.overflowed = true;
            self.block = Vec::new();
        } else {
            self.block.extend_from_slice(bytes);
        }
    }
}

/// Where the block ends in `bytes` (just after the line feed of its empty line), given the last
/// two bytes of the block before them (zeros at its start).
fn block_end(tail: [u8; 2], bytes: &[u8]) -> Option<usize> {
    let before = |at: usize, back: usize| -> u8 {
        match at.checked_sub(back) {
            Some(index) => bytes[index],
            None => tail[2 + at - back],
        }
    };
    memchr::memchr_iter(b'\n', bytes)
        .find(|&at| before(at, 1) == b'\n' || (before(at, 1) == b'\r' && before(at, 2) == b'\n'))
        .map(|at| at + 1)
}

/// What a finished block is: a request head (with conflicting framing or not, and its body's
/// length) or something else. `first`: the connection's first block.
fn inspect(block: &[u8], first: bool) -> Next {
    let mut start = 0;
    let mut lines = memchr::memchr_iter(b'\n', block).map(|end| {
        let line = &block[start..end];
        start = end + 1;
        line.strip_suffix(b"\r").unwrap_or(line)
    });
    let request_line = lines.next().unwrap_or(block);
    if first && request_line.starts_with(b"PRI * HTTP/2.0") {
        return Next::Http2;
    }
    let looks_like_request = memchr::memchr_iter(b' ', request_line).any(|at| {
        request_line
            .get(at + 1..at + 7)
            .is_some_and(|version| version.eq_ignore_ascii_case(b"HTTP/1"))
    });
    if !looks_like_request {
        return Next::Blocks;
    }
    let (mut transfer_encoding, mut content_lengths) = (false, 0);
    let mut length: Option<u64> = None;
    for line in lines {
        let (name, value) = match memchr::memchr(b':', line) {
            Some(colon) => (&line[..colon], &line[colon + 1..]),
            None => (line, &[][..]),
        };
        let name = name.trim_ascii();
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            transfer_encoding = true;
        } else if name.eq_ignore_ascii_case(b"content-length") {
            content_lengths += 1;
            length = parse_length(value.trim_ascii());
        }
    }
    match (transfer_encoding, content_lengths, length) {
        (true, 0, _) => Next::Blocks,
        (true, _, _) => Next::Conflict,
        (false, 0, _) => Next::Body(0),
        (false, 1, Some(length)) => Next::Body(length),
        // Several lengths, or one that is not a plain number: hyper refuses or resolves it.
        (false, _, _) => Next::Blocks,
    }
}

/// A `Content-Length` value made of digits only.
fn parse_length(value: &[u8]) -> Option<u64> {
    if value.is_empty() || value.len() > 19 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        value
            .iter()
            .fold(0u64, |n, &digit| n * 10 + u64::from(digit - b'0')),
    )
}

impl<S: AsyncRead + Unpin> AsyncRead for Inspected<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            self.scan(&buf.filled()[before..]);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Inspected<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_only_heads_with_both_lengths() {
        let both = b"POST / HTTP/1.1\r\nhost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(inspect(both, false), Next::Conflict);
        let chunked = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n";
        assert_eq!(inspect(chunked, false), Next::Blocks);
        let sized = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\n";
        assert_eq!(inspect(sized, false), Next::Body(5));
        let bodiless = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n";
        assert_eq!(inspect(bodiless, false), Next::Body(0));
        let not_a_request = b"transfer-encoding: x\r\ncontent-length: 1\r\n\r\n";
        assert_eq!(inspect(not_a_request, false), Next::Blocks);
        let two_lengths = b"POST / HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\n";
        assert_eq!(inspect(two_lengths, false), Next::Blocks);
    }

    fn flagged(chunks: &[&[u8]], limit: usize) -> bool {
        let (mut inspected, conflict) = Inspected::new((), limit);
        for chunk in chunks {
            inspected.scan(chunk);
        }
        conflict.seen()
    }

    const CONFLICTING: &[u8] =
        b"POST / HTTP/1.1\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n";

    #[test]
    fn a_long_body_does_not_hide_the_next_head() {
        let (mut inspected, conflict) = Inspected::new((), 128);
        inspected.scan(b"POST / HTTP/1.1\r\ncontent-length: 200\r\n\r\n");
        inspected.scan(&[b'a'; 300]);
        inspected.scan(b"\r\n\r\n");
        inspected
            .scan(b"POST / HTTP/1.1\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n");
        assert!(conflict.seen());
    }

    #[test]
    fn a_head_right_after_a_long_sized_body_is_inspected() {
        let head = b"POST / HTTP/1.1\r\ncontent-length: 1000\r\n\r\n";
        assert!(flagged(&[head, &[b'a'; 1000], CONFLICTING], 128));
        let mut whole = head.to_vec();
        whole.extend_from_slice(&[b'{'; 1000]);
        whole.extend_from_slice(CONFLICTING);
        assert!(flagged(&[&whole], 128));
    }

    #[test]
    fn a_sized_body_is_not_taken_for_a_head() {
        let mut request = format!(
            "POST / HTTP/1.1\r\ncontent-length: {}\r\n\r\n",
            CONFLICTING.len()
        )
        .into_bytes();
        request.extend_from_slice(CONFLICTING);
        assert!(!flagged(&[&request], 1024));
        request.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
        request.extend_from_slice(CONFLICTING);
        assert!(flagged(&[&request], 1024));
    }

    #[test]
    fn heads_split_anywhere_across_reads_are_inspected() {
        let mut stream =
            b"GET / HTTP/1.1\r\nhost: x\r\n\r\nPOST / HTTP/1.1\r\ncontent-length: 2\r\n\r\nab"
                .to_vec();
        stream.extend_from_slice(CONFLICTING);
        for first in 0..stream.len() {
            for second in first..stream.len() {
                let chunks = [&stream[..first], &stream[first..second], &stream[second..]];
                assert!(flagged(&chunks, 1024), "split at {first} and {second}");
            }
        }
        let harmless = &stream[..stream.len() - CONFLICTING.len()];
        for split in 0..harmless.len() {
            assert!(!flagged(&[&harmless[..split], &harmless[split..]], 1024));
        }
    }

    #[test]
    fn bare_line_feeds_and_leading_empty_lines_do_not_hide_a_head() {
        let lf = b"POST / HTTP/1.1\ncontent-length: 3\ntransfer-encoding: chunked\n\n";
        assert!(flagged(&[lf], 1024));
        let mut after_empty_lines = b"GET / HTTP/1.1\r\n\r\n\r\n\n".to_vec();
        after_empty_lines.extend_from_slice(CONFLICTING);
        assert!(flagged(&[&after_empty_lines], 1024));
    }

    #[test]
    fn a_head_longer_than_the_limit_is_not_inspected() {
        let mut long = b"POST / HTTP/1.1\r\nx-filler: ".to_vec();
        long.extend_from_slice(&[b'f'; 200]);
        long.extend_from_slice(b"\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n");
        assert!(!flagged(&[&long], 128));
        assert!(flagged(&[&long], 1024));
        assert!(flagged(&[&long[..100], &long[100..]], 1024));
    }

    #[test]
    fn an_http2_connection_is_not_scanned() {
        let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        assert!(!flagged(&[preface, CONFLICTING], 1024));
    }

    #[test]
    fn scans_across_reads_and_later_requests() {
        let (mut inspected, conflict) = Inspected::new((), 1024);
        inspected.scan(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n");
        assert!(!conflict.seen());
        inspected.scan(b"POST / HTTP/1.1\r\ncontent-len");
        inspected.scan(b"gth: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n");
        assert!(conflict.seen());
    }
}
