//! Streams at scale: what a proxy costs per open server-sent event stream and per relayed event,
//! for the router, nginx and HAProxy, side by side; and a large upload through each.
//!
//! ```sh
//! cargo bench --bench streams -- --streams 500,2000,5000 --runs 3 --upload --out target/streams
//! ```
//!
//! One process holds the backend and the clients, each on its own thread with a current-thread
//! tokio runtime: the backend answers every request with a chunked `text/event-stream` of one
//! ~100-byte event every 50 ms, stamped with its send time; the client opens N HTTP/1.1
//! connections through the proxy (ramped in), posts a small chat-completions request on each and
//! reads the stream (one thread for both saturated at about 88 000 events per second, below the
//! 100 000 of 5000 streams). Each proxy
//! is started fresh for every measurement. With `--pin` the proxy goes to CPU 0 and this
//! process to the last CPU (`taskset`); by default nothing is pinned. Reports (`streams.md`,
//! `streams.json`, `streams.csv`, and SVG plots) go to `--out`. See docs/benchmarks.md,
//! "Streams at scale".

mod backend;
mod client;
mod peers;
mod report;
mod wire;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;

use client::{Plan, StreamOutcome};
use peers::{Binaries, Kind, Peer, Running};
use report::{StreamRun, UploadRun};

/// Streams at scale: RSS per stream, CPU per relayed event and event delay of the router,
/// nginx and HAProxy; optionally a large upload through each.
#[derive(Debug, Parser)]
#[command(name = "streams")]
struct Args {
    /// Concurrent streams, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [500, 2000, 5000])]
    streams: Vec<usize>,
    /// Rounds; every proxy is measured once per round and stream count, in an order rotated
    /// from round to round. The report shows medians.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Output directory.
    #[arg(long, default_value = "target/streams")]
    out: PathBuf,
    /// Measure only these peers (repeatable): direct, router, nginx, haproxy, and with
    /// --two-workers router-2, nginx-2, haproxy-2.
    #[arg(long = "peer", value_name = "NAME")]
    peers: Vec<String>,
    /// Also measure each proxy with two workers (threads), on every CPU.
    #[arg(long)]
    two_workers: bool,
    /// Milliseconds between two events of a stream.
    #[arg(long, default_value_t = 50)]
    interval_ms: u64,
    /// Size of one event's payload, in bytes.
    #[arg(long, default_value_t = 100)]
    event_bytes: usize,
    /// Seconds over which the streams are opened.
    #[arg(long, default_value_t = 1.5)]
    ramp: f64,
    /// Seconds between the moment every stream has received its first event and the
    /// measurement window.
    #[arg(long, default_value_t = 0.5)]
    settle: f64,
    /// Seconds of the measurement window; then the streams are closed.
    #[arg(long, default_value_t = 8.0)]
    window: f64,
    /// Also measure an upload of --upload-mb through each proxy.
    #[arg(long)]
    upload: bool,
    /// Only the upload measurement.
    #[arg(long)]
    upload_only: bool,
    /// Size of the uploaded body, in MB (10^6 bytes).
    #[arg(long, default_value_t = 10)]
    upload_mb: usize,
    /// Uploads per proxy and round (one after the other; the median counts).
    #[arg(long, default_value_t = 5)]
    uploads: usize,
    /// Pin the proxy (one worker) to CPU 0 and this process to the last CPU with `taskset`.
    /// Off by default: on a machine shared with other work, a pinned proxy cannot move away
    /// from a busy CPU, and its event delay then measures the other work (see the docs).
    #[arg(long)]
    pin: bool,
    /// The router executable (default: the one cargo built with this bench).
    #[arg(long)]
    router: Option<PathBuf>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    wire::base();
    let nofile = raise_nofile();
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let taskset = peers::find("taskset");
    let pin = args.pin && cpus >= 2 && taskset.is_some();
    let loadgen_cpu = (cpus - 1).to_string();
    if pin {
        let pinned = Command::new(taskset.as_ref().expect("checked"))
            .args([
                "-a",
                "-p",
                "-c",
                &loadgen_cpu,
                &std::process::id().to_string(),
            ])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        if !pinned {
            eprintln!("warning: could not pin the load generator to CPU {loadgen_cpu}");
        }
    }
    let binaries = Binaries {
        router: args
            .router
            .clone()
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_custom-router"))),
        nginx: peers::find("nginx"),
        haproxy: peers::find("haproxy"),
        taskset,
    };
    let proxy_cpus = pin.then(|| "0".to_owned());
    let all_cpus = pin.then(|| format!("0-{}", cpus - 1));
    let mut candidates = vec![
        peer("direct", Kind::Direct, 1, None),
        peer("router", Kind::Router, 1, proxy_cpus.clone()),
    ];
    if binaries.nginx.is_some() {
        candidates.push(peer("nginx", Kind::Nginx, 1, proxy_cpus.clone()));
    }
    if binaries.haproxy.is_some() {
        candidates.push(peer("haproxy", Kind::Haproxy, 1, proxy_cpus.clone()));
    }
    if args.two_workers {
        candidates.push(peer("router-2", Kind::Router, 2, all_cpus.clone()));
        if binaries.nginx.is_some() {
            candidates.push(peer("nginx-2", Kind::Nginx, 2, all_cpus.clone()));
        }
        if binaries.haproxy.is_some() {
            candidates.push(peer("haproxy-2", Kind::Haproxy, 2, all_cpus.clone()));
        }
    }
    let selected: Vec<Peer> = candidates
        .into_iter()
        .filter(|p| args.peers.is_empty() || args.peers.contains(&p.name))
        .collect();
    if selected.is_empty() {
        eprintln!("no peer to measure");
        return ExitCode::FAILURE;
    }
    let largest = args.streams.iter().copied().max().unwrap_or(0);
    if nofile < (2 * largest + 256) as u64 {
        eprintln!(
            "warning: the open-file limit is {nofile}, too low for {largest} streams \
             (client and backend sockets): run as root or raise `ulimit -n`"
        );
    }
    let setup = report::Setup {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        date: utc_now(),
        cpus,
        pinned: pin.then(|| {
            format!("proxies with one worker on CPU 0, two-worker proxies on CPUs 0-{}, load generator on CPU {loadgen_cpu}", cpus - 1)
        }),
        nofile,
        interval_ms: args.interval_ms,
        event_bytes: args.event_bytes,
        ramp_s: args.ramp,
        settle_s: args.settle,
        window_s: args.window,
        router: format!("{} ({})", binaries.router.display(), git_commit()),
        nginx: binaries
            .nginx
            .as_deref()
            .map(|nginx| peers::first_line(nginx, &["-v"])),
        haproxy: binaries
            .haproxy
            .as_deref()
            .map(|haproxy| peers::first_line(haproxy, &["-v"])),
        upload_mb: args.upload_mb,
        uploads: args.uploads,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    match runtime.block_on(run(&args, &selected, &binaries, setup)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn peer(name: &str, kind: Kind, workers: usize, cpus: Option<String>) -> Peer {
    Peer {
        name: name.to_owned(),
        kind,
        workers,
        cpus,
    }
}

async fn run(
    args: &Args,
    peers: &[Peer],
    binaries: &Binaries,
    setup: report::Setup,
) -> Result<(), String> {
    let nofile = setup.nofile;
    let shape = backend::Shape {
        interval: Duration::from_millis(args.interval_ms),
        event_bytes: args.event_bytes,
    };
    let backend = backend::start(shape).map_err(|e| format!("backend: {e}"))?;
    // Absolute: nginx and HAProxy resolve relative paths against their own prefix.
    let work = std::path::absolute(args.out.join("work")).map_err(|e| format!("--out: {e}"))?;
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let ticks = peers::ticks_per_second();
    let mut stream_runs = Vec::new();
    let mut upload_runs = Vec::new();
    let body = upload_body(args.upload_mb * 1_000_000);
    let started = Instant::now();
    for round in 0..args.runs {
        if !args.upload_only {
            for (index, &streams) in args.streams.iter().enumerate() {
                for peer in rotated(peers, round + index) {
                    let dir = work.join(&peer.name);
                    let mut running = peers::start(peer, binaries, backend, &dir, nofile).await?;
                    let measured = measure_streams(args, &mut running, streams, ticks).await;
                    running.stop();
                    let measured = measured.map_err(|e| format!("{}: {e}", peer.name))?;
                    let line = StreamRun {
                        run: round,
                        peer: peer.name.clone(),
                        ..measured
                    };
                    eprintln!(
                        "[{:>5.0} s] {}",
                        started.elapsed().as_secs_f64(),
                        line.summary()
                    );
                    stream_runs.push(line);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        if args.upload || args.upload_only {
            for peer in rotated(peers, round) {
                let dir = work.join(&peer.name);
                let mut running = peers::start(peer, binaries, backend, &dir, nofile).await?;
                let measured = measure_uploads(args, &mut running, &body).await;
                running.stop();
                let line = UploadRun {
                    run: round,
                    peer: peer.name.clone(),
                    ..measured
                };
                eprintln!(
                    "[{:>5.0} s] {}",
                    started.elapsed().as_secs_f64(),
                    line.summary()
                );
                upload_runs.push(line);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    let names: Vec<String> = peers.iter().map(|p| p.name.clone()).collect();
    let report = report::Report::new(setup, &names, &args.streams, stream_runs, upload_runs);
    report
        .write(&args.out)
        .map_err(|e| format!("writing the report: {e}"))?;
    println!("{}", report.markdown());
    eprintln!(
        "done in {:.0} s; reports in {}",
        started.elapsed().as_secs_f64(),
        args.out.display()
    );
    Ok(())
}

/// `peers` starting at `offset` (mod their number).
fn rotated(peers: &[Peer], offset: usize) -> impl Iterator<Item = &Peer> {
    let count = peers.len();
    (0..count).map(move |i| &peers[(i + offset) % count])
}

/// How long the streams may take to open (after the ramp) before the window starts anyway.
const OPEN_LIMIT: Duration = Duration::from_secs(40);

/// One short stream, to check the peer relays before anything is measured.
async fn warm_up(target: SocketAddr) -> Result<(), String> {
    let plan = Arc::new(Plan::new(target, Instant::now(), Duration::ZERO, 1, 2));
    let outcome = tokio::time::timeout(Duration::from_secs(10), client::stream(plan, 0)).await;
    match outcome.map(|outcome| outcome.failure) {
        Ok(None) => Ok(()),
        Ok(Some(failure)) => Err(format!("warm-up stream failed: {failure:?}")),
        Err(_) => Err("warm-up stream did not end within 10 s".to_owned()),
    }
}

/// N streams through `running`: idle and peak memory, CPU over the window, delays, TTFB.
///
/// The window starts `--settle` seconds after every stream received its first event (or
/// after `OPEN_LIMIT`, when some never do), and lasts `--window` seconds; then every stream
/// is told to stop and closes its connection. The streams ask for more events than they
/// can receive by then, so none ends on its own before.
async fn measure_streams(
    args: &Args,
    running: &mut Running,
    streams: usize,
    ticks_per_second: f64,
) -> Result<StreamRun, String> {
    warm_up(running.addr).await?;
    running.settle();
    // Let the start-up work (and the warm-up) finish before the idle reading.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = running.usage();
    let interval = Duration::from_millis(args.interval_ms);
    let start = Instant::now() + Duration::from_millis(100);
    let ramp = Duration::from_secs_f64(args.ramp);
    let settle = Duration::from_secs_f64(args.settle);
    let window = Duration::from_secs_f64(args.window);
    let longest = ramp + OPEN_LIMIT + settle + window + Duration::from_secs(5);
    let events = (longest.as_secs_f64() / interval.as_secs_f64()).ceil() as u32;
    let plan = Arc::new(Plan::new(running.addr, start, ramp, streams, events));
    let tasks: Vec<_> = (0..streams)
        .map(|index| tokio::spawn(client::stream(Arc::clone(&plan), index)))
        .collect();
    tokio::time::sleep_until((start + ramp).into()).await;
    let open_by = start + ramp + OPEN_LIMIT;
    while plan.opened.load(Ordering::Relaxed) < streams && Instant::now() < open_by {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let opened_after = start.elapsed();
    let window_start = Instant::now() + settle;
    let window_end = window_start + window;
    plan.window_start
        .store(wire::ns_at(window_start), Ordering::Relaxed);
    plan.window_end
        .store(wire::ns_at(window_end), Ordering::Relaxed);
    let own = std::process::id();
    tokio::time::sleep_until(window_start.into()).await;
    let (cpu_0, own_0, received_0, at_0) = (
        running.usage(),
        peers::process_usage(own),
        plan.received.load(Ordering::Relaxed),
        Instant::now(),
    );
    tokio::time::sleep_until(window_end.into()).await;
    let (cpu_1, own_1, received_1, at_1) = (
        running.usage(),
        peers::process_usage(own),
        plan.received.load(Ordering::Relaxed),
        Instant::now(),
    );
    let open_in_window = plan.opened.load(Ordering::Relaxed);
    let _ = plan.stop.send(true);
    let mut outcomes: Vec<StreamOutcome> = Vec::with_capacity(streams);
    let finish_by = Instant::now() + Duration::from_secs(30);
    for task in tasks {
        let abort = task.abort_handle();
        match tokio::time::timeout_at(finish_by.into(), task).await {
            Ok(outcome) => outcomes.push(outcome.map_err(|e| format!("stream task: {e}"))?),
            Err(_) => {
                abort.abort();
                return Err("a stream did not close within 30 s of the stop".to_owned());
            }
        }
    }
    let peak = running.usage();
    let window = (at_1 - at_0).as_secs_f64();
    let opened_after_s = opened_after.as_secs_f64();
    let relayed = received_1 - received_0;
    let cpu_seconds = |a: Option<peers::Usage>, b: Option<peers::Usage>| {
        Some((b?.cpu_ticks.saturating_sub(a?.cpu_ticks)) as f64 / ticks_per_second)
    };
    let proxy_cpu = cpu_seconds(cpu_0, cpu_1);
    let own_cpu = cpu_seconds(own_0, own_1);
    let mut delays: Vec<u32> = Vec::new();
    let mut ttfbs: Vec<u32> = Vec::new();
    let mut failures: BTreeMap<client::Failure, usize> = BTreeMap::new();
    let mut received = 0u64;
    for outcome in &mut outcomes {
        delays.append(&mut outcome.delays_us);
        if let Some(ttfb) = outcome.ttfb {
            ttfbs.push(u32::try_from(ttfb.as_micros()).unwrap_or(u32::MAX));
        }
        if let Some(failure) = outcome.failure {
            *failures.entry(failure).or_default() += 1;
        }
        received += u64::from(outcome.events);
    }
    delays.sort_unstable();
    ttfbs.sort_unstable();
    let per_event = |seconds: Option<f64>| {
        seconds
            .filter(|_| relayed > 0)
            .map(|s| s * 1e6 / relayed as f64)
    };
    let rss_per_stream = match (idle, peak) {
        (Some(idle), Some(peak)) => {
            Some(peak.hwm_kib.saturating_sub(idle.rss_kib) as f64 / streams as f64)
        }
        _ => None,
    };
    Ok(StreamRun {
        run: 0,
        peer: String::new(),
        streams,
        events_per_stream: events,
        idle_rss_kib: idle.map(|u| u.rss_kib),
        peak_rss_kib: peak.map(|u| u.hwm_kib),
        rss_per_stream_kib: rss_per_stream,
        cpu_us_per_event: per_event(proxy_cpu),
        proxy_cpu_percent: proxy_cpu.map(|s| s * 100.0 / window),
        loadgen_cpu_percent: own_cpu.map(|s| s * 100.0 / window),
        loadgen_cpu_us_per_event: per_event(own_cpu),
        window_s: window,
        opened_after_s,
        open_in_window,
        events_in_window: relayed,
        events_per_s: relayed as f64 / window,
        events_received: received,
        delay_samples: delays.len(),
        delay_p50_ms: report::percentile(&delays, 0.50).map(|us| us / 1000.0),
        delay_p99_ms: report::percentile(&delays, 0.99).map(|us| us / 1000.0),
        delay_max_ms: delays.last().map(|&us| f64::from(us) / 1000.0),
        ttfb_p50_ms: report::percentile(&ttfbs, 0.50).map(|us| us / 1000.0),
        ttfb_p99_ms: report::percentile(&ttfbs, 0.99).map(|us| us / 1000.0),
        errors: failures.values().sum(),
        failures,
        pids: running.pids().to_vec(),
    })
}

/// `--uploads` uploads of `body` through `running`, one after the other.
async fn measure_uploads(args: &Args, running: &mut Running, body: &[u8]) -> UploadRun {
    let mut errors = Vec::new();
    if let Err(error) = warm_up(running.addr).await {
        errors.push(error);
    }
    running.settle();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = running.usage();
    let mut rates = Vec::new();
    for _ in 0..args.uploads {
        match client::upload(running.addr, body).await {
            Ok(took) => rates.push(body.len() as f64 / 1e6 / took.as_secs_f64()),
            Err(error) => errors.push(error),
        }
    }
    let peak = running.usage();
    let mut sorted = rates.clone();
    sorted.sort_by(f64::total_cmp);
    UploadRun {
        run: 0,
        peer: String::new(),
        mb_per_s: report::median(&sorted),
        each_mb_per_s: rates,
        idle_rss_kib: idle.map(|u| u.rss_kib),
        peak_rss_kib: peak.map(|u| u.hwm_kib),
        errors,
    }
}

/// `size` bytes drawn from the base64 alphabet.
fn upload_body(size: usize) -> Vec<u8> {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut rng = fastrand::Rng::with_seed(7);
    (0..size).map(|_| ALPHABET[rng.usize(..64)]).collect()
}

/// Raises the open-file limit of this process (and so of the proxies it starts) to 65536 with
/// `prlimit`, as far as it is allowed; returns the limit in force.
fn raise_nofile() -> u64 {
    let pid = std::process::id().to_string();
    for limit in ["65536:65536", "65536"] {
        let raised = Command::new("prlimit")
            .args(["--pid", &pid, &format!("--nofile={limit}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        if raised {
            break;
        }
    }
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|limits| {
            limits
                .lines()
                .find(|line| line.starts_with("Max open files"))
                .and_then(|line| line.split_whitespace().nth(3)?.parse().ok())
        })
        .unwrap_or(0)
}

/// The commit of the working tree, for the report.
fn git_commit() -> String {
    Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .output()
        .ok()
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .map(|text| text.trim().to_owned())
        .filter(|text| !text.is_empty())
        .unwrap_or_else(|| "unknown commit".to_owned())
}

fn utc_now() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .map(|text| text.trim().to_owned())
        .unwrap_or_default()
}
