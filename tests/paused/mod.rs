//! Helpers for the tests that drive the balancer directly on paused tokio time (no sockets).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use custom_router::backend::Backend;
use custom_router::balancer::{Admission, Balancer, Finish, Lease, Rejection};
use custom_router::config::{Config, Settings};
use custom_router::strategies::RequestInfo;
use http::StatusCode;
use tokio::task::JoinHandle;

/// A 200 with an empty body.
pub const OK: Finish = Finish {
    status: Some(StatusCode::OK),
    error: None,
    retry_after: None,
    bytes: 0,
    usage: None,
};

/// Lets spawned admissions and releases run up to their next wait.
pub async fn settle() {
    for _ in 0..5 {
        tokio::task::yield_now().await;
    }
}

/// A queued-least-latency balancer with the reference rules (`score = "ewma"`), after
/// `configure`.
pub fn ewma_balancer(configure: impl FnOnce(&mut Config)) -> Arc<Balancer> {
    let mut config = Config::default();
    config.strategy.name = "queued-least-latency".to_owned();
    config
        .strategy
        .params
        .insert("score".into(), figment::value::Value::from("ewma"));
    configure(&mut config);
    Settings::from_config(config).unwrap().balancer().unwrap()
}

/// [`ewma_balancer`] with a 50 ms latency threshold: a backend measured at 100 ms takes one
/// request at a time.
pub fn slow_threshold_balancer(configure: impl FnOnce(&mut Config)) -> Arc<Balancer> {
    ewma_balancer(|config| {
        config.latency.threshold = std::time::Duration::from_millis(50);
        configure(config);
    })
}

/// Sets the backends at `addrs` and returns them.
pub fn with_backends(balancer: &Arc<Balancer>, addrs: &[&str]) -> Vec<Arc<Backend>> {
    let addrs = addrs.iter().map(|a| a.parse().unwrap()).collect();
    balancer.set_backends(addrs).to_vec()
}

/// Admits at once or panics: the fast path must not wait.
pub async fn admit_now(balancer: &Arc<Balancer>) -> Lease {
    tokio::time::timeout(Duration::ZERO, balancer.admit(RequestInfo::default()))
        .await
        .expect("admitted without waiting")
        .expect("a lease")
}

/// Admits requests for as long as they go straight out (at most `most`).
pub async fn admit_while_room(balancer: &Arc<Balancer>, most: usize) -> Vec<Lease> {
    let mut leases = Vec::new();
    while leases.len() < most {
        match tokio::time::timeout(Duration::ZERO, balancer.admit(RequestInfo::default())).await {
            Ok(Ok(lease)) => leases.push(lease),
            _ => break,
        }
    }
    leases
}

/// Admits as `admission` says; the answer must come without waiting (refused or not).
pub async fn answer_now(
    balancer: &Arc<Balancer>,
    admission: Admission,
) -> Result<Lease, Rejection> {
    tokio::time::timeout(
        Duration::ZERO,
        balancer.admit_as(RequestInfo::default(), admission),
    )
    .await
    .expect("answered without waiting")
}

/// Starts admitting `info` as `admission` says in the background and lets it reach the queue.
pub async fn queue_info(
    balancer: &Arc<Balancer>,
    info: RequestInfo,
    admission: Admission,
) -> JoinHandle<Result<Lease, Rejection>> {
    let balancer = Arc::clone(balancer);
    let task = tokio::spawn(async move { balancer.admit_as(info, admission).await });
    settle().await;
    task
}

/// [`queue_info`] for a request with no prompt.
pub async fn queue(
    balancer: &Arc<Balancer>,
    admission: Admission,
) -> JoinHandle<Result<Lease, Rejection>> {
    queue_info(balancer, RequestInfo::default(), admission).await
}

/// One backend measured at 100 ms (above a 50 ms threshold: one request at a time), with one
/// request in flight on it, returned.
pub async fn one_busy_backend(balancer: &Arc<Balancer>) -> Lease {
    balancer.set_backends(vec!["a:1".parse().unwrap()]);
    let first = balancer.admit(RequestInfo::default()).await.unwrap();
    tokio::time::advance(Duration::from_millis(100)).await;
    first.finish(OK);
    settle().await;
    balancer.admit(RequestInfo::default()).await.unwrap()
}

/// The sum of the counter `name` over the series whose line contains `attribute` (`""`: all of
/// them; 0 before any was counted).
pub fn counter(balancer: &Balancer, name: &str, attribute: &str) -> f64 {
    let text = balancer.metrics().render().unwrap();
    text.lines()
        .filter(|line| line.contains(attribute))
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once("} ")?.1,
                None => rest.strip_prefix(' ')?,
            };
            value.parse::<f64>().ok()
        })
        .sum()
}
