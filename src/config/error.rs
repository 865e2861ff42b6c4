//! How a configuration mistake is told: [`ConfigError`], one line naming the environment
//! variable or the file key and what was expected; figment's errors turned into it; and
//! [`MOVED_KEYS`], the keys of the old flat layout, each named with its new place.

use std::path::Path;

use figment::error::Kind;

use super::env::{ENV_VARS, EnvironmentNumber};

/// Keys of the flat layout that moved into sections: `(old key, new dotted key)`. An old key in
/// a file is an error naming its new place.
pub const MOVED_KEYS: &[(&str, &str)] = &[
    ("latency_threshold", "latency.threshold"),
    ("queue_max_size", "queue.max_size"),
    ("queue_timeout", "queue.timeout"),
    ("queue_shed_ratio", "queue.shed_ratio"),
    ("ewma_alpha", "latency.ewma_alpha"),
    ("shutdown_timeout", "shutdown.timeout"),
    ("connect_timeout", "upstream.connect_timeout"),
    ("max_attempts", "retry.max_attempts"),
    ("retry_body_limit", "retry.body_limit"),
    ("max_buffered_bytes", "retry.max_buffered_bytes"),
    ("retry_budget_percent", "retry.budget.percent"),
    ("retry_budget_min_per_second", "retry.budget.min_per_second"),
    ("consecutive_failures", "availability.consecutive_failures"),
    ("ejection_time", "availability.ejection_time"),
    ("max_ejection_time", "availability.max_ejection_time"),
    ("max_ejection_percent", "availability.max_ejection_percent"),
    ("health_check_path", "availability.health_check_path"),
    ("health_check_timeout", "availability.health_check_timeout"),
    ("max_busy_pause", "availability.max_busy_pause"),
    ("slow_start", "availability.slow_start"),
    ("first_byte_timeout", "upstream.first_byte_timeout"),
    ("header_read_timeout", "limits.header_read_timeout"),
    ("body_read_timeout", "limits.body_read_timeout"),
    ("upstream_idle_timeout", "upstream.idle_timeout"),
    (
        "allow_underscore_headers",
        "limits.allow_underscore_headers",
    ),
    ("max_header_bytes", "limits.max_header_bytes"),
    ("pre_drain_delay", "shutdown.pre_drain_delay"),
    ("admin_token", "admin.token"),
    ("backend_allow_cidrs", "admin.backend_allow_cidrs"),
    ("tls_ca_file", "upstream.tls_ca_file"),
];

/// A configuration error: which variable or key, and what was expected.
#[derive(Debug, thiserror::Error)]
#[error("{location}: {message}")]
pub struct ConfigError {
    /// The environment variable, or the key and the file it came from.
    pub location: String,
    /// What is wrong and what was expected.
    pub message: String,
}

impl ConfigError {
    pub(super) fn new(location: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            location: location.into(),
            message: one_line(&message.into()),
        }
    }
}

/// Folds a multi-line message (such as a TOML parse error with its source excerpt) into one line,
/// keeping the text and dropping the excerpt.
fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|line| {
            let excerpt = line.starts_with('|')
                || line
                    .split_once('|')
                    .is_some_and(|(number, _)| number.trim().parse::<u32>().is_ok());
            !line.is_empty() && !excerpt
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Tells a figment error in one line: the variable when the value came from the environment,
/// else the file key; a key of the flat layout is named with its new place.
pub(super) fn describe_figment_error(error: &figment::Error, file: Option<&Path>) -> ConfigError {
    let key = error.path.join(".");
    let from_env = error.metadata.as_ref().is_some_and(|m| {
        m.name.contains("environment")
            || m.name.ends_with(std::any::type_name::<EnvironmentNumber>())
    });
    // A value given as a table where a word was expected (`{a=1}` for an enum) fails below its
    // key (`log_format.a`): the variable is the one whose key the path starts with.
    let env_var = ENV_VARS
        .iter()
        .filter(|v| {
            key.strip_prefix(v.key)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
        })
        .max_by_key(|v| v.key.len());
    let location = match env_var {
        Some(var) if from_env => var.name.to_owned(),
        _ if key.is_empty() => match file {
            Some(path) => path.display().to_string(),
            None => "configuration".to_owned(),
        },
        _ => match (&error.metadata, file) {
            (Some(m), Some(path)) if !from_env && m.source.is_some() => {
                format!("key `{key}` in {}", path.display())
            }
            _ => format!("key `{key}`"),
        },
    };
    if let Kind::UnknownField(..) = &error.kind {
        if let Some((_, moved_to)) = MOVED_KEYS.iter().find(|(old, _)| *old == key) {
            return ConfigError::new(location, format!("moved to `{moved_to}`"));
        }
    }
    ConfigError::new(location, error.kind.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn every_moved_key_names_a_key_of_the_configuration_and_is_gone() {
        let defaults = serde_json::to_value(Config::default()).unwrap();
        for (old, new) in MOVED_KEYS {
            let moved = new
                .split('.')
                .try_fold(&defaults, |value, part| value.get(part));
            assert!(moved.is_some(), "{old} moved to {new}");
            assert!(defaults.get(old).is_none(), "{old} is still a key");
        }
    }

    #[test]
    fn a_multi_line_message_is_folded_into_one_without_its_excerpt() {
        let message = "TOML parse error at line 1, column 8\n  |\n1 | port = \n  |        ^\ninvalid string\n";
        assert_eq!(
            one_line(message),
            "TOML parse error at line 1, column 8; invalid string"
        );
    }
}
