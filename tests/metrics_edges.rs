//! The metrics and the access log held to docs/metrics.md and docs/configuration.md#access-log:
//! per-backend series for the most backends set-backends takes, a response the client cut
//! mid-stream still counted, a 503 `busy` not counted as rejected, a head the HTTP/1 server
//! refused logged; the documented families, bounded label values whatever clients send,
//! in-flight gauges back to 0 on every path, histograms in seconds, queue outcomes counted once,
//! and one escaped access-log line per request on every path.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PATIENCE: Duration = Duration::from_secs(10);

async fn metrics_text(router: &TestRouter) -> String {
    let (status, text) = get(&router.url("/_custom_router/metrics")).await;
    assert_eq!(status, StatusCode::OK);
    text
}

/// The body of `GET path` through the router, its first frame (data) read: a stream under way.
async fn stream_under_way(router: &TestRouter, path: &str) -> hyper::body::Incoming {
    let response = client()
        .request(Request::get(router.url(path)).body(full("")).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    body
}

/// Series lines (not comments) of the metrics text.
fn series_lines(text: &str) -> Vec<&str> {
    text.lines().filter(|line| !line.starts_with('#')).collect()
}

/// A backend streaming `200` whose body sends one chunk and then stays open until the test ends
/// (its senders are kept in the returned list).
async fn streaming_backend() -> (
    FakeBackend,
    Arc<Mutex<Vec<tokio::sync::mpsc::Sender<Bytes>>>>,
) {
    let open: Arc<Mutex<Vec<tokio::sync::mpsc::Sender<Bytes>>>> = Arc::default();
    let kept = Arc::clone(&open);
    let backend = spawn_backend(move |_request| {
        let kept = Arc::clone(&kept);
        async move {
            let (sender, body) = channel_body();
            sender
                .try_send(Bytes::from_static(b"data: one\n\n"))
                .unwrap();
            kept.lock().unwrap().push(sender);
            let mut response = http::Response::new(body);
            response.headers_mut().insert(
                "content-type",
                http::HeaderValue::from_static("text/event-stream"),
            );
            response
        }
    })
    .await;
    (backend, open)
}

// ---------------------------------------------------------------------------------------------
// Counted once, whatever the path

/// Every backend's series, with every `class` and `kind`, for the most backends set-backends
/// takes (1,024), and no overflow series: the SDK's default limit of 2,000 series an instrument
/// would fold those of more than 400 backends into one.
#[tokio::test]
async fn per_backend_counters_keep_every_backend_up_to_the_set_backends_maximum() {
    let router = start_router(round_robin()).await;
    let backends: Vec<String> = (0..1024)
        .map(|i| format!("127.0.0.1:{}", 20000 + i))
        .collect();
    set_backends(router.addr, &backends).await;
    let text = metrics_text(&router).await;
    let responses = series_lines(&text)
        .into_iter()
        .filter(|line| line.starts_with("custom_router_backend_responses_total{addr="))
        .count();
    let errors = series_lines(&text)
        .into_iter()
        .filter(|line| line.starts_with("custom_router_upstream_errors_total{addr="))
        .count();
    let overflow = series_lines(&text)
        .into_iter()
        .filter(|line| line.contains("otel_metric_overflow"))
        .count();
    assert_eq!(
        (responses, errors, overflow),
        (1024 * 5, 1024 * 5, 0),
        "expected 5 classes and 5 kinds for each of 1024 backends and no overflow series"
    );
}

/// A backend's 200 that the client cut mid-stream (common for LLM clients) is a backend response
/// and one duration observation, as the dispatch it follows is counted.
#[tokio::test]
async fn a_response_cut_by_the_client_mid_stream_is_still_a_backend_response() {
    let (backend, _open) = streaming_backend().await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    // The client leaves mid-stream.
    drop(stream_under_way(&router, "/stream").await);
    let balancer = Arc::clone(&router.balancer);
    assert!(
        eventually(PATIENCE, async || balancer.backends()[0].in_flight() == 0).await,
        "the lease is released"
    );
    let text = metrics_text(&router).await;
    let label = format!("{{addr=\"{}\",class=\"2xx\"}}", backend.host_port());
    let dispatched = sample(&text, "custom_router_requests_dispatched_total");
    let responses = sample(
        &text,
        &format!("custom_router_backend_responses_total{label}"),
    );
    let durations = sample(&text, "custom_router_request_duration_seconds_count");
    assert_eq!(
        (dispatched, responses, durations),
        (Some(1.0), Some(1.0), Some(1.0)),
        "dispatched, 2xx responses, duration observations after one 200 cut mid-stream:\n{text}"
    );
}

/// `requests_rejected_total` counts the router's own refusals, not a 503 `busy` after the only
/// backend answered 429 (docs/metrics.md).
#[tokio::test]
async fn a_503_busy_after_a_busy_answer_is_not_counted_as_rejected() {
    let backend =
        spawn_backend(|_request| async { respond(StatusCode::TOO_MANY_REQUESTS, "busy") }).await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let (status, headers, body) =
        send(Request::post(router.url("/v1/x")).body(full("{}")).unwrap()).await;
    let body = String::from_utf8_lossy(&body).into_owned();
    let _ = headers;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("busy"), "{body}");
    let text = metrics_text(&router).await;
    assert_eq!(
        sample(&text, "custom_router_requests_rejected_total"),
        Some(0.0),
        "a 503 busy after a busy answer counted as rejected:\n{text}"
    );
}

/// Every finished request is one access-log line, a head the HTTP/1 server refuses itself (400
/// `invalid request target`: a control byte in the path) included, with reason
/// `invalid_request` and no method or path.
#[tokio::test]
async fn a_request_refused_by_the_http1_server_is_logged() {
    let backend = named_backend("ok").await;
    let router = logged_router(&backend.host_port(), &[]);
    let answer = raw(
        router.addr,
        b"GET /a\x01b HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    // A proxied request after it, so the writer has had its chance.
    assert_eq!(
        get(&format!("http://{}/after", router.addr)).await.0,
        StatusCode::OK
    );
    let lines = access_log_lines(&router, 2).await;
    assert_eq!(lines[0]["status"], 400, "{lines:#?}");
    assert_eq!(lines[0]["reason"], "invalid_request", "{lines:#?}");
    assert_eq!(lines[0]["path"], "", "{lines:#?}");
}

// ---------------------------------------------------------------------------------------------
// The documented families and bounded labels

/// Every documented exported name, type and label set is in the exposition (after one event of
/// each kind that makes a series appear), and every exported family is documented.
#[tokio::test]
async fn documented_families_match_the_exposition() {
    let docs =
        std::fs::read_to_string(format!("{}/docs/metrics.md", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let mut documented: Vec<(String, String, Vec<String>)> = Vec::new();
    for line in docs.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 5 || !cells[1].starts_with("`custom_router_") {
            continue;
        }
        let name = cells[1].trim_matches('`').to_owned();
        let kind = cells[2].to_owned();
        let labels = if cells[3] == "—" {
            Vec::new()
        } else {
            cells[3]
                .split(',')
                .map(|l| l.trim().trim_matches('`').to_owned())
                .collect()
        };
        documented.push((name, kind, labels));
    }
    assert_eq!(documented.len(), 22, "{documented:?}");
    let text = rendered_metrics();
    let exported: Vec<(String, String)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let mut parts = l.split(' ');
            (
                parts.next().unwrap().to_owned(),
                parts.next().unwrap().to_owned(),
            )
        })
        .collect();
    for (name, kind, labels) in &documented {
        let found = exported
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{name} not exported:\n{text}"));
        assert_eq!(&found.1, kind, "{name}");
        // Label names on the family's series.
        let prefix = if kind == "histogram" {
            format!("{name}_count")
        } else {
            name.clone()
        };
        for line in series_lines(&text).iter().filter(|l| {
            l.starts_with(&format!("{prefix}{{")) || l.starts_with(&format!("{prefix} "))
        }) {
            let inside = line
                .split_once('{')
                .map(|(_, rest)| rest.split_once('}').unwrap().0)
                .unwrap_or("");
            let mut names: Vec<String> = inside
                .split(',')
                .filter(|p| !p.is_empty())
                .map(|p| p.split('=').next().unwrap().to_owned())
                .collect();
            names.sort();
            let mut want = labels.clone();
            want.sort();
            // The fixture records the histograms without a band.
            if name != "custom_router_queue_wait_seconds" {
                assert_eq!(names, want, "{line}");
            }
        }
    }
    for (name, _) in &exported {
        assert!(
            documented.iter().any(|(n, _, _)| n == name),
            "{name} exported but not documented"
        );
    }
    // The reference's names are kept.
    for name in [
        "custom_router_queue_depth",
        "custom_router_backend_ewma_latency_seconds",
        "custom_router_requests_dispatched_total",
        "custom_router_requests_evicted_total",
        "custom_router_requests_timeout_total",
    ] {
        assert!(exported.iter().any(|(n, _)| n == name), "{name}");
    }
}

/// 20,000 requests each with a distinct tenant id, priority value, method and path (and a
/// status class mix) leave the exposition's series set as it was after the first request.
#[tokio::test]
async fn client_chosen_values_do_not_grow_the_exposition() {
    let backend = spawn_backend(|request: Request<hyper::body::Incoming>| async move {
        let status = if request.uri().path().ends_with('7') {
            StatusCode::IM_A_TEAPOT
        } else {
            StatusCode::OK
        };
        respond(status, "ok")
    })
    .await;
    let mut config = qll();
    config.queue.tenant_header = "x-tenant-id".to_owned();
    let router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    // Series names and labels; the queue-wait histogram appears with the first request that
    // waited, in one of the three bands.
    let series = |text: &str| -> Vec<String> {
        series_lines(text)
            .iter()
            .map(|l| l.rsplit_once(' ').unwrap().0.to_owned())
            .filter(|l| {
                !l.starts_with("custom_router_queue_wait_seconds")
                    || !["high", "normal", "low"]
                        .iter()
                        .any(|band| l.contains(&format!("band=\"{band}\"")))
            })
            .collect()
    };
    let one = |i: usize| {
        Request::builder()
            .method(http::Method::from_bytes(format!("M{i}").as_bytes()).unwrap())
            .uri(router.url(&format!("/p/{i}?q={i}")))
            .header("x-tenant-id", format!("tenant-{i}"))
            .header("x-priority", format!("prio-{i}"))
            .body(full(""))
            .unwrap()
    };
    let client = client();
    client.request(one(0)).await.unwrap();
    client.request(one(7)).await.unwrap();
    let before = series(&metrics_text(&router).await);
    let total = 20_000usize;
    let mut tasks = Vec::new();
    for worker in 0..8 {
        let client = client.clone();
        let requests: Vec<_> = (0..total)
            .filter(|i| i % 8 == worker)
            .map(|i| one(i + 10))
            .collect();
        tasks.push(tokio::spawn(async move {
            for request in requests {
                let response = client.request(request).await.unwrap();
                let _ = response.into_body().collect().await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let text = metrics_text(&router).await;
    assert_eq!(series(&text), before, "{text}");
    assert_eq!(
        sample(&text, "custom_router_requests_dispatched_total"),
        Some((total + 2) as f64)
    );
}

/// The in-flight gauge is back to 0 after success, a 5xx, a connect failure, a first-byte
/// timeout, a backend reset mid-stream and a client leaving mid-stream or while waiting for the
/// head (failed attempts are held `latency.threshold`, set short here).
#[tokio::test]
async fn in_flight_returns_to_zero_on_every_path() {
    let (streaming, _open) = streaming_backend().await;
    let reset = spawn_backend(|request: Request<hyper::body::Incoming>| async move {
        if request.uri().path() == "/hang" {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        if request.uri().path() == "/500" {
            return respond(StatusCode::INTERNAL_SERVER_ERROR, "no");
        }
        respond(StatusCode::OK, "ok")
    })
    .await;
    let mut config = round_robin();
    config.latency.threshold = Duration::from_millis(50);
    config.upstream.first_byte_timeout = Some(Duration::from_millis(200));
    config.retry.max_attempts = 1;
    config.availability.consecutive_failures = 1000;
    let router = start_router(config).await;
    let all_zero = |router: &TestRouter| {
        router
            .balancer
            .backends()
            .iter()
            .all(|backend| backend.in_flight() == 0)
    };
    // Success, 5xx, first-byte timeout.
    set_backends(router.addr, &[reset.host_port()]).await;
    assert_eq!(get(&router.url("/ok")).await.0, StatusCode::OK);
    assert_eq!(
        get(&router.url("/500")).await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        get(&router.url("/hang")).await.0,
        StatusCode::GATEWAY_TIMEOUT
    );
    // Client gone while the backend has not answered.
    let url = router.url("/hang");
    let waiting = tokio::spawn(async move { get(&url).await });
    assert!(
        eventually(PATIENCE, async || router.balancer.backends()[0].in_flight()
            >= 1)
        .await
    );
    waiting.abort();
    assert!(eventually(PATIENCE, async || all_zero(&router)).await);
    // Connect failure.
    set_backends(router.addr, &[refusing_addr()]).await;
    assert_eq!(get(&router.url("/x")).await.0, StatusCode::BAD_GATEWAY);
    assert!(eventually(PATIENCE, async || all_zero(&router)).await);
    // Client gone mid-stream, backend reset mid-stream.
    set_backends(router.addr, &[streaming.host_port()]).await;
    drop(stream_under_way(&router, "/s").await);
    assert!(eventually(PATIENCE, async || all_zero(&router)).await);
    {
        let mut body = stream_under_way(&router, "/s").await;
        streaming.kill();
        while let Some(Ok(_)) = body.frame().await {}
    }
    assert!(eventually(PATIENCE, async || all_zero(&router)).await);
    let text = metrics_text(&router).await;
    assert!(
        series_lines(&text)
            .iter()
            .filter(|l| l.starts_with("custom_router_backend_inflight_requests"))
            .all(|l| l.ends_with(" 0")),
        "{text}"
    );
}

/// Histograms in seconds: a 300 ms answer lands in (0.25, 0.5] of request_duration and
/// time_to_first_byte, not in milliseconds.
#[tokio::test]
async fn histograms_observe_seconds() {
    let backend = slow_backend(Duration::from_millis(300)).await;
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    assert_eq!(get(&router.url("/x")).await.0, StatusCode::OK);
    let text = metrics_text(&router).await;
    for name in [
        "custom_router_request_duration_seconds",
        "custom_router_time_to_first_byte_seconds",
    ] {
        let sum = sample(&text, &format!("{name}_sum")).unwrap();
        assert!((0.29..2.0).contains(&sum), "{name} {sum}");
        assert_eq!(
            sample(&text, &format!("{name}_bucket{{le=\"0.25\"}}")),
            Some(0.0)
        );
        assert_eq!(
            sample(&text, &format!("{name}_bucket{{le=\"0.5\"}}")),
            Some(1.0)
        );
    }
}

/// Queue outcomes are counted once each, by band: a `high` request that waited is one
/// queue_wait observation with `band="high"`; a `low` request whose client left while queued is
/// one `cancelled{band="low"}`; a request timing out is one `timeout{band="normal"}`; the queue
/// depth is back to 0.
#[tokio::test]
async fn queue_outcomes_are_counted_once_by_band() {
    let (hold_sender, hold) = tokio::sync::watch::channel(false);
    let backend = spawn_backend(move |_request| {
        let mut hold = hold.clone();
        async move {
            while !*hold.borrow() {
                if hold.changed().await.is_err() {
                    break;
                }
            }
            respond(StatusCode::OK, "ok")
        }
    })
    .await;
    // One request at a time until the backend has answered: the first holds it.
    let mut config = qll_held();
    config.queue.timeout = Duration::from_millis(300);
    let router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let with_band = |band: &str| {
        Request::get(router.url("/q"))
            .header("x-priority", band.to_owned())
            .body(full(""))
            .unwrap()
    };
    // Occupies the only backend: the rest wait.
    let first = tokio::spawn(send(with_band("normal")));
    assert!(eventually(PATIENCE, async || backend.hits() == 1).await);
    // A normal request times out in the queue.
    assert_eq!(
        send(with_band("normal")).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    // A low request's client leaves while queued.
    let low = tokio::spawn(send(with_band("low")));
    assert!(eventually(PATIENCE, async || router.balancer.queue_depth() == 1).await);
    low.abort();
    assert!(eventually(PATIENCE, async || router.balancer.queue_depth() == 0).await);
    // A high request waits, then goes.
    let high = tokio::spawn(send(with_band("high")));
    assert!(eventually(PATIENCE, async || router.balancer.queue_depth() == 1).await);
    hold_sender.send(true).unwrap();
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    assert_eq!(high.await.unwrap().0, StatusCode::OK);
    let text = metrics_text(&router).await;
    let expect = [
        ("custom_router_requests_timeout_total{band=\"normal\"}", 1.0),
        ("custom_router_requests_timeout_total{band=\"low\"}", 0.0),
        ("custom_router_requests_cancelled_total{band=\"low\"}", 1.0),
        (
            "custom_router_requests_cancelled_total{band=\"normal\"}",
            0.0,
        ),
        ("custom_router_queue_wait_seconds_count{band=\"high\"}", 1.0),
        ("custom_router_requests_dispatched_total", 2.0),
        ("custom_router_queue_depth", 0.0),
    ];
    for (series, value) in expect {
        assert_eq!(sample(&text, series), Some(value), "{series}\n{text}");
    }
    assert!(
        sample(
            &text,
            "custom_router_queue_wait_seconds_count{band=\"normal\"}"
        )
        .is_none()
    );
}

// ---------------------------------------------------------------------------------------------
// Access log (router binary: the log goes to stdout)
// ---------------------------------------------------------------------------------------------

async fn raw(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

/// Client-chosen text (path with quotes, backslashes, percent-escaped newlines; an extension
/// method; header values with quotes and control-like text) cannot break a line or forge a
/// field: each line is one JSON object holding the text as sent; header-derived fields
/// (`band`, `trace_id`) only take validated values.
#[tokio::test]
async fn access_log_escapes_client_text() {
    let backend = named_backend("ok").await;
    let router = logged_router(&backend.host_port(), &[]);
    let path = "/a\"b\",\"status\":1%22%5Cc%0A%0D'|~!$&()*+,;=:@?x=%22";
    let request = format!(
        "X-CUSTOM!#$%&'*+.^_`|~ {path} HTTP/1.1\r\nhost: x\r\nx-priority: \"high\r\n\
         traceparent: 00-\"}},{{\"a\":1-00f067aa0ba902b7-01\r\nconnection: close\r\n\r\n"
    );
    let answer = raw(router.addr, request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // Invalid UTF-8 in a header value.
    let mut bytes = b"GET /utf HTTP/1.1\r\nhost: x\r\nx-priority: \xff\xfe\r\ntraceparent: \xff\r\nconnection: close\r\n\r\n".to_vec();
    let answer = raw(router.addr, &bytes).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    bytes.clear();
    let lines = access_log_lines(&router, 2).await;
    assert_eq!(lines[0]["method"], "X-CUSTOM!#$%&'*+.^_`|~");
    assert_eq!(lines[0]["path"], path);
    assert_eq!(lines[0]["band"], "normal");
    assert!(lines[0]["trace_id"].is_null());
    assert_eq!(lines[1]["path"], "/utf");
    assert!(lines[1]["trace_id"].is_null());
    let out = router.out.lock().unwrap().clone();
    assert!(out.iter().all(|l| l.starts_with('{') && l.ends_with('}')));
}

/// One line per request on the router's own answers and client departures: CONNECT (405, its
/// target as the path), no backend (503), a client gone while its request was queued (499
/// client_gone), a client gone mid-stream (200, its bytes), a connect failure (502 connect).
#[tokio::test]
async fn access_log_one_line_per_request_on_every_path() {
    let (streaming, _open) = streaming_backend().await;
    let router = logged_router(
        &streaming.host_port(),
        &[("CUSTOM_ROUTER_MAX_ATTEMPTS", "1")],
    );
    let url = |path: &str| format!("http://{}{path}", router.addr);
    // Mid-stream departure (held while the next request is made).
    let response = client()
        .request(Request::get(url("/stream")).body(full("")).unwrap())
        .await
        .unwrap();
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    // A client gone while its backend has not answered.
    let hanging = spawn_backend(|_request| async {
        tokio::time::sleep(Duration::from_secs(3600)).await;
        respond(StatusCode::OK, "late")
    })
    .await;
    set_backends(router.addr, &[hanging.host_port()]).await;
    let queued_url = url("/queued");
    let queued = tokio::spawn(async move { get(&queued_url).await });
    assert!(eventually(PATIENCE, async || hanging.hits() == 1).await);
    queued.abort();
    assert!(eventually(PATIENCE, async || !router.out.lock().unwrap().is_empty()).await);
    drop(body);
    assert!(eventually(PATIENCE, async || router.out.lock().unwrap().len() >= 2).await);
    let answer = raw(
        router.addr,
        b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
    set_backends(router.addr, &[refusing_addr()]).await;
    assert_eq!(get(&url("/refused")).await.0, StatusCode::BAD_GATEWAY);
    set_backends(router.addr, &[]).await;
    assert_eq!(get(&url("/none")).await.0, StatusCode::SERVICE_UNAVAILABLE);
    let lines = access_log_lines(&router, 5).await;
    let summary: Vec<(String, u64, Value)> = lines
        .iter()
        .map(|l| {
            (
                l["path"].as_str().unwrap_or_default().to_owned(),
                l["status"].as_u64().unwrap(),
                l["reason"].clone(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("/queued".to_owned(), 499, Value::from("client_gone")),
            ("/stream".to_owned(), 200, Value::Null),
            (
                "example.com:443".to_owned(),
                405,
                Value::from("connect_not_allowed")
            ),
            ("/refused".to_owned(), 502, Value::from("connect")),
            ("/none".to_owned(), 503, Value::from("no_backend")),
        ],
        "{lines:#?}"
    );
    assert!(lines[1]["bytes_out"].as_u64().unwrap() > 0);
}
