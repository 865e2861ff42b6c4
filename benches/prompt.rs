//! Prompt costs, measured with criterion: `Prompt::of_body` on OpenAI chat bodies of 1 KB, 10 KB
//! and 100 KB (a system prompt of nine tenths of the body, then three turns) and on a 100 KB TGI
//! body, and the prefix index work of one routed request: the longest cached prefix of a 100 KB
//! prompt's blocks in each of 64 backends' full indexes, then the record into the best one.
//!
//! `cargo bench --bench prompt`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use custom_router::prefix_index::PrefixIndex;
use custom_router::prompt::Prompt;
use serde_json::json;

const BACKENDS: usize = 64;

/// Prose-like text of `len` bytes: words, spaces and a line break now and then.
fn text(len: usize, seed: u64) -> String {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = String::with_capacity(len + 16);
    while out.len() < len {
        for _ in 0..rng.usize(2..10) {
            out.push(rng.lowercase());
        }
        out.push(if rng.u8(..) < 8 { '\n' } else { ' ' });
    }
    out.truncate(len);
    out
}

/// A chat body of about `len` bytes: a system prompt of nine tenths of it, then a user turn, an
/// assistant answer and a second user turn.
fn chat_body(len: usize, seed: u64) -> Vec<u8> {
    let turn = len / 30;
    json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [
            {"role": "system", "content": text(len * 9 / 10, seed)},
            {"role": "user", "content": text(turn, seed + 1)},
            {"role": "assistant", "content": text(turn, seed + 2)},
            {"role": "user", "content": text(turn, seed + 3)},
        ],
        "max_tokens": 512,
        "stream": true,
        "temperature": 0.7
    })
    .to_string()
    .into_bytes()
}

fn tgi_body(len: usize, seed: u64) -> Vec<u8> {
    json!({"inputs": text(len, seed), "parameters": {"max_new_tokens": 256, "temperature": 0.7}})
        .to_string()
        .into_bytes()
}

fn of_body(c: &mut Criterion) {
    for (label, body) in [
        ("chat 1 KB", chat_body(1_000, 1)),
        ("chat 10 KB", chat_body(10_000, 2)),
        ("chat 100 KB", chat_body(100_000, 3)),
        ("tgi 100 KB", tgi_body(100_000, 4)),
    ] {
        let prompt = Prompt::of_body(&body).expect("a prompt");
        println!(
            "{label}: {} bytes, {} tokens, {} blocks",
            body.len(),
            prompt.tokens,
            prompt.blocks.len()
        );
        c.bench_function(&format!("Prompt::of_body, {label}"), |b| {
            b.iter(|| Prompt::of_body(black_box(&body)))
        });
    }
}

fn prefix_index(c: &mut Criterion) {
    let prompt = Prompt::of_body(&chat_body(100_000, 5)).expect("a prompt");
    let blocks = &prompt.blocks;
    // 64 full indexes of other prompts; backend 17 also has this one's first half.
    let indexes: Vec<PrefixIndex> = (0..BACKENDS)
        .map(|backend| {
            let index = PrefixIndex::default();
            let mut seed = backend as u64 * 1_000;
            while index.len_blocks() < index.capacity_blocks() {
                let mut rng = fastrand::Rng::with_seed(seed);
                let other: Vec<u64> = (0..400).map(|_| rng.u64(..)).collect();
                index.record(&other);
                seed += 1;
            }
            index
        })
        .collect();
    indexes[17].record(&blocks[..blocks.len() / 2]);
    let memory: usize = indexes.iter().map(PrefixIndex::memory_bytes).sum();
    println!(
        "prefix index: {BACKENDS} full default indexes, {} blocks each, {memory} bytes in all; prompt of {} blocks",
        indexes[0].len_blocks(),
        blocks.len()
    );

    c.bench_function(
        &format!(
            "PrefixIndex: lookup of {} blocks in {BACKENDS} backends + record",
            blocks.len()
        ),
        |b| {
            b.iter(|| {
                let (best, matched) = indexes
                    .iter()
                    .enumerate()
                    .map(|(i, index)| (i, index.matched_blocks(black_box(blocks))))
                    .max_by_key(|&(_, matched)| matched)
                    .expect("backends");
                indexes[best].record(blocks);
                matched
            })
        },
    );
    // A prompt that shares the first half and differs after: a binary search in backend 17.
    let mut rng = fastrand::Rng::with_seed(6);
    let probe: Vec<u64> = (0..blocks.len())
        .map(|i| {
            if i < blocks.len() / 2 {
                blocks[i]
            } else {
                rng.u64(..)
            }
        })
        .collect();
    assert_eq!(indexes[17].matched_blocks(&probe), blocks.len() / 2);
    c.bench_function(
        &format!(
            "PrefixIndex: lookup of {} blocks in {BACKENDS} backends, one half match",
            probe.len()
        ),
        |b| {
            b.iter(|| {
                indexes
                    .iter()
                    .map(|index| index.matched_blocks(black_box(&probe)))
                    .max()
            })
        },
    );
    let fresh = PrefixIndex::default();
    c.bench_function(
        &format!(
            "PrefixIndex: lookup of {} blocks in {BACKENDS} empty backends",
            blocks.len()
        ),
        |b| {
            b.iter(|| {
                (0..BACKENDS)
                    .map(|_| fresh.matched_blocks(black_box(blocks)))
                    .max()
            })
        },
    );
}

criterion_group!(benches, of_body, prefix_index);
criterion_main!(benches);
