//! The router queue's order and admission: priority bands, fair shares between tenants, and
//! the dispatch rate that predicts when a new request would start.
//!
//! - **Bands.** Each request is `high`, `normal` or `low` (the `queue.priority_header`; absent
//!   or unknown: `normal`). A higher band dispatches first. Once a request of a lower band has
//!   waited `queue.priority_aging`, at least one dispatch in [`AGED_SHARE`] goes to such aged
//!   requests (the oldest first) while higher bands hold requests: no band starves, and a
//!   higher band keeps the rest of the dispatches however long an overload makes every lower
//!   request wait (an aged request going before every higher one would hand the whole queue
//!   to the lower band as soon as its waits pass the aging time).
//! - **Tenants.** With `queue.tenant_header` set, a band serves its tenants in fair shares of
//!   cost (fair queueing on virtual finish tags): a request's tag is its tenant's last tag, or the band's
//!   virtual time if later, plus its cost (prompt tokens + expected output tokens); the
//!   smallest tag goes first (of equal tags, the one queued first). A tenant sending ten times
//!   as much waits behind itself, not in front of the others; an idle tenant banks no credit.
//!   State is kept only for tenants with requests queued, so memory is bounded by the queue.
//!   Without a tenant header every request is the same tenant and a band is a FIFO.
//! - **Dispatch rate.** While requests wait, the rate at which the queue hands them to backends
//!   is measured (windows of at least [`RATE_WINDOW`], smoothed). A new request would be
//!   dispatched after the requests ahead of it have gone: `(n + 2√n) / rate` for `n = ahead +
//!   1`, with a margin for the dispatches' irregularity; its answer would start the fleet's
//!   time to first byte later ([`FirstByteTime`]). A new set of eligible
//!   backends forgets the rate (capacity is arriving: nothing is refused on the old one).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{Lease, Rejection};
use crate::backend::Backend;
use crate::strategy::RequestInfo;

/// A request's priority band.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Band {
    /// Dispatched first.
    High,
    /// The default.
    #[default]
    Normal,
    /// Dispatched last (aging bounds its wait).
    Low,
}

impl Band {
    /// Every band, highest first.
    pub const ALL: [Band; 3] = [Band::High, Band::Normal, Band::Low];

    /// The band a priority header's value names: `high`, `normal` or `low`, in any case;
    /// anything else is `normal`.
    pub fn of_header(value: &[u8]) -> Band {
        let value = value.trim_ascii();
        if value.eq_ignore_ascii_case(b"high") {
            Band::High
        } else if value.eq_ignore_ascii_case(b"low") {
            Band::Low
        } else {
            Band::Normal
        }
    }

    /// Its name, as in the header and the metrics' `band` attribute.
    pub fn as_str(self) -> &'static str {
        match self {
            Band::High => "high",
            Band::Normal => "normal",
            Band::Low => "low",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// How a request is queued: its band, its tenant and its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Admission {
    /// Its priority band.
    pub band: Band,
    /// A hash of its tenant key (0: no tenant header configured or present).
    pub tenant: u64,
    /// Within how long its answer must start (its first byte), as the client stated it
    /// (`queue.deadline_header`); the queue's `timeout` bounds it.
    pub deadline: Option<Duration>,
}

/// The shortest window a dispatch-rate sample is read over.
pub(super) const RATE_WINDOW: Duration = Duration::from_millis(100);
/// Weight of a new sample in the dispatch rate.
const RATE_SMOOTHING: f64 = 0.3;

/// The rate at which queued requests are dispatched, measured while the queue holds some.
#[derive(Debug, Default)]
pub(super) struct DispatchRate {
    /// Requests per second (`None`: not measured since the last reset).
    per_second: Option<f64>,
    /// The open window: when it began and how many left the queue in it.
    window: Option<(Instant, u32)>,
}

impl DispatchRate {
    /// The queue just became non-empty at `now`.
    fn opened(&mut self, now: Instant) {
        if self.window.is_none() {
            self.window = Some((now, 0));
        }
    }

    /// A queued request was dispatched at `now`; `empty` when none is left.
    fn dispatched(&mut self, now: Instant, empty: bool) {
        let Some((start, count)) = self.window.as_mut() else {
            return;
        };
        *count += 1;
        let elapsed = now.saturating_duration_since(*start);
        if elapsed >= RATE_WINDOW {
            let sample = f64::from(*count) / elapsed.as_secs_f64();
            self.per_second = Some(match self.per_second {
                Some(old) => old + RATE_SMOOTHING * (sample - old),
                None => sample,
            });
            *start = now;
            *count = 0;
        }
        if empty {
            self.window = None;
        }
    }

    /// Capacity changed (a new eligible set): the rate is measured afresh.
    pub(super) fn reset(&mut self) {
        self.per_second = None;
        if let Some((start, count)) = self.window.as_mut() {
            *start = Instant::now();
            *count = 0;
        }
    }

    /// By when a request with `ahead` requests before it would be dispatched, from `now`, with
    /// a margin for the dispatches' irregularity: `(n + 2√n) / rate` for the `n = ahead + 1`
    /// dispatches it waits for (were they a Poisson process, it would go later in about one
    /// case in forty). `None` while the rate is unknown. A window that has run longer than the
    /// rate allows for the dispatches it saw counts at its own, lower rate (the queue may have
    /// stopped moving).
    pub(super) fn predicted_wait(&self, ahead: usize, now: Instant) -> Option<Duration> {
        let mut rate = self.per_second?;
        if let Some((start, count)) = self.window {
            let open = now.saturating_duration_since(start).as_secs_f64();
            if open >= RATE_WINDOW.as_secs_f64() {
                rate = rate.min(f64::from(count + 1) / open);
            }
        }
        let dispatches = ahead as f64 + 1.0;
        let seconds = (dispatches + WAIT_MARGIN * dispatches.sqrt()) / rate.max(1e-6);
        Some(Duration::from_secs_f64(seconds.min(1e6)))
    }
}

/// Standard deviations of the dispatches' count added to a predicted wait.
const WAIT_MARGIN: f64 = 2.0;

/// How long a dispatched request takes to its answer's first byte, over the fleet: a smoothed
/// mean and mean deviation (weights 1/8 and 1/4, as TCP estimates a round trip). Updated
/// without a lock by every first byte (two concurrent updates may keep one of them).
#[derive(Debug)]
pub(super) struct FirstByteTime {
    /// Seconds, as `f64` bits; NaN until the first sample.
    mean: AtomicU64,
    deviation: AtomicU64,
}

impl Default for FirstByteTime {
    fn default() -> Self {
        Self {
            mean: AtomicU64::new(f64::NAN.to_bits()),
            deviation: AtomicU64::new(0f64.to_bits()),
        }
    }
}

impl FirstByteTime {
    /// A first byte `seconds` after its dispatch.
    pub(super) fn record(&self, seconds: f64) {
        let mean = f64::from_bits(self.mean.load(Ordering::Relaxed));
        let (mean, deviation) = if mean.is_nan() {
            (seconds, seconds / 2.0)
        } else {
            let deviation = f64::from_bits(self.deviation.load(Ordering::Relaxed));
            (
                mean + (seconds - mean) / 8.0,
                deviation + ((seconds - mean).abs() - deviation) / 4.0,
            )
        };
        self.mean.store(mean.to_bits(), Ordering::Relaxed);
        self.deviation.store(deviation.to_bits(), Ordering::Relaxed);
    }

    /// How long after its dispatch a request's first byte is due, with a margin: the mean plus
    /// twice the deviation (zero before any first byte).
    pub(super) fn expected(&self) -> Duration {
        let mean = f64::from_bits(self.mean.load(Ordering::Relaxed));
        if mean.is_nan() {
            return Duration::ZERO;
        }
        let deviation = f64::from_bits(self.deviation.load(Ordering::Relaxed));
        Duration::from_secs_f64((mean + 2.0 * deviation).clamp(0.0, 1e6))
    }
}

/// One queued request.
pub(super) struct Waiter {
    seq: u64,
    pub(super) info: RequestInfo,
    /// Backends this request already tried (a retry): picked only when no other is eligible.
    pub(super) excluded: Vec<Arc<Backend>>,
    pub(super) enqueued_at: Instant,
    pub(super) band: Band,
    pub(super) reply: oneshot::Sender<Result<Lease, Rejection>>,
    /// Its fair-queueing tag (see the module docs).
    tag: u64,
}

/// Where a waiter is: its band, tenant and sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place {
    pub(super) band: Band,
    tenant: u64,
    seq: u64,
}

#[derive(Default)]
struct Tenant {
    /// Its requests, oldest (and smallest tag) first.
    waiters: VecDeque<Waiter>,
    /// The tag of its last request.
    last_tag: u64,
}

impl Tenant {
    /// Where its request `seq` is (sequence numbers grow from front to back).
    fn index_of(&self, seq: u64) -> Option<usize> {
        self.waiters.binary_search_by_key(&seq, |w| w.seq).ok()
    }
}

/// One band: its tenants' queues, and indexes over them so that the next request, the oldest
/// one and a new request's place in line are found without a pass over the tenants.
#[derive(Default)]
struct BandQueue {
    tenants: HashMap<u64, Tenant>,
    /// Each tenant's first request as (tag, sequence number, tenant): the first is the next to
    /// dispatch.
    heads: BTreeSet<(u64, u64, u64)>,
    /// Each tenant's first request as (sequence number, tenant): the first is the oldest request
    /// of the band (requests are numbered as they are queued, and a tenant's are in that order).
    arrivals: BTreeSet<(u64, u64)>,
    /// Every queued request's tag, in order. Dispatch takes the smallest and a new request's is
    /// most often the largest, so both ends move in O(1).
    tags: VecDeque<u64>,
    /// The tag of the last request dispatched from it.
    virtual_time: u64,
    len: usize,
}

impl BandQueue {
    /// The tenant whose head has the smallest tag (among equal tags, the one queued first), and
    /// that head's sequence number.
    fn next_head(&self) -> Option<(u64, u64)> {
        self.heads.first().map(|&(_, seq, tenant)| (tenant, seq))
    }

    /// The tenant and sequence number of its oldest request.
    fn oldest_head(&self) -> Option<(u64, u64)> {
        self.arrivals.first().map(|&(seq, tenant)| (tenant, seq))
    }

    /// When its oldest request was queued.
    fn oldest(&self) -> Option<Instant> {
        let &(_, tenant) = self.arrivals.first()?;
        Some(self.tenants.get(&tenant)?.waiters.front()?.enqueued_at)
    }

    /// The tag a new request of `tenant` with `cost` gets: the tenant's last tag, or the band's
    /// virtual time if later, plus the cost.
    fn tag_for(&self, tenant: u64, cost: u64) -> u64 {
        self.tenants
            .get(&tenant)
            .map_or(0, |t| t.last_tag)
            .max(self.virtual_time)
            .saturating_add(cost.max(1))
    }

    /// Requests that go before a new one of `tenant` with `cost`: those with a smaller tag, and
    /// those with the same (queued before it).
    fn ahead_of(&self, tenant: u64, cost: u64) -> usize {
        let tag = self.tag_for(tenant, cost);
        self.tags.partition_point(|&queued| queued <= tag)
    }

    /// Queues `waiter` (its tag already set) for `tenant`.
    fn push(&mut self, tenant: u64, waiter: Waiter) {
        let (tag, seq) = (waiter.tag, waiter.seq);
        let queue = self.tenants.entry(tenant).or_default();
        queue.last_tag = tag;
        if queue.waiters.is_empty() {
            self.heads.insert((tag, seq, tenant));
            self.arrivals.insert((seq, tenant));
        }
        queue.waiters.push_back(waiter);
        let at = self.tags.partition_point(|&queued| queued <= tag);
        self.tags.insert(at, tag);
        self.len += 1;
    }

    /// Takes out the request `seq` of `tenant`.
    fn remove(&mut self, tenant: u64, seq: u64) -> Option<Waiter> {
        let queue = self.tenants.get_mut(&tenant)?;
        let index = queue.index_of(seq)?;
        let waiter = queue.waiters.remove(index)?;
        // A request that leaves unserved charges its tenant nothing: the next one is tagged
        // after the tenant's last request still queued.
        if waiter.tag == queue.last_tag {
            if let Some(last) = queue.waiters.back() {
                queue.last_tag = last.tag;
            }
        }
        if index == 0 {
            self.heads.remove(&(waiter.tag, waiter.seq, tenant));
            self.arrivals.remove(&(waiter.seq, tenant));
            match queue.waiters.front() {
                Some(next) => {
                    self.heads.insert((next.tag, next.seq, tenant));
                    self.arrivals.insert((next.seq, tenant));
                }
                None => {
                    self.tenants.remove(&tenant);
                }
            }
        }
        let at = self.tags.partition_point(|&queued| queued < waiter.tag);
        debug_assert_eq!(self.tags.get(at), Some(&waiter.tag));
        self.tags.remove(at);
        self.len -= 1;
        Some(waiter)
    }
}

/// Of every this many dispatches while a lower band holds a request that waited the aging time,
/// at least one goes to such a request.
pub(super) const AGED_SHARE: u32 = 4;

/// The queue: a [`BandQueue`] per band.
#[derive(Default)]
pub(super) struct Queue {
    bands: [BandQueue; 3],
    next_seq: u64,
    len: usize,
    /// Dispatches from a higher band in a row while an aged request of a lower band waited.
    passed_over: u32,
    /// The dispatch rate.
    pub(super) rate: DispatchRate,
}

impl Queue {
    /// Requests waiting.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Requests that would be dispatched before a new one of `admission` and `cost`: those of
    /// higher bands, and those of its band with a smaller tag.
    pub(super) fn ahead_of(&self, admission: &Admission, cost: u64) -> usize {
        self.bands[..admission.band.index()]
            .iter()
            .map(|band| band.len)
            .sum::<usize>()
            + self.bands[admission.band.index()].ahead_of(admission.tenant, cost)
    }

    /// Queues a request; returns its place.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push(
        &mut self,
        info: RequestInfo,
        excluded: Vec<Arc<Backend>>,
        admission: &Admission,
        cost: u64,
        enqueued_at: Instant,
        reply: oneshot::Sender<Result<Lease, Rejection>>,
    ) -> Place {
        if self.len == 0 {
            self.rate.opened(enqueued_at);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let band = &mut self.bands[admission.band.index()];
        let tag = band.tag_for(admission.tenant, cost);
        band.push(
            admission.tenant,
            Waiter {
                seq,
                info,
                excluded,
                enqueued_at,
                band: admission.band,
                reply,
                tag,
            },
        );
        self.len += 1;
        Place {
            band: admission.band,
            tenant: admission.tenant,
            seq,
        }
    }

    /// The place of the request to dispatch next at `now`: in the highest band holding
    /// requests, unless the higher bands have gone [`AGED_SHARE`] − 1 times in a row past an
    /// aged request (one of a lower band that has waited `aging`; the older band's, if both):
    /// then the aged band's oldest request. Within the highest band, the smallest tag.
    pub(super) fn next(&self, now: Instant, aging: Duration) -> Option<Place> {
        let highest = Band::ALL
            .into_iter()
            .find(|band| self.bands[band.index()].len > 0)?;
        let (band, (tenant, seq)) = match self.aged(now, aging) {
            Some(aged) if self.passed_over + 1 >= AGED_SHARE => {
                (aged, self.bands[aged.index()].oldest_head()?)
            }
            _ => (highest, self.bands[highest.index()].next_head()?),
        };
        Some(Place { band, tenant, seq })
    }

    /// Whether a request queued before the one at `place` still waits: the queue's order (a
    /// higher band, a tenant under its fair share, an aged request) puts `place` ahead of it.
    pub(super) fn ahead_of_older(&self, place: Place) -> bool {
        self.bands.iter().any(|band| {
            band.arrivals
                .first()
                .is_some_and(|&(seq, _)| seq < place.seq)
        })
    }

    /// The lowest band holding requests: the one a full queue evicts from.
    pub(super) fn lowest_band(&self) -> Option<Band> {
        Band::ALL
            .into_iter()
            .rev()
            .find(|band| self.bands[band.index()].len > 0)
    }

    /// The lower band whose oldest request has waited `aging` at `now` (the older one's, if
    /// both have such a request).
    fn aged(&self, now: Instant, aging: Duration) -> Option<Band> {
        Band::ALL[1..]
            .iter()
            .filter_map(|band| {
                let oldest = self.bands[band.index()].oldest()?;
                (now.saturating_duration_since(oldest) >= aging).then_some((oldest, *band))
            })
            .min()
            .map(|(_, band)| band)
    }

    /// The waiter at `place`, if still queued.
    pub(super) fn get(&self, place: Place) -> Option<&Waiter> {
        let tenant = self.bands[place.band.index()].tenants.get(&place.tenant)?;
        tenant.waiters.get(tenant.index_of(place.seq)?)
    }

    /// Takes the waiter at `place` out to dispatch it at `now`: it counts in the dispatch rate
    /// (the last one of a window included, when it empties the queue), and in the aged
    /// requests' share (`aging` as in [`Queue::next`]).
    pub(super) fn dispatch(
        &mut self,
        place: Place,
        now: Instant,
        aging: Duration,
    ) -> Option<Waiter> {
        let aged = self.aged(now, aging);
        let waiter = self.take(place)?;
        self.passed_over = match aged {
            Some(aged) if place.band < aged => self.passed_over + 1,
            _ => 0,
        };
        let band = &mut self.bands[place.band.index()];
        band.virtual_time = band.virtual_time.max(waiter.tag);
        self.rate.dispatched(now, self.len == 0);
        Some(waiter)
    }

    /// Takes the waiter at `place` out (gone, timed out); `None` if it was not queued.
    pub(super) fn remove(&mut self, place: Place) -> Option<Waiter> {
        let waiter = self.take(place)?;
        if self.len == 0 {
            self.rate.window = None;
        }
        Some(waiter)
    }

    fn take(&mut self, place: Place) -> Option<Waiter> {
        let waiter = self.bands[place.band.index()].remove(place.tenant, place.seq)?;
        self.len -= 1;
        Some(waiter)
    }

    /// Takes out the request to evict when the queue is full: in the lowest band holding
    /// requests, the oldest of the tenant holding the most.
    pub(super) fn evict(&mut self) -> Option<Waiter> {
        let band = self.lowest_band()?;
        let queue = &self.bands[band.index()];
        // Of tenants holding as many, the one whose oldest request is the oldest.
        let tenant = queue
            .tenants
            .iter()
            .max_by_key(|(_, t)| {
                let oldest = t.waiters.front().map_or(u64::MAX, |waiter| waiter.seq);
                (t.waiters.len(), std::cmp::Reverse(oldest))
            })
            .map(|(key, _)| *key)?;
        let seq = queue.tenants.get(&tenant)?.waiters.front()?.seq;
        self.remove(Place { band, tenant, seq })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push(queue: &mut Queue, at: Instant) -> Place {
        push_tenant(queue, 0, at)
    }

    fn push_tenant(queue: &mut Queue, tenant: u64, at: Instant) -> Place {
        let (reply, _) = oneshot::channel();
        let admission = Admission {
            tenant,
            ..Admission::default()
        };
        queue.push(RequestInfo::default(), Vec::new(), &admission, 1, at, reply)
    }

    /// The next tenant, the oldest request and a new request's place in line, by a pass over
    /// every queued request: what the band's indexes must agree with.
    fn brute_force(band: &BandQueue, tenant: u64, cost: u64) -> (Option<u64>, Option<u64>, usize) {
        let all = || {
            band.tenants
                .iter()
                .flat_map(|(key, t)| t.waiters.iter().map(move |w| (key, w)))
        };
        let next = all()
            .map(|(key, w)| (w.tag, w.seq, *key))
            .min()
            .map(|(_, _, key)| key);
        let oldest = all().map(|(_, w)| w.seq).min();
        let tag = band.tag_for(tenant, cost);
        let ahead = all().filter(|(_, w)| w.tag <= tag).count();
        (next, oldest, ahead)
    }

    #[test]
    fn the_band_indexes_agree_with_a_pass_over_every_request() {
        let start = Instant::now();
        let mut queue = Queue::default();
        let mut places: Vec<Place> = Vec::new();
        // A small linear congruential generator: the same mix of operations every run.
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut random = move |bound: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            (state >> 33) % bound
        };
        for step in 0..5_000 {
            let at = start + Duration::from_millis(step);
            match random(10) {
                // Queue a request of one of 8 tenants, with one of a few costs.
                0..=5 => {
                    let (reply, _) = oneshot::channel();
                    let admission = Admission {
                        tenant: random(8),
                        ..Admission::default()
                    };
                    let cost = [1, 1, 10, 300][random(4) as usize];
                    places.push(queue.push(
                        RequestInfo::default(),
                        Vec::new(),
                        &admission,
                        cost,
                        at,
                        reply,
                    ));
                }
                // Dispatch the next one.
                6..=8 => {
                    if let Some(place) = queue.next(at, Duration::from_secs(3600)) {
                        assert!(
                            queue
                                .dispatch(place, at, Duration::from_secs(3600))
                                .is_some()
                        );
                        places.retain(|p| *p != place);
                    }
                }
                // One leaves from anywhere in the queue.
                _ => {
                    if !places.is_empty() {
                        let place = places.swap_remove(random(places.len() as u64) as usize);
                        assert!(queue.remove(place).is_some());
                    }
                }
            }
            let band = &queue.bands[Band::Normal.index()];
            let tenant = random(8);
            let (next, oldest, ahead) = brute_force(band, tenant, 10);
            assert_eq!(
                band.next_head().map(|(tenant, _)| tenant),
                next,
                "step {step}"
            );
            let oldest_seq = band.arrivals.first().map(|&(seq, _)| seq);
            assert_eq!(oldest_seq, oldest, "step {step}");
            let oldest_at = band
                .tenants
                .values()
                .filter_map(|t| t.waiters.front().map(|w| w.enqueued_at))
                .min();
            assert_eq!(band.oldest(), oldest_at, "step {step}");
            assert_eq!(band.ahead_of(tenant, 10), ahead, "step {step}");
            assert_eq!(band.tags.len(), band.len, "step {step}");
            assert_eq!(places.len(), queue.len(), "step {step}");
        }
        assert!(queue.len() > 100, "the queue grew: {}", queue.len());
    }

    #[test]
    fn an_aged_band_takes_one_dispatch_in_four_not_the_whole_queue() {
        let start = Instant::now();
        let aging = Duration::from_secs(1);
        let mut queue = Queue::default();
        let band = |band| Admission {
            band,
            ..Admission::default()
        };
        let push_band = |queue: &mut Queue, admission: &Admission, at: Instant| {
            let (reply, _) = oneshot::channel();
            queue.push(RequestInfo::default(), Vec::new(), admission, 1, at, reply)
        };
        for _ in 0..6 {
            push_band(&mut queue, &band(Band::Normal), start);
        }
        // Before the normal requests have aged, high ones go first.
        let soon = start + Duration::from_millis(500);
        for _ in 0..2 {
            push_band(&mut queue, &band(Band::High), soon);
        }
        let mut order = Vec::new();
        let mut drain = |queue: &mut Queue, at: Instant, count: usize| {
            for _ in 0..count {
                let place = queue.next(at, aging).unwrap();
                order.push(place.band);
                assert!(queue.dispatch(place, at, aging).is_some());
            }
        };
        drain(&mut queue, soon, 2);
        // The normal requests have waited 2 s: a stream of high ones still gets three
        // dispatches in four; the aged normal ones the fourth.
        let later = start + Duration::from_secs(2);
        for _ in 0..8 {
            push_band(&mut queue, &band(Band::High), later);
        }
        drain(&mut queue, later, 14);
        use Band::{High as H, Normal as N};
        assert_eq!(order, [H, H, H, H, H, N, H, H, H, N, H, H, N, N, N, N]);
        assert!(queue.is_empty());
    }

    #[test]
    fn tenants_with_equal_shares_are_served_in_the_order_they_queued() {
        let start = Instant::now();
        let mut queue = Queue::default();
        // Four tenants, one request each, of the same cost: equal tags. The order is their
        // arrival, whatever their keys' hashes.
        let keys = [u64::MAX, 7, u64::MAX / 2, 1];
        let places: Vec<Place> = keys
            .iter()
            .map(|&key| push_tenant(&mut queue, key, start))
            .collect();
        // A fifth goes after all four.
        let fifth = Admission {
            tenant: 3,
            ..Admission::default()
        };
        assert_eq!(queue.ahead_of(&fifth, 1), 4);
        for place in places {
            let next = queue.next(start, Duration::from_secs(60)).unwrap();
            assert_eq!(next, place);
            assert!(
                queue
                    .dispatch(next, start, Duration::from_secs(60))
                    .is_some()
            );
        }
        assert!(queue.is_empty());
    }

    #[test]
    fn a_request_is_ahead_of_older_ones_only_where_the_order_passes_them_over() {
        let start = Instant::now();
        let aging = Duration::from_secs(60);
        let mut queue = Queue::default();
        // Tenant 1 queues two requests, then tenant 2 one: the first of tenant 1 goes first,
        // in the order they queued; then tenant 2's (its share) before tenant 1's older second.
        let first = push_tenant(&mut queue, 1, start);
        let second = push_tenant(&mut queue, 1, start);
        let other = push_tenant(&mut queue, 2, start);
        assert_eq!(queue.next(start, aging), Some(first));
        assert!(!queue.ahead_of_older(first));
        assert!(queue.dispatch(first, start, aging).is_some());
        assert_eq!(queue.next(start, aging), Some(other));
        assert!(queue.ahead_of_older(other));
        assert!(queue.dispatch(other, start, aging).is_some());
        assert!(!queue.ahead_of_older(second));
        assert!(queue.dispatch(second, start, aging).is_some());
        // A high request queued after a normal one goes before it.
        let normal = push(&mut queue, start);
        let (reply, _) = oneshot::channel();
        let high = Admission {
            band: Band::High,
            ..Admission::default()
        };
        let high = queue.push(RequestInfo::default(), Vec::new(), &high, 1, start, reply);
        assert_eq!(queue.next(start, aging), Some(high));
        assert!(queue.ahead_of_older(high));
        assert!(!queue.ahead_of_older(normal));
    }

    #[test]
    fn the_dispatch_that_empties_the_queue_counts_in_the_rate() {
        let start = Instant::now();
        let mut queue = Queue::default();
        // One request waits 200 ms and leaves the queue empty: one dispatch in 200 ms, 5 a
        // second.
        let place = push(&mut queue, start);
        let later = start + Duration::from_millis(200);
        assert!(
            queue
                .dispatch(place, later, Duration::from_secs(60))
                .is_some()
        );
        assert!(queue.is_empty());
        let wait = queue
            .rate
            .predicted_wait(0, later)
            .expect("the rate is measured");
        // (1 + 2) / 5 a second.
        assert!((wait.as_secs_f64() - 0.6).abs() < 1e-9, "{wait:?}");
        // A request that leaves without being dispatched (gone, timed out) is no dispatch: the
        // rate stays as it was, and the window it opened closes with it.
        let gone = push(&mut queue, later);
        assert!(queue.remove(gone).is_some());
        assert_eq!(queue.rate.window, None);
        assert_eq!(queue.rate.predicted_wait(0, later), Some(wait));
    }
}
