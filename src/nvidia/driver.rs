//! The CUDA driver API of the NVIDIA driver (`libcuda.so.1`), opened once for the process
//! and kept (libtorch's CUDA runtime uses the same library): whether and how it starts,
//! its devices, each device's primary context (the one CUDA's runtime, so libtorch, uses),
//! and device memory another process shares by CUDA IPC handle. Every failed call is a
//! [`DriverError`] with the driver's own name for its code.
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::marker::PhantomData;
use std::sync::OnceLock;

use crate::dynlib::{Library, LoadError};

/// `CUDA_ERROR_NO_DEVICE`: the driver runs and sees no (visible) GPU.
pub const ERROR_NO_DEVICE: i32 = 100;

/// Bytes of a CUDA IPC handle (`CU_IPC_HANDLE_SIZE`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, as Triton opens handles.
const LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

type CuResult = c_int;
type DevicePtr = u64;
type Context = *mut c_void;

/// `CUipcMemHandle`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle {
    reserved: [u8; IPC_HANDLE_BYTES],
}

/// A failed driver call, or a driver that is not there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriverError {
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The driver's code and its name for it (`cuGetErrorString`).
    #[error("{text} (CUDA error {code})")]
    Call { code: i32, text: String },
    /// A copy that would reach outside an IPC mapping (checked before the driver is asked).
    #[error("{len} bytes at {offset} are outside the {size} bytes of the allocation")]
    OutOfRange { offset: u64, len: usize, size: u64 },
}

/// The entry points every driver has, with the C signatures `cuda.h` gives them.
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    /// Missing from very old drivers: their codes are then named by number only.
    error_string: Option<unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult>,
    device_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
}

/// The entry points of primary contexts and IPC memory (their `_v2` names since CUDA 11):
/// a driver without them still starts, and these calls fail saying which is missing.
struct ContextApi {
    primary_retain: unsafe extern "C" fn(*mut Context, c_int) -> CuResult,
    primary_release: unsafe extern "C" fn(c_int) -> CuResult,
    push: unsafe extern "C" fn(Context) -> CuResult,
    pop: unsafe extern "C" fn(*mut Context) -> CuResult,
    ipc_open: unsafe extern "C" fn(*mut DevicePtr, IpcHandle, c_uint) -> CuResult,
    ipc_close: unsafe extern "C" fn(DevicePtr) -> CuResult,
    address_range: unsafe extern "C" fn(*mut DevicePtr, *mut usize, DevicePtr) -> CuResult,
    to_host: unsafe extern "C" fn(*mut c_void, DevicePtr, usize) -> CuResult,
    to_device: unsafe extern "C" fn(DevicePtr, *const c_void, usize) -> CuResult,
    stream_sync: unsafe extern "C" fn(*mut c_void) -> CuResult,
}

/// The driver's entry points (its library is never closed).
pub struct Driver {
    api: Api,
    contexts: Result<ContextApi, LoadError>,
}

/// The driver, opened at the first call and kept for the process; `Err` where the NVIDIA
/// driver (or a release with every entry point used here) is not installed.
pub fn driver() -> Result<&'static Driver, LoadError> {
    static DRIVER: OnceLock<Result<Driver, LoadError>> = OnceLock::new();
    DRIVER.get_or_init(open).as_ref().map_err(Clone::clone)
}

fn open() -> Result<Driver, LoadError> {
    let library = Library::open("libcuda.so.1")?;
    // SAFETY: each symbol has the signature `cuda.h` declares for that name.
    unsafe {
        let api = Api {
            init: library.get(c"cuInit")?,
            driver_version: library.get(c"cuDriverGetVersion")?,
            error_string: library.optional(c"cuGetErrorString"),
            device_count: library.get(c"cuDeviceGetCount")?,
            device_get: library.get(c"cuDeviceGet")?,
        };
        let contexts = (|| {
            Ok(ContextApi {
                primary_retain: library.get(c"cuDevicePrimaryCtxRetain")?,
                primary_release: library.get(c"cuDevicePrimaryCtxRelease_v2")?,
                push: library.get(c"cuCtxPushCurrent_v2")?,
                pop: library.get(c"cuCtxPopCurrent_v2")?,
                ipc_open: library.get(c"cuIpcOpenMemHandle_v2")?,
                ipc_close: library.get(c"cuIpcCloseMemHandle")?,
                address_range: library.get(c"cuMemGetAddressRange_v2")?,
                to_host: library.get(c"cuMemcpyDtoH_v2")?,
                to_device: library.get(c"cuMemcpyHtoD_v2")?,
                stream_sync: library.get(c"cuStreamSynchronize")?,
            })
        })();
        Ok(Driver { api, contexts })
    }
}

impl Driver {
    /// `code` as the driver names it, or `Ok` for `CUDA_SUCCESS`.
    fn check(&self, code: CuResult) -> Result<(), DriverError> {
        if code == 0 {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        if let Some(error_string) = self.api.error_string {
            // SAFETY: cuGetErrorString writes a static NUL-terminated string, or null for
            // an unknown code.
            unsafe { error_string(code, &mut text) };
        }
        let text = if text.is_null() {
            "unknown error".into()
        } else {
            // SAFETY: as above.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        Err(DriverError::Call { code, text })
    }

    /// Starts the driver (`cuInit`; again is harmless).
    pub fn init(&self) -> Result<(), DriverError> {
        // SAFETY: cuInit takes flags, 0.
        self.check(unsafe { (self.api.init)(0) })
    }

    /// The newest CUDA version the driver supports (`1000 * major + 10 * minor`).
    pub fn version(&self) -> Result<i32, DriverError> {
        let mut version: c_int = 0;
        // SAFETY: an out-pointer to a local.
        self.check(unsafe { (self.api.driver_version)(&mut version) })?;
        Ok(version)
    }

    /// The GPUs it sees (after `init`).
    pub fn device_count(&self) -> Result<usize, DriverError> {
        let mut count: c_int = 0;
        // SAFETY: an out-pointer to a local.
        self.check(unsafe { (self.api.device_count)(&mut count) })?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    fn contexts(&self) -> Result<&ContextApi, DriverError> {
        self.contexts
            .as_ref()
            .map_err(|e| DriverError::Load(e.clone()))
    }

    /// GPU `ordinal`'s primary context, retained until dropped.
    pub fn primary_context(&'static self, ordinal: usize) -> Result<PrimaryContext, DriverError> {
        let contexts = self.contexts()?;
        let ordinal = c_int::try_from(ordinal).map_err(|_| DriverError::Call {
            code: ERROR_NO_DEVICE,
            text: format!("no GPU {ordinal}"),
        })?;
        let (mut device, mut context): (c_int, Context) = (0, std::ptr::null_mut());
        // SAFETY: out-pointers to locals; the retain is released by `PrimaryContext`'s drop.
        unsafe {
            self.check((self.api.device_get)(&mut device, ordinal))?;
            self.check((contexts.primary_retain)(&mut context, device))?;
        }
        Ok(PrimaryContext {
            driver: self,
            api: contexts,
            device,
            context,
        })
    }
}

/// The driver, started, and the GPUs it shows this process (none where
/// `CUDA_VISIBLE_DEVICES` hides them).
pub fn started() -> Result<(&'static Driver, usize), DriverError> {
    let driver = driver()?;
    driver.init()?;
    Ok((driver, driver.device_count()?))
}

/// What the driver said when started.
#[derive(Debug, Clone, PartialEq)]
pub enum DriverState {
    /// `cuInit` succeeded; the newest CUDA version the driver supports.
    Runs { cuda: i32 },
    /// `cuInit` failed with this code and message.
    Fails { code: i32, message: String },
    /// No `libcuda.so.1` (or one without the entry points used here).
    Absent,
}

/// Starts the driver and reads its CUDA version.
pub fn state() -> DriverState {
    let Ok(driver) = driver() else {
        return DriverState::Absent;
    };
    match driver.init().and_then(|()| driver.version()) {
        Ok(cuda) => DriverState::Runs { cuda },
        Err(DriverError::Call { code, text }) => DriverState::Fails {
            code,
            message: text,
        },
        Err(_) => DriverState::Absent,
    }
}

/// A device's primary context, retained.
pub struct PrimaryContext {
    driver: &'static Driver,
    api: &'static ContextApi,
    device: c_int,
    context: Context,
}

// SAFETY: a context is a process-wide driver object; each use makes it current on the
// calling thread first (`enter`).
unsafe impl Send for PrimaryContext {}
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    /// The context, current on this thread until the guard drops.
    pub fn enter(&self) -> Result<Current<'_>, DriverError> {
        // SAFETY: a context this process retained.
        self.driver
            .check(unsafe { (self.api.push)(self.context) })?;
        Ok(Current {
            api: self.api,
            _thread: PhantomData,
        })
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: releases the retain `primary_context` took.
        unsafe { (self.api.primary_release)(self.device) };
    }
}

/// A context made current on this thread; popped when dropped, on this thread (it is not
/// `Send`).
pub struct Current<'a> {
    api: &'a ContextApi,
    _thread: PhantomData<*const ()>,
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        let mut popped: Context = std::ptr::null_mut();
        // SAFETY: pops the context `enter` made current on this thread.
        unsafe { (self.api.pop)(&mut popped) };
    }
}

/// Device memory another process shared by CUDA IPC handle, mapped in a device's primary
/// context from the handle's address to the end of its allocation; every copy bounded by
/// that; unmapped when dropped.
pub struct IpcMemory {
    context: PrimaryContext,
    ptr: DevicePtr,
    size: u64,
}

impl IpcMemory {
    /// Maps `handle`'s allocation in `context`.
    pub fn open(
        context: PrimaryContext,
        handle: &[u8; IPC_HANDLE_BYTES],
    ) -> Result<IpcMemory, DriverError> {
        let (driver, api) = (context.driver, context.api);
        let (ptr, size) = {
            let _current = context.enter()?;
            let mut ptr: DevicePtr = 0;
            let handle = IpcHandle { reserved: *handle };
            // SAFETY: out-pointers to locals; the handle is passed by value as `cuda.h`
            // declares; the mapping is closed by `IpcMemory`'s drop, or here on error.
            unsafe {
                driver.check((api.ipc_open)(&mut ptr, handle, LAZY_ENABLE_PEER_ACCESS))?;
                let (mut base, mut size): (DevicePtr, usize) = (0, 0);
                let range = (api.address_range)(&mut base, &mut size, ptr);
                if let Err(e) = driver.check(range) {
                    (api.ipc_close)(ptr);
                    return Err(e);
                }
                // The handle names its allocation; the mapping starts at its base.
                (ptr, (base + size as u64).saturating_sub(ptr))
            }
        };
        Ok(IpcMemory { context, ptr, size })
    }

    /// Bytes from the mapped address to the end of its allocation.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The device address of `len` bytes at `offset`, which must lie inside the mapping.
    fn address(&self, offset: u64, len: usize) -> Result<DevicePtr, DriverError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size => Ok(self.ptr + offset),
            _ => Err(DriverError::OutOfRange {
                offset,
                len,
                size: self.size,
            }),
        }
    }

    /// Copies `out.len()` bytes at `offset` to `out`; done when it returns.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), DriverError> {
        let from = self.address(offset, out.len())?;
        let _current = self.context.enter()?;
        let (driver, api) = (self.context.driver, self.context.api);
        // SAFETY: `out` is writable for its length; the source lies inside the mapping.
        // A synchronous copy.
        driver.check(unsafe { (api.to_host)(out.as_mut_ptr().cast(), from, out.len()) })
    }

    /// Copies `data` to `offset`; in the client's memory when it returns.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), DriverError> {
        let to = self.address(offset, data.len())?;
        let _current = self.context.enter()?;
        let (driver, api) = (self.context.driver, self.context.api);
        // SAFETY: `data` is readable for its length; the target lies inside the mapping.
        // From pageable memory the copy returns once the data is staged: the legacy
        // default stream it ran on is waited for, so that the data is in the client's
        // memory before the answer says so.
        unsafe {
            driver.check((api.to_device)(to, data.as_ptr().cast(), data.len()))?;
            driver.check((api.stream_sync)(std::ptr::null_mut()))
        }
    }
}

impl Drop for IpcMemory {
    fn drop(&mut self) {
        if let Ok(_current) = self.context.enter() {
            // SAFETY: closes the mapping `open` made, in its context.
            unsafe { (self.context.api.ipc_close)(self.ptr) };
        }
        // `context` is released after this, by its own drop.
    }
}

#[cfg(test)]
mod tests {
    //! The driver path against a stand-in driver: one GPU whose memory is a host buffer, which
    //! refuses copies without a current context, as the real one does.
    use super::*;
    use std::cell::Cell;
    use std::sync::atomic::{AtomicI32, Ordering::SeqCst};
    use std::sync::Mutex;

    const BASE: DevicePtr = 0x7000_0000;
    const ALLOCATION: usize = 256;
    const INVALID_VALUE: CuResult = 1;
    const INVALID_CONTEXT: CuResult = 201;
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
    unsafe extern "C" fn init(_: c_uint) -> CuResult {
        0
    }
    unsafe extern "C" fn driver_version(v: *mut c_int) -> CuResult {
        *v = 13000;
        0
    }
    unsafe extern "C" fn device_count(n: *mut c_int) -> CuResult {
        *n = 1;
        0
    }
    unsafe extern "C" fn device_get(d: *mut c_int, ordinal: c_int) -> CuResult {
        *d = ordinal;
        if ordinal == 0 {
            0
        } else {
            101 // CUDA_ERROR_INVALID_DEVICE
        }
    }
    unsafe extern "C" fn retain(c: *mut Context, _: c_int) -> CuResult {
        RETAINED.fetch_add(1, SeqCst);
        *c = CONTEXT as Context;
        0
    }
    unsafe extern "C" fn release(_: c_int) -> CuResult {
        RETAINED.fetch_sub(1, SeqCst);
        0
    }
    unsafe extern "C" fn push(c: Context) -> CuResult {
        assert_eq!(c as usize, CONTEXT);
        PUSHED.with(|p| p.set(p.get() + 1));
        0
    }
    unsafe extern "C" fn pop(c: *mut Context) -> CuResult {
        PUSHED.with(|p| p.set(p.get() - 1));
        *c = CONTEXT as Context;
        0
    }
    unsafe extern "C" fn ipc_open(p: *mut DevicePtr, h: IpcHandle, flags: c_uint) -> CuResult {
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
    unsafe extern "C" fn ipc_close(p: DevicePtr) -> CuResult {
        assert_eq!(p, BASE + 16);
        if !current() {
            return INVALID_CONTEXT;
        }
        MAPPED.fetch_sub(1, SeqCst);
        0
    }
    unsafe extern "C" fn range(b: *mut DevicePtr, s: *mut usize, _: DevicePtr) -> CuResult {
        *b = BASE;
        *s = ALLOCATION;
        0
    }
    unsafe extern "C" fn to_host(h: *mut c_void, d: DevicePtr, n: usize) -> CuResult {
        if !current() {
            return INVALID_CONTEXT;
        }
        let start = (d - BASE) as usize;
        let memory = MEMORY.lock().unwrap();
        std::ptr::copy_nonoverlapping(memory[start..start + n].as_ptr(), h.cast(), n);
        0
    }
    unsafe extern "C" fn to_device(d: DevicePtr, h: *const c_void, n: usize) -> CuResult {
        if !current() {
            return INVALID_CONTEXT;
        }
        let start = (d - BASE) as usize;
        let mut memory = MEMORY.lock().unwrap();
        std::ptr::copy_nonoverlapping(h.cast(), memory[start..start + n].as_mut_ptr(), n);
        0
    }
    unsafe extern "C" fn stream_sync(stream: *mut c_void) -> CuResult {
        assert!(stream.is_null(), "the legacy default stream");
        if !current() {
            return INVALID_CONTEXT;
        }
        SYNCED.fetch_add(1, SeqCst);
        0
    }
    unsafe extern "C" fn error_string(code: CuResult, s: *mut *const c_char) -> CuResult {
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
            driver_version,
            error_string: Some(error_string),
            device_count,
            device_get,
        };
        let contexts = ContextApi {
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
        };
        let driver: &'static Driver = Box::leak(Box::new(Driver {
            api,
            contexts: Ok(contexts),
        }));
        driver.init().unwrap();
        assert_eq!(driver.device_count(), Ok(1));
        assert_eq!(driver.version(), Ok(13000));
        let open = |handle: &[u8; IPC_HANDLE_BYTES], device| {
            driver
                .primary_context(device)
                .and_then(|context| IpcMemory::open(context, handle))
        };
        let mut handle = [0u8; IPC_HANDLE_BYTES];
        handle[0] = 1;
        handle[63] = 63;
        MEMORY.lock().unwrap()[16..20].copy_from_slice(&[1, 2, 3, 4]);
        let memory = open(&handle, 0).unwrap();
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
        assert_eq!(
            e.to_string(),
            "2 bytes at 239 are outside the 240 bytes of the allocation"
        );
        let e = memory.read(u64::MAX, &mut out).unwrap_err();
        assert!(matches!(e, DriverError::OutOfRange { .. }), "{e}");
        assert!(!current());
        assert_eq!((MAPPED.load(SeqCst), RETAINED.load(SeqCst)), (1, 1));
        drop(memory);
        assert_eq!((MAPPED.load(SeqCst), RETAINED.load(SeqCst)), (0, 0));
        // A handle the driver refuses: its error, and nothing left retained.
        handle[63] = 0;
        let e = open(&handle, 0).err().unwrap();
        assert_eq!(e.to_string(), "invalid argument (CUDA error 1)");
        let e = open(&handle, 1).err().unwrap();
        assert_eq!(
            e,
            DriverError::Call {
                code: 101,
                text: "unknown error".into()
            }
        );
        assert_eq!((MAPPED.load(SeqCst), RETAINED.load(SeqCst)), (0, 0));
        assert!(!current());
    }
}
