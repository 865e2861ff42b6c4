//! The router binary run as a child process, and CPU / memory readings from `/proc`.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::LabError;

/// Log lines kept for error messages.
const KEPT_LOG_LINES: usize = 50;

/// How long the router may take to report its port.
const START_LIMIT: Duration = Duration::from_secs(20);

/// How long the router may take to exit after SIGTERM before it is killed.
const STOP_LIMIT: Duration = Duration::from_secs(5);

/// A running router process.
pub struct RouterProcess {
    child: Child,
    /// Where it listens (loopback, the port it reported).
    pub addr: SocketAddr,
    log: Arc<Mutex<VecDeque<String>>>,
}

impl RouterProcess {
    /// Starts `binary` on a free port with JSON logs, strategy `strategy` and `extra_env`, and
    /// waits for its "listening" log line. Its standard output (the access log, when on) goes
    /// to `stdout` when given.
    pub fn start(
        binary: &Path,
        strategy: &str,
        extra_env: &[(String, String)],
        stdout: Option<&Path>,
    ) -> Result<Self, LabError> {
        let stdout = match stdout {
            Some(path) => Stdio::from(
                std::fs::File::create(path)
                    .map_err(|e| LabError::new(format!("cannot create {}: {e}", path.display())))?,
            ),
            None => Stdio::null(),
        };
        let mut command = Command::new(binary);
        command
            .env_clear()
            .env("CUSTOM_ROUTER_PORT", "0")
            .env("CUSTOM_ROUTER_STRATEGY", strategy)
            .env("CUSTOM_ROUTER_LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .envs(extra_env.iter().map(|(key, value)| (key, value)))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .map_err(|e| LabError::new(format!("cannot start {}: {e}", binary.display())))?;
        let stderr = child.stderr.take().expect("stderr is piped");
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let (port_sender, port_receiver) = std::sync::mpsc::channel();
        let lines = Arc::clone(&log);
        std::thread::spawn(move || read_log(BufReader::new(stderr), &lines, port_sender));
        let mut router = Self {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            log,
        };
        match port_receiver.recv_timeout(START_LIMIT) {
            Ok(port) => router.addr.set_port(port),
            Err(_) => {
                return Err(LabError::new(format!(
                    "router ({strategy}) did not report its port: {}",
                    router.recent_log()
                )));
            }
        }
        Ok(router)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Why the process is gone, when it has exited: its status and its last log lines.
    pub fn exited(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok()??;
        Some(format!("{status}; last log lines:\n{}", self.recent_log()))
    }

    /// The last log lines, joined.
    pub fn recent_log(&self) -> String {
        let log = self.log.lock().expect("log lock");
        log.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// SIGTERM, then SIGKILL if it has not exited within a few seconds.
    pub fn stop(mut self) {
        stop_child(&mut self.child, STOP_LIMIT);
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads log lines until the pipe closes, sending the port of the first line with a `listen`
/// field and keeping the last few lines.
fn read_log(
    reader: impl BufRead,
    log: &Mutex<VecDeque<String>>,
    port_sender: std::sync::mpsc::Sender<u16>,
) {
    let mut port_sender = Some(port_sender);
    for line in reader.lines() {
        let Ok(line) = line else { break };
        if let Some(port) = listen_port(&line) {
            if let Some(sender) = port_sender.take() {
                let _ = sender.send(port);
            }
        }
        let mut log = log.lock().expect("log lock");
        if log.len() == KEPT_LOG_LINES {
            log.pop_front();
        }
        log.push_back(line);
    }
}

/// The port of a JSON log line's `listen` field (`[::]:PORT` or `0.0.0.0:PORT`).
fn listen_port(line: &str) -> Option<u16> {
    let entry: Value = serde_json::from_str(line).ok()?;
    entry["listen"].as_str()?.rsplit(':').next()?.parse().ok()
}

/// Sends SIGTERM to `child`, waits up to `limit`, then kills it.
pub fn stop_child(child: &mut Child, limit: Duration) {
    send_signal(child.id(), "TERM");
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Sends `signal` (e.g. `TERM`, `HUP`) to `pid` with `kill`.
pub fn send_signal(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// CPU time and memory of a process and its direct children (nginx's workers), read from `/proc`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessUsage {
    /// User plus system CPU seconds since the processes started.
    pub cpu_seconds: f64,
    /// Resident memory in KiB (`VmRSS`), summed.
    pub rss_kib: u64,
}

impl ProcessUsage {
    /// Reads `pid` and every process whose parent is `pid`.
    pub fn of_tree(pid: u32) -> Self {
        let mut pids = vec![pid];
        pids.extend(children_of(pid));
        let ticks_per_second = clock_ticks_per_second();
        let mut usage = Self::default();
        for pid in pids {
            if let Some(ticks) = cpu_ticks(pid) {
                usage.cpu_seconds += ticks as f64 / ticks_per_second;
            }
            usage.rss_kib += status_kib(pid, "VmRSS").unwrap_or(0);
        }
        usage
    }
}

/// `utime + stime` of `/proc/<pid>/stat`, in clock ticks (every thread of the process).
fn cpu_ticks(pid: u32) -> Option<u64> {
    let fields = stat_fields(pid)?;
    // After the command name: state is field 3 of the man page, utime 14, stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// The fields of `/proc/<pid>/stat` after the parenthesised command name.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    Some(after_name.split_whitespace().map(str::to_owned).collect())
}

/// Processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&candidate| {
            stat_fields(candidate)
                .and_then(|fields| fields.get(1)?.parse::<u32>().ok())
                .is_some_and(|parent| parent == pid)
        })
        .collect()
}

/// A `kB` field of `/proc/<pid>/status`, e.g. `VmRSS` or `VmHWM`.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// `getconf CLK_TCK` (100 on Linux unless it says otherwise).
fn clock_ticks_per_second() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|output| String::from_utf8(output.stdout).ok())
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(100.0)
    })
}
