//! Resilience over real sockets: dead, failing, killed and busy replicas; retries; draining;
//! slow and hostile clients; admin protections.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_refusing_connections_costs_no_request_with_any_strategy() {
    for strategy in ["queued-least-latency", "round-robin"] {
        let (_healthy, addrs) =
            three_healthy_and(refusing_addr(), 0, Duration::from_millis(5)).await;
        let router = start_router(with_strategy(strategy)).await;
        set_backends(router.addr, &addrs).await;
        let statuses = run_load(&router, 500, 8).await;
        let errors = statuses.iter().filter(|s| **s != StatusCode::OK).count();
        assert_eq!(errors, 0, "{strategy}: {errors} of 500 failed");
        assert!(
            metric(&router, "custom_router_retries_total{reason=\"connect\"}").await >= 1.0,
            "{strategy}: retries are counted"
        );
    }
}

/// A backend answering 500 to everything until `healthy` is set; `/health` follows the flag.
async fn flaky_backend(healthy: Arc<AtomicBool>) -> FakeBackend {
    spawn_backend(move |_request| {
        let healthy = Arc::clone(&healthy);
        async move {
            if healthy.load(Ordering::SeqCst) {
                respond(StatusCode::OK, "recovered")
            } else {
                respond(StatusCode::INTERNAL_SERVER_ERROR, "boom")
            }
        }
    })
    .await
}

/// Four replicas, the second answering 500 until `healthy` is set; ejection after 0.3 s.
async fn one_failing_of_four(
    strategy: &str,
    healthy: &Arc<AtomicBool>,
) -> (TestRouter, FakeBackend, [FakeBackend; 3]) {
    let failing = flaky_backend(Arc::clone(healthy)).await;
    let (others, addrs) = three_healthy_and(failing.host_port(), 1, Duration::from_millis(5)).await;
    let mut config = with_strategy(strategy);
    config.availability.ejection_time = Duration::from_millis(300);
    config.availability.health_check_path = Some("/health".to_owned());
    let router = start_router(config).await;
    set_backends(router.addr, &addrs).await;
    (router, failing, others)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_answering_500_costs_at_most_two_percent_with_any_strategy() {
    for strategy in ["round-robin", "queued-least-latency"] {
        let healthy = Arc::new(AtomicBool::new(false));
        let (router, _failing, _others) = one_failing_of_four(strategy, &healthy).await;
        let statuses = run_load(&router, 500, 8).await;
        let errors = statuses.iter().filter(|s| **s != StatusCode::OK).count();
        eprintln!("{strategy}: {errors} of 500 failed with one replica answering 500");
        assert!(errors <= 10, "{strategy}: {errors} of 500 failed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_replica_is_ejected_then_readmitted_once_its_probe_passes() {
    // Round-robin keeps sending it its share, so only ejection protects the clients.
    let healthy = Arc::new(AtomicBool::new(false));
    let (router, failing, _others) = one_failing_of_four("round-robin", &healthy).await;
    let statuses = run_load(&router, 500, 8).await;
    let errors = statuses.iter().filter(|s| **s != StatusCode::OK).count();
    assert!(errors <= 10, "{errors} of 500 failed");
    let (_, health) = get_json(&router.url("/_custom_router/health")).await;
    assert_eq!(health["backends"][1]["addr"], failing.host_port().as_str());
    assert_eq!(health["backends"][1]["ejected"], true, "{health}");
    assert!(metric(&router, "custom_router_ejections_total").await >= 1.0);
    let label = format!(
        "custom_router_backend_ejected{{addr=\"{}\"}}",
        failing.host_port()
    );
    assert_eq!(metric(&router, &label).await, 1.0);

    // Probes fail while it is broken: it stays out, through several failed probes.
    let probed = failing.hits();
    assert!(
        eventually(Duration::from_secs(10), async || failing.hits()
            >= probed + 2)
        .await,
        "the ejected backend is probed again"
    );
    let (_, health) = get_json(&router.url("/_custom_router/health")).await;
    assert_eq!(
        health["backends"][1]["ejected"], true,
        "readmitted without a passing probe"
    );

    // Once healthy, its probe passes, it comes back and takes traffic again.
    healthy.store(true, Ordering::SeqCst);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, health) = get_json(&router.url("/_custom_router/health")).await;
        if health["backends"][1]["ejected"] == false {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never readmitted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = failing.hits();
    let statuses = run_load(&router, 100, 4).await;
    assert!(statuses.iter().all(|s| *s == StatusCode::OK));
    assert!(
        failing.hits() >= before + 20,
        "readmitted backend gets its share"
    );
}

/// A backend streaming `events` SSE events `gap` apart.
async fn streaming_backend(events: usize, gap: Duration) -> FakeBackend {
    spawn_backend(move |_request| async move {
        let (sender, body) = channel_body();
        tokio::spawn(async move {
            for index in 0..events {
                let event = Bytes::from(format!("data: {index}\n\n"));
                if sender.send(event).await.is_err() {
                    return;
                }
                tokio::time::sleep(gap).await;
            }
        });
        http::Response::new(body)
    })
    .await
}

/// Reads a whole streamed response: `Ok(events)` or the error that ended it.
async fn read_stream(url: String) -> Result<usize, String> {
    read_stream_with(client(), url).await
}

/// [`read_stream`] through `client` (an h2c one, say).
async fn read_stream_with(
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        TestBody,
    >,
    url: String,
) -> Result<usize, String> {
    let response = client
        .request(Request::get(url).body(full("")).unwrap())
        .await
        .map_err(|e| e.to_string())?;
    if response.status() != StatusCode::OK {
        return Err(format!("status {}", response.status()));
    }
    let mut body = response.into_body();
    let mut events = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| e.to_string())?;
        if let Ok(data) = frame.into_data() {
            events += String::from_utf8_lossy(&data).matches("data: ").count();
        }
    }
    Ok(events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_fails_its_streams_fast_and_new_requests_go_elsewhere() {
    let survivor = streaming_backend(20, Duration::from_millis(50)).await;
    let victim = streaming_backend(20, Duration::from_millis(50)).await;
    let router = start_router(with_strategy("round-robin")).await;
    set_backends(router.addr, &[survivor.host_port(), victim.host_port()]).await;
    let streams: Vec<_> = (0..10)
        .map(|_| tokio::spawn(read_stream(router.url("/stream"))))
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while victim.hits() < 5 || survivor.hits() < 5 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    victim.kill();
    let killed_at = tokio::time::Instant::now();

    let mut completed = 0;
    let mut failed = 0;
    for stream in streams {
        match stream.await.unwrap() {
            Ok(events) => {
                assert_eq!(events, 20);
                completed += 1;
            }
            Err(_) => {
                assert!(
                    killed_at.elapsed() < Duration::from_secs(1),
                    "a broken stream took {:?} to fail",
                    killed_at.elapsed()
                );
                failed += 1;
            }
        }
    }
    assert_eq!((completed, failed), (5, 5));
    // New requests never reach the dead address: connect failures go to the survivor.
    for _ in 0..10 {
        assert_eq!(read_stream(router.url("/after")).await, Ok(20));
    }
}

/// A backend answering `status` with `Retry-After: retry_after` to everything.
async fn busy_backend(status: StatusCode, retry_after: &'static str) -> FakeBackend {
    spawn_backend(move |_request| async move {
        let mut response = respond(status, "busy");
        response
            .headers_mut()
            .insert("retry-after", retry_after.parse().unwrap());
        response
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_replica_is_paused_and_the_request_is_served_elsewhere() {
    let busy = busy_backend(StatusCode::TOO_MANY_REQUESTS, "2").await;
    let free = named_backend("free").await;
    let router = start_router(with_strategy("round-robin")).await;
    set_backends(router.addr, &[busy.host_port(), free.host_port()]).await;
    for _ in 0..10 {
        let (status, body) = get(&router.url("/generate")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "free"));
    }
    assert_eq!(busy.hits(), 1, "paused after its first 429");
    let (_, health) = get_json(&router.url("/_custom_router/health")).await;
    assert_eq!(health["backends"][0]["paused"], true);
    assert_eq!(health["backends"][0]["ejected"], false);
    assert_eq!(
        metric(&router, "custom_router_retries_total{reason=\"busy\"}").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_replica_busy_round_robin_answers_503_busy() {
    let busy = busy_backend(StatusCode::SERVICE_UNAVAILABLE, "5").await;
    let router = start_router(with_strategy("round-robin")).await;
    set_backends(router.addr, &[busy.host_port()]).await;
    let (status, body) = get(&router.url("/generate")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["reason"], "busy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_byte_timeout_answers_504_and_retries_idempotent_requests() {
    let hanging = spawn_backend(|_request| async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        respond(StatusCode::OK, "late")
    })
    .await;
    let quick = named_backend("quick").await;
    let mut config = with_strategy("round-robin");
    config.upstream.first_byte_timeout = Some(Duration::from_millis(200));
    let router = start_router(config).await;
    set_backends(router.addr, &[hanging.host_port()]).await;
    let started = std::time::Instant::now();
    let (status, _) = get(&router.url("/generate")).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert!(started.elapsed() < Duration::from_secs(2));
    // With a second replica, the idempotent GET is sent again there; a POST is not.
    set_backends(router.addr, &[hanging.host_port(), quick.host_port()]).await;
    for _ in 0..4 {
        let (status, body) = get(&router.url("/generate")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "quick"));
    }
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let request = Request::post(router.url("/generate"))
            .body(full("{}"))
            .unwrap();
        statuses.push(send(request).await.0);
    }
    assert!(
        statuses.contains(&StatusCode::GATEWAY_TIMEOUT),
        "{statuses:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_200_streams_to_completion_and_health_says_draining() {
    let backend = streaming_backend(10, Duration::from_millis(100)).await;
    let mut router = spawn_router_process(&[
        ("CUSTOM_ROUTER_STRATEGY", "round-robin"),
        ("CUSTOM_ROUTER_PRE_DRAIN_DELAY", "0.5"),
    ]);
    set_backends(router.addr, &[backend.host_port()]).await;
    let url = format!("http://{}/stream", router.addr);
    // 180 over HTTP/1.1, 20 as streams of one h2c connection (told GOAWAY when the router
    // drains, which must let its open streams finish).
    let h2c = h2c_client();
    let streams: Vec<_> = (0..200)
        .map(|index| match index % 10 {
            0 => tokio::spawn(read_stream_with(h2c.clone(), url.clone())),
            _ => tokio::spawn(read_stream(url.clone())),
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while backend.hits() < 200 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} started",
            backend.hits()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    router.terminate();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, health) = get_json(&format!("http://{}/_custom_router/health", router.addr)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(health["ok"], false);
    assert_eq!(health["draining"], true);
    for stream in streams {
        assert_eq!(stream.await.unwrap(), Ok(10));
    }
    let code = tokio::task::spawn_blocking(move || router.wait_exit(Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(code, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_header_client_loses_its_slot_at_the_header_timeout() {
    let backend = named_backend("served").await;
    let mut config = with_strategy("round-robin");
    config.limits.header_read_timeout = Duration::from_secs(1);
    config.max_connections = custom_router::forms::Count::Fixed(2);
    let router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    // Two clients take both connection slots and send their headers a byte at a time.
    let mut slow = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(router.addr).await.unwrap();
        stream.write_all(b"G").await.unwrap();
        slow.push(tokio::spawn(async move {
            let started = tokio::time::Instant::now();
            for byte in b"ET / HTTP/1.1\r\nhost: x\r\nx-slow: ".iter().cycle() {
                if started.elapsed() > Duration::from_secs(5) {
                    return None;
                }
                if stream.write_all(&[*byte]).await.is_err() {
                    return Some(started.elapsed());
                }
                let mut probe = [0u8; 1];
                if let Ok(Ok(0) | Err(_)) =
                    tokio::time::timeout(Duration::from_millis(100), stream.read(&mut probe)).await
                {
                    return Some(started.elapsed());
                }
            }
            None
        }));
    }
    // Meanwhile a normal client is served once a slot frees up.
    let started = std::time::Instant::now();
    let (status, body) = get(&router.url("/generate")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "served"));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    for client in slow {
        let cut_after = client.await.unwrap().expect("slow client was cut off");
        assert!(cut_after < Duration::from_secs(3), "{cut_after:?}");
    }
}

/// A backend that streams for as long as anyone takes its bytes, behind a round-robin router
/// whose send timeout is 500 ms; the series of the backend's in-flight count.
async fn endless_answer_behind_a_router() -> (FakeBackend, TestRouter, String) {
    let backend = spawn_backend(|_request| async move {
        let (sender, body) = channel_body();
        tokio::spawn(async move {
            let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
            while sender.send(chunk.clone()).await.is_ok() {}
        });
        http::Response::new(body)
    })
    .await;
    let mut config = with_strategy("round-robin");
    config.limits.send_timeout = Duration::from_millis(500);
    let router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let in_flight = format!(
        "custom_router_backend_inflight_requests{{addr=\"{}\"}}",
        backend.host_port()
    );
    (backend, router, in_flight)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_gives_its_backend_slot_back_at_the_send_timeout() {
    let (_backend, router, in_flight) = endless_answer_behind_a_router().await;
    // The client asks, reads the head, then reads nothing more while the answer keeps coming.
    let mut stalled = TcpStream::connect(router.addr).await.unwrap();
    stalled
        .write_all(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    stalled.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    assert_eq!(metric(&router, &in_flight).await, 1.0);
    let released = eventually(Duration::from_secs(5), async || {
        metric(&router, &in_flight).await == 0.0
    })
    .await;
    assert!(released, "the stalled answer still holds its backend");
    // The connection was closed: what the client reads now ends.
    let mut drained = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stalled.read_to_end(&mut drained));
    assert!(matches!(read.await, Ok(Ok(_)) | Ok(Err(_))));
    // A canary on a fresh connection is answered by the same backend.
    let mut canary = TcpStream::connect(router.addr).await.unwrap();
    canary
        .write_all(b"GET /canary HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(5), canary.read_exact(&mut head));
    answered.await.expect("the canary is answered").unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_client_that_stops_sending_its_body_gives_the_backend_slot_back() {
    // The backend reads the whole request body before it answers.
    let backend = spawn_backend(|request: Request<hyper::body::Incoming>| async move {
        let read = request
            .into_body()
            .collect()
            .await
            .map(|body| body.to_bytes().len());
        respond(StatusCode::OK, format!("{read:?}"))
    })
    .await;
    let mut config = with_strategy("round-robin");
    config.limits.body_read_timeout = Duration::from_millis(500);
    let router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let in_flight = format!(
        "custom_router_backend_inflight_requests{{addr=\"{}\"}}",
        backend.host_port()
    );
    // A body announced larger than the retry limit is streamed through; the client sends a
    // little of it, then nothing while it keeps the stream open.
    let (sender, body) = channel_body();
    let request = Request::post(router.url("/upload"))
        .header("content-length", (4 * 1024 * 1024).to_string())
        .body(body)
        .unwrap();
    let client = h2c_client();
    let answer = tokio::spawn(async move { client.request(request).await.map(|r| r.status()) });
    sender.send(Bytes::from(vec![b'x'; 1024])).await.unwrap();
    let dispatched = eventually(Duration::from_secs(5), async || {
        metric(&router, &in_flight).await == 1.0
    })
    .await;
    assert!(dispatched, "the upload never reached the backend");
    let released = eventually(Duration::from_secs(5), async || {
        metric(&router, &in_flight).await == 0.0
    })
    .await;
    assert!(released, "the stalled upload still holds its backend");
    let status = tokio::time::timeout(Duration::from_secs(5), answer)
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(status.ok(), Some(StatusCode::REQUEST_TIMEOUT));
    drop(sender);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_client_that_stops_reading_gives_its_backend_slot_back_at_the_send_timeout() {
    let (_backend, router, in_flight) = endless_answer_behind_a_router().await;
    // The client takes the answer's head and then reads nothing: the stream's flow-control
    // window fills and the router has nowhere to put the backend's bytes.
    let stream = TcpStream::connect(router.addr).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    let connection = tokio::spawn(connection);
    let request = Request::get(router.url("/stream")).body(full("")).unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), sender.send_request(request))
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    let released = eventually(Duration::from_secs(5), async || {
        metric(&router, &in_flight).await == 0.0
    })
    .await;
    assert!(released, "the unread answer still holds its backend");
    // The router closed the connection.
    let ended = tokio::time::timeout(Duration::from_secs(5), connection).await;
    assert!(ended.is_ok(), "the stalled connection is still open");
    drop(answer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_h2c_connection_is_closed_after_the_header_timeout_but_not_while_a_stream_is_open()
{
    // The backend answers after twice the router's header timeout.
    let backend = spawn_backend(|_request| async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        respond(StatusCode::OK, "late")
    })
    .await;
    let mut config = with_strategy("round-robin");
    config.limits.header_read_timeout = Duration::from_secs(1);
    let router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let stream = TcpStream::connect(router.addr).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    let connection = tokio::spawn(connection);
    let request = Request::get(router.url("/slow")).body(full("")).unwrap();
    let started = std::time::Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(10), sender.send_request(request))
        .await
        .expect("answered")
        .unwrap();
    let body = answer.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        &body[..],
        b"late",
        "a stream open longer than the timeout is answered"
    );
    assert!(started.elapsed() >= Duration::from_secs(2));
    // Nothing open any more: the router says GOAWAY and the connection ends.
    let ended = tokio::time::timeout(Duration::from_secs(5), connection).await;
    assert!(
        matches!(ended, Ok(Ok(Ok(())))),
        "the idle connection was not closed cleanly: {ended:?}"
    );
    assert!(sender.is_closed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_loses_its_slot_at_the_header_timeout() {
    let backend = named_backend("served").await;
    let mut config = with_strategy("round-robin");
    config.limits.header_read_timeout = Duration::from_millis(500);
    config.max_connections = custom_router::forms::Count::Fixed(1);
    let router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let mut silent = TcpStream::connect(router.addr).await.unwrap();
    let started = std::time::Instant::now();
    let (status, body) = get(&router.url("/generate")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "served"));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let mut buffer = [0u8; 1];
    let closed = tokio::time::timeout(Duration::from_secs(1), silent.read(&mut buffer)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "silent connection still open"
    );
}

/// One hostile or malformed request, as raw bytes.
fn hostile_request(rng: &mut Rng) -> Vec<u8> {
    let valid_admin = br#"{"backends":["127.0.0.1:1","10.0.0.1:80"]}"#;
    match rng.index(12) {
        0 => b"GE\x00T / HTTP/1.1\r\nhost: x\r\n\r\n".to_vec(),
        1 => {
            let mut request = b"GET / HTTP/1.1\r\nhost: x\r\nx-big: ".to_vec();
            request.extend(std::iter::repeat_n(b'a', 100_000 + rng.index(50_000)));
            request.extend(b"\r\n\r\n");
            request
        }
        2 => b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /_custom_router/set-backends HTTP/1.1\r\n\r\n".to_vec(),
        3 => b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 7\r\n\r\nhello".to_vec(),
        4 => b"GET /\xff\xfe\x80 HTTP/1.1\r\nhost: x\r\n\r\n".to_vec(),
        5 => b"POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n".to_vec(),
        6 => {
            // set-backends with a truncated body: never valid JSON.
            let cut = rng.index(valid_admin.len() - 1);
            let body = &valid_admin[..cut];
            let mut request = format!(
                "POST /_custom_router/set-backends HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            request.extend_from_slice(body);
            request
        }
        7 => {
            // set-backends with random bytes.
            let body: Vec<u8> = (0..rng.index(64)).map(|_| rng.next() as u8).collect();
            let mut request = format!(
                "POST /_custom_router/set-backends HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            request.extend(body);
            request
        }
        8 => {
            let bodies = [
                r#"{"backends":[1,2]}"#,
                r#"{"backends":{"a":"b"}}"#,
                r#"{"backends":["a"]}"#,
                r#"{"backends":["h:0"]}"#,
                r#"{"backends":["h:1/x"]}"#,
                r#"{"other":[]}"#,
                r#"[]"#,
                r#"null"#,
            ];
            let body = bodies[rng.index(bodies.len())];
            format!(
                "POST /_custom_router/set-backends HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .into_bytes()
        }
        9 => b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12garbage".to_vec(),
        10 => {
            let junk: Vec<u8> = (0..rng.index(200) + 1).map(|_| rng.next() as u8).collect();
            junk
        }
        _ => b"DELETE /_custom_router/health HTTP/1.1\r\nhost: x\r\n\r\n".to_vec(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_hostile_requests_leave_the_router_healthy_and_the_set_unchanged() {
    let backend = named_backend("ok").await;
    let mut config = with_strategy("round-robin");
    config.limits.header_read_timeout = Duration::from_secs(2);
    let router = start_router(config).await;
    let set = vec![backend.host_port()];
    set_backends(router.addr, &set).await;
    let sent = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..16)
        .map(|worker| {
            let sent = Arc::clone(&sent);
            let addr = router.addr;
            tokio::spawn(async move {
                let mut rng = Rng(0xC0FF_EE00 + worker);
                while sent.fetch_add(1, Ordering::SeqCst) < 10_000 {
                    let request = hostile_request(&mut rng);
                    let Ok(mut stream) = TcpStream::connect(addr).await else {
                        continue;
                    };
                    let _ = stream.write_all(&request).await;
                    let _ = stream.shutdown().await;
                    let mut answer = Vec::new();
                    let _ = tokio::time::timeout(
                        Duration::from_secs(3),
                        stream.read_to_end(&mut answer),
                    )
                    .await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    let (status, health) = get_json(&router.url("/_custom_router/health")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(health["ok"], true);
    assert_eq!(listed_backends(router.addr).await, set);
    let (status, body) = get(&router.url("/still-works")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
}

#[tokio::test]
async fn set_backends_requires_the_token_when_one_is_set() {
    let mut config = with_strategy("round-robin");
    config.admin.token = Some("s3cret".to_owned());
    let router = start_router(config).await;
    let url = router.url("/_custom_router/set-backends");
    let body = r#"{"backends":["127.0.0.1:9001"]}"#;
    for authorization in [
        None,
        Some("Bearer wrong"),
        Some("s3cret"),
        Some("Bearer s3cre"),
    ] {
        let mut request = Request::post(&url);
        if let Some(value) = authorization {
            request = request.header("authorization", value);
        }
        let (status, headers, answer) = send(request.body(full(body)).unwrap()).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{authorization:?}");
        assert_eq!(headers["www-authenticate"], "Bearer");
        let answer: Value = serde_json::from_slice(&answer).unwrap();
        assert!(answer["error"].is_string());
        assert!(listed_backends(router.addr).await.is_empty());
    }
    let request = Request::post(&url)
        .header("authorization", "Bearer s3cret")
        .body(full(body))
        .unwrap();
    assert_eq!(send(request).await.0, StatusCode::OK);
    assert_eq!(listed_backends(router.addr).await, ["127.0.0.1:9001"]);
}

#[tokio::test]
async fn backends_outside_the_allowed_networks_are_refused() {
    let mut config = with_strategy("round-robin");
    config.admin.backend_allow_cidrs =
        vec!["10.0.0.0/8".parse().unwrap(), "127.0.0.1".parse().unwrap()];
    let router = start_router(config).await;
    let url = router.url("/_custom_router/set-backends");
    set_backends(
        router.addr,
        &["10.1.2.3:80".to_owned(), "127.0.0.1:9".to_owned()],
    )
    .await;
    for (entry, expected) in [
        ("192.168.1.1:80", "outside the allowed networks"),
        ("127.0.0.2:80", "outside the allowed networks"),
        ("replica.internal:80", "host name"),
    ] {
        let body = format!(r#"{{"backends":["10.9.9.9:80","{entry}"]}}"#);
        let (status, answer) = post_json(&url, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{entry}");
        let message = answer["error"].as_str().unwrap();
        assert!(
            message.starts_with("backends[1]") && message.contains(expected),
            "{message}"
        );
        assert_eq!(
            listed_backends(router.addr).await,
            ["10.1.2.3:80", "127.0.0.1:9"]
        );
    }
}

#[tokio::test]
async fn admin_paths_are_never_proxied_even_unknown_ones() {
    let backend = named_backend("backend").await;
    let router = start_router(with_strategy("round-robin")).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    for path in [
        "/_custom_router",
        "/_custom_router/",
        "/_custom_router/x/y?z=1",
    ] {
        let (status, _) = get(&router.url(path)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
    }
    assert_eq!(backend.hits(), 0);
}

#[tokio::test]
async fn a_request_with_both_transfer_encoding_and_content_length_is_refused() {
    let backend = named_backend("backend").await;
    let router = start_router(with_strategy("round-robin")).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    for head in [
        "POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n",
        "POST /a HTTP/1.1\r\nhost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n",
    ] {
        let mut stream = TcpStream::connect(router.addr).await.unwrap();
        let request = format!("{head}0\r\n\r\nGET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer))
            .await
            .expect("the connection is closed")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        assert!(
            answer.contains("Transfer-Encoding and Content-Length"),
            "{answer}"
        );
    }
    assert_eq!(backend.hits(), 0, "neither request reached the backend");
    // An ordinary chunked request on a fresh connection is still proxied.
    let mut stream = TcpStream::connect(router.addr).await.unwrap();
    stream
        .write_all(b"POST /b HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"));
    assert_eq!(backend.hits(), 1);
}

/// A request's deadline header counts from its arrival: after a busy answer that came late, the
/// retry waits in the queue only for what is left of it (answered 503 at the deadline, not a
/// whole deadline later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_waits_only_for_what_is_left_of_the_deadline_header() {
    let busy = spawn_backend(|_request| async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        let mut response = respond(StatusCode::TOO_MANY_REQUESTS, "busy");
        response
            .headers_mut()
            .insert("retry-after", "10".parse().unwrap());
        response
    })
    .await;
    let router = start_router(qll()).await;
    set_backends(router.addr, &[busy.host_port()]).await;
    let started = std::time::Instant::now();
    let request = Request::get(router.url("/generate"))
        .header("x-request-deadline-ms", "1000")
        .body(full(""))
        .unwrap();
    let (status, _, body) = send(request).await;
    let waited = started.elapsed();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body:?}");
    assert_eq!(busy.hits(), 1);
    assert!(
        waited >= Duration::from_millis(950) && waited < Duration::from_millis(1500),
        "answered after {waited:?}, the deadline was 1 s from arrival"
    );
}
