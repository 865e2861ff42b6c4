//! The top-level keys, the listener's and the process's (read by the server and the binary, not
//! by a component below the edges), with their checks, and the `[shutdown]` section
//! ([`ShutdownConfig`]), how the server drains.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Config;
use crate::forms::{Count, Invalid};

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
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

/// Most runtime threads `worker_threads` may ask for: far past any CPU count the router runs
/// on, and low enough that the runtime can start them (a count the system cannot spawn would
/// fail at start, after the configuration was accepted).
const MAX_WORKER_THREADS: usize = 1024;

/// Most client connections `max_connections` may ask for: past what any open-file limit
/// allows, and within what the connection semaphore can count (a larger count would be
/// accepted and then fail at start).
const MAX_CONNECTIONS: usize = 1 << 20;

/// Checks the top-level keys the types leave open: `worker_threads` and `max_connections`
/// within what the process can start, every `backends` entry an address or a `dns://` name,
/// `host` empty or an IP address.
pub(super) fn check(config: &Config) -> Result<(), Invalid> {
    if let Count::Fixed(threads) = config.worker_threads {
        if threads > MAX_WORKER_THREADS {
            return Err(Invalid::new(
                "worker_threads",
                format!(
                    "expected at most {MAX_WORKER_THREADS} threads or \"auto\", found {threads}"
                ),
            ));
        }
    }
    if let Count::Fixed(connections) = config.max_connections {
        if connections > MAX_CONNECTIONS {
            return Err(Invalid::new(
                "max_connections",
                format!(
                    "expected at most {MAX_CONNECTIONS} connections or \"auto\", found {connections}"
                ),
            ));
        }
    }
    crate::discovery::parse_entries(&config.backends)
        .map_err(|message| Invalid::new("backends", message))?;
    if !config.host.is_empty() && listen_ip(&config.host).is_none() {
        return Err(Invalid::new(
            "host",
            format!(
                "expected an IP address such as 0.0.0.0, :: or 127.0.0.1 (empty for all interfaces), found {:?}",
                config.host
            ),
        ));
    }
    Ok(())
}

/// The IP address of a `host` setting (IPv6 may be bracketed).
pub(super) fn listen_ip(host: &str) -> Option<std::net::IpAddr> {
    let host = host.trim();
    let bare = host
        .strip_prefix('[')
        .and_then(|rest| rest.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_an_ip_address_bracketed_or_not() {
        assert_eq!(listen_ip("127.0.0.1"), Some([127, 0, 0, 1].into()));
        assert_eq!(
            listen_ip(" [::1] "),
            Some(std::net::Ipv6Addr::LOCALHOST.into())
        );
        assert_eq!(listen_ip("localhost"), None);
    }

    #[test]
    fn counts_past_what_the_process_can_start_are_refused() {
        let config = Config {
            worker_threads: Count::Fixed(MAX_WORKER_THREADS + 1),
            ..Config::default()
        };
        assert_eq!(check(&config).unwrap_err().key, "worker_threads");
        let config = Config {
            max_connections: Count::Fixed(MAX_CONNECTIONS + 1),
            ..Config::default()
        };
        assert_eq!(check(&config).unwrap_err().key, "max_connections");
    }
}
