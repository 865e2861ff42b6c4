//! The prompt of a request as the simulated replica sees it: the text it prefills, its length in
//! tokens, and the hash chain of its blocks (the prefix cache's keys).
//!
//! - The text: OpenAI chat `messages` rendered with a fixed chat template ([`render_chat`]),
//!   else OpenAI `prompt`, else TGI `inputs`; empty when the body has none of them.
//! - Tokens: [`CHARS_PER_TOKEN`] bytes each (the last one may be shorter), about what a BPE
//!   tokenizer makes of English text.
//! - Blocks: `block_tokens` tokens each; block `i`'s hash covers its bytes and the hash of block
//!   `i - 1`, so equal hashes mean equal prompts up to the end of that block (vLLM's hash chain).
//!   Only full blocks are hashed.
//!
//! Every generated token is [`TOKEN_TEXT`], one token long, so a client that sends the answer
//! back as the assistant's message of its next turn sends the very tokens the replica cached.

use std::hash::{DefaultHasher, Hasher};

use serde_json::Value;

/// Bytes per token.
pub const CHARS_PER_TOKEN: usize = 4;

/// The text of every generated token (exactly [`CHARS_PER_TOKEN`] bytes).
pub const TOKEN_TEXT: &str = " tok";

/// A request's prompt.
#[derive(Debug, Clone, Default)]
pub struct Prompt {
    /// The text the replica prefills.
    pub text: String,
}

impl Prompt {
    /// The prompt of a JSON request body (empty when it has none).
    pub fn of_body(body: &Value) -> Self {
        let text = if let Some(messages) = body["messages"].as_array() {
            render_chat(messages)
        } else if let Some(prompt) = body["prompt"].as_str() {
            prompt.to_owned()
        } else if let Some(inputs) = body["inputs"].as_str() {
            inputs.to_owned()
        } else {
            String::new()
        };
        Self { text }
    }

    /// Its length in tokens.
    pub fn tokens(&self) -> u64 {
        tokens_of(self.text.len())
    }

    /// The hash chain of its full blocks.
    pub fn block_hashes(&self, block_tokens: u32) -> Vec<u64> {
        block_hashes(self.text.as_bytes(), block_tokens)
    }

    /// `chain` (the hash chain of its full blocks) continued over `generated` tokens of answer:
    /// the blocks a replica has computed once the answer is decoded.
    pub fn chain_with_answer(&self, chain: &[u64], generated: u32, block_tokens: u32) -> Vec<u64> {
        let block_bytes = block_bytes(block_tokens);
        let computed = (chain.len() * block_bytes).min(self.text.len());
        let mut tail = self.text.as_bytes()[computed..].to_vec();
        tail.extend_from_slice(answer_text(generated).as_bytes());
        let mut extended = chain.to_vec();
        extended.extend(chain_after(
            chain.last().copied().unwrap_or(0),
            &tail,
            block_bytes,
        ));
        extended
    }
}

/// Tokens in `bytes` bytes of text.
pub fn tokens_of(bytes: usize) -> u64 {
    bytes.div_ceil(CHARS_PER_TOKEN) as u64
}

/// An answer of `tokens` tokens.
pub fn answer_text(tokens: u32) -> String {
    TOKEN_TEXT.repeat(tokens as usize)
}

/// `messages` as one text: `<|role|>\n{content}\n` per message, then `<|assistant|>\n` (the
/// generation prompt). A message's content is a string or a list of `{"type": "text", "text":
/// ...}` parts. An earlier answer sent back as an `assistant` message therefore renders as the
/// text the replica generated, right after the generation prompt it was generated from.
pub fn render_chat(messages: &[Value]) -> String {
    let mut text = String::new();
    for message in messages {
        let role = message["role"].as_str().unwrap_or("user");
        text.push_str("<|");
        text.push_str(role);
        text.push_str("|>\n");
        match &message["content"] {
            Value::String(content) => text.push_str(content),
            Value::Array(parts) => {
                for part in parts {
                    if let Some(part) = part["text"].as_str() {
                        text.push_str(part);
                    }
                }
            }
            _ => {}
        }
        text.push('\n');
    }
    text.push_str("<|assistant|>\n");
    text
}

/// The hash chain of the full blocks of `text`.
pub fn block_hashes(text: &[u8], block_tokens: u32) -> Vec<u64> {
    chain_after(0, text, block_bytes(block_tokens))
}

fn block_bytes(block_tokens: u32) -> usize {
    block_tokens.max(1) as usize * CHARS_PER_TOKEN
}

/// The hashes of the full blocks of `text`, chained on from `previous`.
fn chain_after(mut previous: u64, text: &[u8], block_bytes: usize) -> Vec<u64> {
    text.chunks_exact(block_bytes)
        .map(|block| {
            let mut hasher = DefaultHasher::new();
            hasher.write_u64(previous);
            hasher.write(block);
            previous = hasher.finish();
            previous
        })
        .collect()
}
