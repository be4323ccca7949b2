//! Repository control, as Triton's `--model-control-mode`: explicit load/unload behind the
//! control key, load with a `config` override, version policies serving several versions,
//! reloads that fail keeping the previous version, unloads that let admitted requests
//! finish, and poll mode following the files.
use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{solid_png, temp_repository, with_preferred, Reply, TestGateway};
use serde_json::{json, Value};
use visiongate::settings::Config;
use visiongate::state::ControlMode;
use visiongate::EngineChoice;

const KEY_HEADER: &str = "x-admin-key";
const KEY: &str = "s3cret";

fn explicit(repo: &Path, load: &[&str]) -> Config {
    let mut c = Config::for_tests();
    c.control.model_repository = vec![repo.to_path_buf()];
    c.control.model_control_mode = ControlMode::Explicit;
    c.control.load_models = load.iter().map(|s| s.to_string()).collect();
    c.access.repository_control_key = Some(format!("{KEY_HEADER}={KEY}"));
    c
}

/// The fake engine (`latency` per batch) in explicit mode on a copy of the bundled
/// repository whose classifier pins `preferred` (None: as bundled), `ensemble_model`
/// loaded at start-up.
async fn start_explicit(tag: &str, preferred: Option<&str>, latency: Duration) -> TestGateway {
    let repo = temp_repository(tag, |m, t| match preferred {
        Some(p) => with_preferred(m, t, p),
        None => t.to_string(),
    });
    TestGateway::start_fake(explicit(&repo, &["ensemble_model"]), latency).await
}

impl TestGateway {
    async fn get(&self, path: &str) -> (u16, Value) {
        let r = self.client.get(self.url(path)).send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(json!(text)))
    }

    /// POST `/v2/repository/models/{model}/{action}` with `body`, and the key when `key`.
    async fn control(
        &self,
        model: &str,
        action: &str,
        body: Value,
        key: Option<&str>,
    ) -> (u16, Value) {
        let mut req = self
            .client
            .post(self.url(&format!("/v2/repository/models/{model}/{action}")))
            .json(&body);
        if let Some(k) = key {
            req = req.header(KEY_HEADER, k);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(json!(text)))
    }

    /// `control` with the configured key.
    async fn admin(&self, model: &str, action: &str, body: Value) -> (u16, Value) {
        self.control(model, action, body, Some(KEY)).await
    }

    /// Loads `model` with `config` (its JSON text) as the load's `config` parameter.
    async fn load_config(&self, model: &str, config: &str) -> (u16, Value) {
        let body = json!({"parameters": {"config": config}});
        self.admin(model, "load", body).await
    }

    async fn index_json(&self) -> Value {
        let r = self
            .client
            .post(self.url("/v2/repository/index"))
            .send()
            .await
            .unwrap();
        r.json().await.unwrap()
    }

    async fn index(&self) -> Vec<(String, String, String)> {
        self.index_json()
            .await
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let s = |k: &str| m[k].as_str().unwrap_or("").to_string();
                (s("name"), s("version"), s("state"))
            })
            .collect()
    }

    async fn predict_red(&self, red: u8) -> Reply {
        self.predict("", &[(format!("{red}.png"), solid_png(red))])
            .await
    }
}

fn entry(name: &str, version: &str, state: &str) -> (String, String, String) {
    (name.into(), version.into(), state.into())
}

#[tokio::test(flavor = "multi_thread")]
async fn explicit_mode_loads_and_unloads_on_request_with_the_key() {
    let gw = start_explicit("explicit", None, Duration::from_millis(1)).await;
    // Loading the ensemble loaded its steps.
    assert_eq!(
        gw.index().await,
        vec![
            entry("classifier", "1", "READY"),
            entry("ensemble_model", "1", "READY"),
            entry("preprocessor", "1", "READY"),
        ]
    );

    // Closed without the key, and with a wrong one.
    for key in [None, Some("guess")] {
        let (status, body) = gw.control("ensemble_model", "unload", json!({}), key).await;
        assert_eq!(status, 403, "{body}");
        assert_eq!(body["code"], "forbidden");
        assert!(
            body["error"].as_str().unwrap().contains(KEY_HEADER),
            "{body}"
        );
    }
    assert_eq!(gw.predict_red(7).await.status, 200);

    let (status, body) = gw
        .admin(
            "ensemble_model",
            "unload",
            json!({"parameters": {"unload_dependents": true}}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        gw.index().await,
        vec![
            entry("classifier", "", "UNAVAILABLE"),
            entry("ensemble_model", "", "UNAVAILABLE"),
            entry("preprocessor", "", "UNAVAILABLE"),
        ]
    );
    let reply = gw.predict_red(7).await;
    assert_eq!(reply.status, 404, "{}", reply.json);
    assert!(
        reply.json["error"].as_str().unwrap().contains("unloaded"),
        "{}",
        reply.json
    );
    let (status, _) = gw.get("/v2/models/classifier/ready").await;
    assert_eq!(status, 404);
    let (status, body) = gw.admin("ensemble_model", "unload", json!({})).await;
    // As Triton: unloading a model that is not loaded has no effect and succeeds.
    assert_eq!(status, 200, "{body}");

    // Loading just the classifier serves it; the ensemble stays unloaded.
    let (status, body) = gw.admin("classifier", "load", json!({})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(gw.get("/v2/models/classifier/ready").await.0, 200);
    assert_eq!(gw.predict_red(7).await.status, 404);

    let (status, body) = gw.admin("ensemble_model", "load", json!({})).await;
    assert_eq!(status, 200, "{body}");
    let reply = gw.predict_red(7).await;
    assert_eq!(reply.status, 200, "{}", reply.json);
    assert_eq!(reply.results()[0]["class_id"], 7);

    let (status, body) = gw.admin("resnet50", "load", json!({})).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("no model 'resnet50'"),
        "{body}"
    );
    let (status, body) = gw
        .admin(
            "classifier",
            "load",
            json!({"parameters": {"file:1/model.pt": "AAAA"}}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("file:1/model.pt"),
        "{body}"
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn explicit_mode_starts_with_only_the_named_models_and_lists_the_rest() {
    let repo = temp_repository("explicit-none", |_, t| t.to_string());
    let gw = TestGateway::start_fake(explicit(&repo, &[]), Duration::from_millis(1)).await;
    assert_eq!(
        gw.index().await,
        vec![
            entry("classifier", "", ""),
            entry("ensemble_model", "", ""),
            entry("preprocessor", "", ""),
        ]
    );
    // Nothing loaded is not "not ready": the server serves what it has (nothing).
    assert_eq!(gw.get("/v2/health/ready").await.0, 200);
    assert_eq!(gw.get("/v2/models/classifier").await.0, 404);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn load_and_unload_are_refused_outside_explicit_mode() {
    // No key configured: closed, whatever the header says.
    let gw = TestGateway::start_fake(Config::for_tests(), Duration::from_millis(1)).await;
    let (status, body) = gw.admin("classifier", "unload", json!({})).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("--repository-control-key"),
        "{body}"
    );
    gw.stop().await;

    // A key, but mode none: the repository is fixed.
    let mut c = Config::for_tests();
    c.access.repository_control_key = Some(format!("{KEY_HEADER}={KEY}"));
    let gw = TestGateway::start_fake(c, Duration::from_millis(1)).await;
    let (status, body) = gw.admin("classifier", "unload", json!({})).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("explicit"),
        "{body}"
    );
    assert_eq!(gw.get("/v2/models/classifier/ready").await.0, 200);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn load_with_a_config_parameter_replaces_config_pbtxt() {
    let gw = start_explicit("override", None, Duration::from_millis(1)).await;
    let (_, mut config) = gw.get("/v2/models/classifier/config").await;
    assert_eq!(config["max_batch_size"], 4096);
    config["max_batch_size"] = json!(8);
    config["dynamic_batching"]["preferred_batch_size"] = json!([4]);
    let (status, body) = gw.load_config("classifier", &config.to_string()).await;
    assert_eq!(status, 200, "{body}");
    let (_, now) = gw.get("/v2/models/classifier/config").await;
    assert_eq!(now["max_batch_size"], 8);
    assert_eq!(now["dynamic_batching"]["preferred_batch_size"], json!([4]));
    // The ensemble now runs on the reloaded classifier.
    assert_eq!(gw.predict_red(9).await.results()[0]["class_id"], 9);

    // A config that is not a ModelConfig, or one visiongate cannot run: refused, and the
    // loaded version keeps serving.
    for (bad, needle) in [
        (
            json!({"max_batch_size": 8, "colour": "red"}).to_string(),
            "colour",
        ),
        (
            json!({"name": "classifier", "backend": "python"}).to_string(),
            "Python backend",
        ),
    ] {
        let (status, body) = gw.load_config("classifier", &bad).await;
        assert_eq!(status, 400, "{body}");
        assert!(body["error"].as_str().unwrap().contains(needle), "{body}");
    }
    assert_eq!(
        gw.get("/v2/models/classifier/config").await.1["max_batch_size"],
        8
    );
    assert_eq!(gw.predict_red(9).await.results()[0]["class_id"], 9);

    // A classifier reloaded on its own with another input size no longer fits its
    // ensemble's preprocessor: the ensemble says so until the classifier fits again.
    let mut wide = now.clone();
    wide["input"][0]["dims"] = json!(["3", "299", "299"]);
    let (status, body) = gw.load_config("classifier", &wide.to_string()).await;
    assert_eq!(status, 200, "{body}");
    let reply = gw.predict_red(9).await;
    assert_eq!(reply.status, 404, "{}", reply.json);
    assert!(
        reply.json["error"].as_str().unwrap().contains("299x299"),
        "{}",
        reply.json
    );
    let (status, body) = gw.admin("classifier", "load", json!({})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(gw.predict_red(9).await.results()[0]["class_id"], 9);
    gw.stop().await;
}

/// A repository whose classifier has versions 1 and 2 (the same model file) and serves
/// the two newest.
fn two_version_repository(tag: &str) -> std::path::PathBuf {
    let repo = temp_repository(tag, |model, text| {
        let text = with_preferred(model, text, "[ 4 ]");
        if model == "classifier" {
            format!("{text}\nversion_policy: {{ latest {{ num_versions: 2 }} }}\n")
        } else {
            text
        }
    });
    let cls = repo.join("classifier");
    std::fs::create_dir_all(cls.join("2")).unwrap();
    common::link_file(&cls.join("1/model.pt"), &cls.join("2/model.pt"));
    repo
}

#[tokio::test(flavor = "multi_thread")]
async fn version_policy_serves_every_selected_version() {
    let repo = two_version_repository("versions");
    let mut c = Config::for_tests();
    c.control.model_repository = vec![repo];
    let gw = TestGateway::start_fake(c, Duration::from_millis(1)).await;
    let (status, meta) = gw.get("/v2/models/classifier").await;
    assert_eq!(status, 200, "{meta}");
    assert_eq!(meta["versions"], json!(["1", "2"]));
    let pixels = vec![3.0f32; 3 * 224 * 224];
    for version in ["1", "2"] {
        assert_eq!(
            gw.get(&format!("/v2/models/classifier/versions/{version}/ready"))
                .await
                .0,
            200
        );
        let r = gw
            .client
            .post(gw.url(&format!("/v2/models/classifier/versions/{version}/infer")))
            .json(&json!({"inputs": [{"name": "input__0", "datatype": "FP32",
                                       "shape": [1, 3, 224, 224], "data": pixels}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["model_version"], version, "{body}");
    }
    let (_, stats) = gw.get("/v2/models/classifier/stats").await;
    let per_version: Vec<(String, u64)> = stats["model_stats"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["version"].as_str().unwrap().to_string(),
                s["inference_count"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        per_version,
        vec![("1".to_string(), 1), ("2".to_string(), 1)]
    );
    assert_eq!(
        gw.get("/v2/models/classifier/versions/3/ready").await.0,
        404
    );
    // The ensemble runs on the newest classifier version.
    let reply = gw.predict_red(5).await;
    assert_eq!(reply.status, 200, "{}", reply.json);
    let (_, stats) = gw.get("/v2/models/classifier/versions/2/stats").await;
    assert_eq!(stats["model_stats"][0]["inference_count"], 2);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_reload_keeps_the_previous_version_serving() {
    // The real engine: version 2's model file is not TorchScript, so its load fails.
    let repo = temp_repository("failed-reload", |m, t| with_preferred(m, t, "[ 2 ]"));
    let gw =
        TestGateway::start_with(explicit(&repo, &["ensemble_model"]), EngineChoice::Runtimes).await;
    let cat = common::photo("small", "sk_chelsea.jpg");
    let before = gw.predict("", std::slice::from_ref(&cat)).await;
    assert_eq!(before.status, 200, "{}", before.json);

    std::fs::create_dir_all(repo.join("classifier/2")).unwrap();
    std::fs::write(
        repo.join("classifier/2/model.pt"),
        b"not a TorchScript archive",
    )
    .unwrap();
    let (status, body) = gw.admin("classifier", "load", json!({})).await;
    assert_eq!(status, 400, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("previous versions keep serving"), "{error}");

    let (_, meta) = gw.get("/v2/models/classifier").await;
    assert_eq!(meta["versions"], json!(["1"]));
    let after = gw.predict("", std::slice::from_ref(&cat)).await;
    assert_eq!(after.status, 200, "{}", after.json);
    assert_eq!(
        after.results()[0]["class_id"],
        before.results()[0]["class_id"]
    );

    // Once version 2 is fixed, the same request swaps it in.
    std::fs::remove_file(repo.join("classifier/2/model.pt")).unwrap();
    common::link_file(
        &repo.join("classifier/1/model.pt"),
        &repo.join("classifier/2/model.pt"),
    );
    let (status, body) = gw.admin("classifier", "load", json!({})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        gw.get("/v2/models/classifier").await.1["versions"],
        json!(["2"])
    );
    let reply = gw.predict("", std::slice::from_ref(&cat)).await;
    assert_eq!(
        reply.json["model_version"], "1",
        "the ensemble's own version"
    );
    assert_eq!(
        reply.results()[0]["class_id"],
        before.results()[0]["class_id"]
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn unloaded_model_finishes_the_requests_it_admitted() {
    // One row per batch, 400 ms each: an 8-image upload takes about 1.6 s on 2 instances.
    let gw = std::sync::Arc::new(
        start_explicit("unload-inflight", Some("[ 1 ]"), Duration::from_millis(400)).await,
    );
    let files: Vec<(String, Vec<u8>)> = (0..8u8)
        .map(|i| (format!("{i}.png"), solid_png(10 + i)))
        .collect();
    let busy = {
        let gw = gw.clone();
        tokio::spawn(async move { gw.predict("", &files).await })
    };
    let started = Instant::now();
    // Unload once the upload is admitted and its first rows run.
    while gw.metric("nv_inference_exec_count", &[]).await < 1.0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the upload never ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, body) = gw
        .admin(
            "ensemble_model",
            "unload",
            json!({"parameters": {"unload_dependents": true}}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    // New requests are refused at once while the admitted one still runs.
    assert_eq!(gw.predict_red(1).await.status, 404);
    let reply = busy.await.unwrap();
    assert!(
        started.elapsed() > Duration::from_millis(1200),
        "the upload ran to its end"
    );
    assert_eq!(reply.status, 200, "{}", reply.json);
    let classes: Vec<u64> = reply
        .results()
        .iter()
        .map(|r| r["class_id"].as_u64().unwrap())
        .collect();
    assert_eq!(classes, (10..18).collect::<Vec<u64>>());
    common::stop_shared(gw).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn poll_mode_follows_the_repository() {
    let repo = temp_repository("poll", |_, t| t.to_string());
    let mut c = Config::for_tests();
    c.control.model_repository = vec![repo.clone()];
    c.control.model_control_mode = ControlMode::Poll;
    c.control.repository_poll_secs = 1;
    let gw = TestGateway::start_fake(c, Duration::from_millis(1)).await;
    let wait_for = |what: &'static str, path: &'static str, check: fn(u16, &Value) -> bool| {
        let gw = &gw;
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let (status, body) = gw.get(path).await;
                if check(status, &body) {
                    return;
                }
                assert!(Instant::now() < deadline, "{what}: still {status} {body}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };

    // An edited config is reloaded.
    let config = repo.join("classifier/config.pbtxt");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("max_batch_size: 4096", "max_batch_size: 32"),
    )
    .unwrap();
    wait_for("reload", "/v2/models/classifier/config", |_, c| {
        c["max_batch_size"] == 32
    })
    .await;
    assert_eq!(gw.predict_red(4).await.results()[0]["class_id"], 4);

    // A broken edit is reported and the loaded version keeps serving.
    std::fs::write(&config, "max_batch_size: [").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !gw
        .index()
        .await
        .iter()
        .any(|(n, _, s)| n == "classifier" && s == "UNAVAILABLE")
    {
        // The failure is listed beside the serving version once the poll has seen it.
        assert!(
            Instant::now() < deadline,
            "broken config not reported: {:?}",
            gw.index().await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        gw.get("/v2/models/classifier/config").await.1["max_batch_size"],
        32
    );
    assert_eq!(gw.predict_red(4).await.status, 200);

    // A new model directory is loaded; a removed one is unloaded.
    let copy = repo.join("classifier_copy");
    std::fs::create_dir_all(copy.join("1")).unwrap();
    std::fs::write(
        copy.join("config.pbtxt"),
        text.replace("\"classifier\"", "\"classifier_copy\""),
    )
    .unwrap();
    std::fs::copy(repo.join("classifier/labels.txt"), copy.join("labels.txt")).unwrap();
    common::link_file(
        &repo.join("classifier/1/model.pt"),
        &copy.join("1/model.pt"),
    );
    wait_for("new model", "/v2/models/classifier_copy/ready", |s, _| {
        s == 200
    })
    .await;
    std::fs::remove_dir_all(repo.join("ensemble_model")).unwrap();
    wait_for("removed model", "/v2/models/ensemble_model", |s, _| {
        s == 404
    })
    .await;
    assert_eq!(gw.predict_red(4).await.status, 404);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_during_reloads_are_all_answered() {
    let gw = std::sync::Arc::new(
        start_explicit("reload-under-load", Some("[ 2 ]"), Duration::from_millis(5)).await,
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..4u8)
        .map(|c| {
            let (gw, stop) = (gw.clone(), stop.clone());
            tokio::spawn(async move {
                let mut answered = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let red = 20 + c;
                    let reply = gw.predict_red(red).await;
                    assert_eq!(reply.status, 200, "{}", reply.json);
                    assert_eq!(reply.results()[0]["class_id"], red as u64);
                    answered += 1;
                }
                answered
            })
        })
        .collect();
    for _ in 0..5 {
        let (status, body) = gw.admin("classifier", "load", json!({})).await;
        assert_eq!(status, 200, "{body}");
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for client in clients {
        assert!(client.await.unwrap() > 0);
    }
    common::stop_shared(gw).await;
}

/// Names a client sends are checked at every entry, files a config names stay inside the
/// model's directory, and no answer shows where the repository lies on disk.
#[tokio::test(flavor = "multi_thread")]
async fn control_stays_inside_the_repository_and_shows_no_paths() {
    let repo = temp_repository("confined", |_, t| t.to_string());
    let broken = std::fs::read_to_string(repo.join("classifier/config.pbtxt"))
        .unwrap()
        .replace("name: \"classifier\"", "name: \"broken\"")
        .replace("labels.txt", "nolabels.txt");
    std::fs::create_dir_all(repo.join("broken/1")).unwrap();
    std::fs::write(repo.join("broken/config.pbtxt"), broken).unwrap();
    let gw = TestGateway::start_fake(
        explicit(&repo, &["ensemble_model"]),
        Duration::from_millis(1),
    )
    .await;
    let root = repo.canonicalize().unwrap();
    let shows_no_path = |body: &Value| {
        let text = body.to_string();
        assert!(
            !text.contains(root.to_str().unwrap()) && !text.contains(repo.to_str().unwrap()),
            "an answer shows the repository's path: {text}"
        );
    };

    // Names that are no directory of the repository: 400 wherever they come in.
    // (A bare `..` segment never reaches a server: URL parsers resolve it, `%2E%2E` too;
    // gRPC sends it below.)
    for name in ["..%2F..%2Ftmp", "a%5Cb", "x%00y"] {
        let (status, body) = gw.admin(name, "load", json!({})).await;
        assert_eq!(status, 400, "load {name}: {body}");
        assert!(
            body["error"]
                .as_str()
                .unwrap()
                .contains("invalid model name"),
            "{body}"
        );
        let (status, body) = gw.admin(name, "unload", json!({})).await;
        assert_eq!(status, 400, "unload {name}: {body}");
    }
    let (status, body) = gw.get("/v2/models/..%2Fclassifier").await;
    assert_eq!(status, 400, "{body}");
    let grpc_addr = gw.gateway.as_ref().unwrap().grpc_addr.expect("listening");
    let mut grpc =
        visiongate::grpc::pb::grpc_inference_service_client::GrpcInferenceServiceClient::connect(
            format!("http://{grpc_addr}"),
        )
        .await
        .unwrap();
    for name in ["../classifier", ".."] {
        let mut load = tonic::Request::new(visiongate::grpc::pb::RepositoryModelLoadRequest {
            model_name: name.into(),
            ..Default::default()
        });
        load.metadata_mut().insert(KEY_HEADER, KEY.parse().unwrap());
        let refused = grpc.repository_model_load(load).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("invalid model name"),
            "{refused:?}"
        );
    }

    // Files a `config` names outside the model's directory: refused, naming the field.
    let (_, config) = gw.get("/v2/models/classifier/config").await;
    for (field, value, edit) in [
        (
            "output.label_filename",
            "../../../../etc/passwd",
            json!({"output": [{"name": "output__0", "data_type": "TYPE_FP32", "dims": ["1000"],
                               "label_filename": "../../../../etc/passwd"}]}),
        ),
        (
            "default_model_filename",
            "/etc/passwd",
            json!({"default_model_filename": "/etc/passwd"}),
        ),
    ] {
        let mut bad = config.clone();
        for (k, v) in edit.as_object().unwrap() {
            bad[k] = v.clone();
        }
        let (status, body) = gw.load_config("classifier", &bad.to_string()).await;
        assert_eq!(status, 400, "{field} = {value}: {body}");
        let error = body["error"].as_str().unwrap();
        assert!(
            error.contains(field) && error.contains("inside the model's directory"),
            "{body}"
        );
        shows_no_path(&body);
    }

    // A model whose labels file is missing: the failed load and the index say which file,
    // relative to the repository.
    let (status, body) = gw.admin("broken", "load", json!({})).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("broken/nolabels.txt"),
        "{body}"
    );
    shows_no_path(&body);
    let index = gw.index_json().await;
    assert!(index.to_string().contains("broken/nolabels.txt"), "{index}");
    shows_no_path(&index);

    // The right key still works, and the models still serve.
    let (status, body) = gw.admin("classifier", "load", json!({})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(gw.predict_red(9).await.results()[0]["class_id"], 9);
    gw.stop().await;
}
