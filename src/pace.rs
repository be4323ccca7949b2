//! Request bodies that must keep arriving, over HTTP and gRPC alike. A client has a time
//! budget (`--body-timeout-secs`) that runs down only while the server waits for its bytes
//! and that every byte received refills (one second per `--body-min-rate` bytes, up to the
//! full budget), as Apache's `mod_reqtimeout` does: a body sent at the minimum rate or
//! faster never runs out, one that stalls runs out after the budget. Time the server spends
//! not reading (an upload paced by decoding) is not the client's, with one approximation:
//! a wait is measured from a read that found nothing to the next read, so when the server
//! pauses right after such a read, the pause counts too. The refill of every chunk (30 s
//! for 30 KiB at the default rate) keeps that from mattering short of pauses near the
//! whole budget.
use std::future::Future;
use std::pin::Pin;
use std::task::Context;
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

/// One body's budget. Its owner reports each poll of the body: data (`received`), the end
/// or an error (`settled`), or nothing yet (`exhausted`).
pub struct Budget {
    pace: BodyPace,
    left: Duration,
    waiting_since: Option<Instant>,
    timer: Pin<Box<Sleep>>,
}

impl Budget {
    pub fn new(pace: BodyPace) -> Budget {
        Budget {
            pace,
            left: pace.timeout,
            waiting_since: None,
            timer: Box::pin(tokio::time::sleep(pace.timeout)),
        }
    }

    /// `bytes` arrived: the wait before them is charged, the bytes refill the budget.
    pub fn received(&mut self, bytes: usize) {
        self.settled();
        let refill = Duration::from_secs_f64(bytes as f64 / self.pace.min_rate.max(1) as f64);
        self.left = (self.left + refill).min(self.pace.timeout);
    }

    /// The body's poll ended without data pending (data, its end, an error): the wait is
    /// charged.
    pub fn settled(&mut self) {
        if let Some(since) = self.waiting_since.take() {
            self.left = self.left.saturating_sub(since.elapsed());
        }
    }

    /// The body has nothing yet: whether the client has spent its budget. When not, `cx`
    /// is woken by the time it will have.
    pub fn exhausted(&mut self, cx: &mut Context<'_>) -> bool {
        let since = *self.waiting_since.get_or_insert_with(Instant::now);
        let deadline = since + self.left;
        if self.timer.deadline() != deadline {
            self.timer.as_mut().reset(deadline);
        }
        self.timer.as_mut().poll(cx).is_ready()
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

    fn waker_cx() -> Context<'static> {
        Context::from_waker(std::task::Waker::noop())
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_runs_out_after_the_budget() {
        let mut budget = Budget::new(pace());
        let mut cx = waker_cx();
        assert!(!budget.exhausted(&mut cx));
        tokio::time::advance(Duration::from_millis(9_900)).await;
        assert!(!budget.exhausted(&mut cx));
        tokio::time::advance(Duration::from_millis(200)).await;
        assert!(budget.exhausted(&mut cx));
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_at_the_minimum_rate_keep_it_full_and_a_trickle_does_not() {
        let mut budget = Budget::new(pace());
        let mut cx = waker_cx();
        // 1000 bytes a second, for a minute: never runs out.
        for _ in 0..60 {
            assert!(!budget.exhausted(&mut cx));
            tokio::time::advance(Duration::from_secs(1)).await;
            budget.received(1000);
        }
        // One byte every 2 s: out after about the budget.
        let started = Instant::now();
        loop {
            if budget.exhausted(&mut cx) {
                break;
            }
            tokio::time::advance(Duration::from_secs(2)).await;
            if budget.exhausted(&mut cx) {
                break;
            }
            budget.received(1);
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
        let mut cx = waker_cx();
        budget.received(10);
        // The server does not read for a minute (the upload is paced by decoding).
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(!budget.exhausted(&mut cx));
    }
}
