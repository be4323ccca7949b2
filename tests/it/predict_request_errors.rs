//! Request-level errors: right status, JSON `{"error", "code"}`, never a 5xx.
use crate::common;

use common::{photo, photos, Reply, TestGateway};
use visiongate::settings::Config;

fn assert_error(reply: &Reply, status: u16, code: &str, mentions: &str) {
    assert_eq!(reply.status, status, "{}", reply.json);
    assert_eq!(reply.json["code"], code, "{}", reply.json);
    let msg = reply.json["error"].as_str().expect("error message");
    assert!(
        msg.contains(mentions),
        "'{msg}' should mention '{mentions}'"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn request_level_errors_answer_json_with_the_right_status() {
    let gw = TestGateway::start(Config::for_tests()).await;
    let c = &gw.client;

    let no_files = reqwest::multipart::Form::new().text("note", "hello");
    let r = Reply::from(
        c.post(gw.url("/predict"))
            .multipart(no_files)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_error(&r, 400, "invalid_input", "no files");

    let r = Reply::from(
        c.post(gw.url("/predict"))
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_error(&r, 415, "unsupported_media_type", "multipart/form-data");

    let r = Reply::from(
        c.post(gw.url("/predict"))
            .header("content-type", "multipart/form-data; boundary=XYZ")
            .body("--XYZ\r\nContent-Disposition: form-data; name=\"files\"\r\n\r\nabc")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_error(&r, 400, "invalid_input", "multipart");

    let chelsea = photo("small", "sk_chelsea.jpg");
    let r = gw
        .predict("?model=resnet9000", std::slice::from_ref(&chelsea))
        .await;
    assert_error(&r, 404, "not_found", "resnet9000");

    let r = gw
        .predict("?model=classifier", std::slice::from_ref(&chelsea))
        .await;
    assert_error(&r, 400, "invalid_input", "ensemble");

    let r = gw.predict("?top_k=0", std::slice::from_ref(&chelsea)).await;
    assert_error(&r, 400, "invalid_input", "top_k");
    // More classes than the model has: all of them (as Triton's classification).
    let r = gw
        .predict("?top_k=5000", std::slice::from_ref(&chelsea))
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.results()[0]["top_k"].as_array().unwrap().len(), 1000);
    let r = gw
        .predict("?top_k=many", std::slice::from_ref(&chelsea))
        .await;
    assert_error(&r, 400, "invalid_input", "query");

    let r = Reply::from(c.get(gw.url("/nothing/here")).send().await.unwrap()).await;
    assert_error(&r, 404, "not_found", "/nothing/here");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_body_over_the_limit_is_413() {
    let mut config = Config::for_tests();
    config.uploads.max_body_bytes = 100_000;
    let gw = TestGateway::start(config).await;
    let files: Vec<_> = photos("small").into_iter().take(5).collect();
    let r = gw.predict("", &files).await;
    assert_eq!(r.status, 413, "{}", r.json);
    assert_eq!(r.json["code"], "payload_too_large");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_photos_succeed_and_one_more_is_413() {
    let gw = TestGateway::start(Config::for_tests()).await;
    let small = photos("small");
    let thousand: Vec<_> = (0..1000)
        .map(|i| {
            let (name, bytes) = &small[i % small.len()];
            (format!("{i:04}-{name}"), bytes.clone())
        })
        .collect();
    let r = gw.predict("?top_k=1", &thousand).await;
    assert_eq!(r.status, 200, "{}", r.json);
    let results = r.results();
    assert_eq!(results.len(), 1000);
    // The same photo gets the same class wherever it sits in the upload.
    for (i, res) in results.iter().enumerate() {
        assert_eq!(res["filename"], thousand[i].0);
        assert_eq!(
            res["class_id"],
            results[i % small.len()]["class_id"],
            "row {i}"
        );
    }

    for instance in ["cpu/0", "cpu/1"] {
        let label = format!("instance=\"{instance}\"");
        let n = gw
            .metric("visiongate_instance_executions_total", &[&label])
            .await;
        assert!(n > 0.0, "the 1000-photo request never ran on {instance}");
    }

    let mut too_many = thousand;
    too_many.push(photo("small", "sk_chelsea.jpg"));
    let r = gw.predict("", &too_many).await;
    assert_eq!(r.status, 413, "{}", r.json);
    assert_eq!(r.json["code"], "payload_too_large");
    assert!(r.json["error"].as_str().unwrap().contains("1000"));
    gw.stop().await;
}
