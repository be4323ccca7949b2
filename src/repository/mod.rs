//! The model repository on disk, read as Triton reads it: one directory per model with a
//! `config.pbtxt` (protobuf text format of `inference.ModelConfig`), numeric version
//! directories and label files. Parsing and file I/O only; used at start-up.

mod parse;
pub mod remote;
mod spec;

use std::path::{Path, PathBuf};

pub use parse::{model_config_json, parse_model_config, parse_model_config_json};
pub use remote::{Location, RemoteSettings, Repositories, Snapshot};
pub(crate) use spec::model_kind;
pub use spec::{
    BatchingSpec, ClassifierSpec, EnsembleSpec, GroupKind, InstanceGroupSpec, ModelKind,
    PreprocessorSpec, QueuePolicySpec, ResizeMode,
};

use crate::domain::{ModelName, ModelVersion};
use crate::error::{ErrorKind, HasKind};

/// Prost types generated from `proto/model_config.proto` (Triton's field names and numbers).
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/inference.rs"));
}

#[derive(Debug, thiserror::Error)]
pub enum RepositoryError {
    /// A file or directory of a model; `path` is relative to the repository (no error
    /// shows where the repository lies on the server's disk).
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the model repository: {0}")]
    Root(#[source] std::io::Error),
    #[error("model '{model}': config.pbtxt does not parse: {message}")]
    Parse { model: String, message: String },
    #[error("model '{model}': field '{field}' is not supported: {remedy}")]
    Unsupported {
        model: String,
        field: String,
        remedy: String,
    },
    #[error("model '{model}': field '{field}': {message}")]
    Invalid {
        model: String,
        field: String,
        message: String,
    },
    /// A remote repository, or one of its models, that could not be downloaded.
    #[error("{0}")]
    Remote(remote::RemoteError),
    /// A model's failure, naming the objects of its remote repository that were left out
    /// (their keys cannot name files: it may have needed them).
    #[error(
        "{error}; the store's object {keys} was left out (its key cannot name a file of a \
         model: rename it)"
    )]
    LeftOut {
        error: Box<RepositoryError>,
        keys: String,
    },
}

impl HasKind for RepositoryError {
    fn kind(&self) -> ErrorKind {
        match self {
            RepositoryError::Io { .. } | RepositoryError::Root(_) => ErrorKind::Internal,
            // A configuration a client sent (`load` with `config`) or wrote.
            RepositoryError::Parse { .. }
            | RepositoryError::Unsupported { .. }
            | RepositoryError::Invalid { .. } => ErrorKind::InvalidInput,
            RepositoryError::Remote(_) => ErrorKind::NotReady,
            RepositoryError::LeftOut { error, .. } => error.kind(),
        }
    }
}

/// What one model's config may ask for, checked while it is validated, before anything is
/// allocated or started: a config over a limit fails its load with the field, its value
/// and the limit. Each is a flag (`Config`); the defaults are these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Versions served per model (`--max-model-versions`).
    pub versions: usize,
    /// Bytes of one batch's input (`--max-batch-bytes`): every batch a model runs
    /// (warm-up, batch-size timing, serving) holds at most the rows of its FP32
    /// `[3, height, width]` input that fit, fewer than `max_batch_size` where they must
    /// (`ClassifierSpec::batch_rows`).
    pub batch_bytes: u64,
    /// Rows a model's `model_warmup` samples run on each instance before it serves: each
    /// sample's `batch_size` times its `count` (`--max-warmup-rows`).
    pub warmup_rows: u64,
    /// Instances (each a thread with its own copy of the model) of one model version, as
    /// its `instance_group`s place them on this host (`--max-model-instances`). Checked
    /// as the model starts.
    pub model_instances: usize,
    /// Instances of every model together, those of a model being replaced included while
    /// it finishes its requests (`--max-instances`). Checked as a model starts.
    pub instances: usize,
    /// The longest a row may wait for a batch to fill, `max_queue_delay_microseconds`
    /// (`--max-queue-delay-secs`).
    pub queue_delay: std::time::Duration,
}

impl Limits {
    pub const DEFAULT_VERSIONS: usize = 16;
    pub const DEFAULT_BATCH_BYTES: u64 = 256 << 20;
    pub const DEFAULT_WARMUP_ROWS: u64 = 4096;
    pub const DEFAULT_MODEL_INSTANCES: usize = 32;
    pub const DEFAULT_INSTANCES: usize = 128;
    pub const DEFAULT_QUEUE_DELAY_SECS: u64 = 10;
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            versions: Self::DEFAULT_VERSIONS,
            batch_bytes: Self::DEFAULT_BATCH_BYTES,
            warmup_rows: Self::DEFAULT_WARMUP_ROWS,
            model_instances: Self::DEFAULT_MODEL_INSTANCES,
            instances: Self::DEFAULT_INSTANCES,
            queue_delay: std::time::Duration::from_secs(Self::DEFAULT_QUEUE_DELAY_SECS),
        }
    }
}

/// A model that passed validation and can be started.
#[derive(Debug, Clone)]
pub struct RepositoryModel {
    pub name: ModelName,
    pub dir: PathBuf,
    /// The configuration exactly as parsed from disk (returned by the config endpoints).
    pub config: pb::ModelConfig,
    pub version: ModelVersion,
    pub kind: ModelKind,
    /// [`fingerprint`] of the model's directory, taken before its files were read.
    pub fingerprint: u64,
}

/// A model whose directory exists but could not be loaded; the others still load.
#[derive(Debug)]
pub struct LoadFailure {
    pub model: String,
    pub error: RepositoryError,
}

#[derive(Debug, Default)]
pub struct ScanResult {
    pub models: Vec<RepositoryModel>,
    pub failures: Vec<LoadFailure>,
}

/// The config file of the model in `dir`, relative to it (`sub` directory, file name):
/// `configs/<config_name>.pbtxt` where `--model-config-name` names one and it exists, else
/// `config.pbtxt`; `None` when neither exists.
fn config_file(dir: &Path, config_name: Option<&str>) -> Option<(&'static str, String)> {
    if let Some(name) = config_name {
        let file = format!("{name}.pbtxt");
        if dir.join(CUSTOM_CONFIGS).join(&file).is_file() {
            return Some((CUSTOM_CONFIGS, file));
        }
    }
    dir.join("config.pbtxt")
        .is_file()
        .then(|| ("", "config.pbtxt".to_string()))
}

/// Where `--model-config-name` configs are, in a model's directory (Triton's).
const CUSTOM_CONFIGS: &str = "configs";

/// The model directories (those with a config file: [`config_file`]) of every repository
/// in `roots`, by name, sorted; a name found in more than one repository comes once per
/// repository. Only an unreadable repository is an error.
fn model_dirs(
    roots: &[PathBuf],
    config_name: Option<&str>,
) -> Result<Vec<(String, PathBuf)>, RepositoryError> {
    let mut dirs = Vec::new();
    for root in roots {
        for entry in std::fs::read_dir(root).map_err(RepositoryError::Root)? {
            let Ok(entry) = entry else { continue };
            let dir = entry.path();
            if dir.is_dir() && config_file(&dir, config_name).is_some() {
                dirs.push((entry.file_name().to_string_lossy().into_owned(), dir));
            }
        }
    }
    dirs.sort();
    Ok(dirs)
}

/// Reads every model directory of the repositories `roots`. Only an unreadable repository
/// is an error; a broken model becomes a [`LoadFailure`] and the rest load. A model name
/// found in more than one repository is not served (as in Triton).
pub fn scan(
    roots: &[PathBuf],
    config_name: Option<&str>,
    limits: &Limits,
) -> Result<ScanResult, RepositoryError> {
    let dirs = model_dirs(roots, config_name)?;
    let mut result = ScanResult::default();
    for copies in dirs.chunk_by(|a, b| a.0 == b.0) {
        let (name, dir) = &copies[0];
        let loaded = if copies.len() > 1 {
            Err(RepositoryError::Invalid {
                model: name.clone(),
                field: "name".into(),
                message: format!(
                    "the model is in {} model repositories; keep one of its directories",
                    copies.len()
                ),
            })
        } else {
            load_model(dir, name, config_name, limits)
        };
        match loaded {
            Ok(versions) => result.models.extend(versions),
            Err(error) => result.failures.push(LoadFailure {
                model: name.clone(),
                error,
            }),
        }
    }
    spec::check_ensembles(&mut result);
    Ok(result)
}

/// The directory of model `name` in the repositories `roots`, when exactly one has it.
pub fn model_dir(roots: &[PathBuf], config_name: Option<&str>, name: &str) -> Option<PathBuf> {
    let mut found = roots
        .iter()
        .map(|root| root.join(name))
        .filter(|dir| config_file(dir, config_name).is_some());
    let dir = found.next()?;
    found.next().is_none().then_some(dir)
}

/// A fingerprint of a model directory's files (names, sizes, modification times, two
/// levels deep: `config.pbtxt`, labels, version directories and their files). Poll mode
/// reloads a model when it changes.
pub fn fingerprint(dir: &Path) -> u64 {
    fn walk(dir: &Path, depth: u32, h: &mut xxhash_rust::xxh3::Xxh3) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let mut entries: Vec<_> = entries.filter_map(|e| e.ok()).collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let Ok(meta) = e.metadata() else { continue };
            h.update(e.file_name().as_encoded_bytes());
            h.update(&meta.len().to_le_bytes());
            if let Ok(modified) = meta.modified() {
                let since = modified
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                h.update(&since.as_nanos().to_le_bytes());
            }
            if meta.is_dir() && depth > 0 {
                walk(&e.path(), depth - 1, h);
            }
        }
    }
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    walk(dir, 1, &mut h);
    h.digest()
}

/// Every version of the model in `dir` that its `version_policy` serves, oldest first.
fn load_model(
    dir: &Path,
    name: &str,
    config_name: Option<&str>,
    limits: &Limits,
) -> Result<Vec<RepositoryModel>, RepositoryError> {
    // Before reading: a file changed while it is read shows as a change at the next poll.
    let print = fingerprint(dir);
    let (sub, file) = config_file(dir, config_name).ok_or_else(|| RepositoryError::Io {
        path: Path::new(name).join("config.pbtxt"),
        source: std::io::ErrorKind::NotFound.into(),
    })?;
    let text =
        spec::read_whole_model_file(dir, sub, name, "config.pbtxt", &file, MAX_CONFIG_BYTES)?;
    let text = String::from_utf8(text).map_err(|_| RepositoryError::Parse {
        model: name.to_string(),
        message: format!("{} is not UTF-8 text", Path::new(sub).join(&file).display()),
    })?;
    versions(dir, name, parse_model_config(name, &text)?, print, limits)
}

/// The largest `config.pbtxt` read (Triton's own are a few KiB).
const MAX_CONFIG_BYTES: usize = 1 << 20;

/// Names of the model directories in the repositories `roots` (those with a
/// `config.pbtxt`), sorted, once each, loaded or not.
pub fn model_names(roots: &[PathBuf], config_name: Option<&str>) -> Vec<String> {
    let mut names: Vec<String> = model_dirs(roots, config_name)
        .unwrap_or_default()
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    names.dedup();
    names
}

/// The model in `dir` with `config` instead of its `config.pbtxt` (a load request that
/// carries a config, as Triton's `config` load parameter): validated as a config on disk is.
pub fn load_model_with(
    dir: &Path,
    name: &str,
    config: pb::ModelConfig,
    limits: &Limits,
) -> Result<Vec<RepositoryModel>, RepositoryError> {
    versions(dir, name, config, fingerprint(dir), limits)
}

fn versions(
    dir: &Path,
    name: &str,
    mut config: pb::ModelConfig,
    print: u64,
    limits: &Limits,
) -> Result<Vec<RepositoryModel>, RepositoryError> {
    if config.name.is_empty() {
        // Triton fills an omitted name from the directory.
        config.name = name.to_string();
    } else if config.name != name {
        return Err(RepositoryError::Invalid {
            model: name.to_string(),
            field: "name".into(),
            message: format!(
                "'{}' differs from the directory name; rename one of them",
                config.name
            ),
        });
    }
    let available = spec::available_versions(dir, name)?;
    spec::select_versions(name, &config, &available, limits)?
        .into_iter()
        .map(|version| {
            Ok(RepositoryModel {
                name: ModelName::new(name),
                dir: dir.to_path_buf(),
                kind: spec::model_kind(dir, name, &config, version, limits)?,
                config: config.clone(),
                version,
                fingerprint: print,
            })
        })
        .collect()
}
