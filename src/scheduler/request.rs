//! One request through a model's queue, the only way rows reach a model: admission, rows
//! submitted in chunks as they arrive, the response cache, the merge of every chunk's
//! outputs in row order, and the request's accounting (Triton's success and failure
//! counters, which the statistics extension reads too).
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{FutureExt, Stream, StreamExt};
use tokio::sync::{oneshot, Notify};

use super::cache::{CacheKey, ResponseCache};
use super::handle::{Inner, QueuePlace};
use super::{
    BatchFailed, Job, JobResult, JobRows, ModelHandle, ModelState, QueuedJob, RequestMark,
    RowFailure, RowFormat, RowOutput, SchedulerError,
};
use crate::domain::RequestOptions;
use crate::engine::OutputRequest;
use crate::error::{ErrorKind, GatewayError, HasKind};
use crate::preprocess::{PreprocessError, Row};
use crate::telemetry::{micros, reason, Latency};
use crate::trace::{Ending, Stamp, Trace};

/// The fewest rows a job is submitted with while a request's rows still arrive (unless they
/// end): small enough that the first rows start early, large enough that the per-job cost
/// is nothing. A job takes every row that is ready when it is submitted, so rows that are
/// all there at once (a tensor request) go in one job. The batcher still merges jobs into
/// each instance's own batch size.
const CHUNK_ROWS: usize = 8;

/// What a request asks of the model, besides its rows.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    pub options: RequestOptions,
    pub format: RowFormat,
    pub want: OutputRequest,
    /// The request's trace at this model, where it is sampled.
    pub trace: Option<Trace>,
}

/// How a request's rows fail, and so what each of its rows answers.
pub trait RowFailures: Copy {
    /// What a row answers.
    type Row;
    /// The answer of a row whose input cannot be used (on arrival, or where it ran);
    /// `place` is its place in arrival order. `Err` ends the request.
    fn unusable(place: usize, error: PreprocessError) -> Result<Self::Row, RunError>;
    /// The answer of a row that ran: its output, or the failure of its batch. `Err` ends
    /// the request.
    fn ran(place: usize, output: Result<RowOutput, RowFailure>) -> Result<Self::Row, RunError>;
}

/// Rows fail one by one: a row that fails gets its own `RowFailure` and the other rows keep
/// their outputs (`/predict`'s per-file answers).
#[derive(Debug, Clone, Copy)]
pub struct OneByOne;

impl RowFailures for OneByOne {
    type Row = Result<RowOutput, RowFailure>;

    fn unusable(_: usize, error: PreprocessError) -> Result<Self::Row, RunError> {
        Ok(Err(RowFailure::Unusable(error)))
    }

    fn ran(_: usize, output: Result<RowOutput, RowFailure>) -> Result<Self::Row, RunError> {
        Ok(output)
    }
}

/// Rows fail together: the first row that fails ends the request, its queued rows dropped
/// unrun, so a request that completes has every row's output (KServe has no per-row
/// errors).
#[derive(Debug, Clone, Copy)]
pub struct Together;

impl RowFailures for Together {
    type Row = RowOutput;

    fn unusable(place: usize, error: PreprocessError) -> Result<RowOutput, RunError> {
        Err(RunError::Unusable { row: place, error })
    }

    fn ran(place: usize, output: Result<RowOutput, RowFailure>) -> Result<RowOutput, RunError> {
        output.map_err(|failure| match failure {
            RowFailure::ModelFailed(failed) => RunError::Scheduler(SchedulerError::Failed(failed)),
            RowFailure::Unusable(error) => RunError::Unusable { row: place, error },
        })
    }
}

/// One row of a request as it arrives, with the caller's tag for it (a file's name).
pub enum RowIn<T> {
    Row(T, Row),
    /// Its input cannot be used.
    Unusable(T, PreprocessError),
    /// The request cannot go on (a malformed upload): its queued rows are dropped unrun.
    Abort(GatewayError),
}

/// Why a request got no rows back.
#[derive(Debug)]
pub enum RunError {
    /// Refused, expired, failed in the engine, or the model stopped.
    Scheduler(SchedulerError),
    /// The caller's rows ended the request (`RowIn::Abort`).
    Aborted(GatewayError),
    /// Rows fail together, and this one (its place in arrival order) cannot be used.
    Unusable { row: usize, error: PreprocessError },
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Scheduler(e) => write!(f, "{e}"),
            RunError::Aborted(e) => write!(f, "{e}"),
            RunError::Unusable { row, error } => write!(f, "row {row}: {error}"),
        }
    }
}

impl From<RunError> for GatewayError {
    fn from(e: RunError) -> GatewayError {
        match e {
            RunError::Scheduler(e) => e.into(),
            RunError::Aborted(e) => e,
            RunError::Unusable { row, error } => {
                GatewayError::new(error.kind(), format!("row {row}: {error}"))
            }
        }
    }
}

/// Each row's tag and its answer (as `F` answers rows), in the order the rows came.
pub type RunResult<T, F> = Result<Vec<(T, <F as RowFailures>::Row)>, RunError>;

impl ModelHandle {
    /// Runs one request: once its first row is there, takes a place in the queue (or
    /// refuses at once: `Overloaded` when the queue is full, `NotReady`), submits the rows
    /// in chunks as they arrive so the first run while the rest still arrive, and answers
    /// every row in order. A request still waiting for its first row (a slow upload) holds
    /// no place. Dropping the future cancels the request: its queued rows leave the queue
    /// unrun and it counts as Triton's `CANCELED`. Every outcome is counted once, here.
    pub async fn run<T, F: RowFailures>(
        &self,
        spec: RequestSpec,
        _: F,
        rows: impl Stream<Item = RowIn<T>>,
    ) -> RunResult<T, F> {
        if let Some(trace) = &spec.trace {
            trace.stamp(Stamp::RequestStart);
        }
        let ending = Ending::new(spec.trace.clone());
        let result = self.run_traced::<T, F>(&spec, rows).await;
        ending.finish(&result);
        result
    }

    async fn run_traced<T, F: RowFailures>(
        &self,
        spec: &RequestSpec,
        rows: impl Stream<Item = RowIn<T>>,
    ) -> RunResult<T, F> {
        // Refused at once, before any row is read, when it would be at its first row.
        if let Err(e) = self.would_admit(spec.options) {
            self.account(Outcome::Failed(e.reason()), Instant::now());
            return Err(RunError::Scheduler(e));
        }
        let mut rows = std::pin::pin!(rows);
        let mut arriving = Arriving::new(self);
        let first = rows.next().await;
        arriving.counts_as_cancelled = false;
        if let Some(RowIn::Abort(e)) = first {
            // Ended before any row (a stalled or malformed upload): nothing to queue.
            let result = Err(RunError::Aborted(e));
            self.account(outcome_of(&result), Instant::now());
            return result;
        }
        let rows = futures_util::stream::iter(first).chain(rows);
        let admitted = self.admit(spec.options, spec.trace.clone());
        // Only now: with its place taken, a retiring model still waits for this request.
        drop(arriving);
        let mut admission = match admitted {
            Ok(admission) => admission,
            Err(e) => {
                self.account(Outcome::Failed(e.reason()), Instant::now());
                return Err(RunError::Scheduler(e));
            }
        };
        let result = admission.feed::<T, F>(spec, rows).await;
        admission.finish(if admission.batch_failed {
            Outcome::Failed(reason::BACKEND)
        } else {
            outcome_of(&result)
        });
        result
    }

    /// Whether the model would take a request now: ready, not retired, a queue place free.
    /// The one readiness check of a request, counted where it refuses.
    fn would_admit(&self, options: RequestOptions) -> Result<usize, SchedulerError> {
        let inner = &self.inner;
        let model = || inner.name.to_string();
        if inner.retired.load(Ordering::SeqCst) {
            return Err(SchedulerError::Retired { model: model() });
        }
        match self.state() {
            ModelState::Ready => {}
            ModelState::Down(_) => return Err(SchedulerError::Down { model: model() }),
            ModelState::Loading | ModelState::Failed(_) => {
                return Err(SchedulerError::NotReady { model: model() })
            }
        }
        let level = inner.policy.level(options.priority);
        if inner.queue_places[level].available_permits() == 0 {
            return Err(SchedulerError::Overloaded { model: model() });
        }
        Ok(level)
    }

    /// Takes one place in the model's queue, or refuses at once; never waits for room.
    fn admit(
        &self,
        options: RequestOptions,
        trace: Option<Trace>,
    ) -> Result<Admission, SchedulerError> {
        let inner = &self.inner;
        let model = || inner.name.to_string();
        let level = self.would_admit(options)?;
        let permit = inner.queue_places[level]
            .clone()
            .try_acquire_owned()
            .map_err(|_| SchedulerError::Overloaded { model: model() })?;
        if let Some(trace) = &trace {
            trace.stamp(Stamp::QueueStart);
        }
        Ok(Admission {
            handle: self.clone(),
            place: Some(Arc::new(QueuePlace::new(permit, inner.place_freed.clone()))),
            level,
            timeout: inner.policy.queues[level].timeout_for(options.timeout),
            started: Instant::now(),
            feeding: Some(Feeding::new(inner)),
            request: Arc::new(RequestMark::new(trace)),
            finished: false,
            batch_failed: false,
        })
    }

    /// Counts a request's outcome: Triton's success counter and duration, or its failure
    /// counter with the reason.
    fn account(&self, outcome: Outcome, started: Instant) {
        let inner = &self.inner;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        inner
            .last_inference_ms
            .store(now, std::sync::atomic::Ordering::Relaxed);
        let m = &inner.series;
        match outcome {
            Outcome::Completed => {
                m.request_success.inc();
                m.latency
                    .observe(Latency::Request, micros(started.elapsed()), 1);
            }
            Outcome::Failed(why) => m.failed(why),
        }
    }
}

/// An admitted request that still submits rows, counted in the model's `feeding` until
/// dropped; dropping the last one wakes the batcher, which then waits for no more rows
/// (while any other still feeds, its decision stays the same).
struct Feeding {
    count: Arc<AtomicUsize>,
    wake: Arc<Notify>,
}

impl Feeding {
    fn new(inner: &Inner) -> Feeding {
        inner.feeding.fetch_add(1, Ordering::SeqCst);
        Feeding {
            count: inner.feeding.clone(),
            wake: inner.wake.clone(),
        }
    }
}

impl Drop for Feeding {
    fn drop(&mut self) {
        if self.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.wake.notify_one();
        }
    }
}

/// A request waiting for its first row: it holds no queue place, but a retiring model
/// waits for it (it resolved the model before the model left the table). Dropped while
/// it waits, its caller went away: it counts as cancelled.
struct Arriving<'a> {
    handle: &'a ModelHandle,
    counts_as_cancelled: bool,
}

impl<'a> Arriving<'a> {
    fn new(handle: &'a ModelHandle) -> Arriving<'a> {
        handle.inner.arriving.fetch_add(1, Ordering::SeqCst);
        Arriving {
            handle,
            counts_as_cancelled: true,
        }
    }
}

impl Drop for Arriving<'_> {
    fn drop(&mut self) {
        if self.counts_as_cancelled {
            self.handle
                .account(Outcome::Failed(reason::CANCELED), Instant::now());
        }
        let inner = &self.handle.inner;
        inner.arriving.fetch_sub(1, Ordering::SeqCst);
        inner.place_freed.notify_waiters();
    }
}

/// How a request ended, as counted: completed, or failed with the `reason` label of
/// Triton's failure counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Completed,
    Failed(&'static str),
}

fn outcome_of<T>(result: &Result<T, RunError>) -> Outcome {
    Outcome::Failed(match result {
        Ok(_) => return Outcome::Completed,
        Err(RunError::Scheduler(e)) => e.reason(),
        // The caller's rows ended because its client left (a cut-off upload).
        Err(RunError::Aborted(e)) if e.kind() == ErrorKind::Cancelled => reason::CANCELED,
        // Its own rows ended it.
        Err(RunError::Aborted(_) | RunError::Unusable { .. }) => reason::OTHER,
    })
}

/// One admitted request. Dropped before `finish` (its caller went away), it counts as
/// Triton's `CANCELED`; the batcher drops its queued rows since nobody waits for them.
struct Admission {
    handle: ModelHandle,
    /// Shared with the queued jobs; `None` once every row is submitted, so the place is
    /// freed as soon as the last job leaves the queue.
    place: Option<Arc<QueuePlace>>,
    level: usize,
    timeout: Option<Duration>,
    started: Instant,
    /// Counted as feeding until its last rows are submitted.
    feeding: Option<Feeding>,
    /// Shared by the request's jobs in the batcher.
    request: Arc<RequestMark>,
    /// Set by `finish`, so `Drop` knows the outcome was counted.
    finished: bool,
    /// The engine failed a batch some of the rows ran in (counted as `BACKEND`).
    batch_failed: bool,
}

impl Admission {
    /// Submits the rows in chunks as they arrive, then waits for every chunk's outputs.
    async fn feed<T, F: RowFailures>(
        &mut self,
        spec: &RequestSpec,
        rows: impl Stream<Item = RowIn<T>>,
    ) -> RunResult<T, F> {
        // Per row in arrival order: its tag, and its answer if it has one on arrival
        // (`None`: it takes the next output).
        let mut slots: Vec<(T, Option<F::Row>)> = Vec::new();
        let mut pending = Vec::new();
        let mut chunk = Vec::with_capacity(CHUNK_ROWS);
        let mut rows = std::pin::pin!(rows);
        loop {
            let next = match rows.next().now_or_never() {
                Some(next) => next,
                None => {
                    // Nothing more is ready: a full enough chunk goes now, not after the wait.
                    if chunk.len() >= CHUNK_ROWS {
                        let rows = std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK_ROWS));
                        pending.push(self.submit(rows, spec, false).await?);
                    }
                    rows.next().await
                }
            };
            match next {
                None => break,
                Some(RowIn::Row(tag, row)) => {
                    chunk.push(row);
                    slots.push((tag, None));
                }
                Some(RowIn::Unusable(tag, error)) => {
                    let answer = F::unusable(slots.len(), error)?;
                    slots.push((tag, Some(answer)));
                }
                Some(RowIn::Abort(e)) => return Err(RunError::Aborted(e)),
            }
        }
        // No more jobs: the place is freed when the last one leaves the queue (the last
        // chunk takes the request's own hold on it, so no moment passes between its leaving
        // the queue and the place being free).
        if !chunk.is_empty() {
            pending.push(self.submit(chunk, spec, true).await?);
        }
        self.place = None;
        self.feeding = None;
        let mut outputs = Vec::with_capacity(slots.len());
        // Where the n-th computed row is in arrival order (rows unusable on arrival took
        // places of their own).
        let mut places = (0..slots.len()).filter(|&i| slots[i].1.is_none());
        for chunk in pending {
            for output in chunk.wait(&self.handle.inner).await? {
                let place = places.next().unwrap_or(slots.len());
                if let Err(RowFailure::ModelFailed(_)) = output {
                    self.batch_failed = true;
                }
                outputs.push(F::ran(place, output)?);
            }
        }
        let mut outputs = outputs.into_iter();
        slots
            .into_iter()
            .map(|(tag, failure)| match failure {
                None => outputs
                    .next()
                    .map(|output| (tag, output))
                    .ok_or_else(|| missing_outputs(&self.handle.inner)),
                Some(answer) => Ok((tag, answer)),
            })
            .collect()
    }

    /// Queues one chunk (the rows the response cache does not know); the `last` one takes
    /// the request's hold on its queue place. Waits only if the channel to the batcher is
    /// momentarily full: the request is already admitted, this is backpressure, not
    /// admission.
    async fn submit(
        &mut self,
        rows: Vec<Row>,
        spec: &RequestSpec,
        last: bool,
    ) -> Result<PendingRows, RunError> {
        let inner = &self.handle.inner;
        let mut job = JobRows {
            rows,
            format: spec.format,
            want: spec.want,
        };
        let (reply, computed) = oneshot::channel();
        let mut miss_keys = Vec::new();
        let cached = inner.cache.as_ref().map(|cache| {
            let (found, keys) = lookup(inner, cache, &job);
            let rows = std::mem::take(&mut job.rows);
            for ((row, key), found) in rows.into_iter().zip(keys).zip(&found) {
                if found.is_none() {
                    job.rows.push(row);
                    miss_keys.push(key);
                }
            }
            found
        });
        let computed = Reply {
            rx: Some(computed),
            wake: inner.wake.clone(),
        };
        if job.rows.is_empty() {
            let _ = reply.send(Ok(Vec::new()));
            return Ok(PendingRows { computed, cached });
        }
        let place = if last {
            self.place.take()
        } else {
            self.place.clone()
        }
        .expect("rows are submitted only before the request is complete");
        let mut state = Job::new(job, reply);
        state.cache = inner.cache.clone().map(|cache| (cache, miss_keys));
        state.request = self.request.clone();
        let admitted = QueuedJob {
            job: Arc::new(state),
            place,
            level: self.level,
            timeout: self.timeout,
        };
        let sent = inner.jobs.send(admitted).await;
        if last {
            // Only once its last rows are in the channel: the batcher, woken, finds them
            // there and no more of this request's rows coming.
            self.feeding = None;
        }
        sent.map_err(|_| {
            RunError::Scheduler(SchedulerError::Stopping {
                model: inner.name.to_string(),
            })
        })?;
        Ok(PendingRows { computed, cached })
    }

    fn finish(&mut self, outcome: Outcome) {
        self.handle.account(outcome, self.started);
        self.finished = true;
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if !self.finished {
            self.handle
                .account(Outcome::Failed(reason::CANCELED), self.started);
        }
    }
}

/// Where a queued job's answer arrives. Dropped unanswered (its request left), it wakes the
/// batcher, which drops the job's rows from the queue at once (not when a batch is next
/// cut, which a long queue delay could put off).
struct Reply {
    rx: Option<oneshot::Receiver<JobResult>>,
    wake: Arc<tokio::sync::Notify>,
}

impl Reply {
    async fn answer(&mut self) -> Result<JobResult, oneshot::error::RecvError> {
        let rx = self.rx.as_mut().expect("answered once");
        let answer = rx.await;
        self.rx = None;
        answer
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if let Some(rx) = self.rx.take() {
            // Closed first, so that the woken batcher finds the job abandoned.
            drop(rx);
            self.wake.notify_one();
        }
    }
}

/// The outputs of one submitted chunk, in its row order.
struct PendingRows {
    computed: Reply,
    /// Per row of the chunk: its cached output, or `None` when the model runs it.
    cached: Option<Vec<Option<RowOutput>>>,
}

impl PendingRows {
    /// Each row's output, or why it has none.
    async fn wait(mut self, inner: &Inner) -> Result<Vec<Result<RowOutput, RowFailure>>, RunError> {
        let model = || inner.name.to_string();
        let computed = self
            .computed
            .answer()
            .await
            .unwrap_or_else(|_| Err(SchedulerError::Stopping { model: model() }))
            .map_err(RunError::Scheduler)?;
        let Some(found) = self.cached else {
            return Ok(computed);
        };
        let mut computed = computed.into_iter();
        found
            .into_iter()
            .map(|found| {
                found
                    .map(Ok)
                    .or_else(|| computed.next())
                    .ok_or_else(|| missing_outputs(inner))
            })
            .collect()
    }
}

/// An engine that answered fewer rows than it was given.
fn missing_outputs(inner: &Inner) -> RunError {
    tracing::error!(model = %inner.name, "the engine answered fewer rows than it was given");
    RunError::Scheduler(SchedulerError::Failed(BatchFailed {
        model: inner.name.to_string(),
    }))
}

/// Looks every row of `job` up in the cache and counts hits and misses: each row's cached
/// output (if any) and key.
fn lookup(
    inner: &Inner,
    cache: &ResponseCache,
    job: &JobRows,
) -> (Vec<Option<RowOutput>>, Vec<CacheKey>) {
    let keys: Vec<CacheKey> = job
        .rows
        .iter()
        .map(|row| {
            ResponseCache::key(
                inner.name.as_str(),
                inner.version.0,
                inner.generation,
                &job.format,
                job.want,
                row,
            )
        })
        .collect();
    let found: Vec<Option<RowOutput>> = keys.iter().map(|&k| cache.get(k)).collect();
    let hits = found.iter().filter(|f| f.is_some()).count() as u64;
    inner.series.cache_hits.inc_by(hits);
    inner.series.cache_misses.inc_by(found.len() as u64 - hits);
    (found, keys)
}
