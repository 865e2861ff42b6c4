//! The admin API: set-backends validation, health, metrics.

mod common;

use common::*;
use http::{Request, StatusCode};
use serde_json::{Value, json};

#[tokio::test]
async fn set_backends_replaces_the_set_collapses_duplicates_and_allows_empty() {
    let router = start_router(round_robin()).await;
    let answer = set_backends(
        router.addr,
        &[
            "10.0.0.1:80".into(),
            "http://10.0.0.1:80".into(),
            "https://[::1]:8443".into(),
            "https://[0:0::1]:8443".into(),
            "replica-2.internal:8080".into(),
            "[FD00::0A]:80".into(),
        ],
    )
    .await;
    assert_eq!(
        answer,
        json!({"ok": true, "backends": ["10.0.0.1:80", "https://[::1]:8443", "replica-2.internal:8080", "[fd00::a]:80"]})
    );
    assert_eq!(listed_backends(router.addr).await.len(), 4);
    let answer = set_backends(router.addr, &[]).await;
    assert_eq!(answer, json!({"ok": true, "backends": []}));
    assert!(listed_backends(router.addr).await.is_empty());
}

#[tokio::test]
async fn statistics_of_kept_backends_survive_a_set_change() {
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[a.host_port()]).await;
    for _ in 0..3 {
        assert_eq!(get(&router.url("/")).await.0, StatusCode::OK);
    }
    set_backends(router.addr, &[b.host_port(), a.host_port()]).await;
    let (_, health) = get_json(&router.url("/_custom_router/health")).await;
    let entry = |addr: &str| {
        health["backends"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["addr"] == addr)
            .cloned()
            .unwrap()
    };
    assert_eq!(entry(&a.host_port())["completed"], 3);
    assert!(entry(&a.host_port())["ewma_latency"].as_f64().is_some());
    assert_eq!(entry(&b.host_port())["completed"], 0);
    assert_eq!(entry(&b.host_port())["ewma_latency"], Value::Null);
}

#[tokio::test]
async fn bad_set_backends_input_gets_400_naming_the_problem_and_changes_nothing() {
    let router = start_router(round_robin()).await;
    let good = vec!["127.0.0.1:9001".to_owned(), "127.0.0.1:9002".to_owned()];
    set_backends(router.addr, &good).await;
    let many: Vec<String> = (0..1025)
        .map(|i| format!("10.1.{}.{}:80", i / 256, i % 256))
        .collect();
    let cases: Vec<(String, &str)> = vec![
        ("{not json".into(), "malformed JSON"),
        ("[\"a:1\"]".into(), "JSON object"),
        ("{}".into(), "missing field `backends`"),
        (r#"{"backends": "a:1"}"#.into(), "must be an array"),
        (r#"{"backends": null}"#.into(), "must be an array"),
        (
            r#"{"backends": ["a:1", 7]}"#.into(),
            "backends[1] must be a string",
        ),
        (r#"{"backends": ["10.0.0.1"]}"#.into(), "has no port"),
        (r#"{"backends": ["10.0.0.1:0"]}"#.into(), "invalid port"),
        (r#"{"backends": ["10.0.0.1:80/v1"]}"#.into(), "has a path"),
        (r#"{"backends": ["10.0.0.1:80?x=1"]}"#.into(), "has a query"),
        (
            r#"{"backends": ["ftp://10.0.0.1:21"]}"#.into(),
            "unknown scheme",
        ),
        (json!({ "backends": many }).to_string(), "at most 1024"),
        (r#"{"backends": ["10.0.0.1:+80"]}"#.into(), "invalid port"),
        (r#"{"backends": ["[foo]:80"]}"#.into(), "invalid host"),
        (r#"{"backends": ["[]:80"]}"#.into(), "invalid host"),
        (r#"{"backends": ["[10.0.0.1]:80"]}"#.into(), "invalid host"),
        (
            r#"{"backends": ["[fe80::1%eth0]:80"]}"#.into(),
            "invalid host",
        ),
        (r#"{"backends": ["999.0.0.1:80"]}"#.into(), "invalid host"),
        (r#"{"backends": ["10.0.0.1.2:80"]}"#.into(), "invalid host"),
        (r#"{"backends": ["010.0.0.1:80"]}"#.into(), "invalid host"),
        (r#"{"backends": ["a!b$c:80"]}"#.into(), "invalid host"),
        (r#"{"backends": ["a..b:80"]}"#.into(), "invalid host"),
        (r#"{"backends": ["a:1", "[x]:80"]}"#.into(), "backends[1]"),
    ];
    for (body, expected) in cases {
        let (status, answer) =
            post_json(&router.url("/_custom_router/set-backends"), body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body:.80}: {answer}");
        let message = answer["error"].as_str().unwrap_or_default();
        assert!(
            message.contains(expected),
            "{body:.80}: {message:?} lacks {expected:?}"
        );
        assert_eq!(
            listed_backends(router.addr).await,
            good,
            "{body:.80} changed the set"
        );
    }
}

#[tokio::test]
async fn oversized_body_is_refused_and_changes_nothing() {
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &["127.0.0.1:9001".to_owned()]).await;
    let padding = " ".repeat(1024 * 1024 + 10);
    let body = format!("{{\"backends\": [\"127.0.0.1:9002\"]{padding}}}");
    let (status, answer) = post_json(&router.url("/_custom_router/set-backends"), body).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(answer["error"].as_str().unwrap().contains("larger than"));
    assert_eq!(listed_backends(router.addr).await, ["127.0.0.1:9001"]);
}

#[tokio::test]
async fn a_declared_oversized_body_is_refused_before_it_is_sent() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &["127.0.0.1:9001".to_owned()]).await;
    let mut client = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    client
        .write_all(
            b"POST /_custom_router/set-backends HTTP/1.1\r\nHost: a\r\n\
              Content-Type: application/json\r\nContent-Length: 2000000\r\n\r\n",
        )
        .await
        .unwrap();
    let mut answer = vec![0; 4096];
    let read = tokio::time::timeout(std::time::Duration::from_secs(5), client.read(&mut answer))
        .await
        .expect("answered without waiting for the body")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]).into_owned();
    assert!(answer.starts_with("HTTP/1.1 413 "), "{answer}");
    assert!(answer.contains("larger than"), "{answer}");
    assert_eq!(listed_backends(router.addr).await, ["127.0.0.1:9001"]);
}

#[tokio::test]
async fn wrong_method_on_admin_paths_is_405_and_admin_paths_are_never_proxied() {
    let backend = named_backend("backend").await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    for (method, path) in [
        ("GET", "/_custom_router/set-backends"),
        ("POST", "/_custom_router/health"),
        ("DELETE", "/_custom_router/metrics"),
    ] {
        let request = Request::builder()
            .method(method)
            .uri(router.url(path))
            .body(full(""))
            .unwrap();
        let (status, headers, body) = send(request).await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert!(headers.contains_key("allow"));
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert!(body["error"].is_string());
    }
    let (status, _) = get(&router.url("/_custom_router/other")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(backend.hits(), 0);
}

#[tokio::test]
async fn health_reports_the_reference_fields_and_strategy() {
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &["127.0.0.1:9001".to_owned()]).await;
    let (status, health) = get_json(&router.url("/_custom_router/health")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(health["ok"], true);
    assert_eq!(health["strategy"], "round-robin");
    assert_eq!(health["queue_depth"], 0);
    let backend = &health["backends"][0];
    assert_eq!(backend["addr"], "127.0.0.1:9001");
    assert_eq!(backend["in_flight"], 0);
    assert_eq!(backend["ewma_latency"], Value::Null);
    assert_eq!(backend["completed"], 0);
}

/// The prefix cache the router takes each backend to keep: the default strategy starts it at a
/// few prompts, with what lies past that as likely kept as not, and learns both from what the
/// engine found; a strategy that does not learn them leaves the index's configured capacity,
/// with nothing kept past it.
#[tokio::test]
async fn health_shows_the_prefix_cache_the_router_takes_each_backend_to_keep() {
    for (config, tokens, kept) in [(qll(), 8_192, 0.5), (round_robin(), 1_048_576, 0.0)] {
        let router = start_router(config).await;
        set_backends(router.addr, &["127.0.0.1:9001".to_owned()]).await;
        let (status, health) = get_json(&router.url("/_custom_router/health")).await;
        assert_eq!(status, StatusCode::OK);
        let backend = &health["backends"][0];
        assert_eq!(backend["prefix_reach_tokens"], tokens, "{health}");
        assert_eq!(backend["prefix_stale_kept"], kept, "{health}");
    }
}

#[tokio::test]
async fn metrics_use_the_reference_names_and_drop_removed_backends() {
    let a = named_backend("a").await;
    let router = start_router(round_robin()).await;
    let (status, text) = get(&router.url("/_custom_router/metrics")).await;
    assert_eq!(status, StatusCode::OK);
    for counter in [
        "custom_router_requests_dispatched_total",
        // The queue's counters carry the request's band, each band exported from the start.
        "custom_router_requests_evicted_total{band=\"normal\"}",
        "custom_router_requests_timeout_total{band=\"low\"}",
    ] {
        assert_eq!(
            sample(&text, counter),
            Some(0.0),
            "{counter} missing at start:\n{text}"
        );
    }
    assert_eq!(sample(&text, "custom_router_queue_depth"), Some(0.0));
    assert!(!text.contains("otel_scope"), "{text}");
    assert!(!text.contains("target_info"), "{text}");

    set_backends(router.addr, &[a.host_port()]).await;
    assert_eq!(get(&router.url("/x")).await.0, StatusCode::OK);
    let (_, text) = get(&router.url("/_custom_router/metrics")).await;
    let label = format!("{{addr=\"{}\"}}", a.host_port());
    assert_eq!(
        sample(&text, "custom_router_requests_dispatched_total"),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            &format!("custom_router_backend_inflight_requests{label}")
        ),
        Some(0.0)
    );
    assert!(
        sample(
            &text,
            &format!("custom_router_backend_ewma_latency_seconds{label}")
        )
        .is_some(),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            &format!(
                "custom_router_backend_responses_total{{addr=\"{}\",class=\"2xx\"}}",
                a.host_port()
            )
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "custom_router_request_duration_seconds_count"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "custom_router_time_to_first_byte_seconds_count"),
        Some(1.0)
    );

    set_backends(router.addr, &[]).await;
    let (_, text) = get(&router.url("/_custom_router/metrics")).await;
    assert!(
        !text.contains(&a.host_port()),
        "removed backend still exported:\n{text}"
    );
    assert!(text.contains("# TYPE custom_router_queue_depth gauge"));
}

#[tokio::test]
async fn a_removed_backend_finishes_its_in_flight_requests() {
    let (started_sender, mut started) = tokio::sync::mpsc::channel::<()>(1);
    let backend = spawn_backend(move |_request| {
        let started = started_sender.clone();
        async move {
            let _ = started.send(()).await;
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            respond(StatusCode::OK, "done")
        }
    })
    .await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let url = router.url("/slow");
    let in_flight = tokio::spawn(async move { get(&url).await });
    started.recv().await.unwrap();
    set_backends(router.addr, &[]).await;
    assert!(listed_backends(router.addr).await.is_empty());
    assert_eq!(
        in_flight.await.unwrap(),
        (StatusCode::OK, "done".to_owned())
    );
}
