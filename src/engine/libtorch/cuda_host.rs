//! libtorch's CUDA half, loaded at run time on hosts with the NVIDIA driver
//! ([`cuda_support`]); and why libtorch sees no GPU on a host whose NVIDIA driver sees
//! some: read from the CUDA driver (`nvidia::driver`) and the CUDA runtime libtorch
//! loaded. A `KIND_GPU` model then fails its load with the reason instead of running on
//! the CPU; GPUs hidden on purpose (`CUDA_VISIBLE_DEVICES=`) still fall back to the CPU.
use std::ffi::{c_char, c_int, CStr};
use std::sync::OnceLock;

use crate::dynlib::{loaded, Library};
use crate::nvidia::driver::{self, DriverState, ERROR_NO_DEVICE};
use crate::nvidia::version_text;

/// Whether libtorch's CUDA half (`libtorch_cuda.so`) is loaded.
#[derive(Debug, Clone, PartialEq)]
pub enum CudaSupport {
    Loaded,
    /// No NVIDIA driver (`libcuda.so.1`): CUDA could not run, so it is not loaded.
    NoDriver,
    /// The driver is there but `libtorch_cuda.so` did not load, or loaded without
    /// registering CUDA with libtorch: why.
    Failed(String),
}

/// Loads libtorch's CUDA half once, on a host with the NVIDIA driver, before libtorch is
/// first asked about CUDA (`cuda_device_count` calls this first; so does `main`, before
/// any other thread starts). The binary does not link `libtorch_cuda.so`: on a CPU host
/// the CUDA libraries it pulls in (cuBLASLt, NVRTC, nvJitLink, ...) held about 155 MiB
/// resident for nothing. It is opened from the directory `libtorch_cpu.so` was loaded
/// from, `RTLD_GLOBAL` as a linked library would be; its static initialisers register
/// CUDA with libtorch (hooks, device guard, kernels), as at a linked start.
pub fn cuda_support() -> &'static CudaSupport {
    static SUPPORT: OnceLock<CudaSupport> = OnceLock::new();
    SUPPORT.get_or_init(|| {
        if driver::driver().is_err() {
            return CudaSupport::NoDriver;
        }
        match open_libtorch_cuda() {
            Ok(()) => CudaSupport::Loaded,
            Err(why) => CudaSupport::Failed(why),
        }
    })
}

/// Opens `libtorch_cuda.so` from libtorch's directory (`RTLD_GLOBAL`, never closed),
/// driver or not, and checks that it registered CUDA with libtorch; `cuda_support` calls
/// it where the driver is. Before libtorch is first asked about CUDA, or its CUDA hooks
/// stay the stand-in it looked up.
pub fn open_libtorch_cuda() -> Result<(), String> {
    let path = match libtorch_dir() {
        Some(dir) => format!("{dir}/libtorch_cuda.so"),
        None => "libtorch_cuda.so".to_string(),
    };
    // Never closed: libtorch holds what it registered.
    Library::open_global(&path).map_err(|e| e.to_string())?;
    match super::cuda::cuda_registered() {
        (true, true) => Ok(()),
        (hooks, guard) => Err(format!(
            "{path} loaded but CUDA is not registered with libtorch (hooks: {hooks}, device \
             guard: {guard})"
        )),
    }
}

/// The directory the already loaded `libtorch_cpu.so` came from.
fn libtorch_dir() -> Option<String> {
    // SAFETY: RTLD_NOLOAD only looks the library up among those loaded; dlinfo's
    // RTLD_DI_ORIGIN writes a NUL-terminated directory into a buffer of PATH_MAX bytes.
    unsafe {
        let lib = libc::dlopen(
            c"libtorch_cpu.so".as_ptr(),
            libc::RTLD_LAZY | libc::RTLD_NOLOAD,
        );
        if lib.is_null() {
            return None;
        }
        let mut dir = vec![0 as c_char; libc::PATH_MAX as usize];
        let ok = libc::dlinfo(lib, libc::RTLD_DI_ORIGIN, dir.as_mut_ptr().cast()) == 0;
        libc::dlclose(lib);
        ok.then(|| CStr::from_ptr(dir.as_ptr()).to_string_lossy().into_owned())
    }
}

/// Why CUDA cannot run models here although the driver sees GPUs, from what the runtime
/// libtorch loaded (`runtime`: its CUDA version, `None` when libtorch has no CUDA) and
/// the driver said. `None`: nothing is broken (the GPUs are hidden, or there are none),
/// so `KIND_GPU` models may fall back to the CPU.
pub fn cuda_problem(runtime: Option<i32>, driver: &DriverState) -> Option<String> {
    match (runtime, driver) {
        (_, DriverState::Fails { code, .. }) if *code == ERROR_NO_DEVICE => None,
        (_, DriverState::Absent) => Some(
            "the NVIDIA driver's CUDA library (libcuda.so.1) is missing: install the \
             driver's CUDA component (in a container, the NVIDIA container toolkit)"
                .into(),
        ),
        (None, _) => Some(
            "this libtorch has no CUDA runtime (a CPU-only build, or libtorch_cuda.so did \
             not load): use a CUDA build of libtorch"
                .into(),
        ),
        (Some(_), DriverState::Fails { code, message }) => Some(format!(
            "the CUDA driver does not start: {message} (error {code})"
        )),
        (Some(runtime), DriverState::Runs { cuda }) if cuda < &runtime => Some(format!(
            "the NVIDIA driver supports CUDA {} but libtorch's CUDA runtime is {}: update the \
             driver, or use a libtorch built for CUDA {}",
            version_text(*cuda),
            version_text(runtime),
            version_text(*cuda)
        )),
        (Some(_), DriverState::Runs { .. }) => Some(
            "CUDA starts but libtorch finds no usable GPU (see the driver's log, and \
             nvidia-smi)"
                .into(),
        ),
    }
}

/// The CUDA runtime version libtorch loaded (`cudaRuntimeGetVersion` of the process),
/// `None` when no CUDA runtime is loaded.
pub fn runtime_version() -> Option<i32> {
    // SAFETY: the CUDA runtime's `cudaError_t cudaRuntimeGetVersion(int*)`.
    let get: unsafe extern "C" fn(*mut c_int) -> c_int =
        unsafe { loaded(c"cudaRuntimeGetVersion") }?;
    let mut v: c_int = 0;
    // SAFETY: an out-pointer to a local.
    (unsafe { get(&mut v) } == 0).then_some(v)
}

/// The compute capability (major, minor) of CUDA device `index`, from the CUDA runtime
/// libtorch loaded; `None` without one.
pub fn compute_capability(index: usize) -> Option<(i32, i32)> {
    // cudaDevAttrComputeCapabilityMajor and ...Minor.
    const MAJOR: c_int = 75;
    const MINOR: c_int = 76;
    // SAFETY: the CUDA runtime's
    // `cudaError_t cudaDeviceGetAttribute(int*, cudaDeviceAttr, int)`.
    let get: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int =
        unsafe { loaded(c"cudaDeviceGetAttribute") }?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    let device = c_int::try_from(index).ok()?;
    // SAFETY: out-pointers to locals.
    let read =
        unsafe { get(&mut major, MAJOR, device) == 0 && get(&mut minor, MINOR, device) == 0 };
    read.then_some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_or_absent_gpus_are_no_problem_the_rest_are_named() {
        let runs = |cuda| DriverState::Runs { cuda };
        let no_device = DriverState::Fails {
            code: ERROR_NO_DEVICE,
            message: "no CUDA-capable device is detected".into(),
        };
        // CUDA_VISIBLE_DEVICES= hides every GPU: a fallback, not a failure.
        assert_eq!(cuda_problem(Some(13000), &no_device), None);
        let old = cuda_problem(Some(13000), &runs(12080)).unwrap();
        assert!(
            old.contains("supports CUDA 12.8 but libtorch's CUDA runtime is 13.0"),
            "{old}"
        );
        let cpu_only = cuda_problem(None, &runs(13000)).unwrap();
        assert!(cpu_only.contains("no CUDA runtime"), "{cpu_only}");
        let fails = DriverState::Fails {
            code: 999,
            message: "unknown error".into(),
        };
        let broken = cuda_problem(Some(13000), &fails).unwrap();
        assert!(
            broken.contains("does not start: unknown error (error 999)"),
            "{broken}"
        );
        for runtime in [Some(13000), None] {
            assert!(cuda_problem(runtime, &DriverState::Absent)
                .unwrap()
                .contains("libcuda.so.1"));
        }
        assert!(cuda_problem(Some(12080), &runs(13000))
            .unwrap()
            .contains("no usable GPU"));
        assert_eq!(version_text(12080), "12.8");
    }
}
