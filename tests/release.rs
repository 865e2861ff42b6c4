//! Every way a request can end gives back what it held: its backend's in-flight counters (in
//! flight, awaiting a first byte, queued prefill, work), its place in the router queue and the
//! retry it took from the budget. Clients leave at each stage (queued, waiting for the head,
//! mid-stream; over HTTP/1, also after sending bytes ahead or with a streamed body still
//! unread, and over HTTP/2 by reset or close), backends fail, time out, answer malformed heads
//! or are removed, and the router drains.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use custom_router::backend::Backend;
use http::{Request, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The backend of the router's current set at `addr`.
fn backend_of(router: &TestRouter, addr: &str) -> Arc<Backend> {
    router
        .balancer
        .backends()
        .iter()
        .find(|b| b.addr().to_string() == addr)
        .cloned()
        .unwrap_or_else(|| panic!("{addr} not in the set"))
}

/// A router started with `config` whose one backend is `backend`, and that backend's state.
async fn routed(
    backend: &FakeBackend,
    config: custom_router::config::Config,
) -> (TestRouter, Arc<Backend>) {
    let router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let state = backend_of(&router, &backend.host_port());
    (router, state)
}

/// in_flight, awaiting_first_byte, prefill_in_flight, work_in_flight.
fn counters(backend: &Backend) -> (usize, usize, u64, u64) {
    (
        backend.in_flight(),
        backend.awaiting_first_byte(),
        backend.prefill_in_flight(),
        backend.work_in_flight(),
    )
}

/// Waits until every counter of `backend` is back to 0; panics with what is left.
async fn assert_released(backend: &Backend, within: Duration, what: &str) {
    let released = eventually(within, async || counters(backend) == (0, 0, 0, 0)).await;
    assert!(
        released,
        "{what}: {} still holds (in_flight, awaiting_first_byte, prefill, work) = {:?}",
        backend.addr(),
        counters(backend)
    );
}

async fn assert_queue_empty(router: &TestRouter, within: Duration, what: &str) {
    let empty = eventually(within, async || router.balancer.queue_depth() == 0).await;
    assert!(
        empty,
        "{what}: queue depth still {}",
        router.balancer.queue_depth()
    );
}

/// A backend that takes every request and never answers (until the router drops the exchange).
async fn hanging_backend() -> FakeBackend {
    spawn_backend(|_request| async move {
        std::future::pending::<()>().await;
        respond(StatusCode::OK, "never")
    })
    .await
}

/// A backend that answers a stream head at once, then one event every `gap`, for ever.
async fn endless_stream_backend(gap: Duration) -> FakeBackend {
    spawn_backend(move |_request| async move {
        let (sender, body) = channel_body();
        tokio::spawn(async move {
            loop {
                if sender
                    .send(Bytes::from_static(b"data: x\n\n"))
                    .await
                    .is_err()
                {
                    return;
                }
                tokio::time::sleep(gap).await;
            }
        });
        let mut response = http::Response::new(body);
        response.headers_mut().insert(
            "content-type",
            http::HeaderValue::from_static("text/event-stream"),
        );
        response
    })
    .await
}

async fn wait_hits(backend: &FakeBackend, hits: usize) {
    let reached = eventually(Duration::from_secs(5), async || backend.hits() >= hits).await;
    assert!(reached, "the backend got {} requests", backend.hits());
}

const GET: &[u8] = b"GET /generate HTTP/1.1\r\nhost: x\r\n\r\n";

// ---------------------------------------------------------------------------------------------
// HTTP/1: client goes away

/// What an HTTP/1 client may send after its request before it leaves: nothing, the stray line
/// end some clients send after a body (RFC 9112 §2.2), or its next request (pipelining). The
/// router keeps those bytes for later and goes on watching the connection.
const SENT_AHEAD: [&[u8]; 3] = [b"", b"\r\n", GET];

/// A client connected to `router` whose request `GET` was sent.
async fn h1_request(router: &TestRouter) -> TcpStream {
    let mut client = TcpStream::connect(router.addr).await.unwrap();
    client.write_all(GET).await.unwrap();
    client
}

/// Sends `ahead` (if anything), lets the router read it, and closes the connection.
async fn leave_after(mut client: TcpStream, ahead: &[u8]) {
    if !ahead.is_empty() {
        client.write_all(ahead).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h1_client_that_leaves_while_its_head_is_awaited_releases_the_backend() {
    for ahead in SENT_AHEAD {
        let backend = hanging_backend().await;
        let (router, b) = routed(&backend, round_robin()).await;
        let client = h1_request(&router).await;
        wait_hits(&backend, 1).await;
        assert_eq!(b.in_flight(), 1);
        leave_after(client, ahead).await;
        let context = format!("close while waiting for the head, {ahead:?} sent ahead");
        assert_released(&b, Duration::from_secs(3), &context).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h1_client_that_leaves_while_queued_leaves_the_queue_and_is_never_sent() {
    for ahead in SENT_AHEAD {
        let backend = hanging_backend().await;
        // queued-least-latency: a never-measured busy backend takes no second request.
        let (router, b) = routed(&backend, qll_held()).await;
        let first = h1_request(&router).await;
        wait_hits(&backend, 1).await;
        let queued = h1_request(&router).await;
        let waiting = eventually(Duration::from_secs(3), async || {
            router.balancer.queue_depth() == 1
        })
        .await;
        assert!(waiting, "the second request did not queue");
        leave_after(queued, ahead).await;
        let context = format!("close while queued, {ahead:?} sent ahead");
        assert_queue_empty(&router, Duration::from_secs(3), &context).await;
        drop(first);
        assert_released(&b, Duration::from_secs(3), "first").await;
        assert_eq!(
            backend.hits(),
            1,
            "{context}: the cancelled request was sent"
        );
    }
}

/// Mid-stream, with a backend silent between events: the client's close is seen while the
/// router waits for the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h1_client_that_leaves_mid_stream_releases_the_backend() {
    for ahead in SENT_AHEAD {
        let backend = endless_stream_backend(Duration::from_secs(30)).await;
        let (router, b) = routed(&backend, round_robin()).await;
        let mut client = h1_request(&router).await;
        let mut buffer = vec![0u8; 256];
        let read = tokio::time::timeout(Duration::from_secs(5), client.read(&mut buffer)).await;
        assert!(matches!(read, Ok(Ok(n)) if n > 0));
        leave_after(client, ahead).await;
        let context = format!("close mid-stream, {ahead:?} sent ahead");
        assert_released(&b, Duration::from_secs(3), &context).await;
    }
}

/// A request whose body is too large to be read ahead (streamed) waits in the queue with its
/// body unread; a client that leaves then must still leave the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h1_client_whose_streamed_body_waits_unread_in_the_queue_leaves_it_when_it_leaves() {
    let backend = hanging_backend().await;
    let (router, b) = routed(&backend, qll_held()).await;
    let mut first = TcpStream::connect(router.addr).await.unwrap();
    first.write_all(GET).await.unwrap();
    wait_hits(&backend, 1).await;
    let mut queued = TcpStream::connect(router.addr).await.unwrap();
    queued
        .write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2097152\r\n\r\n")
        .await
        .unwrap();
    queued.write_all(&vec![b'x'; 10 * 1024]).await.unwrap();
    let waiting = eventually(Duration::from_secs(3), async || {
        router.balancer.queue_depth() == 1
    })
    .await;
    assert!(waiting, "the upload did not queue");
    drop(queued);
    let left = eventually(Duration::from_secs(3), async || {
        router.balancer.queue_depth() == 0
    })
    .await;
    let depth = router.balancer.queue_depth();
    // Let the first request go: the abandoned upload is then dispatched to the backend.
    drop(first);
    assert_released(&b, Duration::from_secs(3), "after the first request").await;
    assert!(
        left,
        "a client with a streamed body that left while queued is still queued (depth {depth}); \
         backend hits once the queue moved: {}",
        backend.hits()
    );
}

// ---------------------------------------------------------------------------------------------
// HTTP/2: stream reset and connection close

/// An h2c connection to the router; the returned handle closes its socket (FIN both ways),
/// whatever hyper's tasks still hold.
async fn h2_connection(
    router: &TestRouter,
) -> (
    hyper::client::conn::http2::SendRequest<TestBody>,
    std::net::TcpStream,
) {
    let std_stream = std::net::TcpStream::connect(router.addr).unwrap();
    std_stream.set_nonblocking(true).unwrap();
    let handle = std_stream.try_clone().unwrap();
    let stream = TcpStream::from_std(std_stream).unwrap();
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    (sender, handle)
}

fn close(handle: &std::net::TcpStream) {
    handle.shutdown(std::net::Shutdown::Both).unwrap();
}

/// The stream reset (the response future dropped: RST_STREAM CANCEL), then the connection
/// closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_client_that_leaves_while_its_head_is_awaited_releases_the_backend() {
    for reset in [true, false] {
        let backend = hanging_backend().await;
        let (router, b) = routed(&backend, round_robin()).await;
        let (mut sender, connection) = h2_connection(&router).await;
        let request = Request::get(router.url("/generate"))
            .body(full(""))
            .unwrap();
        let pending = tokio::spawn(sender.send_request(request));
        wait_hits(&backend, 1).await;
        if reset {
            pending.abort();
        } else {
            close(&connection);
        }
        let context = format!("waiting for the head, reset: {reset}");
        assert_released(&b, Duration::from_secs(3), &context).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_reset_and_close_while_queued_leave_the_queue() {
    let backend = hanging_backend().await;
    let (router, b) = routed(&backend, qll_held()).await;
    let mut first = TcpStream::connect(router.addr).await.unwrap();
    first.write_all(GET).await.unwrap();
    wait_hits(&backend, 1).await;
    // Reset.
    let (mut sender, connection) = h2_connection(&router).await;
    let request = Request::get(router.url("/generate"))
        .body(full(""))
        .unwrap();
    let pending = tokio::spawn(sender.send_request(request));
    assert!(
        eventually(Duration::from_secs(3), async || router
            .balancer
            .queue_depth()
            == 1)
        .await
    );
    pending.abort();
    assert_queue_empty(&router, Duration::from_secs(3), "h2 RST while queued").await;
    // Connection closed.
    let request = Request::get(router.url("/generate"))
        .body(full(""))
        .unwrap();
    let _pending = tokio::spawn(sender.send_request(request));
    assert!(
        eventually(Duration::from_secs(3), async || router
            .balancer
            .queue_depth()
            == 1)
        .await
    );
    close(&connection);
    assert_queue_empty(&router, Duration::from_secs(3), "h2 close while queued").await;
    drop(first);
    assert_released(&b, Duration::from_secs(3), "first").await;
    assert_eq!(backend.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_reset_mid_stream_releases_the_backend() {
    let backend = endless_stream_backend(Duration::from_secs(30)).await;
    let (router, b) = routed(&backend, round_robin()).await;
    let (mut sender, connection) = h2_connection(&router).await;
    let request = Request::get(router.url("/generate"))
        .body(full(""))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(b.in_flight(), 1);
    drop(response);
    assert_released(&b, Duration::from_secs(3), "h2 RST mid-stream").await;
    // And a connection closed mid-stream.
    let request = Request::get(router.url("/generate"))
        .body(full(""))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(b.in_flight(), 1);
    close(&connection);
    assert_released(&b, Duration::from_secs(3), "h2 close mid-stream").await;
    drop(response);
}

// ---------------------------------------------------------------------------------------------
// Retries and budgets

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_failure_then_success_elsewhere_releases_both_backends() {
    let good = slow_backend(Duration::from_millis(5)).await;
    let refusing = refusing_addr();
    let mut config = round_robin();
    config.latency.threshold = Duration::from_millis(200);
    let router = start_router(config).await;
    set_backends(router.addr, &[refusing.clone(), good.host_port()]).await;
    let statuses = run_load(&router, 20, 4).await;
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    for addr in [refusing, good.host_port()] {
        let b = backend_of(&router, &addr);
        assert_released(&b, Duration::from_secs(3), "connect failure + retry").await;
    }
    assert_queue_empty(&router, Duration::from_secs(1), "retries").await;
}

/// A failure with nowhere else to go is answered at once; it must not spend a retry from the
/// shared budget that is never made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_with_nowhere_to_retry_spends_no_retry_budget() {
    let good = slow_backend(Duration::from_millis(1)).await;
    let refusing = refusing_addr();
    let mut config = round_robin();
    config.latency.threshold = Duration::from_millis(1);
    // One retry per window of 10 s, whatever the traffic.
    config.retry.budget.min_per_second = 0.1;
    config.retry.budget.percent = 0.0;
    let router = start_router(config).await;
    // Alone, the refusing backend fails: 502, and no retry was possible.
    set_backends(router.addr, std::slice::from_ref(&refusing)).await;
    let (status, _) = get(&router.url("/generate")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    // With a healthy backend beside it, a failure on it is retried there.
    set_backends(router.addr, &[refusing.clone(), good.host_port()]).await;
    let mut statuses = Vec::new();
    for _ in 0..2 {
        statuses.push(get(&router.url("/generate")).await.0);
    }
    let exhausted = router.balancer.metrics().render().unwrap();
    let exhausted = exhausted
        .lines()
        .find_map(|line| line.strip_prefix("custom_router_retry_budget_exhausted_total "))
        .unwrap_or("0")
        .trim()
        .to_owned();
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "the one retry of the window was spent by a request that could not retry: {statuses:?}, retry_budget_exhausted_total = {exhausted}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_answer_then_success_elsewhere_releases_both_backends() {
    let busy = spawn_backend(|_request| async move {
        let mut response = respond(StatusCode::TOO_MANY_REQUESTS, "busy");
        response
            .headers_mut()
            .insert("retry-after", http::HeaderValue::from_static("1"));
        response
    })
    .await;
    let good = slow_backend(Duration::from_millis(5)).await;
    let mut config = qll_held();
    config.latency.threshold = Duration::from_millis(200);
    let router = start_router(config).await;
    set_backends(router.addr, &[busy.host_port(), good.host_port()]).await;
    let statuses = run_load(&router, 10, 2).await;
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    for addr in [busy.host_port(), good.host_port()] {
        let b = backend_of(&router, &addr);
        assert_released(&b, Duration::from_secs(3), "busy + retry").await;
    }
}

// ---------------------------------------------------------------------------------------------
// Timeouts and backend errors

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_idle_and_first_byte_timeouts_release_the_backend() {
    // Idle timeout mid-stream.
    let silent = endless_stream_backend(Duration::from_secs(30)).await;
    let mut config = round_robin();
    config.upstream.idle_timeout = Some(Duration::from_millis(300));
    config.latency.threshold = Duration::from_millis(100);
    let router = start_router(config).await;
    set_backends(router.addr, &[silent.host_port()]).await;
    let b = backend_of(&router, &silent.host_port());
    let mut client = TcpStream::connect(router.addr).await.unwrap();
    client.write_all(GET).await.unwrap();
    let mut all = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut all)).await;
    assert_released(&b, Duration::from_secs(3), "upstream idle timeout").await;

    // First byte timeout.
    let hanging = hanging_backend().await;
    let mut config = round_robin();
    config.upstream.first_byte_timeout = Some(Duration::from_millis(300));
    config.latency.threshold = Duration::from_millis(100);
    let router = start_router(config).await;
    set_backends(router.addr, &[hanging.host_port()]).await;
    let b = backend_of(&router, &hanging.host_port());
    let (status, _) = get(&router.url("/generate")).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_released(&b, Duration::from_secs(3), "first byte timeout").await;
}

/// A raw backend that answers every connection with `answer` and closes.
async fn raw_backend(answer: &'static [u8]) -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 4096];
                let _ = stream.read(&mut buffer).await;
                let _ = stream.write_all(answer).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            });
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_or_cut_response_releases_the_backend() {
    for answer in [
        &b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello"[..],
        &b"garbage\r\n\r\n"[..],
        &b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort"[..],
        &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"[..],
    ] {
        let (addr, task) = raw_backend(answer).await;
        let mut config = round_robin();
        config.latency.threshold = Duration::from_millis(100);
        let router = start_router(config).await;
        set_backends(router.addr, std::slice::from_ref(&addr)).await;
        let b = backend_of(&router, &addr);
        let request = Request::post(router.url("/generate"))
            .body(full("x"))
            .unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            let response = client().request(request).await;
            if let Ok(response) = response {
                let _ = http_body_util::BodyExt::collect(response.into_body()).await;
            }
        })
        .await;
        assert_released(
            &b,
            Duration::from_secs(3),
            &format!("answer {:?}", String::from_utf8_lossy(answer)),
        )
        .await;
        task.abort();
    }
}

// ---------------------------------------------------------------------------------------------
// Request bodies

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h1_client_stalling_its_streamed_body_gets_408_and_releases_the_backend() {
    let backend = spawn_backend(|request: Request<hyper::body::Incoming>| async move {
        let _ = http_body_util::BodyExt::collect(request.into_body()).await;
        respond(StatusCode::OK, "read")
    })
    .await;
    let mut config = round_robin();
    config.limits.body_read_timeout = Duration::from_millis(300);
    let (router, b) = routed(&backend, config).await;
    for length in [200 * 1024usize, 4 * 1024 * 1024] {
        let mut client = TcpStream::connect(router.addr).await.unwrap();
        let head = format!("POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: {length}\r\n\r\n");
        client.write_all(head.as_bytes()).await.unwrap();
        client.write_all(&vec![b'x'; 100 * 1024]).await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut answer)).await;
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 408"), "{length}: {text}");
        assert_released(&b, Duration::from_secs(3), "stalled upload").await;
    }
    // A client that leaves mid-upload.
    let mut client = TcpStream::connect(router.addr).await.unwrap();
    client
        .write_all(b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 4194304\r\n\r\n")
        .await
        .unwrap();
    client.write_all(&vec![b'x'; 1536 * 1024]).await.unwrap();
    wait_hits(&backend, 1).await;
    drop(client);
    assert_released(&b, Duration::from_secs(3), "upload abandoned").await;
}

// ---------------------------------------------------------------------------------------------
// Backend set changes

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_removed_while_requests_are_in_flight_and_queued_releases_everything() {
    let release = Arc::new(tokio::sync::Notify::new());
    let served = Arc::new(AtomicUsize::new(0));
    let backend = {
        let (release, served) = (Arc::clone(&release), Arc::clone(&served));
        spawn_backend(move |_request| {
            let (release, served) = (Arc::clone(&release), Arc::clone(&served));
            async move {
                release.notified().await;
                served.fetch_add(1, Ordering::SeqCst);
                respond(StatusCode::OK, "late")
            }
        })
        .await
    };
    let mut config = qll_held();
    config.queue.timeout = Duration::from_millis(800);
    let (router, b) = routed(&backend, config).await;
    let url = router.url("/generate");
    let first = tokio::spawn(get_owned(url.clone()));
    wait_hits(&backend, 1).await;
    let second = tokio::spawn(get_owned(url.clone()));
    assert!(
        eventually(Duration::from_secs(3), async || router
            .balancer
            .queue_depth()
            == 1)
        .await
    );
    set_backends(router.addr, &[]).await;
    assert_eq!(b.in_flight(), 1);
    release.notify_one();
    let (status, _) = first.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_released(&b, Duration::from_secs(3), "removed backend").await;
    let (status, _) = second.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_queue_empty(&router, Duration::from_secs(1), "removed backend").await;
    // Added again: a new backend, nothing in flight.
    set_backends(router.addr, &[backend.host_port()]).await;
    let again = backend_of(&router, &backend.host_port());
    assert_eq!(counters(&again), (0, 0, 0, 0));
}

async fn get_owned(url: String) -> (StatusCode, String) {
    get(&url).await
}

// ---------------------------------------------------------------------------------------------
// The router queue

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_timeout_deadline_and_eviction_leave_nothing_behind() {
    let backend = hanging_backend().await;
    let mut config = qll_held();
    config.queue.timeout = Duration::from_millis(400);
    config.queue.max_size = 1;
    let (router, b) = routed(&backend, config).await;
    let mut first = TcpStream::connect(router.addr).await.unwrap();
    first.write_all(GET).await.unwrap();
    wait_hits(&backend, 1).await;
    // Queue timeout.
    let (status, _) = get(&router.url("/generate")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_queue_empty(&router, Duration::from_secs(1), "queue timeout").await;
    // Deadline header.
    let request = Request::get(router.url("/generate"))
        .header("x-request-deadline-ms", "100")
        .body(full(""))
        .unwrap();
    let (status, _, _) = send(request).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_queue_empty(&router, Duration::from_secs(1), "deadline").await;
    // Eviction: the second queued request evicts the first.
    let url = router.url("/generate");
    let evicted = tokio::spawn(get_owned(url.clone()));
    assert!(
        eventually(Duration::from_secs(3), async || router
            .balancer
            .queue_depth()
            == 1)
        .await
    );
    let later = tokio::spawn(get_owned(url.clone()));
    let (status, _) = evicted.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, _) = later.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_queue_empty(&router, Duration::from_secs(1), "eviction").await;
    assert_eq!(b.in_flight(), 1);
    drop(first);
    assert_released(&b, Duration::from_secs(3), "queue refusals").await;
    assert_eq!(backend.hits(), 1);
}

// ---------------------------------------------------------------------------------------------
// HTTP/2 reset while the body is sent

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_reset_while_the_body_is_sent_releases_the_backend() {
    let backend = spawn_backend(|request: Request<hyper::body::Incoming>| async move {
        let _ = http_body_util::BodyExt::collect(request.into_body()).await;
        respond(StatusCode::OK, "read")
    })
    .await;
    let (router, b) = routed(&backend, round_robin()).await;
    let (mut sender, _connection) = h2_connection(&router).await;
    let (body_sender, body) = channel_body();
    let request = Request::post(router.url("/upload"))
        .header("content-length", (4 * 1024 * 1024).to_string())
        .body(body)
        .unwrap();
    let pending = tokio::spawn(sender.send_request(request));
    body_sender
        .send(Bytes::from(vec![b'x'; 64 * 1024]))
        .await
        .unwrap();
    wait_hits(&backend, 1).await;
    assert_eq!(b.in_flight(), 1);
    pending.abort();
    assert_released(&b, Duration::from_secs(3), "h2 RST while sending the body").await;
    drop(body_sender);
}

// ---------------------------------------------------------------------------------------------
// Draining

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_finishes_in_flight_and_queued_requests_and_releases_them() {
    // `notify_one` keeps a permit for a handler that has not reached its wait yet; the
    // second request's handler may still be on its way there when the backend counts it.
    let release = Arc::new(tokio::sync::Notify::new());
    let backend = {
        let release = Arc::clone(&release);
        spawn_backend(move |_request| {
            let release = Arc::clone(&release);
            async move {
                release.notified().await;
                respond(StatusCode::OK, "done")
            }
        })
        .await
    };
    let mut config = qll_held();
    config.shutdown.timeout = Duration::from_secs(5);
    let mut router = start_router(config).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let b = backend_of(&router, &backend.host_port());
    let url = router.url("/generate");
    let first = tokio::spawn(get_owned(url.clone()));
    wait_hits(&backend, 1).await;
    let second = tokio::spawn(get_owned(url.clone()));
    assert!(
        eventually(Duration::from_secs(3), async || router
            .balancer
            .queue_depth()
            == 1)
        .await
    );
    let stopped = router.begin_shutdown();
    tokio::time::sleep(Duration::from_millis(100)).await;
    release.notify_one();
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    wait_hits(&backend, 2).await;
    release.notify_one();
    assert_eq!(second.await.unwrap().0, StatusCode::OK);
    tokio::time::timeout(Duration::from_secs(5), stopped)
        .await
        .expect("drained")
        .unwrap();
    assert_released(&b, Duration::from_secs(1), "drain").await;
    assert_eq!(router.balancer.queue_depth(), 0);
}
