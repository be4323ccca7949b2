//! Traces of sampled requests: a `Trace` per model a request runs (its model's name and
//! version, Triton's id and its parent's, the span it is in OpenTelemetry), the
//! timestamps named as Triton names them, and what else answers "where did the time go"
//! (a request's decode, the batches its rows rode in). Recorded in memory while the
//! request runs, handed to the sink as the last handle goes: Triton's trace file, or
//! spans for the OTLP exporter. Unsampled requests carry no trace and cost a lock-free
//! check of the setting.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::config::Mode;
use super::export::{ExportTask, Exporter};
use super::file::TraceFile;
use super::setting::TraceSettings;

/// Triton's timestamp names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stamp {
    HttpRecvStart,
    HttpRecvEnd,
    HttpSendStart,
    HttpSendEnd,
    GrpcWaitreadStart,
    GrpcWaitreadEnd,
    GrpcSendStart,
    GrpcSendEnd,
    RequestStart,
    QueueStart,
    ComputeStart,
    ComputeInputEnd,
    ComputeOutputStart,
    ComputeEnd,
    RequestEnd,
    InferResponseComplete,
}

impl Stamp {
    pub fn name(self) -> &'static str {
        match self {
            Stamp::HttpRecvStart => "HTTP_RECV_START",
            Stamp::HttpRecvEnd => "HTTP_RECV_END",
            Stamp::HttpSendStart => "HTTP_SEND_START",
            Stamp::HttpSendEnd => "HTTP_SEND_END",
            Stamp::GrpcWaitreadStart => "GRPC_WAITREAD_START",
            Stamp::GrpcWaitreadEnd => "GRPC_WAITREAD_END",
            Stamp::GrpcSendStart => "GRPC_SEND_START",
            Stamp::GrpcSendEnd => "GRPC_SEND_END",
            Stamp::RequestStart => "REQUEST_START",
            Stamp::QueueStart => "QUEUE_START",
            Stamp::ComputeStart => "COMPUTE_START",
            Stamp::ComputeInputEnd => "COMPUTE_INPUT_END",
            Stamp::ComputeOutputStart => "COMPUTE_OUTPUT_START",
            Stamp::ComputeEnd => "COMPUTE_END",
            Stamp::RequestEnd => "REQUEST_END",
            Stamp::InferResponseComplete => "INFER_RESPONSE_COMPLETE",
        }
    }
}

/// One clock for both sinks: Triton's trace file counts nanoseconds of the monotonic clock
/// (C++'s `steady_clock`), OTLP nanoseconds since the Unix epoch.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    at: Instant,
    steady_ns: u64,
    unix_ns: u64,
}

impl Clock {
    pub fn new() -> Clock {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec for the call to fill.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        let at = Instant::now();
        let unix_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Clock {
            at,
            steady_ns: ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64,
            unix_ns,
        }
    }

    fn offset(&self, t: Instant, base: u64) -> u64 {
        match t.checked_duration_since(self.at) {
            Some(after) => base.saturating_add(after.as_nanos() as u64),
            None => base.saturating_sub(self.at.duration_since(t).as_nanos() as u64),
        }
    }

    pub fn steady(&self, t: Instant) -> u64 {
        self.offset(t, self.steady_ns)
    }

    pub fn unix(&self, t: Instant) -> u64 {
        self.offset(t, self.unix_ns)
    }
}

impl Default for Clock {
    fn default() -> Clock {
        Clock::new()
    }
}

/// A caller's W3C trace context (`traceparent`, `tracestate`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Context {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
    pub state: String,
}

impl Context {
    /// The context a `traceparent` header names (`version-traceid-parentid-flags`, lower
    /// case hex, ids not all zero), with its `tracestate` (at most 512 bytes kept, as the
    /// W3C's limit); `None` for anything malformed, which is ignored, never an error.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Context> {
        let mut parts = traceparent.trim().split('-');
        let version = hex::<1>(parts.next()?)?;
        let trace_id = hex::<16>(parts.next()?)?;
        let span_id = hex::<8>(parts.next()?)?;
        let flags = hex::<1>(parts.next()?)?;
        // Version 00 has exactly four fields; a later version may add fields after them.
        if version[0] == 0xff || (version[0] == 0 && parts.next().is_some()) {
            return None;
        }
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        let state = tracestate
            .map(str::trim)
            .filter(|s| s.len() <= 512 && s.is_ascii())
            .unwrap_or_default()
            .to_string();
        Some(Context {
            trace_id,
            span_id,
            flags: flags[0],
            state,
        })
    }
}

fn hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let bytes = s.as_bytes();
    if bytes.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// Random bytes for span and trace ids (the kernel's generator; never all zero).
fn random<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    loop {
        // SAFETY: `out` is a writable buffer of `N` bytes.
        let n = unsafe { libc::getrandom(out.as_mut_ptr().cast(), N, 0) };
        if n == N as isize && out != [0u8; N] {
            return out;
        }
    }
}

/// Where finished traces go.
enum Sink {
    File(Arc<TraceFile>),
    Otlp(Exporter),
}

/// The tracer of the server: the settings in force, where traces go, Triton's trace ids.
pub struct Tracer {
    pub settings: TraceSettings,
    sink: Option<Sink>,
    next_id: AtomicU64,
    pub clock: Clock,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Tracer {
    /// The tracer of `settings`: Triton mode writes the trace file, OpenTelemetry mode
    /// queues spans for the exporter, whose task `start_sink` starts.
    pub fn new(settings: TraceSettings) -> Tracer {
        let config = settings.config();
        let sink = match config.mode {
            Mode::Triton if !config.file.is_empty() => Some(Sink::File(Arc::new(TraceFile::new(
                config.file.clone().into(),
            )))),
            Mode::Triton => None,
            Mode::OpenTelemetry => Some(Sink::Otlp(Exporter::new(&config.otel))),
        };
        Tracer {
            settings,
            sink,
            next_id: AtomicU64::new(1),
            clock: Clock::new(),
        }
    }

    /// A tracer whose Triton mode writes to `file` (the tests' limits).
    #[cfg(test)]
    pub(crate) fn with_file(settings: TraceSettings, file: TraceFile) -> Tracer {
        Tracer {
            sink: Some(Sink::File(Arc::new(file))),
            ..Tracer::new(settings)
        }
    }

    /// Starts the sink: the exporter's task (OpenTelemetry mode); spans or traces dropped
    /// are counted in `dropped`.
    pub fn start_sink(&self, dropped: prometheus::IntCounterVec) -> Option<ExportTask> {
        match &self.sink {
            Some(Sink::Otlp(exporter)) => exporter.start(dropped),
            Some(Sink::File(file)) => {
                file.count_drops(dropped);
                None
            }
            None => None,
        }
    }

    /// A tracer that never samples (the settings' defaults, level `OFF`).
    pub fn off() -> Tracer {
        Tracer::new(TraceSettings::new(
            super::TraceFlags::default()
                .settings()
                .expect("the trace arguments' defaults are valid"),
        ))
    }

    /// The trace of a request of `model` (`version`), if the setting it goes by samples it.
    /// A caller's `context` (read only in OpenTelemetry mode, where some setting traces)
    /// makes the request's span the caller's span's child, and is sampled whatever the
    /// rate.
    pub fn start(
        self: &Arc<Self>,
        model: &str,
        version: u64,
        request_id: &str,
        context: impl FnOnce() -> Option<Context>,
    ) -> Option<Trace> {
        if !self.settings.any_on() {
            return None;
        }
        let context = match self.settings.config().mode {
            Mode::OpenTelemetry => context(),
            Mode::Triton => None,
        };
        let setting = self.settings.sample(model, context.is_some())?;
        self.sink.as_ref()?;
        let (trace_id, caller, state) = match context {
            Some(c) => (c.trace_id, Some(c.span_id), c.state),
            None => (random(), None, String::new()),
        };
        let tree = Arc::new(Tree {
            tracer: self.clone(),
            trace_id,
            state,
            caller,
            span_id: random(),
            started: Instant::now(),
            log_frequency: setting.log_frequency,
            done: Mutex::default(),
        });
        let parent_span = tree.span_id;
        Some(Trace(Arc::new(Record {
            ids: Ids {
                id: self.next_id.fetch_add(1, Ordering::Relaxed),
                parent_id: 0,
                span_id: random(),
                parent_span,
            },
            model: Model {
                name: model.to_string(),
                version,
                request_id: request_id.to_string(),
            },
            data: Mutex::default(),
            tree,
        })))
    }

    /// Sends a batch span (OpenTelemetry mode): a batch that served traced requests.
    pub fn batch(&self, batch: BatchSpan) {
        if let Some(Sink::Otlp(exporter)) = &self.sink {
            exporter.batch(self, batch);
        }
    }

    fn finish(&self, tree: &Tree, records: Vec<Finished>) {
        match &self.sink {
            Some(Sink::File(file)) => file.write(self, tree, &records),
            Some(Sink::Otlp(exporter)) => exporter.trace(self, tree, records),
            None => {}
        }
    }

    /// Writes what is still buffered (the trace file's last traces); the exporter flushes
    /// its queue on its own stop.
    pub fn flush(&self) {
        if let Some(Sink::File(file)) = &self.sink {
            file.flush();
        }
    }
}

/// A trace's ids at one model: Triton's (`id`, `parent_id`: 0 for none) and its span's.
#[derive(Debug, Clone)]
pub struct Ids {
    pub id: u64,
    pub parent_id: u64,
    pub span_id: [u8; 8],
    /// The request's span (a request's model), or the ensemble's model span (a step).
    pub parent_span: [u8; 8],
}

#[derive(Debug, Clone)]
pub struct Model {
    pub name: String,
    pub version: u64,
    pub request_id: String,
}

/// A value of an attribute.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    Text(String),
}

/// What happened at a moment, with its attributes (a row that failed, and why).
#[derive(Debug, Clone)]
pub struct Event {
    pub name: &'static str,
    pub at: Instant,
    pub attributes: Vec<(&'static str, Value)>,
}

/// What a trace records.
#[derive(Debug, Default)]
pub struct Data {
    pub stamps: Vec<(Stamp, Instant)>,
    pub events: Vec<Event>,
    pub attributes: Vec<(&'static str, Value)>,
    /// The batches its rows rode in, in the order they ran.
    pub batches: Vec<BatchTimes>,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// One request's traces, its models' and its steps': written together (Triton's trace file
/// groups a request's ids) once the last of them is done. In OpenTelemetry its
/// `InferRequest` span, the parent of its model's span, a child of the caller's.
pub(crate) struct Tree {
    tracer: Arc<Tracer>,
    pub trace_id: [u8; 16],
    pub state: String,
    /// The caller's span, from its `traceparent`.
    pub caller: Option<[u8; 8]>,
    pub span_id: [u8; 8],
    pub started: Instant,
    pub log_frequency: u32,
    done: Mutex<Vec<Finished>>,
}

impl Drop for Tree {
    fn drop(&mut self) {
        let records = std::mem::take(self.done.get_mut().unwrap_or_else(|e| e.into_inner()));
        let tracer = self.tracer.clone();
        tracer.finish(self, records);
    }
}

/// A model's trace, done.
pub(crate) struct Finished {
    pub ids: Ids,
    pub model: Model,
    pub data: Data,
}

struct Record {
    ids: Ids,
    model: Model,
    data: Mutex<Data>,
    tree: Arc<Tree>,
}

impl Record {
    fn data(&self) -> std::sync::MutexGuard<'_, Data> {
        self.data.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        let data = std::mem::take(self.data.get_mut().unwrap_or_else(|e| e.into_inner()));
        let finished = Finished {
            ids: self.ids.clone(),
            model: self.model.clone(),
            data,
        };
        self.tree
            .done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(finished);
    }
}

/// A sampled request's trace at one model; cheap to clone, finished when the last clone
/// goes.
#[derive(Clone)]
pub struct Trace(Arc<Record>);

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Trace({})", self.0.ids.id)
    }
}

impl Trace {
    /// What a link to this trace's model span names: trace id, span id, trace state.
    pub fn link(&self) -> ([u8; 16], [u8; 8], String) {
        let tree = &self.0.tree;
        (tree.trace_id, self.0.ids.span_id, tree.state.clone())
    }

    pub fn tracer(&self) -> &Arc<Tracer> {
        &self.0.tree.tracer
    }

    /// The trace of a step of this request at another model (an ensemble's step): a new
    /// Triton id whose parent is this one, its span this one's child.
    pub fn child(&self, model: &str, version: u64) -> Trace {
        let parent = &self.0;
        let tracer = &parent.tree.tracer;
        Trace(Arc::new(Record {
            ids: Ids {
                id: tracer.next_id.fetch_add(1, Ordering::Relaxed),
                parent_id: parent.ids.id,
                span_id: random(),
                parent_span: parent.ids.span_id,
            },
            model: Model {
                name: model.to_string(),
                version,
                request_id: parent.model.request_id.clone(),
            },
            data: Mutex::default(),
            tree: parent.tree.clone(),
        }))
    }

    pub fn stamp(&self, stamp: Stamp) {
        self.stamp_at(stamp, Instant::now());
    }

    pub fn stamp_at(&self, stamp: Stamp, at: Instant) {
        self.0.data().stamps.push((stamp, at));
    }

    pub fn event(&self, name: &'static str, attributes: Vec<(&'static str, Value)>) {
        self.0.data().events.push(Event {
            name,
            at: Instant::now(),
            attributes,
        });
    }

    pub fn attribute(&self, key: &'static str, value: Value) {
        self.0.data().attributes.push((key, value));
    }

    pub fn fail(&self, why: &str) {
        self.0.data().error.get_or_insert_with(|| why.to_string());
    }

    /// One batch its rows rode in.
    pub fn ran_in(&self, batch: &BatchSpan) {
        self.0.data().batches.push(batch.times);
    }
}

/// The end of a model's part of a request: `REQUEST_END`, and why it failed. Dropped
/// before `finish` (its caller went away and dropped the request), it ends the trace as
/// cancelled.
pub struct Ending(Option<Trace>);

impl Ending {
    pub fn new(trace: Option<Trace>) -> Ending {
        Ending(trace)
    }

    pub fn finish<T, E: std::fmt::Display>(mut self, result: &Result<T, E>) {
        if let Some(t) = self.0.take() {
            if let Err(e) = result {
                t.fail(&e.to_string());
            }
            t.stamp(Stamp::RequestEnd);
        }
    }
}

impl Drop for Ending {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.fail("cancelled: the caller went away");
            t.stamp(Stamp::RequestEnd);
        }
    }
}

/// A batch that served traced requests: its span links to each of them.
#[derive(Debug, Clone)]
pub struct BatchSpan {
    pub times: BatchTimes,
    pub model: String,
    pub version: u64,
    pub instance: String,
    pub requests: usize,
    /// The traced requests it served: (trace id, span id, trace state).
    pub links: Vec<([u8; 16], [u8; 8], String)>,
    pub error: Option<String>,
}

/// A new span id.
pub fn new_span_id() -> [u8; 8] {
    random()
}

impl BatchSpan {
    /// A batch's span, in a trace of its own, as it starts.
    pub fn new(model: &str, version: u64, instance: String, start: Instant) -> BatchSpan {
        BatchSpan {
            times: BatchTimes {
                trace_id: random(),
                span_id: random(),
                rows: 0,
                start,
                input_end: start,
                output_start: start,
                end: start,
            },
            model: model.to_string(),
            version,
            instance,
            requests: 0,
            links: Vec::new(),
            error: None,
        }
    }
}

/// A batch's span ids, rows and Triton's four compute timestamps.
#[derive(Debug, Clone, Copy)]
pub struct BatchTimes {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub rows: usize,
    pub start: Instant,
    pub input_end: Instant,
    pub output_start: Instant,
    pub end: Instant,
}

impl BatchTimes {
    /// Triton's compute timestamps.
    pub fn stamps(&self) -> [(Stamp, Instant); 4] {
        [
            (Stamp::ComputeStart, self.start),
            (Stamp::ComputeInputEnd, self.input_end),
            (Stamp::ComputeOutputStart, self.output_start),
            (Stamp::ComputeEnd, self.end),
        ]
    }
}

impl Data {
    /// Triton's timestamps in the order they were taken, the compute ones from the batches:
    /// one batch's four; a request whose rows rode in several batches has the earliest
    /// start and input end and the latest output start and end.
    pub fn timestamps(&self) -> Vec<(Stamp, Instant)> {
        let mut stamps = self.stamps.clone();
        let b = &self.batches;
        if let (Some(start), Some(input_end), Some(output_start), Some(end)) = (
            b.iter().map(|b| b.start).min(),
            b.iter().map(|b| b.input_end).min(),
            b.iter().map(|b| b.output_start).max(),
            b.iter().map(|b| b.end).max(),
        ) {
            stamps.extend([
                (Stamp::ComputeStart, start),
                (Stamp::ComputeInputEnd, input_end),
                (Stamp::ComputeOutputStart, output_start),
                (Stamp::ComputeEnd, end),
            ]);
        }
        // Stable: the order taken where two share an instant.
        stamps.sort_by_key(|&(_, at)| at);
        stamps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_is_read_as_the_w3c_defines_it_and_anything_else_is_ignored() {
        let c = Context::parse(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("congo=t61rcWkgMzE"),
        )
        .unwrap();
        assert_eq!(c.trace_id[0], 0x4b);
        assert_eq!(c.span_id[7], 0xb7);
        assert_eq!((c.flags, c.state.as_str()), (1, "congo=t61rcWkgMzE"));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(Context::parse(bad, None), None, "{bad}");
        }
        // A later version may carry more fields.
        assert!(Context::parse(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more",
            None
        )
        .is_some());
    }

    #[test]
    fn the_clock_counts_both_epochs_from_one_instant() {
        let clock = Clock::new();
        let later = clock.at + std::time::Duration::from_millis(5);
        assert_eq!(clock.steady(later) - clock.steady(clock.at), 5_000_000);
        assert_eq!(clock.unix(later) - clock.unix(clock.at), 5_000_000);
        assert!(clock.unix(clock.at) > 1_700_000_000 * 1_000_000_000);
    }
}
