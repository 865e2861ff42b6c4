//! The scenarios: which replicas, which traffic, and how each is run against every peer.
//!
//! Loads are given as a fraction of the replicas' capacity computed from the simulator's timing
//! model ([`SimConfig::capacity`] at the mean answer length), so "65% load" is exact for the model.
//! Durations are those of the default mode; quick and smoke modes scale them down.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::time::Duration;

use super::load::{self, ClosedLoop, Lengths, OpenLoop, Record};
use super::peer::PeerSpec;
use super::report::{self, Metrics};
use super::sim::{self, Faults, SimConfig, SimHandle};
use super::{LabError, Mode};

/// A status answered within this many seconds counts as a fast rejection (overload).
const FAST_REJECTION_SECONDS: f64 = 0.1;

/// One scenario.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Short name, used for files and `--scenario`.
    pub name: &'static str,
    /// What it models, one or two sentences.
    pub models: &'static str,
    /// How it runs.
    pub kind: Kind,
}

/// The two kinds of scenario.
#[derive(Debug, Clone)]
pub enum Kind {
    /// Simulated LLM replicas under open-loop traffic: routing quality.
    Routing(Routing),
    /// An instant backend under closed-loop traffic: the proxy's own cost.
    Overhead(Overhead),
}

/// A routing-quality scenario.
#[derive(Debug, Clone)]
pub struct Routing {
    /// The replicas; the first `initial_backends` are set at start.
    pub replicas: Vec<Replica>,
    /// How many replicas the peer knows at start.
    pub initial_backends: usize,
    /// Seconds (default mode) after which every replica is set.
    pub scale_up_after: Option<f64>,
    /// Offered load as a fraction of the capacity of all replicas.
    pub load_fraction: f64,
    /// Requests sent at once at time 0 on top of the Poisson arrivals.
    pub burst: usize,
    /// Answer lengths.
    pub lengths: Lengths,
    /// Fraction of streamed requests.
    pub stream_fraction: f64,
    /// Seconds of arrivals (default mode).
    pub duration: f64,
    /// Report the fast-rejection share and goodput against capacity.
    pub reports_overload: bool,
}

/// One replica of a scenario.
#[derive(Debug, Clone)]
pub struct Replica {
    /// Its name (the `x-sim-replica` header).
    pub name: String,
    /// Its speed factor.
    pub speed: f64,
    /// How it misbehaves.
    pub fault: ReplicaFault,
}

/// How a replica misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaFault {
    /// It does not.
    None,
    /// Nothing listens at its address.
    RefusesConnections,
    /// It answers 500 at once to everything.
    Answers500,
    /// It answers 429 with `Retry-After` when this many requests already wait for a slot.
    QueueLimit(usize),
}

/// The overhead scenario.
#[derive(Debug, Clone)]
pub struct Overhead {
    /// Closed-loop concurrencies measured.
    pub concurrencies: Vec<usize>,
    /// Seconds per measurement (default mode).
    pub duration: f64,
    /// Seconds of warm-up at the highest concurrency before measuring (default mode).
    pub warmup: f64,
}

/// Every scenario, in report order.
pub fn all() -> Vec<Scenario> {
    vec![
        hetero(),
        homog(),
        burst_scaleup(),
        dead(),
        failing(),
        overload(),
        overhead(),
    ]
}

fn replicas(speeds: &[f64]) -> Vec<Replica> {
    speeds
        .iter()
        .enumerate()
        .map(|(index, &speed)| Replica {
            name: format!("r{}", index + 1),
            speed,
            fault: ReplicaFault::None,
        })
        .collect()
}

fn with_fault(mut replicas: Vec<Replica>, index: usize, fault: ReplicaFault) -> Vec<Replica> {
    replicas[index].fault = fault;
    replicas
}

const TYPICAL_LENGTHS: Lengths = Lengths::Uniform { min: 16, max: 112 };

fn hetero() -> Scenario {
    Scenario {
        name: "hetero",
        models: "Replicas of different speeds (e.g. mixed GPU types): 4 replicas with speeds 1, 1, 2 and 4 at 65% of their total capacity, every request streamed.",
        kind: Kind::Routing(Routing {
            replicas: replicas(&[1.0, 1.0, 2.0, 4.0]),
            initial_backends: 4,
            scale_up_after: None,
            load_fraction: 0.65,
            burst: 0,
            lengths: TYPICAL_LENGTHS,
            stream_fraction: 1.0,
            duration: 12.0,
            reports_overload: false,
        }),
    }
}

fn homog() -> Scenario {
    Scenario {
        name: "homog",
        models: "Identical replicas and answers of very different lengths (heavy-tailed): 4 equal replicas at 70% load, half of the requests streamed.",
        kind: Kind::Routing(Routing {
            replicas: replicas(&[1.0; 4]),
            initial_backends: 4,
            scale_up_after: None,
            load_fraction: 0.70,
            burst: 0,
            lengths: Lengths::LogNormal {
                median: 40.0,
                sigma: 1.0,
                max: 600,
            },
            stream_fraction: 0.5,
            duration: 15.0,
            reports_overload: false,
        }),
    }
}

fn burst_scaleup() -> Scenario {
    let slots = SimConfig::default().slots;
    Scenario {
        name: "burst-scaleup",
        models: "A burst hits a single replica while the endpoint scales up: a burst of 10× its slots at time 0 plus Poisson traffic at 30% of the final capacity; 3 more replicas are added with set-backends a few seconds in (nginx: configuration rewritten and reloaded).",
        kind: Kind::Routing(Routing {
            replicas: replicas(&[1.0; 4]),
            initial_backends: 1,
            scale_up_after: Some(3.0),
            load_fraction: 0.30,
            burst: 10 * slots,
            lengths: TYPICAL_LENGTHS,
            stream_fraction: 1.0,
            duration: 9.0,
            reports_overload: false,
        }),
    }
}

fn dead() -> Scenario {
    Scenario {
        name: "dead",
        models: "A replica that is gone but still listed: 1 of 4 equal replicas refuses connections; 50% of the nominal capacity (67% of the three live replicas).",
        kind: Kind::Routing(Routing {
            replicas: with_fault(replicas(&[1.0; 4]), 0, ReplicaFault::RefusesConnections),
            initial_backends: 4,
            scale_up_after: None,
            load_fraction: 0.50,
            burst: 0,
            lengths: TYPICAL_LENGTHS,
            stream_fraction: 1.0,
            duration: 8.0,
            reports_overload: false,
        }),
    }
}

fn failing() -> Scenario {
    Scenario {
        name: "failing",
        models: "A broken replica that fails fast: 1 of 4 equal replicas answers 500 at once; 50% of the nominal capacity.",
        kind: Kind::Routing(Routing {
            replicas: with_fault(replicas(&[1.0; 4]), 0, ReplicaFault::Answers500),
            initial_backends: 4,
            scale_up_after: None,
            load_fraction: 0.50,
            burst: 0,
            lengths: TYPICAL_LENGTHS,
            stream_fraction: 1.0,
            duration: 8.0,
            reports_overload: false,
        }),
    }
}

fn overload() -> Scenario {
    let queue_limit = 8 * SimConfig::default().slots;
    let replicas = replicas(&[1.0; 4])
        .into_iter()
        .map(|replica| Replica {
            fault: ReplicaFault::QueueLimit(queue_limit),
            ..replica
        })
        .collect();
    Scenario {
        name: "overload",
        models: "More traffic than the replicas can serve: 150% of the capacity of 4 equal replicas. Each replica answers 429 with Retry-After once 32 requests wait for a slot (as TGI does past its concurrency limit). What matters: goodput, how much of the excess is refused fast, and the latency of the requests that are served.",
        kind: Kind::Routing(Routing {
            replicas,
            initial_backends: 4,
            scale_up_after: None,
            load_fraction: 1.5,
            burst: 0,
            lengths: TYPICAL_LENGTHS,
            stream_fraction: 1.0,
            duration: 20.0,
            reports_overload: true,
        }),
    }
}

fn overhead() -> Scenario {
    Scenario {
        name: "overhead",
        models: "The proxy's own cost: tiny non-streamed answers from a backend that answers at once, closed loop at concurrency 1 and 32, direct and through each peer; the peer's CPU per request and memory are read from /proc.",
        kind: Kind::Overhead(Overhead {
            concurrencies: vec![1, 32],
            duration: 4.0,
            warmup: 0.5,
        }),
    }
}

impl Routing {
    /// The simulator settings of replica `index`.
    pub fn sim_config(&self, index: usize, seed: u64) -> SimConfig {
        let replica = &self.replicas[index];
        let mut faults = Faults::default();
        match replica.fault {
            ReplicaFault::None | ReplicaFault::RefusesConnections => {}
            ReplicaFault::Answers500 => faults.fail_fraction = 1.0,
            ReplicaFault::QueueLimit(limit) => {
                faults.queue_limit = Some(limit);
                faults.reject_status = 429;
            }
        }
        SimConfig {
            name: replica.name.clone(),
            speed: replica.speed,
            seed: seed.wrapping_add(index as u64),
            faults,
            ..SimConfig::default()
        }
    }

    /// Requests per second all replicas finish with every slot busy (the model's capacity).
    pub fn capacity(&self) -> f64 {
        let mean_tokens = self.lengths.mean();
        (0..self.replicas.len())
            .map(|index| self.sim_config(index, 0).capacity(mean_tokens))
            .sum()
    }

    /// The offered arrival rate.
    pub fn rate(&self) -> f64 {
        self.load_fraction * self.capacity()
    }

    /// The open-loop load of one run.
    pub fn open_loop(&self, mode: Mode, seed: u64) -> OpenLoop {
        let duration = Duration::from_secs_f64(self.duration * mode.time_scale());
        OpenLoop {
            rate: self.rate(),
            duration,
            burst: self.burst,
            lengths: self.lengths.clone(),
            stream_fraction: self.stream_fraction,
            seed,
            request_timeout: duration + mode.drain_limit(),
            max_requests: 100_000,
        }
    }

    /// One line describing the set-up.
    pub fn describe(&self, mode: Mode) -> String {
        let speeds: Vec<String> = self
            .replicas
            .iter()
            .map(|replica| format!("{}", replica.speed))
            .collect();
        let config = SimConfig::default();
        format!(
            "{} replicas (speeds {}; {} slots; prefill {} ms, step {} + {} × batch ms at speed 1); {}; {:.0}% streamed; {:.1} s of arrivals{}",
            self.replicas.len(),
            speeds.join(", "),
            config.slots,
            config.prefill_ms,
            config.step_ms,
            config.step_per_batch_ms,
            self.lengths.describe(),
            self.stream_fraction * 100.0,
            self.duration * mode.time_scale(),
            if self.burst > 0 {
                format!(", burst of {} at 0 s", self.burst)
            } else {
                String::new()
            },
        ) + &self.scale_up_after.map_or_else(String::new, |after| {
            format!(
                ", {} replica(s) at start and all {} from {:.2} s",
                self.initial_backends,
                self.replicas.len(),
                after * mode.time_scale()
            )
        })
    }
}

/// Settings shared by every run of the suite.
#[derive(Debug, Clone, Copy)]
pub struct RunContext<'a> {
    /// Default, quick or smoke.
    pub mode: Mode,
    /// The seed of this run.
    pub seed: u64,
    /// The router executable.
    pub router_binary: &'a Path,
    /// Where peers keep their files.
    pub work_dir: &'a Path,
}

/// The numbers of one peer in one run.
#[derive(Debug, Clone, Default)]
pub struct PeerRun {
    /// Named numbers (see `report`).
    pub metrics: Metrics,
    /// Latencies (seconds) plotted in the CDF.
    pub latencies: Vec<f64>,
}

/// A peer's result in one run, or why it has none.
pub type PeerOutcome = (String, Result<PeerRun, String>);

impl Scenario {
    /// Runs the scenario once against each peer, in order.
    pub async fn run(&self, peers: &[PeerSpec], context: RunContext<'_>) -> Vec<PeerOutcome> {
        match &self.kind {
            Kind::Routing(routing) => {
                let mut outcomes = Vec::new();
                for peer in peers {
                    let outcome = run_routing(self.name, routing, peer, context).await;
                    outcomes.push((peer.name(), outcome.map_err(|e| e.to_string())));
                }
                outcomes
            }
            Kind::Overhead(overhead) => run_overhead(overhead, peers, context).await,
        }
    }
}

/// A replica's address and, unless it refuses connections, its running simulator.
struct StartedReplica {
    address: String,
    _sim: Option<SimHandle>,
}

async fn start_replicas(routing: &Routing, seed: u64) -> Result<Vec<StartedReplica>, LabError> {
    let mut started = Vec::new();
    for (index, replica) in routing.replicas.iter().enumerate() {
        if replica.fault == ReplicaFault::RefusesConnections {
            started.push(StartedReplica {
                address: refusing_address()?.to_string(),
                _sim: None,
            });
            continue;
        }
        let handle = sim::spawn(routing.sim_config(index, seed)).await?;
        started.push(StartedReplica {
            address: handle.host_port(),
            _sim: Some(handle),
        });
    }
    Ok(started)
}

/// An address where nothing listens: bound once to reserve a free port, then released.
fn refusing_address() -> Result<SocketAddr, LabError> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// A seed for `scenario` in run `seed`, the same for every peer.
fn scenario_seed(scenario: &str, seed: u64) -> u64 {
    scenario
        .bytes()
        .fold(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15), |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        })
}

async fn run_routing(
    scenario: &str,
    routing: &Routing,
    peer: &PeerSpec,
    context: RunContext<'_>,
) -> Result<PeerRun, LabError> {
    let seed = scenario_seed(scenario, context.seed);
    let replicas = start_replicas(routing, seed).await?;
    let addresses: Vec<String> = replicas.iter().map(|r| r.address.clone()).collect();
    let initial = &addresses[..routing.initial_backends.min(addresses.len())];
    let mut running = peer
        .start(context.router_binary, context.work_dir, initial)
        .await?;
    let load = routing.open_loop(context.mode, seed);
    let schedule = load::plan(&load);
    let load_task = tokio::spawn(load::run_open_loop(
        running.addr(),
        schedule,
        load.request_timeout,
        None,
    ));
    let mut scale_up_error = None;
    if let Some(after) = routing.scale_up_after {
        tokio::time::sleep(Duration::from_secs_f64(after * context.mode.time_scale())).await;
        scale_up_error = running.set_backends(&addresses).await.err();
    }
    let records = load_task.await.map_err(|e| LabError::new(e.to_string()))?;
    running.stop().await;
    drop(replicas);
    if let Some(error) = scale_up_error {
        return Err(error);
    }
    let names: Vec<String> = routing.replicas.iter().map(|r| r.name.clone()).collect();
    let mut metrics = report::summarize(&records, &names);
    if routing.reports_overload {
        add_overload_metrics(&mut metrics, &records, routing.capacity());
    }
    Ok(PeerRun {
        metrics,
        latencies: success_latencies(&records),
    })
}

fn success_latencies(records: &[Record]) -> Vec<f64> {
    records
        .iter()
        .filter(|record| record.is_success())
        .map(|record| record.latency)
        .collect()
}

fn add_overload_metrics(metrics: &mut Metrics, records: &[Record], capacity: f64) {
    let fast_rejections = records
        .iter()
        .filter(|r| matches!(r.status, 429 | 503) && r.latency < FAST_REJECTION_SECONDS)
        .count();
    metrics.insert(
        "fast_rejection_pct".to_owned(),
        percent(fast_rejections, records.len()),
    );
    let by_proxy = records
        .iter()
        .filter(|r| r.status == 503 && r.replica.is_none())
        .count();
    metrics.insert("proxy_503_pct".to_owned(), percent(by_proxy, records.len()));
    let by_replica = records
        .iter()
        .filter(|r| r.status == 429 && r.replica.is_some())
        .count();
    metrics.insert(
        "replica_429_pct".to_owned(),
        percent(by_replica, records.len()),
    );
    if let Some(goodput) = metrics.get("goodput_rps").copied() {
        metrics.insert(
            "goodput_pct_of_capacity".to_owned(),
            100.0 * goodput / capacity,
        );
    }
}

fn percent(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// The peer used as the reference for the overhead ratios.
const OVERHEAD_REFERENCE: &str = "nginx-round-robin";

async fn run_overhead(
    overhead: &Overhead,
    peers: &[PeerSpec],
    context: RunContext<'_>,
) -> Vec<PeerOutcome> {
    let backend = match sim::spawn(SimConfig::instant("instant")).await {
        Ok(backend) => backend,
        Err(error) => return vec![("direct".to_owned(), Err(error.to_string()))],
    };
    let mut outcomes = vec![(
        "direct".to_owned(),
        Ok(measure_direct(overhead, backend.addr, context.mode).await),
    )];
    for peer in peers {
        let outcome = measure_peer(overhead, peer, &backend, context).await;
        outcomes.push((peer.name(), outcome.map_err(|e| e.to_string())));
    }
    add_overhead_comparisons(&mut outcomes);
    outcomes
}

fn closed_loop(concurrency: usize, seconds: f64) -> ClosedLoop {
    ClosedLoop {
        concurrency,
        duration: Duration::from_secs_f64(seconds),
        max_tokens: 0,
        max_requests_per_worker: 10_000_000,
        request_timeout: Duration::from_secs(10),
    }
}

/// Warm-up at the highest concurrency, then each concurrency in turn.
async fn measure_direct(overhead: &Overhead, target: SocketAddr, mode: Mode) -> PeerRun {
    let mut run = PeerRun::default();
    warm_up(overhead, target, mode).await;
    for &concurrency in &overhead.concurrencies {
        let records = measure(overhead, target, mode, concurrency).await;
        add_closed_loop_metrics(&mut run, &records, concurrency, overhead, mode);
    }
    run
}

async fn measure_peer(
    overhead: &Overhead,
    peer: &PeerSpec,
    backend: &SimHandle,
    context: RunContext<'_>,
) -> Result<PeerRun, LabError> {
    let backends = [backend.host_port()];
    let running = peer
        .start(context.router_binary, context.work_dir, &backends)
        .await?;
    let target = running.addr();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut run = PeerRun::default();
    run.metrics.insert(
        "rss_idle_mib".to_owned(),
        kib_to_mib(running.usage().rss_kib),
    );
    warm_up(overhead, target, context.mode).await;
    for &concurrency in &overhead.concurrencies {
        let before = running.usage();
        let records = measure(overhead, target, context.mode, concurrency).await;
        let after = running.usage();
        add_closed_loop_metrics(&mut run, &records, concurrency, overhead, context.mode);
        let cpu_us = (after.cpu_seconds - before.cpu_seconds) * 1e6;
        run.metrics.insert(
            format!("cpu_us_per_request_c{concurrency}"),
            cpu_us / records.len().max(1) as f64,
        );
        run.metrics.insert(
            format!("rss_load_mib_c{concurrency}"),
            kib_to_mib(after.rss_kib),
        );
    }
    running.stop().await;
    Ok(run)
}

async fn warm_up(overhead: &Overhead, target: SocketAddr, mode: Mode) {
    let concurrency = overhead.concurrencies.iter().copied().max().unwrap_or(1);
    let seconds = (overhead.warmup * mode.time_scale()).max(0.1);
    load::run_closed_loop(target, &closed_loop(concurrency, seconds)).await;
}

async fn measure(
    overhead: &Overhead,
    target: SocketAddr,
    mode: Mode,
    concurrency: usize,
) -> Vec<Record> {
    let seconds = overhead.duration * mode.time_scale();
    load::run_closed_loop(target, &closed_loop(concurrency, seconds)).await
}

fn add_closed_loop_metrics(
    run: &mut PeerRun,
    records: &[Record],
    concurrency: usize,
    overhead: &Overhead,
    mode: Mode,
) {
    let seconds = overhead.duration * mode.time_scale();
    let mut latencies = success_latencies(records);
    latencies.sort_by(f64::total_cmp);
    let metrics = &mut run.metrics;
    metrics.insert(
        format!("rps_c{concurrency}"),
        latencies.len() as f64 / seconds,
    );
    metrics.insert(
        format!("errors_c{concurrency}"),
        (records.len() - latencies.len()) as f64,
    );
    if let (Some(p50), Some(p99)) = (
        report::percentile(&latencies, 0.50),
        report::percentile(&latencies, 0.99),
    ) {
        metrics.insert(format!("p50_us_c{concurrency}"), p50 * 1e6);
        metrics.insert(format!("p99_us_c{concurrency}"), p99 * 1e6);
    }
    if concurrency == 1 {
        run.latencies = latencies;
    }
}

/// Adds latency over direct and ratios to the reference peer.
fn add_overhead_comparisons(outcomes: &mut [PeerOutcome]) {
    let direct = outcomes[0].1.as_ref().ok().map(|run| run.metrics.clone());
    let reference = outcomes
        .iter()
        .find(|(name, _)| name == OVERHEAD_REFERENCE)
        .and_then(|(_, outcome)| outcome.as_ref().ok())
        .map(|run| run.metrics.clone());
    for (name, outcome) in outcomes.iter_mut().skip(1) {
        let Ok(run) = outcome else { continue };
        if let Some(direct) = &direct {
            add_differences(&mut run.metrics, direct, &["p50_us", "p99_us"], "added_");
        }
        if let Some(reference) = reference.as_ref().filter(|_| name != OVERHEAD_REFERENCE) {
            add_ratios(&mut run.metrics, reference);
        }
    }
}

fn add_differences(metrics: &mut Metrics, base: &Metrics, stems: &[&str], prefix: &str) {
    let keys: Vec<String> = metrics
        .keys()
        .filter(|key| stems.iter().any(|stem| key.starts_with(stem)))
        .cloned()
        .collect();
    for key in keys {
        if let (Some(value), Some(base_value)) = (metrics.get(&key), base.get(&key)) {
            let difference = value - base_value;
            metrics.insert(format!("{prefix}{key}"), difference);
        }
    }
}

fn add_ratios(metrics: &mut Metrics, reference: &Metrics) {
    let mut ratios = BTreeMap::new();
    for (key, value) in metrics.iter() {
        let compared = key.starts_with("rps_c") || key.starts_with("cpu_us_per_request_c");
        if let Some(reference_value) = reference.get(key).filter(|v| compared && **v > 0.0) {
            ratios.insert(format!("{key}_vs_nginx"), value / reference_value);
        }
    }
    metrics.extend(ratios);
}

fn kib_to_mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}
