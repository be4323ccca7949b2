//! Request bodies that must keep arriving, over HTTP and gRPC alike. A client has a time
//! budget (`--body-timeout-secs`) that runs down only while the server waits for its bytes
//! and that every byte received refills (one second per `--body-min-rate` bytes, up to the
//! full budget), as Apache's `mod_reqtimeout` does: a body sent at the minimum rate or
//! faster never runs out, one that stalls runs out after the budget. Time the server spends
//! not reading (an upload paced by decoding) is not the client's: a wait runs from a read
//! that found nothing to the wake-up that said more had come, not to the next read.
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use crate::error::{ErrorKind, GatewayError};

/// How long a request body may keep the server waiting.
#[derive(Debug, Clone, Copy)]
pub struct BodyPace {
    /// The most a client may keep the server waiting for its body in a row.
    pub timeout: Duration,
    /// Bytes per second that keep a body's budget full.
    pub min_rate: u64,
}

impl BodyPace {
    /// The answer to a body that stopped arriving (408 / DEADLINE_EXCEEDED).
    pub fn stalled(&self) -> GatewayError {
        GatewayError::new(
            ErrorKind::RequestTimeout,
            format!(
                "the request body stopped arriving: send at least {} bytes/s, with no pause \
                 over {} s",
                self.min_rate,
                self.timeout.as_secs()
            ),
        )
    }
}

/// One body's budget, kept by its owner polling the body through `poll`.
pub struct Budget {
    pace: BodyPace,
    left: Duration,
    /// Since when the server has waited for the client, if it is waiting.
    waiting_since: Option<Instant>,
    timer: Pin<Box<Sleep>>,
    wakes: Arc<WakeTime>,
}

/// What one poll of a body came to.
pub enum Step<T> {
    /// The body's item or its end, passed on.
    Ready(Option<T>),
    Pending,
    /// The client kept the server waiting past its budget.
    Stalled,
}

impl Budget {
    pub fn new(pace: BodyPace) -> Budget {
        Budget {
            pace,
            left: pace.timeout,
            waiting_since: None,
            timer: Box::pin(tokio::time::sleep(pace.timeout)),
            wakes: Arc::default(),
        }
    }

    /// Polls the body with `poll`. `size` is how many bytes an item carries. While the
    /// client `rests` (a stream between messages), waiting is free and the budget full.
    pub fn poll<T>(
        &mut self,
        cx: &mut Context<'_>,
        rests: bool,
        poll: impl FnOnce(&mut Context<'_>) -> Poll<Option<T>>,
        size: impl FnOnce(&T) -> usize,
    ) -> Step<T> {
        let woken = self.wakes.take(cx.waker());
        let waker = Waker::from(self.wakes.clone());
        let polled = poll(&mut Context::from_waker(&waker));
        if !matches!(polled, Poll::Pending) {
            if let Some(since) = self.waiting_since.take() {
                let until = woken.unwrap_or_else(Instant::now);
                self.left = self
                    .left
                    .saturating_sub(until.saturating_duration_since(since));
            }
        }
        match polled {
            Poll::Ready(Some(item)) => {
                let refill = size(&item) as f64 / self.pace.min_rate.max(1) as f64;
                self.left = (self.left + Duration::from_secs_f64(refill)).min(self.pace.timeout);
                Step::Ready(Some(item))
            }
            Poll::Ready(None) => Step::Ready(None),
            Poll::Pending if rests => {
                self.left = self.pace.timeout;
                self.waiting_since = None;
                Step::Pending
            }
            Poll::Pending => {
                let since = *self.waiting_since.get_or_insert_with(Instant::now);
                let deadline = since + self.left;
                if self.timer.deadline() != deadline {
                    self.timer.as_mut().reset(deadline);
                }
                if self.timer.as_mut().poll(cx).is_ready() {
                    Step::Stalled
                } else {
                    Step::Pending
                }
            }
        }
    }
}

/// The waker a body is polled with: it records when the body first woke its task after a
/// poll, then passes the wake on.
#[derive(Default)]
struct WakeTime {
    inner: Mutex<WakeState>,
}

#[derive(Default)]
struct WakeState {
    woken: Option<Instant>,
    task: Option<Waker>,
}

impl WakeTime {
    /// When the body woke the task since the last poll, if it did; `task` is woken from now.
    fn take(&self, task: &Waker) -> Option<Instant> {
        let mut state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if !state.task.as_ref().is_some_and(|t| t.will_wake(task)) {
            state.task = Some(task.clone());
        }
        state.woken.take()
    }
}

impl Wake for WakeTime {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let task = {
            let mut state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            state.woken.get_or_insert_with(Instant::now);
            state.task.clone()
        };
        if let Some(task) = task {
            task.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pace() -> BodyPace {
        BodyPace {
            timeout: Duration::from_secs(10),
            min_rate: 1000,
        }
    }

    /// A body that has nothing yet: whether its client has now spent the budget.
    fn stalled(budget: &mut Budget) -> bool {
        stalled_resting(budget, false)
    }

    fn stalled_resting(budget: &mut Budget, rests: bool) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        let step = budget.poll(&mut cx, rests, |_| Poll::<Option<usize>>::Pending, |n| *n);
        matches!(step, Step::Stalled)
    }

    /// A body that has `n` bytes.
    fn receive(budget: &mut Budget, n: usize) {
        let mut cx = Context::from_waker(Waker::noop());
        let step = budget.poll(&mut cx, false, |_| Poll::Ready(Some(n)), |n| *n);
        assert!(matches!(step, Step::Ready(Some(_))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_runs_out_after_the_budget() {
        let mut budget = Budget::new(pace());
        assert!(!stalled(&mut budget));
        tokio::time::advance(Duration::from_millis(9_900)).await;
        assert!(!stalled(&mut budget));
        tokio::time::advance(Duration::from_millis(200)).await;
        assert!(stalled(&mut budget));
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_at_the_minimum_rate_keep_it_full_and_a_trickle_does_not() {
        let mut budget = Budget::new(pace());
        // 1000 bytes a second, for a minute: never runs out.
        for _ in 0..60 {
            assert!(!stalled(&mut budget));
            tokio::time::advance(Duration::from_secs(1)).await;
            receive(&mut budget, 1000);
        }
        // One byte every 2 s: out after about the budget.
        let started = Instant::now();
        loop {
            if stalled(&mut budget) {
                break;
            }
            tokio::time::advance(Duration::from_secs(2)).await;
            if stalled(&mut budget) {
                break;
            }
            receive(&mut budget, 1);
        }
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(10) && took <= Duration::from_secs(12),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn time_not_spent_waiting_is_not_charged() {
        let mut budget = Budget::new(pace());
        receive(&mut budget, 10);
        // The server does not read for a minute (the upload is paced by decoding).
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(!stalled(&mut budget));
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_after_the_body_woke_the_server_is_not_charged() {
        let mut budget = Budget::new(pace());
        let mut cx = Context::from_waker(Waker::noop());
        let mut body_waker = None;
        let step = budget.poll(
            &mut cx,
            false,
            |cx| {
                body_waker = Some(cx.waker().clone());
                Poll::<Option<usize>>::Pending
            },
            |n| *n,
        );
        assert!(matches!(step, Step::Pending));
        // The bytes come after 1 s; the server reads them a minute later.
        tokio::time::advance(Duration::from_secs(1)).await;
        body_waker.expect("the body kept a waker").wake();
        tokio::time::advance(Duration::from_secs(60)).await;
        receive(&mut budget, 10);
        // 1 s was charged: 9 s (and 10 ms of refill) are left.
        assert!(!stalled(&mut budget));
        tokio::time::advance(Duration::from_millis(8_900)).await;
        assert!(!stalled(&mut budget));
        tokio::time::advance(Duration::from_millis(200)).await;
        assert!(stalled(&mut budget));
    }

    #[tokio::test(start_paused = true)]
    async fn a_resting_client_keeps_its_budget_full() {
        let mut budget = Budget::new(pace());
        assert!(!stalled(&mut budget));
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(!stalled_resting(&mut budget, true));
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(!stalled(&mut budget));
        tokio::time::advance(Duration::from_millis(9_900)).await;
        assert!(!stalled(&mut budget));
    }
}
