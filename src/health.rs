//! Readmission probes over the upstream client: `GET availability.health_check_path` to an ejected
//! backend; the balancer decides when ([`crate::balancer::Probe`]) and bounds the wait.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::backend::Backend;
use crate::balancer::Probe;
use crate::upstream::UpstreamClient;
use arc_swap::ArcSwap;

/// The largest probe answer body read (its connection is kept when it is read to its end; a
/// larger one fails the probe).
const PROBE_BODY: usize = 64 * 1024;

/// Probes through the router's current upstream client (replaced on a reload).
#[derive(Debug)]
pub struct HttpProbe {
    client: Arc<ArcSwap<UpstreamClient>>,
}

impl HttpProbe {
    /// Probes sent through `client`.
    pub fn new(client: Arc<ArcSwap<UpstreamClient>>) -> Self {
        Self { client }
    }
}

impl Probe for HttpProbe {
    fn probe<'a>(
        &'a self,
        backend: &'a Arc<Backend>,
        path: &'a str,
    ) -> Pin<Box<dyn Future<Output = bool> + Send + 'a>> {
        Box::pin(async move {
            let client = self.client.load_full();
            let answer = client.get(backend, path, PROBE_BODY).await;
            matches!(answer, Some((status, _)) if status.is_success())
        })
    }
}
