//! The balancer: backend snapshot, admission queue and dispatcher, outcome recording.
//!
//! A request is *admitted* by [`Balancer::admit`]. Fast path: when nobody is waiting and the
//! strategy picks a backend at once, the request leaves with a [`Lease`] without waiting for any
//! other task. Otherwise it is judged against its deadline at the queue's measured dispatch rate
//! and the fleet's time from dispatch to first byte (503 `overloaded` at once if its answer would
//! start too late), joins the bounded queue (priority
//! bands, fair shares between tenants: [`queue`]) and waits until dispatched or until its
//! deadline (503).
//!
//! There is no dispatcher task and no polling: whoever changes something that may let the next
//! request go — a finished request, a new backend set, an arriving request — runs
//! `Balancer::dispatch_locked` under the queue lock, which hands leases to waiters in the queue's
//! order for as long as the strategy picks a backend. A waiter whose client went away removes itself
//! from the queue when its future is dropped, so it is never sent upstream.
//!
//! The queue lock is a `std::sync::Mutex` that is never held across an await.

mod availability;
mod lease;
mod queue;
mod tuning;

pub use availability::AvailabilityConfig;
use lease::Choice;
pub use lease::{Finish, Lease};
pub use queue::{Admission, Band};
use queue::{FirstByteTime, Place, Queue};
pub use tuning::{PrefixIndexConfig, QueueConfig, Tuning};

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use opentelemetry::KeyValue;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::backend::{Backend, BackendAddr};
use crate::classify::Class;
use crate::metrics::{Metrics, MetricsError, Snapshot};
use crate::strategy::{Candidates, Outcome, RequestInfo, Strategy};

/// Why a request was answered by the router instead of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// The strategy had no backend and does not queue (e.g. round-robin with an empty set).
    NoBackend,
    /// The queue was full: this was the oldest request of the tenant holding the most in the
    /// lowest band, or a newcomer from a band lower than every queued one.
    Evicted,
    /// The request waited `queue.timeout` in the queue.
    Timeout,
    /// The router is going away.
    ShuttingDown,
    /// Every backend that could take the request answered that it is busy.
    Busy,
    /// The request's answer would not start before its deadline (at the queue's measured
    /// dispatch rate and the fleet's time to first byte)
    /// (or the queue held `queue.shed_ratio` times the requests in flight); the value is the
    /// predicted start (with `queue.shed_ratio`, the queue's drain time), in whole seconds (at
    /// least 1).
    Overloaded(u32),
}

impl Rejection {
    /// The client-facing message.
    pub fn message(self) -> &'static str {
        match self {
            Rejection::NoBackend => "no backend available",
            Rejection::Evicted => "router queue full: this request gave way to others",
            Rejection::Timeout => "request timed out waiting in the router queue",
            Rejection::ShuttingDown => "router is shutting down",
            Rejection::Busy => "every backend that could take the request is busy",
            Rejection::Overloaded(_) => {
                "router overloaded: the queue ahead of this request would not let its answer start before its deadline"
            }
        }
    }

    /// Seconds for the `Retry-After` header.
    pub fn retry_after(self) -> u32 {
        match self {
            Rejection::Overloaded(seconds) => seconds.max(1),
            _ => 1,
        }
    }
}

/// Sends readmission probes (`GET availability.health_check_path`): the balancer decides when, the
/// upstream side how ([`crate::health`]).
pub trait Probe: Send + Sync + 'static {
    /// Whether `backend` answers `GET path` with a 2xx (the balancer bounds the wait).
    fn probe<'a>(
        &'a self,
        backend: &'a Arc<Backend>,
        path: &'a str,
    ) -> Pin<Box<dyn Future<Output = bool> + Send + 'a>>;
}

/// Shared routing state. See the module docs.
pub struct Balancer {
    /// Every backend of the current set (health, metrics).
    backends: Arc<Snapshot>,
    /// The backends strategies pick from: not ejected, not paused (see `availability`).
    eligible: Snapshot,
    /// The strategy in use; replaced by a configuration reload.
    strategy: ArcSwap<Arc<dyn Strategy>>,
    queue: Mutex<Queue>,
    queue_depth: Arc<AtomicUsize>,
    /// Leases held, on any backend (those of removed backends included).
    leased: AtomicUsize,
    /// Dispatch to first byte, over the fleet: a queued request's answer starts that long
    /// after it leaves the queue.
    first_byte_time: FirstByteTime,
    tuning: ArcSwap<Tuning>,
    metrics: Metrics,
    /// Sends readmission probes; without one, an expired ejection readmits at once.
    prober: OnceLock<Arc<dyn Probe>>,
    draining: AtomicBool,
    panic_mode: AtomicBool,
    /// Whether a set-backends call replaced the configured backends (discovery then stops).
    set_by_admin: AtomicBool,
}

impl std::fmt::Debug for Balancer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Balancer")
            .field("strategy", &self.strategy.load().name())
            .field("queue_depth", &self.queue_depth())
            .finish_non_exhaustive()
    }
}

impl Balancer {
    /// A balancer with no backends, held to `tuning`, picking with `strategy`.
    pub fn new(tuning: Tuning, strategy: Arc<dyn Strategy>) -> Result<Arc<Self>, MetricsError> {
        let backends: Arc<Snapshot> = Arc::new(Snapshot::from_pointee(Vec::new()));
        let queue_depth = Arc::new(AtomicUsize::new(0));
        let metrics = Metrics::new(Arc::clone(&backends), Arc::clone(&queue_depth))?;
        Ok(Arc::new(Self {
            backends,
            eligible: Snapshot::from_pointee(Vec::new()),
            strategy: ArcSwap::from_pointee(strategy),
            queue: Mutex::new(Queue::default()),
            queue_depth,
            leased: AtomicUsize::new(0),
            first_byte_time: FirstByteTime::default(),
            tuning: ArcSwap::from_pointee(tuning),
            metrics,
            prober: OnceLock::new(),
            draining: AtomicBool::new(false),
            panic_mode: AtomicBool::new(false),
            set_by_admin: AtomicBool::new(false),
        }))
    }

    /// Sets what sends readmission probes (once; later calls are ignored).
    pub fn set_prober(&self, prober: Arc<dyn Probe>) {
        let _ = self.prober.set(prober);
    }

    /// Applies a reloaded configuration to new requests: `tuning`, and `strategy` when it
    /// changed (kept otherwise, so that what it learned is kept). Requests in flight and queued
    /// keep their leases and places; the queue is looked at again at once.
    pub fn reconfigure(self: &Arc<Self>, tuning: Tuning, strategy: Option<Arc<dyn Strategy>>) {
        self.tuning.store(Arc::new(tuning));
        if let Some(strategy) = strategy {
            strategy.on_backends_changed(&self.eligible.load());
            self.strategy.store(Arc::new(strategy));
        }
        let mut queue = self.lock();
        self.dispatch_locked(&mut queue);
    }

    /// Notes that the admin API replaced the backend set: configured discovery stops.
    pub fn mark_set_by_admin(&self) {
        self.set_by_admin.store(true, Ordering::SeqCst);
    }

    /// Whether the admin API replaced the backend set.
    pub fn backends_set_by_admin(&self) -> bool {
        self.set_by_admin.load(Ordering::SeqCst)
    }

    /// Marks the router as draining (health answers 503).
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether the router is draining.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Whether every available backend is ejected and all are used anyway.
    pub fn in_panic_mode(&self) -> bool {
        self.panic_mode.load(Ordering::Relaxed)
    }

    /// The backends strategies currently pick from.
    pub fn eligible(&self) -> Arc<Vec<Arc<Backend>>> {
        self.eligible.load_full()
    }

    /// Picks among `candidates`: the strategy's choice, unless it is slow-starting and its ramp
    /// declines this pick, in which case the strategy chooses among the others.
    fn pick(&self, info: &RequestInfo, candidates: Candidates<'_>) -> Option<Choice> {
        let strategy = self.strategy.load();
        let first = strategy.pick(info, candidates)?;
        debug_assert!(
            candidates.get(first.index).is_some(),
            "picked an excluded backend"
        );
        let chosen = &candidates.all()[first.index];
        if candidates.iter().any(|(other, _)| other != first.index) && !self.ramp_admits(chosen) {
            if let Some(other) = strategy.pick(info, candidates.declining(chosen)) {
                return Some(Choice::of(candidates, other));
            }
            // The first choice stands, and with it what its pick said of the limit.
        }
        Some(Choice::of(candidates, first))
    }

    /// The metrics instruments.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// What the strategy will see of `request`: its method, its affinity key
    /// ([`Strategy::request_key`]) and, for a strategy that reads prompts or when tenants share
    /// the queue by cost (`queue.tenant_header`), its prompt.
    pub fn request_info(&self, request: &crate::strategy::RequestView<'_>) -> RequestInfo {
        let strategy = self.strategy.load();
        RequestInfo {
            method: request.method().clone(),
            key: strategy.request_key(request),
            prompt: if strategy.reads_prompts()
                || !self.tuning.load().queue.tenant_header.is_empty()
            {
                request.prompt().cloned()
            } else {
                None
            },
            ahead_of_older: false,
        }
    }

    /// How `request` is queued if it has to wait: its band, tenant and deadline, read from the
    /// headers `[queue]` names.
    pub fn admission(&self, request: &crate::strategy::RequestView<'_>) -> Admission {
        let tuning = self.tuning.load();
        let queue = &tuning.queue;
        let header = |name: &str| {
            if name.is_empty() {
                None
            } else {
                request.header(name)
            }
        };
        Admission {
            band: header(&queue.priority_header).map_or(Band::Normal, Band::of_header),
            tenant: header(&queue.tenant_header).map_or(0, tenant_key),
            deadline: header(&queue.deadline_header).and_then(|value| {
                let millis: u64 = std::str::from_utf8(value).ok()?.trim().parse().ok()?;
                Some(Duration::from_millis(millis))
            }),
        }
    }

    /// The strategy in use.
    pub fn strategy(&self) -> Arc<dyn Strategy> {
        Arc::clone(&self.strategy.load())
    }

    /// The current backends.
    pub fn backends(&self) -> Arc<Vec<Arc<Backend>>> {
        self.backends.load_full()
    }

    /// Requests waiting in the queue.
    pub fn queue_depth(&self) -> usize {
        self.queue_depth.load(Ordering::SeqCst)
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while holding the lock cannot leave the queue half-updated in a way that matters
        // more than refusing all traffic would, so poisoning is ignored.
        self.queue
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Replaces the backend set atomically and returns the new list.
    ///
    /// Backends present before and after keep their `Arc` and statistics; new addresses start
    /// fresh. Duplicates (same canonical address) collapse, first occurrence wins.
    pub fn set_backends(self: &Arc<Self>, addrs: Vec<BackendAddr>) -> Arc<Vec<Arc<Backend>>> {
        let mut queue = self.lock();
        self.set_backends_locked(&mut queue, addrs)
    }

    /// [`Balancer::set_backends`] for configured discovery: nothing is replaced (and `None`
    /// returned) once the admin API has replaced the set. The mark is read under the lock the
    /// replacement holds, and set-backends marks before it replaces, so a set-backends call is
    /// never overwritten by a discovery result that was checked before it.
    pub fn set_discovered_backends(
        self: &Arc<Self>,
        addrs: Vec<BackendAddr>,
    ) -> Option<Arc<Vec<Arc<Backend>>>> {
        let mut queue = self.lock();
        if self.backends_set_by_admin() {
            return None;
        }
        Some(self.set_backends_locked(&mut queue, addrs))
    }

    fn set_backends_locked(
        self: &Arc<Self>,
        queue: &mut Queue,
        addrs: Vec<BackendAddr>,
    ) -> Arc<Vec<Arc<Backend>>> {
        let current = self.backends.load();
        let mut next: Vec<Arc<Backend>> = Vec::with_capacity(addrs.len());
        for addr in addrs {
            if next.iter().any(|b| b.addr() == &addr) {
                continue;
            }
            let backend = current
                .iter()
                .find(|b| b.addr() == &addr)
                .cloned()
                .unwrap_or_else(|| {
                    let tokens = self.tuning.load().prefix_index.capacity_tokens;
                    Arc::new(Backend::with_prefix_capacity(addr, tokens))
                });
            next.push(backend);
        }
        let next = Arc::new(next);
        self.backends.store(Arc::clone(&next));
        self.refresh_eligible_locked(queue);
        next
    }

    /// Picks for `info` among `candidates` other than `excluded`; among all of them when every
    /// candidate is excluded (a request that tried every backend may go back to one rather
    /// than wait for a backend that does not exist).
    fn pick_excluding(
        &self,
        info: &RequestInfo,
        candidates: &[Arc<Backend>],
        excluded: &[Arc<Backend>],
    ) -> Option<Choice> {
        let others = Candidates::new(candidates).excluding(excluded);
        if excluded.is_empty() || !others.is_empty() {
            self.pick(info, others)
        } else {
            self.pick(info, Candidates::new(candidates))
        }
    }

    /// Admits one request: returns a lease on a backend, possibly after waiting in the queue
    /// (as a `normal` request of no tenant, with the queue's timeout).
    pub async fn admit(self: &Arc<Self>, info: RequestInfo) -> Result<Lease, Rejection> {
        self.admit_as(info, Admission::default()).await
    }

    /// [`Balancer::admit`] for a request queued as `admission` says.
    pub async fn admit_as(
        self: &Arc<Self>,
        info: RequestInfo,
        admission: Admission,
    ) -> Result<Lease, Rejection> {
        self.admit_excluding(info, admission, Vec::new()).await
    }

    /// [`Balancer::admit_as`] for a request that must not go to `excluded` while another
    /// backend is eligible.
    async fn admit_excluding(
        self: &Arc<Self>,
        info: RequestInfo,
        admission: Admission,
        excluded: Vec<Arc<Backend>>,
    ) -> Result<Lease, Rejection> {
        let (place, reply, deadline) = {
            let mut queue = self.lock();
            if queue.is_empty() {
                if let Some(choice) = self.pick_excluding(&info, &self.eligible.load(), &excluded) {
                    let lease = Lease::new(self, choice, &info);
                    drop(queue);
                    return Ok(lease);
                }
            }
            if !self.strategy.load().queues_when_unavailable() {
                drop(queue);
                self.metrics.rejected.add(1, &[]);
                return Err(Rejection::NoBackend);
            }
            let band = KeyValue::new("band", admission.band.as_str());
            if let Some(drain) = self.overloaded_locked(&queue) {
                drop(queue);
                self.metrics
                    .shed
                    .add(1, &[band, KeyValue::new("reason", "ratio")]);
                return Err(Rejection::Overloaded(drain));
            }
            // The clock is read only for a request that waits.
            let now = Instant::now();
            let timeout = self.tuning.load().queue.timeout;
            let patience = admission.deadline.map_or(timeout, |d| d.min(timeout));
            let cost = request_cost(&info);
            let ahead = queue.ahead_of(&admission, cost);
            if let Some(wait) = queue.rate.predicted_wait(ahead, now) {
                let start = wait + self.first_byte_time.expected();
                if start > patience {
                    drop(queue);
                    self.metrics
                        .shed
                        .add(1, &[band, KeyValue::new("reason", "deadline")]);
                    let seconds = start.as_secs_f64().ceil().clamp(1.0, 3600.0) as u32;
                    return Err(Rejection::Overloaded(seconds));
                }
            }
            // A full queue makes room by evicting from its lowest band; a newcomer of a band
            // lower still is the one that does not get in.
            if queue.len() >= self.tuning.load().queue.max_size
                && queue
                    .lowest_band()
                    .is_some_and(|lowest| admission.band > lowest)
            {
                drop(queue);
                self.metrics.evicted.add(1, &[band]);
                return Err(Rejection::Evicted);
            }
            let (place, reply) =
                self.enqueue_locked(&mut queue, info, &admission, cost, excluded, now);
            (place, reply, now + patience)
        };
        let mut waiting = Waiting {
            balancer: self,
            place,
            reply,
            settled: false,
        };
        waiting.wait(deadline).await
    }

    /// Admits a retry on a backend not in `tried`: picked now if the strategy can, else through
    /// the queue (queueing strategies). When every eligible backend was tried, only `requeue`
    /// sends it through the queue again (a busy backend comes back when its pause ends);
    /// otherwise `Ok(None)`: there is nowhere else to go.
    pub async fn admit_retry(
        self: &Arc<Self>,
        info: RequestInfo,
        admission: Admission,
        tried: &[Arc<Backend>],
        requeue: bool,
    ) -> Result<Option<Lease>, Rejection> {
        let untried_exist = {
            let queue = self.lock();
            let eligible = self.eligible.load();
            let untried = Candidates::new(&eligible).excluding(tried);
            if queue.is_empty() && !untried.is_empty() {
                if let Some(choice) = self.pick(&info, untried) {
                    let lease = Lease::new(self, choice, &info);
                    drop(queue);
                    return Ok(Some(lease));
                }
            }
            !untried.is_empty()
        };
        if (untried_exist || requeue) && self.strategy.load().queues_when_unavailable() {
            // Waiting for an untried backend if one exists; else (a busy answer) for any.
            let excluded = if untried_exist {
                tried.to_vec()
            } else {
                Vec::new()
            };
            return self
                .admit_excluding(info, admission, excluded)
                .await
                .map(Some);
        }
        Ok(None)
    }

    /// Load shedding: `Some(seconds to drain the queue)` when a new request should be refused
    /// because the queue already holds `queue.shed_ratio` times the requests in flight.
    ///
    /// By Little's law the backends finish about `in_flight / latency` requests per second, so a
    /// request joining a queue of `q` waits about `q / in_flight` request latencies: the ratio
    /// bounds the wait in units of the backends' own latency. Nothing is shed while a backend has
    /// no latency yet (its capacity is unknown, e.g. it was just added) or nothing is in flight
    /// (the queue waits for backends, not for capacity).
    fn overloaded_locked(&self, queue: &Queue) -> Option<u32> {
        let ratio = self.tuning.load().queue.shed_ratio;
        let queued = queue.len();
        // Cheap test first: the backends' in-flight counts add up to at most the leases held.
        if ratio <= 0.0
            || queued == 0
            || (queued as f64) < ratio * self.leased.load(Ordering::Relaxed) as f64
        {
            return None;
        }
        let backends = self.backends.load();
        let mut in_flight = 0usize;
        let mut per_second = 0.0;
        for backend in backends.iter() {
            let latency = backend.ewma_latency()?;
            let busy = backend.in_flight();
            in_flight += busy;
            per_second += busy as f64 / latency.max(1e-3);
        }
        if in_flight == 0 || (queued as f64) < ratio * in_flight as f64 {
            return None;
        }
        let drain = (queued as f64 / per_second).ceil();
        Some(drain.clamp(1.0, 3600.0) as u32)
    }

    fn enqueue_locked(
        self: &Arc<Self>,
        queue: &mut Queue,
        info: RequestInfo,
        admission: &Admission,
        cost: u64,
        excluded: Vec<Arc<Backend>>,
        enqueued_at: Instant,
    ) -> (Place, oneshot::Receiver<Result<Lease, Rejection>>) {
        if queue.len() >= self.tuning.load().queue.max_size {
            if let Some(evicted) = queue.evict() {
                self.metrics
                    .evicted
                    .add(1, &[KeyValue::new("band", evicted.band.as_str())]);
                let _ = evicted.reply.send(Err(Rejection::Evicted));
            }
        }
        let (sender, receiver) = oneshot::channel();
        let place = queue.push(info, excluded, admission, cost, enqueued_at, sender);
        self.queue_depth.store(queue.len(), Ordering::SeqCst);
        // Something may have freed up between the fast-path pick and now.
        self.dispatch_locked(queue);
        (place, receiver)
    }

    /// Hands leases to waiters in the queue's order (bands, then fair shares) while the strategy
    /// picks a backend for the next one.
    fn dispatch_locked(self: &Arc<Self>, queue: &mut Queue) {
        if queue.is_empty() {
            return;
        }
        let backends = self.eligible.load();
        let now = Instant::now();
        let aging = self.tuning.load().queue.priority_aging;
        while let Some(place) = queue.next(now, aging) {
            let Some(head) = queue.get(place) else {
                break;
            };
            // A request the queue's order puts ahead of an older one is told so (a copy of what
            // the strategy sees, made only then).
            let ahead;
            let info = if queue.ahead_of_older(place) {
                ahead = RequestInfo {
                    ahead_of_older: true,
                    ..head.info.clone()
                };
                &ahead
            } else {
                &head.info
            };
            let choice = match self.pick_excluding(info, &backends, &head.excluded) {
                Some(choice) => choice,
                // A retry waiting for a backend it has not tried holds up no one: with others
                // queued behind it, it takes a backend it tried that has room now.
                None if !head.excluded.is_empty() && queue.len() > 1 => {
                    match self.pick_excluding(info, &backends, &[]) {
                        Some(choice) => choice,
                        None => break,
                    }
                }
                None => break,
            };
            let Some(waiter) = queue.dispatch(place, now, aging) else {
                break;
            };
            let lease = Lease::new(self, choice, &waiter.info);
            let waited = now
                .saturating_duration_since(waiter.enqueued_at)
                .as_secs_f64();
            let band = [KeyValue::new("band", waiter.band.as_str())];
            match waiter.reply.send(Ok(lease)) {
                Ok(()) => self.metrics.queue_wait.record(waited, &band),
                Err(Ok(lease)) => {
                    // The client left without its future removing it: release silently, as the
                    // lock is held and a normal release would try to dispatch again.
                    lease.release_locked();
                    self.metrics.cancelled.add(1, &band);
                }
                Err(Err(_)) => {}
            }
        }
        self.queue_depth.store(queue.len(), Ordering::SeqCst);
    }

    /// Called after a lease is released or a first byte arrives: lets the queue head go if
    /// anything waits.
    fn capacity_freed(self: &Arc<Self>) {
        if self.queue_depth.load(Ordering::SeqCst) > 0 {
            let mut queue = self.lock();
            self.dispatch_locked(&mut queue);
        }
    }

    /// Records how `lease`'s request ended on its backend after `latency` and tells the strategy;
    /// returns whether the attempt failed.
    fn record_outcome(self: &Arc<Self>, lease: &Lease, finish: &Finish, latency: Duration) -> bool {
        let backend = &lease.backend;
        // The attempt's class, judged once: the sample, the strategy and availability read it.
        let class = Class::of(finish.status, finish.error, finish.retry_after);
        let failed = class.counts_as_failed();
        let measured = latency.as_secs_f64();
        let tuning = self.tuning.load();
        // A failure must never look fast: it counts at least as the latency threshold.
        let sample = if failed {
            measured.max(tuning.latency.threshold.as_secs_f64())
        } else {
            measured
        };
        backend.record_latency(sample, tuning.latency.ewma_alpha);
        backend.record_completed(tuning.queue.completed_cap());
        drop(tuning);
        if let Some(status) = finish.status {
            backend.record_status(status);
        }
        if let Some(kind) = finish.error {
            backend.record_error(kind);
        }
        self.strategy.load().on_outcome(
            backend,
            &Outcome {
                latency: sample,
                failed,
                first_byte: lease.first_byte.map(|d| d.as_secs_f64()),
                bytes: finish.bytes,
                streamed: lease.streamed,
                usage: finish.usage,
                in_flight: lease.in_flight,
                prompt_tokens: lease.prompt_tokens,
                recall: lease.recall,
            },
        );
        self.metrics.request_duration.record(measured, &[]);
        self.apply_class(backend, class);
        failed
    }
}

/// A queued request waiting for its lease; removes itself from the queue if dropped early.
struct Waiting<'a> {
    balancer: &'a Arc<Balancer>,
    place: Place,
    reply: oneshot::Receiver<Result<Lease, Rejection>>,
    settled: bool,
}

impl Waiting<'_> {
    async fn wait(&mut self, deadline: Instant) -> Result<Lease, Rejection> {
        let result = match tokio::time::timeout_at(deadline, &mut self.reply).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(Rejection::ShuttingDown),
            Err(_elapsed) => {
                if self.balancer.remove_waiter(self.place) {
                    self.balancer
                        .metrics
                        .timeout
                        .add(1, &[KeyValue::new("band", self.place.band.as_str())]);
                    Err(Rejection::Timeout)
                } else {
                    // Dispatched or evicted under the lock just before the deadline.
                    self.reply.try_recv().unwrap_or(Err(Rejection::Timeout))
                }
            }
        };
        self.settled = true;
        result
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let band = [KeyValue::new("band", self.place.band.as_str())];
        if self.balancer.remove_waiter(self.place) {
            self.balancer.metrics.cancelled.add(1, &band);
        } else if let Ok(Ok(lease)) = self.reply.try_recv() {
            // Dispatched but never used: give the slot back (this may dispatch the next waiter).
            self.balancer.metrics.cancelled.add(1, &band);
            drop(lease);
        }
    }
}

impl Balancer {
    /// Takes a waiter out of the queue; `false` if it was already dispatched or evicted. When the
    /// next one to go leaves, the new next one gets its chance (a strategy may place it where it
    /// could not place the old one).
    fn remove_waiter(self: &Arc<Self>, place: Place) -> bool {
        let mut queue = self.lock();
        let aging = self.tuning.load().queue.priority_aging;
        let was_next = queue.next(Instant::now(), aging) == Some(place);
        let removed = queue.remove(place).is_some();
        if was_next {
            self.dispatch_locked(&mut queue);
        }
        self.queue_depth.store(queue.len(), Ordering::SeqCst);
        removed
    }
}

/// What a request weighs in the tenants' fair shares: its prompt tokens and the output tokens
/// it is expected to generate (every request without a prompt weighs the same).
fn request_cost(info: &RequestInfo) -> u64 {
    info.prompt_tokens() + u64::from(info.expected_output_tokens())
}

/// The hash a tenant header's value is kept as (never the value itself): xxh3, as the prompt's
/// blocks; 0 is no tenant.
fn tenant_key(value: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(value).max(1)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::prompt::Prompt;
    use crate::strategy::{FirstByte, Pick};

    /// Takes a request on the one backend while it holds fewer than one plus the first bytes
    /// seen: each first byte is room for one more.
    #[derive(Default)]
    struct RoomPerFirstByte {
        first_bytes: AtomicUsize,
    }

    impl Strategy for RoomPerFirstByte {
        fn name(&self) -> &'static str {
            "room-per-first-byte"
        }

        fn pick(&self, _request: &RequestInfo, candidates: Candidates<'_>) -> Option<Pick> {
            let (index, backend) = candidates.iter().next()?;
            (backend.in_flight() <= self.first_bytes.load(Ordering::SeqCst))
                .then_some(Pick::at(index))
        }

        fn on_first_byte(&self, _backend: &Backend, _first_byte: &FirstByte) {
            self.first_bytes.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct Headers(Vec<(&'static str, &'static str)>);

    impl crate::strategy::HeaderLookup for Headers {
        fn visit<'s>(
            &'s self,
            name: &str,
            each: &mut dyn FnMut(&'s [u8]) -> std::ops::ControlFlow<()>,
        ) {
            for (field, value) in &self.0 {
                if *field == name && each(value.as_bytes()).is_break() {
                    return;
                }
            }
        }
    }

    fn admission_of(tuning: Tuning, headers: Vec<(&'static str, &'static str)>) -> Admission {
        let balancer = Balancer::new(tuning, Arc::new(RoomPerFirstByte::default())).unwrap();
        let headers = Headers(headers);
        let uri = http::Uri::from_static("/v1/chat/completions");
        let view = crate::strategy::RequestView::new(&http::Method::POST, &uri, &headers, b"");
        balancer.admission(&view)
    }

    #[test]
    fn the_queue_reads_band_tenant_and_deadline_from_the_configured_headers() {
        let mut tuning = Tuning::default();
        let admission = admission_of(
            tuning.clone(),
            vec![
                ("x-priority", " HIGH "),
                ("x-request-deadline-ms", "1500"),
                ("x-tenant-id", "acme"),
            ],
        );
        // No tenant header configured: every request is the same tenant.
        assert_eq!(
            admission,
            Admission {
                band: Band::High,
                tenant: 0,
                deadline: Some(Duration::from_millis(1500)),
            }
        );
        tuning.queue.tenant_header = "x-tenant-id".to_owned();
        let acme = admission_of(tuning.clone(), vec![("x-tenant-id", "acme")]);
        let other = admission_of(tuning.clone(), vec![("x-tenant-id", "globex")]);
        assert_ne!(acme.tenant, 0);
        assert_ne!(acme.tenant, other.tenant);
        assert_eq!(
            acme,
            admission_of(tuning.clone(), vec![("x-tenant-id", "acme")])
        );
        // Unknown bands are normal; a deadline that is not a number is no deadline.
        let odd = admission_of(
            tuning.clone(),
            vec![("x-priority", "urgent"), ("x-request-deadline-ms", "soon")],
        );
        assert_eq!((odd.band, odd.deadline), (Band::Normal, None));
        assert_eq!(
            admission_of(tuning.clone(), vec![("x-priority", "low")]).band,
            Band::Low
        );
        // An empty header name reads nothing.
        tuning.queue.priority_header = String::new();
        assert_eq!(
            admission_of(tuning, vec![("x-priority", "high")]).band,
            Band::Normal
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_streams_first_byte_lets_a_waiting_request_go_before_any_answer_ends() {
        let balancer =
            Balancer::new(Tuning::default(), Arc::new(RoomPerFirstByte::default())).unwrap();
        balancer.set_backends(vec!["127.0.0.1:9".parse().unwrap()]);
        let mut first = balancer.admit(RequestInfo::default()).await.unwrap();
        let waiting = tokio::spawn({
            let balancer = Arc::clone(&balancer);
            async move { balancer.admit(RequestInfo::default()).await }
        });
        tokio::task::yield_now().await;
        assert_eq!(balancer.queue_depth(), 1);
        // The first answer is a stream; its first byte arrives and it goes on streaming.
        first.mark_streamed();
        first.mark_first_byte();
        let second = tokio::time::timeout(Duration::from_millis(1), waiting)
            .await
            .expect("dispatched at the first byte")
            .unwrap()
            .unwrap();
        assert_eq!(balancer.queue_depth(), 0);
        drop((first, second));
    }

    #[tokio::test(start_paused = true)]
    async fn a_prompt_counts_as_held_while_its_request_runs_and_ages_from_its_end() {
        let balancer =
            Balancer::new(Tuning::default(), Arc::new(RoomPerFirstByte::default())).unwrap();
        balancer.set_backends(vec!["127.0.0.1:9".parse().unwrap()]);
        let with_prompt = |text: &str| RequestInfo {
            prompt: Prompt::of_body(format!(r#"{{"prompt":"{text}"}}"#).as_bytes()).map(Arc::new),
            ..RequestInfo::default()
        };
        let (long, other) = (
            with_prompt(&"a".repeat(4_096)),
            with_prompt(&"b".repeat(4_096)),
        );
        let blocks = long.prompt.as_ref().unwrap().blocks.clone();
        // The strategy takes one more request per first byte seen.
        let mut first = balancer.admit(long).await.unwrap();
        first.mark_first_byte();
        let backend = Arc::clone(first.backend());
        let index = backend.prefixes();
        // A reach shorter than the prompt sent after it: while the first request runs, its
        // blocks are held all the same.
        index.set_reach_blocks(4);
        let mut second = balancer.admit(other).await.unwrap();
        second.mark_first_byte();
        second.finish(Finish::default());
        assert!(blocks.len() > 4);
        assert_eq!(index.matched_blocks(&blocks), blocks.len());
        // It ends: held as the youngest, then aging past the reach like any other.
        first.finish(Finish::default());
        assert_eq!(index.matched_blocks(&blocks), blocks.len());
        let third = balancer
            .admit(with_prompt(&"c".repeat(4_096)))
            .await
            .unwrap();
        drop(third);
        assert_eq!(index.matched_blocks(&blocks), 0);
    }

    /// Takes one request at a time on the first backend; keeps each taken request's key and
    /// whether it came ahead of an older one.
    #[derive(Default)]
    struct OneAtATime {
        taken: std::sync::Mutex<Vec<(Option<u64>, bool)>>,
    }

    impl Strategy for OneAtATime {
        fn name(&self) -> &'static str {
            "one-at-a-time"
        }

        fn pick(&self, request: &RequestInfo, candidates: Candidates<'_>) -> Option<Pick> {
            let (index, backend) = candidates.iter().next()?;
            if backend.in_flight() > 0 {
                return None;
            }
            let taken = (request.key, request.ahead_of_older);
            self.taken.lock().unwrap().push(taken);
            Some(Pick::at(index))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_strategy_sees_which_queued_requests_go_ahead_of_older_ones() {
        let strategy = Arc::new(OneAtATime::default());
        let balancer = Balancer::new(Tuning::default(), strategy.clone()).unwrap();
        balancer.set_backends(vec!["127.0.0.1:9".parse().unwrap()]);
        let keyed = |key| RequestInfo {
            key: Some(key),
            ..RequestInfo::default()
        };
        let first = balancer.admit(keyed(0)).await.unwrap();
        // A normal request queues, then a high one: the high one goes first, past the older.
        let normal = tokio::spawn({
            let balancer = Arc::clone(&balancer);
            async move { balancer.admit(keyed(1)).await }
        });
        tokio::task::yield_now().await;
        let high = tokio::spawn({
            let balancer = Arc::clone(&balancer);
            let admission = Admission {
                band: Band::High,
                ..Admission::default()
            };
            async move { balancer.admit_as(keyed(2), admission).await }
        });
        tokio::task::yield_now().await;
        assert_eq!(balancer.queue_depth(), 2);
        drop(first);
        let high = high.await.unwrap().unwrap();
        drop(high);
        let normal = normal.await.unwrap().unwrap();
        drop(normal);
        assert_eq!(
            *strategy.taken.lock().unwrap(),
            [(Some(0), false), (Some(2), true), (Some(1), false)]
        );
    }

    /// Takes every request on the first backend, those sent while it already holds one past its
    /// limit; keeps what each first byte said of it.
    #[derive(Default)]
    struct OneThenPast {
        past_limit: std::sync::Mutex<Vec<bool>>,
    }

    impl Strategy for OneThenPast {
        fn name(&self) -> &'static str {
            "one-then-past"
        }

        fn pick(&self, _request: &RequestInfo, candidates: Candidates<'_>) -> Option<Pick> {
            let (index, backend) = candidates.iter().next()?;
            Some(Pick {
                index,
                past_limit: backend.in_flight() >= 1,
            })
        }

        fn on_first_byte(&self, _backend: &Backend, first_byte: &FirstByte) {
            self.past_limit.lock().unwrap().push(first_byte.past_limit);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_byte_says_whether_its_own_pick_sent_it_past_the_limit() {
        let strategy = Arc::new(OneThenPast::default());
        let balancer = Balancer::new(Tuning::default(), strategy.clone()).unwrap();
        balancer.set_backends(vec!["127.0.0.1:9".parse().unwrap()]);
        let mut first = balancer.admit(RequestInfo::default()).await.unwrap();
        let noted = RequestInfo::default();
        let mut second = balancer.admit(noted.clone()).await.unwrap();
        // The second's first byte comes first: each carries its own pick's note.
        second.mark_first_byte();
        first.mark_first_byte();
        assert_eq!(*strategy.past_limit.lock().unwrap(), [true, false]);
        drop((first, second));
        // A request once sent past the limit is picked afresh: what a pick says holds for its
        // own backend only.
        let mut again = balancer.admit(noted).await.unwrap();
        again.mark_first_byte();
        assert_eq!(*strategy.past_limit.lock().unwrap(), [true, false, false]);
    }

    /// Takes only the first backend, always past its limit.
    #[derive(Default)]
    struct FirstPast {
        past_limit: std::sync::Mutex<Vec<bool>>,
    }

    impl Strategy for FirstPast {
        fn name(&self) -> &'static str {
            "first-past"
        }

        fn pick(&self, _request: &RequestInfo, candidates: Candidates<'_>) -> Option<Pick> {
            let (index, _) = candidates.iter().next().filter(|(index, _)| *index == 0)?;
            Some(Pick::past_limit_at(index))
        }

        fn on_first_byte(&self, _backend: &Backend, first_byte: &FirstByte) {
            self.past_limit.lock().unwrap().push(first_byte.past_limit);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_choice_kept_after_the_ramp_declined_it_keeps_its_note() {
        // Both backends are new: the slow-start ramp declines nine picks in ten. The strategy
        // has nothing else to offer, so its first choice stands, past the limit as it was.
        let mut tuning = Tuning::default();
        tuning.availability.slow_start = Some(Duration::from_secs(3600));
        let strategy = Arc::new(FirstPast::default());
        let balancer = Balancer::new(tuning, strategy.clone()).unwrap();
        balancer.set_backends(vec![
            "127.0.0.1:9".parse().unwrap(),
            "127.0.0.1:10".parse().unwrap(),
        ]);
        for _ in 0..40 {
            let mut lease = balancer.admit(RequestInfo::default()).await.unwrap();
            lease.mark_first_byte();
        }
        assert_eq!(*strategy.past_limit.lock().unwrap(), [true; 40]);
    }

    #[test]
    fn discovery_never_replaces_a_set_the_admin_api_replaced() {
        let balancer =
            Balancer::new(Tuning::default(), Arc::new(RoomPerFirstByte::default())).unwrap();
        let addr = |text: &str| text.parse::<BackendAddr>().unwrap();
        let listed = |balancer: &Arc<Balancer>| -> Vec<String> {
            balancer
                .backends()
                .iter()
                .map(|b| b.addr().to_string())
                .collect()
        };
        assert!(
            balancer
                .set_discovered_backends(vec![addr("10.0.0.1:80")])
                .is_some()
        );
        assert_eq!(listed(&balancer), ["10.0.0.1:80"]);
        balancer.mark_set_by_admin();
        balancer.set_backends(vec![addr("10.0.0.2:80")]);
        assert!(
            balancer
                .set_discovered_backends(vec![addr("10.0.0.3:80")])
                .is_none()
        );
        assert_eq!(listed(&balancer), ["10.0.0.2:80"]);
    }
}
