//! The time to first byte a backend is expected to take without congestion: its own fixed delay
//! (the baseline) plus the prefill of the prompt tokens it had to compute at its prefill rate,
//! both read off streams' first bytes. The limit (`limit.rs`) judges each first byte against it.

use super::Learned;

/// How fast a raised TTFB baseline catches up (per sample of a backend using less than half of
/// its limit), so a replica that became slower for good is not judged against its old best
/// forever. Slow on purpose, and not from busy backends: under sustained overload every TTFB is
/// high, and a baseline that followed it would let the limit climb until the replicas' own
/// queues overflow.
const BASELINE_DRIFT: f64 = 0.002;
/// Prefill seconds per uncached prompt token assumed before a backend has shown its own: 10,000
/// tokens a second, a mid-size model on one current GPU.
pub(super) const PRIOR_PREFILL_SECONDS_PER_TOKEN: f64 = 1e-4;
/// Prompt tokens (the request's uncached ones and those queued ahead of it) from which a first
/// byte teaches the prefill rate: below, the backend's fixed delay dominates.
const MIN_PREFILL_SAMPLE: u64 = 256;
/// First bytes of long prompts after which a backend with no fixed delay known yet has its
/// first bytes judged on the prefill rate they taught.
const PREFILL_SAMPLES_TO_JUDGE: u32 = 16;
/// Weights of a prefill-rate sample below and above the current rate: the rate follows the
/// lower envelope of the samples, as queueing only ever adds to a first byte's delay.
const PREFILL_RATE_DOWN: f64 = 0.3;
/// See [`PREFILL_RATE_DOWN`].
const PREFILL_RATE_UP: f64 = 0.05;

/// What a stream's first byte is judged against.
#[derive(Debug, Clone, Copy)]
pub(super) struct Expected {
    /// Seconds to first byte expected without congestion.
    pub(super) seconds: f64,
    /// Whether the fixed delay is known (or the prefill rate was read off enough long prompts):
    /// until then no first byte is judged late.
    pub(super) known: bool,
}

impl Learned {
    /// Reads a stream's first byte after `ttfb` seconds, whose request and those queued ahead
    /// of it had `prefill` uncached prompt tokens, with `busy` requests in flight on the backend
    /// now, into the backend's fixed delay and prefill rate; returns what it was expected to
    /// take. Only a `certain` prefill (no part of the prompt possibly held beyond what the index
    /// predicted) teaches the rate: a prompt held but counted as uncached would make the
    /// prefill look fast, and the rate follows the fastest samples. A first byte while the
    /// backend holds its [ceiling](super::limit::Ceiling)'s count or more (and more than this
    /// request) does not raise the rate: it waited in the engine's own queue, and a rate that
    /// took that wait for prefill would price every miss on a busy replica several times over
    /// (the score) and hide its queue from the limit.
    pub(super) fn expect_first_byte(
        &mut self,
        ttfb: f64,
        prefill: u64,
        certain: bool,
        busy: f64,
    ) -> Expected {
        // The fixed delay is read off first bytes with little prefill: where the prefill is
        // long, an error in the rate would pass for a shorter (even zero) fixed delay, and every
        // short prompt after it would look late.
        // It drifts up only from first bytes of a backend using less than half of its limit (or
        // holding this request alone): under sustained load every first byte waits, and a
        // baseline that followed them would let the limit climb until the replica's own queue
        // holds what the router queue should.
        let residual = (ttfb - prefill as f64 * self.prefill_rate).max(0.0);
        let drifts = busy < self.limit / 2.0 || busy <= 1.0;
        let baseline = match self.history.ttfb_baseline {
            _ if prefill >= MIN_PREFILL_SAMPLE => self.history.ttfb_baseline,
            Some(old) if residual >= old && !drifts => Some(old),
            Some(old) if residual >= old => Some(old + (residual - old) * BASELINE_DRIFT),
            _ => Some(residual),
        };
        self.history.ttfb_baseline = baseline;
        // Until the fixed delay is known (or the prefill rate is read off enough long prompts)
        // no first byte is judged late: the expected time would be a guess at the prior rate,
        // and one early sample would end the slow start.
        let known = baseline.is_some() || self.history.prefill_samples >= PREFILL_SAMPLES_TO_JUDGE;
        let baseline = baseline.unwrap_or(0.0);
        if prefill >= MIN_PREFILL_SAMPLE && certain {
            self.history.prefill_samples = self.history.prefill_samples.saturating_add(1);
            let sample = (ttfb - baseline).max(0.0) / prefill as f64;
            let queued = busy > 1.0 && self.history.at_ceiling(busy);
            let weight = if sample < self.prefill_rate {
                PREFILL_RATE_DOWN
            } else if queued {
                0.0
            } else {
                PREFILL_RATE_UP
            };
            self.prefill_rate += weight * (sample - self.prefill_rate);
        }
        Expected {
            seconds: baseline + prefill as f64 * self.prefill_rate,
            known,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::strategies::Strategy;

    #[test]
    fn a_long_prefill_is_not_congestion_and_teaches_the_prefill_rate() {
        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(3);
        busy(&replica, 3);
        // A replica with 20 ms of fixed delay prefilling 20,000 tokens a second: prompts from
        // 500 to 32,000 uncached tokens, some with others' prefill queued ahead.
        let rate = 1.0 / 20_000.0;
        let mut limits = Vec::new();
        for i in 0..200u64 {
            let uncached = 500 + (i * 7_919) % 31_500;
            let queued = (i % 3) * 4_000;
            let ttfb = 0.02 + (uncached + queued) as f64 * rate;
            strategy.on_first_byte(&replica, &first_byte_on(&replica, ttfb, uncached, queued));
            limits.push(strategy.limit(&replica));
        }
        let learned = strategy.prefill_rate(&replica);
        assert!((learned / rate - 1.0).abs() < 0.25, "{learned}");
        assert!(
            limits.windows(2).all(|w| w[1] >= w[0]),
            "the limit never dropped: {limits:?}"
        );
        // The same prompts with a second of queueing on top are late.
        let before = strategy.limit(&replica);
        strategy.on_first_byte(
            &replica,
            &first_byte_on(&replica, 1.02 + 8_000.0 * rate, 8_000, 0),
        );
        assert!(strategy.limit(&replica) < before);
    }

    #[test]
    fn a_first_byte_that_waited_in_the_engines_own_queue_does_not_teach_the_prefill_rate() {
        // A replica with 20 ms of fixed delay, prefilling 20,000 tokens a second, found a
        // ceiling at 5 in flight (a fifth request waited inside it), then showed its rate on
        // 4,000-token prompts with 4 in flight.
        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(9);
        find_a_ceiling(&strategy, &replica);
        let rate = 1.0 / 20_000.0;
        let prefill = 0.02 + 4_000.0 * rate;
        for _ in 0..40 {
            strategy.on_first_byte(&replica, &first_byte_on(&replica, prefill, 4_000, 0));
        }
        let learned = strategy.prefill_rate(&replica);
        assert!((learned / rate - 1.0).abs() < 0.25, "{learned}");
        // Sent past the ceiling (6 in flight), every first byte waits half a second in the
        // engine's own queue on top: that wait is not prefill, and the rate stays.
        busy(&replica, 2);
        for _ in 0..200 {
            strategy.on_first_byte(&replica, &first_byte_on(&replica, prefill + 0.5, 4_000, 0));
        }
        assert_eq!(strategy.prefill_rate(&replica), learned);
        // The same first bytes of a request alone there do raise it (late ones lower the
        // ceiling, down to one): a replica that became slower to prefill is learned again.
        for _ in 0..5 {
            replica.release();
        }
        for _ in 0..200 {
            strategy.on_first_byte(&replica, &first_byte_on(&replica, prefill + 0.5, 4_000, 0));
        }
        assert!(
            strategy.prefill_rate(&replica) > 2.0 * learned,
            "{}",
            strategy.prefill_rate(&replica)
        );
    }

    #[test]
    fn sustained_queueing_does_not_become_the_baseline() {
        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(6);
        busy(&replica, 4);
        strategy.on_first_byte(&replica, &first_byte_on(&replica, 0.025, 0, 0));
        // Twenty seconds of overload: every first byte waits 300 ms in the replica's own queue
        // while the router keeps it busy. Each is late, and stays late: the limit never climbs
        // back (were the baseline to follow, 0.3 s would read as on time within a few hundred
        // samples and the limit would grow without bound).
        for _ in 0..2_000 {
            strategy.on_first_byte(&replica, &first_byte_on(&replica, 0.3, 0, 0));
        }
        assert_eq!(strategy.limit(&replica), 1.0);
        // A backend holding only the request itself measures its fixed delay: a replica that
        // became slower for good is learned again.
        let alone = backend(7);
        busy(&alone, 1);
        strategy.on_first_byte(&alone, &first_byte_on(&alone, 0.025, 0, 0));
        for _ in 0..3_000 {
            strategy.on_first_byte(&alone, &first_byte_on(&alone, 0.3, 0, 0));
        }
        busy(&alone, 3);
        let before = strategy.limit(&alone);
        strategy.on_first_byte(&alone, &first_byte_on(&alone, 0.3, 0, 0));
        assert!(strategy.limit(&alone) >= before);
    }

    #[test]
    fn no_first_byte_is_late_before_the_fixed_delay_is_known() {
        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(5);
        busy(&replica, 4);
        // The first streams all have long prompts: their first bytes, slower than the prior
        // prefill rate predicts, cannot tell queueing from prefill yet. The slow start goes on.
        for _ in 0..3 {
            let before = strategy.limit(&replica);
            strategy.on_first_byte(&replica, &first_byte_on(&replica, 0.5, 1_000, 0));
            assert_eq!(strategy.limit(&replica), before + 2.0);
        }
        // A short prompt's first byte gives the fixed delay; from then on a late one counts.
        strategy.on_first_byte(&replica, &first_byte_on(&replica, 0.02, 0, 0));
        let before = strategy.limit(&replica);
        strategy.on_first_byte(&replica, &first_byte_on(&replica, 3.0, 1_000, 0));
        assert!(strategy.limit(&replica) < before);
    }
}
