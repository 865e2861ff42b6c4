//! The in-process backend: answers any request with a server-sent event stream, and
//! `POST /upload` by reading the body to its end and answering 200.
//!
//! A stream is `200`, `content-type: text/event-stream`, `transfer-encoding: chunked`; its
//! first event goes out with the head, then one every `interval` (deadlines counted from the
//! first, so timer slack does not accumulate), each event one chunk of about `event_bytes`
//! bytes carrying its send stamp ([`super::wire::stamp_ns`]), then the last chunk. The number
//! of events is the request's `x-stream-events` field. Connections are kept alive.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::wire::{Chunked, append_event, stamp_ns};

/// What a stream looks like.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Time between two events.
    pub interval: Duration,
    /// Size of one event's payload.
    pub event_bytes: usize,
}

/// Listens on a free loopback port and serves every connection in its own task, on a thread of
/// its own (a current-thread runtime), so that the backend and the clients each have a thread.
pub fn start(shape: Shape) -> io::Result<SocketAddr> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let addr = socket.local_addr()?;
    std::thread::Builder::new()
        .name("backend".to_owned())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("backend runtime");
            runtime.block_on(async move {
                // As many waiting connections as the system allows (`somaxconn`).
                let listener = socket.listen(8192).expect("backend listener");
                loop {
                    match listener.accept().await {
                        Ok((stream, _)) => {
                            let _ = stream.set_nodelay(true);
                            tokio::spawn(serve(stream, shape));
                        }
                        // Out of descriptors, say: try again shortly.
                        Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                    }
                }
            });
        })?;
    Ok(addr)
}

/// A request head, as far as the backend cares.
struct Request {
    upload: bool,
    events: u32,
    body: Body,
    close: bool,
}

enum Body {
    Length(u64),
    Chunked,
}

async fn serve(mut stream: TcpStream, shape: Shape) {
    let mut buffer = BytesMut::with_capacity(1024);
    while let Ok(Some(request)) = read_request(&mut stream, &mut buffer).await {
        if discard_body(&mut stream, &mut buffer, &request.body)
            .await
            .is_err()
        {
            return;
        }
        let answered = if request.upload {
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
        } else {
            send_events(&mut stream, request.events, shape).await
        };
        if answered.is_err() || request.close {
            return;
        }
    }
}

/// Reads the next request head; `None` at the end of the connection.
async fn read_request(
    stream: &mut TcpStream,
    buffer: &mut BytesMut,
) -> io::Result<Option<Request>> {
    loop {
        if !buffer.is_empty() {
            let mut fields = [httparse::EMPTY_HEADER; 32];
            let mut request = httparse::Request::new(&mut fields);
            match request.parse(buffer) {
                Ok(httparse::Status::Complete(length)) => {
                    let mut parsed = Request {
                        upload: request.path.is_some_and(|path| path.starts_with("/upload")),
                        events: 1,
                        body: Body::Length(0),
                        close: false,
                    };
                    for field in request.headers.iter() {
                        let value = std::str::from_utf8(field.value).unwrap_or("").trim();
                        if field.name.eq_ignore_ascii_case("content-length") {
                            parsed.body = Body::Length(value.parse().unwrap_or(0));
                        } else if field.name.eq_ignore_ascii_case("transfer-encoding") {
                            parsed.body = Body::Chunked;
                        } else if field.name.eq_ignore_ascii_case("x-stream-events") {
                            parsed.events = value.parse().unwrap_or(1).max(1);
                        } else if field.name.eq_ignore_ascii_case("connection") {
                            parsed.close = value.eq_ignore_ascii_case("close");
                        }
                    }
                    buffer.advance(length);
                    return Ok(Some(parsed));
                }
                Ok(httparse::Status::Partial) if buffer.len() < 64 * 1024 => {}
                _ => return Err(io::Error::new(io::ErrorKind::InvalidData, "bad request")),
            }
        }
        buffer.reserve(1024);
        if stream.read_buf(buffer).await? == 0 {
            return Ok(None);
        }
    }
}

/// Reads a request body and drops it.
async fn discard_body(
    stream: &mut TcpStream,
    buffer: &mut BytesMut,
    body: &Body,
) -> io::Result<()> {
    match *body {
        Body::Length(mut left) => {
            let taken = buffer
                .len()
                .min(usize::try_from(left).unwrap_or(usize::MAX));
            buffer.advance(taken);
            left -= taken as u64;
            if left == 0 {
                return Ok(());
            }
            let mut scratch = vec![0u8; 64 * 1024];
            while left > 0 {
                let wanted = scratch
                    .len()
                    .min(usize::try_from(left).unwrap_or(usize::MAX));
                let read = stream.read(&mut scratch[..wanted]).await?;
                if read == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                left -= read as u64;
            }
            Ok(())
        }
        Body::Chunked => {
            let mut decoder = Chunked::default();
            loop {
                let used = decoder
                    .decode(buffer, None)
                    .map_err(|message| io::Error::new(io::ErrorKind::InvalidData, message))?;
                buffer.advance(used);
                if decoder.done() {
                    return Ok(());
                }
                buffer.reserve(16 * 1024);
                if stream.read_buf(buffer).await? == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
            }
        }
    }
}

/// Writes the stream's head and its `events` events, then the last chunk.
async fn send_events(stream: &mut TcpStream, events: u32, shape: Shape) -> io::Result<()> {
    let start = tokio::time::Instant::now();
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n\
          transfer-encoding: chunked\r\n\r\n",
    );
    for index in 0..events {
        if index > 0 {
            tokio::time::sleep_until(start + shape.interval * index).await;
            out.clear();
        }
        append_event(&mut out, stamp_ns(), index, shape.event_bytes);
        stream.write_all(&out).await?;
    }
    stream.write_all(b"0\r\n\r\n").await
}
