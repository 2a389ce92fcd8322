"""Every flag the parser accepts has an effect, shown by a named test. Adding a flag without a test
fails here; a renamed or deleted test fails here too."""

from __future__ import annotations

import ast
import dataclasses

from helpers import REPO
from llama_fp8.config import TrainConfig

FLAG_TESTS: dict[str, list[str]] = {
    "config": ["test_config::test_precedence_defaults_preset_file_flags"],
    "model": ["test_config::test_model_can_come_from_config_file", "models/test_common::test_preset_parameter_counts_match_published"],
    "model_type": ["test_config::test_model_type_sets_rope_family"],
    "model_impl": ["models/test_common::test_model_impl_te_without_te_says_how_to_get_it",
                   "precision/test_precision::test_backend_and_model_impl_mismatch_errors"],
    **{f: ["models/test_common::test_shape_flags_reach_the_model"] for f in (
        "vocab_size", "hidden_width", "num_layers", "num_heads", "num_key_value_heads", "intermediate_size",
        "initializer_range", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings")},
    "max_context_width": ["models/test_common::test_max_context_width_raises_rope_range",
                          "train/test_train::test_batch_size_and_context_width_set_the_batch"],
    "rope_theta": ["models/test_common::test_rope_flags_reach_the_model"],
    "rope_scaling": ["models/test_common::test_rope_flags_reach_the_model"],
    "bf16": ["train/test_train::test_bf16_flag_sets_compute_dtype"],
    "fp8": ["train/test_train::test_fp8_run_is_labelled_and_uses_float8",
            "parallel/test_distributed::test_fp8_emulated_loss_tracks_bf16_through_the_cli"],
    "fp8_backend": ["precision/test_precision::test_backend_and_model_impl_mismatch_errors",
                    "precision/test_precision::test_backend_auto_picks_torchao_for_hf_and_te_for_te"],
    "fp8_recipe": ["precision/test_precision::test_fp8_recipe_reaches_torchao"],
    "fp8_all_gather": ["parallel/test_scale::test_fp8_all_gather_sets_torchao_and_refuses_what_cannot_work",
                       "parallel/test_scale::test_fp8_all_gather_tracks_plain_fp8"],
    "fp8_exclude": ["precision/test_fp8_check::test_fp8_exclude_keeps_the_matching_layers_out_of_the_conversion",
                    "precision/test_fp8_check::test_a_healthy_run_writes_its_coverage_record"],
    "fp8_verify": ["precision/test_fp8_check::test_a_run_whose_conversion_is_patched_away_stops_naming_it",
                   "precision/test_fp8_check::test_fp8_verify_warn_lets_the_same_run_finish"],
    "fp8_stats": ["precision/test_fp8_stats::test_a_run_with_fp8_stats_writes_one_line_per_layer_tensor_and_logged_step"],
    "fp8_amax_history_len": ["precision/test_precision::test_te_backend_plumbs_recipe_flags_and_checks_before_building"],
    "fp8_amax_compute_algo": ["precision/test_precision::test_te_backend_plumbs_recipe_flags_and_checks_before_building"],
    "train_batch_size": ["train/test_train::test_batch_size_and_context_width_set_the_batch"],
    "val_batch_size": ["train/test_train::test_val_batch_size_sets_the_validation_batch"],
    "max_steps": ["train/test_train::test_max_steps_and_logging_freq"],
    "seed": ["train/test_train::test_same_seed_same_losses_other_seed_differs"],
    **{f: ["train/test_train::test_lr_schedule_warmup_then_cosine_to_min", "train/test_train::test_lr_decay_styles_and_iters"]
       for f in ("lr", "min_lr", "warmup", "lr_decay_style", "lr_decay_iters")},
    **{f: ["train/test_train::test_optimizer_groups_betas_and_weight_decay"] for f in ("weight_decay", "beta1", "beta2")},
    "grad_clip": ["train/test_train::test_grad_clip_limits_the_update"],
    "grad_accum_steps": ["parallel/test_scale::test_grad_accumulation_equals_the_larger_batch"],
    "optimizer": ["parallel/test_scale::test_adamw8bit_trains_checkpoints_and_resumes_exactly",
                  "parallel/test_scale::test_cpu_offload_and_fp8_optimizer_say_they_need_cuda"],
    "dataset": ["data/test_data::test_all_local_formats_give_the_same_batches", "data/test_data::test_error_messages",
                "data/test_corpus::test_a_resume_at_1_2_or_3_ranks_reads_exactly_what_the_uninterrupted_run_reads",
                "reliability/test_resume_changes::test_resume_of_a_tokenized_corpus_at_another_world_size_reads_on_exactly"],
    "data_blend": ["data/test_corpus::test_blend_is_within_one_percent_of_its_weights_over_10000_samples_and_exact_on_resume",
                   "data/test_corpus_training::test_a_run_reads_a_blend_skips_samples_and_masks_documents"],
    "skip_samples": ["data/test_corpus::test_skip_samples_leave_out_exactly_those_positions_and_stay_in_the_checkpoint",
                     "data/test_corpus_training::test_a_run_reads_a_blend_skips_samples_and_masks_documents"],
    "doc_masking": ["models/test_doc_masking::test_packed_documents_with_the_mask_give_each_documents_own_losses_and_gradients",
                    "models/test_doc_masking::test_te_model_hands_its_layers_the_documents_as_thd_cu_seqlens",
                    "data/test_corpus_training::test_a_run_reads_a_blend_skips_samples_and_masks_documents"],
    "dataset_config_name": ["data/test_data::test_hub_streaming_path_with_a_local_stand_in"],
    "text_field": ["data/test_data::test_error_messages"],
    "data_files": ["data/test_data::test_data_files_globs_inside_a_folder"],
    "val_data_files": ["data/test_data::test_val_data_files"],
    "val_fraction": ["data/test_data::test_val_fraction_holds_out_documents"],
    "tokenizer": ["data/test_data::test_unshuffled_blocks_are_the_document_stream_cut_into_t_plus_1",
                  "data/test_data::test_error_messages"],
    "streaming": ["data/test_data::test_hub_streaming_path_with_a_local_stand_in",
                  "data/test_data::test_hub_dataset_with_streaming_off_is_opened_map_style"],
    "num_workers": ["data/test_data::test_ranks_never_share_a_block_or_a_document",
                    "data/test_data::test_resume_yields_exactly_the_uninterrupted_batches",
                    "data/test_corpus::test_threads_reading_ahead_give_the_same_batches_and_position"],
    "validation_freq": ["train/test_train::test_validation_flags"],
    "validation_batches": ["train/test_train::test_validation_flags"],
    "sharding_strategy": ["parallel/test_scale::test_hybrid_is_replicate_across_nodes_shard_within"],
    "dp_replicate_size": ["parallel/test_scale::test_parallel_dims_fill_and_validate",
                          "parallel/test_distributed::test_hsdp_and_fsdp_match_one_rank_with_the_same_global_batch"],
    "dp_shard_size": ["parallel/test_scale::test_parallel_dims_fill_and_validate"],
    "tp_size": ["parallel/test_nd::test_tensor_parallel_trains_like_one_rank",
                "parallel/test_nd::test_resume_reshards_between_layouts"],
    "cp_size": ["parallel/test_nd::test_a_refused_layout_exits_2_naming_the_flag",
                "models/te/test_te_real_parallel::test_te_context_parallel_wiring_on_two_ranks"],
    "cp_comm_type": ["models/te/test_te_real_parallel::test_te_context_parallel_wiring_on_two_ranks",
                     "parallel/test_nd::test_what_tensor_and_context_parallelism_refuse"],
    "activation_checkpointing": ["parallel/test_scale::test_activation_checkpointing_keeps_losses_and_checkpoint_names",
                                 "parallel/test_scale::test_activation_checkpointing_wraps_every_block"],
    "compile": ["parallel/test_scale::test_compile_per_block_trains_like_eager"],
    "cpu_offload": ["parallel/test_scale::test_cpu_offload_and_fp8_optimizer_say_they_need_cuda"],
    "device": ["train/test_train::test_device_cuda_without_gpu_is_a_config_error"],
    "checkpoint_dir": ["checkpoint/test_save_resume::test_checkpoint_dir_flag_puts_checkpoints_there",
                       "reliability/test_s3::test_s3_save_and_exact_resume_one_rank"],
    "checkpoint_copy_dir": ["reliability/test_s3::test_s3_tier_resumes_from_s3_when_the_file_system_tier_is_gone",
                            "checkpoint/test_s3_settings::test_a_copy_dir_must_be_s3_from_a_file_system_checkpoint_dir"],
    "checkpoint_copy_every": ["checkpoint/test_s3_settings::test_every_mth_checkpoint_is_copied_and_one_copy_at_a_time",
                              "reliability/test_s3::test_s3_tier_resumes_from_s3_when_the_file_system_tier_is_gone"],
    **{f: ["checkpoint/test_s3_settings::test_s3_region_and_endpoint_come_from_flags_or_the_aws_environment",
           "reliability/test_s3::test_s3_save_and_exact_resume_one_rank"] for f in ("s3_region", "s3_endpoint")},
    **{f: ["checkpoint/test_s3_settings::test_s3_writer_threads_and_prefix_strategy_reach_the_connectors_writer",
           "reliability/test_s3::test_s3_resume_at_another_world_size"] for f in ("s3_threads", "s3_prefix_strategy")},
    "checkpoint_freq": ["checkpoint/test_save_resume::test_keep_last_k_and_resume_none"],
    "keep_last_k": ["checkpoint/test_save_resume::test_keep_last_k_and_resume_none"],
    "async_checkpoint": ["checkpoint/test_save_resume::test_resume_reproduces_the_uninterrupted_run_bitwise"],
    "resume_from_checkpoint": ["checkpoint/test_save_resume::test_keep_last_k_and_resume_none",
                               "checkpoint/test_save_resume::test_interrupted_save_is_ignored_and_previous_stays_loadable"],
    "init_from_hf": ["checkpoint/test_save_resume::test_init_from_hf_loads_every_weight"],
    "nan_policy": ["checkpoint/test_save_resume::test_nan_skip_policy_skips_and_counts",
                   "checkpoint/test_save_resume::test_nan_stops_naming_the_step_and_keeps_the_last_good_checkpoint"],
    "max_nan_skips": ["checkpoint/test_save_resume::test_nan_skip_policy_skips_and_counts"],
    "checkpoint_timeout": ["parallel/test_distributed::test_every_process_group_gets_its_timeout"],
    "process_group_timeout": ["checkpoint/test_save_resume::test_process_group_timeout_reaches_the_process_group",
                              "parallel/test_distributed::test_every_process_group_gets_its_timeout",
                              "checkpoint/test_save_resume::test_sigkill_of_one_rank_fails_fast_and_the_rerun_resumes"],
    "logging_freq": ["train/test_train::test_max_steps_and_logging_freq"],
    "straggler_threshold_pct": ["train/test_stragglers::test_a_rank_slowed_by_a_fault_is_named_with_host_and_gpu"],
    "peak_tflops": ["train/test_train::test_peak_tflops_gives_mfu"],
    "tensorboard_dir": ["test_metrics::test_tensorboard_sink_writes_the_scalars"],
    "wandb_project": ["test_metrics::test_wandb_offline_sink_needs_no_network"],
    "wandb_mode": ["test_metrics::test_wandb_flags_reach_wandb_init"],
    "prometheus_textfile_dir": ["test_sinks::test_the_textfile_of_a_2_rank_run_holds_metrics_jsonl_under_prometheus_names",
                                "test_sinks::test_a_textfile_folder_or_otlp_endpoint_that_cannot_work_is_a_config_error"],
    "otlp_endpoint": ["test_sinks::test_otlp_over_http_carries_the_textfiles_gauges_from_every_rank",
                      "test_sinks::test_a_textfile_folder_or_otlp_endpoint_that_cannot_work_is_a_config_error"],
    "mlflow_tracking_uri": ["test_sinks::test_the_documented_sqlite_store_holds_the_runs_params_metrics_and_standard_tags",
                            "test_sinks::test_a_sink_failing_mid_run_leaves_training_and_the_other_records_intact"],
    "mlflow_experiment": ["test_sinks::test_the_documented_sqlite_store_holds_the_runs_params_metrics_and_standard_tags"],
    "mlflow_run_name": ["test_sinks::test_the_documented_sqlite_store_holds_the_runs_params_metrics_and_standard_tags"],
    "profile_steps": ["test_profiling::test_profile_steps_writes_a_trace_of_those_steps_naming_our_modules"],
    "profile_ranks": ["test_profiling::test_profile_ranks_picks_the_ranks_that_write"],
    "memory_snapshot": ["test_profiling::test_memory_snapshot_needs_cuda",
                        "test_profiling::test_memory_snapshot_records_history_and_dumps_at_the_end_and_on_oom"],
    "run_dir": ["train/test_train::test_run_writes_config_metrics_and_log_line",
                "train/test_train::test_existing_run_dir_is_not_overwritten"],
}


def _test_names(module: str) -> set[str]:
    tree = ast.parse((REPO / "tests" / f"{module}.py").read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_flag_has_a_test_of_its_effect():
    flags = {f.name for f in dataclasses.fields(TrainConfig)}
    assert flags - set(FLAG_TESTS) == set(), "flags without an effect test"
    assert set(FLAG_TESTS) - flags == set(), "tests listed for flags that no longer exist"


def test_the_named_tests_exist():
    missing = [ref for refs in FLAG_TESTS.values() for ref in refs
               if ref.split("::")[1] not in _test_names(ref.split("::")[0])]
    assert not missing, missing
