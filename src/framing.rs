//! Request-smuggling guard: spots HTTP/1 request heads that carry both `Transfer-Encoding` and
//! `Content-Length`.
//!
//! hyper resolves such a request by RFC 9112 §6.3 (chunked wins, `Content-Length` is dropped) and
//! closes the connection after it, but it does not say so to the service, and a front proxy that
//! read the other length would disagree about where the request ends. The router refuses them
//! instead: [`Inspected`] wraps a client connection, scans what hyper reads for request heads, and
//! raises a flag the service checks before routing (400). The scan looks at each block of lines
//! that ends with an empty line and starts with a request line; a block longer than the header
//! limit is not looked at (hyper refuses it anyway).

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
    /// The current block of lines, up to `limit` bytes.
    block: Vec<u8>,
    /// Whether the current block went past `limit` (it is then not inspected).
    overflowed: bool,
    /// The last four bytes read, to find the empty line that ends a block.
    tail: u32,
    limit: usize,
    conflict: Arc<Conflict>,
}

impl<S> Inspected<S> {
    /// Wraps `inner`; blocks longer than `limit` bytes are not inspected.
    pub fn new(inner: S, limit: usize) -> (Self, Arc<Conflict>) {
        let conflict = Arc::new(Conflict::default());
        let inspected = Self {
            inner,
            block: Vec::new(),
            overflowed: false,
            tail: 0,
            limit,
            conflict: Arc::clone(&conflict),
        };
        (inspected, conflict)
    }

    fn scan(&mut self, bytes: &[u8]) {
        if self.conflict.seen() {
            return;
        }
        const END_OF_BLOCK: u32 = u32::from_be_bytes(*b"\r\n\r\n");
        for &byte in bytes {
            self.tail = (self.tail << 8) | u32::from(byte);
            if self.block.len() < self.limit {
                self.block.push(byte);
            } else {
                self.overflowed = true;
            }
            if self.tail == END_OF_BLOCK {
                if !self.overflowed && has_conflicting_framing(&self.block) {
                    self.conflict.0.store(true, Ordering::Relaxed);
                    return;
                }
                self.block.clear();
                self.overflowed = false;
            }
        }
    }
}

/// Whether `block` is a request head with both `Transfer-Encoding` and `Content-Length`.
fn has_conflicting_framing(block: &[u8]) -> bool {
    let mut lines = block.split(|&b| b == b'\n');
    let Some(request_line) = lines.next() else {
        return false;
    };
    let looks_like_request = request_line
        .windows(7)
        .any(|window| window.eq_ignore_ascii_case(b" HTTP/1"));
    if !looks_like_request {
        return false;
    }
    let (mut transfer_encoding, mut content_length) = (false, false);
    for line in lines {
        let name = line.split(|&b| b == b':').next().unwrap_or_default();
        transfer_encoding |= name.trim_ascii().eq_ignore_ascii_case(b"transfer-encoding");
        content_length |= name.trim_ascii().eq_ignore_ascii_case(b"content-length");
    }
    transfer_encoding && content_length
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
        assert!(has_conflicting_framing(both));
        let chunked = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n";
        assert!(!has_conflicting_framing(chunked));
        let sized = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\n";
        assert!(!has_conflicting_framing(sized));
        let not_a_request = b"transfer-encoding: x\r\ncontent-length: 1\r\n\r\n";
        assert!(!has_conflicting_framing(not_a_request));
    }

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
    fn scans_across_reads_and_later_requests() {
        let (mut inspected, conflict) = Inspected::new((), 1024);
        inspected.scan(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n");
        assert!(!conflict.seen());
        inspected.scan(b"POST / HTTP/1.1\r\ncontent-len");
        inspected.scan(b"gth: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n");
        assert!(conflict.seen());
    }
}
