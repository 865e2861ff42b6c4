//! `https://` backends: TLS to the backend, trusting the system store plus `upstream.tls_ca_file`.

mod common;

use std::convert::Infallible;
use std::time::Duration;

use common::*;
use http::StatusCode;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

/// A TLS backend on 127.0.0.1 with a fresh self-signed certificate; returns its address and a
/// file holding the certificate.
async fn tls_backend() -> (
    std::net::SocketAddr,
    std::path::PathBuf,
    tokio::task::JoinHandle<()>,
) {
    let TestCerts { acceptor, ca_file } = tls_certs(&["127.0.0.1", "localhost"]);
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
    (addr, ca_file, task)
}

#[tokio::test]
async fn https_backends_are_reached_over_tls_with_a_configured_ca() {
    let (addr, ca_file, _task) = tls_backend().await;
    let mut config = round_robin();
    config.upstream.tls_ca_file = Some(ca_file);
    let router = start_router(config).await;
    set_backends(router.addr, &[format!("https://{addr}")]).await;
    let (status, body) = get(&router.url("/v1/models")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "over tls"));
}

#[tokio::test]
async fn an_untrusted_https_backend_answers_502() {
    let (addr, _ca_file, _task) = tls_backend().await;
    let mut config = round_robin();
    config.latency.threshold = Duration::from_millis(50);
    let router = start_router(config).await;
    set_backends(router.addr, &[format!("https://{addr}")]).await;
    let (status, body) = get(&router.url("/v1/models")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
}
