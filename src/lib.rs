//! visiongate: one process for image classification — multipart `/predict`, Triton model
//! repositories, libtorch instances with dynamic batching.

pub mod config;
pub mod domain;
pub mod engine;
pub mod error;
pub mod fuzz;
pub mod grpc;
pub mod http;
pub mod kserve;
pub mod pace;
pub mod pipeline;
pub mod preprocess;
pub mod repository;
pub mod scheduler;
pub mod shutdown;
pub mod state;
pub mod telemetry;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use actix_web::{web, App, HttpServer};
use anyhow::Context;

use config::Settings;
use engine::{Engine, FakeFaults, TorchEngine};
use scheduler::{EngineFactory, ModelState};
use state::{AppState, BuildOptions, UploadLimits};

/// Which engine runs the classifiers.
#[derive(Clone)]
pub enum EngineChoice {
    /// libtorch, loading each model's TorchScript file.
    Torch,
    /// The deterministic fake (tests): `num_classes` classes, `latency` per batch, and the
    /// faults a test orders.
    Fake {
        num_classes: usize,
        latency: Duration,
        faults: Arc<FakeFaults>,
    },
}

/// A running gateway: its bound address and the handles to stop it.
pub struct Gateway {
    pub http_addr: SocketAddr,
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub state: web::Data<AppState>,
    server: actix_web::dev::ServerHandle,
    metrics_server: actix_web::dev::ServerHandle,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    grpc_stop: tokio_util::sync::CancellationToken,
    /// Ends every gRPC connection at once.
    grpc_kill: tokio_util::sync::CancellationToken,
    poll_stop: tokio_util::sync::CancellationToken,
    poll_task: Option<tokio::task::JoinHandle<()>>,
    grpc_task: tokio::task::JoinHandle<()>,
    exit_timeout: Duration,
}

/// How long the listeners get to close once the requests under way are answered (or the
/// exit timeout is up): idle connections close at once, what is left is cut.
const LISTENER_CLOSE: Duration = Duration::from_secs(2);

impl Gateway {
    /// Loads the repository, starts the models and binds HTTP. Returns once bound; the
    /// models finish loading in the background (see [`Gateway::wait_ready`]).
    pub async fn start(settings: Settings, engine: EngineChoice) -> anyhow::Result<Gateway> {
        let cfg = &settings.config;
        let scan = repository::scan(&cfg.model_repository)
            .with_context(|| format!("reading {}", cfg.model_repository.display()))?;
        let intra = cfg.intra_op_threads;
        let (factory, gpu_count): (EngineFactory, usize) = match engine {
            EngineChoice::Torch => {
                let factory: EngineFactory = Arc::new(move |path, id| {
                    // Per thread: libtorch's intra-op pool size is a thread-local setting.
                    // GPU instances too, so the little CPU work they do (the copy into the
                    // staging buffer) never spreads over the cores decoding needs.
                    tch::set_num_threads(intra as i32);
                    Ok(Box::new(TorchEngine::load(path, id.gpu)?) as Box<dyn Engine>)
                });
                let gpus = engine::cuda_device_count();
                if cfg.tf32 != config::Tf32::Default {
                    engine::cuda::set_allow_tf32(cfg.tf32 == config::Tf32::On)
                        .map_err(|e| anyhow::anyhow!("--tf32: {e}"))?;
                }
                if gpus > 0 {
                    let (cudnn, cublas) = engine::cuda::allow_tf32();
                    tracing::info!(
                        gpus,
                        "TF32: cuDNN convolutions {cudnn}, cuBLAS matmuls {cublas}"
                    );
                }
                (factory, gpus)
            }
            EngineChoice::Fake {
                num_classes,
                latency,
                faults,
            } => {
                let factory: EngineFactory = Arc::new(move |path, _| {
                    Ok(Box::new(faults.load(path, num_classes, latency)?) as Box<dyn Engine>)
                });
                (factory, 0)
            }
        };
        let pace = pace::BodyPace {
            timeout: Duration::from_secs(cfg.body_timeout_secs),
            min_rate: cfg.body_min_rate,
        };
        let state = web::Data::new(AppState::build(
            scan,
            BuildOptions {
                factory,
                metrics: Arc::new(telemetry::Metrics::new()),
                gpu_count,
                default_queue_size: cfg.max_queue_size,
                cache: Arc::new(scheduler::ResponseCache::new(cfg.cache_size)),
                max_image_pixels: cfg.max_image_pixels,
                dct_override: cfg.dct_scaling_min_side,
            },
            settings.control.clone(),
            UploadLimits {
                max_files: cfg.max_files,
                max_file_bytes: cfg.max_file_bytes,
                max_body_bytes: cfg.max_body_bytes,
                pace,
            },
            settings.decode_threads,
            settings.decode_memory,
        ));
        let poll_stop = tokio_util::sync::CancellationToken::new();
        let poll_task = (settings.control.mode == state::ControlMode::Poll).then(|| {
            let (state, stop) = (state.clone(), poll_stop.clone());
            tokio::spawn(async move { state.registry.poll_loop(stop).await })
        });

        let app_state = state.clone();
        let server = HttpServer::new(move || {
            App::new().configure(|c| http::configure(c, app_state.clone()))
        })
        .on_connect(http::on_connect)
        .workers(settings.http_workers)
        .disable_signals()
        .shutdown_timeout(LISTENER_CLOSE.as_secs())
        .bind((cfg.host, cfg.http_port))
        .with_context(|| format!("binding HTTP on {}:{}", cfg.host, cfg.http_port))?;
        let http_addr = *server
            .addrs()
            .first()
            .context("HTTP server has no address")?;
        let server = server.run();
        let handle = server.handle();
        let task = tokio::spawn(server);
        tracing::info!(%http_addr, "HTTP listening");

        let grpc_listener = tokio::net::TcpListener::bind((cfg.host, cfg.grpc_port))
            .await
            .with_context(|| format!("binding gRPC on {}:{}", cfg.host, cfg.grpc_port))?;
        let grpc_addr = grpc_listener.local_addr()?;
        let grpc_stop = tokio_util::sync::CancellationToken::new();
        let grpc_kill = tokio_util::sync::CancellationToken::new();
        let grpc_task = tokio::spawn(grpc::serve_logged(
            grpc_listener,
            grpc::InferenceService::new(state.clone().into_inner()),
            grpc::GrpcSettings {
                max_message_bytes: cfg.grpc_max_message_bytes,
                max_concurrent_streams: cfg.grpc_max_concurrent_streams,
                keepalive_time: Duration::from_millis(cfg.grpc_keepalive_time),
                keepalive_timeout: Duration::from_millis(cfg.grpc_keepalive_timeout),
                connections: grpc::ConnLimits {
                    max_connections: cfg.grpc_max_connections,
                    handshake: Duration::from_secs(cfg.grpc_handshake_timeout_secs),
                    idle: Duration::from_secs(cfg.grpc_idle_timeout_secs),
                    tcp_keepalive: Duration::from_millis(cfg.grpc_keepalive_time),
                },
                pace,
            },
            grpc_stop.clone().cancelled_owned(),
            grpc_kill.clone(),
        ));
        tracing::info!(%grpc_addr, "gRPC listening");

        let metrics = state.metrics.clone();
        let metrics_server = HttpServer::new(move || {
            let metrics = metrics.clone();
            App::new().route(
                "/metrics",
                web::get().to(move || {
                    let body = metrics.render();
                    async move {
                        actix_web::HttpResponse::Ok()
                            .content_type("text/plain; version=0.0.4; charset=utf-8")
                            .body(body)
                    }
                }),
            )
        })
        .workers(1)
        .disable_signals()
        .bind((cfg.host, cfg.metrics_port))
        .with_context(|| format!("binding metrics on {}:{}", cfg.host, cfg.metrics_port))?;
        let metrics_addr = *metrics_server
            .addrs()
            .first()
            .context("metrics server has no address")?;
        let metrics_server = metrics_server.run();
        let metrics_handle = metrics_server.handle();
        tokio::spawn(metrics_server);
        tracing::info!(%metrics_addr, "metrics listening");
        Ok(Gateway {
            http_addr,
            grpc_addr,
            grpc_stop,
            grpc_kill,
            grpc_task,
            poll_stop,
            poll_task,
            metrics_addr,
            state,
            server: handle,
            metrics_server: metrics_handle,
            task,
            exit_timeout: settings.exit_timeout,
        })
    }

    /// Waits until every model has loaded (or failed); returns the failures.
    pub async fn wait_ready(&self) -> Vec<String> {
        let mut failures = Vec::new();
        for handle in self.state.registry.handles() {
            if let ModelState::Failed(e) = handle.wait_loaded().await {
                failures.push(format!("{}: {e}", handle.name()));
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
        self.poll_stop.cancel();
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
        self.grpc_stop.cancel();
        let http = async {
            self.server.stop(true).await;
            let _ = self.task.await;
        };
        let grpc = async {
            let mut task = self.grpc_task;
            if tokio::time::timeout(LISTENER_CLOSE, &mut task)
                .await
                .is_err()
            {
                // Connections that ignore the GOAWAY, or calls still running: cut them.
                self.grpc_kill.cancel();
                let _ = tokio::time::timeout(LISTENER_CLOSE, task).await;
            }
        };
        tokio::join!(http, grpc, self.metrics_server.stop(true));
        if let Some(poll) = self.poll_task {
            // A poll under way finishes its loads first.
            let _ = poll.await;
        }
        self.state.registry.stop_models().await;
    }
}

/// Runs until `shutdown` is cancelled.
pub async fn run(
    settings: Settings,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let gateway = Gateway::start(settings, EngineChoice::Torch).await?;
    tokio::select! {
        failures = gateway.wait_ready() => failures.iter().for_each(|f| tracing::error!("{f}")),
        () = shutdown.cancelled() => {}
    }
    shutdown.cancelled().await;
    gateway.stop().await;
    Ok(())
}
