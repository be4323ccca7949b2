//! An instance's life on its own thread: its engine loaded and warmed up (the first time
//! reported to the model's load, whose failure fails the model), its batches run, and
//! after the engine panics a restart, after a pause that doubles while restarts fail or
//! the engine panics before finishing a batch. The model's stop ends a pause at once.
//! [`Instances`] keeps the model's state and its `visiongate_model_instances_up` gauge
//! following how many instances are up.
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

use super::instance::{instance_loop, Ended, InstanceContext, Slot};
use super::start::EngineFactory;
use super::tuning::{self, BatchSizeChoice, Tuned};
use super::ModelState;
use crate::domain::{InstanceId, WarmupSample};
use crate::engine::{EngineSpec, Stages};

/// How long an instance waits before a restart; doubled after each failed restart or
/// panic before a finished batch, up to `RESTART_PAUSE_MAX`.
const RESTART_PAUSE: Duration = Duration::from_secs(1);
const RESTART_PAUSE_MAX: Duration = Duration::from_secs(30);

/// What an instance's first load reports: its device and batch size, or why it failed.
pub(super) type Loaded = Result<(String, usize), String>;

/// One in a count while it lives: an instance thread in the server's count of them (from
/// just before it is spawned until it ends or fails to spawn), an instance with a JPEG
/// decoder (on its GPU) in the handle's `gpu_decoders` (while it serves).
pub(super) struct Counted(Arc<AtomicUsize>);

impl Counted {
    pub fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Counted(count.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The model's stop, as its instance threads wait for it: set once, waking every waiter.
#[derive(Default)]
pub(super) struct Halt {
    stopped: Mutex<bool>,
    woken: Condvar,
}

impl Halt {
    pub fn halt(&self) {
        *self.stopped.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.woken.notify_all();
    }

    /// Waits up to `pause`; whether the model stopped meanwhile.
    fn stopped_within(&self, pause: Duration) -> bool {
        let until = Instant::now() + pause;
        let mut stopped = self.stopped.lock().unwrap_or_else(|p| p.into_inner());
        while !*stopped {
            let Some(left) = until.checked_duration_since(Instant::now()) else {
                break;
            };
            stopped = match self.woken.wait_timeout(stopped, left) {
                Ok((guard, _)) => guard,
                Err(p) => p.into_inner().0,
            };
        }
        *stopped
    }
}

/// What one instance thread runs.
pub(super) struct Instance {
    pub id: InstanceId,
    pub factory: EngineFactory,
    pub spec: EngineSpec,
    pub ctx: InstanceContext,
    pub batch_size: BatchSizeChoice,
    pub tuned: Tuned,
    pub warmup: Vec<WarmupSample>,
    pub slots: mpsc::Sender<Slot>,
    pub instances: Arc<Instances>,
    pub halt: Arc<Halt>,
    pub gpu_decoders: Arc<AtomicUsize>,
}

impl Instance {
    /// Loads and warms up the engine; a panic meanwhile (a broken device) is a failed load.
    fn start(&self) -> Result<(Stages, usize), String> {
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            let _alone = self.id.gpu.is_none().then(tuning::cpu_start_alone);
            let mut stages = (self.factory)(&self.spec, self.id).map_err(|e| e.to_string())?;
            let target = tuning::prepare(
                stages.engine.as_mut(),
                &self.ctx,
                &self.batch_size,
                &self.tuned,
                &self.warmup,
            )?;
            Ok((stages, target))
        }))
        .unwrap_or_else(|_| Err("the engine panicked while loading".into()))
    }

    /// The instance until the model stops, its first load sent to `loaded`.
    pub fn supervise(self, loaded: oneshot::Sender<Loaded>) {
        let (id, model) = (self.id, self.ctx.model.clone());
        let mut loading = Some(loaded);
        let mut pause = RESTART_PAUSE;
        loop {
            match (self.start(), loading.take()) {
                (Ok((stages, target)), loading) => {
                    let device = stages.engine.device().to_string();
                    match loading {
                        Some(loaded) => {
                            self.instances.add_one();
                            let _ = loaded.send(Ok((device, target)));
                        }
                        None => {
                            self.instances.came_up();
                            tracing::warn!(model, instance = %id, "instance restarted");
                        }
                    }
                    let decodes = stages.decoder.is_some();
                    let _decoding = decodes.then(|| Counted::new(&self.gpu_decoders));
                    match instance_loop(&self.ctx, stages, target, &self.slots) {
                        Ended::Stopped => return,
                        Ended::Panicked { ran } => {
                            tracing::error!(model, instance = %id, "the engine or the JPEG decoder panicked; restarting the instance in {pause:?}");
                            let why =
                                format!("instance {id}: the engine or the JPEG decoder panicked");
                            self.instances.went_down(&why);
                            if ran > 0 {
                                pause = RESTART_PAUSE;
                            }
                        }
                    }
                }
                (Err(e), Some(loaded)) => {
                    let _ = loaded.send(Err(e));
                    return;
                }
                (Err(e), None) => {
                    tracing::error!(model, instance = %id, "restarting the instance failed: {e}; next try in {pause:?}");
                    self.instances.still_down(&format!("instance {id}: {e}"));
                }
            }
            if self.halt.stopped_within(pause) {
                return;
            }
            pause = (pause * 2).min(RESTART_PAUSE_MAX);
        }
    }
}

/// How many of a model's instances are up. The model's state says `Down` while none is,
/// and `Ready` again once one is back.
pub(super) struct Instances {
    up: AtomicUsize,
    /// `up`, as the `visiongate_model_instances_up` gauge shows it.
    shown: prometheus::IntGauge,
    pub state: watch::Sender<ModelState>,
}

impl Instances {
    pub fn new(shown: prometheus::IntGauge, state: watch::Sender<ModelState>) -> Instances {
        Instances {
            up: AtomicUsize::new(0),
            shown,
            state,
        }
    }

    fn add_one(&self) {
        let up = self.up.fetch_add(1, Ordering::SeqCst) + 1;
        self.shown.set(up as i64);
    }

    /// Every instance loaded: ready, unless all of them went down meanwhile.
    pub fn loaded(&self) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_ends_a_restart_pause_at_once() {
        let halt = Arc::new(Halt::default());
        let started = Instant::now();
        assert!(!halt.stopped_within(Duration::from_millis(30)));
        assert!(started.elapsed() >= Duration::from_millis(30));
        let stopper = {
            let halt = halt.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                halt.halt();
            })
        };
        let started = Instant::now();
        assert!(halt.stopped_within(Duration::from_secs(30)));
        assert!(started.elapsed() < Duration::from_secs(10));
        stopper.join().unwrap();
        assert!(
            halt.stopped_within(Duration::from_secs(30)),
            "stays stopped"
        );
    }
}
