//! Per-model scheduling: admission (`ModelHandle`), a batcher task that owns the pending
//! rows and the idle instances, pure batching decisions, one OS thread per instance.
//!
//! Rows of many requests merge into one batch; a request with more rows than a batch is cut
//! into row ranges that run on different instances at once, and its reply waits for all of
//! them. Rows never cross between requests.

mod batcher;
mod cache;
mod flags;
mod handle;
mod instance;
pub mod policy;
mod request;
mod start;
mod supervisor;
mod tuning;

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::oneshot;

pub use cache::ResponseCache;
pub use flags::QueueFlags;
pub use handle::{ModelHandle, ModelState};
pub use policy::{BatchPolicy, QueuePolicy};
pub use request::{OneByOne, RequestSpec, RowFailures, RowIn, RunError, RunResult, Together};
pub use start::{start_model, EngineFactory, ModelSettings};
pub use tuning::BatchSizeChoice;

use crate::domain::{Normalize, Ranked};
use crate::engine::OutputRequest;
use crate::error::{ErrorKind, HasKind};
use crate::preprocess::{PreprocessError, Row};
use crate::telemetry::reason;

/// Why a request got no rows back from a model's queue. Each refusal has its own kind,
/// message and `reason` label in Triton's failure counter.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SchedulerError {
    /// Still loading, or its load failed.
    #[error("model '{model}' is not ready")]
    NotReady { model: String },
    /// Loaded, but every instance is down (its engine failed) and restarting.
    #[error("model '{model}' is down: every instance failed and is restarting; retry later")]
    Down { model: String },
    /// The model is stopping (the server stops, or the model is unloaded or replaced):
    /// its queue no longer runs.
    #[error("model '{model}' is stopping")]
    Stopping { model: String },
    /// Unloaded or replaced after the request found it: the request may be sent again.
    #[error("model '{model}' was unloaded or replaced; send the request again")]
    Retired { model: String },
    /// Its priority level's queue was full at admission (Triton's `max_queue_size`).
    #[error("model '{model}' is busy: its queue is full, retry later")]
    Overloaded { model: String },
    /// Still queued when its timeout passed (Triton's queue policy, `REJECT`).
    #[error(
        "request timeout expired: waited {waited_ms} ms in the queue of model '{model}' \
         (timeout {timeout_ms} ms)"
    )]
    Expired {
        model: String,
        waited_ms: u64,
        timeout_ms: u64,
    },
    #[error(transparent)]
    Failed(BatchFailed),
}

/// The engine failed the batch a request's rows ran in. Why is logged, not told: an
/// engine's message may name files and libraries.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("model '{model}' failed on the batch these rows ran in; the server log says why")]
pub struct BatchFailed {
    pub model: String,
}

impl HasKind for SchedulerError {
    fn kind(&self) -> ErrorKind {
        match self {
            SchedulerError::NotReady { .. } => ErrorKind::NotReady,
            SchedulerError::Down { .. } => ErrorKind::ModelDown,
            SchedulerError::Stopping { .. } => ErrorKind::ShuttingDown,
            SchedulerError::Retired { .. } => ErrorKind::ModelUnloaded,
            SchedulerError::Overloaded { .. } => ErrorKind::Overloaded,
            SchedulerError::Expired { .. } => ErrorKind::DeadlineExceeded,
            SchedulerError::Failed(_) => ErrorKind::ModelFailed,
        }
    }
}

impl SchedulerError {
    /// The `reason` label of Triton's failure counter for a request that ended so.
    pub fn reason(&self) -> &'static str {
        match self {
            SchedulerError::Overloaded { .. } | SchedulerError::Expired { .. } => reason::REJECTED,
            SchedulerError::Failed(_) => reason::BACKEND,
            SchedulerError::NotReady { .. } => reason::NOT_READY,
            SchedulerError::Down { .. } => reason::MODEL_DOWN,
            SchedulerError::Stopping { .. } => reason::STOPPING,
            SchedulerError::Retired { .. } => reason::UNLOADED,
        }
    }
}

/// Why one row of a request has no output.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RowFailure {
    /// Its input cannot be used (empty, undecodable, too large).
    #[error(transparent)]
    Unusable(PreprocessError),
    /// The engine failed the batch it ran in.
    #[error(transparent)]
    ModelFailed(BatchFailed),
}

impl RowFailure {
    /// The per-row error code (`/predict`'s per-file `code`).
    pub fn code(&self) -> &'static str {
        match self {
            RowFailure::Unusable(e) => e.code(),
            RowFailure::ModelFailed(_) => ErrorKind::ModelFailed.code(),
        }
    }
}

/// What the bytes of a job's rows are. Only rows of one format share a batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowFormat {
    /// u8 HWC RGB images of the model's input size, normalized on the device.
    Image(Normalize),
    /// f32 CHW tensors of the model's input size (little-endian bytes), already
    /// preprocessed: a caller of the classifier itself.
    TensorF32,
}

/// One chunk of a request's rows and what it wants back.
#[derive(Debug)]
pub(crate) struct JobRows {
    pub rows: Vec<Row>,
    pub format: RowFormat,
    pub want: OutputRequest,
}

/// One row's result.
#[derive(Debug, Clone, PartialEq)]
pub struct RowOutput {
    /// Its best classes, as many as its request asked (or the number of classes if fewer).
    pub top: Ranked,
    pub logits: Option<Vec<f32>>,
}

/// A job's answer: each row's output, or why it has none (the engine failed the batch it
/// ran in, or its image could not be decoded where it ran); or the whole job's error
/// (expired, the model stopped).
pub(crate) type JobResult = Result<Vec<Result<RowOutput, RowFailure>>, SchedulerError>;

struct JobOutputs {
    outputs: Vec<Option<Result<RowOutput, RowFailure>>>,
    remaining: usize,
    reply: Option<oneshot::Sender<JobResult>>,
}

/// What the jobs (chunks) of one request share in the batcher.
#[derive(Debug, Default)]
pub(crate) struct RequestMark {
    /// Set when the first rows of any of its jobs leave the queue: from then on the request
    /// is executing and cannot time out (Triton's queue timeout is per request).
    started: std::sync::atomic::AtomicBool,
    /// Its trace at this model, where it is sampled: the batches it rides in are recorded
    /// there.
    pub trace: Option<crate::trace::Trace>,
}

impl RequestMark {
    pub fn new(trace: Option<crate::trace::Trace>) -> RequestMark {
        RequestMark {
            started: Default::default(),
            trace,
        }
    }

    /// Marks the request started; true the first time only (its queue time ends here).
    fn start(&self) -> bool {
        !self
            .started
            .swap(true, std::sync::atomic::Ordering::Relaxed)
    }

    fn started(&self) -> bool {
        self.started.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A job: one chunk of a request's rows, from its submission (`JobRows`) to its answer
/// (`JobResult`); sent to the batcher as a `QueuedJob`, held there as a `WaitingJob`. Its
/// rows are read by the instances that run its ranges, and every range writes its outputs
/// back here; the last one answers.
pub(crate) struct Job {
    job: JobRows,
    enqueued_at: Instant,
    /// Shared by the jobs of one request.
    request: Arc<RequestMark>,
    /// Where each row's output is cached as soon as its batch finishes (so a repeat in a
    /// later chunk of the same upload can already hit).
    cache: Option<(Arc<ResponseCache>, Vec<cache::CacheKey>)>,
    collect: Mutex<JobOutputs>,
}

impl Job {
    fn new(job: JobRows, reply: oneshot::Sender<JobResult>) -> Self {
        let n = job.rows.len();
        Self {
            collect: Mutex::new(JobOutputs {
                outputs: vec![None; n],
                remaining: n,
                reply: Some(reply),
            }),
            job,
            enqueued_at: Instant::now(),
            request: Default::default(),
            cache: None,
        }
    }

    fn rows(&self) -> usize {
        self.job.rows.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, JobOutputs> {
        // A panic while holding this lock only ever happens in code that cannot panic
        // (plain assignments); recover the data rather than poisoning the job.
        self.collect.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True when the caller is gone (disconnected) or the job already failed.
    fn abandoned(&self) -> bool {
        self.lock().reply.as_ref().is_none_or(|r| r.is_closed())
    }

    /// `range`'s rows ran: each row's output (cached) or its own failure.
    fn complete(&self, range: Range<usize>, outputs: Vec<Result<RowOutput, RowFailure>>) {
        if let Some((cache, keys)) = &self.cache {
            for (&key, out) in keys[range.clone()].iter().zip(&outputs) {
                if let Ok(out) = out {
                    cache.insert(key, out.clone());
                }
            }
        }
        self.settle(range, outputs.into_iter());
    }

    /// The engine failed the batch that held `range`: those rows get `error`, the job's
    /// other rows are unaffected.
    fn fail_rows(&self, range: Range<usize>, error: BatchFailed) {
        let len = range.len();
        let failure = RowFailure::ModelFailed(error);
        self.settle(range, std::iter::repeat_n(Err(failure), len));
    }

    fn settle(
        &self,
        range: Range<usize>,
        results: impl Iterator<Item = Result<RowOutput, RowFailure>>,
    ) {
        let mut c = self.lock();
        let len = range.len();
        for (slot, result) in c.outputs[range].iter_mut().zip(results) {
            *slot = Some(result);
        }
        c.remaining = c.remaining.saturating_sub(len);
        if c.remaining == 0 {
            if let Some(reply) = c.reply.take() {
                let rows = std::mem::take(&mut c.outputs)
                    .into_iter()
                    .flatten()
                    .collect();
                let _ = reply.send(Ok(rows));
            }
        }
    }

    fn fail(&self, error: SchedulerError) {
        if let Some(reply) = self.lock().reply.take() {
            let _ = reply.send(Err(error));
        }
    }
}

/// A job admitted into a model's queue. Its place is one of `max_queue_size`, shared by
/// the jobs of one request and held until their last rows leave the queue, so admission
/// bounds the requests waiting in the batcher, not just those in the channel.
pub(crate) struct QueuedJob {
    pub job: Arc<Job>,
    pub place: Arc<handle::QueuePlace>,
    /// Priority level (index into the policy's queues).
    pub level: usize,
    /// How long its rows may wait before any of them is cut.
    pub timeout: Option<std::time::Duration>,
}

/// Row ranges of one or more jobs, run together on one instance.
pub(crate) struct Batch {
    parts: Vec<(Arc<Job>, Range<usize>)>,
}

impl Batch {
    fn rows(&self) -> usize {
        self.parts.iter().map(|(_, r)| r.len()).sum()
    }

    /// The requests it serves, each once (jobs are chunks of requests), in batch order.
    fn requests(&self) -> Vec<&RequestMark> {
        let mut requests: Vec<&RequestMark> = Vec::new();
        for (job, _) in &self.parts {
            if !requests.iter().any(|r| std::ptr::eq(*r, &*job.request)) {
                requests.push(&job.request);
            }
        }
        requests
    }
}
