//! The repositories a server reads, local or in object storage (S3 and S3-compatible
//! hosts, GCS, Azure Blob). A remote repository is mirrored into a local directory under
//! `--repository-cache-dir` before each scan (start-up, every poll, each explicit load), so
//! everything past [`Repositories::scan`] reads local directories and never knows where
//! the files came from.

mod credentials;
mod http;
mod location;
mod mirror;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use prometheus::core::Collector;
use prometheus::{IntCounterVec, IntGaugeVec, Opts};

pub use location::{Location, RemoteUrl};

use super::{Limits, LoadFailure, RepositoryError, ScanResult};
use mirror::{Mirror, Skipped};

/// The remote repositories' cache and network limits (the `--repository-*` flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSettings {
    /// Where remote repositories are mirrored (`--repository-cache-dir`); by default
    /// `visiongate-repositories-<uid>` in the temporary directory, which must be this
    /// user's.
    pub cache_dir: Option<PathBuf>,
    /// The bytes the mirrors may hold together (`--repository-cache-max-bytes`).
    pub max_cache_bytes: u64,
    /// The largest object downloaded (`--repository-max-object-bytes`).
    pub max_object_bytes: u64,
    /// The longest one request to a store may take: a listing with all its pages, one
    /// object's download (`--repository-timeout-secs`).
    pub timeout: Duration,
}

impl RemoteSettings {
    pub const DEFAULT_MAX_CACHE_BYTES: u64 = 64 << 30;
    pub const DEFAULT_MAX_OBJECT_BYTES: u64 = 16 << 30;
    pub const DEFAULT_TIMEOUT_SECS: u64 = 300;

    pub fn cache_dir(&self) -> PathBuf {
        self.cache_dir.clone().unwrap_or_else(|| {
            // SAFETY: geteuid has no preconditions.
            let uid = unsafe { libc::geteuid() };
            std::env::temp_dir().join(format!("visiongate-repositories-{uid}"))
        })
    }
}

/// Why a remote repository or one of its models could not be read (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Unreachable,
    Credentials,
    NotFound,
    TooLarge,
    CacheFull,
    Empty,
    Timeout,
    Io,
    Other,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::Unreachable => "unreachable",
            Reason::Credentials => "credentials",
            Reason::NotFound => "not_found",
            Reason::TooLarge => "too_large",
            Reason::CacheFull => "cache_full",
            Reason::Empty => "empty",
            Reason::Timeout => "timeout",
            Reason::Io => "cache_io",
            Reason::Other => "other",
        }
    }
}

/// A remote repository's failure: its URL and what went wrong, with no credential in it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct RemoteError {
    pub reason: Reason,
    pub message: String,
}

enum Source {
    Local(PathBuf),
    Remote(Box<Mirror>),
}

/// Every `--model-repository`, in flag order.
pub struct Repositories {
    sources: Vec<Source>,
    settings: Option<RemoteSettings>,
    /// A sync holds it to write; a scan, and the loads that read what it scanned, to read:
    /// no sync changes a mirror under a load.
    gate: std::sync::Arc<tokio::sync::RwLock<()>>,
    /// What each remote repository's mirror holds (bytes), by source.
    held: std::sync::Mutex<Vec<u64>>,
    metrics: RemoteMetrics,
    /// `--model-config-name`: which config file each model reads.
    config_name: Option<String>,
    /// The objects the last sync of each remote repository left out, by source.
    skipped: std::sync::Mutex<Vec<Vec<Skipped>>>,
}

/// What a scan found. No sync changes a mirror while it lives, so the loads of what it
/// found read the files it read: keep it until they are done.
pub struct Snapshot {
    scan: ScanResult,
    _reading: tokio::sync::OwnedRwLockReadGuard<()>,
}

impl std::ops::Deref for Snapshot {
    type Target = ScanResult;
    fn deref(&self) -> &ScanResult {
        &self.scan
    }
}

impl std::ops::DerefMut for Snapshot {
    fn deref_mut(&mut self) -> &mut ScanResult {
        &mut self.scan
    }
}

/// The remote repositories' series (registered with the server's others).
#[derive(Clone)]
struct RemoteMetrics {
    syncs: IntCounterVec,
    model_failures: IntCounterVec,
    downloaded: IntCounterVec,
    cache_bytes: IntGaugeVec,
    skipped: IntGaugeVec,
}

impl RemoteMetrics {
    fn new() -> RemoteMetrics {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        RemoteMetrics {
            syncs: counter(
                "visiongate_repository_syncs_total",
                "Syncs of a remote model repository into the cache (start-up, polls, \
                 explicit loads), by result: ok, or why the repository could not be read",
                &["repository", "result"],
            ),
            model_failures: counter(
                "visiongate_repository_model_sync_failures_total",
                "Models of a remote repository that a sync could not bring up to date \
                 (their previous files stay), by reason",
                &["repository", "reason"],
            ),
            downloaded: counter(
                "visiongate_repository_downloaded_bytes_total",
                "Bytes downloaded from a remote model repository",
                &["repository"],
            ),
            skipped: IntGaugeVec::new(
                Opts::new(
                    "visiongate_repository_objects_skipped",
                    "Objects the last sync of a remote model repository left out: keys that \
                     cannot name a file of a model (a '//', a '.' or '..' segment, a control \
                     character), each named in a warning",
                ),
                &["repository"],
            )
            .expect("valid metric"),
            cache_bytes: IntGaugeVec::new(
                Opts::new(
                    "visiongate_repository_cache_bytes",
                    "Bytes of a remote model repository held in --repository-cache-dir",
                ),
                &["repository"],
            )
            .expect("valid metric"),
        }
    }
}

impl Repositories {
    /// The repositories of `locations`: a remote one gets its client (credentials read
    /// now) and its directory in the cache. Nothing is downloaded yet.
    pub fn open(locations: &[Location], settings: &RemoteSettings) -> Result<Repositories, String> {
        let network = credentials::Network::new(settings.timeout);
        let mut sources = Vec::new();
        for location in locations {
            sources.push(match location {
                Location::Local(dir) => Source::Local(dir.clone()),
                Location::Remote(url) => {
                    let client = credentials::client(url, &network)?;
                    let mirror = Mirror::open(url.clone(), client, settings)?;
                    tracing::info!(
                        repository = %url,
                        credentials = mirror.credentials(),
                        "remote model repository: mirrored into --repository-cache-dir"
                    );
                    Source::Remote(Box::new(mirror))
                }
            });
        }
        let held = vec![0; sources.len()];
        let skipped = vec![Vec::new(); sources.len()];
        Ok(Repositories {
            sources,
            settings: Some(settings.clone()),
            gate: Default::default(),
            held: std::sync::Mutex::new(held),
            metrics: RemoteMetrics::new(),
            config_name: None,
            skipped: std::sync::Mutex::new(skipped),
        })
    }

    /// Models read `configs/<name>.pbtxt` where they have it (`--model-config-name`).
    pub fn with_config_name(mut self, name: Option<String>) -> Repositories {
        self.config_name = name;
        self
    }

    /// The directory of model `name`, when exactly one repository has it.
    pub fn model_dir(&self, name: &str) -> Option<PathBuf> {
        super::model_dir(&self.roots(), self.config_name.as_deref(), name)
    }

    /// The names of every model directory, loaded or not, sorted.
    pub fn model_names(&self) -> Vec<String> {
        super::model_names(&self.roots(), self.config_name.as_deref())
    }

    /// The local directories to scan: local repositories, and remote ones' mirrors as the
    /// last sync left them.
    pub fn roots(&self) -> Vec<PathBuf> {
        self.sources
            .iter()
            .map(|s| match s {
                Source::Local(dir) => dir.clone(),
                Source::Remote(m) => m.root.clone(),
            })
            .collect()
    }

    /// The series to register with the server's metrics.
    pub fn collectors(&self) -> Vec<Box<dyn Collector>> {
        let m = &self.metrics;
        vec![
            Box::new(m.syncs.clone()),
            Box::new(m.model_failures.clone()),
            Box::new(m.downloaded.clone()),
            Box::new(m.cache_bytes.clone()),
            Box::new(m.skipped.clone()),
        ]
    }

    /// Brings every remote repository's mirror up to date, then reads them all as local
    /// repositories. A remote repository that cannot be read fails the scan (nothing is
    /// taken for removed); a model that could not be brought up to date is a failure of
    /// the scan's, not one of its models, whatever its mirror still holds. The mirrors
    /// stay as scanned while the snapshot lives.
    pub async fn scan(&self, limits: &Limits) -> Result<Snapshot, RepositoryError> {
        let writing = self.gate.clone().write_owned().await;
        let failures = self.sync().await?;
        let reading = writing.downgrade();
        let (roots, limits, name) = (self.roots(), *limits, self.config_name.clone());
        let mut scan =
            tokio::task::spawn_blocking(move || super::scan(&roots, name.as_deref(), &limits))
                .await
                .map_err(|e| RepositoryError::Root(std::io::Error::other(e.to_string())))??;
        for (model, error) in failures {
            scan.models.retain(|m| m.name.as_str() != model);
            scan.failures.retain(|f| f.model != model);
            scan.failures.push(LoadFailure {
                model,
                error: RepositoryError::Remote(error),
            });
        }
        // A model that fails with objects of its left out names them.
        let skipped = self.skipped.lock().unwrap_or_else(|p| p.into_inner());
        scan.failures = std::mem::take(&mut scan.failures)
            .into_iter()
            .map(|f| {
                let keys: Vec<String> = skipped
                    .iter()
                    .flatten()
                    .filter(|(model, _)| model.as_deref() == Some(f.model.as_str()))
                    .map(|(_, key)| format!("'{}'", key.escape_debug()))
                    .collect();
                if keys.is_empty() {
                    return f;
                }
                LoadFailure {
                    model: f.model,
                    error: RepositoryError::LeftOut {
                        error: Box::new(f.error),
                        keys: keys.join(", "),
                    },
                }
            })
            .collect();
        drop(skipped);
        Ok(Snapshot {
            scan,
            _reading: reading,
        })
    }

    /// Call with the gate held to write.
    async fn sync(&self) -> Result<Vec<(String, RemoteError)>, RepositoryError> {
        let Some(settings) = &self.settings else {
            return Ok(Vec::new());
        };
        let mut failures = Vec::new();
        for (i, source) in self.sources.iter().enumerate() {
            let Source::Remote(mirror) = source else {
                continue;
            };
            let label = [mirror.url.text.as_str()];
            let others: u64 = self
                .held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, b)| b)
                .sum();
            let started = Instant::now();
            let synced = mirror
                .sync(settings, settings.max_cache_bytes.saturating_sub(others))
                .await;
            let m = &self.metrics;
            match synced {
                Ok(synced) => {
                    m.syncs.with_label_values(&[label[0], "ok"]).inc();
                    m.downloaded
                        .with_label_values(&label)
                        .inc_by(synced.bytes_downloaded);
                    m.cache_bytes
                        .with_label_values(&label)
                        .set(synced.bytes_held as i64);
                    self.held.lock().unwrap_or_else(|p| p.into_inner())[i] = synced.bytes_held;
                    m.skipped
                        .with_label_values(&label)
                        .set(synced.skipped.count as i64);
                    let mut skipped = self.skipped.lock().unwrap_or_else(|p| p.into_inner());
                    // Named once, not at every poll (the first few of many).
                    let named: std::collections::HashSet<&Skipped> = skipped[i].iter().collect();
                    let new: Vec<&Skipped> = synced
                        .skipped
                        .named
                        .iter()
                        .filter(|s| !named.contains(s))
                        .collect();
                    for (model, key) in new {
                        tracing::warn!(
                            repository = %mirror.url,
                            model = model.as_deref().unwrap_or("-"),
                            "object '{}' left out: its key cannot name a file of a model",
                            key.escape_debug()
                        );
                    }
                    if synced.skipped.count > synced.skipped.named.len() {
                        tracing::warn!(
                            repository = %mirror.url,
                            "{} objects left out in all; the first {} are named",
                            synced.skipped.count,
                            synced.skipped.named.len()
                        );
                    }
                    skipped[i] = synced.skipped.named;
                    if synced.bytes_downloaded > 0 {
                        tracing::info!(
                            repository = %mirror.url,
                            bytes = synced.bytes_downloaded,
                            seconds = started.elapsed().as_secs_f64(),
                            "downloaded from the remote repository"
                        );
                    }
                    for (model, error) in synced.failures {
                        m.model_failures
                            .with_label_values(&[label[0], error.reason.label()])
                            .inc();
                        tracing::error!(model, reason = error.reason.label(), "{error}");
                        failures.push((model, error));
                    }
                }
                Err(error) => {
                    m.syncs
                        .with_label_values(&[label[0], error.reason.label()])
                        .inc();
                    return Err(RepositoryError::Remote(error));
                }
            }
        }
        Ok(failures)
    }
}
