//! Triton's trace extension as both transports speak it: an update read from an HTTP JSON
//! body or a gRPC `TraceSettingRequest`'s map, and a setting written back as each answers
//! it. Triton's words in its errors; where Triton answers a client's mistake with a 500
//! (a value of the wrong JSON type), this answers 400.
use std::collections::HashMap;

use super::config::Level;
use super::setting::{Change, Update, View};
use crate::error::{ErrorKind, GatewayError};

fn invalid(message: impl Into<String>) -> GatewayError {
    GatewayError::invalid(message)
}

fn no_trace_file() -> GatewayError {
    GatewayError::new(
        ErrorKind::Unsupported,
        "trace file location can not be updated through network protocol",
    )
}

/// A client's value as an error message repeats it: at most 64 characters.
fn shown(value: &str) -> String {
    match value.char_indices().nth(64) {
        Some((end, _)) => format!("{}...", &value[..end]),
        None => value.to_string(),
    }
}

/// The levels a list names, in Triton's words (case as written; others are passed over):
/// `OFF` alone, or `TIMESTAMPS` and `TENSORS`; a list naming none changes nothing.
fn level(words: &[&str]) -> Result<Change<Level>, GatewayError> {
    let mut level = Level::OFF;
    let mut named = false;
    for word in words {
        match *word {
            "OFF" if words.len() > 1 => {
                return Err(invalid("Expect only one trace level 'OFF' is specified"))
            }
            "OFF" => named = true,
            "TIMESTAMPS" => (level.timestamps, named) = (true, true),
            "TENSORS" => (level.tensors, named) = (true, true),
            _ => {}
        }
    }
    Ok(if named {
        Change::Set(level)
    } else {
        Change::Keep
    })
}

/// `name`'s value as Triton reads it: an `int` (a value outside its range is refused),
/// which the unsigned settings take as C++'s cast does ("-1": 4294967295); a count must
/// be at least -1.
fn number(name: &str, value: &str) -> Result<i32, GatewayError> {
    let n: i64 = value
        .trim()
        .parse()
        .map_err(|_| invalid(format!("Unable to parse '{name}', got: {}", shown(value))))?;
    let Ok(n) = i32::try_from(n) else {
        // Triton's words: the range of what the setting holds.
        let (min, max) = match name {
            "trace_count" => (-1, i64::from(i32::MAX)),
            _ => (0, i64::from(u32::MAX)),
        };
        return Err(invalid(format!(
            "Unable to parse '{name}', value is out of range [ {min}, {max} ], got: {}",
            shown(value)
        )));
    };
    if name == "trace_count" && n < -1 {
        return Err(invalid(format!(
            "Unable to parse 'trace_count'. Expecting value >= -1, got:{}",
            shown(value)
        )));
    }
    Ok(n)
}

/// One setting's change: `None` clears it.
fn change(update: &mut Update, name: &str, value: Option<&str>) -> Result<(), GatewayError> {
    let value = value.map(|v| number(name, v)).transpose()?;
    match name {
        "trace_rate" => update.rate = to_change(value.map(|n| n as u32)),
        "trace_count" => update.count = to_change(value),
        "log_frequency" => update.log_frequency = to_change(value.map(|n| n as u32)),
        _ => {}
    }
    Ok(())
}

fn to_change<T>(value: Option<T>) -> Change<T> {
    value.map_or(Change::Clear, Change::Set)
}

/// The update an HTTP body asks: a JSON object of the settings to change, each a string
/// (`trace_level` a list of strings), `null` to clear one; other keys are passed over.
pub fn update_from_json(body: &[u8]) -> Result<Update, GatewayError> {
    let body: serde_json::Value = if body.iter().all(u8::is_ascii_whitespace) {
        serde_json::Value::Object(Default::default())
    } else {
        serde_json::from_slice(body).map_err(|e| invalid(format!("the body is not JSON: {e}")))?
    };
    let serde_json::Value::Object(settings) = body else {
        return Err(invalid("the body must be a JSON object of trace settings"));
    };
    if settings.contains_key("trace_file") {
        return Err(no_trace_file());
    }
    let mut update = Update::default();
    for (name, value) in &settings {
        match (name.as_str(), value) {
            ("trace_level", serde_json::Value::Null) => update.level = Change::Clear,
            ("trace_level", serde_json::Value::Array(items)) => {
                let words = items
                    .iter()
                    .map(|v| {
                        v.as_str().ok_or_else(|| {
                            invalid(format!("'trace_level' must list strings, got {v}"))
                        })
                    })
                    .collect::<Result<Vec<&str>, _>>()?;
                update.level = level(&words)?;
            }
            ("trace_level", other) => {
                return Err(invalid(format!(
                    "'trace_level' must be a list of strings or null, got {other}"
                )))
            }
            ("trace_rate" | "trace_count" | "log_frequency", serde_json::Value::Null) => {
                change(&mut update, name, None)?
            }
            ("trace_rate" | "trace_count" | "log_frequency", serde_json::Value::String(v)) => {
                change(&mut update, name, Some(v.as_str()))?
            }
            ("trace_rate" | "trace_count" | "log_frequency", other) => {
                return Err(invalid(format!(
                    "'{name}' must be a string or null, as Triton's trace API takes it, got \
                     {other}"
                )))
            }
            _ => {}
        }
    }
    Ok(update)
}

/// The update a gRPC request asks: each setting's values (none: clear it; one, but for
/// `trace_level`).
pub fn update_from_grpc<'a>(
    settings: impl Iterator<Item = (&'a str, &'a [String])> + Clone,
) -> Result<Update, GatewayError> {
    if settings.clone().any(|(name, _)| name == "trace_file") {
        return Err(no_trace_file());
    }
    let mut update = Update::default();
    for (name, values) in settings {
        if name == "trace_level" {
            update.level = if values.is_empty() {
                Change::Clear
            } else {
                level(&values.iter().map(String::as_str).collect::<Vec<_>>())?
            };
            continue;
        }
        if !matches!(name, "trace_rate" | "trace_count" | "log_frequency") {
            continue;
        }
        match values {
            [] => change(&mut update, name, None)?,
            [value] => change(&mut update, name, Some(value.as_str()))?,
            _ => return Err(invalid(format!("expect only 1 value for '{name}'"))),
        }
    }
    Ok(update)
}

/// A setting's entries as the API lists them: each name with its values and whether it
/// is a list (`trace_level`); the mode's start-up settings after Triton's own, a name given
/// more than once (OpenTelemetry's `resource`) with each of its values.
fn entries(view: &View) -> Vec<(String, Vec<String>, bool)> {
    let mut entries: Vec<(String, Vec<String>, bool)> = view
        .entries()
        .into_iter()
        .map(|(name, values, list)| (name.to_string(), values, list))
        .collect();
    for (name, value) in &view.mode_settings {
        match entries.iter_mut().find(|(n, _, _)| n == name) {
            Some((_, values, _)) => values.push(value.clone()),
            None => entries.push((name.clone(), vec![value.clone()], false)),
        }
    }
    entries
}

/// The HTTP answer: every value a string but `trace_level`'s list (a name given more than
/// once shows its last value, as a JSON reader of Triton's repeated keys sees it).
pub fn to_json(view: &View) -> serde_json::Value {
    let mut object = serde_json::Map::new();
    for (name, mut values, list) in entries(view) {
        let value = if list {
            serde_json::Value::from(values)
        } else {
            serde_json::Value::from(values.pop().unwrap_or_default())
        };
        object.insert(name, value);
    }
    serde_json::Value::Object(object)
}

/// The gRPC answer's map: each name with its values.
pub fn to_grpc(view: &View) -> HashMap<String, Vec<String>> {
    entries(view)
        .into_iter()
        .map(|(name, values, _)| (name, values))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_update_reads_strings_lists_and_nulls() {
        let u = update_from_json(
            br#"{"trace_level":["TIMESTAMPS"],"trace_rate":"12","trace_count":null,"log_frequency":"3","other":1}"#,
        )
        .unwrap();
        assert_eq!(
            u.level,
            Change::Set(Level {
                timestamps: true,
                tensors: false
            })
        );
        assert_eq!(u.rate, Change::Set(12));
        assert_eq!(u.count, Change::Clear);
        assert_eq!(u.log_frequency, Change::Set(3));
        assert_eq!(update_from_json(b"").unwrap(), Update::default());
        // As Triton's cast: "-1" is the largest rate.
        assert_eq!(
            update_from_json(br#"{"trace_rate":"-1"}"#).unwrap().rate,
            Change::Set(u32::MAX)
        );
        // A list naming no level changes none.
        assert_eq!(
            update_from_json(br#"{"trace_level":["LOUD"]}"#)
                .unwrap()
                .level,
            Change::Keep
        );
        assert_eq!(update_from_json(b"{}").unwrap(), Update::default());
    }

    #[test]
    fn a_bad_json_update_says_what_and_where() {
        for (body, kind, want) in [
            (
                &br#"{"trace_file":"x"}"#[..],
                ErrorKind::Unsupported,
                "trace file location",
            ),
            (
                br#"{"trace_file":null}"#,
                ErrorKind::Unsupported,
                "trace file location",
            ),
            (
                br#"{"trace_level":["OFF","TIMESTAMPS"]}"#,
                ErrorKind::InvalidInput,
                "Expect only one trace level 'OFF' is specified",
            ),
            (
                br#"{"trace_rate":"abc"}"#,
                ErrorKind::InvalidInput,
                "Unable to parse 'trace_rate', got: abc",
            ),
            (
                br#"{"trace_rate":"3000000000"}"#,
                ErrorKind::InvalidInput,
                "value is out of range [ 0, 4294967295 ], got: 3000000000",
            ),
            (
                br#"{"trace_level":["OFF","OFF"]}"#,
                ErrorKind::InvalidInput,
                "Expect only one trace level 'OFF' is specified",
            ),
            (
                br#"{"trace_count":"-2"}"#,
                ErrorKind::InvalidInput,
                "Unable to parse 'trace_count'. Expecting value >= -1, got:-2",
            ),
            (
                br#"{"trace_rate":5}"#,
                ErrorKind::InvalidInput,
                "'trace_rate' must be a string",
            ),
            (
                br#"{"trace_level":"TIMESTAMPS"}"#,
                ErrorKind::InvalidInput,
                "'trace_level' must be a list",
            ),
            (
                br#"["trace_rate"]"#,
                ErrorKind::InvalidInput,
                "must be a JSON object",
            ),
            (b"{", ErrorKind::InvalidInput, "not JSON"),
        ] {
            let e = update_from_json(body).unwrap_err();
            assert_eq!(e.kind(), kind, "{}", String::from_utf8_lossy(body));
            assert!(
                e.body().error.contains(want),
                "{}: {}",
                String::from_utf8_lossy(body),
                e.body().error
            );
        }
    }

    #[test]
    fn a_grpc_update_takes_one_value_a_setting_and_none_to_clear() {
        let map = |pairs: &[(&str, &[&str])]| -> HashMap<String, Vec<String>> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
                .collect()
        };
        let update = |m: &HashMap<String, Vec<String>>| {
            update_from_grpc(m.iter().map(|(k, v)| (k.as_str(), v.as_slice())))
        };
        let u = update(&map(&[
            ("trace_level", &["TIMESTAMPS", "TENSORS"]),
            ("trace_rate", &[]),
            ("trace_count", &["5"]),
        ]))
        .unwrap();
        assert_eq!(
            u.level,
            Change::Set(Level {
                timestamps: true,
                tensors: true
            })
        );
        assert_eq!((u.rate, u.count), (Change::Clear, Change::Set(5)));
        let e = update(&map(&[("trace_rate", &["1", "2"])])).unwrap_err();
        assert_eq!(e.body().error, "expect only 1 value for 'trace_rate'");
        let e = update(&map(&[("trace_file", &["x"])])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
    }
}
