//! One OS thread per model instance: owns its engine, offers itself to the batcher when
//! idle, runs the batch it is given and answers each job's rows.
use std::panic::AssertUnwindSafe;

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::{Batch, BatchFailed, RowFailure, RowFormat, RowOutput};
use crate::cores::Cores;
use crate::domain::InstanceId;
use crate::engine::{BatchInput, ComputeTimings, Device, OutputRequest, Stages};
use crate::preprocess::{decode_rows, JpegRow, PreprocessError, Row};
use crate::telemetry::{micros, Latency, ModelSeries};
use prometheus::IntCounter;

/// An idle instance's offer: the batcher sends the next batch through it.
pub(super) struct Slot {
    pub batches: oneshot::Sender<Batch>,
    /// This instance's best batch size (measured at warm-up on its device).
    pub target: usize,
}

pub(super) struct InstanceContext {
    pub model: String,
    pub version: u64,
    pub series: ModelSeries,
    /// The host's cores, which a CPU instance shares with the decode threads.
    pub cores: Arc<Cores>,
    /// This instance's count of executed batches.
    pub executions: IntCounter,
    pub id: InstanceId,
    pub height: usize,
    pub width: usize,
    /// The most rows of one batch it runs (`EngineSpec::max_batch_size`).
    pub batch_rows: usize,
}

/// Why an instance's loop ended.
pub(super) enum Ended {
    /// The batcher went away: the model is stopping.
    Stopped,
    /// The engine panicked: that batch failed, and the engine may be in a broken state.
    /// `ran`: the batches it finished before.
    Panicked { ran: usize },
}

/// Offers this instance to the batcher and runs the batches it is given, until the batcher
/// goes away or the engine panics.
pub(super) fn instance_loop(
    ctx: &InstanceContext,
    mut stages: Stages,
    target: usize,
    slots: &mpsc::Sender<Slot>,
) -> Ended {
    let mut ran = 0;
    let ended = loop {
        let (tx, rx) = oneshot::channel();
        if slots
            .blocking_send(Slot {
                batches: tx,
                target,
            })
            .is_err()
        {
            break Ended::Stopped;
        }
        let Ok(batch) = rx.blocking_recv() else {
            break Ended::Stopped;
        };
        if !run_batch(ctx, &mut stages, batch) {
            break Ended::Panicked { ran };
        }
        ran += 1;
    };
    // An engine that panicked may panic again as it is torn down.
    let _ = std::panic::catch_unwind(AssertUnwindSafe(move || drop(stages)));
    ended
}

/// Returns false if the engine (or the JPEG decoder) panicked.
fn run_batch(ctx: &InstanceContext, stages: &mut Stages, batch: Batch) -> bool {
    crate::memory::note_activity();
    let started = std::time::Instant::now();
    // Only this batch's rows fail; the other rows of their requests are unaffected.
    let fail = |message: String| {
        tracing::error!(model = ctx.model, instance = %ctx.id, %message, "batch failed");
        trace_batch(ctx, &batch, started, None, Some(&message));
        for (job, range) in &batch.parts {
            job.fail_rows(
                range.clone(),
                BatchFailed {
                    model: ctx.model.clone(),
                },
            );
        }
    };
    // Rows of this batch come from one or more requests (merged) or are a range of a larger
    // one (split), so the contiguous batch buffer is assembled here, one row copy each, and
    // reaches libtorch as a single slice. The batcher only merges rows of one format.
    let Some(format) = batch.parts.first().map(|(job, _)| job.job.format) else {
        return true;
    };
    let want = batch
        .parts
        .iter()
        .fold(OutputRequest::default(), |w, (job, _)| {
            w.merge(job.job.want)
        });
    let row_bytes = |elem: usize| ctx.height * ctx.width * 3 * elem;
    let mut bytes = Vec::with_capacity(batch.rows() * row_bytes(1));
    let mut tensors: Vec<f32> = Vec::new();
    // The JPEG rows, each with its row's place (zeros until decoded).
    let mut jpegs: Vec<(usize, Arc<JpegRow>)> = Vec::new();
    let mut at = 0;
    for (job, range) in &batch.parts {
        for row in &job.job.rows[range.clone()] {
            match (format, row) {
                (RowFormat::Image(_), Row::Bytes(row)) => bytes.extend_from_slice(row),
                (RowFormat::Image(_), Row::Jpeg(jpeg)) => {
                    bytes.resize(bytes.len() + row_bytes(1), 0);
                    jpegs.push((at, jpeg.clone()));
                }
                (RowFormat::TensorF32, Row::Bytes(row)) => tensors.extend(
                    row.chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                ),
                // The pipeline passes JPEGs on for image rows only.
                (RowFormat::TensorF32, Row::Jpeg(_)) => {
                    fail("a JPEG row in a batch of tensor rows".into());
                    return true;
                }
            }
            at += 1;
        }
    }
    let rows = batch.rows();
    let len = match format {
        RowFormat::Image(_) => bytes.len(),
        RowFormat::TensorF32 => tensors.len(),
    };
    if len != rows * row_bytes(1) {
        fail(format!(
            "rows do not have the model's input size {}x{}x3",
            ctx.height, ctx.width
        ));
        return true;
    }
    let (engine, decoder) = (stages.engine.as_mut(), stages.decoder.as_deref_mut());
    let decoded = std::panic::catch_unwind(AssertUnwindSafe(|| {
        decode_rows(decoder, &jpegs, &mut bytes, ctx.height, ctx.width)
    }));
    let Ok(unusable) = decoded else {
        fail("the JPEG decoder panicked".into());
        return false;
    };
    let input = match format {
        RowFormat::Image(normalize) => BatchInput::Images {
            data: &bytes,
            height: ctx.height,
            width: ctx.width,
            normalize,
        },
        RowFormat::TensorF32 => BatchInput::Tensors {
            data: &tensors,
            height: ctx.height,
            width: ctx.width,
        },
    };
    // On the CPU, the cores its threads compute on, held while the batch runs.
    let cores = (engine.device() == Device::Cpu).then(|| ctx.cores.infer(engine.threads()));
    let engine_start = std::time::Instant::now();
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| engine.run(input, want)));
    drop(cores);
    match result {
        Ok(Ok(mut out)) => {
            // An engine that lost rows fails the batch rather than give a row no classes.
            let ranked = match out.ranked(rows, want) {
                Ok(ranked) => ranked,
                Err(why) => {
                    fail(why);
                    return true;
                }
            };
            record_execution(ctx, &batch, &out.timings);
            trace_batch(
                ctx,
                &batch,
                started,
                Some((engine_start, &out.timings)),
                None,
            );
            let mut unusable: std::collections::HashMap<usize, PreprocessError> =
                unusable.into_iter().collect();
            let mut ranked = ranked.into_iter().enumerate();
            let logits = out.logits.take();
            let c = out.num_classes;
            for (job, range) in &batch.parts {
                let want = job.job.want;
                let outputs = ranked.by_ref().take(range.len()).map(|(row, mut top)| {
                    if let Some(error) = unusable.remove(&row) {
                        return Err(RowFailure::Unusable(error));
                    }
                    top.truncate(want.top_k);
                    Ok(RowOutput {
                        top,
                        logits: match &logits {
                            Some(l) if want.logits => Some(l[row * c..(row + 1) * c].to_vec()),
                            _ => None,
                        },
                    })
                });
                job.complete(range.clone(), outputs.collect::<Vec<_>>());
            }
            true
        }
        Ok(Err(e)) => {
            fail(e.to_string());
            true
        }
        Err(_) => {
            fail("the engine panicked".into());
            false
        }
    }
}

/// The batch's span and each traced request's compute timestamps, where any of its
/// requests is traced: compute from when the instance took the batch, its input end and
/// output start from the engine's own timings (`engine`: when it started, and its timings;
/// none for a batch that failed before or in the engine, with its `error`), its end now
/// (before any row is answered, so the request's trace is still open).
fn trace_batch(
    ctx: &InstanceContext,
    batch: &Batch,
    started: std::time::Instant,
    engine: Option<(std::time::Instant, &ComputeTimings)>,
    error: Option<&str>,
) {
    if !batch
        .parts
        .iter()
        .any(|(job, _)| job.request.trace.is_some())
    {
        return;
    }
    let requests = batch.requests();
    let traces: Vec<&crate::trace::Trace> =
        requests.iter().filter_map(|r| r.trace.as_ref()).collect();
    let Some(first) = traces.first() else {
        return;
    };
    let mut span =
        crate::trace::BatchSpan::new(&ctx.model, ctx.version, ctx.id.to_string(), started);
    span.times.rows = batch.rows();
    span.requests = requests.len();
    let times = &mut span.times;
    times.end = std::time::Instant::now();
    (times.input_end, times.output_start) = match engine {
        Some((engine_start, t)) => (engine_start + t.input, engine_start + t.input + t.infer),
        None => (times.end, times.end),
    };
    span.error = error.map(str::to_string);
    span.links = traces.iter().map(|t| t.link()).collect();
    for trace in &traces {
        trace.ran_in(&span);
    }
    first.tracer().batch(span);
}

/// Triton's counters for one executed batch; compute durations count once per request in
/// the batch, as Triton accounts them (a request split into parts counts once), and once
/// per execution in the opt-in histograms.
fn record_execution(ctx: &InstanceContext, batch: &Batch, t: &ComputeTimings) {
    let m = &ctx.series;
    let rows = batch.rows();
    let requests = batch.requests().len() as u64;
    tracing::debug!(
        model = ctx.model,
        instance = %ctx.id,
        rows,
        requests,
        infer_us = micros(t.infer),
        "batch ran"
    );
    m.exec_count.inc();
    m.inference_count.inc_by(rows as u64);
    m.batch_size.observe(rows as f64);
    ctx.executions.inc();
    for (which, took) in [
        (Latency::ComputeInput, t.input),
        (Latency::ComputeInfer, t.infer),
        (Latency::ComputeOutput, t.output),
    ] {
        m.latency.observe(which, micros(took), requests);
    }
}
