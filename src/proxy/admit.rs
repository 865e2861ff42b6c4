//! Admit: what the proxy reads of a request before it asks for a backend. A `CONNECT` is refused;
//! a small body is read into memory so that it can be sent again (within the shared buffering
//! budget); the balancer says what the strategy sees of the request and how it is queued (band,
//! tenant, deadline); the head to forward is prepared once. The access log record and server
//! span start here too, when either is on.

use std::time::Duration;

use http::header::{self, HeaderValue};
use http::request::Parts;
use http::{Method, Request};
use tokio::time::Instant;

use super::ProxyPolicy;
use super::answer::RouterAnswer;
use super::retry::{Attempted, Ending};
use crate::access_log;
use crate::balancer::{Admission, Balancer, Lease};
use crate::body::{BodyFailure, ClientBody, RequestBody};
use crate::forwarding::{ForwardedFor, HeadFields, RequestHead};
use crate::h1::{FieldLines, Fields};
use crate::observed::Observation;
use crate::strategy::{RequestInfo, RequestView};

/// A request admitted to be forwarded: what every attempt sends and what each pick asks.
pub(super) struct Admitted {
    /// What each pick asks the balancer for.
    pub ask: Ask,
    /// The head every attempt writes.
    pub head: RequestHead,
    /// The body, kept for replay or streamed once.
    pub body: RequestBody,
    /// Whether it is a generation request ([`super::RetryConfig::is_generation`]).
    generation: bool,
    /// When it arrived, read only when decision headers are on.
    arrived: Option<Instant>,
}

/// What the balancer reads of a request at each pick.
pub(super) struct Ask {
    /// What the strategy sees of the request.
    pub info: RequestInfo,
    /// How it is queued.
    pub admission: Admission,
    /// When its deadline started counting, read only when it has one.
    deadline_from: Option<Instant>,
}

impl Ask {
    /// Its admission for a retry: a deadline has what is left of it since the request arrived.
    pub fn admission_for_retry(&self) -> Admission {
        let mut admission = self.admission;
        if let (Some(deadline), Some(from)) = (admission.deadline, self.deadline_from) {
            admission.deadline = Some(deadline.saturating_sub(from.elapsed()));
        }
        admission
    }
}

impl Admitted {
    /// How long it waited before `lease` was dispatched (the whole time since it arrived,
    /// earlier attempts included), when decision headers are on.
    pub fn queued(&self, lease: &Lease) -> Option<Duration> {
        self.arrived
            .map(|arrived| lease.dispatched_at().saturating_duration_since(arrived))
    }

    /// What the retry decision reads of attempt `number`, which ended as `ending` (with the
    /// answer's `status`, when the backend answered).
    pub fn attempted(
        &self,
        ending: Ending,
        status: Option<http::StatusCode>,
        number: u32,
    ) -> Attempted<'_> {
        Attempted {
            ending,
            method: &self.head.method,
            replayable: self.body.is_replayable(),
            number,
            // The decision is taken at the response head, before any of it is passed on.
            answer_started: false,
            generation: self.generation,
            status,
        }
    }
}

/// Refuses a `CONNECT` and reads the body into memory when it is small enough to be sent
/// again; or says what the client gets instead. The only phase of admission that waits.
pub(super) async fn receive(
    parts: &Parts,
    body: ClientBody,
    policy: &ProxyPolicy,
    seen: &mut Observation,
) -> Result<RequestBody, RouterAnswer> {
    if parts.method == Method::CONNECT {
        return Err(RouterAnswer::ConnectNotAllowed);
    }
    let body = RequestBody::read(body, policy.retry.body_limit, &policy.buffer_budget)
        .await
        .map_err(|error| RouterAnswer::BodyFailure(BodyFailure::of(&*error)))?;
    if let Some(log) = seen.log.as_mut() {
        log.bytes_in(body.is_replayable().then(|| body.prefix().len() as u64));
    }
    Ok(body)
}

/// Admits a received request: reads its admission and prepares its head (see
/// [`RequestHead::prepare`], which takes the method and the fields out of `parts` and
/// `fields`).
pub(super) fn admit(
    balancer: &Balancer,
    policy: &ProxyPolicy,
    parts: &mut Parts,
    body: RequestBody,
    fields: &mut Option<FieldLines>,
    client: &ForwardedFor,
    seen: &mut Observation,
) -> Admitted {
    let generation = policy.retry.is_generation(&parts.method, parts.uri.path());
    let (info, admission) = admission_of(balancer, parts, fields.as_ref(), &body);
    note_admission(seen, &info, admission);
    // With traces on, each attempt sends its own `traceparent`: the fields go into a map, where
    // it can be set.
    if seen.span.is_some() {
        if let Some(lines) = fields.take() {
            parts.headers = lines.to_map();
        }
    }
    let mut head = RequestHead::prepare(parts, fields, client);
    if !body.is_replayable() {
        send_chunked(&mut head);
    }
    Admitted {
        ask: Ask {
            info,
            admission,
            // A deadline header states the client's patience from its arrival.
            deadline_from: admission.deadline.map(|_| Instant::now()),
        },
        head,
        body,
        generation,
        // Read the clock only for what needs it.
        arrived: policy.decision_headers.then(Instant::now),
    }
}

/// What the strategy sees of the request, and how it is queued.
fn admission_of(
    balancer: &Balancer,
    parts: &Parts,
    fields: Option<&FieldLines>,
    body: &RequestBody,
) -> (RequestInfo, Admission) {
    let headers = match fields {
        Some(lines) => Fields::Lines(lines),
        None => Fields::Map(&parts.headers),
    };
    let view = RequestView::new(&parts.method, &parts.uri, &headers, body.prefix());
    (balancer.request_info(&view), balancer.admission(&view))
}

/// The access log record and the span note the request's band and prompt size.
fn note_admission(seen: &mut Observation, info: &RequestInfo, admission: Admission) {
    if seen.log.is_none() && seen.span.is_none() {
        return;
    }
    let prompt_tokens = info.prompt.as_ref().map(|prompt| prompt.tokens);
    if let Some(log) = seen.log.as_mut() {
        log.request(admission.band.as_str(), prompt_tokens);
    }
    if let Some(span) = seen.span.as_ref() {
        span.request(admission.band.as_str(), prompt_tokens);
    }
}

/// A streamed body (not kept for replay) of unknown length goes out chunked, whatever the
/// method: the head says so when its fields are a map (the HTTP/1 client adds this itself when
/// it writes lines).
fn send_chunked(head: &mut RequestHead) {
    if let HeadFields::Map(headers) = &mut head.fields {
        if !headers.contains_key(header::CONTENT_LENGTH) {
            headers.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
        }
    }
}

/// The access log record and server span of a request that arrived now (whichever is on).
pub(super) fn observe(
    policy: &ProxyPolicy,
    request: &Request<ClientBody>,
    fields: Option<&FieldLines>,
) -> Observation {
    if policy.access_log.is_none() && policy.traces.is_none() {
        return Observation::default();
    }
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
