//! What a scenario sends its traffic through: the router with one strategy, nginx, or an LLM
//! router (SMG, the vLLM router).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use super::LabError;
use super::gateways::{GatewayProcess, GatewaySpec, Installed};
use super::load::http_client;
use super::nginx::{Balance, NginxProcess};
use super::router::{ProcessUsage, RouterProcess};

/// One column of the comparison.
#[derive(Debug, Clone)]
pub enum PeerSpec {
    /// The router binary running a registered strategy, with strategy parameters when given.
    Strategy(StrategySpec),
    /// nginx from this executable with this balancing method.
    Nginx { binary: PathBuf, balance: Balance },
    /// An LLM router (SMG or the vLLM router) with one of its policies.
    Gateway {
        installed: Installed,
        spec: GatewaySpec,
    },
}

impl PeerSpec {
    /// The name shown in reports.
    pub fn name(&self) -> String {
        match self {
            PeerSpec::Strategy(spec) => spec.label(),
            PeerSpec::Nginx {
                balance: Balance::RoundRobin,
                ..
            } => "nginx-round-robin".to_owned(),
            PeerSpec::Nginx {
                balance: Balance::LeastConn,
                ..
            } => "nginx-least-conn".to_owned(),
            PeerSpec::Gateway { spec, .. } => spec.label(),
        }
    }

    /// Whether the peer retries a failed request on another backend on its own (the LLM
    /// routers do by default; the router retries within its retry budget, nginx on connection
    /// errors only).
    pub fn is_gateway(&self) -> bool {
        matches!(self, PeerSpec::Gateway { .. })
    }

    /// Starts the peer proxying to `backends`. `work_dir` holds nginx's files. A router writes
    /// its access log to `access_log` when one is given (nginx's is off).
    pub async fn start(
        &self,
        router_binary: &Path,
        work_dir: &Path,
        backends: &[String],
        access_log: Option<&Path>,
    ) -> Result<RunningPeer, LabError> {
        match self {
            PeerSpec::Strategy(spec) => {
                let binary = router_binary.to_owned();
                let strategy = spec.name.clone();
                let mut env = Vec::new();
                if !spec.params.is_empty() {
                    let dir = work_dir.join(self.name());
                    std::fs::create_dir_all(&dir).map_err(|e| {
                        LabError::new(format!("cannot create {}: {e}", dir.display()))
                    })?;
                    let file = dir.join("router.toml");
                    std::fs::write(&file, spec.config_toml()).map_err(|e| {
                        LabError::new(format!("cannot write {}: {e}", file.display()))
                    })?;
                    env.push((
                        "CUSTOM_ROUTER_CONFIG".to_owned(),
                        file.display().to_string(),
                    ));
                }
                let access_log = access_log.map(Path::to_owned);
                if let Some(path) = &access_log {
                    if let Some(dir) = path.parent() {
                        std::fs::create_dir_all(dir).map_err(|e| {
                            LabError::new(format!("cannot create {}: {e}", dir.display()))
                        })?;
                    }
                    env.push(("CUSTOM_ROUTER_ACCESS_LOG".to_owned(), "true".to_owned()));
                }
                let router = tokio::task::spawn_blocking(move || {
                    RouterProcess::start(&binary, &strategy, &env, access_log.as_deref())
                })
                .await
                .map_err(|e| LabError::new(e.to_string()))??;
                let mut peer = RunningPeer::Router(router);
                peer.set_backends(backends).await?;
                Ok(peer)
            }
            PeerSpec::Nginx { binary, balance } => {
                let dir = work_dir.join(self.name());
                let nginx = NginxProcess::start(binary, &dir, *balance, backends).await?;
                Ok(RunningPeer::Nginx(nginx))
            }
            PeerSpec::Gateway { installed, spec } => Ok(RunningPeer::Gateway(
                GatewayProcess::start(installed, spec, backends).await?,
            )),
        }
    }
}

/// A registered strategy and the parameters it runs with: `NAME` or `NAME:KEY=VALUE,...`
/// (for example `queued-least-latency:score=ewma`). A key `config.KEY` sets the router's key
/// `KEY` instead, dotted for a section (for example `config.queue.shed_ratio=0`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StrategySpec {
    /// Registry name.
    pub name: String,
    /// `[strategy.params]` entries, in the order given; values are TOML (a bare word is a
    /// string).
    pub params: Vec<(String, String)>,
}

impl StrategySpec {
    /// Parses `NAME` or `NAME:KEY=VALUE,...`.
    pub fn parse(spec: &str) -> Result<Self, LabError> {
        let (name, params) = match spec.split_once(':') {
            Some((name, params)) => (name, params),
            None => (spec, ""),
        };
        let params = params
            .split(',')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                pair.split_once('=')
                    .filter(|(key, value)| !key.is_empty() && !value.is_empty())
                    .map(|(key, value)| (key.trim().to_owned(), value.trim().to_owned()))
                    .ok_or_else(|| {
                        LabError::new(format!(
                            "strategy {spec:?}: expected KEY=VALUE after the name, found {pair:?}"
                        ))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            name: name.to_owned(),
            params,
        })
    }

    /// The name shown in reports: the spec as given.
    pub fn label(&self) -> String {
        if self.params.is_empty() {
            return self.name.clone();
        }
        let params: Vec<String> = self
            .params
            .iter()
            .map(|(key, value)| format!("{key}={value}"))
            .collect();
        format!("{}:{}", self.name, params.join(","))
    }

    /// The router's configuration file for this spec.
    pub fn config_toml(&self) -> String {
        let literal = |value: &String| {
            if value.parse::<f64>().is_ok() || value == "true" || value == "false" {
                value.clone()
            } else {
                format!("{value:?}")
            }
        };
        let mut top = String::new();
        let mut params = String::new();
        for (key, value) in &self.params {
            match key.strip_prefix("config.") {
                Some(key) => top.push_str(&format!("{key} = {}\n", literal(value))),
                None => params.push_str(&format!("{key} = {}\n", literal(value))),
            }
        }
        format!(
            "{top}[strategy]\nname = {:?}\n[strategy.params]\n{params}",
            self.name
        )
    }
}

/// A started peer.
pub enum RunningPeer {
    /// The router binary.
    Router(RouterProcess),
    /// nginx.
    Nginx(NginxProcess),
    /// An LLM router.
    Gateway(GatewayProcess),
}

impl RunningPeer {
    /// Where clients send requests.
    pub fn addr(&self) -> SocketAddr {
        match self {
            RunningPeer::Router(router) => router.addr,
            RunningPeer::Nginx(nginx) => nginx.addr,
            RunningPeer::Gateway(gateway) => gateway.addr,
        }
    }

    /// The process whose tree is measured.
    pub fn pid(&self) -> u32 {
        match self {
            RunningPeer::Router(router) => router.pid(),
            RunningPeer::Nginx(nginx) => nginx.pid(),
            RunningPeer::Gateway(gateway) => gateway.pid(),
        }
    }

    /// Why the peer's process is gone, when it exited on its own (a run with a dead peer has no
    /// numbers worth reporting).
    pub fn exited(&mut self) -> Option<String> {
        match self {
            RunningPeer::Router(router) => router.exited(),
            RunningPeer::Nginx(nginx) => nginx.exited(),
            RunningPeer::Gateway(gateway) => gateway.exited(),
        }
    }

    /// CPU and memory of the peer's processes.
    pub fn usage(&self) -> ProcessUsage {
        ProcessUsage::of_tree(self.pid())
    }

    /// Replaces the backend set: `POST /_custom_router/set-backends`, or nginx's reload.
    pub async fn set_backends(&mut self, backends: &[String]) -> Result<(), LabError> {
        match self {
            RunningPeer::Router(router) => post_backends(router.addr, backends).await,
            RunningPeer::Nginx(nginx) => nginx.set_backends(backends).await,
            RunningPeer::Gateway(gateway) => gateway.set_backends(backends).await,
        }
    }

    /// Stops the peer's processes.
    pub async fn stop(self) {
        let _ = tokio::task::spawn_blocking(move || match self {
            RunningPeer::Router(router) => router.stop(),
            RunningPeer::Nginx(nginx) => nginx.stop(),
            RunningPeer::Gateway(gateway) => gateway.stop(),
        })
        .await;
    }
}

/// `POST /_custom_router/set-backends` on the router at `addr`; an error unless it answers 200.
pub async fn post_backends(addr: SocketAddr, backends: &[String]) -> Result<(), LabError> {
    let body = serde_json::json!({ "backends": backends }).to_string();
    let request = http::Request::post(format!("http://{addr}/_custom_router/set-backends"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("a valid request");
    let response = http_client()
        .request(request)
        .await
        .map_err(|e| LabError::new(format!("set-backends: {e}")))?;
    let status = response.status();
    let answer = response
        .into_body()
        .collect()
        .await
        .map(|body| String::from_utf8_lossy(&body.to_bytes()).into_owned())
        .unwrap_or_default();
    if status.is_success() {
        Ok(())
    } else {
        Err(LabError::new(format!(
            "set-backends answered {status}: {answer}"
        )))
    }
}
