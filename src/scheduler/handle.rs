//! `ModelHandle`: admission into a model's queue, and the start-up of its batcher and
//! instance threads.
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot, watch};

use super::batcher::run_batcher;
use super::instance::{instance_loop, InstanceContext, Slot};
use super::{BatchPolicy, InferJob, JobResult, JobState, SchedulerError};
use crate::domain::{InstanceId, ModelName, ModelVersion, Normalize};
use crate::engine::{BatchInput, Engine, EngineError, OutputRequest};

/// Builds the engine of one instance; called on that instance's own thread.
pub type EngineFactory =
    Arc<dyn Fn(InstanceId) -> Result<Box<dyn Engine>, EngineError> + Send + Sync>;

#[derive(Debug, Clone)]
pub struct ModelSettings {
    pub name: ModelName,
    pub version: ModelVersion,
    pub instances: Vec<InstanceId>,
    pub policy: BatchPolicy,
    /// Jobs (requests) that may wait; one more is refused with `Overloaded`.
    pub queue_capacity: usize,
    pub height: usize,
    pub width: usize,
    /// Batch sizes run once each on every instance before the model is ready
    /// (TorchScript's first calls for a shape are slow).
    pub warmup_batch_sizes: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ModelState {
    Loading,
    Ready,
    Failed(String),
}

struct Inner {
    name: ModelName,
    version: ModelVersion,
    jobs: mpsc::Sender<Arc<JobState>>,
    state: watch::Receiver<ModelState>,
}

/// Cheap to clone; every transport calls the same handle.
#[derive(Clone)]
pub struct ModelHandle {
    inner: Arc<Inner>,
}

impl ModelHandle {
    pub fn name(&self) -> &ModelName {
        &self.inner.name
    }

    pub fn version(&self) -> ModelVersion {
        self.inner.version
    }

    pub fn state(&self) -> ModelState {
        self.inner.state.borrow().clone()
    }

    pub fn is_ready(&self) -> bool {
        self.state() == ModelState::Ready
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

    /// Queues the job at once or refuses it (`Overloaded` when the queue is full); never
    /// waits for room. Resolves when every row has its output.
    pub async fn infer(&self, job: InferJob) -> JobResult {
        let name = self.inner.name.to_string();
        if !self.is_ready() {
            return Err(SchedulerError::NotReady(name));
        }
        if job.rows.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, rx) = oneshot::channel();
        let state = Arc::new(JobState::new(job, reply));
        self.inner.jobs.try_send(state).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => SchedulerError::Overloaded(name.clone()),
            mpsc::error::TrySendError::Closed(_) => SchedulerError::NotReady(name.clone()),
        })?;
        rx.await.unwrap_or(Err(SchedulerError::NotReady(name)))
    }
}

/// Starts the instance threads and the batcher task (call inside a Tokio runtime).
/// The handle is `Loading` until every instance has loaded and warmed up.
pub fn start_model(settings: ModelSettings, factory: EngineFactory) -> ModelHandle {
    let name = settings.name.to_string();
    // Capacity: the configured queue size, so admission refuses past it.
    let (jobs_tx, jobs_rx) = mpsc::channel(settings.queue_capacity.max(1));
    // Every instance holds at most one outstanding offer.
    let (slots_tx, slots_rx) = mpsc::channel::<Slot>(settings.instances.len().max(1));
    let (state_tx, state_rx) = watch::channel(ModelState::Loading);

    let mut loaded = Vec::new();
    for id in settings.instances.iter().copied() {
        let (done_tx, done_rx) = oneshot::channel::<Result<String, String>>();
        loaded.push((id, done_rx));
        let factory = factory.clone();
        let slots = slots_tx.clone();
        let ctx = InstanceContext {
            model: name.clone(),
            id,
            height: settings.height,
            width: settings.width,
        };
        let warmup = settings.warmup_batch_sizes.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("{name}/{id}"))
            .spawn(move || {
                let engine = factory(id)
                    .map_err(|e| e.to_string())
                    .and_then(|mut engine| {
                        warm_up(engine.as_mut(), &ctx, &warmup)?;
                        Ok(engine)
                    });
                match engine {
                    Ok(engine) => {
                        let _ = done_tx.send(Ok(engine.device_name()));
                        instance_loop(ctx, engine, slots);
                    }
                    Err(e) => {
                        let _ = done_tx.send(Err(e));
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(model = name, "cannot spawn an instance thread: {e}");
        }
    }
    drop(slots_tx);

    tokio::spawn(run_batcher(
        name.clone(),
        jobs_rx,
        slots_rx,
        settings.policy.clone(),
    ));
    tokio::spawn(async move {
        let started = Instant::now();
        let mut failures = Vec::new();
        let mut devices = Vec::new();
        for (id, rx) in loaded {
            match rx.await {
                Ok(Ok(device)) => devices.push(format!("{id}={device}")),
                Ok(Err(e)) => failures.push(format!("instance {id}: {e}")),
                Err(_) => failures.push(format!("instance {id}: thread ended while loading")),
            }
        }
        let state = if failures.is_empty() {
            tracing::info!(
                model = name,
                instances = %devices.join(" "),
                secs = format!("{:.2}", started.elapsed().as_secs_f64()),
                "model ready"
            );
            ModelState::Ready
        } else {
            let msg = failures.join("; ");
            tracing::error!(model = name, "model failed to load: {msg}");
            ModelState::Failed(msg)
        };
        let _ = state_tx.send(state);
        // Keep the sender alive so the state stays readable.
        state_tx.closed().await;
    });

    ModelHandle {
        inner: Arc::new(Inner {
            name: settings.name,
            version: settings.version,
            jobs: jobs_tx,
            state: state_rx,
        }),
    }
}

fn warm_up(engine: &mut dyn Engine, ctx: &InstanceContext, sizes: &[usize]) -> Result<(), String> {
    let row = ctx.height * ctx.width * 3;
    for &n in sizes {
        let data = vec![128u8; n.max(1) * row];
        let input = BatchInput::Images {
            data: &data,
            height: ctx.height,
            width: ctx.width,
            normalize: Normalize {
                mean: [0.5; 3],
                std: [0.5; 3],
            },
        };
        let t = Instant::now();
        engine
            .run(
                input,
                OutputRequest {
                    top_k: 1,
                    logits: false,
                },
            )
            .map_err(|e| format!("warm-up with batch {n}: {e}"))?;
        tracing::debug!(model = ctx.model, instance = %ctx.id, batch = n, ms = t.elapsed().as_millis() as u64, "warm-up");
    }
    Ok(())
}
