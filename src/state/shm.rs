//! Triton's system shared memory: a client registers a region (a name for `byte_size` bytes
//! at `offset` of a POSIX shared-memory object it created, found by its `shm_open` key), then
//! names it in an inference request's `shared_memory_*` parameters instead of sending the
//! tensor: inputs are read from it, outputs written to it.
//!
//! Regions are read and written through their object's file descriptor (`pread`/`pwrite`),
//! not mapped: a client that shrinks its object after registering would turn a mapped read
//! into SIGBUS and take the server down; here it gets an error. Unregistering closes the
//! descriptor once the requests using the region are done (they hold an `Arc`); at exit
//! the table is emptied. Off unless `--allow-client-shm=true`, as in Triton.
use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::error::{ErrorKind, HasKind};

/// The most regions registered at once.
pub const MAX_REGIONS: usize = 1024;

/// The longest region name.
pub const MAX_NAME: usize = 255;

/// Keys of the regions Triton's Python backend creates; refused as Triton does.
const RESERVED_PREFIX: &str = "triton_python_backend_shm_region_";

/// A registered region, as the status APIs report it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct RegionStatus {
    pub name: String,
    /// The `shm_open` key of the object holding the region.
    pub key: String,
    /// Where the region starts in the object, in bytes.
    pub offset: u64,
    pub byte_size: u64,
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
    #[error(
        "CUDA shared memory is not supported by visiongate: use system shared memory \
         (--allow-client-shm=true) or send the tensors in the request"
    )]
    Cuda,
    #[error("shared memory region '{0}' already in manager")]
    Exists(String),
    #[error("Unable to find system shared memory region: '{0}'")]
    NotFound(String),
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
}

impl HasKind for ShmError {
    fn kind(&self) -> ErrorKind {
        match self {
            // Off on this server: a deployment's choice, refused as a closed API is.
            ShmError::Disabled => ErrorKind::Forbidden,
            ShmError::Cuda => ErrorKind::Unsupported,
            ShmError::NotFound(_) => ErrorKind::NotFound,
            ShmError::InputTooLarge { .. } => ErrorKind::PayloadTooLarge,
            ShmError::OutOfMemory { .. } => ErrorKind::Overloaded,
            ShmError::Io { .. } => ErrorKind::Internal,
            _ => ErrorKind::InvalidInput,
        }
    }
}

struct Region {
    status: RegionStatus,
    file: File,
}

impl Region {
    /// Checks `at` against the region and the object's current size, and returns where it
    /// starts in the object.
    fn locate(&self, at: &ShmRef) -> Result<u64, ShmError> {
        let size = self.status.byte_size;
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
        let object = self.object_size()?;
        if self.status.offset + size > object {
            return Err(ShmError::Shrunk {
                region: at.region.clone(),
                key: self.status.key.clone(),
                size: object,
            });
        }
        Ok(self.status.offset + at.offset)
    }

    fn object_size(&self) -> Result<u64, ShmError> {
        self.file
            .metadata()
            .map(|m| m.len())
            .map_err(|error| self.io(error))
    }

    fn io(&self, error: std::io::Error) -> ShmError {
        ShmError::Io {
            region: self.status.name.clone(),
            error,
        }
    }
}

/// The registered regions (one table for both transports).
pub struct SharedMemory {
    allowed: bool,
    regions: Mutex<BTreeMap<String, Arc<Region>>>,
}

impl SharedMemory {
    /// `allowed`: clients may register regions (`--allow-client-shm`).
    pub fn new(allowed: bool) -> Self {
        SharedMemory {
            allowed,
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

    /// Registers `byte_size` bytes at `offset` of the object `key` as region `name`.
    pub fn register(
        &self,
        name: &str,
        key: &str,
        offset: u64,
        byte_size: u64,
    ) -> Result<(), ShmError> {
        self.allowed()?;
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(ShmError::BadName(name.len()));
        }
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
        let mut table = self.table();
        if table.contains_key(name) {
            return Err(ShmError::Exists(name.to_string()));
        }
        if table.len() >= MAX_REGIONS {
            return Err(ShmError::TooMany);
        }
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
        let status = RegionStatus {
            name: name.to_string(),
            key: key.to_string(),
            offset,
            byte_size,
        };
        tracing::debug!(
            region = name,
            key,
            offset,
            byte_size,
            "shared memory registered"
        );
        table.insert(name.to_string(), Arc::new(Region { status, file }));
        Ok(())
    }

    /// Unregisters `name` (nothing to do when it is not registered, as Triton). Requests
    /// reading or writing it finish first; its descriptor closes after them.
    pub fn unregister(&self, name: &str) -> Result<(), ShmError> {
        self.allowed()?;
        self.table().remove(name);
        Ok(())
    }

    /// Unregisters every region.
    pub fn unregister_all(&self) -> Result<(), ShmError> {
        self.allowed()?;
        self.close_all();
        Ok(())
    }

    /// Empties the table (at exit); returns how many regions were registered.
    pub fn close_all(&self) -> usize {
        let regions = std::mem::take(&mut *self.table());
        regions.len()
    }

    /// Every region, or the one called `name`, by name.
    pub fn status(&self, name: Option<&str>) -> Result<Vec<RegionStatus>, ShmError> {
        let table = self.table();
        match name {
            None => Ok(table.values().map(|r| r.status.clone()).collect()),
            Some(name) => table
                .get(name)
                .map(|r| vec![r.status.clone()])
                .ok_or_else(|| ShmError::NotFound(name.to_string())),
        }
    }

    fn region(&self, name: &str) -> Result<Arc<Region>, ShmError> {
        self.table()
            .get(name)
            .cloned()
            .ok_or_else(|| ShmError::NotFound(name.to_string()))
    }

    /// The place `at` names, checked against its region and the region's object.
    pub fn place(&self, at: &ShmRef) -> Result<Place, ShmError> {
        let region = self.region(&at.region)?;
        let start = region.locate(at)?;
        Ok(Place {
            region,
            at: at.clone(),
            start,
        })
    }
}

/// A checked place in a registered region. It keeps the region open while it lives, even
/// if the region is unregistered meanwhile. Reading and writing are blocking file I/O.
pub struct Place {
    region: Arc<Region>,
    at: ShmRef,
    /// Where it starts in the object.
    start: u64,
}

impl Place {
    pub fn at(&self) -> &ShmRef {
        &self.at
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
        self.region
            .file
            .read_exact_at(&mut data, self.start)
            .map_err(|error| match error.kind() {
                // The object shrank after the place was checked.
                std::io::ErrorKind::UnexpectedEof => ShmError::Shrunk {
                    region: at.region.clone(),
                    key: self.region.status.key.clone(),
                    size: self.region.object_size().unwrap_or(0),
                },
                _ => self.region.io(error),
            })?;
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
        // Checked again: the object may have shrunk since (a write past its end would grow
        // it back).
        self.region.locate(&self.at)?;
        self.region
            .file
            .write_all_at(data, self.start)
            .map_err(|error| self.region.io(error))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let shm = SharedMemory::new(true);
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
        let shm = SharedMemory::new(true);
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
        let shm = SharedMemory::new(true);
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
        let shm = SharedMemory::new(true);
        shm.register("a", &object.key, 0, 8).unwrap();
        shm.register("b", &object.key, 8, 8).unwrap();
        // The test's own descriptor, and one a region.
        assert_eq!(descriptors(&object.key), 3);
        let in_flight = shm.place(&at("a", 0, 8)).unwrap();
        shm.unregister("a").unwrap();
        shm.unregister("never-registered").unwrap();
        assert_eq!(shm.status(None).unwrap().len(), 1);
        assert_eq!(descriptors(&object.key), 3, "a request still uses 'a'");
        drop(in_flight);
        assert_eq!(descriptors(&object.key), 2);
        assert_eq!(shm.close_all(), 1);
        assert_eq!(descriptors(&object.key), 1);
        shm.register("a", &object.key, 0, 8).unwrap();
        shm.unregister_all().unwrap();
        assert_eq!(descriptors(&object.key), 1);
    }

    #[test]
    fn without_the_flag_nothing_is_registered() {
        let object = Object::new("off", 16);
        let shm = SharedMemory::new(false);
        let e = shm.register("r", &object.key, 0, 8).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Forbidden);
        assert!(e.to_string().contains("--allow-client-shm=true"), "{e}");
        assert_eq!(
            shm.unregister_all().unwrap_err().kind(),
            ErrorKind::Forbidden
        );
        assert!(shm.status(None).unwrap().is_empty());
    }
}
