//! Test helpers: fake backends, an in-process router, a child-process router and an HTTP client.
//!
//! Every server binds `127.0.0.1:0` first and is spawned after, so there is no port race and no
//! sleep. Traffic stays on loopback.
#![allow(dead_code)]

pub mod h2_frames;

use std::convert::Infallible;
use std::future::Future;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use custom_router::Router;
use custom_router::balancer::Balancer;
use custom_router::config::{Config, Settings};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Body type used by fake backends and the test client.
pub type TestBody = BoxBody<Bytes, Infallible>;

/// A body of `text`.
pub fn full(text: impl Into<Bytes>) -> TestBody {
    Full::new(text.into()).boxed()
}

/// A response with `status` and `text`.
pub fn respond(status: StatusCode, text: impl Into<Bytes>) -> Response<TestBody> {
    let mut response = Response::new(full(text));
    *response.status_mut() = status;
    response
}

/// A fake backend running in this process.
pub struct FakeBackend {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Requests it has received.
    pub hits: Arc<AtomicUsize>,
    task: JoinHandle<()>,
    connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl FakeBackend {
    /// `127.0.0.1:port`.
    pub fn host_port(&self) -> String {
        self.addr.to_string()
    }

    /// Requests received so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// Stops listening and drops every open connection, as a crashed process would.
    pub fn kill(&self) {
        self.task.abort();
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }
}

impl Drop for FakeBackend {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts a backend answering every request with `handler` (HTTP/1.1 and h2c).
pub async fn spawn_backend<F, Fut>(handler: F) -> FakeBackend
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<TestBody>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&hits);
    let connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
    let open = Arc::clone(&connections);
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let handler = handler.clone();
            let counter = Arc::clone(&counter);
            let connection = tokio::spawn(async move {
                let service = service_fn(move |request| {
                    counter.fetch_add(1, Ordering::SeqCst);
                    let response = handler(request);
                    async move { Ok::<_, Infallible>(response.await) }
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
            let mut open = open.lock().unwrap();
            open.retain(|handle| !handle.is_finished());
            open.push(connection.abort_handle());
        }
    });
    FakeBackend {
        addr,
        hits,
        task,
        connections,
    }
}

/// A backend that answers `200 name` to everything, with `x-backend: name`.
pub async fn named_backend(name: &'static str) -> FakeBackend {
    spawn_backend(move |_request| async move {
        let mut response = respond(StatusCode::OK, name);
        response
            .headers_mut()
            .insert("x-backend", http::HeaderValue::from_static(name));
        response
    })
    .await
}

/// A router running in this process.
pub struct TestRouter {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its balancer.
    pub balancer: Arc<Balancer>,
    shutdown: Option<oneshot::Sender<()>>,
    /// Finishes when the router has shut down.
    pub task: Option<JoinHandle<()>>,
}

impl TestRouter {
    /// `http://127.0.0.1:port{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Starts graceful shutdown and returns the task to await.
    pub fn begin_shutdown(&mut self) -> JoinHandle<()> {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        self.task.take().expect("router task")
    }
}

impl Drop for TestRouter {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Starts a router with `config` on `127.0.0.1:0`.
pub async fn start_router(config: Config) -> TestRouter {
    let settings = Settings::from_config(config).expect("valid test config");
    let router = Router::bind_to(settings, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = router.local_addr();
    let balancer = Arc::clone(router.balancer());
    let (shutdown, signal) = oneshot::channel::<()>();
    let task = tokio::spawn(router.serve(async move {
        let _ = signal.await;
    }));
    TestRouter {
        addr,
        balancer,
        shutdown: Some(shutdown),
        task: Some(task),
    }
}

/// A round-robin router config.
pub fn round_robin() -> Config {
    with_strategy("round-robin")
}

/// A default config with strategy `name`.
pub fn with_strategy(name: &str) -> Config {
    let mut config = Config::default();
    config.strategy.name = name.to_owned();
    config
}

/// A queued-least-latency router config.
pub fn qll() -> Config {
    with_strategy("queued-least-latency")
}

/// A queued-least-latency config where a backend not yet measured takes one request at a
/// time (`initial_limit = 1`): the second concurrent request queues in the router.
pub fn qll_held() -> Config {
    let mut config = qll();
    config
        .strategy
        .params
        .insert("initial_limit".into(), figment::value::Value::from(1));
    config
}

/// Three backends answering 200 after `delay`, and the four addresses with `odd_one` at
/// position `at`.
pub async fn three_healthy_and(
    odd_one: String,
    at: usize,
    delay: Duration,
) -> ([FakeBackend; 3], Vec<String>) {
    let healthy = [
        slow_backend(delay).await,
        slow_backend(delay).await,
        slow_backend(delay).await,
    ];
    let mut addrs: Vec<String> = healthy.iter().map(FakeBackend::host_port).collect();
    addrs.insert(at, odd_one);
    (healthy, addrs)
}

/// A backend that answers 200 after `delay`.
pub async fn slow_backend(delay: Duration) -> FakeBackend {
    spawn_backend(move |_request| async move {
        tokio::time::sleep(delay).await;
        respond(StatusCode::OK, "ok")
    })
    .await
}

/// An address on loopback where nothing listens.
pub fn refusing_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// Sends `total` GETs with `concurrency` clients; returns the statuses.
pub async fn run_load(router: &TestRouter, total: usize, concurrency: usize) -> Vec<StatusCode> {
    let next = Arc::new(AtomicUsize::new(0));
    let statuses = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (next, statuses, url) = (
            Arc::clone(&next),
            Arc::clone(&statuses),
            router.url("/generate"),
        );
        workers.push(tokio::spawn(async move {
            let client = client();
            while next.fetch_add(1, Ordering::SeqCst) < total {
                let request = Request::get(&url).body(full("")).unwrap();
                let status = client.request(request).await.unwrap().status();
                statuses.lock().unwrap().push(status);
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    Arc::try_unwrap(statuses).unwrap().into_inner().unwrap()
}

/// An HTTP/1.1 client.
pub fn client() -> Client<HttpConnector, TestBody> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// An HTTP/2 prior-knowledge (h2c) client.
pub fn h2c_client() -> Client<HttpConnector, TestBody> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new())
}

/// Sends `request` and returns status, headers and the whole body.
pub async fn send(request: Request<TestBody>) -> (StatusCode, http::HeaderMap, Bytes) {
    let response = client().request(request).await.expect("request sent");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body read").to_bytes();
    (parts.status, parts.headers, body)
}

/// GET `url`: status and body text.
pub async fn get(url: &str) -> (StatusCode, String) {
    let request = Request::get(url).body(full("")).unwrap();
    let (status, _, body) = send(request).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// GET `url` and parse JSON.
pub async fn get_json(url: &str) -> (StatusCode, Value) {
    let (status, body) = get(url).await;
    (
        status,
        serde_json::from_str(&body).unwrap_or(Value::String(body)),
    )
}

/// POST `body` to `url` and parse the JSON answer.
pub async fn post_json(url: &str, body: impl Into<Bytes>) -> (StatusCode, Value) {
    let request = Request::post(url)
        .header("content-type", "application/json")
        .body(full(body))
        .unwrap();
    let (status, _, body) = send(request).await;
    let text = String::from_utf8_lossy(&body).into_owned();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Sets the router's backends over HTTP; panics unless 200.
pub async fn set_backends(router_addr: SocketAddr, backends: &[String]) -> Value {
    let body = serde_json::json!({ "backends": backends }).to_string();
    let (status, answer) = post_json(
        &format!("http://{router_addr}/_custom_router/set-backends"),
        body,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    answer
}

/// The addresses the router's health document lists.
pub async fn listed_backends(router_addr: SocketAddr) -> Vec<String> {
    let (_, health) = get_json(&format!("http://{router_addr}/_custom_router/health")).await;
    health["backends"]
        .as_array()
        .expect("backends array")
        .iter()
        .map(|b| b["addr"].as_str().unwrap().to_owned())
        .collect()
}

/// A body fed from a channel: each `Bytes` sent becomes one data frame.
pub struct ChannelBody {
    receiver: mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.receiver
            .poll_recv(cx)
            .map(|chunk| chunk.map(|bytes| Ok(Frame::data(bytes))))
    }
}

/// A streaming body and the sender that feeds it.
pub fn channel_body() -> (mpsc::Sender<Bytes>, TestBody) {
    let (sender, receiver) = mpsc::channel(1);
    (sender, ChannelBody { receiver }.boxed())
}

/// `len` bytes of a deterministic pattern, produced in 64 KiB chunks without holding them all.
pub struct PatternBody {
    sent: usize,
    len: usize,
}

/// The byte at `offset` of the pattern.
pub fn pattern_byte(offset: usize) -> u8 {
    (offset.wrapping_mul(31) ^ (offset >> 11)) as u8
}

impl PatternBody {
    /// A pattern body of `len` bytes.
    pub fn new(len: usize) -> Self {
        Self { sent: 0, len }
    }
}

impl Body for PatternBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.sent >= self.len {
            return Poll::Ready(None);
        }
        let chunk_len = (self.len - self.sent).min(64 * 1024);
        let start = self.sent;
        let chunk: Vec<u8> = (start..start + chunk_len).map(pattern_byte).collect();
        self.sent += chunk_len;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(chunk)))))
    }

    fn is_end_stream(&self) -> bool {
        self.sent >= self.len
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact((self.len - self.sent) as u64)
    }
}

/// The router binary run as a child process, with its stderr log captured.
pub struct ChildRouter {
    /// The process.
    pub child: Child,
    /// Where it listens (loopback, the port it reported).
    pub addr: SocketAddr,
    /// Every log line so far.
    pub log: Arc<Mutex<Vec<String>>>,
    /// Every line written to stdout so far (the access log).
    pub out: Arc<Mutex<Vec<String>>>,
}

impl ChildRouter {
    /// Whether a log line so far contains `text`.
    pub fn logged(&self, text: &str) -> bool {
        self.log
            .lock()
            .unwrap()
            .iter()
            .any(|line| line.contains(text))
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// A field of `/proc/<pid>/status` in KiB (e.g. `VmRSS`, `VmHWM`).
    pub fn memory_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|line| line.strip_prefix(&format!("{field}:")))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("{field} not in /proc status"))
    }

    /// Waits for the process to exit (up to `limit`) and returns its exit code.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let start = std::time::Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for ChildRouter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The router binary, with a clean environment plus `env`.
pub fn router_command(env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_custom-router"));
    command.env_clear();
    for (key, value) in env {
        command.env(key, value);
    }
    command
}

/// Starts the router binary on a free port with JSON logs and waits for its listening line.
pub fn spawn_router_process(env: &[(&str, &str)]) -> ChildRouter {
    let mut all: Vec<(&str, &str)> = vec![
        ("CUSTOM_ROUTER_PORT", "0"),
        ("CUSTOM_ROUTER_LOG_FORMAT", "json"),
        ("RUST_LOG", "info"),
    ];
    all.extend_from_slice(env);
    let mut child = router_command(&all)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("router binary starts");
    let stderr = child.stderr.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let out = Arc::new(Mutex::new(Vec::new()));
    let out_lines = Arc::clone(&out);
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            out_lines.lock().unwrap().push(line);
        }
    });
    let log = Arc::new(Mutex::new(Vec::new()));
    let (port_sender, port_receiver) = std::sync::mpsc::channel();
    let lines = Arc::clone(&log);
    std::thread::spawn(move || {
        let mut port_sender = Some(port_sender);
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let port = serde_json::from_str::<Value>(&line).ok().and_then(|entry| {
                let listen = entry["listen"].as_str()?;
                listen.rsplit(':').next()?.parse::<u16>().ok()
            });
            // The line is in the log before the port is reported, so a test that got the port
            // finds the line.
            lines.lock().unwrap().push(line);
            if let Some(port) = port {
                if let Some(sender) = port_sender.take() {
                    let _ = sender.send(port);
                }
            }
        }
    });
    let port = port_receiver
        .recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("router did not report its port: {:?}", log.lock().unwrap()));
    ChildRouter {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        log,
        out,
    }
}

/// The value of the series `series` (labels exactly as written) in a metrics text.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

/// The value of a series in the router's metrics.
pub async fn metric(router: &TestRouter, series: &str) -> f64 {
    let (_, text) = get(&router.url("/_custom_router/metrics")).await;
    sample(&text, series).unwrap_or_else(|| panic!("{series} not in metrics"))
}

/// The router binary with round-robin over `backend`, its access log on stdout, and `extra`.
pub fn logged_router(backend: &str, extra: &[(&str, &str)]) -> ChildRouter {
    let mut env = vec![
        ("CUSTOM_ROUTER_BACKENDS", backend),
        ("CUSTOM_ROUTER_ACCESS_LOG", "true"),
        ("CUSTOM_ROUTER_STRATEGY", "round-robin"),
    ];
    env.extend_from_slice(extra);
    spawn_router_process(&env)
}

/// The router's access log once it holds `count` lines, each parsed: exactly `count` lines (one
/// per finished request; a little more time is given for a line too many to show).
pub async fn access_log_lines(router: &ChildRouter, count: usize) -> Vec<Value> {
    let lines = || router.out.lock().unwrap().clone();
    assert!(
        eventually(Duration::from_secs(10), async || lines().len() >= count).await,
        "{:?}",
        lines()
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let lines: Vec<Value> = lines()
        .iter()
        .map(|line| serde_json::from_str(line).expect("each line is JSON"))
        .collect();
    assert_eq!(lines.len(), count, "one line per request: {lines:#?}");
    lines
}

/// `POST /_custom_router/set-backends` with `body` (and `Authorization: Bearer token`): the
/// status and the answer as JSON (as text when it is not JSON).
pub async fn post_set_backends(
    addr: SocketAddr,
    body: &str,
    token: Option<&str>,
) -> (StatusCode, serde_json::Value) {
    let mut request = Request::post(format!("http://{addr}/_custom_router/set-backends"))
        .header("content-type", "application/json");
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let (status, _, body) = send(request.body(full(body.to_owned())).unwrap()).await;
    let text = String::from_utf8_lossy(&body).into_owned();
    (
        status,
        serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
    )
}

/// The metrics text of a fresh balancer with every family present: one backend with a latency
/// sample, one sample in each histogram.
pub fn rendered_metrics() -> String {
    let settings = Settings::from_config(Config::default()).unwrap();
    let balancer = settings.balancer().unwrap();
    let backends = balancer.set_backends(vec!["127.0.0.1:9".parse().unwrap()]);
    backends[0].record_latency(0.1, 0.3);
    let metrics = balancer.metrics();
    for histogram in [
        &metrics.request_duration,
        &metrics.time_to_first_byte,
        &metrics.queue_wait,
    ] {
        histogram.record(0.1, &[]);
    }
    metrics.render().unwrap()
}

/// Polls `condition` until it holds or `deadline` passes; returns whether it held.
pub async fn eventually(deadline: Duration, mut condition: impl AsyncFnMut() -> bool) -> bool {
    let until = tokio::time::Instant::now() + deadline;
    loop {
        if condition().await {
            return true;
        }
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A tiny deterministic generator (xorshift) so randomized tests are repeatable.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number below `bound`.
    pub fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }

    /// An index below `len`.
    pub fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }
}

/// Where `needle` first stands in `haystack` (`None` for an empty needle).
pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || haystack.len() < needle.len() {
        return None;
    }
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

/// Appends what the next read of `stream` brings to `buffer`; `None` at the end of the
/// connection.
pub async fn fill(stream: &mut tokio::net::TcpStream, buffer: &mut Vec<u8>) -> Option<()> {
    use tokio::io::AsyncReadExt;
    let mut chunk = [0u8; 16 * 1024];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => None,
        Ok(read) => {
            buffer.extend_from_slice(&chunk[..read]);
            Some(())
        }
    }
}

/// A fresh self-signed certificate for `names`: a TLS acceptor serving it, and a PEM file of it
/// to name in `upstream.tls_ca_file`.
pub struct TestCerts {
    pub acceptor: tokio_rustls::TlsAcceptor,
    pub ca_file: std::path::PathBuf,
}

static CA_FILES: AtomicUsize = AtomicUsize::new(0);

/// This test process's scratch directory for `label` (created), under Cargo's per-target temp
/// dir: files the tests hand to a router (configs, CA certificates) stay out of the system's.
pub fn scratch_dir(label: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("custom-router-{label}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn tls_certs(names: &[&str]) -> TestCerts {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    let certified =
        rcgen::generate_simple_self_signed(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
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
    let ca_file =
        scratch_dir("test-ca").join(format!("{}.pem", CA_FILES.fetch_add(1, Ordering::SeqCst)));
    std::fs::write(&ca_file, certified.cert.pem()).unwrap();
    TestCerts {
        acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        ca_file,
    }
}
