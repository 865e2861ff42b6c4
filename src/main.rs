//! The `custom-router` binary: parse flags, load configuration, serve until SIGTERM/SIGINT.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use custom_router::Router;
use custom_router::config::{self, LogFormat, Settings};
use tracing_subscriber::EnvFilter;

/// Exit code for configuration errors.
const CONFIG_ERROR: u8 = 2;

#[derive(Debug, Parser)]
#[command(
    name = "custom-router",
    version,
    about = "Load-balancing HTTP proxy for LLM inference replicas (Inference Endpoints custom router)",
    after_help = config::after_help()
)]
struct Cli {
    /// TOML configuration file (also CUSTOM_ROUTER_CONFIG); environment variables override it.
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,

    /// Print the effective configuration as JSON and exit (2 if it is invalid).
    #[arg(long)]
    check_config: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match config::load(cli.config.as_deref()) {
        Ok(settings) => settings,
        Err(error) => {
            eprintln!("custom-router: configuration error: {error}");
            return ExitCode::from(CONFIG_ERROR);
        }
    };
    if cli.check_config {
        match serde_json::to_string_pretty(&settings.config) {
            Ok(text) => {
                // A closed pipe (e.g. `| head`) is not an error worth a panic.
                let _ = writeln!(std::io::stdout(), "{text}");
            }
            Err(error) => {
                eprintln!("custom-router: cannot print configuration: {error}");
                return ExitCode::from(CONFIG_ERROR);
            }
        }
        return ExitCode::SUCCESS;
    }
    init_logging(settings.config.log_format);
    let open_files = custom_router::process::raise_open_file_limit();
    tracing::debug!(?open_files, "open-file limit");
    let mut builder = match settings.worker_threads() {
        1 => tokio::runtime::Builder::new_current_thread(),
        threads => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(threads);
            builder
        }
    };
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("custom-router: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(settings, cli.config))
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

async fn run(settings: Settings, config_flag: Option<PathBuf>) -> ExitCode {
    let router = match Router::bind(settings.clone()).await {
        Ok(router) => router,
        Err(error) => {
            tracing::error!(%error, "cannot start");
            return ExitCode::FAILURE;
        }
    };
    // Registered before the router says it listens: a SIGHUP from then on reloads (its default
    // action would end the process).
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(hangups) => {
            tokio::spawn(reload_on_hangup(
                hangups,
                router.reloader(),
                std::sync::Arc::clone(router.balancer()),
                config_flag,
            ));
        }
        Err(error) => {
            tracing::warn!(%error, "cannot watch SIGHUP; the configuration cannot be reloaded");
        }
    }
    // SIGTERM and SIGINT are watched before the router says it listens too: a platform that
    // stops the pod right after start gets the drain, not the signal's default action.
    let stop = match StopSignals::watch() {
        Ok(stop) => stop,
        Err(error) => {
            tracing::error!(%error, "cannot watch SIGTERM and SIGINT");
            return ExitCode::FAILURE;
        }
    };
    // Serialised through serde so that secrets print redacted.
    let effective = serde_json::to_string(&settings.config).unwrap_or_default();
    tracing::info!(
        listen = %router.local_addr(),
        strategy = settings.config.strategy.name,
        config_file = ?settings.config_file,
        config = %effective,
        "custom-router listening"
    );
    // A second SIGTERM or SIGINT during the drain stops at once, as nginx's fast shutdown.
    let first = std::sync::Arc::new(tokio::sync::Notify::new());
    let drain = {
        let first = std::sync::Arc::clone(&first);
        async move { first.notified().await }
    };
    tokio::select! {
        () = router.serve(drain) => {}
        () = stop.until_second(first) => {
            tracing::warn!("second signal: stopping without waiting for open connections");
        }
    }
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

/// On each SIGHUP, loads the configuration again (the same file, flag or variable, and the same
/// environment) and applies it to new requests; an invalid configuration is logged with the error
/// start-up would print, and the running one kept.
async fn reload_on_hangup(
    mut hangups: tokio::signal::unix::Signal,
    reloader: custom_router::server::Reloader,
    balancer: std::sync::Arc<custom_router::balancer::Balancer>,
    config_flag: Option<PathBuf>,
) {
    while hangups.recv().await.is_some() {
        match config::load(config_flag.as_deref()) {
            Ok(settings) => {
                let strategy = settings.config.strategy.name.clone();
                let effective = serde_json::to_string(&settings.config).unwrap_or_default();
                let needs_restart = reloader.apply(settings);
                balancer.metrics().count_reload(true);
                tracing::info!(
                    strategy,
                    config = %effective,
                    "configuration reloaded"
                );
                if !needs_restart.is_empty() {
                    tracing::warn!(
                        keys = ?needs_restart,
                        "changed keys that apply only at start were kept; restart to apply them"
                    );
                }
            }
            Err(error) => {
                balancer.metrics().count_reload(false);
                tracing::error!(
                    error = %format!("configuration error: {error}"),
                    "configuration reload failed; keeping the running configuration"
                );
            }
        }
    }
}

/// SIGTERM and SIGINT, watched from start-up.
struct StopSignals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Installs the handlers: from here on either signal is caught, not fatal.
    fn watch() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    /// The next SIGTERM or SIGINT; `None` once neither can arrive any more.
    async fn next(&mut self) -> Option<&'static str> {
        tokio::select! {
            received = self.terminate.recv() => received.map(|()| "SIGTERM"),
            received = self.interrupt.recv() => received.map(|()| "SIGINT"),
        }
    }

    /// Tells `first` at the first signal (the drain starts) and returns at the second.
    async fn until_second(mut self, first: std::sync::Arc<tokio::sync::Notify>) {
        match self.next().await {
            Some(name) => tracing::info!("{name} received"),
            None => return std::future::pending().await,
        }
        first.notify_one();
        if self.next().await.is_none() {
            std::future::pending::<()>().await;
        }
    }
}
