//! Generation requests (a `POST` on `retry.generation_paths`) that fail before any byte of an
//! answer reached the client go to another replica: after a 5xx head of
//! `retry.generation_statuses`, and after a reset before the head (docs/reliability.md, "What is
//! retried"). An answer whose body has started is never retried; other paths keep the rules for
//! any `POST`. Each retry is counted with its reason and logged. Backends here are raw sockets,
//! so what the router sent and what it got is exact; a canary request on a fresh connection
//! follows each case.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use common::*;

/// What a raw backend does with each request it reads whole.
#[derive(Clone, Copy)]
enum Script {
    /// Answers `500` with a small JSON body.
    Status500,
    /// Closes the connection without a byte of answer.
    Reset,
    /// Sends a `200` head and half a body, then closes.
    CutMidBody,
}

/// A backend on a raw socket: reads each request's head and `Content-Length` body, then acts out
/// `script`. Counts the requests it read.
async fn raw_backend(script: Script) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let reads = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&reads);
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let mut buffer = Vec::new();
                loop {
                    let Some(end) = find(&buffer, b"\r\n\r\n") else {
                        if fill(&mut stream, &mut buffer).await.is_none() {
                            return;
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buffer[..end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|line| line.strip_prefix("content-length:"))
                        .map_or(0, |value| value.trim().parse().unwrap());
                    while buffer.len() < end + 4 + length {
                        if fill(&mut stream, &mut buffer).await.is_none() {
                            return;
                        }
                    }
                    buffer.drain(..end + 4 + length);
                    counter.fetch_add(1, Ordering::SeqCst);
                    match script {
                        Script::Status500 => {
                            let body = b"{\"error\":\"engine crashed\"}";
                            let head = format!(
                                "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                                body.len()
                            );
                            let _ = stream.write_all(head.as_bytes()).await;
                            let _ = stream.write_all(body).await;
                        }
                        Script::Reset => return,
                        Script::CutMidBody => {
                            let _ = stream
                                .write_all(
                                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 100\r\n\r\ndata: {\"tok\":1}\n\n",
                                )
                                .await;
                            let _ = stream.flush().await;
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, reads)
}

async fn post(router: &TestRouter, path: &str) -> (StatusCode, Result<Bytes, String>) {
    let request = Request::post(router.url(path))
        .header("content-type", "application/json")
        .body(full(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        ))
        .unwrap();
    let response = client().request(request).await.unwrap();
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map(|collected| collected.to_bytes())
        .map_err(|error| error.to_string());
    (status, body)
}

/// A fresh connection, a plain request to the healthy replica alone: the router still answers.
async fn canary(router: &TestRouter, healthy: &FakeBackend) {
    set_backends(router.addr, &[healthy.host_port()]).await;
    let (status, body) = get(&router.url("/canary")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "healthy"));
}

async fn generation_retries(router: &TestRouter) -> f64 {
    metric(router, "custom_router_retries_total{reason=\"generation\"}").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_answered_500_is_sent_to_another_replica_and_other_posts_are_not() {
    let (failing, reads) = raw_backend(Script::Status500).await;
    let healthy = named_backend("healthy").await;
    let router = start_router(with_strategy("round-robin")).await;
    set_backends(router.addr, &[failing.clone(), healthy.host_port()]).await;
    for path in ["/v1/chat/completions", "/generate", "/v1/completions"] {
        for _ in 0..2 {
            let (status, body) = post(&router, path).await;
            assert_eq!(
                (status, body.unwrap()),
                (StatusCode::OK, Bytes::from("healthy")),
                "{path}"
            );
        }
    }
    let retried = reads.load(Ordering::SeqCst);
    assert!(retried >= 1, "the failing replica was tried");
    assert_eq!(generation_retries(&router).await, retried as f64);
    canary(&router, &healthy).await;
    // The same answer to a POST on another path is the client's: the router does not know it
    // has no side effect.
    let other = start_router(with_strategy("round-robin")).await;
    set_backends(other.addr, &[failing, healthy.host_port()]).await;
    let statuses = [
        post(&other, "/v1/files").await.0,
        post(&other, "/v1/files").await.0,
    ];
    assert!(
        statuses.contains(&StatusCode::INTERNAL_SERVER_ERROR),
        "{statuses:?}"
    );
    assert_eq!(generation_retries(&other).await, 0.0);
    canary(&other, &healthy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_reset_before_its_head_is_sent_to_another_replica() {
    let (resetting, reads) = raw_backend(Script::Reset).await;
    let healthy = named_backend("healthy").await;
    let router = start_router(with_strategy("round-robin")).await;
    set_backends(router.addr, &[resetting.clone(), healthy.host_port()]).await;
    for _ in 0..4 {
        let (status, body) = post(&router, "/v1/chat/completions").await;
        assert_eq!(
            (status, body.unwrap()),
            (StatusCode::OK, Bytes::from("healthy"))
        );
    }
    assert!(reads.load(Ordering::SeqCst) >= 1);
    assert!(generation_retries(&router).await >= 1.0);
    canary(&router, &healthy).await;
    // Another POST reset before its head is not sent again: 502 when it lands there.
    let other = start_router(with_strategy("round-robin")).await;
    set_backends(other.addr, &[resetting, healthy.host_port()]).await;
    let statuses = [
        post(&other, "/v1/files").await.0,
        post(&other, "/v1/files").await.0,
    ];
    assert!(statuses.contains(&StatusCode::BAD_GATEWAY), "{statuses:?}");
    canary(&other, &healthy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_whose_answer_started_is_never_retried() {
    let (cut, reads) = raw_backend(Script::CutMidBody).await;
    let healthy = named_backend("healthy").await;
    let router = start_router(with_strategy("round-robin")).await;
    set_backends(router.addr, &[cut, healthy.host_port()]).await;
    let mut cut_answers = 0;
    for _ in 0..4 {
        let (status, body) = post(&router, "/v1/chat/completions").await;
        assert_eq!(status, StatusCode::OK);
        match body {
            Ok(body) => assert_eq!(body, Bytes::from("healthy")),
            Err(_) => cut_answers += 1,
        }
    }
    assert_eq!(cut_answers, reads.load(Ordering::SeqCst));
    assert!(cut_answers >= 1, "the cutting replica answered some");
    assert_eq!(generation_retries(&router).await, 0.0);
    canary(&router, &healthy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generation_paths_and_statuses_are_configured() {
    let (failing, reads) = raw_backend(Script::Status500).await;
    let healthy = named_backend("healthy").await;
    let mut config = with_strategy("round-robin");
    config.retry.generation_paths = vec!["/v2/generate".to_owned()];
    let router = start_router(config.clone()).await;
    set_backends(router.addr, &[failing.clone(), healthy.host_port()]).await;
    for _ in 0..2 {
        let (status, _) = post(&router, "/v2/generate").await;
        assert_eq!(status, StatusCode::OK);
    }
    assert!(generation_retries(&router).await >= 1.0);
    // A path left out of the list keeps the rules of any POST.
    let other = start_router(config).await;
    set_backends(other.addr, &[failing.clone(), healthy.host_port()]).await;
    let statuses = [
        post(&other, "/v1/chat/completions").await.0,
        post(&other, "/v1/chat/completions").await.0,
    ];
    assert!(
        statuses.contains(&StatusCode::INTERNAL_SERVER_ERROR),
        "{statuses:?}"
    );
    // With 500 left out of the statuses, a 500 is the client's answer.
    let mut config = with_strategy("round-robin");
    config.retry.generation_statuses = vec![502, 503];
    let strict = start_router(config).await;
    set_backends(strict.addr, &[failing, healthy.host_port()]).await;
    let before = reads.load(Ordering::SeqCst);
    let statuses = [
        post(&strict, "/v1/chat/completions").await.0,
        post(&strict, "/v1/chat/completions").await.0,
    ];
    assert!(
        statuses.contains(&StatusCode::INTERNAL_SERVER_ERROR),
        "{statuses:?}"
    );
    assert!(reads.load(Ordering::SeqCst) > before);
    assert_eq!(generation_retries(&strict).await, 0.0);
    canary(&strict, &healthy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_retry_and_its_reason_are_in_the_access_log() {
    let (failing, _) = raw_backend(Script::Status500).await;
    let healthy = named_backend("healthy").await;
    let router = logged_router(&format!("{failing},{}", healthy.host_port()), &[]);
    let mut answered = 0;
    for _ in 0..2 {
        let request = Request::post(format!("http://{}/v1/chat/completions", router.addr))
            .body(full("{}"))
            .unwrap();
        let (status, _, body) = send(request).await;
        assert_eq!((status, body), (StatusCode::OK, Bytes::from("healthy")));
        answered += 1;
    }
    let lines = access_log_lines(&router, answered).await;
    let retried: Vec<_> = lines.iter().filter(|line| line["attempts"] == 2).collect();
    assert!(!retried.is_empty(), "{lines:?}");
    for line in retried {
        assert_eq!(line["retries"], serde_json::json!(["generation"]), "{line}");
    }
    for line in lines.iter().filter(|line| line["attempts"] == 1) {
        assert_eq!(line["retries"], serde_json::json!([]), "{line}");
    }
}
