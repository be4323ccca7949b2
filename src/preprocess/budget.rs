//! The memory every decode thread together may hold for decoded pixels
//! (`--decode-memory-bytes`). A decode reserves what it will allocate, estimated from the
//! header before any pixel buffer exists, and waits while that does not fit; waits are
//! served in arrival order, so a large image is not passed over for ever by small ones. An
//! image whose decode alone needs more than the whole budget is refused (`image_too_large`).
use std::sync::{Condvar, Mutex, MutexGuard};

use prometheus::IntGauge;

use super::PreprocessError;

pub struct DecodeBudget {
    total: u64,
    state: Mutex<State>,
    changed: Condvar,
    /// Bytes reserved now.
    in_use: Option<IntGauge>,
}

#[derive(Default)]
struct State {
    used: u64,
    /// The next ticket to hand out, and the ticket whose turn it is.
    next: u64,
    serving: u64,
}

/// Bytes reserved by one decode, given back when dropped.
pub struct Reserved<'a> {
    budget: &'a DecodeBudget,
    bytes: u64,
}

impl DecodeBudget {
    pub fn new(total: u64, in_use: Option<IntGauge>) -> DecodeBudget {
        DecodeBudget {
            total,
            state: Mutex::default(),
            changed: Condvar::new(),
            in_use,
        }
    }

    /// No budget: every decode goes ahead at once (tools and tests).
    pub fn unlimited() -> DecodeBudget {
        DecodeBudget::new(u64::MAX, None)
    }

    /// Reserves `bytes` for the decode of a `width`x`height` image, waiting in turn until
    /// they fit.
    pub fn reserve(
        &self,
        bytes: u64,
        width: u64,
        height: u64,
    ) -> Result<Reserved<'_>, PreprocessError> {
        if bytes > self.total {
            return Err(PreprocessError::OverBudget {
                width,
                height,
                bytes,
                budget: self.total,
            });
        }
        let mut state = self.lock();
        let ticket = state.next;
        state.next += 1;
        while state.serving != ticket || bytes > self.total - state.used {
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.serving += 1;
        state.used += bytes;
        self.report(&state);
        drop(state);
        // The next ticket may fit as well.
        self.changed.notify_all();
        Ok(Reserved {
            budget: self,
            bytes,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn report(&self, state: &State) {
        if let Some(gauge) = &self.in_use {
            gauge.set(state.used.min(i64::MAX as u64) as i64);
        }
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        let mut state = self.budget.lock();
        state.used -= self.bytes;
        self.budget.report(&state);
        drop(state);
        self.budget.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_decode_waits_for_room_and_takes_its_turn() {
        let budget = Arc::new(DecodeBudget::new(100, None));
        let first = budget.reserve(30, 1, 1).unwrap();
        let (done, order) = mpsc::channel();
        // 75 does not fit beside 30; 70 would, but comes after 75 and waits its turn. Once
        // 30 is freed, 75 goes and 70 must wait for it again (the two do not fit together),
        // so the order they are answered in is the order they were served in.
        for (i, bytes) in [(1, 75u64), (2, 70)] {
            let (shared, done) = (budget.clone(), done.clone());
            std::thread::spawn(move || {
                let held = shared.reserve(bytes, 1, 1).unwrap();
                done.send(i).unwrap();
                std::thread::sleep(Duration::from_millis(50));
                drop(held);
            });
            // Each waits with its ticket before the next comes.
            while budget.lock().next <= i {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        assert!(
            order.recv_timeout(Duration::from_millis(100)).is_err(),
            "nothing goes ahead while 30 of 100 are held by the first"
        );
        drop(first);
        assert_eq!(order.recv_timeout(Duration::from_secs(5)), Ok(1));
        assert_eq!(order.recv_timeout(Duration::from_secs(5)), Ok(2));
    }

    #[test]
    fn a_decode_larger_than_the_whole_budget_is_refused() {
        let budget = DecodeBudget::new(100, None);
        let e = budget.reserve(101, 10, 20).err().expect("refused");
        assert_eq!(e.code(), "image_too_large");
        assert!(e.to_string().contains("101"), "{e}");
        budget
            .reserve(100, 10, 10)
            .expect("the whole budget is allowed");
    }
}
