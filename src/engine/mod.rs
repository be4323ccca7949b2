//! Model execution behind a small synchronous trait, so the scheduler can be tested with
//! a fake. An engine is owned by one instance thread and never sees tasks or channels.

#[cfg(feature = "torch")]
pub mod cuda;
#[cfg(feature = "torch")]
pub mod cuda_host;
mod fake;
#[cfg(feature = "torch")]
mod torch;

pub use fake::{FakeEngine, FakeFaults, Gate};
#[cfg(feature = "torch")]
pub use torch::{cpu_runs_bf16, cuda_device_count, normalize_on_cpu, TorchEngine};

/// A build without libtorch (the fuzz targets') normalizes nothing: the one normalization
/// is libtorch's, so that every path computes the same values.
#[cfg(not(feature = "torch"))]
pub fn normalize_on_cpu(
    _data: &[u8],
    _height: usize,
    _width: usize,
    _normalize: Normalize,
) -> Result<Vec<f32>, EngineError> {
    Err(EngineError::Execution(
        "this build has no libtorch (the `torch` feature)".into(),
    ))
}

use std::time::Duration;

use crate::domain::{ClassScore, Normalize};
use crate::error::{ErrorKind, HasKind};

/// The rows of one batch, contiguous.
#[derive(Debug, Clone, Copy)]
pub enum BatchInput<'a> {
    /// u8 NHWC RGB images; normalized to f32 NCHW on the engine's device.
    Images {
        data: &'a [u8],
        height: usize,
        width: usize,
        normalize: Normalize,
    },
    /// f32 NCHW tensors, already preprocessed.
    Tensors {
        data: &'a [f32],
        height: usize,
        width: usize,
    },
}

impl BatchInput<'_> {
    pub fn rows(&self) -> usize {
        match *self {
            BatchInput::Images {
                data,
                height,
                width,
                ..
            } => data.len() / (height * width * 3),
            BatchInput::Tensors {
                data,
                height,
                width,
            } => data.len() / (height * width * 3),
        }
    }
}

/// What the callers of a batch want back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputRequest {
    /// Softmax top-k per row (0: none).
    pub top_k: usize,
    /// The raw output row (logits) per row.
    pub logits: bool,
}

impl OutputRequest {
    pub fn merge(self, other: OutputRequest) -> OutputRequest {
        OutputRequest {
            top_k: self.top_k.max(other.top_k),
            logits: self.logits || other.logits,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineOutput {
    /// Per row, best first, `top_k` long (or the number of classes if fewer).
    pub top_k: Vec<Vec<ClassScore>>,
    /// Row-major `[rows, classes]` when requested.
    pub logits: Option<Vec<f32>>,
    pub num_classes: usize,
    pub timings: ComputeTimings,
}

impl EngineOutput {
    /// Whether this answers every one of `rows` rows with what `want` asks: each row's top
    /// classes (at least one) and `rows x num_classes` logits. `Err` says what is missing.
    pub fn answers(&self, rows: usize, want: OutputRequest) -> Result<(), String> {
        if want.top_k > 0 && (self.top_k.len() != rows || self.top_k.iter().any(Vec::is_empty)) {
            return Err(format!(
                "the engine answered top classes for {} of {rows} rows",
                self.top_k.iter().filter(|t| !t.is_empty()).count()
            ));
        }
        let logits = self.logits.as_ref().map_or(0, Vec::len);
        if want.logits && (self.num_classes == 0 || logits != rows * self.num_classes) {
            return Err(format!(
                "the engine answered {logits} logits for {rows} rows of {} classes",
                self.num_classes
            ));
        }
        Ok(())
    }
}

/// Where a batch's time went, as Triton splits it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ComputeTimings {
    /// Input tensor built, copied to the device, normalized.
    pub input: Duration,
    /// The model's forward pass.
    pub infer: Duration,
    /// Softmax, top-k and the copy back to the host.
    pub output: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot load {path}: {message}")]
    Load { path: String, message: String },
    #[error("model execution failed: {0}")]
    Execution(String),
}

impl HasKind for EngineError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::Internal
    }
}

pub trait Engine: Send {
    fn run(
        &mut self,
        input: BatchInput<'_>,
        want: OutputRequest,
    ) -> Result<EngineOutput, EngineError>;
    /// Where it runs.
    fn device(&self) -> Device;
}

/// Where an engine runs. Its batch-size timing follows it: on a CPU the cost per image
/// grows with the batch, on a GPU it falls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
    /// The test engine: a fixed time per batch, so larger batches are cheaper per image,
    /// as on a GPU.
    Fake,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Fake => f.write_str("fake"),
        }
    }
}
