"""What FP8 buys at equal quality: the iso-loss speed-up of a candidate over its baseline and the iso-time loss
gap, each with a 95 % interval over pairs (R pairs of runs, as the raw speed-up's).

- Smoothing (``--iso_loss_window K``, logged records): a logged train loss is the mean over its window's steps,
  placed at the window's middle on the time axis (isocurves.py); the smoothed loss is the mean of K consecutive
  logged losses, placed at the mean of their times. Default K: the final train loss's k = max(5, ceil(5 % of the
  records)), so that the target below is the report's final train loss of the baseline. Validation losses (the
  same held-out batches at every evaluation) are not smoothed (K = 1).
- Iso-loss speed-up: the target is the baseline's final smoothed loss. An arm reaches it at the first smoothed
  point at or below the target after which the next K smoothed points (all that are left, near its end) stay at or
  below it too: a single noisy dip, which moves at most K overlapping means, does not count. The time is
  interpolated linearly between that point and the one before. Speed-up = T(baseline) / T(candidate): the baseline
  needs T(baseline) for its own final loss; > 1 means the candidate gets there sooner.
- A candidate that never reaches it is "not reached", with its smoothed loss gap to the target at the time the
  baseline reached it (at its own end when it stopped sooner): no speed-up is made up.
- Iso-time gap: both arms' smoothed losses at the same time, the end of the shorter curve, (B - A) / A in %.
- Interval, per pair: a bootstrap that redraws the loss noise (the residuals around a K-point running mean,
  scaled up by sqrt(w / (w - 1)) for the point's own weight in its mean of w, drawn from the second half of the
  run, where the target and the crossings lie: earlier residuals hold the curve's bend, not noise) onto the
  running mean, and each kept window's time per step (from the run's kept windows); the
  target, both crossings and the ratio are recomputed for every draw. Across pairs, the pairs are drawn with
  replacement too (replicate j of each drawn pair), the statistic the geometric mean of the pairs' speed-ups (the
  mean of their gaps): it holds the noise within each run and the drift between pairs, as the raw speed-up's
  (stats.py). Percentile interval of ``stats.N_BOOT`` draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llama_fp8.report import stats
from llama_fp8.report.isocurves import Curve, step_times, times_at

NOT_REACHED = -1e300  # a draw's log speed-up when the candidate misses the target in that draw


def smooth(loss: np.ndarray, mid: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(means of k consecutive values, the mean of their times), along the last axis."""
    k = max(1, min(k, loss.shape[-1]))

    def run_mean(x: np.ndarray) -> np.ndarray:
        cs = np.concatenate([np.zeros(x.shape[:-1] + (1,)), np.cumsum(x, axis=-1)], axis=-1)
        return (cs[..., k:] - cs[..., :-k]) / k
    return run_mean(loss), run_mean(mid)


def crossing(m: np.ndarray, c: np.ndarray, target: np.ndarray, hold: int) -> np.ndarray:
    """Per row: the time the smoothed curve ``m`` (at times ``c``) reaches ``target`` and stays at or below it for
    the next ``hold`` points (or to its end), interpolated; nan where it never does. Shapes [B, J], [B, J], [B]."""
    above = (m > target[:, None]).astype(int)
    cum = np.concatenate([np.zeros((m.shape[0], 1), dtype=int), np.cumsum(above, axis=1)], axis=1)
    j = np.arange(m.shape[1])
    end = np.minimum(j + hold, m.shape[1] - 1)
    ok = (cum[:, end + 1] - cum[:, j]) == 0  # no point above the target from j through j + hold
    first = np.argmax(ok, axis=1)
    rows = np.arange(m.shape[0])
    prev = np.maximum(first - 1, 0)
    m0, m1, c0, c1 = m[rows, prev], m[rows, first], c[rows, prev], c[rows, first]
    frac = np.where(first > 0, (m0 - target) / np.where(m0 > m1, m0 - m1, 1.0), 1.0)
    out = c0 + np.clip(frac, 0.0, 1.0) * (c1 - c0)
    return np.where(ok.any(axis=1), out, np.nan)


def value_at(m: np.ndarray, c: np.ndarray, when: np.ndarray) -> np.ndarray:
    """Per row: the curve ``m`` at time ``when`` (linear between points; its last value past its end)."""
    if m.shape[1] == 1:
        return m[:, 0].copy()
    idx = np.clip((c < when[:, None]).sum(axis=1), 1, m.shape[1] - 1)
    rows = np.arange(m.shape[0])
    c0, c1, m0, m1 = c[rows, idx - 1], c[rows, idx], m[rows, idx - 1], m[rows, idx]
    w = np.clip((when - c0) / np.where(c1 > c0, c1 - c0, 1.0), 0.0, 1.0)
    return m0 + w * (m1 - m0)


@dataclass(frozen=True)
class Side:
    """One arm's curve for the figures: its losses [B, n], its window ends' times [B, n], the times the losses are
    placed at [B, n] (a train loss at its window's middle, an evaluation at its step) and its smoothing window."""

    loss: np.ndarray
    at: np.ndarray
    k: int

    def smoothed(self) -> tuple[np.ndarray, np.ndarray]:
        return smooth(self.loss, self.at, self.k)


def figures(a: Side, b: Side, hold: int) -> dict[str, np.ndarray]:
    """Per row: target, T(A), T(B), log speed-up (NOT_REACHED where B misses), B's gap to the target at A's time
    (%), the iso-time and both smoothed losses there, the iso-time gap (%)."""
    ma, ca = a.smoothed()
    mb, cb = b.smoothed()
    target = ma[:, -1]
    ta, tb = crossing(ma, ca, target, hold), crossing(mb, cb, target, hold)
    reached = np.isfinite(tb)
    log_ratio = np.where(reached, np.log(ta / np.where(reached, tb, 1.0)), NOT_REACHED)
    when = np.minimum(ta, cb[:, -1])
    gap_end = (value_at(mb, cb, when) - target) / target * 100
    iso_t = np.minimum(ca[:, -1], cb[:, -1])
    la, lb = value_at(ma, ca, iso_t), value_at(mb, cb, iso_t)
    return {"target": target, "t_a": ta, "t_b": tb, "log_ratio": log_ratio, "gap_at_end_pct": gap_end,
            "gap_at": when, "iso_time": iso_t, "iso_loss_a": la, "iso_loss_b": lb,
            "iso_gap_pct": (lb - la) / la * 100}


# ----------------------------------------------------------------------------- resampling
def _trend(y: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(centred k-point running mean, truncated at the ends; the number of points in each mean)."""
    n, h = len(y), k // 2
    lo = np.clip(np.arange(n) - h, 0, n)
    hi = np.clip(np.arange(n) - h + k, 0, n)
    cs = np.r_[0.0, np.cumsum(y)]
    return (cs[hi] - cs[lo]) / (hi - lo), hi - lo


def draw_losses(curve: Curve, k: int, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """[n_boot, n] redrawn losses: the running mean plus residuals drawn from the run's second half (module docstring)."""
    y = curve.loss
    if k <= 1 or len(y) < 3:
        return np.broadcast_to(y, (n_boot, len(y)))
    mu, w = _trend(y, k)
    resid = (y - mu) * np.sqrt(w / np.maximum(w - 1, 1))
    pool = resid[len(y) // 2:]  # early windows hold the curve's bend, which a running mean leaves in its residuals
    return mu + pool[rng.integers(0, len(pool), size=(n_boot, len(y)))]


def draw_per_step(curve: Curve, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """[n_boot, n] per-step times: the kept windows' drawn from the kept ones; warm-up windows at the draw's mean
    kept time (productive axis) or as measured."""
    kept = curve.per_step[curve.kept]
    drawn = kept[rng.integers(0, len(kept), size=(n_boot, len(curve)))]
    rest = drawn.mean(axis=1, keepdims=True) if curve.steady else curve.per_step[None, :]
    return np.where(curve.kept[None, :], drawn, rest)


def sides(curve: Curve, k: int, losses: np.ndarray, per_step: np.ndarray, val=None) -> Side:
    """The train Side (``val`` None) or the validation Side (``val``: val_points' (steps, losses, where))."""
    ends = step_times(per_step, curve.n_steps)
    if val is None:
        return Side(losses, ends - per_step * curve.n_steps / 2, k)
    at = times_at(ends, val[2])
    return Side(np.broadcast_to(val[1], at.shape), at, 1)


# ----------------------------------------------------------------------------- across pairs
@dataclass(frozen=True)
class Interval:
    point: float | None
    low: float | None  # None: below the range (the candidate misses the target in that many draws)
    high: float | None
    missed: float  # share of draws in which the candidate misses the target


def combine_ratio(points: list[float | None], reps: list[np.ndarray], seed: int) -> Interval:
    """The geometric mean of the pairs' speed-ups and its interval (module docstring); None point when a pair's
    candidate did not reach the target."""
    logs = np.stack(reps)  # [pairs, n_boot]
    drawn = _draw_pairs(logs, seed)
    lo, hi = np.quantile(drawn, [(1 - stats.CONFIDENCE) / 2, (1 + stats.CONFIDENCE) / 2])
    missed = float(np.mean(drawn <= NOT_REACHED / 2))
    point = math.exp(sum(math.log(p) for p in points) / len(points)) if all(p for p in points) else None
    return Interval(point, None if lo <= NOT_REACHED / 2 else math.exp(lo),
                    None if hi <= NOT_REACHED / 2 else math.exp(hi), missed)


def combine_mean(points: list[float], reps: list[np.ndarray], seed: int) -> Interval:
    drawn = _draw_pairs(np.stack(reps), seed)
    lo, hi = np.quantile(drawn, [(1 - stats.CONFIDENCE) / 2, (1 + stats.CONFIDENCE) / 2])
    return Interval(float(np.mean(points)), float(lo), float(hi), 0.0)


def _draw_pairs(reps: np.ndarray, seed: int) -> np.ndarray:
    """[n_boot]: one pair's replicates, or the mean over pairs drawn with replacement, replicate j of each."""
    if reps.shape[0] == 1:
        return reps[0]
    n_pairs, n_boot = reps.shape
    drawn = np.random.default_rng(seed).integers(0, n_pairs, size=(n_boot, n_pairs))
    vals = reps[drawn, np.arange(n_boot)[:, None]]
    return np.where((vals <= NOT_REACHED / 2).any(axis=1), NOT_REACHED, vals.mean(axis=1))
