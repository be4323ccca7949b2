//! Request tracing as Triton does it: `--trace-config` (`config`), the trace settings in
//! force and which requests they sample (`setting`), and Triton's trace extension over
//! HTTP and gRPC (`api`).
pub mod api;
pub mod config;
pub mod setting;

pub use config::{Level, Mode, TraceConfig, TraceFlags};
pub use setting::TraceSettings;
