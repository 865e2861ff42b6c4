//! The benchmark suite in smoke mode (tiny durations, no nginx): every scenario reports every
//! registered strategy with numbers, and the markdown, JSON and SVG files are written. Also checks
//! the simulated replica's timing model and fault modes.

#[path = "../benches/lab/mod.rs"]
mod lab;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use custom_router::strategies::REGISTRY;
use lab::load::{self, Record};
use lab::report::ScenarioReport;
use lab::sim::{self, Faults, SimConfig};

fn smoke_options(out_dir: PathBuf) -> lab::SuiteOptions {
    lab::SuiteOptions {
        mode: lab::Mode::Smoke,
        scenarios: Vec::new(),
        strategies: Vec::new(),
        nginx: false,
        seed: 1,
        runs: 1,
        out_dir,
        router_binary: PathBuf::from(env!("CARGO_BIN_EXE_custom-router")),
        command: "tests/bench_smoke.rs".to_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_smoke_suite_reports_every_scenario_and_strategy() {
    let out_dir =
        std::env::temp_dir().join(format!("custom-router-bench-smoke-{}", std::process::id()));
    let options = smoke_options(out_dir.clone());
    let started = Instant::now();
    let report = lab::run_suite(&options).await.expect("the suite runs");
    let files = lab::report::write_all(&report, &out_dir).expect("the report is written");
    eprintln!("smoke suite took {:.1} s", started.elapsed().as_secs_f64());

    let scenarios = lab::scenarios::all();
    assert_eq!(report.scenarios.len(), scenarios.len());
    for scenario in &scenarios {
        let reported = report
            .scenarios
            .iter()
            .find(|r| r.name == scenario.name)
            .unwrap_or_else(|| panic!("{} missing from the report", scenario.name));
        for entry in REGISTRY {
            check_peer_numbers(reported, entry.name);
        }
        // Run with a configuration file of strategy parameters.
        check_peer_numbers(reported, lab::REFERENCE_RULES);
    }

    let markdown = std::fs::read_to_string(out_dir.join("report.md")).unwrap();
    for scenario in &scenarios {
        assert!(markdown.contains(&format!("## {}", scenario.name)));
        assert!(files.contains(&out_dir.join(format!("{}.svg", scenario.name))));
        let svg = std::fs::read_to_string(out_dir.join(format!("{}.svg", scenario.name))).unwrap();
        assert!(
            svg.contains("<svg") && svg.contains("<polyline"),
            "{}",
            scenario.name
        );
    }
    for entry in REGISTRY {
        assert!(
            markdown.contains(&format!("| {} |", entry.name)),
            "{}",
            entry.name
        );
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("report.json")).unwrap())
            .expect("valid JSON");
    assert_eq!(
        json["scenarios"].as_array().map(Vec::len),
        Some(scenarios.len())
    );
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// `strategy` ran in `scenario` without error and has the scenario's numbers.
fn check_peer_numbers(scenario: &ScenarioReport, strategy: &str) {
    let peer = scenario
        .peers
        .iter()
        .find(|p| p.peer == strategy)
        .unwrap_or_else(|| panic!("{}: {strategy} missing", scenario.name));
    assert!(
        peer.errors.is_empty(),
        "{}: {strategy}: {:?}",
        scenario.name,
        peer.errors
    );
    let keys: &[&str] = if scenario.concurrencies.is_empty() {
        &[
            "requests",
            "latency_p50_s",
            "latency_p99_s",
            "ttfb_p50_s",
            "goodput_rps",
            "error_pct",
        ]
    } else {
        &[
            "rps_c1",
            "rps_c32",
            "added_p50_us_c1",
            "cpu_us_per_request_c32",
            "rss_idle_mib",
            "rss_load_mib_c32",
        ]
    };
    for key in keys {
        let value = peer.median.get(*key).copied();
        assert!(
            value.is_some_and(f64::is_finite),
            "{}: {strategy}: {key} = {value:?}",
            scenario.name
        );
    }
    for key in [
        "requests",
        "goodput_rps",
        "rps_c1",
        "rps_c32",
        "rss_idle_mib",
    ] {
        if let Some(value) = peer.median.get(key) {
            assert!(
                *value > 0.0,
                "{}: {strategy}: {key} = {value}",
                scenario.name
            );
        }
    }
}

async fn one_request(
    replica: &sim::SimHandle,
    max_tokens: u32,
    stream: bool,
    limit: Duration,
) -> Record {
    let client = load::http_client();
    let body = load::request_body(max_tokens, stream);
    load::send(&client, replica.addr, body, 0.0, limit).await
}

fn fast_config(faults: Faults) -> SimConfig {
    SimConfig {
        name: "test".to_owned(),
        slots: 1,
        prefill_ms: 5.0,
        step_ms: 1.0,
        step_per_batch_ms: 0.0,
        faults,
        ..SimConfig::default()
    }
}

#[tokio::test]
async fn a_replica_answers_after_prefill_and_decode_steps() {
    let config = SimConfig {
        prefill_ms: 40.0,
        step_ms: 5.0,
        step_per_batch_ms: 1.0,
        ..fast_config(Faults::default())
    };
    let model_seconds = config.full_batch_seconds(20.0);
    let replica = sim::spawn(config).await.unwrap();
    for stream in [false, true] {
        let record = one_request(&replica, 20, stream, Duration::from_secs(10)).await;
        assert!(record.is_success(), "{record:?}");
        assert_eq!(record.replica.as_deref(), Some("test"));
        assert!(
            record.latency >= model_seconds,
            "{record:?} < {model_seconds}"
        );
        assert!(record.latency < model_seconds + 0.5, "{record:?}");
        if stream {
            assert!(record.ttfb < record.latency, "{record:?}");
        }
    }
}

#[tokio::test]
async fn a_failing_replica_answers_500_at_once() {
    let replica = sim::spawn(fast_config(Faults {
        fail_fraction: 1.0,
        ..Faults::default()
    }))
    .await
    .unwrap();
    let record = one_request(&replica, 50, true, Duration::from_secs(10)).await;
    assert_eq!(record.status, 500);
    assert_eq!(record.replica.as_deref(), Some("test"));
    assert!(record.latency < 0.04, "{record:?}");
}

#[tokio::test]
async fn a_full_replica_queue_answers_429_with_retry_after() {
    let replica = sim::spawn(fast_config(Faults {
        queue_limit: Some(1),
        reject_status: 429,
        ..Faults::default()
    }))
    .await
    .unwrap();
    let client = load::http_client();
    let send = |tokens| {
        let client = client.clone();
        let addr = replica.addr;
        tokio::spawn(async move {
            load::send(
                &client,
                addr,
                load::request_body(tokens, false),
                0.0,
                Duration::from_secs(10),
            )
            .await
        })
    };
    let decoding = send(100);
    wait_until(|| {
        replica
            .stats
            .decoding
            .load(std::sync::atomic::Ordering::SeqCst)
            == 1
    })
    .await;
    let waiting = send(1);
    wait_until(|| {
        replica
            .stats
            .waiting
            .load(std::sync::atomic::Ordering::SeqCst)
            == 1
    })
    .await;
    let rejected = send(1).await.unwrap();
    assert_eq!(rejected.status, 429);
    assert!(decoding.await.unwrap().is_success());
    assert!(waiting.await.unwrap().is_success());
}

#[tokio::test]
async fn a_replica_can_close_mid_stream_hang_and_exit() {
    let closing = sim::spawn(fast_config(Faults {
        close_after_tokens: Some(3),
        ..Faults::default()
    }))
    .await
    .unwrap();
    let record = one_request(&closing, 10, true, Duration::from_secs(10)).await;
    assert_eq!(
        (record.status, record.complete, record.error),
        (200, false, Some("body"))
    );

    let hanging = sim::spawn(fast_config(Faults {
        hang_fraction: 1.0,
        ..Faults::default()
    }))
    .await
    .unwrap();
    let record = one_request(&hanging, 1, false, Duration::from_millis(300)).await;
    assert_eq!(record.error, Some("timeout"));

    let exiting = sim::spawn(fast_config(Faults {
        exit_after: Some(Duration::from_millis(100)),
        ..Faults::default()
    }))
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(5), exiting.stopped())
        .await
        .expect("the replica exits");
    wait_until(|| exiting.is_stopped()).await;
    let record = one_request(&exiting, 1, false, Duration::from_secs(5)).await;
    assert_eq!(record.error, Some("connect"), "{record:?}");
}

/// Polls `condition` every 5 ms for up to 5 s.
async fn wait_until(condition: impl Fn() -> bool) {
    for _ in 0..1000 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("condition not reached within 5 s");
}

#[test]
fn a_strategy_spec_carries_its_parameters_into_the_config_file() {
    use lab::peer::StrategySpec;
    let spec = StrategySpec::parse(
        "queued-least-latency:score=ewma,ramp_up_factor=3,config.queue.shed_ratio=0",
    )
    .unwrap();
    assert_eq!(spec.name, "queued-least-latency");
    assert_eq!(
        spec.label(),
        "queued-least-latency:score=ewma,ramp_up_factor=3,config.queue.shed_ratio=0"
    );
    let toml = spec.config_toml();
    assert!(
        toml.starts_with("queue.shed_ratio = 0\n[strategy]\n"),
        "{toml}"
    );
    assert!(toml.contains("name = \"queued-least-latency\""), "{toml}");
    assert!(toml.contains("score = \"ewma\""), "{toml}");
    assert!(toml.contains("ramp_up_factor = 3\n"), "{toml}");
    assert_eq!(
        StrategySpec::parse("round-robin").unwrap().label(),
        "round-robin"
    );
    let error = StrategySpec::parse("round-robin:oops")
        .unwrap_err()
        .to_string();
    assert!(error.contains("KEY=VALUE"), "{error}");
    let error = lab::peer_specs(&["no-such:score=ewma".to_owned()], None)
        .expect_err("unknown strategy")
        .to_string();
    assert!(error.contains("no-such"), "{error}");
}
