"""Goodput: a real run's wall time split into parts that add up to it; a resumed run charges the steps it
redoes to restart loss."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from helpers import REPO, cli_env, read_metrics, run_cli
from llama_fp8.telemetry import goodput


@pytest.mark.slow
def test_goodput_parts_add_up_to_wall_time_and_resume_counts_restart_loss(tiny_args, tmp_path):
    args = [*tiny_args, "--max_steps", "12", "--logging_freq", "4", "--validation_freq", "4",
            "--validation_batches", "2", "--checkpoint_freq", "6", "--keep_last_k", "3"]
    t0 = time.time()
    proc = run_cli(["train", *args])
    external = time.time() - t0
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "run"
    recs = read_metrics(run_dir)
    (g,) = [r for r in recs if r["type"] == "goodput"]
    parts = {k: g[f"{k}_s"] for k in goodput.PARTS}
    assert sum(parts.values()) == pytest.approx(g["wall_s"], rel=0.02)      # nothing lost, nothing twice
    assert 0 < g["wall_s"] <= external                                       # from process start, not before
    for k in ("startup", "warmup", "productive", "evaluation", "checkpoint_sync"):
        assert parts[k] > 0, k
    assert parts["restart_loss"] == 0 and parts["checkpoint_async"] == 0 and g["step"] == 12
    assert (g["saves"], g["ended"]) == (2, "finished")                       # saves at steps 6 and 12
    assert g["goodput"] == pytest.approx(parts["productive"] / g["wall_s"])
    assert "Goodput: " in proc.stdout and f"{100 * g['goodput']:.1f} % of" in proc.stdout
    running = [r["goodput"] for r in recs if r["type"] == "train"]
    assert running[0] == 0 and 0 < running[-1] < 1   # the first window is warm-up: nothing productive yet

    # lose the last checkpoint: the next attempt resumes from step 6 and redoes 7..12, already logged
    shutil.rmtree(run_dir / "checkpoints" / "step_12")
    proc = run_cli(["train", *args])
    assert proc.returncode == 0, proc.stderr
    first, second = [r for r in read_metrics(run_dir) if r["type"] == "goodput"]
    assert first == g and second["start_step"] == 6 and second["restart_loss_s"] > 0
    assert second["productive_s"] == 0 and second["warmup_s"] == 0   # every step was a redo


def test_the_process_start_is_read_to_the_kernels_tick_not_the_boot_times_second():
    """The start of a fresh process lies between the moment it was asked for and its first line. Before, the start was
    the boot time (whole seconds in /proc/stat) plus the process's start ticks: up to a second early (0.43 s on this
    project's machine), a goodput wall longer than the process's life."""
    code = ("import time\nfirst = time.time()\nfrom llama_fp8.telemetry import goodput\n"
            "print(first, goodput.process_start_time())")
    asked = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=True)
    first, start = map(float, out.stdout.split())
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert asked - tick <= start <= first + tick, (asked, start, first)


def test_last_logged_step_reads_only_the_tail_and_survives_junk(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert goodput.last_logged_step(path) == 0   # no file
    path.write_text('{"type": "train", "step": 3}\nnot json\n{"type": "val", "step": 9}\n'
                    '{"type": "train", "step": 7}\n[1, 2]\n{"type": "train", "step": "8"}\n{"type": "tr')
    assert goodput.last_logged_step(path) == 7
    assert goodput.last_logged_step(path, max_bytes=100) == 7 and goodput.last_logged_step(path, max_bytes=40) == 0


def test_first_log_step():
    assert goodput.first_log_step(0, 5, 100) == 5 and goodput.first_log_step(6, 5, 100) == 10
    assert goodput.first_log_step(98, 5, 99) == 99 and goodput.first_log_step(10, 5, 100) == 15


def test_restart_gaps_measure_last_step_before_to_first_step_after():
    recs = [{"type": "meta"}, {"type": "train", "step": 1, "time": 10.0}, {"type": "train", "step": 2, "time": 11.0},
            {"type": "goodput"}, {"type": "meta"}, {"type": "train", "step": 2, "time": 19.5},
            {"type": "train", "step": 3, "time": 20.0}, {"type": "meta"}, {"type": "train", "step": 3},
            {"type": "train", "step": 4, "time": 26.0}]
    assert goodput.restart_gaps(recs) == [8.5, 6.0]
    assert goodput.restart_gaps(recs[:3]) == []  # one attempt: no restart


def test_a_planned_stop_is_not_a_restart():
    """An attempt that ended on SIGUSR1/SIGTERM (a time limit, a preemption: its goodput record says so) was
    requeued on purpose; the hours it may have waited in the queue are not time lost to a failure."""
    recs = [{"type": "meta"}, {"type": "train", "step": 1, "time": 10.0}, {"type": "goodput", "ended": "signal"},
            {"type": "meta"}, {"type": "train", "step": 2, "time": 7210.0}, {"type": "train", "step": 3, "time": 7211.0},
            {"type": "goodput", "ended": "failed"}, {"type": "meta"}, {"type": "train", "step": 3, "time": 7220.0}]
    assert goodput.restart_gaps(recs) == [9.0]


def test_checkpoint_interval_is_youngs_to_first_order_and_daly_beyond():
    young = (2 * 10 * 3600) ** 0.5
    daly = goodput.checkpoint_interval(10, 3600)
    assert daly == pytest.approx(young * (1 + (10 / 7200) ** 0.5 / 3 + 10 / 7200 / 9) - 10)
    assert young - 10 < daly < young
    # as the save gets cheap relative to the MTBF, Daly -> Young
    assert goodput.checkpoint_interval(0.01, 86400) == pytest.approx((2 * 0.01 * 86400) ** 0.5, rel=1e-3)
    # a save as long as two MTBFs: checkpoint once per MTBF
    assert goodput.checkpoint_interval(7200, 3600) == 3600
    # the interval Daly gives maximizes the expected useful fraction (numerically, within 1 %)
    def useful(t, d=30.0, m=6 * 3600.0, r=60.0):
        return t / (t + d) * (1 - goodput.expected_loss_per_failure(t + d, r) / m)
    best = max(range(60, 7200, 5), key=useful)
    assert goodput.checkpoint_interval(30, 6 * 3600) == pytest.approx(best, rel=0.05)
    with pytest.raises(ValueError):
        goodput.checkpoint_interval(0, 3600)
    assert goodput.expected_loss_per_failure(600, 20) == 320


def test_written_by_this_job_reads_the_first_meta_record(tmp_path):
    """A run dir with metrics.jsonl and no checkpoint is taken over only by a later attempt of the job that
    wrote it: a restart inside the allocation (attempt > 0 of the same torchrun run id) or a requeue of the same
    Slurm job (SLURM_RESTART_COUNT > 0). A first attempt never is, whatever its ids."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "meta", "repro": {"slurm_job_id": "42", "elastic_run_id": "abc"}}\n{"type": "train"}\n')
    assert goodput.written_by_this_job(path, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"})  # a requeue
    # the batch script started the training step again in the allocation (a spare for a node left behind)
    assert goodput.written_by_this_job(path, {"SLURM_JOB_ID": "42", goodput.STEP_AGAIN_ENV: "1"})
    assert not goodput.written_by_this_job(path, {"SLURM_JOB_ID": "43", goodput.STEP_AGAIN_ENV: "1"})
    assert goodput.written_by_this_job(path, {"TORCHELASTIC_RUN_ID": "abc", "LLAMA_FP8_ATTEMPT": "1"})
    assert goodput.written_by_this_job(path, {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert not goodput.written_by_this_job(path, {"SLURM_JOB_ID": "43", "TORCHELASTIC_RUN_ID": "xyz",
                                                  "SLURM_RESTART_COUNT": "1", "LLAMA_FP8_ATTEMPT": "1"})
    assert not goodput.written_by_this_job(path, {})  # no ids on either side: another run's, refused
    # a second run in one allocation (salloc, an sbatch running two trainings): same job id, not requeued
    assert not goodput.written_by_this_job(path, {"SLURM_JOB_ID": "42"})
    assert not goodput.written_by_this_job(path, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "0"})
    # the same --rdzv_id again, in a new launch (its first attempt)
    assert not goodput.written_by_this_job(path, {"TORCHELASTIC_RUN_ID": "abc", "LLAMA_FP8_ATTEMPT": "0"})
    # torchrun's default run id is "none" for every run without --rdzv_id (static or multi-node)
    path.write_text('{"type": "meta", "repro": {"slurm_job_id": null, "elastic_run_id": "none"}}\n')
    assert not goodput.written_by_this_job(path, {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"})
    assert not goodput.written_by_this_job(path, {"SLURM_JOB_ID": "", "SLURM_RESTART_COUNT": "1"})
    path.write_bytes(b"\xff garbage")
    assert not goodput.written_by_this_job(path, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"})
    assert not goodput.written_by_this_job(tmp_path / "missing.jsonl", {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"})


@pytest.mark.slow
def test_a_second_torchrun_without_a_run_id_is_refused_the_first_ones_run_dir(tmp_path):
    """Two plain multi-node-style torchrun runs (c10d rendezvous, no --rdzv_id: torchrun's run id "none" for
    both) into one --run_dir: the second stops before writing anything (its config.yaml and metrics.jsonl are the
    first run's, kept byte for byte), as a second run with any other launcher is."""
    def torchrun():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "-m", "llama_fp8", "train",
               "--model", "tiny", "--device", "cpu", "--num_layers", "1", "--max_context_width", "16",
               "--train_batch_size", "1", "--max_steps", "1", "--checkpoint_freq", "0", "--run_dir",
               str(tmp_path / "run")]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240, env=cli_env())

    first = torchrun()
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    second = torchrun()
    assert second.returncode != 0 and "already holds metrics.jsonl" in second.stderr, second.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()} == before
