//! torch.export packages (`.pt2`, Triton's platform `torch_aoti`) through libtorch's
//! AOTInductor package loader (`aoti_shim.cpp`, built by build.rs), which reads the package
//! as `package.rs` checked and unpacked it. A package is compiled
//! code for one device kind and CPU instruction set, and checks nothing of its input when
//! it runs: what it was built for and the batch range it was exported with are read from
//! its metadata and checked against the instance and the config before it loads, and each
//! batch against them before it runs.
use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_int, c_void, CStr, CString};

use tch::Tensor;

use crate::engine::{EngineError, EngineSpec, FileErrors};

extern "C" {
    fn vg_aoti_last_error() -> *const c_char;
    fn vg_torch_version() -> *const c_char;
    fn vg_aoti_load(
        path: *const c_char,
        device_index: c_int,
        stub: *const u8,
        stub_len: usize,
    ) -> *mut c_void;
    fn vg_aoti_free(package: *mut c_void);
    fn vg_aoti_run(
        package: *mut c_void,
        input: *const torch_sys::C_tensor,
    ) -> *mut torch_sys::C_tensor;
}

/// Metadata keys visiongate's exporter writes (`aot_inductor.metadata`) and reads here; a
/// user's package may carry them too (docs/model-repository.md).
/// The name AOTInductor gives the model inside every package it writes.
const MODEL: &str = "model";
const TORCH_VERSION: &str = "torch_version";
const BATCH_MIN: &str = "batch_min";
const BATCH_MAX: &str = "batch_max";
const INPUT_SHAPE: &str = "input_shape";

/// An empty library named `libtorch.so` (build.rs), which a package's compiled model names.
static LIBTORCH_STUB: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libtorch_stub.so"));

fn last_error() -> String {
    // SAFETY: a NUL-terminated string owned by this thread, valid until its next call into
    // the shim; copied out at once.
    unsafe { CStr::from_ptr(vg_aoti_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// The libtorch version this binary runs on, e.g. "2.13.0".
pub fn torch_version() -> String {
    // SAFETY: a static NUL-terminated string.
    unsafe { CStr::from_ptr(vg_torch_version()) }
        .to_string_lossy()
        .into_owned()
}

/// One loaded package, run by the instance thread that owns it.
pub struct Package {
    handle: *mut c_void,
    /// The batch sizes it was exported for (`None`: the package does not say).
    batches: Option<(usize, usize)>,
    /// The files the loader reads, removed once it is freed.
    _unpacked: super::package::Unpacked,
}

// SAFETY: the loader is used by one thread at a time (its engine's owner); libtorch's
// loader has no thread affinity (its runner is itself safe to call from any thread).
unsafe impl Send for Package {}

impl Drop for Package {
    fn drop(&mut self) {
        // SAFETY: made by vg_aoti_load, freed once.
        unsafe { vg_aoti_free(self.handle) }
    }
}

impl Package {
    /// `spec`'s package on CUDA device `gpu` or the CPU, after its metadata is checked
    /// against that device, this CPU, this libtorch and the config's batch and input.
    pub fn load(
        spec: &EngineSpec,
        gpu: Option<u32>,
        errors: &FileErrors,
    ) -> Result<Self, EngineError> {
        // The zip's directory and the metadata are checked before anything is unpacked.
        let mut package = super::package::open(&spec.file).map_err(|e| errors.error(e))?;
        let metadata = package.metadata(MODEL).map_err(|e| errors.error(e))?;
        let batches = check_metadata(&metadata, spec, gpu).map_err(|e| errors.error(e))?;
        if batches.is_none() {
            tracing::warn!(
                model = errors.shown(),
                "the package does not record the batch sizes it was exported for ({BATCH_MIN}, \
                 {BATCH_MAX} in aot_inductor.metadata): the config's max_batch_size is trusted"
            );
        }
        let unpacked = package.unpack().map_err(|e| errors.error(e))?;
        let path = CString::new(unpacked.dir.as_os_str().as_encoded_bytes())
            .map_err(|_| errors.error("the temporary directory's path holds a NUL byte"))?;
        let index = gpu.map_or(-1, |i| i as c_int);
        // SAFETY: `path` is NUL-terminated and the stub is a static byte slice; a null
        // result is a failure the shim describes.
        let handle = unsafe {
            vg_aoti_load(
                path.as_ptr(),
                index,
                LIBTORCH_STUB.as_ptr(),
                LIBTORCH_STUB.len(),
            )
        };
        if handle.is_null() {
            return Err(errors.error(last_error()));
        }
        Ok(Package {
            handle,
            batches,
            _unpacked: unpacked,
        })
    }

    /// The model's output for `input` (FP32 `[N, 3, H, W]`, contiguous, on its device).
    pub fn run(&self, input: &Tensor) -> Result<Tensor, tch::TchError> {
        let rows = input.size().first().copied().unwrap_or(0) as usize;
        if let Some((min, max)) = self.batches {
            if rows < min || rows > max {
                return Err(tch::TchError::Shape(format!(
                    "a batch of {rows} rows; the package was exported for {min} to {max}"
                )));
            }
        }
        // SAFETY: `input` is a live tensor for the call; the result, when not null, is a
        // new tensor whose ownership passes to the returned `Tensor`.
        let out = unsafe { vg_aoti_run(self.handle, input.as_ptr()) };
        if out.is_null() {
            return Err(tch::TchError::Torch(last_error()));
        }
        // SAFETY: a tensor the shim allocated for us alone.
        Ok(unsafe { Tensor::from_ptr(out) })
    }
}

/// What the package says it was built for, against where it would run: its device kind,
/// its machine and vector instruction set (code for AVX-512 stops the process on a CPU
/// without it), the libtorch it was compiled with, and when it records them, its batch
/// range (which must hold 1 to the config's `max_batch_size`) and input shape. Returns its
/// batch range, if it records one.
fn check_metadata(
    metadata: &HashMap<String, String>,
    spec: &EngineSpec,
    gpu: Option<u32>,
) -> Result<Option<(usize, usize)>, String> {
    let get = |key: &str| metadata.get(key).map(String::as_str).unwrap_or_default();
    let machine = get("AOTI_MACHINE");
    if !machine.is_empty() && machine != std::env::consts::ARCH {
        return Err(format!(
            "the package was compiled for {machine} (AOTI_MACHINE); this is {}",
            std::env::consts::ARCH
        ));
    }
    let here = if gpu.is_some() { "cuda" } else { "cpu" };
    let device = get("AOTI_DEVICE_KEY");
    if device != here {
        let runs = match gpu {
            Some(i) => format!("on GPU {i}"),
            None => "on the CPU".to_string(),
        };
        return Err(format!(
            "the package was compiled for device '{device}' (AOTI_DEVICE_KEY) and this \
             instance runs {runs}: export it on the device it is to run on, or change the \
             instance_group's kind"
        ));
    }
    match gpu {
        None => {
            let isa = get("AOTI_CPU_ISA");
            if let Err(missing) = isa_runs_here(isa, &cpu_flags()) {
                return Err(format!(
                    "the package was compiled for {isa} (AOTI_CPU_ISA), and this CPU lacks \
                     {missing}: export it for an instruction set this CPU has (inductor \
                     configs cpp.march and cpp.simdlen, e.g. x86-64-v3 and 256 for AVX2)"
                ));
            }
        }
        Some(i) => {
            let built = get("AOTI_COMPUTE_CAPABILITY");
            if let Some((major, minor)) = super::cuda_host::compute_capability(i as usize) {
                if !built.is_empty() && built != format!("{major}{minor}") {
                    return Err(format!(
                        "the package was compiled for GPUs of compute capability {built} \
                         (AOTI_COMPUTE_CAPABILITY); GPU {i} is {major}.{minor}: export it on \
                         this kind of GPU"
                    ));
                }
            }
        }
    }
    let server = torch_version();
    if let Some(built) = metadata.get(TORCH_VERSION) {
        // "2.13.0+cu130": the release, without the build's local part.
        let release = built.split('+').next().unwrap_or_default();
        if release != server {
            return Err(format!(
                "the package was compiled with torch {built} ({TORCH_VERSION}); this server \
                 runs libtorch {server}: export it again with torch {server}"
            ));
        }
    }
    if let Some(shape) = metadata.get(INPUT_SHAPE) {
        let want = format!("3,{},{}", spec.height, spec.width);
        if shape.replace(' ', "") != want {
            return Err(format!(
                "input.dims: the package takes [{shape}] ({INPUT_SHAPE}); the config declares \
                 [{want}]"
            ));
        }
    }
    let number = |key: &str| -> Result<Option<usize>, String> {
        metadata
            .get(key)
            .map(|v| {
                v.parse()
                    .map_err(|_| format!("its {key} metadata '{v}' is not a number"))
            })
            .transpose()
    };
    match (number(BATCH_MIN)?, number(BATCH_MAX)?) {
        (Some(min), Some(max)) => {
            let need = spec.max_batch_size.max(1);
            if min > 1 || max < need {
                return Err(format!(
                    "max_batch_size: batches of 1 to {need} rows run, and the package was \
                     exported for {min} to {max} ({BATCH_MIN}, {BATCH_MAX})"
                ));
            }
            Ok(Some((min, max)))
        }
        _ => Ok(None),
    }
}

/// This CPU's feature flags, as /proc/cpuinfo names them (`flags` on x86, `Features` on
/// Arm).
fn cpu_flags() -> HashSet<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    info.lines()
        .find(|l| l.starts_with("flags") || l.starts_with("Features"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, flags)| flags.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// Whether code compiled for `isa` runs on a CPU with `flags`, or the flags it lacks.
/// `isa` is AOTInductor's name of the vector instruction set it compiled for, upper case,
/// its extensions after it ("AVX512 AVX512_VNNI AMX_TILE"); "INVALID_VEC_ISA": none.
fn isa_runs_here(isa: &str, flags: &HashSet<String>) -> Result<(), String> {
    let mut missing = Vec::new();
    for word in isa.split_whitespace() {
        let needs: &[&str] = match word {
            "INVALID_VEC_ISA" => &[],
            // The compiler flags AOTInductor builds each with.
            "AVX2" => &["avx2", "fma", "f16c"],
            "AVX512" => &["avx512f", "avx512dq", "avx512vl", "avx512bw", "fma"],
            "AVX512_VNNI" => &["avx512_vnni"],
            "AMX_TILE" => &["amx_tile", "amx_bf16", "amx_int8"],
            "ASIMD" | "NEON" => &["asimd"],
            other => {
                missing.push(format!(
                    "{other} (an instruction set visiongate does not know)"
                ));
                continue;
            }
        };
        missing.extend(
            needs
                .iter()
                .filter(|f| !flags.contains(**f))
                .map(|f| f.to_string()),
        );
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(missing.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(list: &str) -> HashSet<String> {
        list.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn a_package_runs_where_the_cpu_has_every_flag_its_isa_was_compiled_with() {
        let zen3 = flags("sse4_2 avx fma f16c avx2 bmi2");
        let zen4 =
            flags("avx2 fma f16c avx512f avx512dq avx512vl avx512bw avx512_vnni avx512_bf16");
        assert_eq!(isa_runs_here("AVX2", &zen3), Ok(()));
        assert_eq!(isa_runs_here("INVALID_VEC_ISA", &zen3), Ok(()));
        assert_eq!(isa_runs_here("", &zen3), Ok(()));
        assert_eq!(isa_runs_here("AVX512 AVX512_VNNI", &zen4), Ok(()));
        let e = isa_runs_here("AVX512 AVX512_VNNI", &zen3).unwrap_err();
        assert!(
            e.starts_with("avx512f, avx512dq, avx512vl, avx512bw, avx512_vnni"),
            "{e}"
        );
        let e = isa_runs_here("AVX512 AVX512_VNNI AMX_TILE", &zen4).unwrap_err();
        assert_eq!(e, "amx_tile, amx_bf16, amx_int8");
        assert!(isa_runs_here("ASIMD", &zen4).is_err());
        assert_eq!(isa_runs_here("ASIMD", &flags("fp asimd sve")), Ok(()));
        assert!(isa_runs_here("VSX", &zen4)
            .unwrap_err()
            .contains("does not know"));
    }

    fn spec(max_batch_size: usize) -> EngineSpec {
        EngineSpec {
            max_batch_size,
            ..EngineSpec::bundled(
                std::path::Path::new("models"),
                crate::domain::Runtime::TorchAoti,
                crate::domain::Precision::Fp32,
            )
        }
    }

    fn metadata(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        let mut m: HashMap<String, String> = [
            ("AOTI_DEVICE_KEY", "cpu"),
            ("AOTI_MACHINE", std::env::consts::ARCH),
            ("AOTI_CPU_ISA", "INVALID_VEC_ISA"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        for (k, v) in pairs {
            m.insert(k.to_string(), v.to_string());
        }
        m
    }

    #[test]
    fn the_batch_range_must_hold_one_row_to_the_configs_max_batch_size() {
        fn range<'a>(min: &'a str, max: &'a str) -> [(&'a str, &'a str); 2] {
            [(BATCH_MIN, min), (BATCH_MAX, max)]
        }
        assert_eq!(
            check_metadata(&metadata(&range("1", "64")), &spec(64), None),
            Ok(Some((1, 64)))
        );
        assert_eq!(check_metadata(&metadata(&[]), &spec(64), None), Ok(None));
        // Without batching the engine still runs batches of one row.
        assert_eq!(
            check_metadata(&metadata(&range("1", "1")), &spec(0), None),
            Ok(Some((1, 1)))
        );
        for (min, max) in [("2", "64"), ("1", "32")] {
            let e = check_metadata(&metadata(&range(min, max)), &spec(64), None).unwrap_err();
            assert!(
                e.contains("max_batch_size") && e.contains(&format!("{min} to {max}")),
                "{e}"
            );
        }
        let e = check_metadata(&metadata(&range("1", "lots")), &spec(64), None).unwrap_err();
        assert!(e.contains("'lots' is not a number"), "{e}");
    }
}
