//! `round-robin`: cycles through the current backends in order.
//!
//! Each pick takes the next index of a shared counter modulo the number of backends, so every
//! backend gets the same share whatever its speed or load. It never waits: with no backends the
//! request is answered 503 at once. Use it as a baseline, or when replicas are identical and
//! requests are uniform.
//!
//! ```toml
//! [strategy]
//! name = "round-robin"
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use figment::value::Value;
use serde::Deserialize;

use super::{
    Candidates, ParamsError, Pick, RequestInfo, Strategy, StrategyContext, StrategyEntry,
    parse_params,
};

/// Registry entry.
pub const ENTRY: StrategyEntry = StrategyEntry {
    name: "round-robin",
    summary: "cycles through the backends in order; no queueing",
    build,
};

/// `round-robin` takes no parameters.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {}

fn build(_context: &StrategyContext, params: &Value) -> Result<Arc<dyn Strategy>, ParamsError> {
    let Params {} = parse_params(params)?;
    Ok(Arc::new(RoundRobin::default()))
}

/// The round-robin strategy.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Strategy for RoundRobin {
    fn name(&self) -> &'static str {
        ENTRY.name
    }

    fn pick(&self, _request: &RequestInfo, candidates: Candidates<'_>) -> Option<Pick> {
        let count = candidates.len();
        if count == 0 {
            return None;
        }
        let (index, _) = candidates.nth(self.next.fetch_add(1, Ordering::Relaxed) % count)?;
        Some(Pick::at(index))
    }

    fn queues_when_unavailable(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;

    #[test]
    fn cycles_through_every_backend_in_order() {
        let strategy = RoundRobin::default();
        let set: Vec<_> = (0..3)
            .map(|i| Arc::new(Backend::new(format!("h{i}:1").parse().unwrap())))
            .collect();
        let picks: Vec<_> = (0..7)
            .map(|_| {
                strategy
                    .pick(&RequestInfo::default(), (&set).into())
                    .unwrap()
                    .index
            })
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0]);
        // The second backend excluded: the others in turn.
        let tried = [Arc::clone(&set[1])];
        let candidates = Candidates::new(&set).excluding(&tried);
        let picks: Vec<_> = (0..4)
            .map(|_| {
                strategy
                    .pick(&RequestInfo::default(), candidates)
                    .unwrap()
                    .index
            })
            .collect();
        assert!(picks.iter().all(|&index| index != 1), "{picks:?}");
    }
}
