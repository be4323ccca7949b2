//! The value formats of Triton's server arguments, as `tritonserver` parses them, so that
//! the arguments in existing manifests mean the same here.
use crate::telemetry::MetricsConfig;

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
