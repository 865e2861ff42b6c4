//! queued-least-latency's default `load` score, driven through the balancer with paused time:
//! size-normalised cost, learned concurrency limits, and the router queue taking over when every
//! replica is at its limit.

mod paused;

use std::sync::Arc;
use std::time::Duration;

use custom_router::balancer::{Balancer, Finish, Lease};
use custom_router::config::{Config, Settings};
use custom_router::strategies::RequestInfo;
use http::StatusCode;
use paused::{admit_now, admit_while_room, settle, with_backends};
use tokio::task::JoinHandle;
use tokio::time::advance;

fn balancer() -> Arc<Balancer> {
    let mut config = Config::default();
    config.strategy.name = "queued-least-latency".to_owned();
    Settings::from_config(config).unwrap().balancer().unwrap()
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
    lease.finish(ok(bytes));
    settle().await;
}

/// One lease on each of two idle backends, the one on `first` first.
async fn one_lease_each(balancer: &Arc<Balancer>, first: &str) -> (Lease, Lease) {
    let one = admit_now(balancer).await;
    let other = admit_now(balancer).await;
    if addr(&one) == first {
        (one, other)
    } else {
        (other, one)
    }
}

/// A successful answer of `bytes` bytes.
fn ok(bytes: u64) -> Finish {
    Finish {
        status: Some(StatusCode::OK),
        error: None,
        retry_after: None,
        bytes,
        usage: None,
    }
}

fn addr(lease: &Lease) -> String {
    lease.backend().addr().to_string()
}

#[tokio::test(start_paused = true)]
async fn cost_is_normalised_by_answer_size() {
    let balancer = balancer();
    with_backends(&balancer, &["long:1", "short:1"]);
    let (long, short) = one_lease_each(&balancer, "long:1").await;
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
    // Rounds of as many streams as the limit allows, each with a quick first byte: the limit
    // grows past its initial 4 (slow start: two more per on-time first byte while at least half
    // of it is in use, so it doubles every round).
    let probe = admit_now(&balancer).await;
    stream_answer(
        probe,
        Duration::from_millis(20),
        Duration::from_millis(100),
        2048,
    )
    .await;
    for _ in 0..3 {
        let mut round = admit_while_room(&balancer, 200).await;
        for lease in &mut round {
            lease.mark_streamed();
        }
        advance(Duration::from_millis(20)).await;
        for lease in &mut round {
            lease.mark_first_byte();
        }
        advance(Duration::from_millis(100)).await;
        for lease in round {
            lease.finish(ok(2048));
        }
        settle().await;
    }
    let concurrent = admit_while_room(&balancer, 51).await;
    let grown = concurrent.len();
    assert!(grown > 16, "limit stayed at {grown}");
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
    let (bad, good) = one_lease_each(&balancer, "bad:1").await;
    advance(Duration::from_millis(1)).await;
    bad.finish(Finish {
        status: Some(StatusCode::INTERNAL_SERVER_ERROR),
        error: None,
        retry_after: None,
        bytes: 10,
        usage: None,
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

#[tokio::test(start_paused = true)]
async fn replicas_compare_on_equal_terms_whatever_kind_of_answers_they_served() {
    let balancer = balancer();
    with_backends(&balancer, &["streams:1", "whole:1"]);
    let (streams, whole) = one_lease_each(&balancer, "streams:1").await;
    // Equally fast replicas: 2 s each for the same answer, one as events (20 KiB), the other
    // as one JSON document (512 bytes). Per KiB, the stream looks 40× cheaper.
    let stream_task = tokio::spawn(stream_answer(
        streams,
        Duration::from_millis(20),
        Duration::from_millis(1980),
        20 * 1024,
    ));
    advance(Duration::from_secs(2)).await;
    whole.finish(ok(512));
    settle().await;
    stream_task.await.unwrap();
    // Each is the fleet's only measure of its kind: equal relative cost, so the load decides.
    let held = admit_now(&balancer).await;
    let next = admit_now(&balancer).await;
    assert_ne!(
        addr(&held),
        addr(&next),
        "the second request goes to the idle replica"
    );
}

/// Finishes `count` whole (not streamed) answers of 100 ms on the balancer's only backend.
async fn whole_answers(balancer: &Arc<Balancer>, count: usize) {
    for _ in 0..count {
        let lease = admit_now(balancer).await;
        advance(Duration::from_millis(100)).await;
        lease.finish(ok(512));
        settle().await;
    }
}

/// `answers` whole answers on the balancer's only backend, kept as full as its limit allows (each
/// answer that ends is replaced at once), time going by in 5 ms ticks. The backend is an engine of
/// `sequences` that runs each answer for `service` once it holds one (more wait in its own
/// queue, first come first served).
async fn pressed_whole_answers(
    balancer: &Arc<Balancer>,
    answers: usize,
    sequences: usize,
    service: Duration,
) {
    let mut waiting: std::collections::VecDeque<Lease> = std::collections::VecDeque::new();
    let mut running: Vec<(tokio::time::Instant, Lease)> = Vec::new();
    let mut ended = 0;
    while ended < answers {
        waiting.extend(admit_while_room(balancer, 1000).await);
        while running.len() < sequences {
            let Some(lease) = waiting.pop_front() else {
                break;
            };
            running.push((tokio::time::Instant::now() + service, lease));
        }
        advance(Duration::from_millis(5)).await;
        let now = tokio::time::Instant::now();
        let (done, still): (Vec<_>, Vec<_>) =
            running.into_iter().partition(|(ends, _)| *ends <= now);
        running = still;
        for (_, lease) in done {
            lease.finish(ok(512));
            ended += 1;
        }
        settle().await;
    }
}

#[tokio::test(start_paused = true)]
async fn once_streams_have_set_a_baseline_whole_answers_leave_the_limit_alone() {
    // A replica that never streamed: one whole answer at a time says nothing of a higher load,
    // the limit stays at its initial value.
    let balancer = balancer();
    with_backends(&balancer, &["a:1"]);
    whole_answers(&balancer, 20).await;
    assert_eq!(admit_while_room(&balancer, 51).await.len(), 4);
    // Answers that take as long at any load: more in flight finish more, nothing holds it.
    let balancer = self::balancer();
    with_backends(&balancer, &["a:1"]);
    pressed_whole_answers(&balancer, 400, usize::MAX, Duration::from_millis(100)).await;
    let grown = admit_while_room(&balancer, 51).await.len();
    assert!(grown > 40, "limit held at {grown}");
    // An engine of 6 sequences: past 6 the answers wait inside it (the time grows with the
    // load), the throughput is flat, and the limit stops near 6.
    let balancer = self::balancer();
    with_backends(&balancer, &["a:1"]);
    pressed_whole_answers(&balancer, 600, 6, Duration::from_millis(100)).await;
    let knee = admit_while_room(&balancer, 51).await.len();
    assert!((5..=12).contains(&knee), "limit {knee}");

    // A replica whose streams measured its queueing: only streams move its limit.
    let balancer = self::balancer();
    with_backends(&balancer, &["a:1"]);
    let probe = admit_now(&balancer).await;
    stream_answer(
        probe,
        Duration::from_millis(20),
        Duration::from_millis(80),
        2048,
    )
    .await;
    let before = admit_while_room(&balancer, 51).await.len();
    whole_answers(&balancer, 20).await;
    let after = admit_while_room(&balancer, 51).await.len();
    assert!(before <= 5, "{before}");
    assert_eq!(after, before, "whole answers moved the limit");
}
