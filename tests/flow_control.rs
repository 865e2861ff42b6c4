//! Flow control in the router queue, on paused tokio time: admission by deadline at the
//! measured dispatch rate, priority bands with aging, fair shares between tenants.
//!
//! The balancer uses the reference rules (`score = "ewma"`) with a latency threshold (50 ms)
//! below the backends' latency, so a measured backend takes one request at a time: each finished
//! request lets exactly one waiter go, and the dispatch rate is the rate the test finishes them
//! at.

mod paused;

use std::time::Duration;

use custom_router::balancer::{Admission, Band, Lease, Rejection};
use paused::{
    OK, answer_now, counter, one_busy_backend, queue, settle, slow_threshold_balancer as balancer,
};
use tokio::task::JoinHandle;
use tokio::time::advance;

fn in_band(band: Band) -> Admission {
    Admission {
        band,
        ..Admission::default()
    }
}

fn within(millis: u64) -> Admission {
    Admission {
        deadline: Some(Duration::from_millis(millis)),
        ..Admission::default()
    }
}

/// Finishes `lease` after `after`, then returns the lease of the waiter that went next.
async fn next_after(
    lease: Lease,
    after: Duration,
    waiters: &mut Vec<JoinHandle<Result<Lease, Rejection>>>,
) -> Lease {
    advance(after).await;
    lease.finish(OK);
    settle().await;
    let index = waiters
        .iter()
        .position(JoinHandle::is_finished)
        .expect("a waiter went");
    waiters.remove(index).await.unwrap().unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_request_that_would_start_after_its_deadline_is_refused_at_once() {
    let balancer = balancer(|_| {});
    let mut lease = one_busy_backend(&balancer).await;
    let mut waiters = Vec::new();
    for _ in 0..10 {
        waiters.push(queue(&balancer, Admission::default()).await);
    }
    // Before any dispatch from the queue the rate is unknown: even a 1 ms deadline is queued.
    let unknown = queue(&balancer, within(1)).await;
    assert!(!unknown.is_finished());
    // The backend answers every 100 ms: the queue moves at 10 a second.
    for _ in 0..3 {
        lease = next_after(lease, Duration::from_millis(100), &mut waiters).await;
    }
    // The 1 ms request waited past its deadline: answered 503 (timeout) then.
    assert_eq!(unknown.await.unwrap().unwrap_err(), Rejection::Timeout);
    assert_eq!(balancer.queue_depth(), 7);
    // 7 ahead: it would be dispatched within (8 + 2√8) / 10 = 1.37 s (8 dispatches at 10 a
    // second, with a margin of two standard deviations), and its answer would start about
    // 0.14 s after that (every answer so far came 100 ms after its dispatch; the margin there
    // is twice the smoothed deviation): by 1.51 s. With 500 ms to wait it is refused now, with
    // an honest Retry-After (2 s); so is it with 1.45 s, when only the wait for the answer's
    // first byte is past the deadline. With 1.6 s it waits, and so does a request with no
    // deadline.
    let refused = answer_now(&balancer, within(500)).await;
    assert_eq!(refused.unwrap_err(), Rejection::Overloaded(2));
    let refused = answer_now(&balancer, within(1_450)).await;
    assert_eq!(refused.unwrap_err(), Rejection::Overloaded(2));
    assert_eq!(
        counter(
            &balancer,
            "custom_router_requests_shed_total",
            "reason=\"deadline\""
        ),
        2.0
    );
    waiters.push(queue(&balancer, within(1_600)).await);
    waiters.push(queue(&balancer, Admission::default()).await);
    assert_eq!(balancer.queue_depth(), 9);
    // A queue that stops moving counts at the rate it has shown: 2 s without a dispatch, and a
    // request with 9 ahead and 5 s to wait would start in 20 s.
    advance(Duration::from_secs(2)).await;
    assert!(matches!(
        answer_now(&balancer, within(5_000)).await,
        Err(Rejection::Overloaded(_))
    ));
    // A new backend is capacity arriving: the rate is measured afresh and nothing is refused
    // until it is.
    // (The request with 1.6 s to wait was answered 503 at its deadline meanwhile; the new
    // backend takes the next one.)
    balancer.set_backends(vec!["a:1".parse().unwrap(), "b:1".parse().unwrap()]);
    settle().await;
    assert_eq!(balancer.queue_depth(), 7);
    let admitted = queue(&balancer, within(5_000)).await;
    assert!(!admitted.is_finished());
    assert_eq!(balancer.queue_depth(), 8);
    drop(lease);
}

#[tokio::test(start_paused = true)]
async fn higher_bands_go_first_and_a_low_request_ages_past_them() {
    let balancer = balancer(|c| c.queue.priority_aging = Duration::from_secs(2));
    let lease = one_busy_backend(&balancer).await;
    let normal = queue(&balancer, in_band(Band::Normal)).await;
    let low = queue(&balancer, in_band(Band::Low)).await;
    let high = queue(&balancer, in_band(Band::High)).await;
    // Order of service: high, normal, then low, whatever the order of arrival.
    advance(Duration::from_millis(100)).await;
    lease.finish(OK);
    settle().await;
    assert!(high.is_finished() && !normal.is_finished() && !low.is_finished());
    let lease = high.await.unwrap().unwrap();
    advance(Duration::from_millis(100)).await;
    lease.finish(OK);
    settle().await;
    assert!(normal.is_finished() && !low.is_finished());
    let mut lease = normal.await.unwrap().unwrap();
    // High requests keep coming, two for each one served: the low one would never go. Once it
    // has waited 2 s (the aging), it takes one dispatch in four: it goes after three more.
    let mut highs = Vec::new();
    let mut served = 0;
    while !low.is_finished() {
        highs.push(queue(&balancer, in_band(Band::High)).await);
        highs.push(queue(&balancer, in_band(Band::High)).await);
        advance(Duration::from_millis(250)).await;
        lease.finish(OK);
        settle().await;
        if low.is_finished() {
            break;
        }
        let index = highs.iter().position(JoinHandle::is_finished).unwrap();
        lease = highs.remove(index).await.unwrap().unwrap();
        served += 1;
        assert!(served < 20, "the low request starved");
    }
    // It was queued at 1.2 s; the fourth finish after 3.2 s let it go.
    assert!(
        (9..=11).contains(&served),
        "{served} high requests went first"
    );
    assert!(highs.len() > 6, "highs kept waiting: {}", highs.len());
    let wait = counter(
        &balancer,
        "custom_router_queue_wait_seconds_count",
        "band=\"low\"",
    );
    assert_eq!(wait, 1.0);
}

#[tokio::test(start_paused = true)]
async fn normal_requests_waiting_past_the_aging_time_do_not_hold_back_a_high_one() {
    // An overload: ten normal requests have waited three times the aging time when a high one
    // arrives. It goes within the next four dispatches, not after every aged normal request.
    let balancer = balancer(|c| c.queue.priority_aging = Duration::from_secs(2));
    let mut lease = one_busy_backend(&balancer).await;
    let mut normals = Vec::new();
    for _ in 0..10 {
        normals.push(queue(&balancer, in_band(Band::Normal)).await);
    }
    advance(Duration::from_secs(6)).await;
    let high = queue(&balancer, in_band(Band::High)).await;
    let mut before = 0;
    loop {
        advance(Duration::from_millis(100)).await;
        lease.finish(OK);
        settle().await;
        if high.is_finished() {
            break;
        }
        let index = normals
            .iter()
            .position(JoinHandle::is_finished)
            .expect("a normal request went");
        lease = normals.remove(index).await.unwrap().unwrap();
        before += 1;
        assert!(
            before < 10,
            "the high request waited behind every aged normal one"
        );
    }
    // The first dispatch went to the high request: nothing had passed the aged ones over yet,
    // and the high band still goes first until three dispatches in a row have.
    assert_eq!(before, 0, "{before} aged normal requests went first");
    let lease = high.await.unwrap().unwrap();
    // The aged normal requests then get their share: with the high band empty, every dispatch.
    lease.finish(OK);
    settle().await;
    assert_eq!(normals.iter().filter(|n| n.is_finished()).count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_tenant_sending_more_waits_behind_itself_not_in_front_of_the_others() {
    let balancer = balancer(|_| {});
    let tenant = |tenant| Admission {
        tenant,
        ..Admission::default()
    };
    let mut lease = one_busy_backend(&balancer).await;
    // Tenant 1 queues 8 requests, then tenant 2 queues 2.
    let mut first: Vec<_> = Vec::new();
    for _ in 0..8 {
        first.push(queue(&balancer, tenant(1)).await);
    }
    let mut second = vec![
        queue(&balancer, tenant(2)).await,
        queue(&balancer, tenant(2)).await,
    ];
    // In a FIFO the second tenant's first request would go ninth. With fair shares the two
    // tenants alternate: both of its requests go within the first four.
    let mut order = Vec::new();
    for _ in 0..4 {
        advance(Duration::from_millis(100)).await;
        lease.finish(OK);
        settle().await;
        let (went, from) = match second.iter().position(JoinHandle::is_finished) {
            Some(index) => (second.remove(index), 2),
            None => {
                let index = first.iter().position(JoinHandle::is_finished).unwrap();
                (first.remove(index), 1)
            }
        };
        order.push(from);
        lease = went.await.unwrap().unwrap();
    }
    assert_eq!(order.iter().filter(|&&t| t == 2).count(), 2, "{order:?}");
    assert!(second.is_empty());
    // The rest is the first tenant's, in its order: nothing is lost.
    assert_eq!(first.len(), 6);
    assert_eq!(balancer.queue_depth(), 6);
    drop(lease);
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_evicts_from_the_lowest_band_and_the_largest_tenant() {
    let balancer = balancer(|c| c.queue.max_size = 4);
    let lease = one_busy_backend(&balancer).await;
    let admission = |band, tenant| Admission {
        band,
        tenant,
        ..Admission::default()
    };
    let high = queue(&balancer, admission(Band::High, 1)).await;
    let low_small = queue(&balancer, admission(Band::Low, 2)).await;
    let oldest_large = queue(&balancer, admission(Band::Low, 3)).await;
    let newest_large = queue(&balancer, admission(Band::Low, 3)).await;
    // Full: the next one evicts the oldest low request of tenant 3, which holds the most.
    let newcomer = queue(&balancer, admission(Band::Normal, 4)).await;
    assert_eq!(oldest_large.await.unwrap().unwrap_err(), Rejection::Evicted);
    assert!(!newest_large.is_finished() && !low_small.is_finished());
    assert!(!high.is_finished() && !newcomer.is_finished());
    assert_eq!(balancer.queue_depth(), 4);
    drop(lease);
}
