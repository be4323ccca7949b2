//! What the spec tests share: a scratch model repository and a classifier config.

use std::path::{Path, PathBuf};

use super::{ClassifierSpec, ModelKind};
use crate::repository::{scan, Limits, ScanResult};

pub(super) fn write(dir: &Path, rel: &str, text: &str) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

/// Why `model` failed its load in `r`.
pub(super) fn failure_of(r: &ScanResult, model: &str) -> String {
    r.failures
        .iter()
        .find(|f| f.model == model)
        .unwrap_or_else(|| panic!("{model} failed"))
        .error
        .to_string()
}

pub(super) fn temp_repo(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vg-repo-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub(super) const CLASSIFIER: &str = r#"
    platform: "pytorch_libtorch"
    max_batch_size: 4
    input [ { name: "input__0" data_type: TYPE_FP32 dims: [ 3, 8, 8 ] } ]
    output [ { name: "output__0" data_type: TYPE_FP32 dims: [ 2 ] label_filename: "labels.txt" } ]
    instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] } ]
    dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 500 }
"#;

pub(super) fn classifier_with(tag: &str, batching: &str) -> Result<ClassifierSpec, String> {
    let text = CLASSIFIER.replace(
        "dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 500 }",
        batching,
    );
    classifier_config(tag, &format!("{text}\nresponse_cache {{ enable: true }}"))
}

/// The classifier of config `text` (with labels and a model file for either platform), or
/// why it failed.
pub(super) fn classifier_config(tag: &str, text: &str) -> Result<ClassifierSpec, String> {
    let root = temp_repo(tag);
    write(&root, "m/config.pbtxt", text);
    write(&root, "m/labels.txt", "a\nb\n");
    write(&root, "m/1/model.pt", "x");
    write(&root, "m/1/model.onnx", "x");
    write(&root, "m/1/model.pt2", "x");
    write(&root, "m/1/model.xml", "x");
    write(&root, "m/1/model.bin", "x");
    let mut r = scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
    match r.failures.pop() {
        Some(f) => Err(f.error.to_string()),
        None => match r.models.pop().unwrap().kind {
            ModelKind::Classifier(c) => Ok(c),
            other => panic!("not a classifier: {other:?}"),
        },
    }
}
