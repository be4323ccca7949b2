//! What a shared-memory call can fail with, in Triton's words where Triton has them.
use super::{ShmKind, HANDLE_BYTES, MAX_NAME, MAX_REGIONS};
use crate::error::{ErrorKind, HasKind};

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
