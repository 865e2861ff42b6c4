//! Engine load signals (`[engine_metrics]`): the router scrapes fake backends over loopback and
//! strategies read the values on each backend; failing and slow backends go stale, removed ones
//! are no longer scraped, TGI's capacity comes from `/info`; configuration mistakes exit 2.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use common::{
    FakeBackend, TestRouter, eventually, get, respond, round_robin, router_command, spawn_backend,
    start_router,
};
use custom_router::backend::Backend;
use custom_router::engine_metrics::EngineKind;
use http::StatusCode;
use serde_json::Value;
use tokio::time::Instant;

/// How long any condition below may take to come true (many intervals of 100 ms).
const DEADLINE: Duration = Duration::from_secs(10);

fn vllm_text(running: u32, waiting: u32) -> String {
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} 0.25\n"
    )
}

/// What a fake engine serves, and how often `/metrics` and `/info` were asked.
#[derive(Default)]
struct Engine {
    running: AtomicU32,
    /// `/metrics` hangs while set.
    hang: AtomicBool,
    /// `/metrics` answers 500 while set.
    fail: AtomicBool,
    scrapes: AtomicUsize,
    infos: AtomicUsize,
}

/// A fake vLLM (or, with `tgi`, TGI) backend reporting `engine.running` requests.
async fn engine_backend(engine: Arc<Engine>, tgi: bool) -> FakeBackend {
    spawn_backend(move |request| {
        let engine = Arc::clone(&engine);
        async move {
            match request.uri().path() {
                "/metrics" => {
                    engine.scrapes.fetch_add(1, Ordering::SeqCst);
                    if engine.hang.load(Ordering::SeqCst) {
                        std::future::pending::<()>().await;
                    }
                    if engine.fail.load(Ordering::SeqCst) {
                        return respond(StatusCode::INTERNAL_SERVER_ERROR, "engine down");
                    }
                    let running = engine.running.load(Ordering::SeqCst);
                    let text = if tgi {
                        format!(
                            "# TYPE tgi_queue_size gauge\ntgi_queue_size 2\n\
                             # TYPE tgi_batch_current_size gauge\ntgi_batch_current_size {running}\n"
                        )
                    } else {
                        vllm_text(running, 1)
                    };
                    respond(StatusCode::OK, text)
                }
                "/info" => {
                    engine.infos.fetch_add(1, Ordering::SeqCst);
                    respond(
                        StatusCode::OK,
                        r#"{"model_id":"m","max_concurrent_requests":48,"max_input_tokens":4096}"#,
                    )
                }
                _ => respond(StatusCode::NOT_FOUND, "no"),
            }
        }
    })
    .await
}

/// A router scraping `kind` every 100 ms, values stale after 300 ms.
async fn scraping_router(kind: EngineKind) -> TestRouter {
    let mut config = round_robin();
    config.engine_metrics.kind = kind;
    config.engine_metrics.interval = Duration::from_millis(100);
    config.engine_metrics.stale_after = Some(Duration::from_millis(300));
    start_router(config).await
}

fn set(router: &TestRouter, backends: &[&FakeBackend]) -> Vec<Arc<Backend>> {
    let addrs = backends
        .iter()
        .map(|b| b.host_port().parse().unwrap())
        .collect();
    router.balancer.set_backends(addrs).to_vec()
}

fn running(backend: &Backend) -> Option<u32> {
    backend
        .engine()
        .snapshot(Instant::now())
        .map(|snapshot| snapshot.running)
}

/// The router's `custom_router_engine_scrapes_total` for `outcome`.
async fn scrapes_counted(router: &TestRouter, outcome: &str) -> u64 {
    let (_, text) = get(&router.url("/_custom_router/metrics")).await;
    let prefix = format!("custom_router_engine_scrapes_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_backends_engine_values_are_read_and_follow_it() {
    let engine = Arc::new(Engine::default());
    engine.running.store(3, Ordering::SeqCst);
    let fake = engine_backend(Arc::clone(&engine), false).await;
    let router = scraping_router(EngineKind::Vllm).await;
    let backend = set(&router, &[&fake]).remove(0);
    assert!(
        eventually(DEADLINE, async || running(&backend) == Some(3)).await,
        "the first scrape was not read"
    );
    let snapshot = backend.engine().snapshot(Instant::now()).unwrap();
    assert_eq!((snapshot.waiting, snapshot.kv_usage), (1, Some(0.25)));
    assert_eq!(snapshot.max_concurrent, None);
    assert!(snapshot.age <= Duration::from_millis(300), "{snapshot:?}");
    engine.running.store(7, Ordering::SeqCst);
    assert!(
        eventually(DEADLINE, async || running(&backend) == Some(7)).await,
        "a later value was not read"
    );
    assert!(scrapes_counted(&router, "ok").await >= 2);
}

#[tokio::test]
async fn failing_and_slow_backends_go_stale_while_another_stays_fresh() {
    let steady = Arc::new(Engine::default());
    let slow = Arc::new(Engine::default());
    let failing = Arc::new(Engine::default());
    for engine in [&steady, &slow, &failing] {
        engine.running.store(2, Ordering::SeqCst);
    }
    let steady_fake = engine_backend(Arc::clone(&steady), false).await;
    let slow_fake = engine_backend(Arc::clone(&slow), false).await;
    let failing_fake = engine_backend(Arc::clone(&failing), false).await;
    let router = scraping_router(EngineKind::Auto).await;
    let backends = set(&router, &[&steady_fake, &slow_fake, &failing_fake]);
    assert!(
        eventually(DEADLINE, async || backends
            .iter()
            .all(|b| running(b) == Some(2)))
        .await,
        "not every backend was read"
    );
    slow.hang.store(true, Ordering::SeqCst);
    failing.fail.store(true, Ordering::SeqCst);
    assert!(
        eventually(DEADLINE, async || running(&backends[1]).is_none()
            && running(&backends[2]).is_none())
        .await,
        "the hanging and failing backends kept their values"
    );
    // The steady backend kept being scraped meanwhile: its values are fresh.
    let fresh = backends[0].engine().snapshot(Instant::now()).unwrap();
    assert!(fresh.age <= Duration::from_millis(300), "{fresh:?}");
    // And it goes on being scraped every interval while the slow one hangs.
    let before = steady.scrapes.load(Ordering::SeqCst);
    assert!(
        eventually(DEADLINE, async || steady.scrapes.load(Ordering::SeqCst)
            >= before + 5)
        .await,
        "a hanging backend held up the others' scrapes"
    );
    assert!(running(&backends[0]) == Some(2));
    assert!(scrapes_counted(&router, "timeout").await >= 1);
    assert!(scrapes_counted(&router, "failed").await >= 1);
    // A backend that recovers is read again.
    failing.fail.store(false, Ordering::SeqCst);
    assert!(eventually(DEADLINE, async || running(&backends[2]) == Some(2)).await);
}

#[tokio::test]
async fn removed_backends_are_no_longer_scraped_and_new_ones_are() {
    let kept = Arc::new(Engine::default());
    let removed = Arc::new(Engine::default());
    let added = Arc::new(Engine::default());
    let kept_fake = engine_backend(Arc::clone(&kept), false).await;
    let removed_fake = engine_backend(Arc::clone(&removed), false).await;
    let added_fake = engine_backend(Arc::clone(&added), false).await;
    let router = scraping_router(EngineKind::Vllm).await;
    set(&router, &[&kept_fake, &removed_fake]);
    assert!(
        eventually(DEADLINE, async || kept.scrapes.load(Ordering::SeqCst) >= 2
            && removed.scrapes.load(Ordering::SeqCst) >= 2)
        .await
    );
    let now = set(&router, &[&kept_fake, &added_fake]);
    let removed_at = removed.scrapes.load(Ordering::SeqCst);
    let kept_at = kept.scrapes.load(Ordering::SeqCst);
    assert!(
        eventually(DEADLINE, async || kept.scrapes.load(Ordering::SeqCst)
            >= kept_at + 5
            && running(&now[1]).is_some())
        .await,
        "the new backend was not scraped"
    );
    // At most a scrape already sent when the set changed.
    let after = removed.scrapes.load(Ordering::SeqCst);
    assert!(
        after <= removed_at + 1,
        "a removed backend was scraped {} more times",
        after - removed_at
    );
}

#[tokio::test]
async fn tgi_capacity_is_read_from_info_once_per_backend() {
    let engine = Arc::new(Engine::default());
    engine.running.store(5, Ordering::SeqCst);
    let fake = engine_backend(Arc::clone(&engine), true).await;
    let router = scraping_router(EngineKind::Auto).await;
    let backend = set(&router, &[&fake]).remove(0);
    let capacity = |backend: &Backend| {
        backend
            .engine()
            .snapshot(Instant::now())
            .and_then(|s| s.max_concurrent)
    };
    assert!(eventually(DEADLINE, async || capacity(&backend) == Some(48)).await);
    let snapshot = backend.engine().snapshot(Instant::now()).unwrap();
    assert_eq!((snapshot.running, snapshot.waiting), (5, 2));
    assert_eq!(snapshot.kv_usage, None);
    let scraped = engine.scrapes.load(Ordering::SeqCst);
    assert!(
        eventually(DEADLINE, async || engine.scrapes.load(Ordering::SeqCst)
            >= scraped + 3)
        .await
    );
    assert_eq!(engine.infos.load(Ordering::SeqCst), 1, "/info asked again");
    // Removed and added again, it is a new backend: /info is asked once more.
    set(&router, &[]);
    let again = set(&router, &[&fake]).remove(0);
    assert!(!Arc::ptr_eq(&backend, &again));
    assert!(eventually(DEADLINE, async || capacity(&again) == Some(48)).await);
    assert_eq!(engine.infos.load(Ordering::SeqCst), 2);
}

/// Runs `--check-config` with `env` and an optional config file text.
fn check_config(env: &[(&str, &str)], file: Option<&str>) -> (i32, String, String) {
    let mut command = router_command(env);
    command.arg("--check-config");
    if let Some(text) = file {
        let path = common::scratch_dir("engine").join(format!("{:x}.toml", fxhash(text)));
        std::fs::write(&path, text).unwrap();
        command.arg("--config").arg(path);
    }
    let output = command.output().unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn fxhash(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

#[test]
fn the_section_defaults_to_off_and_the_environment_turns_it_on() {
    let (code, out, err) = check_config(&[], None);
    assert_eq!(code, 0, "{err}");
    let config: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        config["engine_metrics"],
        serde_json::json!({
            "kind": "off", "interval": 0.5, "path": "/metrics", "timeout": null, "stale_after": null
        })
    );
    let (code, out, err) = check_config(
        &[
            ("CUSTOM_ROUTER_ENGINE_METRICS", "auto"),
            ("CUSTOM_ROUTER_ENGINE_METRICS_INTERVAL", "0.2"),
        ],
        Some("[engine_metrics]\nkind = \"vllm\"\ntimeout = 0.15\nstale_after = 2\n"),
    );
    assert_eq!(code, 0, "{err}");
    let config: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(config["engine_metrics"]["kind"], "auto");
    assert_eq!(config["engine_metrics"]["interval"], 0.2);
    assert_eq!(config["engine_metrics"]["timeout"], 0.15);
    assert_eq!(config["engine_metrics"]["stale_after"], 2.0);
}

/// Environment, config file text, and the fragments the one error line must contain.
type ErrorCase<'a> = (Vec<(&'a str, &'a str)>, Option<&'a str>, Vec<&'a str>);

#[test]
fn engine_metrics_errors_exit_2_naming_the_key() {
    let cases: [ErrorCase; 6] = [
        (
            vec![("CUSTOM_ROUTER_ENGINE_METRICS", "prometheus")],
            None,
            vec!["CUSTOM_ROUTER_ENGINE_METRICS:", "prometheus", "vllm"],
        ),
        (
            vec![("CUSTOM_ROUTER_ENGINE_METRICS_INTERVAL", "0.05")],
            None,
            vec!["CUSTOM_ROUTER_ENGINE_METRICS_INTERVAL", "0.1 to 10 seconds"],
        ),
        (
            vec![],
            Some("[engine_metrics]\nkind = \"nvidia\"\n"),
            vec!["key `engine_metrics.kind`", "nvidia"],
        ),
        (
            vec![],
            Some("[engine_metrics]\ninterval = 20\n"),
            vec![
                "key `engine_metrics.interval`",
                "0.1 to 10 seconds, found 20",
            ],
        ),
        (
            vec![],
            Some("[engine_metrics]\ninterval = 1\nstale_after = 0.5\n"),
            vec!["key `engine_metrics.stale_after`", "at least"],
        ),
        (
            vec![("CUSTOM_ROUTER_ENGINE_METRICS_PATH", "metrics")],
            None,
            vec!["CUSTOM_ROUTER_ENGINE_METRICS_PATH", "'/'"],
        ),
    ];
    for (env, file, expected) in cases {
        let (code, out, err) = check_config(&env, file);
        assert_eq!(code, 2, "{env:?} {file:?}: exit {code}, stderr {err}");
        assert!(out.is_empty(), "{env:?} {file:?} printed a config: {out}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "one line expected: {err}"
        );
        for part in expected {
            assert!(
                err.contains(part),
                "{env:?} {file:?}: {err:?} lacks {part:?}"
            );
        }
    }
}
