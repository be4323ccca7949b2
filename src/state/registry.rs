//! The model registry: the table of served models, swapped whole (a request works on one
//! consistent snapshot), and everything that changes it: start-up and start of models
//! (`build.rs`), load, unload and polls (`control.rs`), and retiring the models they
//! replace.
use std::sync::{Arc, RwLock};

use super::{BuildOptions, ControlSettings, LookupError, ModelTable, ServedModel};
use crate::domain::{ModelName, ModelVersion};
use crate::pipeline::ImagePipeline;
use crate::repository::{Repositories, Snapshot};
use crate::scheduler::ModelHandle;

pub struct Registry {
    table: RwLock<Arc<ModelTable>>,
    pub(super) build: BuildOptions,
    pub control: ControlSettings,
    /// Every repository, read through [`Repositories::scan`] (remote ones synced first).
    pub repositories: Repositories,
    /// Serializes load, unload, polls and stopping.
    pub(super) control_lock: tokio::sync::Mutex<()>,
    /// Models taken out of service and still finishing their requests (joined on stop,
    /// so no libtorch module outlives the gateway).
    retiring: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Registry {
    /// Starts the models the control mode loads at start-up (call inside a Tokio runtime).
    /// The scan's snapshot is kept until they have loaded: no sync (a poll, an explicit
    /// load) changes a mirror before the models it holds have loaded from it.
    pub fn start(
        scan: Snapshot,
        build: BuildOptions,
        control: ControlSettings,
        repositories: Repositories,
    ) -> Registry {
        let registry = Registry {
            table: RwLock::new(Arc::new(ModelTable::default())),
            build,
            control,
            repositories,
            control_lock: tokio::sync::Mutex::new(()),
            retiring: Default::default(),
        };
        let table = registry.initial_table(&scan);
        registry.replace_table(table);
        let loading = registry.handles();
        tokio::spawn(async move {
            for handle in loading {
                handle.wait_loaded().await;
            }
            drop(scan);
        });
        registry
    }

    /// The models served now (a snapshot: later loads and unloads do not change it).
    pub fn models(&self) -> Arc<ModelTable> {
        self.table.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(super) fn replace_table(&self, mut table: ModelTable) {
        table.prune();
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
        ModelName::check(name).map_err(LookupError::InvalidName)?;
        let table = self.models();
        if let Some(served) = table.get(name, version) {
            return Ok(served.clone());
        }
        let name = name.to_string();
        Err(match (table.versions(&name), version) {
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
                    .entry(&name)
                    .and_then(|e| e.unavailable.as_ref())
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default(),
                name,
            },
        })
    }

    /// The image pipeline behind `name`, for `/predict` (its classifier's queue says
    /// whether it is ready, where the request is counted).
    pub fn image_pipeline(&self, name: &str) -> Result<ImagePipeline, LookupError> {
        match self.model(name)? {
            ServedModel::Ensemble { pipeline, .. } => Ok(pipeline),
            _ => Err(LookupError::NotAnImageModel { name: name.into() }),
        }
    }

    /// Ready: every loaded model is ready (failed ones are reported by their own status).
    pub fn is_ready(&self) -> bool {
        self.models().all().all(ServedModel::is_ready)
    }

    /// Every scheduled model served now (for waiting and stopping).
    pub fn handles(&self) -> Vec<ModelHandle> {
        self.models()
            .all()
            .filter_map(|served| match served {
                ServedModel::Classifier { handle, .. } => Some(handle.clone()),
                _ => None,
            })
            .collect()
    }

    /// Takes `handles` out of service in the background: their admitted requests finish
    /// first. `stop_models` waits for them.
    pub(super) fn retire(&self, handles: Vec<ModelHandle>) {
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
}
