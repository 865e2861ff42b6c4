//! queued-least-latency's default `load` score, driven through the balancer with paused time:
//! size-normalised cost, learned concurrency limits, and the router queue taking over when every
//! replica is at its limit.

use std::sync::Arc;
use std::time::Duration;

use custom_router::backend::Backend;
use custom_router::balancer::{Balancer, Finish, Lease};
use custom_router::config::{Config, Settings};
use custom_router::strategies::RequestInfo;
use http::StatusCode;
use tokio::task::JoinHandle;
use tokio::time::advance;

fn balancer() -> Arc<Balancer> {
    let mut config = Config::default();
    config.strategy.name = "queued-least-latency".to_owned();
    Balancer::new(&Settings::from_config(config).unwrap()).unwrap()
}

fn with_backends(balancer: &Arc<Balancer>, addrs: &[&str]) -> Vec<Arc<Backend>> {
    let addrs = addrs.iter().map(|a| a.parse().unwrap()).collect();
    balancer.set_backends(addrs).to_vec()
}

async fn admit_now(balancer: &Arc<Balancer>) -> Lease {
    tokio::time::timeout(Duration::ZERO, balancer.admit(RequestInfo::default()))
        .await
        .expect("admitted without waiting")
        .expect("a lease")
}

async fn settle() {
    for _ in 0..5 {
        tokio::task::yield_now().await;
    }
}

/// Admits requests for as long as they go straight out (at most `most`).
async fn admit_while_room(balancer: &Arc<Balancer>, most: usize) -> Vec<Lease> {
    let mut leases = Vec::new();
    while leases.len() < most {
        match tokio::time::timeout(Duration::ZERO, balancer.admit(RequestInfo::default())).await {
            Ok(Ok(lease)) => leases.push(lease),
            _ => break,
        }
    }
    leases
}

async fn admit_later(balancer: &Arc<Balancer>) -> JoinHandle<Lease> {
    let balancer = Arc::clone(balancer);
    let task = tokio::spawn(async move { balancer.admit(RequestInfo::default()).await.unwrap() });
    settle().await;
    task
}

/// Finishes `lease` as a streamed answer: first byte after `ttfb`, the end `rest` later.
async fn stream_answer(mut lease: Lease, ttfb: Duration, rest: Duration, bytes: u64) {
    lease.mark_streamed();
    advance(ttfb).await;
    lease.mark_first_byte();
    advance(rest).await;
    lease.finish(Finish {
        status: Some(StatusCode::OK),
        error: None,
        retry_after: None,
        bytes,
    });
    settle().await;
}

fn addr(lease: &Lease) -> String {
    lease.backend().addr().to_string()
}

#[tokio::test(start_paused = true)]
async fn cost_is_normalised_by_answer_size() {
    let balancer = balancer();
    with_backends(&balancer, &["long:1", "short:1"]);
    let first = admit_now(&balancer).await;
    let second = admit_now(&balancer).await;
    let (long, short) = if addr(&first) == "long:1" {
        (first, second)
    } else {
        (second, first)
    };
    // `long` took 4 s for 64 KiB (62 ms per KiB); `short` 0.5 s for 1 KiB (500 ms per KiB).
    let long_task = tokio::spawn(stream_answer(
        long,
        Duration::from_millis(50),
        Duration::from_millis(3950),
        64 * 1024,
    ));
    stream_answer(
        short,
        Duration::from_millis(50),
        Duration::from_millis(450),
        1024,
    )
    .await;
    long_task.await.unwrap();
    // By end-to-end latency `short` looks 8× faster; per KiB `long` is the faster replica.
    let lease = admit_now(&balancer).await;
    assert_eq!(addr(&lease), "long:1");
}

#[tokio::test(start_paused = true)]
async fn a_replica_at_its_limit_sends_requests_to_the_next_then_to_the_queue() {
    let balancer = balancer();
    let backends = with_backends(&balancer, &["a:1"]);
    // One answered request: a limit of about 4, and ramp-up room for 5.
    let probe = admit_now(&balancer).await;
    stream_answer(
        probe,
        Duration::from_millis(20),
        Duration::from_millis(80),
        2048,
    )
    .await;
    let held = admit_while_room(&balancer, 6).await;
    assert!(held.len() <= 5, "no limit");
    assert!(held.len() >= 4, "{}", held.len());
    assert_eq!(backends[0].in_flight(), held.len());
    // At its limit: the next request waits in the router, not in the replica.
    let waiting = admit_later(&balancer).await;
    assert_eq!(balancer.queue_depth(), 1);
    // A replica added now takes the waiting request at once.
    with_backends(&balancer, &["a:1", "b:1"]);
    settle().await;
    let lease = waiting.await.unwrap();
    assert_eq!(addr(&lease), "b:1");
    assert_eq!(balancer.queue_depth(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_limit_grows_while_ttfb_stays_near_its_baseline_and_shrinks_when_it_rises() {
    let balancer = balancer();
    let backends = with_backends(&balancer, &["a:1"]);
    // Quick first bytes: the limit grows past its initial 4.
    for _ in 0..20 {
        let lease = admit_now(&balancer).await;
        stream_answer(
            lease,
            Duration::from_millis(20),
            Duration::from_millis(100),
            2048,
        )
        .await;
    }
    let concurrent = admit_while_room(&balancer, 51).await;
    let grown = concurrent.len();
    assert!(grown > 4, "limit stayed at {grown}");
    assert_eq!(backends[0].in_flight(), grown);
    // Every answer now waits 10× its baseline for its first byte: the limit comes down.
    for lease in concurrent {
        stream_answer(
            lease,
            Duration::from_millis(200),
            Duration::from_millis(100),
            2048,
        )
        .await;
    }
    let concurrent = admit_while_room(&balancer, 51).await;
    assert!(
        concurrent.len() < grown,
        "limit {} did not shrink from {grown}",
        concurrent.len()
    );
}

#[tokio::test(start_paused = true)]
async fn a_failing_replica_is_ranked_last() {
    let balancer = balancer();
    with_backends(&balancer, &["bad:1", "good:1"]);
    let first = admit_now(&balancer).await;
    let second = admit_now(&balancer).await;
    let (bad, good) = if addr(&first) == "bad:1" {
        (first, second)
    } else {
        (second, first)
    };
    advance(Duration::from_millis(1)).await;
    bad.finish(Finish {
        status: Some(StatusCode::INTERNAL_SERVER_ERROR),
        error: None,
        retry_after: None,
        bytes: 10,
    });
    stream_answer(
        good,
        Duration::from_millis(30),
        Duration::from_millis(500),
        1024,
    )
    .await;
    advance(Duration::from_secs(5)).await;
    settle().await;
    // Both idle again; the one that failed costs the threshold per KiB.
    for _ in 0..3 {
        let lease = admit_now(&balancer).await;
        assert_eq!(addr(&lease), "good:1");
        std::mem::forget(lease);
    }
}
