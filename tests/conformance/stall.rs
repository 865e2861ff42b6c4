//! Abort and stall vectors: clients that leave or stop sending (before, during and after the
//! backend's answer) and backends that stop sending, with the timeouts set short. Each checks
//! what the client saw, that the backend connection was closed, and (as every vector does)
//! that nothing stays in flight.

use std::time::Duration;

use crate::harness::*;

const BIG: usize = 2 * 1024 * 1024;

/// A POST head to `path` declaring `length` bytes of body, and the first `sent` of them.
fn partial_upload(path: &str, length: usize, sent: usize) -> Vec<u8> {
    let mut bytes =
        format!("POST {path} HTTP/1.1\r\nHost: a\r\nContent-Length: {length}\r\n\r\n").into_bytes();
    bytes.extend(std::iter::repeat_n(b'b', sent));
    bytes
}

/// Server-sent events: a head, then an event every 50 ms for about three seconds.
fn event_stream() -> Reply {
    let mut pieces = vec![(
        0,
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec(),
    )];
    for n in 0..60 {
        let event = format!("data: {n}\n\n");
        pieces.push((50, format!("{:x}\r\n{event}\r\n", event.len()).into_bytes()));
    }
    Reply::owned(pieces).close()
}

/// A 10 MiB body declared by its length, sent 64 KiB every 20 ms.
fn large_body() -> Reply {
    let mut pieces = vec![(
        0,
        format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
            10 * 1024 * 1024
        )
        .into_bytes(),
    )];
    for _ in 0..160 {
        pieces.push((20, vec![b'z'; 64 * 1024]));
    }
    Reply::owned(pieces)
}

pub fn stalls() -> Vec<Vector> {
    let hundred = "0123456789".repeat(10);
    vec![
        // The client leaves partway through a streamed upload.
        vector(
            "stall-abort-streamed-upload",
            vec![
                send(partial_upload("/x", BIG, 4096)),
                Step::AwaitBackend(1),
                Step::CloseNow,
            ],
        )
        .backend_closed_within(1000),
        // The client leaves partway through a small body (read whole before proxying).
        vector(
            "stall-abort-small-upload",
            vec![send(partial_upload("/x", 100, 10)), Step::Wait(30), Step::CloseNow],
        )
        .nothing(),
        // The client stops sending its body: 408 and the connection closed.
        vector(
            "stall-body-small",
            vec![
                send(partial_upload("/x", 100, 10)),
                Step::Limit(1500),
                expect(resp(408)),
                Step::Closed,
            ],
        )
        .config(|config| config.limits.body_read_timeout = Duration::from_millis(300))
        .nothing(),
        vector(
            "stall-body-streamed",
            vec![
                send(partial_upload("/x", BIG, 10)),
                Step::Limit(1500),
                expect(resp(408)),
                Step::Closed,
            ],
        )
        .config(|config| config.limits.body_read_timeout = Duration::from_millis(300))
        .backend_closed_within(1000),
        vector(
            "stall-body-chunked",
            vec![
                send("POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n0123456789"),
                Step::Limit(1500),
                expect(resp(408)),
                Step::Closed,
            ],
        )
        .config(|config| config.limits.body_read_timeout = Duration::from_millis(300))
        .backend_closed_within(1000),
        // A body that keeps coming, slower than the timeout in total but never idle that long.
        vector(
            "stall-body-slow-progress",
            vec![
                send(partial_upload("/x", 10, 2)),
                Step::Wait(150),
                send("bb"),
                Step::Wait(150),
                send("bb"),
                Step::Wait(150),
                send("bb"),
                Step::Wait(150),
                send("bb"),
                expect(resp(200).body("/x")),
            ],
        )
        .config(|config| config.limits.body_read_timeout = Duration::from_millis(300))
        .requests(vec![req("POST /x HTTP/1.1").body("bbbbbbbbbb")]),
        // The client leaves while the backend prepares its answer.
        vector(
            "stall-client-gone-before-head",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\n\r\n"),
                Step::AwaitBackend(1),
                Step::CloseNow,
            ],
        )
        .script(Script::default().path(
            "/x",
            Reply::owned(vec![(300, b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nLATE".to_vec())]),
        ))
        .backend_closed_within(1000)
        .forbid("LATE"),
        // The client leaves in the middle of an event stream.
        vector(
            "stall-client-gone-mid-stream",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\n\r\n"),
                Step::ReadUntil(b"data: 3".to_vec()),
                Step::CloseNow,
            ],
        )
        .script(Script::default().path("/x", event_stream()))
        .backend_closed_within(1000),
        // The client leaves partway through a large body.
        vector(
            "stall-client-gone-mid-body",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\n\r\n"),
                Step::ReadUntil(b"zzzz".to_vec()),
                Step::CloseNow,
            ],
        )
        .script(Script::default().path("/x", large_body()))
        .backend_closed_within(1000),
        // The backend stops sending partway through a body.
        vector(
            "stall-upstream-idle-length",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\n\r\n"),
                Step::Limit(1500),
                expect(resp(200).truncated(&hundred)),
                Step::Closed,
            ],
        )
        .script(Script::default().path(
            "/x",
            Reply::raw(format!("HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{}", &hundred[..10]))
                .hold(),
        ))
        .config(|config| config.upstream.idle_timeout = Some(Duration::from_millis(300)))
        .backend_closed_within(1000),
        vector(
            "stall-upstream-idle-chunked",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\n\r\n"),
                Step::Limit(1500),
                expect(resp(200).truncated(&hundred)),
                Step::Closed,
            ],
        )
        .script(Script::default().path(
            "/x",
            Reply::raw(format!(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\na\r\n{}\r\n",
                &hundred[..10]
            ))
            .hold(),
        ))
        .config(|config| config.upstream.idle_timeout = Some(Duration::from_millis(300)))
        .backend_closed_within(1000),
        // The backend sends nothing: 504, and its connection is not used again.
        vector(
            "stall-first-byte",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\n\r\n"),
                Step::Limit(1500),
                expect(resp(504)),
            ],
        )
        .script(Script::default().path("/x", Reply::silent()))
        .config(|config| config.upstream.first_byte_timeout = Some(Duration::from_millis(300)))
        .backend_closed_within(1000),
        // The backend answers after the router gave up: the late answer reaches nobody.
        vector(
            "stall-first-byte-late-answer",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\n\r\n"),
                Step::Limit(1500),
                expect(resp(504)),
            ],
        )
        .script(Script::default().path(
            "/x",
            Reply::owned(vec![(600, b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nLATE".to_vec())]),
        ))
        .config(|config| config.upstream.first_byte_timeout = Some(Duration::from_millis(300)))
        .forbid("LATE"),
        // A partial head, then nothing. nginx closes without an answer; a 408 first is as safe.
        vector(
            "stall-header-partial",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\n"),
                Step::Limit(1500),
                Step::ClosedOr(408),
            ],
        )
        .config(|config| config.limits.header_read_timeout = Duration::from_millis(300))
        .nothing(),
        vector(
            "stall-header-idle-keep-alive",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\n\r\n"),
                expect(resp(200).body("/x")),
                Step::Limit(1500),
                Step::ClosedOr(408),
            ],
        )
        .config(|config| config.limits.header_read_timeout = Duration::from_millis(300))
        .requests(vec![req("GET /x HTTP/1.1")]),
    ]
}
