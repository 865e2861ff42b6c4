//! Metrics: OpenTelemetry instruments exported in Prometheus text format.
//!
//! Names live in [`names`] and nowhere else. Per-backend series are observable instruments whose
//! callbacks read the current backend snapshot at scrape time, so a removed backend's series
//! disappear and the request path only bumps atomics on the backend. Process-wide counters are
//! created at start with 0 so they are visible before the first event.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arc_swap::ArcSwap;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter, MeterProvider};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use prometheus::{Encoder, TextEncoder};

use crate::backend::{Backend, ErrorKind, STATUS_CLASSES};

/// Metric names as exported. Counters get `_total` from the exporter; the instrument names below
/// are given without it and the exported names are listed in the constants' docs.
pub mod names {
    /// Gauge: requests waiting in the router queue.
    pub const QUEUE_DEPTH: &str = "custom_router_queue_depth";
    /// Gauge `{addr}`: EWMA latency in seconds of each backend that has one.
    pub const BACKEND_EWMA_LATENCY: &str = "custom_router_backend_ewma_latency_seconds";
    /// Gauge `{addr}`: requests in flight per backend.
    pub const BACKEND_INFLIGHT: &str = "custom_router_backend_inflight_requests";
    /// Counter `custom_router_requests_dispatched_total`: requests forwarded to a backend.
    pub const REQUESTS_DISPATCHED: &str = "custom_router_requests_dispatched";
    /// Counter `custom_router_requests_evicted_total`: oldest queued requests dropped (queue full).
    pub const REQUESTS_EVICTED: &str = "custom_router_requests_evicted";
    /// Counter `custom_router_requests_timeout_total`: queued requests dropped at the queue timeout.
    pub const REQUESTS_TIMEOUT: &str = "custom_router_requests_timeout";
    /// Counter `custom_router_requests_cancelled_total`: clients gone while their request was queued.
    pub const REQUESTS_CANCELLED: &str = "custom_router_requests_cancelled";
    /// Counter `custom_router_requests_rejected_total`: answered 503 at once (no backend to use).
    pub const REQUESTS_REJECTED: &str = "custom_router_requests_rejected";
    /// Counter `custom_router_requests_shed_total{band, reason}`: answered 503 at once because
    /// the request would not start before its deadline (`deadline`) or the queue held
    /// `queue.shed_ratio` times the requests in flight (`ratio`).
    pub const REQUESTS_SHED: &str = "custom_router_requests_shed";
    /// Counter `custom_router_backend_responses_total{addr,class}`: responses by status class.
    pub const BACKEND_RESPONSES: &str = "custom_router_backend_responses";
    /// Counter `custom_router_upstream_errors_total{addr,kind}`: failed upstream attempts.
    pub const UPSTREAM_ERRORS: &str = "custom_router_upstream_errors";
    /// Counter `custom_router_retries_total{reason}`: attempts sent again to another backend.
    pub const RETRIES: &str = "custom_router_retries";
    /// Counter `custom_router_retry_budget_exhausted_total`: failures not retried for lack of budget.
    pub const RETRY_BUDGET_EXHAUSTED: &str = "custom_router_retry_budget_exhausted";
    /// Counter `custom_router_ejections_total`: backends ejected after consecutive failures.
    pub const EJECTIONS: &str = "custom_router_ejections";
    /// Gauge `{addr}`: 1 while the backend is ejected, else 0.
    pub const BACKEND_EJECTED: &str = "custom_router_backend_ejected";
    /// Gauge `{addr}`: 1 while the backend is paused after a busy answer, else 0.
    pub const BACKEND_PAUSED: &str = "custom_router_backend_paused";
    /// Histogram: seconds from dispatch to the end of the response body.
    pub const REQUEST_DURATION: &str = "custom_router_request_duration_seconds";
    /// Histogram: seconds from dispatch to the first byte of the response body.
    pub const TIME_TO_FIRST_BYTE: &str = "custom_router_time_to_first_byte_seconds";
    /// Histogram: seconds queued requests spent waiting in the router queue (requests that went
    /// straight out are not recorded).
    pub const QUEUE_WAIT: &str = "custom_router_queue_wait_seconds";
    /// Counter: failed DNS lookups of configured backend names.
    pub const DNS_LOOKUP_FAILURES: &str = "custom_router_dns_lookup_failures";
    /// Counter: configuration reloads, by `result` (`ok`, `error`).
    pub const CONFIG_RELOADS: &str = "custom_router_config_reloads";
    /// Counter `custom_router_engine_scrapes_total{outcome}`: scrapes of backends' engine
    /// metrics (`[engine_metrics]`), by outcome.
    pub const ENGINE_SCRAPES: &str = "custom_router_engine_scrapes";
}

/// Why an attempt was sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryReason {
    /// The backend could not be reached: it saw nothing of the request.
    Connect,
    /// The backend answered 429, or 503 with `Retry-After`.
    Busy,
    /// Another failure of an idempotent request.
    Idempotent,
    /// A generation request's reset or 5xx head ([`crate::proxy::RetryConfig::generation_paths`]).
    Generation,
}

impl RetryReason {
    /// Every reason.
    pub const ALL: [RetryReason; 4] = [
        RetryReason::Connect,
        RetryReason::Busy,
        RetryReason::Idempotent,
        RetryReason::Generation,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RetryReason::Connect => "connect",
            RetryReason::Busy => "busy",
            RetryReason::Idempotent => "idempotent",
            RetryReason::Generation => "generation",
        }
    }
}

/// How a scrape of a backend's engine metrics ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScrapeOutcome {
    /// The text was read and the backend's values replaced.
    Ok,
    /// The backend could not be reached, or did not answer 2xx.
    Failed,
    /// The scrape took longer than `engine_metrics.timeout`.
    Timeout,
    /// The answer was not the exposition format, or named none of the engine's metrics.
    Invalid,
}

impl ScrapeOutcome {
    /// Every outcome.
    pub const ALL: [ScrapeOutcome; 4] = [
        ScrapeOutcome::Ok,
        ScrapeOutcome::Failed,
        ScrapeOutcome::Timeout,
        ScrapeOutcome::Invalid,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ScrapeOutcome::Ok => "ok",
            ScrapeOutcome::Failed => "failed",
            ScrapeOutcome::Timeout => "timeout",
            ScrapeOutcome::Invalid => "invalid",
        }
    }
}

/// Histogram boundaries in seconds, from a fast proxied call to a long generation.
const LATENCY_BOUNDARIES: [f64; 16] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// The shared backend snapshot: replaced whole on every set change.
pub type Snapshot = ArcSwap<Vec<Arc<Backend>>>;

/// The values of the `band` attribute of the queue's instruments.
const BANDS: [&str; 3] = ["high", "normal", "low"];

/// Series an instrument keeps before the SDK folds new ones into an overflow series: room for
/// the per-backend series (5 a backend in `backend_responses_total` and `upstream_errors_total`:
/// a `class` or `kind` each) of 4,096 backends, four times the most set-backends takes. Every
/// label value is bounded (a backend, a band, a class), so this is a ceiling, not a budget.
const SERIES_LIMIT: usize = 20_480;

/// The router's instruments and the registry they are exported from.
pub struct Metrics {
    registry: prometheus::Registry,
    provider: SdkMeterProvider,
    /// Requests forwarded to a backend.
    pub dispatched: Counter<u64>,
    /// Oldest queued requests evicted because the queue was full.
    pub evicted: Counter<u64>,
    /// Queued requests answered 503 at the queue timeout.
    pub timeout: Counter<u64>,
    /// Clients that went away while their request was queued.
    pub cancelled: Counter<u64>,
    /// Requests answered 503 at once because no backend could take them.
    pub rejected: Counter<u64>,
    /// Requests answered 503 at once because the queue ahead was too long.
    pub shed: Counter<u64>,
    /// Retries by reason.
    retries: Counter<u64>,
    /// Failures not retried because the retry budget was spent.
    pub retry_budget_exhausted: Counter<u64>,
    /// Backend ejections.
    pub ejections: Counter<u64>,
    /// Dispatch to end of response body.
    pub request_duration: Histogram<f64>,
    /// Dispatch to first response body byte.
    pub time_to_first_byte: Histogram<f64>,
    /// Time spent in the router queue.
    pub queue_wait: Histogram<f64>,
    /// DNS lookups of configured backend names that failed.
    pub dns_lookup_failures: Counter<u64>,
    /// Configuration reloads (SIGHUP), by result.
    config_reloads: Counter<u64>,
    /// Engine-metrics scrapes, by outcome.
    engine_scrapes: Counter<u64>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// Errors setting up the exporter.
#[derive(Debug, thiserror::Error)]
#[error("metrics exporter: {0}")]
pub struct MetricsError(String);

impl Metrics {
    /// Creates the instruments; observable ones read `backends` and `queue_depth` at scrape time.
    pub fn new(
        backends: Arc<Snapshot>,
        queue_depth: Arc<AtomicUsize>,
    ) -> Result<Self, MetricsError> {
        let registry = prometheus::Registry::new();
        let exporter = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .without_target_info()
            .scope_info_enabled(false)
            .without_units()
            .build()
            .map_err(|e| MetricsError(e.to_string()))?;
        // Every instrument keeps its series up to SERIES_LIMIT (the SDK's default, 2,000, would
        // fold the per-backend series of more than 400 backends into one overflow series).
        let provider = SdkMeterProvider::builder()
            .with_reader(exporter)
            .with_view(|_: &opentelemetry_sdk::metrics::Instrument| {
                opentelemetry_sdk::metrics::Stream::builder()
                    .with_cardinality_limit(SERIES_LIMIT)
                    .build()
                    .ok()
            })
            .build();
        let meter = provider.meter("custom-router");
        register_observers(&meter, backends, queue_depth);

        let counter = |name: &'static str, description: &'static str| {
            let counter = meter
                .u64_counter(name)
                .with_description(description)
                .build();
            counter.add(0, &[]);
            counter
        };
        // A counter with one label, every value of it exported from the start.
        let labelled = |name: &'static str,
                        description: &'static str,
                        label: &'static str,
                        values: &[&'static str]| {
            let counter = meter
                .u64_counter(name)
                .with_description(description)
                .build();
            for &value in values {
                counter.add(0, &[KeyValue::new(label, value)]);
            }
            counter
        };
        let histogram = |name: &'static str, description: &'static str| {
            meter
                .f64_histogram(name)
                .with_description(description)
                .with_boundaries(LATENCY_BOUNDARIES.to_vec())
                .build()
        };
        Ok(Self {
            dispatched: counter(
                names::REQUESTS_DISPATCHED,
                "Requests successfully forwarded",
            ),
            evicted: labelled(
                names::REQUESTS_EVICTED,
                "Requests dropped due to full queue, by priority band",
                "band",
                &BANDS,
            ),
            timeout: labelled(
                names::REQUESTS_TIMEOUT,
                "Requests dropped due to queue timeout, by priority band",
                "band",
                &BANDS,
            ),
            cancelled: labelled(
                names::REQUESTS_CANCELLED,
                "Requests whose client went away while queued, by priority band",
                "band",
                &BANDS,
            ),
            rejected: counter(
                names::REQUESTS_REJECTED,
                "Requests answered 503 at once because no backend could take them",
            ),
            shed: {
                let counter = meter
                    .u64_counter(names::REQUESTS_SHED)
                    .with_description(
                        "Requests answered 503 at once because they would not start before their deadline (reason deadline) or the queue held shed_ratio times the requests in flight (reason ratio), by priority band",
                    )
                    .build();
                for band in BANDS {
                    for reason in ["deadline", "ratio"] {
                        counter.add(
                            0,
                            &[KeyValue::new("band", band), KeyValue::new("reason", reason)],
                        );
                    }
                }
                counter
            },
            retries: labelled(
                names::RETRIES,
                "Attempts sent again to another backend, by reason",
                "reason",
                &RetryReason::ALL.map(RetryReason::as_str),
            ),
            retry_budget_exhausted: counter(
                names::RETRY_BUDGET_EXHAUSTED,
                "Failed attempts not retried because the retry budget was spent",
            ),
            ejections: counter(
                names::EJECTIONS,
                "Backends ejected after consecutive failures",
            ),
            request_duration: histogram(
                names::REQUEST_DURATION,
                "Seconds from dispatch to the end of the response body",
            ),
            time_to_first_byte: histogram(
                names::TIME_TO_FIRST_BYTE,
                "Seconds from dispatch to the first byte of the response body",
            ),
            queue_wait: histogram(
                names::QUEUE_WAIT,
                "Seconds queued requests waited in the router queue (requests dispatched at once are not recorded)",
            ),
            dns_lookup_failures: counter(
                names::DNS_LOOKUP_FAILURES,
                "DNS lookups of configured backend names that failed (the last good addresses were kept)",
            ),
            config_reloads: labelled(
                names::CONFIG_RELOADS,
                "Configuration reloads on SIGHUP, by result",
                "result",
                &["ok", "error"],
            ),
            engine_scrapes: labelled(
                names::ENGINE_SCRAPES,
                "Scrapes of the backends' engine metrics, by outcome",
                "outcome",
                &ScrapeOutcome::ALL.map(ScrapeOutcome::as_str),
            ),
            registry,
            provider,
        })
    }

    /// Counts one configuration reload.
    pub fn count_reload(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.config_reloads
            .add(1, &[KeyValue::new("result", result)]);
    }

    /// Counts one scrape of a backend's engine metrics.
    pub fn count_engine_scrape(&self, outcome: ScrapeOutcome) {
        self.engine_scrapes
            .add(1, &[KeyValue::new("outcome", outcome.as_str())]);
    }

    /// Counts one retry.
    pub fn count_retry(&self, reason: RetryReason) {
        self.retries
            .add(1, &[KeyValue::new("reason", reason.as_str())]);
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> Result<String, MetricsError> {
        let mut buffer = Vec::with_capacity(8 * 1024);
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .map_err(|e| MetricsError(e.to_string()))?;
        String::from_utf8(buffer).map_err(|e| MetricsError(e.to_string()))
    }
}

impl Drop for Metrics {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

fn addr_label(backend: &Backend) -> KeyValue {
    KeyValue::new("addr", backend.addr().as_str().to_owned())
}

fn register_observers(meter: &Meter, backends: Arc<Snapshot>, queue_depth: Arc<AtomicUsize>) {
    meter
        .u64_observable_gauge(names::QUEUE_DEPTH)
        .with_description("Current number of requests waiting in the queue")
        .with_callback(move |observer| {
            observer.observe(queue_depth.load(Ordering::Relaxed) as u64, &[]);
        })
        .build();

    let snapshot = Arc::clone(&backends);
    meter
        .f64_observable_gauge(names::BACKEND_EWMA_LATENCY)
        .with_description("EWMA latency per backend")
        .with_callback(move |observer| {
            for backend in snapshot.load().iter() {
                if let Some(ewma) = backend.ewma_latency() {
                    observer.observe(ewma, &[addr_label(backend)]);
                }
            }
        })
        .build();

    let snapshot = Arc::clone(&backends);
    meter
        .u64_observable_gauge(names::BACKEND_INFLIGHT)
        .with_description("Requests in flight per backend")
        .with_callback(move |observer| {
            for backend in snapshot.load().iter() {
                observer.observe(backend.in_flight() as u64, &[addr_label(backend)]);
            }
        })
        .build();

    let snapshot = Arc::clone(&backends);
    meter
        .u64_observable_gauge(names::BACKEND_EJECTED)
        .with_description("1 while the backend is ejected after consecutive failures")
        .with_callback(move |observer| {
            for backend in snapshot.load().iter() {
                let ejected = backend.availability().is_ejected();
                observer.observe(u64::from(ejected), &[addr_label(backend)]);
            }
        })
        .build();

    let snapshot = Arc::clone(&backends);
    meter
        .u64_observable_gauge(names::BACKEND_PAUSED)
        .with_description(
            "1 while the backend is paused after a busy answer (429, 503 with Retry-After)",
        )
        .with_callback(move |observer| {
            let now = tokio::time::Instant::now();
            for backend in snapshot.load().iter() {
                let paused = backend.availability().is_paused(now);
                observer.observe(u64::from(paused), &[addr_label(backend)]);
            }
        })
        .build();

    let snapshot = Arc::clone(&backends);
    meter
        .u64_observable_counter(names::BACKEND_RESPONSES)
        .with_description("Responses per backend by status class")
        .with_callback(move |observer| {
            for backend in snapshot.load().iter() {
                let addr = addr_label(backend);
                for (index, class) in STATUS_CLASSES.iter().enumerate() {
                    let attributes = [addr.clone(), KeyValue::new("class", *class)];
                    observer.observe(backend.responses(index), &attributes);
                }
            }
        })
        .build();

    meter
        .u64_observable_counter(names::UPSTREAM_ERRORS)
        .with_description("Failed upstream attempts per backend by kind")
        .with_callback(move |observer| {
            for backend in backends.load().iter() {
                let addr = addr_label(backend);
                for kind in ErrorKind::ALL {
                    let attributes = [addr.clone(), KeyValue::new("kind", kind.as_str())];
                    observer.observe(backend.errors(kind), &attributes);
                }
            }
        })
        .build();
}
