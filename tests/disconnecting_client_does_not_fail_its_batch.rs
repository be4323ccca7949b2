//! A client that goes away drops its own rows only: queued rows leave the queue (counted
//! as CANCELED), and a batch it shares with others still answers the others.
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{spawn_predict, stop_shared, temp_repository, with_preferred, TestGateway};
use visiongate::config::Config;

#[tokio::test(flavor = "multi_thread")]
async fn disconnecting_clients_do_not_fail_the_requests_they_wait_or_run_with() {
    let mut config = Config::for_tests();
    // Batches of up to 4 rows, cut after 300 ms at the latest, so requests sent together
    // share one.
    config.model_repository = vec![temp_repository("disconnect", |m, t| {
        with_preferred(m, t, "[ 4 ]").replace(
            "max_queue_delay_microseconds: 2000",
            "max_queue_delay_microseconds: 300000",
        )
    })];
    let gw = Arc::new(TestGateway::start_fake(config, Duration::from_millis(800)).await);

    // 1. Queued: both instances run 4-row batches while a, b and c wait; b goes away.
    let busy: Vec<_> = (10..18u8).map(|red| spawn_predict(&gw, "", red)).collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let a = spawn_predict(&gw, "", 1);
    let b = spawn_predict(&gw, "", 2);
    let c = spawn_predict(&gw, "", 3);
    tokio::time::sleep(Duration::from_millis(150)).await;
    b.abort();
    for (task, red) in [(a, 1), (c, 3)] {
        let r = task.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.json);
        assert_eq!(r.results()[0]["class_id"], red);
    }
    for task in busy {
        assert_eq!(task.await.unwrap().status, 200);
    }
    assert_eq!(
        gw.metric("nv_inference_request_failure", &["reason=\"CANCELED\""])
            .await,
        1.0,
        "the queued rows of the client that left were dropped"
    );
    let rows_before = gw.metric("nv_inference_count", &[]).await;
    let batches_before = gw.metric("nv_inference_exec_count", &[]).await;
    assert_eq!(rows_before, 10.0, "8 busy rows + a + c; b never ran");

    // 2. Running: d and e share one batch; e goes away while it runs.
    let d = spawn_predict(&gw, "", 4);
    let e = spawn_predict(&gw, "", 5);
    tokio::time::sleep(Duration::from_millis(700)).await; // cut at ~300 ms, runs 800 ms
    e.abort();
    let r = d.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.results()[0]["class_id"], 4);
    assert_eq!(
        gw.metric("nv_inference_count", &[]).await - rows_before,
        2.0
    );
    assert_eq!(
        gw.metric("nv_inference_exec_count", &[]).await - batches_before,
        1.0,
        "d and e ran in one batch"
    );
    stop_shared(gw).await;
}
