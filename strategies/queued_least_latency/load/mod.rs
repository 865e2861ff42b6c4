//! The load score (`score = "load"`): size-normalised cost relative to the fleet's, times the
//! load, within a concurrency limit learned from time to first byte (see the module docs).
//!
//! What is learned about a backend lives with it in a [`Slot`] ([`Backend::strategy_slot`]):
//! what a pick reads (limit, cost, coverage) in atomics, the history behind a mutex. Every read
//! and write happens under the strategy's [`LoadState`] lock, which also holds the fleet's sums;
//! a slot counts only when it carries the state's generation, so a strategy built anew (a reload
//! with other parameters) starts from nothing, and forgetting removed backends is a new
//! generation that the backends still present are carried over to.
//!
//! This file holds what is kept (per backend and for the fleet) and how it is updated; the
//! rooms around it:
//!
//! - `cache.rs`: the backend's prefix cache as learned: its prefix index sized like what the
//!   engine says it keeps;
//! - `cost.rs`: what a backend's answers cost, relative to the fleet's;
//! - `backlog.rs`: the prefill a backend has still to do (estimated for whole answers);
//! - `ttfb.rs`: the time to first byte expected without congestion (the fixed delay and the
//!   prefill rate, read off first bytes);
//! - `limit.rs`: the concurrency limit learned from first bytes (growth, decrease, ceilings and
//!   their probes);
//! - `engine.rs`: what an engine's own numbers add ahead of a request, and whether they say it
//!   is full;
//! - `score.rs`: what one pick needs of the fleet and the request ([`Demand`](score::Demand)),
//!   the guards and the score;
//! - `pick.rs`: the pick's fallback order (a failing backend, the guards, an overflow past a
//!   limit);
//! - `whole.rs`: the limit of a replica that answers whole, from the throughput its answers
//!   show at each load;
//! - `testing.rs`: tests only, what the rooms' tests share.
//!
//! Each room's tests are beside it, in its own `tests` module.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::time::Instant;

use super::{Params, RampUp};
use crate::backend::Backend;
use crate::strategies::{Outcome, next_generation};

mod backlog;
mod cache;
mod cost;
mod engine;
mod limit;
mod pick;
mod score;
#[cfg(test)]
mod testing;
mod ttfb;
mod whole;

use cost::{Fleet, KindCost};
use limit::Ceiling;
use ttfb::PRIOR_PREFILL_SECONDS_PER_TOKEN;

/// The load score: its parameters, and the fleet's sums with the generation of what it learned.
#[derive(Debug)]
pub(super) struct LoadScore {
    /// Seconds a failed attempt counts as, at least (`latency.threshold`).
    latency_threshold: f64,
    ramp_up: RampUp,
    /// TTFB up to this multiple of the expected one does not lower the limit.
    ttfb_tolerance: f64,
    /// Seconds of TTFB above the tolerated multiple that still do not lower the limit.
    ttfb_slack: f64,
    /// Concurrency limit of a backend before it has answered.
    initial_limit: f64,
    /// Highest concurrency limit.
    max_limit: f64,
    /// The guards' multiple of a backend's share (`load_bound`).
    load_bound: f64,
    /// The fleet's sums and generation.
    state: Mutex<LoadState>,
}

impl LoadScore {
    pub(super) fn new(params: &Params, latency_threshold: f64, ramp_up: RampUp) -> Self {
        Self {
            latency_threshold,
            ramp_up,
            ttfb_tolerance: params.ttfb_tolerance,
            ttfb_slack: params.ttfb_slack,
            initial_limit: params.initial_limit,
            max_limit: params.max_limit,
            load_bound: params.load_bound,
            state: Mutex::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, LoadState> {
        lock(&self.state)
    }

    /// Whether `backend`, with `busy` requests in flight, has ramp-up room: its first bytes or
    /// its finished requests, the larger, times `ramp_up_factor`.
    fn ramp_room(&self, backend: &Backend, busy: usize) -> bool {
        let answered = backend
            .strategy_slot::<Slot>()
            .answered
            .load(Ordering::Relaxed);
        self.ramp_up
            .has_room(answered.max(backend.completed()), busy)
    }
}

/// What the load score learns about one backend (a working copy; the backend keeps it in its
/// [`Slot`]).
#[derive(Debug, Clone)]
struct Learned {
    /// Concurrency limit.
    limit: f64,
    /// The costs of the kinds it has: the one cost, or the geometric mean of both.
    own: f64,
    /// Which kinds have a cost: bit [`cost::STREAMED`], bit [`cost::WHOLE`].
    coverage: u8,
    /// Seconds of prefill per uncached prompt token.
    prefill_rate: f64,
    /// Costs and TTFB baseline.
    history: History,
}

/// The part of [`Learned`] a pick reads.
#[derive(Debug, Clone, Copy)]
struct Rank {
    limit: f64,
    /// The limit for a request none of whose prompt the backend holds: below a held ceiling
    /// ([`History::cap`]).
    cap: f64,
    /// That limit for a request that must not probe a held ceiling ([`History::held_cap`]).
    held_cap: f64,
    own: f64,
    coverage: u8,
    prefill_rate: f64,
    /// Whether the backend has streamed ([`History::streamed`]).
    streams: bool,
}

/// The part of [`Learned`] only `learn` reads (kept on the backend behind a mutex).
#[derive(Debug, Clone, Copy, Default)]
struct History {
    /// Cost of streamed and of whole answers.
    kinds: [KindCost; 2],
    /// Lowest recent time to first byte of a stream once its predicted prefill is taken out:
    /// the backend's own fixed delay, in seconds.
    ttfb_baseline: Option<f64>,
    /// Whether a first byte has come later than tolerated: the limit's slow start is over.
    congested: bool,
    /// Whether a stream's first byte was seen: from then on streams alone move the limit.
    streamed: bool,
    /// When the limit was last lowered: a late first byte of a request dispatched before then
    /// was sent under the old limit and lowers it no further (one decrease per round, as TCP
    /// reduces its window once per round trip).
    lowered_at: Option<Instant>,
    /// First bytes the prefill rate was read off.
    prefill_samples: u32,
    /// The probe above the limit that failed last ([`Ceiling`]).
    ceiling: Option<Ceiling>,
    /// The throughput whole answers showed at each load (`whole.rs`).
    throughput: whole::Throughput,
}

impl Learned {
    fn new(limit: f64) -> Self {
        Self {
            limit,
            own: 1.0,
            coverage: 0,
            prefill_rate: PRIOR_PREFILL_SECONDS_PER_TOKEN,
            history: History::default(),
        }
    }

    fn of(rank: Rank, history: History) -> Self {
        Self {
            limit: rank.limit,
            own: rank.own,
            coverage: rank.coverage,
            prefill_rate: rank.prefill_rate,
            history,
        }
    }

    /// What a pick reads of it.
    #[cfg(test)]
    fn rank(&self) -> Rank {
        Rank {
            limit: self.limit,
            cap: self.history.cap(),
            held_cap: self.history.held_cap(),
            own: self.own,
            coverage: self.coverage,
            prefill_rate: self.prefill_rate,
            streams: self.history.streamed,
        }
    }
}

/// What the load score keeps on each backend ([`Backend::strategy_slot`]).
#[derive(Debug, Default)]
struct Slot {
    /// The [`LoadState::generation`] it was written in; 0: never.
    generation: AtomicU64,
    /// [`Learned::limit`], as `f64` bits.
    limit: AtomicU64,
    /// [`History::cap`], as `f64` bits.
    cap: AtomicU64,
    /// [`History::held_cap`], as `f64` bits.
    held_cap: AtomicU64,
    /// [`Learned::own`], as `f64` bits.
    own: AtomicU64,
    /// [`Learned::coverage`].
    coverage: AtomicU8,
    /// [`Learned::prefill_rate`], as `f64` bits.
    prefill_rate: AtomicU64,
    /// [`History::streamed`].
    streams: AtomicBool,
    /// The prefill it is expected to have left (`backlog.rs`).
    backlog: backlog::Backlog,
    /// First bytes seen (any generation): with the finished requests, what the ramp-up room
    /// counts, so a replica streaming long answers gets room as its first tokens arrive.
    answered: AtomicU64,
    /// Whether the backend's answers report the prompt tokens its engine found cached: then
    /// they judge its prefix index, and first bytes no longer do (`cache.rs`).
    reports_cached: AtomicBool,
    /// [`Learned::history`].
    history: Mutex<History>,
    /// What the engine kept of the prompts' parts its prefix index recorded past the reach
    /// (`cache.rs`).
    stale_kept: cache::StaleKept,
}

impl Slot {
    /// What a pick reads, if it was written in `generation`.
    fn rank(&self, generation: u64) -> Option<Rank> {
        (self.generation.load(Ordering::Relaxed) == generation).then(|| Rank {
            limit: f64::from_bits(self.limit.load(Ordering::Relaxed)),
            cap: f64::from_bits(self.cap.load(Ordering::Relaxed)),
            held_cap: f64::from_bits(self.held_cap.load(Ordering::Relaxed)),
            own: f64::from_bits(self.own.load(Ordering::Relaxed)),
            coverage: self.coverage.load(Ordering::Relaxed),
            prefill_rate: f64::from_bits(self.prefill_rate.load(Ordering::Relaxed)),
            streams: self.streams.load(Ordering::Relaxed),
        })
    }

    /// Writes what a pick reads (the history is written by the caller).
    fn store(&self, learned: &Learned, generation: u64) {
        self.limit.store(learned.limit.to_bits(), Ordering::Relaxed);
        self.cap
            .store(learned.history.cap().to_bits(), Ordering::Relaxed);
        self.held_cap
            .store(learned.history.held_cap().to_bits(), Ordering::Relaxed);
        self.own.store(learned.own.to_bits(), Ordering::Relaxed);
        self.coverage.store(learned.coverage, Ordering::Relaxed);
        self.prefill_rate
            .store(learned.prefill_rate.to_bits(), Ordering::Relaxed);
        self.streams
            .store(learned.history.streamed, Ordering::Relaxed);
        self.generation.store(generation, Ordering::Relaxed);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The fleet's sums over the backends learned in `generation`.
#[derive(Debug)]
struct LoadState {
    /// Which slots count: those written in this generation.
    generation: u64,
    fleet: Fleet,
}

impl Default for LoadState {
    fn default() -> Self {
        Self {
            generation: next_generation(),
            fleet: Fleet::default(),
        }
    }
}

impl LoadScore {
    /// The eligible set changed to `backends`. Backends of it the strategy has learned nothing
    /// about yet have their prefix index's reach started (`cache.rs`), so that what the index
    /// predicts, and what the health endpoint shows of it, is the start from the first request
    /// on. What was learned about ejected or paused backends is kept; removed ones are
    /// forgotten once more backends are counted than four times the set: a new generation, to
    /// which the backends of the set are carried over, and the fleet's sums counted again over
    /// them.
    pub(super) fn backends_changed(&self, backends: &[Arc<Backend>]) {
        let mut state = self.state();
        for backend in backends {
            if backend
                .strategy_slot::<Slot>()
                .rank(state.generation)
                .is_none()
            {
                cache::start_reach(backend);
            }
        }
        if state.fleet.entries() as usize <= 4 * backends.len().max(8) {
            return;
        }
        let generation = next_generation();
        let kept: Vec<Learned> = backends
            .iter()
            .filter_map(|backend| {
                let slot = backend.strategy_slot::<Slot>();
                let rank = slot.rank(state.generation)?;
                let learned = Learned::of(rank, *lock(&slot.history));
                slot.generation.store(generation, Ordering::Relaxed);
                Some(learned)
            })
            .collect();
        state.generation = generation;
        state.fleet = Fleet::of(&kept);
    }

    /// Runs `update` on what is learned about `backend` and on the fleet's sums, and stores the
    /// result.
    fn update(&self, backend: &Backend, update: impl FnOnce(&mut Learned, &mut Fleet)) {
        let mut guard = self.state();
        let LoadState { generation, fleet } = &mut *guard;
        let slot = backend.strategy_slot::<Slot>();
        let mut history = lock(&slot.history);
        let mut learned = match slot.rank(*generation) {
            Some(rank) => Learned::of(rank, *history),
            None => {
                fleet.add_entry();
                cache::start_reach(backend);
                Learned::new(self.initial_limit)
            }
        };
        update(&mut learned, fleet);
        *history = learned.history;
        slot.store(&learned, *generation);
    }

    /// Folds `outcome` into what is learned about `backend` and into the fleet's sums: its cost,
    /// and on a replica that never streamed, its limit.
    pub(super) fn learn(&self, backend: &Backend, outcome: &Outcome) {
        let in_flight = backend.in_flight();
        // What the engine's own numbers say as a whole answer ends (read only for those).
        let full =
            !outcome.streamed && !outcome.failed && engine::engine_full(backend, Instant::now());
        self.update(backend, |learned, fleet| {
            self.record_cost(learned, fleet, outcome);
            self.learn_whole(learned, outcome, in_flight, full);
        });
        cache::learn_cache(backend, outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use crate::strategies::Strategy;

    #[test]
    fn what_is_learned_lives_with_the_backend_and_a_new_instance_starts_afresh() {
        let set: Vec<_> = (0..2)
            .map(|i| Arc::new(Backend::new(format!("10.0.4.{i}:80").parse().unwrap())))
            .collect();
        let strategy = QueuedLeastLatency::load(3.0);
        busy(&set[0], 4);
        for _ in 0..5 {
            strategy.on_first_byte(&set[0], &first_byte_on(&set[0], 0.1, 0, 0));
            strategy.on_outcome(&set[0], &streamed(1.0, 0.1));
        }
        let learned = strategy.limit(&set[0]);
        assert!(learned > strategy.load_score().initial_limit, "{learned}");
        assert_eq!(strategy.limit(&set[1]), strategy.load_score().initial_limit);
        // A reload builds a new instance: it does not read the old one's values.
        let reloaded = QueuedLeastLatency::load(3.0);
        assert_eq!(reloaded.limit(&set[0]), reloaded.load_score().initial_limit);
        assert_eq!(reloaded.load_score().state().fleet.entries(), 0);
        // Forgetting removed backends keeps those of the set.
        for backend in (0..40).map(|i| Backend::new(format!("10.0.5.{i}:80").parse().unwrap())) {
            strategy.on_outcome(&backend, &streamed(1.0, 0.1));
        }
        strategy.on_backends_changed(&set);
        assert_eq!(strategy.limit(&set[0]), learned);
        assert_eq!(strategy.load_score().state().fleet.entries(), 1);
    }
}
