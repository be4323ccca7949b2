//! The batcher task of one model: owns the pending jobs and the idle instance slots, and
//! cuts a batch only when an instance is idle (so batches grow while all are busy).
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::handle::QueuePlace;
use super::instance::Slot;
use super::policy::{decide, BatchPolicy, Decision};
use super::{Admitted, Batch, JobState, ModelState, SchedulerError};
use crate::domain::TimeoutAction;
use crate::telemetry::{micros, Metrics};

/// A job waiting in the batcher, with how many of its rows were already cut.
struct Pending {
    job: Arc<JobState>,
    next_row: usize,
    /// When the job times out if none of its rows was cut by then.
    deadline: Option<Instant>,
    /// Frees the request's queue place when its last job leaves the queue.
    _place: Arc<QueuePlace>,
}

impl Pending {
    fn rows_left(&self) -> usize {
        self.job.rows() - self.next_row
    }
}

/// The pending jobs: one FIFO per priority level, highest first, and after them the jobs
/// whose timeout passed under `DELAY`, which run only when nothing else waits.
struct Queue {
    levels: Vec<VecDeque<Pending>>,
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

    fn push(&mut self, admitted: Admitted) {
        self.rows += admitted.job.rows();
        let level = admitted.level.min(self.delayed_level() - 1);
        let deadline = admitted.timeout.map(|t| admitted.job.enqueued_at + t);
        self.levels[level].push_back(Pending {
            job: admitted.job,
            next_row: 0,
            deadline,
            _place: admitted.place,
        });
    }

    fn jobs(&self) -> impl Iterator<Item = &Pending> {
        self.levels.iter().flatten()
    }

    fn len(&self) -> usize {
        self.levels.iter().map(VecDeque::len).sum()
    }

    fn is_empty(&self) -> bool {
        self.levels.iter().all(VecDeque::is_empty)
    }

    /// Drops jobs nobody waits for any more (their client disconnected); returns how many.
    fn drop_abandoned(&mut self) -> usize {
        let rows = &mut self.rows;
        let mut dropped = 0;
        for level in &mut self.levels {
            level.retain(|p| {
                let keep = !p.job.abandoned();
                if !keep {
                    *rows -= p.rows_left();
                    dropped += 1;
                }
                keep
            });
        }
        dropped
    }

    /// Jobs none of whose rows was cut by their deadline: under `Reject` they are answered
    /// with a timeout and leave, under `Delay` they move behind every other job.
    fn expire(&mut self, now: Instant, policy: &BatchPolicy, model: &str) {
        let delayed = self.delayed_level();
        for level in 0..delayed {
            let action = policy
                .queues
                .get(level)
                .map_or(TimeoutAction::Reject, |q| q.timeout_action);
            let mut i = 0;
            while i < self.levels[level].len() {
                let p = &self.levels[level][i];
                let expired = !p.job.request.started() && p.deadline.is_some_and(|d| now >= d);
                if !expired {
                    i += 1;
                    continue;
                }
                let mut p = self.levels[level]
                    .remove(i)
                    .expect("index checked against the length");
                match action {
                    TimeoutAction::Reject => {
                        self.rows -= p.rows_left();
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
                        self.levels[delayed].push_back(p);
                    }
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

    fn head(&self) -> Option<&Pending> {
        self.levels.iter().find_map(|l| l.front())
    }

    fn head_rows(&self) -> usize {
        self.head().map_or(0, Pending::rows_left)
    }

    /// The longest-waiting job at the front of any level.
    fn oldest(&self) -> Option<Instant> {
        self.levels
            .iter()
            .filter_map(|l| l.front())
            .map(|p| p.job.enqueued_at)
            .min()
    }

    /// Takes up to `n` rows, highest priority first. Only jobs with the same row format
    /// (normalization) share a batch, since the whole batch is normalized at once on the device.
    /// Marks each request whose first rows leave the queue started (it can no longer time
    /// out) and calls `started(job)` with the job they came from (its wait is the request's
    /// queue time).
    fn cut(&mut self, n: usize, mut started: impl FnMut(&JobState)) -> Batch {
        let mut parts: Vec<(Arc<JobState>, std::ops::Range<usize>)> = Vec::new();
        let mut left = n;
        while left > 0 {
            let Some(level) = self.levels.iter_mut().find(|l| !l.is_empty()) else {
                break;
            };
            let front = level.front_mut().expect("level is not empty");
            if let Some((first, _)) = parts.first() {
                if first.job.format != front.job.job.format {
                    break;
                }
            }
            if front.job.request.start() {
                started(&front.job);
            }
            let take = left.min(front.rows_left());
            let range = front.next_row..front.next_row + take;
            front.next_row += take;
            parts.push((front.job.clone(), range));
            left -= take;
            if front.rows_left() == 0 {
                level.pop_front();
            }
        }
        self.rows -= n - left;
        Batch { parts }
    }
}

/// Who the batcher works for, for logs and metrics.
pub(super) struct BatcherLabels {
    pub model: String,
    pub version: String,
    pub metrics: Arc<Metrics>,
}

pub(super) async fn run_batcher(
    labels: BatcherLabels,
    mut jobs: mpsc::Receiver<Admitted>,
    mut slots: mpsc::Receiver<Slot>,
    policy: BatchPolicy,
    mut state: watch::Receiver<ModelState>,
    stop: CancellationToken,
) {
    let model = labels.model.clone();
    let mv = [labels.model.as_str(), labels.version.as_str()];
    let m = &labels.metrics;
    let pending_gauge = m.pending_requests.with_label_values(&mv);
    let queue_us = m.queue_duration_us.with_label_values(&mv);
    let mut queue = Queue::new(policy.queues.len());
    let has_timeouts = policy.has_timeouts();
    let mut idle: VecDeque<Slot> = VecDeque::new();
    let mut jobs_open = true;
    let mut state_open = true;
    let fail_all = |queue: &mut Queue| {
        for level in &mut queue.levels {
            for p in level.drain(..) {
                p.job.fail(SchedulerError::NotReady {
                    model: model.clone(),
                });
            }
        }
        queue.rows = 0;
    };
    loop {
        // With every instance down (restarting), nothing would run what waits: it is
        // answered now, as what arrives until one is back.
        if matches!(*state.borrow(), ModelState::Down(_)) {
            fail_all(&mut queue);
        }
        let mut timer = None;
        if has_timeouts {
            // Expired jobs are answered even while every instance is busy.
            queue.expire(Instant::now(), &policy, &model);
        }
        while let Some(target) = idle.front().map(|s| s.target) {
            // Their requests count as CANCELED where they are dropped (`Admission`).
            queue.drop_abandoned();
            let now = Instant::now();
            match decide(
                queue.rows,
                queue.head_rows(),
                queue.oldest(),
                now,
                &policy,
                target,
            ) {
                Decision::Idle => break,
                Decision::Wait(until) => {
                    timer = Some(until);
                    break;
                }
                Decision::Cut(n) => {
                    let batch = queue.cut(n, |job| {
                        queue_us.inc_by(micros(now - job.enqueued_at));
                    });
                    let slot = idle.pop_front().expect("loop runs only with an idle slot");
                    if let Err(batch) = slot.batches.send(batch) {
                        // The instance thread ended between offering and receiving.
                        for (job, _) in batch.parts {
                            job.fail(SchedulerError::NotReady {
                                model: model.clone(),
                            });
                        }
                    }
                }
            }
        }
        if has_timeouts {
            timer = [timer, queue.next_deadline()].into_iter().flatten().min();
        }
        pending_gauge.set(queue.len() as i64);
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
                    fail_all(&mut queue);
                    break;
                }
            },
            job = jobs.recv(), if jobs_open => match job {
                Some(job) => queue.push(job),
                None => jobs_open = false,
            },
            changed = state.changed(), if state_open => state_open = changed.is_ok(),
            _ = sleep => {}
            _ = stop.cancelled() => {
                fail_all(&mut queue);
                break;
            }
        }
    }
    tracing::debug!(model, "batcher stopped");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Normalize;
    use crate::engine::OutputRequest;
    use crate::scheduler::{InferJob, JobResult, QueuePolicy, RowFormat};
    use std::time::Duration;
    use tokio::sync::{oneshot, Semaphore};

    fn job_at(
        rows: usize,
        mean: f32,
        level: usize,
        timeout: Option<Duration>,
    ) -> (Admitted, oneshot::Receiver<JobResult>) {
        let (tx, rx) = oneshot::channel();
        let job = InferJob {
            rows: vec![bytes::Bytes::from_static(&[0u8; 3]); rows],
            format: RowFormat::Image(Normalize {
                mean: [mean; 3],
                std: [1.0; 3],
            }),
            want: OutputRequest {
                top_k: 1,
                logits: false,
            },
        };
        let permit = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let place = Arc::new(QueuePlace::new(permit, Default::default()));
        (
            Admitted {
                job: Arc::new(JobState::new(job, tx)),
                place,
                level,
                timeout,
            },
            rx,
        )
    }

    fn job(rows: usize, mean: f32) -> (Admitted, oneshot::Receiver<JobResult>) {
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

    #[test]
    fn cut_splits_a_large_job_into_ranges_and_merges_small_ones() {
        let mut q = Queue::new(1);
        let (a, _ra) = job(5, 0.0);
        let (b, _rb) = job(2, 0.0);
        q.push(a);
        q.push(b);
        assert_eq!(ranges(&q.cut(3, |_| {})), vec![0..3]);
        assert_eq!(ranges(&q.cut(4, |_| {})), vec![3..5, 0..2]);
        assert_eq!(q.rows, 0);
        assert!(q.is_empty());
    }

    #[test]
    fn cut_never_mixes_normalizations() {
        let mut q = Queue::new(1);
        let (a, _ra) = job(2, 0.0);
        let (b, _rb) = job(2, 0.5);
        q.push(a);
        q.push(b);
        assert_eq!(q.cut(4, |_| {}).rows(), 2);
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
        assert_eq!(q.len(), 1);
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
        let b = q.cut(4, |_| {});
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
        assert_eq!(q.len(), 2, "not yet expired");
        assert_eq!(q.next_deadline(), Some(t0 + Duration::from_millis(10)));
        q.expire(t0 + Duration::from_millis(11), &p, "m");
        assert_eq!(q.len(), 1);
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
        let first = q.cut(1, |_| {});
        assert!(Arc::ptr_eq(&first.parts[0].0, &b_job));
        let second = q.cut(1, |_| {});
        assert!(Arc::ptr_eq(&second.parts[0].0, &a_job));
    }

    #[test]
    fn a_job_whose_rows_started_never_times_out() {
        let p = policy(1, TimeoutAction::Reject);
        let mut q = Queue::new(1);
        let (a, mut ra) = job_at(5, 0.0, 0, Some(Duration::from_millis(10)));
        let t0 = a.job.enqueued_at;
        q.push(a);
        q.cut(2, |_| {});
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
        q.cut(2, |_| {});
        q.expire(t0 + Duration::from_secs(1), &p, "m");
        assert_eq!(q.rows, 2);
        assert!(rb.try_recv().is_err(), "its request already started");
    }
}
