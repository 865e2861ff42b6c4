//! LLM workloads for the users load of `load.rs`: every user's requests drawn up front from a
//! seed (prompts, answer lengths, think times), so every peer receives the same requests.
//!
//! - [`Chat`]: tenants and their users. Every tenant has a long system prompt that starts with a
//!   preamble shared by all tenants; each user holds a multi-turn conversation whose every turn
//!   resends the whole history (system prompt, earlier questions and answers) plus a new
//!   question, as chat clients do. Optionally each request names its conversation in
//!   [`SESSION_HEADER`].
//! - [`Documents`]: single requests arriving as a Poisson process, short chats mixed with long
//!   documents (prompt lengths log-uniform up to tens of thousands of tokens).
//! - [`Trace`]: a production trace replayed (`trace.rs`).
//!
//! Requests are OpenAI chat completions (`POST /v1/chat/completions`, `messages`, `max_tokens`,
//! streamed or not; `requests.rs`). Text is pseudo-random lowercase words, four characters a
//! token as the simulated replica counts them; an earlier answer is sent back as the text the
//! replica generated, so its blocks are the ones the replica cached.

use std::time::Duration;

use serde_json::json;

use super::load::{Lengths, Turn, User};
pub use super::requests::{SESSION_HEADER, Scale, chat_request, text};
use super::sim::prompt::answer_text;
use super::trace::Trace;

/// What the users send.
#[derive(Debug, Clone)]
pub enum Workload {
    /// Multi-turn conversations of tenants' users.
    Chat(Chat),
    /// Single requests, short chats and long documents.
    Documents(Documents),
    /// A production trace replayed (see `trace.rs`).
    Trace(Trace),
}

/// Tenants' users in multi-turn conversations.
#[derive(Debug, Clone)]
pub struct Chat {
    /// Tenants.
    pub tenants: usize,
    /// Users per tenant.
    pub users_per_tenant: usize,
    /// Tokens of the preamble every tenant's system prompt starts with.
    pub shared_preamble_tokens: u32,
    /// Tokens of each tenant's own part of its system prompt (uniform in the range).
    pub tenant_prompt_tokens: (u32, u32),
    /// Turns per user (uniform in the range).
    pub turns: (u32, u32),
    /// Tokens of each question.
    pub question_tokens: Lengths,
    /// Tokens of each answer (`max_tokens`).
    pub answer_tokens: Lengths,
    /// Seconds between an answer and the next question (uniform in the range).
    pub think_seconds: (f64, f64),
    /// Users start at uniformly random offsets within this many seconds.
    pub start_within: f64,
    /// Whether requests carry [`SESSION_HEADER`] (`t<tenant>-u<user>`).
    pub session_header: bool,
    /// Whether requests ask for a stream.
    pub stream: bool,
}

/// Single requests: short chats and long documents.
#[derive(Debug, Clone)]
pub struct Documents {
    /// Requests per second (Poisson arrivals).
    pub rate: f64,
    /// Seconds of arrivals.
    pub duration: f64,
    /// Fraction of requests that carry a long document.
    pub long_fraction: f64,
    /// Prompt tokens of a long document (log-uniform in the range).
    pub long_prompt_tokens: (u32, u32),
    /// Prompt tokens of a short chat (uniform in the range).
    pub short_prompt_tokens: (u32, u32),
    /// Tokens of each answer.
    pub answer_tokens: Lengths,
    /// Whether requests ask for a stream.
    pub stream: bool,
}

impl Workload {
    /// Every user and its turns, from `seed`.
    pub fn users(&self, seed: u64, scale: Scale) -> Vec<User> {
        let mut rng = fastrand::Rng::with_seed(seed);
        match self {
            Workload::Chat(chat) => chat.users(&mut rng, scale),
            Workload::Documents(documents) => documents.users(&mut rng, scale),
            Workload::Trace(trace) => trace.users(seed, scale),
        }
    }

    /// One line describing the users and what they send.
    pub fn describe(&self, scale: Scale) -> String {
        match self {
            Workload::Chat(chat) => chat.describe(scale),
            Workload::Documents(documents) => documents.describe(scale),
            Workload::Trace(trace) => trace.describe(scale),
        }
    }
}

impl Chat {
    fn users_per_tenant(&self, scale: Scale) -> usize {
        ((self.users_per_tenant as f64 * scale.users).round() as usize).max(1)
    }

    fn users(&self, rng: &mut fastrand::Rng, scale: Scale) -> Vec<User> {
        // The preamble is the same text in every run, as a platform's would be.
        let preamble = text(
            &mut fastrand::Rng::with_seed(0x9e3e),
            self.shared_preamble_tokens,
        );
        let mut users = Vec::new();
        for tenant in 0..self.tenants {
            let (low, high) = self.tenant_prompt_tokens;
            let tenant_tokens = rng.u32(low..=high.max(low));
            let system = format!("{preamble}\n{}", text(rng, tenant_tokens));
            for user in 0..self.users_per_tenant(scale) {
                let session = format!("t{tenant}-u{user}");
                users.push(self.user(rng, scale, &system, &session));
            }
        }
        users
    }

    fn user(&self, rng: &mut fastrand::Rng, scale: Scale, system: &str, session: &str) -> User {
        let start = rng.f64() * self.start_within / scale.time_compression;
        let mut messages = vec![json!({"role": "system", "content": system})];
        let turn_count = rng.u32(self.turns.0..=self.turns.1.max(self.turns.0));
        let mut turns = Vec::new();
        for _ in 0..turn_count {
            let question_tokens = self.question_tokens.sample(rng);
            messages.push(json!({"role": "user", "content": text(rng, question_tokens)}));
            let max_tokens = self.answer_tokens.sample(rng);
            let (low, high) = self.think_seconds;
            let think = (low + rng.f64() * (high - low).max(0.0)) / scale.time_compression;
            let session = self.session_header.then_some(session);
            turns.push(Turn {
                think: Duration::from_secs_f64(think),
                request: chat_request(&messages, max_tokens, session, self.stream),
            });
            messages.push(json!({"role": "assistant", "content": answer_text(max_tokens)}));
        }
        User {
            start: Duration::from_secs_f64(start),
            turns,
        }
    }

    fn describe(&self, scale: Scale) -> String {
        let (low, high) = self.tenant_prompt_tokens;
        format!(
            "{} tenants × {} users, {} turns each, users starting within {:.1} s; system prompts of a {}-token shared preamble plus {low}–{high} tenant tokens; questions {}, answers {}; think {:.1}–{:.1} s{}",
            self.tenants,
            self.users_per_tenant(scale),
            range_text(self.turns),
            self.start_within / scale.time_compression,
            self.shared_preamble_tokens,
            self.question_tokens.describe(),
            self.answer_tokens.describe(),
            self.think_seconds.0 / scale.time_compression,
            self.think_seconds.1 / scale.time_compression,
            if self.session_header {
                format!("; `{SESSION_HEADER}` on every request")
            } else {
                "; no session header".to_owned()
            },
        )
    }
}

impl Documents {
    fn rate(&self, scale: Scale) -> f64 {
        self.rate * scale.users * scale.time_compression
    }

    fn users(&self, rng: &mut fastrand::Rng, scale: Scale) -> Vec<User> {
        let rate = self.rate(scale);
        let end = self.duration / scale.time_compression;
        let mut users = Vec::new();
        let mut at = 0.0;
        loop {
            at += -(1.0 - rng.f64()).ln() / rate;
            if at >= end || rate <= 0.0 {
                return users;
            }
            let prompt_tokens = if rng.f64() < self.long_fraction {
                let (low, high) = self.long_prompt_tokens;
                let (low, high) = (f64::from(low.max(1)), f64::from(high.max(low)));
                (low * (high / low).powf(rng.f64())).round() as u32
            } else {
                rng.u32(self.short_prompt_tokens.0..=self.short_prompt_tokens.1)
            };
            let messages = [json!({"role": "user", "content": text(rng, prompt_tokens)})];
            let max_tokens = self.answer_tokens.sample(rng);
            users.push(User {
                start: Duration::from_secs_f64(at),
                turns: vec![Turn {
                    think: Duration::ZERO,
                    request: chat_request(&messages, max_tokens, None, self.stream),
                }],
            });
        }
    }

    fn describe(&self, scale: Scale) -> String {
        format!(
            "single requests, Poisson at {:.1} req/s for {:.1} s; {:.0}% long documents of {}–{} prompt tokens (log-uniform), the rest short chats of {}–{}; answers {}",
            self.rate(scale),
            self.duration / scale.time_compression,
            self.long_fraction * 100.0,
            self.long_prompt_tokens.0,
            self.long_prompt_tokens.1,
            self.short_prompt_tokens.0,
            self.short_prompt_tokens.1,
            self.answer_tokens.describe(),
        )
    }
}

fn range_text((low, high): (u32, u32)) -> String {
    if low == high {
        low.to_string()
    } else {
        format!("{low}–{high}")
    }
}
