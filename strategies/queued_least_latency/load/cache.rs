//! A backend's prefix cache, as learned: the router's prefix index of the backend sized like
//! what the engine keeps.
//!
//! The index records what the router sent to a backend and predicts, for a new prompt, how much
//! of it the backend holds. Its configured capacity (`prefix_index.capacity_tokens`) is a bound,
//! not a guess of the engine's cache: an engine whose answers report `usage` with
//! `prompt_tokens_details.cached_tokens` tells, answer by answer, how much it found, and the
//! index's limit follows:
//!
//! - **a prediction it did not find** (the index expected at least a fifth of the prompt, the
//!   engine found less than half of that): the index remembers more than the engine keeps, and
//!   its limit is lowered by [`SHRINK`];
//! - **more found than predicted** (by a fifth of the prompt or more): the index forgot what the
//!   engine keeps, and its limit is raised by [`GROW`], up to the configured capacity;
//! - anything else confirms the index as it is.
//!
//! Shares of the prompt are compared, the router's estimate of the prompt's tokens on one side
//! and the engine's count on the other, so that the two ways of counting tokens need not agree.
//! An answer without `cached_tokens` teaches nothing here: the index keeps its limit, the
//! configured capacity unless something taught otherwise.

use crate::backend::Backend;
use crate::prompt::Prompt;
use crate::strategies::Outcome;

/// A prediction this large a share of the prompt is judged against what the engine found.
const JUDGED_SHARE: f64 = 0.2;
/// The limit's factor after a prediction the engine did not find.
const SHRINK: f64 = 0.9;
/// The limit's factor after the engine found more than predicted.
const GROW: f64 = 1.25;
/// The fewest tokens the index is lowered to: a few prompts.
const MIN_TOKENS: u64 = 8_192;

/// Sizes `backend`'s prefix index by what its answer says the engine found cached.
pub(super) fn learn_cache(backend: &Backend, outcome: &Outcome) {
    let Some(usage) = outcome.usage else { return };
    let Some(found) = usage.cached_tokens else {
        return;
    };
    if outcome.failed || outcome.prompt_tokens == 0 || usage.prompt_tokens == 0 {
        return;
    }
    let expected = outcome.expected_cached as f64 / outcome.prompt_tokens as f64;
    let found = found as f64 / usage.prompt_tokens as f64;
    let index = backend.prefixes();
    let limit = index.limit_blocks() as f64;
    let factor = if expected >= JUDGED_SHARE && found < 0.5 * expected {
        SHRINK
    } else if found >= expected + JUDGED_SHARE {
        GROW
    } else {
        return;
    };
    let floor = MIN_TOKENS.div_ceil(Prompt::blocks_tokens(1)) as f64;
    index.set_limit_blocks((limit * factor).max(floor).ceil() as usize);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategies::Usage;

    fn answer(prompt: u64, expected: u64, found: Option<u64>) -> Outcome {
        Outcome {
            latency: 1.0,
            failed: false,
            first_byte: Some(0.1),
            bytes: 100,
            streamed: true,
            usage: Some(Usage {
                prompt_tokens: prompt,
                completion_tokens: 10,
                cached_tokens: found,
            }),
            in_flight: 1,
            prompt_tokens: prompt,
            expected_cached: expected,
        }
    }

    #[test]
    fn the_index_shrinks_to_what_the_engine_keeps_and_grows_when_it_keeps_more() {
        let backend = Backend::new("10.0.9.1:80".parse().unwrap());
        let index = backend.prefixes();
        let full = index.limit_blocks();
        // Predicted 3,000 of 4,000 tokens cached; the engine found 100: lowered by a tenth.
        learn_cache(&backend, &answer(4_000, 3_000, Some(100)));
        assert_eq!(index.limit_blocks(), (full as f64 * SHRINK).ceil() as usize);
        // Predicted and found alike, or a small prediction: nothing changes.
        let before = index.limit_blocks();
        learn_cache(&backend, &answer(4_000, 3_000, Some(2_900)));
        learn_cache(&backend, &answer(4_000, 400, Some(0)));
        learn_cache(&backend, &answer(4_000, 3_000, None));
        assert_eq!(index.limit_blocks(), before);
        // Many misses: down to the floor, never below.
        for _ in 0..200 {
            learn_cache(&backend, &answer(4_000, 3_000, Some(0)));
        }
        let floor = (MIN_TOKENS / Prompt::blocks_tokens(1)) as usize;
        assert_eq!(index.limit_blocks(), floor);
        // The engine found what the index had forgotten: raised, up to the configured capacity.
        learn_cache(&backend, &answer(4_000, 0, Some(3_000)));
        assert_eq!(index.limit_blocks(), (floor as f64 * GROW).ceil() as usize);
        for _ in 0..100 {
            learn_cache(&backend, &answer(4_000, 0, Some(3_000)));
        }
        assert_eq!(index.limit_blocks(), full);
    }
}
