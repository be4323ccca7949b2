//! Types shared by every module, parsed once at the boundary.
use std::fmt;

/// A model's name as it appears in the repository (its directory name).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelName(String);

impl ModelName {
    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into())
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `name`, as a client sent it, can name a model: one directory of the
    /// repository (no path separators, not `.` or `..`, no control characters, at most
    /// 255 characters). Returns why not.
    pub fn check(name: &str) -> Result<(), String> {
        let why = if name.is_empty() {
            "it is empty"
        } else if name.chars().count() > 255 {
            "it is longer than 255 characters"
        } else if name == "." || name == ".." {
            "it names no model directory"
        } else if name.contains(['/', '\\']) {
            "it holds a path separator"
        } else if name.chars().any(char::is_control) {
            "it holds a control character"
        } else {
            return Ok(());
        };
        Err(format!(
            "invalid model name {:?}: {why} (a model is one directory of the repository)",
            name.chars().take(64).collect::<String>()
        ))
    }
}

/// Lets maps keyed by name be read with a `&str`.
impl std::borrow::Borrow<str> for ModelName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ModelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A model version: a numeric directory of the model's repository entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelVersion(pub u64);

impl fmt::Display for ModelVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Where one model instance runs: `gpu` is the CUDA ordinal, `None` for the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InstanceId {
    pub gpu: Option<u32>,
    pub index: u32,
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.gpu {
            Some(g) => write!(f, "gpu{g}/{}", self.index),
            None => write!(f, "cpu/{}", self.index),
        }
    }
}

/// Per-channel normalization applied on the device: `(pixel / 255 - mean) / std`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalize {
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

/// One class of a classification result.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClassScore {
    pub class_id: u32,
    /// Softmax probability.
    pub score: f32,
    /// The model's output for the class (its logit), as Triton's classification reports it.
    pub value: f32,
}

/// A row's classes, best first: never empty, so the best class is always there.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranked(Vec<ClassScore>);

impl Ranked {
    /// `classes` best first; `None` when there are none.
    pub fn new(classes: Vec<ClassScore>) -> Option<Ranked> {
        (!classes.is_empty()).then_some(Ranked(classes))
    }

    pub fn best(&self) -> &ClassScore {
        &self.0[0]
    }

    pub fn classes(&self) -> &[ClassScore] {
        &self.0
    }

    /// Keeps the best `k` (at least the best one).
    pub fn truncate(&mut self, k: std::num::NonZeroUsize) {
        self.0.truncate(k.get());
    }
}

/// Indices of the `k` largest values, largest first (ties: lower index first). The one
/// top-k on the host; the engine ranks on its device.
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let order = |&a: &usize, &b: &usize| values[b].total_cmp(&values[a]).then(a.cmp(&b));
    let mut idx: Vec<usize> = (0..values.len()).collect();
    if k < idx.len() {
        // The k best first (unordered), then only they are sorted.
        idx.select_nth_unstable_by(k.saturating_sub(1), order);
        idx.truncate(k);
    }
    idx.sort_unstable_by(order);
    idx
}

/// The `k` classes of `logits` with the largest values, best first (as `top_k` orders
/// them), each with its softmax probability over all of `logits`: the host's
/// classification, for engines whose outputs arrive on the host.
pub fn classify(logits: &[f32], k: usize) -> Vec<ClassScore> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&v| (v - max).exp()).sum();
    top_k(logits, k)
        .into_iter()
        .map(|c| ClassScore {
            class_id: c as u32,
            score: (logits[c] - max).exp() / sum,
            value: logits[c],
        })
        .collect()
}

/// What happens to a request still queued when its timeout passes (Triton's
/// `ModelQueuePolicy.timeout_action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutAction {
    /// Answered with a deadline error.
    Reject,
    /// Kept, but runs only after every request that has not timed out.
    Delay,
}

/// What a caller may ask of the queue for one request (Triton's `priority` and `timeout`
/// request parameters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestOptions {
    /// 1 is the highest; 0 or a level the model does not have means its default level.
    pub priority: u64,
    /// Queue timeout; honoured only where the model allows overriding, and only shorter.
    pub timeout: Option<std::time::Duration>,
}

/// A `model_warmup` sample of a classifier (Triton's): before its instance serves, `count`
/// runs of a batch of `batch_size` rows filled as `data` says.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmupSample {
    pub name: String,
    pub batch_size: usize,
    pub count: usize,
    pub data: WarmupData,
}

#[derive(Debug, Clone, PartialEq)]
pub enum WarmupData {
    Zero,
    Random,
    /// One row (FP32, the model's input shape) from the sample's `input_data_file`,
    /// repeated for each row of the batch.
    Row(std::sync::Arc<Vec<f32>>),
}

/// The precision a classifier's convolutions and matmuls run in (its config's `precision`
/// parameter, or `--precision`). Reduced precisions run under autocast: the input, its
/// normalization, the ops autocast keeps in FP32 and the outputs stay FP32.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    #[default]
    Fp32,
    /// bfloat16: on CPUs with AVX-512 BF16 or AMX, and on CUDA.
    Bf16,
    /// float16: on CUDA only.
    Fp16,
}

impl Precision {
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// `fp32`, `bf16` or `fp16`, in any case, spaces around ignored.
    pub fn parse(text: &str) -> Option<Precision> {
        let text = text.trim();
        [Precision::Fp32, Precision::Bf16, Precision::Fp16]
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(text))
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// The runtime that runs a classifier's model file, as its config's `platform` (or
/// `backend`) names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    /// `pytorch_libtorch`: a TorchScript file (`model.pt`) on libtorch.
    TorchScript,
    /// `torch_aoti`: a torch.export package compiled by AOTInductor (`model.pt2`), on
    /// libtorch's package loader.
    TorchAoti,
    /// `onnxruntime_onnx`: an ONNX file (`model.onnx`) on ONNX Runtime, with the session
    /// options of Triton's onnxruntime backend.
    Onnx(OnnxOptions),
    /// backend `openvino`: OpenVINO IR (`model.xml` with its `model.bin`), or an ONNX file
    /// named by `default_model_filename`, on OpenVINO's CPU plugin, with the parameters of
    /// Triton's openvino backend.
    OpenVino(OpenVinoOptions),
}

impl Runtime {
    /// The file a version directory holds unless `default_model_filename` names another.
    pub fn default_file(&self) -> &'static str {
        match self {
            Runtime::TorchScript => "model.pt",
            Runtime::TorchAoti => "model.pt2",
            Runtime::Onnx(_) => "model.onnx",
            Runtime::OpenVino(_) => "model.xml",
        }
    }

    /// What that file is, in words.
    pub fn format(&self) -> &'static str {
        match self {
            Runtime::TorchScript => "a TorchScript file",
            Runtime::TorchAoti => "a torch.export package (AOTInductor)",
            Runtime::Onnx(_) => "an ONNX file",
            Runtime::OpenVino(_) => "an OpenVINO model (IR .xml with its .bin, or ONNX)",
        }
    }
}

/// An ONNX Runtime session's options, from the parameters and `optimization` of Triton's
/// onnxruntime backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OnnxOptions {
    /// `intra_op_thread_count`: `None` when unset (visiongate's `--intra-op-threads`, as
    /// for libtorch), `Some(0)` for ONNX Runtime's own default (a thread per core).
    pub intra_op_threads: Option<usize>,
    /// `inter_op_thread_count` (used by parallel execution only); `None`: ONNX Runtime's.
    pub inter_op_threads: Option<usize>,
    /// `execution_mode: 1`: independent branches of the graph run in parallel.
    pub parallel: bool,
    /// `optimization { graph { level } }`.
    pub graph_level: GraphLevel,
}

/// How OpenVINO compiles a model for the CPU, from the parameters of Triton's openvino
/// backend; each `None` leaves OpenVINO's own choice, except the threads (visiongate's
/// `--intra-op-threads` where unset, as for the other runtimes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenVinoOptions {
    /// `PERFORMANCE_HINT`.
    pub performance_hint: Option<PerformanceHint>,
    /// `NUM_STREAMS`.
    pub streams: Option<Streams>,
    /// `INFERENCE_NUM_THREADS` (0: OpenVINO's default, a thread per core).
    pub inference_threads: Option<usize>,
    /// `COMPILATION_NUM_THREADS`.
    pub compilation_threads: Option<usize>,
}

/// OpenVINO's `PERFORMANCE_HINT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PerformanceHint {
    Latency,
    Throughput,
    CumulativeThroughput,
}

impl PerformanceHint {
    /// As OpenVINO spells the property's value.
    pub fn as_str(self) -> &'static str {
        match self {
            PerformanceHint::Latency => "LATENCY",
            PerformanceHint::Throughput => "THROUGHPUT",
            PerformanceHint::CumulativeThroughput => "CUMULATIVE_THROUGHPUT",
        }
    }
}

/// OpenVINO's `NUM_STREAMS`: a count, or its `AUTO` or `NUMA` choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Streams {
    Auto,
    Numa,
    Count(u32),
}

/// ONNX Runtime's graph optimizations (Triton's `optimization.graph.level`: -1 basic, 1
/// extended, 2 none, anything else all).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GraphLevel {
    Disabled,
    Basic,
    Extended,
    #[default]
    All,
}

/// How the built-in preprocessor resamples an image to the model's size (its
/// `resize_filter` parameter), named for the library whose pixels it matches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ResizeFilter {
    /// Antialiased bilinear, as Pillow and torchvision's `Resize` (the default).
    #[default]
    Bilinear,
    /// Area averaging, as OpenCV's `INTER_AREA` when shrinking.
    Area,
    /// Bilinear interpolation without antialiasing, as OpenCV's `INTER_LINEAR`.
    Linear,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_is_the_first_k_of_the_whole_order() {
        // Ties (lower index first) and every k from none to more than there are.
        let values: [f32; 8] = [0.5, 2.0, -1.0, 2.0, 0.5, 7.0, -1.0, 0.0];
        let mut order: Vec<usize> = (0..values.len()).collect();
        order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
        assert_eq!(order, [5, 1, 3, 0, 4, 7, 2, 6]);
        for k in 0..=values.len() + 1 {
            assert_eq!(top_k(&values, k), order[..k.min(values.len())], "k = {k}");
        }
    }
}
