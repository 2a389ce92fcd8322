"""The iso-loss speed-up and the iso-time gap (report/isoloss.py, equal_quality.py) on synthetic curves whose crossings
are known exactly, and the coverage of their interval on seeded noisy curves."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from llama_fp8.report import equal_quality, isocurves, isoloss
from llama_fp8.report.compare import final_loss_k
from llama_fp8.report.runs import Run

LOG, WINDOWS, BATCH = 5, 60, 8  # a record every 5 steps, 60 windows, 8 sequences per step


def curve(steps: np.ndarray, shift: float = 0.0) -> np.ndarray:
    """A loss curve that keeps falling (power law), ``shift`` above it everywhere."""
    return 3.0 + 5.0 * (1 + steps / 20.0) ** -0.7 + shift


def make_run(name: str, losses, rates, *, val=None, start: float = 7.0) -> Run:
    """Records as training writes them: the window's loss and samples/s, elapsed_s (the loop's clock, which the
    rates imply) and time (epoch seconds: start-up ``start`` before the loop)."""
    recs, elapsed = [], 0.0
    for i, (loss, rate) in enumerate(zip(losses, rates)):
        step = (i + 1) * LOG
        elapsed += LOG * BATCH / rate
        recs.append({"type": "train", "step": step, "loss": float(loss), "samples_per_sec": float(rate),
                     "elapsed_s": elapsed, "time": start + elapsed, "data_from_step": step - LOG + 1})
    vals = [{"step": s, "val_loss": float(v)} for s, v in (val or [])]
    return Run(name, Path(name), "jsonl", recs, vals, meta={"global_batch_size": BATCH, "start_step": 0})


def window_losses(shift: float = 0.0, windows: int = WINDOWS) -> np.ndarray:
    """Each window's loss: the mean of its steps' losses (as the meter logs it)."""
    steps = np.arange(1, windows * LOG + 1, dtype=float)
    return curve(steps, shift).reshape(windows, LOG).mean(axis=1)


def summarize(pairs, axis="productive", window=None, n_boot=2000):
    warm = [(LOG, LOG)] * len(pairs)  # the first window is warm-up
    return equal_quality.summarize(pairs, warm, window, axis, final_loss_k, n_boot=n_boot)


@pytest.mark.parametrize("axis", isocurves.AXES)
def test_identical_curve_20_percent_faster_in_every_time_field_gives_1_25(axis):
    y = window_losses()
    a = make_run("a", y, [100.0] * WINDOWS)
    b = make_run("b", y, [125.0] * WINDOWS, start=7.0 * 0.8)  # every time 20 % shorter
    eq = summarize([(a, b)], axis)
    sp = eq["train"]["speedup"]
    assert sp["point"] == pytest.approx(1.25, rel=0.01)
    row = eq["train"]["pairs"][0]
    assert row["t_b"] == pytest.approx(0.8 * row["t_a"], rel=0.01) and row["reached"]
    assert eq["train"]["iso_gap"]["point"] < 0  # at the same time the faster arm is further down the curve


def test_the_crossing_time_is_the_known_one_and_the_target_is_the_final_train_loss():
    """No noise, constant rates: A's target is the mean of its last k logged losses, and B (the same curve shifted
    by a known amount) reaches it at the window whose k-point mean equals it, interpolated."""
    y = window_losses()
    a, b = make_run("a", y, [100.0] * WINDOWS), make_run("b", y - 0.05, [100.0] * WINDOWS)
    eq = summarize([(a, b)], window=5)
    row, per_window = eq["train"]["pairs"][0], LOG * BATCH / 100.0
    assert row["target"] == pytest.approx(y[-5:].mean())
    mid = (np.arange(WINDOWS) + 0.5) * per_window
    means = np.convolve(y - 0.05, np.ones(5) / 5, mode="valid")
    times = np.convolve(mid, np.ones(5) / 5, mode="valid")
    j = int(np.argmax(means <= row["target"]))
    expect = times[j - 1] + (means[j - 1] - row["target"]) / (means[j - 1] - means[j]) * (times[j] - times[j - 1])
    assert row["t_b"] == pytest.approx(expect, rel=1e-9)
    assert row["t_a"] == pytest.approx(times[-1], rel=1e-9)
    assert eq["train"]["speedup"]["point"] == pytest.approx(times[-1] / expect, rel=1e-9)
    assert times[-1] / expect > 1


def test_a_candidate_above_the_target_is_not_reached_with_its_gap_at_the_baselines_time():
    y = window_losses()
    a, b = make_run("a", y, [100.0] * WINDOWS), make_run("b", y + 0.02, [200.0] * WINDOWS)
    eq = summarize([(a, b)])
    tr = eq["train"]
    assert tr["speedup"]["point"] is None and not tr["pairs"][0]["reached"]
    assert tr["text"].startswith("not reached (pair 1: +") and "above the target" in tr["text"]
    gap = tr["pairs"][0]["gap_at_end_pct"]  # B ends sooner (twice as fast): its gap at its own end
    assert gap == pytest.approx(0.02 / tr["pairs"][0]["target"] * 100, rel=0.05)
    assert "x," not in tr["text"]  # no made-up speed-up


def test_a_single_noisy_dip_below_the_target_does_not_count():
    y = window_losses()
    dipped = y + 0.02
    dipped[50] -= 1.0  # one window far below the target: it moves 5 overlapping means below it
    a, b = make_run("a", y, [100.0] * WINDOWS), make_run("b", dipped, [100.0] * WINDOWS)
    m, _ = isoloss.smooth(dipped[None, :], np.arange(WINDOWS, dtype=float)[None, :], 5)
    assert (m[0] <= y[-5:].mean()).any()  # the dip does cross the target
    assert summarize([(a, b)])["train"]["pairs"][0]["reached"] is False


def test_validation_iso_loss_uses_each_evaluation_at_its_steps_time():
    y = window_losses()
    val_steps = [50, 100, 150, 200, 250, 300]
    va = [(s, curve(np.array([s]))[0] + 0.1) for s in val_steps]
    a = make_run("a", y, [100.0] * WINDOWS, val=va)
    b = make_run("b", y, [125.0] * WINDOWS, val=va)
    v = summarize([(a, b)])["validation"]
    assert v["available"] and v["speedup"]["point"] == pytest.approx(1.25, rel=1e-6)
    assert v["pairs"][0]["t_a"] == pytest.approx(300 * BATCH / 100.0)
    assert summarize([(make_run("a", y, [100.0] * WINDOWS), b)])["validation"]["available"] is False


def test_a_plain_log_without_a_rate_says_why_and_elapsed_needs_a_clock():
    y = window_losses()
    a, b = make_run("a", y, [100.0] * WINDOWS), make_run("b", y, [100.0] * WINDOWS)
    for r in b.train:
        r.pop("elapsed_s")
    eq = summarize([(a, b)], "elapsed")
    assert eq["available"] is False and "elapsed_s" in eq["why"]
    b.train[3]["samples_per_sec"] = None
    assert "samples/s" in summarize([(a, b)])["why"]


EXTRA = 9  # the candidate's extra windows: 15 % more steps, the baseline's time budget at its 1.15x rate


def _noisy_pairs(rng, pairs: int, sigma: float = 0.01, rate_noise: float = 0.03):
    y, yb, nb = window_losses(), window_losses(0.004, WINDOWS + EXTRA), WINDOWS + EXTRA
    out = []
    for _ in range(pairs):
        drift = rng.normal(0, 0.01)  # pair-to-pair: the node of the day
        ra = 100 * (1 + drift) * (1 + rate_noise * rng.standard_normal(WINDOWS))
        rb = 115 * (1 + drift) * (1 + rate_noise * rng.standard_normal(nb))
        out.append((make_run("a", y + sigma * rng.standard_normal(WINDOWS), ra),
                    make_run("b", yb + sigma * rng.standard_normal(nb), rb)))
    return out


@pytest.mark.parametrize("pairs", [1, pytest.param(2, marks=pytest.mark.slow)])  # across pairs: 10 s
def test_the_interval_covers_the_true_speedup_in_at_least_90_percent_of_200_seeded_trials(pairs):
    """The truth: the same estimator on the noise-free curves and rates. The noise: a normal per window on the loss
    (sigma 0.01, more than the loss falls in a window at the end) and 3 % on each window's rate, plus 1 % drift per
    pair. The candidate (1.15x the rate, its loss 0.004 higher at every step) runs 15 % more steps, as it would in
    the baseline's time: with only the baseline's steps it would end above the target (not reached)."""
    clean = summarize([(make_run("a", window_losses(), [100.0] * WINDOWS),
                        make_run("b", window_losses(0.004, WINDOWS + EXTRA), [115.0] * (WINDOWS + EXTRA)))])
    truth = clean["train"]["speedup"]["point"]
    assert 1.0 < truth < 1.15  # slower to the target than the raw rate says: B's loss is a little higher
    rng = np.random.default_rng(2026)
    hits, widths = 0, []
    for _ in range(200):
        sp = summarize(_noisy_pairs(rng, pairs), n_boot=500)["train"]["speedup"]
        low = sp["low"] if sp["low"] is not None else 0.0
        high = sp["high"] if sp["high"] is not None else math.inf
        hits += low <= truth <= high
        widths.append(high - low)
    print(f"{pairs} pair(s): truth {truth:.4f}, coverage {hits / 200:.3f}, median width {np.median(widths):.4f}")
    assert hits >= 180
    assert np.median(widths) < 0.12  # and an interval that says something (about +-4 % here)


def test_compare_states_the_iso_loss_figures_with_its_flags_and_ends_with_the_headline(tmp_path, capsys):
    """``compare`` on run folders: ``--iso_loss_window`` and ``--iso_loss_time`` change what is computed, the report has
    its section, and the last line printed is the headline (headline.txt)."""
    from test_repeats import make_pairs, run

    from llama_fp8.report import compare

    paths, _ = make_pairs(tmp_path / "runs", [1, 2], fp8_shift=-0.01)  # B a little lower: it reaches A's loss
    default = run(paths, tmp_path / "a")
    out = capsys.readouterr().out.rstrip().splitlines()
    eq = default["equal_quality"]
    assert (eq["time_axis"], eq["window"], eq["pairs"]) == ("productive", 5, 2) and eq["train"]["speedup"]["point"]
    assert out[-1] == f"headline: {default['headline']}" and out[-4].startswith("iso-loss speed-up B/A (train): ")
    assert (tmp_path / "a" / "headline.txt").read_text() == default["headline"] + "\n"
    report = (tmp_path / "a" / "report.md").read_text()
    assert "## At equal quality: iso-loss speed-up and iso-time loss gap" in report
    assert f"**Train iso-loss speed-up B/A: {eq['train']['text']}**" in report
    other = run(paths, tmp_path / "b", "--iso_loss_window", "3", "--iso_loss_time", "measured")
    assert (other["equal_quality"]["time_axis"], other["equal_quality"]["window"]) == ("measured", 3)
    assert other["equal_quality"]["train"]["pairs"][0]["target"] != eq["train"]["pairs"][0]["target"]
    assert compare.main([*paths, "--iso_loss_window", "0"]) == 2
    assert "--iso_loss_window: must be an integer >= 1" in capsys.readouterr().err
