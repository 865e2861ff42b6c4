//! Configuration: built-in defaults < TOML file < environment variables.
//!
//! [`Config`] holds every setting with its default (one place for each default). [`load`] layers the
//! sources with figment, extracts strictly (unknown keys in the file are errors), validates the
//! result and builds the selected strategy, so that every mistake is reported before the router
//! binds its port. Errors name the environment variable or the file key and what was expected.
//!
//! Environment variables are listed once, in [`ENV_VARS`]; the `--help` text, the provider and the
//! error messages are all derived from that table.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Value};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde::{Deserialize, Serialize};

use crate::cidr::Cidr;
use crate::strategies::{self, Strategy, StrategyContext};

/// One environment variable and the configuration key it sets.
#[derive(Debug, Clone, Copy)]
pub struct EnvVar {
    /// The variable's name, e.g. `CUSTOM_ROUTER_PORT`.
    pub name: &'static str,
    /// The dotted configuration key it sets, e.g. `port` or `strategy.name`.
    pub key: &'static str,
    /// One line for `--help` and the docs.
    pub help: &'static str,
}

/// Every environment variable the router reads (besides `RUST_LOG` and `CUSTOM_ROUTER_CONFIG`).
pub const ENV_VARS: &[EnvVar] = &[
    EnvVar {
        name: "CUSTOM_ROUTER_HOST",
        key: "host",
        help: "listening address: an IP address, or empty for all interfaces (IPv6 and IPv4)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_PORT",
        key: "port",
        help: "listening port (0 picks a free port)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_BACKENDS",
        key: "backends",
        help: "comma-separated backends at start: host:port, http(s)://host:port, dns://NAME:PORT, dns+https://NAME:PORT",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_DNS_REFRESH",
        key: "dns_refresh",
        help: "seconds between DNS lookups of dns:// backends",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_ACCESS_LOG",
        key: "access_log",
        help: "write one JSON line per finished request to stdout",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_STRATEGY",
        key: "strategy.name",
        help: "routing strategy, by registry name",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_LATENCY_THRESHOLD",
        key: "latency_threshold",
        help: "seconds; EWMA latency above which a busy backend is not preferred; failures count at least this",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_QUEUE_MAX_SIZE",
        key: "queue_max_size",
        help: "requests held in the router queue; when full the oldest is answered 503",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_QUEUE_TIMEOUT",
        key: "queue_timeout",
        help: "seconds a request may wait in the queue before it is answered 503",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_QUEUE_SHED_RATIO",
        key: "queue_shed_ratio",
        help: "a new request is answered 503 at once while the queue holds more than this many times the requests in flight; 0 never sheds",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_EWMA_ALPHA",
        key: "ewma_alpha",
        help: "EWMA smoothing factor in (0, 1]; higher reacts faster",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_STATE_LOG_INTERVAL",
        key: "state_log_interval",
        help: "seconds between backend-state log lines",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_SHUTDOWN_TIMEOUT",
        key: "shutdown_timeout",
        help: "seconds in-flight requests may take to finish once the listener is closed",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_CONNECT_TIMEOUT",
        key: "connect_timeout",
        help: "seconds allowed to open a connection to a backend",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_ATTEMPTS",
        key: "max_attempts",
        help: "attempts per request, the first included, when a retry is safe",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_RETRY_BODY_LIMIT",
        key: "retry_body_limit",
        help: "bytes of request body kept for a retry; larger bodies stream and are not retried",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_BUFFERED_BYTES",
        key: "max_buffered_bytes",
        help: "bytes of request bodies kept for retries by all requests together; beyond, bodies stream",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_RETRY_BUDGET_PERCENT",
        key: "retry_budget_percent",
        help: "retries allowed as a percentage of requests (over about 10 s)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_RETRY_BUDGET_MIN_PER_SECOND",
        key: "retry_budget_min_per_second",
        help: "retries per second always allowed, whatever the percentage",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_CONSECUTIVE_FAILURES",
        key: "consecutive_failures",
        help: "failures in a row that eject a backend",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_EJECTION_TIME",
        key: "ejection_time",
        help: "seconds of the first ejection; each further ejection adds as much",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_EJECTION_TIME",
        key: "max_ejection_time",
        help: "seconds an ejection lasts at most",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_EJECTION_PERCENT",
        key: "max_ejection_percent",
        help: "largest share of backends ejected at once, in percent",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_HEALTH_CHECK_PATH",
        key: "health_check_path",
        help: "path probed with GET before an ejected backend is readmitted (unset: no probe)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_HEALTH_CHECK_TIMEOUT",
        key: "health_check_timeout",
        help: "seconds a readmission probe may take",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_BUSY_PAUSE",
        key: "max_busy_pause",
        help: "seconds a backend answering 429 or 503 with Retry-After is paused at most",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_SLOW_START",
        key: "slow_start",
        help: "seconds over which a new or readmitted backend's share ramps up (0: off)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_FIRST_BYTE_TIMEOUT",
        key: "first_byte_timeout",
        help: "seconds a backend may take to send response headers (0: no limit)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_HEADER_READ_TIMEOUT",
        key: "header_read_timeout",
        help: "seconds a client may take to send its request headers",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_BODY_READ_TIMEOUT",
        key: "body_read_timeout",
        help: "seconds a client may leave its request body without sending a byte (then 408)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_UPSTREAM_IDLE_TIMEOUT",
        key: "upstream_idle_timeout",
        help: "seconds a backend may leave a response body without sending a byte (0: no limit)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_ALLOW_UNDERSCORE_HEADERS",
        key: "allow_underscore_headers",
        help: "forward request header fields whose names contain '_' (dropped by default)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_HEADER_BYTES",
        key: "max_header_bytes",
        help: "largest request header section accepted, in bytes",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_CONNECTIONS",
        key: "max_connections",
        help: "client connections served at once; more wait to be accepted",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_PRE_DRAIN_DELAY",
        key: "pre_drain_delay",
        help: "seconds between SIGTERM (health turns 503) and closing the listener",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_ADMIN_TOKEN",
        key: "admin_token",
        help: "bearer token required by set-backends (unset: no token)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_BACKEND_ALLOW_CIDRS",
        key: "backend_allow_cidrs",
        help: "comma-separated networks backends must be in (unset: any address)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_DECISION_HEADERS",
        key: "decision_headers",
        help: "add x-custom-router-backend and x-custom-router-queue-ms to responses",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_TLS_CA_FILE",
        key: "tls_ca_file",
        help: "PEM file of extra CA certificates trusted for https:// backends",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_WORKER_THREADS",
        key: "worker_threads",
        help: "threads serving requests; 1 runs everything on one thread (cheapest per request)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_LOG_FORMAT",
        key: "log_format",
        help: "log line format: text or json",
    },
];

/// The environment variable naming the TOML file (same as `--config`).
pub const CONFIG_FILE_ENV: &str = "CUSTOM_ROUTER_CONFIG";

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The `[strategy]` table: which strategy and its own parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StrategyConfig {
    /// Registry name of the strategy.
    pub name: String,
    /// The strategy's own parameters, checked strictly by its factory.
    pub params: Dict,
}

impl Default for StrategyConfig {
    fn default() -> Self {
        Self {
            name: strategies::DEFAULT_STRATEGY.to_owned(),
            params: Dict::new(),
        }
    }
}

/// Every setting, with its default. Durations are seconds (fractions allowed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Listening address; empty for all interfaces (IPv6 and IPv4 where the system allows).
    pub host: String,
    /// Listening port. 0 picks a free port.
    pub port: u16,
    /// Backends at start (set-backends replaces them): addresses and `dns://` names.
    #[serde(deserialize_with = "list_or_comma_separated")]
    pub backends: Vec<String>,
    /// Seconds between DNS lookups of `dns://` backends.
    pub dns_refresh: f64,
    /// Whether each finished request is written as a JSON line to stdout.
    pub access_log: bool,
    /// Strategy selection and parameters.
    pub strategy: StrategyConfig,
    /// Seconds. A busy backend with a higher EWMA is not preferred; failures count at least this.
    pub latency_threshold: f64,
    /// Maximum number of requests waiting in the router queue.
    pub queue_max_size: usize,
    /// Seconds a request may wait in the queue.
    pub queue_timeout: f64,
    /// A new request is answered 503 at once while the queue holds at least this many times the
    /// requests in flight (it would wait about that many request latencies). 0: never.
    pub queue_shed_ratio: f64,
    /// EWMA smoothing factor in (0, 1].
    pub ewma_alpha: f64,
    /// Seconds between backend-state log lines.
    pub state_log_interval: f64,
    /// Seconds in-flight requests may take to finish on shutdown.
    pub shutdown_timeout: f64,
    /// Seconds allowed to connect to a backend.
    pub connect_timeout: f64,
    /// Attempts per request, the first included, when a retry is safe.
    pub max_attempts: u32,
    /// Bytes of request body kept for a retry; larger bodies stream and are never retried.
    pub retry_body_limit: usize,
    /// Bytes of request bodies kept in memory for retries by all requests together.
    pub max_buffered_bytes: usize,
    /// Retries allowed as a percentage of requests over the budget window.
    pub retry_budget_percent: f64,
    /// Retries per second always allowed.
    pub retry_budget_min_per_second: f64,
    /// Failures in a row that eject a backend.
    pub consecutive_failures: u32,
    /// Seconds of the first ejection; the n-th ejection lasts n times this.
    pub ejection_time: f64,
    /// Seconds an ejection lasts at most.
    pub max_ejection_time: f64,
    /// Largest share of the backends ejected at once, in percent.
    pub max_ejection_percent: f64,
    /// Path probed with GET before an ejected backend is readmitted.
    #[serde(deserialize_with = "text_or_number")]
    pub health_check_path: Option<String>,
    /// Seconds a readmission probe may take.
    pub health_check_timeout: f64,
    /// Seconds a busy backend (429, or 503 with Retry-After) is paused at most.
    pub max_busy_pause: f64,
    /// Seconds over which a new or readmitted backend's share ramps up; 0 turns it off.
    pub slow_start: f64,
    /// Seconds a backend may take to send response headers; 0 means no limit.
    pub first_byte_timeout: f64,
    /// Seconds a client may take to send its request headers.
    pub header_read_timeout: f64,
    /// Seconds a client may leave its request body without sending a byte (then 408).
    pub body_read_timeout: f64,
    /// Seconds a backend may leave a response body without sending a byte; 0 means no limit.
    pub upstream_idle_timeout: f64,
    /// Whether request header fields with `_` in their names are forwarded.
    pub allow_underscore_headers: bool,
    /// Largest request header section accepted, in bytes.
    pub max_header_bytes: usize,
    /// Client connections served at once.
    pub max_connections: usize,
    /// Seconds between the shutdown signal and closing the listener (health answers 503).
    pub pre_drain_delay: f64,
    /// Bearer token that set-backends requires.
    #[serde(deserialize_with = "text_or_number", serialize_with = "redacted")]
    pub admin_token: Option<String>,
    /// Networks every backend address must be in; empty allows any address.
    #[serde(deserialize_with = "list_or_comma_separated")]
    pub backend_allow_cidrs: Vec<String>,
    /// Whether responses say which backend answered and how long the request was queued.
    pub decision_headers: bool,
    /// PEM file with extra CA certificates for `https://` backends (the system store is always
    /// trusted).
    pub tls_ca_file: Option<PathBuf>,
    /// Threads serving requests: 1 runs a single-threaded runtime.
    pub worker_threads: usize,
    /// Log line format.
    pub log_format: LogFormat,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            host: String::new(),
            port: 3000,
            backends: Vec::new(),
            dns_refresh: 5.0,
            access_log: false,
            strategy: StrategyConfig::default(),
            latency_threshold: 3.0,
            queue_max_size: 1000,
            queue_timeout: 1200.0,
            queue_shed_ratio: 15.0,
            ewma_alpha: 0.3,
            state_log_interval: 30.0,
            shutdown_timeout: 30.0,
            connect_timeout: 5.0,
            max_attempts: 3,
            retry_body_limit: 1024 * 1024,
            max_buffered_bytes: 32 * 1024 * 1024,
            retry_budget_percent: 20.0,
            retry_budget_min_per_second: 10.0,
            consecutive_failures: 5,
            ejection_time: 30.0,
            max_ejection_time: 300.0,
            max_ejection_percent: 50.0,
            health_check_path: None,
            health_check_timeout: 2.0,
            max_busy_pause: 60.0,
            slow_start: 0.0,
            first_byte_timeout: 0.0,
            header_read_timeout: 10.0,
            body_read_timeout: 60.0,
            upstream_idle_timeout: 300.0,
            allow_underscore_headers: false,
            max_header_bytes: 64 * 1024,
            max_connections: 4096,
            pre_drain_delay: 0.0,
            admin_token: None,
            backend_allow_cidrs: Vec::new(),
            decision_headers: false,
            tls_ca_file: None,
            worker_threads: 1,
            log_format: LogFormat::Text,
        }
    }
}

/// Accepts text or a number as text (an environment value such as `123` parses as a number).
fn text_or_number<'de, D: serde::Deserializer<'de>>(
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
    Ok(
        Option::<Scalar>::deserialize(deserializer)?.map(|value| match value {
            Scalar::Text(text) => text,
            Scalar::Unsigned(n) => n.to_string(),
            Scalar::Signed(n) => n.to_string(),
            Scalar::Float(n) => n.to_string(),
        }),
    )
}

/// Accepts a list of strings, or one comma-separated string (as environment variables give).
fn list_or_comma_separated<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum List {
        Many(Vec<String>),
        One(String),
    }
    Ok(match List::deserialize(deserializer)? {
        List::Many(items) => items,
        List::One(text) => text
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
            .map(str::to_owned)
            .collect(),
    })
}

/// Prints a secret as `"<redacted>"` (in `--check-config` output).
fn redacted<S: serde::Serializer>(
    secret: &Option<String>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match secret {
        Some(_) => serializer.serialize_some("<redacted>"),
        None => serializer.serialize_none(),
    }
}

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
    fn new(location: impl Into<String>, message: impl Into<String>) -> Self {
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

/// A validated configuration with its strategy built.
#[derive(Clone)]
pub struct Settings {
    /// The effective configuration.
    pub config: Config,
    /// The strategy the configuration selects.
    pub strategy: Arc<dyn Strategy>,
    /// Where the file layer came from, if any.
    pub config_file: Option<PathBuf>,
    /// Certificates read from `tls_ca_file`.
    pub extra_ca_certs: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("config", &self.config)
            .field("strategy", &self.strategy.name())
            .field("config_file", &self.config_file)
            .finish()
    }
}

impl Settings {
    /// Validates `config` and builds its strategy.
    pub fn from_config(config: Config) -> Result<Self, ConfigError> {
        let locate = |key: &str| key_location(key, None);
        validate(&config, &locate)?;
        let strategy = build_strategy(&config, None)?;
        let extra_ca_certs = read_ca_file(&config, &locate)?;
        Ok(Self {
            config,
            strategy,
            config_file: None,
            extra_ca_certs,
        })
    }

    /// The address to listen on: `None` for all interfaces (the `host` setting is empty).
    pub fn listen_ip(&self) -> Option<std::net::IpAddr> {
        listen_ip(&self.config.host)
    }

    /// The configured backends (validated when the settings were built).
    pub fn discovery(&self) -> crate::discovery::Discovery {
        let entries = crate::discovery::parse_entries(&self.config.backends).unwrap_or_default();
        crate::discovery::Discovery::new(entries, Duration::from_secs_f64(self.config.dns_refresh))
    }

    /// What the balancer is held to.
    pub fn tuning(&self) -> crate::balancer::Tuning {
        let config = &self.config;
        let seconds = Duration::from_secs_f64;
        crate::balancer::Tuning {
            queue_max_size: config.queue_max_size,
            queue_timeout: self.queue_timeout(),
            queue_shed_ratio: config.queue_shed_ratio,
            ewma_alpha: config.ewma_alpha,
            latency_threshold: config.latency_threshold,
            completed_cap: (2 * config.queue_max_size / 5).max(1) as u64,
            consecutive_failures: config.consecutive_failures,
            ejection_time: seconds(config.ejection_time),
            max_ejection_time: seconds(config.max_ejection_time),
            max_ejection_percent: config.max_ejection_percent,
            health_check_path: config.health_check_path.clone(),
            health_check_timeout: seconds(config.health_check_timeout),
            max_busy_pause: seconds(config.max_busy_pause),
            slow_start: Settings::optional(config.slow_start),
        }
    }

    /// A balancer with no backends, held to these settings and picking with their strategy.
    pub fn balancer(&self) -> Result<Arc<crate::balancer::Balancer>, crate::metrics::MetricsError> {
        crate::balancer::Balancer::new(self.tuning(), Arc::clone(&self.strategy))
    }

    /// The upstream client these settings call for (timeouts, extra CA certificates).
    pub fn upstream_client(&self) -> crate::upstream::UpstreamClient {
        crate::upstream::client(
            self.connect_timeout(),
            Settings::optional(self.config.upstream_idle_timeout),
            &self.extra_ca_certs,
        )
    }

    /// The retry budget these settings call for.
    pub fn retry_budget(&self) -> crate::retry_budget::RetryBudget {
        crate::retry_budget::RetryBudget::new(
            self.config.retry_budget_percent,
            self.config.retry_budget_min_per_second,
        )
    }

    /// Queue timeout as a duration.
    pub fn queue_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.config.queue_timeout)
    }

    /// Backend connect timeout as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.config.connect_timeout)
    }

    /// Shutdown grace period as a duration.
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.config.shutdown_timeout)
    }

    /// Interval between backend-state log lines.
    pub fn state_log_interval(&self) -> Duration {
        Duration::from_secs_f64(self.config.state_log_interval)
    }

    /// The backend allow-list (validated when the settings were built).
    pub fn backend_allow_cidrs(&self) -> Vec<Cidr> {
        self.config
            .backend_allow_cidrs
            .iter()
            .filter_map(|network| network.parse().ok())
            .collect()
    }

    /// `seconds` as a duration, `None` for 0 (a limit that is off).
    pub fn optional(seconds: f64) -> Option<Duration> {
        (seconds > 0.0).then(|| Duration::from_secs_f64(seconds))
    }
}

/// Loads the layered configuration from the process environment and an optional file.
///
/// `file` is the `--config` flag; when absent `CUSTOM_ROUTER_CONFIG` is used. A named file that
/// does not exist is an error.
pub fn load(file: Option<&Path>) -> Result<Settings, ConfigError> {
    let from_flag = file.is_some();
    let file = file
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(CONFIG_FILE_ENV).map(PathBuf::from));
    let mut figment = Figment::from(Serialized::defaults(Config::default()));
    if let Some(path) = &file {
        if !path.is_file() {
            let location = if from_flag {
                "--config".to_owned()
            } else {
                CONFIG_FILE_ENV.to_owned()
            };
            return Err(ConfigError::new(
                location,
                format!(
                    "config file {} does not exist or is not a file",
                    path.display()
                ),
            ));
        }
        figment = figment.merge(Toml::file_exact(path));
    }
    figment = figment.merge(env_provider());
    let config: Config = figment
        .extract()
        .map_err(|error| describe_figment_error(&error, file.as_deref()))?;
    let locate = |key: &str| key_location(key, file.as_deref());
    validate(&config, &locate)?;
    let strategy = build_strategy(&config, file.as_deref())?;
    let extra_ca_certs = read_ca_file(&config, &locate)?;
    Ok(Settings {
        config,
        strategy,
        config_file: file,
        extra_ca_certs,
    })
}

fn env_provider() -> Env {
    let names: Vec<String> = ENV_VARS
        .iter()
        .map(|v| v.name.to_ascii_lowercase())
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    Env::raw().only(&names).map(|name| {
        ENV_VARS
            .iter()
            .find(|v| v.name.eq_ignore_ascii_case(name.as_str()))
            .map_or_else(|| name.into(), |v| v.key.into())
    })
}

/// Where a key's value came from: its environment variable if set, else the file key.
fn key_location(key: &str, file: Option<&Path>) -> String {
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

fn describe_figment_error(error: &figment::Error, file: Option<&Path>) -> ConfigError {
    let key = error.path.join(".");
    let from_env = error
        .metadata
        .as_ref()
        .is_some_and(|m| m.name.contains("environment"));
    let location = match ENV_VARS.iter().find(|v| v.key == key) {
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
    ConfigError::new(location, error.kind.to_string())
}

fn validate(config: &Config, locate: &dyn Fn(&str) -> String) -> Result<(), ConfigError> {
    let positive_seconds = [
        ("latency_threshold", config.latency_threshold),
        ("queue_timeout", config.queue_timeout),
        ("state_log_interval", config.state_log_interval),
        ("connect_timeout", config.connect_timeout),
        ("ejection_time", config.ejection_time),
        ("max_ejection_time", config.max_ejection_time),
        ("health_check_timeout", config.health_check_timeout),
        ("max_busy_pause", config.max_busy_pause),
        ("header_read_timeout", config.header_read_timeout),
        ("body_read_timeout", config.body_read_timeout),
        ("dns_refresh", config.dns_refresh),
    ];
    for (key, value) in positive_seconds {
        if !(value.is_finite() && value > 0.0 && value < 1e9) {
            return Err(ConfigError::new(
                locate(key),
                format!("expected a positive number of seconds, found {value}"),
            ));
        }
    }
    let optional_seconds = [
        ("shutdown_timeout", config.shutdown_timeout),
        ("slow_start", config.slow_start),
        ("first_byte_timeout", config.first_byte_timeout),
        ("upstream_idle_timeout", config.upstream_idle_timeout),
        ("pre_drain_delay", config.pre_drain_delay),
    ];
    for (key, value) in optional_seconds {
        if !(0.0..1e9).contains(&value) {
            return Err(ConfigError::new(
                locate(key),
                format!("expected zero or a positive number of seconds, found {value}"),
            ));
        }
    }
    let positive_counts = [
        ("queue_max_size", config.queue_max_size),
        ("max_attempts", config.max_attempts as usize),
        ("consecutive_failures", config.consecutive_failures as usize),
        ("max_connections", config.max_connections),
        ("worker_threads", config.worker_threads),
    ];
    for (key, value) in positive_counts {
        if value == 0 {
            return Err(ConfigError::new(
                locate(key),
                "expected a positive integer, found 0",
            ));
        }
    }
    let percents = [
        ("retry_budget_percent", config.retry_budget_percent),
        ("max_ejection_percent", config.max_ejection_percent),
    ];
    for (key, value) in percents {
        if !(0.0..=100.0).contains(&value) {
            return Err(ConfigError::new(
                locate(key),
                format!("expected a percentage from 0 to 100, found {value}"),
            ));
        }
    }
    if !(config.queue_shed_ratio.is_finite() && config.queue_shed_ratio >= 0.0) {
        return Err(ConfigError::new(
            locate("queue_shed_ratio"),
            format!(
                "expected zero (never shed) or a positive number, found {}",
                config.queue_shed_ratio
            ),
        ));
    }
    if !(config.retry_budget_min_per_second.is_finite()
        && config.retry_budget_min_per_second >= 0.0)
    {
        return Err(ConfigError::new(
            locate("retry_budget_min_per_second"),
            format!(
                "expected zero or a positive number, found {}",
                config.retry_budget_min_per_second
            ),
        ));
    }
    if config.retry_body_limit > 64 * 1024 * 1024 {
        return Err(ConfigError::new(
            locate("retry_body_limit"),
            format!(
                "expected at most 67108864 bytes, found {}",
                config.retry_body_limit
            ),
        ));
    }
    if !(8 * 1024..=1024 * 1024).contains(&config.max_header_bytes) {
        return Err(ConfigError::new(
            locate("max_header_bytes"),
            format!(
                "expected 8192 to 1048576 bytes, found {}",
                config.max_header_bytes
            ),
        ));
    }
    if let Some(path) = &config.health_check_path {
        if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
            return Err(ConfigError::new(
                locate("health_check_path"),
                format!("expected a path starting with '/', found {path:?}"),
            ));
        }
    }
    if config.admin_token.as_deref().is_some_and(str::is_empty) {
        return Err(ConfigError::new(
            locate("admin_token"),
            "expected a non-empty token",
        ));
    }
    for network in &config.backend_allow_cidrs {
        network
            .parse::<Cidr>()
            .map_err(|message| ConfigError::new(locate("backend_allow_cidrs"), message))?;
    }
    crate::discovery::parse_entries(&config.backends)
        .map_err(|message| ConfigError::new(locate("backends"), message))?;
    if !config.host.is_empty() && listen_ip(&config.host).is_none() {
        return Err(ConfigError::new(
            locate("host"),
            format!(
                "expected an IP address such as 0.0.0.0, :: or 127.0.0.1 (empty for all interfaces), found {:?}",
                config.host
            ),
        ));
    }
    if !(config.ewma_alpha > 0.0 && config.ewma_alpha <= 1.0) {
        return Err(ConfigError::new(
            locate("ewma_alpha"),
            format!("expected a number in (0, 1], found {}", config.ewma_alpha),
        ));
    }
    Ok(())
}

/// The IP address of a `host` setting (IPv6 may be bracketed).
fn listen_ip(host: &str) -> Option<std::net::IpAddr> {
    let host = host.trim();
    let bare = host
        .strip_prefix('[')
        .and_then(|rest| rest.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse().ok()
}

fn read_ca_file(
    config: &Config,
    locate: &dyn Fn(&str) -> String,
) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let Some(path) = &config.tls_ca_file else {
        return Ok(Vec::new());
    };
    let fail = |what: String| ConfigError::new(locate("tls_ca_file"), what);
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| fail(format!("cannot read PEM file {}: {e}", path.display())))?
        .collect::<Result<_, _>>()
        .map_err(|e| fail(format!("invalid PEM in {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(fail(format!(
            "expected at least one certificate in {}",
            path.display()
        )));
    }
    Ok(certs)
}

fn build_strategy(config: &Config, file: Option<&Path>) -> Result<Arc<dyn Strategy>, ConfigError> {
    let Some(entry) = strategies::find(&config.strategy.name) else {
        return Err(ConfigError::new(
            key_location("strategy.name", file),
            format!(
                "unknown strategy {:?}; expected one of: {}",
                config.strategy.name,
                strategies::names().join(", ")
            ),
        ));
    };
    let context = StrategyContext {
        latency_threshold: config.latency_threshold,
        ewma_alpha: config.ewma_alpha,
    };
    let params = Value::from(config.strategy.params.clone());
    (entry.build)(&context, &params).map_err(|error| {
        let key = if error.field.is_empty() {
            "strategy.params".to_owned()
        } else {
            format!("strategy.params.{}", error.field)
        };
        let location = match file {
            Some(path) => format!("key `{key}` in {}", path.display()),
            None => format!("key `{key}`"),
        };
        ConfigError::new(
            location,
            format!("{} (strategy {})", error.message, entry.name),
        )
    })
}

/// The `--help` paragraph listing every environment variable with its default.
pub fn env_help() -> String {
    let defaults = serde_json::to_value(Config::default()).unwrap_or_default();
    let mut text = String::from("Environment variables (override the config file):\n");
    for var in ENV_VARS {
        let default = var
            .key
            .split('.')
            .try_fold(&defaults, |value, part| value.get(part))
            .map(|v| v.to_string().trim_matches('"').to_owned())
            .unwrap_or_default();
        text.push_str(&format!(
            "  {:<34} {} [default: {}]\n",
            var.name, var.help, default
        ));
    }
    text.push_str(&format!(
        "  {:<34} TOML config file (same as --config)\n",
        CONFIG_FILE_ENV
    ));
    text.push_str(&format!(
        "  {:<34} log filter, e.g. info or custom_router=debug [default: info]\n",
        "RUST_LOG"
    ));
    text
}
