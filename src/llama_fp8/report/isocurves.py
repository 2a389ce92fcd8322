"""A run's loss curve on a time axis, as the iso-loss figures read it (isoloss.py): the logged losses, the steps of
each logging window and the window's time, with which windows are warm-up.

Time axes (``compare --iso_loss_time``):

- ``productive`` (default): training time after start-up. Each logging window takes its steps at its own measured
  rate (steps x global batch / samples/s); the warm-up windows (those every speed figure leaves out: compilation and
  allocator warm-up, ``--warmup_steps_excluded``) take theirs at the run's steady rate (the harmonic mean of its
  kept windows' rates), so a one-off compilation, which a long run amortises, weighs on neither arm.
- ``measured``: every window at its own measured rate, warm-up included: what this run spent after start-up.
- ``elapsed``: the records' ``elapsed_s`` (wall time since the training loop started: evaluation and checkpoint
  saves included); a window's time is the difference of two records' (a record from a new attempt, whose clock
  starts again, counts its own). metrics.jsonl only: a plain log has no clock.

Start-up (the process until the first step) is never on the axis. Without the global batch size (a plain log), a
window's time is its steps over its rate: seconds per sample, the same unit for both arms of an A/B (they share the
batch), so every ratio stands while the times are not seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llama_fp8.report.runs import Run

AXES = ("productive", "measured", "elapsed")


class Unavailable(ValueError):
    """The run lacks what the chosen time axis needs (the message says what)."""


@dataclass(frozen=True)
class Curve:
    """One run's logged losses with their windows on the time axis (arrays of the same length, step order)."""

    steps: np.ndarray    # the last step of each window
    loss: np.ndarray     # the window's loss (train: the mean over its steps)
    n_steps: np.ndarray  # steps in each window
    per_step: np.ndarray  # seconds per step in each window, on the axis
    kept: np.ndarray     # windows after the warm-up: their per-step times are the ones resampled
    steady: bool         # productive axis: warm-up windows run at the mean per-step time of the kept ones
    seconds: bool        # the times are seconds (the global batch size is known)

    def __len__(self) -> int:
        return len(self.loss)


def _finite(x) -> bool:
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def batch_of(run: Run) -> int | None:
    """The run's global batch size (sequences per step) from its meta record, None when unknown."""
    b = run.meta.get("global_batch_size")
    return b if isinstance(b, int) and not isinstance(b, bool) and b > 0 else None


def _window_steps(run: Run, recs: list[dict]) -> np.ndarray:
    start = run.meta.get("start_step") if isinstance(run.meta.get("start_step"), int) else 0
    first = recs[0].get("data_from_step")
    prev = [first - 1 if isinstance(first, int) and 0 < first <= recs[0]["step"] else start]
    prev += [r["step"] for r in recs[:-1]]
    return np.array([r["step"] - p for r, p in zip(recs, prev)], dtype=float)


def train_curve(run: Run, warmup: int, axis: str, batch: int | None) -> Curve:
    """The run's train-loss curve on ``axis``; ``batch``: the global batch to turn rates into seconds (None: per
    sample). Raises Unavailable when a window has no usable rate (or clock, for ``elapsed``)."""
    if axis not in AXES:
        raise ValueError(f"time axis {axis!r}: one of {', '.join(AXES)}")
    recs = [r for r in run.train if _finite(r.get("loss"))]
    if len(recs) < 2:
        raise Unavailable(f"{run.name}: fewer than 2 logged losses")
    n = _window_steps(run, recs)
    if np.any(n <= 0):
        raise Unavailable(f"{run.name}: logged steps do not increase")
    kept = np.array([r["step"] > warmup for r in recs])
    if axis == "elapsed":
        clock = [r.get("elapsed_s") for r in recs]
        if not all(_finite(c) and float(c) >= 0 for c in clock):
            raise Unavailable(f"{run.name}: --iso_loss_time elapsed needs elapsed_s in every train record "
                              f"(metrics.jsonl of this version; a plain log has no clock)")
        c = np.array(clock, dtype=float)
        # a window's time is the clock's step from the previous record; a new attempt's clock starts again
        dur = np.r_[c[0], np.where(c[1:] > c[:-1], c[1:] - c[:-1], c[1:])]
        per_step = dur / n
    else:
        rates = [r.get("samples_per_sec") for r in recs]
        if not all(_finite(x) and float(x) > 0 for x in rates):
            raise Unavailable(f"{run.name}: a logging window without a positive samples/s rate")
        per_step = (batch or 1) / np.array(rates, dtype=float)
    if not kept.any():
        kept = np.ones_like(kept)
    steady = axis == "productive"
    if steady:
        per_step = np.where(kept, per_step, per_step[kept].mean())
    return Curve(np.array([r["step"] for r in recs], dtype=float), np.array([float(r["loss"]) for r in recs]),
                 n, per_step, kept, steady, batch is not None or axis == "elapsed")


def val_points(run: Run, train: Curve) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, losses, (index, weight) into the train curve's step ends) of the run's evaluations that lie on its
    train curve: the time at an evaluation is the training time through its step (constant per-step time inside a
    window)."""
    ends = np.r_[train.steps[0] - train.n_steps[0], train.steps]
    pts = [(int(r["step"]), float(r["val_loss"])) for r in run.val
           if _finite(r.get("val_loss")) and ends[0] < int(r["step"]) <= ends[-1]]
    steps = np.array([s for s, _ in pts], dtype=float)
    loss = np.array([v for _, v in pts], dtype=float)
    idx = np.clip(np.searchsorted(ends, steps, side="left"), 1, len(ends) - 1)
    weight = (steps - ends[idx - 1]) / (ends[idx] - ends[idx - 1])
    return steps, loss, np.stack([idx, weight])


def step_times(per_step: np.ndarray, n_steps: np.ndarray) -> np.ndarray:
    """Cumulative time at each window's end, ``[..., n]`` (a leading axis of replicates allowed)."""
    return np.cumsum(per_step * n_steps, axis=-1)


def times_at(ends: np.ndarray, where: np.ndarray) -> np.ndarray:
    """Times at evaluation steps from the window ends' times ``[..., n]`` and ``val_points``' (index, weight)."""
    start = np.zeros(ends.shape[:-1] + (1,))
    full = np.concatenate([start, ends], axis=-1)
    idx, w = where[0].astype(int), where[1]
    return full[..., idx - 1] * (1 - w) + full[..., idx] * w
