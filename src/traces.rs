//! OpenTelemetry traces over OTLP (HTTP/protobuf), on only when the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set.
//!
//! Each proxied request is a server span (`{method}`), continued from the client's W3C
//! `traceparent` when it sent one, with children: `queue` (admission, from arrival until a
//! backend was leased) and one client span per attempt (`{method} attempt`, with the backend,
//! the attempt number, the strategy and what it saw of the backend it chose: in-flight
//! requests, EWMA latency and, for a prompt, the tokens it was expected to prefill; then the
//! status or the error kind). The server span carries the request's priority band and, when a
//! prompt was read, its tokens. Each attempt sends the backend
//! a `traceparent` naming its own span, in place of the client's. The server span ends with the
//! response body (its status and bytes relayed).
//!
//! Sampling follows `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (default: parent-based,
//! always on); the service name is `OTEL_SERVICE_NAME`, else `custom-router`; other
//! `OTEL_EXPORTER_OTLP_*` variables (headers, timeout, `OTEL_BSP_*` batching) apply as the
//! OpenTelemetry SDK reads them. Spans are batched and exported by a thread of their own. When
//! traces are off, nothing of this runs: the proxy checks one `Option`.

use std::sync::Arc;

use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

/// The variables that turn traces on.
pub const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

/// The tracer, when traces are on. Cloning is cheap.
#[derive(Clone)]
pub struct Traces {
    tracer: SdkTracer,
    provider: Arc<SdkTracerProvider>,
}

impl std::fmt::Debug for Traces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Traces").finish_non_exhaustive()
    }
}

impl Traces {
    /// Traces as the environment says: `None` unless an OTLP endpoint variable is set.
    pub fn from_env() -> Result<Option<Self>, String> {
        let on = ENDPOINT_VARS
            .iter()
            .any(|name| std::env::var_os(name).is_some_and(|value| !value.is_empty()));
        if !on {
            return Ok(None);
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
            .map_err(|error| format!("OTLP trace exporter: {error}"))?;
        let processor =
            opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
                exporter,
                opentelemetry_sdk::runtime::TokioCurrentThread,
            )
            .build();
        let service = std::env::var("OTEL_SERVICE_NAME")
            .ok()
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| "custom-router".to_owned());
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(Resource::builder().with_service_name(service).build())
            .build();
        let tracer = provider.tracer("custom-router");
        Ok(Some(Self {
            tracer,
            provider: Arc::new(provider),
        }))
    }

    /// Exports what is left (at shutdown).
    pub fn shutdown(&self) {
        let _ = self.provider.shutdown();
    }

    /// The server span of a request, continued from its `traceparent` if valid.
    pub fn request(&self, method: &str, path: &str, traceparent: Option<&[u8]>) -> RequestSpan {
        let remote = traceparent.and_then(parse_traceparent);
        let continues_client_trace = remote.is_some();
        let parent = remote.map_or_else(Context::new, |remote| {
            Context::new().with_remote_span_context(remote)
        });
        let span = self
            .tracer
            .span_builder(method.to_owned())
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("http.request.method", method.to_owned()),
                KeyValue::new("url.path", path.to_owned()),
            ])
            .start_with_context(&self.tracer, &parent);
        RequestSpan {
            traces: self.clone(),
            context: parent.with_span(span),
            queue: None,
            continues_client_trace,
        }
    }
}

/// A request's server span and what hangs from it.
#[derive(Debug)]
pub struct RequestSpan {
    traces: Traces,
    context: Context,
    queue: Option<opentelemetry_sdk::trace::Span>,
    /// Whether the request's `traceparent` was valid and the trace goes on from it (otherwise
    /// the trace starts here, and the client's `tracestate` belongs to no trace).
    continues_client_trace: bool,
}

impl RequestSpan {
    /// Whether the trace goes on from the client's valid `traceparent`; when it does not, the
    /// client's `tracestate` is not forwarded (W3C Trace Context: a `tracestate` without a
    /// valid `traceparent` is discarded).
    pub fn continues_client_trace(&self) -> bool {
        self.continues_client_trace
    }

    /// The trace id, as the access log writes it.
    pub fn trace_id(&self) -> String {
        self.context.span().span_context().trace_id().to_string()
    }

    /// What the router read of the request: its priority band's name and, when a prompt was
    /// read, its tokens.
    pub fn request(&self, band: &'static str, prompt_tokens: Option<u32>) {
        let span = self.context.span();
        span.set_attribute(KeyValue::new("custom_router.priority", band));
        if let Some(tokens) = prompt_tokens {
            span.set_attribute(KeyValue::new(
                "custom_router.prompt.tokens",
                i64::from(tokens),
            ));
        }
    }

    /// The request starts waiting for admission.
    pub fn queue_started(&mut self) {
        self.queue = Some(
            self.traces
                .tracer
                .span_builder("queue")
                .with_kind(SpanKind::Internal)
                .start_with_context(&self.traces.tracer, &self.context),
        );
    }

    /// Admission ended (a lease, or a refusal named by `refused`).
    pub fn queue_ended(&mut self, refused: Option<&'static str>) {
        if let Some(mut span) = self.queue.take() {
            if let Some(reason) = refused {
                span.set_attribute(KeyValue::new("custom_router.refusal", reason));
            }
            span.end();
        }
    }

    /// A client span for attempt `number` to `backend`, with the routing decision that chose it.
    pub fn attempt(&self, method: &str, number: u32, decision: Decision<'_>) -> AttemptSpan {
        let mut span = self
            .traces
            .tracer
            .span_builder(format!("{method} attempt"))
            .with_kind(SpanKind::Client)
            .with_attributes([
                KeyValue::new("server.address", decision.backend.to_owned()),
                KeyValue::new("custom_router.attempt", i64::from(number)),
                KeyValue::new("custom_router.strategy", decision.strategy),
                KeyValue::new("custom_router.backend.in_flight", decision.in_flight as i64),
                KeyValue::new(
                    "custom_router.backend.ewma_latency_s",
                    decision.ewma_latency.unwrap_or(-1.0),
                ),
            ])
            .start_with_context(&self.traces.tracer, &self.context);
        if let Some(tokens) = decision.uncached_tokens {
            span.set_attribute(KeyValue::new(
                "custom_router.prompt.uncached_tokens",
                i64::try_from(tokens).unwrap_or(i64::MAX),
            ));
        }
        AttemptSpan { span }
    }

    /// The response ended with `status` after `bytes` of body (or failed with `error`).
    pub fn finish(self, status: u16, bytes: u64, error: Option<&'static str>) {
        let span = self.context.span();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        span.set_attribute(KeyValue::new("custom_router.bytes_out", bytes as i64));
        if let Some(error) = error {
            span.set_attribute(KeyValue::new("error.type", error));
        }
        if status >= 500 || error.is_some() {
            span.set_status(Status::error(error.unwrap_or("server error")));
        }
        span.end();
    }
}

/// What the strategy chose, for the attempt's span.
#[derive(Debug, Clone, Copy)]
pub struct Decision<'a> {
    /// The strategy's name.
    pub strategy: &'static str,
    /// The backend it chose.
    pub backend: &'a str,
    /// The backend's requests in flight when it was chosen (this one included).
    pub in_flight: usize,
    /// The backend's EWMA latency in seconds, if measured.
    pub ewma_latency: Option<f64>,
    /// The prompt tokens past the longest prefix the router's index held for the backend, when
    /// a prompt was read.
    pub uncached_tokens: Option<u64>,
}

/// One attempt's client span.
#[derive(Debug)]
pub struct AttemptSpan {
    span: opentelemetry_sdk::trace::Span,
}

impl AttemptSpan {
    /// The `traceparent` the backend gets: this span as its parent.
    pub fn traceparent(&self) -> String {
        let context = self.span.span_context();
        format!(
            "00-{}-{}-{:02x}",
            context.trace_id(),
            context.span_id(),
            context.trace_flags().to_u8()
        )
    }

    /// The attempt got a response head with `status`.
    pub fn answered(mut self, status: u16) {
        self.span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if status >= 500 {
            self.span.set_status(Status::error("server error"));
        }
        self.span.end();
    }

    /// The attempt failed with `kind`.
    pub fn failed(mut self, kind: &'static str) {
        self.span.set_attribute(KeyValue::new("error.type", kind));
        self.span.set_status(Status::error(kind));
        self.span.end();
    }
}

/// The trace id of a valid W3C `traceparent` value (see [`parse_traceparent`]), as the access
/// log writes it.
pub fn trace_id_of(traceparent: &[u8]) -> Option<String> {
    parse_traceparent(traceparent).map(|context| context.trace_id().to_string())
}

/// A valid W3C `traceparent` (version 00 rules; other versions read the same four fields).
fn parse_traceparent(value: &[u8]) -> Option<SpanContext> {
    let text = std::str::from_utf8(value).ok()?.trim();
    let mut parts = text.split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    if trace.len() != 32 || parent.len() != 16 || flags.len() != 2 {
        return None;
    }
    let lower = |part: &str| {
        part.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if !(lower(version) && lower(trace) && lower(parent) && lower(flags)) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(parent).ok()?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    let flags = u8::from_str_radix(flags, 16).ok()?;
    Some(SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags) & TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_read_strictly() {
        let valid = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context = parse_traceparent(valid).expect("valid");
        assert_eq!(
            context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert!(context.is_sampled() && context.is_remote());
        for invalid in [
            &b"00-00000000000000000000000000000000-00f067aa0ba902b7-01"[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert!(parse_traceparent(invalid).is_none(), "{invalid:?}");
        }
    }
}
