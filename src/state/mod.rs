//! The one state every transport shares: the served models (a table replaced whole when
//! models load or unload, so a request works on one consistent snapshot), the decode pool,
//! limits and readiness.
mod build;
mod control;

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

pub use build::{batch_policy, batch_size_choice, plan_instances, BuildOptions};
pub use control::{load_parameters, unload_parameters, ControlMode, ControlParam, ControlSettings};

use crate::domain::{ModelName, ModelVersion, Normalize};
use crate::error::{ErrorKind, HasKind};
use crate::pipeline::ImagePipeline;
use crate::preprocess::{PreprocessPool, PreprocessSettings};
use crate::repository::RepositoryModel;
use crate::scheduler::{ModelHandle, ModelState};
use crate::telemetry::Metrics;

/// Limits of a `/predict` request.
#[derive(Debug, Clone)]
pub struct UploadLimits {
    pub max_files: usize,
    pub max_file_bytes: u64,
    pub max_body_bytes: u64,
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

    /// Why the model cannot serve, once its load failed.
    pub fn failure(&self) -> Option<String> {
        match self.handle()?.state() {
            ModelState::Failed(why) => Some(why),
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
    #[error("unknown model '{name}'{why}")]
    Unknown { name: String, why: String },
    #[error("model '{name}' has no version {version} loaded (loaded: {loaded})")]
    NoSuchVersion {
        name: String,
        version: ModelVersion,
        loaded: String,
    },
    #[error("model '{name}' is not ready")]
    NotReady { name: String },
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
            LookupError::NotReady { .. } => ErrorKind::NotReady,
            LookupError::NotAnImageModel { .. } => ErrorKind::InvalidInput,
        }
    }
}

/// The models served at one moment.
#[derive(Clone, Default)]
pub struct ModelTable {
    /// Per model, its served versions (the newest is the default).
    pub models: BTreeMap<ModelName, BTreeMap<ModelVersion, ServedModel>>,
    /// Models of the repository that are not served, with why (failed or unloaded).
    pub unavailable: BTreeMap<String, String>,
    /// Per loaded model, a fingerprint of its files (poll mode reloads on change).
    pub fingerprints: BTreeMap<ModelName, u64>,
    /// Loaded ensembles (every version), served while their steps are.
    pub ensembles: BTreeMap<ModelName, Vec<Arc<RepositoryModel>>>,
}

impl ModelTable {
    /// `version` of `name`, or its newest.
    pub fn get(&self, name: &str, version: Option<ModelVersion>) -> Option<&ServedModel> {
        let versions = self.models.get(&ModelName::new(name))?;
        match version {
            Some(v) => versions.get(&v),
            None => versions.values().next_back(),
        }
    }

    /// Every served version of every model.
    pub fn all(&self) -> impl Iterator<Item = &ServedModel> {
        self.models.values().flat_map(|v| v.values())
    }
}

pub struct AppState {
    table: RwLock<Arc<ModelTable>>,
    build: BuildOptions,
    pub control: ControlSettings,
    /// Serializes load, unload, polls and stopping.
    control_lock: tokio::sync::Mutex<()>,
    /// Models taken out of service and still finishing their requests (joined on stop,
    /// so no libtorch module outlives the gateway).
    retiring: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
    pub pool: PreprocessPool,
    pub limits: UploadLimits,
    pub metrics: Arc<Metrics>,
}

impl AppState {
    /// Starts the models the control mode loads at start-up (call inside a Tokio runtime).
    /// Models that fail are listed as unavailable; the others serve.
    pub fn build(
        scan: crate::repository::ScanResult,
        opts: BuildOptions,
        control: ControlSettings,
    ) -> AppState {
        let pool = PreprocessPool::start(
            opts.decode_threads,
            opts.decode_threads * 4,
            opts.metrics.clone(),
        );
        let state = AppState {
            table: RwLock::new(Arc::new(ModelTable::default())),
            metrics: opts.metrics.clone(),
            limits: opts.limits.clone(),
            build: opts,
            control,
            control_lock: tokio::sync::Mutex::new(()),
            retiring: Default::default(),
            pool,
        };
        let table = state.initial_table(scan);
        *state.table.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(table);
        state
    }

    /// The models served now (a snapshot: later loads and unloads do not change it).
    pub fn models(&self) -> Arc<ModelTable> {
        self.table.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn replace_table(&self, table: ModelTable) {
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(table);
    }

    /// The newest served version of `name`.
    pub fn model(&self, name: &str) -> Result<ServedModel, LookupError> {
        self.model_version(name, None)
    }

    /// `version` of `name` (its newest when `None`).
    pub fn model_version(
        &self,
        name: &str,
        version: Option<ModelVersion>,
    ) -> Result<ServedModel, LookupError> {
        let table = self.models();
        if let Some(served) = table.get(name, version) {
            return Ok(served.clone());
        }
        let name = name.to_string();
        Err(match (table.models.get(&ModelName::new(&name)), version) {
            (Some(versions), Some(version)) => LookupError::NoSuchVersion {
                name,
                version,
                loaded: versions
                    .keys()
                    .map(|v| v.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            },
            _ => LookupError::Unknown {
                why: table
                    .unavailable
                    .get(&name)
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default(),
                name,
            },
        })
    }

    /// The image pipeline behind `name`, for `/predict`.
    pub fn image_pipeline(&self, name: &str) -> Result<ImagePipeline, LookupError> {
        match self.model(name)? {
            ServedModel::Ensemble { pipeline, .. } if pipeline.classifier.is_ready() => {
                Ok(pipeline)
            }
            ServedModel::Ensemble { .. } => Err(LookupError::NotReady { name: name.into() }),
            _ => Err(LookupError::NotAnImageModel { name: name.into() }),
        }
    }

    /// Ready: every loaded model is ready (failed ones are reported by their own status).
    pub fn is_ready(&self) -> bool {
        self.models().all().all(ServedModel::is_ready)
    }

    /// Takes `handles` out of service in the background: their admitted requests finish
    /// first. `stop_models` waits for them.
    pub(crate) fn retire(&self, handles: Vec<ModelHandle>) {
        let mut retiring = self.retiring.lock().unwrap_or_else(|p| p.into_inner());
        retiring.retain(|t| !t.is_finished());
        for handle in handles {
            retiring.push(tokio::spawn(async move {
                handle.retire().await;
                tracing::info!(model = %handle.name(), version = %handle.version(), "model stopped");
            }));
        }
    }

    /// Stops every model, the served ones and those still retiring, once no load or
    /// unload is under way. Call after the listeners stopped.
    pub async fn stop_models(&self) {
        let _guard = self.control_lock.lock().await;
        for handle in self.handles() {
            handle.shutdown().await;
        }
        let retiring =
            std::mem::take(&mut *self.retiring.lock().unwrap_or_else(|p| p.into_inner()));
        for task in retiring {
            let _ = task.await;
        }
    }

    /// Every distinct scheduled model (for waiting and stopping).
    pub fn handles(&self) -> Vec<ModelHandle> {
        let table = self.models();
        let mut handles: Vec<ModelHandle> = Vec::new();
        for served in table.all() {
            if let ServedModel::Classifier { handle, .. } = served {
                handles.push(handle.clone());
            }
        }
        handles
    }
}
