//! A one-command tour: three simulated replicas of speeds 1, 2 and 4, the router in this process,
//! Poisson traffic, and a live table of what the router sees.
//!
//! ```sh
//! cargo run --release --example demo
//! cargo run --release --example demo -- --strategy round-robin --seconds 30 --load 0.8
//! ```
//!
//! Every second it shows, per replica: requests in flight and the EWMA latency (from
//! `GET /_custom_router/health`), and the share of answers so far (from the `x-sim-replica`
//! header). On a terminal the table is redrawn in place; otherwise (a pipe, a file) a new table
//! is printed every second. Everything listens on 127.0.0.1 only; the demo stops by itself.

#[path = "../benches/lab/load.rs"]
mod load;
#[path = "../benches/lab/sim.rs"]
mod sim;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use custom_router::{Config, Router, Settings};
use http_body_util::{BodyExt, Full};
use serde_json::Value;

/// Three simulated replicas behind the router, with a live table.
#[derive(Debug, Parser)]
#[command(name = "demo")]
struct Args {
    /// Seconds of traffic.
    #[arg(long, default_value_t = 20.0)]
    seconds: f64,
    /// Routing strategy (registry name).
    #[arg(long, default_value = custom_router::strategies::DEFAULT_STRATEGY)]
    strategy: String,
    /// Offered load as a fraction of the replicas' capacity.
    #[arg(long, default_value_t = 0.7)]
    load: f64,
    /// Seed of the traffic.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Speeds of the three replicas.
const SPEEDS: [f64; 3] = [1.0, 2.0, 4.0];

/// Longest wait for the last answers after the traffic stops.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if let Err(error) = run(args).await {
        eprintln!("demo: {error}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let replicas = start_replicas().await?;
    let names: BTreeMap<String, String> = replicas
        .iter()
        .map(|replica| (replica.host_port(), replica.name.clone()))
        .collect();
    let (router_addr, stop_router) = start_router(&args.strategy).await?;
    let backends: Vec<String> = replicas.iter().map(sim::SimHandle::host_port).collect();
    set_backends(router_addr, &backends).await?;

    let lengths = load::Lengths::Uniform { min: 16, max: 112 };
    let capacity: f64 = replicas_config()
        .iter()
        .map(|config| config.capacity(lengths.mean()))
        .sum();
    let traffic = load::OpenLoop {
        rate: args.load * capacity,
        duration: Duration::from_secs_f64(args.seconds.clamp(1.0, 3600.0)),
        burst: 0,
        lengths,
        stream_fraction: 1.0,
        seed: args.seed,
        request_timeout: DRAIN_LIMIT,
        max_requests: 1_000_000,
    };
    println!(
        "router on http://{router_addr} ({}), replicas {}; {:.0} req/s for {:.0} s ({:.0}% of the {:.0} req/s the replicas can serve)",
        args.strategy,
        backends.join(", "),
        traffic.rate,
        traffic.duration.as_secs_f64(),
        args.load * 100.0,
        capacity
    );
    let progress = Arc::new(load::Progress::default());
    let schedule = load::plan(&traffic);
    let sent = schedule.len();
    let mut traffic_task = tokio::spawn(load::run_open_loop(
        router_addr,
        schedule,
        traffic.request_timeout,
        Some(Arc::clone(&progress)),
    ));
    let started = tokio::time::Instant::now();
    let give_up = started + traffic.duration + DRAIN_LIMIT;
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    let mut live = LiveTable::new();
    let records = loop {
        tokio::select! {
            finished = &mut traffic_task => break finished?,
            _ = ticker.tick() => {
                let health = health(router_addr).await.unwrap_or(Value::Null);
                live.show(&table(started.elapsed(), &health, &names, &progress, sent));
            }
            _ = tokio::time::sleep_until(give_up) => {
                traffic_task.abort();
                return Err("traffic did not finish in time".into());
            }
        }
    };
    let health = health(router_addr).await.unwrap_or(Value::Null);
    live.show(&table(started.elapsed(), &health, &names, &progress, sent));
    print_summary(&records);
    let _ = stop_router.send(());
    Ok(())
}

fn replicas_config() -> Vec<sim::SimConfig> {
    SPEEDS
        .iter()
        .map(|&speed| sim::SimConfig {
            name: format!("speed-{speed}"),
            speed,
            ..sim::SimConfig::default()
        })
        .collect()
}

async fn start_replicas() -> std::io::Result<Vec<sim::SimHandle>> {
    let mut replicas = Vec::new();
    for config in replicas_config() {
        replicas.push(sim::spawn(config).await?);
    }
    Ok(replicas)
}

/// Starts the router on 127.0.0.1 with `strategy`; the sender stops it.
async fn start_router(
    strategy: &str,
) -> Result<(SocketAddr, tokio::sync::oneshot::Sender<()>), Box<dyn std::error::Error>> {
    let mut config = Config::default();
    config.strategy.name = strategy.to_owned();
    let settings = Settings::from_config(config)?;
    let router = Router::bind_to(settings, SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    let addr = router.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(router.serve(async move {
        let _ = stopped.await;
    }));
    Ok((addr, stop))
}

async fn set_backends(router: SocketAddr, backends: &[String]) -> Result<(), String> {
    let body = serde_json::json!({ "backends": backends }).to_string();
    let request = http::Request::post(format!("http://{router}/_custom_router/set-backends"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("a valid request");
    let response = load::http_client()
        .request(request)
        .await
        .map_err(|e| format!("set-backends: {e}"))?;
    if response.status().is_success() {
        Ok(())
    } else {
        Err(format!("set-backends answered {}", response.status()))
    }
}

async fn health(router: SocketAddr) -> Option<Value> {
    let request = http::Request::get(format!("http://{router}/_custom_router/health"))
        .body(Full::new(Bytes::new()))
        .ok()?;
    let response = load::http_client().request(request).await.ok()?;
    let body = response.into_body().collect().await.ok()?.to_bytes();
    serde_json::from_slice(&body).ok()
}

/// The live table's lines: a status line, a header and one line per replica.
fn table(
    elapsed: Duration,
    health: &Value,
    names: &BTreeMap<String, String>,
    progress: &load::Progress,
    sent: usize,
) -> Vec<String> {
    let finished = progress.finished.load(Ordering::Relaxed);
    let failed = progress.failed.load(Ordering::Relaxed);
    let answered_by = progress.answered_by.lock().expect("progress lock").clone();
    let answered: u64 = answered_by.values().sum();
    let mut lines = vec![
        format!(
            "t = {:>4.0} s   finished {finished}/{sent}   failed {failed}   router queue {}",
            elapsed.as_secs_f64(),
            health["queue_depth"]
        ),
        "replica      address             in-flight   EWMA s   share of answers".to_owned(),
    ];
    for backend in health["backends"].as_array().into_iter().flatten() {
        let addr = backend["addr"].as_str().unwrap_or("?");
        let name = names.get(addr).map_or("?", String::as_str);
        let ewma = backend["ewma_latency"]
            .as_f64()
            .map_or_else(|| "–".to_owned(), |v| format!("{v:.3}"));
        let share =
            answered_by.get(name).copied().unwrap_or(0) as f64 * 100.0 / answered.max(1) as f64;
        lines.push(format!(
            "{name:<12} {addr:<19} {:>9}   {ewma:>6}   {share:>5.1} % {}",
            backend["in_flight"].to_string(),
            "#".repeat((share / 4.0).round() as usize)
        ));
    }
    lines
}

/// Shows the live table: on a terminal, redrawn over the previous one; otherwise appended, one
/// table per call followed by a blank line.
struct LiveTable {
    terminal: bool,
    /// Lines of the table on screen (terminal only).
    drawn: usize,
}

impl LiveTable {
    fn new() -> Self {
        Self {
            terminal: std::io::stdout().is_terminal(),
            drawn: 0,
        }
    }

    fn show(&mut self, lines: &[String]) {
        let mut text = String::new();
        if self.terminal {
            // Line wrapping off while drawing (DECAWM), so that a line wider than the terminal is
            // cut instead of taking two rows and throwing off the count of rows to go back up.
            text.push_str("\x1b[?7l");
            if self.drawn > 0 {
                // Cursor up to the first row of the previous table.
                let _ = write!(text, "\x1b[{}A", self.drawn);
            }
            for line in lines {
                // Back to column 1, clear the row, write the new line.
                let _ = writeln!(text, "\r\x1b[2K{line}");
            }
            // Rows of a longer previous table are cleared, and the cursor returns below the table.
            let stale = self.drawn.saturating_sub(lines.len());
            if stale > 0 {
                text.push_str(&"\x1b[2K\n".repeat(stale));
                let _ = write!(text, "\x1b[{stale}A");
            }
            text.push_str("\x1b[?7h");
            self.drawn = lines.len();
        } else {
            for line in lines {
                let _ = writeln!(text, "{line}");
            }
            text.push('\n');
        }
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.flush();
    }
}

fn print_summary(records: &[load::Record]) {
    let mut latencies: Vec<f64> = records
        .iter()
        .filter(|record| record.is_success())
        .map(|record| record.latency)
        .collect();
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| {
        latencies
            .get(((q * latencies.len() as f64).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(f64::NAN)
    };
    println!(
        "done: {} requests, {} failed; latency p50 {:.3} s, p99 {:.3} s",
        records.len(),
        records.len() - latencies.len(),
        at(0.50),
        at(0.99)
    );
}
