"""One job, every precision, on CPU: the demo's recipe shoot-out (DEMO_ARMS=shootout: on a CPU BF16, torchao FP8
tensorwise and rowwise, torchao MXFP8, all emulated) on 2 gloo ranks with FSDP2, two repeats (the BF16-vs-BF16 noise
band), then the report of every arm and their ranking at equal quality. One run of it (a module fixture) serves the
loss parity of emulated MXFP8, the 4-arm report and ranking, its re-run script and its MLflow upload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, cli_env, read_metrics

pytestmark = pytest.mark.slow
PNG = b"\x89PNG\r\n\x1a\n"
ARMS = ("bf16", "tensorwise", "rowwise", "mxfp8")  # what the shoot-out runs on a CPU


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("arms")
    env = cli_env(DEMO_ARMS="shootout", DEMO_STEPS="16", DEMO_REPEATS="2", DEMO_DATA=str(out / "data"),
                  DEMO_DIR=str(out / "demo"), VENV=str(Path(sys.executable).parents[1]),
                  DEMO_EXTRA="--num_layers 2 --max_context_width 64 --train_batch_size 2 --logging_freq 2 "
                             "--validation_freq 8 --validation_batches 2 --fp8_stats 8")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh")], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / "demo", proc


def test_every_arm_runs_interleaved_with_the_same_seeds_and_its_own_recipe(demo):
    folder, proc = demo
    starts = [line.split("-> ")[-1] for line in proc.stdout.splitlines() if line.startswith("== training")]
    assert [Path(s).relative_to(folder).as_posix() for s in starts] == [
        "pair1/bf16", "pair1/tensorwise", "pair1/rowwise", "pair1/mxfp8", "pair2/mxfp8", "pair2/rowwise",
        "pair2/tensorwise", "pair2/bf16"]
    # the FP8 arms run DEMO_EXTRA_STEPS (25 %) more steps on BF16's LR schedule: 20 of them for BF16's 16
    assert "--fp8_recipe=mxfp8 --model_impl=hf --max_steps=20 --lr_decay_iters=16 --fp8=1 --seed 1235" in proc.stdout
    for pair, seed in ((1, 1234), (2, 1235)):
        for arm in ARMS:
            meta = next(r for r in read_metrics(folder / f"pair{pair}" / arm) if r["type"] == "meta")
            argv = meta["repro"]["argv"]
            assert argv[len(argv) - argv[::-1].index("--seed")] == str(seed)  # the last --seed: the schedule's
            assert meta["precision"] == ("bf16" if arm == "bf16" else f"fp8-torchao-{arm}")
            assert meta["precision_format"] == {"bf16": "", "tensorwise": "fp8", "rowwise": "fp8", "mxfp8": "mxfp8"}[arm]


def test_emulated_mxfp8_trains_like_bf16_within_the_noise_band(demo):
    """Loss parity of torchao's MXFP8 (emulated: its quantization, dequantized GEMMs) against BF16 on 2 ranks: the mean
    gap over the repeats lies within the bar max(tolerance, BF16-vs-BF16 noise band), the band measured. And the MXFP8
    run really quantized: every decoder linear converted, its losses not BF16's to the bit, its block statistics
    recorded."""
    folder, _ = demo
    summary = json.loads((folder / "report" / "vs_mxfp8" / "summary.json").read_text())
    noise, verdict = summary["ab"]["noise"], summary["ab"]["verdict"]
    assert noise["measured"] and noise["train_band_pct"] is not None
    gap = verdict["gaps"]["train"]
    assert abs(gap["gap_pct"]) <= gap["bar_pct"] and verdict["ok"] and summary["verdict"] == "PASS"
    print(f"MXFP8 emulated vs BF16, 2 ranks, 2 repeats: train gap {gap['gap_pct']:+.4f} %, noise band "
          f"{noise['train_band_pct']:.4f} %, validation gap {verdict['gaps']['validation']['gap_pct']:+.4f} %")
    check = next(r for r in read_metrics(folder / "pair1" / "mxfp8") if r["type"] == "fp8_check")
    assert (check["fp8_linears"], check["linears"], check["problems"]) == (14, 15, [])
    bf16 = [r["loss"] for r in read_metrics(folder / "pair1" / "bf16") if r["type"] == "train"]
    mx = [r["loss"] for r in read_metrics(folder / "pair1" / "mxfp8") if r["type"] == "train"]
    assert bf16 != mx[:8] and (len(bf16), len(mx)) == (8, 10)
    stats = [json.loads(x) for x in (folder / "pair1" / "mxfp8" / "fp8_stats.jsonl").read_text().splitlines()]
    assert {r["dtype"] for r in stats} == {"mxfp8"} and {r["tensor"] for r in stats} == {"input", "weight",
                                                                                         "grad_output"}
    assert all(0 <= r["scale_underflow"] <= 1 and r["snr_db"] > 20 for r in stats)  # E4M3: ~30 dB


def test_the_report_gives_every_arm_its_speed_up_loss_verdict_and_settings_in_one_table_and_one_plot(demo):
    folder, proc = demo
    report = (folder / "report" / "report.md").read_text()
    summary = json.loads((folder / "report" / "summary.json").read_text())
    assert [r["arm"] for r in summary["arms"]] == list(ARMS) and summary["arms_per_repeat"] == 4
    rows = [line for line in report.splitlines() if line.startswith("| [") and "fp8-torchao" in line or
            line.startswith("| bf16 |")]
    assert len(rows) == 4
    for arm in ARMS[1:]:
        sub = json.loads((folder / "report" / f"vs_{arm}" / "summary.json").read_text())
        row = next(r for r in summary["arms"] if r["arm"] == arm)
        assert row["speedup"] == pytest.approx(sub["speedup"]) and row["verdict"] == sub["verdict"]
        assert sub["ab"]["speed"]["samples_per_sec"]["text"] in report  # the interval, as its own report states it
        assert (row["compile"], row["all_gather"], row["activation_checkpointing"], row["emulated"]) == \
            (False, False, "none", True)
        assert f"[{arm}](vs_{arm}/report.md)" in report
    assert "| off | off | none | emulated: speed not meaningful |" in report
    assert summary["verdict"] == ("PASS" if all(r["verdict"] == "PASS" for r in summary["arms"][1:]) else "FAIL")
    assert "Noise band (BF16 vs BF16 across seeds" in report and "![arms](arms.png)" in report
    assert (folder / "report" / "arms.png").read_bytes()[:8] == PNG
    assert f"verdict: {summary['verdict_line']}" in proc.stdout
    # the re-run script names every run and the report's grouping
    rerun = subprocess.run([sys.executable, "-m", "llama_fp8", "compare",
                            *[str(folder / f"pair{p}" / a) for p in (1, 2) for a in ARMS], "--arms", "4", "--repro"],
                           env=cli_env(), capture_output=True, text=True, cwd=folder)
    assert rerun.returncode == 0, rerun.stderr
    assert "DEMO_ARMS=shootout" in rerun.stdout


def test_the_shootout_ranks_every_arm_at_equal_quality_and_ends_with_the_headline(demo):
    """The ranking is each arm's iso-loss figure against BF16, as its own report computes it, ordered; the call names a
    winner only when the intervals allow (emulated FP8 on a CPU: the baseline, or that it cannot tell); the demo's
    output ends with every arm's raw and iso-loss speed-up and verdict, then the call."""
    folder, proc = demo
    summary = json.loads((folder / "report" / "summary.json").read_text())
    ranking = summary["ranking"]
    assert {e["arm"] for e in ranking["order"]} == set(ARMS)
    for e in ranking["order"]:
        if e["arm"] == "bf16":
            continue
        sub = json.loads((folder / "report" / f"vs_{e['arm']}" / "summary.json").read_text())
        assert e["text"] == sub["equal_quality"]["train"]["text"]
        assert e["point"] == sub["equal_quality"]["train"]["speedup"]["point"]
    reached = [e["point"] for e in ranking["order"] if e["reached"]]
    assert reached == sorted(reached, reverse=True)
    assert ranking["winner"] in (None, "bf16")  # emulated FP8 is never faster than BF16
    report = (folder / "report" / "report.md").read_text()
    assert "## Ranked at equal quality" in report and f"**At equal quality: {ranking['line']}**" in report
    tail = proc.stdout.rstrip().splitlines()[-len(ARMS):]
    assert tail == summary["headline"] == (folder / "report" / "headline.txt").read_text().splitlines()
    assert tail[0].startswith("tensorwise vs bf16: raw speed-up ") and " | iso-loss speed-up " in tail[0]
    assert "FP8 emulated on a CPU" in tail[0] and tail[-1] == f"at equal quality: {ranking['line']}"


def test_the_report_of_every_arm_publishes_as_one_parent_with_a_child_per_run(demo, tmp_path, monkeypatch):
    import mlflow

    from llama_fp8 import publish

    folder, _ = demo
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    assert publish.main([str(folder / "report"), "--mlflow_tracking_uri", uri, "--mlflow_experiment", "arms"]) == 0
    mlflow.set_tracking_uri(uri)
    (parent,) = mlflow.search_runs(experiment_names=["arms"], filter_string="tags.kind = 'ab'", output_format="list")
    summary = json.loads((folder / "report" / "summary.json").read_text())
    assert parent.data.metrics["speedup_mxfp8"] == pytest.approx(summary["arms"][3]["speedup"])
    assert parent.data.params["arms"] == ",".join(ARMS)
    children = mlflow.search_runs(experiment_names=["arms"], output_format="list",
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    got = sorted((c.data.tags["ab_pair"], c.data.tags["ab_arm"], c.data.tags["ab_role"]) for c in children)
    assert got == sorted((str(p), a, "baseline" if a == "bf16" else "candidate") for p in (1, 2) for a in ARMS)
    verdicts = {c.data.tags["ab_arm"]: c.data.tags["ab_arm_verdict"] for c in children}
    assert verdicts == {"bf16": "baseline", **{r["arm"]: r["verdict"] for r in summary["arms"][1:]}}
    assert os.path.isdir(tmp_path / "mlruns")
