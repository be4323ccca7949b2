//! The value formats of Triton's server arguments, as `tritonserver` parses them, so that
//! the arguments in existing manifests mean the same here.
use std::net::IpAddr;
use std::path::PathBuf;

use clap::ArgAction;

/// A Triton boolean: `true`, `on`, `1` or `false`, `off`, `0`, in any case. Triton's
/// boolean flags take a value (`--allow-http=false`); a bare flag is not `true`.
pub fn boolean(value: &str) -> Result<bool, String> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "on" | "1" => Ok(true),
        "false" | "off" | "0" => Ok(false),
        _ => Err(format!(
            "invalid value for bool option: '{value}' (true, on, 1, false, off or 0)"
        )),
    }
}

/// `--log-verbose`: a level (0 is off), or `true` (1) / `false` (0).
pub fn verbosity(value: &str) -> Result<u32, String> {
    match value.to_ascii_lowercase().as_str() {
        "true" => Ok(1),
        "false" => Ok(0),
        v => v
            .parse()
            .map_err(|_| format!("'{value}': expected a level (0, 1, 2...), true or false")),
    }
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Triton's glog-style lines; visiongate keeps its own (ISO 8601 timestamps).
    Default,
    #[value(name = "ISO8601")]
    Iso8601,
}

/// The response cache's size from `--cache-config` (`<cache>,<setting>=<value>`, repeated)
/// and the older `--response-cache-byte-size`; `None` when neither is given.
pub fn cache_size(
    cache_config: &[String],
    byte_size: Option<u64>,
) -> Result<Option<usize>, String> {
    if byte_size.is_some() && !cache_config.is_empty() {
        return Err(
            "--response-cache-byte-size and --cache-config both given: use \
                    --cache-config=local,size=<bytes> only"
                .into(),
        );
    }
    let mut size = byte_size.map(|b| usize::try_from(b).unwrap_or(usize::MAX));
    for setting in cache_config {
        let bad = || format!("--cache-config '{setting}': expected <cache>,<setting>=<value>");
        let (cache, rest) = setting.split_once(',').ok_or_else(bad)?;
        let (key, value) = rest.split_once('=').ok_or_else(bad)?;
        if cache != "local" {
            return Err(format!(
                "--cache-config '{setting}': visiongate has the 'local' cache only (in memory)"
            ));
        }
        match key {
            "size" => {
                let bytes = value.parse().map_err(|_| {
                    format!("--cache-config '{setting}': size must be a number of bytes")
                })?;
                size = Some(bytes);
            }
            _ => {
                return Err(format!(
                    "--cache-config '{setting}': the local cache has one setting, size"
                ))
            }
        }
    }
    Ok(size)
}

/// `--backend-config`: `[<backend>,]<setting>=<value>`.
pub fn backend_setting(value: &str) -> Result<String, String> {
    let setting = match value.split_once(',') {
        Some((backend, setting)) if !backend.is_empty() && !backend.contains('=') => setting,
        Some(("", _)) => return Err(format!("'{value}': empty backend name")),
        _ => value,
    };
    match setting.split_once('=') {
        Some((k, _)) if !k.is_empty() => Ok(value.to_string()),
        _ => Err(format!("'{value}': expected [<backend>,]<setting>=<value>")),
    }
}

/// `--cuda-memory-pool-byte-size`: `<gpu>:<bytes>`.
pub fn gpu_bytes(value: &str) -> Result<String, String> {
    let ok = value
        .split_once(':')
        .is_some_and(|(gpu, bytes)| gpu.parse::<u32>().is_ok() && bytes.parse::<u64>().is_ok());
    if ok {
        Ok(value.to_string())
    } else {
        Err(format!("'{value}': expected <gpu id>:<bytes>"))
    }
}

/// An address to bind, as Triton's `--http-address`, `--grpc-address` and
/// `--metrics-address` take it: an IPv4 or IPv6 address, IPv6 also in brackets (`[::]`) or
/// with the `ipv6:` prefix Triton's HTTP server uses (`ipv6:[::1]`), or a host name (its
/// first address).
pub fn address(value: &str) -> Result<IpAddr, String> {
    use std::net::ToSocketAddrs;
    let plain = value.strip_prefix("ipv6:").unwrap_or(value);
    let bare = plain
        .strip_prefix('[')
        .and_then(|v| v.strip_suffix(']'))
        .unwrap_or(plain);
    if let Ok(ip) = bare.parse() {
        return Ok(ip);
    }
    let bad = || format!("'{value}': expected an address to bind (0.0.0.0, [::], a host name)");
    if bare.is_empty() || bare.contains([':', '/', ' ']) {
        return Err(bad());
    }
    (bare, 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut found| found.next())
        .map(|a| a.ip())
        .ok_or_else(bad)
}

/// `--model-config-name`: the file name (without `.pbtxt`) under each model's `configs/`.
pub fn config_name(value: &str) -> Result<String, String> {
    if value.is_empty()
        || value == "."
        || value == ".."
        || value.contains(['/', '\\', '\0'])
        || value.chars().any(char::is_whitespace)
    {
        return Err(format!(
            "'{value}': a file name under each model's configs/ (no spaces or slashes)"
        ));
    }
    Ok(value.to_string())
}

/// A regular expression (`--http-header-forward-pattern`, `--grpc-header-forward-pattern`).
fn pattern(value: &str) -> Result<String, String> {
    regex::Regex::new(value)
        .map(|_| value.to_string())
        .map_err(|e| format!("'{value}': not a regular expression: {e}"))
}

/// `<setting>=<value>`, or `<group>,<setting>=<value>` (`--trace-config`, `--host-policy`).
fn group_setting(value: &str) -> Result<String, String> {
    let setting = match value.split_once(',') {
        Some(("", _)) => return Err(format!("'{value}': empty name before ','")),
        Some((_, setting)) => setting,
        None => value,
    };
    match setting.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok(value.to_string()),
        _ => Err(format!("'{value}': expected [<name>,]<setting>=<value>")),
    }
}

/// `--rate-limit-resource`: `<name>:<count>[:<device>]`.
fn rate_limit_resource(value: &str) -> Result<String, String> {
    let parts: Vec<&str> = value.split(':').collect();
    let ok = matches!(parts.len(), 2 | 3)
        && !parts[0].is_empty()
        && parts[1].parse::<u32>().is_ok()
        && parts.get(2).is_none_or(|d| d.parse::<u32>().is_ok());
    ok.then(|| value.to_string())
        .ok_or_else(|| format!("'{value}': expected <resource>:<count>[:<device>]"))
}

/// `--model-load-gpu-limit`: `<device>:<fraction>`, the fraction in (0, 1].
fn gpu_fraction(value: &str) -> Result<String, String> {
    let ok = value.split_once(':').is_some_and(|(gpu, f)| {
        gpu.parse::<u32>().is_ok() && f.parse::<f64>().is_ok_and(|f| f > 0.0 && f <= 1.0)
    });
    ok.then(|| value.to_string())
        .ok_or_else(|| format!("'{value}': expected <gpu id>:<fraction in (0, 1]>"))
}

/// `--sagemaker-safe-port-range`: `<low>-<high>`.
fn port_range(value: &str) -> Result<String, String> {
    let ok = value.split_once('-').is_some_and(
        |(a, b)| matches!((a.parse::<u16>(), b.parse::<u16>()), (Ok(a), Ok(b)) if a <= b),
    );
    ok.then(|| value.to_string())
        .ok_or_else(|| format!("'{value}': expected <low port>-<high port>"))
}

/// `--rate-limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RateLimit {
    Off,
    #[value(name = "execution_count")]
    ExecutionCount,
}

/// `--grpc-infer-response-compression-level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Compression {
    None,
    Low,
    Medium,
    High,
}

/// Triton's server arguments that mean nothing in visiongate: each is parsed as
/// `tritonserver` parses it (a value it would refuse is refused, naming the argument) and,
/// when given, logged once at start-up with why it has no effect (`log`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct NoEffect {
    /// Triton's; accepted, no effect: visiongate needs every model's config.pbtxt and
    /// completes nothing from the model file.
    #[arg(long, value_parser = boolean, action = ArgAction::Set)]
    pub strict_model_config: Option<bool>,

    /// Triton's; accepted, no effect (see `--strict-model-config`).
    #[arg(long)]
    pub disable_auto_complete_config: bool,

    /// Triton's `[<backend>,]<setting>=<value>` (repeatable); accepted, no effect: the
    /// runtimes are built in.
    #[arg(long, value_parser = backend_setting, action = ArgAction::Append)]
    pub backend_config: Vec<String>,

    /// Triton's; accepted, no effect (the runtimes are built in, not loaded from there).
    #[arg(long)]
    pub backend_directory: Option<PathBuf>,

    /// Triton's; accepted, no effect (visiongate has no repository agents).
    #[arg(long)]
    pub repoagent_directory: Option<PathBuf>,

    /// Triton's; accepted, no effect (the response cache is built in).
    #[arg(long)]
    pub cache_directory: Option<PathBuf>,

    /// Triton's; accepted, no effect (libtorch allocates its own host memory).
    #[arg(long)]
    pub pinned_memory_pool_byte_size: Option<i64>,

    /// Triton's `<gpu>:<bytes>` (repeatable); accepted, no effect (libtorch's CUDA
    /// caching allocator manages GPU memory).
    #[arg(long, value_parser = gpu_bytes, action = ArgAction::Append)]
    pub cuda_memory_pool_byte_size: Vec<String>,

    /// Triton's `<gpu>:<bytes>` (repeatable); accepted, no effect (no implicit state).
    #[arg(long, value_parser = gpu_bytes, action = ArgAction::Append)]
    pub cuda_virtual_address_size: Vec<String>,

    /// Triton's; accepted, no effect (a GPU libtorch cannot run on is reported by its
    /// model's load).
    #[arg(long)]
    pub min_supported_compute_capability: Option<f64>,

    /// Triton's; accepted, no effect (tensors are copied where they are used).
    #[arg(long)]
    pub buffer_manager_thread_count: Option<u32>,

    /// Triton's `<policy>,<setting>=<value>` (repeatable); accepted, no effect.
    #[arg(long, value_parser = group_setting, action = ArgAction::Append)]
    pub host_policy: Vec<String>,

    /// Triton's `<gpu>:<fraction>` (repeatable); accepted, no effect.
    #[arg(long, value_parser = gpu_fraction, action = ArgAction::Append)]
    pub model_load_gpu_limit: Vec<String>,

    /// Triton's; accepted, no effect (CPU instances load one at a time, GPU instances
    /// side by side).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub model_load_thread_count: Option<u64>,

    /// Triton's; accepted, no effect (a failed load is reported; load it again through
    /// the repository API, or let poll mode retry it).
    #[arg(long)]
    pub model_load_retry_count: Option<u32>,

    /// Triton's; accepted, no effect (a model name found in two repositories is not
    /// served, as without namespacing).
    #[arg(long, value_parser = boolean, action = ArgAction::Set)]
    pub model_namespacing: Option<bool>,

    /// Triton's; accepted, no effect (every instance of a model runs on its own device).
    #[arg(long, value_parser = boolean, action = ArgAction::Set)]
    pub enable_peer_access: Option<bool>,

    /// Triton's `off` or `execution_count`; accepted, no effect (each instance runs its
    /// next batch as soon as it is free; models' `rate_limiter` settings are refused).
    #[arg(long, value_enum)]
    pub rate_limit: Option<RateLimit>,

    /// Triton's `<resource>:<count>[:<device>]` (repeatable); accepted, no effect (see
    /// `--rate-limit`).
    #[arg(long, value_parser = rate_limit_resource, action = ArgAction::Append)]
    pub rate_limit_resource: Vec<String>,

    /// Triton's; accepted, no effect (request headers are not forwarded as parameters).
    #[arg(long, value_parser = pattern)]
    pub http_header_forward_pattern: Option<String>,

    /// Triton's; accepted, no effect (see `--http-header-forward-pattern`).
    #[arg(long, value_parser = pattern)]
    pub grpc_header_forward_pattern: Option<String>,

    /// Triton's; accepted, no effect (gRPC calls run on the async workers).
    #[arg(long)]
    pub grpc_infer_thread_count: Option<u32>,

    /// Triton's; accepted, no effect (no pools of request states).
    #[arg(long)]
    pub grpc_infer_allocation_pool_size: Option<i64>,

    /// Triton's; accepted, no effect (no pools of responses).
    #[arg(long)]
    pub grpc_max_response_pool_size: Option<i64>,

    /// Triton's `none`, `low`, `medium` or `high`; accepted, no effect (responses go
    /// uncompressed, Triton's default).
    #[arg(long, value_enum)]
    pub grpc_infer_response_compression_level: Option<Compression>,

    /// Triton's; accepted, no effect (the server's own keepalive pings are sent whether
    /// or not calls are open).
    #[arg(long, value_parser = boolean, action = ArgAction::Set)]
    pub grpc_keepalive_permit_without_calls: Option<bool>,

    /// Triton's; accepted, no effect (gRPC Core's ping policy; HTTP/2 pings from clients
    /// are answered).
    #[arg(long)]
    pub grpc_http2_max_pings_without_data: Option<i64>,

    /// Triton's; accepted, no effect (see `--grpc-http2-max-pings-without-data`).
    #[arg(long)]
    pub grpc_http2_min_recv_ping_interval_without_data: Option<i64>,

    /// Triton's; accepted, no effect (see `--grpc-http2-max-pings-without-data`).
    #[arg(long)]
    pub grpc_http2_max_ping_strikes: Option<i64>,

    /// Triton's; accepted, no effect (no SageMaker endpoint).
    #[arg(long, value_parser = boolean, action = ArgAction::Set)]
    pub allow_sagemaker: Option<bool>,

    /// Triton's; accepted, no effect (no SageMaker endpoint).
    #[arg(long)]
    pub sagemaker_port: Option<u16>,

    /// Triton's `<low>-<high>`; accepted, no effect (no SageMaker endpoint).
    #[arg(long, value_parser = port_range)]
    pub sagemaker_safe_port_range: Option<String>,

    /// Triton's; accepted, no effect (no SageMaker endpoint).
    #[arg(long)]
    pub sagemaker_thread_count: Option<u32>,

    /// Triton's; accepted, no effect (no Vertex AI endpoint).
    #[arg(long, value_parser = boolean, action = ArgAction::Set)]
    pub allow_vertex_ai: Option<bool>,

    /// Triton's; accepted, no effect (no Vertex AI endpoint).
    #[arg(long)]
    pub vertex_ai_port: Option<u16>,

    /// Triton's; accepted, no effect (no Vertex AI endpoint).
    #[arg(long)]
    pub vertex_ai_thread_count: Option<u32>,

    /// Triton's; accepted, no effect (no Vertex AI endpoint).
    #[arg(long)]
    pub vertex_ai_default_model: Option<String>,
}

impl NoEffect {
    /// The arguments given, each with why it has no effect here.
    pub fn given(&self) -> Vec<(&'static str, &'static str)> {
        const NO_SAGEMAKER: &str = "visiongate serves no SageMaker endpoint";
        const NO_VERTEX: &str = "visiongate serves no Vertex AI endpoint";
        const PING_POLICY: &str = "clients' HTTP/2 pings are answered; the connection limits \
                                   and timeouts (--grpc-idle-timeout-secs, ...) bound clients";
        const RATE: &str = "each instance runs its next batch as soon as it is free, and a \
                            model config's rate_limiter is refused at load";
        let list = [
            (
                self.strict_model_config.is_some(),
                "--strict-model-config",
                "every model needs its config.pbtxt; nothing is completed from the model file",
            ),
            (
                self.disable_auto_complete_config,
                "--disable-auto-complete-config",
                "every model needs its config.pbtxt; nothing is completed from the model file",
            ),
            (
                !self.backend_config.is_empty(),
                "--backend-config",
                "the runtimes are built in and take their settings from the model config",
            ),
            (
                self.backend_directory.is_some(),
                "--backend-directory",
                "the runtimes are built in",
            ),
            (
                self.repoagent_directory.is_some(),
                "--repoagent-directory",
                "visiongate has no repository agents",
            ),
            (
                self.cache_directory.is_some(),
                "--cache-directory",
                "the response cache is built in",
            ),
            (
                self.pinned_memory_pool_byte_size.is_some(),
                "--pinned-memory-pool-byte-size",
                "libtorch allocates its own host memory",
            ),
            (
                !self.cuda_memory_pool_byte_size.is_empty(),
                "--cuda-memory-pool-byte-size",
                "libtorch's CUDA caching allocator manages GPU memory",
            ),
            (
                !self.cuda_virtual_address_size.is_empty(),
                "--cuda-virtual-address-size",
                "no model keeps implicit state",
            ),
            (
                self.min_supported_compute_capability.is_some(),
                "--min-supported-compute-capability",
                "a GPU libtorch cannot use fails its model's load with the reason",
            ),
            (
                self.buffer_manager_thread_count.is_some(),
                "--buffer-manager-thread-count",
                "tensors are copied by the threads that use them",
            ),
            (
                !self.host_policy.is_empty(),
                "--host-policy",
                "instances are not pinned to NUMA nodes or cores",
            ),
            (
                !self.model_load_gpu_limit.is_empty(),
                "--model-load-gpu-limit",
                "a model that does not fit on its GPU fails its load with the reason",
            ),
            (
                self.model_load_thread_count.is_some(),
                "--model-load-thread-count",
                "CPU instances load one at a time, so that each times its batch sizes \
                 alone; GPU instances load side by side",
            ),
            (
                self.model_load_retry_count.is_some(),
                "--model-load-retry-count",
                "a failed load is reported; load it again through the repository API, or \
                 poll mode loads it once its files change",
            ),
            (
                self.model_namespacing.is_some(),
                "--model-namespacing",
                "a model name found in two repositories is not served",
            ),
            (
                self.enable_peer_access.is_some(),
                "--enable-peer-access",
                "each instance works on its own GPU",
            ),
            (self.rate_limit.is_some(), "--rate-limit", RATE),
            (
                !self.rate_limit_resource.is_empty(),
                "--rate-limit-resource",
                RATE,
            ),
            (
                self.http_header_forward_pattern.is_some(),
                "--http-header-forward-pattern",
                "no model reads request parameters, so headers are not forwarded as them",
            ),
            (
                self.grpc_header_forward_pattern.is_some(),
                "--grpc-header-forward-pattern",
                "no model reads request parameters, so metadata is not forwarded as them",
            ),
            (
                self.grpc_infer_thread_count.is_some(),
                "--grpc-infer-thread-count",
                "gRPC calls run on the async workers (--http-thread-count)",
            ),
            (
                self.grpc_infer_allocation_pool_size.is_some(),
                "--grpc-infer-allocation-pool-size",
                "request states are not pooled",
            ),
            (
                self.grpc_max_response_pool_size.is_some(),
                "--grpc-max-response-pool-size",
                "responses are not pooled",
            ),
            (
                self.grpc_infer_response_compression_level
                    .is_some_and(|c| c != Compression::None),
                "--grpc-infer-response-compression-level",
                "responses go uncompressed (Triton's default)",
            ),
            (
                self.grpc_keepalive_permit_without_calls.is_some(),
                "--grpc-keepalive-permit-without-calls",
                PING_POLICY,
            ),
            (
                self.grpc_http2_max_pings_without_data.is_some(),
                "--grpc-http2-max-pings-without-data",
                PING_POLICY,
            ),
            (
                self.grpc_http2_min_recv_ping_interval_without_data
                    .is_some(),
                "--grpc-http2-min-recv-ping-interval-without-data",
                PING_POLICY,
            ),
            (
                self.grpc_http2_max_ping_strikes.is_some(),
                "--grpc-http2-max-ping-strikes",
                PING_POLICY,
            ),
            (
                self.allow_sagemaker == Some(true),
                "--allow-sagemaker",
                NO_SAGEMAKER,
            ),
            (
                self.sagemaker_port.is_some()
                    || self.sagemaker_safe_port_range.is_some()
                    || self.sagemaker_thread_count.is_some(),
                "--sagemaker-port / --sagemaker-safe-port-range / --sagemaker-thread-count",
                NO_SAGEMAKER,
            ),
            (
                self.allow_vertex_ai == Some(true),
                "--allow-vertex-ai",
                NO_VERTEX,
            ),
            (
                self.vertex_ai_port.is_some()
                    || self.vertex_ai_thread_count.is_some()
                    || self.vertex_ai_default_model.is_some(),
                "--vertex-ai-port / --vertex-ai-thread-count / --vertex-ai-default-model",
                NO_VERTEX,
            ),
        ];
        list.into_iter()
            .filter(|(given, _, _)| *given)
            .map(|(_, flag, why)| (flag, why))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booleans_are_tritons_words() {
        for t in ["true", "TRUE", "On", "1"] {
            assert_eq!(boolean(t), Ok(true), "{t}");
        }
        for f in ["false", "Off", "0"] {
            assert_eq!(boolean(f), Ok(false), "{f}");
        }
        for bad in ["yes", "no", "", "2"] {
            assert!(boolean(bad).is_err(), "{bad}");
        }
        assert_eq!(verbosity("1"), Ok(1));
        assert_eq!(verbosity("True"), Ok(1));
        assert_eq!(verbosity("false"), Ok(0));
        assert!(verbosity("loud").is_err());
    }

    #[test]
    fn cache_settings_give_the_local_size() {
        let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(cache_size(&[], None), Ok(None));
        assert_eq!(cache_size(&[], Some(1024)), Ok(Some(1024)));
        assert_eq!(
            cache_size(&s(&["local,size=1048576"]), None),
            Ok(Some(1 << 20))
        );
        for bad in [
            "redis,host=localhost",
            "local",
            "local,size",
            "local,size=x",
            "local,ttl=3",
        ] {
            assert!(cache_size(&s(&[bad]), None).is_err(), "{bad}");
        }
        assert!(cache_size(&s(&["local,size=1"]), Some(1)).is_err());
    }

    #[test]
    fn no_effect_flags_still_check_their_format() {
        assert!(backend_setting("tensorrt,coalesce-request-input=true").is_ok());
        assert!(backend_setting("default-max-batch-size=8").is_ok());
        assert!(backend_setting(",x=1").is_err());
        assert!(backend_setting("python").is_err());
        assert!(gpu_bytes("0:67108864").is_ok());
        assert!(gpu_bytes("0").is_err());
        assert!(gpu_bytes("a:1").is_err());
    }
}
