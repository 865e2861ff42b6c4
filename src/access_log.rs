//! The access log: one JSON line per finished request on stdout (`access_log`,
//! `CUSTOM_ROUTER_ACCESS_LOG`; off by default).
//!
//! A request's record is filled as it goes (arrival, attempts, the backend, the queue wait) and
//! sent when the response has ended: at the end of a proxied body (or when the client left or
//! the body failed), at once for an answer the router wrote itself, and when the client left
//! before the answer's head (status 499, reason `client_gone`). Records go through a bounded
//! channel to one writer thread, which serializes them and writes to stdout; nothing on the
//! request path waits for stdout or holds a lock across I/O. When the channel is full (stdout
//! cannot keep up) a record is dropped and counted, never waited for.
//!
//! A line:
//!
//! ```json
//! {"time":"2026-12-01T10:00:00.123Z","method":"POST","path":"/v1/chat/completions","status":200,
//!  "backend":"10.0.0.2:8000","attempts":1,"retries":[],"queue_ms":0.0,"ttfb_ms":412.7,"duration_ms":9120.3,
//!  "bytes_in":1234,"bytes_out":20480,"band":"normal","prompt_tokens":2048,"uncached_tokens":512,
//!  "reason":null,"trace_id":null}
//! ```
//!
//! `time` is when the request arrived; `retries` why each attempt after the first was sent
//! (`connect`, `busy`, `idempotent`, `generation`: the reasons of
//! `custom_router_retries_total`); `queue_ms` from arrival to the last attempt's dispatch;
//! `ttfb_ms` from arrival to the response body's first byte; `duration_ms` from arrival to the
//! response's end; `band` its priority band; `prompt_tokens` the prompt's tokens as the router
//! counted them and `uncached_tokens` those past the longest prefix the router's index holds for
//! the last attempt's backend (both `null` when the strategy read no prompt); `reason` the
//! refusal reason of a 503 the router wrote (`no_backend`, `overloaded`, ...), the failure kind
//! of a 502/504, or `invalid_request` for a head the HTTP/1 server refused itself (400, 431,
//! 501, ...: then `method` and `path` are empty); `trace_id` the W3C trace id when the request carried a `traceparent` or traces
//! are on.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Records waiting for the writer; past this, records are dropped (and counted).
const QUEUE: usize = 4096;

/// Where records go. Cloning is cheap.
#[derive(Debug, Clone)]
pub struct AccessLog {
    sender: mpsc::Sender<Record>,
    dropped: Arc<AtomicU64>,
}

/// One finished request.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// When the request arrived (RFC 3339, UTC, milliseconds).
    pub time: String,
    /// The method.
    pub method: String,
    /// The path and query.
    pub path: String,
    /// The status the client got.
    pub status: u16,
    /// The backend of the last attempt.
    pub backend: Option<String>,
    /// Attempts sent to backends.
    pub attempts: u32,
    /// Why each attempt after the first was sent (empty without retries; nothing is allocated
    /// then).
    pub retries: Vec<&'static str>,
    /// Milliseconds from arrival to the last attempt's dispatch.
    pub queue_ms: Option<f64>,
    /// Milliseconds from arrival to the response body's first byte.
    pub ttfb_ms: Option<f64>,
    /// Milliseconds from arrival to the end of the response.
    pub duration_ms: f64,
    /// Request body bytes, when known.
    pub bytes_in: Option<u64>,
    /// Response body bytes relayed.
    pub bytes_out: u64,
    /// The request's priority band.
    pub band: &'static str,
    /// The prompt's tokens, when the strategy read a prompt.
    pub prompt_tokens: Option<u32>,
    /// The prompt tokens past the longest prefix the router's index held for the last
    /// attempt's backend: what that backend was expected to prefill.
    pub uncached_tokens: Option<u64>,
    /// Why the router answered itself, if it did.
    pub reason: Option<&'static str>,
    /// The W3C trace id.
    pub trace_id: Option<String>,
}

impl AccessLog {
    /// Starts the writer thread, writing to stdout.
    pub fn to_stdout() -> Self {
        Self::start(std::io::stdout())
    }

    /// Starts the writer thread writing lines to `out`. It ends when every [`AccessLog`] is gone
    /// (or `out` fails), after writing what it received.
    pub fn start<W: Write + Send + 'static>(out: W) -> Self {
        let (sender, mut receiver) = mpsc::channel::<Record>(QUEUE);
        let dropped = Arc::new(AtomicU64::new(0));
        let seen_dropped = Arc::clone(&dropped);
        // A thread of its own: writing to stdout may block, and no request waits for it.
        let spawned = std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || {
                let mut out = std::io::BufWriter::new(out);
                let mut reported = 0;
                while let Some(record) = receiver.blocking_recv() {
                    let mut next = Some(record);
                    while let Some(record) = next {
                        if serde_json::to_writer(&mut out, &record).is_err()
                            || out.write_all(b"\n").is_err()
                        {
                            return;
                        }
                        next = receiver.try_recv().ok();
                    }
                    if out.flush().is_err() {
                        return;
                    }
                    let now = seen_dropped.load(Ordering::Relaxed);
                    if now > reported {
                        tracing::warn!(
                            dropped = now - reported,
                            "access log records dropped: stdout is too slow"
                        );
                        reported = now;
                    }
                }
            });
        if let Err(error) = spawned {
            tracing::error!(%error, "cannot start the access log writer");
        }
        Self { sender, dropped }
    }

    /// Sends `record` to the writer, or drops it when the writer is behind.
    pub fn emit(&self, record: Record) {
        if self.sender.try_send(record).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What is known of a request before its response ends.
#[derive(Debug)]
pub struct Pending {
    log: AccessLog,
    arrived: Instant,
    record: Record,
}

impl Pending {
    /// A request that arrived now.
    pub fn new(
        log: &AccessLog,
        method: &http::Method,
        path: &str,
        trace_id: Option<String>,
    ) -> Self {
        Self::arrived(log, method.as_str(), path, trace_id)
    }

    fn arrived(log: &AccessLog, method: &str, path: &str, trace_id: Option<String>) -> Self {
        Self {
            log: log.clone(),
            arrived: Instant::now(),
            record: Record {
                time: crate::dates::rfc3339(SystemTime::now()),
                method: method.to_owned(),
                path: path.to_owned(),
                status: 0,
                backend: None,
                attempts: 0,
                retries: Vec::new(),
                queue_ms: None,
                ttfb_ms: None,
                duration_ms: 0.0,
                bytes_in: None,
                bytes_out: 0,
                band: "normal",
                prompt_tokens: None,
                uncached_tokens: None,
                reason: None,
                trace_id,
            },
        }
    }

    /// A request refused before it was read whole (a malformed or oversized head): its method
    /// and path are not known, and are logged empty.
    pub fn refused(log: &AccessLog) -> Self {
        Self::arrived(log, "", "", None)
    }

    /// What the router read of the request: its priority band's name and, when a prompt was
    /// read, its tokens.
    pub fn request(&mut self, band: &'static str, prompt_tokens: Option<u32>) {
        self.record.band = band;
        self.record.prompt_tokens = prompt_tokens;
    }

    /// An attempt to `backend` was dispatched at `dispatched_at`, expected to prefill
    /// `uncached_tokens` of the prompt (when one was read); `retry` says why, when it is a
    /// retry.
    pub fn attempt(
        &mut self,
        backend: &str,
        dispatched_at: Instant,
        uncached_tokens: Option<u64>,
        retry: Option<&'static str>,
    ) {
        self.record.attempts += 1;
        if let Some(reason) = retry {
            self.record.retries.push(reason);
        }
        self.record.backend = Some(backend.to_owned());
        self.record.uncached_tokens = uncached_tokens;
        self.record.queue_ms = Some(millis(
            dispatched_at.saturating_duration_since(self.arrived),
        ));
    }

    /// The request body's length.
    pub fn bytes_in(&mut self, bytes: Option<u64>) {
        self.record.bytes_in = bytes;
    }

    /// The response body's first byte came now.
    pub fn first_byte(&mut self) {
        if self.record.ttfb_ms.is_none() {
            self.record.ttfb_ms = Some(millis(self.arrived.elapsed()));
        }
    }

    /// The response ended now: writes the record.
    pub fn finish(mut self, status: u16, bytes_out: u64, reason: Option<&'static str>) {
        self.record.status = status;
        self.record.bytes_out = bytes_out;
        self.record.reason = reason;
        self.record.duration_ms = millis(self.arrived.elapsed());
        self.log.emit(self.record);
    }
}

fn millis(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 1e6).round() / 1e3
}
