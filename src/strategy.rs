//! The strategy contract: what the core asks of a routing strategy ([`Strategy`]); what it
//! hands it: the request as a neutral view ([`RequestView`], [`RequestInfo`]), the candidates
//! with what to exclude ([`Candidates`]), how a request ended ([`Outcome`]); what the strategy
//! answers ([`Pick`]: the backend, and whether it is past the strategy's own limit); and how a
//! strategy is built from its configuration ([`StrategyEntry`], [`Factory`], [`parse_params`]).
//! The strategies themselves and their registry are in `strategies/`, above the core: the core
//! knows this contract only.

use std::cell::OnceCell;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use figment::value::Value;
use http::Method;
use serde::{Deserialize, Serialize};

use crate::backend::Backend;
pub use crate::prefix_index::Recall;
use crate::prompt::Prompt;
pub use crate::usage::Usage;

/// What a strategy sees of the request it routes (kept while the request waits in the queue).
#[derive(Debug, Clone, Default)]
pub struct RequestInfo {
    /// The request method.
    pub method: Method,
    /// The hash of the request's affinity key, as derived by [`Strategy::request_key`].
    pub key: Option<u64>,
    /// The prompt of an LLM request, when the strategy reads prompts
    /// ([`Strategy::reads_prompts`]) and the body is one the core understands.
    pub prompt: Option<Arc<Prompt>>,
    /// Whether the router queue dispatches it ahead of a request queued before it (a higher
    /// band, or a tenant under its fair share): the queue's order put it first, so the strategy
    /// must not send it where it would wait inside a backend on purpose (a probe of a held
    /// limit). False for a request picked without waiting.
    pub ahead_of_older: bool,
}

impl RequestInfo {
    /// Output tokens the request is expected to generate: what it asks for (`max_tokens`,
    /// `max_new_tokens`), else [`DEFAULT_OUTPUT_TOKENS`]. The core counts this as the request's
    /// work while it is in flight ([`Backend::work_in_flight`]).
    pub fn expected_output_tokens(&self) -> u32 {
        self.prompt
            .as_ref()
            .and_then(|prompt| prompt.max_tokens)
            .unwrap_or(DEFAULT_OUTPUT_TOKENS)
            .max(1)
    }

    /// The prompt's tokens (0 without a prompt).
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt
            .as_ref()
            .map_or(0, |prompt| u64::from(prompt.tokens))
    }
}

/// The output a request is expected to generate when it does not say (and for requests that are
/// not LLM requests): every such request weighs the same.
pub const DEFAULT_OUTPUT_TOKENS: u32 = 256;

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
/// the first bytes of the body (the whole body when it is at most `retry.body_limit`, else what
/// was read by then). Built by the core; no type of the HTTP layer shows through.
pub struct RequestView<'a> {
    method: &'a Method,
    uri: &'a http::Uri,
    headers: &'a dyn HeaderLookup,
    body_prefix: &'a [u8],
    json: OnceCell<Option<serde_json::Value>>,
    prompt: OnceCell<Option<Arc<Prompt>>>,
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
            prompt: OnceCell::new(),
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

    /// The prompt of an OpenAI chat or completions request or a TGI request
    /// ([`Prompt::of_body`]): found on the first call, at most once per request; `None` for other
    /// bodies and for a body longer than what the core read before routing.
    pub fn prompt(&self) -> Option<&Arc<Prompt>> {
        self.prompt
            .get_or_init(|| Prompt::of_body(self.body_prefix).map(Arc::new))
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

/// The `[latency]` section: how latency is measured and judged, by the balancer (each backend's
/// EWMA, what a failure counts) and by strategies (handed to them in [`StrategyContext`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LatencyConfig {
    /// A busy backend whose EWMA latency is above this is not preferred; a failed attempt counts
    /// as a sample of at least this and holds its backend that long after dispatch.
    #[serde(with = "crate::forms::seconds")]
    pub threshold: Duration,
    /// EWMA smoothing factor in (0, 1]; higher reacts faster.
    pub ewma_alpha: f64,
}

impl Default for LatencyConfig {
    fn default() -> Self {
        Self {
            threshold: Duration::from_secs(3),
            ewma_alpha: 0.3,
        }
    }
}

impl LatencyConfig {
    /// Checks what the types leave open: `ewma_alpha` in (0, 1]. The error names the key within
    /// `[latency]`.
    pub fn check(&self) -> Result<(), crate::forms::Invalid> {
        let alpha = self.ewma_alpha;
        if !(alpha > 0.0 && alpha <= 1.0) {
            return Err(crate::forms::Invalid::new(
                "ewma_alpha",
                format!("expected a number in (0, 1], found {alpha}"),
            ));
        }
        Ok(())
    }
}

/// Core settings a strategy may read when it is built.
#[derive(Debug, Clone, Copy, Default)]
pub struct StrategyContext {
    /// The configured `[latency]` section.
    pub latency: LatencyConfig,
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
    /// What the answer said it used (OpenAI's `usage`, with the prompt tokens the engine found
    /// cached when it says), read for requests whose prompt the strategy reads
    /// ([`Strategy::reads_prompts`]); `None` when the answer had none.
    pub usage: Option<Usage>,
    /// Requests in flight on the backend when this one was dispatched, itself included.
    pub in_flight: usize,
    /// The request's prompt tokens as the router estimates them (0 without a prompt).
    pub prompt_tokens: u64,
    /// What the backend's prefix index held of the prompt when the request was dispatched, in
    /// blocks, with their ages (all 0 without a prompt).
    pub recall: Recall,
}

/// The first byte of an answer, as reported to [`Strategy::on_first_byte`].
#[derive(Debug, Clone, Copy)]
pub struct FirstByte {
    /// Seconds from dispatch to the first response body byte.
    pub seconds: f64,
    /// Whether the answer is a stream: then the first byte ends queueing and prefill; otherwise
    /// it comes with the whole answer.
    pub streamed: bool,
    /// Prompt tokens the backend was expected to prefill: the prompt less the prefix the core's
    /// index expected it to hold ([`Backend::prefixes`]).
    pub uncached_tokens: u64,
    /// The request's prompt tokens as the router estimates them (0 without a prompt).
    pub prompt_tokens: u64,
    /// What the backend's prefix index held of the prompt ([`Outcome::recall`]).
    pub recall: Recall,
    /// Uncached prompt tokens of other requests that were waiting for their first byte on the
    /// backend when this one was dispatched ([`Backend::prefill_in_flight`]).
    pub queued_tokens: u64,
    /// Requests in flight on the backend when this one was dispatched, itself included: a
    /// strategy that limits concurrency can tell a first byte that tested its limit (the
    /// request took the last slot it allowed) from one well within it.
    pub in_flight: usize,
    /// When the request was dispatched: a strategy that reacts to a late first byte can tell
    /// whether the request was sent before or after its last reaction.
    pub dispatched_at: tokio::time::Instant,
    /// Whether the pick that sent it was past the strategy's own limit ([`Pick::past_limit`]):
    /// its first byte was expected to wait for a slot.
    pub past_limit: bool,
}

/// A strategy's choice for one request ([`Strategy::pick`]): the backend, and what the core
/// carries with the request that goes there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    /// The backend's index in [`Candidates::all`].
    pub index: usize,
    /// Whether the backend is past the strategy's own concurrency limit, chosen on purpose (the
    /// request is expected to wait there for a slot). The core hands it back with the request's
    /// first byte ([`FirstByte::past_limit`]), so that its wait is not read as congestion.
    pub past_limit: bool,
}

impl Pick {
    /// The backend at `index`, within the strategy's limits.
    pub const fn at(index: usize) -> Self {
        Self {
            index,
            past_limit: false,
        }
    }

    /// The backend at `index`, past the strategy's own limit on purpose.
    pub const fn past_limit_at(index: usize) -> Self {
        Self {
            index,
            past_limit: true,
        }
    }
}

/// A routing strategy. See the module docs for the contract.
pub trait Strategy: Send + Sync + 'static {
    /// The registry name, e.g. `"round-robin"`.
    fn name(&self) -> &'static str;

    /// Chooses one of `candidates`: a [`Pick`] of a backend that is not excluded (its index in
    /// [`Candidates::all`], and whether it is past the strategy's own limit), or `None` for
    /// "none right now".
    ///
    /// Called often and never across an await: keep it cheap and allocation-free. The core
    /// excludes the backends a retry already tried and one whose slow-start ramp declined the
    /// strategy's first choice; when a retry has tried every backend it passes them all again.
    fn pick(&self, request: &RequestInfo, candidates: Candidates<'_>) -> Option<Pick>;

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

    /// Called when a request is sent to `backend`, with the uncached prompt tokens it adds there
    /// (`prefill`: its prompt past the longest prefix the backend's index held; 0 without a
    /// prompt). The backend's counters already include it ([`Backend::prefill_in_flight`]).
    fn on_dispatch(&self, _backend: &Backend, _prefill: u64) {}

    /// Called when the first body byte of an answer from `backend` arrives (before the answer
    /// ends: for a stream, seconds or minutes before [`Strategy::on_outcome`]).
    fn on_first_byte(&self, _backend: &Backend, _first_byte: &FirstByte) {}

    /// Whether the core should find each request's prompt for [`Strategy::pick`]
    /// ([`RequestInfo::prompt`]); the core then also records each routed prompt in the chosen
    /// backend's prefix index ([`Backend::prefixes`]). The core finds and records prompts for
    /// every strategy when `queue.tenant_header` is set (the fair shares' cost; the access
    /// log's `uncached_tokens`).
    fn reads_prompts(&self) -> bool {
        false
    }
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

/// Deserializes a strategy's params strictly; the type should use `deny_unknown_fields`.
pub fn parse_params<T: serde::de::DeserializeOwned>(params: &Value) -> Result<T, ParamsError> {
    params.deserialize().map_err(|error: figment::Error| {
        ParamsError::new(error.path.join("."), error.kind.to_string())
    })
}
