//! Load generator: open-loop Poisson arrivals or closed-loop workers, with per-request records.
//!
//! Open loop: the whole schedule (arrival times, answer lengths, streaming or not) is drawn up
//! front from a seeded RNG by [`plan`], so every strategy and peer of a scenario receives exactly
//! the same requests at the same offsets. Requests are sent at their time whether or not earlier
//! ones have finished, as real clients do.
//!
//! Closed loop: `concurrency` workers each send a request as soon as their previous one finished;
//! this measures the most a proxy can carry (the overhead scenario).
//!
//! Users: each user starts at a planned offset and sends its turns one after the other, each
//! after the previous answer ended plus a planned think time (a chat user waits for the answer
//! before writing again). What every turn sends is drawn up front (see `workload.rs`), so every
//! peer receives the same requests; only their timing follows the answers.
//!
//! Open and closed loop requests are `POST /generate` with a TGI-style JSON body
//! (`{"inputs": ..., "parameters": {"max_new_tokens": N}, "stream": bool}`); users' turns carry
//! their own path, body and headers.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// The header naming the replica that answered (set by the simulated replica).
pub const REPLICA_HEADER: &str = "x-sim-replica";

/// The HTTP/1.1 client every request goes through (keep-alive pool, `TCP_NODELAY`).
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A new client with its own connection pool.
pub fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

/// How many tokens each request asks for.
#[derive(Debug, Clone)]
pub enum Lengths {
    /// Always `n`.
    Fixed(u32),
    /// Uniform in `min..=max`.
    Uniform { min: u32, max: u32 },
    /// Log-normal (heavy-tailed) with the given median and shape, clamped to `min.max(1)..=max`.
    LogNormal {
        median: f64,
        sigma: f64,
        min: u32,
        max: u32,
    },
}

impl Lengths {
    /// One draw.
    pub fn sample(&self, rng: &mut fastrand::Rng) -> u32 {
        match *self {
            Lengths::Fixed(n) => n,
            Lengths::Uniform { min, max } => rng.u32(min..=max),
            Lengths::LogNormal {
                median,
                sigma,
                min,
                max,
            } => {
                let draw = median * (sigma * standard_normal(rng)).exp();
                (draw.round() as u32).clamp(min.max(1), max.max(min.max(1)))
            }
        }
    }

    /// The mean, estimated from a fixed number of draws with a fixed seed.
    pub fn mean(&self) -> f64 {
        const DRAWS: u32 = 100_000;
        let mut rng = fastrand::Rng::with_seed(0x5eed);
        let total: f64 = (0..DRAWS).map(|_| f64::from(self.sample(&mut rng))).sum();
        total / f64::from(DRAWS)
    }

    /// A short description for reports.
    pub fn describe(&self) -> String {
        match *self {
            Lengths::Fixed(n) => format!("{n} tokens"),
            Lengths::Uniform { min, max } => format!("uniform {min}..={max} tokens"),
            Lengths::LogNormal {
                median,
                sigma,
                min,
                max,
            } if min > 1 => {
                format!("log-normal tokens (median {median}, σ {sigma}, {min} to {max})")
            }
            Lengths::LogNormal {
                median, sigma, max, ..
            } => format!("log-normal tokens (median {median}, σ {sigma}, at most {max})"),
        }
    }
}

/// A standard normal draw (Box–Muller).
fn standard_normal(rng: &mut fastrand::Rng) -> f64 {
    let u1 = 1.0 - rng.f64(); // in (0, 1]
    let u2 = rng.f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// An open-loop load: Poisson arrivals plus an optional burst at time 0.
#[derive(Debug, Clone)]
pub struct OpenLoop {
    /// Mean arrivals per second.
    pub rate: f64,
    /// How long arrivals go on.
    pub duration: Duration,
    /// Requests sent at once at time 0, on top of the Poisson arrivals.
    pub burst: usize,
    /// Answer lengths.
    pub lengths: Lengths,
    /// Fraction (0..=1) of requests that ask for a stream.
    pub stream_fraction: f64,
    /// Seeds the schedule.
    pub seed: u64,
    /// A request not finished after this long is recorded as a timeout.
    pub request_timeout: Duration,
    /// Upper bound on the number of requests in the schedule.
    pub max_requests: usize,
}

/// A header field a request carries.
pub type Header = (http::HeaderName, http::HeaderValue);

/// A traffic class of an open-loop load: a name (kept in each request's [`Record`]), its share
/// of the arrivals and the header fields its requests carry.
#[derive(Debug, Clone)]
pub struct Class {
    /// Its name, in reports.
    pub name: &'static str,
    /// The fraction of arrivals of this class (the shares of a load's classes sum to 1).
    pub share: f64,
    /// Header fields every request of the class carries.
    pub headers: Vec<Header>,
}

impl Class {
    /// A class whose requests carry the static header fields `headers`.
    pub fn new(name: &'static str, share: f64, headers: &[(&'static str, &'static str)]) -> Self {
        Self {
            name,
            share,
            headers: headers
                .iter()
                .map(|&(name, value)| {
                    (
                        http::HeaderName::from_static(name),
                        http::HeaderValue::from_static(value),
                    )
                })
                .collect(),
        }
    }
}

/// The class of a uniform draw `u` in `0..1`: the first whose cumulative share is above `u`
/// (the last one when rounding leaves the shares' sum below `u`).
pub fn class_of_draw(classes: &[Class], u: f64) -> Option<&Class> {
    let mut cumulative = 0.0;
    for class in classes {
        cumulative += class.share;
        if u < cumulative {
            return Some(class);
        }
    }
    classes.last()
}

/// One request of a schedule.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Offset from the start of the run.
    pub at: Duration,
    /// Tokens asked for.
    pub max_tokens: u32,
    /// Whether it asks for a stream.
    pub stream: bool,
    /// Its traffic class (`None` when the load declares none).
    pub class: Option<&'static str>,
    /// Extra header fields: its class's, then those of every request.
    pub headers: Vec<Header>,
}

/// Draws the whole schedule of `load`.
pub fn plan(load: &OpenLoop) -> Vec<Planned> {
    plan_classes(load, &[], &[])
}

/// Draws the whole schedule of `load`, each request of one of `classes` (drawn from the same
/// RNG after its length and streaming, and only when there are classes: without classes the
/// schedule is the one of [`plan`]) and carrying `headers` after its class's.
pub fn plan_classes(load: &OpenLoop, classes: &[Class], headers: &[Header]) -> Vec<Planned> {
    let mut rng = fastrand::Rng::with_seed(load.seed);
    let mut requests = Vec::new();
    for _ in 0..load.burst.min(load.max_requests) {
        requests.push(draw_request(
            load,
            classes,
            headers,
            &mut rng,
            Duration::ZERO,
        ));
    }
    let end = load.duration.as_secs_f64();
    let mut at = 0.0;
    while requests.len() < load.max_requests && load.rate > 0.0 {
        at += -(1.0 - rng.f64()).ln() / load.rate;
        if at >= end {
            break;
        }
        let at = Duration::from_secs_f64(at);
        requests.push(draw_request(load, classes, headers, &mut rng, at));
    }
    requests
}

fn draw_request(
    load: &OpenLoop,
    classes: &[Class],
    headers: &[Header],
    rng: &mut fastrand::Rng,
    at: Duration,
) -> Planned {
    let max_tokens = load.lengths.sample(rng);
    let stream = rng.f64() < load.stream_fraction;
    let class = if classes.is_empty() {
        None
    } else {
        class_of_draw(classes, rng.f64())
    };
    let mut all_headers = class.map_or_else(Vec::new, |class| class.headers.clone());
    all_headers.extend_from_slice(headers);
    Planned {
        at,
        max_tokens,
        stream,
        class: class.map(|class| class.name),
        headers: all_headers,
    }
}

/// A request to send: where, what, and what it asks for (kept in its record).
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// Path and query.
    pub path: String,
    /// The JSON body.
    pub body: Bytes,
    /// Extra header fields.
    pub headers: Vec<(http::HeaderName, http::HeaderValue)>,
    /// Tokens asked for.
    pub max_tokens: u32,
    /// Whether it asks for a stream.
    pub stream: bool,
    /// Prompt tokens, as the simulated replica counts them.
    pub prompt_tokens: u64,
}

impl Outgoing {
    /// `POST /generate` with the TGI body of [`request_body`].
    pub fn generate(max_tokens: u32, stream: bool) -> Self {
        Self {
            path: "/generate".to_owned(),
            body: request_body(max_tokens, stream),
            headers: Vec::new(),
            max_tokens,
            stream,
            prompt_tokens: GENERATE_PROMPT_TOKENS,
        }
    }
}

/// The prompt tokens of [`request_body`] (its 29 characters).
const GENERATE_PROMPT_TOKENS: u64 = 8;

/// What happened to one request.
#[derive(Debug, Clone)]
pub struct Record {
    /// Seconds from the start of the run to sending.
    pub sent_at: f64,
    /// Seconds from sending to the end of the body (or to the failure).
    pub latency: f64,
    /// Seconds from sending to the first body byte (equal to `latency` when there was none).
    pub ttfb: f64,
    /// HTTP status, 0 when no response arrived.
    pub status: u16,
    /// Whether the whole body arrived.
    pub complete: bool,
    /// The `x-sim-replica` header of the answer.
    pub replica: Option<String>,
    /// Why no complete answer arrived: `connect`, `body`, `timeout`.
    pub error: Option<&'static str>,
    /// Tokens asked for.
    pub max_tokens: u32,
    /// Whether it asked for a stream.
    pub stream: bool,
    /// Prompt tokens sent.
    pub prompt_tokens: u64,
    /// The traffic class of an open-loop request (see [`Class`]).
    pub class: Option<&'static str>,
}

impl Record {
    /// A 2xx answer received in full.
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status) && self.complete
    }
}

/// Live counters, for a progress display.
#[derive(Debug, Default)]
pub struct Progress {
    /// Requests finished (any outcome).
    pub finished: AtomicU64,
    /// Requests that did not end in a complete 2xx answer.
    pub failed: AtomicU64,
    /// Answers per replica name (any status).
    pub answered_by: Mutex<BTreeMap<String, u64>>,
}

impl Progress {
    fn count(&self, record: &Record) {
        self.finished.fetch_add(1, Ordering::Relaxed);
        if !record.is_success() {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(replica) = &record.replica {
            *self
                .answered_by
                .lock()
                .expect("progress lock")
                .entry(replica.clone())
                .or_default() += 1;
        }
    }
}

/// Sends `schedule` to `target`, each request at its offset, and waits for all of them (each is
/// bounded by `request_timeout`). Records come back in schedule order.
pub async fn run_open_loop(
    target: SocketAddr,
    schedule: Vec<Planned>,
    request_timeout: Duration,
    progress: Option<Arc<Progress>>,
) -> Vec<Record> {
    let client = http_client();
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    let count = schedule.len();
    for (index, planned) in schedule.into_iter().enumerate() {
        tokio::time::sleep_until(start + planned.at).await;
        let client = client.clone();
        let progress = progress.clone();
        tasks.spawn(async move {
            let mut request = Outgoing::generate(planned.max_tokens, planned.stream);
            request.headers = planned.headers;
            let sent_at = start.elapsed().as_secs_f64();
            let mut record = send(&client, target, &request, sent_at, request_timeout).await;
            record.class = planned.class;
            if let Some(progress) = progress {
                progress.count(&record);
            }
            (index, record)
        });
    }
    let mut records: Vec<Option<Record>> = vec![None; count];
    while let Some(joined) = tasks.join_next().await {
        if let Ok((index, record)) = joined {
            records[index] = Some(record);
        }
    }
    records.into_iter().flatten().collect()
}

/// A closed-loop load: `concurrency` workers sending back to back.
#[derive(Debug, Clone)]
pub struct ClosedLoop {
    /// Workers.
    pub concurrency: usize,
    /// How long they keep sending.
    pub duration: Duration,
    /// Tokens each request asks for.
    pub max_tokens: u32,
    /// Upper bound on requests per worker.
    pub max_requests_per_worker: usize,
    /// A request not finished after this long is recorded as a timeout.
    pub request_timeout: Duration,
}

/// Runs `load` against `target` and returns every record.
pub async fn run_closed_loop(target: SocketAddr, load: &ClosedLoop) -> Vec<Record> {
    let client = http_client();
    let start = Instant::now();
    let deadline = start + load.duration;
    let mut workers = JoinSet::new();
    for _ in 0..load.concurrency {
        let client = client.clone();
        let load = load.clone();
        workers.spawn(async move {
            let mut records = Vec::new();
            let request = Outgoing::generate(load.max_tokens, false);
            while Instant::now() < deadline && records.len() < load.max_requests_per_worker {
                let sent_at = start.elapsed().as_secs_f64();
                records.push(send(&client, target, &request, sent_at, load.request_timeout).await);
            }
            records
        });
    }
    let mut records = Vec::new();
    while let Some(joined) = workers.join_next().await {
        if let Ok(worker_records) = joined {
            records.extend(worker_records);
        }
    }
    records
}

/// The JSON body of one request.
pub fn request_body(max_tokens: u32, stream: bool) -> Bytes {
    Bytes::from(format!(
        "{{\"inputs\":\"Tell me about load balancing.\",\"parameters\":{{\"max_new_tokens\":{max_tokens}}},\"stream\":{stream}}}"
    ))
}

/// One user of a users load: when it starts and its turns, in order.
#[derive(Debug, Clone)]
pub struct User {
    /// Offset of its first request from the start of the run.
    pub start: Duration,
    /// Its requests.
    pub turns: Vec<Turn>,
}

/// One request of a user.
#[derive(Debug, Clone)]
pub struct Turn {
    /// Time between the end of the previous answer and this request (ignored for the first).
    pub think: Duration,
    /// What it sends.
    pub request: Outgoing,
}

/// Runs every user against `target` and returns the records of all turns, user by user in turn
/// order. Each request is bounded by `request_timeout`; a user whose request failed goes on
/// with its next turn.
pub async fn run_users(
    target: SocketAddr,
    users: Vec<User>,
    request_timeout: Duration,
) -> Vec<Record> {
    let client = http_client();
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for (index, user) in users.into_iter().enumerate() {
        let client = client.clone();
        tasks.spawn(async move {
            tokio::time::sleep_until(start + user.start).await;
            let mut records = Vec::with_capacity(user.turns.len());
            for (turn_index, turn) in user.turns.iter().enumerate() {
                if turn_index > 0 {
                    tokio::time::sleep(turn.think).await;
                }
                let sent_at = start.elapsed().as_secs_f64();
                let request = &turn.request;
                records.push(send(&client, target, request, sent_at, request_timeout).await);
            }
            (index, records)
        });
    }
    let mut by_user = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        if let Ok(done) = joined {
            by_user.push(done);
        }
    }
    by_user.sort_by_key(|(index, _)| *index);
    by_user
        .into_iter()
        .flat_map(|(_, records)| records)
        .collect()
}

/// Sends one request and records what happened, within `limit`.
pub async fn send(
    client: &HttpClient,
    target: SocketAddr,
    request: &Outgoing,
    sent_at: f64,
    limit: Duration,
) -> Record {
    let started = Instant::now();
    let mut record = Record {
        sent_at,
        latency: 0.0,
        ttfb: 0.0,
        status: 0,
        complete: false,
        replica: None,
        error: None,
        max_tokens: request.max_tokens,
        stream: request.stream,
        prompt_tokens: request.prompt_tokens,
        class: None,
    };
    let exchange = exchange(client, target, request, started, &mut record);
    if tokio::time::timeout(limit, exchange).await.is_err() {
        record.error = Some("timeout");
    }
    record.latency = started.elapsed().as_secs_f64();
    if record.ttfb == 0.0 {
        record.ttfb = record.latency;
    }
    record
}

async fn exchange(
    client: &HttpClient,
    target: SocketAddr,
    outgoing: &Outgoing,
    started: Instant,
    record: &mut Record,
) {
    let mut request = Request::post(format!("http://{target}{}", outgoing.path))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(outgoing.body.clone()))
        .expect("a valid request");
    for (name, value) in &outgoing.headers {
        request.headers_mut().append(name.clone(), value.clone());
    }
    let response = match client.request(request).await {
        Ok(response) => response,
        Err(_) => {
            record.error = Some("connect");
            return;
        }
    };
    record.status = response.status().as_u16();
    record.replica = response
        .headers()
        .get(REPLICA_HEADER)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let mut body = response.into_body();
    loop {
        match body.frame().await {
            None => {
                record.complete = true;
                return;
            }
            Some(Ok(frame)) => {
                let has_data = frame.data_ref().is_some_and(|data| !data.is_empty());
                if has_data && record.ttfb == 0.0 {
                    record.ttfb = started.elapsed().as_secs_f64();
                }
            }
            Some(Err(_)) => {
                record.error = Some("body");
                return;
            }
        }
    }
}
