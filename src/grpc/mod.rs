//! KServe v2 over gRPC (tonic): `inference.GRPCInferenceService`, wire-compatible with
//! `tritonclient.grpc`. The service is thin: `convert` maps messages to `kserve` types and
//! back, and every answer comes from the same state HTTP uses.
mod convert;
mod service;

pub use service::InferenceService;

/// Messages and service generated from `proto/grpc_service.proto`; `ModelConfig` is the
/// repository's own type (same descriptor), so `ModelConfig` returns what is on disk.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/grpc/inference.rs"));
}

/// Starts serving on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: InferenceService,
    max_message_bytes: usize,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let server = pb::grpc_inference_service_server::GrpcInferenceServiceServer::new(service)
        .max_decoding_message_size(max_message_bytes)
        .max_encoding_message_size(max_message_bytes);
    tonic::transport::Server::builder()
        .add_service(server)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await
}

/// `serve`, with a failure logged (the task that runs it has no one to return it to).
pub async fn serve_logged(
    listener: tokio::net::TcpListener,
    service: InferenceService,
    max_message_bytes: usize,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    if let Err(e) = serve(listener, service, max_message_bytes, shutdown).await {
        tracing::error!("gRPC server stopped: {e}");
    }
}
