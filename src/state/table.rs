//! The models served at one moment: one entry per model of the repository that the
//! registry knows of. A table is never changed in place while requests read it: the
//! registry edits a copy and swaps it in whole.
use std::collections::BTreeMap;
use std::sync::Arc;

use super::ServedModel;
use crate::domain::{ModelName, ModelVersion};
use crate::repository::RepositoryModel;

/// What the table knows of one model.
#[derive(Clone, Default)]
pub struct ModelEntry {
    /// Its served versions (the newest is the default); empty when none serves.
    pub served: BTreeMap<ModelVersion, ServedModel>,
    /// Why it is not served (failed, unloaded, an ensemble's step missing), or why its
    /// last reload failed while `served` keeps serving.
    pub unavailable: Option<String>,
    /// A fingerprint of its files once loaded (poll mode reloads on change).
    pub fingerprint: Option<u64>,
    /// For an ensemble, its loaded versions; served (in `served`) while its steps are.
    pub ensemble: Vec<Arc<RepositoryModel>>,
}

impl ModelEntry {
    fn is_empty(&self) -> bool {
        self.served.is_empty()
            && self.unavailable.is_none()
            && self.fingerprint.is_none()
            && self.ensemble.is_empty()
    }
}

#[derive(Clone, Default)]
pub struct ModelTable {
    entries: BTreeMap<ModelName, ModelEntry>,
}

impl ModelTable {
    /// `version` of `name`, or its newest.
    pub fn get(&self, name: &str, version: Option<ModelVersion>) -> Option<&ServedModel> {
        let served = &self.entries.get(name)?.served;
        match version {
            Some(v) => served.get(&v),
            None => served.values().next_back(),
        }
    }

    /// The served versions of `name` (`None` when none serves).
    pub fn versions(&self, name: &str) -> Option<&BTreeMap<ModelVersion, ServedModel>> {
        self.entries
            .get(name)
            .map(|e| &e.served)
            .filter(|s| !s.is_empty())
    }

    /// Every served version of every model.
    pub fn all(&self) -> impl Iterator<Item = &ServedModel> {
        self.entries.values().flat_map(|e| e.served.values())
    }

    /// Every model's entry, by name.
    pub fn entries(&self) -> impl Iterator<Item = (&ModelName, &ModelEntry)> {
        self.entries.iter()
    }

    pub fn entry(&self, name: &str) -> Option<&ModelEntry> {
        self.entries.get(name)
    }

    /// `name`'s entry to edit (made when missing; `prune` drops it again if left empty).
    pub(super) fn entry_mut(&mut self, name: &ModelName) -> &mut ModelEntry {
        self.entries.entry(name.clone()).or_default()
    }

    /// Every entry to edit.
    pub(super) fn entries_mut(&mut self) -> impl Iterator<Item = (&ModelName, &mut ModelEntry)> {
        self.entries.iter_mut()
    }

    /// Drops the entries that no longer say anything.
    pub(super) fn prune(&mut self) {
        self.entries.retain(|_, e| !e.is_empty());
    }
}
