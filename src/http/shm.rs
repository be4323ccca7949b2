//! Triton's shared-memory endpoints: `/v2/systemsharedmemory[/region/{name}]/status`,
//! `.../region/{name}/register`, `...[/region/{name}]/unregister`. CUDA shared memory
//! (`/v2/cudasharedmemory/...`) answers 501 with what to use instead.
use actix_web::{web, HttpResponse};
use serde::Deserialize;

use crate::error::{ErrorBody, GatewayError};
use crate::state::{AppState, RegionStatus, ShmError};

/// A region to register: `byte_size` bytes at `offset` of the shared-memory object `key`.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct RegisterRequest {
    /// The `shm_open` key of an object the client created (e.g. `/input_data`).
    #[schema(min_length = 1, max_length = 256)]
    key: String,
    /// Where the region starts in the object, in bytes.
    #[serde(default)]
    offset: u64,
    byte_size: u64,
}

/// `GET /v2/systemsharedmemory/status`: every registered region.
#[utoipa::path(get, path = "/v2/systemsharedmemory/status", tag = "shared memory",
    responses(
        (status = 200, description = "The registered regions", body = Vec<RegionStatus>),
        (status = 403, description = "Restricted (`--http-restricted-api=shared-memory:...`) and sent without its header", body = ErrorBody),
    ))]
pub async fn status(state: web::Data<AppState>) -> Result<HttpResponse, GatewayError> {
    Ok(HttpResponse::Ok().json(state.shared_memory.status(None)?))
}

/// `GET /v2/systemsharedmemory/region/{name}/status`: one region.
#[utoipa::path(get, path = "/v2/systemsharedmemory/region/{name}/status", tag = "shared memory",
    params(("name" = String, Path, description = "Region name")),
    responses(
        (status = 200, description = "The region", body = Vec<RegionStatus>),
        (status = 403, description = "Restricted and sent without its header", body = ErrorBody),
        (status = 404, description = "No region of that name", body = ErrorBody),
    ))]
pub async fn region_status(
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    Ok(HttpResponse::Ok().json(state.shared_memory.status(Some(&path))?))
}

/// `POST /v2/systemsharedmemory/region/{name}/register`.
#[utoipa::path(post, path = "/v2/systemsharedmemory/region/{name}/register", tag = "shared memory",
    params(("name" = String, Path, description = "Region name (1 to 255 bytes)")),
    request_body = RegisterRequest,
    responses(
        (status = 200, description = "Registered"),
        (status = 400, description = "A bad body or key, a name already registered, a region beyond its object, or too many regions", body = ErrorBody),
        (status = 403, description = "Client shared memory is off (`--allow-client-shm=false`, the default), or the API is restricted and the request lacks its header", body = ErrorBody),
    ))]
pub async fn register(
    path: web::Path<String>,
    body: web::Bytes,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    // Off: refused whatever the body says.
    state.shared_memory.allowed()?;
    let r: RegisterRequest = serde_json::from_slice(&body).map_err(|e| {
        GatewayError::invalid(format!("malformed shared memory register request: {e}"))
    })?;
    state
        .shared_memory
        .register(&path, &r.key, r.offset, r.byte_size)?;
    Ok(HttpResponse::Ok().finish())
}

/// `POST /v2/systemsharedmemory/unregister`: every region.
#[utoipa::path(post, path = "/v2/systemsharedmemory/unregister", tag = "shared memory",
    responses(
        (status = 200, description = "Unregistered"),
        (status = 403, description = "Client shared memory is off, or the API is restricted and the request lacks its header", body = ErrorBody),
    ))]
pub async fn unregister_all(state: web::Data<AppState>) -> Result<HttpResponse, GatewayError> {
    state.shared_memory.unregister_all()?;
    Ok(HttpResponse::Ok().finish())
}

/// `POST /v2/systemsharedmemory/region/{name}/unregister` (also when it is not registered,
/// as Triton).
#[utoipa::path(post, path = "/v2/systemsharedmemory/region/{name}/unregister", tag = "shared memory",
    params(("name" = String, Path, description = "Region name")),
    responses(
        (status = 200, description = "Unregistered"),
        (status = 403, description = "Client shared memory is off, or the API is restricted and the request lacks its header", body = ErrorBody),
    ))]
pub async fn unregister(
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    state.shared_memory.unregister(&path)?;
    Ok(HttpResponse::Ok().finish())
}

/// `/v2/cudasharedmemory/...`: 501 (not in the OpenAPI document: nothing is served there).
pub async fn cuda() -> Result<HttpResponse, GatewayError> {
    Err(ShmError::Cuda.into())
}
