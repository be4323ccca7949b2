//! KServe v2 REST (Triton's HTTP protocol): server and model metadata, readiness,
//! configuration, statistics and the repository index. Inference is in `v2_infer`. Every
//! answer comes from `kserve`, which gRPC shares.
use actix_web::{web, HttpResponse};
use serde::{Deserialize, Serialize};

use crate::error::{ErrorKind, GatewayError};
use crate::kserve;
use crate::repository::model_config_json;
use crate::state::{AppState, ServedModel};

#[derive(Serialize)]
struct ServerMetadata {
    name: &'static str,
    version: &'static str,
    extensions: Vec<&'static str>,
}

pub async fn server_metadata() -> HttpResponse {
    HttpResponse::Ok().json(ServerMetadata {
        name: kserve::SERVER_NAME,
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
    fn served<'a>(&self, state: &'a AppState) -> Result<&'a ServedModel, GatewayError> {
        kserve::resolve(state, &self.model, self.version.as_deref())
    }
}

pub async fn model_metadata(
    path: web::Path<ModelPath>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    let served = path.served(&state)?;
    Ok(HttpResponse::Ok().json(kserve::model_metadata(served.repository_model())))
}

pub async fn model_config(
    path: web::Path<ModelPath>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    let served = path.served(&state)?;
    Ok(HttpResponse::Ok().json(model_config_json(&served.repository_model().config)))
}

pub async fn model_ready(
    path: web::Path<ModelPath>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    let served = path.served(&state)?;
    // Triton answers 200 when ready and 400 when not.
    Ok(if served.is_ready() {
        HttpResponse::Ok().finish()
    } else {
        HttpResponse::BadRequest().json(crate::error::ErrorBody {
            error: format!("model '{}' is not ready", path.model),
            code: ErrorKind::NotReady.code().to_string(),
        })
    })
}

#[derive(Serialize)]
struct StatsResponse {
    model_stats: Vec<kserve::ModelStatistics>,
}

/// `GET /v2/models/stats`, `/v2/models/{m}/stats`, `/v2/models/{m}/versions/{v}/stats`.
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

#[derive(Deserialize, Default)]
pub struct IndexRequest {
    #[serde(default)]
    ready: bool,
}

/// `POST /v2/repository/index` (body optional: `{"ready": true}` lists only ready models).
pub async fn repository_index(
    body: web::Bytes,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    let request: IndexRequest = if body.iter().all(u8::is_ascii_whitespace) {
        IndexRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            GatewayError::new(
                ErrorKind::InvalidInput,
                format!("malformed repository index request: {e}"),
            )
        })?
    };
    Ok(HttpResponse::Ok().json(kserve::repository_index(&state, request.ready)))
}
