//! Shutdown's view of the work under way. Once draining, new inference work is refused
//! (`shutting_down`, 503 / UNAVAILABLE) and readiness says no, while the work admitted
//! before keeps its place; the stop waits until that work is done, then closes the
//! listeners (`close`), which also ends open gRPC streams.
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::error::{ErrorKind, HasKind};

#[derive(Default)]
pub struct Drain {
    draining: AtomicBool,
    in_flight: AtomicUsize,
    /// Signalled when the last admitted work ends.
    idle: Notify,
    /// Cancelled when the listeners close.
    closing: CancellationToken,
}

/// New work refused because the server is stopping.
#[derive(Debug, thiserror::Error)]
#[error(
    "the server is shutting down and takes no new inference requests; send it to another instance"
)]
pub struct ShuttingDown;

impl HasKind for ShuttingDown {
    fn kind(&self) -> ErrorKind {
        ErrorKind::ShuttingDown
    }
}

/// One admitted request: the stop waits for it to be dropped.
pub struct Work(Arc<Drain>);

impl Drop for Work {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    /// Admits one inference request, unless the server is draining.
    pub fn admit(self: &Arc<Self>) -> Result<Work, ShuttingDown> {
        // Counted before the check: `finished` cannot miss work admitted as the drain begins.
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let work = Work(self.clone());
        if self.draining.load(Ordering::SeqCst) {
            return Err(ShuttingDown);
        }
        Ok(work)
    }

    /// From now on, new work is refused and readiness says no.
    pub fn begin(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Returns once no admitted work is left (call after `begin`).
    pub async fn finished(&self) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.in_flight.load(Ordering::SeqCst) == 0 {
                return;
            }
            idle.await;
        }
    }

    /// The listeners are closing: open streams end now.
    pub fn close(&self) {
        self.closing.cancel();
    }

    /// Cancelled when the listeners close.
    pub fn closing(&self) -> CancellationToken {
        self.closing.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn admitted_work_holds_the_drain_and_new_work_is_refused() {
        let drain = Arc::new(Drain::default());
        let work = drain.admit().expect("admitted before the drain");
        drain.begin();
        assert!(drain.admit().is_err(), "no new work once draining");
        let waiting = tokio::time::timeout(Duration::from_millis(50), drain.finished()).await;
        assert!(waiting.is_err(), "the drain waits for admitted work");
        drop(work);
        tokio::time::timeout(Duration::from_secs(5), drain.finished())
            .await
            .expect("the drain ends with the last admitted work");
    }
}
