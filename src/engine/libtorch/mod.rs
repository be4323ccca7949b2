//! libtorch (tch): one TorchScript module, or one torch.export package, on one device,
//! inference only.
use std::time::Instant;

use tch::{CModule, Device, Kind, Tensor};

mod aoti;
mod backend;
pub mod cuda;
pub mod cuda_host;
mod jpeg;
mod package;

use super::{
    cpu_runs_bf16, normalize_into, BatchInput, ComputeTimings, Engine, EngineError, EngineOutput,
    EngineSpec, FileErrors, Layout, OutputRequest,
};
use crate::domain::{ClassScore, Normalize, Precision, Runtime};
use aoti::Package;
pub use backend::{Libtorch, Options};

/// Number of CUDA devices libtorch sees (0 without a GPU or without CUDA libraries).
/// libtorch's CUDA half is loaded first, where the host has the driver.
pub fn cuda_device_count() -> usize {
    cuda_host::cuda_support();
    if tch::Cuda::is_available() {
        tch::Cuda::device_count().max(0) as usize
    } else {
        0
    }
}

/// What runs the forward pass.
enum Module {
    /// TorchScript, fed channels-last input (its export's layout).
    Script(CModule),
    /// A torch.export package: compiled for contiguous NCHW input, at any batch size of its
    /// range without a compile per shape.
    Package(Package),
}

pub struct TorchEngine {
    module: Module,
    device: Device,
    /// On a GPU, the host buffer a batch's u8 images are copied into, page-locked, so the
    /// copy to the device is a non-blocking DMA on this instance's stream (a CPU instance
    /// normalizes its images on the host instead). Grows to the largest batch seen, then
    /// is reused.
    staging: Option<Tensor>,
    /// The normalization's mean and std as `[1, 3, 1, 1]` tensors on the device, made
    /// once per instance (and again only if a batch asks for different values).
    normalize: Option<(Normalize, Tensor, Tensor)>,
    /// On a GPU: events around input, forward and output on this instance's stream.
    events: Option<[cuda::Event; 4]>,
    /// On a GPU, the batch sizes the module has run. A batch of another size is padded
    /// to the next of these: on a GPU the TorchScript executor compiles fused kernels for
    /// each new input shape, which took 3 to 5 s on an H100, stalling every request in
    /// that batch; padding rows costs little there (a batch of 64 takes about as long as
    /// one of 16). CPU batches run at their own size (no such compile; rows cost time).
    sizes_run: std::collections::BTreeSet<usize>,
    /// The reduced precision the forward runs in under autocast (`None`: FP32).
    autocast: Option<Kind>,
    /// Its intra-op threads (libtorch's setting for the thread that loaded it).
    threads: usize,
}

/// The autocast dtype of `precision` on `device`, or why the device cannot run it
/// natively (emulated, a reduced precision is slower than FP32: refused, not run).
fn autocast_kind(precision: Precision, device: Device) -> Result<Option<Kind>, String> {
    let set = "set the config's precision parameter, or --precision";
    match (precision, device) {
        (Precision::Fp32, _) => Ok(None),
        (Precision::Fp16, Device::Cuda(_)) => Ok(Some(Kind::Half)),
        (Precision::Bf16, Device::Cuda(i)) => match cuda_host::compute_capability(i) {
            Some((major, minor)) if major < 8 => Err(format!(
                "precision bf16 needs a GPU of compute capability 8.0 (Ampere) or newer; GPU \
                 {i} is {major}.{minor}: use fp16 or fp32 ({set})"
            )),
            _ => Ok(Some(Kind::BFloat16)),
        },
        (Precision::Bf16, _) if cpu_runs_bf16() => Ok(Some(Kind::BFloat16)),
        (Precision::Bf16, _) => Err(format!(
            "precision bf16 on the CPU needs AVX-512 BF16 or AMX, which this CPU lacks: use \
             fp32 ({set}, e.g. --precision=fp32)"
        )),
        (Precision::Fp16, _) => Err(format!(
            "precision fp16 runs on GPUs only, and this instance runs on the CPU (a KIND_GPU \
             group without a usable GPU falls back to it): use bf16 (CPUs with AVX-512 BF16 \
             or AMX) or fp32 ({set})"
        )),
    }
}

fn exec(e: tch::TchError) -> EngineError {
    EngineError::Execution(e.to_string())
}

impl TorchEngine {
    /// Loads `spec`'s TorchScript module (in eval mode, to run in its precision) or
    /// torch.export package (FP32) onto `gpu` (CUDA ordinal) or the CPU. Call it on the
    /// thread that will run it: on a GPU that thread gets a stream of its own first.
    pub fn load(spec: &EngineSpec, gpu: Option<u32>) -> Result<Self, EngineError> {
        let errors = FileErrors::new(&spec.file);
        let load_error = |message: String| errors.error(message);
        let device = gpu.map_or(Device::Cpu, |i| Device::Cuda(i as usize));
        let autocast = match spec.runtime {
            Runtime::TorchAoti if spec.precision != Precision::Fp32 => {
                return Err(load_error(format!(
                    "precision {} is not offered for torch.export packages: they run as \
                     compiled, in fp32 (set the config's precision parameter, or --precision, \
                     to fp32)",
                    spec.precision
                )))
            }
            _ => autocast_kind(spec.precision, device).map_err(&load_error)?,
        };
        let (device, events) = match gpu {
            Some(i) => {
                cuda::use_pool_stream(i as usize).map_err(load_error)?;
                let event = || cuda::Event::new().map_err(load_error);
                let events = [event()?, event()?, event()?, event()?];
                (Device::Cuda(i as usize), Some(events))
            }
            None => (Device::Cpu, None),
        };
        let module = match spec.runtime {
            Runtime::TorchAoti => Module::Package(Package::load(spec, gpu, &errors)?),
            _ => {
                let mut module = CModule::load_on_device(&spec.file, device)
                    .map_err(|e| load_error(e.to_string()))?;
                module.set_eval();
                Module::Script(module)
            }
        };
        if let Some(kind) = autocast {
            tracing::info!(model = errors.shown(), precision = %spec.precision, ?device, autocast = ?kind, "reduced precision");
        }
        Ok(Self {
            module,
            device,
            staging: None,
            normalize: None,
            events,
            sizes_run: Default::default(),
            autocast,
            threads: tch::get_num_threads().max(1) as usize,
        })
    }

    /// The rows a batch of `rows` runs as (see `sizes_run`): the smallest size run before
    /// that holds them, if it is at most twice as many; else `rows` (whose kernels are
    /// then compiled once, and the size is known from then on).
    fn padded(&self, rows: usize) -> usize {
        match (self.device, &self.module) {
            (Device::Cuda(_), Module::Script(_)) => self
                .sizes_run
                .range(rows..)
                .next()
                .copied()
                .filter(|&size| size <= rows.saturating_mul(2))
                .unwrap_or(rows),
            _ => rows,
        }
    }

    /// Marks the point `i` (0: start, 1: input ready, 2: forward done, 3: output on the
    /// host) on this instance's stream; a no-op on the CPU.
    fn mark(&mut self, i: usize) -> Result<(), tch::TchError> {
        if let (Some(events), Device::Cuda(index)) = (self.events.as_mut(), self.device) {
            events[i].record(index).map_err(tch::TchError::Torch)?;
        }
        Ok(())
    }

    /// Where the batch's time went: CUDA events on a GPU (waiting for this instance's
    /// stream only), wall-clock instants on the CPU.
    fn timings(&self, instants: [Instant; 4]) -> Result<ComputeTimings, tch::TchError> {
        let Some(e) = &self.events else {
            return Ok(ComputeTimings {
                input: instants[1] - instants[0],
                infer: instants[2] - instants[1],
                output: instants[3] - instants[2],
            });
        };
        let torch = tch::TchError::Torch;
        e[3].synchronize().map_err(torch)?;
        Ok(ComputeTimings {
            input: e[0].elapsed(&e[1]).map_err(torch)?,
            infer: e[1].elapsed(&e[2]).map_err(torch)?,
            output: e[2].elapsed(&e[3]).map_err(torch)?,
        })
    }

    /// After a failed batch on a GPU: waits for what it queued on this instance's stream
    /// (the copy out of the staging buffer among it) before the next batch refills the
    /// buffer. Errors here are the failed batch's own and already reported.
    fn drain(&mut self) {
        if let (Some(events), Device::Cuda(index)) = (self.events.as_mut(), self.device) {
            if events[3].record(index).is_ok() {
                let _ = events[3].synchronize();
            }
        }
    }

    /// `data` at the start of the staging buffer, as a `[len]` u8 tensor on the host
    /// (`len` >= `data.len()`: what follows `data` are pixels of no one, for padding).
    fn stage(&mut self, data: &[u8], len: usize) -> Result<Tensor, tch::TchError> {
        let len = len.max(data.len()) as i64;
        let big_enough = self
            .staging
            .as_ref()
            .is_some_and(|s| s.size1().ok() >= Some(len));
        if !big_enough {
            let buffer = Tensor::f_zeros([len], (Kind::Uint8, Device::Cpu))?;
            self.staging = Some(match self.device {
                Device::Cuda(_) => buffer.f_pin_memory(self.device)?,
                _ => buffer,
            });
        }
        let staging = self.staging.as_ref().expect("staging allocated just above");
        // SAFETY: `staging` is a contiguous u8 tensor of at least `len` bytes that this
        // engine owns; no copy out of it is in flight (the previous batch's copy to the
        // device finished before its outputs reached the host, or `drain` waited for it).
        unsafe {
            let at = staging.data_ptr() as *mut u8;
            std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len());
            // Padding rows hold no one's pixels from an earlier batch.
            std::ptr::write_bytes(at.add(data.len()), 0, len as usize - data.len());
        }
        staging.f_narrow(0, 0, len)
    }

    /// The normalization's mean and std on the device, made once.
    fn normalize(&mut self, want: Normalize) -> Result<(&Tensor, &Tensor), tch::TchError> {
        if self.normalize.as_ref().map(|n| n.0) != Some(want) {
            let on_device = |v: &[f32; 3]| -> Result<Tensor, tch::TchError> {
                Tensor::f_from_slice(v)?
                    .f_view([1, 3, 1, 1])?
                    .f_to_device(self.device)
            };
            self.normalize = Some((want, on_device(&want.mean)?, on_device(&want.std)?));
        }
        let (_, mean, std) = self.normalize.as_ref().expect("normalize set just above");
        Ok((mean, std))
    }

    /// The batch as the model's input, `rows` rows (`input`'s, then padding).
    fn input_tensor(
        &mut self,
        input: BatchInput<'_>,
        rows: usize,
    ) -> Result<Tensor, tch::TchError> {
        let pad = (rows - input.rows()) as i64;
        let rows = rows as i64;
        let cuda = self.device.is_cuda();
        match input {
            BatchInput::Images {
                data,
                height,
                width,
                normalize,
            } if self.device == Device::Cpu => {
                // Normalized on the host straight into the input tensor, one pass of
                // table lookups: libtorch's four elementwise operations took about 0.5 ms
                // per 224x224 row here. Batches run at their own size on the CPU (no
                // padding rows). The bundled TorchScript model is laid out channels-last;
                // a package's compiled model takes NCHW, contiguous.
                if rows as usize * height * width * 3 != data.len() {
                    return Err(tch::TchError::Shape(format!(
                        "{} bytes are not {rows} rows of {height}x{width} RGB",
                        data.len()
                    )));
                }
                let (h, w) = (height as i64, width as i64);
                let (layout, shape) = match self.module {
                    Module::Script(_) => (Layout::Nhwc, [rows, h, w, 3]),
                    Module::Package(_) => (Layout::Nchw, [rows, 3, h, w]),
                };
                let x = Tensor::f_empty(shape, (Kind::Float, Device::Cpu))?;
                // SAFETY: `x` is a new contiguous f32 tensor of `data.len()` values (checked
                // just above), which nothing else refers to while this slice lives.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(x.data_ptr() as *mut f32, data.len()) };
                normalize_into(data, height, width, normalize, layout, out);
                match layout {
                    Layout::Nhwc => x.f_permute([0, 3, 1, 2]),
                    Layout::Nchw => Ok(x),
                }
            }
            BatchInput::Images {
                data,
                height,
                width,
                normalize,
            } => {
                // u8 travels to the device (4x fewer bytes than f32), then NHWC -> NCHW,
                // to f32 and (x / 255 - mean) / std there, in the order torchvision does it.
                // The permuted view keeps the NHWC layout ("channels-last" strides), which
                // the exported model is laid out for; no copy back to NCHW.
                let shape = [rows, height as i64, width as i64, 3];
                let x = self
                    .stage(data, rows as usize * height * width * 3)?
                    .f_view(shape)?
                    .f_to_device_(self.device, Kind::Uint8, cuda, false)?;
                let (mean, std) = self.normalize(normalize)?;
                normalized(&x, mean, std)
            }
            BatchInput::Tensors {
                data,
                height,
                width,
            } => {
                let shape = |n: i64| [n, 3, height as i64, width as i64];
                let x = Tensor::f_from_slice(data)?.f_view(shape(rows - pad))?;
                let x = if pad > 0 {
                    Tensor::f_cat(
                        &[x, Tensor::f_zeros(shape(pad), (Kind::Float, Device::Cpu))?],
                        0,
                    )?
                } else {
                    x
                };
                let x = x.f_to_device(self.device)?;
                match self.module {
                    // To channels-last strides (the module's layout), on the device.
                    Module::Script(_) => x
                        .f_permute([0, 2, 3, 1])?
                        .f_contiguous()?
                        .f_permute([0, 3, 1, 2]),
                    Module::Package(_) => Ok(x),
                }
            }
        }
    }

    fn run_inner(
        &mut self,
        input: BatchInput<'_>,
        want: OutputRequest,
    ) -> Result<EngineOutput, tch::TchError> {
        let _no_grad = tch::no_grad_guard();
        let rows = input.rows();
        let padded = self.padded(rows);
        let t0 = Instant::now();
        self.mark(0)?;
        let x = self.input_tensor(input, padded)?;
        self.mark(1)?;
        let t1 = Instant::now();
        let logits = match (&self.module, self.autocast) {
            // The layout it was compiled for: NCHW, contiguous.
            (Module::Package(package), _) => package.run(&x.f_contiguous()?)?,
            (Module::Script(module), None) => module.forward_ts(&[x])?,
            (Module::Script(module), Some(kind)) => {
                let _autocast = cuda::Autocast::new(self.device.is_cuda(), kind)
                    .map_err(tch::TchError::Torch)?;
                // Outputs in FP32 from here on: ranking, softmax and the logits returned.
                module.forward_ts(&[x])?.f_to_kind(Kind::Float)?
            }
        };
        self.mark(2)?;
        let t2 = Instant::now();
        let size = logits.size();
        if size.len() != 2 || size[0] != padded as i64 {
            return Err(tch::TchError::Shape(format!(
                "model returned shape {size:?} for {padded} rows; expected [{padded}, classes]"
            )));
        }
        if self.device.is_cuda() && matches!(self.module, Module::Script(_)) {
            self.sizes_run.insert(padded);
        }
        let logits = if padded > rows {
            logits.f_narrow(0, 0, rows as i64)?
        } else {
            logits
        };
        let num_classes = size[1] as usize;
        let mut out = EngineOutput {
            num_classes,
            ..Default::default()
        };
        // Ranked on the logits (the order softmax keeps); each class's probability is
        // gathered from the softmax beside its logit.
        let k = want.top_k.get().min(num_classes) as i64;
        let (values, indices) = logits.f_topk(k, -1, true, true)?;
        let probs = logits
            .f_softmax(-1, Kind::Float)?
            .f_gather(-1, &indices, false)?;
        let host = |t: &Tensor| -> Result<Tensor, tch::TchError> {
            t.f_to_device(Device::Cpu)?.f_flatten(0, -1)
        };
        let values = Vec::<f32>::try_from(&host(&values)?.f_to_kind(Kind::Float)?)?;
        let probs = Vec::<f32>::try_from(&host(&probs)?)?;
        let indices = Vec::<i64>::try_from(&host(&indices)?)?;
        let k = k as usize;
        out.top_k = (0..rows)
            .map(|r| {
                (r * k..(r + 1) * k)
                    .map(|i| ClassScore {
                        class_id: indices[i] as u32,
                        score: probs[i],
                        value: values[i],
                    })
                    .collect()
            })
            .collect();
        if want.logits {
            let host = logits
                .f_to_device(Device::Cpu)?
                .f_to_kind(Kind::Float)?
                .f_flatten(0, -1)?;
            out.logits = Some(Vec::<f32>::try_from(&host)?);
        }
        self.mark(3)?;
        out.timings = self.timings([t0, t1, t2, Instant::now()])?;
        Ok(out)
    }
}

/// u8 NHWC images to f32 NCHW `(x / 255 - mean) / std`, in the order torchvision does it,
/// on the device `x` is on (`mean`, `std`: `[1, 3, 1, 1]` there): the same values as
/// `engine::normalize_into` on the host (a test holds them equal).
fn normalized(x: &Tensor, mean: &Tensor, std: &Tensor) -> Result<Tensor, tch::TchError> {
    x.f_permute([0, 3, 1, 2])?
        .f_to_kind(Kind::Float)?
        .f_div_scalar(255.0)?
        .f_sub(mean)?
        .f_div(std)
}

impl Engine for TorchEngine {
    fn run(
        &mut self,
        input: BatchInput<'_>,
        want: OutputRequest,
    ) -> Result<EngineOutput, EngineError> {
        let result = self.run_inner(input, want);
        if result.is_err() {
            self.drain();
        }
        result.map_err(exec)
    }

    fn device(&self) -> super::Device {
        match self.device {
            Device::Cuda(i) => super::Device::Cuda(i),
            _ => super::Device::Cpu,
        }
    }

    fn threads(&self) -> usize {
        self.threads
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_normalizes_every_value_as_the_host_does() {
        // Every u8 value in each channel, with the bundled preprocessor's constants.
        let data: Vec<u8> = (0..=255u8).flat_map(|v| [v, 255 - v, v / 2]).collect();
        let n = Normalize {
            mean: [0.485, 0.456, 0.406],
            std: [0.229, 0.224, 0.225],
        };
        let x = Tensor::from_slice(&data).view([1, 1, 256, 3]);
        let channel = |v: &[f32; 3]| Tensor::from_slice(v).view([1, 3, 1, 1]);
        let torch = normalized(&x, &channel(&n.mean), &channel(&n.std)).unwrap();
        let torch = Vec::<f32>::try_from(&torch.contiguous().flatten(0, -1)).unwrap();
        assert_eq!(torch, super::super::normalize_on_cpu(&data, 1, 256, n));
    }
}
