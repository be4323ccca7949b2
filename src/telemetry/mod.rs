//! Logging (the `--log-*` flags, or `RUST_LOG`) and the Prometheus metrics of one gateway.
//!
//! Metric names follow Triton where Triton has the metric, so existing dashboards work;
//! visiongate's own carry the `visiongate_` prefix. Each gateway owns its registry.
mod flags;
mod latency;
mod system;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

pub use flags::{LogFlags, MetricsFlags, MetricsRefresh};
pub use latency::{Latencies, Latency, MetricsConfig, ModelLatencies};
pub use system::{spawn_poller, GpuProbe, GpuSample};

/// Which log lines are written (Triton's `--log-verbose`, `--log-info`, `--log-warning`,
/// `--log-error`).
#[derive(Debug, Clone, Copy)]
pub struct LogLevels {
    /// 0: no debug lines; 1: visiongate's own; 2: every library's too; 3: trace.
    pub verbose: u32,
    pub info: bool,
    pub warning: bool,
    pub error: bool,
}

impl LogLevels {
    fn allows(&self, level: tracing::Level, target: &str) -> bool {
        use tracing::Level;
        match level {
            Level::ERROR => self.error,
            Level::WARN => self.warning,
            Level::INFO => self.info,
            Level::DEBUG => {
                self.verbose >= 2 || (self.verbose == 1 && target.starts_with("visiongate"))
            }
            Level::TRACE => self.verbose >= 3,
        }
    }
}

/// Logs to stdout, or appended to `file` (`--log-file`, created if missing): as
/// `RUST_LOG` says when it is set, else as `levels` say.
pub fn init(levels: LogLevels, file: Option<&std::path::Path>) -> Result<(), String> {
    use tracing_subscriber::filter::{filter_fn, LevelFilter};
    use tracing_subscriber::fmt::writer::BoxMakeWriter;
    use tracing_subscriber::prelude::*;
    let writer = match file {
        Some(path) => {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| format!("--log-file {}: {e}", path.display()))?;
            BoxMakeWriter::new(std::sync::Mutex::new(file))
        }
        None => BoxMakeWriter::new(std::io::stdout),
    };
    let fmt = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(file.is_none())
        .with_writer(writer);
    let _ = match tracing_subscriber::EnvFilter::try_from_default_env() {
        Ok(env) => tracing_subscriber::registry()
            .with(fmt.with_filter(env))
            .try_init(),
        Err(_) => {
            let most = match levels.verbose {
                0 => LevelFilter::INFO,
                1 | 2 => LevelFilter::DEBUG,
                _ => LevelFilter::TRACE,
            };
            let filter = filter_fn(move |meta| levels.allows(*meta.level(), meta.target()))
                .with_max_level_hint(most);
            tracing_subscriber::registry()
                .with(fmt.with_filter(filter))
                .try_init()
        }
    };
    Ok(())
}

/// The `reason` labels of `nv_inference_request_failure`: Triton's four, and the refusals
/// Triton counts as `OTHER`, each named.
pub mod reason {
    /// Refused at admission (queue full), or timed out in the queue.
    pub const REJECTED: &str = "REJECTED";
    /// The client went away before its answer.
    pub const CANCELED: &str = "CANCELED";
    /// The model (engine) failed.
    pub const BACKEND: &str = "BACKEND";
    /// Ended by its own input (a malformed upload, an unusable row of a KServe request).
    pub const OTHER: &str = "OTHER";
    /// The model is loading, or its load failed.
    pub const NOT_READY: &str = "NOT_READY";
    /// Every instance of the model is down and restarting.
    pub const MODEL_DOWN: &str = "MODEL_DOWN";
    /// The model is stopping (the server stops, or the model is unloaded).
    pub const STOPPING: &str = "STOPPING";
    /// The model was unloaded or replaced after the request found it.
    pub const UNLOADED: &str = "UNLOADED";
    /// Every reason, for series created at zero.
    pub const ALL: [&str; 8] = [
        REJECTED, CANCELED, BACKEND, OTHER, NOT_READY, MODEL_DOWN, STOPPING, UNLOADED,
    ];
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub request_success: IntCounterVec,
    pub request_failure: IntCounterVec,
    pub inference_count: IntCounterVec,
    pub exec_count: IntCounterVec,
    pub pending_requests: IntGaugeVec,
    /// The rows of those requests: images (or tensor rows) waiting for a batch.
    pub pending_rows: IntGaugeVec,
    /// Request, queue and compute durations (counters, summaries, histograms).
    pub latency: Latencies,
    pub cache_hits: IntCounterVec,
    pub cache_misses: IntCounterVec,
    pub batch_size: HistogramVec,
    pub instance_executions: IntCounterVec,
    pub decode_seconds: Histogram,
    /// Images decoded, by path (`cpu`, `gpu_hardware`, `gpu_assisted`) and, on the CPU,
    /// why not on a GPU.
    decode_images: IntCounterVec,
    /// Time spent decoding, by path: the decode threads' on the CPU, the device's on a GPU.
    decode_duration_us: IntCounterVec,
    pub decode_memory_bytes: IntGauge,
    /// Images submitted to the decode threads and not yet decoded.
    pub decode_pending_images: IntGauge,
    /// 1 per loaded instance: its device, and why it is not where the config puts it.
    pub instance_device: IntGaugeVec,
    /// The instances of each model serving now (loaded, not restarting after a panic).
    instances_up: IntGaugeVec,
    /// Spans the trace exporter dropped (OpenTelemetry mode), traces the trace file's
    /// writer did not take (Triton mode).
    pub trace_spans_dropped: IntCounterVec,
    /// CPU and GPU series, refreshed by [`spawn_poller`].
    host: system::HostMetrics,
}

const MV: &[&str] = &["model", "version"];

impl Metrics {
    /// The default series (`--metrics-config` unset).
    pub fn new() -> Metrics {
        Self::with_config(&MetricsConfig::default())
    }

    pub fn with_config(config: &MetricsConfig) -> Metrics {
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
        let latency = Latencies::new(config, &registry);
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
        // With the decode threads' backlog, the images a replica holds: the autoscaling
        // signal (deploy/kubernetes), which a request count is not (one upload is 1000 rows).
        let pending_rows = IntGaugeVec::new(
            Opts::new(
                "visiongate_pending_rows",
                "Instantaneous number of rows (images) of pending requests awaiting execution \
                 per model",
            ),
            MV,
        )
        .expect("valid metric");
        registry
            .register(Box::new(pending_rows.clone()))
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
                "Time to decode and resize one image on the CPU",
            )
            .buckets(vec![
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
            ]),
        )
        .expect("valid metric");
        registry
            .register(Box::new(decode_seconds.clone()))
            .expect("unique metric");
        let decode_images = counter(
            "visiongate_decode_images_total",
            "Images decoded, by path (cpu, gpu_hardware: nvJPEG's hardware decoder, \
             gpu_assisted: its CUDA decoder) and reason (on the cpu path, why not on a GPU; \
             gpu_decodable on the GPU paths)",
            &["path", "reason"],
        );
        let decode_duration_us = counter(
            "visiongate_decode_duration_us_total",
            "Time spent decoding and resizing images, by path: the decode threads' time on \
             the cpu path, the device's on the GPU paths",
            &["path"],
        );
        let decode_memory_bytes = IntGauge::new(
            "visiongate_decode_memory_bytes",
            "Memory reserved by images being decoded, out of --decode-memory-bytes",
        )
        .expect("valid metric");
        registry
            .register(Box::new(decode_memory_bytes.clone()))
            .expect("unique metric");
        let decode_pending_images = IntGauge::new(
            "visiongate_decode_pending_images",
            "Images submitted to the decode threads and not yet decoded (waiting or decoding)",
        )
        .expect("valid metric");
        registry
            .register(Box::new(decode_pending_images.clone()))
            .expect("unique metric");
        let instance_device = IntGaugeVec::new(
            Opts::new(
                "visiongate_instance_device",
                "1 for each loaded model instance, labelled with its device (cpu, cuda:N) and \
                 why it is not where the config puts it (fallback; empty when it is)",
            ),
            &["model", "version", "instance", "device", "fallback"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(instance_device.clone()))
            .expect("unique metric");
        let instances_up = IntGaugeVec::new(
            Opts::new(
                "visiongate_model_instances_up",
                "Instances of the model serving now; fewer than it has while one restarts \
                 after its engine failed",
            ),
            MV,
        )
        .expect("valid metric");
        registry
            .register(Box::new(instances_up.clone()))
            .expect("unique metric");
        let trace_spans_dropped = counter(
            "visiongate_trace_spans_dropped_total",
            "Trace spans not sent to the OpenTelemetry collector, or requests' traces not \
             written to Triton mode's trace file, by reason (queue_full: over \
             bsp_max_queue_size, or 64 MiB waiting for the file's writer; export_failed: the \
             collector did not take them in time)",
            &["reason"],
        );
        for reason in ["queue_full", "export_failed"] {
            trace_spans_dropped.with_label_values(&[reason]);
        }
        Metrics {
            trace_spans_dropped,
            instance_device,
            instances_up,
            request_success,
            request_failure,
            inference_count,
            exec_count,
            pending_requests,
            pending_rows,
            latency,
            cache_hits,
            cache_misses,
            batch_size,
            instance_executions,
            decode_seconds,
            decode_images,
            decode_duration_us,
            decode_memory_bytes,
            decode_pending_images,
            host: system::HostMetrics::new(&registry),
            registry,
        }
    }

    /// One image decoded on the CPU, for `reason` (why not on a GPU), in `took`.
    pub fn count_cpu_decode(&self, reason: &str, took: std::time::Duration) {
        self.decode_seconds.observe(took.as_secs_f64());
        self.count_decode("cpu", reason, 1, took);
    }

    /// `images` decoded together on `path` in `took`.
    pub fn count_decode(&self, path: &str, reason: &str, images: u64, took: std::time::Duration) {
        self.decode_images
            .with_label_values(&[path, reason])
            .inc_by(images);
        self.decode_duration_us
            .with_label_values(&[path])
            .inc_by(micros(took));
    }

    /// Registers series kept elsewhere (the remote repositories').
    pub fn register(&self, collector: Box<dyn prometheus::core::Collector>) {
        self.registry.register(collector).expect("unique metric");
    }

    /// A model version's series, created at zero (a dashboard sees the model before its
    /// traffic) and looked up once here: a label lookup hashes the values under the
    /// vector's lock, which the request and batch paths then skip.
    pub fn register_model(&self, model: &str, version: &str) -> ModelSeries {
        let mv = [model, version];
        ModelSeries {
            request_success: self.request_success.with_label_values(&mv),
            request_failure: reason::ALL
                .map(|r| self.request_failure.with_label_values(&[model, version, r])),
            inference_count: self.inference_count.with_label_values(&mv),
            exec_count: self.exec_count.with_label_values(&mv),
            pending_requests: self.pending_requests.with_label_values(&mv),
            pending_rows: self.pending_rows.with_label_values(&mv),
            cache_hits: self.cache_hits.with_label_values(&mv),
            cache_misses: self.cache_misses.with_label_values(&mv),
            batch_size: self.batch_size.with_label_values(&[model]),
            instances_up: self.instances_up.with_label_values(&mv),
            latency: self.latency.register_model(&mv),
        }
    }

    /// An instance's count of executed batches.
    pub fn instance_executions(&self, model: &str, instance: &str) -> IntCounter {
        self.instance_executions
            .with_label_values(&[model, instance])
    }

    /// Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut families = self.registry.gather();
        if self.latency.export_counters {
            families.extend(self.latency.counter_registry.gather());
            families.sort_by(|a, b| a.name().cmp(b.name()));
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&families, &mut out)
            .expect("encoding metrics to a Vec cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

/// One model version's series (see [`Metrics::register_model`]).
#[derive(Debug, Clone)]
pub struct ModelSeries {
    pub request_success: IntCounter,
    /// One per `reason::ALL`, in its order.
    request_failure: [IntCounter; reason::ALL.len()],
    pub inference_count: IntCounter,
    pub exec_count: IntCounter,
    pub pending_requests: IntGauge,
    pub pending_rows: IntGauge,
    pub cache_hits: IntCounter,
    pub cache_misses: IntCounter,
    pub batch_size: Histogram,
    pub instances_up: IntGauge,
    pub latency: ModelLatencies,
}

impl ModelSeries {
    /// Counts a failed request under `why`, one of `reason::ALL`.
    pub fn failed(&self, why: &'static str) {
        let at = |r: &str| reason::ALL.iter().position(|&known| known == r);
        debug_assert!(at(why).is_some(), "'{why}' is not in reason::ALL");
        let i = at(why).or_else(|| at(reason::OTHER)).unwrap_or_default();
        self.request_failure[i].inc();
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
