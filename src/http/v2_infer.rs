//! `POST /v2/models/{m}[/versions/{v}]/infer`: KServe v2 inference over HTTP, with JSON
//! tensors and Triton's binary tensor data extension.
//!
//! Binary form: the `Inference-Header-Content-Length` header gives the length of the JSON
//! header at the start of the body; the inputs with a `binary_data_size` parameter follow it
//! in input order. Outputs asked with `binary_data: true` (or all, with the request
//! parameter `binary_data_output`) come back the same way. With the header at 0 the whole
//! body is the model's single input (an encoded image for the image models, FP32 rows for a
//! classifier).
use actix_web::http::header::{self, HeaderValue};
use actix_web::{web, HttpRequest, HttpResponse};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::{body, client};
use crate::domain::RequestOptions;
use crate::error::{ErrorBody, ErrorKind, GatewayError};
use crate::kserve::{self, DataType, InferRequest, InputTensor, OutputTensor, RequestedOutput};
use crate::repository::ModelKind;
use crate::state::{AppState, ServedModel, ShmRef, UploadLimits};

pub const HEADER_LENGTH: &str = "inference-header-content-length";

/// Tensors one request may name (inputs, and outputs).
const MAX_TENSORS: usize = 64;
/// Dimensions of one tensor's shape.
const MAX_DIMS: usize = 16;
/// Parameters of one request, input or output.
const MAX_PARAMETERS: usize = 64;

// Every list is bounded while it is parsed, and each input's `data` stays text until its
// datatype and shape are known, then becomes raw bytes in one pass: no tree of JSON values.
/// A KServe v2 inference request (the JSON header of the binary form). At most 64 inputs
/// and 64 outputs, 16 dimensions a shape, 64 parameters a map.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct JsonRequest<'a> {
    #[serde(default)]
    id: Option<String>,
    /// `priority`, `timeout` (microseconds), `binary_data_output`.
    #[serde(default)]
    #[schema(value_type = Object)]
    parameters: Params,
    #[serde(borrow)]
    #[schema(value_type = Vec<JsonInput>, min_items = 1, max_items = 64)]
    inputs: Capped<JsonInput<'a>, MAX_TENSORS>,
    #[serde(default)]
    #[schema(value_type = Vec<JsonOutput>, max_items = 64)]
    outputs: Capped<JsonOutput, MAX_TENSORS>,
}

#[derive(Deserialize, utoipa::ToSchema)]
pub struct JsonInput<'a> {
    #[schema(min_length = 1)]
    name: String,
    #[schema(value_type = Vec<u64>, max_items = 16)]
    shape: Capped<i64, MAX_DIMS>,
    /// BOOL, UINT8..UINT64, INT8..INT64, FP16, BF16, FP32, FP64 or BYTES.
    #[schema(
        pattern = "^(BOOL|UINT8|UINT16|UINT32|UINT64|INT8|INT16|INT32|INT64|FP16|BF16|FP32|FP64|BYTES)$"
    )]
    datatype: String,
    /// `binary_data_size` when the data follows the JSON header.
    #[serde(default)]
    #[schema(value_type = Object)]
    parameters: Params,
    /// The elements, flat or nested (row-major).
    #[serde(default, borrow)]
    #[schema(value_type = Object)]
    data: Option<&'a RawValue>,
}

#[derive(Deserialize, utoipa::ToSchema)]
pub struct JsonOutput {
    #[schema(min_length = 1)]
    name: String,
    /// `binary_data` (boolean), `classification` (top k as `score:index:label`).
    #[serde(default)]
    #[schema(value_type = Object)]
    parameters: Params,
}

/// A JSON list of at most `N` items: the item after the `N`th is refused as it is read.
pub struct Capped<T, const N: usize>(Vec<T>);

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
/// Triton's parameters can be).
#[derive(Default)]
pub struct Params(Map<String, Value>);

impl<'de> Deserialize<'de> for Params {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = Params;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "an object of at most {MAX_PARAMETERS} parameters")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Params, A::Error> {
                let mut params = Map::new();
                while let Some(name) = map.next_key::<String>()? {
                    if params.len() == MAX_PARAMETERS {
                        return Err(de::Error::custom(format!(
                            "more than {MAX_PARAMETERS} parameters"
                        )));
                    }
                    let Scalar(value) = map.next_value()?;
                    params.insert(name, value);
                }
                Ok(Params(params))
            }
        }
        d.deserialize_map(Entries)
    }
}

/// A boolean, number or string; a list or object is refused before it is read.
struct Scalar(Value);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct One;
        impl Visitor<'_> for One {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a parameter value: a boolean, number or string")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar(v.into()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar(v.into()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar(v.into()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar(v.into()))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar(v.into()))
            }
        }
        d.deserialize_any(One)
    }
}

/// A KServe v2 inference response (the JSON header of the binary form).
#[derive(Serialize, utoipa::ToSchema)]
pub struct JsonResponse<'a> {
    model_name: String,
    model_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    outputs: Vec<JsonOutputTensor<'a>>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct JsonOutputTensor<'a> {
    name: String,
    datatype: String,
    shape: Vec<i64>,
    /// `binary_data_size` when the data follows the JSON header.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    parameters: Option<Value>,
    /// The elements, flat (row-major), unless sent as binary or written to shared memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    data: Option<JsonData<'a>>,
}

#[derive(Deserialize)]
pub struct InferPath {
    model: String,
    version: Option<String>,
}

/// Runs a model: JSON tensors, or Triton's binary tensor extension
/// (`Inference-Header-Content-Length` = length of the JSON header, binary data after it;
/// 0 = the whole body is the model's single input, e.g. one encoded image).
#[utoipa::path(post, path = "/v2/models/{model}/infer", tag = "kserve",
    params(
        ("model" = String, Path, description = "Model name"),
        ("Inference-Header-Content-Length" = Option<u64>, Header,
            description = "Binary tensor extension: bytes of JSON before the binary data"),
    ),
    request_body(content = JsonRequest, description = "JSON, or JSON header + binary data"),
    responses(
        (status = 200, description = "Outputs (JSON, or JSON header + binary data with \
            `Inference-Header-Content-Length`)", body = JsonResponse),
        (status = 400, description = "Bad input name, datatype or shape, an undecodable row (named), or a shared-memory place outside its region", body = ErrorBody),
        (status = 404, description = "Unknown model or version, or shared-memory region", body = ErrorBody),
        (status = 408, description = "The body stopped arriving (`--body-timeout-secs`, `--body-min-rate`)", body = ErrorBody),
        (status = 413, description = "Body, or an input in shared memory, over `--max-body-bytes` (from `Content-Length` before reading, when sent)", body = ErrorBody),
        (status = 503, description = "Model not ready, its queue is full, or the server is shutting down", body = ErrorBody),
        (status = 504, description = "Still queued when the queue timeout passed", body = ErrorBody),
    ))]
pub async fn infer(
    req: HttpRequest,
    path: web::Path<InferPath>,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    // A stopping server finishes this request before it closes the listeners.
    let _work = state.drain.admit()?;
    body::check_length(&req, state.limits.max_body_bytes)?;
    let InferPath { model, version } = path.into_inner();
    run(req, model, version, payload, state).await
}

async fn run(
    req: HttpRequest,
    model: String,
    version: Option<String>,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    // Resolved once, first: an unknown model is 404 whatever the body holds.
    let served = kserve::resolve(&state, &model, version.as_deref())?;
    let body = read_body(payload, &state.limits).await?;
    let header_len = match req.headers().get(HEADER_LENGTH) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or_else(|| {
                    GatewayError::invalid(format!("{HEADER_LENGTH} must be a byte count"))
                })?,
        ),
    };
    let (request, binary_outputs) = match header_len {
        Some(0) => (raw_request(&served, &model, version, body)?, false),
        _ => parse_request(model, version, body, header_len)?,
    };
    // A client that leaves drops its request (its queued rows never run).
    let response = tokio::select! {
        r = kserve::infer(&state, &served, request.request) => r?,
        () = client::gone(&req) => return Err(client::left()),
    };
    Ok(write_response(response, &request.binary, binary_outputs))
}

async fn read_body(payload: web::Payload, limits: &UploadLimits) -> Result<Bytes, GatewayError> {
    let limit = limits.max_body_bytes;
    let mut payload = body::Paced::new(payload, limits.pace);
    let mut body = BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| match e {
            e if body::is_stall(&e) => limits.pace.stalled(),
            e => GatewayError::invalid(format!("cannot read the request body: {e}")),
        })?;
        if (body.len() + chunk.len()) as u64 > limit {
            return Err(GatewayError::new(
                ErrorKind::PayloadTooLarge,
                format!("request body is larger than {limit} bytes"),
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// A parsed request and, per requested output, whether it goes back as binary data.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub request: InferRequest,
    binary: Vec<bool>,
}

/// The JSON header (the whole body, or its first `header_len` bytes) and the binary input
/// data after it. Returns whether outputs default to binary (`binary_data_output`).
pub(crate) fn parse_request(
    model: String,
    version: Option<String>,
    body: Bytes,
    header_len: Option<usize>,
) -> Result<(Parsed, bool), GatewayError> {
    let header_len = header_len.unwrap_or(body.len());
    if header_len > body.len() {
        return Err(GatewayError::invalid(format!(
            "{HEADER_LENGTH} is {header_len} but the body has {} bytes",
            body.len()
        )));
    }
    let json: JsonRequest = serde_json::from_slice(&body[..header_len])
        .map_err(|e| GatewayError::invalid(format!("malformed inference request JSON: {e}")))?;
    let mut binary = body.slice(header_len..);
    let mut inputs = Vec::with_capacity(json.inputs.0.len());
    for input in json.inputs.0 {
        let datatype = DataType::parse(&input.datatype)
            .map_err(|e| GatewayError::invalid(format!("input '{}': {e}", input.name)))?;
        let shape = input.shape.0;
        let place = shared_memory(&input.name, &input.parameters.0)?;
        let size = input.parameters.0.get("binary_data_size");
        let given = [input.data.is_some(), size.is_some(), place.is_some()];
        if given.iter().filter(|&&g| g).count() != 1 {
            return Err(GatewayError::invalid(format!(
                "input '{}' must set exactly one of 'data', 'binary_data_size' in \
                 'parameters' or 'shared_memory_region' in 'parameters'",
                input.name
            )));
        }
        let data = if let Some(size) = size {
            let size = size.as_u64().ok_or_else(|| {
                GatewayError::invalid(format!(
                    "input '{}': binary_data_size must be a byte count",
                    input.name
                ))
            })? as usize;
            if size > binary.len() {
                return Err(GatewayError::invalid(format!(
                    "input '{}': binary_data_size {size} is more than the {} bytes left \
                     after the JSON header",
                    input.name,
                    binary.len()
                )));
            }
            binary.split_to(size)
        } else if let Some(data) = &input.data {
            json_to_raw(data, datatype, &shape)
                .map_err(|e| GatewayError::invalid(format!("input '{}': {e}", input.name)))?
                .into()
        } else {
            Bytes::new()
        };
        inputs.push(InputTensor {
            name: input.name,
            datatype,
            shape,
            data,
            shared_memory: place,
        });
    }
    if !binary.is_empty() {
        return Err(GatewayError::invalid(format!(
            "{} bytes after the JSON header are not claimed by any input's binary_data_size",
            binary.len()
        )));
    }
    let params = &json.parameters.0;
    let binary_output_default = bool_param(params, "binary_data_output")?.unwrap_or(false);
    let mut outputs = Vec::new();
    let mut binary_flags = Vec::new();
    for o in json.outputs.0 {
        let classification = match o.parameters.0.get("classification") {
            None => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                GatewayError::invalid(format!(
                    "output '{}': classification must be a class count",
                    o.name
                ))
            })? as usize),
        };
        let place = shared_memory(&o.name, &o.parameters.0)?;
        let binary = bool_param(&o.parameters.0, "binary_data")?;
        if place.is_some() && binary == Some(true) {
            return Err(GatewayError::invalid(format!(
                "output '{}' can't set both 'shared_memory_region' and 'binary_data'",
                o.name
            )));
        }
        binary_flags.push(binary.unwrap_or(binary_output_default));
        outputs.push(RequestedOutput {
            name: o.name,
            classification,
            shared_memory: place,
        });
    }
    let request = InferRequest {
        model,
        version,
        id: json.id.unwrap_or_default(),
        inputs,
        outputs,
        options: request_options(params)?,
    };
    Ok((
        Parsed {
            request,
            binary: binary_flags,
        },
        binary_output_default,
    ))
}

/// A tensor's place in system shared memory, from its `shared_memory_*` parameters.
fn shared_memory(
    tensor: &str,
    params: &Map<String, Value>,
) -> Result<Option<ShmRef>, GatewayError> {
    let region = params
        .get("shared_memory_region")
        .map(|v| v.as_str().map(String::from));
    let number = |name: &str| params.get(name).map(Value::as_u64);
    kserve::shared_memory_ref(
        tensor,
        region,
        number("shared_memory_offset"),
        number("shared_memory_byte_size"),
    )
}

fn bool_param(params: &Map<String, Value>, name: &str) -> Result<Option<bool>, GatewayError> {
    params
        .get(name)
        .map(|v| {
            v.as_bool().ok_or_else(|| {
                GatewayError::invalid(format!("parameter '{name}' must be true or false"))
            })
        })
        .transpose()
}

/// Triton's `priority` and `timeout` (microseconds) request parameters.
fn request_options(params: &Map<String, Value>) -> Result<RequestOptions, GatewayError> {
    let number = |name: &str| -> Result<Option<u64>, GatewayError> {
        params
            .get(name)
            .map(|v| {
                v.as_u64().ok_or_else(|| {
                    GatewayError::invalid(format!(
                        "parameter '{name}' must be a non-negative integer"
                    ))
                })
            })
            .transpose()
    };
    Ok(RequestOptions {
        priority: number("priority")?.unwrap_or(0),
        timeout: number("timeout")?.map(std::time::Duration::from_micros),
    })
}

/// The whole body is the model's single input: one encoded image (BYTES `[1]`) for the
/// image models, `[N, 3, H, W]` FP32 rows for a classifier.
fn raw_request(
    served: &ServedModel,
    model: &str,
    version: Option<String>,
    body: Bytes,
) -> Result<Parsed, GatewayError> {
    let (name, datatype, shape, data) = match &served.repository_model().kind {
        ModelKind::Classifier(spec) => {
            let row = 3 * spec.height * spec.width * 4;
            if body.is_empty() || !body.len().is_multiple_of(row) {
                return Err(GatewayError::invalid(format!(
                    "raw input of model '{model}' must be FP32 rows of 3x{}x{} ({row} bytes each); got {} bytes",
                    spec.height,
                    spec.width,
                    body.len()
                )));
            }
            let n = (body.len() / row) as i64;
            let shape = vec![n, 3, spec.height as i64, spec.width as i64];
            (spec.input_name.clone(), DataType::Fp32, shape, body)
        }
        ModelKind::Ensemble(spec) => (
            spec.input_name.clone(),
            DataType::Bytes,
            vec![1],
            kserve::encode_bytes_elements([body.as_ref()]).into(),
        ),
        ModelKind::Preprocessor(spec) => (
            spec.input_name.clone(),
            DataType::Bytes,
            vec![1],
            kserve::encode_bytes_elements([body.as_ref()]).into(),
        ),
    };
    Ok(Parsed {
        request: InferRequest {
            model: model.to_string(),
            version,
            id: String::new(),
            inputs: vec![InputTensor {
                name,
                datatype,
                shape,
                data,
                shared_memory: None,
            }],
            outputs: Vec::new(),
            options: RequestOptions::default(),
        },
        binary: Vec::new(),
    })
}

/// JSON tensor data (flat or nested row-major) in raw form, written as it is parsed. The
/// shape says how many elements to expect: the raw form is allocated once, never larger
/// than the text allows, and an element past the count is refused where it stands.
fn json_to_raw(data: &RawValue, datatype: DataType, shape: &[i64]) -> Result<Vec<u8>, String> {
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
pub struct JsonData<'a>(&'a OutputTensor);

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

/// The response: JSON, or JSON header + binary output data when any output is binary.
fn write_response(
    response: kserve::InferResponse,
    binary: &[bool],
    binary_default: bool,
) -> HttpResponse {
    let kserve::InferResponse {
        model,
        version,
        id,
        outputs,
    } = response;
    let mut tail: Vec<u8> = Vec::new();
    let json_outputs: Vec<JsonOutputTensor> = outputs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let as_binary = binary.get(i).copied().unwrap_or(binary_default)
                || matches!(o.datatype, DataType::Fp16 | DataType::Bf16);
            let mut out = JsonOutputTensor {
                name: o.name.clone(),
                datatype: o.datatype.as_str().to_string(),
                shape: o.shape.clone(),
                parameters: None,
                data: None,
            };
            if o.shared_memory.is_some() {
                // As Triton: the datatype and shape, the data in the client's region.
            } else if as_binary {
                out.parameters = Some(serde_json::json!({ "binary_data_size": o.data.len() }));
                tail.extend_from_slice(&o.data);
            } else {
                out.data = Some(JsonData(o));
            }
            out
        })
        .collect();
    let header = JsonResponse {
        model_name: model,
        model_version: version,
        id: (!id.is_empty()).then_some(id),
        outputs: json_outputs,
    };
    let header = serde_json::to_vec(&header).expect("a JSON value serializes");
    if tail.is_empty() {
        return HttpResponse::Ok()
            .content_type("application/json")
            .body(header);
    }
    let header_len = header.len();
    let mut body = header;
    body.extend_from_slice(&tail);
    HttpResponse::Ok()
        .content_type("application/octet-stream")
        .insert_header((
            header::HeaderName::from_static(HEADER_LENGTH),
            HeaderValue::from(header_len),
        ))
        .body(body)
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

    #[test]
    fn lists_and_parameters_are_bounded_while_parsed() {
        let parse = |json: String| {
            parse_request("m".into(), None, Bytes::from(json), None)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        };
        let input = r#"{"name":"x","shape":[1],"datatype":"UINT8","data":[1]}"#;
        let inputs = vec![input; MAX_TENSORS + 1].join(",");
        let e = parse(format!(r#"{{"inputs":[{inputs}]}}"#));
        assert!(e.contains("more than 64 items"), "{e}");
        let shape = vec!["1"; MAX_DIMS + 1].join(",");
        let e = parse(format!(
            r#"{{"inputs":[{{"name":"x","shape":[{shape}],"datatype":"UINT8","data":[1]}}]}}"#
        ));
        assert!(e.contains("more than 16 items"), "{e}");
        let params: Vec<String> = (0..=MAX_PARAMETERS)
            .map(|i| format!(r#""p{i}":1"#))
            .collect();
        let e = parse(format!(
            r#"{{"parameters":{{{}}},"inputs":[]}}"#,
            params.join(",")
        ));
        assert!(e.contains("more than 64 parameters"), "{e}");
        let e = parse(r#"{"parameters":{"p":[1,2,3]},"inputs":[]}"#.into());
        assert!(e.contains("boolean, number or string"), "{e}");
    }

    #[test]
    fn binary_inputs_follow_the_json_header_in_order() {
        let header = br#"{"inputs":[{"name":"a","shape":[2],"datatype":"UINT8","parameters":{"binary_data_size":2}},{"name":"b","shape":[1],"datatype":"INT32","data":[7]}],"outputs":[{"name":"o","parameters":{"binary_data":true,"classification":3}}]}"#;
        let mut body = header.to_vec();
        body.extend_from_slice(&[9, 8]);
        let (parsed, default_binary) =
            parse_request("m".into(), None, Bytes::from(body), Some(header.len())).unwrap();
        assert!(!default_binary);
        let inputs = &parsed.request.inputs;
        assert_eq!(inputs[0].data.as_ref(), &[9, 8]);
        assert_eq!(inputs[1].data.as_ref(), &7i32.to_le_bytes());
        assert_eq!(parsed.request.outputs[0].classification, Some(3));
        assert_eq!(parsed.binary, vec![true]);

        let short = Bytes::from(header.to_vec());
        let e = parse_request("m".into(), None, short, Some(header.len())).unwrap_err();
        assert!(e.to_string().contains("binary_data_size 2"), "{e}");
    }

    #[test]
    fn shared_memory_replaces_data_and_binary_data() {
        let parse =
            |json: &str| parse_request("m".into(), None, Bytes::from(json.to_string()), None);
        let (parsed, _) = parse(
            r#"{"inputs":[{"name":"a","shape":[2],"datatype":"FP32","parameters":{"shared_memory_region":"r","shared_memory_byte_size":8,"shared_memory_offset":4}}],"outputs":[{"name":"o","parameters":{"shared_memory_region":"q","shared_memory_byte_size":16}}]}"#,
        )
        .unwrap();
        let input = &parsed.request.inputs[0];
        assert!(input.data.is_empty());
        assert_eq!(
            input.shared_memory,
            Some(ShmRef {
                region: "r".into(),
                offset: 4,
                byte_size: 8
            })
        );
        assert_eq!(
            parsed.request.outputs[0]
                .shared_memory
                .as_ref()
                .unwrap()
                .region,
            "q"
        );
        assert_eq!(parsed.binary, vec![false]);
        for (json, says) in [
            (
                r#"{"inputs":[{"name":"a","shape":[1],"datatype":"UINT8","data":[1],"parameters":{"shared_memory_region":"r","shared_memory_byte_size":1}}]}"#,
                "exactly one of",
            ),
            (
                r#"{"inputs":[{"name":"a","shape":[1],"datatype":"UINT8","data":[1]}],"outputs":[{"name":"o","parameters":{"shared_memory_region":"q","shared_memory_byte_size":4,"binary_data":true}}]}"#,
                "can't set both",
            ),
            (
                r#"{"inputs":[{"name":"a","shape":[1],"datatype":"UINT8","parameters":{"shared_memory_region":"r","shared_memory_byte_size":-1}}]}"#,
                "non-negative integer",
            ),
        ] {
            let e = parse(json).unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
        }
    }

    #[test]
    fn outputs_are_json_lists_or_binary_with_their_size() {
        let out = OutputTensor {
            name: "o".into(),
            datatype: DataType::Fp32,
            shape: vec![1, 2],
            data: [1.0f32.to_le_bytes(), 2.0f32.to_le_bytes()].concat(),
            shared_memory: None,
        };
        assert_eq!(
            serde_json::to_value(JsonData(&out)).unwrap(),
            serde_json::json!([1.0, 2.0])
        );
        let response = kserve::InferResponse {
            model: "m".into(),
            version: "1".into(),
            id: String::new(),
            outputs: vec![out],
        };
        let resp = write_response(response, &[true], false);
        let len: usize = resp
            .headers()
            .get(HEADER_LENGTH)
            .unwrap()
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(len > 0);
    }
}
