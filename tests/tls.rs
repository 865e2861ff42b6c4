//! `https://` backends: TLS to the backend, trusting the system store plus `upstream.tls_ca_file`.

mod common;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use http::StatusCode;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// A TLS backend on 127.0.0.1 with a fresh self-signed certificate; returns its address and the
/// certificate PEM.
async fn tls_backend() -> (std::net::SocketAddr, String, tokio::task::JoinHandle<()>) {
    let certified =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .unwrap();
    let cert_pem = certified.cert.pem();
    let cert = CertificateDer::from(certified.cert.der().to_vec());
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
        certified.signing_key.serialize_der(),
    ));
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![cert], key)
    .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let service = service_fn(|_request| async {
                    Ok::<_, Infallible>(respond(StatusCode::OK, "over tls"))
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, cert_pem, task)
}

#[tokio::test]
async fn https_backends_are_reached_over_tls_with_a_configured_ca() {
    let (addr, cert_pem, _task) = tls_backend().await;
    let ca_file = std::env::temp_dir().join(format!("custom-router-ca-{}.pem", std::process::id()));
    std::fs::write(&ca_file, cert_pem).unwrap();
    let mut config = round_robin();
    config.upstream.tls_ca_file = Some(ca_file);
    let router = start_router(config).await;
    set_backends(router.addr, &[format!("https://{addr}")]).await;
    let (status, body) = get(&router.url("/v1/models")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "over tls"));
}

#[tokio::test]
async fn an_untrusted_https_backend_answers_502() {
    let (addr, _cert_pem, _task) = tls_backend().await;
    let mut config = round_robin();
    config.latency.threshold = Duration::from_millis(50);
    let router = start_router(config).await;
    set_backends(router.addr, &[format!("https://{addr}")]).await;
    let (status, body) = get(&router.url("/v1/models")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
}
