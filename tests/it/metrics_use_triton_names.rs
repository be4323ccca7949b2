//! Prometheus metrics on their own port, with Triton's names and labels.
use crate::common;

use common::{photo, TestGateway};
use visiongate::settings::Config;

#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_requests_images_batches_and_time() {
    let gw = TestGateway::start(Config::for_tests()).await;
    let files = [
        photo("small", "sk_chelsea.jpg"),
        ("bad.jpg".to_string(), b"nope".to_vec()),
        photo("small", "sk_coffee.jpg"),
    ];
    let reply = gw.predict("", &files).await;
    assert_eq!(reply.status, 200);
    let text = gw.metrics_text().await;
    let m = |name: &str, labels: &[&str]| common::metric_sum(&text, name, labels);
    let cls = "model=\"classifier\",version=\"1\"";
    assert_eq!(m("nv_inference_request_success", &[cls]), 1.0, "{text}");
    assert_eq!(
        m("nv_inference_count", &[cls]),
        2.0,
        "the bad file is not an inference"
    );
    let execs = m("nv_inference_exec_count", &[cls]);
    assert!(
        (1.0..=2.0).contains(&execs),
        "{execs} executions for 2 images"
    );
    assert_eq!(m("nv_inference_pending_request_count", &[cls]), 0.0);
    for name in [
        "nv_inference_request_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
    ] {
        assert!(m(name, &[cls]) > 0.0, "{name} is zero");
    }
    assert!(text.contains("nv_inference_queue_duration_us{model=\"classifier\",version=\"1\"}"));
    assert!(text.contains(
        "nv_inference_request_failure{model=\"classifier\",reason=\"REJECTED\",version=\"1\"} 0"
    ));
    assert_eq!(
        m("visiongate_decode_seconds_count", &[]),
        3.0,
        "three files went to the decoder"
    );
    assert_eq!(
        m("visiongate_batch_size_sum", &["model=\"classifier\""]),
        2.0
    );
    gw.stop().await;
}
