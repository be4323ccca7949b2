//! A request still queued when its timeout passes is answered with a deadline error
//! (Triton's queue policy, REJECT); requests without a timeout keep waiting and run.
use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::TestGateway;
use common::{spawn_predict, stop_shared, temp_repository, with_batching, with_preferred};
use visiongate::settings::Config;

#[tokio::test(flavor = "multi_thread")]
async fn a_request_past_its_queue_timeout_gets_504_and_the_others_run() {
    let mut config = Config::for_tests();
    config.control.model_repository = vec![temp_repository("timeout", |m, t| {
        with_batching(
            m,
            &with_preferred(m, t, "[ 1 ]"),
            "default_queue_policy { allow_timeout_override: true }",
        )
    })];
    let (gw, faults) = TestGateway::start_gated(config).await;
    let (gw, gate) = (Arc::new(gw), &faults.gate);
    // Two requests hold both instances until the gate opens.
    let busy = [spawn_predict(&gw, "", 1), spawn_predict(&gw, "", 2)];
    gate.held(2).await;

    // Without a timeout: waits for an instance, then runs.
    let patient = spawn_predict(&gw, "", 3);
    gw.wait_for_queued(1).await;
    let started = Instant::now();
    let r = gw
        .predict(
            "?timeout_us=200000",
            &[("4.png".into(), common::solid_png(4))],
        )
        .await;
    let waited = started.elapsed();
    assert_eq!(r.status, 504, "{}", r.json);
    assert_eq!(r.json["code"], "deadline_exceeded");
    let msg = r.json["error"].as_str().unwrap();
    assert!(
        msg.contains("timeout expired") && msg.contains("'classifier'") && msg.contains("200 ms"),
        "{msg}"
    );
    assert!(
        waited >= Duration::from_millis(200),
        "answered after {waited:?}, before its timeout"
    );
    gate.open();

    for (i, task) in busy.into_iter().chain([patient]).enumerate() {
        let r = task.await.unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.json);
        assert_eq!(r.results()[0]["class_id"], i as u64 + 1);
    }
    assert_eq!(
        gw.metric("nv_inference_request_failure", &["reason=\"REJECTED\""])
            .await,
        1.0
    );
    assert_eq!(gw.metric("nv_inference_request_success", &[]).await, 3.0);
    stop_shared(gw).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_cannot_lengthen_the_default_timeout() {
    let mut config = Config::for_tests();
    config.control.model_repository = vec![temp_repository("timeout-default", |m, t| {
        with_batching(
            m,
            &with_preferred(m, t, "[ 1 ]"),
            "default_queue_policy { default_timeout_microseconds: 150000 \
             allow_timeout_override: true }",
        )
    })];
    let (gw, faults) = TestGateway::start_gated(config).await;
    let (gw, gate) = (Arc::new(gw), &faults.gate);
    let busy = [spawn_predict(&gw, "", 1), spawn_predict(&gw, "", 2)];
    gate.held(2).await;
    // Asks for 10 s; the model's default of 150 ms still applies.
    let r = gw
        .predict(
            "?timeout_us=10000000",
            &[("3.png".into(), common::solid_png(3))],
        )
        .await;
    assert_eq!(r.status, 504, "{}", r.json);
    assert!(
        r.json["error"].as_str().unwrap().contains("150 ms"),
        "{}",
        r.json
    );
    gate.open();
    for task in busy {
        assert_eq!(task.await.unwrap().status, 200);
    }
    stop_shared(gw).await;
}
