//! A request's header fields kept as the lines an HTTP/1 client sent, for the caller to forward
//! as they are: no field map is built, changed and encoded again on each request.
//!
//! The lines leave out what the caller never forwards as sent: the hop-by-hop fields, and the
//! fields it names as [`Captured`], those it sets itself on what it forwards. Their values are
//! set aside ([`FieldLines::captured`]), to be extended or replaced, and the client side writes
//! the caller's values after the lines ([`super::client::OutgoingFields`]). A request whose fields
//! need more than that (a `Connection` that names other fields, a captured field whose values
//! are one list sent more than once) gets a field map instead.
//!
//! The names come from the caller, once, as `'static` data: this layer names no field of its
//! own here, and parsing a head allocates nothing for them.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};

/// Most fields a caller may have set aside ([`Captured`]).
pub const MAX_CAPTURED: usize = 4;

/// A request field the caller sets itself on what it forwards, so the HTTP/1 server keeps it out
/// of the lines and sets its value aside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapturedField {
    /// The field's name, lowercase.
    pub name: &'static str,
    /// What a head that carries the field more than once gets.
    pub repeated: Repeated,
}

/// What a head that carries a captured field more than once gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repeated {
    /// A field map instead of lines: the values are one list, which the caller joins.
    Mapped,
    /// Lines still: the first value is set aside, the others are dropped (the caller replaces
    /// the field).
    FirstKept,
}

/// The fields a caller sets aside ([`CapturedField`]), at most [`MAX_CAPTURED`], in the order
/// [`FieldLines::iter`] gives them after the lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Captured(&'static [CapturedField]);

impl Captured {
    /// None: every end-to-end field stays in the lines.
    pub const NONE: Self = Self(&[]);

    /// The fields `fields`. Panics (at compile time in a constant) when there are more than
    /// [`MAX_CAPTURED`], or a name is empty or not lowercase.
    pub const fn new(fields: &'static [CapturedField]) -> Self {
        assert!(fields.len() <= MAX_CAPTURED, "too many captured fields");
        let mut index = 0;
        while index < fields.len() {
            let name = fields[index].name.as_bytes();
            assert!(!name.is_empty(), "a captured field needs a name");
            let mut at = 0;
            while at < name.len() {
                assert!(
                    !name[at].is_ascii_uppercase(),
                    "captured field names are lowercase"
                );
                at += 1;
            }
            index += 1;
        }
        Self(fields)
    }

    /// The fields, in order.
    pub fn fields(&self) -> &'static [CapturedField] {
        self.0
    }

    /// Where the field named `name` (as a client wrote it, any case) is on the list.
    pub(crate) fn position(&self, name: &[u8]) -> Option<usize> {
        self.0
            .iter()
            .position(|field| name.eq_ignore_ascii_case(field.name.as_bytes()))
    }

    /// Where the field named `name` (lowercase) is on the list.
    fn position_lowercase(&self, name: &str) -> Option<usize> {
        self.0.iter().position(|field| field.name == name)
    }
}

/// Where a value lies in a head: its start and end, as offsets from the head's first byte.
pub(crate) type ValueSpan = (u32, u32);

/// A request's end-to-end fields as lines (see the module documentation).
#[derive(Debug, Clone, Default)]
pub struct FieldLines {
    /// `name: value\r\n` each, names as the client wrote them.
    lines: Bytes,
    /// The fields set aside.
    captured: Captured,
    /// The head the values set aside lie in (empty when none was).
    head: Bytes,
    /// Where each captured field's value lies in `head`, in the order of `captured`.
    values: [Option<ValueSpan>; MAX_CAPTURED],
    has_host: bool,
    has_content_length: bool,
}

impl FieldLines {
    /// Lines made by [`super::append_field`], none set aside.
    #[cfg(test)]
    pub(crate) fn new(lines: Bytes, has_host: bool, has_content_length: bool) -> Self {
        Self {
            lines,
            has_host,
            has_content_length,
            ..Self::default()
        }
    }

    /// Lines made by [`super::append_field`], and the values of the `captured` fields the
    /// client sent: where they lie in its `head`.
    pub(crate) fn with_captured(
        lines: Bytes,
        captured: Captured,
        head: Bytes,
        values: [Option<ValueSpan>; MAX_CAPTURED],
        has_host: bool,
        has_content_length: bool,
    ) -> Self {
        Self {
            lines,
            captured,
            head,
            values,
            has_host,
            has_content_length,
        }
    }

    /// The lines, to be written as they are.
    pub fn lines(&self) -> &[u8] {
        &self.lines
    }

    /// The value the client sent for the captured field named `name` (lowercase), the first
    /// unless the field is [`Repeated::Mapped`].
    pub fn captured(&self, name: &str) -> Option<&[u8]> {
        self.value(self.captured.position_lowercase(name)?)
    }

    /// The value set aside for the `index`th captured field.
    fn value(&self, index: usize) -> Option<&[u8]> {
        let (start, end) = self.values[index]?;
        Some(&self.head[start as usize..end as usize])
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

    /// Every field, the captured ones the client sent last (in the order of [`Captured`]).
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.each_line()
            .filter_map(|line| {
                let colon = line.iter().position(|&byte| byte == b':')?;
                // `append_field` puts one space after the colon.
                Some((&line[..colon], line.get(colon + 2..).unwrap_or_default()))
            })
            .chain(
                self.captured
                    .fields()
                    .iter()
                    .enumerate()
                    .filter_map(|(index, field)| Some((field.name.as_bytes(), self.value(index)?))),
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

    /// The fields as a map (for the admin API and `https://` backends), the captured ones as
    /// they were set aside.
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
            Fields::Lines(lines) => match lines.captured.position_lowercase(name) {
                // Never in the lines.
                Some(index) => lines.value(index).and_then(f),
                None => lines.find_line(name.as_bytes(), f),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::h1::append_field;

    /// Two fields a caller sets itself, named as no client field this layer knows.
    const CAPTURED: Captured = Captured::new(&[
        CapturedField {
            name: "x-chain",
            repeated: Repeated::Mapped,
        },
        CapturedField {
            name: "x-scheme",
            repeated: Repeated::FirstKept,
        },
    ]);

    /// Lines of `fields`, and `chain` set aside as the `x-chain` value.
    fn lines(fields: &[(&str, &str)], chain: Option<&'static str>) -> FieldLines {
        let mut out = Vec::new();
        for (name, value) in fields {
            append_field(&mut out, name.as_bytes(), value.as_bytes());
        }
        // The value lies in a head of its own, after a request line.
        let head = format!("GET / HTTP/1.1\r\nx-chain: {}\r\n", chain.unwrap_or(""));
        let start = "GET / HTTP/1.1\r\nx-chain: ".len() as u32;
        let span = chain.map(|chain| (start, start + chain.len() as u32));
        FieldLines::with_captured(
            Bytes::from(out),
            CAPTURED,
            Bytes::from(head),
            [span, None, None, None],
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
        assert_eq!(view.get("x-chain"), Some(&b"10.0.0.1"[..]));
        assert_eq!(fields.captured("x-chain"), Some(&b"10.0.0.1"[..]));
        assert_eq!(view.get("x-scheme"), None);
        assert_eq!(fields.captured("x-scheme"), None);
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
        assert_eq!(map["x-chain"], "h");
        let view = Fields::Map(&map);
        assert_eq!(view.get("host"), Some(&b"a"[..]));
    }

    #[test]
    fn lines_with_nothing_set_aside_hold_only_their_lines() {
        let mut out = Vec::new();
        append_field(&mut out, b"X-Chain", b"sent");
        let fields = FieldLines::new(Bytes::from(out), true, false);
        // Captured by no one: an ordinary line.
        assert_eq!(Fields::Lines(&fields).get("x-chain"), Some(&b"sent"[..]));
        assert_eq!(fields.captured("x-chain"), None);
        assert_eq!(fields.iter().count(), 1);
    }

    #[test]
    #[should_panic(expected = "lowercase")]
    fn captured_names_are_lowercase() {
        static FIELDS: [CapturedField; 1] = [CapturedField {
            name: "X-Chain",
            repeated: Repeated::Mapped,
        }];
        let _ = Captured::new(&FIELDS);
    }
}
