//! Backend availability and shutdown at their edges: an ejection series across failed
//! readmission probes, the failure run across an ejection, a huge `Retry-After`, a connection
//! that sent nothing when draining starts, a second signal, and a request queued at the drain.

mod common;
mod paused;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use custom_router::backend::{Backend, ErrorKind};
use custom_router::balancer::{Balancer, Finish, Probe};
use custom_router::config::{Config, Settings};
use paused::{admit_now, settle, with_backends};
use tokio::time::advance;

fn balancer(configure: impl FnOnce(&mut Config)) -> Arc<Balancer> {
    let mut config = Config::default();
    config.strategy.name = "round-robin".to_owned();
    configure(&mut config);
    Settings::from_config(config).unwrap().balancer().unwrap()
}

const REFUSED: Finish = Finish {
    status: None,
    error: Some(ErrorKind::Connect),
    retry_after: None,
    bytes: 0,
    usage: None,
};

/// Fails one request on `target` (admitting until it is picked).
async fn fail_on(balancer: &Arc<Balancer>, target: &str, finish: Finish) {
    for _ in 0..100 {
        let lease = admit_now(balancer).await;
        if lease.backend().addr().as_str() == target {
            lease.finish(finish);
            settle().await;
            return;
        }
    }
    panic!("{target} never picked");
}

/// A probe whose answer the test sets.
struct Switch(Arc<AtomicBool>);

impl Probe for Switch {
    fn probe<'a>(
        &'a self,
        _backend: &'a Arc<Backend>,
        _path: &'a str,
    ) -> Pin<Box<dyn Future<Output = bool> + Send + 'a>> {
        let passed = self.0.load(Ordering::SeqCst);
        Box::pin(async move { passed })
    }
}

/// reliability.md: a series ends when a backend is ejected more than 2 × `max_ejection_time`
/// after its previous ejection; a re-ejection after a failed probe is the series' latest, so a
/// replica that stayed down and flaps right after readmission gets the next length, not the
/// shortest.
#[tokio::test(start_paused = true)]
async fn a_reejection_after_a_failed_probe_continues_the_series() {
    let balancer = balancer(|c| {
        c.availability.consecutive_failures = 1;
        c.availability.ejection_time = Duration::from_secs(10);
        c.availability.max_ejection_time = Duration::from_secs(20);
        c.availability.health_check_path = Some("/health".to_owned());
    });
    let passes = Arc::new(AtomicBool::new(false));
    balancer.set_prober(Arc::new(Switch(Arc::clone(&passes))));
    let backends = with_backends(&balancer, &["bad:1", "good:1"]);
    // t = 0: first ejection (10 s).
    fail_on(&balancer, "bad:1", REFUSED).await;
    assert!(backends[0].availability().is_ejected());
    // Probes fail at t = 10, 30, 50: re-ejected for 20 s (capped) each time.
    for _ in 0..6 {
        advance(Duration::from_secs(10)).await;
        settle().await;
    }
    assert!(backends[0].availability().is_ejected());
    // t = 70: the probe passes, the backend is readmitted; its previous ejection began at t = 50.
    passes.store(true, Ordering::SeqCst);
    advance(Duration::from_secs(11)).await;
    settle().await;
    assert!(
        !backends[0].availability().is_ejected(),
        "readmitted after a passing probe"
    );
    // It fails again at once: 31 s or less after the start of its previous ejection (< 40 s),
    // so the series goes on and the ejection is the capped 20 s, not the first 10 s.
    passes.store(false, Ordering::SeqCst);
    fail_on(&balancer, "bad:1", REFUSED).await;
    let until = backends[0].availability().ejected_until.expect("ejected");
    let length = until - tokio::time::Instant::now();
    assert_eq!(
        length,
        Duration::from_secs(20),
        "the series restarted: ejected for ejection_time only, although the previous \
         ejection began less than 2 × max_ejection_time ago"
    );
}

/// A replica that crashes with many requests in flight: the failures of the other requests in
/// flight at its ejection do not carry over, so a readmitted backend needs a whole run of
/// `consecutive_failures` again.
#[tokio::test(start_paused = true)]
async fn a_readmitted_backend_needs_a_full_run_of_failures_to_be_ejected_again() {
    let balancer = balancer(|c| {
        c.availability.consecutive_failures = 3;
        c.availability.ejection_time = Duration::from_secs(10);
    });
    let backends = with_backends(&balancer, &["bad:1", "good:1"]);
    // Six requests in flight on bad:1 when it crashes.
    let mut in_flight = Vec::new();
    while in_flight.len() < 6 {
        let lease = admit_now(&balancer).await;
        if lease.backend().addr().as_str() == "bad:1" {
            in_flight.push(lease);
        }
    }
    for lease in in_flight {
        lease.finish(REFUSED);
        settle().await;
    }
    assert!(backends[0].availability().is_ejected());
    // Readmitted after 10 s; the replica is back.
    advance(Duration::from_secs(11)).await;
    settle().await;
    assert!(!backends[0].availability().is_ejected());
    let carried = backends[0].failures_in_a_row();
    // One transient failure after readmission.
    fail_on(&balancer, "bad:1", REFUSED).await;
    assert!(
        !backends[0].availability().is_ejected(),
        "one failure after readmission ejected the backend again (it was readmitted with a run \
         of {carried} failures, counted while it was ejected)"
    );
}

/// The pause is the `Retry-After` seconds, at most `availability.max_busy_pause`: a value too
/// large for a `Duration` (RFC 9110 allows any digit count) is a long pause, not a 1 s one.
#[test]
fn a_huge_retry_after_pauses_for_the_longest_not_one_second() {
    use custom_router::proxy::retry_after_value;
    assert_eq!(
        retry_after_value(b"120"),
        Some(Duration::from_secs(120)),
        "control"
    );
    let huge = retry_after_value(b"99999999999999999999999").unwrap();
    assert!(
        huge >= Duration::from_secs(60),
        "Retry-After: 99999999999999999999999 read as {huge:?}"
    );
}

/// On SIGTERM a connection that was accepted but has sent nothing yet (a load balancer's or a
/// client's pre-opened connection) is closed: the process exits at once with nothing in flight,
/// not after `limits.header_read_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_an_idle_fresh_connection_exits_promptly() {
    let mut router = common::spawn_router_process(&[
        ("CUSTOM_ROUTER_STRATEGY", "round-robin"),
        ("CUSTOM_ROUTER_HEADER_READ_TIMEOUT", "20"),
        ("CUSTOM_ROUTER_SHUTDOWN_TIMEOUT", "30"),
    ]);
    let idle = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    // Let the router accept it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    router.terminate();
    let code = tokio::task::spawn_blocking(move || router.wait_exit(Duration::from_secs(8)))
        .await
        .unwrap();
    drop(idle);
    assert_eq!(
        code,
        Some(0),
        "no exit within 8 s of SIGTERM with nothing in flight ({:?} elapsed)",
        started.elapsed()
    );
}

/// A second SIGTERM or SIGINT during the drain stops at once (nginx's fast shutdown), with a
/// long stream still in flight, instead of waiting for `shutdown.timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_during_draining_stops_the_router() {
    use common::{respond, set_backends, spawn_backend};
    use http::StatusCode;
    let (started_sender, mut started) = tokio::sync::mpsc::channel::<()>(1);
    let backend = spawn_backend(move |_request| {
        let started = started_sender.clone();
        async move {
            let _ = started.send(()).await;
            tokio::time::sleep(Duration::from_secs(60)).await;
            respond(StatusCode::OK, "late")
        }
    })
    .await;
    let mut router = common::spawn_router_process(&[
        ("CUSTOM_ROUTER_STRATEGY", "round-robin"),
        ("CUSTOM_ROUTER_SHUTDOWN_TIMEOUT", "30"),
    ]);
    set_backends(router.addr, &[backend.host_port()]).await;
    let url = format!("http://{}/generate", router.addr);
    let _in_flight = tokio::spawn(async move {
        let request = http::Request::get(url).body(common::full("")).unwrap();
        let _ = common::client().request(request).await;
    });
    started.recv().await.unwrap();
    router.terminate();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let status = std::process::Command::new("kill")
        .args(["-INT", &router.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let code = tokio::task::spawn_blocking(move || router.wait_exit(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(
        code.is_some(),
        "still running 5 s after SIGTERM then SIGINT (waits for the 30 s shutdown timeout)"
    );
}

/// The drain rule "requests waiting in the queue stay there and are dispatched as backends free
/// up": a request re-queued behind a busy pause when draining starts is answered by the
/// backend, not dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_when_draining_starts_is_still_answered() {
    use common::{get, qll, respond, set_backends, spawn_backend, start_router};
    use http::StatusCode;
    use std::sync::atomic::AtomicUsize;
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&calls);
    let backend = spawn_backend(move |_request| {
        let first = seen.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            if first {
                let mut busy = respond(StatusCode::TOO_MANY_REQUESTS, "busy");
                busy.headers_mut()
                    .insert("retry-after", http::HeaderValue::from_static("1"));
                busy
            } else {
                respond(StatusCode::OK, "served")
            }
        }
    })
    .await;
    let mut router = start_router(qll()).await;
    set_backends(router.addr, &[backend.host_port()]).await;
    let url = router.url("/generate");
    let request = tokio::spawn(async move { get(&url).await });
    let balancer = Arc::clone(&router.balancer);
    assert!(
        common::eventually(Duration::from_secs(2), async || balancer.queue_depth() == 1).await,
        "the request waits in the queue behind the pause"
    );
    let shutdown = router.begin_shutdown();
    let (status, body) = tokio::time::timeout(Duration::from_secs(5), request)
        .await
        .expect("answered")
        .unwrap();
    assert_eq!((status, body.as_str()), (StatusCode::OK, "served"));
    tokio::time::timeout(Duration::from_secs(5), shutdown)
        .await
        .expect("router stopped")
        .unwrap();
}
