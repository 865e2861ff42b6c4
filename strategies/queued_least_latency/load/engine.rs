//! What an engine's own numbers say (with `[engine_metrics]` on): the work they add ahead of a
//! newcomer (read by the score) and whether the engine is full (read by the limit, which then
//! does not grow).

use tokio::time::Instant;

use crate::backend::Backend;
use crate::engine_metrics::EngineSnapshot;

/// KV-cache usage from which an engine's cache is taken as full ([`kv_full`]).
const KV_FULL: f64 = 0.95;

/// What an engine's own numbers add ahead of a newcomer, in typical requests: those waiting in
/// its queue (from this router or any other), those it runs for other clients (`running`
/// beyond the router's requests in flight when the scrape finished: a new leader's first
/// picture of work it did not send), and one more when its KV cache is full (at least
/// [`KV_FULL`]): a new sequence starts only when one ends.
pub(super) fn engine_ahead(engine: &EngineSnapshot) -> f64 {
    let others = engine.running.saturating_sub(engine.in_flight_then);
    f64::from(engine.waiting) + f64::from(others) + if kv_full(engine) { 1.0 } else { 0.0 }
}

/// Whether an engine's KV cache is at least [`KV_FULL`] used (never, when it exports no usage).
fn kv_full(engine: &EngineSnapshot) -> bool {
    engine.kv_usage.is_some_and(|usage| usage >= KV_FULL)
}

/// Whether an engine's own numbers say it is full: requests wait in its queue *and* its KV
/// cache is at least [`KV_FULL`] used. Requests wait in an engine's queue between two of its
/// steps whenever they arrive faster than one a step, with room to spare (a scrape during a
/// burst of arrivals nearly always sees some), so a waiting count alone is no sign of a full
/// engine; with the KV cache full they wait for running sequences to end. An engine that does
/// not export its KV usage is never taken as full here.
fn is_full(engine: &EngineSnapshot) -> bool {
    engine.waiting > 0 && kv_full(engine)
}

/// Whether `backend`'s engine was full ([`is_full`]) at `at`, by its latest scrape then (never
/// without `[engine_metrics]` or a fresh scrape).
pub(super) fn engine_full(backend: &Backend, at: Instant) -> bool {
    backend.engine().snapshot(at).as_ref().is_some_and(is_full)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn engine(
        running: u32,
        waiting: u32,
        kv_usage: Option<f64>,
        in_flight_then: u32,
    ) -> EngineSnapshot {
        EngineSnapshot {
            running,
            waiting,
            kv_usage,
            max_concurrent: None,
            in_flight_then,
            age: Duration::ZERO,
        }
    }

    #[test]
    fn ahead_of_a_newcomer_are_the_waiting_others_running_and_a_full_cache() {
        // 3 waiting, 10 running of which the router sent 6: 4 are other clients'.
        assert_eq!(engine_ahead(&engine(10, 3, Some(0.5), 6)), 7.0);
        // Its own requests that ended since the scrape are no other client's work.
        assert_eq!(engine_ahead(&engine(4, 0, None, 6)), 0.0);
        // A full KV cache: a new sequence starts only when one ends.
        assert_eq!(engine_ahead(&engine(10, 3, Some(KV_FULL), 6)), 8.0);
    }

    #[test]
    fn an_engine_is_full_when_requests_wait_and_its_cache_is_full() {
        assert!(is_full(&engine(8, 2, Some(0.97), 8)));
        // Requests waiting between two steps with room in the cache: not full.
        assert!(!is_full(&engine(8, 2, Some(0.5), 8)));
        // A full cache and nothing waiting: not full.
        assert!(!is_full(&engine(8, 0, Some(0.99), 8)));
        // No KV usage exported: never taken as full.
        assert!(!is_full(&engine(8, 50, None, 8)));
    }
}
