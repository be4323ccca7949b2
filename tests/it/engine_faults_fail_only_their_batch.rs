//! Engine faults, ordered from the fake engine: an engine error or a panic fails only the
//! rows of its batch (`/predict` answers those files `model_failed` and the others as
//! usual; a KServe request gets an error naming the model), a panicked instance is
//! restarted with its model, and while every instance is down, readiness, the model's
//! own readiness and the repository index say so; once an instance is back, it serves.
use crate::common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{solid_png, temp_repository, with_preferred, TestGateway};
use visiongate::engine::FakeFaults;
use visiongate::grpc::pb::grpc_inference_service_client::GrpcInferenceServiceClient;
use visiongate::settings::Config;
use visiongate::EngineChoice;

const FAIL: u8 = 251;
const PANIC: u8 = 250;
const LOSE_ROW: u8 = 249;

fn files(reds: &[u8]) -> Vec<(String, Vec<u8>)> {
    reds.iter()
        .map(|&red| (format!("{red}.png"), solid_png(red)))
        .collect()
}

async fn status(gw: &TestGateway, path: &str) -> u16 {
    gw.client
        .get(gw.url(path))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// The classifier's entry in the repository index: its state and reason.
async fn classifier_in_index(gw: &TestGateway) -> (String, String) {
    let index = gw
        .json(gw.client.post(gw.url("/v2/repository/index")))
        .await;
    let entry = index
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "classifier")
        .expect("the classifier is listed")
        .clone();
    let text = |k: &str| entry[k].as_str().unwrap_or_default().to_string();
    (text("state"), text("reason"))
}

#[tokio::test(flavor = "multi_thread")]
async fn engine_faults_fail_only_their_batch_and_instances_restart() {
    let faults = Arc::new(FakeFaults {
        fail_on_first_byte: Some(FAIL),
        panic_on_first_byte: Some(PANIC),
        lose_row_on_first_byte: Some(LOSE_ROW),
        ..Default::default()
    });
    let mut config = Config::for_tests();
    // One row per batch: each file's fate is its own.
    config.control.model_repository = vec![temp_repository("faults", |m, t| {
        with_preferred(m, t, "[ 1 ]")
    })];
    let gw = TestGateway::start_with(
        config,
        EngineChoice::Fake {
            num_classes: 1000,
            latency: Duration::from_millis(5),
            faults: faults.clone(),
        },
    )
    .await;

    // /predict: the failed files get their own error, the others their class.
    let r = gw.predict("", &files(&[7, FAIL, 9, PANIC, 11])).await;
    assert_eq!(r.status, 200, "{}", r.json);
    let results = r.results();
    for (i, red) in [(0, 7), (2, 9), (4, 11)] {
        assert_eq!(results[i]["class_id"], red, "{}", r.json);
    }
    for i in [1, 3] {
        assert_eq!(results[i]["error"]["code"], "model_failed", "{}", r.json);
        let message = results[i]["error"]["message"].as_str().unwrap();
        assert!(message.contains("'classifier'"), "{message}");
        assert!(
            !message.contains("injected"),
            "the engine's words stay in the log"
        );
    }
    assert_eq!(
        gw.metric("nv_inference_request_failure", &["classifier", "BACKEND"])
            .await,
        1.0
    );

    // KServe: the request fails, naming the model.
    let grpc_addr = gw.gateway.as_ref().unwrap().grpc_addr.expect("listening");
    let mut grpc = GrpcInferenceServiceClient::connect(format!("http://{grpc_addr}"))
        .await
        .unwrap();
    let status_of = grpc
        .model_infer(common::ensemble_request(solid_png(FAIL)))
        .await
        .expect_err("a failed batch fails the request");
    assert_eq!(status_of.code(), tonic::Code::Internal);
    assert!(
        status_of.message().contains("'classifier'"),
        "{status_of:?}"
    );

    // An engine that answers a row short fails its batch: an error entry, not a panic.
    let r = gw.predict("", &files(&[7, LOSE_ROW, 9])).await;
    assert_eq!(r.status, 200, "{}", r.json);
    let results = r.results();
    assert_eq!(results[0]["class_id"], 7, "{}", r.json);
    assert_eq!(results[1]["error"]["code"], "model_failed", "{}", r.json);
    assert_eq!(results[2]["class_id"], 9, "{}", r.json);
    let status_of = grpc
        .model_infer(common::ensemble_request(solid_png(LOSE_ROW)))
        .await
        .expect_err("a batch short of a row fails the request");
    assert_eq!(status_of.code(), tonic::Code::Internal);

    // Both instances panic while no new engine can be loaded: each panic fails its file,
    // then the model is down, and every view of it says so. (The instance that panicked
    // above restarts after a pause: both are up first.)
    gw.wait_for_metric("visiongate_model_instances_up", &["classifier"], 2.0)
        .await;
    faults.refuse_loads.store(true, Ordering::SeqCst);
    for up in [1.0, 0.0] {
        let r = gw.predict("", &files(&[PANIC])).await;
        assert_eq!(r.status, 200, "{}", r.json);
        assert_eq!(
            r.results()[0]["error"]["code"],
            "model_failed",
            "{}",
            r.json
        );
        gw.wait_for_metric("visiongate_model_instances_up", &["classifier"], up)
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while status(&gw, "/v2/health/ready").await != 503 {
        assert!(
            Instant::now() < deadline,
            "still ready with every instance down"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_ne!(status(&gw, "/v2/models/classifier/ready").await, 200);
    assert_ne!(status(&gw, "/v2/models/ensemble_model/ready").await, 200);
    let (state, reason) = classifier_in_index(&gw).await;
    assert_eq!(state, "UNAVAILABLE");
    assert!(reason.contains("every instance is down"), "{reason}");
    // Refused as down (not as loading), and counted so.
    let down = gw
        .metric(
            "nv_inference_request_failure",
            &["classifier", "MODEL_DOWN"],
        )
        .await;
    let r = gw.predict("", &files(&[7])).await;
    assert_eq!(r.status, 503, "{}", r.json);
    assert_eq!(r.json["code"], "model_down");
    assert!(
        r.json["error"].as_str().unwrap().contains("restarting"),
        "{}",
        r.json
    );
    assert_eq!(
        gw.metric(
            "nv_inference_request_failure",
            &["classifier", "MODEL_DOWN"]
        )
        .await,
        down + 1.0
    );

    // Loads work again: the instances come back at their next try (they wait 1 s, then
    // 2 s, 4 s... between tries) and serve.
    faults.refuse_loads.store(false, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(20);
    while status(&gw, "/v2/health/ready").await != 200 {
        assert!(Instant::now() < deadline, "the instances did not come back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(classifier_in_index(&gw).await.0, "READY");
    let r = gw.predict("", &files(&[7, 9, 11, 13])).await;
    assert_eq!(r.status, 200, "{}", r.json);
    for (result, red) in r.results().iter().zip([7, 9, 11, 13]) {
        assert_eq!(result["class_id"], red, "{}", r.json);
    }
    gw.stop().await;
}
