"""Bootstrap confidence intervals of an A/B ratio (numpy), within one pair of runs and across pairs.

A rate metric (samples/s, tokens/s/GPU, TFLOPS, MFU) is logged once per logging window. Windows have the
same number of steps, so an arm's rate over its kept windows is the work done over the time taken:
``n / sum(1 / x_i)``, the harmonic mean of the window rates (an arithmetic mean would over-weight fast
windows). The ratio B/A of two such rates is the speed-up; > 1 means B is faster.

- Within a pair: resample A's windows and B's windows with replacement (independently: the runs ran at
  different times), recompute the ratio; the 2.5th and 97.5th percentiles of ``n_boot`` ratios are the
  95 % interval (percentile bootstrap).
- Across pairs: resample the pairs with replacement and, inside each drawn pair, its windows; the
  statistic is the geometric mean of the per-pair ratios. So the interval holds both the window-to-window
  noise and the pair-to-pair drift (node, seed, time of day). The point estimate is the geometric mean of
  the pairs' own ratios.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

N_BOOT = 4000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class RatioCI:
    ratio: float
    low: float
    high: float
    pairs: int
    windows: tuple[int, ...]  # kept windows per arm run, A then B per pair

    def text(self) -> str:
        """``1.31x, 95 % CI 1.28-1.34, 3 pairs``."""
        unit = f"{self.pairs} pair" + ("s" if self.pairs != 1 else "")
        return f"{self.ratio:.3g}x, 95 % CI {self.low:.3g}-{self.high:.3g}, {unit}"


def _clean(values: Sequence[float]) -> np.ndarray:
    arr = np.asarray([float(v) for v in values if v is not None], dtype=float)
    return arr[np.isfinite(arr) & (arr > 0)]


def rate(values: Sequence[float]) -> float | None:
    """The arm's rate over its windows: harmonic mean of positive finite window rates (None if none)."""
    arr = _clean(values)
    return float(len(arr) / np.sum(1.0 / arr)) if len(arr) else None


def _boot_inv_means(inv: np.ndarray, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """Bootstrap replicates of mean(inv): (n_boot,)."""
    idx = rng.integers(0, len(inv), size=(n_boot, len(inv)))
    return inv[idx].mean(axis=1)


def ratio_ci(pairs: Sequence[tuple[Sequence[float], Sequence[float]]], *, seed: int = 0,
             n_boot: int = N_BOOT) -> RatioCI | None:
    """B/A rate ratio with a 95 % bootstrap interval; ``pairs`` = [(A's window rates, B's window rates)].
    One pair: the within-pair interval; several: across pairs (module docstring). None when an arm of
    some pair has no usable window."""
    arms = [(_clean(a), _clean(b)) for a, b in pairs]
    if not arms or any(len(a) == 0 or len(b) == 0 for a, b in arms):
        return None
    rng = np.random.default_rng(seed)
    # a rate's inverse is time per unit of work; the ratio of mean inverses is the speed-up B/A
    inv = [(1.0 / a, 1.0 / b) for a, b in arms]
    log_ratios = np.array([math.log(ia.mean() / ib.mean()) for ia, ib in inv])
    point = float(math.exp(log_ratios.mean()))
    # per pair: n_boot bootstrap log-ratios of its own windows
    per_pair = np.stack([np.log(_boot_inv_means(ia, rng, n_boot) / _boot_inv_means(ib, rng, n_boot))
                         for ia, ib in inv])  # (pairs, n_boot)
    if len(inv) == 1:
        reps = per_pair[0]
    else:  # draw pairs with replacement; replicate j of a drawn pair is its window resample
        drawn = rng.integers(0, len(inv), size=(n_boot, len(inv)))
        reps = per_pair[drawn, np.arange(n_boot)[:, None]].mean(axis=1)
    alpha = (1 - CONFIDENCE) / 2
    low, high = np.exp(np.quantile(reps, [alpha, 1 - alpha]))
    return RatioCI(point, float(low), float(high), len(inv),
                   tuple(n for a, b in arms for n in (len(a), len(b))))


def json_safe(obj):
    """NaN/inf -> None and Paths -> str, so summary.json is strict JSON."""
    from pathlib import Path

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else obj

