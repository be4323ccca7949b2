//! The forms of visiongate's arguments as `tritonserver` spells them (`triton.rs`):
//! booleans, addresses, levels, sizes, and Triton's arguments that have no effect here. Each
//! flag group is defined and checked beside what it sets (`grpc::GrpcFlags`,
//! `state::ControlFlags`...); `settings::Config` is the whole command line.
mod triton;

pub use triton::{address, boolean, cache_size, config_name, verbosity, LogFormat, NoEffect};

use crate::domain::Precision;

/// The longest timeout or interval a flag may set, in seconds.
pub const DAY_SECS: u64 = 86_400;

/// `--precision` (any case, as the config parameter).
pub fn precision(value: &str) -> Result<Precision, String> {
    Precision::parse(value).ok_or_else(|| format!("'{value}': expected fp32, bf16 or fp16"))
}
