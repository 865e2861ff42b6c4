//! Running without the platform: backends from the configuration (fixed and `dns://`), the
//! access log, and configuration reload on SIGHUP — each through the router binary as a child
//! process, over loopback sockets.

mod common;

use std::time::Duration;

use common::*;
use custom_router::{Router, Settings};
use http::StatusCode;
use serde_json::Value;

const PATIENCE: Duration = Duration::from_secs(10);

async fn health_addrs(router: &ChildRouter) -> Vec<String> {
    let (_, health) = get_json(&format!("http://{}/_custom_router/health", router.addr)).await;
    health["backends"]
        .as_array()
        .map(|backends| {
            backends
                .iter()
                .filter_map(|b| b["addr"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn fixed_backends_from_the_environment_serve_from_the_start() {
    let backend = named_backend("static").await;
    let router = spawn_router_process(&[
        (
            "CUSTOM_ROUTER_BACKENDS",
            &format!(" {} ,", backend.host_port()),
        ),
        ("CUSTOM_ROUTER_STRATEGY", "round-robin"),
    ]);
    assert_eq!(health_addrs(&router).await, [backend.host_port()]);
    let (status, body) = get(&format!("http://{}/v1/models", router.addr)).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "static"));
    // set-backends still replaces the whole set.
    set_backends(router.addr, &[]).await;
    assert!(health_addrs(&router).await.is_empty());
}

#[test]
fn a_bad_backend_entry_exits_2_naming_it() {
    for (value, named) in [
        ("127.0.0.1:1,10.0.0.1", "backends[1]"),
        ("dns://replicas", "backends[0]"),
        ("ftp://a:1", "backends[0]"),
    ] {
        let output = router_command(&[("CUSTOM_ROUTER_BACKENDS", value)])
            .output()
            .expect("router binary runs");
        assert_eq!(output.status.code(), Some(2), "{value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains("CUSTOM_ROUTER_BACKENDS") && stderr.contains(named),
            "{value}: {stderr}"
        );
    }
}

#[tokio::test]
async fn a_dns_name_is_followed_until_set_backends_takes_over() {
    let backend = named_backend("resolved").await;
    let port = backend.addr.port();
    let router = spawn_router_process(&[
        ("CUSTOM_ROUTER_BACKENDS", &format!("dns://localhost:{port}")),
        ("CUSTOM_ROUTER_DNS_REFRESH", "0.1"),
        ("CUSTOM_ROUTER_STRATEGY", "round-robin"),
    ]);
    let expected = format!("127.0.0.1:{port}");
    assert!(
        eventually(PATIENCE, async || health_addrs(&router)
            .await
            .contains(&expected))
        .await,
        "localhost's address joins the set"
    );
    // Every address localhost has (::1 may refuse: connect failures are retried elsewhere).
    for _ in 0..4 {
        let (status, body) = get(&format!("http://{}/", router.addr)).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "resolved"));
    }
    set_backends(router.addr, &[]).await;
    assert!(eventually(PATIENCE, async || router.logged("DNS discovery stops")).await);
    assert!(
        health_addrs(&router).await.is_empty(),
        "discovery no longer sets backends"
    );
}

#[tokio::test]
async fn the_access_log_has_one_json_line_per_finished_request() {
    let backend = named_backend("logged").await;
    let router = logged_router(&backend.host_port(), &[]);
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let request = http::Request::post(format!("http://{}/v1/chat?x=1", router.addr))
        .header("traceparent", traceparent)
        .body(full("{\"prompt\":\"hi\"}"))
        .unwrap();
    let (status, _, body) = send(request).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"logged"[..]));
    // A request the router answers itself.
    set_backends(router.addr, &[]).await;
    let (status, _) = get(&format!("http://{}/none", router.addr)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let lines = access_log_lines(&router, 2).await;
    let proxied = &lines[0];
    assert_eq!(proxied["method"], "POST");
    assert_eq!(proxied["path"], "/v1/chat?x=1");
    assert_eq!(proxied["status"], 200);
    assert_eq!(proxied["backend"], backend.host_port());
    assert_eq!(proxied["attempts"], 1);
    assert_eq!(proxied["bytes_in"], 15);
    assert_eq!(proxied["bytes_out"], 6);
    assert_eq!(proxied["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert!(proxied["reason"].is_null());
    for field in ["queue_ms", "ttfb_ms", "duration_ms"] {
        assert!(
            proxied[field].as_f64().is_some_and(|ms| ms >= 0.0),
            "{field}: {proxied}"
        );
    }
    assert!(
        proxied["time"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z') && t.len() == 24)
    );
    let refused = &lines[1];
    assert_eq!(refused["status"], 503);
    assert_eq!(refused["reason"], "no_backend");
    assert_eq!(refused["attempts"], 0);
    assert!(refused["backend"].is_null());
}

#[tokio::test]
async fn the_access_log_shows_the_band_and_the_prompt_tokens_the_backend_had_cached() {
    let backend = named_backend("logged").await;
    let router = spawn_router_process(&[
        ("CUSTOM_ROUTER_BACKENDS", &backend.host_port()),
        ("CUSTOM_ROUTER_ACCESS_LOG", "true"),
    ]);
    // 1,000 bytes of prompt: 250 tokens, three full blocks of 64 tokens and 58 past them.
    let body = format!("{{\"prompt\":\"{}\",\"max_tokens\":8}}", "a".repeat(1000));
    let post = |priority: Option<&'static str>| {
        let mut request = http::Request::post(format!("http://{}/v1/completions", router.addr));
        if let Some(priority) = priority {
            request = request.header("x-priority", priority);
        }
        request.body(full(body.clone())).unwrap()
    };
    for request in [post(None), post(Some("high"))] {
        let (status, _, _) = send(request).await;
        assert_eq!(status, StatusCode::OK);
    }
    let (status, _) = get(&format!("http://{}/v1/models", router.addr)).await;
    assert_eq!(status, StatusCode::OK);
    let seen: Vec<_> = access_log_lines(&router, 3)
        .await
        .iter()
        .map(|line| {
            (
                line["band"].clone(),
                line["prompt_tokens"].clone(),
                line["uncached_tokens"].clone(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            // The backend had nothing of it: the whole prompt to prefill.
            ("normal".into(), 250.into(), 250.into()),
            // The same prompt again: its three full blocks are cached there.
            ("high".into(), 250.into(), 58.into()),
            // No body: no prompt.
            ("normal".into(), Value::Null, Value::Null),
        ]
    );
}

/// Engines cache an answer with the prompt that asked for it: a chat's next turn, which resends
/// the answer, finds it cached where the turn that wrote it ran, and the access log counts it so.
#[tokio::test]
async fn the_access_log_counts_a_chats_last_answer_cached_where_its_turn_ran() {
    let backend = named_backend("logged").await;
    let router = spawn_router_process(&[
        ("CUSTOM_ROUTER_BACKENDS", &backend.host_port()),
        ("CUSTOM_ROUTER_ACCESS_LOG", "true"),
    ]);
    // "user" 0x00 question 0x1E: 512 bytes, 128 tokens in two full blocks.
    let question = "q".repeat(506);
    let chat = |question: &str, answer: Option<&str>| {
        let mut messages = vec![serde_json::json!({"role": "user", "content": question})];
        if let Some(answer) = answer {
            // "assistant" 0x00 answer 0x1E: 512 bytes more; "user" 0x00 "next" 0x1E: 10.
            messages.push(serde_json::json!({"role": "assistant", "content": answer}));
            messages.push(serde_json::json!({"role": "user", "content": "next"}));
        }
        let body = serde_json::json!({"messages": messages, "max_tokens": 8}).to_string();
        http::Request::post(format!("http://{}/v1/chat/completions", router.addr))
            .body(full(body))
            .unwrap()
    };
    let answer = "a".repeat(501);
    let other = "o".repeat(506);
    for request in [
        chat(&question, None),
        chat(&question, Some(&answer)),
        chat(&other, Some(&answer)),
    ] {
        let (status, _, _) = send(request).await;
        assert_eq!(status, StatusCode::OK);
    }
    let seen: Vec<_> = access_log_lines(&router, 3)
        .await
        .iter()
        .map(|line| {
            (
                line["prompt_tokens"].clone(),
                line["uncached_tokens"].clone(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            // The first turn: nothing cached.
            (128.into(), 128.into()),
            // The second: 1,034 bytes, 259 tokens; the question and the answer (four blocks,
            // 256 tokens) cached where the first turn ran.
            (259.into(), 3.into()),
            // Another chat with the same answer text: its first question never ran there.
            (259.into(), 259.into()),
        ]
    );
}

fn hangup(router: &ChildRouter) {
    let status = std::process::Command::new("kill")
        .args(["-HUP", &router.child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
}

async fn strategy_of(router: &ChildRouter) -> String {
    let (_, health) = get_json(&format!("http://{}/_custom_router/health", router.addr)).await;
    health["strategy"].as_str().unwrap_or_default().to_owned()
}

async fn reloads(router: &ChildRouter, result: &str) -> u64 {
    let (_, text) = get(&format!("http://{}/_custom_router/metrics", router.addr)).await;
    let prefix = format!("custom_router_config_reloads_total{{result=\"{result}\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {prefix} in {text}"))
}

#[tokio::test]
async fn sighup_applies_a_changed_strategy_and_timeout_to_new_requests_and_keeps_requests_in_flight()
 {
    let slow = slow_backend(Duration::from_millis(600)).await;
    let dir = scratch_dir("reload");
    let file = dir.join("router.toml");
    let write = |text: &str| std::fs::write(&file, text).unwrap();
    write(&format!(
        "backends = [\"{}\"]\n[strategy]\nname = \"round-robin\"\n",
        slow.host_port()
    ));
    let router = spawn_router_process(&[("CUSTOM_ROUTER_CONFIG", file.to_str().unwrap())]);
    assert_eq!(strategy_of(&router).await, "round-robin");
    // A request in flight across the reload.
    let url = format!("http://{}/slow", router.addr);
    let in_flight = tokio::spawn(async move { get(&url).await });
    assert!(
        eventually(PATIENCE, async || slow.hits() == 1).await,
        "the request reached the backend"
    );
    write(&format!(
        "backends = [\"{}\"]\n[upstream]\nfirst_byte_timeout = 0.2\n[retry]\nmax_attempts = 1\n\
         [strategy]\nname = \"queued-least-latency\"\n[strategy.params]\nscore = \"ewma\"\n",
        slow.host_port()
    ));
    hangup(&router);
    assert!(
        eventually(PATIENCE, async || strategy_of(&router).await
            == "queued-least-latency")
        .await,
        "the new strategy is in use"
    );
    assert_eq!(reloads(&router, "ok").await, 1);
    let (status, _) = in_flight.await.unwrap();
    assert_eq!(
        status,
        StatusCode::OK,
        "the request in flight finished normally"
    );
    // The new first-byte timeout holds for a new request.
    let (status, body) = get(&format!("http://{}/slow", router.addr)).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{body}");
    assert!(eventually(PATIENCE, async || router.logged("configuration reloaded")).await);

    // An invalid file: the same error as at start-up is logged, the running config kept.
    write("[strategy]\nname = \"no-such-strategy\"\n");
    hangup(&router);
    assert!(
        eventually(PATIENCE, async || reloads(&router, "error").await == 1).await,
        "the failed reload is counted"
    );
    assert_eq!(strategy_of(&router).await, "queued-least-latency");
    let startup = router_command(&[("CUSTOM_ROUTER_CONFIG", file.to_str().unwrap())])
        .output()
        .unwrap();
    assert_eq!(startup.status.code(), Some(2));
    let startup_error = String::from_utf8_lossy(&startup.stderr)
        .trim()
        .trim_start_matches("custom-router: ")
        .to_owned();
    // The log is read from the router's stderr by another thread: the line may come a moment
    // after the counter.
    let failed_reload = || {
        router
            .log
            .lock()
            .unwrap()
            .iter()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .find(|entry| {
                entry["message"] == "configuration reload failed; keeping the running configuration"
            })
    };
    assert!(
        eventually(PATIENCE, async || failed_reload().is_some()).await,
        "a log line for the failed reload"
    );
    let logged = failed_reload().unwrap();
    assert_eq!(logged["error"], startup_error.as_str());
    let (status, _) = get(&format!("http://{}/slow", router.addr)).await;
    assert_eq!(
        status,
        StatusCode::GATEWAY_TIMEOUT,
        "the running config still applies"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_reload_applies_a_changed_upstream_section_and_names_start_only_keys() {
    let slow = slow_backend(Duration::from_millis(600)).await;
    let mut config = round_robin();
    config.retry.max_attempts = 1;
    config.latency.threshold = Duration::from_millis(50);
    let settings = Settings::from_config(config.clone()).unwrap();
    let router = Router::bind_to(settings, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = router.local_addr();
    let reloader = router.reloader();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(router.serve(async move {
        let _ = stopped.await;
    }));
    set_backends(addr, &[slow.host_port()]).await;
    let (status, _) = get(&format!("http://{addr}/slow")).await;
    assert_eq!(status, StatusCode::OK);

    // The `[upstream]` section is handed to a new client as it is: both timeouts apply.
    config.upstream.connect_timeout = Duration::from_millis(250);
    config.upstream.first_byte_timeout = Some(Duration::from_millis(200));
    let needs_restart = reloader.apply(Settings::from_config(config.clone()).unwrap());
    assert!(needs_restart.is_empty(), "{needs_restart:?}");
    let (status, body) = get(&format!("http://{addr}/slow")).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{body}");

    // Keys read only at start are named by their dotted keys, a section by its name.
    config.max_connections = custom_router::forms::Count::Fixed(7);
    config.retry.budget.percent = 5.0;
    config.shutdown.timeout = Duration::from_secs(3);
    config.queue.timeout = Duration::from_secs(9);
    let needs_restart = reloader.apply(Settings::from_config(config).unwrap());
    assert_eq!(
        needs_restart,
        ["max_connections", "shutdown", "retry.budget"]
    );
    let _ = stop.send(());
    served.await.unwrap();
}

#[tokio::test]
async fn the_listen_address_is_configurable_and_checked() {
    let router = spawn_router_process(&[("CUSTOM_ROUTER_HOST", "127.0.0.1")]);
    let listening = router
        .log
        .lock()
        .unwrap()
        .iter()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find_map(|entry| entry["listen"].as_str().map(str::to_owned))
        .expect("a listening line");
    assert!(listening.starts_with("127.0.0.1:"), "{listening}");
    let (status, _) = get(&format!("http://{}/_custom_router/health", router.addr)).await;
    assert_eq!(status, StatusCode::OK);
    for bad in ["localhost", "10.0.0.1:80", "::1::"] {
        let output = router_command(&[("CUSTOM_ROUTER_HOST", bad)])
            .output()
            .expect("router binary runs");
        assert_eq!(output.status.code(), Some(2), "{bad}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("CUSTOM_ROUTER_HOST"), "{bad}: {stderr}");
    }
}
