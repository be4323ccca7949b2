//! Test harness: an in-process gateway on 127.0.0.1:0 and helpers for real HTTP calls.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use reqwest::multipart::{Form, Part};
use visiongate::engine::FakeFaults;
use visiongate::settings::Config;
use visiongate::{EngineChoice, Gateway};

pub struct TestGateway {
    pub gateway: Option<Gateway>,
    pub base: String,
    pub client: reqwest::Client,
}

impl TestGateway {
    /// The real model (libtorch on CPU) with `config`.
    pub async fn start(config: Config) -> TestGateway {
        Self::start_with(config, EngineChoice::Runtimes).await
    }

    pub async fn start_with(config: Config, engine: EngineChoice) -> TestGateway {
        let settings = config.validate().expect("test config is valid");
        // The fake engine's server has no GPUs, whatever the host has.
        let gateway = match engine {
            EngineChoice::Fake { .. } => {
                let gpus = Arc::new(visiongate::shm::NoGpus);
                Gateway::start_with_gpu_memory(settings, engine, gpus).await
            }
            EngineChoice::Runtimes => Gateway::start(settings, engine).await,
        }
        .expect("gateway starts");
        Self::started(gateway).await
    }

    /// `gateway` once its models are ready (each must load).
    pub async fn started(gateway: Gateway) -> TestGateway {
        let failures = gateway.wait_ready().await;
        assert!(failures.is_empty(), "models failed to load: {failures:?}");
        let base = format!("http://{}", gateway.http_addr.expect("listening"));
        TestGateway {
            gateway: Some(gateway),
            base,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(600))
                .build()
                .unwrap(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// POST /predict with `files` as (filename, bytes) parts named `files`.
    pub async fn predict(&self, query: &str, files: &[(String, Vec<u8>)]) -> Reply {
        let mut form = Form::new();
        for (name, bytes) in files {
            form = form.part("files", Part::bytes(bytes.clone()).file_name(name.clone()));
        }
        let resp = self
            .client
            .post(self.url(&format!("/predict{query}")))
            .multipart(form)
            .send()
            .await
            .expect("request is answered");
        Reply::from(resp).await
    }

    pub async fn stop(mut self) {
        if let Some(g) = self.gateway.take() {
            g.stop().await;
        }
    }
}

pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub json: serde_json::Value,
}

impl Reply {
    pub async fn from(resp: reqwest::Response) -> Reply {
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap_or_default();
        let json = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("status {status}: body is not JSON: {text:?}"));
        Reply {
            status,
            headers,
            json,
        }
    }

    pub fn results(&self) -> &Vec<serde_json::Value> {
        self.json["results"].as_array().expect("results array")
    }
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A photo from tests/fixtures/photos/<dir>/<name>.
pub fn photo(dir: &str, name: &str) -> (String, Vec<u8>) {
    let path = fixtures().join("photos").join(dir).join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (name.to_string(), bytes)
}

/// Every photo of one size class, sorted by name.
pub fn photos(dir: &str) -> Vec<(String, Vec<u8>)> {
    let mut names: Vec<String> = std::fs::read_dir(fixtures().join("photos").join(dir))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".jpg"))
        .collect();
    names.sort();
    names.iter().map(|n| photo(dir, n)).collect()
}

/// Says that a test, or its part, did not run on this host and why: written past the
/// test harness's capture, so that it shows among the passing tests.
pub fn not_run(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "NOT RUN: {why}");
}

/// ImageNet cat classes (tabby, tiger cat, Persian, Siamese, Egyptian cat).
pub const CAT_CLASSES: [u64; 5] = [281, 282, 283, 284, 285];

/// A gateway on the fake engine with `faults`, returned as soon as it listens (models may
/// still be loading, or have failed: the test looks).
pub async fn start_fake_gateway(config: Config, faults: visiongate::engine::FakeFaults) -> Gateway {
    Gateway::start_with_gpu_memory(
        config.validate().expect("test config is valid"),
        EngineChoice::Fake {
            num_classes: 1000,
            latency: Duration::ZERO,
            faults: Arc::new(faults),
        },
        Arc::new(visiongate::shm::NoGpus),
    )
    .await
    .expect("gateway starts")
}

impl TestGateway {
    /// The fake engine on `config`'s repository with its gate closed once the models are
    /// ready: every batch waits in the engine until the test lets it through
    /// (`faults.gate`).
    pub async fn start_gated(config: Config) -> (TestGateway, Arc<FakeFaults>) {
        let (gw, faults) = Self::start_faulty(config, FakeFaults::default()).await;
        faults.gate.close();
        (gw, faults)
    }

    /// The fake engine (no latency) on `config`'s repository with `faults`, which the test
    /// keeps to change.
    pub async fn start_faulty(
        config: Config,
        faults: FakeFaults,
    ) -> (TestGateway, Arc<FakeFaults>) {
        let faults = Arc::new(faults);
        let gw = Self::start_with(
            config,
            EngineChoice::Fake {
                num_classes: 1000,
                latency: Duration::ZERO,
                faults: faults.clone(),
            },
        )
        .await;
        (gw, faults)
    }

    /// The fake engine (deterministic, `latency` per batch) on `config`'s repository.
    pub async fn start_fake(config: Config, latency: Duration) -> TestGateway {
        Self::start_with(
            config,
            EngineChoice::Fake {
                num_classes: 1000,
                latency,
                faults: Default::default(),
            },
        )
        .await
    }

    /// The JSON body of the answer to `request`.
    pub async fn json(&self, request: reqwest::RequestBuilder) -> serde_json::Value {
        request.send().await.unwrap().json().await.unwrap()
    }

    /// GET /metrics from the metrics port.
    pub async fn metrics_text(&self) -> String {
        let addr = self
            .gateway
            .as_ref()
            .unwrap()
            .metrics_addr
            .expect("listening");
        self.client
            .get(format!("http://{addr}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Sum of the samples of `name` whose labels contain every `labels` fragment.
    pub async fn metric(&self, name: &str, labels: &[&str]) -> f64 {
        metric_sum(&self.metrics_text().await, name, labels)
    }

    /// Waits (10 s at most) until `metric(name, labels)` reads `value`: a state the server
    /// reaches on its own (a request queued, a closed connection noticed).
    pub async fn wait_for_metric(&self, name: &str, labels: &[&str], value: f64) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let now = self.metric(name, labels).await;
            if now == value {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}{labels:?} is {now} after 10 s, not {value}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The bundled ensemble over KServe HTTP, `images` as its UINT8 `RAW_IMAGE` rows:
    /// the status and the JSON body.
    pub async fn ensemble_infer(&self, images: &[Vec<u8>]) -> (u16, serde_json::Value) {
        let (len, data) = padded(images);
        let body = serde_json::json!({
            "inputs": [{
                "name": "RAW_IMAGE",
                "datatype": "UINT8",
                "shape": [images.len(), len],
                "data": data,
            }]
        });
        let resp = self
            .client
            .post(self.url("/v2/models/ensemble_model/infer"))
            .json(&body)
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    }

    /// Waits until the classifier holds `n` requests in its queue.
    pub async fn wait_for_queued(&self, n: usize) {
        self.wait_for_metric(
            "nv_inference_pending_request_count",
            &["model=\"classifier\""],
            n as f64,
        )
        .await
    }
}

/// UINT8 `[N, L]` rows, each zero-padded to the longest: how FastAPI gateways send images
/// to an ensemble.
pub fn padded(images: &[Vec<u8>]) -> (usize, Vec<u8>) {
    let len = images.iter().map(Vec::len).max().unwrap();
    let mut data = Vec::new();
    for image in images {
        data.extend_from_slice(image);
        data.resize(data.len() + len - image.len(), 0);
    }
    (len, data)
}

pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            let series = l.split_whitespace().next().unwrap_or("");
            let metric = series.split('{').next().unwrap_or("");
            metric == name && labels.iter().all(|f| series.contains(f))
        })
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}

/// `to` as a second name of the file `from` (a copy across file systems): a model reads
/// only regular files inside its directory, never a symlink out of it.
pub fn link_file(from: &Path, to: &Path) {
    if std::fs::hard_link(from, to).is_err() {
        std::fs::copy(from, to).unwrap();
    }
}

/// A copy of the bundled repository in a fresh temp dir (model.pt linked, not copied),
/// with `edit(model, config_text)` applied to each config.pbtxt.
pub fn temp_repository(tag: &str, edit: impl Fn(&str, &str) -> String) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
    let dst = std::env::temp_dir().join(format!("vg-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    for model in ["classifier", "preprocessor", "ensemble_model"] {
        let from = src.join(model);
        let to = dst.join(model);
        std::fs::create_dir_all(to.join("1")).unwrap();
        let text = std::fs::read_to_string(from.join("config.pbtxt")).unwrap();
        std::fs::write(to.join("config.pbtxt"), edit(model, &text)).unwrap();
        if from.join("labels.txt").exists() {
            std::fs::copy(from.join("labels.txt"), to.join("labels.txt")).unwrap();
        }
        if from.join("1/model.pt").exists() {
            link_file(&from.join("1/model.pt"), &to.join("1/model.pt"));
        }
    }
    dst
}

/// Replaces the classifier's preferred batch sizes (`[ 8 ]` pins 8).
pub fn with_preferred(model: &str, text: &str, preferred: &str) -> String {
    if model != "classifier" {
        return text.to_string();
    }
    let start = text
        .find("preferred_batch_size:")
        .expect("classifier has preferred sizes");
    let end = start + text[start..].find(']').unwrap() + 1;
    format!(
        "{}preferred_batch_size: {preferred}{}",
        &text[..start],
        &text[end..]
    )
}

/// A gRPC `ModelInfer` request for the bundled ensemble with one encoded image.
pub fn ensemble_request(image: Vec<u8>) -> visiongate::grpc::pb::ModelInferRequest {
    use visiongate::grpc::pb;
    pb::ModelInferRequest {
        model_name: "ensemble_model".into(),
        inputs: vec![pb::model_infer_request::InferInputTensor {
            name: "RAW_IMAGE".into(),
            datatype: "UINT8".into(),
            shape: vec![1, image.len() as i64],
            ..Default::default()
        }],
        raw_input_contents: vec![image.into()],
        ..Default::default()
    }
}

/// A 32x32 PNG of one colour; the fake engine classifies it as `red`.
pub fn solid_png(red: u8) -> Vec<u8> {
    let img = image::RgbImage::from_pixel(32, 32, image::Rgb([red, 100, 50]));
    let mut out = std::io::Cursor::new(Vec::new());
    image::DynamicImage::ImageRgb8(img)
        .write_to(&mut out, image::ImageFormat::Png)
        .unwrap();
    out.into_inner()
}

/// Adds `lines` inside the classifier's `dynamic_batching { ... }` block.
pub fn with_batching(model: &str, text: &str, lines: &str) -> String {
    if model != "classifier" {
        return text.to_string();
    }
    assert!(text.contains("dynamic_batching {"), "classifier batches");
    text.replace(
        "dynamic_batching {",
        &format!("dynamic_batching {{\n{lines}\n"),
    )
}

/// Starts `predict` on its own task, so it can be awaited later or aborted (which closes
/// its connection, as a client that goes away does).
pub fn spawn_predict(
    gw: &std::sync::Arc<TestGateway>,
    query: &str,
    red: u8,
) -> tokio::task::JoinHandle<Reply> {
    let gw = gw.clone();
    let query = query.to_string();
    tokio::spawn(async move {
        gw.predict(&query, &[(format!("{red}.png"), solid_png(red))])
            .await
    })
}

/// Stops a gateway shared with request tasks once they have all ended.
pub async fn stop_shared(gw: std::sync::Arc<TestGateway>) {
    let gw = std::sync::Arc::try_unwrap(gw)
        .ok()
        .expect("every request task has ended");
    gw.stop().await;
}
