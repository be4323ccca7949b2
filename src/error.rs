//! One error taxonomy for the whole gateway, mapped once per transport (HTTP, gRPC).
use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

use crate::preprocess::PreprocessError;
use crate::repository::RepositoryError;
use crate::scheduler::SchedulerError;

/// What kind of failure, independent of the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidInput,
    UnsupportedMediaType,
    PayloadTooLarge,
    NotFound,
    Forbidden,
    NotReady,
    Overloaded,
    DeadlineExceeded,
    Internal,
}

impl ErrorKind {
    /// The stable snake_case code in every error body.
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::InvalidInput => "invalid_input",
            ErrorKind::UnsupportedMediaType => "unsupported_media_type",
            ErrorKind::PayloadTooLarge => "payload_too_large",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Forbidden => "forbidden",
            ErrorKind::NotReady => "not_ready",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::DeadlineExceeded => "deadline_exceeded",
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
            ErrorKind::Forbidden => tonic::Code::PermissionDenied,
            ErrorKind::NotReady | ErrorKind::Overloaded => tonic::Code::Unavailable,
            ErrorKind::DeadlineExceeded => tonic::Code::DeadlineExceeded,
            ErrorKind::Internal => tonic::Code::Internal,
        }
    }

    pub fn http_status(self) -> StatusCode {
        match self {
            ErrorKind::InvalidInput => StatusCode::BAD_REQUEST,
            ErrorKind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ErrorKind::NotReady | ErrorKind::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// The JSON body of every request-level error.
#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong and where (KServe v2 clients read this field).
    pub error: String,
    /// Stable snake_case kind: `invalid_input`, `unsupported_media_type`,
    /// `payload_too_large`, `not_found`, `forbidden`, `not_ready`, `overloaded`,
    /// `deadline_exceeded`, `internal`.
    pub code: String,
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("{message}")]
    Request { kind: ErrorKind, message: String },
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    #[error(transparent)]
    Repository(#[from] RepositoryError),
    #[error(transparent)]
    Preprocess(#[from] PreprocessError),
}

impl GatewayError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        GatewayError::Request {
            kind,
            message: message.into(),
        }
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            GatewayError::Request { kind, .. } => *kind,
            GatewayError::Scheduler(e) => e.kind(),
            GatewayError::Repository(_) => ErrorKind::Internal,
            GatewayError::Preprocess(_) => ErrorKind::InvalidInput,
        }
    }

    pub fn body(&self) -> ErrorBody {
        let kind = self.kind();
        let error = if kind == ErrorKind::Internal {
            "internal error; see the server log".to_string()
        } else {
            self.to_string()
        };
        ErrorBody {
            error,
            code: kind.code().to_string(),
        }
    }
}

/// Seconds a client should wait before retrying an overloaded model.
const RETRY_AFTER_SECS: &str = "1";

impl ResponseError for GatewayError {
    fn status_code(&self) -> StatusCode {
        self.kind().http_status()
    }

    fn error_response(&self) -> HttpResponse {
        let kind = self.kind();
        if kind == ErrorKind::Internal {
            tracing::error!(error = ?self, "internal error");
        }
        let mut resp = HttpResponse::build(kind.http_status());
        if kind == ErrorKind::Overloaded {
            resp.insert_header((header::RETRY_AFTER, RETRY_AFTER_SECS));
        }
        resp.json(self.body())
    }
}

impl From<GatewayError> for tonic::Status {
    fn from(e: GatewayError) -> tonic::Status {
        let kind = e.kind();
        if kind == ErrorKind::Internal {
            tracing::error!(error = ?e, "internal error");
        }
        tonic::Status::new(kind.grpc_code(), e.body().error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_maps_to_its_status_and_code() {
        let table = [
            (ErrorKind::InvalidInput, 400, "invalid_input"),
            (
                ErrorKind::UnsupportedMediaType,
                415,
                "unsupported_media_type",
            ),
            (ErrorKind::PayloadTooLarge, 413, "payload_too_large"),
            (ErrorKind::NotFound, 404, "not_found"),
            (ErrorKind::Forbidden, 403, "forbidden"),
            (ErrorKind::NotReady, 503, "not_ready"),
            (ErrorKind::Overloaded, 503, "overloaded"),
            (ErrorKind::DeadlineExceeded, 504, "deadline_exceeded"),
            (ErrorKind::Internal, 500, "internal"),
        ];
        for (kind, status, code) in table {
            assert_eq!(kind.http_status().as_u16(), status, "{kind:?}");
            assert_eq!(kind.code(), code);
        }
    }

    #[test]
    fn overloaded_answers_retry_after_and_internal_hides_details() {
        let over = GatewayError::new(ErrorKind::Overloaded, "queue full");
        let resp = over.error_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(resp.headers().contains_key(header::RETRY_AFTER));

        let internal = GatewayError::new(ErrorKind::Internal, "secret stack trace");
        assert!(!internal.body().error.contains("secret"));
    }
}
