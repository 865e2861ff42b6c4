//! The load score (`score = "load"`): size-normalised cost relative to the fleet's, times the
//! load, within a concurrency limit learned from time to first byte (see the module docs).
//!
//! What is learned about a backend lives with it in a [`Slot`] ([`Backend::strategy_slot`]):
//! what a pick reads (limit, cost, coverage) in atomics, the history behind a mutex. Every read
//! and write happens under the strategy's [`LoadState`] lock, which also holds the fleet's sums;
//! a slot counts only when it carries the state's generation, so a strategy built anew (a reload
//! with other parameters) starts from nothing, and forgetting removed backends is a new
//! generation that the backends still present are carried over to.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::time::Instant;

use super::QueuedLeastLatency;
use crate::backend::Backend;
use crate::engine_metrics::EngineSnapshot;
use crate::prompt::Prompt;
use crate::strategies::{Candidates, FirstByte, Outcome, Pick, RequestInfo, next_generation};

/// Index of streamed answers' cost.
const STREAMED: usize = 0;
/// Index of whole answers' cost.
const WHOLE: usize = 1;
/// Weight of a new sample in the cost EWMAs: replicas' relative speeds change slowly, and one
/// answer's length and timing are noisy.
const COST_SMOOTHING: f64 = 0.1;
/// Smallest size an answer counts for, in KiB.
const MIN_KIB: f64 = 0.125;

/// The cost of one kind of answer on one backend: EWMAs of latency and of size.
#[derive(Debug, Clone, Copy, Default)]
struct KindCost {
    latency: f64,
    kib: f64,
}

impl KindCost {
    /// Seconds per KiB; `None` before the first answer of this kind.
    fn cost(&self) -> Option<f64> {
        (self.kib > 0.0).then(|| self.latency / self.kib)
    }

    fn record(&mut self, latency: f64, kib: f64) {
        if self.kib > 0.0 {
            self.latency += COST_SMOOTHING * (latency - self.latency);
            self.kib += COST_SMOOTHING * (kib - self.kib);
        } else {
            self.latency = latency;
            self.kib = kib;
        }
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
    /// Which kinds have a cost: bit [`STREAMED`], bit [`WHOLE`].
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
    /// ([`Ceiling::cap`]).
    cap: f64,
    own: f64,
    coverage: u8,
    prefill_rate: f64,
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
}

impl History {
    /// The limit a held ceiling sets for requests none of whose prompt the backend holds: just
    /// below its count while the hold lasts, then just above it (one probe at the count), and
    /// none without a ceiling.
    fn cap(&self) -> f64 {
        match self.ceiling {
            Some(ceiling) if ceiling.hold > 0 => ceiling.count - 0.5,
            Some(ceiling) => ceiling.count + 0.5,
            None => f64::INFINITY,
        }
    }
}

/// A count of requests in flight found to be one too many: a request that took the last slot
/// the limit allowed had its first byte late (it waited inside the replica, behind the ones it
/// runs). Requests none of whose prompt the backend holds stay below it for a while, then one
/// probes it again: the ceiling is lifted after an on-time probe, held twice as long after each
/// further failure (the probe costs the request that makes it a wait in the replica's own
/// queue, out of the router queue's order). A request whose prompt the backend holds in part
/// may still go up to the limit: waiting inside the engine that holds its prefix is worth more
/// to it than a free slot elsewhere.
#[derive(Debug, Clone, Copy)]
struct Ceiling {
    /// The count that was one too many.
    count: f64,
    /// On-time first bytes still to see before the limit may reach `count` again.
    hold: u32,
    /// Failed probes in a row (the hold doubles with each, up to [`MAX_PROBE_BACKOFF`]).
    failures: u8,
    /// When it was found: a late first byte of a request sent before then is of the same round.
    set_at: Instant,
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
            own: self.own,
            coverage: self.coverage,
            prefill_rate: self.prefill_rate,
        }
    }

    /// Recomputes `coverage` and `own` after a cost changed (not on the pick path); returns the
    /// coverage before and after.
    fn combine(&mut self) -> (usize, usize) {
        let before = usize::from(self.coverage);
        match (
            self.history.kinds[STREAMED].cost(),
            self.history.kinds[WHOLE].cost(),
        ) {
            (Some(streamed), Some(whole)) => {
                self.coverage = 3;
                self.own = (streamed * whole).sqrt();
            }
            (Some(cost), None) => {
                self.coverage = 1 << STREAMED;
                self.own = cost;
            }
            (None, Some(cost)) => {
                self.coverage = 1 << WHOLE;
                self.own = cost;
            }
            (None, None) => {
                self.coverage = 0;
                self.own = 1.0;
            }
        }
        (before, usize::from(self.coverage))
    }
}

/// Sum and count of the backends' costs, per kind, for the fleet's mean.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fleet {
    sum: [f64; 2],
    count: [u32; 2],
    /// By coverage: what a backend's `own` cost is multiplied by to make it relative (1 over the
    /// mean, or over the geometric mean of both means), kept up to date so a pick multiplies once.
    factor: [f64; 4],
    /// How many backends learned have each coverage.
    covered: [u32; 4],
}

impl Default for Fleet {
    fn default() -> Self {
        Self {
            sum: [0.0; 2],
            count: [0; 2],
            factor: [1.0; 4],
            covered: [0; 4],
        }
    }
}

impl Fleet {
    fn of<'a>(learned: impl IntoIterator<Item = &'a Learned>) -> Self {
        let mut fleet = Fleet::default();
        for learned in learned {
            fleet.covered[usize::from(learned.coverage)] += 1;
            for (kind, cost) in learned.history.kinds.iter().enumerate() {
                if let Some(cost) = cost.cost() {
                    fleet.sum[kind] += cost;
                    fleet.count[kind] += 1;
                }
            }
        }
        fleet.refresh();
        fleet
    }

    fn mean(&self, kind: usize) -> f64 {
        let mean = self.sum[kind] / f64::from(self.count[kind].max(1));
        if mean > 0.0 { mean } else { 1.0 }
    }

    fn refresh(&mut self) {
        let streamed = self.mean(STREAMED);
        let whole = self.mean(WHOLE);
        self.factor = [
            1.0,
            1.0 / streamed,
            1.0 / whole,
            1.0 / (streamed * whole).sqrt(),
        ];
    }

    /// How many backends are counted.
    fn entries(&self) -> u32 {
        self.covered.iter().sum()
    }

    /// A backend was learned for the first time (its first cost follows, with a refresh).
    fn add_entry(&mut self) {
        self.covered[0] += 1;
    }

    /// A backend's coverage changed from `before` to `after`.
    fn recover(&mut self, (before, after): (usize, usize)) {
        if before != after {
            self.covered[before] -= 1;
            self.covered[after] += 1;
            self.refresh();
        }
    }

    /// Replaces one backend's `old` cost of `kind` with `new`.
    fn replace(&mut self, kind: usize, old: Option<f64>, new: Option<f64>) {
        if let Some(old) = old {
            self.sum[kind] -= old;
            self.count[kind] -= 1;
        }
        if let Some(new) = new {
            self.sum[kind] += new;
            self.count[kind] += 1;
        }
        self.refresh();
    }

    /// A backend's cost relative to the fleet's mean: for each kind it has, its cost over the
    /// fleet's mean cost of that kind; the geometric mean of both ratios when it has both; 1.0
    /// when it has none.
    fn relative(&self, learned: Rank) -> f64 {
        learned.own * self.factor[usize::from(learned.coverage)]
    }
}

/// What the load score keeps on each backend ([`Backend::strategy_slot`]).
#[derive(Debug, Default)]
pub(super) struct Slot {
    /// The [`LoadState::generation`] it was written in; 0: never.
    generation: AtomicU64,
    /// [`Learned::limit`], as `f64` bits.
    limit: AtomicU64,
    /// [`History::cap`], as `f64` bits.
    cap: AtomicU64,
    /// [`Learned::own`], as `f64` bits.
    own: AtomicU64,
    /// [`Learned::coverage`].
    coverage: AtomicU8,
    /// [`Learned::prefill_rate`], as `f64` bits.
    prefill_rate: AtomicU64,
    /// First bytes seen (any generation): with the finished requests, what the ramp-up room
    /// counts, so a replica streaming long answers gets room as its first tokens arrive.
    answered: AtomicU64,
    /// [`Learned::history`].
    history: Mutex<History>,
}

impl Slot {
    /// What a pick reads, if it was written in `generation`.
    fn rank(&self, generation: u64) -> Option<Rank> {
        (self.generation.load(Ordering::Relaxed) == generation).then(|| Rank {
            limit: f64::from_bits(self.limit.load(Ordering::Relaxed)),
            cap: f64::from_bits(self.cap.load(Ordering::Relaxed)),
            own: f64::from_bits(self.own.load(Ordering::Relaxed)),
            coverage: self.coverage.load(Ordering::Relaxed),
            prefill_rate: f64::from_bits(self.prefill_rate.load(Ordering::Relaxed)),
        })
    }

    /// Writes what a pick reads (the history is written by the caller).
    fn store(&self, learned: &Learned, generation: u64) {
        self.limit.store(learned.limit.to_bits(), Ordering::Relaxed);
        self.cap
            .store(learned.history.cap().to_bits(), Ordering::Relaxed);
        self.own.store(learned.own.to_bits(), Ordering::Relaxed);
        self.coverage.store(learned.coverage, Ordering::Relaxed);
        self.prefill_rate
            .store(learned.prefill_rate.to_bits(), Ordering::Relaxed);
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
pub(super) struct LoadState {
    /// Which slots count: those written in this generation.
    pub(super) generation: u64,
    pub(super) fleet: Fleet,
}

impl Default for LoadState {
    fn default() -> Self {
        Self {
            generation: next_generation(),
            fleet: Fleet::default(),
        }
    }
}

/// How fast a raised TTFB baseline catches up (per sample of a backend using less than half of
/// its limit), so a replica that became slower for good is not judged against its old best
/// forever. Slow on purpose, and not from busy backends: under sustained overload every TTFB is
/// high, and a baseline that followed it would let the limit climb until the replicas' own
/// queues overflow.
const BASELINE_DRIFT: f64 = 0.002;
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
/// Prefill seconds per uncached prompt token assumed before a backend has shown its own: 10,000
/// tokens a second, a mid-size model on one current GPU.
pub(super) const PRIOR_PREFILL_SECONDS_PER_TOKEN: f64 = 1e-4;
/// Prompt tokens (the request's uncached ones and those queued ahead of it) from which a first
/// byte teaches the prefill rate: below, the backend's fixed delay dominates.
const MIN_PREFILL_SAMPLE: u64 = 256;
/// Weights of a prefill-rate sample below and above the current rate: the rate follows the
/// lower envelope of the samples, as queueing only ever adds to a first byte's delay.
/// First bytes of long prompts after which a backend with no fixed delay known yet has its
/// first bytes judged on the prefill rate they taught.
const PREFILL_SAMPLES_TO_JUDGE: u32 = 16;
const PREFILL_RATE_DOWN: f64 = 0.3;
const PREFILL_RATE_UP: f64 = 0.05;

/// Requests a candidate may hold above its equal share of those in flight (the count guard),
/// and at most as many again for `load_bound`'s multiple of the share, when it holds none of
/// the request's prompt ([`LOCALITY_SLACK`] when it does): with few requests per replica a
/// multiple alone would leave no room for locality (1.1 × 4 requests is 4.4), with hundreds
/// it would let one engine take tens more than its share (1.1 × 250 is 275) while its
/// capacity, in sequences and KV cache, is absolute: the locality it buys is one request's
/// prefill whatever the scale.
const LOAD_SLACK: f64 = 2.0;
/// Typical requests' work (the load guard) and requests (the count guard) a candidate holding
/// part of the prompt may hold above its share, and at most as many again for `load_bound`'s
/// multiple: one more than [`LOAD_SLACK`], the room of the others. With two, a tenant's home
/// replica pushed past the guard spills its requests to replicas that must prefill its system
/// prompt, which then draw more of them (`prefix`, in turn: cache hits 78-91 % with two,
/// 88-93 % with three; p50 and p99 lower).
const LOCALITY_SLACK: f64 = 3.0;

/// How many times faster (in relative cost) a full backend must be than the chosen one for a
/// request to wait for a slot there ([`QueuedLeastLatency::overflow`]): on equal replicas the
/// costs differ by noise, never by this much.
const OVERFLOW_SPEEDUP: f64 = 1.5;
/// How many times the typical request's output a request must ask for to overflow: a short
/// answer runs soon enough anywhere.
const OVERFLOW_LENGTH: f64 = 1.2;

/// KV-cache usage from which an engine's cache is taken as full ([`kv_full`]).
pub(super) const KV_FULL: f64 = 0.95;

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

/// Requests a candidate may hold waiting for their first byte above `load_bound` × the fewest
/// before the first-byte guard passes it over: the prefills of a step or two are not a queue.
const AWAITING_SLACK: f64 = 8.0;

/// What one pick needs of the fleet and of the request, gathered once per pick.
#[derive(Debug, Clone, Copy)]
pub(super) struct Demand<'r> {
    /// The request's prompt blocks (empty without a prompt).
    blocks: &'r [u64],
    /// The request's prompt tokens.
    prompt_tokens: u64,
    /// Its expected output tokens.
    output: f64,
    /// Seconds one typical request adds to the wait of the requests it shares a backend with:
    /// the fleet's mean latency over its mean concurrency limit.
    unit: f64,
    /// Tokens of output a typical request in flight is expected to generate.
    typical_output: f64,
    /// The load guard (bounded load) for a request with a prompt: how much work, weighted by
    /// relative cost, a candidate may already hold: its share of the work in flight with this
    /// request added, plus [`LOCALITY_SLACK`] typical requests, plus `load_bound`'s multiple of
    /// the share above it up to as many again ([`guard_bound`]; the least loaded candidate is
    /// always within it). It applies to backends that hold part of the prompt: locality is what
    /// could pile up.
    bound: Option<f64>,
    /// The count guard's share: a candidate's equal share of the requests in flight with this
    /// one added. A candidate may already hold that many plus [`LOAD_SLACK`] requests, or
    /// [`LOCALITY_SLACK`] when it holds part of the prompt, the load guard's room
    /// ([`guard_bound`]). Work weighs a request by its answer's length, but an engine fills up
    /// by sequences and KV cache: many short answers past its share overflow it as surely as a
    /// few long ones.
    count_share: Option<f64>,
    /// The prefill guard for a request with a prompt: how many uncached prompt tokens may
    /// already wait for their first byte on a candidate: `load_bound` times the mean over the
    /// candidates with this request's prompt added, or this request's prompt tokens if more
    /// (the candidate with the least always is within it). A replica busy prefilling long
    /// prompts does not draw every long prompt after them because it holds few streams.
    prefill_bound: Option<f64>,
    /// The first-byte guard for a request with a prompt: how many requests may already wait
    /// for their first byte on a candidate: `load_bound` times the fewest any candidate has,
    /// plus [`AWAITING_SLACK`]. A replica whose engine holds requests in its own queue (its KV
    /// cache is full) stops drawing new ones while a peer answers its own.
    awaiting_bound: Option<f64>,
    /// When the pick happens, for a request with a prompt: the engines' own load signals are
    /// read then ([`Backend::engine`]).
    now: Option<Instant>,
    /// Whether held ceilings apply ([`Ceiling`]); when they do not, backends in a run of
    /// failures are skipped ([`Self::past_ceilings`]).
    ceilings: bool,
    /// Seconds a typical backend takes per output token: the fleet's mean latency over the
    /// typical request's output tokens.
    token_seconds: f64,
    /// The lowest relative cost among the candidates, when the request states its output
    /// (`max_tokens`): what [`QueuedLeastLatency::overflow`] compares with; `None`, no
    /// overflow.
    fastest: Option<f64>,
}

impl<'r> Demand<'r> {
    /// What a pick for `request` among `candidates` needs.
    pub(super) fn of(
        strategy: &QueuedLeastLatency,
        request: &'r RequestInfo,
        candidates: Candidates<'_>,
        generation: u64,
        fleet: &Fleet,
    ) -> Self {
        let output = f64::from(request.expected_output_tokens());
        let (mut latency, mut measured, mut limits) = (0.0, 0u32, 0.0);
        let (mut work, mut in_flight, mut speed, mut count) = (0u64, 0usize, 0.0, 0u32);
        let mut queued_prefill = 0u64;
        let mut fewest_awaiting = usize::MAX;
        let mut fastest = f64::INFINITY;
        for (_, backend) in candidates.iter() {
            let rank = backend.strategy_slot::<Slot>().rank(generation);
            if let Some(ewma) = backend.ewma_latency() {
                latency += ewma;
                measured += 1;
            }
            limits += rank.map_or(strategy.initial_limit, |r| r.limit);
            work += backend.work_in_flight();
            queued_prefill += backend.prefill_in_flight();
            fewest_awaiting = fewest_awaiting.min(backend.awaiting_first_byte());
            in_flight += backend.in_flight();
            let relative = relative_cost(fleet, rank);
            speed += 1.0 / relative;
            if rank.is_some() {
                fastest = fastest.min(relative);
            }
            count += 1;
        }
        let count_f = f64::from(count.max(1));
        let mean_latency = if measured > 0 {
            latency / f64::from(measured)
        } else {
            1.0
        };
        let typical_output = if in_flight > 0 {
            (work as f64 / in_flight as f64).max(1.0)
        } else {
            output
        };
        let prompt = request.prompt.as_deref();
        // Both guards apply to a request with a prompt when there is a choice.
        let guarded = prompt.is_some() && count > 1;
        let bound = guarded.then(|| {
            guard_bound(
                strategy.load_bound,
                (work as f64 + output) / speed.max(f64::MIN_POSITIVE),
                LOCALITY_SLACK * typical_output,
            )
        });
        let count_share = guarded.then(|| (in_flight + 1) as f64 / count_f);
        let prompt_tokens = request.prompt_tokens() as f64;
        let prefill_bound = guarded.then(|| {
            (strategy.load_bound * (queued_prefill as f64 + prompt_tokens) / count_f)
                .max(prompt_tokens)
        });
        let awaiting_bound =
            guarded.then_some(strategy.load_bound * fewest_awaiting as f64 + AWAITING_SLACK);
        Self {
            blocks: prompt.map_or(&[], |p| &p.blocks),
            prompt_tokens: request.prompt_tokens(),
            output,
            unit: mean_latency / (limits / count_f).max(1.0),
            typical_output,
            bound,
            count_share,
            prefill_bound,
            awaiting_bound,
            now: Some(Instant::now()),
            ceilings: true,
            token_seconds: mean_latency / typical_output,
            fastest: prompt
                .and_then(|p| p.max_tokens)
                .and(fastest.is_finite().then_some(fastest)),
        }
    }
}

impl Demand<'_> {
    /// Whether the guards apply to this pick.
    pub(super) fn is_guarded(&self) -> bool {
        self.bound.is_some()
    }

    /// This demand with only the count guard: for a pick where no backend with room is within
    /// every guard. The count guard is about capacity (an engine fills up by sequences), the
    /// others about where work and prefill pile up; when they disagree (one backend holds more
    /// requests, another more work), capacity comes first.
    pub(super) fn counted(&self) -> Self {
        Self {
            bound: None,
            prefill_bound: None,
            awaiting_bound: None,
            ..*self
        }
    }

    /// This demand among healthy backends, their held ceilings waived: for a pick that chose a
    /// backend in a run of failures. A ceiling keeps a request out of a healthy replica's own
    /// queue, which is worth less than keeping it from an answer that is likely an error (an
    /// error is not retried once a backend answered; a wait in a healthy engine costs a few
    /// steps).
    pub(super) fn past_ceilings(&self) -> Self {
        Self {
            ceilings: false,
            ..*self
        }
    }

    /// This demand with no guard: for a pick where no backend with room is within them.
    pub(super) fn unguarded(&self) -> Self {
        Self {
            bound: None,
            count_share: None,
            prefill_bound: None,
            awaiting_bound: None,
            ..*self
        }
    }
}

/// A guard's bound for a `share` of the load: the share plus `slack`, plus `load_bound`'s
/// multiple of the share above it up to as many again.
fn guard_bound(load_bound: f64, share: f64, slack: f64) -> f64 {
    share + slack + ((load_bound - 1.0) * share).min(slack)
}

/// A backend's cost relative to the fleet's (1.0 before it was measured).
fn relative_cost(fleet: &Fleet, rank: Option<Rank>) -> f64 {
    rank.map_or(1.0, |rank| fleet.relative(rank)).max(1e-9)
}

impl QueuedLeastLatency {
    /// Whether `backend` has shown how it answers: a finished request or a first byte.
    fn measured(backend: &Backend, rank: Option<Rank>) -> bool {
        backend.ewma_latency().is_some() || rank.is_some()
    }

    /// The load score of `backend` if it is a candidate: the seconds a request is expected to
    /// spend on it before it ends, as far as they differ between backends: the work in flight
    /// shared over the backend's parallel capacity, plus the prefill of the prompt tokens its
    /// prefix index does not hold and of those queued ahead (see the module docs).
    pub(super) fn load_score(
        &self,
        backend: &Backend,
        generation: u64,
        fleet: &Fleet,
        demand: &Demand<'_>,
    ) -> Option<f64> {
        let in_flight = backend.in_flight();
        if !demand.ceilings && backend.failures_in_a_row() > 0 {
            return None;
        }
        let state = backend.strategy_slot::<Slot>().rank(generation);
        if !Self::measured(backend, state) {
            // One at a time until measured; the engine's own numbers still tell busy from idle
            // (a router that just became the leader has measured nothing).
            if in_flight > 0 {
                return None;
            }
            let engine = demand.now.and_then(|now| backend.engine().snapshot(now));
            return Some(engine.map_or(0.0, |engine| engine_ahead(&engine) * demand.unit));
        }
        // An engine that states its capacity (TGI's `max_concurrent_requests`) is taken at its
        // word.
        let limit = demand
            .now
            .and_then(|now| backend.engine().max_concurrent(now))
            .map_or_else(|| state.map_or(self.initial_limit, |s| s.limit), f64::from);
        let answered = backend
            .strategy_slot::<Slot>()
            .answered
            .load(Ordering::Relaxed);
        let ramp = self.ramp_room(answered.max(backend.completed()), in_flight);
        // A request goes where the limit has a whole slot for it: with a limit of 4.4 a fifth
        // would wait inside the replica, behind the four it runs, out of the router queue's
        // order (bands, tenants' shares). The next one goes when the limit reaches 5.
        if in_flight > 0 && !((in_flight as f64) + 1.0 <= limit && ramp) {
            return None;
        }
        let matched = if demand.prompt_tokens == 0 {
            0
        } else {
            Prompt::blocks_tokens(backend.prefixes().matched_blocks(demand.blocks))
        };
        // Below a held ceiling, unless the backend holds part of the prompt ([`Ceiling`]).
        if demand.ceilings
            && in_flight > 0
            && matched == 0
            && state.is_some_and(|rank| (in_flight as f64) + 1.0 > rank.cap)
        {
            return None;
        }
        let relative = relative_cost(fleet, state);
        let held = backend.work_in_flight() as f64;
        // The guard is for locality: a backend that holds none of the prompt draws nothing to it.
        if matched > 0 && demand.bound.is_some_and(|bound| held * relative > bound) {
            return None;
        }
        let count_slack = if matched > 0 {
            LOCALITY_SLACK
        } else {
            LOAD_SLACK
        };
        if demand.count_share.is_some_and(|share| {
            in_flight as f64 > guard_bound(self.load_bound, share, count_slack)
        }) {
            return None;
        }
        let queued_prefill = backend.prefill_in_flight();
        if demand
            .prefill_bound
            .is_some_and(|bound| queued_prefill as f64 > bound)
        {
            return None;
        }
        if demand
            .awaiting_bound
            .is_some_and(|bound| backend.awaiting_first_byte() as f64 > bound)
        {
            return None;
        }
        let work = held + demand.output;
        let mut load = relative * work / demand.typical_output * demand.unit;
        if let Some(engine) = demand.now.and_then(|now| backend.engine().snapshot(now)) {
            load += engine_ahead(&engine) * demand.unit;
        }
        if demand.prompt_tokens == 0 {
            return Some(load);
        }
        // Its prefill waits for the prefill queued ahead of it, and stalls the decode steps of
        // every request in flight there while it runs (an engine's step carries both): a miss
        // on a busy replica costs its prefill once per sequence it holds up.
        let uncached = demand.prompt_tokens.saturating_sub(matched);
        let stalled = 1 + in_flight as u64;
        let prefill = (queued_prefill + uncached * stalled) as f64
            * state.map_or(PRIOR_PREFILL_SECONDS_PER_TOKEN, |s| s.prefill_rate);
        Some(load + prefill)
    }

    /// A backend past its limit (or ceiling) that is expected to finish the request sooner than
    /// `chosen`, which has room: on replicas of different speeds, a long answer waits for a
    /// slot on one several times faster rather than run on a slow one (the tail of
    /// `hetero-stream` was long answers decoded on the slowest replicas). Only for a request
    /// that states its output, only on a backend at least [`OVERFLOW_SPEEDUP`] times faster
    /// than `chosen`, not in a run of failures and with ramp-up room: on equal replicas it
    /// never applies. The expected end on a backend is its output tokens at the backend's
    /// speed (relative cost × the fleet's seconds per token) plus the prefill of its uncached
    /// prompt tokens, and on a full backend the wait for a slot: a typical request's tokens
    /// over its slots for each request ahead of it inside. Returns the backend, past its limit
    /// ([`Pick::past_limit`]) when it is full.
    pub(super) fn overflow(
        &self,
        chosen: &Backend,
        candidates: Candidates<'_>,
        generation: u64,
        fleet: &Fleet,
        demand: &Demand<'_>,
    ) -> Option<Pick> {
        let fastest = demand.fastest?;
        if demand.output < OVERFLOW_LENGTH * demand.typical_output {
            return None;
        }
        let chosen_rank = chosen.strategy_slot::<Slot>().rank(generation)?;
        let chosen_relative = relative_cost(fleet, Some(chosen_rank));
        if fastest * OVERFLOW_SPEEDUP > chosen_relative {
            return None;
        }
        let end = |backend: &Backend, rank: Rank, relative: f64, full: bool| {
            let matched = if demand.prompt_tokens == 0 {
                0
            } else {
                Prompt::blocks_tokens(backend.prefixes().matched_blocks(demand.blocks))
            };
            let uncached = demand.prompt_tokens.saturating_sub(matched);
            // On a full backend, the work it holds shares its slots with this request.
            let ahead = if full {
                backend.work_in_flight() as f64 / rank.limit.floor().max(1.0)
            } else {
                0.0
            };
            relative * demand.token_seconds * (demand.output + ahead)
                + (backend.prefill_in_flight() + uncached) as f64 * rank.prefill_rate
        };
        let mut best = end(chosen, chosen_rank, chosen_relative, false);
        let mut found = None;
        for (index, backend) in candidates.iter() {
            let Some(rank) = backend.strategy_slot::<Slot>().rank(generation) else {
                continue;
            };
            let relative = relative_cost(fleet, Some(rank));
            let in_flight = backend.in_flight();
            if relative * OVERFLOW_SPEEDUP > chosen_relative
                || backend.failures_in_a_row() > 0
                || demand
                    .now
                    .is_some_and(|now| backend.engine().max_concurrent(now).is_some())
            {
                continue;
            }
            let answered = backend
                .strategy_slot::<Slot>()
                .answered
                .load(Ordering::Relaxed);
            if !self.ramp_room(answered.max(backend.completed()), in_flight) {
                continue;
            }
            let full = in_flight as f64 + 1.0 > rank.limit;
            let time = end(backend, rank, relative, full);
            if time < best {
                best = time;
                found = Some(Pick {
                    index,
                    past_limit: full,
                });
            }
        }
        found
    }

    /// What a pick reads of `backend`'s learned state, if it has any in this generation.
    fn learned_rank(&self, backend: &Backend) -> Option<Rank> {
        let generation = self.load_state().generation;
        backend.strategy_slot::<Slot>().rank(generation)
    }

    /// The current concurrency limit learned for `backend` (`load` score).
    pub fn limit(&self, backend: &Backend) -> f64 {
        self.learned_rank(backend)
            .map_or(self.initial_limit, |s| s.limit)
    }

    /// The limit for a request none of whose prompt `backend` holds: the learned limit, below a
    /// held [`Ceiling`].
    pub fn limit_without_prefix(&self, backend: &Backend) -> f64 {
        self.learned_rank(backend)
            .map_or(self.initial_limit, |s| s.limit.min(s.cap))
    }

    /// The prefill rate learned for `backend`, in seconds per uncached prompt token.
    pub fn prefill_rate(&self, backend: &Backend) -> f64 {
        self.learned_rank(backend)
            .map_or(PRIOR_PREFILL_SECONDS_PER_TOKEN, |s| s.prefill_rate)
    }

    /// Keeps what was learned about ejected or paused backends; forgets removed ones once more
    /// backends are counted than four times the set: a new generation, to which the backends of
    /// the set are carried over, and the fleet's sums counted again over them.
    pub(super) fn forget_removed(&self, backends: &[Arc<Backend>]) {
        let mut state = self.load_state();
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
        let mut guard = self.load_state();
        let LoadState { generation, fleet } = &mut *guard;
        let slot = backend.strategy_slot::<Slot>();
        let mut history = lock(&slot.history);
        let mut learned = match slot.rank(*generation) {
            Some(rank) => Learned::of(rank, *history),
            None => {
                fleet.add_entry();
                Learned::new(self.initial_limit)
            }
        };
        update(&mut learned, fleet);
        *history = learned.history;
        slot.store(&learned, *generation);
    }

    /// Folds `outcome` into what is learned about `backend` and into the fleet's sums.
    pub(super) fn learn(&self, backend: &Backend, outcome: &Outcome) {
        self.update(backend, |learned, fleet| {
            self.learn_into(learned, fleet, outcome);
        });
    }

    /// Folds a stream's first byte into `backend`'s prefill rate, fixed delay and limit. While
    /// the engine's own numbers say it is full ([`engine_full`]), the limit does not grow,
    /// whatever the first bytes say.
    pub(super) fn learn_first_byte(&self, backend: &Backend, first_byte: &FirstByte) {
        let busy = backend.in_flight() as f64;
        // When the first byte came: no clock read of its own.
        let after = std::time::Duration::try_from_secs_f64(first_byte.seconds).unwrap_or_default();
        let at = first_byte.dispatched_at + after;
        let full = backend
            .engine()
            .snapshot(at)
            .as_ref()
            .is_some_and(engine_full);
        let slot = backend.strategy_slot::<Slot>();
        let _ = slot
            .answered
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < u64::from(u32::MAX)).then_some(n + 1)
            });
        // A request sent past the limit on purpose ([`Self::overflow`]) was expected to wait
        // for a slot: however late, its first byte says nothing new about the limit.
        self.update(backend, |learned, _| {
            if first_byte.streamed && !first_byte.past_limit {
                let limit = learned.limit;
                self.learn_ttfb(learned, first_byte, busy);
                if full {
                    learned.limit = learned.limit.min(limit);
                }
            }
        });
    }

    fn learn_into(&self, state: &mut Learned, fleet: &mut Fleet, outcome: &Outcome) {
        if outcome.failed {
            for (kind, cost) in state.history.kinds.iter_mut().enumerate() {
                let old = cost.cost();
                cost.record(self.latency_threshold.max(outcome.latency), 1.0);
                fleet.replace(kind, old, cost.cost());
            }
            fleet.recover(state.combine());
            return;
        }
        let kind = if outcome.streamed { STREAMED } else { WHOLE };
        let cost = &mut state.history.kinds[kind];
        let old = cost.cost();
        cost.record(
            outcome.latency,
            (outcome.bytes as f64 / 1024.0).max(MIN_KIB),
        );
        fleet.replace(kind, old, cost.cost());
        fleet.recover(state.combine());
        // Only a stream's first byte measures queueing (see `learn_ttfb`); a whole answer's
        // first byte comes with its end. On a replica that never streamed, a whole answer
        // counts as no sign of congestion.
        if outcome.streamed || state.history.streamed {
            return;
        }
        state.limit = ((1.0 - LIMIT_SMOOTHING) * state.limit
            + LIMIT_SMOOTHING * (state.limit + state.limit.sqrt()))
        .min(self.max_limit);
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
    fn learn_ttfb(&self, state: &mut Learned, first_byte: &FirstByte, busy: f64) {
        let ttfb = first_byte.seconds;
        let prefill = first_byte.uncached_tokens + first_byte.queued_tokens;
        state.history.streamed = true;
        // The fixed delay is read off first bytes with little prefill: where the prefill is
        // long, an error in the rate would pass for a shorter (even zero) fixed delay, and every
        // short prompt after it would look late.
        // It drifts up only from first bytes of a backend using less than half of its limit (or
        // holding this request alone): under sustained load every first byte waits, and a
        // baseline that followed them would let the limit climb until the replica's own queue
        // holds what the router queue should.
        let residual = (ttfb - prefill as f64 * state.prefill_rate).max(0.0);
        let drifts = busy < state.limit / 2.0 || busy <= 1.0;
        let baseline = match state.history.ttfb_baseline {
            _ if prefill >= MIN_PREFILL_SAMPLE => state.history.ttfb_baseline,
            Some(old) if residual >= old && !drifts => Some(old),
            Some(old) if residual >= old => Some(old + (residual - old) * BASELINE_DRIFT),
            _ => Some(residual),
        };
        state.history.ttfb_baseline = baseline;
        // Until the fixed delay is known (or the prefill rate is read off enough long prompts)
        // no first byte is judged late: the expected time would be a guess at the prior rate,
        // and one early sample would end the slow start.
        let known = baseline.is_some() || state.history.prefill_samples >= PREFILL_SAMPLES_TO_JUDGE;
        let baseline = baseline.unwrap_or(0.0);
        if prefill >= MIN_PREFILL_SAMPLE {
            state.history.prefill_samples = state.history.prefill_samples.saturating_add(1);
            let sample = (ttfb - baseline).max(0.0) / prefill as f64;
            let weight = if sample < state.prefill_rate {
                PREFILL_RATE_DOWN
            } else {
                PREFILL_RATE_UP
            };
            state.prefill_rate += weight * (sample - state.prefill_rate);
        }
        let expected = baseline + prefill as f64 * state.prefill_rate;
        let tolerated = self.ttfb_tolerance * expected + self.ttfb_slack;
        if !known {
            self.grow(state, busy);
            return;
        }
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
    use std::collections::HashMap;
    use std::time::Duration;

    use super::*;

    #[test]
    fn relative_cost_is_the_geometric_mean_of_the_ratios_to_the_fleet_means() {
        let mut map = HashMap::new();
        // a: streamed 0.1 s/KiB, whole 2 s/KiB; b: streamed 0.3 s/KiB only; c: nothing yet.
        let mut a = Learned::new(4.0);
        a.history.kinds[STREAMED].record(1.0, 10.0);
        a.history.kinds[WHOLE].record(1.0, 0.5);
        a.combine();
        let mut b = Learned::new(4.0);
        b.history.kinds[STREAMED].record(3.0, 10.0);
        b.combine();
        let c = Learned::new(4.0);
        map.insert(1, a.clone());
        map.insert(2, b.clone());
        map.insert(3, c.clone());
        let fleet = Fleet::of(map.values());
        // Streamed mean 0.2, whole mean 2.0.
        let expected_a = ((0.1 / 0.2) * (2.0 / 2.0_f64)).sqrt();
        assert!((fleet.relative(a.rank()) - expected_a).abs() < 1e-12);
        assert!((fleet.relative(b.rank()) - 1.5).abs() < 1e-12);
        assert_eq!(fleet.relative(c.rank()), 1.0);
        // Incremental updates give the same fleet as a full recount.
        let mut incremental = Fleet::default();
        incremental.replace(STREAMED, None, Some(0.1));
        incremental.replace(WHOLE, None, Some(2.0));
        incremental.replace(STREAMED, None, Some(0.5));
        incremental.replace(STREAMED, Some(0.5), Some(0.3));
        assert!((incremental.relative(b.rank()) - fleet.relative(b.rank())).abs() < 1e-12);
        assert_eq!(relative_cost(&fleet, None), 1.0);
    }

    fn streamed(latency: f64, ttfb: f64) -> Outcome {
        Outcome {
            latency,
            failed: false,
            first_byte: Some(ttfb),
            bytes: 4096,
            streamed: true,
        }
    }

    #[test]
    fn what_is_learned_lives_with_the_backend_and_a_new_instance_starts_afresh() {
        let set: Vec<_> = (0..2)
            .map(|i| Arc::new(Backend::new(format!("10.0.4.{i}:80").parse().unwrap())))
            .collect();
        let strategy = QueuedLeastLatency::load(3.0);
        busy(&set[0], 4);
        for _ in 0..5 {
            strategy.learn_first_byte(&set[0], &first_byte_on(&set[0], 0.1, 0, 0));
            strategy.learn(&set[0], &streamed(1.0, 0.1));
        }
        let learned = strategy.limit(&set[0]);
        assert!(learned > strategy.initial_limit, "{learned}");
        assert_eq!(strategy.limit(&set[1]), strategy.initial_limit);
        // A reload builds a new instance: it does not read the old one's values.
        let reloaded = QueuedLeastLatency::load(3.0);
        assert_eq!(reloaded.limit(&set[0]), reloaded.initial_limit);
        assert_eq!(reloaded.load_state().fleet.entries(), 0);
        // Forgetting removed backends keeps those of the set.
        for backend in (0..40).map(|i| Backend::new(format!("10.0.5.{i}:80").parse().unwrap())) {
            strategy.learn(&backend, &streamed(1.0, 0.1));
        }
        strategy.forget_removed(&set);
        assert_eq!(strategy.limit(&set[0]), learned);
        assert_eq!(strategy.load_state().fleet.entries(), 1);
    }

    /// A first byte of a request dispatched with `backend`'s requests in flight now.
    fn first_byte_on(
        backend: &Backend,
        seconds: f64,
        uncached_tokens: u64,
        queued_tokens: u64,
    ) -> FirstByte {
        FirstByte {
            in_flight: backend.in_flight(),
            ..first_byte(seconds, uncached_tokens, queued_tokens)
        }
    }

    fn first_byte(seconds: f64, uncached_tokens: u64, queued_tokens: u64) -> FirstByte {
        FirstByte {
            in_flight: 1,
            seconds,
            streamed: true,
            uncached_tokens,
            queued_tokens,
            dispatched_at: Instant::now(),
            past_limit: false,
        }
    }

    /// Puts `n` requests in flight on `backend`.
    fn busy(backend: &Backend, n: usize) {
        for _ in 0..n {
            backend.acquire();
        }
    }

    fn backend(i: u32) -> Arc<Backend> {
        Arc::new(Backend::new(format!("10.0.6.{i}:80").parse().unwrap()))
    }

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
                strategy.learn_first_byte(&replica, &first_byte_on(&replica, 0.05, 0, 0));
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
            strategy.learn_first_byte(&idle, &first_byte_on(&idle, 0.05, 0, 0));
        }
        assert_eq!(strategy.limit(&idle), strategy.initial_limit);
        // A late first byte ends the slow start: the limit drops, then grows by √limit / 5.
        let found = strategy.limit(&replica);
        strategy.learn_first_byte(&replica, &first_byte_on(&replica, 1.0, 0, 0));
        let after = strategy.limit(&replica);
        assert!(after < found * 0.95, "{after} after {found}");
        strategy.learn_first_byte(&replica, &first_byte_on(&replica, 0.05, 0, 0));
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
            strategy.learn_first_byte(&replica, &first_byte_on(&replica, 0.05, 0, 0));
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
        strategy.learn_first_byte(&replica, &late(sent, 100));
        let lowered = strategy.limit(&replica);
        assert!(lowered < 95.0, "{lowered}");
        for _ in 0..49 {
            strategy.learn_first_byte(&replica, &late(sent, 100));
        }
        assert_eq!(strategy.limit(&replica), lowered);
        // A request sent after the decrease that is late again lowers it again.
        let resent = Instant::now();
        tokio::time::advance(Duration::from_secs(2)).await;
        strategy.learn_first_byte(&replica, &late(resent, lowered as usize));
        assert!(strategy.limit(&replica) < lowered);
    }

    /// A stream's first byte after `seconds`, its request dispatched now with `in_flight`
    /// requests in flight.
    fn sent_with(in_flight: usize, seconds: f64) -> FirstByte {
        FirstByte {
            in_flight,
            ..first_byte(seconds, 0, 0)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_count_found_one_too_many_holds_the_limit_below_it_until_probed_again() {
        // A replica of 4 slots answering its first byte in 20 ms when a slot is free.
        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(8);
        busy(&replica, 1);
        strategy.learn_first_byte(&replica, &sent_with(1, 0.02));
        busy(&replica, 3);
        // Slow start: 4, 6, 8, 10.
        for _ in 0..3 {
            strategy.learn_first_byte(&replica, &sent_with(4, 0.02));
        }
        assert_eq!(strategy.limit_without_prefix(&replica), 10.0);
        // The fifth request waited 200 ms in the replica for a slot: 5 is one too many, a
        // request without a cached prefix stays below it at once (a gradient alone would take
        // rounds).
        strategy.learn_first_byte(&replica, &sent_with(5, 0.2));
        assert_eq!(strategy.limit_without_prefix(&replica), 4.5);
        // Two rounds of on-time first bytes (10) keep it there; then it reaches 5: a probe.
        for _ in 0..9 {
            strategy.learn_first_byte(&replica, &sent_with(4, 0.02));
            assert!(strategy.limit_without_prefix(&replica) < 5.0);
        }
        strategy.learn_first_byte(&replica, &sent_with(4, 0.02));
        assert!(strategy.limit_without_prefix(&replica) >= 5.0);
        // The probe waits 20 ms for a slot: within the tolerance for noise (60 ms), not within
        // the probe's (30 ms). Back below 5, with no further decrease, for twice as long.
        tokio::time::advance(Duration::from_millis(1)).await;
        strategy.learn_first_byte(&replica, &sent_with(5, 0.04));
        assert_eq!(strategy.limit_without_prefix(&replica), 4.5);
        for _ in 0..19 {
            strategy.learn_first_byte(&replica, &sent_with(4, 0.02));
            assert!(strategy.limit_without_prefix(&replica) < 5.0);
        }
        strategy.learn_first_byte(&replica, &sent_with(4, 0.02));
        assert!(strategy.limit_without_prefix(&replica) >= 5.0);
        // The replica has more room now: the probe's first byte is on time and the limit grows
        // past 5.
        tokio::time::advance(Duration::from_millis(1)).await;
        strategy.learn_first_byte(&replica, &sent_with(5, 0.021));
        busy(&replica, 1);
        for _ in 0..4 {
            strategy.learn_first_byte(&replica, &sent_with(5, 0.02));
        }
        assert!(
            strategy.limit_without_prefix(&replica) >= 6.0,
            "{}",
            strategy.limit_without_prefix(&replica)
        );
    }

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
            strategy.learn_first_byte(&replica, &first_byte_on(&replica, ttfb, uncached, queued));
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
        strategy.learn_first_byte(
            &replica,
            &first_byte_on(&replica, 1.02 + 8_000.0 * rate, 8_000, 0),
        );
        assert!(strategy.limit(&replica) < before);
    }

    #[test]
    fn sustained_queueing_does_not_become_the_baseline() {
        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(6);
        busy(&replica, 4);
        strategy.learn_first_byte(&replica, &first_byte_on(&replica, 0.025, 0, 0));
        // Twenty seconds of overload: every first byte waits 300 ms in the replica's own queue
        // while the router keeps it busy. Each is late, and stays late: the limit never climbs
        // back (were the baseline to follow, 0.3 s would read as on time within a few hundred
        // samples and the limit would grow without bound).
        for _ in 0..2_000 {
            strategy.learn_first_byte(&replica, &first_byte_on(&replica, 0.3, 0, 0));
        }
        assert_eq!(strategy.limit(&replica), 1.0);
        // A backend holding only the request itself measures its fixed delay: a replica that
        // became slower for good is learned again.
        let alone = backend(7);
        busy(&alone, 1);
        strategy.learn_first_byte(&alone, &first_byte_on(&alone, 0.025, 0, 0));
        for _ in 0..3_000 {
            strategy.learn_first_byte(&alone, &first_byte_on(&alone, 0.3, 0, 0));
        }
        busy(&alone, 3);
        let before = strategy.limit(&alone);
        strategy.learn_first_byte(&alone, &first_byte_on(&alone, 0.3, 0, 0));
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
            strategy.learn_first_byte(&replica, &first_byte_on(&replica, 0.5, 1_000, 0));
            assert_eq!(strategy.limit(&replica), before + 2.0);
        }
        // A short prompt's first byte gives the fixed delay; from then on a late one counts.
        strategy.learn_first_byte(&replica, &first_byte_on(&replica, 0.02, 0, 0));
        let before = strategy.limit(&replica);
        strategy.learn_first_byte(&replica, &first_byte_on(&replica, 3.0, 1_000, 0));
        assert!(strategy.limit(&replica) < before);
    }

    use crate::strategies::Strategy;

    fn chat(system: &str, user: &str) -> RequestInfo {
        let body = serde_json::json!({
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
            "max_tokens": 200,
        });
        RequestInfo {
            prompt: Prompt::of_body(body.to_string().as_bytes()).map(Arc::new),
            ..RequestInfo::default()
        }
    }

    /// Puts `n` requests of `output` expected tokens in flight on `backend`.
    fn working(backend: &Backend, n: usize, output: u64) {
        let work = crate::backend::InFlightWork { prefill: 0, output };
        for _ in 0..n {
            backend.acquire_work(&work);
        }
    }

    /// The load score with a limit of 64, every backend of `set` measured and having answered
    /// three streams (ramp-up room for 15 in flight): limits and ramp-up stay out of the way.
    fn with_room(set: &[Arc<Backend>]) -> QueuedLeastLatency {
        let params = super::super::Params {
            initial_limit: 64.0,
            ..super::super::Params::default()
        };
        let strategy = QueuedLeastLatency::with(&params, &super::super::StrategyContext::default());
        for replica in set {
            for _ in 0..3 {
                strategy.learn_first_byte(replica, &first_byte_on(replica, 0.02, 0, 0));
            }
        }
        strategy
    }

    #[test]
    fn a_request_goes_only_where_the_limit_has_a_whole_slot_for_it() {
        // A learned limit between two counts (4.5: found, not yet proven, room for a fifth)
        // admits 4 in flight: a fifth would wait inside the replica behind the four it runs,
        // where the router's queue order (bands, tenants' shares) no longer holds. The fifth
        // goes once the limit reaches 5.
        let request = RequestInfo::default();
        for (i, limit, admitted) in [(50, 4.5, 4), (51, 5.0, 5)] {
            let replica = backend(i);
            let set = vec![Arc::clone(&replica)];
            let params = super::super::Params {
                initial_limit: limit,
                ..super::super::Params::default()
            };
            let strategy =
                QueuedLeastLatency::with(&params, &super::super::StrategyContext::default());
            for _ in 0..3 {
                strategy.learn_first_byte(&replica, &first_byte_on(&replica, 0.02, 0, 0));
            }
            busy(&replica, admitted - 1);
            assert_eq!(
                strategy.pick(&request, (&set).into()),
                Some(Pick::at(0)),
                "{limit}"
            );
            busy(&replica, 1);
            assert_eq!(strategy.pick(&request, (&set).into()), None, "{limit}");
        }
    }

    /// Takes `replica` (4 slots) through slow start to a limit of 10, then a fifth request
    /// waits inside it for a slot: a ceiling at 5, with 4 in flight.
    fn find_a_ceiling(strategy: &QueuedLeastLatency, replica: &Backend) {
        busy(replica, 1);
        strategy.learn_first_byte(replica, &sent_with(1, 0.02));
        busy(replica, 3);
        for _ in 0..3 {
            strategy.learn_first_byte(replica, &sent_with(4, 0.02));
        }
        strategy.learn_first_byte(replica, &sent_with(5, 0.2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_ceiling_holds_back_requests_without_a_cached_prefix_only() {
        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(52);
        let set = vec![Arc::clone(&replica)];
        find_a_ceiling(&strategy, &replica);
        assert!(
            strategy.limit(&replica) > 5.0,
            "{}",
            strategy.limit(&replica)
        );
        // With 4 in flight, a fifth request none of whose prompt the replica holds waits in the
        // router's queue; one whose tenant prompt the replica holds goes: waiting in the engine
        // that skips its prefill is worth more to it than the next free slot.
        let cold = chat(&"A new tenant's system prompt. ".repeat(400), "hello");
        let cached = tenant_chat_cached_on(&replica, "eleven");
        assert_eq!(strategy.pick(&cold, (&set).into()), None);
        assert_eq!(strategy.pick(&cached, (&set).into()), Some(Pick::at(0)));
        busy(&replica, 1);
        assert_eq!(strategy.pick(&cached, (&set).into()), Some(Pick::at(0)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_replica_answering_errors_is_not_chosen_over_a_healthy_ones_ceiling() {
        // A healthy replica whose ceiling holds a fifth request back (as above), and a replica
        // that answers 500 at once, idle.
        let strategy = QueuedLeastLatency::load(3.0);
        let (healthy, broken) = (backend(53), backend(54));
        let set = vec![Arc::clone(&healthy), Arc::clone(&broken)];
        find_a_ceiling(&strategy, &healthy);
        let error = Outcome {
            failed: true,
            ..streamed(0.001, 0.001)
        };
        strategy.learn(&broken, &error);
        let request = RequestInfo::default();
        // While its last answer is an error, the request goes to the healthy replica past its
        // ceiling (a wait of a few steps there) rather than to a likely error.
        broken.record_failure_in_a_row();
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
        // A replica that is only slower is not passed over that way: the ceiling holds.
        broken.reset_failures_in_a_row();
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
        // At the healthy replica's limit, the failing one is what there is.
        broken.record_failure_in_a_row();
        while (healthy.in_flight() as f64) + 1.0 <= strategy.limit(&healthy) {
            busy(&healthy, 1);
        }
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
    }

    #[test]
    fn a_long_prompt_goes_where_its_prefill_stalls_the_fewest_streams() {
        let set = vec![backend(20), backend(21)];
        let strategy = with_room(&set);
        // A: 4 long answers in flight (2,400 tokens of work); B: 10 short ones (1,000).
        working(&set[0], 4, 600);
        working(&set[1], 10, 100);
        // A short chat goes where the least work waits.
        assert_eq!(
            strategy.pick(&chat("Be brief.", "hi"), (&set).into()),
            Some(Pick::at(1))
        );
        // A 30,000-token document, cached nowhere, holds up every stream of the replica it is
        // prefilled on: it goes to the one with 4 streams, not 10.
        let document = "A long contract to summarise, clause after clause. ".repeat(2_400);
        let request = chat("Summarise.", &document);
        assert!(request.prompt_tokens() > 25_000);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
    }

    #[test]
    fn a_replica_busy_prefilling_documents_does_not_draw_the_next_one() {
        let set = vec![backend(30), backend(31), backend(32)];
        let strategy = with_room(&set);
        // A holds 2 streams and two 30,000-token documents waiting for their first byte; B and
        // C hold 10 streams each and nothing to prefill.
        working(&set[0], 2, 200);
        let documents = crate::backend::InFlightWork {
            prefill: 60_000,
            output: 0,
        };
        set[0].acquire_work(&documents);
        working(&set[1], 10, 200);
        working(&set[2], 10, 200);
        let document = "A long contract to summarise, clause after clause. ".repeat(2_400);
        let request = chat("Summarise.", &document);
        // Its prefill would stall the fewest streams on A, but A already has 60,000 tokens to
        // prefill: more than 1.25 × the mean with this document added (37,500); it goes to B or C.
        let pick = strategy.pick(&request, (&set).into());
        assert!(matches!(pick, Some(Pick { index: 1 | 2, .. })), "{pick:?}");
        // Once A's documents have their first bytes, it takes the next one.
        set[0].prefilled(&documents);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
    }

    #[test]
    fn a_cached_prefix_draws_the_request_until_the_load_guard() {
        let strategy = QueuedLeastLatency::load(3.0);
        let set = vec![backend(10), backend(11)];
        for replica in &set {
            strategy.learn_first_byte(replica, &first_byte_on(replica, 0.02, 0, 0));
        }
        let request = tenant_chat_cached_on(&set[0], "seven");
        assert!(request.prompt.as_ref().unwrap().blocks.len() > 40);
        // A little more load on the replica with the tenant's prompt: the prefill it saves wins.
        working(&set[0], 3, 200);
        working(&set[1], 2, 200);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
        // Past 1.1 × its share of the work in flight plus three typical requests (11 against
        // 2: 1.1 × 14 / 2 + 3 = 10.7 requests' work), it is skipped however long the prefix.
        working(&set[0], 8, 200);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
        // A request whose prompt no replica holds is not held back by the guard: it goes to the
        // cheapest, here the less loaded.
        let other = chat("A different tenant entirely. ", "hi");
        assert_eq!(strategy.pick(&other, (&set).into()), Some(Pick::at(1)));
    }

    #[test]
    fn the_load_guard_allows_a_few_requests_above_the_share_whatever_the_scale() {
        let set = vec![backend(12), backend(13)];
        let params = super::super::Params {
            initial_limit: 1000.0,
            ..super::super::Params::default()
        };
        let strategy = QueuedLeastLatency::with(&params, &super::super::StrategyContext::default());
        for replica in &set {
            for _ in 0..100 {
                strategy.learn_first_byte(replica, &first_byte(0.02, 0, 0));
            }
        }
        let request = tenant_chat_cached_on(&set[0], "three");
        // Few in flight: 4 against 2 is within the share (3.5) + 3 + 0.1 × the share, in
        // requests and in work (a multiple alone, 1.1 × 3.5 = 3.85, would leave no room for
        // the cached prefix).
        decoding(&set[0], 4, 200);
        decoding(&set[1], 2, 200);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
        // Hundreds in flight: 258 against 248 is within the share (253.5) + 3 + 3 (the
        // multiple's part is capped at three requests, in count and in work, for the replica
        // holding the prompt; a replica holding none of it has two and two, 257.5); 262
        // against 248 is not. A multiple of 1.1 would let the cached engine hold 277, 30 more
        // than its peer: past its capacity when the fleet is nearly full (engines of 256
        // sequences).
        decoding(&set[0], 254, 200);
        decoding(&set[1], 246, 200);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
        decoding(&set[0], 4, 200);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
    }

    /// [`with_room`], each backend having answered 23 streams: ramp-up room for 115 in flight.
    fn with_room_for_many(set: &[Arc<Backend>]) -> QueuedLeastLatency {
        let strategy = with_room(set);
        for replica in set {
            for _ in 0..20 {
                strategy.learn_first_byte(replica, &first_byte(0.02, 0, 0));
            }
        }
        strategy
    }

    #[test]
    fn many_short_answers_past_the_share_skip_a_backend_as_work_would() {
        // A holds 30 requests of short answers (3,000 tokens of work), B 20 long ones (6,000).
        // By work A is the less loaded, by count it holds more than its share (25.5) + 2 + 2:
        // an engine fills up by sequences, so the request goes to B.
        let set = vec![backend(14), backend(15)];
        let strategy = with_room_for_many(&set);
        decoding(&set[0], 30, 100);
        decoding(&set[1], 20, 300);
        let request = chat("Be brief.", "hi");
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
        // Within the count's slack, the lighter work wins.
        decoding(&set[1], 7, 300);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
    }

    #[test]
    fn when_the_guards_disagree_the_count_guard_is_kept() {
        // Both replicas hold the tenant's prompt. A: 10 long answers (10,000 tokens of work,
        // past the load guard's 8,300); B: 30 short ones (3,000 tokens, but 30 requests, past
        // the count guard's 25.55). No backend is within every guard: capacity comes first,
        // and the request goes to A, where an engine has sequences to spare, not to B, whose
        // lighter work would win the score.
        let set = vec![backend(16), backend(17)];
        let strategy = with_room_for_many(&set);
        let request = tenant_chat_cached_on(&set[0], "twelve");
        set[1]
            .prefixes()
            .record(&request.prompt.as_ref().unwrap().blocks);
        decoding(&set[0], 10, 1_000);
        decoding(&set[1], 30, 100);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
        // With 16 (within the count guard's 17.85 for a replica holding the prompt), B is
        // within every guard and wins.
        for _ in 0..14 {
            set[1].release_work(
                &crate::backend::InFlightWork {
                    prefill: 0,
                    output: 100,
                },
                false,
            );
        }
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
    }

    /// Puts `n` requests of `output` expected tokens in flight on `backend` that have had
    /// their first byte (streams decoding).
    fn decoding(backend: &Backend, n: usize, output: u64) {
        let work = crate::backend::InFlightWork { prefill: 0, output };
        for _ in 0..n {
            backend.acquire_work(&work);
            backend.prefilled(&work);
        }
    }

    /// A chat request of `tenant`'s long system prompt, which `backend`'s prefix index holds.
    fn tenant_chat_cached_on(backend: &Backend, tenant: &str) -> RequestInfo {
        let system = format!("You are the assistant of tenant {tenant}. ").repeat(400);
        let request = chat(&system, "hello");
        backend
            .prefixes()
            .record(&request.prompt.as_ref().unwrap().blocks);
        request
    }

    #[test]
    fn a_replica_whose_requests_wait_for_their_first_byte_stops_drawing_cached_ones() {
        let set = vec![backend(40), backend(41)];
        let strategy = with_room(&set);
        let request = tenant_chat_cached_on(&set[0], "nine");
        // Both replicas decode 4 streams (A's shorter ones); the one with the tenant's prompt
        // also holds requests that have had no first byte, short ones: the load guard stays out
        // of the way.
        decoding(&set[0], 4, 10);
        decoding(&set[1], 4, 200);
        working(&set[0], 2, 20);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
        // 9 of them: its engine queues them (its KV cache is full).
        working(&set[0], 7, 20);
        // 9 waiting: more than 1.25 × the fewest (0) + 8. The request goes where it starts.
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
        // Once its peer holds waiting requests too, locality wins again.
        working(&set[1], 2, 200);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
    }

    #[test]
    fn the_guards_never_hold_a_request_back_while_a_backend_has_room() {
        let set = vec![backend(42), backend(43)];
        // Each has answered three streams: ramp-up room for 15 in flight.
        let strategy = with_room(&set);
        let request = tenant_chat_cached_on(&set[0], "ten");
        // A holds 10 requests waiting for their first byte (past the first-byte guard); B is
        // full (15 streams). The request goes to A rather than wait for B.
        working(&set[0], 10, 200);
        decoding(&set[1], 15, 200);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
        // With room on B, the guard sends it there.
        set[1].release_work(
            &crate::backend::InFlightWork {
                prefill: 0,
                output: 200,
            },
            false,
        );
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
    }

    /// A chat request asking for `max_tokens` tokens.
    fn asking(max_tokens: u64) -> RequestInfo {
        let body = serde_json::json!({
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": max_tokens,
        });
        RequestInfo {
            prompt: Prompt::of_body(body.to_string().as_bytes()).map(Arc::new),
            ..RequestInfo::default()
        }
    }

    /// Two replicas with a limit of 4, having answered three streams each, whose answers took
    /// `seconds[i]` for 4 KiB; the first is full of 200-token answers.
    fn first_full(seconds: [f64; 2], ids: [u32; 2]) -> (QueuedLeastLatency, Vec<Arc<Backend>>) {
        let set = vec![backend(ids[0]), backend(ids[1])];
        let params = super::super::Params {
            initial_limit: 4.0,
            ..super::super::Params::default()
        };
        let strategy = QueuedLeastLatency::with(&params, &super::super::StrategyContext::default());
        for (replica, seconds) in set.iter().zip(seconds) {
            for _ in 0..3 {
                strategy.learn_first_byte(replica, &first_byte_on(replica, 0.02, 0, 0));
                strategy.learn(replica, &streamed(seconds, 0.02));
            }
        }
        let limit = strategy.limit(&set[0]);
        assert!(limit <= 8.0, "{limit}");
        decoding(&set[0], limit.floor() as usize, 200);
        (strategy, set)
    }

    #[test]
    fn a_long_answer_waits_for_a_slot_on_a_much_faster_replica() {
        // A decodes 4 times as fast as B and is full; B is idle.
        let (strategy, set) = first_full([0.5, 2.0], [60, 61]);
        // A typical answer (200 tokens) starts at once on B.
        assert_eq!(
            strategy.pick(&asking(200), (&set).into()),
            Some(Pick::at(1))
        );
        // A 2,000-token answer ends sooner on A after a slot there frees (the 200-token
        // answers ahead of it) than on B from now: it goes to A, past its limit.
        assert_eq!(
            strategy.pick(&asking(2_000), (&set).into()),
            Some(Pick::past_limit_at(0))
        );
        // Not to a replica answering errors.
        set[0].record_failure_in_a_row();
        assert_eq!(
            strategy.pick(&asking(2_000), (&set).into()),
            Some(Pick::at(1))
        );
        set[0].reset_failures_in_a_row();
        // Nor when the request does not say how long its answer is.
        let unstated = chat_without_max_tokens();
        assert_eq!(strategy.pick(&unstated, (&set).into()), Some(Pick::at(1)));
    }

    #[test]
    fn on_replicas_of_one_speed_a_request_never_waits_past_a_limit() {
        let (strategy, set) = first_full([1.0, 1.1], [62, 63]);
        assert_eq!(
            strategy.pick(&asking(2_000), (&set).into()),
            Some(Pick::at(1))
        );
        assert_eq!(
            strategy.pick(&asking(20_000), (&set).into()),
            Some(Pick::at(1))
        );
    }

    fn chat_without_max_tokens() -> RequestInfo {
        let body = serde_json::json!({
            "messages": [{"role": "user", "content": "Tell me a long story."}],
        });
        RequestInfo {
            prompt: Prompt::of_body(body.to_string().as_bytes()).map(Arc::new),
            ..RequestInfo::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_first_byte_of_a_request_sent_past_the_limit_does_not_lower_it() {
        let (strategy, set) = first_full([0.5, 2.0], [64, 65]);
        let limit = strategy.limit(&set[0]);
        let over = (limit.floor() as usize) + 1;
        tokio::time::advance(Duration::from_secs(1)).await;
        // A 2,000-token answer goes to the full, faster replica, past its limit.
        let long = asking(2_000);
        assert_eq!(
            strategy.pick(&long, (&set).into()),
            Some(Pick {
                index: 0,
                past_limit: true
            })
        );
        // It waited there for a slot, as expected.
        let expected = FirstByte {
            past_limit: true,
            ..sent_with(over, 0.5)
        };
        strategy.learn_first_byte(&set[0], &expected);
        assert_eq!(strategy.limit(&set[0]), limit);
        // The same count and wait of a request its pick did not send past the limit lowers it,
        // whatever else was sent past the limit before.
        strategy.learn_first_byte(&set[0], &sent_with(over, 0.5));
        assert!(strategy.limit(&set[0]) < limit);
    }

    #[test]
    fn a_request_sent_within_the_limit_is_not_noted_past_it() {
        let (strategy, set) = first_full([1.0, 1.1], [66, 67]);
        let long = asking(2_000);
        assert_eq!(
            strategy.pick(&long, (&set).into()),
            Some(Pick {
                index: 1,
                past_limit: false
            })
        );
    }
}
