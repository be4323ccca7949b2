//! Admission refuses at once when the model's queue is full.
mod common;

use std::time::{Duration, Instant};

use common::{solid_png, temp_repository, with_preferred, TestGateway};
use visiongate::config::Config;

#[tokio::test(flavor = "multi_thread")]
async fn full_queue_answers_503_with_retry_after_at_once() {
    let mut config = Config::for_tests();
    config.model_repository = vec![temp_repository("full", |m, t| {
        with_preferred(m, t, "[ 1 ]")
    })];
    config.max_queue_size = 1;
    let gw =
        std::sync::Arc::new(TestGateway::start_fake(config, Duration::from_millis(1500)).await);
    // Two requests keep both instances busy, a third waits in the one queue place.
    let mut running = Vec::new();
    for i in 0..3u8 {
        let gw = gw.clone();
        running.push(tokio::spawn(async move {
            gw.predict("", &[(format!("{i}.png"), solid_png(i))]).await
        }));
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    for i in 3..6u8 {
        let started = Instant::now();
        let r = gw.predict("", &[(format!("{i}.png"), solid_png(i))]).await;
        assert_eq!(r.status, 503, "{}", r.json);
        assert_eq!(r.json["code"], "overloaded");
        assert!(
            r.headers.contains_key("retry-after"),
            "503 without Retry-After"
        );
        let waited = started.elapsed();
        assert!(
            waited < Duration::from_millis(500),
            "refused after {waited:?}, not at once"
        );
    }
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
    let gw = std::sync::Arc::try_unwrap(gw)
        .ok()
        .expect("every request task has ended");
    gw.stop().await;
}
