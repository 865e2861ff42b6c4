//! Configuration, reload and admin input held to the rules: a configuration error exits 2 with
//! one line naming the key; a bad admin request gets 400 with JSON naming the field and changes
//! nothing; environment text is taken as written; a reload keeps the keys read only at start
//! (and keeps naming them) and rebuilds the strategy when its settings change.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use custom_router::Router;
use custom_router::config::Settings;
use http::StatusCode;
use serde_json::Value;

const PATIENCE: Duration = Duration::from_secs(10);

fn scratch_file(name: &str, text: &str) -> PathBuf {
    let path = scratch_dir("config-input").join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `--check-config` with a clean environment plus `env`: (exit code, stdout, stderr).
fn check_config(env: &[(&str, &str)]) -> (i32, String, String) {
    let output = router_command(env).arg("--check-config").output().unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn assert_config_error(env: &[(&str, &str)], names: &str) {
    let (code, _, err) = check_config(env);
    assert_eq!(
        code, 2,
        "{env:?}: expected exit 2, got {code}; stderr: {err}"
    );
    assert_eq!(err.lines().count(), 1, "{env:?}: one line expected: {err}");
    assert!(
        err.contains(names),
        "{env:?}: the line should name {names}: {err}"
    );
}

async fn health(addr: std::net::SocketAddr) -> Value {
    get_json(&format!("http://{addr}/_custom_router/health"))
        .await
        .1
}

// ---------------------------------------------------------------------------------------------
// Findings
// ---------------------------------------------------------------------------------------------

/// `CUSTOM_ROUTER_ADMIN_TOKEN=007` must require `Authorization: Bearer 007`. The environment
/// value goes through figment's type guessing and `forms::text`, so the token becomes `7`:
/// the written token is refused (401) and the shorter `7` is accepted.
#[tokio::test]
async fn an_admin_token_from_the_environment_is_taken_as_written() {
    for (token, mangled) in [("007", "7"), ("1.50", "1.5"), ("\"quoted\"", "quoted")] {
        let router = spawn_router_process(&[("CUSTOM_ROUTER_ADMIN_TOKEN", token)]);
        let (as_written, _) =
            post_set_backends(router.addr, r#"{"backends":[]}"#, Some(token)).await;
        let (as_mangled, _) =
            post_set_backends(router.addr, r#"{"backends":[]}"#, Some(mangled)).await;
        assert_eq!(
            (as_written, as_mangled),
            (StatusCode::OK, StatusCode::UNAUTHORIZED),
            "token {token:?}: the token as written must be the one required (mangled form {mangled:?})"
        );
    }
    // A token that reads as a boolean is refused at start.
    let (code, _, err) = check_config(&[("CUSTOM_ROUTER_ADMIN_TOKEN", "true")]);
    assert_eq!(
        code, 0,
        "the token `true` is a valid non-empty token: {err}"
    );
}

/// A huge `max_connections` passes validation (`--check-config` exits 0) and then panics in
/// `tokio::sync::Semaphore::new` at start (exit 101, a multi-line panic message).
#[test]
fn a_huge_max_connections_is_a_configuration_error() {
    let value = "18446744073709551615";
    let (code, _, err) = check_config(&[("CUSTOM_ROUTER_MAX_CONNECTIONS", value)]);
    let mut child = router_command(&[
        ("CUSTOM_ROUTER_PORT", "0"),
        ("CUSTOM_ROUTER_HOST", "127.0.0.1"),
        ("CUSTOM_ROUTER_MAX_CONNECTIONS", value),
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if start.elapsed() > PATIENCE {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut run_err = String::new();
    use std::io::Read;
    let _ = child.stderr.take().unwrap().read_to_string(&mut run_err);
    assert_eq!(
        (code, status.and_then(|s| s.code())),
        (2, Some(2)),
        "--check-config said {code} ({err}); the run ended with {status:?}: {run_err}"
    );
}

/// docs/configuration.md: `host` is "empty, or an IPv4 or IPv6 address (brackets allowed)". In
/// the environment, figment reads `[::1]` as an array and the value is refused.
#[test]
fn a_bracketed_ipv6_host_in_the_environment_is_taken() {
    let (code, out, err) = check_config(&[("CUSTOM_ROUTER_HOST", "[::1]")]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("::1"), "{out}");
}

/// README "Reload": keys read only at start "are kept, with a warning naming them". The reloader
/// replaces its notion of the running configuration with the reloaded one, restart-only keys
/// included, so a second SIGHUP with the same file no longer warns (the key is still not
/// applied), and going back to the value that really runs warns that it changed.
#[tokio::test]
async fn every_reload_names_the_restart_only_keys_the_file_sets_otherwise() {
    let file = scratch_file("restart-keys.toml", "state_log_interval = 30\n");
    let router = spawn_router_process(&[("CUSTOM_ROUTER_CONFIG", file.to_str().unwrap())]);
    let reloads = || {
        router
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|line| line.contains("configuration reloaded"))
            .count()
    };
    let warnings = || {
        router
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|line| {
                line.contains("apply only at start") && line.contains("state_log_interval")
            })
            .count()
    };
    let hangup = |expected: usize| {
        let status = std::process::Command::new("kill")
            .args(["-HUP", &router.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let start = std::time::Instant::now();
        while reloads() < expected && start.elapsed() < PATIENCE {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(reloads(), expected);
        std::thread::sleep(Duration::from_millis(50));
    };
    std::fs::write(&file, "state_log_interval = 7\n").unwrap();
    hangup(1);
    assert_eq!(warnings(), 1, "first reload warns");
    hangup(2);
    assert_eq!(
        warnings(),
        2,
        "the second reload keeps state_log_interval at 30 too, and must say so"
    );
}

/// docs/configuration.md: the `[latency]` section is handed to the strategy when it is built,
/// and README "Reload": a reload applies "the strategy and its parameters". A reload that
/// changes only `latency.threshold` keeps the old strategy object (server.rs compares only the
/// `[strategy]` table), so queued-least-latency keeps judging busy backends by the old threshold.
#[tokio::test]
async fn a_reloaded_latency_threshold_reaches_the_strategy() {
    let went_to_b = threshold_scenario(3.0, Some(0.5)).await;
    assert!(
        went_to_b,
        "after reloading latency.threshold = 0.5 a busy backend with EWMA 1.0 is no candidate"
    );
}

/// The control for the test above: started with threshold 0.5, the second request goes to B.
#[tokio::test]
async fn a_latency_threshold_at_start_reaches_the_strategy() {
    assert!(threshold_scenario(0.5, None).await);
}

/// Backend A (EWMA 1.0 s, held busy by a hanging request) and B (EWMA 2.0 s, idle), the
/// reference rules (`score = "ewma"`). Returns whether the second request went to B.
async fn threshold_scenario(start_threshold: f64, reload_to: Option<f64>) -> bool {
    let (release, released) = tokio::sync::watch::channel(false);
    let a = spawn_backend(move |_request| {
        let mut released = released.clone();
        async move {
            let _ = released.wait_for(|done| *done).await;
            respond(StatusCode::OK, "a")
        }
    })
    .await;
    let b = named_backend("b").await;
    let config_with = |threshold: f64| {
        let mut config = qll();
        config
            .strategy
            .params
            .insert("score".into(), figment::value::Value::from("ewma"));
        config.latency.threshold = Duration::from_secs_f64(threshold);
        config
    };
    let settings = Settings::from_config(config_with(start_threshold)).unwrap();
    let router = Router::bind_to(settings, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let reloader = router.reloader();
    let addr = router.local_addr();
    let balancer = Arc::clone(router.balancer());
    let serving = tokio::spawn(router.serve(std::future::pending()));
    let backends = balancer.set_backends(vec![
        a.host_port().parse().unwrap(),
        b.host_port().parse().unwrap(),
    ]);
    backends[0].record_latency(1.0, 1.0);
    backends[1].record_latency(2.0, 1.0);
    for backend in backends.iter() {
        for _ in 0..10 {
            backend.record_completed(u64::MAX);
        }
    }
    if let Some(threshold) = reload_to {
        let settings = Settings::from_config(config_with(threshold)).unwrap();
        reloader.apply(settings);
    }
    // First request: both idle, A has the lower EWMA and hangs there.
    let url = format!("http://{addr}/first");
    let first = tokio::spawn(async move { get(&url).await });
    assert!(
        eventually(PATIENCE, async || a.hits() == 1).await,
        "first request on A"
    );
    // Second request: A is busy with EWMA 1.0.
    let url = format!("http://{addr}/second");
    let second = tokio::spawn(async move { get(&url).await });
    let went_to_b = eventually(Duration::from_secs(2), async || b.hits() == 1).await;
    let _ = release.send(true);
    let _ = first.await;
    let _ = second.await;
    serving.abort();
    went_to_b
}

/// A JSON object with `backends` twice is ambiguous (RFC 8259 §4: names SHOULD be unique; a
/// proxy or log in front may read the first one). serde_json's `Value` keeps the last one, and
/// the router answers 200 with a set nobody can tell from the body.
#[tokio::test]
async fn set_backends_with_a_duplicate_backends_field_is_refused() {
    let router = spawn_router_process(&[]);
    set_backends(router.addr, &["127.0.0.1:1".to_owned()]).await;
    let before = health(router.addr).await["backends"].clone();
    let (status, answer) = post_set_backends(
        router.addr,
        r#"{"backends":["127.0.0.1:2"],"backends":["127.0.0.1:3"]}"#,
        None,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert_eq!(health(router.addr).await["backends"], before);
}

// ---------------------------------------------------------------------------------------------
// Checked and found correct
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn refused_set_backends_change_nothing() {
    let router = spawn_router_process(&[]);
    set_backends(
        router.addr,
        &["127.0.0.1:1".to_owned(), "[::1]:2".to_owned()],
    )
    .await;
    let before = health(router.addr).await["backends"].clone();
    let too_many: Vec<String> = (0..1025).map(|i| format!("\"h{i}:1\"")).collect();
    let too_many = format!("{{\"backends\":[{}]}}", too_many.join(","));
    for body in [
        "",
        "{",
        "[]",
        "null",
        "{}",
        r#"{"backends":null}"#,
        r#"{"backends":"a:1"}"#,
        r#"{"backends":["127.0.0.1:5", 5]}"#,
        r#"{"backends":["127.0.0.1:5", "10.0.0.1"]}"#,
        r#"{"backends":["127.0.0.1:5", "::1:80"]}"#,
        r#"{"backends":["127.0.0.1:5", "10.0.0.1:0"]}"#,
        r#"{"backends":["127.0.0.1:5", "10.0.0.1:65536"]}"#,
        r#"{"backends":["127.0.0.1:5", "u@10.0.0.1:80"]}"#,
        r#"{"backends":["127.0.0.1:5", "10.0.0.1:80?x"]}"#,
        r#"{"backends":["127.0.0.1:5", "10.0.0.1:80/p"]}"#,
        r#"{"backends":["127.0.0.1:5", "dns://a:80"]}"#,
        r#"{"backends":["127.0.0.1:5", "ftp://a:80"]}"#,
        r#"{"backends":["127.0.0.1:5", ""]}"#,
        r#"{"backends":["127.0.0.1:5", "a b:80"]}"#,
        too_many.as_str(),
    ] {
        let (status, answer) = post_set_backends(router.addr, body, None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert!(answer["error"].is_string(), "{body}: {answer}");
        assert_eq!(health(router.addr).await["backends"], before, "{body}");
    }
}

#[test]
fn numeric_and_float_errors_exit_2_naming_the_variable() {
    for (var, value) in [
        ("CUSTOM_ROUTER_QUEUE_TIMEOUT", "NaN"),
        ("CUSTOM_ROUTER_QUEUE_TIMEOUT", "inf"),
        ("CUSTOM_ROUTER_QUEUE_TIMEOUT", "-1"),
        ("CUSTOM_ROUTER_QUEUE_SHED_RATIO", "inf"),
        ("CUSTOM_ROUTER_EWMA_ALPHA", "NaN"),
        ("CUSTOM_ROUTER_PORT", "65536"),
        ("CUSTOM_ROUTER_QUEUE_MAX_SIZE", "99999999999999999999"),
        ("CUSTOM_ROUTER_MAX_ATTEMPTS", "4294967296"),
        ("CUSTOM_ROUTER_ADMIN_TOKEN", ""),
        ("CUSTOM_ROUTER_STRATEGY", "fastest"),
        ("CUSTOM_ROUTER_BACKEND_ALLOW_CIDRS", "10.0.0.0/33"),
        // A table where a word or a number is expected names the variable, not the table's key.
        ("CUSTOM_ROUTER_LOG_FORMAT", "{a=1}"),
        ("CUSTOM_ROUTER_PORT", "{a=1}"),
        ("CUSTOM_ROUTER_WORKER_THREADS", "{a=1}"),
    ] {
        assert_config_error(&[(var, value)], var);
    }
}

/// A `dns://` entry is held to the rules of the same host in set-backends: an empty label, a
/// 64-byte label or a `+` before the port exit 2 rather than start a router with a name that
/// can never resolve.
#[test]
fn dns_backend_entries_are_held_to_the_host_rules() {
    let long_label = format!("dns://{}.example:80", "a".repeat(64));
    for entry in ["dns://a..b:80", "dns://a:+80", long_label.as_str()] {
        assert_config_error(
            &[("CUSTOM_ROUTER_BACKENDS", entry)],
            "CUSTOM_ROUTER_BACKENDS",
        );
    }
}
