//! How requests reach backends over HTTP/1.1: `http://` backends over their own keep-alive
//! connections ([`crate::pool`]), `https://` ones over hyper-util's pooled rustls client, and how
//! a failed exchange is told apart (a connect failure, a timeout, an I/O error, or the client's own
//! request body failing).

use std::error::Error as _;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::future::{self, FutureExt as _};
use http::Response;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::CertificateDer;
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, BackendAddr, ErrorKind};
use crate::body::{BackendBody, BodyFailure, UpstreamBody};
use crate::forwarding::RequestHead;
use crate::pool::{self, Failure};

/// The `[upstream]` section: how the router talks to backends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// How long opening a connection to a backend may take.
    #[serde(with = "crate::forms::seconds")]
    pub connect_timeout: Duration,
    /// How long an attempt may take, from its start (connecting included) to the response head
    /// (`None`: no limit).
    #[serde(with = "crate::forms::seconds_or_off")]
    pub first_byte_timeout: Option<Duration>,
    /// How long a backend may leave a response body, or a request being written, without
    /// progress (`None`: no limit).
    #[serde(with = "crate::forms::seconds_or_off")]
    pub idle_timeout: Option<Duration>,
    /// PEM file of extra CA certificates trusted for `https://` backends (the system store is
    /// always trusted); the configuration reads it and hands the certificates to [`client`].
    pub tls_ca_file: Option<PathBuf>,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            first_byte_timeout: None,
            idle_timeout: Some(Duration::from_secs(300)),
            tls_ca_file: None,
        }
    }
}

/// How requests reach backends over HTTP/1.1: `http://` backends over their own keep-alive
/// connections ([`crate::pool`]), `https://` ones over a pooled rustls client built on first use
/// (loading the system's CA certificates costs startup time and memory that plain-HTTP
/// deployments need not pay).
pub struct UpstreamClient {
    https: OnceLock<Client<HttpsConnector<HttpConnector>, UpstreamBody>>,
    config: UpstreamConfig,
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
    /// What the client is held to (the proxy reads the first-byte and idle timeouts here too).
    pub fn config(&self) -> &UpstreamConfig {
        &self.config
    }

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
                    self.config.connect_timeout,
                    self.config.idle_timeout,
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
                .wrap_connector(http_connector(self.config.connect_timeout));
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

/// Builds the upstream client held to `config`: keep-alive connections, `TCP_NODELAY`, connect
/// timeout; TLS for `https://` backends trusting the system store plus `extra_ca_certs` (read from
/// `config.tls_ca_file`).
pub fn client(
    config: UpstreamConfig,
    extra_ca_certs: &[CertificateDer<'static>],
) -> UpstreamClient {
    UpstreamClient {
        https: OnceLock::new(),
        config,
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
