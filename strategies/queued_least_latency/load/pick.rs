//! A pick under the load score, and the order in which it falls back: the lowest score among
//! the backends with room within every guard, and between those holding the same most of the
//! prompt, the prompt's home ([`LoadScore::home`]); a backend in a run of failures only when no
//! healthy one has room, held ceilings waived; with no backend within every guard, the count
//! guard alone, then none; and after the pick, an overflow of a long answer to a much faster
//! backend past its limit ([`Pick::past_limit`]).

use super::super::Ties;
use super::cost::{Fleet, relative_cost};
use super::score::Demand;
use super::{LoadScore, Rank, Slot};
use crate::backend::Backend;
use crate::strategies::{Candidates, Pick, RequestInfo, mix};

/// How many times faster (in relative cost) a full backend must be than the chosen one for a
/// request to wait for a slot there ([`LoadScore::overflow`]): on equal replicas the
/// costs differ by noise, never by this much.
const OVERFLOW_SPEEDUP: f64 = 1.5;
/// How many times the typical request's output a request must ask for to overflow: a short
/// answer runs soon enough anywhere.
const OVERFLOW_LENGTH: f64 = 1.2;
/// The share of the prompt a full backend must hold beyond the chosen one's for the request to
/// wait for a slot there ([`LoadScore::affinity`]).
const AFFINITY_SHARE: f64 = 0.3;
/// How far past its limit a backend takes requests for the prefix it holds: this multiple of
/// the limit, plus one.
const AFFINITY_ROOM: f64 = 1.5;
/// The share of the prompt the chosen backend's held part must cover for the prompt's home to
/// decide between the backends holding as much ([`LoadScore::home`]): a part that every
/// tenant's prompt starts with (a preamble) is no tenant's, and a home for it would draw every
/// tenant's first request to one replica.
const HOME_SHARE: f64 = 0.5;

impl LoadScore {
    /// The pick for `request` among `candidates` (ties broken by `ties`).
    pub(crate) fn pick(
        &self,
        request: &RequestInfo,
        candidates: Candidates<'_>,
        ties: &Ties,
    ) -> Option<Pick> {
        let state = self.state();
        // A copy the loop can keep in registers.
        let fleet = state.fleet;
        let generation = state.generation;
        let demand = Demand::of(self, request, candidates, generation, &fleet);
        let pick = |demand: &Demand<'_>| {
            let found = ties.best(candidates, |backend| {
                self.score(backend, generation, &fleet, demand)
            })?;
            // A backend in a run of failures (its last answer an error, as the core's
            // outlier ejection counts them) is chosen only when no healthy one has
            // room under its limit, held ceilings waived.
            let failing = |index| {
                candidates
                    .get(index)
                    .is_some_and(|backend| backend.failures_in_a_row() > 0)
            };
            if !failing(found) {
                return Some(found);
            }
            let past = demand.past_ceilings();
            ties.best(candidates, |backend| {
                self.score(backend, generation, &fleet, &past)
            })
            .or(Some(found))
        };
        // The guards choose among the backends with room; they never hold a request
        // back while one has room (the others may be full up to their limits). Then
        // the count guard alone (capacity first), then none.
        let found = match pick(&demand) {
            Some(found) => self.home(found, candidates, generation, &fleet, &demand),
            None if demand.is_guarded() => [demand.counted(), demand.unguarded()]
                .iter()
                .find_map(pick)?,
            None => return None,
        };
        // A much faster backend past its limit may still finish it sooner; a full one holding
        // much more of its prompt may start it sooner.
        let chosen = candidates.get(found)?;
        let overflow = self
            .overflow(chosen, candidates, generation, &fleet, &demand)
            .or_else(|| self.affinity(chosen, candidates, generation, &fleet, &demand));
        Some(overflow.unwrap_or(Pick::at(found)))
    }

    /// Between `found` and the other backends within every guard that hold as much of the
    /// prompt (at least [`HOME_SHARE`] of it), the prompt's home: the one whose hash with that
    /// held part ranks first (rendezvous hashing, Thaler and Ravishankar 1998). Scored by load,
    /// the new users of a tenant whose system prompt two replicas hold (a spill once put it on
    /// the second) would split between them for good, and both caches would keep the prompt;
    /// sent to its home, they leave the other copy to age out, and that cache to hold other
    /// prompts. A backend holding more of the prompt than `found` keeps the score's choice
    /// (the score weighed what it holds against its load), and the guards bound how much the
    /// home takes above its share. Never a backend in a run of failures.
    pub(super) fn home(
        &self,
        found: usize,
        candidates: Candidates<'_>,
        generation: u64,
        fleet: &Fleet,
        demand: &Demand<'_>,
    ) -> usize {
        let healthy = |backend: &Backend| backend.failures_in_a_row() == 0;
        let (Some(prompt), Some(chosen)) = (demand.prompt, candidates.get(found)) else {
            return found;
        };
        if !demand.is_guarded() || !healthy(chosen) {
            return found;
        }
        let held = |backend: &Backend| {
            self.scored(backend, generation, fleet, demand)
                .map(|(_, held)| held)
        };
        let Some(top) = held(chosen).filter(|&top| top > 0) else {
            return found;
        };
        if (top as f64) < HOME_SHARE * prompt.blocks.len() as f64 {
            return found;
        }
        // The held part's last block hash names the whole part (each block's hash covers
        // those before it).
        let part = prompt.blocks[top.min(prompt.blocks.len()) - 1];
        let rank = |backend: &Backend| mix(part ^ mix(backend.id()));
        let mut home = (rank(chosen), found);
        for (index, backend) in candidates.iter() {
            if index == found || !healthy(backend) {
                continue;
            }
            match held(backend) {
                Some(other) if other > top => return found,
                Some(other) if other == top && rank(backend) > home.0 => {
                    home = (rank(backend), index);
                }
                _ => {}
            }
        }
        home.1
    }

    /// A backend past its limit holding at least [`AFFINITY_SHARE`] of the prompt more than
    /// `chosen` (which has room), where the prefill this saves is longer than the wait for a
    /// slot: a tenant's requests stay where its prompt is cached rather than spread to replicas
    /// that must prefill it and then draw more of them. The wait is the requests ahead of it past
    /// the limit, each a slot's share of the backend's typical request; at most
    /// [`AFFINITY_ROOM`] × the limit plus one are held. Never a backend in a run of failures,
    /// without ramp-up room or with an engine-stated capacity. Returns the backend past its limit
    /// ([`Pick::past_limit`]): its late first byte does not lower the limit.
    fn affinity(
        &self,
        chosen: &Backend,
        candidates: Candidates<'_>,
        generation: u64,
        fleet: &Fleet,
        demand: &Demand<'_>,
    ) -> Option<Pick> {
        if demand.prompt_tokens == 0 {
            return None;
        }
        let matched = |backend: &Backend| demand.matched_tokens(backend);
        let chosen_matched = matched(chosen);
        let least = AFFINITY_SHARE * demand.prompt_tokens as f64;
        let mut best: Option<(f64, usize)> = None;
        for (index, backend) in candidates.iter() {
            let Some(rank) = backend.strategy_slot::<Slot>().rank(generation) else {
                continue;
            };
            let in_flight = backend.in_flight();
            let ahead = in_flight as f64 + 1.0 - rank.limit.floor().max(1.0);
            if ahead <= 0.0
                || in_flight as f64 + 1.0 > AFFINITY_ROOM * rank.limit + 1.0
                || backend.failures_in_a_row() > 0
                || !self.ramp_room(backend, in_flight)
                || demand
                    .now
                    .is_some_and(|now| backend.engine().max_concurrent(now).is_some())
            {
                continue;
            }
            let extra = matched(backend).saturating_sub(chosen_matched) as f64;
            if extra < least {
                continue;
            }
            let saved = extra * rank.prefill_rate;
            let slot = relative_cost(fleet, Some(rank)) * demand.unit;
            let gain = saved - ahead * slot;
            if gain > 0.0 && best.is_none_or(|(most, _)| gain > most) {
                best = Some((gain, index));
            }
        }
        best.map(|(_, index)| Pick {
            index,
            past_limit: true,
        })
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
    fn overflow(
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
            let matched = demand.matched_tokens(backend);
            let uncached = demand.prompt_tokens.saturating_sub(matched);
            // On a full backend, the work it holds shares its slots with this request.
            let ahead = if full {
                backend.work_in_flight() as f64 / rank.limit.floor().max(1.0)
            } else {
                0.0
            };
            relative * demand.token_seconds * (demand.output + ahead)
                + (demand.queued_prefill(backend, Some(rank)) + uncached) as f64 * rank.prefill_rate
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
            if !self.ramp_room(backend, in_flight) {
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
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::testing::*;
    use crate::backend::Backend;
    use crate::strategies::{FirstByte, Outcome, Pick, RequestInfo, Strategy};

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
        strategy.on_outcome(&broken, &error);
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
        strategy.on_first_byte(&set[0], &expected);
        assert_eq!(strategy.limit(&set[0]), limit);
        // The same count and wait of a request its pick did not send past the limit lowers it,
        // whatever else was sent past the limit before.
        strategy.on_first_byte(&set[0], &sent_with(over, 0.5));
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

    /// The three replicas of the home tests, the prompt of `tenant` (about 4,000 tokens), and
    /// `holding` of its blocks recorded on the first two.
    fn held_on_two(
        ids: [u32; 3],
        tenant: usize,
        holding: impl Fn(usize) -> usize,
    ) -> (QueuedLeastLatency, Vec<Arc<Backend>>, RequestInfo) {
        let set: Vec<_> = ids.into_iter().map(backend).collect();
        let strategy = with_room(&set);
        let system = format!("You are the assistant of tenant {tenant}. ").repeat(400);
        let request = chat(&system, "hello");
        let blocks = &request.prompt.as_ref().unwrap().blocks;
        for holder in &set[..2] {
            holder.prefixes().record(&blocks[..holding(blocks.len())]);
        }
        (strategy, set, request)
    }

    #[test]
    fn a_prompt_two_replicas_hold_goes_to_its_home_whichever_is_less_loaded() {
        let mut homes = [0usize; 2];
        for tenant in 0..24 {
            let (strategy, set, request) = held_on_two([60, 61, 62], tenant, |all| all);
            // One request more on either holder: the pick stays on the same one, never on
            // the third replica, which would prefill the prompt.
            busy(&set[0], 1);
            let first = strategy.pick(&request, (&set).into()).unwrap().index;
            set[0].release();
            busy(&set[1], 1);
            let second = strategy.pick(&request, (&set).into()).unwrap().index;
            assert_eq!(first, second, "tenant {tenant}");
            assert!(first < 2, "tenant {tenant}: {first}");
            homes[first] += 1;
        }
        // Each prompt has its own home: the tenants spread over both holders.
        assert!(homes[0] > 0 && homes[1] > 0, "{homes:?}");
    }

    #[test]
    fn the_home_takes_no_more_than_the_guards_allow() {
        let (strategy, set, request) = held_on_two([63, 64, 65], 3, |all| all);
        let home = strategy.pick(&request, (&set).into()).unwrap().index;
        let other = 1 - home;
        // Past the count guard (its share of 11 in flight plus three), the home's tenant goes
        // to the other replica holding its prompt.
        busy(&set[home], 10);
        assert_eq!(
            strategy.pick(&request, (&set).into()),
            Some(Pick::at(other))
        );
        // And a home in a run of failures is passed over.
        for _ in 0..10 {
            set[home].release();
        }
        set[home].record_failure_in_a_row();
        busy(&set[other], 1);
        assert_eq!(
            strategy.pick(&request, (&set).into()),
            Some(Pick::at(other))
        );
    }

    #[test]
    fn a_part_under_half_the_prompt_has_no_home() {
        // A preamble every tenant's prompt starts with, held on two replicas: the load
        // decides between them, so tenants whose prompts no replica holds yet do not all go
        // to one.
        let (strategy, set, request) = held_on_two([66, 67, 68], 5, |all| all / 3);
        busy(&set[2], 1);
        busy(&set[0], 1);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(1)));
        set[0].release();
        busy(&set[1], 1);
        assert_eq!(strategy.pick(&request, (&set).into()), Some(Pick::at(0)));
    }
}
