"""One job, every precision: the schedule of N arms, the A/B preset, and the launchers that run them (the batch job
with Slurm faked, 2.ab_fp8_vs_bf16.sh with a fake sbatch). The two-arm behaviour: tests/report/test_schedule.py."""

from __future__ import annotations

import shlex
import subprocess

import pytest
from ab_fakes import fake_ab_job, fake_sbatch

from helpers import REPO
from llama_fp8.cluster.launch import ab_preset, schedule


def test_more_arms_interleave_reversed_per_repeat_with_one_seed_and_their_recipe():
    runs = schedule.plan(2, ("bf16", "fp8", "mxfp8", "nvfp4"), seed=5)
    assert [(r.pair, r.name, r.seed) for r in runs] == [
        (1, "bf16", 5), (1, "fp8", 5), (1, "mxfp8", 5), (1, "nvfp4", 5),
        (2, "nvfp4", 6), (2, "mxfp8", 6), (2, "fp8", 6), (2, "bf16", 6)]
    assert [r.flags() for r in runs[:4]] == [[], [], ["--fp8_recipe=mxfp8"], ["--fp8_recipe=nvfp4"]]
    assert [r.fp8 for r in runs[:4]] == [0, 1, 1, 1]
    assert schedule.compare_dirs(runs) == [f"pair{i}/{a}" for i in (1, 2) for a in ("bf16", "fp8", "mxfp8", "nvfp4")]
    one = schedule.plan(1, ("bf16", "mxfp8"), seed=0)
    assert [r.subdir for r in one] == ["pair1/bf16", "pair1/mxfp8"]  # only bf16 + fp8 keep the flat layout


@pytest.mark.parametrize("arms, message", [
    ("fp8,mxfp8", "name bf16 (the baseline)"), ("bf16,bf16,fp8", "each once"), ("bf16,fp16", "fp16: not an arm"),
    ("bf16", "1 to 7 other arms")])
def test_bad_arms_are_refused_naming_the_valid_ones(arms, message, capsys):
    assert schedule.main(["--arms", arms]) == 2 and message in capsys.readouterr().err


def test_the_ab_preset_compiles_every_arm_alike_and_gathers_in_fp8_where_allowed(capsys):
    train = ["--model", "tiny"]
    own = {"bf16": None, "fp8": [], "rowwise": ["--fp8_recipe=rowwise"], "mxfp8": ["--fp8_recipe=mxfp8"]}
    got = ab_preset.arm_flags(own, train)
    assert got == {"bf16": ["--compile=1"], "fp8": ["--compile=1", "--fp8_all_gather=1"], "rowwise": ["--compile=1"],
                   "mxfp8": ["--compile=1"]}
    err = capsys.readouterr().err
    assert "torchao mxfp8, torchao rowwise, torchao tensorwise need torch.compile" in err
    assert "arm rowwise: FP8 all-gather off: torchao rowwise all-gathers in BF16" in err
    assert "arm fp8: --fp8_all_gather=1 (torchao tensorwise all-gathers its weights in FP8)" in err
    # what the flags name is left as given
    assert ab_preset.arm_flags(own, [*train, "--compile", "0", "--fp8_all_gather=0"]) == {a: [] for a in own}
    with pytest.raises(ValueError, match="the training flags: --fp8_backend te does not work with --model_impl hf"):
        ab_preset.arm_flags(own, [*train, "--fp8_backend", "te"])


@pytest.mark.slow
def test_the_batch_job_runs_every_arm_with_its_flags_and_reports_them_together(tmp_path):
    job, base = fake_ab_job(tmp_path)
    ab = tmp_path / "ab"
    ab.mkdir()
    env = {**base, "AB_DIR": str(ab), "AB_REPEATS": "2", "AB_ARMS": "bf16,tensorwise,mxfp8", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "n1"}
    proc = subprocess.run(["bash", str(job), "--model", "tiny", "--seed", "10"],
                          env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [shlex.split(line) for line in (ab / "train.calls").read_text().splitlines()]
    got = [(c[-1].removeprefix(f"--run_dir={ab}/"), c[-3], c[-2], "--fp8_recipe=mxfp8" in c, "--compile=1" in c)
           for c in calls]
    assert got == [("pair1/bf16", "--fp8=0", "--seed=10", False, True),
                   ("pair1/tensorwise", "--fp8=1", "--seed=10", False, True),
                   ("pair1/mxfp8", "--fp8=1", "--seed=10", True, True),
                   ("pair2/mxfp8", "--fp8=1", "--seed=11", True, True),
                   ("pair2/tensorwise", "--fp8=1", "--seed=11", False, True),
                   ("pair2/bf16", "--fp8=0", "--seed=11", False, True)]
    assert "--fp8_all_gather=1" in calls[1] and "--fp8_all_gather=1" not in calls[2]  # tensorwise only
    assert "A/B preset: --compile=1 for every arm" in proc.stderr
    compare = (ab / "compare.calls").read_text().split()
    assert compare[compare.index("--arms") + 1] == "3"
    dirs = compare[compare.index("compare") + 1:compare.index("--arms")]
    assert dirs == [f"{ab}/pair{i}/{a}" for i in (1, 2) for a in ("bf16", "tensorwise", "mxfp8")]


def test_the_ab_script_takes_the_arms_for_one_job_or_one_job_each(tmp_path):
    env = fake_sbatch(tmp_path, "AB_ARMS")
    proc = subprocess.run([str(REPO / "2.ab_fp8_vs_bf16.sh"), "--arms", "bf16,fp8,mxfp8", "--repeats", "2", "--model",
                           "tiny"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sbatch.calls").read_text().startswith("AB_ARMS=bf16,fp8,mxfp8 ")
    cmd = shlex.split((tmp_path / "ab" / "ab_command.sh").read_text().splitlines()[1])
    assert cmd[-6:] == ["--repeats", "2", "--arms", "bf16,fp8,mxfp8", "--model", "tiny"]
    (tmp_path / "sbatch.calls").unlink()
    proc = subprocess.run([str(REPO / "2.ab_fp8_vs_bf16.sh"), "--arms=bf16,mxfp8,nvfp4", "--model", "tiny"],
                          env={**env, "AB_MODE": "two-jobs"}, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "sbatch.calls").read_text().splitlines()
    assert [c.split("--job-name=llama-fp8-")[1].split()[0] for c in calls[:3]] == ["bf16", "mxfp8", "nvfp4"]
    assert "--fp8_recipe=nvfp4 --fp8=1" in calls[2] and calls[0].rstrip().endswith(f"--fp8=0 --run_dir={tmp_path}/ab/bf16")
    report = calls[3]
    assert "--dependency=afterany:101:101:101" in report and "--arms 3" in report
    for bad in (["--arms", "fp8,mxfp8"], ["--arms", "bf16"], ["--arms", "bf16;rm,fp8"]):
        proc = subprocess.run([str(REPO / "2.ab_fp8_vs_bf16.sh"), *bad, "--model", "tiny"], env=env, cwd=tmp_path,
                              capture_output=True, text=True)
        assert proc.returncode == 2 and "--arms" in proc.stderr
