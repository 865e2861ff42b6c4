//! What the router adds, removes and records around a request, over raw sockets on loopback:
//! the host an absolute-form target names, `100 Continue` only for a body that will be read,
//! `Connection: close` on an answer given with the body unread, W3C trace context restarted
//! cleanly, an access-log line for every request (a client that left: 499; a small body that
//! stalled: 408), and the forwarding fields a client cannot strip.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const PATIENCE: Duration = Duration::from_secs(10);

/// A raw HTTP/1.1 backend: sends each request head it reads (bytes as received) on the channel
/// and answers `200 ok` (after `delay`), keeping the connection open.
async fn raw_backend(delay: Duration) -> (String, mpsc::UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (sender, receiver) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let sender = sender.clone();
            tokio::spawn(async move {
                let mut buffer = Vec::new();
                loop {
                    while find(&buffer, b"\r\n\r\n").is_none() {
                        if fill(&mut stream, &mut buffer).await.is_none() {
                            return;
                        }
                    }
                    let end = find(&buffer, b"\r\n\r\n").unwrap() + 4;
                    let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
                    let length = head
                        .lines()
                        .find_map(|line| {
                            let (name, value) = line.split_once(':')?;
                            name.eq_ignore_ascii_case("content-length")
                                .then(|| value.trim().parse::<usize>().ok())?
                        })
                        .unwrap_or(0);
                    while buffer.len() < end + length {
                        if fill(&mut stream, &mut buffer).await.is_none() {
                            return;
                        }
                    }
                    buffer.drain(..end + length);
                    let _ = sender.send(head);
                    tokio::time::sleep(delay).await;
                    if stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (addr, receiver)
}

/// Writes `request` on a new connection to `addr` and reads until the connection ends (or
/// `PATIENCE`): everything the router answered.
async fn exchange(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

/// Reads from `reader` until an answer's head has come (or panics past `PATIENCE`): what was
/// read.
async fn answer_head(reader: &mut tokio::net::tcp::OwnedReadHalf) -> String {
    let mut answer = Vec::new();
    while find(&answer, b"\r\n\r\n").is_none() {
        let mut chunk = [0u8; 4096];
        match tokio::time::timeout(PATIENCE, reader.read(&mut chunk)).await {
            Ok(Ok(read)) if read > 0 => answer.extend_from_slice(&chunk[..read]),
            other => panic!(
                "no answer: {other:?} {:?}",
                String::from_utf8_lossy(&answer)
            ),
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

/// The value of the field `name` in `head` (case-insensitive name), if any.
fn field<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|line| {
        let (field, value) = line.split_once(':')?;
        field.eq_ignore_ascii_case(name).then(|| value.trim())
    })
}

/// RFC 9112 §3.2.2: a proxy forwards the host an absolute-form target names, not the `Host`
/// the client added. One that differs is refused (400, as HAProxy and as the HTTP/2 twin, a
/// `host` unlike the `:authority`); an equal one (any case) is forwarded.
#[tokio::test]
async fn an_absolute_form_target_decides_the_host_the_backend_reads() {
    let (backend, mut heads) = raw_backend(Duration::ZERO).await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend]).await;
    let answer = exchange(
        router.addr,
        b"GET http://a.example/v1/models HTTP/1.1\r\nHost: b.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        answer.contains("Host differs from the target's authority"),
        "{answer}"
    );
    let answer = exchange(
        router.addr,
        b"GET http://a.example/v1/models HTTP/1.1\r\nHost: A.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let head = heads.recv().await.expect("the backend got the request");
    assert!(
        field(&head, "host").is_some_and(|host| host.eq_ignore_ascii_case("a.example")),
        "{head}"
    );
    // HTTP/1.0 without Host: the target's authority is the Host.
    let answer = exchange(router.addr, b"GET http://a.example:8080/x HTTP/1.0\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let head = heads.recv().await.expect("the backend got the request");
    assert_eq!(field(&head, "host"), Some("a.example:8080"), "{head}");
}

/// RFC 9110 §4.2.4: user information in an `http` URI is an error. An absolute-form target
/// with it, or with an invalid host, is refused (400) as an HTTP/2 `:authority` is: its
/// authority would otherwise become the `Host` the backend reads, credentials and all.
#[tokio::test]
async fn credentials_in_an_absolute_form_target_never_reach_the_backend() {
    let (backend, mut heads) = raw_backend(Duration::ZERO).await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend]).await;
    for request in [
        &b"GET http://alice:s3cret@a.example/v1/models HTTP/1.0\r\n\r\n"[..],
        b"GET http://alice:s3cret@a.example/v1/models HTTP/1.1\r\nHost: alice:s3cret@a.example\r\n\r\n",
        b"GET http://a..b/v1/models HTTP/1.0\r\n\r\n",
    ] {
        let answer = exchange(router.addr, request).await;
        assert!(
            answer.starts_with("HTTP/1.1 400") && answer.contains("invalid Host"),
            "{answer}"
        );
    }
    let reached = tokio::time::timeout(Duration::from_millis(200), heads.recv()).await;
    assert!(
        reached.is_err(),
        "a request reached the backend: {reached:?}"
    );
}

/// The README promises set-backends' 413 "at once, before the body is read, when its
/// Content-Length says so" and a 401 without the token; with `Expect: 100-continue` the refusal
/// comes instead of the `100` (a client is not told to upload a body that is refused unread).
#[tokio::test]
async fn a_refused_set_backends_is_answered_before_any_100_continue() {
    let mut config = round_robin();
    config.admin.token = Some("secret-token".to_owned());
    let guarded = start_router(config).await;
    let open = start_router(round_robin()).await;
    for (router, length, expected) in [
        (&open, "2000000", "HTTP/1.1 413"),
        (&guarded, "100000", "HTTP/1.1 401"),
    ] {
        let mut stream = TcpStream::connect(router.addr).await.unwrap();
        let head = format!(
            "POST /_custom_router/set-backends HTTP/1.1\r\nHost: r\r\nContent-Length: {length}\r\nExpect: 100-continue\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), fill(&mut stream, &mut answer)).await;
        let answer = String::from_utf8_lossy(&answer).into_owned();
        assert!(
            answer.starts_with(expected),
            "Content-Length {length}: the first answer should be the refusal, not an invitation to upload: {answer:?}"
        );
    }
}

/// W3C Trace Context, processing model: a `tracestate` that comes without a valid `traceparent`
/// "is invalid and MUST be discarded" (the vendor restarts the trace). With traces on, a
/// restarted trace goes out without the client's `tracestate`.
#[tokio::test]
async fn a_restarted_trace_does_not_carry_the_clients_tracestate() {
    let collector = spawn_backend(|_request| async { respond(StatusCode::OK, "") }).await;
    let (backend, mut heads) = raw_backend(Duration::ZERO).await;
    let router = spawn_router_process(&[
        ("CUSTOM_ROUTER_BACKENDS", &backend),
        ("CUSTOM_ROUTER_STRATEGY", "round-robin"),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            &format!("http://{}", collector.host_port()),
        ),
    ]);
    for traceparent in [
        Some("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"), // uppercase: invalid
        Some("garbage"),
        None,
    ] {
        let mut request =
            "GET /v1/models HTTP/1.1\r\nHost: r\r\ntracestate: vendor=stale\r\n".to_owned();
        if let Some(traceparent) = traceparent {
            request.push_str(&format!("traceparent: {traceparent}\r\n"));
        }
        request.push_str("Connection: close\r\n\r\n");
        let answer = exchange(router.addr, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let head = tokio::time::timeout(PATIENCE, heads.recv())
            .await
            .unwrap()
            .unwrap();
        let sent = field(&head, "traceparent").expect("a new traceparent");
        assert!(
            !sent.contains("4bf92f3577b34da6a3ce929d0e0e4736") && Some(sent) != traceparent,
            "the trace is restarted: {head}"
        );
        assert_eq!(
            field(&head, "tracestate"),
            None,
            "client traceparent {traceparent:?}: the stale tracestate went out with the new trace: {head}"
        );
    }
}

/// The access log has one line per request: a client that gives up before the backend's
/// response head (a long prefill, a long queue wait) gets one with status 499 and reason
/// `client_gone` (nginx's 499).
#[tokio::test]
async fn a_client_that_leaves_before_the_answer_still_gets_an_access_log_line() {
    let (backend, mut heads) = raw_backend(Duration::from_secs(3)).await;
    let router = spawn_router_process(&[
        ("CUSTOM_ROUTER_BACKENDS", &backend),
        ("CUSTOM_ROUTER_STRATEGY", "round-robin"),
        ("CUSTOM_ROUTER_ACCESS_LOG", "true"),
    ]);
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    stream
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}")
        .await
        .unwrap();
    tokio::time::timeout(PATIENCE, heads.recv())
        .await
        .unwrap()
        .unwrap();
    drop(stream); // The client gives up while the backend prefills.
    // One request that finishes, so that the log has been written up to here.
    let answer = exchange(
        router.addr,
        b"GET /after HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let lines = || router.out.lock().unwrap().clone();
    eventually(PATIENCE, async || lines().len() >= 2).await;
    let lines = lines();
    assert!(
        lines
            .iter()
            .any(|line| line.contains("/v1/chat/completions")),
        "the abandoned request left no access-log line: {lines:?}"
    );
    let line: serde_json::Value = serde_json::from_str(
        lines
            .iter()
            .find(|line| line.contains("/v1/chat/completions"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(line["status"], 499, "{line}");
    assert_eq!(line["reason"], "client_gone", "{line}");
}

/// RFC 9112 §9.6: a server that answers before reading the whole request content "SHOULD
/// indicate whether it intends to close the connection". The router closes the connection
/// after an answer given with the body unread (set-backends' 413 here) and says so.
#[tokio::test]
async fn an_answer_given_before_the_body_is_read_says_the_connection_closes() {
    let router = start_router(round_robin()).await;
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    let body = smuggled_requests(2_000_000);
    let head = format!(
        "POST /_custom_router/set-backends HTTP/1.1\r\nHost: r\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let upload = tokio::spawn(async move {
        let _ = writer.write_all(&body).await;
        writer
    });
    let answer = answer_head(&mut reader).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        field(&answer, "connection").is_some_and(|value| value.eq_ignore_ascii_case("close")),
        "the router closes this connection after the answer but does not say so: {answer}"
    );
    // And it does: nothing of the unread body is read as a request of its own.
    assert_no_second_answer(&mut reader).await;
    upload.abort();
    // Canary: a fresh connection is served.
    let health = exchange(
        router.addr,
        b"GET /_custom_router/health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
}

/// A body made of whole requests (`GET /smuggled`), `len` bytes or a little more: read as the
/// connection's next requests, each would get an answer.
fn smuggled_requests(len: usize) -> Vec<u8> {
    let one = b"GET /smuggled HTTP/1.1\r\nHost: r\r\n\r\n";
    one.iter()
        .copied()
        .cycle()
        .take(len.div_ceil(one.len()) * one.len())
        .collect()
}

/// Reads what is left of the connection's answer to its end: the connection ends within
/// [`PATIENCE`] and holds no second answer.
async fn assert_no_second_answer(reader: &mut tokio::net::tcp::OwnedReadHalf) {
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(PATIENCE, reader.read_to_end(&mut rest)).await;
    assert!(ended.is_ok(), "the connection stays open");
    let rest = String::from_utf8_lossy(&rest);
    assert!(!rest.contains("HTTP/1.1 "), "a second answer: {rest}");
}

/// W3C Trace Context §3.2.2.1: `version` is 2 HEXDIGLC; a `traceparent` whose version is not
/// (`zz-…`) is invalid, and the access log reports no trace id from it.
#[tokio::test]
async fn a_traceparent_with_a_version_that_is_not_hex_is_invalid() {
    let backend = named_backend("b").await;
    let router = spawn_router_process(&[
        ("CUSTOM_ROUTER_BACKENDS", &backend.host_port()),
        ("CUSTOM_ROUTER_STRATEGY", "round-robin"),
        ("CUSTOM_ROUTER_ACCESS_LOG", "true"),
    ]);
    let answer = exchange(
        router.addr,
        b"GET /v1/models HTTP/1.1\r\nHost: r\r\ntraceparent: zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let lines = || router.out.lock().unwrap().clone();
    assert!(eventually(PATIENCE, async || !lines().is_empty()).await);
    let line: serde_json::Value = serde_json::from_str(&lines()[0]).unwrap();
    assert!(
        line["trace_id"].is_null(),
        "an invalid traceparent was read as a trace: {line}"
    );
}

/// A client that names `X-Forwarded-For` in `Connection` loses its own value but cannot strip
/// the router's element, and `X-Forwarded-Proto` is the router's.
#[tokio::test]
async fn connection_cannot_strip_the_forwarding_fields_the_router_adds() {
    let (backend, mut heads) = raw_backend(Duration::ZERO).await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend]).await;
    let answer = exchange(
        router.addr,
        b"GET /x HTTP/1.1\r\nHost: r\r\nX-Forwarded-For: 6.6.6.6\r\nX-Forwarded-Proto: https\r\nConnection: close, X-Forwarded-For, X-Forwarded-Proto, TE\r\nTE: trailers\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let head = heads.recv().await.unwrap();
    assert_eq!(field(&head, "x-forwarded-for"), Some("127.0.0.1"), "{head}");
    assert_eq!(field(&head, "x-forwarded-proto"), Some("http"), "{head}");
    assert_eq!(field(&head, "te"), None, "{head}");
    assert_eq!(field(&head, "connection"), None, "{head}");
}

/// A body that stalls is answered 408 and logged with `reason: client_body_timeout`, whether
/// it is streamed through the proxy (over 64 KiB) or read by the HTTP/1 server with the head.
#[tokio::test]
async fn a_small_body_that_stalls_is_logged_as_client_body_timeout() {
    let backend = named_backend("b").await;
    let router = spawn_router_process(&[
        ("CUSTOM_ROUTER_BACKENDS", &backend.host_port()),
        ("CUSTOM_ROUTER_STRATEGY", "round-robin"),
        ("CUSTOM_ROUTER_ACCESS_LOG", "true"),
        ("CUSTOM_ROUTER_BODY_READ_TIMEOUT", "0.3"),
    ]);
    let answer = exchange(
        router.addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 100\r\n\r\n{\"pro",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    // A request that finishes, so that the log has been written up to here.
    let answer = exchange(
        router.addr,
        b"GET /after HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let lines = || router.out.lock().unwrap().clone();
    eventually(PATIENCE, async || !lines().is_empty()).await;
    let lines = lines();
    assert!(
        lines
            .iter()
            .any(|line| line.contains("/v1/completions") && line.contains("client_body_timeout")),
        "the 408 left no access-log line: {lines:?}"
    );
}

/// The same on the proxied path: a backend that refuses a large upload (413) before reading it.
/// The router relays the 413, says `Connection: close` and closes the client's connection.
#[tokio::test]
async fn a_backend_refusal_of_an_unread_upload_says_the_connection_closes() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = Vec::new();
                while find(&buffer, b"\r\n\r\n").is_none() {
                    if fill(&mut stream, &mut buffer).await.is_none() {
                        return;
                    }
                }
                let _ = stream
                    .write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\n\r\nbig")
                    .await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            });
        }
    });
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend]).await;
    let stream = TcpStream::connect(router.addr).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let body = smuggled_requests(4_000_000);
    let upload = tokio::spawn(async move {
        let head = format!(
            "POST /v1/audio HTTP/1.1\r\nHost: r\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let _ = writer.write_all(head.as_bytes()).await;
        let _ = writer.write_all(&body).await;
        writer
    });
    let answer = answer_head(&mut reader).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        field(&answer, "connection").is_some_and(|value| value.eq_ignore_ascii_case("close")),
        "the router closed this connection after the answer but did not say so: {answer}"
    );
    // The router ends the connection after the answer; the rest of the upload (whole requests)
    // is never read as requests.
    assert_no_second_answer(&mut reader).await;
    upload.abort();
    // Canary: a fresh connection is served.
    let health = exchange(
        router.addr,
        b"GET /_custom_router/health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
}

/// A request whose body will be read gets its `100 Continue`, admin and proxied alike.
#[tokio::test]
async fn a_body_that_will_be_read_is_asked_for_with_100_continue() {
    let backend = named_backend("b").await;
    let router = start_router(round_robin()).await;
    let body = format!("{{\"backends\":[\"{}\"]}}", backend.host_port());
    for (path, body) in [
        ("/_custom_router/set-backends", body.as_str()),
        ("/v1/completions", "{\"prompt\":\"hi\"}"),
    ] {
        let mut stream = TcpStream::connect(router.addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: r\r\nContent-Length: {}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut interim = Vec::new();
        while find(&interim, b"\r\n\r\n").is_none() {
            let read = tokio::time::timeout(PATIENCE, fill(&mut stream, &mut interim)).await;
            assert!(matches!(read, Ok(Some(()))), "{path}: no 100 Continue");
        }
        assert!(
            interim.starts_with(b"HTTP/1.1 100 Continue\r\n\r\n"),
            "{path}"
        );
        stream.write_all(body.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut answer)).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
    }
}
