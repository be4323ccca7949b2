//! The one state every transport shares: the served models, the decode pool, limits and
//! readiness. Immutable after start-up (readiness goes through the model handles).
use std::collections::HashMap;
use std::sync::Arc;

use crate::domain::{InstanceId, ModelName, ModelVersion, Normalize};
use crate::error::{ErrorKind, GatewayError};
use crate::preprocess::{PreprocessPool, PreprocessSettings};
use crate::repository::{
    ClassifierSpec, GroupKind, InstanceGroupSpec, ModelKind, PreprocessorSpec, RepositoryModel,
};
use crate::scheduler::{
    BatchPolicy, BatchSizeChoice, EngineFactory, ModelHandle, ModelSettings, QueuePolicy,
    ResponseCache,
};
use crate::telemetry::Metrics;

/// Limits of a `/predict` request.
#[derive(Debug, Clone)]
pub struct UploadLimits {
    pub max_files: usize,
    pub max_file_bytes: u64,
    pub max_body_bytes: u64,
}

/// What `/predict` needs to serve one image model end to end.
#[derive(Clone)]
pub struct ImagePipeline {
    pub name: ModelName,
    pub version: ModelVersion,
    pub preprocess: Arc<PreprocessSettings>,
    pub normalize: Normalize,
    pub classifier: ModelHandle,
    pub num_classes: usize,
    pub labels: Option<Arc<Vec<String>>>,
}

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

    /// Why the model cannot serve, once its load failed.
    pub fn failure(&self) -> Option<String> {
        let handle = match self {
            ServedModel::Classifier { handle, .. } => handle,
            ServedModel::Ensemble { pipeline, .. } => &pipeline.classifier,
            ServedModel::Preprocessor { .. } => return None,
        };
        match handle.state() {
            crate::scheduler::ModelState::Failed(why) => Some(why),
            _ => None,
        }
    }

    pub fn is_ready(&self) -> bool {
        match self {
            ServedModel::Classifier { handle, .. } => handle.is_ready(),
            ServedModel::Preprocessor { .. } => true,
            ServedModel::Ensemble { pipeline, .. } => pipeline.classifier.is_ready(),
        }
    }
}

pub struct AppState {
    pub models: HashMap<ModelName, ServedModel>,
    /// Models that are in the repository but failed to load, with why.
    pub failed: Vec<(String, String)>,
    pub pool: PreprocessPool,
    pub limits: UploadLimits,
    pub metrics: Arc<Metrics>,
}

/// Everything `AppState::build` needs besides the repository.
pub struct BuildOptions {
    pub factory: EngineFactory,
    pub metrics: Arc<Metrics>,
    pub gpu_count: usize,
    pub default_queue_size: usize,
    /// Size of the response cache shared by the models that enable it.
    pub cache_bytes: usize,
    pub max_image_pixels: u64,
    pub dct_override: Option<u32>,
    pub decode_threads: usize,
    pub limits: UploadLimits,
}

impl AppState {
    /// Starts every loadable model (call inside a Tokio runtime). Models that fail are
    /// listed in `failed`; the others serve.
    pub fn build(scan: crate::repository::ScanResult, opts: BuildOptions) -> AppState {
        let mut failed: Vec<(String, String)> = scan
            .failures
            .iter()
            .map(|f| (f.model.clone(), f.error.to_string()))
            .collect();
        for (model, error) in &failed {
            tracing::error!(model, "model not loaded: {error}");
        }
        let repo: Vec<Arc<RepositoryModel>> = scan.models.into_iter().map(Arc::new).collect();
        let mut models = HashMap::new();
        let mut classifiers: HashMap<ModelName, (ModelHandle, ClassifierSpec)> = HashMap::new();
        // One cache for every model that enables it, as Triton has one.
        let cache = Arc::new(ResponseCache::new(opts.cache_bytes));

        for m in &repo {
            match &m.kind {
                ModelKind::Classifier(spec) => {
                    let (instances, warning) =
                        plan_instances(&spec.instance_groups, opts.gpu_count);
                    if let Some(w) = warning {
                        tracing::warn!(model = %m.name, "{w}");
                    }
                    let settings = ModelSettings {
                        name: m.name.clone(),
                        version: m.version,
                        instances,
                        model_file: spec.model_file.clone(),
                        policy: batch_policy(spec, opts.default_queue_size),
                        cache: spec.response_cache.then(|| cache.clone()),
                        height: spec.height,
                        width: spec.width,
                        batch_size: batch_size_choice(spec),
                        metrics: opts.metrics.clone(),
                    };
                    let handle = crate::scheduler::start_model(settings, opts.factory.clone());
                    classifiers.insert(m.name.clone(), (handle.clone(), spec.clone()));
                    models.insert(
                        m.name.clone(),
                        ServedModel::Classifier {
                            model: m.clone(),
                            handle,
                        },
                    );
                }
                ModelKind::Preprocessor(p) => {
                    models.insert(
                        m.name.clone(),
                        ServedModel::Preprocessor {
                            model: m.clone(),
                            preprocess: Arc::new(preprocess_settings(p, &opts)),
                            normalize: p.normalize,
                        },
                    );
                }
                ModelKind::Ensemble(_) => {}
            }
        }
        for m in &repo {
            let ModelKind::Ensemble(e) = &m.kind else {
                continue;
            };
            let pre = repo
                .iter()
                .find(|p| p.name == e.preprocessor)
                .map(|p| &p.kind);
            let cls = classifiers.get(&e.classifier);
            match (pre, cls) {
                (Some(ModelKind::Preprocessor(p)), Some((handle, spec))) => {
                    let pipeline = ImagePipeline {
                        name: m.name.clone(),
                        version: m.version,
                        preprocess: Arc::new(preprocess_settings(p, &opts)),
                        normalize: p.normalize,
                        classifier: handle.clone(),
                        num_classes: spec.num_classes,
                        labels: spec.labels.clone(),
                    };
                    models.insert(
                        m.name.clone(),
                        ServedModel::Ensemble {
                            model: m.clone(),
                            pipeline,
                        },
                    );
                }
                _ => failed.push((m.name.to_string(), "its steps did not load".into())),
            }
        }
        AppState {
            models,
            failed,
            pool: PreprocessPool::start(
                opts.decode_threads,
                opts.decode_threads * 4,
                opts.metrics.clone(),
            ),
            metrics: opts.metrics,
            limits: opts.limits,
        }
    }

    pub fn model(&self, name: &str) -> Result<&ServedModel, GatewayError> {
        self.models.get(&ModelName::new(name)).ok_or_else(|| {
            let why = self
                .failed
                .iter()
                .find(|(m, _)| m == name)
                .map(|(_, e)| format!(" (it failed to load: {e})"))
                .unwrap_or_default();
            GatewayError::new(ErrorKind::NotFound, format!("unknown model '{name}'{why}"))
        })
    }

    /// The image pipeline behind `name`, for `/predict`.
    pub fn image_pipeline(&self, name: &str) -> Result<&ImagePipeline, GatewayError> {
        match self.model(name)? {
            ServedModel::Ensemble { pipeline, .. } => {
                if !pipeline.classifier.is_ready() {
                    return Err(GatewayError::new(
                        ErrorKind::NotReady,
                        format!("model '{name}' is not ready"),
                    ));
                }
                Ok(pipeline)
            }
            _ => Err(GatewayError::new(
                ErrorKind::InvalidInput,
                format!(
                    "model '{name}' does not take encoded images; /predict needs an image \
                     ensemble such as 'ensemble_model'"
                ),
            )),
        }
    }

    /// Ready: every loaded model is ready (failed ones are reported by their own status).
    pub fn is_ready(&self) -> bool {
        self.models.values().all(|m| m.is_ready())
    }
}

fn preprocess_settings(p: &PreprocessorSpec, opts: &BuildOptions) -> PreprocessSettings {
    PreprocessSettings {
        width: p.width,
        height: p.height,
        dct_scaling_min_side: opts.dct_override.unwrap_or(p.dct_scaling_min_side),
        max_pixels: opts.max_image_pixels,
    }
}

/// The scheduler's policy from `dynamic_batching`: one queue per priority level, each with
/// its own capacity (the config's `max_queue_size`, else `default_queue_size`) and timeouts.
pub fn batch_policy(spec: &ClassifierSpec, default_queue_size: usize) -> BatchPolicy {
    let Some(b) = &spec.batching else {
        return BatchPolicy::single_queue(spec.max_batch_size, default_queue_size);
    };
    BatchPolicy {
        max_batch_size: spec.max_batch_size,
        max_queue_delay: b.max_queue_delay,
        merge_requests: true,
        queues: b
            .queues
            .iter()
            .map(|q| QueuePolicy {
                timeout_action: q.timeout_action,
                default_timeout: q.default_timeout,
                allow_timeout_override: q.allow_timeout_override,
                capacity: q.max_queue_size.unwrap_or(default_queue_size),
            })
            .collect(),
        default_level: b.default_level,
    }
}

/// How an instance picks its batch size. Without `dynamic_batching` requests run alone
/// (the size only bounds warm-up); one preferred size pins it; none means Triton's "grow to
/// max_batch_size"; several are candidates timed at warm-up, the fastest per image wins.
pub fn batch_size_choice(spec: &ClassifierSpec) -> BatchSizeChoice {
    let max = spec.max_batch_size;
    match &spec.batching {
        None => BatchSizeChoice::Pinned(1),
        Some(b) => match b.preferred_batch_sizes.as_slice() {
            [] => BatchSizeChoice::Pinned(max),
            [one] => BatchSizeChoice::Pinned(*one),
            many => {
                let mut candidates = many.to_vec();
                if !candidates.contains(&max) {
                    candidates.push(max);
                }
                BatchSizeChoice::Tune(candidates)
            }
        },
    }
}

/// Expands `instance_group`s into instances on the devices that exist. Triton's rules:
/// a GPU group runs `count` instances on each listed GPU (all GPUs when none are listed);
/// a CPU group runs `count` instances. Missing GPUs fall back (fewer GPUs, or the CPU)
/// with one warning.
pub fn plan_instances(
    groups: &[InstanceGroupSpec],
    gpu_count: usize,
) -> (Vec<InstanceId>, Option<String>) {
    let mut out = Vec::new();
    let mut warnings = Vec::new();
    let mut next_index: HashMap<Option<u32>, u32> = HashMap::new();
    let mut push = |gpu: Option<u32>, out: &mut Vec<InstanceId>| {
        let idx = next_index.entry(gpu).or_insert(0);
        out.push(InstanceId { gpu, index: *idx });
        *idx += 1;
    };
    for g in groups {
        match g.kind {
            GroupKind::Cpu => (0..g.count).for_each(|_| push(None, &mut out)),
            GroupKind::Gpu | GroupKind::Auto => {
                let wanted: Vec<u32> = if g.gpus.is_empty() {
                    (0..gpu_count as u32).collect()
                } else {
                    g.gpus.clone()
                };
                let present: Vec<u32> = wanted
                    .iter()
                    .copied()
                    .filter(|&i| (i as usize) < gpu_count)
                    .collect();
                if present.is_empty() {
                    if g.kind == GroupKind::Gpu {
                        warnings.push(format!(
                            "KIND_GPU asks for GPUs {wanted:?} but {gpu_count} are available: running {} instance(s) on the CPU",
                            g.count
                        ));
                    }
                    (0..g.count).for_each(|_| push(None, &mut out));
                } else {
                    if present.len() < wanted.len() {
                        warnings.push(format!(
                            "KIND_GPU asks for GPUs {wanted:?}; only {present:?} exist, using those"
                        ));
                    }
                    for gpu in present {
                        (0..g.count).for_each(|_| push(Some(gpu), &mut out));
                    }
                }
            }
        }
    }
    let warning = (!warnings.is_empty()).then(|| warnings.join("; "));
    (out, warning)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu_group(count: u32, gpus: &[u32]) -> InstanceGroupSpec {
        InstanceGroupSpec {
            kind: GroupKind::Gpu,
            count,
            gpus: gpus.to_vec(),
        }
    }

    #[test]
    fn gpu_groups_run_count_per_gpu() {
        let (ids, warn) = plan_instances(&[gpu_group(2, &[0, 1])], 2);
        assert!(warn.is_none());
        let gpus: Vec<_> = ids.iter().map(|i| (i.gpu, i.index)).collect();
        assert_eq!(
            gpus,
            [(Some(0), 0), (Some(0), 1), (Some(1), 0), (Some(1), 1)]
        );
    }

    #[test]
    fn missing_gpus_fall_back_with_one_warning() {
        let (ids, warn) = plan_instances(&[gpu_group(2, &[0, 1])], 1);
        assert_eq!(ids.len(), 2);
        assert!(ids.iter().all(|i| i.gpu == Some(0)));
        assert!(warn.unwrap().contains("only [0]"));

        let (ids, warn) = plan_instances(&[gpu_group(2, &[0, 1])], 0);
        assert_eq!(
            ids,
            vec![
                InstanceId {
                    gpu: None,
                    index: 0
                },
                InstanceId {
                    gpu: None,
                    index: 1
                }
            ]
        );
        assert!(warn.unwrap().contains("on the CPU"));
    }

    #[test]
    fn auto_groups_use_the_cpu_quietly_without_gpus() {
        let g = InstanceGroupSpec {
            kind: GroupKind::Auto,
            count: 1,
            gpus: vec![],
        };
        let (ids, warn) = plan_instances(&[g], 0);
        assert_eq!(ids.len(), 1);
        assert!(warn.is_none());
    }
}
