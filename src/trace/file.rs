//! Triton's trace file (`--trace-config triton,file=`): each finished request's records as
//! Triton writes them, one compact JSON array. Per model the request ran: the model record
//! (`id`, `model_name`, `model_version`, `request_id` where it has one, `parent_id` where
//! it is a step) just before its `REQUEST_START`, then one record per timestamp
//! (`{"id":N,"timestamps":[{"name":..,"ns":..}]}`), nanoseconds of the monotonic clock.
//!
//! With a log frequency of N every N requests go to a file of their own, `<file>.0`,
//! `<file>.1`, ...; at stop what is left goes to the next such file. With log frequency 0
//! (Triton's default) they go into `<file>` itself. Triton holds a file's traces in memory
//! until the file is due (with log frequency 0: until its stop); here they are written as
//! they come, a MiB of records at a time, each array closed when its file is complete (`<file>`'s
//! at stop), so a server that traces every request for days holds about a MiB, not all of
//! them. One writer thread, for `<file>` and its numbered files alike, does the writing,
//! never a request's thread; at most 64 MiB of records wait for it: past that (a disk
//! slower than the traces) a request's records are dropped and counted
//! (`visiongate_trace_spans_dropped_total{reason="queue_full"}`).
use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use prometheus::IntCounterVec;

use super::record::{Clock, Finished, Stamp, Tracer, Tree};

/// Records handed to the writer at a time.
const CHUNK_BYTES: usize = 1 << 20;
/// Records waiting for the writer, at most.
const HELD_LIMIT: usize = 64 << 20;

pub struct TraceFile {
    path: PathBuf,
    chunk_bytes: usize,
    held_limit: usize,
    inner: Mutex<Buffered>,
    /// The writer waits here for work.
    work: Condvar,
    dropped: OnceLock<IntCounterVec>,
}

#[derive(Default)]
struct Buffered {
    /// Requests not yet handed to the writer, each its records joined by commas.
    pending: Vec<String>,
    pending_bytes: usize,
    /// Bytes of records pending or queued for the writer.
    held: usize,
    /// The log frequency the last request was sampled with.
    log_frequency: u32,
    /// The numbered file being filled: its index and the requests handed to it so far.
    numbered: Option<(u64, usize)>,
    next_index: u64,
    queue: VecDeque<Chunk>,
    stopping: bool,
    /// Whether a request's records were dropped (logged once).
    dropped_any: bool,
    writer: Option<std::thread::JoinHandle<()>>,
    /// Whether the writer thread could not be started (logged once; the stop writes).
    no_writer: bool,
}

/// Requests' records for the writer: appended to the array in `path`, which `last` closes.
struct Chunk {
    path: PathBuf,
    traces: Vec<String>,
    /// What its traces count in `held`.
    bytes: usize,
    last: bool,
}

impl TraceFile {
    pub fn new(path: PathBuf) -> TraceFile {
        TraceFile::with_limits(path, CHUNK_BYTES, HELD_LIMIT)
    }

    pub(crate) fn with_limits(path: PathBuf, chunk_bytes: usize, held_limit: usize) -> TraceFile {
        TraceFile {
            path,
            chunk_bytes,
            held_limit,
            inner: Mutex::default(),
            work: Condvar::new(),
            dropped: OnceLock::new(),
        }
    }

    /// Counts the requests whose records were dropped in `dropped`.
    pub fn count_drops(&self, dropped: IntCounterVec) {
        let _ = self.dropped.set(dropped);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Buffered> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn write(self: &Arc<Self>, tracer: &Tracer, tree: &Tree, records: &[Finished]) {
        let text = records_json(&tracer.clock, records);
        let bytes = text.len() + 1;
        let mut b = self.lock();
        if b.stopping {
            tracing::debug!("a trace finished after the stop was not written");
            return;
        }
        if b.held + bytes > self.held_limit {
            let first = !std::mem::replace(&mut b.dropped_any, true);
            drop(b);
            if first {
                tracing::warn!(
                    file = %self.path.display(),
                    "the trace file's writer is behind: requests' traces are dropped (counted \
                     in visiongate_trace_spans_dropped_total)"
                );
            }
            if let Some(dropped) = self.dropped.get() {
                dropped.with_label_values(&["queue_full"]).inc();
            }
            return;
        }
        b.held += bytes;
        b.pending_bytes += bytes;
        b.pending.push(text);
        b.log_frequency = tree.log_frequency;
        let frequency = b.log_frequency as usize;
        let in_file = b.numbered.map_or(0, |(_, n)| n) + b.pending.len();
        if frequency > 0 && in_file >= frequency {
            self.hand_over(&mut b, true);
        } else if b.pending_bytes >= self.chunk_bytes {
            self.hand_over(&mut b, false);
        }
    }

    /// The pending requests to the writer (started at the first chunk): onto the numbered file
    /// being filled (`last`: which they complete), or onto `<file>` (log frequency 0).
    fn hand_over(self: &Arc<Self>, b: &mut Buffered, last: bool) {
        if b.pending.is_empty() {
            return;
        }
        let traces = std::mem::take(&mut b.pending);
        let bytes = std::mem::take(&mut b.pending_bytes);
        let chunk = if b.log_frequency > 0 {
            let (index, handed) = match b.numbered {
                Some(filling) => filling,
                None => {
                    b.next_index += 1;
                    (b.next_index - 1, 0)
                }
            };
            b.numbered = (!last).then_some((index, handed + traces.len()));
            let mut name = self.path.clone().into_os_string();
            name.push(format!(".{index}"));
            Chunk {
                path: PathBuf::from(name),
                traces,
                bytes,
                last,
            }
        } else {
            // A numbered file left part-filled by a change of log frequency is closed by the
            // writer as it turns to `<file>`; `<file>` is closed at stop.
            b.numbered = None;
            Chunk {
                path: self.path.clone(),
                traces,
                bytes,
                last: false,
            }
        };
        b.queue.push_back(chunk);
        if b.writer.is_none() && !b.no_writer {
            let file = self.clone();
            match std::thread::Builder::new()
                .name("trace-file".into())
                .spawn(move || file.writer())
            {
                Ok(w) => b.writer = Some(w),
                Err(e) => {
                    b.no_writer = true;
                    tracing::error!(error = %e, "cannot start the trace file's writer: traces are written at stop");
                }
            }
        }
        self.work.notify_one();
    }

    /// The writer: each chunk in turn, until the stop has queued its last; then it closes the
    /// arrays still open.
    fn writer(&self) {
        // `<file>`'s array is open; the numbered file whose array is open.
        let mut main_open = false;
        let mut numbered_open: Option<PathBuf> = None;
        loop {
            let chunk = {
                let mut b = self.lock();
                loop {
                    if let Some(chunk) = b.queue.pop_front() {
                        break Some(chunk);
                    }
                    if b.stopping {
                        break None;
                    }
                    b = self.work.wait(b).unwrap_or_else(|e| e.into_inner());
                }
            };
            let Some(chunk) = chunk else {
                if let Some(open) = numbered_open {
                    close(&open);
                }
                if main_open {
                    close(&self.path);
                }
                return;
            };
            let bytes = chunk.bytes;
            let text = chunk.traces.join(",");
            let is_main = chunk.path == self.path;
            // A numbered file part-filled when the log frequency changed is complete.
            if numbered_open.as_ref().is_some_and(|p| *p != chunk.path) {
                if let Some(done) = numbered_open.take() {
                    close(&done);
                }
            }
            let continues = if is_main {
                main_open
            } else {
                numbered_open.is_some()
            };
            if continues {
                append(&chunk.path, &format!(",{text}"));
            } else {
                start(&chunk.path, &text);
            }
            if is_main {
                main_open = true;
            } else if chunk.last {
                close(&chunk.path);
                numbered_open = None;
            } else {
                numbered_open = Some(chunk.path);
            }
            let mut b = self.lock();
            b.held = b.held.saturating_sub(bytes);
        }
    }

    /// At stop: what is pending goes onto the numbered file being filled or onto `<file>`,
    /// and every open array is closed; returns once everything is written.
    pub fn flush(self: &Arc<Self>) {
        let writer = {
            let mut b = self.lock();
            if b.stopping {
                return;
            }
            self.hand_over(&mut b, true);
            b.stopping = true;
            self.work.notify_one();
            b.writer.take()
        };
        match writer {
            Some(writer) => {
                let _ = writer.join();
            }
            // No thread could be started: the queue is written here.
            None => self.writer(),
        }
    }
}

/// A new file holding `[` and `text`.
fn start(path: &Path, text: &str) {
    let written = File::create(path).and_then(|mut f| f.write_all(format!("[{text}").as_bytes()));
    if let Err(e) = written {
        tracing::error!(file = %path.display(), error = %e, "cannot write the trace file");
    }
}

/// The array in `path` closed, and the file on disk.
fn close(path: &Path) {
    if let Some(f) = append(path, "]") {
        let _ = f.sync_all();
    }
}

fn append(path: &Path, text: &str) -> Option<File> {
    let written = OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut f| {
            f.write_all(text.as_bytes())?;
            Ok(f)
        });
    written
        .map_err(
            |e| tracing::error!(file = %path.display(), error = %e, "cannot write the trace file"),
        )
        .ok()
}

/// A request's records: per model, its model record before its `REQUEST_START`, then its
/// timestamps, each a record of its own.
fn records_json(clock: &Clock, records: &[Finished]) -> String {
    let mut out = Vec::new();
    let mut sorted: Vec<&Finished> = records.iter().collect();
    sorted.sort_by_key(|r| r.ids.id);
    for r in sorted {
        let id = r.ids.id;
        // Triton's key order.
        let text = |s: &str| serde_json::Value::from(s).to_string();
        let mut header = format!(
            r#"{{"id":{id},"model_name":{},"model_version":{}"#,
            text(&r.model.name),
            r.model.version
        );
        if !r.model.request_id.is_empty() {
            header.push_str(&format!(r#","request_id":{}"#, text(&r.model.request_id)));
        }
        if r.ids.parent_id != 0 {
            header.push_str(&format!(r#","parent_id":{}"#, r.ids.parent_id));
        }
        header.push('}');
        let stamps = r.data.timestamps();
        let mut header = Some(header);
        for (stamp, at) in stamps {
            if stamp == Stamp::RequestStart {
                out.extend(header.take());
            }
            out.push(format!(
                r#"{{"id":{id},"timestamps":[{{"name":"{}","ns":{}}}]}}"#,
                stamp.name(),
                clock.steady(at)
            ));
        }
        out.extend(header);
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::{Stamp, TraceFlags, TraceSettings, Tracer};
    use super::TraceFile;

    fn settings(file: &std::path::Path, more: &[&str]) -> TraceSettings {
        let mut args = vec![
            format!("triton,file={}", file.display()),
            "level=TIMESTAMPS".to_string(),
            "rate=1".to_string(),
        ];
        args.extend(more.iter().map(|s| s.to_string()));
        let flags = TraceFlags {
            trace_config: args,
            ..TraceFlags::default()
        };
        TraceSettings::new(flags.settings().unwrap())
    }

    fn tracer(file: &std::path::Path, more: &[&str]) -> Arc<Tracer> {
        Arc::new(Tracer::new(settings(file, more)))
    }

    /// `n` requests of one model, each finished at once.
    fn requests(tracer: &Arc<Tracer>, n: usize) {
        for _ in 0..n {
            let t = tracer.start("m", 1, "", || None).unwrap();
            t.stamp(Stamp::RequestStart);
        }
    }

    /// A fresh directory of this test's own, and the trace file's path in it.
    fn scratch(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("vg-trace-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("t.json");
        (dir, file)
    }

    /// A tracer writing to `file` with the given limits.
    fn limited(file: &std::path::Path, more: &[&str], chunk: usize, held: usize) -> Arc<Tracer> {
        Arc::new(Tracer::with_file(
            settings(file, more),
            TraceFile::with_limits(file.to_path_buf(), chunk, held),
        ))
    }

    /// The text of `path` once it holds `n` requests' `REQUEST_START`s (within 10 s).
    fn once_written(path: &std::path::Path, n: usize) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            if text.matches(r#""REQUEST_START""#).count() >= n {
                return text;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "written so far: {text}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// The drop counter `tracer`'s file counts in.
    fn dropped(tracer: &Tracer) -> prometheus::IntCounterVec {
        let dropped = prometheus::IntCounterVec::new(
            prometheus::Opts::new("dropped", "dropped"),
            &["reason"],
        )
        .unwrap();
        assert!(tracer.start_sink(dropped.clone()).is_none());
        dropped
    }

    fn ids(text: &str) -> Vec<u64> {
        let records: Vec<serde_json::Value> = serde_json::from_str(text).unwrap();
        let mut ids: Vec<u64> = records.iter().map(|r| r["id"].as_u64().unwrap()).collect();
        ids.dedup();
        ids
    }

    #[test]
    fn without_a_log_frequency_requests_are_appended_as_they_come_and_closed_at_stop() {
        let (dir, file) = scratch("append");
        // Every request handed to the writer at once.
        let tracer = limited(&file, &[], 1, 1 << 20);
        requests(&tracer, 3);
        let written = once_written(&file, 3);
        // On disk before the stop, the array still open.
        assert!(written.starts_with('[') && !written.ends_with(']'));
        tracer.flush();
        assert_eq!(ids(&std::fs::read_to_string(&file).unwrap()), vec![1, 2, 3]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn records_past_what_the_writer_may_hold_are_dropped_and_counted() {
        let (dir, file) = scratch("held");
        // Less than one request's records may wait for the writer.
        let tracer = limited(&file, &[], 1 << 20, 10);
        let dropped = dropped(&tracer);
        requests(&tracer, 2);
        tracer.flush();
        assert_eq!(dropped.with_label_values(&["queue_full"]).get(), 2);
        assert!(!file.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_stalled_disk_holds_no_request_up_and_no_more_than_the_limit() {
        use std::io::Read;
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::OpenOptionsExt;
        let (dir, file) = scratch("stalled");
        // A FIFO nobody reads yet: the writer blocks opening it, as on a disk that stalls.
        let c_path = std::ffi::CString::new(file.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        // Well inside a pipe's smallest buffer (a page), so the stop's writes never block.
        const HELD: usize = 2048;
        // Each request handed to the writer at once.
        let tracer = limited(&file, &[], 1, HELD);
        let dropped = dropped(&tracer);
        // Four threads of requests go on and finish while the writer is stuck.
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| requests(&tracer, 250));
            }
        });
        let dropped = dropped.with_label_values(&["queue_full"]).get() as usize;
        assert!(dropped > 0 && dropped < 1000, "{dropped} of 1000 dropped");
        // The disk is back: a reader (which also holds the FIFO open for writing, so it never
        // ends).
        let mut fifo = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&file)
            .unwrap();
        tracer.flush();
        let mut bytes = Vec::new();
        if let Err(e) = fifo.read_to_end(&mut bytes) {
            assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
        }
        let text = String::from_utf8(bytes).unwrap();
        // "[", each request's records and a comma or the closing "]": what was held, plus one.
        assert!(text.len() <= HELD + 1, "{} bytes written", text.len());
        let mut ids = ids(&text);
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 1000 - dropped, "every request held is written");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_requests_records_are_written_as_triton_writes_them() {
        let (dir, file) = scratch("format");
        let tracer = tracer(&file, &[]);
        let top = tracer.start("ensemble", 1, "r\"1", || None).unwrap();
        top.stamp(Stamp::HttpRecvStart);
        top.stamp(Stamp::RequestStart);
        let step = top.child("classifier", 3);
        step.stamp(Stamp::RequestStart);
        step.stamp(Stamp::RequestEnd);
        top.stamp(Stamp::RequestEnd);
        drop((top, step));
        // Held until the stop (less than a MiB of records).
        assert!(!file.exists());
        tracer.flush();
        let text = std::fs::read_to_string(&file).unwrap();
        let records: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
        let shapes: Vec<String> = records
            .iter()
            .map(|r| match r.get("timestamps") {
                Some(t) => format!("{}:{}", r["id"], t[0]["name"].as_str().unwrap()),
                None => format!("{}:header", r["id"]),
            })
            .collect();
        assert_eq!(
            shapes,
            [
                "1:HTTP_RECV_START",
                "1:header",
                "1:REQUEST_START",
                "1:REQUEST_END",
                "2:header",
                "2:REQUEST_START",
                "2:REQUEST_END"
            ]
        );
        // Triton's key order, the request id escaped, the parent where it is a step.
        assert!(text
            .contains(r#"{"id":1,"model_name":"ensemble","model_version":1,"request_id":"r\"1"}"#));
        assert!(text.contains(
            r#"{"id":2,"model_name":"classifier","model_version":3,"request_id":"r\"1","parent_id":1}"#
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_log_frequency_writes_numbered_files_and_the_rest_at_stop() {
        let (dir, file) = scratch("freq");
        let tracer = tracer(&file, &["triton,log-frequency=2"]);
        requests(&tracer, 5);
        tracer.flush();
        let ids = |name: &str| ids(&std::fs::read_to_string(dir.join(name)).unwrap());
        assert_eq!(ids("t.json.0"), vec![1, 2]);
        assert_eq!(ids("t.json.1"), vec![3, 4]);
        assert_eq!(ids("t.json.2"), vec![5]);
        assert!(!file.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_numbered_file_is_written_as_it_fills_and_closed_when_full() {
        let (dir, file) = scratch("fill");
        // Every request handed to the writer at once.
        let tracer = limited(&file, &["triton,log-frequency=3"], 1, 1 << 20);
        requests(&tracer, 5);
        let second = dir.join("t.json.1");
        once_written(&second, 2);
        // The first is complete; the second open until the stop.
        assert_eq!(
            ids(&std::fs::read_to_string(dir.join("t.json.0")).unwrap()),
            vec![1, 2, 3]
        );
        assert!(!std::fs::read_to_string(&second).unwrap().ends_with(']'));
        tracer.flush();
        assert_eq!(ids(&std::fs::read_to_string(&second).unwrap()), vec![4, 5]);
        assert!(!file.exists() && !dir.join("t.json.2").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
