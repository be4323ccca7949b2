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
mod cuda;
mod error;
mod region;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

pub use cuda::{CudaIpc, DeviceMemory, FakeCudaIpc, FakeMemory, HostGpus, NoGpus, HANDLE_BYTES};
pub use error::ShmError;
use region::{Memory, Region};

/// The most regions registered at once.
pub const MAX_REGIONS: usize = 1024;

/// The longest region name.
pub const MAX_NAME: usize = 255;

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
    pub(crate) fn text(self) -> &'static str {
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
        let c_key = region::object_key(name, key)?;
        self.insert(name, byte_size, || {
            region::open_object(name, key, &c_key, offset, byte_size)
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
