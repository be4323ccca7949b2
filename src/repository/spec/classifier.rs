//! A classifier's config: its one FP32 image input and logits output, labels, model file,
//! warmup samples and precision (its scheduling is in `scheduling`), an ONNX model's
//! session options and an OpenVINO model's compile options.

use std::path::Path;
use std::sync::Arc;

use super::scheduling::{batching, instance_groups};
use super::{
    exactly_one, invalid, model_file, read_model_file, read_whole_model_file, unsupported,
    ClassifierSpec,
};
use crate::domain::{
    GraphLevel, ModelVersion, OnnxOptions, OpenVinoOptions, PerformanceHint, Precision, Runtime,
    Streams, WarmupData, WarmupSample,
};
use crate::repository::{pb, Limits, RepositoryError};

pub(super) fn classifier(
    dir: &Path,
    model: &str,
    c: &pb::ModelConfig,
    version: ModelVersion,
    limits: &Limits,
    runtime: Runtime,
) -> Result<ClassifierSpec, RepositoryError> {
    if c.max_batch_size < 1 {
        return Err(invalid(
            model,
            "max_batch_size",
            "must be at least 1 (dims then leave out the batch dimension)",
        ));
    }
    let input = exactly_one(&c.input, || {
        invalid(model, "input", "a classifier has exactly one input")
    })?;
    let output = exactly_one(&c.output, || {
        invalid(model, "output", "a classifier has exactly one output")
    })?;
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
    // `max_batch_size` is what the model takes (Triton's meaning), not memory reserved up
    // front: the batches the server forms hold at most what --max-batch-bytes holds of the
    // FP32 input (in u128: dims are i64), and larger requests are cut into such batches.
    let row_bytes = 3 * height as u128 * width as u128 * 4;
    if row_bytes > limits.batch_bytes as u128 {
        return Err(invalid(
            model,
            "input.dims",
            format!(
                "one row of FP32 [3, {height}, {width}] is {row_bytes} bytes; a batch may hold \
                 at most {} (--max-batch-bytes)",
                limits.batch_bytes
            ),
        ));
    }
    let fit = usize::try_from(limits.batch_bytes as u128 / row_bytes).unwrap_or(usize::MAX);
    let batch_rows = (c.max_batch_size as usize).min(fit);
    if output.dims[0] > MAX_CLASSES {
        return Err(invalid(
            model,
            "output.dims",
            format!(
                "{} classes; at most {MAX_CLASSES} are served",
                output.dims[0]
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
        runtime.default_file()
    } else {
        c.default_model_filename.as_str()
    };
    let version_dir = version.to_string();
    let Some(model_file) = model_file(
        dir,
        &version_dir,
        model,
        "default_model_filename",
        file_name,
    )?
    else {
        return Err(invalid(
            model,
            "default_model_filename",
            format!(
                "{} is missing; run `make setup` (it exports the bundled model) or put \
                 {} there",
                Path::new(model).join(version_dir).join(file_name).display(),
                runtime.format()
            ),
        ));
    };

    if matches!(runtime, Runtime::OpenVino(_)) {
        openvino_weights(dir, model, &model_file)?;
    }

    Ok(ClassifierSpec {
        model_file,
        runtime,
        max_batch_size: c.max_batch_size as usize,
        batch_rows,
        input_name: input.name.clone(),
        height: height as usize,
        width: width as usize,
        output_name: output.name.clone(),
        num_classes,
        labels,
        instance_groups: instance_groups(model, c)?,
        batching: batching(model, c, limits)?,
        response_cache: c.response_cache.as_ref().is_some_and(|r| r.enable),
        warmup: warmup(dir, model, c, input, limits)?,
        precision: precision(model, c, &runtime)?,
    })
}

/// Parameters of Triton's openvino backend that shape its static batch; visiongate's
/// OpenVINO models take any batch size up to the config's (the graph's batch dimension is
/// made dynamic), so they have nothing to do: the model loads, and the log says so.
const OPENVINO_BATCH_PARAMETERS: &[&str] = &[
    "ENABLE_BATCH_PADDING",
    "RESHAPE_IO_LAYERS",
    "SKIP_OV_DYNAMIC_BATCHSIZE",
];

/// An OpenVINO model's compile options, from the parameters Triton's openvino backend
/// documents: `PERFORMANCE_HINT`, `NUM_STREAMS`, `INFERENCE_NUM_THREADS`,
/// `COMPILATION_NUM_THREADS` (`HINT_BF16` is read with the precision). Values are read as
/// Triton's backend reads them, in any case.
pub(super) fn openvino_options(
    model: &str,
    c: &pb::ModelConfig,
) -> Result<OpenVinoOptions, RepositoryError> {
    let value = |key: &str| c.parameters.get(key).map(|p| p.string_value.trim());
    let bad = |key: &str, message: String| invalid(model, &format!("parameters[{key}]"), message);
    let threads = |key: &str| -> Result<Option<usize>, RepositoryError> {
        let Some(v) = value(key) else {
            return Ok(None);
        };
        match v.parse::<usize>() {
            Ok(n) if n <= MAX_SESSION_THREADS => Ok(Some(n)),
            _ => Err(bad(
                key,
                format!(
                    "'{v}' is not a thread count: 0 (OpenVINO's default) to {MAX_SESSION_THREADS}"
                ),
            )),
        }
    };
    let performance_hint = match value("PERFORMANCE_HINT") {
        None => None,
        Some(v) => Some(match v.to_ascii_uppercase().as_str() {
            "LATENCY" => PerformanceHint::Latency,
            "THROUGHPUT" => PerformanceHint::Throughput,
            "CUMULATIVE_THROUGHPUT" => PerformanceHint::CumulativeThroughput,
            _ => {
                return Err(bad(
                    "PERFORMANCE_HINT",
                    format!("'{v}' is not a hint: LATENCY, THROUGHPUT or CUMULATIVE_THROUGHPUT"),
                ))
            }
        }),
    };
    let streams = match value("NUM_STREAMS") {
        None => None,
        Some(v) if v.eq_ignore_ascii_case("auto") => Some(Streams::Auto),
        Some(v) if v.eq_ignore_ascii_case("numa") => Some(Streams::Numa),
        Some(v) => match v.parse::<u32>() {
            Ok(n) if (1..=MAX_SESSION_THREADS as u32).contains(&n) => Some(Streams::Count(n)),
            _ => {
                return Err(bad(
                    "NUM_STREAMS",
                    format!(
                        "'{v}' is not a stream count: AUTO, NUMA or 1 to {MAX_SESSION_THREADS}"
                    ),
                ))
            }
        },
    };
    if let Some(v) = value("TARGET_DEVICE") {
        if !v.eq_ignore_ascii_case("CPU") {
            return Err(unsupported(
                model,
                "parameters[TARGET_DEVICE]",
                format!("'{v}': visiongate runs OpenVINO on the CPU only; set CPU or leave it out"),
            ));
        }
    }
    if c.parameters.contains_key("CPU_EXTENSION_PATH") {
        return Err(unsupported(
            model,
            "parameters[CPU_EXTENSION_PATH]",
            "remove it: visiongate loads no custom OpenVINO operations",
        ));
    }
    for key in OPENVINO_BATCH_PARAMETERS {
        if c.parameters.contains_key(*key) {
            tracing::warn!(
                model,
                parameter = key,
                "OpenVINO parameter not needed: visiongate's OpenVINO models take every batch \
                 size up to max_batch_size"
            );
        }
    }
    Ok(OpenVinoOptions {
        performance_hint,
        streams,
        inference_threads: threads("INFERENCE_NUM_THREADS")?,
        compilation_threads: threads("COMPILATION_NUM_THREADS")?.filter(|&n| n > 0),
    })
}

/// An OpenVINO model is IR (`.xml`) or ONNX (`.onnx`), not whatever else OpenVINO's readers
/// take; an IR's weights are the `.bin` beside the `.xml` (where its symlinks lead), held
/// to the rules of every model file, and the engine names that file to OpenVINO.
fn openvino_weights(dir: &Path, model: &str, model_file: &Path) -> Result<(), RepositoryError> {
    let field = "default_model_filename";
    let extension = model_file.extension().and_then(|e| e.to_str());
    if !matches!(extension, Some("xml" | "onnx")) {
        return Err(unsupported(
            model,
            field,
            "OpenVINO models here are IR (.xml with its .bin) or ONNX (.onnx)",
        ));
    }
    if extension != Some("xml") {
        return Ok(());
    }
    // The model file is resolved (inside the model's directory): its .bin from there.
    let weights = model_file.with_extension("bin");
    let root = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let relative = weights.strip_prefix(&root).unwrap_or(&weights);
    if super::model_file(dir, "", model, field, &relative.to_string_lossy())?.is_none() {
        return Err(invalid(
            model,
            field,
            format!(
                "{} is missing: an OpenVINO IR's weights are the .bin beside its .xml",
                Path::new(model).join(relative).display()
            ),
        ));
    }
    Ok(())
}

/// The most threads a config may ask one ONNX Runtime session for, per pool.
const MAX_SESSION_THREADS: usize = 256;

/// Parameters of Triton's onnxruntime backend that visiongate's sessions do not apply: the
/// model loads, and the log says so.
const ONNX_PARAMETERS_NOT_APPLIED: &[&str] = &[
    "enable_mem_arena",
    "enable_mem_pattern",
    "memory.enable_memory_arena_shrinkage",
    "session.use_device_allocator_for_initializers",
    "cudnn_conv_algo_search",
    "gpu_mem_limit",
    "arena_extend_strategy",
    "do_copy_in_default_stream",
];

/// An ONNX model's session options, from the parameters Triton's onnxruntime backend
/// documents (`intra_op_thread_count`, `inter_op_thread_count`, `execution_mode`) and
/// `optimization { graph { level } }`.
pub(super) fn onnx_options(
    model: &str,
    c: &pb::ModelConfig,
) -> Result<OnnxOptions, RepositoryError> {
    let threads = |key: &str| -> Result<Option<usize>, RepositoryError> {
        let Some(p) = c.parameters.get(key) else {
            return Ok(None);
        };
        match p.string_value.trim().parse::<usize>() {
            Ok(n) if n <= MAX_SESSION_THREADS => Ok(Some(n)),
            _ => Err(invalid(
                model,
                &format!("parameters[{key}]"),
                format!(
                    "'{}' is not a thread count: 0 (ONNX Runtime's default) to \
                     {MAX_SESSION_THREADS}",
                    p.string_value
                ),
            )),
        }
    };
    let parallel = match c.parameters.get("execution_mode") {
        None => false,
        Some(p) => match p.string_value.trim() {
            "0" => false,
            "1" => true,
            other => {
                return Err(invalid(
                    model,
                    "parameters[execution_mode]",
                    format!("'{other}' is not an execution mode: 0 (sequential) or 1 (parallel)"),
                ))
            }
        },
    };
    for key in ONNX_PARAMETERS_NOT_APPLIED {
        if c.parameters.contains_key(*key) {
            tracing::warn!(
                model,
                parameter = key,
                "ONNX Runtime parameter not applied: visiongate's sessions keep their default"
            );
        }
    }
    let graph_level = match c.optimization.as_ref().and_then(|o| o.graph.as_ref()) {
        Some(g) if g.level == -1 => GraphLevel::Basic,
        Some(g) if g.level == 1 => GraphLevel::Extended,
        Some(g) if g.level == 2 => GraphLevel::Disabled,
        _ => GraphLevel::All,
    };
    Ok(OnnxOptions {
        intra_op_threads: threads("intra_op_thread_count")?,
        inter_op_threads: threads("inter_op_thread_count")?.filter(|&n| n > 0),
        parallel,
        graph_level,
    })
}

/// A classifier's `precision` parameter (FP32 when it has none); for OpenVINO, Triton's
/// `HINT_BF16: "yes"` asks for bf16 too.
fn precision(
    model: &str,
    c: &pb::ModelConfig,
    runtime: &Runtime,
) -> Result<Precision, RepositoryError> {
    let hint_bf16 = match c.parameters.get("HINT_BF16") {
        Some(p) if matches!(runtime, Runtime::OpenVino(_)) => {
            if !p.string_value.trim().eq_ignore_ascii_case("yes") {
                return Err(invalid(
                    model,
                    "parameters[HINT_BF16]",
                    format!(
                        "'{}' is not a value of it: \"yes\" (bf16), or leave it out (fp32)",
                        p.string_value
                    ),
                ));
            }
            true
        }
        _ => false,
    };
    let Some(p) = c.parameters.get("precision") else {
        return Ok(if hint_bf16 {
            Precision::Bf16
        } else {
            Precision::Fp32
        });
    };
    let precision = precision_parameter(model, p)?;
    if hint_bf16 && precision != Precision::Bf16 {
        return Err(invalid(
            model,
            "parameters[HINT_BF16]",
            format!("asks for bf16 and parameters[precision] for {precision}: keep one of them"),
        ));
    }
    Ok(precision)
}

fn precision_parameter(model: &str, p: &pb::ModelParameter) -> Result<Precision, RepositoryError> {
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
    limits: &Limits,
) -> Result<Vec<WarmupSample>, RepositoryError> {
    use pb::model_warmup::input::InputDataType;
    // The caller checked the dims: [3, height, width], a batch of them within the limit.
    let row: usize = input.dims.iter().product::<i64>() as usize;
    let mut samples = Vec::new();
    let mut rows: u64 = 0;
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
                let shown = Path::new(model).join("warmup").join(file);
                // Only its first row is read; what follows may be longer.
                let (bytes, _) = read_model_file(dir, "warmup", model, &field, file, row * 4)?;
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
        // Triton runs a sample with count 0 once.
        let count = w.count.max(1);
        rows += w.batch_size as u64 * count as u64;
        if rows > limits.warmup_rows {
            return Err(bad(format!(
                "the samples up to this one run {rows} rows on each instance (batch_size \
                 times count); at most {} are allowed (--max-warmup-rows)",
                limits.warmup_rows
            )));
        }
        if w.batch_size > 0 {
            samples.push(WarmupSample {
                name: w.name.clone(),
                batch_size: w.batch_size as usize,
                count: count as usize,
                data,
            });
        }
    }
    Ok(samples)
}

/// The most classes a classifier's output may have.
const MAX_CLASSES: i64 = 1 << 20;

/// The longest line a labels file may average (a label is a few words).
const MAX_LABEL_BYTES: usize = 1024;

fn read_labels(
    dir: &Path,
    model: &str,
    file: &str,
    num_classes: usize,
) -> Result<Vec<String>, RepositoryError> {
    let field = "output.label_filename";
    let shown = Path::new(model).join(file);
    let max = num_classes * MAX_LABEL_BYTES;
    let text = String::from_utf8(read_whole_model_file(dir, "", model, field, file, max)?)
        .map_err(|_| {
            invalid(
                model,
                field,
                format!("{} is not UTF-8 text", shown.display()),
            )
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

#[cfg(test)]
mod tests {
    use super::super::test_support::{classifier_config, classifier_with, CLASSIFIER};
    use super::*;

    fn onnx(tag: &str, extra: &str) -> Result<ClassifierSpec, String> {
        let text = CLASSIFIER.replace("pytorch_libtorch", "onnxruntime_onnx");
        classifier_config(tag, &format!("{text}\n{extra}"))
    }

    fn param(key: &str, value: &str) -> String {
        format!("parameters {{ key: \"{key}\" value: {{ string_value: \"{value}\" }} }}")
    }

    #[test]
    fn torch_aoti_packages_are_model_pt2_under_tritons_pytorch_backend() {
        for (tag, line) in [
            ("a0", "platform: \"torch_aoti\""),
            ("a1", "platform: \"torch_aoti\"\nbackend: \"pytorch\""),
        ] {
            let text = CLASSIFIER.replace("platform: \"pytorch_libtorch\"", line);
            let spec = classifier_config(tag, &text).unwrap();
            assert_eq!(spec.runtime, Runtime::TorchAoti);
            assert!(spec.model_file.ends_with("1/model.pt2"));
        }
        // Another backend with that platform is not Triton's pairing.
        let text = CLASSIFIER.replace(
            "platform: \"pytorch_libtorch\"",
            "platform: \"torch_aoti\"\nbackend: \"onnxruntime\"",
        );
        assert!(classifier_config("a2", &text).is_err());
    }

    #[test]
    fn onnx_models_take_the_onnxruntime_backends_session_options() {
        let plain = onnx("o0", "").unwrap();
        assert_eq!(plain.runtime, Runtime::Onnx(OnnxOptions::default()));
        assert!(plain.model_file.ends_with("1/model.onnx"));
        let backend =
            CLASSIFIER.replace("platform: \"pytorch_libtorch\"", "backend: \"onnxruntime\"");
        assert_eq!(
            classifier_config("o1", &backend).unwrap().runtime,
            plain.runtime
        );

        let set = format!(
            "{}\n{}\n{}\noptimization {{ graph {{ level: 1 }} }}",
            param("intra_op_thread_count", "0"),
            param("inter_op_thread_count", "2"),
            param("execution_mode", "1"),
        );
        let want = OnnxOptions {
            intra_op_threads: Some(0),
            inter_op_threads: Some(2),
            parallel: true,
            graph_level: GraphLevel::Extended,
        };
        assert_eq!(onnx("o2", &set).unwrap().runtime, Runtime::Onnx(want));
        for (level, want) in [
            (-1, GraphLevel::Basic),
            (2, GraphLevel::Disabled),
            (0, GraphLevel::All),
        ] {
            let line = format!("optimization {{ graph {{ level: {level} }} }}");
            let Runtime::Onnx(o) = onnx(&format!("l{level}"), &line).unwrap().runtime else {
                panic!("not onnx")
            };
            assert_eq!(o.graph_level, want, "level {level}");
        }
        // Parameters the sessions do not apply load (and are logged).
        assert!(onnx("o3", &param("enable_mem_arena", "0")).is_ok());
    }

    #[test]
    fn onnx_options_out_of_range_fail_naming_the_field() {
        let cases = [
            (
                param("intra_op_thread_count", "100000"),
                "parameters[intra_op_thread_count]",
            ),
            (
                param("inter_op_thread_count", "-1"),
                "parameters[inter_op_thread_count]",
            ),
            (param("execution_mode", "2"), "parameters[execution_mode]"),
            (
                "optimization { cuda { graphs: true } }".to_string(),
                "optimization",
            ),
        ];
        for (i, (line, field)) in cases.iter().enumerate() {
            let e = onnx(&format!("b{i}"), line).unwrap_err();
            assert!(e.contains(field), "{line}: {e}");
        }
        // A TorchScript model takes no optimization at all.
        let torch = format!("{CLASSIFIER}\noptimization {{ graph {{ level: 1 }} }}");
        let e = classifier_config("b9", &torch).unwrap_err();
        assert!(e.contains("optimization"), "{e}");
    }

    fn openvino(tag: &str, extra: &str) -> Result<ClassifierSpec, String> {
        let text = CLASSIFIER.replace("platform: \"pytorch_libtorch\"", "backend: \"openvino\"");
        classifier_config(tag, &format!("{text}\n{extra}"))
    }

    #[test]
    fn openvino_models_take_the_openvino_backends_parameters() {
        let plain = openvino("v0", "").unwrap();
        assert_eq!(plain.runtime, Runtime::OpenVino(OpenVinoOptions::default()));
        assert!(plain.model_file.ends_with("1/model.xml"));
        assert_eq!(plain.precision, Precision::Fp32);
        let onnx_file = openvino("v1", "default_model_filename: \"model.onnx\"").unwrap();
        assert!(onnx_file.model_file.ends_with("1/model.onnx"));

        let set = [
            param("PERFORMANCE_HINT", "throughput"),
            param("NUM_STREAMS", "2"),
            param("INFERENCE_NUM_THREADS", "4"),
            param("COMPILATION_NUM_THREADS", "1"),
            param("ENABLE_BATCH_PADDING", "YES"),
            param("TARGET_DEVICE", "CPU"),
        ]
        .join("\n");
        let want = OpenVinoOptions {
            performance_hint: Some(PerformanceHint::Throughput),
            streams: Some(Streams::Count(2)),
            inference_threads: Some(4),
            compilation_threads: Some(1),
        };
        assert_eq!(
            openvino("v2", &set).unwrap().runtime,
            Runtime::OpenVino(want)
        );
        let auto = openvino("v3", &param("NUM_STREAMS", "auto")).unwrap();
        let Runtime::OpenVino(o) = auto.runtime else {
            panic!("not OpenVINO")
        };
        assert_eq!(o.streams, Some(Streams::Auto));

        // Triton's HINT_BF16 asks for bf16, as the precision parameter does.
        let hint = openvino("v4", &param("HINT_BF16", "yes")).unwrap();
        assert_eq!(hint.precision, Precision::Bf16);
        let both = format!(
            "{}\n{}",
            param("HINT_BF16", "YES"),
            param("precision", "bf16")
        );
        assert_eq!(openvino("v5", &both).unwrap().precision, Precision::Bf16);
    }

    #[test]
    fn openvino_parameters_it_cannot_honour_fail_naming_the_field() {
        let cases = [
            (
                param("PERFORMANCE_HINT", "fast"),
                "parameters[PERFORMANCE_HINT]",
            ),
            (param("NUM_STREAMS", "0"), "parameters[NUM_STREAMS]"),
            (
                param("INFERENCE_NUM_THREADS", "-1"),
                "parameters[INFERENCE_NUM_THREADS]",
            ),
            (param("TARGET_DEVICE", "GPU"), "parameters[TARGET_DEVICE]"),
            (
                param("CPU_EXTENSION_PATH", "/x.so"),
                "parameters[CPU_EXTENSION_PATH]",
            ),
            (param("HINT_BF16", "no"), "parameters[HINT_BF16]"),
            (
                format!(
                    "{}\n{}",
                    param("HINT_BF16", "yes"),
                    param("precision", "fp32")
                ),
                "parameters[HINT_BF16]",
            ),
            (
                "default_model_filename: \"other.xml\"".to_string(),
                "default_model_filename",
            ),
            (
                "default_model_filename: \"model.pt\"".to_string(),
                "default_model_filename",
            ),
        ];
        for (i, (line, field)) in cases.iter().enumerate() {
            let e = openvino(&format!("w{i}"), line).unwrap_err();
            assert!(e.contains(field), "{line}: {e}");
        }
    }

    #[test]
    fn an_ir_without_its_weights_fails_naming_them() {
        use super::super::test_support::{failure_of, temp_repo, write};
        let root = temp_repo("ir-weights");
        let text = CLASSIFIER.replace("platform: \"pytorch_libtorch\"", "backend: \"openvino\"");
        write(&root, "m/config.pbtxt", &text);
        write(&root, "m/labels.txt", "a\nb\n");
        write(&root, "m/1/model.xml", "x");
        let r =
            crate::repository::scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
        let e = failure_of(&r, "m");
        assert!(e.contains("m/1/model.bin is missing"), "{e}");

        // The .bin beside where the .xml's link leads is the one read, held to the rules:
        // a link out of the model's directory is refused.
        let outside = temp_repo("ir-weights-outside");
        write(&outside, "secret.bin", "x");
        write(&root, "m/1/real/net.xml", "x");
        std::fs::remove_file(root.join("m/1/model.xml")).unwrap();
        std::os::unix::fs::symlink("real/net.xml", root.join("m/1/model.xml")).unwrap();
        std::os::unix::fs::symlink(outside.join("secret.bin"), root.join("m/1/real/net.bin"))
            .unwrap();
        write(&root, "m/1/model.bin", "x");
        let r =
            crate::repository::scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
        let e = failure_of(&r, "m");
        assert!(e.contains("leads out of the model's directory"), "{e}");
        std::fs::remove_file(root.join("m/1/real/net.bin")).unwrap();
        write(&root, "m/1/real/net.bin", "x");
        let r =
            crate::repository::scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
        assert!(
            r.failures.is_empty(),
            "{:?}",
            r.failures.first().map(|f| f.error.to_string())
        );
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
}
