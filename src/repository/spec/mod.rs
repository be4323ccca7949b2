//! Validation of a parsed `ModelConfig` into what visiongate runs. Anything a config asks
//! for that visiongate does not do fails that model's load with the field and a remedy.
//!
//! Here: the spec types, the dispatch on platform and backend, and the checks and helpers
//! every model kind shares. Each kind's own validation is in its file (`classifier`, with
//! its instance groups, dynamic batching and queue policies in `scheduling`;
//! `preprocessor`; `ensemble`), and the choice of versions to serve in `versions`.

mod classifier;
mod ensemble;
mod preprocessor;
mod scheduling;
#[cfg(test)]
mod test_support;
mod versions;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::pb::{self, model_config::SchedulingChoice};
use super::{Limits, RepositoryError};
use crate::domain::{
    ModelName, ModelVersion, Normalize, Precision, ResizeFilter, Runtime, TimeoutAction,
    WarmupSample,
};

use classifier::{classifier, onnx_options, openvino_options};
use ensemble::ensemble;
use preprocessor::preprocessor;

pub(super) use ensemble::check_ensembles;
pub(super) use versions::{available_versions, select_versions};

/// Platform of TorchScript models, as Triton names it.
pub const PLATFORM_LIBTORCH: &str = "pytorch_libtorch";
/// Platform of ONNX models, as Triton names it.
pub const PLATFORM_ONNX: &str = "onnxruntime_onnx";
/// A torch.export package compiled by AOTInductor (`model.pt2`), Triton's PyTorch backend.
pub const PLATFORM_AOTI: &str = "torch_aoti";
pub const PLATFORM_ENSEMBLE: &str = "ensemble";
/// The built-in image preprocessor's backend name.
pub const BACKEND_IMAGE: &str = "visiongate_image";
/// Triton's OpenVINO backend (it has no platform name).
pub const BACKEND_OPENVINO: &str = "openvino";

#[derive(Debug, Clone)]
pub enum ModelKind {
    Classifier(ClassifierSpec),
    Preprocessor(PreprocessorSpec),
    Ensemble(EnsembleSpec),
}

/// An image classifier: FP32 `[N, 3, H, W]` in, FP32 `[N, classes]` logits out.
#[derive(Debug, Clone)]
pub struct ClassifierSpec {
    pub model_file: PathBuf,
    /// What runs the model file (its platform), with that runtime's options.
    pub runtime: Runtime,
    /// The config's: the most rows the model takes in one request.
    pub max_batch_size: usize,
    /// The most rows of one batch the server forms (dynamic batching, warm-up, batch-size
    /// timing, padding): `max_batch_size`, or fewer where `--max-batch-bytes` holds fewer.
    pub batch_rows: usize,
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
    /// Ascending, without repeats.
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
    /// The most rows one request to the model itself may carry: its `max_batch_size`, and
    /// no more than its FP32 outputs that fit in `--max-batch-bytes`.
    pub batch_rows: usize,
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

/// The one item of `items` (a config's `input` or `output`, an ensemble step's `input_map`
/// or `output_map`: every model kind takes exactly one of each), or `error()` when there
/// are none or several.
fn exactly_one<I: IntoIterator>(
    items: I,
    error: impl FnOnce() -> RepositoryError,
) -> Result<I::Item, RepositoryError> {
    let mut items = items.into_iter();
    match (items.next(), items.next()) {
        (Some(item), None) => Ok(item),
        _ => Err(error()),
    }
}

pub(crate) fn model_kind(
    dir: &Path,
    model: &str,
    config: &pb::ModelConfig,
    version: ModelVersion,
    limits: &Limits,
) -> Result<ModelKind, RepositoryError> {
    let platform = config.platform.as_str();
    let backend = config.backend.as_str();
    let onnx = matches!(
        (platform, backend),
        (PLATFORM_ONNX, "" | "onnxruntime") | ("", "onnxruntime")
    );
    reject_unsupported_common(model, config, onnx)?;
    match (platform, backend) {
        (PLATFORM_LIBTORCH, "" | "pytorch") | ("", "pytorch") => {
            classifier(dir, model, config, version, limits, Runtime::TorchScript)
                .map(ModelKind::Classifier)
        }
        (PLATFORM_AOTI, "" | "pytorch") => {
            classifier(dir, model, config, version, limits, Runtime::TorchAoti)
                .map(ModelKind::Classifier)
        }
        _ if onnx => {
            let runtime = Runtime::Onnx(onnx_options(model, config)?);
            classifier(dir, model, config, version, limits, runtime).map(ModelKind::Classifier)
        }
        ("", BACKEND_OPENVINO) => {
            let runtime = Runtime::OpenVino(openvino_options(model, config)?);
            classifier(dir, model, config, version, limits, runtime).map(ModelKind::Classifier)
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
            preprocessor(model, config, limits).map(ModelKind::Preprocessor)
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
                "'{}' cannot be served; export the model to TorchScript (platform \
                 \"pytorch_libtorch\"), ONNX (platform \"onnxruntime_onnx\"), OpenVINO IR \
                 (backend \"openvino\") or a torch.export package (platform \
                 \"torch_aoti\"), or use backend \"visiongate_image\" / platform \
                 \"ensemble\"",
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
/// What no model kind takes; `optimization` only from an ONNX model, and only its `graph`
/// level (read by `onnx_options`).
fn reject_unsupported_common(
    model: &str,
    c: &pb::ModelConfig,
    onnx: bool,
) -> Result<(), RepositoryError> {
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
    if let Some(o) = &c.optimization {
        let graph_only = pb::ModelOptimizationPolicy {
            graph: o.graph,
            ..Default::default()
        };
        if !onnx || *o != graph_only {
            return Err(unsupported(
                model,
                "optimization",
                if onnx {
                    "keep only its graph { level }: visiongate's ONNX Runtime sessions take no \
                     other optimization settings"
                } else {
                    remove
                },
            ));
        }
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

/// The file `name` (relative to `sub`, a directory of the model: `""`, `"1"`, `"warmup"`)
/// that a config's `field` names, as every file a model is read from must be: a relative
/// path without `..` that, once its symlinks are resolved, is a regular file inside the
/// model's directory `dir` (a FIFO or device would block the read, and a link out of the
/// directory would read another's file). `Ok(None)`: there is no such file.
fn model_file(
    dir: &Path,
    sub: &str,
    model: &str,
    field: &str,
    name: &str,
) -> Result<Option<PathBuf>, RepositoryError> {
    let Some(resolved) = resolve_model_file(dir, sub, model, field, name)? else {
        return Ok(None);
    };
    let kind = std::fs::metadata(&resolved).map_err(|e| model_file_io(model, sub, name, e))?;
    regular_model_file(kind.file_type(), model, sub, field, name)?;
    Ok(Some(resolved))
}

/// Where `name` leads once its symlinks are resolved, if it exists: refused unless it is a
/// relative path that stays inside the model's directory. Its kind is the caller's to check.
fn resolve_model_file(
    dir: &Path,
    sub: &str,
    model: &str,
    field: &str,
    name: &str,
) -> Result<Option<PathBuf>, RepositoryError> {
    let path = Path::new(name);
    let relative = !name.is_empty()
        && path
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !relative {
        return Err(invalid(
            model,
            field,
            format!(
                "'{name}' is not a file inside the model's directory: give a relative path \
                 without '..'"
            ),
        ));
    }
    let io = |e| model_file_io(model, sub, name, e);
    let resolved = match dir.join(sub).join(path).canonicalize() {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    if !resolved.starts_with(dir.canonicalize().map_err(io)?) {
        return Err(invalid(
            model,
            field,
            format!(
                "{} leads out of the model's directory; put the file itself there",
                Path::new(model).join(sub).join(name).display()
            ),
        ));
    }
    Ok(Some(resolved))
}

/// A model file that is not a regular file (a FIFO, a device, a directory) is refused.
fn regular_model_file(
    kind: std::fs::FileType,
    model: &str,
    sub: &str,
    field: &str,
    name: &str,
) -> Result<(), RepositoryError> {
    if kind.is_file() {
        return Ok(());
    }
    Err(invalid(
        model,
        field,
        format!(
            "{} is not a regular file",
            Path::new(model).join(sub).join(name).display()
        ),
    ))
}

fn model_file_io(model: &str, sub: &str, name: &str, source: std::io::Error) -> RepositoryError {
    RepositoryError::Io {
        path: Path::new(model).join(sub).join(name),
        source,
    }
}

/// The first `max` bytes of the file `name` in the directory `sub` of model `model` (in
/// `dir`), a [`model_file`] (a missing one is an I/O error naming it), and whether the file
/// goes on past them. Opened without blocking and its kind checked once open, so a FIFO
/// (or a file swapped for one) cannot hold the read.
pub(in crate::repository) fn read_model_file(
    dir: &Path,
    sub: &str,
    model: &str,
    field: &str,
    name: &str,
    max: usize,
) -> Result<(Vec<u8>, bool), RepositoryError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |e| model_file_io(model, sub, name, e);
    let path = resolve_model_file(dir, sub, model, field, name)?
        .ok_or_else(|| io(std::io::ErrorKind::NotFound.into()))?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(&path)
        .map_err(io)?;
    regular_model_file(
        file.metadata().map_err(io)?.file_type(),
        model,
        sub,
        field,
        name,
    )?;
    let mut bytes = Vec::new();
    file.take(max as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    let more = bytes.len() > max;
    bytes.truncate(max);
    Ok((bytes, more))
}

/// [`read_model_file`], refusing a file longer than `max` bytes.
pub(in crate::repository) fn read_whole_model_file(
    dir: &Path,
    sub: &str,
    model: &str,
    field: &str,
    name: &str,
    max: usize,
) -> Result<Vec<u8>, RepositoryError> {
    match read_model_file(dir, sub, model, field, name, max)? {
        (bytes, false) => Ok(bytes),
        (_, true) => Err(invalid(
            model,
            field,
            format!(
                "{} is larger than {max} bytes",
                Path::new(model).join(sub).join(name).display()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::super::scan;
    use super::test_support::{failure_of, temp_repo, write, CLASSIFIER};
    use super::*;

    #[test]
    fn the_bundled_repository_loads_all_three_models() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
        let r = scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
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
        let r = scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
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
        let r = scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
        assert!(r.models.is_empty());
        let msg = |m: &str| failure_of(&r, m);
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

    #[test]
    fn model_files_are_regular_files_inside_the_model_directory() {
        let root = temp_repo("files");
        let outside = root.join("elsewhere.txt");
        std::fs::write(&outside, "a\nb\n").unwrap();
        for model in ["inside", "outside"] {
            write(&root, &format!("{model}/config.pbtxt"), CLASSIFIER);
            write(&root, &format!("{model}/1/model.pt"), "x");
            write(&root, &format!("{model}/data/labels.txt"), "a\nb\n");
            let target = match model {
                "inside" => root.join("inside/data/labels.txt"),
                _ => outside.clone(),
            };
            std::os::unix::fs::symlink(target, root.join(model).join("labels.txt")).unwrap();
        }
        // A directory where the model file should be.
        write(&root, "dir/config.pbtxt", CLASSIFIER);
        write(&root, "dir/labels.txt", "a\nb\n");
        std::fs::create_dir_all(root.join("dir/1/model.pt")).unwrap();
        let r = scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
        let names: Vec<_> = r.models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["inside"], "{:?}", r.failures);
        let msg = failure_of(&r, "outside");
        assert!(
            msg.contains("output.label_filename") && msg.contains("out of the model's directory"),
            "{msg}"
        );
        let msg = failure_of(&r, "dir");
        assert!(msg.contains("1/model.pt is not a regular file"), "{msg}");
    }
}
