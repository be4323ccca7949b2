//! Model execution behind a small synchronous trait, so the scheduler can be tested with
//! a fake. An engine is owned by one instance thread and never sees tasks or channels.

mod fake;
#[cfg(feature = "torch")]
pub mod libtorch;
#[cfg(feature = "onnx")]
mod onnx;
#[cfg(feature = "openvino")]
mod openvino;
pub mod registry;

pub use fake::{FakeEngine, FakeFaults, Gate};
#[cfg(feature = "torch")]
pub use libtorch::{cuda_device_count, TorchEngine};
#[cfg(feature = "onnx")]
pub use onnx::{OnnxEngine, OnnxRuntime, ONNXRUNTIME_VERSION};
#[cfg(feature = "openvino")]
pub use openvino::{OpenVino, OpenVinoEngine, OPENVINO_VERSION};

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use crate::domain::{ClassScore, Normalize, Precision, Ranked, Runtime};
use crate::error::{ErrorKind, HasKind};
use crate::preprocess::BatchDecoder;

/// The rows of one batch, contiguous.
#[derive(Debug, Clone, Copy)]
pub enum BatchInput<'a> {
    /// u8 NHWC RGB images; normalized to f32 by the engine (on a libtorch GPU instance's
    /// device, else on the host).
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

/// What the callers of a batch want back: always each row's best classes (a row's top 1
/// costs next to nothing beside its forward pass, and every row's answer then has its
/// best class), and the logits where asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputRequest {
    /// Softmax top-k per row.
    pub top_k: NonZeroUsize,
    /// The raw output row (logits) per row.
    pub logits: bool,
}

impl Default for OutputRequest {
    fn default() -> OutputRequest {
        OutputRequest {
            top_k: NonZeroUsize::MIN,
            logits: false,
        }
    }
}

impl OutputRequest {
    /// The top `k` classes (at least one).
    pub fn classes(k: usize) -> OutputRequest {
        OutputRequest {
            top_k: NonZeroUsize::new(k).unwrap_or(NonZeroUsize::MIN),
            logits: false,
        }
    }

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
    /// Each of `rows` rows' classes, taken out once this is checked to answer every row
    /// with what `want` asks: its top classes (at least one) and `rows x num_classes`
    /// logits. `Err` says what is missing.
    pub fn ranked(&mut self, rows: usize, want: OutputRequest) -> Result<Vec<Ranked>, String> {
        let logits = self.logits.as_ref().map_or(0, Vec::len);
        if want.logits && (self.num_classes == 0 || logits != rows * self.num_classes) {
            return Err(format!(
                "the engine answered {logits} logits for {rows} rows of {} classes",
                self.num_classes
            ));
        }
        let answered = self.top_k.iter().filter(|t| !t.is_empty()).count();
        let ranked: Option<Vec<Ranked>> = std::mem::take(&mut self.top_k)
            .into_iter()
            .map(Ranked::new)
            .collect();
        match ranked {
            Some(ranked) if ranked.len() == rows => Ok(ranked),
            _ => Err(format!(
                "the engine answered top classes for {answered} of {rows} rows"
            )),
        }
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
    /// The threads a batch computes on (its intra-op threads): on the CPU, the cores it
    /// holds while it runs one (`cores::Cores`).
    fn threads(&self) -> usize {
        1
    }
}

/// What an instance runs on each batch: its decoder of JPEG rows, where its device has one
/// (`--gpu-decode`), then its engine.
pub struct Stages {
    pub decoder: Option<Box<dyn BatchDecoder>>,
    pub engine: Box<dyn Engine>,
}

impl Stages {
    /// An engine alone: JPEG rows are decoded on the CPU.
    pub fn engine(engine: impl Engine + 'static) -> Stages {
        Stages {
            decoder: None,
            engine: Box::new(engine),
        }
    }
}

/// Whether this CPU runs bfloat16 convolutions and matmuls natively (AVX-512 BF16 or
/// AMX); elsewhere a runtime would emulate them, slower than FP32.
pub fn cpu_runs_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
            || std::fs::read_to_string("/proc/cpuinfo")
                .is_ok_and(|info| info.split_whitespace().any(|flag| flag == "amx_bf16"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
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

/// What an instance's engine loads: the model file, the runtime that runs it, and the
/// tensors its config declares, which the engine checks the file against where the runtime
/// says what the graph takes.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    pub file: PathBuf,
    pub runtime: Runtime,
    /// What its convolutions and matmuls run in.
    pub precision: Precision,
    /// The most rows a batch holds: the config's `max_batch_size`, or fewer where
    /// `--max-batch-bytes` holds fewer (`ClassifierSpec::batch_rows`).
    pub max_batch_size: usize,
    /// The FP32 `[N, 3, height, width]` input's name.
    pub input: String,
    pub height: usize,
    pub width: usize,
    /// The FP32 `[N, classes]` output's name.
    pub output: String,
    pub num_classes: usize,
}

impl EngineSpec {
    /// The bundled classifier's (`models/classifier`: EfficientNet-Lite0, FP32 `input__0`
    /// `[N, 3, 224, 224]` to `output__0` `[N, 1000]`, batches up to 64) in `runtime`'s file
    /// under `repository`, for the benchmarks and the engine tests.
    pub fn bundled(repository: &std::path::Path, runtime: Runtime, precision: Precision) -> Self {
        EngineSpec {
            file: repository.join("classifier/1").join(runtime.default_file()),
            runtime,
            precision,
            max_batch_size: 64,
            input: "input__0".into(),
            height: 224,
            width: 224,
            output: "output__0".into(),
            num_classes: 1000,
        }
    }
}

/// A model file's load errors as clients see them (the repository index, a failed load):
/// the runtime's message to its first line, the file and its model directory named from the
/// repository on (`<model>/<version>/<file>`, `<model>`), never by the host's paths (the
/// temporary directory is said as `$TMPDIR`).
#[cfg(any(feature = "torch", feature = "onnx", feature = "openvino"))]
pub(crate) struct FileErrors {
    file: String,
    dir: Option<(String, String)>,
    shown: String,
}

#[cfg(any(feature = "torch", feature = "onnx", feature = "openvino"))]
impl FileErrors {
    pub fn new(path: &std::path::Path) -> Self {
        let dir = path.parent().and_then(std::path::Path::parent).map(|dir| {
            let name = dir.file_name().unwrap_or_default().to_string_lossy();
            (dir.display().to_string(), name.into_owned())
        });
        FileErrors {
            file: path.display().to_string(),
            dir,
            shown: repository_relative(path),
        }
    }

    /// The file as errors name it.
    #[cfg(feature = "torch")]
    pub fn shown(&self) -> &str {
        &self.shown
    }

    pub fn error(&self, message: impl AsRef<str>) -> EngineError {
        let first = message.as_ref().lines().next().unwrap_or_default();
        let mut message = first.replace(&self.file, &self.shown);
        if let Some((dir, name)) = &self.dir {
            message = message.replace(dir.as_str(), name);
        }
        // Where a runtime unpacked the file (a torch.export package's model).
        let temp = std::env::temp_dir().display().to_string();
        if temp.len() > 1 {
            message = message.replace(temp.trim_end_matches('/'), "$TMPDIR");
        }
        EngineError::Load {
            path: self.shown.clone(),
            message,
        }
    }
}

/// A model file's path from its model directory on (`<model>/<version>/<file>`): how load
/// errors name it, since they reach clients (the repository index, a failed load).
pub(crate) fn repository_relative(path: &std::path::Path) -> String {
    let parts: Vec<_> = path.components().rev().take(3).collect();
    parts
        .into_iter()
        .rev()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// A runtime library opened at run time, once for the whole process (`cell` keeps what the
/// first call made): `library`, made absolute so that the file checked is the file opened,
/// or `default` for the dynamic linker to find; `open` makes the runtime of it. Its error,
/// which reaches clients, names no path of the server's and says how to install `runtime`
/// (`install`): the log has the details.
#[cfg(any(feature = "onnx", feature = "openvino"))]
pub(crate) fn open_runtime_once<T>(
    cell: &'static std::sync::OnceLock<Result<T, String>>,
    library: Option<&std::path::Path>,
    default: &str,
    runtime: &str,
    install: &str,
    open: impl FnOnce(&std::path::Path) -> Result<T, String>,
) -> Result<&'static T, String> {
    cell.get_or_init(|| {
        let path = match library {
            Some(path) => std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()),
            None => PathBuf::from(default),
        };
        let why = |e: String| {
            tracing::error!(library = %path.display(), "{runtime} could not be opened: {e}");
            format!("{runtime} could not be opened (the server's log says why): {install}")
        };
        // A path that names no file is said plainly (a failed open of a bare name reads
        // the same whichever directories were searched).
        if library.is_some() && !path.is_file() {
            return Err(why("not a file".into()));
        }
        open(&path).map_err(why)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// A batch's f32 NCHW rows on the host, for runtimes that take their input there: tensors
/// as they come, images normalized into `staging` (reused across batches; the lookup pass
/// writes every value, so only a larger batch's growth is zero-filled first).
#[cfg(any(feature = "onnx", feature = "openvino"))]
pub(crate) fn host_rows<'a>(input: BatchInput<'a>, staging: &'a mut Vec<f32>) -> &'a [f32] {
    match input {
        BatchInput::Images {
            data,
            height,
            width,
            normalize,
        } => {
            staging.resize(data.len(), 0.0);
            normalize_into(data, height, width, normalize, Layout::Nchw, staging);
            staging
        }
        BatchInput::Tensors { data, .. } => data,
    }
}

/// What `want` asks of a batch's `[rows, num_classes]` logits on the host (`shape` as the
/// runtime gave it, checked first): each row's softmax top-k, and the logits themselves.
#[cfg(any(feature = "onnx", feature = "openvino"))]
pub(crate) fn host_output(
    shape: &[i64],
    logits: &[f32],
    rows: usize,
    num_classes: usize,
    want: OutputRequest,
) -> Result<EngineOutput, String> {
    if shape != [rows as i64, num_classes as i64] {
        return Err(format!(
            "the model returned shape {shape:?} for {rows} rows; expected [{rows}, {num_classes}]"
        ));
    }
    let mut out = EngineOutput {
        num_classes,
        ..Default::default()
    };
    out.top_k = logits
        .chunks_exact(num_classes)
        .map(|row| crate::domain::classify(row, want.top_k.get()))
        .collect();
    if want.logits {
        out.logits = Some(logits.to_vec());
    }
    Ok(out)
}

/// How `normalize_into` lays out a batch's f32 values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Each image's three planes in turn (what ONNX models and OpenVINO take).
    Nchw,
    /// Pixel by pixel, as decoded: a permuted view of it is NCHW with channels-last
    /// strides, the layout the bundled TorchScript model is laid out for.
    Nhwc,
}

/// `rows` u8 NHWC RGB images of `height` x `width`, normalized on the host into `out`
/// (as long as `data`) in `layout`: f32 `(x / 255 - mean) / std`, in the order torchvision
/// computes it, the same values libtorch computes on the CPU.
pub fn normalize_into(
    data: &[u8],
    height: usize,
    width: usize,
    normalize: Normalize,
    layout: Layout,
    out: &mut [f32],
) {
    assert_eq!(out.len(), data.len(), "one f32 per u8 value");
    let plane = height * width;
    // Each channel's 256 possible values, computed once per batch (the same operations on
    // the same operands, so the same values): the pass over the pixels is a lookup.
    let table: [[f32; 256]; 3] = std::array::from_fn(|c| {
        let (mean, std) = (normalize.mean[c], normalize.std[c]);
        std::array::from_fn(|v| (v as f32 / 255.0 - mean) / std)
    });
    match layout {
        Layout::Nhwc => {
            for (pixel, dst) in data.chunks_exact(3).zip(out.chunks_exact_mut(3)) {
                dst[0] = table[0][pixel[0] as usize];
                dst[1] = table[1][pixel[1] as usize];
                dst[2] = table[2][pixel[2] as usize];
            }
        }
        Layout::Nchw => {
            for (image, dst) in data
                .chunks_exact(plane * 3)
                .zip(out.chunks_exact_mut(plane * 3))
            {
                let (r, rest) = dst.split_at_mut(plane);
                let (g, b) = rest.split_at_mut(plane);
                for (i, pixel) in image.chunks_exact(3).enumerate() {
                    r[i] = table[0][pixel[0] as usize];
                    g[i] = table[1][pixel[1] as usize];
                    b[i] = table[2][pixel[2] as usize];
                }
            }
        }
    }
}

/// `normalize_into` a new vector, for the preprocessor model's own output.
pub fn normalize_on_cpu(
    data: &[u8],
    height: usize,
    width: usize,
    normalize: Normalize,
) -> Vec<f32> {
    let mut out = vec![0.0; data.len()];
    normalize_into(data, height, width, normalize, Layout::Nchw, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_missing_a_row_or_its_logits_is_refused_whole() {
        let class = |class_id| ClassScore {
            class_id,
            score: 0.5,
            value: 1.0,
        };
        let answer = |top: Vec<Vec<ClassScore>>, logits: Option<Vec<f32>>| EngineOutput {
            top_k: top,
            logits,
            num_classes: 2,
            ..Default::default()
        };
        let both = OutputRequest {
            logits: true,
            ..OutputRequest::default()
        };
        let mut whole = answer(vec![vec![class(1)], vec![class(0)]], Some(vec![0.0; 4]));
        let ranked = whole.ranked(2, both).unwrap();
        let best: Vec<u32> = ranked.iter().map(|r| r.best().class_id).collect();
        assert_eq!(best, [1, 0]);
        for (mut short, why) in [
            (answer(vec![vec![class(1)]], None), "1 of 2 rows"),
            (answer(vec![vec![class(1)]; 3], None), "3 of 2 rows"),
            (answer(vec![vec![class(1)], vec![]], None), "1 of 2 rows"),
        ] {
            let e = short.ranked(2, OutputRequest::default()).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
        let mut no_logits = answer(vec![vec![class(1)], vec![class(0)]], Some(vec![0.0; 3]));
        let e = no_logits.ranked(2, both).unwrap_err();
        assert!(e.contains("3 logits for 2 rows of 2 classes"), "{e}");
    }

    #[test]
    fn channels_last_normalization_holds_the_same_values_pixel_by_pixel() {
        let (h, w) = (3, 5);
        let data: Vec<u8> = (0..2 * h * w * 3).map(|i| (i * 37 % 256) as u8).collect();
        let n = Normalize {
            mean: [0.485, 0.456, 0.406],
            std: [0.229, 0.224, 0.225],
        };
        let (mut nchw, mut nhwc) = (vec![0.0; data.len()], vec![0.0; data.len()]);
        normalize_into(&data, h, w, n, Layout::Nchw, &mut nchw);
        normalize_into(&data, h, w, n, Layout::Nhwc, &mut nhwc);
        assert_eq!(nhwc.len(), nchw.len());
        for image in 0..2 {
            for c in 0..3 {
                for p in 0..h * w {
                    let plane = nchw[(image * 3 + c) * h * w + p];
                    assert_eq!(nhwc[(image * h * w + p) * 3 + c].to_bits(), plane.to_bits());
                }
            }
        }
    }

    #[cfg(any(feature = "onnx", feature = "openvino"))]
    #[test]
    fn reused_staging_holds_only_the_current_batch_whatever_the_last_one_held() {
        let (h, w) = (2, 3);
        let n = Normalize {
            mean: [0.485, 0.456, 0.406],
            std: [0.229, 0.224, 0.225],
        };
        let images = |rows: usize, seed: usize| -> Vec<u8> {
            (0..rows * h * w * 3)
                .map(|i| ((i + seed) * 37 % 256) as u8)
                .collect()
        };
        let mut staging = Vec::new();
        // Growing, shrinking, growing again: each answer is the batch's values alone.
        for (rows, seed) in [(2, 1), (3, 2), (1, 3), (2, 4)] {
            let data = images(rows, seed);
            let input = BatchInput::Images {
                data: &data,
                height: h,
                width: w,
                normalize: n,
            };
            let got = host_rows(input, &mut staging).to_vec();
            assert_eq!(got, normalize_on_cpu(&data, h, w, n), "{rows} rows");
        }
    }

    #[test]
    fn cpu_normalization_is_nchw_of_x_over_255_minus_mean_over_std() {
        // One 1x2 image: pixels (0, 128, 255) and (51, 102, 204).
        let data = [0u8, 128, 255, 51, 102, 204];
        let n = Normalize {
            mean: [0.5, 0.4, 0.3],
            std: [0.2, 0.25, 0.5],
        };
        let out = normalize_on_cpu(&data, 1, 2, n);
        let f = |v: u8, c: usize| (v as f32 / 255.0 - n.mean[c]) / n.std[c];
        let want = [
            f(0, 0),
            f(51, 0),
            f(128, 1),
            f(102, 1),
            f(255, 2),
            f(204, 2),
        ];
        assert_eq!(out, want);
    }
}
