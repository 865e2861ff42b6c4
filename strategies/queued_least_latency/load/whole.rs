//! The concurrency limit of a replica that answers whole (non-streamed): the load where it
//! finishes the most, learned from what its answers took.
//!
//! A whole answer's head comes at its end, so there is no first byte to tell queueing inside
//! the replica from prefill and decode. What an answer does tell is how fast the replica produced
//! it at the load it ran under: its output (the answer's `usage` tokens, else its KiB) over its
//! latency, times the requests it shared the replica with (the mean of the counts in flight at
//! its dispatch and at its end) is the replica's throughput at that load. An engine batches: as
//! long as the load is within its sequences, more requests in flight finish more output a
//! second (each step is a little slower, but carries more of them); past them, requests wait in
//! the engine's own queue, and the throughput stays flat while latency grows. The limit is the
//! knee of that curve:
//!
//! - the throughput is kept per load, in buckets √2 apart (an EWMA in each), a window of
//!   [`WINDOW`] answers a sample;
//! - while the throughput at the highest load read is still rising ([`RISING`] over the
//!   nearest load read below it: the limit may grow past a bucket within one window, and an
//!   unread bucket says nothing), and the requests press against the limit, the limit grows (a
//!   fifth of its square root an answer), up to [`AHEAD`] buckets above the highest load read;
//! - once it is no longer rising, the limit is the lowest load whose throughput is within
//!   [`NEAR_BEST`] of the best, the lower edge of its bucket (past the knee the replica gains
//!   nothing, and requests would only wait inside it, out of the router queue's order).
//!
//! While the engine's own numbers say it is full (`[engine_metrics]`: requests wait in its queue
//! and its KV cache is full, `engine.rs`), the limit does not grow, as for streams. A replica
//! that streams moves its limit by its streams' first bytes instead (`limit.rs`).

use super::{Learned, LoadScore};
use crate::strategies::Outcome;

/// Answers a throughput window holds.
pub(super) const WINDOW: u32 = 12;
/// Buckets of load, √2 apart from 1 request: the last holds 2¹² requests and more.
pub(super) const BUCKETS: usize = 25;
/// Weight of a new throughput sample in its bucket.
const SMOOTHING: f64 = 0.25;
/// Windows a bucket needs before it is read.
const SAMPLES: u32 = 1;
/// How far above the highest load read the limit may grow (in buckets, √2 apart): it does not
/// outrun what the windows can tell. (A window's load, the mean of the counts at its answers'
/// dispatch and end, can read as low as half the limit when answers start and end together.)
const AHEAD: usize = 2;
/// The elasticity of the throughput to the load, from the nearest load read below the highest
/// one to it, that says "still rising": 1 when answers take as long at any load, about 0.5 near
/// the sequences of an engine whose full batch steps 2.5 times slower than one sequence, 0
/// past its sequences.
const RISING: f64 = 0.25;
/// Within this share of the best throughput, a load is as good as the best.
const NEAR_BEST: f64 = 0.95;
/// Weight of the grown limit in the limit after a whole answer (as the first bytes' slow
/// growth).
const GROWTH_SMOOTHING: f64 = 0.2;

/// The throughput a replica showed at each load, and the window being filled.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Throughput {
    buckets: [Bucket; BUCKETS],
    window: Window,
    /// The knee's limit, once the throughput stopped rising.
    held: Option<f64>,
}

/// The answers of the window being filled.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    /// Output of its answers.
    output: f64,
    /// Seconds its answers took, summed.
    seconds: f64,
    /// The load each of its answers ran under, summed.
    load: f64,
    answers: u32,
}

/// The throughput at one load.
#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Output units (tokens or KiB) a second, smoothed.
    rate: f64,
    /// The windows' load, smoothed alike.
    load: f64,
    samples: u32,
}

/// The bucket of a load of `load` requests (at least one).
fn bucket_of(load: f64) -> usize {
    ((2.0 * load.max(1.0).log2()).floor() as usize).min(BUCKETS - 1)
}

/// The load a bucket stands for (its lower edge).
fn load_of(bucket: usize) -> f64 {
    2f64.powf(bucket as f64 / 2.0)
}

impl Throughput {
    /// An answer of `output` units that took `seconds` under a load of `load` requests: when it
    /// closes a window, the window's mean load (its throughput, `load` × output ÷ seconds, is
    /// folded into that load's bucket).
    fn answer(&mut self, output: f64, seconds: f64, load: f64) -> Option<f64> {
        let window = &mut self.window;
        window.output += output;
        window.seconds += seconds.max(0.0);
        window.load += load;
        window.answers += 1;
        if window.answers < WINDOW {
            return None;
        }
        let window = std::mem::take(&mut self.window);
        let load = window.load / f64::from(window.answers);
        if window.seconds <= 0.0 {
            return None;
        }
        self.record(load, load * window.output / window.seconds);
        Some(load)
    }

    /// Folds in a sample: `rate` output units a second at `load` requests.
    fn record(&mut self, load: f64, rate: f64) {
        let bucket = &mut self.buckets[bucket_of(load)];
        if bucket.samples == 0 {
            (bucket.rate, bucket.load) = (rate, load);
        } else {
            bucket.rate += SMOOTHING * (rate - bucket.rate);
            bucket.load += SMOOTHING * (load - bucket.load);
        }
        bucket.samples = bucket.samples.saturating_add(1);
    }

    /// The most the limit may grow to now: [`AHEAD`] buckets above the highest load read (no
    /// bound before one is).
    fn reach(&self) -> f64 {
        (0..BUCKETS)
            .rev()
            .find(|&bucket| self.rate(bucket).is_some())
            .map_or(f64::INFINITY, |top| load_of(top + AHEAD + 1))
    }

    /// The most the limit may be now: the held knee, and no more than [`Self::reach`] allows
    /// (at least `initial`).
    fn ceiling(&self, initial: f64) -> f64 {
        self.held
            .unwrap_or(f64::INFINITY)
            .min(self.reach().max(initial))
            .max(1.0)
    }

    fn rate(&self, bucket: usize) -> Option<f64> {
        let bucket = self.buckets.get(bucket)?;
        (bucket.samples >= SAMPLES).then_some(bucket.rate)
    }

    /// After a window at `load`: the knee's limit when the throughput at the highest load read
    /// has stopped rising, `None` while it rises; unchanged (`held`) when the window says
    /// nothing new (a load under the highest read, or one whose bucket has too few windows).
    fn knee(&self, load: f64) -> Option<f64> {
        let read: Vec<(usize, f64)> = (0..BUCKETS)
            .filter_map(|bucket| Some((bucket, self.rate(bucket)?)))
            .collect();
        let Some(&(top, top_rate)) = read.last() else {
            return self.held;
        };
        if bucket_of(load) != top {
            return self.held;
        }
        // The nearest load read below the top: the limit grows a bucket at a time, but a window
        // may still land two buckets up (or an earlier one may be missing), and an unread
        // bucket between says nothing of whether the top still rises.
        let below = read
            .len()
            .checked_sub(2)
            .map(|index| (self.buckets[read[index].0].load, read[index].1));
        let rising = below.is_none_or(|(below_load, below_rate)| {
            let loads = (self.buckets[top].load / below_load).ln();
            loads <= 0.0 || (top_rate / below_rate).ln() >= RISING * loads
        });
        if rising {
            return None;
        }
        let best = read.iter().map(|&(_, rate)| rate).fold(0.0, f64::max);
        read.iter()
            .find(|&&(_, rate)| rate >= NEAR_BEST * best)
            .map(|&(bucket, _)| load_of(bucket))
    }
}

impl LoadScore {
    /// After a whole answer's end on a replica that never streamed: the throughput window it
    /// belongs to, and when that closes, the limit that follows (see the module docs).
    /// `in_flight_now` is the backend's count as the answer ended (itself included);
    /// `engine_full`, whether the engine's own numbers then said it is full.
    pub(super) fn learn_whole(
        &self,
        state: &mut Learned,
        outcome: &Outcome,
        in_flight_now: usize,
        engine_full: bool,
    ) {
        if outcome.failed || outcome.streamed || state.history.streamed {
            return;
        }
        let output = match outcome.usage {
            Some(usage) if usage.completion_tokens > 0 => usage.completion_tokens as f64,
            _ => (outcome.bytes as f64 / 1024.0).max(1.0 / 8.0),
        };
        let throughput = &mut state.history.throughput;
        let load = (outcome.in_flight + in_flight_now) as f64 / 2.0;
        if let Some(load) = throughput.answer(output, outcome.latency, load) {
            throughput.held = throughput.knee(load);
        }
        let grown = if engine_full {
            state.limit
        } else {
            (1.0 - GROWTH_SMOOTHING) * state.limit
                + GROWTH_SMOOTHING * (state.limit + state.limit.sqrt())
        };
        state.limit = grown
            .min(throughput.ceiling(self.initial_limit))
            .min(self.max_limit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The throughput of an engine of `slots` sequences whose step takes `1 + growth × batch`
    /// at a load of `load` requests: each finishes a token per step while it holds a slot.
    fn engine(slots: f64, growth: f64, load: f64) -> f64 {
        let batch = load.min(slots);
        batch / (1.0 + growth * batch)
    }

    /// Runs windows against an engine whose load follows the limit the knee leaves it (a load
    /// that presses it, growing by a quarter a window while nothing holds it).
    fn settle(slots: f64, growth: f64) -> f64 {
        let mut throughput = Throughput::default();
        let mut limit = 4.0_f64;
        for _ in 0..400 {
            let load = limit.floor().max(1.0);
            throughput.record(load, engine(slots, growth, load));
            throughput.held = throughput.knee(load);
            limit = (limit * 1.25).min(throughput.ceiling(4.0));
        }
        limit
    }

    #[test]
    fn the_limit_settles_within_a_bucket_under_the_sequences_an_engine_batches() {
        for (slots, growth) in [
            (4.0, 0.25),
            (6.0, 0.05),
            (8.0, 0.05),
            (8.0, 0.2),
            (32.0, 0.01),
            (100.0, 0.005),
        ] {
            let limit = settle(slots, growth);
            assert!(
                limit >= slots / 2f64.sqrt() && limit <= slots,
                "{slots} sequences, growth {growth}: limit {limit}"
            );
        }
    }

    #[test]
    fn nothing_holds_the_limit_while_the_throughput_rises() {
        let mut throughput = Throughput::default();
        for (load, rate) in [(2.0, 2.0), (3.0, 2.9), (4.0, 3.8)] {
            for _ in 0..SAMPLES {
                throughput.record(load, rate);
            }
        }
        assert_eq!(throughput.knee(4.0), None);
        // Flat past 4: held at the lowest load near the best.
        for _ in 0..SAMPLES {
            throughput.record(6.0, 3.8);
        }
        assert_eq!(throughput.knee(6.0), Some(load_of(bucket_of(4.0))));
        // Flat from 4 to 8 with the bucket between unread (the limit grew past it within one
        // window): not rising, held at 4.
        let mut skipped = Throughput::default();
        for (load, rate) in [(2.0, 2.0), (4.0, 3.8), (8.0, 3.8)] {
            for _ in 0..SAMPLES {
                skipped.record(load, rate);
            }
        }
        assert_eq!(skipped.knee(8.0), Some(4.0));
        // A window under the highest load read says nothing new.
        let mut held = throughput;
        held.held = Some(4.8);
        assert_eq!(held.knee(3.0), Some(4.8));
    }

    #[test]
    fn a_window_of_answers_gives_its_mean_load_and_its_throughput_there() {
        let mut throughput = Throughput::default();
        let mut closed = None;
        for answer in 0..WINDOW {
            // Loads 4 and 6 in turn; 10 tokens in 2 s each.
            let load = if answer % 2 == 0 { 4.0 } else { 6.0 };
            closed = throughput.answer(10.0, 2.0, load);
            if answer + 1 < WINDOW {
                assert_eq!(closed, None);
            }
        }
        assert_eq!(closed, Some(5.0), "the last answer closes the window");
        // 5 requests in flight, each 5 tokens a second.
        let bucket = throughput.buckets[bucket_of(5.0)];
        assert!((bucket.rate - 25.0).abs() < 1e-9, "{}", bucket.rate);
        // The next answer opens a new window.
        assert_eq!(throughput.answer(10.0, 2.0, 4.0), None);
    }

    #[test]
    fn buckets_are_root_two_apart() {
        assert_eq!(bucket_of(0.5), 0);
        assert_eq!(bucket_of(1.0), 0);
        assert_eq!(bucket_of(1.5), 1);
        assert_eq!(bucket_of(2.0), 2);
        assert_eq!(bucket_of(3.0), 3);
        assert_eq!(bucket_of(1e9), BUCKETS - 1);
        assert!((load_of(4) - 4.0).abs() < 1e-9);
    }
}
