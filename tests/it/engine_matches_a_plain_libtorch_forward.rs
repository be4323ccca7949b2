//! The engine's input path (on the CPU, images normalized on the host into a channels-last
//! tensor; on a GPU, a staging buffer reused across batches, page-locked, and the
//! normalization's mean and std made once per instance) changes no result: on the CPU
//! every logit and top-k score is bit-identical to a plain libtorch forward pass of the
//! same rows, normalized by libtorch, for batches that grow, shrink and repeat. A bf16 engine runs reduced
//! precision for real (close to FP32, not equal) and leaves FP32 engines on the same
//! thread bit-identical.
use std::path::PathBuf;

use tch::{CModule, Device, Kind, Tensor};
use visiongate::domain::{Normalize, Precision, Runtime};
use visiongate::engine::{
    cpu_runs_bf16, BatchInput, Engine, EngineSpec, OutputRequest, TorchEngine,
};

const SIDE: usize = 224;
const ROW: usize = SIDE * SIDE * 3;
const NORMALIZE: Normalize = Normalize {
    mean: [0.498, 0.498, 0.498],
    std: [0.502, 0.502, 0.502],
};

fn model_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/classifier/1/model.pt")
}

/// The bundled classifier's TorchScript file, in `precision`.
fn spec(precision: Precision) -> EngineSpec {
    let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models");
    EngineSpec::bundled(&models, Runtime::TorchScript, precision)
}

/// Deterministic pixels that differ per batch (a small LCG; no two batches alike).
fn rows(n: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n * ROW)
        .map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 24) as u8
        })
        .collect()
}

/// The computation as written before the engine kept anything between batches.
fn reference_logits(module: &CModule, data: &[u8], n: usize) -> Vec<f32> {
    let _no_grad = tch::no_grad_guard();
    let x = Tensor::from_data_size(data, &[n as i64, SIDE as i64, SIDE as i64, 3], Kind::Uint8)
        .permute([0, 3, 1, 2])
        .to_kind(Kind::Float)
        .f_div_scalar(255.0)
        .unwrap();
    let mean = Tensor::from_slice(&NORMALIZE.mean).view([1, 3, 1, 1]);
    let std = Tensor::from_slice(&NORMALIZE.std).view([1, 3, 1, 1]);
    let logits = module.forward_ts(&[(x - mean) / std]).unwrap();
    Vec::<f32>::try_from(&logits.flatten(0, -1)).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn staged_and_cached_inputs_give_bit_identical_logits_and_top_k() {
    tch::set_num_threads(1);
    let module = CModule::load_on_device(model_file(), Device::Cpu).unwrap();
    let mut engine = TorchEngine::load(&spec(Precision::Fp32), None).unwrap();
    let want = OutputRequest {
        logits: true,
        ..OutputRequest::classes(5)
    };
    // Grows (1 -> 4), shrinks (2: stale bytes stay in the buffer), repeats, grows again.
    for (n, seed) in [(1, 1), (4, 2), (2, 3), (2, 3), (5, 4)] {
        let data = rows(n, seed);
        let out = engine
            .run(
                BatchInput::Images {
                    data: &data,
                    height: SIDE,
                    width: SIDE,
                    normalize: NORMALIZE,
                },
                want,
            )
            .unwrap();
        let expected = reference_logits(&module, &data, n);
        let got = out.logits.expect("logits were asked for");
        assert_eq!(bits(&got), bits(&expected), "batch of {n} (seed {seed})");
        // Top-k from the same logits: softmax of each row, best first.
        let probs = Tensor::from_slice(&expected)
            .view([n as i64, -1])
            .softmax(-1, Kind::Float);
        let (values, indices) = probs.topk(5, -1, true, true);
        let values = Vec::<f32>::try_from(&values.flatten(0, -1)).unwrap();
        let indices = Vec::<i64>::try_from(&indices.flatten(0, -1)).unwrap();
        let top: Vec<(u32, u32)> = out
            .top_k
            .iter()
            .flatten()
            .map(|c| (c.class_id, c.score.to_bits()))
            .collect();
        let expected_top: Vec<(u32, u32)> = indices
            .iter()
            .zip(&values)
            .map(|(&i, v)| (i as u32, v.to_bits()))
            .collect();
        assert_eq!(top, expected_top, "top-k of a batch of {n}");
    }
}

#[test]
fn fp32_tensor_input_matches_a_plain_forward_pass() {
    tch::set_num_threads(1);
    let module = CModule::load_on_device(model_file(), Device::Cpu).unwrap();
    let mut engine = TorchEngine::load(&spec(Precision::Fp32), None).unwrap();
    let data: Vec<f32> = rows(3, 9).iter().map(|&b| b as f32 / 127.5 - 1.0).collect();
    let out = engine
        .run(
            BatchInput::Tensors {
                data: &data,
                height: SIDE,
                width: SIDE,
            },
            OutputRequest {
                logits: true,
                ..OutputRequest::default()
            },
        )
        .unwrap();
    let _no_grad = tch::no_grad_guard();
    let x = Tensor::from_slice(&data)
        .view([3, 3, SIDE as i64, SIDE as i64])
        .permute([0, 2, 3, 1])
        .contiguous()
        .permute([0, 3, 1, 2]);
    let expected = module.forward_ts(&[x]).unwrap();
    let expected = Vec::<f32>::try_from(&expected.flatten(0, -1)).unwrap();
    assert_eq!(bits(&out.logits.unwrap()), bits(&expected));
}

fn image_logits(engine: &mut TorchEngine, data: &[u8]) -> Vec<f32> {
    let out = engine
        .run(
            BatchInput::Images {
                data,
                height: SIDE,
                width: SIDE,
                normalize: NORMALIZE,
            },
            OutputRequest {
                logits: true,
                ..OutputRequest::default()
            },
        )
        .unwrap();
    out.logits.unwrap()
}

#[test]
fn bf16_runs_in_reduced_precision_and_leaves_fp32_exact() {
    tch::set_num_threads(1);
    let loaded = TorchEngine::load(&spec(Precision::Bf16), None);
    if !cpu_runs_bf16() {
        let e = loaded
            .err()
            .expect("bf16 refused without AVX-512 BF16 or AMX");
        assert!(e.to_string().contains("--precision=fp32"), "{e}");
        crate::common::not_run(
            "bf16 against FP32 needs a CPU with AVX-512 BF16 or AMX (the refusal was checked)",
        );
        return;
    }
    let mut bf16 = loaded.unwrap();
    let mut fp32 = TorchEngine::load(&spec(Precision::Fp32), None).unwrap();
    let module = CModule::load_on_device(model_file(), Device::Cpu).unwrap();
    let data = rows(4, 11);
    let reduced = image_logits(&mut bf16, &data);
    let exact = image_logits(&mut fp32, &data);
    assert_eq!(bits(&exact), bits(&reference_logits(&module, &data, 4)));
    let diff = reduced
        .iter()
        .zip(&exact)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    // bfloat16 keeps 8 bits of mantissa: the logits move, but not far.
    assert!(
        diff > 0.0,
        "bf16 gave FP32's exact logits: autocast did not run"
    );
    assert!(diff < 1.0, "bf16 logits differ from FP32 by {diff}");
    // Autocast ends with the forward: FP32 after bf16 on this thread is still exact.
    assert_eq!(bits(&image_logits(&mut fp32, &data)), bits(&exact));
    assert_eq!(
        bits(&image_logits(&mut bf16, &data)),
        bits(&reduced),
        "bf16 is deterministic too"
    );
}

#[test]
fn fp16_is_refused_on_the_cpu() {
    let e = TorchEngine::load(&spec(Precision::Fp16), None)
        .err()
        .expect("fp16 on the CPU is refused");
    assert!(e.to_string().contains("GPUs only"), "{e}");
}
