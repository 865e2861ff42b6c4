//! Plain-HTTP backends speaking raw HTTP/1.1: response framings, interim responses, early
//! answers, malformed heads, request encoding and connection reuse, as a client of the router
//! sees them.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// The longest any exchange in this file may take.
const LIMIT: Duration = Duration::from_secs(3);

/// Awaits `future`, failing the test if it takes longer than [`LIMIT`].
async fn within<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(LIMIT, future)
        .await
        .expect("the exchange finishes in time")
}

/// A request as the raw backend read it.
#[derive(Debug)]
struct Received {
    /// The request line, without its line end.
    line: String,
    /// Header fields in order, names lowercased.
    headers: Vec<(String, String)>,
    /// The body, decoded; empty when the backend does not read bodies.
    body: Vec<u8>,
}

impl Received {
    /// The first value of header `name` (lowercase).
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(field, _)| field == name)
            .map(|(_, value)| value.as_str())
    }

    fn method(&self) -> &str {
        self.line.split(' ').next().unwrap_or("")
    }

    fn target(&self) -> &str {
        self.line.split(' ').nth(1).unwrap_or("")
    }
}

/// What the raw backend writes back for one request.
struct Reply {
    /// The response bytes, one write per piece.
    writes: Vec<Vec<u8>>,
    /// Whether the backend closes the connection after the last piece.
    close: bool,
    /// How long the backend waits before each piece after the first.
    pause: Duration,
}

impl Reply {
    /// `bytes` in one write; the connection stays open for the next request.
    fn keep_open(bytes: &[u8]) -> Self {
        Self {
            writes: vec![bytes.to_vec()],
            close: false,
            pause: Duration::ZERO,
        }
    }

    /// `bytes` in one write, then the connection is closed.
    fn then_close(bytes: &[u8]) -> Self {
        Self {
            writes: vec![bytes.to_vec()],
            close: true,
            pause: Duration::ZERO,
        }
    }
}

/// A backend on a raw TCP listener that answers each request with scripted bytes.
struct RawBackend {
    /// `127.0.0.1:port`.
    addr: String,
    accepted: Arc<AtomicUsize>,
    received: mpsc::UnboundedReceiver<Received>,
}

impl RawBackend {
    /// Connections accepted so far.
    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// The next request the backend read (it is recorded before the reply is written).
    async fn next_request(&mut self) -> Received {
        within(self.received.recv())
            .await
            .expect("the backend is running")
    }
}

/// Starts a raw backend that reads each request's head (and its body, decoded from
/// `content-length` or chunked framing, when `read_bodies` is set) and answers with `reply`.
async fn raw_backend<F>(read_bodies: bool, reply: F) -> RawBackend
where
    F: Fn(&Received) -> Reply + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    let (sink, received) = mpsc::unbounded_channel();
    let reply = Arc::new(reply);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve_connection(
                stream,
                read_bodies,
                Arc::clone(&reply),
                sink.clone(),
            ));
        }
    });
    RawBackend {
        addr,
        accepted,
        received,
    }
}

/// Answers the requests of one connection until the peer closes it or a reply closes it.
async fn serve_connection<F>(
    mut stream: TcpStream,
    read_bodies: bool,
    reply: Arc<F>,
    sink: mpsc::UnboundedSender<Received>,
) where
    F: Fn(&Received) -> Reply,
{
    let mut buffer = Vec::new();
    while let Some(request) = read_request(&mut stream, &mut buffer, read_bodies).await {
        let answer = reply(&request);
        let _ = sink.send(request);
        for (index, piece) in answer.writes.iter().enumerate() {
            if index > 0 && !answer.pause.is_zero() {
                tokio::time::sleep(answer.pause).await;
            }
            if stream.write_all(piece).await.is_err() {
                return;
            }
        }
        if answer.close {
            let _ = stream.shutdown().await;
            return;
        }
    }
}

/// Reads one request from `stream`, bytes already read waiting in `buffer`; `None` at the end of
/// the connection or for a request it cannot parse.
async fn read_request(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
    read_bodies: bool,
) -> Option<Received> {
    let end = loop {
        if let Some(end) = find(buffer, b"\r\n\r\n") {
            break end;
        }
        fill(stream, buffer).await?;
    };
    let head = String::from_utf8(buffer.drain(..end + 4).collect()).ok()?;
    let mut lines = head.trim_end().split("\r\n");
    let line = lines.next()?.to_owned();
    let headers = lines
        .map(|field| {
            let (name, value) = field.split_once(':')?;
            Some((name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        })
        .collect::<Option<Vec<_>>>()?;
    let mut request = Received {
        line,
        headers,
        body: Vec::new(),
    };
    if !read_bodies {
        return Some(request);
    }
    let chunked = request
        .header("transfer-encoding")
        .is_some_and(|coding| coding.eq_ignore_ascii_case("chunked"));
    if chunked {
        request.body = read_chunked(stream, buffer).await?;
    } else if let Some(length) = request.header("content-length") {
        let length: usize = length.parse().ok()?;
        while buffer.len() < length {
            fill(stream, buffer).await?;
        }
        request.body = buffer.drain(..length).collect();
    }
    Some(request)
}

/// A chunked body, decoded; the trailer block is read and dropped.
async fn read_chunked(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line = read_line(stream, buffer).await?;
        let size = usize::from_str_radix(line.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            while !read_line(stream, buffer).await?.is_empty() {}
            return Some(body);
        }
        while buffer.len() < size + 2 {
            fill(stream, buffer).await?;
        }
        if &buffer[size..size + 2] != b"\r\n" {
            return None;
        }
        body.extend_from_slice(&buffer[..size]);
        buffer.drain(..size + 2);
    }
}

/// One CRLF-terminated line, without its line end.
async fn read_line(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = find(buffer, b"\r\n") {
            let line = String::from_utf8(buffer.drain(..end + 2).collect()).ok()?;
            return Some(line.trim_end().to_owned());
        }
        fill(stream, buffer).await?;
    }
}

/// A round-robin router with `backend` as its only backend.
async fn router_for(backend: &RawBackend) -> TestRouter {
    router_with(round_robin(), backend).await
}

async fn router_with(config: custom_router::config::Config, backend: &RawBackend) -> TestRouter {
    let router = start_router(config).await;
    set_backends(router.addr, std::slice::from_ref(&backend.addr)).await;
    router
}

/// GET `path` through `router`: status and body.
async fn get_path(router: &TestRouter, path: &str) -> (StatusCode, Bytes) {
    let request = Request::get(router.url(path)).body(full("")).unwrap();
    let (status, _, body) = within(send(request)).await;
    (status, body)
}

#[tokio::test]
async fn a_chunked_response_arrives_decoded_and_the_connection_is_reused() {
    let backend = raw_backend(false, |_| Reply {
        writes: [
            &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"[..],
            b"5;x=1\r\nhel",
            b"lo\r\n6\r\n world\r\n",
            b"0\r\nx-check",
            b"sum: 7\r\n\r\n",
        ]
        .map(<[u8]>::to_vec)
        .to_vec(),
        close: false,
        pause: Duration::ZERO,
    })
    .await;
    let router = router_for(&backend).await;
    for _ in 0..2 {
        let (status, body) = get_path(&router, "/chunked").await;
        assert_eq!((status, &body[..]), (StatusCode::OK, &b"hello world"[..]));
    }
    assert_eq!(
        backend.accepted(),
        1,
        "the second request reuses the connection"
    );
}

#[tokio::test]
async fn a_response_delimited_by_the_end_of_the_connection_arrives_whole_and_is_not_reused() {
    let expected: Vec<u8> = (0..100 * 1024).map(pattern_byte).collect();
    let body = expected.clone();
    let backend = raw_backend(false, move |_| {
        let mut writes =
            vec![b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n\r\n".to_vec()];
        writes.extend(body.chunks(16 * 1024).map(<[u8]>::to_vec));
        Reply {
            writes,
            close: true,
            pause: Duration::ZERO,
        }
    })
    .await;
    let router = router_for(&backend).await;
    for round in 1..=2 {
        let (status, body) = get_path(&router, "/download").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body.len(), expected.len());
        assert!(body == expected, "the body arrives unchanged");
        assert_eq!(backend.accepted(), round, "one connection per response");
    }
}

#[tokio::test]
async fn a_response_that_says_connection_close_is_not_reused_even_if_the_socket_stays_open() {
    let backend = raw_backend(false, |_| {
        Reply::keep_open(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
    })
    .await;
    let router = router_for(&backend).await;
    for _ in 0..2 {
        let (status, body) = get_path(&router, "/").await;
        assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok"[..]));
    }
    assert_eq!(backend.accepted(), 2);
}

#[tokio::test]
async fn an_interim_100_continue_is_skipped_and_the_final_response_reaches_the_client() {
    const INTERIM: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";
    const FINAL: &[u8] = b"HTTP/1.1 201 Created\r\ncontent-length: 7\r\n\r\ncreated";
    // `/together`: both responses in one write; `/apart`: one write each.
    let backend = raw_backend(true, |request| Reply {
        writes: if request.target() == "/together" {
            vec![[INTERIM, FINAL].concat()]
        } else {
            vec![INTERIM.to_vec(), FINAL.to_vec()]
        },
        close: false,
        pause: Duration::ZERO,
    })
    .await;
    let router = router_for(&backend).await;
    for path in ["/apart", "/together", "/apart"] {
        let request = Request::post(router.url(path))
            .body(full("{\"name\":\"a\"}"))
            .unwrap();
        let (status, _, body) = tokio::time::timeout(LIMIT, send(request))
            .await
            .unwrap_or_else(|_| panic!("{path}: no answer in time"));
        assert_eq!(
            (status, &body[..]),
            (StatusCode::CREATED, &b"created"[..]),
            "{path}"
        );
    }
    assert_eq!(
        backend.accepted(),
        1,
        "nothing of the exchanges is left over"
    );
}

#[tokio::test]
async fn an_early_answer_reaches_the_client_while_its_body_is_still_streaming() {
    let backend = raw_backend(false, |_| {
        Reply::then_close(
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 8\r\nconnection: close\r\n\r\ntoo big!",
        )
    })
    .await;
    let mut config = round_robin();
    // No body is kept in memory for a retry: the first chunk goes to the backend at once.
    config.retry.body_limit = 0;
    let router = router_with(config, &backend).await;
    let (chunks, body) = channel_body();
    chunks.send(Bytes::from(vec![b'x'; 4096])).await.unwrap();
    let request = Request::post(router.url("/upload")).body(body).unwrap();
    let exchange = async {
        let response = client().request(request).await.expect("a response");
        let status = response.status();
        let body = response.into_body().collect().await.map(|b| b.to_bytes());
        (status, body)
    };
    let (status, body) = tokio::time::timeout(LIMIT, exchange)
        .await
        .expect("the answer arrives while the request body is still open");
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(&body.expect("the body arrives")[..], b"too big!");
    // The request body stays open until the answer was checked.
    drop(chunks);
}

#[tokio::test]
async fn a_malformed_response_gives_502_naming_the_backend() {
    for garbage in [
        &b"HTTP/1.1 abc\r\n\r\n"[..],
        b"\x00\x01 not http at all\r\n\r\n",
    ] {
        let backend = raw_backend(false, move |_| Reply::keep_open(garbage)).await;
        let router = router_for(&backend).await;
        let (status, body) = within(get_json(&router.url("/"))).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{garbage:?}: {body}");
        let error = body["error"].as_str().expect("a JSON error");
        assert!(error.contains(&backend.addr), "{error}");
    }
}

#[tokio::test]
async fn a_response_head_over_the_limit_gives_502() {
    let limit = custom_router::h1::MAX_HEAD_BYTES;
    let mut head = b"HTTP/1.1 200 OK\r\nx-big: ".to_vec();
    head.resize(head.len() + 70 * 1024, b'a');
    head.extend_from_slice(b"\r\ncontent-length: 2\r\n\r\nok");
    assert!(head.len() > limit);
    // The head in one write; then its first `limit - 512` bytes, a pause that lets the router
    // read them on their own, and the rest, which completes the head in the router's next read.
    let deliveries = [
        (vec![head.clone()], Duration::ZERO),
        (
            vec![head[..limit - 512].to_vec(), head[limit - 512..].to_vec()],
            Duration::from_millis(50),
        ),
    ];
    for (writes, pause) in deliveries {
        let pieces = writes.len();
        let backend = raw_backend(false, move |_| Reply {
            writes: writes.clone(),
            close: false,
            pause,
        })
        .await;
        let router = router_for(&backend).await;
        let (status, body) = within(get_json(&router.url("/"))).await;
        assert_eq!(
            status,
            StatusCode::BAD_GATEWAY,
            "head in {pieces} write(s): {body}"
        );
        let error = body["error"].as_str().expect("a JSON error");
        assert!(error.contains(&backend.addr), "{error}");
    }
}

#[tokio::test]
async fn a_head_response_has_no_body_and_only_one_announcing_none_keeps_its_connection() {
    let backend = raw_backend(false, |request| {
        match (request.method(), request.target()) {
            // A HEAD answer that announces a body: the backend might send it after all.
            ("HEAD", "/sized") => Reply::keep_open(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"),
            ("HEAD", _) => Reply::keep_open(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
            _ => Reply::keep_open(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"),
        }
    })
    .await;
    let router = router_for(&backend).await;
    let request = Request::head(router.url("/sized")).body(full("")).unwrap();
    let (status, headers, body) = within(send(request)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-length"], "5");
    assert!(body.is_empty());
    let (status, body) = get_path(&router, "/").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"hello"[..]));
    assert_eq!(backend.accepted(), 2, "the HEAD's connection was closed");
    let request = Request::head(router.url("/empty")).body(full("")).unwrap();
    let (status, _, body) = within(send(request)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.is_empty());
    let (status, body) = get_path(&router, "/").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"hello"[..]));
    assert_eq!(
        backend.accepted(),
        2,
        "one connection served the last three"
    );
}

#[tokio::test]
async fn a_204_without_length_leaves_the_connection_reusable() {
    let backend = raw_backend(false, |request| {
        if request.target() == "/empty" {
            Reply::keep_open(b"HTTP/1.1 204 No Content\r\n\r\n")
        } else {
            Reply::keep_open(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        }
    })
    .await;
    let router = router_for(&backend).await;
    let (status, body) = get_path(&router, "/empty").await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(body.is_empty());
    let (status, body) = get_path(&router, "/").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok"[..]));
    assert_eq!(
        backend.accepted(),
        1,
        "the second request reuses the connection"
    );
}

#[tokio::test]
async fn a_request_arrives_in_origin_form_with_its_length_and_exact_body() {
    let mut backend = raw_backend(true, |_| {
        Reply::keep_open(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    })
    .await;
    let router = router_for(&backend).await;
    let payload = &b"{\"prompt\":\"hi\\r\\n\"}"[..];
    let request = Request::post(router.url("/path?q=1"))
        .header("content-type", "application/json")
        .body(full(payload))
        .unwrap();
    let (status, _, body) = within(send(request)).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok"[..]));
    let received = backend.next_request().await;
    assert_eq!(received.line, "POST /path?q=1 HTTP/1.1");
    let length = payload.len().to_string();
    assert_eq!(received.header("content-length"), Some(length.as_str()));
    assert_eq!(received.header("transfer-encoding"), None);
    assert_eq!(
        received.header("host"),
        Some(router.addr.to_string().as_str())
    );
    assert_eq!(received.body, payload);
}

#[tokio::test]
async fn a_streamed_request_body_of_unknown_length_arrives_chunked() {
    let mut backend = raw_backend(true, |_| {
        Reply::keep_open(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    })
    .await;
    let mut config = round_robin();
    // No body is kept in memory: it streams to the backend as the client sends it.
    config.retry.body_limit = 0;
    let router = router_with(config, &backend).await;
    let (chunks, body) = channel_body();
    tokio::spawn(async move {
        for piece in ["hello", " ", "world"] {
            if chunks
                .send(Bytes::from_static(piece.as_bytes()))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    let request = Request::post(router.url("/stream")).body(body).unwrap();
    let response = within(client().request(request)).await.expect("a response");
    assert_eq!(response.status(), StatusCode::OK);
    let received = backend.next_request().await;
    assert_eq!(received.line, "POST /stream HTTP/1.1");
    assert_eq!(received.header("transfer-encoding"), Some("chunked"));
    assert_eq!(received.header("content-length"), None);
    assert_eq!(received.body, b"hello world");
}

#[tokio::test]
async fn a_backends_end_to_end_fields_reach_http1_and_h2c_clients_as_sent() {
    let backend = raw_backend(false, |request| {
        let answer: &[u8] = if request.method() == "HEAD" {
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-End: kept\r\n\r\n"
        } else {
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nDate: Mon, 30 Nov 2026 10:00:00 GMT\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-End: kept\r\n\r\nok"
        };
        Reply::keep_open(answer)
    })
    .await;
    let router = router_for(&backend).await;
    let h2c = h2c_client();
    for over_h2c in [false, true] {
        let request = Request::get(router.url("/fields")).body(full("")).unwrap();
        let response = if over_h2c {
            within(h2c.request(request)).await.unwrap()
        } else {
            within(client().request(request)).await.unwrap()
        };
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok", "h2c: {over_h2c}");
        let cookies: Vec<_> = headers.get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"], "h2c: {over_h2c}");
        assert_eq!(headers["x-end"], "kept", "h2c: {over_h2c}");
        let dates: Vec<_> = headers.get_all("date").iter().collect();
        assert_eq!(dates, ["Mon, 30 Nov 2026 10:00:00 GMT"], "h2c: {over_h2c}");
        assert!(!headers.contains_key("keep-alive"), "h2c: {over_h2c}");
        assert!(
            headers.get_all("content-length").iter().count() <= 1,
            "h2c: {over_h2c}"
        );
        if !over_h2c {
            assert_eq!(headers["content-length"], "2");
        }
    }
    // A bodiless answer keeps the backend's length, and the router adds its own date.
    let request = Request::head(router.url("/fields")).body(full("")).unwrap();
    let (status, headers, body) = within(send(request)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.is_empty());
    assert_eq!(headers["content-length"], "5");
    assert_eq!(headers["x-end"], "kept");
    assert_eq!(headers.get_all("date").iter().count(), 1);
}

#[tokio::test]
async fn a_backends_trailers_reach_http1_and_h2c_clients_without_framing_or_hop_by_hop_fields() {
    let backend = raw_backend(false, |_request| {
        Reply::keep_open(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: x-sum\r\n\r\n5\r\nhello\r\n0\r\nx-sum: 42\r\nConnection: close\r\nKeep-Alive: timeout=5\r\nTransfer-Encoding: chunked\r\nContent-Length: 40\r\nHost: elsewhere\r\nTrailer: x-sum\r\n\r\n",
        )
    })
    .await;
    let router = router_for(&backend).await;
    let h2c = h2c_client();
    for over_h2c in [false, true] {
        let request = Request::get(router.url("/trailers"))
            .header("te", "trailers")
            .body(full(""))
            .unwrap();
        let response = if over_h2c {
            within(h2c.request(request)).await.unwrap()
        } else {
            within(client().request(request)).await.unwrap()
        };
        assert_eq!(response.status(), StatusCode::OK, "h2c: {over_h2c}");
        let collected = within(response.into_body().collect())
            .await
            .unwrap_or_else(|error| panic!("h2c: {over_h2c}: body cut: {error}"));
        let trailers = collected.trailers().cloned().unwrap_or_default();
        assert_eq!(&collected.to_bytes()[..], b"hello", "h2c: {over_h2c}");
        let names: Vec<_> = trailers.keys().map(|name| name.as_str()).collect();
        assert_eq!(names, ["x-sum"], "h2c: {over_h2c}");
        assert_eq!(trailers["x-sum"], "42", "h2c: {over_h2c}");
    }
}
