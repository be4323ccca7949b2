//! Triton's statistics extension, read from the same counters `/metrics` exports, so the
//! two never disagree whichever transport a request came in by.
use crate::error::GatewayError;
use crate::state::{AppState, ServedModel};
use crate::telemetry::{reason, Latency, Metrics};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct DurationStat {
    pub count: u64,
    pub ns: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct InferStats {
    pub success: DurationStat,
    pub fail: DurationStat,
    pub queue: DurationStat,
    pub compute_input: DurationStat,
    pub compute_infer: DurationStat,
    pub compute_output: DurationStat,
    pub cache_hit: DurationStat,
    pub cache_miss: DurationStat,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct ModelStatistics {
    pub name: String,
    pub version: String,
    /// Milliseconds since the epoch; 0 before the first request.
    pub last_inference: u64,
    pub inference_count: u64,
    pub execution_count: u64,
    pub inference_stats: InferStats,
}

/// Statistics of every served model, or of `model` (in `version`, when given).
pub fn model_statistics(
    state: &AppState,
    model: Option<&str>,
    version: Option<&str>,
) -> Result<Vec<ModelStatistics>, GatewayError> {
    let served: Vec<ServedModel> = match model.filter(|m| !m.is_empty()) {
        Some(m) => match version.filter(|v| !v.is_empty()) {
            Some(_) => vec![super::resolve(state, m, version)?],
            None => {
                let table = state.registry.models();
                match table.versions(m) {
                    Some(versions) => versions.values().cloned().collect(),
                    // Not served: the lookup's own NOT_FOUND error, with its reason.
                    None => vec![super::resolve(state, m, None)?],
                }
            }
        },
        None => state.registry.models().all().cloned().collect(),
    };
    Ok(served
        .iter()
        .map(|served| statistics(&state.metrics, served))
        .collect())
}

/// Counters are kept per scheduled model (the classifier an ensemble runs on counts the
/// ensemble's requests); the ensemble reports its classifier's request counts, as Triton's
/// ensembles report the requests that went through them.
fn statistics(metrics: &Metrics, served: &ServedModel) -> ModelStatistics {
    let model = served.repository_model();
    let name = model.name.to_string();
    let version = model.version.to_string();
    let handle = match served {
        ServedModel::Classifier { handle, .. } => Some(handle),
        ServedModel::Ensemble { pipeline, .. } => Some(&pipeline.classifier),
        ServedModel::Preprocessor { .. } => None,
    };
    let Some(handle) = handle else {
        return ModelStatistics {
            name,
            version,
            ..Default::default()
        };
    };
    let counted_name = handle.name().to_string();
    let counted_version = handle.version().to_string();
    let mv = [counted_name.as_str(), counted_version.as_str()];
    let get = |c: &prometheus::IntCounterVec| c.with_label_values(&mv).get();
    let ns = |c: &prometheus::IntCounterVec| get(c).saturating_mul(1000);
    let success = get(&metrics.request_success);
    let failures: u64 = [
        reason::REJECTED,
        reason::CANCELED,
        reason::BACKEND,
        reason::OTHER,
    ]
    .iter()
    .map(|r| {
        metrics
            .request_failure
            .with_label_values(&[mv[0], mv[1], r])
            .get()
    })
    .sum();
    let per_request = |c: &prometheus::IntCounterVec| DurationStat {
        count: success,
        ns: ns(c),
    };
    let ensemble = matches!(served, ServedModel::Ensemble { .. });
    ModelStatistics {
        name,
        version,
        last_inference: handle.last_inference_ms(),
        // An ensemble runs no model of its own: its executions are its classifier's.
        inference_count: if ensemble {
            0
        } else {
            get(&metrics.inference_count)
        },
        execution_count: if ensemble {
            0
        } else {
            get(&metrics.exec_count)
        },
        inference_stats: InferStats {
            success: DurationStat {
                count: success,
                ns: ns(metrics.latency.counter(Latency::Request)),
            },
            // Durations of failed requests are not recorded; their count is.
            fail: DurationStat {
                count: failures,
                ns: 0,
            },
            queue: per_request(metrics.latency.counter(Latency::Queue)),
            compute_input: per_request(metrics.latency.counter(Latency::ComputeInput)),
            compute_infer: per_request(metrics.latency.counter(Latency::ComputeInfer)),
            compute_output: per_request(metrics.latency.counter(Latency::ComputeOutput)),
            cache_hit: DurationStat {
                count: get(&metrics.cache_hits),
                ns: 0,
            },
            cache_miss: DurationStat {
                count: get(&metrics.cache_misses),
                ns: 0,
            },
        },
    }
}
