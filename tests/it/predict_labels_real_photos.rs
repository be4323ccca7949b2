//! `/predict` end to end on the real model (libtorch on CPU) and real photos.
use crate::common;

use common::{photo, photos, TestGateway, CAT_CLASSES};
use visiongate::settings::Config;

#[tokio::test(flavor = "multi_thread")]
async fn chelsea_is_a_cat_and_coffee_is_espresso_with_labels_and_top_k() {
    let gw = TestGateway::start(Config::for_tests()).await;
    let reply = gw
        .predict(
            "?top_k=3",
            &[
                photo("small", "sk_chelsea.jpg"),
                photo("small", "sk_coffee.jpg"),
            ],
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.json);
    assert_eq!(reply.json["model"], "ensemble_model");
    assert_eq!(reply.json["model_version"], "1");
    let r = reply.results();
    assert_eq!(r[0]["filename"], "sk_chelsea.jpg");
    let cat = r[0]["class_id"].as_u64().unwrap();
    assert!(CAT_CLASSES.contains(&cat), "chelsea classified as {}", r[0]);
    assert!(r[0]["label"].as_str().unwrap().contains("cat"), "{}", r[0]);
    assert_eq!(r[1]["label"], "espresso");
    for res in r {
        let top = res["top_k"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["class_id"], res["class_id"]);
        assert_eq!(top[0]["score"], res["score"]);
        let scores: Vec<f64> = top.iter().map(|t| t["score"].as_f64().unwrap()).collect();
        assert!(
            scores.windows(2).all(|w| w[0] >= w[1]),
            "top_k sorted: {scores:?}"
        );
        assert!(scores.iter().all(|&s| (0.0..=1.0).contains(&s)));
    }
    let timing = &reply.json["timing"];
    assert_eq!(timing["total_images"], 2);
    assert!(timing["total_sec"].as_f64().unwrap() > 0.0);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn results_keep_upload_order_and_match_single_image_requests() {
    let gw = TestGateway::start(Config::for_tests()).await;
    let all = photos("small");
    let batch = gw.predict("", &all).await;
    assert_eq!(batch.status, 200);
    let names: Vec<&str> = batch
        .results()
        .iter()
        .map(|r| r["filename"].as_str().unwrap())
        .collect();
    let expected: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, expected);
    for (file, in_batch) in all.iter().zip(batch.results()).step_by(5) {
        let alone = gw.predict("", std::slice::from_ref(file)).await;
        let alone = &alone.results()[0];
        assert_eq!(alone["class_id"], in_batch["class_id"], "{}", file.0);
        let (a, b) = (
            alone["score"].as_f64().unwrap(),
            in_batch["score"].as_f64().unwrap(),
        );
        assert!((a - b).abs() < 1e-4, "{}: alone {a} vs batched {b}", file.0);
    }
    gw.stop().await;
}
