//! The listener: accepts HTTP/1.1 and HTTP/2 cleartext connections, routes admin paths to the
//! admin API and everything else through the balancer to a backend, and shuts down gracefully.
//! HTTP/1.1 connections are served by `h1::server`; HTTP/2 ones by hyper (`h2c`, under the
//! watch of `h2`); a reloaded configuration is applied by [`Reloader`] (`reload`).

use std::future::Future;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::future::Either;
use http::{Request, Response, StatusCode};
use hyper_util::rt::TokioExecutor;
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};

use crate::access_log::AccessLog;
use crate::admin::{self, AdminConfig};
use crate::balancer::Balancer;
use crate::body::ClientBody;
use crate::config::Settings;
use crate::forwarding::{ForwardedFor, SET_BY_PROXY};
use crate::h1::{self, FieldLines};
use crate::health::HttpProbe;
use crate::metrics::MetricsError;
use crate::observed::ResponseBody;
use crate::pool;
use crate::proxy::{self, ProxyPolicy};
use crate::retry_budget::RetryBudget;
use crate::traces::Traces;
use crate::upstream::UpstreamClient;

mod h2;
mod h2c;
mod reload;

pub use reload::Reloader;

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

/// What the router's connections and requests share, and a reload replaces parts of.
struct Shared {
    /// Admission, the backends and their statistics (reconfigured by a reload).
    balancer: Arc<Balancer>,
    /// What proxying is held to; replaced by a reload.
    policy: ArcSwap<ProxyPolicy>,
    /// The admin API's settings (the token set-backends requires, the networks backends must be
    /// in); replaced by a reload.
    admin: ArcSwap<AdminConfig>,
    /// What new client connections are held to, HTTP/1 and HTTP/2 (the header timeout also
    /// bounds the wait for a new connection's first bytes); replaced by a reload.
    limits: ArcSwap<h1::server::Limits>,
    /// The tracer (made once at start, from the `OTEL_*` environment).
    traces: Option<Traces>,
    /// How requests and probes reach backends; replaced by a reload.
    client: Arc<ArcSwap<UpstreamClient>>,
    /// Failure retries allowed, shared by all requests (kept across reloads).
    retry_budget: Arc<RetryBudget>,
}

/// What proxying is held to under `settings`, with the router's `traces`: requests go through
/// `client` and share `retry_budget`.
fn policy_of(
    settings: &Settings,
    traces: Option<&Traces>,
    client: Arc<UpstreamClient>,
    retry_budget: &Arc<RetryBudget>,
) -> ProxyPolicy {
    let config = &settings.config;
    ProxyPolicy {
        retry: config.retry.clone(),
        retry_rules: proxy::RetryPolicy::new(&config.retry),
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

/// A bound router, ready to serve.
pub struct Router {
    /// What its connections and requests share (its reloader holds it too).
    shared: Arc<Shared>,
    /// The bound socket it will accept connections from.
    listener: TcpListener,
    /// The configuration it was bound with, which its reloader starts from.
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

    /// The router that serves `settings` on `listener`: balancer, upstream client, retry budget,
    /// tracer; the fixed backends set at once.
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
        Reloader::new(Arc::clone(&self.shared), self.settings.clone())
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
        let (open, mut all_closed) = mpsc::channel::<()>(1);
        let acceptor = Acceptor {
            listener,
            builder: Arc::new(h2c::builder(&config.limits)),
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
    /// The bound socket connections are accepted from; each may be HTTP/1.1 or HTTP/2 with prior
    /// knowledge (the protocol is read from its first bytes).
    listener: TcpListener,
    /// hyper's HTTP/2 server, for the connections that open with the HTTP/2 preface.
    builder: Arc<auto::Builder<TokioExecutor>>,
    /// Tells connections the router drains.
    draining: watch::Sender<bool>,
    /// Held by each connection until it ends.
    open: mpsc::Sender<()>,
    /// One permit per connection served at once (`max_connections`), held until it ends.
    slots: Arc<Semaphore>,
    /// What the connections' requests are routed with.
    shared: Arc<Shared>,
}

impl Acceptor {
    /// Accepts connections, each once a slot is free, and serves each in a task of its own,
    /// until `stop` resolves.
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

    /// Serves one accepted connection in a task of its own: HTTP/1.1 by `h1::server`, HTTP/2 by
    /// hyper; the connection holds `slot`, and a clone of `open`, until it ends.
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
            let preface =
                tokio::time::timeout(limits.header_read_timeout, h2c::h2_preface(&stream));
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
            let served = h2c::serve_h2(&builder, stream, shared, client, draining, peer, limits);
            Box::pin(served).await;
            drop(open);
            drop(slot);
        });
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

/// Logs the queue depth and each backend's in-flight count, EWMA latency and completed count,
/// `every` apart.
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
