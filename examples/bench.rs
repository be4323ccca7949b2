//! Benchmarks, all in one run (figures, not assertions):
//!   1. model-only forward throughput on preprocessed f32 tensors (batch sizes × layouts)
//!   2. decode + resize throughput on the test photos (small / medium / large, 1 and N threads)
//!   3. `/predict` throughput for one request of 1000 photos (the small photos repeated)
//!
//! `make bench` (or `cargo run --release --example bench -- [--images 1000]`).
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use visiongate::config::Config;
use visiongate::engine::{BatchInput, Engine, OutputRequest, TorchEngine};
use visiongate::preprocess::{decode_into, PreprocessSettings};
use visiongate::{EngineChoice, Gateway};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn photos(dir: &str) -> Vec<Vec<u8>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(root().join("tests/fixtures/photos").join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jpg"))
        .collect();
    paths.sort();
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// Images/s of `instances` threads, each with its own engine and `threads` intra-op
/// threads, each running batches of `batch` for about `secs`.
fn forward(model: &Path, batch: usize, instances: usize, threads: i32, secs: f64) -> f64 {
    let barrier = Arc::new(std::sync::Barrier::new(instances));
    let handles: Vec<_> = (0..instances)
        .map(|_| {
            let model = model.to_path_buf();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                tch::set_num_threads(threads);
                let mut engine = TorchEngine::load(&model, None).unwrap();
                let data: Vec<f32> = (0..batch * 3 * 224 * 224)
                    .map(|i| ((i * 7919) % 255) as f32 / 128.0 - 1.0)
                    .collect();
                let input = BatchInput::Tensors {
                    data: &data,
                    height: 224,
                    width: 224,
                };
                let want = OutputRequest {
                    top_k: 5,
                    logits: false,
                };
                for _ in 0..2 {
                    engine.run(input, want).unwrap(); // warm-up
                }
                barrier.wait();
                let t = Instant::now();
                let mut images = 0;
                while t.elapsed().as_secs_f64() < secs {
                    engine.run(input, want).unwrap();
                    images += batch;
                }
                (images, t.elapsed())
            })
        })
        .collect();
    let results: Vec<(usize, Duration)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let images: usize = results.iter().map(|r| r.0).sum();
    let wall = results.iter().map(|r| r.1).max().unwrap();
    images as f64 / wall.as_secs_f64()
}

fn decode(files: &[Vec<u8>], threads: usize, min_side: u32, rounds: usize) -> f64 {
    let settings = PreprocessSettings {
        width: 224,
        height: 224,
        dct_scaling_min_side: min_side,
        max_pixels: 100_000_000,
    };
    let t = Instant::now();
    std::thread::scope(|s| {
        for k in 0..threads {
            let settings = settings.clone();
            s.spawn(move || {
                let mut out = vec![0u8; settings.row_len()];
                for r in 0..rounds {
                    for (i, f) in files.iter().enumerate() {
                        if (r * files.len() + i) % threads == k {
                            decode_into(f, &settings, &mut out).unwrap();
                        }
                    }
                }
            });
        }
    });
    (files.len() * rounds) as f64 / t.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let images: usize = std::env::args()
        .skip_while(|a| a != "--images")
        .nth(1)
        .map(|v| v.parse().expect("--images N"))
        .unwrap_or(1000);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let model = root().join("models/classifier/1/model.pt");
    println!("visiongate benchmark: {cores} cores, EfficientNet-Lite0 on CPU (libtorch)\n");

    println!("1. model-only forward (preprocessed f32 tensors), images/s");
    println!(
        "   {:>6} {:>26} {:>26}",
        "batch",
        "1 instance x 1 thread",
        format!("{cores} instances x 1 thread")
    );
    let mut best = 0.0f64;
    for batch in [1, 8, 32] {
        let one = forward(&model, batch, 1, 1, 4.0);
        let many = forward(&model, batch, cores, 1, 4.0);
        best = best.max(one).max(many);
        println!("   {batch:>6} {one:>26.1} {many:>26.1}");
    }
    let wide = forward(&model, 8, 1, cores as i32, 4.0);
    best = best.max(wide);
    println!("   batch 8, 1 instance x {cores} threads: {wide:.1}");

    println!("\n2. decode + resize to 224x224 (JPEG, DCT threshold 448 / 224), images/s");
    for dir in ["small", "medium", "large"] {
        let files = photos(dir);
        let rounds = match dir {
            "small" => 20,
            "medium" => 3,
            _ => 2,
        };
        let mut cells = Vec::new();
        for min_side in [448, 224] {
            cells.push(format!(
                "{:>7.1} (1 thr) {:>7.1} ({cores} thr)",
                decode(&files, 1, min_side, rounds),
                decode(&files, cores, min_side, rounds)
            ));
        }
        println!("   {dir:<7} 448: {}   224: {}", cells[0], cells[1]);
    }

    println!(
        "\n3. POST /predict, one request of {images} photos (small photos repeated), real server"
    );
    let mut config = Config::for_tests();
    config.model_repository = root().join("models");
    let gw = Gateway::start(config.validate().unwrap(), EngineChoice::Torch)
        .await
        .unwrap();
    assert!(gw.wait_ready().await.is_empty());
    let small = photos("small");
    let mut form = reqwest::multipart::Form::new();
    for i in 0..images {
        form = form.part(
            "files",
            reqwest::multipart::Part::bytes(small[i % small.len()].clone())
                .file_name(format!("{i}.jpg")),
        );
    }
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(3600))
        .build()
        .unwrap();
    let t = Instant::now();
    let resp = client
        .post(format!("http://{}/predict?top_k=1", gw.http_addr))
        .multipart(form)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.unwrap();
    let secs = t.elapsed().as_secs_f64();
    let ok = body["results"]
        .as_array()
        .map_or(0, |r| r.iter().filter(|x| x.get("label").is_some()).count());
    let rate = images as f64 / secs;
    println!("   status {status}, {ok}/{images} labelled, {secs:.2} s, {rate:.1} images/s");
    println!(
        "   = {:.2}x the best model-only figure ({best:.1} images/s)",
        rate / best
    );
    gw.stop().await;
}
