//! The host's cores, shared by the threads that compute on them: the decode threads and the
//! CPU instances. Each holds a share while it computes (a decode thread one core for one
//! image, a CPU instance its intra-op threads for one batch), so no more threads compute
//! than there are cores, and whichever work is due takes a core as one comes free, a
//! waiting instance's batch before the next image: its rows are decoded already and hold
//! memory and requests until they run. There is no fixed split: while the instances wait
//! for rows every core decodes, and as rows queue up the instances take the cores that
//! decoding frees, whatever their runtime costs per row.
use std::sync::{Condvar, Mutex, MutexGuard};

/// The cores, and who holds them.
#[derive(Debug)]
pub struct Cores {
    total: usize,
    state: Mutex<Held>,
    freed: Condvar,
}

#[derive(Debug, Default)]
struct Held {
    /// Cores held now.
    busy: usize,
    /// Instances waiting for cores: no decode starts while one waits.
    instances_waiting: usize,
}

impl Cores {
    /// `total` cores (at least one).
    pub fn new(total: usize) -> Cores {
        Cores {
            total: total.max(1),
            state: Mutex::default(),
            freed: Condvar::new(),
        }
    }

    /// The cores this process may run on.
    pub fn of_host() -> Cores {
        Cores::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// One core, for one image's decode: once one is free and no instance waits for
    /// cores.
    pub fn decode(&self) -> Share<'_> {
        let mut held = self.lock();
        while held.busy >= self.total || held.instances_waiting > 0 {
            held = self.wait(held);
        }
        held.busy += 1;
        Share { cores: self, n: 1 }
    }

    /// `threads` cores (all of them where it asks for more), for one batch of a CPU
    /// instance: before any decode that has not started.
    pub fn infer(&self, threads: usize) -> Share<'_> {
        let n = threads.clamp(1, self.total);
        let mut held = self.lock();
        held.instances_waiting += 1;
        while held.busy + n > self.total {
            held = self.wait(held);
        }
        held.instances_waiting -= 1;
        held.busy += n;
        Share { cores: self, n }
    }

    fn lock(&self) -> MutexGuard<'_, Held> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, held: MutexGuard<'a, Held>) -> MutexGuard<'a, Held> {
        self.freed.wait(held).unwrap_or_else(|p| p.into_inner())
    }
}

/// Cores held until dropped.
#[must_use = "the cores are given back when the share is dropped"]
#[derive(Debug)]
pub struct Share<'a> {
    cores: &'a Cores,
    n: usize,
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        self.cores.lock().busy -= self.n;
        // Waiters want different counts (a decode one, an instance several): each checks.
        self.cores.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    #[test]
    fn no_more_shares_than_cores_and_a_waiting_instance_goes_before_new_decodes() {
        let cores = Arc::new(Cores::new(2));
        let first = cores.decode();
        let second = cores.decode();
        // An instance that wants both cores waits for them, and a decode asked for after
        // it waits behind it.
        let (order_tx, order) = mpsc::channel();
        let instance = {
            let (cores, order_tx) = (cores.clone(), order_tx.clone());
            std::thread::spawn(move || {
                let share = cores.infer(2);
                order_tx.send("instance").unwrap();
                std::thread::sleep(Duration::from_millis(50));
                drop(share);
            })
        };
        while cores.lock().instances_waiting == 0 {
            std::thread::yield_now();
        }
        let decode = {
            let cores = cores.clone();
            std::thread::spawn(move || {
                let _share = cores.decode();
                order_tx.send("decode").unwrap();
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            order.try_recv().is_err(),
            "a share was given beyond the cores"
        );
        // One core free: not enough for the instance, and the decode waits behind it.
        drop(first);
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            order.try_recv().is_err(),
            "the decode went before the waiting instance"
        );
        drop(second);
        assert_eq!(order.recv().unwrap(), "instance");
        assert_eq!(order.recv().unwrap(), "decode");
        instance.join().unwrap();
        decode.join().unwrap();
        assert_eq!(cores.lock().busy, 0);
    }

    #[test]
    fn an_instance_asking_for_more_cores_than_there_are_takes_them_all() {
        let cores = Cores::new(3);
        let share = cores.infer(8);
        assert_eq!(share.n, 3);
        drop(share);
        let _one = cores.infer(0);
        assert_eq!(cores.lock().busy, 1);
    }

    #[test]
    fn threads_sharing_the_cores_never_compute_more_at_once_than_there_are() {
        let cores = Arc::new(Cores::new(2));
        let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let threads: Vec<_> = (0..6)
            .map(|i| {
                let (cores, now, most) = (cores.clone(), now.clone(), most.clone());
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        let share = if i % 3 == 0 {
                            cores.infer(1)
                        } else {
                            cores.decode()
                        };
                        let running = now.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(running, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_micros(200));
                        now.fetch_sub(1, Ordering::SeqCst);
                        drop(share);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 2);
    }
}
