//! Configuration: built-in defaults < TOML file < environment variables.
//!
//! [`Config`] composes the settings in sections, each one the settings struct of the component it
//! configures, defined in that component with its defaults: `[queue]` ([`QueueConfig`]),
//! `[latency]` ([`LatencyConfig`]), `[availability]` ([`AvailabilityConfig`]),
//! `[prefix_index]` ([`PrefixIndexConfig`]), `[retry]`
//! ([`RetryConfig`], with `[retry.budget]`), `[upstream]` ([`UpstreamConfig`]), `[limits]`
//! ([`Limits`]), `[admin]` ([`AdminConfig`]), `[engine_metrics]` ([`EngineMetricsConfig`]), plus `[shutdown]` ([`ShutdownConfig`]) and the
//! strategy's `[strategy]`; the listener and process settings are top-level keys. Each section is
//! handed to its component as it is: durations are [`Duration`]s, read from seconds by
//! [`crate::forms`], and no number is copied into a second struct.
//!
//! [`load`] layers the sources with figment, extracts strictly (unknown keys in the file are
//! errors; a key of the old flat layout names the key it moved to, [`MOVED_KEYS`]), validates the
//! result and builds the selected strategy, so that every mistake is reported before the router
//! binds its port. Errors name the environment variable or the file key and what was expected.
//!
//! Environment variables are listed once, in [`ENV_VARS`]; the `--help` text, the provider and the
//! error messages are all derived from that table.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use figment::Figment;
use figment::error::Kind;
use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Value};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde::{Deserialize, Serialize};

use crate::admin::AdminConfig;
use crate::balancer::{AvailabilityConfig, PrefixIndexConfig, QueueConfig, Tuning};
use crate::engine_metrics::EngineMetricsConfig;
use crate::forms::Count;
use crate::h1::server::Limits;
use crate::process;
use crate::proxy::RetryConfig;
use crate::strategies::{self, LatencyConfig, Strategy, StrategyContext};
use crate::upstream::UpstreamConfig;

/// One environment variable and the configuration key it sets.
#[derive(Debug, Clone, Copy)]
pub struct EnvVar {
    /// The variable's name, e.g. `CUSTOM_ROUTER_PORT`.
    pub name: &'static str,
    /// The dotted configuration key it sets, e.g. `port` or `queue.timeout`.
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
        name: "CUSTOM_ROUTER_MAX_CONNECTIONS",
        key: "max_connections",
        help: "client connections served at once, or auto (from the open-file limit); more wait to be accepted",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_WORKER_THREADS",
        key: "worker_threads",
        help: "threads serving requests; 1 runs everything on one thread (cheapest per request); auto: one per CPU",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_LOG_FORMAT",
        key: "log_format",
        help: "log line format: text or json",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_STATE_LOG_INTERVAL",
        key: "state_log_interval",
        help: "seconds between backend-state log lines",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_ACCESS_LOG",
        key: "access_log",
        help: "write one JSON line per finished request to stdout",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_DECISION_HEADERS",
        key: "decision_headers",
        help: "add x-custom-router-backend and x-custom-router-queue-ms to responses",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_STRATEGY",
        key: "strategy.name",
        help: "routing strategy, by registry name",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_QUEUE_MAX_SIZE",
        key: "queue.max_size",
        help: "requests held in the router queue; when full, the oldest of the largest tenant in the lowest band is answered 503",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_QUEUE_TIMEOUT",
        key: "queue.timeout",
        help: "seconds a request may wait in the queue before it is answered 503",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_QUEUE_SHED_RATIO",
        key: "queue.shed_ratio",
        help: "a new request is answered 503 at once while the queue holds more than this many times the requests in flight; 0 (the default) never sheds by this rule",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_DEADLINE_HEADER",
        key: "queue.deadline_header",
        help: "request header giving the milliseconds within which a request's answer must start; a request predicted to start later is answered 503 at once",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_PRIORITY_HEADER",
        key: "queue.priority_header",
        help: "request header naming the priority band: high, normal or low",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_QUEUE_PRIORITY_AGING",
        key: "queue.priority_aging",
        help: "seconds after which queued lower-band requests get one dispatch in four",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_TENANT_HEADER",
        key: "queue.tenant_header",
        help: "request header naming the tenant; tenants get fair shares of the queue's dispatch (empty: off)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_LATENCY_THRESHOLD",
        key: "latency.threshold",
        help: "seconds; EWMA latency above which a busy backend is not preferred; failures count at least this",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_EWMA_ALPHA",
        key: "latency.ewma_alpha",
        help: "EWMA smoothing factor in (0, 1]; higher reacts faster",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_ATTEMPTS",
        key: "retry.max_attempts",
        help: "attempts per request, the first included, when a retry is safe",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_RETRY_BODY_LIMIT",
        key: "retry.body_limit",
        help: "bytes of request body kept for a retry; larger bodies stream and are not retried",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_BUFFERED_BYTES",
        key: "retry.max_buffered_bytes",
        help: "bytes of request bodies kept for retries by all requests together; beyond, bodies stream",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_RETRY_BUDGET_PERCENT",
        key: "retry.budget.percent",
        help: "retries allowed as a percentage of requests (over about 10 s)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_RETRY_BUDGET_MIN_PER_SECOND",
        key: "retry.budget.min_per_second",
        help: "retries per second always allowed, whatever the percentage",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_CONSECUTIVE_FAILURES",
        key: "availability.consecutive_failures",
        help: "failures in a row that eject a backend",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_EJECTION_TIME",
        key: "availability.ejection_time",
        help: "seconds of the first ejection; each further ejection adds as much",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_EJECTION_TIME",
        key: "availability.max_ejection_time",
        help: "seconds an ejection lasts at most",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_EJECTION_PERCENT",
        key: "availability.max_ejection_percent",
        help: "largest share of backends ejected at once, in percent",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_HEALTH_CHECK_PATH",
        key: "availability.health_check_path",
        help: "path probed with GET before an ejected backend is readmitted (unset: no probe)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_HEALTH_CHECK_TIMEOUT",
        key: "availability.health_check_timeout",
        help: "seconds a readmission probe may take",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_BUSY_PAUSE",
        key: "availability.max_busy_pause",
        help: "seconds a backend answering 429 or 503 with Retry-After is paused at most",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_SLOW_START",
        key: "availability.slow_start",
        help: "seconds over which a new or readmitted backend's share ramps up (0: off)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_CONNECT_TIMEOUT",
        key: "upstream.connect_timeout",
        help: "seconds allowed to open a connection to a backend",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_FIRST_BYTE_TIMEOUT",
        key: "upstream.first_byte_timeout",
        help: "seconds a backend may take to send response headers (0: no limit)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_UPSTREAM_IDLE_TIMEOUT",
        key: "upstream.idle_timeout",
        help: "seconds a backend may leave a response body without sending a byte (0: no limit)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_TLS_CA_FILE",
        key: "upstream.tls_ca_file",
        help: "PEM file of extra CA certificates trusted for https:// backends",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_HEADER_READ_TIMEOUT",
        key: "limits.header_read_timeout",
        help: "seconds a client may take to send its request headers",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_BODY_READ_TIMEOUT",
        key: "limits.body_read_timeout",
        help: "seconds a client may leave its request body without sending a byte (then 408)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_SEND_TIMEOUT",
        key: "limits.send_timeout",
        help: "seconds a client may leave the response unread before its connection is closed",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_MAX_HEADER_BYTES",
        key: "limits.max_header_bytes",
        help: "largest request header section accepted, in bytes",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_ALLOW_UNDERSCORE_HEADERS",
        key: "limits.allow_underscore_headers",
        help: "forward request header fields whose names contain '_' (dropped by default)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_PRE_DRAIN_DELAY",
        key: "shutdown.pre_drain_delay",
        help: "seconds between SIGTERM (health turns 503) and closing the listener",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_SHUTDOWN_TIMEOUT",
        key: "shutdown.timeout",
        help: "seconds in-flight requests may take to finish once the listener is closed",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_ENGINE_METRICS",
        key: "engine_metrics.kind",
        help: "read each backend's engine load from its metrics: off, vllm, sglang, tgi or auto",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_ENGINE_METRICS_INTERVAL",
        key: "engine_metrics.interval",
        help: "seconds between scrapes of each backend's engine metrics (0.1 to 10)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_ENGINE_METRICS_PATH",
        key: "engine_metrics.path",
        help: "path of the backends' metrics endpoint",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_ENGINE_METRICS_TIMEOUT",
        key: "engine_metrics.timeout",
        help: "seconds one scrape may take (unset: the interval)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_ENGINE_METRICS_STALE_AFTER",
        key: "engine_metrics.stale_after",
        help: "seconds after which a backend's engine values are no longer used (unset: 3 intervals)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_ADMIN_TOKEN",
        key: "admin.token",
        help: "bearer token required by set-backends (unset: no token)",
    },
    EnvVar {
        name: "CUSTOM_ROUTER_BACKEND_ALLOW_CIDRS",
        key: "admin.backend_allow_cidrs",
        help: "comma-separated networks backends must be in (unset: any address)",
    },
];

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

/// The `[shutdown]` section: how the router drains after SIGTERM/SIGINT (read by the server).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// Between the signal (health answers 503 at once) and closing the listener.
    #[serde(with = "crate::forms::seconds_or_zero")]
    pub pre_drain_delay: Duration,
    /// How long in-flight and queued requests may take to finish once the listener is closed.
    #[serde(with = "crate::forms::seconds_or_zero")]
    pub timeout: Duration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            pre_drain_delay: Duration::ZERO,
            timeout: Duration::from_secs(30),
        }
    }
}

/// Every setting, with its default: the listener and process settings at the top, then one
/// section per component. Durations are written as seconds (fractions allowed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Listening address; empty for all interfaces (IPv6 and IPv4 where the system allows).
    pub host: String,
    /// Listening port. 0 picks a free port.
    pub port: u16,
    /// Backends at start (set-backends replaces them): addresses and `dns://` names.
    #[serde(with = "crate::forms::list")]
    pub backends: Vec<String>,
    /// Between DNS lookups of `dns://` backends.
    #[serde(with = "crate::forms::seconds")]
    pub dns_refresh: Duration,
    /// Client connections served at once; `auto` derives it from the open-file limit
    /// ([`Settings::max_connections`]).
    pub max_connections: Count,
    /// Threads serving requests: 1 runs a single-threaded runtime; `auto` one per available CPU
    /// ([`Settings::worker_threads`]).
    pub worker_threads: Count,
    /// Log line format.
    pub log_format: LogFormat,
    /// Between backend-state log lines.
    #[serde(with = "crate::forms::seconds")]
    pub state_log_interval: Duration,
    /// Whether each finished request is written as a JSON line to stdout.
    pub access_log: bool,
    /// Whether responses say which backend answered and how long the request was queued.
    pub decision_headers: bool,
    /// Strategy selection and parameters.
    pub strategy: StrategyConfig,
    /// The admission queue (the balancer).
    pub queue: QueueConfig,
    /// Latency measurement (the balancer and strategies).
    pub latency: LatencyConfig,
    /// Retries (the proxy) and the retry budget.
    pub retry: RetryConfig,
    /// Ejection, busy pauses, readmission probes, slow start (the balancer).
    pub availability: AvailabilityConfig,
    /// What the router remembers of the prompts sent to each backend.
    pub prefix_index: PrefixIndexConfig,
    /// Connections and timeouts to backends (the upstream client).
    pub upstream: UpstreamConfig,
    /// What client connections are held to (the HTTP/1 server; the HTTP/2 header limit too).
    pub limits: Limits,
    /// Draining on shutdown (the server).
    pub shutdown: ShutdownConfig,
    /// Protections of the admin API.
    pub admin: AdminConfig,
    /// Scrapes of the backends' engine metrics (the engine-metrics scraper).
    pub engine_metrics: EngineMetricsConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            host: String::new(),
            port: 3000,
            backends: Vec::new(),
            dns_refresh: Duration::from_secs(5),
            max_connections: Count::Auto,
            worker_threads: Count::Fixed(1),
            log_format: LogFormat::Text,
            state_log_interval: Duration::from_secs(30),
            access_log: false,
            decision_headers: false,
            strategy: StrategyConfig::default(),
            queue: QueueConfig::default(),
            latency: LatencyConfig::default(),
            retry: RetryConfig::default(),
            availability: AvailabilityConfig::default(),
            prefix_index: PrefixIndexConfig::default(),
            upstream: UpstreamConfig::default(),
            limits: Limits::default(),
            shutdown: ShutdownConfig::default(),
            admin: AdminConfig::default(),
            engine_metrics: EngineMetricsConfig::default(),
        }
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
    /// Certificates read from `upstream.tls_ca_file`.
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
    /// Client connections served at once: the configured number, or with `auto` (the default)
    /// what the open-file limit allows ([`process::connections_for_open_files`]; 4096 when the
    /// limit cannot be read).
    pub fn max_connections(&self) -> usize {
        self.config.max_connections.or_else(|| {
            process::open_file_limit().map_or(4096, process::connections_for_open_files)
        })
    }

    /// Threads serving requests: the configured number, or with `auto` one per CPU the process
    /// may use (its affinity mask and cgroup quota included).
    pub fn worker_threads(&self) -> usize {
        self.config
            .worker_threads
            .or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get))
    }

    /// Validates `config` and builds its strategy. Durations are checked when they are read from
    /// seconds ([`crate::forms`]); a `Config` built in code is taken as it is for them.
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
        crate::discovery::Discovery::new(entries, self.config.dns_refresh)
    }

    /// What the balancer is held to: its three sections as they are.
    pub fn tuning(&self) -> Tuning {
        let mut queue = self.config.queue.clone();
        for name in [
            &mut queue.deadline_header,
            &mut queue.priority_header,
            &mut queue.tenant_header,
        ] {
            name.make_ascii_lowercase();
        }
        Tuning {
            queue,
            latency: self.config.latency,
            availability: self.config.availability.clone(),
            prefix_index: self.config.prefix_index,
        }
    }

    /// A balancer with no backends, held to these settings and picking with their strategy.
    pub fn balancer(&self) -> Result<Arc<crate::balancer::Balancer>, crate::metrics::MetricsError> {
        crate::balancer::Balancer::new(self.tuning(), Arc::clone(&self.strategy))
    }

    /// The upstream client the `[upstream]` section calls for, with the certificates of its
    /// `tls_ca_file`, checking `dns+https` backends for the names in `tls_names`.
    pub fn upstream_client(
        &self,
        tls_names: crate::upstream::TlsNames,
    ) -> crate::upstream::UpstreamClient {
        crate::upstream::client(
            self.config.upstream.clone(),
            &self.extra_ca_certs,
            tls_names,
        )
    }

    /// The retry budget the `[retry.budget]` section calls for.
    pub fn retry_budget(&self) -> crate::retry_budget::RetryBudget {
        crate::retry_budget::RetryBudget::new(self.config.retry.budget)
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
    // A variable that is set but not UTF-8 would be skipped: an admin token, say, silently off.
    if let Some(var) = ENV_VARS.iter().find(|v| {
        matches!(
            std::env::var(v.name),
            Err(std::env::VarError::NotUnicode(_))
        )
    }) {
        return Err(ConfigError::new(var.name, "the value is not valid UTF-8"));
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

/// Keys whose value is text: their environment variables are taken as written (a token `007`
/// stays `007`, a host `[::1]` is not an array), not read as TOML-like values as the others are.
const TEXT_KEYS: &[&str] = &[
    "host",
    "strategy.name",
    "queue.deadline_header",
    "queue.priority_header",
    "queue.tenant_header",
    "availability.health_check_path",
    "upstream.tls_ca_file",
    "engine_metrics.path",
    "admin.token",
];

/// A number read from the environment in exponent form; its type's name tells an error's
/// location (the variable, not the file key).
#[derive(Serialize)]
#[serde(transparent)]
struct EnvironmentNumber(f64);

fn env_provider() -> impl figment::Provider {
    let names: Vec<String> = ENV_VARS
        .iter()
        .filter(|v| !TEXT_KEYS.contains(&v.key))
        .map(|v| v.name.to_ascii_lowercase())
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let parsed = Env::raw().only(&names).map(|name| {
        ENV_VARS
            .iter()
            .find(|v| v.name.eq_ignore_ascii_case(name.as_str()))
            .map_or_else(|| name.into(), |v| v.key.into())
    });
    let mut figment = Figment::from(parsed);
    // A number in exponent form (`1e3`) is read as the file reads it; figment's own reading of
    // the environment takes it for a string.
    for var in ENV_VARS.iter().filter(|v| !TEXT_KEYS.contains(&v.key)) {
        let Ok(value) = std::env::var(var.name) else {
            continue;
        };
        let value = value.trim();
        if value.contains(['e', 'E'])
            && value.starts_with(|c: char| c.is_ascii_digit() || c == '-' || c == '+' || c == '.')
        {
            if let Ok(number) = value.parse::<f64>() {
                figment = figment.merge(
                    figment::providers::Serialized::default(var.key, EnvironmentNumber(number))
                        .profile(figment::Profile::Default),
                );
            }
        }
    }
    for var in ENV_VARS.iter().filter(|v| TEXT_KEYS.contains(&v.key)) {
        if let Ok(value) = std::env::var(var.name) {
            figment = figment.merge(
                figment::providers::Serialized::default(var.key, value)
                    .profile(figment::Profile::Default),
            );
        }
    }
    figment
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

/// Whether `c` may appear in a header field name (an HTTP token).
fn is_token_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c)
}

/// Most runtime threads `worker_threads` may ask for: far past any CPU count the router runs
/// on, and low enough that the runtime can start them (a count the system cannot spawn would
/// fail at start, after the configuration was accepted).
const MAX_WORKER_THREADS: usize = 1024;

/// Most client connections `max_connections` may ask for: past what any open-file limit
/// allows, and within what the connection semaphore can count (a larger count would be
/// accepted and then fail at start).
const MAX_CONNECTIONS: usize = 1 << 20;

/// Most requests `queue.max_size` may hold.
const MAX_QUEUE_SIZE: usize = 1 << 24;

fn validate(config: &Config, locate: &dyn Fn(&str) -> String) -> Result<(), ConfigError> {
    let positive_counts = [
        ("queue.max_size", config.queue.max_size),
        ("retry.max_attempts", config.retry.max_attempts as usize),
        (
            "availability.consecutive_failures",
            config.availability.consecutive_failures as usize,
        ),
    ];
    for (key, value) in positive_counts {
        if value == 0 {
            return Err(ConfigError::new(
                locate(key),
                "expected a positive integer, found 0",
            ));
        }
    }
    if let Count::Fixed(threads) = config.worker_threads {
        if threads > MAX_WORKER_THREADS {
            return Err(ConfigError::new(
                locate("worker_threads"),
                format!(
                    "expected at most {MAX_WORKER_THREADS} threads or \"auto\", found {threads}"
                ),
            ));
        }
    }
    if let Count::Fixed(connections) = config.max_connections {
        if connections > MAX_CONNECTIONS {
            return Err(ConfigError::new(
                locate("max_connections"),
                format!(
                    "expected at most {MAX_CONNECTIONS} connections or \"auto\", found {connections}"
                ),
            ));
        }
    }
    // Twice the queue's size is counted in places: a size past this would overflow them.
    if config.queue.max_size > MAX_QUEUE_SIZE {
        return Err(ConfigError::new(
            locate("queue.max_size"),
            format!(
                "expected at most {MAX_QUEUE_SIZE} requests, found {}",
                config.queue.max_size
            ),
        ));
    }
    let percents = [
        ("retry.budget.percent", config.retry.budget.percent),
        (
            "availability.max_ejection_percent",
            config.availability.max_ejection_percent,
        ),
    ];
    for (key, value) in percents {
        if !(0.0..=100.0).contains(&value) {
            return Err(ConfigError::new(
                locate(key),
                format!("expected a percentage from 0 to 100, found {value}"),
            ));
        }
    }
    let shed_ratio = config.queue.shed_ratio;
    if !(shed_ratio.is_finite() && shed_ratio >= 0.0) {
        return Err(ConfigError::new(
            locate("queue.shed_ratio"),
            format!("expected zero (never shed) or a positive number, found {shed_ratio}"),
        ));
    }
    let headers = [
        ("queue.deadline_header", &config.queue.deadline_header),
        ("queue.priority_header", &config.queue.priority_header),
        ("queue.tenant_header", &config.queue.tenant_header),
    ];
    for (key, name) in headers {
        if let Some(bad) = name.chars().find(|&c| !is_token_char(c)) {
            return Err(ConfigError::new(
                locate(key),
                format!("expected a header name (or empty for none), found {name:?} with {bad:?}"),
            ));
        }
    }
    let min_per_second = config.retry.budget.min_per_second;
    if !(min_per_second.is_finite() && min_per_second >= 0.0) {
        return Err(ConfigError::new(
            locate("retry.budget.min_per_second"),
            format!("expected zero or a positive number, found {min_per_second}"),
        ));
    }
    if config.retry.body_limit > 64 * 1024 * 1024 {
        return Err(ConfigError::new(
            locate("retry.body_limit"),
            format!(
                "expected at most 67108864 bytes, found {}",
                config.retry.body_limit
            ),
        ));
    }
    if !(8 * 1024..=1024 * 1024).contains(&config.limits.max_header_bytes) {
        return Err(ConfigError::new(
            locate("limits.max_header_bytes"),
            format!(
                "expected 8192 to 1048576 bytes, found {}",
                config.limits.max_header_bytes
            ),
        ));
    }
    if let Some(path) = &config.availability.health_check_path {
        if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
            return Err(ConfigError::new(
                locate("availability.health_check_path"),
                format!("expected a path starting with '/', found {path:?}"),
            ));
        }
    }
    if let Some(token) = config.admin.token.as_deref() {
        // What a client can send after `Bearer ` (the header is read as visible ASCII, trimmed):
        // a token with a space, a line break or a non-ASCII character would refuse every call.
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::new(
                locate("admin.token"),
                "expected a non-empty token of visible ASCII characters (no spaces or line breaks)",
            ));
        }
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
    validate_engine_metrics(&config.engine_metrics, locate)?;
    let alpha = config.latency.ewma_alpha;
    if !(alpha > 0.0 && alpha <= 1.0) {
        return Err(ConfigError::new(
            locate("latency.ewma_alpha"),
            format!("expected a number in (0, 1], found {alpha}"),
        ));
    }
    Ok(())
}

fn validate_engine_metrics(
    engine: &EngineMetricsConfig,
    locate: &dyn Fn(&str) -> String,
) -> Result<(), ConfigError> {
    let interval = engine.interval;
    if !(EngineMetricsConfig::MIN_INTERVAL..=EngineMetricsConfig::MAX_INTERVAL).contains(&interval)
    {
        return Err(ConfigError::new(
            locate("engine_metrics.interval"),
            format!(
                "expected 0.1 to 10 seconds, found {}",
                interval.as_secs_f64()
            ),
        ));
    }
    if let Some(stale_after) = engine.stale_after {
        if stale_after < interval {
            return Err(ConfigError::new(
                locate("engine_metrics.stale_after"),
                format!(
                    "expected at least engine_metrics.interval ({} seconds), found {}",
                    interval.as_secs_f64(),
                    stale_after.as_secs_f64()
                ),
            ));
        }
    }
    let path = &engine.path;
    if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
        return Err(ConfigError::new(
            locate("engine_metrics.path"),
            format!("expected a path starting with '/', found {path:?}"),
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
    let Some(path) = &config.upstream.tls_ca_file else {
        return Ok(Vec::new());
    };
    let fail = |what: String| ConfigError::new(locate("upstream.tls_ca_file"), what);
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
        latency: config.latency,
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

/// The `--help` paragraph listing every environment variable with its key and default.
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
            "  {:<34} {} [{}, default: {}]\n",
            var.name, var.help, var.key, default
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

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> serde_json::Value {
        serde_json::to_value(Config::default()).unwrap()
    }

    fn value_at<'a>(value: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
        key.split('.')
            .try_fold(value, |value, part| value.get(part))
    }

    #[test]
    fn every_environment_variable_sets_a_key_of_the_configuration() {
        let defaults = defaults();
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
    fn every_moved_key_names_a_key_of_the_configuration_and_is_gone() {
        let defaults = defaults();
        for (old, new) in MOVED_KEYS {
            assert!(value_at(&defaults, new).is_some(), "{old} moved to {new}");
            assert!(defaults.get(old).is_none(), "{old} is still a key");
        }
    }

    #[test]
    fn the_defaults_read_back_as_they_were_written() {
        let figment = Figment::from(Serialized::defaults(Config::default()));
        let read: Config = figment.extract().unwrap();
        assert_eq!(read, Config::default());
    }
}
