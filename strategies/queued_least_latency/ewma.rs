//! The reference implementation's rules (`score = "ewma"`): rules 1–4 of the module docs.

use super::RampUp;
use crate::backend::Backend;

/// The reference rules' parameters (they keep nothing else).
#[derive(Debug)]
pub(super) struct EwmaScore {
    /// A busy backend is a candidate only below this EWMA latency, in seconds.
    latency_threshold: f64,
    ramp_up: RampUp,
}

impl EwmaScore {
    pub(super) fn new(latency_threshold: f64, ramp_up: RampUp) -> Self {
        Self {
            latency_threshold,
            ramp_up,
        }
    }

    /// The reference score of `backend` if it is a candidate (rules 1–4).
    pub(super) fn score(&self, backend: &Backend) -> Option<f64> {
        let in_flight = backend.in_flight();
        match (backend.ewma_latency(), in_flight) {
            (None, 0) => Some(0.0),
            (None, _) => None,
            (Some(ewma), 0) => Some(ewma),
            (Some(ewma), busy) => (ewma < self.latency_threshold
                && self.ramp_up.has_room(backend.completed(), busy))
            .then_some(ewma),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::strategies::{Pick, QueuedLeastLatency, RequestInfo, Strategy};

    const THRESHOLD: f64 = 3.0;

    fn strategy() -> QueuedLeastLatency {
        QueuedLeastLatency::ewma(THRESHOLD, 5.0)
    }

    /// The rules [`strategy`] picks by.
    fn rules() -> EwmaScore {
        EwmaScore::new(THRESHOLD, RampUp(5.0))
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

    fn pick(strategy: &QueuedLeastLatency, set: &[Arc<Backend>]) -> Option<Pick> {
        strategy.pick(&RequestInfo::default(), set.into())
    }

    #[test]
    fn rule1_never_measured_and_idle_is_probed_first() {
        let set = [backend(Some(0.01), 0, 10), backend(None, 0, 0)];
        assert_eq!(rules().score(&set[1]), Some(0.0));
        assert_eq!(pick(&strategy(), &set), Some(Pick::at(1)));
    }

    #[test]
    fn rule2_never_measured_with_one_in_flight_is_not_a_candidate() {
        let set = [backend(None, 1, 0)];
        assert_eq!(rules().score(&set[0]), None);
        assert_eq!(pick(&strategy(), &set), None);
    }

    #[test]
    fn rule3_measured_and_idle_is_a_candidate_even_above_the_threshold() {
        let set = [backend(Some(10.0), 0, 1), backend(None, 1, 0)];
        assert_eq!(rules().score(&set[0]), Some(10.0));
        assert_eq!(pick(&strategy(), &set), Some(Pick::at(0)));
    }

    #[test]
    fn rule4_measured_and_busy_needs_low_ewma_and_ramp_up_room() {
        let rules = rules();
        // Below the threshold, 2 in flight < 5 × 1 completed.
        assert_eq!(rules.score(&backend(Some(1.0), 2, 1)), Some(1.0));
        // At or above the threshold: not a candidate while busy.
        assert_eq!(rules.score(&backend(Some(THRESHOLD), 1, 100)), None);
        assert_eq!(rules.score(&backend(Some(5.0), 1, 100)), None);
        // Ramp-up: 5 in flight is not below 5 × 1 completed.
        assert_eq!(rules.score(&backend(Some(0.1), 5, 1)), None);
        assert_eq!(rules.score(&backend(Some(0.1), 4, 1)), Some(0.1));
        // Measured but nothing completed (all samples were cancelled-free failures): no room.
        assert_eq!(rules.score(&backend(Some(0.1), 1, 0)), None);
    }

    #[test]
    fn rule5_lowest_score_wins_then_fewer_in_flight_then_rotation() {
        let strategy = strategy();
        let set = [
            backend(Some(0.5), 0, 5),
            backend(Some(0.2), 3, 5),
            backend(Some(0.9), 0, 5),
        ];
        assert_eq!(pick(&strategy, &set), Some(Pick::at(1)));

        let set = [backend(Some(0.2), 2, 5), backend(Some(0.2), 1, 5)];
        assert_eq!(pick(&strategy, &set), Some(Pick::at(1)));

        let set = [
            backend(Some(0.2), 1, 5),
            backend(Some(0.7), 0, 5),
            backend(Some(0.2), 1, 5),
            backend(Some(0.2), 1, 5),
        ];
        let picks: Vec<_> = (0..6)
            .map(|_| pick(&strategy, &set).unwrap().index)
            .collect();
        let mut counts = [0; 4];
        for index in &picks {
            counts[*index] += 1;
        }
        assert_eq!(counts, [2, 0, 2, 2], "ties rotate: {picks:?}");
    }
}
