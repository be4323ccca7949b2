//! One remote repository mirrored into a local directory, a model at a time: each sync
//! lists the objects under the repository's prefix, and for every model whose objects
//! changed (by ETag and size) builds the model's new directory beside the mirror (the
//! unchanged files linked from the old one, the changed ones downloaded) and exchanges it
//! for the old one in one rename; a model whose download fails keeps its previous
//! directory. Models gone from the listing are removed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use futures_util::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

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
    /// The ETag without quotes or the weak mark (stores quote it in some answers and not
    /// in others), or the modification time where the store gives none.
    tag: String,
}

impl Stamp {
    fn of(meta: &ObjectMeta) -> Stamp {
        let tag = match &meta.e_tag {
            Some(tag) => plain_tag(tag),
            None => meta.last_modified.timestamp_millis().to_string(),
        };
        Stamp {
            size: meta.size,
            tag,
        }
    }
}

/// A model's objects, by their path inside the model's directory.
type ModelObjects = BTreeMap<String, Stamp>;

/// A listed object: its stamp, ETag and location in the store as listed.
struct Listed {
    stamp: Stamp,
    e_tag: Option<String>,
    location: ObjectPath,
}

/// An ETag without quotes or the weak mark (stores quote it in some answers and not in
/// others).
fn plain_tag(tag: &str) -> String {
    tag.trim_start_matches("W/").trim_matches('"').to_string()
}

pub struct Mirror {
    pub url: RemoteUrl,
    client: Client,
    prefix: Option<ObjectPath>,
    /// The mirror: one directory per model, as a local repository.
    pub root: PathBuf,
    /// Models' new directories while they are built, exchanged into `root` once whole.
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
    /// The objects left out.
    pub skipped: Skips,
}

/// An object left out of a sync: its key cannot name a file of a model. With the model it
/// is under (`None`: none that could be told).
pub type Skipped = (Option<String>, String);

/// The objects a listing left out: how many, and the first few by name.
#[derive(Debug, Default)]
pub struct Skips {
    pub named: Vec<Skipped>,
    pub count: usize,
}

impl Skips {
    fn add(&mut self, skipped: Skipped) {
        self.count += 1;
        if self.named.len() < super::http::NAMED {
            self.named.push(skipped);
        }
    }
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
        let dir = &settings.cache_dir();
        private_dir(dir, settings.cache_dir.is_none())?;
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
            private_dir(d, true)?;
        }
        let prefix = match url.prefix.as_str() {
            "" => None,
            p => Some(ObjectPath::parse(p).map_err(|e| format!("{url}: the path: {e}"))?),
        };
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
    /// `cache_left` is what the cache may hold for this repository: models already held
    /// and unchanged count first, then the others in name order.
    pub async fn sync(
        &self,
        settings: &RemoteSettings,
        cache_left: u64,
    ) -> Result<Synced, RemoteError> {
        let (listed, skipped) = self.list(settings.timeout).await?;
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
        let stamps = |objects: &BTreeMap<String, Listed>| -> ModelObjects {
            objects
                .iter()
                .map(|(n, l)| (n.clone(), l.stamp.clone()))
                .collect()
        };
        let unchanged = |model: &String, objects: &BTreeMap<String, Listed>| {
            held.get(model) == Some(&stamps(objects))
        };
        let mut bytes_held: u64 = listed
            .iter()
            .filter(|(m, o)| unchanged(m, o))
            .map(|(m, _)| held_size(&held, m))
            .sum();
        let mut failures = Vec::new();
        let mut bytes_downloaded = 0u64;
        for (model, objects) in listed.iter().filter(|(m, o)| !unchanged(m, o)) {
            let size: u64 = objects.values().map(|l| l.stamp.size).sum();
            let old = held_size(&held, model);
            if let Some((name, l)) = objects
                .iter()
                .find(|(_, l)| l.stamp.size > settings.max_object_bytes)
            {
                let message = format!(
                    "object '{model}/{name}' is {} bytes, over --repository-max-object-bytes {}",
                    l.stamp.size, settings.max_object_bytes
                );
                failures.push((model.clone(), self.error(Reason::TooLarge, message)));
                bytes_held += old;
                continue;
            }
            if bytes_held + size > cache_left {
                let message = format!(
                    "model '{model}' ({size} bytes) does not fit in the repository cache: \
                     {bytes_held} bytes of other models held, --repository-cache-max-bytes {}",
                    settings.max_cache_bytes
                );
                failures.push((model.clone(), self.error(Reason::CacheFull, message)));
                bytes_held += old;
                continue;
            }
            match self.update(model, objects, held.get(model), settings).await {
                Ok(downloaded) => {
                    bytes_downloaded += downloaded;
                    bytes_held += size;
                    self.held
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(model.clone(), stamps(objects));
                }
                Err(e) => {
                    bytes_held += old;
                    failures.push((model.clone(), e));
                }
            }
        }
        // Models no longer listed.
        for model in held.keys().filter(|m| !listed.contains_key(*m)) {
            remove(&self.root.join(model));
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
            skipped,
        })
    }

    /// Every object under the prefix, by model and path inside it, listed within
    /// `timeout` in all (every page), and the keys left out because they cannot name a
    /// file of a model (by model, where one can be told). Objects at the top of the
    /// repository (no model directory) are left out, as Triton does, and so are the empty
    /// objects that consoles and sync tools create as folders (`model/1/`).
    async fn list(
        &self,
        timeout: Duration,
    ) -> Result<(BTreeMap<String, BTreeMap<String, Listed>>, Skips), RemoteError> {
        let mut skipped = Skips::default();
        let mut models: BTreeMap<String, BTreeMap<String, Listed>> = BTreeMap::new();
        self.client.listing.restart();
        let mut stream = self.client.store.list(self.prefix.as_ref());
        let skip = self.prefix.as_ref().map_or(0, |p| p.parts().count());
        let mut count = 0usize;
        let deadline = Instant::now() + timeout;
        while let Some(item) = self.within(deadline, "listing", stream.next()).await? {
            let meta = item.map_err(|e| match self.client.listing.refused() {
                Some(why) => self.error(Reason::TooLarge, format!("listing: {why}")),
                None => self.store_error("listing", e),
            })?;
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
            let inside = &parts[skip.min(parts.len())..];
            if inside.len() < 2 {
                continue;
            }
            if inside.len() > MAX_DEPTH + 1 || inside.iter().any(|p| !safe_segment(p)) {
                skipped.add((
                    safe_segment(&inside[0]).then(|| inside[0].clone()),
                    meta.location.to_string(),
                ));
                continue;
            }
            models.entry(inside[0].clone()).or_default().insert(
                inside[1..].join("/"),
                Listed {
                    stamp: Stamp::of(&meta),
                    e_tag: meta.e_tag.as_deref().map(plain_tag),
                    location: meta.location,
                },
            );
        }
        // Keys the HTTP client left out of the pages (object_store cannot take them).
        let prefix = self
            .prefix
            .as_ref()
            .map(|p| format!("{p}/"))
            .unwrap_or_default();
        let (keys, left_out) = self.client.listing.skipped();
        // The ones the client counted but did not keep by name.
        let unnamed = left_out - keys.len();
        for key in keys {
            let model = key
                .strip_prefix(&prefix)
                .and_then(|k| k.split('/').next())
                .filter(|m| safe_segment(m))
                .map(str::to_string);
            skipped.add((model, key));
        }
        skipped.count += unnamed;
        for objects in models.values_mut() {
            let folders: Vec<String> = objects
                .iter()
                .filter(|(name, l)| {
                    l.stamp.size == 0
                        && objects
                            .range(format!("{name}/")..)
                            .next()
                            .is_some_and(|(n, _)| n.starts_with(&format!("{name}/")))
                })
                .map(|(name, _)| name.clone())
                .collect();
            for name in folders {
                objects.remove(&name);
            }
        }
        Ok((models, skipped))
    }

    /// Builds `model`'s new directory in the incoming area (files unchanged since `held`
    /// linked from the mirror, the others downloaded), then exchanges it for the mirror's
    /// in one rename. On failure the mirror is as it was. Returns the bytes downloaded.
    async fn update(
        &self,
        model: &str,
        listed: &BTreeMap<String, Listed>,
        held: Option<&ModelObjects>,
        settings: &RemoteSettings,
    ) -> Result<u64, RemoteError> {
        let staging = self.incoming.join(model);
        remove(&staging);
        let built = self.build(model, listed, held, &staging, settings).await;
        let outcome = built.and_then(|downloaded| {
            exchange(&staging, &self.root.join(model))
                .map(|()| downloaded)
                .map_err(|e| self.cache_error(&format!("model '{model}'"), e))
        });
        // The old directory (or file) after an exchange, or what a failed build left.
        remove(&staging);
        outcome
    }

    async fn build(
        &self,
        model: &str,
        listed: &BTreeMap<String, Listed>,
        held: Option<&ModelObjects>,
        staging: &Path,
        settings: &RemoteSettings,
    ) -> Result<u64, RemoteError> {
        let what = format!("model '{model}'");
        let io = |e| self.cache_error(&what, e);
        let mut downloaded = 0u64;
        for (name, l) in listed {
            let target = staging.join(name);
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent).map_err(io)?;
            }
            let current = self.root.join(model).join(name);
            if held.and_then(|h| h.get(name)) == Some(&l.stamp)
                && std::fs::hard_link(&current, &target).is_ok()
            {
                continue;
            }
            let what = format!("object '{model}/{name}'");
            self.fetch(&what, l, &target, settings).await?;
            downloaded += l.stamp.size;
        }
        Ok(downloaded)
    }

    /// One object streamed to `target`: at most `--repository-max-object-bytes`, the size
    /// and ETag it was listed with (else it changed since: the next sync takes it), all of
    /// it within the timeout (a store that trickles fails the object).
    async fn fetch(
        &self,
        what: &str,
        listed: &Listed,
        target: &Path,
        settings: &RemoteSettings,
    ) -> Result<(), RemoteError> {
        let deadline = Instant::now() + settings.timeout;
        let result = self
            .within(deadline, what, self.client.store.get(&listed.location))
            .await?
            .map_err(|e| self.store_error(what, e))?;
        let size = result.meta.size;
        let limit = settings.max_object_bytes;
        if size > limit {
            return Err(self.error(
                Reason::TooLarge,
                format!("{what} is {size} bytes, over --repository-max-object-bytes {limit}"),
            ));
        }
        // The size always; the ETag where both answers carry one (a store may leave it,
        // or the modification time's precision, out of one of them).
        let e_tag = result.meta.e_tag.as_deref().map(plain_tag);
        let changed = size != listed.stamp.size
            || matches!((&e_tag, &listed.e_tag), (Some(a), Some(b)) if a != b);
        if changed {
            return Err(self.error(
                Reason::Other,
                format!("{what} changed while the repository was read; the next sync takes it"),
            ));
        }
        let io = |e| self.cache_error(what, e);
        let mut file = tokio::fs::File::create(target).await.map_err(io)?;
        let mut written = 0u64;
        let mut stream = result.into_stream();
        while let Some(chunk) = self.within(deadline, what, stream.next()).await? {
            let chunk = chunk.map_err(|e| self.store_error(what, e))?;
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
        file.sync_all().await.map_err(io)
    }

    /// `step`, unless it is not done by `deadline` (the whole request's).
    async fn within<T>(
        &self,
        deadline: Instant,
        what: &str,
        step: impl std::future::Future<Output = T>,
    ) -> Result<T, RemoteError> {
        tokio::time::timeout_at(deadline, step).await.map_err(|_| {
            self.error(
                Reason::Timeout,
                format!("{what}: not done within --repository-timeout-secs"),
            )
        })
    }

    /// The cache directory refused a write for `what` (a model or an object).
    fn cache_error(&self, what: &str, e: std::io::Error) -> RemoteError {
        self.error(Reason::Io, format!("{what}: cannot write the cache: {e}"))
    }

    fn error(&self, reason: Reason, message: String) -> RemoteError {
        RemoteError {
            reason,
            message: self.client.redact(&format!("{}: {message}", self.url)),
        }
    }

    /// A store's error as a reason and one plain sentence (`store_failure`); the store's
    /// own text, when nothing else says what happened, to the debug log only.
    fn store_error(&self, what: &str, e: object_store::Error) -> RemoteError {
        let (reason, message, unexplained) = store_failure(what, &e, &self.client.credentials);
        if let Some(text) = unexplained {
            tracing::debug!(repository = %self.url, "{what}: {}", self.client.redact(&text));
        }
        self.error(reason, message)
    }
}

/// A store's error for `what` (a listing, an object) as a reason and one plain sentence:
/// what was asked, the HTTP status and the store's error code where it answered, the
/// credentials' source (`credentials`) where it refused them. The store's own message
/// (request URLs, response bodies) is left out; when nothing else says what happened, it
/// comes back third, without query strings (a signed URL's), for the debug log. The
/// error's kind is object_store's (its variants, and the HTTP client's error kind in its
/// sources); the status and error code of an answer object_store keeps as a generic error
/// (a listing's refusal, a 5xx) are read from its text, since the error that holds them
/// is private to object_store.
fn store_failure(
    what: &str,
    e: &object_store::Error,
    credentials: &str,
) -> (Reason, String, Option<String>) {
    use object_store::client::HttpErrorKind;
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
    let failure = |reason, message| (reason, message, None);
    match e {
        _ if refused => failure(
            Reason::Credentials,
            format!(
                "{what}: the store refused the credentials ({}{}); they came from {credentials}",
                status.as_deref().unwrap_or(""),
                code.replace(" (", ", ").replace(')', ""),
            ),
        ),
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => failure(
            Reason::Credentials,
            format!(
                "{what}: the store refused the credentials{code}; they came from {credentials}"
            ),
        ),
        E::NotFound { .. } => failure(
            Reason::NotFound,
            format!("{what}: not found{code}; check the bucket (or container) and path"),
        ),
        _ => match http_kind(e) {
            Some(HttpErrorKind::Connect) => failure(
                Reason::Unreachable,
                format!("{what}: cannot connect to the store{}", retries(&text)),
            ),
            Some(HttpErrorKind::Timeout) => failure(
                Reason::Timeout,
                format!(
                    "{what}: the store did not answer within --repository-timeout-secs{}",
                    retries(&text)
                ),
            ),
            Some(_) => failure(
                Reason::Unreachable,
                format!(
                    "{what}: the connection to the store failed{}",
                    retries(&text)
                ),
            ),
            None => match status {
                Some(status) => failure(
                    Reason::Other,
                    format!("{what}: the store answered {status}{code}"),
                ),
                None => {
                    let plain: Vec<&str> = text
                        .split_whitespace()
                        .map(|w| w.split('?').next().unwrap_or(""))
                        .collect();
                    (
                        Reason::Other,
                        format!("{what}: the request to the store failed"),
                        Some(plain.join(" ")),
                    )
                }
            },
        },
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

/// Puts the directory `new` at `live`: exchanged with the one there in one rename (the old
/// one is left at `new`), or renamed there when there is none.
fn exchange(new: &Path, live: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    if !live.exists() {
        return std::fs::rename(new, live);
    }
    let c =
        |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (from, to) = (c(new)?, c(live)?);
    // SAFETY: two NUL-terminated paths that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let error = std::io::Error::last_os_error();
    match error.raw_os_error() {
        // A file system (or a seccomp policy) without the exchange: two renames. No load
        // reads the mirror meanwhile (the sync holds the gate).
        Some(libc::EINVAL | libc::ENOSYS | libc::EPERM) => {
            let name = new.file_name().unwrap_or_default().to_string_lossy();
            let aside = new.with_file_name(format!(".aside-{name}"));
            remove(&aside);
            std::fs::rename(live, &aside)?;
            std::fs::rename(new, live)?;
            std::fs::rename(&aside, new)
        }
        _ => Err(error),
    }
}

/// Removes `path`, a directory tree or a file, if it is there.
fn remove(path: &Path) {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => {
            let _ = std::fs::remove_dir_all(path);
        }
        Ok(_) => {
            let _ = std::fs::remove_file(path);
        }
        Err(_) => {}
    }
}

/// `dir`, created private to this user where missing. With `own` (the default cache, in
/// the shared temporary directory, and the directories the server makes in a cache), the
/// directory itself is checked, not what a link there points at: a symbolic link, or a
/// directory another user owns, is refused (another user may have planted it), and one of
/// this user's that others may write to is made private.
fn private_dir(dir: &Path, own: bool) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("--repository-cache-dir: cannot create it: {e}"))?;
    if !own {
        return Ok(());
    }
    let refuse = |why: &str| {
        format!(
            "--repository-cache-dir {}: {why}; give a directory of this user's (the flag)",
            dir.display()
        )
    };
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| format!("--repository-cache-dir: cannot read it: {e}"))?;
    if meta.file_type().is_symlink() {
        return Err(refuse("a symbolic link, not a directory"));
    }
    // SAFETY: geteuid has no preconditions.
    if meta.uid() != unsafe { libc::geteuid() } {
        return Err(refuse("owned by another user"));
    }
    if !meta.is_dir() {
        return Err(refuse("not a directory"));
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| {
            refuse(&format!(
                "others may write to it and it cannot be made private: {e}"
            ))
        })?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    use futures_util::TryStreamExt;
    use object_store::aws::{AmazonS3, AmazonS3Builder};
    use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};
    use std::io::{Read, Write};
    use std::time::Duration;

    /// An S3 stand-in on loopback answering every request with `answer` (a whole HTTP/1.1
    /// response), or, with `None`, reading the request and never answering.
    fn canned(answer: Option<String>) -> u16 {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let (Ok(mut stream), answer) = (stream, answer.clone()) else {
                    return;
                };
                std::thread::spawn(move || {
                    let (mut buf, mut head) = ([0; 4096], Vec::new());
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    match answer {
                        Some(answer) => drop(stream.write_all(answer.as_bytes())),
                        None => std::thread::sleep(Duration::from_secs(5)),
                    }
                });
            }
        });
        port
    }

    /// An S3 answer with its error code, as S3 and the stores that imitate it send one.
    fn s3_error(status: &str, code: &str) -> Option<String> {
        let body = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
             <Message>refused</Message><RequestId>1</RequestId></Error>"
        );
        Some(format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/xml\r\ncontent-length: {}\r\n\
             connection: close\r\n\r\n{body}",
            body.len()
        ))
    }

    /// A client of the bucket `models` at `port`, retrying once, waiting 300 ms an answer.
    fn store(port: u16) -> AmazonS3 {
        AmazonS3Builder::new()
            .with_bucket_name("models")
            .with_region("us-east-1")
            .with_endpoint(format!("http://127.0.0.1:{port}"))
            .with_virtual_hosted_style_request(false)
            .with_access_key_id("key")
            .with_secret_access_key("secret")
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(10),
                    max_backoff: Duration::from_millis(40),
                    base: 2.0,
                },
                max_retries: 1,
                retry_timeout: Duration::from_secs(5),
            })
            .with_client_options(
                ClientOptions::new()
                    .with_allow_http(true)
                    .with_timeout(Duration::from_millis(300)),
            )
            .build()
            .unwrap()
    }

    async fn get(port: u16) -> (Reason, String, Option<String>) {
        let path = object_store::path::Path::from("classifier/config.pbtxt");
        let e = store(port).get(&path).await.err().unwrap();
        store_failure("classifier/config.pbtxt", &e, "AWS_ACCESS_KEY_ID")
    }

    async fn list(port: u16) -> (Reason, String, Option<String>) {
        let listing = store(port).list(None).try_collect::<Vec<_>>().await;
        store_failure("listing", &listing.err().unwrap(), "AWS_ACCESS_KEY_ID")
    }

    #[tokio::test]
    async fn store_answers_are_classified_by_their_kind_status_and_code() {
        let (reason, message, _) = get(canned(s3_error("404 Not Found", "NoSuchKey"))).await;
        assert_eq!(reason, Reason::NotFound);
        assert_eq!(
            message,
            "classifier/config.pbtxt: not found (NoSuchKey); check the bucket (or container) \
             and path"
        );
        let (reason, message, _) = get(canned(s3_error("403 Forbidden", "AccessDenied"))).await;
        assert_eq!(reason, Reason::Credentials);
        assert_eq!(
            message,
            "classifier/config.pbtxt: the store refused the credentials (403 Forbidden, \
             AccessDenied); they came from AWS_ACCESS_KEY_ID"
        );
        // A listing's refusal is a generic error of object_store's: its status says it.
        let (reason, message, _) = list(canned(s3_error("403 Forbidden", "AccessDenied"))).await;
        assert_eq!(reason, Reason::Credentials);
        assert_eq!(
            message,
            "listing: the store refused the credentials (403 Forbidden, AccessDenied); they \
             came from AWS_ACCESS_KEY_ID"
        );
        let (reason, message, _) =
            get(canned(s3_error("503 Service Unavailable", "SlowDown"))).await;
        assert_eq!(reason, Reason::Other);
        assert_eq!(
            message,
            "classifier/config.pbtxt: the store answered 503 Service Unavailable (SlowDown)"
        );
        // Nothing listens there any more.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let (reason, message, _) = get(port).await;
        assert_eq!(reason, Reason::Unreachable);
        assert_eq!(
            message,
            "classifier/config.pbtxt: cannot connect to the store (after 1 retries)"
        );
        let (reason, message, _) = list(canned(None)).await;
        assert_eq!(reason, Reason::Timeout);
        assert_eq!(
            message,
            "listing: the store did not answer within --repository-timeout-secs (after 1 \
             retries)"
        );
    }

    #[test]
    fn the_default_cache_directory_is_checked_itself_not_what_a_link_points_at() {
        let tmp = std::env::temp_dir().join(format!("vg-private-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        // A link planted where the cache would be, to a directory this user owns (the
        // ownership check of the target passes): refused, and the target left alone.
        let target = tmp.join("elsewhere");
        std::fs::create_dir(&target).unwrap();
        let planted = tmp.join("cache");
        std::os::unix::fs::symlink(&target, &planted).unwrap();
        let err = private_dir(&planted, true).unwrap_err();
        assert!(err.contains("symbolic link"), "{err}");
        // A flag's own choice may be a link (the operator's).
        private_dir(&planted, false).unwrap();
        // A file is refused; a directory others may write to is made private.
        std::fs::write(tmp.join("file"), b"x").unwrap();
        assert!(private_dir(&tmp.join("file"), true).is_err());
        let open = tmp.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        private_dir(&open, true).unwrap();
        let mode = std::fs::metadata(&open).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
