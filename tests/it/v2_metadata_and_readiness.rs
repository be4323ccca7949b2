//! KServe v2 read-only endpoints: server metadata, model metadata, liveness and readiness
//! (KServe's bodies, Triton's status codes), with Triton's shapes and datatype names, and
//! JSON errors for unknown models and versions.
use crate::common;

use std::time::Duration;

use common::TestGateway;
use serde_json::json;
use visiongate::settings::Config;

#[tokio::test(flavor = "multi_thread")]
async fn v2_metadata_and_readiness_describe_the_repository() {
    let gw = TestGateway::start_fake(Config::for_tests(), Duration::from_millis(1)).await;
    let get = |path: &'static str| {
        let gw = &gw;
        async move {
            let r = gw.client.get(gw.url(path)).send().await.unwrap();
            let status = r.status().as_u16();
            let text = r.text().await.unwrap();
            (
                status,
                serde_json::from_str::<serde_json::Value>(&text).unwrap_or(json!(text)),
            )
        }
    };

    let (status, server) = get("/v2").await;
    assert_eq!(status, 200);
    assert_eq!(server["name"], "visiongate");
    assert!(server["extensions"].is_array());

    let (status, classifier) = get("/v2/models/classifier").await;
    assert_eq!(status, 200, "{classifier}");
    assert_eq!(
        classifier,
        json!({
            "name": "classifier",
            "versions": ["1"],
            "platform": "pytorch_libtorch",
            "inputs": [{"name": "input__0", "datatype": "FP32", "shape": [-1, 3, 224, 224]}],
            "outputs": [{"name": "output__0", "datatype": "FP32", "shape": [-1, 1000]}],
            // Where the instances run, and why not where the config puts them.
            "instances": [{"name": "cpu/0", "device": "fake"}, {"name": "cpu/1", "device": "fake"}],
            "placement_fallback": "KIND_GPU asks for GPUs [0, 1] but 0 are available: running 2 instance(s) on the CPU",
        })
    );
    let metrics = gw.metrics_text().await;
    assert!(
        metrics.contains(
            "visiongate_instance_device{device=\"fake\",fallback=\"KIND_GPU asks for GPUs [0, 1] but 0 are available: running 2 instance(s) on the CPU\",instance=\"cpu/1\",model=\"classifier\",version=\"1\"} 1"
        ),
        "{metrics}"
    );
    let (status, ensemble) = get("/v2/models/ensemble_model/versions/1").await;
    assert_eq!(status, 200, "{ensemble}");
    assert_eq!(ensemble["platform"], "ensemble");
    assert_eq!(ensemble["inputs"][0]["name"], "RAW_IMAGE");
    assert_eq!(ensemble["inputs"][0]["datatype"], "UINT8");

    // KServe's bodies, with Triton's status codes.
    assert_eq!(get("/v2/health/live").await, (200, json!({"live": true})));
    assert_eq!(get("/v2/health/ready").await, (200, json!({"ready": true})));
    for (model, ready) in [
        ("classifier", "/v2/models/classifier/ready"),
        ("preprocessor", "/v2/models/preprocessor/ready"),
        (
            "ensemble_model",
            "/v2/models/ensemble_model/versions/1/ready",
        ),
    ] {
        assert_eq!(
            get(ready).await,
            (200, json!({"name": model, "ready": true})),
            "{ready}"
        );
    }

    let (status, body) = get("/v2/models/resnet50").await;
    assert_eq!(status, 404);
    assert_eq!(body["code"], "not_found");
    assert!(body["error"].as_str().unwrap().contains("resnet50"));
    let (status, body) = get("/v2/models/classifier/versions/7/ready").await;
    assert_eq!(status, 404);
    assert!(
        body["error"].as_str().unwrap().contains("no version 7"),
        "{body}"
    );
    let (status, body) = get("/v2/models/classifier/versions/latest").await;
    assert_eq!(status, 400);
    assert_eq!(body["code"], "invalid_input");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn v2_config_returns_the_model_config_as_on_disk() {
    let gw = TestGateway::start_fake(Config::for_tests(), Duration::from_millis(1)).await;
    for path in [
        "/v2/models/classifier/config",
        "/v2/models/classifier/versions/1/config",
    ] {
        let r = gw.client.get(gw.url(path)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{path}");
        let c: serde_json::Value = r.json().await.unwrap();
        assert_eq!(c["name"], "classifier");
        assert_eq!(c["platform"], "pytorch_libtorch");
        assert_eq!(c["max_batch_size"], 4096);
        assert_eq!(c["input"][0]["name"], "input__0");
        assert_eq!(c["input"][0]["data_type"], "TYPE_FP32");
        assert_eq!(c["input"][0]["dims"], json!(["3", "224", "224"]));
        assert_eq!(c["output"][0]["label_filename"], "labels.txt");
        assert_eq!(
            c["instance_group"],
            json!([{"name": "", "kind": "KIND_GPU", "count": 2, "gpus": [0, 1],
                    "secondary_devices": [], "profile": [], "passive": false,
                    "host_policy": ""}])
        );
        assert_eq!(
            c["dynamic_batching"]["preferred_batch_size"],
            json!([1, 2, 4, 8, 16, 32])
        );
    }
    let r = gw
        .client
        .get(gw.url("/v2/models/nope/config"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn listeners_turned_off_are_not_opened_wrong_methods_get_405_and_readiness_can_be_lax() {
    // --allow-grpc=false --allow-metrics=false: HTTP alone.
    let mut config = Config::for_tests();
    config.listen.allow_grpc = false;
    config.listen.allow_metrics = false;
    let gw = TestGateway::start_fake(config, Duration::ZERO).await;
    let g = gw.gateway.as_ref().unwrap();
    assert!(g.grpc_addr.is_none() && g.metrics_addr.is_none());
    let live = gw.json(gw.client.get(gw.url("/v2/health/live"))).await;
    assert_eq!(live, json!({"live": true}));
    // A known path with a wrong method: 405, JSON, and what is allowed.
    for (method, path, allow) in [
        (reqwest::Method::GET, "/predict", "POST"),
        (reqwest::Method::DELETE, "/v2/models/classifier", "GET"),
        (
            reqwest::Method::PUT,
            "/v2/models/classifier/versions/1/infer",
            "POST",
        ),
        (reqwest::Method::POST, "/v2/health/ready", "GET"),
    ] {
        let r = gw
            .client
            .request(method, gw.url(path))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 405, "{path}");
        assert_eq!(r.headers()["allow"], allow, "{path}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["code"], "method_not_allowed", "{path}");
    }
    let r = gw.client.get(gw.url("/v2/nowhere")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    gw.stop().await;

    // --allow-http=false: gRPC and metrics only; the stop still drains and returns.
    let mut config = Config::for_tests();
    config.listen.allow_http = false;
    let gateway = common::start_fake_gateway(config, Default::default()).await;
    assert!(gateway.http_addr.is_none());
    let metrics = gateway.metrics_addr.expect("metrics on");
    let body = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(body.contains("nv_inference_count") || body.contains("visiongate_"));
    tokio::time::timeout(Duration::from_secs(30), gateway.stop())
        .await
        .expect("stops");

    // --strict-readiness=false: ready while a model is still loading.
    let mut config = Config::for_tests();
    config.server.strict_readiness = false;
    let gateway = common::start_fake_gateway(config, Default::default()).await;
    assert!(gateway.state.is_ready());
    gateway.stop().await;
}
