//! Routing strategies and their registry.
//!
//! A strategy only chooses: given the request and the current backends (with the statistics the
//! core keeps for them), it returns the index of the one to use, or `None` for "none right now".
//! It does no I/O, never sleeps and never queues; the core owns the queue, in-flight counting,
//! outcome measurement, timeouts and metrics.
//!
//! # Adding a strategy
//!
//! Write one file in this folder that exposes a [`StrategyEntry`] constant, declare the module
//! below and add one line to [`REGISTRY`]. The factory receives the `[strategy.params]` table,
//! deserializes it strictly (`#[serde(deny_unknown_fields)]`) and validates it. See
//! `docs/adding-a-strategy.md`.

use std::sync::Arc;

use figment::value::Value;
use http::Method;

pub use queued_least_latency::QueuedLeastLatency;
pub use round_robin::RoundRobin;

use crate::backend::Backend;

mod affinity;
mod p2c_peak_ewma;
mod queued_least_latency;
mod round_robin;

/// Every registered strategy. The config name maps to its factory here and nowhere else.
pub const REGISTRY: &[StrategyEntry] = &[
    queued_least_latency::ENTRY,
    round_robin::ENTRY,
    p2c_peak_ewma::ENTRY,
    affinity::ENTRY,
];

/// The strategy used when the configuration names none.
pub const DEFAULT_STRATEGY: &str = queued_least_latency::ENTRY.name;

/// What a strategy sees of the request it routes (kept while the request waits in the queue).
#[derive(Debug, Clone)]
pub struct RequestInfo {
    /// The request method.
    pub method: Method,
    /// The hash of the request's affinity key, as derived by [`Strategy::request_key`].
    pub key: Option<u64>,
}

impl Default for RequestInfo {
    fn default() -> Self {
        Self {
            method: Method::GET,
            key: None,
        }
    }
}

/// The request as it arrived, for [`Strategy::request_key`]: head and the first bytes of the
/// body (the whole body when it is at most `retry_body_limit`, else what was read by then).
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// The request method.
    pub method: &'a Method,
    /// The request target.
    pub uri: &'a http::Uri,
    /// The request's header fields.
    pub fields: crate::h1::Fields<'a>,
    /// The start of the body.
    pub body_prefix: &'a [u8],
}

/// Core settings a strategy may read when it is built.
#[derive(Debug, Clone, Copy)]
pub struct StrategyContext {
    /// Seconds; the configured latency threshold.
    pub latency_threshold: f64,
    /// The configured EWMA smoothing factor.
    pub ewma_alpha: f64,
}

impl Default for StrategyContext {
    fn default() -> Self {
        Self {
            latency_threshold: 3.0,
            ewma_alpha: 0.3,
        }
    }
}

/// How a finished request ended, as reported to [`Strategy::on_outcome`].
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    /// Seconds from dispatch to the end of the response (or the failure).
    pub latency: f64,
    /// Whether the attempt failed (connect, I/O or timeout error, a 5xx or a 429 answer).
    pub failed: bool,
    /// Seconds from dispatch to the first response body byte, if one arrived.
    pub first_byte: Option<f64>,
    /// Response body bytes relayed.
    pub bytes: u64,
    /// Whether the answer was a stream (`text/event-stream`): its first byte then marks the end
    /// of queueing and prefill, not the whole answer.
    pub streamed: bool,
}

/// A routing strategy. See the module docs for the contract.
pub trait Strategy: Send + Sync + 'static {
    /// The registry name, e.g. `"round-robin"`.
    fn name(&self) -> &'static str;

    /// Chooses one of `candidates` (an index into it) or `None` for "none right now".
    ///
    /// Called often and never across an await: keep it cheap and allocation-free.
    fn pick(&self, request: &RequestInfo, candidates: &[Arc<Backend>]) -> Option<usize>;

    /// Derives the request's affinity key (hashed), once, before the request is admitted.
    /// Strategies that do not route by key keep the default.
    fn request_key(&self, _request: &RequestView<'_>) -> Option<u64> {
        None
    }

    /// Whether a request that gets `None` waits in the core queue (`true`) or is answered 503 at
    /// once (`false`).
    fn queues_when_unavailable(&self) -> bool {
        true
    }

    /// Called after the backend set is replaced; precompute rings or weights here.
    fn on_backends_changed(&self, _backends: &[Arc<Backend>]) {}

    /// Called when a request to `backend` finishes (not when the client cancelled it).
    fn on_outcome(&self, _backend: &Backend, _outcome: &Outcome) {}
}

/// Builds a strategy from the core context and its `[strategy.params]` table.
pub type Factory = fn(&StrategyContext, &Value) -> Result<Arc<dyn Strategy>, ParamsError>;

/// A strategy parameter that is missing, unknown or out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ParamsError {
    /// The parameter's name (dotted if nested); empty for the table as a whole.
    pub field: String,
    /// What is wrong and what was expected.
    pub message: String,
}

impl ParamsError {
    /// An error about `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// One line of the registry.
#[derive(Clone, Copy)]
pub struct StrategyEntry {
    /// The config name.
    pub name: &'static str,
    /// One sentence for `--help` and the docs.
    pub summary: &'static str,
    /// Builds the strategy from its params.
    pub build: Factory,
}

impl std::fmt::Debug for StrategyEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StrategyEntry")
            .field("name", &self.name)
            .finish()
    }
}

/// The registry entry called `name`.
pub fn find(name: &str) -> Option<&'static StrategyEntry> {
    REGISTRY.iter().find(|entry| entry.name == name)
}

/// All registered names, in registry order.
pub fn names() -> Vec<&'static str> {
    REGISTRY.iter().map(|entry| entry.name).collect()
}

/// Deserializes a strategy's params strictly; the type should use `deny_unknown_fields`.
pub fn parse_params<T: serde::de::DeserializeOwned>(params: &Value) -> Result<T, ParamsError> {
    params.deserialize().map_err(|error: figment::Error| {
        ParamsError::new(error.path.join("."), error.kind.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use figment::value::Dict;

    fn empty() -> Value {
        Value::from(Dict::new())
    }

    fn backends(n: usize) -> Vec<Arc<Backend>> {
        (0..n)
            .map(|i| Arc::new(Backend::new(format!("10.0.0.{i}:80").parse().unwrap())))
            .collect()
    }

    #[test]
    fn registry_names_are_unique_and_include_the_default() {
        let names = names();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
        assert!(names.contains(&DEFAULT_STRATEGY));
    }

    #[test]
    fn every_strategy_accepts_empty_params_and_reports_its_name() {
        for entry in REGISTRY {
            let strategy = (entry.build)(&StrategyContext::default(), &empty())
                .unwrap_or_else(|e| panic!("{}: {e}", entry.name));
            assert_eq!(strategy.name(), entry.name);
        }
    }

    #[test]
    fn every_strategy_rejects_unknown_params() {
        for entry in REGISTRY {
            let mut dict = Dict::new();
            dict.insert("no_such_param".into(), Value::from(1));
            let error = (entry.build)(&StrategyContext::default(), &Value::from(dict))
                .err()
                .unwrap_or_else(|| panic!("{} accepted an unknown param", entry.name));
            assert!(
                error.to_string().contains("no_such_param"),
                "{}: {error}",
                entry.name
            );
        }
    }

    #[test]
    fn every_strategy_picks_within_the_candidates() {
        let request = RequestInfo::default();
        for entry in REGISTRY {
            let strategy = (entry.build)(&StrategyContext::default(), &empty()).unwrap();
            for n in 1..6 {
                let set = backends(n);
                strategy.on_backends_changed(&set);
                for _ in 0..50 {
                    if let Some(index) = strategy.pick(&request, &set) {
                        assert!(index < n, "{} picked {index} of {n}", entry.name);
                        // Keep the candidates busy so load-aware strategies move on.
                        set[index].acquire();
                    }
                }
            }
        }
    }

    #[test]
    fn every_strategy_returns_none_without_candidates() {
        for entry in REGISTRY {
            let strategy = (entry.build)(&StrategyContext::default(), &empty()).unwrap();
            strategy.on_backends_changed(&[]);
            assert_eq!(
                strategy.pick(&RequestInfo::default(), &[]),
                None,
                "{}",
                entry.name
            );
        }
    }
}
