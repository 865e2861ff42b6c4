//! The client side on scripted bytes: each test plays the backend at the far end of an in-memory
//! pipe, reads exactly what the client wrote and answers byte for byte.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use http_body::Frame;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::time::Instant;

use super::{Connection, OutgoingFields, OutgoingHead, ResponseStream, SendError, Transport};
use crate::h1::idle::IdleConnections;
use crate::h1::{BoxError, OutgoingBody};

/// The router's end of an in-memory pipe, split into its two sides.
struct Pipe {
    reader: tokio::io::ReadHalf<DuplexStream>,
    writer: tokio::io::WriteHalf<DuplexStream>,
}

impl AsyncRead for Pipe {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().reader).poll_read(cx, buf)
    }
}

impl AsyncWrite for Pipe {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().writer).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().writer).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().writer).poll_shutdown(cx)
    }
}

impl Transport for Pipe {
    type Reader<'a> = &'a mut tokio::io::ReadHalf<DuplexStream>;
    type Writer<'a> = &'a mut tokio::io::WriteHalf<DuplexStream>;

    fn split(&mut self) -> (Self::Reader<'_>, Self::Writer<'_>) {
        (&mut self.reader, &mut self.writer)
    }
}

/// A client connection over a pipe whose buffer holds `capacity` bytes, and the backend's end.
fn pipe(capacity: usize) -> (Connection<Pipe>, DuplexStream) {
    let (near, far) = tokio::io::duplex(capacity);
    let (reader, writer) = tokio::io::split(near);
    (Connection::new(Pipe { reader, writer }), far)
}

/// A request body: whole in memory, or frames handed over one by one (`None` = still to come).
enum TestBody {
    Whole(Option<Bytes>),
    Frames(VecDeque<Option<Result<Bytes, &'static str>>>),
}

impl OutgoingBody for TestBody {
    fn is_whole(&self) -> bool {
        matches!(self, TestBody::Whole(_))
    }

    fn in_memory(&self) -> Option<&Bytes> {
        match self {
            TestBody::Whole(bytes) => bytes.as_ref(),
            TestBody::Frames(_) => None,
        }
    }
}

impl http_body::Body for TestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            TestBody::Whole(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            TestBody::Frames(frames) => match frames.pop_front() {
                None => Poll::Ready(None),
                // A frame that never comes: the body stalls.
                Some(None) => {
                    frames.push_front(None);
                    Poll::Pending
                }
                Some(Some(Ok(data))) => Poll::Ready(Some(Ok(Frame::data(data)))),
                Some(Some(Err(error))) => Poll::Ready(Some(Err(error.into()))),
            },
        }
    }
}

fn head<'a>(method: &'a Method, target: &'a str, headers: &'a HeaderMap) -> OutgoingHead<'a> {
    OutgoingHead {
        method,
        target,
        fields: OutgoingFields::Map(headers),
        host: Some("backend"),
    }
}

/// Reads from the backend's end until `expected` bytes came, and checks them.
async fn expect_request(far: &mut DuplexStream, expected: &[u8]) {
    let mut got = vec![0; expected.len()];
    far.read_exact(&mut got).await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&got),
        String::from_utf8_lossy(expected)
    );
}

/// The whole body, or the error that ended it.
async fn collect(response: &mut ResponseStream<Pipe>) -> Result<Vec<u8>, std::io::Error> {
    let mut body = Vec::new();
    while let Some(frame) =
        std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut *response), cx)).await
    {
        if let Ok(data) = frame?.into_data() {
            body.extend_from_slice(&data);
        }
    }
    Ok(body)
}

#[tokio::test]
async fn a_request_goes_out_byte_for_byte_and_the_connection_comes_back_after_the_body() {
    let (connection, mut far) = pipe(4096);
    let headers = HeaderMap::from_iter([(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    )]);
    let body = TestBody::Whole(Some(Bytes::from_static(b"{\"a\":1}")));
    let backend = async {
        expect_request(
            &mut far,
            b"POST /v1/x HTTP/1.1\r\nhost: backend\r\ncontent-type: application/json\r\n\
              content-length: 7\r\n\r\n{\"a\":1}",
        )
        .await;
        // The answer in three segments, split inside the head and inside the body.
        for part in [
            &b"HTTP/1.1 200 OK\r\ncontent-le"[..],
            b"ngth: 5\r\nx-a: 1\r\n\r\nhel",
            b"lo",
        ] {
            far.write_all(part).await.unwrap();
            tokio::task::yield_now().await;
        }
        far
    };
    let client = async {
        let method = Method::POST;
        let request = head(&method, "/v1/x", &headers);
        let sent = connection.send(&request, body, None);
        let mut response = sent.await.map_err(|_| "send failed").unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let lines = response.body().passthrough().expect("lines").lines.clone();
        assert_eq!(&lines[..], b"x-a: 1\r\n");
        assert_eq!(collect(response.body_mut()).await.unwrap(), b"hello");
        response.body_mut().take_connection()
    };
    let (mut far, connection) = tokio::join!(backend, client);
    let mut connection = connection.expect("reusable");
    assert!(connection.is_clean());
    // Idle, it holds neither buffer: both are back with the thread.
    assert_eq!(
        (connection.read.capacity(), connection.write.capacity()),
        (0, 0)
    );

    // The same connection carries the next exchange.
    let headers = HeaderMap::new();
    let backend = async {
        expect_request(&mut far, b"GET /next HTTP/1.1\r\nhost: backend\r\n\r\n").await;
        far.write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
            .await
            .unwrap();
        far
    };
    let client = async {
        let method = Method::GET;
        let request = head(&method, "/next", &headers);
        let sent = connection.send(&request, TestBody::Whole(None), None);
        let mut response = sent.await.map_err(|_| "send failed").unwrap();
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        response.body_mut().take_connection()
    };
    let (_far, connection) = tokio::join!(backend, client);
    assert!(connection.is_some(), "a 204 has no body to wait for");
}

#[tokio::test]
async fn a_clients_lines_go_out_as_they_are_then_the_fields_the_caller_appends() {
    // The lines hold a length: no other is added. The fields after them are whatever the
    // caller names, in its order.
    for appended in [
        vec![
            (
                HeaderName::from_static("x-chain"),
                HeaderValue::from_static("10.0.0.1, 10.0.0.2"),
            ),
            (
                HeaderName::from_static("x-scheme"),
                HeaderValue::from_static("http"),
            ),
        ],
        vec![(
            HeaderName::from_static("x-trace"),
            HeaderValue::from_static("t1"),
        )],
        vec![],
    ] {
        let (connection, mut far) = pipe(4096);
        let mut expected =
            b"POST /v1 HTTP/1.1\r\nHost: front\r\nContent-Length: 2\r\nX-Id: 7\r\n".to_vec();
        for (name, value) in &appended {
            expected.extend_from_slice(format!("{name}: ").as_bytes());
            expected.extend_from_slice(value.as_bytes());
            expected.extend_from_slice(b"\r\n");
        }
        expected.extend_from_slice(b"\r\nhi");
        let backend = async {
            expect_request(&mut far, &expected).await;
            far.write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
                .await
                .unwrap();
            far
        };
        let client = async {
            let method = Method::POST;
            let request = OutgoingHead {
                method: &method,
                target: "/v1",
                fields: OutgoingFields::Lines {
                    lines: b"Host: front\r\nContent-Length: 2\r\nX-Id: 7\r\n",
                    appended: &appended,
                    has_content_length: true,
                },
                host: None,
            };
            let body = TestBody::Whole(Some(Bytes::from_static(b"hi")));
            let sent = connection.send(&request, body, None);
            let mut response = sent.await.map_err(|_| "send failed").unwrap();
            assert_eq!(response.status(), StatusCode::NO_CONTENT);
            response.body_mut().take_connection()
        };
        let (_far, connection) = tokio::join!(backend, client);
        assert!(connection.is_some());
    }
}

#[tokio::test]
async fn bytes_after_the_response_or_while_idle_keep_the_connection_from_reuse() {
    // A byte past the announced length arrives with the response.
    let (connection, mut far) = pipe(4096);
    let headers = HeaderMap::new();
    far.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n")
        .await
        .unwrap();
    let method = Method::GET;
    let request = head(&method, "/", &headers);
    let sent = connection.send(&request, TestBody::Whole(None), None);
    let mut response = sent.await.map_err(|_| "send failed").unwrap();
    assert_eq!(collect(response.body_mut()).await.unwrap(), b"ok");
    assert!(
        response.body_mut().take_connection().is_none(),
        "a smuggled second response must not answer the next request"
    );

    // Clean at return, then the backend speaks (or leaves) while the connection is idle.
    for backend_then in [&b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"[..], b""] {
        let (connection, mut far) = pipe(4096);
        far.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .await
            .unwrap();
        let request = head(&method, "/", &headers);
        let sent = connection.send(&request, TestBody::Whole(None), None);
        let mut response = sent.await.map_err(|_| "send failed").unwrap();
        let connection = response.body_mut().take_connection().expect("reusable");
        let idle = IdleConnections::default();
        idle.put(connection, Instant::now());
        assert_eq!(idle.len(), 1);
        if backend_then.is_empty() {
            drop(far);
        } else {
            far.write_all(backend_then).await.unwrap();
        }
        assert!(idle.checkout().is_none(), "{backend_then:?}");
        assert!(idle.is_empty());
    }
}

#[tokio::test]
async fn a_connection_the_backend_closed_hands_the_request_back_unsent() {
    let (connection, far) = pipe(4096);
    drop(far);
    let headers = HeaderMap::new();
    let method = Method::POST;
    let body = TestBody::Whole(Some(Bytes::from_static(b"payload")));
    let request = head(&method, "/", &headers);
    match connection.send(&request, body, None).await {
        Err(SendError::Unsent(TestBody::Whole(Some(bytes)))) => assert_eq!(&bytes[..], b"payload"),
        Err(SendError::Unsent(_)) => panic!("the body was consumed"),
        Err(_) | Ok(_) => panic!("expected the request back unsent"),
    }
}

#[tokio::test]
async fn a_chunked_answer_in_single_bytes_is_decoded_with_its_trailers() {
    let (connection, mut far) = pipe(4096);
    let headers = HeaderMap::new();
    let answer =
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
                   5;ext=1\r\nhello\r\n1\r\n!\r\n0\r\nx-checksum: 9\r\n\r\n";
    let backend = async {
        for byte in answer {
            far.write_all(&[*byte]).await.unwrap();
            tokio::task::yield_now().await;
        }
        far
    };
    let client = async {
        let method = Method::GET;
        let request = head(&method, "/", &headers);
        let sent = connection.send(&request, TestBody::Whole(None), None);
        let mut response = sent.await.map_err(|_| "send failed").unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let mut body = Vec::new();
        let mut trailers = None;
        while let Some(frame) = std::future::poll_fn(|cx| {
            http_body::Body::poll_frame(Pin::new(response.body_mut()), cx)
        })
        .await
        {
            match frame.unwrap().into_data() {
                Ok(data) => body.extend_from_slice(&data),
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        assert_eq!(body, b"hello!");
        assert_eq!(trailers.expect("trailers")["x-checksum"], "9");
        response.body_mut().take_connection().is_some()
    };
    let (_far, reusable) = tokio::join!(backend, client);
    assert!(reusable);
}

#[tokio::test]
async fn a_streamed_body_goes_out_chunked_and_an_early_answer_ends_reuse() {
    let (connection, mut far) = pipe(4096);
    let headers = HeaderMap::new();
    let body = TestBody::Frames(VecDeque::from([
        Some(Ok(Bytes::from_static(b"abc"))),
        Some(Ok(Bytes::from_static(b"de"))),
    ]));
    let backend = async {
        expect_request(
            &mut far,
            b"PUT /u HTTP/1.1\r\nhost: backend\r\ntransfer-encoding: chunked\r\n\r\n\
              3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .await;
        far.write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n")
            .await
            .unwrap();
        far
    };
    let client = async {
        let method = Method::PUT;
        let request = head(&method, "/u", &headers);
        let sent = connection.send(&request, body, None);
        let mut response = sent.await.map_err(|_| "send failed").unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        response.body_mut().take_connection().is_some()
    };
    let (mut far, reusable) = tokio::join!(backend, client);
    assert!(reusable);
    drop(far.read(&mut [0; 1]));

    // The backend answers 413 before the body ends (the body's next frame never comes).
    let (connection, mut far) = pipe(4096);
    let body = TestBody::Frames(VecDeque::from([Some(Ok(Bytes::from_static(b"abc"))), None]));
    let backend = async {
        expect_request(
            &mut far,
            b"PUT /u HTTP/1.1\r\nhost: backend\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n",
        )
        .await;
        far.write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\n\r\n")
            .await
            .unwrap();
        far
    };
    let client = async {
        let method = Method::PUT;
        let request = head(&method, "/u", &headers);
        let sent = connection.send(&request, body, None);
        let mut response = sent.await.map_err(|_| "send failed").unwrap();
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        response.body_mut().take_connection().is_some()
    };
    let (_far, reusable) = tokio::join!(backend, client);
    assert!(
        !reusable,
        "the request was not sent whole: the connection closes"
    );
}

#[tokio::test]
async fn a_failing_request_body_abandons_the_exchange() {
    let (connection, mut far) = pipe(4096);
    let headers = HeaderMap::new();
    let body = TestBody::Frames(VecDeque::from([
        Some(Ok(Bytes::from_static(b"abc"))),
        Some(Err("client left")),
    ]));
    let method = Method::POST;
    let request = head(&method, "/", &headers);
    let sent = connection.send(&request, body, None).await;
    match sent {
        Err(SendError::Body(error)) => assert_eq!(error.to_string(), "client left"),
        Err(_) | Ok(_) => panic!("expected the body's failure"),
    }
    // The connection is gone: the backend sees the end of the stream after the partial body.
    let mut seen = Vec::new();
    far.read_to_end(&mut seen).await.unwrap();
    assert!(
        seen.ends_with(b"3\r\nabc\r\n"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
}

#[tokio::test(start_paused = true)]
async fn a_backend_that_stops_reading_the_body_fails_the_exchange_after_the_stall_limit() {
    // A pipe of 64 bytes that the backend never reads: the body's writes stop making progress.
    let (connection, _far) = pipe(64);
    let headers = HeaderMap::new();
    let body = TestBody::Whole(Some(Bytes::from(vec![b'x'; 64 * 1024])));
    let method = Method::POST;
    let started = Instant::now();
    let request = head(&method, "/", &headers);
    let sent = connection
        .send(&request, body, Some(Duration::from_secs(30)))
        .await;
    match sent {
        Err(SendError::Failed(error)) => assert_eq!(error.kind(), std::io::ErrorKind::TimedOut),
        Err(_) | Ok(_) => panic!("expected the stall to fail the exchange"),
    }
    assert_eq!(started.elapsed(), Duration::from_secs(30));
}

#[tokio::test]
async fn malformed_answers_fail_the_exchange_and_never_come_back_to_the_pool() {
    for answer in [
        &b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n"[..],
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n",
        b"garbage\r\n\r\n",
    ] {
        let (connection, mut far) = pipe(4096);
        let backend = async move {
            expect_request(&mut far, b"GET / HTTP/1.1\r\nhost: backend\r\n\r\n").await;
            far.write_all(answer).await.unwrap();
            // The backend then closes.
        };
        let headers = HeaderMap::new();
        let method = Method::GET;
        let request = head(&method, "/", &headers);
        let sent = connection.send(&request, TestBody::Whole(None), None);
        let text = String::from_utf8_lossy(answer);
        let ((), sent) = tokio::join!(backend, sent);
        match sent {
            Err(SendError::Failed(_)) => {}
            Err(_) => panic!("{text}: expected a failed exchange"),
            Ok(mut response) => {
                assert!(collect(response.body_mut()).await.is_err(), "{text}");
                assert!(response.body_mut().take_connection().is_none(), "{text}");
            }
        }
    }
}

#[tokio::test]
async fn a_head_answer_has_no_body_and_one_that_announces_a_body_closes_its_connection() {
    // A backend that announces a length to HEAD may send the body anyway (as a broken one
    // would): those bytes must never be read as the next answer, so the connection closes.
    for (answer, reusable) in [
        (&b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"[..], true),
        (b"HTTP/1.1 200 OK\r\n\r\n", true),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", false),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", false),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\nhello", false),
    ] {
        let (connection, mut far) = pipe(4096);
        far.write_all(answer).await.unwrap();
        let headers = HeaderMap::new();
        let method = Method::HEAD;
        let request = head(&method, "/", &headers);
        let sent = connection.send(&request, TestBody::Whole(None), None);
        let mut response = sent.await.map_err(|_| "send failed").unwrap();
        assert_eq!(collect(response.body_mut()).await.unwrap(), b"");
        let taken = response.body_mut().take_connection();
        let kept = taken.is_some_and(|mut connection| connection.is_clean());
        assert_eq!(kept, reusable, "{}", String::from_utf8_lossy(answer));
    }
}

#[tokio::test]
async fn large_bodies_go_out_whole_from_where_they_are() {
    // A body in memory larger than what is copied behind the head, and a streamed frame larger
    // than what is copied behind its chunk line: both reach the backend byte for byte.
    let large: Bytes = (0..5000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let headers = HeaderMap::new();
    let method = Method::POST;
    let request = head(&method, "/big", &headers);
    for streamed in [false, true] {
        let (connection, mut far) = pipe(512);
        let body = if streamed {
            TestBody::Frames(VecDeque::from([Some(Ok(large.clone()))]))
        } else {
            TestBody::Whole(Some(large.clone()))
        };
        let mut expected = b"POST /big HTTP/1.1\r\nhost: backend\r\n".to_vec();
        if streamed {
            expected.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n1388\r\n");
            expected.extend_from_slice(&large);
            expected.extend_from_slice(b"\r\n0\r\n\r\n");
        } else {
            expected.extend_from_slice(b"content-length: 5000\r\n\r\n");
            expected.extend_from_slice(&large);
        }
        let backend = async {
            expect_request(&mut far, &expected).await;
            far.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await
                .unwrap();
            far
        };
        let client = async {
            let sent = connection.send(&request, body, None);
            let mut response = sent.await.map_err(|_| "send failed").unwrap();
            response.body_mut().take_connection().is_some()
        };
        let (_far, reusable) = tokio::join!(backend, client);
        assert!(reusable, "streamed: {streamed}");
    }
}
