//! The load score (`score = "load"`): size-normalised cost relative to the fleet's, times the
//! load, within a concurrency limit learned from time to first byte (see the module docs).
//!
//! What is learned about a backend lives with it in a [`Slot`] ([`Backend::strategy_slot`]):
//! what a pick reads (limit, cost, coverage) in atomics, the history behind a mutex. Every read
//! and write happens under the strategy's [`LoadState`] lock, which also holds the fleet's sums;
//! a slot counts only when it carries the state's generation, so a strategy built anew (a reload
//! with other parameters) starts from nothing, and forgetting removed backends is a new
//! generation that the backends still present are carried over to.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::QueuedLeastLatency;
use crate::backend::Backend;
use crate::strategies::{Outcome, next_generation};

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

/// What the load score learns about one backend (a working copy; the backend keeps it in its
/// [`Slot`]).
#[derive(Debug, Clone)]
struct Learned {
    /// Concurrency limit.
    limit: f64,
    /// The costs of the kinds it has: the one cost, or the geometric mean of both.
    own: f64,
    /// Which kinds have a cost: bit [`STREAMED`], bit [`WHOLE`].
    coverage: u8,
    /// Costs and TTFB baseline.
    history: History,
}

/// The part of [`Learned`] a pick reads.
#[derive(Debug, Clone, Copy)]
struct Rank {
    limit: f64,
    own: f64,
    coverage: u8,
}

/// The part of [`Learned`] only `learn` reads (kept on the backend behind a mutex).
#[derive(Debug, Clone, Copy, Default)]
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
            history: History::default(),
        }
    }

    /// What a pick reads of it.
    #[cfg(test)]
    fn rank(&self) -> Rank {
        Rank {
            limit: self.limit,
            own: self.own,
            coverage: self.coverage,
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
pub(super) struct Fleet {
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
    fn of<'a>(learned: impl IntoIterator<Item = &'a Learned>) -> Self {
        let mut fleet = Fleet::default();
        for learned in learned {
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

    /// How many backends are counted.
    fn entries(&self) -> u32 {
        self.covered.iter().sum()
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
    fn rank_cost(&self, learned: Option<Rank>) -> f64 {
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
    fn relative(&self, learned: Rank) -> f64 {
        learned.own * self.factor[usize::from(learned.coverage)]
    }
}

/// What the load score keeps on each backend ([`Backend::strategy_slot`]).
#[derive(Debug, Default)]
pub(super) struct Slot {
    /// The [`LoadState::generation`] it was written in; 0: never.
    generation: AtomicU64,
    /// [`Learned::limit`], as `f64` bits.
    limit: AtomicU64,
    /// [`Learned::own`], as `f64` bits.
    own: AtomicU64,
    /// [`Learned::coverage`].
    coverage: AtomicU8,
    /// [`Learned::history`].
    history: Mutex<History>,
}

impl Slot {
    /// What a pick reads, if it was written in `generation`.
    fn rank(&self, generation: u64) -> Option<Rank> {
        (self.generation.load(Ordering::Relaxed) == generation).then(|| Rank {
            limit: f64::from_bits(self.limit.load(Ordering::Relaxed)),
            own: f64::from_bits(self.own.load(Ordering::Relaxed)),
            coverage: self.coverage.load(Ordering::Relaxed),
        })
    }

    /// Writes what a pick reads (the history is written by the caller).
    fn store(&self, learned: &Learned, generation: u64) {
        self.limit.store(learned.limit.to_bits(), Ordering::Relaxed);
        self.own.store(learned.own.to_bits(), Ordering::Relaxed);
        self.coverage.store(learned.coverage, Ordering::Relaxed);
        self.generation.store(generation, Ordering::Relaxed);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The fleet's sums over the backends learned in `generation`.
#[derive(Debug)]
pub(super) struct LoadState {
    /// Which slots count: those written in this generation.
    pub(super) generation: u64,
    pub(super) fleet: Fleet,
}

impl Default for LoadState {
    fn default() -> Self {
        Self {
            generation: next_generation(),
            fleet: Fleet::default(),
        }
    }
}

/// How fast a raised TTFB baseline catches up (per sample), so a replica that became slower for
/// good is not judged against its old best forever. Slow on purpose: under sustained overload
/// every TTFB is high, and a baseline that followed it would let the limit climb until the
/// replicas' own queues overflow.
const BASELINE_DRIFT: f64 = 0.002;
/// Weight of a new limit estimate.
const LIMIT_SMOOTHING: f64 = 0.2;

impl QueuedLeastLatency {
    /// The load score of `backend` if it is a candidate.
    pub(super) fn load_score(
        &self,
        backend: &Backend,
        generation: u64,
        fleet: &Fleet,
    ) -> Option<f64> {
        let in_flight = backend.in_flight();
        if backend.ewma_latency().is_none() {
            return (in_flight == 0).then_some(0.0);
        }
        let state = backend.strategy_slot::<Slot>().rank(generation);
        let limit = state.map_or(self.initial_limit, |s| s.limit);
        let cost = fleet.rank_cost(state);
        let room =
            in_flight == 0 || ((in_flight as f64) < limit && self.ramp_room(backend, in_flight));
        room.then_some(cost * (in_flight + 1) as f64)
    }

    /// The current concurrency limit learned for `backend` (`load` score).
    pub fn limit(&self, backend: &Backend) -> f64 {
        let generation = self.load_state().generation;
        backend
            .strategy_slot::<Slot>()
            .rank(generation)
            .map_or(self.initial_limit, |s| s.limit)
    }

    /// Keeps what was learned about ejected or paused backends; forgets removed ones once more
    /// backends are counted than four times the set: a new generation, to which the backends of
    /// the set are carried over, and the fleet's sums counted again over them.
    pub(super) fn forget_removed(&self, backends: &[Arc<Backend>]) {
        let mut state = self.load_state();
        if state.fleet.entries() as usize <= 4 * backends.len().max(8) {
            return;
        }
        let generation = next_generation();
        let kept: Vec<Learned> = backends
            .iter()
            .filter_map(|backend| {
                let slot = backend.strategy_slot::<Slot>();
                let rank = slot.rank(state.generation)?;
                let learned = Learned {
                    limit: rank.limit,
                    own: rank.own,
                    coverage: rank.coverage,
                    history: *lock(&slot.history),
                };
                slot.generation.store(generation, Ordering::Relaxed);
                Some(learned)
            })
            .collect();
        state.generation = generation;
        state.fleet = Fleet::of(&kept);
    }

    /// Folds `outcome` into what is learned about `backend` and into the fleet's sums.
    pub(super) fn learn(&self, backend: &Backend, outcome: &Outcome) {
        let mut guard = self.load_state();
        let LoadState { generation, fleet } = &mut *guard;
        let slot = backend.strategy_slot::<Slot>();
        let mut history = lock(&slot.history);
        let mut learned = match slot.rank(*generation) {
            Some(rank) => Learned {
                limit: rank.limit,
                own: rank.own,
                coverage: rank.coverage,
                history: *history,
            },
            None => {
                fleet.add_entry();
                Learned::new(self.initial_limit)
            }
        };
        self.learn_into(&mut learned, fleet, outcome);
        *history = learned.history;
        slot.store(&learned, *generation);
    }

    fn learn_into(&self, state: &mut Learned, fleet: &mut Fleet, outcome: &Outcome) {
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
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn relative_cost_is_the_geometric_mean_of_the_ratios_to_the_fleet_means() {
        let mut map = HashMap::new();
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
        let fleet = Fleet::of(map.values());
        // Streamed mean 0.2, whole mean 2.0.
        let expected_a = ((0.1 / 0.2) * (2.0 / 2.0_f64)).sqrt();
        assert!((fleet.relative(a.rank()) - expected_a).abs() < 1e-12);
        assert!((fleet.relative(b.rank()) - 1.5).abs() < 1e-12);
        assert_eq!(fleet.relative(c.rank()), 1.0);
        // Incremental updates give the same fleet as a full recount.
        let mut incremental = Fleet::default();
        incremental.replace(STREAMED, None, Some(0.1));
        incremental.replace(WHOLE, None, Some(2.0));
        incremental.replace(STREAMED, None, Some(0.5));
        incremental.replace(STREAMED, Some(0.5), Some(0.3));
        assert!((incremental.relative(b.rank()) - fleet.relative(b.rank())).abs() < 1e-12);
        // Mixed coverage: picks rank by the relative cost itself.
        assert_eq!(fleet.common, None);
        assert_eq!(fleet.rank_cost(Some(b.rank())), fleet.relative(b.rank()));
        assert_eq!(fleet.rank_cost(None), 1.0);

        // One coverage for all: ranking by `own` keeps the order of the relative costs, and a
        // backend with nothing learned ranks as the mean.
        let mut map = HashMap::new();
        for (id, latency) in [(1, 1.0), (2, 3.0), (3, 2.0)] {
            let mut learned = Learned::new(4.0);
            learned.history.kinds[STREAMED].record(latency, 10.0);
            learned.combine();
            map.insert(id, learned);
        }
        let fleet = Fleet::of(map.values());
        assert!(fleet.common.is_some_and(|mean| (mean - 0.2).abs() < 1e-12));
        let ranks: Vec<f64> = (1..=3)
            .map(|id| fleet.rank_cost(map.get(&id).map(Learned::rank)))
            .collect();
        let relatives: Vec<f64> = (1..=3).map(|id| fleet.relative(map[&id].rank())).collect();
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

    fn streamed(latency: f64, ttfb: f64) -> Outcome {
        Outcome {
            latency,
            failed: false,
            first_byte: Some(ttfb),
            bytes: 4096,
            streamed: true,
        }
    }

    #[test]
    fn what_is_learned_lives_with_the_backend_and_a_new_instance_starts_afresh() {
        let set: Vec<_> = (0..2)
            .map(|i| Arc::new(Backend::new(format!("10.0.4.{i}:80").parse().unwrap())))
            .collect();
        let strategy = QueuedLeastLatency::load(3.0);
        for _ in 0..5 {
            strategy.learn(&set[0], &streamed(1.0, 0.1));
        }
        let learned = strategy.limit(&set[0]);
        assert!(learned > strategy.initial_limit, "{learned}");
        assert_eq!(strategy.limit(&set[1]), strategy.initial_limit);
        // A reload builds a new instance: it does not read the old one's values.
        let reloaded = QueuedLeastLatency::load(3.0);
        assert_eq!(reloaded.limit(&set[0]), reloaded.initial_limit);
        assert_eq!(reloaded.load_state().fleet.entries(), 0);
        // Forgetting removed backends keeps those of the set.
        for backend in (0..40).map(|i| Backend::new(format!("10.0.5.{i}:80").parse().unwrap())) {
            strategy.learn(&backend, &streamed(1.0, 0.1));
        }
        strategy.forget_removed(&set);
        assert_eq!(strategy.limit(&set[0]), learned);
        assert_eq!(strategy.load_state().fleet.entries(), 1);
    }
}
