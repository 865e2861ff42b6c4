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
//! 8. a generation request (a `POST` on one of `retry.generation_paths`: an LLM generation, which
//!    has no side effect) is also retried after a reset before the response head, or a 5xx head
//!    of `retry.generation_statuses`: nothing of it reached the client, and another replica can
//!    generate the answer;
//! 9. a failure retry needs a retry left in the budget.

use http::{Method, StatusCode};
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
    /// Paths whose `POST` requests are generations (no side effect): also retried after a reset
    /// before the response head or a 5xx head of [`Self::generation_statuses`].
    #[serde(with = "crate::forms::list")]
    pub generation_paths: Vec<String>,
    /// The 5xx statuses a generation request is retried after.
    pub generation_statuses: Vec<u16>,
}

/// The OpenAI and TGI generation paths.
pub const GENERATION_PATHS: [&str; 6] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/generate",
    "/generate_stream",
    "/invocations",
];

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            body_limit: 1024 * 1024,
            max_buffered_bytes: 32 * 1024 * 1024,
            budget: BudgetConfig::default(),
            generation_paths: GENERATION_PATHS.map(str::to_owned).to_vec(),
            generation_statuses: vec![500, 502, 503, 504],
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
        if let Some(path) = self.generation_paths.iter().find(|p| !p.starts_with('/')) {
            return Err(crate::forms::Invalid::new(
                "generation_paths",
                format!("expected paths starting with /, found {path:?}"),
            ));
        }
        if let Some(status) = self
            .generation_statuses
            .iter()
            .find(|status| !(500..=599).contains(*status))
        {
            return Err(crate::forms::Invalid::new(
                "generation_statuses",
                format!("expected 5xx statuses, found {status}"),
            ));
        }
        Ok(())
    }

    /// Whether a request with `method` and `path` (no query) is a generation request.
    pub fn is_generation(&self, method: &Method, path: &str) -> bool {
        *method == Method::POST && self.generation_paths.iter().any(|p| p == path)
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
    /// Whether the request is a generation ([`RetryConfig::is_generation`]).
    pub generation: bool,
    /// The answer's status, when the backend answered.
    pub status: Option<StatusCode>,
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
    /// The request may have reached the backend, and its method is not idempotent (nor is it a
    /// generation that failed before its head).
    NotIdempotent,
    /// The retry budget has no retry left.
    BudgetSpent,
}

/// The retry rules of the `[retry]` section (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    max_attempts: u32,
    /// [`RetryConfig::generation_statuses`]: bit `n` for status `500 + n`.
    generation_statuses: u128,
}

impl RetryPolicy {
    /// The policy of a `[retry]` section.
    pub fn new(config: &RetryConfig) -> Self {
        let generation_statuses = config
            .generation_statuses
            .iter()
            .filter(|status| (500..=599).contains(*status))
            .fold(0u128, |bits, status| bits | 1 << (status - 500));
        Self {
            max_attempts: config.max_attempts,
            generation_statuses,
        }
    }

    fn is_generation_status(&self, status: Option<StatusCode>) -> bool {
        status
            .map(|status| status.as_u16())
            .filter(|code| (500..=599).contains(code))
            .is_some_and(|code| self.generation_statuses & (1 << (code - 500)) != 0)
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
        let retriable = self.retriable_ending(attempt)?;
        if !attempt.replayable {
            return Err(Stop::NotReplayable);
        }
        if attempt.number >= self.max_attempts {
            return Err(Stop::AttemptsSpent);
        }
        let reason = match retriable {
            Retriable::Busy => return Ok(RetryReason::Busy),
            Retriable::Failure(kind) => failure_reason(kind, attempt)?,
            Retriable::GenerationStatus => RetryReason::Generation,
        };
        if !withdraw() {
            return Err(Stop::BudgetSpent);
        }
        Ok(reason)
    }

    /// Whether an ending may be retried at all, and as what.
    fn retriable_ending(&self, attempt: &Attempted<'_>) -> Result<Retriable, Stop> {
        match attempt.ending {
            Ending::ClientBody => Err(Stop::ClientBody),
            Ending::Backend(Class::Busy(_)) => Ok(Retriable::Busy),
            Ending::Backend(Class::Failure(Some(kind))) => Ok(Retriable::Failure(kind)),
            Ending::Backend(_)
                if attempt.generation && self.is_generation_status(attempt.status) =>
            {
                Ok(Retriable::GenerationStatus)
            }
            Ending::Backend(_) => Err(Stop::Answered),
        }
    }
}

/// What of an ending may be retried.
enum Retriable {
    /// A busy answer.
    Busy,
    /// An upstream failure before the response head.
    Failure(ErrorKind),
    /// A generation's 5xx head of `retry.generation_statuses`.
    GenerationStatus,
}

/// Why a failure of `kind` may be retried for the attempt's request, if it may: a connect
/// failure for any method, another for an idempotent one, a reset for a generation.
fn failure_reason(kind: ErrorKind, attempt: &Attempted<'_>) -> Result<RetryReason, Stop> {
    if kind.before_request_sent() {
        Ok(RetryReason::Connect)
    } else if is_idempotent(attempt.method) {
        Ok(RetryReason::Idempotent)
    } else if attempt.generation && kind == ErrorKind::Io {
        Ok(RetryReason::Generation)
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
            generation: false,
            status: None,
        }
    }

    /// A first attempt of a generation request that got `status`.
    fn generation_answered(status: u16) -> Attempted<'static> {
        let status = StatusCode::from_u16(status).unwrap();
        Attempted {
            generation: true,
            status: Some(status),
            ..ended(Class::of(Some(status), None, None), &Method::POST)
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

    #[test]
    fn a_generation_is_retried_after_a_5xx_head_of_the_statuses_and_a_reset() {
        for status in [500, 502, 503, 504] {
            assert_eq!(
                decide(&generation_answered(status)),
                (Decision::Retry(RetryReason::Generation), 1),
                "{status}"
            );
        }
        let reset = Attempted {
            generation: true,
            ..ended(IO, &Method::POST)
        };
        assert_eq!(
            decide(&reset),
            (Decision::Retry(RetryReason::Generation), 1)
        );
        // Not a 4xx, not a 501, not a success; not a first-byte timeout (the backend may still
        // be generating); not the same request on another path.
        for status in [200, 400, 404, 501] {
            assert_eq!(
                decide(&generation_answered(status)),
                (Decision::Stop(Stop::Answered), 0),
                "{status}"
            );
        }
        let slow = Attempted {
            generation: true,
            ..ended(
                Class::Failure(Some(ErrorKind::FirstByteTimeout)),
                &Method::POST,
            )
        };
        assert_eq!(decide(&slow), (Decision::Stop(Stop::NotIdempotent), 0));
        let elsewhere = Attempted {
            generation: false,
            ..generation_answered(500)
        };
        assert_eq!(decide(&elsewhere), (Decision::Stop(Stop::Answered), 0));
        // Nothing once the answer started, within the attempts and the budget.
        let started = Attempted {
            answer_started: true,
            ..generation_answered(500)
        };
        assert_eq!(decide(&started), (Decision::Stop(Stop::AnswerStarted), 0));
        let last = Attempted {
            number: 3,
            ..generation_answered(502)
        };
        assert_eq!(decide(&last), (Decision::Stop(Stop::AttemptsSpent), 0));
        assert_eq!(
            policy().decide(&generation_answered(500), || false),
            Decision::Stop(Stop::BudgetSpent)
        );
    }

    #[test]
    fn generation_paths_and_statuses_are_configured() {
        let config = RetryConfig {
            generation_paths: vec!["/v2/generate".to_owned()],
            generation_statuses: vec![503],
            ..RetryConfig::default()
        };
        assert!(config.is_generation(&Method::POST, "/v2/generate"));
        assert!(!config.is_generation(&Method::POST, "/v1/chat/completions"));
        assert!(!config.is_generation(&Method::GET, "/v2/generate"));
        let policy = RetryPolicy::new(&config);
        let attempt = |status| Attempted {
            generation: true,
            ..generation_answered(status)
        };
        assert_eq!(
            policy.decide(&attempt(503), || true),
            Decision::Retry(RetryReason::Generation)
        );
        assert_eq!(
            policy.decide(&attempt(500), || true),
            Decision::Stop(Stop::Answered)
        );
        for path in GENERATION_PATHS {
            assert!(
                RetryConfig::default().is_generation(&Method::POST, path),
                "{path}"
            );
        }
        let relative = RetryConfig {
            generation_paths: vec!["v1/chat".to_owned()],
            ..RetryConfig::default()
        };
        assert_eq!(relative.check().unwrap_err().key, "generation_paths");
        let not_5xx = RetryConfig {
            generation_statuses: vec![429],
            ..RetryConfig::default()
        };
        assert_eq!(not_5xx.check().unwrap_err().key, "generation_statuses");
    }
}
