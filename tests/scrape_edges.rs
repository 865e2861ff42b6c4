//! The engine-metrics scraper and DNS discovery at their edges: scrapes on kept-alive
//! connections, one timeout per scrape (TGI's `/info` apart), large and trickling texts, stale
//! values (capacity included) no longer read, the engine's queue counted for every request,
//! `dns+https` certificates checked for the name, and seconds too small to be a period refused.

mod common;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{TestBody, eventually, get, respond, round_robin, start_router, tls_certs};
use custom_router::engine_metrics::EngineKind;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

const DEADLINE: Duration = Duration::from_secs(10);

fn vllm_text(running: u32) -> String {
    format!(
        "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{model_name=\"m\"}} {running}.0\n\
         # HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{model_name=\"m\"}} 0.0\n"
    )
}

/// A plain-HTTP backend that counts the TCP connections it accepts and the `/metrics` requests
/// it answers (HTTP/1.1 keep-alive, as vLLM's uvicorn serves).
struct CountingBackend {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicUsize>,
    scrapes: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for CountingBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn counting_backend() -> CountingBackend {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let scrapes = Arc::new(AtomicUsize::new(0));
    let (accepted, scraped) = (Arc::clone(&connections), Arc::clone(&scrapes));
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            accepted.fetch_add(1, Ordering::SeqCst);
            let scraped = Arc::clone(&scraped);
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let scraped = Arc::clone(&scraped);
                    async move {
                        let response: Response<TestBody> = if request.uri().path() == "/metrics" {
                            scraped.fetch_add(1, Ordering::SeqCst);
                            respond(StatusCode::OK, vllm_text(2))
                        } else {
                            respond(StatusCode::OK, "ok")
                        };
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    CountingBackend {
        addr,
        connections,
        scrapes,
        task,
    }
}

/// A round-robin router scraping `backend` as vLLM every 100 ms.
async fn scraped_router(backend: &CountingBackend) -> common::TestRouter {
    let mut config = round_robin();
    config.engine_metrics.kind = EngineKind::Vllm;
    config.engine_metrics.interval = Duration::from_millis(100);
    let router = start_router(config).await;
    router
        .balancer
        .set_backends(vec![backend.addr.to_string().parse().unwrap()]);
    router
}

/// Scrapes go on a kept-alive connection: the body is read to its end and the connection goes
/// back to the backend's idle stack, so a scrape costs no new TCP connection.
#[tokio::test]
async fn scrapes_reuse_one_keep_alive_connection() {
    let backend = counting_backend().await;
    let _router = scraped_router(&backend).await;
    assert!(
        eventually(DEADLINE, async || backend.scrapes.load(Ordering::SeqCst)
            >= 6)
        .await,
        "the backend was not scraped"
    );
    let scrapes = backend.scrapes.load(Ordering::SeqCst);
    let connections = backend.connections.load(Ordering::SeqCst);
    assert!(
        connections <= 2,
        "{scrapes} scrapes opened {connections} TCP connections: the connection is not reused"
    );
}

/// A proxied request leaves its keep-alive connection idle in the pool; a scrape that takes it
/// gives it back, so the next proxied request does not connect again.
#[tokio::test]
async fn a_scrape_does_not_close_the_proxys_idle_connection() {
    let backend = counting_backend().await;
    let router = scraped_router(&backend).await;
    // Proxied traffic and scrapes interleaved over several intervals.
    for _ in 0..10 {
        let (status, _) = get(&router.url("/generate")).await;
        assert_eq!(status, StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let scrapes = backend.scrapes.load(Ordering::SeqCst);
    let connections = backend.connections.load(Ordering::SeqCst);
    assert!(scrapes >= 4, "only {scrapes} scrapes");
    assert!(
        connections <= 3,
        "10 sequential requests and {scrapes} scrapes used {connections} TCP connections"
    );
}

/// `dns+https://NAME:PORT` stands for every address NAME resolves to, each an `https://`
/// backend reached at its IP address whose certificate is checked (and SNI sent) for NAME, as
/// `https://NAME:PORT` would be: a certificate that names the service (no IP SANs for pod
/// addresses, the usual case) is accepted.
#[tokio::test]
async fn dns_https_backends_verify_the_certificate_for_the_name() {
    let certs = tls_certs(&["localhost"]);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let acceptor = certs.acceptor.clone();
    let handshakes = Arc::new(AtomicUsize::new(0));
    let served = Arc::clone(&handshakes);
    let server = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            let served = Arc::clone(&served);
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                served.fetch_add(1, Ordering::SeqCst);
                let service = service_fn(|_request: Request<Incoming>| async {
                    Ok::<_, Infallible>(respond(StatusCode::OK, "tls ok"))
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    // Control: the same backend named `https://localhost:PORT` is reached.
    let mut config = round_robin();
    config.upstream.tls_ca_file = Some(certs.ca_file.clone());
    config.backends = vec![format!("https://localhost:{port}")];
    let control = start_router(config.clone()).await;
    assert_eq!(
        get(&control.url("/generate")).await.0,
        StatusCode::OK,
        "control"
    );
    drop(control);
    config.backends = vec![format!("dns+https://localhost:{port}")];
    config.dns_refresh = Duration::from_millis(100);
    let router = start_router(config).await;
    assert!(
        eventually(DEADLINE, async || !router.balancer.backends().is_empty()).await,
        "localhost was not resolved"
    );
    let mut last = None;
    let reached = eventually(Duration::from_secs(3), async || {
        let answer = get(&router.url("/generate")).await;
        let ok = answer.0 == StatusCode::OK;
        last = Some(answer);
        ok
    })
    .await;
    server.abort();
    let listed: Vec<String> = router
        .balancer
        .backends()
        .iter()
        .map(|b| b.addr().as_str().to_owned())
        .collect();
    assert!(
        reached,
        "backends {listed:?}: no request reached the TLS backend (handshakes completed: {}), last answer {last:?}",
        handshakes.load(Ordering::SeqCst)
    );
}

/// A fake engine: `/metrics` answers `text` (counted), `/info` answers with `info` after
/// `info_delay` (counted; `None`: never).
async fn engine_backend(
    text: String,
    info: Option<Duration>,
) -> (common::FakeBackend, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let scrapes = Arc::new(AtomicUsize::new(0));
    let infos = Arc::new(AtomicUsize::new(0));
    let (s, i) = (Arc::clone(&scrapes), Arc::clone(&infos));
    let fake = common::spawn_backend(move |request| {
        let (s, i, text) = (Arc::clone(&s), Arc::clone(&i), text.clone());
        async move {
            match request.uri().path() {
                "/metrics" => {
                    s.fetch_add(1, Ordering::SeqCst);
                    respond(StatusCode::OK, text)
                }
                "/info" => {
                    i.fetch_add(1, Ordering::SeqCst);
                    match info {
                        Some(delay) => tokio::time::sleep(delay).await,
                        None => std::future::pending::<()>().await,
                    }
                    respond(StatusCode::OK, r#"{"max_concurrent_requests":64}"#)
                }
                _ => respond(StatusCode::NOT_FOUND, "no"),
            }
        }
    })
    .await;
    (fake, scrapes, infos)
}

const TGI_TEXT: &str = "# TYPE tgi_queue_size gauge\ntgi_queue_size 1\n# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 4\n";

/// `engine_metrics.timeout` bounds one scrape. A TGI whose `/info` does not answer holds no
/// scrape: `/info` is asked in a task of its own, so the backend is scraped at the configured
/// rate like any other.
#[tokio::test]
async fn a_tgi_scrape_is_bounded_by_one_timeout() {
    let (tgi, tgi_scrapes, infos) = engine_backend(TGI_TEXT.to_owned(), None).await;
    let (vllm, vllm_scrapes, _) = engine_backend(vllm_text(1), None).await;
    let mut config = round_robin();
    config.engine_metrics.kind = EngineKind::Auto;
    config.engine_metrics.interval = Duration::from_millis(100);
    let router = start_router(config).await;
    router.balancer.set_backends(vec![
        tgi.host_port().parse().unwrap(),
        vllm.host_port().parse().unwrap(),
    ]);
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let (tgi_n, vllm_n) = (
        tgi_scrapes.load(Ordering::SeqCst),
        vllm_scrapes.load(Ordering::SeqCst),
    );
    assert!(vllm_n >= 10, "control scraped only {vllm_n} times");
    assert!(
        tgi_n * 4 >= vllm_n * 3,
        "in 2 s the TGI backend was scraped {tgi_n} times (/info asked {} times), the vLLM one \
         {vllm_n}: a scrape took longer than the timeout",
        infos.load(Ordering::SeqCst)
    );
}

/// A seconds value too small for a nanosecond is a configuration error (exit 2 naming the
/// variable): as a zero `dns_refresh` it would stop discovery at start.
#[test]
fn a_seconds_value_below_a_nanosecond_is_a_configuration_error() {
    for (var, value) in [
        ("CUSTOM_ROUTER_DNS_REFRESH", "0.0000000001"),
        ("CUSTOM_ROUTER_QUEUE_TIMEOUT", "1e-12"),
    ] {
        let output = common::router_command(&[(var, value)])
            .arg("--check-config")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{var}={value}: {stderr}");
        assert!(stderr.contains(var), "{var}={value}: {stderr}");
    }
}

/// A metrics endpoint that sends its head and then trickles body bytes forever is given up at
/// the timeout (counted `timeout`), and its values go stale, while another backend's scrapes go
/// on.
#[tokio::test]
async fn a_trickling_metrics_body_is_given_up_at_the_timeout() {
    let trickle = common::spawn_backend(|_request| async {
        let (sender, body) = common::channel_body();
        tokio::spawn(async move {
            let mut text = vllm_text(3).into_bytes();
            text.extend(std::iter::repeat_n(b'#', 1 << 20));
            for byte in text {
                tokio::time::sleep(Duration::from_millis(5)).await;
                if sender.send(bytes::Bytes::from(vec![byte])).await.is_err() {
                    return;
                }
            }
        });
        let mut response = Response::new(body);
        *response.status_mut() = StatusCode::OK;
        response
    })
    .await;
    let (steady, steady_scrapes, _) = engine_backend(vllm_text(1), None).await;
    let mut config = round_robin();
    config.engine_metrics.kind = EngineKind::Vllm;
    config.engine_metrics.interval = Duration::from_millis(100);
    let router = start_router(config).await;
    let backends = router.balancer.set_backends(vec![
        trickle.host_port().parse().unwrap(),
        steady.host_port().parse().unwrap(),
    ]);
    let timeouts = async || {
        let (_, text) = get(&router.url("/_custom_router/metrics")).await;
        text.lines()
            .find_map(|l| {
                l.strip_prefix("custom_router_engine_scrapes_total{outcome=\"timeout\"} ")
            })
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert!(eventually(DEADLINE, async || timeouts().await >= 3).await);
    assert!(steady_scrapes.load(Ordering::SeqCst) >= 3);
    let now = tokio::time::Instant::now();
    assert!(backends[0].engine().snapshot(now).is_none());
    assert_eq!(
        backends[1].engine().snapshot(now).map(|s| s.running),
        Some(1)
    );
}

mod paused;

/// queued-least-latency's score counts the requests waiting inside the engine (with
/// [engine_metrics] on) for every request, a prompt or none (an embeddings call's `input`, a GET,
/// a multipart upload): none goes to a replica whose engine reports a deep queue while an idle
/// one is there.
#[tokio::test(start_paused = true)]
async fn engine_waiting_counts_for_requests_without_a_prompt() {
    use custom_router::engine_metrics::{Engine, EngineReading};
    use custom_router::prompt::Prompt;
    use custom_router::strategies::RequestInfo;
    use tokio::time::{Instant, advance};

    let picks = async |info: fn() -> RequestInfo| {
        let balancer = paused::ewma_balancer(|config| {
            config.strategy.params.remove("score");
        });
        let backends = paused::with_backends(&balancer, &["10.0.0.1:8000", "10.0.0.2:8000"]);
        // Both measured alike: one request each, 100 ms.
        let one = paused::admit_now(&balancer).await;
        let two = paused::admit_now(&balancer).await;
        advance(Duration::from_millis(100)).await;
        one.finish(paused::OK);
        two.finish(paused::OK);
        paused::settle().await;
        // The first engine reports 100 requests waiting in its own queue; the second none.
        for (backend, waiting) in backends.iter().zip([100, 0]) {
            let reading = EngineReading {
                engine: Engine::Vllm,
                running: 0,
                waiting,
                kv_usage: None,
                prefix_cache: None,
            };
            backend
                .engine()
                .record(&reading, 0, Instant::now(), Duration::from_secs(60));
        }
        let mut leases = Vec::new();
        for _ in 0..2 {
            let lease = tokio::time::timeout(Duration::ZERO, balancer.admit(info()))
                .await
                .expect("admitted at once")
                .unwrap();
            leases.push(lease.backend().addr().to_string());
        }
        leases
    };
    let with_prompt = picks(|| RequestInfo {
        method: http::Method::POST,
        prompt: Some(Arc::new(Prompt {
            tokens: 1,
            max_tokens: None,
            stream: false,
            blocks: Box::new([]),
            conversation: 0,
            answer: None,
        })),
        ..RequestInfo::default()
    })
    .await;
    assert_eq!(with_prompt, ["10.0.0.2:8000", "10.0.0.2:8000"], "control");
    let without_prompt = picks(|| RequestInfo {
        method: http::Method::POST,
        ..RequestInfo::default()
    })
    .await;
    assert_eq!(
        without_prompt,
        ["10.0.0.2:8000", "10.0.0.2:8000"],
        "a prompt-less request went to the engine with 100 requests waiting"
    );
}

/// A metrics text the size of the body cap (8 MiB) of small series (a label-cardinality
/// blow-up) is scanned for the lines of the metrics read, not parsed whole: the scrape stays
/// within its timeout, and a parse past it would be given up (`outcome="timeout"`).
#[tokio::test]
async fn a_huge_metrics_text_is_given_up_at_the_timeout() {
    let mut text = vllm_text(1);
    let mut i = 0u64;
    while text.len() < 8 * 1024 * 1024 - 64 {
        text.push_str(&format!("x{{a=\"{i}\"}} 1\n"));
        i += 1;
    }
    let (fake, scrapes, _) = engine_backend(text, None).await;
    let mut config = round_robin();
    config.engine_metrics.kind = EngineKind::Vllm;
    config.engine_metrics.interval = Duration::from_millis(100);
    config.engine_metrics.stale_after = Some(Duration::from_secs(60));
    let router = start_router(config).await;
    let backend = router
        .balancer
        .set_backends(vec![fake.host_port().parse().unwrap()])[0]
        .clone();
    let counted = async |outcome: &str| {
        let (_, text) = get(&router.url("/_custom_router/metrics")).await;
        let prefix = format!("custom_router_engine_scrapes_total{{outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let started = std::time::Instant::now();
    assert!(
        eventually(Duration::from_secs(30), async || counted("ok").await
            + counted("timeout").await
            + counted("failed").await
            > 0)
        .await
    );
    let took = started.elapsed();
    assert!(scrapes.load(Ordering::SeqCst) >= 1);
    assert_eq!(
        (
            counted("ok").await,
            backend
                .engine()
                .snapshot(tokio::time::Instant::now())
                .is_some()
        ),
        (0, false),
        "a scrape with a 100 ms timeout ran {took:?} and was counted ok"
    );
}

/// Once a backend's engine values are stale, strategies use the router's own signals for it:
/// TGI's `/info` capacity no longer caps it either.
#[tokio::test(start_paused = true)]
async fn a_stale_engine_capacity_is_no_longer_read() {
    use custom_router::engine_metrics::{Engine, EngineReading};
    use custom_router::strategies::RequestInfo;
    use tokio::time::{Instant, advance};

    let balancer = paused::ewma_balancer(|config| {
        config.strategy.params.remove("score");
    });
    let backend = paused::with_backends(&balancer, &["10.0.0.1:8000"]).remove(0);
    let lease = paused::admit_now(&balancer).await;
    advance(Duration::from_millis(100)).await;
    lease.finish(paused::OK);
    paused::settle().await;
    // A TGI scrape and `/info`: capacity 1. Then its scrapes fail for a minute.
    let reading = EngineReading {
        engine: Engine::Tgi,
        running: 0,
        waiting: 0,
        kv_usage: None,
        prefix_cache: None,
    };
    backend
        .engine()
        .record(&reading, 0, Instant::now(), Duration::from_secs(1));
    backend.engine().record_info(Some(1));
    advance(Duration::from_secs(60)).await;
    assert!(backend.engine().snapshot(Instant::now()).is_none(), "stale");
    let _first = paused::admit_now(&balancer).await;
    let second = tokio::time::timeout(Duration::ZERO, balancer.admit(RequestInfo::default())).await;
    assert!(
        second.is_ok(),
        "with stale engine values the router's own limit (initial_limit 4) should apply, but the \
         capacity of 1 from /info still held the second request back"
    );
}
