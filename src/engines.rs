//! Which engines run the classifiers: the runtimes this build has, started from the
//! server's settings into the registry (`engine::registry`) whose factory every instance
//! thread calls, or the deterministic fake of the tests. A new runtime is a module of
//! `engine/` under its own Cargo feature, started here.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::config;
use crate::domain::Precision;
use crate::engine::registry::Registry;
use crate::engine::FakeFaults;
use crate::scheduler::EngineFactory;

/// How the engines run.
#[derive(clap::Args, Debug, Clone)]
pub struct EngineFlags {
    /// Intra-op threads per model instance (libtorch's, ONNX Runtime's where a model's
    /// config sets no intra_op_thread_count, OpenVINO's where it sets no
    /// INFERENCE_NUM_THREADS). 1 is best when there are as many CPU
    /// instances as cores: more threads per instance spin-wait against each other. GPU
    /// instances keep to it too, leaving the cores to decoding.
    #[arg(long, env = "VISIONGATE_INTRA_OP_THREADS", default_value_t = 1)]
    pub intra_op_threads: usize,

    /// The ONNX Runtime shared library ONNX models run on (PyPI's onnxruntime wheel has it
    /// as onnxruntime/capi/libonnxruntime.so.VERSION; `make setup` installs it and
    /// scripts/env.sh points here). Opened when the first ONNX model loads. Unset: the
    /// one the set-up installed when this binary was built, if it is still there, else
    /// the dynamic linker's search for libonnxruntime.so.
    #[arg(long, env = "VISIONGATE_ONNXRUNTIME_LIBRARY")]
    pub onnxruntime_library: Option<PathBuf>,

    /// OpenVINO's C API library, which models of backend "openvino" run on (PyPI's openvino
    /// wheel has it as openvino/libs/libopenvino_c.so.2641, its CPU plugin beside it; `make
    /// setup` installs it and scripts/env.sh points here). Opened when the first OpenVINO
    /// model loads. Unset: the one the set-up installed when this binary was built, if it
    /// is still there, else the dynamic linker's search for libopenvino_c.so.2641.
    #[arg(long, env = "VISIONGATE_OPENVINO_LIBRARY")]
    pub openvino_library: Option<PathBuf>,

    /// TF32 on NVIDIA GPUs that have it (Ampere and later): FP32 convolutions and matmuls
    /// with a 10-bit mantissa, several times faster. `default` keeps libtorch's choice (on
    /// for cuDNN convolutions, off for cuBLAS matmuls); `on` and `off` set both. No effect
    /// on the CPU.
    #[arg(long, env = "VISIONGATE_TF32", value_enum, default_value = "default")]
    pub tf32: Tf32,

    /// oneDNN Graph's fuser for TorchScript models on the CPU (PyTorch's
    /// `torch.jit.enable_onednn_fusion`): convolutions fused with their activations and
    /// additions, each batch shape compiled once and kept (memory per shape). On
    /// EfficientNet-Lite0 with one thread per instance its forward pass took a quarter less
    /// time in FP32 and half in bf16 (docs/performance.md). Off where libtorch has GPUs (not
    /// yet measured there).
    #[arg(long, env = "VISIONGATE_ONEDNN_FUSION", default_value_t = true, action = clap::ArgAction::Set)]
    pub onednn_fusion: bool,

    /// Every TorchScript classifier's precision, instead of its config's `precision`
    /// parameter: `fp32`, `bf16` (autocast: convolutions and matmuls in bfloat16; CPUs with
    /// AVX-512 BF16 or AMX, and GPUs) or `fp16` (GPUs only). A model whose device cannot run
    /// it fails its load saying so. ONNX models keep fp32 (logged).
    #[arg(long, env = "VISIONGATE_PRECISION", value_parser = config::precision)]
    pub precision: Option<Precision>,

    /// Decode JPEGs on the GPU (nvJPEG: the hardware decoder where the GPU has one, its
    /// CUDA decoder elsewhere) for image ensembles whose classifier runs there; progressive,
    /// CMYK, 4:1:1, 12-bit and damaged JPEGs, JPEGs the CPU path decodes at a DCT scale and
    /// other formats stay on the CPU. Off by default: on an H200 with 16 cores it was not
    /// faster than the CPU's decode threads (docs/performance.md). No effect without a GPU.
    #[arg(long, env = "VISIONGATE_GPU_DECODE", default_value_t = false, action = clap::ArgAction::Set)]
    pub gpu_decode: bool,

    /// nvJPEG's shared library (PyPI's nvidia-nvjpeg wheel has it as
    /// nvidia/cu13/lib/libnvjpeg.so.13; `make setup` installs it and scripts/env.sh points
    /// here). Opened at start where an instance runs on a GPU. Unset: the one the set-up
    /// installed when this binary was built, if it is still there, else the dynamic
    /// linker's search for libnvjpeg.so.13.
    #[arg(long, env = "VISIONGATE_NVJPEG_LIBRARY")]
    pub nvjpeg_library: Option<PathBuf>,

    /// Device memory each GPU instance's JPEG decode may hold at once: a group's decoded
    /// planes (3 bytes a pixel at the decoded size) and its resized rows (3 bytes a pixel
    /// at the model's size), and one image's float copy while it is resized (12 bytes a
    /// pixel). A batch's JPEGs are decoded in groups that fit; an image
    /// that alone needs more is decoded on the CPU.
    #[arg(long, env = "VISIONGATE_GPU_DECODE_MEMORY_BYTES", default_value_t = 1 << 30,
          value_parser = clap::value_parser!(u64).range(1 << 20..))]
    pub gpu_decode_memory_bytes: u64,
}

impl EngineFlags {
    pub fn settings(&self) -> Result<EngineSettings, String> {
        if self.intra_op_threads == 0 {
            return Err("--intra-op-threads must be at least 1".into());
        }
        Ok(EngineSettings {
            intra_op_threads: self.intra_op_threads,
            tf32: self.tf32,
            onednn_fusion: self.onednn_fusion,
            onnxruntime_library: setup_library(
                &self.onnxruntime_library,
                env!("VISIONGATE_SETUP_ONNXRUNTIME_LIBRARY"),
            ),
            openvino_library: setup_library(
                &self.openvino_library,
                env!("VISIONGATE_SETUP_OPENVINO_LIBRARY"),
            ),
            gpu_decode: self.gpu_decode.then(|| GpuDecode {
                library: setup_library(
                    &self.nvjpeg_library,
                    env!("VISIONGATE_SETUP_NVJPEG_LIBRARY"),
                ),
                memory_bytes: self.gpu_decode_memory_bytes,
            }),
        })
    }
}

/// A runtime library: the one its flag names, else the one the set-up installed when this
/// binary was built (`installed`, recorded by build.rs) if it is still there, else `None`:
/// the dynamic linker's search.
fn setup_library(flag: &Option<PathBuf>, installed: &str) -> Option<PathBuf> {
    flag.clone().or_else(|| {
        let installed = PathBuf::from(installed);
        installed.is_file().then_some(installed)
    })
}

/// `--tf32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Tf32 {
    Default,
    On,
    Off,
}

/// How the engines run.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// Intra-op threads per instance (libtorch's; ONNX Runtime's unless a config sets them).
    pub intra_op_threads: usize,
    pub tf32: Tf32,
    /// oneDNN Graph's fuser for TorchScript on the CPU.
    pub onednn_fusion: bool,
    /// The ONNX Runtime library (`None`: the dynamic linker's search).
    pub onnxruntime_library: Option<PathBuf>,
    /// OpenVINO's C API library (`None`: the dynamic linker's search).
    pub openvino_library: Option<PathBuf>,
    /// JPEG decode on GPU instances (`None`: turned off).
    pub gpu_decode: Option<GpuDecode>,
}

/// JPEG decode on the GPU.
#[derive(Debug, Clone)]
pub struct GpuDecode {
    /// nvJPEG (`None`: the dynamic linker's search).
    pub library: Option<PathBuf>,
    /// Device memory each instance's decoded images may hold at once.
    pub memory_bytes: u64,
}

/// Which engines run the classifiers.
#[derive(Clone)]
pub enum EngineChoice {
    /// The runtime each model's platform names, of those this build has: libtorch for
    /// TorchScript and torch.export packages, ONNX Runtime for ONNX, OpenVINO for backend
    /// "openvino".
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
                factory: Arc::new(move |spec, _| faults.stages(&spec.file, num_classes, latency)),
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
    add_openvino(&mut registry, &settings);
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
    use crate::engine::libtorch::{Libtorch, Options};
    let libtorch = Libtorch::start(Options {
        intra_op_threads: settings.intra_op_threads,
        tf32: match settings.tf32 {
            Tf32::Default => None,
            Tf32::On => Some(true),
            Tf32::Off => Some(false),
        },
        onednn_fusion: settings.onednn_fusion,
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

#[cfg(feature = "openvino")]
fn add_openvino(registry: &mut Registry, settings: &EngineSettings) {
    registry.add(
        crate::engine::registry::RuntimeKind::OpenVino,
        crate::engine::OpenVino {
            library: settings.openvino_library.clone(),
            threads: settings.intra_op_threads,
        },
    );
}

#[cfg(not(feature = "openvino"))]
fn add_openvino(_: &mut Registry, _: &EngineSettings) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_is_the_flags_else_the_setups_while_it_is_there() {
        let dir = std::env::temp_dir().join(format!("vg-setup-library-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let installed = dir.join("libruntime.so.1");
        let flag = Some(PathBuf::from("/opt/lib/libruntime.so"));
        let installed_text = installed.to_str().unwrap();
        // Not there (moved, or another machine): the dynamic linker's search.
        assert_eq!(setup_library(&None, installed_text), None);
        assert_eq!(setup_library(&None, ""), None);
        std::fs::write(&installed, b"").unwrap();
        assert_eq!(
            setup_library(&None, installed_text),
            Some(installed.clone())
        );
        assert_eq!(setup_library(&flag, installed_text), flag);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
