//! Starting a model: the wiring of its instance threads (each supervised by
//! `supervisor.rs`: loads and warms up its engine, measures its batch size, restarts after
//! a panic), its batcher task, the report of its load, and the handle the transports call.
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot, watch, Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use super::batcher::{run_batcher, BatcherLabels, BatcherSignals};
use super::handle::Inner;
use super::instance::{InstanceContext, Slot};
use super::supervisor::{Counted, Halt, Instance, Instances, Loaded};
use super::tuning::{BatchSizeChoice, Tuned};
use super::{BatchPolicy, ModelHandle, ModelState, ResponseCache};
use crate::cores::Cores;
use crate::domain::{InstanceId, ModelName, ModelVersion, WarmupSample};
use crate::engine::{EngineError, EngineSpec, Stages};
use crate::telemetry::Metrics;

/// Builds what one instance runs (its engine, and its JPEG decoder where it has one) as
/// its `EngineSpec` says; called on that instance's own thread.
pub type EngineFactory =
    Arc<dyn Fn(&EngineSpec, InstanceId) -> Result<Stages, EngineError> + Send + Sync>;

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
    /// The host's cores: a CPU instance holds its threads' share while it runs a batch.
    pub cores: Arc<Cores>,
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
    let instances = Arc::new(Instances::new(series.instances_up.clone(), state_tx));

    let mut loaded = Vec::new();
    let mut threads = Vec::new();
    let gpu_decoders = Arc::new(AtomicUsize::new(0));
    // The batch size each device measured, for this model's other instances there.
    let tuned = Tuned::default();
    let stop = CancellationToken::new();
    // The stop as the instance threads wait for it (`shutdown` sets both).
    let halt = Arc::new(Halt::default());
    for id in settings.instances.iter().copied() {
        let (done_tx, done_rx) = oneshot::channel::<Loaded>();
        loaded.push((id, done_rx));
        let instance = Instance {
            id,
            factory: factory.clone(),
            spec: settings.engine.clone(),
            ctx: InstanceContext {
                model: name.clone(),
                version: settings.version.0,
                series: series.clone(),
                cores: settings.cores.clone(),
                executions: settings.metrics.instance_executions(&name, &id.to_string()),
                id,
                height: settings.engine.height,
                width: settings.engine.width,
                batch_rows: settings.engine.max_batch_size.max(1),
            },
            batch_size: settings.batch_size.clone(),
            tuned: tuned.clone(),
            warmup: settings.warmup.clone(),
            slots: slots_tx.clone(),
            instances: instances.clone(),
            halt: halt.clone(),
            gpu_decoders: gpu_decoders.clone(),
        };
        let live = Counted::new(&settings.live_instances);
        let spawned = std::thread::Builder::new()
            .name(format!("{name}/{id}"))
            .spawn(move || {
                let _live = live;
                instance.supervise(done_tx);
            });
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(e) => tracing::error!(model = name, "cannot spawn an instance thread: {e}"),
        }
    }
    drop(slots_tx);

    let (flush, wake) = (CancellationToken::new(), Arc::new(Notify::new()));
    let feeding = Arc::new(AtomicUsize::new(0));
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
            feeding: feeding.clone(),
        },
    ));
    let devices = Arc::new(std::sync::Mutex::new(Vec::new()));
    tokio::spawn(report_load(
        LoadReport {
            model: (name, version),
            metrics: settings.metrics.clone(),
            fallback: settings.fallback.clone(),
            devices: devices.clone(),
        },
        loaded,
        instances,
    ));

    ModelHandle {
        inner: Arc::new(Inner {
            stop,
            halt,
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
            feeding,
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

/// Where a model's load is reported: its name and version, the instance-device series,
/// why its instances run where they do, and the handle's list of instance devices.
struct LoadReport {
    model: (String, String),
    metrics: Arc<Metrics>,
    fallback: Option<String>,
    devices: Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

/// Waits for every instance's first load: the model is ready once all have loaded, or
/// failed with each failure's reason; each loaded instance's device is shown.
async fn report_load(
    report: LoadReport,
    loaded: Vec<(InstanceId, oneshot::Receiver<Loaded>)>,
    instances: Arc<Instances>,
) {
    let LoadReport {
        model: (name, version),
        metrics,
        fallback,
        devices,
    } = report;
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
                devices
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
}
