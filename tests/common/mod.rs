//! Test harness: an in-process gateway on 127.0.0.1:0 and helpers for real HTTP calls.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::multipart::{Form, Part};
use visiongate::config::Config;
use visiongate::{EngineChoice, Gateway};

pub struct TestGateway {
    pub gateway: Option<Gateway>,
    pub base: String,
    pub client: reqwest::Client,
}

impl TestGateway {
    /// The real model (libtorch on CPU) with `config`.
    pub async fn start(config: Config) -> TestGateway {
        Self::start_with(config, EngineChoice::Torch).await
    }

    pub async fn start_with(config: Config, engine: EngineChoice) -> TestGateway {
        let settings = config.validate().expect("test config is valid");
        let gateway = Gateway::start(settings, engine)
            .await
            .expect("gateway starts");
        let failures = gateway.wait_ready().await;
        assert!(failures.is_empty(), "models failed to load: {failures:?}");
        let base = format!("http://{}", gateway.http_addr);
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

/// ImageNet cat classes (tabby, tiger cat, Persian, Siamese, Egyptian cat).
pub const CAT_CLASSES: [u64; 5] = [281, 282, 283, 284, 285];
