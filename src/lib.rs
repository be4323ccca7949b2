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
pub mod memory;
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

/// A running gateway: its bound addresses (`None`: that listener is off, Triton's
/// `--allow-*`) and the handles to stop it.
pub struct Gateway {
    pub http_addr: Option<SocketAddr>,
    pub grpc_addr: Option<SocketAddr>,
    pub metrics_addr: Option<SocketAddr>,
    pub state: web::Data<AppState>,
    http: Option<Listener>,
    metrics: Option<Listener>,
    grpc_stop: tokio_util::sync::CancellationToken,
    /// Ends every gRPC connection at once.
    grpc_kill: tokio_util::sync::CancellationToken,
    poll_stop: tokio_util::sync::CancellationToken,
    poll_task: Option<tokio::task::JoinHandle<()>>,
    grpc_task: Option<tokio::task::JoinHandle<()>>,
    exit_timeout: Duration,
}

/// An actix-web server running in a task.
struct Listener {
    handle: actix_web::dev::ServerHandle,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Listener {
    fn start(server: actix_web::dev::Server) -> Listener {
        Listener {
            handle: server.handle(),
            task: tokio::spawn(server),
        }
    }

    /// Stops taking connections and lets the open ones finish, within `LISTENER_CLOSE`.
    async fn stop(self) {
        self.handle.stop(true).await;
        let _ = self.task.await;
    }
}

/// How long the listeners get to close once the requests under way are answered (or the
/// exit timeout is up): idle connections close at once, what is left is cut.
const LISTENER_CLOSE: Duration = Duration::from_secs(2);

impl Gateway {
    /// Loads the repository, starts the models and binds HTTP. Returns once bound; the
    /// models finish loading in the background (see [`Gateway::wait_ready`]).
    pub async fn start(settings: Settings, engine: EngineChoice) -> anyhow::Result<Gateway> {
        let cfg = &settings.config;
        let scan = repository::scan(&settings.control.repositories)
            .context("reading the model repository")?;
        let intra = cfg.intra_op_threads;
        let (factory, gpu_count, unusable_gpus): (EngineFactory, usize, usize) = match engine {
            EngineChoice::Torch => {
                let torch_gpus = engine::cuda_device_count();
                match engine::cuda_host::cuda_support() {
                    engine::cuda_host::CudaSupport::Loaded => {
                        tracing::info!(gpus = torch_gpus, "libtorch CUDA support loaded")
                    }
                    engine::cuda_host::CudaSupport::NoDriver => tracing::info!(
                        "no NVIDIA driver (libcuda.so.1): libtorch's CUDA support not loaded"
                    ),
                    engine::cuda_host::CudaSupport::Failed(why) => {
                        tracing::error!("libtorch's CUDA support did not load: {why}")
                    }
                }
                // The driver's view (NVML), beside libtorch's: a host with NVIDIA GPUs
                // where CUDA cannot start fails its KIND_GPU models with the reason.
                let host_gpus = telemetry::Nvml::open().map_or(0, |nvml| {
                    let (driver, cuda) = nvml.versions();
                    let runtime = engine::cuda_host::runtime_version()
                        .map_or("none".to_string(), engine::cuda_host::version_text);
                    let gpus = nvml.count() as usize;
                    tracing::info!(
                        driver,
                        driver_cuda = cuda,
                        gpus,
                        libtorch_cuda_runtime = runtime,
                        libtorch_gpus = torch_gpus,
                        "NVIDIA driver"
                    );
                    gpus
                });
                let problem = (host_gpus > 0 && torch_gpus == 0)
                    .then(|| {
                        let driver = engine::cuda_host::driver_state();
                        engine::cuda_host::cuda_problem(
                            engine::cuda_host::runtime_version(),
                            &driver,
                        )
                    })
                    .flatten();
                if let Some(why) = &problem {
                    tracing::error!("CUDA cannot start; KIND_GPU models will fail to load: {why}");
                }
                let broken = problem.clone();
                let factory: EngineFactory = Arc::new(move |path, id, precision| {
                    if let (Some(why), Some(_)) = (&broken, id.gpu) {
                        return Err(engine::EngineError::Load {
                            path: format!("instance {id}"),
                            message: format!("CUDA cannot start on this host: {why}"),
                        });
                    }
                    // Per thread: libtorch's intra-op pool size is a thread-local setting.
                    // GPU instances too, so the little CPU work they do (the copy into the
                    // staging buffer) never spreads over the cores decoding needs.
                    tch::set_num_threads(intra as i32);
                    Ok(Box::new(TorchEngine::load(path, id.gpu, precision)?) as Box<dyn Engine>)
                });
                if cfg.tf32 != config::Tf32::Default {
                    engine::cuda::set_allow_tf32(cfg.tf32 == config::Tf32::On)
                        .map_err(|e| anyhow::anyhow!("--tf32: {e}"))?;
                }
                if torch_gpus > 0 {
                    let (cudnn, cublas) = engine::cuda::allow_tf32();
                    tracing::info!(
                        gpus = torch_gpus,
                        "TF32: cuDNN convolutions {cudnn}, cuBLAS matmuls {cublas}"
                    );
                }
                // With CUDA broken, KIND_GPU instances are planned on the host's GPUs, so
                // that they fail with the reason rather than run on the CPU.
                let unusable = if problem.is_some() { host_gpus } else { 0 };
                (factory, torch_gpus, unusable)
            }
            EngineChoice::Fake {
                num_classes,
                latency,
                faults,
            } => {
                let factory: EngineFactory = Arc::new(move |path, _, _| {
                    Ok(Box::new(faults.load(path, num_classes, latency)?) as Box<dyn Engine>)
                });
                (factory, 0, 0)
            }
        };
        let gpu_instances = scan.models.iter().any(|m| match &m.kind {
            repository::ModelKind::Classifier(spec) => {
                state::plan_instances(&spec.instance_groups, gpu_count, unusable_gpus)
                    .0
                    .iter()
                    .any(|i| i.gpu.is_some())
            }
            _ => false,
        });
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let decode_threads = settings
            .decode_threads
            .unwrap_or_else(|| config::decode_threads(cores, gpu_instances));
        tracing::info!(decode_threads, cores, gpu_instances, "decode threads");
        let pace = pace::BodyPace {
            timeout: Duration::from_secs(cfg.body_timeout_secs),
            min_rate: cfg.body_min_rate,
        };
        let state = web::Data::new(AppState::build(
            scan,
            BuildOptions {
                factory,
                metrics: Arc::new(telemetry::Metrics::with_config(&settings.metrics)),
                gpu_count,
                unusable_gpus,
                default_queue_size: cfg.max_queue_size,
                cache: Arc::new(scheduler::ResponseCache::new(settings.cache_size)),
                max_image_pixels: cfg.max_image_pixels,
                dct_override: cfg.dct_scaling_min_side,
                precision: cfg.precision,
            },
            settings.control.clone(),
            UploadLimits {
                max_files: cfg.max_files,
                max_file_bytes: cfg.max_file_bytes,
                max_body_bytes: cfg.max_body_bytes,
                pace,
            },
            decode_threads,
            settings.decode_memory,
            settings.server.clone(),
        ));
        // Free memory back to the system after 10 s without a batch or a decode.
        tokio::spawn(memory::release_when_idle(Duration::from_secs(10)));
        let poll_stop = tokio_util::sync::CancellationToken::new();
        let poll_task = (settings.control.mode == state::ControlMode::Poll).then(|| {
            let (state, stop) = (state.clone(), poll_stop.clone());
            tokio::spawn(async move { state.registry.poll_loop(stop).await })
        });

        let (http_addr, http) = if cfg.allow_http {
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
            let addr = *server
                .addrs()
                .first()
                .context("HTTP server has no address")?;
            tracing::info!(http_addr = %addr, "HTTP listening");
            (Some(addr), Some(Listener::start(server.run())))
        } else {
            tracing::info!("HTTP off (--allow-http=false)");
            (None, None)
        };

        let grpc_stop = tokio_util::sync::CancellationToken::new();
        let grpc_kill = tokio_util::sync::CancellationToken::new();
        let (grpc_addr, grpc_task) = if cfg.allow_grpc {
            let listener = tokio::net::TcpListener::bind((cfg.host, cfg.grpc_port))
                .await
                .with_context(|| format!("binding gRPC on {}:{}", cfg.host, cfg.grpc_port))?;
            let addr = listener.local_addr()?;
            let task = tokio::spawn(grpc::serve_logged(
                listener,
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
            tracing::info!(grpc_addr = %addr, "gRPC listening");
            (Some(addr), Some(task))
        } else {
            tracing::info!("gRPC off (--allow-grpc=false)");
            (None, None)
        };

        let (metrics_addr, metrics) = if cfg.allow_metrics {
            let metrics = state.metrics.clone();
            let server = HttpServer::new(move || {
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
            .shutdown_timeout(LISTENER_CLOSE.as_secs())
            .bind((cfg.host, cfg.metrics_port))
            .with_context(|| format!("binding metrics on {}:{}", cfg.host, cfg.metrics_port))?;
            let addr = *server
                .addrs()
                .first()
                .context("metrics server has no address")?;
            tracing::info!(metrics_addr = %addr, "metrics listening");
            let gpus = if cfg.allow_gpu_metrics {
                telemetry::Nvml::open()
                    .filter(|n| n.count() > 0)
                    .map(|n| Box::new(n) as Box<dyn telemetry::GpuProbe>)
            } else {
                None
            };
            telemetry::spawn_poller(
                state.metrics.clone(),
                cfg.allow_cpu_metrics,
                gpus,
                Duration::from_millis(cfg.metrics_interval_ms),
                poll_stop.clone(),
            );
            (Some(addr), Some(Listener::start(server.run())))
        } else {
            tracing::info!("metrics off (--allow-metrics=false)");
            (None, None)
        };
        Ok(Gateway {
            http_addr,
            grpc_addr,
            metrics_addr,
            state,
            http,
            metrics,
            grpc_stop,
            grpc_kill,
            grpc_task,
            poll_stop,
            poll_task,
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
        let grpc = async {
            let Some(mut task) = self.grpc_task else {
                return;
            };
            if tokio::time::timeout(LISTENER_CLOSE, &mut task)
                .await
                .is_err()
            {
                // Connections that ignore the GOAWAY, or calls still running: cut them.
                self.grpc_kill.cancel();
                let _ = tokio::time::timeout(LISTENER_CLOSE, task).await;
            }
        };
        let stop = |listener: Option<Listener>| async move {
            if let Some(listener) = listener {
                listener.stop().await;
            }
        };
        tokio::join!(stop(self.http), grpc, stop(self.metrics));
        if let Some(poll) = self.poll_task {
            // A poll under way finishes its loads first.
            let _ = poll.await;
        }
        self.state.registry.stop_models().await;
        let regions = self.state.shared_memory.close_all();
        if regions > 0 {
            tracing::info!(regions, "shared-memory regions closed");
        }
    }
}

/// Runs until `shutdown` is cancelled.
pub async fn run(
    settings: Settings,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let exit_on_error = settings.config.exit_on_error;
    let gateway = Gateway::start(settings, EngineChoice::Torch).await?;
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
