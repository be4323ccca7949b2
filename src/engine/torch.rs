//! libtorch (tch): one TorchScript module on one device, inference only.
use std::path::Path;
use std::time::Instant;

use tch::{CModule, Device, Kind, Tensor};

use super::{BatchInput, ComputeTimings, Engine, EngineError, EngineOutput, OutputRequest};
use crate::domain::ClassScore;

/// Number of CUDA devices libtorch sees (0 without a GPU or without CUDA libraries).
pub fn cuda_device_count() -> usize {
    if tch::Cuda::is_available() {
        tch::Cuda::device_count().max(0) as usize
    } else {
        0
    }
}

pub struct TorchEngine {
    module: CModule,
    device: Device,
}

fn exec(e: tch::TchError) -> EngineError {
    EngineError::Execution(e.to_string())
}

impl TorchEngine {
    /// Loads the module onto `gpu` (CUDA ordinal) or the CPU, in eval mode. Call it on the
    /// thread that will run it.
    pub fn load(path: &Path, gpu: Option<u32>) -> Result<Self, EngineError> {
        let device = match gpu {
            Some(i) => Device::Cuda(i as usize),
            None => Device::Cpu,
        };
        let mut module = CModule::load_on_device(path, device).map_err(|e| EngineError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        module.set_eval();
        Ok(Self { module, device })
    }

    /// CUDA runs asynchronously: wait for the device so the timings split honestly.
    fn sync(&self) {
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
    }

    fn input_tensor(&self, input: BatchInput<'_>) -> Result<Tensor, tch::TchError> {
        let rows = input.rows() as i64;
        match input {
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
                let x = Tensor::f_from_data_size(data, &shape, Kind::Uint8)?
                    .f_to_device(self.device)?
                    .f_permute([0, 3, 1, 2])?
                    .f_to_kind(Kind::Float)?
                    .f_div_scalar(255.0)?;
                let mean = Tensor::f_from_slice(&normalize.mean)?
                    .f_view([1, 3, 1, 1])?
                    .f_to_device(self.device)?;
                let std = Tensor::f_from_slice(&normalize.std)?
                    .f_view([1, 3, 1, 1])?
                    .f_to_device(self.device)?;
                x.f_sub(&mean)?.f_div(&std)
            }
            BatchInput::Tensors {
                data,
                height,
                width,
            } => Tensor::f_from_slice(data)?
                .f_view([rows, 3, height as i64, width as i64])?
                .f_to_device(self.device)?
                // To channels-last strides (the model's layout), on the device.
                .f_permute([0, 2, 3, 1])?
                .f_contiguous()?
                .f_permute([0, 3, 1, 2]),
        }
    }

    fn run_inner(
        &mut self,
        input: BatchInput<'_>,
        want: OutputRequest,
    ) -> Result<EngineOutput, tch::TchError> {
        let _no_grad = tch::no_grad_guard();
        let rows = input.rows();
        let t0 = Instant::now();
        let x = self.input_tensor(input)?;
        self.sync();
        let t1 = Instant::now();
        let logits = self.module.forward_ts(&[x])?;
        self.sync();
        let t2 = Instant::now();
        let size = logits.size();
        if size.len() != 2 || size[0] != rows as i64 {
            return Err(tch::TchError::Shape(format!(
                "model returned shape {size:?} for {rows} rows; expected [{rows}, classes]"
            )));
        }
        let num_classes = size[1] as usize;
        let mut out = EngineOutput {
            num_classes,
            ..Default::default()
        };
        if want.top_k > 0 {
            let k = want.top_k.min(num_classes) as i64;
            let probs = logits.f_softmax(-1, Kind::Float)?;
            let (values, indices) = probs.f_topk(k, -1, true, true)?;
            let values = Vec::<f32>::try_from(&values.f_to_device(Device::Cpu)?.f_flatten(0, -1)?)?;
            let indices =
                Vec::<i64>::try_from(&indices.f_to_device(Device::Cpu)?.f_flatten(0, -1)?)?;
            out.top_k = values
                .chunks(k as usize)
                .zip(indices.chunks(k as usize))
                .map(|(v, i)| {
                    v.iter()
                        .zip(i)
                        .map(|(&score, &class)| ClassScore {
                            class_id: class as u32,
                            score,
                        })
                        .collect()
                })
                .collect();
        }
        if want.logits {
            let host = logits
                .f_to_device(Device::Cpu)?
                .f_to_kind(Kind::Float)?
                .f_flatten(0, -1)?;
            out.logits = Some(Vec::<f32>::try_from(&host)?);
        }
        out.timings = ComputeTimings {
            input: t1 - t0,
            infer: t2 - t1,
            output: t2.elapsed(),
        };
        Ok(out)
    }
}

impl Engine for TorchEngine {
    fn run(
        &mut self,
        input: BatchInput<'_>,
        want: OutputRequest,
    ) -> Result<EngineOutput, EngineError> {
        self.run_inner(input, want).map_err(exec)
    }

    fn device_name(&self) -> String {
        match self.device {
            Device::Cuda(i) => format!("cuda:{i}"),
            _ => "cpu".to_string(),
        }
    }
}
