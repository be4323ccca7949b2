//! A pool of OS threads that decode and resize images, off the async workers, shared
//! fairly: each request's images form a flow, and the threads take one image from each flow
//! with work in turn, so a single image is not queued behind all of a large upload's.
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use bytes::Bytes;
use prometheus::IntGauge;
use tokio::sync::oneshot;

use super::{prepare, DecodeBudget, PreprocessError, PreprocessSettings, Row};
use crate::cores::Cores;
use crate::telemetry::Metrics;

type Reply = oneshot::Sender<Decoded>;

struct Task {
    bytes: Bytes,
    settings: Arc<PreprocessSettings>,
    /// Whether the classifier's instances decode JPEGs on a GPU.
    gpu: bool,
    reply: Reply,
    _pending: Pending,
}

/// An image counted in `visiongate_decode_pending_images` from its submission until its
/// task is done or dropped (its flow gone).
struct Pending(IntGauge);

impl Pending {
    fn new(gauge: &IntGauge) -> Self {
        gauge.inc();
        Pending(gauge.clone())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[derive(Default)]
struct Queue {
    /// Flows with images waiting, in the order of their next turn.
    turns: VecDeque<u64>,
    waiting: HashMap<u64, VecDeque<Task>>,
    next_flow: u64,
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    work: Condvar,
    pending: IntGauge,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next image to decode (one from the flow whose turn it is); `None` once closed.
    fn next(&self) -> Option<Task> {
        let mut q = self.lock();
        loop {
            if let Some(flow) = q.turns.pop_front() {
                let tasks = q.waiting.get_mut(&flow).expect("a flow in turn has images");
                let task = tasks.pop_front().expect("a flow in turn has images");
                if tasks.is_empty() {
                    q.waiting.remove(&flow);
                } else {
                    q.turns.push_back(flow);
                }
                return Some(task);
            }
            if q.closed {
                return None;
            }
            q = self.work.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Stops the threads when the last pool handle is dropped.
struct Closer(Arc<Shared>);

impl Drop for Closer {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.work.notify_all();
    }
}

/// Cheap to clone; the threads stop when the last handle is dropped.
#[derive(Clone)]
pub struct PreprocessPool {
    shared: Arc<Shared>,
    _closer: Arc<Closer>,
}

impl PreprocessPool {
    /// `threads` decoding threads, which together hold at most `memory` bytes of decoded
    /// images. How many images wait is bounded by their flows (the pipeline submits a few
    /// ahead per request).
    /// Each thread decodes on a core of `cores` it holds for that image.
    pub fn start(threads: usize, memory: u64, metrics: Arc<Metrics>, cores: Arc<Cores>) -> Self {
        let shared = Arc::new(Shared {
            queue: Mutex::default(),
            work: Condvar::new(),
            pending: metrics.decode_pending_images.clone(),
        });
        let budget = Arc::new(DecodeBudget::new(
            memory,
            Some(metrics.decode_memory_bytes.clone()),
        ));
        for i in 0..threads.max(1) {
            let (shared, metrics, budget) = (shared.clone(), metrics.clone(), budget.clone());
            let cores = cores.clone();
            std::thread::Builder::new()
                .name(format!("decode/{i}"))
                .spawn(move || worker(&shared, &metrics, &budget, &cores))
                .expect("spawning a decode thread");
        }
        Self {
            _closer: Arc::new(Closer(shared.clone())),
            shared,
        }
    }

    /// A new flow: the images of one request.
    pub fn flow(&self) -> Flow {
        let id = {
            let mut q = self.shared.lock();
            q.next_flow += 1;
            q.next_flow
        };
        Flow {
            pool: self.clone(),
            id,
        }
    }
}

/// An image as a decode thread prepared it: its row, or why it cannot be used; when the
/// thread worked on it.
#[derive(Debug)]
pub struct Decoded {
    pub row: Result<Row, PreprocessError>,
    pub started: Instant,
    pub ended: Instant,
}

/// One request's images on the pool; those still waiting are dropped with it.
pub struct Flow {
    pool: PreprocessPool,
    id: u64,
}

impl Flow {
    /// Queues one image; the receiver yields its row (decoded, or a JPEG passed on whole
    /// for an instance that decodes on a GPU: `gpu`) or why it could not be used.
    pub fn submit(
        &self,
        bytes: Bytes,
        settings: Arc<PreprocessSettings>,
        gpu: bool,
    ) -> oneshot::Receiver<Decoded> {
        let (reply, rx) = oneshot::channel();
        let _pending = Pending::new(&self.pool.shared.pending);
        let mut q = self.pool.shared.lock();
        let tasks = q.waiting.entry(self.id).or_default();
        let first = tasks.is_empty();
        tasks.push_back(Task {
            bytes,
            settings,
            gpu,
            reply,
            _pending,
        });
        if first {
            q.turns.push_back(self.id);
        }
        drop(q);
        self.pool.shared.work.notify_one();
        rx
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        let mut q = self.pool.shared.lock();
        if q.waiting.remove(&self.id).is_some() {
            q.turns.retain(|&f| f != self.id);
        }
    }
}

fn worker(shared: &Shared, metrics: &Arc<Metrics>, budget: &Arc<DecodeBudget>, cores: &Cores) {
    while let Some(Task {
        bytes,
        settings,
        gpu,
        reply,
        _pending: pending,
    }) = shared.next()
    {
        if reply.is_closed() {
            continue; // nobody waits for it (client went away)
        }
        let core = cores.decode();
        let started = Instant::now();
        let row = prepare(bytes, &settings, gpu, budget, metrics);
        let ended = Instant::now();
        drop(core);
        // Done before its row is handed on: a caller holding the row sees it counted out.
        drop(pending);
        let _ = reply.send(Decoded {
            row,
            started,
            ended,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(side: u32, rgb: [u8; 3]) -> Bytes {
        encode(image::RgbImage::from_pixel(side, side, image::Rgb(rgb)))
    }

    /// Noise: slow to decode.
    fn noise_png(side: u32) -> Bytes {
        let mut x = 12345u32;
        encode(image::RgbImage::from_fn(side, side, |_, _| {
            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
            image::Rgb([(x >> 24) as u8, (x >> 16) as u8, (x >> 8) as u8])
        }))
    }

    fn encode(img: image::RgbImage) -> Bytes {
        let mut png = std::io::Cursor::new(Vec::new());
        image::DynamicImage::ImageRgb8(img)
            .write_to(&mut png, image::ImageFormat::Png)
            .unwrap();
        Bytes::from(png.into_inner())
    }

    fn pixels(row: Row) -> Bytes {
        match row {
            Row::Bytes(b) => b,
            Row::Jpeg(_) => panic!("a PNG is decoded on the CPU"),
        }
    }

    fn settings() -> Arc<PreprocessSettings> {
        Arc::new(PreprocessSettings {
            width: 8,
            height: 8,
            dct_scaling_min_side: 0,
            max_pixels: 1 << 24,
            filter: Default::default(),
        })
    }

    #[tokio::test]
    async fn pool_decodes_and_reports_errors_per_task() {
        let pool = PreprocessPool::start(
            2,
            1 << 30,
            Arc::new(Metrics::new()),
            Arc::new(Cores::new(2)),
        );
        let flow = pool.flow();
        let good = flow.submit(png(4, [9, 8, 7]), settings(), false);
        let bad = flow.submit(Bytes::from_static(b"nope"), settings(), false);
        let row = pixels(good.await.unwrap().row.unwrap());
        assert_eq!(row.len(), 8 * 8 * 3);
        assert_eq!(&row[..3], &[9, 8, 7]);
        assert_eq!(bad.await.unwrap().row.unwrap_err().code(), "invalid_image");
    }

    #[tokio::test]
    async fn flows_take_turns_so_a_later_single_image_is_not_queued_behind_a_large_one() {
        let pool = PreprocessPool::start(
            1,
            1 << 30,
            Arc::new(Metrics::new()),
            Arc::new(Cores::new(1)),
        );
        let (large, single) = (pool.flow(), pool.flow());
        // 20 images of a large upload, then one of another request (encoded beforehand).
        let (photo, small) = (noise_png(1000), png(4, [4, 5, 6]));
        let big: Vec<_> = (0..20)
            .map(|_| large.submit(photo.clone(), settings(), false))
            .collect();
        let one = single.submit(small, settings(), false);
        one.await.unwrap().row.unwrap();
        // The single image was decoded within the first few of the large upload's.
        let mut done = 0;
        for mut rx in big {
            if rx.try_recv().is_ok() {
                done += 1;
            }
        }
        // FIFO would have decoded all 20 first.
        assert!(done <= 8, "{done} of the large upload's images went first");
        // Once a flow is dropped (its images waiting with it), the pool goes on.
        drop(large);
        let again = single.submit(png(4, [7, 7, 7]), settings(), false);
        assert_eq!(&pixels(again.await.unwrap().row.unwrap())[..3], &[7, 7, 7]);
    }

    #[tokio::test]
    async fn pending_images_are_those_waiting_or_decoding_until_done_or_their_flow_drops() {
        let metrics = Arc::new(Metrics::new());
        let pool = PreprocessPool::start(1, 1 << 30, metrics.clone(), Arc::new(Cores::new(1)));
        let pending = || metrics.decode_pending_images.get();
        let (large, single) = (pool.flow(), pool.flow());
        let (photo, small) = (noise_png(1000), png(4, [4, 5, 6]));
        let mut all: Vec<_> = (0..10)
            .map(|_| large.submit(photo.clone(), settings(), false))
            .collect();
        all.push(single.submit(small, settings(), false));
        // Every image counts until it is decoded. Those answered, read before and after the
        // count, bound it (an image leaves the count just before its answer is sent).
        let answered = || all.iter().filter(|rx| !rx.is_empty()).count() as i64;
        let (before, now, after) = (answered(), pending(), answered());
        assert!(
            (10 - after..=11 - before).contains(&now),
            "{now} pending with {before}..{after} of 11 answered"
        );
        let one = all.pop().unwrap();
        one.await.unwrap().row.unwrap();
        assert!(pending() < 11);
        // The large request leaves: its waiting images stop counting, and the one decoding
        // as it finishes.
        drop((large, all));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pending() != 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(pending(), 0);
    }
}
