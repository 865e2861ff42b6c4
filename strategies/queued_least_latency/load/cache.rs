//! A backend's prefix cache, as learned: how long the engine keeps a prompt's blocks, read off
//! what it found of the prompts the router's index expected it to hold.
//!
//! The index records what the router sent to a backend and predicts, for a new prompt, how much
//! of it the backend holds. Its configured capacity (`prefix_index.capacity_tokens`) is a bound,
//! not a guess of the engine's cache. What sizes it like the engine is its *reach*: a block
//! counts as held while fewer new blocks than the reach were recorded since its last use (its
//! age). Each judged answer moves the reach half-way (on a log scale) toward the age it proved:
//!
//! - **a prediction the engine did not find** (the index expected at least a fifth of the
//!   prompt, the engine found less than half of that): the engine no longer kept blocks of the
//!   deepest held one's age, and a longer reach moves toward that age;
//! - **stale blocks found** (the index had a fifth of the prompt or more recorded past its
//!   reach, and the engine found at least half of it beyond the prediction): the engine kept
//!   blocks that old, and a shorter reach moves toward their age;
//! - anything else confirms the reach as it is.
//!
//! The reach starts short, at a few prompts ([`start_reach`]), and is lengthened by what the
//! engine proves it kept: a reach too long predicts prompts the engine no longer holds, and
//! requests follow those predictions onto one replica, where queueing hides the misses that
//! would correct it; a reach too short only costs locality until stale blocks are found.
//! Half-way steps make a reach that was far off (a few prompts against a cache of 1M tokens)
//! right within a few answers, while one misjudged answer moves it by a square root, not to
//! the age it showed.
//!
//! What the engine found is read from the answer's `usage`
//! (`prompt_tokens_details.cached_tokens`) when it says; shares of the prompt are compared, the
//! router's estimate of the prompt's tokens on one side and the engine's count on the other, so
//! that the two ways of counting tokens need not agree. A backend whose answers do not say is
//! judged by its streams' first bytes instead: the first byte of a request was expected after
//! the backend's fixed delay plus the prefill of what the index did not hold (`ttfb.rs`), and
//! each prefill second beyond that, at the backend's prefill rate, is prompt the engine did not
//! hold (each second before it, prompt it held beyond the prediction). Queueing inside the
//! replica only ever delays a first byte: an early one proves stale blocks held whatever the
//! load, a late one proves a miss only for a request sent to a backend using at most half of
//! its limit ([`learn_cache_from_first_byte`]). Once a backend's answers have reported
//! `cached_tokens`, they alone judge it.
//!
//! A single age cannot say everything: an engine keeps its blocks by its own policy, and
//! first bytes judged one by one read the delays of a busy engine as misses, so the reach can
//! stay short while the engine still holds much of what lies past it. What lies past it is
//! therefore not taken as gone: the same judgments add up, answer by answer, the share of
//! these *stale* parts the engine found ([`StaleKept`]), and the score counts a stale part's
//! prefill at the share not kept. Added up over many answers, the delays that sink one
//! judgment average out; where the engine really evicted the stale blocks, the share falls
//! toward nothing and the score takes them as uncached.

use std::sync::Mutex;
use std::sync::atomic::Ordering;

use super::{Slot, lock};
use crate::backend::Backend;
use crate::prompt::Prompt;
use crate::strategies::{FirstByte, Outcome, Recall};

/// A prediction (or stale part) this large a share of the prompt is judged against what the
/// engine found.
const JUDGED_SHARE: f64 = 0.2;
/// How far the reach moves toward an age judged, as a power: 0.5 is the geometric mean.
const STEP: f64 = 0.5;
/// The shortest reach, and the first: a few prompts.
const MIN_REACH_TOKENS: u64 = 8_192;

/// The share of a stale part taken to be kept before a backend's answers have judged any: as
/// likely kept as not.
const PRIOR_STALE_KEPT: f64 = 0.5;
/// The prior's weight, in stale tokens judged: a short prompt's worth, which a few answers
/// outweigh.
const PRIOR_STALE_TOKENS: f64 = 1_024.0;
/// How much of the sums each judged stale part replaces: about the last twenty count.
const STALE_KEPT_WEIGHT: f64 = 0.05;

/// What a backend's engine was found to keep of stale parts (blocks the index recorded past
/// its reach, [`Recall::stale`]), in tokens: moving sums of the stale tokens judged and of those
/// found, recent answers weighing most. Their ratio is the index's
/// [`stale_kept`](crate::prefix_index::PrefixIndex::stale_kept), which the score reads.
#[derive(Debug)]
pub(super) struct StaleKept {
    sums: Mutex<StaleSums>,
}

#[derive(Debug)]
struct StaleSums {
    /// Stale tokens found (moving sum).
    kept: f64,
    /// Stale tokens judged (moving sum).
    judged: f64,
    /// How late, in seconds, first bytes with nothing past the reach usually come against
    /// what was expected (a moving mean): the wait for an engine's step or queue that every
    /// first byte has, taken out of a stale part's judgment.
    usual_late: Option<f64>,
}

impl Default for StaleKept {
    fn default() -> Self {
        Self {
            sums: Mutex::new(StaleSums {
                kept: PRIOR_STALE_KEPT * PRIOR_STALE_TOKENS,
                judged: PRIOR_STALE_TOKENS,
                usual_late: None,
            }),
        }
    }
}

impl StaleKept {
    /// The share kept.
    fn share(&self) -> f64 {
        let sums = lock(&self.sums);
        sums.kept / sums.judged
    }

    /// Folds in a stale part of `stale` tokens of which the engine found `found`; returns the
    /// share kept.
    fn fold(&self, found: f64, stale: f64) -> f64 {
        let mut sums = lock(&self.sums);
        sums.kept += STALE_KEPT_WEIGHT * (found.clamp(0.0, stale) - sums.kept);
        sums.judged += STALE_KEPT_WEIGHT * (stale - sums.judged);
        sums.kept / sums.judged
    }

    /// Folds in a first byte `late` seconds after the expected time, its prompt having nothing
    /// past the reach.
    fn late(&self, late: f64) {
        let mut sums = lock(&self.sums);
        sums.usual_late = Some(
            sums.usual_late
                .map_or(late, |usual| usual + STALE_KEPT_WEIGHT * (late - usual)),
        );
    }

    /// How late first bytes with nothing past the reach usually come (0 before one came).
    fn usual_late(&self) -> f64 {
        lock(&self.sums).usual_late.unwrap_or(0.0)
    }
}

/// Sets `backend`'s index reach to its start, the shortest: a backend the strategy has not
/// learned yet is trusted to keep a few prompts, until its answers show more; and what lies
/// past the reach to be kept at the share learned so far ([`StaleKept`]; before any answer,
/// as likely kept as not).
pub(super) fn start_reach(backend: &Backend) {
    let index = backend.prefixes();
    index.set_reach_blocks(floor_blocks());
    index.set_stale_kept(backend.strategy_slot::<Slot>().stale_kept.share());
}

/// [`MIN_REACH_TOKENS`] in blocks.
fn floor_blocks() -> u64 {
    MIN_REACH_TOKENS.div_ceil(Prompt::blocks_tokens(1))
}

/// Judges `backend`'s prefix index by what its answer says the engine found cached.
pub(super) fn learn_cache(backend: &Backend, outcome: &Outcome) {
    let Some(usage) = outcome.usage else { return };
    let Some(found) = usage.cached_tokens else {
        return;
    };
    if outcome.failed || outcome.prompt_tokens == 0 || usage.prompt_tokens == 0 {
        return;
    }
    backend
        .strategy_slot::<Slot>()
        .reports_cached
        .store(true, Ordering::Relaxed);
    let found = found as f64 / usage.prompt_tokens as f64;
    learn_stale_kept(backend, outcome.prompt_tokens, outcome.recall, found);
    judge(backend, outcome.prompt_tokens, outcome.recall, found, true);
}

/// Judges `backend`'s prefix index by a stream's first byte, when its answers do not say what
/// the engine found: it came after `first_byte.seconds` where `expected` seconds were expected
/// with the index's prediction, the backend prefilling `rate` seconds a token. A first byte of
/// a request sent to a `congested` backend may have waited inside the replica: it proves
/// stale blocks held (it came early enough despite the wait), never a miss.
pub(super) fn learn_cache_from_first_byte(
    backend: &Backend,
    first_byte: &FirstByte,
    expected: f64,
    rate: f64,
    congested: bool,
) {
    let prompt = first_byte.prompt_tokens;
    if prompt == 0 || rate <= 0.0 || !expected.is_finite() {
        return;
    }
    if backend
        .strategy_slot::<Slot>()
        .reports_cached
        .load(Ordering::Relaxed)
    {
        return;
    }
    let prompt = prompt as f64;
    let predicted = (prompt - first_byte.uncached_tokens as f64).max(0.0);
    let late = first_byte.seconds - expected;
    // The prompt tokens the engine found, had the first byte come `late` seconds after the
    // expected time.
    let found_if = |late: f64| (predicted - late / rate).clamp(0.0, prompt);
    let found = found_if(late);
    // What the engine found of a stale part is judged against how late first bytes usually
    // are: one by one, the wait for a step would read as stale parts missed.
    let stale_kept = &backend.strategy_slot::<Slot>().stale_kept;
    if !congested {
        if first_byte.recall.stale == 0 {
            stale_kept.late(late);
        } else {
            let found = found_if(late - stale_kept.usual_late());
            learn_stale_kept(
                backend,
                first_byte.prompt_tokens,
                first_byte.recall,
                found / prompt,
            );
        }
    }
    judge(
        backend,
        first_byte.prompt_tokens,
        first_byte.recall,
        found / prompt,
        !congested,
    );
}

/// Folds into `backend`'s [`StaleKept`] what the engine found (`found`, a share of the prompt of
/// `prompt_tokens`) of the stale part of a prompt whose index held `recall`: what it found
/// beyond the held part, up to the stale part.
fn learn_stale_kept(backend: &Backend, prompt_tokens: u64, recall: Recall, found: f64) {
    let tokens = |blocks: usize| Prompt::blocks_tokens(blocks).min(prompt_tokens) as f64;
    let held = tokens(recall.held);
    let stale = tokens(recall.held + recall.stale) - held;
    if stale <= 0.0 {
        return;
    }
    let found = found * prompt_tokens as f64 - held;
    let share = backend
        .strategy_slot::<Slot>()
        .stale_kept
        .fold(found, stale);
    backend.prefixes().set_stale_kept(share);
}

/// Moves `backend`'s index reach toward the age a prompt of `prompt_tokens` proved, the engine
/// having found `found` of it (a share), the index having held `recall` of it; a prediction the
/// engine did not find counts only if `misses` do.
fn judge(backend: &Backend, prompt_tokens: u64, recall: Recall, found: f64, misses: bool) {
    let share = |blocks: usize| {
        Prompt::blocks_tokens(blocks).min(prompt_tokens) as f64 / prompt_tokens as f64
    };
    let held = share(recall.held);
    let stale = share(recall.held + recall.stale) - held;
    let index = backend.prefixes();
    let reach = index.reach_blocks();
    let target = if misses && held >= JUDGED_SHARE && found < 0.5 * held {
        recall.held_age.min(reach)
    } else if stale >= JUDGED_SHARE && found >= held + 0.5 * stale {
        recall.stale_age.max(reach)
    } else {
        return;
    };
    let target = (target as f64).max(floor_blocks() as f64);
    let reach = reach as f64;
    index.set_reach_blocks((reach * (target / reach).powf(STEP)).round() as u64);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategies::Usage;

    /// Tokens in `blocks` blocks.
    fn tokens(blocks: usize) -> u64 {
        Prompt::blocks_tokens(blocks)
    }

    /// An answer to a prompt of 100 blocks, of which the index held `recall`, the engine
    /// reporting `found` blocks' worth cached (or nothing).
    fn answer(recall: Recall, found: Option<usize>) -> Outcome {
        let prompt = tokens(100);
        Outcome {
            latency: 1.0,
            failed: false,
            first_byte: Some(0.1),
            bytes: 100,
            streamed: true,
            usage: Some(Usage {
                prompt_tokens: prompt,
                completion_tokens: 10,
                cached_tokens: found.map(tokens),
            }),
            in_flight: 1,
            prompt_tokens: prompt,
            recall,
        }
    }

    fn held(blocks: usize, age: u64) -> Recall {
        Recall {
            held: blocks,
            held_age: age,
            ..Recall::default()
        }
    }

    fn stale(held: usize, blocks: usize, age: u64) -> Recall {
        Recall {
            held,
            held_age: 10,
            stale: blocks,
            stale_age: age,
        }
    }

    #[test]
    fn misses_bring_the_reach_to_the_age_the_engine_no_longer_holds_within_a_few_answers() {
        let backend = Backend::new("10.0.9.1:80".parse().unwrap());
        let index = backend.prefixes();
        let full = index.reach_blocks();
        // Predicted 75 of 100 blocks, 400 blocks old; the engine found 2: half-way (on a log
        // scale) toward 400.
        learn_cache(&backend, &answer(held(75, 400), Some(2)));
        let once = index.reach_blocks();
        assert_eq!(once, ((full * 400) as f64).sqrt().round() as u64);
        // Found as predicted, a small prediction, no count: nothing changes.
        learn_cache(&backend, &answer(held(75, 400), Some(70)));
        learn_cache(&backend, &answer(held(10, 400), Some(0)));
        learn_cache(&backend, &answer(held(75, 400), None));
        assert_eq!(index.reach_blocks(), once);
        // A few more misses and the reach is at the age the engine no longer holds.
        for _ in 0..8 {
            learn_cache(&backend, &answer(held(75, 400), Some(0)));
        }
        assert!(
            index.reach_blocks().abs_diff(400) <= 4,
            "{}",
            index.reach_blocks()
        );
        // Never below a few prompts.
        for _ in 0..50 {
            learn_cache(&backend, &answer(held(75, 0), Some(0)));
        }
        let floor = MIN_REACH_TOKENS.div_ceil(tokens(1));
        assert!(index.reach_blocks().abs_diff(floor) <= 1);
        // The engine found stale blocks 1,000 old: the reach moves toward their age, and ends
        // there, bounded by the capacity.
        learn_cache(&backend, &answer(stale(10, 60, 1_000), Some(65)));
        let raised = index.reach_blocks();
        assert_eq!(raised, ((floor * 1_000) as f64).sqrt().round() as u64);
        for _ in 0..20 {
            learn_cache(&backend, &answer(stale(10, 60, 1_000), Some(70)));
        }
        assert!(index.reach_blocks().abs_diff(1_000) <= 2);
        for _ in 0..40 {
            learn_cache(&backend, &answer(stale(10, 60, u64::MAX / 2), Some(70)));
        }
        assert_eq!(index.reach_blocks(), full);
        // A stale part the engine did not find says nothing.
        learn_cache(&backend, &answer(stale(10, 60, 10), Some(12)));
        assert_eq!(index.reach_blocks(), full);
    }

    /// A first byte of a prompt of 100 blocks of which the index held 75 (400 blocks old),
    /// `late` prefill tokens' worth of seconds after the expected time, its request sent to a
    /// `congested` backend or not.
    fn judged_first_byte(backend: &Backend, late: f64, congested: bool) {
        let rate = 1e-4;
        let expected = 0.02 + tokens(25) as f64 * rate;
        let first_byte = super::super::testing::first_byte(expected + late * rate, tokens(25), 0);
        let first_byte = FirstByte {
            prompt_tokens: tokens(100),
            recall: held(75, 400),
            ..first_byte
        };
        learn_cache_from_first_byte(backend, &first_byte, expected, rate, congested);
    }

    #[test]
    fn without_usage_first_bytes_judge_the_cache_by_the_prefill_they_took() {
        let backend = Backend::new("10.0.9.2:80".parse().unwrap());
        let index = backend.prefixes();
        let full = index.reach_blocks();
        // On time, or late by less than half the prediction: the engine held it.
        judged_first_byte(&backend, 0.0, false);
        judged_first_byte(&backend, tokens(30) as f64, false);
        assert_eq!(index.reach_blocks(), full);
        // The whole predicted prefix prefilled, on a congested backend: the request may have
        // waited for a slot, no proof of a miss.
        judged_first_byte(&backend, tokens(75) as f64, true);
        assert_eq!(index.reach_blocks(), full);
        // The same on a backend with room: the engine did not hold blocks that old.
        judged_first_byte(&backend, tokens(75) as f64, false);
        assert!(index.reach_blocks() < full);
        // Once its answers report what the engine found, they alone judge.
        let before = index.reach_blocks();
        learn_cache(&backend, &answer(held(75, 400), Some(74)));
        judged_first_byte(&backend, tokens(75) as f64, false);
        assert_eq!(index.reach_blocks(), before);
    }

    #[test]
    fn answers_teach_the_share_of_stale_parts_the_engine_keeps() {
        let backend = Backend::new("10.0.9.3:80".parse().unwrap());
        let kept = || backend.prefixes().stale_kept();
        start_reach(&backend);
        assert_eq!(kept(), PRIOR_STALE_KEPT);
        // Answers to prompts with no stale part say nothing of it.
        for found in [Some(0), Some(75), None] {
            learn_cache(&backend, &answer(held(75, 400), found));
        }
        assert_eq!(kept(), PRIOR_STALE_KEPT);
        // 60 blocks past the reach: the engine found them every time, then never, then 20 of
        // them every time. The share follows within tens of answers.
        let share_after = |found: usize| {
            for _ in 0..60 {
                learn_cache(&backend, &answer(stale(10, 60, 1_000), Some(found)));
            }
            kept()
        };
        assert!(share_after(70) > 0.95, "{}", kept());
        assert!(share_after(10) < 0.1, "{}", kept());
        assert!((share_after(30) - 1.0 / 3.0).abs() < 0.03, "{}", kept());
        // Without usage, first bytes teach it (a backend whose answers never reported
        // `cached_tokens`): one as early as the whole stale part held raises it, unless its
        // request went to a congested backend; one as late as the stale part prefilled lowers
        // it, on a backend with room.
        let backend = Backend::new("10.0.9.4:80".parse().unwrap());
        let kept = || backend.prefixes().stale_kept();
        start_reach(&backend);
        let rate = 1e-4;
        let expected = 0.02 + tokens(90) as f64 * rate;
        // A first byte of a prompt of 100 blocks of which 10 are held and `stale` more are
        // recorded past the reach, the engine having found `found`, `wait` seconds later than
        // its prefill (a wait for a step).
        let first_byte_found = |congested: bool, stale: usize, found: usize, wait: f64| {
            let before = kept();
            let seconds =
                expected + wait - found.saturating_sub(10) as f64 * tokens(1) as f64 * rate;
            let first_byte = FirstByte {
                prompt_tokens: tokens(100),
                recall: Recall {
                    stale,
                    stale_age: if stale > 0 { 1_000 } else { 0 },
                    ..held(10, 20)
                },
                ..super::super::testing::first_byte(seconds, tokens(90), 0)
            };
            learn_cache_from_first_byte(&backend, &first_byte, expected, rate, congested);
            kept() - before
        };
        assert!(first_byte_found(false, 60, 70, 0.0) > 0.0);
        assert_eq!(first_byte_found(true, 60, 10, 0.0), 0.0);
        assert!(first_byte_found(false, 60, 10, 0.0) < 0.0);
        // First bytes usually come a step late here (0.5 s, the prefill of 5,000 tokens, more
        // than the stale part's 3,840): one of a stale part the engine found, that late, counts
        // as found, not missed.
        for _ in 0..60 {
            assert_eq!(first_byte_found(false, 0, 10, 0.5), 0.0);
        }
        assert!(first_byte_found(false, 60, 70, 0.5) > 0.0);
        assert!(first_byte_found(false, 60, 10, 0.5) < 0.0);
    }

    #[test]
    fn the_reach_starts_short_and_an_early_first_byte_lengthens_it_even_under_load() {
        use super::super::testing::*;
        use crate::strategies::Strategy;

        let strategy = QueuedLeastLatency::load(3.0);
        let replica = backend(9);
        let index = replica.prefixes();
        assert_eq!(index.reach_blocks(), index.capacity_blocks() as u64);
        // The strategy's first look at the backend (a first byte with no prefill: its fixed
        // delay, 50 ms) starts the reach at a few prompts.
        strategy.on_first_byte(&replica, &first_byte_on(&replica, 0.05, 0, 0));
        let start = index.reach_blocks();
        assert_eq!(start, floor_blocks());
        let rate = strategy.prefill_rate(&replica);
        // A prompt of 100 blocks the index had recorded 1,000 blocks ago, past its reach, so
        // counted as uncached: its first byte comes after the fixed delay alone, on a backend
        // using all of its limit. The engine held it: the reach moves toward that age, and the
        // prefill rate does not take the short first byte for a fast prefill.
        busy(&replica, strategy.limit(&replica) as usize);
        let early = FirstByte {
            prompt_tokens: tokens(100),
            recall: stale(0, 100, 1_000),
            ..first_byte_on(&replica, 0.06, tokens(100), 0)
        };
        strategy.on_first_byte(&replica, &early);
        assert_eq!(
            index.reach_blocks(),
            ((start * 1_000) as f64).sqrt().round() as u64
        );
        assert_eq!(strategy.prefill_rate(&replica), rate);
    }
}
