//! The built-in image preprocessor's config (backend "visiongate_image"): encoded bytes in,
//! an FP32 `[3, height, width]` image out, resized and normalized as its parameters say.

use super::{exactly_one, invalid, unsupported, PreprocessorSpec, ResizeMode};
use crate::domain::{Normalize, ResizeFilter};
use crate::repository::{pb, Limits, RepositoryError};

pub(super) fn preprocessor(
    model: &str,
    c: &pb::ModelConfig,
    limits: &Limits,
) -> Result<PreprocessorSpec, RepositoryError> {
    let input = exactly_one(&c.input, || {
        invalid(
            model,
            "input",
            "the image preprocessor has exactly one input",
        )
    })?;
    let output = exactly_one(&c.output, || {
        invalid(
            model,
            "output",
            "the image preprocessor has exactly one output",
        )
    })?;
    if input.data_type() != pb::DataType::TypeUint8 || input.dims != [-1] {
        return Err(invalid(
            model,
            "input",
            "must be TYPE_UINT8 with dims [-1] (encoded bytes)",
        ));
    }
    let param = |key: &str| c.parameters.get(key).map(|p| p.string_value.trim());
    let number = |key: &str, default: u32| -> Result<u32, RepositoryError> {
        match param(key) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| {
                invalid(
                    model,
                    &format!("parameters[{key}]"),
                    format!("'{v}' is not a whole number"),
                )
            }),
        }
    };
    let triple = |key: &str, default: f32| -> Result<[f32; 3], RepositoryError> {
        let Some(v) = param(key) else {
            return Ok([default; 3]);
        };
        let parts: Vec<f32> = v
            .split(',')
            .map(|s| s.trim().parse::<f32>())
            .collect::<Result<_, _>>()
            .map_err(|_| {
                invalid(
                    model,
                    &format!("parameters[{key}]"),
                    format!("'{v}' is not 3 numbers"),
                )
            })?;
        <[f32; 3]>::try_from(parts).map_err(|_| {
            invalid(
                model,
                &format!("parameters[{key}]"),
                "needs exactly 3 comma-separated numbers (R,G,B)",
            )
        })
    };
    let width = number("width", 224)?;
    let height = number("height", 224)?;
    if width == 0 || height == 0 {
        return Err(invalid(
            model,
            "parameters[width/height]",
            "must be positive",
        ));
    }
    let image_bytes = 3 * width as u64 * height as u64 * 4;
    if image_bytes > limits.batch_bytes {
        return Err(invalid(
            model,
            "parameters[width/height]",
            format!(
                "an FP32 [3, {height}, {width}] image is {image_bytes} bytes; at most {} are \
                 allowed in a batch (--max-batch-bytes)",
                limits.batch_bytes
            ),
        ));
    }
    let resize = match param("resize_mode").unwrap_or("stretch") {
        "stretch" => ResizeMode::Stretch,
        other => {
            return Err(unsupported(
                model,
                "parameters[resize_mode]",
                format!("'{other}' is not implemented; use \"stretch\""),
            ))
        }
    };
    let filter = match param("resize_filter").unwrap_or("bilinear") {
        "bilinear" => ResizeFilter::Bilinear,
        "area" => ResizeFilter::Area,
        "linear" => ResizeFilter::Linear,
        other => {
            return Err(invalid(
                model,
                "parameters[resize_filter]",
                format!(
                    "'{other}' is not a filter: bilinear (antialiased, as Pillow and \
                     torchvision), area (OpenCV's INTER_AREA) or linear (OpenCV's INTER_LINEAR)"
                ),
            ))
        }
    };
    let normalize = Normalize {
        mean: triple("mean", 0.0)?,
        std: triple("std", 1.0)?,
    };
    if normalize.std.iter().any(|&s| s <= 0.0) {
        return Err(invalid(model, "parameters[std]", "must be positive"));
    }
    let dct = number("dct_scaling_min_side", width.max(height))?;
    if dct != 0 && dct < width.max(height) {
        return Err(invalid(
            model,
            "parameters[dct_scaling_min_side]",
            format!(
                "must be 0 (off) or at least the output size {}",
                width.max(height)
            ),
        ));
    }
    let expected = [3, height as i64, width as i64];
    if output.data_type() != pb::DataType::TypeFp32 || output.dims != expected {
        return Err(invalid(
            model,
            "output",
            format!("must be TYPE_FP32 with dims {expected:?} (from the width/height parameters)"),
        ));
    }
    // Its rows and their FP32 output are held at once (a KServe request to the model
    // itself, which cannot be cut): at most max_batch_size (as Triton), and what fits.
    let batch_rows = usize::try_from(c.max_batch_size.max(1))
        .unwrap_or(usize::MAX)
        .min(usize::try_from(limits.batch_bytes / image_bytes).unwrap_or(usize::MAX));
    Ok(PreprocessorSpec {
        input_name: input.name.clone(),
        output_name: output.name.clone(),
        width,
        height,
        batch_rows,
        resize,
        filter,
        normalize,
        dct_scaling_min_side: dct,
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::test_support::{failure_of, temp_repo, write};
    use super::super::ModelKind;
    use super::*;
    use crate::repository::{scan, Limits};

    #[test]
    fn preprocessor_parameters_are_checked() {
        let root = temp_repo("pre");
        let pre = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/preprocessor/config.pbtxt"),
        )
        .unwrap();
        write(
            &root,
            "p1/config.pbtxt",
            &pre.replace("0.502,0.502,0.502", "0.5,0.5")
                .replace("name: \"preprocessor\"", ""),
        );
        write(
            &root,
            "p2/config.pbtxt",
            &pre.replace("\"stretch\"", "\"letterbox\"")
                .replace("name: \"preprocessor\"", ""),
        );
        let filter = |f: &str| {
            let line = format!(
                "parameters {{ key: \"resize_filter\" value: {{ string_value: \"{f}\" }} }}"
            );
            format!("{}\n{line}\n", pre.replace("name: \"preprocessor\"", ""))
        };
        write(&root, "p3/config.pbtxt", &filter("lanczos"));
        write(&root, "p4/config.pbtxt", &filter("area"));
        for m in ["p1", "p2", "p3", "p4"] {
            std::fs::create_dir_all(root.join(m).join("1")).unwrap();
        }
        let r = scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
        let msg = |m: &str| failure_of(&r, m);
        assert!(msg("p1").contains("parameters[std]"), "{}", msg("p1"));
        assert!(msg("p2").contains("letterbox"), "{}", msg("p2"));
        assert!(
            msg("p3").contains("parameters[resize_filter]"),
            "{}",
            msg("p3")
        );
        let area = r.models.iter().find(|m| m.name.as_str() == "p4").unwrap();
        let ModelKind::Preprocessor(p) = &area.kind else {
            panic!("p4 is a preprocessor")
        };
        assert_eq!(p.filter, ResizeFilter::Area);
    }
}
