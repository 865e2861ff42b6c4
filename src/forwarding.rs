//! What a forwarded request carries: hop-by-hop fields removed (RFC 9110 §7.6.1, plus those
//! named in `Connection`), `X-Forwarded-For` extended with the client's address,
//! `X-Forwarded-Proto` set to `http`, the client's `Host` kept (for HTTP/2 clients, the
//! `:authority`; with none, the backend's). [`RequestHead`] is prepared once per request and
//! written for each attempt.
//!
//! The two forwarding fields are named here only: the HTTP/1 server is handed them
//! ([`SET_BY_PROXY`]) and sets them aside as it parses a client's head, and a head forwarded as
//! the client's lines has them written after the lines.

use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Uri};
use http::{Method, Request, Version};

use crate::backend::BackendAddr;
use crate::body::UpstreamBody;
use crate::h1::{self, Captured, CapturedField, FieldLines, Repeated};

const FORWARDED_FOR: &str = "x-forwarded-for";
const FORWARDED_PROTO: &str = "x-forwarded-proto";
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static(FORWARDED_FOR);
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static(FORWARDED_PROTO);

/// The fields the proxy sets itself, for the HTTP/1 server to set aside: `X-Forwarded-For`,
/// whose values are one list (sent more than once, the client's fields go into a map, where they
/// are joined) and whose value is extended, and `X-Forwarded-Proto`, which is replaced. A head
/// kept as lines gets them back, in this order, after the lines.
pub const SET_BY_PROXY: Captured = Captured::new(&[
    CapturedField {
        name: FORWARDED_FOR,
        repeated: Repeated::Mapped,
    },
    CapturedField {
        name: FORWARDED_PROTO,
        repeated: Repeated::FirstKept,
    },
]);

/// The `X-Forwarded-Proto` every proxied request carries (the listener speaks cleartext only).
const FORWARDED_PROTO_VALUE: &str = "http";
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// Headers that apply to one connection only and are never forwarded (`Connection` first; their
/// lengths are listed in `remove_hop_by_hop`).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    PROXY_CONNECTION,
    KEEP_ALIVE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
];

/// Removes hop-by-hop headers, including every header named in `Connection`.
pub fn remove_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names finds which are present (most messages carry none, responses
    // often `Connection: keep-alive` alone): only those are removed, each with one hashed lookup.
    let mut present = 0u16;
    for name in headers.keys() {
        // Lengths first: most names are ruled out without comparing them.
        if !matches!(name.as_str().len(), 2 | 7 | 10 | 16 | 17 | 19) {
            continue;
        }
        if let Some(index) = HOP_BY_HOP.iter().position(|hop| hop == name) {
            present |= 1 << index;
        }
    }
    if present == 0 {
        return;
    }
    if present & 1 != 0 {
        // `HOP_BY_HOP[0]` is `Connection`: the headers it names go too. Those on the list are
        // removed below if present; the others only when present (`close` names none).
        let mut named: Vec<HeaderName> = Vec::new();
        for token in headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|list| list.split(','))
            .map(str::trim)
        {
            let listed = HOP_BY_HOP.iter().any(|hop| {
                let hop = hop.as_str();
                hop.len() == token.len() && token.eq_ignore_ascii_case(hop)
            });
            if !listed && !token.is_empty() && headers.contains_key(token) {
                if let Ok(name) = HeaderName::from_bytes(token.as_bytes()) {
                    named.push(name);
                }
            }
        }
        for name in named {
            headers.remove(name);
        }
    }
    for (index, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << index) != 0 {
            headers.remove(name);
        }
    }
}

/// The client's address as an `X-Forwarded-For` element, made once per connection.
#[derive(Debug, Clone)]
pub struct ForwardedFor(HeaderValue);

impl ForwardedFor {
    /// The element for a client connected from `peer`.
    pub fn new(peer: SocketAddr) -> Self {
        let text = peer.ip().to_canonical().to_string();
        Self(HeaderValue::from_str(&text).expect("an IP address is a valid header value"))
    }

    /// The `X-Forwarded-For` value of a request that came with the values `sent`: those, joined
    /// into one, then this client.
    fn appended_to<'a>(&self, sent: impl IntoIterator<Item = &'a [u8]>) -> HeaderValue {
        let mut joined = Vec::new();
        for value in sent {
            joined.extend_from_slice(value);
            joined.extend_from_slice(b", ");
        }
        if joined.is_empty() {
            return self.0.clone();
        }
        joined.extend_from_slice(self.0.as_bytes());
        // Field values joined by ", " make a field value.
        HeaderValue::from_bytes(&joined).unwrap_or_else(|_| self.0.clone())
    }
}

fn append_forwarded_for(headers: &mut HeaderMap, client: &ForwardedFor) {
    let value = client.appended_to(
        headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .map(HeaderValue::as_bytes),
    );
    headers.insert(X_FORWARDED_FOR, value);
}

/// A request prepared once for all its attempts: hop-by-hop headers removed, `Host` kept,
/// `X-Forwarded-For` and `X-Forwarded-Proto` set.
#[derive(Debug)]
pub struct RequestHead {
    pub(crate) method: Method,
    pub(crate) path_and_query: PathAndQuery,
    pub(crate) fields: HeadFields,
    /// Whether the fields have a `Host` (otherwise each attempt gets the backend's).
    has_host: bool,
}

/// The fields of a [`RequestHead`].
#[derive(Debug)]
pub(crate) enum HeadFields {
    /// In a map, the forwarding fields set.
    Map(HeaderMap),
    /// An HTTP/1 client's lines as it sent them, and the forwarding fields to write after them
    /// (`X-Forwarded-For`, then `X-Forwarded-Proto`, as [`SET_BY_PROXY`] lists them).
    Lines {
        lines: FieldLines,
        forwarding: [(HeaderName, HeaderValue); 2],
    },
}

impl RequestHead {
    /// Prepares the head of a client request received from `client`, its fields kept as the
    /// lines it sent when there are `fields` (the map is then empty). The method, and the map
    /// or the lines, are taken out of `parts` and `fields`: they stay where the caller keeps
    /// them rather than being moved in.
    pub fn prepare(
        parts: &mut http::request::Parts,
        fields: &mut Option<FieldLines>,
        client: &ForwardedFor,
    ) -> Self {
        let path_and_query = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        match fields.take() {
            Some(lines) => {
                let forwarded_for = client.appended_to(lines.captured(FORWARDED_FOR));
                let forwarding = [
                    (X_FORWARDED_FOR, forwarded_for),
                    (
                        X_FORWARDED_PROTO,
                        HeaderValue::from_static(FORWARDED_PROTO_VALUE),
                    ),
                ];
                Self {
                    method: std::mem::take(&mut parts.method),
                    path_and_query,
                    has_host: lines.has_host(),
                    fields: HeadFields::Lines { lines, forwarding },
                }
            }
            None => Self::prepare_map(parts, path_and_query, client),
        }
    }

    fn prepare_map(
        parts: &mut http::request::Parts,
        path_and_query: PathAndQuery,
        client: &ForwardedFor,
    ) -> Self {
        let mut headers = std::mem::take(&mut parts.headers);
        remove_hop_by_hop(&mut headers);
        let mut has_host = headers.contains_key(header::HOST);
        if !has_host {
            if let Some(authority) = parts.uri.authority() {
                if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
                    headers.insert(header::HOST, host);
                    has_host = true;
                }
            }
        }
        append_forwarded_for(&mut headers, client);
        headers.insert(
            X_FORWARDED_PROTO,
            HeaderValue::from_static(FORWARDED_PROTO_VALUE),
        );
        Self {
            method: std::mem::take(&mut parts.method),
            path_and_query,
            fields: HeadFields::Map(headers),
            has_host,
        }
    }

    /// Sets the `traceparent` the next attempt sends (fields kept in a map only; the proxy puts
    /// them there when traces are on). Unless the trace goes on from the client's
    /// `traceparent`, the client's `tracestate` is dropped: it belongs to no trace sent.
    pub(crate) fn set_traceparent(&mut self, value: &str, continues_client_trace: bool) {
        if let (HeadFields::Map(headers), Ok(value)) =
            (&mut self.fields, HeaderValue::from_str(value))
        {
            headers.insert(HeaderName::from_static("traceparent"), value);
            if !continues_client_trace {
                headers.remove(HeaderName::from_static("tracestate"));
            }
        }
    }

    /// A bodiless `GET path` with no header fields (a health probe's request).
    pub fn probe(path: &str) -> Option<Self> {
        Some(Self {
            method: Method::GET,
            path_and_query: PathAndQuery::try_from(path).ok()?,
            fields: HeadFields::Map(HeaderMap::new()),
            has_host: false,
        })
    }

    /// The head for one attempt to the plain-HTTP backend `addr`: origin form (authority form
    /// for `CONNECT`), with the backend's `Host` if the client sent none.
    pub(crate) fn h1<'a>(&'a self, addr: &'a BackendAddr) -> h1::OutgoingHead<'a> {
        h1::OutgoingHead {
            method: &self.method,
            target: if self.method == Method::CONNECT {
                addr.authority().as_str()
            } else {
                self.path_and_query.as_str()
            },
            fields: match &self.fields {
                HeadFields::Map(headers) => h1::client::OutgoingFields::Map(headers),
                HeadFields::Lines { lines, forwarding } => h1::client::OutgoingFields::Lines {
                    lines: lines.lines(),
                    appended: forwarding,
                    has_content_length: lines.has_content_length(),
                },
            },
            host: (!self.has_host).then(|| host_text(addr)),
        }
    }

    /// The request for one attempt to the `https://` backend `addr`, with an absolute URI (the
    /// TLS client sets `Host` from it when the client sent none). The headers are copied when
    /// another attempt may follow, and moved into the `last` one.
    pub(crate) fn tls_request(
        &mut self,
        addr: &BackendAddr,
        body: UpstreamBody,
        last: bool,
    ) -> Request<UpstreamBody> {
        let mut request = Request::new(body);
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = absolute_uri(addr, self.path_and_query.clone());
        *request.version_mut() = Version::HTTP_11;
        *request.headers_mut() = match &mut self.fields {
            HeadFields::Map(headers) if last => std::mem::take(headers),
            HeadFields::Map(headers) => headers.clone(),
            HeadFields::Lines { lines, forwarding } => {
                let mut headers = lines.to_map();
                for (name, value) in forwarding.iter() {
                    headers.insert(name.clone(), value.clone());
                }
                headers
            }
        };
        request
    }
}

/// `scheme://authority/path` for `addr`.
fn absolute_uri(addr: &BackendAddr, path_and_query: PathAndQuery) -> Uri {
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(addr.scheme());
    parts.authority = Some(addr.authority().clone());
    parts.path_and_query = Some(path_and_query);
    Uri::from_parts(parts).expect("scheme, authority and path make an absolute URI")
}

/// The `Host` a request to `addr` carries when the client sent none: the host, and the port
/// unless it is the scheme's default.
fn host_text(addr: &BackendAddr) -> &str {
    let authority = addr.authority();
    let default_port = if addr.is_https() { 443 } else { 80 };
    match authority.port_u16() {
        Some(port) if port != default_port => authority.as_str(),
        _ => authority.host(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn removes_hop_by_hop_and_connection_named_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret"),
        );
        headers.insert("x-secret", HeaderValue::from_static("1"));
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        headers.insert("x-end-to-end", HeaderValue::from_static("kept"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
        remove_hop_by_hop(&mut headers);
        let names: Vec<_> = headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(headers.contains_key("x-end-to-end"));
        assert!(headers.contains_key(header::AUTHORIZATION));

        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, Upgrade, x-Gone, , x-absent"),
        );
        headers.append(header::CONNECTION, HeaderValue::from_static("x-other"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("h2c"));
        headers.insert("x-gone", HeaderValue::from_static("1"));
        headers.insert("x-other", HeaderValue::from_static("1"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        remove_hop_by_hop(&mut headers);
        let names: Vec<_> = headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["content-type"]);
    }

    #[test]
    fn every_hop_by_hop_name_passes_the_length_filter() {
        for hop in &HOP_BY_HOP {
            let mut headers = HeaderMap::new();
            headers.insert(hop.clone(), HeaderValue::from_static("x"));
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            remove_hop_by_hop(&mut headers);
            assert_eq!(headers.len(), 1, "{hop}");
        }
    }

    #[test]
    fn appends_to_forwarded_for() {
        let peer = ForwardedFor::new("192.0.2.7:5000".parse().unwrap());
        let mut headers = HeaderMap::new();
        append_forwarded_for(&mut headers, &peer);
        assert_eq!(headers[&X_FORWARDED_FOR], "192.0.2.7");
        append_forwarded_for(&mut headers, &peer);
        assert_eq!(headers[&X_FORWARDED_FOR], "192.0.2.7, 192.0.2.7");
        headers.append(&X_FORWARDED_FOR, HeaderValue::from_static("198.51.100.1"));
        append_forwarded_for(&mut headers, &peer);
        assert_eq!(
            headers[&X_FORWARDED_FOR],
            "192.0.2.7, 192.0.2.7, 198.51.100.1, 192.0.2.7"
        );
        // The value an HTTP/1 client's lines get is made the same way, bytes kept as they came.
        assert_eq!(peer.appended_to(None).as_bytes(), b"192.0.2.7");
        let sent: [&[u8]; 2] = [b"a", b"b\xff"];
        assert_eq!(peer.appended_to(sent).as_bytes(), b"a, b\xff, 192.0.2.7");
    }

    #[test]
    fn the_fields_set_aside_come_back_after_a_clients_lines() {
        let client = ForwardedFor::new("192.0.2.7:5000".parse().unwrap());
        // What the HTTP/1 server hands over for `Host: a` and `X-Forwarded-For: 203.0.113.9`.
        let head = bytes::Bytes::from_static(b"x-forwarded-for: 203.0.113.9");
        let lines = FieldLines::with_captured(
            bytes::Bytes::from_static(b"Host: a\r\n"),
            SET_BY_PROXY,
            head,
            [Some((17, 28)), None, None, None],
            true,
            false,
        );
        let (mut parts, ()) = Request::new(()).into_parts();
        let prepared = RequestHead::prepare(&mut parts, &mut Some(lines), &client);
        let addr: BackendAddr = "10.0.0.1:8000".parse().unwrap();
        let h1::client::OutgoingFields::Lines {
            lines, appended, ..
        } = prepared.h1(&addr).fields
        else {
            panic!("lines expected");
        };
        assert_eq!(lines, b"Host: a\r\n");
        // Every field set aside is written again, in the order the server was handed them.
        let names: Vec<_> = appended.iter().map(|(name, _)| name.as_str()).collect();
        let set_aside: Vec<_> = SET_BY_PROXY.fields().iter().map(|f| f.name).collect();
        assert_eq!(names, set_aside);
        assert_eq!(appended[0].1, "203.0.113.9, 192.0.2.7");
        assert_eq!(appended[1].1, "http");
    }

    #[test]
    fn the_http1_sides_leave_out_the_same_hop_by_hop_fields() {
        for name in &HOP_BY_HOP {
            assert!(h1::hop_by_hop(name.as_str().as_bytes()).is_some(), "{name}");
        }
        for name in [
            "host",
            "content-length",
            "authorization",
            "x-forwarded-for",
            "t",
            "tee",
        ] {
            assert!(h1::hop_by_hop(name.as_bytes()).is_none(), "{name}");
        }
    }
}
