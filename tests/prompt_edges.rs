//! Prompt extraction, the prefix index and the strategies that use them at their edges: the
//! index's memory while it keeps evicting, p2c's estimate after long failure runs and beside
//! long streams, a duplicate `messages`, prompts recorded for fair-share cost, and affinity's
//! body key for a body over the retry limit.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use custom_router::backend::Backend;
use custom_router::prefix_index::PrefixIndex;
use custom_router::prompt::Prompt;
use custom_router::strategies::{self, Candidates, Outcome, Pick, RequestInfo, StrategyContext};
use figment::value::{Dict, Value};

/// Counts the heap bytes held by allocations made on the current thread, so that a test can
/// measure what one structure holds whatever other tests do in parallel.
struct PerThread;

thread_local! {
    static HELD: Cell<isize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for PerThread {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = HELD.try_with(|held| held.set(held.get() + layout.size() as isize));
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = HELD.try_with(|held| held.set(held.get() - layout.size() as isize));
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ =
            HELD.try_with(|held| held.set(held.get() + new_size as isize - layout.size() as isize));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: PerThread = PerThread;

fn held() -> isize {
    HELD.with(Cell::get)
}

/// xorshift64: distinct random block hashes.
fn random_chain(state: &mut u64, n: usize) -> Vec<u64> {
    (0..n)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            *state
        })
        .collect()
}

/// docs/configuration.md: the default index holds 16,384 blocks in under 0.95 MiB per backend.
/// A full index that keeps evicting (a busy replica's, always) stays within it: the tombstones
/// evictions leave in its hash map are cleared by a rebuild in place, not by the map doubling.
#[test]
fn prefix_index_memory_stays_bounded_while_it_keeps_evicting() {
    let before = held();
    let index = PrefixIndex::default();
    let mut state = 0x1234_5678_9abc_def1;
    let mut largest = 0;
    // 400 new blocks a prompt (25,600 tokens of new text), 1,000 prompts: about 24 times the
    // capacity evicted.
    for _ in 0..1_000 {
        let chain = random_chain(&mut state, 400);
        let held_before_chain = held();
        index.record(&chain);
        // The chain's own Vec is dropped after; count only what the index holds.
        largest = largest.max(held_before_chain - before - (chain.capacity() * 8) as isize);
    }
    assert_eq!(index.len_blocks(), index.capacity_blocks());
    let reported = index.memory_bytes();
    eprintln!("largest heap held by the index: {largest} bytes; memory_bytes() = {reported}");
    assert!(
        reported <= (95 << 20) / 100 && largest <= (95 << 20) / 100,
        "a full default index holds {reported} bytes ({largest} measured) after churn: \
         {} MB at 64 backends, over the documented 0.95 MiB a backend",
        reported * 64 / 1_000_000
    );
}

fn p2c(seed: u64) -> Arc<dyn strategies::Strategy> {
    let entry = strategies::find("p2c-peak-ewma").unwrap();
    let mut params = Dict::new();
    params.insert("seed".into(), Value::from(seed));
    (entry.build)(&StrategyContext::default(), &Value::from(params)).unwrap()
}

fn outcome(latency: f64, failed: bool) -> Outcome {
    Outcome {
        latency,
        failed,
        first_byte: None,
        bytes: 0,
        streamed: false,
        usage: None,
        in_flight: 1,
        prompt_tokens: 0,
        recall: Default::default(),
    }
}

fn backends(n: usize, net: u8) -> Vec<Arc<Backend>> {
    (0..n)
        .map(|i| Arc::new(Backend::new(format!("10.{net}.0.{i}:80").parse().unwrap())))
        .collect()
}

/// A failure counts at least twice the current estimate, up to an hour: a long run of failures
/// never makes it infinite, whose decay would read as NaN (a NaN cost would win or lose every
/// pair by draw order, and spread to never-measured backends through the mean).
#[tokio::test(start_paused = true)]
async fn p2c_a_long_run_of_failures_leaves_no_nan_estimate() {
    let strategy = p2c(1);
    let set = backends(2, 91);
    strategy.on_backends_changed(&set);
    // Backend 0 refuses connections for about a second, at 1,000 attempts a second.
    for _ in 0..1_100 {
        strategy.on_outcome(&set[0], &outcome(3.0, true));
        tokio::time::advance(Duration::from_millis(1)).await;
    }
    // Three quiet hours later, both answer: backend 0 in 0.5 s, backend 1 in 1 s.
    tokio::time::advance(Duration::from_secs(3 * 3600)).await;
    strategy.on_outcome(&set[0], &outcome(0.5, false));
    strategy.on_outcome(&set[1], &outcome(1.0, false));
    // Both idle; backend 0 is twice as fast (its estimate is its sample after 3 h: the old one
    // weighs exp(-1080) = 0), so it costs 0.5 against 1.0 and wins every pair.
    let picks: Vec<usize> = (0..100)
        .filter_map(|_| strategy.pick(&RequestInfo::default(), Candidates::new(&set)))
        .map(|pick| pick.index)
        .collect();
    let to_slow = picks.iter().filter(|&&i| i == 1).count();
    assert_eq!(
        to_slow, 0,
        "{to_slow} of 100 picks went to the slower idle backend: backend 0's estimate is NaN"
    );
}

/// Duplicate keys: a duplicated `prompt`, `inputs`, `max_tokens` or `stream` is read last-wins
/// (as Python's json, the engines built on it); a duplicated `messages` makes a body with no
/// prompt (Python engines run the last, TGI refuses the body: the router cannot know which
/// conversation runs), routed by load alone.
#[test]
fn a_duplicate_messages_field_leaves_no_prompt() {
    let body = br#"{"messages": [{"role": "user", "content": "first"}],
                    "messages": [{"role": "user", "content": "the second, longer, one the engine runs"}]}"#;
    assert_eq!(Prompt::of_body(body), None);
    let dup_prompt = Prompt::of_body(br#"{"prompt": "a", "prompt": "bbbbbbbb"}"#).unwrap();
    assert_eq!(
        dup_prompt,
        Prompt::of_body(br#"{"prompt": "bbbbbbbb"}"#).unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_index_is_recorded_through_the_router_and_forgotten_on_re_add() {
    use common::*;
    let backend = slow_backend(Duration::from_millis(1)).await;
    let router = start_router(qll()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let system = "You are a careful assistant. ".repeat(100);
    let body = serde_json::json!({
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        "max_tokens": 10
    })
    .to_string();
    let prompt = Prompt::of_body(body.as_bytes()).unwrap();
    assert!(prompt.blocks.len() >= 10);
    let (status, _) = post_json(&router.url("/v1/chat/completions"), body.clone()).await;
    assert_eq!(status, http::StatusCode::OK);
    let first = Arc::clone(&router.balancer.backends()[0]);
    assert_eq!(
        first.prefixes().matched_blocks(&prompt.blocks),
        prompt.blocks.len()
    );
    set_backends(router.addr, &[]).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let again = Arc::clone(&router.balancer.backends()[0]);
    assert!(!Arc::ptr_eq(&first, &again));
    assert_eq!(again.prefixes().len_blocks(), 0);
    assert_eq!(again.prefixes().matched_blocks(&prompt.blocks), 0);
}

/// p2c-peak-ewma's cost is the expected time to drain what the backend already has plus this
/// request. A replica busy with streams longer than `decay` gets no sample while they run: its
/// estimate holds while requests are in flight, so it does not look cheapest when it is busiest.
#[tokio::test(start_paused = true)]
async fn p2c_a_replica_busy_with_long_streams_does_not_look_free() {
    // A round-robin balancer only to hold requests in flight on chosen backends.
    let mut config = custom_router::Config::default();
    config.strategy.name = "round-robin".to_owned();
    let balancer = custom_router::Settings::from_config(config)
        .unwrap()
        .balancer()
        .unwrap();
    let addrs = vec![
        "10.92.0.1:80".parse().unwrap(),
        "10.92.0.2:80".parse().unwrap(),
    ];
    let set = balancer.set_backends(addrs).to_vec();
    let strategy = p2c(5);
    strategy.on_backends_changed(&set);
    // Both replicas answered in 2 s.
    strategy.on_outcome(&set[0], &outcome(2.0, false));
    strategy.on_outcome(&set[1], &outcome(2.0, false));
    // Replica 0 then holds 20 long streams, replica 1 two requests.
    let mut held = Vec::new();
    while set[0].in_flight() < 20 || set[1].in_flight() < 2 {
        let lease = balancer.admit(RequestInfo::default()).await.unwrap();
        if Arc::ptr_eq(lease.backend(), &set[0]) || set[1].in_flight() <= 2 {
            held.push(lease);
        }
    }
    assert_eq!((set[0].in_flight(), set[1].in_flight()), (20, 2));
    // A minute later the streams still run; replica 1 just finished another 2 s answer.
    tokio::time::advance(Duration::from_secs(59)).await;
    strategy.on_outcome(&set[1], &outcome(2.0, false));
    tokio::time::advance(Duration::from_secs(1)).await;
    let to_busy = (0..100)
        .filter(|_| {
            strategy.pick(&RequestInfo::default(), Candidates::new(&set)) == Some(Pick::at(0))
        })
        .count();
    assert_eq!(
        to_busy, 0,
        "{to_busy} of 100 new requests went to the replica with 20 streams in flight rather \
         than to the equally fast one with 2"
    );
    drop(held);
}

/// With `queue.tenant_header` set the core finds prompts for every strategy (the fair shares'
/// cost) and records them in the chosen backend's prefix index, so that the access log's
/// `uncached_tokens` means the same under every strategy (`Strategy::reads_prompts`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_are_recorded_for_fair_share_cost_under_any_strategy() {
    use common::*;
    let backend = slow_backend(Duration::from_millis(1)).await;
    let mut config = round_robin();
    config.queue.tenant_header = "x-tenant".to_owned();
    let router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let body = serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": "A long question. ".repeat(200)}]
    })
    .to_string();
    let request = http::Request::post(router.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-tenant", "acme")
        .body(full(body))
        .unwrap();
    let (status, _, _) = send(request).await;
    assert_eq!(status, http::StatusCode::OK);
    let recorded = router.balancer.backends()[0].prefixes().len_blocks();
    assert!(recorded > 0, "the prompt was not recorded");
}

/// docs/strategies.md (affinity): a body without a prompt the router reads is keyed by its first
/// `body_prefix_bytes` (256) bytes. A body whose `Content-Length` is above `retry.body_limit` is
/// streamed, but its first frame is read before routing, so a chat with base64 images (> 1 MiB,
/// sent with `Content-Length`) keeps its affinity as the same body sent chunked does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn affinity_keys_a_body_above_the_limit_by_its_first_bytes() {
    use common::*;
    use http_body_util::BodyExt;
    let mut backends = Vec::new();
    for _ in 0..3 {
        backends.push(
            spawn_backend(|request: http::Request<hyper::body::Incoming>| async move {
                let _ = request.into_body().collect().await;
                respond(http::StatusCode::OK, "ok")
            })
            .await,
        );
    }
    let router = start_router(with_strategy("affinity")).await;
    let addrs: Vec<String> = backends.iter().map(|b| b.host_port()).collect();
    set_backends(router.addr, &addrs).await;
    let image = "A".repeat(2 << 20);
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"what is this?"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{image}"}}}}]}}]}}"#
    );
    // Sent chunked, the body is read up to the limit and keyed by its first 256 bytes: the six
    // turns go to one backend.
    for _ in 0..6 {
        let (sender, chunked) = channel_body();
        let request = http::Request::post(router.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(chunked)
            .unwrap();
        let feed = body.clone();
        let feeder = tokio::spawn(async move {
            for piece in feed.as_bytes().chunks(64 * 1024) {
                if sender
                    .send(bytes::Bytes::copy_from_slice(piece))
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
        let (status, _, _) = send(request).await;
        feeder.await.unwrap();
        assert_eq!(status, http::StatusCode::OK);
    }
    let chunked_hits: Vec<usize> = backends.iter().map(|b| b.hits()).collect();
    assert!(chunked_hits.contains(&6), "chunked: {chunked_hits:?}");
    for _ in 0..6 {
        let request = http::Request::post(router.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("content-length", body.len())
            .body(full(body.clone()))
            .unwrap();
        let (status, _, _) = send(request).await;
        assert_eq!(status, http::StatusCode::OK);
    }
    let hits: Vec<usize> = backends
        .iter()
        .zip(&chunked_hits)
        .map(|(b, before)| b.hits() - before)
        .collect();
    assert!(
        hits.contains(&6),
        "six turns of one body over 1 MiB (same first bytes) spread over {hits:?}"
    );
}
