//! Why libtorch sees no GPU on a host whose NVIDIA driver sees some: read from the CUDA
//! driver (`libcuda.so.1`, loaded at run time) and the CUDA runtime libtorch loaded. A
//! `KIND_GPU` model then fails its load with the reason instead of running on the CPU;
//! GPUs hidden on purpose (`CUDA_VISIBLE_DEVICES=`) still fall back to the CPU.
use std::ffi::{c_char, c_int, c_uint, CStr};

/// CUDA's `CUDA_ERROR_NO_DEVICE`: the driver runs and sees no (visible) GPU.
const CUDA_ERROR_NO_DEVICE: c_int = 100;

/// A CUDA version as CUDA encodes it (`1000 * major + 10 * minor`), as `major.minor`.
pub fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// What the CUDA driver said when started: its CUDA version, or its error.
#[derive(Debug, Clone, PartialEq)]
pub enum DriverState {
    /// `cuInit` succeeded; the newest CUDA version the driver supports.
    Runs { cuda: i32 },
    /// `cuInit` failed with this code and message.
    Fails { code: i32, message: String },
    /// No `libcuda.so.1`.
    Absent,
}

/// Why CUDA cannot run models here although the driver sees GPUs, from what the runtime
/// libtorch loaded (`runtime`: its CUDA version, `None` when libtorch has no CUDA) and
/// the driver said. `None`: nothing is broken (the GPUs are hidden, or there are none),
/// so `KIND_GPU` models may fall back to the CPU.
pub fn cuda_problem(runtime: Option<i32>, driver: &DriverState) -> Option<String> {
    match (runtime, driver) {
        (_, DriverState::Fails { code, .. }) if *code == CUDA_ERROR_NO_DEVICE => None,
        (None, _) => Some(
            "this libtorch has no CUDA runtime (a CPU-only build, or libtorch_cuda.so did \
             not load): use a CUDA build of libtorch"
                .into(),
        ),
        (Some(_), DriverState::Absent) => Some(
            "the NVIDIA driver's CUDA library (libcuda.so.1) is missing: install the \
             driver's CUDA component (in a container, the NVIDIA container toolkit)"
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
    // SAFETY: looks a symbol up among the libraries the process has loaded; if found, it
    // has the CUDA runtime's signature `cudaError_t cudaRuntimeGetVersion(int*)`.
    unsafe {
        let sym = libc::dlsym(libc::RTLD_DEFAULT, c"cudaRuntimeGetVersion".as_ptr());
        if sym.is_null() {
            return None;
        }
        let get: unsafe extern "C" fn(*mut c_int) -> c_int = std::mem::transmute(sym);
        let mut v: c_int = 0;
        (get(&mut v) == 0).then_some(v)
    }
}

/// The compute capability (major, minor) of CUDA device `index`, from the CUDA runtime
/// libtorch loaded; `None` without one.
pub fn compute_capability(index: usize) -> Option<(i32, i32)> {
    // cudaDevAttrComputeCapabilityMajor and ...Minor.
    const MAJOR: c_int = 75;
    const MINOR: c_int = 76;
    // SAFETY: as in `runtime_version`; the symbol has the runtime's signature
    // `cudaError_t cudaDeviceGetAttribute(int*, cudaDeviceAttr, int)`.
    unsafe {
        let sym = libc::dlsym(libc::RTLD_DEFAULT, c"cudaDeviceGetAttribute".as_ptr());
        if sym.is_null() {
            return None;
        }
        let get: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int = std::mem::transmute(sym);
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        let device = c_int::try_from(index).ok()?;
        (get(&mut major, MAJOR, device) == 0 && get(&mut minor, MINOR, device) == 0)
            .then_some((major, minor))
    }
}

/// Starts the CUDA driver (`cuInit`) and reads its CUDA version.
pub fn driver_state() -> DriverState {
    // SAFETY: dlopen/dlsym with constant names; the symbols have the driver API's
    // signatures (`CUresult cuInit(unsigned)`, `cuDriverGetVersion(int*)`,
    // `cuGetErrorString(CUresult, const char**)`). The library stays loaded: libtorch
    // uses it too.
    unsafe {
        let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
        if lib.is_null() {
            return DriverState::Absent;
        }
        let sym = |name: &CStr| libc::dlsym(lib, name.as_ptr());
        let (init, version, error) = (
            sym(c"cuInit"),
            sym(c"cuDriverGetVersion"),
            sym(c"cuGetErrorString"),
        );
        if init.is_null() || version.is_null() {
            return DriverState::Absent;
        }
        let init: unsafe extern "C" fn(c_uint) -> c_int = std::mem::transmute(init);
        let code = init(0);
        if code != 0 {
            let mut text: *const c_char = std::ptr::null();
            if !error.is_null() {
                let error: unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int =
                    std::mem::transmute(error);
                error(code, &mut text);
            }
            let message = if text.is_null() {
                "unknown error".to_string()
            } else {
                CStr::from_ptr(text).to_string_lossy().into_owned()
            };
            return DriverState::Fails { code, message };
        }
        let version: unsafe extern "C" fn(*mut c_int) -> c_int = std::mem::transmute(version);
        let mut cuda: c_int = 0;
        version(&mut cuda);
        DriverState::Runs { cuda }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_or_absent_gpus_are_no_problem_the_rest_are_named() {
        let runs = |cuda| DriverState::Runs { cuda };
        let no_device = DriverState::Fails {
            code: CUDA_ERROR_NO_DEVICE,
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
        assert!(cuda_problem(Some(13000), &DriverState::Absent)
            .unwrap()
            .contains("libcuda.so.1"));
        assert!(cuda_problem(Some(12080), &runs(13000))
            .unwrap()
            .contains("no usable GPU"));
        assert_eq!(version_text(12080), "12.8");
    }
}
