//! KServe parameters of a request, an input or an output, read once for both transports:
//! each transport turns its own map (JSON values, protobuf `InferParameter`s) into
//! `Params`, and what they mean (priority, timeout, classification, `binary_data`,
//! `shared_memory_*`) is parsed here.
use std::collections::HashMap;
use std::time::Duration;

use super::RequestedOutput;
use crate::domain::RequestOptions;
use crate::error::GatewayError;
use crate::shm::ShmRef;

/// One parameter's value: what KServe parameters can hold.
#[derive(Debug, Clone, PartialEq)]
pub enum Param {
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    Text(String),
}

/// The parameters of a request, an input or an output, by name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Params(HashMap<String, Param>);

impl FromIterator<(String, Param)> for Params {
    fn from_iter<I: IntoIterator<Item = (String, Param)>>(iter: I) -> Self {
        Params(iter.into_iter().collect())
    }
}

impl Params {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn insert(&mut self, name: String, value: Param) {
        self.0.insert(name, value);
    }

    pub fn contains(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    /// `name` as a non-negative integer; `error` says why when it is anything else.
    pub fn count(
        &self,
        name: &str,
        error: impl FnOnce() -> String,
    ) -> Result<Option<u64>, GatewayError> {
        match self.0.get(name) {
            None => Ok(None),
            Some(Param::Uint(v)) => Ok(Some(*v)),
            Some(Param::Int(v)) => u64::try_from(*v)
                .map(Some)
                .map_err(|_| GatewayError::invalid(error())),
            Some(_) => Err(GatewayError::invalid(error())),
        }
    }

    /// `name` as a boolean (`binary_data`, `binary_data_output`).
    pub fn flag(&self, name: &str) -> Result<Option<bool>, GatewayError> {
        match self.0.get(name) {
            None => Ok(None),
            Some(Param::Bool(v)) => Ok(Some(*v)),
            Some(_) => Err(GatewayError::invalid(format!(
                "parameter '{name}' must be true or false"
            ))),
        }
    }

    /// Triton's `priority` and `timeout` (microseconds) request parameters.
    pub fn request_options(&self) -> Result<RequestOptions, GatewayError> {
        let number = |name: &str| {
            self.count(name, || {
                format!("parameter '{name}' must be a non-negative integer")
            })
        };
        Ok(RequestOptions {
            priority: number("priority")?.unwrap_or(0),
            timeout: number("timeout")?.map(Duration::from_micros),
        })
    }

    /// An output's request: its top classes (`classification`) and its place in shared
    /// memory.
    pub fn requested_output(&self, name: String) -> Result<RequestedOutput, GatewayError> {
        let classification = self.count("classification", || {
            format!("output '{name}': classification must be a class count")
        })?;
        Ok(RequestedOutput {
            classification: classification.map(|k| usize::try_from(k).unwrap_or(usize::MAX)),
            shared_memory: self.shared_memory(&name)?,
            name,
        })
    }

    /// The place of tensor `tensor` in system shared memory; `None` when it has no region.
    /// The offset defaults to 0; the byte size is required with a region, and neither
    /// number goes without one.
    pub fn shared_memory(&self, tensor: &str) -> Result<Option<ShmRef>, GatewayError> {
        let number = |name: &str| {
            self.count(name, || {
                format!("tensor '{tensor}': '{name}' must be a non-negative integer")
            })
        };
        let offset = number("shared_memory_offset")?;
        let byte_size = number("shared_memory_byte_size")?;
        let region = match self.0.get("shared_memory_region") {
            None if offset.is_some() || byte_size.is_some() => {
                return Err(GatewayError::invalid(format!(
                    "tensor '{tensor}': 'shared_memory_offset' and 'shared_memory_byte_size' \
                     can not be specified without 'shared_memory_region'"
                )));
            }
            None => return Ok(None),
            Some(Param::Text(region)) => region.clone(),
            Some(_) => {
                return Err(GatewayError::invalid(format!(
                    "tensor '{tensor}': 'shared_memory_region' must be a string (a registered \
                     region's name)"
                )))
            }
        };
        let byte_size = byte_size.ok_or_else(|| {
            GatewayError::invalid(format!(
                "tensor '{tensor}': 'shared_memory_region' needs 'shared_memory_byte_size'"
            ))
        })?;
        Ok(Some(ShmRef {
            region,
            offset: offset.unwrap_or(0),
            byte_size,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(entries: &[(&str, Param)]) -> Params {
        entries
            .iter()
            .map(|(n, v)| (n.to_string(), v.clone()))
            .collect()
    }

    #[test]
    fn numbers_take_either_integer_kind_and_refuse_the_rest() {
        let p = params(&[("priority", Param::Int(2)), ("timeout", Param::Uint(1500))]);
        let options = p.request_options().unwrap();
        assert_eq!(options.priority, 2);
        assert_eq!(options.timeout, Some(Duration::from_micros(1500)));
        for bad in [Param::Int(-1), Param::Double(1.0), Param::Text("1".into())] {
            let e = params(&[("priority", bad)]).request_options().unwrap_err();
            assert_eq!(
                e.to_string(),
                "parameter 'priority' must be a non-negative integer"
            );
        }
    }

    #[test]
    fn an_output_reads_classification_and_its_place() {
        let p = params(&[
            ("classification", Param::Int(3)),
            ("shared_memory_region", Param::Text("out".into())),
            ("shared_memory_byte_size", Param::Uint(64)),
        ]);
        let o = p.requested_output("scores".into()).unwrap();
        assert_eq!(o.classification, Some(3));
        let place = o.shared_memory.unwrap();
        assert_eq!(
            (place.region.as_str(), place.offset, place.byte_size),
            ("out", 0, 64)
        );
        let e = params(&[("classification", Param::Bool(true))])
            .requested_output("scores".into())
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("classification must be a class count"),
            "{e}"
        );
    }

    #[test]
    fn shared_memory_numbers_need_a_region_and_a_region_needs_a_size() {
        let e = params(&[("shared_memory_offset", Param::Uint(8))])
            .shared_memory("x")
            .unwrap_err();
        assert!(
            e.to_string().contains("without 'shared_memory_region'"),
            "{e}"
        );
        let e = params(&[("shared_memory_region", Param::Text("r".into()))])
            .shared_memory("x")
            .unwrap_err();
        assert!(
            e.to_string().contains("needs 'shared_memory_byte_size'"),
            "{e}"
        );
        let e = params(&[("shared_memory_region", Param::Int(1))])
            .shared_memory("x")
            .unwrap_err();
        assert!(e.to_string().contains("must be a string"), "{e}");
        assert_eq!(Params::default().shared_memory("x").unwrap(), None);
    }

    #[test]
    fn flags_are_booleans() {
        let p = params(&[("binary_data", Param::Bool(true)), ("x", Param::Int(1))]);
        assert_eq!(p.flag("binary_data").unwrap(), Some(true));
        assert_eq!(p.flag("absent").unwrap(), None);
        assert!(p.flag("x").is_err());
    }
}
