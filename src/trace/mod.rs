//! Request tracing as Triton does it: `--trace-config` (`config`), the trace settings in
//! force and which requests they sample (`setting`), Triton's trace extension over HTTP and
//! gRPC (`api`); the traces of sampled requests (`record`), written to Triton's trace file
//! (`file`) or sent to an OpenTelemetry collector (`export`, over `otlp`'s messages).
pub mod api;
pub mod config;
pub mod export;
pub mod file;
pub mod otlp;
pub mod record;
pub mod setting;

pub use config::{Level, Mode, TraceConfig, TraceFlags};
pub use record::{BatchSpan, Context, Ending, Stamp, Trace, Tracer, Value};
pub use setting::TraceSettings;
