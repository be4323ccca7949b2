//! visiongate: one process for image classification — multipart `/predict`, Triton model
//! repositories, libtorch instances with dynamic batching.

pub mod config;
pub mod cores;
pub mod domain;
pub mod dynlib;
pub mod engine;
pub mod engines;
pub mod error;
pub mod fuzz;
pub mod grpc;
pub mod http;
pub mod kserve;
pub mod listeners;
pub mod memory;
pub mod nvidia;
pub mod pace;
pub mod pipeline;
pub mod preprocess;
pub mod repository;
pub mod scheduler;
pub mod settings;
pub mod shm;
pub mod shutdown;
pub mod state;
pub mod telemetry;
pub mod trace;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use actix_web::web;
use anyhow::Context;
use tokio_util::sync::CancellationToken;

pub use engines::EngineChoice;
use engines::Engines;
use listeners::{Bind, GrpcListener, HttpListener};
use repository::Repositories;
use scheduler::ModelState;
use settings::Settings;
use state::{AppState, BuildOptions, StateSettings};

/// A running gateway: its bound addresses (`None`: that listener is off, Triton's
/// `--allow-*`) and the handles to stop it.
pub struct Gateway {
    pub http_addr: Option<SocketAddr>,
    pub grpc_addr: Option<SocketAddr>,
    pub metrics_addr: Option<SocketAddr>,
    pub state: web::Data<AppState>,
    http: Option<HttpListener>,
    grpc: Option<GrpcListener>,
    metrics: Option<HttpListener>,
    /// The root of every background task's token (repository polls, the metrics refresh,
    /// the idle memory release): cancelled as the stop begins.
    background: CancellationToken,
    /// A repository poll under way finishes its loads before the models stop.
    poll_task: Option<tokio::task::JoinHandle<()>>,
    /// OpenTelemetry mode's span exporter, which sends what is queued as the server stops.
    trace_export: Option<trace::export::ExportTask>,
    exit_timeout: Duration,
}

impl Gateway {
    /// Loads the repository, starts the models and binds the listeners. Returns once bound;
    /// the models finish loading in the background (see [`Gateway::wait_ready`]).
    pub async fn start(settings: Settings, engine: EngineChoice) -> anyhow::Result<Gateway> {
        let gpu_memory = Arc::new(shm::HostGpus::default());
        Gateway::start_with_gpu_memory(settings, engine, gpu_memory).await
    }

    /// As [`Gateway::start`], CUDA shared-memory regions opened through `gpu_memory` (the
    /// host's GPUs, or a test's memory standing in for them).
    pub async fn start_with_gpu_memory(
        settings: Settings,
        engine: EngineChoice,
        gpu_memory: Arc<dyn shm::CudaIpc>,
    ) -> anyhow::Result<Gateway> {
        let repositories =
            Repositories::open(&settings.control.repositories, &settings.control.remote)
                .map_err(anyhow::Error::msg)
                .context("opening the model repositories")?
                .with_config_name(settings.control.config_name.clone());
        let scan = repositories
            .scan(&settings.control.limits)
            .await
            .context("reading the model repository")?;

        let engines = Engines::new(engine, settings.engine.clone())?;
        let cores = Arc::new(cores::Cores::of_host());
        let decode_threads = decode_threads(&settings, &scan, &engines, cores.total());
        let state = web::Data::new(build_state(
            &settings,
            scan,
            repositories,
            gpu_memory,
            (engines, cores),
            decode_threads,
        ));
        let background = CancellationToken::new();
        let poll_task = spawn_background(&settings, &state, &background);
        let trace_export = state
            .server
            .trace
            .start_sink(state.metrics.trace_spans_dropped.clone());
        let (http, grpc, metrics) = start_listeners(&settings, &state, &background).await?;
        Ok(Gateway {
            http_addr: http.as_ref().map(|l| l.addr),
            grpc_addr: grpc.as_ref().map(|l| l.addr),
            metrics_addr: metrics.as_ref().map(|l| l.addr),
            state,
            http,
            grpc,
            metrics,
            background,
            poll_task,
            trace_export,
            exit_timeout: settings.exit_timeout,
        })
    }

    /// Waits until every model has loaded (or failed); returns the failed loads.
    pub async fn wait_ready(&self) -> Vec<String> {
        let mut failures = Vec::new();
        for handle in self.state.registry.handles() {
            if let ModelState::Failed(e) = handle.wait_loaded().await {
                failures.push(format!("{}: {e}", handle.name()));
            }
        }
        failures
    }

    /// `wait_ready`'s failures and every other model the control mode loads at start-up
    /// that is not served: its config did not pass, an ensemble's step is missing (what
    /// `--exit-on-error` exits for).
    pub async fn startup_failures(&self) -> Vec<String> {
        let mut failures = self.wait_ready().await;
        // In explicit mode only the models asked for at start-up count (as in Triton).
        let control = &self.state.registry.control;
        let wanted = |name: &str| {
            control.mode != state::ControlMode::Explicit
                || control.startup_models.iter().any(|m| m == "*" || m == name)
        };
        for (name, entry) in self.state.registry.models().entries() {
            if !wanted(name.as_str()) {
                continue;
            }
            if let (true, Some(why)) = (entry.served.is_empty(), &entry.unavailable) {
                failures.push(format!("{name}: {why}"));
            }
        }
        failures
    }

    /// Stops as Triton does, within the exit timeout: readiness and new inference
    /// requests answer 503 at once; the requests under way are answered; then HTTP and
    /// gRPC close together (open gRPC streams end with UNAVAILABLE) and the models stop.
    pub async fn stop(self) {
        let deadline = tokio::time::Instant::now() + self.exit_timeout;
        self.state.drain.begin();
        self.background.cancel();
        if tokio::time::timeout_at(deadline, self.state.drain.finished())
            .await
            .is_err()
        {
            tracing::warn!(
                "exit timeout ({} s) reached with requests still running: they are cut off",
                self.exit_timeout.as_secs()
            );
        }
        self.state.drain.close();
        let http = async {
            if let Some(l) = self.http {
                l.stop().await
            }
        };
        let grpc = async {
            if let Some(l) = self.grpc {
                l.stop().await
            }
        };
        let metrics = async {
            if let Some(l) = self.metrics {
                l.stop().await
            }
        };
        tokio::join!(http, grpc, metrics);
        if let Some(poll) = self.poll_task {
            // A poll under way finishes its loads first.
            let _ = poll.await;
        }
        self.state.registry.stop_models().await;
        // The traces of the last requests: the trace file's (at most 64 MiB waiting for its
        // writer), and the spans still queued, within what is left of the exit timeout.
        let trace = self.state.server.trace.clone();
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let flushed = tokio::task::spawn_blocking(move || trace.flush());
        if tokio::time::timeout(left.max(Duration::from_secs(1)), flushed)
            .await
            .is_err()
        {
            tracing::warn!("exit timeout reached with the trace file still being written");
        }
        if let Some(export) = self.trace_export {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            export.stop(left.max(Duration::from_secs(1))).await;
        }
        let regions = self.state.shared_memory.close_all();
        if regions > 0 {
            tracing::info!(regions, "shared-memory regions closed");
        }
    }
}

/// A listener's port, or `None` when it is off (logging the flag that turned it off).
fn listening(name: &str, at: Option<Bind>, flag: &str) -> Option<Bind> {
    if at.is_none() {
        tracing::info!("{name} off ({flag}=false)");
    }
    at
}

/// Decode threads: `--decode-threads`, or the default for the `cores` and whether any
/// classifier instance runs on a GPU.
fn decode_threads(
    settings: &Settings,
    scan: &repository::ScanResult,
    engines: &Engines,
    cores: usize,
) -> usize {
    let gpu_instances = scan.models.iter().any(|m| match &m.kind {
        repository::ModelKind::Classifier(spec) => state::plan_instances(
            &spec.instance_groups,
            engines.gpu_count,
            engines.unusable_gpus,
            settings.control.limits.model_instances,
        )
        .is_ok_and(|(instances, _)| instances.iter().any(|i| i.gpu.is_some())),
        _ => false,
    });
    let threads = settings
        .decode_threads
        .unwrap_or_else(|| preprocess::decode_threads(cores, gpu_instances));
    tracing::info!(
        decode_threads = threads,
        cores,
        gpu_instances,
        "decode threads"
    );
    threads
}

/// The shared state: the decode pool, and the models the control mode loads at start-up,
/// sharing the `cores`.
fn build_state(
    settings: &Settings,
    scan: repository::Snapshot,
    repositories: Repositories,
    gpu_memory: Arc<dyn shm::CudaIpc>,
    (engines, cores): (Engines, Arc<cores::Cores>),
    decode_threads: usize,
) -> AppState {
    let models = settings.models;
    let metrics = telemetry::Metrics::with_config(&settings.metrics);
    for collector in repositories.collectors() {
        metrics.register(collector);
    }
    AppState::build(
        scan,
        BuildOptions {
            factory: engines.factory,
            metrics: Arc::new(metrics),
            gpu_count: engines.gpu_count,
            unusable_gpus: engines.unusable_gpus,
            default_queue_size: models.max_queue_size,
            cache: Arc::new(scheduler::ResponseCache::new(settings.cache_size)),
            max_image_pixels: models.max_image_pixels,
            dct_override: models.dct_override,
            precision: models.precision,
            live_instances: Default::default(),
            cores,
        },
        StateSettings {
            control: settings.control.clone(),
            repositories,
            limits: settings.limits.clone(),
            decode_threads,
            decode_memory: settings.decode_memory,
            server: settings.server.clone(),
            cuda_ipc: gpu_memory,
        },
    )
}

/// The background tasks `stop` ends (each holds a child of `background`): the idle memory
/// release and the repository's polls (returned, in poll mode).
fn spawn_background(
    settings: &Settings,
    state: &web::Data<AppState>,
    background: &CancellationToken,
) -> Option<tokio::task::JoinHandle<()>> {
    // Free memory back to the system after 10 s without a batch or a decode.
    let idle = background.child_token();
    tokio::spawn(memory::release_when_idle(Duration::from_secs(10), idle));
    (settings.control.mode == state::ControlMode::Poll).then(|| {
        let (state, stop) = (state.clone(), background.child_token());
        tokio::spawn(async move { state.registry.poll_loop(stop).await })
    })
}

/// The HTTP, gRPC and metrics listeners, each where the settings turn it on.
async fn start_listeners(
    settings: &Settings,
    state: &web::Data<AppState>,
    background: &CancellationToken,
) -> anyhow::Result<(
    Option<HttpListener>,
    Option<GrpcListener>,
    Option<HttpListener>,
)> {
    let listen = settings.listen;
    let http = match listening("HTTP", listen.http, "--allow-http") {
        Some(at) => Some(start_http(settings, state, at)?),
        None => None,
    };
    let grpc = match listening("gRPC", listen.grpc, "--allow-grpc") {
        Some(at) => Some(start_grpc(settings, state, at).await?),
        None => None,
    };
    let metrics = match listening("metrics", listen.metrics, "--allow-metrics") {
        Some(at) => Some(start_metrics(
            settings,
            state,
            at,
            background.child_token(),
        )?),
        None => None,
    };
    Ok((http, grpc, metrics))
}

fn start_http(
    settings: &Settings,
    state: &web::Data<AppState>,
    at: Bind,
) -> anyhow::Result<HttpListener> {
    let state = state.clone();
    HttpListener::start(
        "HTTP",
        at,
        settings.http_workers,
        state
            .limits
            .max_body_bytes
            .max(state.limits.max_input_bytes),
        move |c| http::configure(c, state.clone()),
    )
}

async fn start_grpc(
    settings: &Settings,
    state: &web::Data<AppState>,
    at: Bind,
) -> anyhow::Result<GrpcListener> {
    let service = grpc::InferenceService::new(state.clone().into_inner());
    GrpcListener::start(at, service, settings.grpc.clone()).await
}

/// The metrics listener (`/metrics`) and the CPU and GPU series' refresh, which `stop`
/// ends.
fn start_metrics(
    settings: &Settings,
    state: &web::Data<AppState>,
    at: Bind,
    stop: CancellationToken,
) -> anyhow::Result<HttpListener> {
    let metrics = state.metrics.clone();
    // Only GET /metrics: no body to wait for.
    let listener = HttpListener::start("metrics", at, 1, 0, move |c| {
        let metrics = metrics.clone();
        c.route(
            "/metrics",
            web::get().to(move || {
                let body = metrics.render();
                async move {
                    actix_web::HttpResponse::Ok()
                        .content_type("text/plain; version=0.0.4; charset=utf-8")
                        .body(body)
                }
            }),
        );
    })?;
    let refresh = settings.refresh;
    let gpus = if refresh.gpu {
        nvidia::Nvml::open()
            .filter(|n| n.count() > 0)
            .map(|n| Box::new(n) as Box<dyn telemetry::GpuProbe>)
    } else {
        None
    };
    telemetry::spawn_poller(
        state.metrics.clone(),
        refresh.cpu,
        gpus,
        refresh.interval,
        stop,
    );
    Ok(listener)
}

/// Runs until `shutdown` is cancelled.
pub async fn run(
    settings: Settings,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let exit_on_error = settings.exit_on_error;
    let gateway = Gateway::start(settings, EngineChoice::Runtimes).await?;
    tokio::select! {
        failures = gateway.startup_failures() => {
            failures.iter().for_each(|f| tracing::error!("{f}"));
            if exit_on_error && !failures.is_empty() {
                gateway.stop().await;
                anyhow::bail!(
                    "{} model(s) failed to load at start-up (--exit-on-error=false serves \
                     the others)",
                    failures.len()
                );
            }
        }
        () = shutdown.cancelled() => {}
    }
    shutdown.cancelled().await;
    gateway.stop().await;
    Ok(())
}
