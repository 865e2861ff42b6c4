//! The watch over an HTTP/2 (h2c) connection served by hyper, which has no timeouts of its own
//! for a client that stops reading or stays connected with nothing to ask:
//!
//! - **Send stall.** hyper polls a stream's answer only while the client's flow-control windows
//!   have room, so a client that stops reading a stream holds its answer, and the backend slot
//!   behind it, for as long as it keeps the connection. A stream whose answer yielded a frame
//!   that the connection has not taken on from for `limits.send_timeout` closes the whole
//!   connection (as nginx's `send_timeout` closes an HTTP/2 connection).
//! - **Idle.** A connection with no stream open for `limits.header_read_timeout` is told GOAWAY
//!   and closed once the client has seen it, as an idle HTTP/1 keep-alive connection is closed
//!   after that time.
//! - **Spent.** A connection that opened [`MAX_STREAMS`] streams is told GOAWAY (its open
//!   streams finish; the client goes on over a new connection); one that opens as many again
//!   (it never read the GOAWAY) is dropped.
//! - **After GOAWAY.** A connection told GOAWAY (idle, or draining) with no stream open is
//!   dropped once the shorter of the two timeouts has passed, whether or not the client acked
//!   the GOAWAY's PING or took the last bytes of an answer h2 still buffers: a client that never
//!   reads does not keep its connection slot, nor a drain waiting.
//!
//! The watch is one timer per connection, checking every tenth of the shorter of the two
//! timeouts; each stream costs a lock to register and a clock read per answer frame.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

/// The clock of a stream whose answer is not waiting on the connection.
const NOT_WAITING: u64 = u64::MAX;

/// The streams of one connection, as the watch sees them.
#[derive(Debug)]
pub(super) struct Streams {
    /// When the connection started: the clocks below count milliseconds from it.
    epoch: Instant,
    /// The open streams' clocks; a clock whose stream has ended is pruned at the next check.
    open: Mutex<Vec<Arc<StreamClock>>>,
    /// When a stream last opened or ended.
    last_change_ms: AtomicU64,
    /// Streams opened so far.
    opened: AtomicU64,
    /// Told when [`MAX_STREAMS`] streams have opened.
    spent: tokio::sync::Notify,
    /// Told when twice [`MAX_STREAMS`] have: a client that went on opening streams after the
    /// GOAWAY (it never read it) is dropped.
    overrun: tokio::sync::Notify,
}

/// Streams one connection may open before it is told GOAWAY (nginx's `keepalive_requests`,
/// 1000): a client that opens and resets streams without end (CVE-2023-44487, each one
/// dispatched to a backend before its reset) starts a new connection every thousand.
pub(super) const MAX_STREAMS: u64 = 1000;

/// Streams a client may have open at once on one connection (`SETTINGS_MAX_CONCURRENT_STREAMS`,
/// nginx's `http2_max_concurrent_streams`); one more is refused (`REFUSED_STREAM`, which a
/// client may retry, RFC 9113 §8.7).
pub(super) const MAX_CONCURRENT_STREAMS: u32 = 128;

/// One stream's answer: since when its last frame has waited for the connection to take on.
#[derive(Debug)]
struct StreamClock {
    /// When the answer's last frame started waiting (milliseconds from the connection's start),
    /// or [`NOT_WAITING`].
    waiting_since_ms: AtomicU64,
}

/// What a check of the connection found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Streams progress, or the connection has not been idle long.
    Fine,
    /// No stream open for the idle timeout.
    Idle,
    /// A stream's answer waited for the send timeout with nothing taken.
    Stalled,
}

impl Streams {
    /// A connection's streams, none opened yet; its clocks count from now.
    pub(super) fn new() -> Self {
        Self {
            epoch: Instant::now(),
            open: Mutex::new(Vec::new()),
            last_change_ms: AtomicU64::new(0),
            opened: AtomicU64::new(0),
            spent: tokio::sync::Notify::new(),
            overrun: tokio::sync::Notify::new(),
        }
    }

    /// Returns once twice [`MAX_STREAMS`] streams have opened: the GOAWAY went unheeded.
    pub(super) async fn overrun(&self) {
        self.overrun.notified().await;
    }

    /// Returns once [`MAX_STREAMS`] streams have opened on the connection.
    pub(super) async fn spent(&self) {
        self.spent.notified().await;
    }

    /// Milliseconds since the connection started.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(NOT_WAITING - 1)
    }

    /// A stream opens; it counts as open until the returned guard is dropped.
    pub(super) fn open(self: &Arc<Self>) -> StreamGuard {
        match self.opened.fetch_add(1, Ordering::Relaxed) + 1 {
            MAX_STREAMS => self.spent.notify_one(),
            n if n == 2 * MAX_STREAMS => self.overrun.notify_one(),
            _ => {}
        }
        let clock = Arc::new(StreamClock {
            waiting_since_ms: AtomicU64::new(NOT_WAITING),
        });
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(Arc::clone(&clock));
        self.last_change_ms.store(self.now_ms(), Ordering::Relaxed);
        StreamGuard {
            streams: Arc::clone(self),
            clock,
        }
    }

    /// Whether a stream stalled past `send_timeout`, or no stream has been open for `idle`.
    pub(super) fn check(&self, send_timeout: Duration, idle: Duration) -> Verdict {
        let now = self.now_ms();
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        open.retain(|clock| Arc::strong_count(clock) > 1);
        let send_timeout = millis(send_timeout);
        let stalled = open.iter().any(|clock| {
            let since = clock.waiting_since_ms.load(Ordering::Relaxed);
            since != NOT_WAITING && now.saturating_sub(since) >= send_timeout
        });
        if stalled {
            return Verdict::Stalled;
        }
        let quiet = now.saturating_sub(self.last_change_ms.load(Ordering::Relaxed));
        if open.is_empty() && quiet >= millis(idle) {
            return Verdict::Idle;
        }
        Verdict::Fine
    }

    /// Whether no stream is open (the answers of ended ones may still sit in the connection's
    /// buffers).
    pub(super) fn none_open(&self) -> bool {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        open.retain(|clock| Arc::strong_count(clock) > 1);
        open.is_empty()
    }
}

/// `duration` in whole milliseconds.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// How often the watch checks a connection held to these timeouts.
pub(super) fn check_period(send_timeout: Duration, idle: Duration) -> Duration {
    (send_timeout.min(idle) / 10).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// An open stream, from its request until its answer is dropped.
#[derive(Debug)]
pub(super) struct StreamGuard {
    /// The connection's streams, told when this one ends.
    streams: Arc<Streams>,
    /// This stream's clock (in the connection's list while this guard holds it).
    clock: Arc<StreamClock>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.streams
            .last_change_ms
            .store(self.streams.now_ms(), Ordering::Relaxed);
    }
}

/// A stream's answer, watched: a frame it yields starts the stream's clock, which stops when
/// hyper polls for the next one (hyper does so once the client's windows take the frame).
#[derive(Debug)]
pub(super) struct Watched<B> {
    /// The answer's body.
    body: B,
    /// Its stream, open until the answer is dropped.
    stream: StreamGuard,
}

impl<B> Watched<B> {
    /// `body`, the answer of `stream`, watched.
    pub(super) fn new(body: B, stream: StreamGuard) -> Self {
        Self { body, stream }
    }
}

impl<B: Body + Unpin> Body for Watched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.get_mut();
        let clock = &this.stream.clock.waiting_since_ms;
        clock.store(NOT_WAITING, Ordering::Relaxed);
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled {
            clock.store(this.stream.streams.now_ms(), Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEND: Duration = Duration::from_secs(60);
    const IDLE: Duration = Duration::from_secs(10);

    /// An answer of `frames` frames, each ready at once.
    struct Frames(usize);

    impl Body for Frames {
        type Data = bytes::Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<bytes::Bytes>, Self::Error>>> {
            if self.0 == 0 {
                return Poll::Ready(None);
            }
            self.0 -= 1;
            Poll::Ready(Some(Ok(Frame::data(bytes::Bytes::from_static(b"x")))))
        }
    }

    fn poll<B: Body + Unpin>(body: &mut B) {
        let waker = std::task::Waker::noop();
        let _ = Pin::new(body).poll_frame(&mut Context::from_waker(waker));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_whose_frame_is_not_taken_on_for_the_send_timeout_stalls_the_connection() {
        let streams = Arc::new(Streams::new());
        let mut answer = Watched::new(Frames(3), streams.open());
        poll(&mut answer);
        tokio::time::advance(SEND - Duration::from_millis(1)).await;
        assert_eq!(streams.check(SEND, IDLE), Verdict::Fine);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(streams.check(SEND, IDLE), Verdict::Stalled);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_polled_again_is_not_waiting_however_slow_its_backend() {
        let streams = Arc::new(Streams::new());
        let mut answer = Watched::new(Frames(3), streams.open());
        poll(&mut answer);
        tokio::time::advance(SEND / 2).await;
        // The connection took the frame on and asks for the next: from here on the wait is the
        // backend's, not the client's.
        poll(&mut answer);
        tokio::time::advance(SEND / 2).await;
        assert_eq!(streams.check(SEND, IDLE), Verdict::Fine);
        // Its last frame taken on, the answer polled to its end: nothing waits, for any time.
        poll(&mut answer);
        poll(&mut answer);
        tokio::time::advance(SEND * 3).await;
        assert_eq!(streams.check(SEND, IDLE), Verdict::Fine);
    }

    #[tokio::test(start_paused = true)]
    async fn one_stalled_stream_among_progressing_ones_is_found() {
        let streams = Arc::new(Streams::new());
        let mut stalled = Watched::new(Frames(2), streams.open());
        let mut moving = Watched::new(Frames(1000), streams.open());
        poll(&mut stalled);
        for _ in 0..60 {
            tokio::time::advance(Duration::from_secs(1)).await;
            poll(&mut moving);
        }
        assert_eq!(streams.check(SEND, IDLE), Verdict::Stalled);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_once_no_stream_was_open_for_the_idle_timeout() {
        let streams = Arc::new(Streams::new());
        tokio::time::advance(IDLE - Duration::from_millis(1)).await;
        assert_eq!(streams.check(SEND, IDLE), Verdict::Fine);
        // A stream open for any time is not idle.
        let answer = Watched::new(Frames(1), streams.open());
        tokio::time::advance(IDLE * 5).await;
        assert_eq!(streams.check(SEND, IDLE), Verdict::Fine);
        // Idle counts from the end of the last stream.
        drop(answer);
        tokio::time::advance(IDLE - Duration::from_millis(1)).await;
        assert_eq!(streams.check(SEND, IDLE), Verdict::Fine);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(streams.check(SEND, IDLE), Verdict::Idle);
        // A stalled answer that was dropped (its stream reset) stalls nothing.
        let mut reset = Watched::new(Frames(2), streams.open());
        poll(&mut reset);
        drop(reset);
        tokio::time::advance(SEND).await;
        assert_eq!(streams.check(SEND, IDLE), Verdict::Idle);
    }

    #[test]
    fn the_check_period_is_a_tenth_of_the_shorter_timeout_within_bounds() {
        assert_eq!(check_period(SEND, IDLE), Duration::from_secs(1));
        assert_eq!(
            check_period(Duration::from_millis(500), IDLE),
            Duration::from_millis(50)
        );
        assert_eq!(
            check_period(Duration::from_millis(20), IDLE),
            Duration::from_millis(10)
        );
    }
}
