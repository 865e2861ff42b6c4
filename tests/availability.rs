//! Ejection, busy pauses, panic mode and slow start, driven through the balancer with paused
//! tokio time.

mod paused;

use std::sync::Arc;
use std::time::Duration;

use custom_router::backend::ErrorKind;
use custom_router::balancer::{Balancer, Finish};
use custom_router::config::{Config, Settings};
use http::StatusCode;
use paused::{admit_now, settle, with_backends};
use tokio::time::advance;

fn balancer(configure: impl FnOnce(&mut Config)) -> Arc<Balancer> {
    let mut config = Config::default();
    config.strategy.name = "round-robin".to_owned();
    configure(&mut config);
    Settings::from_config(config).unwrap().balancer().unwrap()
}

/// Where the next `n` admissions go, by address (each lease released at once).
async fn spread(balancer: &Arc<Balancer>, n: usize) -> Vec<String> {
    let mut addrs = Vec::new();
    for _ in 0..n {
        let lease = admit_now(balancer).await;
        addrs.push(lease.backend().addr().to_string());
    }
    addrs
}

/// Fails one request on `target` (admitting until it is picked).
async fn fail_on(balancer: &Arc<Balancer>, target: &str, finish: Finish) {
    loop {
        let lease = admit_now(balancer).await;
        if lease.backend().addr().as_str() == target {
            lease.finish(finish);
            settle().await;
            return;
        }
    }
}

const REFUSED: Finish = Finish {
    status: None,
    error: Some(ErrorKind::Connect),
    retry_after: None,
    bytes: 0,
    usage: None,
};

#[tokio::test(start_paused = true)]
async fn a_429_with_retry_after_pauses_the_backend_for_that_long() {
    let balancer = balancer(|_| {});
    let backends = with_backends(&balancer, &["busy:1", "free:1"]);
    fail_on(
        &balancer,
        "busy:1",
        Finish {
            status: Some(StatusCode::TOO_MANY_REQUESTS),
            error: None,
            retry_after: Some(Duration::from_secs(2)),
            bytes: 0,
            usage: None,
        },
    )
    .await;
    assert!(
        backends[0]
            .availability()
            .is_paused(tokio::time::Instant::now())
    );
    assert!(!backends[0].availability().is_ejected());
    advance(Duration::from_millis(1990)).await;
    settle().await;
    assert!(spread(&balancer, 10).await.iter().all(|a| a == "free:1"));
    advance(Duration::from_millis(20)).await;
    settle().await;
    assert!(spread(&balancer, 10).await.iter().any(|a| a == "busy:1"));
}

#[tokio::test(start_paused = true)]
async fn a_busy_pause_is_capped() {
    let balancer = balancer(|c| c.availability.max_busy_pause = Duration::from_secs(5));
    with_backends(&balancer, &["busy:1", "free:1"]);
    fail_on(
        &balancer,
        "busy:1",
        Finish {
            status: Some(StatusCode::SERVICE_UNAVAILABLE),
            error: None,
            retry_after: Some(Duration::from_secs(3600)),
            bytes: 0,
            usage: None,
        },
    )
    .await;
    advance(Duration::from_secs(5)).await;
    settle().await;
    assert!(spread(&balancer, 4).await.iter().any(|a| a == "busy:1"));
}

#[tokio::test(start_paused = true)]
async fn consecutive_failures_eject_for_a_growing_time_and_4xx_never_count() {
    let balancer = balancer(|c| {
        c.availability.consecutive_failures = 3;
        c.availability.ejection_time = Duration::from_secs(10);
        c.availability.max_ejection_time = Duration::from_secs(25);
    });
    let backends = with_backends(&balancer, &["bad:1", "good:1"]);
    let not_found = Finish {
        status: Some(StatusCode::NOT_FOUND),
        error: None,
        retry_after: None,
        bytes: 0,
        usage: None,
    };
    for _ in 0..2 {
        fail_on(&balancer, "bad:1", REFUSED).await;
    }
    // A client error ends the run of failures.
    fail_on(&balancer, "bad:1", not_found).await;
    for _ in 0..2 {
        fail_on(&balancer, "bad:1", REFUSED).await;
    }
    assert!(!backends[0].availability().is_ejected());
    fail_on(&balancer, "bad:1", REFUSED).await;
    assert!(backends[0].availability().is_ejected());
    assert_eq!(balancer.eligible().len(), 1);

    // First ejection: 10 s.
    advance(Duration::from_millis(9_990)).await;
    settle().await;
    assert!(backends[0].availability().is_ejected());
    advance(Duration::from_millis(20)).await;
    settle().await;
    assert!(!backends[0].availability().is_ejected());
    // Second ejection in the series: 20 s; third: capped at 25 s.
    for expected in [20_000, 25_000] {
        for _ in 0..3 {
            fail_on(&balancer, "bad:1", REFUSED).await;
        }
        assert!(backends[0].availability().is_ejected());
        advance(Duration::from_millis(expected - 10)).await;
        settle().await;
        assert!(backends[0].availability().is_ejected(), "{expected}");
        advance(Duration::from_millis(20)).await;
        settle().await;
        assert!(!backends[0].availability().is_ejected(), "{expected}");
    }
    assert_eq!(backends[0].ejections_total(), 3);
}

#[tokio::test(start_paused = true)]
async fn never_more_than_the_allowed_share_is_ejected_and_one_backend_never() {
    let balancer = balancer(|c| c.availability.consecutive_failures = 1);
    let backends = with_backends(&balancer, &["a:1", "b:1"]);
    fail_on(&balancer, "a:1", REFUSED).await;
    fail_on(&balancer, "b:1", REFUSED).await;
    let ejected = backends
        .iter()
        .filter(|b| b.availability().is_ejected())
        .count();
    assert_eq!(ejected, 1, "50 % of 2");

    let balancer = self::balancer(|c| c.availability.consecutive_failures = 1);
    let backends = with_backends(&balancer, &["only:1"]);
    fail_on(&balancer, "only:1", REFUSED).await;
    assert!(!backends[0].availability().is_ejected());
}

#[tokio::test(start_paused = true)]
async fn when_every_backend_is_ejected_all_are_used_panic_mode() {
    let balancer = balancer(|c| {
        c.availability.consecutive_failures = 1;
        c.availability.max_ejection_percent = 100.0;
    });
    let backends = with_backends(&balancer, &["a:1", "b:1"]);
    fail_on(&balancer, "a:1", REFUSED).await;
    assert!(!balancer.in_panic_mode());
    fail_on(&balancer, "b:1", REFUSED).await;
    assert!(backends.iter().all(|b| b.availability().is_ejected()));
    assert!(balancer.in_panic_mode());
    let picks = spread(&balancer, 4).await;
    assert!(picks.contains(&"a:1".to_owned()) && picks.contains(&"b:1".to_owned()));
}

#[tokio::test(start_paused = true)]
async fn a_new_backend_ramps_up_over_the_slow_start_window() {
    let balancer = balancer(|c| c.availability.slow_start = Some(Duration::from_secs(10)));
    with_backends(&balancer, &["old:1"]);
    advance(Duration::from_secs(60)).await;
    with_backends(&balancer, &["old:1", "new:1"]);
    let share = |picks: Vec<String>| {
        picks.iter().filter(|a| *a == "new:1").count() as f64 / picks.len() as f64
    };
    advance(Duration::from_secs(1)).await;
    let early = share(spread(&balancer, 2000).await);
    advance(Duration::from_secs(4)).await;
    let middle = share(spread(&balancer, 2000).await);
    advance(Duration::from_secs(6)).await;
    let done = share(spread(&balancer, 2000).await);
    // Round-robin offers it about half the picks; the ramp lets through 10 %, 50 %, then all
    // of them (a declined pick moves round-robin's counter too, so the middle share is higher
    // than half of 50 %).
    assert!(early < 0.15, "{early}");
    assert!((0.18..0.42).contains(&middle), "{middle}");
    assert!(early < middle && middle < done, "{early} {middle} {done}");
    assert!((0.45..0.55).contains(&done), "{done}");
}
