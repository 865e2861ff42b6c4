//! OpenTelemetry traces through the router binary: a fake OTLP/HTTP collector on loopback
//! receives the spans; the backend sees a `traceparent` continuing the client's trace.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::Value;

const PATIENCE: Duration = Duration::from_secs(15);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attribute(span: &Span, key: &str) -> Option<AnyValue> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone()?.value)
}

#[tokio::test]
async fn a_request_is_one_trace_continued_from_the_client_and_passed_to_the_backend() {
    let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
    let services: Arc<Mutex<Vec<String>>> = Arc::default();
    let (sink, names) = (Arc::clone(&spans), Arc::clone(&services));
    let collector = spawn_backend(move |request: http::Request<hyper::body::Incoming>| {
        let (sink, names) = (Arc::clone(&sink), Arc::clone(&names));
        async move {
            assert_eq!(request.uri().path(), "/v1/traces");
            let body = request.into_body().collect().await.unwrap().to_bytes();
            let export = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
            for resource in export.resource_spans {
                for kv in resource.resource.iter().flat_map(|r| r.attributes.iter()) {
                    if let (true, Some(AnyValue::StringValue(name))) = (
                        kv.key == "service.name",
                        kv.value.clone().and_then(|v| v.value),
                    ) {
                        names.lock().unwrap().push(name);
                    }
                }
                for scope in resource.scope_spans {
                    sink.lock().unwrap().extend(scope.spans);
                }
            }
            respond(StatusCode::OK, "")
        }
    })
    .await;
    let received: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = Arc::clone(&received);
    let backend = spawn_backend(move |request: http::Request<hyper::body::Incoming>| {
        let seen = Arc::clone(&seen);
        async move {
            let traceparent = request
                .headers()
                .get_all("traceparent")
                .iter()
                .map(|v| v.to_str().unwrap().to_owned())
                .collect::<Vec<_>>()
                .join(" | ");
            seen.lock().unwrap().push(traceparent);
            Response::new(full("traced"))
        }
    })
    .await;
    let router = spawn_router_process(&[
        ("CUSTOM_ROUTER_BACKENDS", &backend.host_port()),
        ("CUSTOM_ROUTER_ACCESS_LOG", "true"),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            &format!("http://{}", collector.host_port()),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY", "50"),
    ]);
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let request = http::Request::get(format!("http://{}/v1/models", router.addr))
        .header("traceparent", format!("00-{trace_id}-{client_span}-01"))
        .body(full(""))
        .unwrap();
    let (status, _, body) = send(request).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"traced"[..]));

    // The backend got one traceparent: the same trace, the router's attempt span as parent.
    let forwarded = received.lock().unwrap().clone();
    assert_eq!(forwarded.len(), 1);
    let parts: Vec<&str> = forwarded[0].split('-').collect();
    assert_eq!(parts.len(), 4, "{forwarded:?}");
    assert_eq!((parts[0], parts[1], parts[3]), ("00", trace_id, "01"));
    assert_ne!(
        parts[2], client_span,
        "the client's span is not passed on as the parent"
    );

    // The first exported span named `name`, if any yet.
    let find = |name: &str| {
        spans
            .lock()
            .unwrap()
            .iter()
            .find(|s| s.name == name)
            .cloned()
    };
    assert!(
        eventually(PATIENCE, async || find("GET").is_some()
            && find("GET attempt").is_some())
        .await,
        "spans exported: {:?}",
        spans
            .lock()
            .unwrap()
            .iter()
            .map(|s| &s.name)
            .collect::<Vec<_>>()
    );
    let server = find("GET").unwrap();
    let attempt = find("GET attempt").unwrap();
    let queue = find("queue").unwrap();
    for span in [&server, &attempt, &queue] {
        assert_eq!(hex(&span.trace_id), trace_id, "{}", span.name);
    }
    assert_eq!(
        hex(&server.parent_span_id),
        client_span,
        "continued from the client"
    );
    assert_eq!(attempt.parent_span_id, server.span_id);
    assert_eq!(queue.parent_span_id, server.span_id);
    assert_eq!(
        hex(&attempt.span_id),
        parts[2],
        "the backend's parent is the attempt"
    );
    assert_eq!(
        attribute(&attempt, "server.address"),
        Some(AnyValue::StringValue(backend.host_port()))
    );
    assert_eq!(
        attribute(&attempt, "custom_router.attempt"),
        Some(AnyValue::IntValue(1))
    );
    assert_eq!(
        attribute(&attempt, "custom_router.strategy"),
        Some(AnyValue::StringValue("queued-least-latency".into()))
    );
    assert_eq!(
        attribute(&server, "http.response.status_code"),
        Some(AnyValue::IntValue(200))
    );
    // No body: the normal band, no prompt.
    assert_eq!(
        attribute(&server, "custom_router.priority"),
        Some(AnyValue::StringValue("normal".into()))
    );
    assert_eq!(attribute(&server, "custom_router.prompt.tokens"), None);
    assert_eq!(
        attribute(&attempt, "custom_router.prompt.uncached_tokens"),
        None
    );
    assert!(
        services
            .lock()
            .unwrap()
            .iter()
            .all(|name| name == "custom-router")
    );
    // The access log names the same trace.
    assert!(eventually(PATIENCE, async || !router.out.lock().unwrap().is_empty()).await);
    let line: Value = serde_json::from_str(&router.out.lock().unwrap()[0]).unwrap();
    assert_eq!(line["trace_id"], trace_id);

    // A prompt of 1,000 bytes (250 tokens) in the high band: the server span has both, the
    // attempt the tokens its backend had to prefill (all of them: it had seen none).
    let request = http::Request::post(format!("http://{}/v1/completions", router.addr))
        .header("x-priority", "high")
        .body(full(format!("{{\"prompt\":\"{}\"}}", "a".repeat(1000))))
        .unwrap();
    let (status, _, _) = send(request).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        eventually(PATIENCE, async || find("POST").is_some()
            && find("POST attempt").is_some())
        .await
    );
    let (server, attempt) = (find("POST").unwrap(), find("POST attempt").unwrap());
    assert_eq!(
        attribute(&server, "custom_router.priority"),
        Some(AnyValue::StringValue("high".into()))
    );
    assert_eq!(
        attribute(&server, "custom_router.prompt.tokens"),
        Some(AnyValue::IntValue(250))
    );
    assert_eq!(
        attribute(&attempt, "custom_router.prompt.uncached_tokens"),
        Some(AnyValue::IntValue(250))
    );
}

#[tokio::test]
async fn the_standard_sampler_variable_is_honoured() {
    let collector = spawn_backend(|_request: http::Request<hyper::body::Incoming>| async {
        respond(StatusCode::OK, "")
    })
    .await;
    let received: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = Arc::clone(&received);
    let backend = spawn_backend(move |request: http::Request<hyper::body::Incoming>| {
        let seen = Arc::clone(&seen);
        async move {
            if let Some(value) = request.headers().get("traceparent") {
                seen.lock()
                    .unwrap()
                    .push(value.to_str().unwrap().to_owned());
            }
            Response::new(full("ok"))
        }
    })
    .await;
    let router = spawn_router_process(&[
        ("CUSTOM_ROUTER_BACKENDS", &backend.host_port()),
        (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            &format!("http://{}/v1/traces", collector.host_port()),
        ),
        ("OTEL_TRACES_SAMPLER", "always_off"),
    ]);
    let (status, _) = get(&format!("http://{}/", router.addr)).await;
    assert_eq!(status, StatusCode::OK);
    let forwarded = received.lock().unwrap().clone();
    assert_eq!(forwarded.len(), 1, "{forwarded:?}");
    // A trace is still propagated, marked not sampled.
    assert!(
        forwarded[0].starts_with("00-") && forwarded[0].ends_with("-00"),
        "{forwarded:?}"
    );
}
