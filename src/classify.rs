//! How one attempt ended, judged in one place: every decision that reads an answer — retry,
//! the latency sample and the strategy's outcome, ejection, the busy pause — derives from the
//! [`Class`] computed here, so they cannot drift apart (linkerd's `classify`).

use std::time::Duration;

use http::StatusCode;

use crate::backend::ErrorKind;

/// Default pause for a 429 without `Retry-After`.
pub const DEFAULT_BUSY_PAUSE: Duration = Duration::from_secs(1);

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Class {
    /// A 1xx–3xx answer.
    Success,
    /// A 4xx answer other than 429: the request's fault, not the backend's.
    ClientError,
    /// 429, or 503 with `Retry-After`: busy, not broken; pause this long.
    Busy(Duration),
    /// An upstream error (connect, timeout, I/O), or 500, 502, 504, or 503 without
    /// `Retry-After`.
    Failure(Option<ErrorKind>),
    /// Another 5xx (501, 505, ...): neither healthy nor a failure.
    Neutral,
}

impl Class {
    /// The class of an attempt that got `status` (if it answered), failed with `error` (if it
    /// did, the answer's status notwithstanding), and carried `retry_after`.
    pub fn of(
        status: Option<StatusCode>,
        error: Option<ErrorKind>,
        retry_after: Option<Duration>,
    ) -> Self {
        if let Some(kind) = error {
            return Class::Failure(Some(kind));
        }
        match status.map(|status| status.as_u16()) {
            Some(429) => Class::Busy(retry_after.unwrap_or(DEFAULT_BUSY_PAUSE)),
            Some(503) => retry_after.map_or(Class::Failure(None), Class::Busy),
            Some(500 | 502 | 504) => Class::Failure(None),
            Some(501..=599) => Class::Neutral,
            Some(400..=499) => Class::ClientError,
            _ => Class::Success,
        }
    }

    /// Whether the backend said it is busy (the request may go to another at once).
    pub fn is_busy(self) -> bool {
        matches!(self, Class::Busy(_))
    }

    /// Whether the attempt counts as failed for the latency sample and the strategy: it must
    /// never look fast (failures, busy answers and other 5xx count at least the threshold).
    pub fn counts_as_failed(self) -> bool {
        matches!(self, Class::Failure(_) | Class::Busy(_) | Class::Neutral)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_follow_the_status_the_error_and_retry_after() {
        let two = Some(Duration::from_secs(2));
        let busy_two = Class::Busy(Duration::from_secs(2));
        let io = Some(ErrorKind::Io);
        let cases = [
            (Some(StatusCode::OK), None, None, Class::Success),
            (Some(StatusCode::NOT_FOUND), None, None, Class::ClientError),
            (
                Some(StatusCode::INTERNAL_SERVER_ERROR),
                None,
                None,
                Class::Failure(None),
            ),
            (
                Some(StatusCode::BAD_GATEWAY),
                None,
                None,
                Class::Failure(None),
            ),
            (
                Some(StatusCode::GATEWAY_TIMEOUT),
                None,
                None,
                Class::Failure(None),
            ),
            (
                Some(StatusCode::SERVICE_UNAVAILABLE),
                None,
                None,
                Class::Failure(None),
            ),
            (Some(StatusCode::SERVICE_UNAVAILABLE), None, two, busy_two),
            (Some(StatusCode::TOO_MANY_REQUESTS), None, two, busy_two),
            (
                Some(StatusCode::TOO_MANY_REQUESTS),
                None,
                None,
                Class::Busy(DEFAULT_BUSY_PAUSE),
            ),
            (
                Some(StatusCode::NOT_IMPLEMENTED),
                None,
                None,
                Class::Neutral,
            ),
            (None, io, None, Class::Failure(io)),
            (Some(StatusCode::OK), io, None, Class::Failure(io)),
        ];
        for (status, error, retry_after, expected) in cases {
            assert_eq!(
                Class::of(status, error, retry_after),
                expected,
                "{status:?} {error:?}"
            );
        }
        assert!(Class::Busy(DEFAULT_BUSY_PAUSE).is_busy());
        assert!(!Class::Failure(None).is_busy());
        assert!(!Class::Success.counts_as_failed() && !Class::ClientError.counts_as_failed());
        assert!(
            Class::Neutral.counts_as_failed() && Class::Busy(DEFAULT_BUSY_PAUSE).counts_as_failed()
        );
    }
}
