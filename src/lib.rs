//! custom-router: a load-balancing HTTP proxy for LLM inference replicas.
//!
//! It runs as the custom-router sidecar of Hugging Face Inference Endpoints (and anywhere a few
//! inference servers need one entry point): the platform tells it the current replicas through
//! `POST /_custom_router/set-backends`, and every other request is proxied to the replica the
//! configured [strategy](strategies) picks. See `docs/architecture.md` for the life of a request.

pub mod access_log;
pub mod admin;
pub mod backend;
pub mod balancer;
pub mod body;
pub mod cidr;
pub mod classify;
pub mod config;
pub mod dates;
pub mod discovery;
pub mod engine_metrics;
pub mod engine_scrape;
pub mod forms;
pub mod forwarding;
pub mod h1;
pub mod health;
pub mod metrics;
pub mod observed;
pub mod pool;
pub mod prefix_index;
pub mod process;
pub mod prompt;
pub mod proxy;
mod request_view;
pub mod response;
pub mod retry_budget;
pub mod server;
#[path = "../strategies/mod.rs"]
pub mod strategies;
pub mod strategy;
pub mod traces;
pub mod upstream;
pub mod usage;

pub use config::{Config, Settings};
pub use server::Router;
