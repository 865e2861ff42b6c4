//! The documentation tables match the code: every environment variable, exported metric,
//! registered strategy and strategy parameter is documented (the README's metric labels as in
//! docs/metrics.md), every source file has a row in the module map, and every example config
//! file is valid.

mod common;

use std::collections::BTreeMap;

use common::rendered_metrics;
use custom_router::config::{ENV_VARS, MOVED_KEYS};
use custom_router::strategies::REGISTRY;

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn every_environment_variable_is_documented() {
    let readme = read("README.md");
    let configuration = read("docs/configuration.md");
    let default_toml = read("config/default.toml");
    for var in ENV_VARS {
        assert!(
            readme.contains(&format!("`{}`", var.name)),
            "README lacks {}",
            var.name
        );
        assert!(
            configuration.contains(var.name),
            "docs/configuration.md lacks {}",
            var.name
        );
        assert!(
            configuration.contains(&format!("`{}`", var.key)),
            "docs/configuration.md lacks the key {}",
            var.key
        );
        let (section, key) = var.key.rsplit_once('.').unwrap_or(("", var.key));
        assert!(
            default_toml.contains(key),
            "config/default.toml lacks {key}"
        );
        assert!(
            section.is_empty() || default_toml.contains(&format!("[{section}]")),
            "config/default.toml lacks the section [{section}]"
        );
    }
}

#[test]
fn every_moved_key_is_in_the_table_of_the_flat_layout() {
    let configuration = read("docs/configuration.md");
    for (old, new) in MOVED_KEYS {
        assert!(
            configuration.contains(&format!("| `{old}` | `{new}` |")),
            "docs/configuration.md does not say that {old} moved to {new}"
        );
    }
}

#[test]
fn every_exported_metric_is_documented() {
    let text = rendered_metrics();
    let names: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_whitespace().next())
        .collect();
    assert!(names.len() >= 13, "{names:?}");
    let readme = read("README.md");
    let metrics = read("docs/metrics.md");
    for name in names {
        assert!(readme.contains(&format!("`{name}`")), "README lacks {name}");
        assert!(
            metrics.contains(&format!("`{name}`")),
            "docs/metrics.md lacks {name}"
        );
    }
}

/// Each metric's labels column in a markdown table (`| \`name\` | type | labels | ... |`).
fn metric_labels(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let name = cells
                .get(1)?
                .strip_prefix("`custom_router_")?
                .strip_suffix('`')?;
            Some((name.to_owned(), cells.get(3)?.to_string()))
        })
        .collect()
}

#[test]
fn the_readme_and_the_metrics_reference_give_each_metric_the_same_labels() {
    let readme = metric_labels(&read("README.md"));
    let reference = metric_labels(&read("docs/metrics.md"));
    assert!(readme.len() >= 20, "{readme:?}");
    assert_eq!(readme, reference);
}

#[test]
fn every_strategy_is_documented_with_an_example_config() {
    let readme = read("README.md");
    let strategies = read("docs/strategies.md");
    for entry in REGISTRY {
        let name = entry.name;
        assert!(readme.contains(&format!("`{name}`")), "README lacks {name}");
        assert!(
            strategies.contains(&format!("## {name}")),
            "docs/strategies.md lacks a {name} section"
        );
        let example = read(&format!("config/{name}.toml"));
        assert!(
            example.contains(&format!("name = \"{name}\"")),
            "config/{name}.toml selects another strategy"
        );
    }
}

/// A strategy's parameters, as its factory names them when refusing an unknown one (every
/// factory reads its table with `deny_unknown_fields`).
fn parameters_of(entry: &custom_router::strategies::StrategyEntry) -> Vec<String> {
    let mut table = figment::value::Dict::new();
    table.insert("not_a_parameter".into(), figment::value::Value::from(1));
    let context = custom_router::strategies::StrategyContext::default();
    let Err(error) = (entry.build)(&context, &figment::value::Value::from(table)) else {
        panic!("{} accepts an unknown parameter", entry.name);
    };
    let (_, expected) = error
        .message
        .split_once("expected")
        .unwrap_or_else(|| panic!("{}: {}", entry.name, error.message));
    // "expected `one of `a`, `b``", or "expected `none`" for a strategy without parameters.
    expected
        .split('`')
        .filter(|name| {
            !name.is_empty()
                && *name != "none"
                && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_strategy_parameter_is_in_both_parameter_tables() {
    let readme = read("README.md");
    let configuration = read("docs/configuration.md");
    let mut documented = 0;
    for entry in REGISTRY {
        for parameter in parameters_of(entry) {
            let row = format!("| `{}` | `{parameter}` |", entry.name);
            assert!(readme.contains(&row), "README lacks the row {row}");
            assert!(
                configuration.contains(&row),
                "docs/configuration.md lacks the row {row}"
            );
            documented += 1;
        }
    }
    // queued-least-latency 7, p2c-peak-ewma 3, affinity 5, round-robin none.
    assert_eq!(documented, 15);
}

#[test]
fn every_example_config_is_valid() {
    let dir = format!("{}/config", env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let output = common::router_command(&[])
                .arg("--config")
                .arg(&path)
                .arg("--check-config")
                .output()
                .unwrap();
            assert!(
                output.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&output.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 3);
}

#[test]
fn every_method_of_the_strategy_trait_is_documented() {
    let contract = read("src/strategy.rs");
    let guide = read("docs/adding-a-strategy.md");
    let start = contract
        .find("pub trait Strategy")
        .expect("src/strategy.rs declares `pub trait Strategy`");
    let body = &contract[start..];
    // The trait ends at the first line that is a lone closing brace.
    let end = body.find("\n}").expect("the trait's closing brace");
    let names: Vec<&str> = body[..end]
        .split("fn ")
        .skip(1)
        .filter_map(|rest| rest.split(['(', '<']).next())
        .map(str::trim)
        .collect();
    assert!(names.len() >= 6, "{names:?}");
    for name in names {
        assert!(
            guide.contains(&format!("`{name}")) || guide.contains(&format!("fn {name}")),
            "docs/adding-a-strategy.md lacks Strategy::{name}"
        );
    }
}

#[test]
fn every_source_file_has_a_row_in_the_module_map() {
    let architecture = read("docs/architecture.md");
    let map = architecture
        .split("## Module map")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/architecture.md has a module map");
    let mut files = Vec::new();
    let mut folders = vec!["src".to_owned(), "strategies".to_owned()];
    while let Some(folder) = folders.pop() {
        let dir = format!("{}/{folder}", env!("CARGO_MANIFEST_DIR"));
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir}: {e}")) {
            let entry = entry.unwrap();
            let name = format!("{folder}/{}", entry.file_name().to_string_lossy());
            if entry.file_type().unwrap().is_dir() {
                folders.push(name);
            } else if name.ends_with(".rs") {
                files.push(name);
            }
        }
    }
    assert!(files.len() > 30, "found only {files:?}");
    let missing: Vec<_> = files
        .iter()
        .filter(|file| !map.contains(&format!("| `{file}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "no row in docs/architecture.md's module map for {missing:?}"
    );
}
