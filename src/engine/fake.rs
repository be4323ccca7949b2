//! A deterministic engine for tests: the class of a row is a function of its pixels, so a
//! test can tell whether each caller got its own row back.
use std::time::Duration;

use super::{BatchInput, Engine, EngineError, EngineOutput, OutputRequest};
use crate::domain::{top_k, ClassScore};

pub struct FakeEngine {
    pub num_classes: usize,
    /// Sleep per batch, to make batching observable.
    pub latency: Duration,
    /// Fail every batch that contains a row whose first byte is this value.
    pub fail_on_first_byte: Option<u8>,
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
        if let Some(bad) = self.fail_on_first_byte {
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
        Ok(out)
    }

    fn device_name(&self) -> String {
        "fake".to_string()
    }
}
