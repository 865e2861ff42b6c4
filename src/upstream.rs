//! How requests reach backends over HTTP/1.1: `http://` backends over their own keep-alive
//! connections ([`crate::pool`]), `https://` ones over hyper-util's pooled rustls client, and how
//! a failed exchange is told apart (a connect failure, a timeout, an I/O error, or the client's own
//! request body failing).

use std::error::Error as _;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::future::{self, FutureExt as _};
use http::Response;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::CertificateDer;

use crate::backend::{Backend, BackendAddr, ErrorKind};
use crate::body::{BackendBody, BodyFailure, UpstreamBody};
use crate::forwarding::RequestHead;
use crate::pool::{self, Failure};

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
                .map(|sent| sent.map(|response| response.map(BackendBody::Left))),
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
            Ok(response) => Ok(response.map(BackendBody::Right)),
            Err(error) => Err(classify(&error)),
        }
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

fn classify(error: &hyper_util::client::legacy::Error) -> Failure {
    if !error.is_connect() {
        // The request body's own error comes back as hyper's "user body" error.
        let mut source = error.source();
        while let Some(cause) = source {
            if cause
                .downcast_ref::<hyper::Error>()
                .is_some_and(hyper::Error::is_user)
            {
                return Failure::RequestBody(BodyFailure::of(cause));
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
