//! `https://` backends (hyper-util's client over rustls) held to the guarantees of the router's
//! own HTTP/1 client: connect timeout through the TLS handshake, a write stall bounded by the
//! idle timeout, framing refused or connections closed as docs/reliability.md says, no answer
//! ever read for another request, retries only when safe, certificates and SNI, forwarding
//! fields. Each test drives a scripted TLS backend on 127.0.0.1 whose certificate is trusted
//! through `upstream.tls_ca_file`; the `control_http_*` tests run the same scenarios against an
//! `http://` backend.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use custom_router::config::Config;
use http::{Request, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;

const POISON: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nPOISON";

// ---------------------------------------------------------------------------------------------
// Certificates and the scripted TLS backend.
// ---------------------------------------------------------------------------------------------

fn certs() -> TestCerts {
    tls_certs(&["127.0.0.1", "localhost"])
}

/// A request as the backend read it.
#[derive(Debug, Clone, Default)]
struct Req {
    head: String,
    body: Vec<u8>,
}

impl Req {
    fn line(&self) -> &str {
        self.head.lines().next().unwrap_or("")
    }
    fn method(&self) -> &str {
        self.line().split(' ').next().unwrap_or("")
    }
    fn target(&self) -> &str {
        self.line().split(' ').nth(1).unwrap_or("")
    }
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    }
    fn content_length(&self) -> usize {
        self.header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

struct Conn {
    stream: Box<dyn Io>,
    buf: Vec<u8>,
    /// The connection's number (0 for the first the backend accepted).
    #[allow(dead_code)]
    number: usize,
}

impl Conn {
    async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 16 * 1024];
        match self.stream.read(&mut chunk).await {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }

    /// The next request head (the body left unread).
    async fn read_head(&mut self) -> Option<Req> {
        loop {
            if let Some(end) = find(&self.buf, b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buf[..end]).into_owned();
                self.buf.drain(..end + 4);
                return Some(Req {
                    head,
                    body: Vec::new(),
                });
            }
            if !self.fill().await {
                return None;
            }
        }
    }

    /// The next request, its `Content-Length` body read.
    async fn read_request(&mut self) -> Option<Req> {
        let mut req = self.read_head().await?;
        let len = req.content_length();
        while self.buf.len() < len {
            if !self.fill().await {
                return None;
            }
        }
        req.body = self.buf.drain(..len).collect();
        Some(req)
    }

    async fn write(&mut self, bytes: &[u8]) {
        let _ = self.stream.write_all(bytes).await;
        let _ = self.stream.flush().await;
    }

    /// Whether the peer closes the connection (EOF or error) within `limit`; bytes read meanwhile
    /// are kept.
    async fn closed_within(&mut self, limit: Duration) -> bool {
        tokio::time::timeout(limit, async { while self.fill().await {} })
            .await
            .is_ok()
    }
}

struct TlsBackend {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicUsize>,
    sni: Arc<Mutex<Vec<Option<String>>>>,
    _task: tokio::task::JoinHandle<()>,
}

impl TlsBackend {
    fn url(&self) -> String {
        format!("https://{}", self.addr)
    }
    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for TlsBackend {
    fn drop(&mut self) {
        self._task.abort();
    }
}

async fn tls_backend<F, Fut>(certs: &TestCerts, handler: F) -> TlsBackend
where
    F: Fn(Conn) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let acceptor = certs.acceptor.clone();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let sni: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let (count, names) = (Arc::clone(&connections), Arc::clone(&sni));
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            let handler = handler.clone();
            let count = Arc::clone(&count);
            let names = Arc::clone(&names);
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                names
                    .lock()
                    .unwrap()
                    .push(stream.get_ref().1.server_name().map(str::to_owned));
                let number = count.fetch_add(1, Ordering::SeqCst);
                let stream: TlsStream<TcpStream> = stream;
                handler(Conn {
                    stream: Box::new(stream),
                    buf: Vec::new(),
                    number,
                })
                .await;
            });
        }
    });
    TlsBackend {
        addr,
        connections,
        sni,
        _task: task,
    }
}

/// The same scripted backend over plain TCP (an `http://` backend: the control).
async fn plain_backend<F, Fut>(handler: F) -> TlsBackend
where
    F: Fn(Conn) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&connections);
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let handler = handler.clone();
            let number = count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(handler(Conn {
                stream: Box::new(stream),
                buf: Vec::new(),
                number,
            }));
        }
    });
    TlsBackend {
        addr,
        connections,
        sni: Arc::default(),
        _task: task,
    }
}

fn ok_with(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A backend that answers every request (body read) with its target as the body, except that
/// `/x` gets `pieces` (each after its pause in ms).
async fn scripted(certs: &TestCerts, pieces: Vec<(u64, Vec<u8>)>, close_after: bool) -> TlsBackend {
    tls_backend(certs, move |mut conn| {
        let pieces = pieces.clone();
        async move {
            while let Some(req) = conn.read_request().await {
                if req.target() == "/x" {
                    for (ms, bytes) in &pieces {
                        tokio::time::sleep(Duration::from_millis(*ms)).await;
                        conn.write(bytes).await;
                    }
                    if close_after {
                        return;
                    }
                } else if req.method() == "HEAD" {
                    conn.write(
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
                            req.target().len()
                        )
                        .as_bytes(),
                    )
                    .await;
                } else {
                    conn.write(&ok_with(req.target())).await;
                }
            }
        }
    })
    .await
}

fn config_for(certs: &TestCerts) -> Config {
    let mut config = round_robin();
    config.upstream.tls_ca_file = Some(certs.ca_file.clone());
    config.latency.threshold = Duration::from_millis(50);
    config
}

async fn router_for(config: Config, backends: &[String]) -> TestRouter {
    let router = start_router(config).await;
    set_backends(router.addr, backends).await;
    router
}

/// Raw HTTP/1 exchange with the router (`request` should say `Connection: close`): everything
/// read until the router closes, or `None` past `limit`.
async fn raw(router: &TestRouter, request: &[u8], limit: Duration) -> Option<Vec<u8>> {
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(limit, async {
        while fill(&mut stream, &mut out).await.is_some() {}
    })
    .await
    .ok()?;
    Some(out)
}

async fn get_within(
    router: &TestRouter,
    path: &str,
    limit: Duration,
) -> Option<(StatusCode, String)> {
    tokio::time::timeout(limit, get(&router.url(path)))
        .await
        .ok()
}

async fn in_flight(router: &TestRouter) -> i64 {
    let (_, health) = get_json(&router.url("/_custom_router/health")).await;
    health["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["in_flight"].as_i64().unwrap())
        .sum()
}

// ---------------------------------------------------------------------------------------------
// Timeouts.
// ---------------------------------------------------------------------------------------------

/// A backend that accepts the TCP connection but never answers the ClientHello. The docs:
/// `upstream.connect_timeout` bounds "opening a connection to a backend", and "a TLS failure is a
/// connect failure". The plain-HTTP path fails such an attempt with `connect_timeout`.
#[tokio::test]
async fn a_tls_handshake_that_stalls_is_bounded_by_the_connect_timeout() {
    let c = certs();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let mut config = config_for(&c);
    config.upstream.connect_timeout = Duration::from_millis(500);
    let router = router_for(config, &[format!("https://{addr}")]).await;
    let started = Instant::now();
    let answer = get_within(&router, "/v1/models", Duration::from_secs(5)).await;
    assert!(
        answer.is_some(),
        "no answer after 5 s although connect_timeout is 0.5 s (TLS handshake unbounded)"
    );
    let (status, body) = answer.unwrap();
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert!(body.contains("connect timeout"), "{body}");
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// Same stalled handshake with a healthy second backend: a connect failure is retried for any
/// method (POST here).
#[tokio::test]
async fn a_post_to_a_backend_whose_handshake_stalls_is_retried_elsewhere() {
    let c = certs();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let good = scripted(&c, vec![], false).await;
    let mut config = config_for(&c);
    config.upstream.connect_timeout = Duration::from_millis(300);
    let router = router_for(config, &[format!("https://{addr}"), good.url()]).await;
    for _ in 0..2 {
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            post_json(&router.url("/v1/completions"), "{}"),
        )
        .await;
        let (status, body) =
            answer.expect("POST never answered: stalled TLS handshake not bounded");
        assert_eq!(status, StatusCode::OK, "{body}");
    }
}

/// A backend silent before its head, with `first_byte_timeout`: 504, the backend connection is
/// closed (slot released), and the late answer reaches nobody.
#[tokio::test]
async fn a_first_byte_timeout_closes_the_tls_connection_and_the_late_answer_reaches_nobody() {
    let c = certs();
    let closed = Arc::new(Mutex::new(None::<bool>));
    let seen = Arc::clone(&closed);
    let backend = tls_backend(&c, move |mut conn| {
        let seen = Arc::clone(&seen);
        async move {
            while let Some(req) = conn.read_request().await {
                if req.target() == "/slow" {
                    tokio::time::sleep(Duration::from_millis(700)).await;
                    conn.write(POISON).await;
                    let gone = conn.closed_within(Duration::from_millis(800)).await;
                    *seen.lock().unwrap() = Some(gone);
                    return;
                }
                conn.write(&ok_with(req.target())).await;
            }
        }
    })
    .await;
    let mut config = config_for(&c);
    config.upstream.first_byte_timeout = Some(Duration::from_millis(300));
    config.retry.max_attempts = 1;
    let router = router_for(config, &[backend.url()]).await;
    let (status, body) = get(&router.url("/slow")).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{body}");
    for i in 0..5 {
        let (status, body) = get(&router.url(&format!("/after-{i}"))).await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::OK, format!("/after-{i}").as_str())
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        *closed.lock().unwrap(),
        Some(true),
        "the timed-out connection was not closed"
    );
    assert_eq!(in_flight(&router).await, 0);
}

/// `upstream.idle_timeout` mid-body: the client's connection is closed without the body's end,
/// and the backend connection closed.
#[tokio::test]
async fn an_idle_tls_body_is_cut_at_the_idle_timeout() {
    let c = certs();
    let closed = Arc::new(Mutex::new(None::<bool>));
    let seen = Arc::clone(&closed);
    let backend = tls_backend(&c, move |mut conn| {
        let seen = Arc::clone(&seen);
        async move {
            let Some(_req) = conn.read_request().await else {
                return;
            };
            conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart")
                .await;
            let gone = conn.closed_within(Duration::from_secs(3)).await;
            *seen.lock().unwrap() = Some(gone);
        }
    })
    .await;
    let mut config = config_for(&c);
    config.upstream.idle_timeout = Some(Duration::from_millis(400));
    let router = router_for(config, &[backend.url()]).await;
    let started = Instant::now();
    let out = raw(
        &router,
        b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        Duration::from_secs(4),
    )
    .await
    .expect("the client's connection was not closed at the idle timeout");
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.ends_with("part"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(2));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(*closed.lock().unwrap(), Some(true));
    assert_eq!(in_flight(&router).await, 0);
}

/// A backend that reads the head of a streamed upload and then takes none of its body. The
/// plain-HTTP path fails the exchange after `upstream.idle_timeout` without progress
/// (`pool::send`'s `stall`; the `UpstreamConfig::idle_timeout` doc: "or a request being
/// written"); no first-byte timeout is set (the default).
async fn stop_reading(mut conn: Conn) {
    let Some(_req) = conn.read_head().await else {
        return;
    };
    // Never read again, never answer.
    tokio::time::sleep(Duration::from_secs(30)).await;
    drop(conn);
}

#[tokio::test]
async fn a_tls_backend_that_stops_reading_a_streamed_upload_is_bounded_by_the_idle_timeout() {
    let (answered, held) = upload_to_a_backend_that_stops_reading(true).await;
    assert!(
        answered,
        "no answer and no close 6 s after the backend stopped reading (idle_timeout 0.5 s); backend in_flight = {held}"
    );
}

#[tokio::test]
async fn control_http_backend_that_stops_reading_a_streamed_upload_is_bounded() {
    let (answered, held) = upload_to_a_backend_that_stops_reading(false).await;
    assert!(answered, "http control: in_flight = {held}");
}

async fn upload_to_a_backend_that_stops_reading(tls: bool) -> (bool, i64) {
    let c = certs();
    let (backend, url) = if tls {
        let b = tls_backend(&c, stop_reading).await;
        let url = b.url();
        (b, url)
    } else {
        let b = plain_backend(stop_reading).await;
        let url = format!("http://{}", b.addr);
        (b, url)
    };
    let mut config = config_for(&c);
    config.upstream.idle_timeout = Some(Duration::from_millis(500));
    config.retry.body_limit = 1024;
    config.limits.body_read_timeout = Duration::from_secs(60);
    let router = router_for(config, &[url]).await;
    let _keep = &backend;
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    let total: usize = 256 * 1024 * 1024;
    stream
        .write_all(
            format!("POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: {total}\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let _pusher = tokio::spawn(async move {
        let chunk = vec![b'u'; 64 * 1024];
        let mut sent = 0;
        while sent < total {
            if writer.write_all(&chunk).await.is_err() {
                return;
            }
            sent += chunk.len();
        }
    });
    let mut out = Vec::new();
    let answered = tokio::time::timeout(Duration::from_secs(6), async {
        let mut chunk = [0u8; 4096];
        loop {
            match reader.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    out.extend_from_slice(&chunk[..n]);
                    if find(&out, b"\r\n\r\n").is_some() {
                        return;
                    }
                }
            }
        }
    })
    .await
    .is_ok();
    let held = in_flight(&router).await;
    (answered, held)
}

// ---------------------------------------------------------------------------------------------
// Clients that leave.
// ---------------------------------------------------------------------------------------------

/// A client that leaves while the backend prepares its head: the backend connection is closed and
/// the slot released.
#[tokio::test]
async fn a_client_that_leaves_before_the_head_closes_the_tls_connection() {
    let c = certs();
    let closed = Arc::new(Mutex::new(None::<bool>));
    let seen = Arc::clone(&closed);
    let backend = tls_backend(&c, move |mut conn| {
        let seen = Arc::clone(&seen);
        async move {
            let Some(_req) = conn.read_request().await else {
                return;
            };
            let gone = conn.closed_within(Duration::from_secs(3)).await;
            *seen.lock().unwrap() = Some(gone);
        }
    })
    .await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    stream
        .write_all(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(2), async || in_flight(&router).await
            == 1)
        .await
    );
    drop(stream);
    assert!(
        eventually(Duration::from_secs(2), async || in_flight(&router).await
            == 0)
        .await
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(*closed.lock().unwrap(), Some(true));
}

/// A client that leaves mid-stream: the backend connection is closed and the slot released.
#[tokio::test]
async fn a_client_that_leaves_mid_stream_closes_the_tls_connection() {
    let c = certs();
    let closed = Arc::new(Mutex::new(None::<bool>));
    let seen = Arc::clone(&closed);
    let backend = tls_backend(&c, move |mut conn| {
        let seen = Arc::clone(&seen);
        async move {
            let Some(_req) = conn.read_request().await else { return };
            conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata:1\r\n").await;
            let gone = conn.closed_within(Duration::from_secs(3)).await;
            *seen.lock().unwrap() = Some(gone);
        }
    })
    .await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    stream
        .write_all(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    while find(&out, b"data:1").is_none() {
        fill(&mut stream, &mut out).await.unwrap();
    }
    drop(stream);
    assert!(
        eventually(Duration::from_secs(2), async || in_flight(&router).await
            == 0)
        .await
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(*closed.lock().unwrap(), Some(true));
}

// ---------------------------------------------------------------------------------------------
// Isolation: no response handed to another request.
// ---------------------------------------------------------------------------------------------

/// Runs `GET /x` (or `HEAD /x`) against a backend answering `/x` with `pieces`, then, after
/// `settle` ms, canary requests on fresh client connections. Returns the first answer and every
/// canary's (status, body).
async fn desync_run(
    pieces: Vec<(u64, Vec<u8>)>,
    method: &str,
    settle: u64,
) -> (Vec<u8>, Vec<(StatusCode, String)>) {
    let c = certs();
    let backend = scripted(&c, pieces, false).await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let first = raw(
        &router,
        format!("{method} /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes(),
        Duration::from_secs(3),
    )
    .await
    .unwrap_or_default();
    tokio::time::sleep(Duration::from_millis(settle)).await;
    let mut canaries = Vec::new();
    for i in 0..3 {
        let answer = get_within(&router, &format!("/canary-{i}"), Duration::from_secs(3))
            .await
            .unwrap_or((StatusCode::IM_A_TEAPOT, "no answer".into()));
        canaries.push(answer);
    }
    (first, canaries)
}

fn canaries_ok(canaries: &[(StatusCode, String)]) -> bool {
    canaries
        .iter()
        .enumerate()
        .all(|(i, (s, b))| *s == StatusCode::OK && *b == format!("/canary-{i}"))
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// The conformance corpus' desync vectors (same segment and 40 ms later, canaries 120 ms after),
/// replayed against a TLS backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn desync_vectors_with_a_settle_reach_no_other_request_over_tls() {
    let mut failures = Vec::new();
    let heads: Vec<(&str, &str, Vec<u8>)> = vec![
        (
            "cl-extra",
            "GET",
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello".to_vec(),
        ),
        (
            "head-with-body",
            "HEAD",
            format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
                POISON.len()
            )
            .into_bytes(),
        ),
        (
            "204-with-body",
            "GET",
            b"HTTP/1.1 204 No Content\r\n\r\n".to_vec(),
        ),
        (
            "304-with-body",
            "GET",
            b"HTTP/1.1 304 Not Modified\r\netag: \"a\"\r\n\r\n".to_vec(),
        ),
        (
            "http10-keep-alive-stray",
            "GET",
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
        ),
        (
            "chunked-extra",
            "GET",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
        ),
        (
            "cl-zero-extra",
            "GET",
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".to_vec(),
        ),
        (
            "connection-close-kept-open",
            "GET",
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 5\r\n\r\nhello".to_vec(),
        ),
    ];
    for (id, method, head) in heads {
        for later in [false, true] {
            let pieces = if later {
                vec![(0, head.clone()), (40, POISON.to_vec())]
            } else {
                vec![(0, cat(&[&head, POISON]))]
            };
            let (first, canaries) = desync_run(pieces, method, 120).await;
            let first = String::from_utf8_lossy(&first).into_owned();
            if first.contains("POISON") || !canaries_ok(&canaries) {
                failures.push(format!(
                    "{id}-{later}: first={first:?} canaries={canaries:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// `do_HEAD = do_GET` (or a 204 that announces a length) with the body a moment after the head
/// (a generated page), and another client's request arriving within that moment. The plain-HTTP
/// path closes a connection whose bodiless answer announced a body (reliability.md: "the body a
/// misbehaving backend may send after the head can never be read as the next answer"), whatever
/// the timing.
async fn bodiless_then_late_body(mut conn: Conn) {
    let page: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\nHIJACK!";
    while let Some(req) = conn.read_request().await {
        let head = match (req.method(), req.target()) {
            ("HEAD", _) => format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", page.len()),
            (_, "/204") => format!(
                "HTTP/1.1 204 No Content\r\ncontent-length: {}\r\n\r\n",
                page.len()
            ),
            (_, target) => {
                conn.write(&ok_with(target)).await;
                continue;
            }
        };
        conn.write(head.as_bytes()).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        conn.write(page).await;
    }
}

/// The bodiless exchange (`HEAD /x` or `GET /204`), then at once `GET /account` from another
/// client: what that client got.
async fn bodiless_then_next(url: String, router: &TestRouter, head: bool) -> (StatusCode, String) {
    let _ = url;
    let first: &[u8] = if head {
        b"HEAD /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    } else {
        b"GET /204 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    };
    let answer = raw(router, first, Duration::from_secs(3)).await.unwrap();
    assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 2"));
    get(&router.url("/account")).await
}

#[tokio::test]
async fn a_head_answer_announcing_a_body_sent_late_is_never_read_as_the_next_answer() {
    let c = certs();
    let backend = tls_backend(&c, bodiless_then_late_body).await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let (status, body) = bodiless_then_next(backend.url(), &router, true).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "/account"),
        "another request got the body of a HEAD answer ({} backend connection(s))",
        backend.connections()
    );
}

#[tokio::test]
async fn a_204_announcing_a_body_sent_late_is_never_read_as_the_next_answer() {
    let c = certs();
    let backend = tls_backend(&c, bodiless_then_late_body).await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let (status, body) = bodiless_then_next(backend.url(), &router, false).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "/account"));
}

/// Control: the same two scenarios against an `http://` backend pass.
#[tokio::test]
async fn control_http_bodiless_answers_announcing_a_body_close_their_connection() {
    let c = certs();
    for head in [true, false] {
        let backend = plain_backend(bodiless_then_late_body).await;
        let router = router_for(config_for(&c), &[format!("http://{}", backend.addr)]).await;
        let (status, body) = bodiless_then_next(String::new(), &router, head).await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::OK, "/account"),
            "head={head}"
        );
        assert_eq!(backend.connections(), 2);
    }
}

/// A TLS backend's answer with both `Content-Length: 0` and `Transfer-Encoding: chunked` whose
/// chunked body is a whole response. The router relays the map's `Content-Length: 0` and then
/// writes the decoded body after it on the client's connection: a pipelined (or quickly reused)
/// client connection reads the backend's bytes as its next answer.
#[tokio::test]
async fn a_tls_answer_with_both_lengths_puts_no_response_on_the_client_connection() {
    let c = certs();
    let smuggled = format!(
        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{}\r\n0\r\n\r\n",
        POISON.len(),
        String::from_utf8_lossy(POISON)
    );
    let backend = scripted(&c, vec![(0, smuggled.into_bytes())], false).await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let out = raw(
        &router,
        b"GET /x HTTP/1.1\r\nHost: a\r\n\r\nGET /canary-0 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        Duration::from_secs(3),
    )
    .await
    .unwrap_or_default();
    let text = String::from_utf8_lossy(&out);
    // What an HTTP/1 client reads: the first answer (by its Content-Length), then the second.
    let first_end = text.find("\r\n\r\n").map(|i| i + 4).unwrap_or(0);
    let first_len: usize = text[..first_end]
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .unwrap_or(0);
    let second = &text[(first_end + first_len).min(text.len())..];
    assert!(
        !second.contains("POISON"),
        "the client's second answer came from the backend's body:\n{text}"
    );
}

/// A backend that answers a POST without reading its body, then reads the body as a request
/// (the conformance vector `resp-backend-ignores-body`).
#[tokio::test]
async fn a_backend_that_ignores_request_bodies_plants_no_answer_over_tls() {
    let c = certs();
    let backend = tls_backend(&c, move |mut conn| async move {
        while let Some(req) = conn.read_head().await {
            match req.target() {
                "/x" => conn.write(&ok_with("posted")).await,
                "/planted" => conn.write(&ok_with("PLANTED")).await,
                other => {
                    let len = req.content_length();
                    while conn.buf.len() < len {
                        if !conn.fill().await {
                            return;
                        }
                    }
                    conn.buf.drain(..len);
                    conn.write(&ok_with(other)).await;
                }
            }
        }
    })
    .await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let planted = "GET /planted HTTP/1.1\r\nHost: a\r\n\r\n";
    let request = Request::post(router.url("/x")).body(full(planted)).unwrap();
    let (status, _, body) = send(request).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"posted"[..]));
    tokio::time::sleep(Duration::from_millis(120)).await;
    for i in 0..3 {
        let (status, body) = get(&router.url(&format!("/next-{i}"))).await;
        assert_eq!((status, body), (StatusCode::OK, format!("/next-{i}")));
    }
}

// ---------------------------------------------------------------------------------------------
// Response framing (reliability.md "Backend responses": each is an `io` failure, 502).
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_or_ambiguous_tls_response_framing_is_refused_with_502() {
    let mut too_many = b"HTTP/1.1 200 OK\r\n".to_vec();
    for i in 0..150 {
        too_many.extend_from_slice(format!("x-f{i}: {i}\r\n").as_bytes());
    }
    too_many.extend_from_slice(b"content-length: 2\r\n\r\nok");
    let mut too_large = b"HTTP/1.1 200 OK\r\nx-big: ".to_vec();
    too_large.extend(std::iter::repeat_n(b'a', 70 * 1024));
    too_large.extend_from_slice(b"\r\ncontent-length: 2\r\n\r\nok");
    let vectors: Vec<(&str, Vec<u8>)> = vec![
        (
            "101-unrequested",
            cat(&[
                b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
                POISON,
            ]),
        ),
        ("cl-differ", b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!".to_vec()),
        ("cl-list-same", b"HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\n\r\nhello".to_vec()),
        ("cl-dup-same", b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\nhello".to_vec()),
        (
            "cl-te",
            cat(&[
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                POISON,
            ]),
        ),
        ("te-gzip", b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nnot really gzip".to_vec()),
        (
            "te-gzip-chunked",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n".to_vec(),
        ),
        (
            "te-twice",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n".to_vec(),
        ),
        ("cl-negative", b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\nhello".to_vec()),
        ("cl-plus", b"HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\nhello".to_vec()),
        ("cl-20-digits", b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\nhello".to_vec()),
        ("status-words", b"HTTP/1.1 abc\r\n\r\n".to_vec()),
        ("status-four-digits", b"HTTP/1.1 2000 OK\r\ncontent-length: 2\r\n\r\nok".to_vec()),
        ("status-bad-version", b"HTTX/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec()),
        ("status-http2", b"HTTP/2.0 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec()),
        ("space-before-colon", b"HTTP/1.1 200 OK\r\ncontent-length : 2\r\n\r\nok".to_vec()),
        ("nul-in-value", b"HTTP/1.1 200 OK\r\nx-a: a\x00b\r\ncontent-length: 2\r\n\r\nok".to_vec()),
        ("head-too-large-70k", too_large),
        ("too-many-fields", too_many),
    ];
    let mut failures = Vec::new();
    for (id, reply) in vectors {
        let c = certs();
        let backend = scripted(&c, vec![(0, reply)], false).await;
        let router = router_for(config_for(&c), &[backend.url()]).await;
        let out = raw(
            &router,
            b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
            Duration::from_secs(3),
        )
        .await;
        let text = out
            .map(|o| String::from_utf8_lossy(&o).into_owned())
            .unwrap_or_else(|| "(no answer in 3 s)".into());
        if !text.starts_with("HTTP/1.1 502") {
            let shown: String = text.chars().take(160).collect();
            failures.push(format!("{id}: {shown:?}"));
        }
        drop(router);
    }
    assert!(failures.is_empty(), "not refused with 502: {failures:#?}");
}

/// HTTP/1.0 + chunked: an `http://` backend's is relayed (read as chunked, the connection
/// closed after it); hyper refuses it, so an `https://` backend's is a 502 (documented).
#[tokio::test]
async fn an_http10_chunked_answer_over_tls_is_refused() {
    let c = certs();
    let backend = scripted(
        &c,
        vec![(
            0,
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n".to_vec(),
        )],
        false,
    )
    .await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let (status, _) = get(&router.url("/x")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
}

/// `Content-Length` on a 204 is dropped (reliability.md).
#[tokio::test]
async fn content_length_on_a_204_is_dropped_over_tls() {
    let c = certs();
    let backend = scripted(
        &c,
        vec![(
            0,
            b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n".to_vec(),
        )],
        false,
    )
    .await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let out = raw(
        &router,
        b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        Duration::from_secs(3),
    )
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 204"), "{text}");
    assert!(!text.contains("content-length"), "{text}");
}

/// Interim 1xx answers are passed over; trailers lose their framing fields.
#[tokio::test]
async fn interim_answers_and_trailer_framing_fields_over_tls() {
    let c = certs();
    let backend = tls_backend(&c, move |mut conn| async move {
        while let Some(req) = conn.read_request().await {
            match req.target() {
                "/interim" => {
                    conn.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n").await;
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    conn.write(&ok_with("final")).await;
                }
                "/trailers" => conn.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-sum\r\n\r\n5\r\nhello\r\n0\r\nx-sum: 42\r\nConnection: close\r\nContent-Length: 40\r\nTransfer-Encoding: chunked\r\nHost: elsewhere\r\n\r\n").await,
                other => conn.write(&ok_with(other)).await,
            }
        }
    })
    .await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let (status, body) = get(&router.url("/interim")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "final"));
    let out = raw(
        &router,
        b"GET /trailers HTTP/1.1\r\nHost: a\r\nTE: trailers\r\nConnection: close\r\n\r\n",
        Duration::from_secs(3),
    )
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out).to_ascii_lowercase();
    let tail = &text[text.find("hello").expect(&text)..];
    for forbidden in [
        "connection:",
        "content-length:",
        "transfer-encoding:",
        "host:",
    ] {
        assert!(
            !tail.contains(forbidden),
            "trailer {forbidden} relayed: {tail:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Retries.
// ---------------------------------------------------------------------------------------------

/// A backend that reads the request then closes without answering: `io`. POST is not retried
/// (502), GET is retried on the other backend.
#[tokio::test]
async fn io_failures_over_tls_are_retried_only_for_idempotent_methods() {
    let c = certs();
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&hits);
    let dead = tls_backend(&c, move |mut conn| {
        let counter = Arc::clone(&counter);
        async move {
            if conn.read_request().await.is_some() {
                counter.fetch_add(1, Ordering::SeqCst);
            }
        }
    })
    .await;
    let good = scripted(&c, vec![], false).await;
    let router = router_for(config_for(&c), &[dead.url(), good.url()]).await;
    // Round-robin: alternate so that each method meets the dead backend first at least once.
    let mut post_statuses = Vec::new();
    for _ in 0..2 {
        let (status, _) = post_json(&router.url("/p"), "{}").await;
        post_statuses.push(status);
        tokio::time::sleep(Duration::from_millis(80)).await;
    }
    assert!(
        post_statuses.contains(&StatusCode::BAD_GATEWAY),
        "{post_statuses:?}"
    );
    let before = hits.load(Ordering::SeqCst);
    for _ in 0..2 {
        let (status, body) = get(&router.url("/g")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "/g"));
        tokio::time::sleep(Duration::from_millis(80)).await;
    }
    // Each POST reached the dead backend at most once (no hidden retry by hyper).
    assert!(before <= 1, "dead backend saw {before} POSTs");
}

/// An untrusted certificate (a TLS failure) counts as a connect failure: a POST is retried on the
/// other backend.
#[tokio::test]
async fn a_tls_certificate_failure_is_a_connect_failure_retried_for_a_post() {
    let trusted = certs();
    let other = certs();
    let untrusted = scripted(&other, vec![], false).await;
    let good = scripted(&trusted, vec![], false).await;
    let router = router_for(config_for(&trusted), &[untrusted.url(), good.url()]).await;
    for i in 0..4 {
        let (status, body) = post_json(&router.url(&format!("/p{i}")), "{}").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        tokio::time::sleep(Duration::from_millis(80)).await;
    }
    let metrics = get(&router.url("/_custom_router/metrics")).await.1;
    let line = metrics
        .lines()
        .find(|l| {
            l.starts_with("custom_router_upstream_errors_total")
                && l.contains(&untrusted.addr.to_string())
        })
        .unwrap_or("")
        .to_owned();
    assert!(line.contains("kind=\"connect\""), "{line}");
}

// ---------------------------------------------------------------------------------------------
// Certificates and SNI.
// ---------------------------------------------------------------------------------------------

/// A trusted certificate whose names do not include the address's host is refused.
#[tokio::test]
async fn a_certificate_for_another_name_is_refused() {
    let c = tls_certs(&["example.test"]);
    let backend = scripted(&c, vec![], false).await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let (status, body) = get(&router.url("/v1/models")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    // A cert for 127.0.0.1 only, reached as localhost: refused too.
    let c = tls_certs(&["127.0.0.1"]);
    let backend = scripted(&c, vec![], false).await;
    let router = router_for(
        config_for(&c),
        &[format!("https://localhost:{}", backend.addr.port())],
    )
    .await;
    let (status, body) = get(&router.url("/v1/models")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
}

/// A self-signed certificate with no CA file configured is refused.
#[tokio::test]
async fn a_self_signed_certificate_is_refused_without_a_ca_file() {
    let c = certs();
    let backend = scripted(&c, vec![], false).await;
    let mut config = round_robin();
    config.latency.threshold = Duration::from_millis(50);
    let router = router_for(config, &[backend.url()]).await;
    let (status, body) = get(&router.url("/v1/models")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert!(body.contains("connect"), "{body}");
    assert_eq!(backend.connections(), 0);
}

/// A DNS-named backend gets SNI with its name; an IP one gets none (RFC 6066 §3).
#[tokio::test]
async fn sni_carries_the_backend_host_name() {
    let c = certs();
    let backend = scripted(&c, vec![], false).await;
    let router = router_for(
        config_for(&c),
        &[format!("https://localhost:{}", backend.addr.port())],
    )
    .await;
    let (status, body) = get(&router.url("/v1/models")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "/v1/models"));
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let (status, _) = get(&router.url("/v1/models")).await;
    assert_eq!(status, StatusCode::OK);
    let sni = backend.sni.lock().unwrap().clone();
    assert_eq!(sni, vec![Some("localhost".to_owned()), None]);
}

// ---------------------------------------------------------------------------------------------
// Headers.
// ---------------------------------------------------------------------------------------------

/// Hop-by-hop fields removed both ways, `Host` kept, X-Forwarded-For appended, -Proto set.
#[tokio::test]
async fn forwarding_headers_over_tls() {
    let c = certs();
    let seen: Arc<Mutex<Vec<Req>>> = Arc::default();
    let record = Arc::clone(&seen);
    let backend = tls_backend(&c, move |mut conn| {
        let record = Arc::clone(&record);
        async move {
            while let Some(req) = conn.read_request().await {
                record.lock().unwrap().push(req.clone());
                let body = req.target().to_owned();
                conn.write(
                    format!(
                        "HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nUpgrade: h2c\r\nTrailer: x-t\r\nX-End: kept\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    )
                    .as_bytes(),
                )
                .await;
            }
        }
    })
    .await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    // HTTP/1.1 client, fields kept as lines.
    let out = raw(
        &router,
        b"GET /a HTTP/1.1\r\nHost: front.example\r\nX-Forwarded-For: 203.0.113.9\r\nX-Forwarded-Proto: https\r\nTE: trailers\r\nKeep-Alive: timeout=1\r\nProxy-Authorization: Basic eA==\r\nProxy-Connection: keep-alive\r\nUpgrade: websocket\r\nX-End: 1\r\nConnection: close\r\n\r\n",
        Duration::from_secs(3),
    )
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out).to_ascii_lowercase();
    for hop in [
        "x-hop",
        "keep-alive:",
        "proxy-connection",
        "upgrade",
        "trailer:",
    ] {
        assert!(!text.contains(hop), "response kept {hop}: {text}");
    }
    assert!(text.contains("x-end: kept"), "{text}");
    // Connection names another field: the map path.
    let _ = raw(
        &router,
        b"GET /b HTTP/1.1\r\nHost: front.example\r\nX-Secret: 1\r\nConnection: X-Secret, close\r\n\r\n",
        Duration::from_secs(3),
    )
    .await
    .unwrap();
    // HTTP/1.0 without Host.
    let _ = raw(&router, b"GET /c HTTP/1.0\r\n\r\n", Duration::from_secs(3))
        .await
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    let a = &seen[0];
    assert_eq!(
        a.header("host").as_deref(),
        Some("front.example"),
        "{}",
        a.head
    );
    assert_eq!(
        a.header("x-forwarded-for").as_deref(),
        Some("203.0.113.9, 127.0.0.1"),
        "{}",
        a.head
    );
    assert_eq!(
        a.header("x-forwarded-proto").as_deref(),
        Some("http"),
        "{}",
        a.head
    );
    for hop in [
        "te",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "upgrade",
        "connection",
    ] {
        assert!(a.header(hop).is_none(), "request kept {hop}: {}", a.head);
    }
    assert_eq!(a.header("x-end").as_deref(), Some("1"));
    let b = &seen[1];
    assert!(b.header("x-secret").is_none(), "{}", b.head);
    assert!(b.header("connection").is_none(), "{}", b.head);
    let c0 = &seen[2];
    assert_eq!(
        c0.header("host"),
        Some(backend.addr.to_string()),
        "{}",
        c0.head
    );
    assert!(c0.line().ends_with("HTTP/1.1"), "{}", c0.head);
}

/// A streamed upload (over `retry.body_limit`) of unknown length reaches the TLS backend whole.
#[tokio::test]
async fn a_streamed_chunked_upload_reaches_the_tls_backend_whole() {
    let c = certs();
    let got: Arc<Mutex<Option<Req>>> = Arc::default();
    let record = Arc::clone(&got);
    let backend = tls_backend(&c, move |mut conn| {
        let record = Arc::clone(&record);
        async move {
            let Some(req) = conn.read_head().await else {
                return;
            };
            // Decode chunked.
            let mut body = Vec::new();
            loop {
                let line_end = loop {
                    if let Some(i) = find(&conn.buf, b"\r\n") {
                        break i;
                    }
                    if !conn.fill().await {
                        return;
                    }
                };
                let size_text = String::from_utf8_lossy(&conn.buf[..line_end]).into_owned();
                let size =
                    usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
                conn.buf.drain(..line_end + 2);
                while conn.buf.len() < size + 2 {
                    if !conn.fill().await {
                        return;
                    }
                }
                body.extend(conn.buf.drain(..size));
                conn.buf.drain(..2);
                if size == 0 {
                    break;
                }
            }
            *record.lock().unwrap() = Some(Req {
                head: req.head,
                body,
            });
            conn.write(&ok_with("done")).await;
        }
    })
    .await;
    let mut config = config_for(&c);
    config.retry.body_limit = 16;
    let router = router_for(config, &[backend.url()]).await;
    let out = raw(
        &router,
        b"POST /u HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n10\r\n0123456789abcdef\r\n10\r\n0123456789abcdef\r\n3\r\nxyz\r\n0\r\n\r\n",
        Duration::from_secs(3),
    )
    .await
    .unwrap();
    assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 200"));
    let got = got.lock().unwrap().clone().unwrap();
    assert_eq!(got.body, b"0123456789abcdef0123456789abcdefxyz");
    assert!(
        got.header("transfer-encoding")
            .is_some_and(|v| v == "chunked"),
        "{}",
        got.head
    );
}

/// Idle TLS connections per backend are capped as the router's own pool caps them
/// (`MAX_IDLE_PER_BACKEND`): after a burst of more concurrent requests than that, the ones past
/// the cap are closed when their exchange ends, not kept open for the idle timeout.
#[tokio::test]
async fn idle_tls_connections_per_backend_are_capped() {
    const BURST: usize = custom_router::pool::MAX_IDLE_PER_BACKEND + 6;
    let c = certs();
    let open = Arc::new(AtomicUsize::new(0));
    let (release, released) = tokio::sync::watch::channel(false);
    let live = Arc::clone(&open);
    let backend = tls_backend(&c, move |mut conn| {
        let live = Arc::clone(&live);
        let mut released = released.clone();
        async move {
            live.fetch_add(1, Ordering::SeqCst);
            while let Some(req) = conn.read_request().await {
                let _ = released.wait_for(|go| *go).await;
                conn.write(&ok_with(req.target())).await;
            }
            live.fetch_sub(1, Ordering::SeqCst);
        }
    })
    .await;
    let router = router_for(config_for(&c), &[backend.url()]).await;
    let url = router.url("/burst");
    let burst: Vec<_> = (0..BURST)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { get(&url).await })
        })
        .collect();
    let all_open = eventually(Duration::from_secs(10), async || {
        open.load(Ordering::SeqCst) == BURST
    })
    .await;
    assert!(
        all_open,
        "{} of {BURST} connections opened",
        open.load(Ordering::SeqCst)
    );
    release.send(true).unwrap();
    for answer in burst {
        assert_eq!(answer.await.unwrap().0, StatusCode::OK);
    }
    let capped = eventually(Duration::from_secs(5), async || {
        open.load(Ordering::SeqCst) == custom_router::pool::MAX_IDLE_PER_BACKEND
    })
    .await;
    assert!(
        capped,
        "{} idle connections kept, cap {}",
        open.load(Ordering::SeqCst),
        custom_router::pool::MAX_IDLE_PER_BACKEND
    );
}
