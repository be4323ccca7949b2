//! The KServe v2 protocol (Triton's flavour) without a transport: tensors in the protocol's
//! raw layout, model resolution, metadata, inference and statistics. `http::v2` and `grpc`
//! only convert their wire types to these and back, so both answer alike and share state.
mod infer;
mod params;
mod shm;
mod stats;
mod tensor;

pub use infer::{
    image_rows, infer, ImageRows, InferRequest, InferResponse, OutputTensor, RequestedOutput,
    RowLimit,
};
pub use params::{Param, Params};
pub use stats::{model_statistics, DurationStat, ModelStatistics};
pub use tensor::{
    bytes_elements, count_bytes_elements, element_count, encode_bytes_elements, DataType,
    InputTensor,
};

use crate::domain::ModelVersion;
use crate::error::{ErrorKind, GatewayError};
use crate::repository::pb;
use crate::state::{AppState, ServedModel};

pub const SERVER_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The protocol extensions this server implements, as reported in server metadata.
pub const EXTENSIONS: [&str; 8] = [
    "classification",
    "binary_tensor_data",
    "statistics",
    "model_configuration",
    "model_repository",
    "system_shared_memory",
    "cuda_shared_memory",
    "trace",
];

#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct TensorMetadata {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct ModelMetadata {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: String,
    pub inputs: Vec<TensorMetadata>,
    pub outputs: Vec<TensorMetadata>,
    /// visiongate's addition (HTTP only): where each loaded instance of a classifier runs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<InstancePlacement>,
    /// visiongate's addition (HTTP only): why a classifier's instances do not run where
    /// its config puts them (e.g. `KIND_GPU` on a host without usable GPUs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement_fallback: Option<String>,
}

/// One model instance and its device.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct InstancePlacement {
    /// The instance (`gpu0/1`: the second instance on GPU 0; `cpu/0`).
    pub name: String,
    /// `cpu` or `cuda:N`.
    pub device: String,
}

/// The served model called `model`, in `version` when one is given (empty means its
/// newest).
pub fn resolve(
    state: &AppState,
    model: &str,
    version: Option<&str>,
) -> Result<ServedModel, GatewayError> {
    let version = match version.filter(|v| !v.is_empty()) {
        None => None,
        Some(v) => Some(ModelVersion(v.parse().map_err(|_| {
            GatewayError::new(
                ErrorKind::InvalidInput,
                format!("model version must be a number, got '{v}'"),
            )
        })?)),
    };
    Ok(state.registry.model_version(model, version)?)
}

/// Triton's trace extension, for both transports: the setting `model` traces by (`None`:
/// the server-wide one) after the update `read` reads from the request (none: read only).
/// A model must be ready, as Triton asks (its words when not), and is checked before the
/// update is read.
pub fn trace_setting(
    state: &AppState,
    model: Option<&str>,
    read: impl FnOnce() -> Result<Option<crate::trace::setting::Update>, GatewayError>,
) -> Result<crate::trace::setting::View, GatewayError> {
    if let Some(name) = model {
        if !state.registry.model(name).is_ok_and(|m| m.is_ready()) {
            return Err(GatewayError::invalid(format!(
                "Request for unknown model : {}",
                name.chars().take(256).collect::<String>()
            )));
        }
    }
    let settings = &state.server.trace.settings;
    match read()? {
        None => Ok(settings.get(model)),
        Some(update) => settings
            .update(model, &update)
            .map_err(|e| GatewayError::invalid(e.to_string())),
    }
}

/// The trace of a request of `served` where the trace setting samples it; `context` is
/// the caller's (`traceparent`, `tracestate`).
pub fn start_trace(
    state: &AppState,
    served: &ServedModel,
    request_id: &str,
    context: impl FnOnce() -> Option<crate::trace::Context>,
) -> Option<crate::trace::Trace> {
    let model = served.repository_model();
    state
        .server
        .trace
        .start(model.name.as_str(), model.version.0, request_id, context)
}

/// Triton's datatype names: the config's `TYPE_X` without the prefix, `STRING` as `BYTES`.
pub fn datatype_name(t: pb::DataType) -> String {
    match t {
        pb::DataType::TypeString => "BYTES".to_string(),
        other => other.as_str_name().trim_start_matches("TYPE_").to_string(),
    }
}

/// Model metadata as Triton reports it: with batching, the batch dimension is a leading -1;
/// `versions` lists every served version of the model.
pub fn model_metadata(state: &AppState, served: &ServedModel) -> ModelMetadata {
    let m = served.repository_model();
    let c = &m.config;
    let (instances, placement_fallback) = match served {
        ServedModel::Classifier { handle, .. } => handle.placement(),
        _ => (Vec::new(), None),
    };
    let shape = |dims: &[i64]| -> Vec<i64> {
        let batch = (c.max_batch_size > 0).then_some(-1);
        batch.into_iter().chain(dims.iter().copied()).collect()
    };
    ModelMetadata {
        name: m.name.to_string(),
        versions: state
            .registry
            .models()
            .versions(m.name.as_str())
            .map(|v| v.keys().map(|v| v.to_string()).collect())
            .unwrap_or_else(|| vec![m.version.to_string()]),
        platform: if c.platform.is_empty() {
            c.backend.clone()
        } else {
            c.platform.clone()
        },
        inputs: c
            .input
            .iter()
            .map(|i| TensorMetadata {
                name: i.name.clone(),
                datatype: datatype_name(i.data_type()),
                shape: shape(&i.dims),
            })
            .collect(),
        outputs: c
            .output
            .iter()
            .map(|o| TensorMetadata {
                name: o.name.clone(),
                datatype: datatype_name(o.data_type()),
                shape: shape(&o.dims),
            })
            .collect(),
        instances: instances
            .into_iter()
            .map(|(name, device)| InstancePlacement { name, device })
            .collect(),
        placement_fallback,
    }
}

/// One model of the repository index.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct IndexEntry {
    pub name: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub version: String,
    /// Triton's model state; none for a model never loaded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<IndexState>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// A model's state in the repository index, as Triton names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum IndexState {
    Ready,
    Loading,
    Unavailable,
}

impl IndexState {
    pub fn as_str(self) -> &'static str {
        match self {
            IndexState::Ready => "READY",
            IndexState::Loading => "LOADING",
            IndexState::Unavailable => "UNAVAILABLE",
        }
    }
}

/// Every model of the repository, served or not (with why), sorted by name: one entry
/// per served version.
pub fn repository_index(state: &AppState, ready_only: bool) -> Vec<IndexEntry> {
    let table = state.registry.models();
    let served = table.all().map(|served| {
        let m = served.repository_model();
        let (state, reason) = if served.is_ready() {
            (IndexState::Ready, String::new())
        } else if let Some(why) = served.failure() {
            (IndexState::Unavailable, why)
        } else {
            (IndexState::Loading, String::new())
        };
        IndexEntry {
            name: m.name.to_string(),
            version: m.version.to_string(),
            state: Some(state),
            reason,
        }
    });
    let unavailable = table.entries().filter_map(|(name, e)| {
        Some(IndexEntry {
            name: name.to_string(),
            version: String::new(),
            state: Some(IndexState::Unavailable),
            reason: e.unavailable.clone()?,
        })
    });
    // Models of the repository never loaded (explicit mode): the name alone, as Triton.
    let known = |name: &str| {
        table
            .entry(name)
            .is_some_and(|e| !e.served.is_empty() || e.unavailable.is_some())
    };
    let never_loaded = state
        .registry
        .repositories
        .model_names()
        .into_iter()
        .filter(|name| !known(name))
        .map(|name| IndexEntry {
            name,
            version: String::new(),
            state: None,
            reason: String::new(),
        });
    let mut out: Vec<IndexEntry> = served
        .chain(unavailable)
        .chain(never_loaded)
        .filter(|e| !ready_only || e.state == Some(IndexState::Ready))
        .collect();
    let version = |e: &IndexEntry| e.version.parse::<u64>().ok();
    out.sort_by(|a, b| (&a.name, version(a)).cmp(&(&b.name, version(b))));
    out
}
