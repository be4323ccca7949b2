//! A careless or hostile model config, or model directory, cannot take the server down:
//! what a config asks for is checked against the limits before anything is allocated or
//! started, a model's files are read only when they are regular files inside its
//! directory, and queued rows are answered whatever the queue delay. The bundled ensemble
//! keeps serving throughout.
use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{solid_png, temp_repository, with_preferred, TestGateway};
use serde_json::Value;
use visiongate::settings::Config;
use visiongate::state::ControlMode;

const KEY_HEADER: &str = "x-admin-key";
const KEY: &str = "s3cret";

/// Explicit mode on `repo`, the ensemble loaded at start-up, load and unload behind a key.
fn explicit(repo: &Path) -> Config {
    let mut c = Config::for_tests();
    c.control.model_repository = vec![repo.to_path_buf()];
    c.control.model_control_mode = ControlMode::Explicit;
    c.control.load_models = vec!["ensemble_model".into()];
    c.access.repository_control_key = Some(format!("{KEY_HEADER}={KEY}"));
    c
}

/// A copy of the bundled classifier as model `name` of `repo`, its config edited by `edit`.
fn classifier_copy(repo: &Path, name: &str, edit: impl Fn(String) -> String) -> PathBuf {
    let dir = repo.join(name);
    std::fs::create_dir_all(dir.join("1")).unwrap();
    let text = std::fs::read_to_string(repo.join("classifier/config.pbtxt"))
        .unwrap()
        .replace("name: \"classifier\"", &format!("name: \"{name}\""));
    std::fs::write(dir.join("config.pbtxt"), edit(text)).unwrap();
    std::fs::copy(repo.join("classifier/labels.txt"), dir.join("labels.txt")).unwrap();
    std::fs::write(dir.join("1/model.pt"), "the fake engine does not read it").unwrap();
    dir
}

/// POST `/v2/repository/models/{model}/{action}` with the key: its status and body.
async fn control(gw: &TestGateway, model: &str, action: &str) -> (u16, Value) {
    let r = gw
        .client
        .post(gw.url(&format!("/v2/repository/models/{model}/{action}")))
        .header(KEY_HEADER, KEY)
        .json(&serde_json::json!({}))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{action} of {model} got no answer: {e}"));
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// The load of `model` fails at once, its error naming each of `words`.
async fn load_fails(gw: &TestGateway, model: &str, words: &[&str]) {
    let started = Instant::now();
    let (status, body) = control(gw, model, "load").await;
    assert_eq!(status, 400, "{model}: {body}");
    let error = body["error"].as_str().unwrap_or_default();
    for word in words {
        assert!(
            error.contains(word),
            "{model}: '{word}' missing in: {error}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{model}: refused only after {:?}",
        started.elapsed()
    );
}

/// The bundled ensemble answers one image.
async fn serves(gw: &TestGateway, after: &str) {
    let r = gw.predict("", &[("a.png".into(), solid_png(10))]).await;
    assert_eq!(r.status, 200, "after {after}: {}", r.json);
}

const WARMUP: &str = r#"
model_warmup [
  {
    name: "many"
    batch_size: BATCH
    count: COUNT
    inputs {
      key: "input__0"
      value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true }
    }
  }
]
"#;

fn warmup(batch: &str, count: &str) -> String {
    WARMUP.replace("BATCH", batch).replace("COUNT", count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configs_over_a_limit_fail_their_load_and_the_server_serves_on() {
    let repo = temp_repository("config-limits", |_, t| t.to_string());
    let max_batch = |t: String| t.replace("max_batch_size: 4096", "max_batch_size: 2147483647");
    classifier_copy(&repo, "warmup_batch", |t| {
        max_batch(t) + &warmup("2147483647", "1")
    });
    classifier_copy(&repo, "warmup_rows", |t| t + &warmup("64", "1000000"));
    classifier_copy(&repo, "row", |t| {
        t.replace("dims: [ 3, 224, 224 ]", "dims: [ 3, 10000, 10000 ]")
    });
    classifier_copy(&repo, "instances", |t| {
        t.replace(
            "count: 2\n    kind: KIND_GPU\n    gpus: [ 0, 1 ]",
            "count: 10000\n    kind: KIND_CPU",
        )
    });
    classifier_copy(&repo, "delay", |t| {
        t.replace(
            "max_queue_delay_microseconds: 2000",
            "max_queue_delay_microseconds: 9223372036854775808",
        )
    });
    let versions = classifier_copy(&repo, "versions", |t| t + "\nversion_policy: { all {} }\n");
    for v in 2..=1000 {
        std::fs::create_dir(versions.join(v.to_string())).unwrap();
    }
    let gw = TestGateway::start_fake(explicit(&repo), Duration::ZERO).await;
    serves(&gw, "start-up").await;

    let cases: [(&str, &[&str]); 6] = [
        (
            "row",
            &[
                "input.dims",
                "one row of FP32 [3, 10000, 10000] is 1200000000 bytes",
                "--max-batch-bytes",
            ],
        ),
        (
            "warmup_batch",
            &["model_warmup[0]", "2147483647 rows", "--max-warmup-rows"],
        ),
        (
            "warmup_rows",
            &["model_warmup[0]", "64000000 rows", "--max-warmup-rows"],
        ),
        (
            "instances",
            &["instance_group", "10000 instances", "--max-model-instances"],
        ),
        (
            "delay",
            &[
                "max_queue_delay_microseconds",
                "9223372036854775808",
                "--max-queue-delay-secs 10",
            ],
        ),
        (
            "versions",
            &["version_policy", "1000 versions", "--max-model-versions"],
        ),
    ];
    for (model, words) in cases {
        load_fails(&gw, model, words).await;
        serves(&gw, model).await;
    }
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_of_all_models_together_are_bounded() {
    let repo = temp_repository("instance-total", |_, t| t.to_string());
    classifier_copy(&repo, "second", |t| t);
    let mut config = explicit(&repo);
    // The bundled classifier runs 2 instances here (its GPU group falls back to the CPU).
    config.control.max_instances = 3;
    let gw = TestGateway::start_fake(config, Duration::ZERO).await;
    serves(&gw, "start-up").await;
    load_fails(&gw, "second", &["2 running", "--max-instances"]).await;
    serves(&gw, "the refused load").await;

    // Once the classifier's instances have ended, there is room for the other's.
    assert_eq!(control(&gw, "ensemble_model", "unload").await.0, 200);
    assert_eq!(control(&gw, "classifier", "unload").await.0, 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = control(&gw, "second", "load").await;
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "second never loaded: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_files_fail_their_load_at_once_and_hold_no_other() {
    let repo = temp_repository("special-files", |_, t| t.to_string());
    let fifo = classifier_copy(&repo, "fifo", |t| t);
    std::fs::remove_file(fifo.join("labels.txt")).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(fifo.join("labels.txt"))
        .status()
        .unwrap();
    assert!(made.success());
    // A labels file outside the model's directory that would otherwise be valid.
    let outside = repo.join("outside.txt");
    std::fs::copy(repo.join("classifier/labels.txt"), &outside).unwrap();
    let linked = classifier_copy(&repo, "linked", |t| t);
    std::fs::remove_file(linked.join("labels.txt")).unwrap();
    std::os::unix::fs::symlink(&outside, linked.join("labels.txt")).unwrap();
    // Warm-up data linked to a file outside: its size must not show.
    let sample = classifier_copy(&repo, "sample", |t| {
        t + &WARMUP
            .replace("BATCH", "1")
            .replace("COUNT", "1")
            .replace("zero_data: true", "input_data_file: \"row\"")
    });
    std::fs::create_dir(sample.join("warmup")).unwrap();
    let secret = repo.join("secret.bin");
    std::fs::write(&secret, vec![7u8; 12345]).unwrap();
    std::os::unix::fs::symlink(&secret, sample.join("warmup/row")).unwrap();

    let gw = TestGateway::start_fake(explicit(&repo), Duration::ZERO).await;
    // Each load reads the whole repository, so a FIFO there once held every load.
    let ((), reload) = tokio::join!(
        load_fails(&gw, "fifo", &["labels.txt", "not a regular file"]),
        control(&gw, "classifier", "load"),
    );
    assert_eq!(reload.0, 200, "{}", reload.1);
    load_fails(
        &gw,
        "linked",
        &["labels.txt", "out of the model's directory"],
    )
    .await;
    let (status, body) = control(&gw, "sample", "load").await;
    assert_eq!(status, 400, "{body}");
    let error = body["error"].as_str().unwrap_or_default();
    assert!(error.contains("out of the model's directory"), "{error}");
    assert!(
        !error.contains("12345"),
        "the outside file's size shows: {error}"
    );
    serves(&gw, "the special files").await;
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_rows_are_answered_whatever_the_queue_delay() {
    // Rows wait up to the longest delay allowed for a batch of 4 that never fills.
    let repo = temp_repository("long-delay", |m, t| {
        with_preferred(m, t, "[ 4 ]").replace(
            "max_queue_delay_microseconds: 2000",
            "max_queue_delay_microseconds: 10000000",
        )
    });
    let gw = std::sync::Arc::new(TestGateway::start_fake(explicit(&repo), Duration::ZERO).await);
    let pending = || {
        gw.metric(
            "nv_inference_pending_request_count",
            &["model=\"classifier\""],
        )
    };

    // A client that leaves: its queued row is dropped at once, not when the delay ends.
    let leaving = common::spawn_predict(&gw, "", 10);
    gw.wait_for_queued(1).await;
    leaving.abort();
    let _ = leaving.await;
    let left = Instant::now();
    while pending().await != 0.0 {
        assert!(
            left.elapsed() < Duration::from_secs(5),
            "the row of a client that left is still queued"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Unloaded with a row queued: the row runs at once and is answered.
    let waiting = common::spawn_predict(&gw, "", 20);
    gw.wait_for_queued(1).await;
    let unloaded = Instant::now();
    assert_eq!(control(&gw, "classifier", "unload").await.0, 200);
    let reply = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the queued request is answered once the model is unloaded")
        .unwrap();
    assert_eq!(reply.status, 200, "{}", reply.json);
    assert!(unloaded.elapsed() < Duration::from_secs(5));
    common::stop_shared(gw).await;
}
