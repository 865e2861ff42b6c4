//! The write-stall timer both directions share: a write that waits `limit` with nothing taken
//! fails, so that a peer that stops reading (a client its answer, a backend its upload) does not
//! hold the exchange forever. The clock runs only while a write waits; the timer is made on the
//! first write that waits and set again on the next.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// A timer over the writes of one connection.
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
