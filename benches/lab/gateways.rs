//! The LLM routers an operator would install instead of this one, as peers: SMG (Shepherd Model
//! Gateway, formerly the SGLang router) and the vLLM router. Both are Rust binaries shipped in
//! Python wheels; the bench installs them itself, at pinned versions, in a virtual environment it
//! creates under the output directory ([`install`]), and runs each as a child process.
//!
//! - SMG: `smg launch --host 127.0.0.1 --port P --worker-urls URL... --policy POLICY
//!   --disable-tokenizer-autoload`, its metrics on a port of their own. It registers a worker once
//!   the worker answers `GET /v1/models`, and polls each worker's `/metrics`.
//! - The vLLM router: `vllm-router --host 127.0.0.1 --port P --worker-urls URL... --policy
//!   POLICY`. With `cache_aware` it asks every worker for the prompt's tokens
//!   (`POST /v1/chat/completions/render`) on every request.
//!
//! Both retry a failed request on another worker by default (SMG up to 5 attempts, the vLLM router
//! likewise) and are run with their defaults: the reports say so beside their numbers. A peer is
//! ready once a request for `GET /v1/models` through it is answered 200 (a worker is registered).
//! A new backend set adds the new workers through each router's admin API (SMG `POST /workers`,
//! the vLLM router `POST /add_worker?url=`).
#![allow(dead_code)]

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use super::LabError;
use super::load::http_client;
use super::router::stop_child;

/// The SMG release the bench installs.
pub const SMG_VERSION: &str = "1.13.0";

/// The vLLM router release the bench installs.
pub const VLLM_ROUTER_VERSION: &str = "0.1.17";

/// How long a gateway may take to register a worker after it starts.
const READY_LIMIT: Duration = Duration::from_secs(60);

/// How long a gateway may take to exit after SIGTERM before it is killed.
const STOP_LIMIT: Duration = Duration::from_secs(5);

/// Log lines kept for error messages.
const KEPT_LOG_LINES: usize = 30;

/// Which LLM router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gateway {
    /// SMG, `smg launch`.
    Smg,
    /// The vLLM router, `vllm-router`.
    VllmRouter,
}

impl Gateway {
    /// Its name in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Gateway::Smg => "smg",
            Gateway::VllmRouter => "vllm-router",
        }
    }

    fn executable(self) -> &'static str {
        match self {
            Gateway::Smg => "smg",
            Gateway::VllmRouter => "vllm-router",
        }
    }
}

/// An LLM router with one of its policies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewaySpec {
    /// Which router.
    pub gateway: Gateway,
    /// Its `--policy`, e.g. `cache_aware`.
    pub policy: String,
}

impl GatewaySpec {
    /// Every peer the suite runs by default: SMG `cache_aware`, `least_load` and `power_of_two`,
    /// the vLLM router `cache_aware` and `power_of_two`.
    pub fn defaults() -> Vec<Self> {
        [
            (Gateway::Smg, "cache_aware"),
            (Gateway::Smg, "least_load"),
            (Gateway::Smg, "power_of_two"),
            (Gateway::VllmRouter, "cache_aware"),
            (Gateway::VllmRouter, "power_of_two"),
        ]
        .into_iter()
        .map(|(gateway, policy)| Self {
            gateway,
            policy: policy.to_owned(),
        })
        .collect()
    }

    /// Parses `smg:POLICY` or `vllm-router:POLICY`.
    pub fn parse(text: &str) -> Result<Self, LabError> {
        let (name, policy) = text.split_once(':').ok_or_else(|| {
            LabError::new(format!(
                "LLM router {text:?}: expected smg:POLICY or vllm-router:POLICY"
            ))
        })?;
        let gateway = match name {
            "smg" => Gateway::Smg,
            "vllm-router" => Gateway::VllmRouter,
            _ => {
                return Err(LabError::new(format!(
                    "LLM router {text:?}: unknown router {name:?} (smg or vllm-router)"
                )));
            }
        };
        if policy.is_empty() || !policy.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
            return Err(LabError::new(format!(
                "LLM router {text:?}: expected a policy name such as cache_aware"
            )));
        }
        Ok(Self {
            gateway,
            policy: policy.to_owned(),
        })
    }

    /// The name shown in reports, e.g. `smg-cache-aware`.
    pub fn label(&self) -> String {
        format!("{}-{}", self.gateway.name(), self.policy.replace('_', "-"))
    }
}

/// Where the gateways' executables are, once installed.
#[derive(Debug, Clone)]
pub struct Installed {
    bin: PathBuf,
}

impl Installed {
    fn executable(&self, gateway: Gateway) -> PathBuf {
        self.bin.join(gateway.executable())
    }

    /// The versions installed, for the report's machine line.
    pub fn versions(&self) -> String {
        format!("smg {SMG_VERSION}, vllm-router {VLLM_ROUTER_VERSION}")
    }
}

/// Makes sure `dir` is a virtual environment holding the pinned releases: `python3 -m venv dir`,
/// then `pip install smg==… vllm-router==…`, unless a previous run did it (a marker file names the
/// versions). Errors say what failed (no `python3`, no network to PyPI).
pub fn install(dir: &Path) -> Result<Installed, LabError> {
    let bin = dir.join("bin");
    let marker = dir.join("bench-installed");
    let wanted = format!("smg=={SMG_VERSION} vllm-router=={VLLM_ROUTER_VERSION}\n");
    let installed = Installed { bin: bin.clone() };
    if std::fs::read_to_string(&marker).is_ok_and(|text| text == wanted)
        && [Gateway::Smg, Gateway::VllmRouter]
            .iter()
            .all(|gateway| installed.executable(*gateway).is_file())
    {
        return Ok(installed);
    }
    eprintln!(
        "[bench] installing smg {SMG_VERSION} and vllm-router {VLLM_ROUTER_VERSION} into {}",
        dir.display()
    );
    run(Command::new("python3").args(["-m", "venv"]).arg(dir))?;
    run(Command::new(bin.join("python3")).args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        &format!("smg=={SMG_VERSION}"),
        &format!("vllm-router=={VLLM_ROUTER_VERSION}"),
    ]))?;
    std::fs::write(&marker, wanted)?;
    Ok(installed)
}

fn run(command: &mut Command) -> Result<(), LabError> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| LabError::new(format!("cannot run {command:?}: {e}")))?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
    Err(LabError::new(format!(
        "{command:?} failed ({}): {}",
        output.status,
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    )))
}

/// A running gateway.
pub struct GatewayProcess {
    child: Child,
    /// Where clients send requests.
    pub addr: SocketAddr,
    gateway: Gateway,
    known: Vec<String>,
    log: Arc<Mutex<VecDeque<String>>>,
}

impl GatewayProcess {
    /// Starts `spec` from `installed` on free loopback ports, proxying to `backends`
    /// (`host:port` each), and waits until it answers through a registered worker.
    pub async fn start(
        installed: &Installed,
        spec: &GatewaySpec,
        backends: &[String],
    ) -> Result<Self, LabError> {
        let port = free_port()?;
        let metrics_port = free_port()?;
        let mut command = Command::new(installed.executable(spec.gateway));
        if spec.gateway == Gateway::Smg {
            command.arg("launch");
        }
        command
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .arg("--worker-urls")
            .args(backends.iter().map(|backend| format!("http://{backend}")))
            .args(["--policy", &spec.policy])
            .args(["--prometheus-host", "127.0.0.1"])
            .args(["--prometheus-port", &metrics_port.to_string()]);
        match spec.gateway {
            Gateway::Smg => command.args(["--disable-tokenizer-autoload", "--log-level", "warn"]),
            Gateway::VllmRouter => command.args(["--log-level", "warning"]),
        };
        command
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .map_err(|e| LabError::new(format!("cannot start {}: {e}", spec.label())))?;
        let stderr = child.stderr.take().expect("stderr is piped");
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let lines = Arc::clone(&log);
        std::thread::spawn(move || keep_log(BufReader::new(stderr), &lines));
        let mut process = Self {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            gateway: spec.gateway,
            known: backends.to_vec(),
            log,
        };
        process.wait_until_ready(spec).await?;
        Ok(process)
    }

    async fn wait_until_ready(&mut self, spec: &GatewaySpec) -> Result<(), LabError> {
        let started = tokio::time::Instant::now();
        while started.elapsed() < READY_LIMIT {
            if let Some(why) = self.exited() {
                return Err(LabError::new(format!(
                    "{} exited at start: {why}",
                    spec.label()
                )));
            }
            if get_status(self.addr, "/v1/models").await == Some(200) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(LabError::new(format!(
            "{} registered no worker within {READY_LIMIT:?}: {}",
            spec.label(),
            self.recent_log()
        )))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Why the process is gone, when it has exited.
    pub fn exited(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok()??;
        Some(format!("{status}; last log lines:\n{}", self.recent_log()))
    }

    fn recent_log(&self) -> String {
        let log = self.log.lock().expect("log lock");
        log.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// Adds the backends of `backends` it does not know yet through its admin API (a backend
    /// set only grows in the suite's scenarios).
    pub async fn set_backends(&mut self, backends: &[String]) -> Result<(), LabError> {
        for backend in backends {
            if self.known.contains(backend) {
                continue;
            }
            let url = format!("http://{backend}");
            let request = match self.gateway {
                Gateway::Smg => http::Request::post(format!("http://{}/workers", self.addr))
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(
                        serde_json::json!({ "url": url }).to_string(),
                    ))),
                Gateway::VllmRouter => {
                    http::Request::post(format!("http://{}/add_worker?url={url}", self.addr))
                        .body(Full::new(Bytes::new()))
                }
            }
            .expect("a valid request");
            let response = http_client()
                .request(request)
                .await
                .map_err(|e| LabError::new(format!("adding {url}: {e}")))?;
            let status = response.status();
            let answer = response
                .into_body()
                .collect()
                .await
                .map(|body| String::from_utf8_lossy(&body.to_bytes()).into_owned())
                .unwrap_or_default();
            if !status.is_success() {
                return Err(LabError::new(format!(
                    "adding {url} answered {status}: {answer}"
                )));
            }
            self.known.push(backend.clone());
        }
        Ok(())
    }

    /// SIGTERM, then SIGKILL if it has not exited within a few seconds.
    pub fn stop(mut self) {
        stop_child(&mut self.child, STOP_LIMIT);
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port: bound once, then released for the gateway to bind.
fn free_port() -> Result<u16, LabError> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The status of `GET path` at `addr`, `None` when nothing answered.
async fn get_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let request = http::Request::get(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::new()))
        .ok()?;
    let response = tokio::time::timeout(Duration::from_secs(2), http_client().request(request))
        .await
        .ok()?
        .ok()?;
    let status = response.status().as_u16();
    let _ = response.into_body().collect().await;
    Some(status)
}

/// Keeps the last lines of the gateway's log until its pipe closes.
fn keep_log(reader: impl BufRead, log: &Mutex<VecDeque<String>>) {
    for line in reader.lines() {
        let Ok(line) = line else { break };
        let mut log = log.lock().expect("log lock");
        if log.len() == KEPT_LOG_LINES {
            log.pop_front();
        }
        log.push_back(line);
    }
}
