//! The integration tests that can share a process, in one binary: one link against
//! libtorch instead of one per file. Each module is one user-visible behaviour, named as
//! such; `cargo test --release --test it NAME` runs those whose path holds NAME.
//!
//! Tests that need a process of their own stay in `tests/*.rs`: one counts every
//! allocation (its global allocator), one measures the process's resident memory, one
//! installs the global log subscriber, and one checks what libtorch maps before CUDA is
//! opened.
#[path = "../common/mod.rs"]
mod common;

mod batching_keeps_each_request_its_own_rows;
mod cuda_shared_memory_serves_the_ensemble;
mod disconnecting_client_does_not_fail_its_batch;
mod engine_faults_fail_only_their_batch;
#[cfg(feature = "torch")]
mod engine_matches_a_plain_libtorch_forward;
mod error_contract_is_pinned;
mod every_route_answers_its_restriction;
mod full_queue_answers_503_with_retry_after;
mod higher_priority_requests_run_first;
mod jpegs_go_whole_to_instances_that_decode_them;
mod kserve_unusable_image_fails_its_request;
mod metrics_use_triton_names;
mod model_configs_cannot_take_the_server_down;
mod model_warmup_runs_before_ready;
mod openapi_document_matches_the_code;
mod packages_load_side_by_side;
mod predict_bad_files_get_error_entries;
mod predict_labels_real_photos;
mod predict_request_errors;
mod queue_timeout_answers_504_with_its_error;
mod repeated_image_is_a_cache_hit;
mod repository_control_loads_and_unloads_models;
mod stalled_uploads_hold_nothing;
mod v2_metadata_and_readiness;
