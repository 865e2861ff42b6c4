//! The core queue and the queued-least-latency reference rules (`score = "ewma"`), driven
//! through the balancer with paused tokio time (no sockets: the rules are about counts and
//! clocks).

mod paused;

use std::sync::Arc;
use std::time::Duration;

use custom_router::backend::ErrorKind;
use custom_router::balancer::{Admission, Balancer, Finish, Lease, Rejection};
use custom_router::strategies::RequestInfo;
use http::StatusCode;
use paused::{OK, admit_now, counter, ewma_balancer as balancer, settle, with_backends};
use tokio::task::JoinHandle;
use tokio::time::{Instant, advance};

/// Starts an admission in the background and lets it reach the queue.
async fn admit_later(balancer: &Arc<Balancer>) -> JoinHandle<Result<Lease, Rejection>> {
    let balancer = Arc::clone(balancer);
    let task = tokio::spawn(async move { balancer.admit(RequestInfo::default()).await });
    settle().await;
    task
}

/// Finishes `lease` successfully after `latency` of paused time.
async fn finish_after(lease: Lease, latency: Duration) {
    advance(latency).await;
    lease.finish(OK);
    settle().await;
}

#[tokio::test(start_paused = true)]
async fn rule1_a_never_measured_idle_backend_is_probed_first() {
    let balancer = balancer(|_| {});
    let [fast, fresh] = &with_backends(&balancer, &["a:1", "b:1"])[..] else {
        unreachable!()
    };
    // Measure `fast` (its first pick is a probe too, then it has a sample).
    let lease = admit_now(&balancer).await;
    let first = Arc::clone(lease.backend());
    finish_after(lease, Duration::from_millis(10)).await;
    let other = if Arc::ptr_eq(&first, fast) {
        fresh
    } else {
        fast
    };
    // The unmeasured one scores 0 and wins over a 10 ms EWMA.
    let lease = admit_now(&balancer).await;
    assert!(Arc::ptr_eq(lease.backend(), other));
}

#[tokio::test(start_paused = true)]
async fn rule2_a_never_measured_busy_backend_waits_for_its_first_result() {
    let balancer = balancer(|_| {});
    let backends = with_backends(&balancer, &["a:1"]);
    let probe = admit_now(&balancer).await;
    let waiting = admit_later(&balancer).await;
    assert_eq!(balancer.queue_depth(), 1);
    assert!(!waiting.is_finished());
    finish_after(probe, Duration::from_millis(100)).await;
    let lease = waiting.await.unwrap().unwrap();
    assert!(Arc::ptr_eq(lease.backend(), &backends[0]));
    assert_eq!(balancer.queue_depth(), 0);
}

#[tokio::test(start_paused = true)]
async fn rule3_a_measured_idle_backend_is_used_even_above_the_threshold() {
    let balancer = balancer(|c| c.latency.threshold = Duration::from_secs(3));
    let backends = with_backends(&balancer, &["a:1"]);
    finish_after(admit_now(&balancer).await, Duration::from_secs(10)).await;
    assert_eq!(backends[0].ewma_latency(), Some(10.0));
    let lease = admit_now(&balancer).await;
    assert!(Arc::ptr_eq(lease.backend(), &backends[0]));
}

#[tokio::test(start_paused = true)]
async fn rule4_a_busy_backend_needs_a_low_ewma_and_ramp_up_room() {
    // Low EWMA: 1 completed allows up to 5 in flight (ramp_up_factor 5), the 6th waits.
    let balancer = balancer(|_| {});
    let backends = with_backends(&balancer, &["a:1"]);
    finish_after(admit_now(&balancer).await, Duration::from_millis(200)).await;
    let mut leases = Vec::new();
    for _ in 0..5 {
        leases.push(admit_now(&balancer).await);
    }
    assert_eq!(backends[0].in_flight(), 5);
    let sixth = admit_later(&balancer).await;
    assert_eq!(balancer.queue_depth(), 1);
    leases.pop().unwrap().finish(OK);
    settle().await;
    assert!(sixth.await.unwrap().is_ok());

    // EWMA at or above the threshold: a busy backend takes nothing more.
    let balancer = self::balancer(|c| c.latency.threshold = Duration::from_secs(3));
    let backends = with_backends(&balancer, &["a:1"]);
    finish_after(admit_now(&balancer).await, Duration::from_secs(4)).await;
    let busy = admit_now(&balancer).await;
    let next = admit_later(&balancer).await;
    assert_eq!(backends[0].in_flight(), 1);
    assert_eq!(balancer.queue_depth(), 1);
    finish_after(busy, Duration::from_secs(4)).await;
    assert!(next.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn rule5_lowest_ewma_wins_and_equal_backends_take_turns() {
    let balancer = balancer(|_| {});
    let backends = with_backends(&balancer, &["a:1", "b:1", "c:1"]);
    // Measure all three: a = 300 ms, b = 100 ms, c = 100 ms.
    let mut probes = Vec::new();
    for _ in 0..3 {
        probes.push(admit_now(&balancer).await);
    }
    probes.sort_by_key(|lease| lease.backend().addr().to_string());
    let mut probes = probes.into_iter();
    let a = probes.next().unwrap();
    advance(Duration::from_millis(100)).await;
    probes.next().unwrap().finish(OK);
    probes.next().unwrap().finish(OK);
    finish_after(a, Duration::from_millis(200)).await;
    let mut picks = Vec::new();
    for _ in 0..4 {
        let lease = admit_now(&balancer).await;
        picks.push(lease.backend().addr().to_string());
        // Not finished: each pick leaves its backend busy, so turns are by in-flight then rotation.
        std::mem::forget(lease);
    }
    assert_eq!(
        picks[..2].iter().filter(|p| *p == "b:1").count(),
        1,
        "{picks:?}"
    );
    assert_eq!(
        picks[..2].iter().filter(|p| *p == "c:1").count(),
        1,
        "{picks:?}"
    );
    assert!(!picks[..2].contains(&"a:1".to_owned()), "{picks:?}");
    assert_eq!(
        backends[0].in_flight() + backends[1].in_flight() + backends[2].in_flight(),
        4
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_evicts_the_oldest_waiter_with_503() {
    let balancer = balancer(|c| c.queue.max_size = 2);
    with_backends(&balancer, &["a:1"]);
    let _probe = admit_now(&balancer).await;
    let oldest = admit_later(&balancer).await;
    let second = admit_later(&balancer).await;
    let third = admit_later(&balancer).await;
    assert_eq!(oldest.await.unwrap().unwrap_err(), Rejection::Evicted);
    assert_eq!(balancer.queue_depth(), 2);
    assert!(!second.is_finished() && !third.is_finished());
    assert_eq!(
        counter(&balancer, "custom_router_requests_evicted_total", ""),
        1.0
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_waiting_past_the_queue_timeout_gets_503_at_the_deadline() {
    let balancer = balancer(|c| c.queue.timeout = Duration::from_secs(5));
    with_backends(&balancer, &["a:1"]);
    let _probe = admit_now(&balancer).await;
    let started = Instant::now();
    let outcome = balancer.admit(RequestInfo::default()).await;
    let waited = started.elapsed();
    assert_eq!(outcome.unwrap_err(), Rejection::Timeout);
    assert!(
        waited >= Duration::from_millis(4990) && waited <= Duration::from_millis(5010),
        "{waited:?}"
    );
    assert_eq!(balancer.queue_depth(), 0);
    assert_eq!(
        counter(&balancer, "custom_router_requests_timeout_total", ""),
        1.0
    );
}

#[tokio::test(start_paused = true)]
async fn waiters_are_dispatched_in_arrival_order() {
    // Answers slower than the threshold: the backend takes one request at a time (rules 3 and 4),
    // so each finish lets exactly one waiter go.
    let balancer = balancer(|c| c.latency.threshold = Duration::from_millis(10));
    with_backends(&balancer, &["a:1"]);
    let mut lease = admit_now(&balancer).await;
    let mut waiters = Vec::new();
    for _ in 0..20 {
        waiters.push(admit_later(&balancer).await);
    }
    assert_eq!(balancer.queue_depth(), 20);
    for (index, waiter) in waiters.into_iter().enumerate() {
        advance(Duration::from_millis(50)).await;
        lease.finish(OK);
        settle().await;
        assert_eq!(balancer.queue_depth(), 19 - index);
        lease = waiter.await.unwrap().unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_while_queued_is_never_dispatched() {
    let balancer = balancer(|_| {});
    let backends = with_backends(&balancer, &["a:1"]);
    let probe = admit_now(&balancer).await;
    let gone = admit_later(&balancer).await;
    let stays = admit_later(&balancer).await;
    gone.abort();
    settle().await;
    assert_eq!(balancer.queue_depth(), 1);
    assert_eq!(
        counter(&balancer, "custom_router_requests_cancelled_total", ""),
        1.0
    );
    finish_after(probe, Duration::from_millis(10)).await;
    let lease = stays.await.unwrap().unwrap();
    assert_eq!(
        backends[0].in_flight(),
        1,
        "only the live waiter holds the backend"
    );
    drop(lease);
    assert_eq!(backends[0].in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_failed_attempt_counts_as_at_least_the_threshold_and_occupies_the_backend() {
    let balancer = balancer(|c| c.latency.threshold = Duration::from_secs(2));
    let backends = with_backends(&balancer, &["dead:1", "live:1"]);
    // Both probed; the dead one fails in 1 ms, the live one answers in 50 ms.
    let first = admit_now(&balancer).await;
    let second = admit_now(&balancer).await;
    let (dead, live) = if first.backend().addr().as_str() == "dead:1" {
        (first, second)
    } else {
        (second, first)
    };
    advance(Duration::from_millis(1)).await;
    dead.finish(Finish {
        status: None,
        error: Some(ErrorKind::Connect),
        retry_after: None,
        bytes: 0,
        usage: None,
    });
    finish_after(live, Duration::from_millis(49)).await;
    assert_eq!(backends[0].ewma_latency(), Some(2.0));
    assert_eq!(
        backends[0].in_flight(),
        1,
        "held for the rest of the threshold"
    );
    // Every request now goes to the live backend, even concurrently.
    for _ in 0..4 {
        let lease = admit_now(&balancer).await;
        assert_eq!(lease.backend().addr().as_str(), "live:1");
        std::mem::forget(lease);
    }
    advance(Duration::from_secs(2)).await;
    settle().await;
    assert_eq!(backends[0].in_flight(), 0);

    // A 5xx answer is a failure too.
    let balancer = self::balancer(|c| c.latency.threshold = Duration::from_secs(2));
    let backends = with_backends(&balancer, &["a:1"]);
    let lease = admit_now(&balancer).await;
    advance(Duration::from_millis(5)).await;
    lease.finish(Finish {
        status: Some(StatusCode::INTERNAL_SERVER_ERROR),
        error: None,
        retry_after: None,
        bytes: 0,
        usage: None,
    });
    assert_eq!(backends[0].ewma_latency(), Some(2.0));
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_request_gives_no_sample_but_releases_its_slot() {
    let balancer = balancer(|_| {});
    let backends = with_backends(&balancer, &["a:1"]);
    let lease = admit_now(&balancer).await;
    advance(Duration::from_millis(30)).await;
    drop(lease);
    assert_eq!(backends[0].ewma_latency(), None);
    assert_eq!(backends[0].completed(), 0);
    assert_eq!(backends[0].in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_backend_removed_and_added_again_starts_with_no_in_flight() {
    let balancer = balancer(|_| {});
    let before = with_backends(&balancer, &["a:1"]);
    let lease = admit_now(&balancer).await;
    with_backends(&balancer, &[]);
    let after = with_backends(&balancer, &["a:1"]);
    assert!(!Arc::ptr_eq(&before[0], &after[0]));
    assert_eq!(after[0].in_flight(), 0);
    // The old request finishes normally on the old entry.
    lease.finish(OK);
    assert_eq!(before[0].in_flight(), 0);
    assert_eq!(after[0].in_flight(), 0);
    // And the new entry is probed afresh.
    assert!(Arc::ptr_eq(admit_now(&balancer).await.backend(), &after[0]));
}

#[tokio::test(start_paused = true)]
async fn queued_requests_go_out_when_backends_arrive() {
    let balancer = balancer(|_| {});
    let waiting = admit_later(&balancer).await;
    assert_eq!(balancer.queue_depth(), 1);
    with_backends(&balancer, &["a:1"]);
    settle().await;
    assert!(waiting.await.unwrap().is_ok());
    assert_eq!(balancer.queue_depth(), 0);
}

#[tokio::test(start_paused = true)]
async fn completed_is_capped_at_two_fifths_of_the_queue_size() {
    let balancer = balancer(|c| c.queue.max_size = 10);
    let backends = with_backends(&balancer, &["a:1"]);
    for _ in 0..10 {
        finish_after(admit_now(&balancer).await, Duration::from_millis(1)).await;
    }
    assert_eq!(backends[0].completed(), 4);
}

/// Measures the only backend with one 1 s answer, then fills it to its ramp-up room
/// (5 × 1 completed): returns the five leases in flight.
async fn five_in_flight_at_one_second(balancer: &Arc<Balancer>) -> Vec<Lease> {
    let first = admit_now(balancer).await;
    finish_after(first, Duration::from_secs(1)).await;
    let mut leases = Vec::new();
    for _ in 0..5 {
        leases.push(admit_now(balancer).await);
    }
    leases
}

#[tokio::test(start_paused = true)]
async fn a_queue_of_ratio_times_the_in_flight_requests_sheds_new_ones_at_once() {
    let balancer = balancer(|c| c.queue.shed_ratio = 2.0);
    with_backends(&balancer, &["a:1"]);
    let mut leases = five_in_flight_at_one_second(&balancer).await;
    // 2 × 5 in flight: ten may wait.
    let mut waiting = Vec::new();
    for _ in 0..10 {
        waiting.push(admit_later(&balancer).await);
    }
    assert_eq!(balancer.queue_depth(), 10);
    assert!(waiting.iter().all(|task| !task.is_finished()));

    // The eleventh would wait ten requests / (5 in flight / 1 s) = 2 s: answered at once.
    let shed = tokio::time::timeout(Duration::ZERO, balancer.admit(RequestInfo::default()))
        .await
        .expect("answered without waiting");
    assert_eq!(shed.unwrap_err(), Rejection::Overloaded(2));
    assert_eq!(Rejection::Overloaded(2).retry_after(), 2);
    assert_eq!(balancer.queue_depth(), 10);
    assert_eq!(
        counter(&balancer, "custom_router_requests_shed_total", ""),
        1.0
    );

    // A finish lets waiters go (more ramp-up room too): the queue is below the bound again and
    // takes a newcomer.
    finish_after(leases.pop().unwrap(), Duration::from_secs(1)).await;
    let depth = balancer.queue_depth();
    assert!(depth < 10, "{depth}");
    let newcomer = admit_later(&balancer).await;
    assert!(!newcomer.is_finished());
    assert_eq!(balancer.queue_depth(), depth + 1);
    assert_eq!(
        counter(&balancer, "custom_router_requests_shed_total", ""),
        1.0
    );
}

#[tokio::test(start_paused = true)]
async fn nothing_is_shed_while_a_backend_has_no_latency_yet() {
    let balancer = balancer(|c| c.queue.shed_ratio = 2.0);
    with_backends(&balancer, &["a:1"]);
    // A burst on a backend never measured: one probe in flight, the rest wait for its answer.
    let probe = admit_now(&balancer).await;
    let mut waiting = Vec::new();
    for _ in 0..30 {
        waiting.push(admit_later(&balancer).await);
    }
    assert_eq!(balancer.queue_depth(), 30);
    assert!(waiting.iter().all(|task| !task.is_finished()));
    // Once measured (5 may be in flight after one answer), the queue is far above 2 × in
    // flight: newcomers are shed, and the waiters keep their places.
    finish_after(probe, Duration::from_secs(1)).await;
    assert_eq!(balancer.queue_depth(), 25);
    let shed = tokio::time::timeout(Duration::ZERO, balancer.admit(RequestInfo::default()))
        .await
        .expect("answered without waiting");
    assert!(matches!(shed, Err(Rejection::Overloaded(_))), "{shed:?}");
    assert_eq!(balancer.queue_depth(), 25);
    assert_eq!(waiting.iter().filter(|task| task.is_finished()).count(), 5);
}

#[tokio::test(start_paused = true)]
async fn a_ratio_of_zero_never_sheds() {
    let balancer = balancer(|c| c.queue.shed_ratio = 0.0);
    with_backends(&balancer, &["a:1"]);
    let _leases = five_in_flight_at_one_second(&balancer).await;
    let mut waiting = Vec::new();
    for _ in 0..100 {
        waiting.push(admit_later(&balancer).await);
    }
    assert_eq!(balancer.queue_depth(), 100);
    assert!(waiting.iter().all(|task| !task.is_finished()));
    assert_eq!(
        counter(&balancer, "custom_router_requests_shed_total", ""),
        0.0
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_waits_for_an_untried_backend_rather_than_going_back_to_the_failed_one() {
    let balancer = balancer(|_| {});
    let [a, b] = &with_backends(&balancer, &["a:1", "b:1"])[..] else {
        unreachable!()
    };
    // Both are fresh and idle: the first two requests take one each.
    let first = admit_now(&balancer).await;
    let second = admit_now(&balancer).await;
    let (on_a, on_b) = if Arc::ptr_eq(first.backend(), a) {
        (first, second)
    } else {
        (second, first)
    };
    assert!(Arc::ptr_eq(on_b.backend(), b));
    on_a.finish(Finish {
        status: None,
        error: Some(ErrorKind::Connect),
        retry_after: None,
        bytes: 0,
        usage: None,
    });
    settle().await;
    let tried = vec![Arc::clone(a)];
    let retrying = Arc::clone(&balancer);
    let retry = tokio::spawn(async move {
        retrying
            .admit_retry(RequestInfo::default(), Admission::default(), &tried, false)
            .await
    });
    settle().await;
    // The failed backend's slot is held for the latency threshold, then it is idle again, and
    // the reference rules would take it (measured and idle). The retry must not.
    advance(Duration::from_secs(4)).await;
    settle().await;
    assert_eq!(a.in_flight(), 0);
    assert!(
        !retry.is_finished(),
        "the retry went back to the backend that failed"
    );
    finish_after(on_b, Duration::from_millis(100)).await;
    let lease = retry.await.unwrap().unwrap().expect("a lease");
    assert!(
        Arc::ptr_eq(lease.backend(), b),
        "the retry goes to the untried backend"
    );
}
