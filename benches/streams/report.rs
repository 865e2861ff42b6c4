//! Medians over the runs, same-run ratios to nginx and HAProxy, and the report files:
//! `streams.md`, `streams.json`, `streams.csv` and three SVG plots against the number of
//! streams (RSS per stream, CPU per event, p99 event delay).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use super::client::Failure;

/// How the numbers were taken.
#[derive(Debug, Serialize)]
pub struct Setup {
    pub command: String,
    pub date: String,
    pub cpus: usize,
    pub pinned: Option<String>,
    pub nofile: u64,
    pub interval_ms: u64,
    pub event_bytes: usize,
    pub ramp_s: f64,
    pub settle_s: f64,
    pub window_s: f64,
    pub router: String,
    pub nginx: Option<String>,
    pub haproxy: Option<String>,
    pub upload_mb: usize,
    pub uploads: usize,
}

/// One proxy, one stream count, one run.
#[derive(Debug, Clone, Serialize)]
pub struct StreamRun {
    pub run: usize,
    pub peer: String,
    pub streams: usize,
    pub events_per_stream: u32,
    /// VmRSS after start and one short stream.
    pub idle_rss_kib: Option<u64>,
    /// VmHWM at the end.
    pub peak_rss_kib: Option<u64>,
    /// (peak − idle) / streams.
    pub rss_per_stream_kib: Option<f64>,
    /// The proxy's utime + stime over the window ÷ events received in it.
    pub cpu_us_per_event: Option<f64>,
    pub proxy_cpu_percent: Option<f64>,
    pub loadgen_cpu_percent: Option<f64>,
    pub loadgen_cpu_us_per_event: Option<f64>,
    pub window_s: f64,
    /// Seconds from the first stream's start until every stream had its first event.
    pub opened_after_s: f64,
    /// Streams that had their first event by the window's end.
    pub open_in_window: usize,
    pub events_in_window: u64,
    pub events_per_s: f64,
    pub events_received: u64,
    pub delay_samples: usize,
    pub delay_p50_ms: Option<f64>,
    pub delay_p99_ms: Option<f64>,
    pub delay_max_ms: Option<f64>,
    pub ttfb_p50_ms: Option<f64>,
    pub ttfb_p99_ms: Option<f64>,
    pub errors: usize,
    pub failures: BTreeMap<Failure, usize>,
    pub pids: Vec<u32>,
}

impl StreamRun {
    /// One progress line.
    pub fn summary(&self) -> String {
        format!(
            "run {} {:>9} N={:<5} RSS/stream {} KiB, CPU/event {} µs (proxy {} %, load gen {} %), \
             delay p50 {} p99 {} ms, TTFB p99 {} ms, {:.0} events/s, errors {}",
            self.run,
            self.peer,
            self.streams,
            show(self.rss_per_stream_kib, 1),
            show(self.cpu_us_per_event, 2),
            show(self.proxy_cpu_percent, 0),
            show(self.loadgen_cpu_percent, 0),
            show(self.delay_p50_ms, 3),
            show(self.delay_p99_ms, 3),
            show(self.ttfb_p99_ms, 2),
            self.events_per_s,
            self.errors,
        )
    }
}

/// One proxy's uploads in one run.
#[derive(Debug, Clone, Serialize)]
pub struct UploadRun {
    pub run: usize,
    pub peer: String,
    /// Median over the uploads.
    pub mb_per_s: Option<f64>,
    pub each_mb_per_s: Vec<f64>,
    pub idle_rss_kib: Option<u64>,
    pub peak_rss_kib: Option<u64>,
    pub errors: Vec<String>,
}

impl UploadRun {
    pub fn summary(&self) -> String {
        format!(
            "run {} {:>9} upload {} MB/s, RSS idle {} peak {} KiB, errors {}",
            self.run,
            self.peer,
            show(self.mb_per_s, 0),
            show(self.idle_rss_kib.map(|v| v as f64), 0),
            show(self.peak_rss_kib.map(|v| v as f64), 0),
            self.errors.len(),
        )
    }
}

/// Medians over the runs of one proxy at one stream count.
#[derive(Debug, Clone, Serialize)]
pub struct StreamMedian {
    pub peer: String,
    pub streams: usize,
    pub runs: usize,
    pub idle_rss_kib: Option<f64>,
    pub peak_rss_kib: Option<f64>,
    pub rss_per_stream_kib: Option<f64>,
    pub cpu_us_per_event: Option<f64>,
    pub proxy_cpu_percent: Option<f64>,
    pub loadgen_cpu_percent: Option<f64>,
    pub events_per_s: Option<f64>,
    pub delay_p50_ms: Option<f64>,
    pub delay_p99_ms: Option<f64>,
    pub ttfb_p50_ms: Option<f64>,
    pub ttfb_p99_ms: Option<f64>,
    pub opened_after_s: Option<f64>,
    /// Failed streams over every run.
    pub errors: usize,
}

/// A proxy's numbers divided by a reference proxy's of the same run, medians over the runs.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    pub peer: String,
    pub base: String,
    pub streams: usize,
    pub runs: usize,
    pub rss_per_stream: Option<f64>,
    pub peak_rss: Option<f64>,
    pub cpu_per_event: Option<f64>,
    pub delay_p50: Option<f64>,
    pub delay_p99: Option<f64>,
    pub ttfb_p99: Option<f64>,
}

/// Medians over the runs of one proxy's uploads.
#[derive(Debug, Clone, Serialize)]
pub struct UploadMedian {
    pub peer: String,
    pub runs: usize,
    pub mb_per_s: Option<f64>,
    pub idle_rss_kib: Option<f64>,
    pub peak_rss_kib: Option<f64>,
    /// Per-run ratio of MB/s to nginx's and HAProxy's, median.
    pub mb_per_s_vs_nginx: Option<f64>,
    pub mb_per_s_vs_haproxy: Option<f64>,
    pub peak_rss_vs_nginx: Option<f64>,
    pub peak_rss_vs_haproxy: Option<f64>,
    pub errors: usize,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub setup: Setup,
    pub medians: Vec<StreamMedian>,
    pub ratios: Vec<Ratio>,
    pub uploads: Vec<UploadMedian>,
    pub stream_runs: Vec<StreamRun>,
    pub upload_runs: Vec<UploadRun>,
}

/// The references the ratios are taken against.
const BASES: [&str; 2] = ["nginx", "haproxy"];

impl Report {
    pub fn new(
        setup: Setup,
        peers: &[String],
        counts: &[usize],
        stream_runs: Vec<StreamRun>,
        upload_runs: Vec<UploadRun>,
    ) -> Self {
        let mut medians = Vec::new();
        let mut ratios = Vec::new();
        for &streams in counts {
            for peer in peers {
                let runs: Vec<&StreamRun> = stream_runs
                    .iter()
                    .filter(|r| &r.peer == peer && r.streams == streams)
                    .collect();
                if runs.is_empty() {
                    continue;
                }
                let of =
                    |field: fn(&StreamRun) -> Option<f64>| median_of(runs.iter().map(|r| field(r)));
                medians.push(StreamMedian {
                    peer: peer.clone(),
                    streams,
                    runs: runs.len(),
                    idle_rss_kib: of(|r| r.idle_rss_kib.map(|v| v as f64)),
                    peak_rss_kib: of(|r| r.peak_rss_kib.map(|v| v as f64)),
                    rss_per_stream_kib: of(|r| r.rss_per_stream_kib),
                    cpu_us_per_event: of(|r| r.cpu_us_per_event),
                    proxy_cpu_percent: of(|r| r.proxy_cpu_percent),
                    loadgen_cpu_percent: of(|r| r.loadgen_cpu_percent),
                    events_per_s: of(|r| Some(r.events_per_s)),
                    delay_p50_ms: of(|r| r.delay_p50_ms),
                    delay_p99_ms: of(|r| r.delay_p99_ms),
                    ttfb_p50_ms: of(|r| r.ttfb_p50_ms),
                    ttfb_p99_ms: of(|r| r.ttfb_p99_ms),
                    opened_after_s: of(|r| Some(r.opened_after_s)),
                    errors: runs.iter().map(|r| r.errors).sum(),
                });
                for base in BASES {
                    if peer == base || peer == "direct" {
                        continue;
                    }
                    let pairs: Vec<(&StreamRun, &StreamRun)> = runs
                        .iter()
                        .filter_map(|r| {
                            let other = stream_runs.iter().find(|o| {
                                o.peer == base && o.streams == streams && o.run == r.run
                            })?;
                            Some((*r, other))
                        })
                        .collect();
                    if pairs.is_empty() {
                        continue;
                    }
                    let ratio = |field: fn(&StreamRun) -> Option<f64>| {
                        median_of(pairs.iter().map(|(a, b)| {
                            let (a, b) = (field(a)?, field(b)?);
                            (b > 0.0).then(|| a / b)
                        }))
                    };
                    ratios.push(Ratio {
                        peer: peer.clone(),
                        base: base.to_owned(),
                        streams,
                        runs: pairs.len(),
                        rss_per_stream: ratio(|r| r.rss_per_stream_kib),
                        peak_rss: ratio(|r| r.peak_rss_kib.map(|v| v as f64)),
                        cpu_per_event: ratio(|r| r.cpu_us_per_event),
                        delay_p50: ratio(|r| r.delay_p50_ms),
                        delay_p99: ratio(|r| r.delay_p99_ms),
                        ttfb_p99: ratio(|r| r.ttfb_p99_ms),
                    });
                }
            }
        }
        let mut uploads = Vec::new();
        for peer in peers {
            let runs: Vec<&UploadRun> = upload_runs.iter().filter(|r| &r.peer == peer).collect();
            if runs.is_empty() {
                continue;
            }
            let vs = |base: &str, field: fn(&UploadRun) -> Option<f64>| {
                if peer == base {
                    return None;
                }
                median_of(runs.iter().map(|r| {
                    let other = upload_runs
                        .iter()
                        .find(|o| o.peer == base && o.run == r.run)?;
                    let (a, b) = (field(r)?, field(other)?);
                    (b > 0.0).then(|| a / b)
                }))
            };
            let peak = |r: &UploadRun| r.peak_rss_kib.map(|v| v as f64);
            uploads.push(UploadMedian {
                peer: peer.clone(),
                runs: runs.len(),
                mb_per_s: median_of(runs.iter().map(|r| r.mb_per_s)),
                idle_rss_kib: median_of(runs.iter().map(|r| r.idle_rss_kib.map(|v| v as f64))),
                peak_rss_kib: median_of(runs.iter().map(|r| peak(r))),
                mb_per_s_vs_nginx: vs("nginx", |r| r.mb_per_s),
                mb_per_s_vs_haproxy: vs("haproxy", |r| r.mb_per_s),
                peak_rss_vs_nginx: vs("nginx", peak),
                peak_rss_vs_haproxy: vs("haproxy", peak),
                errors: runs.iter().map(|r| r.errors.len()).sum(),
            });
        }
        Self {
            setup,
            medians,
            ratios,
            uploads,
            stream_runs,
            upload_runs,
        }
    }

    /// Writes `streams.json`, `streams.csv`, `streams.md` and the plots into `out`.
    pub fn write(&self, out: &Path) -> Result<(), Box<dyn std::error::Error>> {
        std::fs::create_dir_all(out)?;
        std::fs::write(
            out.join("streams.json"),
            serde_json::to_string_pretty(self)?,
        )?;
        std::fs::write(out.join("streams.csv"), self.csv())?;
        std::fs::write(out.join("streams.md"), self.markdown())?;
        if !self.medians.is_empty() {
            self.plot(
                &out.join("streams-rss.svg"),
                "RSS per open stream (peak − idle) ÷ N",
                "KiB per stream",
                |m| m.rss_per_stream_kib,
            )?;
            self.plot(
                &out.join("streams-cpu.svg"),
                "proxy CPU per relayed event",
                "CPU µs per event",
                |m| m.cpu_us_per_event,
            )?;
            self.plot(
                &out.join("streams-delay.svg"),
                "p99 event delay (receipt − send stamp)",
                "ms",
                |m| m.delay_p99_ms,
            )?;
        }
        Ok(())
    }

    /// Every run and every median, one row each.
    fn csv(&self) -> String {
        let mut csv = String::from(
            "kind,run,peer,streams,idle_rss_kib,peak_rss_kib,rss_per_stream_kib,cpu_us_per_event,\
             proxy_cpu_percent,loadgen_cpu_percent,events_per_s,delay_p50_ms,delay_p99_ms,\
             ttfb_p50_ms,ttfb_p99_ms,errors,upload_mb_per_s\n",
        );
        let cell = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.4}"));
        for r in &self.stream_runs {
            let _ = writeln!(
                csv,
                "stream,{},{},{},{},{},{},{},{},{},{:.1},{},{},{},{},{},",
                r.run,
                r.peer,
                r.streams,
                cell(r.idle_rss_kib.map(|v| v as f64)),
                cell(r.peak_rss_kib.map(|v| v as f64)),
                cell(r.rss_per_stream_kib),
                cell(r.cpu_us_per_event),
                cell(r.proxy_cpu_percent),
                cell(r.loadgen_cpu_percent),
                r.events_per_s,
                cell(r.delay_p50_ms),
                cell(r.delay_p99_ms),
                cell(r.ttfb_p50_ms),
                cell(r.ttfb_p99_ms),
                r.errors,
            );
        }
        for m in &self.medians {
            let _ = writeln!(
                csv,
                "stream,median,{},{},{},{},{},{},{},{},{},{},{},{},{},{},",
                m.peer,
                m.streams,
                cell(m.idle_rss_kib),
                cell(m.peak_rss_kib),
                cell(m.rss_per_stream_kib),
                cell(m.cpu_us_per_event),
                cell(m.proxy_cpu_percent),
                cell(m.loadgen_cpu_percent),
                cell(m.events_per_s),
                cell(m.delay_p50_ms),
                cell(m.delay_p99_ms),
                cell(m.ttfb_p50_ms),
                cell(m.ttfb_p99_ms),
                m.errors,
            );
        }
        for r in &self.upload_runs {
            let _ = writeln!(
                csv,
                "upload,{},{},,{},{},,,,,,,,,,{},{}",
                r.run,
                r.peer,
                cell(r.idle_rss_kib.map(|v| v as f64)),
                cell(r.peak_rss_kib.map(|v| v as f64)),
                r.errors.len(),
                cell(r.mb_per_s),
            );
        }
        for u in &self.uploads {
            let _ = writeln!(
                csv,
                "upload,median,{},,{},{},,,,,,,,,,{},{}",
                u.peer,
                cell(u.idle_rss_kib),
                cell(u.peak_rss_kib),
                u.errors,
                cell(u.mb_per_s),
            );
        }
        csv
    }

    /// The tables.
    pub fn markdown(&self) -> String {
        let s = &self.setup;
        let mut md = String::new();
        let _ = writeln!(md, "## Streams at scale\n");
        let _ = writeln!(md, "- Command: `{}`", s.command);
        let _ = writeln!(
            md,
            "- Date: {}; {} CPUs; open-file limit {}",
            s.date, s.cpus, s.nofile
        );
        let _ = writeln!(
            md,
            "- Pinning: {}",
            s.pinned
                .as_deref()
                .unwrap_or("none (every process on every CPU)")
        );
        let _ = writeln!(
            md,
            "- Streams: one {}-byte event every {} ms each, opened over {} s; measured over a {} s \
             window starting {} s after every stream had its first event",
            s.event_bytes, s.interval_ms, s.ramp_s, s.window_s, s.settle_s
        );
        let _ = writeln!(md, "- Router: {}", s.router);
        if let Some(nginx) = &s.nginx {
            let _ = writeln!(md, "- nginx: {nginx}");
        }
        if let Some(haproxy) = &s.haproxy {
            let _ = writeln!(md, "- HAProxy: {haproxy}");
        }
        if !self.medians.is_empty() {
            let runs = self.medians.iter().map(|m| m.runs).max().unwrap_or(0);
            let _ = writeln!(
                md,
                "\nMedians of {runs} run(s); errors are failed streams summed over the runs.\n"
            );
            md.push_str(
                "| peer | N | idle RSS MiB | peak RSS MiB | RSS per stream KiB | CPU µs per event | \
                 proxy CPU % | delay p50 ms | delay p99 ms | TTFB p50 ms | TTFB p99 ms | all open after s | \
                 errors | load gen CPU % |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            );
            for m in &self.medians {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    m.peer,
                    m.streams,
                    show(m.idle_rss_kib.map(|v| v / 1024.0), 1),
                    show(m.peak_rss_kib.map(|v| v / 1024.0), 1),
                    show(m.rss_per_stream_kib, 1),
                    show(m.cpu_us_per_event, 2),
                    show(m.proxy_cpu_percent, 0),
                    show(m.delay_p50_ms, 3),
                    show(m.delay_p99_ms, 3),
                    show(m.ttfb_p50_ms, 2),
                    show(m.ttfb_p99_ms, 2),
                    show(m.opened_after_s, 1),
                    m.errors,
                    show(m.loadgen_cpu_percent, 0),
                );
            }
        }
        if !self.ratios.is_empty() {
            md.push_str(
                "\nSame-run ratios (each run's number divided by the reference's in the same run, \
                 median over the runs; below 1 is better for the peer):\n\n\
                 | peer | N | ÷ | RSS per stream | peak RSS | CPU per event | delay p50 | delay p99 | TTFB p99 |\n\
                 |---|---|---|---|---|---|---|---|---|\n",
            );
            for r in &self.ratios {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    r.peer,
                    r.streams,
                    r.base,
                    times(r.rss_per_stream),
                    times(r.peak_rss),
                    times(r.cpu_per_event),
                    times(r.delay_p50),
                    times(r.delay_p99),
                    times(r.ttfb_p99),
                );
            }
        }
        if !self.uploads.is_empty() {
            let _ = writeln!(
                md,
                "\nUpload: `POST` of {} MB ({} per proxy and run, one after the other; median of \
                 the uploads, then of the runs); the backend reads the body and answers 200.\n",
                s.upload_mb, s.uploads
            );
            md.push_str(
                "| peer | MB/s | ÷ nginx | ÷ HAProxy | idle RSS MiB | peak RSS MiB | peak RSS ÷ nginx | \
                 peak RSS ÷ HAProxy | errors |\n|---|---|---|---|---|---|---|---|---|\n",
            );
            for u in &self.uploads {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    u.peer,
                    show(u.mb_per_s, 0),
                    times(u.mb_per_s_vs_nginx),
                    times(u.mb_per_s_vs_haproxy),
                    show(u.idle_rss_kib.map(|v| v / 1024.0), 1),
                    show(u.peak_rss_kib.map(|v| v / 1024.0), 1),
                    times(u.peak_rss_vs_nginx),
                    times(u.peak_rss_vs_haproxy),
                    u.errors,
                );
            }
        }
        md
    }

    /// One line per peer (with a value) of `field` against the number of streams.
    fn plot(
        &self,
        path: &Path,
        caption: &str,
        unit: &str,
        field: fn(&StreamMedian) -> Option<f64>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let mut lines: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for m in &self.medians {
            let Some(value) = field(m) else { continue };
            let point = (m.streams as f64, value);
            match lines.iter_mut().find(|(peer, _)| peer == &m.peer) {
                Some((_, points)) => points.push(point),
                None => lines.push((m.peer.clone(), vec![point])),
            }
        }
        let x_max = lines
            .iter()
            .flat_map(|(_, points)| points.iter().map(|p| p.0))
            .fold(1.0, f64::max);
        let y_max = lines
            .iter()
            .flat_map(|(_, points)| points.iter().map(|p| p.1))
            .fold(0.0, f64::max)
            .max(1e-3);
        let root = SVGBackend::new(path, (760, 460)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..x_max * 1.05, 0.0..y_max * 1.15)?;
        chart
            .configure_mesh()
            .x_desc("concurrent streams")
            .y_desc(unit)
            .draw()?;
        for (index, (peer, points)) in lines.iter().enumerate() {
            let colour = COLOURS[index % COLOURS.len()];
            chart
                .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))?
                .label(peer.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                });
            chart.draw_series(
                points
                    .iter()
                    .map(|&point| Circle::new(point, 4, colour.filled())),
            )?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    }
}

const COLOURS: [RGBColor; 7] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
];

/// The `q` quantile (nearest rank) of sorted microseconds, as f64.
pub fn percentile(sorted: &[u32], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(f64::from(sorted[rank - 1]))
}

/// The median of sorted values.
pub fn median(sorted: &[f64]) -> Option<f64> {
    match sorted.len() {
        0 => None,
        n if n % 2 == 1 => Some(sorted[n / 2]),
        n => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// The median of the values that are present.
fn median_of(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let mut present: Vec<f64> = values.flatten().filter(|v| v.is_finite()).collect();
    present.sort_by(f64::total_cmp);
    median(&present)
}

fn show(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "–".to_owned(), |v| format!("{v:.decimals$}"))
}

fn times(value: Option<f64>) -> String {
    value.map_or_else(|| "–".to_owned(), |v| format!("{v:.2}×"))
}
