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
//!   (tower and Finagle decay the same way when they read the load) — but only while the backend
//!   has nothing in flight: requests in flight will answer for it, and a replica holding LLM
//!   streams longer than `decay` would otherwise look cheapest exactly when it is busiest.
//!
//! The cost is `estimate × (in_flight + 1)`: the expected time to drain the work already sent
//! there plus this request. It prefers fast replicas but moves on as soon as their queue grows,
//! which is the least-connections behaviour weighted by speed.
//!
//! # Details of this implementation
//!
//! - Samples are the core's outcome latencies (seconds from dispatch to the end of the response;
//!   a failure counts at least `latency.threshold`). A **failure** also counts at least twice the
//!   backend's current estimate, so a replica that answers errors quickly never looks fast even
//!   when normal answers take longer than the threshold; consecutive failures double it again
//!   (the core ejects the replica after `availability.consecutive_failures`), up to an hour.
//! - A backend never measured is assumed as slow as the **mean current estimate of the measured
//!   ones** (or `default_rtt` seconds when that parameter is set): attractive while it has fewer
//!   requests in flight than its peers, never infinitely so. Tower defaults to 1 s and Linkerd to
//!   30 ms; a fixed value fits one workload only (30 ms would make a new LLM replica ~100 times
//!   cheaper than a measured one, so it would win every pair it is drawn in until its first
//!   answer, seconds later). With nothing measured yet all backends are equal and in-flight
//!   counts decide.
//! - Estimates live with each backend ([`Backend::strategy_slot`]), stamped with the strategy
//!   instance's generation, so a backend removed from the set takes its estimate along and a
//!   strategy built anew (a reload with other parameters) starts from nothing. The mean for
//!   never-measured backends is over the eligible set. Time is [`tokio::time::Instant`], so
//!   tests pause it.
//! - The two candidates are drawn with a [`fastrand::Rng`], seeded by `seed` when given (tests,
//!   benchmarks) and from entropy otherwise, among the candidates left after the core's
//!   exclusions (backends a retry already tried). One candidate is picked as is.
//! - **Queueing**: `pick` returns `None` only when there is no candidate at all (no backends set
//!   yet, or every one ejected or paused after busy answers). Such a request waits in the core
//!   queue, like with `queued-least-latency`, and leaves when set-backends or the end of a pause
//!   brings a backend back (bounded by `queue.max_size` and `queue.timeout`). With candidates it
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use figment::value::Value;
use serde::Deserialize;
use tokio::time::Instant;

use super::{
    Candidates, Outcome, ParamsError, Pick, RequestInfo, Strategy, StrategyContext, StrategyEntry,
    next_generation, parse_params,
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

/// Seconds no estimate exceeds: past any answer, and low enough that a long run of failures
/// (each doubling the estimate) never reaches infinity, whose decay would read as NaN.
const MAX_ESTIMATE: f64 = 3600.0;

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
        let sample = sample.min(MAX_ESTIMATE);
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

/// What the strategy keeps on each backend ([`Backend::strategy_slot`]): its estimate, written
/// under the strategy's lock and valid only with the strategy's generation.
#[derive(Debug, Default)]
struct Slot {
    /// The generation of the strategy that wrote it; 0: never written.
    generation: AtomicU64,
    /// [`PeakEwma::estimate`], as `f64` bits.
    estimate: AtomicU64,
    /// [`PeakEwma::updated`], as nanoseconds since the strategy's epoch.
    updated: AtomicU64,
}

/// What the strategy keeps behind its lock.
#[derive(Debug)]
struct State {
    rng: fastrand::Rng,
    /// The eligible set, as last given to `on_backends_changed`: the mean for never-measured
    /// backends when an outcome is recorded.
    set: Vec<Arc<Backend>>,
}

impl State {
    /// Two distinct indices below `n` (n ≥ 2), uniformly.
    fn two_distinct(&mut self, n: usize) -> (usize, usize) {
        let first = self.rng.usize(..n);
        let second = self.rng.usize(..n - 1);
        (first, if second >= first { second + 1 } else { second })
    }
}

/// The p2c-peak-ewma strategy. See the module docs for the algorithm.
#[derive(Debug)]
pub struct P2cPeakEwma {
    decay: f64,
    default_rtt: Option<f64>,
    /// Stamps this instance's estimates on the backends.
    generation: u64,
    /// Time zero of the stored `updated` instants.
    epoch: Instant,
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
            generation: next_generation(),
            epoch: Instant::now(),
            state: Mutex::new(State {
                rng,
                set: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The estimate this instance keeps on `backend`, if it measured it.
    fn estimate(&self, backend: &Backend) -> Option<PeakEwma> {
        let slot = backend.strategy_slot::<Slot>();
        (slot.generation.load(Ordering::Relaxed) == self.generation).then(|| PeakEwma {
            estimate: f64::from_bits(slot.estimate.load(Ordering::Relaxed)),
            updated: self.epoch + Duration::from_nanos(slot.updated.load(Ordering::Relaxed)),
        })
    }

    /// Stores `estimate` on `backend` (under the strategy's lock).
    fn store(&self, backend: &Backend, estimate: PeakEwma) {
        let slot = backend.strategy_slot::<Slot>();
        let updated = estimate.updated.saturating_duration_since(self.epoch);
        slot.estimate
            .store(estimate.estimate.to_bits(), Ordering::Relaxed);
        slot.updated.store(
            u64::try_from(updated.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        slot.generation.store(self.generation, Ordering::Relaxed);
    }

    /// The mean current estimate of the measured backends of `set`, if any.
    fn mean_estimate(&self, set: &[Arc<Backend>], now: Instant) -> Option<f64> {
        let (sum, count) = set
            .iter()
            .filter_map(|backend| self.estimate(backend))
            .fold((0.0, 0usize), |(sum, count), estimate| {
                (sum + estimate.value(now, self.decay), count + 1)
            });
        (count > 0).then(|| sum / count as f64)
    }

    /// Seconds a request to `backend` is expected to take at `now`, before load; `set` gives
    /// the mean for a never-measured backend.
    fn latency(&self, set: &[Arc<Backend>], backend: &Backend, now: Instant) -> f64 {
        match self.estimate(backend) {
            // While requests are in flight the estimate holds: their answers, not time, will
            // tell. An LLM stream outlasts `decay`; decayed, the busiest replica would look free.
            Some(estimate) if backend.in_flight() > 0 => estimate.estimate,
            Some(estimate) => estimate.value(now, self.decay),
            None => self.unmeasured_latency(set, now),
        }
    }

    fn unmeasured_latency(&self, set: &[Arc<Backend>], now: Instant) -> f64 {
        self.default_rtt
            .or_else(|| self.mean_estimate(set, now))
            .unwrap_or(NOTHING_MEASURED_RTT)
    }

    /// The cost of sending one more request to `backend`: latency × (in-flight + 1).
    fn cost(&self, set: &[Arc<Backend>], backend: &Backend, now: Instant) -> f64 {
        self.latency(set, backend, now) * (backend.in_flight() + 1) as f64
    }
}

impl Strategy for P2cPeakEwma {
    fn name(&self) -> &'static str {
        ENTRY.name
    }

    fn pick(&self, _request: &RequestInfo, candidates: Candidates<'_>) -> Option<Pick> {
        let count = candidates.len();
        if count < 2 {
            return candidates.nth(0).map(|(index, _)| Pick::at(index));
        }
        let mut state = self.lock();
        let (first, second) = state.two_distinct(count);
        let (first, second) = (candidates.nth(first)?, candidates.nth(second)?);
        let now = Instant::now();
        let set = candidates.all();
        let first_cost = self.cost(set, first.1, now);
        let second_cost = self.cost(set, second.1, now);
        Some(Pick::at(if second_cost < first_cost {
            second.0
        } else {
            first.0
        }))
    }

    fn on_backends_changed(&self, backends: &[Arc<Backend>]) {
        self.lock().set = backends.to_vec();
    }

    fn on_outcome(&self, backend: &Backend, outcome: &Outcome) {
        if !outcome.latency.is_finite() {
            return;
        }
        let now = Instant::now();
        let state = self.lock();
        let estimate = match self.estimate(backend) {
            Some(mut estimate) => {
                let sample = if outcome.failed {
                    outcome
                        .latency
                        .max(FAILURE_PENALTY * estimate.value(now, self.decay))
                } else {
                    outcome.latency
                };
                estimate.observe(sample, now, self.decay);
                estimate
            }
            None => {
                let sample = if outcome.failed {
                    let current = self.unmeasured_latency(&state.set, now);
                    outcome.latency.max(FAILURE_PENALTY * current)
                } else {
                    outcome.latency
                };
                PeakEwma {
                    estimate: sample.min(MAX_ESTIMATE),
                    updated: now,
                }
            }
        };
        self.store(backend, estimate);
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
            usage: None,
            in_flight: 1,
            prompt_tokens: 0,
            recall: Default::default(),
        }
    }

    fn ok(strategy: &P2cPeakEwma, backend: &Backend, latency: f64) {
        strategy.on_outcome(backend, &outcome(latency, false));
    }

    fn estimate(strategy: &P2cPeakEwma, set: &[Arc<Backend>], index: usize) -> f64 {
        strategy.latency(set, &set[index], Instant::now())
    }

    fn pick(strategy: &P2cPeakEwma, set: &[Arc<Backend>]) -> Option<Pick> {
        strategy.pick(&RequestInfo::default(), set.into())
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
        assert_eq!(estimate(&strategy, &set, 0), 4.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lower_sample_pulls_the_estimate_by_the_elapsed_time() {
        let (strategy, set) = (strategy(), backends(1));
        ok(&strategy, &set[0], 3.0);
        advance(DECAY).await;
        ok(&strategy, &set[0], 1.0);
        let weight = (-1.0f64).exp();
        let expected = 3.0 * weight + 1.0 * (1.0 - weight);
        assert!(close(estimate(&strategy, &set, 0), expected));
        // A sample right after the previous one barely moves it.
        ok(&strategy, &set[0], 0.0);
        assert!(close(estimate(&strategy, &set, 0), expected));
    }

    #[tokio::test(start_paused = true)]
    async fn the_estimate_decays_towards_zero_between_samples() {
        let (strategy, set) = (strategy(), backends(1));
        ok(&strategy, &set[0], 2.0);
        advance(DECAY).await;
        assert!(close(estimate(&strategy, &set, 0), 2.0 * (-1.0f64).exp()));
        advance(4.0 * DECAY).await;
        assert!(estimate(&strategy, &set, 0) < 2.0 * 0.01);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_counts_at_least_twice_the_current_estimate() {
        let (strategy, set) = (strategy(), backends(1));
        ok(&strategy, &set[0], 5.0);
        let failure = outcome(3.0, true);
        strategy.on_outcome(&set[0], &failure);
        assert_eq!(estimate(&strategy, &set, 0), 10.0);
        strategy.on_outcome(&set[0], &failure);
        assert_eq!(estimate(&strategy, &set, 0), 20.0);
    }

    #[tokio::test(start_paused = true)]
    async fn picks_the_cheaper_of_the_two_by_latency_times_load() {
        let (strategy, set) = (strategy(), backends(2));
        ok(&strategy, &set[0], 1.0);
        ok(&strategy, &set[1], 0.5);
        // Costs 1.0 × 1 against 0.5 × 1: the faster one.
        assert_eq!(pick(&strategy, &set), Some(Pick::at(1)));
        // Costs 1.0 × 1 against 0.5 × 4: the idle one, though slower.
        for _ in 0..3 {
            set[1].acquire();
        }
        for _ in 0..20 {
            assert_eq!(pick(&strategy, &set), Some(Pick::at(0)));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_never_measured_backend_is_assumed_as_slow_as_the_mean() {
        let (strategy, set) = (strategy(), backends(3));
        ok(&strategy, &set[0], 1.0);
        ok(&strategy, &set[1], 3.0);
        assert_eq!(estimate(&strategy, &set, 2), 2.0);
        // Idle, it beats the slower measured one and loses to the faster one (the third
        // excluded: the mean is still over the whole set).
        let request = RequestInfo::default();
        let pair = |excluded: usize| {
            let excluded = [Arc::clone(&set[excluded])];
            strategy.pick(&request, Candidates::new(&set).excluding(&excluded))
        };
        assert_eq!(pair(0), Some(Pick::at(2)));
        assert_eq!(pair(1), Some(Pick::at(0)));
    }

    #[tokio::test(start_paused = true)]
    async fn default_rtt_fixes_the_never_measured_latency() {
        let strategy = P2cPeakEwma::new(DECAY, Some(0.25), Some(1));
        let set = backends(2);
        assert_eq!(estimate(&strategy, &set, 1), 0.25);
        ok(&strategy, &set[0], 5.0);
        assert_eq!(estimate(&strategy, &set, 1), 0.25);
        let fresh = P2cPeakEwma::new(DECAY, None, Some(1));
        assert_eq!(estimate(&fresh, &set, 1), NOTHING_MEASURED_RTT);
    }

    #[test]
    fn draws_two_distinct_candidates_uniformly_and_reproducibly() {
        let set = backends(4);
        let request = RequestInfo::default();
        let picks = |seed| {
            let strategy = P2cPeakEwma::new(DECAY, None, Some(seed));
            (0..4000)
                .map(|_| strategy.pick(&request, (&set).into()).unwrap().index)
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
            set: Vec::new(),
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
        assert_eq!(
            strategy.pick(&request, (&backends(1)).into()),
            Some(Pick::at(0))
        );
        assert_eq!(strategy.pick(&request, Candidates::new(&[])), None);
        // Both of two excluded but one: that one.
        let set = backends(2);
        let tried = [Arc::clone(&set[0])];
        for _ in 0..20 {
            let candidates = Candidates::new(&set).excluding(&tried);
            assert_eq!(strategy.pick(&request, candidates), Some(Pick::at(1)));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn estimates_live_with_the_backend_and_a_new_instance_starts_afresh() {
        let (strategy, set) = (strategy(), backends(3));
        ok(&strategy, &set[0], 1.0);
        ok(&strategy, &set[1], 3.0);
        // A backend no longer in the set no longer counts in the mean.
        assert_eq!(estimate(&strategy, &set[1..], 1), 3.0);
        let again = P2cPeakEwma::new(DECAY, None, Some(7));
        assert!(again.estimate(&set[0]).is_none());
        assert_eq!(estimate(&again, &set, 2), NOTHING_MEASURED_RTT);
        assert_eq!(estimate(&strategy, &set, 0), 1.0);
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
