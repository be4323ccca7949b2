//! `infer` on the three kinds of served models:
//! - the image ensemble (`RAW_IMAGE`: UINT8 `[N, L]` zero-padded encoded images, or BYTES
//!   `[N]`) runs the same pipeline as `/predict`: decode pool, then the classifier's queue;
//! - a classifier takes its FP32 `[N, 3, H, W]` input as is;
//! - the preprocessor alone returns the normalized FP32 `[N, 3, H, W]` rows.
//!
//! The protocol has no per-row errors: a row that cannot be decoded fails the request with
//! `InvalidInput` naming the row. Batches are not limited to `max_batch_size`: the
//! scheduler cuts a large request into batches that run on every instance.
use crate::trace::Trace;
use bytes::Bytes;
use futures_util::StreamExt;

use super::tensor::encode_bytes_elements;
use super::{DataType, InputTensor};
use crate::domain::{Normalize, RequestOptions};
use crate::engine::OutputRequest;
use crate::error::{ErrorKind, GatewayError, HasKind};
use crate::pipeline::{self, Encoded};
use crate::preprocess::{PreprocessError, PreprocessSettings, Row};
use crate::repository::{ModelKind, RepositoryModel};
use crate::scheduler::{RequestSpec, RowFormat, RowIn, RowOutput, RunError, RunResult, Together};
use crate::shm::ShmRef;
use crate::state::{AppState, ServedModel};

/// One requested output; `classification: Some(k)` asks for the top k classes as BYTES
/// `"score:index:label"` instead of the tensor (Triton's classification extension).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestedOutput {
    pub name: String,
    pub classification: Option<usize>,
    /// Written to this place in system shared memory instead of the response.
    pub shared_memory: Option<ShmRef>,
}

#[derive(Debug, Clone)]
pub struct InferRequest {
    pub model: String,
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
    /// Raw form (little-endian; BYTES length-prefixed); empty when in shared memory.
    pub data: Vec<u8>,
    /// Where the data was written, for an output asked in shared memory.
    pub shared_memory: Option<ShmRef>,
}

#[derive(Debug, Clone)]
pub struct InferResponse {
    pub model: String,
    pub version: String,
    pub id: String,
    pub outputs: Vec<OutputTensor>,
}

/// An image row that cannot be used: the protocol has no per-row errors, so it fails the
/// request, naming the row.
#[derive(Debug, thiserror::Error)]
#[error("input '{input}' of model '{model}', row {row}: {error}")]
struct BadRow {
    input: String,
    model: String,
    row: usize,
    error: PreprocessError,
}

impl BadRow {
    fn new(input: &str, model: &str, row: usize, error: PreprocessError) -> Self {
        BadRow {
            input: input.to_string(),
            model: model.to_string(),
            row,
            error,
        }
    }
}

/// Too large an image is too large a payload (413); any other unusable image is invalid
/// input.
impl HasKind for BadRow {
    fn kind(&self) -> ErrorKind {
        match self.error.kind() {
            ErrorKind::PayloadTooLarge => ErrorKind::PayloadTooLarge,
            _ => ErrorKind::InvalidInput,
        }
    }
}

/// Runs `req` on `served` (the model the transport resolved from the request's name and
/// version), recording into its `trace` where it is sampled.
pub async fn infer(
    state: &AppState,
    served: &ServedModel,
    mut req: InferRequest,
    trace: Option<&Trace>,
) -> Result<InferResponse, GatewayError> {
    let model = served.repository_model();
    let (input_name, output_name) = io_names(model);
    let wanted = requested_outputs(&req, model, output_name)?;
    // Output regions are found and checked before anything runs, and kept to the end.
    let places = super::shm::output_places(state, &wanted)?;
    let input = single_input(&mut req, model, input_name)?;
    super::shm::read_input(state, input, model.name.as_str()).await?;
    input.check_size().map_err(|e| {
        GatewayError::invalid(format!(
            "input '{input_name}' of model '{}' {e}",
            model.name
        ))
    })?;
    let input = &req.inputs[0];
    let max_rows = RowLimit {
        rows: state.limits.max_files,
        why: "--max-files",
        kind: ErrorKind::InvalidInput,
    };
    let want = output_request(&wanted);
    let mut outputs = match served {
        ServedModel::Ensemble { pipeline, .. } => {
            let images = image_rows(input, &req.model, max_rows)?;
            let images = images.map(|bytes| Encoded {
                tag: (),
                image: Ok(bytes),
            });
            // The protocol has no per-row errors: a bad image fails the request, naming it.
            let rows = pipeline
                .classify(
                    &state.pool,
                    req.options,
                    want,
                    Together,
                    futures_util::stream::iter(images),
                    std::future::pending(),
                    trace,
                )
                .await;
            let rows = answered(rows, &input.name, &req.model)?;
            classifier_outputs(&wanted, &rows, pipeline.labels.as_deref())?
        }
        ServedModel::Classifier { handle, .. } => {
            let ModelKind::Classifier(spec) = &model.kind else {
                unreachable!("a served classifier is a classifier in the repository")
            };
            let rows = tensor_rows(input, &req.model, spec.height, spec.width, max_rows)?;
            let request = RequestSpec {
                options: req.options,
                format: RowFormat::TensorF32,
                want,
                trace: trace.cloned(),
            };
            let rows = futures_util::stream::iter(rows).map(|row| RowIn::Row((), row));
            let rows = handle.run(request, Together, rows).await;
            let rows = answered(rows, &input.name, &req.model)?;
            classifier_outputs(&wanted, &rows, spec.labels.as_deref())?
        }
        ServedModel::Preprocessor {
            preprocess,
            normalize,
            ..
        } => {
            // Its rows and their FP32 output are held at once: as Triton, it takes at most
            // its max_batch_size rows, and no more than --max-batch-bytes holds (413).
            let ModelKind::Preprocessor(spec) = &model.kind else {
                unreachable!("a served preprocessor is one")
            };
            let by_config = usize::try_from(model.config.max_batch_size.max(1)).unwrap_or(1);
            let limit = if spec.batch_rows < by_config.min(max_rows.rows) {
                RowLimit {
                    rows: spec.batch_rows,
                    why: "the FP32 outputs --max-batch-bytes holds",
                    kind: ErrorKind::PayloadTooLarge,
                }
            } else if by_config < max_rows.rows {
                RowLimit {
                    rows: by_config,
                    why: "the preprocessor's max_batch_size",
                    kind: ErrorKind::InvalidInput,
                }
            } else {
                max_rows
            };
            let images = image_rows(input, &req.model, limit)?;
            let rows =
                decode_all(state, preprocess, images, &input.name, &req.model, trace).await?;
            preprocessed_outputs(&wanted, &rows, preprocess, normalize, &req.model)?
        }
    };
    super::shm::write_outputs(places, &mut outputs).await?;
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

/// The model's one input, once its name and count are checked (its data not yet).
fn single_input<'a>(
    req: &'a mut InferRequest,
    model: &RepositoryModel,
    name: &str,
) -> Result<&'a mut InputTensor, GatewayError> {
    if let Some(other) = req.inputs.iter().find(|i| i.name != name) {
        return Err(GatewayError::invalid(format!(
            "unexpected inference input '{}' for model '{}': its only input is '{name}'",
            other.name, model.name
        )));
    }
    let input = match req.inputs.as_mut_slice() {
        [one] => one,
        [] => {
            return Err(GatewayError::invalid(format!(
                "missing input '{name}' for model '{}'",
                model.name
            )))
        }
        _ => {
            return Err(GatewayError::invalid(format!(
                "input '{name}' given more than once for model '{}'",
                model.name
            )))
        }
    };
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
            shared_memory: None,
        }]);
    }
    for o in &req.outputs {
        if o.name != name {
            return Err(GatewayError::invalid(format!(
                "unexpected inference output '{}' for model '{}': its only output is '{name}'",
                o.name, model.name
            )));
        }
        if o.classification == Some(0) {
            return Err(GatewayError::invalid(format!(
                "output '{name}': classification must ask for at least 1 class"
            )));
        }
    }
    // As Triton: each output once (a repeated one would multiply the response, not the work).
    if req.outputs.len() > 1 {
        return Err(GatewayError::invalid(format!(
            "output '{name}' is requested {} times: ask for each output once",
            req.outputs.len()
        )));
    }
    Ok(req.outputs.clone())
}

/// The most rows one request may carry, and what sets it.
#[derive(Debug, Clone, Copy)]
pub struct RowLimit {
    pub rows: usize,
    pub why: &'static str,
    /// How a request over it is refused: `InvalidInput` where the protocol sets the limit
    /// (Triton's), `PayloadTooLarge` where the server's memory bound does.
    pub kind: ErrorKind,
}

impl RowLimit {
    /// Refuses a request of more than `rows` rows before any is read.
    fn check(self, input: &InputTensor, model: &str, rows: usize) -> Result<(), GatewayError> {
        if rows > self.rows {
            return Err(GatewayError::new(
                self.kind,
                format!(
                    "input '{}' of model '{model}' has {rows} rows; one request may carry at \
                     most {} ({})",
                    input.name, self.rows, self.why
                ),
            ));
        }
        Ok(())
    }
}

/// The encoded images of a `RAW_IMAGE` input (its size already checked against its shape):
/// the rows of UINT8 `[N, L]` (zero padding after an image's end is left to the decoder,
/// which stops at the image's end marker) or the elements of BYTES `[N]` / `[N, 1]`. They
/// are cut one at a time as the pipeline takes them.
pub fn image_rows(
    input: &InputTensor,
    model: &str,
    max_rows: RowLimit,
) -> Result<ImageRows, GatewayError> {
    let (rows, row_len) = match (input.datatype, input.shape.as_slice()) {
        (DataType::Uint8, &[n, len]) if n > 0 && len > 0 => (n, Some(len as usize)),
        (DataType::Bytes, &[n] | &[n, 1]) if n > 0 => (n, None),
        _ => {
            return Err(GatewayError::invalid(format!(
                "input '{}' of model '{model}' must be UINT8 [N, L] (encoded images, \
                 zero-padded to one length) or BYTES [N]; got {} {:?}",
                input.name, input.datatype, input.shape
            )))
        }
    };
    let rows = usize::try_from(rows).unwrap_or(usize::MAX);
    max_rows.check(input, model, rows)?;
    Ok(ImageRows {
        data: input.data.clone(),
        row_len,
        offset: 0,
        left: rows,
    })
}

/// The rows of an image input, cut as they are taken (slices of the request's data).
pub struct ImageRows {
    data: Bytes,
    /// UINT8 rows' length; `None`: BYTES elements, each with its 4-byte length.
    row_len: Option<usize>,
    offset: usize,
    left: usize,
}

impl Iterator for ImageRows {
    type Item = Bytes;

    fn next(&mut self) -> Option<Bytes> {
        if self.left == 0 {
            return None;
        }
        let (start, len) = match self.row_len {
            Some(len) => (self.offset, len),
            None => {
                let prefix = self.data.get(self.offset..self.offset.checked_add(4)?)?;
                let len = u32::from_le_bytes(prefix.try_into().ok()?) as usize;
                (self.offset + 4, len)
            }
        };
        let end = start
            .checked_add(len)
            .filter(|&end| end <= self.data.len())?;
        self.offset = end;
        self.left -= 1;
        Some(self.data.slice(start..end))
    }
}

/// The preprocessor model alone: every image decoded on the pool, in order; the first that
/// fails fails the request, naming its row.
async fn decode_all(
    state: &AppState,
    settings: &std::sync::Arc<PreprocessSettings>,
    images: ImageRows,
    input: &str,
    model: &str,
    trace: Option<&Trace>,
) -> Result<Vec<Bytes>, GatewayError> {
    let n = images.left;
    let images = futures_util::stream::iter(images.enumerate()).map(|(i, bytes)| Encoded {
        tag: i,
        image: Ok(bytes),
    });
    // Decoded here whatever the classifier's instances do: the output is the host's tensor.
    let decoding = pipeline::decode(&state.pool, settings, false, images, trace.cloned());
    let mut decoding = std::pin::pin!(decoding);
    let mut rows = Vec::with_capacity(n);
    while let Some(decoded) = decoding.next().await {
        let (i, row) = decoded?;
        match row.map_err(|error| BadRow::new(input, model, i, error))? {
            Row::Bytes(pixels) => rows.push(pixels),
            Row::Jpeg(_) => {
                return Err(GatewayError::new(
                    ErrorKind::Internal,
                    "the preprocessor's decode passed a JPEG on undecoded",
                ))
            }
        }
    }
    Ok(rows)
}

/// Every row's output of a request whose rows fail together (the protocol has no per-row
/// errors), or its error, an unusable row named by its place.
fn answered(
    rows: RunResult<(), Together>,
    input: &str,
    model: &str,
) -> Result<Vec<RowOutput>, GatewayError> {
    match rows {
        Ok(rows) => Ok(rows.into_iter().map(|((), output)| output).collect()),
        Err(RunError::Unusable { row, error }) => Err(BadRow::new(input, model, row, error).into()),
        Err(e) => Err(e.into()),
    }
}

/// What the engine computes for `wanted`: the logits for a tensor output, the top k classes
/// for classification.
fn output_request(wanted: &[RequestedOutput]) -> OutputRequest {
    wanted.iter().fold(OutputRequest::default(), |w, o| {
        w.merge(match o.classification {
            Some(k) => OutputRequest::classes(k),
            None => OutputRequest {
                logits: true,
                ..OutputRequest::default()
            },
        })
    })
}

/// The classifier's FP32 `[N, 3, H, W]` input cut into rows (their raw bytes are already
/// the little-endian f32 layout the instances read).
fn tensor_rows(
    input: &InputTensor,
    model: &str,
    height: usize,
    width: usize,
    max_rows: RowLimit,
) -> Result<Vec<Row>, GatewayError> {
    let expected = [3, height as i64, width as i64];
    match (input.datatype, input.shape.as_slice()) {
        (DataType::Fp32, [n, rest @ ..]) if *n > 0 && rest == expected => {
            max_rows.check(input, model, usize::try_from(*n).unwrap_or(usize::MAX))?;
        }
        _ => {
            return Err(GatewayError::invalid(format!(
                "input '{}' of model '{model}' must be FP32 [N, 3, {height}, {width}]; got {} {:?}",
                input.name, input.datatype, input.shape
            )))
        }
    }
    // Slices of the request's data: converted to f32 once, where the batch is assembled.
    let row_bytes = 3 * height * width * 4;
    Ok((0..input.data.len() / row_bytes)
        .map(|i| Row::Bytes(input.data.slice(i * row_bytes..(i + 1) * row_bytes)))
        .collect())
}

/// The requested outputs from the classifier's rows: the FP32 `[N, C]` logits, or with
/// classification BYTES `[N, k]` of `"score:index:label"` from the engine's top k (score:
/// the output's value, as Triton reports it; the label when the model has a label file).
fn classifier_outputs(
    wanted: &[RequestedOutput],
    rows: &[RowOutput],
    labels: Option<&Vec<String>>,
) -> Result<Vec<OutputTensor>, GatewayError> {
    let n = rows.len() as i64;
    wanted
        .iter()
        .map(|w| match w.classification {
            None => {
                let mut data = Vec::new();
                let mut classes = 0;
                for row in rows {
                    let logits = row.logits.as_ref().ok_or_else(|| {
                        GatewayError::new(ErrorKind::Internal, "the classifier returned no logits")
                    })?;
                    classes = logits.len();
                    data.extend(logits.iter().flat_map(|v| v.to_le_bytes()));
                }
                Ok(OutputTensor {
                    name: w.name.clone(),
                    datatype: DataType::Fp32,
                    shape: vec![n, classes as i64],
                    data,
                    shared_memory: None,
                })
            }
            Some(k) => {
                let mut elements = Vec::new();
                let mut width = 0;
                for row in rows {
                    let top = &row.top.classes()[..k.min(row.top.classes().len())];
                    width = top.len();
                    elements.extend(top.iter().map(|c| {
                        let (i, value) = (c.class_id, c.value);
                        match labels.and_then(|l| l.get(i as usize)) {
                            Some(l) => format!("{value:.6}:{i}:{l}"),
                            None => format!("{value:.6}:{i}"),
                        }
                    }));
                }
                Ok(OutputTensor {
                    name: w.name.clone(),
                    datatype: DataType::Bytes,
                    shape: vec![n, width as i64],
                    data: encode_bytes_elements(elements.iter().map(String::as_bytes)),
                    shared_memory: None,
                })
            }
        })
        .collect()
}

/// The preprocessor's output: each u8 HWC row as normalized FP32 CHW.
fn preprocessed_outputs(
    wanted: &[RequestedOutput],
    rows: &[Bytes],
    settings: &PreprocessSettings,
    normalize: &Normalize,
    model: &str,
) -> Result<Vec<OutputTensor>, GatewayError> {
    let (h, w) = (settings.height as usize, settings.width as usize);
    if wanted.iter().any(|o| o.classification.is_some()) {
        return Err(GatewayError::invalid(format!(
            "model '{model}' has no class scores: classification is not available"
        )));
    }
    let pixels: Vec<u8> = rows.iter().flat_map(|row| row.iter().copied()).collect();
    let data: Vec<u8> = crate::engine::normalize_on_cpu(&pixels, h, w, *normalize)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    Ok(wanted
        .iter()
        .map(|o| OutputTensor {
            name: o.name.clone(),
            datatype: DataType::Fp32,
            shape: vec![rows.len() as i64, 3, h as i64, w as i64],
            data: data.clone(),
            shared_memory: None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{ClassScore, Ranked};

    fn row(top: &[(u32, f32)], logits: &[f32]) -> RowOutput {
        RowOutput {
            top: Ranked::new(
                top.iter()
                    .map(|&(class_id, value)| ClassScore {
                        class_id,
                        score: 0.5,
                        value,
                    })
                    .collect(),
            )
            .unwrap(),
            logits: Some(logits.to_vec()),
        }
    }

    #[test]
    fn classification_formats_score_index_label() {
        let labels = vec!["cat".to_string(), "dog".to_string(), "cow".to_string()];
        let wanted = [RequestedOutput {
            name: "out".into(),
            classification: Some(2),
            shared_memory: None,
        }];
        let rows = [row(&[(2, 3.25), (0, 1.5)], &[1.5, -2.0, 3.25])];
        let out = classifier_outputs(&wanted, &rows, Some(&labels)).unwrap();
        assert_eq!(out[0].datatype, DataType::Bytes);
        assert_eq!(out[0].shape, vec![1, 2]);
        let elements: Vec<_> = crate::kserve::bytes_elements(&out[0].data).collect();
        assert_eq!(elements, vec![&b"3.250000:2:cow"[..], b"1.500000:0:cat"]);
        let out = classifier_outputs(&wanted, &rows, None).unwrap();
        let elements: Vec<_> = crate::kserve::bytes_elements(&out[0].data).collect();
        assert_eq!(elements[0], b"3.250000:2");
    }

    #[test]
    fn logits_are_fp32_rows() {
        let wanted = [RequestedOutput {
            name: "out".into(),
            classification: None,
            shared_memory: None,
        }];
        let rows = [row(&[(1, 2.0)], &[1.0, 2.0]), row(&[(1, 4.0)], &[3.0, 4.0])];
        let out = classifier_outputs(&wanted, &rows, None).unwrap();
        assert_eq!(out[0].shape, vec![2, 2]);
        let values: Vec<f32> = out[0]
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(values, vec![1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn classification_and_logits_together_ask_the_engine_for_both() {
        let wanted = [
            RequestedOutput {
                name: "out".into(),
                classification: Some(3),
                shared_memory: None,
            },
            RequestedOutput {
                name: "out".into(),
                classification: None,
                shared_memory: None,
            },
        ];
        assert_eq!(
            output_request(&wanted),
            OutputRequest {
                logits: true,
                ..OutputRequest::classes(3)
            }
        );
    }
}
