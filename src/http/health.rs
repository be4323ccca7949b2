//! KServe v2 health: live = the process answers; ready = every loaded model is ready.
use actix_web::{web, HttpResponse};

use crate::state::AppState;

/// Live: the process answers.
#[utoipa::path(get, path = "/v2/health/live", tag = "health",
    responses((status = 200, description = "The server is live")))]
pub async fn live() -> HttpResponse {
    HttpResponse::Ok().finish()
}

/// Ready: every loaded model is ready (a model that failed to load is reported by its own
/// status and the repository index).
#[utoipa::path(get, path = "/v2/health/ready", tag = "health",
    responses(
        (status = 200, description = "Every loaded model is ready"),
        (status = 503, description = "A model is still loading"),
    ))]
pub async fn ready(state: web::Data<AppState>) -> HttpResponse {
    if state.is_ready() {
        HttpResponse::Ok().finish()
    } else {
        HttpResponse::ServiceUnavailable().finish()
    }
}
