//! Model execution behind a small synchronous trait, so the scheduler can be tested with
//! a fake. An engine is owned by one instance thread and never sees tasks or channels.

pub mod cuda;
pub mod cuda_host;
mod fake;
mod torch;

pub use fake::{FakeEngine, FakeFaults};
pub use torch::{cpu_runs_bf16, cuda_device_count, normalize_on_cpu, TorchEngine};

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
    /// Where it runs, for logs ("cpu", "cuda:0").
    fn device_name(&self) -> String;
}
