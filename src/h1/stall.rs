//! The stall timers, both directions: [`StallTimer`] for a body the router reads (a request
//! body from a client, an answer's body from a backend) that stops coming, [`WriteStall`] for a
//! write the peer takes nothing of (a client its answer, a backend its upload), so that a peer
//! that stops sending or reading does not hold the exchange forever.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// A body's idle timeout: fires when nothing came for `timeout` since the last progress. The
/// timer is made on the body's first wait (a body ready at once never makes one) and moved only
/// when it fires, not on every frame.
#[derive(Debug)]
pub struct StallTimer {
    timeout: Duration,
    progress_at: Option<tokio::time::Instant>,
    sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl StallTimer {
    /// A timer for `timeout`; progress is counted from the first wait.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            progress_at: None,
            sleep: None,
        }
    }

    /// Something came: the wait starts again from now (the clock is read only once the body has
    /// waited).
    pub fn progressed(&mut self) {
        if self.sleep.is_some() {
            self.progress_at = Some(tokio::time::Instant::now());
        }
    }

    /// Whether nothing came for the timeout (registers the wake-up otherwise).
    pub fn stalled(&mut self, cx: &mut Context<'_>) -> bool {
        let progress_at = *self
            .progress_at
            .get_or_insert_with(tokio::time::Instant::now);
        let deadline = progress_at + self.timeout;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        loop {
            if sleep.as_mut().poll(cx).is_pending() {
                return false;
            }
            if sleep.deadline() >= deadline {
                return true;
            }
            // Progress came since the timer was set: it waits on from the last of it.
            sleep.as_mut().reset(deadline);
        }
    }
}

/// A timer over the writes of one connection: a write that waits `limit` with nothing taken
/// fails. The clock runs only while a write waits; the timer is made on the first write that
/// waits and set again on the next.
pub struct WriteStall {
    limit: Duration,
    /// What the error says when the limit passes.
    message: &'static str,
    /// Whether the last write waited and nothing was taken since.
    waiting: bool,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WriteStall {
    /// A timer failing writes that wait `limit`, with `message` as the error.
    pub fn new(limit: Duration, message: &'static str) -> Self {
        Self {
            limit,
            message,
            waiting: false,
            sleep: None,
        }
    }

    /// `written` as it is, unless the writes have waited `limit` with nothing taken: then a
    /// `TimedOut` error.
    pub fn bounded<T>(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if written.is_ready() {
            self.waiting = false;
            return written;
        }
        if !self.waiting {
            self.waiting = true;
            let deadline = tokio::time::Instant::now() + self.limit;
            match self.sleep.as_mut() {
                Some(sleep) => sleep.as_mut().reset(deadline),
                None => self.sleep = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        let expired = self
            .sleep
            .as_mut()
            .is_some_and(|sleep| sleep.as_mut().poll(cx).is_ready());
        if expired {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, self.message)));
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waited(stall: &mut WriteStall) -> Poll<io::Result<()>> {
        let waker = std::task::Waker::noop();
        stall.bounded(&mut Context::from_waker(waker), Poll::Pending)
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_time_a_write_waits_counts() {
        let mut stall = WriteStall::new(Duration::from_secs(1), "stalled");
        assert!(waited(&mut stall).is_pending());
        tokio::time::advance(Duration::from_millis(900)).await;
        assert!(waited(&mut stall).is_pending());
        // Progress: the clock starts again at the next wait.
        let waker = std::task::Waker::noop();
        let taken = stall.bounded(&mut Context::from_waker(waker), Poll::Ready(Ok(())));
        assert!(matches!(taken, Poll::Ready(Ok(()))));
        assert!(waited(&mut stall).is_pending());
        tokio::time::advance(Duration::from_millis(900)).await;
        assert!(waited(&mut stall).is_pending());
        tokio::time::advance(Duration::from_millis(100)).await;
        match waited(&mut stall) {
            Poll::Ready(Err(error)) => {
                assert_eq!(error.kind(), io::ErrorKind::TimedOut);
                assert_eq!(error.to_string(), "stalled");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
}
