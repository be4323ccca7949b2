//! The command line: every flag group, each defined and checked beside what it sets, and
//! Triton's arguments that have no effect here (`config::NoEffect`), read into one
//! [`Settings`].
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::config::{LogFormat, NoEffect};
use crate::domain::Precision;
use crate::engines::{EngineFlags, EngineSettings};
use crate::grpc::{GrpcFlags, GrpcSettings};
use crate::listeners::{Listen, ListenFlags};
use crate::preprocess::DecodeFlags;
use crate::scheduler::QueueFlags;
use crate::state::{
    AccessFlags, ControlFlags, ControlSettings, ServerFlags, ServerOptions, UploadFlags,
    UploadLimits,
};
use crate::telemetry::{LogFlags, MetricsConfig, MetricsFlags, MetricsRefresh};

#[derive(Parser, Debug, Clone)]
#[command(
    name = "visiongate",
    version,
    about = "Image classification gateway: /predict, Triton model repositories, libtorch",
    // As `tritonserver`: an argument given twice takes its last value.
    args_override_self = true
)]
pub struct Config {
    #[command(flatten)]
    pub control: ControlFlags,
    #[command(flatten)]
    pub access: AccessFlags,
    #[command(flatten)]
    pub listen: ListenFlags,
    #[command(flatten)]
    pub metrics: MetricsFlags,
    #[command(flatten)]
    pub grpc: GrpcFlags,
    #[command(flatten)]
    pub uploads: UploadFlags,
    #[command(flatten)]
    pub decode: DecodeFlags,
    #[command(flatten)]
    pub engine: EngineFlags,
    #[command(flatten)]
    pub queues: QueueFlags,
    #[command(flatten)]
    pub server: ServerFlags,
    #[command(flatten)]
    pub log: LogFlags,
    #[command(flatten)]
    pub trace: crate::trace::TraceFlags,
    /// Triton's arguments that have no effect here: parsed, then logged as such.
    #[command(flatten)]
    pub no_effect: NoEffect,
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
    /// instances run: `preprocess::decode_threads`).
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

/// What every model gets unless its config says otherwise.
#[derive(Debug, Clone, Copy)]
pub struct ModelDefaults {
    pub max_queue_size: usize,
    pub max_image_pixels: u64,
    pub dct_override: Option<u32>,
    /// `--precision`: every classifier's, instead of its config's.
    pub precision: Option<Precision>,
}

impl Config {
    /// Checks every flag group and derives the settings; logs the Triton arguments that
    /// have no effect here (call after `telemetry::init`).
    pub fn validate(self) -> Result<Settings, String> {
        let control = self.control.settings()?;
        let keys = self.access.keys()?;
        let limits = self.uploads.limits()?;
        let cache_size = self.queues.cache_bytes()?;
        let (refresh, metrics) = self.metrics.settings()?;
        let listen = self.listen.listen();
        let settings = Settings {
            grpc: self.grpc.settings(limits.pace, listen.grpc.is_some())?,
            engine: self.engine.settings()?,
            models: ModelDefaults {
                max_queue_size: self.queues.max_queue_size()?,
                max_image_pixels: self.decode.max_image_pixels,
                dct_override: self.decode.dct_scaling_min_side,
                precision: self.engine.precision,
            },
            exit_timeout: self.server.exit_timeout()?,
            exit_on_error: self.server.exit_on_error,
            server: self.server.options(keys, self.trace.settings()?),
            decode_threads: self.decode.threads(),
            decode_memory: self.decode.memory(),
            http_workers: self.listen.http_workers(),
            listen,
            limits,
            refresh,
            control,
            cache_size,
            metrics,
        };
        self.log_ignored(&settings.metrics);
        Ok(settings)
    }

    /// One log line for each Triton argument given that has no effect here.
    fn log_ignored(&self, metrics: &MetricsConfig) {
        let mut ignored = self.no_effect.given();
        if self.log.log_format == Some(LogFormat::Default) {
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
        if self.trace.given() {
            if let Ok(c) = self.trace.settings() {
                let to = match c.mode {
                    crate::trace::Mode::Triton => format!("the trace file '{}'", c.file),
                    crate::trace::Mode::OpenTelemetry => format!("OTLP/HTTP at {}", c.otel.url),
                };
                tracing::info!(
                    "--trace-config: tracing {} mode to {to}, level {:?}, every {}-th request, \
                     count {}",
                    c.mode.name(),
                    c.level.names(),
                    c.rate,
                    c.count
                );
            }
        }
        for (flag, instead) in self.trace.deprecated() {
            tracing::warn!(
                "'{flag}' has been deprecated and will be removed in future releases. Please \
                 use '--trace-config {instead}' instead."
            );
        }
    }

    /// Defaults for tests: the bundled repository, loopback, a free port.
    pub fn for_tests() -> Config {
        let mut c = Config::parse_from(["visiongate"]);
        c.control.model_repository = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models")];
        c.listen.host = std::net::IpAddr::from([127, 0, 0, 1]);
        c.listen.http_port = 0;
        c.listen.grpc_port = 0;
        c.listen.metrics_port = 0;
        c.listen.http_workers = 2;
        // In-process tests hold libtorch's outputs equal bit for bit from run to run; the
        // fuser (process-wide once a gateway starts) fuses a module only after its first
        // runs, whose last bits then differ from the later ones'. The binary's tests run it
        // fused.
        c.engine.onednn_fusion = false;
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{ControlMode, Endpoint};

    fn parse(args: &[&str]) -> Result<Config, String> {
        Config::try_parse_from(std::iter::once("tritonserver").chain(args.iter().copied()))
            .map_err(|e| e.to_string())
    }

    fn models() -> String {
        format!("{}/models", env!("CARGO_MANIFEST_DIR"))
    }

    #[test]
    fn the_flag_groups_make_one_consistent_command_line() {
        // Two groups declaring one flag, environment variable or field name fail here.
        <Config as clap::CommandFactory>::command().debug_assert();
    }

    #[test]
    fn tritons_manifest_lines_parse_in_both_spellings() {
        let c = parse(&[
            "--model-repository=models",
            "--strict-model-config=false",
            "--log-verbose=1",
        ])
        .unwrap();
        assert_eq!(c.control.model_repository, [PathBuf::from("models")]);
        assert_eq!(
            (c.no_effect.strict_model_config, c.log.log_verbose),
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
        assert_eq!(c.control.model_control_mode, ControlMode::Poll);
        assert_eq!(c.control.repository_poll_secs, 30);
        assert_eq!(
            c.control.model_repository,
            [PathBuf::from("a"), PathBuf::from("b")]
        );
        assert!(
            !c.listen.allow_grpc && c.listen.allow_http && c.no_effect.disable_auto_complete_config
        );
        assert_eq!(c.listen.http_workers, 3);
        assert_eq!(c.log.log_format, Some(LogFormat::Iso8601));

        // visiongate's own: a precision for every classifier, Triton's shared-memory switch.
        let c = parse(&["--precision=bf16", "--allow-client-shm=true"]).unwrap();
        assert_eq!(c.engine.precision, Some(Precision::Bf16));
        assert!(c.server.allow_client_shm);
        assert!(!parse(&[]).unwrap().server.allow_client_shm);
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
            assert_eq!(c.listen.grpc_address.unwrap().to_string(), addr, "{given}");
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
                .listen
                .http_port,
            2
        );
        // Every no-effect option given is named in the log, once.
        let c = parse(TRITONSERVER_OPTIONS).unwrap();
        let given = c.no_effect.given();
        for flag in ["--rate-limit", "--allow-sagemaker", "--host-policy"] {
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
            (vec!["--trace-level=LOUD"], "Bad option: \"--trace-level\""),
            (vec!["--trace-config=level"], "--trace-config option format"),
            (
                vec!["--trace-config=rate=often"],
                "Bad option: \"--trace-config rate\"",
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
