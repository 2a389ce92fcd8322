"""Repeated A/B pairs: the bootstrap interval's coverage, the speed-up and noise band checked against an
independent computation on fixture runs, and the verdict's reasoning."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from llama_fp8.report import compare as C
from llama_fp8.report import stats
from llama_fp8.telemetry import goodput

STEPS, K = 40, 5   # fixture runs log every step; the final loss is the mean of the last K = max(5, 5 %)


def write_run(run_dir: Path, precision: str, seed: int, *, loss_shift: float, speed: float, mem: float) -> list[dict]:
    """A metrics.jsonl + config.yaml like train's; loss depends on the seed, speed has window noise."""
    rng = np.random.default_rng(seed * 7 + (precision == "fp8"))
    run_dir.mkdir(parents=True)
    recs = []
    for step in range(1, STEPS + 1):
        sps = speed * (0.3 if step == 1 else rng.uniform(0.9, 1.1))
        recs.append({"type": "train", "step": step, "loss": 5.0 * math.exp(-step / 30) + 0.02 * seed + loss_shift,
                     "lr": 1e-3, "grad_norm": 1.0, "samples_per_sec": sps, "tokens_per_sec_per_device": sps * 16,
                     "tflops_per_device": sps * 16 * 5.5e6 / 1e12, "mfu_vs_bf16_peak": None,
                     "mem_peak_gib": mem, "precision": precision, "world_size": 2})
    meta = {"type": "meta", "precision": precision, "world_size": 2}
    parts = {f"{k}_s": float(i + 1 + seed) for i, k in enumerate(goodput.PARTS)}
    good = {"type": "goodput", "step": STEPS, "wall_s": sum(parts.values()), **parts}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [meta, *recs, good]))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"asked": {"seed": seed, "fp8": precision == "fp8"}}))
    return recs


def make_pairs(root: Path, seeds: list[int], fp8_shift: float) -> tuple[list[str], list[tuple[list, list]]]:
    paths, recs = [], []
    for seed in seeds:
        a = write_run(root / f"s{seed}" / "bf16", "bf16", seed, loss_shift=0.0, speed=50.0, mem=2.0)
        b = write_run(root / f"s{seed}" / "fp8", "fp8", seed, loss_shift=fp8_shift, speed=65.0, mem=1.5)
        paths += [str(root / f"s{seed}" / "bf16"), str(root / f"s{seed}" / "fp8")]
        recs.append((a, b))
    return paths, recs


def run(paths: list[str], out: Path, *extra: str) -> dict:
    assert C.main([*paths, "--out", str(out), *extra]) == 0
    return json.loads((out / "summary.json").read_text())


def final_loss(recs: list[dict]) -> float:
    return sum(r["loss"] for r in recs[-K:]) / K


# --- the bootstrap ---------------------------------------------------------------------------------------
def coverage_band(n: int, p: float = 0.95) -> tuple[float, float]:
    """Where the hit rate of a 95 % interval falls in n trials with near certainty (+-3 binomial sd)."""
    sd = math.sqrt(p * (1 - p) / n)
    return p - 3 * sd, p + 3 * sd


def test_within_pair_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    true, trials, hits = 1.31, 200, 0
    for t in range(trials):
        g = np.random.default_rng(1000 + t)
        time_a = 2.0 * g.gamma(50, 1 / 50, size=30)          # seconds per window, mean 2.0
        time_b = 2.0 / true * g.gamma(50, 1 / 50, size=30)   # mean 2.0 / true: B is `true` times faster
        ci = stats.ratio_ci([(1 / time_a, 1 / time_b)], seed=t, n_boot=2000)
        hits += ci.low <= true <= ci.high
    low, high = coverage_band(trials)
    assert low <= hits / trials <= high, (hits, low, high)


def test_across_pairs_interval_covers_the_true_ratio_under_drift_between_pairs():
    true, trials, hits, widths = 1.2, 200, 0, []
    for t in range(trials):
        g = np.random.default_rng(5000 + t)
        pairs = []
        for _ in range(3):
            drift = g.lognormal(0, 0.05)  # the node got slower or faster between pairs: hits both arms
            pairs.append((1 / (drift * g.gamma(50, 1 / 50, size=20)),
                          1 / (drift / true * g.gamma(50, 1 / 50, size=20))))
        ci = stats.ratio_ci(pairs, seed=t, n_boot=2000)
        hits += ci.low <= true <= ci.high
        widths.append(ci.high - ci.low)
    assert hits / trials >= coverage_band(trials)[0]
    assert ci.pairs == 3 and ci.text().endswith("3 pairs") and np.median(widths) < 0.2  # informative, not trivial


def test_ratio_ci_is_none_without_windows_and_text_format():
    assert stats.ratio_ci([([1.0, 2.0], [])]) is None and stats.rate([None, float("nan")]) is None
    ci = stats.RatioCI(1.3123, 1.281, 1.344, 3, (4, 4))
    assert ci.text() == "1.31x, 95 % CI 1.28-1.34, 3 pairs"


# --- repeats on fixture runs -----------------------------------------------------------------------------
def test_speedup_memory_and_noise_band_match_an_independent_computation(tmp_path, capsys):
    seeds = [1, 2, 3]
    paths, recs = make_pairs(tmp_path, seeds, fp8_shift=0.003)
    s = run(paths, tmp_path / "o", "--warmup_steps_excluded", "4", "--loss_tolerance", "0.1")
    ab = s["ab"]
    # speed-up: per pair, the ratio of time per sample over kept windows (steps > 4); overall: geometric mean
    ratios = []
    for a, b in recs:
        ta = np.mean([1 / r["samples_per_sec"] for r in a if r["step"] > 4])
        tb = np.mean([1 / r["samples_per_sec"] for r in b if r["step"] > 4])
        ratios.append(ta / tb)
    sp = ab["speed"]["samples_per_sec"]
    assert [p["ratio"] for p in sp["pairs"]] == pytest.approx(ratios, rel=1e-9)
    assert sp["overall"]["ratio"] == pytest.approx(math.exp(np.mean(np.log(ratios))), rel=1e-9)
    assert sp["overall"]["low"] < sp["overall"]["ratio"] < sp["overall"]["high"]
    assert sp["overall"]["pairs"] == 3 and 1.2 < sp["overall"]["ratio"] < 1.4
    assert ab["speed"]["tokens_per_sec_per_device"]["overall"]["ratio"] == pytest.approx(sp["overall"]["ratio"])
    assert ab["speed"]["mfu_vs_bf16_peak"]["overall"] is None   # not recorded: n/a, not invented
    assert ab["memory"] == {"peak_gib_a": 2.0, "peak_gib_b": 1.5, "ratio": 0.75}
    # noise band: the largest |final-loss gap| between BF16 runs of different seeds
    fa = {seed: final_loss(a) for seed, (a, _) in zip(seeds, recs)}
    band = max(abs(fa[j] - fa[i]) / fa[i] * 100 for i in seeds for j in seeds if i < j)
    assert ab["noise"]["train_band_pct"] == pytest.approx(band, rel=1e-9)
    gap = np.mean([(final_loss(b) - final_loss(a)) / final_loss(a) * 100 for a, b in recs])
    v = ab["verdict"]["gaps"]["train"]
    assert v["gap_pct"] == pytest.approx(gap, rel=1e-9) and abs(gap) < band and 0.1 < band
    # the band (wider than the 0.1 % tolerance) decided: PASS although the gap exceeds the tolerance
    assert abs(gap) > 0.1 and v["within"] and s["verdict"] == "PASS" and "decided by the noise band" in s["verdict_line"]
    report = (tmp_path / "o" / "report.md").read_text()
    assert f"**Speed-up B/A (samples/s): {sp['text']}**" in report and "3 pairs" in sp["text"]
    assert s["speedup"] == sp["overall"]["ratio"]  # summary.json's one speed-up is the headline's
    assert "Noise band (BF16 vs BF16 across seeds" in report and "| 3 | 3 |" in report   # pair 3, seed 3
    # goodput of an arm: its runs' parts summed; productive is the 3rd part (3 + seed s in run s)
    wall = sum(sum(i + 1 + seed for i in range(len(goodput.PARTS))) for seed in seeds)
    prod = sum(3 + seed for seed in seeds)
    assert ab["goodput"][0]["wall_s"] == wall and ab["goodput"][0]["goodput"] == pytest.approx(prod / wall)
    assert f"| **goodput** (productive / wall) | {100 * prod / wall:.1f} % |" in report
    out = capsys.readouterr().out
    assert f"goodput: A {100 * prod / wall:.1f} %, B {100 * prod / wall:.1f} %" in out
    assert f"speedup B/A: {sp['text']}" in out and "stragglers: none named; throttling: throttling not measured (no per-rank records)" in out


def test_the_tolerance_decides_when_wider_than_the_band_and_a_gap_beyond_both_fails(tmp_path):
    paths, recs = make_pairs(tmp_path, [1, 2], fp8_shift=0.002)
    s = run(paths, tmp_path / "o", "--loss_tolerance", "5")
    assert s["verdict"] == "PASS" and "decided by the fixed tolerance (it is wider" in s["verdict_line"]
    paths, _ = make_pairs(tmp_path / "far", [1, 2], fp8_shift=0.5)   # ~ +25 %: beyond band and tolerance
    s = run(paths, tmp_path / "o2", "--loss_tolerance", "1")
    assert s["verdict"] == "FAIL" and "exceeds" in s["verdict_line"]


def test_one_pair_says_noise_not_measured(tmp_path):
    paths, _ = make_pairs(tmp_path, [1], fp8_shift=0.0)
    s = run(paths, tmp_path / "o")
    assert s["ab"]["noise"]["measured"] is False and s["ab"]["noise"]["train_band_pct"] is None
    assert "noise not measured" in s["verdict_line"] and s["ab"]["speed"]["samples_per_sec"]["text"].endswith("1 pair")
    assert "**noise not measured**" in (tmp_path / "o" / "report.md").read_text()


def test_an_odd_number_of_runs_is_refused(tmp_path, capsys):
    paths, _ = make_pairs(tmp_path, [1, 2], fp8_shift=0.0)
    assert C.main([*paths[:3], "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "RUN_B is missing" in err and not (tmp_path / "o").exists()
    # three runs may be one repeat of three arms (a baseline and two candidates): it says how to ask for that
    assert "give --arms 3" in err, err
    paths9 = (paths * 3)[:9]
    assert C.main([*paths9, "--out", str(tmp_path / "o")]) == 2
    assert "give --arms 3 or --arms 9" in capsys.readouterr().err


def test_goodput_section_shows_time_lost_to_restarts_and_the_checkpoint_interval(tmp_path):
    """A run restarted twice (a meta record per attempt, steps redone): the report gives the gaps from the last
    step before each restart to the first after, and, from the save cost (checkpoint time / saves), the
    Young/Daly interval for 1, 6 and 24 h between failures."""
    paths, _ = make_pairs(tmp_path, [1], 0.0)
    metrics = Path(paths[1]) / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    t = 1000.0
    for r in recs:
        if r["type"] == "train":
            r["time"], t = t, t + 1.0
    meta, train, good = recs[0], recs[1:-1], recs[-1]
    redo = [dict(r, time=r["time"] + 30.0) for r in train[9:]]        # killed after step 20, resumed at 10
    redo2 = [dict(r, time=r["time"] + 80.0) for r in train[29:]]      # and after step 40 (its end), resumed at 30
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [meta, *train[:20], meta, *redo, meta, *redo2, good]))
    (Path(paths[1]) / "config.yaml").write_text(yaml.safe_dump({"asked": {"seed": 1, "fp8": True,
                                                                          "checkpoint_freq": 10}}))
    run(paths, tmp_path / "o")
    report = (tmp_path / "o" / "report.md").read_text()
    # gaps: 1019 -> 1039 (20 s), 1069 -> 1109 (40 s)
    assert "| restarts: time from the last step before to the first after | none | 2: 60.0 s (median 40.0, " \
           "max 40.0) |" in report, report
    from llama_fp8.telemetry.goodput import checkpoint_interval
    save = (good["checkpoint_sync_s"] + good["checkpoint_async_s"]) / 4   # 40 steps, every 10: 4 saves
    t1 = checkpoint_interval(save, 3600)
    assert f"(a save blocks training {save:.2f} s; Young/Daly): MTBF 1 h -> every {t1 / 60:.1f} min, " \
           f"{(t1 / 2 + 40.0) / 60:.1f} min lost per failure" in report


def test_restart_figures_leave_out_planned_requeues_and_count_every_save(tmp_path):
    """A run requeued once on purpose (its first attempt ended on SIGUSR1, saved, and waited 2 h in the queue) and
    restarted once after a crash: one restart of 25 s, not two with the queue in them; and the save cost is the
    checkpoint time over the saves the attempts report (5, counting the one at the signal and the one redone),
    not over the 4 an uninterrupted run makes."""
    paths, _ = make_pairs(tmp_path, [1], 0.0)
    metrics = Path(paths[1]) / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    t = 1000.0
    for r in recs:
        if r["type"] == "train":
            r["time"], t = t, t + 1.0
    meta, train, good = recs[0], recs[1:-1], recs[-1]
    parts = {f"{k}_s": good[f"{k}_s"] / 3 for k in goodput.PARTS}
    first = dict(good, **parts, saves=2, ended="signal")     # steps 1-15, a save at 10 and at the signal (15)
    second = dict(good, **parts, saves=2, ended="failed")    # resumed at 15 two hours later, crashed after 25
    third = dict(good, **parts, saves=1, ended="finished")   # resumed at 20 (its save), to the end
    queued = [dict(r, time=r["time"] + 7200.0) for r in train[15:25]]
    redo = [dict(r, time=r["time"] + 7225.0) for r in train[20:]]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in
                               [meta, *train[:15], first, meta, *queued, second, meta, *redo, third]))
    (Path(paths[1]) / "config.yaml").write_text(yaml.safe_dump({"asked": {"seed": 1, "fp8": True,
                                                                          "checkpoint_freq": 10}}))
    run(paths, tmp_path / "o")
    report = (tmp_path / "o" / "report.md").read_text()
    # the crash: last step 8224 (step 25), first step after 8245 (step 21 redone)
    assert "| restarts: time from the last step before to the first after | none | 1: 21.0 s (median 21.0, " \
           "max 21.0) |" in report, report
    save = (good["checkpoint_sync_s"] + good["checkpoint_async_s"]) / 5
    assert f"(a save blocks training {save:.2f} s; Young/Daly)" in report, report
