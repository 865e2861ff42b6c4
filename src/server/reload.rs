//! Reloading the configuration into a running router (`main.rs` does it on SIGHUP): a reload
//! hands the reloaded settings to new requests and connections, and keeps the keys read only at
//! start, all listed in one table ([`START_ONLY`]), at their running values, naming those it
//! changed.

use std::sync::{Arc, Mutex};

use crate::config::{Config, Settings};

use super::{Shared, policy_of};

/// Applies a reloaded configuration to a running router (see
/// [`Router::reloader`](super::Router::reloader)).
pub struct Reloader {
    /// What the router's connections and requests read their settings from.
    shared: Arc<Shared>,
    /// The configuration that runs: the last one applied, its keys read only at start kept at
    /// their values at start.
    running: Mutex<Settings>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader").finish_non_exhaustive()
    }
}

/// A key read only at start.
struct StartOnly {
    /// Its dotted name (a section standing for all its keys), as a reload names it.
    key: &'static str,
    /// Sets it in a reloaded configuration (the first) to its value in the running one.
    keep: fn(&mut Config, &Config),
}

/// The rows of [`START_ONLY`], each made from one field path of [`Config`]: its dotted name and
/// the assignment that keeps it cannot disagree.
macro_rules! start_only {
    ($($first:ident $(. $rest:ident)*),* $(,)?) => {
        &[$(StartOnly {
            key: concat!(stringify!($first) $(, ".", stringify!($rest))*),
            keep: |config, kept| config.$first$(.$rest)*.clone_from(&kept.$first$(.$rest)*),
        }),*]
    };
}

/// The keys read only at start, in the order a reload names them: a reload that changes one keeps
/// its running value and says it needs a restart.
const START_ONLY: &[StartOnly] = start_only![
    host,
    port,
    backends,
    dns_refresh,
    max_connections,
    worker_threads,
    log_format,
    state_log_interval,
    shutdown,
    retry.budget,
    engine_metrics,
];

/// The keys of [`START_ONLY`] whose values differ between two configurations.
fn start_only_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    let old = serde_json::to_value(old).unwrap_or_default();
    let new = serde_json::to_value(new).unwrap_or_default();
    START_ONLY
        .iter()
        .map(|start_only| start_only.key)
        .filter(|key| value_at(&old, key) != value_at(&new, key))
        .collect()
}

/// The value at a dotted `key` of a configuration as JSON (`None` if there is none).
fn value_at<'a>(config: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    key.split('.')
        .try_fold(config, |value, part| value.get(part))
}

impl Reloader {
    /// What applies reloaded configurations to the router that `shared` serves with, which runs
    /// `settings`.
    pub(super) fn new(shared: Arc<Shared>, settings: Settings) -> Self {
        Self {
            shared,
            running: Mutex::new(settings),
        }
    }

    /// Applies `settings` to new requests and connections: the strategy and its parameters, the
    /// queue, retry, ejection and timeout settings, limits, the admin token and networks, the
    /// access log and decision headers. Requests in flight keep what they started with. Keys
    /// read only at start (`START_ONLY`) are kept, and the changed ones named in the answer.
    pub fn apply(&self, settings: Settings) -> Vec<&'static str> {
        let mut running = self
            .running
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let needs_restart = start_only_changes(&running.config, &settings.config);
        // The strategy is built with the `[latency]` settings too (the reference rules' threshold).
        let strategy_changed = running.config.strategy != settings.config.strategy
            || running.config.latency != settings.config.latency;
        let strategy = strategy_changed.then(|| Arc::clone(&settings.strategy));
        self.shared
            .balancer
            .reconfigure(settings.tuning(), strategy);
        let names = self.shared.client.load().tls_names().clone();
        let client = Arc::new(settings.upstream_client(names));
        self.shared.client.store(Arc::clone(&client));
        let policy = policy_of(
            &settings,
            self.shared.traces.as_ref(),
            client,
            &self.shared.retry_budget,
        );
        self.shared.policy.store(Arc::new(policy));
        self.shared
            .admin
            .store(Arc::new(settings.config.admin.clone()));
        self.shared.limits.store(Arc::new(settings.config.limits));
        // What runs is what is kept: keys read only at start keep their running values, so a
        // later reload compares against them (and still names them) and the log shows them.
        let mut settings = settings;
        for start_only in START_ONLY {
            (start_only.keep)(&mut settings.config, &running.config);
        }
        *running = settings;
        needs_restart
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default configuration with every key of [`START_ONLY`] set otherwise, and one key a
    /// reload applies (`queue.timeout`).
    fn all_changed() -> Config {
        let mut config = serde_json::to_value(Config::default()).unwrap();
        let changes = serde_json::json!({
            "host": "127.0.0.1",
            "port": 1,
            "backends": ["127.0.0.1:9"],
            "dns_refresh": 1,
            "max_connections": 7,
            "worker_threads": 2,
            "log_format": "json",
            "state_log_interval": 7,
            "shutdown": { "timeout": 3 },
            "retry": { "budget": { "percent": 5.0 } },
            "engine_metrics": { "interval": 1 },
            "queue": { "timeout": 9 },
        });
        merge(&mut config, &changes);
        serde_json::from_value(config).unwrap()
    }

    /// Writes the leaves of `changes` into `into`.
    fn merge(into: &mut serde_json::Value, changes: &serde_json::Value) {
        match (into, changes) {
            (serde_json::Value::Object(into), serde_json::Value::Object(changes)) => {
                for (key, change) in changes {
                    merge(
                        into.entry(key.clone()).or_insert(serde_json::Value::Null),
                        change,
                    );
                }
            }
            (into, change) => *into = change.clone(),
        }
    }

    #[test]
    fn every_key_read_only_at_start_is_named_by_its_dotted_key_when_changed() {
        let keys: Vec<_> = START_ONLY.iter().map(|start_only| start_only.key).collect();
        assert_eq!(start_only_changes(&Config::default(), &all_changed()), keys);
        assert!(start_only_changes(&Config::default(), &Config::default()).is_empty());
    }

    #[test]
    fn keeping_the_keys_read_only_at_start_keeps_exactly_them() {
        let running = Config::default();
        let mut reloaded = all_changed();
        for start_only in START_ONLY {
            (start_only.keep)(&mut reloaded, &running);
        }
        assert!(start_only_changes(&running, &reloaded).is_empty());
        let kept = serde_json::to_value(&running).unwrap();
        let mut applied = serde_json::to_value(&reloaded).unwrap();
        assert_ne!(
            value_at(&kept, "queue.timeout"),
            value_at(&applied, "queue.timeout"),
            "a key a reload applies is not kept"
        );
        applied["queue"]["timeout"] = kept["queue"]["timeout"].clone();
        assert_eq!(applied, kept, "all else was read only at start, and kept");
    }
}
