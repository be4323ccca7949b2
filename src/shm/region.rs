//! A registered region and where its bytes are: a POSIX shared-memory object read and
//! written through its descriptor, or GPU memory copied to and from through the driver.
use std::ffi::{CStr, CString};
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

use super::cuda::DeviceMemory;
use super::{ShmError, ShmKind, ShmRef, MAX_NAME};

/// Keys of the regions Triton's Python backend creates; refused as Triton does.
const RESERVED_PREFIX: &str = "triton_python_backend_shm_region_";

pub(super) struct Region {
    pub name: String,
    pub byte_size: u64,
    pub memory: Memory,
}

/// Where a region's bytes are.
pub(super) enum Memory {
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
    pub(super) fn kind(&self) -> ShmKind {
        match self.memory {
            Memory::System { .. } => ShmKind::System,
            Memory::Cuda { .. } => ShmKind::Cuda,
        }
    }

    /// Checks `at` against the region (and a system region's object, at its current size),
    /// and returns where it starts in the region's memory.
    pub(super) fn locate(&self, at: &ShmRef) -> Result<u64, ShmError> {
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
    pub(super) fn read(&self, start: u64, out: &mut [u8]) -> Result<(), ShmError> {
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
    pub(super) fn write(&self, start: u64, data: &[u8]) -> Result<(), ShmError> {
        match &self.memory {
            Memory::System { file, .. } => file.write_all_at(data, start).map_err(|e| self.io(e)),
            Memory::Cuda { memory, .. } => memory.write(start, data).map_err(|e| self.copy(e)),
        }
    }
}

/// The `shm_open` key of a system region `name`'s object, checked: one name, not one of
/// Triton's Python backend's.
pub(super) fn object_key(name: &str, key: &str) -> Result<CString, ShmError> {
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
    CString::new(key).map_err(|_| bad_key("it contains a NUL byte"))
}

/// `byte_size` bytes at `offset` of the object `key` (`c_key`), opened, for region `name`.
pub(super) fn open_object(
    name: &str,
    key: &str,
    c_key: &CStr,
    offset: u64,
    byte_size: u64,
) -> Result<Memory, ShmError> {
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
        return Err(ShmError::BadKey {
            name: name.to_string(),
            key: key.to_string(),
            why: "not a shared-memory object",
        });
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
}
