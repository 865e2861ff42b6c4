//! Helpers for the tests that drive the balancer directly on paused tokio time (no sockets).
#![allow(dead_code)]

use std::sync::Arc;

use custom_router::balancer::{Balancer, Finish};
use custom_router::config::{Config, Settings};
use http::StatusCode;

/// A 200 with an empty body.
pub const OK: Finish = Finish {
    status: Some(StatusCode::OK),
    error: None,
    retry_after: None,
    bytes: 0,
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
