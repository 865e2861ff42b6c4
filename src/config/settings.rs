//! [`Settings`]: a configuration that passed every check, with its strategy built and its CA
//! certificates read, and what each component is handed from it (the balancer's [`Tuning`], the
//! upstream client, the retry budget, the configured backends, the process's counts).

use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use super::{Config, ConfigError, env, listener, strategy};
use crate::balancer::Tuning;
use crate::process;
use crate::strategies::Strategy;

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

    /// Checks `config` and builds its strategy. Durations are checked when they are read from
    /// seconds ([`crate::forms`]); a `Config` built in code is taken as it is for them.
    pub fn from_config(config: Config) -> Result<Self, ConfigError> {
        Self::build(config, None)
    }

    /// Checks `config` ([`Config::check`]), builds its strategy and reads its CA file; an error
    /// names the variable the value came from, else the key in `file`.
    pub(super) fn build(config: Config, file: Option<PathBuf>) -> Result<Self, ConfigError> {
        let locate = |key: &str| env::key_location(key, file.as_deref());
        config
            .check()
            .map_err(|invalid| ConfigError::new(locate(&invalid.key), invalid.message))?;
        let strategy = strategy::build(&config, file.as_deref())?;
        let extra_ca_certs = read_ca_file(&config, &locate)?;
        Ok(Self {
            config,
            strategy,
            config_file: file,
            extra_ca_certs,
        })
    }

    /// The address to listen on: `None` for all interfaces (the `host` setting is empty).
    pub fn listen_ip(&self) -> Option<std::net::IpAddr> {
        listener::listen_ip(&self.config.host)
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

/// The certificates of `upstream.tls_ca_file` (none when unset): a readable PEM file with at least
/// one.
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
