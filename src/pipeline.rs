//! The image ensemble: encoded images are decoded on the pool, a bounded window ahead, and
//! their rows enter the classifier's queue as they are ready, so inference of the first
//! overlaps decoding (and uploading) of the rest. `/predict` and KServe's ensemble models
//! both run this one pipeline; they differ only in how rows fail (`RowFailures`: one by
//! one, or together).
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};

use crate::domain::{ModelName, ModelVersion, Normalize, RequestOptions};
use crate::engine::OutputRequest;
use crate::error::{ErrorKind, GatewayError};
use crate::preprocess::{PreprocessError, PreprocessPool, PreprocessSettings, Row};
use crate::scheduler::{ModelHandle, RequestSpec, RowFailures, RowFormat, RowIn, RunResult};

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

/// One image of a request as it arrives, with the caller's tag for it (a file's name).
pub struct Encoded<T> {
    pub tag: T,
    /// Its bytes, or why it is unusable before decoding (empty, over the size limit).
    pub image: Result<Bytes, PreprocessError>,
}

/// Images in flight on the decode pool at once for one request: enough to keep every
/// decode thread busy, few enough that a large request does not crowd out others.
pub const DECODE_AHEAD: usize = 32;

impl ImagePipeline {
    /// Classifies `images` in order, each answered with its tag; `failures` says whether an
    /// image that cannot be used (or whose batch the model failed) gets its own failure or
    /// fails the request. If `abort` resolves first, the request ends with its error at
    /// once, ahead of the images still decoding.
    pub async fn classify<T, F: RowFailures>(
        &self,
        pool: &PreprocessPool,
        options: RequestOptions,
        want: OutputRequest,
        failures: F,
        images: impl Stream<Item = Encoded<T>>,
        abort: impl Future<Output = GatewayError>,
    ) -> RunResult<T, F> {
        let gpu = self.classifier.decodes_on_gpu();
        let rows = decode(pool, &self.preprocess, gpu, images).map(|decoded| match decoded {
            Ok((tag, Ok(row))) => RowIn::Row(tag, row),
            Ok((tag, Err(e))) => RowIn::Unusable(tag, e),
            Err(e) => RowIn::Abort(e),
        });
        let spec = RequestSpec {
            options,
            format: RowFormat::Image(self.normalize),
            want,
        };
        self.classifier
            .run(spec, failures, abortable(rows, abort))
            .await
    }
}

/// Each image prepared on the pool (decoded, or with `gpu` a JPEG the GPU decoder takes
/// checked and passed on whole), `DECODE_AHEAD` at a time, yielded in order as soon as it
/// and those before it are done: its tag and its row, or why it cannot be used (`Err`: the
/// pool stopped).
pub fn decode<'a, T: 'a>(
    pool: &'a PreprocessPool,
    settings: &'a Arc<PreprocessSettings>,
    gpu: bool,
    images: impl Stream<Item = Encoded<T>> + 'a,
) -> impl Stream<Item = Result<(T, Result<Row, PreprocessError>), GatewayError>> + 'a {
    // The request's own flow: the pool takes its images in turn with other requests'.
    let flow = pool.flow();
    images
        .map(move |Encoded { tag, image }| {
            let decoded = image.map(|bytes| flow.submit(bytes, settings.clone(), gpu));
            async move {
                match decoded {
                    Ok(rx) => match rx.await {
                        Ok(row) => Ok((tag, row)),
                        Err(_) => Err(GatewayError::new(
                            ErrorKind::ShuttingDown,
                            "the decode pool is shutting down",
                        )),
                    },
                    Err(e) => Ok((tag, Err(e))),
                }
            }
        })
        .buffered(DECODE_AHEAD)
}

/// `rows`, ended by `abort`'s error as soon as it resolves.
fn abortable<T>(
    rows: impl Stream<Item = RowIn<T>>,
    abort: impl Future<Output = GatewayError>,
) -> impl Stream<Item = RowIn<T>> {
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
