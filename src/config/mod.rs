//! Command-line flags and their validation: visiongate's own (each also an environment
//! variable) and Triton's server arguments as `tritonserver` spells them (`triton.rs`),
//! honoured where visiongate can and otherwise accepted with a log line.
mod triton;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser};

pub use triton::LogFormat;

use crate::domain::Precision;
use crate::grpc::{ConnLimits, GrpcSettings};
use crate::pace::BodyPace;
use crate::repository::{Limits, Location, RemoteSettings};
use crate::state::{
    ApiKeys, ControlMode, ControlSettings, Endpoint, ServerOptions, UploadLimits,
    GRPC_HEADER_PREFIX,
};
use crate::telemetry::{LogLevels, MetricsConfig};

#[derive(Parser, Debug, Clone)]
#[command(
    name = "visiongate",
    version,
    about = "Image classification gateway: /predict, Triton model repositories, libtorch",
    // As `tritonserver`: an argument given twice takes its last value.
    args_override_self = true
)]
pub struct Config {
    /// Model repository in Triton layout (<model>/config.pbtxt, <model>/<version>/...): a
    /// directory, or in object storage as Triton spells it: `s3://bucket/path`,
    /// `s3://host:port/bucket/path` (an S3-compatible host; `s3://https://host:port/...`
    /// for TLS), `gs://bucket/path`, `as://account/container/path` (mirrored into
    /// `--repository-cache-dir`). Repeat the flag for several repositories, of any kinds
    /// (Triton's `--model-repository`, also `--model-store`); a model name found in more
    /// than one is not served.
    #[arg(
        long,
        visible_alias = "model-store",
        env = "VISIONGATE_MODEL_REPOSITORY",
        default_value = "models",
        action = ArgAction::Append
    )]
    pub model_repository: Vec<PathBuf>,

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

    /// Each model's config is `configs/<name>.pbtxt` in its directory where that file
    /// exists, else its `config.pbtxt` (Triton's `--model-config-name`): one repository
    /// shared by hosts of different kinds.
    #[arg(long, value_parser = triton::config_name)]
    pub model_config_name: Option<String>,

    /// Seconds between repository polls in `poll` mode.
    #[arg(long, env = "VISIONGATE_REPOSITORY_POLL_SECS", default_value_t = 15)]
    pub repository_poll_secs: u64,

    /// Where remote repositories (s3://, gs://, as://) are mirrored before their models
    /// load: one directory per repository, cleared at start-up, locked while the server
    /// runs (default: `visiongate-repositories-<uid>` in the temporary directory, which must
    /// be this user's).
    #[arg(long, env = "VISIONGATE_REPOSITORY_CACHE_DIR")]
    pub repository_cache_dir: Option<PathBuf>,

    /// Bytes the mirrors of remote repositories may hold together; a model that would
    /// not fit is not downloaded (its load fails, naming this flag).
    #[arg(long, env = "VISIONGATE_REPOSITORY_CACHE_MAX_BYTES", default_value_t = RemoteSettings::DEFAULT_MAX_CACHE_BYTES)]
    pub repository_cache_max_bytes: u64,

    /// The largest object downloaded from a remote repository; a model with a larger one
    /// fails its load, naming the object.
    #[arg(long, env = "VISIONGATE_REPOSITORY_MAX_OBJECT_BYTES", default_value_t = RemoteSettings::DEFAULT_MAX_OBJECT_BYTES)]
    pub repository_max_object_bytes: u64,

    /// The longest one request to a remote repository's store may take (a listing with all
    /// its pages, one object's download however slowly its bytes come), retries included; a
    /// failed connection or a 5xx answer is retried three times with backoff within it.
    #[arg(long, env = "VISIONGATE_REPOSITORY_TIMEOUT_SECS", default_value_t = RemoteSettings::DEFAULT_TIMEOUT_SECS)]
    pub repository_timeout_secs: u64,

    /// In `explicit` mode, a model to load at start-up (repeat the flag, or `*` for all).
    /// As in Triton (since 2.48), it needs `--model-control-mode explicit`.
    #[arg(
        long = "load-model",
        env = "VISIONGATE_LOAD_MODEL",
        value_delimiter = ','
    )]
    pub load_models: Vec<String>,

    /// `<header>=<key>`: load and unload requests must carry this header with this value,
    /// over HTTP and gRPC alike (visiongate's older form of
    /// `--http-restricted-api`/`--grpc-restricted-protocol`, for load and unload only).
    /// Load and unload are refused (403 / PERMISSION_DENIED) unless a key restricts them.
    #[arg(long, env = "VISIONGATE_REPOSITORY_CONTROL_KEY")]
    pub repository_control_key: Option<String>,

    /// Triton's `<api>[,<api>...]:<header>=<key>` (repeatable): HTTP requests to those
    /// APIs need that header with that key, else 403. APIs: health, metadata, inference
    /// (also /predict), shared-memory, model-config, model-repository (index, load,
    /// unload), statistics, trace, logging.
    #[arg(long, action = ArgAction::Append)]
    pub http_restricted_api: Vec<String>,

    /// The same for gRPC methods; the metadata key is `triton-grpc-protocol-<header>`
    /// (Triton's), and a refusal is PERMISSION_DENIED (Triton: UNAVAILABLE).
    #[arg(long, action = ArgAction::Append)]
    pub grpc_restricted_protocol: Vec<String>,

    /// Address to listen on. 0.0.0.0 serves every interface; 127.0.0.1 only this host.
    #[arg(long, env = "VISIONGATE_HOST", default_value = "0.0.0.0")]
    pub host: IpAddr,

    /// The address the HTTP listener binds (Triton's `--http-address`; default: `--host`):
    /// an IP address (IPv6 also as `[::1]` or Triton's `ipv6:[::1]`) or a host name.
    #[arg(long, value_parser = triton::address)]
    pub http_address: Option<IpAddr>,

    /// The address the gRPC listener binds (Triton's `--grpc-address`; default: `--host`).
    #[arg(long, value_parser = triton::address)]
    pub grpc_address: Option<IpAddr>,

    /// The address the metrics listener binds (Triton's `--metrics-address`; default:
    /// `--http-address`, as in Triton, else `--host`).
    #[arg(long, value_parser = triton::address)]
    pub metrics_address: Option<IpAddr>,

    /// Let other processes listen on the HTTP port too (SO_REUSEPORT; Triton's
    /// `--reuse-http-port`): the kernel spreads new connections over every server that set
    /// it, so each must serve the same models.
    #[arg(long, value_parser = triton::boolean, default_value = "false", action = ArgAction::Set)]
    pub reuse_http_port: bool,

    /// The same for the gRPC port (Triton's `--reuse-grpc-port`).
    #[arg(long, value_parser = triton::boolean, default_value = "false", action = ArgAction::Set)]
    pub reuse_grpc_port: bool,

    /// Serve HTTP (Triton's `--allow-http`; booleans take a value: true/on/1,
    /// false/off/0).
    #[arg(long, value_parser = triton::boolean, default_value = "true", action = ArgAction::Set)]
    pub allow_http: bool,

    /// Serve gRPC (Triton's `--allow-grpc`).
    #[arg(long, value_parser = triton::boolean, default_value = "true", action = ArgAction::Set)]
    pub allow_grpc: bool,

    /// Serve Prometheus metrics (Triton's `--allow-metrics`).
    #[arg(long, value_parser = triton::boolean, default_value = "true", action = ArgAction::Set)]
    pub allow_metrics: bool,

    /// GPU series in the metrics (Triton's `--allow-gpu-metrics`; with `--allow-metrics`).
    #[arg(long, value_parser = triton::boolean, default_value = "true", action = ArgAction::Set)]
    pub allow_gpu_metrics: bool,

    /// CPU series in the metrics (Triton's `--allow-cpu-metrics`; with `--allow-metrics`).
    #[arg(long, value_parser = triton::boolean, default_value = "true", action = ArgAction::Set)]
    pub allow_cpu_metrics: bool,

    /// Milliseconds between refreshes of the CPU and GPU series (Triton's
    /// `--metrics-interval-ms`).
    #[arg(long, default_value_t = 2000)]
    pub metrics_interval_ms: u64,

    /// `--metrics-config <setting>=<value>` (repeatable, Triton's):
    /// `summary_latencies=true` adds `*_summary_us` summaries, `summary_quantiles=
    /// 0.5:0.05,0.9:0.01,...` sets their quantiles, `histogram_latencies=true` adds
    /// histograms, `counter_latencies=false` drops the `*_duration_us` counters.
    #[arg(long, action = ArgAction::Append)]
    pub metrics_config: Vec<String>,

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

    /// Serve gRPC over TLS (Triton's `--grpc-use-ssl`) with `--grpc-server-cert` and
    /// `--grpc-server-key`.
    #[arg(long, value_parser = triton::boolean, default_value = "false", action = ArgAction::Set)]
    pub grpc_use_ssl: bool,

    /// `true`: serve gRPC over TLS and accept only clients whose certificate
    /// `--grpc-root-cert` signed (Triton's `--grpc-use-ssl-mutual`). Given at all, `false`
    /// too, it turns TLS on, as in Triton.
    #[arg(long, value_parser = triton::boolean, action = ArgAction::Set)]
    pub grpc_use_ssl_mutual: Option<bool>,

    /// PEM file of the gRPC server's certificate chain (Triton's `--grpc-server-cert`).
    #[arg(long)]
    pub grpc_server_cert: Option<PathBuf>,

    /// PEM file of the gRPC server's private key (Triton's `--grpc-server-key`).
    #[arg(long)]
    pub grpc_server_key: Option<PathBuf>,

    /// PEM file of the certificates that sign clients' certificates, for
    /// `--grpc-use-ssl-mutual` (Triton's `--grpc-root-cert`).
    #[arg(long)]
    pub grpc_root_cert: Option<PathBuf>,

    /// Milliseconds a gRPC connection may last; then it is sent a GOAWAY, and its client
    /// reconnects for its next call (Triton's `--grpc-max-connection-age`; spreads clients
    /// over replicas behind a balancer). Unset: no limit.
    #[arg(long)]
    pub grpc_max_connection_age: Option<u64>,

    /// Milliseconds the calls of a connection past its age may still run before it is
    /// closed (Triton's `--grpc-max-connection-age-grace`). Unset: no limit.
    #[arg(long)]
    pub grpc_max_connection_age_grace: Option<u64>,

    /// gRPC connections open at once; one more is closed as it is accepted.
    #[arg(long, env = "VISIONGATE_GRPC_MAX_CONNECTIONS", default_value_t = 1024)]
    pub grpc_max_connections: usize,

    /// gRPC connections open at once from one client address, loopback included; one more
    /// is closed as it is accepted. Behind a proxy every client has the proxy's address:
    /// raise it there.
    #[arg(
        long,
        env = "VISIONGATE_GRPC_MAX_CONNECTIONS_PER_PEER",
        default_value_t = 64
    )]
    pub grpc_max_connections_per_peer: usize,

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

    /// Seconds from a gRPC connection's accept to its client's first call; a connection
    /// that has opened none by then is closed (clients reconnect on their next call).
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
    /// threads; also Triton's `--http-thread-count`). 0: one per CPU core.
    #[arg(
        long,
        visible_alias = "http-thread-count",
        env = "VISIONGATE_HTTP_WORKERS",
        default_value_t = 0
    )]
    pub http_workers: usize,

    /// Most files in one /predict request (FastAPI's default is 1000). The first extra
    /// part is answered with 413.
    #[arg(long, env = "VISIONGATE_MAX_FILES", default_value_t = 1000)]
    pub max_files: usize,

    /// Largest single file in bytes. A larger file gets a `file_too_large` entry; the
    /// other files of the request still run.
    #[arg(long, env = "VISIONGATE_MAX_FILE_BYTES", default_value_t = 64 << 20)]
    pub max_file_bytes: u64,

    /// Largest body of a KServe inference request over HTTP (`/v2/.../infer`), in bytes;
    /// 413 above it (Triton's `--http-max-input-size`, whose default there is 64 MiB).
    /// Unset: `--max-body-bytes`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub http_max_input_size: Option<u64>,

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

    /// Threads that decode and resize images. 0: with a model instance on a GPU, every
    /// core but one (the GPU needs images faster than a few cores decode them); with CPU
    /// instances only, half the cores (at least one), so decoding does not starve the
    /// instances it feeds. See `decode_threads`.
    #[arg(long, env = "VISIONGATE_DECODE_THREADS", default_value_t = 0)]
    pub decode_threads: usize,

    /// Memory, in bytes, that all decode threads together may hold for decoded images. A
    /// decode reserves what it needs (estimated from the image's header) and waits while
    /// that is not free; an image that alone needs more is refused (`image_too_large`).
    /// 0: a quarter of the machine's memory, or of the container's limit when lower.
    #[arg(long, env = "VISIONGATE_DECODE_MEMORY_BYTES", default_value_t = 0)]
    pub decode_memory_bytes: u64,

    /// Intra-op threads per model instance (libtorch's, and ONNX Runtime's where a model's
    /// config sets no intra_op_thread_count). 1 is best when there are as many CPU
    /// instances as cores: more threads per instance spin-wait against each other. GPU
    /// instances keep to it too, leaving the cores to decoding.
    #[arg(long, env = "VISIONGATE_INTRA_OP_THREADS", default_value_t = 1)]
    pub intra_op_threads: usize,

    /// The ONNX Runtime shared library ONNX models run on (PyPI's onnxruntime wheel has it
    /// as onnxruntime/capi/libonnxruntime.so.VERSION; `make setup` installs it and
    /// scripts/env.sh points here). Opened when the first ONNX model loads. Unset: the
    /// dynamic linker's search for libonnxruntime.so.
    #[arg(long, env = "VISIONGATE_ONNXRUNTIME_LIBRARY")]
    pub onnxruntime_library: Option<PathBuf>,

    /// Decode JPEGs on the GPU (nvJPEG: the hardware decoder where the GPU has one, its
    /// CUDA decoder elsewhere) for image ensembles whose classifier runs there; progressive,
    /// CMYK, 4:1:1, 12-bit and damaged JPEGs, JPEGs the CPU path decodes at a DCT scale and
    /// other formats stay on the CPU. Off by default: on an H200 with 16 cores it was not
    /// faster than the CPU's decode threads (docs/performance.md). No effect without a GPU.
    #[arg(long, env = "VISIONGATE_GPU_DECODE", default_value_t = false, action = clap::ArgAction::Set)]
    pub gpu_decode: bool,

    /// nvJPEG's shared library (PyPI's nvidia-nvjpeg wheel has it as
    /// nvidia/cu13/lib/libnvjpeg.so.13; `make setup` installs it and scripts/env.sh points
    /// here). Opened at start where an instance runs on a GPU. Unset: the dynamic linker's
    /// search for libnvjpeg.so.13.
    #[arg(long, env = "VISIONGATE_NVJPEG_LIBRARY")]
    pub nvjpeg_library: Option<PathBuf>,

    /// Device memory each GPU instance's JPEG decode may hold at once: a group's decoded
    /// planes (3 bytes a pixel at the decoded size) and one image's float copy while it is
    /// resized (12 bytes a pixel). A batch's JPEGs are decoded in groups that fit; an image
    /// that alone needs more is decoded on the CPU.
    #[arg(long, env = "VISIONGATE_GPU_DECODE_MEMORY_BYTES", default_value_t = 1 << 30,
          value_parser = clap::value_parser!(u64).range(1 << 20..))]
    pub gpu_decode_memory_bytes: u64,

    /// TF32 on NVIDIA GPUs that have it (Ampere and later): FP32 convolutions and matmuls
    /// with a 10-bit mantissa, several times faster. `default` keeps libtorch's choice (on
    /// for cuDNN convolutions, off for cuBLAS matmuls); `on` and `off` set both. No effect
    /// on the CPU.
    #[arg(long, env = "VISIONGATE_TF32", value_enum, default_value = "default")]
    pub tf32: Tf32,

    /// Every TorchScript classifier's precision, instead of its config's `precision`
    /// parameter: `fp32`, `bf16` (autocast: convolutions and matmuls in bfloat16; CPUs with
    /// AVX-512 BF16 or AMX, and GPUs) or `fp16` (GPUs only). A model whose device cannot run
    /// it fails its load saying so. ONNX models keep fp32 (logged).
    #[arg(long, env = "VISIONGATE_PRECISION", value_parser = precision)]
    pub precision: Option<Precision>,

    /// Requests that may wait in a model's queue when its config.pbtxt sets no
    /// `default_queue_policy.max_queue_size`. One more is refused at once with 503.
    #[arg(long, env = "VISIONGATE_MAX_QUEUE_SIZE", default_value_t = 256)]
    pub max_queue_size: usize,

    /// Versions of one model served at once (its `version_policy` may select no more).
    #[arg(long, env = "VISIONGATE_MAX_MODEL_VERSIONS", default_value_t = Limits::DEFAULT_VERSIONS)]
    pub max_model_versions: usize,

    /// Bytes of one batch's input: the batches the server forms for a classifier hold at
    /// most as many rows of its FP32 `[3, height, width]` input as fit, however large its
    /// `max_batch_size` (what the model takes; a larger request is cut into such batches).
    /// Every batch a model runs, at warm-up or serving, is within it; one row, or one
    /// preprocessor output image, over it fails the load.
    #[arg(long, env = "VISIONGATE_MAX_BATCH_BYTES", default_value_t = Limits::DEFAULT_BATCH_BYTES)]
    pub max_batch_bytes: u64,

    /// Rows the `model_warmup` samples of one model run on each instance before it serves
    /// (each sample's `batch_size` times its `count`).
    #[arg(long, env = "VISIONGATE_MAX_WARMUP_ROWS", default_value_t = Limits::DEFAULT_WARMUP_ROWS)]
    pub max_warmup_rows: u64,

    /// Instances of one model version (each a thread with its own copy of the model), as
    /// its `instance_group`s place them on this host.
    #[arg(long, env = "VISIONGATE_MAX_MODEL_INSTANCES", default_value_t = Limits::DEFAULT_MODEL_INSTANCES)]
    pub max_model_instances: usize,

    /// Seconds a row may wait for a batch to fill: a model's
    /// `max_queue_delay_microseconds` may be no longer.
    #[arg(long, env = "VISIONGATE_MAX_QUEUE_DELAY_SECS", default_value_t = Limits::DEFAULT_QUEUE_DELAY_SECS)]
    pub max_queue_delay_secs: u64,

    /// Instances of all models together; those of a model being replaced count until it
    /// has finished its requests.
    #[arg(long, env = "VISIONGATE_MAX_INSTANCES", default_value_t = Limits::DEFAULT_INSTANCES)]
    pub max_instances: usize,

    /// Response cache size in bytes, shared by the models whose config.pbtxt has
    /// `response_cache { enable: true }`. An entry (one image's answer) takes about 200
    /// bytes; least recently used leave first. Triton's `--cache-config local,size=N`
    /// and `--response-cache-byte-size N` set it too.
    #[arg(long, env = "VISIONGATE_CACHE_SIZE", default_value_t = 64 << 20)]
    pub cache_size: usize,

    /// Triton's `--cache-config <cache>,<setting>=<value>` (repeatable): `local,size=N`
    /// sets the response cache's size (the only cache here).
    #[arg(long, action = ArgAction::Append)]
    pub cache_config: Vec<String>,

    /// Triton's older `--response-cache-byte-size N`: `--cache-config local,size=N`.
    #[arg(long)]
    pub response_cache_byte_size: Option<u64>,

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

    /// Exit (status 1) when a model fails to load at start-up (Triton's
    /// `--exit-on-error`); `false` serves the others and lists the failure.
    #[arg(long, value_parser = triton::boolean, default_value = "true", action = ArgAction::Set)]
    pub exit_on_error: bool,

    /// Readiness (`/v2/health/ready`, `ServerReady`) waits for every loaded model
    /// (Triton's `--strict-readiness`); `false`: ready once the server runs.
    #[arg(long, value_parser = triton::boolean, default_value = "true", action = ArgAction::Set)]
    pub strict_readiness: bool,

    /// Clients may register shared-memory regions, system and CUDA, and name them in
    /// inference requests instead of sending tensors (Triton's `--allow-client-shm`; off by
    /// default, as in Triton: a client can then read and write any shared-memory object the
    /// server's user can open).
    #[arg(long, value_parser = triton::boolean, default_value = "false", action = ArgAction::Set)]
    pub allow_client_shm: bool,

    /// The server's name in server metadata (Triton's `--id`).
    #[arg(long, default_value = "visiongate")]
    pub id: String,

    /// Debug logging (Triton's `--log-verbose`): 1 adds visiongate's own debug lines, 2
    /// every library's. `RUST_LOG`, when set, decides instead of the `--log-*` flags.
    #[arg(long, value_parser = triton::verbosity, default_value = "0")]
    pub log_verbose: u32,

    /// Information lines (Triton's `--log-info`).
    #[arg(long, value_parser = triton::boolean, default_value = "true", action = ArgAction::Set)]
    pub log_info: bool,

    /// Warning lines (Triton's `--log-warning`).
    #[arg(long, value_parser = triton::boolean, default_value = "true", action = ArgAction::Set)]
    pub log_warning: bool,

    /// Error lines (Triton's `--log-error`).
    #[arg(long, value_parser = triton::boolean, default_value = "true", action = ArgAction::Set)]
    pub log_error: bool,

    /// Write the log lines to this file (appended; created if missing) instead of
    /// standard output (Triton's `--log-file`).
    #[arg(long)]
    pub log_file: Option<PathBuf>,

    /// Triton's `--log-format`: `ISO8601` is visiongate's format (each line starts with an
    /// ISO 8601 UTC time); `default`, Triton's glog-style lines, is accepted and keeps it.
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,

    /// Triton's arguments that have no effect here: parsed, then logged as such.
    #[command(flatten)]
    pub no_effect: triton::NoEffect,
}

/// `--tf32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Tf32 {
    Default,
    On,
    Off,
}

/// `--precision` (any case, as the config parameter).
fn precision(value: &str) -> Result<Precision, String> {
    Precision::parse(value).ok_or_else(|| format!("'{value}': expected fp32, bf16 or fp16"))
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

/// The default decode threads on `cores` cores: every core but one when a model instance
/// runs on a GPU (the GPU's forward pass needs little CPU, so decoding is the limit),
/// half of them with CPU instances only (the instances need the other half).
pub fn decode_threads(cores: usize, gpu_instances: bool) -> usize {
    if gpu_instances {
        cores.saturating_sub(1).max(1)
    } else {
        (cores / 2).max(1)
    }
}

/// Validated settings, passed down as one struct; the raw flags stay behind.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: Listen,
    pub engine: EngineSettings,
    pub models: ModelDefaults,
    pub limits: UploadLimits,
    pub grpc: GrpcSettings,
    pub refresh: MetricsRefresh,
    /// `--exit-on-error`: a model that fails at start-up stops the server.
    pub exit_on_error: bool,
    /// `--decode-threads`, `None` for the default (which depends on where the model
    /// instances run: `decode_threads`).
    pub decode_threads: Option<usize>,
    /// Bytes of decoded images all decode threads together may hold.
    pub decode_memory: u64,
    pub http_workers: usize,
    /// How long a stopping server lets the requests under way finish.
    pub exit_timeout: Duration,
    pub control: ControlSettings,
    /// Response cache bytes (`--cache-size`, or Triton's cache flags when given).
    pub cache_size: usize,
    pub metrics: MetricsConfig,
    pub server: ServerOptions,
}

/// Where the listeners bind; `None` for one that is off (Triton's `--allow-*`).
#[derive(Debug, Clone, Copy)]
pub struct Listen {
    pub http: Option<Bind>,
    pub grpc: Option<Bind>,
    pub metrics: Option<Bind>,
}

/// Where one listener binds (port 0: a free one).
#[derive(Debug, Clone, Copy)]
pub struct Bind {
    pub addr: SocketAddr,
    /// SO_REUSEPORT (`--reuse-http-port`, `--reuse-grpc-port`).
    pub reuse_port: bool,
}

/// How the engines run.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// Intra-op threads per instance (libtorch's; ONNX Runtime's unless a config sets them).
    pub intra_op_threads: usize,
    pub tf32: Tf32,
    /// The ONNX Runtime library (`None`: the dynamic linker's search).
    pub onnxruntime_library: Option<PathBuf>,
    /// JPEG decode on GPU instances (`None`: turned off).
    pub gpu_decode: Option<GpuDecode>,
}

/// JPEG decode on the GPU.
#[derive(Debug, Clone)]
pub struct GpuDecode {
    /// nvJPEG (`None`: the dynamic linker's search).
    pub library: Option<PathBuf>,
    /// Device memory each instance's decoded images may hold at once.
    pub memory_bytes: u64,
}

/// What every model gets unless its config says otherwise.
#[derive(Debug, Clone, Copy)]
pub struct ModelDefaults {
    pub max_queue_size: usize,
    pub max_image_pixels: u64,
    pub dct_override: Option<u32>,
    /// `--precision`: every classifier's, instead of its config's.
    pub precision: Option<Precision>,
}

/// The CPU and GPU series' refresh.
#[derive(Debug, Clone, Copy)]
pub struct MetricsRefresh {
    pub cpu: bool,
    pub gpu: bool,
    pub interval: Duration,
}

impl Config {
    /// What the `--log-*` flags let through.
    pub fn log_levels(&self) -> LogLevels {
        LogLevels {
            verbose: self.log_verbose,
            info: self.log_info,
            warning: self.log_warning,
            error: self.log_error,
        }
    }

    /// Checks every flag and derives the settings; logs the Triton arguments that have no
    /// effect here (call after `telemetry::init`).
    pub fn validate(self) -> Result<Settings, String> {
        let mut repositories: Vec<Location> = Vec::new();
        for repository in &self.model_repository {
            let location = Location::parse(&repository.to_string_lossy())?;
            if let Location::Local(dir) = &location {
                if !dir.is_dir() {
                    return Err(format!(
                        "--model-repository {} is not a directory",
                        dir.display()
                    ));
                }
            }
            // Named twice (even by two spellings) is one repository, as in Triton.
            let same = |a: &Location| match (a, &location) {
                (Location::Local(a), Location::Local(b)) => {
                    a.canonicalize().ok() == b.canonicalize().ok()
                }
                (a, b) => a == b,
            };
            if !repositories.iter().any(same) {
                repositories.push(location);
            }
        }
        if self.repository_cache_max_bytes == 0
            || self.repository_max_object_bytes == 0
            || self.repository_timeout_secs == 0
        {
            return Err(
                "--repository-cache-max-bytes, --repository-max-object-bytes and \
                        --repository-timeout-secs must be at least 1"
                    .into(),
            );
        }
        if !self.load_models.is_empty() && self.model_control_mode != ControlMode::Explicit {
            return Err("--load-model needs --model-control-mode=explicit as well".into());
        }
        if self.max_files == 0
            || self.intra_op_threads == 0
            || self.max_queue_size == 0
            || self.max_model_versions == 0
            || self.max_batch_bytes == 0
            || self.max_model_instances == 0
            || self.max_instances == 0
            || self.body_timeout_secs == 0
            || self.body_min_rate == 0
            || self.grpc_max_connections == 0
            || self.grpc_max_connections_per_peer == 0
            || self.grpc_max_concurrent_streams == 0
            || self.grpc_keepalive_time == 0
            || self.grpc_keepalive_timeout == 0
            || self.grpc_idle_timeout_secs == 0
            || self.grpc_handshake_timeout_secs == 0
            || self.metrics_interval_ms == 0
        {
            return Err(
                "--max-files, --intra-op-threads, --max-queue-size, the --max-* model \
                 limits, --body-timeout-secs, --body-min-rate and the --grpc-* limits and \
                 timeouts must be at least 1 (and --metrics-interval-ms)"
                    .into(),
            );
        }
        const DAY_SECS: u64 = 86_400;
        if self.body_timeout_secs > DAY_SECS
            || self.exit_timeout_secs > DAY_SECS
            || self.max_queue_delay_secs > DAY_SECS
            || self.grpc_idle_timeout_secs > DAY_SECS
            || self.grpc_handshake_timeout_secs > DAY_SECS
            || self.grpc_keepalive_time > DAY_SECS * 1000
            || self.grpc_keepalive_timeout > DAY_SECS * 1000
        {
            return Err("timeouts and intervals must be at most a day".into());
        }
        let mut keys = ApiKeys::default();
        for group in &self.http_restricted_api {
            keys.http
                .add_group(group, "")
                .map_err(|e| format!("--http-restricted-api {e}"))?;
        }
        for group in &self.grpc_restricted_protocol {
            keys.grpc
                .add_group(group, GRPC_HEADER_PREFIX)
                .map_err(|e| format!("--grpc-restricted-protocol {e}"))?;
        }
        if let Some(v) = &self.repository_control_key {
            let (header, key) = v
                .split_once('=')
                .filter(|(h, k)| !h.trim().is_empty() && !k.is_empty())
                .ok_or(
                    "--repository-control-key must be <header>=<key>, e.g. x-admin-key=secret",
                )?;
            for restrictions in [&mut keys.http, &mut keys.grpc] {
                restrictions
                    .add(
                        &[Endpoint::RepositoryControl],
                        header,
                        key,
                        "model load/unload (--repository-control-key)",
                    )
                    .map_err(|e| format!("--repository-control-key: {e}"))?;
            }
        }
        let cache_size = triton::cache_size(&self.cache_config, self.response_cache_byte_size)?
            .unwrap_or(self.cache_size);
        let metrics = triton::metrics_config(&self.metrics_config)?;
        self.log_ignored(&metrics);
        if self.repository_poll_secs == 0 {
            return Err("--repository-poll-secs must be at least 1".into());
        }
        let control = ControlSettings {
            mode: self.model_control_mode,
            repositories,
            remote: RemoteSettings {
                cache_dir: self.repository_cache_dir.clone(),
                max_cache_bytes: self.repository_cache_max_bytes,
                max_object_bytes: self.repository_max_object_bytes,
                timeout: Duration::from_secs(self.repository_timeout_secs),
            },
            poll_interval: Duration::from_secs(self.repository_poll_secs),
            startup_models: self.load_models.clone(),
            config_name: self.model_config_name.clone(),
            limits: Limits {
                versions: self.max_model_versions,
                batch_bytes: self.max_batch_bytes,
                warmup_rows: self.max_warmup_rows,
                model_instances: self.max_model_instances,
                instances: self.max_instances,
                queue_delay: Duration::from_secs(self.max_queue_delay_secs),
            },
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // How fast a request body must keep arriving, on both transports.
        let pace = BodyPace {
            timeout: Duration::from_secs(self.body_timeout_secs),
            min_rate: self.body_min_rate,
        };
        Ok(Settings {
            decode_threads: (self.decode_threads > 0).then_some(self.decode_threads),
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
            cache_size,
            metrics,
            server: ServerOptions {
                id: self.id.clone(),
                strict_readiness: self.strict_readiness,
                allow_client_shm: self.allow_client_shm,
                keys,
            },
            listen: self.listen(),
            engine: EngineSettings {
                intra_op_threads: self.intra_op_threads,
                tf32: self.tf32,
                onnxruntime_library: self.onnxruntime_library.clone(),
                gpu_decode: self.gpu_decode.then(|| GpuDecode {
                    library: self.nvjpeg_library.clone(),
                    memory_bytes: self.gpu_decode_memory_bytes,
                }),
            },
            models: ModelDefaults {
                max_queue_size: self.max_queue_size,
                max_image_pixels: self.max_image_pixels,
                dct_override: self.dct_scaling_min_side,
                precision: self.precision,
            },
            limits: UploadLimits {
                max_files: self.max_files,
                max_file_bytes: self.max_file_bytes,
                max_body_bytes: self.max_body_bytes,
                max_input_bytes: self.http_max_input_size.unwrap_or(self.max_body_bytes),
                pace,
            },
            grpc: GrpcSettings {
                max_message_bytes: self.grpc_max_message_bytes,
                max_concurrent_streams: self.grpc_max_concurrent_streams,
                keepalive_time: Duration::from_millis(self.grpc_keepalive_time),
                keepalive_timeout: Duration::from_millis(self.grpc_keepalive_timeout),
                connections: ConnLimits {
                    max_connections: self.grpc_max_connections,
                    per_peer: self.grpc_max_connections_per_peer,
                    handshake: Duration::from_secs(self.grpc_handshake_timeout_secs),
                    idle: Duration::from_secs(self.grpc_idle_timeout_secs),
                    tcp_keepalive: Duration::from_millis(self.grpc_keepalive_time),
                    lifetime: self
                        .grpc_max_connection_age
                        .zip(self.grpc_max_connection_age_grace)
                        .map(|(age, grace)| Duration::from_millis(age.saturating_add(grace))),
                },
                pace,
                tls: if self.allow_grpc {
                    self.grpc_tls()?
                } else {
                    None
                },
                max_connection_age: self.grpc_max_connection_age.map(Duration::from_millis),
            },
            refresh: MetricsRefresh {
                cpu: self.allow_cpu_metrics,
                gpu: self.allow_gpu_metrics,
                interval: Duration::from_millis(self.metrics_interval_ms),
            },
            exit_on_error: self.exit_on_error,
        })
    }

    /// Where each listener binds: its own address flag, else `--host` (metrics: else
    /// `--http-address`, as in Triton).
    fn listen(&self) -> Listen {
        let http = self.http_address.unwrap_or(self.host);
        let bind = |on: bool, host: IpAddr, port: u16, reuse_port: bool| {
            on.then_some(Bind {
                addr: SocketAddr::new(host, port),
                reuse_port,
            })
        };
        Listen {
            http: bind(self.allow_http, http, self.http_port, self.reuse_http_port),
            grpc: bind(
                self.allow_grpc,
                self.grpc_address.unwrap_or(self.host),
                self.grpc_port,
                self.reuse_grpc_port,
            ),
            metrics: bind(
                self.allow_metrics,
                self.metrics_address.unwrap_or(http),
                self.metrics_port,
                false,
            ),
        }
    }

    /// The gRPC listener's TLS, as Triton reads its flags: `--grpc-use-ssl-mutual` implies
    /// `--grpc-use-ssl` and needs `--grpc-root-cert`; the certificate flags are ignored
    /// without either.
    fn grpc_tls(&self) -> Result<Option<crate::grpc::tls::TlsAcceptor>, String> {
        // As Triton's parser: naming --grpc-use-ssl-mutual at all turns TLS on.
        if !self.grpc_use_ssl && self.grpc_use_ssl_mutual.is_none() {
            return Ok(None);
        }
        let mutual = self.grpc_use_ssl_mutual == Some(true);
        let flag = if self.grpc_use_ssl_mutual.is_some() {
            "--grpc-use-ssl-mutual"
        } else {
            "--grpc-use-ssl"
        };
        let (Some(cert), Some(key)) = (&self.grpc_server_cert, &self.grpc_server_key) else {
            return Err(format!(
                "{flag}=true needs --grpc-server-cert and --grpc-server-key (PEM files)"
            ));
        };
        let roots = if mutual {
            Some(self.grpc_root_cert.as_deref().ok_or(
                "--grpc-use-ssl-mutual=true needs --grpc-root-cert (PEM file of the \
                 certificates that sign clients' certificates)",
            )?)
        } else {
            None
        };
        crate::grpc::tls::acceptor(cert, key, roots).map(Some)
    }

    /// One log line for each Triton argument given that has no effect here.
    fn log_ignored(&self, metrics: &MetricsConfig) {
        let mut ignored = self.no_effect.given();
        if self.log_format == Some(LogFormat::Default) {
            ignored.push((
                "--log-format=default",
                "log lines keep visiongate's format, which starts with an ISO 8601 time",
            ));
        }
        for (flag, why) in ignored {
            tracing::info!("{flag}: accepted, no effect in visiongate ({why})");
        }
        for setting in &metrics.unknown {
            tracing::warn!("--metrics-config {setting}: unknown setting, ignored");
        }
    }

    /// Defaults for tests: the bundled repository, loopback, a free port.
    pub fn for_tests() -> Config {
        let mut c = Config::parse_from(["visiongate"]);
        c.model_repository = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models")];
        c.host = IpAddr::from([127, 0, 0, 1]);
        c.http_port = 0;
        c.grpc_port = 0;
        c.metrics_port = 0;
        c.http_workers = 2;
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, String> {
        Config::try_parse_from(std::iter::once("tritonserver").chain(args.iter().copied()))
            .map_err(|e| e.to_string())
    }

    fn models() -> String {
        format!("{}/models", env!("CARGO_MANIFEST_DIR"))
    }

    #[test]
    fn decode_threads_follow_where_the_instances_run() {
        for (cores, gpu, want) in [
            (1, false, 1),
            (2, false, 1),
            (16, false, 8),
            (1, true, 1),
            (2, true, 1),
            (16, true, 15),
            (64, true, 63),
        ] {
            assert_eq!(decode_threads(cores, gpu), want, "{cores} cores, GPU {gpu}");
        }
    }

    #[test]
    fn tritons_manifest_lines_parse_in_both_spellings() {
        let c = parse(&[
            "--model-repository=models",
            "--strict-model-config=false",
            "--log-verbose=1",
        ])
        .unwrap();
        assert_eq!(c.model_repository, [PathBuf::from("models")]);
        assert_eq!(
            (c.no_effect.strict_model_config, c.log_verbose),
            (Some(false), 1)
        );

        let c = parse(&[
            "--model-control-mode",
            "poll",
            "--repository-poll-secs",
            "30",
            "--model-store",
            "a",
            "--model-repository",
            "b",
            "--allow-grpc",
            "OFF",
            "--http-thread-count",
            "3",
            "--disable-auto-complete-config",
            "--log-format",
            "ISO8601",
        ])
        .unwrap();
        assert_eq!(c.model_control_mode, ControlMode::Poll);
        assert_eq!(c.repository_poll_secs, 30);
        assert_eq!(c.model_repository, [PathBuf::from("a"), PathBuf::from("b")]);
        assert!(!c.allow_grpc && c.allow_http && c.no_effect.disable_auto_complete_config);
        assert_eq!(c.http_workers, 3);
        assert_eq!(c.log_format, Some(LogFormat::Iso8601));

        // visiongate's own: a precision for every classifier, Triton's shared-memory switch.
        let c = parse(&["--precision=bf16", "--allow-client-shm=true"]).unwrap();
        assert_eq!(c.precision, Some(Precision::Bf16));
        assert!(c.allow_client_shm);
        assert!(!parse(&[]).unwrap().allow_client_shm);
        assert!(parse(&["--precision=int8"]).is_err());

        // A boolean flag needs its value, as in Triton.
        assert!(parse(&["--allow-http"]).is_err());
        assert!(parse(&["--exit-on-error=maybe"]).is_err());
        assert!(parse(&["--no-such-flag=1"]).is_err());
    }

    /// Every option of `tritonserver` (its command-line parser, release 2.73) but
    /// `--model-repository` and `--help`, each with a value a manifest would carry.
    pub(crate) const TRITONSERVER_OPTIONS: &[&str] = &[
        "--id=triton-prod",
        "--exit-timeout-secs=30",
        "--model-store=models",
        "--exit-on-error=true",
        "--disable-auto-complete-config",
        "--strict-readiness=true",
        "--model-control-mode=poll",
        "--repository-poll-secs=15",
        "--load-model=classifier",
        "--model-config-name=h100",
        "--model-load-thread-count=4",
        "--model-load-retry-count=2",
        "--model-namespacing=false",
        "--enable-peer-access=true",
        "--allow-http=true",
        "--http-address=0.0.0.0",
        "--http-port=8000",
        "--reuse-http-port=true",
        "--http-header-forward-pattern=x-request-.*",
        "--http-thread-count=8",
        "--http-max-input-size=67108864",
        "--http-restricted-api=model-repository:admin-key=s3cret",
        "--allow-grpc=true",
        "--grpc-address=[::]",
        "--grpc-port=8001",
        "--reuse-grpc-port=true",
        "--grpc-header-forward-pattern=x-request-.*",
        "--grpc-infer-thread-count=2",
        "--grpc-infer-allocation-pool-size=8",
        "--grpc-max-response-pool-size=64",
        "--grpc-use-ssl=false",
        "--grpc-use-ssl-mutual=false",
        "--grpc-server-cert=/certs/server.crt",
        "--grpc-server-key=/certs/server.key",
        "--grpc-root-cert=/certs/ca.crt",
        "--grpc-infer-response-compression-level=high",
        "--grpc-keepalive-time=7200000",
        "--grpc-keepalive-timeout=20000",
        "--grpc-keepalive-permit-without-calls=true",
        "--grpc-http2-max-pings-without-data=2",
        "--grpc-http2-min-recv-ping-interval-without-data=300000",
        "--grpc-http2-max-ping-strikes=2",
        "--grpc-max-connection-age=3600000",
        "--grpc-max-connection-age-grace=30000",
        "--grpc-restricted-protocol=model-repository:admin-key=s3cret",
        "--log-verbose=1",
        "--log-info=true",
        "--log-warning=true",
        "--log-error=true",
        "--log-format=ISO8601",
        "--log-file=/var/log/triton.log",
        "--allow-sagemaker=true",
        "--sagemaker-port=8080",
        "--sagemaker-safe-port-range=8081-8082",
        "--sagemaker-thread-count=8",
        "--allow-vertex-ai=true",
        "--vertex-ai-port=8080",
        "--vertex-ai-thread-count=8",
        "--vertex-ai-default-model=ensemble_model",
        "--allow-metrics=true",
        "--allow-gpu-metrics=true",
        "--allow-cpu-metrics=true",
        "--metrics-address=0.0.0.0",
        "--metrics-port=8002",
        "--metrics-interval-ms=2000",
        "--metrics-config=summary_latencies=true",
        "--trace-config=opentelemetry,url=http://collector:4318/v1/traces",
        "--cache-config=local,size=1048576",
        "--cache-directory=/opt/tritonserver/caches",
        "--rate-limit=execution_count",
        "--rate-limit-resource=R1:10:0",
        "--pinned-memory-pool-byte-size=268435456",
        "--cuda-memory-pool-byte-size=0:67108864",
        "--cuda-virtual-address-size=0:1073741824",
        "--min-supported-compute-capability=6.0",
        "--buffer-manager-thread-count=0",
        "--host-policy=gpu_0,numa-node=0",
        "--model-load-gpu-limit=0:0.8",
        "--allow-client-shm=false",
        "--backend-directory=/opt/tritonserver/backends",
        "--backend-config=pytorch,default-max-batch-size=8",
        "--repoagent-directory=/opt/tritonserver/repoagents",
        "--strict-model-config=false",
        "--response-cache-byte-size=1048576",
        "--trace-file=/tmp/trace.json",
        "--trace-level=TIMESTAMPS",
        "--trace-rate=1000",
        "--trace-count=-1",
        "--trace-log-frequency=0",
    ];

    #[test]
    fn every_tritonserver_option_is_accepted_alone() {
        let m = models();
        for option in TRITONSERVER_OPTIONS {
            let mut args = vec![format!("--model-repository={m}")];
            if option.starts_with("--load-model") {
                args.push("--model-control-mode=explicit".into());
            }
            args.push(option.to_string());
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let config = parse(&args).unwrap_or_else(|e| panic!("{option}: {e}"));
            match config.validate() {
                // As in Triton, naming it at all (`false` too) turns TLS on, which needs
                // the certificate and key.
                Err(e) if option.starts_with("--grpc-use-ssl-mutual") => {
                    assert!(e.contains("--grpc-server-cert"), "{e}")
                }
                other => {
                    other.unwrap_or_else(|e| panic!("{option}: {e}"));
                }
            }
        }
        // Triton's IPv6 spelling and host names bind where they resolve.
        for (given, addr) in [
            ("ipv6:[::1]", "::1"),
            ("[::]", "::"),
            ("localhost", "127.0.0.1"),
        ] {
            let c = parse(&[&format!("--grpc-address={given}")]).unwrap();
            assert_eq!(c.grpc_address.unwrap().to_string(), addr, "{given}");
        }
        // With gRPC off, its TLS files are not read (Triton does not read them either).
        parse(&[
            &format!("--model-repository={m}"),
            "--allow-grpc=false",
            "--grpc-use-ssl=true",
        ])
        .unwrap()
        .validate()
        .unwrap();
        // What a value means where visiongate honours it.
        let s = parse(&[
            &format!("--model-repository={m}"),
            "--host=127.0.0.1",
            "--grpc-address=[::1]",
            "--http-address=0.0.0.0",
            "--reuse-grpc-port=1",
            "--http-max-input-size=1000",
            "--model-config-name=h100",
            "--grpc-max-connection-age=5000",
        ])
        .unwrap()
        .validate()
        .unwrap();
        let (http, grpc, metrics) = (
            s.listen.http.unwrap(),
            s.listen.grpc.unwrap(),
            s.listen.metrics.unwrap(),
        );
        assert_eq!(http.addr.to_string(), "0.0.0.0:8000");
        assert_eq!(grpc.addr.to_string(), "[::1]:8001");
        // Triton's metrics address defaults to the HTTP address.
        assert_eq!(metrics.addr.to_string(), "0.0.0.0:8002");
        assert!(grpc.reuse_port && !http.reuse_port);
        assert_eq!(s.limits.max_input_bytes, 1000);
        assert_eq!(s.limits.max_body_bytes, 4 << 30);
        assert_eq!(s.control.config_name.as_deref(), Some("h100"));
        assert_eq!(s.grpc.max_connection_age, Some(Duration::from_secs(5)));
        assert!(s.grpc.tls.is_none());
        // Given twice, the last value counts (as tritonserver's parser).
        assert_eq!(
            parse(&["--http-port=1", "--http-port=2"])
                .unwrap()
                .http_port,
            2
        );
        // Every no-effect option given is named in the log, once.
        let c = parse(TRITONSERVER_OPTIONS).unwrap();
        let given = c.no_effect.given();
        for flag in [
            "--trace-config",
            "--rate-limit",
            "--allow-sagemaker",
            "--host-policy",
        ] {
            assert_eq!(
                given.iter().filter(|(f, _)| *f == flag).count(),
                1,
                "{flag}"
            );
        }
    }

    #[test]
    fn option_values_tritonserver_would_refuse_are_refused_naming_the_option() {
        for (bad, says) in [
            ("--http-address=localhost:80", "--http-address"),
            ("--model-config-name=../x", "--model-config-name"),
            ("--model-config-name=a b", "--model-config-name"),
            ("--rate-limit=sometimes", "--rate-limit"),
            ("--rate-limit-resource=R1", "--rate-limit-resource"),
            ("--trace-level=LOUD", "--trace-level"),
            ("--trace-config=level", "--trace-config"),
            (
                "--sagemaker-safe-port-range=9-1",
                "--sagemaker-safe-port-range",
            ),
            ("--model-load-gpu-limit=0:1.5", "--model-load-gpu-limit"),
            (
                "--http-header-forward-pattern=(",
                "--http-header-forward-pattern",
            ),
            (
                "--grpc-infer-response-compression-level=max",
                "--grpc-infer-response-compression-level",
            ),
            ("--http-max-input-size=0", "--http-max-input-size"),
            ("--reuse-http-port", "--reuse-http-port"),
        ] {
            let err = parse(&[bad]).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
        let m = models();
        for (args, says) in [
            (
                vec!["--grpc-use-ssl=true"],
                "--grpc-server-cert and --grpc-server-key",
            ),
            (
                vec![
                    "--grpc-use-ssl-mutual=true",
                    "--grpc-server-cert=a",
                    "--grpc-server-key=b",
                ],
                "--grpc-root-cert",
            ),
            (
                vec![
                    "--grpc-use-ssl=true",
                    "--grpc-server-cert=/no/such/cert.pem",
                    "--grpc-server-key=/no/such/key.pem",
                ],
                "--grpc-server-cert /no/such/cert.pem",
            ),
        ] {
            let mut all = vec![format!("--model-repository={m}")];
            all.extend(args.iter().map(|a| a.to_string()));
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            let err = parse(&all).unwrap().validate().unwrap_err();
            assert!(err.contains(says), "{args:?}: {err}");
        }
    }

    #[test]
    fn validation_derives_what_the_flags_mean() {
        let m = models();
        let s = parse(&[
            &format!("--model-repository={m}"),
            &format!("--model-repository={m}/"),
            "--response-cache-byte-size=4096",
            "--id=edge-1",
            "--strict-readiness=0",
            "--http-restricted-api=model-repository:k=v",
        ])
        .unwrap()
        .validate()
        .unwrap();
        // One repository named twice is one.
        assert_eq!(s.control.repositories.len(), 1);
        assert_eq!(s.cache_size, 4096);
        assert_eq!(s.server.id, "edge-1");
        assert!(!s.server.strict_readiness);
        assert!(s.server.keys.http.is_restricted(Endpoint::RepositoryIndex));
        assert!(!s.server.keys.grpc.is_restricted(Endpoint::RepositoryIndex));

        let legacy = parse(&[
            &format!("--model-repository={m}"),
            "--repository-control-key=h=k",
        ])
        .unwrap()
        .validate()
        .unwrap();
        for keys in [&legacy.server.keys.http, &legacy.server.keys.grpc] {
            assert!(keys.is_restricted(Endpoint::RepositoryControl));
            assert!(!keys.is_restricted(Endpoint::RepositoryIndex));
        }

        for (args, says) in [
            (
                vec!["--load-model=classifier"],
                "--model-control-mode=explicit",
            ),
            (
                vec![
                    "--repository-control-key=h=k",
                    "--http-restricted-api=model-repository:h=k",
                ],
                "restricted twice",
            ),
            (vec!["--repository-control-key=nokey"], "<header>=<key>"),
            (
                vec!["--metrics-config=summary_latencies"],
                "<setting>=<value>",
            ),
        ] {
            let mut all = vec![format!("--model-repository={m}")];
            all.extend(args.iter().map(|a| a.to_string()));
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            let err = parse(&all).unwrap().validate().unwrap_err();
            assert!(err.contains(says), "{args:?}: {err}");
        }
    }
}
