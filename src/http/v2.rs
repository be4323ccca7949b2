//! KServe v2 REST (Triton's HTTP protocol): server and model metadata, readiness,
//! configuration, statistics and the repository index. Inference is in `v2_infer`. Every
//! answer comes from `kserve`, which gRPC shares.
use actix_web::{web, HttpResponse};
use serde::{Deserialize, Serialize};

use crate::error::{ErrorBody, ErrorKind, GatewayError};
use crate::kserve;
use crate::kserve::{IndexEntry, ModelMetadata};
use crate::repository::model_config_json;
use crate::state::{load_parameters, unload_parameters, AppState, ControlParam, ServedModel};

#[derive(Serialize, utoipa::ToSchema)]
pub struct ServerMetadata {
    /// The server's id (Triton's `--id`; default `visiongate`).
    name: String,
    version: &'static str,
    /// The protocol extensions served (Triton's names).
    extensions: Vec<&'static str>,
}

/// Server name, version and protocol extensions.
#[utoipa::path(get, path = "/v2", tag = "kserve",
    responses((status = 200, description = "Server metadata", body = ServerMetadata)))]
pub async fn server_metadata(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(ServerMetadata {
        name: state.server.id.clone(),
        version: kserve::SERVER_VERSION,
        extensions: kserve::EXTENSIONS.to_vec(),
    })
}

/// `{model}` or `{model}/versions/{version}` of a path.
#[derive(Deserialize)]
pub struct ModelPath {
    model: String,
    version: Option<String>,
}

impl ModelPath {
    fn served(&self, state: &AppState) -> Result<ServedModel, GatewayError> {
        kserve::resolve(state, &self.model, self.version.as_deref())
    }
}

/// A model's name, versions, platform and tensors (the batch dimension is -1).
#[utoipa::path(get, path = "/v2/models/{model}", tag = "kserve",
    params(("model" = String, Path, description = "Model name")),
    responses(
        (status = 200, description = "Model metadata", body = ModelMetadata),
        (status = 400, description = "The version is not a number", body = ErrorBody),
        (status = 404, description = "Unknown model or version", body = ErrorBody),
    ))]
pub async fn model_metadata(
    path: web::Path<ModelPath>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    let served = path.served(&state)?;
    Ok(HttpResponse::Ok().json(kserve::model_metadata(&state, &served)))
}

/// The model's configuration as Triton returns it: its `config.pbtxt` in the protobuf
/// JSON mapping (proto field names, enums by name, every field present).
#[utoipa::path(get, path = "/v2/models/{model}/config", tag = "kserve",
    params(("model" = String, Path, description = "Model name")),
    responses(
        (status = 200, description = "Triton `ModelConfig` as JSON", body = Object),
        (status = 404, description = "Unknown model or version", body = ErrorBody),
    ))]
pub async fn model_config(
    path: web::Path<ModelPath>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    let served = path.served(&state)?;
    Ok(HttpResponse::Ok().json(model_config_json(&served.repository_model().config)))
}

/// KServe v2's model ready response.
#[derive(Serialize, utoipa::ToSchema)]
pub struct ModelReadyBody {
    pub name: String,
    pub ready: bool,
}

/// 200 when the model is ready; 400 while it is not (as Triton).
#[utoipa::path(get, path = "/v2/models/{model}/ready", tag = "kserve",
    params(("model" = String, Path, description = "Model name")),
    responses(
        (status = 200, description = "The model is ready", body = ModelReadyBody),
        (status = 400, description = "The model is loading or failed", body = ErrorBody),
        (status = 404, description = "Unknown model or version", body = ErrorBody),
    ))]
pub async fn model_ready(
    path: web::Path<ModelPath>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    let served = path.served(&state)?;
    // Triton answers 200 when ready and 400 when not.
    Ok(if served.is_ready() {
        HttpResponse::Ok().json(ModelReadyBody {
            name: path.model.clone(),
            ready: true,
        })
    } else {
        HttpResponse::BadRequest().json(crate::error::ErrorBody {
            error: format!("model '{}' is not ready", path.model),
            code: ErrorKind::NotReady.code().to_string(),
        })
    })
}

/// `{model}` of a per-model trace setting's path (Triton serves no per-version one).
#[derive(Deserialize)]
pub struct TraceModelPath {
    model: String,
}

/// The trace setting a model traces by (its own, else the server-wide one), as Triton's
/// trace extension answers: every value a string but `trace_level`'s list.
#[utoipa::path(get, path = "/v2/models/{model}/trace/setting", tag = "trace",
    params(("model" = String, Path, description = "Model name")),
    responses(
        (status = 200, description = "The trace setting", body = Object),
        (status = 400, description = "Unknown model", body = ErrorBody),
    ))]
pub async fn model_trace_setting(
    path: web::Path<TraceModelPath>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    trace_answer(&state, Some(&path.model), None)
}

/// Changes a model's trace setting: a JSON object of the settings to change (`trace_level`
/// a list of `OFF`, `TIMESTAMPS`, `TENSORS`; `trace_rate`, `trace_count`, `log_frequency`
/// strings), `null` to go back to the server-wide value; answers the setting then in force.
#[utoipa::path(post, path = "/v2/models/{model}/trace/setting", tag = "trace",
    params(("model" = String, Path, description = "Model name")),
    request_body(content = Option<Object>, description = "The settings to change (optional)"),
    responses(
        (status = 200, description = "The trace setting", body = Object),
        (status = 400, description = "Unknown model, or a malformed or invalid setting", body = ErrorBody),
        (status = 501, description = "`trace_file` cannot be changed", body = ErrorBody),
    ))]
pub async fn update_model_trace_setting(
    path: web::Path<TraceModelPath>,
    state: web::Data<AppState>,
    body: web::Bytes,
) -> Result<HttpResponse, GatewayError> {
    trace_answer(&state, Some(&path.model), Some(&body))
}

/// The server-wide trace setting (`--trace-config`, as changed since).
#[utoipa::path(get, path = "/v2/trace/setting", tag = "trace",
    responses((status = 200, description = "The trace setting", body = Object)))]
pub async fn trace_setting(state: web::Data<AppState>) -> Result<HttpResponse, GatewayError> {
    trace_answer(&state, None, None)
}

/// Changes the server-wide trace setting (as a model's; `null` goes back to the
/// `--trace-config` value).
#[utoipa::path(post, path = "/v2/trace/setting", tag = "trace",
    request_body(content = Option<Object>, description = "The settings to change (optional)"),
    responses(
        (status = 200, description = "The trace setting", body = Object),
        (status = 400, description = "A malformed or invalid setting", body = ErrorBody),
        (status = 501, description = "`trace_file` cannot be changed", body = ErrorBody),
    ))]
pub async fn update_trace_setting(
    state: web::Data<AppState>,
    body: web::Bytes,
) -> Result<HttpResponse, GatewayError> {
    trace_answer(&state, None, Some(&body))
}

/// The trace setting `model` (`None`: the server) goes by, after the update in `body`.
fn trace_answer(
    state: &AppState,
    model: Option<&str>,
    body: Option<&[u8]>,
) -> Result<HttpResponse, GatewayError> {
    let view = kserve::trace_setting(state, model, || {
        body.map(crate::trace::api::update_from_json).transpose()
    })?;
    Ok(HttpResponse::Ok().json(crate::trace::api::to_json(&view)))
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct StatsResponse {
    model_stats: Vec<kserve::ModelStatistics>,
}

/// `GET /v2/models/stats`, `/v2/models/{m}/stats`, `/v2/models/{m}/versions/{v}/stats`:
/// Triton's statistics extension, from the same counters as the Prometheus metrics.
#[utoipa::path(get, path = "/v2/models/{model}/stats", tag = "kserve",
    params(("model" = String, Path, description = "Model name")),
    responses(
        (status = 200, description = "Statistics per served version", body = StatsResponse),
        (status = 404, description = "Unknown model or version", body = ErrorBody),
    ))]
pub async fn model_stats(
    path: Option<web::Path<ModelPath>>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    let (model, version) = match &path {
        Some(p) => (Some(p.model.as_str()), p.version.as_deref()),
        None => (None, None),
    };
    Ok(HttpResponse::Ok().json(StatsResponse {
        model_stats: kserve::model_statistics(&state, model, version)?,
    }))
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
pub struct IndexRequest {
    /// Only the models ready for inference.
    #[serde(default)]
    ready: bool,
}

/// `POST /v2/repository/index` (body optional: `{"ready": true}` lists only ready models).
/// Every model directory of the repository: served versions with their state, unloaded
/// or failed models as `UNAVAILABLE` with the reason, never-loaded models by name.
#[utoipa::path(post, path = "/v2/repository/index", tag = "repository",
    request_body(content = Option<IndexRequest>, description = "Optional"),
    responses(
        (status = 200, description = "The repository index", body = Vec<IndexEntry>),
        (status = 400, description = "Malformed request", body = ErrorBody),
    ))]
pub async fn repository_index(
    body: web::Bytes,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    let request: IndexRequest = json_object_or_null(&body).map_err(|e| {
        GatewayError::new(
            ErrorKind::InvalidInput,
            format!("malformed repository index request: {e}"),
        )
    })?;
    Ok(HttpResponse::Ok().json(kserve::repository_index(&state, request.ready)))
}

/// A load or unload request. Load: `config` (a `ModelConfig` as a JSON string) replaces
/// `config.pbtxt`. Unload: `unload_dependents` (boolean) unloads an ensemble's steps too.
#[derive(Deserialize, Default)]
pub struct ControlRequest {
    #[serde(default)]
    parameters: serde_json::Map<String, serde_json::Value>,
}

/// A load request (documentation: the handler reads a `ControlRequest`, and refuses the
/// parameters not listed here).
#[derive(Deserialize, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct LoadRequest {
    #[serde(default)]
    parameters: LoadParameters,
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[allow(dead_code)]
#[serde(deny_unknown_fields)]
pub struct LoadParameters {
    /// A `ModelConfig` as JSON, used instead of the model's `config.pbtxt`.
    #[serde(default)]
    config: String,
}

/// An unload request (documentation, as `LoadRequest`).
#[derive(Deserialize, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct UnloadRequest {
    #[serde(default)]
    parameters: UnloadParameters,
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[allow(dead_code)]
#[serde(deny_unknown_fields)]
pub struct UnloadParameters {
    /// Unload an ensemble's steps too (unless another loaded ensemble uses them).
    #[serde(default)]
    unload_dependents: bool,
}

/// An optional JSON body: nothing or `null` is the default; otherwise an object (serde
/// would also read a struct from an array).
fn json_object_or_null<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    match serde_json::from_slice::<serde_json::Value>(body).map_err(|e| e.to_string())? {
        serde_json::Value::Null => Ok(T::default()),
        v @ serde_json::Value::Object(_) => serde_json::from_value(v).map_err(|e| e.to_string()),
        _ => Err("expected a JSON object".into()),
    }
}

/// The parameters of a load or unload request body (an empty body has none).
fn control_parameters(body: &web::Bytes) -> Result<Vec<(String, ControlParam)>, GatewayError> {
    let request: ControlRequest = json_object_or_null(body).map_err(|e| {
        GatewayError::new(
            ErrorKind::InvalidInput,
            format!("malformed repository request: {e}"),
        )
    })?;
    Ok(request
        .parameters
        .into_iter()
        .map(|(name, value)| {
            let value = match value {
                serde_json::Value::Bool(b) => ControlParam::Bool(b),
                serde_json::Value::String(s) => ControlParam::Text(s),
                serde_json::Value::Number(n) => {
                    n.as_i64().map_or(ControlParam::Other, ControlParam::Int)
                }
                _ => ControlParam::Other,
            };
            (name, value)
        })
        .collect())
}

/// `POST /v2/repository/models/{m}/load`: loads or reloads the model from the repository
/// (explicit mode, with the control key), with the `config` parameter instead of its
/// `config.pbtxt` when given. Returns once it serves.
#[utoipa::path(post, path = "/v2/repository/models/{model}/load", tag = "repository",
    params(("model" = String, Path, description = "Model name")),
    request_body(content = Option<LoadRequest>, description = "Optional"),
    responses(
        (status = 200, description = "Done"),
        (status = 400, description = "Not explicit mode, an unknown model, a bad parameter or a failed load (the previous versions keep serving)", body = ErrorBody),
        (status = 403, description = "Without the model-repository key's header (`--http-restricted-api`, `--repository-control-key`), or none configured", body = ErrorBody),
    ))]
pub async fn load_model(
    path: web::Path<String>,
    body: web::Bytes,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    state.registry.authorize_control(&state.server.keys.http)?;
    let config = load_parameters(control_parameters(&body)?)?;
    state.registry.load_model(&path, config).await?;
    Ok(HttpResponse::Ok().finish())
}

/// `POST /v2/repository/models/{m}/unload`: the model stops taking requests; those it
/// admitted finish. `unload_dependents` unloads an ensemble's steps too.
#[utoipa::path(post, path = "/v2/repository/models/{model}/unload", tag = "repository",
    params(("model" = String, Path, description = "Model name")),
    request_body(content = Option<UnloadRequest>, description = "Optional"),
    responses(
        (status = 200, description = "Unloaded (also when it was not loaded, as Triton)"),
        (status = 400, description = "Not explicit mode, or a bad parameter", body = ErrorBody),
        (status = 403, description = "Without the model-repository key's header (`--http-restricted-api`, `--repository-control-key`), or none configured", body = ErrorBody),
    ))]
pub async fn unload_model(
    path: web::Path<String>,
    body: web::Bytes,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    state.registry.authorize_control(&state.server.keys.http)?;
    let dependents = unload_parameters(control_parameters(&body)?)?;
    state.registry.unload_model(&path, dependents).await?;
    Ok(HttpResponse::Ok().finish())
}
