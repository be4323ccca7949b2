//! Starting a model: its instance threads (each loads and warms up its engine and measures
//! its batch size), its batcher task, and the handle the transports call.
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch, Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use super::batcher::{run_batcher, BatcherLabels};
use super::handle::Inner;
use super::instance::{instance_loop, Ended, InstanceContext, Slot};
use super::{BatchPolicy, ModelHandle, ModelState, ResponseCache};
use crate::domain::{
    InstanceId, ModelName, ModelVersion, Normalize, Precision, WarmupData, WarmupSample,
};
use crate::engine::{BatchInput, Engine, EngineError, OutputRequest};
use crate::telemetry::Metrics;

/// Builds the engine of one instance, running the model file in a precision; called on
/// that instance's own thread.
pub type EngineFactory = Arc<
    dyn Fn(&std::path::Path, InstanceId, Precision) -> Result<Box<dyn Engine>, EngineError>
        + Send
        + Sync,
>;

#[derive(Debug, Clone)]
pub struct ModelSettings {
    pub name: ModelName,
    pub version: ModelVersion,
    pub instances: Vec<InstanceId>,
    /// The model file each instance loads.
    pub model_file: std::path::PathBuf,
    /// What its convolutions and matmuls run in.
    pub precision: Precision,
    /// Batching, and per priority level the queue's capacity (requests that may wait;
    /// one more is refused with `Overloaded`) and timeouts.
    pub policy: BatchPolicy,
    /// `Some` when the model's `response_cache` is enabled.
    pub cache: Option<Arc<ResponseCache>>,
    pub height: usize,
    pub width: usize,
    /// How each instance picks the batch size it asks the batcher for.
    pub batch_size: BatchSizeChoice,
    /// The config's `model_warmup` samples, run by each instance before it serves.
    pub warmup: Vec<WarmupSample>,
    /// Why the instances do not run where the config puts them (shown in metadata, a
    /// metric and the log).
    pub fallback: Option<String>,
    pub metrics: Arc<Metrics>,
}

/// Batch size per instance: fixed by the config, or the candidate with the lowest time per
/// image measured on the instance's own device at warm-up (on a CPU per-image cost grows
/// with batch size, on a GPU it falls).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchSizeChoice {
    Pinned(usize),
    Tune(Vec<usize>),
}

/// Starts the instance threads and the batcher task (call inside a Tokio runtime).
/// The handle is `Loading` until every instance has loaded and warmed up.
pub fn start_model(settings: ModelSettings, factory: EngineFactory) -> ModelHandle {
    let name = settings.name.to_string();
    let version = settings.version.to_string();
    settings.metrics.register_model(&name, &version);
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
        state: state_tx,
    });

    let mut loaded = Vec::new();
    let mut threads = Vec::new();
    // The batch size each device measured, for this model's other instances there.
    let tuned = Tuned::default();
    let stop = CancellationToken::new();
    for id in settings.instances.iter().copied() {
        let (done_tx, done_rx) = oneshot::channel::<Result<(String, usize), String>>();
        loaded.push((id, done_rx));
        let factory = factory.clone();
        let (model_file, precision) = (settings.model_file.clone(), settings.precision);
        let slots = slots_tx.clone();
        let ctx = InstanceContext {
            model: name.clone(),
            version: version.clone(),
            metrics: settings.metrics.clone(),
            id,
            height: settings.height,
            width: settings.width,
        };
        let choice = settings.batch_size.clone();
        let tuned = tuned.clone();
        let samples = settings.warmup.clone();
        let (instances, stop) = (instances.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("{name}/{id}"))
            .spawn(move || {
                // A panic while loading (a broken device) is a failed load.
                let start = || {
                    std::panic::catch_unwind(AssertUnwindSafe(|| {
                        // CPU instances start one at a time (load, first runs, timing):
                        // another's load on the shared cores would be timed as this one's.
                        // GPU instances load side by side (each GPU compiles its own).
                        let _cpu = id
                            .gpu
                            .is_none()
                            .then(|| CPU_START.lock().unwrap_or_else(|e| e.into_inner()));
                        let mut engine = factory(&model_file, id, precision).map_err(|e| e.to_string())?;
                        let target = warm_up(engine.as_mut(), &ctx, &choice, &tuned)?;
                        run_warmup_samples(engine.as_mut(), &ctx, &samples)?;
                        // What the batch-size candidates left allocated but free, before
                        // the next instance warms up beside it.
                        crate::memory::release_free_memory();
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
                            let device = engine.device_name();
                            match loading {
                                Some(done) => {
                                    instances.up.fetch_add(1, Ordering::SeqCst);
                                    let _ = done.send(Ok((device, target)));
                                }
                                None => {
                                    instances.came_up();
                                    tracing::warn!(model = ctx.model, instance = %id, "instance restarted");
                                }
                            }
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

    tokio::spawn(run_batcher(
        BatcherLabels {
            model: name.clone(),
            version: version.clone(),
            metrics: settings.metrics.clone(),
        },
        jobs_rx,
        slots_rx,
        settings.policy.clone(),
        state_rx.clone(),
        stop.clone(),
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
            threads: std::sync::Mutex::new(threads),
            last_inference_ms: Default::default(),
            retiring: Default::default(),
            retired: Default::default(),
            devices,
            fallback: settings.fallback,
            generation: {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
            place_freed: Arc::new(Notify::new()),
            arriving: Default::default(),
            name: settings.name,
            version: settings.version,
            metrics: settings.metrics,
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
    state: watch::Sender<ModelState>,
}

impl Instances {
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
        if self.up.fetch_sub(1, Ordering::SeqCst) == 1 {
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
        self.up.fetch_add(1, Ordering::SeqCst);
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

/// Warms the instance up (TorchScript optimizes on its first calls) and returns its batch
/// size: the pinned one, or the candidate with the lowest measured time per image. Other
/// batch shapes are not run one by one: after the first two calls, a new shape's first run
/// was measured within about 15% of its steady time on this model.
/// Runs the config's `model_warmup` samples as Triton does: each `count` times, in order;
/// the first that fails fails the instance's load, naming the sample.
fn run_warmup_samples(
    engine: &mut dyn Engine,
    ctx: &InstanceContext,
    samples: &[WarmupSample],
) -> Result<(), String> {
    let row = ctx.height * ctx.width * 3;
    for sample in samples {
        let n = sample.batch_size;
        let mut data = match &sample.data {
            WarmupData::Zero => vec![0.0f32; n * row],
            WarmupData::Random => {
                // xorshift: values in [0, 1), different for each sample and row.
                let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ (n as u64);
                (0..n * row)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x >> 40) as f32 / (1u64 << 24) as f32
                    })
                    .collect()
            }
            WarmupData::Row(values) => values.repeat(n),
        };
        data.truncate(n * row);
        let t = Instant::now();
        for _ in 0..sample.count {
            let input = BatchInput::Tensors {
                data: &data,
                height: ctx.height,
                width: ctx.width,
            };
            let want = OutputRequest {
                top_k: 1,
                logits: false,
            };
            engine
                .run(input, want)
                .map_err(|e| format!("failed to run warmup sample '{}': {e}", sample.name))?;
        }
        tracing::info!(
            model = ctx.model,
            instance = %ctx.id,
            sample = sample.name,
            count = sample.count,
            batch_size = n,
            secs = format!("{:.2}", t.elapsed().as_secs_f64()),
            "warmup sample ran"
        );
    }
    Ok(())
}

/// Held by a CPU instance from its load to the end of its warm-up.
static CPU_START: Mutex<()> = Mutex::new(());

/// Batch sizes measured per device (`cpu`, `cuda:0`) by one start of a model: its
/// instances on one device share the first one's measurement. Identical instances then
/// ask for the same size, instead of each reading its own noise, and start sooner.
type Tuned = Arc<Mutex<HashMap<String, usize>>>;

/// Runs the first calls (the executor specializes on them), then picks the batch size:
/// pinned by the config, measured on this device by another instance of this start, or
/// measured here: each candidate's first run (a new shape) and one timed run in order,
/// stopping once two in a row have not beaten the fastest so far (on the CPU: by the
/// tolerance, as a larger size is only chosen when it does, and each leaves more memory
/// behind); then two more timed rounds over
/// the candidates kept, interleaved so that a slow stretch of the machine falls on all of
/// them; per candidate the fastest of its three.
fn warm_up(
    engine: &mut dyn Engine,
    ctx: &InstanceContext,
    choice: &BatchSizeChoice,
    tuned: &Tuned,
) -> Result<usize, String> {
    let row = ctx.height * ctx.width * 3;
    let device = engine.device_name();
    let mut run = |n: usize| -> Result<f64, String> {
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
        Ok(t.elapsed().as_secs_f64())
    };
    // The profiling executor specializes on its first two calls.
    run(1)?;
    run(1)?;
    let mut candidates = match choice {
        // Not run at its own size: a pinned size can be the whole upload (a batch of 1000
        // takes minutes on a CPU, and may not fit a GPU's memory at load), and after the
        // calls above a new shape's first run is within about 15% of its steady time on
        // this model (on a GPU a new shape compiles once; see `TorchEngine::padded`).
        BatchSizeChoice::Pinned(n) => return Ok(*n),
        BatchSizeChoice::Tune(c) => c.clone(),
    };
    if device == "cpu" {
        // Larger CPU batches were never faster per image here (bf16 at 16: 7.6 ms per image,
        // at 8: 7.3), and their activations are what the process's peak memory is made of
        // (timing FP32 at 16 images took the process from 210 to 584 MiB).
        let smallest = candidates.iter().copied().min();
        candidates.retain(|&n| n <= MAX_CPU_CANDIDATE);
        if candidates.is_empty() {
            candidates.extend(smallest);
        }
    }
    // One instance of the process times its candidates at a time: instances warming up
    // together (on one GPU, or on the CPU's cores) would each time the others' work too,
    // and the last to finish would find large batches cheaper than they are.
    static TIMING: Mutex<()> = Mutex::new(());
    let _alone = TIMING.lock().unwrap_or_else(|e| e.into_inner());
    let known = tuned
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&device)
        .copied();
    if let Some(chosen) = known {
        // Its shapes still run once here, so that no request pays for a first run.
        run(chosen)?;
        tracing::info!(model = ctx.model, instance = %ctx.id, chosen, device, "batch size as measured by another instance on this device");
        return Ok(chosen);
    }
    let mut table: Vec<(usize, f64)> = Vec::new();
    let mut best = f64::INFINITY;
    // On a GPU per-image time keeps falling by a few percent a step up to large sizes, so
    // any gain counts there; on the CPU only one beyond the tolerance.
    let margin = if device == "cpu" {
        BATCH_SIZE_TOLERANCE
    } else {
        0.0
    };
    let mut no_gain_in_a_row = 0;
    for &n in &candidates {
        run(n)?; // first run of this shape
        let per_image = run(n)? / n as f64;
        table.push((n, per_image));
        if per_image < best * (1.0 - margin) {
            no_gain_in_a_row = 0;
        } else {
            no_gain_in_a_row += 1;
            // Per-image cost no longer falls enough past this point on this device.
            if no_gain_in_a_row == 2 {
                break;
            }
        }
        best = best.min(per_image);
    }
    for _ in 0..2 {
        for (n, per_image) in table.iter_mut() {
            *per_image = per_image.min(run(*n)? / *n as f64);
        }
    }
    let chosen = choose_batch_size(&table);
    tuned
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(device, chosen);
    let table: Vec<String> = table
        .iter()
        .map(|(n, t)| format!("{n}:{:.1}ms", t * 1e3))
        .collect();
    tracing::info!(
        model = ctx.model,
        instance = %ctx.id,
        per_image = %table.join(" "),
        chosen,
        "batch size measured"
    );
    Ok(chosen)
}

/// The largest batch size timed on the CPU (see `warm_up`).
const MAX_CPU_CANDIDATE: usize = 8;

/// Within this fraction of the fastest per-image time, sizes count as equally fast: a
/// 2-core VM's timings of one size vary by 5 to 9% between starts, and a margin below that
/// picked sizes 1 or 2 from start to start.
const BATCH_SIZE_TOLERANCE: f64 = 0.10;

/// The smallest measured batch size whose time per image is within the tolerance of the
/// fastest: as fast, lower latency, and steadier against timing noise than the minimum.
fn choose_batch_size(per_image: &[(usize, f64)]) -> usize {
    let best = per_image
        .iter()
        .map(|&(_, t)| t)
        .fold(f64::INFINITY, f64::min);
    per_image
        .iter()
        .filter(|&&(_, t)| t <= best * (1.0 + BATCH_SIZE_TOLERANCE))
        .map(|&(n, _)| n)
        .min()
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::choose_batch_size;

    #[test]
    fn the_smallest_size_about_as_fast_as_the_best_is_chosen() {
        // CPU-like: cost per image grows with the batch.
        assert_eq!(choose_batch_size(&[(1, 0.040), (2, 0.043), (4, 0.047)]), 1);
        // Noise: 2 measured 2% (or 8%) faster than 1.
        assert_eq!(choose_batch_size(&[(1, 0.041), (2, 0.040), (4, 0.047)]), 1);
        assert_eq!(
            choose_batch_size(&[(1, 0.0147), (2, 0.0135), (4, 0.0185)]),
            1
        );
        // A real gain: 2 is 18% faster than 1.
        assert_eq!(
            choose_batch_size(&[(1, 0.0105), (2, 0.0086), (4, 0.0079)]),
            2
        );
        // GPU-like: big batches are much cheaper per image.
        assert_eq!(
            choose_batch_size(&[(1, 0.010), (8, 0.002), (32, 0.0006), (64, 0.00059)]),
            32
        );
    }
}
