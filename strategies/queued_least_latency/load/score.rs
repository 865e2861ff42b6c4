//! The score: what one pick needs of the fleet and of the request ([`Demand`]), the guards that
//! keep locality from piling work on one backend (load, count, prefill, first-byte), and the
//! expected time a request would spend on a backend: relative cost × the work in flight with
//! its own, plus the prefill queued there and its own uncached prefill once per sequence it
//! stalls, plus the engine's own waiting requests.

use tokio::time::Instant;

use super::cost::{Fleet, relative_cost};
use super::engine::engine_ahead;
use super::ttfb::PRIOR_PREFILL_SECONDS_PER_TOKEN;
use super::{LoadScore, Rank, Slot};
use crate::backend::Backend;
use crate::prompt::Prompt;
use crate::strategies::{Candidates, RequestInfo};

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

/// The share of its prompt a request must leave uncached on a backend for the prefill guard to
/// pass that backend over: a request whose prompt the backend mostly holds adds little to its
/// prefill queue, and would add most of it to another's, prefilled while that one's streams
/// wait.
const PREFILL_GUARDED_SHARE: f64 = 0.5;

/// Requests a candidate may hold waiting for their first byte above `load_bound` × the fewest
/// before the first-byte guard passes it over: the prefills of a step or two are not a queue.
const AWAITING_SLACK: f64 = 8.0;

/// What one pick needs of the fleet and of the request, gathered once per pick.
#[derive(Debug, Clone, Copy)]
pub(super) struct Demand<'r> {
    /// The request's prompt (`None` without one).
    pub(super) prompt: Option<&'r Prompt>,
    /// The request's prompt tokens.
    pub(super) prompt_tokens: u64,
    /// Its expected output tokens.
    pub(super) output: f64,
    /// Seconds one typical request adds to the wait of the requests it shares a backend with:
    /// the fleet's mean latency over its mean concurrency limit.
    pub(super) unit: f64,
    /// Tokens of output a typical request in flight is expected to generate.
    pub(super) typical_output: f64,
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
    /// The fleet's mean count of requests in flight, for a request with a prompt: a held
    /// [`Ceiling`] does not keep this request from a backend whose count, with it and weighed
    /// by the backend's relative cost, stays [`LOAD_SLACK`] or more below that mean. A ceiling
    /// comes from first bytes judged late against what the backend was expected to take, and
    /// that expectation can be wrong (a prefill rate read low makes the first bytes of long
    /// prompts look late on a replica with sequences to spare); that far below the mean, the
    /// backend's requests take less time than a typical backend's, least-loaded would send the
    /// request there, and the router routes no worse. The relative cost keeps a slow replica's
    /// low count from reading as room: its ceiling is its speed, not a misreading. Closer to
    /// the mean the ceiling holds: on replicas kept at their sequences, the counts move around
    /// the mean, and a ceiling waived there lets requests into engines' own queues, out of the
    /// router queue's order.
    mean_in_flight: Option<f64>,
    /// The prefill guard for a request with a prompt: how many uncached prompt tokens may
    /// already wait for their first byte on a candidate: `load_bound` times the mean over the
    /// candidates with this request's prompt added, or this request's prompt tokens if more
    /// (the candidate with the least always is within it). A replica busy prefilling long
    /// prompts does not draw every long prompt after them because it holds few streams. It
    /// passes over only a backend that holds less than [`PREFILL_GUARDED_SHARE`] of the prompt.
    prefill_bound: Option<f64>,
    /// The first-byte guard for a request with a prompt: how many requests may already wait
    /// for their first byte on a candidate: `load_bound` times the fewest any candidate has,
    /// plus [`AWAITING_SLACK`]. A replica whose engine holds requests in its own queue (its KV
    /// cache is full) stops drawing new ones while a peer answers its own.
    awaiting_bound: Option<f64>,
    /// When the pick happens, for a request with a prompt: the engines' own load signals are
    /// read then ([`Backend::engine`]).
    pub(super) now: Option<Instant>,
    /// Whether held ceilings apply ([`Ceiling`]); when they do not, backends in a run of
    /// failures are skipped ([`Self::past_ceilings`]).
    ceilings: bool,
    /// Whether the request may probe a held ceiling ([`Ceiling`]): not one the router queue
    /// put ahead of an older request ([`RequestInfo::ahead_of_older`]), which a probe would
    /// make wait inside the replica, out of the queue's order.
    probes: bool,
    /// Seconds a typical backend takes per output token: the fleet's mean latency over the
    /// typical request's output tokens.
    pub(super) token_seconds: f64,
    /// The lowest relative cost among the candidates, when the request states its output
    /// (`max_tokens`): what [`LoadScore::overflow`] compares with; `None`, no
    /// overflow.
    pub(super) fastest: Option<f64>,
}

impl<'r> Demand<'r> {
    /// What a pick for `request` among `candidates` needs.
    pub(super) fn of(
        strategy: &LoadScore,
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
        let now = Instant::now();
        for (_, backend) in candidates.iter() {
            let rank = backend.strategy_slot::<Slot>().rank(generation);
            if let Some(ewma) = backend.ewma_latency() {
                latency += ewma;
                measured += 1;
            }
            limits += rank.map_or(strategy.initial_limit, |r| r.limit);
            work += backend.work_in_flight();
            queued_prefill += LoadScore::queued_prefill(backend, rank, now);
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
        let mean_in_flight = guarded.then(|| in_flight as f64 / count_f);
        let prompt_tokens = request.prompt_tokens() as f64;
        let prefill_bound = guarded.then(|| {
            (strategy.load_bound * (queued_prefill as f64 + prompt_tokens) / count_f)
                .max(prompt_tokens)
        });
        let awaiting_bound =
            guarded.then_some(strategy.load_bound * fewest_awaiting as f64 + AWAITING_SLACK);
        Self {
            prompt,
            prompt_tokens: request.prompt_tokens(),
            output,
            unit: mean_latency / (limits / count_f).max(1.0),
            typical_output,
            bound,
            count_share,
            mean_in_flight,
            prefill_bound,
            awaiting_bound,
            now: Some(now),
            ceilings: true,
            probes: !request.ahead_of_older,
            token_seconds: mean_latency / typical_output,
            fastest: prompt
                .and_then(|p| p.max_tokens)
                .and(fastest.is_finite().then_some(fastest)),
        }
    }
}

impl Demand<'_> {
    /// The prompt tokens `backend`'s prefix index says it holds (0 for a request without a
    /// prompt).
    pub(super) fn matched_tokens(&self, backend: &Backend) -> u64 {
        match self.prompt {
            Some(prompt) if self.prompt_tokens > 0 => {
                Prompt::blocks_tokens(backend.prefixes().held_blocks(prompt))
            }
            _ => 0,
        }
    }

    /// The uncached prompt tokens `backend` (learned as `rank`) has still to prefill when the
    /// pick happens ([`LoadScore::queued_prefill`]; the tokens awaiting their first byte
    /// without a pick time).
    pub(super) fn queued_prefill(&self, backend: &Backend, rank: Option<Rank>) -> u64 {
        self.now.map_or_else(
            || backend.prefill_in_flight(),
            |now| LoadScore::queued_prefill(backend, rank, now),
        )
    }

    /// The prompt's blocks `backend`'s prefix index says it holds, and the tokens of those and
    /// of the blocks after them it recorded past its reach (stale): the held blocks and tokens
    /// of [`Self::matched_tokens`], then the stale tokens; (0, 0, 0) for a request without a
    /// prompt.
    fn held_and_stale(&self, backend: &Backend) -> (usize, u64, u64) {
        match self.prompt {
            Some(prompt) if self.prompt_tokens > 0 => {
                let (blocks, stale) = backend.prefixes().held_and_stale_blocks(prompt);
                let held = Prompt::blocks_tokens(blocks);
                let stale =
                    Prompt::blocks_tokens(stale).min(self.prompt_tokens.saturating_sub(held));
                (blocks, held, stale)
            }
            _ => (0, 0, 0),
        }
    }

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

impl LoadScore {
    /// Whether `backend` has shown how it answers: a finished request or a first byte.
    fn measured(backend: &Backend, rank: Option<Rank>) -> bool {
        backend.ewma_latency().is_some() || rank.is_some()
    }

    /// The load score of `backend` if it is a candidate: the seconds a request is expected to
    /// spend on it before it ends, as far as they differ between backends: the work in flight
    /// shared over the backend's parallel capacity, plus the prefill of the prompt tokens its
    /// prefix index does not hold and of those queued ahead (see the module docs).
    pub(super) fn score(
        &self,
        backend: &Backend,
        generation: u64,
        fleet: &Fleet,
        demand: &Demand<'_>,
    ) -> Option<f64> {
        self.scored(backend, generation, fleet, demand)
            .map(|(score, _)| score)
    }

    /// [`Self::score`], and the prompt's blocks the backend's prefix index says it holds.
    pub(super) fn scored(
        &self,
        backend: &Backend,
        generation: u64,
        fleet: &Fleet,
        demand: &Demand<'_>,
    ) -> Option<(f64, usize)> {
        let in_flight = backend.in_flight();
        if !demand.ceilings && backend.failures_in_a_row() > 0 {
            return None;
        }
        let state = backend.strategy_slot::<Slot>().rank(generation);
        // Until it has answered, a backend takes up to the initial limit, scored as a typical
        // backend of the fleet (its answers take seconds: holding requests back until the first
        // one ends would leave it idle while they wait); then the ramp-up room applies.
        let measured = Self::measured(backend, state);
        // An engine that states its capacity (TGI's `max_concurrent_requests`) is taken at its
        // word.
        let limit = demand
            .now
            .and_then(|now| backend.engine().max_concurrent(now))
            .map_or_else(|| state.map_or(self.initial_limit, |s| s.limit), f64::from);
        let ramp = !measured || self.ramp_room(backend, in_flight);
        // A request goes where the limit has a whole slot for it: with a limit of 4.4 a fifth
        // would wait inside the replica, behind the four it runs, out of the router queue's
        // order (bands, tenants' shares). The next one goes when the limit reaches 5.
        if in_flight > 0 && !((in_flight as f64) + 1.0 <= limit && ramp) {
            return None;
        }
        let (held_blocks, matched, stale) = demand.held_and_stale(backend);
        let relative = relative_cost(fleet, state);
        // Below a held ceiling (at its count, for a probe, only if the request may probe),
        // unless the backend holds part of the prompt ([`Ceiling`]) or stays well below the
        // fleet's mean count with this request, its count weighed by its relative cost
        // ([`Demand::mean_in_flight`]).
        let busier = |rank: Rank| {
            let count = in_flight as f64 + 1.0;
            let cap = if demand.probes {
                rank.cap
            } else {
                rank.held_cap
            };
            count > cap
                && demand
                    .mean_in_flight
                    .is_none_or(|mean| count * relative > mean - LOAD_SLACK)
        };
        if demand.ceilings && in_flight > 0 && matched == 0 && state.is_some_and(busier) {
            return None;
        }
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
        let queued_prefill = demand.queued_prefill(backend, state);
        let uncached = demand.prompt_tokens.saturating_sub(matched);
        if demand.prefill_bound.is_some_and(|bound| {
            queued_prefill as f64 > bound
                && uncached as f64 > PREFILL_GUARDED_SHARE * demand.prompt_tokens as f64
        }) {
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
            return Some((load, held_blocks));
        }
        // Its prefill waits for the prefill queued ahead of it, and stalls the decode steps of
        // every request in flight there while it runs (an engine's step carries both): a miss
        // on a busy replica costs its prefill once per sequence it holds up. Of the prompt's
        // part recorded past the index's reach, the share the engine was found to keep
        // (`cache.rs`) is not prefilled.
        let stalled = 1 + in_flight as u64;
        let kept = backend.prefixes().stale_kept() * stale as f64;
        let prefill = (queued_prefill as f64 + (uncached as f64 - kept) * stalled as f64)
            * state.map_or(PRIOR_PREFILL_SECONDS_PER_TOKEN, |s| s.prefill_rate);
        Some((load + prefill, held_blocks))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::testing::*;
    use crate::strategies::{Pick, RequestInfo, Strategy};

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
            let strategy = with_initial_limit(limit);
            for _ in 0..3 {
                strategy.on_first_byte(&replica, &first_byte_on(&replica, 0.02, 0, 0));
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
    async fn a_request_the_queue_put_ahead_of_older_ones_never_probes_a_ceiling() {
        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(77);
        let set = vec![Arc::clone(&replica)];
        find_a_ceiling(&strategy, &replica);
        // Two rounds of on-time first bytes end the hold: one request may go at the ceiling's
        // count, a probe that may wait inside the replica.
        for _ in 0..10 {
            strategy.on_first_byte(&replica, &sent_with(4, 0.02));
        }
        assert!(strategy.limit_without_prefix(&replica) >= 5.0);
        let cold = chat(&"A new tenant's system prompt. ".repeat(400), "hello");
        let ahead = RequestInfo {
            ahead_of_older: true,
            ..cold.clone()
        };
        // A request the queue put ahead of an older one (a tenant under its share, a higher
        // band) waits for a slot below the count; the probe is left to one in the queue's own
        // order.
        assert_eq!(strategy.pick(&ahead, (&set).into()), None);
        assert_eq!(strategy.pick(&cold, (&set).into()), Some(Pick::at(0)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_ceiling_does_not_hold_a_replica_well_below_the_fleets_mean_count() {
        // A replica whose ceiling holds a fifth request back (4 in flight), beside two with
        // room to spare.
        let (held, a, b) = (backend(58), backend(59), backend(60));
        let set = vec![Arc::clone(&held), Arc::clone(&a), Arc::clone(&b)];
        let strategy = with_room(&set);
        find_a_ceiling(&strategy, &held);
        assert_eq!(held.in_flight(), 4);
        assert!(strategy.limit_without_prefix(&held) < 5.0);
        assert!(strategy.limit(&held) > 5.0, "{}", strategy.limit(&held));
        let cold = chat(&"A new tenant's system prompt. ".repeat(400), "hello");
        // With 4 in flight on each, a fifth would take the held replica past the fleet's mean:
        // the ceiling holds, and the request goes to a replica with room. With 8 on each of the
        // others (a mean of 6.7), its fifth would still be within 2 of the mean: it holds.
        for others in [4, 8] {
            busy(&a, others - a.in_flight());
            busy(&b, others - b.in_flight());
            let pick = strategy.pick(&cold, (&set).into());
            assert!(
                matches!(pick, Some(Pick { index: 1 | 2, .. })),
                "{others}: {pick:?}"
            );
        }
        // With 9 on each (a mean of 7.3), the fifth keeps it more than 2 below the mean:
        // least-loaded would send the request there, and so does the score (its prefill there
        // stalls the fewest streams).
        busy(&a, 1);
        busy(&b, 1);
        assert_eq!(strategy.pick(&cold, (&set).into()), Some(Pick::at(0)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_ceiling_holds_a_slow_replica_whose_low_count_is_its_speed() {
        // As above, but the held replica's answers take six times as long as the others' (a
        // relative cost of about 2.25): its low count is what its speed allows, not room.
        let (held, a, b) = (backend(61), backend(62), backend(63));
        let set = vec![Arc::clone(&held), Arc::clone(&a), Arc::clone(&b)];
        let strategy = with_room(&set);
        for _ in 0..5 {
            strategy.on_outcome(&held, &streamed(6.0, 0.02));
            strategy.on_outcome(&a, &streamed(1.0, 0.02));
            strategy.on_outcome(&b, &streamed(1.0, 0.02));
        }
        find_a_ceiling(&strategy, &held);
        assert_eq!(held.in_flight(), 4);
        let cold = chat(&"A new tenant's system prompt. ".repeat(400), "hello");
        // With 15 on each of the others (a mean of 11.3), a fifth request would leave a
        // replica of typical speed more than 2 below the mean, but this one's five weigh as
        // eleven typical requests: the ceiling holds, and the request waits for room.
        busy(&a, 15 - a.in_flight());
        busy(&b, 15 - b.in_flight());
        let pick = strategy.pick(&cold, (&set).into());
        assert!(pick.is_none_or(|pick| pick.index != 0), "{pick:?}");
        // Far enough below the mean, even weighed, it takes the request.
        busy(&a, 5);
        busy(&b, 5);
        assert_eq!(strategy.pick(&cold, (&set).into()), Some(Pick::at(0)));
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
    fn a_replica_busy_prefilling_still_draws_requests_whose_prompt_it_holds() {
        let set = vec![backend(33), backend(34), backend(35)];
        let strategy = with_room(&set);
        let request = tenant_chat_cached_on(&set[0], "thirteen");
        let prompt = request.prompt_tokens();
        // Each replica decodes 2 streams and prefills other prompts: A 9,000 tokens, B and C
        // 1,000 each. A's queue is above the prefill guard's 1.25 × the mean with this prompt
        // added.
        let queued = |tokens| crate::backend::InFlightWork {
            prefill: tokens,
            output: 200,
        };
        for (replica, tokens) in set.iter().zip([9_000, 1_000, 1_000]) {
            decoding(replica, 2, 200);
            replica.acquire_work(&queued(tokens));
        }
        assert!(9_000.0 > 1.25 * (11_000 + prompt) as f64 / 3.0, "{prompt}");
        // A holds the request's prompt: there it adds nothing to the prefill queue, anywhere else
        // all of it, prefilled while streams wait. It goes to A.
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
        // Holding only part of it, less than half, A is passed over as before.
        let longer = chat(
            &format!(
                "{}{}",
                "You are the assistant of tenant thirteen. ".repeat(400),
                "More. ".repeat(3_000)
            ),
            "hello",
        );
        assert!(
            set[0]
                .prefixes()
                .matched_blocks(&longer.prompt.as_ref().unwrap().blocks)
                > 0
        );
        let pick = strategy.pick(&longer, (&set).into());
        assert!(matches!(pick, Some(Pick { index: 1 | 2, .. })), "{pick:?}");
    }

    #[test]
    fn a_cached_prefix_draws_the_request_until_the_load_guard() {
        let strategy = QueuedLeastLatency::load(3.0);
        let set = vec![backend(10), backend(11)];
        for replica in &set {
            strategy.on_first_byte(replica, &first_byte_on(replica, 0.02, 0, 0));
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
        let strategy = with_initial_limit(1000.0);
        for replica in &set {
            for _ in 0..100 {
                strategy.on_first_byte(replica, &first_byte(0.02, 0, 0));
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
    fn a_prompt_recorded_past_the_reach_counts_at_the_share_the_engine_was_found_to_keep() {
        use crate::strategies::{Outcome, Recall, Usage};

        // Two replicas with room. A ran the tenant's prompt long ago: its index recorded the
        // prompt, then a thousand newer blocks, so the prompt lies past the reach (stale). B
        // never saw it. A runs three requests, B two.
        let (a, b) = (backend(72), backend(73));
        let set = vec![Arc::clone(&a), Arc::clone(&b)];
        let strategy = with_room(&set);
        let request = chat(
            &"You are the assistant of tenant twelve. ".repeat(400),
            "hi",
        );
        let prompt = request.prompt.as_ref().unwrap();
        let filler: Vec<u64> = (1..=1_000u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        for blocks in [&prompt.blocks[..], &filler] {
            a.prefixes().record(blocks);
            a.prefixes().release(blocks);
        }
        let blocks = prompt.blocks.len();
        assert_eq!(a.prefixes().held_and_stale_blocks(prompt), (0, blocks));
        busy(&a, 3);
        busy(&b, 2);
        // Before A's answers have said anything, a stale part is as likely kept as not: half
        // the prefill saved is worth more than one request fewer to stall.
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
        // A's answers report what its engine found of prompts recorded past the reach.
        let answers = |found: u64| {
            let tokens = prompt.tokens.into();
            let answer = Outcome {
                usage: Some(Usage {
                    prompt_tokens: tokens,
                    completion_tokens: 10,
                    cached_tokens: Some(found * tokens),
                }),
                prompt_tokens: tokens,
                recall: Recall {
                    stale: blocks,
                    stale_age: 200,
                    ..Recall::default()
                },
                ..streamed(1.0, 0.1)
            };
            for _ in 0..60 {
                super::super::cache::learn_cache(&a, &answer);
            }
        };
        // It found none: the prompt counts as uncached there, and B, less loaded, takes it.
        answers(0);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
        // It found all of them (stale parts younger than this one, which stays past the
        // reach): A again, even with two more requests than B.
        answers(1);
        assert_eq!(a.prefixes().held_and_stale_blocks(prompt), (0, blocks));
        busy(&a, 1);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
    }
}
