//! One remote repository mirrored into a local directory, a model at a time: each sync
//! lists the objects under the repository's prefix, and for every model whose objects
//! changed (by ETag and size) downloads the changed ones beside the mirror, then moves
//! them in together; a model whose download fails keeps its previous files. Models gone
//! from the listing are removed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use futures_util::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use tokio::io::AsyncWriteExt;

use super::credentials::Client;
use super::location::RemoteUrl;
use super::{Reason, RemoteError, RemoteSettings};

/// The most objects one listing may return (a repository's models, versions and files).
const MAX_OBJECTS: usize = 100_000;
/// Path segments below the prefix (model, version, files inside a model file's directory).
const MAX_DEPTH: usize = 16;

/// What a listed object was when it was downloaded.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    size: u64,
    /// The ETag, or the modification time where the store gives none.
    tag: String,
}

/// A model's objects, by their path inside the model's directory.
type ModelObjects = BTreeMap<String, Stamp>;

pub struct Mirror {
    pub url: RemoteUrl,
    client: Client,
    prefix: Option<ObjectPath>,
    /// The mirror: one directory per model, as a local repository.
    pub root: PathBuf,
    /// Downloads in progress, moved into `root` once a model's are all in.
    incoming: PathBuf,
    /// What `root` holds now, per model.
    held: Mutex<BTreeMap<String, ModelObjects>>,
    /// Held for the mirror's life: no second server uses the same directories.
    _lock: std::fs::File,
}

/// One sync's outcome: the models that could not be brought up to date, with why.
pub struct Synced {
    pub failures: Vec<(String, RemoteError)>,
    pub bytes_held: u64,
    pub bytes_downloaded: u64,
}

impl Mirror {
    pub fn open(
        url: RemoteUrl,
        client: Client,
        settings: &RemoteSettings,
    ) -> Result<Mirror, String> {
        let id = format!(
            "{}-{:016x}",
            url.scheme(),
            xxhash_rust::xxh3::xxh3_64(url.text.as_bytes())
        );
        let dir = &settings.cache_dir;
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("--repository-cache-dir: cannot create it: {e}"))?;
        let lock = lock(&dir.join(format!("{id}.lock")))?;
        let root = dir.join(&id);
        let incoming = dir.join(format!("{id}.incoming"));
        // What an earlier run left is not trusted: the first sync downloads everything.
        for d in [&root, &incoming] {
            match std::fs::remove_dir_all(d) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(format!("--repository-cache-dir: cannot clear it: {e}")),
            }
            std::fs::create_dir_all(d)
                .map_err(|e| format!("--repository-cache-dir: cannot create it: {e}"))?;
        }
        let prefix = (!url.prefix.is_empty()).then(|| ObjectPath::from(url.prefix.as_str()));
        Ok(Mirror {
            url,
            client,
            prefix,
            root,
            incoming,
            held: Mutex::new(BTreeMap::new()),
            _lock: lock,
        })
    }

    pub fn credentials(&self) -> &str {
        &self.client.credentials
    }

    /// Brings the mirror up to date with the store. An error (the store unreachable, the
    /// credentials refused, nothing listed) leaves the mirror as it was; a model that
    /// cannot be brought up to date is one of the returned failures, its files as they were.
    /// `cache_left` is what the cache may hold for this repository.
    pub async fn sync(
        &self,
        settings: &RemoteSettings,
        cache_left: u64,
    ) -> Result<Synced, RemoteError> {
        let listed = self.list().await?;
        if listed.is_empty() {
            return Err(self.error(
                Reason::Empty,
                format!(
                    "lists no model files (credentials: {}); check the bucket and path",
                    self.client.credentials
                ),
            ));
        }
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut failures = Vec::new();
        let mut bytes_held = 0u64;
        let mut bytes_downloaded = 0u64;
        for (model, objects) in &listed {
            let size: u64 = objects.values().map(|s| s.size).sum();
            if let Some((name, stamp)) = objects
                .iter()
                .find(|(_, s)| s.size > settings.max_object_bytes)
            {
                failures.push((
                    model.clone(),
                    self.error(
                        Reason::TooLarge,
                        format!(
                            "object '{model}/{name}' is {} bytes, over \
                             --repository-max-object-bytes {}",
                            stamp.size, settings.max_object_bytes
                        ),
                    ),
                ));
                bytes_held += held_size(&held, model);
                continue;
            }
            if bytes_held + size > cache_left {
                failures.push((
                    model.clone(),
                    self.error(
                        Reason::CacheFull,
                        format!(
                            "model '{model}' ({size} bytes) does not fit in the repository \
                             cache: {bytes_held} bytes of this repository's models before it, \
                             --repository-cache-max-bytes {}",
                            settings.max_cache_bytes
                        ),
                    ),
                ));
                bytes_held += held_size(&held, model);
                continue;
            }
            if held.get(model) == Some(objects) {
                bytes_held += size;
                continue;
            }
            match self.update(model, objects, held.get(model), settings).await {
                Ok((stamps, downloaded)) => {
                    bytes_downloaded += downloaded;
                    bytes_held += stamps.values().map(|s| s.size).sum::<u64>();
                    self.held
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(model.clone(), stamps);
                }
                Err(e) => {
                    bytes_held += held_size(&held, model);
                    failures.push((model.clone(), e));
                }
            }
        }
        // Models no longer listed.
        for model in held.keys().filter(|m| !listed.contains_key(*m)) {
            let _ = std::fs::remove_dir_all(self.root.join(model));
            self.held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(model);
            tracing::info!(repository = %self.url, model, "removed from the cache: no longer in the repository");
        }
        Ok(Synced {
            failures,
            bytes_held,
            bytes_downloaded,
        })
    }

    /// Every object under the prefix, by model and path inside it. Objects at the top of
    /// the repository (no model directory) are left out, as Triton does.
    async fn list(&self) -> Result<BTreeMap<String, ModelObjects>, RemoteError> {
        let mut models: BTreeMap<String, ModelObjects> = BTreeMap::new();
        let mut stream = self.client.store.list(self.prefix.as_ref());
        let mut count = 0usize;
        while let Some(item) = stream.next().await {
            let meta = item.map_err(|e| self.store_error("listing", e))?;
            count += 1;
            if count > MAX_OBJECTS {
                return Err(self.error(
                    Reason::TooLarge,
                    format!("lists over {MAX_OBJECTS} objects; give the models a repository of their own"),
                ));
            }
            let parts: Vec<String> = meta
                .location
                .parts()
                .map(|p| p.as_ref().to_string())
                .collect();
            let skip = self.prefix.as_ref().map_or(0, |p| p.parts().count());
            let inside = &parts[skip.min(parts.len())..];
            if inside.len() < 2 {
                continue;
            }
            if inside.len() > MAX_DEPTH + 1 || inside.iter().any(|p| !safe_segment(p)) {
                tracing::warn!(repository = %self.url, object = %meta.location, "object left out: its path cannot be a file of a model");
                continue;
            }
            let tag = meta
                .e_tag
                .clone()
                .unwrap_or_else(|| meta.last_modified.timestamp_millis().to_string());
            models.entry(inside[0].clone()).or_default().insert(
                inside[1..].join("/"),
                Stamp {
                    size: meta.size,
                    tag,
                },
            );
        }
        Ok(models)
    }

    /// Downloads the objects of `model` that differ from what the mirror holds, then moves
    /// them in and removes the files no longer listed; on failure nothing in the mirror
    /// changed. Returns the model's stamps as downloaded, and the bytes downloaded.
    async fn update(
        &self,
        model: &str,
        listed: &ModelObjects,
        held: Option<&ModelObjects>,
        settings: &RemoteSettings,
    ) -> Result<(ModelObjects, u64), RemoteError> {
        let staging = self.incoming.join(model);
        let _ = std::fs::remove_dir_all(&staging);
        let result = self.download(model, listed, held, &staging, settings).await;
        let outcome = match result {
            Ok((stamps, downloaded)) => self
                .move_in(model, &stamps, &staging)
                .map(|()| (stamps, downloaded))
                .map_err(|e| {
                    self.error(
                        Reason::Io,
                        format!("model '{model}': cannot write the cache: {e}"),
                    )
                }),
            Err(e) => Err(e),
        };
        let _ = std::fs::remove_dir_all(&staging);
        outcome
    }

    async fn download(
        &self,
        model: &str,
        listed: &ModelObjects,
        held: Option<&ModelObjects>,
        staging: &Path,
        settings: &RemoteSettings,
    ) -> Result<(ModelObjects, u64), RemoteError> {
        let mut stamps = ModelObjects::new();
        let mut downloaded = 0u64;
        for (name, stamp) in listed {
            if held.and_then(|h| h.get(name)) == Some(stamp) {
                stamps.insert(name.clone(), stamp.clone());
                continue;
            }
            let key = match &self.prefix {
                Some(p) => format!("{p}/{model}/{name}"),
                None => format!("{model}/{name}"),
            };
            let target = staging.join(name);
            let fetch = self.fetch(&key, &target, settings.max_object_bytes);
            let got = tokio::time::timeout(settings.timeout, fetch)
                .await
                .map_err(|_| {
                    self.error(
                        Reason::Timeout,
                        format!(
                            "object '{model}/{name}' did not download within \
                             --repository-timeout-secs {}",
                            settings.timeout.as_secs()
                        ),
                    )
                })??;
            downloaded += got.size;
            stamps.insert(name.clone(), got);
        }
        Ok((stamps, downloaded))
    }

    /// One object streamed to `target`, at most `limit` bytes.
    async fn fetch(&self, key: &str, target: &Path, limit: u64) -> Result<Stamp, RemoteError> {
        let what = format!("object '{}'", self.relative(key));
        let result = self
            .client
            .store
            .get(&ObjectPath::from(key))
            .await
            .map_err(|e| self.store_error(&what, e))?;
        let size = result.meta.size;
        if size > limit {
            return Err(self.error(
                Reason::TooLarge,
                format!("{what} is {size} bytes, over --repository-max-object-bytes {limit}"),
            ));
        }
        let tag = result
            .meta
            .e_tag
            .clone()
            .unwrap_or_else(|| result.meta.last_modified.timestamp_millis().to_string());
        let io = |e: std::io::Error| {
            self.error(Reason::Io, format!("{what}: cannot write the cache: {e}"))
        };
        if let Some(parent) = target.parent() {
            tokio::fs::create_dir_all(parent).await.map_err(io)?;
        }
        let mut file = tokio::fs::File::create(target).await.map_err(io)?;
        let mut written = 0u64;
        let mut stream = result.into_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.store_error(&what, e))?;
            written += chunk.len() as u64;
            if written > size {
                return Err(self.error(
                    Reason::Other,
                    format!("{what} sent more than the {size} bytes it announced"),
                ));
            }
            file.write_all(&chunk).await.map_err(io)?;
        }
        if written != size {
            return Err(self.error(
                Reason::Other,
                format!("{what} ended after {written} of its {size} bytes"),
            ));
        }
        file.sync_all().await.map_err(io)?;
        Ok(Stamp { size, tag })
    }

    /// Moves a model's downloaded files into the mirror and removes the ones not listed.
    fn move_in(&self, model: &str, stamps: &ModelObjects, staging: &Path) -> std::io::Result<()> {
        let dir = self.root.join(model);
        for name in stamps.keys() {
            let from = staging.join(name);
            if from.exists() {
                let to = dir.join(name);
                if let Some(parent) = to.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::rename(&from, &to)?;
            }
        }
        remove_unlisted(&dir, &dir, stamps)?;
        Ok(())
    }

    fn relative(&self, key: &str) -> String {
        match &self.prefix {
            Some(p) => key
                .strip_prefix(&format!("{p}/"))
                .unwrap_or(key)
                .to_string(),
            None => key.to_string(),
        }
    }

    fn error(&self, reason: Reason, message: String) -> RemoteError {
        RemoteError {
            reason,
            message: self.client.redact(&format!("{}: {message}", self.url)),
        }
    }

    /// A store's error as a reason and one plain sentence: what was asked, the HTTP status
    /// and the store's error code where it answered, the credentials' source where it
    /// refused them. The store's own message (request URLs, response bodies) is left out.
    fn store_error(&self, what: &str, e: object_store::Error) -> RemoteError {
        use object_store::Error as E;
        let text = e.to_string();
        let code = between(&text, "<Code>", "</Code>")
            .or_else(|| between(&text, "\"reason\": \"", "\""))
            .map(|c| format!(" ({c})"))
            .unwrap_or_default();
        let status = status(&text);
        // A listing's refusal arrives as a generic error with its status.
        let refused = status
            .as_deref()
            .is_some_and(|s| s.starts_with("401") || s.starts_with("403"));
        let (reason, message) = match &e {
            _ if refused => (
                Reason::Credentials,
                format!(
                    "{what}: the store refused the credentials ({}{}); they came from {}",
                    status.as_deref().unwrap_or(""),
                    code.replace(" (", ", ").replace(')', ""),
                    self.client.credentials
                ),
            ),
            E::PermissionDenied { .. } | E::Unauthenticated { .. } => (
                Reason::Credentials,
                format!(
                    "{what}: the store refused the credentials{code}; they came from {}",
                    self.client.credentials
                ),
            ),
            E::NotFound { .. } => (
                Reason::NotFound,
                format!("{what}: not found{code}; check the bucket (or container) and path"),
            ),
            _ => match http_kind(&e) {
                Some(object_store::client::HttpErrorKind::Connect) => (
                    Reason::Unreachable,
                    format!("{what}: cannot connect to the store{}", retries(&text)),
                ),
                Some(object_store::client::HttpErrorKind::Timeout) => (
                    Reason::Timeout,
                    format!(
                        "{what}: the store did not answer within --repository-timeout-secs{}",
                        retries(&text)
                    ),
                ),
                Some(_) => (
                    Reason::Unreachable,
                    format!(
                        "{what}: the connection to the store failed{}",
                        retries(&text)
                    ),
                ),
                None => match status {
                    Some(status) => (
                        Reason::Other,
                        format!("{what}: the store answered {status}{code}"),
                    ),
                    None => {
                        tracing::debug!(repository = %self.url, "{what}: {}", self.client.redact(&text));
                        (
                            Reason::Other,
                            format!("{what}: the request to the store failed"),
                        )
                    }
                },
            },
        };
        self.error(reason, message)
    }
}

fn held_size(held: &BTreeMap<String, ModelObjects>, model: &str) -> u64 {
    held.get(model)
        .map_or(0, |o| o.values().map(|s| s.size).sum())
}

/// A path segment that can name a file or directory inside a model's directory.
fn safe_segment(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && s.len() <= 255 && !s.contains(['\0', '\\'])
}

/// Removes the files below `dir` that `stamps` does not list, and directories left empty.
fn remove_unlisted(base: &Path, dir: &Path, stamps: &ModelObjects) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            remove_unlisted(base, &path, stamps)?;
            if std::fs::read_dir(&path)?.next().is_none() {
                std::fs::remove_dir(&path)?;
            }
        } else {
            let name = path
                .strip_prefix(base)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned();
            if !stamps.contains_key(&name) {
                std::fs::remove_file(&path)?;
            }
        }
    }
    Ok(())
}

/// An exclusive lock on `path` (created), held while the file stays open.
fn lock(path: &Path) -> Result<std::fs::File, String> {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| format!("--repository-cache-dir: cannot create a lock file: {e}"))?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(
            "--repository-cache-dir is in use by another visiongate serving the same \
             repository; give each server its own directory"
                .into(),
        );
    }
    Ok(file)
}

/// The kind of the HTTP failure under a store's error, if one is.
fn http_kind(e: &object_store::Error) -> Option<object_store::client::HttpErrorKind> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<object_store::client::HttpError>() {
            return Some(h.kind());
        }
        source = s.source();
    }
    None
}

fn between<'a>(text: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let from = text.find(start)? + start.len();
    let len = text[from..].find(end)?;
    Some(&text[from..from + len]).filter(|c| c.len() <= 64 && !c.contains('<'))
}

/// The status a store's error reports (`... status code: 503 Service Unavailable ...`).
fn status(text: &str) -> Option<String> {
    let from = text.find("status code: ")? + "status code: ".len();
    let rest = &text[from..];
    let end = rest.find([':', ',', '\n']).unwrap_or(rest.len());
    Some(rest[..end].trim().to_string()).filter(|s| s.len() <= 40)
}

/// `, after N retries` as the store's error says it.
fn retries(text: &str) -> String {
    let Some(at) = text.find("after ") else {
        return String::new();
    };
    let rest = &text[at..];
    match rest.find(" retries") {
        Some(end) if end < 20 => format!(" ({})", &rest[..end + " retries".len()]),
        _ => String::new(),
    }
}
