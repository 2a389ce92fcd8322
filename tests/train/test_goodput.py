"""Goodput: a real run's wall time split into parts that add up to it; a resumed run charges the steps it
redoes to restart loss."""

from __future__ import annotations

import shutil
import time

import pytest

from helpers import read_metrics, run_cli
from llama_fp8.telemetry import goodput


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
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "meta", "repro": {"slurm_job_id": "42", "elastic_run_id": "abc"}}\n{"type": "train"}\n')
    assert goodput.written_by_this_job(path, {"SLURM_JOB_ID": "42"})
    assert goodput.written_by_this_job(path, {"TORCHELASTIC_RUN_ID": "abc"})
    assert not goodput.written_by_this_job(path, {"SLURM_JOB_ID": "43", "TORCHELASTIC_RUN_ID": "xyz"})
    assert not goodput.written_by_this_job(path, {})  # no ids on either side: another run's, refused
    path.write_text('{"type": "meta", "repro": {"slurm_job_id": null}}\n')
    assert not goodput.written_by_this_job(path, {"SLURM_JOB_ID": ""})
    path.write_bytes(b"\xff garbage")
    assert not goodput.written_by_this_job(path, {"SLURM_JOB_ID": "42"})
    assert not goodput.written_by_this_job(tmp_path / "missing.jsonl", {"SLURM_JOB_ID": "42"})
