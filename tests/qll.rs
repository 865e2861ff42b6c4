//! queued-least-latency over real sockets: dead and failing replicas, clients leaving the queue,
//! and a stress run with cancellations and backend set changes.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use http::{Request, StatusCode};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_refusing_connections_costs_at_most_two_percent() {
    let (_healthy, addrs) = three_healthy_and(refusing_addr(), 1, Duration::from_millis(20)).await;
    // Retries off: the strategy rule alone must keep the dead replica from attracting traffic.
    let mut config = qll();
    config.retry.max_attempts = 1;
    let router = start_router(config).await;
    set_backends(router.addr, &addrs).await;
    let statuses = run_load(&router, 300, 8).await;
    let errors = statuses.iter().filter(|s| **s != StatusCode::OK).count();
    assert_eq!(statuses.len(), 300);
    eprintln!("refusing replica: {errors} of 300 requests failed");
    assert!(errors <= 6, "{errors} of 300 failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_answering_500_at_once_costs_at_most_ten_percent() {
    let failing =
        spawn_backend(|_request| async { respond(StatusCode::INTERNAL_SERVER_ERROR, "boom") })
            .await;
    let (_healthy, addrs) =
        three_healthy_and(failing.host_port(), 2, Duration::from_millis(20)).await;
    let mut config = qll();
    config.retry.max_attempts = 1;
    let router = start_router(config).await;
    set_backends(router.addr, &addrs).await;
    let statuses = run_load(&router, 300, 8).await;
    let errors = statuses.iter().filter(|s| **s != StatusCode::OK).count();
    eprintln!("failing replica: {errors} of 300 requests failed");
    assert!(errors <= 30, "{errors} of 300 failed");
    assert_eq!(errors, failing.hits());
}

/// Waits (bounded) until the router's queue depth is `depth`.
async fn wait_for_queue_depth(router: &TestRouter, depth: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while router.balancer.queue_depth() != depth {
        assert!(
            tokio::time::Instant::now() < deadline,
            "queue depth stuck at {}",
            router.balancer.queue_depth()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_while_queued_is_never_sent_upstream() {
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let gate = Arc::clone(&release);
    let backend = spawn_backend(move |_request| {
        let gate = Arc::clone(&gate);
        async move {
            gate.acquire().await.unwrap().forget();
            respond(StatusCode::OK, "ok")
        }
    })
    .await;
    // A limit of one until the backend has answered: the first request holds it, the rest
    // must queue.
    let router = start_router(qll_held()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let url = router.url("/first");
    let first = tokio::spawn(async move { get(&url).await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while backend.hits() == 0 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Two clients queue, one without and one with a request body, and hang up.
    for raw in [
        "GET /gone HTTP/1.1\r\nhost: x\r\n\r\n",
        "POST /gone HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello",
    ] {
        let mut stream = TcpStream::connect(router.addr).await.unwrap();
        stream.write_all(raw.as_bytes()).await.unwrap();
        wait_for_queue_depth(&router, 1).await;
        drop(stream);
        wait_for_queue_depth(&router, 0).await;
    }
    release.add_permits(10);
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    // A later request goes through, and the backend saw only the live ones.
    assert_eq!(get(&router.url("/after")).await.0, StatusCode::OK);
    assert_eq!(backend.hits(), 2);
    let (_, metrics) = get(&router.url("/_custom_router/metrics")).await;
    assert!(
        metrics.contains("custom_router_requests_cancelled_total{band=\"normal\"} 2"),
        "{metrics}"
    );
    assert_eq!(router.balancer.backends()[0].in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_every_request_is_answered_or_cancelled_exactly_once() {
    const TOTAL: usize = 5000;
    const CONCURRENCY: usize = 48;
    // Each backend echoes the request id and records every id it sees.
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut backends = Vec::new();
    for _ in 0..3 {
        let seen = Arc::clone(&seen);
        backends.push(
            spawn_backend(move |request: Request<hyper::body::Incoming>| {
                let seen = Arc::clone(&seen);
                async move {
                    let id = request.uri().path().trim_start_matches('/').to_owned();
                    seen.lock().unwrap().push(id.clone());
                    let delay = id.parse::<u64>().unwrap_or(0) % 4;
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                    respond(StatusCode::OK, id)
                }
            })
            .await,
        );
    }
    let addrs: Vec<String> = backends.iter().map(FakeBackend::host_port).collect();
    let mut config = qll();
    config.queue.max_size = 64;
    let router = start_router(config).await;
    set_backends(router.addr, &addrs).await;

    let next = Arc::new(AtomicUsize::new(0));
    let answered: Arc<Mutex<Vec<String>>> = Arc::default();
    let rejected = Arc::new(AtomicUsize::new(0));
    let cancelled = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for worker in 0..CONCURRENCY {
        let (next, answered, rejected, cancelled) = (
            Arc::clone(&next),
            Arc::clone(&answered),
            Arc::clone(&rejected),
            Arc::clone(&cancelled),
        );
        let base = router.url("/");
        workers.push(tokio::spawn(async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (worker as u64 + 1));
            let client = client();
            loop {
                let id = next.fetch_add(1, Ordering::SeqCst);
                if id >= TOTAL {
                    break;
                }
                let request = Request::get(format!("{base}{id}")).body(full("")).unwrap();
                let exchange = async {
                    let response = client.request(request).await.unwrap();
                    let status = response.status();
                    let body = http_body_util::BodyExt::collect(response.into_body())
                        .await
                        .unwrap();
                    (status, String::from_utf8(body.to_bytes().to_vec()).unwrap())
                };
                // One request in ten gives up after 0–5 ms: queued, in flight or already done.
                let outcome = if rng.below(10) == 0 {
                    tokio::time::timeout(Duration::from_millis(rng.below(6)), exchange)
                        .await
                        .ok()
                } else {
                    Some(exchange.await)
                };
                match outcome {
                    None => {
                        cancelled.fetch_add(1, Ordering::SeqCst);
                    }
                    Some((StatusCode::OK, body)) => {
                        assert_eq!(body, id.to_string());
                        answered.lock().unwrap().push(body);
                    }
                    Some((StatusCode::SERVICE_UNAVAILABLE, _)) => {
                        rejected.fetch_add(1, Ordering::SeqCst);
                    }
                    Some((status, body)) => panic!("request {id}: {status} {body}"),
                }
            }
        }));
    }
    // Meanwhile the platform keeps changing the backend set.
    let changer = {
        let addrs = addrs.clone();
        let router_addr = router.addr;
        let next = Arc::clone(&next);
        tokio::spawn(async move {
            let mut rng = Rng(42);
            while next.load(Ordering::SeqCst) < TOTAL {
                let subset: Vec<String> = addrs
                    .iter()
                    .filter(|_| rng.below(3) != 0)
                    .cloned()
                    .collect();
                let subset = if subset.is_empty() {
                    vec![addrs[0].clone()]
                } else {
                    subset
                };
                set_backends(router_addr, &subset).await;
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
            set_backends(router_addr, &addrs).await;
        })
    };
    for worker in workers {
        worker.await.unwrap();
    }
    changer.await.unwrap();

    let answered = answered.lock().unwrap().clone();
    let outcomes =
        answered.len() + rejected.load(Ordering::SeqCst) + cancelled.load(Ordering::SeqCst);
    assert_eq!(outcomes, TOTAL, "every request ends exactly once");
    let unique: HashSet<&String> = answered.iter().collect();
    assert_eq!(unique.len(), answered.len(), "no request answered twice");
    let seen = seen.lock().unwrap().clone();
    let seen_unique: HashSet<&String> = seen.iter().collect();
    assert_eq!(
        seen_unique.len(),
        seen.len(),
        "no request sent upstream twice"
    );
    assert!(answered.iter().all(|id| seen_unique.contains(id)));

    // Everything drains: nothing queued, nothing in flight anywhere.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let busy: usize = router
            .balancer
            .backends()
            .iter()
            .map(|b| b.in_flight())
            .sum();
        if busy == 0 && router.balancer.queue_depth() == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{busy} still in flight"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, health) = get_json(&router.url("/_custom_router/health")).await;
    assert_eq!(health["queue_depth"], 0);
    for backend in health["backends"].as_array().unwrap() {
        assert_eq!(backend["in_flight"], 0, "{health}");
    }
}
