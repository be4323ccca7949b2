//! How a classifier's requests are scheduled: its instance groups, dynamic batching and
//! the queue policy of each priority level.

use std::time::Duration;

use super::{invalid, unsupported, BatchingSpec, GroupKind, InstanceGroupSpec, QueuePolicySpec};
use crate::domain::TimeoutAction;
use crate::repository::pb::{self, model_config::SchedulingChoice};
use crate::repository::{Limits, RepositoryError};

/// The most batch sizes each instance times at warm-up (`preferred_batch_size`).
const MAX_TIMED_BATCH_SIZES: usize = 16;

/// The most priority levels a model's queue has (`priority_levels`).
const MAX_PRIORITY_LEVELS: u64 = 64;

/// The most requests one priority level's queue may hold (`max_queue_size`).
const MAX_QUEUE_SIZE: u32 = 1 << 20;

pub(super) fn instance_groups(
    model: &str,
    c: &pb::ModelConfig,
) -> Result<Vec<InstanceGroupSpec>, RepositoryError> {
    use pb::model_instance_group::Kind;
    if c.instance_group.is_empty() {
        // Triton's default: one instance on each available GPU, else one on the CPU.
        return Ok(vec![InstanceGroupSpec {
            kind: GroupKind::Auto,
            count: 1,
            gpus: vec![],
        }]);
    }
    c.instance_group
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let field = |f: &str| format!("instance_group[{i}].{f}");
            let kind = match g.kind() {
                Kind::Auto => GroupKind::Auto,
                Kind::Gpu => GroupKind::Gpu,
                Kind::Cpu => GroupKind::Cpu,
                Kind::Model => {
                    return Err(unsupported(
                        model,
                        &field("kind"),
                        "use KIND_GPU or KIND_CPU",
                    ))
                }
            };
            if g.rate_limiter.is_some() || !g.secondary_devices.is_empty() || g.passive {
                return Err(unsupported(
                    model,
                    &field("rate_limiter/secondary_devices/passive"),
                    "remove it from config.pbtxt",
                ));
            }
            if !g.profile.is_empty() {
                return Err(unsupported(
                    model,
                    &field("profile"),
                    "TensorRT only; remove it",
                ));
            }
            if kind == GroupKind::Cpu && !g.gpus.is_empty() {
                return Err(invalid(model, &field("gpus"), "KIND_CPU cannot list gpus"));
            }
            if g.count < 0 {
                return Err(invalid(model, &field("count"), "must not be negative"));
            }
            let gpus = g
                .gpus
                .iter()
                .map(|&x| {
                    u32::try_from(x).map_err(|_| invalid(model, &field("gpus"), "negative GPU id"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(InstanceGroupSpec {
                kind,
                // Triton: an unset count means 1.
                count: g.count.max(1) as u32,
                gpus,
            })
        })
        .collect()
}

pub(super) fn batching(
    model: &str,
    c: &pb::ModelConfig,
    limits: &Limits,
) -> Result<Option<BatchingSpec>, RepositoryError> {
    let Some(SchedulingChoice::DynamicBatching(d)) = &c.scheduling_choice else {
        return Ok(None);
    };
    let max = c.max_batch_size as i64;
    let mut preferred = Vec::new();
    for &p in &d.preferred_batch_size {
        if p < 1 || p as i64 > max {
            return Err(invalid(
                model,
                "dynamic_batching.preferred_batch_size",
                format!("{p} is outside 1..=max_batch_size ({max})"),
            ));
        }
        preferred.push(p as usize);
    }
    preferred.sort_unstable();
    preferred.dedup();
    if preferred.len() > MAX_TIMED_BATCH_SIZES {
        return Err(invalid(
            model,
            "dynamic_batching.preferred_batch_size",
            format!(
                "{} sizes; each instance times them at warm-up, at most \
                 {MAX_TIMED_BATCH_SIZES}",
                preferred.len()
            ),
        ));
    }
    let delay = Duration::from_micros(d.max_queue_delay_microseconds);
    if delay > limits.queue_delay {
        return Err(invalid(
            model,
            "dynamic_batching.max_queue_delay_microseconds",
            format!(
                "{} holds a row for a batch longer than the most allowed, {} \
                 (--max-queue-delay-secs {})",
                d.max_queue_delay_microseconds,
                limits.queue_delay.as_micros(),
                limits.queue_delay.as_secs()
            ),
        ));
    }
    if d.priority_levels > MAX_PRIORITY_LEVELS {
        return Err(invalid(
            model,
            "dynamic_batching.priority_levels",
            format!("{}; at most {MAX_PRIORITY_LEVELS}", d.priority_levels),
        ));
    }
    let levels = d.priority_levels as usize;
    let default_policy = queue_policy(
        model,
        "dynamic_batching.default_queue_policy",
        d.default_queue_policy.as_ref(),
    )?;
    let mut queues = vec![default_policy; levels.max(1)];
    for (&level, policy) in &d.priority_queue_policy {
        let field = format!("dynamic_batching.priority_queue_policy[{level}]");
        if level < 1 || level as usize > levels {
            return Err(invalid(
                model,
                &field,
                format!("priority level {level} is outside 1..=priority_levels ({levels})"),
            ));
        }
        queues[level as usize - 1] = queue_policy(model, &field, Some(policy))?;
    }
    let default_level = if levels == 0 {
        if d.default_priority_level != 0 {
            return Err(invalid(
                model,
                "dynamic_batching.default_priority_level",
                "set priority_levels too, or remove it",
            ));
        }
        0
    } else {
        let level = d.default_priority_level as usize;
        if level < 1 || level > levels {
            return Err(invalid(
                model,
                "dynamic_batching.default_priority_level",
                format!("must be within 1..=priority_levels ({levels}), got {level}"),
            ));
        }
        level - 1
    };
    Ok(Some(BatchingSpec {
        preferred_batch_sizes: preferred,
        max_queue_delay: delay,
        queues,
        default_level,
    }))
}

fn queue_policy(
    model: &str,
    field: &str,
    q: Option<&pb::ModelQueuePolicy>,
) -> Result<QueuePolicySpec, RepositoryError> {
    let Some(q) = q else {
        return Ok(QueuePolicySpec {
            timeout_action: TimeoutAction::Reject,
            default_timeout: None,
            allow_timeout_override: false,
            max_queue_size: None,
        });
    };
    let timeout_action = match pb::model_queue_policy::TimeoutAction::try_from(q.timeout_action) {
        Ok(pb::model_queue_policy::TimeoutAction::Reject) => TimeoutAction::Reject,
        Ok(pb::model_queue_policy::TimeoutAction::Delay) => TimeoutAction::Delay,
        Err(_) => {
            return Err(invalid(
                model,
                &format!("{field}.timeout_action"),
                "must be REJECT or DELAY",
            ))
        }
    };
    if q.max_queue_size > MAX_QUEUE_SIZE {
        return Err(invalid(
            model,
            &format!("{field}.max_queue_size"),
            format!("{}; at most {MAX_QUEUE_SIZE}", q.max_queue_size),
        ));
    }
    Ok(QueuePolicySpec {
        timeout_action,
        default_timeout: (q.default_timeout_microseconds > 0)
            .then(|| Duration::from_micros(q.default_timeout_microseconds)),
        allow_timeout_override: q.allow_timeout_override,
        max_queue_size: (q.max_queue_size > 0).then_some(q.max_queue_size as usize),
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{classifier_with, failure_of, temp_repo, write, CLASSIFIER};
    use super::*;
    use crate::repository::{scan, Limits};

    #[test]
    fn queue_policies_priorities_and_the_response_cache_are_read() {
        let c = classifier_with(
            "queues",
            r#"dynamic_batching {
                priority_levels: 2
                default_priority_level: 2
                default_queue_policy {
                    timeout_action: DELAY
                    default_timeout_microseconds: 5000
                    allow_timeout_override: true
                    max_queue_size: 4
                }
                priority_queue_policy { key: 1 value: { max_queue_size: 8 } }
            }"#,
        )
        .unwrap();
        assert!(c.response_cache);
        let b = c.batching.unwrap();
        assert_eq!(b.default_level, 1);
        assert_eq!(
            b.queues,
            vec![
                QueuePolicySpec {
                    timeout_action: TimeoutAction::Reject,
                    default_timeout: None,
                    allow_timeout_override: false,
                    max_queue_size: Some(8),
                },
                QueuePolicySpec {
                    timeout_action: TimeoutAction::Delay,
                    default_timeout: Some(Duration::from_micros(5000)),
                    allow_timeout_override: true,
                    max_queue_size: Some(4),
                },
            ]
        );
    }

    #[test]
    fn priority_settings_outside_the_levels_fail_with_the_field() {
        let e = classifier_with(
            "prio-key",
            "dynamic_batching { priority_levels: 2 default_priority_level: 1 \
             priority_queue_policy { key: 3 value: { max_queue_size: 8 } } }",
        )
        .unwrap_err();
        assert!(e.contains("priority_queue_policy[3]"), "{e}");
        let e =
            classifier_with("prio-default", "dynamic_batching { priority_levels: 2 }").unwrap_err();
        assert!(e.contains("default_priority_level"), "{e}");
        let e = classifier_with(
            "prio-none",
            "dynamic_batching { default_priority_level: 1 }",
        )
        .unwrap_err();
        assert!(e.contains("set priority_levels too"), "{e}");
    }

    #[test]
    fn scheduling_bounds_fail_with_the_field_and_the_bound() {
        let cases = [
            (
                "dynamic_batching { max_queue_delay_microseconds: 10000001 }".to_string(),
                "10000000 (--max-queue-delay-secs 10)",
            ),
            (
                "dynamic_batching { priority_levels: 65 default_priority_level: 1 }".to_string(),
                "priority_levels",
            ),
            (
                "dynamic_batching { default_queue_policy { max_queue_size: 1048577 } }".to_string(),
                "max_queue_size",
            ),
        ];
        for (i, (batching, expected)) in cases.iter().enumerate() {
            let e = classifier_with(&format!("bounds-{i}"), batching).unwrap_err();
            assert!(e.contains(expected), "{e}");
        }
        let at_the_bound = "dynamic_batching { max_queue_delay_microseconds: 10000000 }";
        assert!(classifier_with("bounds-ok", at_the_bound).is_ok());

        // Each instance times every preferred size at warm-up.
        let root = temp_repo("bounds-sizes");
        let sizes: Vec<String> = (1..=17).map(|n| n.to_string()).collect();
        let config = CLASSIFIER
            .replace("max_batch_size: 4", "max_batch_size: 32")
            .replace(
                "preferred_batch_size: [ 2 ]",
                &format!("preferred_batch_size: [ {} ]", sizes.join(", ")),
            );
        write(&root, "m/config.pbtxt", &config);
        write(&root, "m/labels.txt", "a\nb\n");
        write(&root, "m/1/model.pt", "x");
        let r = scan(std::slice::from_ref(&root), None, &Limits::default()).unwrap();
        let e = failure_of(&r, "m");
        assert!(
            e.contains("preferred_batch_size") && e.contains("17 sizes"),
            "{e}"
        );
    }
}
