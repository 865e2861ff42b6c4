//! Backends: their addresses, the statistics the core keeps for each, what their engines say of
//! their load ([`crate::engine_metrics`]), and their idle keep-alive connections.
//!
//! A [`Backend`] is shared (`Arc`) between the current snapshot and every request leased to it, so
//! a backend removed from the set still counts its in-flight requests down as they finish. A set
//! change keeps the `Arc` (and so the statistics) of every backend present before and after; an
//! address removed and added again gets a fresh `Backend` with zeroed counters.

use std::any::Any;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use tokio::time::Instant;

use http::uri::{Authority, Scheme};

use crate::engine_metrics::EngineLoad;
use crate::h1::idle::IdleConnections;
use crate::prefix_index::PrefixIndex;

/// Why a backend address was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    /// Nothing given.
    #[error("address is empty")]
    Empty,
    /// The text is not a URI authority.
    #[error("{0:?} is not a valid host:port")]
    Invalid(String),
    /// Scheme other than http or https.
    #[error("{0:?} has an unknown scheme (expected http:// or https://)")]
    UnknownScheme(String),
    /// No `:port`.
    #[error("{0:?} has no port")]
    NoPort(String),
    /// Port 0 or above 65535.
    #[error("{0:?} has an invalid port (expected 1-65535)")]
    BadPort(String),
    /// A path after the authority.
    #[error("{0:?} has a path; give only [scheme://]host:port")]
    Path(String),
    /// A query after the authority.
    #[error("{0:?} has a query; give only [scheme://]host:port")]
    Query(String),
    /// `user@host`.
    #[error("{0:?} has user info; give only [scheme://]host:port")]
    UserInfo(String),
    /// A host that is not an IPv4 address, a bracketed IPv6 address or a DNS name.
    #[error(
        "{0:?} has an invalid host (expected an IPv4 address, a bracketed IPv6 address or a DNS name)"
    )]
    BadHost(String),
}

/// The host as written in a canonical address, or `None` when it is not an IPv4 address, a
/// bracketed IPv6 address (written in its shortest form) or a DNS name (labels of letters,
/// digits, `-` and `_`, an optional final dot; a name of digits and dots only is an IPv4
/// address).
pub(crate) fn canonical_host(host: &str) -> Option<String> {
    if let Some(inner) = host.strip_prefix('[') {
        let ip: Ipv6Addr = inner.strip_suffix(']')?.parse().ok()?;
        return Some(format!("[{ip}]"));
    }
    if host.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return host.parse::<Ipv4Addr>().ok().map(|ip| ip.to_string());
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    let valid = name.len() <= 253
        && name.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    valid.then(|| host.to_ascii_lowercase())
}

/// A parsed backend address: `host:port`, `http://host:port` or `https://host:port`.
///
/// ```
/// use custom_router::backend::BackendAddr;
///
/// let addr: BackendAddr = "HTTP://Replica-1.Internal:8080/".parse().unwrap();
/// assert_eq!(addr.as_str(), "replica-1.internal:8080");
/// assert!(!addr.is_https());
/// assert!("10.0.0.1".parse::<BackendAddr>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BackendAddr {
    https: bool,
    authority: Authority,
    display: Box<str>,
}

impl BackendAddr {
    /// The URI scheme used to reach this backend.
    pub fn scheme(&self) -> Scheme {
        if self.https {
            Scheme::HTTPS
        } else {
            Scheme::HTTP
        }
    }

    /// Whether the backend is reached over TLS.
    pub fn is_https(&self) -> bool {
        self.https
    }

    /// `host:port` (IPv6 hosts in brackets).
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// Canonical text: `host:port` for http, `https://host:port` for https; host lowercased.
    pub fn as_str(&self) -> &str {
        &self.display
    }
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display)
    }
}

impl FromStr for BackendAddr {
    type Err = AddrError;

    fn from_str(text: &str) -> Result<Self, AddrError> {
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(AddrError::Empty);
        }
        let owned = || trimmed.to_owned();
        let (https, rest) = match trimmed.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => (false, rest),
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("https") => (true, rest),
            Some(_) => return Err(AddrError::UnknownScheme(owned())),
            None => (false, trimmed),
        };
        // A single trailing slash is the empty path; anything after it is not.
        let (authority_text, tail) = match rest.find(['/', '?', '#']) {
            Some(at) => rest.split_at(at),
            None => (rest, ""),
        };
        if tail.contains('?') {
            return Err(AddrError::Query(owned()));
        }
        if !(tail.is_empty() || tail == "/") {
            return Err(AddrError::Path(owned()));
        }
        if authority_text.contains('@') {
            return Err(AddrError::UserInfo(owned()));
        }
        let Some((host_text, port_text)) = authority_text
            .rsplit_once(':')
            .filter(|(_, port)| !port.contains(']'))
        else {
            return Err(AddrError::NoPort(owned()));
        };
        if port_text.is_empty() {
            return Err(AddrError::NoPort(owned()));
        }
        let port = match port_text.parse::<u16>() {
            Ok(port) if port > 0 && port_text.bytes().all(|b| b.is_ascii_digit()) => port,
            _ => return Err(AddrError::BadPort(owned())),
        };
        if host_text.is_empty() || (host_text.contains(':') && !host_text.starts_with('[')) {
            return Err(AddrError::Invalid(owned()));
        }
        Authority::from_str(authority_text).map_err(|_| AddrError::Invalid(owned()))?;
        let host = canonical_host(host_text).ok_or_else(|| AddrError::BadHost(owned()))?;
        let canonical = format!("{host}:{port}");
        let authority = Authority::from_str(&canonical).map_err(|_| AddrError::Invalid(owned()))?;
        let display = if https {
            format!("https://{canonical}")
        } else {
            canonical
        };
        Ok(Self {
            https,
            authority,
            display: display.into_boxed_str(),
        })
    }
}

/// Status classes counted per backend: 1xx to 5xx.
pub const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// Kinds of upstream failure counted per backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The connection could not be opened (refused, unreachable, DNS).
    Connect,
    /// Opening the connection took longer than the connect timeout.
    ConnectTimeout,
    /// The connection failed while the request or response was in transit.
    Io,
    /// The response headers did not arrive within the first-byte timeout.
    FirstByteTimeout,
    /// The response body stalled: nothing came for the upstream idle timeout.
    IdleTimeout,
}

impl ErrorKind {
    /// Every kind, in the order of their counters.
    pub const ALL: [ErrorKind; 5] = [
        ErrorKind::Connect,
        ErrorKind::ConnectTimeout,
        ErrorKind::Io,
        ErrorKind::FirstByteTimeout,
        ErrorKind::IdleTimeout,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Connect => "connect",
            ErrorKind::ConnectTimeout => "connect_timeout",
            ErrorKind::Io => "io",
            ErrorKind::FirstByteTimeout => "first_byte_timeout",
            ErrorKind::IdleTimeout => "idle_timeout",
        }
    }

    /// Whether the backend can have received none of the request (safe to retry for any method).
    pub fn before_request_sent(self) -> bool {
        matches!(self, ErrorKind::Connect | ErrorKind::ConnectTimeout)
    }
}

/// Availability of a backend, kept by the core: ejection after repeated failures, pauses after
/// "busy" answers, and the start of its slow-start ramp.
#[derive(Debug, Clone, Copy, Default)]
pub struct Availability {
    /// Ejected until then (still ejected after it while a readmission probe is due or running).
    pub ejected_until: Option<Instant>,
    /// How many times it was ejected in the current series (sets the next ejection's length).
    pub ejections: u32,
    /// When it was last ejected.
    pub last_ejected_at: Option<Instant>,
    /// A readmission probe is running.
    pub probing: bool,
    /// Paused (busy) until then.
    pub paused_until: Option<Instant>,
    /// When its slow-start ramp began (added or readmitted).
    pub ramp_from: Option<Instant>,
}

impl Availability {
    /// Whether it is ejected at `now` (an expired ejection awaiting readmission still counts).
    pub fn is_ejected(&self) -> bool {
        self.ejected_until.is_some()
    }

    /// Whether it is paused at `now`.
    pub fn is_paused(&self, now: Instant) -> bool {
        self.paused_until.is_some_and(|until| until > now)
    }
}

const NO_SAMPLE: u64 = u64::MAX;

/// Per-backend state of the strategies ([`Backend::strategy_slot`]): one value per type, created
/// on first use and kept as long as the backend, so a removed backend takes it along.
///
/// The values form a chain of write-once cells; a lookup walks it until the value of the asked
/// type, which in practice is the first (one strategy runs at a time; another type is added
/// behind only after a reload installs a strategy of another type).
#[derive(Default)]
pub struct StrategySlot {
    head: OnceLock<Box<SlotValue>>,
}

struct SlotValue {
    value: Box<dyn Any + Send + Sync>,
    next: StrategySlot,
}

impl StrategySlot {
    fn get<T: Default + Send + Sync + 'static>(&self) -> &T {
        let mut slot = self;
        loop {
            let entry = slot.head.get_or_init(|| {
                Box::new(SlotValue {
                    value: Box::new(T::default()),
                    next: StrategySlot::default(),
                })
            });
            if let Some(value) = entry.value.downcast_ref::<T>() {
                return value;
            }
            slot = &entry.next;
        }
    }
}

impl fmt::Debug for StrategySlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut types = 0;
        let mut slot = self;
        while let Some(entry) = slot.head.get() {
            types += 1;
            slot = &entry.next;
        }
        f.debug_struct("StrategySlot")
            .field("types", &types)
            .finish()
    }
}

/// What one request in flight adds to its backend's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InFlightWork {
    /// Uncached prompt tokens (until the first byte).
    pub prefill: u64,
    /// Expected output tokens.
    pub output: u64,
}

/// One backend, the statistics the core keeps for it (all counters are lock-free) and its idle
/// connections.
#[derive(Debug)]
pub struct Backend {
    id: u64,
    addr: BackendAddr,
    in_flight: AtomicUsize,
    completed: AtomicU64,
    ewma_bits: AtomicU64,
    responses: [AtomicU64; 5],
    errors: [AtomicU64; ErrorKind::ALL.len()],
    consecutive_failures: AtomicU32,
    ejections_total: AtomicU64,
    availability: Mutex<Availability>,
    connections: IdleConnections,
    strategy_slot: StrategySlot,
    engine: EngineLoad,
    /// Requests in flight that have no first byte yet.
    awaiting_first_byte: AtomicUsize,
    /// Uncached prompt tokens of the requests in flight that have no first byte yet.
    prefill_in_flight: AtomicU64,
    /// Expected output tokens of the requests in flight.
    work_in_flight: AtomicU64,
    prefixes: PrefixIndex,
}

impl Backend {
    /// A backend with no history and a prefix index of the default capacity.
    pub fn new(addr: BackendAddr) -> Self {
        Self::with_prefix_capacity(addr, PrefixIndex::DEFAULT_CAPACITY_TOKENS)
    }

    /// A backend with no history whose prefix index holds up to `tokens` (0: none).
    pub fn with_prefix_capacity(addr: BackendAddr, tokens: u64) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            addr,
            in_flight: AtomicUsize::new(0),
            completed: AtomicU64::new(0),
            ewma_bits: AtomicU64::new(NO_SAMPLE),
            responses: Default::default(),
            errors: Default::default(),
            consecutive_failures: AtomicU32::new(0),
            ejections_total: AtomicU64::new(0),
            availability: Mutex::new(Availability {
                ramp_from: Some(Instant::now()),
                ..Availability::default()
            }),
            connections: IdleConnections::default(),
            strategy_slot: StrategySlot::default(),
            engine: EngineLoad::new(),
            awaiting_first_byte: AtomicUsize::new(0),
            prefill_in_flight: AtomicU64::new(0),
            work_in_flight: AtomicU64::new(0),
            prefixes: PrefixIndex::new(tokens),
        }
    }

    /// The strategy state of type `T` kept with this backend, created with `T::default()` on
    /// first use. `T` brings its own interior mutability (atomics, a mutex). The state lives as
    /// long as the backend: a backend removed from the set forgets it with everything else, and
    /// one added again starts from `T::default()`.
    ///
    /// There is one value per type. A strategy of another type (a reload may swap the strategy)
    /// gets its own, fresh value; a new instance of the same type finds the previous instance's
    /// value and must tell its own state from it (e.g. by a generation number stored in `T`).
    pub fn strategy_slot<T: Default + Send + Sync + 'static>(&self) -> &T {
        self.strategy_slot.get()
    }

    /// What its inference engine last said of its load (`[engine_metrics]`; never scraped while
    /// that is off, so [`EngineLoad::snapshot`] reads `None`).
    pub fn engine(&self) -> &EngineLoad {
        &self.engine
    }

    /// Its idle keep-alive connections (plain-HTTP backends).
    pub fn connections(&self) -> &IdleConnections {
        &self.connections
    }

    /// A copy of its availability state.
    pub fn availability(&self) -> Availability {
        *self.lock_availability()
    }

    /// Locks its availability state (short critical sections only, never across an await).
    pub(crate) fn lock_availability(&self) -> MutexGuard<'_, Availability> {
        self.availability
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Times it was ejected since it was added.
    pub fn ejections_total(&self) -> u64 {
        self.ejections_total.load(Ordering::Relaxed)
    }

    pub(crate) fn count_ejection(&self) {
        self.ejections_total.fetch_add(1, Ordering::Relaxed);
    }

    /// Failures in a row of its latest answers (connect, I/O and timeout errors, 500, 502, 504,
    /// 503 without `Retry-After`): 0 after a success or a client error, and again once it is
    /// ejected for them.
    pub fn failures_in_a_row(&self) -> u32 {
        self.consecutive_failures.load(Ordering::Relaxed)
    }

    /// Counts a failure in a row and returns the run's length.
    pub(crate) fn record_failure_in_a_row(&self) -> u32 {
        self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Ends a run of failures.
    pub(crate) fn reset_failures_in_a_row(&self) {
        if self.consecutive_failures.load(Ordering::Relaxed) != 0 {
            self.consecutive_failures.store(0, Ordering::Relaxed);
        }
    }

    /// A process-unique identity (an address removed and added again gets a new id). A strategy
    /// keeps per-backend state in [`Backend::strategy_slot`], not in a map keyed by it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The backend's address.
    pub fn addr(&self) -> &BackendAddr {
        &self.addr
    }

    /// Requests dispatched to this backend whose response has not finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Requests finished (not cancelled by the client), capped by the core.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    /// EWMA of end-to-end latency in seconds; `None` until the first sample.
    pub fn ewma_latency(&self) -> Option<f64> {
        match self.ewma_bits.load(Ordering::Relaxed) {
            NO_SAMPLE => None,
            bits => Some(f64::from_bits(bits)),
        }
    }

    /// Responses with status class `index` (0 = 1xx … 4 = 5xx) since the backend was added.
    pub fn responses(&self, class_index: usize) -> u64 {
        self.responses[class_index].load(Ordering::Relaxed)
    }

    /// Upstream errors of `kind` since the backend was added.
    pub fn errors(&self, kind: ErrorKind) -> u64 {
        self.errors[kind as usize].load(Ordering::Relaxed)
    }

    /// Uncached prompt tokens of the requests in flight still waiting for their first byte:
    /// the prefill queued on the backend, as far as the router knows.
    pub fn prefill_in_flight(&self) -> u64 {
        self.prefill_in_flight.load(Ordering::Relaxed)
    }

    /// Requests in flight still waiting for their first byte: those in prefill and those the
    /// backend holds in its own queue.
    pub fn awaiting_first_byte(&self) -> usize {
        self.awaiting_first_byte.load(Ordering::Relaxed)
    }

    /// Expected output tokens of the requests in flight ([`crate::strategy::RequestInfo::expected_output_tokens`]).
    pub fn work_in_flight(&self) -> u64 {
        self.work_in_flight.load(Ordering::Relaxed)
    }

    /// The prompts recently routed here, by block hash: which prefixes its cache likely holds.
    pub fn prefixes(&self) -> &PrefixIndex {
        &self.prefixes
    }

    /// One more request in flight, with no work counted (tests).
    #[cfg(test)]
    pub(crate) fn acquire(&self) {
        self.acquire_work(&InFlightWork::default());
    }

    /// One request fewer in flight (tests).
    #[cfg(test)]
    pub(crate) fn release(&self) {
        self.release_work(&InFlightWork::default(), false);
    }

    pub(crate) fn acquire_work(&self, work: &InFlightWork) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.awaiting_first_byte.fetch_add(1, Ordering::Relaxed);
        self.prefill_in_flight
            .fetch_add(work.prefill, Ordering::Relaxed);
        self.work_in_flight
            .fetch_add(work.output, Ordering::Relaxed);
    }

    /// The request's prefill is over (its first byte arrived).
    pub(crate) fn prefilled(&self, work: &InFlightWork) {
        self.awaiting_first_byte.fetch_sub(1, Ordering::Relaxed);
        self.prefill_in_flight
            .fetch_sub(work.prefill, Ordering::Relaxed);
    }

    /// The request ended; `prefilling` when its first byte never came.
    pub(crate) fn release_work(&self, work: &InFlightWork, prefilling: bool) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        if prefilling {
            self.prefilled(work);
        }
        self.work_in_flight
            .fetch_sub(work.output, Ordering::Relaxed);
    }

    /// Folds one latency sample (seconds) into the EWMA: the first sample is taken as is.
    pub fn record_latency(&self, sample: f64, alpha: f64) {
        let _ = self
            .ewma_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let next = match bits {
                    NO_SAMPLE => sample,
                    old => alpha * sample + (1.0 - alpha) * f64::from_bits(old),
                };
                Some(next.to_bits())
            });
    }

    /// Counts one finished request, never above `cap`.
    pub fn record_completed(&self, cap: u64) {
        let _ = self
            .completed
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < cap).then_some(n + 1)
            });
    }

    pub(crate) fn record_status(&self, status: http::StatusCode) {
        let index = (status.as_u16() / 100).clamp(1, 5) as usize - 1;
        self.responses[index].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn record_error(&self, kind: ErrorKind) {
        self.errors[kind as usize].fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<String, AddrError> {
        text.parse::<BackendAddr>().map(|a| a.to_string())
    }

    #[test]
    fn accepts_the_three_forms() {
        assert_eq!(parse("10.0.0.1:8080").unwrap(), "10.0.0.1:8080");
        assert_eq!(parse("http://10.0.0.1:8080").unwrap(), "10.0.0.1:8080");
        assert_eq!(
            parse("HTTP://Replica-1.Local:80/").unwrap(),
            "replica-1.local:80"
        );
        assert_eq!(parse("https://[::1]:8443").unwrap(), "https://[::1]:8443");
        assert_eq!(parse("[fe80::1]:80").unwrap(), "[fe80::1]:80");
        assert!(parse("https://a:1").unwrap().starts_with("https://"));
    }

    #[test]
    fn rejects_bad_addresses_with_the_reason() {
        assert_eq!(parse(""), Err(AddrError::Empty));
        assert!(matches!(parse("10.0.0.1"), Err(AddrError::NoPort(_))));
        assert!(matches!(parse("http://host"), Err(AddrError::NoPort(_))));
        assert!(matches!(parse("host:0"), Err(AddrError::BadPort(_))));
        assert!(matches!(parse("host:70000"), Err(AddrError::BadPort(_))));
        assert!(matches!(parse("host:80/v1"), Err(AddrError::Path(_))));
        assert!(matches!(parse("host:80?a=1"), Err(AddrError::Query(_))));
        assert!(matches!(parse("host:80/?a=1"), Err(AddrError::Query(_))));
        assert!(matches!(
            parse("ftp://host:21"),
            Err(AddrError::UnknownScheme(_))
        ));
        assert!(matches!(parse("user@host:80"), Err(AddrError::UserInfo(_))));
        assert!(matches!(parse(":80"), Err(AddrError::Invalid(_))));
        assert!(matches!(parse("ho st:80"), Err(AddrError::Invalid(_))));
        assert!(matches!(parse("host:+80"), Err(AddrError::BadPort(_))));
        for bad in [
            "[foo]:80",
            "[]:80",
            "[10.0.0.1]:80",
            "999.0.0.1:80",
            "10.1:80",
            "a..b:80",
            ".a:80",
            "a!b:80",
        ] {
            assert!(matches!(parse(bad), Err(AddrError::BadHost(_))), "{bad}");
        }
        assert_eq!(parse("[FD00:0::0A]:80").unwrap(), "[fd00::a]:80");
        assert_eq!(parse("Replica_1.svc.:0080").unwrap(), "replica_1.svc.:80");
    }

    #[test]
    fn ewma_starts_at_first_sample_then_smooths() {
        let backend = Backend::new("a:1".parse().unwrap());
        assert_eq!(backend.ewma_latency(), None);
        backend.record_latency(1.0, 0.3);
        assert_eq!(backend.ewma_latency(), Some(1.0));
        backend.record_latency(2.0, 0.3);
        let ewma = backend.ewma_latency().unwrap();
        assert!((ewma - 1.3).abs() < 1e-12, "{ewma}");
    }

    #[test]
    fn a_strategy_slot_holds_one_value_per_type() {
        use std::sync::atomic::AtomicU8;
        let backend = Backend::new("a:1".parse().unwrap());
        backend
            .strategy_slot::<AtomicU64>()
            .store(7, Ordering::Relaxed);
        assert_eq!(
            backend.strategy_slot::<AtomicU8>().load(Ordering::Relaxed),
            0
        );
        backend
            .strategy_slot::<AtomicU8>()
            .store(3, Ordering::Relaxed);
        assert_eq!(
            backend.strategy_slot::<AtomicU64>().load(Ordering::Relaxed),
            7
        );
        assert_eq!(
            backend.strategy_slot::<AtomicU8>().load(Ordering::Relaxed),
            3
        );
        assert!(format!("{backend:?}").contains("types: 2"));
    }

    #[test]
    fn completed_is_capped() {
        let backend = Backend::new("a:1".parse().unwrap());
        for _ in 0..10 {
            backend.record_completed(3);
        }
        assert_eq!(backend.completed(), 3);
    }
}
