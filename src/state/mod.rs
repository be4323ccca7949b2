//! The one state every transport shares: the model registry (the served models and their
//! lifecycle), the decode pool, upload limits, metrics and shared-memory regions.
mod build;
mod control;
mod drain;
mod flags;
mod registry;
mod restrict;
mod table;

use std::sync::Arc;

pub use build::{batch_policy, batch_size_choice, plan_instances, BuildOptions};
pub use control::{load_parameters, unload_parameters, ControlMode, ControlParam, ControlSettings};
pub use drain::{Drain, Work};
pub use flags::{AccessFlags, ControlFlags, ServerFlags, UploadFlags};
pub use registry::Registry;
pub use restrict::{ApiKeys, Endpoint, Restrictions, GRPC_HEADER_PREFIX};
pub use table::{ModelEntry, ModelTable};

use crate::domain::{ModelVersion, Normalize};
use crate::error::{ErrorKind, HasKind};
use crate::pace::BodyPace;
use crate::pipeline::ImagePipeline;
use crate::preprocess::{PreprocessPool, PreprocessSettings};
use crate::repository::RepositoryModel;
use crate::scheduler::{ModelHandle, ModelState};
use crate::telemetry::Metrics;

/// Limits of a request body (`max_files`, `max_file_bytes`: of a `/predict` upload).
#[derive(Debug, Clone)]
pub struct UploadLimits {
    pub max_files: usize,
    pub max_file_bytes: u64,
    pub max_body_bytes: u64,
    /// Of a KServe inference request over HTTP (`--http-max-input-size`, else
    /// `max_body_bytes`).
    pub max_input_bytes: u64,
    pub pace: BodyPace,
}

/// One served version of a model. Cheap to clone (handles and `Arc`s).
#[derive(Clone)]
pub enum ServedModel {
    Classifier {
        model: Arc<RepositoryModel>,
        handle: ModelHandle,
    },
    Preprocessor {
        model: Arc<RepositoryModel>,
        preprocess: Arc<PreprocessSettings>,
        normalize: Normalize,
    },
    Ensemble {
        model: Arc<RepositoryModel>,
        pipeline: ImagePipeline,
    },
}

impl ServedModel {
    /// The model as read from the repository (its parsed `config.pbtxt`, its version).
    pub fn repository_model(&self) -> &RepositoryModel {
        match self {
            ServedModel::Classifier { model, .. }
            | ServedModel::Preprocessor { model, .. }
            | ServedModel::Ensemble { model, .. } => model,
        }
    }

    /// The scheduled model behind it (an ensemble's is its classifier's).
    pub fn handle(&self) -> Option<&ModelHandle> {
        match self {
            ServedModel::Classifier { handle, .. } => Some(handle),
            ServedModel::Ensemble { pipeline, .. } => Some(&pipeline.classifier),
            ServedModel::Preprocessor { .. } => None,
        }
    }

    /// Why the model cannot serve: its load failed, or every instance is down.
    pub fn failure(&self) -> Option<String> {
        match self.handle()?.state() {
            ModelState::Failed(why) | ModelState::Down(why) => Some(why),
            _ => None,
        }
    }

    pub fn is_ready(&self) -> bool {
        self.handle().is_none_or(ModelHandle::is_ready)
    }
}

/// Why a request's model cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("{0}")]
    InvalidName(String),
    #[error("unknown model '{name}'{why}")]
    Unknown { name: String, why: String },
    #[error("model '{name}' has no version {version} loaded (loaded: {loaded})")]
    NoSuchVersion {
        name: String,
        version: ModelVersion,
        loaded: String,
    },
    #[error(
        "model '{name}' does not take encoded images; /predict needs an image ensemble such \
         as 'ensemble_model'"
    )]
    NotAnImageModel { name: String },
}

impl HasKind for LookupError {
    fn kind(&self) -> ErrorKind {
        match self {
            LookupError::Unknown { .. } | LookupError::NoSuchVersion { .. } => ErrorKind::NotFound,
            LookupError::NotAnImageModel { .. } | LookupError::InvalidName(_) => {
                ErrorKind::InvalidInput
            }
        }
    }
}

/// What the server says of itself and whom it serves.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The name in server metadata (Triton's `--id`).
    pub id: String,
    /// Readiness waits for every loaded model (Triton's `--strict-readiness`); without
    /// it, the server is ready once it runs.
    pub strict_readiness: bool,
    /// Clients may register shared memory, system and CUDA (Triton's `--allow-client-shm`).
    pub allow_client_shm: bool,
    /// Restricted endpoints per transport.
    pub keys: ApiKeys,
    /// The tracer: the trace settings in force (Triton's trace extension reads and changes
    /// them) and where sampled requests' traces go.
    pub trace: Arc<crate::trace::Tracer>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            id: "visiongate".to_string(),
            strict_readiness: true,
            allow_client_shm: false,
            keys: ApiKeys::default(),
            trace: Arc::new(crate::trace::Tracer::off()),
        }
    }
}

/// What the shared state is built with, besides the models' build options.
pub struct StateSettings {
    pub control: ControlSettings,
    /// The repositories `control` names, opened (remote ones' clients and caches).
    pub repositories: crate::repository::Repositories,
    pub limits: UploadLimits,
    pub decode_threads: usize,
    /// Bytes of decoded images all decode threads together may hold.
    pub decode_memory: u64,
    pub server: ServerOptions,
    /// How CUDA shared-memory regions are opened.
    pub cuda_ipc: Arc<dyn crate::shm::CudaIpc>,
}

/// The state every transport shares.
pub struct AppState {
    /// The served models and their lifecycle.
    pub registry: Registry,
    /// Shutdown's count of the inference requests under way.
    pub drain: Arc<Drain>,
    pub pool: PreprocessPool,
    pub limits: UploadLimits,
    pub metrics: Arc<Metrics>,
    pub server: ServerOptions,
    /// The shared-memory regions clients registered (system and CUDA).
    pub shared_memory: crate::shm::SharedMemory,
}

impl AppState {
    /// Starts the decode pool and the models the control mode loads at start-up (call
    /// inside a Tokio runtime). Models that fail are listed as unavailable; the others
    /// serve.
    pub fn build(
        scan: crate::repository::Snapshot,
        opts: BuildOptions,
        settings: StateSettings,
    ) -> AppState {
        let metrics = opts.metrics.clone();
        AppState {
            pool: PreprocessPool::start(
                settings.decode_threads,
                settings.decode_memory,
                metrics.clone(),
                opts.cores.clone(),
            ),
            registry: Registry::start(scan, opts, settings.control, settings.repositories),
            drain: Default::default(),
            limits: settings.limits,
            metrics,
            shared_memory: crate::shm::SharedMemory::new(
                settings.server.allow_client_shm,
                settings.cuda_ipc,
            ),
            server: settings.server,
        }
    }

    /// Ready for traffic: the server is not stopping, and (with strict readiness, the
    /// default) every loaded model is ready.
    pub fn is_ready(&self) -> bool {
        !self.drain.is_draining() && (!self.server.strict_readiness || self.registry.is_ready())
    }
}
