//! Validation of a parsed `ModelConfig` into what visiongate runs. Anything a config asks
//! for that visiongate does not do fails that model's load with the field and a remedy.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::pb::{self, model_config::SchedulingChoice};
use super::{LoadFailure, RepositoryError, ScanResult};
use crate::domain::{
    ModelName, ModelVersion, Normalize, Precision, ResizeFilter, TimeoutAction, WarmupData,
    WarmupSample,
};

/// Platform of TorchScript models, as Triton names it.
pub const PLATFORM_LIBTORCH: &str = "pytorch_libtorch";
pub const PLATFORM_ENSEMBLE: &str = "ensemble";
/// The built-in image preprocessor's backend name.
pub const BACKEND_IMAGE: &str = "visiongate_image";

#[derive(Debug, Clone)]
pub enum ModelKind {
    Classifier(ClassifierSpec),
    Preprocessor(PreprocessorSpec),
    Ensemble(EnsembleSpec),
}

/// A TorchScript image classifier: FP32 `[N, 3, H, W]` in, FP32 `[N, classes]` logits out.
#[derive(Debug, Clone)]
pub struct ClassifierSpec {
    pub model_file: PathBuf,
    pub max_batch_size: usize,
    pub input_name: String,
    pub height: usize,
    pub width: usize,
    pub output_name: String,
    pub num_classes: usize,
    pub labels: Option<Arc<Vec<String>>>,
    pub instance_groups: Vec<InstanceGroupSpec>,
    /// `None`: no `dynamic_batching`, so requests run one by one (as in Triton).
    pub batching: Option<BatchingSpec>,
    /// `response_cache { enable: true }`: rows seen before are answered from the cache.
    pub response_cache: bool,
    /// `model_warmup` samples with rows (those with `batch_size: 0` are skipped, as in
    /// Triton), run by each instance before the model is ready.
    pub warmup: Vec<WarmupSample>,
    /// `parameters { key: "precision" ... }`: what convolutions and matmuls run in.
    pub precision: Precision,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    Auto,
    Gpu,
    Cpu,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceGroupSpec {
    pub kind: GroupKind,
    /// Instances per listed GPU (GPU groups) or in all (CPU groups).
    pub count: u32,
    /// Empty: every visible GPU.
    pub gpus: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BatchingSpec {
    pub preferred_batch_sizes: Vec<usize>,
    pub max_queue_delay: Duration,
    /// One queue policy per priority level, highest priority first (one level when the
    /// config sets no `priority_levels`).
    pub queues: Vec<QueuePolicySpec>,
    /// Index into `queues` of the level a request without a priority gets.
    pub default_level: usize,
}

/// Triton's `ModelQueuePolicy` for one priority level.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuePolicySpec {
    pub timeout_action: TimeoutAction,
    /// `None`: requests wait without a limit unless they set their own (when allowed).
    pub default_timeout: Option<Duration>,
    /// A request may ask for a shorter timeout than the default (never a longer one).
    pub allow_timeout_override: bool,
    /// `None`: no limit in the config; the `--max-queue-size` default applies.
    pub max_queue_size: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResizeMode {
    /// Both sides to the target size, aspect ratio not kept (torchvision `Resize((h, w))`).
    Stretch,
}

/// The built-in preprocessor's settings, from its `parameters`.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessorSpec {
    pub input_name: String,
    pub output_name: String,
    pub width: u32,
    pub height: u32,
    pub resize: ResizeMode,
    pub filter: ResizeFilter,
    pub normalize: Normalize,
    /// JPEG DCT-domain scaling keeps the scaled short side at or above this; 0 = off.
    pub dct_scaling_min_side: u32,
}

/// The one ensemble shape visiongate runs: raw image → preprocessor → classifier.
#[derive(Debug, Clone)]
pub struct EnsembleSpec {
    pub input_name: String,
    pub output_name: String,
    pub preprocessor: ModelName,
    pub classifier: ModelName,
}

fn unsupported(model: &str, field: &str, remedy: impl Into<String>) -> RepositoryError {
    RepositoryError::Unsupported {
        model: model.to_string(),
        field: field.to_string(),
        remedy: remedy.into(),
    }
}

fn invalid(model: &str, field: &str, message: impl Into<String>) -> RepositoryError {
    RepositoryError::Invalid {
        model: model.to_string(),
        field: field.to_string(),
        message: message.into(),
    }
}

pub(super) fn available_versions(
    dir: &Path,
    model: &str,
) -> Result<Vec<ModelVersion>, RepositoryError> {
    let entries = std::fs::read_dir(dir).map_err(|source| RepositoryError::Io {
        path: PathBuf::from(model),
        source,
    })?;
    let mut versions: Vec<ModelVersion> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok())
        .map(ModelVersion)
        .collect();
    versions.sort();
    if versions.is_empty() {
        return Err(invalid(
            model,
            "version directories",
            "no numeric version directory (e.g. 1/) next to config.pbtxt",
        ));
    }
    Ok(versions)
}

/// Applies `version_policy` (default `latest { num_versions: 1 }`): the versions served,
/// oldest first.
pub(super) fn select_versions(
    model: &str,
    config: &pb::ModelConfig,
    available: &[ModelVersion],
) -> Result<Vec<ModelVersion>, RepositoryError> {
    use pb::model_version_policy::PolicyChoice;
    let choice = config
        .version_policy
        .as_ref()
        .and_then(|p| p.policy_choice.clone());
    let selected: Vec<ModelVersion> = match choice {
        None => available.iter().rev().take(1).rev().copied().collect(),
        Some(PolicyChoice::Latest(l)) => {
            if l.num_versions == 0 {
                return Err(invalid(
                    model,
                    "version_policy.latest.num_versions",
                    "must be at least 1",
                ));
            }
            let n = l.num_versions as usize;
            available[available.len().saturating_sub(n)..].to_vec()
        }
        Some(PolicyChoice::All(_)) => available.to_vec(),
        Some(PolicyChoice::Specific(s)) => available
            .iter()
            .filter(|v| s.versions.iter().any(|&w| w >= 0 && w as u64 == v.0))
            .copied()
            .collect(),
    };
    if selected.is_empty() {
        return Err(invalid(
            model,
            "version_policy",
            "selects none of the version directories on disk",
        ));
    }
    Ok(selected)
}

pub(crate) fn model_kind(
    dir: &Path,
    model: &str,
    config: &pb::ModelConfig,
    version: ModelVersion,
) -> Result<ModelKind, RepositoryError> {
    reject_unsupported_common(model, config)?;
    let platform = config.platform.as_str();
    let backend = config.backend.as_str();
    match (platform, backend) {
        (PLATFORM_LIBTORCH, "" | "pytorch") | ("", "pytorch") => {
            classifier(dir, model, config, version).map(ModelKind::Classifier)
        }
        (PLATFORM_ENSEMBLE, "") => {
            refuse_response_cache(model, config)?;
            if !config.model_warmup.is_empty() {
                // Triton's rule: an ensemble's steps warm up, not the ensemble.
                return Err(invalid(
                    model,
                    "model_warmup",
                    "cannot be specified for an ensemble; put it in the classifier's config",
                ));
            }
            ensemble(model, config).map(ModelKind::Ensemble)
        }
        ("", BACKEND_IMAGE) => {
            refuse_response_cache(model, config)?;
            if !config.model_warmup.is_empty() {
                return Err(unsupported(
                    model,
                    "model_warmup",
                    "remove it: the built-in preprocessor has nothing to warm up (the \
                     classifier's model_warmup runs before it serves)",
                ));
            }
            preprocessor(model, config).map(ModelKind::Preprocessor)
        }
        ("", "python") => Err(unsupported(
            model,
            "backend",
            "the Python backend does not run in visiongate; for image preprocessing use \
             backend \"visiongate_image\" with width/height/mean/std parameters",
        )),
        _ => Err(unsupported(
            model,
            if platform.is_empty() {
                "backend"
            } else {
                "platform"
            },
            format!(
                "'{}' cannot be served; export the model to TorchScript and use platform \
                 \"pytorch_libtorch\", or backend \"visiongate_image\" / platform \"ensemble\"",
                if platform.is_empty() {
                    backend
                } else {
                    platform
                }
            ),
        )),
    }
}

/// The cache keys on the preprocessed rows a classifier runs, so only classifiers have one.
fn refuse_response_cache(model: &str, c: &pb::ModelConfig) -> Result<(), RepositoryError> {
    if c.response_cache.as_ref().is_some_and(|r| r.enable) {
        return Err(unsupported(
            model,
            "response_cache",
            "enable it on the classifier step instead: it caches per preprocessed image, so \
             an ensemble's repeated photos hit it there",
        ));
    }
    Ok(())
}

/// Fields of `ModelConfig` that no model kind here honours: refuse rather than ignore.
fn reject_unsupported_common(model: &str, c: &pb::ModelConfig) -> Result<(), RepositoryError> {
    let remove = "remove it from config.pbtxt; visiongate does not implement it";
    if matches!(
        c.scheduling_choice,
        Some(SchedulingChoice::SequenceBatching(_))
    ) {
        return Err(unsupported(model, "sequence_batching", remove));
    }
    if !c.batch_input.is_empty() {
        return Err(unsupported(model, "batch_input", remove));
    }
    if !c.batch_output.is_empty() {
        return Err(unsupported(model, "batch_output", remove));
    }
    if c.model_transaction_policy
        .as_ref()
        .is_some_and(|p| p.decoupled)
    {
        return Err(unsupported(
            model,
            "model_transaction_policy.decoupled",
            remove,
        ));
    }
    if c.model_repository_agents
        .as_ref()
        .is_some_and(|a| !a.agents.is_empty())
    {
        return Err(unsupported(model, "model_repository_agents", remove));
    }
    if c.optimization.is_some() {
        return Err(unsupported(model, "optimization", remove));
    }
    for (i, input) in c.input.iter().enumerate() {
        if input.reshape.is_some() {
            return Err(unsupported(model, &format!("input[{i}].reshape"), remove));
        }
        if input.is_shape_tensor || input.allow_ragged_batch || input.optional {
            return Err(unsupported(
                model,
                &format!("input[{i}] (shape tensor / ragged / optional)"),
                remove,
            ));
        }
    }
    for (i, output) in c.output.iter().enumerate() {
        if output.reshape.is_some() {
            return Err(unsupported(model, &format!("output[{i}].reshape"), remove));
        }
    }
    Ok(())
}

fn classifier(
    dir: &Path,
    model: &str,
    c: &pb::ModelConfig,
    version: ModelVersion,
) -> Result<ClassifierSpec, RepositoryError> {
    if c.max_batch_size < 1 {
        return Err(invalid(
            model,
            "max_batch_size",
            "must be at least 1 (dims then leave out the batch dimension)",
        ));
    }
    let [input] = c.input.as_slice() else {
        return Err(invalid(
            model,
            "input",
            "a classifier has exactly one input",
        ));
    };
    let [output] = c.output.as_slice() else {
        return Err(invalid(
            model,
            "output",
            "a classifier has exactly one output",
        ));
    };
    if input.data_type() != pb::DataType::TypeFp32 || input.dims.len() != 3 || input.dims[0] != 3 {
        return Err(invalid(
            model,
            "input",
            format!(
                "'{}' must be TYPE_FP32 with dims [3, height, width], got {:?} {:?}",
                input.name,
                input.data_type(),
                input.dims
            ),
        ));
    }
    if input.format() == pb::model_input::Format::Nhwc {
        return Err(unsupported(
            model,
            "input.format",
            "use FORMAT_NCHW or leave it out",
        ));
    }
    let (height, width) = (input.dims[1], input.dims[2]);
    if height < 1 || width < 1 {
        return Err(invalid(
            model,
            "input.dims",
            "height and width must be fixed sizes",
        ));
    }
    if output.data_type() != pb::DataType::TypeFp32 || output.dims.len() != 1 || output.dims[0] < 1
    {
        return Err(invalid(
            model,
            "output",
            format!(
                "'{}' must be TYPE_FP32 with dims [classes], got {:?} {:?}",
                output.name,
                output.data_type(),
                output.dims
            ),
        ));
    }
    let num_classes = output.dims[0] as usize;
    let labels = if output.label_filename.is_empty() {
        None
    } else {
        Some(Arc::new(read_labels(
            dir,
            model,
            &output.label_filename,
            num_classes,
        )?))
    };

    let file_name = if c.default_model_filename.is_empty() {
        "model.pt"
    } else {
        c.default_model_filename.as_str()
    };
    let version_dir = version.to_string();
    let model_file = file_in(
        &dir.join(&version_dir),
        model,
        "default_model_filename",
        file_name,
    )?;
    if !model_file.is_file() {
        return Err(invalid(
            model,
            "default_model_filename",
            format!(
                "{} is missing; run `make setup` (it exports the bundled model) or put a \
                 TorchScript file there",
                Path::new(model).join(version_dir).join(file_name).display()
            ),
        ));
    }

    Ok(ClassifierSpec {
        model_file,
        max_batch_size: c.max_batch_size as usize,
        input_name: input.name.clone(),
        height: height as usize,
        width: width as usize,
        output_name: output.name.clone(),
        num_classes,
        labels,
        instance_groups: instance_groups(model, c)?,
        batching: batching(model, c)?,
        response_cache: c.response_cache.as_ref().is_some_and(|r| r.enable),
        warmup: warmup(dir, model, c, input)?,
        precision: precision(model, c)?,
    })
}

/// A classifier's `precision` parameter (FP32 when it has none).
fn precision(model: &str, c: &pb::ModelConfig) -> Result<Precision, RepositoryError> {
    let Some(p) = c.parameters.get("precision") else {
        return Ok(Precision::Fp32);
    };
    Precision::parse(&p.string_value).ok_or_else(|| {
        invalid(
            model,
            "parameters[precision]",
            format!(
                "'{}' is not a precision: fp32, bf16 (CPUs with AVX-512 BF16 or AMX, GPUs) or \
                 fp16 (GPUs)",
                p.string_value
            ),
        )
    })
}

/// The `model_warmup` samples of a classifier whose one input is `input`: each names that
/// input with the model's data type and dims and one of `zero_data`, `random_data` or
/// `input_data_file` (a file in the model's `warmup/` directory, raw little-endian FP32,
/// at least one row; only that row is read).
fn warmup(
    dir: &Path,
    model: &str,
    c: &pb::ModelConfig,
    input: &pb::ModelInput,
) -> Result<Vec<WarmupSample>, RepositoryError> {
    use pb::model_warmup::input::InputDataType;
    let row: usize = input.dims.iter().product::<i64>() as usize;
    let mut samples = Vec::new();
    for (i, w) in c.model_warmup.iter().enumerate() {
        let field = format!("model_warmup[{i}] '{}'", w.name);
        let bad = |message: String| invalid(model, &field, message);
        if w.batch_size as i64 > c.max_batch_size as i64 {
            return Err(bad(format!(
                "batch_size {} is over max_batch_size {}",
                w.batch_size, c.max_batch_size
            )));
        }
        if let Some(other) = w.inputs.keys().find(|k| **k != input.name) {
            return Err(bad(format!(
                "'{other}' is not an input of the model (its input is '{}')",
                input.name
            )));
        }
        let Some(spec) = w.inputs.get(&input.name) else {
            return Err(bad(format!("needs the model's input '{}'", input.name)));
        };
        if spec.data_type() != pb::DataType::TypeFp32 || spec.dims != input.dims {
            return Err(bad(format!(
                "input '{}' must be TYPE_FP32 with dims {:?} (the model's input, without the \
                 batch dimension), got {:?} {:?}",
                input.name,
                input.dims,
                spec.data_type(),
                spec.dims
            )));
        }
        let data = match &spec.input_data_type {
            None => {
                return Err(bad(format!(
                    "input '{}' needs zero_data, random_data or input_data_file",
                    input.name
                )))
            }
            Some(InputDataType::ZeroData(_)) => WarmupData::Zero,
            Some(InputDataType::RandomData(_)) => WarmupData::Random,
            Some(InputDataType::InputDataFile(file)) => {
                let field = format!("{field}.input_data_file");
                let path = file_in(&dir.join("warmup"), model, &field, file)?;
                let shown = Path::new(model).join("warmup").join(file);
                let io = |source| RepositoryError::Io {
                    path: shown.clone(),
                    source,
                };
                let mut bytes = Vec::with_capacity(row * 4);
                std::io::Read::read_to_end(
                    &mut std::io::Read::take(
                        std::fs::File::open(&path).map_err(io)?,
                        (row * 4) as u64,
                    ),
                    &mut bytes,
                )
                .map_err(io)?;
                if bytes.len() < row * 4 {
                    return Err(bad(format!(
                        "{} has {} bytes; one row of FP32 {:?} needs {}",
                        shown.display(),
                        bytes.len(),
                        input.dims,
                        row * 4
                    )));
                }
                let values = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                WarmupData::Row(Arc::new(values))
            }
        };
        if w.batch_size > 0 {
            samples.push(WarmupSample {
                name: w.name.clone(),
                batch_size: w.batch_size as usize,
                // Triton runs a sample with count 0 once.
                count: w.count.max(1) as usize,
                data,
            });
        }
    }
    Ok(samples)
}

fn read_labels(
    dir: &Path,
    model: &str,
    file: &str,
    num_classes: usize,
) -> Result<Vec<String>, RepositoryError> {
    let field = "output.label_filename";
    let shown = Path::new(model).join(file);
    let text = std::fs::read_to_string(file_in(dir, model, field, file)?).map_err(|source| {
        RepositoryError::Io {
            path: shown.clone(),
            source,
        }
    })?;
    let labels: Vec<String> = text.lines().map(|l| l.trim_end().to_string()).collect();
    if labels.len() != num_classes {
        return Err(invalid(
            model,
            field,
            format!(
                "{} has {} lines but the output has {num_classes} classes",
                shown.display(),
                labels.len()
            ),
        ));
    }
    Ok(labels)
}

/// The file `name` that a config's `field` names, inside `dir` (the model's directory or
/// a version's), or why it is refused: only a relative path that stays inside is taken.
fn file_in(dir: &Path, model: &str, field: &str, name: &str) -> Result<PathBuf, RepositoryError> {
    let path = Path::new(name);
    let inside = !name.is_empty()
        && path
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !inside {
        return Err(invalid(
            model,
            field,
            format!(
                "'{name}' is not a file inside the model's directory: give a relative path \
                 without '..'"
            ),
        ));
    }
    Ok(dir.join(path))
}

fn instance_groups(
    model: &str,
    c: &pb::ModelConfig,
) -> Result<Vec<InstanceGroupSpec>, RepositoryError> {
    use pb::model_instance_group::Kind;
    if c.instance_group.is_empty() {
        // Triton's default: one instance on each available GPU, else one on the CPU.
        return Ok(vec![InstanceGroupSpec {
            kind: GroupKind::Auto,
            count: 1,
            gpus: vec![],
        }]);
    }
    c.instance_group
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let field = |f: &str| format!("instance_group[{i}].{f}");
            let kind = match g.kind() {
                Kind::Auto => GroupKind::Auto,
                Kind::Gpu => GroupKind::Gpu,
                Kind::Cpu => GroupKind::Cpu,
                Kind::Model => {
                    return Err(unsupported(
                        model,
                        &field("kind"),
                        "use KIND_GPU or KIND_CPU",
                    ))
                }
            };
            if g.rate_limiter.is_some() || !g.secondary_devices.is_empty() || g.passive {
                return Err(unsupported(
                    model,
                    &field("rate_limiter/secondary_devices/passive"),
                    "remove it from config.pbtxt",
                ));
            }
            if !g.profile.is_empty() {
                return Err(unsupported(
                    model,
                    &field("profile"),
                    "TensorRT only; remove it",
                ));
            }
            if kind == GroupKind::Cpu && !g.gpus.is_empty() {
                return Err(invalid(model, &field("gpus"), "KIND_CPU cannot list gpus"));
            }
            if g.count < 0 {
                return Err(invalid(model, &field("count"), "must not be negative"));
            }
            let gpus = g
                .gpus
                .iter()
                .map(|&x| {
                    u32::try_from(x).map_err(|_| invalid(model, &field("gpus"), "negative GPU id"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(InstanceGroupSpec {
                kind,
                // Triton: an unset count means 1.
                count: g.count.max(1) as u32,
                gpus,
            })
        })
        .collect()
}

fn batching(model: &str, c: &pb::ModelConfig) -> Result<Option<BatchingSpec>, RepositoryError> {
    let Some(SchedulingChoice::DynamicBatching(d)) = &c.scheduling_choice else {
        return Ok(None);
    };
    let max = c.max_batch_size as i64;
    let mut preferred = Vec::new();
    for &p in &d.preferred_batch_size {
        if p < 1 || p as i64 > max {
            return Err(invalid(
                model,
                "dynamic_batching.preferred_batch_size",
                format!("{p} is outside 1..=max_batch_size ({max})"),
            ));
        }
        preferred.push(p as usize);
    }
    preferred.sort_unstable();
    preferred.dedup();
    let levels = d.priority_levels as usize;
    let default_policy = queue_policy(
        model,
        "dynamic_batching.default_queue_policy",
        d.default_queue_policy.as_ref(),
    )?;
    let mut queues = vec![default_policy; levels.max(1)];
    for (&level, policy) in &d.priority_queue_policy {
        let field = format!("dynamic_batching.priority_queue_policy[{level}]");
        if level < 1 || level as usize > levels {
            return Err(invalid(
                model,
                &field,
                format!("priority level {level} is outside 1..=priority_levels ({levels})"),
            ));
        }
        queues[level as usize - 1] = queue_policy(model, &field, Some(policy))?;
    }
    let default_level = if levels == 0 {
        if d.default_priority_level != 0 {
            return Err(invalid(
                model,
                "dynamic_batching.default_priority_level",
                "set priority_levels too, or remove it",
            ));
        }
        0
    } else {
        let level = d.default_priority_level as usize;
        if level < 1 || level > levels {
            return Err(invalid(
                model,
                "dynamic_batching.default_priority_level",
                format!("must be within 1..=priority_levels ({levels}), got {level}"),
            ));
        }
        level - 1
    };
    Ok(Some(BatchingSpec {
        preferred_batch_sizes: preferred,
        max_queue_delay: Duration::from_micros(d.max_queue_delay_microseconds),
        queues,
        default_level,
    }))
}

fn queue_policy(
    model: &str,
    field: &str,
    q: Option<&pb::ModelQueuePolicy>,
) -> Result<QueuePolicySpec, RepositoryError> {
    let Some(q) = q else {
        return Ok(QueuePolicySpec {
            timeout_action: TimeoutAction::Reject,
            default_timeout: None,
            allow_timeout_override: false,
            max_queue_size: None,
        });
    };
    let timeout_action = match pb::model_queue_policy::TimeoutAction::try_from(q.timeout_action) {
        Ok(pb::model_queue_policy::TimeoutAction::Reject) => TimeoutAction::Reject,
        Ok(pb::model_queue_policy::TimeoutAction::Delay) => TimeoutAction::Delay,
        Err(_) => {
            return Err(invalid(
                model,
                &format!("{field}.timeout_action"),
                "must be REJECT or DELAY",
            ))
        }
    };
    Ok(QueuePolicySpec {
        timeout_action,
        default_timeout: (q.default_timeout_microseconds > 0)
            .then(|| Duration::from_micros(q.default_timeout_microseconds)),
        allow_timeout_override: q.allow_timeout_override,
        max_queue_size: (q.max_queue_size > 0).then_some(q.max_queue_size as usize),
    })
}

fn preprocessor(model: &str, c: &pb::ModelConfig) -> Result<PreprocessorSpec, RepositoryError> {
    let [input] = c.input.as_slice() else {
        return Err(invalid(
            model,
            "input",
            "the image preprocessor has exactly one input",
        ));
    };
    let [output] = c.output.as_slice() else {
        return Err(invalid(
            model,
            "output",
            "the image preprocessor has exactly one output",
        ));
    };
    if input.data_type() != pb::DataType::TypeUint8 || input.dims != [-1] {
        return Err(invalid(
            model,
            "input",
            "must be TYPE_UINT8 with dims [-1] (encoded bytes)",
        ));
    }
    let param = |key: &str| c.parameters.get(key).map(|p| p.string_value.trim());
    let number = |key: &str, default: u32| -> Result<u32, RepositoryError> {
        match param(key) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| {
                invalid(
                    model,
                    &format!("parameters[{key}]"),
                    format!("'{v}' is not a whole number"),
                )
            }),
        }
    };
    let triple = |key: &str, default: f32| -> Result<[f32; 3], RepositoryError> {
        let Some(v) = param(key) else {
            return Ok([default; 3]);
        };
        let parts: Vec<f32> = v
            .split(',')
            .map(|s| s.trim().parse::<f32>())
            .collect::<Result<_, _>>()
            .map_err(|_| {
                invalid(
                    model,
                    &format!("parameters[{key}]"),
                    format!("'{v}' is not 3 numbers"),
                )
            })?;
        <[f32; 3]>::try_from(parts).map_err(|_| {
            invalid(
                model,
                &format!("parameters[{key}]"),
                "needs exactly 3 comma-separated numbers (R,G,B)",
            )
        })
    };
    let width = number("width", 224)?;
    let height = number("height", 224)?;
    if width == 0 || height == 0 {
        return Err(invalid(
            model,
            "parameters[width/height]",
            "must be positive",
        ));
    }
    let resize = match param("resize_mode").unwrap_or("stretch") {
        "stretch" => ResizeMode::Stretch,
        other => {
            return Err(unsupported(
                model,
                "parameters[resize_mode]",
                format!("'{other}' is not implemented; use \"stretch\""),
            ))
        }
    };
    let filter = match param("resize_filter").unwrap_or("bilinear") {
        "bilinear" => ResizeFilter::Bilinear,
        "area" => ResizeFilter::Area,
        "linear" => ResizeFilter::Linear,
        other => {
            return Err(invalid(
                model,
                "parameters[resize_filter]",
                format!(
                    "'{other}' is not a filter: bilinear (antialiased, as Pillow and \
                     torchvision), area (OpenCV's INTER_AREA) or linear (OpenCV's INTER_LINEAR)"
                ),
            ))
        }
    };
    let normalize = Normalize {
        mean: triple("mean", 0.0)?,
        std: triple("std", 1.0)?,
    };
    if normalize.std.iter().any(|&s| s <= 0.0) {
        return Err(invalid(model, "parameters[std]", "must be positive"));
    }
    let dct = number("dct_scaling_min_side", width.max(height))?;
    if dct != 0 && dct < width.max(height) {
        return Err(invalid(
            model,
            "parameters[dct_scaling_min_side]",
            format!(
                "must be 0 (off) or at least the output size {}",
                width.max(height)
            ),
        ));
    }
    let expected = [3, height as i64, width as i64];
    if output.data_type() != pb::DataType::TypeFp32 || output.dims != expected {
        return Err(invalid(
            model,
            "output",
            format!("must be TYPE_FP32 with dims {expected:?} (from the width/height parameters)"),
        ));
    }
    Ok(PreprocessorSpec {
        input_name: input.name.clone(),
        output_name: output.name.clone(),
        width,
        height,
        resize,
        filter,
        normalize,
        dct_scaling_min_side: dct,
    })
}

fn ensemble(model: &str, c: &pb::ModelConfig) -> Result<EnsembleSpec, RepositoryError> {
    let Some(SchedulingChoice::EnsembleScheduling(e)) = &c.scheduling_choice else {
        return Err(invalid(
            model,
            "ensemble_scheduling",
            "platform \"ensemble\" needs it",
        ));
    };
    let [input] = c.input.as_slice() else {
        return Err(invalid(
            model,
            "input",
            "an image ensemble has exactly one input",
        ));
    };
    let [output] = c.output.as_slice() else {
        return Err(invalid(
            model,
            "output",
            "an image ensemble has exactly one output",
        ));
    };
    let shape_msg = "visiongate runs ensembles of two steps: the image preprocessor \
                     (backend \"visiongate_image\") feeding a pytorch_libtorch classifier";
    let [pre, cls] = e.step.as_slice() else {
        return Err(unsupported(model, "ensemble_scheduling.step", shape_msg));
    };
    for (i, step) in e.step.iter().enumerate() {
        if step.model_version != -1 {
            return Err(unsupported(
                model,
                &format!("ensemble_scheduling.step[{i}].model_version"),
                "only -1 (the served version) is supported",
            ));
        }
        if step.input_map.len() != 1 || step.output_map.len() != 1 {
            return Err(unsupported(
                model,
                &format!("ensemble_scheduling.step[{i}]"),
                shape_msg,
            ));
        }
    }
    let one = |m: &std::collections::HashMap<String, String>| {
        m.iter()
            .next()
            .map(|(k, v)| (k.clone(), v.clone()))
            .unwrap_or_default()
    };
    let (_, pre_in) = one(&pre.input_map);
    let (_, pre_out) = one(&pre.output_map);
    let (_, cls_in) = one(&cls.input_map);
    let (_, cls_out) = one(&cls.output_map);
    if pre_in != input.name || cls_in != pre_out || cls_out != output.name {
        return Err(unsupported(
            model,
            "ensemble_scheduling.step (input_map/output_map)",
            format!(
                "{shape_msg}: the ensemble input must feed step 0, step 0's output step 1, \
                 and step 1's output the ensemble output"
            ),
        ));
    }
    Ok(EnsembleSpec {
        input_name: input.name.clone(),
        output_name: output.name.clone(),
        preprocessor: ModelName::new(pre.model_name.clone()),
        classifier: ModelName::new(cls.model_name.clone()),
    })
}

/// Ensembles are checked after every model is read: their steps must name loaded models
/// of the right kinds with matching tensor names and sizes.
pub(super) fn check_ensembles(result: &mut ScanResult) {
    let mut failed = Vec::new();
    for (idx, m) in result.models.iter().enumerate() {
        let ModelKind::Ensemble(e) = &m.kind else {
            continue;
        };
        if let Err(error) = check_ensemble(m.name.as_str(), e, result) {
            failed.push((idx, error));
        }
    }
    for (idx, error) in failed.into_iter().rev() {
        let m = result.models.remove(idx);
        result.failures.push(LoadFailure {
            model: m.name.to_string(),
            error,
        });
    }
}

fn check_ensemble(
    model: &str,
    e: &EnsembleSpec,
    result: &ScanResult,
) -> Result<(), RepositoryError> {
    let find = |name: &ModelName| result.models.iter().find(|m| &m.name == name);
    let step_missing = |i: usize, name: &ModelName| {
        let why = match result.failures.iter().find(|f| f.model == name.as_str()) {
            Some(f) => format!("model '{name}' failed to load: {}", f.error),
            None => format!("no model '{name}' in the repository"),
        };
        invalid(
            model,
            &format!("ensemble_scheduling.step[{i}].model_name"),
            why,
        )
    };
    let pre = find(&e.preprocessor).ok_or_else(|| step_missing(0, &e.preprocessor))?;
    let cls = find(&e.classifier).ok_or_else(|| step_missing(1, &e.classifier))?;
    let ModelKind::Preprocessor(p) = &pre.kind else {
        return Err(unsupported(
            model,
            "ensemble_scheduling.step[0]",
            format!(
                "'{}' must be a visiongate_image preprocessor",
                e.preprocessor
            ),
        ));
    };
    let ModelKind::Classifier(c) = &cls.kind else {
        return Err(unsupported(
            model,
            "ensemble_scheduling.step[1]",
            format!("'{}' must be a pytorch_libtorch classifier", e.classifier),
        ));
    };
    if (p.width as usize, p.height as usize) != (c.width, c.height) {
        return Err(invalid(
            model,
            "ensemble_scheduling",
            format!(
                "preprocessor output {}x{} does not match classifier input {}x{}",
                p.width, p.height, c.width, c.height
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::scan;
    use super::*;

    fn write(dir: &Path, rel: &str, text: &str) {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn temp_repo(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vg-repo-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    const CLASSIFIER: &str = r#"
        platform: "pytorch_libtorch"
        max_batch_size: 4
        input [ { name: "input__0" data_type: TYPE_FP32 dims: [ 3, 8, 8 ] } ]
        output [ { name: "output__0" data_type: TYPE_FP32 dims: [ 2 ] label_filename: "labels.txt" } ]
        instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] } ]
        dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 500 }
    "#;

    #[test]
    fn the_bundled_repository_loads_all_three_models() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
        let r = scan(std::slice::from_ref(&root)).unwrap();
        let names: Vec<_> = r.models.iter().map(|m| m.name.to_string()).collect();
        let failures: Vec<_> = r.failures.iter().map(|f| f.error.to_string()).collect();
        assert_eq!(
            names,
            ["classifier", "ensemble_model", "preprocessor"],
            "{failures:?}"
        );
        let cls = r
            .models
            .iter()
            .find(|m| m.name.as_str() == "classifier")
            .unwrap();
        let ModelKind::Classifier(c) = &cls.kind else {
            panic!("classifier kind")
        };
        assert_eq!((c.height, c.width, c.num_classes), (224, 224, 1000));
        assert_eq!(c.labels.as_ref().unwrap()[281], "tabby, tabby cat");
        assert_eq!(
            c.instance_groups,
            vec![InstanceGroupSpec {
                kind: GroupKind::Gpu,
                count: 2,
                gpus: vec![0, 1]
            }]
        );
        let pre = r
            .models
            .iter()
            .find(|m| m.name.as_str() == "preprocessor")
            .unwrap();
        let ModelKind::Preprocessor(p) = &pre.kind else {
            panic!("preprocessor kind")
        };
        assert_eq!(p.normalize.mean, [0.498; 3]);
        assert_eq!(p.normalize.std, [0.502; 3]);
    }

    #[test]
    fn python_backend_fails_with_field_and_remedy_and_others_still_load() {
        let root = temp_repo("python");
        write(
            &root,
            "pymodel/config.pbtxt",
            "backend: \"python\"\nmax_batch_size: 1\n",
        );
        write(&root, "pymodel/1/model.py", "");
        write(&root, "cls/config.pbtxt", CLASSIFIER);
        write(&root, "cls/labels.txt", "a\nb\n");
        write(
            &root,
            "cls/1/model.pt",
            "not really torchscript; loading is the engine's job",
        );
        let r = scan(std::slice::from_ref(&root)).unwrap();
        assert_eq!(r.models.len(), 1, "{:?}", r.failures);
        assert_eq!(r.models[0].name.as_str(), "cls");
        let msg = r.failures[0].error.to_string();
        assert!(
            msg.contains("model 'pymodel'") && msg.contains("'backend'"),
            "{msg}"
        );
        assert!(msg.contains("visiongate_image"), "remedy missing: {msg}");
    }

    #[test]
    fn unsupported_fields_and_bad_labels_fail_that_model_only() {
        let root = temp_repo("fields");
        let seq = CLASSIFIER.replace("dynamic_batching", "sequence_batching { }\n#");
        write(&root, "seq/config.pbtxt", &seq);
        write(&root, "seq/labels.txt", "a\nb\n");
        write(&root, "seq/1/model.pt", "x");
        write(&root, "labels/config.pbtxt", CLASSIFIER);
        write(&root, "labels/labels.txt", "only one\n");
        write(&root, "labels/1/model.pt", "x");
        write(&root, "nofile/config.pbtxt", CLASSIFIER);
        write(&root, "nofile/labels.txt", "a\nb\n");
        std::fs::create_dir_all(root.join("nofile/1")).unwrap();
        let r = scan(std::slice::from_ref(&root)).unwrap();
        assert!(r.models.is_empty());
        let msg = |m: &str| {
            r.failures
                .iter()
                .find(|f| f.model == m)
                .unwrap()
                .error
                .to_string()
        };
        assert!(msg("seq").contains("sequence_batching"), "{}", msg("seq"));
        assert!(
            msg("labels").contains("1 lines but the output has 2 classes"),
            "{}",
            msg("labels")
        );
        assert!(
            msg("nofile").contains("model.pt is missing"),
            "{}",
            msg("nofile")
        );
    }

    fn classifier_with(tag: &str, batching: &str) -> Result<ClassifierSpec, String> {
        let root = temp_repo(tag);
        let text = CLASSIFIER.replace(
            "dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 500 }",
            batching,
        );
        write(
            &root,
            "m/config.pbtxt",
            &format!("{text}\nresponse_cache {{ enable: true }}"),
        );
        write(&root, "m/labels.txt", "a\nb\n");
        write(&root, "m/1/model.pt", "x");
        let mut r = scan(std::slice::from_ref(&root)).unwrap();
        match r.failures.pop() {
            Some(f) => Err(f.error.to_string()),
            None => match r.models.pop().unwrap().kind {
                ModelKind::Classifier(c) => Ok(c),
                other => panic!("not a classifier: {other:?}"),
            },
        }
    }

    #[test]
    fn precision_is_a_parameter_fp32_by_default() {
        let with = |tag, value: &str| {
            let line = format!(
                "parameters {{ key: \"precision\" value: {{ string_value: \"{value}\" }} }}"
            );
            classifier_with(tag, &line)
        };
        assert_eq!(
            classifier_with("p0", "").unwrap().precision,
            Precision::Fp32
        );
        assert_eq!(with("p1", "bf16").unwrap().precision, Precision::Bf16);
        assert_eq!(with("p2", " FP16 ").unwrap().precision, Precision::Fp16);
        let e = with("p3", "int8").unwrap_err();
        assert!(
            e.contains("parameters[precision]") && e.contains("'int8'"),
            "{e}"
        );
    }

    #[test]
    fn queue_policies_priorities_and_the_response_cache_are_read() {
        let c = classifier_with(
            "queues",
            r#"dynamic_batching {
                priority_levels: 2
                default_priority_level: 2
                default_queue_policy {
                    timeout_action: DELAY
                    default_timeout_microseconds: 5000
                    allow_timeout_override: true
                    max_queue_size: 4
                }
                priority_queue_policy { key: 1 value: { max_queue_size: 8 } }
            }"#,
        )
        .unwrap();
        assert!(c.response_cache);
        let b = c.batching.unwrap();
        assert_eq!(b.default_level, 1);
        assert_eq!(
            b.queues,
            vec![
                QueuePolicySpec {
                    timeout_action: TimeoutAction::Reject,
                    default_timeout: None,
                    allow_timeout_override: false,
                    max_queue_size: Some(8),
                },
                QueuePolicySpec {
                    timeout_action: TimeoutAction::Delay,
                    default_timeout: Some(Duration::from_micros(5000)),
                    allow_timeout_override: true,
                    max_queue_size: Some(4),
                },
            ]
        );
    }

    #[test]
    fn priority_settings_outside_the_levels_fail_with_the_field() {
        let e = classifier_with(
            "prio-key",
            "dynamic_batching { priority_levels: 2 default_priority_level: 1 \
             priority_queue_policy { key: 3 value: { max_queue_size: 8 } } }",
        )
        .unwrap_err();
        assert!(e.contains("priority_queue_policy[3]"), "{e}");
        let e =
            classifier_with("prio-default", "dynamic_batching { priority_levels: 2 }").unwrap_err();
        assert!(e.contains("default_priority_level"), "{e}");
        let e = classifier_with(
            "prio-none",
            "dynamic_batching { default_priority_level: 1 }",
        )
        .unwrap_err();
        assert!(e.contains("set priority_levels too"), "{e}");
    }

    #[test]
    fn version_policy_picks_the_served_version() {
        let root = temp_repo("versions");
        let specific =
            format!("{CLASSIFIER}\nversion_policy: {{ specific {{ versions: [ 2 ] }} }}");
        write(&root, "cls/config.pbtxt", &specific);
        write(&root, "cls/labels.txt", "a\nb\n");
        for v in ["1", "2", "3"] {
            write(&root, &format!("cls/{v}/model.pt"), "x");
        }
        write(&root, "latest/config.pbtxt", CLASSIFIER);
        write(&root, "latest/labels.txt", "a\nb\n");
        write(
            &root,
            "two/config.pbtxt",
            &format!("{CLASSIFIER}\nversion_policy: {{ latest {{ num_versions: 2 }} }}"),
        );
        write(&root, "two/labels.txt", "a\nb\n");
        write(
            &root,
            "all/config.pbtxt",
            &format!("{CLASSIFIER}\nversion_policy: {{ all {{ }} }}"),
        );
        write(&root, "all/labels.txt", "a\nb\n");
        for v in ["1", "7", "10"] {
            write(&root, &format!("latest/{v}/model.pt"), "x");
            write(&root, &format!("two/{v}/model.pt"), "x");
            write(&root, &format!("all/{v}/model.pt"), "x");
        }
        let r = scan(std::slice::from_ref(&root)).unwrap();
        assert!(r.failures.is_empty(), "{:?}", r.failures);
        let versions = |m: &str| -> Vec<u64> {
            r.models
                .iter()
                .filter(|x| x.name.as_str() == m)
                .map(|x| x.version.0)
                .collect()
        };
        assert_eq!(versions("cls"), vec![2]);
        assert_eq!(versions("latest"), vec![10]);
        assert_eq!(versions("two"), vec![7, 10]);
        assert_eq!(versions("all"), vec![1, 7, 10]);
    }

    #[test]
    fn ensemble_of_a_missing_step_fails_with_the_reason() {
        let root = temp_repo("ensemble");
        let ens = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/ensemble_model/config.pbtxt"),
        )
        .unwrap();
        write(&root, "ensemble_model/config.pbtxt", &ens);
        std::fs::create_dir_all(root.join("ensemble_model/1")).unwrap();
        let r = scan(std::slice::from_ref(&root)).unwrap();
        let msg = r.failures[0].error.to_string();
        assert!(msg.contains("no model 'preprocessor'"), "{msg}");
    }

    #[test]
    fn preprocessor_parameters_are_checked() {
        let root = temp_repo("pre");
        let pre = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/preprocessor/config.pbtxt"),
        )
        .unwrap();
        write(
            &root,
            "p1/config.pbtxt",
            &pre.replace("0.502,0.502,0.502", "0.5,0.5")
                .replace("name: \"preprocessor\"", ""),
        );
        write(
            &root,
            "p2/config.pbtxt",
            &pre.replace("\"stretch\"", "\"letterbox\"")
                .replace("name: \"preprocessor\"", ""),
        );
        let filter = |f: &str| {
            let line = format!(
                "parameters {{ key: \"resize_filter\" value: {{ string_value: \"{f}\" }} }}"
            );
            format!("{}\n{line}\n", pre.replace("name: \"preprocessor\"", ""))
        };
        write(&root, "p3/config.pbtxt", &filter("lanczos"));
        write(&root, "p4/config.pbtxt", &filter("area"));
        for m in ["p1", "p2", "p3", "p4"] {
            std::fs::create_dir_all(root.join(m).join("1")).unwrap();
        }
        let r = scan(std::slice::from_ref(&root)).unwrap();
        let msg = |m: &str| {
            r.failures
                .iter()
                .find(|f| f.model == m)
                .unwrap()
                .error
                .to_string()
        };
        assert!(msg("p1").contains("parameters[std]"), "{}", msg("p1"));
        assert!(msg("p2").contains("letterbox"), "{}", msg("p2"));
        assert!(
            msg("p3").contains("parameters[resize_filter]"),
            "{}",
            msg("p3")
        );
        let area = r.models.iter().find(|m| m.name.as_str() == "p4").unwrap();
        let ModelKind::Preprocessor(p) = &area.kind else {
            panic!("p4 is a preprocessor")
        };
        assert_eq!(p.filter, ResizeFilter::Area);
    }
}
