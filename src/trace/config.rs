//! `--trace-config` as `tritonserver` reads it, and its older `--trace-*` arguments: the
//! start-up trace setting (level, rate, count, the mode and each mode's settings). Values
//! are read once every argument is in, so their order does not matter; a value Triton
//! refuses is refused with its words ("Bad option: ..."), a setting it ignores is ignored.
use std::path::PathBuf;

use clap::ArgAction;

/// Triton's trace arguments.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TraceFlags {
    /// Triton's `[<mode>,]<setting>=<value>` (repeatable): `rate=N` (trace every Nth
    /// request, default 1000), `level=OFF|TIMESTAMPS` (default OFF; repeatable), `count=N`
    /// (stop after N traces; -1: no limit), `mode=triton|opentelemetry`, and each mode's
    /// settings: `triton,file=PATH`, `triton,log-frequency=N`; `opentelemetry,url=URL`,
    /// `opentelemetry,resource=KEY=VALUE` (repeatable), `opentelemetry,bsp_max_queue_size=N`,
    /// `opentelemetry,bsp_schedule_delay=MS`, `opentelemetry,bsp_max_export_batch_size=N`.
    #[arg(long, action = ArgAction::Append)]
    pub trace_config: Vec<String>,

    /// Triton's older `--trace-config triton,file=`.
    #[arg(long)]
    pub trace_file: Option<PathBuf>,

    /// Triton's older `--trace-config level=` (repeatable; `OFF` turns tracing off whatever
    /// else is given, as in Triton).
    #[arg(long, action = ArgAction::Append)]
    pub trace_level: Vec<String>,

    /// Triton's older `--trace-config rate=`.
    #[arg(long)]
    pub trace_rate: Option<String>,

    /// Triton's older `--trace-config count=`.
    #[arg(long, allow_negative_numbers = true)]
    pub trace_count: Option<String>,

    /// Triton's older `--trace-config triton,log-frequency=`.
    #[arg(long)]
    pub trace_log_frequency: Option<String>,
}

/// Where traces go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Triton's JSON trace file.
    Triton,
    /// Spans exported over OTLP/HTTP.
    OpenTelemetry,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Triton => "triton",
            Mode::OpenTelemetry => "opentelemetry",
        }
    }
}

/// What a trace records: nothing (Triton's `OFF`), timestamps, tensors, or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Level {
    pub timestamps: bool,
    pub tensors: bool,
}

impl Level {
    pub const OFF: Level = Level {
        timestamps: false,
        tensors: false,
    };

    pub fn is_off(self) -> bool {
        self == Level::OFF
    }

    /// Triton's names, as its trace API lists them: `["OFF"]`, or those of `TIMESTAMPS`
    /// and `TENSORS` that are on, in that order.
    pub fn names(self) -> Vec<&'static str> {
        if self.is_off() {
            return vec!["OFF"];
        }
        let mut names = Vec::new();
        if self.timestamps {
            names.push("TIMESTAMPS");
        }
        if self.tensors {
            names.push("TENSORS");
        }
        names
    }

    fn or(self, other: Level) -> Level {
        Level {
            timestamps: self.timestamps || other.timestamps,
            tensors: self.tensors || other.tensors,
        }
    }

    /// A level word as the command line takes it (any case): `off`/`false`; `timestamps`,
    /// `true`, `on`, `min`, `max`; `tensors`.
    fn parse_argument(value: &str) -> Option<Level> {
        Some(match value.to_ascii_lowercase().as_str() {
            "off" | "false" => Level::OFF,
            "timestamps" | "true" | "on" | "min" | "max" => Level {
                timestamps: true,
                tensors: false,
            },
            "tensors" => Level {
                timestamps: false,
                tensors: true,
            },
            _ => return None,
        })
    }
}

/// OTLP/HTTP export's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtelConfig {
    pub url: String,
    /// The resource's attributes beyond the defaults, in order (a later key wins).
    pub resource: Vec<(String, String)>,
    pub bsp_max_queue_size: u32,
    pub bsp_schedule_delay_ms: u32,
    pub bsp_max_export_batch_size: u32,
}

/// The trace setting the server starts with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceConfig {
    pub mode: Mode,
    pub level: Level,
    /// Every `rate`-th request is traced (0: none, but those carrying a caller's context
    /// in OpenTelemetry mode).
    pub rate: u32,
    /// Traces left to take; negative: no limit.
    pub count: i32,
    /// Triton mode's file ("" where none is given: nothing is traced then).
    pub file: String,
    /// Triton mode: every this many traces go to a file of their own (`<file>.<n>`); 0: one
    /// file, complete at shutdown.
    pub log_frequency: u32,
    /// The mode's settings as given, other than `file` and `log-frequency`, in order (the
    /// trace API lists them); OpenTelemetry's include the export defaults not given.
    pub mode_settings: Vec<(String, String)>,
    pub otel: OtelConfig,
}

pub const DEFAULT_URL: &str = "http://localhost:4318/v1/traces";
const DEFAULT_SERVICE: &str = "triton-inference-server";

/// The value of the last `name` in `list`.
fn last<'a>(list: &[(&'a str, &'a str)], name: &str) -> Option<&'a str> {
    list.iter().rev().find(|(n, _)| *n == name).map(|(_, v)| *v)
}

fn bad_option(name: &str, why: String) -> String {
    format!("Bad option: \"--trace-config {name}\".\n{why}")
}

/// A setting's value from `--trace-config` (`name` there) or else the older argument
/// (`older`), read as an integer and named as given.
fn int_setting(
    config: Option<&str>,
    name: &str,
    older: Option<&str>,
    older_name: &str,
) -> Result<Option<i32>, String> {
    match (config, older) {
        (Some(v), _) => int(&format!("--trace-config {name}"), v).map(Some),
        (None, Some(v)) => int(older_name, v).map(Some),
        (None, None) => Ok(None),
    }
}

/// An integer argument as Triton reads one: an `int` (a value outside its range is
/// refused), which an unsigned setting then takes as C++'s cast does (-1: 4294967295).
fn int(option: &str, value: &str) -> Result<i32, String> {
    let n: i64 = value
        .trim()
        .parse()
        .map_err(|_| format!("Bad option: \"{option}\".\nInvalid option value. Got {value}"))?;
    i32::try_from(n).map_err(|_| {
        format!("Bad option: \"{option}\".\nProvided option value is out of bound. Got {value}")
    })
}

/// The OpenTelemetry batch processor's setting `name`: the argument, else the environment
/// variable `env` (as OpenTelemetry's SDK reads it), else `default`.
fn bsp(given: Option<&str>, name: &str, env: &str, default: u32) -> Result<u32, String> {
    match (given, std::env::var(env).ok()) {
        (Some(v), _) => {
            let n: i64 = v.trim().parse().map_err(|_| {
                bad_option(
                    &format!("opentelemetry,{name}"),
                    format!("Invalid option value. Got {v}"),
                )
            })?;
            u32::try_from(n).map_err(|_| {
                bad_option(
                    &format!("opentelemetry,{name}"),
                    format!("Provided option value is out of bound. Got {v}"),
                )
            })
        }
        (None, Some(v)) => v
            .trim()
            .parse()
            .map_err(|_| format!("Bad option: \"{env}\".\nInvalid option value. Got {v}")),
        (None, None) => Ok(default),
    }
}

impl TraceFlags {
    /// The start-up setting, as Triton reads its arguments.
    pub fn settings(&self) -> Result<TraceConfig, String> {
        let mut global: Vec<(&str, &str)> = Vec::new();
        let mut triton: Vec<(&str, &str)> = Vec::new();
        let mut otel: Vec<(&str, &str)> = Vec::new();
        for arg in &self.trace_config {
            let format_error = || {
                format!(
                    "--trace-config option format is '<trace mode>,<setting>=<value>'. Got {arg}"
                )
            };
            let (mode, setting) = match arg.split_once(',') {
                Some(("", _)) => {
                    return Err(format!(
                        "No trace mode specified. --trace-config option format is <trace \
                         mode>,<setting>=<value> or <setting>=<value>. Got {arg}"
                    ))
                }
                Some((mode, rest)) => (Some(mode), rest),
                None => (None, arg.as_str()),
            };
            let (name, value) = setting
                .split_once('=')
                .filter(|(n, v)| !n.is_empty() && !v.is_empty())
                .ok_or_else(format_error)?;
            match mode.map(str::to_ascii_lowercase).as_deref() {
                None => global.push((name, value)),
                Some("triton") => triton.push((name, value)),
                Some("opentelemetry") => otel.push((name, value)),
                Some(other) => {
                    return Err(format!(
                        "invalid value for trace mode option: {other}. Available options are \
                         \"triton\" and \"opentelemetry\""
                    ))
                }
            }
        }

        // The older arguments first; --trace-config overrides them (levels add up).
        let level_word = |word: &str, option: String| {
            Level::parse_argument(word).ok_or_else(|| {
                format!(
                    "Bad option: \"{option}\".\ninvalid value for trace level option: {}",
                    word.to_ascii_lowercase()
                )
            })
        };
        let mut level = Level::OFF;
        let mut forced_off = false;
        for word in &self.trace_level {
            let l = level_word(word, "--trace-level".into())?;
            forced_off |= l.is_off();
            level = level.or(l);
        }
        for (_, value) in global.iter().filter(|(n, _)| *n == "level") {
            level = level.or(level_word(value, "--trace-config level".into())?);
        }
        if forced_off {
            level = Level::OFF;
        }
        let rate = int_setting(
            last(&global, "rate"),
            "rate",
            self.trace_rate.as_deref(),
            "--trace-rate",
        )?
        .map_or(1000, |n| n as u32);
        let count = int_setting(
            last(&global, "count"),
            "count",
            self.trace_count.as_deref(),
            "--trace-count",
        )?
        .unwrap_or(-1);
        let mode = match last(&global, "mode") {
            None => Mode::Triton,
            Some(v) => match v.to_ascii_lowercase().as_str() {
                "triton" => Mode::Triton,
                "opentelemetry" => Mode::OpenTelemetry,
                other => {
                    return Err(bad_option(
                        "mode",
                        format!(
                            "invalid value for trace mode option: {other}. Available options \
                             are \"triton\" and \"opentelemetry\""
                        ),
                    ))
                }
            },
        };
        // Each mode's settings are read in that mode only (Triton ignores the other's).
        let (mut file, mut log_frequency) = (String::new(), 0);
        if mode == Mode::Triton {
            file = last(&triton, "file")
                .map(str::to_string)
                .or_else(|| self.trace_file.as_ref().map(|p| p.display().to_string()))
                .unwrap_or_default();
            log_frequency = int_setting(
                last(&triton, "log-frequency"),
                "triton,log-frequency",
                self.trace_log_frequency.as_deref(),
                "--trace-log-frequency",
            )?
            .map_or(0, |n| n as u32);
        }
        let mut otel_config = OtelConfig {
            url: DEFAULT_URL.to_string(),
            resource: vec![("service.name".to_string(), DEFAULT_SERVICE.to_string())],
            bsp_max_queue_size: 2048,
            bsp_schedule_delay_ms: 5000,
            bsp_max_export_batch_size: 512,
        };
        if mode == Mode::OpenTelemetry {
            for (_, value) in otel.iter().filter(|(n, _)| *n == "resource") {
                let (k, v) = value.split_once('=').unwrap_or((value, ""));
                otel_config.resource.push((k.to_string(), v.to_string()));
            }
            if let Some(url) = last(&otel, "url") {
                otel_config.url = url.to_string();
            }
            otel_config.bsp_max_queue_size = bsp(
                last(&otel, "bsp_max_queue_size"),
                "bsp_max_queue_size",
                "OTEL_BSP_MAX_QUEUE_SIZE",
                2048,
            )?;
            otel_config.bsp_schedule_delay_ms = bsp(
                last(&otel, "bsp_schedule_delay"),
                "bsp_schedule_delay",
                "OTEL_BSP_SCHEDULE_DELAY",
                5000,
            )?;
            otel_config.bsp_max_export_batch_size = bsp(
                last(&otel, "bsp_max_export_batch_size"),
                "bsp_max_export_batch_size",
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
                512,
            )?;
        }
        let mode_settings = match mode {
            Mode::Triton => triton
                .iter()
                .filter(|(n, _)| !matches!(*n, "file" | "log-frequency"))
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            Mode::OpenTelemetry => {
                let mut listed: Vec<(String, String)> = otel
                    .iter()
                    .map(|(n, v)| (n.to_string(), v.to_string()))
                    .collect();
                for (name, value) in [
                    ("bsp_max_queue_size", otel_config.bsp_max_queue_size),
                    ("bsp_schedule_delay", otel_config.bsp_schedule_delay_ms),
                    (
                        "bsp_max_export_batch_size",
                        otel_config.bsp_max_export_batch_size,
                    ),
                ] {
                    if !listed.iter().any(|(n, _)| n == name) {
                        listed.push((name.to_string(), value.to_string()));
                    }
                }
                listed
            }
        };
        Ok(TraceConfig {
            mode,
            level,
            rate,
            count,
            file,
            log_frequency,
            mode_settings,
            otel: otel_config,
        })
    }

    /// The older arguments given, each with what replaces it (Triton warns of them).
    pub fn deprecated(&self) -> Vec<(&'static str, &'static str)> {
        [
            (
                self.trace_file.is_some(),
                "--trace-file",
                "triton,file=<path>",
            ),
            (
                !self.trace_level.is_empty(),
                "--trace-level",
                "level=<level>",
            ),
            (self.trace_rate.is_some(), "--trace-rate", "rate=<rate>"),
            (self.trace_count.is_some(), "--trace-count", "count=<count>"),
            (
                self.trace_log_frequency.is_some(),
                "--trace-log-frequency",
                "triton,log-frequency=<n>",
            ),
        ]
        .into_iter()
        .filter(|(given, _, _)| *given)
        .map(|(_, flag, instead)| (flag, instead))
        .collect()
    }

    /// Whether any trace argument was given.
    pub fn given(&self) -> bool {
        !self.trace_config.is_empty()
            || self.trace_file.is_some()
            || !self.trace_level.is_empty()
            || self.trace_rate.is_some()
            || self.trace_count.is_some()
            || self.trace_log_frequency.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(args: &[&str]) -> TraceFlags {
        TraceFlags {
            trace_config: args.iter().map(|s| s.to_string()).collect(),
            ..TraceFlags::default()
        }
    }

    #[test]
    fn defaults_are_tritons() {
        let c = flags(&[]).settings().unwrap();
        assert_eq!(c.mode, Mode::Triton);
        assert!(c.level.is_off());
        assert_eq!((c.rate, c.count, c.log_frequency), (1000, -1, 0));
        assert_eq!(c.file, "");
        assert_eq!(c.otel.url, DEFAULT_URL);
        assert_eq!(
            (
                c.otel.bsp_max_queue_size,
                c.otel.bsp_schedule_delay_ms,
                c.otel.bsp_max_export_batch_size
            ),
            (2048, 5000, 512)
        );
    }

    #[test]
    fn settings_of_each_mode_and_the_global_ones() {
        let c = flags(&[
            "triton,file=/tmp/trace.json",
            "rate=6",
            "level=TIMESTAMPS",
            "count=5",
            "TRITON,log-frequency=2",
            "mode=triton",
        ])
        .settings()
        .unwrap();
        assert_eq!(c.file, "/tmp/trace.json");
        assert_eq!((c.rate, c.count, c.log_frequency), (6, 5, 2));
        assert_eq!(c.level.names(), ["TIMESTAMPS"]);
        assert!(c.mode_settings.is_empty());

        let c = flags(&[
            "mode=opentelemetry",
            "opentelemetry,url=localhost:4318/v1/traces",
            "opentelemetry,resource=service.name=test_triton",
            "opentelemetry,resource=test.key=test.value",
            "opentelemetry,bsp_max_queue_size=10",
        ])
        .settings()
        .unwrap();
        assert_eq!(c.mode, Mode::OpenTelemetry);
        assert_eq!(c.otel.url, "localhost:4318/v1/traces");
        assert_eq!(
            c.otel.resource,
            [
                ("service.name".into(), "triton-inference-server".into()),
                ("service.name".into(), "test_triton".into()),
                ("test.key".into(), "test.value".into())
            ]
        );
        assert_eq!(c.otel.bsp_max_queue_size, 10);
        // Every batch-processor setting is listed, given or not.
        let names: Vec<&str> = c.mode_settings.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "url",
                "resource",
                "resource",
                "bsp_max_queue_size",
                "bsp_schedule_delay",
                "bsp_max_export_batch_size"
            ]
        );
    }

    #[test]
    fn levels_add_up_and_the_older_off_wins() {
        let c = flags(&["level=OFF", "level=timestamps"])
            .settings()
            .unwrap();
        assert_eq!(c.level.names(), ["TIMESTAMPS"]);
        let c = flags(&["level=tensors", "level=max"]).settings().unwrap();
        assert_eq!(c.level.names(), ["TIMESTAMPS", "TENSORS"]);
        let mut f = flags(&["level=TIMESTAMPS"]);
        f.trace_level = vec!["OFF".into()];
        assert!(f.settings().unwrap().level.is_off());
    }

    #[test]
    fn trace_config_overrides_the_older_arguments() {
        let mut f = flags(&["rate=7", "triton,file=new.json"]);
        f.trace_rate = Some("3".into());
        f.trace_count = Some("9".into());
        f.trace_file = Some("old.json".into());
        let c = f.settings().unwrap();
        assert_eq!((c.rate, c.count, c.file.as_str()), (7, 9, "new.json"));
    }

    #[test]
    fn a_value_triton_refuses_is_refused_in_its_words() {
        for (arg, want) in [
            (",rate=1", "No trace mode specified"),
            ("rate", "--trace-config option format is"),
            ("rate=", "--trace-config option format is"),
            (
                "jaeger,url=x",
                "invalid value for trace mode option: jaeger",
            ),
            (
                "rate=many",
                "Bad option: \"--trace-config rate\".\nInvalid option value. Got many",
            ),
            ("count=99999999999", "out of bound"),
            ("level=Loud", "invalid value for trace level option: loud"),
            ("mode=jaeger", "invalid value for trace mode option: jaeger"),
        ] {
            let e = flags(&[arg]).settings().unwrap_err();
            assert!(e.contains(want), "{arg}: {e}");
        }
    }

    #[test]
    fn each_modes_settings_are_read_in_that_mode_only() {
        // Triton ignores OpenTelemetry's settings in its own mode, and the other way round.
        let c = flags(&[
            "opentelemetry,bsp_max_queue_size=-3",
            "opentelemetry,resource=x",
        ])
        .settings()
        .unwrap();
        assert_eq!(c.otel.bsp_max_queue_size, 2048);
        let e = flags(&["mode=opentelemetry", "opentelemetry,bsp_max_queue_size=-3"])
            .settings()
            .unwrap_err();
        assert!(e.contains("opentelemetry,bsp_max_queue_size"), "{e}");
        let c = flags(&["mode=opentelemetry", "triton,log-frequency=soon"])
            .settings()
            .unwrap();
        assert_eq!(c.log_frequency, 0);
        let mut older = flags(&[]);
        older.trace_rate = Some("often".into());
        assert!(older
            .settings()
            .unwrap_err()
            .contains("Bad option: \"--trace-rate\""));
    }

    #[test]
    fn an_unsigned_setting_takes_a_negative_value_as_tritons_cast_does() {
        assert_eq!(flags(&["rate=-1"]).settings().unwrap().rate, u32::MAX);
    }

    #[test]
    fn settings_triton_does_not_know_are_ignored() {
        let c = flags(&["colour=blue", "triton,shade=dark"])
            .settings()
            .unwrap();
        assert_eq!(c.rate, 1000);
        // A Triton-mode setting it does not know is still listed by the trace API.
        assert_eq!(c.mode_settings, [("shade".to_string(), "dark".to_string())]);
    }

    #[test]
    fn a_negative_count_is_kept_and_means_no_limit() {
        assert_eq!(flags(&["count=-5"]).settings().unwrap().count, -5);
    }
}
