//! The prefill a backend has still to do, as a pick reads it. A stream's first byte ends its
//! prefill, so for a replica that streams the core's count of uncached prompt tokens awaiting
//! their first byte ([`Backend::prefill_in_flight`]) is what it holds. A whole answer's head
//! comes at its end: counted that way, the prompt of a long answer would stay "queued" for
//! the whole answer, seconds after the engine prefilled it, and the prefill guard and the
//! score's prefill term would keep requests off that replica while its slots run short
//! answers. For a replica not seen streaming, the backlog is also estimated: each request's
//! uncached tokens join it at dispatch, and it drains at the backend's prefill rate (a leaky
//! bucket, kept as the time its prefill is expected to end); the smaller of the two counts.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;

use super::ttfb::PRIOR_PREFILL_SECONDS_PER_TOKEN;
use super::{LoadScore, Rank, Slot};
use crate::backend::Backend;

/// When the backend's prefill of what was sent to it is expected to end: nanoseconds since
/// [`epoch`] (0: nothing sent).
#[derive(Debug, Default)]
pub(super) struct Backlog {
    until: AtomicU64,
}

/// The instant the backlogs' times count from (the first one read in the process).
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn nanos_at(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(epoch()).as_nanos()).unwrap_or(u64::MAX)
}

/// The prefill rate a backend's backlog drains at: the learned one, else the prior.
fn rate_of(rank: Option<Rank>) -> f64 {
    rank.map_or(PRIOR_PREFILL_SECONDS_PER_TOKEN, |rank| rank.prefill_rate)
        .max(f64::MIN_POSITIVE)
}

impl LoadScore {
    /// A request with `prefill` uncached prompt tokens was sent to `backend`: they join its
    /// backlog, after what is still queued there.
    pub(crate) fn dispatched(&self, backend: &Backend, prefill: u64) {
        if prefill == 0 {
            return;
        }
        let slot = backend.strategy_slot::<Slot>();
        let rate = rate_of(slot.rank(self.state().generation));
        let seconds = prefill as f64 * rate;
        let added = (seconds * 1e9).min(u64::MAX as f64) as u64;
        let now = nanos_at(Instant::now());
        let _ = slot
            .backlog
            .until
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |until| {
                Some(until.max(now).saturating_add(added))
            });
    }

    /// The uncached prompt tokens `backend` has still to prefill at `now` (see the module
    /// docs): the tokens awaiting their first byte, and for a backend not seen streaming no
    /// more than its backlog has left at its prefill rate.
    pub(super) fn queued_prefill(backend: &Backend, rank: Option<Rank>, now: Instant) -> u64 {
        let awaiting = backend.prefill_in_flight();
        if awaiting == 0 || rank.is_some_and(|rank| rank.streams) {
            return awaiting;
        }
        let until = backend
            .strategy_slot::<Slot>()
            .backlog
            .until
            .load(Ordering::Relaxed);
        let left = until.saturating_sub(nanos_at(now)) as f64 / 1e9;
        let tokens = (left / rate_of(rank)).ceil();
        awaiting.min(tokens.min(u64::MAX as f64) as u64)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::testing::*;
    use crate::backend::{Backend, InFlightWork};
    use crate::strategies::{Pick, Strategy};

    /// Sends `backend` a request whose answer is not in yet: `prefill` uncached prompt tokens
    /// and 200 output tokens.
    fn sent(strategy: &QueuedLeastLatency, backend: &Backend, prefill: u64) {
        backend.acquire_work(&InFlightWork {
            prefill,
            output: 200,
        });
        strategy.on_dispatch(backend, prefill);
    }

    #[tokio::test(start_paused = true)]
    async fn a_whole_answers_prompt_leaves_the_backlog_at_the_prefill_rate() {
        // Two replicas that have not streamed: A runs one answer of a 30,000-token document
        // (3 s of prefill at the prior rate, 10,000 tokens a second), B two short ones.
        let set = vec![backend(70), backend(71)];
        let strategy = with_initial_limit(4.0);
        sent(&strategy, &set[0], 30_000);
        sent(&strategy, &set[1], 0);
        sent(&strategy, &set[1], 0);
        let document = "A long contract to summarise, clause after clause. ".repeat(800);
        let request = chat("Summarise.", &document);
        assert!(request.prompt_tokens() > 8_000);
        let queued = |backend: &Backend| strategy.queued_prefill(backend);
        // A is busy prefilling: the next document goes to B.
        assert_eq!(queued(&set[0]), 30_000);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
        // A second later, two thirds of it are left.
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(queued(&set[0]), 20_000);
        // After 4 s, the prompt is prefilled though the answer's head has not come (it comes
        // with its end): A, with one request decoding against B's two, takes the document.
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(set[0].prefill_in_flight(), 30_000);
        assert_eq!(queued(&set[0]), 0);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
        // A later request's prompt joins the backlog from now, not from when it was empty.
        sent(&strategy, &set[0], 5_000);
        assert_eq!(queued(&set[0]), 5_000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_streaming_replicas_prefill_lasts_until_its_first_byte() {
        // The same on replicas that stream: their first bytes say when a prefill ends, and A's
        // has not come.
        let set: Vec<Arc<Backend>> = vec![backend(72), backend(73)];
        let strategy = with_room(&set);
        sent(&strategy, &set[0], 30_000);
        sent(&strategy, &set[1], 0);
        sent(&strategy, &set[1], 0);
        let document = "A long contract to summarise, clause after clause. ".repeat(800);
        let request = chat("Summarise.", &document);
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(strategy.queued_prefill(&set[0]), 30_000);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
    }
}
