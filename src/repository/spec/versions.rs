//! The versions of a model that are served: its numeric version directories, as its
//! `version_policy` selects them.

use std::path::{Path, PathBuf};

use super::invalid;
use crate::domain::ModelVersion;
use crate::repository::{pb, Limits, RepositoryError};

pub(in crate::repository) fn available_versions(
    dir: &Path,
    model: &str,
) -> Result<Vec<ModelVersion>, RepositoryError> {
    let entries = std::fs::read_dir(dir).map_err(|source| RepositoryError::Io {
        path: PathBuf::from(model),
        source,
    })?;
    let mut versions: Vec<ModelVersion> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok())
        .map(ModelVersion)
        .collect();
    versions.sort();
    if versions.is_empty() {
        return Err(invalid(
            model,
            "version directories",
            "no numeric version directory (e.g. 1/) next to config.pbtxt",
        ));
    }
    Ok(versions)
}

/// Applies `version_policy` (default `latest { num_versions: 1 }`): the versions served,
/// oldest first.
pub(in crate::repository) fn select_versions(
    model: &str,
    config: &pb::ModelConfig,
    available: &[ModelVersion],
    limits: &Limits,
) -> Result<Vec<ModelVersion>, RepositoryError> {
    use pb::model_version_policy::PolicyChoice;
    let choice = config
        .version_policy
        .as_ref()
        .and_then(|p| p.policy_choice.clone());
    let selected: Vec<ModelVersion> = match choice {
        None => available.iter().rev().take(1).rev().copied().collect(),
        Some(PolicyChoice::Latest(l)) => {
            if l.num_versions == 0 {
                return Err(invalid(
                    model,
                    "version_policy.latest.num_versions",
                    "must be at least 1",
                ));
            }
            let n = l.num_versions as usize;
            available[available.len().saturating_sub(n)..].to_vec()
        }
        Some(PolicyChoice::All(_)) => available.to_vec(),
        Some(PolicyChoice::Specific(s)) => available
            .iter()
            .filter(|v| s.versions.iter().any(|&w| w >= 0 && w as u64 == v.0))
            .copied()
            .collect(),
    };
    if selected.is_empty() {
        return Err(invalid(
            model,
            "version_policy",
            "selects none of the version directories on disk",
        ));
    }
    if selected.len() > limits.versions {
        return Err(invalid(
            model,
            "version_policy",
            format!(
                "selects {} versions; at most {} are served per model (--max-model-versions)",
                selected.len(),
                limits.versions
            ),
        ));
    }
    Ok(selected)
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{temp_repo, write, CLASSIFIER};
    use crate::repository::{scan, Limits};

    #[test]
    fn version_policy_picks_the_served_version() {
        let root = temp_repo("versions");
        let specific =
            format!("{CLASSIFIER}\nversion_policy: {{ specific {{ versions: [ 2 ] }} }}");
        write(&root, "cls/config.pbtxt", &specific);
        write(&root, "cls/labels.txt", "a\nb\n");
        for v in ["1", "2", "3"] {
            write(&root, &format!("cls/{v}/model.pt"), "x");
        }
        write(&root, "latest/config.pbtxt", CLASSIFIER);
        write(&root, "latest/labels.txt", "a\nb\n");
        write(
            &root,
            "two/config.pbtxt",
            &format!("{CLASSIFIER}\nversion_policy: {{ latest {{ num_versions: 2 }} }}"),
        );
        write(&root, "two/labels.txt", "a\nb\n");
        write(
            &root,
            "all/config.pbtxt",
            &format!("{CLASSIFIER}\nversion_policy: {{ all {{ }} }}"),
        );
        write(&root, "all/labels.txt", "a\nb\n");
        for v in ["1", "7", "10"] {
            write(&root, &format!("latest/{v}/model.pt"), "x");
            write(&root, &format!("two/{v}/model.pt"), "x");
            write(&root, &format!("all/{v}/model.pt"), "x");
        }
        let r = scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
        assert!(r.failures.is_empty(), "{:?}", r.failures);
        let versions = |m: &str| -> Vec<u64> {
            r.models
                .iter()
                .filter(|x| x.name.as_str() == m)
                .map(|x| x.version.0)
                .collect()
        };
        assert_eq!(versions("cls"), vec![2]);
        assert_eq!(versions("latest"), vec![10]);
        assert_eq!(versions("two"), vec![7, 10]);
        assert_eq!(versions("all"), vec![1, 7, 10]);
    }
}
