//! The load client: streams read through a proxy (or directly), and large uploads.
//!
//! Each stream is one HTTP/1.1 connection carrying one `POST /v1/chat/completions` with a small
//! JSON body; the answer's chunked body is decoded and split into events at blank lines, and
//! every event's delay (receipt time minus the send stamp it carries) is recorded when it is
//! received inside the measurement window. Raw tokio TCP and `httparse`: a stream costs a task,
//! a socket and a few KiB of buffers, so one thread holds thousands.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::wire::{Chunked, event_stamp, ns_at};

/// A run of streams, shared by its tasks.
#[derive(Debug)]
pub struct Plan {
    /// Where the streams go.
    pub target: SocketAddr,
    /// When the first stream opens.
    pub start: Instant,
    /// Streams open evenly over this time.
    pub ramp: Duration,
    /// How many streams.
    pub streams: usize,
    /// Events each stream asks for (the stream is read until [`Plan::stop`] unless it ends
    /// first).
    pub events: u32,
    /// Delays are recorded for events received in `[window_start, window_end)` (nanoseconds
    /// since [`super::wire::base`]; set by the coordinator once every stream is open).
    pub window_start: AtomicU64,
    pub window_end: AtomicU64,
    /// Tells every stream to stop reading and close its connection.
    pub stop: watch::Sender<bool>,
    /// The request, the same for every stream.
    pub request: Vec<u8>,
    /// Streams that received their first event.
    pub opened: AtomicUsize,
    /// Events received so far, by every stream.
    pub received: AtomicU64,
}

impl Plan {
    /// A plan without a window yet.
    pub fn new(
        target: SocketAddr,
        start: Instant,
        ramp: Duration,
        streams: usize,
        events: u32,
    ) -> Self {
        Self {
            target,
            start,
            ramp,
            streams,
            events,
            window_start: AtomicU64::new(u64::MAX),
            window_end: AtomicU64::new(u64::MAX),
            stop: watch::Sender::new(false),
            request: Self::request(events),
            opened: AtomicUsize::new(0),
            received: AtomicU64::new(0),
        }
    }

    /// The request: `POST /v1/chat/completions` with a small JSON body, asking for `events`.
    pub fn request(events: u32) -> Vec<u8> {
        let body = r#"{"model":"bench","stream":true,"max_tokens":256,"messages":[{"role":"user","content":"Say something long."}]}"#;
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n\
             accept: text/event-stream\r\nx-stream-events: {events}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }
}

/// Why a stream failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Failure {
    /// The connection could not be opened.
    Connect,
    /// The request could not be written.
    Write,
    /// The answer was not a 200.
    Status,
    /// The answer could not be parsed.
    Malformed,
    /// The connection ended (or failed) before the body did.
    Cut,
    /// The body ended with fewer events than asked for.
    Short,
    /// No event had come when the run stopped.
    NeverOpened,
}

/// What one stream saw.
#[derive(Debug, Default)]
pub struct StreamOutcome {
    /// Request written to the first byte of the answer.
    pub ttfb: Option<Duration>,
    /// Delays of the events received in the window, in microseconds.
    pub delays_us: Vec<u32>,
    /// Events received.
    pub events: u32,
    pub failure: Option<Failure>,
}

/// Opens stream `index` of `plan` at its time in the ramp and reads it until it ends or the plan
/// says stop.
pub async fn stream(plan: Arc<Plan>, index: usize) -> StreamOutcome {
    let offset = plan.ramp.mul_f64(index as f64 / plan.streams.max(1) as f64);
    let mut stop = plan.stop.subscribe();
    let stopped = stop.wait_for(|stop| *stop);
    tokio::pin!(stopped);
    let mut outcome = StreamOutcome::default();
    let read = read_stream(&plan, offset, &mut outcome, stopped.as_mut()).await;
    outcome.failure = match read {
        Ok(()) if outcome.events == 0 => Some(Failure::NeverOpened),
        Ok(()) => None,
        Err(failure) => Some(failure),
    };
    outcome
}

/// Reads one stream, opened `offset` after the plan's start; `Ok` once it ended whole or
/// `stopped` is ready.
async fn read_stream<F: std::future::Future>(
    plan: &Plan,
    offset: Duration,
    outcome: &mut StreamOutcome,
    mut stopped: std::pin::Pin<&mut F>,
) -> Result<(), Failure> {
    tokio::select! {
        biased;
        _ = stopped.as_mut() => return Ok(()),
        () = tokio::time::sleep_until((plan.start + offset).into()) => {}
    }
    let mut stream = tokio::select! {
        biased;
        _ = stopped.as_mut() => return Ok(()),
        connected = TcpStream::connect(plan.target) => connected.map_err(|_| Failure::Connect)?,
    };
    let _ = stream.set_nodelay(true);
    stream
        .write_all(&plan.request)
        .await
        .map_err(|_| Failure::Write)?;
    let sent = Instant::now();
    let mut buffer = BytesMut::with_capacity(2048);
    // The head.
    let chunked = loop {
        buffer.reserve(1024);
        let read = tokio::select! {
            biased;
            _ = stopped.as_mut() => return Ok(()),
            read = stream.read_buf(&mut buffer) => read,
        };
        if read.map_err(|_| Failure::Cut)? == 0 {
            return Err(Failure::Cut);
        }
        if outcome.ttfb.is_none() {
            outcome.ttfb = Some(sent.elapsed());
        }
        let mut fields = [httparse::EMPTY_HEADER; 32];
        let mut response = httparse::Response::new(&mut fields);
        match response.parse(&buffer) {
            Ok(httparse::Status::Complete(length)) => {
                if response.code != Some(200) {
                    return Err(Failure::Status);
                }
                let chunked = response.headers.iter().any(|field| {
                    field.name.eq_ignore_ascii_case("transfer-encoding")
                        && field.value.eq_ignore_ascii_case(b"chunked")
                });
                buffer.advance(length);
                break chunked;
            }
            Ok(httparse::Status::Partial) if buffer.len() < 64 * 1024 => {}
            _ => return Err(Failure::Malformed),
        }
    };
    if !chunked {
        // Every peer relays the stream chunked; anything else is not what is measured.
        return Err(Failure::Malformed);
    }
    let mut decoder = Chunked::default();
    let mut events = Vec::with_capacity(512);
    let mut received_at = Instant::now();
    loop {
        let used = decoder
            .decode(&buffer, Some(&mut events))
            .map_err(|_| Failure::Malformed)?;
        buffer.advance(used);
        // Complete events: up to each blank line.
        let now_ns = ns_at(received_at);
        let in_window = now_ns >= plan.window_start.load(Ordering::Relaxed)
            && now_ns < plan.window_end.load(Ordering::Relaxed);
        let mut from = 0;
        while let Some(end) = memchr::memmem::find(&events[from..], b"\n\n") {
            let event = &events[from..from + end];
            from += end + 2;
            let stamp = event_stamp(event).ok_or(Failure::Malformed)?;
            if outcome.events == 0 {
                plan.opened.fetch_add(1, Ordering::Relaxed);
            }
            outcome.events += 1;
            plan.received.fetch_add(1, Ordering::Relaxed);
            if in_window {
                let delay = now_ns.saturating_sub(stamp) / 1000;
                outcome
                    .delays_us
                    .push(u32::try_from(delay).unwrap_or(u32::MAX));
            }
        }
        events.drain(..from);
        if decoder.done() {
            break;
        }
        buffer.reserve(1024);
        let read = tokio::select! {
            biased;
            _ = stopped.as_mut() => return Ok(()),
            read = stream.read_buf(&mut buffer) => read,
        };
        if read.map_err(|_| Failure::Cut)? == 0 {
            return Err(Failure::Cut);
        }
        received_at = Instant::now();
    }
    if outcome.events < plan.events {
        return Err(Failure::Short);
    }
    Ok(())
}

/// Sends one `POST /upload` of `body` and waits for its answer: the time from the first byte
/// sent to the end of the answer.
pub async fn upload(target: SocketAddr, body: &[u8]) -> Result<Duration, String> {
    let mut stream = TcpStream::connect(target)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    let head = format!(
        "POST /upload HTTP/1.1\r\nhost: bench\r\ncontent-type: application/octet-stream\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    let start = Instant::now();
    let (mut reader, mut writer) = stream.split();
    let send = async {
        writer.write_all(head.as_bytes()).await?;
        writer.write_all(body).await
    };
    let receive = async {
        let mut buffer = BytesMut::with_capacity(1024);
        loop {
            buffer.reserve(1024);
            if reader.read_buf(&mut buffer).await? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
            }
            let mut fields = [httparse::EMPTY_HEADER; 32];
            let mut response = httparse::Response::new(&mut fields);
            if let Ok(httparse::Status::Complete(length)) = response.parse(&buffer) {
                let code = response.code.unwrap_or(0);
                let content_length: usize = response
                    .headers
                    .iter()
                    .find(|field| field.name.eq_ignore_ascii_case("content-length"))
                    .and_then(|field| std::str::from_utf8(field.value).ok()?.trim().parse().ok())
                    .unwrap_or(0);
                while buffer.len() < length + content_length {
                    buffer.reserve(1024);
                    if reader.read_buf(&mut buffer).await? == 0 {
                        break;
                    }
                }
                return Ok(code);
            }
        }
    };
    let (sent, code) = tokio::join!(send, receive);
    let code = code.map_err(|e| format!("answer: {e}"))?;
    sent.map_err(|e| format!("send: {e}"))?;
    if code != 200 {
        return Err(format!("status {code}"));
    }
    Ok(start.elapsed())
}
