//! libtorch's CUDA half is not linked (on a CPU host its CUDA libraries held about 155 MiB
//! resident): the binary opens `libtorch_cuda.so` at run time where the NVIDIA driver is.
//! Here, without a GPU: nothing of CUDA is mapped at first, and once opened the way a GPU
//! host opens it, CUDA is registered with libtorch (its hooks and device guard) and asking
//! for devices answers 0 instead of failing. One test in its own binary: libtorch looks its
//! CUDA hooks up once per process.
use visiongate::engine::cuda_device_count;
use visiongate::engine::libtorch::{cuda, cuda_host};

/// Whether a mapped file's path holds `part`.
fn mapped(part: &str) -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .any(|l| l.contains(part))
}

#[test]
fn libtorch_cuda_opened_at_run_time_registers_cuda_with_libtorch() {
    assert!(mapped("/libtorch_cpu.so"), "libtorch is linked");
    assert!(
        !mapped("/libtorch_cuda.so") && !mapped("/libcublas"),
        "nothing of CUDA is loaded before it is asked for"
    );
    let driver = visiongate::nvidia::driver::state() != visiongate::nvidia::DriverState::Absent;
    if let Err(why) = cuda_host::open_libtorch_cuda() {
        // A CPU-only libtorch has no CUDA half to open: not run here. CI's libtorch (the
        // PyPI wheel setup installs) has one.
        assert!(why.contains("libtorch_cuda.so"), "{why}");
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI's libtorch must have its CUDA half: {why}"
        );
        // Past the test harness's capture, so that it shows among passing tests.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "NOT RUN: libtorch's CUDA half needs a libtorch that has one ({why})"
        );
        return;
    }
    assert!(mapped("/libtorch_cuda.so"));
    assert_eq!(
        cuda::cuda_registered(),
        (true, true),
        "hooks and device guard"
    );
    if driver {
        assert_eq!(*cuda_host::cuda_support(), cuda_host::CudaSupport::Loaded);
    } else {
        assert_eq!(cuda_device_count(), 0);
        assert_eq!(*cuda_host::cuda_support(), cuda_host::CudaSupport::NoDriver);
    }
}
