//! A simulated LLM inference replica (TGI / vLLM-like) for benchmarks, tests and the demo.
//!
//! # Timing model
//!
//! - `slots` requests run at once (continuous batching); more wait in the replica's own FIFO
//!   queue. With `kv_capacity_tokens` set, a request also reserves KV cache for its prompt plus
//!   its `max_tokens` when it starts, and the head of the queue waits until that fits.
//! - The prompt is read from the body ([`prompt`]: chat `messages`, `prompt` or TGI `inputs`,
//!   about 4 characters a token). With a prefix cache (`prefix_cache_tokens` > 0), the leading
//!   blocks of the prompt that the replica computed recently are not prefilled again
//!   ([`prefix_cache`]); a running request's blocks are pinned there until it ends.
//! - `max_tokens` is read from the JSON request body (`max_tokens`, or TGI's
//!   `parameters.max_new_tokens`), else `default_max_tokens`.
//! - [`Batching::PerRequest`] (the default): a request that holds a slot pays a prefill of
//!   `(prefill_ms + prefill_per_token_ms × uncached prompt tokens) / speed`, then decodes
//!   `max_tokens` tokens, one a step: the first token comes at the end of the first step (the
//!   time to first token is the prefill plus one step). Each decode step takes `(step_ms +
//!   step_per_batch_ms × batch) / speed`, where `batch` is the number of requests holding a slot
//!   at that step, so a fuller batch decodes each token more slowly. Steps are scheduled against
//!   deadlines (`previous deadline + step`), so the timer's millisecond resolution does not
//!   accumulate over a long answer.
//! - [`Batching::Stepped`]: one engine loop steps every running request together, with chunked
//!   prefill, so a prefill in progress slows the replica's decodes (see [`engine`]).
//!
//! With `full_batch` on, every step is timed as if every slot were decoding: one request alone
//! takes what it takes in a batch kept full by others (the floor of the tenant and band
//! scenarios). With `pooled_prefix_cache` on, the replicas of a run share one prefix cache of
//! their capacity together (the floor of the prefix scenarios).
//!
//! With the per-token costs and the KV limit off (the default), per-request batching, every slot
//! busy and one request of `t` tokens takes `(prefill_ms + t × (step_ms + step_per_batch_ms ×
//! slots)) / speed` milliseconds, and the replica finishes `slots` requests per such period:
//! [`SimConfig::capacity`].
//!
//! # Answers
//!
//! `"stream": true` answers server-sent events, one `data: {...}` event per token and then
//! `data: [DONE]`; otherwise one JSON document when the last token is decoded. Every answer carries
//! `x-sim-replica: NAME`. `GET /metrics` answers the engine's gauges and counters under vLLM's
//! and TGI's names ([`SimState::metrics_text`]), `GET /info` TGI's `max_concurrent_requests`.
//!
//! # Faults
//!
//! See [`Faults`]: a fraction answered 500 (at once or after a delay), 429/503 with `Retry-After`
//! when the replica's own queue is over a limit, a fraction that hangs, connections closed
//! mid-stream after N tokens, and the whole replica exiting after N seconds.
#![allow(dead_code)]

use std::convert::Infallible;
use std::fmt::Write as _;
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
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

#[path = "sim/engine.rs"]
mod engine;
#[path = "sim/prefix_cache.rs"]
pub mod prefix_cache;
#[path = "sim/prompt.rs"]
pub mod prompt;

use self::prefix_cache::PrefixCache;
use self::prompt::{Prompt, TOKEN_TEXT, answer_text};

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
    /// Milliseconds of prefill per prompt token not found in the prefix cache, at speed 1.
    pub prefill_per_token_ms: f64,
    /// KV cache tokens the running requests may hold together: each reserves its prompt plus its
    /// `max_tokens` when it starts, and the queue's head waits until that fits; a request that
    /// could never fit is answered 400. `None`: no limit but the slots.
    pub kv_capacity_tokens: Option<u64>,
    /// Tokens the prefix cache holds (0: no prefix cache).
    pub prefix_cache_tokens: u64,
    /// Tokens per block of the prefix cache (vLLM's default is 16).
    pub block_tokens: u32,
    /// How requests holding a slot are timed.
    pub batching: Batching,
    /// Seeds the fault draws.
    pub seed: u64,
    /// Injected faults.
    pub faults: Faults,
    /// Whether answers carry OpenAI's `usage` (prompt, completion and cached prompt tokens): in a
    /// whole answer's document, and as a last event before `[DONE]` in a stream (vLLM with
    /// `--enable-force-include-usage`).
    pub usage: bool,
    /// Every decode step is timed as if every slot were decoding (and, stepped, the prompt
    /// chunks get the token budget a full batch leaves): a request's time in a batch kept full
    /// by others, the physics floor the tenant and band scenarios are measured against.
    pub full_batch: bool,
    /// Every replica of a run reads and fills one prefix cache, as large as all of theirs
    /// together (`prefix_cache_tokens` times the replicas): where a request runs no longer
    /// decides what it finds cached, the floor of the prefix scenarios. The lab makes the cache
    /// ([`SharedCache`]) and hands it to each replica in `shared_cache`.
    pub pooled_prefix_cache: bool,
    /// The prefix cache this replica shares with others, instead of one of its own.
    pub shared_cache: Option<SharedCache>,
}

/// A prefix cache several replicas read and fill.
#[derive(Clone)]
pub struct SharedCache(Arc<Mutex<PrefixCache>>);

impl SharedCache {
    /// A cache of `capacity_tokens` in blocks of `block_tokens`.
    pub fn new(capacity_tokens: u64, block_tokens: u32) -> Self {
        Self(Arc::new(Mutex::new(PrefixCache::new(
            capacity_tokens,
            block_tokens,
        ))))
    }
}

impl std::fmt::Debug for SharedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedCache")
    }
}

/// How the requests holding a slot are timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batching {
    /// Each request times its own prefill and decode steps; the batch only sets the length of a
    /// step (the original model).
    PerRequest,
    /// One engine loop runs every step for all running requests: a decode token each, plus up to
    /// `token_budget` minus the decodes of prompt tokens (chunked prefill), and a step lasts longer
    /// for each prompt token it carries (see the `engine` module).
    Stepped {
        /// Tokens per step, decodes and prompt chunks together (vLLM's
        /// `max_num_batched_tokens`).
        token_budget: u32,
    },
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
            prefill_per_token_ms: 0.0,
            kv_capacity_tokens: None,
            prefix_cache_tokens: 0,
            block_tokens: 16,
            batching: Batching::PerRequest,
            seed: 1,
            faults: Faults::default(),
            usage: false,
            full_batch: false,
            pooled_prefix_cache: false,
            shared_cache: None,
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

    /// The prefill (time to first token) of one request with `uncached` prompt tokens to compute,
    /// per-request batching.
    pub fn prefill(&self, uncached: u64) -> Duration {
        millis((self.prefill_ms + self.prefill_per_token_ms * uncached as f64) / self.speed)
    }

    /// One decode step with `batch` requests holding a slot.
    pub fn step(&self, batch: usize) -> Duration {
        millis((self.step_ms + self.step_per_batch_ms * batch as f64) / self.speed)
    }

    /// Seconds one request of `tokens` tokens takes while every slot is busy (per-request
    /// batching, no prompt cost).
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
    /// KV cache tokens reserved by the requests holding a slot.
    pub kv_reserved_tokens: AtomicU64,
    /// Prompt tokens of the requests that took a slot.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Prompt tokens looked up in the prefix cache (vLLM's `prefix_cache_queries`).
    pub prefix_queried_tokens: AtomicU64,
    /// Prompt tokens found there (vLLM's `prefix_cache_hits`).
    pub prefix_hit_tokens: AtomicU64,
}

impl SimStats {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// Prompt tokens found in the prefix cache over prompt tokens looked up; `None` before any
    /// lookup.
    pub fn prefix_hit_ratio(&self) -> Option<f64> {
        let queried = Self::get(&self.prefix_queried_tokens);
        (queried > 0).then(|| Self::get(&self.prefix_hit_tokens) as f64 / queried as f64)
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
    /// KV cache tokens, when limited.
    kv: Option<Arc<Semaphore>>,
    cache: Arc<Mutex<PrefixCache>>,
    /// The engine loop's inbox (stepped batching).
    engine: Option<mpsc::UnboundedSender<engine::Job>>,
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
    let (engine, inbox) = match config.batching {
        Batching::PerRequest => (None, None),
        Batching::Stepped { token_budget } => {
            let (sender, receiver) = mpsc::unbounded_channel();
            (Some(sender), Some((receiver, token_budget)))
        }
    };
    let state = Arc::new(SimState {
        slots: Arc::new(Semaphore::new(config.slots.max(1))),
        kv: config
            .kv_capacity_tokens
            .map(|tokens| Arc::new(Semaphore::new(kv_permits(tokens)))),
        cache: match &config.shared_cache {
            Some(shared) => Arc::clone(&shared.0),
            None => Arc::new(Mutex::new(PrefixCache::new(
                config.prefix_cache_tokens,
                config.block_tokens,
            ))),
        },
        engine,
        stats: Arc::clone(&stats),
        rng: Mutex::new(fastrand::Rng::with_seed(config.seed)),
        stopped: stopped.clone(),
        config: config.clone(),
    });
    if let Some((receiver, token_budget)) = inbox {
        tokio::spawn(engine::run(Arc::clone(&state), receiver, token_budget));
    }
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

/// Semaphore permits for `tokens` KV tokens (a semaphore holds at most `usize::MAX >> 3`).
fn kv_permits(tokens: u64) -> usize {
    usize::try_from(tokens).map_or(Semaphore::MAX_PERMITS, |n| n.min(Semaphore::MAX_PERMITS))
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
#[derive(Debug, Clone)]
struct Ask {
    max_tokens: u32,
    stream: bool,
    prompt: Prompt,
    api: Api,
}

/// The API a request speaks, which shapes its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    /// TGI's `/generate`: `generated_text`, token events.
    Tgi,
    /// OpenAI's `/v1/...`: `choices`, chunk events, `usage` when the replica sends it.
    OpenAi,
}

impl Api {
    fn of_path(path: &str) -> Self {
        if path.starts_with("/v1/") {
            Api::OpenAi
        } else {
            Api::Tgi
        }
    }
}

/// What a finished answer reports in OpenAI's `usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens found in the prefix cache (`prompt_tokens_details.cached_tokens`).
    pub cached_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u32,
}

impl Usage {
    fn document(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + u64::from(self.completion_tokens),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    /// The last event of a stream that reports usage (no choices).
    pub(crate) fn event(self) -> Bytes {
        let chunk = json!({
            "id": "sim",
            "object": "chat.completion.chunk",
            "model": "sim",
            "choices": [],
            "usage": self.document(),
        });
        Bytes::from(format!("data: {chunk}\n\n"))
    }
}

impl Ask {
    fn parse(body: &[u8], default_max_tokens: u32, api: Api) -> Self {
        let value: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let max_tokens = value["max_tokens"]
            .as_u64()
            .or_else(|| value["parameters"]["max_new_tokens"].as_u64())
            .map_or(default_max_tokens, |n| n.min(u64::from(u32::MAX)) as u32);
        let stream = value["stream"].as_bool().unwrap_or(false);
        Self {
            max_tokens,
            stream,
            prompt: Prompt::of_body(&value),
            api,
        }
    }
}

/// What the fault draw decided for one request.
enum Fate {
    Serve,
    Fail,
    Hang,
}

async fn handle(state: Arc<SimState>, request: Request<Incoming>) -> Response<SimBody> {
    if request.method() == http::Method::GET {
        return match request.uri().path() {
            "/metrics" => state.text(state.metrics_text()),
            "/info" => state.json(
                StatusCode::OK,
                json!({"model_id": "sim", "max_concurrent_requests": state.config.slots}),
            ),
            "/health" => state.text(String::new()),
            "/version" => state.json(StatusCode::OK, json!({"version": "sim"})),
            "/v1/models" => state.json(StatusCode::OK, models_document(&state.config)),
            _ => state.json(StatusCode::NOT_FOUND, json!({"error": "not found"})),
        };
    }
    let path = request.uri().path();
    let tokenize = match path {
        "/tokenize" => Some(Tokenize::Tokenize),
        "/v1/chat/completions/render" | "/v1/completions/render" => Some(Tokenize::Render),
        _ => None,
    };
    let api = Api::of_path(path);
    let body = match Limited::new(request.into_body(), MAX_REQUEST_BODY)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(_) => return state.json(StatusCode::PAYLOAD_TOO_LARGE, json!({"error": "body"})),
    };
    if let Some(kind) = tokenize {
        return state.json(StatusCode::OK, tokenize_document(kind, &body));
    }
    SimStats::bump(&state.stats.received);
    let ask = Ask::parse(&body, state.config.default_max_tokens, api);
    match state.draw_fate() {
        Fate::Fail => return state.fail().await,
        Fate::Hang => return state.hang().await,
        Fate::Serve => {}
    }
    if state.queue_is_over_limit() {
        return state.reject();
    }
    if !state.could_ever_fit(&ask) {
        return state.json(
            StatusCode::BAD_REQUEST,
            json!({"error": "the prompt and max_tokens exceed the replica's KV cache capacity"}),
        );
    }
    match (&state.engine, ask.stream) {
        (Some(engine), true) => state.stream_stepped(engine, ask),
        (Some(engine), false) => state.answer_whole_stepped(engine, ask).await,
        (None, true) => state.stream(ask),
        (None, false) => state.answer_whole(ask).await,
    }
}

/// A request's place in the batch: its KV reservation, and what it needs to prefill. Dropping it
/// frees the place.
struct Admission {
    stats: Arc<SimStats>,
    _kv: Option<OwnedSemaphorePermit>,
    reserved_tokens: u64,
    /// Prompt tokens (at least one).
    prompt_tokens: u64,
    /// Prompt tokens to prefill (those not found in the prefix cache; at least one).
    uncached_tokens: u64,
    /// The hash chain of the prompt's full blocks (empty without a prefix cache).
    chain: Vec<u64>,
    /// The prefix cache, and how many leading blocks of `chain` the request holds pinned there
    /// while it runs (those found at admission, then all once its prefill stored them).
    cache: Arc<Mutex<PrefixCache>>,
    pinned: AtomicUsize,
}

impl Admission {
    /// The usage of its answer once `generated` tokens are out.
    fn usage(&self, generated: u32) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.prompt_tokens - self.uncached_tokens,
            completion_tokens: generated,
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.stats.decoding.fetch_sub(1, Ordering::SeqCst);
        self.stats
            .kv_reserved_tokens
            .fetch_sub(self.reserved_tokens, Ordering::SeqCst);
        let pinned = *self.pinned.get_mut();
        if pinned > 0 {
            self.cache
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .unpin(&self.chain[..pinned]);
        }
    }
}

impl SimState {
    /// KV tokens a request reserves: its prompt (at least one token) and its answer.
    fn reservation(prompt: &Prompt, max_tokens: u32) -> u64 {
        prompt.tokens().max(1) + u64::from(max_tokens)
    }

    fn could_ever_fit(&self, ask: &Ask) -> bool {
        self.config
            .kv_capacity_tokens
            .is_none_or(|capacity| Self::reservation(&ask.prompt, ask.max_tokens) <= capacity)
    }

    /// Admits a request at once if its KV reservation fits (the caller holds or checked a slot).
    fn try_admit(&self, prompt: &Prompt, max_tokens: u32) -> Option<Admission> {
        let reserved = Self::reservation(prompt, max_tokens);
        let kv = match &self.kv {
            Some(kv) => Some(
                Arc::clone(kv)
                    .try_acquire_many_owned(permit_count(reserved))
                    .ok()?,
            ),
            None => None,
        };
        Some(self.admitted(prompt, reserved, kv))
    }

    /// Counts a request into the batch and looks its prompt up in the prefix cache.
    fn admitted(
        &self,
        prompt: &Prompt,
        reserved_tokens: u64,
        kv: Option<OwnedSemaphorePermit>,
    ) -> Admission {
        let stats = &self.stats;
        stats.decoding.fetch_add(1, Ordering::SeqCst);
        stats
            .kv_reserved_tokens
            .fetch_add(reserved_tokens, Ordering::SeqCst);
        let tokens = prompt.tokens().max(1);
        stats.prompt_tokens.fetch_add(tokens, Ordering::Relaxed);
        let mut cache = self.cache.lock().expect("prefix cache lock");
        let (chain, cached, held) = if cache.is_enabled() {
            let chain = prompt.block_hashes(self.config.block_tokens);
            let held = cache.lookup(&chain);
            cache.pin(&chain[..held]);
            let held = held as u64;
            // At least the last prompt token is computed, to yield the first output token.
            let cached = (held * u64::from(self.config.block_tokens)).min(tokens - 1);
            stats
                .prefix_queried_tokens
                .fetch_add(tokens, Ordering::Relaxed);
            stats.prefix_hit_tokens.fetch_add(cached, Ordering::Relaxed);
            (chain, cached, held as usize)
        } else {
            (Vec::new(), 0, 0)
        };
        Admission {
            stats: Arc::clone(stats),
            _kv: kv,
            reserved_tokens,
            prompt_tokens: tokens,
            uncached_tokens: tokens - cached,
            chain,
            cache: Arc::clone(&self.cache),
            pinned: AtomicUsize::new(held),
        }
    }

    /// Stores the blocks a request has computed (its prompt, and `generated` tokens of answer)
    /// in the prefix cache.
    fn remember(&self, prompt: &Prompt, generated: u32, admission: &Admission) {
        let mut cache = self.cache.lock().expect("prefix cache lock");
        if !cache.is_enabled() {
            return;
        }
        if generated == 0 {
            // The prefill stored the whole prompt; the request holds it while it runs.
            let pinned = admission
                .pinned
                .swap(admission.chain.len(), Ordering::Relaxed);
            cache.insert_pinned(&admission.chain, pinned);
        } else {
            let block_tokens = self.config.block_tokens;
            cache.insert(&prompt.chain_with_answer(&admission.chain, generated, block_tokens));
        }
    }

    /// The engine's state in Prometheus' text format, under vLLM's and TGI's names.
    fn metrics_text(&self) -> String {
        let stats = &self.stats;
        let running = stats.decoding.load(Ordering::SeqCst);
        let waiting = stats.waiting.load(Ordering::SeqCst);
        let kv_usage = match self.config.kv_capacity_tokens {
            Some(capacity) => {
                stats.kv_reserved_tokens.load(Ordering::SeqCst) as f64 / capacity.max(1) as f64
            }
            None => running as f64 / self.config.slots.max(1) as f64,
        };
        let label = "{model_name=\"sim\"}";
        let mut text = String::new();
        let mut family = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                text,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{label} {value}"
            );
        };
        family(
            "vllm:num_requests_running",
            "gauge",
            "Requests in the batch (prefill or decode).",
            running.to_string(),
        );
        family(
            "vllm:num_requests_waiting",
            "gauge",
            "Requests waiting for a slot or for KV cache.",
            waiting.to_string(),
        );
        family(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "Fraction of the KV cache reserved by running requests (1 = full).",
            kv_usage.to_string(),
        );
        family(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            SimStats::get(&stats.prefix_queried_tokens).to_string(),
        );
        family(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
            SimStats::get(&stats.prefix_hit_tokens).to_string(),
        );
        family(
            "vllm:prompt_tokens_total",
            "counter",
            "Prompt tokens of the requests admitted.",
            SimStats::get(&stats.prompt_tokens).to_string(),
        );
        family(
            "vllm:generation_tokens_total",
            "counter",
            "Tokens generated.",
            SimStats::get(&stats.generated_tokens).to_string(),
        );
        let _ = writeln!(
            text,
            "# HELP tgi_queue_size Requests waiting.\n# TYPE tgi_queue_size gauge\ntgi_queue_size {waiting}\n\
             # HELP tgi_batch_current_size Requests in the batch.\n# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size {running}"
        );
        text
    }

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

    /// Waits in FIFO order for the KV reservation (when limited), then for a slot (per-request
    /// batching); the admission gives both back when dropped.
    async fn take_slot(&self, ask: &Ask) -> SlotGuard {
        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        let waiting = WaitingGuard(Arc::clone(&self.stats));
        let reserved = Self::reservation(&ask.prompt, ask.max_tokens);
        let kv = match &self.kv {
            Some(kv) => Some(
                Arc::clone(kv)
                    .acquire_many_owned(permit_count(reserved))
                    .await
                    .expect("the KV semaphore is never closed"),
            ),
            None => None,
        };
        let permit = Arc::clone(&self.slots)
            .acquire_owned()
            .await
            .expect("the slot semaphore is never closed");
        drop(waiting);
        SlotGuard {
            admission: self.admitted(&ask.prompt, reserved, kv),
            _permit: permit,
        }
    }

    /// Prefill then `ask.max_tokens` decode steps (per-request batching); calls
    /// `on_token(index)` after each step and stops early when it returns false. Returns whether
    /// every token was produced.
    async fn decode(&self, ask: &Ask, slot: &SlotGuard, mut on_token: impl AsyncTokenSink) -> bool {
        let admission = &slot.admission;
        let prefill = self.config.prefill(admission.uncached_tokens);
        let mut deadline = Instant::now() + prefill;
        if !prefill.is_zero() {
            tokio::time::sleep_until(deadline).await;
        }
        self.remember(&ask.prompt, 0, admission);
        for index in 0..ask.max_tokens {
            let batch = if self.config.full_batch {
                self.config.slots
            } else {
                self.stats.decoding.load(Ordering::SeqCst)
            };
            deadline += self.config.step(batch);
            tokio::time::sleep_until(deadline).await;
            if self.config.faults.close_after_tokens == Some(index) {
                SimStats::bump(&self.stats.closed_mid_stream);
                return false;
            }
            self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
            if !on_token.token(index).await {
                return false;
            }
        }
        self.remember(&ask.prompt, ask.max_tokens, admission);
        true
    }

    async fn answer_whole(&self, ask: Ask) -> Response<SimBody> {
        let slot = self.take_slot(&ask).await;
        let finished = self.decode(&ask, &slot, NoSink).await;
        if !finished {
            return closing_response(&self.config.name);
        }
        SimStats::bump(&self.stats.completed);
        self.whole_answer(ask.api, slot.admission.usage(ask.max_tokens))
    }

    /// The JSON document of a whole answer: TGI's, or OpenAI's chat completion (with `usage`
    /// when the replica sends it).
    fn whole_answer(&self, api: Api, usage: Usage) -> Response<SimBody> {
        let text = answer_text(usage.completion_tokens);
        let document = match api {
            Api::Tgi => json!({
                "generated_text": text,
                "details": {"generated_tokens": usage.completion_tokens, "finish_reason": "length"},
            }),
            Api::OpenAi => {
                let mut document = json!({
                    "id": "sim",
                    "object": "chat.completion",
                    "model": "sim",
                    "choices": [{
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "length",
                    }],
                });
                if self.config.usage {
                    document["usage"] = usage.document();
                }
                document
            }
        };
        self.json(StatusCode::OK, document)
    }

    /// The event that ends a stream before `[DONE]`: its usage, when the replica reports it.
    pub(crate) fn usage_event(&self, api: Api, usage: Usage) -> Option<Bytes> {
        (self.config.usage && api == Api::OpenAi).then(|| usage.event())
    }

    fn stream(self: &Arc<Self>, ask: Ask) -> Response<SimBody> {
        let (sender, receiver) = mpsc::unbounded_channel();
        let state = Arc::clone(self);
        tokio::spawn(async move {
            let slot = state.take_slot(&ask).await;
            let sink = EventSink {
                sender: sender.clone(),
                api: ask.api,
            };
            if state.decode(&ask, &slot, sink).await {
                if let Some(event) =
                    state.usage_event(ask.api, slot.admission.usage(ask.max_tokens))
                {
                    let _ = sender.send(Ok(event));
                }
                if sender
                    .send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
                    .is_ok()
                {
                    SimStats::bump(&state.stats.completed);
                }
            } else {
                let _ = sender.send(Err(ClosedMidStream));
            }
        });
        self.event_stream(receiver)
    }

    /// Hands a streamed request to the engine loop (stepped batching).
    fn stream_stepped(
        &self,
        engine: &mpsc::UnboundedSender<engine::Job>,
        ask: Ask,
    ) -> Response<SimBody> {
        let (sender, receiver) = mpsc::unbounded_channel();
        self.submit(engine, ask, engine::Output::Stream(sender));
        self.event_stream(receiver)
    }

    /// Hands a whole-answer request to the engine loop and waits for its end (stepped batching).
    async fn answer_whole_stepped(
        &self,
        engine: &mpsc::UnboundedSender<engine::Job>,
        ask: Ask,
    ) -> Response<SimBody> {
        let (sender, receiver) = oneshot::channel();
        let api = ask.api;
        self.submit(engine, ask, engine::Output::Whole(sender));
        match receiver.await {
            Ok(Some(usage)) => self.whole_answer(api, usage),
            _ => closing_response(&self.config.name),
        }
    }

    fn submit(
        &self,
        engine: &mpsc::UnboundedSender<engine::Job>,
        ask: Ask,
        output: engine::Output,
    ) {
        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        let job = engine::Job {
            prompt: ask.prompt,
            max_tokens: ask.max_tokens,
            api: ask.api,
            output,
        };
        if engine.send(job).is_err() {
            // The engine loop has stopped with the replica; the connection goes with it.
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// A server-sent events answer fed from `receiver`.
    fn event_stream(
        &self,
        receiver: mpsc::UnboundedReceiver<Result<Bytes, ClosedMidStream>>,
    ) -> Response<SimBody> {
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
        let mut response = self.text(value.to_string());
        *response.status_mut() = status;
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }

    /// 200 with `body` as plain text.
    fn text(&self, body: String) -> Response<SimBody> {
        let body = Full::new(Bytes::from(body))
            .map_err(|never: Infallible| match never {})
            .boxed();
        let mut response = Response::new(body);
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
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

/// A reservation as semaphore permits (reservations never exceed the capacity, itself capped).
fn permit_count(tokens: u64) -> u32 {
    u32::try_from(tokens).unwrap_or(u32::MAX)
}

/// A response whose body fails at once, so the connection is closed without a complete answer.
fn closing_response(name: &str) -> Response<SimBody> {
    let (sender, receiver) = mpsc::unbounded_channel();
    let _ = sender.send(Err(ClosedMidStream));
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

/// A slot held by a request (per-request batching); dropping it frees the slot and the KV.
struct SlotGuard {
    admission: Admission,
    _permit: OwnedSemaphorePermit,
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
    sender: mpsc::UnboundedSender<Result<Bytes, ClosedMidStream>>,
    api: Api,
}

impl AsyncTokenSink for EventSink {
    async fn token(&mut self, index: u32) -> bool {
        self.sender.send(Ok(token_event(self.api, index))).is_ok()
    }
}

/// The server-sent event of token `index`: TGI's token event, or OpenAI's chat chunk.
fn token_event(api: Api, index: u32) -> Bytes {
    match api {
        Api::Tgi => Bytes::from(format!(
            "data: {{\"token\":{{\"id\":{index},\"text\":\"{TOKEN_TEXT}\",\"logprob\":0.0,\"special\":false}},\"generated_text\":null}}\n\n"
        )),
        Api::OpenAi => Bytes::from(format!(
            "data: {{\"id\":\"sim\",\"object\":\"chat.completion.chunk\",\"model\":\"sim\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{TOKEN_TEXT}\"}},\"finish_reason\":null}}]}}\n\n"
        )),
    }
}

/// `GET /v1/models`: the one model the replica serves, as vLLM lists it.
fn models_document(config: &SimConfig) -> Value {
    json!({
        "object": "list",
        "data": [{
            "id": "sim",
            "object": "model",
            "owned_by": "vllm",
            "root": "sim",
            "max_model_len": config.kv_capacity_tokens.unwrap_or(131_072),
        }],
    })
}

/// The two ways vLLM tells a router a prompt's tokens.
#[derive(Debug, Clone, Copy)]
enum Tokenize {
    /// `POST /tokenize`: `{"count", "max_model_len", "tokens"}`.
    Tokenize,
    /// `POST /v1/chat/completions/render` and `/v1/completions/render`: `{"token_ids"}`.
    Render,
}

/// The prompt of a body (`prompt` or chat `messages`, as a generation request's) as token ids,
/// one per [`prompt::CHARS_PER_TOKEN`] bytes, each the hash of its bytes, so equal text gives
/// equal ids.
fn tokenize_document(kind: Tokenize, body: &[u8]) -> Value {
    let value: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let prompt = Prompt::of_body(&value);
    let tokens: Vec<u32> = prompt
        .text
        .as_bytes()
        .chunks(prompt::CHARS_PER_TOKEN)
        .map(|chunk| {
            let mut hash = 0x811c_9dc5_u32;
            for &byte in chunk {
                hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
            }
            hash % 150_000
        })
        .collect();
    match kind {
        Tokenize::Tokenize => {
            json!({"count": tokens.len(), "max_model_len": 131_072, "tokens": tokens})
        }
        Tokenize::Render => json!({"token_ids": tokens}),
    }
}

/// A body fed from a channel: each item becomes one data frame or ends the body with an error.
struct ChannelBody {
    receiver: mpsc::UnboundedReceiver<Result<Bytes, ClosedMidStream>>,
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
