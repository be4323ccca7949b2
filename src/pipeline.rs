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
use crate::preprocess::{Decoded, PreprocessError, PreprocessPool, PreprocessSettings, Row};
use crate::scheduler::{ModelHandle, RequestSpec, RowFailures, RowFormat, RowIn, RunResult};
use crate::trace::{Ending, Stamp, Trace, Value};

/// What an image ensemble needs to serve requests end to end.
#[derive(Clone)]
pub struct ImagePipeline {
    pub name: ModelName,
    pub version: ModelVersion,
    /// The preprocessor step's name and version (a trace's step).
    pub preprocessor: (ModelName, ModelVersion),
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
    /// once, ahead of the images still decoding. A sampled request's `trace` (at this
    /// ensemble) gets a step of its own at each of the ensemble's models.
    #[allow(clippy::too_many_arguments)]
    pub async fn classify<T, F: RowFailures>(
        &self,
        pool: &PreprocessPool,
        options: RequestOptions,
        want: OutputRequest,
        failures: F,
        images: impl Stream<Item = Encoded<T>>,
        abort: impl Future<Output = GatewayError>,
        trace: Option<&Trace>,
    ) -> RunResult<T, F> {
        let ending = Ending::new(trace.cloned());
        let steps = trace.map(|t| {
            t.stamp(Stamp::RequestStart);
            t.stamp(Stamp::QueueStart);
            let (pre, pre_version) = &self.preprocessor;
            let classifier = &self.classifier;
            (
                t.child(pre.as_str(), pre_version.0),
                t.child(classifier.name().as_str(), classifier.version().0),
            )
        });
        let (decode_trace, classify_trace) = steps.unzip();
        let gpu = self.classifier.decodes_on_gpu();
        let decoded = decode(pool, &self.preprocess, gpu, images, decode_trace);
        let rows = decoded.map(|decoded| match decoded {
            Ok((tag, Ok(row))) => RowIn::Row(tag, row),
            Ok((tag, Err(e))) => RowIn::Unusable(tag, e),
            Err(e) => RowIn::Abort(e),
        });
        let spec = RequestSpec {
            options,
            format: RowFormat::Image(self.normalize),
            want,
            trace: classify_trace,
        };
        let result = self
            .classifier
            .run(spec, failures, abortable(rows, abort))
            .await;
        ending.finish(&result);
        result
    }
}

/// Each image prepared on the pool (decoded, or with `gpu` a JPEG the GPU decoder takes
/// checked and passed on whole), `DECODE_AHEAD` at a time, yielded in order as soon as it
/// and those before it are done: its tag and its row, or why it cannot be used (`Err`: the
/// pool stopped). A sampled request's `trace` (at the preprocessor) records the decode.
pub fn decode<'a, T: 'a>(
    pool: &'a PreprocessPool,
    settings: &'a Arc<PreprocessSettings>,
    gpu: bool,
    images: impl Stream<Item = Encoded<T>> + 'a,
    trace: Option<Trace>,
) -> impl Stream<Item = Result<(T, Result<Row, PreprocessError>), GatewayError>> + 'a {
    // The request's own flow: the pool takes its images in turn with other requests'.
    let flow = pool.flow();
    let stats = trace.map(|t| Arc::new(DecodeTrace::new(t)));
    let end = stats.clone();
    let mut place = 0;
    images
        .map(move |Encoded { tag, image }| {
            let size = image.as_ref().map_or(0, |b| b.len());
            let decoded = image.map(|bytes| flow.submit(bytes, settings.clone(), gpu));
            let stats = stats.clone();
            place += 1;
            let at = place - 1;
            async move {
                match decoded {
                    Ok(rx) => match rx.await {
                        Ok(done) => {
                            if let Some(stats) = &stats {
                                stats.image(at, size, &done);
                            }
                            Ok((tag, done.row))
                        }
                        Err(_) => Err(GatewayError::new(
                            ErrorKind::ShuttingDown,
                            "the decode pool is shutting down",
                        )),
                    },
                    Err(e) => {
                        if let Some(stats) = &stats {
                            stats.unusable(at, &e);
                        }
                        Ok((tag, Err(e)))
                    }
                }
            }
        })
        .buffered(DECODE_AHEAD)
        // The decode's end, once the last image is done.
        .chain(
            futures_util::stream::once(async move {
                if let Some(stats) = end {
                    stats.finish();
                }
            })
            .filter_map(|()| async { None }),
        )
}

/// A request's decode as its trace records it: the images, their bytes, the decode
/// threads' time on them, the slowest (its place in the request), the first decode's start
/// and the last one's end (the preprocessor's compute), each image that cannot be used as
/// an event with its code. Written to the trace when the last image is done.
struct DecodeTrace {
    trace: Trace,
    stats: std::sync::Mutex<DecodeStats>,
}

#[derive(Default)]
struct DecodeStats {
    images: usize,
    bytes: usize,
    busy: std::time::Duration,
    slowest: Option<(usize, std::time::Duration)>,
    first: Option<std::time::Instant>,
    last: Option<std::time::Instant>,
    finished: bool,
}

impl DecodeTrace {
    fn new(trace: Trace) -> DecodeTrace {
        trace.stamp(Stamp::RequestStart);
        trace.stamp(Stamp::QueueStart);
        DecodeTrace {
            trace,
            stats: Default::default(),
        }
    }

    /// An image that cannot be used, before or after its decode.
    fn unusable(&self, place: usize, e: &PreprocessError) {
        self.trace.event(
            "image_unusable",
            vec![
                ("image", Value::Int(place as i64)),
                ("code", Value::Text(e.code().to_string())),
                ("message", Value::Text(e.to_string())),
            ],
        );
    }

    fn image(&self, place: usize, bytes: usize, done: &Decoded) {
        let took = done.ended.saturating_duration_since(done.started);
        if let Err(e) = &done.row {
            self.unusable(place, e);
        }
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.images += 1;
        s.bytes += bytes;
        s.busy += took;
        if s.slowest.is_none_or(|(_, t)| took > t) {
            s.slowest = Some((place, took));
        }
        s.first = Some(s.first.map_or(done.started, |f| f.min(done.started)));
        s.last = Some(s.last.map_or(done.ended, |l| l.max(done.ended)));
    }
}

impl DecodeTrace {
    /// Once: after the last image (or as the request ends without it).
    fn finish(&self) {
        let s = {
            let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            if s.finished {
                return;
            }
            let done = DecodeStats {
                finished: true,
                ..Default::default()
            };
            std::mem::replace(&mut *s, done)
        };
        let t = &self.trace;
        if let (Some(first), Some(last)) = (s.first, s.last) {
            t.stamp_at(Stamp::ComputeStart, first);
            t.stamp_at(Stamp::ComputeEnd, last);
        }
        t.attribute("visiongate.decode.images", Value::Int(s.images as i64));
        t.attribute("visiongate.decode.bytes", Value::Int(s.bytes as i64));
        t.attribute(
            "visiongate.decode.busy_ms",
            Value::Float(s.busy.as_secs_f64() * 1e3),
        );
        if let Some((place, took)) = s.slowest {
            t.attribute("visiongate.decode.slowest_image", Value::Int(place as i64));
            t.attribute(
                "visiongate.decode.slowest_ms",
                Value::Float(took.as_secs_f64() * 1e3),
            );
        }
        t.stamp(Stamp::RequestEnd);
    }
}

impl Drop for DecodeTrace {
    fn drop(&mut self) {
        self.finish();
    }
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
