//! The image ensemble: encoded images are decoded on the pool, a bounded window ahead, and
//! their rows enter the classifier's queue as they are ready, so inference of the first
//! overlaps decoding (and uploading) of the rest. `/predict` and KServe's ensemble models
//! both run this one pipeline; they differ only in what a bad image does (an error entry of
//! its own, or the whole request's error).
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};

use crate::domain::{ModelName, ModelVersion, Normalize, RequestOptions};
use crate::engine::OutputRequest;
use crate::error::{ErrorKind, GatewayError};
use crate::preprocess::{PreprocessError, PreprocessPool, PreprocessSettings, Row};
use crate::scheduler::{ModelHandle, RequestSpec, RowError, RowFormat, RowIn, RunResult};

/// What an image ensemble needs to serve requests end to end.
#[derive(Clone)]
pub struct ImagePipeline {
    pub name: ModelName,
    pub version: ModelVersion,
    pub preprocess: Arc<PreprocessSettings>,
    pub normalize: Normalize,
    pub classifier: ModelHandle,
    pub num_classes: usize,
    pub labels: Option<Arc<Vec<String>>>,
}

/// One image of a request as it arrives.
pub enum Encoded {
    Image(Bytes),
    /// Unusable before decoding (empty, over the size limit).
    Failed(PreprocessError),
}

/// Images in flight on the decode pool at once for one request: enough to keep every
/// decode thread busy, few enough that a large request does not crowd out others.
pub const DECODE_AHEAD: usize = 32;

impl ImagePipeline {
    /// Classifies `images` in order. `bad_image(row, error)` says what an image that cannot
    /// be used becomes: `RowIn::Failed` (an error entry of its own) or `RowIn::Abort` (the
    /// request's error); `F` says the same of rows whose batch the model failed. If `abort` resolves first, the request ends with its error at once,
    /// ahead of the images still decoding.
    pub async fn classify<F: RowError>(
        &self,
        pool: &PreprocessPool,
        options: RequestOptions,
        want: OutputRequest,
        images: impl Stream<Item = Encoded>,
        abort: impl Future<Output = GatewayError>,
        bad_image: impl Fn(usize, PreprocessError) -> RowIn<F>,
    ) -> RunResult<F> {
        let rows = decode(pool, &self.preprocess, images)
            .enumerate()
            .map(|(i, decoded)| match decoded {
                Ok(Ok(row)) => RowIn::Row(row),
                Ok(Err(e)) => bad_image(i, e),
                Err(e) => RowIn::Abort(e),
            });
        let spec = RequestSpec {
            options,
            format: RowFormat::Image(self.normalize),
            want,
        };
        self.classifier.run(spec, abortable(rows, abort)).await
    }
}

/// Each image decoded on the pool, `DECODE_AHEAD` at a time, yielded in order as soon as it
/// and those before it are done: its row, or why it cannot be used (`Err`: the pool stopped).
pub fn decode<'a>(
    pool: &'a PreprocessPool,
    settings: &'a Arc<PreprocessSettings>,
    images: impl Stream<Item = Encoded> + 'a,
) -> impl Stream<Item = Result<Result<Row, PreprocessError>, GatewayError>> + 'a {
    // The request's own flow: the pool takes its images in turn with other requests'.
    let flow = pool.flow();
    images
        .map(move |image| {
            let decoded = match image {
                Encoded::Image(bytes) => Ok(flow.submit(bytes, settings.clone())),
                Encoded::Failed(e) => Err(e),
            };
            async move {
                match decoded {
                    Ok(rx) => rx.await.map_err(|_| {
                        GatewayError::new(ErrorKind::NotReady, "the decode pool is shutting down")
                    }),
                    Err(e) => Ok(Err(e)),
                }
            }
        })
        .buffered(DECODE_AHEAD)
}

/// `rows`, ended by `abort`'s error as soon as it resolves.
fn abortable<F>(
    rows: impl Stream<Item = RowIn<F>>,
    abort: impl Future<Output = GatewayError>,
) -> impl Stream<Item = RowIn<F>> {
    let state = Some((Box::pin(rows), Box::pin(abort)));
    futures_util::stream::unfold(state, |state| async move {
        let (mut rows, mut abort) = state?;
        tokio::select! {
            biased;
            e = &mut abort => Some((RowIn::Abort(e), None)),
            row = rows.next() => Some((row?, Some((rows, abort)))),
        }
    })
}
