//! The HTTP/2 (h2c) inbound side at its edges: a window never opened, an answer h2 buffers
//! that the client never takes, a client that never acks the GOAWAY's PING (idle or at the
//! drain), rapid reset after dispatch and in one write, the concurrent-stream limit, and cookie crumbs against the field
//! limit. Raw frames over a loopback socket; every wait is bounded.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::h2_frames::*;
use common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;

/// A header block of literal fields without indexing, new names, no Huffman coding.
fn block(fields: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        out.push(0x00);
        integer(&mut out, name.len());
        out.extend_from_slice(name);
        integer(&mut out, value.len());
        out.extend_from_slice(value);
    }
    out
}

fn integer(out: &mut Vec<u8>, mut value: usize) {
    if value < 127 {
        out.push(value as u8);
        return;
    }
    out.push(127);
    value -= 127;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

fn get_block(path: &str) -> Vec<u8> {
    block(&[
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":authority", b"router.test"),
        (b":path", path.as_bytes()),
    ])
}

fn settings(pairs: &[(u16, u32)]) -> Vec<u8> {
    let mut payload = Vec::new();
    for (id, value) in pairs {
        payload.extend_from_slice(&id.to_be_bytes());
        payload.extend_from_slice(&value.to_be_bytes());
    }
    payload
}

/// A raw h2c client.
struct H2 {
    stream: TcpStream,
    read: Vec<u8>,
    /// Whether the client answers the router's PINGs.
    ack_pings: bool,
}

impl H2 {
    async fn connect(router: &TestRouter, client_settings: &[(u16, u32)]) -> Self {
        let mut stream = TcpStream::connect(router.addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let mut start = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        start.extend_from_slice(&frame(SETTINGS, 0, 0, &settings(client_settings)));
        stream.write_all(&start).await.unwrap();
        Self {
            stream,
            read: Vec::new(),
            ack_pings: true,
        }
    }

    async fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> bool {
        self.stream
            .write_all(&frame(kind, flags, stream, payload))
            .await
            .is_ok()
    }

    async fn get(&mut self, stream: u32, path: &str) {
        assert!(
            self.send(HEADERS, END_HEADERS | END_STREAM, stream, &get_block(path))
                .await
        );
    }

    /// The next frame (SETTINGS acked, PINGs acked if `ack_pings`); `None` once closed.
    async fn frame(&mut self) -> Option<(u8, u8, u32, Vec<u8>)> {
        loop {
            if let Some((kind, flags, stream, payload)) = take_frame(&mut self.read) {
                if kind == SETTINGS && flags & ACK == 0 {
                    self.send(SETTINGS, ACK, 0, &[]).await;
                }
                if kind == PING && flags & ACK == 0 && self.ack_pings {
                    self.send(PING, ACK, 0, &payload).await;
                }
                return Some((kind, flags, stream, payload));
            }
            let mut chunk = [0u8; 16 * 1024];
            match self.stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(read) => self.read.extend_from_slice(&chunk[..read]),
            }
        }
    }

    /// The HEADERS frame of stream `id`'s answer, within 5 s.
    async fn answer_head(&mut self, id: u32) -> Option<(u8, u8, u32, Vec<u8>)> {
        self.until(Duration::from_secs(5), |kind, _, stream, _| {
            kind == HEADERS && stream == id
        })
        .await
    }

    /// Reads frames until `stop` says so (returns that frame) or `limit` passes (`None`, also
    /// when the connection closed).
    async fn until(
        &mut self,
        limit: Duration,
        mut stop: impl FnMut(u8, u8, u32, &[u8]) -> bool,
    ) -> Option<(u8, u8, u32, Vec<u8>)> {
        tokio::time::timeout(limit, async {
            loop {
                let (kind, flags, stream, payload) = self.frame().await?;
                if stop(kind, flags, stream, &payload) {
                    return Some((kind, flags, stream, payload));
                }
            }
        })
        .await
        .ok()
        .flatten()
    }

    /// Reads (and discards) frames until the connection closes; `true` if it did within `limit`.
    async fn closed_within(&mut self, limit: Duration) -> bool {
        tokio::time::timeout(limit, async { while self.frame().await.is_some() {} })
            .await
            .is_ok()
    }
}

fn in_flight_series(backend: &FakeBackend) -> String {
    format!(
        "custom_router_backend_inflight_requests{{addr=\"{}\"}}",
        backend.host_port()
    )
}

/// A backend: `/stream` is an endless answer, `/small` 10 KB, anything else `ok`.
async fn mixed_backend() -> FakeBackend {
    spawn_backend(|request| async move {
        match request.uri().path() {
            "/stream" => {
                let (sender, body) = channel_body();
                tokio::spawn(async move {
                    let chunk = Bytes::from(vec![b'x'; 16 * 1024]);
                    while sender.send(chunk.clone()).await.is_ok() {}
                });
                http::Response::new(body)
            }
            "/small" => respond(StatusCode::OK, vec![b's'; 10 * 1024]),
            "/tiny" => respond(StatusCode::OK, vec![b't'; 200]),
            "/slow" => {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                respond(StatusCode::OK, "slow")
            }
            _ => respond(StatusCode::OK, "ok"),
        }
    })
    .await
}

async fn router_for(
    backend: &FakeBackend,
    tune: impl FnOnce(&mut custom_router::config::Config),
) -> TestRouter {
    let mut config = with_strategy("round-robin");
    config.limits.send_timeout = Duration::from_millis(500);
    tune(&mut config);
    let router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    router
}

// ---------------------------------------------------------------------------------------------
// Send stall: a window that is zero before the answer's first frame.

/// A client that advertises SETTINGS_INITIAL_WINDOW_SIZE = 0 and never opens a stream's window
/// trips the send watch, because hyper polls the answer's first frame before it waits for
/// capacity (so the `Watched` clock starts): a guard for a hyper upgrade that reserved capacity
/// first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_stream_window_from_the_start_gives_the_backend_slot_back_at_the_send_timeout() {
    let backend = mixed_backend().await;
    let router = router_for(&backend, |_| {}).await;
    let series = in_flight_series(&backend);
    let mut h2 = H2::connect(&router, &[(SETTINGS_INITIAL_WINDOW_SIZE, 0)]).await;
    h2.get(1, "/stream").await;
    let head = h2.answer_head(1).await;
    assert!(head.is_some(), "the answer's head arrives");
    assert_eq!(metric(&router, &series).await, 1.0);
    // send_timeout is 0.5 s: give it ten times that.
    let released = eventually(Duration::from_secs(5), async || {
        metric(&router, &series).await == 0.0
    })
    .await;
    assert!(
        released,
        "a stream whose window was zero from the start holds its backend past send_timeout"
    );
}

/// A 200-byte answer yielded in one frame that is also its end is handed to h2, which buffers
/// what the window (1 byte, never opened) does not take: the watch sees the stream ended. The
/// connection is told GOAWAY when idle and, with no stream open, dropped after the grace,
/// rather than held (with its `max_connections` slot) until the bytes go out: never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_buffered_in_h2_that_the_client_never_takes_does_not_hold_the_connection() {
    let backend = mixed_backend().await;
    let router = router_for(&backend, |config| {
        config.limits.header_read_timeout = Duration::from_millis(500);
        config.max_connections = custom_router::forms::Count::Fixed(1);
    })
    .await;
    let mut h2 = H2::connect(&router, &[(SETTINGS_INITIAL_WINDOW_SIZE, 1)]).await;
    h2.get(1, "/tiny").await;
    let head = h2.answer_head(1).await;
    assert!(head.is_some(), "the answer's head arrives");
    // send_timeout and header_read_timeout are 0.5 s.
    let closed = h2.closed_within(Duration::from_secs(6)).await;
    assert!(
        closed,
        "the connection whose answer the client never takes is still open"
    );
}

// ---------------------------------------------------------------------------------------------
// Idle connections: GOAWAY, then waiting forever for a PING ack.

/// A client that sends the 24-byte HTTP/2 preface and then nothing (it never reads, so never
/// acks the GOAWAY's PING) loses its `max_connections` slot: told GOAWAY at
/// `header_read_timeout`, it is dropped after the grace. Here `max_connections = 1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_client_that_sends_only_the_preface_loses_its_slot() {
    let backend = mixed_backend().await;
    let router = router_for(&backend, |config| {
        config.limits.header_read_timeout = Duration::from_millis(500);
        config.max_connections = custom_router::forms::Count::Fixed(1);
    })
    .await;
    let mut silent = TcpStream::connect(router.addr).await.unwrap();
    silent
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let served = tokio::time::timeout(Duration::from_secs(8), get(&router.url("/ok"))).await;
    assert!(
        matches!(&served, Ok((StatusCode::OK, body)) if body == "ok"),
        "another client is not served {:?} after a preface-only h2c connection took the slot",
        started.elapsed()
    );
    drop(silent);
}

/// At the drain, an idle h2c connection that does not answer PINGs is dropped after the grace,
/// not waited for until `shutdown.timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_does_not_wait_for_an_idle_h2c_connection_that_ignores_pings() {
    let backend = mixed_backend().await;
    let mut router = router_for(&backend, |_| {}).await;
    let mut h2 = H2::connect(&router, &[]).await;
    h2.ack_pings = false;
    // The handshake is done (the router's SETTINGS came).
    let settings = h2
        .until(Duration::from_secs(5), |kind, _, _, _| kind == SETTINGS)
        .await;
    assert!(settings.is_some());
    let reader = tokio::spawn(async move { h2.closed_within(Duration::from_secs(20)).await });
    let started = Instant::now();
    let task = router.begin_shutdown();
    let finished = tokio::time::timeout(Duration::from_secs(5), task).await;
    reader.abort();
    assert!(
        finished.is_ok(),
        "the drain still waits on an idle h2c connection after {:?}",
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------------------------
// Rapid reset and stream limits.

/// CVE-2023-44487 shape: HEADERS then RST_STREAM, each reset after the request was dispatched.
/// A connection is told GOAWAY after 1000 streams (nginx's `keepalive_requests`) and dropped if
/// it opens as many again (it never read the GOAWAY), so one connection cannot dispatch
/// requests to backends without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_after_dispatch_is_capped_per_connection() {
    let backend = mixed_backend().await;
    let router = router_for(&backend, |_| {}).await;
    let mut h2 = H2::connect(&router, &[]).await;
    let started = Instant::now();
    let mut ended = false;
    for (sent, id) in (0..3000u32).map(|n| 1 + 2 * n).enumerate() {
        let headers = frame(HEADERS, END_HEADERS | END_STREAM, id, &get_block("/slow"));
        if h2.stream.write_all(&headers).await.is_err() {
            ended = true;
            break;
        }
        // Let the router accept and dispatch it, then cancel.
        let dispatched = tokio::time::timeout(Duration::from_millis(500), async {
            while backend.hits() < sent + 1 {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        })
        .await;
        let reset = frame(RST_STREAM, 0, id, &CANCEL.to_be_bytes());
        if h2.stream.write_all(&reset).await.is_err() || dispatched.is_err() {
            // Refused, or the connection ended.
            ended = true;
            break;
        }
        if started.elapsed() > Duration::from_secs(20) {
            break;
        }
    }
    let hits = backend.hits();
    assert!(
        ended && hits <= 2000,
        "{hits} reset streams reached the backend over one connection (ended: {ended})"
    );
}

/// HEADERS + RST_STREAM pairs blasted in one write (the reset reaches h2 before hyper accepts
/// the stream): h2's pending-accept reset limit ends the connection with
/// GOAWAY(ENHANCE_YOUR_CALM) after a few, and none reach the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_in_one_write_ends_the_connection_with_enhance_your_calm() {
    let backend = mixed_backend().await;
    let router = router_for(&backend, |_| {}).await;
    let mut h2 = H2::connect(&router, &[]).await;
    let mut all = Vec::new();
    for n in 0..5000u32 {
        let id = 1 + 2 * n;
        all.extend(frame(
            HEADERS,
            END_HEADERS | END_STREAM,
            id,
            &get_block("/slow"),
        ));
        all.extend(frame(RST_STREAM, 0, id, &CANCEL.to_be_bytes()));
    }
    let wrote = h2.stream.write_all(&all).await;
    let goaway = h2
        .until(Duration::from_secs(5), |kind, _, _, _| kind == GOAWAY)
        .await;
    let _ = wrote;
    let goaway = goaway.expect("GOAWAY");
    assert_eq!(u32::from_be_bytes(goaway.3[4..8].try_into().unwrap()), 0xb);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        backend.hits() <= 25,
        "{} reached the backend",
        backend.hits()
    );
}

/// A connection may hold 128 streams open at once (nginx's `http2_max_concurrent_streams`): the
/// router says so in its SETTINGS, and a 129th concurrent stream is refused with
/// `REFUSED_STREAM` (safe for the client to retry) without reaching a backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_holds_at_most_128_streams_at_once() {
    const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
    const REFUSED_STREAM: u32 = 0x7;
    let backend = mixed_backend().await;
    let router = router_for(&backend, |_| {}).await;
    let mut h2 = H2::connect(&router, &[]).await;
    let (_, _, _, payload) = h2
        .until(Duration::from_secs(5), |kind, flags, _, _| {
            kind == SETTINGS && flags & ACK == 0
        })
        .await
        .expect("the router's SETTINGS");
    let advertised = payload.chunks(6).find_map(|pair| {
        (u16::from_be_bytes([pair[0], pair[1]]) == SETTINGS_MAX_CONCURRENT_STREAMS)
            .then(|| u32::from_be_bytes([pair[2], pair[3], pair[4], pair[5]]))
    });
    assert_eq!(advertised, Some(128));
    let mut all = Vec::new();
    for n in 0..129u32 {
        all.extend(frame(
            HEADERS,
            END_HEADERS | END_STREAM,
            1 + 2 * n,
            &get_block("/slow"),
        ));
    }
    h2.stream.write_all(&all).await.unwrap();
    let last = 1 + 2 * 128;
    let reset = h2
        .until(Duration::from_secs(5), |kind, _, stream, _| {
            kind == RST_STREAM && stream == last
        })
        .await
        .expect("the 129th stream is reset");
    assert_eq!(
        u32::from_be_bytes(reset.3[..4].try_into().unwrap()),
        REFUSED_STREAM
    );
    let mut answered = 0;
    while answered < 128 {
        let found = h2
            .until(Duration::from_secs(10), |kind, _, _, _| kind == HEADERS)
            .await;
        assert!(found.is_some(), "{answered} of 128 streams answered");
        answered += 1;
    }
    assert_eq!(backend.hits(), 128);
    // Canary: a fresh connection is served.
    let mut fresh = H2::connect(&router, &[]).await;
    fresh.get(1, "/tiny").await;
    let head = fresh
        .answer_head(1)
        .await
        .expect("an answer on a fresh connection");
    assert_eq!(status(&head.3), 200);
}

/// Cookies split into crumbs (RFC 9113 §8.2.3) are one field against the field limit: 150
/// crumbs are one `Cookie` line for the backend, as 150 cookies in one HTTP/1 line are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cookie_crumbs_count_as_one_field_against_the_field_limit() {
    let backend = mixed_backend().await;
    let router = router_for(&backend, |_| {}).await;
    // Over HTTP/1, 150 cookies in one line: accepted.
    let line: Vec<String> = (0..150).map(|n| format!("c{n}=v")).collect();
    let mut http1 = TcpStream::connect(router.addr).await.unwrap();
    http1
        .write_all(
            format!(
                "GET /cookies HTTP/1.1\r\nhost: x\r\ncookie: {}\r\nconnection: close\r\n\r\n",
                line.join("; ")
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), http1.read_to_end(&mut answer)).await;
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
    // Over HTTP/2, the same cookies as crumbs.
    let owned: Vec<Vec<u8>> = (0..150).map(|n| format!("c{n}=v").into_bytes()).collect();
    let mut fields: Vec<(&[u8], &[u8])> = vec![
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":authority", b"router.test"),
        (b":path", b"/cookies"),
    ];
    for crumb in &owned {
        fields.push((b"cookie", crumb));
    }
    let mut h2 = H2::connect(&router, &[]).await;
    assert!(
        h2.send(HEADERS, END_HEADERS | END_STREAM, 1, &block(&fields))
            .await
    );
    let head = h2.answer_head(1).await.expect("an answer");
    assert_eq!(
        status(&head.3),
        200,
        "150 cookie crumbs refused over HTTP/2"
    );
}
