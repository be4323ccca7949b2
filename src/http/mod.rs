//! HTTP (actix-web): routes, extractor error bodies, the upload page.
mod body;
mod client;
mod health;
pub mod multipart;
pub mod openapi;
mod predict;
mod shm;
mod v2;
pub(crate) mod v2_infer;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::middleware::Next;
use actix_web::{web, HttpResponse};

use crate::error::{ErrorKind, GatewayError};
use crate::state::{AppState, Endpoint};

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
        .service(one_method(
            "/predict",
            Method::POST,
            web::post().to(predict::predict),
        ))
        .service(one_method(
            "/v2/health/live",
            Method::GET,
            web::get().to(health::live),
        ))
        .service(one_method(
            "/v2/health/ready",
            Method::GET,
            web::get().to(health::ready),
        ))
        .service(one_method(
            "/v2",
            Method::GET,
            web::get().to(v2::server_metadata),
        ))
        .service(one_method(
            "/v2/models/stats",
            Method::GET,
            web::get().to(v2::model_stats),
        ))
        .service(one_method(
            "/v2/repository/index",
            Method::POST,
            web::post().to(v2::repository_index),
        ))
        .service(one_method(
            "/v2/repository/models/{model}/load",
            Method::POST,
            web::post().to(v2::load_model),
        ))
        .service(one_method(
            "/v2/repository/models/{model}/unload",
            Method::POST,
            web::post().to(v2::unload_model),
        ))
        .service(one_method(
            "/v2/systemsharedmemory/status",
            Method::GET,
            web::get().to(shm::status),
        ))
        .service(one_method(
            "/v2/systemsharedmemory/region/{name}/status",
            Method::GET,
            web::get().to(shm::region_status),
        ))
        .service(one_method(
            "/v2/systemsharedmemory/region/{name}/register",
            Method::POST,
            web::post().to(shm::register),
        ))
        .service(one_method(
            "/v2/systemsharedmemory/unregister",
            Method::POST,
            web::post().to(shm::unregister_all),
        ))
        .service(one_method(
            "/v2/systemsharedmemory/region/{name}/unregister",
            Method::POST,
            web::post().to(shm::unregister),
        ));
    // CUDA shared memory: each of Triton's routes answers 501.
    for (path, method) in [
        ("/v2/cudasharedmemory/status", Method::GET),
        ("/v2/cudasharedmemory/region/{name}/status", Method::GET),
        ("/v2/cudasharedmemory/region/{name}/register", Method::POST),
        ("/v2/cudasharedmemory/unregister", Method::POST),
        (
            "/v2/cudasharedmemory/region/{name}/unregister",
            Method::POST,
        ),
    ] {
        let route = web::route().method(method.clone()).to(shm::cuda);
        cfg.service(one_method(path, method, route));
    }
    // Each model route with and without `/versions/{version}`.
    for base in [
        "/v2/models/{model}",
        "/v2/models/{model}/versions/{version}",
    ] {
        cfg.service(one_method(
            base,
            Method::GET,
            web::get().to(v2::model_metadata),
        ))
        .service(one_method(
            &format!("{base}/ready"),
            Method::GET,
            web::get().to(v2::model_ready),
        ))
        .service(one_method(
            &format!("{base}/config"),
            Method::GET,
            web::get().to(v2::model_config),
        ))
        .service(one_method(
            &format!("{base}/stats"),
            Method::GET,
            web::get().to(v2::model_stats),
        ))
        .service(one_method(
            &format!("{base}/infer"),
            Method::POST,
            web::post().to(v2_infer::infer),
        ));
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

/// Middleware (`actix_web::middleware::from_fn`): a request to a restricted endpoint
/// without its key gets 403 (`--http-restricted-api`).
pub async fn restrict(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    // The path as the router matches it (percent-decoded but for `/`, `%` and `+`), not
    // the raw one: `/v2/%72epository/...` must be classified as the route it reaches.
    let endpoint = Endpoint::of_http_path(req.match_info().as_str());
    if let Some(endpoint) = endpoint {
        let Some(state) = req.app_data::<web::Data<AppState>>() else {
            let e = GatewayError::new(ErrorKind::Internal, "the server's state is missing");
            return Ok(req.error_response(e).map_into_right_body());
        };
        if let Err(e) = state
            .server
            .keys
            .http
            .check(endpoint, header_of(req.headers()))
        {
            return Ok(req.error_response(e).map_into_right_body());
        }
    }
    Ok(next.call(req).await?.map_into_left_body())
}

/// A request header by name, as text.
pub(crate) fn header_of(
    headers: &actix_web::http::header::HeaderMap,
) -> impl Fn(&str) -> Option<String> + '_ {
    |name| Some(headers.get(name)?.to_str().ok()?.to_string())
}

async fn index() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .body(include_str!("../../static/index.html"))
}

/// A resource answering `method` with `route`, and any other method with 405 and a JSON
/// body (with `Allow`, as RFC 9110 asks).
fn one_method(path: &str, method: Method, route: actix_web::Route) -> actix_web::Resource {
    web::resource(path)
        .route(route)
        .default_service(web::to(move |req: actix_web::HttpRequest| {
            let allow = method.clone();
            async move {
                let error = GatewayError::new(
                    ErrorKind::MethodNotAllowed,
                    format!("{} {} is not served: use {allow}", req.method(), req.path()),
                );
                let mut response = actix_web::ResponseError::error_response(&error);
                if let Ok(value) = allow.as_str().parse() {
                    response
                        .headers_mut()
                        .insert(actix_web::http::header::ALLOW, value);
                }
                response
            }
        }))
}

async fn not_found(req: actix_web::HttpRequest) -> Result<HttpResponse, GatewayError> {
    Err(GatewayError::new(
        ErrorKind::NotFound,
        format!("no route for {} {}", req.method(), req.path()),
    ))
}
