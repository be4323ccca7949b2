//! Which engines run the classifiers, and the one factory every instance thread calls to
//! load its engine: the runtime a model's platform names (libtorch, with why CUDA cannot
//! start on a host whose GPUs it cannot use, or ONNX Runtime), or the deterministic fake of
//! the tests. A new model runtime joins here.
use std::sync::Arc;
use std::time::Duration;

use crate::config::EngineSettings;
#[cfg(feature = "torch")]
use crate::config::{GpuDecode, Tf32};
#[cfg(feature = "torch")]
use crate::domain::Runtime;
use crate::engine::cuda_ipc::{CudaIpc, NoGpus};
#[cfg(feature = "torch")]
use crate::engine::{self, cuda_host, TorchEngine};
use crate::engine::{Engine, FakeFaults};
use crate::scheduler::EngineFactory;
#[cfg(feature = "torch")]
use crate::telemetry;

/// Which engines run the classifiers.
#[derive(Clone)]
pub enum EngineChoice {
    /// The runtime each model's platform names: libtorch for TorchScript, ONNX Runtime for
    /// ONNX.
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
    /// GPUs libtorch can use.
    pub gpu_count: usize,
    /// GPUs of the host that CUDA cannot start on: `KIND_GPU` instances are planned on
    /// them so that they fail with the reason rather than run on the CPU.
    pub unusable_gpus: usize,
    /// The GPUs' memory clients share by CUDA IPC handle (CUDA shared memory).
    pub cuda_ipc: Arc<dyn CudaIpc>,
}

impl Engines {
    /// The engines of `choice` (intra-op threads, TF32 and the ONNX Runtime library as
    /// `settings` say).
    pub fn new(choice: EngineChoice, settings: EngineSettings) -> anyhow::Result<Engines> {
        match choice {
            #[cfg(feature = "torch")]
            EngineChoice::Runtimes => runtimes(settings),
            #[cfg(not(feature = "torch"))]
            EngineChoice::Runtimes => {
                let _ = settings;
                anyhow::bail!("this build has no libtorch (the `torch` feature)")
            }
            EngineChoice::Fake {
                num_classes,
                latency,
                faults,
            } => {
                let cuda_ipc: Arc<dyn CudaIpc> = match &faults.cuda_ipc {
                    Some(fake) => fake.clone(),
                    None => Arc::new(NoGpus),
                };
                Ok(Engines {
                    factory: Arc::new(move |spec, _| {
                        Ok(Box::new(faults.load(&spec.file, num_classes, latency)?)
                            as Box<dyn Engine>)
                    }),
                    gpu_count: 0,
                    unusable_gpus: 0,
                    cuda_ipc,
                })
            }
        }
    }
}

#[cfg(feature = "torch")]
fn runtimes(settings: EngineSettings) -> anyhow::Result<Engines> {
    let EngineSettings {
        intra_op_threads,
        tf32,
        onnxruntime_library,
        gpu_decode,
    } = settings;
    let torch_gpus = engine::cuda_device_count();
    match cuda_host::cuda_support() {
        cuda_host::CudaSupport::Loaded => {
            tracing::info!(gpus = torch_gpus, "libtorch CUDA support loaded")
        }
        cuda_host::CudaSupport::NoDriver => {
            tracing::info!("no NVIDIA driver (libcuda.so.1): libtorch's CUDA support not loaded")
        }
        cuda_host::CudaSupport::Failed(why) => {
            tracing::error!("libtorch's CUDA support did not load: {why}")
        }
    }
    let host_gpus = host_gpus(torch_gpus);
    let problem = (host_gpus > 0 && torch_gpus == 0)
        .then(|| cuda_host::cuda_problem(cuda_host::runtime_version(), &cuda_host::driver_state()))
        .flatten();
    if let Some(why) = &problem {
        tracing::error!("CUDA cannot start; KIND_GPU models will fail to load: {why}");
    }
    if tf32 != Tf32::Default {
        engine::cuda::set_allow_tf32(tf32 == Tf32::On)
            .map_err(|e| anyhow::anyhow!("--tf32: {e}"))?;
    }
    if torch_gpus > 0 {
        let (cudnn, cublas) = engine::cuda::allow_tf32();
        tracing::info!(
            gpus = torch_gpus,
            "TF32: cuDNN convolutions {cudnn}, cuBLAS matmuls {cublas}"
        );
    }
    let unusable_gpus = if problem.is_some() { host_gpus } else { 0 };
    let nvjpeg = jpeg_decoder(gpu_decode.as_ref(), torch_gpus);
    let factory: EngineFactory = Arc::new(move |spec, id| match spec.runtime {
        Runtime::TorchScript | Runtime::TorchAoti => {
            if let (Some(why), Some(_)) = (&problem, id.gpu) {
                return Err(engine::EngineError::Load {
                    path: format!("instance {id}"),
                    message: format!("CUDA cannot start on this host: {why}"),
                });
            }
            // Per thread: libtorch's intra-op pool size is a thread-local setting. GPU
            // instances too, so the little CPU work they do (the copy into the staging
            // buffer) never spreads over the cores decoding needs.
            tch::set_num_threads(intra_op_threads as i32);
            let mut engine = TorchEngine::load(spec, id.gpu)?;
            if let Some((library, memory)) = nvjpeg {
                engine.decode_jpeg_with(library, memory);
            }
            Ok(Box::new(engine) as Box<dyn Engine>)
        }
        Runtime::Onnx(options) => onnx(
            spec,
            options,
            id.gpu,
            intra_op_threads,
            onnxruntime_library.as_deref(),
        ),
    });
    Ok(Engines {
        factory,
        gpu_count: torch_gpus,
        unusable_gpus,
        cuda_ipc: Arc::new(engine::cuda_ipc::HostGpus::default()),
    })
}

/// nvJPEG for libtorch's GPU instances, with the device memory each may decode into; said
/// once at start: where JPEGs are decoded, and why not on the GPU.
#[cfg(feature = "torch")]
fn jpeg_decoder(
    settings: Option<&GpuDecode>,
    gpus: usize,
) -> Option<(&'static engine::nvjpeg::Library, u64)> {
    let Some(settings) = settings else {
        if gpus > 0 {
            tracing::info!("--gpu-decode=false: images are decoded on the CPU");
        }
        return None;
    };
    if gpus == 0 {
        tracing::info!("no GPU: images are decoded on the CPU");
        return None;
    }
    match engine::nvjpeg::library(settings.library.as_deref()) {
        Ok(library) => {
            tracing::info!(
                version = library.version(),
                "nvJPEG loaded: JPEGs are decoded on the GPU for classifiers that run there"
            );
            Some((library, settings.memory_bytes))
        }
        Err(e) => {
            tracing::warn!(
                "nvJPEG did not load, images are decoded on the CPU: {e} (set --nvjpeg-library)"
            );
            None
        }
    }
}

/// An ONNX Runtime engine, or why this build has none.
#[cfg(feature = "torch")]
fn onnx(
    spec: &engine::EngineSpec,
    options: crate::domain::OnnxOptions,
    gpu: Option<u32>,
    threads: usize,
    library: Option<&std::path::Path>,
) -> Result<Box<dyn Engine>, engine::EngineError> {
    #[cfg(feature = "onnx")]
    return Ok(Box::new(engine::OnnxEngine::load(
        spec, options, gpu, threads, library,
    )?));
    #[cfg(not(feature = "onnx"))]
    {
        let _ = (options, gpu, threads, library);
        Err(engine::EngineError::Load {
            path: engine::repository_relative(&spec.file),
            message: "this build has no ONNX Runtime (the `onnx` feature)".into(),
        })
    }
}

/// The NVIDIA GPUs the driver sees (NVML), logged beside libtorch's view.
#[cfg(feature = "torch")]
fn host_gpus(torch_gpus: usize) -> usize {
    telemetry::Nvml::open().map_or(0, |nvml| {
        let (driver, cuda) = nvml.versions();
        let runtime =
            cuda_host::runtime_version().map_or("none".to_string(), cuda_host::version_text);
        let gpus = nvml.count() as usize;
        tracing::info!(
            driver,
            driver_cuda = cuda,
            gpus,
            libtorch_cuda_runtime = runtime,
            libtorch_gpus = torch_gpus,
            "NVIDIA driver"
        );
        gpus
    })
}
