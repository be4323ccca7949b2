//! Batching decisions as a pure function of (pending rows, now, policy).
use std::time::{Duration, Instant};

#[derive(Debug, Clone, PartialEq)]
pub struct BatchPolicy {
    pub max_batch_size: usize,
    /// Ascending. Empty: batches grow to `max_batch_size`.
    pub preferred_batch_sizes: Vec<usize>,
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
/// having `head_rows` rows not yet cut) when an instance is idle.
pub fn decide(
    pending_rows: usize,
    head_rows: usize,
    oldest: Option<Instant>,
    now: Instant,
    policy: &BatchPolicy,
) -> Decision {
    let Some(oldest) = oldest.filter(|_| pending_rows > 0) else {
        return Decision::Idle;
    };
    let max = policy.max_batch_size.max(1);
    if !policy.merge_requests {
        // Without dynamic batching each request runs alone (cut to max_batch_size).
        return Decision::Cut(head_rows.clamp(1, max));
    }
    let available = pending_rows.min(max);
    if let Some(&preferred) = policy
        .preferred_batch_sizes
        .iter()
        .rev()
        .find(|&&p| p <= available)
    {
        return Decision::Cut(preferred);
    }
    if policy.preferred_batch_sizes.is_empty() && available == max {
        return Decision::Cut(max);
    }
    let deadline = oldest + policy.max_queue_delay;
    if now >= deadline {
        Decision::Cut(available)
    } else {
        Decision::Wait(deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(preferred: &[usize]) -> BatchPolicy {
        BatchPolicy {
            max_batch_size: 32,
            preferred_batch_sizes: preferred.to_vec(),
            max_queue_delay: Duration::from_millis(2),
            merge_requests: true,
        }
    }

    #[test]
    fn nothing_pending_is_idle() {
        let now = Instant::now();
        assert_eq!(decide(0, 0, None, now, &policy(&[])), Decision::Idle);
    }

    #[test]
    fn the_largest_preferred_size_that_fits_is_cut_at_once() {
        let now = Instant::now();
        let p = policy(&[4, 8, 16]);
        assert_eq!(decide(1000, 1000, Some(now), now, &p), Decision::Cut(16));
        assert_eq!(decide(9, 3, Some(now), now, &p), Decision::Cut(8));
        assert_eq!(decide(5, 5, Some(now), now, &p), Decision::Cut(4));
    }

    #[test]
    fn fewer_rows_wait_for_the_queue_delay_then_go() {
        let t0 = Instant::now();
        let p = policy(&[4, 8]);
        assert_eq!(
            decide(3, 3, Some(t0), t0, &p),
            Decision::Wait(t0 + Duration::from_millis(2))
        );
        let later = t0 + Duration::from_millis(3);
        assert_eq!(decide(3, 3, Some(t0), later, &p), Decision::Cut(3));
    }

    #[test]
    fn without_preferred_sizes_a_full_batch_goes_at_once() {
        let t0 = Instant::now();
        assert_eq!(
            decide(40, 40, Some(t0), t0, &policy(&[])),
            Decision::Cut(32)
        );
        assert!(matches!(
            decide(31, 31, Some(t0), t0, &policy(&[])),
            Decision::Wait(_)
        ));
    }

    #[test]
    fn without_dynamic_batching_requests_run_alone_cut_to_the_max() {
        let t0 = Instant::now();
        let p = BatchPolicy {
            merge_requests: false,
            ..policy(&[])
        };
        assert_eq!(decide(10, 3, Some(t0), t0, &p), Decision::Cut(3));
        assert_eq!(decide(100, 100, Some(t0), t0, &p), Decision::Cut(32));
    }
}
