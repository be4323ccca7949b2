//! Per-file errors stay per file: the photos beside a bad file keep their labels.
use crate::common;

use common::{photo, TestGateway};
use visiongate::settings::Config;

#[tokio::test(flavor = "multi_thread")]
async fn empty_text_and_truncated_files_get_errors_while_photos_keep_their_labels() {
    let gw = TestGateway::start(Config::for_tests()).await;
    let chelsea = photo("small", "sk_chelsea.jpg");
    let coffee = photo("small", "sk_coffee.jpg");
    let truncated = (
        "cut.jpg".to_string(),
        chelsea.1[..chelsea.1.len() / 2].to_vec(),
    );
    let files = vec![
        chelsea.clone(),
        ("empty.jpg".to_string(), vec![]),
        (
            "notes.jpg".to_string(),
            b"these are my notes, not a photo\n".to_vec(),
        ),
        coffee.clone(),
        truncated,
        ("pic.tiff".to_string(), b"II*\0\x08\0\0\0rest".to_vec()),
    ];
    let mixed = gw.predict("", &files).await;
    let clean = gw.predict("", &[chelsea, coffee]).await;
    assert_eq!(mixed.status, 200, "{}", mixed.json);
    let r = mixed.results();
    assert_eq!(r.len(), 6);
    let code = |i: usize| r[i]["error"]["code"].as_str().unwrap_or("none").to_string();
    assert_eq!(code(1), "empty_file");
    assert_eq!(code(2), "invalid_image");
    assert_eq!(code(4), "invalid_image");
    assert_eq!(code(5), "unsupported_format");
    for i in [1, 2, 4, 5] {
        assert!(!r[i]["error"]["message"].as_str().unwrap().is_empty());
        assert!(
            r[i].get("label").is_none(),
            "an error entry has no label: {}",
            r[i]
        );
        assert_eq!(r[i]["filename"], files[i].0);
    }
    let c = clean.results();
    for (i, j) in [(0, 0), (3, 1)] {
        assert_eq!(r[i]["class_id"], c[j]["class_id"]);
        assert_eq!(r[i]["label"], c[j]["label"]);
        let (a, b) = (
            r[i]["score"].as_f64().unwrap(),
            c[j]["score"].as_f64().unwrap(),
        );
        assert!((a - b).abs() < 1e-4);
    }
    assert_eq!(mixed.json["timing"]["total_images"], 6);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_file_over_the_size_limit_gets_file_too_large_and_others_run() {
    let mut config = Config::for_tests();
    config.uploads.max_file_bytes = 40_000;
    let gw = TestGateway::start(config).await;
    let big = photo("small", "sk_coffee.jpg"); // 72 kB
    let small = photo("small", "sk_chelsea.jpg"); // 35 kB
    let reply = gw.predict("", &[big, small]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.results()[0]["error"]["code"], "file_too_large");
    assert!(reply.results()[1]["label"].is_string());
    gw.stop().await;
}
