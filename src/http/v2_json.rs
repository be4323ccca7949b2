//! KServe v2's JSON form, bounded while it is parsed: the request header (every list and
//! map capped as it is read, parameters as KServe's transport-neutral `Params`), tensor
//! `data` written straight to raw bytes, and the response's data serialized from raw bytes.
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::Value;

use crate::kserve::{self, DataType, OutputTensor, Param, Params};

/// Tensors one request may name (inputs, and outputs).
pub const MAX_TENSORS: usize = 64;
/// Dimensions of one tensor's shape.
pub const MAX_DIMS: usize = 16;
/// Parameters of one request, input or output.
pub const MAX_PARAMETERS: usize = 64;

// Every list is bounded while it is parsed, and each input's `data` stays text until its
// datatype and shape are known, then becomes raw bytes in one pass: no tree of JSON values.
/// A KServe v2 inference request (the JSON header of the binary form). At most 64 inputs
/// and 64 outputs, 16 dimensions a shape, 64 parameters a map.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct JsonRequest<'a> {
    #[serde(default)]
    pub id: Option<String>,
    /// `priority`, `timeout` (microseconds), `binary_data_output`.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub parameters: JsonParams,
    #[serde(borrow)]
    #[schema(value_type = Vec<JsonInput>, min_items = 1, max_items = 64)]
    pub inputs: Capped<JsonInput<'a>, MAX_TENSORS>,
    #[serde(default)]
    #[schema(value_type = Vec<JsonOutput>, max_items = 64)]
    pub outputs: Capped<JsonOutput, MAX_TENSORS>,
}

#[derive(Deserialize, utoipa::ToSchema)]
pub struct JsonInput<'a> {
    #[schema(min_length = 1)]
    pub name: String,
    #[schema(value_type = Vec<u64>, max_items = 16)]
    pub shape: Capped<i64, MAX_DIMS>,
    /// BOOL, UINT8..UINT64, INT8..INT64, FP16, BF16, FP32, FP64 or BYTES.
    #[schema(
        pattern = "^(BOOL|UINT8|UINT16|UINT32|UINT64|INT8|INT16|INT32|INT64|FP16|BF16|FP32|FP64|BYTES)$"
    )]
    pub datatype: String,
    /// `binary_data_size` when the data follows the JSON header.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub parameters: JsonParams,
    /// The elements, flat or nested (row-major).
    #[serde(default, borrow)]
    #[schema(value_type = Vec<serde_json::Value>)]
    pub data: Option<&'a RawValue>,
}

#[derive(Deserialize, utoipa::ToSchema)]
pub struct JsonOutput {
    #[schema(min_length = 1)]
    pub name: String,
    /// `binary_data` (boolean), `classification` (top k as `score:index:label`).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub parameters: JsonParams,
}

/// A JSON list of at most `N` items: the item after the `N`th is refused as it is read.
pub struct Capped<T, const N: usize>(pub Vec<T>);

impl<T, const N: usize> Default for Capped<T, N> {
    fn default() -> Self {
        Capped(Vec::new())
    }
}

impl<'de, T: Deserialize<'de>, const N: usize> Deserialize<'de> for Capped<T, N> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Items<T, const N: usize>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>, const N: usize> Visitor<'de> for Items<T, N> {
            type Value = Capped<T, N>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a list of at most {N} items")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    if items.len() == N {
                        return Err(de::Error::custom(format!(
                            "a list of more than {N} items (inputs and outputs: at most \
                             {MAX_TENSORS}, shape: {MAX_DIMS} dimensions)"
                        )));
                    }
                    items.push(item);
                }
                Ok(Capped(items))
            }
        }
        d.deserialize_seq(Items::<T, N>(PhantomData))
    }
}

/// Parameters: at most [`MAX_PARAMETERS`], each a boolean, number or string (what
/// KServe's parameters can be); a list or object is refused before it is read.
#[derive(Default)]
pub struct JsonParams(pub Params);

impl<'de> Deserialize<'de> for JsonParams {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = JsonParams;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "an object of at most {MAX_PARAMETERS} parameters")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonParams, A::Error> {
                let mut params = Params::default();
                while let Some(name) = map.next_key::<String>()? {
                    if params.len() == MAX_PARAMETERS {
                        return Err(de::Error::custom(format!(
                            "more than {MAX_PARAMETERS} parameters"
                        )));
                    }
                    let Scalar(value) = map.next_value()?;
                    params.insert(name, value);
                }
                Ok(JsonParams(params))
            }
        }
        d.deserialize_map(Entries)
    }
}

/// A boolean, number or string.
struct Scalar(Param);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct One;
        impl Visitor<'_> for One {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a parameter value: a boolean, number or string")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar(Param::Bool(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar(Param::Int(v)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar(Param::Uint(v)))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar(Param::Double(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar(Param::Text(v.to_string())))
            }
        }
        d.deserialize_any(One)
    }
}

/// A KServe v2 inference response (the JSON header of the binary form).
#[derive(Serialize, utoipa::ToSchema)]
pub struct JsonResponse<'a> {
    pub model_name: String,
    pub model_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub outputs: Vec<JsonOutputTensor<'a>>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct JsonOutputTensor<'a> {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
    /// `binary_data_size` when the data follows the JSON header.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Value>,
    /// The elements, flat (row-major), unless sent as binary or written to shared memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub data: Option<JsonData<'a>>,
}

/// JSON tensor data (flat or nested row-major) in raw form, written as it is parsed. The
/// shape says how many elements to expect: the raw form is allocated once, never larger
/// than the text allows, and an element past the count is refused where it stands.
pub fn json_to_raw(data: &RawValue, datatype: DataType, shape: &[i64]) -> Result<Vec<u8>, String> {
    if matches!(datatype, DataType::Fp16 | DataType::Bf16) {
        return Err(format!(
            "{datatype} cannot travel as JSON; send it as binary data"
        ));
    }
    let expected = kserve::element_count(shape)?;
    let text = data.get();
    // Each element takes at least one character of the text.
    let capacity = match datatype.size() {
        Some(size) => expected.min(text.len()) * size,
        None => text.len(),
    };
    let mut elements = Elements {
        datatype,
        out: Vec::with_capacity(capacity),
        count: 0,
        expected,
    };
    let mut de = serde_json::Deserializer::from_str(text);
    (&mut elements)
        .deserialize(&mut de)
        .map_err(|e| format!("'data': {e}"))?;
    if elements.count != expected {
        return Err(format!(
            "'data' has {} elements, but shape {shape:?} needs {expected}",
            elements.count
        ));
    }
    Ok(elements.out)
}

/// The raw form of JSON elements of one datatype, as they are read.
struct Elements {
    datatype: DataType,
    out: Vec<u8>,
    count: usize,
    expected: usize,
}

/// One JSON element.
#[derive(Clone, Copy)]
enum Element<'s> {
    Bool(bool),
    Unsigned(u64),
    Signed(i64),
    Float(f64),
    Str(&'s str),
}

impl fmt::Display for Element<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Element::Bool(v) => write!(f, "{v}"),
            Element::Unsigned(v) => write!(f, "{v}"),
            Element::Signed(v) => write!(f, "{v}"),
            Element::Float(v) => write!(f, "{v}"),
            Element::Str(v) => write!(f, "{v:?}"),
        }
    }
}

impl Elements {
    fn push(&mut self, v: Element) -> Result<(), String> {
        if self.count == self.expected {
            return Err(format!(
                "more elements than the {} the shape asks for",
                self.expected
            ));
        }
        let (i, datatype) = (self.count, self.datatype);
        self.count += 1;
        let bad = || format!("element {i} ({v}) is not a valid {datatype}");
        let unsigned = match v {
            Element::Unsigned(x) => Some(x),
            Element::Signed(x) => u64::try_from(x).ok(),
            _ => None,
        };
        let signed = match v {
            Element::Unsigned(x) => i64::try_from(x).ok(),
            Element::Signed(x) => Some(x),
            _ => None,
        };
        let float = match v {
            Element::Unsigned(x) => Some(x as f64),
            Element::Signed(x) => Some(x as f64),
            Element::Float(x) => Some(x),
            _ => None,
        };
        let out = &mut self.out;
        macro_rules! put {
            ($t:ty, $get:expr) => {{
                let x: $t = $get.ok_or_else(bad)?;
                out.extend_from_slice(&x.to_le_bytes());
            }};
        }
        match datatype {
            DataType::Bool => match v {
                Element::Bool(b) => out.push(u8::from(b)),
                _ => return Err(bad()),
            },
            DataType::Uint8 => put!(u8, unsigned.and_then(|x| u8::try_from(x).ok())),
            DataType::Uint16 => put!(u16, unsigned.and_then(|x| u16::try_from(x).ok())),
            DataType::Uint32 => put!(u32, unsigned.and_then(|x| u32::try_from(x).ok())),
            DataType::Uint64 => put!(u64, unsigned),
            DataType::Int8 => put!(i8, signed.and_then(|x| i8::try_from(x).ok())),
            DataType::Int16 => put!(i16, signed.and_then(|x| i16::try_from(x).ok())),
            DataType::Int32 => put!(i32, signed.and_then(|x| i32::try_from(x).ok())),
            DataType::Int64 => put!(i64, signed),
            DataType::Fp32 => put!(f32, float.map(|x| x as f32)),
            DataType::Fp64 => put!(f64, float),
            DataType::Bytes => match v {
                Element::Str(s) => {
                    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
                    out.extend_from_slice(s.as_bytes());
                }
                _ => return Err(format!("BYTES element {i} must be a string")),
            },
            DataType::Fp16 | DataType::Bf16 => unreachable!("refused before parsing"),
        }
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for &mut Elements {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for &mut Elements {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} elements, in a list or nested lists", self.datatype)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(&mut *self)?.is_some() {}
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.push(Element::Bool(v)).map_err(E::custom)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.push(Element::Unsigned(v)).map_err(E::custom)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.push(Element::Signed(v)).map_err(E::custom)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.push(Element::Float(v)).map_err(E::custom)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.push(Element::Str(v)).map_err(E::custom)
    }
}

/// Raw output data as a flat JSON list, written as it is serialized (floats as their
/// f64 value, as JSON numbers are).
pub struct JsonData<'a>(pub &'a OutputTensor);

impl Serialize for JsonData<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let d = &self.0.data;
        macro_rules! nums {
            ($t:ty, $f:expr) => {
                s.collect_seq(d.chunks_exact(size_of::<$t>()).map(|b| {
                    $f(<$t>::from_le_bytes(
                        b.try_into().expect("chunks of the element size"),
                    ))
                }))
            };
        }
        match self.0.datatype {
            DataType::Bool => s.collect_seq(d.iter().map(|&b| b != 0)),
            DataType::Uint8 => s.collect_seq(d.iter()),
            DataType::Int8 => s.collect_seq(d.iter().map(|&b| b as i8)),
            DataType::Uint16 => nums!(u16, |x| x),
            DataType::Int16 => nums!(i16, |x| x),
            DataType::Uint32 => nums!(u32, |x| x),
            DataType::Int32 => nums!(i32, |x| x),
            DataType::Fp32 => nums!(f32, f64::from),
            DataType::Uint64 => nums!(u64, |x| x),
            DataType::Int64 => nums!(i64, |x| x),
            DataType::Fp64 => nums!(f64, |x| x),
            DataType::Fp16 | DataType::Bf16 => s.serialize_none(),
            DataType::Bytes => {
                s.collect_seq(kserve::bytes_elements(d).map(String::from_utf8_lossy))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_data_becomes_raw_little_endian_and_nested_lists_flatten() {
        let raw = |text: &str, datatype, shape: &[i64]| {
            let data: Box<RawValue> = serde_json::from_str(text).unwrap();
            json_to_raw(&data, datatype, shape)
        };
        let r = raw("[[1, 2], [3, 255]]", DataType::Uint8, &[2, 2]).unwrap();
        assert_eq!(r, vec![1, 2, 3, 255]);
        let r = raw("[1.5, -2]", DataType::Fp32, &[2]).unwrap();
        assert_eq!(r[..4], 1.5f32.to_le_bytes());
        assert_eq!(r[4..], (-2.0f32).to_le_bytes());
        let e = raw("[1, 256]", DataType::Uint8, &[2]).unwrap_err();
        assert!(e.contains("element 1") && e.contains("UINT8"), "{e}");
        let r = raw(r#"["ab"]"#, DataType::Bytes, &[1]).unwrap();
        assert_eq!(r, vec![2, 0, 0, 0, b'a', b'b']);
        // More elements than the shape: refused at the first one over, saying where.
        let e = raw("[1, 2, 3]", DataType::Int64, &[2]).unwrap_err();
        assert!(
            e.contains("more elements than the 2") && e.contains("column"),
            "{e}"
        );
        let e = raw("[1]", DataType::Int64, &[2]).unwrap_err();
        assert!(e.contains("has 1 elements") && e.contains("needs 2"), "{e}");
        let e = raw("[{}]", DataType::Fp32, &[1]).unwrap_err();
        assert!(e.contains("FP32 elements"), "{e}");
    }
}
