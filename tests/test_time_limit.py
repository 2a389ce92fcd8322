"""The time limit's lead against the save time (telemetry/time_limit.py): the rule, the warning at start (the save
time the resumed checkpoint recorded), after the first save (measured), in the estimate (predicted), and the lead
the batch script finds."""

from __future__ import annotations

import subprocess

import pytest

from helpers import REPO
from llama_fp8.telemetry import time_limit


def test_the_rule_and_the_suggested_interval():
    assert time_limit.lead_needed(100.0, 5.0) == 5.0 + 150.0 + 30.0
    assert time_limit.parse_signal("USR1@120") == 120 and time_limit.parse_signal("B:USR1@90") == 90
    assert time_limit.parse_signal("USR1") == 60 and time_limit.parse_signal("nonsense @") is None
    assert time_limit.check(600.0, 100.0, 5.0, "measured") is None  # 600 >= 185: long enough
    line = time_limit.check(120.0, 300.0, 2.0, "the save of step_10", limit_s=4 * 3600)
    assert "comes 120 s before the end" in line and "a save takes 300 s (the save of step_10)" in line
    assert "--signal=USR1@482" in line and "TIMEOUT, which it does not requeue" in line
    every = time_limit.suggested_interval_s(300.0, 4 * 3600)
    assert f"--checkpoint_freq {round(every / 2.0)}" in line
    assert time_limit.check(None, 300.0, 2.0, "x") is None and time_limit.check(120.0, None, 2.0, "x") is None
    assert time_limit.predicted_save_s(840e9 / 16) == pytest.approx(52.5)  # 70B's FP32 state over 16 nodes at 1 GB/s
    assert time_limit.limit_from_env({"SLURM_JOB_START_TIME": "100", "SLURM_JOB_END_TIME": "3700"}) == 3600
    assert time_limit.limit_from_env({time_limit.LIMIT_ENV: "7200"}) == 7200
    assert time_limit.lead_from_env({time_limit.LEAD_ENV: "120"}) == 120 and time_limit.lead_from_env({}) is None


@pytest.mark.slow
def test_the_estimate_predicts_the_save_and_warns_on_a_short_lead(capsys, monkeypatch):
    from llama_fp8.estimate import cli

    tiny = ["--model", "tiny", "--num_layers", "2", "--max_context_width", "128", "--train_batch_size", "2",
            "--model_impl", "hf", "--suggest", "0"]
    assert cli.main(tiny) == 0
    out = capsys.readouterr().out
    assert "Checkpoint:" in out and "per node (parameters and optimizer states)" in out and "WARNING" not in out
    # a lead shorter than the rule's 30 s to exit (time_limit.EXIT_S) plus 1.5 x this tiny model's save: the same
    # path as a 70B checkpoint against a 120 s lead (before, this test estimated 70B: 40 s of CPU for one line)
    monkeypatch.setenv(time_limit.LEAD_ENV, "20")
    assert cli.main(tiny) == 0
    out = capsys.readouterr().out
    assert "WARNING: the time-limit warning comes 20 s before the end" in out, out[-2000:]
    assert "Submit with --signal=USR1@90" in out, out[-2000:]  # 30 s + 1.5 x (a save of ~0 s) + 60 s for a step


@pytest.mark.parametrize(("env", "header", "lead"), [
    ({"SIGNAL_LEAD_S": "300"}, "#SBATCH --signal=USR1@120", "300"),
    ({"SBATCH_SIGNAL": "B:USR1@240"}, "#SBATCH --signal=USR1@120", "240"),
    ({}, "#SBATCH --signal=USR1@120", "120"),
    ({}, "#SBATCH --signal=USR1", "60"),
    ({}, "", "none")])
def test_the_batch_script_finds_its_lead(tmp_path, env, header, lead):
    script = tmp_path / "job.sbatch"
    script.write_text(f"#!/bin/bash\n{header}\nset -euo pipefail\nsource {REPO}/scripts/slurm/job_lib.sh\n"
                      "lf_signal_lead\necho \"lead=${LLAMA_FP8_SIGNAL_LEAD_S:-none}\"\n")
    clean = {k: v for k, v in __import__("os").environ.items() if k not in ("SIGNAL_LEAD_S", "SBATCH_SIGNAL")}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={**clean, **env}, check=True)
    assert out.stdout.strip() == f"lead={lead}"
