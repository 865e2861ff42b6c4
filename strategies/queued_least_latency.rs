//! `queued-least-latency`: the backend with the lowest EWMA latency, with bursts held in the
//! router queue.
//!
//! The core keeps, per backend, an EWMA of end-to-end latency (none until the first sample), the
//! requests in flight and the requests completed. A backend is a *candidate* when:
//!
//! 1. it was never measured and is idle: score 0 (probe it first);
//! 2. it was never measured and has a request in flight: not a candidate until that result is in;
//! 3. it was measured and is idle: score = its EWMA, even above the latency threshold;
//! 4. it was measured and is busy: a candidate only if its EWMA is below `latency_threshold` **and**
//!    its in-flight count is below `ramp_up_factor × completed`; score = its EWMA.
//!
//! The lowest score wins; ties go to fewer requests in flight, then rotate so that equal backends
//! share the load. When no backend is a candidate the request waits in the core's FIFO queue and
//! is dispatched as soon as one becomes a candidate (a request finishes, the backend set changes).
//!
//! The core records a failed attempt (connect error, I/O error, 5xx) as a latency sample of at
//! least the threshold and keeps the backend occupied for that long, so a dead or failing
//! replica is neither preferred nor retried at once. Use this strategy when replicas differ in
//! speed or when bursts should wait in the router for a replica with room instead of piling onto
//! busy ones.
//!
//! ```toml
//! latency_threshold = 3.0      # top-level: used by the core and by this strategy
//! [strategy]
//! name = "queued-least-latency"
//! [strategy.params]
//! ramp_up_factor = 5
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use figment::value::Value;
use serde::Deserialize;

use super::{ParamsError, RequestInfo, Strategy, StrategyContext, StrategyEntry, parse_params};
use crate::backend::Backend;

/// Registry entry.
pub const ENTRY: StrategyEntry = StrategyEntry {
    name: "queued-least-latency",
    summary: "lowest EWMA latency below the threshold; bursts wait in the router queue",
    build,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Params {
    /// A busy backend may hold at most this many requests per completed request.
    ramp_up_factor: f64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            ramp_up_factor: 5.0,
        }
    }
}

fn build(context: &StrategyContext, params: &Value) -> Result<Arc<dyn Strategy>, ParamsError> {
    let params: Params = parse_params(params)?;
    if !(params.ramp_up_factor.is_finite() && params.ramp_up_factor > 0.0) {
        return Err(ParamsError::new(
            "ramp_up_factor",
            format!(
                "expected a positive number, found {}",
                params.ramp_up_factor
            ),
        ));
    }
    Ok(Arc::new(QueuedLeastLatency::new(
        context.latency_threshold,
        params.ramp_up_factor,
    )))
}

/// The queued-least-latency strategy. See the module docs for the rules.
#[derive(Debug)]
pub struct QueuedLeastLatency {
    latency_threshold: f64,
    ramp_up_factor: f64,
    rotation: AtomicUsize,
}

impl QueuedLeastLatency {
    /// A strategy with the given threshold (seconds) and ramp-up factor.
    pub fn new(latency_threshold: f64, ramp_up_factor: f64) -> Self {
        Self {
            latency_threshold,
            ramp_up_factor,
            rotation: AtomicUsize::new(0),
        }
    }

    /// The score of `backend` if it is a candidate (rules 1–4).
    pub fn score(&self, backend: &Backend) -> Option<f64> {
        let in_flight = backend.in_flight();
        match (backend.ewma_latency(), in_flight) {
            (None, 0) => Some(0.0),
            (None, _) => None,
            (Some(ewma), 0) => Some(ewma),
            (Some(ewma), busy) => {
                let ramp_limit = self.ramp_up_factor * backend.completed() as f64;
                (ewma < self.latency_threshold && (busy as f64) < ramp_limit).then_some(ewma)
            }
        }
    }
}

impl Strategy for QueuedLeastLatency {
    fn name(&self) -> &'static str {
        ENTRY.name
    }

    fn pick(&self, _request: &RequestInfo, candidates: &[Arc<Backend>]) -> Option<usize> {
        // First pass: the best (score, in-flight) and how many backends share it.
        let mut best: Option<(f64, usize)> = None;
        let mut ties = 0usize;
        for backend in candidates {
            let Some(score) = self.score(backend) else {
                continue;
            };
            let key = (score, backend.in_flight());
            match best {
                Some(current) if key > current => {}
                Some(current) if key == current => ties += 1,
                _ => {
                    best = Some(key);
                    ties = 1;
                }
            }
        }
        let best = best?;
        // Second pass: rotate among the tied backends.
        let mut skip = self.rotation.fetch_add(1, Ordering::Relaxed) % ties;
        candidates.iter().position(|backend| {
            let tied = self
                .score(backend)
                .is_some_and(|score| (score, backend.in_flight()) == best);
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

#[cfg(test)]
mod tests {
    use super::*;

    const THRESHOLD: f64 = 3.0;

    fn strategy() -> QueuedLeastLatency {
        QueuedLeastLatency::new(THRESHOLD, 5.0)
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
    fn ramp_up_factor_must_be_positive() {
        let mut dict = figment::value::Dict::new();
        dict.insert("ramp_up_factor".into(), Value::from(0));
        let error = build(&StrategyContext::default(), &Value::from(dict))
            .err()
            .unwrap();
        assert_eq!(error.field, "ramp_up_factor");
    }
}
