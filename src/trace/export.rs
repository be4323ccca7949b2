//! OpenTelemetry mode: a finished request's spans, as Triton shapes them, queued for the
//! OTLP/HTTP exporter (protobuf, POSTed to `opentelemetry,url=`). The span tree of one
//! request: `InferRequest` (the transport's timestamps as events; the caller's span, from
//! its `traceparent`, as parent) > one span per model it ran, named after the model
//! (`REQUEST_START`, `QUEUE_START`, `REQUEST_END`; an ensemble's steps under the
//! ensemble's) > a `compute` span per batch its rows rode in (the four `COMPUTE_*`). Each
//! batch that served traced requests is a `batch` span of its own, linked to every one of
//! them, and each `compute` span links to its batch.
//!
//! The exporter never holds a request up: spans go into a queue of
//! `bsp_max_queue_size` (a full queue drops them, counted in
//! `visiongate_trace_spans_dropped_total{reason="queue_full"}`), and one task sends them
//! in batches of `bsp_max_export_batch_size` every `bsp_schedule_delay` ms or as soon as a
//! batch is full, each POST within `EXPORT_TIMEOUT` (a collector that is down or slow
//! drops its batch, counted with `reason="export_failed"`). Stopping sends what is queued
//! within the time the stop gives it.
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use prometheus::IntCounterVec;
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::config::OtelConfig;
use super::otlp::{self, kind, KeyValue};
use super::record::{new_span_id, BatchSpan, Clock, Finished, Stamp, Tracer, Tree, Value};

/// How long one export may take before its spans count as dropped.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The instrumentation scope of every span.
const SCOPE: &str = "visiongate";

/// The queue, held by the tracer; its task starts with the server (`start`).
pub struct Exporter {
    queue: mpsc::Sender<otlp::Span>,
    config: OtelConfig,
    /// The queue's receiving end until the task starts, and the counter of dropped spans.
    parked: Mutex<Option<mpsc::Receiver<otlp::Span>>>,
    dropped: OnceLock<IntCounterVec>,
}

/// The exporting task, until it stops.
pub struct ExportTask {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Exporter {
    pub fn new(config: &OtelConfig) -> Exporter {
        let (queue, rx) = mpsc::channel(config.bsp_max_queue_size.max(1) as usize);
        Exporter {
            queue,
            config: config.clone(),
            parked: Mutex::new(Some(rx)),
            dropped: OnceLock::new(),
        }
    }

    /// Starts the exporting task on the current runtime (once), counting dropped spans in
    /// `dropped`.
    pub fn start(&self, dropped: IntCounterVec) -> Option<ExportTask> {
        let rx = self
            .parked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        let _ = self.dropped.set(dropped.clone());
        let config = &self.config;
        let stop = CancellationToken::new();
        // A URL without a scheme (Triton's examples write `localhost:4318/v1/traces`) is
        // plain HTTP.
        let url = if config.url.contains("://") {
            config.url.clone()
        } else {
            format!("http://{}", config.url)
        };
        let sender = Sender {
            url,
            resource: resource(config),
            client: store_reqwest::Client::builder()
                .timeout(EXPORT_TIMEOUT)
                .redirect(store_reqwest::redirect::Policy::none())
                .build()
                .expect("an HTTP client with a timeout builds"),
            dropped,
            batch: config.bsp_max_export_batch_size.max(1) as usize,
            delay: Duration::from_millis(u64::from(config.bsp_schedule_delay_ms)),
        };
        let task = tokio::spawn(sender.run(rx, stop.clone()));
        Some(ExportTask { stop, task })
    }

    fn queue(&self, span: otlp::Span) {
        if self.queue.try_send(span).is_err() {
            if let Some(dropped) = self.dropped.get() {
                dropped.with_label_values(&["queue_full"]).inc();
            }
        }
    }

    pub(crate) fn trace(&self, tracer: &Tracer, tree: &Tree, records: Vec<Finished>) {
        for span in request_spans(&tracer.clock, tree, records) {
            self.queue(span);
        }
    }

    pub(crate) fn batch(&self, tracer: &Tracer, batch: BatchSpan) {
        self.queue(batch_span(&tracer.clock, batch));
    }
}

impl ExportTask {
    /// Sends what is queued, within `within`, then ends.
    pub async fn stop(self, within: Duration) {
        self.stop.cancel();
        if tokio::time::timeout(within, self.task).await.is_err() {
            tracing::warn!("trace export: spans still queued at stop were dropped");
        }
    }
}

struct Sender {
    url: String,
    resource: otlp::Resource,
    client: store_reqwest::Client,
    dropped: IntCounterVec,
    batch: usize,
    delay: Duration,
}

impl Sender {
    /// Sends a batch once it is full, or once its first span has waited the schedule
    /// delay; at stop, what is queued.
    async fn run(self, mut rx: mpsc::Receiver<otlp::Span>, stop: CancellationToken) {
        let mut spans = Vec::with_capacity(self.batch);
        let mut due = tokio::time::Instant::now();
        loop {
            // The timer runs only while spans wait.
            let armed = !spans.is_empty();
            let timer = async move {
                if armed {
                    tokio::time::sleep_until(due).await
                } else {
                    std::future::pending().await
                }
            };
            tokio::select! {
                biased;
                () = stop.cancelled() => break,
                span = rx.recv() => match span {
                    Some(span) => {
                        if spans.is_empty() {
                            due = tokio::time::Instant::now() + self.delay;
                        }
                        spans.push(span);
                        if spans.len() < self.batch {
                            continue;
                        }
                    }
                    None => break,
                },
                () = timer => {}
            }
            self.send(std::mem::replace(
                &mut spans,
                Vec::with_capacity(self.batch),
            ))
            .await;
        }
        // What is queued now goes out, then the task ends.
        while let Ok(span) = rx.try_recv() {
            spans.push(span);
            if spans.len() == self.batch {
                self.send(std::mem::take(&mut spans)).await;
            }
        }
        if !spans.is_empty() {
            self.send(spans).await;
        }
    }

    async fn send(&self, spans: Vec<otlp::Span>) {
        let n = spans.len() as u64;
        let body = otlp::ExportTraceServiceRequest {
            resource_spans: vec![otlp::ResourceSpans {
                resource: Some(self.resource.clone()),
                scope_spans: vec![otlp::ScopeSpans {
                    scope: Some(otlp::InstrumentationScope {
                        name: SCOPE.to_string(),
                        version: env!("CARGO_PKG_VERSION").to_string(),
                    }),
                    spans,
                }],
            }],
        }
        .encode_to_vec();
        let sent = self
            .client
            .post(&self.url)
            .header("content-type", "application/x-protobuf")
            .body(body)
            .send()
            .await
            .and_then(|r| r.error_for_status());
        if let Err(e) = sent {
            self.dropped.with_label_values(&["export_failed"]).inc_by(n);
            tracing::warn!(url = %self.url, error = %e, spans = n, "trace export failed");
        }
    }
}

/// The resource: `service.name` and the configured attributes, a later key winning.
fn resource(config: &OtelConfig) -> otlp::Resource {
    let mut attributes: Vec<KeyValue> = Vec::new();
    for (key, value) in &config.resource {
        attributes.retain(|a| &a.key != key);
        attributes.push(KeyValue::new(key, otlp::Value::String(value.clone())));
    }
    otlp::Resource { attributes }
}

fn value(v: Value) -> otlp::Value {
    match v {
        Value::Int(i) => otlp::Value::Int(i),
        Value::Float(f) => otlp::Value::Double(f),
        Value::Text(s) => otlp::Value::String(s),
    }
}

fn event(clock: &Clock, name: &str, at: Instant) -> otlp::Event {
    otlp::Event {
        time_unix_nano: clock.unix(at),
        name: name.to_string(),
        attributes: Vec::new(),
    }
}

fn compute_events(clock: &Clock, stamps: &[(Stamp, Instant)]) -> Vec<otlp::Event> {
    stamps
        .iter()
        .map(|(s, at)| event(clock, s.name(), *at))
        .collect()
}

/// The transport's timestamps: events of the request's `InferRequest` span.
fn is_transport(stamp: Stamp) -> bool {
    let name = stamp.name();
    name.starts_with("HTTP_") || name.starts_with("GRPC_") || stamp == Stamp::InferResponseComplete
}

fn is_compute(stamp: Stamp) -> bool {
    stamp.name().starts_with("COMPUTE_")
}

/// A request's spans: `InferRequest`, each model's, each model's `compute` spans.
fn request_spans(clock: &Clock, tree: &Tree, records: Vec<Finished>) -> Vec<otlp::Span> {
    let trace_id = tree.trace_id.to_vec();
    let span = |span_id: [u8; 8], parent: Option<[u8; 8]>, name: String, kind: i32| otlp::Span {
        trace_id: trace_id.clone(),
        span_id: span_id.to_vec(),
        trace_state: tree.state.clone(),
        parent_span_id: parent.map(|p| p.to_vec()).unwrap_or_default(),
        name,
        kind,
        flags: 1,
        ..Default::default()
    };
    let mut spans = Vec::new();
    let mut root = span(
        tree.span_id,
        tree.caller,
        "InferRequest".into(),
        kind::SERVER,
    );
    // From the first thing the request's trace saw (its body's first bytes) to now.
    let earliest = records
        .iter()
        .flat_map(|r| r.data.stamps.iter().map(|s| s.1))
        .chain([tree.started])
        .min()
        .unwrap_or(tree.started);
    root.start_time_unix_nano = clock.unix(earliest);
    root.end_time_unix_nano = clock.unix(Instant::now());
    for r in records {
        let stamps = r.data.timestamps();
        let mut model = span(
            r.ids.span_id,
            Some(r.ids.parent_span),
            r.model.name.clone(),
            kind::SERVER,
        );
        // The model's own time: its request's, not the transport's.
        let own: Vec<Instant> = stamps
            .iter()
            .filter(|s| !is_transport(s.0))
            .map(|s| s.1)
            .collect();
        let first = own.first().copied().unwrap_or(earliest);
        let last = own.last().copied().unwrap_or(first);
        model.start_time_unix_nano = clock.unix(first);
        model.end_time_unix_nano = clock.unix(last);
        model.attributes = vec![
            KeyValue::new("triton.model_name", otlp::Value::String(r.model.name)),
            KeyValue::new(
                "triton.model_version",
                otlp::Value::Int(r.model.version as i64),
            ),
            KeyValue::new("triton.trace_id", otlp::Value::Int(r.ids.id as i64)),
            KeyValue::new(
                "triton.trace_parent_id",
                otlp::Value::Int(r.ids.parent_id as i64),
            ),
        ];
        if !r.model.request_id.is_empty() {
            model.attributes.push(KeyValue::new(
                "triton.request_id",
                otlp::Value::String(r.model.request_id),
            ));
        }
        model.attributes.extend(
            r.data
                .attributes
                .into_iter()
                .map(|(k, v)| KeyValue::new(k, value(v))),
        );
        if let Some(why) = r.data.error {
            model.status = Some(otlp::Status {
                message: why,
                code: otlp::status::ERROR,
            });
        }
        // Timestamps the model took itself (a decode's compute is its own).
        let own_compute: Vec<_> = r
            .data
            .stamps
            .iter()
            .filter(|(s, _)| is_compute(*s))
            .copied()
            .collect();
        for (stamp, at) in &stamps {
            if is_transport(*stamp) {
                root.events.push(event(clock, stamp.name(), *at));
            } else if !is_compute(*stamp) {
                model.events.push(event(clock, stamp.name(), *at));
            }
        }
        model.events.extend(r.data.events.into_iter().map(|e| {
            otlp::Event {
                time_unix_nano: clock.unix(e.at),
                name: e.name.to_string(),
                attributes: e
                    .attributes
                    .into_iter()
                    .map(|(k, v)| KeyValue::new(k, value(v)))
                    .collect(),
            }
        }));
        model.events.sort_by_key(|e| e.time_unix_nano);
        if let (Some(start), Some(end)) = (own_compute.first(), own_compute.last()) {
            let mut compute = span(
                new_span_id(),
                Some(r.ids.span_id),
                "compute".into(),
                kind::SERVER,
            );
            compute.start_time_unix_nano = clock.unix(start.1);
            compute.end_time_unix_nano = clock.unix(end.1);
            compute.events = compute_events(clock, &own_compute);
            spans.push(compute);
        }
        for b in &r.data.batches {
            let mut compute = span(
                new_span_id(),
                Some(r.ids.span_id),
                "compute".into(),
                kind::SERVER,
            );
            compute.start_time_unix_nano = clock.unix(b.start);
            compute.end_time_unix_nano = clock.unix(b.end);
            compute.events = compute_events(clock, &b.stamps());
            compute.attributes = vec![KeyValue::new(
                "visiongate.batch.rows",
                otlp::Value::Int(b.rows as i64),
            )];
            compute.links = vec![otlp::Link {
                trace_id: b.trace_id.to_vec(),
                span_id: b.span_id.to_vec(),
                ..Default::default()
            }];
            spans.push(compute);
        }
        spans.push(model);
    }
    root.events.sort_by_key(|e| e.time_unix_nano);
    spans.push(root);
    spans
}

/// A batch's span: a trace of its own, linked to the model span of every traced request
/// it served.
fn batch_span(clock: &Clock, b: BatchSpan) -> otlp::Span {
    let t = b.times;
    otlp::Span {
        trace_id: t.trace_id.to_vec(),
        span_id: t.span_id.to_vec(),
        name: "batch".into(),
        kind: kind::INTERNAL,
        start_time_unix_nano: clock.unix(t.start),
        end_time_unix_nano: clock.unix(t.end),
        flags: 1,
        attributes: vec![
            KeyValue::new("triton.model_name", otlp::Value::String(b.model)),
            KeyValue::new("triton.model_version", otlp::Value::Int(b.version as i64)),
            KeyValue::new("visiongate.instance", otlp::Value::String(b.instance)),
            KeyValue::new("visiongate.batch.rows", otlp::Value::Int(t.rows as i64)),
            KeyValue::new(
                "visiongate.batch.requests",
                otlp::Value::Int(b.requests as i64),
            ),
        ],
        events: compute_events(clock, &t.stamps()),
        links: b
            .links
            .into_iter()
            .map(|(trace_id, span_id, trace_state)| otlp::Link {
                trace_id: trace_id.to_vec(),
                span_id: span_id.to_vec(),
                trace_state,
                ..Default::default()
            })
            .collect(),
        status: b.error.map(|message| otlp::Status {
            message,
            code: otlp::status::ERROR,
        }),
        ..Default::default()
    }
}
