//! Engine load signals: what an inference engine says of its own load on its Prometheus
//! endpoint, read per backend and kept on it for strategies ([`EngineLoad`]).
//!
//! Off by default (`[engine_metrics] kind = "off"`). When on, [`crate::engine_scrape`] fetches
//! `GET engine_metrics.path` of every backend each `interval`, [`parse`] turns the text into an
//! [`EngineReading`], and [`EngineLoad::record`] stores it on the backend. Strategies read
//! [`EngineLoad::snapshot`], lock-free: `None` until the first good scrape and once the last one
//! is older than `stale_after`, so a backend whose scrapes fail keeps its values for that long
//! and then counts on router-side signals only.
//!
//! What is read, per engine (a family exported under several label sets, such as one per model
//! or per data-parallel engine, is summed; a usage fraction is averaged over them, so it stays
//! within 0..1):
//!
//! | Engine | Running | Waiting | KV-cache usage | Capacity |
//! |---|---|---|---|---|
//! | vLLM | `vllm:num_requests_running` | `vllm:num_requests_waiting` | `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) | — |
//! | SGLang | `sglang:num_running_reqs` | `sglang:num_queue_reqs` | `sglang:token_usage` | — |
//! | TGI | `tgi_batch_current_size` | `tgi_queue_size` | — | `GET /info` `max_concurrent_requests` ([`parse_info`]) |
//!
//! vLLM's prefix-cache counters `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` (with
//! or without `_total`) are kept too ([`EngineLoad::prefix_cache`]). With `kind = "auto"` the
//! engine is told by which of these names appear: vLLM's, then SGLang's, then TGI's.
//!
//! The text is parsed by the `prom_text_format_parser` crate (MIT or Apache-2.0). It takes the
//! whole metric-name grammar of the exposition format, colons included, with `HELP`/`TYPE`
//! lines, labels, histograms and summaries, and hands back what it could assemble even when a
//! family is malformed. `prometheus-parse`, the most used parser, matches metric names with
//! `\w+`, so it drops every `vllm:` and `sglang:` sample; `openmetrics-parser` is LGPL-3.0.
//! A line the crate cannot read at all fails the whole scrape (counted `invalid`), and the
//! backend's values then go stale as after any failed scrape.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use prom_text_format_parser::{Metric, ValueType};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// Which engine's metrics to read (`engine_metrics.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// No scraping (the default).
    #[default]
    Off,
    /// vLLM's `vllm:` metrics.
    Vllm,
    /// SGLang's `sglang:` metrics.
    Sglang,
    /// Text Generation Inference's `tgi_` metrics and its `/info` capacity.
    Tgi,
    /// Whichever of the three a backend's text names.
    Auto,
}

/// The `[engine_metrics]` section: whether and how the router reads each backend's engine
/// metrics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineMetricsConfig {
    /// Which engine's names to read; `Off` scrapes nothing.
    pub kind: EngineKind,
    /// Between two scrapes of a backend (the configuration allows 100 ms to 10 s).
    #[serde(with = "crate::forms::seconds")]
    pub interval: Duration,
    /// The path of the metrics endpoint.
    pub path: String,
    /// How long one scrape may take; `None`: the interval ([`EngineMetricsConfig::timeout`]).
    #[serde(with = "crate::forms::optional_seconds")]
    pub timeout: Option<Duration>,
    /// Age after which a backend's values are no longer read; `None`: three intervals
    /// ([`EngineMetricsConfig::stale_after`]).
    #[serde(with = "crate::forms::optional_seconds")]
    pub stale_after: Option<Duration>,
}

impl Default for EngineMetricsConfig {
    fn default() -> Self {
        Self {
            kind: EngineKind::Off,
            interval: Duration::from_millis(500),
            path: "/metrics".to_owned(),
            timeout: None,
            stale_after: None,
        }
    }
}

impl EngineMetricsConfig {
    /// The shortest interval the configuration allows.
    pub const MIN_INTERVAL: Duration = Duration::from_millis(100);
    /// The longest interval the configuration allows.
    pub const MAX_INTERVAL: Duration = Duration::from_secs(10);

    /// How long one scrape may take: the configured timeout, else the interval.
    pub fn timeout(&self) -> Duration {
        self.timeout.unwrap_or(self.interval)
    }

    /// Age after which values are not read: the configured one, else three intervals.
    pub fn stale_after(&self) -> Duration {
        self.stale_after.unwrap_or(self.interval * 3)
    }

    /// Checks what the types leave open: an interval from [`Self::MIN_INTERVAL`] to
    /// [`Self::MAX_INTERVAL`], a `stale_after` of at least the interval, a path starting with
    /// `/`. The error names the key within `[engine_metrics]`.
    pub fn check(&self) -> Result<(), crate::forms::Invalid> {
        use crate::forms::Invalid;
        let interval = self.interval;
        if !(Self::MIN_INTERVAL..=Self::MAX_INTERVAL).contains(&interval) {
            return Err(Invalid::new(
                "interval",
                format!(
                    "expected 0.1 to 10 seconds, found {}",
                    interval.as_secs_f64()
                ),
            ));
        }
        if let Some(stale_after) = self.stale_after {
            if stale_after < interval {
                return Err(Invalid::new(
                    "stale_after",
                    format!(
                        "expected at least engine_metrics.interval ({} seconds), found {}",
                        interval.as_secs_f64(),
                        stale_after.as_secs_f64()
                    ),
                ));
            }
        }
        crate::forms::check::path("path", &self.path)
    }
}

/// An engine whose names were found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// vLLM.
    Vllm,
    /// SGLang.
    Sglang,
    /// Text Generation Inference.
    Tgi,
}

/// The names one engine exports its load under.
struct Names {
    engine: Engine,
    running: &'static [&'static str],
    waiting: &'static [&'static str],
    /// Usage fractions, the first one present being read.
    usage: &'static [&'static str],
    prefix_queries: &'static [&'static str],
    prefix_hits: &'static [&'static str],
}

const VLLM: Names = Names {
    engine: Engine::Vllm,
    running: &["vllm:num_requests_running"],
    waiting: &["vllm:num_requests_waiting"],
    usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    prefix_queries: &[
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_queries_total",
    ],
    prefix_hits: &["vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total"],
};

const SGLANG: Names = Names {
    engine: Engine::Sglang,
    running: &["sglang:num_running_reqs"],
    waiting: &["sglang:num_queue_reqs"],
    usage: &["sglang:token_usage"],
    prefix_queries: &[],
    prefix_hits: &[],
};

const TGI: Names = Names {
    engine: Engine::Tgi,
    running: &["tgi_batch_current_size"],
    waiting: &["tgi_queue_size"],
    usage: &[],
    prefix_queries: &[],
    prefix_hits: &[],
};

/// Prompt tokens looked up in the prefix cache and found there, since the engine started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixCache {
    /// Tokens looked up.
    pub queries: u64,
    /// Tokens found.
    pub hits: u64,
}

/// What one scrape said.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineReading {
    /// The engine whose names were read.
    pub engine: Engine,
    /// Requests in the running batch.
    pub running: u32,
    /// Requests waiting in the engine's queue.
    pub waiting: u32,
    /// KV-cache (or token) usage, 0..1, when the engine exports it.
    pub kv_usage: Option<f64>,
    /// Prefix-cache counters, when the engine exports them.
    pub prefix_cache: Option<PrefixCache>,
}

/// Why a scrape's text gave no reading.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The text is not Prometheus' text exposition format.
    #[error("not the Prometheus text format: {0}")]
    Syntax(String),
    /// None of the engine's running or waiting names appear.
    #[error("no known engine metrics")]
    Unrecognised,
}

/// Per name of interest: the sum of its samples and how many there were.
struct Found<'a> {
    metrics: &'a [Metric],
}

impl Found<'_> {
    /// Sum and count of the plain samples of the first of `names` that appears.
    fn first(&self, names: &[&str]) -> Option<(f64, usize)> {
        names.iter().find_map(|name| {
            let mut sum = 0.0;
            let mut count = 0;
            for metric in self.metrics.iter().filter(|m| m.name == *name) {
                for sample in &metric.samples {
                    if sample.value.value_type != ValueType::Sample {
                        continue;
                    }
                    if let Ok(value) = sample.value.value.parse::<f64>() {
                        if value.is_finite() {
                            sum += value;
                            count += 1;
                        }
                    }
                }
            }
            (count > 0).then_some((sum, count))
        })
    }

    fn has_any(&self, names: &Names) -> bool {
        self.first(names.running).is_some() || self.first(names.waiting).is_some()
    }

    fn reading(&self, names: &Names) -> Option<EngineReading> {
        let running = self.first(names.running);
        let waiting = self.first(names.waiting);
        if running.is_none() && waiting.is_none() {
            return None;
        }
        let count = |found: Option<(f64, usize)>| {
            found.map_or(0, |(sum, _)| {
                sum.round().clamp(0.0, f64::from(u32::MAX)) as u32
            })
        };
        let kv_usage = self
            .first(names.usage)
            .map(|(sum, count)| (sum / count as f64).clamp(0.0, 1.0));
        let total = |found: Option<(f64, usize)>| {
            found.map(|(sum, _)| sum.round().clamp(0.0, u64::MAX as f64) as u64)
        };
        let prefix_cache = match (
            total(self.first(names.prefix_queries)),
            total(self.first(names.prefix_hits)),
        ) {
            (Some(queries), Some(hits)) => Some(PrefixCache { queries, hits }),
            _ => None,
        };
        Some(EngineReading {
            engine: names.engine,
            running: count(running),
            waiting: count(waiting),
            kv_usage,
            prefix_cache,
        })
    }
}

/// Reads the load of the engine `kind` names (with [`EngineKind::Auto`], of the engine whose
/// names appear) from a metrics endpoint's text.
pub fn parse(text: &str, kind: EngineKind) -> Result<EngineReading, ParseError> {
    // Only the lines of the metrics read go to the parser, which builds every line it is given:
    // an engine's text of thousands of histogram series costs a scan, not their strings.
    let read = read_lines(text);
    if read.is_empty() {
        return Err(ParseError::Unrecognised);
    }
    let (metrics, error) = prom_text_format_parser::parse_scrape(&read);
    if metrics.is_empty() {
        if let Some(error) = error {
            return Err(ParseError::Syntax(format!("{error:?}")));
        }
    }
    let found = Found { metrics: &metrics };
    let names = match kind {
        EngineKind::Vllm => &VLLM,
        EngineKind::Sglang => &SGLANG,
        EngineKind::Tgi => &TGI,
        EngineKind::Off | EngineKind::Auto => [&VLLM, &SGLANG, &TGI]
            .into_iter()
            .find(|names| found.has_any(names))
            .ok_or(ParseError::Unrecognised)?,
    };
    found.reading(names).ok_or(ParseError::Unrecognised)
}

/// The lines of `text` about the metrics any engine's [`Names`] read: samples, `# TYPE` and
/// `# HELP` lines whose name starts with one of them (less a `_total`, so that a counter's
/// family and its samples both stay).
fn read_lines(text: &str) -> String {
    let stems: Vec<&str> = [&VLLM, &SGLANG, &TGI]
        .into_iter()
        .flat_map(|names| {
            [
                names.running,
                names.waiting,
                names.usage,
                names.prefix_queries,
                names.prefix_hits,
            ]
            .into_iter()
            .flatten()
            .map(|name| name.trim_end_matches("_total"))
        })
        .collect();
    let mut kept = String::new();
    for line in text.lines() {
        let name = match line.strip_prefix('#') {
            Some(comment) => comment.split_whitespace().nth(1).unwrap_or(""),
            None => line
                .split(|c: char| c == '{' || c.is_ascii_whitespace())
                .next()
                .unwrap_or(""),
        };
        if !name.is_empty() && stems.iter().any(|stem| name.starts_with(stem)) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    kept
}

/// The capacity in a TGI `GET /info` answer: its `max_concurrent_requests`, when positive.
pub fn parse_info(body: &[u8]) -> Option<u32> {
    #[derive(Deserialize)]
    struct Info {
        max_concurrent_requests: Option<u64>,
    }
    let info: Info = serde_json::from_slice(body).ok()?;
    info.max_concurrent_requests
        .filter(|&n| n > 0)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// What strategies read of a backend's engine: its last scrape, and how old it is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineSnapshot {
    /// Requests in the engine's running batch.
    pub running: u32,
    /// Requests waiting in the engine's queue.
    pub waiting: u32,
    /// KV-cache usage, 0..1, when the engine exports it.
    pub kv_usage: Option<f64>,
    /// Requests the engine takes at once, when it says (TGI's `/info`).
    pub max_concurrent: Option<u32>,
    /// The router's own requests in flight to the backend when the scrape finished: what of
    /// `running` is its own then. Compared with the count at the scrape, not the count now,
    /// the requests ended since are not taken for another client's work.
    pub in_flight_then: u32,
    /// Since the scrape the values come from.
    pub age: Duration,
}

/// No value stored in a `u64` cell.
const UNSET: u64 = u64::MAX;

/// A backend's latest engine load, written by the scraper and read by strategies without a
/// lock: the values of one scrape are stored under a sequence number (odd while a store is
/// under way), and a reader that saw it change reads again.
#[derive(Debug)]
pub struct EngineLoad {
    /// The time scrape times are counted from.
    born: Instant,
    sequence: AtomicU64,
    running: AtomicU32,
    waiting: AtomicU32,
    in_flight_then: AtomicU32,
    kv_bits: AtomicU64,
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
    /// Nanoseconds from `born` to the last good scrape, plus 1; 0: never scraped.
    scraped_at: AtomicU64,
    /// Nanoseconds after which the last scrape is not read.
    stale_after: AtomicU64,
    /// From TGI's `/info`; 0: unknown.
    max_concurrent: AtomicU32,
    /// Whether `/info` answered (asked again only once the values went stale).
    info_answered: AtomicBool,
    /// Whether an `/info` request is under way (one at a time).
    info_asking: AtomicBool,
}

impl Default for EngineLoad {
    fn default() -> Self {
        Self::new()
    }
}

/// The values of one consistent read.
struct Stored {
    running: u32,
    waiting: u32,
    in_flight_then: u32,
    kv_bits: u64,
    prefix_queries: u64,
    prefix_hits: u64,
    scraped_at: u64,
    stale_after: u64,
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(UNSET - 1)
}

impl EngineLoad {
    /// Nothing scraped yet.
    pub fn new() -> Self {
        Self {
            born: Instant::now(),
            sequence: AtomicU64::new(0),
            running: AtomicU32::new(0),
            waiting: AtomicU32::new(0),
            in_flight_then: AtomicU32::new(0),
            kv_bits: AtomicU64::new(UNSET),
            prefix_queries: AtomicU64::new(UNSET),
            prefix_hits: AtomicU64::new(UNSET),
            scraped_at: AtomicU64::new(0),
            stale_after: AtomicU64::new(0),
            max_concurrent: AtomicU32::new(0),
            info_answered: AtomicBool::new(false),
            info_asking: AtomicBool::new(false),
        }
    }

    /// Stores the reading of a scrape finished `at`, to be read until it is older than
    /// `stale_after`.
    pub fn record(
        &self,
        reading: &EngineReading,
        in_flight: usize,
        at: Instant,
        stale_after: Duration,
    ) {
        // Writers take turns: the sequence goes odd for the store, even again after it.
        let mut current = self.sequence.load(Ordering::SeqCst);
        loop {
            if current % 2 == 1 {
                std::hint::spin_loop();
                current = self.sequence.load(Ordering::SeqCst);
                continue;
            }
            match self.sequence.compare_exchange_weak(
                current,
                current + 1,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => break,
                Err(seen) => current = seen,
            }
        }
        self.running.store(reading.running, Ordering::SeqCst);
        self.waiting.store(reading.waiting, Ordering::SeqCst);
        self.in_flight_then.store(
            u32::try_from(in_flight).unwrap_or(u32::MAX),
            Ordering::SeqCst,
        );
        self.kv_bits.store(
            reading.kv_usage.map_or(UNSET, f64::to_bits),
            Ordering::SeqCst,
        );
        let (queries, hits) = reading
            .prefix_cache
            .map_or((UNSET, UNSET), |p| (p.queries, p.hits));
        self.prefix_queries.store(queries, Ordering::SeqCst);
        self.prefix_hits.store(hits, Ordering::SeqCst);
        let since_born = nanos(at.saturating_duration_since(self.born));
        self.scraped_at.store(since_born + 1, Ordering::SeqCst);
        self.stale_after.store(nanos(stale_after), Ordering::SeqCst);
        self.sequence.store(current + 2, Ordering::SeqCst);
    }

    fn read(&self) -> Stored {
        loop {
            let before = self.sequence.load(Ordering::SeqCst);
            if before % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let stored = Stored {
                running: self.running.load(Ordering::SeqCst),
                waiting: self.waiting.load(Ordering::SeqCst),
                in_flight_then: self.in_flight_then.load(Ordering::SeqCst),
                kv_bits: self.kv_bits.load(Ordering::SeqCst),
                prefix_queries: self.prefix_queries.load(Ordering::SeqCst),
                prefix_hits: self.prefix_hits.load(Ordering::SeqCst),
                scraped_at: self.scraped_at.load(Ordering::SeqCst),
                stale_after: self.stale_after.load(Ordering::SeqCst),
            };
            if self.sequence.load(Ordering::SeqCst) == before {
                return stored;
            }
        }
    }

    /// The age at `now` of a stored scrape, `None` if there is none or it is stale.
    fn fresh_age(&self, stored: &Stored, now: Instant) -> Option<Duration> {
        if stored.scraped_at == 0 {
            return None;
        }
        let at = self.born + Duration::from_nanos(stored.scraped_at - 1);
        let age = now.saturating_duration_since(at);
        (age <= Duration::from_nanos(stored.stale_after)).then_some(age)
    }

    /// The last scrape's values at `now`: `None` when the backend was never scraped, or its
    /// last good scrape is older than `stale_after`.
    pub fn snapshot(&self, now: Instant) -> Option<EngineSnapshot> {
        let stored = self.read();
        let age = self.fresh_age(&stored, now)?;
        Some(EngineSnapshot {
            running: stored.running,
            waiting: stored.waiting,
            kv_usage: (stored.kv_bits != UNSET).then(|| f64::from_bits(stored.kv_bits)),
            max_concurrent: self.stated_capacity(),
            in_flight_then: stored.in_flight_then,
            age,
        })
    }

    /// vLLM's prefix-cache counters from the last scrape at `now`, under the same staleness
    /// rule as [`EngineLoad::snapshot`].
    pub fn prefix_cache(&self, now: Instant) -> Option<PrefixCache> {
        let stored = self.read();
        self.fresh_age(&stored, now)?;
        (stored.prefix_queries != UNSET && stored.prefix_hits != UNSET).then_some(PrefixCache {
            queries: stored.prefix_queries,
            hits: stored.prefix_hits,
        })
    }

    /// Requests the engine takes at once, when it said (TGI's `/info`), while its scrapes are
    /// fresh: a stale engine's capacity is read no more than its other values (the router's own
    /// signals decide), and `/info` is asked again once scrapes come back.
    pub fn max_concurrent(&self, now: Instant) -> Option<u32> {
        // The stated capacity first: without one (no TGI, or metrics off) nothing else is read.
        let capacity = self.stated_capacity()?;
        self.fresh_age(&self.read(), now)?;
        Some(capacity)
    }

    fn stated_capacity(&self) -> Option<u32> {
        match self.max_concurrent.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }

    /// Whether `/info` still has to be asked: it has not answered yet, or the engine's values
    /// went stale since (a restarted engine may state another capacity).
    pub fn wants_info(&self, now: Instant) -> bool {
        !self.info_answered.load(Ordering::Relaxed) || self.fresh_age(&self.read(), now).is_none()
    }

    /// Notes `/info`'s answer: the capacity it gave, if any (none replaces an earlier one). It
    /// is asked again only once the values went stale.
    pub fn record_info(&self, max_concurrent: Option<u32>) {
        self.max_concurrent
            .store(max_concurrent.unwrap_or(0), Ordering::Relaxed);
        self.info_answered.store(true, Ordering::Relaxed);
        self.info_asking.store(false, Ordering::Relaxed);
    }

    /// Claims the one `/info` request under way: `false` when one is already.
    pub fn start_info(&self) -> bool {
        !self.info_asking.swap(true, Ordering::Relaxed)
    }

    /// The `/info` request under way failed or timed out: it may be asked again.
    pub fn info_not_read(&self) {
        self.info_asking.store(false, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM_TEXT: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 500.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7327e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
vllm:prefix_cache_hits_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.5
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
"#;

    /// An older vLLM: the usage under `gpu_cache_usage_perc`, counters named without `_total`
    /// in their `TYPE` line.
    const OLD_VLLM_TEXT: &str = r#"# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 1.0
vllm:num_requests_running{model_name="b"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 0.0
vllm:num_requests_waiting{model_name="b"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="a"} 0.9
vllm:gpu_cache_usage_perc{model_name="b"} 0.7
# HELP vllm:prefix_cache_queries Prefix cache queries.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries{model_name="a"} 10
# HELP vllm:prefix_cache_hits Prefix cache hits.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits{model_name="a"} 3
"#;

    const SGLANG_TEXT: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B",tp_rank="0"} 7.0
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B",tp_rank="1"} 5.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B",tp_rank="0"} 2.0
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B",tp_rank="1"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen2.5-7B",tp_rank="0"} 0.6
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen2.5-7B",tp_rank="1"} 0.4
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="Qwen/Qwen2.5-7B",tp_rank="0"} 812.3
"#;

    /// TGI exports through metrics-exporter-prometheus: `TYPE` lines, no `HELP`, summaries.
    const TGI_TEXT: &str = r#"# TYPE tgi_request_count counter
tgi_request_count 1520
# TYPE tgi_queue_size gauge
tgi_queue_size 6
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 32
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 15360
# TYPE tgi_request_duration summary
tgi_request_duration{quantile="0.5"} 1.25
tgi_request_duration{quantile="0.99"} 8.5
tgi_request_duration_sum 2100.5
tgi_request_duration_count 1520
"#;

    #[test]
    fn vllm_sums_label_sets_and_averages_usage() {
        let reading = parse(VLLM_TEXT, EngineKind::Vllm).unwrap();
        assert_eq!(
            reading,
            EngineReading {
                engine: Engine::Vllm,
                running: 5,
                waiting: 5,
                kv_usage: Some(0.375),
                prefix_cache: Some(PrefixCache {
                    queries: 1500,
                    hits: 500
                }),
            }
        );
    }

    #[test]
    fn older_vllm_names_are_read() {
        let reading = parse(OLD_VLLM_TEXT, EngineKind::Vllm).unwrap();
        assert_eq!((reading.running, reading.waiting), (2, 2));
        assert!((reading.kv_usage.unwrap() - 0.8).abs() < 1e-9);
        assert_eq!(
            reading.prefix_cache,
            Some(PrefixCache {
                queries: 10,
                hits: 3
            })
        );
    }

    #[test]
    fn sglang_is_read() {
        let reading = parse(SGLANG_TEXT, EngineKind::Sglang).unwrap();
        assert_eq!(reading.engine, Engine::Sglang);
        assert_eq!((reading.running, reading.waiting), (12, 2));
        assert!((reading.kv_usage.unwrap() - 0.5).abs() < 1e-9);
        assert_eq!(reading.prefix_cache, None);
    }

    #[test]
    fn tgi_is_read() {
        let reading = parse(TGI_TEXT, EngineKind::Tgi).unwrap();
        assert_eq!(
            reading,
            EngineReading {
                engine: Engine::Tgi,
                running: 32,
                waiting: 6,
                kv_usage: None,
                prefix_cache: None,
            }
        );
    }

    #[test]
    fn auto_tells_the_engine_by_its_names() {
        for (text, engine) in [
            (VLLM_TEXT, Engine::Vllm),
            (OLD_VLLM_TEXT, Engine::Vllm),
            (SGLANG_TEXT, Engine::Sglang),
            (TGI_TEXT, Engine::Tgi),
        ] {
            assert_eq!(parse(text, EngineKind::Auto).unwrap().engine, engine);
        }
        let other = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n";
        assert_eq!(
            parse(other, EngineKind::Auto),
            Err(ParseError::Unrecognised)
        );
    }

    #[test]
    fn a_named_engine_reads_only_its_own_names() {
        assert_eq!(
            parse(SGLANG_TEXT, EngineKind::Vllm),
            Err(ParseError::Unrecognised)
        );
        assert_eq!(
            parse(VLLM_TEXT, EngineKind::Tgi),
            Err(ParseError::Unrecognised)
        );
    }

    #[test]
    fn text_that_is_not_the_exposition_format_is_refused() {
        // No line names a metric read: not read further.
        assert_eq!(
            parse("<html>502 Bad Gateway</html>", EngineKind::Auto),
            Err(ParseError::Unrecognised)
        );
        assert!(parse("", EngineKind::Auto).is_err());
        // A line of a metric read that is not the format.
        assert!(matches!(
            parse("vllm:num_requests_running{ 3\n", EngineKind::Auto),
            Err(ParseError::Syntax(_))
        ));
    }

    #[test]
    fn the_simulator_text_reads_as_vllm() {
        // The bench simulator's `/metrics` (benches/lab/sim.rs): vLLM's and TGI's names at once.
        let text = "# HELP vllm:num_requests_running Requests in the batch (prefill or decode).\n\
             # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"sim\"} 3\n\
             # HELP vllm:num_requests_waiting Requests waiting.\n# TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{model_name=\"sim\"} 1\n\
             # HELP vllm:kv_cache_usage_perc Usage.\n# TYPE vllm:kv_cache_usage_perc gauge\n\
             vllm:kv_cache_usage_perc{model_name=\"sim\"} 0.1875\n\
             # HELP tgi_queue_size Requests waiting.\n# TYPE tgi_queue_size gauge\ntgi_queue_size 1\n\
             # HELP tgi_batch_current_size Requests in the batch.\n# TYPE tgi_batch_current_size gauge\n\
             tgi_batch_current_size 3\n";
        let reading = parse(text, EngineKind::Auto).unwrap();
        assert_eq!(reading.engine, Engine::Vllm);
        assert_eq!((reading.running, reading.waiting), (3, 1));
        assert_eq!(reading.kv_usage, Some(0.1875));
        assert_eq!(parse(text, EngineKind::Tgi).unwrap().running, 3);
    }

    #[test]
    fn tgi_info_gives_the_capacity() {
        let info = br#"{"model_id":"bigscience/bloom-560m","max_concurrent_requests":128,"max_input_tokens":1024}"#;
        assert_eq!(parse_info(info), Some(128));
        assert_eq!(parse_info(br#"{"model_id":"x"}"#), None);
        assert_eq!(parse_info(br#"{"max_concurrent_requests":0}"#), None);
        assert_eq!(parse_info(b"not json"), None);
    }

    #[tokio::test(start_paused = true)]
    async fn values_are_read_until_they_are_stale() {
        let load = EngineLoad::new();
        assert_eq!(load.snapshot(Instant::now()), None);
        let reading = parse(VLLM_TEXT, EngineKind::Vllm).unwrap();
        let stale_after = Duration::from_millis(1500);
        load.record(&reading, 3, Instant::now(), stale_after);
        tokio::time::advance(Duration::from_millis(400)).await;
        let snapshot = load.snapshot(Instant::now()).unwrap();
        assert_eq!(
            snapshot,
            EngineSnapshot {
                running: 5,
                waiting: 5,
                kv_usage: Some(0.375),
                max_concurrent: None,
                in_flight_then: 3,
                age: Duration::from_millis(400),
            }
        );
        assert_eq!(
            load.prefix_cache(Instant::now()),
            Some(PrefixCache {
                queries: 1500,
                hits: 500
            })
        );
        tokio::time::advance(Duration::from_millis(1100)).await;
        assert!(load.snapshot(Instant::now()).is_some(), "at the bound");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(load.snapshot(Instant::now()), None);
        assert_eq!(load.prefix_cache(Instant::now()), None);
        // A new scrape makes it fresh again.
        load.record(&reading, 0, Instant::now(), stale_after);
        assert_eq!(
            load.snapshot(Instant::now()).map(|s| s.age),
            Some(Duration::ZERO)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn info_is_asked_until_it_answers_and_read_while_fresh() {
        let load = EngineLoad::new();
        let stale_after = Duration::from_secs(2);
        let reading = parse(TGI_TEXT, EngineKind::Tgi).unwrap();
        load.record(&reading, 0, Instant::now(), stale_after);
        assert!(load.wants_info(Instant::now()));
        assert_eq!(load.max_concurrent(Instant::now()), None);
        load.record_info(Some(64));
        assert!(!load.wants_info(Instant::now()));
        assert_eq!(load.max_concurrent(Instant::now()), Some(64));
        // Stale: the capacity is read no more, and `/info` is wanted again.
        tokio::time::advance(stale_after + Duration::from_millis(1)).await;
        assert_eq!(load.max_concurrent(Instant::now()), None);
        assert!(load.wants_info(Instant::now()));
        load.record(&reading, 0, Instant::now(), stale_after);
        assert_eq!(load.max_concurrent(Instant::now()), Some(64));
    }

    #[test]
    fn parsing_a_large_vllm_text_is_cheap() {
        // A rough measure for the docs: a text of the size a busy vLLM serves (a few hundred
        // families and histogram buckets, about 100 KiB).
        let mut text = String::from(VLLM_TEXT);
        for family in 0..60 {
            text.push_str(&format!(
                "# HELP vllm:h{family}_seconds Histogram.\n# TYPE vllm:h{family}_seconds histogram\n"
            ));
            for le in [
                "0.001", "0.01", "0.1", "0.5", "1.0", "2.5", "5.0", "10.0", "+Inf",
            ] {
                text.push_str(&format!(
                    "vllm:h{family}_seconds_bucket{{engine=\"0\",le=\"{le}\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}} 12.0\n"
                ));
            }
            text.push_str(&format!(
                "vllm:h{family}_seconds_count{{engine=\"0\",model_name=\"m\"}} 12.0\nvllm:h{family}_seconds_sum{{engine=\"0\",model_name=\"m\"}} 1.5\n"
            ));
        }
        let started = std::time::Instant::now();
        let reading = parse(&text, EngineKind::Auto).unwrap();
        let took = started.elapsed();
        assert_eq!(reading.running, 5);
        eprintln!("parsed {} bytes in {took:?}", text.len());
        assert!(took < Duration::from_secs(1), "{took:?}");
    }
}
