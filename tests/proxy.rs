//! Proxying: address forms, headers, streaming both ways, h2c, failures.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A backend that answers with a JSON echo of what it received.
async fn echo_backend() -> FakeBackend {
    spawn_backend(|request: Request<hyper::body::Incoming>| async move {
        let method = request.method().to_string();
        let uri = request.uri().to_string();
        let version = format!("{:?}", request.version());
        let headers: serde_json::Map<String, Value> = request
            .headers()
            .iter()
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    Value::String(value.to_str().unwrap_or("").to_owned()),
                )
            })
            .collect();
        let body = request.into_body().collect().await.unwrap().to_bytes();
        let echo = json!({
            "method": method,
            "uri": uri,
            "version": version,
            "headers": headers,
            "body": String::from_utf8_lossy(&body),
        });
        let mut response = respond(StatusCode::OK, echo.to_string());
        let headers = response.headers_mut();
        headers.insert("connection", "keep-alive, x-hop".parse().unwrap());
        headers.insert("x-hop", "dropped".parse().unwrap());
        headers.insert("keep-alive", "timeout=5".parse().unwrap());
        headers.insert("x-end-to-end", "kept".parse().unwrap());
        response
    })
    .await
}

#[tokio::test]
async fn both_address_forms_proxy_to_the_backend() {
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let router = start_router(round_robin()).await;
    set_backends(
        router.addr,
        &[a.host_port(), format!("http://{}", b.host_port())],
    )
    .await;
    let mut seen = Vec::new();
    for _ in 0..4 {
        let (status, body) = get(&router.url("/generate")).await;
        assert_eq!(status, StatusCode::OK);
        seen.push(body);
    }
    seen.sort();
    assert_eq!(seen, ["a", "a", "b", "b"]);
    assert_eq!((a.hits(), b.hits()), (2, 2));
}

#[tokio::test]
async fn method_path_query_and_body_are_forwarded_unchanged() {
    let backend = echo_backend().await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let request = Request::put(router.url("/v1/chat/completions?stream=true&x=%20y"))
        .header("content-type", "application/json")
        .body(full(r#"{"prompt":"hi"}"#))
        .unwrap();
    let (status, _, body) = send(request).await;
    assert_eq!(status, StatusCode::OK);
    let echo: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(echo["method"], "PUT");
    assert_eq!(echo["uri"], "/v1/chat/completions?stream=true&x=%20y");
    assert_eq!(echo["body"], r#"{"prompt":"hi"}"#);
    assert_eq!(echo["version"], "HTTP/1.1");
    assert_eq!(echo["headers"]["content-type"], "application/json");
}

#[tokio::test]
async fn hop_by_hop_headers_are_dropped_and_end_to_end_kept() {
    let backend = echo_backend().await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let request = Request::get(router.url("/"))
        .header("connection", "keep-alive, x-private")
        .header("x-private", "secret")
        .header("keep-alive", "timeout=10")
        .header("proxy-connection", "keep-alive")
        .header("te", "trailers")
        .header("upgrade", "websocket")
        .header("proxy-authorization", "Basic eA==")
        .header("authorization", "Bearer token")
        .header("x-request-id", "abc")
        .header("x-forwarded-for", "203.0.113.9")
        .body(full(""))
        .unwrap();
    let (status, response_headers, body) = send(request).await;
    assert_eq!(status, StatusCode::OK);
    let echo: Value = serde_json::from_slice(&body).unwrap();
    let headers = echo["headers"].as_object().unwrap();
    for dropped in [
        "x-private",
        "keep-alive",
        "proxy-connection",
        "te",
        "upgrade",
        "proxy-authorization",
    ] {
        assert!(
            !headers.contains_key(dropped),
            "{dropped} was forwarded: {headers:?}"
        );
    }
    assert_eq!(headers["authorization"], "Bearer token");
    assert_eq!(headers["x-request-id"], "abc");
    assert_eq!(headers["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(headers["x-forwarded-proto"], "http");
    assert_eq!(headers["host"], router.addr.to_string());
    // And on the way back.
    assert!(!response_headers.contains_key("x-hop"));
    assert!(!response_headers.contains_key("keep-alive"));
    assert_eq!(response_headers["x-end-to-end"], "kept");
}

#[tokio::test]
async fn forwarding_fields_are_set_whether_a_request_is_forwarded_as_lines_or_from_a_map() {
    let backend = echo_backend().await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    // No field named by `Connection` and at most one `X-Forwarded-For`: the client's lines are
    // forwarded as they are; two `X-Forwarded-For` fields are joined through the map.
    let cases: [(&[&str], &str); 3] = [
        (&[], "127.0.0.1"),
        (&["203.0.113.9"], "203.0.113.9, 127.0.0.1"),
        (
            &["203.0.113.9", "198.51.100.7"],
            "203.0.113.9, 198.51.100.7, 127.0.0.1",
        ),
    ];
    for (sent, forwarded) in cases {
        let mut request = Request::post(router.url("/chat?x=1"))
            .header("Connection", "keep-alive")
            .header("Keep-Alive", "timeout=10")
            .header("TE", "trailers")
            .header("Upgrade", "websocket")
            .header("X-Forwarded-Proto", "https")
            .header("X-Request-Id", "abc")
            .header("Content-Type", "application/json");
        for value in sent {
            request = request.header("X-Forwarded-For", *value);
        }
        let (status, _, body) = send(request.body(full("{}")).unwrap()).await;
        assert_eq!(status, StatusCode::OK);
        let echo: Value = serde_json::from_slice(&body).unwrap();
        let headers = echo["headers"].as_object().unwrap();
        for dropped in ["connection", "keep-alive", "te", "upgrade"] {
            assert!(
                !headers.contains_key(dropped),
                "{dropped} was forwarded: {headers:?}"
            );
        }
        assert_eq!(headers["x-forwarded-for"], forwarded, "{sent:?}");
        assert_eq!(headers["x-forwarded-proto"], "http");
        assert_eq!(headers["x-request-id"], "abc");
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(headers["content-length"], "2");
        assert_eq!(headers["host"], router.addr.to_string());
        assert_eq!(echo["uri"], "/chat?x=1");
        assert_eq!(echo["body"], "{}");
    }
}

#[tokio::test]
async fn sse_events_reach_the_client_one_by_one() {
    // The backend writes the next event only after the client has received the previous one,
    // so the test can only finish if the router forwards each event as soon as it is written.
    let (go_sender, go_receiver) = tokio::sync::mpsc::channel::<()>(1);
    let go_receiver = std::sync::Arc::new(tokio::sync::Mutex::new(go_receiver));
    let backend = spawn_backend(move |_request| {
        let go = std::sync::Arc::clone(&go_receiver);
        async move {
            let (events, body) = channel_body();
            tokio::spawn(async move {
                let mut go = go.lock().await;
                for index in 0..5 {
                    let event = format!("data: {{\"token\":{index}}}\n\n");
                    if events.send(Bytes::from(event)).await.is_err() {
                        return;
                    }
                    if go.recv().await.is_none() {
                        return;
                    }
                }
                let _ = events.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            });
            let mut response = http::Response::new(body);
            response
                .headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            response
        }
    })
    .await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;

    let request = Request::post(router.url("/generate_stream"))
        .body(full("{}"))
        .unwrap();
    let response = client().request(request).await.unwrap();
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    let mut received = String::new();
    for index in 0..5 {
        let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .unwrap_or_else(|_| panic!("event {index} did not arrive before the next was written"))
            .unwrap()
            .unwrap();
        let chunk = String::from_utf8(frame.into_data().unwrap().to_vec()).unwrap();
        assert_eq!(chunk, format!("data: {{\"token\":{index}}}\n\n"));
        received.push_str(&chunk);
        go_sender.send(()).await.unwrap();
    }
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, Bytes::from_static(b"data: [DONE]\n\n"));
}

#[tokio::test]
async fn h2c_clients_are_served_and_forwarded_as_http11() {
    let backend = echo_backend().await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let request = Request::post(router.url("/v1/completions?a=1"))
        .version(http::Version::HTTP_2)
        .body(full("h2 body"))
        .unwrap();
    let response = h2c_client().request(request).await.unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::OK);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let echo: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(echo["version"], "HTTP/1.1");
    assert_eq!(echo["uri"], "/v1/completions?a=1");
    assert_eq!(echo["body"], "h2 body");
    assert_eq!(echo["headers"]["host"], router.addr.to_string());
}

#[tokio::test]
async fn an_h2c_request_with_a_host_nginx_would_refuse_or_one_against_its_authority_gets_400() {
    let backend = echo_backend().await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let client = h2c_client();
    // hyper sends a `host` field set on the request beside the `:authority` of its URI (the
    // router's address); only one that agrees with the authority is forwarded.
    let own = router.addr.to_string();
    for (host, status, error) in [
        ("a/../b", StatusCode::BAD_REQUEST, "invalid Host"),
        ("a..b", StatusCode::BAD_REQUEST, "invalid Host"),
        (
            "example.test:8080",
            StatusCode::BAD_REQUEST,
            "Host differs from the target's authority",
        ),
        (own.as_str(), StatusCode::OK, ""),
    ] {
        let request = Request::get(router.url("/x"))
            .header("host", host)
            .body(full(""))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.status(), status, "{host}");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let answer: Value = serde_json::from_slice(&body).unwrap();
        if status == StatusCode::OK {
            assert_eq!(answer["headers"]["host"], host);
        } else {
            assert_eq!(answer["error"], error, "{host}");
        }
    }
}

#[tokio::test]
async fn no_backend_answers_503_json_at_once_with_round_robin() {
    let router = start_router(round_robin()).await;
    let (status, body) = get(&router.url("/generate")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["error"], "no backend available");
}

#[tokio::test]
async fn unreachable_backend_answers_502_json() {
    // A listener that is bound but closed at once refuses connections on that port.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let mut config = round_robin();
    config.latency.threshold = Duration::from_millis(200);
    let router = start_router(config).await;
    set_backends(router.addr, &[closed.to_string()]).await;
    let started = std::time::Instant::now();
    let (status, body) = get(&router.url("/generate")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert!(started.elapsed() < Duration::from_secs(3));
    let body: Value = serde_json::from_str(&body).unwrap();
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains(&closed.to_string()),
        "{body}"
    );
    let backend = &router.balancer.backends()[0];
    assert_eq!(
        backend.errors(custom_router::backend::ErrorKind::Connect),
        1
    );
    assert_eq!(
        backend.ewma_latency(),
        Some(0.2),
        "a failure counts as the threshold"
    );
    // The failed attempt holds its slot for the threshold, then releases it.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while backend.in_flight() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "in-flight never released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn backend_dying_mid_stream_ends_the_client_stream_with_an_error() {
    let backend = spawn_backend(|_request| async move {
        let (chunks, body) = channel_body();
        tokio::spawn(async move {
            let _ = chunks.send(Bytes::from_static(b"partial")).await;
            // Dropping the sender ends the body early: hyper aborts the chunked response.
        });
        let mut response = http::Response::new(body);
        response
            .headers_mut()
            .insert("content-length", "1000".parse().unwrap());
        response
    })
    .await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let exchange = async {
        let response = client()
            .request(Request::get(router.url("/")).body(full("")).unwrap())
            .await
            .map_err(|error| error.to_string())?;
        response
            .into_body()
            .collect()
            .await
            .map(|collected| collected.to_bytes())
            .map_err(|error| error.to_string())
    };
    // Either the head or the body fails; what matters is an error, promptly.
    let result = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .expect("the stream ends, it does not hang");
    assert!(result.is_err(), "a truncated body must surface as an error");
}

#[tokio::test]
async fn decision_headers_are_off_by_default_and_name_the_backend_when_on() {
    let backend = named_backend("a").await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let (_, headers, _) = send(Request::get(router.url("/")).body(full("")).unwrap()).await;
    assert!(!headers.contains_key("x-custom-router-backend"));
    assert!(!headers.contains_key("x-custom-router-queue-ms"));

    let mut config = round_robin();
    config.decision_headers = true;
    let router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let (status, headers, _) = send(Request::get(router.url("/")).body(full("")).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        headers["x-custom-router-backend"],
        backend.host_port().as_str()
    );
    let queued: u64 = headers["x-custom-router-queue-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(queued < 1000, "{queued}");
}

/// A backend that answers `200 ok` to every request (GET, no body) on raw HTTP/1.1 keep-alive
/// connections, counting the connections it accepted; with `close_after` it closes each
/// connection that long after answering, without saying so in the response.
async fn counting_backend(close_after: Option<Duration>) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut received = Vec::new();
                let mut buffer = [0u8; 4096];
                loop {
                    while let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
                        received.drain(..end + 4);
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if stream.write_all(answer).await.is_err() {
                            return;
                        }
                        if let Some(delay) = close_after {
                            tokio::time::sleep(delay).await;
                            return;
                        }
                    }
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(read) => received.extend_from_slice(&buffer[..read]),
                    }
                }
            });
        }
    });
    (addr.to_string(), accepted)
}

#[tokio::test]
async fn backend_connections_are_kept_alive_and_reused() {
    let (backend, accepted) = counting_backend(None).await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend]).await;
    for _ in 0..20 {
        let (status, body) = get(&router.url("/generate")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_connection_the_backend_closed_while_idle_is_not_used_again() {
    let (backend, accepted) = counting_backend(Some(Duration::from_millis(20))).await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend]).await;
    for _ in 0..5 {
        let request = Request::post(router.url("/generate"))
            .body(full("{}"))
            .unwrap();
        let (status, _, body) = send(request).await;
        assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok"[..]));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 5);
    let backend = &router.balancer.backends()[0];
    assert_eq!(backend.errors(custom_router::backend::ErrorKind::Io), 0);
}

#[tokio::test]
async fn a_request_whose_first_segment_is_a_lone_p_is_served_by_the_http1_server() {
    let backend = named_backend("p").await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    // A prefix of the HTTP/2 preface, then the rest of a POST with both lengths: the HTTP/1
    // server reads it whole and refuses it, as it refuses any such request.
    let answer = after_a_lone_p(
        router.addr,
        b"OST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert!(
        answer.contains("both Transfer-Encoding and Content-Length"),
        "{answer}"
    );
    assert_eq!(backend.hits(), 0);
    // A request split the same way that is well formed is proxied.
    let answer = after_a_lone_p(
        router.addr,
        b"OST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    assert!(answer.ends_with('p'), "{answer}");
}

/// Sends a lone `P` in its own segment, then `rest`, and reads until the router closes.
async fn after_a_lone_p(router: std::net::SocketAddr, rest: &[u8]) -> String {
    let mut client = tokio::net::TcpStream::connect(router).await.unwrap();
    client.set_nodelay(true).unwrap();
    client.write_all(b"P").await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    client.write_all(rest).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut answer))
        .await
        .expect("the connection closes")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}
