//! The table, both kinds of region, and their bounds.
use std::ffi::CString;
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

use super::*;
use crate::error::{ErrorKind, HasKind};

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
