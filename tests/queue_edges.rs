//! The router queue's edge cases, through the balancer on paused time: eviction (band,
//! tenant, age), the aged requests' share, a tenant's tags when its requests leave unserved, a
//! retry waiting for an untried backend, the dispatch-rate prediction across backend-set
//! changes, fair shares by cost under every strategy, the admission headers' odd values,
//! deadline 0, a cancel at the instant of dispatch and every backend removed while requests
//! wait.

mod paused;

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use custom_router::backend::ErrorKind;
use custom_router::balancer::{Admission, Balancer, Band, Finish, Lease, Rejection};
use custom_router::config::Config;
use custom_router::prompt::Prompt;
use custom_router::strategies::RequestInfo;
use custom_router::strategy::{HeaderLookup, RequestView};
use paused::{
    OK, answer_now, counter, ewma_balancer, one_busy_backend, queue, queue_info, settle,
    slow_threshold_balancer as balancer,
};
use tokio::task::JoinHandle;
use tokio::time::advance;

type Waiter = JoinHandle<Result<Lease, Rejection>>;

fn adm(band: Band, tenant: u64) -> Admission {
    Admission {
        band,
        tenant,
        deadline: None,
    }
}

/// A request whose cost (prompt tokens + max_tokens) is `cost`.
fn costing(cost: u32) -> RequestInfo {
    RequestInfo {
        prompt: Some(Arc::new(Prompt {
            tokens: 0,
            max_tokens: Some(cost),
            stream: false,
            blocks: Box::new([]),
            conversation: 0,
            answer: None,
        })),
        ..RequestInfo::default()
    }
}

/// Finishes `lease` after 100 ms and returns which of `waiters` (by label) went, and its lease.
async fn step(lease: Lease, waiters: &mut Vec<(&'static str, Waiter)>) -> (&'static str, Lease) {
    advance(Duration::from_millis(100)).await;
    lease.finish(OK);
    settle().await;
    let index = waiters
        .iter()
        .position(|(_, w)| w.is_finished())
        .expect("a waiter went");
    let (label, waiter) = waiters.remove(index);
    (label, waiter.await.unwrap().expect("dispatched"))
}

// ---------------------------------------------------------------------------------------------
// Eviction
// ---------------------------------------------------------------------------------------------

/// A full queue of high requests: a low newcomer must not push a high request out (it is the
/// least important request present; evicting a high one to queue a low one inverts priority).
#[tokio::test(start_paused = true)]
async fn eviction_a_low_newcomer_does_not_evict_a_high_request() {
    let balancer = balancer(|c| c.queue.max_size = 2);
    let lease = one_busy_backend(&balancer).await;
    let high_1 = queue(&balancer, adm(Band::High, 0)).await;
    let high_2 = queue(&balancer, adm(Band::High, 0)).await;
    let low = queue(&balancer, adm(Band::Low, 0)).await;
    let evicted_high = counter(
        &balancer,
        "custom_router_requests_evicted_total",
        "band=\"high\"",
    );
    assert!(
        !high_1.is_finished() && !high_2.is_finished(),
        "a high request was evicted (503) to queue a low one: evicted{{band=high}} = {evicted_high}, low still queued: {}",
        !low.is_finished()
    );
    drop(lease);
}

/// Among tenants holding the same number, the oldest request is the one evicted
/// (configuration.md: "when full, the oldest is answered 503"; the 503 message says "the oldest
/// waiting request was evicted"). Tried on 16 fresh balancers.
#[tokio::test(start_paused = true)]
async fn eviction_between_equal_tenants_evicts_the_oldest() {
    let mut evicted_index = Vec::new();
    for _ in 0..16 {
        let balancer = balancer(|c| c.queue.max_size = 3);
        let lease = one_busy_backend(&balancer).await;
        let mut queued = Vec::new();
        for tenant in [11, 22, 33] {
            queued.push(queue(&balancer, adm(Band::Normal, tenant)).await);
        }
        let newcomer = queue(&balancer, adm(Band::Normal, 44)).await;
        assert!(!newcomer.is_finished());
        let index = queued.iter().position(JoinHandle::is_finished).unwrap();
        assert_eq!(
            queued.remove(index).await.unwrap().unwrap_err(),
            Rejection::Evicted
        );
        evicted_index.push(index);
        drop(lease);
    }
    assert!(
        evicted_index.iter().all(|&i| i == 0),
        "evicted (0 = oldest): {evicted_index:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Aging
// ---------------------------------------------------------------------------------------------

/// reliability.md: "at least one dispatch in four goes to such aged requests (the oldest
/// first)". With tenants in the aged band, the aged slot goes to the smallest tag instead: a
/// request that arrived after the aging time (not aged at all) takes it.
#[tokio::test(start_paused = true)]
async fn the_aged_slot_goes_to_the_aged_request_not_a_newer_cheaper_one() {
    let balancer = balancer(|c| c.queue.priority_aging = Duration::from_secs(2));
    let mut lease = one_busy_backend(&balancer).await;
    let mut waiters: Vec<(&'static str, Waiter)> = Vec::new();
    // Low, tenant A, cost 1000: queued first.
    waiters.push((
        "aged-low-A",
        queue_info(&balancer, costing(1000), adm(Band::Low, 1)).await,
    ));
    for _ in 0..6 {
        waiters.push(("high", queue(&balancer, adm(Band::High, 0)).await));
    }
    advance(Duration::from_millis(2500)).await;
    // A's request has aged. Tenant B's low request (cost 1) arrives now: not aged.
    waiters.push((
        "fresh-low-B",
        queue_info(&balancer, costing(1), adm(Band::Low, 2)).await,
    ));
    let mut order = Vec::new();
    for _ in 0..4 {
        let (label, next) = step(lease, &mut waiters).await;
        order.push(label);
        lease = next;
    }
    assert_eq!(
        order,
        ["high", "high", "high", "aged-low-A"],
        "the aged slot went to a request that had not aged"
    );
    drop(lease);
}

// ---------------------------------------------------------------------------------------------
// Head-of-line blocking behind a retry
// ---------------------------------------------------------------------------------------------

/// A retry waits in the queue for a backend it has not tried. With requests queued behind it,
/// it must not hold them while a backend it tried sits idle (the dispatch step stops at the
/// first request it cannot place): it takes that backend, and the others follow as backends
/// free up.
#[tokio::test(start_paused = true)]
async fn a_retry_waiting_for_an_untried_backend_does_not_hold_an_idle_one_from_the_queue() {
    let balancer = ewma_balancer(|_| {});
    let set = balancer.set_backends(vec!["a:1".parse().unwrap(), "b:1".parse().unwrap()]);
    let (a, b) = (Arc::clone(&set[0]), Arc::clone(&set[1]));
    let first = balancer.admit(RequestInfo::default()).await.unwrap();
    let second = balancer.admit(RequestInfo::default()).await.unwrap();
    let (on_a, on_b) = if Arc::ptr_eq(first.backend(), &a) {
        (first, second)
    } else {
        (second, first)
    };
    on_a.finish(Finish {
        status: None,
        error: Some(ErrorKind::Connect),
        retry_after: None,
        bytes: 0,
        usage: None,
    });
    settle().await;
    let tried = vec![Arc::clone(&a)];
    let retrying = Arc::clone(&balancer);
    let retry = tokio::spawn(async move {
        retrying
            .admit_retry(RequestInfo::default(), Admission::default(), &tried, false)
            .await
    });
    settle().await;
    advance(Duration::from_secs(4)).await;
    settle().await;
    // Alone, the retry waits for b, the backend it has not tried.
    assert_eq!((a.in_flight(), balancer.queue_depth()), (0, 1), "a is idle");
    // A request queues behind it: the retry takes a rather than hold the queue.
    let fresh = queue(&balancer, Admission::default()).await;
    assert_eq!(a.in_flight(), 1, "a stayed idle while two requests waited");
    let retried = retry.await.unwrap().unwrap().unwrap();
    assert!(Arc::ptr_eq(retried.backend(), &a));
    // The fresh request goes when b frees up.
    drop(on_b);
    settle().await;
    let fresh = fresh.await.unwrap().unwrap();
    assert!(Arc::ptr_eq(fresh.backend(), &b));
    assert_eq!(balancer.queue_depth(), 0);
}

// ---------------------------------------------------------------------------------------------
// Fair shares
// ---------------------------------------------------------------------------------------------

/// A tenant's requests that left the queue unserved (client gone, timed out) still count in its
/// last tag while one of its requests stays queued: its next request is pushed behind requests
/// it never got service for. (Had the staying one left too, its state would be dropped and it
/// would start at the virtual time.)
#[tokio::test(start_paused = true)]
async fn a_tenants_cancelled_requests_do_not_push_its_next_request_back() {
    let balancer = balancer(|_| {});
    let mut lease = one_busy_backend(&balancer).await;
    let mut waiters: Vec<(&'static str, Waiter)> = Vec::new();
    waiters.push(("A-stays", queue(&balancer, adm(Band::Normal, 1)).await));
    let mut gone = Vec::new();
    for _ in 0..10 {
        gone.push(queue(&balancer, adm(Band::Normal, 1)).await);
    }
    for _ in 0..10 {
        waiters.push(("B", queue(&balancer, adm(Band::Normal, 2)).await));
    }
    for task in &gone {
        task.abort();
    }
    settle().await;
    assert_eq!(balancer.queue_depth(), 11);
    assert_eq!(
        counter(&balancer, "custom_router_requests_cancelled_total", ""),
        10.0
    );
    waiters.push(("A-new", queue(&balancer, adm(Band::Normal, 1)).await));
    let mut order = Vec::new();
    while !waiters.is_empty() {
        let (label, next) = step(lease, &mut waiters).await;
        order.push(label);
        lease = next;
    }
    let position = order.iter().position(|&l| l == "A-new").unwrap() + 1;
    assert!(
        position <= 4,
        "A's new request went {position}th of {}: {order:?}",
        order.len()
    );
}

// ---------------------------------------------------------------------------------------------
// Prediction reset
// ---------------------------------------------------------------------------------------------

/// The same backends posted again in another order are no capacity arriving: the prediction
/// must not be forgotten (otherwise every admin call, or a list from a source that does not
/// sort, disables admission by deadline until the rate is measured again).
#[tokio::test(start_paused = true)]
async fn the_same_set_in_another_order_does_not_reset_the_prediction() {
    let balancer = balancer(|_| {});
    let mut lease = one_busy_backend(&balancer).await;
    let mut waiters: Vec<(&'static str, Waiter)> = Vec::new();
    for _ in 0..10 {
        waiters.push(("n", queue(&balancer, Admission::default()).await));
    }
    for _ in 0..3 {
        let (_, next) = step(lease, &mut waiters).await;
        lease = next;
    }
    // Add b (capacity arriving: reset, correct), hold it busy, then measure again.
    balancer.set_backends(vec!["a:1".parse().unwrap(), "b:1".parse().unwrap()]);
    settle().await;
    let on_b = {
        let index = waiters
            .iter()
            .position(|(_, w)| w.is_finished())
            .expect("b took one");
        waiters.remove(index).1.await.unwrap().unwrap()
    };
    for _ in 0..3 {
        let (_, next) = step(lease, &mut waiters).await;
        lease = next;
    }
    // The queue has stopped moving for 2 s: a request with 5 s to wait is refused.
    advance(Duration::from_secs(2)).await;
    let within = Admission {
        deadline: Some(Duration::from_millis(5_000)),
        ..Admission::default()
    };
    assert!(matches!(
        answer_now(&balancer, within).await,
        Err(Rejection::Overloaded(_))
    ));
    // The same two backends, reordered: nothing arrived.
    balancer.set_backends(vec!["b:1".parse().unwrap(), "a:1".parse().unwrap()]);
    settle().await;
    let answer = tokio::time::timeout(
        Duration::ZERO,
        balancer.admit_as(RequestInfo::default(), within),
    )
    .await;
    assert!(
        matches!(answer, Ok(Err(Rejection::Overloaded(_)))),
        "a reordered but identical set reset the prediction: queued instead of refused ({answer:?})"
    );
    drop((lease, on_b));
}

// ---------------------------------------------------------------------------------------------
// Checks expected to hold
// ---------------------------------------------------------------------------------------------

struct Headers(Vec<(&'static str, &'static str)>);

impl HeaderLookup for Headers {
    fn visit<'s>(&'s self, name: &str, each: &mut dyn FnMut(&'s [u8]) -> ControlFlow<()>) {
        for (field, value) in &self.0 {
            if *field == name && each(value.as_bytes()).is_break() {
                return;
            }
        }
    }
}

fn admission_of(balancer: &Balancer, headers: Vec<(&'static str, &'static str)>) -> Admission {
    let headers = Headers(headers);
    let uri = http::Uri::from_static("/v1/chat/completions");
    let view = RequestView::new(&http::Method::POST, &uri, &headers, b"");
    balancer.admission(&view)
}

#[tokio::test(start_paused = true)]
async fn odd_deadline_priority_and_tenant_header_values_are_read_as_documented() {
    let balancer = balancer(|c| c.queue.tenant_header = "x-tenant-id".to_owned());
    let deadline =
        |v: &'static str| admission_of(&balancer, vec![("x-request-deadline-ms", v)]).deadline;
    assert_eq!(deadline("0"), Some(Duration::ZERO));
    assert_eq!(deadline(" 7 "), Some(Duration::from_millis(7)));
    assert_eq!(deadline("-1"), None);
    assert_eq!(deadline("1.5"), None);
    assert_eq!(deadline("1e3"), None);
    assert_eq!(deadline("99999999999999999999"), None);
    assert_eq!(
        deadline("18446744073709551615"),
        Some(Duration::from_millis(u64::MAX))
    );
    let band = |v: &'static str| admission_of(&balancer, vec![("x-priority", v)]).band;
    assert_eq!(band("urgent"), Band::Normal);
    assert_eq!(band(""), Band::Normal);
    assert_eq!(band("LoW"), Band::Low);
    let none = admission_of(&balancer, vec![]).tenant;
    let empty = admission_of(&balancer, vec![("x-tenant-id", "")]).tenant;
    assert_eq!(none, 0);
    // Present but empty: a tenant of its own (not the no-tenant key 0).
    assert_ne!(empty, 0);
}

/// A deadline of 0: queued (and answered queue_timeout at once) while the rate is unknown,
/// refused at once with Retry-After ≥ 1 once it is known; metrics by band.
#[tokio::test(start_paused = true)]
async fn a_deadline_of_zero_is_answered_at_once_and_counted() {
    let balancer = balancer(|_| {});
    let mut lease = one_busy_backend(&balancer).await;
    let zero = Admission {
        band: Band::Low,
        deadline: Some(Duration::ZERO),
        ..Admission::default()
    };
    let mut waiters: Vec<(&'static str, Waiter)> = Vec::new();
    for _ in 0..5 {
        waiters.push(("n", queue(&balancer, Admission::default()).await));
    }
    let unknown = queue(&balancer, zero).await;
    assert_eq!(unknown.await.unwrap().unwrap_err(), Rejection::Timeout);
    assert_eq!(
        counter(
            &balancer,
            "custom_router_requests_timeout_total",
            "band=\"low\""
        ),
        1.0
    );
    for _ in 0..3 {
        let (_, next) = step(lease, &mut waiters).await;
        lease = next;
    }
    let refused = answer_now(&balancer, zero).await.unwrap_err();
    assert!(
        matches!(refused, Rejection::Overloaded(s) if s >= 1),
        "{refused:?}"
    );
    assert_eq!(
        counter(
            &balancer,
            "custom_router_requests_shed_total",
            "band=\"low\",reason=\"deadline\""
        ) + counter(
            &balancer,
            "custom_router_requests_shed_total",
            "reason=\"deadline\",band=\"low\""
        ),
        1.0
    );
    assert_eq!(balancer.queue_depth(), 2);
    drop(lease);
}

/// A client gone at the instant its lease was handed over: the lease is released, the next
/// waiter goes, the cancel is counted once with its band, nothing is lost or double-sent.
#[tokio::test(start_paused = true)]
async fn a_request_cancelled_as_it_is_dispatched_is_released_and_counted_once() {
    let balancer = balancer(|_| {});
    let lease = one_busy_backend(&balancer).await;
    let backend = Arc::clone(lease.backend());
    let first = queue(&balancer, adm(Band::High, 0)).await;
    let second = queue(&balancer, adm(Band::Normal, 0)).await;
    advance(Duration::from_millis(100)).await;
    // The finish hands the lease to `first` under the lock; its task has not run yet.
    lease.finish(OK);
    first.abort();
    settle().await;
    assert!(first.await.unwrap_err().is_cancelled());
    let lease = second.await.unwrap().expect("the next waiter went");
    assert_eq!(backend.in_flight(), 1);
    assert_eq!(balancer.queue_depth(), 0);
    assert_eq!(
        counter(
            &balancer,
            "custom_router_requests_cancelled_total",
            "band=\"high\""
        ),
        1.0
    );
    assert_eq!(
        counter(&balancer, "custom_router_requests_cancelled_total", ""),
        1.0
    );
    drop(lease);
    assert_eq!(backend.in_flight(), 0);
}

/// All backends removed while requests wait: nothing is refused (rate unknown), they time out
/// at their deadline with the band counted, the depth goes back to 0; backends that come back
/// take the survivors.
#[tokio::test(start_paused = true)]
async fn every_backend_removed_while_requests_wait_refuses_nothing_and_times_them_out() {
    let balancer = balancer(|_| {});
    let mut lease = one_busy_backend(&balancer).await;
    let mut waiters: Vec<(&'static str, Waiter)> = Vec::new();
    for _ in 0..8 {
        waiters.push(("n", queue(&balancer, Admission::default()).await));
    }
    for _ in 0..3 {
        let (_, next) = step(lease, &mut waiters).await;
        lease = next;
    }
    balancer.set_backends(vec![]);
    drop(lease);
    settle().await;
    assert_eq!(balancer.queue_depth(), 5);
    let short = Admission {
        band: Band::High,
        deadline: Some(Duration::from_secs(1)),
        ..Admission::default()
    };
    let timed = queue(&balancer, short).await;
    advance(Duration::from_secs(1)).await;
    settle().await;
    assert_eq!(timed.await.unwrap().unwrap_err(), Rejection::Timeout);
    assert_eq!(
        counter(
            &balancer,
            "custom_router_requests_timeout_total",
            "band=\"high\""
        ),
        1.0
    );
    assert_eq!(balancer.queue_depth(), 5);
    balancer.set_backends(vec!["z:1".parse().unwrap()]);
    settle().await;
    assert_eq!(balancer.queue_depth(), 4, "the new backend probes with one");
}

// ---------------------------------------------------------------------------------------------
// Cost of a request in the fair shares
// ---------------------------------------------------------------------------------------------

fn info_of(balancer: &Balancer, body: &'static [u8]) -> RequestInfo {
    let headers = Headers(vec![("content-type", "application/json")]);
    let uri = http::Uri::from_static("/v1/chat/completions");
    let view = RequestView::new(&http::Method::POST, &uri, &headers, body);
    balancer.request_info(&view)
}

/// reliability.md: a request's cost is "the prompt tokens and the output tokens it asks for
/// (`max_tokens`; 256 when it does not say, or for a request that is not an LLM request)". A
/// tenant that asks for 10 000 output tokens twice then must not go before one asking for 10,
/// whatever the strategy. With `score = "ewma"` (and any strategy that does not read prompts)
/// the prompt is never parsed and every request weighs 256.
#[tokio::test(start_paused = true)]
async fn fair_shares_weigh_llm_requests_by_cost_under_every_strategy() {
    let balancer = balancer(|config| config.queue.tenant_header = "x-tenant-id".to_owned());
    let big: &'static [u8] =
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":10000}"#;
    let small: &'static [u8] =
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":10}"#;
    let mut lease = one_busy_backend(&balancer).await;
    let mut waiters: Vec<(&'static str, Waiter)> = Vec::new();
    for _ in 0..2 {
        let info = info_of(&balancer, big);
        waiters.push((
            "A-10000",
            queue_info(&balancer, info, adm(Band::Normal, 1)).await,
        ));
    }
    let info = info_of(&balancer, small);
    let parsed = info.prompt.is_some();
    waiters.push((
        "B-10",
        queue_info(&balancer, info, adm(Band::Normal, 2)).await,
    ));
    let (first, next) = step(lease, &mut waiters).await;
    lease = next;
    assert_eq!(
        first, "B-10",
        "cost ignored (prompt parsed for the queue: {parsed}): A's 10 000-token request went first"
    );
    drop(lease);
}

/// Control for the test above: the default strategy (`score = "load"`) reads prompts, so there
/// the cost is the documented one.
#[test]
fn the_default_strategy_reads_the_prompt_for_the_cost() {
    let balancer = custom_router::config::Settings::from_config(Config::default())
        .unwrap()
        .balancer()
        .unwrap();
    let body: &'static [u8] =
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":10000}"#;
    let info = info_of(&balancer, body);
    assert_eq!(info.expected_output_tokens(), 10000);
}
