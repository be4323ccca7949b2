//! Starting models: classifier handles with their instances, preprocessor settings, and
//! ensembles linked to the newest versions of their steps.
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{ModelTable, Registry, ServedModel};
use crate::cores::Cores;
use crate::domain::{InstanceId, ModelName, Precision, Runtime};
use crate::engine::EngineSpec;
use crate::pipeline::ImagePipeline;
use crate::preprocess::PreprocessSettings;
use crate::repository::{
    ClassifierSpec, GroupKind, InstanceGroupSpec, ModelKind, PreprocessorSpec, RepositoryModel,
};
use crate::scheduler::{
    BatchPolicy, BatchSizeChoice, EngineFactory, ModelHandle, ModelSettings, QueuePolicy,
    ResponseCache,
};
use crate::telemetry::Metrics;

/// Everything starting a model needs besides the repository.
pub struct BuildOptions {
    pub factory: EngineFactory,
    pub metrics: Arc<Metrics>,
    pub gpu_count: usize,
    /// GPUs the NVIDIA driver sees where CUDA cannot start (0 otherwise): `KIND_GPU`
    /// instances are planned there and fail their load with the reason.
    pub unusable_gpus: usize,
    pub default_queue_size: usize,
    /// The response cache shared by the models that enable it (as Triton has one).
    pub cache: Arc<ResponseCache>,
    pub max_image_pixels: u64,
    pub dct_override: Option<u32>,
    /// `--precision`: every classifier's, instead of its config's.
    pub precision: Option<Precision>,
    /// Instance threads running now, of every model (the `--max-instances` budget).
    pub live_instances: Arc<AtomicUsize>,
    /// The host's cores, which CPU instances share with the decode threads.
    pub cores: Arc<Cores>,
}

impl Registry {
    /// Starts `models` (every version given) into `table`: classifiers get new handles
    /// (returned, still loading), preprocessors their settings, ensembles are recorded and
    /// linked. Versions of a model already in `table` are replaced as a whole. A classifier
    /// whose instances would be over a limit is not started: it is listed unavailable in
    /// `table`, and why is returned.
    pub(super) fn start_models(
        &self,
        models: &[Arc<RepositoryModel>],
        table: &mut ModelTable,
    ) -> Started {
        let opts = &self.build;
        let limits = &self.control.limits;
        let mut started = Started::default();
        let mut names: Vec<&ModelName> = models.iter().map(|m| &m.name).collect();
        names.dedup();
        for name in names {
            let entry = table.entry_mut(name);
            entry.served.clear();
            entry.ensemble.clear();
            entry.unavailable = None;
        }
        for m in models {
            let served = match &m.kind {
                ModelKind::Classifier(spec) => {
                    let planned = plan_instances(
                        &spec.instance_groups,
                        opts.gpu_count,
                        opts.unusable_gpus,
                        limits.model_instances,
                    )
                    .and_then(|(instances, fallback)| {
                        let live = opts.live_instances.load(Ordering::SeqCst);
                        if live + instances.len() > limits.instances {
                            return Err(format!(
                                "field 'instance_group': its {} instances and the {live} \
                                 running would be more than the {} allowed in all \
                                 (--max-instances)",
                                instances.len(),
                                limits.instances
                            ));
                        }
                        Ok((instances, fallback))
                    });
                    let (instances, fallback) = match planned {
                        Ok(planned) => planned,
                        Err(why) => {
                            let why = format!("model '{}' version {}: {why}", m.name, m.version);
                            tracing::error!("{why}");
                            table.entry_mut(&m.name).unavailable = Some(why.clone());
                            started.refused.push(why);
                            continue;
                        }
                    };
                    if let Some(w) = &fallback {
                        tracing::warn!(model = %m.name, "{w}");
                    }
                    if spec.batch_rows < spec.max_batch_size {
                        tracing::info!(
                            model = %m.name,
                            max_batch_size = spec.max_batch_size,
                            batch_rows = spec.batch_rows,
                            "the batches this server forms hold at most {} rows: {} rows of FP32 \
                             [3, {}, {}] would be over --max-batch-bytes {}; a larger request is \
                             cut into such batches",
                            spec.batch_rows,
                            spec.max_batch_size,
                            spec.height,
                            spec.width,
                            limits.batch_bytes
                        );
                    }
                    let settings = ModelSettings {
                        name: m.name.clone(),
                        version: m.version,
                        instances,
                        engine: EngineSpec {
                            file: spec.model_file.clone(),
                            runtime: spec.runtime,
                            precision: precision(spec, opts.precision),
                            max_batch_size: spec.batch_rows,
                            input: spec.input_name.clone(),
                            height: spec.height,
                            width: spec.width,
                            output: spec.output_name.clone(),
                            num_classes: spec.num_classes,
                        },
                        policy: batch_policy(spec, opts.default_queue_size),
                        cache: spec.response_cache.then(|| opts.cache.clone()),
                        batch_size: batch_size_choice(spec),
                        warmup: spec.warmup.clone(),
                        fallback,
                        metrics: opts.metrics.clone(),
                        live_instances: opts.live_instances.clone(),
                        cores: opts.cores.clone(),
                    };
                    let handle = crate::scheduler::start_model(settings, opts.factory.clone());
                    started.handles.push(handle.clone());
                    ServedModel::Classifier {
                        model: m.clone(),
                        handle,
                    }
                }
                ModelKind::Preprocessor(p) => ServedModel::Preprocessor {
                    model: m.clone(),
                    preprocess: Arc::new(preprocess_settings(p, opts)),
                    normalize: p.normalize,
                },
                ModelKind::Ensemble(_) => {
                    table.entry_mut(&m.name).ensemble.push(m.clone());
                    continue;
                }
            };
            table.entry_mut(&m.name).served.insert(m.version, served);
        }
        link_ensembles(table);
        started
    }
}

/// The precision a classifier runs in: `--precision` over its config's, for the runtime
/// that offers reduced precisions (libtorch's TorchScript); an ONNX or OpenVINO model or a
/// torch.export package keeps its config's (FP32 unless it asks otherwise), the flag logged
/// as not applied to it.
fn precision(spec: &ClassifierSpec, flag: Option<Precision>) -> Precision {
    match (spec.runtime, flag) {
        (Runtime::Onnx(_) | Runtime::OpenVino(_) | Runtime::TorchAoti, Some(p))
            if p != spec.precision =>
        {
            tracing::warn!(
                "--precision={p} applies to TorchScript models only: {} runs in {}",
                spec.runtime.format(),
                spec.precision
            );
            spec.precision
        }
        (_, flag) => flag.unwrap_or(spec.precision),
    }
}

/// What `start_models` started, and the models it refused.
#[derive(Default)]
pub(super) struct Started {
    pub handles: Vec<ModelHandle>,
    pub refused: Vec<String>,
}

/// (Re)builds every recorded ensemble on the newest versions of its steps; an ensemble
/// whose steps are not served is unavailable until they are.
pub(super) fn link_ensembles(table: &mut ModelTable) {
    let ensembles: Vec<(ModelName, Vec<Arc<RepositoryModel>>)> = table
        .entries()
        .filter(|(_, e)| !e.ensemble.is_empty())
        .map(|(n, e)| (n.clone(), e.ensemble.clone()))
        .collect();
    for (name, versions) in ensembles {
        let mut served = std::collections::BTreeMap::new();
        let mut unavailable = None;
        // The last version decides whether the model is listed unavailable.
        for m in versions {
            match ensemble_pipeline(table, &m) {
                Ok(pipeline) => {
                    unavailable = None;
                    served.insert(m.version, ServedModel::Ensemble { model: m, pipeline });
                }
                Err(why) => unavailable = Some(why),
            }
        }
        let entry = table.entry_mut(&name);
        entry.served = served;
        entry.unavailable = unavailable;
    }
}

/// The ensemble `m` on the newest versions of its steps in `table`, or why it cannot run.
fn ensemble_pipeline(
    table: &ModelTable,
    m: &Arc<RepositoryModel>,
) -> Result<ImagePipeline, String> {
    let ModelKind::Ensemble(e) = &m.kind else {
        return Err("not an ensemble".to_string());
    };
    let (pre, cls) = match (
        table.get(e.preprocessor.as_str(), None),
        table.get(e.classifier.as_str(), None),
    ) {
        (
            Some(ServedModel::Preprocessor {
                model: pre_model,
                preprocess,
                normalize,
            }),
            Some(ServedModel::Classifier { model, handle }),
        ) => ((preprocess, normalize, pre_model), (model, handle)),
        (pre, _) => {
            let missing = if pre.is_none() {
                &e.preprocessor
            } else {
                &e.classifier
            };
            return Err(format!("its step '{missing}' is not loaded"));
        }
    };
    let ModelKind::Classifier(spec) = &cls.0.kind else {
        return Err(format!("its step '{}' is not a classifier", e.classifier));
    };
    // Steps reloaded on their own (new files, a config override) must still fit.
    let made = (pre.0.width as usize, pre.0.height as usize);
    if made != (spec.width, spec.height) {
        return Err(format!(
            "its preprocessor makes {}x{} images but its classifier takes {}x{}",
            made.0, made.1, spec.width, spec.height
        ));
    }
    Ok(ImagePipeline {
        name: m.name.clone(),
        version: m.version,
        preprocessor: (pre.2.name.clone(), pre.2.version),
        preprocess: pre.0.clone(),
        normalize: *pre.1,
        classifier: cls.1.clone(),
        num_classes: spec.num_classes,
        labels: spec.labels.clone(),
    })
}

fn preprocess_settings(p: &PreprocessorSpec, opts: &BuildOptions) -> PreprocessSettings {
    PreprocessSettings {
        width: p.width,
        height: p.height,
        dct_scaling_min_side: opts.dct_override.unwrap_or(p.dct_scaling_min_side),
        max_pixels: opts.max_image_pixels,
        filter: p.filter,
    }
}

/// The scheduler's policy from `dynamic_batching`: one queue per priority level, each with
/// its own capacity (the config's `max_queue_size`, else `default_queue_size`) and timeouts.
pub fn batch_policy(spec: &ClassifierSpec, default_queue_size: usize) -> BatchPolicy {
    let Some(b) = &spec.batching else {
        return BatchPolicy::single_queue(spec.batch_rows, default_queue_size);
    };
    BatchPolicy {
        max_batch_size: spec.batch_rows,
        max_queue_delay: b.max_queue_delay,
        // The spec's sizes are ascending.
        smallest_preferred: (b.preferred_batch_sizes.first().copied())
            .filter(|&n| n <= spec.batch_rows),
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
/// Sizes over the largest batch the server forms (`batch_rows`) are left out, and that
/// largest batch stands in for max_batch_size.
pub fn batch_size_choice(spec: &ClassifierSpec) -> BatchSizeChoice {
    let preferred = spec
        .batching
        .as_ref()
        .map(|b| b.preferred_batch_sizes.as_slice());
    choose_batch_size(preferred, spec.batch_rows)
}

/// `batch_size_choice` from the preferred sizes (`None`: no dynamic batching) and the
/// largest batch the server forms.
fn choose_batch_size(preferred: Option<&[usize]>, max: usize) -> BatchSizeChoice {
    let Some(all) = preferred else {
        return BatchSizeChoice::Pinned(1);
    };
    let preferred: Vec<usize> = all.iter().copied().filter(|&n| n <= max).collect();
    match preferred.as_slice() {
        [] => BatchSizeChoice::Pinned(max),
        [one] if all.len() == 1 => BatchSizeChoice::Pinned(*one),
        _ => {
            let mut candidates = preferred;
            if !candidates.contains(&max) {
                candidates.push(max);
            }
            BatchSizeChoice::Tune(candidates)
        }
    }
}

/// Expands `instance_group`s into instances on the devices that exist. Triton's rules:
/// a GPU group runs `count` instances on each listed GPU (all GPUs when none are listed);
/// a CPU group runs `count` instances. Missing GPUs fall back (fewer GPUs, or the CPU)
/// with one warning. More than `max` instances in all is refused, saying how many.
pub fn plan_instances(
    groups: &[InstanceGroupSpec],
    gpu_count: usize,
    unusable_gpus: usize,
    max: usize,
) -> Result<(Vec<InstanceId>, Option<String>), String> {
    // First the devices of each group (each runs `count` instances), so that the total is
    // checked before a single instance is listed.
    let mut warnings = Vec::new();
    let mut placed: Vec<(u32, Vec<Option<u32>>)> = Vec::new();
    for g in groups {
        match g.kind {
            GroupKind::Cpu => placed.push((g.count, vec![None])),
            GroupKind::Gpu | GroupKind::Auto => {
                // KIND_GPU on a host whose GPUs CUDA cannot use is planned on them, so
                // that its load fails with the reason; an Auto group uses the CPU.
                let gpu_count = if g.kind == GroupKind::Gpu && gpu_count == 0 {
                    unusable_gpus
                } else {
                    gpu_count
                };
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
                    placed.push((g.count, vec![None]));
                } else {
                    if present.len() < wanted.len() {
                        warnings.push(format!(
                            "KIND_GPU asks for GPUs {wanted:?}; only {present:?} exist, using those"
                        ));
                    }
                    placed.push((g.count, present.into_iter().map(Some).collect()));
                }
            }
        }
    }
    let total: u64 = placed
        .iter()
        .map(|(count, devices)| *count as u64 * devices.len() as u64)
        .sum();
    if total > max as u64 {
        return Err(format!(
            "field 'instance_group': {total} instances on this host; at most {max} are \
             allowed per model (--max-model-instances)"
        ));
    }
    let mut out = Vec::new();
    let mut next_index: HashMap<Option<u32>, u32> = HashMap::new();
    for (count, devices) in placed {
        for gpu in devices {
            for _ in 0..count {
                let index = next_index.entry(gpu).or_insert(0);
                out.push(InstanceId { gpu, index: *index });
                *index += 1;
            }
        }
    }
    let warning = (!warnings.is_empty()).then(|| warnings.join("; "));
    Ok((out, warning))
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
    fn preferred_sizes_over_the_largest_batch_are_left_out() {
        use BatchSizeChoice::{Pinned, Tune};
        // The seeds' sizes with 445 rows to a batch (FP32 [3, 224, 224], 256 MiB).
        let seeds = [32, 64, 128, 256, 512, 1024];
        assert_eq!(
            choose_batch_size(Some(&seeds), 445),
            Tune(vec![32, 64, 128, 256, 445])
        );
        assert_eq!(choose_batch_size(Some(&seeds), 4096), {
            let mut all = seeds.to_vec();
            all.push(4096);
            Tune(all)
        });
        assert_eq!(choose_batch_size(Some(&[1024]), 445), Pinned(445));
        assert_eq!(choose_batch_size(Some(&[16]), 445), Pinned(16));
        assert_eq!(
            choose_batch_size(Some(&[16, 1024]), 445),
            Tune(vec![16, 445])
        );
        assert_eq!(choose_batch_size(Some(&[]), 445), Pinned(445));
        assert_eq!(choose_batch_size(None, 445), Pinned(1));
    }

    #[test]
    fn gpu_groups_run_count_per_gpu() {
        let (ids, warn) = plan_instances(&[gpu_group(2, &[0, 1])], 2, 0, 8).unwrap();
        assert!(warn.is_none());
        let gpus: Vec<_> = ids.iter().map(|i| (i.gpu, i.index)).collect();
        assert_eq!(
            gpus,
            [(Some(0), 0), (Some(0), 1), (Some(1), 0), (Some(1), 1)]
        );
    }

    #[test]
    fn missing_gpus_fall_back_with_one_warning() {
        let (ids, warn) = plan_instances(&[gpu_group(2, &[0, 1])], 1, 0, 8).unwrap();
        assert_eq!(ids.len(), 2);
        assert!(ids.iter().all(|i| i.gpu == Some(0)));
        assert!(warn.unwrap().contains("only [0]"));

        let (ids, warn) = plan_instances(&[gpu_group(2, &[0, 1])], 0, 0, 8).unwrap();
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
        let (ids, warn) = plan_instances(std::slice::from_ref(&g), 0, 0, 8).unwrap();
        assert_eq!(ids.len(), 1);
        assert!(warn.is_none());
        // Where CUDA cannot start, an Auto group still uses the CPU; KIND_GPU does not.
        let (ids, _) = plan_instances(std::slice::from_ref(&g), 0, 1, 8).unwrap();
        assert_eq!(ids[0].gpu, None);
        let (ids, _) = plan_instances(&[gpu_group(1, &[])], 0, 1, 8).unwrap();
        assert_eq!(ids[0].gpu, Some(0));
    }

    #[test]
    fn more_instances_than_the_limit_are_refused_before_any_is_planned() {
        let cpu = InstanceGroupSpec {
            kind: GroupKind::Cpu,
            count: u32::MAX,
            gpus: vec![],
        };
        let e = plan_instances(std::slice::from_ref(&cpu), 0, 0, 32).unwrap_err();
        assert!(
            e.contains("4294967295 instances") && e.contains("--max-model-instances"),
            "{e}"
        );
        // Per listed GPU, and on every GPU when none are listed.
        assert!(plan_instances(&[gpu_group(16, &[0, 1])], 2, 0, 32).is_ok());
        assert!(plan_instances(&[gpu_group(17, &[0, 1])], 2, 0, 32).is_err());
        assert!(plan_instances(&[gpu_group(9, &[])], 4, 0, 32).is_err());
    }
}
