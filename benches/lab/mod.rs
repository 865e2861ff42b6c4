//! The benchmark lab: simulated LLM replicas, a load generator, scenarios run against every
//! registered strategy (and nginx when it is installed), and reports in markdown, JSON and SVG.
//!
//! - [`sim`]: the simulated replica (also `examples/sim_replica.rs`).
//! - [`load`]: open-loop Poisson, closed-loop and users load, one record per request.
//! - [`workload`]: LLM chat workloads (tenants' multi-turn users, long documents), and
//!   [`trace`]: production traces replayed with their real prefix structure.
//! - [`scenarios`]: what each scenario sets up and how it is run against a peer.
//! - [`peer`], [`router`], [`nginx`], [`gateways`]: the router binary, nginx and the LLM routers
//!   (SMG, the vLLM router, installed by the bench at pinned versions) as child processes.
//! - [`report`]: numbers, tables, JSON and CDF plots.
//!
//! [`run_sweep`] runs the physics sweep ([`sweep`]) against the default and the best peers.
//!
//! [`run_suite`] runs everything; `benches/suite.rs` is its command line and
//! `tests/bench_smoke.rs` runs it in smoke mode. See `docs/lab.md` and `docs/benchmarks.md`.
#![allow(dead_code)]

pub mod gateways;
pub mod load;
pub mod nginx;
pub mod peer;
pub mod report;
pub mod requests;
pub mod router;
pub mod scenarios;
pub mod sim;
pub mod summary;
pub mod sweep;
pub mod trace;
pub mod workload;

use std::path::{Path, PathBuf};
use std::time::Duration;

use custom_router::strategies::REGISTRY;

use self::gateways::GatewaySpec;
use self::nginx::Balance;
use self::peer::{PeerSpec, StrategySpec};

/// The reference implementation's rules, run beside the registered strategies by default.
pub const REFERENCE_RULES: &str = "queued-least-latency:score=ewma";
use self::report::SuiteReport;
use self::scenarios::{Kind, PeerOutcome, RunContext, Scenario};

/// An error of the lab, as text.
#[derive(Debug)]
pub struct LabError(String);

impl LabError {
    /// An error saying `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

impl std::fmt::Display for LabError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LabError {}

impl From<std::io::Error> for LabError {
    fn from(error: std::io::Error) -> Self {
        Self(error.to_string())
    }
}

/// How long the suite runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The durations of `scenarios.rs`.
    Default,
    /// 12% of them.
    Quick,
    /// A twenty-fifth, for the smoke test.
    Smoke,
}

impl Mode {
    /// Multiplies every scenario duration.
    pub fn time_scale(self) -> f64 {
        match self {
            Mode::Default => 1.0,
            Mode::Quick => 0.12,
            Mode::Smoke => 0.04,
        }
    }

    /// How long requests still running after the last arrival may take.
    pub fn drain_limit(self) -> Duration {
        match self {
            Mode::Default => Duration::from_secs(60),
            Mode::Quick => Duration::from_secs(30),
            Mode::Smoke => Duration::from_secs(10),
        }
    }

    /// How much faster than real time the LLM scenarios run (their replicas are that much
    /// faster, their users' times that much shorter).
    pub fn time_compression(self) -> f64 {
        match self {
            Mode::Default => 1.0,
            Mode::Quick => 4.0,
            Mode::Smoke => 50.0,
        }
    }

    /// The fraction of the LLM scenarios' users that take part (at least one per tenant).
    pub fn user_fraction(self) -> f64 {
        match self {
            Mode::Default => 1.0,
            Mode::Quick => 0.12,
            Mode::Smoke => 0.04,
        }
    }

    /// `default`, `quick` or `smoke`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Default => "default",
            Mode::Quick => "quick",
            Mode::Smoke => "smoke",
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    /// Durations.
    pub mode: Mode,
    /// Scenario names to run; empty runs all.
    pub scenarios: Vec<String>,
    /// Strategy names to run; empty runs every registered one.
    pub strategies: Vec<String>,
    /// Whether nginx takes part when it is installed.
    pub nginx: bool,
    /// The LLM routers that take part (`smg:POLICY`, `vllm-router:POLICY`); empty with
    /// `gateways` on: every one of [`GatewaySpec::defaults`].
    pub gateway_specs: Vec<String>,
    /// Whether the LLM routers take part (installed on first use; left out, with a note, when
    /// they cannot be installed).
    pub gateways: bool,
    /// The seed of the first run; run `i` uses `seed + i`.
    pub seed: u64,
    /// Runs, each with its own seed; numbers are medians over the runs.
    pub runs: usize,
    /// Where reports and peer files go.
    pub out_dir: PathBuf,
    /// The router executable.
    pub router_binary: PathBuf,
    /// The command line shown in the report.
    pub command: String,
    /// Whether router peers write access logs to `out_dir/work/<peer>/`.
    pub access_logs: bool,
}

/// Runs the selected scenarios against every selected peer and returns the report (not yet
/// written; see [`report::write_all`]).
pub async fn run_suite(options: &SuiteOptions) -> Result<SuiteReport, LabError> {
    let scenarios = selected_scenarios(&options.scenarios)?;
    let nginx_binary = if options.nginx {
        nginx::find_nginx()
    } else {
        None
    };
    let mut peers = peer_specs(&options.strategies, nginx_binary.as_deref())?;
    let gateway_versions = if options.gateways {
        add_gateways(&mut peers, &options.gateway_specs, &options.out_dir)?
    } else {
        None
    };
    let work_dir = options.out_dir.join("work");
    std::fs::create_dir_all(&work_dir)?;
    let seeds: Vec<u64> = (0..options.runs.max(1) as u64)
        .map(|run| options.seed.wrapping_add(run))
        .collect();
    let mut reports = Vec::new();
    for scenario in &scenarios {
        let mut runs = Vec::new();
        for &seed in &seeds {
            let context = RunContext {
                mode: options.mode,
                seed,
                router_binary: &options.router_binary,
                work_dir: &work_dir,
                access_logs: options.access_logs,
            };
            let outcomes = scenario.run(&peers, context).await;
            print_progress(scenario.name, seed, &outcomes);
            runs.push(outcomes);
        }
        let setup = describe(scenario, options.mode);
        reports.push(report::aggregate(scenario, options.mode, setup, runs));
    }
    Ok(SuiteReport {
        mode: options.mode.name().to_owned(),
        command: options.command.clone(),
        date_utc: report::utc_now(),
        seeds,
        machine: report::machine(
            nginx_binary.as_deref().map(nginx::version),
            gateway_versions,
        ),
        scenarios: reports,
    })
}

/// The scenarios named in `names` (all when empty), in report order.
pub fn selected_scenarios(names: &[String]) -> Result<Vec<Scenario>, LabError> {
    let all = scenarios::all();
    for name in names {
        if !all.iter().any(|scenario| scenario.name == name) {
            let known: Vec<&str> = all.iter().map(|s| s.name).collect();
            return Err(LabError::new(format!(
                "unknown scenario {name:?}; known: {}",
                known.join(", ")
            )));
        }
    }
    Ok(all
        .into_iter()
        .filter(|scenario| names.is_empty() || names.iter().any(|n| n == scenario.name))
        .collect())
}

/// Every registered strategy and the reference rules (`queued-least-latency:score=ewma`), or the
/// strategies in `names`; then nginx round-robin and least_conn.
pub fn peer_specs(names: &[String], nginx: Option<&Path>) -> Result<Vec<PeerSpec>, LabError> {
    let mut specs = Vec::new();
    for name in names {
        let spec = StrategySpec::parse(name)?;
        if !REGISTRY.iter().any(|entry| entry.name == spec.name) {
            return Err(LabError::new(format!("unknown strategy {:?}", spec.name)));
        }
        specs.push(spec);
    }
    if names.is_empty() {
        for entry in REGISTRY {
            specs.push(StrategySpec::parse(entry.name)?);
        }
        specs.push(StrategySpec::parse(REFERENCE_RULES)?);
    }
    let mut peers: Vec<PeerSpec> = specs.into_iter().map(PeerSpec::Strategy).collect();
    if let Some(binary) = nginx {
        for balance in [Balance::RoundRobin, Balance::LeastConn] {
            peers.push(PeerSpec::Nginx {
                binary: binary.to_owned(),
                balance,
            });
        }
    }
    Ok(peers)
}

/// Appends the LLM routers named in `names` (every default one when empty), installing them in
/// `out_dir/gateways-venv` first; returns their versions. When they cannot be installed the
/// suite runs without them and says why.
fn add_gateways(
    peers: &mut Vec<PeerSpec>,
    names: &[String],
    out_dir: &Path,
) -> Result<Option<String>, LabError> {
    let specs = if names.is_empty() {
        GatewaySpec::defaults()
    } else {
        names
            .iter()
            .map(|name| GatewaySpec::parse(name))
            .collect::<Result<_, _>>()?
    };
    let installed = match gateways::install(&out_dir.join("gateways-venv")) {
        Ok(installed) => installed,
        Err(error) => {
            eprintln!("[bench] LLM routers left out: {error}");
            return Ok(None);
        }
    };
    let versions = installed.versions();
    peers.extend(specs.into_iter().map(|spec| PeerSpec::Gateway {
        installed: installed.clone(),
        spec,
    }));
    Ok(Some(versions))
}

/// What the physics sweep runs.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    /// The seed of the draws.
    pub seed: u64,
    /// The draws run (their numbers).
    pub draws: std::ops::Range<usize>,
    /// Router peers (`NAME` or `NAME:KEY=VALUE,...`); the first is the one measured.
    pub strategies: Vec<String>,
    /// Whether the LLM routers take part.
    pub gateways: bool,
    /// Where reports and peer files go.
    pub out_dir: PathBuf,
    /// The router executable.
    pub router_binary: PathBuf,
    /// The command line shown in the report.
    pub command: String,
}

/// Runs every draw of the sweep against the router peers, nginx `least_conn` and the LLM
/// routers' `cache_aware`, and returns the report (not yet written).
pub async fn run_sweep(options: &SweepOptions) -> Result<sweep::SweepReport, LabError> {
    let strategies = if options.strategies.is_empty() {
        vec![REGISTRY[0].name.to_owned()]
    } else {
        options.strategies.clone()
    };
    let default = StrategySpec::parse(&strategies[0])?.label();
    let mut peers = peer_specs(&strategies, None)?;
    if let Some(binary) = nginx::find_nginx() {
        peers.push(PeerSpec::Nginx {
            binary,
            balance: Balance::LeastConn,
        });
    }
    if options.gateways {
        let cache_aware = ["smg:cache_aware", "vllm-router:cache_aware"].map(str::to_owned);
        add_gateways(&mut peers, &cache_aware, &options.out_dir)?;
    }
    eprintln!("[sweep] peers: {}", sweep::describe_peers(&peers));
    let work_dir = options.out_dir.join("work");
    std::fs::create_dir_all(&work_dir)?;
    let mut draws = Vec::new();
    for index in options.draws.clone() {
        let draw = sweep::draw(options.seed, index);
        eprintln!("[sweep] draw {index}: {}", draw.describe());
        let context = RunContext {
            mode: sweep::MODE,
            seed: options.seed.wrapping_add(index as u64),
            router_binary: &options.router_binary,
            work_dir: &work_dir,
            access_logs: false,
        };
        let scenario = draw.scenario();
        let outcomes = scenario.run(&peers, context).await;
        print_progress(scenario.name, context.seed, &outcomes);
        let result = sweep::DrawResult::of(draw, outcomes, &default);
        eprintln!(
            "[sweep] draw {index}: p50 ÷ best {:?}, p99 ÷ best {:?}, goodput ÷ best {:?}",
            result.p50_ratio, result.p99_ratio, result.goodput_ratio
        );
        draws.push(result);
    }
    Ok(sweep::SweepReport {
        command: options.command.clone(),
        date_utc: report::utc_now(),
        seed: options.seed,
        default,
        draws,
    })
}

fn describe(scenario: &Scenario, mode: Mode) -> String {
    match &scenario.kind {
        Kind::Routing(routing) => routing.describe(mode),
        Kind::Overhead(overhead) => format!(
            "one backend answering a small JSON document at once; POST /generate; closed loop at concurrency {:?}, {:.1} s each after {:.1} s of warm-up",
            overhead.concurrencies,
            overhead.duration * mode.time_scale(),
            (overhead.warmup * mode.time_scale()).max(0.1),
        ),
    }
}

fn print_progress(scenario: &str, seed: u64, outcomes: &[PeerOutcome]) {
    for (peer, outcome) in outcomes {
        match outcome {
            Ok(run) => {
                let shown: Vec<String> = [
                    "requests",
                    "latency_p50_s",
                    "latency_p99_s",
                    "ttfb_p99_s",
                    "slo_pct",
                    "prefix_hit_pct",
                    "engine_waiting_mean",
                    "error_pct",
                    "rps_c1",
                    "rps_c32",
                ]
                .iter()
                .filter_map(|key| Some(format!("{key}={:.3}", run.metrics.get(*key)?)))
                .collect();
                eprintln!("[bench] {scenario} seed {seed} {peer}: {}", shown.join(" "));
                for class in run
                    .metrics
                    .keys()
                    .filter_map(|key| key.strip_prefix("requests."))
                {
                    let shown: Vec<String> = summary::CLASS_STEMS
                        .iter()
                        .filter_map(|stem| {
                            let value = run.metrics.get(&format!("{stem}.{class}"))?;
                            Some(format!("{stem}={value:.3}"))
                        })
                        .collect();
                    eprintln!(
                        "[bench] {scenario} seed {seed} {peer} class {class}: {}",
                        shown.join(" ")
                    );
                }
            }
            Err(error) => eprintln!("[bench] {scenario} seed {seed} {peer}: FAILED: {error}"),
        }
    }
}
