//! `queued-least-latency`: the backend expected to answer soonest, with bursts held in the
//! router queue.
//!
//! The core keeps, per backend, an EWMA of end-to-end latency (none until the first sample), the
//! requests in flight and the requests completed. Two scores are available (`score` param):
//!
//! **`score = "ewma"`: the reference implementation's rules.** A backend is a *candidate* when:
//!
//! 1. it was never measured and is idle: score 0 (probe it first);
//! 2. it was never measured and has a request in flight: not a candidate until that result is in;
//! 3. it was measured and is idle: score = its EWMA, even above the latency threshold;
//! 4. it was measured and is busy: a candidate only if its EWMA is below `latency.threshold`
//!    **and** its in-flight count is below `ramp_up_factor × completed`; score = its EWMA.
//!
//! **`score = "load"` (default): predicted latency with a learned concurrency limit.** End-to-end
//! latency mixes up a slow replica with a long answer, and a latency threshold is not a capacity
//! signal, so the load score replaces all four rules:
//!
//! - *Before it has answered*, a backend takes up to `initial_limit` requests, scored as a
//!   typical backend of the fleet (an LLM answer takes seconds: holding requests back until the
//!   first ends would leave it idle).
//! - *Cost*: seconds per KiB of response body, i.e. the replica's speed with the answer length
//!   factored out: an EWMA of latency divided by an EWMA of KiB (at least 1/8 KiB per answer),
//!   kept apart for streamed and whole answers, whose bytes per token differ by an order of
//!   magnitude (an event per token against plain text). A replica's cost is relative to the
//!   fleet's: for each kind, its cost over the mean cost of the replicas that served that kind
//!   (the geometric mean of the two ratios when it served both), so replicas compare on equal
//!   terms whatever mix of answers each happened to get. A failed attempt counts as
//!   `latency.threshold` for 1 KiB in both kinds, which keeps a failing replica last.
//! - *Concurrency limit*: learned from each stream's first byte as it arrives. The TTFB expected
//!   without congestion is the replica's fixed delay (baseline) plus the prefill of the uncached
//!   prompt tokens of the request and of those queued ahead at its learned prefill rate; within
//!   `ttfb_tolerance` × that + `ttfb_slack` (and with at least half of the limit in use) the limit
//!   grows by two per first byte until the first late one (slow start: it doubles every round,
//!   streams keeping their slots), by about √limit / 5 after; a later first byte lowers it in
//!   proportion (a gradient, as in Netflix's concurrency-limits), once per round: late first
//!   bytes of requests sent before the last decrease lower it no further. A late first byte
//!   of a request that took the last slot the limit allowed (or any clearly late one: twice
//!   the tolerated time) marks the count it was dispatched with as one too many, a *ceiling*:
//!   requests none of whose prompt the backend holds stay below it at once and for two rounds
//!   of on-time first bytes, then one probes it; a probe is judged strictly (on time within
//!   1.25 × expected plus 5 ms: a request that waited for a slot found none), and each
//!   failed probe doubles the hold (up to 32 rounds), so the replica's own queue is visited
//!   rarely rather than every few first bytes. A request whose prompt the backend holds in
//!   part may still go up to the limit: waiting in the engine that skips its prefill is worth
//!   more to it than the next free slot elsewhere. A ceiling never sends a request to a
//!   backend in a run of failures (as outlier ejection counts them): when the pick would
//!   choose one, it is made again among the others, their ceilings waived, and the failing
//!   backend gets the request only if none has room under its limit. The fixed delay is read
//!   off first bytes with little prefill; none is judged late before it is known (or 16 long
//!   prompts taught the prefill rate). It starts at `initial_limit`; an engine's stated
//!   capacity (TGI `max_concurrent_requests` through `[engine_metrics]`) replaces it. A
//!   measured backend is a candidate while one more request in flight stays within its limit
//!   (a limit of 4.4 admits 4: a fifth would wait inside the replica, out of the router
//!   queue's order) and its in-flight count is below `ramp_up_factor` × its first
//!   bytes (or completed requests, the larger). On a backend that never streamed, the limit is
//!   the load where its whole answers show the most throughput (`load/whole.rs`).
//! - *Prefix index*: each backend's is sized like what its engine keeps, from the `usage`
//!   answers report (`load/cache.rs`), and what it recorded past that size counts at the share
//!   the engine was found to keep of it; a full backend holding much more of the prompt still
//!   takes it when the prefill saved outweighs the wait for a slot (`load/pick.rs`).
//! - *Load guard*: for a request with a prompt, a backend that holds part of that prompt and more
//!   work in flight (expected output tokens, weighted by relative cost) than its share plus three
//!   typical requests' work, plus `load_bound` - 1 times the share up to three more, is skipped;
//!   so is any backend holding more requests than its equal share of those in flight plus two
//!   (three if it holds part of the prompt), plus `load_bound` - 1 times the share up to as
//!   many more (the count guard: an engine fills up by sequences and KV cache, and hundreds of
//!   sequences leave it no room for tens above its share); so is a backend whose queued
//!   prefill (uncached prompt tokens waiting for their first byte) is above
//!   `load_bound` × the candidates' mean with this prompt added, or above this prompt's tokens
//!   if more, unless it holds at least half of the prompt (the prefill guard); so is a backend
//!   holding more requests without a first byte than `load_bound` × the fewest any candidate
//!   holds + 8 (the first-byte guard: its engine queues them). The guards choose among the
//!   backends with room; when none with room is within them all, the count guard alone is
//!   kept, and when none is within that either, they are waived.
//! - *Score*: the expected time on the backend: relative cost × (work in flight + this
//!   request's) ÷ the typical request's × the fleet's latency per concurrency slot, plus the
//!   prefill of those queued there and of its uncached prompt tokens (less the prefix the
//!   backend's index holds) once for itself and once for each request in flight there, whose
//!   decode steps its prefill stalls, plus the engine's own waiting requests when engine
//!   metrics are on. See `docs/strategies.md` for a worked example.
//! - *Overflow*: after the pick, a request that states `max_tokens` of at least 1.2 × the
//!   typical output may go to a backend at least 1.5 × faster (relative cost) than the chosen
//!   one, even at its limit, when its expected end there is sooner: output tokens at that
//!   backend's speed, plus its queued and uncached prefill, plus on a full backend the work
//!   ahead per slot. Never a backend in a run of failures, without ramp-up room or with an
//!   engine-stated capacity; the late first byte of such a request does not lower the limit.
//!
//! When every replica is at its limit, requests wait in the router queue instead of in a
//! replica's own queue, so a replica added during a burst takes the waiting requests at once.
//!
//! The strategy holds one [`Mode`], the score configured with the state only that score keeps:
//! the reference rules are in `ewma.rs`, the load score in `load/` (its rooms: what is kept per
//! backend, the cost, the expected time to first byte, the limit, the engine's own numbers, the
//! score and the pick's fallback order); what the load score learns about a backend lives with
//! it ([`Backend::strategy_slot`]), the fleet's sums in the strategy.
//!
//! In both modes the lowest score wins; ties go to fewer requests in flight, then rotate. When no
//! backend is a candidate the request waits in the core's FIFO queue and is dispatched as soon as
//! one becomes a candidate (a request finishes, the backend set changes). Backends the core
//! excludes from a pick (a retry's tried ones) are skipped.
//!
//! The core records a failed attempt (connect error, I/O error, 5xx) as a latency sample of at
//! least the threshold and keeps the backend occupied for that long, so a dead or failing
//! replica is neither preferred nor retried at once.
//!
//! ```toml
//! [latency]
//! threshold = 3.0              # used by the core and by this strategy
//! [strategy]
//! name = "queued-least-latency"
//! [strategy.params]
//! score = "load"               # or "ewma" for the reference rules
//! ramp_up_factor = 5
//! ttfb_tolerance = 2.0
//! ttfb_slack = 0.02
//! initial_limit = 4
//! load_bound = 1.1
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use figment::value::Value;
use serde::Deserialize;

use super::{
    Candidates, FirstByte, LatencyConfig, Outcome, ParamsError, Pick, RequestInfo, Strategy,
    StrategyContext, StrategyEntry, parse_params,
};
use crate::backend::Backend;

mod ewma;
mod load;

/// Registry entry.
pub const ENTRY: StrategyEntry = StrategyEntry {
    name: "queued-least-latency",
    summary: "fastest replica with room (learned limits); bursts wait in the router queue",
    build,
};

/// The values of the `score` param: which score ranks the candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Score {
    /// The reference implementation's rules: lowest end-to-end EWMA under the threshold.
    Ewma,
    /// Predicted latency (size-normalised cost × load) within a learned concurrency limit.
    Load,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Params {
    score: Score,
    /// A busy backend may hold at most this many requests per completed request.
    ramp_up_factor: f64,
    /// TTFB up to this multiple of the baseline does not lower the limit (`load`).
    ttfb_tolerance: f64,
    /// Seconds of TTFB above the tolerated multiple that still do not lower the limit (`load`):
    /// micro-second noise on a fast backend is not congestion.
    ttfb_slack: f64,
    /// Concurrency limit of a backend before it has answered (`load`).
    initial_limit: f64,
    /// Highest concurrency limit (`load`).
    max_limit: f64,
    /// Load guard for requests with a prompt (`load`): a backend whose work in flight, this
    /// request's included and weighted by its relative cost, is above this multiple of its fair
    /// share is not a candidate (bounded load); the same multiple bounds its queued prefill.
    load_bound: f64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            score: Score::Load,
            ramp_up_factor: 5.0,
            ttfb_tolerance: 2.0,
            ttfb_slack: 0.02,
            initial_limit: 4.0,
            max_limit: 1000.0,
            load_bound: 1.1,
        }
    }
}

fn positive(field: &str, value: f64, minimum: f64) -> Result<(), ParamsError> {
    if value.is_finite() && value >= minimum && value > 0.0 {
        Ok(())
    } else {
        Err(ParamsError::new(
            field,
            format!("expected a number of at least {minimum} (and above 0), found {value}"),
        ))
    }
}

fn build(context: &StrategyContext, params: &Value) -> Result<Arc<dyn Strategy>, ParamsError> {
    let params: Params = parse_params(params)?;
    positive("ramp_up_factor", params.ramp_up_factor, 0.0)?;
    positive("ttfb_tolerance", params.ttfb_tolerance, 1.0)?;
    if !(params.ttfb_slack.is_finite() && params.ttfb_slack >= 0.0) {
        return Err(ParamsError::new(
            "ttfb_slack",
            format!(
                "expected zero or a positive number of seconds, found {}",
                params.ttfb_slack
            ),
        ));
    }
    positive("initial_limit", params.initial_limit, 1.0)?;
    positive("max_limit", params.max_limit, params.initial_limit)?;
    positive("load_bound", params.load_bound, 1.0)?;
    Ok(Arc::new(QueuedLeastLatency::with(&params, context)))
}

/// The queued-least-latency strategy. See the module docs for the rules.
#[derive(Debug)]
pub struct QueuedLeastLatency {
    /// The score configured, with its own state.
    mode: Mode,
    /// Ties between the best candidates rotate.
    ties: Ties,
}

/// The two scores (`score = "ewma" | "load"`), each with what only it keeps.
#[derive(Debug)]
enum Mode {
    /// The reference rules: rules 1–4 of the module docs.
    Ewma(ewma::EwmaScore),
    /// The load score: cost × load within a learned concurrency limit, its fleet sums and
    /// generation.
    Load(load::LoadScore),
}

impl QueuedLeastLatency {
    fn with(params: &Params, context: &StrategyContext) -> Self {
        let latency_threshold = context.latency.threshold.as_secs_f64();
        let ramp_up = RampUp(params.ramp_up_factor);
        let mode = match params.score {
            Score::Ewma => Mode::Ewma(ewma::EwmaScore::new(latency_threshold, ramp_up)),
            Score::Load => Mode::Load(load::LoadScore::new(params, latency_threshold, ramp_up)),
        };
        Self {
            mode,
            ties: Ties::default(),
        }
    }

    /// The reference rules (`score = "ewma"`) with the given threshold and ramp-up factor.
    pub fn ewma(latency_threshold: f64, ramp_up_factor: f64) -> Self {
        let params = Params {
            score: Score::Ewma,
            ramp_up_factor,
            ..Params::default()
        };
        Self::with(
            &params,
            &StrategyContext {
                latency: LatencyConfig {
                    threshold: Duration::from_secs_f64(latency_threshold),
                    ..LatencyConfig::default()
                },
            },
        )
    }

    /// The load score with default parameters.
    pub fn load(latency_threshold: f64) -> Self {
        Self::with(
            &Params::default(),
            &StrategyContext {
                latency: LatencyConfig {
                    threshold: Duration::from_secs_f64(latency_threshold),
                    ..LatencyConfig::default()
                },
            },
        )
    }
}

/// The `ramp_up_factor` param: a busy backend may hold at most this many requests per answered
/// one.
#[derive(Debug, Clone, Copy)]
struct RampUp(f64);

impl RampUp {
    /// Whether a backend with `busy` requests in flight has ramp-up room, having answered
    /// `answered` requests.
    fn has_room(self, answered: u64, busy: usize) -> bool {
        (busy as f64) < self.0 * answered as f64
    }
}

/// The choice among the best-scored candidates: ties go to fewer requests in flight, then
/// rotate.
#[derive(Debug, Default)]
struct Ties {
    rotation: AtomicUsize,
}

impl Ties {
    /// The candidate with the lowest score (`None`: not a candidate); ties go to fewer requests
    /// in flight, then rotate.
    fn best<F: Fn(&Backend) -> Option<f64>>(
        &self,
        candidates: Candidates<'_>,
        score: F,
    ) -> Option<usize> {
        // First pass: the best (score, in-flight), where it first occurs, and how many backends
        // share it.
        let mut best: Option<(f64, usize)> = None;
        let mut first = 0usize;
        let mut ties = 0usize;
        for (index, backend) in candidates.iter() {
            let Some(score) = score(backend) else {
                continue;
            };
            let key = (score, backend.in_flight());
            match best {
                Some(current) if key > current => {}
                Some(current) if key == current => ties += 1,
                _ => {
                    best = Some(key);
                    first = index;
                    ties = 1;
                }
            }
        }
        let best = best?;
        if ties == 1 {
            return Some(first);
        }
        // Second pass: rotate among the tied backends.
        let mut skip = self.rotation.fetch_add(1, Ordering::Relaxed) % ties;
        candidates
            .iter()
            .find(|(_, backend)| {
                let tied = score(backend).is_some_and(|score| (score, backend.in_flight()) == best);
                if tied {
                    if skip == 0 {
                        return true;
                    }
                    skip -= 1;
                }
                false
            })
            .map(|(index, _)| index)
    }
}

impl Strategy for QueuedLeastLatency {
    fn name(&self) -> &'static str {
        ENTRY.name
    }

    fn pick(&self, request: &RequestInfo, candidates: Candidates<'_>) -> Option<Pick> {
        match &self.mode {
            Mode::Ewma(ewma) => self
                .ties
                .best(candidates, |backend| ewma.score(backend))
                .map(Pick::at),
            Mode::Load(load) => load.pick(request, candidates, &self.ties),
        }
    }

    fn on_outcome(&self, backend: &Backend, outcome: &Outcome) {
        if let Mode::Load(load) = &self.mode {
            load.learn(backend, outcome);
        }
    }

    fn on_dispatch(&self, backend: &Backend, prefill: u64) {
        if let Mode::Load(load) = &self.mode {
            load.dispatched(backend, prefill);
        }
    }

    fn on_first_byte(&self, backend: &Backend, first_byte: &FirstByte) {
        if let Mode::Load(load) = &self.mode {
            load.learn_first_byte(backend, first_byte);
        }
    }

    fn reads_prompts(&self) -> bool {
        matches!(self.mode, Mode::Load(_))
    }

    fn on_backends_changed(&self, backends: &[Arc<Backend>]) {
        if let Mode::Load(load) = &self.mode {
            load.backends_changed(backends);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ramp_up_factor_must_be_positive() {
        let mut dict = figment::value::Dict::new();
        dict.insert("ramp_up_factor".into(), Value::from(0));
        let error = build(&StrategyContext::default(), &Value::from(dict))
            .err()
            .unwrap();
        assert_eq!(error.field, "ramp_up_factor");
    }

    #[test]
    fn the_score_param_selects_the_mode() {
        let built = |score: &str| {
            let mut dict = figment::value::Dict::new();
            dict.insert("score".into(), Value::from(score));
            build(&StrategyContext::default(), &Value::from(dict))
        };
        // The load score reads prompts; the reference rules do not.
        assert!(built("load").unwrap().reads_prompts());
        assert!(!built("ewma").unwrap().reads_prompts());
        assert!(
            build(
                &StrategyContext::default(),
                &Value::from(figment::value::Dict::new())
            )
            .unwrap()
            .reads_prompts(),
            "load is the default"
        );
        assert_eq!(built("latency").err().unwrap().field, "score");
    }

    #[test]
    fn backends_excluded_from_the_pick_are_skipped() {
        let strategy = QueuedLeastLatency::ewma(3.0, 5.0);
        let set: Vec<_> = (0..3)
            .map(|i| Arc::new(Backend::new(format!("10.0.3.{i}:80").parse().unwrap())))
            .collect();
        for (backend, latency) in set.iter().zip([0.1, 0.2, 0.3]) {
            backend.record_latency(latency, 1.0);
        }
        let request = RequestInfo::default();
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
        let tried = [Arc::clone(&set[0])];
        let candidates = Candidates::new(&set).excluding(&tried);
        assert_eq!(strategy.pick(&request, candidates), Some(Pick::at(1)));
        let candidates = candidates.declining(&set[1]);
        assert_eq!(strategy.pick(&request, candidates), Some(Pick::at(2)));
    }
}
