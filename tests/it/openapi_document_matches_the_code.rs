//! `openapi/openapi.json` is generated from the code and committed: it must be what the
//! code generates now. `make openapi` rewrites it.
use std::path::Path;

#[test]
fn committed_openapi_json_matches_the_code() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi/openapi.json");
    let generated = visiongate::http::openapi::document_json();
    // `make openapi` writes the document, then checks it as every run does; CI never writes.
    if std::env::var_os("VISIONGATE_WRITE_OPENAPI").is_some() {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI checks the committed document: unset VISIONGATE_WRITE_OPENAPI"
        );
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "openapi/openapi.json differs from the document the code generates: run `make openapi` \
         and commit the result"
    );
    // The document names every route family the server has.
    for route in [
        "/predict",
        "/v2/health/ready",
        "/v2/models/{model}/versions/{version}/infer",
        "/v2/models/stats",
        "/v2/repository/models/{model}/load",
    ] {
        assert!(
            generated.contains(&format!("\"{route}\"")),
            "{route} is not documented"
        );
    }
}
