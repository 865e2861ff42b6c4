//! Configuration: built-in defaults < TOML file < environment variables.
//!
//! [`Config`] composes the settings in sections, each one the settings struct of the component it
//! configures, defined in that component with its defaults and its own `check` of the ranges its
//! types leave open: `[queue]` ([`QueueConfig`]), `[latency]` ([`LatencyConfig`]),
//! `[availability]` ([`AvailabilityConfig`]), `[prefix_index]` ([`PrefixIndexConfig`]), `[retry]`
//! ([`RetryConfig`], with `[retry.budget]`), `[upstream]` ([`UpstreamConfig`]), `[limits]`
//! ([`Limits`]), `[admin]` ([`AdminConfig`]), `[engine_metrics]` ([`EngineMetricsConfig`]), plus
//! `[shutdown]` ([`ShutdownConfig`]) and the strategy's `[strategy]` ([`StrategyConfig`]); the
//! listener and process settings are top-level keys ([`listener`]). Each section is handed to its
//! component as it is: durations are [`Duration`]s, read from seconds by [`crate::forms`], and no
//! number is copied into a second struct.
//!
//! [`load`] layers the sources with figment, extracts strictly (unknown keys in the file are
//! errors; a key of the old flat layout names the key it moved to, [`MOVED_KEYS`]), checks every
//! section ([`Config::check`]) and builds the selected strategy, so that every mistake is reported
//! before the router binds its port. Errors name the environment variable or the file key and
//! what was expected.
//!
//! The rooms:
//!
//! - this file: [`Config`], its layering ([`load`]) and the order its sections are checked in;
//! - [`settings`]: [`Settings`], a checked configuration with its strategy built, and what each
//!   component is handed from it;
//! - [`env`](mod@env): [`ENV_VARS`], the one table of environment variables, and the provider
//!   reading them; the `--help` text ([`help`]) is derived from the same table;
//! - [`listener`]: the top-level keys' own types and checks, and `[shutdown]`;
//! - [`strategy`]: `[strategy]` and building the strategy it names;
//! - [`error`]: [`ConfigError`], how figment's errors are told, [`MOVED_KEYS`].
//!
//! Adding a key: a field (with its default) in its section's struct, its range in that struct's
//! `check` when its type does not say it, a row in [`ENV_VARS`] if it has a variable, and its
//! docs: `docs/configuration.md` ("Adding a key" there), `config/default.toml`, the README.

use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

use crate::admin::AdminConfig;
use crate::balancer::{AvailabilityConfig, PrefixIndexConfig, QueueConfig};
use crate::engine_metrics::EngineMetricsConfig;
use crate::forms::{Count, Invalid};
use crate::h1::server::Limits;
use crate::proxy::RetryConfig;
use crate::strategy::LatencyConfig;
use crate::upstream::UpstreamConfig;

pub mod env;
pub mod error;
pub mod help;
pub mod listener;
pub mod settings;
pub mod strategy;

pub use env::{CONFIG_FILE_ENV, ENV_VARS, EnvForm, EnvVar};
pub use error::{ConfigError, MOVED_KEYS};
pub use help::{after_help, env_help};
pub use listener::{LogFormat, ShutdownConfig};
pub use settings::Settings;
pub use strategy::StrategyConfig;

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

impl Config {
    /// Checks the ranges the types leave open: the top-level keys, then each section by its own
    /// `check`, in the order of the file; the first failure is the error, its key dotted from
    /// the top. Durations were checked when they were read from seconds ([`crate::forms`]); the
    /// strategy's parameters are checked when it is built.
    pub fn check(&self) -> Result<(), Invalid> {
        listener::check(self)?;
        self.queue.check().map_err(|e| e.within("queue"))?;
        self.latency.check().map_err(|e| e.within("latency"))?;
        self.retry.check().map_err(|e| e.within("retry"))?;
        self.availability
            .check()
            .map_err(|e| e.within("availability"))?;
        self.limits.check().map_err(|e| e.within("limits"))?;
        self.admin.check().map_err(|e| e.within("admin"))?;
        self.engine_metrics
            .check()
            .map_err(|e| e.within("engine_metrics"))
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
    env::check_unicode()?;
    figment = figment.merge(env::provider());
    let config: Config = figment
        .extract()
        .map_err(|error| error::describe_figment_error(&error, file.as_deref()))?;
    Settings::build(config, file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_read_back_as_they_were_written() {
        let figment = Figment::from(Serialized::defaults(Config::default()));
        let read: Config = figment.extract().unwrap();
        assert_eq!(read, Config::default());
    }

    #[test]
    fn the_defaults_pass_every_check() {
        assert_eq!(Config::default().check(), Ok(()));
    }

    #[test]
    fn a_section_error_names_its_key_from_the_top() {
        let mut config = Config::default();
        config.retry.budget.percent = 101.0;
        let error = config.check().unwrap_err();
        assert_eq!(error.key, "retry.budget.percent");
        assert_eq!(
            error.message,
            "expected a percentage from 0 to 100, found 101"
        );
    }
}
