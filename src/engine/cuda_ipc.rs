//! GPU memory a client shares by a CUDA IPC handle (the 64 bytes of `cudaIpcMemHandle_t`,
//! what `cudaIpcGetMemHandle` gives), opened, read and written through the CUDA driver API
//! of the NVIDIA driver (`libcuda.so.1`, opened at run time) on each device's primary
//! context: the one libtorch's CUDA runtime uses. [`CudaIpc`] is what the shared-memory
//! table needs of it, so that tests can give it GPU memory kept in host memory
//! ([`FakeCudaIpc`]).
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock};

use crate::telemetry::cast;

/// Bytes of a CUDA IPC handle (`CU_IPC_HANDLE_SIZE`).
pub const HANDLE_BYTES: usize = 64;

/// Opens the device memory clients share by handle.
pub trait CudaIpc: Send + Sync {
    /// How many GPUs the driver sees; 0 where none (or no driver).
    fn device_count(&self) -> usize;

    /// Opens `handle`'s allocation on GPU `device` (below `device_count`).
    fn open(
        &self,
        handle: &[u8; HANDLE_BYTES],
        device: usize,
    ) -> Result<Box<dyn DeviceMemory>, String>;
}

/// An allocation opened from a handle; closed when dropped.
pub trait DeviceMemory: Send + Sync {
    /// Bytes from the opened address to the end of its allocation.
    fn size(&self) -> u64;
    /// Copies `out.len()` bytes at `offset` (within `size`) to `out`.
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String>;
    /// Copies `data` to `offset` (within `size`).
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String>;
}

/// A host without GPUs (or without the NVIDIA driver).
pub struct NoGpus;

impl CudaIpc for NoGpus {
    fn device_count(&self) -> usize {
        0
    }

    fn open(&self, _: &[u8; HANDLE_BYTES], _: usize) -> Result<Box<dyn DeviceMemory>, String> {
        Err("GPUs not supported".into())
    }
}

/// This host's GPUs, through the NVIDIA driver, started at the first use (a server that
/// never registers a CUDA region never starts it for this): where it does not run or sees
/// no GPU, none.
#[derive(Default)]
pub struct HostGpus {
    driver: OnceLock<Option<Driver>>,
}

impl HostGpus {
    fn driver(&self) -> Option<&Driver> {
        self.driver
            .get_or_init(|| match Driver::load() {
                Ok(driver) => Some(driver),
                Err(why) => {
                    tracing::info!("CUDA shared memory: no GPUs ({why})");
                    None
                }
            })
            .as_ref()
    }
}

impl CudaIpc for HostGpus {
    fn device_count(&self) -> usize {
        self.driver().map_or(0, Driver::device_count)
    }

    fn open(
        &self,
        handle: &[u8; HANDLE_BYTES],
        device: usize,
    ) -> Result<Box<dyn DeviceMemory>, String> {
        match self.driver() {
            Some(driver) => driver.open(handle, device),
            None => NoGpus.open(handle, device),
        }
    }
}

type Result32 = c_int;
type DevicePtr = u64;
type Context = *mut c_void;

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, as Triton opens handles.
const LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// `CUipcMemHandle`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle {
    reserved: [u8; HANDLE_BYTES],
}

/// The driver API entry points used here, with the C signatures `cuda.h` gives them.
#[derive(Clone, Copy)]
struct Api {
    init: unsafe extern "C" fn(c_uint) -> Result32,
    device_count: unsafe extern "C" fn(*mut c_int) -> Result32,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> Result32,
    primary_retain: unsafe extern "C" fn(*mut Context, c_int) -> Result32,
    primary_release: unsafe extern "C" fn(c_int) -> Result32,
    push: unsafe extern "C" fn(Context) -> Result32,
    pop: unsafe extern "C" fn(*mut Context) -> Result32,
    ipc_open: unsafe extern "C" fn(*mut DevicePtr, IpcHandle, c_uint) -> Result32,
    ipc_close: unsafe extern "C" fn(DevicePtr) -> Result32,
    address_range: unsafe extern "C" fn(*mut DevicePtr, *mut usize, DevicePtr) -> Result32,
    to_host: unsafe extern "C" fn(*mut c_void, DevicePtr, usize) -> Result32,
    to_device: unsafe extern "C" fn(DevicePtr, *const c_void, usize) -> Result32,
    stream_sync: unsafe extern "C" fn(*mut c_void) -> Result32,
    error_string: unsafe extern "C" fn(Result32, *mut *const c_char) -> Result32,
}

/// The CUDA driver, started.
pub struct Driver {
    api: Api,
    devices: usize,
}

impl Driver {
    /// Opens `libcuda.so.1` (kept open: libtorch uses it too) and starts it.
    fn load() -> Result<Driver, String> {
        static API: OnceLock<Result<Api, String>> = OnceLock::new();
        let api = *API.get_or_init(open_api).as_ref().map_err(Clone::clone)?;
        Driver::start(api)
    }

    fn start(api: Api) -> Result<Driver, String> {
        // SAFETY: `api` holds the driver's entry points; cuInit may be called again.
        unsafe {
            check(&api, (api.init)(0))?;
            let mut count: c_int = 0;
            check(&api, (api.device_count)(&mut count))?;
            Ok(Driver {
                api,
                devices: usize::try_from(count).unwrap_or(0),
            })
        }
    }
}

fn open_api() -> Result<Api, String> {
    // SAFETY: dlopen with a constant name; the handle is never closed (the entry points
    // below point into it).
    let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
    if lib.is_null() {
        return Err("no NVIDIA driver (libcuda.so.1)".into());
    }
    let sym = |name: &CStr| {
        // SAFETY: looking a symbol up in a handle that is open.
        let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
        if p.is_null() {
            Err(format!("libcuda.so.1 has no {}", name.to_string_lossy()))
        } else {
            Ok(p)
        }
    };
    // SAFETY: each symbol has the signature `cuda.h` declares for that name.
    unsafe {
        Ok(Api {
            init: cast(sym(c"cuInit")?),
            device_count: cast(sym(c"cuDeviceGetCount")?),
            device_get: cast(sym(c"cuDeviceGet")?),
            primary_retain: cast(sym(c"cuDevicePrimaryCtxRetain")?),
            primary_release: cast(sym(c"cuDevicePrimaryCtxRelease_v2")?),
            push: cast(sym(c"cuCtxPushCurrent_v2")?),
            pop: cast(sym(c"cuCtxPopCurrent_v2")?),
            ipc_open: cast(sym(c"cuIpcOpenMemHandle_v2")?),
            ipc_close: cast(sym(c"cuIpcCloseMemHandle")?),
            address_range: cast(sym(c"cuMemGetAddressRange_v2")?),
            to_host: cast(sym(c"cuMemcpyDtoH_v2")?),
            to_device: cast(sym(c"cuMemcpyHtoD_v2")?),
            stream_sync: cast(sym(c"cuStreamSynchronize")?),
            error_string: cast(sym(c"cuGetErrorString")?),
        })
    }
}

/// `code` as the driver names it, or `Ok` for `CUDA_SUCCESS`.
fn check(api: &Api, code: Result32) -> Result<(), String> {
    if code == 0 {
        return Ok(());
    }
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a static NUL-terminated string, or null for an
    // unknown code.
    unsafe { (api.error_string)(code, &mut text) };
    let text = if text.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: as above.
        unsafe { CStr::from_ptr(text) }.to_string_lossy()
    };
    Err(format!("{text} (CUDA error {code})"))
}

/// A device's primary context, made current on this thread while it lives.
struct Current<'a> {
    api: &'a Api,
}

impl<'a> Current<'a> {
    fn push(api: &'a Api, context: Context) -> Result<Current<'a>, String> {
        // SAFETY: `context` is a primary context this process retained.
        check(api, unsafe { (api.push)(context) })?;
        Ok(Current { api })
    }
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        let mut popped: Context = std::ptr::null_mut();
        // SAFETY: pops the context `push` made current on this thread.
        unsafe { (self.api.pop)(&mut popped) };
    }
}

impl CudaIpc for Driver {
    fn device_count(&self) -> usize {
        self.devices
    }

    fn open(
        &self,
        handle: &[u8; HANDLE_BYTES],
        device: usize,
    ) -> Result<Box<dyn DeviceMemory>, String> {
        let api = &self.api;
        let ordinal = c_int::try_from(device).map_err(|_| format!("no GPU {device}"))?;
        let mut dev: c_int = 0;
        let mut context: Context = std::ptr::null_mut();
        // SAFETY: driver calls with out-pointers to locals; the retained context is
        // released by `Opened`'s drop, or here when opening fails.
        unsafe {
            check(api, (api.device_get)(&mut dev, ordinal))?;
            check(api, (api.primary_retain)(&mut context, dev))?;
        }
        let release = || {
            // SAFETY: releases the retain above.
            unsafe { (api.primary_release)(dev) };
        };
        let opened = (|| {
            let _current = Current::push(api, context)?;
            let mut ptr: DevicePtr = 0;
            let handle = IpcHandle { reserved: *handle };
            // SAFETY: out-pointers to locals; the handle is passed by value as `cuda.h`
            // declares; the mapping is closed by `Opened`'s drop, or here on error.
            unsafe {
                check(
                    api,
                    (api.ipc_open)(&mut ptr, handle, LAZY_ENABLE_PEER_ACCESS),
                )?;
                let (mut base, mut size): (DevicePtr, usize) = (0, 0);
                if let Err(e) = check(api, (api.address_range)(&mut base, &mut size, ptr)) {
                    (api.ipc_close)(ptr);
                    return Err(e);
                }
                // The handle names its allocation; the mapping starts at its base.
                let size = (base + size as u64).saturating_sub(ptr);
                Ok((ptr, size))
            }
        })();
        match opened {
            Ok((ptr, size)) => Ok(Box::new(Opened {
                api: *api,
                device: dev,
                context,
                ptr,
                size,
            })),
            Err(e) => {
                release();
                Err(e)
            }
        }
    }
}

/// A mapping of a client's allocation on one device.
struct Opened {
    api: Api,
    device: c_int,
    context: Context,
    ptr: DevicePtr,
    size: u64,
}

// SAFETY: the context and address are process-wide driver objects; each use makes the
// context current on the calling thread first.
unsafe impl Send for Opened {}
unsafe impl Sync for Opened {}

impl Opened {
    /// The device address of `len` bytes at `offset`, which must lie inside the mapping.
    fn address(&self, offset: u64, len: usize) -> Result<DevicePtr, String> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size => Ok(self.ptr + offset),
            _ => Err(format!(
                "{len} bytes at {offset} are outside the {} bytes of the allocation",
                self.size
            )),
        }
    }
}

impl DeviceMemory for Opened {
    fn size(&self) -> u64 {
        self.size
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        let from = self.address(offset, out.len())?;
        let _current = Current::push(&self.api, self.context)?;
        // SAFETY: `out` is writable for its length; the source lies inside the mapping.
        // A synchronous copy: done when it returns.
        check(&self.api, unsafe {
            (self.api.to_host)(out.as_mut_ptr().cast(), from, out.len())
        })
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        let to = self.address(offset, data.len())?;
        let _current = Current::push(&self.api, self.context)?;
        // SAFETY: `data` is readable for its length; the target lies inside the mapping.
        // From pageable memory the copy returns once the data is staged: the legacy
        // default stream it ran on is waited for, so that the data is in the client's
        // memory before the answer says so.
        unsafe {
            check(
                &self.api,
                (self.api.to_device)(to, data.as_ptr().cast(), data.len()),
            )?;
            check(&self.api, (self.api.stream_sync)(std::ptr::null_mut()))
        }
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        if let Ok(_current) = Current::push(&self.api, self.context) {
            // SAFETY: closes the mapping `open` made, in its context.
            unsafe { (self.api.ipc_close)(self.ptr) };
        }
        // SAFETY: releases the retain `open` took.
        unsafe { (self.api.primary_release)(self.device) };
    }
}

/// Fake GPU memory: host bytes a test reads and writes while the server does.
pub type FakeMemory = Arc<Mutex<Vec<u8>>>;

/// GPU memory for tests, kept in host memory: allocations made with [`FakeCudaIpc::share`]
/// on a device, opened by their handle.
#[derive(Debug, Default)]
pub struct FakeCudaIpc {
    devices: usize,
    /// Each allocation's device and bytes, by handle.
    shared: Mutex<BTreeMap<[u8; HANDLE_BYTES], (usize, FakeMemory)>>,
}

impl FakeCudaIpc {
    /// A host with `devices` GPUs.
    pub fn new(devices: usize) -> FakeCudaIpc {
        FakeCudaIpc {
            devices,
            shared: Mutex::default(),
        }
    }

    /// Allocates `size` bytes on `device` and returns their handle and memory.
    pub fn share(&self, device: usize, size: usize) -> ([u8; HANDLE_BYTES], FakeMemory) {
        let mut shared = self.shared.lock().unwrap();
        let mut handle = [0; HANDLE_BYTES];
        handle[..8].copy_from_slice(&(shared.len() as u64 + 1).to_le_bytes());
        handle[8..16].copy_from_slice(&(device as u64).to_le_bytes());
        let memory = Arc::new(Mutex::new(vec![0; size]));
        shared.insert(handle, (device, memory.clone()));
        (handle, memory)
    }
}

impl CudaIpc for FakeCudaIpc {
    fn device_count(&self) -> usize {
        self.devices
    }

    fn open(
        &self,
        handle: &[u8; HANDLE_BYTES],
        device: usize,
    ) -> Result<Box<dyn DeviceMemory>, String> {
        match self.shared.lock().unwrap().get(handle) {
            Some((on, memory)) if *on == device => Ok(Box::new(Fake(memory.clone()))),
            Some((on, _)) => Err(format!("the handle's memory is on GPU {on}")),
            None => Err("invalid argument (CUDA error 1)".into()),
        }
    }
}

struct Fake(FakeMemory);

impl DeviceMemory for Fake {
    fn size(&self) -> u64 {
        self.0.lock().unwrap().len() as u64
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        let memory = self.0.lock().unwrap();
        let from = usize::try_from(offset)
            .ok()
            .and_then(|s| memory.get(s..s + out.len()));
        out.copy_from_slice(from.ok_or("outside the allocation")?);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        let mut memory = self.0.lock().unwrap();
        let to = usize::try_from(offset)
            .ok()
            .and_then(|s| memory.get_mut(s..s + data.len()));
        to.ok_or("outside the allocation")?.copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The driver path against a stand-in driver: one GPU whose memory is a host buffer, which
    //! refuses copies without a current context, as the real one does.
    use super::*;
    use std::cell::Cell;
    use std::sync::atomic::{AtomicI32, Ordering::SeqCst};

    const BASE: DevicePtr = 0x7000_0000;
    const ALLOCATION: usize = 256;
    const INVALID_VALUE: Result32 = 1;
    const INVALID_CONTEXT: Result32 = 201;
    static MEMORY: Mutex<[u8; ALLOCATION]> = Mutex::new([0; ALLOCATION]);
    static RETAINED: AtomicI32 = AtomicI32::new(0);
    static MAPPED: AtomicI32 = AtomicI32::new(0);
    static SYNCED: AtomicI32 = AtomicI32::new(0);
    thread_local! {
        static PUSHED: Cell<i32> = const { Cell::new(0) };
    }
    const CONTEXT: usize = 0xc0;

    fn current() -> bool {
        PUSHED.with(|p| p.get()) > 0
    }
    unsafe extern "C" fn init(_: c_uint) -> Result32 {
        0
    }
    unsafe extern "C" fn device_count(n: *mut c_int) -> Result32 {
        *n = 1;
        0
    }
    unsafe extern "C" fn device_get(d: *mut c_int, ordinal: c_int) -> Result32 {
        *d = ordinal;
        if ordinal == 0 {
            0
        } else {
            101 // CUDA_ERROR_INVALID_DEVICE
        }
    }
    unsafe extern "C" fn retain(c: *mut Context, _: c_int) -> Result32 {
        RETAINED.fetch_add(1, SeqCst);
        *c = CONTEXT as Context;
        0
    }
    unsafe extern "C" fn release(_: c_int) -> Result32 {
        RETAINED.fetch_sub(1, SeqCst);
        0
    }
    unsafe extern "C" fn push(c: Context) -> Result32 {
        assert_eq!(c as usize, CONTEXT);
        PUSHED.with(|p| p.set(p.get() + 1));
        0
    }
    unsafe extern "C" fn pop(c: *mut Context) -> Result32 {
        PUSHED.with(|p| p.set(p.get() - 1));
        *c = CONTEXT as Context;
        0
    }
    unsafe extern "C" fn ipc_open(p: *mut DevicePtr, h: IpcHandle, flags: c_uint) -> Result32 {
        if !current() {
            return INVALID_CONTEXT;
        }
        assert_eq!(flags, LAZY_ENABLE_PEER_ACCESS);
        if h.reserved[0] != 1 || h.reserved[63] != 63 {
            return INVALID_VALUE;
        }
        MAPPED.fetch_add(1, SeqCst);
        // The handle names an allocation; this one is mapped 16 bytes into it.
        *p = BASE + 16;
        0
    }
    unsafe extern "C" fn ipc_close(p: DevicePtr) -> Result32 {
        assert_eq!(p, BASE + 16);
        if !current() {
            return INVALID_CONTEXT;
        }
        MAPPED.fetch_sub(1, SeqCst);
        0
    }
    unsafe extern "C" fn range(b: *mut DevicePtr, s: *mut usize, _: DevicePtr) -> Result32 {
        *b = BASE;
        *s = ALLOCATION;
        0
    }
    unsafe extern "C" fn to_host(h: *mut c_void, d: DevicePtr, n: usize) -> Result32 {
        if !current() {
            return INVALID_CONTEXT;
        }
        let start = (d - BASE) as usize;
        let memory = MEMORY.lock().unwrap();
        std::ptr::copy_nonoverlapping(memory[start..start + n].as_ptr(), h.cast(), n);
        0
    }
    unsafe extern "C" fn to_device(d: DevicePtr, h: *const c_void, n: usize) -> Result32 {
        if !current() {
            return INVALID_CONTEXT;
        }
        let start = (d - BASE) as usize;
        let mut memory = MEMORY.lock().unwrap();
        std::ptr::copy_nonoverlapping(h.cast(), memory[start..start + n].as_mut_ptr(), n);
        0
    }
    unsafe extern "C" fn stream_sync(stream: *mut c_void) -> Result32 {
        assert!(stream.is_null(), "the legacy default stream");
        if !current() {
            return INVALID_CONTEXT;
        }
        SYNCED.fetch_add(1, SeqCst);
        0
    }
    unsafe extern "C" fn error_string(code: Result32, s: *mut *const c_char) -> Result32 {
        *s = match code {
            INVALID_VALUE => c"invalid argument".as_ptr(),
            _ => std::ptr::null(),
        };
        0
    }

    #[test]
    fn the_driver_path_maps_copies_and_closes_in_the_devices_context() {
        let api = Api {
            init,
            device_count,
            device_get,
            primary_retain: retain,
            primary_release: release,
            push,
            pop,
            ipc_open,
            ipc_close,
            address_range: range,
            to_host,
            to_device,
            stream_sync,
            error_string,
        };
        let driver = Driver::start(api).unwrap();
        assert_eq!(driver.device_count(), 1);
        let mut handle = [0u8; HANDLE_BYTES];
        handle[0] = 1;
        handle[63] = 63;
        MEMORY.lock().unwrap()[16..20].copy_from_slice(&[1, 2, 3, 4]);
        let memory = driver.open(&handle, 0).unwrap();
        assert!(!current(), "the context is popped after each call");
        // From the mapping to the end of its allocation.
        assert_eq!(memory.size(), ALLOCATION as u64 - 16);
        let mut out = [0; 4];
        memory.read(0, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4]);
        memory.write(238, &[9, 9]).unwrap();
        assert_eq!(&MEMORY.lock().unwrap()[254..], &[9, 9]);
        assert_eq!(SYNCED.load(SeqCst), 1, "a write waits for its copy");
        let e = memory.write(239, &[9, 9]).unwrap_err();
        assert!(e.contains("outside the 240 bytes"), "{e}");
        let e = memory.read(u64::MAX, &mut out).unwrap_err();
        assert!(e.contains("outside"), "{e}");
        assert!(!current());
        assert_eq!((MAPPED.load(SeqCst), RETAINED.load(SeqCst)), (1, 1));
        drop(memory);
        assert_eq!((MAPPED.load(SeqCst), RETAINED.load(SeqCst)), (0, 0));
        // A handle the driver refuses: its error, and nothing left retained.
        handle[63] = 0;
        let e = driver.open(&handle, 0).err().unwrap();
        assert_eq!(e, "invalid argument (CUDA error 1)");
        let e = driver.open(&handle, 1).err().unwrap();
        assert_eq!(e, "unknown error (CUDA error 101)");
        assert_eq!((MAPPED.load(SeqCst), RETAINED.load(SeqCst)), (0, 0));
        assert!(!current());
    }
}
