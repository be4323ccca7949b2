//! Admission refuses at once when the model's queue is full.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{solid_png, spawn_predict, stop_shared, temp_repository, with_preferred, TestGateway};
use visiongate::settings::Config;

#[tokio::test(flavor = "multi_thread")]
async fn full_queue_answers_503_with_retry_after_at_once() {
    let mut config = Config::for_tests();
    config.control.model_repository = vec![temp_repository("full", |m, t| {
        with_preferred(m, t, "[ 1 ]")
    })];
    config.queues.max_queue_size = 1;
    let (gw, faults) = TestGateway::start_gated(config).await;
    let (gw, gate) = (Arc::new(gw), &faults.gate);
    // Two requests hold both instances (one after the other: the one queue place is free
    // again once a request's row runs), a third waits in the queue place.
    let mut running = Vec::new();
    for i in 0..2u8 {
        running.push(spawn_predict(&gw, "", i));
        gate.held(usize::from(i) + 1).await;
    }
    running.push(spawn_predict(&gw, "", 2));
    gw.wait_for_queued(1).await;

    // Nothing leaves the queue while the gate holds the instances: an answer now is a
    // refusal that did not wait for a place.
    for i in 3..6u8 {
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            gw.predict("", &[(format!("{i}.png"), solid_png(i))]),
        )
        .await
        .expect("refused at once, not after waiting for a queue place");
        assert_eq!(r.status, 503, "{}", r.json);
        assert_eq!(r.json["code"], "overloaded");
        assert!(
            r.headers.contains_key("retry-after"),
            "503 without Retry-After"
        );
    }
    gate.open();
    for (i, r) in running.into_iter().enumerate() {
        let r = r.await.unwrap();
        assert_eq!(r.status, 200, "admitted request {i}: {}", r.json);
        assert_eq!(r.results()[0]["class_id"], i as u64);
    }
    assert_eq!(
        gw.metric("nv_inference_request_failure", &["reason=\"REJECTED\""])
            .await,
        3.0
    );
    assert_eq!(
        gw.metric("nv_inference_request_success", &["model=\"classifier\""])
            .await,
        3.0
    );
    stop_shared(gw).await;
}
