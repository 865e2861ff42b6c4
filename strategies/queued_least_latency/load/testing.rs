//! Tests only: what the load score's rooms share in their tests — backends, first bytes,
//! outcomes and requests of given shapes, strategies with room — and the reads of what the
//! score learned about a backend.

use std::sync::Arc;

use tokio::time::Instant;

pub(super) use super::super::QueuedLeastLatency;
use super::super::{Mode, Params};
use super::ttfb::PRIOR_PREFILL_SECONDS_PER_TOKEN;
use super::{LoadScore, Rank, Slot};
use crate::backend::Backend;
use crate::prompt::Prompt;
use crate::strategies::{FirstByte, Outcome, RequestInfo, Strategy, StrategyContext};

impl QueuedLeastLatency {
    /// The load score this strategy ranks by.
    pub(super) fn load_score(&self) -> &LoadScore {
        match &self.mode {
            Mode::Load(load) => load,
            Mode::Ewma(_) => panic!("built with score = \"ewma\""),
        }
    }

    /// The current concurrency limit learned for `backend`.
    pub(super) fn limit(&self, backend: &Backend) -> f64 {
        self.load_score().limit(backend)
    }

    /// The limit for a request none of whose prompt `backend` holds: the learned limit, below a
    /// held ceiling.
    pub(super) fn limit_without_prefix(&self, backend: &Backend) -> f64 {
        self.load_score().limit_without_prefix(backend)
    }

    /// The prefill rate learned for `backend`, in seconds per uncached prompt token.
    pub(super) fn prefill_rate(&self, backend: &Backend) -> f64 {
        self.load_score().prefill_rate(backend)
    }

    /// The uncached prompt tokens a pick reads as still to prefill on `backend` now.
    pub(super) fn queued_prefill(&self, backend: &Backend) -> u64 {
        let rank = self.load_score().learned_rank(backend);
        LoadScore::queued_prefill(backend, rank, Instant::now())
    }
}

impl LoadScore {
    /// What a pick reads of `backend`'s learned state, if it has any in this generation.
    fn learned_rank(&self, backend: &Backend) -> Option<Rank> {
        let generation = self.state().generation;
        backend.strategy_slot::<Slot>().rank(generation)
    }

    /// The current concurrency limit learned for `backend`.
    fn limit(&self, backend: &Backend) -> f64 {
        self.learned_rank(backend)
            .map_or(self.initial_limit, |s| s.limit)
    }

    /// The limit for a request none of whose prompt `backend` holds: the learned limit, below a
    /// held [`Ceiling`].
    fn limit_without_prefix(&self, backend: &Backend) -> f64 {
        self.learned_rank(backend)
            .map_or(self.initial_limit, |s| s.limit.min(s.cap))
    }

    /// The prefill rate learned for `backend`, in seconds per uncached prompt token.
    fn prefill_rate(&self, backend: &Backend) -> f64 {
        self.learned_rank(backend)
            .map_or(PRIOR_PREFILL_SECONDS_PER_TOKEN, |s| s.prefill_rate)
    }
}

/// The load score with default parameters but `initial_limit`.
pub(super) fn with_initial_limit(initial_limit: f64) -> QueuedLeastLatency {
    let params = Params {
        initial_limit,
        ..Params::default()
    };
    QueuedLeastLatency::with(&params, &StrategyContext::default())
}

pub(super) fn streamed(latency: f64, ttfb: f64) -> Outcome {
    Outcome {
        latency,
        failed: false,
        first_byte: Some(ttfb),
        bytes: 4096,
        streamed: true,
        usage: None,
        in_flight: 1,
        prompt_tokens: 0,
        recall: Default::default(),
    }
}

/// A first byte of a request dispatched with `backend`'s requests in flight now.
pub(super) fn first_byte_on(
    backend: &Backend,
    seconds: f64,
    uncached_tokens: u64,
    queued_tokens: u64,
) -> FirstByte {
    FirstByte {
        in_flight: backend.in_flight(),
        ..first_byte(seconds, uncached_tokens, queued_tokens)
    }
}

pub(super) fn first_byte(seconds: f64, uncached_tokens: u64, queued_tokens: u64) -> FirstByte {
    FirstByte {
        in_flight: 1,
        seconds,
        streamed: true,
        uncached_tokens,
        prompt_tokens: uncached_tokens,
        recall: Default::default(),
        queued_tokens,
        dispatched_at: Instant::now(),
        past_limit: false,
    }
}

/// Puts `n` requests in flight on `backend`.
pub(super) fn busy(backend: &Backend, n: usize) {
    for _ in 0..n {
        backend.acquire();
    }
}

pub(super) fn backend(i: u32) -> Arc<Backend> {
    Arc::new(Backend::new(format!("10.0.6.{i}:80").parse().unwrap()))
}

/// A stream's first byte after `seconds`, its request dispatched now with `in_flight`
/// requests in flight.
pub(super) fn sent_with(in_flight: usize, seconds: f64) -> FirstByte {
    FirstByte {
        in_flight,
        ..first_byte(seconds, 0, 0)
    }
}

pub(super) fn chat(system: &str, user: &str) -> RequestInfo {
    let body = serde_json::json!({
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "max_tokens": 200,
    });
    RequestInfo {
        prompt: Prompt::of_body(body.to_string().as_bytes()).map(Arc::new),
        ..RequestInfo::default()
    }
}

/// Puts `n` requests of `output` expected tokens in flight on `backend`.
pub(super) fn working(backend: &Backend, n: usize, output: u64) {
    let work = crate::backend::InFlightWork { prefill: 0, output };
    for _ in 0..n {
        backend.acquire_work(&work);
    }
}

/// The load score with a limit of 64, every backend of `set` measured and having answered
/// three streams (ramp-up room for 15 in flight): limits and ramp-up stay out of the way.
pub(super) fn with_room(set: &[Arc<Backend>]) -> QueuedLeastLatency {
    let strategy = with_initial_limit(64.0);
    for replica in set {
        for _ in 0..3 {
            strategy.on_first_byte(replica, &first_byte_on(replica, 0.02, 0, 0));
        }
    }
    strategy
}

/// Takes `replica` (4 slots) through slow start to a limit of 10, then a fifth request
/// waits inside it for a slot: a ceiling at 5, with 4 in flight.
pub(super) fn find_a_ceiling(strategy: &QueuedLeastLatency, replica: &Backend) {
    busy(replica, 1);
    strategy.on_first_byte(replica, &sent_with(1, 0.02));
    busy(replica, 3);
    for _ in 0..3 {
        strategy.on_first_byte(replica, &sent_with(4, 0.02));
    }
    strategy.on_first_byte(replica, &sent_with(5, 0.2));
}

/// [`with_room`], each backend having answered 23 streams: ramp-up room for 115 in flight.
pub(super) fn with_room_for_many(set: &[Arc<Backend>]) -> QueuedLeastLatency {
    let strategy = with_room(set);
    for replica in set {
        for _ in 0..20 {
            strategy.on_first_byte(replica, &first_byte(0.02, 0, 0));
        }
    }
    strategy
}

/// Puts `n` requests of `output` expected tokens in flight on `backend` that have had
/// their first byte (streams decoding).
pub(super) fn decoding(backend: &Backend, n: usize, output: u64) {
    let work = crate::backend::InFlightWork { prefill: 0, output };
    for _ in 0..n {
        backend.acquire_work(&work);
        backend.prefilled(&work);
    }
}

/// A chat request of `tenant`'s long system prompt, which `backend`'s prefix index holds.
pub(super) fn tenant_chat_cached_on(backend: &Backend, tenant: &str) -> RequestInfo {
    let system = format!("You are the assistant of tenant {tenant}. ").repeat(400);
    let request = chat(&system, "hello");
    backend
        .prefixes()
        .record(&request.prompt.as_ref().unwrap().blocks);
    request
}

/// A chat request asking for `max_tokens` tokens.
pub(super) fn asking(max_tokens: u64) -> RequestInfo {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": max_tokens,
    });
    RequestInfo {
        prompt: Prompt::of_body(body.to_string().as_bytes()).map(Arc::new),
        ..RequestInfo::default()
    }
}

/// Two replicas with a limit of 4, having answered three streams each, whose answers took
/// `seconds[i]` for 4 KiB; the first is full of 200-token answers.
pub(super) fn first_full(
    seconds: [f64; 2],
    ids: [u32; 2],
) -> (QueuedLeastLatency, Vec<Arc<Backend>>) {
    let set = vec![backend(ids[0]), backend(ids[1])];
    let strategy = with_initial_limit(4.0);
    for (replica, seconds) in set.iter().zip(seconds) {
        for _ in 0..3 {
            strategy.on_first_byte(replica, &first_byte_on(replica, 0.02, 0, 0));
            strategy.on_outcome(replica, &streamed(seconds, 0.02));
        }
    }
    let limit = strategy.limit(&set[0]);
    assert!(limit <= 8.0, "{limit}");
    decoding(&set[0], limit.floor() as usize, 200);
    (strategy, set)
}

pub(super) fn chat_without_max_tokens() -> RequestInfo {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    });
    RequestInfo {
        prompt: Prompt::of_body(body.to_string().as_bytes()).map(Arc::new),
        ..RequestInfo::default()
    }
}
