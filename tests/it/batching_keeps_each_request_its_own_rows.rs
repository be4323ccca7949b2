//! Dynamic batching merges concurrent requests and splits large ones without mixing rows.
use crate::common;

use std::time::Duration;

use common::{photos, solid_png, temp_repository, with_preferred, TestGateway};
use futures_util::future::join_all;
use visiongate::engine::FakeFaults;
use visiongate::settings::Config;

#[tokio::test(flavor = "multi_thread")]
async fn thirty_two_concurrent_requests_share_batches_and_keep_their_own_answers() {
    let mut config = Config::for_tests();
    config.control.model_repository = vec![temp_repository("share", |m, t| {
        with_preferred(m, t, "[ 8 ]").replace(
            "max_queue_delay_microseconds: 2000",
            "max_queue_delay_microseconds: 20000",
        )
    })];
    let gw = TestGateway::start_fake(config, Duration::from_millis(30)).await;
    // (the fake's latency also applies to warm-up, so its batch size is pinned)
    let reds: Vec<u8> = (0..32u8).map(|i| i * 7 + 3).collect();
    let replies = join_all(reds.iter().map(|&red| {
        let gw = &gw;
        async move {
            gw.predict("?top_k=1", &[(format!("{red}.png"), solid_png(red))])
                .await
        }
    }))
    .await;
    for (red, reply) in reds.iter().zip(&replies) {
        assert_eq!(reply.status, 200, "{}", reply.json);
        assert_eq!(
            reply.results()[0]["class_id"],
            *red as u64,
            "request {red} got another's row"
        );
    }
    let batches = gw.metric("visiongate_batch_size_count", &[]).await;
    let rows = gw.metric("visiongate_batch_size_sum", &[]).await;
    assert_eq!(rows, 32.0);
    assert!(
        batches < 32.0,
        "requests were not batched: {batches} batches for 32 rows"
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_wait_for_the_queue_delay_only_while_more_are_on_their_way() {
    // The bundled preferred sizes with a 10 s queue delay: the fake engine's time per batch
    // (the same for any size) makes the largest size the fastest per image, and the fake is
    // no CPU, so the instances ask for 32 or more.
    let mut config = Config::for_tests();
    config.control.model_repository = vec![temp_repository("coming", |_, t| {
        t.replace(
            "max_queue_delay_microseconds: 2000",
            "max_queue_delay_microseconds: 10000000",
        )
    })];
    let gw = TestGateway::start_fake(config, Duration::from_millis(20)).await;
    // A lone image: no rows are on their way, and 1 is a preferred size, so it runs at once
    // (as in Triton) instead of waiting 10 s for seven more.
    let started = std::time::Instant::now();
    let reply = gw.predict("", &[("one.png".into(), solid_png(9))]).await;
    assert_eq!(reply.status, 200, "{}", reply.json);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a lone image waited {:?} for a batch to fill",
        started.elapsed()
    );
    // An upload of 61 whose files arrive 15 ms apart (the request submits its rows 8 at a
    // time as they decode): its rows wait for the batch to fill instead of running 8 at a
    // time as they come, and once its last rows are submitted what is queued runs without
    // waiting: at most 32 + 29 (the instances ask for 32 or more).
    let before = gw.metric("visiongate_batch_size_count", &[]).await;
    let rows_before = gw.metric("visiongate_batch_size_sum", &[]).await;
    let started = std::time::Instant::now();
    let (status, body) = paced_upload(&gw, 61, Duration::from_millis(15)).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "the upload's last rows waited: {:?}",
        started.elapsed()
    );
    let reply: serde_json::Value = serde_json::from_str(&body).unwrap();
    for (i, r) in reply["results"].as_array().unwrap().iter().enumerate() {
        assert_eq!(r["class_id"], i as u64, "row {i}");
    }
    let batches = gw.metric("visiongate_batch_size_count", &[]).await - before;
    let rows = gw.metric("visiongate_batch_size_sum", &[]).await - rows_before;
    assert_eq!(rows, 61.0);
    assert!(
        batches <= 2.0,
        "61 rows that trickled in ran in {batches} batches: they did not wait for the rows coming"
    );
    gw.stop().await;
}

/// A `/predict` of `files` solid PNGs (file i classified as i), one file every `gap`:
/// the response's status and body.
async fn paced_upload(gw: &TestGateway, files: u8, gap: Duration) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let parts: Vec<Vec<u8>> = (0..files)
        .map(|i| {
            let mut part = format!(
                "--XyZ\r\nContent-Disposition: form-data; name=\"files\"; filename=\"{i}.png\"\r\n\
                 Content-Type: image/png\r\n\r\n"
            )
            .into_bytes();
            part.extend(solid_png(i));
            part.extend(b"\r\n");
            part
        })
        .collect();
    let end = b"--XyZ--\r\n";
    let length = parts.iter().map(Vec::len).sum::<usize>() + end.len();
    let url = gw.url("/predict?top_k=1");
    let addr = url.trim_start_matches("http://").split('/').next().unwrap();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /predict?top_k=1 HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\
         Content-Type: multipart/form-data; boundary=XyZ\r\nContent-Length: {length}\r\n\r\n"
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    for part in &parts {
        conn.write_all(part).await.unwrap();
        tokio::time::sleep(gap).await;
    }
    conn.write_all(end).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), conn.read_to_end(&mut answer))
        .await
        .expect("an answer within 30 s")
        .unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    (head[9..12].parse().unwrap(), body.to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_large_request_is_split_over_both_instances_in_upload_order() {
    let mut config = Config::for_tests();
    config.control.model_repository = vec![temp_repository("split", |m, t| {
        with_preferred(m, t, "[ 4 ]")
    })];
    let gw = TestGateway::start_fake(config, Duration::from_millis(10)).await;
    let files: Vec<_> = (0..100u8)
        .map(|i| (format!("{i}.png"), solid_png(i)))
        .collect();
    let reply = gw.predict("?top_k=1", &files).await;
    assert_eq!(reply.status, 200);
    for (i, r) in reply.results().iter().enumerate() {
        assert_eq!(r["class_id"], i as u64, "row {i}");
    }
    for instance in ["cpu/0", "cpu/1"] {
        let n = gw
            .metric(
                "visiongate_instance_executions_total",
                &[&format!("instance=\"{instance}\"")],
            )
            .await;
        assert!(n > 0.0, "instance {instance} ran nothing");
    }
    assert_eq!(
        gw.metric("nv_inference_count", &["model=\"classifier\""])
            .await,
        100.0
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_real_model_gives_the_same_answer_alone_and_inside_a_batch() {
    let mut config = Config::for_tests();
    config.control.model_repository = vec![temp_repository("same", |m, t| {
        with_preferred(m, t, "[ 8 ]")
    })];
    let gw = TestGateway::start(config).await;
    let files: Vec<_> = photos("small").into_iter().take(8).collect();
    let batched = gw.predict("", &files).await;
    assert_eq!(gw.metric("visiongate_batch_size_sum", &[]).await, 8.0);
    assert_eq!(
        gw.metric("visiongate_batch_size_count", &[]).await,
        1.0,
        "8 rows ran as one batch"
    );
    for (file, in_batch) in files.iter().zip(batched.results()) {
        let alone = gw.predict("", std::slice::from_ref(file)).await;
        let alone = &alone.results()[0];
        assert_eq!(alone["class_id"], in_batch["class_id"], "{}", file.0);
        for (a, b) in alone["top_k"]
            .as_array()
            .unwrap()
            .iter()
            .zip(in_batch["top_k"].as_array().unwrap())
        {
            assert_eq!(a["class_id"], b["class_id"]);
            let (x, y) = (a["score"].as_f64().unwrap(), b["score"].as_f64().unwrap());
            assert!((x - y).abs() < 1e-4, "{}: {x} alone vs {y} batched", file.0);
        }
    }
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn max_batch_size_says_what_the_model_takes_and_batches_stay_within_the_batch_bytes() {
    // The config asks for everything (Triton's meaning: what the model takes), and still
    // loads; with --max-batch-bytes at four FP32 [3, 224, 224] rows, the preferred sizes
    // over four are left out and every batch the server forms holds at most four rows.
    let mut config = Config::for_tests();
    config.control.model_repository = vec![temp_repository("batch-bytes", |m, t| {
        with_preferred(m, t, "[ 1000000000, 2000000000 ]")
            .replace("max_batch_size: 4096", "max_batch_size: 2147483647")
    })];
    config.control.max_batch_bytes = 4 * 3 * 224 * 224 * 4;
    // The engine fails a batch of more than four rows (warm-up and timing included).
    let faults = FakeFaults {
        most_rows: Some(4),
        ..Default::default()
    };
    let (gw, _) = TestGateway::start_faulty(config, faults).await;
    let c = gw
        .json(gw.client.get(gw.url("/v2/models/classifier/config")))
        .await;
    assert_eq!(
        c["max_batch_size"], 2147483647,
        "the config is served as written"
    );
    let files: Vec<_> = (0..30u8)
        .map(|i| (format!("{i}.png"), solid_png(i)))
        .collect();
    let reply = gw.predict("?top_k=1", &files).await;
    assert_eq!(reply.status, 200, "{}", reply.json);
    for (i, r) in reply.results().iter().enumerate() {
        assert_eq!(r["class_id"], i as u64, "row {i}");
    }
    let batches = gw.metric("visiongate_batch_size_count", &[]).await;
    assert_eq!(gw.metric("visiongate_batch_size_sum", &[]).await, 30.0);
    assert!(batches >= 8.0, "30 rows in {batches} batches");
    gw.stop().await;
}
