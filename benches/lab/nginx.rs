//! nginx as a reference peer: its configuration and its process.
//!
//! One worker process, keep-alive connections to the upstreams (`keepalive 64`), HTTP/1.1 with
//! the `Connection` header cleared, response buffering off (so streams pass through token by
//! token) and nginx's default `proxy_next_upstream error timeout`. Every path (pid, logs, temp
//! files) lives under the peer's own directory. A new backend set rewrites the configuration and
//! reloads it with SIGHUP, as an operator would.
//!
//! nginx must be told its port, so a port is tried and, if nginx reports it taken, another one is
//! (a bounded number of times). Readiness and reloads are confirmed by a location that answers the
//! configuration's generation.
#![allow(dead_code)]

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use super::LabError;
use super::load::http_client;
use super::router::{send_signal, stop_child};

/// Ports tried before giving up.
const PORT_ATTEMPTS: u32 = 20;

/// How long nginx may take to answer after a start or a reload.
const READY_LIMIT: Duration = Duration::from_secs(10);

/// The path answering the configuration's generation.
const GENERATION_PATH: &str = "/_bench_nginx_generation";

/// nginx's upstream balancing method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    /// Weighted round-robin (nginx's default).
    RoundRobin,
    /// `least_conn`.
    LeastConn,
}

/// The `nginx` executable: the first on `PATH`, else `/usr/sbin/nginx`.
pub fn find_nginx() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("nginx"))
        .find(|candidate| candidate.is_file())
}

/// `nginx -v`, e.g. `nginx/1.22.1`.
pub fn version(binary: &Path) -> String {
    Command::new(binary)
        .arg("-v")
        .output()
        .ok()
        .map(|output| String::from_utf8_lossy(&output.stderr).into_owned())
        .and_then(|text| text.trim().rsplit(' ').next().map(str::to_owned))
        .unwrap_or_else(|| "nginx".to_owned())
}

/// A running nginx (master plus one worker).
pub struct NginxProcess {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    dir: PathBuf,
    balance: Balance,
    generation: u64,
    temp_modules: Vec<&'static str>,
}

impl NginxProcess {
    /// Starts nginx from `binary` in `dir` (created), proxying to `backends`.
    pub async fn start(
        binary: &Path,
        dir: &Path,
        balance: Balance,
        backends: &[String],
    ) -> Result<Self, LabError> {
        std::fs::create_dir_all(dir)?;
        let temp_modules = temp_path_modules(binary);
        let mut last_error = String::new();
        for attempt in 0..PORT_ATTEMPTS {
            let port = candidate_port(attempt);
            let config = NginxConfig {
                dir,
                port,
                balance,
                backends,
                generation: 1,
                temp_modules: &temp_modules,
            };
            std::fs::write(dir.join("nginx.conf"), config.render())?;
            let _ = std::fs::remove_file(dir.join("error.log"));
            let child = spawn_nginx(binary, dir)?;
            let mut nginx = Self {
                child,
                addr: SocketAddr::from(([127, 0, 0, 1], port)),
                dir: dir.to_owned(),
                balance,
                generation: 1,
                temp_modules: temp_modules.clone(),
            };
            match nginx.wait_for_generation().await {
                Ok(()) => return Ok(nginx),
                Err(error) => last_error = error.to_string(),
            }
            let error_log = std::fs::read_to_string(dir.join("error.log")).unwrap_or_default();
            if !error_log.contains("Address already in use") {
                return Err(LabError::new(format!(
                    "nginx did not start: {last_error}\n{error_log}"
                )));
            }
        }
        Err(LabError::new(format!(
            "nginx found no free port in {PORT_ATTEMPTS} tries: {last_error}"
        )))
    }

    /// Why the master process is gone, when it has exited.
    pub fn exited(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok()??;
        let error_log = std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default();
        Some(format!("{status}; error.log:\n{error_log}"))
    }

    /// The master's process id (its workers are its children).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Rewrites the upstream list and reloads (SIGHUP); returns once the new configuration answers.
    pub async fn set_backends(&mut self, backends: &[String]) -> Result<(), LabError> {
        self.generation += 1;
        let config = NginxConfig {
            dir: &self.dir,
            port: self.addr.port(),
            balance: self.balance,
            backends,
            generation: self.generation,
            temp_modules: &self.temp_modules,
        };
        std::fs::write(self.dir.join("nginx.conf"), config.render())?;
        if !send_signal(self.pid(), "HUP") {
            return Err(LabError::new("cannot send SIGHUP to nginx"));
        }
        self.wait_for_generation().await
    }

    /// Fast shutdown (SIGTERM), then SIGKILL after a few seconds.
    pub fn stop(mut self) {
        stop_child(&mut self.child, Duration::from_secs(5));
    }

    /// Polls the generation location until it answers the current generation.
    async fn wait_for_generation(&mut self) -> Result<(), LabError> {
        let expected = self.generation.to_string();
        let client = http_client();
        let url = format!("http://{}{GENERATION_PATH}", self.addr);
        let start = Instant::now();
        while start.elapsed() < READY_LIMIT {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(LabError::new(format!("nginx exited: {status}")));
            }
            let request = http::Request::get(&url)
                .body(Full::new(Bytes::new()))
                .expect("a valid request");
            if let Ok(response) = client.request(request).await {
                let body = response.into_body().collect().await.map(|b| b.to_bytes());
                if body.is_ok_and(|body| body == expected.as_bytes()) {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(LabError::new(format!(
            "nginx did not answer generation {expected} within {READY_LIMIT:?}"
        )))
    }
}

impl Drop for NginxProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            stop_child(&mut self.child, Duration::from_secs(2));
        }
    }
}

fn spawn_nginx(binary: &Path, dir: &Path) -> Result<Child, LabError> {
    Command::new(binary)
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(dir.join("nginx.conf"))
        .arg("-e")
        .arg(dir.join("error.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| LabError::new(format!("cannot start {}: {e}", binary.display())))
}

/// A port in 20000..32000 (below Linux's ephemeral range), different per attempt and per process.
fn candidate_port(attempt: u32) -> u16 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.subsec_nanos());
    let mix =
        u64::from(std::process::id()) * 7919 + u64::from(attempt) * 104_729 + u64::from(nanos);
    20_000 + (mix % 12_000) as u16
}

/// The optional modules whose temp path this nginx knows (from `nginx -V`).
fn temp_path_modules(binary: &Path) -> Vec<&'static str> {
    let configure = Command::new(binary)
        .arg("-V")
        .output()
        .map(|output| String::from_utf8_lossy(&output.stderr).into_owned())
        .unwrap_or_default();
    ["fastcgi", "uwsgi", "scgi"]
        .into_iter()
        .filter(|module| configure.contains(&format!("--http-{module}-temp-path")))
        .collect()
}

/// Whether this process runs as root (nginx workers must then run as root too, to write under
/// the output directory).
fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|euid| euid == "0"))
        })
        .unwrap_or(false)
}

/// The inputs of one `nginx.conf`.
struct NginxConfig<'a> {
    dir: &'a Path,
    port: u16,
    balance: Balance,
    backends: &'a [String],
    generation: u64,
    temp_modules: &'a [&'static str],
}

impl NginxConfig<'_> {
    fn render(&self) -> String {
        let dir = self.dir.display();
        let mut text = String::new();
        if running_as_root() {
            text.push_str("user root;\n");
        }
        let _ = write!(
            text,
            "worker_processes 1;\ndaemon off;\nmaster_process on;\npid {dir}/nginx.pid;\n\
             error_log {dir}/error.log warn;\n\
             events {{ worker_connections 8192; }}\n\
             http {{\n  access_log off;\n  keepalive_requests 1000000;\n  keepalive_timeout 75s;\n\
             \x20 client_body_temp_path {dir}/client_body_temp;\n  proxy_temp_path {dir}/proxy_temp;\n"
        );
        for module in self.temp_modules {
            let _ = writeln!(text, "  {module}_temp_path {dir}/{module}_temp;");
        }
        text.push_str(&self.upstream());
        let _ = write!(
            text,
            "  server {{\n    listen 127.0.0.1:{port};\n\
             \x20   location = {GENERATION_PATH} {{ return 200 \"{generation}\"; }}\n\
             \x20   location / {{\n      proxy_pass http://backends;\n\
             \x20     proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n\
             \x20     proxy_buffering off;\n      proxy_next_upstream error timeout;\n\
             \x20     proxy_read_timeout 300s;\n    }}\n  }}\n}}\n",
            port = self.port,
            generation = self.generation,
        );
        text
    }

    fn upstream(&self) -> String {
        let mut text = String::from("  upstream backends {\n");
        if self.balance == Balance::LeastConn {
            text.push_str("    least_conn;\n");
        }
        for backend in self.backends {
            let _ = writeln!(text, "    server {backend};");
        }
        text.push_str("    keepalive 64;\n    keepalive_requests 1000000;\n  }\n");
        text
    }
}
