//! Slow and stalled clients: 300 uploads that send their headers and part of a file, then
//! stop, hold no queue place (a normal `/predict` still gets its 200), and each is answered
//! 408 `request_timeout` once its body budget runs out. A `Content-Length` over the limit
//! is answered 413 before any of the body is sent, and with `Expect: 100-continue` without
//! the 100. A preamble or a part's header block
//! that goes on and on is answered 400 as soon as it passes its limit.
use crate::common;

use std::time::{Duration, Instant};

use common::{photo, TestGateway};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use visiongate::settings::Config;

const STALLED: usize = 300;
const BODY_TIMEOUT_SECS: u64 = 3;

/// The head and the start of a one-file `/predict` upload that claims `length` bytes.
fn stalled_upload(path: &str, length: u64) -> Vec<u8> {
    let (_, jpeg) = photo("small", "sk_chelsea.jpg");
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: multipart/form-data; boundary=XyZ\r\n\
         Content-Length: {length}\r\n\r\n--XyZ\r\nContent-Disposition: form-data; name=\"files\"; \
         filename=\"a.jpg\"\r\nContent-Type: image/jpeg\r\n\r\n"
    )
    .into_bytes();
    head.extend_from_slice(&jpeg[..200]);
    head
}

/// The status line's code of the response waiting on `conn` (within `within`).
async fn status_of(conn: &mut TcpStream, within: Duration) -> Option<u16> {
    let mut buf = vec![0u8; 4096];
    let mut got = 0;
    let deadline = Instant::now() + within;
    while got < 12 {
        let left = deadline.checked_duration_since(Instant::now())?;
        match tokio::time::timeout(left, conn.read(&mut buf[got..])).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return None,
            Ok(Ok(n)) => got += n,
        }
    }
    std::str::from_utf8(&buf[9..12]).ok()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread")]
async fn stalled_uploads_hold_no_queue_place_and_get_408() {
    let mut config = Config::for_tests();
    config.uploads.body_timeout_secs = BODY_TIMEOUT_SECS;
    let max_body = config.uploads.max_body_bytes;
    let gw = TestGateway::start_fake(config, Duration::from_millis(5)).await;
    let addr = gw.gateway.as_ref().unwrap().http_addr.expect("listening");

    let started = Instant::now();
    let mut stalled = Vec::new();
    for _ in 0..STALLED {
        let mut conn = TcpStream::connect(addr).await.expect("connects");
        conn.write_all(&stalled_upload("/predict", 1 << 20))
            .await
            .expect("sends the head");
        stalled.push(conn);
    }

    // More stalled uploads than the queue has places (256), and a normal request still runs.
    let r = gw.predict("", &[photo("small", "sk_chelsea.jpg")]).await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert!(r.results()[0]["class_id"].is_u64(), "{}", r.json);
    assert!(
        started.elapsed() < Duration::from_secs(BODY_TIMEOUT_SECS),
        "the check ran after the stalled uploads timed out; it proves nothing"
    );

    // Each stalled upload is answered 408 once its budget is spent, not before.
    let mut answers = Vec::new();
    for conn in &mut stalled {
        answers.push(status_of(conn, Duration::from_secs(BODY_TIMEOUT_SECS + 10)).await);
    }
    let waited = started.elapsed();
    assert!(
        answers.iter().all(|a| *a == Some(408)),
        "stalled uploads answered {:?}",
        answers
            .iter()
            .filter(|a| **a != Some(408))
            .take(5)
            .collect::<Vec<_>>()
    );
    assert!(
        waited >= Duration::from_secs(BODY_TIMEOUT_SECS),
        "answered 408 after {waited:?}, before the budget ran out"
    );

    // A body announced over the limit: 413 at once, nothing of it sent.
    for path in ["/predict", "/v2/models/ensemble_model/infer"] {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        let head = stalled_upload(path, max_body + 1);
        let end = head.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        conn.write_all(&head[..end]).await.unwrap();
        assert_eq!(
            status_of(&mut conn, Duration::from_secs(2)).await,
            Some(413),
            "{path}"
        );
    }

    // The same with `Expect: 100-continue`: 413 first, no `100 Continue` inviting the body,
    // and the connection closed (what the client may still send is not read as a request).
    // Within the limit, the 100 comes.
    for (length, first) in [(max_body + 1, 413), (1000, 100)] {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /predict HTTP/1.1\r\nHost: test\r\nExpect: 100-continue\r\n\
             Content-Type: multipart/form-data; boundary=XyZ\r\nContent-Length: {length}\r\n\r\n"
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        assert_eq!(
            status_of(&mut conn, Duration::from_secs(2)).await,
            Some(first),
            "Content-Length {length}"
        );
    }
    let mut conn = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v2/models/ensemble_model/infer HTTP/1.1\r\nHost: test\r\n\
         Expect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        max_body + 1
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut got)).await;
    assert!(closed.is_ok(), "the connection stays open after the 413");
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 413"), "{got}");
    assert!(got.contains("\"code\":\"payload_too_large\""), "{got}");

    // A stalled KServe body times out too.
    let mut conn = TcpStream::connect(addr).await.unwrap();
    conn.write_all(
        b"POST /v2/models/ensemble_model/infer HTTP/1.1\r\nHost: test\r\n\
          Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"inputs\": [",
    )
    .await
    .unwrap();
    assert_eq!(
        status_of(&mut conn, Duration::from_secs(BODY_TIMEOUT_SECS + 10)).await,
        Some(408)
    );

    // Still serving.
    let r = gw.predict("", &[photo("small", "sk_chelsea.jpg")]).await;
    assert_eq!(r.status, 200, "{}", r.json);
    gw.stop().await;
}

/// The response waiting on `conn` (within `within`): its status and body.
async fn answer_of(conn: &mut TcpStream, within: Duration) -> Option<(u16, String)> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_string())
                })
                .and_then(|v| v.parse::<usize>().ok())?;
            if body.len() >= length {
                return Some((head[9..12].parse().ok()?, body.to_string()));
            }
        }
        let left = deadline.checked_duration_since(Instant::now())?;
        match tokio::time::timeout(left, conn.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return None,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_endless_preamble_or_part_header_is_refused_at_its_limit() {
    let gw = TestGateway::start_fake(Config::for_tests(), Duration::from_millis(5)).await;
    let addr = gw.gateway.as_ref().unwrap().http_addr.expect("listening");
    let head = "POST /predict HTTP/1.1\r\nHost: test\r\n\
                Content-Type: multipart/form-data; boundary=XyZ\r\nContent-Length: 67108864\r\n\r\n";
    let endless_header = format!(
        "--XyZ\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.jpg\"\r\nX-Pad: {}",
        "a".repeat(100 << 10)
    );
    let preamble = "x".repeat(100 << 10);
    for (body, mentions) in [
        (preamble.as_str(), "preamble"),
        (endless_header.as_str(), "headers of part 1"),
    ] {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(head.as_bytes()).await.unwrap();
        // The rest of the 64 MiB never comes: the answer must not wait for it.
        let _ = conn.write_all(body.as_bytes()).await;
        let (status, text) = answer_of(&mut conn, Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("no answer to a body that goes on ({mentions})"));
        assert_eq!(status, 400, "{text}");
        let json: serde_json::Value = serde_json::from_str(&text).expect("a JSON error");
        assert_eq!(json["code"], "invalid_input", "{json}");
        let message = json["error"].as_str().unwrap();
        assert!(message.contains(mentions), "{message}");
    }

    // Still serving.
    let r = gw.predict("", &[photo("small", "sk_chelsea.jpg")]).await;
    assert_eq!(r.status, 200, "{}", r.json);
    gw.stop().await;
}
