//! The listener: accepts HTTP/1.1 and HTTP/2 cleartext connections, routes admin paths to the
//! admin API and everything else through the balancer to a backend, and shuts down gracefully.

use std::convert::Infallible;
use std::future::Future;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::Either;
use http::{HeaderValue, Request, Response, StatusCode, header};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};

use crate::access_log::AccessLog;
use crate::admin::{self, AdminConfig};
use crate::balancer::Balancer;
use crate::body::{ClientBody, H2Body};
use crate::config::Settings;
use crate::forwarding::{ForwardedFor, SET_BY_PROXY};
use crate::h1::{self, FieldLines};
use crate::health::HttpProbe;
use crate::metrics::MetricsError;
use crate::observed::ResponseBody;
use crate::pool;
use crate::proxy::{self, ProxyPolicy};
use crate::response;
use crate::retry_budget::RetryBudget;
use crate::traces::Traces;
use crate::upstream::UpstreamClient;

mod h2;
use arc_swap::ArcSwap;

/// Errors starting the router.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The port could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// What was tried.
        addr: SocketAddr,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The metrics exporter could not be set up.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// The trace exporter could not be set up.
    #[error("{0}")]
    Traces(String),
}

struct Shared {
    balancer: Arc<Balancer>,
    /// What proxying is held to; replaced by a reload.
    policy: ArcSwap<ProxyPolicy>,
    admin: ArcSwap<AdminConfig>,
    /// What new HTTP/1 connections are held to; replaced by a reload.
    limits: ArcSwap<h1::server::Limits>,
    /// The tracer (made once at start, from the `OTEL_*` environment).
    traces: Option<Traces>,
    /// How requests and probes reach backends; replaced by a reload.
    client: Arc<ArcSwap<UpstreamClient>>,
    /// Failure retries allowed, shared by all requests (kept across reloads).
    retry_budget: Arc<RetryBudget>,
}

fn policy_of(
    settings: &Settings,
    traces: Option<&Traces>,
    client: Arc<UpstreamClient>,
    retry_budget: &Arc<RetryBudget>,
) -> ProxyPolicy {
    let config = &settings.config;
    ProxyPolicy {
        retry: config.retry.clone(),
        buffer_budget: Arc::new(Semaphore::new(
            config.retry.max_buffered_bytes.div_ceil(1024),
        )),
        client,
        retry_budget: Arc::clone(retry_budget),
        traces: traces.cloned(),
        access_log: config.access_log.then(AccessLog::to_stdout),
        decision_headers: config.decision_headers,
    }
}

/// Applies a reloaded configuration to a running router (see [`Router::reloader`]).
pub struct Reloader {
    shared: Arc<Shared>,
    running: std::sync::Mutex<Settings>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader").finish_non_exhaustive()
    }
}

/// Keys read only at start (dotted, a section standing for all its keys): a reload that changes
/// them logs that they need a restart.
const RESTART_KEYS: [&str; 11] = [
    "host",
    "port",
    "backends",
    "dns_refresh",
    "max_connections",
    "worker_threads",
    "log_format",
    "state_log_interval",
    "shutdown",
    "retry.budget",
    "engine_metrics",
];

/// The value at a dotted `key` of a configuration as JSON (`None` if there is none).
fn value_at<'a>(config: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    key.split('.')
        .try_fold(config, |value, part| value.get(part))
}

impl Reloader {
    /// Applies `settings` to new requests and connections: the strategy and its parameters, the
    /// queue, retry, ejection and timeout settings, limits, the admin token and networks, the
    /// access log and decision headers. Requests in flight keep what they started with. Keys
    /// read only at start ([`RESTART_KEYS`]) are kept, and named in the answer.
    pub fn apply(&self, settings: Settings) -> Vec<&'static str> {
        let mut running = self
            .running
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let old = serde_json::to_value(&running.config).unwrap_or_default();
        let new = serde_json::to_value(&settings.config).unwrap_or_default();
        let needs_restart: Vec<&'static str> = RESTART_KEYS
            .into_iter()
            .filter(|key| value_at(&old, key) != value_at(&new, key))
            .collect();
        // The strategy is built with the `[latency]` settings too (the reference rules' threshold).
        let strategy_changed = running.config.strategy != settings.config.strategy
            || running.config.latency != settings.config.latency;
        let strategy = strategy_changed.then(|| Arc::clone(&settings.strategy));
        self.shared
            .balancer
            .reconfigure(settings.tuning(), strategy);
        let names = self.shared.client.load().tls_names().clone();
        let client = Arc::new(settings.upstream_client(names));
        self.shared.client.store(Arc::clone(&client));
        let policy = policy_of(
            &settings,
            self.shared.traces.as_ref(),
            client,
            &self.shared.retry_budget,
        );
        self.shared.policy.store(Arc::new(policy));
        self.shared
            .admin
            .store(Arc::new(settings.config.admin.clone()));
        self.shared.limits.store(Arc::new(settings.config.limits));
        // What runs is what is kept: keys read only at start keep their running values, so a
        // later reload compares against them (and still names them) and the log shows them.
        let mut settings = settings;
        let (kept, config) = (&running.config, &mut settings.config);
        config.host.clone_from(&kept.host);
        config.port = kept.port;
        config.backends.clone_from(&kept.backends);
        config.dns_refresh = kept.dns_refresh;
        config.max_connections = kept.max_connections;
        config.worker_threads = kept.worker_threads;
        config.log_format = kept.log_format;
        config.state_log_interval = kept.state_log_interval;
        config.shutdown = kept.shutdown;
        config.retry.budget = kept.retry.budget;
        config.engine_metrics.clone_from(&kept.engine_metrics);
        debug_assert!({
            let stored = serde_json::to_value(&*config).unwrap_or_default();
            RESTART_KEYS
                .iter()
                .all(|key| value_at(&old, key) == value_at(&stored, key))
        });
        *running = settings;
        needs_restart
    }
}

/// Connections the kernel completes and queues for the accept loop (the listen backlog). The
/// standard library's 128 overflows when thousands of clients connect within a second (a
/// streaming fleet reconnecting, say): SYNs are dropped and those clients wait for their
/// retransmission, a second or more. HAProxy asks for its `maxconn`, nginx for 511; the kernel
/// caps the value at `net.core.somaxconn` (4096 by default since Linux 5.4).
const LISTEN_BACKLOG: u32 = 4096;

/// A listening socket on `addr`, with `SO_REUSEADDR` (as the standard library sets it) and a
/// backlog of [`LISTEN_BACKLOG`]. An IPv6 wildcard accepts IPv4 too where the system allows it.
fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Serves an HTTP/2 (h2c) connection with hyper until it ends, the router has drained it, it
/// has stayed idle for the header timeout or a stream's answer stalled for the send timeout
/// (see [`h2`]).
async fn serve_h2(
    builder: &auto::Builder<TokioExecutor>,
    stream: TcpStream,
    shared: Arc<Shared>,
    client: Arc<ForwardedFor>,
    mut draining: watch::Receiver<bool>,
    peer: SocketAddr,
    limits: h1::server::Limits,
) {
    let streams = Arc::new(h2::Streams::new());
    let service = service_fn({
        let streams = Arc::clone(&streams);
        move |request: Request<hyper::body::Incoming>| {
            let shared = Arc::clone(&shared);
            let client = Arc::clone(&client);
            let stream = streams.open();
            async move {
                let mut request = request;
                if let Err((status, refusal)) = h2_as_http1(&mut request, &limits) {
                    let answer = response::error(status, refusal);
                    return Ok(answer.map(|body| h2::Watched::new(body, stream)));
                }
                let request = request.map(|body| {
                    ClientBody::Right(H2Body::new(
                        body,
                        limits.body_read_timeout,
                        limits.allow_underscore_headers,
                    ))
                });
                let mut answer = route(&shared, request, None, &client).await;
                fields_into_map(&mut answer);
                Ok::<_, Infallible>(answer.map(|body| h2::Watched::new(body, stream)))
            }
        }
    });
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let (send_timeout, idle) = (limits.send_timeout, limits.header_read_timeout);
    let period = h2::check_period(send_timeout, idle);
    let mut check = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Told GOAWAY (draining or idle) at this time: the connection ends once its open streams
    // have, and is dropped when none is open `grace` after it (a client that never acks the
    // GOAWAY's PING, or never takes an answer's last bytes, would hold it forever).
    let mut closing: Option<tokio::time::Instant> = None;
    let grace = send_timeout.min(idle);
    loop {
        tokio::select! {
            ended = connection.as_mut() => {
                if let Err(error) = ended {
                    tracing::debug!(%peer, error = %error, "connection ended with an error");
                }
                return;
            }
            _ = draining.wait_for(|draining| *draining), if closing.is_none() => {
                closing = Some(tokio::time::Instant::now());
                connection.as_mut().graceful_shutdown();
            }
            () = streams.overrun() => {
                tracing::debug!(%peer, "streams went on opening after GOAWAY: connection dropped");
                return;
            }
            () = streams.spent(), if closing.is_none() => {
                tracing::debug!(%peer, "connection opened its last stream: told GOAWAY");
                closing = Some(tokio::time::Instant::now());
                connection.as_mut().graceful_shutdown();
            }
            _ = check.tick() => {
                match streams.check(send_timeout, idle) {
                    h2::Verdict::Fine => {}
                    h2::Verdict::Idle => {
                        if closing.is_none() {
                            closing = Some(tokio::time::Instant::now());
                            connection.as_mut().graceful_shutdown();
                        }
                    }
                    h2::Verdict::Stalled => {
                        tracing::debug!(%peer, "a stream's answer was not taken for send_timeout: connection closed");
                        return;
                    }
                }
                if closing.is_some_and(|since| since.elapsed() >= grace) && streams.none_open() {
                    tracing::debug!(%peer, "told GOAWAY, no stream open, not closed by the client: connection dropped");
                    return;
                }
            }
        }
    }
}

/// Makes an HTTP/2 request that hyper accepted into what its HTTP/1.1 head will say, or says
/// why it is answered instead (400, or 431 for too many fields): what the backend reads from
/// that head must be what the client asked, held to the HTTP/1 server's rules (RFC 9113 §8.3.1
/// for the authority, §8.2.3 for cookies).
fn h2_as_http1(
    request: &mut Request<hyper::body::Incoming>,
    limits: &h1::server::Limits,
) -> Result<(), (StatusCode, &'static str)> {
    let bad = |refusal| Err((StatusCode::BAD_REQUEST, refusal));
    let headers = request.headers_mut();
    // As many fields as the HTTP/1 server takes: the backend reads them as an HTTP/1.1 head,
    // where the cookie crumbs are one line (joined below).
    let crumbs = headers.get_all(header::COOKIE).iter().count();
    if headers.len() - crumbs.saturating_sub(1) > h1::MAX_HEADERS {
        return Err((
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "too many header fields",
        ));
    }
    if !limits.allow_underscore_headers {
        h1::drop_underscore_fields(headers);
    }
    // One `Host` and one `Content-Length` at most (RFC 9112 §3.2, §6.3), as the HTTP/1 server
    // and nginx require: h2 only checks that repeated lengths agree, and a backend would read
    // repeated fields as it likes. The length is held to the HTTP/1 syntax (h2 takes an empty
    // value for 0).
    for (name, refusal) in [
        (header::HOST, "duplicate Host"),
        (header::CONTENT_LENGTH, "duplicate Content-Length"),
    ] {
        if headers.get_all(name).iter().nth(1).is_some() {
            return bad(refusal);
        }
    }
    if let Some(length) = headers.get(header::CONTENT_LENGTH) {
        if h1::parse_content_length(length.as_bytes()).is_err() {
            return bad("invalid Content-Length");
        }
    }
    // The `:authority` is the `Host` the backend reads, held to the HTTP/1 server's rule (and
    // without user information); a `host` field that says otherwise is malformed (RFC 9113
    // §8.3.1), and a request with neither is the HTTP/1.1 request without `Host` the HTTP/1
    // server refuses.
    let authority = request
        .uri()
        .authority()
        .map(|authority| authority.as_str().as_bytes());
    let host = request
        .headers()
        .get(header::HOST)
        .map(HeaderValue::as_bytes);
    if let Some(refusal) = h1::server::host_refusal(authority, host) {
        return bad(refusal);
    }
    if authority.is_none() && host.is_none() {
        return bad("request without Host");
    }
    // Cookies split into fields of their own (as browsers send them over HTTP/2) are one line
    // again, joined with "; " (RFC 9113 §8.2.3).
    let headers = request.headers_mut();
    if headers.get_all(header::COOKIE).iter().nth(1).is_some() {
        let mut joined = Vec::new();
        for (at, value) in headers.get_all(header::COOKIE).iter().enumerate() {
            if at > 0 {
                joined.extend_from_slice(b"; ");
            }
            joined.extend_from_slice(value.as_bytes());
        }
        match HeaderValue::from_bytes(&joined) {
            Ok(joined) => {
                headers.insert(header::COOKIE, joined);
            }
            Err(_) => return bad("invalid Cookie"),
        }
    }
    // The `:path` becomes the request target: origin form, or asterisk form for OPTIONS only
    // (RFC 9113 §8.3.1), as the HTTP/1 server requires. hyper lets a path that starts with `?`
    // through (`GET ?a HTTP/1.1`).
    let uri = request.uri();
    if let Some(refusal) = h1::server::target_form_refusal(request.method(), uri) {
        return bad(refusal);
    }
    let target = uri.path_and_query().map(|path| path.as_str());
    match target {
        Some(target) if target != "*" && !target.starts_with('/') => bad("invalid request target"),
        _ => Ok(()),
    }
}

/// A bound router, ready to serve.
pub struct Router {
    shared: Arc<Shared>,
    listener: TcpListener,
    settings: Settings,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("local_addr", &self.local_addr())
            .finish_non_exhaustive()
    }
}

impl Router {
    /// Binds the configured host and port; with no host, all interfaces (IPv6 dual-stack where
    /// available, else IPv4).
    pub async fn bind(settings: Settings) -> Result<Self, StartError> {
        let port = settings.config.port;
        if let Some(ip) = settings.listen_ip() {
            return Self::bind_to(settings, SocketAddr::from((ip, port))).await;
        }
        let v6 = SocketAddr::from((Ipv6Addr::UNSPECIFIED, port));
        match listen(v6) {
            Ok(listener) => Self::with_listener(settings, listener),
            Err(_) => {
                Self::bind_to(settings, SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))).await
            }
        }
    }

    /// Binds `addr` (tests use `127.0.0.1:0`).
    pub async fn bind_to(settings: Settings, addr: SocketAddr) -> Result<Self, StartError> {
        let listener = listen(addr).map_err(|source| StartError::Bind { addr, source })?;
        Self::with_listener(settings, listener)
    }

    fn with_listener(settings: Settings, listener: TcpListener) -> Result<Self, StartError> {
        let balancer = settings.balancer()?;
        let client = Arc::new(ArcSwap::from_pointee(
            settings.upstream_client(crate::upstream::TlsNames::default()),
        ));
        balancer.set_prober(Arc::new(HttpProbe::new(Arc::clone(&client))));
        let retry_budget = Arc::new(settings.retry_budget());
        // Fixed backends are there from the start; DNS names join once `serve` resolves them.
        let discovery = settings.discovery();
        if !discovery.is_empty() {
            balancer.set_backends(discovery.addrs());
        }
        let traces = Traces::from_env().map_err(StartError::Traces)?;
        if traces.is_some() {
            tracing::info!("traces are exported over OTLP");
        }
        Ok(Self {
            shared: Arc::new(Shared {
                balancer,
                policy: ArcSwap::from_pointee(policy_of(
                    &settings,
                    traces.as_ref(),
                    client.load_full(),
                    &retry_budget,
                )),
                client,
                retry_budget,
                traces,
                admin: ArcSwap::from_pointee(settings.config.admin.clone()),
                limits: ArcSwap::from_pointee(settings.config.limits),
            }),
            listener,
            settings,
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has a local address")
    }

    /// What applies a reloaded configuration to this router while it serves.
    pub fn reloader(&self) -> Reloader {
        Reloader {
            shared: Arc::clone(&self.shared),
            running: std::sync::Mutex::new(self.settings.clone()),
        }
    }

    /// The balancer, for inspection and for setting backends without HTTP.
    pub fn balancer(&self) -> &Arc<Balancer> {
        &self.shared.balancer
    }

    /// Serves until `shutdown` resolves, then drains: health answers 503 at once, the listener
    /// stays open for `shutdown.pre_drain_delay` and then closes, and in-flight requests (queued
    /// ones included) may finish for up to `shutdown.timeout`.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let Router {
            shared,
            listener,
            settings,
        } = self;
        let config = &settings.config;
        // hyper serves only connections that opened with the HTTP/2 preface.
        let mut builder = auto::Builder::new(TokioExecutor::new()).http2_only();
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(h2::MAX_CONCURRENT_STREAMS)
            .max_header_list_size(
                u32::try_from(config.limits.max_header_bytes).unwrap_or(u32::MAX),
            );
        let (open, mut all_closed) = mpsc::channel::<()>(1);
        let acceptor = Acceptor {
            listener,
            builder: Arc::new(builder),
            draining: watch::channel(false).0,
            open,
            slots: Arc::new(Semaphore::new(settings.max_connections())),
            shared: Arc::clone(&shared),
        };
        let state_log = tokio::spawn(log_state_periodically(
            Arc::clone(&shared.balancer),
            config.state_log_interval,
        ));
        let reaper = tokio::spawn(reap_idle_connections(Arc::clone(&shared.balancer)));
        let engine_scraper = crate::engine_scrape::spawn(
            Arc::clone(&shared.balancer),
            Arc::clone(&shared.client),
            config.engine_metrics.clone(),
        );
        let discovery = settings.discovery();
        let discovery = discovery.has_dns().then(|| {
            let names = shared.client.load().tls_names().clone();
            tokio::spawn(discovery.run(Arc::clone(&shared.balancer), names))
        });
        acceptor.accept_until(shutdown).await;
        if let Some(discovery) = discovery {
            discovery.abort();
        }
        shared.balancer.start_draining();
        let shutdown = config.shutdown;
        tracing::info!(
            pre_drain_delay_s = shutdown.pre_drain_delay.as_secs_f64(),
            "draining: health answers 503"
        );
        if !shutdown.pre_drain_delay.is_zero() {
            acceptor
                .accept_until(tokio::time::sleep(shutdown.pre_drain_delay))
                .await;
        }
        let Acceptor {
            listener,
            draining,
            open,
            ..
        } = acceptor;
        drop(listener);
        tracing::info!(
            timeout_s = shutdown.timeout.as_secs_f64(),
            "listener closed, waiting for in-flight requests"
        );
        // HTTP/1 connections close once their current response is written (at once when idle),
        // HTTP/2 ones are told GOAWAY and close once their open streams have ended; each holds a
        // clone of `open`, so `all_closed` ends when the last one has.
        draining.send_replace(true);
        drop(open);
        match tokio::time::timeout(shutdown.timeout, all_closed.recv()).await {
            Ok(_) => tracing::info!("all connections finished"),
            Err(_) => tracing::warn!("shutdown timeout reached with connections still open"),
        }
        state_log.abort();
        reaper.abort();
        if let Some(engine_scraper) = engine_scraper {
            engine_scraper.abort();
        }
        if let Some(traces) = &shared.traces {
            // Export the spans still batched.
            traces.shutdown();
        }
    }
}

/// The accept loop's state: at most `max_connections` connections are served at once; further
/// clients wait in the listen backlog.
struct Acceptor {
    /// What HTTP/1 connections are held to; the header timeout also bounds the wait for a new
    /// connection's first byte.
    listener: TcpListener,
    /// Connections that may be HTTP/2 with prior knowledge: the protocol is read from the preface.
    builder: Arc<auto::Builder<TokioExecutor>>,
    /// Tells connections the router drains.
    draining: watch::Sender<bool>,
    /// Held by each connection until it ends.
    open: mpsc::Sender<()>,
    slots: Arc<Semaphore>,
    shared: Arc<Shared>,
}

impl Acceptor {
    async fn accept_until(&self, stop: impl Future<Output = ()>) {
        tokio::pin!(stop);
        loop {
            let slot = tokio::select! {
                slot = Arc::clone(&self.slots).acquire_owned() => slot,
                () = &mut stop => return,
            };
            let Ok(slot) = slot else { return };
            let accepted = tokio::select! {
                accepted = self.listener.accept() => accepted,
                () = &mut stop => return,
            };
            match accepted {
                Ok((stream, peer)) => self.serve_connection(stream, peer, slot),
                Err(error) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn serve_connection(&self, stream: TcpStream, peer: SocketAddr, slot: OwnedSemaphorePermit) {
        let _ = stream.set_nodelay(true);
        let shared = Arc::clone(&self.shared);
        let client = Arc::new(ForwardedFor::new(peer));
        let builder = Arc::clone(&self.builder);
        let limits = **self.shared.limits.load();
        let draining = self.draining.subscribe();
        let open = self.open.clone();
        tokio::spawn(async move {
            // A client that connects and sends nothing does not keep a connection slot, nor a
            // drain waiting: it is closed when draining starts.
            let preface = tokio::time::timeout(limits.header_read_timeout, h2_preface(&stream));
            let mut drain_started = draining.clone();
            let preface = tokio::select! {
                preface = preface => preface,
                _ = drain_started.wait_for(|draining| *draining) => return,
            };
            let Ok(Some(h2)) = preface else {
                return;
            };
            // Only a connection that opens with the whole HTTP/2 preface is HTTP/2; any other
            // start is an HTTP/1 request (or garbage, answered 400 by the HTTP/1 server).
            if !h2 {
                let (reader, writer) = stream.into_split();
                let routes = Routes { shared, client };
                h1::server::serve(
                    Box::new(reader),
                    writer,
                    limits,
                    SET_BY_PROXY,
                    draining,
                    routes,
                )
                .await;
                drop(open);
                drop(slot);
                return;
            }
            // Boxed: an HTTP/2 connection's state is large, and the task of every HTTP/1
            // connection would be as large if it were kept inline.
            let served = serve_h2(&builder, stream, shared, client, draining, peer, limits);
            Box::pin(served).await;
            drop(open);
            drop(slot);
        });
    }
}

/// The HTTP/2 connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Whether the connection opens with the whole HTTP/2 preface: peeks until the bytes received
/// stop matching it (`false`) or match it whole (`true`); `None` if the client closed first.
async fn h2_preface(stream: &TcpStream) -> Option<bool> {
    let mut first = [0u8; H2_PREFACE.len()];
    let mut seen = 0;
    loop {
        let peeked = stream.peek(&mut first).await.ok()?;
        if peeked == 0 {
            return None;
        }
        if !H2_PREFACE.starts_with(&first[..peeked]) {
            return Some(false);
        }
        if peeked == H2_PREFACE.len() {
            return Some(true);
        }
        if peeked == seen {
            // A prefix of the preface and nothing new yet. A peek leaves the socket readable, so
            // there is no readiness to wait on: look again shortly (only a client whose first
            // segment is a prefix of the preface, such as a lone `P`, comes here).
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        seen = peeked;
    }
}

/// Puts the field lines a plain-HTTP backend sent into the response's map, for hyper to write
/// (the router's HTTP/1 server writes the lines as they are).
fn fields_into_map(answer: &mut Response<ResponseBody>) {
    let http_body_util::Either::Left(observed) = answer.body() else {
        return;
    };
    let Some(passthrough) = observed.passthrough() else {
        return;
    };
    let lines = passthrough.lines.clone();
    let mut fields = Vec::new();
    for line in lines.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(&line[..colon]),
            http::HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
        ) else {
            continue;
        };
        fields.push((name, value));
    }
    for (name, value) in fields {
        answer.headers_mut().append(name, value);
    }
}

/// The answer to `request`: from the admin API for its paths, from a backend otherwise.
///
/// Not an `async fn`: the proxy's future is returned as it is, so that it is not moved into one
/// more future on each request (the admin API's, seldom called, is boxed to keep it small).
///
/// An HTTP/1 request may come with its fields as lines (its map then empty).
fn route<'a>(
    shared: &'a Shared,
    mut request: Request<ClientBody>,
    fields: Option<FieldLines>,
    client: &'a ForwardedFor,
) -> impl Future<Output = Response<ResponseBody>> + 'a {
    if admin::is_admin_path(request.uri().path()) {
        if let Some(fields) = fields {
            *request.headers_mut() = fields.to_map();
        }
        let admin = shared.admin.load_full();
        Either::Left(Box::pin(async move {
            admin::handle(&shared.balancer, &admin, request).await
        }))
    } else {
        Either::Right(proxy::proxy(
            &shared.balancer,
            shared.policy.load_full(),
            request,
            fields,
            client,
        ))
    }
}

/// Routes the requests of one HTTP/1 connection.
struct Routes {
    shared: Arc<Shared>,
    client: Arc<ForwardedFor>,
}

impl h1::server::Handler for Routes {
    type Body = ResponseBody;

    fn call(
        &self,
        request: Request<h1::server::IncomingBody>,
        fields: Option<FieldLines>,
    ) -> impl Future<Output = Response<ResponseBody>> {
        route(
            &self.shared,
            request.map(ClientBody::Left),
            fields,
            &self.client,
        )
    }

    fn refused(&self, status: StatusCode) {
        if let Some(log) = self.shared.policy.load().access_log.as_ref() {
            crate::access_log::Pending::refused(log).finish(
                status.as_u16(),
                0,
                Some("invalid_request"),
            );
        }
    }

    fn refuse_unread(
        &self,
        request: &Request<()>,
        fields: Option<&FieldLines>,
        declared: Option<u64>,
    ) -> Option<Response<ResponseBody>> {
        let path = request.uri().path();
        if !admin::is_admin_path(path) {
            return None;
        }
        let headers = fields.map(FieldLines::to_map);
        let headers = headers.as_ref().unwrap_or(request.headers());
        let admin = self.shared.admin.load();
        admin::refusal(&admin, request.method(), path, headers, declared)
    }
}

/// Closes backend connections idle for longer than the idle timeout, a third of it apart.
async fn reap_idle_connections(balancer: Arc<Balancer>) {
    let every = pool::IDLE_TIMEOUT / 3;
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        for backend in balancer.backends().iter() {
            backend.connections().reap(pool::IDLE_TIMEOUT);
        }
    }
}

async fn log_state_periodically(balancer: Arc<Balancer>, every: Duration) {
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let backends = balancer.backends();
        let states: Vec<String> = backends
            .iter()
            .map(|b| {
                let ewma = b
                    .ewma_latency()
                    .map_or_else(|| "-".to_owned(), |e| format!("{e:.3}s"));
                format!(
                    "{} in_flight={} ewma={} completed={}",
                    b.addr(),
                    b.in_flight(),
                    ewma,
                    b.completed()
                )
            })
            .collect();
        tracing::info!(
            queue_depth = balancer.queue_depth(),
            backends = ?states,
            "backend state"
        );
    }
}
