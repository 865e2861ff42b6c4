//! Response bodies: the upstream body observed until its end, or a body the router wrote.
//!
//! [`ObservedBody`] passes every frame through untouched (so an SSE event reaches the client as
//! soon as the backend writes it) and finishes the request's [`Lease`] when the stream ends,
//! fails or is dropped: end of stream records a latency sample; an upstream error records an I/O
//! failure; a drop before the end (the client went away) records nothing but still releases the
//! backend.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::StatusCode;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use crate::backend::ErrorKind;
use crate::balancer::{Finish, Lease};

/// What the router answers with: a proxied body or one it wrote itself.
pub type ResponseBody = Either<ObservedBody, Full<Bytes>>;

pin_project_lite::pin_project! {
    /// An upstream response body that finishes its lease at end of stream.
    pub struct ObservedBody {
        #[pin]
        inner: Incoming,
        lease: Option<Lease>,
        status: StatusCode,
    }

    impl PinnedDrop for ObservedBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(lease) = this.lease.take() {
                if this.inner.is_end_stream() {
                    lease.finish(Finish { status: Some(*this.status), error: None });
                }
                // Otherwise the client left mid-response: no sample, the lease drop releases.
            }
        }
    }
}

impl ObservedBody {
    /// Wraps `inner`, finishing `lease` when it ends.
    pub fn new(inner: Incoming, lease: Lease, status: StatusCode) -> Self {
        Self {
            inner,
            lease: Some(lease),
            status,
        }
    }
}

impl Body for ObservedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let mut this = self.project();
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        let status = Some(*this.status);
        match &frame {
            Some(Ok(frame)) => {
                if let Some(lease) = this.lease.as_mut() {
                    if frame.is_data() {
                        lease.mark_first_byte();
                    }
                }
                if this.inner.is_end_stream() {
                    if let Some(lease) = this.lease.take() {
                        lease.finish(Finish {
                            status,
                            error: None,
                        });
                    }
                }
            }
            Some(Err(_)) => {
                if let Some(lease) = this.lease.take() {
                    lease.finish(Finish {
                        status,
                        error: Some(ErrorKind::Io),
                    });
                }
            }
            None => {
                if let Some(lease) = this.lease.take() {
                    lease.finish(Finish {
                        status,
                        error: None,
                    });
                }
            }
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
