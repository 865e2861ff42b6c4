//! How settings are written in the TOML file and the environment, for the serde derives of the
//! settings structs each component owns (`#[serde(with = "crate::forms::seconds")]` and so on).
//!
//! Durations are numbers of seconds (fractions allowed) read into [`Duration`] and written back as
//! seconds, so `--check-config`, the `--help` defaults and the reload diff show what the file says:
//!
//! - [`seconds`]: more than 0;
//! - [`seconds_or_zero`]: 0 or more (0 is no time at all);
//! - [`seconds_or_off`]: 0 or more read into an `Option`, 0 being `None` (a limit that is off);
//! - [`optional_seconds`]: more than 0 read into an `Option`, absent being `None` (a default that
//!   follows another setting).
//!
//! Every form refuses negative, non-finite and huge values (1e9 s or more) with one message naming
//! what was expected; the caller of the deserializer names the key.
//!
//! Besides durations: [`list`] (a TOML array, or one comma-separated string as an environment
//! variable gives), [`text`] (text that may look like a number) and [`secret`] (text printed
//! as `"<redacted>"`).
//!
//! Ranges a type cannot say are checked by each settings struct's own `check` method, which
//! names the refused key within its section in an [`Invalid`]; the common checks are in
//! [`check`].

use std::fmt::Display;
use std::str::FromStr;
use std::time::Duration;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serializer};

/// Largest number of seconds accepted (exclusive).
const MAX_SECONDS: f64 = 1e9;

fn read_seconds<'de, D: Deserializer<'de>>(
    deserializer: D,
    zero_allowed: bool,
) -> Result<Duration, D::Error> {
    let value = f64::deserialize(deserializer)?;
    let low_ok = if zero_allowed {
        value >= 0.0
    } else {
        value > 0.0
    };
    if !(value.is_finite() && low_ok && value < MAX_SECONDS) {
        let expected = if zero_allowed {
            "zero or a positive number of seconds"
        } else {
            "a positive number of seconds"
        };
        return Err(D::Error::custom(format!(
            "expected {expected}, found {value}"
        )));
    }
    let duration = Duration::from_secs_f64(value);
    // A positive value too small for a nanosecond would be a zero period where none is allowed.
    if !zero_allowed && duration.is_zero() {
        return Err(D::Error::custom(format!(
            "expected at least a nanosecond, found {value} s"
        )));
    }
    Ok(duration)
}

/// Seconds, more than 0, as a [`Duration`].
pub mod seconds {
    use super::*;

    /// Writes the duration as seconds.
    pub fn serialize<S: Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_f64(duration.as_secs_f64())
    }

    /// Reads seconds; 0, negative, non-finite and huge values are errors.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        read_seconds(deserializer, false)
    }
}

/// Seconds, 0 or more, as a [`Duration`] (0: no time at all).
pub mod seconds_or_zero {
    use super::*;

    /// Writes the duration as seconds.
    pub fn serialize<S: Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_f64(duration.as_secs_f64())
    }

    /// Reads seconds; negative, non-finite and huge values are errors.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        read_seconds(deserializer, true)
    }
}

/// Seconds, 0 or more, as an optional [`Duration`]: 0 is `None`, a limit that is off.
pub mod seconds_or_off {
    use super::*;

    /// Writes the duration as seconds, `None` as 0.
    pub fn serialize<S: Serializer>(
        duration: &Option<Duration>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.serialize_f64(duration.map_or(0.0, |d| d.as_secs_f64()))
    }

    /// Reads seconds, 0 as `None`; negative, non-finite and huge values are errors.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Duration>, D::Error> {
        let duration = read_seconds(deserializer, true)?;
        Ok((!duration.is_zero()).then_some(duration))
    }
}

/// Seconds, more than 0, as an optional [`Duration`]: absent is `None`, for a setting whose
/// default follows another one (the component that reads it says which).
pub mod optional_seconds {
    use super::*;

    /// Writes the duration as seconds, `None` as nothing.
    pub fn serialize<S: Serializer>(
        duration: &Option<Duration>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match duration {
            Some(duration) => serializer.serialize_some(&duration.as_secs_f64()),
            None => serializer.serialize_none(),
        }
    }

    /// Reads seconds; 0, negative, non-finite and huge values are errors.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Duration>, D::Error> {
        match Option::<f64>::deserialize(deserializer)? {
            None => Ok(None),
            Some(value) => read_seconds(
                serde::de::value::F64Deserializer::<D::Error>::new(value),
                false,
            )
            .map(Some),
        }
    }
}

/// A list: a TOML array of strings, or one comma-separated string (as environment variables
/// give; spaces around entries and empty entries are ignored). Each entry is parsed with
/// [`FromStr`], its error being the message; entries are written back as text.
pub mod list {
    use super::*;

    /// Writes each entry as text.
    pub fn serialize<T: Display, S: Serializer>(
        items: &[T],
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(items.iter().map(ToString::to_string))
    }

    /// Reads an array or a comma-separated string, and parses each entry.
    pub fn deserialize<'de, T, D>(deserializer: D) -> Result<Vec<T>, D::Error>
    where
        T: FromStr,
        T::Err: Display,
        D: Deserializer<'de>,
    {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum List {
            Many(Vec<String>),
            One(String),
        }
        let list = List::deserialize(deserializer).map_err(|_| {
            D::Error::custom("expected an array of strings or one comma-separated string")
        })?;
        let entries: Vec<String> = match list {
            List::Many(items) => items,
            List::One(text) => text
                .split(',')
                .map(str::trim)
                .filter(|item| !item.is_empty())
                .map(str::to_owned)
                .collect(),
        };
        entries
            .iter()
            .map(|entry| entry.parse().map_err(D::Error::custom))
            .collect()
    }
}

/// A positive count, or `"auto"` for one derived from the machine at start (the component that
/// reads it says how). Written back as the number or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Derived at start.
    Auto,
    /// This many.
    Fixed(usize),
}

impl Count {
    /// The fixed count, or what `auto` gives.
    pub fn or_else(self, auto: impl FnOnce() -> usize) -> usize {
        match self {
            Count::Fixed(count) => count,
            Count::Auto => auto(),
        }
    }
}

impl serde::Serialize for Count {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Count::Auto => serializer.serialize_str("auto"),
            Count::Fixed(count) => serializer.serialize_u64(*count as u64),
        }
    }
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;

        const EXPECTED: &str = "a positive integer or \"auto\"";

        fn refused<E: serde::de::Error>(found: impl std::fmt::Debug) -> E {
            E::custom(format!("expected {EXPECTED}, found {found:?}"))
        }

        impl serde::de::Visitor<'_> for Visitor {
            type Value = Count;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(EXPECTED)
            }

            fn visit_u64<E: serde::de::Error>(self, count: u64) -> Result<Count, E> {
                match usize::try_from(count) {
                    Ok(count) if count > 0 => Ok(Count::Fixed(count)),
                    _ => Err(refused(count)),
                }
            }

            fn visit_i64<E: serde::de::Error>(self, count: i64) -> Result<Count, E> {
                let count = u64::try_from(count).map_err(|_| refused(count))?;
                self.visit_u64(count)
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Count, E> {
                if text.trim().eq_ignore_ascii_case("auto") {
                    return Ok(Count::Auto);
                }
                let count = text.trim().parse::<u64>().map_err(|_| refused(text))?;
                self.visit_u64(count).map_err(|_: E| refused(text))
            }
        }

        deserializer.deserialize_any(Visitor)
    }
}

/// Optional text that may look like a number (an environment value such as `123` reads as one).
pub mod text {
    use super::*;

    /// Writes the text as it is.
    pub fn serialize<S: Serializer>(
        text: &Option<String>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match text {
            Some(text) => serializer.serialize_some(text),
            None => serializer.serialize_none(),
        }
    }

    /// Reads text, or a number as its text.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<String>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Scalar {
            Text(String),
            Unsigned(u64),
            Signed(i64),
            Float(f64),
        }
        let scalar = Option::<Scalar>::deserialize(deserializer)
            .map_err(|_| D::Error::custom("expected a string or a number"))?;
        Ok(scalar.map(|value| match value {
            Scalar::Text(text) => text,
            Scalar::Unsigned(n) => n.to_string(),
            Scalar::Signed(n) => n.to_string(),
            Scalar::Float(n) => n.to_string(),
        }))
    }
}

/// An optional secret: read as [`text`], written as `"<redacted>"` (in `--check-config` output
/// and logged configurations).
pub mod secret {
    use super::*;

    /// Writes `"<redacted>"` for a set secret.
    pub fn serialize<S: Serializer>(
        secret: &Option<String>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match secret {
            Some(_) => serializer.serialize_some("<redacted>"),
            None => serializer.serialize_none(),
        }
    }

    /// Reads text, or a number as its text.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<String>, D::Error> {
        super::text::deserialize(deserializer)
    }
}

/// A value a settings struct's `check` refused: the key within its section and what was
/// expected. The configuration prefixes the section and names where the value came from (the
/// environment variable or the file key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    /// The key, relative to the checked section (`max_size`, `budget.percent`).
    pub key: String,
    /// What is wrong and what was expected.
    pub message: String,
}

impl Invalid {
    /// `key` holds a value that is wrong as `message` says.
    pub fn new(key: &str, message: impl Into<String>) -> Self {
        Self {
            key: key.to_owned(),
            message: message.into(),
        }
    }

    /// The same error seen from the enclosing section: the key becomes `section.key`.
    pub fn within(self, section: &str) -> Self {
        Self {
            key: format!("{section}.{}", self.key),
            message: self.message,
        }
    }
}

/// The checks several sections share, each naming the key it refuses.
pub mod check {
    use super::Invalid;

    /// A count of at least 1.
    pub fn positive(key: &str, value: u64) -> Result<(), Invalid> {
        if value == 0 {
            return Err(Invalid::new(key, "expected a positive integer, found 0"));
        }
        Ok(())
    }

    /// A percentage, from 0 to 100.
    pub fn percentage(key: &str, value: f64) -> Result<(), Invalid> {
        if !(0.0..=100.0).contains(&value) {
            return Err(Invalid::new(
                key,
                format!("expected a percentage from 0 to 100, found {value}"),
            ));
        }
        Ok(())
    }

    /// A request path (and query) starting with `/`.
    pub fn path(key: &str, path: &str) -> Result<(), Invalid> {
        if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
            return Err(Invalid::new(
                key,
                format!("expected a path starting with '/', found {path:?}"),
            ));
        }
        Ok(())
    }

    /// A header field name (an HTTP token), or empty for none.
    pub fn header_name(key: &str, name: &str) -> Result<(), Invalid> {
        let is_token_char = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
        if let Some(bad) = name.chars().find(|&c| !is_token_char(c)) {
            return Err(Invalid::new(
                key,
                format!("expected a header name (or empty for none), found {name:?} with {bad:?}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;

    #[derive(Debug, Deserialize, Serialize, PartialEq)]
    struct Durations {
        #[serde(with = "seconds")]
        positive: Duration,
        #[serde(with = "seconds_or_zero")]
        zero: Duration,
        #[serde(with = "seconds_or_off")]
        off: Option<Duration>,
    }

    fn read(text: &str) -> Result<Durations, String> {
        serde_json::from_str(text).map_err(|e| e.to_string())
    }

    #[test]
    fn seconds_read_into_durations_and_write_back_as_seconds() {
        let read = read(r#"{"positive": 0.5, "zero": 0, "off": 0}"#).unwrap();
        assert_eq!(
            read,
            Durations {
                positive: Duration::from_millis(500),
                zero: Duration::ZERO,
                off: None,
            }
        );
        assert_eq!(
            serde_json::to_string(&read).unwrap(),
            r#"{"positive":0.5,"zero":0.0,"off":0.0}"#
        );
        let read = super::tests::read(r#"{"positive": 3, "zero": 2, "off": 1.25}"#).unwrap();
        assert_eq!(read.off, Some(Duration::from_millis(1250)));
        assert_eq!(read.zero, Duration::from_secs(2));
    }

    #[test]
    fn out_of_range_seconds_are_refused_with_what_was_expected() {
        for (text, expected) in [
            (
                r#"{"positive": 0, "zero": 0, "off": 0}"#,
                "expected a positive number of seconds, found 0",
            ),
            (
                r#"{"positive": -1, "zero": 0, "off": 0}"#,
                "expected a positive number of seconds, found -1",
            ),
            (
                r#"{"positive": 1e9, "zero": 0, "off": 0}"#,
                "expected a positive number of seconds, found 1000000000",
            ),
            (
                r#"{"positive": 1, "zero": -0.5, "off": 0}"#,
                "expected zero or a positive number of seconds, found -0.5",
            ),
            (
                r#"{"positive": 1, "zero": 0, "off": -2}"#,
                "expected zero or a positive number of seconds, found -2",
            ),
        ] {
            let error = read(text).unwrap_err();
            assert!(error.starts_with(expected), "{text}: {error}");
        }
    }

    #[test]
    fn a_list_is_an_array_or_comma_separated_text_parsed_entry_by_entry() {
        #[derive(Debug, Deserialize, Serialize)]
        struct Numbers {
            #[serde(with = "list")]
            items: Vec<u16>,
        }
        let read = |text: &str| serde_json::from_str::<Numbers>(text).map(|n| n.items);
        assert_eq!(read(r#"{"items": ["1", "2"]}"#).unwrap(), [1, 2]);
        assert_eq!(read(r#"{"items": " 3, ,4 "}"#).unwrap(), [3, 4]);
        assert!(read(r#"{"items": "5,x"}"#).is_err());
        let written = serde_json::to_string(&Numbers { items: vec![7, 8] }).unwrap();
        assert_eq!(written, r#"{"items":["7","8"]}"#);
    }
}
