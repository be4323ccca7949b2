//! `POST /predict`: multipart upload of many images, classified in upload order.
//!
//! Parts are read as a stream; each file goes to the decode pool as soon as its part is
//! complete, so decoding overlaps the rest of the upload. A file that cannot be used gets
//! an error entry and never changes the other files' results.
use std::time::{Duration, Instant};

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};
use bytes::BytesMut;
use futures_util::future::Either;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use super::multipart::{self, Event, Parser, Parts, ReadError};
use super::{body, client};
use crate::domain::RequestOptions;
use crate::engine::OutputRequest;
use crate::error::{ErrorBody, ErrorKind, GatewayError};
use crate::pace::BodyPace;
use crate::pipeline::Encoded;
use crate::preprocess::PreprocessError;
use crate::scheduler::{OneByOne, RowFailure, RowOutput};
use crate::state::AppState;
use crate::trace::{Stamp, Value};

const DEFAULT_MODEL: &str = "ensemble_model";
const DEFAULT_TOP_K: usize = 5;
/// Multipart field names accepted for files (`files` as FastAPI's `List[UploadFile]`).
const FILE_FIELDS: [&str; 2] = ["files", "file"];

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PredictQuery {
    /// How many classes to return per image (default 5; more than the model has gives
    /// all of them).
    #[param(minimum = 1)]
    pub top_k: Option<i32>,
    /// Which image model (default `ensemble_model`).
    pub model: Option<String>,
    /// Priority level, 1 the highest (Triton's `priority`); 0 or a level the model does
    /// not have means its `default_priority_level`.
    #[param(minimum = 0)]
    pub priority: Option<i64>,
    /// Queue timeout in microseconds (Triton's `timeout`): honoured where the model's
    /// queue policy has `allow_timeout_override`, and only to shorten its default.
    #[param(minimum = 0)]
    pub timeout_us: Option<i64>,
}

#[derive(Debug, Serialize, Deserialize, Clone, PartialEq, utoipa::ToSchema)]
pub struct TopK {
    pub label: Option<String>,
    pub class_id: u32,
    pub score: f32,
}

#[derive(Debug, Serialize, Deserialize, Clone, PartialEq, utoipa::ToSchema)]
pub struct Prediction {
    pub filename: String,
    pub label: Option<String>,
    pub class_id: u32,
    /// Softmax probability of the top class.
    pub score: f32,
    pub top_k: Vec<TopK>,
}

#[derive(Debug, Serialize, Deserialize, Clone, PartialEq, utoipa::ToSchema)]
pub struct FileError {
    pub code: String,
    pub message: String,
}

/// One uploaded file's result: its prediction, or why it could not be classified.
#[derive(Debug, Serialize, Deserialize, Clone, PartialEq, utoipa::ToSchema)]
#[serde(untagged)]
pub enum FileResult {
    Ok(Prediction),
    Err(FileFailure),
}

/// A file that could not be classified; the other files' results are unaffected.
#[derive(Debug, Serialize, Deserialize, Clone, PartialEq, utoipa::ToSchema)]
pub struct FileFailure {
    pub filename: String,
    pub error: FileError,
}

/// A query number that must not be negative (typed `i64` so that the document's int64
/// is exactly what parses).
fn non_negative(name: &str, v: Option<i64>) -> Result<Option<u64>, GatewayError> {
    v.map(|v| {
        u64::try_from(v)
            .map_err(|_| GatewayError::invalid(format!("{name} must not be negative, got {v}")))
    })
    .transpose()
}

/// The multipart body of `/predict` (documentation only: the handler streams the parts).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct PredictUpload {
    /// The images, one part each (up to `--max-files`, 1000 by default; the field `file`
    /// works too).
    #[schema(value_type = Vec<String>, format = Binary, min_items = 1, max_items = 1000)]
    files: Vec<Vec<u8>>,
}

#[derive(Debug, Serialize, Deserialize, Clone, PartialEq, utoipa::ToSchema)]
pub struct Timing {
    pub total_images: usize,
    pub total_sec: f64,
    pub average_latency_per_image_ms: f64,
}

#[derive(Debug, Serialize, Deserialize, Clone, PartialEq, utoipa::ToSchema)]
pub struct PredictResponse {
    pub model: String,
    pub model_version: String,
    pub results: Vec<FileResult>,
    pub timing: Timing,
}

/// The error entry of a file that could not be classified.
fn failed(filename: String, failure: RowFailure) -> FileResult {
    FileResult::Err(FileFailure {
        filename,
        error: FileError {
            code: failure.code().to_string(),
            message: failure.to_string(),
        },
    })
}

fn too_large(message: impl Into<String>) -> GatewayError {
    GatewayError::new(ErrorKind::PayloadTooLarge, message)
}

fn upload_error(e: ReadError<actix_web::error::PayloadError>, pace: BodyPace) -> GatewayError {
    use actix_web::error::PayloadError;
    match e {
        ReadError::Body(p) if body::is_stall(&p) => pace.stalled(),
        // The connection ended before the body did: the client left mid-upload.
        ReadError::Body(PayloadError::Incomplete(_) | PayloadError::Io(_)) => client::left(),
        ReadError::Body(e) => GatewayError::invalid(format!("cannot read the body: {e}")),
        ReadError::Malformed(e) => GatewayError::invalid(e.to_string()),
    }
}

/// Classifies the uploaded images, in upload order. A file that cannot be used gets an
/// `error` entry of its own and never changes the other files' results.
#[utoipa::path(
    post,
    path = "/predict",
    tag = "predict",
    params(PredictQuery),
    request_body(content = PredictUpload, content_type = "multipart/form-data"),
    responses(
        (status = 200, description = "One result per file, in upload order", body = PredictResponse),
        (status = 400, description = "No files, malformed multipart or a bad query", body = ErrorBody),
        (status = 404, description = "Unknown model", body = ErrorBody),
        (status = 408, description = "The body stopped arriving (`--body-timeout-secs`, `--body-min-rate`)", body = ErrorBody),
        (status = 413, description = "More files than `--max-files`, or a body over `--max-body-bytes` (from `Content-Length` before reading, when sent)", body = ErrorBody),
        (status = 415, description = "Not multipart/form-data", body = ErrorBody),
        (status = 503, description = "Model not ready, its queue is full (with `Retry-After`), or the server is shutting down", body = ErrorBody),
        (status = 504, description = "Still queued when the queue timeout passed", body = ErrorBody),
    )
)]
pub async fn predict(
    req: HttpRequest,
    payload: web::Payload,
    query: web::Query<PredictQuery>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    // A stopping server finishes this request before it closes the listeners.
    let _work = state.drain.admit()?;
    body::check_length(req.headers(), state.limits.max_body_bytes)?;
    // A client that leaves drops its request here: its queued rows leave the queue and
    // the request counts as CANCELED (see `Admission`).
    tokio::select! {
        answer = classify(req.clone(), payload, query, state) => answer,
        () = client::gone(&req) => Err(client::left()),
    }
}

async fn classify(
    req: HttpRequest,
    payload: web::Payload,
    query: web::Query<PredictQuery>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, GatewayError> {
    let started = Instant::now();
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let is_multipart = content_type
        .trim_start()
        .to_ascii_lowercase()
        .starts_with("multipart/form-data");
    if !is_multipart {
        return Err(GatewayError::new(
            ErrorKind::UnsupportedMediaType,
            "send the images as multipart/form-data, one part named 'files' per image",
        ));
    }
    let model_name = query.model.as_deref().unwrap_or(DEFAULT_MODEL);
    let pipeline = state.registry.image_pipeline(model_name)?;
    let top_k = query.top_k.map_or(DEFAULT_TOP_K as i32, |k| k);
    if top_k < 1 {
        return Err(GatewayError::invalid(format!(
            "top_k must be at least 1, got {top_k}"
        )));
    }
    // As Triton's classification: asking for more classes than there are gives all.
    let top_k = (top_k as usize).min(pipeline.num_classes);
    let options = RequestOptions {
        priority: non_negative("priority", query.priority)?.unwrap_or(0),
        timeout: non_negative("timeout_us", query.timeout_us)?.map(Duration::from_micros),
    };
    let want = OutputRequest::classes(top_k);
    let trace = state
        .server
        .trace
        .start(pipeline.name.as_str(), pipeline.version.0, "", || {
            super::v2_infer::trace_context(&req)
        });
    if let Some(t) = &trace {
        t.stamp_at(Stamp::HttpRecvStart, started);
    }
    // The reader streams the body into this channel, one entry per file part (tagged with
    // its name), paced by the decoding (so the upload slows down instead of piling up in
    // memory); its error, if any, ends the request at once through `abort`.
    let (files_tx, files_rx) = mpsc::channel(1);
    let (abort_tx, abort_rx) = oneshot::channel();
    // A bad boundary ends the request through `abort`, as any malformed upload does.
    let boundary = multipart::boundary(content_type);
    let reader = std::pin::pin!(read_upload(boundary, payload, &state, files_tx, abort_tx));
    let abort = async move {
        match abort_rx.await {
            Ok(e) => e,
            Err(_) => std::future::pending().await, // the upload was read whole
        }
    };
    // A full queue answers 503 at once; otherwise the queue place is taken with the first
    // decoded image, and rows enter the queue as their decode finishes. Each file fails on
    // its own: an error entry, the other files unaffected.
    let run = std::pin::pin!(pipeline.classify(
        &state.pool,
        options,
        want,
        OneByOne,
        tokio_stream::wrappers::ReceiverStream::new(files_rx),
        abort,
        trace.as_ref(),
    ));
    let outputs = match futures_util::future::select(run, reader).await {
        // Refused or failed: the rest of the upload is not read.
        Either::Left((outputs, _)) => outputs,
        Either::Right(((), run)) => {
            // The upload is read whole (its first images are decoding, or done, by now).
            if let Some(t) = &trace {
                t.stamp(Stamp::HttpRecvEnd);
            }
            run.await
        }
    };
    if let Some(t) = &trace {
        match &outputs {
            Ok(_) => t.stamp(Stamp::InferResponseComplete),
            Err(e) => {
                t.fail(&e.to_string());
                t.stamp(Stamp::HttpSendStart);
                t.stamp(Stamp::HttpSendEnd);
            }
        }
    }
    let outputs = outputs?;
    if let Some(t) = &trace {
        t.stamp(Stamp::HttpSendStart);
        for (place, (_, output)) in outputs.iter().enumerate() {
            if let Err(failure) = output {
                t.event(
                    "row_failed",
                    vec![
                        ("file", Value::Int(place as i64)),
                        ("code", Value::Text(failure.code().to_string())),
                    ],
                );
            }
        }
    }
    let label = |class: u32| {
        pipeline
            .labels
            .as_ref()
            .and_then(|l| l.get(class as usize).cloned())
    };
    let results: Vec<FileResult> = outputs
        .into_iter()
        .map(|(filename, output)| match output {
            Ok(RowOutput { top, .. }) => {
                let best = top.best();
                FileResult::Ok(Prediction {
                    filename,
                    label: label(best.class_id),
                    class_id: best.class_id,
                    score: best.score,
                    top_k: top
                        .classes()
                        .iter()
                        .map(|c| TopK {
                            label: label(c.class_id),
                            class_id: c.class_id,
                            score: c.score,
                        })
                        .collect(),
                })
            }
            Err(failure) => failed(filename, failure),
        })
        .collect();

    let total_sec = started.elapsed().as_secs_f64();
    let total_images = results.len();
    let response = HttpResponse::Ok().json(PredictResponse {
        model: pipeline.name.to_string(),
        model_version: pipeline.version.to_string(),
        results,
        timing: Timing {
            total_images,
            total_sec,
            average_latency_per_image_ms: total_sec * 1000.0 / total_images as f64,
        },
    });
    if let Some(t) = &trace {
        t.stamp(Stamp::HttpSendEnd);
    }
    Ok(response)
}

/// Streams the multipart body into `files`: each complete file part, tagged with its name
/// (or why it is unusable), as soon as it is read; the upload's error, which ends the
/// request, goes to `abort`.
async fn read_upload(
    boundary: Result<String, multipart::Malformed>,
    payload: web::Payload,
    state: &AppState,
    files: mpsc::Sender<Encoded<String>>,
    abort: oneshot::Sender<GatewayError>,
) {
    let end = match read_parts(boundary, payload, state, &files).await {
        Ok(0) => Err(GatewayError::invalid(
            "no files: send one or more multipart parts named 'files' (or 'file')",
        )),
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = end {
        let _ = abort.send(e);
    }
}

/// Reads the parts, sending each file on; returns how many file parts there were.
async fn read_parts(
    boundary: Result<String, multipart::Malformed>,
    payload: web::Payload,
    state: &AppState,
    files: &mpsc::Sender<Encoded<String>>,
) -> Result<usize, GatewayError> {
    let limits = &state.limits;
    let pace = limits.pace;
    let boundary = boundary.map_err(|e| GatewayError::invalid(e.to_string()))?;
    // Files, and as many other form fields (FastAPI's limits: 1000 of each).
    let parser = Parser::new(&boundary, limits.max_files.saturating_mul(2));
    let mut parts = Parts::new(body::Paced::new(payload, pace), parser);
    let mut count = 0;
    // The file part being read: its name, its content so far and its size.
    let mut file: Option<(String, BytesMut, u64)> = None;
    while let Some(event) = parts.next().await.map_err(|e| upload_error(e, pace))? {
        // Everything read counts, boundaries and part headers too (a body without a
        // `Content-Length` is only measured here).
        if parts.received() > limits.max_body_bytes {
            return Err(too_large(format!(
                "request body is larger than {} bytes",
                limits.max_body_bytes
            )));
        }
        match event {
            Event::Part(head) => {
                let is_file = head
                    .name
                    .as_deref()
                    .is_some_and(|n| FILE_FIELDS.contains(&n));
                if !is_file {
                    continue; // other form fields are ignored, as FastAPI does
                }
                if count == limits.max_files {
                    return Err(too_large(format!(
                        "too many files: at most {} per request",
                        limits.max_files
                    )));
                }
                let name = head.filename.unwrap_or_else(|| format!("file{count}"));
                count += 1;
                file = Some((name, BytesMut::new(), 0));
            }
            Event::Data(chunk) => {
                if let Some((_, data, size)) = &mut file {
                    *size += chunk.len() as u64;
                    // Past the per-file limit keep reading (to reach the next part) but
                    // drop it.
                    if *size <= limits.max_file_bytes {
                        data.extend_from_slice(&chunk);
                    }
                }
            }
            Event::PartEnd => {
                let Some((tag, data, size)) = file.take() else {
                    continue;
                };
                let image = if size > limits.max_file_bytes {
                    Err(PreprocessError::FileTooLarge {
                        size,
                        limit: limits.max_file_bytes,
                    })
                } else if data.is_empty() {
                    Err(PreprocessError::Empty)
                } else {
                    Ok(data.freeze())
                };
                if files.send(Encoded { tag, image }).await.is_err() {
                    break; // the request ended: its error answers it
                }
            }
        }
    }
    Ok(count)
}
