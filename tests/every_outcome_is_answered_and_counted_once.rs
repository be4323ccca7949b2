//! Every way a request can end, over HTTP (`/predict`) and gRPC (`ModelInfer` on the
//! ensemble): completed, queue full, expired in the queue, failed in the engine, client
//! gone. Each is answered with its documented status (where anyone is left to read it) and
//! counted exactly once, the same in `/metrics` and in the statistics extension; a client
//! that leaves logs no error.
mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::{solid_png, temp_repository, with_batching, with_preferred, TestGateway};
use visiongate::engine::FakeFaults;
use visiongate::grpc::pb;
use visiongate::grpc::pb::grpc_inference_service_client::GrpcInferenceServiceClient;
use visiongate::settings::Config;

/// The fake engine fails every batch holding a row whose first byte is this.
const FAILING: u8 = 66;

/// Everything logged at WARN or above, kept for the test to read.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Counts {
    success: f64,
    rejected: f64,
    canceled: f64,
    backend: f64,
    other: f64,
    /// The statistics extension's success and fail counts.
    stats_success: f64,
    stats_fail: f64,
}

impl Counts {
    /// These counts plus `success` completed requests and one failure counted as `reason`.
    fn plus(self, success: f64, reason: Option<&str>) -> Counts {
        let mut c = self;
        c.success += success;
        c.stats_success += success;
        if let Some(reason) = reason {
            c.stats_fail += 1.0;
            match reason {
                "REJECTED" => c.rejected += 1.0,
                "CANCELED" => c.canceled += 1.0,
                "BACKEND" => c.backend += 1.0,
                _ => c.other += 1.0,
            }
        }
        c
    }
}

struct Harness {
    gw: TestGateway,
    faults: Arc<FakeFaults>,
    grpc: GrpcInferenceServiceClient<tonic::transport::Channel>,
}

/// How one request ended, as its client saw it.
#[derive(Debug, PartialEq)]
enum Seen {
    Ok(u64),
    /// HTTP status and `code`, or the gRPC code's name with the message's presence.
    Error(String),
}

#[derive(Clone, Copy, Debug)]
enum Transport {
    Http,
    Grpc,
}

impl Harness {
    async fn counts(&self) -> Counts {
        let text = self.gw.metrics_text().await;
        let failure = |reason: &str| {
            common::metric_sum(
                &text,
                "nv_inference_request_failure",
                &["model=\"classifier\"", &format!("reason=\"{reason}\"")],
            )
        };
        let stats = self
            .gw
            .json(
                self.gw
                    .client
                    .get(self.gw.url("/v2/models/classifier/stats")),
            )
            .await;
        let infer = &stats["model_stats"][0]["inference_stats"];
        Counts {
            success: common::metric_sum(
                &text,
                "nv_inference_request_success",
                &["model=\"classifier\""],
            ),
            rejected: failure("REJECTED"),
            canceled: failure("CANCELED"),
            backend: failure("BACKEND"),
            other: failure("OTHER"),
            stats_success: infer["success"]["count"].as_f64().unwrap(),
            stats_fail: infer["fail"]["count"].as_f64().unwrap(),
        }
    }

    /// One image (`red` is the class the fake engine gives it) over `transport`.
    fn send(
        &self,
        transport: Transport,
        red: u8,
        timeout_us: Option<u64>,
    ) -> tokio::task::JoinHandle<Seen> {
        let image = solid_png(red);
        match transport {
            Transport::Http => {
                let client = self.gw.client.clone();
                let query = timeout_us.map_or(String::new(), |t| format!("?timeout_us={t}"));
                let url = self.gw.url(&format!("/predict{query}"));
                tokio::spawn(async move {
                    let form = reqwest::multipart::Form::new().part(
                        "files",
                        reqwest::multipart::Part::bytes(image).file_name("x.png"),
                    );
                    let resp = client.post(url).multipart(form).send().await.unwrap();
                    let status = resp.status().as_u16();
                    let json: serde_json::Value = resp.json().await.unwrap();
                    let file = &json["results"][0];
                    if status == 200 && file["error"].is_object() {
                        // A file whose batch failed: its own error, the request succeeds.
                        Seen::Error(format!("200 {}", file["error"]["code"].as_str().unwrap()))
                    } else if status == 200 {
                        Seen::Ok(file["class_id"].as_u64().unwrap())
                    } else {
                        assert!(json["error"].as_str().is_some_and(|e| !e.is_empty()));
                        Seen::Error(format!("{status} {}", json["code"].as_str().unwrap()))
                    }
                })
            }
            Transport::Grpc => {
                let mut client = self.grpc.clone();
                tokio::spawn(async move {
                    let mut parameters = std::collections::HashMap::new();
                    if let Some(t) = timeout_us {
                        parameters.insert(
                            "timeout".to_string(),
                            pb::InferParameter {
                                parameter_choice: Some(
                                    pb::infer_parameter::ParameterChoice::Int64Param(t as i64),
                                ),
                            },
                        );
                    }
                    let request = pb::ModelInferRequest {
                        parameters,
                        ..common::ensemble_request(image)
                    };
                    match client.model_infer(request).await {
                        Ok(r) => {
                            let r = r.into_inner();
                            let logits: Vec<f32> = r.raw_output_contents[0]
                                .chunks_exact(4)
                                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                                .collect();
                            let best = visiongate::domain::top_k(&logits, 1)[0];
                            Seen::Ok(best as u64)
                        }
                        Err(status) => {
                            assert!(!status.message().is_empty());
                            Seen::Error(format!("{:?}", status.code()))
                        }
                    }
                })
            }
        }
    }

    /// Checks that the counts moved from `before` by exactly this outcome; the new counts.
    async fn counted(
        &self,
        before: Counts,
        success: f64,
        reason: Option<&str>,
        what: &str,
    ) -> Counts {
        let after = self.counts().await;
        assert_eq!(after, before.plus(success, reason), "{what}");
        after
    }

    /// Holds both instances in a batch each until [`Harness::release`] (one after the
    /// other: the one queue place is free again once a request's row is running).
    async fn occupy(&self, transport: Transport) -> Vec<tokio::task::JoinHandle<Seen>> {
        self.faults.gate.close();
        let mut busy = Vec::new();
        for red in [1, 2] {
            busy.push(self.send(transport, red, None));
            self.faults.gate.held(busy.len()).await;
        }
        busy
    }

    /// Lets the held batches, and every later one, run; their requests end `Ok`.
    async fn release(&self, tasks: Vec<tokio::task::JoinHandle<Seen>>) {
        self.faults.gate.open();
        for task in tasks {
            assert!(matches!(task.await.unwrap(), Seen::Ok(_)));
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_outcome_is_answered_and_counted_once_over_http_and_grpc() {
    let logs = Logs::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();

    let mut config = Config::for_tests();
    config.control.model_repository = vec![temp_repository("outcomes", |m, t| {
        with_batching(
            m,
            &with_preferred(m, t, "[ 1 ]"),
            "default_queue_policy { allow_timeout_override: true max_queue_size: 1 }",
        )
    })];
    config.queues.max_queue_size = 1;
    let faults = FakeFaults {
        fail_on_first_byte: Some(FAILING),
        ..Default::default()
    };
    let (gw, faults) = TestGateway::start_faulty(config, faults).await;
    let grpc_addr = gw.gateway.as_ref().unwrap().grpc_addr.expect("listening");
    let grpc = GrpcInferenceServiceClient::connect(format!("http://{grpc_addr}"))
        .await
        .expect("gRPC connects");
    let h = Harness { gw, faults, grpc };

    for transport in [Transport::Http, Transport::Grpc] {
        let (overloaded, expired, failed) = match transport {
            Transport::Http => (
                "503 overloaded",
                "504 deadline_exceeded",
                "200 model_failed",
            ),
            Transport::Grpc => ("Unavailable", "DeadlineExceeded", "Internal"),
        };
        let at = |what: &str| format!("{transport:?}: {what}");

        // Completed.
        let counts = h.counts().await;
        assert_eq!(h.send(transport, 7, None).await.unwrap(), Seen::Ok(7));
        let counts = h.counted(counts, 1.0, None, &at("completed")).await;

        // Failed in the engine: the error says so (over HTTP in the file's own entry, the
        // request succeeding); counted as BACKEND.
        let seen = h.send(transport, FAILING, None).await.unwrap();
        assert_eq!(seen, Seen::Error(failed.into()), "{}", at("engine failure"));
        let counts = h
            .counted(counts, 0.0, Some("BACKEND"), &at("engine failure"))
            .await;

        // Queue full: both instances busy, the one queue place taken; refused at once.
        let mut admitted = h.occupy(transport).await;
        admitted.push(h.send(transport, 3, None));
        h.gw.wait_for_queued(1).await;
        let seen = h.send(transport, 4, None).await.unwrap();
        assert_eq!(seen, Seen::Error(overloaded.into()), "{}", at("queue full"));
        h.release(admitted).await;
        let counts = h
            .counted(counts, 3.0, Some("REJECTED"), &at("queue full"))
            .await;

        // Expired: still queued when its 100 ms timeout passed.
        let busy = h.occupy(transport).await;
        let seen = h.send(transport, 5, Some(100_000)).await.unwrap();
        assert_eq!(seen, Seen::Error(expired.into()), "{}", at("expired"));
        h.release(busy).await;
        let counts = h
            .counted(counts, 2.0, Some("REJECTED"), &at("expired"))
            .await;

        // Client gone while queued: nobody is answered; counted CANCELED.
        let busy = h.occupy(transport).await;
        let leaving = h.send(transport, 6, None);
        h.gw.wait_for_queued(1).await;
        leaving.abort();
        // The server notices the closed connection within its poll interval.
        h.gw.wait_for_metric(
            "nv_inference_request_failure",
            &["model=\"classifier\"", "reason=\"CANCELED\""],
            counts.canceled + 1.0,
        )
        .await;
        h.release(busy).await;
        let counts = h
            .counted(counts, 2.0, Some("CANCELED"), &at("client gone"))
            .await;
        assert_eq!(counts.other, 0.0, "{}", at("nothing counted as OTHER"));
    }

    let logged = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let errors: Vec<&str> = logged
        .lines()
        .filter(|l| l.contains("ERROR"))
        .filter(|l| !l.contains("injected failure"))
        .collect();
    assert!(errors.is_empty(), "errors logged: {errors:#?}");
    let cancel_logged = logged.lines().any(|l| l.contains("client closed"));
    assert!(!cancel_logged, "a client that left was logged:\n{logged}");
    h.gw.stop().await;
}
