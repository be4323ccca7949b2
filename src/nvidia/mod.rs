//! NVIDIA's libraries, opened at run time through the crate's loader (`crate::dynlib`) so
//! that the binary needs none of them to start: the CUDA driver API
//! (`driver.rs`: `libcuda.so.1` opened once for the process, one typed [`DriverError`];
//! device count, primary contexts, CUDA IPC memory), NVIDIA's management library
//! (`nvml.rs`) and nvJPEG (`nvjpeg.rs`). What is libtorch's own (its CUDA half, its CUDA
//! runtime's symbols) stays with the libtorch engine, opened through the same loader.
pub mod driver;
pub mod nvjpeg;
pub mod nvml;

pub use driver::{DriverError, DriverState};
pub use nvml::Nvml;

/// A CUDA version as CUDA encodes it (`1000 * major + 10 * minor`), as `major.minor`.
pub fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}
