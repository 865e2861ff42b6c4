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

use std::cell::OnceCell;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Header fields as a strategy reads them, whatever protocol carried the request. Names are
/// given in lowercase; values are the raw bytes, in the order they came.
pub trait HeaderLookup {
    /// The value of the first field named `name`.
    fn get(&self, name: &str) -> Option<&[u8]> {
        let mut first = None;
        self.visit(name, &mut |value| {
            first = Some(value);
            ControlFlow::Break(())
        });
        first
    }

    /// Calls `each` with the value of every field named `name`, in order, until it breaks.
    fn visit<'s>(&'s self, name: &str, each: &mut dyn FnMut(&'s [u8]) -> ControlFlow<()>);
}

impl dyn HeaderLookup + '_ {
    /// The first `Some` that `f` gives for the values of the fields named `name`, in order.
    pub fn find_map<'s, T>(
        &'s self,
        name: &str,
        mut f: impl FnMut(&'s [u8]) -> Option<T>,
    ) -> Option<T> {
        let mut found = None;
        self.visit(name, &mut |value| match f(value) {
            Some(item) => {
                found = Some(item);
                ControlFlow::Break(())
            }
            None => ControlFlow::Continue(()),
        });
        found
    }

    /// The values of every field named `name`, in order.
    pub fn get_all<'s>(&'s self, name: &str) -> Vec<&'s [u8]> {
        let mut values = Vec::new();
        self.visit(name, &mut |value| {
            values.push(value);
            ControlFlow::Continue(())
        });
        values
    }
}

/// The request as it arrived, for [`Strategy::request_key`]: method, target, header fields and
/// the first bytes of the body (the whole body when it is at most `retry_body_limit`, else what
/// was read by then). Built by the core; no type of the HTTP layer shows through.
pub struct RequestView<'a> {
    method: &'a Method,
    uri: &'a http::Uri,
    headers: &'a dyn HeaderLookup,
    body_prefix: &'a [u8],
    json: OnceCell<Option<serde_json::Value>>,
}

impl<'a> RequestView<'a> {
    /// A view of a request with these parts.
    pub fn new(
        method: &'a Method,
        uri: &'a http::Uri,
        headers: &'a dyn HeaderLookup,
        body_prefix: &'a [u8],
    ) -> Self {
        Self {
            method,
            uri,
            headers,
            body_prefix,
            json: OnceCell::new(),
        }
    }

    /// The request method.
    pub fn method(&self) -> &'a Method {
        self.method
    }

    /// The path of the request target, e.g. `/v1/chat/completions`.
    pub fn path(&self) -> &'a str {
        self.uri.path()
    }

    /// The request target as it came (path and query, or an absolute URI).
    pub fn uri(&self) -> &'a http::Uri {
        self.uri
    }

    /// The header fields.
    pub fn headers(&self) -> &'a dyn HeaderLookup {
        self.headers
    }

    /// The value of the first header field named `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&'a [u8]> {
        self.headers.get(name)
    }

    /// The start of the body (see the type's docs for how much of it).
    pub fn body_prefix(&self) -> &'a [u8] {
        self.body_prefix
    }

    /// The body parsed as JSON: parsed on the first call, at most once per request, and `None`
    /// when the body is not JSON or was longer than what the core read before routing.
    pub fn json(&self) -> Option<&serde_json::Value> {
        self.json
            .get_or_init(|| serde_json::from_slice(self.body_prefix).ok())
            .as_ref()
    }
}

impl std::fmt::Debug for RequestView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestView")
            .field("method", self.method)
            .field("uri", self.uri)
            .field("body_prefix", &self.body_prefix.len())
            .finish_non_exhaustive()
    }
}

/// The backends a strategy chooses from for one pick: the eligible set, less the backends to
/// exclude for this request (those it already tried, and one whose slow-start ramp declined
/// it). Nothing is copied: it borrows the set and the exclusions.
///
/// Indices are positions in the whole set ([`Candidates::all`]), so a strategy can precompute
/// per-position data in [`Strategy::on_backends_changed`] and keep using it while some are
/// excluded. A strategy returns the index of an eligible backend.
#[derive(Debug, Clone, Copy)]
pub struct Candidates<'a> {
    all: &'a [Arc<Backend>],
    tried: &'a [Arc<Backend>],
    declined: Option<&'a Backend>,
}

impl<'a> Candidates<'a> {
    /// Every backend of `all`, none excluded.
    pub fn new(all: &'a [Arc<Backend>]) -> Self {
        Self {
            all,
            tried: &[],
            declined: None,
        }
    }

    /// The same, with the backends of `tried` excluded.
    pub fn excluding(self, tried: &'a [Arc<Backend>]) -> Self {
        Self { tried, ..self }
    }

    /// The same, with `backend` excluded too.
    pub fn declining(self, backend: &'a Backend) -> Self {
        Self {
            declined: Some(backend),
            ..self
        }
    }

    /// The whole set, excluded backends included: what indices refer to.
    pub fn all(&self) -> &'a [Arc<Backend>] {
        self.all
    }

    /// Whether any backend is excluded from this pick.
    pub fn has_exclusions(&self) -> bool {
        !self.tried.is_empty() || self.declined.is_some()
    }

    /// Whether `backend` is excluded from this pick.
    pub fn is_excluded(&self, backend: &Backend) -> bool {
        self.declined.is_some_and(|d| std::ptr::eq(d, backend))
            || self.tried.iter().any(|t| std::ptr::eq(&**t, backend))
    }

    /// The backend at `index` if it is a candidate.
    pub fn get(&self, index: usize) -> Option<&'a Arc<Backend>> {
        self.all
            .get(index)
            .filter(|backend| !self.is_excluded(backend))
    }

    /// The candidates with their indices, in the order of the set.
    pub fn iter(&self) -> Iter<'a> {
        Iter {
            backends: self.all.iter().enumerate(),
            candidates: *self,
            exclusions: self.has_exclusions(),
        }
    }

    /// How many candidates there are.
    pub fn len(&self) -> usize {
        if self.has_exclusions() {
            self.iter().count()
        } else {
            self.all.len()
        }
    }

    /// Whether there is no candidate.
    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }

    /// The `n`-th candidate (from 0) with its index.
    pub fn nth(&self, n: usize) -> Option<(usize, &'a Arc<Backend>)> {
        if self.has_exclusions() {
            self.iter().nth(n)
        } else {
            self.all.get(n).map(|backend| (n, backend))
        }
    }
}

/// The iterator of [`Candidates::iter`]: without exclusions, the set as it is.
#[derive(Debug, Clone)]
pub struct Iter<'a> {
    backends: std::iter::Enumerate<std::slice::Iter<'a, Arc<Backend>>>,
    candidates: Candidates<'a>,
    exclusions: bool,
}

impl<'a> Iterator for Iter<'a> {
    type Item = (usize, &'a Arc<Backend>);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        if !self.exclusions {
            return self.backends.next();
        }
        let candidates = self.candidates;
        self.backends
            .find(|(_, backend)| !candidates.is_excluded(backend))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let (low, high) = self.backends.size_hint();
        (if self.exclusions { 0 } else { low }, high)
    }
}

impl<'a> From<&'a [Arc<Backend>]> for Candidates<'a> {
    fn from(all: &'a [Arc<Backend>]) -> Self {
        Self::new(all)
    }
}

impl<'a> From<&'a Vec<Arc<Backend>>> for Candidates<'a> {
    fn from(all: &'a Vec<Arc<Backend>>) -> Self {
        Self::new(all)
    }
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

    /// Chooses one of `candidates`: the index in [`Candidates::all`] of a backend that is not
    /// excluded, or `None` for "none right now".
    ///
    /// Called often and never across an await: keep it cheap and allocation-free. The core
    /// excludes the backends a retry already tried and one whose slow-start ramp declined the
    /// strategy's first choice; when a retry has tried every backend it passes them all again.
    fn pick(&self, request: &RequestInfo, candidates: Candidates<'_>) -> Option<usize>;

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

    /// Called after the eligible backend set changes (and when the strategy is installed);
    /// precompute rings or weights here.
    fn on_backends_changed(&self, _backends: &[Arc<Backend>]) {}

    /// Called when a request to `backend` finishes (not when the client cancelled it). Keep
    /// what is learned per backend in [`Backend::strategy_slot`].
    fn on_outcome(&self, _backend: &Backend, _outcome: &Outcome) {}
}

/// A process-unique number, for a strategy instance to stamp the values it keeps in
/// [`Backend::strategy_slot`]: a value stamped by another instance of the same type (before a
/// reload) or before a reset reads as "nothing learned".
pub fn next_generation() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
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
                    if let Some(index) = strategy.pick(&request, (&set).into()) {
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
                strategy.pick(&RequestInfo::default(), Candidates::new(&[])),
                None,
                "{}",
                entry.name
            );
        }
    }

    #[test]
    fn every_strategy_picks_outside_the_exclusions() {
        let request = RequestInfo::default();
        for entry in REGISTRY {
            let strategy = (entry.build)(&StrategyContext::default(), &empty()).unwrap();
            let set = backends(4);
            strategy.on_backends_changed(&set);
            let tried = [Arc::clone(&set[0]), Arc::clone(&set[2])];
            for _ in 0..50 {
                let candidates = Candidates::new(&set).excluding(&tried).declining(&set[3]);
                assert_eq!(
                    strategy.pick(&request, candidates),
                    Some(1),
                    "{}",
                    entry.name
                );
                let candidates = Candidates::new(&set).excluding(&tried);
                let index = strategy.pick(&request, candidates).unwrap();
                assert!(index == 1 || index == 3, "{} picked {index}", entry.name);
            }
        }
    }

    #[test]
    fn candidates_skip_the_exclusions_without_copying() {
        let set = backends(5);
        let all = Candidates::new(&set);
        assert_eq!((all.len(), all.nth(3).map(|(i, _)| i)), (5, Some(3)));
        assert!(!all.has_exclusions());
        let tried = [Arc::clone(&set[1]), Arc::clone(&set[3])];
        let some = all.excluding(&tried).declining(&set[0]);
        let left: Vec<usize> = some.iter().map(|(index, _)| index).collect();
        assert_eq!(left, [2, 4]);
        assert_eq!((some.len(), some.nth(1).map(|(i, _)| i)), (2, Some(4)));
        assert!(some.get(1).is_none() && some.get(2).is_some() && some.get(9).is_none());
        assert!(std::ptr::eq(some.all(), set.as_slice()));
        assert!(all.excluding(&set).is_empty());
    }

    struct Fields(Vec<(&'static str, &'static str)>);

    impl HeaderLookup for Fields {
        fn visit<'s>(&'s self, name: &str, each: &mut dyn FnMut(&'s [u8]) -> ControlFlow<()>) {
            for (field, value) in &self.0 {
                if *field == name && each(value.as_bytes()).is_break() {
                    return;
                }
            }
        }
    }

    #[test]
    fn the_request_view_reads_headers_and_parses_the_body_once() {
        let fields = Fields(vec![("a", "1"), ("b", "2"), ("a", "3")]);
        let uri = http::Uri::from_static("/v1/chat/completions?x=1");
        let body = br#"{"model": "m", "messages": []}"#;
        let view = RequestView::new(&Method::POST, &uri, &fields, body);
        assert_eq!(view.path(), "/v1/chat/completions");
        assert_eq!(view.method(), Method::POST);
        assert_eq!(view.header("a"), Some(&b"1"[..]));
        assert_eq!(view.headers().get_all("a"), [&b"1"[..], &b"3"[..]]);
        assert_eq!(view.header("c"), None);
        let json = view.json().unwrap();
        assert_eq!(json["model"], "m");
        assert!(std::ptr::eq(json, view.json().unwrap()), "parsed once");
        let cut = RequestView::new(&Method::POST, &uri, &fields, &body[..10]);
        assert!(cut.json().is_none());
    }
}
