//! The process's allocator: jemalloc, unprefixed, so libtorch's C++ allocations and every C
//! library's come from it as well as Rust's (`main.rs` makes it Rust's global allocator).
//!
//! glibc's malloc kept what threads freed in per-thread arenas and raised its mmap
//! threshold after large frees, so a server held 230 MiB of heap at rest. jemalloc's
//! defaults returned less-used pages, but its decay also returns the pages of the forward
//! pass's buffers, freed and reused every batch (the count of free pages stays level, which
//! it reads as "not needed"), so batches faulted them back in: a bf16 forward of 4 images
//! took 10.5 ms per image instead of 7.6, and batch-size tuning picked 1 instead of 4. So
//! free pages are kept while the process works (`dirty_decay_ms:-1`), and given back
//! ([`release_free_memory`]) as each instance finishes warming up (what batch-size tuning's
//! larger candidates left) and once the process has been idle for a while
//! ([`release_when_idle`]: what a burst of large uploads left). `MALLOC_CONF` overrides
//! the option (for example `MALLOC_CONF=dirty_decay_ms:10000` gives memory back as it
//! goes, at that cost).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// jemalloc's options, read at its start before `MALLOC_CONF` (which overrides them).
#[cfg(all(feature = "jemalloc", target_os = "linux", target_env = "gnu"))]
#[used]
#[export_name = "malloc_conf"]
static MALLOC_CONF: &[u8; 18] = b"dirty_decay_ms:-1\0";

/// Work that allocates and frees large buffers (a batch, an image decoded), counted so
/// that [`release_when_idle`] sees whether the process is busy.
static ACTIVITY: AtomicU64 = AtomicU64::new(0);

pub fn note_activity() {
    ACTIVITY.fetch_add(1, Ordering::Relaxed);
}

/// Gives free pages back once no batch has run and no image has been decoded for a whole
/// `idle` period, once per quiet spell: a busy process keeps reusing its pages, a quiet
/// one returns what its last burst left. Runs until `stop` is cancelled.
pub async fn release_when_idle(idle: Duration, stop: tokio_util::sync::CancellationToken) {
    let mut seen = ACTIVITY.load(Ordering::Relaxed);
    let mut released = true;
    loop {
        tokio::select! {
            () = tokio::time::sleep(idle) => {}
            () = stop.cancelled() => return,
        }
        let now = ACTIVITY.load(Ordering::Relaxed);
        if now != seen {
            seen = now;
            released = false;
        } else if !released {
            released = true;
            // A few madvise calls; off the runtime's worker threads all the same.
            let _ = tokio::task::spawn_blocking(release_free_memory).await;
        }
    }
}

/// Gives the free pages of every jemalloc arena back to the system. Instances already
/// serving fault theirs back in once.
pub fn release_free_memory() {
    #[cfg(all(feature = "jemalloc", target_os = "linux", target_env = "gnu"))]
    {
        // jemalloc's MALLCTL_ARENAS_ALL: every arena.
        let name = c"arena.4096.purge";
        // SAFETY: a NUL-terminated control name that takes no old or new value.
        let rc = unsafe {
            tikv_jemalloc_sys::mallctl(
                name.as_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if rc != 0 {
            tracing::debug!(rc, "jemalloc purge failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_idle_release_ends_when_stopped() {
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(release_when_idle(Duration::from_secs(3600), stop.clone()));
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("it ends at once, not after its idle period")
            .unwrap();
    }
}
