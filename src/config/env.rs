//! The environment variables: [`ENV_VARS`], the one table naming each variable, the key it sets,
//! how its value is read and its `--help` line, and the figment provider that reads them.
//!
//! Everything about a variable is derived from its row: the provider (`provider`), where an
//! error says a value came from (`key_location`), the `--help` paragraph
//! ([`super::help::env_help`]) and the docs check (`tests/docs.rs`).

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Serialized};
use serde::Serialize;

use super::ConfigError;

/// The environment variable naming the TOML file (same as `--config`).
pub const CONFIG_FILE_ENV: &str = "CUSTOM_ROUTER_CONFIG";

/// How an environment variable's value is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvForm {
    /// As a value of the file is: a number, a boolean, an array (`1e3` included).
    Parsed,
    /// As written: text that may look like a number or an array (a token `007` stays `007`, a
    /// host `[::1]` is not an array).
    Text,
}

/// One environment variable and the configuration key it sets.
#[derive(Debug, Clone, Copy)]
pub struct EnvVar {
    /// The variable's name, e.g. `CUSTOM_ROUTER_PORT`.
    pub name: &'static str,
    /// The dotted configuration key it sets, e.g. `port` or `queue.timeout`.
    pub key: &'static str,
    /// One line for `--help` and the docs.
    pub help: &'static str,
    /// How its value is read.
    pub form: EnvForm,
}

/// A variable whose value is read as the file's values are.
const fn parsed(name: &'static str, key: &'static str, help: &'static str) -> EnvVar {
    EnvVar {
        name,
        key,
        help,
        form: EnvForm::Parsed,
    }
}

/// A variable whose value is text, taken as written.
const fn text(name: &'static str, key: &'static str, help: &'static str) -> EnvVar {
    EnvVar {
        name,
        key,
        help,
        form: EnvForm::Text,
    }
}

/// Every environment variable the router reads (besides `RUST_LOG` and `CUSTOM_ROUTER_CONFIG`).
pub const ENV_VARS: &[EnvVar] = &[
    text(
        "CUSTOM_ROUTER_HOST",
        "host",
        "listening address: an IP address, or empty for all interfaces (IPv6 and IPv4)",
    ),
    parsed(
        "CUSTOM_ROUTER_PORT",
        "port",
        "listening port (0 picks a free port)",
    ),
    parsed(
        "CUSTOM_ROUTER_BACKENDS",
        "backends",
        "comma-separated backends at start: host:port, http(s)://host:port, dns://NAME:PORT, dns+https://NAME:PORT",
    ),
    parsed(
        "CUSTOM_ROUTER_DNS_REFRESH",
        "dns_refresh",
        "seconds between DNS lookups of dns:// backends",
    ),
    parsed(
        "CUSTOM_ROUTER_MAX_CONNECTIONS",
        "max_connections",
        "client connections served at once, or auto (from the open-file limit); more wait to be accepted",
    ),
    parsed(
        "CUSTOM_ROUTER_WORKER_THREADS",
        "worker_threads",
        "threads serving requests; 1 runs everything on one thread (cheapest per request); auto: one per CPU",
    ),
    parsed(
        "CUSTOM_ROUTER_LOG_FORMAT",
        "log_format",
        "log line format: text or json",
    ),
    parsed(
        "CUSTOM_ROUTER_STATE_LOG_INTERVAL",
        "state_log_interval",
        "seconds between backend-state log lines",
    ),
    parsed(
        "CUSTOM_ROUTER_ACCESS_LOG",
        "access_log",
        "write one JSON line per finished request to stdout",
    ),
    parsed(
        "CUSTOM_ROUTER_DECISION_HEADERS",
        "decision_headers",
        "add x-custom-router-backend and x-custom-router-queue-ms to responses",
    ),
    text(
        "CUSTOM_ROUTER_STRATEGY",
        "strategy.name",
        "routing strategy, by registry name",
    ),
    parsed(
        "CUSTOM_ROUTER_QUEUE_MAX_SIZE",
        "queue.max_size",
        "requests held in the router queue; when full, the oldest of the largest tenant in the lowest band is answered 503",
    ),
    parsed(
        "CUSTOM_ROUTER_QUEUE_TIMEOUT",
        "queue.timeout",
        "seconds a request may wait in the queue before it is answered 503",
    ),
    parsed(
        "CUSTOM_ROUTER_QUEUE_SHED_RATIO",
        "queue.shed_ratio",
        "a new request is answered 503 at once while the queue holds more than this many times the requests in flight; 0 (the default) never sheds by this rule",
    ),
    text(
        "CUSTOM_ROUTER_DEADLINE_HEADER",
        "queue.deadline_header",
        "request header giving the milliseconds within which a request's answer must start; a request predicted to start later is answered 503 at once",
    ),
    text(
        "CUSTOM_ROUTER_PRIORITY_HEADER",
        "queue.priority_header",
        "request header naming the priority band: high, normal or low",
    ),
    parsed(
        "CUSTOM_ROUTER_QUEUE_PRIORITY_AGING",
        "queue.priority_aging",
        "seconds after which queued lower-band requests get one dispatch in four",
    ),
    text(
        "CUSTOM_ROUTER_TENANT_HEADER",
        "queue.tenant_header",
        "request header naming the tenant; tenants get fair shares of the queue's dispatch (empty: off)",
    ),
    parsed(
        "CUSTOM_ROUTER_LATENCY_THRESHOLD",
        "latency.threshold",
        "seconds; EWMA latency above which a busy backend is not preferred; failures count at least this",
    ),
    parsed(
        "CUSTOM_ROUTER_EWMA_ALPHA",
        "latency.ewma_alpha",
        "EWMA smoothing factor in (0, 1]; higher reacts faster",
    ),
    parsed(
        "CUSTOM_ROUTER_MAX_ATTEMPTS",
        "retry.max_attempts",
        "attempts per request, the first included, when a retry is safe",
    ),
    parsed(
        "CUSTOM_ROUTER_RETRY_BODY_LIMIT",
        "retry.body_limit",
        "bytes of request body kept for a retry; larger bodies stream and are not retried",
    ),
    parsed(
        "CUSTOM_ROUTER_MAX_BUFFERED_BYTES",
        "retry.max_buffered_bytes",
        "bytes of request bodies kept for retries by all requests together; beyond, bodies stream",
    ),
    parsed(
        "CUSTOM_ROUTER_RETRY_BUDGET_PERCENT",
        "retry.budget.percent",
        "retries allowed as a percentage of requests (over about 10 s)",
    ),
    parsed(
        "CUSTOM_ROUTER_RETRY_BUDGET_MIN_PER_SECOND",
        "retry.budget.min_per_second",
        "retries per second always allowed, whatever the percentage",
    ),
    parsed(
        "CUSTOM_ROUTER_CONSECUTIVE_FAILURES",
        "availability.consecutive_failures",
        "failures in a row that eject a backend",
    ),
    parsed(
        "CUSTOM_ROUTER_EJECTION_TIME",
        "availability.ejection_time",
        "seconds of the first ejection; each further ejection adds as much",
    ),
    parsed(
        "CUSTOM_ROUTER_MAX_EJECTION_TIME",
        "availability.max_ejection_time",
        "seconds an ejection lasts at most",
    ),
    parsed(
        "CUSTOM_ROUTER_MAX_EJECTION_PERCENT",
        "availability.max_ejection_percent",
        "largest share of backends ejected at once, in percent",
    ),
    text(
        "CUSTOM_ROUTER_HEALTH_CHECK_PATH",
        "availability.health_check_path",
        "path probed with GET before an ejected backend is readmitted (unset: no probe)",
    ),
    parsed(
        "CUSTOM_ROUTER_HEALTH_CHECK_TIMEOUT",
        "availability.health_check_timeout",
        "seconds a readmission probe may take",
    ),
    parsed(
        "CUSTOM_ROUTER_MAX_BUSY_PAUSE",
        "availability.max_busy_pause",
        "seconds a backend answering 429 or 503 with Retry-After is paused at most",
    ),
    parsed(
        "CUSTOM_ROUTER_SLOW_START",
        "availability.slow_start",
        "seconds over which a new or readmitted backend's share ramps up (0: off)",
    ),
    parsed(
        "CUSTOM_ROUTER_CONNECT_TIMEOUT",
        "upstream.connect_timeout",
        "seconds allowed to open a connection to a backend",
    ),
    parsed(
        "CUSTOM_ROUTER_FIRST_BYTE_TIMEOUT",
        "upstream.first_byte_timeout",
        "seconds a backend may take to send response headers (0: no limit)",
    ),
    parsed(
        "CUSTOM_ROUTER_UPSTREAM_IDLE_TIMEOUT",
        "upstream.idle_timeout",
        "seconds a backend may leave a response body without sending a byte (0: no limit)",
    ),
    text(
        "CUSTOM_ROUTER_TLS_CA_FILE",
        "upstream.tls_ca_file",
        "PEM file of extra CA certificates trusted for https:// backends",
    ),
    parsed(
        "CUSTOM_ROUTER_HEADER_READ_TIMEOUT",
        "limits.header_read_timeout",
        "seconds a client may take to send its request headers",
    ),
    parsed(
        "CUSTOM_ROUTER_BODY_READ_TIMEOUT",
        "limits.body_read_timeout",
        "seconds a client may leave its request body without sending a byte (then 408)",
    ),
    parsed(
        "CUSTOM_ROUTER_SEND_TIMEOUT",
        "limits.send_timeout",
        "seconds a client may leave the response unread before its connection is closed",
    ),
    parsed(
        "CUSTOM_ROUTER_MAX_HEADER_BYTES",
        "limits.max_header_bytes",
        "largest request header section accepted, in bytes",
    ),
    parsed(
        "CUSTOM_ROUTER_ALLOW_UNDERSCORE_HEADERS",
        "limits.allow_underscore_headers",
        "forward request header fields whose names contain '_' (dropped by default)",
    ),
    parsed(
        "CUSTOM_ROUTER_PRE_DRAIN_DELAY",
        "shutdown.pre_drain_delay",
        "seconds between SIGTERM (health turns 503) and closing the listener",
    ),
    parsed(
        "CUSTOM_ROUTER_SHUTDOWN_TIMEOUT",
        "shutdown.timeout",
        "seconds in-flight requests may take to finish once the listener is closed",
    ),
    parsed(
        "CUSTOM_ROUTER_ENGINE_METRICS",
        "engine_metrics.kind",
        "read each backend's engine load from its metrics: off, vllm, sglang, tgi or auto",
    ),
    parsed(
        "CUSTOM_ROUTER_ENGINE_METRICS_INTERVAL",
        "engine_metrics.interval",
        "seconds between scrapes of each backend's engine metrics (0.1 to 10)",
    ),
    text(
        "CUSTOM_ROUTER_ENGINE_METRICS_PATH",
        "engine_metrics.path",
        "path of the backends' metrics endpoint",
    ),
    parsed(
        "CUSTOM_ROUTER_ENGINE_METRICS_TIMEOUT",
        "engine_metrics.timeout",
        "seconds one scrape may take (unset: the interval)",
    ),
    parsed(
        "CUSTOM_ROUTER_ENGINE_METRICS_STALE_AFTER",
        "engine_metrics.stale_after",
        "seconds after which a backend's engine values are no longer used (unset: 3 intervals)",
    ),
    text(
        "CUSTOM_ROUTER_ADMIN_TOKEN",
        "admin.token",
        "bearer token required by set-backends (unset: no token)",
    ),
    parsed(
        "CUSTOM_ROUTER_BACKEND_ALLOW_CIDRS",
        "admin.backend_allow_cidrs",
        "comma-separated networks backends must be in (unset: any address)",
    ),
];

/// Refuses a variable of the table that is set but not UTF-8: it would be skipped (an admin
/// token, say, silently off).
pub(super) fn check_unicode() -> Result<(), ConfigError> {
    if let Some(var) = ENV_VARS.iter().find(|v| {
        matches!(
            std::env::var(v.name),
            Err(std::env::VarError::NotUnicode(_))
        )
    }) {
        return Err(ConfigError::new(var.name, "the value is not valid UTF-8"));
    }
    Ok(())
}

/// A number read from the environment in exponent form; its type's name tells an error's
/// location (the variable, not the file key).
#[derive(Serialize)]
#[serde(transparent)]
pub(super) struct EnvironmentNumber(f64);

/// The variables of the table that are set, each at its key: [`EnvForm::Parsed`] ones read as
/// figment reads the environment (numbers in exponent form as the file reads them),
/// [`EnvForm::Text`] ones as written.
pub(super) fn provider() -> impl figment::Provider {
    let parsed = || ENV_VARS.iter().filter(|v| v.form == EnvForm::Parsed);
    let names: Vec<String> = parsed().map(|v| v.name.to_ascii_lowercase()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let read = Env::raw().only(&names).map(|name| {
        ENV_VARS
            .iter()
            .find(|v| v.name.eq_ignore_ascii_case(name.as_str()))
            .map_or_else(|| name.into(), |v| v.key.into())
    });
    let mut figment = Figment::from(read);
    // A number in exponent form (`1e3`) is read as the file reads it; figment's own reading of
    // the environment takes it for a string.
    for var in parsed() {
        let Ok(value) = std::env::var(var.name) else {
            continue;
        };
        let value = value.trim();
        if value.contains(['e', 'E'])
            && value.starts_with(|c: char| c.is_ascii_digit() || c == '-' || c == '+' || c == '.')
        {
            if let Ok(number) = value.parse::<f64>() {
                figment = figment.merge(
                    Serialized::default(var.key, EnvironmentNumber(number))
                        .profile(figment::Profile::Default),
                );
            }
        }
    }
    for var in ENV_VARS.iter().filter(|v| v.form == EnvForm::Text) {
        if let Ok(value) = std::env::var(var.name) {
            figment = figment
                .merge(Serialized::default(var.key, value).profile(figment::Profile::Default));
        }
    }
    figment
}

/// Where a key's value came from: its environment variable if set, else the file key.
pub(super) fn key_location(key: &str, file: Option<&Path>) -> String {
    if let Some(var) = ENV_VARS
        .iter()
        .find(|v| v.key == key && std::env::var_os(v.name).is_some())
    {
        return var.name.to_owned();
    }
    match file {
        Some(path) => format!("key `{key}` in {}", path.display()),
        None => format!("key `{key}`"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn value_at<'a>(value: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
        key.split('.')
            .try_fold(value, |value, part| value.get(part))
    }

    #[test]
    fn every_environment_variable_sets_a_key_of_the_configuration() {
        let defaults = serde_json::to_value(Config::default()).unwrap();
        for var in ENV_VARS {
            assert!(
                value_at(&defaults, var.key).is_some(),
                "{} sets {}, which the configuration lacks",
                var.name,
                var.key
            );
        }
    }

    #[test]
    fn text_variables_set_keys_whose_defaults_are_text_or_unset() {
        let defaults = serde_json::to_value(Config::default()).unwrap();
        for var in ENV_VARS.iter().filter(|v| v.form == EnvForm::Text) {
            let default = value_at(&defaults, var.key).unwrap();
            assert!(
                default.is_string() || default.is_null(),
                "{} is read as text, but {} defaults to {default}",
                var.name,
                var.key
            );
        }
    }

    #[test]
    fn every_variable_and_key_is_named_once() {
        for (at, var) in ENV_VARS.iter().enumerate() {
            for other in &ENV_VARS[at + 1..] {
                assert_ne!(var.name, other.name);
                assert_ne!(var.key, other.key);
            }
        }
    }
}
