//! What a backend's answers cost: seconds per KiB of answer body, an EWMA of latency over an
//! EWMA of size, kept apart for streamed and whole answers (an event per token against plain
//! text), and the fleet's sums that make a backend's cost relative to the fleet's mean.

use super::{Learned, LoadScore, Rank};
use crate::strategies::Outcome;

/// Index of streamed answers' cost.
pub(super) const STREAMED: usize = 0;
/// Index of whole answers' cost.
pub(super) const WHOLE: usize = 1;
/// Weight of a new sample in the cost EWMAs: replicas' relative speeds change slowly, and one
/// answer's length and timing are noisy.
const COST_SMOOTHING: f64 = 0.1;
/// Smallest size an answer counts for, in KiB.
const MIN_KIB: f64 = 0.125;

/// The cost of one kind of answer on one backend: EWMAs of latency and of size.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct KindCost {
    latency: f64,
    kib: f64,
}

impl KindCost {
    /// Seconds per KiB; `None` before the first answer of this kind.
    pub(super) fn cost(&self) -> Option<f64> {
        (self.kib > 0.0).then(|| self.latency / self.kib)
    }

    pub(super) fn record(&mut self, latency: f64, kib: f64) {
        if self.kib > 0.0 {
            self.latency += COST_SMOOTHING * (latency - self.latency);
            self.kib += COST_SMOOTHING * (kib - self.kib);
        } else {
            self.latency = latency;
            self.kib = kib;
        }
    }
}

impl Learned {
    /// Recomputes `coverage` and `own` after a cost changed (not on the pick path); returns the
    /// coverage before and after.
    pub(super) fn combine(&mut self) -> (usize, usize) {
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
}

impl Default for Fleet {
    fn default() -> Self {
        Self {
            sum: [0.0; 2],
            count: [0; 2],
            factor: [1.0; 4],
            covered: [0; 4],
        }
    }
}

impl Fleet {
    pub(super) fn of<'a>(learned: impl IntoIterator<Item = &'a Learned>) -> Self {
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
    }

    /// How many backends are counted.
    pub(super) fn entries(&self) -> u32 {
        self.covered.iter().sum()
    }

    /// A backend was learned for the first time (its first cost follows, with a refresh).
    pub(super) fn add_entry(&mut self) {
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

/// A backend's cost relative to the fleet's (1.0 before it was measured).
pub(super) fn relative_cost(fleet: &Fleet, rank: Option<Rank>) -> f64 {
    rank.map_or(1.0, |rank| fleet.relative(rank)).max(1e-9)
}

impl LoadScore {
    /// Folds `outcome` into `learned`'s cost of its kind and into the fleet's sums. A failed
    /// attempt counts as `latency.threshold` (or its latency, if longer) for 1 KiB in both kinds,
    /// which keeps a failing replica last.
    pub(super) fn record_cost(&self, learned: &mut Learned, fleet: &mut Fleet, outcome: &Outcome) {
        if outcome.failed {
            for (kind, cost) in learned.history.kinds.iter_mut().enumerate() {
                let old = cost.cost();
                cost.record(self.latency_threshold.max(outcome.latency), 1.0);
                fleet.replace(kind, old, cost.cost());
            }
            fleet.recover(learned.combine());
            return;
        }
        let kind = if outcome.streamed { STREAMED } else { WHOLE };
        let cost = &mut learned.history.kinds[kind];
        let old = cost.cost();
        cost.record(
            outcome.latency,
            (outcome.bytes as f64 / 1024.0).max(MIN_KIB),
        );
        fleet.replace(kind, old, cost.cost());
        fleet.recover(learned.combine());
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
        assert_eq!(relative_cost(&fleet, None), 1.0);
    }
}
