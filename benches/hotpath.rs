//! Hot-path costs, measured with criterion: one pick plus one dispatch with 256 backends and
//! 10 000 requests waiting in the queue, and the memory one queued request holds.
//!
//! `cargo bench --bench hotpath`. Each iteration releases one in-flight request; the release
//! dispatches the head of the queue (the strategy picks among the 256 backends), the dispatched
//! request takes its lease, and a new request joins the tail so the queue stays at 10 000.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

use criterion::{Criterion, criterion_group, criterion_main};
use custom_router::balancer::{Admission as QueuedAs, Balancer, Finish, Lease, Rejection};
use custom_router::config::{Config, Settings};
use custom_router::strategies::RequestInfo;
use http::StatusCode;

/// Counts live heap bytes, to measure what a queued request holds.
struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const BACKENDS: usize = 256;
const QUEUED: usize = 10_000;

type Admission = Pin<Box<dyn Future<Output = Result<Lease, Rejection>>>>;

/// A request of `tenant` (0: none), queued as a `normal` one.
fn admission(balancer: &Arc<Balancer>, tenant: u64) -> Admission {
    let balancer = Arc::clone(balancer);
    let queued = QueuedAs {
        tenant,
        ..QueuedAs::default()
    };
    Box::pin(async move { balancer.admit_as(RequestInfo::default(), queued).await })
}

fn poll(admission: &mut Admission) -> Poll<Result<Lease, Rejection>> {
    admission
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
}

/// A balancer whose 256 backends are measured and full, with 10 000 requests queued.
struct Loaded {
    balancer: Arc<Balancer>,
    held: Vec<Lease>,
    waiting: VecDeque<Admission>,
    /// Whether each queued request is a tenant of its own (else none has a tenant).
    tenants: bool,
    /// The tenant of the next request, when `tenants`.
    next_tenant: u64,
}

fn loaded(strategy: &str, params: &[(&str, &str)], tenants: bool) -> Loaded {
    let mut config = Config::default();
    config.strategy.name = strategy.to_owned();
    for (key, value) in params {
        config
            .strategy
            .params
            .insert((*key).into(), figment::value::Value::from(*value));
    }
    config.queue.max_size = QUEUED + 2000;
    // Loading the queue takes long enough (with a tenant per request, most of a second) that
    // the first measured dispatch rate is low: a long timeout keeps every request patient.
    config.queue.timeout = std::time::Duration::from_secs(1_000_000);
    let balancer = Settings::from_config(config).unwrap().balancer().unwrap();
    let addrs = (0..BACKENDS)
        .map(|i| {
            format!("10.0.{}.{}:8000", i / 256, i % 256)
                .parse()
                .unwrap()
        })
        .collect();
    balancer.set_backends(addrs);
    // Probe every backend once so each has a measurement.
    let probes: Vec<Lease> = (0..BACKENDS)
        .map(|_| match poll(&mut admission(&balancer, 0)) {
            Poll::Ready(Ok(lease)) => lease,
            _ => panic!("a fresh backend takes a probe"),
        })
        .collect();
    for lease in probes {
        lease.finish(Finish {
            status: Some(StatusCode::OK),
            error: None,
            retry_after: None,
            bytes: 4096,
            usage: None,
        });
    }
    let mut held = Vec::new();
    let mut waiting = VecDeque::new();
    let mut next_tenant = 1;
    while waiting.len() < QUEUED {
        let mut next = admission(&balancer, if tenants { next_tenant } else { 0 });
        next_tenant += 1;
        match poll(&mut next) {
            Poll::Ready(Ok(lease)) => held.push(lease),
            Poll::Ready(Err(rejection)) => panic!("{rejection:?}"),
            Poll::Pending => waiting.push_back(next),
        }
    }
    assert_eq!(balancer.queue_depth(), QUEUED);
    Loaded {
        balancer,
        held,
        waiting,
        tenants,
        next_tenant,
    }
}

impl Loaded {
    /// Releases one request, takes the dispatched head's lease, queues a new request.
    fn step(&mut self) {
        drop(self.held.pop().expect("requests in flight"));
        let mut head = self.waiting.pop_front().expect("requests waiting");
        match poll(&mut head) {
            Poll::Ready(Ok(lease)) => self.held.push(lease),
            other => panic!("the head was not dispatched: {:?}", other.map(|r| r.err())),
        }
        let tenant = if self.tenants { self.next_tenant } else { 0 };
        self.next_tenant += 1;
        let mut next = admission(&self.balancer, tenant);
        let polled = poll(&mut next);
        assert!(polled.is_pending(), "{:?}", polled.map(|r| r.err()));
        self.waiting.push_back(next);
    }
}

/// A label, a strategy name, its params, and whether each queued request is its own tenant.
type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], bool);

fn pick_and_dispatch(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _context = runtime.enter();
    let cases: [Case; 3] = [
        (
            "queued-least-latency (load)",
            "queued-least-latency",
            &[],
            false,
        ),
        (
            "queued-least-latency (ewma)",
            "queued-least-latency",
            &[("score", "ewma")],
            false,
        ),
        (
            "queued-least-latency (load), a tenant per queued request",
            "queued-least-latency",
            &[],
            true,
        ),
    ];
    for (label, strategy, params, tenants) in cases {
        let before = LIVE_BYTES.load(Ordering::Relaxed);
        let mut state = loaded(strategy, params, tenants);
        let held_bytes = LIVE_BYTES.load(Ordering::Relaxed) - before;
        // What 10 000 queued requests hold (their futures, queue entries and reply channels),
        // over what the in-flight leases and the balancer hold.
        let queue_bytes = {
            let before_queue = LIVE_BYTES.load(Ordering::Relaxed);
            let extra: Vec<Admission> = (0..1000)
                .map(|_| {
                    let mut next = admission(&state.balancer, 0);
                    assert!(poll(&mut next).is_pending());
                    next
                })
                .collect();
            let per_request = (LIVE_BYTES.load(Ordering::Relaxed) - before_queue) / extra.len();
            drop(extra);
            per_request
        };
        println!(
            "{label}: {BACKENDS} backends, {QUEUED} queued: {} bytes in all, {queue_bytes} bytes per queued request",
            held_bytes
        );
        c.bench_function(
            &format!("{label}: pick + dispatch, {BACKENDS} backends, {QUEUED} queued"),
            |b| b.iter(|| state.step()),
        );
    }
}

criterion_group!(benches, pick_and_dispatch);
criterion_main!(benches);
