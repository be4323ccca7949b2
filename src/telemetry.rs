//! Logging (`RUST_LOG`, default `info`) and the Prometheus metrics of one gateway.
//!
//! Metric names follow Triton where Triton has the metric, so existing dashboards work;
//! visiongate's own carry the `visiongate_` prefix. Each gateway owns its registry.
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .try_init();
}

/// Triton's `nv_inference_request_failure` reasons.
pub mod reason {
    /// Refused at admission (queue full), or timed out in the queue.
    pub const REJECTED: &str = "REJECTED";
    /// The client went away before its answer.
    pub const CANCELED: &str = "CANCELED";
    /// The model (engine) failed.
    pub const BACKEND: &str = "BACKEND";
    /// Anything else (model not ready, shutting down).
    pub const OTHER: &str = "OTHER";
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub request_success: IntCounterVec,
    pub request_failure: IntCounterVec,
    pub inference_count: IntCounterVec,
    pub exec_count: IntCounterVec,
    pub pending_requests: IntGaugeVec,
    pub request_duration_us: IntCounterVec,
    pub queue_duration_us: IntCounterVec,
    pub compute_input_duration_us: IntCounterVec,
    pub compute_infer_duration_us: IntCounterVec,
    pub compute_output_duration_us: IntCounterVec,
    pub cache_hits: IntCounterVec,
    pub cache_misses: IntCounterVec,
    pub batch_size: HistogramVec,
    pub instance_executions: IntCounterVec,
    pub decode_seconds: Histogram,
    pub decode_memory_bytes: IntGauge,
}

const MV: &[&str] = &["model", "version"];

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let request_success = counter(
            "nv_inference_request_success",
            "Number of successful inference requests, all batch sizes",
            MV,
        );
        let request_failure = counter(
            "nv_inference_request_failure",
            "Number of failed inference requests, all batch sizes",
            &["model", "version", "reason"],
        );
        let inference_count = counter(
            "nv_inference_count",
            "Number of inferences performed (one per image / batch row)",
            MV,
        );
        let exec_count = counter(
            "nv_inference_exec_count",
            "Number of model executions (batches) performed",
            MV,
        );
        let request_duration_us = counter(
            "nv_inference_request_duration_us",
            "Cumulative inference request duration in microseconds (queue + compute)",
            MV,
        );
        let queue_duration_us = counter(
            "nv_inference_queue_duration_us",
            "Cumulative inference queuing duration in microseconds",
            MV,
        );
        let compute_input_duration_us = counter("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds (batch assembly, copy to device, normalization)", MV);
        let compute_infer_duration_us = counter(
            "nv_inference_compute_infer_duration_us",
            "Cumulative compute inference duration in microseconds",
            MV,
        );
        let compute_output_duration_us = counter(
            "nv_inference_compute_output_duration_us",
            "Cumulative compute output duration in microseconds (softmax, top-k, copy to host)",
            MV,
        );
        let cache_hits = counter(
            "nv_cache_num_hits_per_model",
            "Number of response cache hits per model (one per image answered from the cache)",
            MV,
        );
        let cache_misses = counter(
            "nv_cache_num_misses_per_model",
            "Number of response cache misses per model (one per image the model had to run)",
            MV,
        );
        let instance_executions = counter(
            "visiongate_instance_executions_total",
            "Batches executed per model instance",
            &["model", "instance"],
        );
        let pending_requests = IntGaugeVec::new(
            Opts::new(
                "nv_inference_pending_request_count",
                "Instantaneous number of pending requests awaiting execution per model",
            ),
            MV,
        )
        .expect("valid metric");
        registry
            .register(Box::new(pending_requests.clone()))
            .expect("unique metric");
        let batch_size = HistogramVec::new(
            HistogramOpts::new("visiongate_batch_size", "Rows per executed batch")
                .buckets((0..=10).map(|p| f64::from(1u32 << p)).collect()),
            &["model"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(batch_size.clone()))
            .expect("unique metric");
        let decode_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "visiongate_decode_seconds",
                "Time to decode and resize one image",
            )
            .buckets(vec![
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
            ]),
        )
        .expect("valid metric");
        registry
            .register(Box::new(decode_seconds.clone()))
            .expect("unique metric");
        let decode_memory_bytes = IntGauge::new(
            "visiongate_decode_memory_bytes",
            "Memory reserved by images being decoded, out of --decode-memory-bytes",
        )
        .expect("valid metric");
        registry
            .register(Box::new(decode_memory_bytes.clone()))
            .expect("unique metric");
        Metrics {
            registry,
            request_success,
            request_failure,
            inference_count,
            exec_count,
            pending_requests,
            request_duration_us,
            queue_duration_us,
            compute_input_duration_us,
            compute_infer_duration_us,
            compute_output_duration_us,
            cache_hits,
            cache_misses,
            batch_size,
            instance_executions,
            decode_seconds,
            decode_memory_bytes,
        }
    }

    /// Creates the per-model series at zero, so a dashboard sees the model before traffic.
    pub fn register_model(&self, model: &str, version: &str) {
        let mv = [model, version];
        self.request_success.with_label_values(&mv);
        self.inference_count.with_label_values(&mv);
        self.exec_count.with_label_values(&mv);
        self.pending_requests.with_label_values(&mv);
        self.request_duration_us.with_label_values(&mv);
        self.queue_duration_us.with_label_values(&mv);
        self.compute_input_duration_us.with_label_values(&mv);
        self.compute_infer_duration_us.with_label_values(&mv);
        self.compute_output_duration_us.with_label_values(&mv);
        self.cache_hits.with_label_values(&mv);
        self.cache_misses.with_label_values(&mv);
        for r in [
            reason::REJECTED,
            reason::CANCELED,
            reason::BACKEND,
            reason::OTHER,
        ] {
            self.request_failure.with_label_values(&[model, version, r]);
        }
    }

    /// Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("encoding metrics to a Vec cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Microseconds of a duration, for the `_us` counters.
pub fn micros(d: std::time::Duration) -> u64 {
    d.as_micros().min(u64::MAX as u128) as u64
}
