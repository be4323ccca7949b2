//! The KServe v2 protocol (Triton's flavour) without a transport: tensors in the protocol's
//! raw layout, model resolution, metadata, inference and statistics. `http::v2` and `grpc`
//! only convert their wire types to these and back, so both answer alike and share state.
mod infer;
mod stats;
mod tensor;

pub use infer::{infer, InferRequest, InferResponse, OutputTensor, RequestedOutput};
pub use stats::{model_statistics, DurationStat, ModelStatistics};
pub use tensor::{encode_bytes_elements, split_bytes_elements, DataType, InputTensor};

use crate::error::{ErrorKind, GatewayError};
use crate::repository::{pb, RepositoryModel};
use crate::state::{AppState, ServedModel};

pub const SERVER_NAME: &str = "visiongate";
pub const SERVER_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The protocol extensions this server implements, as reported in server metadata.
pub const EXTENSIONS: [&str; 5] = [
    "classification",
    "binary_tensor_data",
    "statistics",
    "model_configuration",
    "model_repository",
];

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TensorMetadata {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelMetadata {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: String,
    pub inputs: Vec<TensorMetadata>,
    pub outputs: Vec<TensorMetadata>,
}

/// The served model called `model` (in version `version` when one is given; empty means
/// the served one).
pub fn resolve<'a>(
    state: &'a AppState,
    model: &str,
    version: Option<&str>,
) -> Result<&'a ServedModel, GatewayError> {
    let served = state.model(model)?;
    if let Some(v) = version.filter(|v| !v.is_empty()) {
        let loaded = served.repository_model().version;
        let asked: u64 = v.parse().map_err(|_| {
            GatewayError::new(
                ErrorKind::InvalidInput,
                format!("model version must be a number, got '{v}'"),
            )
        })?;
        if asked != loaded.0 {
            return Err(GatewayError::new(
                ErrorKind::NotFound,
                format!("model '{model}' has no version {asked} loaded (version {loaded} is)"),
            ));
        }
    }
    Ok(served)
}

/// Triton's datatype names: the config's `TYPE_X` without the prefix, `STRING` as `BYTES`.
pub fn datatype_name(t: pb::DataType) -> String {
    match t {
        pb::DataType::TypeString => "BYTES".to_string(),
        other => other.as_str_name().trim_start_matches("TYPE_").to_string(),
    }
}

/// Model metadata as Triton reports it: with batching, the batch dimension is a leading -1.
pub fn model_metadata(m: &RepositoryModel) -> ModelMetadata {
    let c = &m.config;
    let shape = |dims: &[i64]| -> Vec<i64> {
        let batch = (c.max_batch_size > 0).then_some(-1);
        batch.into_iter().chain(dims.iter().copied()).collect()
    };
    ModelMetadata {
        name: m.name.to_string(),
        versions: vec![m.version.to_string()],
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
    }
}

/// One model of the repository index.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct IndexEntry {
    pub name: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub version: String,
    /// `READY`, `LOADING` or `UNAVAILABLE` (Triton's model states).
    pub state: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// Every model of the repository, served or not (with why), sorted by name.
pub fn repository_index(state: &AppState, ready_only: bool) -> Vec<IndexEntry> {
    let mut out: Vec<IndexEntry> = state
        .models
        .values()
        .map(|served| {
            let m = served.repository_model();
            let (state, reason) = if served.is_ready() {
                ("READY", String::new())
            } else if let Some(why) = served.failure() {
                ("UNAVAILABLE", why)
            } else {
                ("LOADING", String::new())
            };
            IndexEntry {
                name: m.name.to_string(),
                version: m.version.to_string(),
                state: state.to_string(),
                reason,
            }
        })
        .chain(state.failed.iter().map(|(name, why)| IndexEntry {
            name: name.clone(),
            version: String::new(),
            state: "UNAVAILABLE".to_string(),
            reason: why.clone(),
        }))
        .filter(|e| !ready_only || e.state == "READY")
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}
