//! The prompt of an LLM request, read from the JSON body the proxy already holds: an estimate of
//! its size in tokens, the generation limit and streaming flag, a hash chain over its blocks (what
//! a [`PrefixIndex`](crate::prefix_index::PrefixIndex) records and matches, the way an inference
//! engine's prefix cache keys its KV blocks) and a key naming the conversation it belongs to.
//!
//! Three body shapes are read:
//!
//! - OpenAI chat: `{"messages": [{"role": .., "content": string | array of parts}, ..]}`;
//! - OpenAI completions: `{"prompt": string | array}`;
//! - TGI: `{"inputs": string, "parameters": {"max_new_tokens": N}}`.
//!
//! When a body has several of these fields, `messages` wins over `prompt`, which wins over
//! `inputs`. Anything else (not JSON, not an object, none of these fields, a `messages` that is
//! not an array of objects) is no prompt: [`Prompt::of_body`] answers `None`.
//!
//! # The prompt text
//!
//! The prompt text is a byte stream taken from the body as it is, never rebuilt as a string:
//!
//! - chat: for each message, the role's bytes, a `0x00` byte, the content's bytes, a `0x1E` byte.
//!   Only `role` and `content` are read (`tool_calls`, `name` and the like are not).
//! - completions and TGI: the bytes of `prompt` or `inputs`.
//!
//! A value's bytes are its raw JSON: escapes stay as they are written (`\n` is two bytes, `\u00e9`
//! six), a string loses only its two quotes, and anything else (an array of prompts, `null`) is
//! taken whole, except a chat content given as an array of parts: a text part gives its text,
//! any other part (an image, an audio clip) a stand-in of [`MEDIA_TOKENS`] tokens derived from
//! its JSON, so that a base64 image costs what a vision model spends on it, not its size. The two separator bytes cannot
//! occur in raw JSON, so no message boundary can be mistaken for content.
//!
//! The stream is cut into [`BLOCK_BYTES`] blocks that run across message boundaries, as an
//! engine's token blocks run across its chat template. Block `i`'s hash is the XXH3 hash of block
//! `i - 1`'s hash and the XXH3 hash of its bytes, so a hash names the whole prefix up to the end
//! of its block: equal prefixes give equal leading hashes, and a change in block `k` changes the
//! hashes from `k` on and none before. The last, partial block has no hash in [`Prompt::blocks`].
//!
//! [`Prompt::tokens`] is the length of the whole stream (role and separator bytes included, about
//! what a chat template adds per message) divided by [`BYTES_PER_TOKEN`], rounded up, so the full
//! blocks never cover more tokens than the prompt has.
//!
//! # The last answer
//!
//! An engine caches the blocks of an answer with the prompt that asked for it (vLLM and SGLang
//! keep a finished sequence's generated blocks in their prefix cache), and a chat's next turn
//! resends that answer as its last `assistant` message. A router's index records the prompts it
//! sent, never the answers, so it would see only the previous question held where the previous
//! turn ran. [`Prompt::answer`] is the span of blocks of the chat's last `assistant` message, and
//! [`Prompt::held_blocks`] counts it as held by a backend that holds the prompt up to it.
//!
//! # The conversation key
//!
//! [`Prompt::conversation`] hashes a prefix of the prompt text:
//!
//! - chat: the text up to the end of the first `user` message, which is the system message(s)
//!   and the first user message in the usual order. Every turn of one chat resends that history,
//!   so every turn has the same key; two users of one tenant who share a system prompt differ in
//!   their first user message, so their keys differ (unless they opened with the very same
//!   words). A chat without a user message is keyed by its whole text.
//! - completions and TGI: the first 8 KiB of the text (the whole text when shorter), as a
//!   templated prompt has no message boundary to cut at. Prompts that share their first 8 KiB,
//!   such as one long system prompt used by many users, share the key.
//!
//! # Cost
//!
//! The body is parsed once with serde_json's borrowed deserialization (values are borrowed as
//! `RawValue`s, nothing is built), and the text is hashed through one stack buffer, without
//! gathering it: the only allocation is the [`Prompt::blocks`] slice, and a 100 KB chat body
//! costs a few tens of microseconds (`benches/prompt.rs`).

use std::cell::Cell;
use std::fmt;

use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Bytes of prompt text in one block: 64 tokens at [`BYTES_PER_TOKEN`].
pub const BLOCK_BYTES: usize = 256;

/// Bytes of prompt text counted as one token.
pub const BYTES_PER_TOKEN: usize = 4;

/// Bytes of a completions or TGI prompt that the conversation key covers.
const CONVERSATION_TEXT_BYTES: usize = 8 * 1024;

/// Ends a chat message's role in the prompt text.
const ROLE_END: u8 = 0x00;

/// Ends a chat message in the prompt text.
const MESSAGE_END: u8 = 0x1E;

/// The seed of the first block's hash.
const CHAIN_SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// Hashes a thread's scratch list may keep between prompts (512 KiB); a longer one, built for a
/// very long prompt, is given back to the allocator.
const SCRATCH_KEPT: usize = 64 * 1024;

thread_local! {
    /// The block hashes of the prompt being read, a list each thread keeps between prompts: a
    /// chain neither allocates nor clears a buffer of its own per request (each prompt's hashes
    /// are copied out once, into its `blocks`).
    static SCRATCH: Cell<Vec<u64>> = const { Cell::new(Vec::new()) };
}

/// The prompt of one request, as far as routing cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// Estimated prompt tokens: prompt text bytes / [`BYTES_PER_TOKEN`], rounded up.
    pub tokens: u32,
    /// `max_tokens`, else `max_completion_tokens` (OpenAI), else `parameters.max_new_tokens`
    /// (TGI); a value that is not a `u32` counts as absent.
    pub max_tokens: Option<u32>,
    /// `"stream": true` in the body (OpenAI). TGI streams through its `/generate_stream` path,
    /// which the body does not show: `false` there.
    pub stream: bool,
    /// The hash chain over the prompt text's full [`BLOCK_BYTES`] blocks: block `i`'s hash covers
    /// its bytes and block `i - 1`'s hash.
    pub blocks: Box<[u64]>,
    /// The conversation the prompt belongs to (see the module docs for what it covers).
    pub conversation: u64,
    /// The chat's last `assistant` message as a span of [`Self::blocks`]: the block its first byte
    /// falls in, and the number of full blocks before its end (`None` for a chat without one and
    /// for completions and TGI prompts). See [`Self::held_blocks`].
    pub answer: Option<(u32, u32)>,
}

impl Prompt {
    /// The prompt of a JSON request body, or `None` when the body is not JSON, not an object, or
    /// has none of `messages`, `prompt` and `inputs` in a known shape.
    pub fn of_body(body: &[u8]) -> Option<Prompt> {
        let mut chain = Chain::new();
        let mut de = serde_json::Deserializer::from_slice(body);
        let fields = BodySeed { chain: &mut chain }.deserialize(&mut de).ok()?;
        de.end().ok()?;

        let conversation = if fields.chat {
            fields.conversation.unwrap_or_else(|| chain.fingerprint())
        } else {
            let text = text_of(fields.prompt.or(fields.inputs)?);
            let (head, tail) = text.split_at(text.len().min(CONVERSATION_TEXT_BYTES));
            chain.feed(head);
            let conversation = chain.fingerprint();
            chain.feed(tail);
            conversation
        };
        let tokens = chain.bytes.div_ceil(BYTES_PER_TOKEN);
        Some(Prompt {
            tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
            max_tokens: fields
                .max_tokens
                .or(fields.max_completion_tokens)
                .or(fields.max_new_tokens),
            stream: fields.stream,
            answer: chain
                .answer
                .map(|(a, b)| ((a / BLOCK_BYTES) as u32, (b / BLOCK_BYTES) as u32)),
            blocks: chain.into_blocks(),
            conversation,
        })
    }

    /// The leading blocks of the prompt a backend holds when its prefix index holds `matched`
    /// of them: all of the chat's last answer too ([`Self::answer`]) when the index holds every
    /// block before the answer's first, since the backend then ran the turn that wrote it (see
    /// the module docs). A backend holding none of the prompt holds none of the answer, even one
    /// that starts in the first block.
    pub fn held_blocks(&self, matched: usize) -> usize {
        match self.answer {
            Some((start, end)) if matched > 0 && matched >= start as usize => {
                matched.max((end as usize).min(self.blocks.len()))
            }
            _ => matched,
        }
    }

    /// The tokens that `blocks` full blocks cover.
    pub fn blocks_tokens(blocks: usize) -> u64 {
        blocks as u64 * (BLOCK_BYTES / BYTES_PER_TOKEN) as u64
    }
}

/// The hash chain being built: a block buffer, the last full block's hash and the hashes so far
/// (in the thread's scratch list, given back when the chain is dropped).
struct Chain {
    buf: [u8; BLOCK_BYTES],
    fill: usize,
    last: u64,
    bytes: usize,
    hashes: Vec<u64>,
    answer: Option<(usize, usize)>,
}

impl Drop for Chain {
    fn drop(&mut self) {
        let mut hashes = std::mem::take(&mut self.hashes);
        if hashes.capacity() <= SCRATCH_KEPT {
            hashes.clear();
            SCRATCH.with(|scratch| scratch.set(hashes));
        }
    }
}

impl Chain {
    fn new() -> Self {
        Self {
            buf: [0; BLOCK_BYTES],
            fill: 0,
            last: CHAIN_SEED,
            bytes: 0,
            hashes: SCRATCH.with(Cell::take),
            answer: None,
        }
    }

    /// Appends bytes to the text; full blocks are hashed straight from `bytes` when the buffer is
    /// empty, so only block-straddling pieces are copied.
    fn feed(&mut self, mut bytes: &[u8]) {
        self.bytes += bytes.len();
        if self.fill > 0 {
            let take = (BLOCK_BYTES - self.fill).min(bytes.len());
            self.buf[self.fill..self.fill + take].copy_from_slice(&bytes[..take]);
            self.fill += take;
            bytes = &bytes[take..];
            if self.fill < BLOCK_BYTES {
                return;
            }
            self.fill = 0;
            let hash = chained(&self.buf, self.last);
            self.push(hash);
        }
        let mut blocks = bytes.chunks_exact(BLOCK_BYTES);
        for block in &mut blocks {
            let hash = chained(block, self.last);
            self.push(hash);
        }
        let rest = blocks.remainder();
        self.buf[..rest.len()].copy_from_slice(rest);
        self.fill = rest.len();
    }

    fn push(&mut self, hash: u64) {
        self.last = hash;
        self.hashes.push(hash);
    }

    /// The hash of the whole text so far, its partial block included.
    fn fingerprint(&self) -> u64 {
        xxh3_64_with_seed(&self.buf[..self.fill], self.last)
    }

    fn into_blocks(self) -> Box<[u64]> {
        Box::from(&self.hashes[..])
    }
}

/// A block's hash in the chain: the XXH3 hash of the previous hash and the block's own XXH3 hash.
/// (Seeding XXH3 with the previous hash instead would derive a new secret for every block.)
fn chained(block: &[u8], previous: u64) -> u64 {
    let mut pair = [0; 16];
    pair[..8].copy_from_slice(&previous.to_le_bytes());
    pair[8..].copy_from_slice(&xxh3_64(block).to_le_bytes());
    xxh3_64(&pair)
}

/// A value's bytes in the prompt text: a string without its quotes, anything else whole.
fn text_of(raw: &RawValue) -> &[u8] {
    let raw = raw.get().as_bytes();
    match raw {
        [b'"', inner @ .., b'"'] => inner,
        _ => raw,
    }
}

/// Tokens a content part other than text (an image, an audio clip, a file) is counted as: about
/// what one image costs a vision model (576 for LLaVA-1.5, about 765–1,105 for GPT-4o at high
/// detail, about 1,300 for Qwen2-VL at 1024 × 1024), whatever the size of its base64 data.
pub const MEDIA_TOKENS: usize = 1024;

/// Feeds a chat message's content: a string as it is; an array of parts part by part, a text
/// part's text as it is and any other part as a stand-in of [`MEDIA_TOKENS`] tokens derived from
/// its JSON (equal parts give equal stand-ins, so an image sent again is a cached prefix; its
/// base64 bytes are not counted as tokens); anything else whole.
fn feed_content(chain: &mut Chain, content: &RawValue) {
    let raw = content.get();
    if !raw.starts_with('[') {
        chain.feed(text_of(content));
        return;
    }
    let Ok(parts) = serde_json::from_str::<PartsSeq<'_>>(raw) else {
        chain.feed(text_of(content));
        return;
    };
    for part in parts.0 {
        match serde_json::from_str::<Part<'_>>(part.get()) {
            Ok(Part {
                kind: Some("text"),
                text: Some(text),
            }) => chain.feed(text_of(text)),
            _ => {
                let digest = xxh3_64(part.get().as_bytes()).to_le_bytes();
                let mut stand_in = [0u8; BLOCK_BYTES];
                for piece in stand_in.chunks_exact_mut(digest.len()) {
                    piece.copy_from_slice(&digest);
                }
                for _ in 0..MEDIA_TOKENS * BYTES_PER_TOKEN / BLOCK_BYTES {
                    chain.feed(&stand_in);
                }
            }
        }
    }
}

/// A content array's parts, borrowed raw.
#[derive(Deserialize)]
struct PartsSeq<'a>(#[serde(borrow)] Vec<&'a RawValue>);

/// A content part: its type, and its text when it is a text part.
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<&'a str>,
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
}

/// A number field read leniently: a `u32`, or nothing.
fn count_of(raw: &RawValue) -> Option<u32> {
    raw.get().parse().ok()
}

/// The fields of a body that matter, once its chat messages have gone through the chain.
#[derive(Default)]
struct Fields<'de> {
    chat: bool,
    conversation: Option<u64>,
    prompt: Option<&'de RawValue>,
    inputs: Option<&'de RawValue>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    max_new_tokens: Option<u32>,
    stream: bool,
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Field {
    Messages,
    Prompt,
    Inputs,
    MaxTokens,
    MaxCompletionTokens,
    Parameters,
    Stream,
    #[serde(other)]
    Other,
}

/// TGI's `parameters`, of which only the generation limit matters.
#[derive(Deserialize)]
struct Parameters<'a> {
    #[serde(borrow, default)]
    max_new_tokens: Option<&'a RawValue>,
}

/// One chat message: its role and content, borrowed raw.
#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// Reads the top-level object, feeding chat messages into the chain as they are read.
struct BodySeed<'c> {
    chain: &'c mut Chain,
}

impl<'de> DeserializeSeed<'de> for BodySeed<'_> {
    type Value = Fields<'de>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed<'_> {
    type Value = Fields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = Fields::default();
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                // Engines disagree on a duplicate `messages` (Python's read the last, TGI
                // refuses the body): such a body has no prompt the router can trust.
                Field::Messages if fields.chat => {
                    return Err(serde::de::Error::custom("duplicate field `messages`"));
                }
                Field::Messages => {
                    fields.chat = true;
                    fields.conversation = map.next_value_seed(MessagesSeed {
                        chain: &mut *self.chain,
                    })?;
                }
                Field::Prompt => fields.prompt = Some(map.next_value()?),
                Field::Inputs => fields.inputs = Some(map.next_value()?),
                Field::MaxTokens => fields.max_tokens = count_of(map.next_value()?),
                Field::MaxCompletionTokens => {
                    fields.max_completion_tokens = count_of(map.next_value()?);
                }
                Field::Parameters => {
                    let raw: &RawValue = map.next_value()?;
                    fields.max_new_tokens = serde_json::from_str::<Parameters>(raw.get())
                        .ok()
                        .and_then(|p| p.max_new_tokens)
                        .and_then(count_of);
                }
                Field::Stream => fields.stream = map.next_value::<&RawValue>()?.get() == "true",
                Field::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(fields)
    }
}

/// Reads the `messages` array into the chain; its value is the conversation key, when the chat
/// has a user message.
struct MessagesSeed<'c> {
    chain: &'c mut Chain,
}

impl<'de> DeserializeSeed<'de> for MessagesSeed<'_> {
    type Value = Option<u64>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed<'_> {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of chat messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut conversation = None;
        while let Some(message) = seq.next_element::<Message>()? {
            let role = message.role.map(text_of).unwrap_or_default();
            let start = self.chain.bytes;
            self.chain.feed(role);
            self.chain.feed(&[ROLE_END]);
            if let Some(content) = message.content {
                feed_content(self.chain, content);
            }
            self.chain.feed(&[MESSAGE_END]);
            if role == b"assistant" {
                self.chain.answer = Some((start, self.chain.bytes));
            }
            if conversation.is_none() && role == b"user" {
                conversation = Some(self.chain.fingerprint());
            }
        }
        Ok(conversation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn of(value: serde_json::Value) -> Prompt {
        Prompt::of_body(value.to_string().as_bytes()).expect("a prompt")
    }

    fn chat(messages: &[(&str, &str)]) -> serde_json::Value {
        let messages: Vec<_> = messages
            .iter()
            .map(|(role, content)| json!({"role": role, "content": content}))
            .collect();
        json!({"model": "m", "messages": messages})
    }

    /// A text of `len` bytes that differs everywhere from one `seed` to another.
    fn text(len: usize, seed: u64) -> String {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..len).map(|_| rng.alphanumeric()).collect()
    }

    fn common_prefix(a: &[u64], b: &[u64]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    #[test]
    fn prompt_of_a_chat_counts_roles_separators_and_content() {
        let p = of(json!({
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hi"}
            ],
            "max_tokens": 100,
            "stream": true
        }));
        // "system" 0x00 "You are terse." 0x1E "user" 0x00 "Hi" 0x1E = 6+1+14+1+4+1+2+1 = 30 bytes.
        assert_eq!(p.tokens, 8);
        assert_eq!(p.max_tokens, Some(100));
        assert!(p.stream);
        assert!(p.blocks.is_empty());
    }

    #[test]
    fn prompt_of_a_long_chat_has_one_hash_per_full_block() {
        let p = of(chat(&[("user", &text(1000, 1))]));
        // 4 + 1 + 1000 + 1 bytes: three full blocks, 252 tokens.
        assert_eq!(p.blocks.len(), 3);
        assert_eq!(p.tokens, 252);
        assert!(Prompt::blocks_tokens(p.blocks.len()) <= u64::from(p.tokens));
        assert_eq!(Prompt::blocks_tokens(3), 192);
    }

    #[test]
    fn prompt_of_completions_takes_the_prompt_string_or_array() {
        let p = of(json!({"model": "m", "prompt": "abcdefghi", "max_completion_tokens": 7}));
        assert_eq!(p.tokens, 3);
        assert_eq!(p.max_tokens, Some(7));
        assert!(!p.stream);
        let long = text(600, 2);
        let as_string = of(json!({"prompt": long}));
        assert_eq!(as_string.blocks.len(), 2);
        let as_array = of(json!({"prompt": [long, "second"]}));
        // The array's raw JSON: `["` + 600 + `","second"]` = 613 bytes.
        assert_eq!(as_array.tokens, 154);
        assert_ne!(as_array.blocks[0], as_string.blocks[0]);
    }

    #[test]
    fn content_parts_count_text_as_text_and_media_as_a_fixed_stand_in() {
        let image = |data: &str| json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{data}")}});
        let big = text(1_000_000, 7);
        let with = |data: &str| {
            of(json!({"messages": [
                {"role": "system", "content": "Describe images."},
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image(data)]}
            ]}))
        };
        let p = with(&big);
        // "system" 0 "Describe images." 1E "user" 0 "What is this?" + 4,096 stand-in bytes 1E.
        let text_bytes = 6 + 1 + 16 + 1 + 4 + 1 + 13 + 1;
        assert_eq!(
            p.tokens as usize,
            (text_bytes + MEDIA_TOKENS * BYTES_PER_TOKEN).div_ceil(BYTES_PER_TOKEN)
        );
        // The same image again: the same blocks; another image: the blocks part from it on.
        assert_eq!(with(&big).blocks, p.blocks);
        let other = with(&text(1_000_000, 8));
        let shared = common_prefix(&p.blocks, &other.blocks);
        assert!(shared < p.blocks.len() && shared <= 1, "{shared}");
        // A content of one text part reads as the same text given as a string.
        let parts = of(
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]}),
        );
        let string = of(json!({"messages": [{"role": "user", "content": "Hi there"}]}));
        assert_eq!(parts, string);
    }

    #[test]
    fn prompt_of_tgi_reads_inputs_and_max_new_tokens() {
        let p =
            of(json!({"inputs": text(513, 3), "parameters": {"max_new_tokens": 20, "top_p": 0.9}}));
        assert_eq!(p.tokens, 129);
        assert_eq!(p.max_tokens, Some(20));
        assert_eq!(p.blocks.len(), 2);
        assert!(!p.stream);
        // The same text as a completions prompt hashes the same.
        let q = of(json!({"prompt": text(513, 3)}));
        assert_eq!(p.blocks, q.blocks);
        assert_eq!(p.conversation, q.conversation);
    }

    #[test]
    fn prompt_max_tokens_precedence_and_leniency() {
        let body = |v| of(v).max_tokens;
        let all = json!({"prompt": "x", "max_tokens": 1, "max_completion_tokens": 2,
                         "parameters": {"max_new_tokens": 3}});
        assert_eq!(body(all), Some(1));
        let two = json!({"prompt": "x", "max_completion_tokens": 2,
                         "parameters": {"max_new_tokens": 3}});
        assert_eq!(body(two), Some(2));
        assert_eq!(
            body(json!({"prompt": "x", "parameters": {"max_new_tokens": 3}})),
            Some(3)
        );
        assert_eq!(body(json!({"prompt": "x"})), None);
        // Values that are not a u32 count as absent, and the next field is read.
        let odd = json!({"prompt": "x", "max_tokens": null, "max_completion_tokens": 2.5,
                         "parameters": {"max_new_tokens": 9}});
        assert_eq!(body(odd), Some(9));
        assert_eq!(body(json!({"prompt": "x", "max_tokens": -1})), None);
        assert_eq!(body(json!({"prompt": "x", "parameters": "odd"})), None);
    }

    #[test]
    fn prompt_stream_is_true_only_for_true() {
        assert!(of(json!({"prompt": "x", "stream": true})).stream);
        assert!(!of(json!({"prompt": "x", "stream": false})).stream);
        assert!(!of(json!({"prompt": "x", "stream": "true"})).stream);
    }

    #[test]
    fn prompt_keeps_escapes_as_written() {
        // `a\nb` is 4 bytes as written, `\u00e9` 6: the text is not unescaped.
        let p = Prompt::of_body(br#"{"prompt": "a\nb\u00e9"}"#).unwrap();
        assert_eq!(p.tokens, 3); // 10 bytes
        let q = Prompt::of_body(br#"{"prompt": "a\nb\u00E9"}"#).unwrap();
        assert_ne!(p.conversation, q.conversation);
    }

    #[test]
    fn prompt_of_non_json_or_unknown_shapes_is_none() {
        for body in [
            &b""[..],
            b"not json",
            b"[1, 2]",
            b"\"prompt\"",
            b"{\"model\": \"m\"}",
            b"{\"prompt\": \"x\"",
            b"{\"prompt\": \"x\"} trailing",
            b"{\"messages\": \"hello\"}",
            b"{\"messages\": null}",
            b"{\"messages\": [\"hello\"]}",
        ] {
            assert_eq!(
                Prompt::of_body(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // An empty chat is still a chat.
        assert_eq!(of(json!({"messages": []})).tokens, 0);
    }

    #[test]
    fn prompt_messages_win_over_prompt_and_inputs() {
        let c = of(json!({
            "inputs": "tgi",
            "prompt": "completions",
            "messages": [{"role": "user", "content": "chat"}]
        }));
        assert_eq!(c.tokens, 3); // "user" 0x00 "chat" 0x1E = 10 bytes
        let p = of(json!({"inputs": "tgi", "prompt": "completions"}));
        assert_eq!(p.tokens, 3); // 11 bytes
        assert_eq!(
            p.conversation,
            of(json!({"prompt": "completions"})).conversation
        );
    }

    #[test]
    fn prompt_equal_prefixes_give_equal_leading_blocks() {
        let base = text(4096, 5);
        let a = of(json!({"prompt": base}));
        assert_eq!(a.blocks.len(), 16);
        // A change in block 9 changes hashes 9.. and none before.
        let mut changed = base.clone().into_bytes();
        changed[9 * BLOCK_BYTES + 17] = b'#';
        let b = of(json!({"prompt": String::from_utf8(changed).unwrap()}));
        assert_eq!(&a.blocks[..9], &b.blocks[..9]);
        assert!(
            a.blocks[9..]
                .iter()
                .zip(&b.blocks[9..])
                .all(|(x, y)| x != y)
        );
        // A longer text with the same start shares every full block of the shorter one.
        let c = of(json!({"prompt": format!("{base}{}", text(1000, 6))}));
        assert_eq!(&c.blocks[..16], &a.blocks[..]);
        // The same block content at another position hashes differently (the chain).
        let twice = text(BLOCK_BYTES, 7).repeat(2);
        let d = of(json!({"prompt": twice}));
        assert_ne!(d.blocks[0], d.blocks[1]);
    }

    #[test]
    fn prompt_blocks_run_across_message_boundaries() {
        // Many short messages: blocks are full 256-byte pieces of the whole stream.
        let messages: Vec<(&str, String)> = (0..40)
            .map(|i| (if i % 2 == 0 { "user" } else { "assistant" }, text(37, i)))
            .collect();
        let messages: Vec<(&str, &str)> = messages.iter().map(|(r, c)| (*r, c.as_str())).collect();
        let p = of(chat(&messages));
        let bytes: usize = messages.iter().map(|(r, c)| r.len() + c.len() + 2).sum();
        assert_eq!(p.blocks.len(), bytes / BLOCK_BYTES);
        assert_eq!(p.tokens as usize, bytes.div_ceil(BYTES_PER_TOKEN));
    }

    #[test]
    fn prompt_turns_of_one_chat_share_blocks_and_conversation() {
        let system = text(5000, 8);
        let question = text(700, 9);
        let turn1 = of(chat(&[("system", &system), ("user", &question)]));
        let answer = text(900, 10);
        let turn2 = of(chat(&[
            ("system", &system),
            ("user", &question),
            ("assistant", &answer),
            ("user", "And then?"),
        ]));
        assert_eq!(&turn2.blocks[..turn1.blocks.len()], &turn1.blocks[..]);
        assert!(turn2.blocks.len() > turn1.blocks.len());
        assert_eq!(turn1.conversation, turn2.conversation);
        // Resent with extra fields and another key order, the turn is the same prompt.
        let reordered = of(json!({
            "stream": true,
            "messages": [
                {"content": system, "role": "system", "name": "s"},
                {"content": question, "role": "user"}
            ],
            "model": "m"
        }));
        assert_eq!(reordered.blocks, turn1.blocks);
        assert_eq!(reordered.conversation, turn1.conversation);
    }

    #[test]
    fn prompt_conversation_differs_between_users_of_one_system_prompt() {
        let system = text(5000, 11);
        let alice = of(chat(&[
            ("system", &system),
            ("user", "Summarise my invoice"),
        ]));
        let bob = of(chat(&[
            ("system", &system),
            ("user", "Translate this poem"),
        ]));
        assert_ne!(alice.conversation, bob.conversation);
        // They still share the system prompt's blocks.
        assert!(common_prefix(&alice.blocks, &bob.blocks) >= 19);
        // Another tenant's system prompt with the same first question is another conversation.
        let other = of(chat(&[
            ("system", &text(5000, 12)),
            ("user", "Summarise my invoice"),
        ]));
        assert_ne!(alice.conversation, other.conversation);
        // A chat without a user message is keyed by its whole text.
        let a = of(chat(&[("system", "a")]));
        let b = of(chat(&[("system", "b")]));
        assert_ne!(a.conversation, b.conversation);
    }

    #[test]
    fn prompt_conversation_of_text_prompts_covers_the_first_8_kib() {
        let head = text(CONVERSATION_TEXT_BYTES, 13);
        let a = of(json!({"inputs": format!("{head}{}", text(3000, 14))}));
        let b = of(json!({"inputs": format!("{head}{}", text(10, 15))}));
        assert_eq!(a.conversation, b.conversation);
        let short_a = of(json!({"prompt": text(100, 16)}));
        let short_b = of(json!({"prompt": format!("{}!", text(100, 16))}));
        assert_ne!(short_a.conversation, short_b.conversation);
    }

    #[test]
    fn a_prompts_blocks_do_not_depend_on_the_prompts_read_before_it() {
        let big = text(600 * BLOCK_BYTES + 10, 17);
        let long = of(json!({"prompt": big}));
        assert_eq!(long.blocks.len(), 600);
        // The thread's scratch list held 600 hashes; a shorter prompt sees none of them.
        let short = of(json!({"prompt": &big[..10 * BLOCK_BYTES]}));
        assert_eq!(&short.blocks[..], &long.blocks[..10]);
        // A body that is not a prompt leaves the list empty for the next one too.
        assert!(Prompt::of_body(br#"{"prompt": "unterminated"#).is_none());
        assert_eq!(of(json!({"prompt": big})), long);
    }

    #[test]
    fn prompt_answer_is_the_block_span_of_the_chats_last_assistant_message() {
        // "user" 0x00 q 0x1E: 512 bytes, two blocks; "assistant" 0x00 a 0x1E: 512 more.
        let question = text(506, 30);
        let answer = text(501, 31);
        let turn1 = of(chat(&[("user", &question)]));
        assert_eq!((turn1.blocks.len(), turn1.answer), (2, None));
        let turn2 = of(chat(&[
            ("user", &question),
            ("assistant", &answer),
            ("user", "next"),
        ]));
        assert_eq!((turn2.blocks.len(), turn2.answer), (4, Some((2, 4))));
        // An answer that does not start or end on a block boundary: the block it starts in,
        // and the full blocks before its end.
        let turn2b = of(chat(&[
            ("user", &question[..400]),
            ("assistant", &answer[..300]),
            ("user", &text(300, 32)),
        ]));
        // It runs from byte 406 to 717: block 1 to the two full blocks before byte 717.
        assert_eq!(turn2b.answer, Some((1, 2)));
        // Of several answers, the last one; completions and TGI prompts have none.
        let turn3 = of(chat(&[
            ("user", &question),
            ("assistant", &answer),
            ("user", &question),
            ("assistant", &answer),
            ("user", "next"),
        ]));
        assert_eq!(turn3.answer, Some((6, 8)));
        assert_eq!(of(json!({"prompt": question})).answer, None);
        assert_eq!(of(json!({"inputs": question})).answer, None);
    }

    #[test]
    fn a_backend_holding_a_chat_up_to_its_last_answer_holds_the_answer() {
        let question = text(506, 33);
        let turn2 = of(chat(&[
            ("user", &question),
            ("assistant", &text(501, 34)),
            ("user", "next"),
        ]));
        // The turn before ran there (its two blocks held): the answer's two blocks are held.
        assert_eq!(turn2.held_blocks(2), 4);
        // Held further than the answer's start (the same turn sent there before): as held.
        assert_eq!(turn2.held_blocks(3), 4);
        assert_eq!(turn2.held_blocks(4), 4);
        // Held short of the answer's start: the backend did not run the turn that wrote it.
        assert_eq!(turn2.held_blocks(1), 1);
        assert_eq!(turn2.held_blocks(0), 0);
        // No answer: what the index holds.
        let turn1 = of(chat(&[("user", &question)]));
        assert_eq!(turn1.held_blocks(1), 1);
        // An answer starting in the first block: held only by a backend holding some of the
        // prompt.
        let opened = of(chat(&[
            ("assistant", &text(1000, 35)),
            ("user", &text(600, 36)),
        ]));
        assert_eq!(opened.answer, Some((0, 3)));
        assert_eq!(opened.held_blocks(0), 0);
        assert_eq!(opened.held_blocks(1), 3);
    }
}
