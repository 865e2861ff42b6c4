//! The raw-byte harness of the conformance corpus and the fuzz: a scripted backend on a raw TCP
//! listener, a raw client that writes scripted bytes to the router and parses what comes back,
//! and the driver that runs one vector (its clients, its checks on what the backend received,
//! then the canaries on fresh connections) and reports failures with the vector's id.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use custom_router::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};

use crate::common::{TestRouter, find, get_json, round_robin, set_backends, start_router};

/// The longest any single read or wait of a vector may take.
pub const LIMIT: Duration = Duration::from_secs(3);

/// Paths starting with this are canaries: the backend always answers them with their own path.
pub const CANARY: &str = "/canary-";

// ---------------------------------------------------------------------------------------------
// The scripted backend.
// ---------------------------------------------------------------------------------------------

/// What the backend does once a reply's pieces are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// Reads the next request on the same connection.
    KeepOpen,
    /// Closes the connection.
    Close,
    /// Writes nothing more and reads nothing more as requests; the connection stays open until
    /// the router closes it.
    Hold,
}

/// The backend's answer to one request.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Bytes to write, each after a pause of this many milliseconds.
    pub pieces: Vec<(u64, Vec<u8>)>,
    /// Whether the request body is read (by its framing) before answering; when not, the body's
    /// bytes are read as the next request.
    pub read_body: bool,
    pub after: After,
}

impl Reply {
    /// `bytes` in one write, the body read first, the connection kept open.
    pub fn raw(bytes: impl AsRef<[u8]>) -> Self {
        Self {
            pieces: vec![(0, bytes.as_ref().to_vec())],
            read_body: true,
            after: After::KeepOpen,
        }
    }

    /// Each piece after its pause in milliseconds.
    pub fn pieces(pieces: &[(u64, &[u8])]) -> Self {
        Self {
            pieces: pieces.iter().map(|(ms, b)| (*ms, b.to_vec())).collect(),
            read_body: true,
            after: After::KeepOpen,
        }
    }

    /// Each piece after its pause in milliseconds (owned bytes).
    pub fn owned(pieces: Vec<(u64, Vec<u8>)>) -> Self {
        Self {
            pieces,
            read_body: true,
            after: After::KeepOpen,
        }
    }

    /// `200 OK` with a content-length and `body`.
    pub fn ok(body: impl AsRef<[u8]>) -> Self {
        Self::raw(response_with_length(200, body.as_ref()))
    }

    /// Nothing written: the connection holds.
    pub fn silent() -> Self {
        Self {
            pieces: Vec::new(),
            read_body: true,
            after: After::Hold,
        }
    }

    pub fn close(mut self) -> Self {
        self.after = After::Close;
        self
    }

    pub fn hold(mut self) -> Self {
        self.after = After::Hold;
        self
    }

    /// Answers without reading the request body.
    pub fn ignoring_body(mut self) -> Self {
        self.read_body = false;
        self
    }
}

/// `HTTP/1.1 {status}` with a content-length and `body`.
pub fn response_with_length(status: u16, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} X\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// Which requests a route answers.
#[derive(Debug, Clone)]
pub struct Route {
    pub method: Option<String>,
    pub path: Option<String>,
    pub reply: Reply,
}

/// How the backend answers the vector's requests; canaries are always answered with their path.
#[derive(Debug, Clone, Default)]
pub struct Script {
    pub routes: Vec<Route>,
    /// For requests no route takes; `None`: `200` with the request path as the body.
    pub default: Option<Reply>,
}

impl Script {
    /// Every request answered with `reply`.
    pub fn always(reply: Reply) -> Self {
        Self {
            routes: Vec::new(),
            default: Some(reply),
        }
    }

    /// Requests for `path` (any method) answered with `reply`.
    pub fn path(mut self, path: &str, reply: Reply) -> Self {
        self.routes.push(Route {
            method: None,
            path: Some(path.to_owned()),
            reply,
        });
        self
    }

    /// Requests with `method` (any path) answered with `reply`.
    pub fn method(mut self, method: &str, reply: Reply) -> Self {
        self.routes.push(Route {
            method: Some(method.to_owned()),
            path: None,
            reply,
        });
        self
    }

    fn reply_for(&self, request: &Received) -> Reply {
        if request.target().starts_with(CANARY) {
            return Reply::ok(request.target());
        }
        let route = self.routes.iter().find(|route| {
            route
                .method
                .as_deref()
                .is_none_or(|m| m == request.method())
                && route.path.as_deref().is_none_or(|p| p == request.target())
        });
        match route {
            Some(route) => route.reply.clone(),
            None => match &self.default {
                Some(reply) => reply.clone(),
                None if request.method() == "HEAD" => Reply::raw(format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
                    request.target().len()
                )),
                None => Reply::ok(request.target()),
            },
        }
    }
}

/// A request as the backend read it.
#[derive(Debug, Clone, Default)]
pub struct Received {
    /// The request line, without its line end.
    pub line: String,
    /// Fields in order, names lowercased (as sent, not trimmed), values trimmed.
    pub headers: Vec<(String, String)>,
    /// The body, decoded.
    pub body: Vec<u8>,
    /// Whether the body was read to its end (or was not read by choice).
    pub complete: bool,
    /// Trailer field names of a chunked body, lowercased.
    pub trailers: Vec<String>,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(field, _)| field == name)
            .map(|(_, value)| value.as_str())
    }

    pub fn method(&self) -> &str {
        self.line.split(' ').next().unwrap_or("")
    }

    pub fn target(&self) -> &str {
        self.line.split(' ').nth(1).unwrap_or("")
    }

    pub fn is_canary(&self) -> bool {
        self.target().starts_with(CANARY)
    }
}

/// One backend connection as the backend saw it.
#[derive(Debug, Clone, Default)]
pub struct ConnLog {
    pub requests: Vec<Received>,
    /// When the router's side of the connection ended (read returned 0 or failed).
    pub eof: Option<Instant>,
    /// Bytes the backend could not parse as a request.
    pub garbage: Option<Vec<u8>>,
}

impl ConnLog {
    /// Whether a request other than a canary came over this connection.
    pub fn carried_vector_traffic(&self) -> bool {
        self.requests.iter().any(|r| !r.is_canary())
    }
}

/// A scripted backend on `127.0.0.1:0`.
pub struct Backend {
    pub addr: String,
    pub log: Arc<Mutex<Vec<ConnLog>>>,
}

impl Backend {
    /// Starts it; each connection is served by `script`.
    pub async fn start(script: Script) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let log: Arc<Mutex<Vec<ConnLog>>> = Arc::default();
        let shared = Arc::clone(&log);
        let script = Arc::new(script);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let index = {
                    let mut log = shared.lock().unwrap();
                    log.push(ConnLog::default());
                    log.len() - 1
                };
                tokio::spawn(serve_backend_connection(
                    stream,
                    Arc::clone(&script),
                    Arc::clone(&shared),
                    index,
                ));
            }
        });
        Self { addr, log }
    }

    pub fn snapshot(&self) -> Vec<ConnLog> {
        self.log.lock().unwrap().clone()
    }

    /// The requests other than canaries, in connection order.
    pub fn vector_requests(&self) -> Vec<Received> {
        self.snapshot()
            .into_iter()
            .flat_map(|conn| conn.requests)
            .filter(|r| !r.is_canary())
            .collect()
    }
}

/// Bytes a backend connection's reader task passes on, ending at the connection's end.
struct Incoming {
    chunks: mpsc::UnboundedReceiver<Vec<u8>>,
    buffer: Vec<u8>,
}

impl Incoming {
    /// Appends the next chunk; `None` at the end of the connection.
    async fn fill(&mut self) -> Option<()> {
        let chunk = self.chunks.recv().await?;
        self.buffer.extend_from_slice(&chunk);
        Some(())
    }
}

async fn serve_backend_connection(
    stream: TcpStream,
    script: Arc<Script>,
    log: Arc<Mutex<Vec<ConnLog>>>,
    index: usize,
) {
    let (mut reader, mut writer) = stream.into_split();
    let (sink, chunks) = mpsc::unbounded_channel();
    let ended = Arc::new(AtomicBool::new(false));
    // A reader of its own notices the router closing the connection even while a reply waits.
    let reader_log = Arc::clone(&log);
    let reader_ended = Arc::clone(&ended);
    tokio::spawn(async move {
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            match reader.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(read) => {
                    if sink.send(chunk[..read].to_vec()).is_err() {
                        // The serving side stopped reading; keep watching for the end.
                    }
                }
            }
        }
        reader_ended.store(true, Ordering::SeqCst);
        reader_log.lock().unwrap()[index].eof = Some(Instant::now());
    });
    let mut input = Incoming {
        chunks,
        buffer: Vec::new(),
    };
    loop {
        let head = match read_backend_head(&mut input).await {
            HeadRead::Ended => return,
            HeadRead::Garbage(bytes) => {
                log.lock().unwrap()[index].garbage = Some(bytes);
                return;
            }
            HeadRead::Head(head) => head,
        };
        let reply = script.reply_for(&head);
        let position = {
            let mut log = log.lock().unwrap();
            let requests = &mut log[index].requests;
            requests.push(head.clone());
            requests.len() - 1
        };
        if reply.read_body {
            let mut trailers = Vec::new();
            let body = read_backend_body(&mut input, &head, &mut trailers).await;
            let mut log = log.lock().unwrap();
            let request = &mut log[index].requests[position];
            request.trailers = trailers;
            match body {
                Ok(body) => {
                    request.body = body;
                    request.complete = true;
                }
                Err(partial) => {
                    request.body = partial;
                    return;
                }
            }
        } else {
            log.lock().unwrap()[index].requests[position].complete = true;
        }
        for (pause, piece) in &reply.pieces {
            if *pause > 0 {
                tokio::time::sleep(Duration::from_millis(*pause)).await;
            }
            if ended.load(Ordering::SeqCst) || writer.write_all(piece).await.is_err() {
                break;
            }
        }
        match reply.after {
            After::KeepOpen => {}
            After::Close => {
                let _ = writer.shutdown().await;
                return;
            }
            After::Hold => {
                while input.fill().await.is_some() {}
                return;
            }
        }
    }
}

enum HeadRead {
    Head(Received),
    Ended,
    Garbage(Vec<u8>),
}

async fn read_backend_head(input: &mut Incoming) -> HeadRead {
    let end = loop {
        if let Some(end) = find(&input.buffer, b"\r\n\r\n") {
            break end;
        }
        if input.buffer.len() > 256 * 1024 {
            return HeadRead::Garbage(std::mem::take(&mut input.buffer));
        }
        if input.fill().await.is_none() {
            if input.buffer.is_empty() {
                return HeadRead::Ended;
            }
            return HeadRead::Garbage(std::mem::take(&mut input.buffer));
        }
    };
    let raw: Vec<u8> = input.buffer.drain(..end + 4).collect();
    let Ok(text) = String::from_utf8(raw.clone()) else {
        return HeadRead::Garbage(raw);
    };
    let mut lines = text[..end].split("\r\n");
    let line = lines.next().unwrap_or_default().to_owned();
    if line.split(' ').count() != 3 || !line.ends_with("HTTP/1.1") && !line.ends_with("HTTP/1.0") {
        return HeadRead::Garbage(raw);
    }
    let mut headers = Vec::new();
    for field in lines {
        let Some((name, value)) = field.split_once(':') else {
            return HeadRead::Garbage(raw);
        };
        headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
    }
    HeadRead::Head(Received {
        line,
        headers,
        body: Vec::new(),
        complete: false,
        trailers: Vec::new(),
    })
}

/// The request body by its framing (the trailer field names of a chunked one into `trailers`);
/// `Err` with what was read when the connection ended first or the framing is not understood.
async fn read_backend_body(
    input: &mut Incoming,
    head: &Received,
    trailers: &mut Vec<String>,
) -> Result<Vec<u8>, Vec<u8>> {
    let chunked = head
        .header("transfer-encoding")
        .is_some_and(|coding| coding.eq_ignore_ascii_case("chunked"));
    if chunked {
        return read_backend_chunked(input, trailers).await;
    }
    if head.header("transfer-encoding").is_some() {
        return Err(Vec::new());
    }
    let Some(length) = head.header("content-length") else {
        return Ok(Vec::new());
    };
    let Ok(length) = length.parse::<usize>() else {
        return Err(Vec::new());
    };
    while input.buffer.len() < length {
        if input.fill().await.is_none() {
            return Err(std::mem::take(&mut input.buffer));
        }
    }
    Ok(input.buffer.drain(..length).collect())
}

async fn read_backend_chunked(
    input: &mut Incoming,
    trailers: &mut Vec<String>,
) -> Result<Vec<u8>, Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let Some(line) = read_crlf_line(input).await else {
            return Err(body);
        };
        let size_text = line.split(|&b| b == b';').next().unwrap_or_default();
        let size = std::str::from_utf8(size_text)
            .ok()
            .and_then(|text| usize::from_str_radix(text, 16).ok());
        let Some(size) = size else {
            return Err(body);
        };
        if size == 0 {
            loop {
                match read_crlf_line(input).await {
                    None => return Err(body),
                    Some(line) if line.is_empty() => return Ok(body),
                    Some(line) => {
                        let text = String::from_utf8_lossy(&line);
                        let name = text.split(':').next().unwrap_or_default();
                        trailers.push(name.trim().to_ascii_lowercase());
                    }
                }
            }
        }
        while input.buffer.len() < size + 2 {
            if input.fill().await.is_none() {
                body.extend_from_slice(&input.buffer[..input.buffer.len().min(size)]);
                return Err(body);
            }
        }
        if &input.buffer[size..size + 2] != b"\r\n" {
            return Err(body);
        }
        body.extend_from_slice(&input.buffer[..size]);
        input.buffer.drain(..size + 2);
    }
}

async fn read_crlf_line(input: &mut Incoming) -> Option<Vec<u8>> {
    loop {
        if let Some(end) = find(&input.buffer, b"\r\n") {
            let line: Vec<u8> = input.buffer.drain(..end + 2).collect();
            return Some(line[..end].to_vec());
        }
        input.fill().await?;
    }
}

// ---------------------------------------------------------------------------------------------
// The raw client.
// ---------------------------------------------------------------------------------------------

/// A response as the raw client parsed it.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Whether the body ended by its framing (a close-delimited body: by the connection's end).
    pub complete: bool,
    pub chunked: bool,
    pub trailers: Vec<(String, String)>,
}

impl Parsed {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(field, _)| field == name)
            .map(|(_, value)| value.as_str())
    }
}

/// A client connection to the router, with everything it ever received.
pub struct Client {
    stream: TcpStream,
    buffer: Vec<u8>,
    /// Every byte received on this connection.
    pub seen: Vec<u8>,
    pub limit: Duration,
    /// Whether the router ended the connection (a read returned 0 or failed).
    pub ended: bool,
}

impl Client {
    pub async fn connect(addr: std::net::SocketAddr) -> Result<Self, String> {
        let stream = tokio::time::timeout(LIMIT, TcpStream::connect(addr))
            .await
            .map_err(|_| "connect timed out".to_owned())?
            .map_err(|e| format!("connect: {e}"))?;
        stream.set_nodelay(true).ok();
        Ok(Self {
            stream,
            buffer: Vec::new(),
            seen: Vec::new(),
            limit: LIMIT,
            ended: false,
        })
    }

    pub async fn send(&mut self, bytes: &[u8]) -> Result<(), String> {
        tokio::time::timeout(LIMIT, self.stream.write_all(bytes))
            .await
            .map_err(|_| "write timed out".to_owned())?
            .map_err(|e| format!("write failed: {e}"))
    }

    /// Reads more; `Ok(false)` at the end of the connection.
    async fn fill(&mut self, deadline: tokio::time::Instant) -> Result<bool, String> {
        if self.ended {
            return Ok(false);
        }
        let mut chunk = vec![0u8; 64 * 1024];
        match tokio::time::timeout_at(deadline, self.stream.read(&mut chunk)).await {
            Err(_) => Err(format!(
                "no more bytes within {:?}; buffered: {:?}",
                self.limit,
                lossy(&self.buffer)
            )),
            Ok(Ok(0)) | Ok(Err(_)) => {
                self.ended = true;
                Ok(false)
            }
            Ok(Ok(read)) => {
                self.buffer.extend_from_slice(&chunk[..read]);
                self.seen.extend_from_slice(&chunk[..read]);
                Ok(true)
            }
        }
    }

    fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.limit
    }

    /// Reads until the bytes received contain `needle`.
    pub async fn read_until(&mut self, needle: &[u8]) -> Result<(), String> {
        let deadline = self.deadline();
        while find(&self.buffer, needle).is_none() {
            if !self.fill(deadline).await? {
                return Err(format!(
                    "closed before {:?} arrived; got {:?}",
                    lossy(needle),
                    lossy(&self.buffer)
                ));
            }
        }
        self.buffer.clear();
        Ok(())
    }

    /// Expects the end of the connection with nothing more received.
    pub async fn expect_closed(&mut self) -> Result<(), String> {
        let deadline = self.deadline();
        while self.fill(deadline).await? {}
        if !self.buffer.is_empty() {
            return Err(format!(
                "bytes before the connection closed: {:?}",
                lossy(&self.buffer)
            ));
        }
        Ok(())
    }

    /// Reads one response (an interim one too) to a request that was `HEAD` if `head`.
    pub async fn read_response(&mut self, head: bool) -> Result<Parsed, String> {
        let deadline = self.deadline();
        let end = loop {
            if let Some(end) = find(&self.buffer, b"\r\n\r\n") {
                break end;
            }
            if !self.fill(deadline).await? {
                return Err(format!(
                    "connection closed before a response head; got {:?}",
                    lossy(&self.buffer)
                ));
            }
        };
        let raw: Vec<u8> = self.buffer.drain(..end + 4).collect();
        let text = String::from_utf8_lossy(&raw[..end]).into_owned();
        let mut lines = text.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let mut parts = status_line.splitn(3, ' ');
        let version = parts.next().unwrap_or_default();
        if version != "HTTP/1.1" && version != "HTTP/1.0" {
            return Err(format!("not a status line: {status_line:?}"));
        }
        let status: u16 = parts
            .next()
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| format!("not a status line: {status_line:?}"))?;
        let mut headers = Vec::new();
        for field in lines {
            let (name, value) = field
                .split_once(':')
                .ok_or_else(|| format!("not a field line: {field:?}"))?;
            headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
        }
        let mut parsed = Parsed {
            status,
            headers,
            body: Vec::new(),
            complete: true,
            chunked: false,
            trailers: Vec::new(),
        };
        if (100..200).contains(&status) || head || status == 204 || status == 304 {
            return Ok(parsed);
        }
        let chunked = parsed
            .header("transfer-encoding")
            .is_some_and(|te| te.eq_ignore_ascii_case("chunked"));
        if chunked {
            parsed.chunked = true;
            self.read_chunked(&mut parsed, deadline).await?;
        } else if let Some(length) = parsed.header("content-length") {
            let length: usize = length
                .parse()
                .map_err(|_| format!("bad content-length {length:?}"))?;
            while self.buffer.len() < length {
                if !self.fill(deadline).await? {
                    parsed.body = std::mem::take(&mut self.buffer);
                    parsed.complete = false;
                    return Ok(parsed);
                }
            }
            parsed.body = self.buffer.drain(..length).collect();
        } else {
            while self.fill(deadline).await? {}
            parsed.body = std::mem::take(&mut self.buffer);
        }
        Ok(parsed)
    }

    async fn read_chunked(
        &mut self,
        parsed: &mut Parsed,
        deadline: tokio::time::Instant,
    ) -> Result<(), String> {
        loop {
            let Some(line) = self.line(deadline).await? else {
                parsed.complete = false;
                return Ok(());
            };
            let size_text = String::from_utf8_lossy(&line);
            let size_text = size_text.split(';').next().unwrap_or_default();
            let size = usize::from_str_radix(size_text, 16)
                .map_err(|_| format!("bad chunk size line {:?}", lossy(&line)))?;
            if size == 0 {
                loop {
                    let Some(line) = self.line(deadline).await? else {
                        parsed.complete = false;
                        return Ok(());
                    };
                    if line.is_empty() {
                        return Ok(());
                    }
                    let text = String::from_utf8_lossy(&line).into_owned();
                    let (name, value) = text.split_once(':').unwrap_or((&text, ""));
                    parsed
                        .trailers
                        .push((name.to_ascii_lowercase(), value.trim().to_owned()));
                }
            }
            while self.buffer.len() < size + 2 {
                if !self.fill(deadline).await? {
                    let available = self.buffer.len().min(size);
                    parsed.body.extend_from_slice(&self.buffer[..available]);
                    self.buffer.clear();
                    parsed.complete = false;
                    return Ok(());
                }
            }
            if &self.buffer[size..size + 2] != b"\r\n" {
                return Err("chunk data longer than its size".to_owned());
            }
            parsed.body.extend_from_slice(&self.buffer[..size]);
            self.buffer.drain(..size + 2);
        }
    }

    /// One CRLF line; `None` if the connection ended first.
    async fn line(&mut self, deadline: tokio::time::Instant) -> Result<Option<Vec<u8>>, String> {
        loop {
            if let Some(end) = find(&self.buffer, b"\r\n") {
                let line: Vec<u8> = self.buffer.drain(..end + 2).collect();
                return Ok(Some(line[..end].to_vec()));
            }
            if !self.fill(deadline).await? {
                return Ok(None);
            }
        }
    }
}

pub fn lossy(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(400)]).into_owned();
    if bytes.len() > 400 {
        format!("{text}… ({} bytes)", bytes.len())
    } else {
        text
    }
}

// ---------------------------------------------------------------------------------------------
// Vectors.
// ---------------------------------------------------------------------------------------------

/// What a response's body must be.
#[derive(Debug, Clone)]
pub enum BodyCheck {
    Any,
    /// Exactly these bytes, ended by the framing.
    Exact(Vec<u8>),
    /// Cut short by the end of the connection: what arrived is a prefix of these bytes.
    Truncated(Vec<u8>),
}

/// What a response must be.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    /// The request was `HEAD`.
    pub head: bool,
    /// `Some(value)`: the field is there with this value (compared ignoring ASCII case);
    /// `None`: the field is absent.
    pub headers: Vec<(String, Option<String>)>,
    pub body: BodyCheck,
    /// Trailer fields that must be there, with their values.
    pub trailers: Vec<(String, String)>,
    /// Trailer fields that must not be there.
    pub no_trailers: Vec<String>,
}

/// A response with `status`, any body.
pub fn resp(status: u16) -> Resp {
    Resp {
        status,
        head: false,
        headers: Vec::new(),
        body: BodyCheck::Any,
        trailers: Vec::new(),
        no_trailers: Vec::new(),
    }
}

impl Resp {
    pub fn body(mut self, body: impl AsRef<[u8]>) -> Self {
        self.body = BodyCheck::Exact(body.as_ref().to_vec());
        self
    }

    pub fn truncated(mut self, full: impl AsRef<[u8]>) -> Self {
        self.body = BodyCheck::Truncated(full.as_ref().to_vec());
        self
    }

    pub fn for_head(mut self) -> Self {
        self.head = true;
        self
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers
            .push((name.to_ascii_lowercase(), Some(value.to_owned())));
        self
    }

    pub fn no_header(mut self, name: &str) -> Self {
        self.headers.push((name.to_ascii_lowercase(), None));
        self
    }

    pub fn trailer(mut self, name: &str, value: &str) -> Self {
        self.trailers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn no_trailer(mut self, name: &str) -> Self {
        self.no_trailers.push(name.to_ascii_lowercase());
        self
    }

    fn check(&self, got: &Parsed) -> Result<(), String> {
        let summary = || {
            format!(
                "got {} {:?} body {:?} (complete: {})",
                got.status,
                got.headers,
                lossy(&got.body),
                got.complete
            )
        };
        if got.status != self.status {
            return Err(format!("expected status {}; {}", self.status, summary()));
        }
        for (name, value) in &self.headers {
            match (value, got.header(name)) {
                (None, None) => {}
                (Some(want), Some(have)) if want.eq_ignore_ascii_case(have) => {}
                _ => return Err(format!("expected {name}: {value:?}; {}", summary())),
            }
        }
        match &self.body {
            BodyCheck::Any => {}
            BodyCheck::Exact(want) => {
                if &got.body != want || !got.complete {
                    return Err(format!("expected body {:?}; {}", lossy(want), summary()));
                }
            }
            BodyCheck::Truncated(full) => {
                if got.complete || !full.starts_with(&got.body) {
                    return Err(format!(
                        "expected a body cut short (a prefix of {:?}); {}",
                        lossy(full),
                        summary()
                    ));
                }
            }
        }
        for (name, value) in &self.trailers {
            if !got
                .trailers
                .iter()
                .any(|(n, v)| n.eq_ignore_ascii_case(name) && v == value)
            {
                return Err(format!(
                    "expected trailer {name}: {value}; got trailers {:?}; {}",
                    got.trailers,
                    summary()
                ));
            }
        }
        for name in &self.no_trailers {
            if got.trailers.iter().any(|(n, _)| n == name) {
                return Err(format!(
                    "expected no trailer {name}; got trailers {:?}; {}",
                    got.trailers,
                    summary()
                ));
            }
        }
        Ok(())
    }
}

/// One step of a client connection.
#[derive(Debug, Clone)]
pub enum Step {
    /// Writes these bytes.
    Send(Vec<u8>),
    /// Pauses this many milliseconds (between scripted writes).
    Wait(u64),
    /// Reads one response and checks it.
    Expect(Resp),
    /// Reads one response: either a refusal with one of these statuses (and then the backend
    /// must have received nothing), or `Resp` (and then the backend must have received exactly
    /// the vector's requests).
    RefusedOr(Vec<u16>, Resp),
    /// Expects the connection to end with nothing more received.
    Closed,
    /// Expects the connection to end, with nothing or only a response with this status first.
    ClosedOr(u16),
    /// Reads until the bytes received contain this.
    ReadUntil(Vec<u8>),
    /// Closes the connection.
    CloseNow,
    /// Waits until the backend received this many request heads other than canaries.
    AwaitBackend(usize),
    /// Sends a canary on this connection and checks its answer.
    Canary,
    /// Sets how long the following reads may take, in milliseconds.
    Limit(u64),
}

pub fn send(bytes: impl AsRef<[u8]>) -> Step {
    Step::Send(bytes.as_ref().to_vec())
}

pub fn expect(resp: Resp) -> Step {
    Step::Expect(resp)
}

/// What the backend must have received (canaries aside).
#[derive(Debug, Clone)]
pub enum BackendCheck {
    Any,
    Nothing,
    Requests(Vec<Req>),
}

/// A request the backend must have received.
#[derive(Debug, Clone)]
pub struct Req {
    pub line: String,
    pub has: Vec<(String, String)>,
    pub lacks: Vec<String>,
    pub body: Option<Vec<u8>>,
    /// `Some`: exactly these trailer field names (lowercased), in order.
    pub trailers: Option<Vec<String>>,
}

pub fn req(line: &str) -> Req {
    Req {
        line: line.to_owned(),
        has: Vec::new(),
        lacks: Vec::new(),
        body: None,
        trailers: None,
    }
}

impl Req {
    pub fn has(mut self, name: &str, value: &str) -> Self {
        self.has.push((name.to_ascii_lowercase(), value.to_owned()));
        self
    }

    pub fn lacks(mut self, names: &[&str]) -> Self {
        self.lacks
            .extend(names.iter().map(|name| name.to_ascii_lowercase()));
        self
    }

    pub fn body(mut self, body: impl AsRef<[u8]>) -> Self {
        self.body = Some(body.as_ref().to_vec());
        self
    }

    /// The backend gets exactly these trailer fields.
    pub fn trailers(mut self, names: &[&str]) -> Self {
        self.trailers = Some(names.iter().map(|name| name.to_ascii_lowercase()).collect());
        self
    }

    fn check(&self, got: &Received) -> Result<(), String> {
        let summary = || {
            format!(
                "backend got {:?} {:?} body {:?} (complete: {})",
                got.line,
                got.headers,
                lossy(&got.body),
                got.complete
            )
        };
        if got.line != self.line {
            return Err(format!(
                "expected request line {:?}; {}",
                self.line,
                summary()
            ));
        }
        for (name, value) in &self.has {
            if got.header(name) != Some(value.as_str()) {
                return Err(format!("expected {name}: {value}; {}", summary()));
            }
        }
        for name in &self.lacks {
            if got.header(name).is_some() {
                return Err(format!("expected no {name}; {}", summary()));
            }
        }
        if let Some(body) = &self.body {
            if &got.body != body || !got.complete {
                return Err(format!("expected body {:?}; {}", lossy(body), summary()));
            }
        }
        if let Some(trailers) = &self.trailers {
            if &got.trailers != trailers {
                return Err(format!(
                    "expected trailers {trailers:?}; got {:?}; {}",
                    got.trailers,
                    summary()
                ));
            }
        }
        Ok(())
    }
}

/// One conformance vector.
#[derive(Debug, Clone)]
pub struct Vector {
    pub id: String,
    pub config: Config,
    pub script: Script,
    /// Client connections, one after the other.
    pub clients: Vec<Vec<Step>>,
    pub backend: BackendCheck,
    /// Bytes no client of the vector (canaries included) may ever receive.
    pub forbidden: Vec<Vec<u8>>,
    /// Every backend connection that carried a vector request ends within this many
    /// milliseconds after the clients' steps.
    pub backend_closed_within: Option<u64>,
}

/// A vector with one client connection running `steps`, a round-robin router with one attempt
/// per request, and a backend that answers each request with its path.
pub fn vector(id: &str, steps: Vec<Step>) -> Vector {
    let mut config = round_robin();
    config.retry.max_attempts = 1;
    // A failed attempt keeps its backend counted in flight until this much time has passed since
    // dispatch; short, so the in-flight check after each vector sees failures released.
    config.latency.threshold = Duration::from_millis(50);
    Vector {
        id: id.to_owned(),
        config,
        script: Script::default(),
        clients: vec![steps],
        backend: BackendCheck::Any,
        forbidden: Vec::new(),
        backend_closed_within: None,
    }
}

impl Vector {
    pub fn script(mut self, script: Script) -> Self {
        self.script = script;
        self
    }

    pub fn reply(mut self, reply: Reply) -> Self {
        self.script = Script::always(reply);
        self
    }

    pub fn then_client(mut self, steps: Vec<Step>) -> Self {
        self.clients.push(steps);
        self
    }

    pub fn nothing(mut self) -> Self {
        self.backend = BackendCheck::Nothing;
        self
    }

    pub fn requests(mut self, requests: Vec<Req>) -> Self {
        self.backend = BackendCheck::Requests(requests);
        self
    }

    pub fn forbid(mut self, marker: &str) -> Self {
        self.forbidden.push(marker.as_bytes().to_vec());
        self
    }

    pub fn backend_closed_within(mut self, ms: u64) -> Self {
        self.backend_closed_within = Some(ms);
        self
    }

    pub fn config(mut self, change: impl FnOnce(&mut Config)) -> Self {
        change(&mut self.config);
        self
    }
}

/// A request for `path` with a Host field.
pub fn canary_request(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: canary\r\n\r\n").into_bytes()
}

async fn canary_exchange(client: &mut Client, path: &str) -> Result<(), String> {
    client.send(&canary_request(path)).await?;
    let got = client.read_response(false).await?;
    resp(200)
        .body(path)
        .check(&got)
        .map_err(|e| format!("canary {path}: {e}"))
}

/// Runs `vector`; `Err` names the vector and what went wrong.
pub async fn run_vector(vector: Vector) -> Result<(), String> {
    let id = vector.id.clone();
    run(vector).await.map_err(|error| format!("[{id}] {error}"))
}

async fn run(vector: Vector) -> Result<(), String> {
    let config = vector.config.clone();
    let backend = Backend::start(vector.script.clone()).await;
    let router = start_router(config).await;
    set_backends(router.addr, std::slice::from_ref(&backend.addr)).await;
    let mut seen: Vec<Vec<u8>> = Vec::new();
    let mut refused: Option<bool> = None;
    for (number, steps) in vector.clients.iter().enumerate() {
        let mut client = Client::connect(router.addr).await?;
        let outcome = run_steps(&vector, &backend, &mut client, steps, &mut refused).await;
        seen.push(std::mem::take(&mut client.seen));
        outcome.map_err(|(step, error)| format!("client {number}, step {step}: {error}"))?;
    }
    if let Some(ms) = vector.backend_closed_within {
        await_backend_closed(&backend, Duration::from_millis(ms)).await?;
    }
    check_backend(&vector, &backend, refused)?;
    let canaries = run_canaries(&vector.id, router.addr, &mut seen).await;
    check_forbidden(&vector, &seen)?;
    canaries?;
    check_garbage(&backend)?;
    await_idle(&router).await
}

async fn run_steps(
    vector: &Vector,
    backend: &Backend,
    client: &mut Client,
    steps: &[Step],
    refused: &mut Option<bool>,
) -> Result<(), (usize, String)> {
    let mut canaries = 0;
    for (index, step) in steps.iter().enumerate() {
        let fail = |error: String| (index, error);
        match step {
            Step::Send(bytes) => {
                client.send(bytes).await.map_err(fail)?;
            }
            Step::Wait(ms) => tokio::time::sleep(Duration::from_millis(*ms)).await,
            Step::Expect(want) => {
                let got = client.read_response(want.head).await.map_err(fail)?;
                want.check(&got).map_err(fail)?;
            }
            Step::RefusedOr(statuses, want) => {
                let got = client.read_response(want.head).await.map_err(fail)?;
                if statuses.contains(&got.status) {
                    *refused = Some(true);
                } else {
                    want.check(&got).map_err(|e| {
                        fail(format!(
                            "neither a refusal {statuses:?} nor the answer: {e}"
                        ))
                    })?;
                    *refused = Some(false);
                }
            }
            Step::Closed => client.expect_closed().await.map_err(fail)?,
            Step::ClosedOr(status) => {
                let deadline = tokio::time::Instant::now() + client.limit;
                while client.fill(deadline).await.map_err(fail)? {}
                if !client.buffer.is_empty() {
                    let text = lossy(&client.buffer);
                    let prefix = format!("HTTP/1.1 {status} ");
                    if !text.starts_with(&prefix) {
                        return Err(fail(format!(
                            "expected the end of the connection (or a {status}); got {text:?}"
                        )));
                    }
                }
            }
            Step::ReadUntil(needle) => client.read_until(needle).await.map_err(fail)?,
            Step::CloseNow => {
                let _ = client.stream.shutdown().await;
                client.ended = true;
            }
            Step::AwaitBackend(count) => {
                let deadline = Instant::now() + LIMIT;
                while backend.vector_requests().len() < *count {
                    if Instant::now() > deadline {
                        return Err(fail(format!(
                            "the backend did not receive {count} request(s); it has {:?}",
                            backend.snapshot()
                        )));
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            Step::Canary => {
                canaries += 1;
                let path = format!("{CANARY}{}-same-{canaries}", vector.id);
                canary_exchange(client, &path).await.map_err(fail)?;
            }
            Step::Limit(ms) => client.limit = Duration::from_millis(*ms),
        }
    }
    Ok(())
}

/// Three canaries on new connections, then two on one kept-alive connection.
pub async fn run_canaries(
    id: &str,
    addr: std::net::SocketAddr,
    seen: &mut Vec<Vec<u8>>,
) -> Result<(), String> {
    let mut result = Ok(());
    for round in 1..=3 {
        let path = format!("{CANARY}{id}-new-{round}");
        let mut client = Client::connect(addr).await?;
        let outcome = canary_exchange(&mut client, &path).await;
        seen.push(std::mem::take(&mut client.seen));
        if let Err(error) = outcome {
            result = result.and(Err(error));
        }
    }
    let mut client = Client::connect(addr).await?;
    for round in 1..=2 {
        let path = format!("{CANARY}{id}-kept-{round}");
        let outcome = canary_exchange(&mut client, &path).await;
        if let Err(error) = outcome {
            result = result.and(Err(error));
            break;
        }
    }
    seen.push(std::mem::take(&mut client.seen));
    result
}

fn check_forbidden(vector: &Vector, seen: &[Vec<u8>]) -> Result<(), String> {
    for marker in &vector.forbidden {
        for (number, bytes) in seen.iter().enumerate() {
            if find(bytes, marker).is_some() {
                return Err(format!(
                    "client connection {number} received {:?}: {:?}",
                    lossy(marker),
                    lossy(bytes)
                ));
            }
        }
    }
    Ok(())
}

fn check_backend(vector: &Vector, backend: &Backend, refused: Option<bool>) -> Result<(), String> {
    let got = backend.vector_requests();
    let expected = match (&vector.backend, refused) {
        (BackendCheck::Any, _) => return Ok(()),
        (_, Some(true)) | (BackendCheck::Nothing, _) => {
            if got.is_empty() {
                return Ok(());
            }
            return Err(format!(
                "the backend should have received nothing; it got {got:?}"
            ));
        }
        (BackendCheck::Requests(expected), _) => expected,
    };
    if got.len() != expected.len() {
        return Err(format!(
            "the backend should have received {} request(s); it got {got:?}",
            expected.len()
        ));
    }
    for (want, have) in expected.iter().zip(&got) {
        want.check(have)?;
    }
    Ok(())
}

pub fn check_garbage(backend: &Backend) -> Result<(), String> {
    for conn in backend.snapshot() {
        if let Some(garbage) = conn.garbage {
            return Err(format!(
                "the backend received bytes that are not a request: {:?} (after {:?})",
                lossy(&garbage),
                conn.requests
            ));
        }
    }
    Ok(())
}

async fn await_backend_closed(backend: &Backend, within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    loop {
        let open: Vec<ConnLog> = backend
            .snapshot()
            .into_iter()
            .filter(|conn| conn.carried_vector_traffic() && conn.eof.is_none())
            .collect();
        if open.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "backend connection(s) still open {within:?} after the client's steps: {open:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the router counts no request in flight at its backend.
pub async fn await_idle(router: &TestRouter) -> Result<(), String> {
    let url = format!("http://{}/_custom_router/health", router.addr);
    let deadline = Instant::now() + Duration::from_millis(1500);
    loop {
        let (_, health) = tokio::time::timeout(LIMIT, get_json(&url))
            .await
            .map_err(|_| "the health document did not arrive".to_owned())?;
        let in_flight: Vec<u64> = health["backends"]
            .as_array()
            .map(|backends| {
                backends
                    .iter()
                    .map(|b| b["in_flight"].as_u64().unwrap_or(u64::MAX))
                    .collect()
            })
            .unwrap_or_default();
        if in_flight.iter().all(|&n| n == 0) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("in_flight stays at {in_flight:?}"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs `vectors` a few at a time and fails with every failing vector's id and reason.
pub async fn run_group(group: &str, vectors: Vec<Vector>) {
    let started = Instant::now();
    let count = vectors.len();
    let mut ids = std::collections::HashSet::new();
    for vector in &vectors {
        assert!(ids.insert(vector.id.clone()), "duplicate id {}", vector.id);
    }
    let permits = Arc::new(Semaphore::new(6));
    let mut tasks = Vec::new();
    for vector in vectors {
        let permits = Arc::clone(&permits);
        let id = vector.id.clone();
        tasks.push((
            id,
            tokio::spawn(async move {
                let _permit = permits.acquire_owned().await.unwrap();
                tokio::time::timeout(Duration::from_secs(20), run_vector(vector))
                    .await
                    .unwrap_or_else(|_| Err("the vector did not finish in 20 s".to_owned()))
            }),
        ));
    }
    let mut failures = Vec::new();
    for (id, task) in tasks {
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => failures.push(error),
            Err(panic) => failures.push(format!("[{id}] panicked: {panic}")),
        }
    }
    eprintln!(
        "{group}: {count} vectors, {} failed, {:?}",
        failures.len(),
        started.elapsed()
    );
    assert!(
        failures.is_empty(),
        "{group}: {} of {count} vectors failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
