//! The benchmark lab's simulator and measurements held to what docs/lab.md ("The
//! simulated replica", "Scenarios") says of them: the time to first token of per-request
//! batching, a running request's prefix blocks pinned in the replica's cache, goodput set
//! against the capacity of the replicas as run, open-loop arrivals, nearest-rank percentiles and
//! goodput counting only successes.

#[path = "../benches/lab/mod.rs"]
mod lab;

use std::sync::atomic::Ordering;
use std::time::Duration;

use lab::Mode;
use lab::load::{self, Outgoing, Record};
use lab::scenarios::{self, Kind, Routing, Traffic};
use lab::sim::{self, Batching, SimConfig, SimStats};

fn completion(prompt: &str, max_tokens: u32) -> Outgoing {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true});
    Outgoing {
        path: "/v1/completions".to_owned(),
        body: body.to_string().into(),
        headers: Vec::new(),
        max_tokens,
        stream: true,
        prompt_tokens: sim::prompt::Prompt::of_body(&body).tokens(),
    }
}

async fn send_to(addr: std::net::SocketAddr, request: &Outgoing) -> Record {
    let client = load::http_client();
    load::send(&client, addr, request, 0.0, Duration::from_secs(30)).await
}

fn spawn_send(addr: std::net::SocketAddr, request: Outgoing) -> tokio::task::JoinHandle<Record> {
    tokio::spawn(async move { send_to(addr, &request).await })
}

async fn wait_until(condition: impl Fn() -> bool) {
    for _ in 0..2000 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("condition not reached within 4 s");
}

fn routing(name: &str) -> Routing {
    let scenario = scenarios::all()
        .into_iter()
        .find(|s| s.name == name)
        .unwrap();
    match scenario.kind {
        Kind::Routing(routing) => *routing,
        Kind::Overhead(_) => panic!("{name} is not a routing scenario"),
    }
}

// --- Per-request batching: the documented time to first token. ---

/// Per-request batching: the prefill, then one decode step per token, the first token at the end
/// of the first step (time to first token = prefill + one step).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_request_first_token_comes_after_the_prefill_and_one_step() {
    let config = SimConfig {
        name: "p".into(),
        slots: 4,
        prefill_ms: 100.0,
        step_ms: 60.0,
        step_per_batch_ms: 0.0,
        ..SimConfig::default()
    };
    let replica = sim::spawn(config).await.unwrap();
    let record = send_to(replica.addr, &completion("abcd", 3)).await;
    assert!(record.is_success(), "{record:?}");
    // 0.100 s of prefill and a 60 ms step, plus a few ms of I/O.
    assert!(
        (0.155..0.200).contains(&record.ttfb),
        "time to first token {:.3} s, documented prefill + one step 0.160 s",
        record.ttfb
    );
}

/// A replica timed as a full batch takes, for one request alone, what a full batch takes: every
/// step as if every slot were decoding, per-request and stepped alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_batch_replica_times_a_lone_request_as_a_full_batch() {
    for batching in [
        Batching::PerRequest,
        Batching::Stepped {
            token_budget: 2_048,
        },
    ] {
        let config = |full_batch| SimConfig {
            name: "fb".into(),
            slots: 8,
            prefill_ms: 0.0,
            step_ms: 10.0,
            step_per_batch_ms: 5.0,
            batching,
            full_batch,
            ..SimConfig::default()
        };
        let alone = sim::spawn(config(false)).await.unwrap();
        let full = sim::spawn(config(true)).await.unwrap();
        // 4 tokens: 4 × 15 ms alone, 4 × 50 ms in a full batch of 8.
        let quick = send_to(alone.addr, &completion("abcd", 4)).await;
        let slow = send_to(full.addr, &completion("abcd", 4)).await;
        assert!(
            quick.is_success() && slow.is_success(),
            "{quick:?} {slow:?}"
        );
        assert!(
            quick.latency < 0.15,
            "{batching:?}: alone {:.3} s, documented 0.060 s",
            quick.latency
        );
        assert!(
            (0.19..0.40).contains(&slow.latency),
            "{batching:?}: full batch {:.3} s, documented 0.200 s",
            slow.latency
        );
    }
}

/// A floor scenario sends the class that matters alone, on replicas timed as full batches; its
/// non-streamed form sends the same requests without streaming.
#[test]
fn floor_scenarios_send_their_class_alone_on_full_batch_replicas() {
    let all = scenarios::all();
    let routing = |name: &str| -> Routing {
        let scenario = all.iter().find(|s| s.name == name).expect(name);
        match &scenario.kind {
            Kind::Routing(routing) => (**routing).clone(),
            Kind::Overhead(_) => panic!("{name} is not a routing scenario"),
        }
    };
    for (mixed, floor, class) in [
        ("noisy-tenant", "noisy-tenant-floor", "b"),
        ("noisy-tenant-whole", "noisy-tenant-whole-floor", "b"),
        ("priority-engine", "priority-engine-floor", "high"),
        (
            "priority-engine-whole",
            "priority-engine-whole-floor",
            "high",
        ),
    ] {
        let (mixed, floor) = (routing(mixed), routing(floor));
        assert!(!mixed.engine.full_batch && floor.engine.full_batch);
        let (Traffic::Poisson(m), Traffic::Poisson(f)) = (&mixed.traffic, &floor.traffic) else {
            panic!("Poisson traffic expected");
        };
        assert_eq!(m.mix.only, None);
        assert_eq!(f.mix.only, Some(class));
        assert_eq!(m.stream_fraction, f.stream_fraction);
        assert_eq!(mixed.seed_of, floor.seed_of, "the same schedule");
    }
    let (Traffic::Poisson(whole), Traffic::Poisson(streamed)) = (
        &routing("noisy-tenant-whole").traffic,
        &routing("noisy-tenant").traffic,
    ) else {
        panic!("Poisson traffic expected");
    };
    assert_eq!(
        (whole.stream_fraction, streamed.stream_fraction),
        (0.0, 1.0)
    );
}

// --- Prefix cache: the blocks of a running request. ---

/// A running request's blocks are in use (in vLLM they are its KV cache and cannot be evicted):
/// a second request with the same prompt, sent while the first still decodes, finds the whole
/// prefix, whatever else passed through the cache meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_requests_prefix_blocks_are_not_evicted_while_it_runs() {
    let config = SimConfig {
        name: "pc".into(),
        slots: 8,
        prefill_ms: 0.0,
        step_ms: 1.0,
        step_per_batch_ms: 0.0,
        prefill_per_token_ms: 0.01,
        // 62 blocks of 16 tokens.
        prefix_cache_tokens: 1_000,
        block_tokens: 16,
        batching: Batching::Stepped {
            token_budget: 2_048,
        },
        ..SimConfig::default()
    };
    let replica = sim::spawn(config).await.unwrap();
    let stats = std::sync::Arc::clone(&replica.stats);
    // 800 tokens = 50 full blocks each.
    let prompt_a = "a".repeat(3_200);
    let prompt_b = "b".repeat(3_200);
    // A: decodes 1,500 tokens (about 1.5 s).
    let a = spawn_send(replica.addr, completion(&prompt_a, 1_500));
    wait_until(|| SimStats::get(&stats.generated_tokens) >= 5).await;
    // B: another 50 blocks, finished at once; the cache (62 blocks) cannot hold both prompts.
    let b = send_to(replica.addr, &completion(&prompt_b, 1)).await;
    assert!(b.is_success());
    assert_eq!(stats.decoding.load(Ordering::SeqCst), 1, "A still runs");
    let hits_before = SimStats::get(&stats.prefix_hit_tokens);
    // C: A's prompt while A still runs.
    let c = send_to(replica.addr, &completion(&prompt_a, 1)).await;
    assert!(c.is_success());
    assert_eq!(stats.decoding.load(Ordering::SeqCst), 1, "A still runs");
    let c_hits = SimStats::get(&stats.prefix_hit_tokens) - hits_before;
    a.abort();
    assert_eq!(
        c_hits, 799,
        "C found {c_hits} of its 800 prompt tokens although A, running, holds them all"
    );
}

/// The cache's accounting: pinned blocks are skipped by eviction (the cache may exceed its
/// capacity while they do), a block pinned twice stays pinned until both let go, and a block
/// let go is evicted in its turn again.
#[test]
fn pinned_blocks_are_evicted_only_once_every_holder_let_go() {
    use lab::sim::prefix_cache::PrefixCache;
    // 4 blocks of 16 tokens.
    let mut cache = PrefixCache::new(64, 16);
    cache.insert_pinned(&[1, 2, 3], 0);
    cache.pin(&[1]);
    cache.insert(&[4, 5, 6]);
    // 6 and 5 (the chain's last blocks, unpinned) went; the pinned chain stayed.
    assert_eq!(cache.len(), 4);
    assert_eq!(cache.lookup(&[1, 2, 3]), 3);
    assert_eq!(cache.lookup(&[4, 5, 6]), 1);
    // Pinned blocks beyond capacity: held until let go.
    cache.insert_pinned(&[7, 8, 9, 10], 0);
    assert_eq!(cache.len(), 7);
    cache.unpin(&[7, 8, 9, 10]);
    assert_eq!(cache.len(), 4, "let go: back to capacity");
    cache.unpin(&[1, 2, 3]);
    // Block 1 is still held once; 2 and 3 may go.
    cache.insert(&[11, 12, 13]);
    assert_eq!(cache.lookup(&[1]), 1);
    assert_eq!(cache.lookup(&[1, 2, 3]), 1);
    cache.unpin(&[1]);
    cache.insert(&[14, 15, 16, 17]);
    assert_eq!(
        cache.lookup(&[1]),
        0,
        "let go by both holders: evicted in its turn"
    );
}

// --- The overload columns of a compressed (engine-scale Poisson) scenario. ---

/// `goodput_pct_of_capacity` divides the run's goodput by `Routing::capacity()`. In quick and
/// smoke modes a compressed scenario's replicas run 4 (50) times faster and its arrivals come
/// 4 (50) times as fast, so the capacity it is judged against must be the replicas' as run:
/// offered load over capacity must stay the scenario's load fraction.
#[test]
fn goodput_share_of_capacity_uses_the_capacity_of_the_replicas_as_run() {
    for name in ["priority-engine", "noisy-tenant-engine"] {
        let routing = routing(name);
        let Traffic::Poisson(poisson) = &routing.traffic else {
            panic!("{name} is Poisson traffic")
        };
        assert!(
            routing.reports_overload,
            "{name} reports goodput % of capacity"
        );
        for mode in [Mode::Default, Mode::Quick, Mode::Smoke] {
            let mean = poisson.lengths.mean();
            let as_run: f64 = (0..routing.replicas.len())
                .map(|index| routing.sim_config(index, 1, mode).capacity(mean))
                .sum();
            let offered = routing.open_loop(mode, 1).unwrap().rate;
            let used = routing.capacity_as_run(mode).unwrap();
            // A run whose goodput equals the replicas' capacity (as run) should read 100 %.
            let reported_pct = 100.0 * as_run / used;
            assert!(
                (reported_pct - 100.0).abs() < 1e-6,
                "{name} in {mode:?}: replicas serve {as_run:.1} req/s, offered {offered:.1} req/s, \
                 but goodput is divided by {used:.1} req/s: a run at full capacity reads \
                 {reported_pct:.0} % of capacity"
            );
        }
    }
}

// --- The load generator and the report. ---

/// Open loop: a target that never answers does not delay the later sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_sends_on_schedule_even_when_the_target_never_answers() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            held.push(stream);
        }
    });
    let schedule: Vec<load::Planned> = (0..20)
        .map(|i| load::Planned {
            at: Duration::from_millis(10 * i),
            max_tokens: 4,
            stream: true,
            class: None,
            headers: Vec::new(),
        })
        .collect();
    let records = load::run_open_loop(addr, schedule, Duration::from_millis(400), None).await;
    holder.abort();
    assert_eq!(records.len(), 20);
    for (i, record) in records.iter().enumerate() {
        assert_eq!(record.error, Some("timeout"));
        assert!(
            (record.sent_at - 0.010 * i as f64).abs() < 0.02,
            "request {i} sent at {:.3}",
            record.sent_at
        );
    }
}

/// Nearest-rank percentiles: the p99 of 100 sorted samples is the 99th, of 1,000 the 990th.
#[test]
fn percentiles_are_nearest_rank() {
    use lab::summary::{median, percentile};
    let values: Vec<f64> = (1..=100).map(f64::from).collect();
    assert_eq!(percentile(&values, 0.99), Some(99.0));
    assert_eq!(percentile(&values, 0.50), Some(50.0));
    let values: Vec<f64> = (1..=1000).map(f64::from).collect();
    assert_eq!(percentile(&values, 0.99), Some(990.0));
    assert_eq!(percentile(&[3.0], 0.99), Some(3.0));
    assert_eq!(median(&mut [3.0, 1.0, 2.0, 10.0]), Some(2.5));
}

/// Refused and failed requests never count in the SLO; a success counts once.
#[test]
fn slo_goodput_counts_only_successes_once() {
    use lab::summary::{Slo, summarize};
    let slo = Slo {
        ttft_seconds: 1.0,
        ttft_seconds_per_prompt_token: 0.0,
        tpot_seconds: 0.0,
    };
    let record = |status: u16, complete: bool| Record {
        sent_at: 0.0,
        latency: 0.01,
        ttfb: 0.005,
        status,
        complete,
        replica: Some("r1".into()),
        error: None,
        max_tokens: 1,
        stream: true,
        prompt_tokens: 8,
        class: None,
    };
    let records = vec![
        record(200, true),
        record(200, false),
        record(429, true),
        record(503, true),
        record(500, true),
    ];
    let metrics = summarize(&records, &["r1".to_owned()], &slo);
    assert_eq!(metrics["slo_pct"], 20.0);
    assert_eq!(metrics["refused_pct"], 40.0);
    assert_eq!(metrics["error_pct"], 80.0);
}

/// The most of `prefix`'s prompt tokens any routing can find cached: every request sent to one
/// replica with a cache that never evicts, in the order the users send them (each user's turns
/// in turn, users by start; answers stored with their prompt). The first sight of each tenant's
/// prompt and every new question are misses whatever the routing. Prints the ceiling per seed
/// (`cargo test --test sim_edges -- --ignored --nocapture prefix_cache_hit_ceiling`).
#[test]
#[ignore = "a measurement for docs/benchmarks.md, not a check"]
fn prefix_cache_hit_ceiling() {
    use lab::sim::prefix_cache::PrefixCache;
    use lab::sim::prompt::Prompt;
    use lab::workload::Scale;
    let routing = routing("prefix");
    let Traffic::Users(workload) = &routing.traffic else {
        panic!("prefix is a users workload")
    };
    let block_tokens = routing.engine.block_tokens;
    for seed in 1..=3 {
        let users = workload.users(seed, Scale::FULL);
        let mut sends: Vec<(Duration, usize, usize)> = Vec::new();
        for (user, turns) in users.iter().enumerate() {
            let mut at = turns.start;
            for (index, turn) in turns.turns.iter().enumerate() {
                if index > 0 {
                    at += turn.think;
                }
                sends.push((at, user, index));
            }
        }
        sends.sort();
        let mut cache = PrefixCache::new(u64::MAX / 2, block_tokens);
        let (mut queried, mut hit) = (0u64, 0u64);
        for (_, user, index) in sends {
            let request = &users[user].turns[index].request;
            let body: serde_json::Value = serde_json::from_slice(&request.body).unwrap();
            let prompt = Prompt::of_body(&body);
            let tokens = prompt.tokens().max(1);
            let chain = prompt.block_hashes(block_tokens);
            let held = cache.lookup(&chain) as u64;
            queried += tokens;
            hit += (held * u64::from(block_tokens)).min(tokens - 1);
            cache.insert(&prompt.chain_with_answer(&chain, request.max_tokens, block_tokens));
        }
        println!(
            "prefix seed {seed}: {queried} prompt tokens, at most {:.1} % found cached",
            100.0 * hit as f64 / queried as f64
        );
    }
}

// --- What the LLM routers ask of a replica: health, models, tokens; usage in answers. ---

async fn exchange(
    addr: std::net::SocketAddr,
    method: http::Method,
    path: &str,
    body: &str,
) -> (u16, String) {
    use http_body_util::BodyExt;
    let request = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_owned(),
        )))
        .unwrap();
    let response = load::http_client().request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// As vLLM: `GET /health` and `GET /v1/models` answer (SMG registers a worker once they do),
/// `POST /tokenize` and the render endpoints give equal ids for equal text (the vLLM router's
/// cache_aware matches on them), and any other `GET` is 404, not a generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replica_answers_what_llm_routers_ask_of_a_vllm_worker() {
    let replica = sim::spawn(SimConfig::instant("v")).await.unwrap();
    let addr = replica.addr;
    assert_eq!(
        exchange(addr, http::Method::GET, "/health", "").await.0,
        200
    );
    let (status, models) = exchange(addr, http::Method::GET, "/v1/models", "").await;
    let models: serde_json::Value = serde_json::from_str(&models).unwrap();
    assert_eq!(
        (status, models["data"][0]["owned_by"].as_str()),
        (200, Some("vllm"))
    );
    assert_eq!(
        exchange(addr, http::Method::GET, "/get_load", "").await.0,
        404
    );
    let tokenize = |body: &'static str| exchange(addr, http::Method::POST, "/tokenize", body);
    let (status, one) = tokenize(r#"{"prompt": "abcdefgh-same-start-1"}"#).await;
    let (_, two) = tokenize(r#"{"prompt": "abcdefgh-same-start-2"}"#).await;
    let ids = |text: &str| -> Vec<u64> {
        let value: serde_json::Value = serde_json::from_str(text).unwrap();
        let tokens = value["tokens"].as_array().or(value["token_ids"].as_array());
        tokens
            .unwrap()
            .iter()
            .map(|id| id.as_u64().unwrap())
            .collect()
    };
    let (one, two) = (ids(&one), ids(&two));
    assert_eq!(status, 200);
    assert_eq!(one.len(), 6, "21 bytes are 6 tokens of 4");
    assert_eq!(one[..5], two[..5]);
    assert_ne!(one[5], two[5]);
    let chat = r#"{"messages": [{"role": "user", "content": "hello"}]}"#;
    let (status, rendered) = exchange(
        addr,
        http::Method::POST,
        "/v1/chat/completions/render",
        chat,
    )
    .await;
    // `<|user|>\nhello\n<|assistant|>\n`: 29 bytes, 8 tokens.
    assert_eq!((status, ids(&rendered).len()), (200, 8));
    assert_eq!(
        SimStats::get(&replica.stats.received),
        0,
        "none was a generation"
    );
}

/// A stepped replica of 1 ms steps answering with `usage`, a prefix cache of 10,000 tokens in
/// blocks of 16 (or `shared_cache`).
fn usage_replica(name: &str, shared_cache: Option<sim::SharedCache>) -> SimConfig {
    SimConfig {
        name: name.into(),
        prefill_ms: 0.0,
        step_ms: 1.0,
        step_per_batch_ms: 0.0,
        prefix_cache_tokens: 10_000,
        block_tokens: 16,
        batching: Batching::Stepped {
            token_budget: 2_048,
        },
        usage: true,
        shared_cache,
        ..SimConfig::default()
    }
}

/// With `usage` on, an OpenAI answer reports its prompt, completion and cached prompt tokens
/// (vLLM's `prompt_tokens_details.cached_tokens`): in the document of a whole answer, and in a
/// last event before `[DONE]` of a stream. A second request with the same prompt finds its full
/// blocks cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_report_usage_with_the_cached_prompt_tokens() {
    let replica = sim::spawn(usage_replica("u", None)).await.unwrap();
    let prompt = "p".repeat(400);
    let whole = format!(r#"{{"prompt": "{prompt}", "max_tokens": 3}}"#);
    let (status, first) =
        exchange(replica.addr, http::Method::POST, "/v1/completions", &whole).await;
    let first: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(status, 200);
    assert_eq!(first["usage"]["prompt_tokens"], 100);
    assert_eq!(first["usage"]["completion_tokens"], 3);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The same prompt again: its 6 full blocks of 16 tokens are cached.
    let streamed = format!(r#"{{"prompt": "{prompt}", "max_tokens": 2, "stream": true}}"#);
    let (_, events) = exchange(
        replica.addr,
        http::Method::POST,
        "/v1/completions",
        &streamed,
    )
    .await;
    let events: Vec<&str> = events.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 4, "two tokens, the usage, [DONE]: {events:?}");
    assert_eq!(events[3], "data: [DONE]");
    let usage: serde_json::Value =
        serde_json::from_str(events[2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
    // Without usage on, the same answer has none.
    let plain = sim::spawn(SimConfig::instant("n")).await.unwrap();
    let (_, answer) = exchange(plain.addr, http::Method::POST, "/v1/completions", &whole).await;
    let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert!(answer["usage"].is_null() && answer["choices"][0]["message"].is_object());
}

/// Replicas sharing one prefix cache (the floor of the prefix workloads) find a prompt another
/// of them computed; replicas with caches of their own do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_a_prefix_cache_find_what_another_computed() {
    // 100 prompt tokens: 6 full blocks, computed by the first replica, asked of the second.
    let body = format!(r#"{{"prompt": "{}", "max_tokens": 2}}"#, "q".repeat(400));
    for (shared, cached_on_second) in [(Some(sim::SharedCache::new(10_000, 16)), 96), (None, 0)] {
        let first = sim::spawn(usage_replica("one", shared.clone()))
            .await
            .unwrap();
        let second = sim::spawn(usage_replica("two", shared)).await.unwrap();
        let mut cached = Vec::new();
        for replica in [&first, &second] {
            let (status, answer) =
                exchange(replica.addr, http::Method::POST, "/v1/completions", &body).await;
            assert_eq!(status, 200);
            let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
            cached.push(answer["usage"]["prompt_tokens_details"]["cached_tokens"].clone());
        }
        assert_eq!(cached, [0, cached_on_second]);
    }
}

/// The floors of the prefix workloads run their parent's requests (its seed and traffic) on its
/// replicas with their prefix caches pooled.
#[test]
fn cache_floor_scenarios_pool_the_caches_of_their_parents_replicas() {
    for parent in [
        "prefix",
        "prefix-session",
        "trace-conversation",
        "trace-synthetic",
    ] {
        let (mixed, floor) = (routing(parent), routing(&format!("{parent}-floor")));
        assert!(!mixed.engine.pooled_prefix_cache && floor.engine.pooled_prefix_cache);
        assert_eq!(floor.seed_of, Some(parent), "the parent's schedule");
        assert_eq!(
            format!("{:?}", (&mixed.traffic, mixed.replicas.len(), mixed.slo)),
            format!("{:?}", (&floor.traffic, floor.replicas.len(), floor.slo)),
        );
        assert_eq!(
            mixed.engine.prefix_cache_tokens,
            floor.engine.prefix_cache_tokens
        );
    }
}

// --- Trace replays: the trace's prefix sharing, its window and its times. ---

/// Two requests of a replayed trace share exactly the prefix their `hash_ids` say (a whole
/// block of text per shared id), arrive at their timestamps divided by the speed-up, and a run
/// with another seed replays another window of the trace.
#[test]
fn a_replayed_trace_keeps_its_prefix_sharing_and_its_times() {
    use lab::trace::{Trace, load as load_trace};
    use lab::workload::Scale;
    let trace = Trace {
        file: "conversation_trace.jsonl.gz",
        about: "test",
        window_seconds: 60.0,
        speedup: 2.0,
        tokens_per_block: 32,
        output_scale: 0.5,
        stream: false,
    };
    let lines = load_trace(trace.file).unwrap();
    assert_eq!(lines.len(), 12_031);
    let users = trace.users(5, Scale::FULL);
    assert!(
        users.len() > 100,
        "{} requests in 60 s of trace",
        users.len()
    );
    let prompt = |user: &load::User| -> String {
        let body: serde_json::Value = serde_json::from_slice(&user.turns[0].request.body).unwrap();
        assert_eq!(body["stream"], false);
        body["messages"][0]["content"].as_str().unwrap().to_owned()
    };
    let window = trace.window(&lines, 5, Scale::FULL);
    assert_eq!(window.len(), users.len());
    let block_chars = 32 * 4;
    let mut compared = 0;
    for (i, (a_line, a)) in window.iter().zip(&users).enumerate().take(60) {
        for (b_line, b) in window.iter().zip(&users).skip(i + 1).take(60) {
            let shared = a_line
                .hash_ids
                .iter()
                .zip(&b_line.hash_ids)
                .take_while(|(x, y)| x == y)
                .count();
            let (pa, pb) = (prompt(a), prompt(b));
            let common = pa
                .bytes()
                .zip(pb.bytes())
                .take_while(|(x, y)| x == y)
                .count();
            let whole_blocks = (shared * block_chars).min(pa.len()).min(pb.len());
            assert!(common >= whole_blocks, "{common} < {whole_blocks}");
            if shared < a_line.hash_ids.len() && shared < b_line.hash_ids.len() {
                assert!(
                    common < whole_blocks + block_chars,
                    "only the shared blocks match"
                );
            }
            compared += usize::from(shared > 0);
        }
    }
    assert!(compared > 0, "the window has requests that share blocks");
    let at = |user: &load::User| user.start.as_secs_f64();
    let (t0, t5) = (window[0].timestamp as f64, window[5].timestamp as f64);
    assert!((at(&users[5]) - at(&users[0]) - (t5 - t0) / 1000.0 / 2.0).abs() < 1e-6);
    assert_eq!(
        users[5].turns[0].request.max_tokens,
        ((window[5].output_length as f64 * 0.5).round() as u32).max(1)
    );
    let other = trace.users(6, Scale::FULL);
    assert_ne!(
        prompt(&other[0]),
        prompt(&users[0]),
        "another seed, another window"
    );
}
