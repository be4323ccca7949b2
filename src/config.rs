//! Command-line flags (each also an environment variable) and their validation.
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::state::{ControlMode, ControlSettings};

#[derive(Parser, Debug, Clone)]
#[command(
    name = "visiongate",
    version,
    about = "Image classification gateway: /predict, Triton model repositories, libtorch"
)]
pub struct Config {
    /// Model repository in Triton layout (<model>/config.pbtxt, <model>/<version>/...).
    #[arg(long, env = "VISIONGATE_MODEL_REPOSITORY", default_value = "models")]
    pub model_repository: PathBuf,

    /// How the model set changes while running (Triton's `--model-control-mode`): `none`
    /// loads every model at start-up and keeps them; `poll` also re-reads the repository
    /// every `--repository-poll-secs` and reloads changed models, loads new ones and
    /// unloads removed ones; `explicit` loads only `--load-model` models at start-up and
    /// takes load/unload requests (which also need `--repository-control-key`).
    #[arg(
        long,
        env = "VISIONGATE_MODEL_CONTROL_MODE",
        value_enum,
        default_value = "none"
    )]
    pub model_control_mode: ControlMode,

    /// Seconds between repository polls in `poll` mode.
    #[arg(long, env = "VISIONGATE_REPOSITORY_POLL_SECS", default_value_t = 15)]
    pub repository_poll_secs: u64,

    /// In `explicit` mode, a model to load at start-up (repeat the flag, or `*` for all).
    #[arg(
        long = "load-model",
        env = "VISIONGATE_LOAD_MODEL",
        value_delimiter = ','
    )]
    pub load_models: Vec<String>,

    /// `<header>=<key>`: load and unload requests must carry this header with this value
    /// (Triton's restricted API). Without it they are refused (403 / PERMISSION_DENIED).
    #[arg(long, env = "VISIONGATE_REPOSITORY_CONTROL_KEY")]
    pub repository_control_key: Option<String>,

    /// Address to listen on. 0.0.0.0 serves every interface; 127.0.0.1 only this host.
    #[arg(long, env = "VISIONGATE_HOST", default_value = "0.0.0.0")]
    pub host: IpAddr,

    /// HTTP port (/predict, /v2 health). Triton's default is 8000; 0 picks a free port.
    #[arg(long, env = "VISIONGATE_HTTP_PORT", default_value_t = 8000)]
    pub http_port: u16,

    /// gRPC port (KServe v2 `inference.GRPCInferenceService`, what `tritonclient.grpc`
    /// calls). Triton's default is 8001; 0 picks a free port.
    #[arg(long, env = "VISIONGATE_GRPC_PORT", default_value_t = 8001)]
    pub grpc_port: u16,

    /// Largest gRPC message in bytes, received or sent. Triton's default is 2 GiB - 1, so
    /// a request of hundreds of images fits; lower it to bound what one call may hold.
    #[arg(long, env = "VISIONGATE_GRPC_MAX_MESSAGE_BYTES", default_value_t = i32::MAX as usize)]
    pub grpc_max_message_bytes: usize,

    /// gRPC connections open at once; one more is closed as it is accepted.
    #[arg(long, env = "VISIONGATE_GRPC_MAX_CONNECTIONS", default_value_t = 1024)]
    pub grpc_max_connections: usize,

    /// Calls open at once on one gRPC connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS);
    /// clients queue the rest themselves.
    #[arg(
        long,
        env = "VISIONGATE_GRPC_MAX_CONCURRENT_STREAMS",
        default_value_t = 256
    )]
    pub grpc_max_concurrent_streams: u32,

    /// Milliseconds between HTTP/2 keepalive pings on a gRPC connection (Triton's
    /// `--grpc-keepalive-time`; Triton's default is 2 hours).
    #[arg(long, env = "VISIONGATE_GRPC_KEEPALIVE_TIME", default_value_t = 60_000)]
    pub grpc_keepalive_time: u64,

    /// Milliseconds a client has to answer a keepalive ping before its connection is
    /// closed (Triton's `--grpc-keepalive-timeout`, same default).
    #[arg(
        long,
        env = "VISIONGATE_GRPC_KEEPALIVE_TIMEOUT",
        default_value_t = 20_000
    )]
    pub grpc_keepalive_timeout: u64,

    /// Seconds a gRPC connection may stay with no call open before it is closed (clients
    /// reconnect on their next call).
    #[arg(long, env = "VISIONGATE_GRPC_IDLE_TIMEOUT_SECS", default_value_t = 300)]
    pub grpc_idle_timeout_secs: u64,

    /// Seconds from a gRPC connection's accept to its client's HTTP/2 preface.
    #[arg(
        long,
        env = "VISIONGATE_GRPC_HANDSHAKE_TIMEOUT_SECS",
        default_value_t = 10
    )]
    pub grpc_handshake_timeout_secs: u64,

    /// Prometheus metrics port (`GET /metrics`, Triton's metric names). Triton's default
    /// is 8002; 0 picks a free port.
    #[arg(long, env = "VISIONGATE_METRICS_PORT", default_value_t = 8002)]
    pub metrics_port: u16,

    /// HTTP worker threads (async I/O only; decoding and inference have their own
    /// threads). 0: one per CPU core.
    #[arg(long, env = "VISIONGATE_HTTP_WORKERS", default_value_t = 0)]
    pub http_workers: usize,

    /// Most files in one /predict request (FastAPI's default is 1000). The first extra
    /// part is answered with 413.
    #[arg(long, env = "VISIONGATE_MAX_FILES", default_value_t = 1000)]
    pub max_files: usize,

    /// Largest single file in bytes. A larger file gets a `file_too_large` entry; the
    /// other files of the request still run.
    #[arg(long, env = "VISIONGATE_MAX_FILE_BYTES", default_value_t = 64 << 20)]
    pub max_file_bytes: u64,

    /// Largest request body in bytes (413 above it). Files are decoded while the body
    /// streams in, so memory holds only the parts waiting for a decode thread, not this.
    #[arg(long, env = "VISIONGATE_MAX_BODY_BYTES", default_value_t = 4 << 30)]
    pub max_body_bytes: u64,

    /// Seconds a request body (`/predict`, `/v2/.../infer`) may keep the server waiting:
    /// a budget that runs down only while the server waits for the client's bytes and that
    /// `--body-min-rate` refills. A body that stops arriving is answered 408
    /// `request_timeout` and holds no queue place while it trickles.
    #[arg(long, env = "VISIONGATE_BODY_TIMEOUT_SECS", default_value_t = 30)]
    pub body_timeout_secs: u64,

    /// Bytes per second that keep a request body's time budget full: each such amount
    /// received gives back one second (as Apache's `mod_reqtimeout` `MinRate`). Uploads at
    /// least this fast never time out.
    #[arg(long, env = "VISIONGATE_BODY_MIN_RATE", default_value_t = 1024)]
    pub body_min_rate: u64,

    /// Largest image in pixels (width × height, read from the header before any pixel
    /// buffer exists). Guards memory against decompression bombs.
    #[arg(
        long,
        env = "VISIONGATE_MAX_IMAGE_PIXELS",
        default_value_t = 100_000_000
    )]
    pub max_image_pixels: u64,

    /// Threads that decode and resize images. 0: half the CPU cores (at least one), so
    /// decoding does not starve the CPU model instances it feeds.
    #[arg(long, env = "VISIONGATE_DECODE_THREADS", default_value_t = 0)]
    pub decode_threads: usize,

    /// Memory, in bytes, that all decode threads together may hold for decoded images. A
    /// decode reserves what it needs (estimated from the image's header) and waits while
    /// that is not free; an image that alone needs more is refused (`image_too_large`).
    /// 0: a quarter of the machine's memory, or of the container's limit when lower.
    #[arg(long, env = "VISIONGATE_DECODE_MEMORY_BYTES", default_value_t = 0)]
    pub decode_memory_bytes: u64,

    /// libtorch intra-op threads per model instance. 1 is best when there are as many CPU
    /// instances as cores: more threads per instance spin-wait against each other. GPU
    /// instances keep to it too, leaving the cores to decoding.
    #[arg(long, env = "VISIONGATE_INTRA_OP_THREADS", default_value_t = 1)]
    pub intra_op_threads: usize,

    /// TF32 on NVIDIA GPUs that have it (Ampere and later): FP32 convolutions and matmuls
    /// with a 10-bit mantissa, several times faster. `default` keeps libtorch's choice (on
    /// for cuDNN convolutions, off for cuBLAS matmuls); `on` and `off` set both. No effect
    /// on the CPU.
    #[arg(long, env = "VISIONGATE_TF32", value_enum, default_value = "default")]
    pub tf32: Tf32,

    /// Requests that may wait in a model's queue when its config.pbtxt sets no
    /// `default_queue_policy.max_queue_size`. One more is refused at once with 503.
    #[arg(long, env = "VISIONGATE_MAX_QUEUE_SIZE", default_value_t = 256)]
    pub max_queue_size: usize,

    /// Response cache size in bytes, shared by the models whose config.pbtxt has
    /// `response_cache { enable: true }` (Triton's `--cache-config local,size=...`).
    /// An entry (one image's answer) takes about 200 bytes; least recently used leave first.
    #[arg(long, env = "VISIONGATE_CACHE_SIZE", default_value_t = 64 << 20)]
    pub cache_size: usize,

    /// Overrides the preprocessor's `dct_scaling_min_side` parameter: JPEGs decode at
    /// 1/2, 1/4 or 1/8 scale while their short side stays at or above it (0: full size).
    /// Lower is faster on large photos; higher is closer to a full-size decode.
    #[arg(long, env = "VISIONGATE_DCT_SCALING_MIN_SIDE")]
    pub dct_scaling_min_side: Option<u32>,

    /// Seconds a stopping server (SIGTERM or SIGINT) gives the requests it has already
    /// taken (Triton's `--exit-timeout-secs`). From the signal on, readiness answers 503
    /// and new inference requests get 503 `shutting_down`; once the requests under way are
    /// answered, or this time is up, the listeners close and open gRPC streams end. The
    /// process exits at most a few seconds later; a second signal exits at once. Keep the
    /// orchestrator's grace period longer (docker compose: 90 s, Kubernetes: 120 s here).
    #[arg(long, env = "VISIONGATE_EXIT_TIMEOUT_SECS", default_value_t = 60)]
    pub exit_timeout_secs: u64,
}

/// `--tf32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Tf32 {
    Default,
    On,
    Off,
}

/// The memory this process may use: the machine's, or its container's limit (cgroup v2,
/// else v1) when lower. 4 GiB when neither can be read.
fn memory_limit() -> u64 {
    let read =
        |path: &str| -> Option<u64> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let kib = text.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
            kib.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
                .map(|k| k * 1024)
        });
    // "max" (no limit) does not parse and v1's "no limit" is a huge number: both are
    // passed over by `min`.
    [
        machine,
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
    ]
    .into_iter()
    .flatten()
    .min()
    .unwrap_or(4 << 30)
}

/// Validated settings, passed down as one struct.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config: Config,
    pub decode_threads: usize,
    /// Bytes of decoded images all decode threads together may hold.
    pub decode_memory: u64,
    pub http_workers: usize,
    /// How long a stopping server lets the requests under way finish.
    pub exit_timeout: Duration,
    pub control: ControlSettings,
}

impl Config {
    pub fn validate(self) -> Result<Settings, String> {
        if !self.model_repository.is_dir() {
            return Err(format!(
                "--model-repository {} is not a directory",
                self.model_repository.display()
            ));
        }
        if self.max_files == 0
            || self.intra_op_threads == 0
            || self.max_queue_size == 0
            || self.body_timeout_secs == 0
            || self.body_min_rate == 0
            || self.grpc_max_connections == 0
            || self.grpc_max_concurrent_streams == 0
            || self.grpc_keepalive_time == 0
            || self.grpc_keepalive_timeout == 0
            || self.grpc_idle_timeout_secs == 0
            || self.grpc_handshake_timeout_secs == 0
        {
            return Err("--max-files, --intra-op-threads, --max-queue-size, \
                 --body-timeout-secs, --body-min-rate and the --grpc-* limits and timeouts \
                 must be at least 1"
                .into());
        }
        const DAY_SECS: u64 = 86_400;
        if self.body_timeout_secs > DAY_SECS
            || self.exit_timeout_secs > DAY_SECS
            || self.grpc_idle_timeout_secs > DAY_SECS
            || self.grpc_handshake_timeout_secs > DAY_SECS
            || self.grpc_keepalive_time > DAY_SECS * 1000
            || self.grpc_keepalive_timeout > DAY_SECS * 1000
        {
            return Err("timeouts and intervals must be at most a day".into());
        }
        let api_key =
            match &self.repository_control_key {
                None => None,
                Some(v) => match v.split_once('=') {
                    Some((h, k)) if !h.trim().is_empty() && !k.is_empty() => {
                        Some((h.trim().to_ascii_lowercase(), k.to_string()))
                    }
                    _ => return Err(
                        "--repository-control-key must be <header>=<key>, e.g. x-admin-key=secret"
                            .into(),
                    ),
                },
            };
        if self.repository_poll_secs == 0 {
            return Err("--repository-poll-secs must be at least 1".into());
        }
        let control = ControlSettings {
            mode: self.model_control_mode,
            repository: self.model_repository.clone(),
            poll_interval: Duration::from_secs(self.repository_poll_secs),
            startup_models: self.load_models.clone(),
            api_key,
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(Settings {
            decode_threads: if self.decode_threads == 0 {
                (cores / 2).max(1)
            } else {
                self.decode_threads
            },
            decode_memory: if self.decode_memory_bytes == 0 {
                memory_limit() / 4
            } else {
                self.decode_memory_bytes
            },
            http_workers: if self.http_workers == 0 {
                cores
            } else {
                self.http_workers
            },
            exit_timeout: Duration::from_secs(self.exit_timeout_secs),
            control,
            config: self,
        })
    }

    /// Defaults for tests: the bundled repository, loopback, a free port.
    pub fn for_tests() -> Config {
        let mut c = Config::parse_from(["visiongate"]);
        c.model_repository = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models");
        c.host = IpAddr::from([127, 0, 0, 1]);
        c.http_port = 0;
        c.grpc_port = 0;
        c.metrics_port = 0;
        c.http_workers = 2;
        c
    }
}
