//! Every HTTP route, declared once: its method, path, restriction category and handler.
//! `configure` serves exactly these; each route's resource carries its category, which
//! the restriction middleware reads, so a route cannot be served without one (a resource
//! without it is refused, not let through). The OpenAPI document lists the same routes
//! (a test holds the two together).
use std::sync::{Arc, OnceLock};

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{header, Method};
use actix_web::middleware::{from_fn, Next};
use actix_web::{web, HttpRequest, HttpResponse};

use super::{health, openapi, predict, shm, v2, v2_infer};
use crate::error::{ErrorKind, GatewayError};
use crate::state::{AppState, Endpoint};

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// An API of one of Triton's restricted-API categories: open unless a flag restricts
    /// its category to requests with a key.
    Api(Endpoint),
    /// Never restricted: the upload page, the API documentation.
    Open,
}

/// One route.
pub struct HttpRoute {
    pub method: Method,
    pub path: String,
    pub access: Access,
    /// In the OpenAPI document (`/openapi.json`).
    pub documented: bool,
    handler: fn(actix_web::Route) -> actix_web::Route,
}

/// Every route the server answers (anything else is 404).
pub fn routes() -> Vec<HttpRoute> {
    use Access::{Api, Open};
    use Endpoint::*;
    type Handler = fn(actix_web::Route) -> actix_web::Route;
    let route = |method: Method, path: &str, access, documented, handler: Handler| HttpRoute {
        method,
        path: path.to_string(),
        access,
        documented,
        handler,
    };
    let (get, post) = (Method::GET, Method::POST);
    let mut routes = vec![
        route(post.clone(), "/predict", Api(Inference), true, |r| {
            r.to(predict::predict)
        }),
        route(get.clone(), "/v2/health/live", Api(Health), true, |r| {
            r.to(health::live)
        }),
        route(get.clone(), "/v2/health/ready", Api(Health), true, |r| {
            r.to(health::ready)
        }),
        route(get.clone(), "/v2", Api(Metadata), true, |r| {
            r.to(v2::server_metadata)
        }),
        route(
            get.clone(),
            "/v2/models/stats",
            Api(Statistics),
            true,
            |r| r.to(v2::model_stats),
        ),
        route(
            post.clone(),
            "/v2/repository/index",
            Api(RepositoryIndex),
            true,
            |r| r.to(v2::repository_index),
        ),
        route(
            post.clone(),
            "/v2/repository/models/{model}/load",
            Api(RepositoryControl),
            true,
            |r| r.to(v2::load_model),
        ),
        route(
            post.clone(),
            "/v2/repository/models/{model}/unload",
            Api(RepositoryControl),
            true,
            |r| r.to(v2::unload_model),
        ),
        route(
            get.clone(),
            "/v2/systemsharedmemory/status",
            Api(SharedMemory),
            true,
            |r| r.to(shm::status),
        ),
        route(
            get.clone(),
            "/v2/systemsharedmemory/region/{name}/status",
            Api(SharedMemory),
            true,
            |r| r.to(shm::region_status),
        ),
        route(
            post.clone(),
            "/v2/systemsharedmemory/region/{name}/register",
            Api(SharedMemory),
            true,
            |r| r.to(shm::register),
        ),
        route(
            post.clone(),
            "/v2/systemsharedmemory/unregister",
            Api(SharedMemory),
            true,
            |r| r.to(shm::unregister_all),
        ),
        route(
            post.clone(),
            "/v2/systemsharedmemory/region/{name}/unregister",
            Api(SharedMemory),
            true,
            |r| r.to(shm::unregister),
        ),
        route(
            get.clone(),
            "/v2/cudasharedmemory/status",
            Api(SharedMemory),
            true,
            |r| r.to(shm::cuda_status),
        ),
        route(
            get.clone(),
            "/v2/cudasharedmemory/region/{name}/status",
            Api(SharedMemory),
            true,
            |r| r.to(shm::cuda_region_status),
        ),
        route(
            post.clone(),
            "/v2/cudasharedmemory/region/{name}/register",
            Api(SharedMemory),
            true,
            |r| r.to(shm::cuda_register),
        ),
        route(
            post.clone(),
            "/v2/cudasharedmemory/unregister",
            Api(SharedMemory),
            true,
            |r| r.to(shm::cuda_unregister_all),
        ),
        route(
            post.clone(),
            "/v2/cudasharedmemory/region/{name}/unregister",
            Api(SharedMemory),
            true,
            |r| r.to(shm::cuda_unregister),
        ),
        route(get.clone(), "/v2/trace/setting", Api(Trace), true, |r| {
            r.to(v2::trace_setting)
        }),
        route(post.clone(), "/v2/trace/setting", Api(Trace), true, |r| {
            r.to(v2::update_trace_setting)
        }),
        route(
            get.clone(),
            "/v2/models/{model}/trace/setting",
            Api(Trace),
            true,
            |r| r.to(v2::model_trace_setting),
        ),
        route(
            post.clone(),
            "/v2/models/{model}/trace/setting",
            Api(Trace),
            true,
            |r| r.to(v2::update_model_trace_setting),
        ),
        route(get.clone(), "/", Open, false, |r| r.to(index)),
        route(get.clone(), "/docs", Open, false, |r| r.to(docs_redirect)),
        route(get.clone(), "/docs/{file:.*}", Open, false, |r| {
            r.to(docs_file)
        }),
        route(get.clone(), "/openapi.json", Open, false, |r| {
            r.to(openapi_json)
        }),
    ];
    // Each model route with and without `/versions/{version}`.
    for base in [
        "/v2/models/{model}",
        "/v2/models/{model}/versions/{version}",
    ] {
        let model_routes: [(&Method, &str, Endpoint, Handler); 5] = [
            (&get, "", Metadata, |r| r.to(v2::model_metadata)),
            (&get, "/ready", Health, |r| r.to(v2::model_ready)),
            (&get, "/config", ModelConfig, |r| r.to(v2::model_config)),
            (&get, "/stats", Statistics, |r| r.to(v2::model_stats)),
            (&post, "/infer", Inference, |r| r.to(v2_infer::infer)),
        ];
        for (method, tail, endpoint, handler) in model_routes {
            let path = format!("{base}{tail}");
            routes.push(route(method.clone(), &path, Api(endpoint), true, handler));
        }
    }
    routes
}

/// The routes grouped by path, in declaration order: one resource serves each path.
pub fn by_path(routes: Vec<HttpRoute>) -> Vec<Vec<HttpRoute>> {
    let mut groups: Vec<Vec<HttpRoute>> = Vec::new();
    for route in routes {
        match groups.iter_mut().find(|g| g[0].path == route.path) {
            Some(group) => group.push(route),
            None => groups.push(vec![route]),
        }
    }
    groups
}

/// One path's resource: each route's handler for its method, 405 (with `Allow`) for any
/// other, and the path's access (its routes share one) checked before either.
pub fn resource(
    group: &[HttpRoute],
) -> actix_web::Resource<
    impl actix_web::dev::ServiceFactory<
        ServiceRequest,
        Config = (),
        Response = ServiceResponse<impl MessageBody>,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    let allow: Vec<Method> = group.iter().map(|r| r.method.clone()).collect();
    let mut resource = web::resource(group[0].path.as_str()).app_data(group[0].access);
    for route in group {
        resource = resource.route((route.handler)(web::route().method(route.method.clone())));
    }
    resource
        .default_service(web::to(move |req: HttpRequest| {
            let allow = allow.clone();
            async move { method_not_allowed(&req, &allow) }
        }))
        .wrap(from_fn(restrict))
}

/// A method the path does not serve: 405 with a JSON body and `Allow` (RFC 9110).
fn method_not_allowed(req: &HttpRequest, allow: &[Method]) -> HttpResponse {
    let allow = allow
        .iter()
        .map(Method::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    let error = GatewayError::new(
        ErrorKind::MethodNotAllowed,
        format!("{} {} is not served: use {allow}", req.method(), req.path()),
    );
    let mut response = actix_web::ResponseError::error_response(&error);
    if let Ok(value) = allow.parse() {
        response.headers_mut().insert(header::ALLOW, value);
    }
    response
}

/// Resource middleware: a request to a route whose category is restricted
/// (`--http-restricted-api`) and that does not carry the key gets 403. A resource without
/// an access is refused (500): the policy fails closed.
async fn restrict(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let refused = match (
        req.app_data::<Access>(),
        req.app_data::<web::Data<AppState>>(),
    ) {
        (Some(Access::Open), _) => None,
        (Some(&Access::Api(endpoint)), Some(state)) => state
            .server
            .keys
            .http
            .check(endpoint, super::header_of(req.headers()))
            .err(),
        (None, _) => Some(GatewayError::new(
            ErrorKind::Internal,
            format!("the route of {} declares no access", req.path()),
        )),
        (_, None) => Some(GatewayError::new(
            ErrorKind::Internal,
            "the server's state is missing",
        )),
    };
    match refused {
        Some(e) => Ok(req.error_response(e).map_into_right_body()),
        None => Ok(next.call(req).await?.map_into_left_body()),
    }
}

async fn index() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .body(include_str!("../../static/index.html"))
}

async fn docs_redirect() -> HttpResponse {
    HttpResponse::PermanentRedirect()
        .insert_header((header::LOCATION, "/docs/"))
        .finish()
}

/// The OpenAPI document, rendered once.
fn document_json() -> &'static [u8] {
    static DOCUMENT: OnceLock<Vec<u8>> = OnceLock::new();
    DOCUMENT.get_or_init(|| {
        serde_json::to_vec(&openapi::document()).expect("the OpenAPI document serializes")
    })
}

async fn openapi_json() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(document_json())
}

/// Swagger UI's files, from the vendored crate (nothing is fetched from outside), reading
/// the document at `/openapi.json`; no online validator badge, so `/docs` sends no request
/// off the machine.
async fn docs_file(path: web::Path<String>) -> Result<HttpResponse, GatewayError> {
    static CONFIG: OnceLock<Arc<utoipa_swagger_ui::Config<'static>>> = OnceLock::new();
    let config = CONFIG.get_or_init(|| {
        Arc::new(utoipa_swagger_ui::Config::new(["/openapi.json"]).validator_url("none"))
    });
    match utoipa_swagger_ui::serve(&path, config.clone()) {
        Ok(Some(file)) => Ok(HttpResponse::Ok()
            .content_type(file.content_type)
            .body(file.bytes.to_vec())),
        Ok(None) => Err(GatewayError::new(
            ErrorKind::NotFound,
            format!("no such file of the API docs: {path}"),
        )),
        Err(e) => Err(GatewayError::new(ErrorKind::Internal, e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::dev::ResourceDef;

    /// The route serving `method path`, matched as the router matches it.
    fn route_of<'a>(routes: &'a [HttpRoute], method: &Method, path: &str) -> Option<&'a HttpRoute> {
        routes
            .iter()
            .find(|r| r.method == *method && ResourceDef::new(r.path.as_str()).is_match(path))
    }

    #[test]
    fn every_route_has_its_category() {
        use Access::{Api, Open};
        use Endpoint::*;
        let routes = routes();
        let (get, post) = (Method::GET, Method::POST);
        for (method, path, access) in [
            (&post, "/predict", Api(Inference)),
            (&get, "/v2", Api(Metadata)),
            (&get, "/v2/health/live", Api(Health)),
            (&get, "/v2/health/ready", Api(Health)),
            (&get, "/v2/models/m", Api(Metadata)),
            (&get, "/v2/models/m/versions/1", Api(Metadata)),
            (&get, "/v2/models/m/ready", Api(Health)),
            (&get, "/v2/models/m/versions/1/ready", Api(Health)),
            (&get, "/v2/models/m/config", Api(ModelConfig)),
            (&get, "/v2/models/m/stats", Api(Statistics)),
            (&get, "/v2/models/stats", Api(Statistics)),
            (&post, "/v2/models/m/versions/1/infer", Api(Inference)),
            (&post, "/v2/models/m/infer", Api(Inference)),
            (&post, "/v2/repository/index", Api(RepositoryIndex)),
            (
                &post,
                "/v2/repository/models/m/load",
                Api(RepositoryControl),
            ),
            (
                &post,
                "/v2/repository/models/m/unload",
                Api(RepositoryControl),
            ),
            (&get, "/v2/systemsharedmemory/status", Api(SharedMemory)),
            (
                &post,
                "/v2/systemsharedmemory/region/r/register",
                Api(SharedMemory),
            ),
            (&get, "/v2/cudasharedmemory/status", Api(SharedMemory)),
            (&get, "/v2/trace/setting", Api(Trace)),
            (&post, "/v2/trace/setting", Api(Trace)),
            (&get, "/v2/models/m/trace/setting", Api(Trace)),
            (&post, "/v2/models/m/trace/setting", Api(Trace)),
            (&get, "/", Open),
            (&get, "/docs", Open),
            (&get, "/docs/index.html", Open),
            (&get, "/openapi.json", Open),
        ] {
            let route = route_of(&routes, method, path).unwrap_or_else(|| panic!("{path}"));
            assert_eq!(route.access, access, "{method} {path}");
        }
    }

    #[test]
    fn each_method_and_path_is_declared_once_and_a_path_has_one_access() {
        let routes = routes();
        for (i, a) in routes.iter().enumerate() {
            for b in &routes[i + 1..] {
                assert!(
                    a.path != b.path || a.method != b.method,
                    "{} {} is declared twice",
                    a.method,
                    a.path
                );
                assert!(
                    a.path != b.path || a.access == b.access,
                    "{}: its methods' accesses differ (one resource serves a path)",
                    a.path
                );
            }
        }
    }

    #[test]
    fn the_openapi_document_lists_exactly_the_documented_routes() {
        let document = openapi::document();
        let mut listed: Vec<(String, String)> = Vec::new();
        for (path, item) in &document.paths.paths {
            for (method, op) in [("GET", &item.get), ("POST", &item.post)] {
                if op.is_some() {
                    listed.push((method.to_string(), path.clone()));
                }
            }
            assert!(
                item.put.is_none() && item.delete.is_none() && item.patch.is_none(),
                "{path}: only GET and POST are served"
            );
        }
        let mut declared: Vec<(String, String)> = routes()
            .into_iter()
            .filter(|r| r.documented)
            .map(|r| (r.method.to_string(), r.path))
            .collect();
        listed.sort();
        declared.sort();
        assert_eq!(listed, declared);
    }
}
