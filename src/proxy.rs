//! Forwarding a request to backends (with retries where safe) and streaming the answer back.
//!
//! The request keeps its method, path and query; hop-by-hop headers (RFC 9110 §7.6.1, plus those
//! named in `Connection`) are removed both ways; `X-Forwarded-For` gets the client address
//! appended and `X-Forwarded-Proto` is set to `http`. The client's `Host` is kept (for HTTP/2
//! clients, the `:authority`). A request body of at most `retry_body_limit` bytes is read into
//! memory first (within a global budget, `max_buffered_bytes`) so it can be sent again; a larger
//! one is streamed once. Responses are always streamed. Requests go out as HTTP/1.1 over
//! keep-alive connections ([`crate::pool`] for `http://` backends).

use std::error::Error as _;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::Semaphore;

use futures_util::future::{self, FutureExt as _};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Uri};
use http::{Method, Request, Response, StatusCode, Version};
use http_body_util::Either;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::CertificateDer;

use crate::access_log::{self, AccessLog};
use crate::backend::{Backend, BackendAddr, ErrorKind};
use crate::balancer::{Balancer, Finish, Lease, Rejection};
use crate::body::{
    BackendBody, BodyFailure, ClientBody, Observation, ObservedBody, RequestBody, ResponseBody,
    UpstreamBody,
};
use crate::h1::{FieldLines, Fields};
use crate::metrics::RetryReason;
use crate::pool::Failure;
use crate::response;
use crate::strategies::{RequestInfo, RequestView};
use crate::traces::{Decision, Traces};
use crate::{h1, pool};

/// How requests reach backends over HTTP/1.1: `http://` backends over their own keep-alive
/// connections ([`crate::pool`]), `https://` ones over a pooled rustls client built on first use
/// (loading the system's CA certificates costs startup time and memory that plain-HTTP
/// deployments need not pay).
pub struct UpstreamClient {
    https: OnceLock<Client<HttpsConnector<HttpConnector>, UpstreamBody>>,
    connect_timeout: Duration,
    /// How long a backend may take none of a request being written (`upstream_idle_timeout`).
    stall_timeout: Option<Duration>,
    extra_ca_certs: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for UpstreamClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamClient")
            .field("tls_ready", &self.https.get().is_some())
            .finish_non_exhaustive()
    }
}

impl UpstreamClient {
    /// Sends the request `head` with `body` to `backend`. An `http://` backend gets it over a
    /// pooled connection ([`crate::pool`]), the head written from `head` as it is (so another
    /// attempt needs no copy of it); the response body then holds the connection, which goes back
    /// once the body has been read to its end. An `https://` backend gets a request built from
    /// `head`: its headers are copied unless this is the `last` attempt.
    ///
    /// Not an `async fn`: the exchange's own future is returned, not moved into another one.
    pub fn send<'a>(
        &'a self,
        backend: &'a Arc<Backend>,
        head: &'a mut RequestHead,
        body: UpstreamBody,
        last: bool,
    ) -> impl Future<Output = Result<Response<BackendBody>, Failure>> + 'a {
        let addr = backend.addr();
        if addr.is_https() {
            future::Either::Right(self.send_tls(addr, head, body, last))
        } else {
            future::Either::Left(
                pool::send(
                    backend,
                    head.h1(addr),
                    body,
                    self.connect_timeout,
                    self.stall_timeout,
                )
                .map(|sent| sent.map(|response| response.map(BackendBody::Pooled))),
            )
        }
    }

    async fn send_tls(
        &self,
        addr: &BackendAddr,
        head: &mut RequestHead,
        body: UpstreamBody,
        last: bool,
    ) -> Result<Response<BackendBody>, Failure> {
        let https = self.https.get_or_init(|| {
            let connector = HttpsConnectorBuilder::new()
                .with_tls_config(tls_config(&self.extra_ca_certs))
                .https_or_http()
                .enable_http1()
                .wrap_connector(http_connector(self.connect_timeout));
            pooled(connector)
        });
        let request = head.tls_request(addr, body, last);
        match https.request(request).await {
            Ok(response) => Ok(response.map(BackendBody::Tls)),
            Err(error) => Err(classify(&error)),
        }
    }
}

/// `scheme://authority/path` for `addr`.
fn absolute_uri(addr: &BackendAddr, path_and_query: PathAndQuery) -> Uri {
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(addr.scheme());
    parts.authority = Some(addr.authority().clone());
    parts.path_and_query = Some(path_and_query);
    Uri::from_parts(parts).expect("scheme, authority and path make an absolute URI")
}

/// The `Host` a request to `addr` carries when the client sent none: the host, and the port
/// unless it is the scheme's default.
fn host_text(addr: &BackendAddr) -> &str {
    let authority = addr.authority();
    let default_port = if addr.is_https() { 443 } else { 80 };
    match authority.port_u16() {
        Some(port) if port != default_port => authority.as_str(),
        _ => authority.host(),
    }
}

fn http_connector(connect_timeout: Duration) -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector.enforce_http(false);
    connector
}

fn pooled<C>(connector: C) -> Client<C, UpstreamBody>
where
    C: hyper_util::client::legacy::connect::Connect + Clone,
{
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(pool::IDLE_TIMEOUT)
        .build(connector)
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static(h1::fields::FORWARDED_FOR);
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static(h1::fields::FORWARDED_PROTO);
/// The `X-Forwarded-Proto` every proxied request carries (the listener speaks cleartext only).
const FORWARDED_PROTO_VALUE: &str = "http";
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// Headers that apply to one connection only and are never forwarded (`Connection` first; their
/// lengths are listed in `remove_hop_by_hop`).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    PROXY_CONNECTION,
    KEEP_ALIVE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
];

/// Builds the upstream client: keep-alive connections, `TCP_NODELAY`, connect timeout; TLS for
/// `https://` backends trusting the system store plus `extra_ca_certs`.
pub fn client(
    connect_timeout: Duration,
    stall_timeout: Option<Duration>,
    extra_ca_certs: &[CertificateDer<'static>],
) -> UpstreamClient {
    UpstreamClient {
        https: OnceLock::new(),
        connect_timeout,
        stall_timeout,
        extra_ca_certs: extra_ca_certs.to_vec(),
    }
}

fn tls_config(extra_ca_certs: &[CertificateDer<'static>]) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, _ignored) = roots.add_parsable_certificates(native.certs);
    let (extra, _) = roots.add_parsable_certificates(extra_ca_certs.iter().cloned());
    tracing::debug!(
        system = added,
        extra,
        "trusted CA certificates for https backends"
    );
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("the ring provider supports the default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// Removes hop-by-hop headers, including every header named in `Connection`.
pub fn remove_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names finds which are present (most messages carry none, responses
    // often `Connection: keep-alive` alone): only those are removed, each with one hashed lookup.
    let mut present = 0u16;
    for name in headers.keys() {
        // Lengths first: most names are ruled out without comparing them.
        if !matches!(name.as_str().len(), 2 | 7 | 10 | 16 | 17 | 19) {
            continue;
        }
        if let Some(index) = HOP_BY_HOP.iter().position(|hop| hop == name) {
            present |= 1 << index;
        }
    }
    if present == 0 {
        return;
    }
    if present & 1 != 0 {
        // `HOP_BY_HOP[0]` is `Connection`: the headers it names go too. Those on the list are
        // removed below if present; the others only when present (`close` names none).
        let mut named: Vec<HeaderName> = Vec::new();
        for token in headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|list| list.split(','))
            .map(str::trim)
        {
            let listed = HOP_BY_HOP.iter().any(|hop| {
                let hop = hop.as_str();
                hop.len() == token.len() && token.eq_ignore_ascii_case(hop)
            });
            if !listed && !token.is_empty() && headers.contains_key(token) {
                if let Ok(name) = HeaderName::from_bytes(token.as_bytes()) {
                    named.push(name);
                }
            }
        }
        for name in named {
            headers.remove(name);
        }
    }
    for (index, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << index) != 0 {
            headers.remove(name);
        }
    }
}

/// The client's address as an `X-Forwarded-For` element, made once per connection.
#[derive(Debug, Clone)]
pub struct ForwardedFor(HeaderValue);

impl ForwardedFor {
    /// The element for a client connected from `peer`.
    pub fn new(peer: SocketAddr) -> Self {
        let text = peer.ip().to_canonical().to_string();
        Self(HeaderValue::from_str(&text).expect("an IP address is a valid header value"))
    }

    /// The `X-Forwarded-For` value of a request that came with the values `sent`: those, joined
    /// into one, then this client.
    fn appended_to<'a>(&self, sent: impl IntoIterator<Item = &'a [u8]>) -> HeaderValue {
        let mut joined = Vec::new();
        for value in sent {
            joined.extend_from_slice(value);
            joined.extend_from_slice(b", ");
        }
        if joined.is_empty() {
            return self.0.clone();
        }
        joined.extend_from_slice(self.0.as_bytes());
        // Field values joined by ", " make a field value.
        HeaderValue::from_bytes(&joined).unwrap_or_else(|_| self.0.clone())
    }
}

fn append_forwarded_for(headers: &mut HeaderMap, client: &ForwardedFor) {
    let value = client.appended_to(
        headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .map(HeaderValue::as_bytes),
    );
    headers.insert(X_FORWARDED_FOR, value);
}

/// How requests are proxied: what retries may do, and what the response says of the decision.
#[derive(Debug, Clone)]
pub struct ProxyPolicy {
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// Bytes of body kept in memory so the request can be sent again.
    pub body_limit: usize,
    /// KiB of request bodies all requests together may keep in memory.
    pub buffer_budget: Arc<Semaphore>,
    /// How long a backend may take to send response headers.
    pub first_byte_timeout: Option<Duration>,
    /// How long a backend may leave a response body without sending a byte.
    pub upstream_idle_timeout: Option<Duration>,
    /// Whether responses carry `x-custom-router-backend` and `x-custom-router-queue-ms`.
    pub decision_headers: bool,
    /// Where finished requests are logged, when the access log is on.
    pub access_log: Option<AccessLog>,
    /// The tracer, when traces are on.
    pub traces: Option<Traces>,
}

/// A request prepared once for all its attempts: hop-by-hop headers removed, `Host` kept,
/// `X-Forwarded-For` and `X-Forwarded-Proto` set.
#[derive(Debug)]
pub struct RequestHead {
    method: Method,
    path_and_query: PathAndQuery,
    fields: HeadFields,
    /// Whether the fields have a `Host` (otherwise each attempt gets the backend's).
    has_host: bool,
}

/// The fields of a [`RequestHead`].
#[derive(Debug)]
enum HeadFields {
    /// In a map, the forwarding fields set.
    Map(HeaderMap),
    /// An HTTP/1 client's lines as it sent them, and the `X-Forwarded-For` value to add.
    Lines {
        lines: FieldLines,
        forwarded_for: HeaderValue,
    },
}

impl RequestHead {
    /// Prepares the head of a client request received from `client`, its fields kept as the
    /// lines it sent when there are `fields` (the map is then empty).
    pub fn prepare(
        parts: http::request::Parts,
        fields: Option<FieldLines>,
        client: &ForwardedFor,
    ) -> Self {
        let path_and_query = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        match fields {
            Some(lines) => {
                let forwarded_for = client.appended_to(lines.forwarded_for());
                Self {
                    method: parts.method,
                    path_and_query,
                    has_host: lines.has_host(),
                    fields: HeadFields::Lines {
                        lines,
                        forwarded_for,
                    },
                }
            }
            None => Self::prepare_map(parts, path_and_query, client),
        }
    }

    fn prepare_map(
        mut parts: http::request::Parts,
        path_and_query: PathAndQuery,
        client: &ForwardedFor,
    ) -> Self {
        remove_hop_by_hop(&mut parts.headers);
        let mut has_host = parts.headers.contains_key(header::HOST);
        if !has_host {
            if let Some(authority) = parts.uri.authority() {
                if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
                    parts.headers.insert(header::HOST, host);
                    has_host = true;
                }
            }
        }
        append_forwarded_for(&mut parts.headers, client);
        parts.headers.insert(
            X_FORWARDED_PROTO,
            HeaderValue::from_static(FORWARDED_PROTO_VALUE),
        );
        Self {
            method: parts.method,
            path_and_query,
            fields: HeadFields::Map(parts.headers),
            has_host,
        }
    }

    /// Sets the `traceparent` the next attempt sends (fields kept in a map only; the proxy puts
    /// them there when traces are on).
    fn set_traceparent(&mut self, value: &str) {
        if let (HeadFields::Map(headers), Ok(value)) =
            (&mut self.fields, HeaderValue::from_str(value))
        {
            headers.insert(HeaderName::from_static("traceparent"), value);
        }
    }

    /// A bodiless `GET path` with no header fields (a health probe's request).
    pub fn probe(path: &str) -> Option<Self> {
        Some(Self {
            method: Method::GET,
            path_and_query: PathAndQuery::try_from(path).ok()?,
            fields: HeadFields::Map(HeaderMap::new()),
            has_host: false,
        })
    }

    /// The head for one attempt to the plain-HTTP backend `addr`: origin form (authority form
    /// for `CONNECT`), with the backend's `Host` if the client sent none.
    fn h1<'a>(&'a self, addr: &'a BackendAddr) -> h1::RequestHead<'a> {
        h1::RequestHead {
            method: &self.method,
            target: if self.method == Method::CONNECT {
                addr.authority().as_str()
            } else {
                self.path_and_query.as_str()
            },
            fields: match &self.fields {
                HeadFields::Map(headers) => h1::client::HeadFields::Map(headers),
                HeadFields::Lines {
                    lines,
                    forwarded_for,
                } => h1::client::HeadFields::Lines {
                    lines: lines.lines(),
                    forwarded_for: forwarded_for.as_bytes(),
                    forwarded_proto: FORWARDED_PROTO_VALUE.as_bytes(),
                    has_content_length: lines.has_content_length(),
                },
            },
            host: (!self.has_host).then(|| host_text(addr)),
        }
    }

    /// The request for one attempt to the `https://` backend `addr`, with an absolute URI (the
    /// TLS client sets `Host` from it when the client sent none). The headers are copied when
    /// another attempt may follow, and moved into the `last` one.
    fn tls_request(
        &mut self,
        addr: &BackendAddr,
        body: UpstreamBody,
        last: bool,
    ) -> Request<UpstreamBody> {
        let mut request = Request::new(body);
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = absolute_uri(addr, self.path_and_query.clone());
        *request.version_mut() = Version::HTTP_11;
        *request.headers_mut() = match &mut self.fields {
            HeadFields::Map(headers) if last => std::mem::take(headers),
            HeadFields::Map(headers) => headers.clone(),
            HeadFields::Lines {
                lines,
                forwarded_for,
            } => {
                let mut headers = lines.to_map();
                headers.insert(X_FORWARDED_FOR, forwarded_for.clone());
                headers.insert(
                    X_FORWARDED_PROTO,
                    HeaderValue::from_static(FORWARDED_PROTO_VALUE),
                );
                headers
            }
        };
        request
    }
}

/// How one attempt ended.
// Returned once per attempt and matched at once: boxing the response would allocate per request.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Attempt {
    /// The answer for the client (the backend's response, streamed).
    Answer(Response<ResponseBody>),
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
    let seconds = text
        .trim()
        .parse::<f64>()
        .ok()
        .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok());
    // Longer pauses are capped by `max_busy_pause` later; a day keeps the arithmetic safe.
    Some(seconds.map_or(Duration::from_secs(1), |d| {
        d.min(Duration::from_secs(86_400))
    }))
}

fn is_event_stream(content_type: &[u8]) -> bool {
    content_type.starts_with(b"text/event-stream")
}

fn is_busy(status: StatusCode, retry_after: Option<Duration>) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS
        || (status == StatusCode::SERVICE_UNAVAILABLE && retry_after.is_some())
}

/// Sends one attempt to the leased backend.
async fn attempt(
    client: &UpstreamClient,
    head: &mut RequestHead,
    body: UpstreamBody,
    last: bool,
    lease: Lease,
    first_byte_timeout: Option<Duration>,
    idle_timeout: Option<Duration>,
) -> Attempt {
    let may_retry_busy = !last;
    let sent = client.send(lease.backend(), head, body, last);
    let answer = match first_byte_timeout {
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
            if may_retry_busy && is_busy(status, retry_after) {
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
            Attempt::Answer(Response::from_parts(parts, Either::Left(body)))
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
fn add_decision_headers(
    response: &mut Response<ResponseBody>,
    backend: &BackendAddr,
    queued: Duration,
) {
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
/// more than `max_attempts` in all, and failure retries draw on the shared retry budget.
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
    let body = match RequestBody::read(body, policy.body_limit, &policy.buffer_budget).await {
        Ok(body) => body,
        Err(error) => {
            let failure = BodyFailure::of(&error);
            return logged(seen, response::body_failure(failure), failure.as_str());
        }
    };
    if let Some(log) = seen.log.as_mut() {
        log.bytes_in(body.is_replayable().then(|| body.prefix().len() as u64));
    }
    let info = RequestInfo {
        method: parts.method.clone(),
        key: balancer.request_key(&RequestView::new(
            &parts.method,
            &parts.uri,
            &match &fields {
                Some(lines) => Fields::Lines(lines),
                None => Fields::Map(&parts.headers),
            },
            body.prefix(),
        )),
    };
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
    let retriable = body.is_replayable() && policy.max_attempts > 1;
    let idempotent = is_idempotent(&head.method);
    balancer.retry_budget().deposit();
    // Read the clock only for what needs it.
    let arrived = policy.decision_headers.then(tokio::time::Instant::now);
    let mut tried: Vec<Arc<Backend>> = Vec::new();
    let mut last_failure: Option<(ErrorKind, Arc<Backend>)> = None;
    let mut retry_reason: Option<RetryReason> = None;
    for number in 1..=policy.max_attempts {
        if let Some(span) = seen.span.as_mut() {
            span.queue_started();
        }
        let admitted = if tried.is_empty() {
            balancer.admit(info.clone()).await.map(Some)
        } else {
            let requeue = last_failure.is_none();
            balancer.admit_retry(info.clone(), &tried, requeue).await
        };
        if let Some(span) = seen.span.as_mut() {
            span.queue_ended(admitted.as_ref().err().map(|r| response::reason(*r)));
        }
        let lease = match admitted {
            Ok(Some(lease)) => lease,
            Ok(None) => {
                return match &last_failure {
                    Some((kind, backend)) => {
                        logged(seen, failure_response(*kind, backend.addr()), kind.as_str())
                    }
                    None => {
                        balancer.metrics().rejected.add(1, &[]);
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
        if let Some(log) = seen.log.as_mut() {
            log.attempt(lease.backend().addr().as_str(), lease.dispatched_at());
        }
        let attempt_span = seen.span.as_ref().map(|span| {
            let backend = lease.backend();
            let span = span.attempt(
                head.method.as_str(),
                number,
                Decision {
                    strategy: balancer.strategy().name(),
                    backend: backend.addr().as_str(),
                    in_flight: backend.in_flight(),
                    ewma_latency: backend.ewma_latency(),
                },
            );
            head.set_traceparent(&span.traceparent());
            span
        });
        if let Some(reason) = retry_reason.take() {
            balancer.metrics().count_retry(reason);
        }
        balancer.metrics().dispatched.add(1, &[]);
        let backend = Arc::clone(lease.backend());
        let queued =
            arrived.map(|arrived| lease.dispatched_at().saturating_duration_since(arrived));
        let last = !retriable || number == policy.max_attempts;
        let Some(upstream_body) = body.for_attempt() else {
            let answer = response::error(StatusCode::BAD_GATEWAY, "request body already sent");
            return logged(seen, answer, "body_already_sent");
        };
        tracing::debug!(method = %head.method, path = head.path_and_query.as_str(), backend = %backend.addr(), attempt = number, "proxying request");
        let client = balancer.client();
        let outcome = attempt(
            &client,
            &mut head,
            upstream_body,
            last,
            lease,
            policy.first_byte_timeout,
            policy.upstream_idle_timeout,
        )
        .await;
        if let Some(span) = attempt_span {
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
                if let Either::Left(observed) = response.body_mut() {
                    observed.observe(seen);
                }
                return response;
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
                if !balancer.retry_budget().try_withdraw() {
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
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |path| path.as_str());
    let span = policy
        .traces
        .as_ref()
        .map(|traces| Box::new(traces.request(request.method().as_str(), path, traceparent)));
    let log = policy.access_log.as_ref().map(|log| {
        let trace_id = match &span {
            Some(span) => Some(span.trace_id()),
            None => traceparent.and_then(access_log::trace_id_of),
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

fn classify(error: &hyper_util::client::legacy::Error) -> Failure {
    if !error.is_connect() {
        // The request body's own error comes back as hyper's "user body" error.
        let mut source = error.source();
        while let Some(cause) = source {
            if let Some(hyper) = cause.downcast_ref::<hyper::Error>() {
                if hyper.is_user() {
                    let mut timed_out = false;
                    let mut inner = hyper.source();
                    while let Some(cause) = inner {
                        timed_out |= cause
                            .downcast_ref::<std::io::Error>()
                            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut);
                        inner = cause.source();
                    }
                    return Failure::RequestBody(if timed_out {
                        BodyFailure::TimedOut
                    } else {
                        BodyFailure::Broken
                    });
                }
            }
            source = cause.source();
        }
        return Failure::Backend(ErrorKind::Io);
    }
    Failure::Backend(connect_kind(error))
}

fn connect_kind(error: &hyper_util::client::legacy::Error) -> ErrorKind {
    let mut source = error.source();
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return ErrorKind::ConnectTimeout;
            }
        }
        source = cause.source();
    }
    ErrorKind::Connect
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_hop_by_hop_and_connection_named_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret"),
        );
        headers.insert("x-secret", HeaderValue::from_static("1"));
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        headers.insert("x-end-to-end", HeaderValue::from_static("kept"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
        remove_hop_by_hop(&mut headers);
        let names: Vec<_> = headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(headers.contains_key("x-end-to-end"));
        assert!(headers.contains_key(header::AUTHORIZATION));

        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, Upgrade, x-Gone, , x-absent"),
        );
        headers.append(header::CONNECTION, HeaderValue::from_static("x-other"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("h2c"));
        headers.insert("x-gone", HeaderValue::from_static("1"));
        headers.insert("x-other", HeaderValue::from_static("1"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        remove_hop_by_hop(&mut headers);
        let names: Vec<_> = headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["content-type"]);
    }

    #[test]
    fn every_hop_by_hop_name_passes_the_length_filter() {
        for hop in &HOP_BY_HOP {
            let mut headers = HeaderMap::new();
            headers.insert(hop.clone(), HeaderValue::from_static("x"));
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            remove_hop_by_hop(&mut headers);
            assert_eq!(headers.len(), 1, "{hop}");
        }
    }

    #[test]
    fn appends_to_forwarded_for() {
        let peer = ForwardedFor::new("192.0.2.7:5000".parse().unwrap());
        let mut headers = HeaderMap::new();
        append_forwarded_for(&mut headers, &peer);
        assert_eq!(headers[&X_FORWARDED_FOR], "192.0.2.7");
        append_forwarded_for(&mut headers, &peer);
        assert_eq!(headers[&X_FORWARDED_FOR], "192.0.2.7, 192.0.2.7");
        headers.append(&X_FORWARDED_FOR, HeaderValue::from_static("198.51.100.1"));
        append_forwarded_for(&mut headers, &peer);
        assert_eq!(
            headers[&X_FORWARDED_FOR],
            "192.0.2.7, 192.0.2.7, 198.51.100.1, 192.0.2.7"
        );
        // The value an HTTP/1 client's lines get is made the same way, bytes kept as they came.
        assert_eq!(peer.appended_to(None).as_bytes(), b"192.0.2.7");
        let sent: [&[u8]; 2] = [b"a", b"b\xff"];
        assert_eq!(peer.appended_to(sent).as_bytes(), b"a, b\xff, 192.0.2.7");
    }

    #[test]
    fn the_http1_sides_leave_out_the_same_hop_by_hop_fields() {
        for name in &HOP_BY_HOP {
            assert!(h1::hop_by_hop(name.as_str().as_bytes()).is_some(), "{name}");
        }
        for name in [
            "host",
            "content-length",
            "authorization",
            "x-forwarded-for",
            "t",
            "tee",
        ] {
            assert!(h1::hop_by_hop(name.as_bytes()).is_none(), "{name}");
        }
    }
}
