//! The `--help` text after the flags: every environment variable of [`ENV_VARS`] with its key
//! and default (read from [`Config::default`]), then the registered strategies.

use super::Config;
use super::env::{CONFIG_FILE_ENV, ENV_VARS};
use crate::strategies;

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

/// Everything `--help` prints after the flags: [`env_help`], then each registered strategy
/// with its summary.
pub fn after_help() -> String {
    let strategies: Vec<String> = strategies::REGISTRY
        .iter()
        .map(|entry| format!("  {:<34} {}", entry.name, entry.summary))
        .collect();
    format!(
        "{}\nStrategies (CUSTOM_ROUTER_STRATEGY or [strategy] name):\n{}\n",
        env_help(),
        strategies.join("\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variable_has_its_line_with_key_and_default() {
        let help = env_help();
        for var in ENV_VARS {
            let line = help
                .lines()
                .find(|line| line.trim_start().starts_with(&format!("{} ", var.name)))
                .unwrap_or_else(|| panic!("--help lacks {}", var.name));
            assert!(line.contains(var.help), "{line}");
            assert!(line.contains(&format!("[{}, default: ", var.key)), "{line}");
        }
        assert!(help.contains("CUSTOM_ROUTER_QUEUE_TIMEOUT"));
        assert!(help.contains("[queue.timeout, default: 1200.0]"), "{help}");
    }

    #[test]
    fn the_strategies_follow_the_variables() {
        let help = after_help();
        let strategies = help.find("Strategies (").unwrap();
        assert!(help.find("RUST_LOG").unwrap() < strategies);
        for entry in strategies::REGISTRY {
            assert!(help[strategies..].contains(entry.name), "{}", entry.name);
        }
    }
}
