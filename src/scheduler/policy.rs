//! Batching decisions as a pure function of (pending rows, now, policy, the idle
//! instance's target batch size), and the queue rules of Triton's `ModelQueuePolicy`.
use std::time::{Duration, Instant};

use crate::domain::TimeoutAction;

#[derive(Debug, Clone, PartialEq)]
pub struct BatchPolicy {
    pub max_batch_size: usize,
    pub max_queue_delay: Duration,
    /// The smallest `preferred_batch_size` within `max_batch_size` (`None`: none is): with
    /// no more rows on their way, pending rows that make it go without waiting.
    pub smallest_preferred: Option<usize>,
    /// `dynamic_batching` present: rows of different requests may share a batch.
    pub merge_requests: bool,
    /// One queue per priority level, highest priority first.
    pub queues: Vec<QueuePolicy>,
    /// The level of a request that names none (or one the model does not have).
    pub default_level: usize,
}

impl BatchPolicy {
    /// One level, no timeouts: what a model without `dynamic_batching` gets.
    pub fn single_queue(max_batch_size: usize, capacity: usize) -> Self {
        BatchPolicy {
            max_batch_size,
            max_queue_delay: Duration::ZERO,
            smallest_preferred: None,
            merge_requests: false,
            queues: vec![QueuePolicy::without_timeout(capacity)],
            default_level: 0,
        }
    }

    /// Triton's rule: priority 1 is the highest; 0 or a level past `priority_levels`
    /// means the default level. Returns an index into `queues`.
    pub fn level(&self, priority: u64) -> usize {
        match usize::try_from(priority) {
            Ok(p) if p >= 1 && p <= self.queues.len() => p - 1,
            _ => self.default_level.min(self.queues.len().saturating_sub(1)),
        }
    }

    /// Whether any request can ever time out in the queue.
    pub fn has_timeouts(&self) -> bool {
        self.queues
            .iter()
            .any(|q| q.default_timeout.is_some() || q.allow_timeout_override)
    }
}

/// Triton's `ModelQueuePolicy` of one priority level.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuePolicy {
    pub timeout_action: TimeoutAction,
    pub default_timeout: Option<Duration>,
    pub allow_timeout_override: bool,
    /// Requests that may wait at this level; one more is refused with `Overloaded`.
    pub capacity: usize,
}

impl QueuePolicy {
    pub fn without_timeout(capacity: usize) -> Self {
        QueuePolicy {
            timeout_action: TimeoutAction::Reject,
            default_timeout: None,
            allow_timeout_override: false,
            capacity,
        }
    }

    /// The queue timeout of a request that asked for `requested`: the default, unless
    /// overriding is allowed and the request asks for a shorter one (no default means no
    /// limit, so any requested timeout is shorter). A zero request means "not set".
    pub fn timeout_for(&self, requested: Option<Duration>) -> Option<Duration> {
        let requested = requested.filter(|t| !t.is_zero() && self.allow_timeout_override);
        match (self.default_timeout, requested) {
            (default, None) => default,
            (None, Some(r)) => Some(r),
            (Some(d), Some(r)) => Some(d.min(r)),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Nothing to do until something arrives.
    Idle,
    /// Cut a batch of this many rows now.
    Cut(usize),
    /// Wait for more rows until then, and cut whatever is there.
    Wait(Instant),
}

/// What to do with `pending_rows` rows (the oldest enqueued at `oldest`, the first job
/// having `head_rows` rows not yet cut) for an idle instance whose best batch size is
/// `target`: a full target batch goes at once. Fewer rows wait up to the queue delay while
/// `rows_coming` (an admitted request still has rows to submit: they arrive within a decode,
/// and waiting for them fills the batch the instance measured as fastest). With none on
/// their way, they go at once where Triton's batcher sends a batch without waiting (the
/// rows make at least one preferred batch size), in one batch: Triton would send the
/// largest preferred size of whole requests and leave the rest for the next, so this is
/// never later and never smaller. Fewer rows than any preferred size wait up to the queue
/// delay, as there.
pub fn decide(
    pending_rows: usize,
    head_rows: usize,
    oldest: Option<Instant>,
    now: Instant,
    policy: &BatchPolicy,
    target: usize,
    rows_coming: bool,
) -> Decision {
    let Some(oldest) = oldest.filter(|_| pending_rows > 0) else {
        return Decision::Idle;
    };
    let max = policy.max_batch_size.max(1);
    if !policy.merge_requests {
        // Without dynamic batching each request runs alone (cut to max_batch_size).
        return Decision::Cut(head_rows.clamp(1, max));
    }
    let target = target.clamp(1, max);
    if pending_rows >= target {
        return Decision::Cut(target);
    }
    let deadline = oldest + policy.max_queue_delay;
    let preferred_now =
        !rows_coming && policy.smallest_preferred.is_some_and(|n| n <= pending_rows);
    if now >= deadline || preferred_now {
        Decision::Cut(pending_rows)
    } else {
        Decision::Wait(deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> BatchPolicy {
        BatchPolicy {
            max_batch_size: 32,
            max_queue_delay: Duration::from_millis(2),
            smallest_preferred: None,
            merge_requests: true,
            queues: vec![QueuePolicy::without_timeout(8)],
            default_level: 0,
        }
    }

    #[test]
    fn priorities_follow_triton_one_is_highest_zero_and_unknown_mean_default() {
        let p = BatchPolicy {
            queues: vec![QueuePolicy::without_timeout(8); 3],
            default_level: 1,
            ..policy()
        };
        assert_eq!(p.level(1), 0);
        assert_eq!(p.level(3), 2);
        assert_eq!(p.level(0), 1);
        assert_eq!(p.level(4), 1);
        assert_eq!(p.level(u64::MAX), 1);
    }

    #[test]
    fn a_request_may_only_shorten_its_timeout_and_only_where_allowed() {
        let ms = Duration::from_millis;
        let mut q = QueuePolicy::without_timeout(8);
        assert_eq!(q.timeout_for(Some(ms(5))), None, "override not allowed");
        q.allow_timeout_override = true;
        assert_eq!(q.timeout_for(Some(ms(5))), Some(ms(5)));
        assert_eq!(q.timeout_for(Some(Duration::ZERO)), None);
        q.default_timeout = Some(ms(100));
        assert_eq!(q.timeout_for(None), Some(ms(100)));
        assert_eq!(q.timeout_for(Some(ms(5))), Some(ms(5)));
        assert_eq!(q.timeout_for(Some(ms(500))), Some(ms(100)), "never longer");
        q.allow_timeout_override = false;
        assert_eq!(q.timeout_for(Some(ms(5))), Some(ms(100)));
    }

    #[test]
    fn nothing_pending_is_idle() {
        let now = Instant::now();
        assert_eq!(decide(0, 0, None, now, &policy(), 8, false), Decision::Idle);
    }

    #[test]
    fn a_full_target_batch_is_cut_at_once() {
        let now = Instant::now();
        assert_eq!(
            decide(1000, 1000, Some(now), now, &policy(), 16, false),
            Decision::Cut(16)
        );
        assert_eq!(
            decide(9, 3, Some(now), now, &policy(), 8, false),
            Decision::Cut(8)
        );
        assert_eq!(
            decide(5, 5, Some(now), now, &policy(), 1, false),
            Decision::Cut(1)
        );
    }

    #[test]
    fn the_target_never_exceeds_max_batch_size() {
        let now = Instant::now();
        assert_eq!(
            decide(100, 100, Some(now), now, &policy(), 500, false),
            Decision::Cut(32)
        );
    }

    #[test]
    fn fewer_rows_wait_for_the_queue_delay_then_go() {
        let t0 = Instant::now();
        let p = policy();
        assert_eq!(
            decide(3, 3, Some(t0), t0, &p, 8, false),
            Decision::Wait(t0 + Duration::from_millis(2))
        );
        let later = t0 + Duration::from_millis(3);
        assert_eq!(
            decide(3, 3, Some(t0), later, &p, 8, false),
            Decision::Cut(3)
        );
    }

    #[test]
    fn with_no_rows_on_their_way_rows_that_make_a_preferred_size_go_at_once_together() {
        let t0 = Instant::now();
        let p = BatchPolicy {
            smallest_preferred: Some(1), // [1, 2, 4, 8, 16, 32]
            ..policy()
        };
        // Where Triton would send a preferred size now, every pending row goes in one batch.
        assert_eq!(decide(3, 3, Some(t0), t0, &p, 8, false), Decision::Cut(3));
        assert_eq!(decide(1, 1, Some(t0), t0, &p, 8, false), Decision::Cut(1));
        assert_eq!(decide(7, 1, Some(t0), t0, &p, 8, false), Decision::Cut(7));
        assert_eq!(decide(12, 1, Some(t0), t0, &p, 8, false), Decision::Cut(8));
        // A request still submitting rows: they fill the measured size within the delay,
        // and past it what is there goes.
        assert_eq!(
            decide(3, 3, Some(t0), t0, &p, 8, true),
            Decision::Wait(t0 + Duration::from_millis(2))
        );
        let later = t0 + Duration::from_millis(3);
        assert_eq!(decide(3, 3, Some(t0), later, &p, 8, true), Decision::Cut(3));
        // Fewer rows than any preferred size wait, as in Triton's batcher.
        let from_four = BatchPolicy {
            smallest_preferred: Some(4), // [4, 8]
            ..policy()
        };
        assert_eq!(
            decide(3, 3, Some(t0), t0, &from_four, 8, false),
            Decision::Wait(t0 + Duration::from_millis(2))
        );
        assert_eq!(
            decide(5, 5, Some(t0), t0, &from_four, 8, false),
            Decision::Cut(5)
        );
    }

    #[test]
    fn without_dynamic_batching_requests_run_alone_cut_to_the_max() {
        let t0 = Instant::now();
        let p = BatchPolicy {
            merge_requests: false,
            ..policy()
        };
        assert_eq!(decide(10, 3, Some(t0), t0, &p, 8, false), Decision::Cut(3));
        assert_eq!(
            decide(100, 100, Some(t0), t0, &p, 8, false),
            Decision::Cut(32)
        );
    }
}
