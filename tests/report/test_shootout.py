"""The recipe shoot-out: its arms on a CPU (cluster/launch/shootout.py), their schedule, and the call the ranking makes
from the arms' iso-loss intervals (report/shootout.py). The report of a real shoot-out of emulated arms:
tests/report/test_arms.py."""

from __future__ import annotations

import pytest
import torch

from llama_fp8.cluster.launch import schedule, shootout
from llama_fp8.report import shootout as ranking


def test_on_a_cpu_the_shootout_runs_bf16_and_the_emulated_torchao_recipes(capsys):
    arms = shootout.arms(["--model", "tiny"], torch.device("cpu"))
    assert [(a.name, a.fp8) for a in arms] == [("bf16", False), ("tensorwise", True), ("rowwise", True),
                                                 ("mxfp8", True)]
    assert arms[1].flags == ("--fp8_recipe=tensorwise", "--model_impl=hf")
    err = capsys.readouterr().err
    assert "current left out: --model_impl te runs Transformer Engine's CUDA kernels" in err
    assert "delayed left out" in err and "arms bf16, tensorwise, rowwise, mxfp8" in err


def test_the_shootout_schedule_interleaves_its_arms_with_their_flags(capsys):
    assert schedule.main(["--repeats", "2", "--arms", "shootout", "--order", "shootout", "--", "--model", "tiny",
                          "--device", "cpu", "--seed", "3"]) == 0
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    assert [ln[:3] for ln in lines] == [["pair1/bf16", "0", "3"], ["pair1/tensorwise", "1", "3"],
                                        ["pair1/rowwise", "1", "3"], ["pair1/mxfp8", "1", "3"],
                                        ["pair2/mxfp8", "1", "4"], ["pair2/rowwise", "1", "4"],
                                        ["pair2/tensorwise", "1", "4"], ["pair2/bf16", "0", "4"]]
    assert lines[2][3:] == ["--fp8_recipe=rowwise", "--model_impl=hf"] and lines[0][3:] == []
    assert schedule.main(["--repeats", "1", "--arms", "shootout", "--compare", "--", "--model", "tiny"]) == 0
    assert capsys.readouterr().out.split() == ["pair1/bf16", "pair1/tensorwise", "pair1/rowwise", "pair1/mxfp8"]


def test_bad_training_flags_are_refused_by_the_shootout(capsys):
    assert schedule.main(["--arms", "shootout", "--", "--model", "tiny", "--fp8_backend", "nope"]) == 2
    assert "error:" in capsys.readouterr().err


def entry(arm, point, low, high, baseline=False):
    return {"arm": arm, "label": arm, "baseline": baseline, "reached": point is not None, "point": point, "low": low,
            "high": high, "text": f"{point}x" if point else "not reached", "gap_pct": None if point else 0.3}


BASE = entry("bf16", 1.0, 1.0, 1.0, baseline=True)


@pytest.mark.parametrize("arms, winner, words", [
    ([entry("tensorwise", 1.25, 1.2, 1.3), entry("rowwise", 1.1, 1.05, 1.15)], "tensorwise",
     "tensorwise wins at equal quality (1.25x): its interval above every other arm's"),
    ([entry("tensorwise", 1.25, 1.12, 1.3), entry("rowwise", 1.1, 1.05, 1.15)], None,
     "cannot tell tensorwise (1.25x) from rowwise at equal quality"),
    ([entry("tensorwise", 1.05, 0.98, 1.1)], None, "cannot tell tensorwise (1.05x) from the baseline"),
    ([entry("tensorwise", 0.6, 0.55, 0.65), entry("mxfp8", 0.5, 0.45, 0.55)], "bf16",
     "the baseline wins at equal quality (1.0x): every candidate's interval below 1"),
    ([entry("tensorwise", None, None, None)], None, "no candidate reaches the baseline's final loss"),
])
def test_the_ranking_names_a_winner_only_when_its_interval_clears_every_other(arms, winner, words):
    got = ranking.rank([BASE, *arms])
    assert got["winner"] == winner and words in got["line"]
    reached = [e for e in got["order"] if e["reached"]]
    assert [e["point"] for e in reached] == sorted((e["point"] for e in reached), reverse=True)
    assert all(not e["reached"] for e in got["order"][len(reached):])  # not reached: last


def test_fp8_arms_run_extra_steps_on_the_baselines_lr_schedule(capsys):
    assert schedule.main(["--repeats", "1", "--arms", "bf16,tensorwise,mxfp8", "--extra_steps", "10", "--",
                          "--model", "tiny", "--max_steps", "100"]) == 0
    lines = {ln.split()[0]: ln.split()[3:] for ln in capsys.readouterr().out.splitlines()}
    assert lines["pair1/bf16"] == []
    assert lines["pair1/tensorwise"] == ["--fp8_recipe=tensorwise", "--max_steps=110", "--lr_decay_iters=100"]
    assert lines["pair1/mxfp8"][-2:] == ["--max_steps=110", "--lr_decay_iters=100"]
    assert schedule.steps_flags(25, ["--model", "tiny", "--max_steps", "10", "--lr_decay_iters", "8"]) == [
        "--max_steps=13", "--lr_decay_iters=8"]  # a schedule asked for is kept
    assert schedule.main(["--extra_steps", "101", "--", "--model", "tiny"]) == 2
    assert "--extra_steps 101: a percentage from 0 to 100" in capsys.readouterr().err


@pytest.mark.slow
def test_the_batch_job_runs_the_shootout_decided_on_its_node_and_ends_with_the_headline(tmp_path):
    """ab_job.sbatch with Slurm faked (tests/report/ab_fakes.py): AB_ARMS=shootout runs the arms its node decides
    (a CPU here), the FP8 ones AB_EXTRA_STEPS longer, compares them as 4 arms and prints the report's headline last."""
    import shlex
    import subprocess

    from ab_fakes import FAKE_SRUN, fake_ab_job

    ab = tmp_path / "ab"
    compare = 'echo "$*" >>"$AB_DIR/compare.calls"; '
    job, base = fake_ab_job(tmp_path, FAKE_SRUN.replace(
        compare + "exit 0",
        compare + 'mkdir -p "$AB_DIR/report"; echo "at equal quality: a call" >"$AB_DIR/report/headline.txt"; exit 0'))
    ab.mkdir()
    env = {**base, "AB_DIR": str(ab), "AB_REPEATS": "1", "AB_ARMS": "shootout", "AB_PRESET": "none",
           "AB_EXTRA_STEPS": "20", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}
    proc = subprocess.run(["bash", str(job), "--model", "tiny", "--max_steps", "10"],
                          env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [shlex.split(line) for line in (ab / "train.calls").read_text().splitlines()]
    runs = {c[-1].removeprefix(f"--run_dir={ab}/"): c for c in calls}
    assert list(runs) == ["pair1/bf16", "pair1/tensorwise", "pair1/rowwise", "pair1/mxfp8"]
    assert "--model_impl=hf" in runs["pair1/rowwise"] and "--max_steps=12" in runs["pair1/rowwise"]
    assert "--max_steps=12" not in runs["pair1/bf16"]
    compare = (ab / "compare.calls").read_text().split()
    assert compare[compare.index("--arms") + 1] == "4"
    assert proc.stdout.rstrip().splitlines()[-2:] == ["at equal quality: a call",
                                                      f"A/B finished: report {ab}/report/report.md"]


def test_the_ab_script_takes_the_shootout_and_extra_steps_and_records_them(tmp_path):
    import os
    import subprocess

    from helpers import REPO

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "AB_ARMS=$AB_ARMS AB_EXTRA_STEPS=$AB_EXTRA_STEPS $*" '
                                    f'>>{tmp_path}/sbatch.calls\necho 101\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "AB_DIR": str(tmp_path / "ab")}
    proc = subprocess.run([str(REPO / "2.ab_fp8_vs_bf16.sh"), "--arms", "shootout", "--extra_steps=15", "--model",
                           "tiny"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sbatch.calls").read_text().startswith("AB_ARMS=shootout AB_EXTRA_STEPS=15 ")
    assert "--arms shootout --extra_steps 15 --model tiny" in (tmp_path / "ab" / "ab_command.sh").read_text()
    for bad, words in ((["--extra_steps", "x"], "--extra_steps 'x'"),
                       (["--arms", "shootout"], "--arms shootout needs AB_MODE=same")):
        proc = subprocess.run([str(REPO / "2.ab_fp8_vs_bf16.sh"), *bad, "--model", "tiny"], cwd=tmp_path,
                              env={**env, "AB_MODE": "two-jobs"}, capture_output=True, text=True)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr


def test_publish_logs_the_iso_loss_speedups_beside_the_raw_ones():
    from llama_fp8 import publish

    two = {"speedup": 1.3, "equal_quality": {"train": {"speedup": {"point": 1.2}}}, "ab": {"pairs": 2}}
    assert publish._parent_numbers(two)[0]["iso_loss_speedup"] == 1.2
    arms = {"arms": [{"arm": "bf16"}, {"arm": "tensorwise", "speedup": 1.3}, {"arm": "rowwise", "speedup": 1.1}],
            "ranking": {"order": [entry("tensorwise", 1.25, 1.2, 1.3), BASE, entry("rowwise", None, None, None)]}}
    metrics = publish._parent_numbers(arms)[0]
    assert metrics["iso_loss_speedup_tensorwise"] == 1.25 and "iso_loss_speedup_rowwise" not in metrics  # not reached
    assert "iso_loss_speedup_bf16" not in metrics and "iso_loss_speedup" not in metrics
    assert publish._parent_numbers({"equal_quality": "half-written"})[0] == {}
