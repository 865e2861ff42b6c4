//! Forwarding one request to the leased backend and streaming the answer back.
//!
//! The request keeps its method, path and query; hop-by-hop headers (RFC 9110 §7.6.1, plus those
//! named in `Connection`) are removed both ways; `X-Forwarded-For` gets the client address
//! appended and `X-Forwarded-Proto` is set to `http`. The client's `Host` is kept (for HTTP/2
//! clients, the `:authority`). Bodies are streamed both ways, never buffered whole. Requests go
//! out as HTTP/1.1 over a pooled keep-alive client.

use std::error::Error as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Uri};
use http::{Request, Response, StatusCode, Version};
use http_body_util::Either;
use hyper::body::Incoming;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::CertificateDer;

use crate::backend::ErrorKind;
use crate::balancer::{Finish, Lease};
use crate::body::{ObservedBody, ResponseBody};
use crate::response;

/// The pooled HTTP/1.1 client used for every backend (`https://` backends over rustls).
pub type UpstreamClient = Client<HttpsConnector<HttpConnector>, Incoming>;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// Headers that apply to one connection only and are never forwarded.
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

/// Builds the upstream client: keep-alive pool reaped in the background, `TCP_NODELAY`, connect
/// timeout; TLS for `https://` backends trusting the system store plus `extra_ca_certs`.
pub fn client(
    connect_timeout: Duration,
    extra_ca_certs: &[CertificateDer<'static>],
) -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector.enforce_http(false);
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config(tls_config(extra_ca_certs))
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector);
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector)
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
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|list| list.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

fn append_forwarded_for(headers: &mut HeaderMap, peer: SocketAddr) {
    let ip = peer.ip().to_canonical();
    let value = match headers.get(&X_FORWARDED_FOR).map(HeaderValue::to_str) {
        Some(Ok(existing)) if headers.get_all(&X_FORWARDED_FOR).iter().count() == 1 => {
            format!("{existing}, {ip}")
        }
        Some(_) => {
            let mut joined = headers
                .get_all(&X_FORWARDED_FOR)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect::<Vec<_>>()
                .join(", ");
            joined.push_str(&format!(", {ip}"));
            joined
        }
        None => ip.to_string(),
    };
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert(X_FORWARDED_FOR, value);
    }
}

/// Sends `request` to the leased backend and returns its response, streamed.
///
/// Connect and I/O failures before a response answer 502 with a JSON body; the lease records
/// them as failures.
pub async fn forward(
    client: &UpstreamClient,
    request: Request<Incoming>,
    lease: Lease,
    peer: SocketAddr,
) -> Response<ResponseBody> {
    let (mut parts, body) = request.into_parts();
    remove_hop_by_hop(&mut parts.headers);
    if !parts.headers.contains_key(header::HOST) {
        if let Some(authority) = parts.uri.authority() {
            if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
                parts.headers.insert(header::HOST, host);
            }
        }
    }
    append_forwarded_for(&mut parts.headers, peer);
    parts
        .headers
        .insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    let addr = lease.backend().addr();
    let path_and_query = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let uri = Uri::builder()
        .scheme(addr.scheme())
        .authority(addr.authority().clone())
        .path_and_query(path_and_query)
        .build();
    parts.uri = match uri {
        Ok(uri) => uri,
        Err(_) => {
            // Never sent: the lease is dropped without a sample.
            drop(lease);
            return response::error(
                StatusCode::BAD_REQUEST,
                "request target cannot be forwarded",
            );
        }
    };
    parts.version = Version::HTTP_11;

    match client.request(Request::from_parts(parts, body)).await {
        Ok(upstream) => {
            let (mut parts, body) = upstream.into_parts();
            remove_hop_by_hop(&mut parts.headers);
            // The client gets the router's own protocol version, whatever the backend spoke.
            parts.version = Version::default();
            let status = parts.status;
            Response::from_parts(parts, Either::Left(ObservedBody::new(body, lease, status)))
        }
        Err(error) => {
            let kind = classify(&error);
            tracing::debug!(backend = %lease.backend().addr(), %error, kind = kind.as_str(), "upstream request failed");
            let message = format!(
                "upstream {} error for backend {}",
                kind.as_str().replace('_', " "),
                lease.backend().addr()
            );
            lease.finish(Finish {
                status: None,
                error: Some(kind),
            });
            response::error(StatusCode::BAD_GATEWAY, &message)
        }
    }
}

fn classify(error: &hyper_util::client::legacy::Error) -> ErrorKind {
    if !error.is_connect() {
        return ErrorKind::Io;
    }
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
    }

    #[test]
    fn appends_to_forwarded_for() {
        let peer: SocketAddr = "192.0.2.7:5000".parse().unwrap();
        let mut headers = HeaderMap::new();
        append_forwarded_for(&mut headers, peer);
        assert_eq!(headers[&X_FORWARDED_FOR], "192.0.2.7");
        append_forwarded_for(&mut headers, peer);
        assert_eq!(headers[&X_FORWARDED_FOR], "192.0.2.7, 192.0.2.7");
        headers.append(&X_FORWARDED_FOR, HeaderValue::from_static("198.51.100.1"));
        append_forwarded_for(&mut headers, peer);
        assert_eq!(
            headers[&X_FORWARDED_FOR],
            "192.0.2.7, 192.0.2.7, 198.51.100.1, 192.0.2.7"
        );
    }
}
