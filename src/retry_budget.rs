//! The retry budget: over a sliding window of about ten seconds, retries may add at most
//! `percent` % of the requests, plus `min_per_second` retries per second always allowed, so that
//! a failing backend cannot turn into a retry storm (Finagle's and Linkerd's retry budgets).
//!
//! Ten one-second slots count requests and retries with atomics; a slot is reset when a new
//! second reuses it. Counting is approximate at slot boundaries, which a budget can afford.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

const SLOTS: u64 = 10;

#[derive(Debug, Default)]
struct Slot {
    second: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
}

/// The `[retry.budget]` section: how many failure retries the budget allows.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BudgetConfig {
    /// Retries allowed as a percentage of the requests of the window.
    pub percent: f64,
    /// Retries per second always allowed, whatever the traffic.
    pub min_per_second: f64,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            percent: 20.0,
            min_per_second: 10.0,
        }
    }
}

impl BudgetConfig {
    /// Checks what the types leave open: a percentage, a finite `min_per_second` ≥ 0. The error
    /// names the key within `[retry.budget]`.
    pub fn check(&self) -> Result<(), crate::forms::Invalid> {
        crate::forms::check::percentage("percent", self.percent)?;
        let min_per_second = self.min_per_second;
        if !(min_per_second.is_finite() && min_per_second >= 0.0) {
            return Err(crate::forms::Invalid::new(
                "min_per_second",
                format!("expected zero or a positive number, found {min_per_second}"),
            ));
        }
        Ok(())
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct RetryBudget {
    slots: [Slot; SLOTS as usize],
    started: Instant,
    config: BudgetConfig,
}

impl RetryBudget {
    /// A budget allowing `config.percent` % of requests as retries plus `config.min_per_second`
    /// retries/s.
    pub fn new(config: BudgetConfig) -> Self {
        Self {
            slots: Default::default(),
            started: Instant::now(),
            config,
        }
    }

    /// The current second (from 1) and its slot, reset if it last held an older second.
    fn current(&self) -> (u64, &Slot) {
        let second = self.started.elapsed().as_secs() + 1;
        let slot = &self.slots[(second % SLOTS) as usize];
        if slot.second.load(Ordering::Acquire) != second
            && slot.second.swap(second, Ordering::AcqRel) != second
        {
            slot.requests.store(0, Ordering::Relaxed);
            slot.retries.store(0, Ordering::Relaxed);
        }
        (second, slot)
    }

    /// Counts one request (its first attempt).
    pub fn deposit(&self) {
        self.current().1.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes one retry from the budget; `false` when it is spent.
    pub fn try_withdraw(&self) -> bool {
        let (now, slot) = self.current();
        let (mut requests, mut retries) = (0u64, 0u64);
        for window_slot in &self.slots {
            let second = window_slot.second.load(Ordering::Acquire);
            if second + SLOTS > now {
                requests += window_slot.requests.load(Ordering::Relaxed);
                retries += window_slot.retries.load(Ordering::Relaxed);
            }
        }
        let allowed = self.config.min_per_second * SLOTS as f64
            + self.config.percent / 100.0 * requests as f64;
        if (retries as f64) < allowed.floor() {
            slot.retries.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            false
        }
    }

    /// Gives back a retry taken for an attempt that was never made (no backend was left to
    /// try): counted off the current second (approximate if a second passed since).
    pub fn refund(&self) {
        let _ = self.current().1.retries.fetch_update(
            Ordering::Relaxed,
            Ordering::Relaxed,
            |retries| retries.checked_sub(1),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn drain(budget: &RetryBudget) -> usize {
        let mut allowed = 0;
        while budget.try_withdraw() {
            allowed += 1;
        }
        allowed
    }

    #[tokio::test(start_paused = true)]
    async fn retries_are_bounded_by_the_share_of_requests_and_the_floor() {
        // 20 % of requests, 1 retry per second floor: 10 retries over the 10 s window.
        let budget = RetryBudget::new(BudgetConfig {
            percent: 20.0,
            min_per_second: 1.0,
        });
        assert_eq!(drain(&budget), 10);
        // A retry given back may be taken again, once.
        budget.refund();
        assert_eq!(drain(&budget), 1);
        // 100 requests earn 20 more.
        for _ in 0..100 {
            budget.deposit();
        }
        assert_eq!(drain(&budget), 20);
        // The window slides: after 10 s the old requests and retries no longer count.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(drain(&budget), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_budget_allows_nothing() {
        let budget = RetryBudget::new(BudgetConfig {
            percent: 0.0,
            min_per_second: 0.0,
        });
        budget.deposit();
        assert!(!budget.try_withdraw());
    }
}
