//! What the LLM workloads send, shared by the drawn ones (`workload.rs`) and the replayed
//! traces (`trace.rs`): OpenAI chat completion requests, the pseudo-random text they carry
//! ([`CHARS_PER_TOKEN`] characters a token, as the simulated replica counts them), and how a
//! mode shrinks a workload ([`Scale`]).

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use serde_json::{Value, json};

use super::load::Outgoing;
use super::sim::prompt::{CHARS_PER_TOKEN, Prompt};

/// The header naming a request's conversation in session workloads (the `affinity` strategy's
/// default).
pub const SESSION_HEADER: &str = "x-session-id";

/// The path of every request.
pub const CHAT_PATH: &str = "/v1/chat/completions";

/// How a mode shrinks a workload: fewer users, and time compressed (the replicas run faster by
/// the same factor, see `scenarios.rs`).
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    /// Multiplies users per tenant (at least one each) and the document arrival rate.
    pub users: f64,
    /// Divides every time: start windows, think times, durations; multiplies the rate.
    pub time_compression: f64,
}

impl Scale {
    /// The workload as drawn up.
    pub const FULL: Scale = Scale {
        users: 1.0,
        time_compression: 1.0,
    };
}

/// A chat completion of `messages`, streamed or not.
pub fn chat_request(
    messages: &[Value],
    max_tokens: u32,
    session: Option<&str>,
    stream: bool,
) -> Outgoing {
    let body = json!({
        "model": "sim",
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": stream,
    });
    let prompt_tokens = Prompt::of_body(&body).tokens();
    let headers = session
        .and_then(|session| HeaderValue::from_str(session).ok())
        .map(|value| (HeaderName::from_static(SESSION_HEADER), value))
        .into_iter()
        .collect();
    Outgoing {
        path: CHAT_PATH.to_owned(),
        body: Bytes::from(body.to_string()),
        headers,
        max_tokens,
        stream,
        prompt_tokens,
    }
}

/// `tokens` tokens of pseudo-random lowercase words.
pub fn text(rng: &mut fastrand::Rng, tokens: u32) -> String {
    let length = tokens as usize * CHARS_PER_TOKEN;
    let mut text = String::with_capacity(length);
    while text.len() < length {
        let word = rng.usize(2..=9).min(length - text.len());
        text.extend((0..word).map(|_| rng.alphabetic().to_ascii_lowercase()));
        if text.len() < length {
            text.push(' ');
        }
    }
    text
}
