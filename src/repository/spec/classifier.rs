//! A TorchScript classifier's config: its one FP32 image input and logits output, labels,
//! model file, warmup samples and precision (its scheduling is in `scheduling`).

use std::path::Path;
use std::sync::Arc;

use super::scheduling::{batching, instance_groups};
use super::{
    exactly_one, invalid, model_file, read_model_file, read_whole_model_file, unsupported,
    ClassifierSpec,
};
use crate::domain::{ModelVersion, Precision, WarmupData, WarmupSample};
use crate::repository::{pb, Limits, RepositoryError};

pub(super) fn classifier(
    dir: &Path,
    model: &str,
    c: &pb::ModelConfig,
    version: ModelVersion,
    limits: &Limits,
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
    // The input a batch of `max_batch_size` rows needs, in u128: dims are i64.
    let row_bytes = 3 * height as u128 * width as u128 * 4;
    let batch_bytes = row_bytes * c.max_batch_size as u128;
    if batch_bytes > limits.batch_bytes as u128 {
        return Err(invalid(
            model,
            "max_batch_size",
            format!(
                "a batch of {} rows of FP32 [3, {height}, {width}] is {batch_bytes} bytes; at \
                 most {} are allowed (--max-batch-bytes)",
                c.max_batch_size, limits.batch_bytes
            ),
        ));
    }
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
        "model.pt"
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
                "{} is missing; run `make setup` (it exports the bundled model) or put a \
                 TorchScript file there",
                Path::new(model).join(version_dir).join(file_name).display()
            ),
        ));
    };

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
        batching: batching(model, c, limits)?,
        response_cache: c.response_cache.as_ref().is_some_and(|r| r.enable),
        warmup: warmup(dir, model, c, input, limits)?,
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
    let text =
        String::from_utf8(read_whole_model_file(dir, model, field, file, max)?).map_err(|_| {
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
    use super::super::test_support::classifier_with;
    use super::*;

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
