"""The repeated A/B's run order: interleaved pairs, alternating order, one seed per pair; the launchers
use it (2.ab_fp8_vs_bf16.sh --repeats with a fake sbatch, the batch job and the demo read the schedule)."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from ab_fakes import fake_ab_job, fake_sbatch

from helpers import REPO, cli_env
from llama_fp8.cluster.launch import schedule


def test_pairs_interleave_alternate_and_share_a_seed():
    runs = schedule.plan(4, ("bf16", "fp8"), seed=7)
    assert [(r.pair, r.name) for r in runs] == [(1, "bf16"), (1, "fp8"), (2, "fp8"), (2, "bf16"),
                                               (3, "bf16"), (3, "fp8"), (4, "fp8"), (4, "bf16")]
    for pair in range(1, 5):
        assert {r.seed for r in runs if r.pair == pair} == {7 + pair - 1}   # both arms, the same seed s_i
    assert [r.subdir for r in runs[:2]] == ["pair1/bf16", "pair1/fp8"] and runs[2].fp8 == 1
    assert schedule.compare_dirs(runs) == [f"pair{i}/{a}" for i in range(1, 5) for a in ("bf16", "fp8")]
    first = schedule.plan(2, ("fp8", "bf16"), seed=0)
    assert [r.name for r in first] == ["fp8", "bf16", "bf16", "fp8"]
    one = schedule.plan(1, seed=3)
    assert [(r.subdir, r.fp8, r.seed) for r in one] == [("bf16", 0, 3), ("fp8", 1, 3)]   # the old layout


def test_a_plain_ab_schedule_starts_without_torch():
    """The batch job and the demo run the schedule several times per A/B: reading flags needs no torch (its import
    was 1.6 s of each, the whole of its time); only the shoot-out's arms, decided by what this node runs, import it."""
    code = ("import sys; from llama_fp8.cluster.launch import schedule; "
            "schedule.main(['--repeats', '2', '--', '--model', 'tiny', '--seed', '3']); print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["pair1/bf16 0 3", "pair1/fp8 1 3", "pair2/fp8 1 4", "pair2/bf16 0 4", "False"]


def test_base_seed_from_train_flags_and_bad_values(capsys):
    assert schedule.base_seed(["--model", "tiny", "--seed", "5", "--seed=9"]) == 9
    assert schedule.base_seed(["--model", "tiny"]) == 42   # TrainConfig's default
    assert schedule.main(["--repeats", "0"]) == 2 and "between 1 and" in capsys.readouterr().err
    assert schedule.main(["--repeats", "2", "--order", "fp8 fp8"]) == 2 and "once each" in capsys.readouterr().err
    assert schedule.main(["--repeats", "2", "--", "--seed", "x"]) == 2 and "--seed 'x'" in capsys.readouterr().err
    assert schedule.main(["--repeats", "2", "--", "--seed", "10"]) == 0
    assert capsys.readouterr().out.split("\n")[:4] == ["pair1/bf16 0 10", "pair1/fp8 1 10", "pair2/fp8 1 11",
                                                       "pair2/bf16 0 11"]


def test_ab_script_passes_repeats_to_the_job_and_keeps_the_exact_command(tmp_path):
    env = fake_sbatch(tmp_path, "AB_REPEATS")
    proc = subprocess.run([str(REPO / "2.ab_fp8_vs_bf16.sh"), "--repeats", "3", "--model", "tiny", "--seed", "5"],
                          env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    call = (tmp_path / "sbatch.calls").read_text()
    assert call.startswith("AB_REPEATS=3 ") and call.rstrip().endswith("ab_job.sbatch --model tiny --seed 5")
    cmd = (tmp_path / "ab" / "ab_command.sh").read_text().splitlines()
    assert cmd[0] == f"cd {shlex.quote(str(tmp_path))}"
    assert shlex.split(cmd[1])[-6:] == ["--repeats", "3", "--model", "tiny", "--seed", "5"]


@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--repeats", "x"], ["--repeats"]])
def test_ab_script_refuses_a_bad_repeat_count(tmp_path, bad):
    env = fake_sbatch(tmp_path, "AB_REPEATS")
    proc = subprocess.run([str(REPO / "2.ab_fp8_vs_bf16.sh"), *bad, "--model", "tiny"], env=env, cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--repeats" in proc.stderr and not (tmp_path / "sbatch.calls").exists()


def test_launchers_take_their_order_and_seeds_from_the_schedule():
    """The batch job and the demo run what the schedule prints (SUBDIR FP8 SEED) and compare its folders."""
    for path in (REPO / "scripts" / "slurm" / "ab_job.sbatch", REPO / "scripts" / "demo.sh"):
        text = path.read_text()
        assert "-m llama_fp8.cluster.launch.schedule --repeats" in text and "--compare" in text, path
        assert "read -r" in text and '--seed' in text and "$fp8" in text, path


@pytest.mark.slow
def test_batch_job_runs_the_interleaved_schedule_and_compares_every_pair(tmp_path):
    """ab_job.sbatch itself, with Slurm's commands and the job library faked: every run of 3 pairs runs, in
    the alternating order with one seed per pair, although each job step drains its stdin; then compare."""
    job, base = fake_ab_job(tmp_path)
    ab = tmp_path / "ab"
    ab.mkdir()
    env = {**base, "AB_DIR": str(ab), "AB_REPEATS": "3", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]"}
    cmd = ["bash", str(job), "--model", "tiny", "--seed", "10"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [shlex.split(line) for line in (ab / "train.calls").read_text().splitlines()]
    got = [(c[-1].removeprefix(f"--run_dir={ab}/"), c[-3], c[-2]) for c in calls]
    assert got == [("pair1/bf16", "--fp8=0", "--seed=10"), ("pair1/fp8", "--fp8=1", "--seed=10"),
                   ("pair2/fp8", "--fp8=1", "--seed=11"), ("pair2/bf16", "--fp8=0", "--seed=11"),
                   ("pair3/bf16", "--fp8=0", "--seed=12"), ("pair3/fp8", "--fp8=1", "--seed=12")]
    compare = (ab / "compare.calls").read_text().split()
    dirs = compare[compare.index("compare") + 1:compare.index("--out")]
    assert dirs == [f"{ab}/pair{i}/{arm}" for i in (1, 2, 3) for arm in ("bf16", "fp8")]
    runs_tsv = [line.split("\t") for line in (ab / "ab_runs.tsv").read_text().splitlines()]
    assert [r[:3] for r in runs_tsv] == [[g[0], "77", "n[1-2]"] for g in got]
    # a requeued job skips the runs that finished
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("finished in an earlier attempt") == 6
    assert len((ab / "train.calls").read_text().splitlines()) == 6


@pytest.mark.slow
def test_a_swap_to_a_spare_during_an_arm_is_recorded(tmp_path):
    """A spare node takes n2's place during pair 1's fp8 run (SPARE_NODES): the job log says that run trained on
    n[1-2], then n1,n3, ab_runs.tsv gets a swap line, and the later runs start on the nodes now training (the
    report's hardware check then names that run and the ones after it: report/hardware.py)."""
    job, base = fake_ab_job(tmp_path)
    ab = tmp_path / "ab"
    ab.mkdir()
    env = {**base, "AB_DIR": str(ab), "AB_REPEATS": "2", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]",
           "FAKE_SWAP_IN": "pair1/fp8"}
    cmd = ["bash", str(job), "--model", "tiny", "--seed", "10"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "== run pair1/fp8: a training node was left behind during the run: it trained on n[1-2], then n1,n3" \
        in proc.stdout, proc.stdout
    runs_tsv = [line.split("\t") for line in (ab / "ab_runs.tsv").read_text().splitlines()]
    assert [(r[0], r[2], r[4:]) for r in runs_tsv] == [
        ("pair1/bf16", "n[1-2]", []), ("pair1/fp8", "n[1-2]", []), ("pair1/fp8", "n1,n3", ["swap"]),
        ("pair2/fp8", "n1,n3", []), ("pair2/bf16", "n1,n3", [])]


@pytest.mark.slow
def test_batch_job_publishes_the_report_to_mlflow_only_when_the_arms_log_there(tmp_path):
    """With --mlflow_tracking_uri among the train arguments the job runs `llama_fp8 publish` on its report once; a
    failed upload is a warning, not a failed A/B; without the flag there is no publish step."""
    job, base = fake_ab_job(tmp_path)
    for name, extra, rc in (("plain", [], "0"), ("tracked", ["--mlflow_tracking_uri", "http://mlflow:5000"], "1")):
        ab = tmp_path / name
        ab.mkdir()
        env = {**base, "AB_DIR": str(ab), "SLURM_JOB_ID": "78", "SLURM_JOB_NODELIST": "n1", "FAKE_PUBLISH_RC": rc}
        cmd = ["bash", str(job), "--model", "tiny", *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        calls = (ab / "publish.calls").read_text().splitlines() if (ab / "publish.calls").exists() else []
        if extra:
            assert [c.split()[-2:] for c in calls] == [["publish", f"{ab}/report"]]
            assert "could not log the report to MLflow" in proc.stderr
        else:
            assert calls == []
