//! How requests reach backends over HTTP/1.1: `http://` backends over their own keep-alive
//! connections ([`crate::pool`]), `https://` ones over hyper-util's pooled rustls client, and how
//! a failed exchange is told apart (a connect failure, a timeout, an I/O error, or the client's own
//! request body failing).

use std::collections::HashMap;
use std::error::Error as _;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::future::{self, FutureExt as _};
use http::Response;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder, ResolveServerName as _};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{HttpConnector, capture_connection};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::{CertificateDer, ServerName};
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, BackendAddr, ErrorKind};
use crate::body::{BackendBody, BodyFailure, UpstreamBody};
use crate::forwarding::RequestHead;
use crate::h1;
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
    https: OnceLock<Client<Bounded<HttpsConnector<HttpConnector>>, UpstreamBody>>,
    config: UpstreamConfig,
    extra_ca_certs: Vec<CertificateDer<'static>>,
    tls_names: TlsNames,
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

    /// The names `dns+https://` backends are checked for (shared with discovery, and with the
    /// client a reload builds).
    pub fn tls_names(&self) -> &TlsNames {
        &self.tls_names
    }

    /// A bodiless `GET path` to `backend` (the router's own requests: engine metrics, probes),
    /// its answer's status and body, read whole up to `max_body` bytes (`None` past that, or
    /// when the exchange failed). A body read to its end gives its connection back to the
    /// backend's idle stack, as a proxied answer's does.
    pub async fn get(
        &self,
        backend: &Arc<Backend>,
        path: &str,
        max_body: usize,
    ) -> Option<(http::StatusCode, bytes::Bytes)> {
        use http_body::Body as _;
        let mut head = RequestHead::probe(path)?;
        let empty = UpstreamBody::full(bytes::Bytes::new());
        let response = self.send(backend, &mut head, empty, true).await.ok()?;
        let (parts, mut body) = response.into_parts();
        let mut read = bytes::BytesMut::new();
        while let Some(frame) =
            std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await
        {
            if let Ok(data) = frame.ok()?.into_data() {
                if read.len() + data.len() > max_body {
                    return None;
                }
                read.extend_from_slice(&data);
            }
        }
        if let Some(connection) = crate::body::Pooled::take_connection(&mut body) {
            backend
                .connections()
                .put(connection, tokio::time::Instant::now());
        }
        Some((parts.status, read.freeze()))
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
                .with_server_name_resolver({
                    let names = self.tls_names.clone();
                    move |uri: &http::Uri| server_name(&names, uri)
                })
                .enable_http1()
                .wrap_connector(http_connector(self.config.connect_timeout));
            pooled(Bounded {
                inner: connector,
                timeout: self.config.connect_timeout,
                write_stall: self.config.idle_timeout,
            })
        });
        let mut request = head.tls_request(addr, body, last);
        let head_request = request.method() == http::Method::HEAD;
        let connection = capture_connection(&mut request);
        let mut response = match https.request(request).await {
            Ok(response) => response,
            Err(error) => return Err(classify(&error)),
        };
        // hyper's pool reuses a connection once its answer has been read; the framing the
        // router's own client refuses or closes on ([`tls_framing`]) must end it here too.
        let poison = || {
            if let Some(connected) = connection.connection_metadata().as_ref() {
                connected.poison();
            }
        };
        match tls_framing(&response, head_request) {
            TlsFraming::Clean => {}
            TlsFraming::CloseAfter => poison(),
            TlsFraming::Refused => {
                poison();
                return Err(Failure::Backend(ErrorKind::Io));
            }
        }
        if response.status() == http::StatusCode::NO_CONTENT {
            response.headers_mut().remove(http::header::CONTENT_LENGTH);
        }
        Ok(response.map(BackendBody::Right))
    }
}

/// The TLS names of the addresses `dns+https://` discovery found: such a backend is reached at
/// its IP address, and its certificate checked (and SNI sent) for the name that resolved to it,
/// not for the address. One per router, shared by its clients and its discovery.
#[derive(Debug, Clone, Default)]
pub struct TlsNames(Arc<std::sync::RwLock<HashMap<std::net::SocketAddr, ServerName<'static>>>>);

impl TlsNames {
    /// The `https://` backends found by resolving a name, with that name. Replaces every earlier
    /// note, so addresses that left the set are forgotten. A name that is not a valid TLS server
    /// name is not noted.
    pub fn set<'a>(&self, found: impl IntoIterator<Item = (std::net::SocketAddr, &'a str)>) {
        let names: HashMap<_, _> = found
            .into_iter()
            .filter_map(|(addr, name)| Some((addr, ServerName::try_from(name.to_owned()).ok()?)))
            .collect();
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = names;
    }

    /// The name noted for `addr`.
    pub fn get(&self, addr: std::net::SocketAddr) -> Option<ServerName<'static>> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&addr)
            .cloned()
    }
}

/// The name an `https://` backend's certificate is checked for: the discovered name of its
/// address ([`TlsNames`]), else the host of its URI.
fn server_name(
    names: &TlsNames,
    uri: &http::Uri,
) -> Result<ServerName<'static>, Box<dyn std::error::Error + Send + Sync>> {
    let discovered = uri
        .authority()
        .and_then(|authority| authority.as_str().parse().ok())
        .and_then(|addr| names.get(addr));
    match discovered {
        Some(name) => Ok(name),
        None => hyper_rustls::DefaultServerNameResolver::default().resolve(uri),
    }
}

/// What the framing of an `https://` backend's answer calls for.
#[derive(Debug, PartialEq, Eq)]
enum TlsFraming {
    Clean,
    /// Relayed, but the connection is not reused: a bodiless answer (HEAD, 204, 304) that
    /// announces a body, whose bytes, if the backend sends them, would be read as the next
    /// answer.
    CloseAfter,
    /// Refused (502) and the connection closed, as the router's own client refuses it: an
    /// unasked-for `101`, a `Content-Length` twice, as a list or not digits, both
    /// `Content-Length` and `Transfer-Encoding`, or a `Transfer-Encoding` other than one
    /// `chunked` (hyper would read such a body one way, the client perhaps another).
    Refused,
}

fn tls_framing<B>(response: &Response<B>, head_request: bool) -> TlsFraming {
    let headers = response.headers();
    let mut lengths = headers.get_all(http::header::CONTENT_LENGTH).iter();
    let length = lengths.next();
    let mut codings = headers.get_all(http::header::TRANSFER_ENCODING).iter();
    let coding = codings.next();
    let refused = response.status() == http::StatusCode::SWITCHING_PROTOCOLS
        || lengths.next().is_some()
        || codings.next().is_some()
        || (length.is_some() && coding.is_some())
        || coding.is_some_and(|coding| !h1::is_chunked(coding.as_bytes()));
    let length = match length.map(|length| h1::parse_content_length(length.as_bytes())) {
        Some(Err(_)) => return TlsFraming::Refused,
        Some(Ok(length)) => length,
        None => 0,
    };
    if refused || head_bytes(headers) > h1::MAX_HEAD_BYTES {
        return TlsFraming::Refused;
    }
    let status = response.status();
    let bodiless = head_request
        || status == http::StatusCode::NO_CONTENT
        || status == http::StatusCode::NOT_MODIFIED;
    if bodiless && (coding.is_some() || length > 0) {
        TlsFraming::CloseAfter
    } else {
        TlsFraming::Clean
    }
}

/// The size of a response head with `headers` as it was read (each field `name: value\r\n`,
/// the status line and the blank line). hyper enforces its buffer limit only between reads, so a
/// head that arrived whole in one read can pass it: this holds the limit whatever the reads.
fn head_bytes(headers: &http::HeaderMap) -> usize {
    const STATUS_LINE_AND_END: usize = "HTTP/1.1 200 \r\n\r\n".len();
    headers
        .iter()
        .fold(STATUS_LINE_AND_END, |total, (name, value)| {
            total + name.as_str().len() + value.len() + 4
        })
}

/// A connector whose whole connection, TCP and TLS handshake together, is bounded by the
/// connect timeout (the TCP connector's own bounds the TCP part only): a backend that accepts
/// and never answers the handshake fails `connect_timeout`, retried like any connect failure.
/// Its connections fail a write that waits `write_stall` (`upstream.idle_timeout`) without the
/// backend taking a byte, as the `http://` pool's do: a backend that stops reading a streamed
/// upload does not hold the request and its slot.
#[derive(Clone)]
struct Bounded<C> {
    inner: C,
    timeout: Duration,
    write_stall: Option<Duration>,
}

/// A connection whose writes fail once one has waited `upstream.idle_timeout` with nothing
/// taken (none with no limit).
struct Stalling<S> {
    inner: S,
    stall: Option<h1::stall::WriteStall>,
}

impl<S> Stalling<S> {
    /// `written` as it is, unless the writes have waited the limit: then an error.
    fn bounded<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        written: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        match self.stall.as_mut() {
            Some(stall) => stall.bounded(cx, written),
            None => written,
        }
    }
}

impl<S: hyper::rt::Read + Unpin> hyper::rt::Read for Stalling<S> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: hyper::rt::Write + Unpin> hyper::rt::Write for Stalling<S> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let written = std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
        this.bounded(cx, written)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let flushed = std::pin::Pin::new(&mut this.inner).poll_flush(cx);
        this.bounded(cx, flushed)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let written = std::pin::Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.bounded(cx, written)
    }
}

impl<S: hyper_util::client::legacy::connect::Connection>
    hyper_util::client::legacy::connect::Connection for Stalling<S>
{
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        self.inner.connected()
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> tower_service::Service<http::Uri> for Bounded<C>
where
    C: tower_service::Service<http::Uri>,
    C::Error: Into<BoxError>,
    C::Future: Send + 'static,
{
    type Response = Stalling<C::Response>;
    type Error = BoxError;
    type Future = std::pin::Pin<
        Box<dyn Future<Output = Result<Stalling<C::Response>, BoxError>> + Send + 'static>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let (timeout, limit) = (self.timeout, self.write_stall);
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(connected) => connected
                    .map(|inner| Stalling {
                        inner,
                        stall: limit.map(|limit| {
                            h1::stall::WriteStall::new(
                                limit,
                                "the backend took nothing of the request for idle_timeout",
                            )
                        }),
                    })
                    .map_err(Into::into),
                Err(_) => Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "connecting (TLS handshake included) timed out",
                )
                .into()),
            }
        })
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
        // As many idle connections per backend as the router's own pool keeps.
        .pool_max_idle_per_host(pool::MAX_IDLE_PER_BACKEND)
        // The router's own client's limits on a response head (hyper's own are larger).
        .http1_max_buf_size(h1::MAX_HEAD_BYTES)
        .http1_max_headers(h1::MAX_HEADERS)
        .build(connector)
}

/// Builds the upstream client held to `config`: keep-alive connections, `TCP_NODELAY`, connect
/// timeout; TLS for `https://` backends trusting the system store plus `extra_ca_certs` (read from
/// `config.tls_ca_file`).
pub fn client(
    config: UpstreamConfig,
    extra_ca_certs: &[CertificateDer<'static>],
    tls_names: TlsNames,
) -> UpstreamClient {
    UpstreamClient {
        https: OnceLock::new(),
        config,
        extra_ca_certs: extra_ca_certs.to_vec(),
        tls_names,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_bytes_counts_the_head_as_sent() {
        let sent = "HTTP/1.1 200 \r\ncontent-length: 2\r\nx-a: bcd\r\n\r\n";
        let mut headers = http::HeaderMap::new();
        headers.insert("content-length", http::HeaderValue::from_static("2"));
        headers.insert("x-a", http::HeaderValue::from_static("bcd"));
        assert_eq!(head_bytes(&headers), sent.len());
    }
}
