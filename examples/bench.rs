//! Benchmarks, all in one run (figures, not assertions):
//!   1. model-only forward throughput on preprocessed f32 tensors (each variant x batch
//!      sizes x layouts)
//!   2. decode + resize throughput on the test photos (small / medium / large, 1 and N threads)
//!   3. the real server binary, side by side for each variant this CPU runs (the TorchScript
//!      model in FP32, and bf16 where the CPU has AVX-512 BF16 or AMX; the ONNX model on ONNX
//!      Runtime; the IR on OpenVINO in FP32, and bf16 likewise; the torch.export package),
//!      alternating for `--rounds` rounds (default 2)
//!      so the noise shows: (b) one `/predict` request of 1000 photos (small and medium ones
//!      with one in 20 of 9 to 24 MP) with the cores the server kept busy and the decode-only
//!      bound (the cores over the decode threads' time per image, from the server's decode
//!      metrics in the same request), (d) single-image
//!      requests at concurrency 1, 8 and 32, and the server's peak RSS over both; then (c)
//!      the same request handled naively (one batch, one instance, FP32) and (f)
//!      with the response cache
//!   4. a report: `report.md`, `report.json` and `report.png` (a plot drawn by
//!      `scripts/bench_plot.py` with the venv's matplotlib) in `--report DIR`
//!      (default `test-artifacts/bench`)
//!
//! `make bench` (or `cargo run --release --example bench -- [--images 1000] [--rounds 2]`).
//!
//! `--compare BIN_A BIN_B [--rounds N]` runs only 3b and 3d, alternating the two server
//! binaries for N rounds (default 3), so a change is measured against its base in one run
//! with the noise visible; with each: the cores 3b kept busy, its decode-only bound and the
//! peak RSS of it all.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use visiongate::domain::{OnnxOptions, OpenVinoOptions, Precision, Runtime};
use visiongate::engine::{
    cpu_runs_bf16, BatchInput, Engine, EngineSpec, OnnxEngine, OpenVinoEngine, OutputRequest,
    TorchEngine,
};
use visiongate::preprocess::{decode_into, DecodeBudget, PreprocessSettings};

/// The clone `cargo run` runs it from (cargo sets the variable for what it runs); the one it
/// was built in where run otherwise. With a target directory shared between clones, the
/// build's own path may be another clone's.
fn root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
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

/// What a server or a model-only run loads: the bundled model in one format and precision.
#[derive(Clone, Copy, PartialEq)]
struct Variant {
    runtime: Runtime,
    precision: Precision,
}

impl Variant {
    fn name(self) -> String {
        let format = match self.runtime {
            Runtime::TorchScript => "torchscript",
            Runtime::TorchAoti => "pt2",
            Runtime::Onnx(_) => "onnx",
            Runtime::OpenVino(_) => "openvino",
        };
        format!("{format} {}", self.precision)
    }

    /// The variants this CPU runs: TorchScript first (the baseline), in FP32 and, where the
    /// CPU runs it natively, bf16; then ONNX, OpenVINO (FP32, and bf16 where the CPU runs
    /// it) and the torch.export package.
    fn all() -> Vec<Variant> {
        let torch = |precision| Variant {
            runtime: Runtime::TorchScript,
            precision,
        };
        let mut all = vec![torch(Precision::Fp32)];
        if cpu_runs_bf16() {
            all.push(torch(Precision::Bf16));
        }
        all.push(Variant {
            runtime: Runtime::Onnx(OnnxOptions::default()),
            precision: Precision::Fp32,
        });
        let openvino = |precision| Variant {
            runtime: Runtime::OpenVino(OpenVinoOptions::default()),
            precision,
        };
        all.push(openvino(Precision::Fp32));
        if cpu_runs_bf16() {
            all.push(openvino(Precision::Bf16));
        }
        all.push(Variant {
            runtime: Runtime::TorchAoti,
            precision: Precision::Fp32,
        });
        all
    }

    /// An engine of this variant with `threads` intra-op threads (call it on its thread).
    fn engine(self, threads: usize) -> Box<dyn Engine> {
        let spec = EngineSpec::bundled(&root().join("models"), self.runtime, self.precision);
        match self.runtime {
            Runtime::TorchScript | Runtime::TorchAoti => {
                tch::set_num_threads(threads as i32);
                Box::new(TorchEngine::load(&spec, None).unwrap())
            }
            Runtime::Onnx(options) => {
                let library = std::env::var_os("VISIONGATE_ONNXRUNTIME_LIBRARY").map(PathBuf::from);
                Box::new(
                    OnnxEngine::load(&spec, options, None, threads, library.as_deref()).unwrap(),
                )
            }
            Runtime::OpenVino(options) => {
                let library = std::env::var_os("VISIONGATE_OPENVINO_LIBRARY").map(PathBuf::from);
                Box::new(OpenVinoEngine::load(&spec, options, threads, library.as_deref()).unwrap())
            }
        }
    }

    /// The server's arguments: ONNX, OpenVINO or the package on a copy of the bundled
    /// repository whose classifier's platform is switched (the one line a user changes;
    /// OpenVINO's bf16 is its config's `HINT_BF16`, which `--precision` does not override).
    fn server_args(self) -> Vec<String> {
        let mut args = vec![format!("--precision={}", self.precision)];
        let (tag, line) = match self.runtime {
            Runtime::TorchScript => return args,
            Runtime::Onnx(_) => ("onnx", "platform: \"onnxruntime_onnx\""),
            Runtime::TorchAoti => ("pt2", "platform: \"torch_aoti\""),
            Runtime::OpenVino(_) if self.precision == Precision::Bf16 => (
                "openvino-bf16",
                "backend: \"openvino\"\nparameters { key: \"HINT_BF16\" value: { string_value: \"yes\" } }",
            ),
            Runtime::OpenVino(_) => ("openvino", "backend: \"openvino\""),
        };
        let repo = repository_copy(tag, |text| {
            text.replace("platform: \"pytorch_libtorch\"", line)
        });
        args.extend(["--model-repository".into(), repo.display().to_string()]);
        args
    }
}

/// Images/s of `instances` threads, each with its own engine of `variant` and `threads`
/// intra-op threads, each running batches of `batch` for about `secs`.
fn forward(variant: Variant, batch: usize, instances: usize, threads: usize, secs: f64) -> f64 {
    let barrier = Arc::new(std::sync::Barrier::new(instances));
    let handles: Vec<_> = (0..instances)
        .map(|_| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let mut engine = variant.engine(threads);
                let data: Vec<f32> = (0..batch * 3 * 224 * 224)
                    .map(|i| ((i * 7919) % 255) as f32 / 128.0 - 1.0)
                    .collect();
                let input = BatchInput::Tensors {
                    data: &data,
                    height: 224,
                    width: 224,
                };
                let want = OutputRequest::classes(5);
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
        filter: Default::default(),
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
                            decode_into(f, &settings, &DecodeBudget::unlimited(), &mut out)
                                .unwrap();
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
    let images = arg_value("--images").unwrap_or(1000);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if let Some(bins) = compare_args() {
        return compare(&bins, images).await;
    }
    println!(
        "visiongate benchmark: {cores} cores, EfficientNet-Lite0 on CPU (libtorch, ONNX Runtime, OpenVINO)\n{}\n",
        cpu_description()
    );

    // TorchScript runs as the server runs it on a host without GPUs (`--onednn-fusion`).
    visiongate::engine::libtorch::cuda::set_onednn_fusion(true).unwrap();
    println!("1. model-only forward (preprocessed f32 tensors), images/s");
    println!(
        "   {:>16} {:>6} {:>26} {:>26}",
        "variant",
        "batch",
        "1 instance x 1 thread",
        format!("{cores} instances x 1 thread")
    );
    let mut best = 0.0f64;
    let variants = Variant::all();
    let baseline = variants[0];
    for &variant in &variants {
        for batch in [1, 8, 32] {
            let one = forward(variant, batch, 1, 1, 4.0);
            let many = forward(variant, batch, cores, 1, 4.0);
            if variant == baseline {
                best = best.max(one).max(many);
            }
            println!(
                "   {:>16} {batch:>6} {one:>26.1} {many:>26.1}",
                variant.name()
            );
        }
    }
    let wide = forward(baseline, 8, 1, cores, 4.0);
    best = best.max(wide);
    println!(
        "   {}, batch 8, 1 instance x {cores} threads: {wide:.1}",
        baseline.name()
    );

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

    let small = photos("small");
    let mixed = mixed_photos();
    let rounds = arg_value("--rounds").unwrap_or(2);
    println!(
        "\n3. the server, one process per variant, alternating for {rounds} round(s):\n   \
         b: one /predict request of {images} photos ({}), with the cores it kept busy and \
         its decode-only bound (the cores over the decode threads' time per image in it: \
         what decoding alone would allow), d: single-image requests (one small photo each), \
         peak RSS over both",
        mixed_description(&mixed)
    );
    println!(
        "   {:<5} {:<16} {:>9} {:>12} {:>6} {:>8} {:>22} {:>22} {:>22} {:>9}",
        "round",
        "variant",
        "ready MiB",
        "b images/s",
        "cores",
        "bound",
        "d c=1 req/s p50 p99",
        "c=8 req/s p50 p99",
        "c=32 req/s p50 p99",
        "peak MiB"
    );
    let mut runs = Vec::new();
    let mut metrics = String::new();
    for round in 1..=rounds {
        for &variant in &variants {
            let args = variant.server_args();
            let server = Server::start(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
            let ready_mib = server.rss_mib("VmRSS:");
            let big = one_big_request(&server, &mixed, images).await;
            let single = single_loads(&server, &small).await;
            let run = Run {
                round,
                variant: variant.name(),
                ready_mib,
                rate: big.rate,
                busy: big.busy,
                bound: big.decode_bound(cores),
                single,
                peak_mib: server.peak_rss_mib(),
            };
            println!("   {}", run.row());
            runs.push(run);
            if round == rounds && variant == baseline {
                metrics = server.metrics_summary().await;
            }
        }
    }
    let names: Vec<String> = variants.iter().map(|v| v.name()).collect();
    let summary = Summary::of(&runs, &names, best);
    print!("{}", summary.text());
    print!(
        "   {}, last round: {}",
        baseline.name(),
        metrics.trim_start()
    );

    // The naive way: the whole upload as one batch on one instance with libtorch's default
    // threads (what the seed pipeline does with a 1000-image upload).
    // Its one batch of the whole request takes gigabytes while it runs: memory freed goes
    // back to the system at once, so that its peak is what the batch holds, not retention.
    let naive_repo = naive_repository(images);
    let server = Server::start_env(
        &[
            "--model-repository",
            naive_repo.to_str().unwrap(),
            "--intra-op-threads",
            &cores.to_string(),
            "--precision=fp32",
            "--max-queue-delay-secs=60",
            // One batch of the whole upload: over the default --max-batch-bytes.
            &format!("--max-batch-bytes={}", (images + 1) * 3 * 224 * 224 * 4),
        ],
        &[("MALLOC_CONF", "dirty_decay_ms:0")],
    )
    .await;
    println!("\n3c. the same request handled naively (one batch of {images}, one instance, {cores} threads, FP32)");
    let BigRequest {
        rate: naive,
        secs,
        busy: naive_busy,
        ..
    } = one_big_request(&server, &mixed, images).await;
    let naive_peak = server.peak_rss_mib();
    let fp32_rate = summary.median(&names[0], |r| r.rate);
    println!(
        "   {secs:.2} s, {naive:.1} images/s, cores busy {naive_busy:.2}; visiongate {} is {:.2}x faster",
        names[0],
        fp32_rate / naive
    );
    println!("   naive server peak RSS: {naive_peak:.0} MiB");
    drop(server);

    // The response cache: the same request with `response_cache` enabled (the small
    // photos repeat, so every repeat after the first of each is a hit).
    let cache_repo = repository_copy("cache", |text| {
        format!("{text}\nresponse_cache {{ enable: true }}\n")
    });
    let server = Server::start(&["--model-repository", cache_repo.to_str().unwrap()]).await;
    println!(
        "\n3f. a request of {images} small photos with response_cache enabled ({} distinct photos)",
        small.len()
    );
    let BigRequest {
        rate: cold, secs, ..
    } = one_big_request(&server, &small, images).await;
    println!(
        "   first time: {secs:.2} s, {cold:.1} images/s (repeats hit once their first copy ran)"
    );
    let BigRequest {
        rate: warm, secs, ..
    } = one_big_request(&server, &small, images).await;
    println!("   again:      {secs:.2} s, {warm:.1} images/s");
    drop(server);

    let dir = arg("--report").map_or_else(|| root().join("test-artifacts/bench"), PathBuf::from);
    write_report(
        &dir,
        &json!({
            "cores": cores,
            "cpu": cpu_description(),
            "images": images,
            "photos": mixed_description(&mixed),
            "model_only_best_fp32": best,
            "runs": runs.iter().map(Run::json).collect::<Vec<_>>(),
            "summary": summary.json(),
            "naive": {"images_per_s": naive, "cores_busy": naive_busy, "peak_rss_mib": naive_peak},
            "response_cache": {"first_images_per_s": cold, "again_images_per_s": warm},
        }),
        &summary,
        naive,
    );
}

/// The single-image loads of 3d: (concurrency, requests).
const SINGLE_LOADS: [(usize, usize); 3] = [(1, 60), (8, 320), (32, 960)];

/// 3d: each of `SINGLE_LOADS` in turn, (req/s, p50 ms, p99 ms).
async fn single_loads(server: &Server, small: &[Vec<u8>]) -> Vec<(f64, f64, f64)> {
    let mut single = Vec::new();
    for (concurrency, total) in SINGLE_LOADS {
        single.push(single_image_load(server, small, concurrency, total).await);
    }
    single
}

/// One server process's figures in 3b and 3d.
struct Run {
    round: usize,
    variant: String,
    ready_mib: f64,
    /// 3b: images/s and cores busy.
    rate: f64,
    busy: f64,
    /// 3b's decode-only bound: the cores over the decode threads' time per image.
    bound: f64,
    /// 3d: (req/s, p50 ms, p99 ms) for each of `SINGLE_LOADS`.
    single: Vec<(f64, f64, f64)>,
    /// Over 3b and 3d, start-up included.
    peak_mib: f64,
}

impl Run {
    fn row(&self) -> String {
        let cells = single_cells(&self.single);
        format!(
            "{:<5} {:<16} {:>9.0} {:>12.1} {:>6.2} {:>8.1} {:>22} {:>22} {:>22} {:>9.0}",
            self.round,
            self.variant,
            self.ready_mib,
            self.rate,
            self.busy,
            self.bound,
            cells[0],
            cells[1],
            cells[2],
            self.peak_mib
        )
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "round": self.round,
            "variant": self.variant,
            "ready_rss_mib": self.ready_mib,
            "request_images_per_s": self.rate,
            "cores_busy": self.busy,
            "decode_only_bound_images_per_s": self.bound,
            "single": SINGLE_LOADS.iter().zip(&self.single).map(|((c, _), (rps, p50, p99))| {
                json!({"concurrency": c, "req_per_s": rps, "p50_ms": p50, "p99_ms": p99})
            }).collect::<Vec<_>>(),
            "peak_rss_mib": self.peak_mib,
        })
    }
}

/// 3d's figures, a column each: "req/s p50 p99".
fn single_cells(single: &[(f64, f64, f64)]) -> Vec<String> {
    single
        .iter()
        .map(|(rps, p50, p99)| format!("{rps:>8.1} {p50:>6.1} {p99:>6.1}"))
        .collect()
}

/// The runs of 3b/3d per variant: medians, ranges, and each variant against the first
/// (TorchScript FP32).
struct Summary<'a> {
    runs: &'a [Run],
    variants: Vec<String>,
    best_model_only: f64,
}

impl<'a> Summary<'a> {
    fn of(runs: &'a [Run], variants: &[String], best_model_only: f64) -> Self {
        Summary {
            runs,
            variants: variants.to_vec(),
            best_model_only,
        }
    }

    fn values(&self, variant: &str, f: impl Fn(&Run) -> f64) -> Vec<f64> {
        let mut v: Vec<f64> = self
            .runs
            .iter()
            .filter(|r| r.variant == variant)
            .map(f)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    }

    fn median(&self, variant: &str, f: impl Fn(&Run) -> f64) -> f64 {
        let v = self.values(variant, f);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    fn range(&self, variant: &str, f: impl Fn(&Run) -> f64) -> (f64, f64) {
        let v = self.values(variant, f);
        (
            v.first().copied().unwrap_or(f64::NAN),
            v.last().copied().unwrap_or(f64::NAN),
        )
    }

    fn c32(r: &Run) -> f64 {
        r.single[2].0
    }

    fn peak(&self) -> f64 {
        self.runs.iter().map(|r| r.peak_mib).fold(0.0, f64::max)
    }

    fn text(&self) -> String {
        let mut out = String::from("   per variant (median, range over the rounds):\n");
        for p in &self.variants {
            let p = p.as_str();
            let (lo, hi) = self.range(p, |r| r.rate);
            let (blo, bhi) = self.range(p, |r| r.busy);
            let (clo, chi) = self.range(p, Self::c32);
            let (plo, phi) = self.range(p, |r| r.peak_mib);
            out.push_str(&format!(
                "   {p:<16} b {:.1} images/s ({lo:.1}-{hi:.1}; {:.2}x the best TorchScript FP32 model-only; \
                 {:.0}% of its decode-only bound, {:.1}), cores busy {blo:.2}-{bhi:.2}; d c=32 {:.1} req/s \
                 ({clo:.1}-{chi:.1}); peak RSS {plo:.0}-{phi:.0} MiB\n",
                self.median(p, |r| r.rate),
                self.median(p, |r| r.rate) / self.best_model_only,
                100.0 * self.median(p, |r| r.rate / r.bound),
                self.median(p, |r| r.bound),
                self.median(p, Self::c32),
            ));
        }
        for (variant, big, c32) in self.gains() {
            out.push_str(&format!(
                "   {variant} / {} (medians): the large request {big:.2}x, single-image c=32 {c32:.2}x\n",
                self.variants[0]
            ));
        }
        out.push_str(&format!(
            "   peak RSS of any server above: {:.0} MiB\n",
            self.peak()
        ));
        out
    }

    /// Each other variant's medians over the first's: (variant, 3b images/s, 3d c=32 req/s).
    fn gains(&self) -> Vec<(&str, f64, f64)> {
        let base = self.variants[0].as_str();
        self.variants[1..]
            .iter()
            .map(|v| {
                (
                    v.as_str(),
                    self.median(v, |r| r.rate) / self.median(base, |r| r.rate),
                    self.median(v, Self::c32) / self.median(base, Self::c32),
                )
            })
            .collect()
    }

    fn json(&self) -> serde_json::Value {
        let per: serde_json::Map<String, serde_json::Value> = self
            .variants
            .iter()
            .map(|p| {
                (
                    p.clone(),
                    json!({
                        "request_images_per_s": self.median(p, |r| r.rate),
                        "cores_busy_min": self.range(p, |r| r.busy).0,
                        "decode_only_bound_images_per_s": self.median(p, |r| r.bound),
                        "share_of_decode_only_bound": self.median(p, |r| r.rate / r.bound),
                        "c32_req_per_s": self.median(p, Self::c32),
                        "peak_rss_mib_max": self.range(p, |r| r.peak_mib).1,
                    }),
                )
            })
            .collect();
        json!({
            "per_variant": per,
            "over_first": self.gains().iter().map(|(v, big, c32)| json!({"variant": v, "request": big, "c32": c32})).collect::<Vec<_>>(),
            "peak_rss_mib": self.peak(),
        })
    }
}

/// `report.json`, `report.md`, and `report.png` from `scripts/bench_plot.py`.
fn write_report(dir: &Path, report: &serde_json::Value, summary: &Summary, naive: f64) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("report.json"),
        serde_json::to_string_pretty(report).unwrap(),
    )
    .unwrap();
    let mut md = format!(
        "# visiongate benchmark\n\n{} cores ({}); one /predict request of {} photos ({}); \
         single-image requests of one small photo.\n\n\
         | round | variant | ready RSS MiB | large request images/s | cores busy | decode-only bound images/s | c=1 req/s | c=8 req/s | c=32 req/s | peak RSS MiB |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
        report["cores"],
        report["cpu"].as_str().unwrap_or(""),
        report["images"],
        report["photos"].as_str().unwrap_or("")
    );
    for r in summary.runs {
        md.push_str(&format!(
            "| {} | {} | {:.0} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} |\n",
            r.round,
            r.variant,
            r.ready_mib,
            r.rate,
            r.busy,
            r.bound,
            r.single[0].0,
            r.single[1].0,
            r.single[2].0,
            r.peak_mib
        ));
    }
    md.push_str(&format!(
        "\nNaive (one batch of the whole request, one instance, TorchScript FP32): {naive:.1} images/s.\n\n```\n{}```\n\n![plot](report.png)\n",
        summary.text()
    ));
    std::fs::write(dir.join("report.md"), md).unwrap();
    let python = std::env::var("VISIONGATE_PYTHON").unwrap_or_else(|_| "python3".into());
    let plot = std::process::Command::new(&python)
        .arg(root().join("scripts/bench_plot.py"))
        .arg(dir.join("report.json"))
        .arg(dir.join("report.png"))
        .status();
    match plot {
        Ok(s) if s.success() => println!("\n4. report: {}/report.{{md,json,png}}", dir.display()),
        other => println!(
            "\n4. report: {}/report.{{md,json}}; no plot: {python} scripts/bench_plot.py {} \
             (it needs the venv's matplotlib: `make bench` sets VISIONGATE_PYTHON)",
            dir.display(),
            other.map_or_else(|e| e.to_string(), |s| s.to_string())
        ),
    }
}

/// The CPU's model name and the flags that decide which kernels run (from /proc/cpuinfo).
fn cpu_description() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_once(':'))
            .map_or("", |(_, v)| v.trim())
    };
    let flags: Vec<&str> = field("flags")
        .split_whitespace()
        .filter(|f| {
            [
                "avx2",
                "fma",
                "avx512f",
                "avx512_vnni",
                "avx512_bf16",
                "amx_bf16",
                "avx_vnni",
            ]
            .contains(f)
        })
        .collect();
    format!("CPU: {}; flags: {}", field("model name"), flags.join(" "))
}

/// The value after `name` on the command line.
fn arg(name: &str) -> Option<String> {
    std::env::args().skip_while(|a| a != name).nth(1)
}

/// The number after `name` on the command line.
fn arg_value(name: &str) -> Option<usize> {
    arg(name).map(|v| v.parse().unwrap_or_else(|_| panic!("{name} N")))
}

/// The photos of 3b, in a cycle of 80: the fixtures' 26 small and 12 medium photos twice
/// each, and four large ones spread among them: the two 12 MP mosaics, a 9 MP crop of one
/// and a 24 MP pair of both side by side (made here, JPEG quality 90). One photo in 20 is
/// 9 to 24 MP.
fn mixed_photos() -> Vec<Vec<u8>> {
    let (small, medium, large) = (photos("small"), photos("medium"), photos("large"));
    let decoded: Vec<image::RgbImage> = large
        .iter()
        .map(|f| image::load_from_memory(f).unwrap().to_rgb8())
        .collect();
    let jpeg = |img: &image::RgbImage| {
        let mut out = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 90)
            .encode_image(img)
            .unwrap();
        out
    };
    let (a, b) = (&decoded[0], &decoded[1]);
    let nine = image::imageops::crop_imm(a, 0, 0, 3464, 2600).to_image();
    let mut pair = image::RgbImage::new(a.width() + b.width(), a.height().max(b.height()));
    image::imageops::replace(&mut pair, a, 0, 0);
    image::imageops::replace(&mut pair, b, i64::from(a.width()), 0);
    let big = [jpeg(&nine), large[0].clone(), large[1].clone(), jpeg(&pair)];
    let rest: Vec<&Vec<u8>> = small
        .iter()
        .chain(&medium)
        .chain(&small)
        .chain(&medium)
        .collect();
    let mut out = Vec::new();
    for (i, chunk) in rest.chunks(rest.len().div_ceil(big.len())).enumerate() {
        out.push(big[i].clone());
        out.extend(chunk.iter().map(|f| (*f).clone()));
    }
    out
}

/// What `mixed_photos` holds, in words.
fn mixed_description(mixed: &[Vec<u8>]) -> String {
    let mut counts = [0usize; 3];
    for f in mixed {
        let (w, h) = image::ImageReader::new(std::io::Cursor::new(f))
            .with_guessed_format()
            .unwrap()
            .into_dimensions()
            .unwrap();
        let mp = f64::from(w) * f64::from(h) / 1e6;
        counts[if mp >= 9.0 {
            2
        } else if mp >= 1.0 {
            1
        } else {
            0
        }] += 1;
    }
    format!(
        "cycles of {}: {} small (about 0.2 MP), {} medium (1.3-2.5 MP), {} of 9-24 MP",
        mixed.len(),
        counts[0],
        counts[1],
        counts[2]
    )
}

/// `--compare A B` and `--rounds N`.
fn compare_args() -> Option<(Vec<PathBuf>, usize)> {
    let args: Vec<String> = std::env::args().collect();
    let at = args.iter().position(|a| a == "--compare")?;
    let bins = args[at + 1..]
        .iter()
        .take_while(|a| !a.starts_with("--"))
        .map(PathBuf::from)
        .collect();
    Some((bins, arg_value("--rounds").unwrap_or(3)))
}

/// 3b and 3d for each binary, alternating, `rounds` times.
async fn compare((bins, rounds): &(Vec<PathBuf>, usize), images: usize) {
    let small = photos("small");
    let mixed = mixed_photos();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("{}\n", cpu_description());
    println!(
        "{:<5} {:<28} {:>12} {:>6} {:>8} {:>7} {:>22} {:>22} {:>22}",
        "round",
        "binary",
        "3b img/s",
        "cores",
        "bound",
        "RSS MiB",
        "c=1 req/s p50 p99",
        "c=8 req/s p50 p99",
        "c=32 req/s p50 p99"
    );
    for round in 1..=*rounds {
        for bin in bins {
            let server = Server::start_bin(bin, &[], &[]).await;
            let big = one_big_request(&server, &mixed, images).await;
            let single = single_loads(&server, &small).await;
            let cells = single_cells(&single);
            let name = bin
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into());
            println!(
                "{round:<5} {name:<28} {:>12.1} {:>6.2} {:>8.1} {:>7.0} {:>22} {:>22} {:>22}",
                big.rate,
                big.busy,
                big.decode_bound(cores),
                server.peak_rss_mib(),
                cells[0],
                cells[1],
                cells[2]
            );
        }
    }
}

/// The real server binary on a free port, stopped on drop.
struct Server {
    child: std::process::Child,
    base: String,
    metrics: String,
    client: reqwest::Client,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Server {
    async fn start(args: &[&str]) -> Server {
        Self::start_env(args, &[]).await
    }

    async fn start_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let bin = std::env::var("VISIONGATE_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|_| {
                std::env::current_exe()
                    .unwrap()
                    .parent()
                    .unwrap()
                    .parent()
                    .unwrap()
                    .join("visiongate")
            });
        Self::start_bin(&bin, args, env).await
    }

    async fn start_bin(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let (port, metrics_port) = (free_port(), free_port());
        let repo = root().join("models");
        let mut cmd = std::process::Command::new(bin);
        cmd.args([
            "--host",
            "127.0.0.1",
            "--http-port",
            &port.to_string(),
            "--metrics-port",
            &metrics_port.to_string(),
        ])
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
        if !args.contains(&"--model-repository") {
            cmd.args(["--model-repository", repo.to_str().unwrap()]);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        let mut server = Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            metrics: format!("http://127.0.0.1:{metrics_port}/metrics"),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(3600))
                .build()
                .unwrap(),
        };
        // Up to 10 minutes: the naive server warms up with one batch of the whole upload.
        for _ in 0..6000 {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!(
                    "{} {args:?} exited ({status}) before it was ready",
                    bin.display()
                );
            }
            if let Ok(r) = server
                .client
                .get(format!("{}/v2/health/ready", server.base))
                .send()
                .await
            {
                if r.status().is_success() {
                    return server;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("server did not become ready");
    }

    fn peak_rss_mib(&self) -> f64 {
        self.rss_mib("VmHWM:")
    }

    /// Its Prometheus metrics, as scraped.
    async fn metrics_text(&self) -> String {
        self.client
            .get(&self.metrics)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The seconds its decode threads have spent decoding and the images they decoded (the
    /// `path="cpu"` series of its metrics).
    async fn cpu_decodes(&self) -> (f64, f64) {
        let text = self.metrics_text().await;
        let sum = |name: &str| -> f64 {
            text.lines()
                .filter(|l| l.starts_with(name) && l.contains("path=\"cpu\""))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        (
            sum("visiongate_decode_duration_us_total") / 1e6,
            sum("visiongate_decode_images_total"),
        )
    }

    /// CPU time the server has used so far (user + system, every thread), in seconds.
    fn cpu_seconds(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        // After the command name (which may hold spaces) in parentheses: fields 14 and 15
        // of the line are utime and stime, in clock ticks.
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let ticks: f64 = after
            .split_whitespace()
            .skip(11)
            .take(2)
            .filter_map(|t| t.parse::<f64>().ok())
            .sum();
        // SAFETY: sysconf only reads a system constant.
        let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        ticks / per_second
    }

    /// A memory line of /proc/<pid>/status (`VmRSS:` now, `VmHWM:` the peak), in MiB.
    fn rss_mib(&self, field: &str) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    }

    async fn metrics_summary(&self) -> String {
        let text = self.metrics_text().await;
        let pick = |prefix: &str| -> String {
            text.lines()
                .filter(|l| l.starts_with(prefix))
                .map(|l| format!("   {l}\n"))
                .collect()
        };
        // Every Triton-named series, and the totals of visiongate's own histograms.
        let mut out = String::from("   metrics after the runs above (GET :8002/metrics):\n");
        for prefix in [
            "nv_",
            "visiongate_instance_executions_total",
            "visiongate_batch_size_sum",
            "visiongate_batch_size_count",
            "visiongate_decode_seconds_sum",
            "visiongate_decode_seconds_count",
        ] {
            out.push_str(&pick(prefix));
        }
        out
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request of `images` photos (`photos` repeated): (images/s, seconds, cores the
/// server kept busy: its CPU time over the request's wall time).
/// One `/predict` of `images` photos, as the server answered it.
struct BigRequest {
    /// Images/s.
    rate: f64,
    secs: f64,
    /// Cores the server kept busy.
    busy: f64,
    /// Its decode threads' time per image (the server's decode metrics): the decode-only
    /// bound of this run is the cores over it.
    decode_secs: f64,
}

impl BigRequest {
    /// Images/s the cores would decode with nothing else to do, at this run's decode cost.
    fn decode_bound(&self, cores: usize) -> f64 {
        cores as f64 / self.decode_secs
    }
}

async fn one_big_request(server: &Server, photos: &[Vec<u8>], images: usize) -> BigRequest {
    let mut form = reqwest::multipart::Form::new();
    for i in 0..images {
        let part = reqwest::multipart::Part::bytes(photos[i % photos.len()].clone())
            .file_name(format!("{i}.jpg"));
        form = form.part("files", part);
    }
    let decodes = server.cpu_decodes().await;
    let (t, cpu) = (Instant::now(), server.cpu_seconds());
    let resp = server
        .client
        .post(format!("{}/predict?top_k=1", server.base))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "status {}", resp.status());
    let body: serde_json::Value = resp.json().await.unwrap();
    let secs = t.elapsed().as_secs_f64();
    let busy = (server.cpu_seconds() - cpu) / secs;
    let ok = body["results"]
        .as_array()
        .map_or(0, |r| r.iter().filter(|x| x.get("label").is_some()).count());
    assert_eq!(ok, images, "every photo labelled");
    let after = server.cpu_decodes().await;
    BigRequest {
        rate: images as f64 / secs,
        secs,
        busy,
        decode_secs: (after.0 - decodes.0) / (after.1 - decodes.1).max(1.0),
    }
}

/// `total` single-photo requests from `concurrency` clients: (req/s, p50 ms, p99 ms).
async fn single_image_load(
    server: &Server,
    small: &[Vec<u8>],
    concurrency: usize,
    total: usize,
) -> (f64, f64, f64) {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let next = next.clone();
            let client = server.client.clone();
            let url = format!("{}/predict?top_k=1", server.base);
            let small = small.to_vec();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let part = reqwest::multipart::Part::bytes(small[i % small.len()].clone())
                        .file_name("a.jpg");
                    let form = reqwest::multipart::Form::new().part("files", part);
                    let start = Instant::now();
                    let r = client.post(&url).multipart(form).send().await.unwrap();
                    assert!(r.status().is_success(), "status {}", r.status());
                    let _ = r.bytes().await.unwrap();
                    latencies.push(start.elapsed().as_secs_f64() * 1e3);
                }
                latencies
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    let secs = t.elapsed().as_secs_f64();
    all.sort_by(f64::total_cmp);
    let pct = |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)];
    (total as f64 / secs, pct(0.5), pct(0.99))
}

/// The bundled repository with the classifier run the naive way: one instance, one batch
/// of the whole upload.
/// A copy of the bundled repository (model.pt linked) with `edit` applied to the
/// classifier's config.
fn repository_copy(tag: &str, edit: impl Fn(String) -> String) -> PathBuf {
    let src = root().join("models");
    let dst = std::env::temp_dir().join(format!("visiongate-bench-{tag}-{}", std::process::id()));
    if dst.exists() {
        return dst; // made by an earlier round of this run
    }
    for model in ["classifier", "preprocessor", "ensemble_model"] {
        std::fs::create_dir_all(dst.join(model).join("1")).unwrap();
        let mut text = std::fs::read_to_string(src.join(model).join("config.pbtxt")).unwrap();
        if model == "classifier" {
            std::fs::copy(
                src.join(model).join("labels.txt"),
                dst.join(model).join("labels.txt"),
            )
            .unwrap();
            // Linked, not symlinked: a model reads only files inside its directory.
            for file in [
                "model.pt",
                "model.onnx",
                "model.xml",
                "model.bin",
                "model.pt2",
            ] {
                let (from, to) = (
                    src.join(model).join("1").join(file),
                    dst.join(model).join("1").join(file),
                );
                if std::fs::hard_link(&from, &to).is_err() {
                    std::fs::copy(&from, &to).unwrap();
                }
            }
            text = edit(text);
        }
        std::fs::write(dst.join(model).join("config.pbtxt"), text).unwrap();
    }
    dst
}

fn naive_repository(images: usize) -> PathBuf {
    repository_copy("naive", |text| {
        let text = text
            .replace("max_batch_size: 64", &format!("max_batch_size: {images}"))
            .replace("count: 2", "count: 1")
            .replace(
                "max_queue_delay_microseconds: 2000",
                "max_queue_delay_microseconds: 60000000",
            );
        let start = text.find("preferred_batch_size:").unwrap();
        let end = start + text[start..].find(']').unwrap() + 1;
        format!(
            "{}preferred_batch_size: [ {images} ]{}",
            &text[..start],
            &text[end..]
        )
    })
}
