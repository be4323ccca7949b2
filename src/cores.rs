//! The host's cores, shared by the threads that compute on them: the decode threads and the
//! CPU instances. Each holds a share while it computes (a decode thread one core for one
//! image, a CPU instance its intra-op threads for one batch), so no more threads compute
//! than there are cores, and whichever work is due takes a core as one comes free, a
//! waiting instance's batch before the next image: its rows are decoded already and hold
//! memory and requests until they run. There is no fixed split: while the instances wait
//! for rows every core decodes, and as rows queue up the instances take the cores that
//! decoding frees, whatever their runtime costs per row.
//!
//! A one-core share also names its CPU: the thread runs there until it gives the share
//! back. Counting alone left cores idle: a thread handed a core is woken while the thread
//! that gave it back still runs, so the kernel queues it behind another share's thread,
//! and its load balancing leaves the two on one CPU for milliseconds while the other CPU
//! idles (the kernel keeps a task that ran in the last half millisecond where it is).
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

/// The cores, and who holds them.
#[derive(Debug)]
pub struct Cores {
    total: usize,
    /// The CPUs this process may run on, where one-core shares pin their threads (none:
    /// shares only count).
    cpus: Option<Cpus>,
    state: Mutex<Held>,
    freed: Condvar,
}

#[derive(Debug, Default)]
struct Held {
    /// Cores held now.
    busy: usize,
    /// Instances waiting for cores: no decode starts while one waits.
    instances_waiting: usize,
    /// The CPUs one-core shares run on now.
    pinned: Vec<usize>,
}

impl Cores {
    /// `total` cores (at least one), counted only.
    pub fn new(total: usize) -> Cores {
        Cores {
            total: total.max(1),
            cpus: None,
            state: Mutex::default(),
            freed: Condvar::new(),
        }
    }

    /// The cores this process may run on. Where they are all its CPUs (a whole host, a
    /// container given a cpuset), a one-core share runs on a CPU of its own; under a CPU
    /// quota narrower than the CPUs, shares only count, and the kernel places the threads
    /// among CPUs that other processes use too.
    pub fn of_host() -> Cores {
        let total = std::thread::available_parallelism().map_or(1, |n| n.get());
        Cores {
            cpus: Cpus::of_process().filter(|c| c.allowed.len() == total),
            ..Cores::new(total)
        }
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
        self.take(held, 1, true)
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
        self.take(held, n, threads <= 1)
    }

    /// `n` free cores for the calling thread; with `pin` (a share for one thread), on a
    /// CPU no other one-core share runs on (where it runs now if it can), the thread pinned
    /// there. A share for several threads is not pinned: a runtime's thread pool, started
    /// from the thread, would keep the CPUs it was started on.
    fn take(&self, mut held: MutexGuard<'_, Held>, n: usize, pin: bool) -> Share<'_> {
        held.busy += n;
        let pinned = match &self.cpus {
            Some(cpus) if pin && !cpus.refused.load(Ordering::Relaxed) => {
                // SAFETY: no arguments; -1 where the kernel cannot say.
                let here = usize::try_from(unsafe { libc::sched_getcpu() }).ok();
                let free = |c: &usize| !held.pinned.contains(c);
                let cpu = here
                    .filter(|c| cpus.allowed.contains(c) && free(c))
                    .or_else(|| cpus.allowed.iter().copied().find(free));
                if let Some(c) = cpu {
                    held.pinned.push(c);
                }
                cpu
            }
            _ => None,
        };
        drop(held);
        let pinned = pinned.filter(|&cpu| match &self.cpus {
            Some(cpus) if cpus.pin(cpu) => true,
            _ => {
                self.lock().pinned.retain(|&c| c != cpu);
                false
            }
        });
        Share {
            cores: self,
            n,
            pinned,
            _thread: PhantomData,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Held> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, held: MutexGuard<'a, Held>) -> MutexGuard<'a, Held> {
        self.freed.wait(held).unwrap_or_else(|p| p.into_inner())
    }
}

/// The process's CPU affinity as it started.
#[derive(Debug)]
struct Cpus {
    mask: libc::cpu_set_t,
    allowed: Vec<usize>,
    /// The kernel refused a pin (the process's cpuset changed since start): shares only
    /// count from then on.
    refused: AtomicBool,
}

impl Cpus {
    fn of_process() -> Option<Cpus> {
        let (mask, allowed) = affinity()?;
        (allowed.len() > 1).then_some(Cpus {
            mask,
            allowed,
            refused: AtomicBool::new(false),
        })
    }

    /// The calling thread on `cpu` alone; false where the kernel refuses (a cpuset changed
    /// since start).
    fn pin(&self, cpu: usize) -> bool {
        // SAFETY: a zeroed cpu_set_t is an empty set, and `cpu` is below CPU_SETSIZE.
        let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        unsafe { libc::CPU_SET(cpu, &mut one) };
        let pinned = set_affinity(&one);
        if !pinned {
            self.refused.store(true, Ordering::Relaxed);
        }
        pinned
    }

    /// The calling thread back on every CPU the process started with (on every CPU the
    /// kernel allows it, where none of those is left).
    fn unpin(&self) {
        if !set_affinity(&self.mask) {
            // SAFETY: a zeroed cpu_set_t is an empty set; every index is below CPU_SETSIZE.
            let mut every: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            (0..libc::CPU_SETSIZE as usize).for_each(|c| unsafe { libc::CPU_SET(c, &mut every) });
            set_affinity(&every);
        }
    }
}

/// The calling thread's CPU affinity: its mask and the CPUs in it.
fn affinity() -> Option<(libc::cpu_set_t, Vec<usize>)> {
    // SAFETY: a zeroed cpu_set_t is an empty set; the kernel writes at most its size.
    let mut mask: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    if unsafe { libc::sched_getaffinity(0, size, &mut mask) } != 0 {
        return None;
    }
    let cpus = (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &mask) })
        .collect();
    Some((mask, cpus))
}

fn set_affinity(mask: &libc::cpu_set_t) -> bool {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `mask` is a valid cpu_set_t of `size` bytes; 0 is the calling thread.
    unsafe { libc::sched_setaffinity(0, size, mask) == 0 }
}

/// Cores held until dropped.
#[must_use = "the cores are given back when the share is dropped"]
#[derive(Debug)]
pub struct Share<'a> {
    cores: &'a Cores,
    n: usize,
    /// The CPU a one-core share's thread is pinned to.
    pinned: Option<usize>,
    /// Given back on the thread that took it (which it unpins): not `Send`.
    _thread: PhantomData<*const ()>,
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        if let (Some(_), Some(cpus)) = (self.pinned, &self.cores.cpus) {
            cpus.unpin();
        }
        let mut held = self.cores.lock();
        held.busy -= self.n;
        if let Some(cpu) = self.pinned {
            held.pinned.retain(|&c| c != cpu);
        }
        drop(held);
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

    fn on_cpu() -> usize {
        usize::try_from(unsafe { libc::sched_getcpu() }).unwrap()
    }

    fn affinity() -> Vec<usize> {
        super::affinity().expect("the thread's affinity").1
    }

    #[test]
    fn one_core_shares_run_on_cpus_of_their_own_and_their_threads_go_back_to_every_cpu() {
        // Two cores on whatever CPUs this process has (a CPU quota can make of_host count
        // fewer cores than CPUs, and then it does not pin).
        let cores = Arc::new(Cores {
            cpus: Cpus::of_process(),
            ..Cores::new(2)
        });
        let Some(cpus) = &cores.cpus else {
            // A one-CPU host has nothing to pin; CI's machines have two.
            assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "needs 2 CPUs");
            eprintln!("NOT RUN: pinning needs 2 CPUs");
            return;
        };
        let all = cpus.allowed.clone();
        // The last CPU: a share that finds no CPU free where it runs takes the first free.
        let first = *all.last().unwrap();
        // Every thread starts on one CPU, as the kernel leaves a woken thread beside
        // another: each share moves its thread to a CPU no other share runs on.
        let holding = Arc::new(std::sync::Barrier::new(2));
        let threads: Vec<_> = (0..2)
            .map(|i| {
                let (cores, holding, all) = (cores.clone(), holding.clone(), all.clone());
                std::thread::spawn(move || {
                    let one = Cpus::of_process().unwrap();
                    assert!(one.pin(first));
                    assert_eq!(on_cpu(), first);
                    let share = if i == 0 {
                        cores.decode()
                    } else {
                        cores.infer(1)
                    };
                    let cpu = on_cpu();
                    assert_eq!(affinity(), vec![cpu], "pinned to the CPU it runs on");
                    holding.wait();
                    drop(share);
                    assert_eq!(affinity(), all, "every CPU again once given back");
                    cpu
                })
            })
            .collect();
        let ran: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert_ne!(ran[0], ran[1], "two shares on one CPU");
        assert!(
            ran.contains(&first),
            "a free CPU where the thread ran was kept"
        );
        assert!(cores.lock().pinned.is_empty());
        // A share for several threads leaves its thread where the kernel puts it.
        let both = cores.infer(2);
        assert_eq!(both.pinned, None);
        assert_eq!(affinity(), all);
        drop(both);
        // So does one clamped to a single core.
        let one = Cores {
            cpus: Cpus::of_process(),
            ..Cores::new(1)
        };
        assert_eq!(one.infer(2).pinned, None);
        assert_eq!(affinity(), all);
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
