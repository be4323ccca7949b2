//! Batching decisions as a pure function of (pending rows, now, policy, the idle
//! instance's target batch size).
use std::time::{Duration, Instant};

#[derive(Debug, Clone, PartialEq)]
pub struct BatchPolicy {
    pub max_batch_size: usize,
    pub max_queue_delay: Duration,
    /// `dynamic_batching` present: rows of different requests may share a batch.
    pub merge_requests: bool,
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
/// `target`: a full target batch goes at once; fewer rows wait up to the queue delay.
pub fn decide(
    pending_rows: usize,
    head_rows: usize,
    oldest: Option<Instant>,
    now: Instant,
    policy: &BatchPolicy,
    target: usize,
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
    if now >= deadline {
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
            merge_requests: true,
        }
    }

    #[test]
    fn nothing_pending_is_idle() {
        let now = Instant::now();
        assert_eq!(decide(0, 0, None, now, &policy(), 8), Decision::Idle);
    }

    #[test]
    fn a_full_target_batch_is_cut_at_once() {
        let now = Instant::now();
        assert_eq!(
            decide(1000, 1000, Some(now), now, &policy(), 16),
            Decision::Cut(16)
        );
        assert_eq!(decide(9, 3, Some(now), now, &policy(), 8), Decision::Cut(8));
        assert_eq!(decide(5, 5, Some(now), now, &policy(), 1), Decision::Cut(1));
    }

    #[test]
    fn the_target_never_exceeds_max_batch_size() {
        let now = Instant::now();
        assert_eq!(
            decide(100, 100, Some(now), now, &policy(), 500),
            Decision::Cut(32)
        );
    }

    #[test]
    fn fewer_rows_wait_for_the_queue_delay_then_go() {
        let t0 = Instant::now();
        let p = policy();
        assert_eq!(
            decide(3, 3, Some(t0), t0, &p, 8),
            Decision::Wait(t0 + Duration::from_millis(2))
        );
        let later = t0 + Duration::from_millis(3);
        assert_eq!(decide(3, 3, Some(t0), later, &p, 8), Decision::Cut(3));
    }

    #[test]
    fn without_dynamic_batching_requests_run_alone_cut_to_the_max() {
        let t0 = Instant::now();
        let p = BatchPolicy {
            merge_requests: false,
            ..policy()
        };
        assert_eq!(decide(10, 3, Some(t0), t0, &p, 8), Decision::Cut(3));
        assert_eq!(decide(100, 100, Some(t0), t0, &p, 8), Decision::Cut(32));
    }
}
