//! A torch.export package (`.pt2`, a zip archive) read by this server before libtorch sees
//! it: the zip's directory is checked first (entry names stay inside the package; sizes
//! and compression ratios within the limits below), then its metadata is read from the
//! zip, and only once that metadata has been checked is the package unpacked, here, into
//! a new private directory. libtorch's loader reads that directory, never the zip, and the
//! directory is removed when [`Unpacked`] is dropped: a failed load and an unloaded model
//! alike leave nothing behind.
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Entries in one package (AOTInductor writes about ten).
pub const MAX_ENTRIES: usize = 10_000;
/// The largest compression ratio of an entry over [`RATIO_FLOOR`] bytes unpacked (a
/// package's code and weights compress a few times at most; zeros, a thousand times).
pub const MAX_RATIO: u64 = 100;
const RATIO_FLOOR: u64 = 1 << 20;
/// The largest metadata entry read.
const MAX_METADATA_BYTES: u64 = 1 << 20;

/// The bytes a package of `len` bytes may unpack to, in all.
pub fn max_unpacked(len: u64) -> u64 {
    len.saturating_mul(4).saturating_add(256 << 20)
}

/// A package whose zip directory passed the checks.
pub struct Checked {
    archive: zip::ZipArchive<File>,
}

/// Opens the package at `path` and checks its zip directory. Nothing is decompressed yet.
pub fn open(path: &Path) -> Result<Checked, String> {
    let file = File::open(path).map_err(|e| format!("cannot open it: {e}"))?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| format!("not a torch.export package (a zip archive): {e}"))?;
    if archive.len() > MAX_ENTRIES {
        return Err(format!(
            "the package has {} entries; at most {MAX_ENTRIES} are read",
            archive.len()
        ));
    }
    let limit = max_unpacked(len);
    let mut total = 0u64;
    for i in 0..archive.len() {
        let entry = archive
            .by_index_raw(i)
            .map_err(|e| format!("entry {i}: {e}"))?;
        let name = entry.name().to_string();
        inside(&name)?;
        if entry.is_symlink() {
            return Err(format!("entry '{name}' is a symbolic link"));
        }
        if entry.encrypted() {
            return Err(format!("entry '{name}' is encrypted"));
        }
        match entry.compression() {
            zip::CompressionMethod::Stored | zip::CompressionMethod::Deflated => {}
            other => {
                return Err(format!(
                    "entry '{name}' is compressed with {other:?}; a package's entries are \
                     stored or deflated"
                ))
            }
        }
        let (size, packed) = (entry.size(), entry.compressed_size());
        if size > RATIO_FLOOR && size > packed.saturating_mul(MAX_RATIO) {
            return Err(format!(
                "entry '{name}' unpacks from {packed} to {size} bytes, over {MAX_RATIO} times \
                 its size in the package"
            ));
        }
        total = total.saturating_add(size);
        if total > limit {
            return Err(format!(
                "the package unpacks to over {limit} bytes (four times its {len} bytes and \
                 256 MiB)"
            ));
        }
    }
    Ok(Checked { archive })
}

/// An entry name that stays inside the package: relative, no `..` or empty segment (a
/// trailing `/` marks a directory), no backslash or NUL.
fn inside(name: &str) -> Result<(), String> {
    let body = name.strip_suffix('/').unwrap_or(name);
    let bad = body.is_empty()
        || body.starts_with('/')
        || body.contains(['\\', '\0'])
        || body
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..");
    if bad {
        return Err(format!(
            "entry '{}' is not a path inside the package",
            name.escape_debug()
        ));
    }
    Ok(())
}

impl Checked {
    /// The metadata of the package's model `model` (AOTInductor's keys and the exporter's):
    /// the `*_metadata.json` objects under `data/aotinductor/<model>/`, merged.
    pub fn metadata(&mut self, model: &str) -> Result<HashMap<String, String>, String> {
        // Under the archive's top directory (`<archive>/data/...`, what AOTInductor writes)
        // or at its root (older packages), as libtorch's loader finds them.
        let place = format!("data/aotinductor/{model}/");
        let under = |name: &str| {
            name.starts_with(&place)
                || name
                    .split_once('/')
                    .is_some_and(|(_, rest)| rest.starts_with(&place))
        };
        let names: Vec<String> = self
            .archive
            .file_names()
            .filter(|n| under(n) && n.ends_with("_metadata.json"))
            .map(str::to_string)
            .collect();
        if names.is_empty() {
            return Err(format!(
                "no data/aotinductor/{model}/*_metadata.json in the package: not a package \
                 AOTInductor wrote"
            ));
        }
        let mut metadata = HashMap::new();
        for name in names {
            let mut entry = self
                .archive
                .by_name(&name)
                .map_err(|e| format!("entry '{name}': {e}"))?;
            if entry.size() > MAX_METADATA_BYTES {
                return Err(format!(
                    "entry '{name}' is {} bytes; metadata is at most {MAX_METADATA_BYTES}",
                    entry.size()
                ));
            }
            let mut text = String::new();
            (&mut entry)
                .take(MAX_METADATA_BYTES + 1)
                .read_to_string(&mut text)
                .map_err(|e| format!("entry '{name}': {e}"))?;
            let object: HashMap<String, serde_json::Value> = serde_json::from_str(&text)
                .map_err(|e| format!("entry '{name}' is not a JSON object: {e}"))?;
            for (key, value) in object {
                let value = match value {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                };
                metadata.insert(key, value);
            }
        }
        Ok(metadata)
    }

    /// Unpacks every entry into a new private directory under the temporary directory.
    pub fn unpack(mut self) -> Result<Unpacked, String> {
        let unpacked = Unpacked::create()?;
        let io = |what: &str, e: std::io::Error| format!("unpacking {what}: {e}");
        for i in 0..self.archive.len() {
            let mut entry = self
                .archive
                .by_index(i)
                .map_err(|e| format!("entry {i}: {e}"))?;
            let name = entry.name().to_string();
            let path = unpacked.dir.join(name.trim_end_matches('/'));
            if entry.is_dir() {
                std::fs::create_dir_all(&path).map_err(|e| io(&name, e))?;
                continue;
            }
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| io(&name, e))?;
            }
            let mut file = create_new(&path).map_err(|e| io(&name, e))?;
            let size = entry.size();
            let written = std::io::copy(&mut (&mut entry).take(size + 1), &mut file)
                .map_err(|e| io(&name, e))?;
            if written != size {
                return Err(format!(
                    "entry '{name}' unpacked to {written} bytes; its directory says {size}"
                ));
            }
        }
        Ok(unpacked)
    }
}

/// A file created here, never one already there or a link.
fn create_new(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// A package's unpacked files, removed when dropped.
pub struct Unpacked {
    pub dir: PathBuf,
}

impl Unpacked {
    /// A new directory of this user's alone (`visiongate-pt2-<pid>-<n>` in the temporary
    /// directory), created here: a name already taken, a planted link included, is passed
    /// over.
    fn create() -> Result<Unpacked, String> {
        use std::os::unix::fs::DirBuilderExt;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let base = std::env::temp_dir();
        for _ in 0..100 {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir = base.join(format!("visiongate-pt2-{}-{n}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(Unpacked { dir }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(format!(
                        "cannot make a directory to unpack it in {}: {e}",
                        base.display()
                    ))
                }
            }
        }
        Err(format!(
            "cannot make a directory to unpack it in {}: every name tried is taken",
            base.display()
        ))
    }
}

impl Drop for Unpacked {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), "cannot remove an unpacked package: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn package(entries: &[(&str, &[u8], bool)]) -> (tempdir::Dir, PathBuf) {
        let dir = tempdir::Dir::new();
        let path = dir.0.join("model.pt2");
        let mut zip = zip::ZipWriter::new(File::create(&path).unwrap());
        for (name, body, deflate) in entries {
            let method = if *deflate {
                zip::CompressionMethod::Deflated
            } else {
                zip::CompressionMethod::Stored
            };
            let options = zip::write::SimpleFileOptions::default()
                .compression_method(method)
                .large_file(body.len() > u32::MAX as usize);
            zip.start_file(*name, options).unwrap();
            zip.write_all(body).unwrap();
        }
        zip.finish().unwrap();
        (dir, path)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let p = std::env::temp_dir()
                    .join(format!("vg-package-test-{}-{n}", std::process::id()));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    const META: &[u8] = br#"{"AOTI_DEVICE_KEY": "cpu", "batch_max": "64"}"#;

    #[test]
    fn a_package_unpacks_into_its_own_directory_which_goes_with_it() {
        let (_d, path) = package(&[
            ("p/data/aotinductor/model/x_metadata.json", META, false),
            ("p/data/aotinductor/model/x.so", &[7u8; 5000], true),
        ]);
        let mut checked = open(&path).unwrap();
        let metadata = checked.metadata("model").unwrap();
        assert_eq!(metadata["AOTI_DEVICE_KEY"], "cpu");
        assert_eq!(metadata["batch_max"], "64");
        let unpacked = checked.unpack().unwrap();
        let dir = unpacked.dir.clone();
        let so = dir.join("p/data/aotinductor/model/x.so");
        assert_eq!(std::fs::read(&so).unwrap(), [7u8; 5000]);
        drop(unpacked);
        assert!(!dir.exists());
    }

    #[test]
    fn hostile_packages_are_refused_before_anything_is_unpacked() {
        let zeros = vec![0u8; 4 << 20];
        for (entries, says) in [
            (
                vec![("p/../../escape/f", b"x".as_slice(), false)],
                "not a path inside",
            ),
            (
                vec![("/etc/f", b"x".as_slice(), false)],
                "not a path inside",
            ),
            (
                vec![("p/a\\..\\b", b"x".as_slice(), false)],
                "not a path inside",
            ),
            (
                vec![("p/data/aotinductor/model/x_metadata.json", &zeros[..], true)],
                "times its size",
            ),
        ] {
            let (_d, path) = package(&entries);
            let err = open(&path).err().unwrap();
            assert!(err.contains(says), "{entries:?}: {err}");
        }
        let (_d, path) = package(&[("p/other", b"x", false)]);
        let err = open(&path).unwrap().metadata("model").unwrap_err();
        assert!(err.contains("_metadata.json"), "{err}");
        let text = _d.0.join("text.pt2");
        std::fs::write(&text, b"not a zip at all").unwrap();
        assert!(open(&text)
            .err()
            .unwrap()
            .contains("not a torch.export package"));
    }
}
