//! KServe v2 health: live = the process answers; ready = every loaded model is ready. The
//! bodies are KServe's (`{"live": true}`, `{"ready": true}`); Triton sends none, and its
//! clients read only the status, which is Triton's.
use actix_web::{web, HttpResponse};
use serde::Serialize;

use crate::state::AppState;

/// KServe v2's server live response.
#[derive(Serialize, utoipa::ToSchema)]
pub struct LiveBody {
    pub live: bool,
}

/// KServe v2's server ready response.
#[derive(Serialize, utoipa::ToSchema)]
pub struct ReadyBody {
    pub ready: bool,
}

/// Live: the process answers.
#[utoipa::path(get, path = "/v2/health/live", tag = "health",
    responses((status = 200, description = "The server is live", body = LiveBody)))]
pub async fn live() -> HttpResponse {
    HttpResponse::Ok().json(LiveBody { live: true })
}

/// Ready: every loaded model is ready (a model that failed to load is reported by its own
/// status and the repository index), and the server is not stopping.
#[utoipa::path(get, path = "/v2/health/ready", tag = "health",
    responses(
        (status = 200, description = "Every loaded model is ready", body = ReadyBody),
        (status = 503, description = "A model is still loading, or the server is stopping",
            body = ReadyBody),
    ))]
pub async fn ready(state: web::Data<AppState>) -> HttpResponse {
    let ready = state.is_ready();
    let body = ReadyBody { ready };
    if ready {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}
