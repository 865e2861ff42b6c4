//! What a scenario sends its traffic through: the router with one strategy, or nginx.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use super::LabError;
use super::load::http_client;
use super::nginx::{Balance, NginxProcess};
use super::router::{ProcessUsage, RouterProcess};

/// One column of the comparison.
#[derive(Debug, Clone)]
pub enum PeerSpec {
    /// The router binary with `CUSTOM_ROUTER_STRATEGY` set to this registry name.
    Strategy(String),
    /// nginx from this executable with this balancing method.
    Nginx { binary: PathBuf, balance: Balance },
}

impl PeerSpec {
    /// The name shown in reports.
    pub fn name(&self) -> String {
        match self {
            PeerSpec::Strategy(name) => name.clone(),
            PeerSpec::Nginx {
                balance: Balance::RoundRobin,
                ..
            } => "nginx-round-robin".to_owned(),
            PeerSpec::Nginx {
                balance: Balance::LeastConn,
                ..
            } => "nginx-least-conn".to_owned(),
        }
    }

    /// Starts the peer proxying to `backends`. `work_dir` holds nginx's files.
    pub async fn start(
        &self,
        router_binary: &Path,
        work_dir: &Path,
        backends: &[String],
    ) -> Result<RunningPeer, LabError> {
        match self {
            PeerSpec::Strategy(strategy) => {
                let binary = router_binary.to_owned();
                let strategy = strategy.clone();
                let router = tokio::task::spawn_blocking(move || {
                    RouterProcess::start(&binary, &strategy, &[])
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
        }
    }
}

/// A started peer.
pub enum RunningPeer {
    /// The router binary.
    Router(RouterProcess),
    /// nginx.
    Nginx(NginxProcess),
}

impl RunningPeer {
    /// Where clients send requests.
    pub fn addr(&self) -> SocketAddr {
        match self {
            RunningPeer::Router(router) => router.addr,
            RunningPeer::Nginx(nginx) => nginx.addr,
        }
    }

    /// The process whose tree is measured.
    pub fn pid(&self) -> u32 {
        match self {
            RunningPeer::Router(router) => router.pid(),
            RunningPeer::Nginx(nginx) => nginx.pid(),
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
        }
    }

    /// Stops the peer's processes.
    pub async fn stop(self) {
        let _ = tokio::task::spawn_blocking(move || match self {
            RunningPeer::Router(router) => router.stop(),
            RunningPeer::Nginx(nginx) => nginx.stop(),
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
