//! The binary: configuration layering and errors, graceful shutdown, memory under large bodies.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Writes `text` to a fresh file under the target temp dir.
fn config_file(name: &str, text: &str) -> PathBuf {
    let path = scratch_dir("test").join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `--check-config` and returns (exit code, stdout, stderr).
fn check_config(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let output = router_command(env)
        .arg("--check-config")
        .args(args)
        .output()
        .unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn defaults_then_file_then_environment() {
    let (code, out, _) = check_config(&[], &[]);
    assert_eq!(code, 0);
    let config: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(config["port"], 3000);
    assert_eq!(config["queue"]["max_size"], 1000);
    assert_eq!(config["latency"]["threshold"], 3.0);
    assert_eq!(config["queue"]["timeout"], 1200.0);
    assert_eq!(config["latency"]["ewma_alpha"], 0.3);
    assert_eq!(config["state_log_interval"], 30.0);
    assert_eq!(config["strategy"]["name"], "queued-least-latency");
    assert_eq!(config["max_connections"], "auto");
    assert_eq!(config["worker_threads"], 1);
    // A count or `auto`, from the environment as from the file.
    let (code, out, err) = check_config(
        &[],
        &[
            ("CUSTOM_ROUTER_WORKER_THREADS", "auto"),
            ("CUSTOM_ROUTER_MAX_CONNECTIONS", "300"),
        ],
    );
    assert_eq!(code, 0, "{err}");
    let config: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(config["worker_threads"], "auto");
    assert_eq!(config["max_connections"], 300);

    let file = config_file(
        "layers.toml",
        "port = 4000\n[queue]\nmax_size = 50\n[latency]\newma_alpha = 0.5\n\
         [strategy]\nname = \"round-robin\"\n",
    );
    let file = file.to_str().unwrap();
    let (code, out, err) = check_config(&["--config", file], &[]);
    assert_eq!(code, 0, "{err}");
    let config: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (
            config["port"].clone(),
            config["queue"]["max_size"].clone(),
            config["latency"]["ewma_alpha"].clone()
        ),
        (4000.into(), 50.into(), 0.5.into())
    );

    let (code, out, err) = check_config(
        &[],
        &[
            ("CUSTOM_ROUTER_CONFIG", file),
            ("CUSTOM_ROUTER_QUEUE_MAX_SIZE", "7"),
            ("CUSTOM_ROUTER_STATE_LOG_INTERVAL", "0.5"),
        ],
    );
    assert_eq!(code, 0, "{err}");
    let config: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(config["port"], 4000, "file value kept where env is silent");
    assert_eq!(config["queue"]["max_size"], 7, "env overrides file");
    assert_eq!(config["state_log_interval"], 0.5);
}

#[test]
fn sections_load_into_durations_and_environment_variables_set_their_nested_keys() {
    let file = config_file(
        "sections.toml",
        "[queue]\ntimeout = 2.5\nmax_size = 9\n\
         [latency]\nthreshold = 0.75\n\
         [upstream]\nfirst_byte_timeout = 4\nidle_timeout = 0\n\
         [availability]\nslow_start = 0.5\n\
         [shutdown]\npre_drain_delay = 1\n\
         [retry.budget]\npercent = 5\n\
         [admin]\nbackend_allow_cidrs = \"10.0.0.0/8, 127.0.0.1\"\n",
    );
    let settings = custom_router::config::load(Some(&file)).unwrap();
    let config = &settings.config;
    assert_eq!(config.queue.timeout, Duration::from_millis(2500));
    assert_eq!(config.queue.max_size, 9);
    assert_eq!(config.latency.threshold, Duration::from_millis(750));
    assert_eq!(
        config.upstream.first_byte_timeout,
        Some(Duration::from_secs(4))
    );
    assert_eq!(config.upstream.idle_timeout, None, "0 turns the limit off");
    assert_eq!(
        config.availability.slow_start,
        Some(Duration::from_millis(500))
    );
    assert_eq!(config.shutdown.pre_drain_delay, Duration::from_secs(1));
    assert_eq!(config.shutdown.timeout, Duration::from_secs(30), "default");
    assert_eq!(config.retry.budget.percent, 5.0);
    assert_eq!(
        config.admin.backend_allow_cidrs,
        [
            "10.0.0.0/8".parse().unwrap(),
            "127.0.0.1/32".parse().unwrap()
        ]
    );

    let file = file.to_str().unwrap();
    let (code, out, err) = check_config(
        &["--config", file],
        &[
            ("CUSTOM_ROUTER_QUEUE_TIMEOUT", "0.25"),
            ("CUSTOM_ROUTER_UPSTREAM_IDLE_TIMEOUT", "7"),
            ("CUSTOM_ROUTER_RETRY_BUDGET_MIN_PER_SECOND", "3"),
        ],
    );
    assert_eq!(code, 0, "{err}");
    let config: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(config["queue"]["timeout"], 0.25, "env overrides file");
    assert_eq!(
        config["queue"]["max_size"], 9,
        "the rest of the section kept"
    );
    assert_eq!(config["upstream"]["idle_timeout"], 7.0);
    assert_eq!(config["upstream"]["first_byte_timeout"], 4.0);
    assert_eq!(config["retry"]["budget"]["min_per_second"], 3.0);
    assert_eq!(config["retry"]["budget"]["percent"], 5.0);
    assert_eq!(
        config["admin"]["backend_allow_cidrs"],
        serde_json::json!(["10.0.0.0/8", "127.0.0.1/32"])
    );
}

/// Flags, environment, and the fragments the one error line must contain.
type ErrorCase<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, Vec<&'a str>);

#[test]
fn each_config_error_exits_2_with_one_line_naming_the_key() {
    let unknown_key = config_file("unknown.toml", "port = 1\nqueue_size = 5\n");
    let unknown_param = config_file(
        "param.toml",
        "[strategy]\nname = \"round-robin\"\n[strategy.params]\nweight = 2\n",
    );
    let bad_toml = config_file("bad.toml", "port = = 1\n");
    let moved = config_file("moved.toml", "port = 1\nqueue_timeout = 5\n");
    let negative = config_file("negative.toml", "[queue]\ntimeout = -1\n");
    let bad_cidr = config_file("cidr.toml", "[admin]\nbackend_allow_cidrs = [\"nope\"]\n");
    let bad_list = config_file("list.toml", "backends = [1]\n");
    let missing = scratch_dir("test").join("no-such-file.toml");
    let missing = missing.to_str().unwrap();
    let cases: Vec<ErrorCase> = vec![
        (
            vec![],
            vec![("CUSTOM_ROUTER_QUEUE_MAX_SIZE", "abc")],
            vec!["CUSTOM_ROUTER_QUEUE_MAX_SIZE", "abc"],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_QUEUE_MAX_SIZE", "-5")],
            vec!["CUSTOM_ROUTER_QUEUE_MAX_SIZE"],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_QUEUE_MAX_SIZE", "0")],
            vec!["CUSTOM_ROUTER_QUEUE_MAX_SIZE", "positive"],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_EWMA_ALPHA", "1.5")],
            vec!["CUSTOM_ROUTER_EWMA_ALPHA", "(0, 1]"],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_EWMA_ALPHA", "0")],
            vec!["CUSTOM_ROUTER_EWMA_ALPHA", "(0, 1]"],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_QUEUE_TIMEOUT", "-1")],
            vec!["CUSTOM_ROUTER_QUEUE_TIMEOUT", "positive"],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_PORT", "70000")],
            vec!["CUSTOM_ROUTER_PORT"],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_WORKER_THREADS", "1000000")],
            vec!["CUSTOM_ROUTER_WORKER_THREADS", "at most 1024"],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_MAX_CONNECTIONS", "-1")],
            vec![
                "CUSTOM_ROUTER_MAX_CONNECTIONS",
                "positive integer or \"auto\", found -1",
            ],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_LOG_FORMAT", "xml")],
            vec!["CUSTOM_ROUTER_LOG_FORMAT", "text"],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_STRATEGY", "fastest")],
            vec!["CUSTOM_ROUTER_STRATEGY", "fastest", "round-robin"],
        ),
        (
            vec!["--config", unknown_key.to_str().unwrap()],
            vec![],
            vec!["queue_size", "unknown.toml"],
        ),
        (
            vec!["--config", moved.to_str().unwrap()],
            vec![],
            vec![
                "key `queue_timeout` in",
                "moved.toml",
                "moved to `queue.timeout`",
            ],
        ),
        (
            vec!["--config", negative.to_str().unwrap()],
            vec![],
            vec![
                "key `queue.timeout` in",
                "negative.toml",
                "expected a positive number of seconds, found -1",
            ],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_WORKER_THREADS", "many")],
            vec![
                "CUSTOM_ROUTER_WORKER_THREADS",
                "expected a positive integer or \"auto\", found \"many\"",
            ],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_MAX_CONNECTIONS", "0")],
            vec![
                "CUSTOM_ROUTER_MAX_CONNECTIONS",
                "expected a positive integer or \"auto\", found 0",
            ],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_SLOW_START", "-2")],
            vec![
                "CUSTOM_ROUTER_SLOW_START",
                "expected zero or a positive number of seconds, found -2",
            ],
        ),
        (
            vec!["--config", bad_cidr.to_str().unwrap()],
            vec![],
            vec!["key `admin.backend_allow_cidrs` in", "cidr.toml", "nope"],
        ),
        (
            vec!["--config", bad_list.to_str().unwrap()],
            vec![],
            vec![
                "key `backends` in",
                "list.toml",
                "expected an array of strings or one comma-separated string",
            ],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_BACKEND_ALLOW_CIDRS", "10.0.0.0/33")],
            vec!["CUSTOM_ROUTER_BACKEND_ALLOW_CIDRS", "10.0.0.0/33"],
        ),
        (
            vec!["--config", unknown_param.to_str().unwrap()],
            vec![],
            vec!["strategy.params", "weight", "round-robin"],
        ),
        (
            vec!["--config", bad_toml.to_str().unwrap()],
            vec![],
            vec!["bad.toml"],
        ),
        (
            vec!["--config", missing],
            vec![],
            vec!["--config", "does not exist"],
        ),
        (
            vec![],
            vec![("CUSTOM_ROUTER_CONFIG", missing)],
            vec!["CUSTOM_ROUTER_CONFIG", "does not exist"],
        ),
    ];
    for (args, env, expected) in cases {
        let (code, out, err) = check_config(&args, &env);
        assert_eq!(code, 2, "{args:?} {env:?}: exit {code}, stderr {err}");
        assert!(out.is_empty(), "{args:?} {env:?} printed a config: {out}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "one line expected: {err}"
        );
        for part in expected {
            assert!(
                err.contains(part),
                "{args:?} {env:?}: {err:?} lacks {part:?}"
            );
        }
    }
}

#[test]
fn help_lists_flags_and_environment_variables() {
    let output = router_command(&[]).arg("--help").output().unwrap();
    assert_eq!(output.status.code(), Some(0));
    let text = String::from_utf8_lossy(&output.stdout);
    for expected in [
        "--config",
        "--check-config",
        "CUSTOM_ROUTER_PORT",
        "CUSTOM_ROUTER_QUEUE_MAX_SIZE",
        "CUSTOM_ROUTER_CONFIG",
        "RUST_LOG",
        "round-robin",
    ] {
        assert!(text.contains(expected), "--help lacks {expected}:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_in_flight_request_finish_then_exits_0() {
    let (started_sender, mut started) = tokio::sync::mpsc::channel::<()>(1);
    let backend = spawn_backend(move |_request| {
        let started = started_sender.clone();
        async move {
            let _ = started.send(()).await;
            tokio::time::sleep(Duration::from_millis(800)).await;
            respond(StatusCode::OK, "finished")
        }
    })
    .await;
    let mut router = spawn_router_process(&[("CUSTOM_ROUTER_STRATEGY", "round-robin")]);
    set_backends(router.addr, &[backend.host_port()]).await;
    let url = format!("http://{}/slow", router.addr);
    let in_flight = tokio::spawn(async move { get(&url).await });
    started.recv().await.unwrap();
    router.terminate();
    let (status, body) = in_flight.await.unwrap();
    assert_eq!((status, body.as_str()), (StatusCode::OK, "finished"));
    let code = tokio::task::spawn_blocking(move || router.wait_exit(Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(code, Some(0));
}

/// Stopping right after start: the signal handlers are installed before the listening line, so
/// a SIGTERM sent the moment the port is known is a drain (exit 0, logged), never the signal's
/// default action (death by signal, no exit code).
#[test]
fn sigterm_at_the_listening_line_is_a_drain_not_a_kill() {
    for _ in 0..5 {
        let mut router = spawn_router_process(&[]);
        router.terminate();
        let code = router.wait_exit(Duration::from_secs(10));
        // The log is read by a thread of its own: give it the last lines.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !router.logged("\"stopped\"") && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let log = router.log.lock().unwrap().join("\n");
        assert_eq!(code, Some(0), "exit status; log:\n{log}");
        assert!(log.contains("SIGTERM received"), "{log}");
    }
}

const SIXTEEN_MIB: usize = 16 * 1024 * 1024;

fn pattern_digest(len: usize) -> Vec<u8> {
    let mut hasher = Sha256::new();
    let mut chunk = Vec::with_capacity(64 * 1024);
    for offset in 0..len {
        chunk.push(pattern_byte(offset));
        if chunk.len() == chunk.capacity() {
            hasher.update(&chunk);
            chunk.clear();
        }
    }
    hasher.update(&chunk);
    hasher.finalize().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_mib_up_and_down_arrive_intact_without_buffering_in_the_router() {
    let backend = spawn_backend(|request: Request<hyper::body::Incoming>| async move {
        if request.method() == http::Method::POST {
            // Upload: hash as it streams in, answer with the digest.
            let mut body = request.into_body();
            let mut hasher = Sha256::new();
            let mut total = 0usize;
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.unwrap().into_data() {
                    total += data.len();
                    hasher.update(&data);
                }
            }
            let digest = hasher.finalize();
            respond(StatusCode::OK, format!("{total} {}", hex(&digest)))
        } else {
            http::Response::new(PatternBody::new(SIXTEEN_MIB).boxed())
        }
    })
    .await;
    let router = spawn_router_process(&[("CUSTOM_ROUTER_STRATEGY", "round-robin")]);
    set_backends(router.addr, &[backend.host_port()]).await;
    // Warm up so allocator arenas and pools exist before the baseline.
    assert_eq!(
        get(&format!("http://{}/warm", router.addr)).await.0,
        StatusCode::OK
    );
    let baseline = router.memory_kib("VmHWM");
    let expected = hex(&pattern_digest(SIXTEEN_MIB));

    let upload = Request::post(format!("http://{}/upload", router.addr))
        .body(PatternBody::new(SIXTEEN_MIB).boxed())
        .unwrap();
    let (status, _, answer) = send(upload).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        String::from_utf8_lossy(&answer),
        format!("{SIXTEEN_MIB} {expected}")
    );

    let response = client()
        .request(
            Request::get(format!("http://{}/download", router.addr))
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    let mut body = response.into_body();
    let mut hasher = Sha256::new();
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            total += data.len();
            hasher.update(&data);
        }
    }
    assert_eq!(total, SIXTEEN_MIB);
    assert_eq!(hex(&hasher.finalize()), expected);

    let growth_kib = router.memory_kib("VmHWM").saturating_sub(baseline);
    assert!(
        growth_kib < 8 * 1024,
        "router peak memory grew by {growth_kib} KiB moving 16 MiB each way"
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
