//! One attempt, in three phases. Dispatch: the access log and span note the backend chosen,
//! the retry and the dispatch are counted. Send: the request goes to the leased backend, its
//! response head awaited within `upstream.first_byte_timeout`. Classify: how the attempt ended
//! ([`Ended`]), judged once ([`Class`]); a failure is recorded on the lease at once, an answer
//! keeps its lease until the retry decision says whether it is passed on or set aside.

use std::time::Duration;

use http::Response;
use http::header::{self, HeaderValue};
use http::response::Parts;

use super::retry::{Decision, Ending};
use crate::backend::ErrorKind;
use crate::balancer::{Balancer, Finish, Lease};
use crate::body::{BackendBody, BodyFailure, Pooled, UpstreamBody};
use crate::classify::Class;
use crate::forwarding::RequestHead;
use crate::metrics::RetryReason;
use crate::observed::Observation;
use crate::pool::Failure;
use crate::strategy::RequestInfo;
use crate::traces::{AttemptSpan, RequestSpan};
use crate::upstream::UpstreamClient;

/// Attempt `number` of the request `info` describes leaves on `lease`: noted in the access log
/// and span (the span's `traceparent` set on `head`), its retry (`retry`, if it is one) and
/// dispatch counted. Returns the attempt's span, when traces are on.
pub(super) fn dispatch(
    balancer: &Balancer,
    info: &RequestInfo,
    head: &mut RequestHead,
    lease: &Lease,
    number: u32,
    seen: &mut Observation,
    retry: Option<RetryReason>,
) -> Option<Box<AttemptSpan>> {
    let uncached_tokens = info.prompt.is_some().then(|| lease.uncached_tokens());
    if let Some(log) = seen.log.as_mut() {
        log.attempt(
            lease.backend().addr().as_str(),
            lease.dispatched_at(),
            uncached_tokens,
            retry.map(RetryReason::as_str),
        );
    }
    let span = seen.span.as_ref().map(|server| {
        let span = attempt_span(server, balancer, head, lease, number, uncached_tokens);
        // Boxed: the span is large, and the proxy's future carries it across the attempt.
        Box::new(span)
    });
    if let Some(reason) = retry {
        balancer.metrics().count_retry(reason);
    }
    balancer.metrics().dispatched.add(1, &[]);
    tracing::debug!(method = %head.method, path = head.path_and_query.as_str(), backend = %lease.backend().addr(), attempt = number, "proxying request");
    span
}

/// The client span of attempt `number`, with the routing decision that chose its backend; the
/// head carries it as the backend's `traceparent`.
fn attempt_span(
    server: &RequestSpan,
    balancer: &Balancer,
    head: &mut RequestHead,
    lease: &Lease,
    number: u32,
    uncached_tokens: Option<u64>,
) -> AttemptSpan {
    let backend = lease.backend();
    let span = server.attempt(
        head.method.as_str(),
        number,
        crate::traces::Decision {
            strategy: balancer.strategy().name(),
            backend: backend.addr().as_str(),
            in_flight: backend.in_flight(),
            ewma_latency: backend.ewma_latency(),
            uncached_tokens,
        },
    );
    head.set_traceparent(&span.traceparent(), server.continues_client_trace());
    span
}

/// Sends one attempt to the leased backend and waits for its response head. `last` says no
/// attempt follows this one.
pub(super) async fn send(
    client: &UpstreamClient,
    lease: &Lease,
    head: &mut RequestHead,
    body: UpstreamBody,
    last: bool,
) -> Result<Response<BackendBody>, Failure> {
    let sent = client.send(lease.backend(), head, body, last);
    match client.config().first_byte_timeout {
        Some(limit) => tokio::time::timeout(limit, sent)
            .await
            .unwrap_or(Err(Failure::Backend(ErrorKind::FirstByteTimeout))),
        None => sent.await,
    }
}

/// How one attempt ended.
// Returned once per attempt and matched at once: boxing the response would allocate per request.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(super) enum Ended {
    /// The backend answered: its response head, classified; the lease is held until the answer
    /// is passed on or set aside.
    Answered(Answered),
    /// The attempt failed before a response head; the lease has recorded it.
    Failed(ErrorKind),
    /// The client's request body failed; the lease was released with nothing recorded.
    RequestBody(BodyFailure),
}

/// A backend's response head, with what the proxy read of it.
#[derive(Debug)]
pub(super) struct Answered {
    /// The response head.
    pub parts: Parts,
    /// The response body, unread.
    pub body: BackendBody,
    /// The attempt's lease.
    pub lease: Lease,
    /// How the answer is classified.
    pub class: Class,
    /// Its `Retry-After`, if it has a valid one.
    pub retry_after: Option<Duration>,
    /// Whether it is a server-sent event stream.
    pub event_stream: bool,
}

/// How the attempt on `lease` ended, judged once from what `send` returned.
pub(super) fn classify(sent: Result<Response<BackendBody>, Failure>, lease: Lease) -> Ended {
    match sent {
        Ok(response) => Ended::Answered(answered(response, lease)),
        Err(Failure::RequestBody(failure)) => {
            // Not the backend's doing: dropping the lease releases it with no outcome.
            drop(lease);
            Ended::RequestBody(failure)
        }
        Err(Failure::Backend(kind)) => {
            tracing::debug!(backend = %lease.backend().addr(), kind = kind.as_str(), "upstream attempt failed");
            lease.finish(Finish {
                status: None,
                error: Some(kind),
                retry_after: None,
                bytes: 0,
                usage: None,
            });
            Ended::Failed(kind)
        }
    }
}

/// A response head read for its class, its `Retry-After` and its content type.
fn answered(response: Response<BackendBody>, lease: Lease) -> Answered {
    let (parts, body) = response.into_parts();
    // Fields a plain-HTTP backend sent are read as lines, not put in the map.
    let (retry_after, content_type) = match body.passthrough() {
        Some(fields) => (
            fields.retry_after.as_deref(),
            fields.content_type.as_deref(),
        ),
        None => (
            parts
                .headers
                .get(header::RETRY_AFTER)
                .map(HeaderValue::as_bytes),
            parts
                .headers
                .get(header::CONTENT_TYPE)
                .map(HeaderValue::as_bytes),
        ),
    };
    let retry_after = retry_after.and_then(retry_after_value);
    let event_stream = content_type.is_some_and(is_event_stream);
    Answered {
        class: Class::of(Some(parts.status), None, retry_after),
        parts,
        body,
        lease,
        retry_after,
        event_stream,
    }
}

impl Ended {
    /// The answer's status, when the backend answered.
    pub fn status(&self) -> Option<http::StatusCode> {
        match self {
            Ended::Answered(answered) => Some(answered.parts.status),
            Ended::Failed(_) | Ended::RequestBody(_) => None,
        }
    }

    /// How the attempt ended, as the retry decision sees it.
    pub fn ending(&self) -> Ending {
        match self {
            Ended::Answered(answered) => Ending::Backend(answered.class),
            Ended::Failed(kind) => Ending::Backend(Class::Failure(Some(*kind))),
            Ended::RequestBody(_) => Ending::ClientBody,
        }
    }

    /// Sets the attempt aside for a retry: an answer's lease records it (a busy answer, or a
    /// generation's 5xx head: nothing of it reached the client; its body is not read, and its
    /// connection is closed). Returns the failure, if the attempt failed.
    pub fn set_aside(self) -> Option<ErrorKind> {
        match self {
            Ended::Answered(answered) => {
                answered.lease.finish(Finish {
                    status: Some(answered.parts.status),
                    error: None,
                    retry_after: answered.retry_after,
                    bytes: 0,
                    usage: None,
                });
                None
            }
            Ended::Failed(kind) => Some(kind),
            Ended::RequestBody(_) => None,
        }
    }

    /// Ends the attempt's span: answered when the answer goes to the client, failed otherwise.
    pub fn trace(&self, span: AttemptSpan, decision: Decision) {
        match self {
            Ended::Answered(_) if matches!(decision, Decision::Retry(_)) => span.failed(
                if matches!(self.ending(), Ending::Backend(Class::Busy(_))) {
                    "busy"
                } else {
                    "retried"
                },
            ),
            Ended::Answered(answered) => span.answered(answered.parts.status.as_u16()),
            Ended::Failed(kind) => span.failed(kind.as_str()),
            Ended::RequestBody(failure) => span.failed(failure.as_str()),
        }
    }
}

/// A `Retry-After` value in seconds (delta-seconds form; any other visible-ASCII text counts as
/// 1 s, anything else as no value).
pub fn retry_after_value(value: &[u8]) -> Option<Duration> {
    let text = std::str::from_utf8(value)
        .ok()
        .filter(|text| text.bytes().all(|b| b == b'\t' || (32..127).contains(&b)))?;
    // Longer pauses are capped by `availability.max_busy_pause` later; a day keeps the arithmetic
    // safe (a number too large for a `Duration` is a long pause, not a malformed one).
    const LONGEST: f64 = 86_400.0;
    let seconds = text
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|seconds| seconds.is_finite() && *seconds >= 0.0)
        .map(|seconds| Duration::from_secs_f64(seconds.min(LONGEST)));
    Some(seconds.unwrap_or(Duration::from_secs(1)))
}

fn is_event_stream(content_type: &[u8]) -> bool {
    content_type.starts_with(b"text/event-stream")
}
