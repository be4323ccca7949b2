//! libtorch as a runtime of this build: started once (its CUDA half, TF32, nvJPEG for its
//! GPU instances, why CUDA cannot start on a host whose GPUs it cannot use), then the
//! engine of each TorchScript or torch.export instance.
use std::path::PathBuf;

use super::jpeg::GpuJpeg;
use super::{cuda, cuda_device_count, cuda_host, TorchEngine};
use crate::domain::InstanceId;
use crate::engine::registry::Backend;
use crate::engine::{EngineError, EngineSpec, Stages};
use crate::nvidia::{driver, nvjpeg, version_text, Nvml};
use crate::preprocess::BatchDecoder;

/// How libtorch starts.
#[derive(Debug, Clone)]
pub struct Options {
    /// Intra-op threads per instance.
    pub intra_op_threads: usize,
    /// TF32 for cuDNN convolutions and cuBLAS matmuls; `None`: libtorch's default.
    pub tf32: Option<bool>,
    /// oneDNN Graph's fuser for TorchScript where libtorch has no GPU.
    pub onednn_fusion: bool,
    /// JPEG decode on GPU instances: nvJPEG's library (`None`: the dynamic linker's
    /// search) and the device memory each instance's decoded images may hold at once.
    pub gpu_decode: Option<(Option<PathBuf>, u64)>,
}

/// libtorch, started.
pub struct Libtorch {
    intra_op_threads: usize,
    gpus: usize,
    /// Why CUDA cannot start although the host has NVIDIA GPUs (`unusable_gpus` of them).
    problem: Option<String>,
    unusable_gpus: usize,
    nvjpeg: Option<(&'static nvjpeg::Library, u64)>,
}

impl Libtorch {
    pub fn start(options: Options) -> Result<Libtorch, String> {
        let gpus = cuda_device_count();
        match cuda_host::cuda_support() {
            cuda_host::CudaSupport::Loaded => {
                tracing::info!(gpus, "libtorch CUDA support loaded")
            }
            cuda_host::CudaSupport::NoDriver => {
                tracing::info!(
                    "no NVIDIA driver (libcuda.so.1): libtorch's CUDA support not loaded"
                )
            }
            cuda_host::CudaSupport::Failed(why) => {
                tracing::error!("libtorch's CUDA support did not load: {why}")
            }
        }
        let host_gpus = host_gpus(gpus);
        let problem = (host_gpus > 0 && gpus == 0)
            .then(|| cuda_host::cuda_problem(cuda_host::runtime_version(), &driver::state()))
            .flatten();
        if let Some(why) = &problem {
            tracing::error!("CUDA cannot start; KIND_GPU models will fail to load: {why}");
        }
        if let Some(allow) = options.tf32 {
            cuda::set_allow_tf32(allow).map_err(|e| format!("--tf32: {e}"))?;
        }
        // Not where libtorch has GPUs: the fuser's effect on graphs that run there (and on
        // CPU instances beside them) has not been measured.
        let fusion = options.onednn_fusion && gpus == 0;
        cuda::set_onednn_fusion(fusion).map_err(|e| format!("--onednn-fusion: {e}"))?;
        tracing::info!(
            on = cuda::onednn_fusion(),
            "oneDNN Graph fusion of TorchScript on the CPU"
        );
        if gpus > 0 {
            let (cudnn, cublas) = cuda::allow_tf32();
            tracing::info!(
                gpus,
                "TF32: cuDNN convolutions {cudnn}, cuBLAS matmuls {cublas}"
            );
        }
        Ok(Libtorch {
            intra_op_threads: options.intra_op_threads,
            gpus,
            unusable_gpus: if problem.is_some() { host_gpus } else { 0 },
            problem,
            nvjpeg: jpeg_decoder(options.gpu_decode, gpus),
        })
    }

    /// GPUs libtorch can use.
    pub fn gpus(&self) -> usize {
        self.gpus
    }

    /// GPUs of the host that CUDA cannot start on: `KIND_GPU` instances are planned on
    /// them so that they fail with the reason rather than run on the CPU.
    pub fn unusable_gpus(&self) -> usize {
        self.unusable_gpus
    }
}

impl Backend for Libtorch {
    fn load(&self, spec: &EngineSpec, id: InstanceId) -> Result<Stages, EngineError> {
        if let (Some(why), Some(_)) = (&self.problem, id.gpu) {
            return Err(EngineError::Load {
                path: format!("instance {id}"),
                message: format!("CUDA cannot start on this host: {why}"),
            });
        }
        // Per thread: libtorch's intra-op pool size is a thread-local setting. GPU
        // instances too, so the little CPU work they do (the copy into the staging
        // buffer) never spreads over the cores decoding needs.
        tch::set_num_threads(self.intra_op_threads as i32);
        let mut stages = Stages::engine(TorchEngine::load(spec, id.gpu)?);
        // After the engine: the decoder takes the stream the engine made this thread's.
        if let (Some((library, memory)), Some(gpu)) = (self.nvjpeg, id.gpu) {
            stages.decoder = GpuJpeg::start(library, gpu as usize, memory)
                .map(|jpeg| Box::new(jpeg) as Box<dyn BatchDecoder>);
        }
        Ok(stages)
    }
}

/// nvJPEG for libtorch's GPU instances, with the device memory each may decode into; said
/// once at start: where JPEGs are decoded, and why not on the GPU.
fn jpeg_decoder(
    settings: Option<(Option<PathBuf>, u64)>,
    gpus: usize,
) -> Option<(&'static nvjpeg::Library, u64)> {
    let Some((library, memory)) = settings else {
        if gpus > 0 {
            tracing::info!("--gpu-decode=false: images are decoded on the CPU");
        }
        return None;
    };
    if gpus == 0 {
        tracing::info!("no GPU: images are decoded on the CPU");
        return None;
    }
    match nvjpeg::library(library.as_deref()) {
        Ok(library) => {
            tracing::info!(
                version = library.version(),
                "nvJPEG loaded: JPEGs are decoded on the GPU for classifiers that run there"
            );
            Some((library, memory))
        }
        Err(e) => {
            tracing::warn!(
                "nvJPEG did not load, images are decoded on the CPU: {e} (set --nvjpeg-library)"
            );
            None
        }
    }
}

/// The NVIDIA GPUs the driver sees (NVML), logged beside libtorch's view.
fn host_gpus(torch_gpus: usize) -> usize {
    Nvml::open().map_or(0, |nvml| {
        let (driver, cuda) = nvml.versions();
        let runtime = cuda_host::runtime_version().map_or("none".to_string(), version_text);
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
