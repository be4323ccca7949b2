//! The gRPC service: each RPC resolves the model through `kserve` (so an unknown model is
//! NOT_FOUND before its inputs are looked at) and converts the answer.
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures_util::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use super::convert;
use super::pb::{self, grpc_inference_service_server::GrpcInferenceService};
use crate::error::GatewayError;
use crate::kserve;
use crate::shm::ShmKind;
use crate::state::{
    load_parameters, unload_parameters, AppState, ControlParam, Drain, Restrictions, ServedModel,
};
use crate::trace::{Context, Stamp, Trace};

#[derive(Clone)]
pub struct InferenceService {
    state: Arc<AppState>,
}

/// The caller's W3C trace context, where the call's metadata carries one that parses.
fn trace_context(metadata: &tonic::metadata::MetadataMap) -> Option<Context> {
    let value = |name: &str| metadata.get(name).and_then(|v| v.to_str().ok());
    Context::parse(value("traceparent")?, value("tracestate"))
}

/// A `ModelInferRequest` run on `served` and its response, recorded into its `trace` where
/// sampled: Triton's gRPC timestamps, the wait for the request ending as it reached the
/// service (`read`: its message already whole), the send as the response is built (tonic
/// writes it after).
async fn infer_traced(
    state: &AppState,
    served: &ServedModel,
    r: pb::ModelInferRequest,
    trace: Option<Trace>,
    read: Instant,
) -> Result<pb::ModelInferResponse, Status> {
    if let Some(t) = &trace {
        t.stamp_at(Stamp::GrpcWaitreadStart, read);
        t.stamp_at(Stamp::GrpcWaitreadEnd, read);
    }
    let answer = async {
        let request = convert::infer_request(r)?;
        // A client that cancels drops this future, and with it the request's queued rows.
        kserve::infer(state, served, request, trace.as_ref()).await
    }
    .await;
    let Some(t) = &trace else {
        return Ok(convert::infer_response(answer?));
    };
    match &answer {
        Ok(_) => t.stamp(Stamp::InferResponseComplete),
        Err(e) => t.fail(&e.to_string()),
    }
    t.stamp(Stamp::GrpcSendStart);
    let response = answer.map(convert::infer_response);
    t.stamp(Stamp::GrpcSendEnd);
    Ok(response?)
}

impl InferenceService {
    pub fn new(state: Arc<AppState>) -> Self {
        Self { state }
    }

    pub fn drain(&self) -> Arc<Drain> {
        self.state.drain.clone()
    }

    /// The restricted methods (`--grpc-restricted-protocol`), checked by the call layer.
    pub fn restrictions(&self) -> Restrictions {
        self.state.server.keys.grpc.clone()
    }
}

fn version(v: &str) -> Option<&str> {
    Some(v).filter(|v| !v.is_empty())
}

/// Load/unload parameters as the transport-neutral `ControlParam`.
fn control_params(
    params: std::collections::HashMap<String, pb::ModelRepositoryParameter>,
) -> Vec<(String, ControlParam)> {
    use pb::model_repository_parameter::ParameterChoice;
    params
        .into_iter()
        .map(|(name, p)| {
            let value = match p.parameter_choice {
                Some(ParameterChoice::BoolParam(b)) => ControlParam::Bool(b),
                Some(ParameterChoice::Int64Param(i)) => ControlParam::Int(i),
                Some(ParameterChoice::StringParam(s)) => ControlParam::Text(s),
                Some(ParameterChoice::BytesParam(_)) | None => ControlParam::Other,
            };
            (name, value)
        })
        .collect()
}

type StreamInferResponses =
    Pin<Box<dyn Stream<Item = Result<pb::ModelStreamInferResponse, Status>> + Send>>;

#[tonic::async_trait]
impl GrpcInferenceService for InferenceService {
    async fn server_live(
        &self,
        _: Request<pb::ServerLiveRequest>,
    ) -> Result<Response<pb::ServerLiveResponse>, Status> {
        Ok(Response::new(pb::ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<pb::ServerReadyRequest>,
    ) -> Result<Response<pb::ServerReadyResponse>, Status> {
        Ok(Response::new(pb::ServerReadyResponse {
            ready: self.state.is_ready(),
        }))
    }

    async fn model_ready(
        &self,
        request: Request<pb::ModelReadyRequest>,
    ) -> Result<Response<pb::ModelReadyResponse>, Status> {
        let r = request.into_inner();
        // As Triton: a model or version that is not loaded is simply not ready.
        let ready = kserve::resolve(&self.state, &r.name, version(&r.version))
            .is_ok_and(|served| served.is_ready());
        Ok(Response::new(pb::ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: Request<pb::ServerMetadataRequest>,
    ) -> Result<Response<pb::ServerMetadataResponse>, Status> {
        Ok(Response::new(pb::ServerMetadataResponse {
            name: self.state.server.id.clone(),
            version: kserve::SERVER_VERSION.to_string(),
            extensions: kserve::EXTENSIONS.iter().map(|e| e.to_string()).collect(),
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<pb::ModelMetadataRequest>,
    ) -> Result<Response<pb::ModelMetadataResponse>, Status> {
        let r = request.into_inner();
        let served = kserve::resolve(&self.state, &r.name, version(&r.version))?;
        Ok(Response::new(convert::model_metadata(
            kserve::model_metadata(&self.state, &served),
        )))
    }

    async fn model_infer(
        &self,
        request: Request<pb::ModelInferRequest>,
    ) -> Result<Response<pb::ModelInferResponse>, Status> {
        // Admitted by the drain as its headers arrived (`conn::Calls`), read whole by the
        // codec before it gets here.
        let read = Instant::now();
        let (metadata, _, r) = request.into_parts();
        // The model first: an unknown model is NOT_FOUND whatever its inputs look like.
        let served = kserve::resolve(&self.state, &r.model_name, version(&r.model_version))?;
        let trace = kserve::start_trace(&self.state, &served, &r.id, || trace_context(&metadata));
        let response = infer_traced(&self.state, &served, r, trace, read).await?;
        Ok(Response::new(response))
    }

    type ModelStreamInferStream = StreamInferResponses;

    /// Each request of the stream is answered in order; an error is reported in the
    /// response's `error_message` and the stream goes on, as Triton does.
    async fn model_stream_infer(
        &self,
        request: Request<Streaming<pb::ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        let state = self.state.clone();
        let closing = self.state.drain.closing();
        // The stream's context is its call's: every request of it is the caller span's child.
        let (metadata, _, requests) = request.into_parts();
        let metadata = Arc::new(metadata);
        let responses = requests.then(move |r| {
            let state = state.clone();
            let metadata = metadata.clone();
            async move {
                let r = r?;
                let id = r.id.clone();
                let answer = async {
                    let read = Instant::now();
                    let _work = state.drain.admit().map_err(GatewayError::from)?;
                    let served = kserve::resolve(&state, &r.model_name, version(&r.model_version))?;
                    let trace =
                        kserve::start_trace(&state, &served, &r.id, || trace_context(&metadata));
                    infer_traced(&state, &served, r, trace, read).await
                }
                .await;
                Ok(match answer {
                    Ok(response) => pb::ModelStreamInferResponse {
                        error_message: String::new(),
                        infer_response: Some(response),
                    },
                    Err(status) => pb::ModelStreamInferResponse {
                        error_message: status.message().to_string(),
                        infer_response: Some(pb::ModelInferResponse {
                            id,
                            ..Default::default()
                        }),
                    },
                })
            }
        });
        // A stopping server ends open streams when it closes its listeners (Triton's
        // UNAVAILABLE); a stream the client ends just ends.
        let ended = closing.clone();
        let responses = responses.take_until(closing.cancelled_owned()).chain(
            futures_util::stream::once(async move { ended.is_cancelled() }).filter_map(
                |stopped| async move {
                    stopped.then(|| Err(Status::unavailable("the server is shutting down")))
                },
            ),
        );
        Ok(Response::new(Box::pin(responses)))
    }

    async fn model_config(
        &self,
        request: Request<pb::ModelConfigRequest>,
    ) -> Result<Response<pb::ModelConfigResponse>, Status> {
        let r = request.into_inner();
        let served = kserve::resolve(&self.state, &r.name, version(&r.version))?;
        Ok(Response::new(pb::ModelConfigResponse {
            config: Some(served.repository_model().config.clone()),
        }))
    }

    async fn model_statistics(
        &self,
        request: Request<pb::ModelStatisticsRequest>,
    ) -> Result<Response<pb::ModelStatisticsResponse>, Status> {
        let r = request.into_inner();
        let stats = kserve::model_statistics(
            &self.state,
            Some(r.name.as_str()).filter(|n| !n.is_empty()),
            version(&r.version),
        )?;
        Ok(Response::new(pb::ModelStatisticsResponse {
            model_stats: stats.into_iter().map(convert::model_statistics).collect(),
        }))
    }

    async fn repository_index(
        &self,
        request: Request<pb::RepositoryIndexRequest>,
    ) -> Result<Response<pb::RepositoryIndexResponse>, Status> {
        let r = request.into_inner();
        let models = kserve::repository_index(&self.state, r.ready)
            .into_iter()
            .map(|e| pb::repository_index_response::ModelIndex {
                name: e.name,
                version: e.version,
                state: e.state.map(|s| s.as_str().to_string()).unwrap_or_default(),
                reason: e.reason,
            })
            .collect();
        Ok(Response::new(pb::RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        request: Request<pb::RepositoryModelLoadRequest>,
    ) -> Result<Response<pb::RepositoryModelLoadResponse>, Status> {
        self.state
            .registry
            .authorize_control(&self.state.server.keys.grpc)?;
        let r = request.into_inner();
        let config = load_parameters(control_params(r.parameters))?;
        self.state
            .registry
            .load_model(&r.model_name, config)
            .await?;
        Ok(Response::new(pb::RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        request: Request<pb::RepositoryModelUnloadRequest>,
    ) -> Result<Response<pb::RepositoryModelUnloadResponse>, Status> {
        self.state
            .registry
            .authorize_control(&self.state.server.keys.grpc)?;
        let r = request.into_inner();
        let dependents = unload_parameters(control_params(r.parameters))?;
        self.state
            .registry
            .unload_model(&r.model_name, dependents)
            .await?;
        Ok(Response::new(pb::RepositoryModelUnloadResponse {}))
    }

    async fn system_shared_memory_status(
        &self,
        request: Request<pb::SystemSharedMemoryStatusRequest>,
    ) -> Result<Response<pb::SystemSharedMemoryStatusResponse>, Status> {
        let name = request.into_inner().name;
        let regions = self
            .state
            .shared_memory
            .status(Some(name.as_str()).filter(|n| !n.is_empty()))
            .map_err(GatewayError::from)?;
        let regions = regions
            .into_iter()
            .map(|r| {
                let status = pb::system_shared_memory_status_response::RegionStatus {
                    name: r.name.clone(),
                    key: r.key,
                    offset: r.offset,
                    byte_size: r.byte_size,
                };
                (r.name, status)
            })
            .collect();
        Ok(Response::new(pb::SystemSharedMemoryStatusResponse {
            regions,
        }))
    }

    async fn system_shared_memory_register(
        &self,
        request: Request<pb::SystemSharedMemoryRegisterRequest>,
    ) -> Result<Response<pb::SystemSharedMemoryRegisterResponse>, Status> {
        let r = request.into_inner();
        self.state
            .shared_memory
            .register(&r.name, &r.key, r.offset, r.byte_size)
            .map_err(GatewayError::from)?;
        Ok(Response::new(pb::SystemSharedMemoryRegisterResponse {}))
    }

    async fn system_shared_memory_unregister(
        &self,
        request: Request<pb::SystemSharedMemoryUnregisterRequest>,
    ) -> Result<Response<pb::SystemSharedMemoryUnregisterResponse>, Status> {
        let name = request.into_inner().name;
        let shm = &self.state.shared_memory;
        match name.as_str() {
            "" => shm.unregister_all(ShmKind::System),
            name => shm.unregister(ShmKind::System, name),
        }
        .map_err(GatewayError::from)?;
        Ok(Response::new(pb::SystemSharedMemoryUnregisterResponse {}))
    }

    async fn cuda_shared_memory_status(
        &self,
        request: Request<pb::CudaSharedMemoryStatusRequest>,
    ) -> Result<Response<pb::CudaSharedMemoryStatusResponse>, Status> {
        let name = request.into_inner().name;
        let regions = self
            .state
            .shared_memory
            .cuda_status(Some(name.as_str()).filter(|n| !n.is_empty()))
            .map_err(GatewayError::from)?;
        let regions = regions
            .into_iter()
            .map(|r| {
                let status = pb::cuda_shared_memory_status_response::RegionStatus {
                    name: r.name.clone(),
                    device_id: r.device_id,
                    byte_size: r.byte_size,
                };
                (r.name, status)
            })
            .collect();
        Ok(Response::new(pb::CudaSharedMemoryStatusResponse {
            regions,
        }))
    }

    async fn cuda_shared_memory_register(
        &self,
        request: Request<pb::CudaSharedMemoryRegisterRequest>,
    ) -> Result<Response<pb::CudaSharedMemoryRegisterResponse>, Status> {
        let r = request.into_inner();
        let state = self.state.clone();
        // Opening a handle is a driver call: off the connection's thread.
        let register = move || {
            let shm = &state.shared_memory;
            shm.register_cuda(&r.name, &r.raw_handle, r.device_id, r.byte_size)
        };
        tokio::task::spawn_blocking(register)
            .await
            .map_err(|_| Status::internal("the CUDA register task failed"))?
            .map_err(GatewayError::from)?;
        Ok(Response::new(pb::CudaSharedMemoryRegisterResponse {}))
    }

    async fn cuda_shared_memory_unregister(
        &self,
        request: Request<pb::CudaSharedMemoryUnregisterRequest>,
    ) -> Result<Response<pb::CudaSharedMemoryUnregisterResponse>, Status> {
        let name = request.into_inner().name;
        let state = self.state.clone();
        // Closing a region is a driver call: off the connection's thread.
        let unregister = move || {
            let shm = &state.shared_memory;
            match name.as_str() {
                "" => shm.unregister_all(ShmKind::Cuda),
                name => shm.unregister(ShmKind::Cuda, name),
            }
        };
        tokio::task::spawn_blocking(unregister)
            .await
            .map_err(|_| Status::internal("the CUDA unregister task failed"))?
            .map_err(GatewayError::from)?;
        Ok(Response::new(pb::CudaSharedMemoryUnregisterResponse {}))
    }

    async fn trace_setting(
        &self,
        request: Request<pb::TraceSettingRequest>,
    ) -> Result<Response<pb::TraceSettingResponse>, Status> {
        let r = request.into_inner();
        let model = Some(r.model_name.as_str()).filter(|m| !m.is_empty());
        let view = kserve::trace_setting(&self.state, model, || {
            if r.settings.is_empty() {
                return Ok(None);
            }
            let settings = r
                .settings
                .iter()
                .map(|(k, v)| (k.as_str(), v.value.as_slice()));
            crate::trace::api::update_from_grpc(settings).map(Some)
        })?;
        let settings = crate::trace::api::to_grpc(&view)
            .into_iter()
            .map(|(name, value)| (name, pb::trace_setting_response::SettingValue { value }))
            .collect();
        Ok(Response::new(pb::TraceSettingResponse { settings }))
    }

    async fn log_settings(
        &self,
        _: Request<pb::LogSettingsRequest>,
    ) -> Result<Response<pb::LogSettingsResponse>, Status> {
        Err(Status::unimplemented(
            "log settings cannot be changed at run time; set RUST_LOG when starting visiongate",
        ))
    }
}
