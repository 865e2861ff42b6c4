//! The physics sweep: replicas the router knows nothing about.
//!
//! Each draw sets the replicas' physics from wide ranges and runs one workload on them against
//! every peer, once:
//!
//! - engines of 4 to 256 sequences (log-uniform), a KV cache for 0.6 to 1.5 times their
//!   sequences' typical requests, a prefix cache of 20,000 to 2,000,000 tokens (log-uniform);
//! - prefill of 50 to 500 µs per uncached prompt token; decode steps of 12 to 35 ms growing to
//!   1.15 to 2.5 times that with every sequence busy; chunked prefill of 512 to 4,096 tokens a
//!   step;
//! - replicas of one speed, or each of its own (0.5 to 2 times);
//! - answers streamed or not (a whole answer's head comes at its end), with or without
//!   OpenAI's `usage` (cached prompt tokens included);
//! - one workload in turn: multi-tenant chat (tenants' system prompts, multi-turn users), the
//!   Mooncake conversation trace, the Mooncake synthetic trace, long documents among chats;
//!   offered at 50 to 90 % of what a simple model of the replicas says they can finish.
//!
//! The SLO of a draw follows its physics: the first token within 1 s plus three times the
//! prompt's prefill on the slowest replica, then 1.5 times a full batch's step per token. The
//! result of a draw is the default's p50, p99 and goodput within the SLO over the best peer's
//! (the best of SMG `cache_aware`, the vLLM router `cache_aware` and nginx `least_conn`, each
//! number on its own); the report gives every draw and the distribution.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use super::load::Lengths;
use super::peer::PeerSpec;
use super::scenarios::{Kind, PeerOutcome, Replica, ReplicaFault, Routing, Scenario, Traffic};
use super::sim::{Batching, SimConfig};
use super::summary::{Metrics, Slo};
use super::trace::Trace;
use super::workload::{Chat, Documents, Workload};
use super::{LabError, Mode};

/// Seconds of arrivals in every draw, in the draw's own time (a draw runs compressed, see
/// [`Draw::compression`]).
const ARRIVAL_SECONDS: f64 = 60.0;

/// Token events a second the machine can carry through a peer and the load generator: streamed
/// draws with more sequences than this allows run fewer replicas, and less compressed.
const EVENT_BUDGET: f64 = 8_000.0;

/// How much faster than real time a draw runs at most: replicas, arrivals, think times and the
/// SLO together, so that a draw's physics and its results hold as drawn.
const MAX_COMPRESSION: f64 = 3.0;

/// The workloads a draw runs, in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Family {
    /// Tenants' system prompts, multi-turn users.
    MultiTenant,
    /// The Mooncake conversation trace.
    TraceConversation,
    /// The Mooncake synthetic trace.
    TraceSynthetic,
    /// Long documents among short chats.
    LongContext,
}

impl Family {
    const ALL: [Family; 4] = [
        Family::MultiTenant,
        Family::TraceConversation,
        Family::TraceSynthetic,
        Family::LongContext,
    ];

    fn name(self) -> &'static str {
        match self {
            Family::MultiTenant => "multi-tenant",
            Family::TraceConversation => "trace-conversation",
            Family::TraceSynthetic => "trace-synthetic",
            Family::LongContext => "long-context",
        }
    }
}

/// One draw of physics and workload.
#[derive(Debug, Clone, Serialize)]
pub struct Draw {
    /// Its number.
    pub index: usize,
    /// Its workload.
    pub family: Family,
    /// Replicas.
    pub replicas: usize,
    /// Sequences per replica.
    pub slots: usize,
    /// KV cache tokens per replica.
    pub kv_tokens: u64,
    /// Prefix cache tokens per replica.
    pub prefix_cache_tokens: u64,
    /// Prefill µs per uncached prompt token.
    pub prefill_us_per_token: f64,
    /// Decode step ms with one sequence.
    pub step_ms: f64,
    /// A full batch's step over one sequence's.
    pub full_batch_factor: f64,
    /// Chunked prefill tokens a step.
    pub token_budget: u32,
    /// Each replica's speed.
    pub speeds: Vec<f64>,
    /// Whether answers are streamed.
    pub stream: bool,
    /// Whether answers carry `usage`.
    pub usage: bool,
    /// Offered load over the modelled capacity.
    pub load: f64,
    /// How much faster than real time it runs (what the report shows is in real time: the
    /// replicas' physics as drawn, latencies times this).
    pub compression: f64,
    /// The SLO.
    pub slo: Slo,
    #[serde(skip)]
    routing: Routing,
}

/// Typical prompt and answer tokens of a family, and the share of prompt tokens a cache can
/// be expected to skip (a guess for the capacity model, not a measurement).
fn family_shape(family: Family) -> (f64, f64, f64) {
    match family {
        Family::MultiTenant => (3_000.0, 150.0, 0.6),
        Family::TraceConversation => trace_shape(&conversation(1.0, true)),
        Family::TraceSynthetic => trace_shape(&synthetic(1.0, true)),
        Family::LongContext => (3_300.0, 200.0, 0.0),
    }
}

fn trace_shape(trace: &Trace) -> (f64, f64, f64) {
    let profile = trace.profile().expect("the traces are in the repository");
    (
        profile.prompt_tokens,
        profile.output_tokens,
        0.5 * profile.reusable_share,
    )
}

fn conversation(speedup: f64, stream: bool) -> Trace {
    Trace {
        file: "conversation_trace.jsonl.gz",
        about: "Mooncake conversation trace",
        window_seconds: ARRIVAL_SECONDS * speedup,
        speedup,
        tokens_per_block: 128,
        output_scale: 0.25,
        stream,
    }
}

fn synthetic(speedup: f64, stream: bool) -> Trace {
    Trace {
        file: "synthetic_trace.jsonl.gz",
        about: "Mooncake synthetic trace",
        window_seconds: ARRIVAL_SECONDS * speedup,
        speedup,
        tokens_per_block: 128,
        output_scale: 0.25,
        stream,
    }
}

/// Draw `index` of the sweep with `seed`.
pub fn draw(seed: u64, index: usize) -> Draw {
    let mut rng =
        fastrand::Rng::with_seed(seed.wrapping_mul(0x9e37_79b9).wrapping_add(index as u64));
    let family = Family::ALL[index % Family::ALL.len()];
    let log_uniform =
        |rng: &mut fastrand::Rng, low: f64, high: f64| low * (high / low).powf(rng.f64());
    let uniform = |rng: &mut fastrand::Rng, low: f64, high: f64| low + (high - low) * rng.f64();
    let slots = log_uniform(&mut rng, 4.0, 256.0).round() as usize;
    let prefix_cache_tokens = log_uniform(&mut rng, 20_000.0, 2_000_000.0) as u64;
    let prefill_us_per_token = uniform(&mut rng, 50.0, 500.0);
    let step_ms = uniform(&mut rng, 12.0, 35.0);
    let full_batch_factor = uniform(&mut rng, 1.15, 2.5);
    let token_budget = [512, 1_024, 2_048, 4_096][rng.usize(0..4)];
    let mixed_speeds = rng.bool();
    let mut stream = rng.f64() < 0.7;
    let usage = rng.bool();
    let load = uniform(&mut rng, 0.5, 0.9);
    let kv_share = uniform(&mut rng, 0.6, 1.5);
    let (prompt, output, reuse) = family_shape(family);
    // The KV cache: for kv_share of the sequences' typical requests, and at least four of the
    // longest prompts the family sends (32k tokens), so that none is refused.
    let kv_tokens = ((slots as f64 * (prompt + output) * kv_share) as u64).max(140_000);
    let concurrent = (slots as f64).min(kv_tokens as f64 / (prompt + output));
    let mut replicas = 3 + rng.usize(0..=2);
    let mut compression = MAX_COMPRESSION;
    if stream {
        let step_s = step_ms * full_batch_factor / 1000.0;
        let per_replica = concurrent * load / step_s;
        replicas = replicas.min((EVENT_BUDGET / per_replica).floor() as usize);
        if replicas < 2 {
            replicas = 2;
            stream = per_replica * 2.0 <= EVENT_BUDGET;
        }
        if stream {
            let events = per_replica * replicas as f64;
            compression = (EVENT_BUDGET / events).clamp(1.0, MAX_COMPRESSION);
        }
    }
    let speeds: Vec<f64> = (0..replicas)
        .map(|_| {
            if mixed_speeds {
                log_uniform(&mut rng, 0.5, 2.0)
            } else {
                1.0
            }
        })
        .collect();
    let step_per_batch_ms = step_ms * (full_batch_factor - 1.0) / slots as f64;
    let engine = SimConfig {
        slots,
        prefill_ms: 0.0,
        step_ms,
        step_per_batch_ms,
        prefill_per_token_ms: prefill_us_per_token / 1000.0,
        kv_capacity_tokens: Some(kv_tokens),
        prefix_cache_tokens,
        block_tokens: 16,
        batching: Batching::Stepped { token_budget },
        default_max_tokens: 256,
        usage,
        ..SimConfig::default()
    };
    // What the replicas can finish a second: per replica, a typical request's uncached prefill
    // plus its share of a full batch's decode steps.
    let batch = concurrent.max(1.0);
    let capacity: f64 = speeds
        .iter()
        .map(|speed| {
            let step_s = (step_ms + step_per_batch_ms * batch) / 1000.0 / speed;
            let prefill_s = prompt * (1.0 - reuse) * prefill_us_per_token / 1e6 / speed;
            1.0 / (prefill_s + output * step_s / batch)
        })
        .sum();
    let rate = load * capacity;
    let workload = match family {
        Family::MultiTenant => {
            let turns = 2 + rng.u32(0..=3);
            let tenants = 16 + rng.usize(0..=24);
            // Users start within the arrival window and each takes `turns` turns, a think time
            // and an answer apart (about 4 s): that many requests over the window and the turns.
            let span = ARRIVAL_SECONDS + f64::from(turns) * 4.0;
            let users = (rate * span / f64::from(turns)).round() as usize;
            Workload::Chat(Chat {
                tenants,
                users_per_tenant: (users / tenants).max(1),
                shared_preamble_tokens: 500,
                tenant_prompt_tokens: (1_000, 4_000),
                turns: (turns, turns),
                question_tokens: Lengths::LogNormal {
                    median: 60.0,
                    sigma: 0.7,
                    min: 10,
                    max: 400,
                },
                answer_tokens: Lengths::LogNormal {
                    median: 150.0,
                    sigma: 0.5,
                    min: 30,
                    max: 600,
                },
                think_seconds: (1.0, 4.0),
                start_within: ARRIVAL_SECONDS,
                session_header: false,
                stream,
            })
        }
        Family::TraceConversation | Family::TraceSynthetic => {
            let base = if family == Family::TraceConversation {
                conversation(1.0, stream)
            } else {
                synthetic(1.0, stream)
            };
            let trace_rate = base.profile().expect("trace").requests_per_second;
            let speedup = (rate / trace_rate).max(0.25);
            Workload::Trace(if family == Family::TraceConversation {
                conversation(speedup, stream)
            } else {
                synthetic(speedup, stream)
            })
        }
        Family::LongContext => Workload::Documents(Documents {
            rate,
            duration: ARRIVAL_SECONDS,
            long_fraction: 0.25,
            long_prompt_tokens: (2_000, 16_000),
            short_prompt_tokens: (100, 1_000),
            answer_tokens: Lengths::LogNormal {
                median: 200.0,
                sigma: 0.5,
                min: 50,
                max: 1_000,
            },
            stream,
        }),
    };
    let slowest = speeds.iter().copied().fold(f64::INFINITY, f64::min);
    let slo = Slo {
        ttft_seconds: 1.0,
        ttft_seconds_per_prompt_token: 3.0 * prefill_us_per_token / 1e6 / slowest,
        tpot_seconds: 1.5 * (step_ms + step_per_batch_ms * slots as f64) / 1000.0 / slowest,
    };
    let routing = Routing {
        replicas: speeds
            .iter()
            .enumerate()
            .map(|(i, &speed)| Replica {
                name: format!("r{}", i + 1),
                speed,
                fault: ReplicaFault::None,
            })
            .collect(),
        engine,
        initial_backends: replicas,
        scale_up_after: None,
        traffic: Traffic::Users(workload),
        slo,
        reports_overload: false,
        seed_of: None,
        classifier: None,
        compression,
    };
    Draw {
        index,
        family,
        replicas,
        slots,
        kv_tokens,
        prefix_cache_tokens,
        prefill_us_per_token,
        step_ms,
        full_batch_factor,
        token_budget,
        speeds,
        stream,
        usage,
        load,
        compression,
        slo,
        routing,
    }
}

impl Draw {
    /// The draw as a scenario of its own.
    pub fn scenario(&self) -> Scenario {
        Scenario {
            name: Box::leak(format!("sweep-{:02}", self.index).into_boxed_str()),
            models: Box::leak(self.describe().into_boxed_str()),
            kind: Kind::Routing(Box::new(self.routing.clone())),
        }
    }

    /// One line: the physics and the workload.
    pub fn describe(&self) -> String {
        let speeds = if self.speeds.iter().all(|&s| s == 1.0) {
            "equal".to_owned()
        } else {
            self.speeds
                .iter()
                .map(|s| format!("{s:.2}"))
                .collect::<Vec<_>>()
                .join("/")
        };
        format!(
            "{} at {:.0} % load; {} × {} seqs, KV {}k, prefix cache {}k, prefill {:.0} µs/tok, step {:.0} ms × {:.2} full, budget {}, speeds {speeds}, {}, {}; run {:.1} × faster",
            self.family.name(),
            self.load * 100.0,
            self.replicas,
            self.slots,
            self.kv_tokens / 1000,
            self.prefix_cache_tokens / 1000,
            self.prefill_us_per_token,
            self.step_ms,
            self.full_batch_factor,
            self.token_budget,
            if self.stream { "streamed" } else { "whole" },
            if self.usage { "usage" } else { "no usage" },
            self.compression,
        )
    }
}

/// The peers a draw's result is set against.
pub const BEST_PEERS: [&str; 3] = [
    "smg-cache-aware",
    "vllm-router-cache-aware",
    "nginx-least-conn",
];

/// A draw's numbers for every peer, and the default's ratios to the best peer.
#[derive(Debug, Clone, Serialize)]
pub struct DrawResult {
    /// The draw.
    pub draw: Draw,
    /// Each peer's numbers (or why it has none).
    pub peers: Vec<(String, Result<Metrics, String>)>,
    /// The default's p50 over the best peer's.
    pub p50_ratio: Option<f64>,
    /// The default's p99 over the best peer's.
    pub p99_ratio: Option<f64>,
    /// The default's goodput within the SLO over the best peer's.
    pub goodput_ratio: Option<f64>,
}

impl DrawResult {
    /// The result of `outcomes` for `draw`, `default` the peer measured against the others.
    pub fn of(draw: Draw, outcomes: Vec<PeerOutcome>, default: &str) -> Self {
        // Back to the draw's real time: it ran `compression` times faster.
        let real_time = |mut metrics: Metrics| {
            for (key, value) in &mut metrics {
                if key.ends_with("_s") || key.contains("_s.") {
                    *value *= draw.compression;
                } else if key.ends_with("_rps") {
                    *value /= draw.compression;
                }
            }
            metrics
        };
        let peers: Vec<(String, Result<Metrics, String>)> = outcomes
            .into_iter()
            .map(|(name, outcome)| (name, outcome.map(|run| real_time(run.metrics))))
            .collect();
        let metric = |name: &str, key: &str| -> Option<f64> {
            let (_, outcome) = peers.iter().find(|(peer, _)| peer == name)?;
            outcome.as_ref().ok()?.get(key).copied()
        };
        let best = |key: &str, lowest: bool| -> Option<f64> {
            let values = BEST_PEERS.iter().filter_map(|peer| metric(peer, key));
            if lowest {
                values.reduce(f64::min)
            } else {
                values.reduce(f64::max)
            }
        };
        let ratio = |key: &str, lowest: bool| -> Option<f64> {
            Some(metric(default, key)? / best(key, lowest)?.max(1e-9))
        };
        Self {
            p50_ratio: ratio("latency_p50_s", true),
            p99_ratio: ratio("latency_p99_s", true),
            goodput_ratio: ratio("slo_goodput_rps", false),
            draw,
            peers,
        }
    }

    /// A draw's result as `sweep.json` holds it, its physics drawn again from `seed` and its
    /// number (a metric written as `null`, not a number, is left out).
    fn read(seed: u64, written: WrittenDraw) -> Self {
        let peers = written
            .peers
            .into_iter()
            .map(|(name, outcome)| {
                let outcome = outcome.map(|metrics| {
                    metrics
                        .into_iter()
                        .filter_map(|(key, value)| Some((key, value?)))
                        .collect()
                });
                (name, outcome)
            })
            .collect();
        Self {
            draw: draw(seed, written.draw.index),
            peers,
            p50_ratio: written.p50_ratio,
            p99_ratio: written.p99_ratio,
            goodput_ratio: written.goodput_ratio,
        }
    }
}

/// A `sweep.json` as the sweep writes it ([`SweepReport`]), read back by
/// [`SweepReport::merged`].
#[derive(Deserialize)]
struct WrittenSweep {
    command: String,
    seed: u64,
    default: String,
    draws: Vec<WrittenDraw>,
}

/// A [`DrawResult`] as `sweep.json` holds it: the draw by its number only.
#[derive(Deserialize)]
struct WrittenDraw {
    draw: WrittenIndex,
    peers: Vec<(String, Result<WrittenMetrics, String>)>,
    p50_ratio: Option<f64>,
    p99_ratio: Option<f64>,
    goodput_ratio: Option<f64>,
}

/// A peer's numbers as `sweep.json` holds them: a number that was not finite is `null`.
type WrittenMetrics = std::collections::BTreeMap<String, Option<f64>>;

/// A draw's number, as `sweep.json` holds it.
#[derive(Deserialize)]
struct WrittenIndex {
    index: usize,
}

/// The whole sweep.
#[derive(Debug, Serialize)]
pub struct SweepReport {
    /// How it was started.
    pub command: String,
    /// When (UTC).
    pub date_utc: String,
    /// The seed of the draws.
    pub seed: u64,
    /// The peer measured.
    pub default: String,
    /// Every draw.
    pub draws: Vec<DrawResult>,
}

impl SweepReport {
    /// The sweeps written to `dirs` (each one's `sweep.json`) read as one report, its draws in
    /// order: draws run apart (`--first`) are one sweep when they share the seed and the peer
    /// measured. Each draw's physics is drawn again from the seed and its number; the peers'
    /// numbers and the ratios are read as written.
    pub fn merged(
        dirs: &[std::path::PathBuf],
        command: &str,
        date_utc: String,
    ) -> Result<Self, LabError> {
        let mut commands = Vec::new();
        let mut seed_and_default: Option<(u64, String)> = None;
        let mut draws: Vec<DrawResult> = Vec::new();
        for dir in dirs {
            let path = dir.join("sweep.json");
            let at =
                |what: &dyn std::fmt::Display| LabError::new(format!("{}: {what}", path.display()));
            let text = std::fs::read_to_string(&path).map_err(|error| at(&error))?;
            let sweep: WrittenSweep = serde_json::from_str(&text).map_err(|error| at(&error))?;
            let (seed, default) = (sweep.seed, sweep.default);
            match &seed_and_default {
                None => seed_and_default = Some((seed, default)),
                Some(first) if first.0 == seed && first.1 == default => {}
                Some((first_seed, first_default)) => {
                    return Err(at(&format!(
                        "seed {seed} and peer `{default}`, where the first sweep has seed {first_seed} and `{first_default}`"
                    )));
                }
            }
            commands.push(sweep.command);
            draws.extend(
                sweep
                    .draws
                    .into_iter()
                    .map(|written| DrawResult::read(seed, written)),
            );
        }
        let Some((seed, default)) = seed_and_default else {
            return Err(LabError::new("no sweep to merge"));
        };
        draws.sort_by_key(|result| result.draw.index);
        if let Some(twice) = draws
            .windows(2)
            .find(|pair| pair[0].draw.index == pair[1].draw.index)
        {
            return Err(LabError::new(format!(
                "draw {} is in two sweeps",
                twice[0].draw.index
            )));
        }
        commands.push(command.to_owned());
        Ok(Self {
            command: commands.join("; "),
            date_utc,
            seed,
            default,
            draws,
        })
    }

    /// The markdown report: the distribution, then every draw.
    pub fn markdown(&self) -> String {
        let mut text = String::new();
        let _ = writeln!(
            text,
            "# Physics sweep\n\n- command: `{}`\n- date: {} UTC, seed {}\n- ratios: `{}` over the best of {} (each number on its own; p50 and p99 lower is better, goodput within the SLO higher is better)\n",
            self.command,
            self.date_utc,
            self.seed,
            self.default,
            BEST_PEERS.join(", "),
        );
        let mut summary = |name: &str, values: Vec<f64>, better_low: bool| {
            if values.is_empty() {
                return;
            }
            let mut sorted = values.clone();
            sorted.sort_by(f64::total_cmp);
            let within = values
                .iter()
                .filter(|&&v| if better_low { v <= 1.0 } else { v >= 1.0 })
                .count();
            let _ = writeln!(
                text,
                "- {name}: {within} of {} draws {} 1.0; median {:.2}, worst {:.2}",
                values.len(),
                if better_low { "≤" } else { "≥" },
                sorted[sorted.len() / 2],
                if better_low {
                    sorted[sorted.len() - 1]
                } else {
                    sorted[0]
                },
            );
        };
        summary(
            "p50 ratio",
            self.draws.iter().filter_map(|d| d.p50_ratio).collect(),
            true,
        );
        summary(
            "p99 ratio",
            self.draws.iter().filter_map(|d| d.p99_ratio).collect(),
            true,
        );
        summary(
            "goodput ratio",
            self.draws.iter().filter_map(|d| d.goodput_ratio).collect(),
            false,
        );
        let _ = writeln!(
            text,
            "\n| draw | physics and workload | p50 ÷ best | p99 ÷ best | goodput ÷ best | p50 s / p99 s / in SLO % per peer |\n|---|---|---|---|---|---|"
        );
        for result in &self.draws {
            let peers: Vec<String> = result
                .peers
                .iter()
                .map(|(name, outcome)| match outcome {
                    Ok(m) => format!(
                        "{name} {:.2} / {:.2} / {:.0}",
                        m.get("latency_p50_s").copied().unwrap_or(f64::NAN),
                        m.get("latency_p99_s").copied().unwrap_or(f64::NAN),
                        m.get("slo_pct").copied().unwrap_or(f64::NAN)
                    ),
                    Err(error) => format!("{name} failed: {}", error.lines().next().unwrap_or("")),
                })
                .collect();
            let shown = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.2}"));
            let _ = writeln!(
                text,
                "| {} | {} | {} | {} | {} | {} |",
                result.draw.index,
                result.draw.describe(),
                shown(result.p50_ratio),
                shown(result.p99_ratio),
                shown(result.goodput_ratio),
                peers.join("; ")
            );
        }
        text
    }

    /// The distribution of the ratios, sorted (a CDF), as an SVG.
    pub fn write_svg(&self, path: &Path) -> Result<(), LabError> {
        let series: [(&str, Vec<f64>, RGBColor); 3] = [
            (
                "p50 ÷ best peer",
                self.draws.iter().filter_map(|d| d.p50_ratio).collect(),
                RGBColor(31, 119, 180),
            ),
            (
                "p99 ÷ best peer",
                self.draws.iter().filter_map(|d| d.p99_ratio).collect(),
                RGBColor(214, 39, 40),
            ),
            (
                "best peer's goodput ÷ default's",
                self.draws
                    .iter()
                    .filter_map(|d| d.goodput_ratio.map(|g| 1.0 / g.max(1e-9)))
                    .collect(),
                RGBColor(44, 160, 44),
            ),
        ];
        let highest = series
            .iter()
            .flat_map(|(_, values, _)| values.iter().copied())
            .fold(1.3_f64, f64::max)
            .min(4.0);
        let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
        let draw_error = |e: &dyn std::fmt::Display| LabError::new(format!("plot: {e}"));
        root.fill(&WHITE).map_err(|e| draw_error(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "Physics sweep: the default against the best peer, per draw",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0_f64..1.0_f64, 0.0_f64..highest)
            .map_err(|e| draw_error(&e))?;
        chart
            .configure_mesh()
            .x_desc("share of draws")
            .y_desc("ratio (below 1: the default is better)")
            .draw()
            .map_err(|e| draw_error(&e))?;
        for bound in [1.0, 1.2] {
            chart
                .draw_series(LineSeries::new(
                    [(0.0, bound), (1.0, bound)],
                    BLACK.mix(if bound == 1.0 { 0.6 } else { 0.3 }),
                ))
                .map_err(|e| draw_error(&e))?;
        }
        for (label, values, colour) in series {
            let mut sorted = values;
            sorted.sort_by(f64::total_cmp);
            let count = sorted.len().max(1) as f64;
            let points: Vec<(f64, f64)> = sorted
                .iter()
                .enumerate()
                .flat_map(|(i, &v)| {
                    let v = v.min(highest);
                    [(i as f64 / count, v), ((i + 1) as f64 / count, v)]
                })
                .collect();
            chart
                .draw_series(LineSeries::new(points, colour.stroke_width(2)))
                .map_err(|e| draw_error(&e))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| draw_error(&e))?;
        root.present().map_err(|e| draw_error(&e))?;
        Ok(())
    }
}

/// The peers of a sweep: `strategies` (router peers), nginx least_conn and the LLM routers'
/// `cache_aware`.
pub fn describe_peers(peers: &[PeerSpec]) -> String {
    peers
        .iter()
        .map(PeerSpec::name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The mode every draw runs in (real time, full size).
pub const MODE: Mode = Mode::Default;
