//! Which backends may be picked: outlier ejection, busy pauses, readmission probes, panic mode,
//! held to the `[availability]` section ([`AvailabilityConfig`], whose keys are named below).
//!
//! - A backend with `consecutive_failures` failures in a row (connect error, timeout, I/O error,
//!   500, 502, 504, or 503 without `Retry-After`) is ejected for `ejection_time × n` (n-th ejection
//!   in a series, capped at `max_ejection_time`), unless that would eject more than
//!   `max_ejection_percent` of the backends. 4xx answers never count.
//! - A backend answering 429, or 503 with `Retry-After`, is paused for that long (capped at
//!   `max_busy_pause`; 1 s when a 429 has no `Retry-After`). It is busy, not broken: not ejected.
//! - When an ejection expires the backend is readmitted, after a passing `GET health_check_path`
//!   probe when one is configured (a failing probe ejects it again, for longer).
//! - The eligible list is what strategies pick from. If every backend that is not paused is
//!   ejected, all of them are eligible again (panic mode) rather than failing every request.
//!
//! State changes happen under the queue lock; expiries are timers that refresh the list and let
//! the queue move. The list is a snapshot, so picking costs no allocation.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{Balancer, Queue};
use crate::backend::Backend;
use crate::classify::Class;

/// The `[availability]` section: when a backend is ejected or paused, how it is readmitted and how
/// its share ramps up again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AvailabilityConfig {
    /// Failures in a row that eject a backend.
    pub consecutive_failures: u32,
    /// The first ejection's length; the n-th ejection of a series lasts n times this.
    #[serde(with = "crate::forms::seconds")]
    pub ejection_time: Duration,
    /// The longest ejection.
    #[serde(with = "crate::forms::seconds")]
    pub max_ejection_time: Duration,
    /// Largest share of the backends ejected at once, in percent.
    pub max_ejection_percent: f64,
    /// Path probed with `GET` before an ejected backend is readmitted (`None`: no probe).
    #[serde(with = "crate::forms::text")]
    pub health_check_path: Option<String>,
    /// How long a readmission probe may take.
    #[serde(with = "crate::forms::seconds")]
    pub health_check_timeout: Duration,
    /// The longest pause of a busy backend (429, or 503 with `Retry-After`).
    #[serde(with = "crate::forms::seconds")]
    pub max_busy_pause: Duration,
    /// The slow-start ramp of new and readmitted backends (`None`: off).
    #[serde(with = "crate::forms::seconds_or_off")]
    pub slow_start: Option<Duration>,
}

impl Default for AvailabilityConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            ejection_time: Duration::from_secs(30),
            max_ejection_time: Duration::from_secs(300),
            max_ejection_percent: 50.0,
            health_check_path: None,
            health_check_timeout: Duration::from_secs(2),
            max_busy_pause: Duration::from_secs(60),
            slow_start: None,
        }
    }
}

impl AvailabilityConfig {
    /// How long the n-th ejection of a series lasts: n × `ejection_time`, at most
    /// `max_ejection_time`.
    fn ejection_length(&self, ejections: u32) -> Duration {
        (self.ejection_time * ejections).min(self.max_ejection_time)
    }

    /// Checks what the types leave open: at least one failure to eject, a percentage, a probe
    /// path starting with `/`. The error names the key within `[availability]`.
    pub fn check(&self) -> Result<(), crate::forms::Invalid> {
        use crate::forms::check;
        check::positive("consecutive_failures", self.consecutive_failures.into())?;
        check::percentage("max_ejection_percent", self.max_ejection_percent)?;
        if let Some(path) = &self.health_check_path {
            check::path("health_check_path", path)?;
        }
        Ok(())
    }
}

impl Balancer {
    /// Applies what an attempt's class means for `backend`'s availability: success or a client
    /// error ends a run of failures, a failure counts towards ejection, a busy answer pauses,
    /// another 5xx leaves the run as it is.
    pub(super) fn apply_class(self: &Arc<Self>, backend: &Arc<Backend>, class: Class) {
        match class {
            Class::Success | Class::ClientError => backend.reset_failures_in_a_row(),
            Class::Failure(_) => {
                if backend.record_failure_in_a_row()
                    >= self.tuning.load().availability.consecutive_failures
                {
                    self.eject(backend);
                }
            }
            Class::Busy(pause) => self.pause(
                backend,
                pause.min(self.tuning.load().availability.max_busy_pause),
            ),
            Class::Neutral => {}
        }
    }

    fn is_current(&self, backend: &Arc<Backend>) -> bool {
        self.backends.load().iter().any(|b| Arc::ptr_eq(b, backend))
    }

    fn eject(self: &Arc<Self>, backend: &Arc<Backend>) {
        let mut queue = self.lock();
        if !self.is_current(backend) {
            return;
        }
        let tuning = self.tuning.load();
        let config = &tuning.availability;
        let all = self.backends.load();
        let ejected = all.iter().filter(|b| b.availability().is_ejected()).count();
        let allowed = (all.len() as f64 * config.max_ejection_percent / 100.0).floor() as usize;
        let now = Instant::now();
        let until = {
            let mut state = backend.lock_availability();
            if state.is_ejected() || ejected >= allowed {
                return;
            }
            let series_over = state
                .last_ejected_at
                .is_none_or(|at| now.duration_since(at) > config.max_ejection_time * 2);
            state.ejections = if series_over { 1 } else { state.ejections + 1 };
            let length = config.ejection_length(state.ejections);
            state.ejected_until = Some(now + length);
            state.last_ejected_at = Some(now);
            now + length
        };
        drop(tuning);
        backend.reset_failures_in_a_row();
        backend.count_ejection();
        self.metrics.ejections.add(1, &[]);
        tracing::warn!(backend = %backend.addr(), until_s = (until - now).as_secs_f64(), "backend ejected after consecutive failures");
        self.refresh_eligible_locked(&mut queue);
        self.schedule_refresh(until);
    }

    fn pause(self: &Arc<Self>, backend: &Arc<Backend>, pause: Duration) {
        let until = Instant::now() + pause;
        let mut queue = self.lock();
        {
            let mut state = backend.lock_availability();
            if state.paused_until.is_some_and(|current| current >= until) {
                return;
            }
            state.paused_until = Some(until);
        }
        tracing::debug!(backend = %backend.addr(), pause_s = pause.as_secs_f64(), "backend busy: paused");
        self.refresh_eligible_locked(&mut queue);
        drop(queue);
        self.schedule_refresh(until);
    }

    /// Refreshes the list and lets the queue move at `at`.
    fn schedule_refresh(self: &Arc<Self>, at: Instant) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let balancer = Arc::downgrade(self);
        runtime.spawn(async move {
            tokio::time::sleep_until(at).await;
            if let Some(balancer) = balancer.upgrade() {
                let mut queue = balancer.lock();
                balancer.refresh_eligible_locked(&mut queue);
            }
        });
    }

    /// Recomputes the eligible list: readmits expired ejections (or starts their probe), drops
    /// paused and ejected backends, falls back to panic mode, then dispatches.
    pub(super) fn refresh_eligible_locked(self: &Arc<Self>, queue: &mut Queue) {
        let now = Instant::now();
        let all = self.backends.load();
        let mut eligible = Vec::with_capacity(all.len());
        let mut not_paused = Vec::with_capacity(all.len());
        for backend in all.iter() {
            let mut state = backend.lock_availability();
            if let Some(until) = state.ejected_until {
                if until <= now && !state.probing {
                    if self.tuning.load().availability.health_check_path.is_some() {
                        state.probing = true;
                        self.spawn_probe(Arc::clone(backend));
                    } else {
                        state.ejected_until = None;
                        state.ramp_from = Some(now);
                        // Failures of requests in flight at the ejection counted on meanwhile:
                        // a readmitted backend needs a whole run again.
                        backend.reset_failures_in_a_row();
                        tracing::info!(backend = %backend.addr(), "backend readmitted");
                    }
                }
            }
            if state.is_paused(now) {
                continue;
            }
            not_paused.push(Arc::clone(backend));
            if !state.is_ejected() {
                eligible.push(Arc::clone(backend));
            }
        }
        let panic = eligible.is_empty() && !not_paused.is_empty();
        if panic != self.panic_mode.swap(panic, Ordering::Relaxed) {
            if panic {
                tracing::warn!(
                    "every available backend is ejected: routing to all of them (panic mode)"
                );
            } else {
                tracing::info!("panic mode over");
            }
        }
        let eligible = if panic { not_paused } else { eligible };
        let (changed, members_changed) = {
            let current = self.eligible.load();
            let members_changed = current.len() != eligible.len()
                || eligible
                    .iter()
                    .any(|backend| !current.iter().any(|c| Arc::ptr_eq(c, backend)));
            let reordered = current
                .iter()
                .zip(&eligible)
                .any(|(a, b)| !Arc::ptr_eq(a, b));
            (members_changed || reordered, members_changed)
        };
        if members_changed {
            // Capacity changed: the queue's dispatch rate is measured afresh, and nothing is
            // refused on the old one while capacity arrives. The same backends in another order
            // are the same capacity.
            queue.rate.reset();
        }
        if changed {
            let eligible = Arc::new(eligible);
            self.eligible.store(Arc::clone(&eligible));
            self.strategy.load().on_backends_changed(&eligible);
        }
        self.dispatch_locked(queue);
    }

    fn spawn_probe(self: &Arc<Self>, backend: Arc<Backend>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let balancer = Arc::downgrade(self);
        runtime.spawn(async move {
            let Some(balancer) = balancer.upgrade() else {
                return;
            };
            let passed = balancer.probe(&backend).await;
            balancer.finish_probe(&backend, passed);
        });
    }

    async fn probe(&self, backend: &Arc<Backend>) -> bool {
        let tuning = self.tuning.load_full();
        let (Some(path), Some(prober)) =
            (&tuning.availability.health_check_path, self.prober.get())
        else {
            return true;
        };
        let answer = tokio::time::timeout(
            tuning.availability.health_check_timeout,
            prober.probe(backend, path),
        )
        .await;
        let passed = answer.unwrap_or(false);
        tracing::info!(backend = %backend.addr(), passed, "readmission probe");
        passed
    }

    fn finish_probe(self: &Arc<Self>, backend: &Arc<Backend>, passed: bool) {
        let mut queue = self.lock();
        let now = Instant::now();
        let retry_at = {
            let mut state = backend.lock_availability();
            state.probing = false;
            if passed {
                state.ejected_until = None;
                state.ramp_from = Some(now);
                backend.reset_failures_in_a_row();
                None
            } else {
                state.ejections += 1;
                let length = self
                    .tuning
                    .load()
                    .availability
                    .ejection_length(state.ejections);
                state.ejected_until = Some(now + length);
                // The series goes on from this ejection, not from the outage's first.
                state.last_ejected_at = Some(now);
                Some(now + length)
            }
        };
        if passed {
            tracing::info!(backend = %backend.addr(), "backend readmitted after a passing probe");
        }
        if self.is_current(backend) {
            self.refresh_eligible_locked(&mut queue);
            if let Some(at) = retry_at {
                drop(queue);
                self.schedule_refresh(at);
            }
        }
    }

    /// Whether a slow-starting backend takes this pick: its share ramps linearly from 10 % to
    /// 100 % over `slow_start`.
    pub(super) fn ramp_admits(&self, backend: &Backend) -> bool {
        let Some(window) = self.tuning.load().availability.slow_start else {
            return true;
        };
        let Some(from) = backend.availability().ramp_from else {
            return true;
        };
        let weight = from.elapsed().as_secs_f64() / window.as_secs_f64();
        weight >= 1.0 || fastrand::f64() < weight.max(0.1)
    }
}
