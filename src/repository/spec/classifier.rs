//! A classifier's config: its one FP32 image input and logits output, labels, model file,
//! warmup samples and precision (its scheduling is in `scheduling`), and an ONNX model's
//! session options.

use std::path::Path;
use std::sync::Arc;

use super::scheduling::{batching, instance_groups};
use super::{
    exactly_one, invalid, model_file, read_model_file, read_whole_model_file, unsupported,
    ClassifierSpec,
};
use crate::domain::{
    GraphLevel, ModelVersion, OnnxOptions, Precision, Runtime, WarmupData, WarmupSample,
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
        precision: precision(model, c)?,
    })
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
