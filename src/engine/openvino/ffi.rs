//! OpenVINO's C API (`libopenvino_c.so`), opened at run time: the calls a classifier needs,
//! as typed function pointers taken from the library once, and the objects they return
//! owned by types that free them. Signatures are those of the C headers PyPI's `openvino`
//! wheel ships (`openvino/include/openvino/c/`) for the release the set-up installs; only
//! the non-variadic calls are used, so every argument crosses the boundary as declared.
use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::{self, NonNull};

use crate::dynlib::{Library, LoadError};

/// The hwloc library OpenVINO's wheel carries for oneTBB.
const HWLOC: &str = "libhwloc.so.15";

/// `ov_status_e`: 0 is OK.
type Status = i32;
/// `ov_element_type_e`.
pub type ElementType = u32;

/// The element types this engine reads, as the installed release numbers them (2026.x: the
/// `DYNAMIC` type is 0, so `F32` is 4).
pub const F32: ElementType = 4;

/// `ov_shape_t`.
#[repr(C)]
struct Shape {
    rank: i64,
    dims: *mut i64,
}

/// `ov_dimension_t` (and `ov_rank_t`): an interval, `max` -1 for unbounded.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dimension {
    pub min: i64,
    pub max: i64,
}

impl Dimension {
    /// Any size.
    pub const DYNAMIC: Dimension = Dimension { min: -1, max: -1 };

    pub fn fixed(n: i64) -> Dimension {
        Dimension { min: n, max: n }
    }

    /// Its size, where it has one.
    pub fn size(self) -> Option<i64> {
        (self.min == self.max && self.min >= 0).then_some(self.min)
    }
}

/// `ov_partial_shape_t`.
#[repr(C)]
struct PartialShape {
    rank: Dimension,
    dims: *mut Dimension,
}

/// `ov_property_t`: a key and its value (a C string for every key used here).
#[repr(C)]
struct Property {
    key: *const c_char,
    value: *const c_void,
}

/// `ov_version_t`.
#[repr(C)]
struct Version {
    build_number: *const c_char,
    description: *const c_char,
}

type Out<T> = *mut *mut T;

/// The calls, bound once.
struct Api {
    free: unsafe extern "C" fn(*const c_char),
    last_error: unsafe extern "C" fn() -> *const c_char,
    error_info: unsafe extern "C" fn(Status) -> *const c_char,
    version: unsafe extern "C" fn(*mut Version) -> Status,
    version_free: unsafe extern "C" fn(*mut Version),
    core_create: unsafe extern "C" fn(Out<c_void>) -> Status,
    core_free: unsafe extern "C" fn(*mut c_void),
    core_set: unsafe extern "C" fn(*const c_void, *const c_char, usize, *const Property) -> Status,
    read_model:
        unsafe extern "C" fn(*const c_void, *const c_char, *const c_char, Out<c_void>) -> Status,
    model_free: unsafe extern "C" fn(*mut c_void),
    inputs_size: unsafe extern "C" fn(*const c_void, *mut usize) -> Status,
    outputs_size: unsafe extern "C" fn(*const c_void, *mut usize) -> Status,
    input_by_index: unsafe extern "C" fn(*const c_void, usize, Out<c_void>) -> Status,
    output_by_index: unsafe extern "C" fn(*const c_void, usize, Out<c_void>) -> Status,
    port_free: unsafe extern "C" fn(*mut c_void),
    port_name: unsafe extern "C" fn(*const c_void, *mut *mut c_char) -> Status,
    port_shape: unsafe extern "C" fn(*const c_void, *mut PartialShape) -> Status,
    port_type: unsafe extern "C" fn(*const c_void, *mut ElementType) -> Status,
    partial_shape_create: unsafe extern "C" fn(i64, *const Dimension, *mut PartialShape) -> Status,
    partial_shape_free: unsafe extern "C" fn(*mut PartialShape),
    reshape_input: unsafe extern "C" fn(*const c_void, *const c_char, PartialShape) -> Status,
    compile: unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_char,
        usize,
        *const Property,
        Out<c_void>,
    ) -> Status,
    compiled_free: unsafe extern "C" fn(*mut c_void),
    compiled_property:
        unsafe extern "C" fn(*const c_void, *const c_char, *mut *mut c_char) -> Status,
    request_create: unsafe extern "C" fn(*const c_void, Out<c_void>) -> Status,
    request_free: unsafe extern "C" fn(*mut c_void),
    set_input: unsafe extern "C" fn(*mut c_void, usize, *const c_void) -> Status,
    infer: unsafe extern "C" fn(*mut c_void) -> Status,
    get_output: unsafe extern "C" fn(*const c_void, usize, Out<c_void>) -> Status,
    tensor_from_host: unsafe extern "C" fn(ElementType, Shape, *mut c_void, Out<c_void>) -> Status,
    tensor_free: unsafe extern "C" fn(*mut c_void),
    tensor_shape: unsafe extern "C" fn(*const c_void, *mut Shape) -> Status,
    shape_free: unsafe extern "C" fn(*mut Shape) -> Status,
    tensor_type: unsafe extern "C" fn(*const c_void, *mut ElementType) -> Status,
    tensor_data: unsafe extern "C" fn(*const c_void, *mut *mut c_void) -> Status,
}

impl Api {
    fn bind(lib: &Library) -> Result<Api, LoadError> {
        // SAFETY: each type is the C header's declaration of its symbol (see the module's
        // documentation).
        unsafe {
            Ok(Api {
                // The release first: an older one lacks calls bound below.
                version: lib.get(c"ov_get_openvino_version")?,
                version_free: lib.get(c"ov_version_free")?,
                free: lib.get(c"ov_free")?,
                last_error: lib.get(c"ov_get_last_err_msg")?,
                error_info: lib.get(c"ov_get_error_info")?,
                core_create: lib.get(c"ov_core_create")?,
                core_free: lib.get(c"ov_core_free")?,
                core_set: lib.get(c"ov_core_set_properties")?,
                read_model: lib.get(c"ov_core_read_model")?,
                model_free: lib.get(c"ov_model_free")?,
                inputs_size: lib.get(c"ov_model_inputs_size")?,
                outputs_size: lib.get(c"ov_model_outputs_size")?,
                input_by_index: lib.get(c"ov_model_const_input_by_index")?,
                output_by_index: lib.get(c"ov_model_const_output_by_index")?,
                port_free: lib.get(c"ov_output_const_port_free")?,
                port_name: lib.get(c"ov_port_get_any_name")?,
                port_shape: lib.get(c"ov_port_get_partial_shape")?,
                port_type: lib.get(c"ov_port_get_element_type")?,
                partial_shape_create: lib.get(c"ov_partial_shape_create")?,
                partial_shape_free: lib.get(c"ov_partial_shape_free")?,
                reshape_input: lib.get(c"ov_model_reshape_input_by_name")?,
                compile: lib.get(c"ov_core_compile_model_props")?,
                compiled_free: lib.get(c"ov_compiled_model_free")?,
                compiled_property: lib.get(c"ov_compiled_model_get_property")?,
                request_create: lib.get(c"ov_compiled_model_create_infer_request")?,
                request_free: lib.get(c"ov_infer_request_free")?,
                set_input: lib.get(c"ov_infer_request_set_input_tensor_by_index")?,
                infer: lib.get(c"ov_infer_request_infer")?,
                get_output: lib.get(c"ov_infer_request_get_output_tensor_by_index")?,
                tensor_from_host: lib.get(c"ov_tensor_create_from_host_ptr")?,
                tensor_free: lib.get(c"ov_tensor_free")?,
                tensor_shape: lib.get(c"ov_tensor_get_shape")?,
                shape_free: lib.get(c"ov_shape_free")?,
                tensor_type: lib.get(c"ov_tensor_get_element_type")?,
                tensor_data: lib.get(c"ov_tensor_data")?,
            })
        }
    }

    /// `status` as a result: where `call` failed, what the status means and, for the
    /// statuses the C API sets it with (a C++ exception caught), the library's last error
    /// message. That message is one for the whole process: the loads that could fail
    /// together take turns (`Runtime::loading`), so it is this call's.
    fn check(&self, call: &str, status: Status) -> Result<(), String> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: a static string for any status.
        let info = unsafe { CStr::from_ptr((self.error_info)(status)) }
            .to_string_lossy()
            .into_owned();
        // GENERAL_ERROR, NOT_IMPLEMENTED, REQUEST_BUSY, INFER_CANCELLED, UNKNOW_EXCEPTION.
        let message = if matches!(status, -1 | -2 | -8 | -13 | -17) {
            // SAFETY: a NUL-terminated copy the caller frees with ov_free, or null.
            unsafe { self.take_string((self.last_error)() as *mut c_char) }
        } else {
            String::new()
        };
        let message = message.trim();
        Err(if message.is_empty() {
            format!("{call} failed ({})", info.trim())
        } else {
            format!("{call}: {}", first_line(message))
        })
    }

    /// A string the library allocated, copied and freed.
    ///
    /// # Safety
    /// `s` is null or a NUL-terminated string to free with `ov_free`.
    unsafe fn take_string(&self, s: *mut c_char) -> String {
        if s.is_null() {
            return String::new();
        }
        // SAFETY: as the caller vouches.
        unsafe {
            let text = CStr::from_ptr(s).to_string_lossy().into_owned();
            (self.free)(s);
            text
        }
    }
}

/// OpenVINO's messages carry lines naming its C++ source ("Exception from src/...",
/// "Check '...' failed at src/..."): its first line that says something else, else its
/// first line.
fn first_line(message: &str) -> &str {
    let mut lines = message.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.clone().next().unwrap_or(message);
    lines
        .find(|l| !l.starts_with("Exception from src") && !l.contains(" failed at src/"))
        .unwrap_or(first)
}

/// The opened library and its core (one per process: OpenVINO's core is thread-safe, and
/// each compiled model is an instance's own).
pub struct Runtime {
    api: Api,
    core: NonNull<c_void>,
    /// The release, as OpenVINO reports it.
    pub version: String,
    /// Held while a model is read and compiled: the loads take turns, so the error message
    /// a failed call leaves is the failed call's.
    loading: std::sync::Mutex<()>,
}

// SAFETY: the core is documented thread-safe; the function pointers are plain code.
unsafe impl Send for Runtime {}
unsafe impl Sync for Runtime {}

impl Drop for Runtime {
    fn drop(&mut self) {
        // SAFETY: the core this type made (a runtime kept for the process is never dropped).
        unsafe { (self.api.core_free)(self.core.as_ptr()) }
    }
}

impl Runtime {
    /// `library` (a path, or a name for the dynamic linker), bound, with a core made that
    /// reads weights into memory (a mapped `.bin` changed in place would crash the process).
    pub fn open(library: &str) -> Result<Runtime, String> {
        // oneTBB opens its NUMA binding (libtbbbind) with RTLD_DEEPBIND, so the hwloc that
        // binding needs would bind `free` to the C library's own while the C library's
        // functions allocate with this process's malloc (jemalloc), and the process would
        // abort in hwloc's topology load (where an hwloc is found: the wheel's, beside the
        // C API). hwloc opened first, from beside the C API, is the one the binding gets,
        // bound to the process's malloc like everything else.
        let path = std::path::Path::new(library);
        let hwloc = if path.parent().is_some_and(|p| p.as_os_str().is_empty()) {
            Library::open(HWLOC).map(drop)
        } else if path.with_file_name(HWLOC).is_file() {
            Library::open(&path.with_file_name(HWLOC).to_string_lossy()).map(drop)
        } else {
            Err(LoadError::Open {
                library: HWLOC.into(),
                why: "not beside the C API".into(),
            })
        };
        if let Err(e) = hwloc {
            tracing::warn!(
                "{e}: OpenVINO's threads will not know the NUMA layout (and an hwloc found \
                 elsewhere could abort the process)"
            );
        }
        let lib = Library::open(library).map_err(|e| e.to_string())?;
        let api = Api::bind(&lib).map_err(|e| e.to_string())?;
        let mut version = Version {
            build_number: ptr::null(),
            description: ptr::null(),
        };
        // SAFETY: the version is filled by the call and freed by its own free.
        let version = unsafe {
            api.check("ov_get_openvino_version", (api.version)(&mut version))?;
            let text = CStr::from_ptr(version.build_number)
                .to_string_lossy()
                .into_owned();
            (api.version_free)(&mut version);
            text
        };
        let mut core = ptr::null_mut();
        // SAFETY: an out-pointer for the new core.
        api.check("ov_core_create", unsafe { (api.core_create)(&mut core) })?;
        let core = NonNull::new(core).ok_or("ov_core_create gave no core")?;
        let rt = Runtime {
            api,
            core,
            version,
            loading: std::sync::Mutex::new(()),
        };
        let props = [Property {
            key: c"ENABLE_MMAP".as_ptr(),
            value: c"NO".as_ptr().cast(),
        }];
        // SAFETY: a null device name sets the core's own properties; `props` outlives it.
        let status = unsafe { (rt.api.core_set)(core.as_ptr(), ptr::null(), 1, props.as_ptr()) };
        rt.api.check("setting ENABLE_MMAP", status)?;
        Ok(rt)
    }

    /// The lock a model's read and compile hold (see `loading`).
    pub fn loading(&self) -> std::sync::MutexGuard<'_, ()> {
        self.loading.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The model in `path` (IR `.xml` with its weights in `weights`, or ONNX).
    pub fn read_model(
        &self,
        path: &std::path::Path,
        weights: Option<&std::path::Path>,
    ) -> Result<Model<'_>, String> {
        let path = c_path(path)?;
        let weights = weights.map(c_path).transpose()?;
        let mut model = ptr::null_mut();
        // SAFETY: NUL-terminated paths (the weights' or null), an out-pointer.
        let status = unsafe {
            (self.api.read_model)(
                self.core.as_ptr(),
                path.as_ptr(),
                weights.as_ref().map_or(ptr::null(), |w| w.as_ptr()),
                &mut model,
            )
        };
        self.api.check("reading the model", status)?;
        Ok(Model {
            rt: self,
            raw: NonNull::new(model).ok_or("ov_core_read_model gave no model")?,
        })
    }
}

fn c_path(path: &std::path::Path) -> Result<CString, String> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes()).map_err(|_| "a NUL in the model's path".to_string())
}

/// A model as read, before it is compiled.
pub struct Model<'r> {
    rt: &'r Runtime,
    raw: NonNull<c_void>,
}

impl Drop for Model<'_> {
    fn drop(&mut self) {
        // SAFETY: a model this type owns.
        unsafe { (self.rt.api.model_free)(self.raw.as_ptr()) }
    }
}

/// One of a model's inputs or outputs: its name, element type and shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Port {
    pub name: String,
    pub element: ElementType,
    /// `None`: of dynamic rank.
    pub dims: Option<Vec<Dimension>>,
}

impl<'r> Model<'r> {
    pub fn inputs(&self) -> Result<Vec<Port>, String> {
        self.ports(self.rt.api.inputs_size, self.rt.api.input_by_index)
    }

    pub fn outputs(&self) -> Result<Vec<Port>, String> {
        self.ports(self.rt.api.outputs_size, self.rt.api.output_by_index)
    }

    fn ports(
        &self,
        size: unsafe extern "C" fn(*const c_void, *mut usize) -> Status,
        by_index: unsafe extern "C" fn(*const c_void, usize, Out<c_void>) -> Status,
    ) -> Result<Vec<Port>, String> {
        let api = &self.rt.api;
        let model = self.raw.as_ptr();
        let mut n = 0;
        // SAFETY: an out-pointer for the count.
        api.check("counting the model's ports", unsafe { size(model, &mut n) })?;
        (0..n)
            .map(|i| {
                let mut port = ptr::null_mut();
                // SAFETY: an index below the count, an out-pointer for the port.
                api.check("a model's port", unsafe { by_index(model, i, &mut port) })?;
                let port = PortHandle { api, raw: port };
                port.read()
            })
            .collect()
    }

    /// `input`'s shape set to `dims` (a dimension of -1 on both ends: any size).
    pub fn reshape_input(&self, input: &str, dims: &[Dimension]) -> Result<(), String> {
        let api = &self.rt.api;
        let name = CString::new(input).map_err(|_| "a NUL in the input's name".to_string())?;
        let mut shape = PartialShape {
            rank: Dimension::DYNAMIC,
            dims: ptr::null_mut(),
        };
        // SAFETY: `dims.len()` dimensions read from `dims`; the shape made is freed below
        // (the reshape takes it by value and copies it).
        unsafe {
            api.check(
                "ov_partial_shape_create",
                (api.partial_shape_create)(dims.len() as i64, dims.as_ptr(), &mut shape),
            )?;
            let copy = PartialShape {
                rank: shape.rank,
                dims: shape.dims,
            };
            let status = (api.reshape_input)(self.raw.as_ptr(), name.as_ptr(), copy);
            (api.partial_shape_free)(&mut shape);
            api.check("reshaping the model's input", status)
        }
    }

    /// Compiled for the CPU with `properties` (OpenVINO's keys and string values), with its
    /// one infer request.
    pub fn compile(&self, properties: &[(&str, String)]) -> Result<Compiled<'r>, String> {
        let api = &self.rt.api;
        let pairs: Vec<(CString, CString)> = properties
            .iter()
            .map(|(k, v)| Ok((CString::new(*k)?, CString::new(v.as_str())?)))
            .collect::<Result<_, std::ffi::NulError>>()
            .map_err(|_| "a NUL in a property".to_string())?;
        let props: Vec<Property> = pairs
            .iter()
            .map(|(k, v)| Property {
                key: k.as_ptr(),
                value: v.as_ptr().cast(),
            })
            .collect();
        let mut compiled = ptr::null_mut();
        // SAFETY: `props` (and the strings it points at) outlive the call; out-pointer.
        let status = unsafe {
            (api.compile)(
                self.rt.core.as_ptr(),
                self.raw.as_ptr(),
                c"CPU".as_ptr(),
                props.len(),
                props.as_ptr(),
                &mut compiled,
            )
        };
        api.check("compiling the model for the CPU", status)?;
        let compiled = NonNull::new(compiled).ok_or("the compile gave no model")?;
        let mut request = ptr::null_mut();
        // SAFETY: a compiled model, an out-pointer for its request.
        let status = unsafe { (api.request_create)(compiled.as_ptr(), &mut request) };
        let request = api
            .check("ov_compiled_model_create_infer_request", status)
            .and_then(|()| NonNull::new(request).ok_or("no infer request".to_string()));
        match request {
            Ok(request) => Ok(Compiled {
                rt: self.rt,
                raw: compiled,
                request,
            }),
            Err(e) => {
                // SAFETY: the compiled model made above, owned by nothing else.
                unsafe { (api.compiled_free)(compiled.as_ptr()) };
                Err(e)
            }
        }
    }
}

/// A port as the model lends it, freed when dropped.
struct PortHandle<'a> {
    api: &'a Api,
    raw: *mut c_void,
}

impl Drop for PortHandle<'_> {
    fn drop(&mut self) {
        // SAFETY: a port this type owns (null is accepted).
        unsafe { (self.api.port_free)(self.raw) }
    }
}

impl PortHandle<'_> {
    fn read(&self) -> Result<Port, String> {
        let api = self.api;
        let mut name = ptr::null_mut();
        let mut element = 0;
        let mut shape = PartialShape {
            rank: Dimension::DYNAMIC,
            dims: ptr::null_mut(),
        };
        // SAFETY: out-pointers for the port's name (freed by take_string), type and
        // shape (freed below).
        unsafe {
            // A port may have no name: an empty one then.
            let name = if (api.port_name)(self.raw, &mut name) == 0 {
                api.take_string(name)
            } else {
                String::new()
            };
            api.check("a port's type", (api.port_type)(self.raw, &mut element))?;
            api.check("a port's shape", (api.port_shape)(self.raw, &mut shape))?;
            let dims = match shape.rank.size() {
                Some(rank) if !shape.dims.is_null() => {
                    Some(std::slice::from_raw_parts(shape.dims, rank as usize).to_vec())
                }
                Some(0) => Some(Vec::new()),
                _ => None,
            };
            (api.partial_shape_free)(&mut shape);
            Ok(Port {
                name,
                element,
                dims,
            })
        }
    }
}

/// A model compiled for the CPU and its infer request, used by one thread at a time.
pub struct Compiled<'r> {
    rt: &'r Runtime,
    raw: NonNull<c_void>,
    request: NonNull<c_void>,
}

// SAFETY: the compiled model and its request move with the instance thread that owns them.
unsafe impl Send for Compiled<'_> {}

impl Drop for Compiled<'_> {
    fn drop(&mut self) {
        // SAFETY: the request and the model this type owns, the request first.
        unsafe {
            (self.rt.api.request_free)(self.request.as_ptr());
            (self.rt.api.compiled_free)(self.raw.as_ptr());
        }
    }
}

impl Compiled<'_> {
    /// A property of the compiled model as OpenVINO prints it.
    pub fn property(&self, key: &str) -> Result<String, String> {
        let api = &self.rt.api;
        let key_c = CString::new(key).map_err(|_| "a NUL in a property".to_string())?;
        let mut value = ptr::null_mut();
        // SAFETY: a NUL-terminated key; the value is freed by take_string.
        unsafe {
            api.check(
                key,
                (api.compiled_property)(self.raw.as_ptr(), key_c.as_ptr(), &mut value),
            )?;
            Ok(api.take_string(value))
        }
    }

    /// Runs the model on FP32 `input` of shape `dims`, and hands output `output`'s shape
    /// and values to `read`.
    pub fn infer<T>(
        &mut self,
        input: &[f32],
        dims: &[i64],
        output: usize,
        read: impl FnOnce(&[i64], &[f32]) -> T,
    ) -> Result<T, String> {
        let api = &self.rt.api;
        let count: i64 = dims.iter().product();
        if count < 0 || count as usize != input.len() {
            return Err(format!(
                "{} values do not make a tensor of {dims:?}",
                input.len()
            ));
        }
        let mut dims = dims.to_vec();
        let shape = Shape {
            rank: dims.len() as i64,
            dims: dims.as_mut_ptr(),
        };
        let mut tensor = ptr::null_mut();
        // SAFETY: the tensor borrows `input` (never written through: it is the model's
        // input, which OpenVINO reads in place) and the shape's dims for the call; it is
        // freed below, before either goes. The request keeps the pointer until the next
        // batch sets another input, but reads it only while it infers.
        unsafe {
            api.check(
                "ov_tensor_create_from_host_ptr",
                (api.tensor_from_host)(F32, shape, input.as_ptr() as *mut c_void, &mut tensor),
            )?;
            let tensor = TensorHandle { api, raw: tensor };
            let request = self.request.as_ptr();
            api.check("setting the input", (api.set_input)(request, 0, tensor.raw))?;
            api.check("inference", (api.infer)(request))?;
            let mut out = ptr::null_mut();
            api.check(
                "getting the output",
                (api.get_output)(request, output, &mut out),
            )?;
            let out = TensorHandle { api, raw: out };
            out.read(read)
        }
    }
}

/// A tensor, freed when dropped.
struct TensorHandle<'a> {
    api: &'a Api,
    raw: *mut c_void,
}

impl Drop for TensorHandle<'_> {
    fn drop(&mut self) {
        // SAFETY: a tensor this type owns (null is accepted).
        unsafe { (self.api.tensor_free)(self.raw) }
    }
}

impl TensorHandle<'_> {
    /// Its shape and FP32 values, lent to `read`.
    fn read<T>(&self, read: impl FnOnce(&[i64], &[f32]) -> T) -> Result<T, String> {
        let api = self.api;
        let mut element = 0;
        let mut shape = Shape {
            rank: 0,
            dims: ptr::null_mut(),
        };
        let mut data = ptr::null_mut();
        // SAFETY: out-pointers; the shape is freed below; the data, `count` FP32 values
        // (its type checked), is the tensor's, alive while it is.
        unsafe {
            api.check(
                "the output's type",
                (api.tensor_type)(self.raw, &mut element),
            )?;
            if element != F32 {
                return Err(format!("the output is of element type {element}, not FP32"));
            }
            api.check(
                "the output's shape",
                (api.tensor_shape)(self.raw, &mut shape),
            )?;
            let dims = if shape.dims.is_null() {
                Vec::new()
            } else {
                std::slice::from_raw_parts(shape.dims, shape.rank.max(0) as usize).to_vec()
            };
            (api.shape_free)(&mut shape);
            api.check("the output's data", (api.tensor_data)(self.raw, &mut data))?;
            let count = dims.iter().try_fold(1usize, |n, &d| {
                usize::try_from(d).ok().and_then(|d| n.checked_mul(d))
            });
            let Some(count) = count.filter(|_| !data.is_null()) else {
                return Err(format!("the output has shape {dims:?}"));
            };
            let values = std::slice::from_raw_parts(data as *const f32, count);
            Ok(read(&dims, values))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_its_first_line_that_says_something() {
        let m = "Exception from src/inference/src/cpp/core.cpp:97:\nCheck 'false' failed at src/frontends/common/src/frontend.cpp:54:\nUnable to read the model\n";
        assert_eq!(first_line(m), "Unable to read the model");
        let bare = "Check 'x' failed at src/core/a.cpp:9:\n";
        assert_eq!(first_line(bare), "Check 'x' failed at src/core/a.cpp:9:");
        assert_eq!(first_line("plain"), "plain");
        assert_eq!(Dimension::fixed(3).size(), Some(3));
        assert_eq!(Dimension::DYNAMIC.size(), None);
        assert_eq!(Dimension { min: 1, max: 8 }.size(), None);
    }
}
