//! Which engines run the classifiers: the runtimes this build has, started from the
//! server's settings into the registry (`engine::registry`) whose factory every instance
//! thread calls, or the deterministic fake of the tests. A new runtime is a module of
//! `engine/` under its own Cargo feature, started here.
use std::sync::Arc;
use std::time::Duration;

use crate::config::EngineSettings;
use crate::engine::registry::Registry;
use crate::engine::{Engine, FakeFaults};
use crate::scheduler::EngineFactory;

/// Which engines run the classifiers.
#[derive(Clone)]
pub enum EngineChoice {
    /// The runtime each model's platform names, of those this build has: libtorch for
    /// TorchScript and torch.export packages, ONNX Runtime for ONNX.
    Runtimes,
    /// The deterministic fake (tests): `num_classes` classes, `latency` per batch, and the
    /// faults a test orders.
    Fake {
        num_classes: usize,
        latency: Duration,
        faults: Arc<FakeFaults>,
    },
}

/// The engines of this process: the factory, and the GPUs instances can be planned on.
pub struct Engines {
    pub factory: EngineFactory,
    /// GPUs the runtimes can use.
    pub gpu_count: usize,
    /// GPUs of the host that CUDA cannot start on: `KIND_GPU` instances are planned on
    /// them so that they fail with the reason rather than run on the CPU.
    pub unusable_gpus: usize,
}

impl Engines {
    /// The engines of `choice` (intra-op threads, TF32, nvJPEG and the ONNX Runtime
    /// library as `settings` say).
    pub fn new(choice: EngineChoice, settings: EngineSettings) -> anyhow::Result<Engines> {
        match choice {
            EngineChoice::Runtimes => runtimes(settings),
            EngineChoice::Fake {
                num_classes,
                latency,
                faults,
            } => Ok(Engines {
                factory: Arc::new(move |spec, _| {
                    Ok(Box::new(faults.load(&spec.file, num_classes, latency)?) as Box<dyn Engine>)
                }),
                gpu_count: 0,
                unusable_gpus: 0,
            }),
        }
    }
}

/// Every runtime this build has, started, behind one factory.
fn runtimes(settings: EngineSettings) -> anyhow::Result<Engines> {
    let mut registry = Registry::default();
    let (gpu_count, unusable_gpus) = add_libtorch(&mut registry, &settings)?;
    add_onnx_runtime(&mut registry, &settings);
    tracing::info!(runtimes = ?registry.names(), "model runtimes of this build");
    let registry = Arc::new(registry);
    Ok(Engines {
        factory: Arc::new(move |spec, id| registry.load(spec, id)),
        gpu_count,
        unusable_gpus,
    })
}

/// libtorch, started: the GPUs it can use, and those of the host CUDA cannot start on.
#[cfg(feature = "torch")]
fn add_libtorch(
    registry: &mut Registry,
    settings: &EngineSettings,
) -> anyhow::Result<(usize, usize)> {
    use crate::config::Tf32;
    use crate::engine::libtorch::{Libtorch, Options};
    let libtorch = Libtorch::start(Options {
        intra_op_threads: settings.intra_op_threads,
        tf32: match settings.tf32 {
            Tf32::Default => None,
            Tf32::On => Some(true),
            Tf32::Off => Some(false),
        },
        gpu_decode: (settings.gpu_decode.as_ref()).map(|g| (g.library.clone(), g.memory_bytes)),
    })
    .map_err(anyhow::Error::msg)?;
    let gpus = (libtorch.gpus(), libtorch.unusable_gpus());
    registry.add(crate::engine::registry::RuntimeKind::Libtorch, libtorch);
    Ok(gpus)
}

/// Without libtorch, the GPUs are those the CUDA driver shows this process (none where
/// `CUDA_VISIBLE_DEVICES` hides them): ONNX Runtime's CUDA provider says at a model's load
/// whether it can use them.
#[cfg(not(feature = "torch"))]
fn add_libtorch(_: &mut Registry, _: &EngineSettings) -> anyhow::Result<(usize, usize)> {
    let gpus = crate::nvidia::driver::started().map_or(0, |(_, gpus)| gpus);
    Ok((gpus, 0))
}

#[cfg(feature = "onnx")]
fn add_onnx_runtime(registry: &mut Registry, settings: &EngineSettings) {
    registry.add(
        crate::engine::registry::RuntimeKind::OnnxRuntime,
        crate::engine::OnnxRuntime {
            library: settings.onnxruntime_library.clone(),
            intra_op_threads: settings.intra_op_threads,
        },
    );
}

#[cfg(not(feature = "onnx"))]
fn add_onnx_runtime(_: &mut Registry, _: &EngineSettings) {}
