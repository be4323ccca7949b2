//! An ensemble's config (raw image → preprocessor → classifier), and the check, once every
//! model is read, that its steps name loaded models that fit together.

use super::{exactly_one, invalid, unsupported, EnsembleSpec, ModelKind};
use crate::domain::ModelName;
use crate::repository::pb::{self, model_config::SchedulingChoice};
use crate::repository::{LoadFailure, RepositoryError, ScanResult};

pub(super) fn ensemble(model: &str, c: &pb::ModelConfig) -> Result<EnsembleSpec, RepositoryError> {
    use pb::model_ensembling::Step;
    let Some(SchedulingChoice::EnsembleScheduling(e)) = &c.scheduling_choice else {
        return Err(invalid(
            model,
            "ensemble_scheduling",
            "platform \"ensemble\" needs it",
        ));
    };
    let input = exactly_one(&c.input, || {
        invalid(model, "input", "an image ensemble has exactly one input")
    })?;
    let output = exactly_one(&c.output, || {
        invalid(model, "output", "an image ensemble has exactly one output")
    })?;
    let shape_msg = "visiongate runs ensembles of two steps: the image preprocessor \
                     (backend \"visiongate_image\") feeding a classifier (pytorch_libtorch, \
                     onnxruntime_onnx or torch_aoti)";
    let [pre, cls] = e.step.as_slice() else {
        return Err(unsupported(model, "ensemble_scheduling.step", shape_msg));
    };
    // A step's version, and the tensors its one input mapping and one output mapping name.
    let wiring = |i: usize, step: &Step| -> Result<(String, String), RepositoryError> {
        if step.model_version != -1 {
            return Err(unsupported(
                model,
                &format!("ensemble_scheduling.step[{i}].model_version"),
                "only -1 (the served version) is supported",
            ));
        }
        let shape = || unsupported(model, &format!("ensemble_scheduling.step[{i}]"), shape_msg);
        let (_, step_in) = exactly_one(&step.input_map, shape)?;
        let (_, step_out) = exactly_one(&step.output_map, shape)?;
        Ok((step_in.clone(), step_out.clone()))
    };
    let (pre_in, pre_out) = wiring(0, pre)?;
    let (cls_in, cls_out) = wiring(1, cls)?;
    if pre_in != input.name || cls_in != pre_out || cls_out != output.name {
        return Err(unsupported(
            model,
            "ensemble_scheduling.step (input_map/output_map)",
            format!(
                "{shape_msg}: the ensemble input must feed step 0, step 0's output step 1, \
                 and step 1's output the ensemble output"
            ),
        ));
    }
    Ok(EnsembleSpec {
        input_name: input.name.clone(),
        output_name: output.name.clone(),
        preprocessor: ModelName::new(pre.model_name.clone()),
        classifier: ModelName::new(cls.model_name.clone()),
    })
}

/// Ensembles are checked after every model is read: their steps must name loaded models
/// of the right kinds with matching tensor names and sizes.
pub(in crate::repository) fn check_ensembles(result: &mut ScanResult) {
    let mut failed = Vec::new();
    for (idx, m) in result.models.iter().enumerate() {
        let ModelKind::Ensemble(e) = &m.kind else {
            continue;
        };
        if let Err(error) = check_ensemble(m.name.as_str(), e, result) {
            failed.push((idx, error));
        }
    }
    for (idx, error) in failed.into_iter().rev() {
        let m = result.models.remove(idx);
        result.failures.push(LoadFailure {
            model: m.name.to_string(),
            error,
        });
    }
}

fn check_ensemble(
    model: &str,
    e: &EnsembleSpec,
    result: &ScanResult,
) -> Result<(), RepositoryError> {
    let find = |name: &ModelName| result.models.iter().find(|m| &m.name == name);
    let step_missing = |i: usize, name: &ModelName| {
        let why = match result.failures.iter().find(|f| f.model == name.as_str()) {
            Some(f) => format!("model '{name}' failed to load: {}", f.error),
            None => format!("no model '{name}' in the repository"),
        };
        invalid(
            model,
            &format!("ensemble_scheduling.step[{i}].model_name"),
            why,
        )
    };
    let pre = find(&e.preprocessor).ok_or_else(|| step_missing(0, &e.preprocessor))?;
    let cls = find(&e.classifier).ok_or_else(|| step_missing(1, &e.classifier))?;
    let ModelKind::Preprocessor(p) = &pre.kind else {
        return Err(unsupported(
            model,
            "ensemble_scheduling.step[0]",
            format!(
                "'{}' must be a visiongate_image preprocessor",
                e.preprocessor
            ),
        ));
    };
    let ModelKind::Classifier(c) = &cls.kind else {
        return Err(unsupported(
            model,
            "ensemble_scheduling.step[1]",
            format!("'{}' must be a pytorch_libtorch classifier", e.classifier),
        ));
    };
    if (p.width as usize, p.height as usize) != (c.width, c.height) {
        return Err(invalid(
            model,
            "ensemble_scheduling",
            format!(
                "preprocessor output {}x{} does not match classifier input {}x{}",
                p.width, p.height, c.width, c.height
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::test_support::{temp_repo, write};
    use crate::repository::{scan, Limits};

    #[test]
    fn ensemble_of_a_missing_step_fails_with_the_reason() {
        let root = temp_repo("ensemble");
        let ens = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/ensemble_model/config.pbtxt"),
        )
        .unwrap();
        write(&root, "ensemble_model/config.pbtxt", &ens);
        std::fs::create_dir_all(root.join("ensemble_model/1")).unwrap();
        let r = scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
        let msg = r.failures[0].error.to_string();
        assert!(msg.contains("no model 'preprocessor'"), "{msg}");
    }
}
