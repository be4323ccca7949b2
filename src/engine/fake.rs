//! A deterministic engine for tests: the class of a row is a function of its pixels, so a
//! test can tell whether each caller got its own row back.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{BatchInput, Engine, EngineError, EngineOutput, OutputRequest};
use crate::domain::{top_k, ClassScore};

pub struct FakeEngine {
    pub num_classes: usize,
    /// Sleep per batch, to make batching observable.
    pub latency: Duration,
    pub faults: Arc<FakeFaults>,
}

/// Faults a test orders: an engine error, a panic, or an answer one row short for every
/// batch with a row whose first byte is the given value, and new engines refused while
/// `refuse_loads` is set.
#[derive(Debug, Default)]
pub struct FakeFaults {
    pub fail_on_first_byte: Option<u8>,
    pub panic_on_first_byte: Option<u8>,
    pub lose_row_on_first_byte: Option<u8>,
    pub refuse_loads: AtomicBool,
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
        if let Some(bad) = self.faults.panic_on_first_byte {
            assert!(!firsts.contains(&bad), "injected panic");
        }
        if let Some(bad) = self.faults.fail_on_first_byte {
            if firsts.contains(&bad) {
                return Err(EngineError::Execution("injected failure".into()));
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
        if want.top_k > 0 {
            out.top_k = firsts
                .iter()
                .map(|&f| {
                    let s = scores(f);
                    top_k(&s, want.top_k)
                        .into_iter()
                        .map(|c| ClassScore {
                            class_id: c as u32,
                            score: s[c],
                            value: s[c],
                        })
                        .collect()
                })
                .collect();
        }
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

    fn device_name(&self) -> String {
        "fake".to_string()
    }
}
