//! What an engine's own numbers say (with `[engine_metrics]` on): the work they add ahead of a
//! newcomer (read by the score) and whether the engine is full (read by the limit, which then
//! does not grow).

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
pub(super) fn engine_full(engine: &EngineSnapshot) -> bool {
    engine.waiting > 0 && kv_full(engine)
}
