//! `ModelHandle`: one started model as every transport sees it (its state, its queue places)
//! and how it is taken out of service.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::{BatchPolicy, QueuedJob, ResponseCache};
use crate::domain::{ModelName, ModelVersion};
use crate::telemetry::ModelSeries;

#[derive(Debug, Clone, PartialEq)]
pub enum ModelState {
    Loading,
    Ready,
    /// The load failed.
    Failed(String),
    /// Loaded, but every instance is down (its engine panicked) and restarting.
    Down(String),
}

pub(super) struct Inner {
    pub name: ModelName,
    pub version: ModelVersion,
    pub series: ModelSeries,
    pub jobs: mpsc::Sender<QueuedJob>,
    pub policy: BatchPolicy,
    /// Per priority level, one permit per queue place (`max_queue_size`).
    pub queue_places: Vec<Arc<Semaphore>>,
    /// Signalled whenever a request gives its queue place back (or stops waiting for its
    /// first row).
    pub place_freed: Arc<Notify>,
    /// Requests that resolved this model and wait for their first row, holding no place
    /// yet: a retiring model waits for them too.
    pub arriving: std::sync::atomic::AtomicUsize,
    /// Admitted requests with rows still to submit: the batcher waits for their rows to
    /// fill a batch, and with none it runs what a preferred batch size holds at once.
    pub feeding: Arc<std::sync::atomic::AtomicUsize>,
    pub cache: Option<Arc<ResponseCache>>,
    pub state: watch::Receiver<ModelState>,
    /// Stops the batcher, which ends the instance threads.
    pub stop: CancellationToken,
    /// The same stop, as instance threads waiting to restart wait for it.
    pub halt: Arc<super::supervisor::Halt>,
    /// Cancelled as the model retires: the batcher stops holding rows for a batch to fill.
    pub flush: CancellationToken,
    /// Wakes the batcher: a request left with rows queued (`Reply`).
    pub wake: Arc<Notify>,
    /// The instance threads, joined on shutdown so no libtorch module outlives the gateway
    /// (a module still being torn down while the process exits can crash it).
    pub threads: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// When the last request finished, in ms since the epoch (0: none yet).
    pub last_inference_ms: AtomicU64,
    /// Set once the model is unloaded or replaced.
    pub retiring: AtomicBool,
    /// Set once no request holds a place after `retiring`: new requests are refused.
    pub retired: AtomicBool,
    /// Unique per started model in this process (keys the response cache: a reload may
    /// bring new weights under the same version).
    pub generation: u64,
    /// Each loaded instance and its device (`cpu`, `cuda:0`).
    pub devices: Arc<std::sync::Mutex<Vec<(String, String)>>>,
    /// Why the instances do not run where the config puts them.
    pub fallback: Option<String>,
    /// Instances serving now with a JPEG decoder (on their GPU).
    pub gpu_decoders: Arc<std::sync::atomic::AtomicUsize>,
}

impl Inner {
    /// No request holds a queue place or waits for its first row.
    fn idle(&self) -> bool {
        self.arriving.load(Ordering::SeqCst) == 0
            && self
                .queue_places
                .iter()
                .zip(&self.policy.queues)
                .all(|(places, queue)| places.available_permits() == queue.capacity.max(1))
    }
}

/// One request's place in a model's queue, shared by the jobs its rows were submitted in
/// and given back when the last of them leaves the queue.
pub(crate) struct QueuePlace {
    permit: Option<OwnedSemaphorePermit>,
    freed: Arc<Notify>,
}

impl QueuePlace {
    pub(super) fn new(permit: OwnedSemaphorePermit, freed: Arc<Notify>) -> Self {
        Self {
            permit: Some(permit),
            freed,
        }
    }
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        // Released before the signal, so a woken `retire` sees the place free; it registers
        // before it checks, so no release is missed.
        drop(self.permit.take());
        self.freed.notify_waiters();
    }
}

/// Cheap to clone; every transport calls the same handle.
#[derive(Clone)]
pub struct ModelHandle {
    pub(super) inner: Arc<Inner>,
}

impl ModelHandle {
    pub fn name(&self) -> &ModelName {
        &self.inner.name
    }

    pub fn version(&self) -> ModelVersion {
        self.inner.version
    }

    /// The same started model (not merely the same name and version).
    pub fn same(&self, other: &ModelHandle) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    pub fn state(&self) -> ModelState {
        self.inner.state.borrow().clone()
    }

    pub fn is_ready(&self) -> bool {
        self.state() == ModelState::Ready
    }

    /// Whether an instance serving now decodes JPEGs on its GPU: the pipeline then passes
    /// the JPEGs that decoder takes on whole (an instance without one decodes those it is
    /// given on the CPU).
    pub fn decodes_on_gpu(&self) -> bool {
        self.inner
            .gpu_decoders
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    }

    /// When the last request finished (Triton's `last_inference`), in ms since the epoch.
    /// Where each loaded instance runs, (instance, device), and why the instances are not
    /// where the config puts them (a `KIND_GPU` group without usable GPUs).
    pub fn placement(&self) -> (Vec<(String, String)>, Option<String>) {
        let devices = self
            .inner
            .devices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        (devices, self.inner.fallback.clone())
    }

    pub fn last_inference_ms(&self) -> u64 {
        self.inner.last_inference_ms.load(Ordering::Relaxed)
    }

    /// Resolves once every instance is loaded and warmed up, or the load failed.
    pub async fn wait_loaded(&self) -> ModelState {
        let mut rx = self.inner.state.clone();
        let state = rx
            .wait_for(|s| *s != ModelState::Loading)
            .await
            .map(|s| s.clone());
        state.unwrap_or_else(|_| ModelState::Failed("model stopped while loading".into()))
    }

    /// Stops the model: the batcher ends (queued jobs are answered `NotReady`), each
    /// instance finishes its batch and its thread is joined. Call after the transports
    /// stopped taking requests.
    pub async fn shutdown(&self) {
        self.inner.stop.cancel();
        self.inner.halt.halt();
        let threads =
            std::mem::take(&mut *self.inner.threads.lock().unwrap_or_else(|p| p.into_inner()));
        let joined = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        });
        if tokio::time::timeout(Duration::from_secs(60), joined)
            .await
            .is_err()
        {
            tracing::warn!(model = %self.inner.name, "instance threads still busy after 60 s");
        }
    }

    /// Takes the model out of service gracefully once it is no longer in the model table:
    /// requests that resolved it just before still get in, those admitted finish (their
    /// rows leave the queue and run at once, without waiting for a batch to fill), then new
    /// requests are refused and the model stops.
    pub async fn retire(&self) {
        let inner = &self.inner;
        if inner.retiring.swap(true, Ordering::SeqCst) {
            return;
        }
        inner.flush.cancel();
        // Woken by each freed place, not `acquire_many`: a waiting `acquire_many` would take
        // free places and make the late requests above look like a full queue.
        loop {
            let freed = inner.place_freed.notified();
            let mut freed = std::pin::pin!(freed);
            freed.as_mut().enable();
            if inner.idle() {
                break;
            }
            freed.await;
        }
        inner.retired.store(true, Ordering::SeqCst);
        // A request that passed the `retired` check just before it was set.
        for (places, queue) in inner.queue_places.iter().zip(&inner.policy.queues) {
            let _ = places.acquire_many(queue.capacity.max(1) as u32).await;
        }
        self.shutdown().await;
    }
}
