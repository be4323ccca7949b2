//! Starting a model: its instance threads (each loads and warms up its engine and measures
//! its batch size), its batcher task, and the handle the transports call.
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch, Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use super::batcher::{run_batcher, BatcherLabels, BatcherSignals};
use super::handle::Inner;
use super::instance::{instance_loop, Ended, InstanceContext, Slot};
use super::tuning::{self, BatchSizeChoice, Tuned};
use super::{BatchPolicy, ModelHandle, ModelState, ResponseCache};
use crate::domain::{InstanceId, ModelName, ModelVersion, WarmupSample};
use crate::engine::{Engine, EngineError, EngineSpec};
use crate::telemetry::Metrics;

/// Builds the engine of one instance as its `EngineSpec` says; called on that instance's
/// own thread.
pub type EngineFactory =
    Arc<dyn Fn(&EngineSpec, InstanceId) -> Result<Box<dyn Engine>, EngineError> + Send + Sync>;

#[derive(Debug, Clone)]
pub struct ModelSettings {
    pub name: ModelName,
    pub version: ModelVersion,
    pub instances: Vec<InstanceId>,
    /// What each instance loads: the model file, its runtime, precision and tensors.
    pub engine: EngineSpec,
    /// Batching, and per priority level the queue's capacity (requests that may wait;
    /// one more is refused with `Overloaded`) and timeouts.
    pub policy: BatchPolicy,
    /// `Some` when the model's `response_cache` is enabled.
    pub cache: Option<Arc<ResponseCache>>,
    /// How each instance picks the batch size it asks the batcher for.
    pub batch_size: BatchSizeChoice,
    /// The config's `model_warmup` samples, run by each instance before it serves.
    pub warmup: Vec<WarmupSample>,
    /// Why the instances do not run where the config puts them (shown in metadata, a
    /// metric and the log).
    pub fallback: Option<String>,
    pub metrics: Arc<Metrics>,
    /// Instance threads running, of every model: each of this model's counts while its
    /// thread lives.
    pub live_instances: Arc<AtomicUsize>,
}

/// One in a count while it lives: an instance thread in `ModelSettings::live_instances`
/// (from just before it is spawned until it ends or fails to spawn), an instance whose
/// engine decodes JPEGs on its GPU in the handle's `gpu_decoders` (while it serves).
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Counted(count.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Starts the instance threads and the batcher task (call inside a Tokio runtime).
/// The handle is `Loading` until every instance has loaded and warmed up.
pub fn start_model(settings: ModelSettings, factory: EngineFactory) -> ModelHandle {
    let name = settings.name.to_string();
    let version = settings.version.to_string();
    let series = settings.metrics.register_model(&name, &version);
    let queue_places: Vec<Arc<Semaphore>> = settings
        .policy
        .queues
        .iter()
        .map(|q| Arc::new(Semaphore::new(q.capacity.max(1))))
        .collect();
    let capacity: usize = settings
        .policy
        .queues
        .iter()
        .map(|q| q.capacity.max(1))
        .sum();
    // The batcher drains this at once into its own queue (bounded by `queue_places`);
    // the capacity only smooths bursts of chunks from streaming uploads.
    let (jobs_tx, jobs_rx) = mpsc::channel(capacity * 4);
    // Every instance holds at most one outstanding offer.
    let (slots_tx, slots_rx) = mpsc::channel::<Slot>(settings.instances.len().max(1));
    let (state_tx, state_rx) = watch::channel(ModelState::Loading);
    let instances = Arc::new(Instances {
        up: AtomicUsize::new(0),
        shown: series.instances_up.clone(),
        state: state_tx,
    });

    let mut loaded = Vec::new();
    let mut threads = Vec::new();
    let gpu_decoders = Arc::new(AtomicUsize::new(0));
    // The batch size each device measured, for this model's other instances there.
    let tuned = Tuned::default();
    let stop = CancellationToken::new();
    for id in settings.instances.iter().copied() {
        let (done_tx, done_rx) = oneshot::channel::<Result<(String, usize), String>>();
        loaded.push((id, done_rx));
        let factory = factory.clone();
        let spec = settings.engine.clone();
        let slots = slots_tx.clone();
        let ctx = InstanceContext {
            model: name.clone(),
            series: series.clone(),
            metrics: settings.metrics.clone(),
            executions: settings.metrics.instance_executions(&name, &id.to_string()),
            id,
            height: settings.engine.height,
            width: settings.engine.width,
            batch_rows: settings.engine.max_batch_size.max(1),
        };
        let choice = settings.batch_size.clone();
        let tuned = tuned.clone();
        let samples = settings.warmup.clone();
        let (instances, stop) = (instances.clone(), stop.clone());
        let gpu_decoders = gpu_decoders.clone();
        let live = Counted::new(&settings.live_instances);
        let spawned = std::thread::Builder::new()
            .name(format!("{name}/{id}"))
            .spawn(move || {
                let _live = live;
                // A panic while loading (a broken device) is a failed load.
                let start = || {
                    std::panic::catch_unwind(AssertUnwindSafe(|| {
                        let _alone = id.gpu.is_none().then(tuning::cpu_start_alone);
                        let mut engine = factory(&spec, id).map_err(|e| e.to_string())?;
                        let target = tuning::prepare(engine.as_mut(), &ctx, &choice, &tuned, &samples)?;
                        Ok::<_, String>((engine, target))
                    }))
                    .unwrap_or_else(|_| Err("the engine panicked while loading".into()))
                };
                // The first load is reported to the model's loading; a failure there fails
                // the model. Later ones restart the instance after a panic, after a pause
                // that doubles while restarts fail or the engine panics before finishing a
                // batch.
                let mut loading = Some(done_tx);
                let mut pause = RESTART_PAUSE;
                loop {
                    match (start(), loading.take()) {
                        (Ok((engine, target)), loading) => {
                            let device = engine.device().to_string();
                            match loading {
                                Some(done) => {
                                    instances.add_one();
                                    let _ = done.send(Ok((device, target)));
                                }
                                None => {
                                    instances.came_up();
                                    tracing::warn!(model = ctx.model, instance = %id, "instance restarted");
                                }
                            }
                            let _decoding = engine.decodes_jpeg().then(|| Counted::new(&gpu_decoders));
                            match instance_loop(&ctx, engine, target, &slots) {
                                Ended::Stopped => return,
                                Ended::Panicked { ran } => {
                                    tracing::error!(model = ctx.model, instance = %id, "the engine panicked; restarting the instance in {pause:?}");
                                    instances.went_down(&format!("instance {id}: the engine panicked"));
                                    if ran > 0 {
                                        pause = RESTART_PAUSE;
                                    }
                                }
                            }
                        }
                        (Err(e), Some(done)) => {
                            let _ = done.send(Err(e));
                            return;
                        }
                        (Err(e), None) => {
                            tracing::error!(model = ctx.model, instance = %id, "restarting the instance failed: {e}; next try in {pause:?}");
                            instances.still_down(&format!("instance {id}: {e}"));
                        }
                    }
                    if stopped_within(&stop, pause) {
                        return;
                    }
                    pause = (pause * 2).min(RESTART_PAUSE_MAX);
                }
            });
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(e) => tracing::error!(model = name, "cannot spawn an instance thread: {e}"),
        }
    }
    drop(slots_tx);

    let (flush, wake) = (CancellationToken::new(), Arc::new(Notify::new()));
    tokio::spawn(run_batcher(
        BatcherLabels {
            model: name.clone(),
            series: series.clone(),
        },
        jobs_rx,
        slots_rx,
        settings.policy.clone(),
        BatcherSignals {
            state: state_rx.clone(),
            stop: stop.clone(),
            flush: flush.clone(),
            wake: wake.clone(),
        },
    ));
    let devices = Arc::new(std::sync::Mutex::new(Vec::new()));
    let placed = devices.clone();
    let (metrics, fallback) = (settings.metrics.clone(), settings.fallback.clone());
    tokio::spawn(async move {
        let started = Instant::now();
        let mut failures = Vec::new();
        let mut shown = Vec::new();
        for (id, rx) in loaded {
            match rx.await {
                Ok(Ok((device, batch))) => {
                    shown.push(format!("{id}={device} batch {batch}"));
                    metrics
                        .instance_device
                        .with_label_values(&[
                            name.as_str(),
                            version.as_str(),
                            &id.to_string(),
                            &device,
                            fallback.as_deref().unwrap_or_default(),
                        ])
                        .set(1);
                    placed
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((id.to_string(), device));
                }
                Ok(Err(e)) => failures.push(format!("instance {id}: {e}")),
                Err(_) => failures.push(format!("instance {id}: thread ended while loading")),
            }
        }
        if failures.is_empty() {
            tracing::info!(
                model = name,
                instances = %shown.join(" "),
                secs = format!("{:.2}", started.elapsed().as_secs_f64()),
                "model ready"
            );
            instances.loaded();
        } else {
            let msg = failures.join("; ");
            tracing::error!(model = name, "model failed to load: {msg}");
            instances.state.send_replace(ModelState::Failed(msg));
        }
        // Keep the state readable as long as anyone looks at it.
        instances.state.closed().await;
    });

    ModelHandle {
        inner: Arc::new(Inner {
            stop,
            flush,
            wake,
            threads: std::sync::Mutex::new(threads),
            last_inference_ms: Default::default(),
            retiring: Default::default(),
            retired: Default::default(),
            devices,
            gpu_decoders,
            fallback: settings.fallback,
            generation: {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
            place_freed: Arc::new(Notify::new()),
            arriving: Default::default(),
            name: settings.name,
            version: settings.version,
            series,
            jobs: jobs_tx,
            policy: settings.policy,
            queue_places,
            cache: settings.cache,
            state: state_rx,
        }),
    }
}

/// How long an instance waits before a restart; doubled after each failed restart or
/// panic before a finished batch, up to `RESTART_PAUSE_MAX`.
const RESTART_PAUSE: Duration = Duration::from_secs(1);
const RESTART_PAUSE_MAX: Duration = Duration::from_secs(30);

/// How many of a model's instances are up. The model's state says `Down` while none is,
/// and `Ready` again once one is back.
struct Instances {
    up: AtomicUsize,
    /// `up`, as the `visiongate_model_instances_up` gauge shows it.
    shown: prometheus::IntGauge,
    state: watch::Sender<ModelState>,
}

impl Instances {
    fn add_one(&self) {
        let up = self.up.fetch_add(1, Ordering::SeqCst) + 1;
        self.shown.set(up as i64);
    }

    /// Every instance loaded: ready, unless all of them went down meanwhile.
    fn loaded(&self) {
        let state = if self.up.load(Ordering::SeqCst) > 0 {
            ModelState::Ready
        } else {
            ModelState::Down("every instance went down after loading".into())
        };
        self.state.send_replace(state);
    }

    fn went_down(&self, why: &str) {
        let up = self.up.fetch_sub(1, Ordering::SeqCst) - 1;
        self.shown.set(up as i64);
        if up == 0 {
            self.still_down(why);
        }
    }

    /// With no instance up, the state gives the latest reason.
    fn still_down(&self, why: &str) {
        self.state.send_if_modified(|state| {
            let serving = matches!(state, ModelState::Ready | ModelState::Down(_));
            let down = serving && self.up.load(Ordering::SeqCst) == 0;
            if down {
                *state = ModelState::Down(format!("every instance is down ({why}); restarting"));
            }
            down
        });
    }

    fn came_up(&self) {
        self.add_one();
        self.state.send_if_modified(|state| {
            let down = matches!(state, ModelState::Down(_));
            if down {
                *state = ModelState::Ready;
            }
            down
        });
    }
}

/// Waits up to `pause`; whether the model stopped meanwhile.
fn stopped_within(stop: &CancellationToken, pause: Duration) -> bool {
    let until = Instant::now() + pause;
    while Instant::now() < until {
        if stop.is_cancelled() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.is_cancelled()
}
