//! Responses the router writes itself: JSON bodies with the right status.

use bytes::Bytes;
use http::header::{ALLOW, CONNECTION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::{Either, Full};

use crate::balancer::Rejection;
use crate::body::BodyFailure;
use crate::observed::ResponseBody;

const JSON: HeaderValue = HeaderValue::from_static("application/json");

/// A JSON response with `status`.
pub fn json(status: StatusCode, value: &serde_json::Value) -> Response<ResponseBody> {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut response = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, JSON);
    response
}

/// `{"error": message}` with `status`.
pub fn error(status: StatusCode, message: &str) -> Response<ResponseBody> {
    json(status, &serde_json::json!({ "error": message }))
}

/// The answer to a request whose body could not be read: 408 when the client stalled, 400 when
/// it left or sent a malformed body; the connection is closed after it (where the next request
/// would start is unknown).
pub fn body_failure(failure: BodyFailure) -> Response<ResponseBody> {
    let mut response = error(failure.status(), failure.message());
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    response
}

/// 405 for `CONNECT`: the router proxies requests, it does not open tunnels.
pub fn connect_not_allowed() -> Response<ResponseBody> {
    let mut response = error(
        StatusCode::METHOD_NOT_ALLOWED,
        "CONNECT is not supported: the router does not open tunnels",
    );
    response.headers_mut().insert(
        ALLOW,
        HeaderValue::from_static("GET, HEAD, POST, PUT, DELETE, OPTIONS, PATCH, TRACE"),
    );
    response
}

/// 503 for a request the router could not place, with `Retry-After`.
pub fn rejection(rejection: Rejection) -> Response<ResponseBody> {
    let mut response = json(
        StatusCode::SERVICE_UNAVAILABLE,
        &serde_json::json!({ "error": rejection.message(), "reason": reason(rejection) }),
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(rejection.retry_after()));
    response
}

/// The `reason` field of a rejection's answer.
pub fn reason(rejection: Rejection) -> &'static str {
    match rejection {
        Rejection::NoBackend => "no_backend",
        Rejection::Evicted => "evicted",
        Rejection::Timeout => "queue_timeout",
        Rejection::ShuttingDown => "shutting_down",
        Rejection::Busy => "busy",
        Rejection::Overloaded(_) => "overloaded",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overloaded_rejection_says_when_to_come_back() {
        let response = rejection(Rejection::Overloaded(7));
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[RETRY_AFTER], "7");
        let response = rejection(Rejection::Timeout);
        assert_eq!(response.headers()[RETRY_AFTER], "1");
    }
}
