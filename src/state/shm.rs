//! Triton's shared memory: a client registers a region, then names it in an inference
//! request's `shared_memory_*` parameters instead of sending the tensor: inputs are read
//! from it, outputs written to it. A region is system shared memory (`byte_size` bytes at
//! `offset` of a POSIX shared-memory object the client created, found by its `shm_open`
//! key) or CUDA shared memory (GPU memory the client allocated, found by its CUDA IPC
//! handle, opened through [`CudaIpc`]); both kinds share one namespace, as in Triton.
//!
//! System regions are read and written through their object's file descriptor
//! (`pread`/`pwrite`), not mapped: a client that shrinks its object after registering would
//! turn a mapped read into SIGBUS and take the server down; here it gets an error. CUDA
//! regions are copied to and from the device, bounded by the allocation the driver reports
//! for the handle. Unregistering closes a region once the requests using it are done (they
//! hold an `Arc`); at exit the table is emptied. Off unless `--allow-client-shm=true`, as in
//! Triton.
use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::engine::cuda_ipc::{CudaIpc, DeviceMemory, HANDLE_BYTES};
use crate::error::{ErrorKind, HasKind};

/// The most regions registered at once.
pub const MAX_REGIONS: usize = 1024;

/// The longest region name.
pub const MAX_NAME: usize = 255;

/// Keys of the regions Triton's Python backend creates; refused as Triton does.
const RESERVED_PREFIX: &str = "triton_python_backend_shm_region_";

/// A registered system region, as the status APIs report it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct RegionStatus {
    pub name: String,
    /// The `shm_open` key of the object holding the region.
    pub key: String,
    /// Where the region starts in the object, in bytes.
    pub offset: u64,
    pub byte_size: u64,
}

/// A registered CUDA region, as the status APIs report it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct CudaRegionStatus {
    pub name: String,
    /// The GPU holding the region.
    pub device_id: u64,
    pub byte_size: u64,
}

/// The two kinds of region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShmKind {
    System,
    Cuda,
}

impl ShmKind {
    fn text(self) -> &'static str {
        match self {
            ShmKind::System => "system",
            ShmKind::Cuda => "CUDA",
        }
    }
}

/// A tensor's place in a region: the request parameters `shared_memory_region`,
/// `shared_memory_offset` (default 0) and `shared_memory_byte_size`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmRef {
    pub region: String,
    pub offset: u64,
    pub byte_size: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error(
        "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to \
         enable."
    )]
    Disabled,
    #[error("shared memory region '{0}' already in manager")]
    Exists(String),
    #[error("Unable to find system shared memory region: '{0}'")]
    NotFound(String),
    #[error("Unable to find cuda shared memory region: '{0}'")]
    CudaNotFound(String),
    /// A request names a region of neither kind.
    #[error("Unable to find shared memory region: '{0}'")]
    Unknown(String),
    #[error(
        "The region named '{name}' is registered as {is} shared memory, not {not} shared memory",
        is = .is.text(), not = .not.text()
    )]
    OtherKind {
        name: String,
        is: ShmKind,
        not: ShmKind,
    },
    #[error("a shared memory region's name is 1 to {MAX_NAME} bytes; got {0}")]
    BadName(usize),
    #[error(
        "at most {MAX_REGIONS} shared memory regions can be registered; unregister some first"
    )]
    TooMany,
    #[error("cannot register shared memory region '{name}' - invalid shm key '{key}': {why}")]
    BadKey {
        name: String,
        key: String,
        why: &'static str,
    },
    #[error("cannot register shared memory region '{name}': unable to open '{key}': {error}")]
    Open {
        name: String,
        key: String,
        error: std::io::Error,
    },
    #[error(
        "failed to register shared memory region '{name}': offset {offset} + byte_size \
         {byte_size} is beyond the {size} bytes of '{key}'"
    )]
    BeyondObject {
        name: String,
        key: String,
        offset: u64,
        byte_size: u64,
        size: u64,
    },
    #[error("failed to register CUDA shared memory region: '{0}', GPUs not supported")]
    NoGpus(String),
    #[error(
        "failed to register CUDA shared memory region '{name}': 'raw_handle' must be a valid \
         base64 encoded cudaIpcMemHandle_t ({HANDLE_BYTES} bytes); got {len} bytes"
    )]
    BadHandle { name: String, len: usize },
    #[error(
        "failed to register CUDA shared memory region '{name}': device_id {device_id} is not \
         a GPU of this server (it has {count})"
    )]
    NoDevice {
        name: String,
        device_id: i64,
        count: usize,
    },
    #[error(
        "failed to register CUDA shared memory region '{name}': cannot open its CUDA IPC \
         handle on GPU {device_id}: {error}"
    )]
    CudaOpen {
        name: String,
        device_id: usize,
        error: String,
    },
    #[error(
        "failed to register CUDA shared memory region '{name}': byte_size {byte_size} is \
         beyond the {size} bytes of the allocation its handle names"
    )]
    BeyondAllocation {
        name: String,
        byte_size: u64,
        size: u64,
    },
    #[error(
        "shared memory region '{region}' has {size} bytes: offset {offset} + byte_size \
         {byte_size} is outside it"
    )]
    OutsideRegion {
        region: String,
        offset: u64,
        byte_size: u64,
        size: u64,
    },
    #[error(
        "shared memory region '{region}': its object '{key}' is now {size} bytes, smaller \
         than the region registered on it; register it again"
    )]
    Shrunk {
        region: String,
        key: String,
        size: u64,
    },
    #[error(
        "shared memory size specified with the request for output '{output}' ({byte_size} \
         bytes) should be at least {needed} bytes to hold the results"
    )]
    OutputTooSmall {
        output: String,
        byte_size: u64,
        needed: u64,
    },
    #[error(
        "shared memory for input '{input}' is {byte_size} bytes; one request may carry at \
         most {limit} (--max-body-bytes)"
    )]
    InputTooLarge {
        input: String,
        byte_size: u64,
        limit: u64,
    },
    #[error("cannot hold the {byte_size} bytes of input '{input}' now: out of memory")]
    OutOfMemory { input: String, byte_size: u64 },
    #[error("shared memory region '{region}': {error}")]
    Io {
        region: String,
        error: std::io::Error,
    },
    #[error("CUDA shared memory region '{region}': the copy failed: {error}")]
    Copy { region: String, error: String },
}

impl HasKind for ShmError {
    fn kind(&self) -> ErrorKind {
        match self {
            // Off on this server: a deployment's choice, refused as a closed API is.
            ShmError::Disabled => ErrorKind::Forbidden,
            ShmError::NotFound(_)
            | ShmError::CudaNotFound(_)
            | ShmError::Unknown(_)
            | ShmError::OtherKind { .. } => ErrorKind::NotFound,
            ShmError::InputTooLarge { .. } => ErrorKind::PayloadTooLarge,
            ShmError::OutOfMemory { .. } => ErrorKind::Overloaded,
            ShmError::Io { .. } | ShmError::Copy { .. } => ErrorKind::Internal,
            _ => ErrorKind::InvalidInput,
        }
    }
}

struct Region {
    name: String,
    byte_size: u64,
    memory: Memory,
}

/// Where a region's bytes are.
enum Memory {
    /// `offset` is where the region starts in the object `key` opened as `file`.
    System {
        key: String,
        offset: u64,
        file: File,
    },
    /// GPU memory, opened from a client's handle; closed when dropped.
    Cuda {
        device_id: u64,
        memory: Box<dyn DeviceMemory>,
    },
}

impl Region {
    fn kind(&self) -> ShmKind {
        match self.memory {
            Memory::System { .. } => ShmKind::System,
            Memory::Cuda { .. } => ShmKind::Cuda,
        }
    }

    /// Checks `at` against the region (and a system region's object, at its current size),
    /// and returns where it starts in the region's memory.
    fn locate(&self, at: &ShmRef) -> Result<u64, ShmError> {
        let size = self.byte_size;
        let outside = || ShmError::OutsideRegion {
            region: at.region.clone(),
            offset: at.offset,
            byte_size: at.byte_size,
            size,
        };
        let end = at.offset.checked_add(at.byte_size).ok_or_else(outside)?;
        if end > size || (at.offset >= size && at.byte_size > 0) {
            return Err(outside());
        }
        let Memory::System { key, offset, .. } = &self.memory else {
            return Ok(at.offset);
        };
        let object = self.object_size()?;
        if offset + size > object {
            return Err(ShmError::Shrunk {
                region: at.region.clone(),
                key: key.clone(),
                size: object,
            });
        }
        Ok(offset + at.offset)
    }

    /// A system region's object's size now (0 for a CUDA region).
    fn object_size(&self) -> Result<u64, ShmError> {
        match &self.memory {
            Memory::System { file, .. } => file.metadata().map(|m| m.len()).map_err(|e| self.io(e)),
            Memory::Cuda { .. } => Ok(0),
        }
    }

    fn io(&self, error: std::io::Error) -> ShmError {
        ShmError::Io {
            region: self.name.clone(),
            error,
        }
    }

    fn copy(&self, error: String) -> ShmError {
        ShmError::Copy {
            region: self.name.clone(),
            error,
        }
    }

    /// Fills `out` from `start` (from `locate`).
    fn read(&self, start: u64, out: &mut [u8]) -> Result<(), ShmError> {
        match &self.memory {
            Memory::System { key, file, .. } => {
                file.read_exact_at(out, start)
                    .map_err(|error| match error.kind() {
                        // The object shrank after the place was checked.
                        std::io::ErrorKind::UnexpectedEof => ShmError::Shrunk {
                            region: self.name.clone(),
                            key: key.clone(),
                            size: self.object_size().unwrap_or(0),
                        },
                        _ => self.io(error),
                    })
            }
            Memory::Cuda { memory, .. } => memory.read(start, out).map_err(|e| self.copy(e)),
        }
    }

    /// Writes `data` at `start` (from `locate`).
    fn write(&self, start: u64, data: &[u8]) -> Result<(), ShmError> {
        match &self.memory {
            Memory::System { file, .. } => file.write_all_at(data, start).map_err(|e| self.io(e)),
            Memory::Cuda { memory, .. } => memory.write(start, data).map_err(|e| self.copy(e)),
        }
    }
}

/// The registered regions (one table for both transports and both kinds).
pub struct SharedMemory {
    allowed: bool,
    /// The GPUs' memory clients share by handle.
    cuda: Arc<dyn CudaIpc>,
    regions: Mutex<BTreeMap<String, Arc<Region>>>,
}

impl SharedMemory {
    /// `allowed`: clients may register regions (`--allow-client-shm`); `cuda`: how CUDA
    /// regions are opened.
    pub fn new(allowed: bool, cuda: Arc<dyn CudaIpc>) -> Self {
        SharedMemory {
            allowed,
            cuda,
            regions: Mutex::default(),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<Region>>> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether clients may use shared memory here: `Disabled` when they may not.
    pub fn allowed(&self) -> Result<(), ShmError> {
        if self.allowed {
            Ok(())
        } else {
            Err(ShmError::Disabled)
        }
    }

    /// Adds region `name` of `byte_size` bytes, its memory opened by `open` once the name
    /// is known to be free. Opened without the table's lock (a driver call can take long,
    /// and every request naming a region takes the lock), so the name and the count are
    /// checked again after; a region opened for a name taken meanwhile is closed.
    fn insert(
        &self,
        name: &str,
        byte_size: u64,
        open: impl FnOnce() -> Result<Memory, ShmError>,
    ) -> Result<(), ShmError> {
        let free = |table: &BTreeMap<String, Arc<Region>>| {
            if table.contains_key(name) {
                Err(ShmError::Exists(name.to_string()))
            } else if table.len() >= MAX_REGIONS {
                Err(ShmError::TooMany)
            } else {
                Ok(())
            }
        };
        free(&self.table())?;
        let region = Region {
            name: name.to_string(),
            byte_size,
            memory: open()?,
        };
        let kind = region.kind().text();
        let mut table = self.table();
        free(&table)?;
        tracing::debug!(region = name, byte_size, kind, "shared memory registered");
        table.insert(name.to_string(), Arc::new(region));
        Ok(())
    }

    fn check_name(&self, name: &str) -> Result<(), ShmError> {
        self.allowed()?;
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(ShmError::BadName(name.len()));
        }
        Ok(())
    }

    /// Registers `byte_size` bytes at `offset` of the object `key` as system region `name`.
    pub fn register(
        &self,
        name: &str,
        key: &str,
        offset: u64,
        byte_size: u64,
    ) -> Result<(), ShmError> {
        self.check_name(name)?;
        let bad_key = |why| ShmError::BadKey {
            name: name.to_string(),
            key: key.to_string(),
            why,
        };
        let bare = key.trim_start_matches('/');
        if bare.is_empty() || bare == "." || bare == ".." || bare.contains('/') {
            return Err(bad_key(
                "a key is one name, optionally after a leading '/' (e.g. '/input_data')",
            ));
        }
        if key.len() > MAX_NAME + 1 {
            return Err(bad_key("longer than 256 bytes"));
        }
        if bare.starts_with(RESERVED_PREFIX) {
            return Err(bad_key(
                "the prefix 'triton_python_backend_shm_region_' is reserved",
            ));
        }
        let c_key = CString::new(key).map_err(|_| bad_key("it contains a NUL byte"))?;
        self.insert(name, byte_size, || {
            let open_error = |error| ShmError::Open {
                name: name.to_string(),
                key: key.to_string(),
                error,
            };
            // SAFETY: `c_key` is a NUL-terminated string that outlives the call; the mode is
            // ignored without O_CREAT (glibc adds O_NOFOLLOW | O_CLOEXEC).
            let fd = unsafe { libc::shm_open(c_key.as_ptr(), libc::O_RDWR, 0) };
            if fd < 0 {
                return Err(open_error(std::io::Error::last_os_error()));
            }
            // SAFETY: `fd` was just opened and is owned by nothing else.
            let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
            let meta = file.metadata().map_err(open_error)?;
            if !meta.is_file() {
                return Err(bad_key("not a shared-memory object"));
            }
            let beyond = offset
                .checked_add(byte_size)
                .is_none_or(|end| end > meta.len());
            if beyond {
                return Err(ShmError::BeyondObject {
                    name: name.to_string(),
                    key: key.to_string(),
                    offset,
                    byte_size,
                    size: meta.len(),
                });
            }
            Ok(Memory::System {
                key: key.to_string(),
                offset,
                file,
            })
        })
    }

    /// Registers the first `byte_size` bytes of the GPU allocation `raw_handle` (a CUDA IPC
    /// handle) names, on GPU `device_id`, as CUDA region `name`.
    pub fn register_cuda(
        &self,
        name: &str,
        raw_handle: &[u8],
        device_id: i64,
        byte_size: u64,
    ) -> Result<(), ShmError> {
        self.check_name(name)?;
        let count = self.cuda.device_count();
        if count == 0 {
            return Err(ShmError::NoGpus(name.to_string()));
        }
        let handle: &[u8; HANDLE_BYTES] =
            raw_handle.try_into().map_err(|_| ShmError::BadHandle {
                name: name.to_string(),
                len: raw_handle.len(),
            })?;
        let device = usize::try_from(device_id)
            .ok()
            .filter(|d| *d < count)
            .ok_or_else(|| ShmError::NoDevice {
                name: name.to_string(),
                device_id,
                count,
            })?;
        self.insert(name, byte_size, || {
            let memory = self
                .cuda
                .open(handle, device)
                .map_err(|error| ShmError::CudaOpen {
                    name: name.to_string(),
                    device_id: device,
                    error,
                })?;
            if byte_size > memory.size() {
                return Err(ShmError::BeyondAllocation {
                    name: name.to_string(),
                    byte_size,
                    size: memory.size(),
                });
            }
            Ok(Memory::Cuda {
                device_id: device as u64,
                memory,
            })
        })
    }

    /// Unregisters `kind` region `name` (nothing to do when no region of that kind has the
    /// name, as Triton). Requests reading or writing it finish first; it closes after them.
    pub fn unregister(&self, kind: ShmKind, name: &str) -> Result<(), ShmError> {
        self.allowed()?;
        let mut table = self.table();
        let removed = match table.get(name) {
            Some(r) if r.kind() == kind => table.remove(name),
            _ => None,
        };
        // Closed (a driver call for a CUDA region) without the table's lock.
        drop(table);
        drop(removed);
        Ok(())
    }

    /// Unregisters every region of `kind`.
    pub fn unregister_all(&self, kind: ShmKind) -> Result<(), ShmError> {
        self.allowed()?;
        let mut table = self.table();
        let (removed, kept) = std::mem::take(&mut *table)
            .into_iter()
            .partition::<BTreeMap<_, _>, _>(|(_, r)| r.kind() == kind);
        *table = kept;
        drop(table);
        drop(removed);
        Ok(())
    }

    /// Empties the table (at exit); returns how many regions were registered.
    pub fn close_all(&self) -> usize {
        let regions = std::mem::take(&mut *self.table());
        regions.len()
    }

    /// The regions of `kind`: every one, or the one called `name`.
    fn regions(&self, kind: ShmKind, name: Option<&str>) -> Result<Vec<Arc<Region>>, ShmError> {
        let table = self.table();
        let Some(name) = name else {
            return Ok(table
                .values()
                .filter(|r| r.kind() == kind)
                .cloned()
                .collect());
        };
        match table.get(name) {
            Some(r) if r.kind() == kind => Ok(vec![r.clone()]),
            Some(r) => Err(ShmError::OtherKind {
                name: name.to_string(),
                is: r.kind(),
                not: kind,
            }),
            None if kind == ShmKind::Cuda => Err(ShmError::CudaNotFound(name.to_string())),
            None => Err(ShmError::NotFound(name.to_string())),
        }
    }

    /// Every system region, or the one called `name`, by name.
    pub fn status(&self, name: Option<&str>) -> Result<Vec<RegionStatus>, ShmError> {
        let regions = self.regions(ShmKind::System, name)?;
        Ok(regions
            .iter()
            .filter_map(|r| match &r.memory {
                Memory::System { key, offset, .. } => Some(RegionStatus {
                    name: r.name.clone(),
                    key: key.clone(),
                    offset: *offset,
                    byte_size: r.byte_size,
                }),
                Memory::Cuda { .. } => None,
            })
            .collect())
    }

    /// Every CUDA region, or the one called `name`, by name.
    pub fn cuda_status(&self, name: Option<&str>) -> Result<Vec<CudaRegionStatus>, ShmError> {
        let regions = self.regions(ShmKind::Cuda, name)?;
        Ok(regions
            .iter()
            .filter_map(|r| match &r.memory {
                Memory::Cuda { device_id, .. } => Some(CudaRegionStatus {
                    name: r.name.clone(),
                    device_id: *device_id,
                    byte_size: r.byte_size,
                }),
                Memory::System { .. } => None,
            })
            .collect())
    }

    /// The place `at` names, checked against its region (of either kind).
    pub fn place(&self, at: &ShmRef) -> Result<Place, ShmError> {
        let region = self
            .table()
            .get(&at.region)
            .cloned()
            .ok_or_else(|| ShmError::Unknown(at.region.clone()))?;
        let start = region.locate(at)?;
        Ok(Place {
            region,
            at: at.clone(),
            start,
        })
    }
}

/// A checked place in a registered region. It keeps the region open while it lives, even
/// if the region is unregistered meanwhile. Reading and writing are blocking (file I/O, or
/// a synchronous copy from or to a GPU).
pub struct Place {
    region: Arc<Region>,
    at: ShmRef,
    /// Where it starts in the region's memory.
    start: u64,
}

impl Place {
    pub fn at(&self) -> &ShmRef {
        &self.at
    }

    /// Whether the place is in GPU memory (its copies are driver calls).
    pub fn on_gpu(&self) -> bool {
        self.region.kind() == ShmKind::Cuda
    }

    /// The bytes of input `input`; at most `limit` of them.
    pub fn read(&self, input: &str, limit: u64) -> Result<Bytes, ShmError> {
        let at = &self.at;
        if at.byte_size > limit {
            return Err(ShmError::InputTooLarge {
                input: input.to_string(),
                byte_size: at.byte_size,
                limit,
            });
        }
        let mut data = Vec::new();
        // A failed allocation is this request's error, not the process's end.
        data.try_reserve_exact(at.byte_size as usize)
            .map_err(|_| ShmError::OutOfMemory {
                input: input.to_string(),
                byte_size: at.byte_size,
            })?;
        data.resize(at.byte_size as usize, 0);
        self.region.read(self.start, &mut data)?;
        Ok(data.into())
    }

    /// Writes output `output` (`data`), which must fit.
    pub fn write(&self, output: &str, data: &[u8]) -> Result<(), ShmError> {
        if data.len() as u64 > self.at.byte_size {
            return Err(ShmError::OutputTooSmall {
                output: output.to_string(),
                byte_size: self.at.byte_size,
                needed: data.len() as u64,
            });
        }
        // Checked again: a system region's object may have shrunk since (a write past its
        // end would grow it back).
        self.region.locate(&self.at)?;
        self.region.write(self.start, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cuda_ipc::{FakeCudaIpc, NoGpus};

    /// A shared-memory object of `size` bytes, unlinked when dropped.
    struct Object {
        key: String,
        file: File,
    }

    impl Object {
        fn new(tag: &str, size: u64) -> Object {
            let key = format!("/visiongate-test-{tag}-{}", std::process::id());
            let c = CString::new(key.clone()).unwrap();
            // SAFETY: a valid NUL-terminated name; the fd is owned by the File below.
            let fd = unsafe {
                libc::shm_open(
                    c.as_ptr(),
                    libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
                    0o600,
                )
            };
            assert!(fd >= 0, "{}", std::io::Error::last_os_error());
            let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
            file.set_len(size).unwrap();
            Object { key, file }
        }
    }

    impl Drop for Object {
        fn drop(&mut self) {
            let c = CString::new(self.key.clone()).unwrap();
            // SAFETY: a valid NUL-terminated name.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }

    fn at(region: &str, offset: u64, byte_size: u64) -> ShmRef {
        ShmRef {
            region: region.into(),
            offset,
            byte_size,
        }
    }

    /// How many descriptors of `key`'s object this process holds.
    fn descriptors(key: &str) -> usize {
        let target = format!("/dev/shm/{}", key.trim_start_matches('/'));
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter(|e| {
                let link = std::fs::read_link(e.as_ref().unwrap().path());
                link.is_ok_and(|p| p.to_string_lossy() == target)
            })
            .count()
    }

    #[test]
    fn regions_read_and_write_inside_their_bounds_only() {
        let object = Object::new("bounds", 64);
        object.file.write_all_at(&[7; 16], 32).unwrap();
        let shm = SharedMemory::new(true, Arc::new(NoGpus));
        shm.register("r", &object.key, 16, 32).unwrap();
        let read = |place: ShmRef, limit| shm.place(&place)?.read("in", limit);
        let write = |place: ShmRef, data: &[u8]| shm.place(&place)?.write("out", data);
        // Region byte 16 is object byte 32.
        assert_eq!(&read(at("r", 16, 16), 1 << 20).unwrap()[..], &[7; 16]);
        write(at("r", 0, 4), &[1, 2, 3]).unwrap();
        let mut back = [0; 4];
        object.file.read_exact_at(&mut back, 16).unwrap();
        assert_eq!(back, [1, 2, 3, 0]);
        let e = read(at("r", 16, 17), 1 << 20).unwrap_err();
        assert!(matches!(e, ShmError::OutsideRegion { .. }), "{e}");
        let e = read(at("r", u64::MAX, 2), 1 << 20).unwrap_err();
        assert!(matches!(e, ShmError::OutsideRegion { .. }), "{e}");
        let e = read(at("r", 0, 32), 31).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PayloadTooLarge, "{e}");
        let e = write(at("r", 0, 2), &[1, 2, 3]).unwrap_err();
        assert!(
            e.to_string().contains("(2 bytes) should be at least 3"),
            "{e}"
        );
        let e = read(at("nope", 0, 1), 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
    }

    #[test]
    fn registration_checks_key_name_and_object_size() {
        let object = Object::new("register", 100);
        let shm = SharedMemory::new(true, Arc::new(NoGpus));
        let e = shm.register("r", &object.key, 50, 51).unwrap_err();
        assert!(e.to_string().contains("beyond the 100 bytes"), "{e}");
        let e = shm.register("r", &object.key, u64::MAX, 2).unwrap_err();
        assert!(matches!(e, ShmError::BeyondObject { .. }), "{e}");
        shm.register("r", &object.key, 50, 50).unwrap();
        let e = shm.register("r", &object.key, 0, 1).unwrap_err();
        assert!(e.to_string().contains("already in manager"), "{e}");
        for key in [
            "",
            "/",
            "../etc/passwd",
            "/a/b",
            "/triton_python_backend_shm_region_1",
        ] {
            let e = shm.register("k", key, 0, 0).unwrap_err();
            assert!(matches!(e, ShmError::BadKey { .. }), "{key}: {e}");
        }
        let e = shm
            .register("k", "/visiongate-no-such-object", 0, 0)
            .unwrap_err();
        assert!(matches!(e, ShmError::Open { .. }), "{e}");
        assert_eq!(
            shm.status(None).unwrap(),
            vec![RegionStatus {
                name: "r".into(),
                key: object.key.clone(),
                offset: 50,
                byte_size: 50
            }]
        );
        assert_eq!(
            shm.status(Some("k")).unwrap_err().kind(),
            ErrorKind::NotFound
        );
    }

    #[test]
    fn a_shrunk_object_is_an_error_not_a_crash() {
        let object = Object::new("shrink", 4096);
        let shm = SharedMemory::new(true, Arc::new(NoGpus));
        shm.register("r", &object.key, 0, 4096).unwrap();
        // Shrunk before the place is checked, and between the check and the I/O.
        let checked = shm.place(&at("r", 0, 4096)).unwrap();
        object.file.set_len(100).unwrap();
        let e = shm.place(&at("r", 0, 200)).err().unwrap();
        assert!(e.to_string().contains("now 100 bytes"), "{e}");
        let e = checked.read("in", 1 << 20).unwrap_err();
        assert!(e.to_string().contains("now 100 bytes"), "{e}");
        let e = checked.write("out", &[1]).unwrap_err();
        assert!(matches!(e, ShmError::Shrunk { .. }), "{e}");
        assert_eq!(object.file.metadata().unwrap().len(), 100, "not grown back");
    }

    #[test]
    fn unregistering_closes_the_object_once_its_requests_are_done() {
        let object = Object::new("close", 16);
        let shm = SharedMemory::new(true, Arc::new(NoGpus));
        shm.register("a", &object.key, 0, 8).unwrap();
        shm.register("b", &object.key, 8, 8).unwrap();
        // The test's own descriptor, and one a region.
        assert_eq!(descriptors(&object.key), 3);
        let in_flight = shm.place(&at("a", 0, 8)).unwrap();
        shm.unregister(ShmKind::System, "a").unwrap();
        shm.unregister(ShmKind::System, "never-registered").unwrap();
        assert_eq!(shm.status(None).unwrap().len(), 1);
        assert_eq!(descriptors(&object.key), 3, "a request still uses 'a'");
        drop(in_flight);
        assert_eq!(descriptors(&object.key), 2);
        assert_eq!(shm.close_all(), 1);
        assert_eq!(descriptors(&object.key), 1);
        shm.register("a", &object.key, 0, 8).unwrap();
        shm.unregister_all(ShmKind::System).unwrap();
        assert_eq!(descriptors(&object.key), 1);
    }

    #[test]
    fn without_the_flag_nothing_is_registered() {
        let object = Object::new("off", 16);
        let shm = SharedMemory::new(false, Arc::new(NoGpus));
        let e = shm.register("r", &object.key, 0, 8).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Forbidden);
        assert!(e.to_string().contains("--allow-client-shm=true"), "{e}");
        assert_eq!(
            shm.unregister_all(ShmKind::System).unwrap_err().kind(),
            ErrorKind::Forbidden
        );
        assert!(shm.status(None).unwrap().is_empty());
    }

    #[test]
    fn cuda_regions_are_opened_by_handle_and_bounded_by_their_allocation() {
        let gpus = Arc::new(FakeCudaIpc::new(2));
        let (handle, memory) = gpus.share(1, 64);
        memory.lock().unwrap()[32..48].copy_from_slice(&[7; 16]);
        let shm = SharedMemory::new(true, gpus.clone());
        // The handle's allocation is on GPU 1: opened there only.
        let e = shm.register_cuda("r", &handle, 0, 64).unwrap_err();
        assert!(
            e.to_string()
                .contains("on GPU 0: the handle's memory is on GPU 1"),
            "{e}"
        );
        let e = shm.register_cuda("r", &handle, 1, 65).unwrap_err();
        assert!(
            e.to_string()
                .contains("byte_size 65 is beyond the 64 bytes"),
            "{e}"
        );
        for device in [2, -1] {
            let e = shm.register_cuda("r", &handle, device, 8).unwrap_err();
            assert!(
                e.to_string()
                    .contains("is not a GPU of this server (it has 2)"),
                "{e}"
            );
        }
        let e = shm.register_cuda("r", &handle[..63], 1, 8).unwrap_err();
        assert!(matches!(e, ShmError::BadHandle { len: 63, .. }), "{e}");
        let e = shm.register_cuda("r", &[9; 64], 1, 8).unwrap_err();
        assert!(
            e.to_string()
                .contains("cannot open its CUDA IPC handle on GPU 1"),
            "{e}"
        );
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        shm.register_cuda("r", &handle, 1, 48).unwrap();
        let read = |place: ShmRef, limit| shm.place(&place)?.read("in", limit);
        let write = |place: ShmRef, data: &[u8]| shm.place(&place)?.write("out", data);
        assert_eq!(&read(at("r", 32, 16), 1 << 20).unwrap()[..], &[7; 16]);
        write(at("r", 4, 8), &[1, 2, 3]).unwrap();
        assert_eq!(&memory.lock().unwrap()[3..8], &[0, 1, 2, 3, 0]);
        // Bounded by the region registered, not the allocation behind it.
        let e = read(at("r", 40, 16), 1 << 20).unwrap_err();
        assert!(matches!(e, ShmError::OutsideRegion { size: 48, .. }), "{e}");
        let e = write(at("r", 0, 2), &[1, 2, 3]).unwrap_err();
        assert!(matches!(e, ShmError::OutputTooSmall { .. }), "{e}");
        assert_eq!(
            shm.cuda_status(None).unwrap(),
            vec![CudaRegionStatus {
                name: "r".into(),
                device_id: 1,
                byte_size: 48
            }]
        );
    }

    #[test]
    fn system_and_cuda_regions_share_names_but_not_status_or_unregister() {
        let object = Object::new("kinds", 16);
        let gpus = Arc::new(FakeCudaIpc::new(1));
        let (handle, _) = gpus.share(0, 16);
        let shm = SharedMemory::new(true, gpus);
        shm.register("sys", &object.key, 0, 16).unwrap();
        shm.register_cuda("gpu", &handle, 0, 16).unwrap();
        let e = shm.register_cuda("sys", &handle, 0, 16).unwrap_err();
        assert!(e.to_string().contains("'sys' already in manager"), "{e}");
        let e = shm.register("gpu", &object.key, 0, 16).unwrap_err();
        assert!(matches!(e, ShmError::Exists(_)), "{e}");
        assert_eq!(shm.status(None).unwrap().len(), 1);
        assert_eq!(shm.cuda_status(None).unwrap().len(), 1);
        let e = shm.cuda_status(Some("sys")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "The region named 'sys' is registered as system shared memory, not CUDA shared memory"
        );
        assert_eq!(e.kind(), ErrorKind::NotFound);
        let e = shm.status(Some("gpu")).unwrap_err();
        assert!(
            e.to_string().contains("registered as CUDA shared memory"),
            "{e}"
        );
        let e = shm.cuda_status(Some("none")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Unable to find cuda shared memory region: 'none'"
        );
        // Unregistering names a kind: a region of the other kind stays.
        shm.unregister(ShmKind::Cuda, "sys").unwrap();
        shm.unregister(ShmKind::System, "gpu").unwrap();
        shm.unregister_all(ShmKind::Cuda).unwrap();
        assert_eq!(shm.status(None).unwrap().len(), 1);
        assert!(shm.cuda_status(None).unwrap().is_empty());
        // Either kind serves a request's place.
        shm.register_cuda("gpu", &handle, 0, 16).unwrap();
        shm.place(&at("gpu", 0, 16)).unwrap();
        shm.place(&at("sys", 0, 16)).unwrap();
    }

    #[test]
    fn a_client_filling_the_table_is_refused_while_its_regions_still_serve() {
        let gpus = Arc::new(FakeCudaIpc::new(1));
        let (handle, memory) = gpus.share(0, 16);
        memory.lock().unwrap()[..4].copy_from_slice(&[1, 2, 3, 4]);
        let shm = SharedMemory::new(true, gpus);
        for i in 0..MAX_REGIONS {
            shm.register_cuda(&format!("r{i}"), &handle, 0, 16).unwrap();
        }
        let e = shm.register_cuda("one-more", &handle, 0, 16).unwrap_err();
        assert!(matches!(e, ShmError::TooMany), "{e}");
        let object = Object::new("full", 16);
        let e = shm.register("sys", &object.key, 0, 16).unwrap_err();
        assert!(matches!(e, ShmError::TooMany), "{e}");
        let place = shm.place(&at("r0", 0, 4)).unwrap();
        assert_eq!(&place.read("in", 1 << 20).unwrap()[..], &[1, 2, 3, 4]);
        shm.unregister(ShmKind::Cuda, "r0").unwrap();
        shm.register("sys", &object.key, 0, 16).unwrap();
    }

    #[test]
    fn without_gpus_or_the_flag_no_cuda_region_is_registered() {
        let shm = SharedMemory::new(true, Arc::new(NoGpus));
        let e = shm.register_cuda("r", &[0; 64], 0, 8).unwrap_err();
        assert_eq!(
            e.to_string(),
            "failed to register CUDA shared memory region: 'r', GPUs not supported"
        );
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        let gpus = Arc::new(FakeCudaIpc::new(1));
        let (handle, _) = gpus.share(0, 16);
        let shm = SharedMemory::new(false, gpus);
        let e = shm.register_cuda("r", &handle, 0, 8).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Forbidden);
        assert!(shm.cuda_status(None).unwrap().is_empty());
    }
}
