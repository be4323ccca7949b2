//! The batcher task of one model: owns the pending jobs and the idle instance slots, and
//! cuts a batch only when an instance is idle (so batches grow while all are busy).
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio_util::sync::CancellationToken;

use super::instance::Slot;
use super::policy::{decide, BatchPolicy, Decision};
use super::{Admitted, Batch, JobState, SchedulerError};
use crate::telemetry::{micros, reason, Metrics};

/// A job waiting in the batcher, with how many of its rows were already cut.
struct Pending {
    job: Arc<JobState>,
    next_row: usize,
    /// Frees the request's queue place when its last job leaves the queue.
    _permit: Arc<OwnedSemaphorePermit>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Pending>,
    rows: usize,
}

impl Queue {
    fn push(&mut self, admitted: Admitted) {
        self.rows += admitted.job.rows();
        self.jobs.push_back(Pending {
            job: admitted.job,
            next_row: 0,
            _permit: admitted.permit,
        });
    }

    /// Drops jobs nobody waits for any more (their client disconnected); returns how many.
    fn drop_abandoned(&mut self) -> usize {
        let rows = &mut self.rows;
        let before = self.jobs.len();
        self.jobs.retain(|p| {
            let keep = !p.job.abandoned();
            if !keep {
                *rows -= p.job.rows() - p.next_row;
            }
            keep
        });
        before - self.jobs.len()
    }

    fn head_rows(&self) -> usize {
        self.jobs.front().map_or(0, |p| p.job.rows() - p.next_row)
    }

    fn oldest(&self) -> Option<Instant> {
        self.jobs.front().map(|p| p.job.enqueued_at)
    }

    /// Takes up to `n` rows from the front. Only jobs with the same normalization share a
    /// batch, since the whole batch is normalized at once on the device. Calls
    /// `started(job)` for each job whose first rows leave the queue.
    fn cut(&mut self, n: usize, mut started: impl FnMut(&JobState)) -> Batch {
        let mut parts = Vec::new();
        let mut left = n;
        while left > 0 {
            let Some(front) = self.jobs.front_mut() else {
                break;
            };
            if let Some((first, _)) = parts.first() {
                let first: &Arc<JobState> = first;
                if first.job.normalize != front.job.job.normalize {
                    break;
                }
            }
            if front.next_row == 0 {
                started(&front.job);
            }
            let take = left.min(front.job.rows() - front.next_row);
            let range = front.next_row..front.next_row + take;
            front.next_row += take;
            parts.push((front.job.clone(), range));
            left -= take;
            if front.next_row == front.job.rows() {
                self.jobs.pop_front();
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
    stop: CancellationToken,
) {
    let model = labels.model.clone();
    let mv = [labels.model.as_str(), labels.version.as_str()];
    let m = &labels.metrics;
    let pending_gauge = m.pending_requests.with_label_values(&mv);
    let queue_us = m.queue_duration_us.with_label_values(&mv);
    let canceled = m
        .request_failure
        .with_label_values(&[mv[0], mv[1], reason::CANCELED]);
    let mut queue = Queue::default();
    let mut idle: VecDeque<Slot> = VecDeque::new();
    let mut jobs_open = true;
    loop {
        let mut timer = None;
        while let Some(target) = idle.front().map(|s| s.target) {
            canceled.inc_by(queue.drop_abandoned() as u64);
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
                    let batch = queue.cut(n, |job| queue_us.inc_by(micros(now - job.enqueued_at)));
                    let slot = idle.pop_front().expect("loop runs only with an idle slot");
                    if let Err(batch) = slot.batches.send(batch) {
                        // The instance thread ended between offering and receiving.
                        for (job, _) in batch.parts {
                            job.fail(SchedulerError::NotReady(model.clone()));
                        }
                    }
                }
            }
        }
        pending_gauge.set(queue.jobs.len() as i64);
        if !jobs_open && queue.jobs.is_empty() {
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
                    for p in queue.jobs.drain(..) {
                        p.job.fail(SchedulerError::NotReady(model.clone()));
                    }
                    break;
                }
            },
            job = jobs.recv(), if jobs_open => match job {
                Some(job) => queue.push(job),
                None => jobs_open = false,
            },
            _ = sleep => {}
            _ = stop.cancelled() => {
                for p in queue.jobs.drain(..) {
                    p.job.fail(SchedulerError::NotReady(model.clone()));
                }
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
    use crate::scheduler::InferJob;
    use tokio::sync::{oneshot, Semaphore};

    fn job(rows: usize, mean: f32) -> (Admitted, oneshot::Receiver<super::super::JobResult>) {
        let (tx, rx) = oneshot::channel();
        let job = InferJob {
            rows: vec![vec![0u8; 3]; rows],
            normalize: Normalize {
                mean: [mean; 3],
                std: [1.0; 3],
            },
            want: OutputRequest {
                top_k: 1,
                logits: false,
            },
        };
        let permit = Arc::new(Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap());
        (
            Admitted {
                job: Arc::new(JobState::new(job, tx)),
                permit,
            },
            rx,
        )
    }

    #[test]
    fn cut_splits_a_large_job_into_ranges_and_merges_small_ones() {
        let mut q = Queue::default();
        let (a, _ra) = job(5, 0.0);
        let (b, _rb) = job(2, 0.0);
        q.push(a);
        q.push(b);
        let first = q.cut(3, |_| {});
        assert_eq!(
            first
                .parts
                .iter()
                .map(|(_, r)| r.clone())
                .collect::<Vec<_>>(),
            vec![0..3]
        );
        let second = q.cut(4, |_| {});
        assert_eq!(
            second
                .parts
                .iter()
                .map(|(_, r)| r.clone())
                .collect::<Vec<_>>(),
            vec![3..5, 0..2]
        );
        assert_eq!(q.rows, 0);
        assert!(q.jobs.is_empty());
    }

    #[test]
    fn cut_never_mixes_normalizations() {
        let mut q = Queue::default();
        let (a, _ra) = job(2, 0.0);
        let (b, _rb) = job(2, 0.5);
        q.push(a);
        q.push(b);
        assert_eq!(q.cut(4, |_| {}).rows(), 2);
        assert_eq!(q.rows, 2);
    }

    #[test]
    fn abandoned_jobs_are_dropped_with_their_rows() {
        let mut q = Queue::default();
        let (a, ra) = job(3, 0.0);
        let (b, _rb) = job(2, 0.0);
        q.push(a);
        q.push(b);
        drop(ra);
        q.drop_abandoned();
        assert_eq!(q.rows, 2);
        assert_eq!(q.jobs.len(), 1);
    }
}
