//! The retry decision, apart from the loop that acts on it: given how an attempt ended and what
//! the request allows, send it again or not, and why (the shape of linkerd's retry `Policy`).
//!
//! [`RetryPolicy::decide`] reads only what it is given ([`Attempted`]): how the attempt ended
//! (its [`Class`], computed once), the method, whether the body can be sent again, the attempts
//! made, whether the client already has part of an answer. It sends nothing and keeps no state;
//! the shared retry budget is asked last, through the closure it is handed, and only when every
//! other rule allows a failure retry (asking takes a retry from it). Each rule is one branch of
//! [`RetryPolicy::decide`] with its own [`Stop`] reason; a new rule is one more field of
//! [`Attempted`] and one more branch.
//!
//! The rules, in order (docs/reliability.md, "What is retried"):
//! 1. once a byte of an answer reached the client, nothing is retried;
//! 2. a failure of the client's own request body is not retried;
//! 3. an answer that is not busy (success, 4xx, a 5xx without `Retry-After`) is the client's;
//! 4. only a body kept in memory is sent again;
//! 5. never more than `retry.max_attempts` attempts in all;
//! 6. a busy answer (429, or 503 with `Retry-After`) is retried for any method, off budget;
//! 7. a connect failure (the backend saw nothing) is retried for any method; another failure
//!    before the response head only for an idempotent method;
//! 8. a failure retry needs a retry left in the budget.

use http::Method;
use serde::{Deserialize, Serialize};

use crate::backend::ErrorKind;
use crate::classify::Class;
use crate::metrics::RetryReason;
use crate::retry_budget::BudgetConfig;

/// The `[retry]` section: how often a request may be sent, and what is kept to send it again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// Bytes of body kept in memory so the request can be sent again.
    pub body_limit: usize,
    /// Bytes of request bodies all requests together may keep in memory.
    pub max_buffered_bytes: usize,
    /// The retry budget (`[retry.budget]`), shared by all requests: see
    /// [`crate::retry_budget::RetryBudget`].
    pub budget: BudgetConfig,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            body_limit: 1024 * 1024,
            max_buffered_bytes: 32 * 1024 * 1024,
            budget: BudgetConfig::default(),
        }
    }
}

impl RetryConfig {
    /// Checks what the types leave open: at least one attempt, the budget, a body limit of at
    /// most 64 MiB. The error names the key within `[retry]`.
    pub fn check(&self) -> Result<(), crate::forms::Invalid> {
        crate::forms::check::positive("max_attempts", self.max_attempts.into())?;
        self.budget
            .check()
            .map_err(|error| error.within("budget"))?;
        if self.body_limit > 64 * 1024 * 1024 {
            return Err(crate::forms::Invalid::new(
                "body_limit",
                format!("expected at most 67108864 bytes, found {}", self.body_limit),
            ));
        }
        Ok(())
    }
}

/// How an attempt ended, as the decision sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Ending {
    /// The backend's side of it: its answer or its failure, classified once.
    Backend(Class),
    /// The client's request body failed: not the backend's doing.
    ClientBody,
}

/// What the decision reads of one ended attempt.
#[derive(Debug, Clone, Copy)]
pub struct Attempted<'a> {
    /// How the attempt ended.
    pub ending: Ending,
    /// The request's method.
    pub method: &'a Method,
    /// Whether the request body is kept in memory, so that it can be sent again.
    pub replayable: bool,
    /// Attempts made so far, this one included (from 1).
    pub number: u32,
    /// Whether any byte of an answer reached the client.
    pub answer_started: bool,
}

/// Retry or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Send the request again, for this reason (counted in `custom_router_retries_total`).
    Retry(RetryReason),
    /// The attempt's ending is the request's: the client gets it.
    Stop(Stop),
}

/// Why an attempt is not retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Part of an answer already reached the client.
    AnswerStarted,
    /// The client's request body failed.
    ClientBody,
    /// The backend answered, and not busy: its answer is the client's.
    Answered,
    /// The body was streamed, not kept: it cannot be sent again.
    NotReplayable,
    /// This was the last attempt `retry.max_attempts` allows.
    AttemptsSpent,
    /// The request may have reached the backend, and its method is not idempotent.
    NotIdempotent,
    /// The retry budget has no retry left.
    BudgetSpent,
}

/// The retry rules of the `[retry]` section (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    max_attempts: u32,
}

impl RetryPolicy {
    /// The policy of a `[retry]` section.
    pub fn new(config: &RetryConfig) -> Self {
        Self {
            max_attempts: config.max_attempts,
        }
    }

    /// Whether attempt `number` can be followed by no other, whatever its ending (a busy answer
    /// then goes to the client as it is).
    pub fn is_last(&self, number: u32, replayable: bool) -> bool {
        !replayable || number >= self.max_attempts
    }

    /// Retry or not, and why. `withdraw` takes a retry from the shared budget (`false`: none
    /// left); it is called at most once, and only for a failure every other rule lets through.
    pub fn decide(&self, attempt: &Attempted<'_>, withdraw: impl FnOnce() -> bool) -> Decision {
        match self.judge(attempt, withdraw) {
            Ok(reason) => Decision::Retry(reason),
            Err(stop) => Decision::Stop(stop),
        }
    }

    fn judge(
        &self,
        attempt: &Attempted<'_>,
        withdraw: impl FnOnce() -> bool,
    ) -> Result<RetryReason, Stop> {
        if attempt.answer_started {
            return Err(Stop::AnswerStarted);
        }
        let failure = retriable_ending(attempt.ending)?;
        if !attempt.replayable {
            return Err(Stop::NotReplayable);
        }
        if attempt.number >= self.max_attempts {
            return Err(Stop::AttemptsSpent);
        }
        let Some(kind) = failure else {
            return Ok(RetryReason::Busy);
        };
        let reason = failure_reason(kind, attempt.method)?;
        if !withdraw() {
            return Err(Stop::BudgetSpent);
        }
        Ok(reason)
    }
}

/// Whether an ending may be retried at all: `Ok(None)` for a busy answer, `Ok(Some(kind))` for
/// an upstream failure before the response head.
fn retriable_ending(ending: Ending) -> Result<Option<ErrorKind>, Stop> {
    match ending {
        Ending::ClientBody => Err(Stop::ClientBody),
        Ending::Backend(Class::Busy(_)) => Ok(None),
        Ending::Backend(Class::Failure(Some(kind))) => Ok(Some(kind)),
        Ending::Backend(_) => Err(Stop::Answered),
    }
}

/// Why a failure of `kind` may be retried for `method`, if it may.
fn failure_reason(kind: ErrorKind, method: &Method) -> Result<RetryReason, Stop> {
    if kind.before_request_sent() {
        Ok(RetryReason::Connect)
    } else if is_idempotent(method) {
        Ok(RetryReason::Idempotent)
    } else {
        Err(Stop::NotIdempotent)
    }
}

/// Methods whose repetition has the same effect as one request (RFC 9110 §9.2.2).
pub fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::time::Duration;

    use http::StatusCode;

    use super::*;

    const BUSY: Class = Class::Busy(Duration::from_secs(1));
    const CONNECT: Class = Class::Failure(Some(ErrorKind::Connect));
    const IO: Class = Class::Failure(Some(ErrorKind::Io));

    fn policy() -> RetryPolicy {
        RetryPolicy::new(&RetryConfig::default())
    }

    /// A first attempt of a replayable request that ended as `class`.
    fn ended(class: Class, method: &Method) -> Attempted<'_> {
        Attempted {
            ending: Ending::Backend(class),
            method,
            replayable: true,
            number: 1,
            answer_started: false,
        }
    }

    /// The decision, and how many times the budget was asked (it always has a retry).
    fn decide(attempt: &Attempted<'_>) -> (Decision, u32) {
        let asked = Cell::new(0);
        let decision = policy().decide(attempt, || {
            asked.set(asked.get() + 1);
            true
        });
        (decision, asked.get())
    }

    #[test]
    fn nothing_is_retried_once_the_client_has_part_of_the_answer() {
        for class in [CONNECT, BUSY, IO] {
            let attempt = Attempted {
                answer_started: true,
                ..ended(class, &Method::GET)
            };
            assert_eq!(decide(&attempt), (Decision::Stop(Stop::AnswerStarted), 0));
        }
    }

    #[test]
    fn a_failed_client_body_is_not_retried() {
        let attempt = Attempted {
            ending: Ending::ClientBody,
            ..ended(CONNECT, &Method::GET)
        };
        assert_eq!(decide(&attempt), (Decision::Stop(Stop::ClientBody), 0));
    }

    #[test]
    fn an_answer_that_is_not_busy_is_the_clients() {
        let statuses = [200, 404, 500, 501, 502, 503, 504];
        for status in statuses.map(|code| StatusCode::from_u16(code).unwrap()) {
            let class = Class::of(Some(status), None, None);
            assert_eq!(
                decide(&ended(class, &Method::GET)),
                (Decision::Stop(Stop::Answered), 0),
                "{status}"
            );
        }
    }

    #[test]
    fn a_streamed_body_is_not_sent_again() {
        for class in [BUSY, CONNECT] {
            let attempt = Attempted {
                replayable: false,
                ..ended(class, &Method::GET)
            };
            assert_eq!(decide(&attempt), (Decision::Stop(Stop::NotReplayable), 0));
        }
        assert!(policy().is_last(1, false));
    }

    #[test]
    fn the_last_attempt_is_not_retried() {
        for class in [BUSY, CONNECT, IO] {
            let attempt = Attempted {
                number: 3,
                ..ended(class, &Method::GET)
            };
            assert_eq!(decide(&attempt), (Decision::Stop(Stop::AttemptsSpent), 0));
        }
        let second = Attempted {
            number: 2,
            ..ended(CONNECT, &Method::GET)
        };
        assert_eq!(decide(&second), (Decision::Retry(RetryReason::Connect), 1));
        assert!(!policy().is_last(2, true) && policy().is_last(3, true));
        let once = RetryPolicy::new(&RetryConfig {
            max_attempts: 1,
            ..RetryConfig::default()
        });
        assert!(once.is_last(1, true));
        assert_eq!(
            once.decide(&ended(BUSY, &Method::GET), || true),
            Decision::Stop(Stop::AttemptsSpent)
        );
    }

    #[test]
    fn a_busy_answer_is_retried_for_any_method_without_the_budget() {
        for method in [Method::GET, Method::POST, Method::PATCH] {
            assert_eq!(
                decide(&ended(BUSY, &method)),
                (Decision::Retry(RetryReason::Busy), 0),
                "{method}"
            );
        }
        let busy_503 = Class::of(
            Some(StatusCode::SERVICE_UNAVAILABLE),
            None,
            Some(Duration::from_secs(2)),
        );
        assert_eq!(
            policy().decide(&ended(busy_503, &Method::POST), || false),
            Decision::Retry(RetryReason::Busy)
        );
    }

    #[test]
    fn a_connect_failure_is_retried_for_any_method() {
        let timeout = Class::Failure(Some(ErrorKind::ConnectTimeout));
        for class in [CONNECT, timeout] {
            for method in [Method::GET, Method::POST] {
                assert_eq!(
                    decide(&ended(class, &method)),
                    (Decision::Retry(RetryReason::Connect), 1),
                    "{class:?} {method}"
                );
            }
        }
    }

    #[test]
    fn another_failure_is_retried_only_for_an_idempotent_method() {
        let first_byte = Class::Failure(Some(ErrorKind::FirstByteTimeout));
        for class in [IO, first_byte] {
            for method in ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"] {
                let method = Method::from_bytes(method.as_bytes()).unwrap();
                assert_eq!(
                    decide(&ended(class, &method)),
                    (Decision::Retry(RetryReason::Idempotent), 1),
                    "{class:?} {method}"
                );
            }
            for method in [Method::POST, Method::PATCH, Method::CONNECT] {
                assert_eq!(
                    decide(&ended(class, &method)),
                    (Decision::Stop(Stop::NotIdempotent), 0),
                    "{class:?} {method}"
                );
            }
        }
    }

    #[test]
    fn a_failure_retry_needs_the_budget() {
        for class in [CONNECT, IO] {
            let decision = policy().decide(&ended(class, &Method::GET), || false);
            assert_eq!(decision, Decision::Stop(Stop::BudgetSpent), "{class:?}");
        }
    }
}
