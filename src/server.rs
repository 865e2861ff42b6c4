//! The listener: accepts HTTP/1.1 and HTTP/2 cleartext connections, routes admin paths to the
//! admin API and everything else through the balancer to a backend, and shuts down gracefully.

use std::convert::Infallible;
use std::future::Future;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::admin;
use crate::balancer::Balancer;
use crate::body::ResponseBody;
use crate::config::Settings;
use crate::metrics::MetricsError;
use crate::proxy::{self, UpstreamClient};
use crate::response;
use crate::strategies::RequestInfo;

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
}

struct Shared {
    balancer: Arc<Balancer>,
    client: UpstreamClient,
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
    /// Binds the configured port on all interfaces (IPv6 dual-stack where available, else IPv4).
    pub async fn bind(settings: Settings) -> Result<Self, StartError> {
        let port = settings.config.port;
        let v6 = SocketAddr::from((Ipv6Addr::UNSPECIFIED, port));
        match TcpListener::bind(v6).await {
            Ok(listener) => Self::with_listener(settings, listener),
            Err(_) => {
                Self::bind_to(settings, SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))).await
            }
        }
    }

    /// Binds `addr` (tests use `127.0.0.1:0`).
    pub async fn bind_to(settings: Settings, addr: SocketAddr) -> Result<Self, StartError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Bind { addr, source })?;
        Self::with_listener(settings, listener)
    }

    fn with_listener(settings: Settings, listener: TcpListener) -> Result<Self, StartError> {
        let balancer = Balancer::new(&settings)?;
        let client = proxy::client(settings.connect_timeout(), &settings.extra_ca_certs);
        Ok(Self {
            shared: Arc::new(Shared { balancer, client }),
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

    /// The balancer, for inspection and for setting backends without HTTP.
    pub fn balancer(&self) -> &Arc<Balancer> {
        &self.shared.balancer
    }

    /// Serves until `shutdown` resolves, then stops accepting and lets in-flight requests finish
    /// for up to the configured shutdown timeout.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let Router {
            shared,
            listener,
            settings,
        } = self;
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder.http1().timer(TokioTimer::new()).keep_alive(true);
        builder.http2().timer(TokioTimer::new());
        let graceful = GracefulShutdown::new();
        let state_log = tokio::spawn(log_state_periodically(
            Arc::clone(&shared.balancer),
            settings.state_log_interval(),
        ));
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, peer) = match accepted {
                        Ok(accepted) => accepted,
                        Err(error) => {
                            // Out of file descriptors and the like: back off instead of spinning.
                            tracing::warn!(%error, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let shared = Arc::clone(&shared);
                    let service = service_fn(move |request| {
                        let shared = Arc::clone(&shared);
                        async move { Ok::<_, Infallible>(route(&shared, request, peer).await) }
                    });
                    let connection = builder.serve_connection(TokioIo::new(stream), service);
                    let connection = graceful.watch(connection.into_owned());
                    tokio::spawn(async move {
                        if let Err(error) = connection.await {
                            tracing::debug!(%peer, error = %error, "connection ended with an error");
                        }
                    });
                }
                () = &mut shutdown => break,
            }
        }
        drop(listener);
        tracing::info!(
            timeout_s = settings.config.shutdown_timeout,
            "shutting down: listener closed, waiting for in-flight requests"
        );
        match tokio::time::timeout(settings.shutdown_timeout(), graceful.shutdown()).await {
            Ok(()) => tracing::info!("all connections finished"),
            Err(_) => tracing::warn!("shutdown timeout reached with connections still open"),
        }
        state_log.abort();
    }
}

async fn route(
    shared: &Shared,
    request: Request<Incoming>,
    peer: SocketAddr,
) -> Response<ResponseBody> {
    if admin::is_admin_path(request.uri().path()) {
        return admin::handle(&shared.balancer, request).await;
    }
    let info = RequestInfo {
        method: request.method().clone(),
    };
    let lease = match shared.balancer.admit(info).await {
        Ok(lease) => lease,
        Err(rejection) => return response::rejection(rejection),
    };
    shared.balancer.metrics().dispatched.add(1, &[]);
    tracing::debug!(
        method = %request.method(),
        path = request.uri().path(),
        backend = %lease.backend().addr(),
        "proxying request"
    );
    proxy::forward(&shared.client, request, lease, peer).await
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
