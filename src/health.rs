//! Readmission probes over the upstream client: `GET availability.health_check_path` to an ejected
//! backend; the balancer decides when ([`crate::balancer::Probe`]) and bounds the wait.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::Bytes;

use crate::backend::Backend;
use crate::balancer::Probe;
use crate::body::UpstreamBody;
use crate::forwarding::RequestHead;
use crate::upstream::UpstreamClient;

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
            let Some(mut head) = RequestHead::probe(path) else {
                return false;
            };
            let client = self.client.load_full();
            let answer = client
                .send(backend, &mut head, UpstreamBody::full(Bytes::new()), true)
                .await;
            matches!(&answer, Ok(response) if response.status().is_success())
        })
    }
}
