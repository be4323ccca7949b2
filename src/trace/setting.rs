//! The trace settings in force: the server-wide one and each model's own, changed at run
//! time through Triton's trace extension with its semantics (a server-wide field that is
//! cleared goes back to its start-up value, a model's to the server-wide one; a model whose
//! fields are all cleared follows the server-wide setting again), and which requests each
//! one samples (every `rate`-th, at most `count` of them). Every change starts the setting
//! afresh: its request counter from zero and its count from its new value.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::config::{Level, Mode, TraceConfig};

/// One field of an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Change<T> {
    /// Not in the update.
    #[default]
    Keep,
    /// `null`: back to what the field falls back to.
    Clear,
    Set(T),
}

/// What an update asks (Triton's `trace_level`, `trace_rate`, `trace_count`,
/// `log_frequency`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Update {
    pub level: Change<Level>,
    pub rate: Change<u32>,
    pub count: Change<i32>,
    pub log_frequency: Change<u32>,
}

/// The fields a setting was given explicitly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Explicit {
    level: Option<Level>,
    rate: Option<u32>,
    count: Option<i32>,
    log_frequency: Option<u32>,
}

impl Explicit {
    fn apply(&mut self, update: &Update) {
        fn field<T: Copy>(slot: &mut Option<T>, change: Change<T>) {
            match change {
                Change::Keep => {}
                Change::Clear => *slot = None,
                Change::Set(v) => *slot = Some(v),
            }
        }
        field(&mut self.level, update.level);
        field(&mut self.rate, update.rate);
        field(&mut self.count, update.count);
        field(&mut self.log_frequency, update.log_frequency);
    }

    fn is_empty(&self) -> bool {
        *self == Explicit::default()
    }

    /// These fields over `base`, with fresh sampling.
    fn over(&self, base: &Values) -> Values {
        Values {
            level: self.level.unwrap_or(base.level),
            rate: self.rate.unwrap_or(base.rate),
            count: self.count.unwrap_or(base.count),
            log_frequency: self.log_frequency.unwrap_or(base.log_frequency),
        }
    }
}

/// A setting's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Values {
    pub level: Level,
    pub rate: u32,
    /// Traces left (negative: no limit).
    pub count: i32,
    pub log_frequency: u32,
}

/// A setting in force and the requests it has seen since it was made.
#[derive(Debug, Clone, Copy)]
struct Active {
    values: Values,
    seen: u64,
}

impl Active {
    fn new(values: Values) -> Active {
        Active { values, seen: 0 }
    }
}

/// What a setting looks like through the trace API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    pub values: Values,
    pub mode: Mode,
    pub file: String,
    /// The mode's other start-up settings, in order.
    pub mode_settings: Vec<(String, String)>,
}

impl View {
    /// Triton's keys and values: every value a string but `trace_level`'s, a list.
    pub fn entries(&self) -> Vec<(&'static str, Vec<String>, bool)> {
        let one = |s: String| vec![s];
        let mut entries = vec![
            (
                "trace_level",
                self.values
                    .level
                    .names()
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
                true,
            ),
            ("trace_rate", one(self.values.rate.to_string()), false),
            ("trace_count", one(self.values.count.to_string()), false),
        ];
        if self.mode == Mode::Triton {
            entries.push((
                "log_frequency",
                one(self.values.log_frequency.to_string()),
                false,
            ));
            entries.push(("trace_file", one(self.file.clone()), false));
        }
        entries.push(("trace_mode", one(self.mode.name().to_string()), false));
        entries
    }
}

/// Why an update is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpdateError {
    /// The setting it would make cannot trace, though its level asks to.
    Invalid(&'static str),
}

impl std::fmt::Display for UpdateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpdateError::Invalid(why) => {
                write!(f, "Attempting to set invalid trace setting :{why}")
            }
        }
    }
}

/// The trace settings of the server and its models.
#[derive(Debug)]
pub struct TraceSettings {
    startup: TraceConfig,
    inner: Mutex<Inner>,
    /// Whether any setting's level is not `OFF`: a request is sampled only then, so while
    /// nothing traces, a request costs this one load.
    on: AtomicBool,
}

#[derive(Debug)]
struct Inner {
    global: Explicit,
    active: Active,
    models: HashMap<String, (Explicit, Active)>,
}

impl TraceSettings {
    pub fn new(startup: TraceConfig) -> TraceSettings {
        let values = Explicit::default().over(&startup_values(&startup));
        TraceSettings {
            on: AtomicBool::new(!values.level.is_off()),
            inner: Mutex::new(Inner {
                global: Explicit::default(),
                active: Active::new(values),
                models: HashMap::new(),
            }),
            startup,
        }
    }

    /// Whether any setting traces (its level is not `OFF`).
    pub fn any_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub fn config(&self) -> &TraceConfig {
        &self.startup
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn view(&self, values: Values) -> View {
        View {
            values,
            mode: self.startup.mode,
            file: self.startup.file.clone(),
            mode_settings: self.startup.mode_settings.clone(),
        }
    }

    /// The setting `model` traces by (`None`: the server-wide one).
    pub fn get(&self, model: Option<&str>) -> View {
        let inner = self.lock();
        let values = model
            .and_then(|m| inner.models.get(m))
            .map_or(inner.active.values, |(_, a)| a.values);
        self.view(values)
    }

    /// Why `values` cannot trace, if it cannot.
    fn invalid(&self, values: &Values) -> Option<&'static str> {
        if values.rate == 0 {
            Some("sample rate must be non-zero")
        } else if values.count == 0 {
            Some("trace count must be non-zero")
        } else if self.startup.mode == Mode::Triton && self.startup.file.is_empty() {
            Some("trace file name is not given")
        } else {
            None
        }
    }

    /// Applies `update` to `model`'s setting (`None`: the server-wide one) and returns the
    /// setting it then traces by. Refused, changing nothing, when the result could not
    /// trace though its level is not `OFF`.
    pub fn update(&self, model: Option<&str>, update: &Update) -> Result<View, UpdateError> {
        let mut inner = self.lock();
        let view = self.apply(&mut inner, model, update);
        let on = !inner.active.values.level.is_off()
            || inner.models.values().any(|(_, a)| !a.values.level.is_off());
        self.on.store(on, Ordering::Relaxed);
        view
    }

    fn apply(
        &self,
        inner: &mut Inner,
        model: Option<&str>,
        update: &Update,
    ) -> Result<View, UpdateError> {
        match model {
            None => {
                let mut global = inner.global;
                // A count kept from before is what is left of it.
                global.count = global.count.map(|_| inner.active.values.count);
                global.apply(update);
                let values = global.over(&startup_values(&self.startup));
                self.check(&values)?;
                inner.global = global;
                inner.active = Active::new(values);
                // The models' fields that follow the server-wide setting follow it anew.
                for (explicit, active) in inner.models.values_mut() {
                    explicit.count = explicit.count.map(|_| active.values.count);
                    *active = Active::new(explicit.over(&values));
                }
                Ok(self.view(values))
            }
            Some(model) => {
                let global = inner.active.values;
                let mut explicit = match inner.models.get(model) {
                    Some((e, active)) => Explicit {
                        count: e.count.map(|_| active.values.count),
                        ..*e
                    },
                    None => Explicit::default(),
                };
                explicit.apply(update);
                if explicit.is_empty() {
                    inner.models.remove(model);
                    return Ok(self.view(global));
                }
                let values = explicit.over(&global);
                self.check(&values)?;
                inner
                    .models
                    .insert(model.to_string(), (explicit, Active::new(values)));
                Ok(self.view(values))
            }
        }
    }

    fn check(&self, values: &Values) -> Result<(), UpdateError> {
        match self.invalid(values) {
            Some(why) if !values.level.is_off() => Err(UpdateError::Invalid(why)),
            _ => Ok(()),
        }
    }

    /// Whether this request of `model` is traced, and the values of the setting it goes by
    /// (the model's own, else the server-wide one), against which it is counted. A request
    /// carrying its caller's trace context in OpenTelemetry mode (`forced`) is counted too,
    /// and traced whatever the rate and count where the level is not `OFF`.
    pub fn sample(&self, model: &str, forced: bool) -> Option<Values> {
        if !self.any_on() {
            return None;
        }
        let mut inner = self.lock();
        let inner = &mut *inner;
        let active = match inner.models.get_mut(model) {
            Some((_, active)) => active,
            None => &mut inner.active,
        };
        let values = active.values;
        if values.level.is_off() {
            return None;
        }
        let forced = forced && self.startup.mode == Mode::OpenTelemetry;
        let sampled = self.invalid(&values).is_none() && {
            active.seen += 1;
            active.seen % u64::from(values.rate) == 0
        };
        if sampled && values.count > 0 {
            active.values.count -= 1;
        }
        (sampled || forced).then_some(values)
    }
}

fn startup_values(c: &TraceConfig) -> Values {
    Values {
        level: c.level,
        rate: c.rate,
        count: c.count,
        log_frequency: c.log_frequency,
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::TraceFlags;
    use super::*;

    const TIMESTAMPS: Level = Level {
        timestamps: true,
        tensors: false,
    };

    fn settings(args: &[&str]) -> TraceSettings {
        let flags = TraceFlags {
            trace_config: args.iter().map(|s| s.to_string()).collect(),
            ..TraceFlags::default()
        };
        TraceSettings::new(flags.settings().unwrap())
    }

    fn sampled(s: &TraceSettings, model: &str, requests: usize) -> usize {
        (0..requests)
            .filter(|_| s.sample(model, false).is_some())
            .count()
    }

    #[test]
    fn every_rate_th_request_is_traced_until_the_count_is_spent() {
        let s = settings(&["triton,file=t.json", "level=TIMESTAMPS", "rate=6"]);
        assert_eq!(sampled(&s, "m", 20), 3);
        let s = settings(&["triton,file=t.json", "level=TIMESTAMPS", "rate=9"]);
        assert_eq!(sampled(&s, "m", 20), 2);
        let s = settings(&["triton,file=t.json", "level=TIMESTAMPS", "rate=1"]);
        s.update(
            None,
            &Update {
                count: Change::Set(5),
                ..Update::default()
            },
        )
        .unwrap();
        assert_eq!(sampled(&s, "m", 20), 5);
        assert_eq!(s.get(None).values.count, 0);
    }

    #[test]
    fn nothing_is_traced_off_or_without_a_file() {
        assert_eq!(
            sampled(&settings(&["triton,file=t.json", "rate=1"]), "m", 10),
            0
        );
        assert_eq!(
            sampled(&settings(&["level=TIMESTAMPS", "rate=1"]), "m", 10),
            0
        );
    }

    #[test]
    fn model_and_server_wide_settings_fall_back_as_tritons_do() {
        // Triton's trace_endpoint_test: a model's own fields, the server-wide ones under
        // them, and clears.
        let s = settings(&["triton,file=t.json", "level=TIMESTAMPS", "rate=1"]);
        let set = |rate: Change<u32>, count, level, freq| Update {
            level,
            rate,
            count,
            log_frequency: freq,
        };
        s.update(
            Some("simple"),
            &set(Change::Set(12), Change::Keep, Change::Keep, Change::Set(34)),
        )
        .unwrap();
        s.update(
            None,
            &set(
                Change::Set(56),
                Change::Set(78),
                Change::Set(Level::OFF),
                Change::Keep,
            ),
        )
        .unwrap();
        let g = s
            .update(
                None,
                &set(Change::Clear, Change::Clear, Change::Keep, Change::Keep),
            )
            .unwrap();
        assert_eq!(
            (g.values.level, g.values.rate, g.values.count),
            (Level::OFF, 1, -1)
        );
        let m = s.get(Some("simple")).values;
        assert_eq!((m.level, m.rate, m.log_frequency), (Level::OFF, 12, 34));
        let m = s
            .update(
                Some("simple"),
                &set(Change::Clear, Change::Keep, Change::Clear, Change::Keep),
            )
            .unwrap()
            .values;
        assert_eq!((m.rate, m.log_frequency), (1, 34));
        // Every field cleared: the model follows the server-wide setting again.
        s.update(
            Some("simple"),
            &set(Change::Keep, Change::Keep, Change::Keep, Change::Clear),
        )
        .unwrap();
        assert_eq!(s.get(Some("simple")), s.get(None));
        // A model that follows it was never another setting's.
        assert_eq!(s.get(Some("other")), s.get(None));
    }

    #[test]
    fn an_update_that_could_not_trace_is_refused_unless_off() {
        let s = settings(&["triton,file=t.json", "level=TIMESTAMPS"]);
        let zero = Update {
            rate: Change::Set(0),
            ..Update::default()
        };
        assert_eq!(
            s.update(None, &zero).unwrap_err().to_string(),
            "Attempting to set invalid trace setting :sample rate must be non-zero"
        );
        assert_eq!(s.get(None).values.rate, 1000);
        let off = Update {
            level: Change::Set(Level::OFF),
            ..zero
        };
        assert_eq!(s.update(None, &off).unwrap().values.rate, 0);
        let no_file = settings(&["level=TIMESTAMPS"]);
        let e = no_file.update(
            Some("m"),
            &Update {
                rate: Change::Set(5),
                ..Update::default()
            },
        );
        assert_eq!(
            e.unwrap_err(),
            UpdateError::Invalid("trace file name is not given")
        );
    }

    #[test]
    fn a_count_kept_through_a_change_is_what_is_left_of_it() {
        let s = settings(&["triton,file=t.json", "level=TIMESTAMPS", "rate=1"]);
        let count = |n| Update {
            count: Change::Set(n),
            ..Update::default()
        };
        let rate = Update {
            rate: Change::Set(1),
            ..Update::default()
        };
        s.update(None, &count(5)).unwrap();
        assert_eq!(sampled(&s, "m", 2), 2);
        assert_eq!(s.update(None, &rate).unwrap().values.count, 3);
        s.update(Some("m"), &count(4)).unwrap();
        assert_eq!(sampled(&s, "m", 1), 1);
        assert_eq!(s.update(Some("m"), &rate).unwrap().values.count, 3);
        // A count spent to nothing is a setting that cannot trace: a change keeping it is
        // refused, as Triton refuses it.
        assert_eq!(sampled(&s, "m", 5), 3);
        assert_eq!(
            s.update(Some("m"), &rate).unwrap_err(),
            UpdateError::Invalid("trace count must be non-zero")
        );
    }

    #[test]
    fn a_change_starts_the_setting_afresh() {
        let s = settings(&["triton,file=t.json", "level=TIMESTAMPS", "rate=3"]);
        assert_eq!(sampled(&s, "m", 2), 0);
        s.update(
            None,
            &Update {
                rate: Change::Set(3),
                ..Update::default()
            },
        )
        .unwrap();
        // The two requests seen before count no more.
        assert_eq!(sampled(&s, "m", 2), 0);
        assert_eq!(sampled(&s, "m", 1), 1);
    }

    #[test]
    fn a_callers_context_is_traced_whatever_the_rate_in_opentelemetry_mode() {
        let s = settings(&["mode=opentelemetry", "level=TIMESTAMPS", "rate=0"]);
        assert_eq!(s.sample("m", true).map(|v| v.level), Some(TIMESTAMPS));
        assert_eq!(s.sample("m", false).map(|v| v.level), None);
        let s = settings(&["triton,file=t.json", "level=TIMESTAMPS", "rate=1000"]);
        assert_eq!(s.sample("m", true).map(|v| v.level), None);
    }

    #[test]
    fn the_view_lists_tritons_keys() {
        let s = settings(&["triton,file=t.json", "level=TIMESTAMPS", "rate=1"]);
        let keys: Vec<&str> = s.get(None).entries().iter().map(|(k, _, _)| *k).collect();
        assert_eq!(
            keys,
            [
                "trace_level",
                "trace_rate",
                "trace_count",
                "log_frequency",
                "trace_file",
                "trace_mode"
            ]
        );
        let s = settings(&["mode=opentelemetry"]);
        let keys: Vec<&str> = s.get(None).entries().iter().map(|(k, _, _)| *k).collect();
        assert_eq!(
            keys,
            ["trace_level", "trace_rate", "trace_count", "trace_mode"]
        );
    }
}
