//! OpenVINO, as Triton's `openvino` backend serves it: an IR model (`model.xml` with its
//! `model.bin`) or an ONNX file on OpenVINO's CPU plugin, one compiled model and one infer
//! request per instance. The library (PyPI's `openvino` wheel carries its C API,
//! `libopenvino_c.so.<release>`, with the CPU plugin beside it) is opened at run time, once
//! per process, by the first OpenVINO model that loads.
//!
//! Unlike Triton's backend, which fixes the batch dimension to `max_batch_size` (a smaller
//! request then fails, or is padded), the graph's batch dimension is made 1 to the largest
//! batch the server forms, so each batch runs at its own size. The precision is FP32 unless the config asks for bf16: on
//! CPUs with AVX-512 BF16 or AMX, OpenVINO would otherwise compute in bf16 unasked.
mod ffi;
mod onnx_data;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use super::registry::Backend;
use super::{
    cpu_runs_bf16, host_output, host_rows, open_runtime_once, repository_relative, BatchInput,
    ComputeTimings, Engine, EngineError, EngineOutput, EngineSpec, FileErrors, OutputRequest,
    Stages,
};
use crate::domain::{InstanceId, OpenVinoOptions, Precision, Runtime, Streams};
use ffi::{Compiled, Dimension, Port};

/// The OpenVINO release the set-up installs; its C API is `libopenvino_c.so.2641`.
pub const OPENVINO_VERSION: &str = "2026.4.1";
/// The file name the dynamic linker is asked for when no path is given.
const LIBRARY_NAME: &str = "libopenvino_c.so.2641";
/// The releases whose C API this build's bindings match (their element type numbering).
const RELEASES: &str = "2026.";

static RUNTIME: OnceLock<Result<ffi::Runtime, String>> = OnceLock::new();

/// Opens OpenVINO from `library` (the first call decides, for the whole process): `None`
/// asks the dynamic linker for `libopenvino_c.so.2641`.
fn runtime(library: Option<&Path>) -> Result<&'static ffi::Runtime, String> {
    let install = format!(
        "install PyPI's openvino=={OPENVINO_VERSION} (`make setup` does) and pass its \
         openvino/libs/{LIBRARY_NAME} to --openvino-library (or VISIONGATE_OPENVINO_LIBRARY)"
    );
    open_runtime_once(
        &RUNTIME,
        library,
        LIBRARY_NAME,
        "OpenVINO",
        &install,
        |path| {
            let rt = ffi::Runtime::open(&path.to_string_lossy())?;
            if !rt.version.starts_with(RELEASES) {
                return Err(format!(
                    "release {} is not one this build speaks to ({RELEASES}x)",
                    rt.version
                ));
            }
            tracing::info!(library = %path.display(), version = %rt.version, "OpenVINO opened");
            Ok(rt)
        },
    )
}

/// OpenVINO as a runtime of this build: its library is opened by the first OpenVINO model
/// that loads.
pub struct OpenVino {
    /// The library (`None`: the dynamic linker's search).
    pub library: Option<PathBuf>,
    /// Inference threads per compiled model where a config sets no
    /// `INFERENCE_NUM_THREADS`.
    pub threads: usize,
}

impl Backend for OpenVino {
    fn load(&self, spec: &EngineSpec, id: InstanceId) -> Result<Stages, EngineError> {
        let errors = FileErrors::new(&spec.file);
        let Runtime::OpenVino(options) = spec.runtime else {
            return Err(EngineError::Load {
                path: repository_relative(&spec.file),
                message: format!("{} is not an OpenVINO model", spec.runtime.format()),
            });
        };
        if let Some(gpu) = id.gpu {
            return Err(errors.error(format!(
                "OpenVINO runs on the CPU here, and this instance is planned on GPU {gpu}: \
                 use an instance group of KIND_CPU (as Triton's openvino backend requires)"
            )));
        }
        OpenVinoEngine::load(spec, options, self.threads, self.library.as_deref())
            .map(Stages::engine)
    }
}

pub struct OpenVinoEngine {
    compiled: Compiled<'static>,
    /// The index of the config's output among the graph's.
    output: usize,
    height: usize,
    width: usize,
    num_classes: usize,
    /// Its inference threads, as compiled.
    threads: usize,
    /// The normalized rows of an image batch, reused: grows to the largest batch seen.
    staging: Vec<f32>,
}

impl OpenVinoEngine {
    /// `spec`'s model compiled for the CPU with `options`, in its precision, on `threads`
    /// inference threads where the config sets none (0: a thread per core), OpenVINO opened
    /// from `library` if it is not yet; the graph checked against the config.
    pub fn load(
        spec: &EngineSpec,
        options: OpenVinoOptions,
        threads: usize,
        library: Option<&Path>,
    ) -> Result<Self, EngineError> {
        let errors = FileErrors::new(&spec.file);
        let rt = runtime(library).map_err(|e| errors.error(e))?;
        Self::compile(rt, spec, options, threads).map_err(|e| errors.error(e))
    }

    fn compile(
        rt: &'static ffi::Runtime,
        spec: &EngineSpec,
        options: OpenVinoOptions,
        threads: usize,
    ) -> Result<Self, String> {
        let precision = match spec.precision {
            Precision::Fp32 => "f32",
            Precision::Bf16 if cpu_runs_bf16() => "bf16",
            Precision::Bf16 => {
                return Err(
                    "precision bf16 on the CPU needs AVX-512 BF16 or AMX, which this CPU \
                            lacks: use fp32 (the config's precision parameter, or leave \
                            HINT_BF16 out)"
                        .into(),
                )
            }
            Precision::Fp16 => {
                return Err(
                    "precision fp16 is not offered for OpenVINO models, which run on \
                            the CPU: use fp32, or bf16 on CPUs with AVX-512 BF16 or AMX"
                        .into(),
                )
            }
        };
        // An IR's weights: the .bin beside it, which the repository checked (a regular file
        // inside the model's directory); named here, not left to OpenVINO to find. An ONNX
        // file must hold its weights itself.
        let is_ir = spec.file.extension().is_some_and(|e| e == "xml");
        let weights = is_ir.then(|| spec.file.with_extension("bin"));
        if !is_ir {
            let bytes = std::fs::read(&spec.file).map_err(|e| format!("cannot read it: {e}"))?;
            onnx_data::check(&bytes).map_err(|finding| match finding {
                onnx_data::Finding::ExternalData(what) => format!(
                    "{what}: an ONNX model served by OpenVINO must hold its weights (export \
                     it with external_data=False, or convert it to IR)"
                ),
                onnx_data::Finding::Malformed(what) => {
                    format!("not an ONNX model ({what})")
                }
            })?;
        }
        let _loading = rt.loading();
        let model = rt.read_model(&spec.file, weights.as_deref())?;
        let output = check_graph(&model.inputs()?, &model.outputs()?, spec)?;
        // Every batch size up to the config's, at the config's image size.
        let dims = [
            Dimension {
                min: 1,
                max: spec.max_batch_size as i64,
            },
            Dimension::fixed(3),
            Dimension::fixed(spec.height as i64),
            Dimension::fixed(spec.width as i64),
        ];
        model.reshape_input(&spec.input, &dims)?;
        // A graph that fixed its batch inside (a reshape to the export's batch) would now
        // give that batch whatever it is fed: its output must follow the input's batch.
        let batch = &model.outputs()?[output];
        if batch.dims.as_ref().and_then(|d| d.first()) != Some(&dims[0]) {
            return Err(format!(
                "field 'output': '{}' keeps a batch dimension of {} once the input's is made \
                 1..{} (the graph fixes its batch inside: export it with a dynamic batch axis)",
                spec.output,
                batch
                    .dims
                    .as_ref()
                    .and_then(|d| d.first())
                    .map_or("?".into(), |d| format!("{}..{}", d.min, d.max)),
                spec.max_batch_size
            ));
        }
        let threads = options.inference_threads.unwrap_or(threads);
        let compiled = model.compile(&properties(precision, options, threads))?;
        let compiled_precision = compiled.property("INFERENCE_PRECISION_HINT")?;
        if !compiled_precision.eq_ignore_ascii_case(precision) {
            return Err(format!(
                "OpenVINO compiled the model in {compiled_precision}, not the {precision} asked"
            ));
        }
        let threads = compiled
            .property("INFERENCE_NUM_THREADS")
            .ok()
            .and_then(|t| t.parse().ok())
            .filter(|&t| t > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        tracing::debug!(
            model = %repository_relative(&spec.file),
            precision = compiled_precision,
            threads,
            streams = compiled.property("NUM_STREAMS").unwrap_or_default(),
            "OpenVINO model compiled"
        );
        Ok(OpenVinoEngine {
            compiled,
            output,
            height: spec.height,
            width: spec.width,
            num_classes: spec.num_classes,
            threads,
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
        let dims = [rows as i64, 3, self.height as i64, self.width as i64];
        let num_classes = self.num_classes;
        let t1 = Instant::now();
        let mut t2 = t1;
        let out = self
            .compiled
            .infer(data, &dims, self.output, |shape, logits| {
                t2 = Instant::now();
                host_output(shape, logits, rows, num_classes, want)
            });
        let mut out = out??;
        out.timings = ComputeTimings {
            input: t1 - t0,
            infer: t2 - t1,
            output: t2.elapsed(),
        };
        Ok(out)
    }
}

impl Engine for OpenVinoEngine {
    fn run(
        &mut self,
        input: BatchInput<'_>,
        want: OutputRequest,
    ) -> Result<EngineOutput, EngineError> {
        self.run_inner(input, want).map_err(EngineError::Execution)
    }

    fn device(&self) -> super::Device {
        super::Device::Cpu
    }

    fn threads(&self) -> usize {
        self.threads
    }
}

/// The CPU plugin's properties: the precision always (OpenVINO's own default is bf16 on
/// CPUs that have it), the threads unless 0 (OpenVINO's default), the latency hint unless
/// the config names one (one request per instance: a throughput hint's streams would sit
/// idle), and what else the config sets.
fn properties(precision: &str, options: OpenVinoOptions, threads: usize) -> Vec<(&str, String)> {
    let mut p = vec![
        ("INFERENCE_PRECISION_HINT", precision.to_string()),
        // OpenVINO pins each compiled model's threads to cores of its choosing, the same
        // ones for every instance (on 2 cores, two 1-thread instances shared one core
        // while the decode threads had the other); the cores are shared here already.
        ("ENABLE_CPU_PINNING", "NO".to_string()),
    ];
    let hint = options
        .performance_hint
        .unwrap_or(crate::domain::PerformanceHint::Latency);
    p.push(("PERFORMANCE_HINT", hint.as_str().to_string()));
    if threads > 0 {
        p.push(("INFERENCE_NUM_THREADS", threads.to_string()));
    }
    if let Some(streams) = options.streams {
        let streams = match streams {
            Streams::Auto => "AUTO".to_string(),
            Streams::Numa => "NUMA".to_string(),
            Streams::Count(n) => n.to_string(),
        };
        p.push(("NUM_STREAMS", streams));
    }
    if let Some(n) = options.compilation_threads {
        p.push(("COMPILATION_NUM_THREADS", n.to_string()));
    }
    p
}

/// Whether the graph takes the config's input and gives its output: one FP32 input of the
/// config's name, `[batch, 3, height, width]` (a dimension the graph leaves dynamic takes
/// the config's size; the batch is made dynamic), and an FP32 output of its name,
/// `[batch, classes]`. The output's index among the graph's.
fn check_graph(inputs: &[Port], outputs: &[Port], spec: &EngineSpec) -> Result<usize, String> {
    let names = |ports: &[Port]| {
        ports
            .iter()
            .map(|p| format!("'{}'", p.name))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let [input] = inputs else {
        return Err(format!(
            "field 'input': the graph has {} inputs ({}); a classifier takes one",
            inputs.len(),
            names(inputs)
        ));
    };
    if input.name != spec.input {
        return Err(format!(
            "field 'input': the config names '{}', the graph's input is '{}'",
            spec.input, input.name
        ));
    }
    check_port("input", input, &[3, spec.height as i64, spec.width as i64])?;
    let Some(index) = outputs.iter().position(|o| o.name == spec.output) else {
        return Err(format!(
            "field 'output': the config names '{}', the graph's outputs are {}",
            spec.output,
            names(outputs)
        ));
    };
    check_port("output", &outputs[index], &[spec.num_classes as i64])?;
    Ok(index)
}

/// One port of the graph against the config's `field` (`dims` without the batch).
fn check_port(field: &str, port: &Port, dims: &[i64]) -> Result<(), String> {
    let name = &port.name;
    if port.element != ffi::F32 {
        return Err(format!(
            "field '{field}': '{name}' is not FP32 in the graph (OpenVINO element type {}); \
             the config says TYPE_FP32",
            port.element
        ));
    }
    let Some(shape) = &port.dims else {
        return Err(format!(
            "field '{field}': '{name}' has a dynamic rank in the graph; the config's dims \
             with the batch dimension have rank {}",
            dims.len() + 1
        ));
    };
    let shown = |d: &[Option<i64>]| {
        let d: Vec<String> = d
            .iter()
            .map(|v| v.map_or("-1".into(), |v| v.to_string()))
            .collect();
        format!("[{}]", d.join(", "))
    };
    let graph: Vec<Option<i64>> = shape.iter().map(|d| d.size()).collect();
    let mut want = vec![None];
    want.extend(dims.iter().map(|&d| Some(d)));
    if graph.len() != want.len() {
        return Err(format!(
            "field '{field}': '{name}' has rank {} in the graph {}; the config's dims with the \
             batch dimension are {}",
            graph.len(),
            shown(&graph),
            shown(&want)
        ));
    }
    if let Some(i) = (1..want.len()).find(|&i| graph[i].is_some() && graph[i] != want[i]) {
        return Err(format!(
            "field '{field}.dims': '{name}' is {} in the graph, the config says {} (dimension \
             {i} differs)",
            shown(&graph),
            shown(&want)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::PerformanceHint;

    fn port(name: &str, element: u32, dims: &[Option<i64>]) -> Port {
        Port {
            name: name.into(),
            element,
            dims: Some(
                dims.iter()
                    .map(|d| d.map_or(Dimension::DYNAMIC, Dimension::fixed))
                    .collect(),
            ),
        }
    }

    fn spec() -> EngineSpec {
        EngineSpec::bundled(
            Path::new("/models"),
            Runtime::OpenVino(OpenVinoOptions::default()),
            Precision::Fp32,
        )
    }

    #[test]
    fn the_graph_is_checked_against_the_config_naming_the_field() {
        let input = port("input__0", ffi::F32, &[None, Some(3), Some(224), Some(224)]);
        let logits = port("output__0", ffi::F32, &[None, Some(1000)]);
        let other = port("features", ffi::F32, &[None, Some(1280)]);
        let outputs = [other.clone(), logits.clone()];
        assert_eq!(
            check_graph(std::slice::from_ref(&input), &outputs, &spec()),
            Ok(1)
        );
        // A fixed batch of the export is fine: it is made dynamic.
        let fixed = port("input__0", ffi::F32, &[Some(1), Some(3), None, None]);
        assert_eq!(check_graph(&[fixed], &outputs, &spec()), Ok(1));

        let e = check_graph(&[input.clone(), other.clone()], &outputs, &spec()).unwrap_err();
        assert!(
            e.starts_with("field 'input': the graph has 2 inputs"),
            "{e}"
        );
        let e = check_graph(std::slice::from_ref(&other), &outputs, &spec()).unwrap_err();
        assert!(e.contains("the graph's input is 'features'"), "{e}");
        let e = check_graph(
            std::slice::from_ref(&input),
            std::slice::from_ref(&other),
            &spec(),
        )
        .unwrap_err();
        assert!(e.contains("the graph's outputs are 'features'"), "{e}");
        let small = port("input__0", ffi::F32, &[None, Some(3), Some(160), Some(160)]);
        let e = check_graph(&[small], &outputs, &spec()).unwrap_err();
        assert_eq!(
            e,
            "field 'input.dims': 'input__0' is [-1, 3, 160, 160] in the graph, the config says \
             [-1, 3, 224, 224] (dimension 2 differs)"
        );
        let u8_input = port("input__0", 16, &[None, Some(3), Some(224), Some(224)]);
        let e = check_graph(&[u8_input], &outputs, &spec()).unwrap_err();
        assert!(e.contains("is not FP32 in the graph"), "{e}");
        let flat = port("output__0", ffi::F32, &[Some(1000)]);
        let e = check_graph(&[input], &[flat], &spec()).unwrap_err();
        assert!(
            e.starts_with("field 'output': 'output__0' has rank 1"),
            "{e}"
        );
    }

    #[test]
    fn fp32_is_asked_for_whatever_the_cpu_and_the_config_adds_its_choices() {
        let plain = properties("f32", OpenVinoOptions::default(), 2);
        assert_eq!(
            plain,
            [
                ("INFERENCE_PRECISION_HINT", "f32".to_string()),
                ("ENABLE_CPU_PINNING", "NO".to_string()),
                ("PERFORMANCE_HINT", "LATENCY".to_string()),
                ("INFERENCE_NUM_THREADS", "2".to_string()),
            ]
        );
        let set = OpenVinoOptions {
            performance_hint: Some(PerformanceHint::Throughput),
            streams: Some(Streams::Count(2)),
            inference_threads: Some(0),
            compilation_threads: Some(1),
        };
        assert_eq!(
            properties("bf16", set, 0),
            [
                ("INFERENCE_PRECISION_HINT", "bf16".to_string()),
                ("ENABLE_CPU_PINNING", "NO".to_string()),
                ("PERFORMANCE_HINT", "THROUGHPUT".to_string()),
                ("NUM_STREAMS", "2".to_string()),
                ("COMPILATION_NUM_THREADS", "1".to_string()),
            ]
        );
    }
}
