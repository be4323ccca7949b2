//! KServe v2 over gRPC (tonic): `inference.GRPCInferenceService`, wire-compatible with
//! `tritonclient.grpc`. The service is thin: `convert` maps messages to `kserve` types and
//! back, and every answer comes from the same state HTTP uses.
mod conn;
pub(crate) mod convert;
mod flags;
mod service;
pub mod tls;
mod wire;

use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use conn::ConnLimits;
pub use flags::GrpcFlags;
pub use service::InferenceService;
pub use wire::{check_infer_request, CheckedCodec};

use crate::pace::BodyPace;

/// Messages and service generated from `proto/grpc_service.proto`; `ModelConfig` is the
/// repository's own type (same descriptor), so `ModelConfig` returns what is on disk.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/grpc/inference.rs"));
}

/// How the gRPC listener treats its clients.
#[derive(Clone)]
pub struct GrpcSettings {
    /// Largest message, received or sent.
    pub max_message_bytes: usize,
    /// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: calls open at once on one connection.
    pub max_concurrent_streams: u32,
    /// HTTP/2 PING every so often; a client that does not answer within the timeout is
    /// dropped.
    pub keepalive_time: Duration,
    pub keepalive_timeout: Duration,
    pub connections: ConnLimits,
    pub pace: BodyPace,
    /// TLS (`--grpc-use-ssl`), `None` for plain connections.
    pub tls: Option<tls::TlsAcceptor>,
    /// A connection's age at which it is sent a GOAWAY (`--grpc-max-connection-age`; the
    /// grace after it is `ConnLimits::lifetime`).
    pub max_connection_age: Option<Duration>,
}

impl std::fmt::Debug for GrpcSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcSettings")
            .field("max_message_bytes", &self.max_message_bytes)
            .field("max_concurrent_streams", &self.max_concurrent_streams)
            .field("keepalive_time", &self.keepalive_time)
            .field("keepalive_timeout", &self.keepalive_timeout)
            .field("connections", &self.connections)
            .field("pace", &self.pace)
            .field("tls", &self.tls.is_some())
            .field("max_connection_age", &self.max_connection_age)
            .finish()
    }
}

/// Serves on `listener` until `shutdown` resolves, then drains (calls under way finish;
/// see `Gateway::stop`); `kill` ends every connection at once.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: InferenceService,
    settings: GrpcSettings,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    kill: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let drain = service.drain();
    let restrictions = service.restrictions();
    let server = pb::grpc_inference_service_server::GrpcInferenceServiceServer::new(service)
        .max_decoding_message_size(settings.max_message_bytes)
        .max_encoding_message_size(settings.max_message_bytes);
    let mut builder = tonic::transport::Server::builder();
    // The age alone: tonic's grace, when given, drops the connection at age + grace
    // without the GOAWAY at age (conn.rs ends it at age + grace instead).
    if let Some(age) = settings.max_connection_age {
        builder = builder.max_connection_age(age);
    }
    builder
        .max_concurrent_streams(Some(settings.max_concurrent_streams))
        .http2_keepalive_interval(Some(settings.keepalive_time))
        .http2_keepalive_timeout(Some(settings.keepalive_timeout))
        // h2's guard against floods of streams reset for errors (tonic turns it off).
        .http2_max_local_error_reset_streams(Some(1024))
        .layer(conn::CallLayer {
            pace: settings.pace,
            max_message: settings.max_message_bytes,
            drain,
            restrictions,
        })
        .add_service(server)
        .serve_with_incoming_shutdown(
            conn::incoming(listener, settings.connections, settings.tls, kill),
            shutdown,
        )
        .await
}

/// `serve`, with a failure logged (the task that runs it has no one to return it to).
pub async fn serve_logged(
    listener: tokio::net::TcpListener,
    service: InferenceService,
    settings: GrpcSettings,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    kill: CancellationToken,
) {
    if let Err(e) = serve(listener, service, settings, shutdown, kill).await {
        tracing::error!("gRPC server stopped: {e}");
    }
}
