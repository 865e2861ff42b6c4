//! Stream back: what the client gets. Either the backend's answer, streamed frame by frame in an
//! [`ObservedBody`] that finishes the lease at its end (hop-by-hop fields removed, the decision
//! headers added when on), or an answer the router writes itself ([`RouterAnswer`]: a refusal,
//! the 502/504 of a failed last attempt), with the reason its access log record and span give.
//!
//! The client's response is built once, where the request's last phase ends: the phases before
//! hand back a small [`RouterAnswer`] or the attempt's [`Ended`], not a response that each layer
//! would move again.

use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode, Version};
use http_body_util::Either;

use super::attempt::{Answered, Ended};
use crate::backend::{Backend, BackendAddr, ErrorKind};
use crate::balancer::Rejection;
use crate::body::BodyFailure;
use crate::forwarding::remove_hop_by_hop;
use crate::observed::{Observation, ObservedBody, ResponseBody};
use crate::response;

/// An answer the router writes itself, as the phase that decides it hands it back; its response
/// is written only once it is the client's ([`RouterAnswer::respond`]).
#[derive(Debug)]
pub(super) enum RouterAnswer {
    /// A `CONNECT`, which the router does not proxy.
    ConnectNotAllowed,
    /// The client's request body could not be read or sent.
    BodyFailure(BodyFailure),
    /// A refusal of admission (503 with its reason).
    Rejection(Rejection),
    /// The last attempt failed with this kind on this backend: 504 for a first-byte timeout,
    /// 502 otherwise.
    Failure(ErrorKind, Arc<Backend>),
    /// The body was streamed to an earlier attempt (never the case: a streamed body is not
    /// retried).
    BodyAlreadySent,
    /// No attempt was made (`retry.max_attempts` is at least 1, so never the case).
    NoAttemptLeft,
}

impl RouterAnswer {
    /// The response the client gets; the access log record and span are finished now, with the
    /// answer's reason.
    pub fn respond(self, seen: Observation) -> Response<ResponseBody> {
        let (answer, reason) = self.response();
        logged(seen, answer, reason)
    }

    /// The response and its reason.
    fn response(self) -> (Response<ResponseBody>, &'static str) {
        match self {
            RouterAnswer::ConnectNotAllowed => {
                (response::connect_not_allowed(), "connect_not_allowed")
            }
            RouterAnswer::BodyFailure(failure) => {
                (response::body_failure(failure), failure.as_str())
            }
            RouterAnswer::Rejection(rejection) => {
                (response::rejection(rejection), response::reason(rejection))
            }
            RouterAnswer::Failure(kind, backend) => (failure(kind, backend.addr()), kind.as_str()),
            RouterAnswer::BodyAlreadySent => (
                response::error(StatusCode::BAD_GATEWAY, "request body already sent"),
                "body_already_sent",
            ),
            RouterAnswer::NoAttemptLeft => (
                response::error(StatusCode::BAD_GATEWAY, "no attempt left"),
                "no_attempt_left",
            ),
        }
    }
}

/// The answer to a last attempt that failed with `kind` on `backend`: 504 for a first-byte
/// timeout, 502 otherwise.
fn failure(kind: ErrorKind, backend: &BackendAddr) -> Response<ResponseBody> {
    let status = if kind == ErrorKind::FirstByteTimeout {
        StatusCode::GATEWAY_TIMEOUT
    } else {
        StatusCode::BAD_GATEWAY
    };
    let message = format!(
        "upstream {} error for backend {backend}",
        kind.as_str().replace('_', " ")
    );
    response::error(status, &message)
}

/// The client's response to an attempt on `backend` whose ending is final. `queued` is the time
/// the request waited, when decision headers are on; `idle_timeout` bounds the body's stalls.
/// The backend's body carries the access log record and span to its end; an answer of the
/// router's finishes them now.
pub(super) fn of(
    ended: Ended,
    backend: Arc<Backend>,
    queued: Option<Duration>,
    idle_timeout: Option<Duration>,
    seen: Observation,
) -> Response<ResponseBody> {
    match ended {
        Ended::Answered(answered) => {
            passed_on(answered, backend.addr(), queued, idle_timeout, seen)
        }
        Ended::Failed(kind) => RouterAnswer::Failure(kind, backend).respond(seen),
        Ended::RequestBody(failure) => RouterAnswer::BodyFailure(failure).respond(seen),
    }
}

/// The backend's answer as the client gets it: hop-by-hop fields removed, the router's own
/// protocol version, the decision headers when on, the body observed to its end.
fn passed_on(
    answered: Answered,
    backend: &BackendAddr,
    queued: Option<Duration>,
    idle_timeout: Option<Duration>,
    seen: Observation,
) -> Response<ResponseBody> {
    let Answered {
        mut parts,
        body,
        mut lease,
        retry_after,
        event_stream,
        ..
    } = answered;
    remove_hop_by_hop(&mut parts.headers);
    // The client gets the router's own protocol version, whatever the backend spoke.
    parts.version = Version::default();
    if let Some(queued) = queued {
        add_decision_headers(&mut parts.headers, backend, queued);
    }
    if event_stream {
        lease.mark_streamed();
    }
    let mut body = ObservedBody::new(body, lease, parts.status, retry_after);
    body.set_idle_timeout(idle_timeout);
    body.observe(seen);
    Response::from_parts(parts, Either::Left(body))
}

const X_CUSTOM_ROUTER_BACKEND: HeaderName = HeaderName::from_static("x-custom-router-backend");
const X_CUSTOM_ROUTER_QUEUE_MS: HeaderName = HeaderName::from_static("x-custom-router-queue-ms");

/// Says which backend answered and how long the request waited before it was dispatched (the
/// whole time since it was read, retries included).
fn add_decision_headers(headers: &mut HeaderMap, backend: &BackendAddr, queued: Duration) {
    if let Ok(value) = HeaderValue::from_str(backend.as_str()) {
        headers.insert(X_CUSTOM_ROUTER_BACKEND, value);
    }
    headers.insert(
        X_CUSTOM_ROUTER_QUEUE_MS,
        HeaderValue::from(queued.as_millis() as u64),
    );
}

/// Finishes the access log record and span of an answer the router wrote itself, for `reason`.
fn logged(
    seen: Observation,
    answer: Response<ResponseBody>,
    reason: &'static str,
) -> Response<ResponseBody> {
    if seen.log.is_some() || seen.span.is_some() {
        let bytes = http_body::Body::size_hint(answer.body())
            .exact()
            .unwrap_or(0);
        seen.finish(answer.status().as_u16(), bytes, Some(reason));
    }
    answer
}
