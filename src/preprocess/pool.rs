//! A bounded pool of OS threads that decode and resize images, off the async workers.
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::oneshot;

use super::{decode_into, DecodeBudget, PreprocessError, PreprocessSettings};
use crate::telemetry::Metrics;

/// One row of a model's input: a preprocessed image (u8 HWC RGB of the model's input
/// size), or a caller's tensor row (its little-endian bytes, a slice of the request).
pub type Row = Bytes;

type Reply = oneshot::Sender<Result<Row, PreprocessError>>;

struct Task {
    bytes: Bytes,
    settings: Arc<PreprocessSettings>,
    reply: Reply,
}

/// Cheap to clone; the threads stop when the last handle is dropped.
#[derive(Clone)]
pub struct PreprocessPool {
    tasks: async_channel::Sender<Task>,
}

impl PreprocessPool {
    /// `threads` decoding threads; `queue` tasks may wait for one. A full queue makes
    /// `submit` wait, which slows the upload that feeds it instead of buffering it all.
    /// The threads together hold at most `memory` bytes of decoded images.
    pub fn start(threads: usize, queue: usize, memory: u64, metrics: Arc<Metrics>) -> Self {
        let (tx, rx) = async_channel::bounded::<Task>(queue.max(1));
        let budget = Arc::new(DecodeBudget::new(
            memory,
            Some(metrics.decode_memory_bytes.clone()),
        ));
        for i in 0..threads.max(1) {
            let (rx, metrics, budget) = (rx.clone(), metrics.clone(), budget.clone());
            std::thread::Builder::new()
                .name(format!("decode/{i}"))
                .spawn(move || worker(rx, metrics, budget))
                .expect("spawning a decode thread");
        }
        Self { tasks: tx }
    }

    /// Queues one image; the receiver yields its row or why it could not be used.
    pub async fn submit(
        &self,
        bytes: Bytes,
        settings: Arc<PreprocessSettings>,
    ) -> oneshot::Receiver<Result<Row, PreprocessError>> {
        let (reply, rx) = oneshot::channel();
        // The threads live as long as any sender, so this only fails if a thread
        // panicked outside the guarded decode; the dropped reply then reads as an error.
        let _ = self
            .tasks
            .send(Task {
                bytes,
                settings,
                reply,
            })
            .await;
        rx
    }
}

fn worker(rx: async_channel::Receiver<Task>, metrics: Arc<Metrics>, budget: Arc<DecodeBudget>) {
    while let Ok(task) = rx.recv_blocking() {
        if task.reply.is_closed() {
            continue; // nobody waits for it (client went away)
        }
        let started = std::time::Instant::now();
        let mut row = vec![0u8; task.settings.row_len()];
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            decode_into(&task.bytes, &task.settings, &budget, &mut row)
        }))
        .unwrap_or_else(|_| {
            Err(PreprocessError::Invalid(
                "the decoder failed on this file".into(),
            ))
        });
        metrics
            .decode_seconds
            .observe(started.elapsed().as_secs_f64());
        let _ = task.reply.send(result.map(|()| Bytes::from(row)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pool_decodes_and_reports_errors_per_task() {
        let pool = PreprocessPool::start(2, 4, 1 << 30, Arc::new(Metrics::new()));
        let settings = Arc::new(PreprocessSettings {
            width: 8,
            height: 8,
            dct_scaling_min_side: 0,
            max_pixels: 1 << 20,
        });
        let mut png = std::io::Cursor::new(Vec::new());
        image::DynamicImage::ImageRgb8(image::RgbImage::from_pixel(4, 4, image::Rgb([9, 8, 7])))
            .write_to(&mut png, image::ImageFormat::Png)
            .unwrap();
        let good = pool
            .submit(Bytes::from(png.into_inner()), settings.clone())
            .await;
        let bad = pool
            .submit(Bytes::from_static(b"nope"), settings.clone())
            .await;
        let row = good.await.unwrap().unwrap();
        assert_eq!(row.len(), 8 * 8 * 3);
        assert_eq!(&row[..3], &[9, 8, 7]);
        assert_eq!(bad.await.unwrap().unwrap_err().code(), "invalid_image");
    }
}
