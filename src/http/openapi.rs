//! The OpenAPI document: `/predict`, health and the KServe v2 REST endpoints, generated
//! from the handlers' `#[utoipa::path]` and the DTOs' `ToSchema`. `openapi/openapi.json` is
//! this document, committed (`make openapi` rewrites it); a test fails when they drift.
use utoipa::openapi::path::{Operation, Parameter, ParameterBuilder, ParameterIn, PathItem};
use utoipa::openapi::schema::{AllOfBuilder, OneOfBuilder};
use utoipa::openapi::{
    ContentBuilder, ObjectBuilder, Ref, RefOr, Required, ResponseBuilder, Schema, Type,
};
use utoipa::OpenApi;

use super::{health, predict, shm, v2, v2_infer};

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
        shm::status,
        shm::region_status,
        shm::register,
        shm::unregister_all,
        shm::unregister,
        shm::cuda_status,
        shm::cuda_region_status,
        shm::cuda_register,
        shm::cuda_unregister_all,
        shm::cuda_unregister,
        v2::trace_setting,
        v2::update_trace_setting,
        v2::model_trace_setting,
        v2::update_model_trace_setting,
    ),
    tags(
        (name = "predict", description = "Classify uploaded images"),
        (name = "health", description = "Liveness and readiness (KServe v2)"),
        (name = "kserve", description = "KServe v2 / Triton HTTP protocol"),
        (name = "repository", description = "Triton's model repository extension"),
        (name = "trace", description = "Triton's trace extension: the trace settings, server-wide and per model"),
        (name = "shared memory", description = "Triton's system and CUDA shared memory extensions (`--allow-client-shm=true`)"),
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
        // (Not the trace setting: Triton serves it per model only.)
        .filter(|(path, _)| {
            path.starts_with("/v2/models/{model}") && !path.ends_with("/trace/setting")
        })
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
    for item in paths.values_mut() {
        *item = with_operations(item.clone(), exact_contract);
    }
    one_way_of_data(&mut doc);
    doc
}

/// A KServe input carries its data in exactly one way (`v2_infer` refuses none or two):
/// `data`, `binary_data_size` in `parameters` (the bytes follow the JSON), or
/// `shared_memory_region` in `parameters`.
fn one_way_of_data(doc: &mut utoipa::openapi::OpenApi) {
    let input = doc
        .components
        .as_mut()
        .and_then(|c| c.schemas.get_mut("JsonInput"))
        .expect("the document has JsonInput");
    let in_parameters = |name: &str| {
        ObjectBuilder::new()
            .property("parameters", ObjectBuilder::new().required(name))
            .required("parameters")
    };
    let ways = OneOfBuilder::new()
        .item(ObjectBuilder::new().required("data"))
        .item(in_parameters("binary_data_size"))
        .item(in_parameters("shared_memory_region"));
    *input = AllOfBuilder::new().item(input.clone()).item(ways).into();
}

/// Model names as `ModelName::check` takes them: no path separator or control character,
/// not `.` or `..` (and at most 255 characters: `maxLength`).
const MODEL_NAME: &str = r"^(?:[^/\\.\x00-\x1f\x7f-\x9f][^/\\\x00-\x1f\x7f-\x9f]*|\.[^/\\.\x00-\x1f\x7f-\x9f][^/\\\x00-\x1f\x7f-\x9f]*|\.\.[^/\\\x00-\x1f\x7f-\x9f]+)$";
/// A version is a number (u64; 19 digits always fit).
const MODEL_VERSION: &str = "^[0-9]{1,19}$";

/// What every operation shares: model and version parameters typed as the server checks
/// them, 400 where they can be malformed, and 403 where `--http-restricted-api` applies.
fn exact_contract(op: &mut Operation) {
    let mut names = false;
    for p in op.parameters.iter_mut().flatten() {
        let pattern = match p.name.as_str() {
            "model" => MODEL_NAME,
            "version" => MODEL_VERSION,
            _ => continue,
        };
        names = true;
        let description = p.description.take();
        *p = ParameterBuilder::from(p.clone())
            .description(description)
            .schema(Some(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some(pattern))
                    .min_length(Some(1))
                    .max_length(Some(if pattern == MODEL_NAME { 255 } else { 19 })),
            ))
            .build();
    }
    let error = |description: &str| {
        RefOr::T(
            ResponseBuilder::new()
                .description(description)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(RefOr::<Schema>::Ref(Ref::from_schema_name(
                            "ErrorBody",
                        ))))
                        .build(),
                )
                .build(),
        )
    };
    let responses = &mut op.responses.responses;
    if names {
        responses
            .entry("400".to_string())
            .or_insert_with(|| error("A malformed model name or version"));
    }
    responses.entry("403".to_string()).or_insert_with(|| {
        error(
            "The API is restricted (`--http-restricted-api`) and the request lacks its \
             header and key",
        )
    });
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
