//! HTTP/2 requests forwarded as HTTP/1.1: malformed fields and pseudo-header fields, framing
//! that disagrees with `Content-Length`, trailers, resets mid-body and oversized header blocks,
//! sent as raw frames by an h2c client (hyper's and h2's clients refuse to send most of them).
//! Each vector checks what a raw backend received: one well-formed request with exactly the body
//! the client framed, or nothing. The fields the HTTP/1 server drops or refuses are dropped or
//! refused over HTTP/2 too, and the authority and cookies become one `Host` and one `Cookie`.
//!
//! Then the other direction: HTTP/1 answers as a hyper HTTP/2 client gets them (the h2 crate
//! fails a stream whose answer carries a connection-specific field, so a clean answer proves
//! none leaked), and resets that leave a backend connection in an unknown state.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::h2_frames::*;
use common::*;
use custom_router::config::Config;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// The longest any exchange in this file may take.
const LIMIT: Duration = Duration::from_secs(3);

// ---------------------------------------------------------------------------------------------
// The backend: records each request as the bytes it read, and what was left when a connection
// ended.

/// What the backend saw.
#[derive(Debug)]
enum Seen {
    /// A whole request on connection `connection`: its head as sent, and its body (decoded).
    Request {
        connection: usize,
        head: String,
        body: Vec<u8>,
        /// The chunked trailer block (empty for other framings).
        trailers: String,
    },
    /// Connection `connection` ended, with `left` bytes read that made no whole request.
    Closed { connection: usize, left: Vec<u8> },
}

/// What the backend writes for one request: pieces (each after its pause), then maybe a close.
struct Reply {
    writes: Vec<(Duration, Vec<u8>)>,
    close: bool,
}

impl Reply {
    fn now(bytes: &[u8]) -> Self {
        Self {
            writes: vec![(Duration::ZERO, bytes.to_vec())],
            close: false,
        }
    }
}

/// The default answer: 200 with the request's path as the body.
fn echo_path(head: &str) -> Reply {
    let path = head.split(' ').nth(1).unwrap_or("");
    Reply::now(
        format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{path}",
            path.len()
        )
        .as_bytes(),
    )
}

type ReplyFn = Arc<dyn Fn(&str) -> Reply + Send + Sync>;

struct Backend {
    addr: String,
    seen: mpsc::UnboundedReceiver<Seen>,
    accepted: Arc<AtomicUsize>,
}

impl Backend {
    /// A backend that answers each request with its path.
    async fn start() -> Self {
        Self::start_with(echo_path).await
    }

    /// A backend that answers each request as `reply` says from its head.
    async fn start_with(reply: impl Fn(&str) -> Reply + Send + Sync + 'static) -> Self {
        let reply: ReplyFn = Arc::new(reply);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (sink, seen) = mpsc::unbounded_channel();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let connection = counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(stream, connection, sink.clone(), Arc::clone(&reply)));
            }
        });
        Self {
            addr,
            seen,
            accepted,
        }
    }

    /// The next thing the backend saw.
    async fn next(&mut self) -> Seen {
        tokio::time::timeout(LIMIT, self.seen.recv())
            .await
            .expect("the backend sees something in time")
            .unwrap()
    }

    /// The next whole request (head, body and chunked trailer block); connection ends before
    /// it are passed over.
    async fn next_request(&mut self) -> (usize, String, Vec<u8>, String) {
        loop {
            if let Seen::Request {
                connection,
                head,
                body,
                trailers,
            } = self.next().await
            {
                return (connection, head, body, trailers);
            }
        }
    }

    /// Sends the marker request (a `GET /marker`) through `router` and returns what the backend
    /// saw before it.
    async fn before_marker(&mut self, router: &TestRouter) -> Vec<Seen> {
        marker(router).await;
        self.until_marker().await.0
    }

    /// What the backend saw before the marker request, and the connection that carried it.
    async fn until_marker(&mut self) -> (Vec<Seen>, usize) {
        let mut seen = Vec::new();
        loop {
            let next = self.next().await;
            if let Seen::Request {
                head, connection, ..
            } = &next
            {
                if head.starts_with("GET /marker ") {
                    return (seen, *connection);
                }
            }
            seen.push(next);
        }
    }
}

/// Answers each request of one connection as `reply` says.
async fn serve(
    mut stream: TcpStream,
    connection: usize,
    sink: mpsc::UnboundedSender<Seen>,
    reply: ReplyFn,
) {
    let mut buffer = Vec::new();
    while let Some((head, body, trailers)) = read_request(&mut stream, &mut buffer).await {
        let answer = reply(&head);
        let _ = sink.send(Seen::Request {
            connection,
            head,
            body,
            trailers,
        });
        for (pause, piece) in answer.writes {
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            if stream.write_all(&piece).await.is_err() {
                break;
            }
        }
        if answer.close {
            let _ = stream.shutdown().await;
            break;
        }
    }
    let _ = sink.send(Seen::Closed {
        connection,
        left: buffer,
    });
}

/// Reads one request; `None` when the connection ends first (what was read stays in `buffer`).
async fn read_request(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
) -> Option<(String, Vec<u8>, String)> {
    let mut scanned = 0;
    let end = loop {
        if let Some(end) = find(&buffer[scanned..], b"\r\n\r\n") {
            break scanned + end + 4;
        }
        scanned = buffer.len().saturating_sub(3);
        fill(stream, buffer).await?;
    };
    let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
    let field = |name: &str| {
        head.split("\r\n").skip(1).find_map(|line| {
            let (field, value) = line.split_once(':')?;
            field
                .eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
    };
    let mut at = end;
    let mut body = Vec::new();
    let mut trailers = String::new();
    if field("transfer-encoding").is_some() {
        loop {
            let line_end = loop {
                if let Some(line_end) = find(&buffer[at..], b"\r\n") {
                    break at + line_end;
                }
                fill(stream, buffer).await?;
            };
            let size = std::str::from_utf8(&buffer[at..line_end]).ok()?;
            let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
            at = line_end + 2;
            if size == 0 {
                // The trailer block, up to its empty line.
                loop {
                    if let Some(end) = find(&buffer[at - 2..], b"\r\n\r\n") {
                        trailers = String::from_utf8_lossy(&buffer[at..at + end]).into_owned();
                        at = at - 2 + end + 4;
                        break;
                    }
                    fill(stream, buffer).await?;
                }
                break;
            }
            while buffer.len() < at + size + 2 {
                fill(stream, buffer).await?;
            }
            body.extend_from_slice(&buffer[at..at + size]);
            at += size + 2;
        }
    } else if let Some(length) = field("content-length") {
        let length: usize = length.parse().ok()?;
        while buffer.len() < at + length {
            fill(stream, buffer).await?;
        }
        body.extend_from_slice(&buffer[at..at + length]);
        at += length;
    }
    buffer.drain(..at);
    Some((head, body, trailers))
}

/// The values of field `name` in a request head, in order.
fn values<'a>(head: &'a str, name: &str) -> Vec<&'a str> {
    head.split("\r\n")
        .skip(1)
        .filter_map(|line| line.split_once(':'))
        .filter(|(field, _)| field.eq_ignore_ascii_case(name))
        .map(|(_, value)| value.trim())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The raw h2c client.

/// A header block of literal fields without indexing, new names, no Huffman coding.
fn block(fields: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        out.push(0x00);
        integer(&mut out, 0, name.len());
        out.extend_from_slice(name);
        integer(&mut out, 0, value.len());
        out.extend_from_slice(value);
    }
    out
}

/// An HPACK integer with a 7-bit prefix, the first byte's high bit `high`.
fn integer(out: &mut Vec<u8>, high: u8, mut value: usize) {
    if value < 127 {
        out.push(high | value as u8);
        return;
    }
    out.push(high | 127);
    value -= 127;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

/// The pseudo-header fields of a request `method path` over h2c, then `rest`.
fn request<'a>(
    method: &'a [u8],
    path: &'a [u8],
    rest: &[(&'a [u8], &'a [u8])],
) -> Vec<(&'a [u8], &'a [u8])> {
    let mut fields: Vec<(&[u8], &[u8])> = vec![
        (b":method", method),
        (b":scheme", b"http"),
        (b":authority", b"router.test"),
        (b":path", path),
    ];
    fields.extend_from_slice(rest);
    fields
}

/// How a stream ended, as the client saw it.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// A response head with this status.
    Status(u16),
    /// RST_STREAM with this code.
    Reset(u32),
    /// GOAWAY with this code.
    GoAway(u32),
    /// The connection closed.
    Closed,
}

impl Outcome {
    /// Whether the router refused the request: a reset, a GOAWAY, a close or a 4xx.
    fn refused(&self) -> bool {
        match self {
            Outcome::Status(status) => (400..500).contains(status),
            _ => true,
        }
    }
}

struct H2 {
    stream: TcpStream,
    read: Vec<u8>,
}

impl H2 {
    async fn connect(router: &TestRouter) -> Self {
        let mut stream = TcpStream::connect(router.addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let mut start = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        start.extend_from_slice(&frame(SETTINGS, 0, 0, &[]));
        stream.write_all(&start).await.unwrap();
        Self {
            stream,
            read: Vec::new(),
        }
    }

    /// Writes a frame; `false` if the router no longer reads.
    async fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> bool {
        self.stream
            .write_all(&frame(kind, flags, stream, payload))
            .await
            .is_ok()
    }

    /// A request whose header block is `fields`, in one HEADERS frame, ending the stream.
    async fn headers(&mut self, stream: u32, fields: &[(&[u8], &[u8])], end_stream: bool) {
        let flags = END_HEADERS | if end_stream { END_STREAM } else { 0 };
        assert!(self.send(HEADERS, flags, stream, &block(fields)).await);
    }

    async fn reset(&mut self, stream: u32, code: u32) {
        assert!(self.send(RST_STREAM, 0, stream, &code.to_be_bytes()).await);
    }

    async fn data(&mut self, stream: u32, data: &[u8], end_stream: bool) {
        let flags = if end_stream { END_STREAM } else { 0 };
        assert!(self.send(DATA, flags, stream, data).await);
    }

    /// The next frame: kind, flags, stream and payload; `None` once the connection closed.
    async fn frame(&mut self) -> Option<(u8, u8, u32, Vec<u8>)> {
        loop {
            if let Some(frame) = take_frame(&mut self.read) {
                return Some(frame);
            }
            let mut chunk = [0u8; 16 * 1024];
            match self.stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(read) => self.read.extend_from_slice(&chunk[..read]),
            }
        }
    }

    /// How stream `id` ends (the first response head counts as its end).
    async fn outcome(&mut self, id: u32) -> Outcome {
        let waited = async {
            loop {
                let Some((kind, flags, stream, payload)) = self.frame().await else {
                    return Outcome::Closed;
                };
                match kind {
                    SETTINGS if flags & ACK == 0 => {
                        self.send(SETTINGS, ACK, 0, &[]).await;
                    }
                    PING if flags & ACK == 0 => {
                        self.send(PING, ACK, 0, &payload).await;
                    }
                    GOAWAY => {
                        return Outcome::GoAway(u32::from_be_bytes(
                            payload[4..8].try_into().unwrap(),
                        ));
                    }
                    RST_STREAM if stream == id => {
                        return Outcome::Reset(u32::from_be_bytes(
                            payload[..4].try_into().unwrap(),
                        ));
                    }
                    HEADERS if stream == id => return Outcome::Status(status(&payload)),
                    _ => {}
                }
            }
        };
        tokio::time::timeout(LIMIT, waited)
            .await
            .expect("the stream ends in time")
    }
}

// ---------------------------------------------------------------------------------------------
// The router.

async fn router_with(backend: &Backend, config: Config) -> TestRouter {
    let router = start_router(config).await;
    set_backends(router.addr, std::slice::from_ref(&backend.addr)).await;
    router
}

async fn router(backend: &Backend) -> TestRouter {
    router_with(backend, round_robin()).await
}

type Sender = hyper::client::conn::http2::SendRequest<TestBody>;

/// A hyper HTTP/2 client on a connection of its own.
async fn h2_client(router: &TestRouter) -> Sender {
    let stream = TcpStream::connect(router.addr).await.unwrap();
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    sender
}

/// Sends `request` on `sender`: status, headers and whole body (or the error text).
async fn exchange(
    sender: &mut Sender,
    request: Request<TestBody>,
) -> Result<(StatusCode, http::HeaderMap, Vec<u8>), String> {
    let sent = async {
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("{e:?}"))?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|e| format!("{e:?}"))?;
        Ok((parts.status, parts.headers, body.to_bytes().to_vec()))
    };
    tokio::time::timeout(LIMIT, sent)
        .await
        .expect("the exchange ends in time")
}

fn get(router: &TestRouter, path: &str) -> Request<TestBody> {
    Request::get(router.url(path))
        .version(http::Version::HTTP_2)
        .body(full(""))
        .unwrap()
}

/// A router that reads request bodies whole before forwarding them, or (`streaming`) one that
/// streams bodies of more than 8 bytes.
async fn body_router(backend: &Backend, streaming: bool) -> TestRouter {
    let mut config = round_robin();
    if streaming {
        config.retry.body_limit = 8;
    }
    router_with(backend, config).await
}

/// Asserts that the router refused stream 1 of `h2` and that no whole request reached the
/// backend (at most part of one, on a connection that was then closed).
async fn refused_before_any_whole_request(
    h2: &mut H2,
    router: &TestRouter,
    backend: &mut Backend,
    context: &str,
) {
    let outcome = h2.outcome(1).await;
    assert!(outcome.refused(), "{context}: {outcome:?}");
    let seen = backend.before_marker(router).await;
    assert!(nothing_whole(&seen), "{context}: {seen:?}");
}

/// Whether every connection the backend saw carried at most part of a request and was closed.
fn nothing_whole(seen: &[Seen]) -> bool {
    seen.iter().all(|seen| matches!(seen, Seen::Closed { .. }))
}

/// Sends the marker request on a new connection and waits for its answer.
async fn marker(router: &TestRouter) {
    let mut h2 = H2::connect(router).await;
    h2.headers(1, &request(b"GET", b"/marker", &[]), true).await;
    assert_eq!(h2.outcome(1).await, Outcome::Status(200));
}

/// `fields` as text, for failure messages.
fn shown(fields: &[(&[u8], &[u8])]) -> Vec<(String, String)> {
    fields
        .iter()
        .map(|(name, value)| {
            (
                String::from_utf8_lossy(name).into_owned(),
                String::from_utf8_lossy(value).into_owned(),
            )
        })
        .collect()
}

/// Sends a bodiless request of `fields` on a connection of its own and asserts that the router
/// refused it and that nothing reached the backend.
async fn refused(router: &TestRouter, backend: &mut Backend, fields: &[(&[u8], &[u8])]) {
    let mut h2 = H2::connect(router).await;
    h2.headers(1, fields, true).await;
    let outcome = h2.outcome(1).await;
    let shown = shown(fields);
    assert!(outcome.refused(), "{shown:?}: {outcome:?}");
    let seen = backend.before_marker(router).await;
    assert!(
        seen.iter()
            .all(|seen| matches!(seen, Seen::Closed { left, .. } if left.is_empty())),
        "{shown:?}: {seen:?}"
    );
}

/// Sends a bodiless request of `fields` and returns the head the backend got.
async fn forwarded(
    router: &TestRouter,
    backend: &mut Backend,
    fields: &[(&[u8], &[u8])],
) -> String {
    let mut h2 = H2::connect(router).await;
    h2.headers(1, fields, true).await;
    assert_eq!(h2.outcome(1).await, Outcome::Status(200), "{fields:?}");
    let (_, head, body, _) = backend.next_request().await;
    assert!(body.is_empty());
    head
}

// ---------------------------------------------------------------------------------------------
// The vectors.

#[tokio::test]
async fn a_plain_request_and_one_in_headers_and_continuation_arrive_whole() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    let mut h2 = H2::connect(&router).await;
    h2.headers(1, &request(b"POST", b"/a?b=1", &[(b"x-a", b"1")]), false)
        .await;
    h2.data(1, b"hello", true).await;
    assert_eq!(h2.outcome(1).await, Outcome::Status(200));
    let (_, head, body, _) = backend.next_request().await;
    assert!(head.starts_with("POST /a?b=1 HTTP/1.1\r\n"), "{head}");
    assert_eq!(values(&head, "host"), ["router.test"]);
    assert_eq!(values(&head, "x-a"), ["1"]);
    assert_eq!(values(&head, "content-length"), ["5"]);
    assert_eq!(body, b"hello");

    let fields = block(&request(
        b"GET",
        b"/continued",
        &[(b"x-first", b"1"), (b"x-second", b"2")],
    ));
    let (first, rest) = fields.split_at(fields.len() / 2);
    assert!(h2.send(HEADERS, END_STREAM, 3, first).await);
    let (middle, last) = rest.split_at(rest.len() / 2);
    assert!(h2.send(CONTINUATION, 0, 3, middle).await);
    assert!(h2.send(CONTINUATION, END_HEADERS, 3, last).await);
    assert_eq!(h2.outcome(3).await, Outcome::Status(200));
    let (_, head, _, _) = backend.next_request().await;
    assert!(head.starts_with("GET /continued HTTP/1.1\r\n"), "{head}");
    assert_eq!(values(&head, "x-first"), ["1"]);
    assert_eq!(values(&head, "x-second"), ["2"]);
}

#[tokio::test]
async fn field_values_with_cr_lf_or_nul_reach_no_backend() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    for value in [
        &b"a\r\nx-injected: 1"[..],
        b"a\nx-injected: 1",
        b"a\rb",
        b"a\0b",
        b"a\r\n\r\nGET /smuggled HTTP/1.1",
    ] {
        refused(
            &router,
            &mut backend,
            &request(b"GET", b"/", &[(b"x-a", value)]),
        )
        .await;
    }
}

#[tokio::test]
async fn field_names_with_spaces_colons_or_line_ends_reach_no_backend() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    for name in [
        &b"x a"[..],
        b"x:a",
        b"x-a:",
        b"x\r\nx-injected",
        b"x\na",
        b"x\0a",
        b"",
        b":bogus",
    ] {
        refused(
            &router,
            &mut backend,
            &request(b"GET", b"/", &[(name, b"1")]),
        )
        .await;
    }
}

#[tokio::test]
async fn an_uppercase_field_name_goes_out_as_one_well_formed_field() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    let mut h2 = H2::connect(&router).await;
    h2.headers(1, &request(b"GET", b"/", &[(b"X-Upper", b"1")]), true)
        .await;
    let outcome = h2.outcome(1).await;
    let seen = backend.before_marker(&router).await;
    // Refused (as RFC 9113 §8.2.1 asks), or forwarded with the name lowercased: never anything
    // else.
    if outcome == Outcome::Status(200) {
        let [Seen::Request { head, body, .. }] = &seen[..] else {
            panic!("{seen:?}");
        };
        assert!(head.starts_with("GET / HTTP/1.1\r\n"));
        assert_eq!(values(head, "x-upper"), ["1"]);
        assert!(body.is_empty());
    } else {
        assert!(outcome.refused(), "{outcome:?}");
        assert!(nothing_whole(&seen));
    }
}

#[tokio::test]
async fn a_path_with_a_space_a_line_end_or_no_leading_slash_reaches_no_backend() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    for path in [
        &b"/a HTTP/1.1\r\nHost: x\r\n\r\nGET /smuggled"[..],
        b"/a b",
        b"/a\r\nx-injected: 1",
        b"/a\nb",
        b"/a\0b",
        b"",
        b"a",
        b"http://elsewhere.test/a",
        b"?a=1",
        b"*",
    ] {
        refused(&router, &mut backend, &request(b"GET", path, &[])).await;
    }
}

#[tokio::test]
async fn an_asterisk_path_goes_out_only_with_options() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    let head = forwarded(&router, &mut backend, &request(b"OPTIONS", b"*", &[])).await;
    assert!(head.starts_with("OPTIONS * HTTP/1.1\r\n"), "{head}");
}

#[tokio::test]
async fn a_method_with_a_space_or_line_end_reaches_no_backend() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    for method in [
        &b"GET /smuggled HTTP/1.1\r\n\r\nGET"[..],
        b"GET /x",
        b"G\r\nET",
        b"GET\0",
        b"",
    ] {
        refused(&router, &mut backend, &request(method, b"/", &[])).await;
    }
    // A lowercase method is a token like any other: it goes out as it came (case matters).
    let head = forwarded(&router, &mut backend, &request(b"get", b"/lower", &[])).await;
    assert!(head.starts_with("get /lower HTTP/1.1\r\n"), "{head}");
}

#[tokio::test]
async fn connection_specific_fields_make_the_request_malformed() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    for (name, value) in [
        (&b"connection"[..], &b"close"[..]),
        (b"connection", b"x-secret"),
        (b"transfer-encoding", b"chunked"),
        (b"keep-alive", b"timeout=5"),
        (b"upgrade", b"websocket"),
        (b"proxy-connection", b"keep-alive"),
        (b"te", b"gzip"),
        (b"te", b"trailers, gzip"),
    ] {
        refused(
            &router,
            &mut backend,
            &request(b"GET", b"/", &[(name, value)]),
        )
        .await;
    }
    // `te: trailers` is allowed, and not forwarded (it is hop-by-hop).
    let head = forwarded(
        &router,
        &mut backend,
        &request(b"GET", b"/te", &[(b"te", b"trailers")]),
    )
    .await;
    assert!(values(&head, "te").is_empty(), "{head}");
}

#[tokio::test]
async fn a_content_length_that_disagrees_with_the_data_sends_no_whole_request() {
    let mut backend = Backend::start().await;
    for streaming in [false, true] {
        let router = body_router(&backend, streaming).await;
        for (length, data) in [
            (&b"20"[..], &b"0123456789"[..]),
            (b"5", b"0123456789"),
            (b"1", b""),
        ] {
            let mut h2 = H2::connect(&router).await;
            let fields = request(b"POST", b"/length", &[(b"content-length", length)]);
            h2.headers(1, &fields, data.is_empty()).await;
            if !data.is_empty() {
                h2.data(1, data, true).await;
            }
            let context = format!("{streaming} {length:?}");
            refused_before_any_whole_request(&mut h2, &router, &mut backend, &context).await;
        }
    }
}

#[tokio::test]
async fn two_content_lengths_or_two_hosts_reach_no_backend() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    for fields in [
        &[
            (&b"content-length"[..], &b"0"[..]),
            (b"content-length", b"0"),
        ][..],
        &[(b"content-length", b"0"), (b"content-length", b"1")],
        &[(b"host", b"a.test"), (b"host", b"b.test")],
        &[(b"host", b"a.test"), (b"host", b"a.test")],
    ] {
        refused(&router, &mut backend, &request(b"POST", b"/", fields)).await;
    }
}

/// The `:authority` is the `Host` the backend reads (RFC 9113 §8.3.1): a `host` field that says
/// the same goes out once, one that says otherwise is refused (a backend routing on `Host`
/// would read another host than the one the client's authority named), and so are an authority
/// with user information and a request with neither (the HTTP/1.1 request without `Host` the
/// HTTP/1 server refuses).
#[tokio::test]
async fn the_authority_is_the_host_and_a_host_field_may_not_contradict_it() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    let head = forwarded(
        &router,
        &mut backend,
        &request(b"GET", b"/host", &[(b"host", b"Router.Test")]),
    )
    .await;
    assert_eq!(values(&head, "host"), ["Router.Test"], "{head}");
    let head = forwarded(&router, &mut backend, &request(b"GET", b"/host", &[])).await;
    assert_eq!(values(&head, "host"), ["router.test"], "{head}");
    refused(
        &router,
        &mut backend,
        &request(b"GET", b"/host", &[(b"host", b"internal-admin.test")]),
    )
    .await;
    // Without `:authority`, the `Host`; without either, refused.
    let fields: [(&[u8], &[u8]); 4] = [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":path", b"/host"),
        (b"host", b"b.test"),
    ];
    let head = forwarded(&router, &mut backend, &fields).await;
    assert_eq!(values(&head, "host"), ["b.test"], "{head}");
    refused(&router, &mut backend, &fields[..3]).await;
    refused(
        &router,
        &mut backend,
        &[
            (b":method", b"GET"),
            (b":scheme", b"http"),
            (b":authority", b"evil.test@router.test"),
            (b":path", b"/host"),
        ],
    )
    .await;
}

/// Header names containing `_` are dropped from HTTP/2 requests and their trailers as from
/// HTTP/1 ones (nginx's `underscores_in_headers off`): a CGI/WSGI backend reads `x_api_key` as
/// `X-Api-Key`.
#[tokio::test]
async fn underscore_field_names_are_dropped_from_heads_and_trailers() {
    let mut backend = Backend::start().await;
    let router = body_router(&backend, true).await;
    let head = forwarded(
        &router,
        &mut backend,
        &request(
            b"GET",
            b"/h2",
            &[
                (b"x_api_key", b"forged"),
                (b"x-real-ip_", b"6.6.6.6"),
                (b"x-kept", b"1"),
            ],
        ),
    )
    .await;
    assert!(!head.contains('_'), "{head}");
    assert_eq!(values(&head, "x-kept"), ["1"], "{head}");
    // The same over HTTP/1, in a chunked body's trailers.
    let mut http1 = TcpStream::connect(router.addr).await.unwrap();
    http1
        .write_all(b"POST /h1 HTTP/1.1\r\nHost: router.test\r\nx_api_key: forged\r\nTransfer-Encoding: chunked\r\n\r\na\r\n0123456789\r\n0\r\nx_api_key: forged\r\nx-sum: 1\r\n\r\n")
        .await
        .unwrap();
    let (_, head, body, trailers) = backend.next_request().await;
    assert_eq!(body, b"0123456789", "{head}");
    assert!(
        !head.contains('_') && !trailers.contains('_'),
        "{head}{trailers}"
    );
    assert!(trailers.contains("x-sum: 1"), "{trailers:?}");
    // Over HTTP/2, in the trailers of a streamed body.
    let mut h2 = H2::connect(&router).await;
    h2.headers(1, &request(b"POST", b"/trailers", &[]), false)
        .await;
    h2.data(1, b"0123456789", false).await;
    let trailers = block(&[(b"x_api_key", b"forged"), (b"x-sum", b"1")]);
    assert!(
        h2.send(HEADERS, END_HEADERS | END_STREAM, 1, &trailers)
            .await
    );
    assert_eq!(h2.outcome(1).await, Outcome::Status(200));
    let (_, head, body, trailers) = backend.next_request().await;
    assert_eq!(body, b"0123456789", "{head}");
    assert!(!trailers.contains('_'), "{trailers:?}");
    assert!(trailers.contains("x-sum: 1"), "{trailers:?}");
}

/// RFC 9113 §8.2.3: cookies split into fields of their own (as browsers send them over HTTP/2)
/// are joined with "; " into one `Cookie` line before the request goes out as HTTP/1.1, as
/// nginx joins them; many HTTP/1 servers read only the first line.
#[tokio::test]
async fn split_cookie_fields_go_out_as_one_cookie_line() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    let head = forwarded(
        &router,
        &mut backend,
        &request(
            b"GET",
            b"/cookies",
            &[(b"cookie", b"session=abc"), (b"cookie", b"csrf=xyz")],
        ),
    )
    .await;
    assert_eq!(values(&head, "cookie"), ["session=abc; csrf=xyz"], "{head}");
}

/// The HTTP/1 server's limits on a head's fields hold over HTTP/2: more than 100 fields (431,
/// though the list is well inside `max_header_list_size`) and a `content-length` that is not
/// digits (h2 reads an empty one as 0) reach no backend.
#[tokio::test]
async fn too_many_fields_or_an_empty_content_length_reach_no_backend() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    let owned: Vec<(Vec<u8>, Vec<u8>)> = (0..150)
        .map(|index| (format!("x-{index}").into_bytes(), b"v".to_vec()))
        .collect();
    let many: Vec<(&[u8], &[u8])> = owned
        .iter()
        .map(|(name, value)| (&name[..], &value[..]))
        .collect();
    let mut h2 = H2::connect(&router).await;
    h2.headers(1, &request(b"GET", b"/many", &many), true).await;
    assert_eq!(h2.outcome(1).await, Outcome::Status(431));
    refused(
        &router,
        &mut backend,
        &request(b"POST", b"/empty", &[(b"content-length", b"")]),
    )
    .await;
    // At the limit, forwarded.
    let head = forwarded(
        &router,
        &mut backend,
        &request(b"GET", b"/many", &many[..100]),
    )
    .await;
    assert_eq!(values(&head, "x-99"), ["v"], "{head}");
}

#[tokio::test]
async fn connect_and_extended_connect_reach_no_backend() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    refused(
        &router,
        &mut backend,
        &[
            (b":method", b"CONNECT"),
            (b":authority", b"elsewhere.test:443"),
        ],
    )
    .await;
    refused(
        &router,
        &mut backend,
        &request(b"CONNECT", b"/chat", &[(b":protocol", b"websocket")]),
    )
    .await;
    // A `:protocol` on another method is malformed.
    refused(
        &router,
        &mut backend,
        &request(b"GET", b"/chat", &[(b":protocol", b"websocket")]),
    )
    .await;
}

#[tokio::test]
async fn trailers_keep_only_the_fields_a_trailer_may_carry() {
    let mut backend = Backend::start().await;
    // Read whole (the trailers are dropped) and streamed (sent in the chunked trailer block).
    for streaming in [false, true] {
        let router = body_router(&backend, streaming).await;
        let mut h2 = H2::connect(&router).await;
        h2.headers(1, &request(b"POST", b"/trailers", &[]), false)
            .await;
        h2.data(1, b"0123456789", false).await;
        let trailers = block(&[
            (b"x-checksum", b"1"),
            (b"content-length", b"1000"),
            (b"host", b"elsewhere.test"),
        ]);
        assert!(
            h2.send(HEADERS, END_HEADERS | END_STREAM, 1, &trailers)
                .await
        );
        assert_eq!(h2.outcome(1).await, Outcome::Status(200));
        let (head, body, trailers) = loop {
            if let Seen::Request {
                head,
                body,
                trailers,
                ..
            } = backend.next().await
            {
                break (head, body, trailers);
            }
        };
        assert_eq!(body, b"0123456789", "{head}");
        let expected = if streaming { "x-checksum: 1\r\n" } else { "" };
        assert_eq!(trailers, expected, "{head}");
        assert_eq!(values(&head, "host"), ["router.test"], "{head}");
        assert!(values(&head, "content-length").len() <= 1, "{head}");

        // A pseudo-header field in trailers: h2 leaves it out of the trailer map, so the
        // request goes out without it (or is refused), never with it as a field or target.
        let mut h2 = H2::connect(&router).await;
        h2.headers(1, &request(b"POST", b"/trailers", &[]), false)
            .await;
        h2.data(1, b"0123456789", false).await;
        let trailers = block(&[(b":path", b"/smuggled")]);
        assert!(
            h2.send(HEADERS, END_HEADERS | END_STREAM, 1, &trailers)
                .await
        );
        let outcome = h2.outcome(1).await;
        for seen in backend.before_marker(&router).await {
            if let Seen::Request { head, body, .. } = seen {
                assert_eq!(outcome, Outcome::Status(200));
                assert!(head.starts_with("POST /trailers HTTP/1.1\r\n"), "{head}");
                assert!(!head.contains("smuggled"), "{head}");
                assert_eq!(body, b"0123456789");
            }
        }

        // Connection-specific fields or pseudo-header fields in trailers: the request is
        // malformed, and no whole request reaches the backend.
        for trailer in [
            &[(&b"transfer-encoding"[..], &b"chunked"[..])][..],
            &[(b"connection", b"close")],
            &[(b"x-a", b"1\r\nx-injected: 1")],
        ] {
            let mut h2 = H2::connect(&router).await;
            h2.headers(1, &request(b"POST", b"/trailers", &[]), false)
                .await;
            h2.data(1, b"0123456789", false).await;
            assert!(
                h2.send(HEADERS, END_HEADERS | END_STREAM, 1, &block(trailer))
                    .await
            );
            let context = format!("{streaming} {trailer:?}");
            refused_before_any_whole_request(&mut h2, &router, &mut backend, &context).await;
        }
    }
}

#[tokio::test]
async fn a_stream_reset_mid_body_sends_no_whole_request_and_closes_the_backend_connection() {
    let mut backend = Backend::start().await;
    for streaming in [false, true] {
        let router = body_router(&backend, streaming).await;
        for code in [NO_ERROR, CANCEL] {
            for length in [None, Some(&b"20"[..])] {
                // A connection to the backend that a later request would reuse.
                marker(&router).await;
                backend.next_request().await;
                let mut h2 = H2::connect(&router).await;
                let fields = match length {
                    Some(length) => request(b"POST", b"/reset", &[(b"content-length", length)]),
                    None => request(b"POST", b"/reset", &[]),
                };
                h2.headers(1, &fields, false).await;
                h2.data(1, b"0123456789", false).await;
                // Let the router read the part sent before it is reset.
                tokio::time::sleep(Duration::from_millis(50)).await;
                h2.reset(1, code).await;
                // The next request on the same client connection.
                h2.headers(3, &request(b"GET", b"/marker", &[]), true).await;
                assert_eq!(h2.outcome(3).await, Outcome::Status(200));
                let (seen, marker) = backend.until_marker().await;
                let context = format!("{streaming} {code} {length:?}: {seen:?}");
                assert!(nothing_whole(&seen), "{context}");
                // A connection that carried part of the request was closed, not reused (the
                // marker's bytes would have been read as the rest of that request).
                for seen in &seen {
                    if let Seen::Closed { connection, left } = seen {
                        if !left.is_empty() {
                            assert_ne!(*connection, marker, "{context}");
                        }
                    }
                }
            }
        }
    }
}

#[tokio::test]
async fn a_huge_header_list_or_endless_continuation_ends_the_stream_or_connection() {
    let mut backend = Backend::start().await;
    let router = router(&backend).await;
    // Far more than `limits.max_header_bytes` (64 KiB) in one block, over many CONTINUATIONs.
    let value = vec![b'v'; 4000];
    let mut h2 = H2::connect(&router).await;
    let first = block(&request(b"GET", b"/huge", &[]));
    assert!(h2.send(HEADERS, END_STREAM, 1, &first).await);
    let mut ended = false;
    for index in 0..2000 {
        let name = format!("x-{index}");
        let fragment = block(&[(name.as_bytes(), &value)]);
        if !h2.send(CONTINUATION, 0, 1, &fragment).await {
            ended = true;
            break;
        }
    }
    if !ended {
        let outcome = h2.outcome(1).await;
        assert!(outcome.refused(), "{outcome:?}");
    }
    // Empty CONTINUATION frames, without end.
    let mut h2 = H2::connect(&router).await;
    assert!(h2.send(HEADERS, END_STREAM, 1, &first).await);
    let empty = frame(CONTINUATION, 0, 1, &[]);
    let mut endless = Vec::new();
    for _ in 0..10_000 {
        endless.extend_from_slice(&empty);
    }
    let mut ended = false;
    for _ in 0..100 {
        if h2.stream.write_all(&endless).await.is_err() {
            ended = true;
            break;
        }
    }
    if !ended {
        let outcome = h2.outcome(1).await;
        assert!(outcome.refused(), "{outcome:?}");
    }
    let seen = backend.before_marker(&router).await;
    assert!(nothing_whole(&seen), "{seen:?}");
    assert!(backend.accepted.load(Ordering::SeqCst) >= 1);
}

// ---------------------------------------------------------------------------------------------
// Answers relayed to HTTP/2 clients.

/// Every HTTP/1 connection-specific field, in the lines path and the map path (a `Connection`
/// that names another field), and an HTTP/1.0 keep-alive answer: the HTTP/2 client gets a
/// clean answer without any of them (h2 would fail the stream otherwise).
#[tokio::test]
async fn connection_specific_response_fields_never_reach_the_h2_client() {
    let backend = Backend::start_with(|head| {
        let bytes: &[u8] = match head.split(' ').nth(1).unwrap_or("") {
            "/lines" => b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nUpgrade: h2c\r\nTE: trailers\r\nTrailer: x-sum\r\nTransfer-Encoding: chunked\r\nX-End: 1\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            "/map" => b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Secret\r\nX-Secret: 1\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nUpgrade: h2c\r\nTE: trailers\r\nTransfer-Encoding: chunked\r\nX-End: 1\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            "/http10" => b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\nX-End: 1\r\n\r\nok",
            "/upper" => b"HTTP/1.1 200 OK\r\nCONNECTION: Keep-Alive\r\nTRANSFER-ENCODING: chunked\r\nX-End: 1\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            _ => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
        };
        Reply::now(bytes)
    })
    .await;
    let router = router(&backend).await;
    let mut sender = h2_client(&router).await;
    for path in ["/lines", "/map", "/http10", "/upper"] {
        let (status, headers, body) = exchange(&mut sender, get(&router, path))
            .await
            .unwrap_or_else(|error| panic!("{path}: {error}"));
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(body, b"ok", "{path}");
        assert_eq!(headers["x-end"], "1", "{path}");
        for name in [
            "connection",
            "keep-alive",
            "proxy-connection",
            "upgrade",
            "te",
            "trailer",
            "transfer-encoding",
            "x-secret",
        ] {
            assert!(!headers.contains_key(name), "{path}: {name}: {headers:?}");
        }
    }
}

/// Interim answers are passed over; a 101, or both a length and chunked, fail the attempt.
#[tokio::test]
async fn interim_101_and_double_framing_answers_over_h2() {
    let backend = Backend::start_with(|head| {
        let bytes: &[u8] = match head.split(' ').nth(1).unwrap_or("") {
            "/interim" => b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
            "/switch" => b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n",
            "/both" => b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            _ => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
        };
        Reply::now(bytes)
    })
    .await;
    let router = router(&backend).await;
    let mut sender = h2_client(&router).await;
    let (status, headers, body) = exchange(&mut sender, get(&router, "/interim"))
        .await
        .unwrap();
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok"[..]));
    assert!(!headers.contains_key("link"), "{headers:?}");
    for path in ["/switch", "/both"] {
        let (status, _, _) = exchange(&mut sender, get(&router, path)).await.unwrap();
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{path}");
    }
}

/// A HEAD answer that announces a length and (misbehaving) sends the bytes anyway: the h2
/// client gets the length and no body, and the next request does not read those bytes.
#[tokio::test]
async fn a_head_answer_keeps_its_length_and_its_stray_body_is_never_read_as_an_answer() {
    let mut backend = Backend::start_with(|head| {
        if head.starts_with("HEAD ") {
            Reply::now(b"HTTP/1.1 200 OK\r\ncontent-length: 38\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale")
        } else {
            echo_path(head)
        }
    })
    .await;
    let router = router(&backend).await;
    let mut sender = h2_client(&router).await;
    let request = Request::head(router.url("/head"))
        .version(http::Version::HTTP_2)
        .body(full(""))
        .unwrap();
    let (status, headers, body) = exchange(&mut sender, request).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-length"], "38");
    assert!(body.is_empty());
    backend.next_request().await;
    let (status, _, body) = exchange(&mut sender, get(&router, "/marker"))
        .await
        .unwrap();
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"/marker"[..]));
}

/// RFC 9110 §8.6: "A server MUST NOT send a Content-Length header field in any response with a
/// status code of ... 204". nginx clears it; nghttp2-based HTTP/2 clients (curl, Envoy) treat
/// a 204 with a non-zero `content-length` as a malformed response.
#[tokio::test]
async fn a_204_answer_goes_out_without_content_length() {
    let backend = Backend::start_with(|_| {
        Reply::now(b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n")
    })
    .await;
    let router = router(&backend).await;
    let mut sender = h2_client(&router).await;
    let (status, headers, body) = exchange(&mut sender, get(&router, "/204")).await.unwrap();
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(body.is_empty());
    assert!(!headers.contains_key("content-length"), "{headers:?}");
}

/// An answer shorter than its length (the backend closes early) reaches the client as a failed
/// stream, never as a clean shorter body.
#[tokio::test]
async fn a_short_answer_is_a_failed_stream_for_the_h2_client() {
    let backend = Backend::start_with(|_| Reply {
        writes: vec![(
            Duration::ZERO,
            b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n01234".to_vec(),
        )],
        close: true,
    })
    .await;
    let router = router(&backend).await;
    let mut sender = h2_client(&router).await;
    let result = exchange(&mut sender, get(&router, "/short")).await;
    assert!(result.is_err(), "{result:?}");
}

/// The client resets the stream mid-download: the backend connection, with the rest of the body
/// (and a stray answer) still to come, is closed and never pooled.
#[tokio::test]
async fn a_reset_mid_download_closes_the_backend_connection() {
    let mut backend = Backend::start_with(|head| {
        if head.starts_with("GET /download ") {
            Reply {
                writes: vec![
                    (
                        Duration::ZERO,
                        b"HTTP/1.1 200 OK\r\ncontent-length: 20\r\n\r\n0123456789".to_vec(),
                    ),
                    (
                        Duration::from_millis(300),
                        b"abcdefghijHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale".to_vec(),
                    ),
                ],
                close: false,
            }
        } else {
            echo_path(head)
        }
    })
    .await;
    let router = router(&backend).await;
    let mut sender = h2_client(&router).await;
    let response = tokio::time::timeout(LIMIT, sender.send_request(get(&router, "/download")))
        .await
        .unwrap()
        .unwrap();
    let mut body = response.into_body();
    let first = tokio::time::timeout(LIMIT, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), &b"0123456789"[..]);
    // Dropping the body resets the stream (CANCEL).
    drop(body);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, _, body) = exchange(&mut sender, get(&router, "/marker"))
        .await
        .unwrap();
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"/marker"[..]));
    let (seen, marker) = backend.until_marker().await;
    let download = seen
        .iter()
        .find_map(|seen| match seen {
            Seen::Request {
                connection, head, ..
            } if head.starts_with("GET /download ") => Some(*connection),
            _ => None,
        })
        .unwrap();
    assert_ne!(download, marker, "{seen:?}");
}

/// The client resets the stream after its whole request was sent, while the backend has not
/// answered yet: that connection has an answer in flight and must never be pooled.
#[tokio::test]
async fn a_reset_while_the_answer_is_awaited_closes_the_backend_connection() {
    let mut backend = Backend::start_with(|head| {
        if head.starts_with("POST /slow ") {
            Reply {
                writes: vec![(
                    Duration::from_millis(300),
                    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale".to_vec(),
                )],
                close: false,
            }
        } else {
            echo_path(head)
        }
    })
    .await;
    for streaming in [false, true] {
        let mut config = round_robin();
        if streaming {
            config.retry.body_limit = 4;
        }
        let router = router_with(&backend, config).await;
        let mut h2 = H2::connect(&router).await;
        h2.headers(1, &request(b"POST", b"/slow", &[]), false).await;
        h2.data(1, b"0123456789", true).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(h2.send(RST_STREAM, 0, 1, &0x8u32.to_be_bytes()).await);
        tokio::time::sleep(Duration::from_millis(400)).await;
        h2.headers(3, &request(b"GET", b"/marker", &[]), true).await;
        assert_eq!(h2.outcome(3).await, Outcome::Status(200));
        let (seen, marker) = backend.until_marker().await;
        for seen in &seen {
            if let Seen::Request {
                connection, head, ..
            } = seen
            {
                assert_ne!(*connection, marker, "{streaming}: {head}");
            }
        }
        // The marker's answer is its own.
        let mut sender = h2_client(&router).await;
        let (_, _, body) = exchange(&mut sender, get(&router, "/marker"))
            .await
            .unwrap();
        assert_eq!(body, b"/marker", "{streaming}");
        backend.next_request().await;
    }
}
