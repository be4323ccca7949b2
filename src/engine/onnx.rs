//! ONNX Runtime (the `ort` crate): one ONNX model in one session, inference only. The
//! runtime is a shared library opened at run time (PyPI's `onnxruntime` wheel carries it),
//! once per process, by the first ONNX model that loads.
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use ort::environment::Environment;
use ort::ep::{ExecutionProvider, CUDA};
use ort::session::builder::GraphOptimizationLevel;
use ort::session::{HasSelectedOutputs, OutputSelector, RunOptions, Session};
use ort::value::{TensorElementType, TensorRef, ValueType};

use super::registry::Backend;
use super::{
    host_output, host_rows, open_runtime_once, repository_relative, BatchInput, ComputeTimings,
    Engine, EngineError, EngineOutput, EngineSpec, FileErrors, OutputRequest, Stages,
};
use crate::domain::{GraphLevel, InstanceId, OnnxOptions, Precision, Runtime};

/// The ONNX Runtime version the set-up installs and this build is made for (the `ort`
/// crate's API level): older libraries are refused as they load.
pub const ONNXRUNTIME_VERSION: &str = "1.31.1";

/// The runtime library's environment, made once: `Err` says why ONNX models cannot load.
static RUNTIME: OnceLock<Result<Environment, String>> = OnceLock::new();

/// Opens ONNX Runtime from `library` (the first call decides, for the whole process):
/// `None` looks for `libonnxruntime.so` where the dynamic linker looks.
fn runtime(library: Option<&Path>) -> Result<&'static Environment, String> {
    let install = format!(
        "install PyPI's onnxruntime=={ONNXRUNTIME_VERSION} (`make setup` does) and pass its \
         onnxruntime/capi/libonnxruntime.so.{ONNXRUNTIME_VERSION} to --onnxruntime-library \
         (or VISIONGATE_ONNXRUNTIME_LIBRARY)"
    );
    open_runtime_once(
        &RUNTIME,
        library,
        "libonnxruntime.so",
        "ONNX Runtime",
        &install,
        |path| {
            let env = ort::init_from(path).map_err(|e| e.to_string())?;
            let env = env
                .with_name("visiongate")
                .build()
                .map_err(|e| e.to_string())?;
            // Its own INFO lines (every session's options) are a debugging aid: warnings up.
            env.set_log_level(ort::logging::LogLevel::Warning);
            tracing::info!(library = %path.display(), build = ort::info(), "ONNX Runtime opened");
            Ok(env)
        },
    )
}

/// ONNX Runtime as a runtime of this build: its library is opened by the first ONNX model
/// that loads.
pub struct OnnxRuntime {
    /// The library (`None`: the dynamic linker's search).
    pub library: Option<PathBuf>,
    /// Intra-op threads per session where a model's config sets none.
    pub intra_op_threads: usize,
}

impl Backend for OnnxRuntime {
    fn load(&self, spec: &EngineSpec, id: InstanceId) -> Result<Stages, EngineError> {
        let Runtime::Onnx(options) = spec.runtime else {
            return Err(EngineError::Load {
                path: repository_relative(&spec.file),
                message: format!("{} is not an ONNX model", spec.runtime.format()),
            });
        };
        let library = self.library.as_deref();
        let engine = OnnxEngine::load(spec, options, id.gpu, self.intra_op_threads, library)?;
        Ok(Stages::engine(engine))
    }
}

pub struct OnnxEngine {
    session: Session,
    /// Asks the session for the config's output alone: a graph's other outputs are not
    /// computed (or only as far as the config's needs them).
    run_options: RunOptions<HasSelectedOutputs>,
    input: String,
    output: String,
    height: usize,
    width: usize,
    num_classes: usize,
    device: super::Device,
    /// Its intra-op threads.
    threads: usize,
    /// The normalized rows of an image batch, reused: grows to the largest batch seen.
    staging: Vec<f32>,
}

impl OnnxEngine {
    /// A session for `spec`'s ONNX file on `gpu` (CUDA ordinal, through ONNX Runtime's CUDA
    /// execution provider) or the CPU, with `options`; `threads` intra-op threads where the
    /// config sets none. The graph's input and output are checked against the config's.
    pub fn load(
        spec: &EngineSpec,
        options: OnnxOptions,
        gpu: Option<u32>,
        threads: usize,
        library: Option<&Path>,
    ) -> Result<Self, EngineError> {
        let errors = FileErrors::new(&spec.file);
        let load_error = |message: String| errors.error(message);
        if spec.precision != Precision::Fp32 {
            return Err(load_error(format!(
                "precision {} is not offered for ONNX models; ONNX Runtime runs them in fp32 \
                 (set the config's precision parameter, or --precision, to fp32)",
                spec.precision
            )));
        }
        let env = runtime(library).map_err(&load_error)?;
        // The ort crate panics on graph value types it does not model (a sequence of
        // sequences, an opaque type): that is this file's failure, said so.
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            session(env, &spec.file, options, gpu, threads)
        }))
        .map_err(|_| {
            load_error("the graph has an input or output of a type visiongate cannot read".into())
        })?;
        let session = built.map_err(|e| load_error(e.to_string()))?;
        check_graph(&session, spec).map_err(load_error)?;
        let run_options = RunOptions::new()
            .map_err(|e| load_error(e.to_string()))?
            .with_outputs(OutputSelector::no_default().with(spec.output.as_str()));
        Ok(OnnxEngine {
            session,
            run_options,
            input: spec.input.clone(),
            output: spec.output.clone(),
            height: spec.height,
            width: spec.width,
            num_classes: spec.num_classes,
            device: gpu.map_or(super::Device::Cpu, |i| super::Device::Cuda(i as usize)),
            // 0: ONNX Runtime's default, a thread per core.
            threads: match options.intra_op_threads.unwrap_or(threads) {
                0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
                n => n,
            },
            staging: Vec::new(),
        })
    }

    fn run_inner(
        &mut self,
        input: BatchInput<'_>,
        want: OutputRequest,
    ) -> Result<EngineOutput, String> {
        let t0 = Instant::now();
        let rows = input.rows();
        let data = host_rows(input, &mut self.staging);
        let shape = [rows, 3, self.height, self.width];
        let tensor = TensorRef::from_array_view((shape, data)).map_err(|e| e.to_string())?;
        let t1 = Instant::now();
        let outputs = self
            .session
            .run_with_options(
                ort::inputs![self.input.as_str() => tensor],
                &self.run_options,
            )
            .map_err(|e| e.to_string())?;
        let t2 = Instant::now();
        let output = outputs
            .get(self.output.as_str())
            .ok_or_else(|| format!("the model gave no output '{}'", self.output))?;
        let (shape, logits) = output
            .try_extract_tensor::<f32>()
            .map_err(|e| e.to_string())?;
        let mut out = host_output(shape, logits, rows, self.num_classes, want)?;
        out.timings = ComputeTimings {
            input: t1 - t0,
            infer: t2 - t1,
            output: t2.elapsed(),
        };
        Ok(out)
    }
}

impl Engine for OnnxEngine {
    fn run(
        &mut self,
        input: BatchInput<'_>,
        want: OutputRequest,
    ) -> Result<EngineOutput, EngineError> {
        self.run_inner(input, want).map_err(EngineError::Execution)
    }

    fn device(&self) -> super::Device {
        self.device
    }

    fn threads(&self) -> usize {
        self.threads
    }
}

fn session(
    env: &Environment,
    file: &Path,
    options: OnnxOptions,
    gpu: Option<u32>,
    threads: usize,
) -> ort::Result<Session> {
    let level = match options.graph_level {
        GraphLevel::Disabled => GraphOptimizationLevel::Disable,
        GraphLevel::Basic => GraphOptimizationLevel::Level1,
        GraphLevel::Extended => GraphOptimizationLevel::Level2,
        GraphLevel::All => GraphOptimizationLevel::All,
    };
    let mut builder = Session::builder(env)?
        .with_optimization_level(level)?
        .with_parallel_execution(options.parallel)?;
    // 0: ONNX Runtime's own default (a thread per core).
    let intra = options.intra_op_threads.unwrap_or(threads);
    if intra > 0 {
        builder = builder.with_intra_threads(intra)?;
    }
    if let Some(inter) = options.inter_op_threads {
        builder = builder.with_inter_threads(inter)?;
    }
    if let Some(i) = gpu {
        let cuda = CUDA::default().with_device_id(i as i32);
        if !CUDA::is_available()? {
            return Err(ort::Error::new(format!(
                "this ONNX Runtime has no CUDA execution provider, so it cannot run on GPU \
                 {i}: install PyPI's onnxruntime-gpu=={ONNXRUNTIME_VERSION} instead of \
                 onnxruntime, with the CUDA libraries it names, or use KIND_CPU"
            )));
        }
        builder = builder.with_execution_providers([cuda.build().error_on_failure()])?;
    }
    builder.commit_from_file(file)
}

/// Whether the graph takes the config's input and gives its output: one FP32 input of the
/// config's name, `[batch, 3, height, width]`, and an FP32 output of its name,
/// `[batch, classes]`, each batch dimension dynamic (the config's max_batch_size is at least
/// 1). A dimension the graph leaves dynamic takes the config's size.
fn check_graph(session: &Session, spec: &EngineSpec) -> Result<(), String> {
    let names = |outlets: &[ort::value::Outlet]| {
        outlets
            .iter()
            .map(|o| format!("'{}'", o.name()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let inputs = session.inputs();
    let [input] = inputs else {
        return Err(format!(
            "field 'input': the graph has {} inputs ({}); a classifier takes one",
            inputs.len(),
            names(inputs)
        ));
    };
    if input.name() != spec.input {
        return Err(format!(
            "field 'input': the config names '{}', the graph's input is '{}'",
            spec.input,
            input.name()
        ));
    }
    let dims = [3, spec.height as i64, spec.width as i64];
    check_tensor("input", &spec.input, input.dtype(), &dims)?;
    let outputs = session.outputs();
    let Some(output) = outputs.iter().find(|o| o.name() == spec.output) else {
        return Err(format!(
            "field 'output': the config names '{}', the graph's outputs are {}",
            spec.output,
            names(outputs)
        ));
    };
    check_tensor(
        "output",
        &spec.output,
        output.dtype(),
        &[spec.num_classes as i64],
    )
}

/// An element type as a Triton config spells it.
fn triton_type(ty: TensorElementType) -> String {
    use TensorElementType as T;
    let name = match ty {
        T::Float64 => "FP64",
        T::Float16 => "FP16",
        T::Bfloat16 => "BF16",
        T::Int64 => "INT64",
        T::Int32 => "INT32",
        T::Int16 => "INT16",
        T::Int8 => "INT8",
        T::Uint8 => "UINT8",
        T::Bool => "BOOL",
        T::String => "STRING",
        other => return format!("{other:?}"),
    };
    format!("TYPE_{name}")
}

/// One tensor of the graph against the config's `field` (`dims` without the batch).
fn check_tensor(field: &str, name: &str, dtype: &ValueType, dims: &[i64]) -> Result<(), String> {
    let (Some(ty), Some(shape)) = (dtype.tensor_type(), dtype.tensor_shape()) else {
        return Err(format!(
            "field '{field}': '{name}' is not a tensor in the graph"
        ));
    };
    let mut want = vec![-1];
    want.extend_from_slice(dims);
    let shown = |d: &[i64]| {
        let d: Vec<String> = d
            .iter()
            .map(|&v| if v < 0 { "-1".into() } else { v.to_string() })
            .collect();
        format!("[{}]", d.join(", "))
    };
    if ty != TensorElementType::Float32 {
        return Err(format!(
            "field '{field}': '{name}' is {} in the graph; the config says TYPE_FP32",
            triton_type(ty)
        ));
    }
    if shape.len() != want.len() {
        return Err(format!(
            "field '{field}': '{name}' has rank {} in the graph {}; the config's dims with the \
             batch dimension are {}",
            shape.len(),
            shown(shape),
            shown(&want)
        ));
    }
    if shape[0] >= 0 {
        return Err(format!(
            "field '{field}': '{name}' has a fixed batch dimension of {} in the graph; with \
             max_batch_size > 0 it must be dynamic (export it with a dynamic batch axis)",
            shape[0]
        ));
    }
    if let Some(i) = (1..want.len()).find(|&i| shape[i] >= 0 && shape[i] != want[i]) {
        return Err(format!(
            "field '{field}.dims': '{name}' is {} in the graph, the config says {} (dimension \
             {i} differs)",
            shown(shape),
            shown(&want)
        ));
    }
    Ok(())
}
