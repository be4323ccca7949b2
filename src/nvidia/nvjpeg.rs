//! nvJPEG, NVIDIA's JPEG decoder, opened at run time like libtorch's CUDA half: PyPI's
//! `nvidia-nvjpeg` wheel has `libnvjpeg.so.13` (CUDA 13, depending only on glibc; its CUDA
//! runtime is linked in), which `make setup` installs and scripts/env.sh and the container
//! point `--nvjpeg-library` at. One `Decoder` per GPU instance, on that instance's stream
//! (decoder states are not shared between threads): the hardware decoder where the GPU has
//! one (A100, H100, H200 and newer; `video` must be among the container's driver
//! capabilities), the CUDA ("GPU-assisted") decoder elsewhere. Images are decoded in
//! batches into planar RGB buffers on the device; an image the batch failed on is retried
//! alone, and what still fails is the caller's to decode on the CPU.
use std::ffi::{c_int, c_uint, c_void};
use std::path::Path;
use std::sync::OnceLock;

use crate::dynlib::{Library as Loaded, LoadError};

type Status = c_int;
type Handle = *mut c_void;
type State = *mut c_void;
type JpegStream = *mut c_void;
type Params = *mut c_void;
type CudaStream = *mut c_void;

const SUCCESS: Status = 0;
const BACKEND_GPU_HYBRID: c_int = 2;
const BACKEND_HARDWARE: c_int = 3;
/// Planar RGB: three planes of `pitch` x height.
const OUTPUT_RGB: c_int = 3;
/// libraryPropertyType: MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL.
const VERSION_PARTS: [c_int; 3] = [0, 1, 2];

/// nvJPEG's `nvjpegImage_t`: up to four planes and their pitches.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Image {
    channel: [*mut u8; 4],
    pitch: [usize; 4],
}

/// The library's entry points this uses.
pub struct Library {
    version: String,
    get_property: unsafe extern "C" fn(c_int, *mut c_int) -> Status,
    create_ex: unsafe extern "C" fn(c_int, *mut c_void, *mut c_void, c_uint, *mut Handle) -> Status,
    destroy: unsafe extern "C" fn(Handle) -> Status,
    state_create: unsafe extern "C" fn(Handle, *mut State) -> Status,
    state_destroy: unsafe extern "C" fn(State) -> Status,
    hardware_info: unsafe extern "C" fn(Handle, *mut c_uint, *mut c_uint) -> Status,
    stream_create: unsafe extern "C" fn(Handle, *mut JpegStream) -> Status,
    stream_destroy: unsafe extern "C" fn(JpegStream) -> Status,
    stream_parse_header: unsafe extern "C" fn(Handle, *const u8, usize, JpegStream) -> Status,
    params_create: unsafe extern "C" fn(Handle, *mut Params) -> Status,
    params_destroy: unsafe extern "C" fn(Params) -> Status,
    params_output_format: unsafe extern "C" fn(Params, c_int) -> Status,
    batched_supported_ex: unsafe extern "C" fn(Handle, JpegStream, Params, *mut c_int) -> Status,
    batched_initialize: unsafe extern "C" fn(Handle, State, c_int, c_int, c_int) -> Status,
    batched: unsafe extern "C" fn(
        Handle,
        State,
        *const *const u8,
        *const usize,
        *mut Image,
        CudaStream,
    ) -> Status,
    batched_ex: unsafe extern "C" fn(
        Handle,
        State,
        *const *const u8,
        *const usize,
        *mut Image,
        *mut Params,
        CudaStream,
    ) -> Status,
}

// SAFETY: the entry points are plain functions; nvJPEG's handles are used by one thread at
// a time (each `Decoder` is owned by one instance thread).
unsafe impl Send for Library {}
unsafe impl Sync for Library {}

static LIBRARY: OnceLock<Result<Library, String>> = OnceLock::new();

/// The library at `path` (or `libnvjpeg.so.13` by the dynamic linker's search), opened
/// once for the process; later calls get the first call's outcome.
pub fn library(path: Option<&Path>) -> Result<&'static Library, String> {
    LIBRARY
        .get_or_init(|| open(path))
        .as_ref()
        .map_err(Clone::clone)
}

fn open(path: Option<&Path>) -> Result<Library, String> {
    let name = path.map_or_else(
        || "libnvjpeg.so.13".to_string(),
        |p| p.display().to_string(),
    );
    let symbols = |lib: &Loaded| -> Result<Library, LoadError> {
        // SAFETY: each symbol has the C signature nvjpeg.h declares for that name.
        unsafe {
            Ok(Library {
                version: String::new(),
                get_property: lib.get(c"nvjpegGetProperty")?,
                create_ex: lib.get(c"nvjpegCreateEx")?,
                destroy: lib.get(c"nvjpegDestroy")?,
                state_create: lib.get(c"nvjpegJpegStateCreate")?,
                state_destroy: lib.get(c"nvjpegJpegStateDestroy")?,
                hardware_info: lib.get(c"nvjpegGetHardwareDecoderInfo")?,
                stream_create: lib.get(c"nvjpegJpegStreamCreate")?,
                stream_destroy: lib.get(c"nvjpegJpegStreamDestroy")?,
                stream_parse_header: lib.get(c"nvjpegJpegStreamParseHeader")?,
                params_create: lib.get(c"nvjpegDecodeParamsCreate")?,
                params_destroy: lib.get(c"nvjpegDecodeParamsDestroy")?,
                params_output_format: lib.get(c"nvjpegDecodeParamsSetOutputFormat")?,
                batched_supported_ex: lib.get(c"nvjpegDecodeBatchedSupportedEx")?,
                batched_initialize: lib.get(c"nvjpegDecodeBatchedInitialize")?,
                batched: lib.get(c"nvjpegDecodeBatched")?,
                batched_ex: lib.get(c"nvjpegDecodeBatchedEx")?,
            })
        }
    };
    // The library is never closed: the entry points point into it.
    let mut lib = Loaded::open(&name)
        .and_then(|lib| symbols(&lib))
        .map_err(|e| e.to_string())?;
    let parts: Vec<String> = VERSION_PARTS
        .iter()
        .map(|&part| {
            let mut v: c_int = 0;
            // SAFETY: an out-pointer to a live int.
            let status = unsafe { (lib.get_property)(part, &mut v) };
            if status == SUCCESS {
                v.to_string()
            } else {
                "?".into()
            }
        })
        .collect();
    lib.version = parts.join(".");
    Ok(lib)
}

impl Library {
    /// The library's version, e.g. "13.2.3".
    pub fn version(&self) -> &str {
        &self.version
    }
}

/// What nvJPEG's status codes mean (nvjpeg.h).
fn status_text(status: Status) -> String {
    let what = match status {
        1 => "not initialized",
        2 => "invalid parameter",
        3 => "bad JPEG",
        4 => "JPEG not supported",
        5 => "allocator failure",
        6 => "execution failed",
        7 => "architecture mismatch",
        8 => "internal error",
        9 => "implementation not supported",
        10 => "incomplete bitstream",
        _ => "unknown status",
    };
    format!("nvJPEG status {status} ({what})")
}

fn check(status: Status, call: &str) -> Result<(), String> {
    if status == SUCCESS {
        Ok(())
    } else {
        Err(format!("{call}: {}", status_text(status)))
    }
}

/// Which of nvJPEG's decoders a `Decoder` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The GPU's JPEG engines (baseline, one scan; with DCT-domain scaling).
    Hardware,
    /// CUDA kernels with the Huffman decode on the GPU for large enough batches.
    Assisted,
}

impl Backend {
    /// The `path` label of `visiongate_decode_images_total`.
    pub fn label(self) -> &'static str {
        match self {
            Backend::Hardware => "gpu_hardware",
            Backend::Assisted => "gpu_assisted",
        }
    }
}

/// One image to decode at full size: its bytes and where its planar RGB goes on the
/// device: three planes of `width` x `height` bytes, one after another, at `out`.
/// (nvJPEG's hardware decoder can also scale by 1/2, 1/4 and 1/8; asked to, it gave other
/// pixels than libjpeg's DCT scaling on an H200, so it is not asked: see
/// `CpuReason::DctScale`.)
pub struct Job<'a> {
    pub bytes: &'a [u8],
    pub out: *mut u8,
    pub width: u32,
    pub height: u32,
}

/// An nvJPEG handle and decoder state on one CUDA stream.
pub struct Decoder {
    lib: &'static Library,
    handle: Handle,
    state: State,
    stream: CudaStream,
    jpeg_stream: JpegStream,
    /// One set of decode parameters per image of the largest batch so far (hardware).
    params: Vec<Params>,
    backend: Backend,
    /// Whether decode work may still run on the stream: the state is not reused (nor its
    /// batch re-initialized) until it has finished.
    in_flight: bool,
}

// SAFETY: a decoder is created, used and dropped by one instance thread; it is moved into
// that thread's engine once.
unsafe impl Send for Decoder {}

impl Decoder {
    /// A decoder whose work queues on `stream` (a `cudaStream_t` of the calling thread's
    /// device): the hardware backend where the GPU has JPEG engines, else the assisted one.
    pub fn new(lib: &'static Library, stream: *mut c_void) -> Result<Decoder, String> {
        let (handle, backend) = match create(lib, BACKEND_HARDWARE) {
            Ok(handle) => {
                let (mut engines, mut cores) = (0, 0);
                // SAFETY: a live handle and out-pointers to live ints.
                let info = unsafe { (lib.hardware_info)(handle, &mut engines, &mut cores) };
                tracing::info!(
                    engines,
                    cores,
                    ok = info == SUCCESS,
                    "nvJPEG hardware decoder"
                );
                (handle, Backend::Hardware)
            }
            Err(hardware) => {
                let handle = create(lib, BACKEND_GPU_HYBRID)
                    .map_err(|assisted| format!("{hardware}; {assisted}"))?;
                tracing::info!("nvJPEG: no hardware decoder ({hardware}); the CUDA decoder runs");
                (handle, Backend::Assisted)
            }
        };
        let mut decoder = Decoder {
            lib,
            handle,
            state: std::ptr::null_mut(),
            stream,
            jpeg_stream: std::ptr::null_mut(),
            params: Vec::new(),
            backend,
            in_flight: false,
        };
        // SAFETY: a live handle; out-pointers to this decoder's fields, freed in Drop.
        unsafe {
            check(
                (lib.state_create)(handle, &mut decoder.state),
                "nvjpegJpegStateCreate",
            )?;
            check(
                (lib.stream_create)(handle, &mut decoder.jpeg_stream),
                "nvjpegJpegStreamCreate",
            )?;
        }
        Ok(decoder)
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The stream has finished all decode work queued so far (the caller waited for it).
    pub fn settled(&mut self) {
        self.in_flight = false;
    }

    /// Decodes `jobs` on the stream, together where it can; per job, `Ok` or why it was not
    /// decoded (then its output holds nothing meaningful). Before it reuses its state for
    /// more work while earlier work may still run, it calls `settle`, which waits for the
    /// stream. The bytes must stay alive until the stream has done this work.
    pub fn decode(
        &mut self,
        jobs: &[Job<'_>],
        settle: &mut dyn FnMut() -> Result<(), String>,
    ) -> Vec<Result<(), String>> {
        let mut results: Vec<Result<(), String>> = Vec::with_capacity(jobs.len());
        let mut batch = Vec::with_capacity(jobs.len());
        for (i, job) in jobs.iter().enumerate() {
            match self.supported(i, job) {
                Ok(()) => {
                    batch.push(i);
                    results.push(Ok(()));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        if batch.is_empty() {
            return results;
        }
        if let Err(e) = self.run(jobs, &batch, settle) {
            tracing::debug!(
                "nvJPEG batch of {} failed ({e}); each image alone",
                batch.len()
            );
            for i in batch {
                results[i] = self.run(jobs, &[i], settle);
            }
        }
        results
    }

    /// Whether the decoder takes job `i` (its parameters set up at index `i`).
    fn supported(&mut self, i: usize, job: &Job<'_>) -> Result<(), String> {
        let lib = self.lib;
        while self.params.len() <= i {
            let mut params = std::ptr::null_mut();
            // SAFETY: a live handle; the parameters are freed in Drop.
            check(
                unsafe { (lib.params_create)(self.handle, &mut params) },
                "nvjpegDecodeParamsCreate",
            )?;
            self.params.push(params);
            // SAFETY: parameters just created.
            check(
                unsafe { (lib.params_output_format)(params, OUTPUT_RGB) },
                "nvjpegDecodeParamsSetOutputFormat",
            )?;
        }
        if self.backend != Backend::Hardware {
            return Ok(());
        }
        let mut unsupported: c_int = 1;
        // SAFETY: live handle, parameters and stream object; the bytes outlive the call.
        unsafe {
            check(
                (lib.stream_parse_header)(
                    self.handle,
                    job.bytes.as_ptr(),
                    job.bytes.len(),
                    self.jpeg_stream,
                ),
                "nvjpegJpegStreamParseHeader",
            )?;
            check(
                (lib.batched_supported_ex)(
                    self.handle,
                    self.jpeg_stream,
                    self.params[i],
                    &mut unsupported,
                ),
                "nvjpegDecodeBatchedSupportedEx",
            )?;
        }
        if unsupported == 0 {
            Ok(())
        } else {
            Err("the hardware decoder does not take this JPEG".into())
        }
    }

    /// Decodes the jobs at `which` as one batch (after earlier work settled).
    fn run(
        &mut self,
        jobs: &[Job<'_>],
        which: &[usize],
        settle: &mut dyn FnMut() -> Result<(), String>,
    ) -> Result<(), String> {
        if self.in_flight {
            settle()?;
            self.in_flight = false;
        }
        self.in_flight = true;
        let lib = self.lib;
        let data: Vec<*const u8> = which.iter().map(|&i| jobs[i].bytes.as_ptr()).collect();
        let lengths: Vec<usize> = which.iter().map(|&i| jobs[i].bytes.len()).collect();
        let mut images: Vec<Image> = which
            .iter()
            .map(|&i| {
                let job = &jobs[i];
                let plane = job.width as usize * job.height as usize;
                let mut image = Image {
                    channel: [std::ptr::null_mut(); 4],
                    pitch: [0; 4],
                };
                for c in 0..3 {
                    // SAFETY: the caller's buffer holds three planes of `plane` bytes.
                    image.channel[c] = unsafe { job.out.add(c * plane) };
                    image.pitch[c] = job.width as usize;
                }
                image
            })
            .collect();
        let mut params: Vec<Params> = which.iter().map(|&i| self.params[i]).collect();
        // SAFETY: live handle, state and stream; `data`, `lengths`, `images` and `params`
        // hold `which.len()` entries each; each output buffer holds its image's planes.
        unsafe {
            check(
                (lib.batched_initialize)(
                    self.handle,
                    self.state,
                    which.len() as c_int,
                    1,
                    OUTPUT_RGB,
                ),
                "nvjpegDecodeBatchedInitialize",
            )?;
            match self.backend {
                Backend::Hardware => check(
                    (lib.batched_ex)(
                        self.handle,
                        self.state,
                        data.as_ptr(),
                        lengths.as_ptr(),
                        images.as_mut_ptr(),
                        params.as_mut_ptr(),
                        self.stream,
                    ),
                    "nvjpegDecodeBatchedEx",
                ),
                Backend::Assisted => check(
                    (lib.batched)(
                        self.handle,
                        self.state,
                        data.as_ptr(),
                        lengths.as_ptr(),
                        images.as_mut_ptr(),
                        self.stream,
                    ),
                    "nvjpegDecodeBatched",
                ),
            }
        }
    }
}

impl Drop for Decoder {
    fn drop(&mut self) {
        let lib = self.lib;
        // SAFETY: each object was created by this decoder and is destroyed once.
        unsafe {
            for &p in &self.params {
                (lib.params_destroy)(p);
            }
            if !self.jpeg_stream.is_null() {
                (lib.stream_destroy)(self.jpeg_stream);
            }
            if !self.state.is_null() {
                (lib.state_destroy)(self.state);
            }
            (lib.destroy)(self.handle);
        }
    }
}

/// `NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION`: chroma upsampled by interpolation, as
/// libjpeg-turbo's default ("fancy") upsampling does on the CPU path.
const FLAG_INTERPOLATED_UPSAMPLING: c_uint = 1 << 5;

/// A handle for `backend`: with interpolated chroma upsampling where the library takes
/// the flag, else without.
fn create(lib: &Library, backend: c_int) -> Result<Handle, String> {
    let name = if backend == BACKEND_HARDWARE {
        "hardware"
    } else {
        "CUDA"
    };
    let mut status = SUCCESS;
    for flags in [FLAG_INTERPOLATED_UPSAMPLING, 0] {
        let mut handle = std::ptr::null_mut();
        // SAFETY: default allocators (null) and an out-pointer to a live handle slot.
        status = unsafe {
            (lib.create_ex)(
                backend,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                flags,
                &mut handle,
            )
        };
        if status == SUCCESS {
            if flags == 0 {
                tracing::info!("nvJPEG ({name} backend): chroma upsampling without interpolation");
            }
            return Ok(handle);
        }
    }
    Err(format!(
        "nvjpegCreateEx ({name} backend): {}",
        status_text(status)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The library `scripts/env.sh` names (PyPI's nvidia-nvjpeg), if the environment has it.
    fn installed() -> Option<std::path::PathBuf> {
        std::env::var_os("VISIONGATE_NVJPEG_LIBRARY").map(Into::into)
    }

    #[test]
    fn the_library_opens_and_says_its_version_without_a_gpu() {
        let Some(path) = installed() else {
            // CI's environment has the library (scripts/setup.sh installs it).
            assert_ne!(
                std::env::var("CI").as_deref(),
                Ok("true"),
                "VISIONGATE_NVJPEG_LIBRARY is unset: source scripts/env.sh"
            );
            // Past the test harness's capture, so that it shows among passing tests.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "NOT RUN: nvJPEG needs VISIONGATE_NVJPEG_LIBRARY (scripts/env.sh sets it)"
            );
            return;
        };
        let lib = library(Some(&path)).unwrap();
        assert!(lib.version().starts_with("13."), "{}", lib.version());
        // Without a GPU a decoder cannot start, and says why; with one, it starts.
        let decoder = Decoder::new(lib, std::ptr::null_mut());
        if Path::new("/dev/nvidiactl").exists() {
            assert!(decoder.is_ok(), "{:?}", decoder.err());
        } else {
            let e = decoder.err().unwrap();
            assert!(e.contains("nvjpegCreateEx"), "{e}");
        }
    }

    #[test]
    fn a_library_that_is_not_there_is_an_error_naming_it() {
        let e = open(Some(Path::new("/nonexistent/libnvjpeg.so.13")))
            .err()
            .unwrap();
        assert!(e.contains("/nonexistent/libnvjpeg.so.13"), "{e}");
    }
}
