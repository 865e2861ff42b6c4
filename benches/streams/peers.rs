//! The proxies under test, run as child processes, and what `/proc` says about them.
//!
//! - `router`: the custom-router binary, `round-robin`, one runtime thread (its default),
//!   `max_connections` raised to fit every stream, the in-process backend set with
//!   `POST /_custom_router/set-backends`.
//! - `nginx`: one worker (master process on), `worker_connections` and
//!   `worker_rlimit_nofile` the open-file limit,
//!   `proxy_buffering off`, `proxy_request_buffering off` (so an upload is streamed, as the
//!   router and HAProxy do, rather than spooled to a temporary file first),
//!   `client_max_body_size 0`, HTTP/1.1 with keep-alive to the upstream.
//! - `haproxy`: one thread, HTTP mode, keep-alive on both sides, `http-reuse always`,
//!   `maxconn` half the open-file limit (at most 30000), client and server timeouts of 300 s,
//!   and `option http-no-delay`: without it HAProxy sends with `MSG_MORE` while a message is
//!   unfinished, and the kernel holds each small event for up to 200 ms (p50 event delay 111 ms
//!   and TTFB 212 ms at 500 streams in a trial run).
//! - `*-2`: the same with two workers or threads, for the `--two-workers` runs.
//!
//! A peer runs only if its executable exists. Each is started fresh for every measurement,
//! pinned to its CPUs with `taskset` when asked.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What a peer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// No proxy: the client reads the backend itself (the load generator's own floor).
    Direct,
    Router,
    Nginx,
    Haproxy,
}

/// A peer to measure.
#[derive(Debug, Clone)]
pub struct Peer {
    pub name: String,
    pub kind: Kind,
    /// Worker processes or threads.
    pub workers: usize,
    /// The CPUs it is pinned to (`taskset -c`), if any.
    pub cpus: Option<String>,
}

/// Where the proxies' executables are.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub router: PathBuf,
    pub nginx: Option<PathBuf>,
    pub haproxy: Option<PathBuf>,
    pub taskset: Option<PathBuf>,
}

/// `name` on `PATH`, or in `/usr/sbin` or `/usr/local/sbin`.
pub fn find(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The first line a command prints (to either stream) with `args`, e.g. a version.
pub fn first_line(binary: &Path, args: &[&str]) -> String {
    Command::new(binary)
        .args(args)
        .output()
        .ok()
        .map(|output| {
            let text = [output.stdout, output.stderr].concat();
            String::from_utf8_lossy(&text)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_owned()
        })
        .unwrap_or_default()
}

/// A started peer.
pub struct Running {
    /// Where clients connect.
    pub addr: SocketAddr,
    child: Option<Child>,
    /// The process and its children (nginx's workers), once known.
    pids: Vec<u32>,
}

/// CPU and memory of a peer's processes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    /// utime + stime, in clock ticks.
    pub cpu_ticks: u64,
    /// VmRSS, KiB.
    pub rss_kib: u64,
    /// VmHWM (peak RSS), KiB.
    pub hwm_kib: u64,
}

impl Running {
    /// No process: the backend itself.
    pub fn direct(backend: SocketAddr) -> Self {
        Self {
            addr: backend,
            child: None,
            pids: Vec::new(),
        }
    }

    /// Notes the process's children (call once it has served a request, so that nginx's
    /// workers exist).
    pub fn settle(&mut self) {
        if let Some(child) = &self.child {
            let pid = child.id();
            self.pids = std::iter::once(pid).chain(children(pid)).collect();
        }
    }

    /// The processes measured.
    pub fn pids(&self) -> &[u32] {
        &self.pids
    }

    /// CPU and memory summed over the processes; `None` without a process.
    pub fn usage(&self) -> Option<Usage> {
        if self.pids.is_empty() {
            return None;
        }
        let mut usage = Usage::default();
        for &pid in &self.pids {
            let own = process_usage(pid)?;
            usage.cpu_ticks += own.cpu_ticks;
            usage.rss_kib += own.rss_kib;
            usage.hwm_kib += own.hwm_kib;
        }
        Some(usage)
    }

    /// SIGTERM, then SIGKILL after a few seconds.
    pub fn stop(mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        signal(child.id(), "TERM");
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            signal(child.id(), "TERM");
            std::thread::sleep(Duration::from_millis(200));
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts `peer` in `dir`, proxying to `backend`, and waits until it accepts connections.
///
/// `nofile` is the open-file limit the peer inherits: nginx's `worker_rlimit_nofile` and
/// `worker_connections` and HAProxy's `maxconn` are sized to it (HAProxy refuses to start when
/// its `maxconn` needs more descriptors than it may open).
pub async fn start(
    peer: &Peer,
    binaries: &Binaries,
    backend: SocketAddr,
    dir: &Path,
    nofile: u64,
) -> Result<Running, String> {
    if peer.kind == Kind::Direct {
        return Ok(Running::direct(backend));
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut last_error = String::new();
    // A port that was free may be taken by the time the peer binds it: try a few.
    for _ in 0..5 {
        let port = free_port().map_err(|e| format!("no free port: {e}"))?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let log = std::fs::File::create(dir.join("output.log")).map_err(|e| e.to_string())?;
        let (program, args, env) = match peer.kind {
            Kind::Router => (
                binaries.router.clone(),
                Vec::new(),
                vec![
                    ("CUSTOM_ROUTER_HOST", "127.0.0.1".to_owned()),
                    ("CUSTOM_ROUTER_PORT", port.to_string()),
                    ("CUSTOM_ROUTER_STRATEGY", "round-robin".to_owned()),
                    ("CUSTOM_ROUTER_MAX_CONNECTIONS", "30000".to_owned()),
                    ("CUSTOM_ROUTER_WORKER_THREADS", peer.workers.to_string()),
                    ("RUST_LOG", "warn".to_owned()),
                ],
            ),
            Kind::Nginx => {
                let config = dir.join("nginx.conf");
                std::fs::write(
                    &config,
                    nginx_config(dir, port, backend, peer.workers, nofile),
                )
                .map_err(|e| e.to_string())?;
                let args = vec![
                    "-c".into(),
                    config.display().to_string(),
                    "-p".into(),
                    dir.display().to_string(),
                    "-e".into(),
                    dir.join("error.log").display().to_string(),
                ];
                (binaries.nginx.clone().ok_or("no nginx")?, args, Vec::new())
            }
            Kind::Haproxy => {
                let config = dir.join("haproxy.cfg");
                std::fs::write(&config, haproxy_config(port, backend, peer.workers, nofile))
                    .map_err(|e| e.to_string())?;
                let args = vec!["-f".into(), config.display().to_string(), "-db".into()];
                (
                    binaries.haproxy.clone().ok_or("no haproxy")?,
                    args,
                    Vec::new(),
                )
            }
            Kind::Direct => unreachable!("handled above"),
        };
        let mut command = match (&peer.cpus, &binaries.taskset) {
            (Some(cpus), Some(taskset)) => {
                let mut command = Command::new(taskset);
                command.arg("-c").arg(cpus).arg(&program);
                command
            }
            _ => Command::new(&program),
        };
        command
            .args(&args)
            .envs(env)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let child = command
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", program.display()))?;
        let mut running = Running {
            addr,
            child: Some(child),
            pids: Vec::new(),
        };
        match wait_ready(&mut running).await {
            Ok(()) => {
                if peer.kind == Kind::Router {
                    set_backends(addr, backend).await?;
                }
                return Ok(running);
            }
            Err(error) => {
                let output = std::fs::read_to_string(dir.join("output.log")).unwrap_or_default();
                let errors = std::fs::read_to_string(dir.join("error.log")).unwrap_or_default();
                last_error = format!("{error}\n{output}{errors}");
                running.stop();
            }
        }
    }
    Err(format!("{} did not start: {last_error}", peer.name))
}

/// Waits until the peer accepts a connection, or exits.
async fn wait_ready(running: &mut Running) -> Result<(), String> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if let Some(child) = running.child.as_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("exited: {status}"));
            }
        }
        if TcpStream::connect(running.addr).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Err("not listening after 10 s".to_owned())
}

/// `POST /_custom_router/set-backends` with the backend.
async fn set_backends(router: SocketAddr, backend: SocketAddr) -> Result<(), String> {
    let body = format!(r#"{{"backends":["{backend}"]}}"#);
    let request = format!(
        "POST /_custom_router/set-backends HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect(router)
        .await
        .map_err(|e| format!("set-backends: {e}"))?;
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("set-backends: {e}"))?;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
    if answer.starts_with(b"HTTP/1.1 200") {
        Ok(())
    } else {
        Err(format!(
            "set-backends answered: {}",
            String::from_utf8_lossy(&answer)
        ))
    }
}

fn nginx_config(dir: &Path, port: u16, backend: SocketAddr, workers: usize, nofile: u64) -> String {
    let dir = dir.display();
    let connections = nofile.saturating_sub(64).max(1024);
    let user = if is_root() { "user root;\n" } else { "" };
    let mut config = String::new();
    let _ = write!(
        config,
        "{user}worker_processes {workers};
worker_rlimit_nofile {nofile};
daemon off;
master_process on;
pid {dir}/nginx.pid;
events {{ worker_connections {connections}; }}
http {{
  access_log off;
  client_body_temp_path {dir}/client_body;
  proxy_temp_path {dir}/proxy;
  client_max_body_size 0;
  upstream up {{ server {backend}; keepalive 1024; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection \"\";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 300s;
      proxy_send_timeout 300s;
    }}
  }}
}}
"
    );
    config
}

fn haproxy_config(port: u16, backend: SocketAddr, threads: usize, nofile: u64) -> String {
    // Two descriptors per connection (client and server side), and some to spare.
    let maxconn = (nofile.saturating_sub(200) / 2).clamp(1024, 30000);
    format!(
        "global
    nbthread {threads}
    maxconn {maxconn}

defaults
    mode http
    maxconn {maxconn}
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    timeout http-keep-alive 60s
    option http-keep-alive
    option http-no-delay

frontend streams
    bind 127.0.0.1:{port}
    default_backend replicas

backend replicas
    balance roundrobin
    http-reuse always
    server r1 {backend}
"
    )
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Uid:"))
                .map(|uids| uids.split_whitespace().next() == Some("0"))
        })
        .unwrap_or(false)
}

/// A loopback port nothing listens on right now.
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Sends `signal` (e.g. `TERM`) to `pid` with `kill`.
fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The children of `pid` (every thread's `children` file).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("children")).ok())
        .flat_map(|text| {
            text.split_whitespace()
                .filter_map(|pid| pid.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// One process's CPU ticks, VmRSS and VmHWM.
pub fn process_usage(pid: u32) -> Option<Usage> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    // After the command name: utime is field 14 of proc(5), stime 15.
    let cpu_ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    Some(Usage {
        cpu_ticks,
        rss_kib: kib("VmRSS"),
        hwm_kib: kib("VmHWM"),
    })
}

/// Clock ticks per second (`getconf CLK_TCK`, 100 unless it says otherwise).
pub fn ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(100.0)
}
