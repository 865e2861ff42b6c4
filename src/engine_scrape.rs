//! The engine-metrics scraper: one task per router that reads every backend's metrics endpoint
//! each `engine_metrics.interval` and stores what [`crate::engine_metrics::parse`] makes of it on
//! the backend ([`crate::backend::Backend::engine`]).
//!
//! Each tick the task takes the balancer's current backend set. A backend whose previous scrape
//! is still running is left out of that tick; every other one gets a scrape, and all of them run
//! at once inside the task, each bounded by `engine_metrics.timeout`, so a slow backend delays
//! no other. A backend that left the set has its scrape dropped at the next tick and gets no
//! more; a new one is scraped at the next tick. The first tick is at once, so a router that
//! starts (or takes over) has every backend's picture within one interval.
//!
//! Requests go through the router's upstream client ([`UpstreamClient::get`], as readmission
//! probes do), as a bodiless `GET` on the backend's keep-alive connections; the body is read to
//! its end, so the connection goes back to the backend's idle stack. A scrape, the read and the
//! parse together, is bounded by `engine_metrics.timeout`. A TGI
//! backend is also asked `GET /info` for its capacity, in a task of its own, until it answers
//! (and again after its values went stale: a restarted engine may state another). Every scrape is
//! counted by outcome (`custom_router_engine_scrapes_total`); a failed one leaves the backend's
//! last values to go stale.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::Bytes;
use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::backend::Backend;
use crate::balancer::Balancer;
use crate::engine_metrics::{self, Engine, EngineKind, EngineMetricsConfig};
use crate::metrics::ScrapeOutcome;
use crate::upstream::UpstreamClient;

/// The largest metrics text read (a busy vLLM serves about 100 KiB).
const MAX_BODY: usize = 8 * 1024 * 1024;

/// Where TGI says how many requests it takes at once.
const TGI_INFO_PATH: &str = "/info";

/// The largest `/info` answer read (TGI's is about 1 KiB).
const MAX_INFO_BODY: usize = 64 * 1024;

/// Starts the scraper for `config` on the current runtime, or nothing when `kind` is off. The
/// task runs until it is aborted.
pub fn spawn(
    balancer: Arc<Balancer>,
    client: Arc<ArcSwap<UpstreamClient>>,
    config: EngineMetricsConfig,
) -> Option<JoinHandle<()>> {
    (config.kind != EngineKind::Off).then(|| tokio::spawn(run(balancer, client, config)))
}

type Scrape = Pin<Box<dyn Future<Output = (u64, Option<ScrapeOutcome>)> + Send>>;

/// Scrapes `balancer`'s backends every `config.interval`, forever.
pub async fn run(
    balancer: Arc<Balancer>,
    client: Arc<ArcSwap<UpstreamClient>>,
    config: EngineMetricsConfig,
) {
    let config = Arc::new(config);
    let mut ticker = tokio::time::interval(config.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut scrapes: FuturesUnordered<Scrape> = FuturesUnordered::new();
    // Per backend id with a scrape under way: dropping the sender drops that scrape.
    let mut running: HashMap<u64, oneshot::Sender<()>> = HashMap::new();
    loop {
        tokio::select! {
            _ = ticker.tick() => {
                let backends = balancer.backends();
                running.retain(|id, _| backends.iter().any(|b| b.id() == *id));
                for backend in backends.iter() {
                    if running.contains_key(&backend.id()) {
                        continue;
                    }
                    let (stop, stopped) = oneshot::channel();
                    running.insert(backend.id(), stop);
                    scrapes.push(scrape_until_dropped(
                        Arc::clone(backend),
                        Arc::clone(&client),
                        Arc::clone(&config),
                        stopped,
                    ));
                }
            }
            Some((id, outcome)) = scrapes.next(), if !scrapes.is_empty() => {
                if let Some(outcome) = outcome {
                    running.remove(&id);
                    balancer.metrics().count_engine_scrape(outcome);
                }
            }
        }
    }
}

/// One scrape of `backend`, given up (with no outcome) when `stopped` fires or its sender is
/// dropped.
fn scrape_until_dropped(
    backend: Arc<Backend>,
    client: Arc<ArcSwap<UpstreamClient>>,
    config: Arc<EngineMetricsConfig>,
    stopped: oneshot::Receiver<()>,
) -> Scrape {
    let id = backend.id();
    Box::pin(async move {
        tokio::select! {
            outcome = scrape(&backend, &client, &config) => (id, Some(outcome)),
            _ = stopped => (id, None),
        }
    })
}

/// Scrapes `backend` once and stores what it said, the read and the parse bounded together by
/// the timeout; for TGI, has `/info` asked while it has not answered (or the values went stale
/// since), in a task of its own bounded by the timeout too, so that a slow `/info` never holds
/// the scrape past its interval.
pub async fn scrape(
    backend: &Arc<Backend>,
    client: &ArcSwap<UpstreamClient>,
    config: &EngineMetricsConfig,
) -> ScrapeOutcome {
    let read = tokio::time::timeout(config.timeout(), read(backend, client, config)).await;
    let reading = match read {
        Ok(Ok(reading)) => reading,
        Ok(Err(outcome)) => return outcome,
        Err(_) => return ScrapeOutcome::Timeout,
    };
    // Asked before the new values make the engine fresh again: a stale one is asked anew.
    let now = Instant::now();
    let wants_info = backend.engine().wants_info(now);
    backend
        .engine()
        .record(&reading, backend.in_flight(), now, config.stale_after());
    if reading.engine == Engine::Tgi && wants_info && backend.engine().start_info() {
        let (backend, client) = (Arc::clone(backend), client.load_full());
        let timeout = config.timeout();
        tokio::spawn(async move {
            let info = client.get(&backend, TGI_INFO_PATH, MAX_INFO_BODY);
            match tokio::time::timeout(timeout, info).await {
                Ok(Some((status, body))) if status.is_success() => {
                    let capacity = engine_metrics::parse_info(&body);
                    tracing::debug!(backend = %backend.addr(), ?capacity, "TGI /info read");
                    backend.engine().record_info(capacity);
                }
                _ => backend.engine().info_not_read(),
            }
        });
    }
    ScrapeOutcome::Ok
}

/// Reads and parses `backend`'s metrics text.
async fn read(
    backend: &Arc<Backend>,
    client: &ArcSwap<UpstreamClient>,
    config: &EngineMetricsConfig,
) -> Result<engine_metrics::EngineReading, ScrapeOutcome> {
    let text = get(backend, client, &config.path).await?;
    // A busy engine's text takes a millisecond or two to parse: off the runtime's threads, so
    // that requests are not held up meanwhile.
    let kind = config.kind;
    let parsed = tokio::task::spawn_blocking(move || match std::str::from_utf8(&text) {
        Ok(text) => engine_metrics::parse(text, kind).map_err(|error| error.to_string()),
        Err(_) => Err("not UTF-8".to_owned()),
    })
    .await;
    match parsed {
        Ok(Ok(reading)) => Ok(reading),
        Ok(Err(error)) => {
            tracing::debug!(backend = %backend.addr(), %error, "engine metrics not read");
            Err(ScrapeOutcome::Invalid)
        }
        Err(error) => {
            tracing::debug!(backend = %backend.addr(), %error, "engine metrics not read");
            Err(ScrapeOutcome::Invalid)
        }
    }
}

/// The body of a 2xx answer to `GET path`, read whole (its connection kept for the next).
async fn get(
    backend: &Arc<Backend>,
    client: &ArcSwap<UpstreamClient>,
    path: &str,
) -> Result<Bytes, ScrapeOutcome> {
    let client = client.load_full();
    match client.get(backend, path, MAX_BODY).await {
        Some((status, body)) if status.is_success() => Ok(body),
        _ => Err(ScrapeOutcome::Failed),
    }
}
