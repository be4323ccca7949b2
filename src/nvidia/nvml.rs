//! NVIDIA's management library (`libnvidia-ml.so.1`, installed with the driver), loaded at
//! run time so that the binary needs no NVIDIA library to start. Read: each GPU's UUID,
//! utilisation, memory, power and energy, and the driver's and its CUDA's versions.
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::OnceLock;

use super::version_text;
use crate::dynlib::{Library, LoadError};
use crate::telemetry::{GpuProbe, GpuSample};

type Device = *mut c_void;
type Ret = c_int;
const SUCCESS: Ret = 0;

#[repr(C)]
#[derive(Default)]
struct Utilization {
    gpu: c_uint,
    memory: c_uint,
}

#[repr(C)]
#[derive(Default)]
struct Memory {
    total: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

/// The library's entry points this reads.
#[derive(Clone, Copy)]
pub struct Nvml {
    device_count: unsafe extern "C" fn(*mut c_uint) -> Ret,
    device_by_index: unsafe extern "C" fn(c_uint, *mut Device) -> Ret,
    uuid: unsafe extern "C" fn(Device, *mut c_char, c_uint) -> Ret,
    utilization: unsafe extern "C" fn(Device, *mut Utilization) -> Ret,
    memory: unsafe extern "C" fn(Device, *mut Memory) -> Ret,
    power_usage: unsafe extern "C" fn(Device, *mut c_uint) -> Ret,
    power_limit: unsafe extern "C" fn(Device, *mut c_uint) -> Ret,
    energy: unsafe extern "C" fn(Device, *mut c_ulonglong) -> Ret,
    driver_version: unsafe extern "C" fn(*mut c_char, c_uint) -> Ret,
    /// Missing from old drivers.
    cuda_version: Option<unsafe extern "C" fn(*mut c_int) -> Ret>,
}

/// The library, opened once (never closed: NVML keeps state for the process, its own
/// reference count of `nvmlInit`), with its entry points.
fn library() -> Result<&'static (Nvml, unsafe extern "C" fn() -> Ret), LoadError> {
    static NVML: OnceLock<Result<(Nvml, unsafe extern "C" fn() -> Ret), LoadError>> =
        OnceLock::new();
    NVML.get_or_init(|| {
        let lib = Library::open("libnvidia-ml.so.1")?;
        // SAFETY: each symbol has the C signature NVML's header declares for that name.
        unsafe {
            let nvml = Nvml {
                device_count: lib.get(c"nvmlDeviceGetCount_v2")?,
                device_by_index: lib.get(c"nvmlDeviceGetHandleByIndex_v2")?,
                uuid: lib.get(c"nvmlDeviceGetUUID")?,
                utilization: lib.get(c"nvmlDeviceGetUtilizationRates")?,
                memory: lib.get(c"nvmlDeviceGetMemoryInfo")?,
                power_usage: lib.get(c"nvmlDeviceGetPowerUsage")?,
                power_limit: lib.get(c"nvmlDeviceGetEnforcedPowerLimit")?,
                energy: lib.get(c"nvmlDeviceGetTotalEnergyConsumption")?,
                driver_version: lib.get(c"nvmlSystemGetDriverVersion")?,
                cuda_version: lib.optional(c"nvmlSystemGetCudaDriverVersion_v2"),
            };
            Ok((nvml, lib.get(c"nvmlInit_v2")?))
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

impl Nvml {
    /// The library, initialised; `None` when it is not installed or finds no driver.
    pub fn open() -> Option<Nvml> {
        let (nvml, init) = library().ok()?;
        // SAFETY: nvmlInit_v2 takes nothing; it counts its callers.
        (unsafe { init() } == SUCCESS).then_some(*nvml)
    }

    /// The driver's version and the newest CUDA version it supports, e.g. ("580.65.06",
    /// "13.0").
    pub fn versions(&self) -> (String, String) {
        let mut buf = [0 as c_char; 96];
        let mut cuda: c_int = 0;
        // SAFETY: buffers of the sizes passed.
        let (d, c) = unsafe {
            (
                (self.driver_version)(buf.as_mut_ptr(), buf.len() as c_uint),
                self.cuda_version.map_or(-1, |f| f(&mut cuda)),
            )
        };
        let driver = if d == SUCCESS {
            text(&buf)
        } else {
            "unknown".into()
        };
        let cuda = if c == SUCCESS {
            version_text(cuda)
        } else {
            "unknown".into()
        };
        (driver, cuda)
    }

    /// How many GPUs the driver sees.
    pub fn count(&self) -> u32 {
        let mut n: c_uint = 0;
        // SAFETY: an out-pointer to a local.
        if unsafe { (self.device_count)(&mut n) } == SUCCESS {
            n
        } else {
            0
        }
    }

    fn read(&self, index: u32) -> Option<GpuSample> {
        let mut dev: Device = std::ptr::null_mut();
        let mut uuid = [0 as c_char; 96];
        let mut util = Utilization::default();
        let mut mem = Memory::default();
        let (mut power, mut limit, mut energy): (c_uint, c_uint, c_ulonglong) = (0, 0, 0);
        // SAFETY: out-pointers to locals of the types NVML writes; `dev` is the handle
        // NVML returned for this index.
        unsafe {
            if (self.device_by_index)(index, &mut dev) != SUCCESS
                || (self.uuid)(dev, uuid.as_mut_ptr(), uuid.len() as c_uint) != SUCCESS
            {
                return None;
            }
            let ok = |r: Ret| r == SUCCESS;
            let util_ok = ok((self.utilization)(dev, &mut util));
            let mem_ok = ok((self.memory)(dev, &mut mem));
            let power_ok = ok((self.power_usage)(dev, &mut power));
            let limit_ok = ok((self.power_limit)(dev, &mut limit));
            let energy_ok = ok((self.energy)(dev, &mut energy));
            Some(GpuSample {
                uuid: text(&uuid),
                utilization: if util_ok {
                    f64::from(util.gpu) / 100.0
                } else {
                    0.0
                },
                memory_total_bytes: if mem_ok { mem.total as f64 } else { 0.0 },
                memory_used_bytes: if mem_ok { mem.used as f64 } else { 0.0 },
                power_watts: if power_ok {
                    f64::from(power) / 1000.0
                } else {
                    0.0
                },
                power_limit_watts: if limit_ok {
                    f64::from(limit) / 1000.0
                } else {
                    0.0
                },
                energy_joules: energy_ok.then(|| energy as f64 / 1000.0),
            })
        }
    }
}

impl GpuProbe for Nvml {
    fn sample(&mut self) -> Vec<GpuSample> {
        (0..self.count()).filter_map(|i| self.read(i)).collect()
    }
}

/// A NUL-terminated C string in `buf`, as text.
fn text(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
