//! The scenarios: which replicas, which traffic, and how each is run against every peer.
//!
//! The first scenarios send open-loop Poisson traffic of short TGI requests to small replicas
//! (4 slots, per-request batching); their loads are given as a fraction of the replicas'
//! capacity computed from the simulator's timing model ([`SimConfig::capacity`] at the mean
//! answer length), so "65% load" is exact for the model. The LLM scenarios (`prefix`,
//! `prefix-session`, `long-context`, `engine-scale`) send users' chat completions
//! (`workload.rs`) to replicas at LLM-engine scale: stepped batching with chunked prefill, a KV
//! cache limit, a prefix cache, prefill paid per uncached prompt token and decode steps of 20 to
//! 50 ms. Every scenario states the SLO its goodput is judged by.
//!
//! Durations are those of the default mode; quick and smoke modes scale them down (the LLM
//! scenarios also run fewer users on replicas sped up by the same factor as their times).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::load::{self, Class, ClosedLoop, Lengths, OpenLoop, Planned, Record};
use super::peer::PeerSpec;
use super::sim::{self, Batching, Faults, SharedCache, SimConfig, SimHandle, SimStats};
use super::summary::{self, Metrics, Slo};
use super::trace::Trace;
use super::workload::{Chat, Documents, Scale, Workload};
use super::{LabError, Mode};

/// A status answered within this many seconds counts as a fast rejection (overload).
const FAST_REJECTION_SECONDS: f64 = 0.1;

/// The header giving the milliseconds within which a request's answer must start (the router's
/// `queue.deadline_header` default).
pub const DEADLINE_HEADER: &str = "x-request-deadline-ms";

/// The header naming a request's priority band (the router's `queue.priority_header` default).
pub const PRIORITY_HEADER: &str = "x-priority";

/// The header naming a request's tenant in the tenant scenarios; the router reads it only when
/// run with `queue.tenant_header = "x-tenant-id"` (the peer
/// `queued-least-latency:config.queue.tenant_header=x-tenant-id`).
pub const TENANT_HEADER: &str = "x-tenant-id";

/// How often the replicas' batch and queue are sampled during an LLM scenario, in the
/// replicas' time: a run that compresses time samples as much more often, down to
/// [`MIN_ENGINE_SAMPLE_INTERVAL`] (a smoke run's requests last tens of milliseconds).
const ENGINE_SAMPLE_INTERVAL: Duration = Duration::from_millis(100);
/// The shortest interval between samples of the replicas, whatever the time compression.
const MIN_ENGINE_SAMPLE_INTERVAL: Duration = Duration::from_millis(5);

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
    /// Simulated LLM replicas under traffic: routing quality.
    Routing(Box<Routing>),
    /// An instant backend under closed-loop traffic: the proxy's own cost.
    Overhead(Overhead),
}

/// A routing-quality scenario.
#[derive(Debug, Clone)]
pub struct Routing {
    /// The replicas; the first `initial_backends` are set at start.
    pub replicas: Vec<Replica>,
    /// The replicas' engine; each replica's name, speed (times the mode's time compression for
    /// users traffic), seed and faults are set from `replicas`.
    pub engine: SimConfig,
    /// How many replicas the peer knows at start.
    pub initial_backends: usize,
    /// Seconds (default mode) after which every replica is set.
    pub scale_up_after: Option<f64>,
    /// What the clients send.
    pub traffic: Traffic,
    /// The bounds a request must finish within to count in the SLO goodput.
    pub slo: Slo,
    /// Report the fast-rejection share and goodput against capacity.
    pub reports_overload: bool,
    /// The scenario whose seed this one runs with (its own name when `None`): the same seed
    /// and the same traffic parameters give the same schedule, so a scenario can send a part of
    /// another one's requests (a class alone) or the same requests with other headers.
    pub seed_of: Option<&'static str>,
    /// Splits the records into classes by a function of the record (instead of the classes a
    /// Poisson traffic declares), for per-class numbers.
    pub classifier: Option<Classifier>,
    /// How much faster than real time it runs on top of what its mode compresses: its replicas
    /// that much faster, its users' times and its SLO that much shorter (1: as the mode says).
    pub compression: f64,
}

/// Classes of records given by a function of the record (for example its prompt length).
#[derive(Debug, Clone, Copy)]
pub struct Classifier {
    /// Every class, in report order.
    pub names: &'static [&'static str],
    /// What the classes are, one line.
    pub about: &'static str,
    /// A record's class.
    pub class_of: fn(&Record) -> Option<&'static str>,
}

/// What the clients of a routing scenario send.
#[derive(Debug, Clone)]
pub enum Traffic {
    /// Open-loop Poisson arrivals of TGI `/generate` requests.
    Poisson(Poisson),
    /// Users sending chat completions, each turn after the previous answer (see `workload.rs`).
    Users(Workload),
}

/// Open-loop Poisson traffic.
#[derive(Debug, Clone)]
pub struct Poisson {
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
    /// Traffic classes and header fields of the requests.
    pub mix: Mix,
    /// Answers of engine scale (seconds each): in quick and smoke modes the run is compressed
    /// in time like the LLM scenarios' (replicas and arrivals that much faster) on top of being
    /// shortened, since a shortened run alone would end before its answers do.
    pub compressed: bool,
}

/// What the requests of a Poisson traffic carry beyond their lengths.
#[derive(Debug, Clone, Default)]
pub struct Mix {
    /// Traffic classes, each request's drawn from the schedule's RNG; empty: no classes (and no
    /// draw, so the schedule is the one drawn before classes existed).
    pub classes: Vec<Class>,
    /// Send only the requests of this class of the schedule (the others are drawn, then left
    /// out): a class alone, at its rate in the whole traffic.
    pub only: Option<&'static str>,
    /// Every request carries [`DEADLINE_HEADER`] with the scenario SLO's first-token bound in
    /// milliseconds, as the run sees them (scaled like the SLO).
    pub deadline_from_slo: bool,
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
    let mut all = vec![
        hetero(),
        homog(),
        burst_scaleup(),
        dead(),
        failing(),
        overload(),
        hetero_stream(),
        overload_deadline(),
        noisy_tenant(),
        noisy_tenant_alone(),
        priority(),
        priority_alone(),
        noisy_tenant_engine(),
        noisy_tenant_engine_alone(),
        priority_engine(),
        priority_engine_alone(),
    ];
    all.extend(FLOOR_FORMS.iter().map(form_scenario));
    all.extend([
        prefix(),
        prefix_session(),
        long_context(),
        engine_scale(),
        trace_conversation(),
        trace_synthetic(),
    ]);
    all.extend(CACHE_FLOORS.iter().map(form_scenario));
    all.push(overhead());
    all
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

/// The SLO of the small-replica scenarios: a first token within 0.5 s and every token after it
/// within 10 ms on average (2.5 × a full-batch step of a speed-1 replica).
const SMALL_REPLICA_SLO: Slo = Slo {
    ttft_seconds: 0.5,
    ttft_seconds_per_prompt_token: 0.0,
    tpot_seconds: 0.010,
};

/// A routing scenario on the original small replicas, with Poisson traffic.
fn small_replicas(replicas: Vec<Replica>, poisson: Poisson) -> Routing {
    Routing {
        replicas,
        engine: SimConfig::default(),
        initial_backends: 4,
        scale_up_after: None,
        traffic: Traffic::Poisson(poisson),
        slo: SMALL_REPLICA_SLO,
        reports_overload: false,
        seed_of: None,
        classifier: None,
        compression: 1.0,
    }
}

fn hetero() -> Scenario {
    Scenario {
        name: "hetero",
        models: "Replicas of different speeds (e.g. mixed GPU types): 4 replicas with speeds 1, 1, 2 and 4 at 65% of their total capacity, every request streamed.",
        kind: Kind::Routing(Box::new(small_replicas(
            replicas(&[1.0, 1.0, 2.0, 4.0]),
            Poisson {
                load_fraction: 0.65,
                burst: 0,
                lengths: TYPICAL_LENGTHS,
                stream_fraction: 1.0,
                duration: 12.0,
                mix: Mix::default(),
                compressed: false,
            },
        ))),
    }
}

fn homog() -> Scenario {
    Scenario {
        name: "homog",
        models: "Identical replicas and answers of very different lengths (heavy-tailed): 4 equal replicas at 70% load, half of the requests streamed.",
        kind: Kind::Routing(Box::new(small_replicas(
            replicas(&[1.0; 4]),
            Poisson {
                load_fraction: 0.70,
                burst: 0,
                lengths: Lengths::LogNormal {
                    median: 40.0,
                    sigma: 1.0,
                    min: 1,
                    max: 600,
                },
                stream_fraction: 0.5,
                duration: 15.0,
                mix: Mix::default(),
                compressed: false,
            },
        ))),
    }
}

fn burst_scaleup() -> Scenario {
    let slots = SimConfig::default().slots;
    Scenario {
        name: "burst-scaleup",
        models: "A burst hits a single replica while the endpoint scales up: a burst of 10× its slots at time 0 plus Poisson traffic at 30% of the final capacity; 3 more replicas are added with set-backends a few seconds in (nginx: configuration rewritten and reloaded).",
        kind: Kind::Routing(Box::new(Routing {
            initial_backends: 1,
            scale_up_after: Some(3.0),
            ..small_replicas(
                replicas(&[1.0; 4]),
                Poisson {
                    load_fraction: 0.30,
                    burst: 10 * slots,
                    lengths: TYPICAL_LENGTHS,
                    stream_fraction: 1.0,
                    duration: 9.0,
                    mix: Mix::default(),
                    compressed: false,
                },
            )
        })),
    }
}

fn dead() -> Scenario {
    Scenario {
        name: "dead",
        models: "A replica that is gone but still listed: 1 of 4 equal replicas refuses connections; 50% of the nominal capacity (67% of the three live replicas).",
        kind: Kind::Routing(Box::new(small_replicas(
            with_fault(replicas(&[1.0; 4]), 0, ReplicaFault::RefusesConnections),
            half_load(),
        ))),
    }
}

fn failing() -> Scenario {
    Scenario {
        name: "failing",
        models: "A broken replica that fails fast: 1 of 4 equal replicas answers 500 at once; 50% of the nominal capacity.",
        kind: Kind::Routing(Box::new(small_replicas(
            with_fault(replicas(&[1.0; 4]), 0, ReplicaFault::Answers500),
            half_load(),
        ))),
    }
}

fn half_load() -> Poisson {
    Poisson {
        load_fraction: 0.50,
        burst: 0,
        lengths: TYPICAL_LENGTHS,
        stream_fraction: 1.0,
        duration: 8.0,
        mix: Mix::default(),
        compressed: false,
    }
}

fn overload() -> Scenario {
    Scenario {
        name: "overload",
        models: "More traffic than the replicas can serve: 150% of the capacity of 4 equal replicas. Each replica answers 429 with Retry-After once 32 requests wait for a slot (as TGI does past its concurrency limit). What matters: goodput, how much of the excess is refused fast, and the latency of the requests that are served.",
        kind: Kind::Routing(Box::new(overload_routing(Mix::default()))),
    }
}

/// The replicas and load of `overload`, the requests carrying `mix`.
fn overload_routing(mix: Mix) -> Routing {
    let queue_limit = 8 * SimConfig::default().slots;
    let replicas = replicas(&[1.0; 4])
        .into_iter()
        .map(|replica| Replica {
            fault: ReplicaFault::QueueLimit(queue_limit),
            ..replica
        })
        .collect();
    Routing {
        reports_overload: true,
        ..small_replicas(
            replicas,
            Poisson {
                load_fraction: 1.5,
                burst: 0,
                lengths: TYPICAL_LENGTHS,
                stream_fraction: 1.0,
                duration: 20.0,
                mix,
                compressed: false,
            },
        )
    }
}

fn hetero_stream() -> Scenario {
    Scenario {
        name: "hetero-stream",
        models: "Streaming (SSE) near saturation on replicas of different speeds: the hetero replicas (speeds 1, 1, 2 and 4), every request streamed, Poisson arrivals at 85% of their capacity for 20 s, so that requests queue (in the router or in the replicas). The time to first token is what a chat user sees: it must not be traded for a shorter total time.",
        kind: Kind::Routing(Box::new(small_replicas(
            replicas(&[1.0, 1.0, 2.0, 4.0]),
            Poisson {
                load_fraction: 0.85,
                burst: 0,
                lengths: TYPICAL_LENGTHS,
                stream_fraction: 1.0,
                duration: 20.0,
                mix: Mix::default(),
                compressed: false,
            },
        ))),
    }
}

fn overload_deadline() -> Scenario {
    Scenario {
        name: "overload-deadline",
        models: "The overload scenario (same replicas with their 429 limit, same load, same requests: it runs with the seed of overload) with every request stating in `x-request-deadline-ms` that its answer must start within the SLO's first-token bound (500 ms): the router refuses at once (503) a request whose first byte it predicts would come later, instead of queueing it past its deadline.",
        kind: Kind::Routing(Box::new(Routing {
            seed_of: Some("overload"),
            ..overload_routing(Mix {
                deadline_from_slo: true,
                ..Mix::default()
            })
        })),
    }
}

/// 4 equal replicas (speed 1) under `load_fraction` of their capacity for 20 s, every request
/// streamed, carrying `mix`.
fn equal_replicas(load_fraction: f64, mix: Mix) -> Routing {
    small_replicas(
        replicas(&[1.0; 4]),
        Poisson {
            load_fraction,
            burst: 0,
            lengths: TYPICAL_LENGTHS,
            stream_fraction: 1.0,
            duration: 20.0,
            mix,
            compressed: false,
        },
    )
}

/// 4 equal replicas at `load_fraction` carrying `classes` (the scenario `parent`'s schedule),
/// or only the class `only` of it.
fn classed_routing(
    parent: &'static str,
    load_fraction: f64,
    classes: Vec<Class>,
    only: Option<&'static str>,
) -> Routing {
    let mix = Mix {
        classes,
        only,
        ..Mix::default()
    };
    Routing {
        reports_overload: only.is_none(),
        seed_of: Some(parent),
        ..equal_replicas(load_fraction, mix)
    }
}

/// The replicas of the engine-scale tenant and priority scenarios: 4 replicas of 64 sequences
/// (KV cache enough for every slot's longest answer, so the sequences bind), answers of 200 to
/// 2,000 tokens at 20 ms + 0.1 ms × batch a token, every request streamed, 60 s of arrivals at
/// `load_fraction` of their capacity, carrying `classes` (the scenario `parent`'s schedule), or
/// only the class `only` of it.
fn engine_classed_routing(
    parent: &'static str,
    load_fraction: f64,
    classes: Vec<Class>,
    only: Option<&'static str>,
) -> Routing {
    Routing {
        replicas: replicas(&[1.0; 4]),
        engine: llm_engine(64, 64 * 2_100, 100_000),
        initial_backends: 4,
        scale_up_after: None,
        traffic: Traffic::Poisson(Poisson {
            load_fraction,
            burst: 0,
            lengths: ENGINE_ANSWERS,
            stream_fraction: 1.0,
            duration: 60.0,
            mix: Mix {
                classes,
                only,
                ..Mix::default()
            },
            compressed: true,
        }),
        slo: CHAT_SLO,
        reports_overload: only.is_none(),
        seed_of: Some(parent),
        classifier: None,
        compression: 1.0,
    }
}

/// Answer lengths of the engine-scale scenarios.
const ENGINE_ANSWERS: Lengths = Lengths::LogNormal {
    median: 300.0,
    sigma: 0.5,
    min: 200,
    max: 2_000,
};

/// The traffic of `noisy-tenant-engine`, or of one of its tenants alone.
fn noisy_tenant_engine_routing(only: Option<&'static str>) -> Routing {
    engine_classed_routing("noisy-tenant-engine", 1.2, noisy_tenant_classes(), only)
}

/// The traffic of `priority-engine`, or of one of its classes alone.
fn priority_engine_routing(only: Option<&'static str>) -> Routing {
    engine_classed_routing("priority-engine", 1.5, priority_classes(), only)
}

fn noisy_tenant_engine() -> Scenario {
    Scenario {
        name: "noisy-tenant-engine",
        models: "noisy-tenant at engine scale: 4 replicas of 64 sequences, answers of 200 to 2,000 tokens (seconds each), 120% of their capacity for 60 s, tenant a sending 10 times the rate of tenant b. Whether the router's queue still holds the line (and serves b its share) when each replica batches dozens of long streams. What matters: b's latency against noisy-tenant-engine-alone.",
        kind: Kind::Routing(Box::new(noisy_tenant_engine_routing(None))),
    }
}

fn noisy_tenant_engine_alone() -> Scenario {
    Scenario {
        name: "noisy-tenant-engine-alone",
        models: "The baseline of noisy-tenant-engine: its tenant b alone (the same b requests at the same times, 11% of the replicas' capacity).",
        kind: Kind::Routing(Box::new(noisy_tenant_engine_routing(Some("b")))),
    }
}

fn priority_engine() -> Scenario {
    Scenario {
        name: "priority-engine",
        models: "priority at engine scale: 4 replicas of 64 sequences, answers of 200 to 2,000 tokens, 150% of their capacity for 60 s, 20% of the requests marked `x-priority: high`. What matters: the high requests' latency against priority-engine-alone, and what the normal ones pay.",
        kind: Kind::Routing(Box::new(priority_engine_routing(None))),
    }
}

fn priority_engine_alone() -> Scenario {
    Scenario {
        name: "priority-engine-alone",
        models: "The baseline of priority-engine: its high requests alone (30% of the replicas' capacity).",
        kind: Kind::Routing(Box::new(priority_engine_routing(Some("high")))),
    }
}

/// The traffic of `noisy-tenant`, or of one of its tenants alone.
fn noisy_tenant_routing(only: Option<&'static str>) -> Routing {
    classed_routing("noisy-tenant", 1.2, noisy_tenant_classes(), only)
}

/// Tenant a sending 10 times the rate of tenant b.
fn noisy_tenant_classes() -> Vec<Class> {
    vec![
        Class::new("a", 10.0 / 11.0, &[(TENANT_HEADER, "a")]),
        Class::new("b", 1.0 / 11.0, &[(TENANT_HEADER, "b")]),
    ]
}

fn noisy_tenant() -> Scenario {
    Scenario {
        name: "noisy-tenant",
        models: "One tenant floods a shared endpoint: 4 equal replicas at 120% of their capacity for 20 s, tenant a (`x-tenant-id: a`) sending 10 times the rate of tenant b (`x-tenant-id: b`). The router reads the tenant only when run with `queue.tenant_header = \"x-tenant-id\"` (peer `queued-least-latency:config.queue.tenant_header=x-tenant-id`): then its queue serves the tenants in fair shares. What matters: b's latency against noisy-tenant-alone.",
        kind: Kind::Routing(Box::new(noisy_tenant_routing(None))),
    }
}

fn noisy_tenant_alone() -> Scenario {
    Scenario {
        name: "noisy-tenant-alone",
        models: "The baseline of noisy-tenant: its tenant b alone (the same schedule with a's requests left out: the same b requests at the same times, 11% of the replicas' capacity), b's latency when no tenant floods the endpoint.",
        kind: Kind::Routing(Box::new(noisy_tenant_routing(Some("b")))),
    }
}

/// The traffic of `priority`, or of one of its classes alone.
fn priority_routing(only: Option<&'static str>) -> Routing {
    classed_routing("priority", 1.5, priority_classes(), only)
}

/// 20 % of the requests marked high.
fn priority_classes() -> Vec<Class> {
    vec![
        Class::new("high", 0.2, &[(PRIORITY_HEADER, "high")]),
        Class::new("normal", 0.8, &[]),
    ]
}

fn priority() -> Scenario {
    Scenario {
        name: "priority",
        models: "Priority under overload: 4 equal replicas at 150% of their capacity for 20 s, 20% of the requests marked `x-priority: high`, the others without the header (normal). The router's queue dispatches the high band first; what matters: the high requests' latency against priority-alone, and what the normal ones pay.",
        kind: Kind::Routing(Box::new(priority_routing(None))),
    }
}

fn priority_alone() -> Scenario {
    Scenario {
        name: "priority-alone",
        models: "The baseline of priority: its high requests alone (the same schedule with the normal requests left out, 30% of the replicas' capacity), their latency on replicas that are not overloaded.",
        kind: Kind::Routing(Box::new(priority_routing(Some("high")))),
    }
}

// --- The floors of the tenant and band scenarios, and their non-streamed forms. ---
//
// A request that runs in a full batch is slower than one that runs alone, whatever the router
// does. A `-floor` scenario sends the class that matters (tenant b, the high band) alone, on
// replicas whose every step is timed as a full batch (`SimConfig::full_batch`): what its
// requests take when the replicas are kept full by others and nothing of theirs waits. Its
// numbers are the floor the mixed scenario's are stated against. A `-whole` scenario is the
// mixed one with every answer non-streamed (its head at its end, as vLLM sends it).

/// `routing` on replicas timed as full batches.
fn at_floor(mut routing: Routing) -> Routing {
    routing.engine.full_batch = true;
    routing
}

/// `routing` with every answer non-streamed.
fn whole(mut routing: Routing) -> Routing {
    if let Traffic::Poisson(poisson) = &mut routing.traffic {
        poisson.stream_fraction = 0.0;
    }
    routing
}

/// A scenario given by its name, what it models and its routing.
type Form = (&'static str, &'static str, fn() -> Routing);

/// The scenario of a form.
fn form_scenario(&(name, models, routing): &Form) -> Scenario {
    Scenario {
        name,
        models,
        kind: Kind::Routing(Box::new(routing())),
    }
}

/// The floors and non-streamed forms.
const FLOOR_FORMS: [Form; 12] = [
    (
        "noisy-tenant-floor",
        "The floor of noisy-tenant: its tenant b alone (the same requests at the same times) on replicas whose every step is timed as a full batch.",
        || at_floor(noisy_tenant_routing(Some("b"))),
    ),
    (
        "noisy-tenant-whole",
        "noisy-tenant with every answer non-streamed: the response head comes at the answer's end, so no first byte tells the router a request has started. What matters: b's latency against noisy-tenant-whole-floor.",
        || whole(noisy_tenant_routing(None)),
    ),
    (
        "noisy-tenant-whole-floor",
        "The floor of noisy-tenant-whole: its tenant b alone, non-streamed, on replicas timed as full batches.",
        || whole(at_floor(noisy_tenant_routing(Some("b")))),
    ),
    (
        "priority-floor",
        "The floor of priority: its high requests alone on replicas whose every step is timed as a full batch.",
        || at_floor(priority_routing(Some("high"))),
    ),
    (
        "priority-whole",
        "priority with every answer non-streamed. What matters: the high requests' latency against priority-whole-floor.",
        || whole(priority_routing(None)),
    ),
    (
        "priority-whole-floor",
        "The floor of priority-whole: its high requests alone, non-streamed, on replicas timed as full batches.",
        || whole(at_floor(priority_routing(Some("high")))),
    ),
    (
        "noisy-tenant-engine-floor",
        "The floor of noisy-tenant-engine: its tenant b alone on replicas of 64 sequences whose every step is timed as a full batch.",
        || at_floor(noisy_tenant_engine_routing(Some("b"))),
    ),
    (
        "noisy-tenant-engine-whole",
        "noisy-tenant-engine with every answer non-streamed. What matters: b's latency against noisy-tenant-engine-whole-floor.",
        || whole(noisy_tenant_engine_routing(None)),
    ),
    (
        "noisy-tenant-engine-whole-floor",
        "The floor of noisy-tenant-engine-whole: its tenant b alone, non-streamed, on replicas timed as full batches.",
        || whole(at_floor(noisy_tenant_engine_routing(Some("b")))),
    ),
    (
        "priority-engine-floor",
        "The floor of priority-engine: its high requests alone on replicas of 64 sequences whose every step is timed as a full batch.",
        || at_floor(priority_engine_routing(Some("high"))),
    ),
    (
        "priority-engine-whole",
        "priority-engine with every answer non-streamed. What matters: the high requests' latency against priority-engine-whole-floor.",
        || whole(priority_engine_routing(None)),
    ),
    (
        "priority-engine-whole-floor",
        "The floor of priority-engine-whole: its high requests alone, non-streamed, on replicas timed as full batches.",
        || whole(at_floor(priority_engine_routing(Some("high")))),
    ),
];

/// An LLM engine at speed 1: decode steps of 20 ms + 0.1 ms per sequence in the batch (20 to
/// 46 ms a token from 1 to 256 sequences), prefill 0.05 ms per uncached prompt token (20,000
/// tokens a second), chunked prefill of up to 2,048 tokens a step, blocks of 16 tokens.
fn llm_engine(slots: usize, kv_capacity_tokens: u64, prefix_cache_tokens: u64) -> SimConfig {
    SimConfig {
        slots,
        prefill_ms: 0.0,
        step_ms: 20.0,
        step_per_batch_ms: 0.1,
        prefill_per_token_ms: 0.05,
        kv_capacity_tokens: Some(kv_capacity_tokens),
        prefix_cache_tokens,
        block_tokens: 16,
        batching: Batching::Stepped {
            token_budget: 2_048,
        },
        default_max_tokens: 256,
        ..SimConfig::default()
    }
}

/// An LLM scenario: equal replicas of `engine` serving `workload`.
fn llm(replica_count: usize, engine: SimConfig, workload: Workload, slo: Slo) -> Routing {
    Routing {
        replicas: replicas(&vec![1.0; replica_count]),
        engine,
        initial_backends: replica_count,
        scale_up_after: None,
        traffic: Traffic::Users(workload),
        slo,
        reports_overload: false,
        seed_of: None,
        classifier: None,
        compression: 1.0,
    }
}

/// The SLO of the chat scenarios: first token within 2 s, then 100 ms a token on average (a
/// reading pace).
const CHAT_SLO: Slo = Slo {
    ttft_seconds: 2.0,
    ttft_seconds_per_prompt_token: 0.0,
    tpot_seconds: 0.100,
};

/// Tenants sharing long system prompts, their users in multi-turn chats.
fn tenants_chat(session_header: bool) -> Workload {
    Workload::Chat(Chat {
        tenants: 24,
        users_per_tenant: 9,
        shared_preamble_tokens: 1_000,
        tenant_prompt_tokens: (2_000, 4_000),
        turns: (3, 4),
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
        start_within: 15.0,
        session_header,
        stream: true,
    })
}

/// The replicas of the prefix scenarios: KV for about 30 of their requests, a prefix cache
/// smaller than all the tenants' prompts and histories.
fn prefix_engine() -> SimConfig {
    llm_engine(128, 150_000, 50_000)
}

fn prefix() -> Scenario {
    Scenario {
        name: "prefix",
        models: "Multi-tenant chat: tenants' long system prompts (thousands of tokens, all starting with one shared preamble), several users per tenant in multi-turn chats that resend their growing history, no session header. A replica that saw a prefix recently skips its prefill; the prefix cache of one replica cannot hold every tenant and history.",
        kind: Kind::Routing(Box::new(prefix_routing(false))),
    }
}

/// The prefix workloads: 4 replicas of [`prefix_engine`] serving [`tenants_chat`].
fn prefix_routing(session_header: bool) -> Routing {
    llm(4, prefix_engine(), tenants_chat(session_header), CHAT_SLO)
}

fn prefix_session() -> Scenario {
    Scenario {
        name: "prefix-session",
        models: "The prefix workload with every request naming its conversation in an `x-session-id` header, as a client that knows its sessions would.",
        kind: Kind::Routing(Box::new(prefix_routing(true))),
    }
}

/// The prompt tokens from which a `long-context` request is a document.
const LONG_PROMPT_TOKENS: u64 = 2_000;

/// `short` (a chat) or `long` (a document), by the prompt's tokens.
fn prompt_class(record: &Record) -> Option<&'static str> {
    Some(if record.prompt_tokens < LONG_PROMPT_TOKENS {
        "short"
    } else {
        "long"
    })
}

fn long_context() -> Scenario {
    let routing = llm(
        4,
        llm_engine(128, 200_000, 50_000),
        Workload::Documents(Documents {
            rate: 14.0,
            duration: 40.0,
            long_fraction: 0.25,
            long_prompt_tokens: (2_000, 32_000),
            short_prompt_tokens: (100, 1_000),
            answer_tokens: Lengths::LogNormal {
                median: 200.0,
                sigma: 0.5,
                min: 50,
                max: 1_000,
            },
            stream: true,
        }),
        LONG_PROMPT_SLO,
    );
    Scenario {
        name: "long-context",
        models: "Long documents among short chats: prompts from 100 to 32k tokens. A long prefill fills a replica's steps (chunked prefill) and slows every stream it decodes, and a long prompt reserves much of its KV cache.",
        kind: Kind::Routing(Box::new(Routing {
            classifier: Some(Classifier {
                names: &["short", "long"],
                about: "short: prompts under 2,000 tokens (the chats); long: the documents (2,000 to 32,000 tokens)",
                class_of: prompt_class,
            }),
            ..routing
        })),
    }
}

fn engine_scale() -> Scenario {
    Scenario {
        name: "engine-scale",
        models: "Replicas at engine scale: 2 replicas of 256 sequences each, their KV cache for about 230 typical requests; 500 streaming users arrive within 5 s and chat for two turns, answers of 200 to 2,000 tokens at 20 to 46 ms a token.",
        kind: Kind::Routing(Box::new(llm(
            2,
            llm_engine(256, 300_000, 100_000),
            Workload::Chat(Chat {
                tenants: 20,
                users_per_tenant: 25,
                shared_preamble_tokens: 200,
                tenant_prompt_tokens: (300, 800),
                turns: (2, 2),
                question_tokens: Lengths::LogNormal {
                    median: 50.0,
                    sigma: 0.7,
                    min: 10,
                    max: 300,
                },
                answer_tokens: Lengths::LogNormal {
                    median: 300.0,
                    sigma: 0.5,
                    min: 200,
                    max: 2_000,
                },
                think_seconds: (1.0, 3.0),
                start_within: 5.0,
                session_header: false,
                stream: true,
            }),
            CHAT_SLO,
        ))),
    }
}

/// The SLO of the long-prompt scenarios: a first token within 2 s plus twice the prefill of the
/// prompt on an idle replica, then 100 ms a token on average.
const LONG_PROMPT_SLO: Slo = Slo {
    ttft_seconds: 2.0,
    ttft_seconds_per_prompt_token: 0.000_1,
    tpot_seconds: 0.100,
};

/// The replicas of the trace replays: 4 engines of 32 sequences, KV cache for about 30 of the
/// replayed prompts, a prefix cache of 60,000 tokens (about 20 of them).
fn trace_replicas(trace: Trace) -> Routing {
    Routing {
        classifier: Some(Classifier {
            names: &["short", "long"],
            about: "short: prompts under 2,000 tokens as replayed; long: the others",
            class_of: prompt_class,
        }),
        ..llm(
            4,
            llm_engine(32, 100_000, 60_000),
            Workload::Trace(trace),
            LONG_PROMPT_SLO,
        )
    }
}

fn trace_conversation() -> Scenario {
    Scenario {
        name: "trace-conversation",
        models: "A production trace replayed: Mooncake's conversation workload (Kimi's online chat, multi-turn conversations resending their history), every request at its time with the trace's real prompt sharing; about a fifth of a window's prompt tokens are held by earlier requests.",
        kind: Kind::Routing(Box::new(trace_replicas(CONVERSATION_TRACE))),
    }
}

/// The window of the conversation trace replayed.
const CONVERSATION_TRACE: Trace = Trace {
    file: "conversation_trace.jsonl.gz",
    about: "Mooncake conversation trace",
    window_seconds: 300.0,
    speedup: 4.5,
    tokens_per_block: 128,
    output_scale: 0.25,
    stream: true,
};

fn trace_synthetic() -> Scenario {
    Scenario {
        name: "trace-synthetic",
        models: "A trace replayed: Mooncake's synthetic workload (multi-turn conversations from public datasets in their order, Poisson arrivals, long prompts), every request at its time with the trace's real prompt sharing; over the whole trace two thirds of the prompt tokens are held by earlier requests.",
        kind: Kind::Routing(Box::new(trace_replicas(SYNTHETIC_TRACE))),
    }
}

/// The window of the synthetic trace replayed: as the conversation trace's, a little slower.
const SYNTHETIC_TRACE: Trace = Trace {
    file: "synthetic_trace.jsonl.gz",
    about: "Mooncake synthetic trace",
    speedup: 4.0,
    ..CONVERSATION_TRACE
};

// --- The floors of the prefix workloads. ---
//
// What a request takes when where it runs does not decide what it finds cached: the same
// requests at the same times (the parent's seed), on the same replicas except that they read
// and fill one prefix cache as large as all of theirs together (`SimConfig::pooled_prefix_cache`).
// No placement of prompts on replicas holds more distinct prefixes than that cache, and a
// least-loaded router then loses nothing to locality: the floor a prefix-aware router's latency
// is measured against.

/// `routing` on replicas sharing one prefix cache, with the seed of `parent`.
fn pooled(mut routing: Routing, parent: &'static str) -> Routing {
    routing.engine.pooled_prefix_cache = true;
    routing.seed_of = Some(parent);
    routing
}

/// The floors of the prefix workloads.
const CACHE_FLOORS: [Form; 4] = [
    (
        "prefix-floor",
        "The floor of prefix: its requests at the same times on replicas sharing one prefix cache of their capacity together, so that no choice of replica loses a cache hit.",
        || pooled(prefix_routing(false), "prefix"),
    ),
    (
        "prefix-session-floor",
        "The floor of prefix-session: its requests at the same times on replicas sharing one prefix cache of their capacity together.",
        || pooled(prefix_routing(true), "prefix-session"),
    ),
    (
        "trace-conversation-floor",
        "The floor of trace-conversation: its window of the trace on replicas sharing one prefix cache of their capacity together.",
        || pooled(trace_replicas(CONVERSATION_TRACE), "trace-conversation"),
    ),
    (
        "trace-synthetic-floor",
        "The floor of trace-synthetic: its window of the trace on replicas sharing one prefix cache of their capacity together.",
        || pooled(trace_replicas(SYNTHETIC_TRACE), "trace-synthetic"),
    ),
];

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
    /// The tokens of the prefix cache the replicas share when they pool theirs: all of their
    /// capacity together.
    pub fn pooled_cache_tokens(&self) -> u64 {
        self.engine.prefix_cache_tokens * self.replicas.len() as u64
    }

    /// The simulator settings of replica `index` in `mode`.
    pub fn sim_config(&self, index: usize, seed: u64, mode: Mode) -> SimConfig {
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
            speed: replica.speed * self.time_compression(mode),
            seed: seed.wrapping_add(index as u64),
            faults,
            ..self.engine.clone()
        }
    }

    /// How much faster than real time the scenario runs in `mode`: the LLM scenarios compress
    /// time in quick and smoke modes; Poisson scenarios shorten their duration instead.
    pub fn time_compression(&self, mode: Mode) -> f64 {
        let by_mode = match &self.traffic {
            Traffic::Poisson(poisson) if !poisson.compressed => 1.0,
            Traffic::Poisson(_) | Traffic::Users(_) => mode.time_compression(),
        };
        by_mode * self.compression
    }

    /// How a users workload is shrunk in `mode`.
    fn workload_scale(&self, mode: Mode) -> Scale {
        Scale {
            users: mode.user_fraction(),
            time_compression: self.time_compression(mode),
        }
    }

    /// Requests per second all replicas finish with every slot busy (the model's capacity), for
    /// Poisson traffic.
    pub fn capacity(&self) -> Option<f64> {
        let Traffic::Poisson(poisson) = &self.traffic else {
            return None;
        };
        let mean_tokens = poisson.lengths.mean();
        Some(
            (0..self.replicas.len())
                .map(|index| {
                    self.sim_config(index, 0, Mode::Default)
                        .capacity(mean_tokens)
                })
                .sum(),
        )
    }

    /// [`Routing::capacity`] of the replicas as run in `mode` (a compressed scenario's replicas
    /// run faster in quick and smoke modes), what a run's goodput is set against.
    pub fn capacity_as_run(&self, mode: Mode) -> Option<f64> {
        Some(self.capacity()? * self.time_compression(mode))
    }

    /// [`Routing::rate`] as run in `mode` (a compressed scenario's arrivals come faster).
    pub fn rate_as_run(&self, mode: Mode) -> Option<f64> {
        Some(self.rate()? * self.time_compression(mode))
    }

    /// The offered arrival rate, for Poisson traffic (of the class sent alone, when one is).
    pub fn rate(&self) -> Option<f64> {
        let Traffic::Poisson(poisson) = &self.traffic else {
            return None;
        };
        let share = match poisson.mix.only {
            Some(only) => poisson
                .mix
                .classes
                .iter()
                .filter(|class| class.name == only)
                .map(|class| class.share)
                .sum(),
            None => 1.0,
        };
        Some(share * self.arrival_rate()?)
    }

    /// The arrival rate of the schedule drawn (before a class alone is kept), at the default
    /// mode's speed.
    fn arrival_rate(&self) -> Option<f64> {
        let Traffic::Poisson(poisson) = &self.traffic else {
            return None;
        };
        Some(poisson.load_fraction * self.capacity()?)
    }

    /// The requests of one run of a Poisson traffic: `load` drawn with the traffic's classes and
    /// header fields, only the class sent alone kept when one is.
    pub fn schedule(&self, load: &OpenLoop, mode: Mode) -> Vec<Planned> {
        let Traffic::Poisson(poisson) = &self.traffic else {
            return Vec::new();
        };
        let mut headers = Vec::new();
        if let Some(millis) = self.deadline_millis(mode) {
            headers.push((
                http::HeaderName::from_static(DEADLINE_HEADER),
                http::HeaderValue::from(millis),
            ));
        }
        let mut schedule = load::plan_classes(load, &poisson.mix.classes, &headers);
        if let Some(only) = poisson.mix.only {
            schedule.retain(|planned| planned.class == Some(only));
        }
        schedule
    }

    /// The [`DEADLINE_HEADER`] value of every request in `mode`, when the traffic sends one:
    /// the SLO's first-token bound as the run sees it, in milliseconds.
    pub fn deadline_millis(&self, mode: Mode) -> Option<u64> {
        let Traffic::Poisson(poisson) = &self.traffic else {
            return None;
        };
        poisson.mix.deadline_from_slo.then(|| {
            let slo = self.slo.scaled(self.time_compression(mode));
            (slo.ttft_seconds * 1000.0).round() as u64
        })
    }

    /// The classes with numbers of their own, in report order: the classifier's, or the
    /// classes of a Poisson traffic (only the one sent alone, when one is).
    pub fn class_names(&self) -> Vec<String> {
        if let Some(classifier) = &self.classifier {
            return classifier.names.iter().map(|&n| n.to_owned()).collect();
        }
        let Traffic::Poisson(poisson) = &self.traffic else {
            return Vec::new();
        };
        poisson
            .mix
            .classes
            .iter()
            .filter(|class| poisson.mix.only.is_none_or(|only| only == class.name))
            .map(|class| class.name.to_owned())
            .collect()
    }

    /// The class of `record`: by the classifier, or the class drawn for it.
    pub fn class_of(&self, record: &Record) -> Option<&'static str> {
        match &self.classifier {
            Some(classifier) => (classifier.class_of)(record),
            None => record.class,
        }
    }

    /// What the classes are, one line (empty without classes).
    pub fn describe_classes(&self) -> String {
        if let Some(classifier) = &self.classifier {
            return classifier.about.to_owned();
        }
        let Traffic::Poisson(poisson) = &self.traffic else {
            return String::new();
        };
        let classes: Vec<String> = poisson
            .mix
            .classes
            .iter()
            .map(|class| {
                let headers: Vec<String> = class
                    .headers
                    .iter()
                    .map(|(name, value)| {
                        format!("`{name}: {}`", value.to_str().unwrap_or("(binary)"))
                    })
                    .collect();
                format!(
                    "{} {:.1}% of arrivals ({})",
                    class.name,
                    class.share * 100.0,
                    if headers.is_empty() {
                        "no header".to_owned()
                    } else {
                        headers.join(", ")
                    }
                )
            })
            .collect();
        let mut text = classes.join("; ");
        if let Some(only) = poisson.mix.only {
            let _ = write!(text, "; only the requests of class {only} are sent");
        }
        text
    }

    /// The open-loop load of one run, for Poisson traffic.
    pub fn open_loop(&self, mode: Mode, seed: u64) -> Option<OpenLoop> {
        let Traffic::Poisson(poisson) = &self.traffic else {
            return None;
        };
        let duration = Duration::from_secs_f64(self.arrival_seconds(poisson, mode));
        Some(OpenLoop {
            // A compressed run's replicas are that much faster: as many requests, sooner.
            rate: self.arrival_rate()? * self.time_compression(mode),
            duration,
            burst: poisson.burst,
            lengths: poisson.lengths.clone(),
            stream_fraction: poisson.stream_fraction,
            seed,
            request_timeout: duration + mode.drain_limit(),
            max_requests: 100_000,
        })
    }

    /// One line describing the set-up.
    pub fn describe(&self, mode: Mode) -> String {
        let traffic = match &self.traffic {
            Traffic::Poisson(poisson) if poisson.compressed => format!(
                "{}; {}",
                self.describe_engine(mode),
                self.describe_arrivals(poisson, mode)
            ),
            Traffic::Poisson(poisson) => self.describe_small_replicas(poisson, mode),
            Traffic::Users(workload) => format!(
                "{}; {}",
                self.describe_engine(mode),
                workload.describe(self.workload_scale(mode))
            ),
        };
        let floor = if self.engine.full_batch {
            "; every step timed as a full batch (the floor)".to_owned()
        } else if self.engine.pooled_prefix_cache {
            format!(
                "; every replica reads and fills one prefix cache of {} tokens, their capacity together (the floor)",
                self.pooled_cache_tokens()
            )
        } else {
            String::new()
        };
        format!(
            "{traffic}{floor}; SLO: {}",
            self.slo.scaled(self.time_compression(mode)).describe()
        )
    }

    fn describe_small_replicas(&self, poisson: &Poisson, mode: Mode) -> String {
        let speeds: Vec<String> = self
            .replicas
            .iter()
            .map(|replica| format!("{}", replica.speed))
            .collect();
        let config = &self.engine;
        format!(
            "{} replicas (speeds {}; {} slots; prefill {} ms, step {} + {} × batch ms at speed 1); {}",
            self.replicas.len(),
            speeds.join(", "),
            config.slots,
            config.prefill_ms,
            config.step_ms,
            config.step_per_batch_ms,
            self.describe_arrivals(poisson, mode),
        )
    }

    /// Seconds of arrivals of `poisson` in `mode`: shortened, and compressed in time when the
    /// run is.
    fn arrival_seconds(&self, poisson: &Poisson, mode: Mode) -> f64 {
        poisson.duration * mode.time_scale() / self.time_compression(mode)
    }

    /// The answers, the arrivals and what the requests carry, as the tail of the set-up line.
    fn describe_arrivals(&self, poisson: &Poisson, mode: Mode) -> String {
        let seconds = self.arrival_seconds(poisson, mode);
        // Tenths of a second, or hundredths for a compressed run's short spans.
        let decimals = if poisson.compressed { 2 } else { 1 };
        format!(
            "{}; {:.0}% streamed; {seconds:.decimals$} s of arrivals{}",
            poisson.lengths.describe(),
            poisson.stream_fraction * 100.0,
            if poisson.burst > 0 {
                format!(", burst of {} at 0 s", poisson.burst)
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
        }) + &self.describe_mix(poisson, mode)
    }

    /// The classes, the header fields of every request and the borrowed seed, as a tail of the
    /// set-up line.
    fn describe_mix(&self, poisson: &Poisson, mode: Mode) -> String {
        let mut text = String::new();
        if !poisson.mix.classes.is_empty() {
            let _ = write!(text, "; classes: {}", self.describe_classes());
        }
        if let Some(millis) = self.deadline_millis(mode) {
            let _ = write!(text, "; every request with `{DEADLINE_HEADER}: {millis}`");
        }
        if let Some(name) = self.seed_of {
            let _ = write!(text, "; the seed (and schedule) of {name}");
        }
        text
    }

    fn describe_engine(&self, mode: Mode) -> String {
        let config = &self.engine;
        let budget = match config.batching {
            Batching::Stepped { token_budget } => {
                format!("stepped batching, chunked prefill of {token_budget} tokens a step")
            }
            Batching::PerRequest => "per-request batching".to_owned(),
        };
        let compression = self.time_compression(mode);
        format!(
            "{} replicas ({} sequences, KV cache {} tokens, prefix cache {} tokens in blocks of {}; {budget}; decode step {} + {} × batch ms, prefill {} ms a token{})",
            self.replicas.len(),
            config.slots,
            config
                .kv_capacity_tokens
                .map_or_else(|| "unlimited".to_owned(), |t| t.to_string()),
            config.prefix_cache_tokens,
            config.block_tokens,
            config.step_ms,
            config.step_per_batch_ms,
            config.prefill_per_token_ms,
            if compression == 1.0 {
                String::new()
            } else {
                format!("; every time ÷ {compression}")
            },
        )
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
    /// Whether router peers write their access log (`--access-logs`), one file per scenario
    /// and seed in their work directory.
    pub access_logs: bool,
}

impl RunContext<'_> {
    /// Where `peer` writes its access log in `scenario`, when access logs are asked for.
    fn access_log(&self, scenario: &str, peer: &PeerSpec) -> Option<std::path::PathBuf> {
        self.access_logs.then(|| {
            self.work_dir
                .join(peer.name())
                .join(format!("access-{scenario}-seed{}.jsonl", self.seed))
        })
    }
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
    sim: Option<SimHandle>,
}

async fn start_replicas(
    routing: &Routing,
    seed: u64,
    mode: Mode,
) -> Result<Vec<StartedReplica>, LabError> {
    let mut started = Vec::new();
    let shared_cache = routing
        .engine
        .pooled_prefix_cache
        .then(|| SharedCache::new(routing.pooled_cache_tokens(), routing.engine.block_tokens));
    for (index, replica) in routing.replicas.iter().enumerate() {
        if replica.fault == ReplicaFault::RefusesConnections {
            started.push(StartedReplica {
                address: refusing_address()?.to_string(),
                sim: None,
            });
            continue;
        }
        let config = SimConfig {
            shared_cache: shared_cache.clone(),
            ..routing.sim_config(index, seed, mode)
        };
        let handle = sim::spawn(config).await?;
        started.push(StartedReplica {
            address: handle.host_port(),
            sim: Some(handle),
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
    let seed = scenario_seed(routing.seed_of.unwrap_or(scenario), context.seed);
    let started = tokio::time::Instant::now();
    let replicas = start_replicas(routing, seed, context.mode).await?;
    let addresses: Vec<String> = replicas.iter().map(|r| r.address.clone()).collect();
    let stats: Vec<Arc<SimStats>> = replicas
        .iter()
        .filter_map(|replica| Some(Arc::clone(&replica.sim.as_ref()?.stats)))
        .collect();
    let initial = &addresses[..routing.initial_backends.min(addresses.len())];
    let access_log = context.access_log(scenario, peer);
    let mut running = peer
        .start(
            context.router_binary,
            context.work_dir,
            initial,
            access_log.as_deref(),
        )
        .await?;
    let peer_ready = started.elapsed().as_secs_f64();
    let load_task = match (&routing.traffic, routing.open_loop(context.mode, seed)) {
        (Traffic::Poisson(_), Some(load)) => tokio::spawn(load::run_open_loop(
            running.addr(),
            routing.schedule(&load, context.mode),
            load.request_timeout,
            None,
        )),
        (Traffic::Users(workload), _) => tokio::spawn(load::run_users(
            running.addr(),
            workload.users(seed, routing.workload_scale(context.mode)),
            users_request_timeout(context.mode),
        )),
        (Traffic::Poisson(_), None) => return Err(LabError::new("no open-loop load")),
    };
    let (sampling_done, done) = tokio::sync::oneshot::channel();
    let engine_scale = match &routing.traffic {
        Traffic::Users(_) => true,
        Traffic::Poisson(poisson) => poisson.compressed,
    };
    let every = ENGINE_SAMPLE_INTERVAL
        .div_f64(routing.time_compression(context.mode))
        .max(MIN_ENGINE_SAMPLE_INTERVAL);
    let sampler = engine_scale.then(|| {
        tokio::spawn(sample_engines(
            stats.clone(),
            routing.engine.clone(),
            every,
            done,
        ))
    });
    let mut scale_up_error = None;
    if let Some(after) = routing.scale_up_after {
        tokio::time::sleep(Duration::from_secs_f64(after * context.mode.time_scale())).await;
        scale_up_error = running.set_backends(&addresses).await.err();
    }
    let records = load_task.await.map_err(|e| LabError::new(e.to_string()))?;
    let _ = sampling_done.send(());
    let engine_samples = match sampler {
        Some(sampler) => sampler.await.ok(),
        None => None,
    };
    let exited = running.exited();
    running.stop().await;
    eprintln!(
        "[bench] {scenario} {}: ready after {peer_ready:.1} s, {} requests done after {:.1} s",
        peer.name(),
        records.len(),
        started.elapsed().as_secs_f64()
    );
    drop(replicas);
    if let Some(error) = scale_up_error {
        return Err(error);
    }
    if let Some(why) = exited {
        return Err(LabError::new(format!(
            "{} exited during the run: {why}",
            peer.name()
        )));
    }
    let names: Vec<String> = routing.replicas.iter().map(|r| r.name.clone()).collect();
    let slo = routing.slo.scaled(routing.time_compression(context.mode));
    let mut metrics = summary::summarize(&records, &names, &slo);
    let classes = routing.class_names();
    if !classes.is_empty() {
        let class_of = |record: &Record| routing.class_of(record);
        metrics.extend(summary::summarize_classes(
            &records, &classes, class_of, &slo,
        ));
    }
    if routing.engine.prefix_cache_tokens > 0 {
        add_prefix_cache_metrics(&mut metrics, &stats);
    }
    if let Some(samples) = engine_samples {
        samples.add_metrics(&mut metrics);
    }
    if routing.reports_overload {
        if let Some(capacity) = routing.capacity_as_run(context.mode) {
            add_overload_metrics(&mut metrics, &records, capacity);
        }
    }
    Ok(PeerRun {
        metrics,
        latencies: success_latencies(&records),
    })
}

/// How long a users request may take (its answer can last a minute at full batch).
fn users_request_timeout(mode: Mode) -> Duration {
    3 * mode.drain_limit()
}

/// The prefix-cache hit ratio over every replica: prompt tokens found in a replica's cache over
/// prompt tokens looked up, from the replicas' counters (`vllm:prefix_cache_hits_total` over
/// `vllm:prefix_cache_queries_total`).
fn add_prefix_cache_metrics(metrics: &mut Metrics, stats: &[Arc<SimStats>]) {
    let queried: u64 = stats
        .iter()
        .map(|s| SimStats::get(&s.prefix_queried_tokens))
        .sum();
    let hits: u64 = stats
        .iter()
        .map(|s| SimStats::get(&s.prefix_hit_tokens))
        .sum();
    if queried > 0 {
        metrics.insert(
            "prefix_hit_pct".to_owned(),
            100.0 * hits as f64 / queried as f64,
        );
    }
}

/// The replicas' batches, queues and KV cache, sampled every [`ENGINE_SAMPLE_INTERVAL`] while
/// at least one request is in a replica: means per replica, the largest batch of one replica,
/// the most requests waiting in all replicas together, the mean share of KV cache reserved.
#[derive(Debug, Default)]
struct EngineSamples {
    samples: u64,
    running: f64,
    waiting: f64,
    max_running: usize,
    max_waiting: usize,
    kv_usage: f64,
    replicas: usize,
}

impl EngineSamples {
    fn add(&mut self, stats: &[Arc<SimStats>], engine: &SimConfig) {
        let batches: Vec<usize> = stats
            .iter()
            .map(|s| s.decoding.load(std::sync::atomic::Ordering::Relaxed))
            .collect();
        let running: usize = batches.iter().sum();
        let waiting: usize = stats
            .iter()
            .map(|s| s.waiting.load(std::sync::atomic::Ordering::Relaxed))
            .sum();
        if running + waiting == 0 {
            return;
        }
        let reserved: u64 = stats
            .iter()
            .map(|s| {
                s.kv_reserved_tokens
                    .load(std::sync::atomic::Ordering::Relaxed)
            })
            .sum();
        let capacity = engine.kv_capacity_tokens.unwrap_or(0) * stats.len() as u64;
        self.samples += 1;
        self.replicas = stats.len().max(1);
        self.running += running as f64;
        self.waiting += waiting as f64;
        self.max_waiting = self.max_waiting.max(waiting);
        self.max_running = batches.into_iter().fold(self.max_running, usize::max);
        if capacity > 0 {
            self.kv_usage += reserved as f64 / capacity as f64;
        }
    }

    fn add_metrics(&self, metrics: &mut Metrics) {
        if self.samples == 0 {
            return;
        }
        let samples = self.samples as f64;
        let per_replica = samples * self.replicas as f64;
        metrics.insert("engine_running_mean".to_owned(), self.running / per_replica);
        metrics.insert("engine_waiting_mean".to_owned(), self.waiting / per_replica);
        metrics.insert("engine_running_max".to_owned(), self.max_running as f64);
        metrics.insert("engine_waiting_max".to_owned(), self.max_waiting as f64);
        metrics.insert(
            "kv_usage_mean_pct".to_owned(),
            100.0 * self.kv_usage / samples,
        );
    }
}

/// Samples the replicas `every` so often until `done` fires.
async fn sample_engines(
    stats: Vec<Arc<SimStats>>,
    engine: SimConfig,
    every: Duration,
    mut done: tokio::sync::oneshot::Receiver<()>,
) -> EngineSamples {
    let mut samples = EngineSamples::default();
    let mut ticker = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = &mut done => return samples,
            _ = ticker.tick() => samples.add(&stats, &engine),
        }
    }
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
        .start(context.router_binary, context.work_dir, &backends, None)
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
        summary::percentile(&latencies, 0.50),
        summary::percentile(&latencies, 0.99),
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
