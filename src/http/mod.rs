//! HTTP (actix-web): routes, extractor error bodies, the upload page.
mod body;
mod client;
mod health;
pub mod multipart;
pub mod openapi;
mod predict;
pub mod routes;
mod shm;
mod v2;
pub(crate) mod v2_infer;
mod v2_json;

use actix_web::{web, HttpResponse};

use crate::error::{ErrorKind, GatewayError};
use crate::state::AppState;

pub use body::check_length;
pub use client::on_connect;
pub use predict::{FileError, FileFailure, FileResult, PredictResponse, Prediction, Timing, TopK};

/// Routes (every one from `routes::routes`) and extractor configs, shared by `main` and the
/// tests.
pub fn configure(cfg: &mut web::ServiceConfig, state: web::Data<AppState>) {
    cfg.app_data(state)
        .app_data(web::QueryConfig::default().error_handler(|err, _req| {
            GatewayError::new(ErrorKind::InvalidInput, format!("bad query string: {err}")).into()
        }))
        .app_data(web::PathConfig::default().error_handler(|err, _req| {
            GatewayError::new(ErrorKind::InvalidInput, format!("bad path: {err}")).into()
        }));
    for group in routes::by_path(routes::routes()) {
        cfg.service(routes::resource(&group));
    }
    cfg.default_service(web::to(not_found));
}

/// A request header by name, as text.
pub(crate) fn header_of(
    headers: &actix_web::http::header::HeaderMap,
) -> impl Fn(&str) -> Option<String> + '_ {
    |name| Some(headers.get(name)?.to_str().ok()?.to_string())
}

async fn not_found(req: actix_web::HttpRequest) -> Result<HttpResponse, GatewayError> {
    Err(GatewayError::new(
        ErrorKind::NotFound,
        format!("no route for {} {}", req.method(), req.path()),
    ))
}
