//! Replays of production traces (`benches/traces/`, the Mooncake FAST'25 traces): every request
//! at its timestamp, with its prompt's real prefix structure.
//!
//! A trace line gives a request's arrival (`timestamp`, ms), its `input_length` and
//! `output_length` in tokens and `hash_ids`, one id per 512-token block of its prompt, equal ids
//! meaning equal blocks. The replay turns each block id into a fixed text (drawn from a seed made
//! of the id), so the prompt of a request is the concatenation of its blocks' texts (its last
//! block cut to the length the trace gives) and two requests share exactly the prefix the trace
//! says they share; a router that reads prompts, and a replica's prefix cache, see the real
//! sharing. Requests are OpenAI chat completions with that text as one user message.
//!
//! To fit two cores, a replay scales tokens and time: each 512-token block becomes
//! [`Trace::tokens_per_block`] tokens of text, answers [`Trace::output_scale`] of their length,
//! and a window of [`Trace::window_seconds`] of the trace is replayed [`Trace::speedup`] times
//! faster. The window starts at an offset drawn from the run's seed, so runs with other seeds
//! replay other parts of the trace.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;

use super::LabError;
use super::load::{Turn, User};
use super::requests::{Scale, chat_request, text};

/// Tokens per block of the traces' `hash_ids`.
const TRACE_BLOCK_TOKENS: u64 = 512;

/// One request of a trace file.
#[derive(Debug, Clone, Deserialize)]
pub struct TraceLine {
    /// Arrival, ms from the trace's start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Answer tokens.
    pub output_length: u64,
    /// The prompt's 512-token blocks.
    pub hash_ids: Vec<u64>,
}

/// A trace replayed as a workload.
#[derive(Debug, Clone)]
pub struct Trace {
    /// The file under `benches/traces/` (gzip-compressed JSON lines).
    pub file: &'static str,
    /// What the trace is, a few words.
    pub about: &'static str,
    /// Seconds of trace time replayed.
    pub window_seconds: f64,
    /// Trace seconds per second of the run.
    pub speedup: f64,
    /// Tokens of text per 512-token block of the trace.
    pub tokens_per_block: u32,
    /// Answer lengths are the trace's times this (at least one token).
    pub output_scale: f64,
    /// Whether requests ask for a stream.
    pub stream: bool,
}

impl Trace {
    /// The requests of one run: the window starting at an offset drawn from `seed`, each
    /// request a user of one turn at its (scaled) arrival time.
    pub fn users(&self, seed: u64, scale: Scale) -> Vec<User> {
        let lines = match load(self.file) {
            Ok(lines) => lines,
            Err(error) => panic!("trace {}: {error}", self.file),
        };
        let window = self.window(&lines, seed, scale);
        let mut blocks = BlockTexts::new(self.file, self.tokens_per_block);
        let compression = self.speedup * scale.time_compression;
        let first = window.first().map_or(0, |line| line.timestamp);
        window
            .iter()
            .map(|line| {
                let content = blocks.prompt(line);
                let max_tokens = self.output_tokens(line);
                let messages = [json!({"role": "user", "content": content})];
                let at = (line.timestamp - first) as f64 / 1000.0 / compression;
                User {
                    start: Duration::from_secs_f64(at),
                    turns: vec![Turn {
                        think: Duration::ZERO,
                        request: chat_request(&messages, max_tokens, None, self.stream),
                    }],
                }
            })
            .collect()
    }

    /// The lines of the window replayed in a run with `seed`.
    pub fn window<'a>(&self, lines: &'a [TraceLine], seed: u64, scale: Scale) -> &'a [TraceLine] {
        let Some(last) = lines.last() else {
            return lines;
        };
        let span_ms = (self.window_seconds * scale.users.min(1.0) * 1000.0) as u64;
        let latest_start = last.timestamp.saturating_sub(span_ms);
        let start_ms = fastrand::Rng::with_seed(seed).u64(0..=latest_start);
        let from = lines.partition_point(|line| line.timestamp < start_ms);
        let to = lines.partition_point(|line| line.timestamp < start_ms + span_ms);
        &lines[from..to]
    }

    fn output_tokens(&self, line: &TraceLine) -> u32 {
        ((line.output_length as f64 * self.output_scale).round() as u32).max(1)
    }

    /// Prompt tokens of a line as replayed.
    pub fn prompt_tokens(&self, line: &TraceLine) -> u64 {
        (line.input_length * u64::from(self.tokens_per_block)).div_ceil(TRACE_BLOCK_TOKENS)
    }

    /// The whole trace's mean prompt and answer tokens as replayed, and the share of prompt
    /// tokens that an earlier request's blocks hold (what an unbounded cache could skip).
    pub fn profile(&self) -> Result<TraceProfile, LabError> {
        let lines = load(self.file)?;
        let count = lines.len().max(1) as f64;
        let mut seen = std::collections::HashSet::new();
        let (mut reusable, mut total) = (0u64, 0u64);
        for line in lines.iter() {
            let held = line
                .hash_ids
                .iter()
                .take_while(|id| seen.contains(*id))
                .count() as u64;
            reusable += (held * TRACE_BLOCK_TOKENS).min(line.input_length);
            total += line.input_length;
            seen.extend(line.hash_ids.iter().copied());
        }
        let span = lines.last().map_or(0, |line| line.timestamp) as f64 / 1000.0;
        Ok(TraceProfile {
            requests_per_second: count / span.max(1.0),
            prompt_tokens: lines.iter().map(|l| self.prompt_tokens(l)).sum::<u64>() as f64 / count,
            output_tokens: lines
                .iter()
                .map(|l| f64::from(self.output_tokens(l)))
                .sum::<f64>()
                / count,
            reusable_share: reusable as f64 / total.max(1) as f64,
        })
    }

    /// One line describing the replay.
    pub fn describe(&self, scale: Scale) -> String {
        format!(
            "{} (`benches/traces/{}`): a window of {:.0} s of the trace, from an offset drawn from the seed, replayed {:.1} × faster; each 512-token block a {}-token text, answers × {}; {}",
            self.about,
            self.file,
            self.window_seconds * scale.users.min(1.0),
            self.speedup * scale.time_compression,
            self.tokens_per_block,
            self.output_scale,
            if self.stream {
                "streamed"
            } else {
                "not streamed"
            },
        )
    }
}

/// A trace's shape as replayed.
#[derive(Debug, Clone, Copy)]
pub struct TraceProfile {
    /// Arrivals per second of trace time.
    pub requests_per_second: f64,
    /// Mean prompt tokens.
    pub prompt_tokens: f64,
    /// Mean answer tokens.
    pub output_tokens: f64,
    /// Share of prompt tokens held by earlier requests' blocks.
    pub reusable_share: f64,
}

/// The text of every block id of one trace, drawn once.
struct BlockTexts {
    file: &'static str,
    tokens_per_block: u32,
    texts: HashMap<u64, String>,
}

impl BlockTexts {
    fn new(file: &'static str, tokens_per_block: u32) -> Self {
        Self {
            file,
            tokens_per_block,
            texts: HashMap::new(),
        }
    }

    /// The prompt of `line`: its blocks' texts, the last one cut to the line's length.
    fn prompt(&mut self, line: &TraceLine) -> String {
        let per_block = u64::from(self.tokens_per_block);
        let tokens = (line.input_length * per_block).div_ceil(TRACE_BLOCK_TOKENS);
        let chars = tokens as usize * super::sim::prompt::CHARS_PER_TOKEN;
        let mut prompt = String::with_capacity(chars);
        for &id in &line.hash_ids {
            if prompt.len() >= chars {
                break;
            }
            let block = self.block(id);
            let take = block.len().min(chars - prompt.len());
            prompt.push_str(&block[..take]);
        }
        prompt
    }

    fn block(&mut self, id: u64) -> &str {
        let seed = self
            .file
            .bytes()
            .fold(id.wrapping_mul(0x9e37_79b9_7f4a_7c15), |hash, byte| {
                (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
            });
        let tokens = self.tokens_per_block;
        self.texts
            .entry(id)
            .or_insert_with(|| text(&mut fastrand::Rng::with_seed(seed), tokens))
    }
}

/// The traces read so far, by file.
type Loaded = Mutex<HashMap<&'static str, Arc<Vec<TraceLine>>>>;

/// The lines of `file` (read and parsed once per process).
pub fn load(file: &'static str) -> Result<Arc<Vec<TraceLine>>, LabError> {
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    let mut loaded = LOADED
        .get_or_init(Mutex::default)
        .lock()
        .expect("trace cache lock");
    if let Some(lines) = loaded.get(file) {
        return Ok(Arc::clone(lines));
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("benches/traces")
        .join(file);
    let reader = BufReader::new(flate2::read::GzDecoder::new(
        std::fs::File::open(&path)
            .map_err(|e| LabError::new(format!("cannot open {}: {e}", path.display())))?,
    ));
    let mut lines = Vec::new();
    for (number, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| LabError::new(format!("{}: {e}", path.display())))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed: TraceLine = serde_json::from_str(&line)
            .map_err(|e| LabError::new(format!("{} line {}: {e}", path.display(), number + 1)))?;
        lines.push(parsed);
    }
    lines.sort_by_key(|line| line.timestamp);
    let lines = Arc::new(lines);
    loaded.insert(file, Arc::clone(&lines));
    Ok(lines)
}
