//! A request's header fields kept as the lines an HTTP/1 client sent, for the proxy to forward
//! as they are: no field map is built, changed and encoded again on each request.
//!
//! The lines leave out what the proxy never forwards: hop-by-hop fields and the forwarding
//! fields it sets (`X-Forwarded-For`, whose value is kept to be extended, and
//! `X-Forwarded-Proto`). A request whose fields need more than that (a `Connection` that names
//! other fields, `X-Forwarded-For` sent twice) gets a field map instead.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};

/// The field names the proxy sets; the lines leave them out.
pub(crate) const FORWARDED_FOR: &str = "x-forwarded-for";
pub(crate) const FORWARDED_PROTO: &str = "x-forwarded-proto";

/// A request's end-to-end fields as lines (see the module documentation).
#[derive(Debug, Clone, Default)]
pub struct FieldLines {
    /// `name: value\r\n` each, names as the client wrote them.
    lines: Bytes,
    /// The client's `X-Forwarded-For` value.
    forwarded_for: Option<Bytes>,
    /// The client's `X-Forwarded-Proto` value.
    forwarded_proto: Option<Bytes>,
    has_host: bool,
    has_content_length: bool,
}

impl FieldLines {
    /// Lines made by [`super::append_field`], with what the parser noted on the way.
    pub(crate) fn new(
        lines: Bytes,
        forwarded_for: Option<Bytes>,
        forwarded_proto: Option<Bytes>,
        has_host: bool,
        has_content_length: bool,
    ) -> Self {
        Self {
            lines,
            forwarded_for,
            forwarded_proto,
            has_host,
            has_content_length,
        }
    }

    /// The lines, to be written as they are.
    pub fn lines(&self) -> &[u8] {
        &self.lines
    }

    /// The client's `X-Forwarded-For` value.
    pub fn forwarded_for(&self) -> Option<&[u8]> {
        self.forwarded_for.as_deref()
    }

    /// Whether the client sent a `Host`.
    pub fn has_host(&self) -> bool {
        self.has_host
    }

    /// Whether the client sent a `Content-Length`.
    pub fn has_content_length(&self) -> bool {
        self.has_content_length
    }

    /// Each line without its `\r\n`, as [`super::append_field`] writes them: `name: value`.
    /// Each line's end is found with `memchr`.
    fn each_line(&self) -> impl Iterator<Item = &[u8]> {
        let mut rest: &[u8] = &self.lines;
        std::iter::from_fn(move || {
            while !rest.is_empty() {
                let end = memchr::memchr(b'\n', rest).map_or(rest.len(), |at| at + 1);
                let (line, next) = rest.split_at(end);
                rest = next;
                if let Some(line) = line.strip_suffix(b"\r\n") {
                    return Some(line);
                }
            }
            None
        })
    }

    /// Every field, the forwarding ones the client sent last.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let forwarding = [
            (FORWARDED_FOR, &self.forwarded_for),
            (FORWARDED_PROTO, &self.forwarded_proto),
        ];
        self.each_line()
            .filter_map(|line| {
                let colon = line.iter().position(|&byte| byte == b':')?;
                // `append_field` puts one space after the colon.
                Some((&line[..colon], line.get(colon + 2..).unwrap_or_default()))
            })
            .chain(
                forwarding
                    .into_iter()
                    .filter_map(|(name, value)| Some((name.as_bytes(), value.as_deref()?))),
            )
    }

    /// The first `Some` that `f` gives for the values of the lines named `name`, in order. Only
    /// a line whose name is as long as `name` is compared: a lookup does not walk every byte of
    /// the other lines.
    fn find_line<'a, T>(&'a self, name: &[u8], f: impl FnMut(&'a [u8]) -> Option<T>) -> Option<T> {
        self.each_line()
            .filter(|line| {
                line.len() > name.len()
                    && line[name.len()] == b':'
                    && line[..name.len()].eq_ignore_ascii_case(name)
            })
            .map(|line| line.get(name.len() + 2..).unwrap_or_default())
            .find_map(f)
    }

    /// The fields as a map (for the admin API and `https://` backends), the forwarding ones as
    /// the client sent them.
    pub fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in self.iter() {
            // The parser checked both already.
            if let (Ok(name), Ok(value)) =
                (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
            {
                map.append(name, value);
            }
        }
        map
    }
}

/// A request's fields as a strategy reads them: from the field map, or from the lines.
#[derive(Debug, Clone, Copy)]
pub enum Fields<'a> {
    /// The field map (HTTP/2 clients, and HTTP/1 requests whose fields need more than lines).
    Map(&'a HeaderMap),
    /// The lines of an HTTP/1 request.
    Lines(&'a FieldLines),
}

impl<'a> Fields<'a> {
    /// The value of the first field named `name` (lowercase).
    pub fn get(&self, name: &str) -> Option<&'a [u8]> {
        self.find_map(name, Some)
    }

    /// The first `Some` that `f` gives for the values of the fields named `name` (lowercase),
    /// in the order they came.
    pub fn find_map<T>(&self, name: &str, mut f: impl FnMut(&'a [u8]) -> Option<T>) -> Option<T> {
        match *self {
            Fields::Map(map) => map
                .get_all(name)
                .iter()
                .find_map(|value| f(value.as_bytes())),
            Fields::Lines(lines) => {
                let forwarding = match name {
                    FORWARDED_FOR => Some(&lines.forwarded_for),
                    FORWARDED_PROTO => Some(&lines.forwarded_proto),
                    _ => None,
                };
                if let Some(value) = forwarding {
                    // Never in the lines.
                    return value.as_deref().and_then(f);
                }
                lines.find_line(name.as_bytes(), f)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::h1::append_field;

    fn lines(fields: &[(&str, &str)], forwarded_for: Option<&'static str>) -> FieldLines {
        let mut out = Vec::new();
        for (name, value) in fields {
            append_field(&mut out, name.as_bytes(), value.as_bytes());
        }
        FieldLines::new(
            Bytes::from(out),
            forwarded_for.map(|value| Bytes::from_static(value.as_bytes())),
            None,
            true,
            false,
        )
    }

    #[test]
    fn lookups_ignore_case_and_see_every_value_in_order() {
        let fields = lines(
            &[
                ("Host", "a"),
                ("Hostname", "b"),
                ("Cookie", "x=1"),
                ("X-Empty", ""),
                ("cookie", "sid=2"),
            ],
            Some("10.0.0.1"),
        );
        let view = Fields::Lines(&fields);
        assert_eq!(view.get("host"), Some(&b"a"[..]));
        assert_eq!(view.get("x-empty"), Some(&b""[..]));
        assert_eq!(view.get("x-forwarded-for"), Some(&b"10.0.0.1"[..]));
        assert_eq!(view.get("x-forwarded-proto"), None);
        assert_eq!(view.get("absent"), None);
        // A name that starts another is not that one.
        assert_eq!(view.get("hostname"), Some(&b"b"[..]));
        assert_eq!(view.get("hos"), None);
        let sid = view.find_map("cookie", |value| value.strip_prefix(b"sid="));
        assert_eq!(sid, Some(&b"2"[..]));
    }

    #[test]
    fn the_map_holds_every_field_the_lines_hold() {
        let fields = lines(&[("Host", "a"), ("X-Two", "1"), ("x-two", "2")], Some("h"));
        let map = fields.to_map();
        assert_eq!(map.len(), 4);
        let two: Vec<_> = map.get_all("x-two").iter().collect();
        assert_eq!(two, ["1", "2"]);
        assert_eq!(map["x-forwarded-for"], "h");
        let view = Fields::Map(&map);
        assert_eq!(view.get("host"), Some(&b"a"[..]));
    }
}
