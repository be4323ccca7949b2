//! Triton's trace file (`--trace-config triton,file=`): each finished request's records as
//! Triton writes them, one compact JSON array. Per model the request ran: the model record
//! (`id`, `model_name`, `model_version`, `request_id` where it has one, `parent_id` where
//! it is a step) just before its `REQUEST_START`, then one record per timestamp
//! (`{"id":N,"timestamps":[{"name":..,"ns":..}]}`), nanoseconds of the monotonic clock.
//! Requests are held in memory; with a log frequency of N every N of them go to a file of
//! their own, `<file>.0`, `<file>.1`, ...; at stop what is left goes to the next such file,
//! or (log frequency 0) into `<file>` itself.
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use super::record::{Clock, Finished, Stamp, Tracer, Tree};

pub struct TraceFile {
    path: PathBuf,
    inner: Mutex<Buffered>,
}

#[derive(Default)]
struct Buffered {
    /// The requests held, each its records joined by commas.
    traces: Vec<String>,
    /// The log frequency the last request was sampled with.
    log_frequency: u32,
    /// The next numbered file.
    next_index: u64,
    /// Whether `<file>` was written (it is written once, at stop).
    flushed: bool,
    /// Numbered files being written, each on a thread of its own (never on the thread
    /// that finished the request).
    writing: Vec<std::thread::JoinHandle<()>>,
}

impl TraceFile {
    pub fn new(path: PathBuf) -> TraceFile {
        TraceFile {
            path,
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Buffered> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn write(&self, tracer: &Tracer, tree: &Tree, records: &[Finished]) {
        let text = records_json(&tracer.clock, records);
        let mut b = self.lock();
        b.traces.push(text);
        b.log_frequency = tree.log_frequency;
        if b.log_frequency > 0 && b.traces.len() >= b.log_frequency as usize {
            self.numbered(&mut b);
        }
    }

    /// The held requests into the next numbered file.
    fn numbered(&self, b: &mut Buffered) {
        let mut name = self.path.clone().into_os_string();
        name.push(format!(".{}", b.next_index));
        b.next_index += 1;
        let traces = std::mem::take(&mut b.traces);
        let path = PathBuf::from(name);
        b.writing.retain(|w| !w.is_finished());
        let writer = std::thread::Builder::new()
            .name("trace-file".into())
            .spawn(move || save(&path, &traces));
        match writer {
            Ok(w) => b.writing.push(w),
            Err(e) => tracing::error!(error = %e, "cannot start the trace file's writer"),
        }
    }

    /// At stop: what is held goes to the next numbered file, or into the trace file; then
    /// every file is written.
    pub fn flush(&self) {
        let mut b = self.lock();
        if !b.traces.is_empty() {
            if b.log_frequency > 0 {
                self.numbered(&mut b);
            } else if !b.flushed {
                b.flushed = true;
                let traces = std::mem::take(&mut b.traces);
                save(&self.path, &traces);
            }
        }
        for writer in std::mem::take(&mut b.writing) {
            let _ = writer.join();
        }
    }
}

fn save(path: &PathBuf, traces: &[String]) {
    let written = std::fs::File::create(path).and_then(|mut f| {
        write!(f, "[{}]", traces.join(","))?;
        f.sync_data()
    });
    if let Err(e) = written {
        tracing::error!(file = %path.display(), error = %e, "cannot write the trace file");
    }
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

    fn tracer(file: &std::path::Path, more: &[&str]) -> Arc<Tracer> {
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
        Arc::new(Tracer::new(TraceSettings::new(flags.settings().unwrap())))
    }

    #[test]
    fn a_requests_records_are_written_as_triton_writes_them() {
        let dir = std::env::temp_dir().join(format!("vg-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("trace.json");
        let tracer = tracer(&file, &[]);
        let top = tracer.start("ensemble", 1, "r\"1", || None).unwrap();
        top.stamp(Stamp::HttpRecvStart);
        top.stamp(Stamp::RequestStart);
        let step = top.child("classifier", 3);
        step.stamp(Stamp::RequestStart);
        step.stamp(Stamp::RequestEnd);
        top.stamp(Stamp::RequestEnd);
        drop((top, step));
        // Held until the stop.
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
        let dir = std::env::temp_dir().join(format!("vg-trace-freq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("t.json");
        let tracer = tracer(&file, &["triton,log-frequency=2"]);
        for _ in 0..5 {
            let t = tracer.start("m", 1, "", || None).unwrap();
            t.stamp(Stamp::RequestStart);
        }
        let ids = |name: &str| -> Vec<u64> {
            let text = std::fs::read_to_string(dir.join(name)).unwrap();
            let records: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
            let mut ids: Vec<u64> = records.iter().map(|r| r["id"].as_u64().unwrap()).collect();
            ids.dedup();
            ids
        };
        tracer.flush();
        assert_eq!(ids("t.json.0"), vec![1, 2]);
        assert_eq!(ids("t.json.1"), vec![3, 4]);
        assert_eq!(ids("t.json.2"), vec![5]);
        assert!(!file.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
