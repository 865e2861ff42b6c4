//! The `[strategy]` section ([`StrategyConfig`]): which registered strategy routes, and its own
//! `[strategy.params]`, which the strategy's factory checks strictly when `build` builds it.

use std::path::Path;
use std::sync::Arc;

use figment::value::{Dict, Value};
use serde::{Deserialize, Serialize};

use super::{Config, ConfigError, env};
use crate::strategies::{self, Strategy, StrategyContext};

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

/// Builds the strategy `config` names, with its parameters and the `[latency]` section; an
/// unknown name or a parameter its factory refuses is an error naming the key.
pub(super) fn build(
    config: &Config,
    file: Option<&Path>,
) -> Result<Arc<dyn Strategy>, ConfigError> {
    let Some(entry) = strategies::find(&config.strategy.name) else {
        return Err(ConfigError::new(
            env::key_location("strategy.name", file),
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
