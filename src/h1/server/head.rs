//! Reading a request head: parsed in place (httparse), the framing and connection fields read,
//! the others kept as the client's lines ([`FieldLines`], the fields the caller sets itself set
//! aside) or, when the lines cannot carry the caller's rules, put in a map; the checks of the
//! target's form and of `Host`.

use std::mem::MaybeUninit;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Uri, Version};

use crate::h1::fields::{Captured, FieldLines, MAX_CAPTURED, Repeated};
use crate::h1::{
    Hop, MAX_HEADERS, Span, append_field, apply_connection, field_spans, hop_by_hop, is_chunked,
    parse_content_length,
};

use super::Limits;

/// A parsed request head, and what it says about the body and the connection.
pub(super) struct Head {
    /// The request; its map is empty when its fields are kept as lines.
    pub(super) request: Request<()>,
    /// The request's fields as lines, when they serve.
    pub(super) fields: Option<FieldLines>,
    pub(super) body: BodyLength,
    pub(super) keep_alive: bool,
    pub(super) expects_continue: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyLength {
    Length(u64),
    Chunked,
}

/// Why a connection ends without an answer to a request.
pub(super) enum Refusal {
    /// Closed by the client, timed out, or drained while idle: nothing to say.
    Quiet,
    /// A malformed or oversized head: answered with this status and closed.
    Answer(StatusCode, &'static str),
}

/// Why a request target's form does not fit its method, if it does not: authority form is for
/// CONNECT only, asterisk form for OPTIONS only (RFC 9112 §3.2.3, §3.2.4); another method with
/// either has no path to forward.
pub fn target_form_refusal(method: &Method, uri: &Uri) -> Option<&'static str> {
    let authority_form = uri.scheme().is_none() && uri.authority().is_some();
    if authority_form && method != Method::CONNECT {
        return Some("authority-form target without CONNECT");
    }
    let asterisk_form = uri
        .path_and_query()
        .is_some_and(|target| target.as_str() == "*");
    if asterisk_form && method != Method::OPTIONS {
        return Some("asterisk-form target without OPTIONS");
    }
    None
}

/// Why a request's host is refused (400), given its target's authority (HTTP/1 absolute form,
/// HTTP/2 `:authority`) and its `Host` field: an authority with user information (RFC 9110
/// §4.2.4) or either not a valid host ([`valid_host`]), or a `Host` that names another host than
/// the authority (RFC 9112 §3.2.2 has a proxy take the target's, RFC 9113 §8.3.1 calls the
/// request malformed; refused as HAProxy refuses it, so that no party reads another host).
pub fn host_refusal(authority: Option<&[u8]>, host: Option<&[u8]>) -> Option<&'static str> {
    if authority.is_some_and(|authority| authority.contains(&b'@') || !valid_host(authority))
        || host.is_some_and(|host| !valid_host(host))
    {
        return Some("invalid Host");
    }
    match (authority, host) {
        (Some(authority), Some(host)) if !authority.eq_ignore_ascii_case(host) => {
            Some("Host differs from the target's authority")
        }
        _ => None,
    }
}

/// Whether a `Host` value names a host as nginx accepts it (`ngx_http_validate_host`): no
/// space, control byte or `/`, no `..`, and a name that is not empty once a port and one
/// trailing dot are set aside. The value reaches the backend as it is, and a backend may build
/// paths, links or cache keys from it.
pub fn valid_host(value: &[u8]) -> bool {
    let mut name_end = value.len();
    let mut literal = false;
    let mut in_port = false;
    let mut previous = 0u8;
    for (at, &byte) in value.iter().enumerate() {
        match byte {
            b'.' if previous == b'.' => return false,
            b':' if !literal && !in_port => {
                name_end = at;
                in_port = true;
            }
            b'[' if at == 0 => literal = true,
            b']' if literal => {
                name_end = at + 1;
                literal = false;
                in_port = true;
            }
            b'/' => return false,
            byte if byte <= 0x20 || byte == 0x7f => return false,
            _ => {}
        }
        previous = byte;
    }
    let name = &value[..name_end];
    let name = name.strip_suffix(b".").unwrap_or(name);
    !name.is_empty()
}

/// Parses a request head at the start of `buffer` and removes it from there; `None` when it is
/// not complete yet. The `captured` fields are left out of the lines, their values set aside.
pub(super) fn parse_head(
    buffer: &mut BytesMut,
    limits: Limits,
    captured: Captured,
) -> Result<Option<Head>, Refusal> {
    let max_header_bytes = limits.max_header_bytes;
    // Empty lines before a request line are passed over (RFC 9112 §2.2).
    let blank = buffer
        .iter()
        .take_while(|&&b| b == b'\r' || b == b'\n')
        .count();
    if blank > 0 {
        buffer.advance(blank);
        if buffer.is_empty() {
            return Ok(None);
        }
    }
    let mut fields = [MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_HEADERS];
    let mut spans: [Span; MAX_HEADERS] = [(0, 0, 0, 0); MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let status = match parsed.parse_with_uninit_headers(buffer, &mut fields) {
        Ok(status) => status,
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Refusal::Answer(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "too many header fields",
            ));
        }
        Err(_) => {
            return Err(Refusal::Answer(
                StatusCode::BAD_REQUEST,
                "malformed request head",
            ));
        }
    };
    let httparse::Status::Complete(length) = status else {
        if buffer.len() >= max_header_bytes {
            return Err(Refusal::Answer(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "request head too large",
            ));
        }
        return Ok(None);
    };
    if length > max_header_bytes {
        return Err(Refusal::Answer(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "request head too large",
        ));
    }
    let bad = |message| Refusal::Answer(StatusCode::BAD_REQUEST, message);
    let method = Method::from_bytes(parsed.method.unwrap_or_default().as_bytes())
        .map_err(|_| bad("invalid method"))?;
    let version = if parsed.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    let path = parsed.path.unwrap_or_default();
    let path_span = (
        path.as_ptr() as usize - buffer.as_ptr() as usize,
        path.len(),
    );
    let count = parsed.headers.len();
    field_spans(buffer, parsed.headers, &mut spans);
    let head = buffer.split_to(length).freeze();
    let uri = Uri::from_maybe_shared(head.slice(path_span.0..path_span.0 + path_span.1))
        .map_err(|_| bad("invalid request target"))?;
    if let Some(refusal) = target_form_refusal(&method, &uri) {
        return Err(bad(refusal));
    }
    let spans = &spans[..count];
    let field = |start: u32, end: u32| &head[start as usize..end as usize];
    // One pass reads the framing and connection fields and writes the others as lines (httparse
    // checked names and values already).
    let mut content_length: Option<u64> = None;
    let mut chunked: Option<bool> = None;
    let mut keep_alive = version == Version::HTTP_11;
    let mut expects_continue = false;
    let mut connection_names_fields = false;
    let mut hosts = 0usize;
    let mut dropped = false;
    // Where each captured field's value lies, and whether one whose values are one list came
    // more than once.
    let mut values = [None; MAX_CAPTURED];
    let mut list_repeated = false;
    let mut lines = Vec::with_capacity(length);
    for &(name_start, name_end, value_start, value_end) in spans {
        let (name, value) = (field(name_start, name_end), field(value_start, value_end));
        if !limits.allow_underscore_headers && name.contains(&b'_') {
            dropped = true;
            continue;
        }
        match hop_by_hop(name) {
            Some(Hop::Connection) => {
                connection_names_fields |=
                    apply_connection(value, version == Version::HTTP_10, &mut keep_alive);
                continue;
            }
            Some(Hop::TransferEncoding) => {
                if chunked.is_some() {
                    return Err(bad("duplicate Transfer-Encoding"));
                }
                chunked = Some(is_chunked(value));
                continue;
            }
            Some(Hop::Other) => continue,
            None => {}
        }
        if name.eq_ignore_ascii_case(b"content-length") {
            if content_length.is_some() {
                return Err(bad("duplicate Content-Length"));
            }
            let length = parse_content_length(value).map_err(|_| bad("invalid Content-Length"))?;
            content_length = Some(length);
        } else if name.eq_ignore_ascii_case(b"host") {
            let authority = uri.authority().map(|a| a.as_str().as_bytes());
            if let Some(refusal) = host_refusal(authority, Some(value)) {
                return Err(bad(refusal));
            }
            hosts += 1;
        } else if name.eq_ignore_ascii_case(b"expect") {
            // An HTTP/1.0 client reads no interim answers: its expectation is ignored
            // (RFC 9110 §10.1.1).
            expects_continue =
                version == Version::HTTP_11 && value.eq_ignore_ascii_case(b"100-continue");
        } else if let Some(index) = captured.position(name) {
            match values[index] {
                None => values[index] = Some((value_start, value_end)),
                Some(_) => {
                    list_repeated |= captured.fields()[index].repeated == Repeated::Mapped;
                }
            }
            continue;
        }
        append_field(&mut lines, name, value);
    }
    // RFC 9112 §3.2: an HTTP/1.1 request has exactly one `Host` (nginx: 400 otherwise).
    if hosts > 1 {
        return Err(bad("duplicate Host"));
    }
    if hosts == 0 && version == Version::HTTP_11 {
        return Err(bad("HTTP/1.1 request without Host"));
    }
    let has_host = hosts == 1;
    if !has_host {
        // An absolute-form target without `Host` (HTTP/1.0): its authority becomes the `Host`.
        let authority = uri.authority().map(|a| a.as_str().as_bytes());
        if let Some(refusal) = host_refusal(authority, None) {
            return Err(bad(refusal));
        }
    }
    // Lines serve unless `Connection` names fields (they must go too), a captured field whose
    // values are one list came more than once (they are joined), or an absolute-form target
    // stands for `Host`.
    let as_lines =
        !connection_names_fields && !list_repeated && (has_host || uri.authority().is_none());
    let (headers, fields) = if as_lines {
        // The values set aside keep the head; with none, nothing does.
        let set_aside = if values.iter().any(Option::is_some) {
            head.clone()
        } else {
            Bytes::new()
        };
        let fields = FieldLines::with_captured(
            Bytes::from(lines),
            captured,
            set_aside,
            values,
            has_host,
            content_length.is_some(),
        );
        (HeaderMap::new(), Some(fields))
    } else {
        let kept = |name: &[u8]| !dropped || !name.contains(&b'_');
        (
            field_map(&head, spans, captured.fields().len(), kept).map_err(bad)?,
            None,
        )
    };
    let body = match (chunked, content_length) {
        (Some(_), Some(_)) => {
            return Err(bad("request has both Transfer-Encoding and Content-Length"));
        }
        // HTTP/1.0 has no transfer codings: a sender that uses one cannot be trusted on framing.
        (Some(_), None) if version == Version::HTTP_10 => {
            return Err(bad("Transfer-Encoding in an HTTP/1.0 request"));
        }
        (Some(true), None) => BodyLength::Chunked,
        // nginx: 501 for a coding it cannot decode.
        (Some(false), None) => {
            return Err(Refusal::Answer(
                StatusCode::NOT_IMPLEMENTED,
                "unsupported transfer coding",
            ));
        }
        (None, length) => BodyLength::Length(length.unwrap_or(0)),
    };
    let mut request = Request::new(());
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = version;
    *request.headers_mut() = headers;
    Ok(Some(Head {
        request,
        fields,
        body,
        keep_alive,
        expects_continue,
    }))
}

/// Every field of the request head `head` (where `spans` lie) whose name is `kept`, in a map,
/// with room for `added` more.
fn field_map(
    head: &Bytes,
    spans: &[Span],
    added: usize,
    kept: impl Fn(&[u8]) -> bool,
) -> Result<HeaderMap, &'static str> {
    // Room for the captured fields the caller sets again, so the map does not grow for them.
    let mut headers = HeaderMap::with_capacity(spans.len() + added);
    for &(name_start, name_end, value_start, value_end) in spans {
        if !kept(&head[name_start as usize..name_end as usize]) {
            continue;
        }
        let name = HeaderName::from_bytes(&head[name_start as usize..name_end as usize])
            .map_err(|_| "invalid header name")?;
        let value =
            HeaderValue::from_maybe_shared(head.slice(value_start as usize..value_end as usize))
                .map_err(|_| "invalid header value")?;
        headers.append(name, value);
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{TEST_CAPTURED, test_limits};
    use super::*;

    #[test]
    fn a_host_is_accepted_as_nginx_accepts_it() {
        for host in [
            &b"example.test"[..],
            b"example.test:8080",
            b"example.test.",
            b"10.0.0.1:80",
            b"[::1]",
            b"[::1]:3000",
            b"xn--caf-dma.test",
            b"under_score.test",
        ] {
            assert!(valid_host(host), "{}", String::from_utf8_lossy(host));
        }
        for host in [
            &b""[..],
            b":80",
            b".",
            b"a b",
            b"a\tb",
            b"a/b",
            b"a/../b",
            b"a..b",
            b"..",
            b"x\x7f",
            b"x\x01y",
        ] {
            assert!(!valid_host(host), "{}", String::from_utf8_lossy(host));
        }
    }

    #[test]
    fn heads_say_how_the_body_is_delimited_and_whether_to_keep_alive() {
        let parse = |text: &str| match parse_head(
            &mut BytesMut::from(text.as_bytes()),
            test_limits(),
            TEST_CAPTURED,
        ) {
            Ok(Some(head)) => Ok((head.body, head.keep_alive)),
            Ok(None) => Err("partial".to_owned()),
            Err(Refusal::Answer(status, message)) => Err(format!("{status} {message}")),
            Err(Refusal::Quiet) => Err("quiet".to_owned()),
        };
        assert_eq!(
            parse("\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n"),
            Ok((BodyLength::Length(0), true))
        );
        assert_eq!(
            parse("POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\nconnection: close\r\n\r\n"),
            Ok((BodyLength::Length(5), false))
        );
        assert_eq!(
            parse("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n"),
            Ok((BodyLength::Chunked, true))
        );
        assert_eq!(
            parse("POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 005\r\n\r\n"),
            Ok((BodyLength::Length(5), true))
        );
        assert_eq!(
            parse("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"),
            Ok((BodyLength::Length(0), true))
        );
        assert_eq!(
            parse("GET / HTTP/1.1\r\nhost: x\r\n"),
            Err("partial".to_owned())
        );
        for refused in [
            "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n",
            "POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
            "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\n",
            "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5, 5\r\n\r\n",
            "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\n",
            "GET / HTTP/1.1\r\nbad header\r\n\r\n",
            "G\x01T / HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\n\r\n",
            "GET http://b:81/ HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n",
        ] {
            assert!(
                parse(refused).is_err_and(|error| error.starts_with("400")),
                "{refused:?}"
            );
        }
        for coding in ["gzip", "gzip, chunked", "chunked, identity", "xchunked"] {
            let text = format!("POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: {coding}\r\n\r\n");
            assert!(
                parse(&text).is_err_and(|error| error.starts_with("501")),
                "{coding}"
            );
        }
        let long = format!("GET / HTTP/1.1\r\nx-long: {}\r\n\r\n", "a".repeat(9000));
        assert!(parse(&long).is_err_and(|error| error.starts_with("431")));
    }

    #[test]
    fn fields_are_kept_as_lines_unless_they_need_the_map() {
        let parse = |text: &str| {
            let Ok(Some(head)) = parse_head(
                &mut BytesMut::from(text.as_bytes()),
                test_limits(),
                TEST_CAPTURED,
            ) else {
                panic!("not a head: {text:?}");
            };
            head
        };
        let head = parse(
            "POST /v1 HTTP/1.1\r\nHost: a\r\nConnection: keep-alive\r\nKeep-Alive: 5\r\n\
             X-Chain: 10.0.0.1\r\nX-Scheme: https\r\nTE: trailers\r\n\
             Content-Length: 2\r\nX-Id:  7 \r\nx-scheme: ftp\r\n\r\n",
        );
        assert!(head.request.headers().is_empty());
        let fields = head.fields.expect("lines");
        assert_eq!(
            fields.lines(),
            b"Host: a\r\nContent-Length: 2\r\nX-Id: 7\r\n"
        );
        assert_eq!(fields.captured("x-chain"), Some(&b"10.0.0.1"[..]));
        assert!(fields.has_host() && fields.has_content_length());
        assert_eq!(
            crate::h1::Fields::Lines(&fields).get("x-scheme"),
            Some(&b"https"[..])
        );
        // A `Connection` that names a field, a captured list twice, an absolute-form target
        // without `Host`: every field goes into the map.
        for text in [
            "GET / HTTP/1.1\r\nHost: a\r\nConnection: x-private\r\nX-Private: 1\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nX-Chain: 1.1.1.1\r\nX-Chain: 2.2.2.2\r\n\r\n",
            "GET http://b:81/ HTTP/1.0\r\nX-Id: 1\r\n\r\n",
        ] {
            let head = parse(text);
            assert!(head.fields.is_none(), "{text:?}");
            let fields = text.matches("\r\n").count() - 2;
            assert_eq!(head.request.headers().len(), fields, "{text:?}");
        }
    }

    #[test]
    fn underscore_names_are_dropped_unless_allowed() {
        let text = "GET / HTTP/1.1\r\nHost: a\r\nX_Api: 1\r\nTransfer_Encoding: chunked\r\nX-Ok: 2\r\n\r\n";
        let Ok(Some(head)) = parse_head(&mut BytesMut::from(text), test_limits(), TEST_CAPTURED)
        else {
            panic!("not a head");
        };
        assert_eq!(head.body, BodyLength::Length(0));
        assert_eq!(
            head.fields.expect("lines").lines(),
            b"Host: a\r\nX-Ok: 2\r\n"
        );
        let mapped = "GET / HTTP/1.1\r\nHost: a\r\nConnection: x-b\r\nX_Api: 1\r\nX-Ok: 2\r\n\r\n";
        let Ok(Some(head)) = parse_head(&mut BytesMut::from(mapped), test_limits(), TEST_CAPTURED)
        else {
            panic!("not a head");
        };
        assert!(!head.request.headers().contains_key("x_api"));
        assert!(head.request.headers().contains_key("x-ok"));
        let allowed = Limits {
            allow_underscore_headers: true,
            ..test_limits()
        };
        let Ok(Some(head)) = parse_head(&mut BytesMut::from(text), allowed, TEST_CAPTURED) else {
            panic!("not a head");
        };
        assert_eq!(
            head.fields.expect("lines").lines(),
            b"Host: a\r\nX_Api: 1\r\nTransfer_Encoding: chunked\r\nX-Ok: 2\r\n"
        );
    }
}
