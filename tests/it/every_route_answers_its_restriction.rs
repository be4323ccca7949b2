//! Every route the server declares, called for real with every restricted-API category
//! restricted: each API route refuses a request without the key (403 naming the header)
//! and lets one with the key through; the open routes (the upload page, the API docs) need
//! none. The list comes from the route table the server is built from, so a new route is
//! checked as soon as it exists.
use crate::common;

use std::time::Duration;

use common::TestGateway;
use visiongate::http::routes::{routes, Access};
use visiongate::settings::Config;

/// A concrete path for a route's pattern.
fn concrete(pattern: &str) -> String {
    pattern
        .replace("{model}", "classifier")
        .replace("{version}", "1")
        .replace("{name}", "region")
        .replace("{file:.*}", "index.html")
}

#[tokio::test(flavor = "multi_thread")]
async fn each_route_is_restricted_by_its_category() {
    let mut config = Config::for_tests();
    config.access.http_restricted_api = vec![
        "health,metadata,inference,shared-memory,model-config,model-repository,statistics,trace:\
         the-key=s3cret"
            .to_string(),
    ];
    // On, so that with its key a shared-memory route is let through (off, it is 403 too).
    config.server.allow_client_shm = true;
    let gw = TestGateway::start_fake(config, Duration::ZERO).await;
    let routes = routes();
    assert!(routes.len() > 30, "the table lists every route");
    for route in &routes {
        let url = gw.url(&concrete(&route.path));
        let request = |key: Option<&str>| {
            let method = reqwest::Method::from_bytes(route.method.as_str().as_bytes()).unwrap();
            let mut r = gw.client.request(method, url.as_str());
            if let Some(key) = key {
                r = r.header("The-Key", key);
            }
            r.send()
        };
        let without = request(None).await.unwrap();
        let status = without.status().as_u16();
        match route.access {
            Access::Api(_) => {
                assert_eq!(status, 403, "{} {}", route.method, route.path);
                let body: serde_json::Value = without.json().await.unwrap();
                assert_eq!(body["code"], "forbidden");
                assert!(
                    body["error"].as_str().unwrap().contains("the-key"),
                    "{body}"
                );
                let wrong = request(Some("guess")).await.unwrap().status().as_u16();
                assert_eq!(
                    wrong, 403,
                    "{} {} with a wrong key",
                    route.method, route.path
                );
                let with = request(Some("s3cret")).await.unwrap().status().as_u16();
                assert_ne!(with, 403, "{} {} with its key", route.method, route.path);
            }
            Access::Open => assert_ne!(status, 403, "{} {} is open", route.method, route.path),
        }
    }
    // A path no route serves is 404 with or without a key.
    let r = gw.client.get(gw.url("/v2/logging")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    gw.stop().await;
}
