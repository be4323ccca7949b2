//! The OpenAPI document: `/predict`, health and the KServe v2 REST endpoints, generated
//! from the handlers' `#[utoipa::path]` and the DTOs' `ToSchema`. `openapi/openapi.json` is
//! this document, committed (`make openapi` rewrites it); a test fails when they drift.
use utoipa::openapi::path::{Operation, Parameter, ParameterBuilder, ParameterIn, PathItem};
use utoipa::openapi::{ObjectBuilder, Required, Type};
use utoipa::OpenApi;

use super::{health, predict, v2, v2_infer};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "visiongate",
        description = "Image classification in one binary: multipart `/predict` for many \
                       images at once, and Triton's KServe v2 REST protocol (`/v2/...`) for \
                       existing Triton clients. Every error body is `{\"error\", \"code\"}`.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    paths(
        predict::predict,
        health::live,
        health::ready,
        v2::server_metadata,
        v2::model_metadata,
        v2::model_ready,
        v2::model_config,
        v2::model_stats,
        v2_infer::infer,
        v2::repository_index,
        v2::load_model,
        v2::unload_model,
    ),
    tags(
        (name = "predict", description = "Classify uploaded images"),
        (name = "health", description = "Liveness and readiness (KServe v2)"),
        (name = "kserve", description = "KServe v2 / Triton HTTP protocol"),
        (name = "repository", description = "Triton's model repository extension"),
    )
)]
struct ApiDoc;

/// The document served at `/openapi.json` and committed as `openapi/openapi.json`.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    let paths = &mut doc.paths.paths;
    // Each per-model route also exists per version, as the server routes them
    // (`/v2/models/{model}/versions/{version}/...`).
    let per_model: Vec<(String, PathItem)> = paths
        .iter()
        .filter(|(path, _)| path.starts_with("/v2/models/{model}"))
        .map(|(path, item)| (path.clone(), item.clone()))
        .collect();
    for (path, item) in per_model {
        let versioned = path.replacen("{model}", "{model}/versions/{version}", 1);
        paths.insert(
            versioned,
            with_operations(item.clone(), |op| {
                op.operation_id = op.operation_id.take().map(|id| format!("{id}_version"));
                op.parameters
                    .get_or_insert_with(Vec::new)
                    .push(path_parameter("version", "Model version (a number)"));
            }),
        );
        if path == "/v2/models/{model}/stats" {
            // And for every model at once.
            paths.insert(
                "/v2/models/stats".to_string(),
                with_operations(item, |op| {
                    op.operation_id = Some("model_stats_all".to_string());
                    op.parameters = None;
                    op.summary = Some("Statistics of every loaded model".to_string());
                }),
            );
        }
    }
    doc
}

/// The document as the committed file holds it.
pub fn document_json() -> String {
    let mut text = document()
        .to_pretty_json()
        .expect("the OpenAPI document serializes");
    text.push('\n');
    text
}

fn with_operations(mut item: PathItem, edit: impl Fn(&mut Operation)) -> PathItem {
    for op in [&mut item.get, &mut item.post].into_iter().flatten() {
        edit(op);
    }
    item
}

fn path_parameter(name: &str, description: &str) -> Parameter {
    ParameterBuilder::new()
        .name(name)
        .parameter_in(ParameterIn::Path)
        .required(Required::True)
        .description(Some(description))
        .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
        .build()
}
