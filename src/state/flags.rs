//! The flags of what the state holds (the repositories and how models load, who may call
//! what, request bodies' limits, the server's own options), each group checked into the
//! settings it gives.
use std::path::PathBuf;
use std::time::Duration;

use super::GRPC_HEADER_PREFIX;
use super::{ApiKeys, ControlMode, ControlSettings, Endpoint, ServerOptions, UploadLimits};
use crate::config::{self, DAY_SECS};
use crate::pace::BodyPace;
use crate::repository::{self, Location};

/// The model repositories, how their models load and change, and what a model may ask for.
#[derive(clap::Args, Debug, Clone)]
pub struct ControlFlags {
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
        action = clap::ArgAction::Append
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
    #[arg(long, value_parser = config::config_name)]
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
    #[arg(long, env = "VISIONGATE_REPOSITORY_CACHE_MAX_BYTES", default_value_t = repository::RemoteSettings::DEFAULT_MAX_CACHE_BYTES)]
    pub repository_cache_max_bytes: u64,

    /// The largest object downloaded from a remote repository; a model with a larger one
    /// fails its load, naming the object.
    #[arg(long, env = "VISIONGATE_REPOSITORY_MAX_OBJECT_BYTES", default_value_t = repository::RemoteSettings::DEFAULT_MAX_OBJECT_BYTES)]
    pub repository_max_object_bytes: u64,

    /// The longest one request to a remote repository's store may take (a listing with all
    /// its pages, one object's download however slowly its bytes come), retries included; a
    /// failed connection or a 5xx answer is retried three times with backoff within it.
    #[arg(long, env = "VISIONGATE_REPOSITORY_TIMEOUT_SECS", default_value_t = repository::RemoteSettings::DEFAULT_TIMEOUT_SECS)]
    pub repository_timeout_secs: u64,

    /// In `explicit` mode, a model to load at start-up (repeat the flag, or `*` for all).
    /// As in Triton (since 2.48), it needs `--model-control-mode explicit`.
    #[arg(
        long = "load-model",
        env = "VISIONGATE_LOAD_MODEL",
        value_delimiter = ','
    )]
    pub load_models: Vec<String>,

    /// Versions of one model served at once (its `version_policy` may select no more).
    #[arg(long, env = "VISIONGATE_MAX_MODEL_VERSIONS", default_value_t = repository::Limits::DEFAULT_VERSIONS)]
    pub max_model_versions: usize,

    /// Bytes of one batch's input: the batches the server forms for a classifier hold at
    /// most as many rows of its FP32 `[3, height, width]` input as fit, however large its
    /// `max_batch_size` (what the model takes; a larger request is cut into such batches).
    /// Every batch a model runs, at warm-up or serving, is within it; one row, or one
    /// preprocessor output image, over it fails the load.
    #[arg(long, env = "VISIONGATE_MAX_BATCH_BYTES", default_value_t = repository::Limits::DEFAULT_BATCH_BYTES)]
    pub max_batch_bytes: u64,

    /// Rows the `model_warmup` samples of one model run on each instance before it serves
    /// (each sample's `batch_size` times its `count`).
    #[arg(long, env = "VISIONGATE_MAX_WARMUP_ROWS", default_value_t = repository::Limits::DEFAULT_WARMUP_ROWS)]
    pub max_warmup_rows: u64,

    /// Instances of one model version (each a thread with its own copy of the model), as
    /// its `instance_group`s place them on this host.
    #[arg(long, env = "VISIONGATE_MAX_MODEL_INSTANCES", default_value_t = repository::Limits::DEFAULT_MODEL_INSTANCES)]
    pub max_model_instances: usize,

    /// Seconds a row may wait for a batch to fill: a model's
    /// `max_queue_delay_microseconds` may be no longer.
    #[arg(long, env = "VISIONGATE_MAX_QUEUE_DELAY_SECS", default_value_t = repository::Limits::DEFAULT_QUEUE_DELAY_SECS)]
    pub max_queue_delay_secs: u64,

    /// Instances of all models together; those of a model being replaced count until it
    /// has finished its requests.
    #[arg(long, env = "VISIONGATE_MAX_INSTANCES", default_value_t = repository::Limits::DEFAULT_INSTANCES)]
    pub max_instances: usize,
}

impl ControlFlags {
    pub fn settings(&self) -> Result<ControlSettings, String> {
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
            || self.repository_poll_secs == 0
        {
            return Err(
                "--repository-cache-max-bytes, --repository-max-object-bytes, \
                        --repository-timeout-secs and --repository-poll-secs must be at least 1"
                    .into(),
            );
        }
        if self.max_model_versions == 0
            || self.max_batch_bytes == 0
            || self.max_model_instances == 0
            || self.max_instances == 0
        {
            return Err(
                "--max-model-versions, --max-batch-bytes, --max-model-instances and \
                        --max-instances must be at least 1"
                    .into(),
            );
        }
        if self.max_queue_delay_secs > DAY_SECS {
            return Err("--max-queue-delay-secs must be at most a day".into());
        }
        if !self.load_models.is_empty() && self.model_control_mode != ControlMode::Explicit {
            return Err("--load-model needs --model-control-mode=explicit as well".into());
        }
        Ok(ControlSettings {
            mode: self.model_control_mode,
            repositories,
            remote: repository::RemoteSettings {
                cache_dir: self.repository_cache_dir.clone(),
                max_cache_bytes: self.repository_cache_max_bytes,
                max_object_bytes: self.repository_max_object_bytes,
                timeout: Duration::from_secs(self.repository_timeout_secs),
            },
            poll_interval: Duration::from_secs(self.repository_poll_secs),
            startup_models: self.load_models.clone(),
            config_name: self.model_config_name.clone(),
            limits: repository::Limits {
                versions: self.max_model_versions,
                batch_bytes: self.max_batch_bytes,
                warmup_rows: self.max_warmup_rows,
                model_instances: self.max_model_instances,
                instances: self.max_instances,
                queue_delay: Duration::from_secs(self.max_queue_delay_secs),
            },
        })
    }
}

/// Who may call which APIs: Triton's restricted APIs and visiongate's older control key.
#[derive(clap::Args, Debug, Clone)]
pub struct AccessFlags {
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
    #[arg(long, action = clap::ArgAction::Append)]
    pub http_restricted_api: Vec<String>,

    /// The same for gRPC methods; the metadata key is `triton-grpc-protocol-<header>`
    /// (Triton's), and a refusal is PERMISSION_DENIED (Triton: UNAVAILABLE).
    #[arg(long, action = clap::ArgAction::Append)]
    pub grpc_restricted_protocol: Vec<String>,
}

impl AccessFlags {
    pub fn keys(&self) -> Result<ApiKeys, String> {
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
        Ok(keys)
    }
}

/// The limits of request bodies, on both transports.
#[derive(clap::Args, Debug, Clone)]
pub struct UploadFlags {
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
}

impl UploadFlags {
    pub fn limits(&self) -> Result<UploadLimits, String> {
        if self.max_files == 0 || self.body_timeout_secs == 0 || self.body_min_rate == 0 {
            return Err(
                "--max-files, --body-timeout-secs and --body-min-rate must be at least 1".into(),
            );
        }
        if self.body_timeout_secs > DAY_SECS {
            return Err("--body-timeout-secs must be at most a day".into());
        }
        Ok(UploadLimits {
            max_files: self.max_files,
            max_file_bytes: self.max_file_bytes,
            max_body_bytes: self.max_body_bytes,
            max_input_bytes: self.http_max_input_size.unwrap_or(self.max_body_bytes),
            pace: BodyPace {
                timeout: Duration::from_secs(self.body_timeout_secs),
                min_rate: self.body_min_rate,
            },
        })
    }
}

/// What the server says of itself, whom it serves, and how it starts and stops.
#[derive(clap::Args, Debug, Clone)]
pub struct ServerFlags {
    /// The server's name in server metadata (Triton's `--id`).
    #[arg(long, default_value = "visiongate")]
    pub id: String,

    /// Readiness (`/v2/health/ready`, `ServerReady`) waits for every loaded model
    /// (Triton's `--strict-readiness`); `false`: ready once the server runs.
    #[arg(long, value_parser = config::boolean, default_value = "true", action = clap::ArgAction::Set)]
    pub strict_readiness: bool,

    /// Clients may register shared-memory regions, system and CUDA, and name them in
    /// inference requests instead of sending tensors (Triton's `--allow-client-shm`; off by
    /// default, as in Triton: a client can then read and write any shared-memory object the
    /// server's user can open).
    #[arg(long, value_parser = config::boolean, default_value = "false", action = clap::ArgAction::Set)]
    pub allow_client_shm: bool,

    /// Exit (status 1) when a model fails to load at start-up (Triton's
    /// `--exit-on-error`); `false` serves the others and lists the failure.
    #[arg(long, value_parser = config::boolean, default_value = "true", action = clap::ArgAction::Set)]
    pub exit_on_error: bool,

    /// Seconds a stopping server (SIGTERM or SIGINT) gives the requests it has already
    /// taken (Triton's `--exit-timeout-secs`). From the signal on, readiness answers 503
    /// and new inference requests get 503 `shutting_down`; once the requests under way are
    /// answered, or this time is up, the listeners close and open gRPC streams end. The
    /// process exits at most a few seconds later; a second signal exits at once. Keep the
    /// orchestrator's grace period longer (docker compose: 90 s, Kubernetes: 120 s here).
    #[arg(long, env = "VISIONGATE_EXIT_TIMEOUT_SECS", default_value_t = 60)]
    pub exit_timeout_secs: u64,
}

impl ServerFlags {
    pub fn options(&self, keys: ApiKeys, trace: crate::trace::TraceConfig) -> ServerOptions {
        ServerOptions {
            id: self.id.clone(),
            strict_readiness: self.strict_readiness,
            allow_client_shm: self.allow_client_shm,
            keys,
            trace: std::sync::Arc::new(crate::trace::Tracer::new(
                crate::trace::TraceSettings::new(trace),
            )),
        }
    }

    /// How long a stopping server lets the requests under way finish.
    pub fn exit_timeout(&self) -> Result<Duration, String> {
        if self.exit_timeout_secs > DAY_SECS {
            return Err("--exit-timeout-secs must be at most a day".into());
        }
        Ok(Duration::from_secs(self.exit_timeout_secs))
    }
}
