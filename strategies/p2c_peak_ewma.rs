//! `p2c-peak-ewma`: the cheaper of two backends drawn at random, where a backend's cost is its
//! peak-EWMA latency times its requests in flight plus one.
//!
//! # The idea
//!
//! *Power of two choices* (Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing",
//! 2001): instead of scanning every backend for the least loaded one, draw two distinct backends
//! uniformly at random and take the less loaded. The maximum load falls exponentially compared
//! with one random choice, and because different requests see different pairs, a burst is not
//! herded onto the single backend that looks best at that instant (the failure of "always the
//! lowest score" rules such as `queued-least-latency`'s EWMA mode).
//!
//! *Peak EWMA* (Finagle's `PeakEwma` load metric, used by Linkerd and by tower's
//! `tower/src/load/peak_ewma.rs`) estimates how long a new request would take:
//!
//! - a latency sample above the estimate replaces it at once (the *peak*), so a backend that
//!   slows down is avoided at once;
//! - a sample below it pulls the estimate down with weight `1 − exp(−elapsed / decay)`, where
//!   `elapsed` is the time since the previous sample: a time-based EWMA whose time constant is
//!   `decay` seconds (10 by default), independent of the request rate;
//! - between samples the estimate read by `pick` decays towards zero by `exp(−age / decay)`, so a
//!   backend that stopped being picked after one slow answer is tried again after a while
//!   (tower and Finagle decay the same way when they read the load).
//!
//! The cost is `estimate × (in_flight + 1)`: the expected time to drain the work already sent
//! there plus this request. It prefers fast replicas but moves on as soon as their queue grows,
//! which is the least-connections behaviour weighted by speed.
//!
//! # Details of this implementation
//!
//! - Samples are the core's outcome latencies (seconds from dispatch to the end of the response;
//!   a failure counts at least `latency_threshold`). A **failure** also counts at least twice the
//!   backend's current estimate, so a replica that answers errors quickly never looks fast even
//!   when normal answers take longer than the threshold; consecutive failures double it again
//!   (the core ejects the replica after `consecutive_failures`).
//! - A backend never measured is assumed as slow as the **mean current estimate of the measured
//!   ones** (or `default_rtt` seconds when that parameter is set): attractive while it has fewer
//!   requests in flight than its peers, never infinitely so. Tower defaults to 1 s and Linkerd to
//!   30 ms; a fixed value fits one workload only (30 ms would make a new LLM replica ~100 times
//!   cheaper than a measured one, so it would win every pair it is drawn in until its first
//!   answer, seconds later). With nothing measured yet all backends are equal and in-flight
//!   counts decide.
//! - Estimates are private to the strategy, keyed by [`Backend::id`], and dropped for backends
//!   that leave the eligible set. Time is [`tokio::time::Instant`], so tests pause it.
//! - The two candidates are drawn with a [`fastrand::Rng`], seeded by `seed` when given (tests,
//!   benchmarks) and from entropy otherwise. One candidate is picked as is.
//! - **Queueing**: `pick` returns `None` only when there is no candidate at all (no backends set
//!   yet, or every one ejected or paused after busy answers). Such a request waits in the core
//!   queue, like with `queued-least-latency`, and leaves when set-backends or the end of a pause
//!   brings a backend back (bounded by `queue_max_size` and `queue_timeout`). With candidates it
//!   always picks one: load is spread by cost, not held in the router.
//!
//! Use it for replicas of different or changing speeds with many concurrent requests; it needs
//! no tuning and keeps working when a replica slows down. It does not hold bursts back in the
//! router while backends exist.
//!
//! ```toml
//! [strategy]
//! name = "p2c-peak-ewma"
//!
//! [strategy.params]
//! decay = 10.0          # seconds; time constant of the peak EWMA
//! # default_rtt = 1.0   # seconds assumed for a never-measured backend (unset: mean of the others)
//! # seed = 42           # fixed random draws (tests, benchmarks)
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use figment::value::Value;
use serde::Deserialize;
use tokio::time::Instant;

use super::{
    Outcome, ParamsError, RequestInfo, Strategy, StrategyContext, StrategyEntry, parse_params,
};
use crate::backend::Backend;

/// Registry entry.
pub const ENTRY: StrategyEntry = StrategyEntry {
    name: "p2c-peak-ewma",
    summary: "the cheaper of two random backends, cost = peak-EWMA latency x (in-flight + 1)",
    build,
};

/// A failed request counts at least this many times the backend's current estimate.
const FAILURE_PENALTY: f64 = 2.0;

/// Seconds assumed for a never-measured backend when no backend is measured yet (any value
/// works: then every backend is unmeasured and in-flight counts decide).
const NOTHING_MEASURED_RTT: f64 = 1.0;

/// `[strategy.params]` of `p2c-peak-ewma`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Params {
    /// Seconds; time constant of the peak EWMA.
    decay: f64,
    /// Seconds assumed for a never-measured backend; unset: the mean of the measured ones.
    default_rtt: Option<f64>,
    /// Seed of the random draws; unset: from entropy.
    seed: Option<u64>,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            decay: 10.0,
            default_rtt: None,
            seed: None,
        }
    }
}

fn build(_context: &StrategyContext, params: &Value) -> Result<Arc<dyn Strategy>, ParamsError> {
    let params: Params = parse_params(params)?;
    positive("decay", params.decay)?;
    if let Some(default_rtt) = params.default_rtt {
        positive("default_rtt", default_rtt)?;
    }
    Ok(Arc::new(P2cPeakEwma::new(
        params.decay,
        params.default_rtt,
        params.seed,
    )))
}

fn positive(field: &str, value: f64) -> Result<(), ParamsError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ParamsError::new(
            field,
            format!("expected a positive number of seconds, found {value}"),
        ))
    }
}

/// The peak-EWMA latency estimate of one backend.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PeakEwma {
    /// Seconds, as of `updated`.
    estimate: f64,
    /// When the last sample arrived.
    updated: Instant,
}

impl PeakEwma {
    /// The estimate read at `now`: decayed towards zero since the last sample.
    fn value(&self, now: Instant, decay: f64) -> f64 {
        self.estimate * decay_weight(now.saturating_duration_since(self.updated), decay)
    }

    /// Folds in a sample: a peak replaces the estimate, a lower sample pulls it down by the
    /// weight of the time elapsed since the previous sample.
    fn observe(&mut self, sample: f64, now: Instant, decay: f64) {
        if sample > self.estimate {
            self.estimate = sample;
        } else {
            let weight = decay_weight(now.saturating_duration_since(self.updated), decay);
            self.estimate = self.estimate * weight + sample * (1.0 - weight);
        }
        self.updated = now;
    }
}

/// How much of an estimate survives `elapsed`: `exp(−elapsed / decay)`.
fn decay_weight(elapsed: Duration, decay: f64) -> f64 {
    (-elapsed.as_secs_f64() / decay).exp()
}

/// What the strategy keeps behind its lock.
#[derive(Debug)]
struct State {
    rng: fastrand::Rng,
    estimates: HashMap<u64, PeakEwma>,
}

impl State {
    /// Two distinct indices below `n` (n ≥ 2), uniformly.
    fn two_distinct(&mut self, n: usize) -> (usize, usize) {
        let first = self.rng.usize(..n);
        let second = self.rng.usize(..n - 1);
        (first, if second >= first { second + 1 } else { second })
    }

    /// The mean current estimate of the measured backends, if any.
    fn mean_estimate(&self, now: Instant, decay: f64) -> Option<f64> {
        let count = self.estimates.len();
        let sum: f64 = self.estimates.values().map(|e| e.value(now, decay)).sum();
        (count > 0).then(|| sum / count as f64)
    }
}

/// The p2c-peak-ewma strategy. See the module docs for the algorithm.
#[derive(Debug)]
pub struct P2cPeakEwma {
    decay: f64,
    default_rtt: Option<f64>,
    state: Mutex<State>,
}

impl P2cPeakEwma {
    /// A strategy with the given time constant (seconds), latency assumed for never-measured
    /// backends (`None`: the mean of the measured ones) and random seed (`None`: entropy).
    pub fn new(decay: f64, default_rtt: Option<f64>, seed: Option<u64>) -> Self {
        let rng = seed.map_or_else(fastrand::Rng::new, fastrand::Rng::with_seed);
        Self {
            decay,
            default_rtt,
            state: Mutex::new(State {
                rng,
                estimates: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Seconds a request to `backend` is expected to take at `now`, before load.
    fn latency(&self, state: &State, backend: &Backend, now: Instant) -> f64 {
        match state.estimates.get(&backend.id()) {
            Some(estimate) => estimate.value(now, self.decay),
            None => self.unmeasured_latency(state, now),
        }
    }

    fn unmeasured_latency(&self, state: &State, now: Instant) -> f64 {
        self.default_rtt
            .or_else(|| state.mean_estimate(now, self.decay))
            .unwrap_or(NOTHING_MEASURED_RTT)
    }

    /// The cost of sending one more request to `backend`: latency × (in-flight + 1).
    fn cost(&self, state: &State, backend: &Backend, now: Instant) -> f64 {
        self.latency(state, backend, now) * (backend.in_flight() + 1) as f64
    }
}

impl Strategy for P2cPeakEwma {
    fn name(&self) -> &'static str {
        ENTRY.name
    }

    fn pick(&self, _request: &RequestInfo, candidates: &[Arc<Backend>]) -> Option<usize> {
        if candidates.len() < 2 {
            return (!candidates.is_empty()).then_some(0);
        }
        let mut state = self.lock();
        let (first, second) = state.two_distinct(candidates.len());
        let now = Instant::now();
        let first_cost = self.cost(&state, &candidates[first], now);
        let second_cost = self.cost(&state, &candidates[second], now);
        Some(if second_cost < first_cost {
            second
        } else {
            first
        })
    }

    fn on_backends_changed(&self, backends: &[Arc<Backend>]) {
        self.lock()
            .estimates
            .retain(|id, _| backends.iter().any(|backend| backend.id() == *id));
    }

    fn on_outcome(&self, backend: &Backend, outcome: &Outcome) {
        if !outcome.latency.is_finite() {
            return;
        }
        let now = Instant::now();
        let mut state = self.lock();
        let sample = if outcome.failed {
            let current = self.latency(&state, backend, now);
            outcome.latency.max(FAILURE_PENALTY * current)
        } else {
            outcome.latency
        };
        state
            .estimates
            .entry(backend.id())
            .and_modify(|estimate| estimate.observe(sample, now, self.decay))
            .or_insert(PeakEwma {
                estimate: sample,
                updated: now,
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use figment::value::Dict;

    const DECAY: f64 = 10.0;

    fn backends(n: usize) -> Vec<Arc<Backend>> {
        (0..n)
            .map(|i| Arc::new(Backend::new(format!("10.0.1.{i}:80").parse().unwrap())))
            .collect()
    }

    fn strategy() -> P2cPeakEwma {
        P2cPeakEwma::new(DECAY, None, Some(7))
    }

    fn outcome(latency: f64, failed: bool) -> Outcome {
        Outcome {
            latency,
            failed,
            first_byte: None,
            bytes: 0,
            streamed: false,
        }
    }

    fn ok(strategy: &P2cPeakEwma, backend: &Backend, latency: f64) {
        strategy.on_outcome(backend, &outcome(latency, false));
    }

    fn estimate(strategy: &P2cPeakEwma, backend: &Backend) -> f64 {
        strategy.latency(&strategy.lock(), backend, Instant::now())
    }

    fn close(actual: f64, expected: f64) -> bool {
        (actual - expected).abs() < 1e-9
    }

    async fn advance(seconds: f64) {
        tokio::time::advance(Duration::from_secs_f64(seconds)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_peak_replaces_the_estimate_at_once() {
        let (strategy, set) = (strategy(), backends(1));
        ok(&strategy, &set[0], 1.0);
        ok(&strategy, &set[0], 4.0);
        assert_eq!(estimate(&strategy, &set[0]), 4.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lower_sample_pulls_the_estimate_by_the_elapsed_time() {
        let (strategy, set) = (strategy(), backends(1));
        ok(&strategy, &set[0], 3.0);
        advance(DECAY).await;
        ok(&strategy, &set[0], 1.0);
        let weight = (-1.0f64).exp();
        let expected = 3.0 * weight + 1.0 * (1.0 - weight);
        assert!(close(estimate(&strategy, &set[0]), expected));
        // A sample right after the previous one barely moves it.
        ok(&strategy, &set[0], 0.0);
        assert!(close(estimate(&strategy, &set[0]), expected));
    }

    #[tokio::test(start_paused = true)]
    async fn the_estimate_decays_towards_zero_between_samples() {
        let (strategy, set) = (strategy(), backends(1));
        ok(&strategy, &set[0], 2.0);
        advance(DECAY).await;
        assert!(close(estimate(&strategy, &set[0]), 2.0 * (-1.0f64).exp()));
        advance(4.0 * DECAY).await;
        assert!(estimate(&strategy, &set[0]) < 2.0 * 0.01);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_counts_at_least_twice_the_current_estimate() {
        let (strategy, set) = (strategy(), backends(1));
        ok(&strategy, &set[0], 5.0);
        let failure = outcome(3.0, true);
        strategy.on_outcome(&set[0], &failure);
        assert_eq!(estimate(&strategy, &set[0]), 10.0);
        strategy.on_outcome(&set[0], &failure);
        assert_eq!(estimate(&strategy, &set[0]), 20.0);
    }

    #[tokio::test(start_paused = true)]
    async fn picks_the_cheaper_of_the_two_by_latency_times_load() {
        let (strategy, set) = (strategy(), backends(2));
        ok(&strategy, &set[0], 1.0);
        ok(&strategy, &set[1], 0.5);
        let request = RequestInfo::default();
        // Costs 1.0 × 1 against 0.5 × 1: the faster one.
        assert_eq!(strategy.pick(&request, &set), Some(1));
        // Costs 1.0 × 1 against 0.5 × 4: the idle one, though slower.
        for _ in 0..3 {
            set[1].acquire();
        }
        for _ in 0..20 {
            assert_eq!(strategy.pick(&request, &set), Some(0));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_never_measured_backend_is_assumed_as_slow_as_the_mean() {
        let (strategy, set) = (strategy(), backends(3));
        ok(&strategy, &set[0], 1.0);
        ok(&strategy, &set[1], 3.0);
        assert_eq!(estimate(&strategy, &set[2]), 2.0);
        // Idle, it beats the slower measured one and loses to the faster one.
        let request = RequestInfo::default();
        let pair = [Arc::clone(&set[1]), Arc::clone(&set[2])];
        assert_eq!(strategy.pick(&request, &pair), Some(1));
        let pair = [Arc::clone(&set[0]), Arc::clone(&set[2])];
        assert_eq!(strategy.pick(&request, &pair), Some(0));
    }

    #[tokio::test(start_paused = true)]
    async fn default_rtt_fixes_the_never_measured_latency() {
        let strategy = P2cPeakEwma::new(DECAY, Some(0.25), Some(1));
        let set = backends(2);
        assert_eq!(estimate(&strategy, &set[1]), 0.25);
        ok(&strategy, &set[0], 5.0);
        assert_eq!(estimate(&strategy, &set[1]), 0.25);
        let fresh = P2cPeakEwma::new(DECAY, None, Some(1));
        assert_eq!(estimate(&fresh, &set[1]), NOTHING_MEASURED_RTT);
    }

    #[test]
    fn draws_two_distinct_candidates_uniformly_and_reproducibly() {
        let set = backends(4);
        let request = RequestInfo::default();
        let picks = |seed| {
            let strategy = P2cPeakEwma::new(DECAY, None, Some(seed));
            (0..4000)
                .map(|_| strategy.pick(&request, &set).unwrap())
                .collect::<Vec<_>>()
        };
        let first = picks(3);
        assert_eq!(first, picks(3));
        let mut counts = [0usize; 4];
        for index in &first {
            counts[*index] += 1;
        }
        // Equal costs: the first drawn wins, so each backend gets about a quarter.
        assert!(
            counts.iter().all(|&n| (800..1200).contains(&n)),
            "{counts:?}"
        );

        let mut state = State {
            rng: fastrand::Rng::with_seed(5),
            estimates: HashMap::new(),
        };
        for n in 2..6 {
            for _ in 0..200 {
                let (a, b) = state.two_distinct(n);
                assert!(a != b && a < n && b < n, "{a} {b} of {n}");
            }
        }
    }

    #[test]
    fn one_candidate_is_picked_and_none_gives_none() {
        let strategy = strategy();
        let request = RequestInfo::default();
        assert_eq!(strategy.pick(&request, &backends(1)), Some(0));
        assert_eq!(strategy.pick(&request, &[]), None);
    }

    #[tokio::test(start_paused = true)]
    async fn estimates_of_removed_backends_are_dropped() {
        let (strategy, set) = (strategy(), backends(2));
        ok(&strategy, &set[0], 1.0);
        ok(&strategy, &set[1], 1.0);
        strategy.on_backends_changed(&set[1..]);
        let estimates = &strategy.lock().estimates;
        assert!(!estimates.contains_key(&set[0].id()));
        assert!(estimates.contains_key(&set[1].id()));
    }

    #[test]
    fn decay_and_default_rtt_must_be_positive() {
        for (field, value) in [("decay", 0.0), ("decay", -1.0), ("default_rtt", 0.0)] {
            let mut dict = Dict::new();
            dict.insert(field.into(), Value::from(value));
            let error = build(&StrategyContext::default(), &Value::from(dict))
                .err()
                .unwrap();
            assert_eq!(error.field, field);
        }
    }
}
