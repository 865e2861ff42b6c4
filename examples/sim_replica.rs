//! A simulated LLM inference replica, run on its own.
//!
//! ```sh
//! cargo run --release --example sim_replica -- --port 8001 --speed 2 --slots 4
//! curl -s localhost:8001/generate -d '{"parameters": {"max_new_tokens": 8}}'
//! curl -sN localhost:8001/generate -d '{"max_tokens": 8, "stream": true}'
//! ```
//!
//! An engine at LLM scale (256 sequences, KV cache, prefix cache, chunked prefill):
//!
//! ```sh
//! cargo run --release --example sim_replica -- --port 8001 --slots 256 --step-ms 20 \
//!     --step-per-batch-ms 0.1 --prefill-ms 0 --prefill-per-token-ms 0.05 \
//!     --kv-capacity-tokens 300000 --prefix-cache-tokens 100000 --token-budget 2048
//! curl -s localhost:8001/metrics
//! ```
//!
//! The timing model and the fault modes are described in `docs/benchmarks.md`. It listens on
//! 127.0.0.1 only and runs until Ctrl-C (or until `--exit-after`).

#[path = "../benches/lab/sim.rs"]
mod sim;

use std::time::Duration;

use clap::Parser;

/// A simulated LLM inference replica (continuous batching, SSE streaming, fault injection).
#[derive(Debug, Parser)]
#[command(name = "sim_replica")]
struct Args {
    /// Port on 127.0.0.1 (0 picks a free one).
    #[arg(long, default_value_t = 8001)]
    port: u16,
    /// Name sent in the x-sim-replica header.
    #[arg(long, default_value = "sim")]
    name: String,
    /// Speed factor: every duration is divided by it.
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Requests decoded at once (continuous batching); more wait in a FIFO.
    #[arg(long, default_value_t = 4)]
    slots: usize,
    /// Prefill (time to first token) in ms at speed 1.
    #[arg(long, default_value_t = 20.0)]
    prefill_ms: f64,
    /// Decode step in ms at speed 1, before the batch term.
    #[arg(long, default_value_t = 2.0)]
    step_ms: f64,
    /// Milliseconds added to each decode step per request in the batch, at speed 1.
    #[arg(long, default_value_t = 0.5)]
    step_per_batch_ms: f64,
    /// Tokens generated when the request names none.
    #[arg(long, default_value_t = 64)]
    default_max_tokens: u32,
    /// Prefill in ms per prompt token not in the prefix cache, at speed 1.
    #[arg(long, default_value_t = 0.0)]
    prefill_per_token_ms: f64,
    /// KV cache tokens running requests may reserve together (prompt + max_tokens each); more
    /// wait. Unset: no limit but the slots.
    #[arg(long)]
    kv_capacity_tokens: Option<u64>,
    /// Tokens the prefix cache holds (0: none).
    #[arg(long, default_value_t = 0)]
    prefix_cache_tokens: u64,
    /// Tokens per prefix-cache block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u32,
    /// Stepped batching with chunked prefill: tokens per engine step (decodes plus prompt
    /// chunks). Unset: each request times its own steps.
    #[arg(long)]
    token_budget: Option<u32>,
    /// Seed of the fault draws.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// OpenAI answers carry `usage` (prompt, completion and cached prompt tokens).
    #[arg(long)]
    usage: bool,
    /// Time every step as if every slot were decoding (a lone request takes a full batch's time).
    #[arg(long)]
    full_batch: bool,
    /// Fraction (0..=1) of requests answered 500.
    #[arg(long, default_value_t = 0.0)]
    fail_fraction: f64,
    /// Milliseconds before a failing request's 500 (0: at once).
    #[arg(long, default_value_t = 0.0)]
    fail_delay_ms: f64,
    /// Answer 429/503 with Retry-After once this many requests wait for a slot.
    #[arg(long)]
    queue_limit: Option<usize>,
    /// Status used by --queue-limit: 429 or 503.
    #[arg(long, default_value_t = 429, value_parser = parse_reject_status)]
    reject_status: u16,
    /// Fraction (0..=1) of requests never answered.
    #[arg(long, default_value_t = 0.0)]
    hang_fraction: f64,
    /// Close the connection after this many tokens of each answer.
    #[arg(long)]
    close_after_tokens: Option<u32>,
    /// Stop listening and drop every connection after this many seconds.
    #[arg(long)]
    exit_after: Option<f64>,
}

fn parse_reject_status(text: &str) -> Result<u16, String> {
    match text.parse::<u16>() {
        Ok(status @ (429 | 503)) => Ok(status),
        _ => Err("expected 429 or 503".to_owned()),
    }
}

impl Args {
    fn into_config(self) -> sim::SimConfig {
        sim::SimConfig {
            name: self.name,
            port: self.port,
            speed: self.speed,
            slots: self.slots,
            prefill_ms: self.prefill_ms,
            step_ms: self.step_ms,
            step_per_batch_ms: self.step_per_batch_ms,
            default_max_tokens: self.default_max_tokens,
            prefill_per_token_ms: self.prefill_per_token_ms,
            kv_capacity_tokens: self.kv_capacity_tokens,
            prefix_cache_tokens: self.prefix_cache_tokens,
            block_tokens: self.block_tokens.max(1),
            batching: match self.token_budget {
                Some(token_budget) => sim::Batching::Stepped {
                    token_budget: token_budget.max(1),
                },
                None => sim::Batching::PerRequest,
            },
            seed: self.seed,
            faults: sim::Faults {
                fail_fraction: self.fail_fraction,
                fail_delay_ms: self.fail_delay_ms,
                queue_limit: self.queue_limit,
                reject_status: self.reject_status,
                hang_fraction: self.hang_fraction,
                close_after_tokens: self.close_after_tokens,
                exit_after: self.exit_after.map(Duration::from_secs_f64),
            },
            usage: self.usage,
            full_batch: self.full_batch,
            pooled_prefix_cache: false,
            shared_cache: None,
        }
    }
}

#[tokio::main]
async fn main() {
    let config = Args::parse().into_config();
    let model = match config.batching {
        sim::Batching::PerRequest if config.prefill_per_token_ms == 0.0 => format!(
            "about {:.1} req/s of {} tokens with every slot busy",
            config.capacity(f64::from(config.default_max_tokens)),
            config.default_max_tokens
        ),
        sim::Batching::PerRequest => "per-request batching".to_owned(),
        sim::Batching::Stepped { token_budget } => {
            format!("stepped batching, {token_budget} tokens per step")
        }
    };
    let replica = match sim::spawn(config.clone()).await {
        Ok(replica) => replica,
        Err(error) => {
            eprintln!(
                "sim_replica: cannot listen on 127.0.0.1:{}: {error}",
                config.port
            );
            std::process::exit(1);
        }
    };
    println!(
        "sim_replica {} listening on http://{} (speed {}, {} slots; {model})",
        replica.name, replica.addr, config.speed, config.slots
    );
    tokio::select! {
        _ = tokio::signal::ctrl_c() => replica.stop(),
        _ = replica.stopped() => println!("sim_replica {}: exited as configured", replica.name),
    }
}
