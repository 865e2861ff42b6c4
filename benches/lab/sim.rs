//! A simulated LLM inference replica (TGI / vLLM-like) for benchmarks, tests and the demo.
//!
//! # Timing model
//!
//! - `slots` requests decode at once (continuous batching); more wait in the replica's own FIFO
//!   queue for a slot.
//! - A request that holds a slot first pays a prefill (the time to first token) of
//!   `prefill_ms / speed`, then decodes `max_tokens` tokens. Each decode step takes
//!   `(step_ms + step_per_batch_ms × batch) / speed`, where `batch` is the number of requests
//!   holding a slot at that step, so a fuller batch decodes each token more slowly.
//! - `max_tokens` is read from the JSON request body (`max_tokens`, or TGI's
//!   `parameters.max_new_tokens`), else `default_max_tokens`.
//! - Steps are scheduled against deadlines (`previous deadline + step`), so the timer's
//!   millisecond resolution does not accumulate over a long answer.
//!
//! With every slot busy, one request of `t` tokens takes
//! `(prefill_ms + t × (step_ms + step_per_batch_ms × slots)) / speed` milliseconds, and the
//! replica finishes `slots` requests per such period: [`SimConfig::capacity`].
//!
//! # Answers
//!
//! `"stream": true` answers server-sent events, one `data: {...}` event per token and then
//! `data: [DONE]`; otherwise one JSON document when the last token is decoded. Every answer carries
//! `x-sim-replica: NAME`.
//!
//! # Faults
//!
//! See [`Faults`]: a fraction answered 500 (at once or after a delay), 429/503 with `Retry-After`
//! when the replica's own queue is over a limit, a fraction that hangs, connections closed
//! mid-stream after N tokens, and the whole replica exiting after N seconds.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The header naming the replica that answered.
pub const REPLICA_HEADER: &str = "x-sim-replica";

/// Largest request body read, in bytes.
const MAX_REQUEST_BODY: usize = 1024 * 1024;

/// Faults a replica can inject. The default injects none.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Fraction (0..=1) of requests answered 500.
    pub fail_fraction: f64,
    /// Milliseconds before a failing request gets its 500 (0: at once, without taking a slot).
    pub fail_delay_ms: f64,
    /// Requests allowed to wait for a slot; a request arriving when this many wait is answered
    /// `reject_status` with `Retry-After: 1`.
    pub queue_limit: Option<usize>,
    /// 429 or 503, for `queue_limit`.
    pub reject_status: u16,
    /// Fraction (0..=1) of requests that are never answered (until the replica stops).
    pub hang_fraction: f64,
    /// Close the connection after this many tokens of an answer (streamed or not).
    pub close_after_tokens: Option<u32>,
    /// Stop listening and drop every connection this long after start.
    pub exit_after: Option<Duration>,
}

/// A simulated replica's settings.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Sent in the `x-sim-replica` header.
    pub name: String,
    /// Port on 127.0.0.1; 0 picks a free one.
    pub port: u16,
    /// Divides every duration: 2.0 is twice as fast.
    pub speed: f64,
    /// Requests decoded at once.
    pub slots: usize,
    /// Milliseconds of prefill per request, at speed 1.
    pub prefill_ms: f64,
    /// Milliseconds per decode step at speed 1, before the batch term.
    pub step_ms: f64,
    /// Milliseconds added to each decode step per request in the batch, at speed 1.
    pub step_per_batch_ms: f64,
    /// Tokens generated when the request names none.
    pub default_max_tokens: u32,
    /// Seeds the fault draws.
    pub seed: u64,
    /// Injected faults.
    pub faults: Faults,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            name: "sim".to_owned(),
            port: 0,
            speed: 1.0,
            slots: 4,
            prefill_ms: 20.0,
            step_ms: 2.0,
            step_per_batch_ms: 0.5,
            default_max_tokens: 64,
            seed: 1,
            faults: Faults::default(),
        }
    }
}

impl SimConfig {
    /// A replica that answers at once: no prefill, no tokens unless asked, many slots.
    pub fn instant(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            slots: 4096,
            prefill_ms: 0.0,
            step_ms: 0.0,
            step_per_batch_ms: 0.0,
            default_max_tokens: 0,
            ..Self::default()
        }
    }

    /// The prefill (time to first token) of one request.
    pub fn prefill(&self) -> Duration {
        millis(self.prefill_ms / self.speed)
    }

    /// One decode step with `batch` requests holding a slot.
    pub fn step(&self, batch: usize) -> Duration {
        millis((self.step_ms + self.step_per_batch_ms * batch as f64) / self.speed)
    }

    /// Seconds one request of `tokens` tokens takes while every slot is busy.
    pub fn full_batch_seconds(&self, tokens: f64) -> f64 {
        let step_ms = self.step_ms + self.step_per_batch_ms * self.slots as f64;
        (self.prefill_ms + tokens * step_ms) / self.speed / 1000.0
    }

    /// Requests per second the replica finishes with every slot busy and answers of
    /// `mean_tokens` tokens on average.
    pub fn capacity(&self, mean_tokens: f64) -> f64 {
        self.slots as f64 / self.full_batch_seconds(mean_tokens)
    }
}

fn millis(ms: f64) -> Duration {
    Duration::from_secs_f64(ms.max(0.0) / 1000.0)
}

/// Counters of what a replica did.
#[derive(Debug, Default)]
pub struct SimStats {
    /// Requests received.
    pub received: AtomicU64,
    /// Answers finished in full.
    pub completed: AtomicU64,
    /// Requests answered 500.
    pub failed: AtomicU64,
    /// Requests answered 429/503 because the queue was over its limit.
    pub rejected: AtomicU64,
    /// Requests left unanswered on purpose.
    pub hung: AtomicU64,
    /// Answers cut by closing the connection.
    pub closed_mid_stream: AtomicU64,
    /// Requests holding a slot (the current batch).
    pub decoding: AtomicUsize,
    /// Requests waiting for a slot.
    pub waiting: AtomicUsize,
}

impl SimStats {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// A running replica.
pub struct SimHandle {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its name (the `x-sim-replica` header).
    pub name: String,
    /// What it did so far.
    pub stats: Arc<SimStats>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl SimHandle {
    /// `127.0.0.1:port`.
    pub fn host_port(&self) -> String {
        self.addr.to_string()
    }

    /// Stops listening and drops every open connection.
    pub fn stop(&self) {
        let _ = self.stop.send(true);
    }

    /// Whether the replica has stopped.
    pub fn is_stopped(&self) -> bool {
        self.task.is_finished()
    }

    /// Resolves once the replica has stopped listening (after [`SimHandle::stop`] or
    /// `exit_after`).
    pub async fn stopped(&self) {
        wait_for_stop(&mut self.stop.subscribe()).await;
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.stop();
        self.task.abort();
    }
}

/// Shared state of one replica.
struct SimState {
    config: SimConfig,
    slots: Arc<Semaphore>,
    stats: Arc<SimStats>,
    rng: Mutex<fastrand::Rng>,
    stopped: watch::Receiver<bool>,
}

/// Binds `127.0.0.1:{config.port}` and serves in the background.
pub async fn spawn(config: SimConfig) -> std::io::Result<SimHandle> {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], config.port))).await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = watch::channel(false);
    let stats = Arc::new(SimStats::default());
    let state = Arc::new(SimState {
        slots: Arc::new(Semaphore::new(config.slots.max(1))),
        stats: Arc::clone(&stats),
        rng: Mutex::new(fastrand::Rng::with_seed(config.seed)),
        stopped: stopped.clone(),
        config: config.clone(),
    });
    if let Some(after) = config.faults.exit_after {
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let _ = stop.send(true);
        });
    }
    let task = tokio::spawn(accept_loop(listener, state, stopped));
    Ok(SimHandle {
        addr,
        name: config.name,
        stats,
        stop,
        task,
    })
}

async fn accept_loop(
    listener: TcpListener,
    state: Arc<SimState>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = wait_for_stop(&mut stopped) => return,
        };
        let _ = stream.set_nodelay(true);
        let state = Arc::clone(&state);
        let mut connection_stopped = stopped.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let state = Arc::clone(&state);
                async move { Ok::<_, Infallible>(handle(state, request).await) }
            });
            let builder = auto::Builder::new(TokioExecutor::new());
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = connection => {}
                _ = wait_for_stop(&mut connection_stopped) => {}
            }
        });
    }
}

/// Resolves once the stop flag is set (or its sender is gone).
async fn wait_for_stop(stopped: &mut watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

/// The body of every answer: whole, or fed token by token from a producer task.
pub type SimBody = BoxBody<Bytes, ClosedMidStream>;

/// The body error that makes the server drop the connection mid-answer.
#[derive(Debug)]
pub struct ClosedMidStream;

impl std::fmt::Display for ClosedMidStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection closed mid-stream by the simulated replica")
    }
}

impl std::error::Error for ClosedMidStream {}

/// What a request asks for.
#[derive(Debug, Clone, Copy)]
struct Ask {
    max_tokens: u32,
    stream: bool,
}

impl Ask {
    fn parse(body: &[u8], default_max_tokens: u32) -> Self {
        let value: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let max_tokens = value["max_tokens"]
            .as_u64()
            .or_else(|| value["parameters"]["max_new_tokens"].as_u64())
            .map_or(default_max_tokens, |n| n.min(u64::from(u32::MAX)) as u32);
        let stream = value["stream"].as_bool().unwrap_or(false);
        Self { max_tokens, stream }
    }
}

/// What the fault draw decided for one request.
enum Fate {
    Serve,
    Fail,
    Hang,
}

async fn handle(state: Arc<SimState>, request: Request<Incoming>) -> Response<SimBody> {
    SimStats::bump(&state.stats.received);
    let body = match Limited::new(request.into_body(), MAX_REQUEST_BODY)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(_) => return state.json(StatusCode::PAYLOAD_TOO_LARGE, json!({"error": "body"})),
    };
    let ask = Ask::parse(&body, state.config.default_max_tokens);
    match state.draw_fate() {
        Fate::Fail => return state.fail().await,
        Fate::Hang => return state.hang().await,
        Fate::Serve => {}
    }
    if state.queue_is_over_limit() {
        return state.reject();
    }
    if ask.stream {
        state.stream(ask)
    } else {
        state.answer_whole(ask).await
    }
}

impl SimState {
    fn draw_fate(&self) -> Fate {
        let faults = &self.config.faults;
        if faults.fail_fraction <= 0.0 && faults.hang_fraction <= 0.0 {
            return Fate::Serve;
        }
        let draw = self.rng.lock().expect("rng lock").f64();
        if draw < faults.fail_fraction {
            Fate::Fail
        } else if draw < faults.fail_fraction + faults.hang_fraction {
            Fate::Hang
        } else {
            Fate::Serve
        }
    }

    fn queue_is_over_limit(&self) -> bool {
        self.config
            .faults
            .queue_limit
            .is_some_and(|limit| self.stats.waiting.load(Ordering::SeqCst) >= limit)
    }

    async fn fail(&self) -> Response<SimBody> {
        SimStats::bump(&self.stats.failed);
        if self.config.faults.fail_delay_ms > 0.0 {
            tokio::time::sleep(millis(self.config.faults.fail_delay_ms)).await;
        }
        self.json(
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({"error": "simulated failure"}),
        )
    }

    async fn hang(&self) -> Response<SimBody> {
        SimStats::bump(&self.stats.hung);
        let mut stopped = self.stopped.clone();
        wait_for_stop(&mut stopped).await;
        self.json(StatusCode::SERVICE_UNAVAILABLE, json!({"error": "stopped"}))
    }

    fn reject(&self) -> Response<SimBody> {
        SimStats::bump(&self.stats.rejected);
        let status = StatusCode::from_u16(self.config.faults.reject_status)
            .unwrap_or(StatusCode::TOO_MANY_REQUESTS);
        let mut response = self.json(status, json!({"error": "Model is overloaded"}));
        response
            .headers_mut()
            .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
        response
    }

    /// Waits for a slot in FIFO order; the guard gives it back.
    async fn take_slot(&self) -> SlotGuard {
        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        let waiting = WaitingGuard(Arc::clone(&self.stats));
        let permit = Arc::clone(&self.slots)
            .acquire_owned()
            .await
            .expect("the slot semaphore is never closed");
        drop(waiting);
        self.stats.decoding.fetch_add(1, Ordering::SeqCst);
        SlotGuard {
            stats: Arc::clone(&self.stats),
            _permit: permit,
        }
    }

    /// Prefill then `tokens` decode steps; calls `on_token(index)` after each step and stops
    /// early when it returns false. Returns whether every token was produced.
    async fn decode(&self, tokens: u32, mut on_token: impl AsyncTokenSink) -> bool {
        let mut deadline = Instant::now() + self.config.prefill();
        if !self.config.prefill().is_zero() {
            tokio::time::sleep_until(deadline).await;
        }
        for index in 0..tokens {
            let batch = self.stats.decoding.load(Ordering::SeqCst);
            deadline += self.config.step(batch);
            tokio::time::sleep_until(deadline).await;
            if self.config.faults.close_after_tokens == Some(index) {
                SimStats::bump(&self.stats.closed_mid_stream);
                return false;
            }
            if !on_token.token(index).await {
                return false;
            }
        }
        true
    }

    async fn answer_whole(&self, ask: Ask) -> Response<SimBody> {
        let _slot = self.take_slot().await;
        let finished = self.decode(ask.max_tokens, NoSink).await;
        if !finished {
            return closing_response(&self.config.name);
        }
        SimStats::bump(&self.stats.completed);
        let text = " tok".repeat(ask.max_tokens as usize);
        self.json(
            StatusCode::OK,
            json!({
                "generated_text": text,
                "details": {"generated_tokens": ask.max_tokens, "finish_reason": "length"},
            }),
        )
    }

    fn stream(self: &Arc<Self>, ask: Ask) -> Response<SimBody> {
        let (sender, receiver) = mpsc::channel(16);
        let state = Arc::clone(self);
        tokio::spawn(async move {
            let _slot = state.take_slot().await;
            let sink = EventSink {
                sender: sender.clone(),
            };
            if state.decode(ask.max_tokens, sink).await {
                if sender
                    .send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
                    .await
                    .is_ok()
                {
                    SimStats::bump(&state.stats.completed);
                }
            } else {
                let _ = sender.send(Err(ClosedMidStream)).await;
            }
        });
        let mut response = Response::new(ChannelBody { receiver }.boxed());
        let headers = response.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(
            http::header::CACHE_CONTROL,
            HeaderValue::from_static("no-cache"),
        );
        self.name_response(response)
    }

    fn json(&self, status: StatusCode, value: Value) -> Response<SimBody> {
        let body = Full::new(Bytes::from(value.to_string()))
            .map_err(|never: Infallible| match never {})
            .boxed();
        let mut response = Response::new(body);
        *response.status_mut() = status;
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        self.name_response(response)
    }

    fn name_response(&self, mut response: Response<SimBody>) -> Response<SimBody> {
        if let Ok(name) = HeaderValue::from_str(&self.config.name) {
            response.headers_mut().insert(REPLICA_HEADER, name);
        }
        response
    }
}

/// A response whose body fails at once, so the connection is closed without a complete answer.
fn closing_response(name: &str) -> Response<SimBody> {
    let (sender, receiver) = mpsc::channel(1);
    let _ = sender.try_send(Err(ClosedMidStream));
    let mut response = Response::new(ChannelBody { receiver }.boxed());
    if let Ok(name) = HeaderValue::from_str(name) {
        response.headers_mut().insert(REPLICA_HEADER, name);
    }
    response
}

/// Counts a request waiting for a slot while it lives.
struct WaitingGuard(Arc<SimStats>);

impl Drop for WaitingGuard {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A slot held by a request; dropping it frees the slot.
struct SlotGuard {
    stats: Arc<SimStats>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.stats.decoding.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Receives each decoded token.
trait AsyncTokenSink {
    /// Returns false when the client is gone.
    fn token(&mut self, index: u32) -> impl Future<Output = bool> + Send;
}

/// Ignores tokens (the whole answer is sent at the end).
struct NoSink;

impl AsyncTokenSink for NoSink {
    async fn token(&mut self, _index: u32) -> bool {
        true
    }
}

/// Sends one server-sent event per token.
struct EventSink {
    sender: mpsc::Sender<Result<Bytes, ClosedMidStream>>,
}

impl AsyncTokenSink for EventSink {
    async fn token(&mut self, index: u32) -> bool {
        let event = format!(
            "data: {{\"token\":{{\"id\":{index},\"text\":\" tok\",\"logprob\":0.0,\"special\":false}},\"generated_text\":null}}\n\n"
        );
        self.sender.send(Ok(Bytes::from(event))).await.is_ok()
    }
}

/// A body fed from a channel: each item becomes one data frame or ends the body with an error.
struct ChannelBody {
    receiver: mpsc::Receiver<Result<Bytes, ClosedMidStream>>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = ClosedMidStream;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClosedMidStream>>> {
        self.receiver
            .poll_recv(cx)
            .map(|item| item.map(|chunk| chunk.map(Frame::data)))
    }
}
