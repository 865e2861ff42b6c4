//! Stream back: what the client gets. Either the backend's answer, streamed frame by frame in an
//! [`ObservedBody`] that finishes the lease at its end (hop-by-hop fields removed, the decision
//! headers added when on), or an answer the router wrote itself (a refusal, the 502/504 of a
//! failed last attempt), with the reason its access log record and span give.

use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::{Response, StatusCode, Version};
use http_body_util::Either;

use super::attempt::{Answered, Ended};
use crate::backend::{BackendAddr, ErrorKind};
use crate::balancer::Rejection;
use crate::body::BodyFailure;
use crate::forwarding::remove_hop_by_hop;
use crate::observed::{Observation, ObservedBody, ResponseBody};
use crate::response;

/// What the client gets.
// Built once per request and matched at once: boxing the response would allocate per request.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(super) enum Answer {
    /// The backend's response, streamed.
    Backend(Response<ObservedBody>),
    /// An answer the router wrote, and why (for the access log and the span).
    Router(Response<ResponseBody>, &'static str),
}

impl Answer {
    /// A `CONNECT`, which the router does not proxy.
    pub fn connect_not_allowed() -> Self {
        Answer::Router(response::connect_not_allowed(), "connect_not_allowed")
    }

    /// The body was streamed to an earlier attempt (never the case: a streamed body is not
    /// retried).
    pub fn body_already_sent() -> Self {
        let answer = response::error(StatusCode::BAD_GATEWAY, "request body already sent");
        Answer::Router(answer, "body_already_sent")
    }

    /// No attempt was made (`retry.max_attempts` is at least 1, so never the case).
    pub fn no_attempt_left() -> Self {
        let answer = response::error(StatusCode::BAD_GATEWAY, "no attempt left");
        Answer::Router(answer, "no_attempt_left")
    }

    /// A refusal of admission (503 with its reason).
    pub fn rejection(rejection: Rejection) -> Self {
        Answer::Router(response::rejection(rejection), response::reason(rejection))
    }

    /// The client's request body could not be read or sent.
    pub fn body_failure(failure: BodyFailure) -> Self {
        Answer::Router(response::body_failure(failure), failure.as_str())
    }

    /// The last attempt failed with `kind` on `backend`: 504 for a first-byte timeout, 502
    /// otherwise.
    pub fn failure(kind: ErrorKind, backend: &BackendAddr) -> Self {
        let status = if kind == ErrorKind::FirstByteTimeout {
            StatusCode::GATEWAY_TIMEOUT
        } else {
            StatusCode::BAD_GATEWAY
        };
        let message = format!(
            "upstream {} error for backend {backend}",
            kind.as_str().replace('_', " ")
        );
        Answer::Router(response::error(status, &message), kind.as_str())
    }

    /// The answer for an attempt on `backend` whose ending is final. `queued` is the time the
    /// request waited, when decision headers are on; `idle_timeout` bounds the body's stalls.
    pub fn of(
        ended: Ended,
        backend: &BackendAddr,
        queued: Option<Duration>,
        idle_timeout: Option<Duration>,
    ) -> Self {
        match ended {
            Ended::Answered(answered) => {
                let mut response = passed_on(answered, idle_timeout);
                if let Some(queued) = queued {
                    add_decision_headers(&mut response, backend, queued);
                }
                Answer::Backend(response)
            }
            Ended::Failed(kind) => Answer::failure(kind, backend),
            Ended::RequestBody(failure) => Answer::body_failure(failure),
        }
    }
}

/// The backend's answer as the client gets it: hop-by-hop fields removed, the router's own
/// protocol version, the body observed to its end.
fn passed_on(answered: Answered, idle_timeout: Option<Duration>) -> Response<ObservedBody> {
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
    if event_stream {
        lease.mark_streamed();
    }
    let status = parts.status;
    let mut body = ObservedBody::new(body, lease, status, retry_after);
    body.set_idle_timeout(idle_timeout);
    Response::from_parts(parts, body)
}

const X_CUSTOM_ROUTER_BACKEND: HeaderName = HeaderName::from_static("x-custom-router-backend");
const X_CUSTOM_ROUTER_QUEUE_MS: HeaderName = HeaderName::from_static("x-custom-router-queue-ms");

/// Says which backend answered and how long the request waited before it was dispatched (the
/// whole time since it was read, retries included).
fn add_decision_headers<B>(response: &mut Response<B>, backend: &BackendAddr, queued: Duration) {
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(backend.as_str()) {
        headers.insert(X_CUSTOM_ROUTER_BACKEND, value);
    }
    headers.insert(
        X_CUSTOM_ROUTER_QUEUE_MS,
        HeaderValue::from(queued.as_millis() as u64),
    );
}

/// Hands `answer` to the client: the backend's body carries the access log record and span to
/// its end; an answer of the router's finishes them now.
pub(super) fn stream_back(seen: Observation, answer: Answer) -> Response<ResponseBody> {
    match answer {
        Answer::Backend(mut response) => {
            response.body_mut().observe(seen);
            response.map(Either::Left)
        }
        Answer::Router(response, reason) => logged(seen, response, reason),
    }
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
