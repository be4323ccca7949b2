//! An instance's warm-up before it serves: the first runs its executor specializes on, the
//! batch size it asks the batcher for (pinned by the config, or timed on its own device),
//! and the config's `model_warmup` samples.
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::instance::InstanceContext;
use crate::domain::{Normalize, WarmupData, WarmupSample};
use crate::engine::{BatchInput, Device, Engine, OutputRequest};

/// Makes a new engine ready to serve: its first runs, its batch size, the config's
/// samples; then what the batch-size candidates left allocated but free is given back,
/// before the next instance warms up beside it.
pub(super) fn prepare(
    engine: &mut dyn Engine,
    ctx: &InstanceContext,
    choice: &BatchSizeChoice,
    tuned: &Tuned,
    samples: &[WarmupSample],
) -> Result<usize, String> {
    let target = warm_up(engine, ctx, choice, tuned)?;
    run_warmup_samples(engine, ctx, samples)?;
    crate::memory::release_free_memory();
    Ok(target)
}

/// Held by a CPU instance from its load to the end of its warm-up: CPU instances start one
/// at a time, as another's load on the shared cores would be timed as this one's. GPU
/// instances load side by side (each GPU compiles its own).
pub(super) fn cpu_start_alone() -> MutexGuard<'static, ()> {
    static CPU_START: Mutex<()> = Mutex::new(());
    CPU_START.lock().unwrap_or_else(|e| e.into_inner())
}

/// Batch size per instance: fixed by the config, or the candidate with the lowest time per
/// image measured on the instance's own device at warm-up (on a CPU per-image cost grows
/// with batch size, on a GPU it falls).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchSizeChoice {
    Pinned(usize),
    Tune(Vec<usize>),
}

/// Runs the config's `model_warmup` samples as Triton does: each `count` times, in order;
/// the first that fails fails the instance's load, naming the sample. A sample larger than
/// the largest batch the instance runs (`batch_rows`) runs as batches of that many rows and
/// the rest, as a request of its size would.
fn run_warmup_samples(
    engine: &mut dyn Engine,
    ctx: &InstanceContext,
    samples: &[WarmupSample],
) -> Result<(), String> {
    let row = ctx.height * ctx.width * 3;
    for sample in samples {
        let n = sample.batch_size.min(ctx.batch_rows);
        let mut data = buffer(n * row)?;
        match &sample.data {
            WarmupData::Zero => data.resize(n * row, 0.0),
            WarmupData::Random => {
                // xorshift: values in [0, 1), different for each sample and row.
                let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ (n as u64);
                data.extend((0..n * row).map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 40) as f32 / (1u64 << 24) as f32
                }));
            }
            WarmupData::Row(values) => (0..n).for_each(|_| data.extend_from_slice(values)),
        }
        data.truncate(n * row);
        let t = Instant::now();
        for _ in 0..sample.count {
            let mut left = sample.batch_size;
            while left > 0 {
                let rows = left.min(n);
                left -= rows;
                let input = BatchInput::Tensors {
                    data: &data[..rows * row],
                    height: ctx.height,
                    width: ctx.width,
                };
                let want = OutputRequest::default();
                engine
                    .run(input, want)
                    .map_err(|e| format!("failed to run warmup sample '{}': {e}", sample.name))?;
            }
        }
        tracing::info!(
            model = ctx.model,
            instance = %ctx.id,
            sample = sample.name,
            count = sample.count,
            batch_size = sample.batch_size,
            secs = format!("{:.2}", t.elapsed().as_secs_f64()),
            "warmup sample ran"
        );
    }
    Ok(())
}

/// An empty buffer with room for a batch of `len` values, or why there is none: the
/// config sized it (within `--max-batch-bytes`), so running out of memory fails the load
/// instead of aborting the process.
fn buffer<T>(len: usize) -> Result<Vec<T>, String> {
    let mut data = Vec::new();
    data.try_reserve_exact(len).map_err(|e| {
        format!(
            "no memory for a warm-up batch of {} bytes: {e}",
            len * std::mem::size_of::<T>()
        )
    })?;
    Ok(data)
}

/// Batch sizes measured per device by one start of a model: its instances on one device
/// share the first one's measurement. Identical instances then ask for the same size,
/// instead of each reading its own noise, and start sooner.
pub(super) type Tuned = Arc<Mutex<HashMap<Device, usize>>>;

/// Warms the instance up (TorchScript optimizes on its first calls) and returns its batch
/// size. Runs the first calls (the executor specializes on them), then picks the batch size:
/// pinned by the config, measured on this device by another instance of this start, or
/// measured here: each candidate's first run (a new shape) and one timed run in order,
/// stopping once two in a row have not beaten the fastest so far (gains below the
/// tolerance add up: OpenVINO bf16 on AMX took 7.3, 7.2 and 6.7 ms per image at 1, 2 and 4,
/// and about a quarter less at 8); then `EXTRA_ROUNDS` more timed rounds over the
/// candidates kept, interleaved so that a slow stretch of the machine falls on all of them;
/// per candidate the fastest of its rounds.
fn warm_up(
    engine: &mut dyn Engine,
    ctx: &InstanceContext,
    choice: &BatchSizeChoice,
    tuned: &Tuned,
) -> Result<usize, String> {
    let row = ctx.height * ctx.width * 3;
    let device = engine.device();
    let mut run = |n: usize| -> Result<f64, String> {
        let mut data = buffer(n.max(1) * row)?;
        data.resize(n.max(1) * row, 128u8);
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
            .run(input, OutputRequest::default())
            .map_err(|e| format!("warm-up with batch {n}: {e}"))?;
        Ok(t.elapsed().as_secs_f64())
    };
    // The profiling executor specializes on its first two calls. They run outside any
    // share of the cores, so a runtime's threads started by a first run keep every CPU
    // (a one-thread share pins its thread: `Cores`).
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
    if device == Device::Cpu {
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
        tracing::info!(model = ctx.model, instance = %ctx.id, chosen, %device, "batch size as measured by another instance on this device");
        return Ok(chosen);
    }
    let mut table: Vec<(usize, f64)> = Vec::new();
    let mut best = f64::INFINITY;
    let mut no_gain_in_a_row = 0;
    for &n in &candidates {
        run(n)?; // first run of this shape
        let per_image = run(n)? / n as f64;
        table.push((n, per_image));
        if per_image < best {
            no_gain_in_a_row = 0;
        } else {
            no_gain_in_a_row += 1;
            // Per-image cost no longer falls past this point on this device.
            if no_gain_in_a_row == 2 {
                break;
            }
        }
        best = best.min(per_image);
    }
    for _ in 0..EXTRA_ROUNDS {
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

/// Timed rounds over the candidates kept, after the first: a 2-core VM's slow stretches
/// last about as long as a round, and with two the chosen size moved between 1 and 4 from
/// start to start (per candidate the fastest of its rounds counts).
const EXTRA_ROUNDS: usize = 4;

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
