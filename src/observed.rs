//! The body of a proxied response, observed until its end ([`ObservedBody`]), and what the
//! router answers with ([`ResponseBody`]).
//!
//! [`ObservedBody`] passes every frame through untouched (so an SSE event reaches the client as
//! soon as the backend writes it) and finishes the request's [`Lease`] when the stream ends,
//! fails or is dropped: end of stream records a latency sample (and puts a pooled keep-alive
//! connection back); an upstream error records an I/O failure; a drop before the end (the client
//! went away) records nothing but still releases the backend, and closes the connection.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Full};
use tokio::time::Instant;

use crate::access_log;
use crate::backend::ErrorKind;
use crate::balancer::{Finish, Lease};
use crate::body::{BackendBody, BoxError, Pooled};
use crate::h1::StallTimer;
use crate::usage::UsageScan;

/// What the router answers with: a proxied body or one it wrote itself.
pub type ResponseBody = Either<ObservedBody, Full<Bytes>>;

impl crate::h1::server::Answer for ResponseBody {
    fn passthrough(&self) -> Option<&crate::h1::client::Passthrough> {
        match self {
            Either::Left(observed) => observed.passthrough(),
            Either::Right(_) => None,
        }
    }
}

/// An upstream response body that finishes its lease at end of stream.
#[derive(Debug)]
pub struct ObservedBody {
    inner: BackendBody,
    lease: Option<Lease>,
    // Status, `Retry-After` and the bytes relayed so far: how the lease will finish.
    outcome: Finish,
    idle: Option<StallTimer>,
    /// The request's access log record and trace span, finished when the body ends.
    seen: Observation,
    /// The answer's usage, looked for in its frames when the lease reads it.
    usage: Option<UsageScan>,
}

/// What is kept of a request for the access log and its trace, when either is on (both empty
/// otherwise: nothing is allocated).
#[derive(Debug, Default)]
pub struct Observation {
    /// The access log record.
    pub log: Option<Box<access_log::Pending>>,
    /// The server span.
    pub span: Option<Box<crate::traces::RequestSpan>>,
}

impl Observation {
    /// The response body's first byte came now.
    pub fn first_byte(&mut self) {
        if let Some(log) = self.log.as_mut() {
            log.first_byte();
        }
    }

    /// The response ended with `status` and `bytes` of body; `reason` says why the router
    /// answered itself, or how the body failed.
    pub fn finish(mut self, status: u16, bytes: u64, reason: Option<&'static str>) {
        if let Some(log) = self.log.take() {
            log.finish(status, bytes, reason);
        }
        if let Some(span) = self.span.take() {
            span.finish(status, bytes, reason);
        }
    }
}

/// The status an access log line and a span give a request whose client left before its
/// answer's head (nginx's 499), with the reason `client_gone`.
pub const CLIENT_GONE: u16 = 499;

impl Drop for Observation {
    fn drop(&mut self) {
        // Dropped unfinished: the client left before the answer's head (while its request was
        // queued or its backend had not answered), and the proxy's future went with it.
        if let Some(log) = self.log.take() {
            log.finish(CLIENT_GONE, 0, Some("client_gone"));
        }
        if let Some(span) = self.span.take() {
            span.finish(CLIENT_GONE, 0, Some("client_gone"));
        }
    }
}

impl Drop for ObservedBody {
    fn drop(&mut self) {
        // Dropped before its end: the client left mid-response. The backend's answer is counted
        // (its status class, its duration so far) but no sample goes to the strategy, and the
        // lease's own drop releases the backend.
        if self.inner.is_end_stream() {
            finish_at_end(&mut self.lease, &mut self.inner, self.outcome);
        } else if let Some(lease) = self.lease.take() {
            lease.client_left(self.outcome.status);
        }
        self.write_log();
    }
}

/// Finishes the lease (once) with `outcome`.
fn finish(lease: &mut Option<Lease>, outcome: Finish) {
    if let Some(lease) = lease.take() {
        lease.finish(outcome);
    }
}

/// The body was read to its end: puts the connection back on its backend's idle stack (before
/// the lease lets a queued request go, so that request finds it), then finishes the lease.
fn finish_at_end(lease: &mut Option<Lease>, body: &mut BackendBody, outcome: Finish) {
    let Some(lease) = lease.take() else { return };
    // One reading of the clock serves the idle connection and the lease.
    let now = Instant::now();
    if let Some(connection) = body.take_connection() {
        lease.backend().connections().put(connection, now);
    }
    lease.finish_at(outcome, now);
}

impl ObservedBody {
    /// A plain-HTTP backend's field lines, when they were left as lines.
    pub fn passthrough(&self) -> Option<&crate::h1::client::Passthrough> {
        self.inner.passthrough()
    }

    /// Wraps `inner`, finishing `lease` when it ends; a pooled connection goes back to the
    /// backend's idle connections if the body is read to its end.
    pub fn new(
        inner: BackendBody,
        lease: Lease,
        status: StatusCode,
        retry_after: Option<Duration>,
    ) -> Self {
        let usage = lease.reads_usage().then(UsageScan::default);
        Self {
            inner,
            lease: Some(lease),
            outcome: Finish {
                status: Some(status),
                error: None,
                retry_after,
                bytes: 0,
                usage: None,
            },
            idle: None,
            seen: Observation::default(),
            usage,
        }
    }

    /// Finishes `seen` when the body ends, fails or is dropped.
    pub fn observe(&mut self, seen: Observation) {
        self.seen = seen;
    }

    fn write_log(&mut self) {
        let seen = std::mem::take(&mut self.seen);
        if seen.log.is_some() || seen.span.is_some() {
            let status = self.outcome.status.map_or(0, |status| status.as_u16());
            let failure = self.outcome.error.map(ErrorKind::as_str);
            seen.finish(status, self.outcome.bytes, failure);
        }
    }

    /// Fails the body when the backend sends nothing for `timeout` (`None`: no limit).
    pub fn set_idle_timeout(&mut self, timeout: Option<Duration>) {
        self.idle = timeout.map(StallTimer::new);
    }
}

impl Body for ObservedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) else {
            if this.idle.as_mut().is_some_and(|idle| idle.stalled(cx)) {
                this.idle = None;
                this.outcome.error = Some(ErrorKind::IdleTimeout);
                this.outcome.retry_after = None;
                finish(&mut this.lease, this.outcome);
                let error = std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the backend sent nothing for upstream_idle_timeout",
                );
                return Poll::Ready(Some(Err(Box::new(error))));
            }
            return Poll::Pending;
        };
        if let Some(idle) = this.idle.as_mut() {
            idle.progressed();
        }
        if let Some(Ok(frame)) = frame.as_ref() {
            if frame.is_data() {
                this.seen.first_byte();
            }
        }
        match &frame {
            Some(Ok(frame)) => {
                let end = this.inner.is_end_stream();
                if let (Some(lease), Some(data)) = (this.lease.as_mut(), frame.data_ref()) {
                    // A body that ends here has its first byte noted by the lease's end.
                    if !end {
                        lease.mark_first_byte();
                    }
                    this.outcome.bytes += data.len() as u64;
                    if let Some(scan) = this.usage.as_mut() {
                        scan.frame(data);
                        this.outcome.usage = scan.usage();
                    }
                }
                if end {
                    finish_at_end(&mut this.lease, &mut this.inner, this.outcome);
                }
            }
            Some(Err(_)) => {
                this.outcome.error = Some(ErrorKind::Io);
                this.outcome.retry_after = None;
                finish(&mut this.lease, this.outcome);
            }
            None => finish_at_end(&mut this.lease, &mut this.inner, this.outcome),
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
