//! Forwarding a request to backends (with retries where safe) and streaming the answer back.
//!
//! The request keeps its method, path and query; hop-by-hop headers (RFC 9110 §7.6.1, plus those
//! named in `Connection`) are removed both ways; `X-Forwarded-For` gets the client address
//! appended and `X-Forwarded-Proto` is set to `http`. The client's `Host` is kept (for HTTP/2
//! clients, the `:authority`). A request body of at most `retry.body_limit` bytes is read into
//! memory first (within a global budget, `retry.max_buffered_bytes`) so it can be sent again; a
//! larger one is streamed once. Responses are always streamed. Requests go out as HTTP/1.1 over
//! keep-alive connections ([`crate::pool`] for `http://` backends).

use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body_util::Either;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::access_log::{self, AccessLog};
use crate::backend::{Backend, BackendAddr, ErrorKind};
use crate::balancer::{Balancer, Finish, Lease, Rejection};
use crate::body::{BodyFailure, ClientBody, Pooled, RequestBody, UpstreamBody};
use crate::classify::Class;
use crate::forwarding::{ForwardedFor, HeadFields, RequestHead, remove_hop_by_hop};
use crate::h1::{FieldLines, Fields};
use crate::metrics::RetryReason;
use crate::observed::{Observation, ObservedBody, ResponseBody};
use crate::pool::Failure;
use crate::response;
use crate::retry_budget::{BudgetConfig, RetryBudget};
use crate::strategy::RequestView;
use crate::traces::{Decision, Traces};
use crate::upstream::UpstreamClient;

/// The `[retry]` section: how often a request may be sent, and what is kept to send it again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// Bytes of body kept in memory so the request can be sent again.
    pub body_limit: usize,
    /// Bytes of request bodies all requests together may keep in memory.
    pub max_buffered_bytes: usize,
    /// The retry budget (`[retry.budget]`), shared by all requests: see [`RetryBudget`].
    pub budget: BudgetConfig,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            body_limit: 1024 * 1024,
            max_buffered_bytes: 32 * 1024 * 1024,
            budget: BudgetConfig::default(),
        }
    }
}

impl RetryConfig {
    /// Checks what the types leave open: at least one attempt, the budget, a body limit of at
    /// most 64 MiB. The error names the key within `[retry]`.
    pub fn check(&self) -> Result<(), crate::forms::Invalid> {
        crate::forms::check::positive("max_attempts", self.max_attempts.into())?;
        self.budget
            .check()
            .map_err(|error| error.within("budget"))?;
        if self.body_limit > 64 * 1024 * 1024 {
            return Err(crate::forms::Invalid::new(
                "body_limit",
                format!("expected at most 67108864 bytes, found {}", self.body_limit),
            ));
        }
        Ok(())
    }
}

/// How requests are proxied: what retries may do, and what the response says of the decision.
#[derive(Debug, Clone)]
pub struct ProxyPolicy {
    /// The `[retry]` section.
    pub retry: RetryConfig,
    /// KiB of request bodies all requests together may keep in memory
    /// (`retry.max_buffered_bytes`).
    pub buffer_budget: Arc<Semaphore>,
    /// Whether responses carry `x-custom-router-backend` and `x-custom-router-queue-ms`.
    pub decision_headers: bool,
    /// Where finished requests are logged, when the access log is on.
    pub access_log: Option<AccessLog>,
    /// The tracer, when traces are on.
    pub traces: Option<Traces>,
    /// How attempts reach backends, and their timeouts ([`UpstreamClient::config`]).
    pub client: Arc<UpstreamClient>,
    /// Failure retries allowed (shared by all requests, kept across reloads).
    pub retry_budget: Arc<RetryBudget>,
}

/// How one attempt ended.
// Returned once per attempt and matched at once: boxing the response would allocate per request.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Attempt {
    /// The answer for the client (the backend's response, streamed).
    Answer(Response<ObservedBody>),
    /// The backend said it is busy before anything reached the client.
    Busy,
    /// The attempt failed; the lease has recorded it.
    Failed(ErrorKind),
    /// The client's request body failed; the lease was released with nothing recorded.
    RequestBody(BodyFailure),
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

/// Sends one attempt to the leased backend.
async fn attempt(
    client: &UpstreamClient,
    head: &mut RequestHead,
    body: UpstreamBody,
    last: bool,
    lease: Lease,
) -> Attempt {
    let may_retry_busy = !last;
    let idle_timeout = client.config().idle_timeout;
    let sent = client.send(lease.backend(), head, body, last);
    let answer = match client.config().first_byte_timeout {
        Some(limit) => match tokio::time::timeout(limit, sent).await {
            Ok(answer) => answer,
            Err(_) => Err(Failure::Backend(ErrorKind::FirstByteTimeout)),
        },
        None => sent.await,
    };
    match answer {
        Ok(upstream) => {
            let (mut parts, body) = upstream.into_parts();
            let status = parts.status;
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
            if may_retry_busy && Class::of(Some(status), None, retry_after).is_busy() {
                lease.finish(Finish {
                    status: Some(status),
                    error: None,
                    retry_after,
                    bytes: 0,
                });
                return Attempt::Busy;
            }
            remove_hop_by_hop(&mut parts.headers);
            // The client gets the router's own protocol version, whatever the backend spoke.
            parts.version = Version::default();
            let mut lease = lease;
            if event_stream {
                lease.mark_streamed();
            }
            let mut body = ObservedBody::new(body, lease, status, retry_after);
            body.set_idle_timeout(idle_timeout);
            Attempt::Answer(Response::from_parts(parts, body))
        }
        Err(Failure::RequestBody(failure)) => {
            // Not the backend's doing: dropping the lease releases it with no outcome.
            drop(lease);
            Attempt::RequestBody(failure)
        }
        Err(Failure::Backend(kind)) => {
            tracing::debug!(backend = %lease.backend().addr(), kind = kind.as_str(), "upstream attempt failed");
            lease.finish(Finish {
                status: None,
                error: Some(kind),
                retry_after: None,
                bytes: 0,
            });
            Attempt::Failed(kind)
        }
    }
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

/// The client's answer when the last attempt failed.
fn failure_response(kind: ErrorKind, backend: &BackendAddr) -> Response<ResponseBody> {
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

/// Methods whose repetition has the same effect as one request (RFC 9110 §9.2.2).
fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Proxies a client request: admits it, sends it, and retries where that is safe.
///
/// A connect failure (the backend saw nothing) or a busy answer (429, or 503 with
/// `Retry-After`) is retried on another backend for any method; any other failure only for
/// idempotent methods. Only bodies kept in memory (at most `body_limit`) are sent again, never
/// more than `retry.max_attempts` in all, and failure retries draw on the shared retry budget.
pub async fn proxy(
    balancer: &Arc<Balancer>,
    policy: Arc<ProxyPolicy>,
    request: Request<ClientBody>,
    fields: Option<FieldLines>,
    client: &ForwardedFor,
) -> Response<ResponseBody> {
    let mut seen = Observation::default();
    if policy.access_log.is_some() || policy.traces.is_some() {
        seen = observe(&policy, &request, fields.as_ref());
    }
    if request.method() == Method::CONNECT {
        return logged(seen, response::connect_not_allowed(), "connect_not_allowed");
    }
    let (mut parts, body) = request.into_parts();
    let body = match RequestBody::read(body, policy.retry.body_limit, &policy.buffer_budget).await {
        Ok(body) => body,
        Err(error) => {
            let failure = BodyFailure::of(&*error);
            return logged(seen, response::body_failure(failure), failure.as_str());
        }
    };
    if let Some(log) = seen.log.as_mut() {
        log.bytes_in(body.is_replayable().then(|| body.prefix().len() as u64));
    }
    let (info, admission) = {
        let headers = match &fields {
            Some(lines) => Fields::Lines(lines),
            None => Fields::Map(&parts.headers),
        };
        let view = RequestView::new(&parts.method, &parts.uri, &headers, body.prefix());
        (balancer.request_info(&view), balancer.admission(&view))
    };
    if seen.log.is_some() || seen.span.is_some() {
        let prompt_tokens = info.prompt.as_ref().map(|prompt| prompt.tokens);
        if let Some(log) = seen.log.as_mut() {
            log.request(admission.band.as_str(), prompt_tokens);
        }
        if let Some(span) = seen.span.as_ref() {
            span.request(admission.band.as_str(), prompt_tokens);
        }
    }
    let mut body = body;
    // With traces on, each attempt sends its own `traceparent`: the fields go into a map, where
    // it can be set.
    let fields = match fields {
        Some(lines) if seen.span.is_some() => {
            parts.headers = lines.to_map();
            None
        }
        fields => fields,
    };
    let mut head = RequestHead::prepare(parts, fields, client);
    if let HeadFields::Map(headers) = &mut head.fields {
        if !body.is_replayable() && !headers.contains_key(header::CONTENT_LENGTH) {
            // A streamed body of unknown length goes out chunked, whatever the method (the
            // HTTP/1 client adds this itself when it writes lines).
            headers.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
        }
    }
    let retriable = body.is_replayable() && policy.retry.max_attempts > 1;
    let idempotent = is_idempotent(&head.method);
    policy.retry_budget.deposit();
    // Read the clock only for what needs it.
    let arrived = policy.decision_headers.then(tokio::time::Instant::now);
    // A deadline header states the client's patience from its arrival: a retry has what is left.
    let deadline_from = admission.deadline.map(|_| tokio::time::Instant::now());
    let mut tried: Vec<Arc<Backend>> = Vec::new();
    let mut last_failure: Option<(ErrorKind, Arc<Backend>)> = None;
    let mut retry_reason: Option<RetryReason> = None;
    for number in 1..=policy.retry.max_attempts {
        if let Some(span) = seen.span.as_mut() {
            span.queue_started();
        }
        let admitted = if tried.is_empty() {
            balancer.admit_as(info.clone(), admission).await.map(Some)
        } else {
            let requeue = last_failure.is_none();
            let mut admission = admission;
            if let (Some(deadline), Some(from)) = (admission.deadline, deadline_from) {
                admission.deadline = Some(deadline.saturating_sub(from.elapsed()));
            }
            balancer
                .admit_retry(info.clone(), admission, &tried, requeue)
                .await
        };
        if let Some(span) = seen.span.as_mut() {
            span.queue_ended(admitted.as_ref().err().map(|r| response::reason(*r)));
        }
        // A failure retry took its retry from the budget before it was admitted: with no
        // backend to try it on, it is given back.
        if last_failure.is_some() && !matches!(admitted, Ok(Some(_))) {
            policy.retry_budget.refund();
        }
        let lease = match admitted {
            Ok(Some(lease)) => lease,
            Ok(None) => {
                return match &last_failure {
                    Some((kind, backend)) => {
                        logged(seen, failure_response(*kind, backend.addr()), kind.as_str())
                    }
                    None => {
                        // Every backend tried answered busy: not a refusal of the router's.
                        let reason = response::reason(Rejection::Busy);
                        logged(seen, response::rejection(Rejection::Busy), reason)
                    }
                };
            }
            Err(rejection) => {
                let reason = response::reason(rejection);
                return logged(seen, response::rejection(rejection), reason);
            }
        };
        let uncached_tokens = info.prompt.is_some().then(|| lease.uncached_tokens());
        if let Some(log) = seen.log.as_mut() {
            log.attempt(
                lease.backend().addr().as_str(),
                lease.dispatched_at(),
                uncached_tokens,
            );
        }
        let attempt_span = seen.span.as_ref().map(|span| {
            let continues_client_trace = span.continues_client_trace();
            let backend = lease.backend();
            let span = span.attempt(
                head.method.as_str(),
                number,
                Decision {
                    strategy: balancer.strategy().name(),
                    backend: backend.addr().as_str(),
                    in_flight: backend.in_flight(),
                    ewma_latency: backend.ewma_latency(),
                    uncached_tokens,
                },
            );
            head.set_traceparent(&span.traceparent(), continues_client_trace);
            // Boxed: the span is large, and the proxy's future carries it across the attempt.
            Box::new(span)
        });
        if let Some(reason) = retry_reason.take() {
            balancer.metrics().count_retry(reason);
        }
        balancer.metrics().dispatched.add(1, &[]);
        let backend = Arc::clone(lease.backend());
        let queued =
            arrived.map(|arrived| lease.dispatched_at().saturating_duration_since(arrived));
        let last = !retriable || number == policy.retry.max_attempts;
        let Some(upstream_body) = body.for_attempt() else {
            let answer = response::error(StatusCode::BAD_GATEWAY, "request body already sent");
            return logged(seen, answer, "body_already_sent");
        };
        tracing::debug!(method = %head.method, path = head.path_and_query.as_str(), backend = %backend.addr(), attempt = number, "proxying request");
        let outcome = attempt(&policy.client, &mut head, upstream_body, last, lease).await;
        if let Some(span) = attempt_span {
            let span = *span;
            match &outcome {
                Attempt::Answer(response) => span.answered(response.status().as_u16()),
                Attempt::Busy => span.failed("busy"),
                Attempt::Failed(kind) => span.failed(kind.as_str()),
                Attempt::RequestBody(failure) => span.failed(failure.as_str()),
            }
        }
        let reason = match outcome {
            Attempt::Answer(mut response) => {
                if let Some(queued) = queued {
                    add_decision_headers(&mut response, backend.addr(), queued);
                }
                response.body_mut().observe(seen);
                return response.map(Either::Left);
            }
            Attempt::RequestBody(failure) => {
                return logged(seen, response::body_failure(failure), failure.as_str());
            }
            Attempt::Busy => {
                last_failure = None;
                RetryReason::Busy
            }
            Attempt::Failed(kind) => {
                let safe = kind.before_request_sent() || idempotent;
                if last || !safe {
                    return logged(seen, failure_response(kind, backend.addr()), kind.as_str());
                }
                if !policy.retry_budget.try_withdraw() {
                    balancer.metrics().retry_budget_exhausted.add(1, &[]);
                    return logged(seen, failure_response(kind, backend.addr()), kind.as_str());
                }
                last_failure = Some((kind, Arc::clone(&backend)));
                if kind.before_request_sent() {
                    RetryReason::Connect
                } else {
                    RetryReason::Idempotent
                }
            }
        };
        retry_reason = Some(reason);
        tried.push(backend);
    }
    // The loop returns on its last attempt.
    logged(
        seen,
        response::error(StatusCode::BAD_GATEWAY, "no attempt left"),
        "no_attempt_left",
    )
}

/// The access log record and server span of a request that arrived now (whichever is on).
fn observe(
    policy: &ProxyPolicy,
    request: &Request<ClientBody>,
    fields: Option<&FieldLines>,
) -> Observation {
    let view = match fields {
        Some(lines) => Fields::Lines(lines),
        None => Fields::Map(request.headers()),
    };
    let traceparent = view.get("traceparent");
    // A CONNECT's target is an authority (`host:port`), which is what it asks for.
    let uri = request.uri();
    let path = uri.path_and_query().map_or_else(
        || uri.authority().map_or("/", |authority| authority.as_str()),
        |path| path.as_str(),
    );
    let span = policy
        .traces
        .as_ref()
        .map(|traces| Box::new(traces.request(request.method().as_str(), path, traceparent)));
    let log = policy.access_log.as_ref().map(|log| {
        let trace_id = match &span {
            Some(span) => Some(span.trace_id()),
            None => traceparent.and_then(crate::traces::trace_id_of),
        };
        Box::new(access_log::Pending::new(
            log,
            request.method(),
            path,
            trace_id,
        ))
    });
    Observation { log, span }
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
