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
        gateways: false,
        gateway_specs: Vec::new(),
        seed: 1,
        runs: 1,
        out_dir,
        router_binary: PathBuf::from(env!("CARGO_BIN_EXE_custom-router")),
        command: "tests/bench_smoke.rs".to_owned(),
        access_logs: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_smoke_suite_reports_every_scenario_and_strategy() {
    let out_dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("custom-router-bench-smoke-{}", std::process::id()));
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
        if let lab::scenarios::Kind::Routing(routing) = &scenario.kind {
            assert!(reported.slo.is_some(), "{}", scenario.name);
            if routing.engine.prefix_cache_tokens > 0 {
                for entry in REGISTRY {
                    check_engine_numbers(reported, entry.name);
                }
            }
            assert_eq!(reported.classes, routing.class_names(), "{}", scenario.name);
            for entry in REGISTRY {
                check_class_numbers(reported, entry.name);
            }
        }
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
            "slo_goodput_rps",
            "slo_pct",
            "error_pct",
            "refused_pct",
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

/// Every class of `scenario` has its request count, and the classes' counts add up to the
/// requests (every request of these scenarios has a class; one run, so the medians are the
/// run's numbers).
fn check_class_numbers(scenario: &ScenarioReport, strategy: &str) {
    let peer = scenario.peers.iter().find(|p| p.peer == strategy).unwrap();
    let mut total = 0.0;
    for class in &scenario.classes {
        let value = peer.median.get(&format!("requests.{class}")).copied();
        assert!(
            value.is_some_and(|v| v.is_finite() && v >= 0.0),
            "{}: {strategy}: requests.{class} = {value:?}",
            scenario.name
        );
        total += value.unwrap_or(0.0);
    }
    if let (false, Some(requests)) = (scenario.classes.is_empty(), peer.median.get("requests")) {
        assert_eq!(total, *requests, "{}: {strategy}", scenario.name);
    }
}

/// An LLM scenario's peer has the numbers read from its replicas.
fn check_engine_numbers(scenario: &ScenarioReport, strategy: &str) {
    let peer = scenario.peers.iter().find(|p| p.peer == strategy).unwrap();
    for key in [
        "prefix_hit_pct",
        "engine_running_mean",
        "engine_waiting_mean",
        "kv_usage_mean_pct",
    ] {
        let value = peer.median.get(key).copied();
        assert!(
            value.is_some_and(|v| v.is_finite() && v >= 0.0),
            "{}: {strategy}: {key} = {value:?}",
            scenario.name
        );
    }
}

async fn one_request(
    replica: &sim::SimHandle,
    max_tokens: u32,
    stream: bool,
    limit: Duration,
) -> Record {
    let client = load::http_client();
    let request = load::Outgoing::generate(max_tokens, stream);
    load::send(&client, replica.addr, &request, 0.0, limit).await
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
                &load::Outgoing::generate(tokens, false),
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

// --- The simulator's LLM physics: prompts, prefix cache, KV capacity, chunked prefill. ---

/// An engine with a per-token prefill cost, a prefix cache of 10,000 tokens and 1 ms steps.
fn engine_config(batching: sim::Batching) -> SimConfig {
    SimConfig {
        name: "engine".to_owned(),
        slots: 8,
        prefill_ms: 0.0,
        step_ms: 1.0,
        step_per_batch_ms: 0.0,
        prefill_per_token_ms: 0.1,
        prefix_cache_tokens: 10_000,
        batching,
        ..SimConfig::default()
    }
}

/// A streamed OpenAI completion of `prompt`.
fn completion(prompt: &str, max_tokens: u32) -> load::Outgoing {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true});
    load::Outgoing {
        path: "/v1/completions".to_owned(),
        body: body.to_string().into(),
        headers: Vec::new(),
        max_tokens,
        stream: true,
        prompt_tokens: sim::prompt::Prompt::of_body(&body).tokens(),
    }
}

async fn send_to(replica: &sim::SimHandle, request: &load::Outgoing) -> Record {
    let client = load::http_client();
    load::send(&client, replica.addr, request, 0.0, Duration::from_secs(20)).await
}

async fn scrape(replica: &sim::SimHandle) -> String {
    use http_body_util::BodyExt;
    let request = http::Request::get(format!("http://{}/metrics", replica.addr))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let response = load::http_client().request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

/// The value of `name` (any labels) in a Prometheus text `page`.
fn sample(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| line.split(['{', ' ']).next() == Some(name))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in\n{page}"))
}

#[tokio::test]
async fn a_replica_prefills_uncached_prompt_tokens_and_skips_its_cached_prefix() {
    for batching in [
        sim::Batching::PerRequest,
        sim::Batching::Stepped { token_budget: 256 },
    ] {
        let replica = sim::spawn(engine_config(batching)).await.unwrap();
        // 2,000 tokens: 200 ms of prefill at 0.1 ms a token.
        let prompt = "abcd".repeat(2_000);
        let first = send_to(&replica, &completion(&prompt, 4)).await;
        let second = send_to(&replica, &completion(&prompt, 4)).await;
        assert!(
            first.is_success() && second.is_success(),
            "{first:?} {second:?}"
        );
        assert!(first.ttfb >= 0.2, "{batching:?}: {first:?}");
        assert!(second.ttfb < 0.1, "{batching:?}: {second:?}");
        let page = scrape(&replica).await;
        assert_eq!(sample(&page, "vllm:prefix_cache_queries_total"), 4_000.0);
        // Every block but the last token, which is computed to yield the first output token.
        assert_eq!(sample(&page, "vllm:prefix_cache_hits_total"), 1_999.0);
        assert_eq!(sample(&page, "vllm:generation_tokens_total"), 8.0);
        assert_eq!(replica.stats.prefix_hit_ratio(), Some(1_999.0 / 4_000.0));
    }
}

#[tokio::test]
async fn a_long_prefill_slows_the_decode_steps_of_its_replica() {
    let config = SimConfig {
        prefill_per_token_ms: 0.05,
        step_ms: 2.0,
        prefix_cache_tokens: 0,
        ..engine_config(sim::Batching::Stepped { token_budget: 512 })
    };
    let replica = sim::spawn(config).await.unwrap();
    let stream = completion("hello", 200);
    let alone = send_to(&replica, &stream).await;
    // The same stream while a 20,000-token prompt is prefilled in 40 chunks of about 27 ms.
    let beside = tokio::spawn({
        let client = load::http_client();
        let (addr, stream) = (replica.addr, stream.clone());
        async move { load::send(&client, addr, &stream, 0.0, Duration::from_secs(20)).await }
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let long = send_to(&replica, &completion(&"w".repeat(80_000), 1)).await;
    let beside = beside.await.unwrap();
    assert!(alone.is_success() && beside.is_success() && long.is_success());
    assert!(long.ttfb >= 1.0, "{long:?}");
    assert!(
        beside.latency > alone.latency + 0.5,
        "alone {alone:?}, beside a long prefill {beside:?}"
    );
}

#[tokio::test]
async fn requests_wait_inside_a_replica_whose_kv_cache_is_full() {
    let config = SimConfig {
        kv_capacity_tokens: Some(1_000),
        ..engine_config(sim::Batching::Stepped { token_budget: 256 })
    };
    let replica = sim::spawn(config).await.unwrap();
    // 1 + 900 tokens reserved for about 0.9 s: the next 1 + 200 do not fit.
    let holder = tokio::spawn({
        let (client, addr) = (load::http_client(), replica.addr);
        async move {
            let request = completion("", 900);
            load::send(&client, addr, &request, 0.0, Duration::from_secs(20)).await
        }
    });
    wait_until(|| {
        replica
            .stats
            .decoding
            .load(std::sync::atomic::Ordering::SeqCst)
            == 1
    })
    .await;
    let waiter = tokio::spawn({
        let (client, addr) = (load::http_client(), replica.addr);
        async move {
            let request = completion("", 200);
            load::send(&client, addr, &request, 0.0, Duration::from_secs(20)).await
        }
    });
    wait_until(|| {
        replica
            .stats
            .waiting
            .load(std::sync::atomic::Ordering::SeqCst)
            == 1
    })
    .await;
    let page = scrape(&replica).await;
    assert_eq!(sample(&page, "vllm:num_requests_running"), 1.0);
    assert_eq!(sample(&page, "vllm:num_requests_waiting"), 1.0);
    assert_eq!(sample(&page, "tgi_queue_size"), 1.0);
    assert_eq!(sample(&page, "vllm:kv_cache_usage_perc"), 0.901);
    // A request that could never fit is refused at once.
    let too_big = send_to(&replica, &completion("", 1_000)).await;
    assert_eq!(too_big.status, 400, "{too_big:?}");
    let (holder, waiter) = (holder.await.unwrap(), waiter.await.unwrap());
    assert!(holder.is_success() && waiter.is_success());
    // The waiter's first token came after the holder had finished.
    assert!(
        waiter.ttfb >= holder.latency - 0.05,
        "{holder:?} {waiter:?}"
    );
    assert_eq!(
        sample(&scrape(&replica).await, "vllm:kv_cache_usage_perc"),
        0.0
    );
}

#[test]
fn chat_openai_and_tgi_prompts_are_read() {
    use lab::sim::prompt::Prompt;
    use serde_json::json;
    let chat = json!({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
    assert_eq!(
        Prompt::of_body(&chat).text,
        "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    );
    assert_eq!(Prompt::of_body(&json!({"prompt": "abcde"})).tokens(), 2);
    assert_eq!(Prompt::of_body(&json!({"inputs": "abcd"})).tokens(), 1);
    assert_eq!(Prompt::of_body(&json!({"max_tokens": 3})).tokens(), 0);
}

#[test]
fn a_shared_prefix_shares_its_full_blocks() {
    use lab::sim::prompt::block_hashes;
    let a = "x".repeat(100) + "the one tail....";
    let b = "x".repeat(100) + "the other tail..";
    let (a, b) = (block_hashes(a.as_bytes(), 4), block_hashes(b.as_bytes(), 4));
    // Blocks of 16 bytes: 6 full blocks of x, the 7th holds the tails.
    assert_eq!(a[..6], b[..6]);
    assert_ne!(a[6], b[6]);
    // The same bytes after a different prefix hash differently.
    let c = block_hashes(("y".repeat(16) + &"x".repeat(16)).as_bytes(), 4);
    assert_ne!(c[1], a[1]);
}

#[test]
fn an_answer_sent_back_in_the_next_turn_matches_the_cached_blocks() {
    use lab::sim::prompt::{Prompt, answer_text, block_hashes};
    use serde_json::json;
    let first = json!({"messages": [{"role": "user", "content": "q".repeat(50)}]});
    let prompt = Prompt::of_body(&first);
    let computed = prompt.chain_with_answer(&prompt.block_hashes(4), 40, 4);
    let whole = block_hashes((prompt.text.clone() + &answer_text(40)).as_bytes(), 4);
    assert_eq!(computed, whole);
    let next = json!({"messages": [
        {"role": "user", "content": "q".repeat(50)},
        {"role": "assistant", "content": answer_text(40)},
        {"role": "user", "content": "more"},
    ]});
    let sent = Prompt::of_body(&next).block_hashes(4);
    assert!(sent.len() > computed.len());
    assert_eq!(sent[..computed.len()], computed[..]);
}

#[test]
fn the_prefix_cache_counts_leading_blocks_and_evicts_the_least_recently_used() {
    use lab::sim::prefix_cache::PrefixCache;
    let mut cache = PrefixCache::new(160, 16);
    cache.insert(&[1, 2, 3]);
    assert_eq!(cache.lookup(&[1, 2, 3, 4]), 3);
    assert_eq!(cache.lookup(&[1, 9, 3]), 1);
    assert_eq!(cache.lookup(&[9, 2, 3]), 0);
    assert!(!PrefixCache::new(15, 16).is_enabled());

    // Room for 4 blocks.
    let mut cache = PrefixCache::new(64, 16);
    cache.insert(&[1, 2, 3]);
    cache.insert(&[10, 11]);
    // 5 blocks: the oldest tail (3) goes.
    assert_eq!(cache.len(), 4);
    assert_eq!(cache.lookup(&[1, 2, 3]), 2);
    // Using [1, 2] made [10, 11] the oldest: its tail (11) goes.
    cache.insert(&[1, 2, 4]);
    assert_eq!(cache.lookup(&[10, 11]), 1);
    // That lookup made 10 recent: the next eviction takes the tail of [1, 2, 4].
    cache.insert(&[20]);
    assert_eq!(cache.lookup(&[10]), 1);
    assert_eq!(cache.lookup(&[1, 2, 4]), 2);
}

mod workloads {
    use super::lab::load::{Lengths, Outgoing, User};
    use super::lab::sim::prompt::answer_text;
    use super::lab::workload::{Chat, Documents, SESSION_HEADER, Scale, Workload};
    use serde_json::Value;

    fn chat(session_header: bool) -> Chat {
        Chat {
            tenants: 2,
            users_per_tenant: 2,
            shared_preamble_tokens: 100,
            tenant_prompt_tokens: (200, 300),
            turns: (3, 3),
            question_tokens: Lengths::Fixed(20),
            answer_tokens: Lengths::Fixed(30),
            think_seconds: (1.0, 2.0),
            start_within: 10.0,
            session_header,
            stream: true,
        }
    }

    fn body(request: &Outgoing) -> Value {
        serde_json::from_slice(&request.body).unwrap()
    }

    #[test]
    fn each_turn_resends_the_history_and_tenants_share_the_preamble() {
        let users = Workload::Chat(chat(false)).users(7, Scale::FULL);
        assert_eq!(users.len(), 4);
        let turns = &users[0].turns;
        assert_eq!(turns.len(), 3);
        let (first, second) = (body(&turns[0].request), body(&turns[1].request));
        let first_messages = first["messages"].as_array().unwrap();
        let second_messages = second["messages"].as_array().unwrap();
        assert_eq!(second_messages[..first_messages.len()], first_messages[..]);
        assert_eq!(second_messages[2]["content"], answer_text(30));
        assert!(turns[1].request.prompt_tokens > turns[0].request.prompt_tokens + 50);
        assert!(turns[0].request.headers.is_empty());
        // Same tenant: same system prompt; another tenant: the same preamble only.
        let system = |user: &User| body(&user.turns[0].request)["messages"][0]["content"].clone();
        assert_eq!(system(&users[0]), system(&users[1]));
        let (a, c) = (system(&users[0]), system(&users[2]));
        let (a, c) = (a.as_str().unwrap(), c.as_str().unwrap());
        assert_ne!(a, c);
        assert_eq!(a[..400], c[..400]);
        // The same seed draws the same requests.
        let again = Workload::Chat(chat(false)).users(7, Scale::FULL);
        assert_eq!(
            again[3].turns[2].request.body,
            users[3].turns[2].request.body
        );
    }

    #[test]
    fn sessions_are_named_when_asked() {
        let users = Workload::Chat(chat(true)).users(1, Scale::FULL);
        let (name, value) = &users[3].turns[0].request.headers[0];
        assert_eq!(
            (name.as_str(), value.to_str().unwrap()),
            (SESSION_HEADER, "t1-u1")
        );
    }

    #[test]
    fn documents_mix_short_and_long_prompts() {
        let documents = Documents {
            rate: 50.0,
            duration: 10.0,
            long_fraction: 0.3,
            long_prompt_tokens: (2_000, 32_000),
            short_prompt_tokens: (100, 500),
            answer_tokens: Lengths::Fixed(10),
            stream: true,
        };
        let users = Workload::Documents(documents).users(3, Scale::FULL);
        assert!((400..600).contains(&users.len()), "{}", users.len());
        let prompts: Vec<u64> = users
            .iter()
            .map(|u| u.turns[0].request.prompt_tokens)
            .collect();
        let long = prompts.iter().filter(|&&p| p >= 2_000).count() as f64;
        assert!((0.2..0.4).contains(&(long / prompts.len() as f64)));
        assert!(prompts.iter().all(|&p| (100..=32_010).contains(&p)));
        assert!(prompts.iter().any(|&p| p > 16_000));
    }
}

// --- Traffic classes: drawing, schedules shared between scenarios, per-class numbers. ---

mod classes {
    use std::time::Duration;

    use super::lab::Mode;
    use super::lab::load::{self, Class, Lengths, OpenLoop, Record};
    use super::lab::report;
    use super::lab::scenarios::{self, Kind, PeerRun, Routing};
    use super::lab::summary::{self, Slo};

    fn open_loop(seed: u64) -> OpenLoop {
        OpenLoop {
            rate: 1_000.0,
            duration: Duration::from_secs(20),
            burst: 5,
            lengths: Lengths::Uniform { min: 16, max: 112 },
            stream_fraction: 0.5,
            seed,
            request_timeout: Duration::from_secs(1),
            max_requests: 100_000,
        }
    }

    fn tenants() -> Vec<Class> {
        vec![
            Class::new("a", 10.0 / 11.0, &[("x-tenant-id", "a")]),
            Class::new("b", 1.0 / 11.0, &[("x-tenant-id", "b")]),
        ]
    }

    #[test]
    fn classes_are_drawn_in_their_shares_the_same_for_a_seed() {
        let load = open_loop(3);
        let extra = [(
            http::HeaderName::from_static("x-request-deadline-ms"),
            http::HeaderValue::from_static("500"),
        )];
        let schedule = load::plan_classes(&load, &tenants(), &extra);
        assert!(schedule.len() > 19_000, "{}", schedule.len());
        let b = schedule.iter().filter(|p| p.class == Some("b")).count();
        let a = schedule.iter().filter(|p| p.class == Some("a")).count();
        assert_eq!(a + b, schedule.len());
        let share = b as f64 / schedule.len() as f64;
        assert!((share - 1.0 / 11.0).abs() < 0.01, "share of b {share}");
        for planned in &schedule {
            let tenant = planned.headers[0].1.to_str().unwrap();
            assert_eq!(Some(tenant), planned.class);
            assert_eq!(planned.headers[1], extra[0]);
        }
        // The same seed draws the same schedule; another seed another one.
        let again = load::plan_classes(&load, &tenants(), &extra);
        let key = |p: &load::Planned| (p.at, p.max_tokens, p.stream, p.class);
        assert!(schedule.iter().map(key).eq(again.iter().map(key)));
        let other = load::plan_classes(&open_loop(4), &tenants(), &extra);
        assert!(!schedule.iter().map(key).eq(other.iter().map(key)));
        // Rounding cannot leave a draw without a class.
        assert_eq!(
            load::class_of_draw(&tenants(), 0.999_999_999_9)
                .unwrap()
                .name,
            "b"
        );
        assert_eq!(load::class_of_draw(&tenants(), 0.0).unwrap().name, "a");
        assert!(load::class_of_draw(&[], 0.5).is_none());
    }

    #[test]
    fn a_schedule_without_classes_draws_what_it_drew_before_classes() {
        let load = open_loop(11);
        let schedule = load::plan(&load);
        // The draws of the schedule before classes existed: lengths and streaming of the burst,
        // then an inter-arrival time, a length and streaming per request.
        let mut rng = fastrand::Rng::with_seed(load.seed);
        let mut expected = Vec::new();
        for _ in 0..load.burst {
            expected.push((0.0, load.lengths.sample(&mut rng), rng.f64() < 0.5));
        }
        let mut at = 0.0;
        loop {
            at += -(1.0 - rng.f64()).ln() / load.rate;
            if at >= 20.0 {
                break;
            }
            expected.push((at, load.lengths.sample(&mut rng), rng.f64() < 0.5));
        }
        assert_eq!(schedule.len(), expected.len());
        for (planned, (at, tokens, stream)) in schedule.iter().zip(expected) {
            assert_eq!(planned.at, Duration::from_secs_f64(at));
            assert_eq!((planned.max_tokens, planned.stream), (tokens, stream));
            assert_eq!(planned.class, None);
            assert!(planned.headers.is_empty());
        }
        let same = load::plan_classes(&load, &[], &[]);
        assert!(same.iter().map(|p| p.at).eq(schedule.iter().map(|p| p.at)));
    }

    fn routing(name: &str) -> Routing {
        let scenario = scenarios::all()
            .into_iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no scenario {name}"));
        match scenario.kind {
            Kind::Routing(routing) => *routing,
            Kind::Overhead(_) => panic!("{name} is not a routing scenario"),
        }
    }

    /// The schedule `name` sends in run seed `seed` (the same seed for scenarios sharing one).
    fn schedule(name: &str, seed: u64, mode: Mode) -> Vec<load::Planned> {
        let routing = routing(name);
        let load = routing.open_loop(mode, seed).unwrap();
        routing.schedule(&load, mode)
    }

    #[test]
    fn a_class_alone_is_sent_exactly_as_in_the_shared_scenario() {
        for (shared, alone, class) in [
            ("noisy-tenant", "noisy-tenant-alone", "b"),
            ("priority", "priority-alone", "high"),
            ("noisy-tenant-engine", "noisy-tenant-engine-alone", "b"),
            ("priority-engine", "priority-engine-alone", "high"),
        ] {
            assert_eq!(routing(shared).seed_of, Some(shared));
            assert_eq!(routing(alone).seed_of, Some(shared));
            let all = schedule(shared, 7, Mode::Default);
            let kept = schedule(alone, 7, Mode::Default);
            let of_class: Vec<_> = all.iter().filter(|p| p.class == Some(class)).collect();
            assert!(!kept.is_empty());
            assert_eq!(kept.len(), of_class.len(), "{alone}");
            for (a, b) in kept.iter().zip(of_class) {
                assert_eq!(
                    (a.at, a.max_tokens, a.stream),
                    (b.at, b.max_tokens, b.stream)
                );
                assert_eq!(a.headers, b.headers);
            }
            // The offered rate is the class's share of the shared rate.
            let (shared_rate, alone_rate) = (
                routing(shared).rate().unwrap(),
                routing(alone).rate().unwrap(),
            );
            let share = alone_rate / shared_rate;
            let expected = if class == "b" { 1.0 / 11.0 } else { 0.2 };
            assert!((share - expected).abs() < 1e-9, "{alone}: {share}");
            assert_eq!(routing(alone).class_names(), vec![class.to_owned()]);
        }
        let tenant = |p: &load::Planned| {
            p.headers
                .iter()
                .find(|(name, _)| name == "x-tenant-id")
                .map(|(_, value)| value.to_str().unwrap().to_owned())
        };
        let noisy = schedule("noisy-tenant", 1, Mode::Default);
        assert!(noisy.iter().all(|p| tenant(p).as_deref() == p.class));
        let priority = schedule("priority", 1, Mode::Default);
        for planned in &priority {
            let high = planned
                .headers
                .iter()
                .any(|(n, v)| n == "x-priority" && v == "high");
            assert_eq!(high, planned.class == Some("high"));
        }
    }

    #[test]
    fn an_engine_scale_schedule_is_compressed_in_time_not_cut_short() {
        let engine = routing("noisy-tenant-engine");
        let full = schedule("noisy-tenant-engine", 2, Mode::Default);
        for mode in [Mode::Quick, Mode::Smoke] {
            // Replicas that much faster, and the default run's first requests at times that
            // much shorter: the same requests, none cut short by the shorter run.
            let compression = engine.time_compression(mode);
            assert_eq!(compression, mode.time_compression());
            assert_eq!(
                engine.sim_config(0, 2, mode).speed,
                engine.sim_config(0, 2, Mode::Default).speed * compression
            );
            let short = schedule("noisy-tenant-engine", 2, mode);
            let kept = full
                .iter()
                .take_while(|p| p.at.as_secs_f64() < 60.0 * mode.time_scale())
                .count();
            assert!(short.len() > 20, "{mode:?}: {}", short.len());
            assert!(short.len().abs_diff(kept) <= 1, "{mode:?}");
            for (short, full) in short.iter().zip(&full) {
                let at = full.at.as_secs_f64() / compression;
                assert!((short.at.as_secs_f64() - at).abs() < 1e-6, "{mode:?}");
                assert_eq!(
                    (short.max_tokens, short.stream, short.class),
                    (full.max_tokens, full.stream, full.class)
                );
            }
        }
        // The small-replica scenarios are shortened instead.
        assert_eq!(routing("noisy-tenant").time_compression(Mode::Smoke), 1.0);
    }

    #[test]
    fn overload_deadline_sends_the_overload_requests_with_the_slo_deadline() {
        let overload = routing("overload");
        let deadline = routing("overload-deadline");
        assert_eq!(deadline.seed_of, Some("overload"));
        assert_eq!(overload.rate(), deadline.rate());
        assert!(deadline.reports_overload);
        for mode in [Mode::Default, Mode::Smoke] {
            let bound_ms = deadline
                .slo
                .scaled(deadline.time_compression(mode))
                .ttft_seconds
                * 1e3;
            assert_eq!(
                deadline.deadline_millis(mode),
                Some(bound_ms.round() as u64)
            );
            assert_eq!(overload.deadline_millis(mode), None);
            let plain = schedule("overload", 5, mode);
            let with_deadline = schedule("overload-deadline", 5, mode);
            assert_eq!(plain.len(), with_deadline.len());
            for (a, b) in plain.iter().zip(&with_deadline) {
                assert_eq!(
                    (a.at, a.max_tokens, a.stream),
                    (b.at, b.max_tokens, b.stream)
                );
                assert!(a.headers.is_empty());
                let value = bound_ms.round().to_string();
                assert_eq!(b.headers.len(), 1);
                assert_eq!(b.headers[0].0, "x-request-deadline-ms");
                assert_eq!(b.headers[0].1.to_str().unwrap(), value);
            }
        }
        // The small-replica scenarios run in real time: 500 ms in every mode.
        assert_eq!(deadline.deadline_millis(Mode::Smoke), Some(500));
    }

    #[test]
    fn hetero_stream_offers_85_percent_of_the_hetero_replicas_capacity() {
        let routing = routing("hetero-stream");
        let rate = routing.rate().unwrap();
        let capacity = routing.capacity().unwrap();
        assert!(
            (rate / capacity - 0.85).abs() < 1e-6,
            "{rate} of {capacity}"
        );
        let speeds: Vec<f64> = routing.replicas.iter().map(|r| r.speed).collect();
        assert_eq!(speeds, [1.0, 1.0, 2.0, 4.0]);
    }

    fn record(
        class: Option<&'static str>,
        status: u16,
        latency: f64,
        prompt_tokens: u64,
    ) -> Record {
        Record {
            sent_at: 0.0,
            latency,
            ttfb: latency / 2.0,
            status,
            complete: status == 200,
            replica: (status != 503).then(|| "r1".to_owned()),
            error: None,
            max_tokens: 10,
            stream: true,
            prompt_tokens,
            class,
        }
    }

    const SLO: Slo = Slo {
        ttft_seconds: 0.5,
        ttft_seconds_per_prompt_token: 0.0,
        tpot_seconds: 0.0105,
    };

    #[test]
    fn each_class_has_its_own_numbers() {
        let mut records = Vec::new();
        // a: 100 successes of 0.01 to 1.00 s (those above 0.605 s miss the SLO), 10 refused
        // by the proxy, 10 by a replica.
        for i in 1..=100 {
            records.push(record(Some("a"), 200, f64::from(i) / 100.0, 8));
        }
        for _ in 0..10 {
            records.push(record(Some("a"), 503, 0.001, 8));
            records.push(record(Some("a"), 429, 0.001, 8));
        }
        // b: 4 fast successes and one failure that is not a refusal.
        for _ in 0..4 {
            records.push(record(Some("b"), 200, 0.1, 8));
        }
        records.push(record(Some("b"), 500, 0.001, 8));
        let classes = vec!["a".to_owned(), "b".to_owned(), "c".to_owned()];
        let metrics = summary::summarize_classes(&records, &classes, |r| r.class, &SLO);
        let get = |key: &str| metrics.get(key).copied();
        assert_eq!(get("requests.a"), Some(120.0));
        assert_eq!(get("latency_p50_s.a"), Some(0.5));
        assert_eq!(get("latency_p99_s.a"), Some(0.99));
        assert_eq!(get("ttfb_p99_s.a"), Some(0.495));
        assert_eq!(get("slo_pct.a"), Some(50.0));
        assert!((get("refused_pct.a").unwrap() - 100.0 * 20.0 / 120.0).abs() < 1e-9);
        assert_eq!(get("requests.b"), Some(5.0));
        assert_eq!(get("latency_p99_s.b"), Some(0.1));
        assert_eq!(get("slo_pct.b"), Some(80.0));
        assert_eq!(get("refused_pct.b"), Some(0.0));
        // A class without requests has only its count.
        assert_eq!(get("requests.c"), Some(0.0));
        assert_eq!(get("latency_p99_s.c"), None);
        assert_eq!(get("slo_pct.c"), None);
        for key in metrics.keys() {
            let stem = key.split('.').next().unwrap();
            assert!(summary::CLASS_STEMS.contains(&stem), "{key}");
        }
    }

    #[test]
    fn long_context_classes_its_requests_by_prompt_length() {
        let routing = routing("long-context");
        assert_eq!(routing.class_names(), ["short", "long"]);
        assert_eq!(
            routing.class_of(&record(None, 200, 1.0, 1_999)),
            Some("short")
        );
        assert_eq!(
            routing.class_of(&record(None, 200, 1.0, 2_000)),
            Some("long")
        );
        // A scenario without classes has none.
        assert!(self::routing("hetero").class_names().is_empty());
    }

    #[test]
    fn the_report_has_a_table_per_class() {
        let scenario = scenarios::all()
            .into_iter()
            .find(|s| s.name == "noisy-tenant")
            .unwrap();
        let records: Vec<Record> = (1..=20)
            .map(|i| record(Some(if i % 5 == 0 { "b" } else { "a" }), 200, 0.1, 8))
            .collect();
        let classes = ["a".to_owned(), "b".to_owned()];
        let mut metrics = summary::summarize(&records, &["r1".to_owned()], &SLO);
        metrics.extend(summary::summarize_classes(
            &records,
            &classes,
            |r| r.class,
            &SLO,
        ));
        let run = PeerRun {
            metrics,
            latencies: vec![0.1; 20],
        };
        let outcome = vec![vec![("round-robin".to_owned(), Ok(run))]];
        let reported = report::aggregate(&scenario, Mode::Smoke, "set-up".to_owned(), outcome);
        assert_eq!(reported.classes, classes);
        assert!(
            reported.classes_about.contains("`x-tenant-id: b`"),
            "{}",
            reported.classes_about
        );
        let markdown = report::scenario_markdown(&reported);
        assert!(
            markdown.contains(
                "| peer | class | requests | p50 s | p99 s | TTFB p99 s | in SLO % | refused % |"
            ),
            "{markdown}"
        );
        assert!(
            markdown.contains("| round-robin | a | 16 | 0.100 | 0.100 | 0.050 | 100.0 | 0.0 |"),
            "{markdown}"
        );
        assert!(markdown.contains("| round-robin | b | 4 |"), "{markdown}");
        let json = serde_json::to_value(&reported).unwrap();
        assert_eq!(json["classes"], serde_json::json!(["a", "b"]));
        assert_eq!(json["peers"][0]["median"]["latency_p99_s.b"], 0.1);
    }
}

// --- The LLM routers as peers: their names and policies on the command line. ---

mod gateways {
    use super::lab::gateways::{Gateway, GatewaySpec};

    #[test]
    fn an_llm_router_is_named_with_its_policy_and_bad_names_are_refused() {
        let spec = GatewaySpec::parse("smg:cache_aware").unwrap();
        assert_eq!(
            (spec.gateway, spec.label()),
            (Gateway::Smg, "smg-cache-aware".to_owned())
        );
        let spec = GatewaySpec::parse("vllm-router:power_of_two").unwrap();
        assert_eq!(spec.label(), "vllm-router-power-of-two");
        for bad in ["smg", "nginx:least_conn", "smg:", "smg:Cache"] {
            assert!(GatewaySpec::parse(bad).is_err(), "{bad}");
        }
        let labels: Vec<String> = GatewaySpec::defaults()
            .iter()
            .map(GatewaySpec::label)
            .collect();
        assert_eq!(
            labels,
            [
                "smg-cache-aware",
                "smg-least-load",
                "smg-power-of-two",
                "vllm-router-cache-aware",
                "vllm-router-power-of-two"
            ]
        );
    }
}

/// A `sweep.json` as the sweep writes it: `draws` of seed 1, the default against one peer.
fn sweep_json(command: &str, seed: u64, draws: &[usize]) -> serde_json::Value {
    let results: Vec<serde_json::Value> = draws
        .iter()
        .map(|&index| {
            serde_json::json!({
                "draw": { "index": index },
                "peers": [
                    ["queued-least-latency", { "Ok": { "latency_p50_s": 2.0, "latency_p99_s": 6.0, "slo_pct": 90.0 } }],
                    ["nginx-least-conn", { "Err": "it did not start" }]
                ],
                "p50_ratio": 0.5 + index as f64,
                "p99_ratio": null,
                "goodput_ratio": 1.0
            })
        })
        .collect();
    serde_json::json!({
        "command": command,
        "date_utc": "2026-12-06 12:00",
        "seed": seed,
        "default": "queued-least-latency",
        "draws": results,
    })
}

#[test]
fn sweeps_run_apart_merge_into_one_report_in_draw_order() {
    let root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("custom-router-sweep-merge-{}", std::process::id()));
    let write = |name: &str, json: serde_json::Value| {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("sweep.json"), json.to_string()).unwrap();
        dir
    };
    let later = write("later", sweep_json("sweep --first 2 --draws 2", 1, &[2, 3]));
    let first = write("first", sweep_json("sweep --draws 2", 1, &[0, 1]));
    let merged = lab::sweep::SweepReport::merged(
        &[later.clone(), first.clone()],
        "sweep --merge later --merge first",
        "now".to_owned(),
    )
    .unwrap();
    let indices: Vec<usize> = merged.draws.iter().map(|d| d.draw.index).collect();
    assert_eq!(indices, [0, 1, 2, 3]);
    // Each draw's physics is drawn again from the seed and its number.
    assert_eq!(
        merged.draws[2].draw.describe(),
        lab::sweep::draw(1, 2).describe()
    );
    let markdown = merged.markdown();
    assert!(
        markdown.contains(
            "command: `sweep --first 2 --draws 2; sweep --draws 2; sweep --merge later --merge first`"
        ),
        "{markdown}"
    );
    assert!(
        markdown.contains("p50 ratio: 1 of 4 draws ≤ 1.0; median 2.50, worst 3.50"),
        "{markdown}"
    );
    assert!(
        markdown.contains("nginx-least-conn failed: it did not start"),
        "{markdown}"
    );
    // A draw in two sweeps, or sweeps of different seeds, are refused with the reason.
    let again = write("again", sweep_json("sweep --first 1 --draws 1", 1, &[1]));
    let error = lab::sweep::SweepReport::merged(&[first.clone(), again], "m", "now".to_owned())
        .err()
        .unwrap();
    assert_eq!(error.to_string(), "draw 1 is in two sweeps");
    let other = write("other", sweep_json("sweep --seed 2", 2, &[5]));
    let error = lab::sweep::SweepReport::merged(&[first, other], "m", "now".to_owned())
        .err()
        .unwrap();
    assert!(error.to_string().contains("seed 2"), "{error}");
    let _ = std::fs::remove_dir_all(&root);
}
