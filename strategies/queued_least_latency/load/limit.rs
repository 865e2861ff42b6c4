//! The concurrency limit, learned from streams' first bytes as they arrive: within the
//! tolerated time (`ttfb.rs`'s expected time × `ttfb_tolerance` + `ttfb_slack`, with at least
//! half of the limit in use) it grows, by two per first byte until the first late one (slow
//! start), by about √limit / 5 after; a later first byte lowers it in proportion, once per
//! round. A late first byte of a request that tested the limit sets a [`Ceiling`], held for a
//! while, then probed. An engine that says it is full keeps the limit from growing.

use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::cache::learn_cache_from_first_byte;
use super::engine::engine_full;
use super::ttfb::Expected;
use super::{History, Learned, LoadScore, Slot};
use crate::backend::Backend;
use crate::strategies::FirstByte;

/// Weight of a new limit estimate.
const LIMIT_SMOOTHING: f64 = 0.2;
/// Rounds (the ceiling's count of on-time first bytes) the limit stays below a ceiling after
/// its first failed probe.
const PROBE_HOLD_ROUNDS: f64 = 2.0;
/// Doublings of the hold after failed probes in a row: at most 2⁴ × 2 rounds between probes.
const MAX_PROBE_BACKOFF: u8 = 4;
/// A probe of a ceiling is on time within this multiple of the expected time to first byte
/// plus [`PROBE_SLACK`] (stricter than `ttfb_tolerance`): a request that waited for a slot
/// inside the replica did not find room, whatever the tolerance for noise elsewhere.
const PROBE_TOLERANCE: f64 = 1.25;
/// A first byte this many times past the tolerated time says its request's count in flight
/// was too many even well within the limit.
const CLEARLY_LATE: f64 = 2.0;
/// Seconds a probe's first byte may come after the expected time × [`PROBE_TOLERANCE`].
const PROBE_SLACK: f64 = 0.005;

impl History {
    /// The limit a held ceiling sets for requests none of whose prompt the backend holds: the
    /// [held cap](Self::held_cap) while the hold lasts, then one above it (one probe at the
    /// count), and none without a ceiling.
    pub(super) fn cap(&self) -> f64 {
        match self.ceiling {
            Some(ceiling) if ceiling.hold == 0 => self.held_cap() + 1.0,
            _ => self.held_cap(),
        }
    }

    /// The limit a held ceiling sets for a request that must not probe it (one the router queue
    /// put ahead of an older request: a probe may wait inside the replica): just below its
    /// count, hold or not, and none without a ceiling.
    pub(super) fn held_cap(&self) -> f64 {
        self.ceiling
            .map_or(f64::INFINITY, |ceiling| ceiling.count - 0.5)
    }

    /// Whether `busy` requests in flight reach the ceiling's count: past it, requests wait in
    /// the engine's own queue.
    pub(super) fn at_ceiling(&self, busy: f64) -> bool {
        self.ceiling.is_some_and(|ceiling| busy >= ceiling.count)
    }
}

/// A count of requests in flight found to be one too many: a request that took the last slot
/// the limit allowed had its first byte late (it waited inside the replica, behind the ones it
/// runs). Requests none of whose prompt the backend holds stay below it for a while, then one
/// probes it again: the ceiling is lifted after an on-time probe, held twice as long after each
/// further failure (the probe costs the request that makes it a wait in the replica's own
/// queue, out of the router queue's order). A request whose prompt the backend holds in part
/// may still go up to the limit: waiting inside the engine that holds its prefix is worth more
/// to it than a free slot elsewhere. Nor does a ceiling hold a backend well below the fleet's
/// mean count in flight (the score's `Demand::mean_in_flight`): it is read off first bytes
/// judged against an expected time that may be wrong, and there least-loaded would send the
/// request.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ceiling {
    /// The count that was one too many.
    count: f64,
    /// On-time first bytes still to see before the limit may reach `count` again.
    hold: u32,
    /// Failed probes in a row (the hold doubles with each, up to [`MAX_PROBE_BACKOFF`]).
    failures: u8,
    /// When it was found: a late first byte of a request sent before then is of the same round.
    set_at: Instant,
}

impl LoadScore {
    /// Folds a stream's first byte into `backend`'s prefill rate, fixed delay and limit. While
    /// the engine's own numbers say it is full ([`engine_full`]), the limit does not grow,
    /// whatever the first bytes say.
    pub(crate) fn learn_first_byte(&self, backend: &Backend, first_byte: &FirstByte) {
        let busy = backend.in_flight() as f64;
        // When the first byte came: no clock read of its own.
        let after = std::time::Duration::try_from_secs_f64(first_byte.seconds).unwrap_or_default();
        let at = first_byte.dispatched_at + after;
        let full = engine_full(backend, at);
        let slot = backend.strategy_slot::<Slot>();
        let _ = slot
            .answered
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < u64::from(u32::MAX)).then_some(n + 1)
            });
        // A request sent past the limit on purpose ([`Self::overflow`]) was expected to wait
        // for a slot: however late, its first byte says nothing new about the limit, nor about
        // the cache. One sent to a backend using more than half of its limit may have waited
        // inside the replica: it is no proof of a cache miss.
        let mut judged = None;
        self.update(backend, |learned, _| {
            if first_byte.streamed && !first_byte.past_limit {
                let limit = learned.limit;
                let expected = self.learn_ttfb(learned, first_byte, busy);
                let sent_to = first_byte.in_flight as f64;
                if expected.known {
                    let congested = sent_to > 1.0 && sent_to > limit / 2.0;
                    judged = Some((expected.seconds, learned.prefill_rate, congested));
                }
                if full {
                    learned.limit = learned.limit.min(limit);
                }
            }
        });
        if let Some((expected, rate, congested)) = judged {
            learn_cache_from_first_byte(backend, first_byte, expected, rate, congested);
        }
    }

    /// A stream's first byte after `first_byte.seconds`, with `busy` requests in flight on the
    /// backend now.
    ///
    /// The TTFB expected without congestion is the backend's fixed delay (the baseline) plus the
    /// prefill of the prompt tokens it had to compute — this request's uncached ones and those
    /// queued ahead of it — at its prefill rate. Within `ttfb_tolerance` × that + `ttfb_slack`,
    /// the limit grows ([`Self::grow`]). A later first byte lowers it in proportion (a
    /// gradient, at most halving the estimate), once per round: not for a request sent before
    /// the last decrease. A late first byte of a request that tested the limit (it took the last
    /// slot the limit allowed, or it was clearly late) finds a [`Ceiling`]; a probe of a ceiling
    /// is judged by the stricter [`PROBE_TOLERANCE`].
    ///
    /// Returns what the first byte was expected to take.
    fn learn_ttfb(&self, state: &mut Learned, first_byte: &FirstByte, busy: f64) -> Expected {
        let prefill = first_byte.uncached_tokens + first_byte.queued_tokens;
        state.history.streamed = true;
        // Blocks recorded past the index's reach may have been held: the prefill is uncertain.
        let certain = first_byte.recall.stale == 0;
        let expected = state.expect_first_byte(first_byte.seconds, prefill, certain, busy);
        if expected.known {
            self.judge_ttfb(state, first_byte, busy, expected.seconds);
        } else {
            self.grow(state, busy);
        }
        expected
    }

    /// Judges a first byte against the `expected` seconds: the limit grows, or is lowered, or
    /// finds a ceiling ([`Self::learn_ttfb`]).
    fn judge_ttfb(&self, state: &mut Learned, first_byte: &FirstByte, busy: f64, expected: f64) {
        let ttfb = first_byte.seconds;
        let tolerated = self.ttfb_tolerance * expected + self.ttfb_slack;
        let count = first_byte.in_flight as f64;
        let ceiling = state.history.ceiling;
        // A probe: the request went at (or past) the ceiling's count once its hold was over.
        let probe = ceiling.is_some_and(|c| {
            c.hold == 0 && count >= c.count && first_byte.dispatched_at >= c.set_at
        });
        // The limit this request was held to, if none of its prompt was cached there.
        let allowed = state.limit.min(state.history.cap());
        let on_time = if probe {
            ttfb <= PROBE_TOLERANCE * expected + PROBE_SLACK
        } else {
            ttfb <= tolerated
        };
        if on_time {
            if probe {
                // Room at that count now: the limit grows past it.
                state.history.ceiling = None;
            } else if busy >= allowed / 2.0
                && let Some(ceiling) = state.history.ceiling.as_mut()
            {
                ceiling.hold = ceiling.hold.saturating_sub(1);
            }
            self.grow(state, busy);
            return;
        }
        // Late. A request that took the last slot the limit allows (or more) found no room:
        // that count is one too many, for a while. So is any count whose request came clearly
        // late (a limit overshot in slow start), not just past the noise of the expected time.
        let tested = count + 1.0 > allowed || probe || ttfb > CLEARLY_LATE * tolerated;
        // Past the tolerance for noise, the limit is lowered in proportion, once per round.
        if ttfb > tolerated {
            state.history.congested = true;
            let same_round = state
                .history
                .lowered_at
                .is_some_and(|lowered| first_byte.dispatched_at < lowered);
            if !same_round {
                state.history.lowered_at = Some(Instant::now());
                let target = state.limit * (tolerated / ttfb.max(1e-6)).clamp(0.5, 1.0);
                state.limit = ((1.0 - LIMIT_SMOOTHING) * state.limit + LIMIT_SMOOTHING * target)
                    .clamp(1.0, self.max_limit);
            }
        }
        // A probe that missed only its stricter bound keeps the limit below the ceiling, with
        // no decrease beyond it.
        if tested {
            self.found_ceiling(state, count, probe);
        }
    }

    /// An on-time first byte on a backend using at least half of its limit: slow start (two
    /// more, undamped) until the first late one, about √limit / 5 more after.
    fn grow(&self, state: &mut Learned, busy: f64) {
        if busy < state.limit / 2.0 {
            return;
        }
        let grown = if state.history.congested {
            (1.0 - LIMIT_SMOOTHING) * state.limit
                + LIMIT_SMOOTHING * (state.limit + state.limit.sqrt())
        } else {
            // Slow start, undamped: two more per first byte, as a stream keeps its slot after
            // it (one for the slot, one for growth): the limit doubles every round even when
            // every answer is a long stream, where one more per first byte would let one more
            // request go per round only.
            state.limit + 2.0
        };
        state.limit = grown.clamp(1.0, self.max_limit);
    }

    /// A late first byte of a request dispatched with `count` in flight that tested the limit:
    /// `count` is a ceiling for the hold, which doubles when the request was a probe of the
    /// ceiling in place.
    fn found_ceiling(&self, state: &mut Learned, count: f64, probe: bool) {
        let count = count.max(1.0);
        let failures = match state.history.ceiling.as_mut() {
            None => 0,
            Some(ceiling) if probe => ceiling.failures.saturating_add(1).min(MAX_PROBE_BACKOFF),
            // Not a probe (sent in the same round, or while the ceiling holds by a request that
            // may pass it): a lower count lowers the ceiling, nothing else.
            Some(ceiling) => {
                ceiling.count = ceiling.count.min(count);
                return;
            }
        };
        let rounds = PROBE_HOLD_ROUNDS * count * f64::from(1u32 << failures);
        state.history.ceiling = Some(Ceiling {
            count,
            hold: rounds.min(f64::from(u32::MAX)) as u32,
            failures,
            set_at: Instant::now(),
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::super::testing::*;
    use crate::strategies::{FirstByte, Strategy};

    #[test]
    fn the_limit_doubles_each_round_of_fast_first_bytes_until_one_is_late() {
        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(1);
        // An engine with room for 256 streams answering its first byte in 50 ms. Each round,
        // the requests the limit has room for are sent; their first bytes come back and the
        // streams keep their slots. Within 6 rounds (300 ms) the limit is there: not within
        // 252 answers of several seconds each, nor one more request per round.
        let mut rounds = 0;
        while strategy.limit(&replica) < 256.0 {
            let room = (strategy.limit(&replica) as usize).saturating_sub(replica.in_flight());
            busy(&replica, room);
            for _ in 0..room {
                strategy.on_first_byte(&replica, &first_byte_on(&replica, 0.05, 0, 0));
            }
            rounds += 1;
            assert!(
                rounds <= 6,
                "limit {} after {rounds} rounds",
                strategy.limit(&replica)
            );
        }
        // Under half of the limit in use, a fast first byte says nothing about capacity.
        let idle = backend(2);
        for _ in 0..50 {
            strategy.on_first_byte(&idle, &first_byte_on(&idle, 0.05, 0, 0));
        }
        assert_eq!(strategy.limit(&idle), strategy.load_score().initial_limit);
        // A late first byte ends the slow start: the limit drops, then grows by √limit / 5.
        let found = strategy.limit(&replica);
        strategy.on_first_byte(&replica, &first_byte_on(&replica, 1.0, 0, 0));
        let after = strategy.limit(&replica);
        assert!(after < found * 0.95, "{after} after {found}");
        strategy.on_first_byte(&replica, &first_byte_on(&replica, 0.05, 0, 0));
        let grown = strategy.limit(&replica) - after;
        assert!(grown > 0.0 && grown < 0.25 * after.sqrt(), "{grown}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_limit_is_lowered_once_per_round_of_requests_sent_after_the_last_decrease() {
        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(4);
        while strategy.limit(&replica) < 100.0 {
            let limit = strategy.limit(&replica) as usize;
            busy(&replica, limit.saturating_sub(replica.in_flight()));
            strategy.on_first_byte(&replica, &first_byte_on(&replica, 0.05, 0, 0));
        }
        // Fifty requests were sent under the limit of 100; their first bytes come late, one
        // after the other. The first lowers the limit; the others were sent before that and
        // say nothing about the lower limit.
        let sent = Instant::now();
        tokio::time::advance(Duration::from_secs(2)).await;
        let late = |dispatched_at, in_flight| FirstByte {
            dispatched_at,
            in_flight,
            ..first_byte(2.0, 0, 0)
        };
        strategy.on_first_byte(&replica, &late(sent, 100));
        let lowered = strategy.limit(&replica);
        assert!(lowered < 95.0, "{lowered}");
        for _ in 0..49 {
            strategy.on_first_byte(&replica, &late(sent, 100));
        }
        assert_eq!(strategy.limit(&replica), lowered);
        // A request sent after the decrease that is late again lowers it again.
        let resent = Instant::now();
        tokio::time::advance(Duration::from_secs(2)).await;
        strategy.on_first_byte(&replica, &late(resent, lowered as usize));
        assert!(strategy.limit(&replica) < lowered);
    }

    #[tokio::test(start_paused = true)]
    async fn a_count_found_one_too_many_holds_the_limit_below_it_until_probed_again() {
        // A replica of 4 slots answering its first byte in 20 ms when a slot is free.
        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(8);
        busy(&replica, 1);
        strategy.on_first_byte(&replica, &sent_with(1, 0.02));
        busy(&replica, 3);
        // Slow start: 4, 6, 8, 10.
        for _ in 0..3 {
            strategy.on_first_byte(&replica, &sent_with(4, 0.02));
        }
        assert_eq!(strategy.limit_without_prefix(&replica), 10.0);
        // The fifth request waited 200 ms in the replica for a slot: 5 is one too many, a
        // request without a cached prefix stays below it at once (a gradient alone would take
        // rounds).
        strategy.on_first_byte(&replica, &sent_with(5, 0.2));
        assert_eq!(strategy.limit_without_prefix(&replica), 4.5);
        // Two rounds of on-time first bytes (10) keep it there; then it reaches 5: a probe.
        for _ in 0..9 {
            strategy.on_first_byte(&replica, &sent_with(4, 0.02));
            assert!(strategy.limit_without_prefix(&replica) < 5.0);
        }
        strategy.on_first_byte(&replica, &sent_with(4, 0.02));
        assert!(strategy.limit_without_prefix(&replica) >= 5.0);
        // The probe waits 20 ms for a slot: within the tolerance for noise (60 ms), not within
        // the probe's (30 ms). Back below 5, with no further decrease, for twice as long.
        tokio::time::advance(Duration::from_millis(1)).await;
        strategy.on_first_byte(&replica, &sent_with(5, 0.04));
        assert_eq!(strategy.limit_without_prefix(&replica), 4.5);
        for _ in 0..19 {
            strategy.on_first_byte(&replica, &sent_with(4, 0.02));
            assert!(strategy.limit_without_prefix(&replica) < 5.0);
        }
        strategy.on_first_byte(&replica, &sent_with(4, 0.02));
        assert!(strategy.limit_without_prefix(&replica) >= 5.0);
        // The replica has more room now: the probe's first byte is on time and the limit grows
        // past 5.
        tokio::time::advance(Duration::from_millis(1)).await;
        strategy.on_first_byte(&replica, &sent_with(5, 0.021));
        busy(&replica, 1);
        for _ in 0..4 {
            strategy.on_first_byte(&replica, &sent_with(5, 0.02));
        }
        assert!(
            strategy.limit_without_prefix(&replica) >= 6.0,
            "{}",
            strategy.limit_without_prefix(&replica)
        );
    }
}
