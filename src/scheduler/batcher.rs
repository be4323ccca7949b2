//! The batcher task of one model: owns the pending jobs and the idle instance slots, and
//! cuts a batch only when an instance is idle (so batches grow while all are busy).
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, watch, Notify};
use tokio_util::sync::CancellationToken;

use super::handle::QueuePlace;
use super::instance::Slot;
use super::policy::{decide, BatchPolicy, Decision};
use super::{Batch, Job, ModelState, QueuedJob, SchedulerError};
use crate::domain::TimeoutAction;
use crate::telemetry::{micros, Latency, ModelSeries};

/// A job waiting in the batcher, with how many of its rows were already cut.
struct WaitingJob {
    job: Arc<Job>,
    next_row: usize,
    /// When the job times out if none of its request's rows was cut by then.
    deadline: Option<Instant>,
    /// Frees the request's queue place when its last job leaves the queue.
    _place: Arc<QueuePlace>,
}

impl WaitingJob {
    fn rows_left(&self) -> usize {
        self.job.rows() - self.next_row
    }
}

/// The jobs of one request waiting at one level, in the order they were submitted.
struct WaitingRequest {
    jobs: VecDeque<WaitingJob>,
}

impl WaitingRequest {
    fn front(&self) -> &WaitingJob {
        self.jobs.front().expect("a waiting request has a job")
    }

    fn rows(&self) -> usize {
        self.jobs.iter().map(WaitingJob::rows_left).sum()
    }
}

/// The pending jobs: per priority level (highest first, and after them the jobs whose
/// timeout passed under `DELAY`, which run only when nothing else waits) the requests
/// waiting there, in turn. A batch takes the rows of a level's requests in turn, an equal
/// share each, so a request that arrives behind a large upload's queued rows rides in the
/// next batch rather than after all of them.
struct Queue {
    levels: Vec<VecDeque<WaitingRequest>>,
    rows: usize,
}

impl Queue {
    fn new(priority_levels: usize) -> Self {
        Queue {
            levels: (0..priority_levels.max(1) + 1)
                .map(|_| VecDeque::new())
                .collect(),
            rows: 0,
        }
    }

    fn delayed_level(&self) -> usize {
        self.levels.len() - 1
    }

    fn push(&mut self, admitted: QueuedJob) {
        let level = admitted.level.min(self.delayed_level() - 1);
        let deadline = admitted.timeout.map(|t| admitted.job.enqueued_at + t);
        self.enqueue(
            level,
            WaitingJob {
                job: admitted.job,
                next_row: 0,
                deadline,
                _place: admitted.place,
            },
        );
    }

    /// Behind its request's other jobs at `level`, or as a request taking the last turn.
    fn enqueue(&mut self, level: usize, p: WaitingJob) {
        self.rows += p.rows_left();
        let requests = &mut self.levels[level];
        let at = requests
            .iter()
            .position(|w| Arc::ptr_eq(&w.front().job.request, &p.job.request))
            .unwrap_or_else(|| {
                requests.push_back(WaitingRequest {
                    jobs: VecDeque::new(),
                });
                requests.len() - 1
            });
        requests[at].jobs.push_back(p);
    }

    fn jobs(&self) -> impl Iterator<Item = &WaitingJob> {
        self.levels.iter().flatten().flat_map(|w| &w.jobs)
    }

    /// Requests waiting (one partly delayed counts at both of its levels).
    fn requests(&self) -> usize {
        self.levels.iter().map(VecDeque::len).sum()
    }

    fn is_empty(&self) -> bool {
        self.levels.iter().all(VecDeque::is_empty)
    }

    /// Takes out of the queue the jobs `leave(level, job)` picks, each with its level.
    fn remove(
        &mut self,
        mut leave: impl FnMut(usize, &WaitingJob) -> bool,
    ) -> Vec<(usize, WaitingJob)> {
        let mut gone = Vec::new();
        for (level, requests) in self.levels.iter_mut().enumerate() {
            for waiting in requests.iter_mut() {
                // In place: this runs each time the batcher looks for a batch.
                let mut i = 0;
                while i < waiting.jobs.len() {
                    if leave(level, &waiting.jobs[i]) {
                        let p = waiting.jobs.remove(i).expect("index checked");
                        self.rows -= p.rows_left();
                        gone.push((level, p));
                    } else {
                        i += 1;
                    }
                }
            }
            requests.retain(|w| !w.jobs.is_empty());
        }
        gone
    }

    /// Drops jobs nobody waits for any more (their client disconnected); returns how many.
    fn drop_abandoned(&mut self) -> usize {
        self.remove(|_, p| p.job.abandoned()).len()
    }

    /// Fails every job with `error` (nothing can run them).
    fn fail_all(&mut self, error: impl Fn() -> SchedulerError) {
        for (_, p) in self.remove(|_, _| true) {
            p.job.fail(error());
        }
    }

    /// Jobs none of whose request's rows was cut by their deadline: under `Reject` they
    /// are answered with a timeout and leave, under `Delay` they move behind every other
    /// job.
    fn expire(&mut self, now: Instant, policy: &BatchPolicy, model: &str) {
        let delayed = self.delayed_level();
        let expired = self.remove(|level, p| {
            level < delayed && !p.job.request.started() && p.deadline.is_some_and(|d| now >= d)
        });
        for (level, mut p) in expired {
            let action = policy
                .queues
                .get(level)
                .map_or(TimeoutAction::Reject, |q| q.timeout_action);
            match action {
                TimeoutAction::Reject => {
                    let waited = now - p.job.enqueued_at;
                    let timeout = p.deadline.map_or(waited, |d| d - p.job.enqueued_at);
                    p.job.fail(SchedulerError::Expired {
                        model: model.to_string(),
                        waited_ms: waited.as_millis() as u64,
                        timeout_ms: timeout.as_millis() as u64,
                    });
                }
                TimeoutAction::Delay => {
                    p.deadline = None;
                    self.enqueue(delayed, p);
                }
            }
        }
    }

    /// The earliest deadline of a job that can still time out.
    fn next_deadline(&self) -> Option<Instant> {
        self.jobs()
            .filter(|p| !p.job.request.started())
            .filter_map(|p| p.deadline)
            .min()
    }

    /// Rows of the request whose turn it is.
    fn head_rows(&self) -> usize {
        self.levels
            .iter()
            .find_map(|l| l.front())
            .map_or(0, WaitingRequest::rows)
    }

    /// When the longest-waiting row arrived.
    fn oldest(&self) -> Option<Instant> {
        self.levels
            .iter()
            .flatten()
            .map(|w| w.front().job.enqueued_at)
            .min()
    }

    /// Takes up to `n` rows, highest priority first; within a level, from its requests in
    /// turn, `n` shared equally between them (what one leaves goes to the others), each
    /// request's rows in order. With `one_request` the batch is only the rows of the request
    /// whose turn it is (a model without dynamic batching). Only jobs with the same row
    /// format (normalization) share a batch, since the whole batch is normalized at once on
    /// the device. Marks each request whose first rows leave the queue started (it can no
    /// longer time out) and calls `started(job)` with the job they came from (its wait is
    /// the request's queue time).
    fn cut(&mut self, n: usize, one_request: bool, mut started: impl FnMut(&Job)) -> Batch {
        let mut parts: Vec<(Arc<Job>, std::ops::Range<usize>)> = Vec::new();
        let mut left = n;
        'levels: for requests in &mut self.levels {
            let share = if one_request {
                n
            } else {
                left.div_ceil(requests.len().max(1))
            };
            while left > 0 {
                let Some(mut waiting) = requests.pop_front() else {
                    continue 'levels;
                };
                if let Some((first, _)) = parts.first() {
                    if first.job.format != waiting.front().job.job.format {
                        requests.push_front(waiting);
                        break 'levels;
                    }
                }
                let mut turn = share.min(left);
                while turn > 0 {
                    let Some(front) = waiting.jobs.front_mut() else {
                        break;
                    };
                    if front.job.request.start() {
                        started(&front.job);
                    }
                    let take = turn.min(front.rows_left());
                    parts.push((front.job.clone(), front.next_row..front.next_row + take));
                    front.next_row += take;
                    turn -= take;
                    left -= take;
                    if front.rows_left() == 0 {
                        waiting.jobs.pop_front();
                    }
                }
                if !waiting.jobs.is_empty() {
                    requests.push_back(waiting);
                }
                if one_request {
                    break 'levels;
                }
            }
            break;
        }
        self.rows -= n - left;
        Batch { parts }
    }
}

/// Who the batcher works for, for logs and metrics.
pub(super) struct BatcherLabels {
    pub model: String,
    pub series: ModelSeries,
}

/// What the batcher hears besides jobs and idle instances.
pub(super) struct BatcherSignals {
    /// The model's state (a model whose instances are all down answers what waits).
    pub state: watch::Receiver<ModelState>,
    /// Stops the batcher: what waits is answered `Stopping`.
    pub stop: CancellationToken,
    /// The model is retiring: rows no longer wait for a batch to fill.
    pub flush: CancellationToken,
    /// Something changed that no channel says: a request left with rows still queued, or
    /// one stopped submitting rows.
    pub wake: Arc<Notify>,
    /// Admitted requests with rows still to submit (`Inner::feeding`).
    pub feeding: Arc<AtomicUsize>,
}

pub(super) async fn run_batcher(
    labels: BatcherLabels,
    mut jobs: mpsc::Receiver<QueuedJob>,
    mut slots: mpsc::Receiver<Slot>,
    mut policy: BatchPolicy,
    signals: BatcherSignals,
) {
    let BatcherSignals {
        mut state,
        stop,
        flush,
        wake,
        feeding,
    } = signals;
    let model = labels.model.clone();
    let m = &labels.series;
    let mut queue = Queue::new(policy.queues.len());
    let has_timeouts = policy.has_timeouts();
    let mut idle: VecDeque<Slot> = VecDeque::new();
    let mut jobs_open = true;
    let mut state_open = true;
    let mut flushing = false;
    let down = || SchedulerError::Down {
        model: model.clone(),
    };
    let stopping = || SchedulerError::Stopping {
        model: model.clone(),
    };
    loop {
        // With every instance down (restarting), nothing would run what waits: it is
        // answered now, as what arrives until one is back.
        if matches!(*state.borrow(), ModelState::Down(_)) {
            queue.fail_all(down);
        }
        let mut timer = None;
        if has_timeouts {
            // Expired jobs are answered even while every instance is busy.
            queue.expire(Instant::now(), &policy, &model);
        }
        // Read before the jobs are taken in: a request stops feeding only once its last
        // job is sent, so with none feeding every row there is to come is in the channel.
        let rows_coming = feeding.load(Ordering::SeqCst) > 0;
        while let Ok(job) = jobs.try_recv() {
            queue.push(job);
        }
        // Whatever the queue delay, and while every instance is busy. Their requests count
        // as CANCELED where they are dropped (`Admission`).
        queue.drop_abandoned();
        while let Some(target) = idle.front().map(|s| s.target) {
            let now = Instant::now();
            match decide(
                queue.rows,
                queue.head_rows(),
                queue.oldest(),
                now,
                &policy,
                target,
                rows_coming,
            ) {
                Decision::Idle => break,
                Decision::Wait(until) => {
                    timer = Some(until);
                    break;
                }
                Decision::Cut(n) => {
                    let batch = queue.cut(n, !policy.merge_requests, |job| {
                        m.latency
                            .observe(Latency::Queue, micros(now - job.enqueued_at), 1);
                    });
                    let slot = idle.pop_front().expect("loop runs only with an idle slot");
                    if let Err(batch) = slot.batches.send(batch) {
                        // The instance thread ended between offering and receiving.
                        for (job, _) in batch.parts {
                            job.fail(stopping());
                        }
                    }
                }
            }
        }
        if has_timeouts {
            timer = [timer, queue.next_deadline()].into_iter().flatten().min();
        }
        m.pending_requests.set(queue.requests() as i64);
        m.pending_rows.set(queue.rows as i64);
        if !jobs_open && queue.is_empty() {
            break; // drained: dropping the slots ends the instance threads
        }
        let sleep = async {
            match timer {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            slot = slots.recv() => match slot {
                Some(slot) => idle.push_back(slot),
                None => {
                    // Every instance is gone: nothing can run what is queued.
                    queue.fail_all(stopping);
                    break;
                }
            },
            job = jobs.recv(), if jobs_open => match job {
                Some(job) => queue.push(job),
                None => jobs_open = false,
            },
            changed = state.changed(), if state_open => state_open = changed.is_ok(),
            _ = flush.cancelled(), if !flushing => {
                // Retiring: what is queued runs as soon as an instance is free.
                flushing = true;
                policy.max_queue_delay = std::time::Duration::ZERO;
            }
            _ = wake.notified() => {}
            _ = sleep => {}
            _ = stop.cancelled() => {
                queue.fail_all(stopping);
                break;
            }
        }
    }
    // Whatever was queued has been answered: nothing of this model waits any longer.
    m.pending_requests.set(0);
    m.pending_rows.set(0);
    tracing::debug!(model, "batcher stopped");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Normalize;
    use crate::engine::OutputRequest;
    use crate::scheduler::{JobResult, JobRows, QueuePolicy, RowFormat};
    use std::time::Duration;
    use tokio::sync::{oneshot, Semaphore};

    fn job_at(
        rows: usize,
        mean: f32,
        level: usize,
        timeout: Option<Duration>,
    ) -> (QueuedJob, oneshot::Receiver<JobResult>) {
        let (tx, rx) = oneshot::channel();
        let job = JobRows {
            rows: vec![crate::preprocess::Row::Bytes(bytes::Bytes::from_static(&[0u8; 3])); rows],
            format: RowFormat::Image(Normalize {
                mean: [mean; 3],
                std: [1.0; 3],
            }),
            want: OutputRequest::default(),
        };
        let permit = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let place = Arc::new(QueuePlace::new(permit, Default::default()));
        (
            QueuedJob {
                job: Arc::new(Job::new(job, tx)),
                place,
                level,
                timeout,
            },
            rx,
        )
    }

    fn job(rows: usize, mean: f32) -> (QueuedJob, oneshot::Receiver<JobResult>) {
        job_at(rows, mean, 0, None)
    }

    fn ranges(b: &Batch) -> Vec<std::ops::Range<usize>> {
        b.parts.iter().map(|(_, r)| r.clone()).collect()
    }

    fn policy(levels: usize, action: TimeoutAction) -> BatchPolicy {
        BatchPolicy {
            queues: vec![
                QueuePolicy {
                    timeout_action: action,
                    default_timeout: Some(Duration::from_millis(10)),
                    allow_timeout_override: false,
                    capacity: 8,
                };
                levels
            ],
            ..BatchPolicy::single_queue(32, 8)
        }
    }

    /// A second job of `first`'s request.
    fn same_request(first: &QueuedJob, rows: usize) -> (QueuedJob, oneshot::Receiver<JobResult>) {
        let (mut next, rx) = job(rows, 0.0);
        Arc::get_mut(&mut next.job).unwrap().request = first.job.request.clone();
        (next, rx)
    }

    #[test]
    fn cut_splits_a_large_job_into_ranges_and_merges_small_ones() {
        let mut q = Queue::new(1);
        let (a, _ra) = job(5, 0.0);
        let (a2, _ra2) = same_request(&a, 2);
        q.push(a);
        q.push(a2);
        assert_eq!(q.requests(), 1);
        assert_eq!(q.head_rows(), 7);
        assert_eq!(ranges(&q.cut(3, false, |_| {})), vec![0..3]);
        assert_eq!(ranges(&q.cut(4, false, |_| {})), vec![3..5, 0..2]);
        assert_eq!(q.rows, 0);
        assert!(q.is_empty());
    }

    #[test]
    fn a_request_behind_a_large_one_shares_the_next_batch() {
        let mut q = Queue::new(1);
        let (large, _rl) = job(100, 0.0);
        let (single, _rs) = job(1, 0.0);
        let (large_job, single_job) = (large.job.clone(), single.job.clone());
        q.push(large);
        q.push(single);
        // Four rows each at most; what the single request leaves goes back to the large one.
        let b = q.cut(8, false, |_| {});
        assert_eq!(ranges(&b), vec![0..4, 0..1, 4..7]);
        assert!(Arc::ptr_eq(&b.parts[0].0, &large_job));
        assert!(Arc::ptr_eq(&b.parts[1].0, &single_job));
        assert_eq!(q.rows, 93);
        // Three requests: the later two are not kept waiting for the first one's turn.
        let (b2, _r2) = job(5, 0.0);
        let (b3, _r3) = job(5, 0.0);
        q.push(b2);
        q.push(b3);
        assert_eq!(ranges(&q.cut(6, false, |_| {})), vec![7..9, 0..2, 0..2]);
        assert_eq!(ranges(&q.cut(6, false, |_| {})), vec![9..11, 2..4, 2..4]);
    }

    #[test]
    fn without_dynamic_batching_a_batch_is_one_request_and_requests_take_turns() {
        let mut q = Queue::new(1);
        let (a, _ra) = job(3, 0.0);
        let (a2, _ra2) = same_request(&a, 3);
        let (b, _rb) = job(2, 0.0);
        let (a_job, b_job) = (a.job.clone(), b.job.clone());
        q.push(a);
        q.push(a2);
        q.push(b);
        let first = q.cut(4, true, |_| {});
        assert_eq!(ranges(&first), vec![0..3, 0..1]);
        assert!(Arc::ptr_eq(&first.parts[0].0, &a_job));
        let second = q.cut(q.head_rows(), true, |_| {});
        assert_eq!(ranges(&second), vec![0..2]);
        assert!(Arc::ptr_eq(&second.parts[0].0, &b_job));
        assert_eq!(q.head_rows(), 2);
    }

    #[test]
    fn cut_never_mixes_normalizations() {
        let mut q = Queue::new(1);
        let (a, _ra) = job(2, 0.0);
        let (b, _rb) = job(2, 0.5);
        q.push(a);
        q.push(b);
        assert_eq!(q.cut(4, false, |_| {}).rows(), 2);
        assert_eq!(q.rows, 2);
    }

    #[test]
    fn abandoned_jobs_are_dropped_with_their_rows() {
        let mut q = Queue::new(1);
        let (a, ra) = job(3, 0.0);
        let (b, _rb) = job(2, 0.0);
        q.push(a);
        q.push(b);
        drop(ra);
        assert_eq!(q.drop_abandoned(), 1);
        assert_eq!(q.rows, 2);
        assert_eq!(q.requests(), 1);
    }

    #[test]
    fn higher_priority_rows_are_cut_first_even_when_they_came_later() {
        let mut q = Queue::new(2);
        let (low, _rl) = job_at(3, 0.0, 1, None);
        let (high, _rh) = job_at(2, 0.0, 0, None);
        let low_job = low.job.clone();
        let high_job = high.job.clone();
        q.push(low);
        q.push(high);
        assert_eq!(q.head_rows(), 2);
        let b = q.cut(4, false, |_| {});
        assert!(Arc::ptr_eq(&b.parts[0].0, &high_job));
        assert!(Arc::ptr_eq(&b.parts[1].0, &low_job));
        assert_eq!(ranges(&b), vec![0..2, 0..2]);
        assert_eq!(q.rows, 1);
    }

    #[test]
    fn an_expired_job_is_rejected_with_a_timeout_under_reject() {
        let p = policy(1, TimeoutAction::Reject);
        let mut q = Queue::new(1);
        let (a, mut ra) = job_at(2, 0.0, 0, Some(Duration::from_millis(10)));
        let (b, mut rb) = job(1, 0.0);
        let t0 = a.job.enqueued_at;
        q.push(a);
        q.push(b);
        q.expire(t0 + Duration::from_millis(5), &p, "m");
        assert_eq!(q.requests(), 2, "not yet expired");
        assert_eq!(q.next_deadline(), Some(t0 + Duration::from_millis(10)));
        q.expire(t0 + Duration::from_millis(11), &p, "m");
        assert_eq!(q.requests(), 1);
        assert_eq!(q.rows, 1);
        match ra.try_recv() {
            Ok(Err(SchedulerError::Expired { timeout_ms, .. })) => assert_eq!(timeout_ms, 10),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(rb.try_recv().is_err(), "the other job is still waiting");
        assert_eq!(q.next_deadline(), None);
    }

    #[test]
    fn an_expired_job_runs_after_everything_else_under_delay() {
        let p = policy(1, TimeoutAction::Delay);
        let mut q = Queue::new(1);
        let (a, mut ra) = job_at(1, 0.0, 0, Some(Duration::from_millis(10)));
        let (b, _rb) = job(1, 0.0);
        let (a_job, b_job) = (a.job.clone(), b.job.clone());
        let t0 = a.job.enqueued_at;
        q.push(a);
        q.push(b);
        q.expire(t0 + Duration::from_millis(20), &p, "m");
        assert!(ra.try_recv().is_err(), "delayed, not answered");
        assert_eq!(q.rows, 2);
        let first = q.cut(1, false, |_| {});
        assert!(Arc::ptr_eq(&first.parts[0].0, &b_job));
        let second = q.cut(1, false, |_| {});
        assert!(Arc::ptr_eq(&second.parts[0].0, &a_job));
    }

    #[test]
    fn a_job_whose_rows_started_never_times_out() {
        let p = policy(1, TimeoutAction::Reject);
        let mut q = Queue::new(1);
        let (a, mut ra) = job_at(5, 0.0, 0, Some(Duration::from_millis(10)));
        let t0 = a.job.enqueued_at;
        q.push(a);
        q.cut(2, false, |_| {});
        q.expire(t0 + Duration::from_secs(1), &p, "m");
        assert_eq!(q.rows, 3);
        assert!(ra.try_recv().is_err());
    }

    #[test]
    fn a_later_chunk_of_a_started_request_never_times_out() {
        let p = policy(1, TimeoutAction::Reject);
        let mut q = Queue::new(1);
        let (a, _ra) = job_at(2, 0.0, 0, Some(Duration::from_millis(10)));
        let (mut b, mut rb) = job_at(2, 0.0, 0, Some(Duration::from_millis(10)));
        // Two chunks of one request.
        Arc::get_mut(&mut b.job).unwrap().request = a.job.request.clone();
        let t0 = a.job.enqueued_at;
        q.push(a);
        q.push(b);
        q.cut(2, false, |_| {});
        q.expire(t0 + Duration::from_secs(1), &p, "m");
        assert_eq!(q.rows, 2);
        assert!(rb.try_recv().is_err(), "its request already started");
    }
}
