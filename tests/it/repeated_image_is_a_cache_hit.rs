//! With `response_cache { enable: true }` a photo seen before is answered from the cache
//! without running the model, with the same answer.
use crate::common;

use std::time::Duration;

use common::{photo, temp_repository, TestGateway};
use visiongate::settings::Config;

#[tokio::test(flavor = "multi_thread")]
async fn a_repeated_photo_is_answered_from_the_cache() {
    let mut config = Config::for_tests();
    config.control.model_repository = vec![temp_repository("cache", |m, t| {
        if m == "classifier" {
            format!("{t}\nresponse_cache {{ enable: true }}\n")
        } else {
            t.to_string()
        }
    })];
    let gw = TestGateway::start_fake(config, Duration::from_millis(20)).await;
    let p1 = photo("small", "Aqua.jpg");
    let p2 = photo("small", "Autumn.jpg");
    let p3 = photo("small", "Blinds.jpg");
    let hits = || gw.metric("nv_cache_num_hits_per_model", &["model=\"classifier\""]);
    let misses = || gw.metric("nv_cache_num_misses_per_model", &["model=\"classifier\""]);
    let rows = || gw.metric("nv_inference_count", &["model=\"classifier\""]);

    let first = gw.predict("", &[p1.clone(), p2.clone()]).await;
    assert_eq!(first.status, 200, "{}", first.json);
    assert_eq!(
        (hits().await, misses().await, rows().await),
        (0.0, 2.0, 2.0)
    );

    let second = gw.predict("", &[p3.clone(), p1.clone(), p2.clone()]).await;
    assert_eq!(second.status, 200, "{}", second.json);
    assert_eq!(
        (hits().await, misses().await, rows().await),
        (2.0, 3.0, 3.0),
        "only the new photo ran"
    );
    let strip = |v: &serde_json::Value| v.as_object().unwrap().get("top_k").cloned();
    assert_eq!(strip(&second.results()[1]), strip(&first.results()[0]));
    assert_eq!(strip(&second.results()[2]), strip(&first.results()[1]));
    assert_eq!(second.results()[1]["filename"], "Aqua.jpg");

    // Another top_k is another answer: not served from the top-5 entry.
    let top1 = gw.predict("?top_k=1", &[p1]).await;
    assert_eq!(top1.status, 200);
    assert_eq!(top1.results()[0]["top_k"].as_array().unwrap().len(), 1);
    assert_eq!((hits().await, misses().await), (2.0, 4.0));
    gw.stop().await;
}
