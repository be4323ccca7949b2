//! HTTP (actix-web): routes, extractor error bodies, the upload page.
mod body;
mod client;
mod health;
pub mod multipart;
pub mod openapi;
mod predict;
mod v2;
pub(crate) mod v2_infer;

use actix_web::{web, HttpResponse};

use crate::error::{ErrorKind, GatewayError};
use crate::state::AppState;

pub use client::on_connect;
pub use predict::{FileError, FileFailure, FileResult, PredictResponse, Prediction, Timing, TopK};

/// Routes and extractor configs, shared by `main` and the tests.
pub fn configure(cfg: &mut web::ServiceConfig, state: web::Data<AppState>) {
    cfg.app_data(state)
        .app_data(web::QueryConfig::default().error_handler(|err, _req| {
            GatewayError::new(ErrorKind::InvalidInput, format!("bad query string: {err}")).into()
        }))
        .app_data(web::PathConfig::default().error_handler(|err, _req| {
            GatewayError::new(ErrorKind::InvalidInput, format!("bad path: {err}")).into()
        }))
        .route("/predict", web::post().to(predict::predict))
        .route("/v2/health/live", web::get().to(health::live))
        .route("/v2/health/ready", web::get().to(health::ready))
        .route("/v2", web::get().to(v2::server_metadata))
        .route("/v2/models/stats", web::get().to(v2::model_stats))
        .route("/v2/repository/index", web::post().to(v2::repository_index))
        .route(
            "/v2/repository/models/{model}/load",
            web::post().to(v2::load_model),
        )
        .route(
            "/v2/repository/models/{model}/unload",
            web::post().to(v2::unload_model),
        );
    // Each model route with and without `/versions/{version}`.
    for base in [
        "/v2/models/{model}",
        "/v2/models/{model}/versions/{version}",
    ] {
        cfg.route(base, web::get().to(v2::model_metadata))
            .route(&format!("{base}/ready"), web::get().to(v2::model_ready))
            .route(&format!("{base}/config"), web::get().to(v2::model_config))
            .route(&format!("{base}/stats"), web::get().to(v2::model_stats))
            .route(&format!("{base}/infer"), web::post().to(v2_infer::infer));
    }
    cfg.route("/", web::get().to(index))
        // Swagger UI from the vendored crate (nothing is fetched from outside), reading the
        // document it also serves at /openapi.json.
        .route(
            "/docs",
            web::get().to(|| async {
                HttpResponse::PermanentRedirect()
                    .insert_header((actix_web::http::header::LOCATION, "/docs/"))
                    .finish()
            }),
        )
        .service(
            utoipa_swagger_ui::SwaggerUi::new("/docs/{_:.*}")
                .url("/openapi.json", openapi::document())
                // No online validator badge: /docs sends no request off the machine.
                .config(utoipa_swagger_ui::Config::new(["/openapi.json"]).validator_url("none")),
        )
        .default_service(web::to(not_found));
}

async fn index() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .body(include_str!("../../static/index.html"))
}

async fn not_found(req: actix_web::HttpRequest) -> Result<HttpResponse, GatewayError> {
    Err(GatewayError::new(
        ErrorKind::NotFound,
        format!("no route for {} {}", req.method(), req.path()),
    ))
}
