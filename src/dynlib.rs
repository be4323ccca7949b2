//! Shared libraries opened at run time (`dlopen`), never closed: the function pointers
//! taken from them point into them, and the runtimes' libraries (NVIDIA's, OpenVINO's) keep
//! state for the process. One loader for all: a library opened once and kept, its symbols
//! taken as typed function pointers, errors naming the library and the symbol.
use std::ffi::{c_void, CStr, CString};
use std::ptr::NonNull;

/// Why a library or one of its symbols is not there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// `why` is the dynamic linker's message, which usually names the library itself.
    #[error("{}", if why.starts_with(library.as_str()) { why.clone() } else { format!("cannot open {library}: {why}") })]
    Open { library: String, why: String },
    #[error("{library} has no {symbol}")]
    Symbol { library: String, symbol: String },
}

/// An opened library. It has no `Drop`: closing it would leave every function pointer
/// taken from it dangling.
pub struct Library {
    name: String,
    handle: NonNull<c_void>,
}

// SAFETY: a dlopen handle is process-wide; looking symbols up is thread-safe.
unsafe impl Send for Library {}
unsafe impl Sync for Library {}

impl Library {
    /// `name` (a file name the dynamic linker searches for, or a path), its symbols bound
    /// now and kept to itself.
    pub fn open(name: &str) -> Result<Library, LoadError> {
        Library::open_with(name, libc::RTLD_NOW | libc::RTLD_LOCAL)
    }

    /// `name`, its symbols offered to the libraries loaded after it, as a linked library's
    /// are (libtorch's CUDA half).
    pub fn open_global(name: &str) -> Result<Library, LoadError> {
        Library::open_with(name, libc::RTLD_NOW | libc::RTLD_GLOBAL)
    }

    fn open_with(name: &str, flags: libc::c_int) -> Result<Library, LoadError> {
        let open_error = |why: String| LoadError::Open {
            library: name.to_string(),
            why,
        };
        let c_name = CString::new(name).map_err(|_| open_error("a NUL in the name".into()))?;
        // SAFETY: dlopen with a NUL-terminated name; the handle is never closed.
        let handle = unsafe { libc::dlopen(c_name.as_ptr(), flags) };
        match NonNull::new(handle) {
            Some(handle) => Ok(Library {
                name: name.to_string(),
                handle,
            }),
            None => Err(open_error(dl_error())),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `symbol` as the function pointer type `F`.
    ///
    /// # Safety
    /// `F` must be the C signature the library's header declares for `symbol`.
    pub unsafe fn get<F: Copy>(&self, symbol: &CStr) -> Result<F, LoadError> {
        // SAFETY: the caller vouches for `F`.
        unsafe { self.optional(symbol) }.ok_or_else(|| LoadError::Symbol {
            library: self.name.clone(),
            symbol: symbol.to_string_lossy().into_owned(),
        })
    }

    /// `symbol` as `F`, or `None` where this release of the library lacks it.
    ///
    /// # Safety
    /// As for [`Library::get`].
    pub unsafe fn optional<F: Copy>(&self, symbol: &CStr) -> Option<F> {
        // SAFETY: looking a symbol up in a handle that is open; the caller vouches for `F`.
        unsafe { cast(libc::dlsym(self.handle.as_ptr(), symbol.as_ptr())) }
    }
}

/// `symbol` among the libraries the process has loaded (the CUDA runtime libtorch
/// loaded, say), as `F`; `None` where none has it.
///
/// # Safety
/// `F` must be the C signature that symbol has.
pub unsafe fn loaded<F: Copy>(symbol: &CStr) -> Option<F> {
    // SAFETY: as `Library::optional`, over every loaded library.
    unsafe { cast(libc::dlsym(libc::RTLD_DEFAULT, symbol.as_ptr())) }
}

/// A symbol's address as the function pointer type `F`; `None` for null.
///
/// # Safety
/// A non-null `p` must be a function with `F`'s signature.
unsafe fn cast<F: Copy>(p: *mut c_void) -> Option<F> {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: a function pointer has a pointer's size (checked); the caller vouches for
    // the signature.
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy(&p) })
}

/// This thread's last `dl*` failure.
fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated message of this thread's last
    // dl* failure.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "not found".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_or_symbol_is_named() {
        let Err(LoadError::Open { library, why }) = Library::open("/nonexistent/libx.so.1") else {
            panic!("opened a library that is not there");
        };
        assert_eq!(library, "/nonexistent/libx.so.1");
        assert!(why.contains("/nonexistent/libx.so.1"), "{why}");
        let libc = Library::open("libc.so.6").unwrap();
        // SAFETY: `getpid` is `pid_t getpid(void)`.
        let getpid: unsafe extern "C" fn() -> libc::pid_t = unsafe { libc.get(c"getpid") }.unwrap();
        assert_eq!(unsafe { getpid() }, std::process::id() as libc::pid_t);
        let missing = unsafe { libc.get::<unsafe extern "C" fn()>(c"no_such_symbol") };
        assert_eq!(
            missing.err().unwrap().to_string(),
            "libc.so.6 has no no_such_symbol"
        );
    }
}
