//! The Grafana dashboard (`docs/grafana/custom-router.json`) matches the metrics the router
//! exports: every metric a panel queries is exported, and every exported family has a panel.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::rendered_metrics;
use serde_json::Value;

const DASHBOARD: &str = "docs/grafana/custom-router.json";

fn dashboard() -> Value {
    let path = format!("{}/{DASHBOARD}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"))
}

/// Every exported metric family with its type (`counter`, `gauge`, `histogram`), rendered as
/// `tests/docs.rs` does: one backend with a latency sample, one sample in each histogram.
fn exported_families() -> BTreeMap<String, String> {
    let text = rendered_metrics();
    let families: BTreeMap<String, String> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| {
            let mut words = rest.split_whitespace();
            Some((words.next()?.to_owned(), words.next()?.to_owned()))
        })
        .collect();
    assert!(families.len() >= 13, "{families:?}");
    families
}

/// Every panel, those nested in collapsed rows included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for panel in list.as_array().into_iter().flatten() {
            out.push(panel);
            if let Some(nested) = panel.get("panels") {
                walk(nested, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// PromQL aggregation operators: they may be followed by `by (...)` rather than `(`.
const AGGREGATIONS: [&str; 14] = [
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];

/// Keywords whose parenthesised list holds label names.
const LABEL_LISTS: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// Other keywords that are not metric names.
const KEYWORDS: [&str; 7] = ["bool", "and", "or", "unless", "offset", "atan2", "inf"];

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// The index just after the closing `close` matching the `open` at `start`, skipping strings.
fn skip_group(chars: &[char], start: usize, open: char, close: char) -> usize {
    let mut depth = 0;
    let mut i = start;
    while i < chars.len() {
        match chars[i] {
            '"' | '\'' | '`' => i = skip_string(chars, i) - 1,
            c if c == open => depth += 1,
            c if c == close => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    chars.len()
}

/// The index just after the string literal starting at `start`.
fn skip_string(chars: &[char], start: usize) -> usize {
    let quote = chars[start];
    let mut i = start + 1;
    while i < chars.len() {
        match chars[i] {
            '\\' if quote != '`' => i += 1,
            c if c == quote => return i + 1,
            _ => {}
        }
        i += 1;
    }
    chars.len()
}

/// The metric names a PromQL expression selects: identifiers that are not functions,
/// aggregation operators or keywords, outside label matchers `{...}`, range selectors `[...]`,
/// label lists `by (...)` and strings; Grafana variables (`$name`, `${name}`) are skipped.
fn metric_names(expr: &str) -> Vec<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&chars, i);
        } else if c == '{' {
            i = skip_group(&chars, i, '{', '}');
        } else if c == '[' {
            i = skip_group(&chars, i, '[', ']');
        } else if c == '$' {
            i += 1;
            if chars.get(i) == Some(&'{') {
                i = skip_group(&chars, i, '{', '}');
            }
            while i < chars.len() && is_name_char(chars[i]) {
                i += 1;
            }
        } else if c.is_ascii_digit() || c == '.' {
            // A number or a duration such as 1.5e3 or 5m.
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if is_name_start(c) {
            let start = i;
            while i < chars.len() && is_name_char(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let call = chars.get(next) == Some(&'(');
            let lower = word.to_ascii_lowercase();
            if LABEL_LISTS.contains(&lower.as_str()) {
                if call {
                    i = skip_group(&chars, next, '(', ')');
                }
            } else if call
                || AGGREGATIONS.contains(&lower.as_str())
                || KEYWORDS.contains(&lower.as_str())
            {
                // A function, an aggregation operator or a keyword.
            } else {
                names.push(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The exported family a queried name belongs to: the name itself, or a histogram's family
/// for its `_bucket`, `_sum` and `_count` series.
fn family_of(name: &str, families: &BTreeMap<String, String>) -> Option<String> {
    if families.contains_key(name) {
        return Some(name.to_owned());
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
        let base = name.strip_suffix(suffix)?;
        (families.get(base).map(String::as_str) == Some("histogram")).then(|| base.to_owned())
    })
}

#[test]
fn the_expression_parser_finds_metric_names_only() {
    assert_eq!(
        metric_names(
            r#"histogram_quantile(0.99, sum by (le, addr) (rate(a_seconds_bucket{instance=~"$instance", x="}"}[$__rate_interval])))"#
        ),
        ["a_seconds_bucket"]
    );
    assert_eq!(
        metric_names(
            "sum(rate(x_total[5m])) by (kind) / on (kind) group_left sum without (addr) (y)"
        ),
        ["x_total", "y"]
    );
    assert_eq!(
        metric_names("max by (addr) (up offset 1h) > bool 0 and count(z) or ${var}"),
        ["up", "z"]
    );
    let families = BTreeMap::from([
        ("h_seconds".to_owned(), "histogram".to_owned()),
        ("c_total".to_owned(), "counter".to_owned()),
    ]);
    assert_eq!(
        family_of("h_seconds_bucket", &families).as_deref(),
        Some("h_seconds")
    );
    assert_eq!(family_of("c_total", &families).as_deref(), Some("c_total"));
    assert_eq!(family_of("c_total_count", &families), None);
    assert_eq!(family_of("unknown", &families), None);
}

#[test]
fn the_dashboard_is_importable() {
    let dashboard = dashboard();
    assert!(
        dashboard["schemaVersion"].as_u64().unwrap_or(0) >= 36,
        "schemaVersion {}",
        dashboard["schemaVersion"]
    );
    let inputs = dashboard["__inputs"].as_array().expect("__inputs");
    assert!(
        inputs
            .iter()
            .any(|i| i["name"] == "DS_PROMETHEUS" && i["pluginId"] == "prometheus"),
        "no DS_PROMETHEUS datasource input: {inputs:?}"
    );
    let mut ids = BTreeSet::new();
    for panel in panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or("?");
        assert!(ids.insert(panel["id"].as_u64()), "{title}: duplicate id");
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(
            panel["datasource"]["uid"], "${DS_PROMETHEUS}",
            "{title}: datasource"
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no targets");
        for target in targets {
            assert_eq!(
                target["datasource"]["uid"], "${DS_PROMETHEUS}",
                "{title}: target datasource"
            );
        }
    }
}

#[test]
fn every_panel_metric_is_exported_and_every_exported_family_has_a_panel() {
    let families = exported_families();
    let dashboard = dashboard();
    let mut shown = BTreeSet::new();
    for panel in panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or("?");
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("{title}: a target without expr"));
            let names = metric_names(expr);
            assert!(!names.is_empty(), "{title}: no metric in {expr}");
            for name in names {
                let family = family_of(&name, &families).unwrap_or_else(|| {
                    panic!("{title}: {name} is not exported by the router (in {expr})")
                });
                shown.insert(family);
            }
        }
    }
    let missing: Vec<&String> = families.keys().filter(|f| !shown.contains(*f)).collect();
    assert!(missing.is_empty(), "no panel shows {missing:?}");
}
