//! The metrics' and the log's flags (Triton's `--allow-*-metrics`, `--metrics-*`,
//! `--log-*`).
use std::path::PathBuf;
use std::time::Duration;

use super::{LogLevels, MetricsConfig};
use crate::config;

/// What the metrics hold and how often the CPU and GPU series refresh.
#[derive(clap::Args, Debug, Clone)]
pub struct MetricsFlags {
    /// GPU series in the metrics (Triton's `--allow-gpu-metrics`; with `--allow-metrics`).
    #[arg(long, value_parser = config::boolean, default_value = "true", action = clap::ArgAction::Set)]
    pub allow_gpu_metrics: bool,

    /// CPU series in the metrics (Triton's `--allow-cpu-metrics`; with `--allow-metrics`).
    #[arg(long, value_parser = config::boolean, default_value = "true", action = clap::ArgAction::Set)]
    pub allow_cpu_metrics: bool,

    /// Milliseconds between refreshes of the CPU and GPU series (Triton's
    /// `--metrics-interval-ms`).
    #[arg(long, default_value_t = 2000)]
    pub metrics_interval_ms: u64,

    /// `--metrics-config <setting>=<value>` (repeatable, Triton's):
    /// `summary_latencies=true` adds `*_summary_us` summaries, `summary_quantiles=
    /// 0.5:0.05,0.9:0.01,...` sets their quantiles, `histogram_latencies=true` adds
    /// histograms, `counter_latencies=false` drops the `*_duration_us` counters.
    #[arg(long, action = clap::ArgAction::Append)]
    pub metrics_config: Vec<String>,
}

/// The CPU and GPU series' refresh.
#[derive(Debug, Clone, Copy)]
pub struct MetricsRefresh {
    pub cpu: bool,
    pub gpu: bool,
    pub interval: Duration,
}

impl MetricsFlags {
    /// The series' refresh and what `--metrics-config` sets.
    pub fn settings(&self) -> Result<(MetricsRefresh, MetricsConfig), String> {
        if self.metrics_interval_ms == 0 {
            return Err("--metrics-interval-ms must be at least 1".into());
        }
        let refresh = MetricsRefresh {
            cpu: self.allow_cpu_metrics,
            gpu: self.allow_gpu_metrics,
            interval: Duration::from_millis(self.metrics_interval_ms),
        };
        Ok((refresh, metrics_config(&self.metrics_config)?))
    }
}

/// `--metrics-config` settings (`<setting>=<value>`, repeated), as Triton reads them.
pub fn metrics_config(settings: &[String]) -> Result<MetricsConfig, String> {
    let mut config = MetricsConfig::default();
    for setting in settings {
        let (key, value) = setting
            .split_once('=')
            .filter(|(k, v)| !k.is_empty() && !v.is_empty() && !k.contains(','))
            .ok_or_else(|| format!("--metrics-config '{setting}': expected <setting>=<value>"))?;
        match key {
            // As Triton: only these exact words switch them.
            "counter_latencies" => config.counter_latencies = value != "false",
            "summary_latencies" => config.summary_latencies = value == "true",
            "histogram_latencies" => config.histogram_latencies = value == "true",
            "summary_quantiles" => {
                config.summary_quantiles = value
                    .split(',')
                    .map(|pair| {
                        let (q, e) = pair.split_once(':')?;
                        let (q, e) = (q.trim().parse::<f64>().ok()?, e.trim().parse().ok()?);
                        ((0.0..=1.0).contains(&q) && (0.0..=1.0).contains(&e)).then_some((q, e))
                    })
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        format!(
                            "--metrics-config '{setting}': expected <quantile>:<error>,... \
                             with both in [0, 1]"
                        )
                    })?;
            }
            _ => config.unknown.push(setting.clone()),
        }
    }
    Ok(config)
}

/// What the log lets through and where it goes.
#[derive(clap::Args, Debug, Clone)]
pub struct LogFlags {
    /// Debug logging (Triton's `--log-verbose`): 1 adds visiongate's own debug lines, 2
    /// every library's. `RUST_LOG`, when set, decides instead of the `--log-*` flags.
    #[arg(long, value_parser = config::verbosity, default_value = "0")]
    pub log_verbose: u32,

    /// Information lines (Triton's `--log-info`).
    #[arg(long, value_parser = config::boolean, default_value = "true", action = clap::ArgAction::Set)]
    pub log_info: bool,

    /// Warning lines (Triton's `--log-warning`).
    #[arg(long, value_parser = config::boolean, default_value = "true", action = clap::ArgAction::Set)]
    pub log_warning: bool,

    /// Error lines (Triton's `--log-error`).
    #[arg(long, value_parser = config::boolean, default_value = "true", action = clap::ArgAction::Set)]
    pub log_error: bool,

    /// Write the log lines to this file (appended; created if missing) instead of
    /// standard output (Triton's `--log-file`).
    #[arg(long)]
    pub log_file: Option<PathBuf>,

    /// Triton's `--log-format`: `ISO8601` is visiongate's format (each line starts with an
    /// ISO 8601 UTC time); `default`, Triton's glog-style lines, is accepted and keeps it.
    #[arg(long, value_enum)]
    pub log_format: Option<config::LogFormat>,
}

impl LogFlags {
    /// What the `--log-*` flags let through.
    pub fn levels(&self) -> LogLevels {
        LogLevels {
            verbose: self.log_verbose,
            info: self.log_info,
            warning: self.log_warning,
            error: self.log_error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_settings_read_as_triton_reads_them() {
        let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let c = metrics_config(&s(&[
            "summary_latencies=true",
            "summary_quantiles=0.5:0.05,0.99:0.001",
            "counter_latencies=false",
            "histogram_latencies=true",
        ]))
        .unwrap();
        assert!(c.summary_latencies && c.histogram_latencies && !c.counter_latencies);
        assert_eq!(c.summary_quantiles, [(0.5, 0.05), (0.99, 0.001)]);
        // Anything but the exact word leaves a switch as it was.
        let c = metrics_config(&s(&["summary_latencies=TRUE", "counter_latencies=no"])).unwrap();
        assert!(!c.summary_latencies && c.counter_latencies);
        for bad in [
            "summary_latencies",
            "=true",
            "a,b=c",
            "summary_quantiles=2:0.1",
        ] {
            assert!(metrics_config(&s(&[bad])).is_err(), "{bad}");
        }
        assert_eq!(metrics_config(&s(&["x=1"])).unwrap().unknown, ["x=1"]);
    }
}
