"""The fault matrix: what each test injects and expects (here, static), what it observed (recorded by the
test when it passes), and the table docs/reliability.md rendered from both.

    LLAMA_FP8_RELIABILITY_DOC=docs/reliability.md .venv/bin/python -m pytest tests/reliability   # + the doc
    .venv/bin/python tests/reliability/matrix.py --out docs/reliability.md      # render the recorded rows
    .venv/bin/python -m pytest tests/checkpoint && \
        .venv/bin/python tests/reliability/matrix.py --hostile_only    # only the hostile-inputs section

A passing matrix test records its row (observed outcome, optimizer steps lost) in ROWS_FILE, replacing
the row of an earlier run of the same test; the Slurm rows (tests/cluster/test_faults_slurm.py,
test_spares_slurm.py) are recorded the same way when they run. The doc is written only when every row of MATRIX has been recorded,
so it always describes runs of the current tests. test_reliability_doc.py checks that the doc lists
exactly MATRIX and that the README's headline figures are the doc's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import platform
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROWS_FILE = Path(os.environ.get("LLAMA_FP8_RELIABILITY_ROWS", REPO / ".pytest_cache" / "llama-fp8-reliability.json"))

FAULT, BAD_INPUT, CHANGE = "fault", "bad input", "resume change"
_KILL_SAVE = "the save of step_4 never becomes complete; step_2 stays intact; the rerun resumes from step_2 and " \
             "ends bitwise equal to the uninterrupted run"
# test id -> (kind, fault injected, expected outcome)
MATRIX: dict[str, tuple[str, str, str]] = {
    # --- process faults: 2 ranks (gloo), real torchrun ------------------------------------------------------
    "test_sigkill_one_rank_mid_step": (
        FAULT, "SIGKILL of rank 1 in the middle of step 5 (after forward, before backward)",
        "the job fails fast (torchrun stops the other rank); step_4 intact; the rerun resumes from step_4, bitwise"),
    "test_sigkill_every_rank_mid_step": (
        FAULT, "SIGKILL of every rank in the middle of step 5",
        "step_4 intact; the rerun resumes from step_4, bitwise"),
    "test_sigkill_during_save[save.shards_written-rank0]": (
        FAULT, "SIGKILL of rank 0 during the save of step_4: its shards written, before the COMPLETE marker",
        _KILL_SAVE),
    "test_sigkill_during_save[save.shards_written-rank1]": (
        FAULT, "SIGKILL of rank 1 during the save of step_4: its shards written, before the COMPLETE marker",
        _KILL_SAVE),
    "test_sigkill_during_save[save.marker_written-rank0]": (
        FAULT, "SIGKILL of rank 0 during the save of step_4: after the marker, before the rename", _KILL_SAVE),
    "test_sigkill_during_save[save.marker_written-rank1]": (
        FAULT, "SIGKILL of rank 1 during the save of step_4: after every rank's files are on disk, while rank 0 "
        "writes the marker and renames", "rank 0 completes step_4 (nothing of it is missing); the job fails; the "
        "rerun resumes from step_4, bitwise"),
    "test_sigkill_during_save[save.async_in_flight-rank0]": (
        FAULT, "SIGKILL of rank 0 while an async save of step_4 is being written", _KILL_SAVE),
    "test_sigkill_during_save[save.async_in_flight-rank1]": (
        FAULT, "SIGKILL of rank 1 while an async save of step_4 is being written", _KILL_SAVE),
    "test_sigkill_during_save[save.pruning-rank0]": (
        FAULT, "SIGKILL of rank 0 while --keep_last_k deletes step_2 after saving step_4",
        "step_4 complete; the half-deleted step_2 is never a resume candidate and is removed by the next save; "
        "the rerun resumes from step_4, bitwise"),
    "test_slow_rank_during_async_save": (
        FAULT, "rank 1 stalls 3 s right after an async save of step_4 started (training collectives on rank 0 "
        "overlap the save's)", "training and the save both complete; losses and weights bitwise equal"),
    "test_sigusr1_repeated": (
        FAULT, "SIGUSR1 to both ranks, then again every 50 ms until the job exits",
        "one checkpoint at the step where all ranks agreed, exit 85 (requeue), never killed by a later signal; "
        "the rerun resumes, bitwise"),
    "test_sigterm_during_async_save": (
        FAULT, "SIGTERM to both ranks while the async save of step_4 is in flight",
        "the in-flight save completes, one more checkpoint at the next step, exit 85; the rerun resumes, bitwise"),
    "test_signal_during_validation": (
        FAULT, "SIGUSR1 while validation runs (after step 2)",
        "validation finishes and is logged, checkpoint at step 2, exit 85; the rerun resumes, bitwise"),
    "test_disk_full_during_save": (
        FAULT, "the checkpoint file system fills up during the save of step_4 (tmpfs; RLIMIT_FSIZE where mount "
        "is not allowed)",
        "every rank stops with exit 2 naming the path and its free space; no step_4, step_2 intact; after "
        "space is freed the rerun resumes from step_2, bitwise"),
    "test_checkpoint_dir_not_writable": (
        FAULT, "--checkpoint_dir on a read-only file system",
        "refused at start-up on every rank, before the model is built (exit 2, one message naming the dir)"),
    # --- inside a Slurm allocation: 2 nodes x 1 rank (2 x 2 where said), `sbatch 1.train_llama.sbatch`, the default
    # timeouts (tests/cluster/test_faults_slurm.py)
    "test_worker_sigkilled_twice_restarts_in_the_job": (
        FAULT, "Slurm: SIGKILL of a worker at two random steps (rank 1, then rank 0)",
        "every rank restarts inside the allocation twice, resumes from the latest complete "
        "checkpoint each time, COMPLETED without a requeue, bitwise"),
    "test_worker_sigstopped_is_detected_and_restarted": (
        FAULT, "Slurm, 2 nodes x 2 ranks, the default timeouts: rank 1 frozen by SIGSTOP in step 5",
        "the launcher sees it stall past max(5 x its step time, 15 s), names it and none of the three ranks waiting "
        "for it, kills every rank and restarts in the job; COMPLETED, bitwise, no collective timeout"),
    "test_every_worker_sigstopped_at_once_is_detected_and_restarted": (
        FAULT, "Slurm, the default timeouts: every rank frozen by SIGSTOP in step 5 (a stall where nobody fails)",
        "seen the same way, nobody named (nobody is behind), restarted in the job; COMPLETED, bitwise"),
    "test_transient_eio_on_the_checkpoint_read_after_a_crash_is_retried": (
        FAULT, "Slurm: rank 1 SIGKILLed in step 5, then an EIO on the restarted attempt's read of step_4 (once per rank)",
        "the read is retried in place (not exit 2), the job resumes in the allocation; COMPLETED, bitwise"),
    "test_rank_hangs_in_a_collective_on_slurm": (
        FAULT, "Slurm, the backstop (hang detection off): rank 1 stuck outside collectives (a loop deaf to SIGTERM) in "
        "step 5; --process_group_timeout 30",
        "rank 0's collective fails after 30 s naming the timeout; rank 1 named, killed; every rank restarts in the "
        "job, COMPLETED, bitwise"),
    "test_worker_exiting_1_restarts_in_the_job": (
        FAULT, "Slurm: rank 0 exits 1 (an exception) in step 5",
        "every rank restarts in the job from step_4, COMPLETED, bitwise"),
    "test_rendezvous_host_killed_requeues_and_resumes": (
        FAULT, "Slurm: the first node's launcher (the rendezvous host) SIGKILLed in step 4",
        "the allocation cannot continue; the batch script requeues the job (at most MAX_REQUEUES times), which "
        "resumes, COMPLETED, bitwise"),
    **{f"test_node_marked_down_is_requeued_by_slurm_and_resumes[{which}]": (
        FAULT, f"Slurm: the {which} node of the job set DOWN in step 4" + (" (it runs the batch script too)"
                                                                           if which == "first" else ""),
        "Slurm requeues the job (NODE_FAIL, --requeue); when the node is back it resumes, COMPLETED, bitwise")
       for which in ("second", "first")},
    "test_a_node_that_fails_twice_is_left_behind_on_requeue": (
        FAULT, "Slurm, three nodes: n2 kills its rank in step 3, then again in step 4 (no new checkpoint between)",
        "restarted in the job once; the second failure leaves n2 behind, the cluster having a node for the job "
        "without it: requeued with ExcNodeList=n2, resumes on the other two nodes, COMPLETED, bitwise"),
    # --- spare nodes and the bad-node policy (tests/cluster/test_spares_slurm.py) ----------------------------------
    "test_failures_far_apart_restart_and_a_bad_node_the_job_cannot_do_without_restarts_in_place": (
        FAULT, "Slurm, SPARE_NODES=1 on three nodes, the spare n3 failing its preflight: n2 kills its rank in steps 3 "
        "and 5 (a checkpoint between) and 6 (none since)",
        "n3 never used; the first two failures restarted in the job (not a bad node); the third leaves n2 charged "
        "twice without progress, and with no node for the job without it the step restarts in place on n2, saying "
        "why; no requeue, COMPLETED, bitwise"),
    "test_a_lost_training_node_continues_on_the_spare_without_a_requeue": (
        FAULT, "Slurm, SPARE_NODES=1: n2's launcher and worker SIGKILLed in step 4 (the node gone)",
        "the spare n3 joins the next rendezvous after torch drops n2; the job resumes at the same world size, no "
        "requeue; the swap in the log and metrics.jsonl; COMPLETED, bitwise"),
    "test_a_node_failing_its_health_check_goes_to_the_spare_then_a_lost_node_requeues": (
        FAULT, "Slurm, SPARE_NODES=1: n2 kills its rank in step 3 and fails its health check; then n3's launcher "
        "SIGKILLed in step 6",
        "n2 hands its place to the spare, no requeue; with no spare left the lost n3 ends the step and the job is "
        "requeued as without spares (without n2, on two nodes), COMPLETED, bitwise"),
    "test_sigusr1_during_a_restart_requeues": (
        FAULT, "Slurm: rank 1 killed in step 4, then SIGUSR1 (the time-limit warning) while the workers restart",
        "no restart after the signal: exit 85, the script requeues, the job resumes, COMPLETED, bitwise"),
    "test_deterministic_failure_is_not_restarted": (
        FAULT, "Slurm: a non-finite loss from step 3 on (every attempt would hit it)",
        "exit 3 once, not restarted, not requeued: the job FAILED with one line saying why"),
    # --- checkpoints on S3: a real S3-compatible server (SeaweedFS) on 127.0.0.1, the connector's own client ----
    "test_s3_rank_killed_mid_upload_two_ranks": (
        FAULT, "S3, 2 ranks: SIGKILL of rank 1 while its shard of step_4 is being uploaded",
        "step_4 never gets its manifest; step_2 intact; the rerun resumes from step_2 (bitwise), its first save "
        "removes the half-written prefix"),
    "test_s3_throttled_with_503_slow_down": (
        FAULT, "S3: a proxy answers every 4th request 503 Slow Down (async saves and the load)",
        "the client retries; nothing fails; the resumed run is bitwise equal"),
    "test_s3_server_down_during_a_save_and_back_before_the_next": (
        FAULT, "S3: the server stopped during the save of step_4, back before the rerun",
        "the save fails after the retries with the transient exit 75 (restart, not a bad config); step_2 intact; "
        "the rerun resumes from step_2, bitwise"),
    "test_s3_half_written_prefix_is_never_loaded": (
        FAULT, "S3: step_4's objects without its manifest (a save interrupted before COMPLETE)",
        "never a resume candidate; resumes from step_2, bitwise; the prefix is replaced by the next save of step 4"),
    "test_s3_manifest_without_its_shards_falls_back": (
        BAD_INPUT, "S3: step_4's manifest present, its shard objects deleted",
        "list-and-verify names them; step_4 set aside (kept); resumes from step_2, bitwise"),
    "test_s3_planted_objects_that_are_not_ours_are_kept": (
        BAD_INPUT, "S3: objects not ours planted inside step_4/, as a step_6/ prefix, and beside the checkpoints",
        "never read, never deleted (step_6/ moved aside before step 6 is saved); resumes from step_4, bitwise"),
    "test_s3_tier_resumes_from_s3_when_the_file_system_tier_is_gone": (
        FAULT, "two tiers: checkpoints on the file system, each copied to S3 in the background; then the file system's "
               "folder deleted", "resumes from the S3 copy of step_4, bitwise"),
    # --- damaged checkpoints and unsafe files (1 rank, in-process) --------------------------------------------
    "test_damaged_latest_checkpoint_falls_back[truncated shard]": (
        BAD_INPUT, "the latest checkpoint's .distcp shard truncated to half",
        "auto resume names the file, sets step_4 aside as step_4.broken, resumes from step_2, bitwise"),
    "test_damaged_latest_checkpoint_falls_back[flipped byte in shard]": (
        BAD_INPUT, "one byte flipped in the middle of the latest shard (same size)",
        "the checksum mismatch is named; falls back to step_2, bitwise"),
    "test_damaged_latest_checkpoint_falls_back[missing shard]": (
        BAD_INPUT, "the latest checkpoint's shard deleted", "named as missing; falls back to step_2, bitwise"),
    "test_damaged_latest_checkpoint_falls_back[truncated .metadata]": (
        BAD_INPUT, "DCP's .metadata truncated", "named; falls back to step_2, bitwise"),
    "test_damaged_latest_checkpoint_falls_back[garbled train_state.json]": (
        BAD_INPUT, "train_state.json cut in the middle", "named; falls back to step_2, bitwise"),
    "test_damaged_latest_checkpoint_falls_back[garbled rank file]": (
        BAD_INPUT, "rank0.safetensors overwritten with garbage of the same size", "named; falls back to step_2, "
        "bitwise"),
    "test_damaged_latest_checkpoint_falls_back[garbled COMPLETE]": (
        BAD_INPUT, "the COMPLETE manifest overwritten", "named; falls back to step_2, bitwise"),
    "test_every_checkpoint_damaged_stops": (
        BAD_INPUT, "every complete checkpoint damaged",
        "stops before building (exit 2) naming each; nothing deleted, metrics not appended"),
    "test_explicitly_named_damaged_checkpoint_stops": (
        BAD_INPUT, "--resume_from_checkpoint names a damaged checkpoint",
        "stops (exit 2) naming the broken file; no fallback to another checkpoint, nothing renamed"),
    "test_planted_pickle_in_legacy_rank_file_is_refused": (
        BAD_INPUT, "a pickle whose payload runs a command, planted as rank0.pt of an old-format checkpoint",
        "refused without running the payload (named: the global it tried to load); falls back to step_2"),
    "test_planted_pickle_in_dcp_metadata_is_refused": (
        BAD_INPUT, "the same payload planted as DCP's .metadata (manifest rewritten to match)",
        "refused without running the payload; falls back to step_2"),
    "test_planted_pickle_as_rank_file_with_forged_manifest_is_refused": (
        BAD_INPUT, "a pickle payload as rank0.safetensors, manifest checksum forged to match",
        "refused by the safetensors reader, payload not run; falls back to step_2"),
    "test_old_format_checkpoint_still_resumes_bitwise": (
        BAD_INPUT, "a checkpoint of the previous format (rank0.pt pickles, COMPLETE = ok, no checksums)",
        "loads through the allow-listed reader and resumes bitwise"),
    # --- resume with changed settings (1 rank, in-process) ---------------------------------------------------
    "test_resume_with_changed_model_shape_stops[num_layers]": (
        CHANGE, "resume with --num_layers 3 (saved: 2)", "stops before building, naming --num_layers"),
    "test_resume_with_changed_model_shape_stops[hidden_width]": (
        CHANGE, "resume with --hidden_width 64 (saved: 128)", "stops before building, naming --hidden_width"),
    "test_resume_with_changed_model_shape_stops[optimizer]": (
        CHANGE, "resume with --optimizer adamw8bit (saved: adamw)", "stops before building, naming --optimizer"),
    "test_resume_with_changed_model_shape_stops[dataset]": (
        CHANGE, "resume on another --dataset (saved: synthetic)", "stops before building, naming --dataset"),
    "test_resume_with_another_model_implementation_stops": (
        CHANGE, "resume with another --model_impl (a third, registered implementation)",
        "stops before building, naming both implementations"),
    "test_resume_with_changed_precision_works[fp8]": (
        CHANGE, "resume a BF16 checkpoint with --fp8 1 (torchao tensorwise)",
        "works: FP32 master weights and moments load unchanged; loss continues within 2 % of the BF16 run"),
    "test_resume_with_changed_precision_works[fp8 rowwise]": (
        CHANGE, "resume a BF16 checkpoint with --fp8 1 --fp8_recipe rowwise", "works, as above"),
    "test_resume_with_changed_precision_works[fp8 all-gather]": (
        CHANGE, "resume a BF16 checkpoint with --fp8 1 --fp8_all_gather 1", "works, as above"),
    "test_resume_with_changed_precision_works[fp32]": (
        CHANGE, "resume a BF16 checkpoint with --bf16 0", "works, as above"),
    "test_resume_with_changed_world_size_works": (
        CHANGE, "resume a 2-rank checkpoint on 1 rank (batch 2 -> 4: same global batch)",
        "works: DCP reshards; synthetic data continues at the same global sample; losses within 2e-3"),
    "test_resume_of_a_tokenized_corpus_at_another_world_size_reads_on_exactly": (
        CHANGE, "resume a 2-rank checkpoint of real text from a tokenized corpus (2 x 3 samples per step) on 1 rank "
        "(x 6) and on 3 ranks (x 2)",
        "works: the data position is one global sample count; steps 5-6 read exactly the samples of the "
        "uninterrupted run (equal data_crc32); losses within 2e-3"),
    "test_resume_with_changed_lr_applies_the_new_schedule": (
        CHANGE, "resume with --lr halved", "the new peak LR applies from the resumed step on"),
    # --- bad data (1 rank, in-process, a local JSONL corpus) -------------------------------------------------
    "test_bad_data_is_refused_naming_file_and_line[malformed JSON line]": (
        BAD_INPUT, "a JSONL file with a malformed line", "stops at start-up (exit 2) naming the file and line"),
    "test_bad_data_is_refused_naming_file_and_line[files with different fields]": (
        BAD_INPUT, "one JSONL file with a field the others lack (the JSON reader needs one schema per split)",
        "stops at start-up naming the file and both field lists"),
    "test_bad_data_is_refused_naming_file_and_line[invalid UTF-8]": (
        BAD_INPUT, "a .jsonl file with bytes that are not UTF-8", "stops at start-up naming the file and line"),
    "test_bad_data_is_refused_naming_file_and_line[dangling symlink]": (
        BAD_INPUT, "a data file that is a dangling symlink (unreadable)", "stops at start-up naming the file"),
    "test_bad_data_is_refused_naming_file_and_line[every file empty]": (
        BAD_INPUT, "every data file empty", "stops at start-up naming the files"),
    "test_empty_file_is_skipped_and_counted": (
        BAD_INPUT, "one empty file among the data files", "skipped, named and counted in the log; training runs"),
    "test_documents_without_text_are_skipped_and_counted": (
        BAD_INPUT, "documents without the text field (an empty record, a null text)",
        "skipped and counted in the log; training runs on the others"),
}


# --- hostile inputs: checkpoint files written by an attacker or left by a flaky file system --------------------
NAMES, PICKLE, TOCTOU, COMPLETE, AGREE = ("names and file kinds", "metadata pickle", "checked = loaded",
                                          "saved = complete", "agreement and lock")
_NAME = "the check refuses it naming the entry, before any byte of it is read (a resume then treats the " \
        "checkpoint as damaged: set aside, nothing deleted)"
# test id (tests/checkpoint/) -> (class, attack, what the trainer does); every one leaves every file in place
HOSTILE: dict[str, tuple[str, str, str]] = {
    **{f"test_metadata_pickle_cannot_change_a_shared_object[{k}]": (PICKLE, attack, "refused by the .metadata "
       "unpickler (BUILD only on objects the load created, SETITEM/APPEND only on plain containers); the object "
       "is unchanged after the refusal") for k, attack in (
        ("class attribute", "a .metadata whose BUILD sets an attribute on an allowed class (PosixPath)"),
        ("function attribute", "BUILD on an allowed function (torch.serialization._get_layout)"),
        ("enum member", "BUILD on an enum member (a process-wide singleton) made by REDUCE"),
        ("change then refused global", "BUILD on an allowed class, then a refused global (the change made "
         "before the refusal)"),
        ("setitem on a class", "SETITEM on an allowed class"))},
    **{f"test_manifest_entries_outside_the_folder_or_not_regular_files_are_refused[{k}]": (NAMES, attack, _NAME)
       for k, attack in (
        ("absolute path", "a manifest entry with an absolute path to a file outside (size and checksum forged to "
         "match)"),
        ("dot-dot", "a manifest entry ../../outside.bin (size and checksum match)"),
        ("symlink out", "a manifest entry that is a symlink to a file outside the folder (checksum matches)"),
        ("/dev/zero", "a manifest entry naming /dev/zero (size 0: the old check read it forever)"),
        ("symlink to /dev/zero", "a symlink in the folder to /dev/zero"),
        ("FIFO", "a FIFO in the folder named by the manifest (the old check blocked in open)"),
        ("directory", "a manifest entry naming a directory"))},
    **{f"test_dcp_storage_paths_outside_the_folder_are_refused[{k}]": (
        NAMES, f"DCP's .metadata pointing a shard at {k} (manifest forged to match)",
        "refused: the metadata points outside the checkpoint folder; set aside, nothing read outside")
       for k in ("../outside.distcp", "/etc/hostname", "sub/__0_0.distcp")},
    "test_oversized_json_files_are_refused_without_reading_them[COMPLETE]": (
        NAMES, "a 2 GiB COMPLETE manifest (sparse)", "refused by its size cap (64 MiB) without reading it"),
    "test_oversized_json_files_are_refused_without_reading_them[train_state.json]": (
        NAMES, "an 80 MiB train_state.json listed in the manifest", "refused by its size cap without parsing it"),
    **{f"test_bytes_changed_between_the_check_and_the_load_are_refused[{k}]": (
        TOCTOU, f"{what} changed after the start-up check passed, before the load",
        "the load hashes the bytes it uses: refused (exit 2) naming the file, nothing of it loaded; "
        "no checkpoint deleted") for k, what in (
        ("shard", "one byte of the model/optimizer shard"), ("rank file", "one byte of the per-rank state"),
        ("train_state.json", "the step in train_state.json"))},
    **{f"test_forged_train_state_field_is_named[{k}]": (
        AGREE, f"train_state.json with a forged {k} (manifest forged to match), in every checkpoint",
        "exit 2 naming the file and the field; no traceback; nothing deleted") for k in (
        "world_size", "step", "scheduler", "config")},
    "test_manifest_lists_every_file_dcp_wrote_even_if_the_listing_misses_one": (
        COMPLETE, "the directory listing misses the shard while the save is checksummed",
        "the manifest lists what DCP reports it wrote: complete, and the next check passes"),
    "test_a_manifest_that_misses_a_file_of_the_metadata_fails_the_save": (
        COMPLETE, "the manifest lacks a shard that .metadata points into",
        "the save fails on every rank (exit 2) naming the shard; no COMPLETE is written"),
    "test_step_folder_without_complete_is_named_and_kept": (
        COMPLETE, "a step_6 folder without COMPLETE (copied by hand) where the run will save step 6",
        "named at start-up; renamed step_6.incomplete before the save, its files kept"),
    "test_transient_io_error_during_the_check_is_retried": (
        COMPLETE, "EIO twice while checksumming the latest shard",
        "retried (logged), the sound checkpoint is used, nothing set aside"),
    "test_checkpoint_dir_that_cannot_be_listed_stops_instead_of_starting_over": (
        COMPLETE, "the checkpoint folder cannot be listed (EIO)",
        "exit 2 naming the folder instead of starting over from step 0; nothing changed"),
    "test_second_job_on_the_same_checkpoint_dir_is_refused_naming_the_holder": (
        AGREE, "a second job on a checkpoint folder held by a live job; then that job dies",
        "exit 2 naming the holder's Slurm job id, host and pid; once the holder is dead the stale lock is "
        "taken over with a warning"),
    "test_lock_of_another_host_is_not_judged_stale_and_says_how_to_remove_it": (
        AGREE, "a lock held by a job on another host", "exit 2 naming that host and the file to remove by hand "
        "if the job is gone"),
    "test_the_same_slurm_job_requeued_takes_its_lock_back": (
        AGREE, "the lock of this same Slurm job before a requeue (another host, dead pid)",
        "taken back with a warning; the run resumes"),
    **{f"test_every_checkpoint_damaged_on_two_ranks_ends_in_the_agreed_exit[{k}]": (
        AGREE, f"2 ranks, every checkpoint damaged ({what})",
        "every rank exits 2 together (no SIGABRT); one message; checkpoints renamed *.broken, none deleted")
       for k, what in (("__1_0.distcp", "rank 1's shard"), ("rank1.safetensors", "rank 1's state file"),
                       ("COMPLETE", "the manifest"))},
}
HOSTILE_ROWS_FILE = ROWS_FILE.with_name("llama-fp8-hostile.json")
BEGIN, END = "<!-- hostile inputs: generated from tests/checkpoint/ -->", "<!-- end of hostile inputs -->"


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock beside ``path`` (two test workers, `make test`'s -n 2, record rows at once: each
    read-modify-write of the rows file is whole, or a row recorded meanwhile would be lost)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def record_hostile(test_id: str, observed: str) -> None:
    """Store a passing hostile-input test's observation (replacing that test's earlier row)."""
    assert test_id in HOSTILE, f"{test_id} is not in tests/reliability/matrix.py HOSTILE"
    with _locked(HOSTILE_ROWS_FILE):
        _record_hostile(test_id, observed)


def _record_hostile(test_id: str, observed: str) -> None:
    rows = json.loads(HOSTILE_ROWS_FILE.read_text()) if HOSTILE_ROWS_FILE.is_file() else {}
    observed = re.sub(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/[^/\s]+/", "", observed).replace("|", "/")
    rows[test_id] = {"observed": " ".join(observed.split())[:300],
                     "when": datetime.datetime.now().isoformat(timespec="seconds")}
    HOSTILE_ROWS_FILE.parent.mkdir(parents=True, exist_ok=True)
    tmp = HOSTILE_ROWS_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1, sort_keys=True))
    tmp.replace(HOSTILE_ROWS_FILE)


def render_hostile() -> str:
    rows = json.loads(HOSTILE_ROWS_FILE.read_text()) if HOSTILE_ROWS_FILE.is_file() else {}
    missing = [k for k in HOSTILE if k not in rows]
    if missing:
        raise SystemExit(f"no recorded result for {len(missing)} hostile-input rows (run tests/checkpoint first): "
                         f"{missing[:5]}")
    lines = [BEGIN, "## Hostile inputs", "",
             f"Checkpoint files written by an attacker or left by a flaky file system: every row is a test in "
             f"tests/checkpoint/ that plants the file (or the fault) and asserts the outcome. {len(HOSTILE)} "
             f"attacks, all refused or handled with a message naming the file; in none was a checkpoint deleted "
             f"or overwritten. Results as of {max(r['when'] for r in rows.values())[:10]}.", "",
             "| class | attack | what the trainer does | observed | test |", "|---|---|---|---|---|"]
    for key, (kind, attack, expected) in HOSTILE.items():
        lines.append(f"| {kind} | {attack} | {expected} | {rows[key]['observed']} | `{key}` |".replace("\n", " "))
    return "\n".join([*lines, "", END]) + "\n"


def with_hostile(doc: str, kept: str | None = None) -> str:
    """``doc`` with its hostile-inputs section replaced (or put before the decisions); ``kept``: the section to put
    there instead of one rendered from recorded rows."""
    section = kept or render_hostile()
    if BEGIN in doc and END in doc:
        return doc[:doc.index(BEGIN)] + section + doc[doc.index(END) + len(END) + 1:]
    cut = doc.index("## What was decided") if "## What was decided" in doc else len(doc)
    return doc[:cut] + section + "\n" + doc[cut:]


def record(test_id: str, observed: str, steps_lost: int | None) -> None:
    """Store a passing test's row (replacing that test's earlier row)."""
    assert test_id in MATRIX, f"{test_id} is not in tests/reliability/matrix.py MATRIX"
    with _locked(ROWS_FILE):
        _record(test_id, observed, steps_lost)


def _record(test_id: str, observed: str, steps_lost: int | None) -> None:
    rows = load_rows()
    observed = re.sub(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/[^/\s]+/", "", observed).replace("|", "/")
    rows[test_id] = {"observed": observed, "steps_lost": steps_lost,
                     "when": datetime.datetime.now().isoformat(timespec="seconds")}
    ROWS_FILE.parent.mkdir(parents=True, exist_ok=True)
    tmp = ROWS_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1, sort_keys=True))
    tmp.replace(ROWS_FILE)


def load_rows() -> dict[str, dict]:
    return json.loads(ROWS_FILE.read_text()) if ROWS_FILE.is_file() else {}


def summary(rows: dict[str, dict]) -> dict[str, int]:
    kinds = {k: MATRIX[k][0] for k in rows if k in MATRIX}
    lost = [r["steps_lost"] for k, r in rows.items() if kinds.get(k) == FAULT and r["steps_lost"] is not None]
    return {"faults_injected": sum(v == FAULT for v in kinds.values()),
            "faults_survived": sum(v == FAULT for v in kinds.values()),  # a row exists only for a passing test
            "max_steps_lost": max(lost, default=0), "total_steps_lost": sum(lost),
            "bad_inputs_tried": sum(v == BAD_INPUT for v in kinds.values()),
            "resume_changes_tried": sum(v == CHANGE for v in kinds.values())}


def headline(s: dict[str, int]) -> str:
    return (f"{s['faults_injected']} faults injected, {s['faults_survived']} survived (at most "
            f"{s['max_steps_lost']} optimizer steps lost, always at most the steps since the last checkpoint); "
            f"{s['bad_inputs_tried']} bad inputs tried, all refused or skipped with a message naming them; "
            f"{s['resume_changes_tried']} resume changes, each working or refused before training")


def from_doc(doc: Path) -> dict[str, dict]:
    """The rows the rendered doc holds (observed, steps lost), as recorded rows dated by the doc."""
    text = doc.read_text() if doc.is_file() else ""
    when = re.search(r"Results as of (\d{4}-\d{2}-\d{2})", text)
    out = {}
    for _, _, observed, lost, key in re.findall(r"^\| (.+?) \| (.+?) \| (.+?) \| (\d+|-) \| `(.+?)` \|$", text, re.M):
        if key in MATRIX:
            out[key] = {"observed": observed, "steps_lost": None if lost == "-" else int(lost),
                        "when": when.group(1) if when else "unknown"}
    return out


def hostile_section(doc: Path) -> str | None:
    """The doc's hostile-inputs section as it is, when this machine has not recorded every hostile row."""
    recorded = json.loads(HOSTILE_ROWS_FILE.read_text()) if HOSTILE_ROWS_FILE.is_file() else {}
    text = doc.read_text() if doc.is_file() else ""
    if all(k in recorded for k in HOSTILE) or BEGIN not in text or END not in text:
        return None
    return text[text.index(BEGIN):text.index(END) + len(END)] + "\n"


def render(rows: dict[str, dict], kept_hostile: str | None = None) -> str:
    missing = [k for k in MATRIX if k not in rows]
    if missing:
        raise SystemExit(f"no recorded result for {len(missing)} matrix rows (run them first): {missing[:5]}")
    when = max(r["when"] for r in rows.values())
    lines = ["# Reliability: the fault matrix", "",
             "<!-- generated by tests/reliability/matrix.py from the recorded test results: do not edit -->", "",
             f"Every row is a test that injects the fault into a real training run and asserts the outcome "
             f"(tests/reliability/, tests/cluster/test_faults_slurm.py, tests/cluster/test_spares_slurm.py). "
             f"Results as of {when[:10]} on "
             f"{platform.machine()} Linux, Python {platform.python_version()}. **{headline(summary(rows))}.**", "",
             "Steps lost: optimizer steps that had completed before the fault and had to be trained again "
             "after the resume (checkpoints every 2 steps in these runs). Bitwise: the losses of every step "
             "after the resume and the final model and optimizer shards equal the uninterrupted run's.", ""]
    for kind, title in ((FAULT, "Faults"), (BAD_INPUT, "Bad inputs"), (CHANGE, "Resuming with changed settings")):
        lines += [f"## {title}", "", "| fault | expected | observed | steps lost | test |", "|---|---|---|---|---|"]
        for key, (k, fault, expected) in MATRIX.items():
            if k == kind:
                r = rows[key]
                lost = "-" if r["steps_lost"] is None else str(r["steps_lost"])
                lines.append(f"| {fault} | {expected} | {r['observed']} | {lost} | `{key}` |".replace("\n", " "))
        lines.append("")
    return with_hostile("\n".join(lines) + "\n" + (DECISIONS.read_text() if DECISIONS.is_file() else ""), kept_hostile)


DECISIONS = Path(__file__).with_name("decisions.md")
"""The prose after the table (what was decided and why), kept next to the matrix it explains."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Render docs/reliability.md from the recorded matrix rows.")
    p.add_argument("--out", default=str(REPO / "docs" / "reliability.md"))
    p.add_argument("--keep_unrecorded", action="store_true",
                   help="rows this machine has not recorded keep what --out says (run only the rows you changed)")
    p.add_argument("--hostile_only", action="store_true",
                   help="replace only the hostile-inputs section of --out (from tests/checkpoint/ results)")
    args = p.parse_args(argv)
    if args.hostile_only:  # the hostile-inputs table and the decisions after it; the fault rows stay as they are
        doc = with_hostile(Path(args.out).read_text())
        cut = doc.index("## What was decided") if "## What was decided" in doc else len(doc)
        Path(args.out).write_text(doc[:cut] + (DECISIONS.read_text() if DECISIONS.is_file() else ""))
        print(f"wrote the hostile-inputs section of {args.out}: {len(HOSTILE)} rows")
        return 0
    rows = {**from_doc(Path(args.out)), **load_rows()} if args.keep_unrecorded else load_rows()
    Path(args.out).write_text(render(rows, hostile_section(Path(args.out)) if args.keep_unrecorded else None))
    print(f"wrote {args.out}: {headline(summary(rows))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
