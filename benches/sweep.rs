//! The physics sweep: the default strategy on replicas it knows nothing about, against the
//! best peers (SMG and the vLLM router `cache_aware`, nginx `least_conn`), draw by draw.
//!
//! ```sh
//! cargo bench --bench sweep                          # draws 0 to 31, seed 1
//! cargo bench --bench sweep -- --draws 8 --first 8   # draws 8 to 15
//! cargo bench --bench sweep -- --strategy 'queued-least-latency:load_bound=1.5'
//! cargo bench --bench sweep -- --merge a --merge b --out ab   # sweeps a and b as one report
//! ```
//!
//! Reports go to `target/bench-sweep/` (`sweep.md`, `sweep.json`, `sweep.svg`, the distribution
//! of the ratios); the markdown is printed at the end. See `docs/lab.md` and `docs/benchmarks.md`.

#[path = "lab/mod.rs"]
mod lab;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// The default strategy against the best peers over random replica physics.
#[derive(Debug, Parser)]
#[command(name = "sweep")]
struct Args {
    /// Draws to run.
    #[arg(long, default_value_t = 32)]
    draws: usize,
    /// The first draw's number.
    #[arg(long, default_value_t = 0)]
    first: usize,
    /// Seed of the draws.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Router peers (repeatable, `NAME` or `NAME:KEY=VALUE,...`); the first is the one measured
    /// (default: the default strategy).
    #[arg(long = "strategy", value_name = "SPEC")]
    strategies: Vec<String>,
    /// Leave the LLM routers out.
    #[arg(long)]
    no_llm_routers: bool,
    /// Run nothing: read the sweeps written to these directories (`sweep.json`, same seed and
    /// peer measured, draws run apart with `--first`) as one report (repeatable).
    #[arg(long, value_name = "DIR")]
    merge: Vec<PathBuf>,
    /// Output directory.
    #[arg(long, default_value = "target/bench-sweep")]
    out: PathBuf,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let out_dir = std::path::absolute(&args.out).unwrap_or(args.out);
    let options = lab::SweepOptions {
        seed: args.seed,
        draws: args.first..args.first + args.draws,
        strategies: args.strategies,
        gateways: !args.no_llm_routers,
        out_dir: out_dir.clone(),
        router_binary: PathBuf::from(env!("CARGO_BIN_EXE_custom-router")),
        command: command_line(),
    };
    let report = if args.merge.is_empty() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        runtime.block_on(lab::run_sweep(&options))
    } else {
        lab::sweep::SweepReport::merged(&args.merge, &options.command, lab::report::utc_now())
    };
    let report = match report {
        Ok(report) => report,
        Err(error) => {
            eprintln!("sweep: {error}");
            return ExitCode::FAILURE;
        }
    };
    let markdown = report.markdown();
    let written = std::fs::create_dir_all(&out_dir)
        .and_then(|()| std::fs::write(out_dir.join("sweep.md"), &markdown))
        .and_then(|()| {
            let json = serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?;
            std::fs::write(out_dir.join("sweep.json"), json)
        });
    if let Err(error) = written {
        eprintln!("sweep: cannot write the report: {error}");
        return ExitCode::FAILURE;
    }
    if let Err(error) = report.write_svg(&out_dir.join("sweep.svg")) {
        eprintln!("sweep: cannot draw the plot: {error}");
        return ExitCode::FAILURE;
    }
    println!("{markdown}");
    ExitCode::SUCCESS
}

/// `cargo bench --bench sweep -- ARGS` with the arguments given (less cargo's `--bench`).
fn command_line() -> String {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| arg != "--bench")
        .collect();
    if args.is_empty() {
        "cargo bench --bench sweep".to_owned()
    } else {
        format!("cargo bench --bench sweep -- {}", args.join(" "))
    }
}
