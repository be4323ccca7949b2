//! Triton's shared-memory endpoints, for system shared memory (`/v2/systemsharedmemory`)
//! and CUDA shared memory (`/v2/cudasharedmemory`): `...[/region/{name}]/status`,
//! `.../region/{name}/register`, `...[/region/{name}]/unregister`.
use actix_web::{web, HttpResponse};
use base64::Engine as _;
use serde::Deserialize;

use crate::error::{ErrorBody, ErrorKind, GatewayError};
use crate::shm::{CudaRegionStatus, RegionStatus, ShmError, ShmKind};
use crate::state::AppState;

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
    state.shared_memory.unregister_all(ShmKind::System)?;
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
    state.shared_memory.unregister(ShmKind::System, &path)?;
    Ok(HttpResponse::Ok().finish())
}

/// A CUDA region to register: the first `byte_size` bytes of the GPU allocation a CUDA IPC
/// handle names.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct CudaRegisterRequest {
    raw_handle: RawHandle,
    /// The GPU holding the allocation.
    device_id: i64,
    byte_size: u64,
}

/// A CUDA IPC handle: what `cudaIpcGetMemHandle` gives (`cudaIpcMemHandle_t`, 64 bytes),
/// in base64 (tritonclient's `cuda_shared_memory.get_raw_handle`).
#[derive(Deserialize, utoipa::ToSchema)]
pub struct RawHandle {
    #[schema(min_length = 88, max_length = 88)]
    b64: String,
}

/// `GET /v2/cudasharedmemory/status`: every registered CUDA region.
#[utoipa::path(get, path = "/v2/cudasharedmemory/status", tag = "shared memory",
    responses(
        (status = 200, description = "The registered CUDA regions", body = Vec<CudaRegionStatus>),
        (status = 403, description = "Restricted (`--http-restricted-api=shared-memory:...`) and sent without its header", body = ErrorBody),
    ))]
pub async fn cuda_status(state: web::Data<AppState>) -> Result<HttpResponse, GatewayError> {
    Ok(HttpResponse::Ok().json(state.shared_memory.cuda_status(None)?))
}

/// `GET /v2/cudasharedmemory/region/{name}/status`: one CUDA region.
#[utoipa::path(get, path = "/v2/cudasharedmemory/region/{name}/status", tag = "shared memory",
    params(("name" = String, Path, description = "Region name")),
    responses(
        (status = 200, description = "The region", body = Vec<CudaRegionStatus>),
        (status = 403, description = "Restricted and sent without its header", body = ErrorBody),
        (status = 404, description = "No CUDA region of that name", body = ErrorBody),
    ))]
pub async fn cuda_region_status(
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    Ok(HttpResponse::Ok().json(state.shared_memory.cuda_status(Some(&path))?))
}

/// `POST /v2/cudasharedmemory/region/{name}/register`.
#[utoipa::path(post, path = "/v2/cudasharedmemory/region/{name}/register", tag = "shared memory",
    params(("name" = String, Path, description = "Region name (1 to 255 bytes)")),
    request_body = CudaRegisterRequest,
    responses(
        (status = 200, description = "Registered"),
        (status = 400, description = "A bad body or handle, no such GPU, no GPU at all, a handle the driver cannot open, a byte_size beyond its allocation, a name already registered, or too many regions", body = ErrorBody),
        (status = 403, description = "Client shared memory is off (`--allow-client-shm=false`, the default), or the API is restricted and the request lacks its header", body = ErrorBody),
    ))]
pub async fn cuda_register(
    path: web::Path<String>,
    body: web::Bytes,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    state.shared_memory.allowed()?;
    let r: CudaRegisterRequest = serde_json::from_slice(&body).map_err(|e| {
        GatewayError::invalid(format!(
            "malformed CUDA shared memory register request: {e}"
        ))
    })?;
    let handle = base64::engine::general_purpose::STANDARD
        .decode(r.raw_handle.b64.as_bytes())
        .map_err(|e| {
            GatewayError::invalid(format!(
                "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t: {e}"
            ))
        })?;
    // Opening a handle is a driver call: off the connection's thread.
    let register = move || {
        let shm = &state.shared_memory;
        shm.register_cuda(&path, &handle, r.device_id, r.byte_size)
    };
    off_thread(register).await
}

/// Runs `work` (driver calls: opening or closing a CUDA region) on a blocking thread.
async fn off_thread(
    work: impl FnOnce() -> Result<(), ShmError> + Send + 'static,
) -> Result<HttpResponse, GatewayError> {
    web::block(work).await.map_err(|_| {
        GatewayError::new(ErrorKind::Internal, "the CUDA shared memory task failed")
    })??;
    Ok(HttpResponse::Ok().finish())
}

/// `POST /v2/cudasharedmemory/unregister`: every CUDA region.
#[utoipa::path(post, path = "/v2/cudasharedmemory/unregister", tag = "shared memory",
    responses(
        (status = 200, description = "Unregistered"),
        (status = 403, description = "Client shared memory is off, or the API is restricted and the request lacks its header", body = ErrorBody),
    ))]
pub async fn cuda_unregister_all(state: web::Data<AppState>) -> Result<HttpResponse, GatewayError> {
    off_thread(move || state.shared_memory.unregister_all(ShmKind::Cuda)).await
}

/// `POST /v2/cudasharedmemory/region/{name}/unregister` (also when no CUDA region has that
/// name, as Triton).
#[utoipa::path(post, path = "/v2/cudasharedmemory/region/{name}/unregister", tag = "shared memory",
    params(("name" = String, Path, description = "Region name")),
    responses(
        (status = 200, description = "Unregistered"),
        (status = 403, description = "Client shared memory is off, or the API is restricted and the request lacks its header", body = ErrorBody),
    ))]
pub async fn cuda_unregister(
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    off_thread(move || state.shared_memory.unregister(ShmKind::Cuda, &path)).await
}
