//! The core's side of the strategies' request view: the HTTP layer's header fields read through
//! [`HeaderLookup`], so strategies never name a type of the HTTP layer.

use std::ops::ControlFlow;

use crate::h1::Fields;
use crate::strategy::HeaderLookup;

impl HeaderLookup for Fields<'_> {
    fn get(&self, name: &str) -> Option<&[u8]> {
        Fields::get(self, name)
    }

    fn visit<'s>(&'s self, name: &str, each: &mut dyn FnMut(&'s [u8]) -> ControlFlow<()>) {
        self.find_map(name, |value| each(value).break_value());
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderName, HeaderValue};

    use super::*;
    use crate::h1::{FieldLines, append_field};

    fn both(pairs: &[(&'static str, &'static str)], check: impl Fn(&dyn HeaderLookup)) {
        let map: HeaderMap = pairs
            .iter()
            .map(|(name, value)| {
                (
                    HeaderName::from_static(name),
                    HeaderValue::from_static(value),
                )
            })
            .collect();
        let mut bytes = Vec::new();
        for (name, value) in pairs {
            append_field(&mut bytes, name.as_bytes(), value.as_bytes());
        }
        let lines = FieldLines::new(bytes.into(), true, false);
        check(&Fields::Map(&map));
        check(&Fields::Lines(&lines));
    }

    #[test]
    fn fields_read_the_same_through_the_lookup_from_a_map_or_lines() {
        both(
            &[
                ("cookie", "a=1"),
                ("x-session-id", "s"),
                ("cookie", "sid=2"),
            ],
            |headers| {
                assert_eq!(headers.get("x-session-id"), Some(&b"s"[..]));
                assert_eq!(headers.get("absent"), None);
                assert_eq!(headers.get_all("cookie"), [&b"a=1"[..], &b"sid=2"[..]]);
                let sid = headers.find_map("cookie", |value| value.strip_prefix(b"sid="));
                assert_eq!(sid, Some(&b"2"[..]));
            },
        );
    }
}
