//! A client that goes away drops its own rows only: queued rows leave the queue (counted
//! as CANCELED), and a batch it shares with others still answers the others.
use crate::common;

use std::sync::Arc;

use common::{spawn_predict, stop_shared, temp_repository, with_preferred, TestGateway};
use visiongate::settings::Config;

const CANCELED: [&str; 2] = ["model=\"classifier\"", "reason=\"CANCELED\""];

#[tokio::test(flavor = "multi_thread")]
async fn disconnecting_clients_do_not_fail_the_requests_they_wait_or_run_with() {
    let mut config = Config::for_tests();
    // Batches of 4 rows, cut only once 4 are there (the delay, the longest allowed, is far
    // beyond the test).
    config.control.model_repository = vec![temp_repository("disconnect", |m, t| {
        with_preferred(m, t, "[ 4 ]").replace(
            "max_queue_delay_microseconds: 2000",
            "max_queue_delay_microseconds: 10000000",
        )
    })];
    let (gw, faults) = TestGateway::start_gated(config).await;
    let (gw, gate) = (Arc::new(gw), &faults.gate);

    // 1. Queued: both instances hold a 4-row batch while a, b and c wait; b goes away.
    let busy: Vec<_> = (10..18u8).map(|red| spawn_predict(&gw, "", red)).collect();
    gate.held(2).await;
    let a = spawn_predict(&gw, "", 1);
    let b = spawn_predict(&gw, "", 2);
    let c = spawn_predict(&gw, "", 3);
    gw.wait_for_queued(3).await;
    b.abort();
    gw.wait_for_metric("nv_inference_request_failure", &CANCELED, 1.0)
        .await;

    // 2. Running: d and e join a and c in the next batch (b's row left the queue as its
    // client went); e goes away while it runs.
    gw.wait_for_queued(2).await;
    let d = spawn_predict(&gw, "", 4);
    let e = spawn_predict(&gw, "", 5);
    gw.wait_for_queued(4).await;
    gate.let_through(2);
    let batches = gate.held(3).await;
    let mut shared = batches[2].clone();
    shared.sort();
    assert_eq!(shared, [1, 3, 4, 5], "batches by first byte: {batches:?}");
    e.abort();
    gw.wait_for_metric("nv_inference_request_failure", &CANCELED, 2.0)
        .await;
    gate.open();

    for (task, red) in [(a, 1), (c, 3), (d, 4)] {
        let r = task.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.json);
        assert_eq!(r.results()[0]["class_id"], red);
    }
    for task in busy {
        assert_eq!(task.await.unwrap().status, 200);
    }
    assert_eq!(
        gw.metric("nv_inference_count", &["model=\"classifier\""])
            .await,
        12.0,
        "8 busy rows and one batch of a, c, d and e; b never ran"
    );
    assert_eq!(
        gw.metric("nv_inference_exec_count", &["model=\"classifier\""])
            .await,
        3.0
    );
    stop_shared(gw).await;
}
