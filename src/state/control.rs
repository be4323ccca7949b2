//! Repository control, as Triton's `--model-control-mode`:
//! - `none`: every model loads at start-up and stays;
//! - `poll`: every model loads at start-up, and the repository is re-read every
//!   `--repository-poll-secs`: changed models reload, new ones load, removed ones unload;
//! - `explicit`: only `--load-model` models load at start-up; the load and unload
//!   endpoints do the rest.
//!
//! A (re)load starts the new versions next to the serving ones and swaps them in only once
//! they are warmed up; if they fail, the previous versions keep serving. Unloaded and
//! replaced versions finish the requests they admitted before they stop.
use std::sync::Arc;
use std::time::Duration;

use super::build::{link_ensembles, Started};
use super::restrict::{Endpoint, Restrictions};
use super::{ModelTable, Registry};
use crate::domain::ModelName;
use crate::error::{ErrorKind, GatewayError, HasKind};
use crate::repository::{self, ModelKind, RepositoryModel, ScanResult};
use crate::scheduler::{ModelHandle, ModelState};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ControlMode {
    None,
    Poll,
    Explicit,
}

#[derive(Debug, Clone)]
pub struct ControlSettings {
    pub mode: ControlMode,
    /// The model repositories (Triton's repeatable `--model-repository`).
    pub repositories: Vec<repository::Location>,
    /// The cache and limits of remote repositories.
    pub remote: repository::RemoteSettings,
    pub poll_interval: Duration,
    /// Models loaded at start-up in explicit mode (`*`: all).
    pub startup_models: Vec<String>,
    /// What a model's config may ask for.
    pub limits: repository::Limits,
    /// `--model-config-name`: models read `configs/<name>.pbtxt` where they have it.
    pub config_name: Option<String>,
}

/// A load or unload request parameter, as both transports carry them.
pub enum ControlParam {
    Bool(bool),
    Int(i64),
    Text(String),
    Other,
}

/// The `config` of a load request's parameters (Triton's `config`: a JSON `ModelConfig`
/// used instead of `config.pbtxt`). Override files (`file:<path>`) and unknown parameters
/// are refused with what to do instead.
pub fn load_parameters(
    params: impl IntoIterator<Item = (String, ControlParam)>,
) -> Result<Option<String>, GatewayError> {
    let mut config = None;
    for (name, value) in params {
        match (name.as_str(), value) {
            ("config", ControlParam::Text(json)) => config = Some(json),
            ("config", _) => {
                return Err(GatewayError::invalid(
                    "load parameter 'config' must be a string holding the model config as JSON",
                ))
            }
            (n, _) if n.starts_with("file:") => {
                return Err(GatewayError::invalid(format!(
                    "load parameter '{n}': override files are not supported; put the files in \
                     the model's directory of the repository, then load it"
                )))
            }
            (n, _) => {
                return Err(GatewayError::invalid(format!(
                    "load parameter '{n}' is not supported (known: 'config')"
                )))
            }
        }
    }
    Ok(config)
}

/// `unload_dependents` of an unload request's parameters (false when absent).
pub fn unload_parameters(
    params: impl IntoIterator<Item = (String, ControlParam)>,
) -> Result<bool, GatewayError> {
    let mut dependents = false;
    for (name, value) in params {
        match (name.as_str(), value) {
            ("unload_dependents", ControlParam::Bool(b)) => dependents = b,
            ("unload_dependents", _) => {
                return Err(GatewayError::invalid(
                    "unload parameter 'unload_dependents' must be a boolean",
                ))
            }
            (n, _) => {
                return Err(GatewayError::invalid(format!(
                    "unload parameter '{n}' is not supported (known: 'unload_dependents')"
                )))
            }
        }
    }
    Ok(dependents)
}

impl Registry {
    /// The table at start-up: what the control mode loads, started (still warming up).
    pub(super) fn initial_table(&self, scan: &ScanResult) -> ModelTable {
        let mut table = ModelTable::default();
        for f in &scan.failures {
            tracing::error!(model = f.model, "model not loaded: {}", f.error);
            table.entry_mut(&ModelName::new(&f.model)).unavailable = Some(f.error.to_string());
        }
        let wanted: Vec<String> = match self.control.mode {
            ControlMode::None | ControlMode::Poll => {
                scan.models.iter().map(|m| m.name.to_string()).collect()
            }
            ControlMode::Explicit if self.control.startup_models.iter().any(|m| m == "*") => {
                scan.models.iter().map(|m| m.name.to_string()).collect()
            }
            ControlMode::Explicit => self.control.startup_models.clone(),
        };
        let mut models = Vec::new();
        for name in wanted {
            match with_steps(scan, &name) {
                Ok(found) => models.extend(found),
                Err(e) => {
                    tracing::error!(model = name, "{e}");
                    table.entry_mut(&ModelName::new(name)).unavailable = Some(e);
                }
            }
        }
        models.sort_by(|a, b| (&a.name, a.version).cmp(&(&b.name, b.version)));
        models.dedup_by(|a, b| a.name == b.name && a.version == b.version);
        let models: Vec<Arc<RepositoryModel>> = models.into_iter().map(Arc::new).collect();
        // A model refused there is listed unavailable.
        self.start_models(&models, &mut table);
        self.record_fingerprints(&models, &mut table);
        table
    }

    fn record_fingerprints(&self, models: &[Arc<RepositoryModel>], table: &mut ModelTable) {
        for m in models {
            table.entry_mut(&m.name).fingerprint = Some(m.fingerprint);
        }
    }

    /// Load and unload are open only in explicit mode and where a key restricts them (the
    /// key itself is checked where the request entered, by its route's category).
    pub fn authorize_control(&self, restrictions: &Restrictions) -> Result<(), GatewayError> {
        if !restrictions.is_restricted(Endpoint::RepositoryControl) {
            return Err(GatewayError::new(
                ErrorKind::Forbidden,
                "model load and unload are disabled: start visiongate with \
                 --http-restricted-api / --grpc-restricted-protocol \
                 model-repository:<header>=<key> (or --repository-control-key \
                 <header>=<key>) and send that header",
            ));
        }
        if self.control.mode != ControlMode::Explicit {
            return Err(GatewayError::invalid(format!(
                "explicit model load and unload need --model-control-mode explicit (this \
                 server runs in mode '{}')",
                mode_name(self.control.mode)
            )));
        }
        Ok(())
    }

    /// Loads `name` (every version its policy selects; an ensemble with its steps), or
    /// reloads it. `config` (JSON, Triton's `config` load parameter) replaces its
    /// `config.pbtxt` for this load. Returns once the new versions serve; on failure the
    /// old ones still do.
    pub async fn load_model(&self, name: &str, config: Option<String>) -> Result<(), GatewayError> {
        ModelName::check(name).map_err(GatewayError::invalid)?;
        let limits = self.control.limits;
        // The mirrors stay as scanned until this load is done.
        let mut scan = self
            .repositories
            .scan(&limits)
            .await
            .map_err(|e| GatewayError::new(e.kind(), e.to_string()))?;
        // A model a remote repository could not download fails its load with why.
        if let Some(f) = scan
            .failures
            .iter()
            .find(|f| f.model == name && matches!(f.error, repository::RepositoryError::Remote(_)))
        {
            return Err(GatewayError::new(
                f.error.kind(),
                format!("failed to load '{name}': {}", f.error),
            ));
        }
        // Its directory only for a load that replaces its config.
        let dir = config
            .as_ref()
            .and_then(|_| self.repositories.model_dir(name));
        let model = name.to_string();
        let scan = tokio::task::spawn_blocking(move || {
            if let Some(json) = config {
                let Some(dir) = dir else {
                    return Err(GatewayError::invalid(format!(
                        "no model directory '{model}' in the repository (or in more than one)"
                    )));
                };
                let versions = repository::parse_model_config_json(&model, &json)
                    .and_then(|c| repository::load_model_with(&dir, &model, c, &limits))
                    .map_err(|e| GatewayError::invalid(e.to_string()))?;
                scan.models.retain(|m| m.name.as_str() != model);
                scan.failures.retain(|f| f.model != model);
                scan.models.extend(versions);
            }
            Ok(scan)
        })
        .await
        .map_err(|e| GatewayError::new(ErrorKind::Internal, e.to_string()))??;
        let loaded = self.load_scanned(&scan, name).await;
        let in_repository = scan.models.iter().any(|m| m.name.as_str() == name)
            || scan.failures.iter().any(|f| f.model == name);
        if let (Err(e), true) = (&loaded, in_repository) {
            // As Triton: the index says why a model of the repository is not served.
            let _guard = self.control_lock.lock().await;
            let mut table = (*self.models()).clone();
            if table.versions(name).is_none() && record_failure(&mut table, name, &e.to_string()) {
                self.replace_table(table);
            }
        }
        loaded
    }

    /// Loads `name` as `scan` found it (see `load_model`).
    async fn load_scanned(&self, scan: &ScanResult, name: &str) -> Result<(), GatewayError> {
        let _guard = self.control_lock.lock().await;
        let current = self.models();
        let mut found = with_steps(scan, name).map_err(GatewayError::invalid)?;
        // Steps already serving stay as they are (failed ones load again); the named
        // model itself reloads.
        found.retain(|m| {
            m.name.as_str() == name
                || current
                    .get(m.name.as_str(), None)
                    .is_none_or(|s| s.failure().is_some())
        });
        found.sort_by(|a, b| (&a.name, a.version).cmp(&(&b.name, b.version)));
        found.dedup_by(|a, b| a.name == b.name && a.version == b.version);
        let models: Vec<Arc<RepositoryModel>> = found.into_iter().map(Arc::new).collect();
        self.swap_in(&models, &current).await
    }

    /// Starts `models` beside the serving table, waits for them, then swaps them in and
    /// retires what they replace.
    async fn swap_in(
        &self,
        models: &[Arc<RepositoryModel>],
        current: &ModelTable,
    ) -> Result<(), GatewayError> {
        let mut table = current.clone();
        // Stopped again unless swapped in, also when this future is dropped (a client
        // that left, a deadline): no started model is left running outside the table.
        let Started { handles, refused } = self.start_models(models, &mut table);
        let mut started = Starting {
            registry: self,
            handles,
        };
        // A refused model fails the load at once; the others started stop again.
        let mut failures = refused;
        if failures.is_empty() {
            for handle in &started.handles {
                if let ModelState::Failed(why) = handle.wait_loaded().await {
                    failures.push(format!("'{}': {why}", handle.name()));
                }
            }
        }
        if !failures.is_empty() {
            return Err(GatewayError::invalid(format!(
                "failed to load {}; the previous versions keep serving",
                failures.join("; ")
            )));
        }
        started.handles.clear();
        self.record_fingerprints(models, &mut table);
        let replaced = replaced_handles(current, &table);
        self.replace_table(table);
        for m in models {
            tracing::info!(model = %m.name, version = %m.version, "model loaded");
        }
        self.retire(replaced);
        Ok(())
    }

    /// Unloads every version of `name`; ensembles built on it become unavailable. With
    /// `dependents` (Triton's `unload_dependents`), an ensemble's steps are unloaded too,
    /// unless another loaded ensemble uses them.
    pub async fn unload_model(&self, name: &str, dependents: bool) -> Result<(), GatewayError> {
        ModelName::check(name).map_err(GatewayError::invalid)?;
        let _guard = self.control_lock.lock().await;
        let current = self.models();
        let key = ModelName::new(name);
        let loaded = current
            .entry(name)
            .is_some_and(|e| !e.served.is_empty() || !e.ensemble.is_empty());
        if !loaded {
            // Triton: unloading a model that is not loaded has no effect and succeeds.
            tracing::info!(model = name, "unload: the model is not loaded");
            return Ok(());
        }
        let mut table = (*current).clone();
        let steps = if dependents {
            steps_of(&table, &key)
        } else {
            Vec::new()
        };
        unload_from(&mut table, &key);
        for step in steps {
            let used = table
                .entries()
                .flat_map(|(_, e)| &e.ensemble)
                .any(|m| steps_of_model(m).contains(&step));
            if !used {
                unload_from(&mut table, &step);
            }
        }
        let replaced = replaced_handles(&current, &table);
        self.replace_table(table);
        tracing::info!(model = name, "model unloaded");
        self.retire(replaced);
        Ok(())
    }

    /// One poll: reloads the models whose files changed, loads new ones, unloads the
    /// ones gone from the repository. Errors are logged; serving models keep serving. A
    /// stop while a remote repository downloads ends the poll there; its loads, once
    /// begun, finish.
    pub async fn poll_repository(&self, stop: &tokio_util::sync::CancellationToken) {
        let scanned = tokio::select! {
            scanned = self.repositories.scan(&self.control.limits) => scanned,
            () = stop.cancelled() => return,
        };
        // The mirrors stay as scanned until this poll's loads are done.
        let scan = match scanned {
            Ok(scanned) => scanned,
            Err(e) => {
                return tracing::error!("repository poll failed, serving what is loaded: {e}")
            }
        };
        let mut prints: Vec<(ModelName, u64)> = scan
            .models
            .iter()
            .map(|m| (m.name.clone(), m.fingerprint))
            .collect();
        prints.dedup();
        let in_repository = |name: &str| {
            scan.models.iter().any(|m| m.name.as_str() == name)
                || scan.failures.iter().any(|f| f.model == name)
        };
        for (name, print) in &prints {
            // Loading an ensemble loads its new steps: skip what an earlier load of this
            // poll already brought up to date.
            if self
                .models()
                .entry(name.as_str())
                .and_then(|e| e.fingerprint)
                == Some(*print)
            {
                continue;
            }
            if let Err(e) = self.load_scanned(&scan, name.as_str()).await {
                tracing::error!(model = %name, "reload failed: {e}");
                // Do not retry the same files every poll.
                let mut table = (*self.models()).clone();
                table.entry_mut(name).fingerprint = Some(*print);
                record_failure(&mut table, name.as_str(), &e.to_string());
                self.replace_table(table);
            }
        }
        for f in &scan.failures {
            let mut table = (*self.models()).clone();
            if record_failure(&mut table, &f.model, &f.error.to_string()) {
                tracing::error!(model = f.model, "cannot load: {}", f.error);
                self.replace_table(table);
            }
        }
        // Directories removed: unload what they served, forget the rest.
        let current = self.models();
        for name in current
            .entries()
            .filter(|(n, e)| e.fingerprint.is_some() && !in_repository(n.as_str()))
            .map(|(n, _)| n)
        {
            if let Err(e) = self.unload_model(name.as_str(), false).await {
                tracing::error!(model = %name, "unload failed: {e}");
            }
        }
        let mut table = (*self.models()).clone();
        let mut forgot = false;
        for (name, entry) in table.entries_mut() {
            if !in_repository(name.as_str()) {
                forgot |= entry.fingerprint.take().is_some() | entry.unavailable.take().is_some();
            }
        }
        if forgot {
            self.replace_table(table);
        }
    }

    /// Runs `poll_repository` every poll interval until `stop` is cancelled.
    pub async fn poll_loop(&self, stop: tokio_util::sync::CancellationToken) {
        let mut tick = tokio::time::interval(self.control.poll_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = tick.tick() => self.poll_repository(&stop).await,
                () = stop.cancelled() => return,
            }
        }
    }
}

pub fn mode_name(mode: ControlMode) -> &'static str {
    match mode {
        ControlMode::None => "none",
        ControlMode::Poll => "poll",
        ControlMode::Explicit => "explicit",
    }
}

/// Lists why `name` could not (re)load (a model still served says so in the reason);
/// returns whether that is news.
fn record_failure(table: &mut ModelTable, name: &str, why: &str) -> bool {
    let why = if table.versions(name).is_some() {
        format!("{why} (the loaded versions keep serving)")
    } else {
        why.to_string()
    };
    table
        .entry_mut(&ModelName::new(name))
        .unavailable
        .replace(why.clone())
        != Some(why)
}

/// Removes `name` and relinks the ensembles (one built on it becomes unavailable).
fn unload_from(table: &mut ModelTable, name: &ModelName) {
    *table.entry_mut(name) = super::ModelEntry {
        unavailable: Some("unloaded".to_string()),
        ..Default::default()
    };
    link_ensembles(table);
}

/// The steps of every loaded version of the ensemble `name` (none for other models).
fn steps_of(table: &ModelTable, name: &ModelName) -> Vec<ModelName> {
    let mut steps: Vec<ModelName> = table
        .entry(name.as_str())
        .into_iter()
        .flat_map(|e| &e.ensemble)
        .flat_map(|m| steps_of_model(m))
        .collect();
    steps.sort();
    steps.dedup();
    steps
}

fn steps_of_model(m: &RepositoryModel) -> Vec<ModelName> {
    match &m.kind {
        ModelKind::Ensemble(e) => vec![e.preprocessor.clone(), e.classifier.clone()],
        _ => Vec::new(),
    }
}

/// Handles served in `before` and no longer in `after`.
fn replaced_handles(before: &ModelTable, after: &ModelTable) -> Vec<ModelHandle> {
    let kept: Vec<&ModelHandle> = after.all().filter_map(|s| s.handle()).collect();
    let mut out: Vec<ModelHandle> = Vec::new();
    for handle in before.all().filter_map(|s| s.handle()) {
        if !kept.iter().any(|k| k.same(handle)) && !out.iter().any(|o| o.same(handle)) {
            out.push(handle.clone());
        }
    }
    out
}

/// Models started for a load: shut down when dropped with handles still in it.
struct Starting<'a> {
    registry: &'a Registry,
    handles: Vec<ModelHandle>,
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        let handles = std::mem::take(&mut self.handles);
        if !handles.is_empty() {
            self.registry.retire(handles);
        }
    }
}

/// Every version of `name` in the scan, with its ensemble steps; an error says why the
/// model cannot load.
fn with_steps(scan: &ScanResult, name: &str) -> Result<Vec<RepositoryModel>, String> {
    let versions: Vec<&RepositoryModel> = scan
        .models
        .iter()
        .filter(|m| m.name.as_str() == name)
        .collect();
    if versions.is_empty() {
        return Err(match scan.failures.iter().find(|f| f.model == name) {
            Some(f) => format!("failed to load '{name}': {}", f.error),
            None => format!("no model '{name}' in the repository"),
        });
    }
    let mut out: Vec<RepositoryModel> = Vec::new();
    for m in versions {
        if let ModelKind::Ensemble(e) = &m.kind {
            for step in [&e.preprocessor, &e.classifier] {
                out.extend(with_steps(scan, step.as_str())?);
            }
        }
        out.push(m.clone());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_files_are_refused_in_one_plain_sentence() {
        let params = [(
            "file:1/model.pt".to_string(),
            ControlParam::Text("x".into()),
        )];
        let message = load_parameters(params).unwrap_err().to_string();
        assert!(!message.contains("  "), "{message}");
        assert!(
            message.contains("put the files in the model's directory"),
            "{message}"
        );
    }
}
