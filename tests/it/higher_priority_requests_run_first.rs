//! With `priority_levels`, a queued request of a higher priority (1 is the highest) runs
//! before lower ones that came earlier; requests naming none get the default level.
use crate::common;

use std::sync::Arc;

use common::TestGateway;
use common::{spawn_predict, stop_shared, temp_repository, with_batching, with_preferred};
use visiongate::settings::Config;

#[tokio::test(flavor = "multi_thread")]
async fn a_later_high_priority_request_overtakes_a_queued_default_one() {
    let mut config = Config::for_tests();
    config.control.model_repository = vec![temp_repository("priority", |m, t| {
        with_batching(
            m,
            &with_preferred(m, t, "[ 1 ]"),
            "priority_levels: 2\ndefault_priority_level: 2",
        )
    })];
    let (gw, faults) = TestGateway::start_gated(config).await;
    let (gw, gate) = (Arc::new(gw), &faults.gate);
    // Both instances hold a batch; then a default request queues, then a priority-1 one.
    let busy = [spawn_predict(&gw, "", 1), spawn_predict(&gw, "", 2)];
    gate.held(2).await;
    let low = spawn_predict(&gw, "", 3);
    gw.wait_for_queued(1).await;
    let high = spawn_predict(&gw, "?priority=1", 4);
    gw.wait_for_queued(2).await;

    // One instance frees: the batcher gives it the priority-1 request.
    gate.let_through(1);
    let order = gate.held(3).await;
    assert_eq!(
        order[2],
        [4],
        "the batch after the first freed instance (batches by first byte: {order:?})"
    );
    gate.open();
    for (task, red) in busy.into_iter().zip([1, 2]).chain([(low, 3), (high, 4)]) {
        let r = task.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.json);
        assert_eq!(r.results()[0]["class_id"], red);
    }
    stop_shared(gw).await;
}
