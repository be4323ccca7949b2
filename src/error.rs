//! One error taxonomy for the whole gateway, mapped once per transport (HTTP, gRPC).
//!
//! Every module's error type says its kind (`HasKind`) and becomes a `GatewayError` through
//! the one blanket `From` below, so handlers just use `?`. This module imports no other
//! module of the crate: the dependency points from the modules to it.
use std::fmt;

use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

/// What kind of failure, independent of the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidInput,
    UnsupportedMediaType,
    PayloadTooLarge,
    /// The request body stopped arriving.
    RequestTimeout,
    NotFound,
    /// A known path asked with a method it does not serve.
    MethodNotAllowed,
    Forbidden,
    /// The model is loading, or its load failed.
    NotReady,
    /// Every instance of the model is down and restarting.
    ModelDown,
    /// The model was unloaded or replaced after the request found it.
    ModelUnloaded,
    Overloaded,
    /// The server (or the model) is stopping: it finishes the requests it has and takes no new work.
    ShuttingDown,
    /// The client went away before its answer (nobody reads this answer; it is counted).
    Cancelled,
    DeadlineExceeded,
    /// The model failed on the batch the request's rows ran in (the log says why).
    ModelFailed,
    /// Asks for something this server does not do (Triton's `UNSUPPORTED`).
    Unsupported,
    Internal,
}

/// An error that knows its kind. Implemented by each module's error type.
pub trait HasKind {
    fn kind(&self) -> ErrorKind;
}

/// nginx's "client closed request": the status a cancelled request is logged with.
const CLIENT_CLOSED_REQUEST: u16 = 499;

impl ErrorKind {
    /// Every kind, for tables and tests.
    pub const ALL: [ErrorKind; 17] = [
        ErrorKind::InvalidInput,
        ErrorKind::UnsupportedMediaType,
        ErrorKind::PayloadTooLarge,
        ErrorKind::RequestTimeout,
        ErrorKind::NotFound,
        ErrorKind::MethodNotAllowed,
        ErrorKind::Forbidden,
        ErrorKind::NotReady,
        ErrorKind::ModelDown,
        ErrorKind::ModelUnloaded,
        ErrorKind::Overloaded,
        ErrorKind::ShuttingDown,
        ErrorKind::Cancelled,
        ErrorKind::DeadlineExceeded,
        ErrorKind::ModelFailed,
        ErrorKind::Unsupported,
        ErrorKind::Internal,
    ];

    /// The stable snake_case code in every error body.
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::InvalidInput => "invalid_input",
            ErrorKind::UnsupportedMediaType => "unsupported_media_type",
            ErrorKind::PayloadTooLarge => "payload_too_large",
            ErrorKind::RequestTimeout => "request_timeout",
            ErrorKind::NotFound => "not_found",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::Forbidden => "forbidden",
            ErrorKind::NotReady => "not_ready",
            ErrorKind::ModelDown => "model_down",
            ErrorKind::ModelUnloaded => "model_unloaded",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::ShuttingDown => "shutting_down",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::DeadlineExceeded => "deadline_exceeded",
            ErrorKind::ModelFailed => "model_failed",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Internal => "internal",
        }
    }

    pub fn grpc_code(self) -> tonic::Code {
        match self {
            ErrorKind::InvalidInput | ErrorKind::UnsupportedMediaType => {
                tonic::Code::InvalidArgument
            }
            ErrorKind::PayloadTooLarge => tonic::Code::ResourceExhausted,
            ErrorKind::NotFound => tonic::Code::NotFound,
            ErrorKind::MethodNotAllowed | ErrorKind::Unsupported => tonic::Code::Unimplemented,
            ErrorKind::Forbidden => tonic::Code::PermissionDenied,
            ErrorKind::NotReady
            | ErrorKind::ModelDown
            | ErrorKind::ModelUnloaded
            | ErrorKind::Overloaded
            | ErrorKind::ShuttingDown => tonic::Code::Unavailable,
            ErrorKind::Cancelled => tonic::Code::Cancelled,
            ErrorKind::DeadlineExceeded | ErrorKind::RequestTimeout => {
                tonic::Code::DeadlineExceeded
            }
            ErrorKind::ModelFailed | ErrorKind::Internal => tonic::Code::Internal,
        }
    }

    pub fn http_status(self) -> StatusCode {
        match self {
            ErrorKind::InvalidInput => StatusCode::BAD_REQUEST,
            ErrorKind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ErrorKind::NotReady
            | ErrorKind::ModelDown
            | ErrorKind::ModelUnloaded
            | ErrorKind::Overloaded
            | ErrorKind::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Cancelled => StatusCode::from_u16(CLIENT_CLOSED_REQUEST)
                .expect("499 is within the valid status range"),
            ErrorKind::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::ModelFailed | ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorKind::Unsupported => StatusCode::NOT_IMPLEMENTED,
        }
    }
}

/// The JSON body of every request-level error.
#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong and where (KServe v2 clients read this field).
    pub error: String,
    /// Stable snake_case kind: `invalid_input`, `unsupported_media_type`,
    /// `payload_too_large`, `request_timeout`, `not_found`, `method_not_allowed`, `forbidden`,
    /// `not_ready`, `model_down`, `model_unloaded`, `overloaded`, `shutting_down`,
    /// `cancelled`, `deadline_exceeded`, `model_failed`, `unsupported`,
    /// `internal`.
    pub code: String,
}

/// A request's error: its kind, what to tell the client, and (for the log) the error it
/// came from.
pub struct GatewayError {
    kind: ErrorKind,
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl<E: HasKind + std::error::Error + Send + Sync + 'static> From<E> for GatewayError {
    fn from(e: E) -> Self {
        GatewayError {
            kind: e.kind(),
            message: e.to_string(),
            source: Some(Box::new(e)),
        }
    }
}

impl fmt::Display for GatewayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for GatewayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(source) => write!(f, "{:?}: {source:?}", self.kind),
            None => write!(f, "{:?}: {}", self.kind, self.message),
        }
    }
}

impl GatewayError {
    /// An error found where it is raised (request validation at a transport's edge).
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        GatewayError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, message)
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn body(&self) -> ErrorBody {
        let error = if self.kind == ErrorKind::Internal {
            "internal error; see the server log".to_string()
        } else {
            self.message.clone()
        };
        ErrorBody {
            error,
            code: self.kind.code().to_string(),
        }
    }

    /// Logs the error once, where a transport maps it: internal errors with their chain,
    /// cancelled requests only at debug (their client left; nothing went wrong here).
    fn log(&self) {
        match self.kind {
            ErrorKind::Internal => tracing::error!(error = ?self, "internal error"),
            ErrorKind::Cancelled => tracing::debug!("{}", self.message),
            _ => {}
        }
    }
}

/// Seconds a client should wait before retrying an overloaded model.
const RETRY_AFTER_SECS: &str = "1";

impl ResponseError for GatewayError {
    fn status_code(&self) -> StatusCode {
        self.kind.http_status()
    }

    fn error_response(&self) -> HttpResponse {
        self.log();
        let mut resp = HttpResponse::build(self.kind.http_status());
        if self.kind == ErrorKind::Overloaded {
            resp.insert_header((header::RETRY_AFTER, RETRY_AFTER_SECS));
        }
        resp.json(self.body())
    }
}

impl From<GatewayError> for tonic::Status {
    fn from(e: GatewayError) -> tonic::Status {
        e.log();
        tonic::Status::new(e.kind.grpc_code(), e.body().error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overloaded_answers_retry_after_and_internal_hides_details() {
        let over = GatewayError::new(ErrorKind::Overloaded, "queue full");
        let resp = over.error_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(resp.headers().contains_key(header::RETRY_AFTER));

        let internal = GatewayError::new(ErrorKind::Internal, "secret stack trace");
        assert!(!internal.body().error.contains("secret"));
    }

    #[derive(Debug, thiserror::Error)]
    #[error("bad row 3")]
    struct RowError;

    impl HasKind for RowError {
        fn kind(&self) -> ErrorKind {
            ErrorKind::InvalidInput
        }
    }

    #[test]
    fn a_module_error_keeps_its_kind_and_message() {
        let e: GatewayError = RowError.into();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert_eq!(e.body().error, "bad row 3");
        assert_eq!(e.body().code, "invalid_input");
    }
}
