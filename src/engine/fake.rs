//! A deterministic engine for tests: the class of a row is a function of its pixels, so a
//! test can tell whether each caller got its own row back.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::{BatchInput, Engine, EngineError, EngineOutput, OutputRequest, Stages};
use crate::domain::{top_k, ClassScore};
use crate::preprocess::{BatchDecoder, DeviceDecode, JpegRow};

pub struct FakeEngine {
    pub num_classes: usize,
    /// Sleep per batch, to make batching observable.
    pub latency: Duration,
    pub faults: Arc<FakeFaults>,
}

/// Faults a test orders: an engine error, a panic, or an answer one row short for every
/// batch with a row whose first byte is the given value, an engine error for a batch of
/// more rows than `most_rows` (as a model exported for fewer fails), new engines refused while
/// `refuse_loads` is set, and batches held in the engine while the gate is closed; and
/// whether it decodes JPEG rows itself.
#[derive(Debug, Default)]
pub struct FakeFaults {
    pub fail_on_first_byte: Option<u8>,
    pub panic_on_first_byte: Option<u8>,
    pub lose_row_on_first_byte: Option<u8>,
    pub most_rows: Option<usize>,
    pub refuse_loads: AtomicBool,
    pub gate: Gate,
    /// Each instance has a JPEG decoder, as a GPU instance with nvJPEG does, one that
    /// fails every JPEG (`FailingDecoder`), so that the instance decodes them on the CPU as
    /// it does what a GPU decoder fails: the pipeline then passes JPEGs on whole, and a
    /// JPEG the CPU cannot decode either is its row's own failure.
    pub decodes_jpeg: bool,
}

/// Holds batches in the engine until the test lets them finish, so that a test about
/// order reads the server's decisions instead of racing timers. Open (holding nothing)
/// until [`Gate::close`].
#[derive(Debug)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
    /// The rows of each batch held since the gate last closed, by each row's first byte,
    /// in the order they reached the engine.
    held: watch::Sender<Vec<Vec<u8>>>,
}

#[derive(Debug, Default)]
struct GateState {
    closed: bool,
    /// How many of the batches held since the gate closed may finish.
    let_through: usize,
    /// Counts the closings: a batch held before the gate last opened is not held again.
    closing: u64,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            state: Default::default(),
            changed: Condvar::new(),
            held: watch::Sender::new(Vec::new()),
        }
    }
}

impl Gate {
    /// From now on every batch waits in the engine until it is let through.
    pub fn close(&self) {
        let mut s = self.lock();
        s.closed = true;
        s.let_through = 0;
        s.closing += 1;
        self.held.send_replace(Vec::new());
    }

    /// Lets the `n` earliest held batches (or the next to come) finish.
    pub fn let_through(&self, n: usize) {
        self.lock().let_through += n;
        self.changed.notify_all();
    }

    /// Lets every batch through, now and from now on.
    pub fn open(&self) {
        self.lock().closed = false;
        self.changed.notify_all();
    }

    /// Waits (10 s at most) until `n` batches have been held since the gate closed; the
    /// rows of each, by first byte, in the order they came.
    pub async fn held(&self, n: usize) -> Vec<Vec<u8>> {
        let mut rx = self.held.subscribe();
        let enough = async {
            let held = rx.wait_for(|h| h.len() >= n).await;
            held.expect("the gate lives as long as its engine").clone()
        };
        match tokio::time::timeout(Duration::from_secs(10), enough).await {
            Ok(held) => held,
            Err(_) => panic!(
                "{n} batches were not held within 10 s: {:?}",
                self.held.borrow()
            ),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Called by the engine with its batch's rows: returns at once while the gate is
    /// open, else once this batch is let through or the gate opens.
    fn pass(&self, firsts: &[u8]) {
        let mut s = self.lock();
        if !s.closed {
            return;
        }
        let closing = s.closing;
        let mut ticket = 0;
        self.held.send_modify(|held| {
            ticket = held.len();
            held.push(firsts.to_vec());
        });
        while s.closed && s.closing == closing && s.let_through <= ticket {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl FakeFaults {
    /// A new engine, unless loads are refused now.
    pub fn load(
        self: &Arc<Self>,
        path: &std::path::Path,
        num_classes: usize,
        latency: Duration,
    ) -> Result<FakeEngine, EngineError> {
        if self.refuse_loads.load(Ordering::SeqCst) {
            return Err(EngineError::Load {
                path: path.display().to_string(),
                message: "loads are refused (injected)".into(),
            });
        }
        Ok(FakeEngine {
            num_classes,
            latency,
            faults: self.clone(),
        })
    }

    /// What a fake instance runs: a new engine, after a `FailingDecoder` where
    /// `decodes_jpeg`.
    pub fn stages(
        self: &Arc<Self>,
        path: &std::path::Path,
        num_classes: usize,
        latency: Duration,
    ) -> Result<Stages, EngineError> {
        let mut stages = Stages::engine(self.load(path, num_classes, latency)?);
        if self.decodes_jpeg {
            stages.decoder = Some(Box::new(FailingDecoder));
        }
        Ok(stages)
    }
}

/// A JPEG decoder that fails every image it is given, as nvJPEG fails what it cannot
/// decode.
pub struct FailingDecoder;

impl BatchDecoder for FailingDecoder {
    fn decode(
        &mut self,
        jpegs: &[(usize, Arc<JpegRow>)],
        _: &mut [u8],
        _: usize,
        _: usize,
    ) -> DeviceDecode {
        DeviceDecode {
            path: "gpu_hardware",
            decoded: 0,
            took: Duration::ZERO,
            left: (0..jpegs.len()).collect(),
        }
    }
}

impl FakeEngine {
    /// The class the fake assigns to a row: its first byte modulo the class count.
    pub fn class_of(first_byte: u8, num_classes: usize) -> u32 {
        (first_byte as usize % num_classes) as u32
    }
}

impl Engine for FakeEngine {
    fn run(
        &mut self,
        input: BatchInput<'_>,
        want: OutputRequest,
    ) -> Result<EngineOutput, EngineError> {
        std::thread::sleep(self.latency);
        let rows = input.rows();
        let firsts: Vec<u8> = match input {
            BatchInput::Images { data, .. } => data
                .chunks(data.len() / rows.max(1))
                .map(|r| r[0])
                .collect(),
            BatchInput::Tensors { data, .. } => data
                .chunks(data.len() / rows.max(1))
                .map(|r| r[0].clamp(0.0, 255.0) as u8)
                .collect(),
        };
        self.faults.gate.pass(&firsts);
        if let Some(bad) = self.faults.panic_on_first_byte {
            assert!(!firsts.contains(&bad), "injected panic");
        }
        if let Some(bad) = self.faults.fail_on_first_byte {
            if firsts.contains(&bad) {
                return Err(EngineError::Execution("injected failure".into()));
            }
        }
        if let Some(most) = self.faults.most_rows {
            if firsts.len() > most {
                return Err(EngineError::Execution(format!(
                    "a batch of {} rows; this engine takes at most {most}",
                    firsts.len()
                )));
            }
        }
        let n = self.num_classes;
        let mut out = EngineOutput {
            num_classes: n,
            ..Default::default()
        };
        let scores = |first: u8| {
            let top = Self::class_of(first, n);
            (0..n as u32)
                .map(|c| {
                    if c == top {
                        0.9
                    } else {
                        0.1 / (n as f32 - 1.0)
                    }
                })
                .collect::<Vec<f32>>()
        };
        out.top_k = firsts
            .iter()
            .map(|&f| {
                let s = scores(f);
                top_k(&s, want.top_k.get())
                    .into_iter()
                    .map(|c| ClassScore {
                        class_id: c as u32,
                        score: s[c],
                        value: s[c],
                    })
                    .collect()
            })
            .collect();
        if want.logits {
            out.logits = Some(firsts.iter().flat_map(|&f| scores(f)).collect());
        }
        if let Some(bad) = self.faults.lose_row_on_first_byte {
            if firsts.contains(&bad) {
                out.top_k.pop();
                if let Some(logits) = &mut out.logits {
                    logits.truncate(logits.len().saturating_sub(n));
                }
            }
        }
        Ok(out)
    }

    fn device(&self) -> super::Device {
        super::Device::Fake
    }
}
