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
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{body, client};
use crate::domain::RequestOptions;
use crate::error::{ErrorBody, ErrorKind, GatewayError};
use crate::kserve::{self, DataType, InferRequest, InputTensor, OutputTensor, RequestedOutput};
use crate::repository::ModelKind;
use crate::state::{AppState, ServedModel, UploadLimits};

pub const HEADER_LENGTH: &str = "inference-header-content-length";

/// A KServe v2 inference request (the JSON header of the binary form).
#[derive(Deserialize, utoipa::ToSchema)]
pub struct JsonRequest {
    #[serde(default)]
    id: Option<String>,
    /// `priority`, `timeout` (microseconds), `binary_data_output`.
    #[serde(default)]
    #[schema(value_type = Object)]
    parameters: Map<String, Value>,
    inputs: Vec<JsonInput>,
    #[serde(default)]
    outputs: Vec<JsonOutput>,
}

#[derive(Deserialize, utoipa::ToSchema)]
pub struct JsonInput {
    name: String,
    shape: Vec<i64>,
    /// BOOL, UINT8..UINT64, INT8..INT64, FP16, BF16, FP32, FP64 or BYTES.
    datatype: String,
    /// `binary_data_size` when the data follows the JSON header.
    #[serde(default)]
    #[schema(value_type = Object)]
    parameters: Map<String, Value>,
    /// The elements, flat or nested (row-major).
    #[serde(default)]
    #[schema(value_type = Object)]
    data: Option<Value>,
}

#[derive(Deserialize, utoipa::ToSchema)]
pub struct JsonOutput {
    name: String,
    /// `binary_data` (boolean), `classification` (top k as `score:index:label`).
    #[serde(default)]
    #[schema(value_type = Object)]
    parameters: Map<String, Value>,
}

/// A KServe v2 inference response (the JSON header of the binary form).
#[derive(Serialize, utoipa::ToSchema)]
pub struct JsonResponse {
    model_name: String,
    model_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    outputs: Vec<JsonOutputTensor>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct JsonOutputTensor {
    name: String,
    datatype: String,
    shape: Vec<i64>,
    /// `binary_data_size` when the data follows the JSON header.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    parameters: Option<Value>,
    /// The elements, flat (row-major), unless sent as binary.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    data: Option<Value>,
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
        (status = 400, description = "Bad input name, datatype or shape, or an undecodable row (named)", body = ErrorBody),
        (status = 404, description = "Unknown model or version", body = ErrorBody),
        (status = 408, description = "The body stopped arriving (`--body-timeout-secs`, `--body-min-rate`)", body = ErrorBody),
        (status = 413, description = "Body over `--max-body-bytes` (from `Content-Length` before reading, when sent)", body = ErrorBody),
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
struct Parsed {
    request: InferRequest,
    binary: Vec<bool>,
}

/// The JSON header (the whole body, or its first `header_len` bytes) and the binary input
/// data after it. Returns whether outputs default to binary (`binary_data_output`).
fn parse_request(
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
    let mut inputs = Vec::with_capacity(json.inputs.len());
    for input in json.inputs {
        let datatype = DataType::parse(&input.datatype)
            .map_err(|e| GatewayError::invalid(format!("input '{}': {e}", input.name)))?;
        let size = input.parameters.get("binary_data_size");
        let data = match (size, &input.data) {
            (Some(size), None) => {
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
            }
            (None, Some(data)) => json_to_raw(data, datatype)
                .map_err(|e| GatewayError::invalid(format!("input '{}': {e}", input.name)))?
                .into(),
            (Some(_), Some(_)) => {
                return Err(GatewayError::invalid(format!(
                    "input '{}' has both 'data' and binary_data_size",
                    input.name
                )))
            }
            (None, None) => {
                return Err(GatewayError::invalid(format!(
                    "input '{}' has no 'data' and no binary_data_size",
                    input.name
                )))
            }
        };
        inputs.push(InputTensor {
            name: input.name,
            datatype,
            shape: input.shape,
            data,
        });
    }
    if !binary.is_empty() {
        return Err(GatewayError::invalid(format!(
            "{} bytes after the JSON header are not claimed by any input's binary_data_size",
            binary.len()
        )));
    }
    let params = &json.parameters;
    let binary_output_default = bool_param(params, "binary_data_output")?.unwrap_or(false);
    let mut outputs = Vec::new();
    let mut binary_flags = Vec::new();
    for o in json.outputs {
        let classification = match o.parameters.get("classification") {
            None => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                GatewayError::invalid(format!(
                    "output '{}': classification must be a class count",
                    o.name
                ))
            })? as usize),
        };
        binary_flags
            .push(bool_param(&o.parameters, "binary_data")?.unwrap_or(binary_output_default));
        outputs.push(RequestedOutput {
            name: o.name,
            classification,
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
            }],
            outputs: Vec::new(),
            options: RequestOptions::default(),
        },
        binary: Vec::new(),
    })
}

/// JSON tensor data (flat or nested row-major) in raw form.
fn json_to_raw(data: &Value, datatype: DataType) -> Result<Vec<u8>, String> {
    let mut flat = Vec::new();
    flatten(data, &mut flat);
    let mut out = Vec::with_capacity(flat.len() * datatype.size().unwrap_or(8));
    if datatype == DataType::Bytes {
        let elements: Result<Vec<&[u8]>, String> = flat
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .map(str::as_bytes)
                    .ok_or_else(|| format!("BYTES element {i} must be a string"))
            })
            .collect();
        return Ok(kserve::encode_bytes_elements(elements?));
    }
    for (i, v) in flat.iter().enumerate() {
        let bad = || format!("element {i} ({v}) is not a valid {datatype}");
        macro_rules! put {
            ($t:ty, $get:expr) => {{
                let x: $t = $get.ok_or_else(bad)?;
                out.extend_from_slice(&x.to_le_bytes());
            }};
        }
        match datatype {
            DataType::Bool => out.push(u8::from(v.as_bool().ok_or_else(bad)?)),
            DataType::Uint8 => put!(u8, v.as_u64().and_then(|x| u8::try_from(x).ok())),
            DataType::Uint16 => put!(u16, v.as_u64().and_then(|x| u16::try_from(x).ok())),
            DataType::Uint32 => put!(u32, v.as_u64().and_then(|x| u32::try_from(x).ok())),
            DataType::Uint64 => put!(u64, v.as_u64()),
            DataType::Int8 => put!(i8, v.as_i64().and_then(|x| i8::try_from(x).ok())),
            DataType::Int16 => put!(i16, v.as_i64().and_then(|x| i16::try_from(x).ok())),
            DataType::Int32 => put!(i32, v.as_i64().and_then(|x| i32::try_from(x).ok())),
            DataType::Int64 => put!(i64, v.as_i64()),
            DataType::Fp32 => put!(f32, v.as_f64().map(|x| x as f32)),
            DataType::Fp64 => put!(f64, v.as_f64()),
            DataType::Fp16 | DataType::Bf16 => {
                return Err(format!(
                    "{datatype} cannot travel as JSON; send it as binary data"
                ))
            }
            DataType::Bytes => unreachable!("handled above"),
        }
    }
    Ok(out)
}

fn flatten<'a>(v: &'a Value, out: &mut Vec<&'a Value>) {
    match v {
        Value::Array(items) => items.iter().for_each(|i| flatten(i, out)),
        other => out.push(other),
    }
}

/// Raw output data as a flat JSON list.
fn raw_to_json(t: &OutputTensor) -> Value {
    let d = &t.data;
    let nums = |size: usize, f: &dyn Fn(&[u8]) -> Value| -> Value {
        Value::Array(d.chunks_exact(size).map(f).collect())
    };
    match t.datatype {
        DataType::Bool => Value::Array(d.iter().map(|&b| Value::Bool(b != 0)).collect()),
        DataType::Uint8 => Value::Array(d.iter().map(|&b| b.into()).collect()),
        DataType::Int8 => Value::Array(d.iter().map(|&b| (b as i8).into()).collect()),
        DataType::Uint16 => nums(2, &|b| u16::from_le_bytes([b[0], b[1]]).into()),
        DataType::Int16 => nums(2, &|b| i16::from_le_bytes([b[0], b[1]]).into()),
        DataType::Uint32 => nums(4, &|b| {
            u32::from_le_bytes(b.try_into().unwrap_or([0; 4])).into()
        }),
        DataType::Int32 => nums(4, &|b| {
            i32::from_le_bytes(b.try_into().unwrap_or([0; 4])).into()
        }),
        DataType::Fp32 => nums(4, &|b| {
            f32::from_le_bytes(b.try_into().unwrap_or([0; 4])).into()
        }),
        DataType::Uint64 => nums(8, &|b| {
            u64::from_le_bytes(b.try_into().unwrap_or([0; 8])).into()
        }),
        DataType::Int64 => nums(8, &|b| {
            i64::from_le_bytes(b.try_into().unwrap_or([0; 8])).into()
        }),
        DataType::Fp64 => nums(8, &|b| {
            f64::from_le_bytes(b.try_into().unwrap_or([0; 8])).into()
        }),
        DataType::Fp16 | DataType::Bf16 => Value::Null,
        DataType::Bytes => Value::Array(
            kserve::split_bytes_elements(d)
                .unwrap_or_default()
                .into_iter()
                .map(|e| String::from_utf8_lossy(e).into_owned().into())
                .collect(),
        ),
    }
}

/// The response: JSON, or JSON header + binary output data when any output is binary.
fn write_response(
    response: kserve::InferResponse,
    binary: &[bool],
    binary_default: bool,
) -> HttpResponse {
    let mut tail: Vec<u8> = Vec::new();
    let outputs: Vec<JsonOutputTensor> = response
        .outputs
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
            if as_binary {
                out.parameters = Some(serde_json::json!({ "binary_data_size": o.data.len() }));
                tail.extend_from_slice(&o.data);
            } else {
                out.data = Some(raw_to_json(o));
            }
            out
        })
        .collect();
    let header = JsonResponse {
        model_name: response.model,
        model_version: response.version,
        id: (!response.id.is_empty()).then_some(response.id),
        outputs,
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
        let raw = json_to_raw(&serde_json::json!([[1, 2], [3, 255]]), DataType::Uint8).unwrap();
        assert_eq!(raw, vec![1, 2, 3, 255]);
        let raw = json_to_raw(&serde_json::json!([1.5, -2]), DataType::Fp32).unwrap();
        assert_eq!(raw[..4], 1.5f32.to_le_bytes());
        assert_eq!(raw[4..], (-2.0f32).to_le_bytes());
        let e = json_to_raw(&serde_json::json!([1, 256]), DataType::Uint8).unwrap_err();
        assert!(e.contains("element 1") && e.contains("UINT8"), "{e}");
        let raw = json_to_raw(&serde_json::json!(["ab"]), DataType::Bytes).unwrap();
        assert_eq!(raw, vec![2, 0, 0, 0, b'a', b'b']);
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
    fn outputs_are_json_lists_or_binary_with_their_size() {
        let out = OutputTensor {
            name: "o".into(),
            datatype: DataType::Fp32,
            shape: vec![1, 2],
            data: [1.0f32.to_le_bytes(), 2.0f32.to_le_bytes()].concat(),
        };
        assert_eq!(raw_to_json(&out), serde_json::json!([1.0, 2.0]));
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
