//! What tch leaves out of libtorch, through `cuda_shim.cpp` (built by build.rs): TF32
//! switches, a stream of its own per instance thread, CUDA events, so an instance times its
//! batches and waits for its own stream instead of synchronizing the device, autocast
//! on the CPU as well as on CUDA, and oneDNN Graph's fuser for TorchScript on the CPU.
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::NonNull;
use std::time::Duration;

extern "C" {
    fn vg_last_error() -> *const c_char;
    fn vg_cuda_registered() -> c_int;
    fn vg_set_allow_tf32(allow: c_int) -> c_int;
    fn vg_allow_tf32() -> c_int;
    fn vg_cuda_use_pool_stream(index: c_int) -> c_int;
    fn vg_cuda_current_stream(index: c_int, stream: *mut *mut c_void) -> c_int;
    fn vg_cuda_set_device(index: c_int) -> c_int;
    fn vg_cuda_event_new() -> *mut c_void;
    fn vg_cuda_event_free(event: *mut c_void);
    fn vg_cuda_event_record(event: *mut c_void, index: c_int) -> c_int;
    fn vg_cuda_event_synchronize(event: *mut c_void) -> c_int;
    fn vg_cuda_event_elapsed_ms(start: *mut c_void, end: *mut c_void, ms: *mut f64) -> c_int;
    fn vg_autocast_enter(cuda: c_int, precision: c_int, previous: *mut c_int) -> c_int;
    fn vg_autocast_exit(cuda: c_int, previous: c_int) -> c_int;
    fn vg_set_onednn_fusion(on: c_int) -> c_int;
    fn vg_onednn_fusion() -> c_int;
}

fn last_error() -> String {
    // SAFETY: the shim returns a NUL-terminated string owned by this thread, valid until
    // this thread's next call into the shim; it is copied out at once.
    unsafe { CStr::from_ptr(vg_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn check(rc: c_int) -> Result<(), String> {
    if rc < 0 {
        Err(last_error())
    } else {
        Ok(())
    }
}

/// Whether libtorch's CUDA half is registered with libtorch: (CUDA's hooks, its device
/// guard). `cuda_host::open_libtorch_cuda` checks it once the library is open.
pub fn cuda_registered() -> (bool, bool) {
    // SAFETY: reads libtorch's registries; no pointers involved.
    let bits = unsafe { vg_cuda_registered() };
    (bits & 1 != 0, bits & 2 != 0)
}

/// Whether FP32 convolutions (cuDNN) and matmuls (cuBLAS) may run in TF32 on GPUs that
/// have it. Process-wide; set once at start-up, before any model runs.
pub fn set_allow_tf32(allow: bool) -> Result<(), String> {
    // SAFETY: sets two flags of libtorch's global context; no pointers involved.
    check(unsafe { vg_set_allow_tf32(c_int::from(allow)) })
}

/// Whether TorchScript graphs the profiling executor optimizes from now on have their CPU
/// operators fused by oneDNN Graph (`torch.jit.enable_onednn_fusion`). Process-wide; set
/// once at start-up, before any model loads.
pub fn set_onednn_fusion(on: bool) -> Result<(), String> {
    // SAFETY: registers or clears one of libtorch's graph passes; no pointers involved.
    check(unsafe { vg_set_onednn_fusion(c_int::from(on)) })
}

/// Whether oneDNN Graph's fuser is on.
pub fn onednn_fusion() -> bool {
    // SAFETY: reads a flag; no pointers involved.
    unsafe { vg_onednn_fusion() != 0 }
}

/// (cuDNN convolutions, cuBLAS matmuls): whether each may use TF32.
pub fn allow_tf32() -> (bool, bool) {
    // SAFETY: reads two flags of libtorch's global context.
    let bits = unsafe { vg_allow_tf32() };
    (bits > 0 && bits & 1 != 0, bits > 0 && bits & 2 != 0)
}

/// Gives the calling thread a stream of its own on CUDA device `index` (from libtorch's
/// pool): what this thread runs there no longer queues behind other instances' work.
pub fn use_pool_stream(index: usize) -> Result<(), String> {
    // SAFETY: changes the calling thread's current-stream setting only.
    check(unsafe { vg_cuda_use_pool_stream(index as c_int) })
}

/// Makes CUDA device `index` the calling thread's current device, which CUDA libraries
/// beside libtorch (nvJPEG) work on; libtorch's device guards restore it after each op.
pub fn set_device(index: usize) -> Result<(), String> {
    // SAFETY: changes the calling thread's current-device setting only.
    check(unsafe { vg_cuda_set_device(index as c_int) })
}

/// The calling thread's current stream on CUDA device `index` (a `cudaStream_t`), for
/// CUDA libraries that queue work beside libtorch's (nvJPEG).
pub fn current_stream(index: usize) -> Result<*mut c_void, String> {
    let mut stream = std::ptr::null_mut();
    // SAFETY: reads the calling thread's current-stream setting into a live pointer slot.
    check(unsafe { vg_cuda_current_stream(index as c_int, &mut stream) })?;
    Ok(stream)
}

/// Autocast on the calling thread, on the CPU or on CUDA, while it lives: convolutions and
/// matmuls run in `dtype` (float16 or bfloat16), the rest as torch.autocast keeps it. On
/// drop the thread's autocast state is what it was before.
pub struct Autocast {
    cuda: bool,
    previous: c_int,
}

impl Autocast {
    pub fn new(cuda: bool, dtype: tch::Kind) -> Result<Autocast, String> {
        let precision = match dtype {
            tch::Kind::Half => 1,
            tch::Kind::BFloat16 => 2,
            other => return Err(format!("autocast to {other:?} is not supported")),
        };
        let mut previous: c_int = -1;
        // SAFETY: changes the calling thread's autocast settings only; `previous` is a
        // valid pointer for the call.
        check(unsafe { vg_autocast_enter(c_int::from(cuda), precision, &mut previous) })?;
        Ok(Autocast { cuda, previous })
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        // SAFETY: as in `new`. Restoring cannot fail but for a libtorch bug, which the
        // next `new` would report.
        let _ = unsafe { vg_autocast_exit(c_int::from(self.cuda), self.previous) };
    }
}

/// A CUDA event with timing enabled.
pub struct Event(NonNull<c_void>);

// SAFETY: a c10::Event may be used from any thread, one at a time; `Event` is not `Sync`,
// and its owner (an engine) is used by one instance thread at a time.
unsafe impl Send for Event {}

impl Event {
    pub fn new() -> Result<Event, String> {
        // SAFETY: returns an owned heap object or null.
        NonNull::new(unsafe { vg_cuda_event_new() })
            .map(Event)
            .ok_or_else(last_error)
    }

    /// Records the event on the calling thread's current stream of device `index`.
    pub fn record(&mut self, index: usize) -> Result<(), String> {
        // SAFETY: self.0 is a live event owned by self.
        check(unsafe { vg_cuda_event_record(self.0.as_ptr(), index as c_int) })
    }

    /// Waits for the work recorded before this event (its stream only).
    pub fn synchronize(&self) -> Result<(), String> {
        // SAFETY: self.0 is a live event owned by self.
        check(unsafe { vg_cuda_event_synchronize(self.0.as_ptr()) })
    }

    /// Time from this event to `end`; both recorded, `end` done.
    pub fn elapsed(&self, end: &Event) -> Result<Duration, String> {
        let mut ms = 0f64;
        // SAFETY: both are live events; `ms` is a valid out-pointer.
        check(unsafe { vg_cuda_event_elapsed_ms(self.0.as_ptr(), end.0.as_ptr(), &mut ms) })?;
        Ok(Duration::from_secs_f64(ms.max(0.0) / 1e3))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: self.0 came from vg_cuda_event_new and is freed once, here.
        unsafe { vg_cuda_event_free(self.0.as_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tf32_switches_both_libraries_and_reads_back() {
        // TF32 does nothing on the CPU, where the other tests of this process run.
        set_allow_tf32(false).unwrap();
        assert_eq!(allow_tf32(), (false, false));
        set_allow_tf32(true).unwrap();
        assert_eq!(allow_tf32(), (true, true));
    }

    #[test]
    fn onednn_fusion_switches_and_reads_back() {
        set_onednn_fusion(true).unwrap();
        assert!(onednn_fusion());
        set_onednn_fusion(false).unwrap();
        assert!(!onednn_fusion());
    }

    #[test]
    fn cuda_calls_fail_with_libtorchs_message_without_a_gpu() {
        let stream = use_pool_stream(0);
        if super::super::cuda_device_count() > 0 {
            assert!(stream.is_ok(), "{:?}", stream.err());
        } else {
            assert!(!stream.unwrap_err().is_empty());
        }
    }
}
