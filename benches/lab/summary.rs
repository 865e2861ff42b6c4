//! Turning one run's records into numbers.
//!
//! Latency and time-to-first-byte percentiles are over successful requests only (a 2xx answer
//! received in full); failures are counted in `error_pct`, answers 429 and 503 also in
//! `refused_pct`. The SLO goodput counts only the successful requests that met the scenario's
//! [`Slo`], so refusing requests cannot pass for a latency win. A scenario with traffic classes
//! also has each class's numbers, keyed `<stem>.<class>` ([`summarize_classes`]).
#![allow(dead_code)]

use std::collections::BTreeMap;

use serde::Serialize;

use super::load::Record;
/// Named numbers of one peer (keys such as `latency_p99_s`, `share_pct.r1`).
pub type Metrics = BTreeMap<String, f64>;

/// The value below which a fraction `q` of `sorted` lies (nearest rank); `None` when empty.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The median of `values` (mean of the middle two for an even count); `None` when empty.
pub fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    Some(if values.len() % 2 == 0 {
        (values[middle - 1] + values[middle]) / 2.0
    } else {
        values[middle]
    })
}

/// The bounds a request must finish within to count in the SLO goodput.
///
/// A streamed request meets it when its first token came within `ttft_seconds +
/// ttft_seconds_per_prompt_token × prompt tokens` and its whole answer within that plus
/// `tpot_seconds` per token asked for; a whole (non-streamed) answer has only the second bound.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    /// Seconds to the first token.
    pub ttft_seconds: f64,
    /// Seconds to the first token allowed per prompt token, on top.
    pub ttft_seconds_per_prompt_token: f64,
    /// Seconds per output token after the first, on average.
    pub tpot_seconds: f64,
}

impl Slo {
    /// The time to first token allowed for `record`.
    pub fn ttft_bound(&self, record: &Record) -> f64 {
        self.ttft_seconds + self.ttft_seconds_per_prompt_token * record.prompt_tokens as f64
    }

    /// The end-to-end time allowed for `record`.
    pub fn latency_bound(&self, record: &Record) -> f64 {
        self.ttft_bound(record) + self.tpot_seconds * f64::from(record.max_tokens)
    }

    /// Whether `record` succeeded within the bounds.
    pub fn is_met(&self, record: &Record) -> bool {
        record.is_success()
            && (!record.stream || record.ttfb <= self.ttft_bound(record))
            && record.latency <= self.latency_bound(record)
    }

    /// Every bound divided by `compression` (a scenario run faster than real time).
    pub fn scaled(&self, compression: f64) -> Self {
        Self {
            ttft_seconds: self.ttft_seconds / compression,
            ttft_seconds_per_prompt_token: self.ttft_seconds_per_prompt_token / compression,
            tpot_seconds: self.tpot_seconds / compression,
        }
    }

    /// For example `TTFT ≤ 2 s, end to end ≤ that + 100 ms × tokens asked for`.
    pub fn describe(&self) -> String {
        let per_prompt_token = if self.ttft_seconds_per_prompt_token > 0.0 {
            format!(
                " + {} ms × prompt tokens",
                trim(self.ttft_seconds_per_prompt_token * 1e3)
            )
        } else {
            String::new()
        };
        format!(
            "TTFT ≤ {} s{per_prompt_token}, end to end ≤ that + {} ms × tokens asked for",
            trim(self.ttft_seconds),
            trim(self.tpot_seconds * 1e3)
        )
    }
}

/// A number without trailing zeros (`0.5`, `2`, `0.1`).
fn trim(value: f64) -> String {
    let text = format!("{value:.4}");
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// The numbers of one run: request count, latency and TTFB percentiles, goodput (all and within
/// `slo`), error and refusal shares and the share of answers per replica.
pub fn summarize(records: &[Record], replicas: &[String], slo: &Slo) -> Metrics {
    let mut metrics = Metrics::new();
    metrics.insert("requests".to_owned(), records.len() as f64);
    let successes: Vec<&Record> = records.iter().filter(|r| r.is_success()).collect();
    let mut latencies: Vec<f64> = successes.iter().map(|r| r.latency).collect();
    let mut ttfbs: Vec<f64> = successes.iter().map(|r| r.ttfb).collect();
    latencies.sort_by(f64::total_cmp);
    ttfbs.sort_by(f64::total_cmp);
    for (name, q) in [("p50", 0.50), ("p90", 0.90), ("p99", 0.99)] {
        if let Some(value) = percentile(&latencies, q) {
            metrics.insert(format!("latency_{name}_s"), value);
        }
    }
    for (name, q) in [("p50", 0.50), ("p99", 0.99)] {
        if let Some(value) = percentile(&ttfbs, q) {
            metrics.insert(format!("ttfb_{name}_s"), value);
        }
    }
    let span = span_seconds(records);
    metrics.insert("goodput_rps".to_owned(), successes.len() as f64 / span);
    let within_slo = successes.iter().filter(|r| slo.is_met(r)).count();
    metrics.insert("slo_goodput_rps".to_owned(), within_slo as f64 / span);
    metrics.insert("slo_pct".to_owned(), percent(within_slo, records.len()));
    let failures = records.len() - successes.len();
    metrics.insert("error_pct".to_owned(), percent(failures, records.len()));
    let refused = records
        .iter()
        .filter(|r| matches!(r.status, 429 | 503))
        .count();
    metrics.insert("refused_pct".to_owned(), percent(refused, records.len()));
    add_shares(&mut metrics, records, replicas);
    metrics
}

/// The per-class stems of [`summarize_classes`]: each number is `<stem>.<class>`.
pub const CLASS_STEMS: [&str; 6] = [
    "requests",
    "latency_p50_s",
    "latency_p99_s",
    "ttfb_p99_s",
    "slo_pct",
    "refused_pct",
];

/// The numbers of each class of a run, keyed `<stem>.<class>` (see [`CLASS_STEMS`]): requests,
/// latency p50 and p99 and TTFB p99 over the class's successful requests, the share of its
/// requests that met `slo`, and the share refused (answered 429 or 503, by the proxy or a
/// replica, as `refused_pct`). `class_of` names a record's class; records of no class in
/// `classes` are left out. A class without requests has only `requests.<class>` (0), a class
/// without successes no percentiles.
pub fn summarize_classes(
    records: &[Record],
    classes: &[String],
    class_of: impl Fn(&Record) -> Option<&'static str>,
    slo: &Slo,
) -> Metrics {
    let mut metrics = Metrics::new();
    for class in classes {
        let of_class: Vec<&Record> = records
            .iter()
            .filter(|r| class_of(r) == Some(class.as_str()))
            .collect();
        metrics.insert(format!("requests.{class}"), of_class.len() as f64);
        if of_class.is_empty() {
            continue;
        }
        let successes: Vec<&Record> = of_class
            .iter()
            .copied()
            .filter(|r| r.is_success())
            .collect();
        let mut latencies: Vec<f64> = successes.iter().map(|r| r.latency).collect();
        let mut ttfbs: Vec<f64> = successes.iter().map(|r| r.ttfb).collect();
        latencies.sort_by(f64::total_cmp);
        ttfbs.sort_by(f64::total_cmp);
        for (key, sorted, q) in [
            ("latency_p50_s", &latencies, 0.50),
            ("latency_p99_s", &latencies, 0.99),
            ("ttfb_p99_s", &ttfbs, 0.99),
        ] {
            if let Some(value) = percentile(sorted, q) {
                metrics.insert(format!("{key}.{class}"), value);
            }
        }
        let within_slo = successes.iter().filter(|r| slo.is_met(r)).count();
        metrics.insert(
            format!("slo_pct.{class}"),
            percent(within_slo, of_class.len()),
        );
        let refused = of_class
            .iter()
            .filter(|r| matches!(r.status, 429 | 503))
            .count();
        metrics.insert(
            format!("refused_pct.{class}"),
            percent(refused, of_class.len()),
        );
    }
    metrics
}

/// Seconds from the first request sent to the last one finished (at least 1 ms).
fn span_seconds(records: &[Record]) -> f64 {
    let first = records
        .iter()
        .map(|r| r.sent_at)
        .fold(f64::INFINITY, f64::min);
    let last = records
        .iter()
        .map(|r| r.sent_at + r.latency)
        .fold(0.0, f64::max);
    (last - first).max(0.001)
}

fn add_shares(metrics: &mut Metrics, records: &[Record], replicas: &[String]) {
    let answered = records.iter().filter(|r| r.replica.is_some()).count();
    for name in replicas {
        let count = records
            .iter()
            .filter(|r| r.replica.as_deref() == Some(name))
            .count();
        metrics.insert(format!("share_pct.{name}"), percent(count, answered));
    }
}

fn percent(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}
