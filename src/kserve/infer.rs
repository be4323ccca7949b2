//! `infer` on the three kinds of served models:
//! - the image ensemble (`RAW_IMAGE`: UINT8 `[N, L]` zero-padded encoded images, or BYTES
//!   `[N]`) runs the same pipeline as `/predict`: decode pool, then the classifier's queue;
//! - a classifier takes its FP32 `[N, 3, H, W]` input as is;
//! - the preprocessor alone returns the normalized FP32 `[N, 3, H, W]` rows.
//!
//! The protocol has no per-row errors: a row that cannot be decoded fails the request with
//! `InvalidInput` naming the row. Batches are not limited to `max_batch_size`: the
//! scheduler cuts a large request into batches that run on every instance.
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use ndarray::Axis;

use super::tensor::{encode_bytes_elements, split_bytes_elements};
use super::{resolve, DataType, InputTensor};
use crate::domain::{Normalize, RequestOptions};
use crate::engine::OutputRequest;
use crate::error::{ErrorKind, GatewayError};
use crate::preprocess::{PreprocessError, PreprocessSettings, Row};
use crate::repository::{ModelKind, RepositoryModel};
use crate::scheduler::{InferJob, JobResult, ModelHandle, RowFormat, RowOutput};
use crate::state::{AppState, ServedModel};

/// One requested output; `classification: Some(k)` asks for the top k classes as BYTES
/// `"score:index:label"` instead of the tensor (Triton's classification extension).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestedOutput {
    pub name: String,
    pub classification: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct InferRequest {
    pub model: String,
    pub version: Option<String>,
    pub id: String,
    pub inputs: Vec<InputTensor>,
    /// Empty: every output of the model.
    pub outputs: Vec<RequestedOutput>,
    pub options: RequestOptions,
}

#[derive(Debug, Clone, PartialEq)]
pub struct OutputTensor {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<i64>,
    /// Raw form (little-endian; BYTES length-prefixed).
    pub data: Vec<u8>,
}

#[derive(Debug, Clone)]
pub struct InferResponse {
    pub model: String,
    pub version: String,
    pub id: String,
    pub outputs: Vec<OutputTensor>,
}

fn invalid(message: String) -> GatewayError {
    GatewayError::new(ErrorKind::InvalidInput, message)
}

/// Rows decoded per job while the rest still decode (as `/predict` streams its upload).
const CHUNK_ROWS: usize = 8;

pub async fn infer(state: &AppState, req: InferRequest) -> Result<InferResponse, GatewayError> {
    // The model first: an unknown model is NOT_FOUND whatever its inputs look like.
    let served = resolve(state, &req.model, req.version.as_deref())?;
    let model = served.repository_model();
    if !served.is_ready() {
        return Err(GatewayError::new(
            ErrorKind::NotReady,
            format!("model '{}' is not ready", req.model),
        ));
    }
    let (input_name, output_name) = io_names(model);
    let input = single_input(&req, model, input_name)?;
    let wanted = requested_outputs(&req, model, output_name)?;
    let outputs = match &served {
        ServedModel::Ensemble { pipeline, .. } => {
            let images = encoded_images(input, &req.model)?;
            let logits = classify_decoding(
                &pipeline.classifier,
                decode_in_order(state, &pipeline.preprocess, &images),
                RowNames {
                    model: &req.model,
                    input: &input.name,
                },
                RowFormat::Image(pipeline.normalize),
                req.options,
            )
            .await?;
            logits_outputs(&wanted, &logits, pipeline.labels.as_deref())
        }
        ServedModel::Classifier { handle, .. } => {
            let ModelKind::Classifier(spec) = &model.kind else {
                unreachable!("a served classifier is a classifier in the repository")
            };
            let rows = tensor_rows(input, &req.model, spec.height, spec.width)?;
            let logits = classify_rows(handle, rows, RowFormat::TensorF32, req.options).await?;
            logits_outputs(&wanted, &logits, spec.labels.as_deref())
        }
        ServedModel::Preprocessor {
            preprocess,
            normalize,
            ..
        } => {
            let images = encoded_images(input, &req.model)?;
            let names = RowNames {
                model: &req.model,
                input: &input.name,
            };
            let decoding = decode_in_order(state, preprocess, &images).enumerate();
            let mut decoding = std::pin::pin!(decoding);
            let mut rows = Vec::with_capacity(images.len());
            while let Some((i, got)) = decoding.next().await {
                rows.push(names.row(i, got)?);
            }
            preprocessed_outputs(&wanted, &rows, preprocess, normalize, &req.model)?
        }
    };
    Ok(InferResponse {
        model: req.model.clone(),
        version: model.version.to_string(),
        id: req.id,
        outputs,
    })
}

/// The model's one input and one output, by the names in its config.
fn io_names(model: &RepositoryModel) -> (&str, &str) {
    match &model.kind {
        ModelKind::Classifier(s) => (&s.input_name, &s.output_name),
        ModelKind::Preprocessor(s) => (&s.input_name, &s.output_name),
        ModelKind::Ensemble(s) => (&s.input_name, &s.output_name),
    }
}

fn single_input<'a>(
    req: &'a InferRequest,
    model: &RepositoryModel,
    name: &str,
) -> Result<&'a InputTensor, GatewayError> {
    if let Some(other) = req.inputs.iter().find(|i| i.name != name) {
        return Err(invalid(format!(
            "unexpected inference input '{}' for model '{}': its only input is '{name}'",
            other.name, model.name
        )));
    }
    let input = match req.inputs.as_slice() {
        [one] => one,
        [] => {
            return Err(invalid(format!(
                "missing input '{name}' for model '{}'",
                model.name
            )))
        }
        _ => {
            return Err(invalid(format!(
                "input '{name}' given more than once for model '{}'",
                model.name
            )))
        }
    };
    input
        .check_size()
        .map_err(|e| invalid(format!("input '{name}' of model '{}' {e}", model.name)))?;
    Ok(input)
}

/// What each requested output wants (the model's only output unless none is named).
fn requested_outputs(
    req: &InferRequest,
    model: &RepositoryModel,
    name: &str,
) -> Result<Vec<RequestedOutput>, GatewayError> {
    if req.outputs.is_empty() {
        return Ok(vec![RequestedOutput {
            name: name.to_string(),
            classification: None,
        }]);
    }
    for o in &req.outputs {
        if o.name != name {
            return Err(invalid(format!(
                "unexpected inference output '{}' for model '{}': its only output is '{name}'",
                o.name, model.name
            )));
        }
        if o.classification == Some(0) {
            return Err(invalid(format!(
                "output '{name}': classification must ask for at least 1 class"
            )));
        }
    }
    Ok(req.outputs.clone())
}

/// The encoded images of a `RAW_IMAGE` input: the rows of UINT8 `[N, L]` (zero padding
/// after an image's end is left to the decoder, which stops at the image's end marker) or
/// the elements of BYTES `[N]` / `[N, 1]`.
fn encoded_images(input: &InputTensor, model: &str) -> Result<Vec<Bytes>, GatewayError> {
    let shape_err = || {
        invalid(format!(
            "input '{}' of model '{model}' must be UINT8 [N, L] (encoded images, zero-padded \
             to one length) or BYTES [N]; got {} {:?}",
            input.name, input.datatype, input.shape
        ))
    };
    let images: Vec<Bytes> = match (input.datatype, input.shape.as_slice()) {
        (DataType::Uint8, &[n, len]) if n > 0 && len > 0 => {
            let len = len as usize;
            (0..n as usize)
                .map(|i| input.data.slice(i * len..(i + 1) * len))
                .collect()
        }
        (DataType::Bytes, &[n] | &[n, 1]) if n > 0 => split_bytes_elements(&input.data)
            .map_err(|e| invalid(format!("input '{}': {e}", input.name)))?
            .into_iter()
            .map(|e| input.data.slice_ref(e))
            .collect(),
        _ => return Err(shape_err()),
    };
    Ok(images)
}

/// Images in flight on the decode pool at once for one request: enough to keep every
/// decode thread busy, few enough that a large request does not crowd out others.
const DECODE_AHEAD: usize = 32;

type Decoded = Result<Result<Row, PreprocessError>, tokio::sync::oneshot::error::RecvError>;

/// Each image decoded on the pool, yielded in order as soon as it and those before it are
/// done.
fn decode_in_order<'a>(
    state: &'a AppState,
    settings: &Arc<PreprocessSettings>,
    images: &'a [Bytes],
) -> impl futures_util::Stream<Item = Decoded> + 'a {
    let settings = settings.clone();
    futures_util::stream::iter(images)
        .map(move |image| {
            let settings = settings.clone();
            async move { state.pool.submit(image.clone(), settings).await.await }
        })
        .buffered(DECODE_AHEAD)
}

/// Says which row of which input failed to decode.
struct RowNames<'a> {
    model: &'a str,
    input: &'a str,
}

impl RowNames<'_> {
    fn row(&self, i: usize, got: Decoded) -> Result<Row, GatewayError> {
        match got {
            Ok(Ok(row)) => Ok(row),
            Ok(Err(e)) => Err(invalid(format!(
                "input '{}' of model '{}', row {i}: {e}",
                self.input, self.model
            ))),
            Err(_) => Err(GatewayError::new(
                ErrorKind::NotReady,
                "the decode pool is shutting down",
            )),
        }
    }
}

const LOGITS: OutputRequest = OutputRequest {
    top_k: 0,
    logits: true,
};

/// Runs ready rows (the caller's tensors) through the classifier; each row's logits.
async fn classify_rows(
    handle: &ModelHandle,
    rows: Vec<Row>,
    format: RowFormat,
    options: RequestOptions,
) -> Result<Vec<Vec<f32>>, GatewayError> {
    let job = InferJob {
        rows,
        format,
        want: LOGITS,
    };
    logits_of(handle.infer(job, options).await?)
}

/// Runs images through the classifier as they decode: rows enter its queue in chunks, so
/// inference of the first overlaps decoding of the rest. A row that fails to decode fails
/// the request (its queued chunks are dropped unrun).
async fn classify_decoding(
    handle: &ModelHandle,
    decoding: impl futures_util::Stream<Item = Decoded>,
    names: RowNames<'_>,
    format: RowFormat,
    options: RequestOptions,
) -> Result<Vec<Vec<f32>>, GatewayError> {
    let mut admission = handle.admit(options)?;
    let mut chunks = Vec::new();
    let mut chunk = Vec::with_capacity(CHUNK_ROWS);
    let mut decoding = std::pin::pin!(decoding.enumerate());
    while let Some((i, got)) = decoding.next().await {
        let row = match names.row(i, got) {
            Ok(row) => row,
            Err(e) => {
                drop(chunks);
                admission.abandon();
                return Err(e);
            }
        };
        chunk.push(row);
        if chunk.len() == CHUNK_ROWS {
            chunks.push(
                admission
                    .submit(job(std::mem::take(&mut chunk), format))
                    .await,
            );
        }
    }
    if !chunk.is_empty() {
        chunks.push(admission.submit(job(chunk, format)).await);
    }
    admission.all_submitted();
    let mut all: JobResult = Ok(Vec::new());
    for chunk in chunks {
        let result = match chunk {
            Ok(pending) => pending.wait(handle.name().as_str()).await,
            Err(e) => Err(e),
        };
        match (&mut all, result) {
            (Ok(all), Ok(rows)) => all.extend(rows),
            (Ok(_), Err(e)) => all = Err(e),
            (Err(_), _) => {}
        }
    }
    admission.finish(&all);
    logits_of(all?)
}

fn job(rows: Vec<Row>, format: RowFormat) -> InferJob {
    InferJob {
        rows,
        format,
        want: LOGITS,
    }
}

fn logits_of(outputs: Vec<RowOutput>) -> Result<Vec<Vec<f32>>, GatewayError> {
    outputs
        .into_iter()
        .map(|o| {
            o.logits.ok_or_else(|| {
                GatewayError::new(ErrorKind::Internal, "the classifier returned no logits")
            })
        })
        .collect()
}

/// The classifier's FP32 `[N, 3, H, W]` input cut into rows (their raw bytes are already
/// the little-endian f32 layout the instances read).
fn tensor_rows(
    input: &InputTensor,
    model: &str,
    height: usize,
    width: usize,
) -> Result<Vec<Row>, GatewayError> {
    let expected = [3, height as i64, width as i64];
    match (input.datatype, input.shape.as_slice()) {
        (DataType::Fp32, [n, rest @ ..]) if *n > 0 && rest == expected => {}
        _ => {
            return Err(invalid(format!(
                "input '{}' of model '{model}' must be FP32 [N, 3, {height}, {width}]; got {} {:?}",
                input.name, input.datatype, input.shape
            )))
        }
    }
    let row_bytes = 3 * height * width * 4;
    Ok(input
        .data
        .chunks_exact(row_bytes)
        .map(<[u8]>::to_vec)
        .collect())
}

/// The requested outputs from each row's logits: the FP32 `[N, C]` tensor, or with
/// classification BYTES `[N, k]` of `"score:index:label"` (score: the output's value, as
/// Triton reports it; the label when the model has a label file).
fn logits_outputs(
    wanted: &[RequestedOutput],
    logits: &[Vec<f32>],
    labels: Option<&Vec<String>>,
) -> Vec<OutputTensor> {
    let n = logits.len();
    let classes = logits.first().map_or(0, Vec::len);
    wanted
        .iter()
        .map(|w| match w.classification {
            None => OutputTensor {
                name: w.name.clone(),
                datatype: DataType::Fp32,
                shape: vec![n as i64, classes as i64],
                data: logits
                    .iter()
                    .flatten()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            },
            Some(k) => {
                let k = k.min(classes);
                let mut elements = Vec::with_capacity(n * k);
                for row in logits {
                    elements.extend(top_k(row, k).into_iter().map(|i| {
                        let label = labels.and_then(|l| l.get(i));
                        match label {
                            Some(l) => format!("{:.6}:{i}:{l}", row[i]),
                            None => format!("{:.6}:{i}", row[i]),
                        }
                    }));
                }
                OutputTensor {
                    name: w.name.clone(),
                    datatype: DataType::Bytes,
                    shape: vec![n as i64, k as i64],
                    data: encode_bytes_elements(elements.iter().map(String::as_bytes)),
                }
            }
        })
        .collect()
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// The preprocessor's output: each u8 HWC row as normalized FP32 CHW.
fn preprocessed_outputs(
    wanted: &[RequestedOutput],
    rows: &[Row],
    settings: &PreprocessSettings,
    normalize: &Normalize,
    model: &str,
) -> Result<Vec<OutputTensor>, GatewayError> {
    let (h, w) = (settings.height as usize, settings.width as usize);
    if wanted.iter().any(|o| o.classification.is_some()) {
        return Err(invalid(format!(
            "model '{model}' has no class scores: classification is not available"
        )));
    }
    let mut data = Vec::with_capacity(rows.len() * 3 * h * w * 4);
    for row in rows {
        let hwc = ndarray::ArrayView3::from_shape((h, w, 3), row.as_slice())
            .map_err(|e| GatewayError::new(ErrorKind::Internal, e.to_string()))?;
        for c in 0..3 {
            let (mean, std) = (normalize.mean[c], normalize.std[c]);
            for v in hwc.index_axis(Axis(2), c).iter() {
                data.extend_from_slice(&((*v as f32 / 255.0 - mean) / std).to_le_bytes());
            }
        }
    }
    Ok(wanted
        .iter()
        .map(|o| OutputTensor {
            name: o.name.clone(),
            datatype: DataType::Fp32,
            shape: vec![rows.len() as i64, 3, h as i64, w as i64],
            data: data.clone(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_is_largest_first_with_ties_by_index() {
        assert_eq!(top_k(&[0.1, 0.9, 0.5, 0.9], 3), vec![1, 3, 2]);
        assert_eq!(top_k(&[1.0], 5), vec![0]);
    }

    #[test]
    fn classification_formats_score_index_label() {
        let labels = vec!["cat".to_string(), "dog".to_string(), "cow".to_string()];
        let wanted = [RequestedOutput {
            name: "out".into(),
            classification: Some(2),
        }];
        let out = logits_outputs(&wanted, &[vec![1.5, -2.0, 3.25]], Some(&labels));
        assert_eq!(out[0].datatype, DataType::Bytes);
        assert_eq!(out[0].shape, vec![1, 2]);
        let elements = split_bytes_elements(&out[0].data).unwrap();
        assert_eq!(elements, vec![&b"3.250000:2:cow"[..], b"1.500000:0:cat"]);
        let out = logits_outputs(&wanted, &[vec![1.5, -2.0, 3.25]], None);
        let elements = split_bytes_elements(&out[0].data).unwrap();
        assert_eq!(elements[0], b"3.250000:2");
    }

    #[test]
    fn logits_are_fp32_rows() {
        let wanted = [RequestedOutput {
            name: "out".into(),
            classification: None,
        }];
        let out = logits_outputs(&wanted, &[vec![1.0, 2.0], vec![3.0, 4.0]], None);
        assert_eq!(out[0].shape, vec![2, 2]);
        let values: Vec<f32> = out[0]
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(values, vec![1.0, 2.0, 3.0, 4.0]);
    }
}
