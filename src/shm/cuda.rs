//! GPU memory a client shares by a CUDA IPC handle (the 64 bytes of `cudaIpcMemHandle_t`,
//! what `cudaIpcGetMemHandle` gives), opened, read and written through the CUDA driver API
//! of the NVIDIA driver (`libcuda.so.1`, opened at run time) on each device's primary
//! context: the one libtorch's CUDA runtime uses. [`CudaIpc`] is what the shared-memory
//! table needs of it, so that tests can give it GPU memory kept in host memory
//! ([`FakeCudaIpc`]).
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::nvidia::driver::{self, Driver, IpcMemory};

/// Bytes of a CUDA IPC handle (`CU_IPC_HANDLE_SIZE`).
pub const HANDLE_BYTES: usize = driver::IPC_HANDLE_BYTES;

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
    driver: OnceLock<Option<(&'static Driver, usize)>>,
}

impl HostGpus {
    /// The driver, started, and the GPUs it sees.
    fn driver(&self) -> Option<(&'static Driver, usize)> {
        *self.driver.get_or_init(|| match driver::started() {
            Ok(started) => Some(started),
            Err(why) => {
                tracing::info!("CUDA shared memory: no GPUs ({why})");
                None
            }
        })
    }
}

impl CudaIpc for HostGpus {
    fn device_count(&self) -> usize {
        self.driver().map_or(0, |(_, devices)| devices)
    }

    /// The allocation mapped on the device's primary context: the one libtorch's CUDA
    /// runtime uses.
    fn open(
        &self,
        handle: &[u8; HANDLE_BYTES],
        device: usize,
    ) -> Result<Box<dyn DeviceMemory>, String> {
        let Some((driver, _)) = self.driver() else {
            return NoGpus.open(handle, device);
        };
        let opened = driver
            .primary_context(device)
            .and_then(|context| IpcMemory::open(context, handle));
        match opened {
            Ok(memory) => Ok(Box::new(memory)),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl DeviceMemory for IpcMemory {
    fn size(&self) -> u64 {
        IpcMemory::size(self)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        IpcMemory::read(self, offset, out).map_err(|e| e.to_string())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        IpcMemory::write(self, offset, data).map_err(|e| e.to_string())
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
