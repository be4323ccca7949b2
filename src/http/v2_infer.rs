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
use serde::Deserialize;

use super::v2_json::{json_to_raw, JsonData, JsonOutputTensor, JsonRequest, JsonResponse};
use super::{body, client};
use crate::domain::RequestOptions;
use crate::error::{ErrorBody, ErrorKind, GatewayError};
use crate::kserve::{self, DataType, InferRequest, InputTensor};
use crate::repository::ModelKind;
use crate::state::{AppState, ServedModel, UploadLimits};
use crate::trace::{Context, Stamp};
use std::time::Instant;

pub const HEADER_LENGTH: &str = "inference-header-content-length";

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
    body::check_length(req.headers(), state.limits.max_input_bytes)?;
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
    let recv_start = Instant::now();
    // Resolved once, first: an unknown model is 404 whatever the body holds.
    let served = kserve::resolve(&state, &model, version.as_deref())?;
    let body = read_body(payload, &state.limits).await?;
    let recv_end = Instant::now();
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
        Some(0) => (raw_request(&served, &model, body)?, false),
        _ => parse_request(model, body, header_len)?,
    };
    // Sampled once the request is read: its id is the trace's.
    let trace = kserve::start_trace(&state, &served, &request.request.id, || trace_context(&req));
    if let Some(t) = &trace {
        t.stamp_at(Stamp::HttpRecvStart, recv_start);
        t.stamp_at(Stamp::HttpRecvEnd, recv_end);
    }
    // A client that leaves drops its request (its queued rows never run).
    let response = tokio::select! {
        r = kserve::infer(&state, &served, request.request, trace.as_ref()) => r,
        () = client::gone(&req) => Err(client::left()),
    };
    if let Some(t) = &trace {
        match &response {
            Ok(_) => t.stamp(Stamp::InferResponseComplete),
            Err(e) => t.fail(&e.to_string()),
        }
        t.stamp(Stamp::HttpSendStart);
    }
    let response = response.map(|r| write_response(r, &request.binary, binary_outputs));
    if let Some(t) = &trace {
        t.stamp(Stamp::HttpSendEnd);
    }
    response
}

/// The caller's W3C trace context, where its headers carry one that parses.
pub(crate) fn trace_context(req: &HttpRequest) -> Option<Context> {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    Context::parse(header("traceparent")?, header("tracestate"))
}

async fn read_body(payload: web::Payload, limits: &UploadLimits) -> Result<Bytes, GatewayError> {
    let limit = limits.max_input_bytes;
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
        let params = &input.parameters.0;
        let place = params.shared_memory(&input.name)?;
        let size = params
            .count("binary_data_size", || {
                format!(
                    "input '{}': binary_data_size must be a byte count",
                    input.name
                )
            })?
            .map(|size| usize::try_from(size).unwrap_or(usize::MAX));
        let given = [input.data.is_some(), size.is_some(), place.is_some()];
        if given.iter().filter(|&&g| g).count() != 1 {
            return Err(GatewayError::invalid(format!(
                "input '{}' must set exactly one of 'data', 'binary_data_size' in \
                 'parameters' or 'shared_memory_region' in 'parameters'",
                input.name
            )));
        }
        let data = if let Some(size) = size {
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
    let binary_output_default = params.flag("binary_data_output")?.unwrap_or(false);
    let mut outputs = Vec::new();
    let mut binary_flags = Vec::new();
    for o in json.outputs.0 {
        let binary = o.parameters.0.flag("binary_data")?;
        let output = o.parameters.0.requested_output(o.name)?;
        if output.shared_memory.is_some() && binary == Some(true) {
            return Err(GatewayError::invalid(format!(
                "output '{}' can't set both 'shared_memory_region' and 'binary_data'",
                output.name
            )));
        }
        binary_flags.push(binary.unwrap_or(binary_output_default));
        outputs.push(output);
    }
    let request = InferRequest {
        model,
        id: json.id.unwrap_or_default(),
        inputs,
        outputs,
        options: params.request_options()?,
    };
    Ok((
        Parsed {
            request,
            binary: binary_flags,
        },
        binary_output_default,
    ))
}

/// The whole body is the model's single input: one encoded image (BYTES `[1]`) for the
/// image models, `[N, 3, H, W]` FP32 rows for a classifier.
fn raw_request(served: &ServedModel, model: &str, body: Bytes) -> Result<Parsed, GatewayError> {
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
    use super::super::v2_json::{MAX_DIMS, MAX_PARAMETERS, MAX_TENSORS};
    use super::*;
    use crate::kserve::OutputTensor;
    use crate::shm::ShmRef;

    #[test]
    fn lists_and_parameters_are_bounded_while_parsed() {
        let parse = |json: String| {
            parse_request("m".into(), Bytes::from(json), None)
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
            parse_request("m".into(), Bytes::from(body), Some(header.len())).unwrap();
        assert!(!default_binary);
        let inputs = &parsed.request.inputs;
        assert_eq!(inputs[0].data.as_ref(), &[9, 8]);
        assert_eq!(inputs[1].data.as_ref(), &7i32.to_le_bytes());
        assert_eq!(parsed.request.outputs[0].classification, Some(3));
        assert_eq!(parsed.binary, vec![true]);

        let short = Bytes::from(header.to_vec());
        let e = parse_request("m".into(), short, Some(header.len())).unwrap_err();
        assert!(e.to_string().contains("binary_data_size 2"), "{e}");
    }

    #[test]
    fn shared_memory_replaces_data_and_binary_data() {
        let parse = |json: &str| parse_request("m".into(), Bytes::from(json.to_string()), None);
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
