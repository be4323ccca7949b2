//! KServe v2 health: live = the process answers; ready = every loaded model is ready.
use actix_web::{web, HttpResponse};

use crate::state::AppState;

pub async fn live() -> HttpResponse {
    HttpResponse::Ok().finish()
}

pub async fn ready(state: web::Data<AppState>) -> HttpResponse {
    if state.is_ready() {
        HttpResponse::Ok().finish()
    } else {
        HttpResponse::ServiceUnavailable().finish()
    }
}
