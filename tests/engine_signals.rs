//! The engines' own numbers (`engine_metrics`) in the default strategy's picks, on paused time:
//! a stated capacity (TGI's `/info`) is the limit, work an engine runs for other clients and a
//! full KV cache count as load (a router that just became the leader sees them before it has
//! measured anything), and the limit does not grow while an engine says it is full (requests
//! wait inside it and its KV cache is full), whether its answers stream or come whole.

mod paused;

use std::sync::Arc;
use std::time::Duration;

use custom_router::backend::Backend;
use custom_router::balancer::{Balancer, Finish};
use custom_router::engine_metrics::{Engine, EngineReading};
use custom_router::strategies::RequestInfo;
use tokio::time::{Instant, advance};

/// The default strategy (`score = "load"`).
fn load_balancer() -> Arc<Balancer> {
    paused::ewma_balancer(|config| {
        config.strategy.params.remove("score");
    })
}

/// Records a fresh scrape of `backend` (read for the next 10 s).
fn scraped(backend: &Backend, running: u32, waiting: u32, kv_usage: Option<f64>) {
    let reading = EngineReading {
        engine: Engine::Vllm,
        running,
        waiting,
        kv_usage,
        prefix_cache: None,
    };
    backend.engine().record(
        &reading,
        backend.in_flight(),
        Instant::now(),
        Duration::from_secs(10),
    );
}

/// Two backends, each measured by one answer of 100 ms.
async fn measured_pair(balancer: &Arc<Balancer>) -> Vec<Arc<Backend>> {
    let backends = paused::with_backends(balancer, &["10.0.0.1:8000", "10.0.0.2:8000"]);
    for _ in 0..2 {
        let lease = paused::admit_now(balancer).await;
        advance(Duration::from_millis(100)).await;
        lease.finish(paused::OK);
        paused::settle().await;
    }
    backends
}

/// The address the next request is admitted to (its lease is finished at once).
async fn next_pick(balancer: &Arc<Balancer>) -> String {
    let lease = paused::admit_now(balancer).await;
    let addr = lease.backend().addr().to_string();
    lease.finish(paused::OK);
    paused::settle().await;
    addr
}

/// Two idle backends the router has measured nothing of: one engine runs 8 requests for other
/// clients (an earlier leader's), the other none. New requests go to the idle engine, whichever
/// is listed first.
#[tokio::test(start_paused = true)]
async fn work_an_engine_runs_for_other_clients_counts_before_anything_is_measured() {
    for busy in [0, 1] {
        let balancer = load_balancer();
        let backends = paused::with_backends(&balancer, &["10.0.0.1:8000", "10.0.0.2:8000"]);
        scraped(&backends[busy], 8, 0, Some(0.5));
        scraped(&backends[1 - busy], 0, 0, Some(0.0));
        let idle = backends[1 - busy].addr().to_string();
        assert_eq!(next_pick(&balancer).await, idle);
    }
}

/// Measured, equal backends: one engine's KV cache is full (97 %), so a new sequence starts
/// there only when one ends; the request goes to the other. At 90 % it is not full, and the
/// tie goes to either.
#[tokio::test(start_paused = true)]
async fn a_full_kv_cache_counts_as_a_request_ahead() {
    for full in [0, 1] {
        let balancer = load_balancer();
        let backends = measured_pair(&balancer).await;
        // One request in flight on each, so that the work term is equal.
        let _a = paused::admit_now(&balancer).await;
        let _b = paused::admit_now(&balancer).await;
        scraped(&backends[full], 1, 0, Some(0.97));
        scraped(&backends[1 - full], 1, 0, Some(0.90));
        let other = backends[1 - full].addr().to_string();
        for _ in 0..3 {
            assert_eq!(next_pick(&balancer).await, other);
        }
    }
}

/// TGI's `/info` `max_concurrent_requests` is the limit while fresh: with a capacity of 2 the
/// third request waits in the router queue until one ends, although the learned limit starts
/// at 4.
#[tokio::test(start_paused = true)]
async fn a_stated_capacity_is_the_limit() {
    let balancer = load_balancer();
    let backend = paused::with_backends(&balancer, &["10.0.0.1:8000"]).remove(0);
    let lease = paused::admit_now(&balancer).await;
    advance(Duration::from_millis(100)).await;
    lease.finish(paused::OK);
    paused::settle().await;
    scraped(&backend, 0, 0, None);
    backend.engine().record_info(Some(2));
    let first = paused::admit_now(&balancer).await;
    let _second = paused::admit_now(&balancer).await;
    let third = tokio::time::timeout(Duration::ZERO, balancer.admit(RequestInfo::default())).await;
    assert!(
        third.is_err(),
        "a third request went past the stated capacity of 2"
    );
    let waiting = {
        let balancer = Arc::clone(&balancer);
        tokio::spawn(async move { balancer.admit(RequestInfo::default()).await })
    };
    paused::settle().await;
    assert!(!waiting.is_finished());
    first.finish(paused::OK);
    paused::settle().await;
    assert!(
        waiting.is_finished(),
        "the queued request goes once one ends"
    );
}

/// Streams whose first bytes come on time grow the limit (slow start) — unless the engine says
/// it is full: requests wait inside it and its KV cache is full, whatever the first bytes say.
/// Requests waiting between two of an engine's steps while its KV cache has room (a scrape
/// during a burst of arrivals sees them) do not hold the limit back.
#[tokio::test(start_paused = true)]
async fn the_limit_does_not_grow_while_the_engine_is_full() {
    // (waiting, KV usage, whether the limit grows)
    for (waiting, kv_usage, grows) in [
        (0, Some(0.5), true),
        (3, Some(0.5), true),
        (3, None, true),
        (0, Some(0.97), true),
        (3, Some(0.97), false),
    ] {
        let balancer = load_balancer();
        let backend = paused::with_backends(&balancer, &["10.0.0.1:8000"]).remove(0);
        // Four streams with on-time first bytes, the engine scraped before each.
        let mut leases = Vec::new();
        for _ in 0..4 {
            scraped(&backend, 4, waiting, kv_usage);
            let mut lease = paused::admit_now(&balancer).await;
            lease.mark_streamed();
            advance(Duration::from_millis(5)).await;
            lease.mark_first_byte();
            leases.push(lease);
        }
        paused::settle().await;
        // Initial limit 4: a fifth goes only if the limit grew.
        let fifth =
            tokio::time::timeout(Duration::ZERO, balancer.admit(RequestInfo::default())).await;
        assert_eq!(
            fifth.is_ok(),
            grows,
            "waiting {waiting}, KV usage {kv_usage:?}: the fifth request went: {}",
            fifth.is_ok()
        );
    }
}

#[tokio::test(start_paused = true)]
async fn the_limit_of_whole_answers_does_not_grow_while_the_engine_is_full() {
    // (waiting, KV usage, whether the limit grows)
    for (waiting, kv_usage, grows) in [
        (0, Some(0.5), true),
        (3, Some(0.5), true),
        (3, Some(0.97), false),
    ] {
        let balancer = load_balancer();
        let backend = paused::with_backends(&balancer, &["10.0.0.1:8000"]).remove(0);
        // A replica that never streams, kept as full as its limit allows for 15 rounds: each
        // round's answers take 100 ms whatever the load (more in flight finish more), the
        // engine scraped before each round.
        for _ in 0..15 {
            scraped(&backend, 4, waiting, kv_usage);
            let leases = paused::admit_while_room(&balancer, 1000).await;
            advance(Duration::from_millis(100)).await;
            for lease in leases {
                lease.finish(Finish {
                    bytes: 512,
                    ..paused::OK
                });
            }
            paused::settle().await;
        }
        // Initial limit 4: a fifth goes only if the limit grew.
        let admitted = paused::admit_while_room(&balancer, 1000).await;
        assert_eq!(
            admitted.len() > 4,
            grows,
            "waiting {waiting}, KV usage {kv_usage:?}: {} admitted",
            admitted.len()
        );
    }
}

/// The engine's running count is compared with the router's requests in flight when the scrape
/// was taken: requests that ended since are not taken for another client's work. Two measured
/// backends, three requests on one and two on the other when both were scraped; two of the
/// three end. The next request goes to the backend that made room (one in flight against two),
/// though its last scrape still shows three running.
#[tokio::test(start_paused = true)]
async fn requests_ended_since_the_scrape_are_not_another_clients_work() {
    let balancer = load_balancer();
    let backends = measured_pair(&balancer).await;
    let mut leases = Vec::new();
    for _ in 0..5 {
        leases.push(paused::admit_now(&balancer).await);
    }
    let on = |backend: &Backend| {
        leases
            .iter()
            .filter(|lease| lease.backend().addr() == backend.addr())
            .count()
    };
    let (three, two) = if on(&backends[0]) == 3 {
        (0, 1)
    } else {
        (1, 0)
    };
    assert_eq!((on(&backends[three]), on(&backends[two])), (3, 2));
    scraped(&backends[three], 3, 0, Some(0.5));
    scraped(&backends[two], 2, 0, Some(0.5));
    // Two of the three end, answered.
    let roomy = backends[three].addr().to_string();
    for _ in 0..2 {
        let at = leases
            .iter()
            .position(|lease| lease.backend().addr().to_string() == roomy)
            .unwrap();
        leases.swap_remove(at).finish(paused::OK);
    }
    paused::settle().await;
    assert_eq!(backends[three].in_flight(), 1);
    assert_eq!(next_pick(&balancer).await, roomy);
}
