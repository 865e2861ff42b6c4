//! The benchmark suite: every scenario against every registered strategy, and nginx when it is
//! installed.
//!
//! ```sh
//! cargo bench --bench suite                      # default suite
//! cargo bench --bench suite -- --quick           # short durations
//! cargo bench --bench suite -- --scenario hetero --runs 3 --seed 7
//! ```
//!
//! Reports go to `target/bench/` (`report.md`, `report.json`, one SVG per scenario); the markdown
//! is printed at the end. See `docs/lab.md` and `docs/benchmarks.md`.

#[path = "lab/mod.rs"]
mod lab;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Routing quality and proxy cost of every strategy, side by side.
#[derive(Debug, Parser)]
#[command(name = "suite")]
struct Args {
    /// Short durations (the LLM scenarios 4 times faster, with fewer users).
    #[arg(long)]
    quick: bool,
    /// Tiny durations (what the smoke test runs).
    #[arg(long, conflicts_with = "quick")]
    smoke: bool,
    /// Run only this scenario (repeatable).
    #[arg(long = "scenario", value_name = "NAME")]
    scenarios: Vec<String>,
    /// Run only this strategy (repeatable).
    #[arg(long = "strategy", value_name = "NAME")]
    strategies: Vec<String>,
    /// Leave nginx out even when it is installed.
    #[arg(long)]
    no_nginx: bool,
    /// Leave the LLM routers (SMG, the vLLM router) out.
    #[arg(long)]
    no_llm_routers: bool,
    /// Run only this LLM router and policy (repeatable): `smg:cache_aware`,
    /// `vllm-router:power_of_two`, ...
    #[arg(long = "llm-router", value_name = "ROUTER:POLICY")]
    llm_routers: Vec<String>,
    /// Seed of the first run.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Runs with seeds seed, seed+1, …; the report shows medians.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Router peers write their access log (one JSON line per request) to
    /// `<out>/work/<peer>/access-<scenario>-seed<n>.jsonl`.
    #[arg(long)]
    access_logs: bool,
    /// Output directory.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let options = lab::SuiteOptions {
        mode: if args.smoke {
            lab::Mode::Smoke
        } else if args.quick {
            lab::Mode::Quick
        } else {
            lab::Mode::Default
        },
        scenarios: args.scenarios,
        strategies: args.strategies,
        nginx: !args.no_nginx,
        gateways: !args.no_llm_routers,
        gateway_specs: args.llm_routers,
        seed: args.seed,
        runs: args.runs.max(1),
        // Absolute, because nginx resolves the paths in its configuration against its prefix.
        out_dir: std::path::absolute(&args.out).unwrap_or(args.out),
        router_binary: PathBuf::from(env!("CARGO_BIN_EXE_custom-router")),
        command: command_line(),
        access_logs: args.access_logs,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let started = std::time::Instant::now();
    let report = match runtime.block_on(lab::run_suite(&options)) {
        Ok(report) => report,
        Err(error) => {
            eprintln!("suite: {error}");
            return ExitCode::FAILURE;
        }
    };
    match lab::report::write_all(&report, &options.out_dir) {
        Ok(files) => {
            println!("{}", lab::report::markdown(&report));
            for file in files {
                eprintln!("[bench] wrote {}", file.display());
            }
            eprintln!(
                "[bench] suite took {:.0} s",
                started.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("suite: cannot write the report: {error}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo bench --bench suite -- ARGS` with the arguments given (less cargo's `--bench`).
fn command_line() -> String {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| arg != "--bench")
        .collect();
    if args.is_empty() {
        "cargo bench --bench suite".to_owned()
    } else {
        format!("cargo bench --bench suite -- {}", args.join(" "))
    }
}
