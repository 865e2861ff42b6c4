//! Turning the numbers of every run into a report: medians over runs, markdown, JSON and SVG
//! plots. With several runs, every number is the median over the runs and the CDF plots pool the
//! latencies of all runs. The numbers of one run come from [`super::summary`].
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde::Serialize;

use super::scenarios::{Kind, PeerOutcome, Scenario};
use super::summary::{CLASS_STEMS, Metrics, Slo, median, percentile};
use super::{LabError, Mode};

/// The whole suite's results.
#[derive(Debug, Serialize)]
pub struct SuiteReport {
    /// `default`, `quick` or `smoke`.
    pub mode: String,
    /// How the suite was started.
    pub command: String,
    /// When (UTC).
    pub date_utc: String,
    /// The seed of each run.
    pub seeds: Vec<u64>,
    /// Where it ran.
    pub machine: Machine,
    /// One entry per scenario, in order.
    pub scenarios: Vec<ScenarioReport>,
}

/// The machine the suite ran on.
#[derive(Debug, Serialize)]
pub struct Machine {
    /// Logical CPUs available.
    pub cpus: usize,
    /// `/proc/cpuinfo` model name.
    pub cpu_model: String,
    /// `/proc/meminfo` MemTotal, GiB.
    pub memory_gib: f64,
    /// Kernel release.
    pub kernel: String,
    /// `nginx -v`, when nginx took part.
    pub nginx: Option<String>,
    /// The LLM routers' versions, when they took part.
    pub gateways: Option<String>,
}

/// One scenario's results.
#[derive(Debug, Serialize)]
pub struct ScenarioReport {
    /// Its name.
    pub name: String,
    /// What it models.
    pub models: String,
    /// Replicas, traffic and durations.
    pub setup: String,
    /// The replicas' capacity from the timing model, requests per second.
    pub capacity_rps: Option<f64>,
    /// The offered arrival rate.
    pub offered_rps: Option<f64>,
    /// Replica names (routing scenarios).
    pub replicas: Vec<String>,
    /// Overhead concurrencies (overhead scenario).
    pub concurrencies: Vec<usize>,
    /// Whether the overload columns apply.
    pub reports_overload: bool,
    /// The SLO of the SLO goodput (routing scenarios), as run.
    pub slo: Option<Slo>,
    /// The traffic classes with numbers of their own (`<stem>.<class>`, see
    /// [`summarize_classes`]), in report order; empty for a scenario without classes.
    pub classes: Vec<String>,
    /// What the classes are, one line.
    pub classes_about: String,
    /// One entry per peer, in order.
    pub peers: Vec<PeerReport>,
}

/// One peer's results in a scenario.
#[derive(Debug, Serialize)]
pub struct PeerReport {
    /// Strategy name, `nginx-…` or `direct`.
    pub peer: String,
    /// The median of each number over the runs.
    pub median: Metrics,
    /// Each run's numbers.
    pub runs: Vec<Metrics>,
    /// Runs that failed, and why.
    pub errors: Vec<String>,
    /// Latencies of every run (seconds), for the CDF.
    #[serde(skip)]
    pub latencies: Vec<f64>,
}

/// Combines the outcomes of every run of `scenario` into its report.
pub fn aggregate(
    scenario: &Scenario,
    mode: Mode,
    setup: String,
    runs: Vec<Vec<PeerOutcome>>,
) -> ScenarioReport {
    let mut peers: Vec<PeerReport> = Vec::new();
    for outcome in runs.into_iter().flatten() {
        let (name, result) = outcome;
        let index = match peers.iter().position(|p| p.peer == name) {
            Some(index) => index,
            None => {
                peers.push(PeerReport {
                    peer: name,
                    median: Metrics::new(),
                    runs: Vec::new(),
                    errors: Vec::new(),
                    latencies: Vec::new(),
                });
                peers.len() - 1
            }
        };
        let peer = &mut peers[index];
        match result {
            Ok(run) => {
                peer.runs.push(run.metrics);
                peer.latencies.extend(run.latencies);
            }
            Err(error) => peer.errors.push(error),
        }
    }
    for peer in &mut peers {
        peer.median = median_metrics(&peer.runs);
        peer.latencies.sort_by(f64::total_cmp);
    }
    let (capacity_rps, offered_rps, replicas, concurrencies, reports_overload) =
        match &scenario.kind {
            Kind::Routing(routing) => (
                routing.capacity_as_run(mode),
                routing.rate_as_run(mode),
                routing.replicas.iter().map(|r| r.name.clone()).collect(),
                Vec::new(),
                routing.reports_overload,
            ),
            Kind::Overhead(overhead) => (
                None,
                None,
                Vec::new(),
                overhead.concurrencies.clone(),
                false,
            ),
        };
    let slo = match &scenario.kind {
        Kind::Routing(routing) => Some(routing.slo.scaled(routing.time_compression(mode))),
        Kind::Overhead(_) => None,
    };
    let (classes, classes_about) = match &scenario.kind {
        Kind::Routing(routing) => (routing.class_names(), routing.describe_classes()),
        Kind::Overhead(_) => (Vec::new(), String::new()),
    };
    ScenarioReport {
        name: scenario.name.to_owned(),
        models: scenario.models.to_owned(),
        setup,
        capacity_rps,
        offered_rps,
        replicas,
        concurrencies,
        reports_overload,
        slo,
        classes,
        classes_about,
        peers,
    }
}

fn median_metrics(runs: &[Metrics]) -> Metrics {
    let mut values: BTreeMap<&String, Vec<f64>> = BTreeMap::new();
    for run in runs {
        for (key, value) in run {
            values.entry(key).or_default().push(*value);
        }
    }
    values
        .into_iter()
        .filter_map(|(key, mut list)| Some((key.clone(), median(&mut list)?)))
        .collect()
}

/// How a column's numbers are printed.
#[derive(Debug, Clone, Copy)]
enum Unit {
    Seconds,
    Micros,
    Rate,
    Percent,
    Count,
    Mebibytes,
    Ratio,
}

impl Unit {
    fn format(self, value: f64) -> String {
        match self {
            Unit::Seconds => format!("{value:.3}"),
            Unit::Micros | Unit::Count => format!("{value:.0}"),
            Unit::Rate | Unit::Percent | Unit::Mebibytes => format!("{value:.1}"),
            Unit::Ratio => format!("{value:.2}"),
        }
    }
}

/// One column of a table.
struct Column {
    header: String,
    key: String,
    unit: Unit,
}

fn column(header: impl Into<String>, key: impl Into<String>, unit: Unit) -> Column {
    Column {
        header: header.into(),
        key: key.into(),
        unit,
    }
}

fn routing_columns(scenario: &ScenarioReport) -> Vec<Column> {
    let mut columns = vec![
        column("requests", "requests", Unit::Count),
        column("p50 s", "latency_p50_s", Unit::Seconds),
        column("p90 s", "latency_p90_s", Unit::Seconds),
        column("p99 s", "latency_p99_s", Unit::Seconds),
        column("TTFB p50 s", "ttfb_p50_s", Unit::Seconds),
        column("TTFB p99 s", "ttfb_p99_s", Unit::Seconds),
        column("goodput req/s", "goodput_rps", Unit::Rate),
        column("SLO goodput req/s", "slo_goodput_rps", Unit::Rate),
        column("in SLO %", "slo_pct", Unit::Percent),
        column("errors %", "error_pct", Unit::Percent),
        column("refused %", "refused_pct", Unit::Percent),
    ];
    // Numbers only some scenarios have (an engine with a prefix cache, sampled batches).
    for (header, key, unit) in [
        ("prefix cache hit %", "prefix_hit_pct", Unit::Percent),
        ("batch mean", "engine_running_mean", Unit::Rate),
        ("batch max", "engine_running_max", Unit::Count),
        ("engine queue mean", "engine_waiting_mean", Unit::Rate),
        ("KV use mean %", "kv_usage_mean_pct", Unit::Percent),
    ] {
        if scenario.peers.iter().any(|p| p.median.contains_key(key)) {
            columns.push(column(header, key, unit));
        }
    }
    if scenario.reports_overload {
        columns.push(column(
            "fast 429/503 %",
            "fast_rejection_pct",
            Unit::Percent,
        ));
        columns.push(column("503 by proxy %", "proxy_503_pct", Unit::Percent));
        columns.push(column("429 by replica %", "replica_429_pct", Unit::Percent));
        columns.push(column(
            "goodput % of capacity",
            "goodput_pct_of_capacity",
            Unit::Percent,
        ));
    }
    columns
}

fn overhead_columns(scenario: &ScenarioReport) -> Vec<Column> {
    let mut columns = Vec::new();
    for c in &scenario.concurrencies {
        columns.push(column(
            format!("req/s c={c}"),
            format!("rps_c{c}"),
            Unit::Rate,
        ));
    }
    for c in &scenario.concurrencies {
        columns.push(column(
            format!("p50 µs c={c}"),
            format!("p50_us_c{c}"),
            Unit::Micros,
        ));
        columns.push(column(
            format!("added p50 µs c={c}"),
            format!("added_p50_us_c{c}"),
            Unit::Micros,
        ));
        columns.push(column(
            format!("added p99 µs c={c}"),
            format!("added_p99_us_c{c}"),
            Unit::Micros,
        ));
    }
    for c in &scenario.concurrencies {
        columns.push(column(
            format!("CPU µs/req c={c}"),
            format!("cpu_us_per_request_c{c}"),
            Unit::Micros,
        ));
    }
    let highest = scenario.concurrencies.iter().max().copied().unwrap_or(1);
    columns.push(column("RSS idle MiB", "rss_idle_mib", Unit::Mebibytes));
    columns.push(column(
        format!("RSS MiB c={highest}"),
        format!("rss_load_mib_c{highest}"),
        Unit::Mebibytes,
    ));
    columns.push(column(
        format!("req/s c={highest} ÷ nginx-rr"),
        format!("rps_c{highest}_vs_nginx"),
        Unit::Ratio,
    ));
    columns.push(column(
        format!("CPU/req c={highest} ÷ nginx-rr"),
        format!("cpu_us_per_request_c{highest}_vs_nginx"),
        Unit::Ratio,
    ));
    columns
}

/// The markdown of the whole report: a header and one section per scenario.
pub fn markdown(report: &SuiteReport) -> String {
    let machine = &report.machine;
    let mut text = String::new();
    let _ = writeln!(text, "# Benchmark results\n");
    let _ = writeln!(
        text,
        "- command: `{}`\n- date: {} UTC\n- mode: {}, seeds {:?} (numbers are medians over the runs)\n- machine: {} CPUs, {}, {:.1} GiB, Linux {}{}{}\n",
        report.command,
        report.date_utc,
        report.mode,
        report.seeds,
        machine.cpus,
        machine.cpu_model,
        machine.memory_gib,
        machine.kernel,
        machine
            .nginx
            .as_ref()
            .map(|v| format!(", peer {v}"))
            .unwrap_or_default(),
        machine
            .gateways
            .as_ref()
            .map(|v| format!(
                ", LLM routers {v} (with their defaults: both retry a failed request on another worker)"
            ))
            .unwrap_or_default(),
    );
    for scenario in &report.scenarios {
        text.push_str(&scenario_markdown(scenario));
    }
    text
}

/// One scenario's section: what it models, its set-up and its table.
pub fn scenario_markdown(scenario: &ScenarioReport) -> String {
    let mut text = String::new();
    let _ = writeln!(text, "## {}\n\n{}\n", scenario.name, scenario.models);
    let _ = write!(text, "Set-up: {}", scenario.setup);
    if let (Some(capacity), Some(offered)) = (scenario.capacity_rps, scenario.offered_rps) {
        let _ = write!(
            text,
            ". Model capacity {capacity:.1} req/s, offered {offered:.1} req/s"
        );
    }
    text.push_str(".\n\n");
    let routing = scenario.concurrencies.is_empty();
    let columns = if routing {
        routing_columns(scenario)
    } else {
        overhead_columns(scenario)
    };
    text.push_str(&table(scenario, &columns, routing));
    if !scenario.classes.is_empty() {
        text.push_str(&class_table(scenario));
    }
    for peer in &scenario.peers {
        for error in &peer.errors {
            let _ = writeln!(text, "\n{}: a run failed: {}", peer.peer, one_line(error));
        }
    }
    let _ = writeln!(text, "\n![{0} latency CDF]({0}.svg)\n", scenario.name);
    text
}

fn table(scenario: &ScenarioReport, columns: &[Column], with_shares: bool) -> String {
    let mut header = vec!["peer".to_owned()];
    header.extend(columns.iter().map(|c| c.header.clone()));
    if with_shares {
        header.push(format!("share % ({})", scenario.replicas.join(" / ")));
    }
    let mut text = format!("| {} |\n", header.join(" | "));
    let _ = writeln!(text, "|{}", "---|".repeat(header.len()));
    for peer in &scenario.peers {
        let mut cells = vec![peer.peer.clone()];
        cells.extend(columns.iter().map(|c| {
            peer.median
                .get(&c.key)
                .map_or_else(|| "–".to_owned(), |v| c.unit.format(*v))
        }));
        if with_shares {
            cells.push(shares(peer, &scenario.replicas));
        }
        let _ = writeln!(text, "| {} |", cells.join(" | "));
    }
    text
}

/// The numbers of each class, one row per peer and class.
fn class_table(scenario: &ScenarioReport) -> String {
    let columns = [
        ("requests", Unit::Count),
        ("p50 s", Unit::Seconds),
        ("p99 s", Unit::Seconds),
        ("TTFB p99 s", Unit::Seconds),
        ("in SLO %", Unit::Percent),
        ("refused %", Unit::Percent),
    ];
    let mut text = format!("\nPer class: {}.\n\n", scenario.classes_about);
    let headers: Vec<&str> = columns.iter().map(|(header, _)| *header).collect();
    let _ = writeln!(text, "| peer | class | {} |", headers.join(" | "));
    let _ = writeln!(text, "|{}", "---|".repeat(columns.len() + 2));
    for peer in &scenario.peers {
        for class in &scenario.classes {
            let mut cells = vec![peer.peer.clone(), class.clone()];
            cells.extend(CLASS_STEMS.iter().zip(columns).map(|(stem, (_, unit))| {
                peer.median
                    .get(&format!("{stem}.{class}"))
                    .map_or_else(|| "–".to_owned(), |v| unit.format(*v))
            }));
            let _ = writeln!(text, "| {} |", cells.join(" | "));
        }
    }
    text
}

fn shares(peer: &PeerReport, replicas: &[String]) -> String {
    replicas
        .iter()
        .map(|name| {
            peer.median
                .get(&format!("share_pct.{name}"))
                .map_or_else(|| "–".to_owned(), |v| format!("{v:.0}"))
        })
        .collect::<Vec<_>>()
        .join(" / ")
}

fn one_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().to_owned()
}

/// Writes `report.md`, `report.json` and one `<scenario>.svg` per scenario into `dir`.
pub fn write_all(report: &SuiteReport, dir: &Path) -> Result<Vec<PathBuf>, LabError> {
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    let markdown_path = dir.join("report.md");
    std::fs::write(&markdown_path, markdown(report))?;
    written.push(markdown_path);
    let json_path = dir.join("report.json");
    let json = serde_json::to_string_pretty(report).map_err(|e| LabError::new(e.to_string()))?;
    std::fs::write(&json_path, json)?;
    written.push(json_path);
    for scenario in &report.scenarios {
        let path = dir.join(format!("{}.svg", scenario.name));
        write_cdf_svg(scenario, &path)?;
        written.push(path);
    }
    Ok(written)
}

/// Points of the CDF plots per series.
const CDF_POINTS: usize = 400;

/// Line colours, one per peer (cycled).
const COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// The latency CDF of every peer of `scenario`: the whole distribution on the left, the tail
/// (fractions 0.9 to 1) on the right. The x axes are logarithmic; they start just below the
/// smallest latency and end at the largest p99.9 (p99 for overhead).
pub fn write_cdf_svg(scenario: &ScenarioReport, path: &Path) -> Result<(), LabError> {
    let overhead = !scenario.concurrencies.is_empty();
    let (scale, unit) = if overhead { (1e6, "µs") } else { (1.0, "s") };
    let largest = |q: f64| {
        scenario
            .peers
            .iter()
            .filter_map(|peer| percentile(&peer.latencies, q))
            .fold(0.0, f64::max)
            * scale
    };
    // The overhead scenario's tail is scheduling noise; its axis ends at the largest p99.
    let x_max = match largest(if overhead { 0.99 } else { 0.999 }) {
        x if x > 0.0 => x * 1.05,
        _ => 1.0,
    };
    // A logarithmic axis needs a start above 0: just below the smallest positive latency.
    let smallest = scenario
        .peers
        .iter()
        .filter_map(|peer| peer.latencies.iter().copied().find(|&x| x > 0.0))
        .fold(f64::INFINITY, f64::min)
        * scale;
    let x_min = if smallest.is_finite() && smallest < x_max {
        smallest * 0.95
    } else {
        x_max / 1000.0
    };
    let tail_start = scenario
        .peers
        .iter()
        .filter_map(|peer| percentile(&peer.latencies, 0.9))
        .fold(f64::INFINITY, f64::min)
        * scale
        * 0.95;
    let tail_start = if tail_start > x_min && tail_start < x_max {
        tail_start
    } else {
        x_min
    };
    let what = if overhead {
        "latency at concurrency 1"
    } else {
        "latency of successful requests"
    };
    let plot = CdfPlot {
        unit,
        scale,
        peers: &scenario.peers,
    };
    plot.draw(
        path,
        &format!("{}: {what}", scenario.name),
        x_min..x_max,
        tail_start,
    )
    .map_err(|e| LabError::new(format!("{}: {e}", path.display())))
}

/// What the two CDF panels share.
struct CdfPlot<'a> {
    unit: &'a str,
    scale: f64,
    peers: &'a [PeerReport],
}

impl CdfPlot<'_> {
    fn draw(
        &self,
        path: &Path,
        caption: &str,
        x_range: std::ops::Range<f64>,
        tail_start: f64,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (1200, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(caption, ("sans-serif", 22))?;
        let (whole, tail) = root.split_horizontally(640);
        let x_max = x_range.end;
        self.panel(&whole, "CDF", x_range, 0.0..1.0, true)?;
        self.panel(
            &tail,
            "tail (p90 and above)",
            tail_start..x_max,
            0.9..1.0,
            false,
        )?;
        root.present()?;
        Ok(())
    }

    /// One panel; `x_range` (above 0) is drawn on a logarithmic axis.
    fn panel(
        &self,
        area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
        title: &str,
        x_range: std::ops::Range<f64>,
        y_range: std::ops::Range<f64>,
        legend: bool,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let (x_span, y_from) = (x_range.clone(), y_range.start);
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 16))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d(
                x_range
                    .clone()
                    .log_scale()
                    .with_key_points(log_ticks(&x_range)),
                y_range,
            )?;
        chart
            .configure_mesh()
            .x_desc(format!("latency ({}, log scale)", self.unit))
            .x_label_formatter(&|x| tick_label(*x))
            .y_desc("fraction of requests")
            .draw()?;
        for (index, peer) in self.peers.iter().enumerate() {
            if peer.latencies.is_empty() {
                continue;
            }
            let colour = COLOURS[index % COLOURS.len()];
            let points = cdf_points(&peer.latencies, self.scale, &x_span, y_from);
            let series = chart.draw_series(LineSeries::new(points, colour.stroke_width(2)))?;
            if legend {
                series.label(peer.peer.clone()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                });
            }
        }
        if legend {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.9))
                .border_style(BLACK)
                .draw()?;
        }
        Ok(())
    }
}

/// Labelled ticks of a logarithmic axis over `range`: 1, 2 and 5 times the powers of ten inside
/// it, every multiple 1 to 9 when that gives fewer than four, or its two ends.
fn log_ticks(range: &std::ops::Range<f64>) -> Vec<f64> {
    let decades = range.start.log10().floor() as i32..=range.end.log10().ceil() as i32;
    let ticks = |multiples: &[f64]| -> Vec<f64> {
        decades
            .clone()
            .flat_map(|decade| multiples.iter().map(move |m| m * 10f64.powi(decade)))
            .filter(|value| (range.start..=range.end).contains(value))
            .collect()
    };
    let coarse = ticks(&[1.0, 2.0, 5.0]);
    if coarse.len() >= 4 {
        return coarse;
    }
    let fine = ticks(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    if fine.len() >= 2 {
        fine
    } else {
        vec![range.start, range.end]
    }
}

/// A tick value with three significant digits at most and no trailing zeros (`0.005`, `0.25`,
/// `1.5`, `120`).
fn tick_label(value: f64) -> String {
    if !(value.is_finite() && value > 0.0) {
        return format!("{value}");
    }
    let decimals = (2 - value.log10().floor() as i32).clamp(0, 12) as usize;
    let text = format!("{value:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        text
    }
}

/// `(value × scale, fraction ≤ value)` at evenly spaced ranks from the fraction `y_from` up,
/// kept inside `x_range` (a last point at its end carries the line to the edge).
fn cdf_points(
    sorted: &[f64],
    scale: f64,
    x_range: &std::ops::Range<f64>,
    y_from: f64,
) -> Vec<(f64, f64)> {
    let count = sorted.len();
    let first_rank = ((y_from * count as f64).ceil() as usize).min(count - 1);
    let mut points: Vec<(f64, f64)> = (0..=CDF_POINTS)
        .map(|step| first_rank + step * (count - 1 - first_rank) / CDF_POINTS)
        .map(|rank| (sorted[rank] * scale, (rank + 1) as f64 / count as f64))
        .filter(|(x, _)| *x >= x_range.start)
        .take_while(|(x, _)| *x <= x_range.end)
        .collect();
    if let Some(&(_, fraction)) = points.last() {
        points.push((x_range.end, fraction));
    }
    points
}

/// Facts about this machine.
pub fn machine(nginx: Option<String>, gateways: Option<String>) -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name"))
        .and_then(|rest| rest.split_once(':'))
        .map_or_else(
            || "unknown CPU".to_owned(),
            |(_, name)| name.trim().to_owned(),
        );
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_kib: f64 = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    Machine {
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu_model,
        memory_gib: memory_kib / (1024.0 * 1024.0),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map_or_else(|_| "unknown".to_owned(), |text| text.trim().to_owned()),
        nginx,
        gateways,
    }
}

/// The current UTC date and time, `YYYY-MM-DD HH:MM`.
pub fn utc_now() -> String {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs());
    let (year, month, day) = civil_from_days((seconds / 86_400) as i64);
    let minute_of_day = (seconds % 86_400) / 60;
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}",
        minute_of_day / 60,
        minute_of_day % 60
    )
}

/// Year, month, day of a count of days since 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}
