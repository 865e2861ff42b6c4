//! HTTP/2 cleartext (h2c with prior knowledge) connections, served by hyper, and the glue between
//! hyper and the router:
//!
//! - the preface that tells such a connection from an HTTP/1 one ([`h2_preface`]);
//! - hyper's HTTP/2 server as the router sets it up ([`builder`]);
//! - one connection served until it ends, drains, or the watch of [`super::h2`] closes it
//!   ([`serve_h2`]);
//! - a request made what its HTTP/1.1 head will say before it is routed ([`h2_as_http1`]), and a
//!   plain-HTTP backend's field lines put into the answer's map for hyper ([`fields_into_map`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Request, Response, StatusCode, header};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::body::{ClientBody, H2Body};
use crate::forwarding::ForwardedFor;
use crate::h1;
use crate::observed::ResponseBody;
use crate::response;

use super::h2;
use super::{Shared, route};

/// The HTTP/2 connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Whether the connection opens with the whole HTTP/2 preface: peeks until the bytes received
/// stop matching it (`false`) or match it whole (`true`); `None` if the client closed first.
pub(super) async fn h2_preface(stream: &TcpStream) -> Option<bool> {
    let mut first = [0u8; H2_PREFACE.len()];
    let mut seen = 0;
    loop {
        let peeked = stream.peek(&mut first).await.ok()?;
        if peeked == 0 {
            return None;
        }
        if !H2_PREFACE.starts_with(&first[..peeked]) {
            return Some(false);
        }
        if peeked == H2_PREFACE.len() {
            return Some(true);
        }
        if peeked == seen {
            // A prefix of the preface and nothing new yet. A peek leaves the socket readable, so
            // there is no readiness to wait on: look again shortly (only a client whose first
            // segment is a prefix of the preface, such as a lone `P`, comes here).
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        seen = peeked;
    }
}

/// hyper's HTTP/2 server (HTTP/2 only: it serves just the connections that opened with the
/// preface): at most [`h2::MAX_CONCURRENT_STREAMS`] streams open at once, request heads bounded
/// by `limits.max_header_bytes`.
pub(super) fn builder(limits: &h1::server::Limits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new()).http2_only();
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(h2::MAX_CONCURRENT_STREAMS)
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
    builder
}

/// Serves an HTTP/2 (h2c) connection with hyper until it ends, the router has drained it, it
/// has stayed idle for the header timeout or a stream's answer stalled for the send timeout
/// (see [`h2`]).
pub(super) async fn serve_h2(
    builder: &auto::Builder<TokioExecutor>,
    stream: TcpStream,
    shared: Arc<Shared>,
    client: Arc<ForwardedFor>,
    mut draining: watch::Receiver<bool>,
    peer: SocketAddr,
    limits: h1::server::Limits,
) {
    let streams = Arc::new(h2::Streams::new());
    let service = service_fn({
        let streams = Arc::clone(&streams);
        move |request: Request<hyper::body::Incoming>| {
            let shared = Arc::clone(&shared);
            let client = Arc::clone(&client);
            let stream = streams.open();
            async move {
                let mut request = request;
                if let Err((status, refusal)) = h2_as_http1(&mut request, &limits) {
                    let answer = response::error(status, refusal);
                    return Ok(answer.map(|body| h2::Watched::new(body, stream)));
                }
                let request = request.map(|body| {
                    ClientBody::Right(H2Body::new(
                        body,
                        limits.body_read_timeout,
                        limits.allow_underscore_headers,
                    ))
                });
                let mut answer = route(&shared, request, None, &client).await;
                fields_into_map(&mut answer);
                Ok::<_, Infallible>(answer.map(|body| h2::Watched::new(body, stream)))
            }
        }
    });
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let (send_timeout, idle) = (limits.send_timeout, limits.header_read_timeout);
    let period = h2::check_period(send_timeout, idle);
    let mut check = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Told GOAWAY (draining or idle) at this time: the connection ends once its open streams
    // have, and is dropped when none is open `grace` after it (a client that never acks the
    // GOAWAY's PING, or never takes an answer's last bytes, would hold it forever).
    let mut closing: Option<tokio::time::Instant> = None;
    let grace = send_timeout.min(idle);
    loop {
        tokio::select! {
            ended = connection.as_mut() => {
                if let Err(error) = ended {
                    tracing::debug!(%peer, error = %error, "connection ended with an error");
                }
                return;
            }
            _ = draining.wait_for(|draining| *draining), if closing.is_none() => {
                closing = Some(tokio::time::Instant::now());
                connection.as_mut().graceful_shutdown();
            }
            () = streams.overrun() => {
                tracing::debug!(%peer, "streams went on opening after GOAWAY: connection dropped");
                return;
            }
            () = streams.spent(), if closing.is_none() => {
                tracing::debug!(%peer, "connection opened its last stream: told GOAWAY");
                closing = Some(tokio::time::Instant::now());
                connection.as_mut().graceful_shutdown();
            }
            _ = check.tick() => {
                match streams.check(send_timeout, idle) {
                    h2::Verdict::Fine => {}
                    h2::Verdict::Idle => {
                        if closing.is_none() {
                            closing = Some(tokio::time::Instant::now());
                            connection.as_mut().graceful_shutdown();
                        }
                    }
                    h2::Verdict::Stalled => {
                        tracing::debug!(%peer, "a stream's answer was not taken for send_timeout: connection closed");
                        return;
                    }
                }
                if closing.is_some_and(|since| since.elapsed() >= grace) && streams.none_open() {
                    tracing::debug!(%peer, "told GOAWAY, no stream open, not closed by the client: connection dropped");
                    return;
                }
            }
        }
    }
}

/// Makes an HTTP/2 request that hyper accepted into what its HTTP/1.1 head will say, or says
/// why it is answered instead (400, or 431 for too many fields): what the backend reads from
/// that head must be what the client asked, held to the HTTP/1 server's rules (RFC 9113 §8.3.1
/// for the authority, §8.2.3 for cookies).
fn h2_as_http1(
    request: &mut Request<hyper::body::Incoming>,
    limits: &h1::server::Limits,
) -> Result<(), (StatusCode, &'static str)> {
    let bad = |refusal| Err((StatusCode::BAD_REQUEST, refusal));
    let headers = request.headers_mut();
    // As many fields as the HTTP/1 server takes: the backend reads them as an HTTP/1.1 head,
    // where the cookie crumbs are one line (joined below).
    let crumbs = headers.get_all(header::COOKIE).iter().count();
    if headers.len() - crumbs.saturating_sub(1) > h1::MAX_HEADERS {
        return Err((
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "too many header fields",
        ));
    }
    if !limits.allow_underscore_headers {
        h1::drop_underscore_fields(headers);
    }
    // One `Host` and one `Content-Length` at most (RFC 9112 §3.2, §6.3), as the HTTP/1 server
    // and nginx require: h2 only checks that repeated lengths agree, and a backend would read
    // repeated fields as it likes. The length is held to the HTTP/1 syntax (h2 takes an empty
    // value for 0).
    for (name, refusal) in [
        (header::HOST, "duplicate Host"),
        (header::CONTENT_LENGTH, "duplicate Content-Length"),
    ] {
        if headers.get_all(name).iter().nth(1).is_some() {
            return bad(refusal);
        }
    }
    if let Some(length) = headers.get(header::CONTENT_LENGTH) {
        if h1::parse_content_length(length.as_bytes()).is_err() {
            return bad("invalid Content-Length");
        }
    }
    // The `:authority` is the `Host` the backend reads, held to the HTTP/1 server's rule (and
    // without user information); a `host` field that says otherwise is malformed (RFC 9113
    // §8.3.1), and a request with neither is the HTTP/1.1 request without `Host` the HTTP/1
    // server refuses.
    let authority = request
        .uri()
        .authority()
        .map(|authority| authority.as_str().as_bytes());
    let host = request
        .headers()
        .get(header::HOST)
        .map(HeaderValue::as_bytes);
    if let Some(refusal) = h1::server::host_refusal(authority, host) {
        return bad(refusal);
    }
    if authority.is_none() && host.is_none() {
        return bad("request without Host");
    }
    // Cookies split into fields of their own (as browsers send them over HTTP/2) are one line
    // again, joined with "; " (RFC 9113 §8.2.3).
    let headers = request.headers_mut();
    if headers.get_all(header::COOKIE).iter().nth(1).is_some() {
        let mut joined = Vec::new();
        for (at, value) in headers.get_all(header::COOKIE).iter().enumerate() {
            if at > 0 {
                joined.extend_from_slice(b"; ");
            }
            joined.extend_from_slice(value.as_bytes());
        }
        match HeaderValue::from_bytes(&joined) {
            Ok(joined) => {
                headers.insert(header::COOKIE, joined);
            }
            Err(_) => return bad("invalid Cookie"),
        }
    }
    // The `:path` becomes the request target: origin form, or asterisk form for OPTIONS only
    // (RFC 9113 §8.3.1), as the HTTP/1 server requires. hyper lets a path that starts with `?`
    // through (`GET ?a HTTP/1.1`).
    let uri = request.uri();
    if let Some(refusal) = h1::server::target_form_refusal(request.method(), uri) {
        return bad(refusal);
    }
    let target = uri.path_and_query().map(|path| path.as_str());
    match target {
        Some(target) if target != "*" && !target.starts_with('/') => bad("invalid request target"),
        _ => Ok(()),
    }
}

/// Puts the field lines a plain-HTTP backend sent into the response's map, for hyper to write
/// (the router's HTTP/1 server writes the lines as they are).
fn fields_into_map(answer: &mut Response<ResponseBody>) {
    let http_body_util::Either::Left(observed) = answer.body() else {
        return;
    };
    let Some(passthrough) = observed.passthrough() else {
        return;
    };
    let lines = passthrough.lines.clone();
    let mut fields = Vec::new();
    for line in lines.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(&line[..colon]),
            http::HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
        ) else {
            continue;
        };
        fields.push((name, value));
    }
    for (name, value) in fields {
        answer.headers_mut().append(name, value);
    }
}
