//! The admin API under `/_custom_router/`: set-backends, health, metrics. Never proxied.

use std::sync::Arc;

use std::net::IpAddr;

use http::header::{ALLOW, AUTHORIZATION, CONTENT_TYPE, HeaderValue, WWW_AUTHENTICATE};
use http::{Method, Request, Response, StatusCode};
use http_body::Body as _;
use http_body_util::{BodyExt, Limited};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::backend::{Backend, BackendAddr};
use crate::balancer::Balancer;
use crate::body::ClientBody;
use crate::cidr::Cidr;
use crate::observed::ResponseBody;
use crate::response;

/// Every admin path starts with this.
pub const PREFIX: &str = "/_custom_router";
/// `POST`: replace the backend set.
pub const SET_BACKENDS: &str = "/_custom_router/set-backends";
/// `GET`: readiness and per-backend state.
pub const HEALTH: &str = "/_custom_router/health";
/// `GET`: Prometheus text.
pub const METRICS: &str = "/_custom_router/metrics";

/// Largest set-backends body accepted.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
/// Most backends one set-backends call may list.
pub const MAX_BACKENDS: usize = 1024;

/// Whether `path` belongs to the admin API (and so is never proxied).
pub fn is_admin_path(path: &str) -> bool {
    path.strip_prefix(PREFIX)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// The `[admin]` section: optional protections of the admin API (both off by default: the
/// platform sends no credentials).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Bearer token that set-backends requires (printed redacted).
    #[serde(with = "crate::forms::secret")]
    pub token: Option<String>,
    /// Networks every backend address must be in; empty allows any address.
    #[serde(with = "crate::forms::list")]
    pub backend_allow_cidrs: Vec<Cidr>,
}

impl AdminConfig {
    /// Checks what the types leave open: a set token is one a client can send after `Bearer `
    /// (the header is read as visible ASCII, trimmed), so a token with a space, a line break or
    /// a non-ASCII character, which would refuse every call, is an error. The error names the
    /// key within `[admin]`.
    pub fn check(&self) -> Result<(), crate::forms::Invalid> {
        if let Some(token) = self.token.as_deref() {
            if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(crate::forms::Invalid::new(
                    "token",
                    "expected a non-empty token of visible ASCII characters (no spaces or line breaks)",
                ));
            }
        }
        Ok(())
    }

    /// Whether `headers` carry the configured bearer token (or none is configured).
    fn authorizes(&self, headers: &http::HeaderMap) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        let presented = headers
            .get(AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| {
                let (scheme, token) = value.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(token)
            })
            .unwrap_or("");
        constant_time_eq(presented.trim().as_bytes(), token.as_bytes())
    }

    /// Checks every address against the allow-list; the error names the entry.
    fn check_networks(&self, addrs: &[BackendAddr]) -> Result<(), String> {
        if self.backend_allow_cidrs.is_empty() {
            return Ok(());
        }
        for (index, addr) in addrs.iter().enumerate() {
            let host = addr
                .authority()
                .host()
                .trim_start_matches('[')
                .trim_end_matches(']');
            let Ok(ip) = host.parse::<IpAddr>() else {
                return Err(format!(
                    "backends[{index}]: {addr} is a host name; only IP addresses in the allowed networks are accepted"
                ));
            };
            if !self
                .backend_allow_cidrs
                .iter()
                .any(|network| network.contains(ip))
            {
                return Err(format!(
                    "backends[{index}]: {addr} is outside the allowed networks"
                ));
            }
        }
        Ok(())
    }
}

/// Compares two byte strings in time that depends only on their lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The answer to an admin request that does not depend on its body, if it is refused whatever
/// the body holds: an unknown path (404), a wrong method (405), set-backends without the token
/// (401) or with a body declared (`declared`, its `Content-Length`) over [`MAX_BODY_BYTES`]
/// (413). Asked before the body is read, so that a client expecting `100 Continue` is refused
/// before it is told to send.
pub fn refusal(
    policy: &AdminConfig,
    method: &Method,
    path: &str,
    headers: &http::HeaderMap,
    declared: Option<u64>,
) -> Option<Response<ResponseBody>> {
    let allowed = match path {
        SET_BACKENDS => Method::POST,
        HEALTH | METRICS => Method::GET,
        _ => return Some(response::error(StatusCode::NOT_FOUND, "unknown admin path")),
    };
    if method != allowed && !(allowed == Method::GET && method == Method::HEAD) {
        let mut answer = response::error(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("method {method} not allowed; use {allowed}"),
        );
        // HEAD is served where GET is (RFC 9110 §10.2.1: `Allow` lists what the resource takes).
        let allow = if allowed == Method::GET {
            HeaderValue::from_static("GET, HEAD")
        } else {
            HeaderValue::from_str(allowed.as_str()).expect("a method is a valid header value")
        };
        answer.headers_mut().insert(ALLOW, allow);
        return Some(answer);
    }
    if path == SET_BACKENDS {
        if !policy.authorizes(headers) {
            let mut answer =
                response::error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
            answer
                .headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return Some(answer);
        }
        // A body declared larger than the limit is refused before any of it is read.
        if declared.is_some_and(|length| length > MAX_BODY_BYTES as u64) {
            return Some(too_large());
        }
    }
    None
}

/// Answers one admin request.
pub async fn handle(
    balancer: &Arc<Balancer>,
    policy: &AdminConfig,
    request: Request<ClientBody>,
) -> Response<ResponseBody> {
    let declared = request.body().size_hint().lower();
    if let Some(answer) = refusal(
        policy,
        request.method(),
        request.uri().path(),
        request.headers(),
        Some(declared),
    ) {
        return answer;
    }
    match request.uri().path() {
        SET_BACKENDS => set_backends(balancer, policy, request).await,
        HEALTH => {
            let status = if balancer.is_draining() {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::OK
            };
            response::json(status, &health(balancer))
        }
        _ => metrics(balancer),
    }
}

/// Set-backends, its token and declared size checked ([`refusal`]).
async fn set_backends(
    balancer: &Arc<Balancer>,
    policy: &AdminConfig,
    request: Request<ClientBody>,
) -> Response<ResponseBody> {
    let body = match Limited::new(request.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => return too_large(),
        // A body the client stopped sending: 408, as a proxied request's (and its connection
        // closed); one cut short: 400.
        Err(error) => match crate::h1::BodyFailure::of(&*error) {
            failure @ crate::h1::BodyFailure::TimedOut => return response::body_failure(failure),
            crate::h1::BodyFailure::Broken => {
                return response::error(
                    StatusCode::BAD_REQUEST,
                    &format!("could not read body: {error}"),
                );
            }
        },
    };
    let addrs = match parse_backends(&body).and_then(|addrs| {
        policy.check_networks(&addrs)?;
        Ok(addrs)
    }) {
        Ok(addrs) => addrs,
        Err(message) => return response::error(StatusCode::BAD_REQUEST, &message),
    };
    balancer.mark_set_by_admin();
    let backends = balancer.set_backends(addrs);
    let list: Vec<&str> = backends.iter().map(|b| b.addr().as_str()).collect();
    tracing::info!(backends = ?list, "backend set replaced");
    response::json(StatusCode::OK, &json!({ "ok": true, "backends": list }))
}

fn too_large() -> Response<ResponseBody> {
    response::error(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!("body larger than {MAX_BODY_BYTES} bytes"),
    )
}

/// Parses a set-backends body; the error names the offending field.
pub fn parse_backends(body: &[u8]) -> Result<Vec<BackendAddr>, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|error| format!("malformed JSON: {error}"))?;
    let Value::Object(object) = value else {
        return Err("body must be a JSON object with a `backends` array".to_owned());
    };
    // A map keeps the last of two `backends` fields: which one the sender meant is unknowable.
    #[derive(serde::Deserialize)]
    struct Fields {
        #[allow(dead_code)]
        backends: Option<serde::de::IgnoredAny>,
    }
    if let Err(error) = serde_json::from_slice::<Fields>(body) {
        if error.to_string().starts_with("duplicate field") {
            return Err("duplicate field `backends`".to_owned());
        }
    }
    let entries = match object.get("backends") {
        None => return Err("missing field `backends`".to_owned()),
        Some(Value::Array(entries)) => entries,
        Some(_) => return Err("field `backends` must be an array of strings".to_owned()),
    };
    if entries.len() > MAX_BACKENDS {
        return Err(format!(
            "field `backends` has {} entries; at most {MAX_BACKENDS} are allowed",
            entries.len()
        ));
    }
    entries
        .iter()
        .enumerate()
        .map(|(index, entry)| {
            let Value::String(text) = entry else {
                return Err(format!("backends[{index}] must be a string, found {entry}"));
            };
            text.parse::<BackendAddr>()
                .map_err(|error| format!("backends[{index}]: {error}"))
        })
        .collect()
}

fn backend_json(backend: &Backend, now: Instant) -> Value {
    let availability = backend.availability();
    json!({
        "addr": backend.addr().as_str(),
        "in_flight": backend.in_flight(),
        "ewma_latency": backend.ewma_latency(),
        "completed": backend.completed(),
        "ejected": availability.is_ejected(),
        "paused": availability.is_paused(now),
        "prefix_reach_tokens": backend.prefixes().reach_tokens(),
        "prefix_stale_kept": backend.prefixes().stale_kept(),
    })
}

/// The health document: `ok`, `strategy`, `queue_depth` and per-backend state; while draining
/// `ok` is false and `draining` true.
pub fn health(balancer: &Balancer) -> Value {
    let now = Instant::now();
    let backends: Vec<Value> = balancer
        .backends()
        .iter()
        .map(|b| backend_json(b, now))
        .collect();
    let draining = balancer.is_draining();
    json!({
        "ok": !draining,
        "draining": draining,
        "strategy": balancer.strategy().name(),
        "queue_depth": balancer.queue_depth(),
        "panic_mode": balancer.in_panic_mode(),
        "backends": backends,
    })
}

fn metrics(balancer: &Balancer) -> Response<ResponseBody> {
    match balancer.metrics().render() {
        Ok(text) => {
            let mut answer = Response::new(http_body_util::Either::Right(
                http_body_util::Full::new(bytes::Bytes::from(text)),
            ));
            answer.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            answer
        }
        Err(error) => response::error(StatusCode::INTERNAL_SERVER_ERROR, &error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_paths_are_recognised_exactly() {
        assert!(is_admin_path("/_custom_router"));
        assert!(is_admin_path("/_custom_router/health"));
        assert!(is_admin_path("/_custom_router/anything"));
        assert!(!is_admin_path("/_custom_routerx"));
        assert!(!is_admin_path("/v1/_custom_router/health"));
    }

    #[test]
    fn parse_errors_name_the_field() {
        let error = |body: &str| parse_backends(body.as_bytes()).unwrap_err();
        assert!(error("{").starts_with("malformed JSON"));
        assert_eq!(
            error("[]"),
            "body must be a JSON object with a `backends` array"
        );
        assert_eq!(error("{}"), "missing field `backends`");
        assert_eq!(
            error(r#"{"backends":"a:1"}"#),
            "field `backends` must be an array of strings"
        );
        assert_eq!(
            error(r#"{"backends":["a:1",5]}"#),
            "backends[1] must be a string, found 5"
        );
        assert!(error(r#"{"backends":["a"]}"#).starts_with("backends[0]: "));
        let many: Vec<String> = (0..1025).map(|i| format!("\"h{i}:1\"")).collect();
        assert!(error(&format!("{{\"backends\":[{}]}}", many.join(","))).contains("at most 1024"));
    }

    #[test]
    fn parse_accepts_empty_and_mixed_forms() {
        assert!(parse_backends(br#"{"backends":[]}"#).unwrap().is_empty());
        let addrs = parse_backends(br#"{"backends":["a:1","http://b:2","https://c:3"]}"#).unwrap();
        assert_eq!(addrs.len(), 3);
    }
}
