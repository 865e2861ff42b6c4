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
//! 4. it was measured and is busy: a candidate only if its EWMA is below `latency_threshold` **and**
//!    its in-flight count is below `ramp_up_factor × completed`; score = its EWMA.
//!
//! **`score = "load"` (default): predicted latency with a learned concurrency limit.** End-to-end
//! latency mixes up a slow replica with a long answer, and a latency threshold is not a capacity
//! signal, so the load score keeps rules 1 and 2 and replaces 3 and 4:
//!
//! - *Cost*: seconds per KiB of response body, i.e. the replica's speed with the answer length
//!   factored out: an EWMA of latency divided by an EWMA of KiB (at least 1/8 KiB per answer),
//!   kept apart for streamed and whole answers, whose bytes per token differ by an order of
//!   magnitude (an event per token against plain text). A replica's cost is relative to the
//!   fleet's: for each kind, its cost over the mean cost of the replicas that served that kind
//!   (the geometric mean of the two ratios when it served both), so replicas compare on equal
//!   terms whatever mix of answers each happened to get. A failed attempt counts as
//!   `latency_threshold` for 1 KiB in both kinds, which keeps a failing replica last.
//! - *Concurrency limit*: learned from time to first byte (for a streamed answer, the time to the
//!   first token: queueing plus prefill). Each replica keeps a TTFB baseline (its lowest recent
//!   TTFB). An answer whose TTFB stayed within `ttfb_tolerance` × baseline + `ttfb_slack` raises
//!   the limit by about √limit; a slower one lowers it in proportion (a gradient, as in
//!   Netflix's concurrency-limits). It starts at `initial_limit`. Once streams have set the
//!   baseline, whole answers leave the limit alone; on a replica that never streamed, each whole
//!   answer raises it. A measured backend is a candidate while its in-flight count is below its
//!   limit and below `ramp_up_factor × completed`.
//! - *Score*: relative cost × (in-flight + 1), the expected latency of one more request
//!   (peak-EWMA style).
//!
//! When every replica is at its limit, requests wait in the router queue instead of in a
//! replica's own queue, so a replica added during a burst takes the waiting requests at once.
//!
//! In both modes the lowest score wins; ties go to fewer requests in flight, then rotate. When no
//! backend is a candidate the request waits in the core's FIFO queue and is dispatched as soon as
//! one becomes a candidate (a request finishes, the backend set changes).
//!
//! The core records a failed attempt (connect error, I/O error, 5xx) as a latency sample of at
//! least the threshold and keeps the backend occupied for that long, so a dead or failing
//! replica is neither preferred nor retried at once.
//!
//! ```toml
//! latency_threshold = 3.0      # top-level: used by the core and by this strategy
//! [strategy]
//! name = "queued-least-latency"
//! [strategy.params]
//! score = "load"               # or "ewma" for the reference rules
//! ramp_up_factor = 5
//! ttfb_tolerance = 2.0
//! ttfb_slack = 0.02
//! initial_limit = 4
//! ```

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use figment::value::Value;
use serde::Deserialize;

use super::{
    Outcome, ParamsError, RequestInfo, Strategy, StrategyContext, StrategyEntry, parse_params,
};
use crate::backend::Backend;

/// Registry entry.
pub const ENTRY: StrategyEntry = StrategyEntry {
    name: "queued-least-latency",
    summary: "fastest replica with room (learned limits); bursts wait in the router queue",
    build,
};

/// Which score ranks the candidates.
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
    Ok(Arc::new(QueuedLeastLatency::with(&params, context)))
}

/// Index of streamed answers' cost.
const STREAMED: usize = 0;
/// Index of whole answers' cost.
const WHOLE: usize = 1;
/// Weight of a new sample in the cost EWMAs: replicas' relative speeds change slowly, and one
/// answer's length and timing are noisy.
const COST_SMOOTHING: f64 = 0.1;
/// Smallest size an answer counts for, in KiB.
const MIN_KIB: f64 = 0.125;

/// The cost of one kind of answer on one backend: EWMAs of latency and of size.
#[derive(Debug, Clone, Copy, Default)]
struct KindCost {
    latency: f64,
    kib: f64,
}

impl KindCost {
    /// Seconds per KiB; `None` before the first answer of this kind.
    fn cost(&self) -> Option<f64> {
        (self.kib > 0.0).then(|| self.latency / self.kib)
    }

    fn record(&mut self, latency: f64, kib: f64) {
        if self.kib > 0.0 {
            self.latency += COST_SMOOTHING * (latency - self.latency);
            self.kib += COST_SMOOTHING * (kib - self.kib);
        } else {
            self.latency = latency;
            self.kib = kib;
        }
    }
}

/// What the load score learns about one backend. A pick reads `limit`, `own` and `coverage`
/// only; the rest is boxed, so a pick over many backends reads less memory.
#[derive(Debug, Clone)]
struct Learned {
    /// Concurrency limit.
    limit: f64,
    /// The costs of the kinds it has: the one cost, or the geometric mean of both.
    own: f64,
    /// Which kinds have a cost: bit [`STREAMED`], bit [`WHOLE`].
    coverage: u8,
    /// Costs and TTFB baseline.
    history: Box<History>,
}

/// The part of [`Learned`] only `learn` reads.
#[derive(Debug, Clone, Default)]
struct History {
    /// Cost of streamed and of whole answers.
    kinds: [KindCost; 2],
    /// Lowest recent time to first byte, in seconds.
    ttfb_baseline: Option<f64>,
}

impl Learned {
    fn new(limit: f64) -> Self {
        Self {
            limit,
            own: 1.0,
            coverage: 0,
            history: Box::default(),
        }
    }

    /// Recomputes `coverage` and `own` after a cost changed (not on the pick path); returns the
    /// coverage before and after.
    fn combine(&mut self) -> (usize, usize) {
        let before = usize::from(self.coverage);
        match (
            self.history.kinds[STREAMED].cost(),
            self.history.kinds[WHOLE].cost(),
        ) {
            (Some(streamed), Some(whole)) => {
                self.coverage = 3;
                self.own = (streamed * whole).sqrt();
            }
            (Some(cost), None) => {
                self.coverage = 1 << STREAMED;
                self.own = cost;
            }
            (None, Some(cost)) => {
                self.coverage = 1 << WHOLE;
                self.own = cost;
            }
            (None, None) => {
                self.coverage = 0;
                self.own = 1.0;
            }
        }
        (before, usize::from(self.coverage))
    }
}

/// Sum and count of the backends' costs, per kind, for the fleet's mean.
#[derive(Debug, Clone, Copy)]
struct Fleet {
    sum: [f64; 2],
    count: [u32; 2],
    /// By coverage: what a backend's `own` cost is multiplied by to make it relative (1 over the
    /// mean, or over the geometric mean of both means), kept up to date so a pick multiplies once.
    factor: [f64; 4],
    /// How many backends learned have each coverage.
    covered: [u32; 4],
    /// When every backend has the same coverage, the factor is common to all and only the
    /// ordering of scores matters: a pick then uses `own` as it is, and this for a backend with
    /// nothing learned (the fleet's mean, i.e. a relative cost of 1).
    common: Option<f64>,
}

impl Default for Fleet {
    fn default() -> Self {
        Self {
            sum: [0.0; 2],
            count: [0; 2],
            factor: [1.0; 4],
            covered: [0; 4],
            common: Some(1.0),
        }
    }
}

impl Fleet {
    fn of(map: &HashMap<u64, Learned, BuildHasherDefault<IdHasher>>) -> Self {
        let mut fleet = Fleet::default();
        for learned in map.values() {
            fleet.covered[usize::from(learned.coverage)] += 1;
            for (kind, cost) in learned.history.kinds.iter().enumerate() {
                if let Some(cost) = cost.cost() {
                    fleet.sum[kind] += cost;
                    fleet.count[kind] += 1;
                }
            }
        }
        fleet.refresh();
        fleet
    }

    fn mean(&self, kind: usize) -> f64 {
        let mean = self.sum[kind] / f64::from(self.count[kind].max(1));
        if mean > 0.0 { mean } else { 1.0 }
    }

    fn refresh(&mut self) {
        let streamed = self.mean(STREAMED);
        let whole = self.mean(WHOLE);
        self.factor = [
            1.0,
            1.0 / streamed,
            1.0 / whole,
            1.0 / (streamed * whole).sqrt(),
        ];
        let entries: u32 = self.covered.iter().sum();
        self.common = self
            .covered
            .iter()
            .position(|&n| n == entries)
            .map(|coverage| 1.0 / self.factor[coverage]);
    }

    /// A backend was learned for the first time (its first cost follows, with a refresh).
    fn add_entry(&mut self) {
        self.covered[0] += 1;
    }

    /// A backend's coverage changed from `before` to `after`.
    fn recover(&mut self, (before, after): (usize, usize)) {
        if before != after {
            self.covered[before] -= 1;
            self.covered[after] += 1;
            self.refresh();
        }
    }

    /// What ranks a backend: its relative cost, or a number in the same order (see `common`).
    fn rank_cost(&self, learned: Option<&Learned>) -> f64 {
        match (self.common, learned) {
            (Some(_), Some(learned)) => learned.own,
            (Some(mean), None) => mean,
            (None, Some(learned)) => self.relative(learned),
            (None, None) => 1.0,
        }
    }

    /// Replaces one backend's `old` cost of `kind` with `new`.
    fn replace(&mut self, kind: usize, old: Option<f64>, new: Option<f64>) {
        if let Some(old) = old {
            self.sum[kind] -= old;
            self.count[kind] -= 1;
        }
        if let Some(new) = new {
            self.sum[kind] += new;
            self.count[kind] += 1;
        }
        self.refresh();
    }

    /// A backend's cost relative to the fleet's mean: for each kind it has, its cost over the
    /// fleet's mean cost of that kind; the geometric mean of both ratios when it has both; 1.0
    /// when it has none.
    fn relative(&self, learned: &Learned) -> f64 {
        learned.own * self.factor[usize::from(learned.coverage)]
    }
}

/// What was learned, by backend id, and the fleet's sums.
#[derive(Debug, Default)]
struct LearnedMap {
    map: HashMap<u64, Learned, BuildHasherDefault<IdHasher>>,
    fleet: Fleet,
}

/// Backend ids are unique sequence numbers: one multiplication (Fibonacci hashing) spreads them
/// over the hash's high bits, which the map uses, at a fraction of SipHash's cost.
#[derive(Debug, Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// How fast a raised TTFB baseline catches up (per sample), so a replica that became slower for
/// good is not judged against its old best forever. Slow on purpose: under sustained overload
/// every TTFB is high, and a baseline that followed it would let the limit climb until the
/// replicas' own queues overflow.
const BASELINE_DRIFT: f64 = 0.002;
/// Weight of a new limit estimate.
const LIMIT_SMOOTHING: f64 = 0.2;

/// The queued-least-latency strategy. See the module docs for the rules.
#[derive(Debug)]
pub struct QueuedLeastLatency {
    score: Score,
    latency_threshold: f64,
    ramp_up_factor: f64,
    ttfb_tolerance: f64,
    ttfb_slack: f64,
    initial_limit: f64,
    max_limit: f64,
    learned: Mutex<LearnedMap>,
    rotation: AtomicUsize,
}

impl QueuedLeastLatency {
    fn with(params: &Params, context: &StrategyContext) -> Self {
        Self {
            score: params.score,
            latency_threshold: context.latency_threshold,
            ramp_up_factor: params.ramp_up_factor,
            ttfb_tolerance: params.ttfb_tolerance,
            ttfb_slack: params.ttfb_slack,
            initial_limit: params.initial_limit,
            max_limit: params.max_limit,
            learned: Mutex::default(),
            rotation: AtomicUsize::new(0),
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
                latency_threshold,
                ..StrategyContext::default()
            },
        )
    }

    /// The load score with default parameters.
    pub fn load(latency_threshold: f64) -> Self {
        Self::with(
            &Params::default(),
            &StrategyContext {
                latency_threshold,
                ..StrategyContext::default()
            },
        )
    }

    fn learned(&self) -> MutexGuard<'_, LearnedMap> {
        self.learned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn ramp_room(&self, backend: &Backend, busy: usize) -> bool {
        (busy as f64) < self.ramp_up_factor * backend.completed() as f64
    }

    /// The reference score of `backend` if it is a candidate (rules 1–4).
    pub fn score(&self, backend: &Backend) -> Option<f64> {
        let in_flight = backend.in_flight();
        match (backend.ewma_latency(), in_flight) {
            (None, 0) => Some(0.0),
            (None, _) => None,
            (Some(ewma), 0) => Some(ewma),
            (Some(ewma), busy) => {
                (ewma < self.latency_threshold && self.ramp_room(backend, busy)).then_some(ewma)
            }
        }
    }

    /// The load score of `backend` if it is a candidate.
    fn load_score(&self, backend: &Backend, learned: &LearnedMap, fleet: &Fleet) -> Option<f64> {
        let in_flight = backend.in_flight();
        if backend.ewma_latency().is_none() {
            return (in_flight == 0).then_some(0.0);
        }
        let state = learned.map.get(&backend.id());
        let limit = state.map_or(self.initial_limit, |s| s.limit);
        let cost = fleet.rank_cost(state);
        let room =
            in_flight == 0 || ((in_flight as f64) < limit && self.ramp_room(backend, in_flight));
        room.then_some(cost * (in_flight + 1) as f64)
    }

    /// The current concurrency limit learned for `backend` (`load` score).
    pub fn limit(&self, backend: &Backend) -> f64 {
        self.learned()
            .map
            .get(&backend.id())
            .map_or(self.initial_limit, |s| s.limit)
    }

    fn learn(&self, backend: &Backend, outcome: &Outcome) {
        let mut guard = self.learned();
        let LearnedMap { map, fleet } = &mut *guard;
        let state = map.entry(backend.id()).or_insert_with(|| {
            fleet.add_entry();
            Learned::new(self.initial_limit)
        });
        if outcome.failed {
            for (kind, cost) in state.history.kinds.iter_mut().enumerate() {
                let old = cost.cost();
                cost.record(self.latency_threshold.max(outcome.latency), 1.0);
                fleet.replace(kind, old, cost.cost());
            }
            fleet.recover(state.combine());
            return;
        }
        let kind = if outcome.streamed { STREAMED } else { WHOLE };
        let cost = &mut state.history.kinds[kind];
        let old = cost.cost();
        cost.record(
            outcome.latency,
            (outcome.bytes as f64 / 1024.0).max(MIN_KIB),
        );
        fleet.replace(kind, old, cost.cost());
        fleet.recover(state.combine());
        // Only a stream's first byte measures queueing; a whole answer's first byte comes with
        // its end. Once streams have set a baseline they alone move the limit; on a replica
        // that never streamed, a whole answer counts as no sign of congestion.
        let Some(ttfb) = outcome.first_byte.filter(|_| outcome.streamed) else {
            if state.history.ttfb_baseline.is_some() {
                return;
            }
            state.limit = ((1.0 - LIMIT_SMOOTHING) * state.limit
                + LIMIT_SMOOTHING * (state.limit + state.limit.sqrt()))
            .min(self.max_limit);
            return;
        };
        let baseline = match state.history.ttfb_baseline {
            Some(old) if ttfb >= old => old + (ttfb - old) * BASELINE_DRIFT,
            _ => ttfb,
        };
        state.history.ttfb_baseline = Some(baseline);
        let tolerated = self.ttfb_tolerance * baseline + self.ttfb_slack;
        let gradient = (tolerated / ttfb.max(1e-6)).clamp(0.5, 1.0);
        let target = if gradient >= 1.0 {
            state.limit + state.limit.sqrt()
        } else {
            state.limit * gradient
        };
        state.limit = ((1.0 - LIMIT_SMOOTHING) * state.limit + LIMIT_SMOOTHING * target)
            .clamp(1.0, self.max_limit);
    }

    fn best<F: Fn(&Backend) -> Option<f64>>(
        &self,
        candidates: &[Arc<Backend>],
        score: F,
    ) -> Option<usize> {
        // First pass: the best (score, in-flight), where it first occurs, and how many backends
        // share it.
        let mut best: Option<(f64, usize)> = None;
        let mut first = 0usize;
        let mut ties = 0usize;
        for (index, backend) in candidates.iter().enumerate() {
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
        candidates.iter().position(|backend| {
            let tied = score(backend).is_some_and(|score| (score, backend.in_flight()) == best);
            if tied {
                if skip == 0 {
                    return true;
                }
                skip -= 1;
            }
            false
        })
    }
}

impl Strategy for QueuedLeastLatency {
    fn name(&self) -> &'static str {
        ENTRY.name
    }

    fn pick(&self, _request: &RequestInfo, candidates: &[Arc<Backend>]) -> Option<usize> {
        match self.score {
            Score::Ewma => self.best(candidates, |backend| self.score(backend)),
            Score::Load => {
                let learned = self.learned();
                // A copy the loop can keep in registers.
                let fleet = learned.fleet;
                self.best(candidates, |backend| {
                    self.load_score(backend, &learned, &fleet)
                })
            }
        }
    }

    fn on_outcome(&self, backend: &Backend, outcome: &Outcome) {
        if self.score == Score::Load {
            self.learn(backend, outcome);
        }
    }

    fn on_backends_changed(&self, backends: &[Arc<Backend>]) {
        // Keep what was learned about ejected or paused backends; forget removed ones once the
        // map is much larger than the set.
        let mut learned = self.learned();
        if learned.map.len() > 4 * backends.len().max(8) {
            learned
                .map
                .retain(|id, _| backends.iter().any(|b| b.id() == *id));
            learned.fleet = Fleet::of(&learned.map);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THRESHOLD: f64 = 3.0;

    fn strategy() -> QueuedLeastLatency {
        QueuedLeastLatency::ewma(THRESHOLD, 5.0)
    }

    fn backend(ewma: Option<f64>, in_flight: usize, completed: u64) -> Arc<Backend> {
        let backend = Backend::new(format!("10.0.0.{}:80", in_flight + 1).parse().unwrap());
        if let Some(ewma) = ewma {
            backend.record_latency(ewma, 1.0);
        }
        for _ in 0..completed {
            backend.record_completed(u64::MAX);
        }
        for _ in 0..in_flight {
            backend.acquire();
        }
        Arc::new(backend)
    }

    fn pick(strategy: &QueuedLeastLatency, set: &[Arc<Backend>]) -> Option<usize> {
        strategy.pick(&RequestInfo::default(), set)
    }

    #[test]
    fn rule1_never_measured_and_idle_is_probed_first() {
        let set = [backend(Some(0.01), 0, 10), backend(None, 0, 0)];
        assert_eq!(strategy().score(&set[1]), Some(0.0));
        assert_eq!(pick(&strategy(), &set), Some(1));
    }

    #[test]
    fn rule2_never_measured_with_one_in_flight_is_not_a_candidate() {
        let set = [backend(None, 1, 0)];
        assert_eq!(strategy().score(&set[0]), None);
        assert_eq!(pick(&strategy(), &set), None);
    }

    #[test]
    fn rule3_measured_and_idle_is_a_candidate_even_above_the_threshold() {
        let set = [backend(Some(10.0), 0, 1), backend(None, 1, 0)];
        assert_eq!(strategy().score(&set[0]), Some(10.0));
        assert_eq!(pick(&strategy(), &set), Some(0));
    }

    #[test]
    fn rule4_measured_and_busy_needs_low_ewma_and_ramp_up_room() {
        let strategy = strategy();
        // Below the threshold, 2 in flight < 5 × 1 completed.
        assert_eq!(strategy.score(&backend(Some(1.0), 2, 1)), Some(1.0));
        // At or above the threshold: not a candidate while busy.
        assert_eq!(strategy.score(&backend(Some(THRESHOLD), 1, 100)), None);
        assert_eq!(strategy.score(&backend(Some(5.0), 1, 100)), None);
        // Ramp-up: 5 in flight is not below 5 × 1 completed.
        assert_eq!(strategy.score(&backend(Some(0.1), 5, 1)), None);
        assert_eq!(strategy.score(&backend(Some(0.1), 4, 1)), Some(0.1));
        // Measured but nothing completed (all samples were cancelled-free failures): no room.
        assert_eq!(strategy.score(&backend(Some(0.1), 1, 0)), None);
    }

    #[test]
    fn rule5_lowest_score_wins_then_fewer_in_flight_then_rotation() {
        let strategy = strategy();
        let set = [
            backend(Some(0.5), 0, 5),
            backend(Some(0.2), 3, 5),
            backend(Some(0.9), 0, 5),
        ];
        assert_eq!(pick(&strategy, &set), Some(1));

        let set = [backend(Some(0.2), 2, 5), backend(Some(0.2), 1, 5)];
        assert_eq!(pick(&strategy, &set), Some(1));

        let set = [
            backend(Some(0.2), 1, 5),
            backend(Some(0.7), 0, 5),
            backend(Some(0.2), 1, 5),
            backend(Some(0.2), 1, 5),
        ];
        let picks: Vec<_> = (0..6).map(|_| pick(&strategy, &set).unwrap()).collect();
        let mut counts = [0; 4];
        for index in &picks {
            counts[*index] += 1;
        }
        assert_eq!(counts, [2, 0, 2, 2], "ties rotate: {picks:?}");
    }

    #[test]
    fn relative_cost_is_the_geometric_mean_of_the_ratios_to_the_fleet_means() {
        let mut map = HashMap::default();
        // a: streamed 0.1 s/KiB, whole 2 s/KiB; b: streamed 0.3 s/KiB only; c: nothing yet.
        let mut a = Learned::new(4.0);
        a.history.kinds[STREAMED].record(1.0, 10.0);
        a.history.kinds[WHOLE].record(1.0, 0.5);
        a.combine();
        let mut b = Learned::new(4.0);
        b.history.kinds[STREAMED].record(3.0, 10.0);
        b.combine();
        let c = Learned::new(4.0);
        map.insert(1, a.clone());
        map.insert(2, b.clone());
        map.insert(3, c.clone());
        let fleet = Fleet::of(&map);
        // Streamed mean 0.2, whole mean 2.0.
        let expected_a = ((0.1 / 0.2) * (2.0 / 2.0_f64)).sqrt();
        assert!((fleet.relative(&a) - expected_a).abs() < 1e-12);
        assert!((fleet.relative(&b) - 1.5).abs() < 1e-12);
        assert_eq!(fleet.relative(&c), 1.0);
        // Incremental updates give the same fleet as a full recount.
        let mut incremental = Fleet::default();
        incremental.replace(STREAMED, None, Some(0.1));
        incremental.replace(WHOLE, None, Some(2.0));
        incremental.replace(STREAMED, None, Some(0.5));
        incremental.replace(STREAMED, Some(0.5), Some(0.3));
        assert!((incremental.relative(&b) - fleet.relative(&b)).abs() < 1e-12);
        // Mixed coverage: picks rank by the relative cost itself.
        assert_eq!(fleet.common, None);
        assert_eq!(fleet.rank_cost(Some(&b)), fleet.relative(&b));
        assert_eq!(fleet.rank_cost(None), 1.0);

        // One coverage for all: ranking by `own` keeps the order of the relative costs, and a
        // backend with nothing learned ranks as the mean.
        let mut map = HashMap::default();
        for (id, latency) in [(1, 1.0), (2, 3.0), (3, 2.0)] {
            let mut learned = Learned::new(4.0);
            learned.history.kinds[STREAMED].record(latency, 10.0);
            learned.combine();
            map.insert(id, learned);
        }
        let fleet = Fleet::of(&map);
        assert!(fleet.common.is_some_and(|mean| (mean - 0.2).abs() < 1e-12));
        let ranks: Vec<f64> = (1..=3).map(|id| fleet.rank_cost(map.get(&id))).collect();
        let relatives: Vec<f64> = (1..=3).map(|id| fleet.relative(&map[&id])).collect();
        assert!(
            ranks
                .iter()
                .zip([0.1, 0.3, 0.2])
                .all(|(rank, own)| (rank - own).abs() < 1e-12),
            "{ranks:?}"
        );
        assert!((relatives[0] - 0.5).abs() < 1e-12 && (relatives[1] - 1.5).abs() < 1e-12);
        assert!((fleet.rank_cost(None) - 0.2).abs() < 1e-12);
    }

    #[test]
    fn ramp_up_factor_must_be_positive() {
        let mut dict = figment::value::Dict::new();
        dict.insert("ramp_up_factor".into(), Value::from(0));
        let error = build(&StrategyContext::default(), &Value::from(dict))
            .err()
            .unwrap();
        assert_eq!(error.field, "ramp_up_factor");
    }
}
