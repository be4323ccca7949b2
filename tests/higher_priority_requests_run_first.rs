//! With `priority_levels`, a queued request of a higher priority (1 is the highest) runs
//! before lower ones that came earlier; requests naming none get the default level.
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::TestGateway;
use common::{solid_png, stop_shared, temp_repository, with_batching, with_preferred};
use visiongate::config::Config;

#[tokio::test(flavor = "multi_thread")]
async fn a_later_high_priority_request_overtakes_a_queued_default_one() {
    let mut config = Config::for_tests();
    config.model_repository = vec![temp_repository("priority", |m, t| {
        with_batching(
            m,
            &with_preferred(m, t, "[ 1 ]"),
            "priority_levels: 2\ndefault_priority_level: 2",
        )
    })];
    let gw = Arc::new(TestGateway::start_fake(config, Duration::from_millis(600)).await);
    let t0 = Instant::now();
    let timed = |query: &'static str, red: u8| {
        let gw = gw.clone();
        tokio::spawn(async move {
            let r = gw
                .predict(query, &[(format!("{red}.png"), solid_png(red))])
                .await;
            (r, t0.elapsed())
        })
    };
    // Both instances busy, freeing 300 ms apart.
    let busy1 = timed("", 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let busy2 = timed("", 2);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let low = timed("", 3);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let high = timed("?priority=1", 4);

    let (low, low_done) = low.await.unwrap();
    let (high, high_done) = high.await.unwrap();
    assert_eq!(low.status, 200, "{}", low.json);
    assert_eq!(high.status, 200, "{}", high.json);
    assert_eq!(low.results()[0]["class_id"], 3);
    assert_eq!(high.results()[0]["class_id"], 4);
    assert!(
        high_done < low_done,
        "the priority-1 request finished at {high_done:?}, after the default one at {low_done:?}"
    );
    for task in [busy1, busy2] {
        assert_eq!(task.await.unwrap().0.status, 200);
    }
    stop_shared(gw).await;
}
