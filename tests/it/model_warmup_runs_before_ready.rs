//! A classifier's `model_warmup` samples (Triton's) run on each instance before the model
//! is ready: zero, random and file data; the first failing sample fails the load, named.
use crate::common;

use std::time::Duration;

use common::{temp_repository, TestGateway};
use visiongate::engine::FakeFaults;
use visiongate::settings::Config;
use visiongate::Gateway;

const WARMUP: &str = r#"
model_warmup [
  {
    name: "zeros"
    batch_size: 4
    inputs { key: "input__0" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true } }
    count: 2
  },
  {
    name: "noise"
    batch_size: 2
    inputs { key: "input__0" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] random_data: true } }
  },
  {
    name: "sevens"
    batch_size: 3
    inputs { key: "input__0" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] input_data_file: "sevens.bin" } }
  },
  {
    name: "skipped"
    batch_size: 0
    inputs { key: "input__0" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true } }
  }
]
"#;

/// The bundled repository with the samples above in the classifier's config and a row of
/// 7.0 in `classifier/warmup/sevens.bin`.
fn repository(tag: &str) -> std::path::PathBuf {
    let repo = temp_repository(tag, |model, text| {
        if model == "classifier" {
            format!("{text}\n{WARMUP}")
        } else {
            text.to_string()
        }
    });
    let warmup = repo.join("classifier/warmup");
    std::fs::create_dir_all(&warmup).unwrap();
    let row: Vec<u8> = std::iter::repeat_n(7.0f32.to_le_bytes(), 3 * 224 * 224)
        .flatten()
        .collect();
    std::fs::write(warmup.join("sevens.bin"), row).unwrap();
    repo
}

async fn start(repo: std::path::PathBuf, faults: FakeFaults) -> Gateway {
    let mut config = Config::for_tests();
    config.control.model_repository = vec![repo];
    common::start_fake_gateway(config, faults).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_classifier_with_model_warmup_loads_and_serves() {
    let mut config = Config::for_tests();
    config.control.model_repository = vec![repository("warmup-ok")];
    let gw = TestGateway::start_fake(config, Duration::ZERO).await;
    let reply = gw.predict("", &[common::photo("small", "Aqua.jpg")]).await;
    assert_eq!(reply.status, 200, "{}", reply.json);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sample_larger_than_a_batch_may_hold_runs_as_several_batches() {
    // --max-batch-bytes at four rows: the 'zeros' sample (4 rows, twice) runs as is, and a
    // sample of 10 rows (within max_batch_size 4096) runs as batches of 4, 4 and 2. The
    // engine fails any batch of more than four rows: none reaches it, warm-up or not.
    let repo = temp_repository("warmup-cut", |model, text| {
        if model == "classifier" {
            format!(
                "{text}\n{}",
                WARMUP
                    .replace("batch_size: 2\n", "batch_size: 10\n")
                    .replace("input_data_file: \"sevens.bin\"", "zero_data: true")
            )
        } else {
            text.to_string()
        }
    });
    let mut config = Config::for_tests();
    config.control.model_repository = vec![repo];
    config.control.max_batch_bytes = 4 * 3 * 224 * 224 * 4;
    let gateway = common::start_fake_gateway(
        config,
        FakeFaults {
            most_rows: Some(4),
            ..Default::default()
        },
    )
    .await;
    let failures = gateway.wait_ready().await;
    assert!(failures.is_empty(), "{failures:?}");
    assert!(gateway.state.is_ready());
    gateway.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_first_failing_sample_fails_the_load_by_name() {
    // The engine fails on rows that start with 7.0: the file sample's.
    let gateway = start(
        repository("warmup-file"),
        FakeFaults {
            fail_on_first_byte: Some(7),
            ..Default::default()
        },
    )
    .await;
    let failures = gateway.wait_ready().await;
    assert!(
        failures
            .iter()
            .any(|f| f.contains("classifier") && f.contains("warmup sample 'sevens'")),
        "{failures:?}"
    );
    assert!(!gateway.state.is_ready());
    gateway.stop().await;

    // Rows of zeros: the first sample's.
    let gateway = start(
        repository("warmup-zero"),
        FakeFaults {
            fail_on_first_byte: Some(0),
            ..Default::default()
        },
    )
    .await;
    let failures = gateway.wait_ready().await;
    assert!(
        failures.iter().any(|f| f.contains("warmup sample 'zeros'")),
        "{failures:?}"
    );
    gateway.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn samples_that_do_not_fit_the_model_fail_its_load_at_once() {
    for (sample, says) in [
        (
            r#"model_warmup [{ name: "big" batch_size: 4097 inputs { key: "input__0" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true } } }]"#,
            "over max_batch_size",
        ),
        (
            r#"model_warmup [{ name: "dims" batch_size: 1 inputs { key: "input__0" value: { data_type: TYPE_FP32 dims: [ 3, 8, 8 ] zero_data: true } } }]"#,
            "must be TYPE_FP32 with dims [3, 224, 224]",
        ),
        (
            r#"model_warmup [{ name: "other" batch_size: 1 inputs { key: "image" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true } } }]"#,
            "'image' is not an input of the model",
        ),
        (
            r#"model_warmup [{ name: "nodata" batch_size: 1 inputs { key: "input__0" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } } }]"#,
            "needs zero_data, random_data or input_data_file",
        ),
        (
            r#"model_warmup [{ name: "escape" batch_size: 1 inputs { key: "input__0" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] input_data_file: "../config.pbtxt" } } }]"#,
            "not a file inside the model's directory",
        ),
        (
            r#"model_warmup [{ name: "short" batch_size: 1 inputs { key: "input__0" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] input_data_file: "short.bin" } } }]"#,
            "one row of FP32 [3, 224, 224] needs 602112",
        ),
    ] {
        let repo = temp_repository("warmup-bad", |model, text| {
            if model == "classifier" {
                format!("{text}\n{sample}")
            } else {
                text.to_string()
            }
        });
        std::fs::create_dir_all(repo.join("classifier/warmup")).unwrap();
        std::fs::write(repo.join("classifier/warmup/short.bin"), [0u8; 100]).unwrap();
        let gateway = start(repo, FakeFaults::default()).await;
        let failures = gateway.startup_failures().await;
        assert!(
            failures.iter().any(|f| f.contains(says)),
            "{says}: {failures:?}"
        );
        gateway.stop().await;
    }

    // Triton's rule: not on an ensemble.
    let repo = temp_repository("warmup-ensemble", |model, text| {
        if model == "ensemble_model" {
            format!("{text}\nmodel_warmup [{{ name: \"e\" batch_size: 1 }}]")
        } else {
            text.to_string()
        }
    });
    let gateway = start(repo, FakeFaults::default()).await;
    let failures = gateway.startup_failures().await;
    assert!(
        failures
            .iter()
            .any(|f| f.contains("ensemble_model")
                && f.contains("cannot be specified for an ensemble")),
        "{failures:?}"
    );
    gateway.stop().await;
}
