//! The balancer's configuration: the `[queue]` and `[prefix_index]` sections, and [`Tuning`],
//! everything the balancer is held to (replaced whole by a reload).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::AvailabilityConfig;
use crate::prefix_index::PrefixIndex;
use crate::strategy::LatencyConfig;

/// The `[queue]` section: the admission queue requests wait in when no backend can take them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// Requests the queue holds; when full, one request gives way (see [`Rejection::Evicted`](super::Rejection::Evicted)).
    /// Also caps each backend's
    /// completed count ([`QueueConfig::completed_cap`]).
    pub max_size: usize,
    /// How long a request may wait in the queue.
    #[serde(with = "crate::forms::seconds")]
    pub timeout: Duration,
    /// Load shedding by a fixed rule: a new request is answered 503 at once while the queue
    /// holds this many times the requests in flight (0: never, the default; admission by
    /// deadline applies either way).
    pub shed_ratio: f64,
    /// The request header stating within how many milliseconds the request's answer must start
    /// (its first byte; the queue's `timeout` bounds it). Empty: none is read.
    pub deadline_header: String,
    /// The request header naming the request's priority band: `high`, `normal` (also when
    /// absent or anything else) or `low`. Empty: every request is `normal`.
    pub priority_header: String,
    /// How long a request of a lower band waits before such requests get at least one
    /// dispatch in four while higher bands hold requests.
    #[serde(with = "crate::forms::seconds")]
    pub priority_aging: Duration,
    /// The request header whose value names the tenant (e.g. `x-tenant-id`, `authorization`):
    /// tenants get fair shares of dispatch. Empty (the default): off.
    pub tenant_header: String,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_size: 1000,
            timeout: Duration::from_secs(1200),
            shed_ratio: 0.0,
            deadline_header: "x-request-deadline-ms".to_owned(),
            priority_header: "x-priority".to_owned(),
            priority_aging: Duration::from_secs(10),
            tenant_header: String::new(),
        }
    }
}

impl QueueConfig {
    /// The cap of each backend's completed count: `2 × max_size / 5`, at least 1.
    pub fn completed_cap(&self) -> u64 {
        (2 * self.max_size / 5).max(1) as u64
    }

    /// Most requests `max_size` may hold: twice the queue's size is counted in places, and a
    /// size past this would overflow them.
    pub const MAX_SIZE: usize = 1 << 24;

    /// Checks what the types leave open: a size from 1 to [`QueueConfig::MAX_SIZE`], a finite
    /// `shed_ratio` ≥ 0, header names that are tokens. The error names the key within `[queue]`.
    pub fn check(&self) -> Result<(), crate::forms::Invalid> {
        use crate::forms::{Invalid, check};
        check::positive("max_size", self.max_size as u64)?;
        if self.max_size > Self::MAX_SIZE {
            return Err(Invalid::new(
                "max_size",
                format!(
                    "expected at most {} requests, found {}",
                    Self::MAX_SIZE,
                    self.max_size
                ),
            ));
        }
        let shed_ratio = self.shed_ratio;
        if !(shed_ratio.is_finite() && shed_ratio >= 0.0) {
            return Err(Invalid::new(
                "shed_ratio",
                format!("expected zero (never shed) or a positive number, found {shed_ratio}"),
            ));
        }
        check::header_name("deadline_header", &self.deadline_header)?;
        check::header_name("priority_header", &self.priority_header)?;
        check::header_name("tenant_header", &self.tenant_header)
    }
}

/// What the balancer is held to: the configuration's `[queue]`, `[latency]` and `[availability]`
/// sections as they are (replaced whole by a reload).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tuning {
    /// The admission queue.
    pub queue: QueueConfig,
    /// Latency samples and what a failure counts.
    pub latency: LatencyConfig,
    /// Ejection, busy pauses, readmission probes, slow start.
    pub availability: AvailabilityConfig,
    /// Each backend's prefix index.
    pub prefix_index: PrefixIndexConfig,
}

/// The `[prefix_index]` section: what the router remembers of the prompts it sent to each
/// backend ([`Backend::prefixes`](crate::backend::Backend::prefixes)), read by strategies that route on prompts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixIndexConfig {
    /// Prompt tokens remembered per backend, least recently routed forgotten first; about the
    /// size of one replica's prefix cache. 0 turns the index off. Applies to backends added
    /// after a change.
    pub capacity_tokens: u64,
}

impl Default for PrefixIndexConfig {
    fn default() -> Self {
        Self {
            capacity_tokens: PrefixIndex::DEFAULT_CAPACITY_TOKENS,
        }
    }
}
