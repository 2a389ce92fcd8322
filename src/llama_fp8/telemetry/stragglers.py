"""Per-rank figures of every logging window: one small all-gather of each rank's step time, data wait
and GPU health (gpu_health.py), the ranks that held the others up, and the throttled nodes.

Each rank measures, over the window's steps, its mean step time without data wait (``step_s``) and its
mean data wait (``data_wait_s``). In synchronous data-parallel training the collectives make every
rank's step wall time nearly equal: a slow rank shows up as the others waiting inside collectives, which
host timers cannot tell apart from work. What stays per-rank is what a rank does before it joins a
collective: its input pipeline. So a rank is named a straggler in a window when

- its own time per step (``step_s + data_wait_s``) is more than X % above the median rank's, or
- its data wait exceeds the median rank's by more than X % of the median time per step (its loader held
  every rank up),

with X = ``--straggler_threshold_pct`` (default 10). On GPUs the NVML readings add the usual cause of a
slow rank: a throttled GPU (lower SM clock, thermal or power throttling), marked per node.
"""

from __future__ import annotations

import socket
import statistics
from typing import Any

import torch
import torch.distributed as dist

from llama_fp8.telemetry.gpu_health import FIELDS, GpuHealth, per_node

NAN = float("nan")


class RankMonitor:
    """Accumulates this rank's step times; ``window()`` (a collective: every rank calls it on logging
    steps) returns the record fields."""

    def __init__(self, device: torch.device, local_rank: int, threshold_pct: float, health: GpuHealth):
        self.device, self.threshold, self.health = device, threshold_pct / 100.0, health
        me = {"host": socket.gethostname(), "local_rank": local_rank}
        self.ranks = [me]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.ranks = [None] * dist.get_world_size()
            dist.all_gather_object(self.ranks, me)  # once: who is where
        self._reset()

    def _reset(self) -> None:
        self._steps, self._step_s, self._wait_s = 0, 0.0, 0.0

    def add_step(self, step_s: float, data_wait_s: float) -> None:
        self._steps += 1
        self._step_s += max(step_s - data_wait_s, 0.0)
        self._wait_s += data_wait_s

    def window(self, mem_peak_gib: float | None = None) -> dict[str, Any]:
        """``mem_peak_gib``: this rank's memory high-water mark (the meter's), gathered with the rest so that the record
        holds every rank's."""
        n = max(self._steps, 1)
        g = self.health.sample()
        mine = torch.tensor([self._step_s / n, self._wait_s / n, NAN if mem_peak_gib is None else mem_peak_gib,
                             *(NAN if g[k] is None else g[k] for k in FIELDS)], dtype=torch.float64)
        self._reset()
        if len(self.ranks) > 1:
            # NCCL gathers device tensors; gloo host ones. 8 numbers per rank: no measurable cost.
            t = mine.to(self.device)
            out = [torch.empty_like(t) for _ in self.ranks]
            dist.all_gather(out, t)
            rows = [o.cpu().tolist() for o in out]
        else:
            rows = [mine.tolist()]
        ranks = [{"rank": i, **self.ranks[i], "step_s": r[0], "data_wait_s": r[1],
                  "mem_peak_gib": None if r[2] != r[2] else r[2],
                  **{k: (None if v != v else v) for k, v in zip(FIELDS, r[3:])}}  # NaN -> None
                 for i, r in enumerate(rows)]
        nodes = per_node(ranks)
        return {"ranks": ranks, "stragglers": find_stragglers(ranks, self.threshold),
                "gpu_health": self.health.status, "gpu_nodes": nodes,
                "throttled": any(v["throttle_thermal"] or v["throttle_power"] for v in nodes.values())}


def find_stragglers(ranks: list[dict[str, Any]], threshold: float) -> list[dict[str, Any]]:
    """The ranks named in one window (module docstring), slowest first, with how much slower they were."""
    if len(ranks) < 2:
        return []
    total = [r["step_s"] + r["data_wait_s"] for r in ranks]
    med_total, med_wait = statistics.median(total), statistics.median(r["data_wait_s"] for r in ranks)
    if med_total <= 0:
        return []
    named = []
    for r, t in zip(ranks, total):
        slower = (t - med_total) / med_total
        held_up = (r["data_wait_s"] - med_wait) / med_total
        if slower > threshold or held_up > threshold:
            named.append({"rank": r["rank"], "host": r["host"], "local_rank": r["local_rank"],
                          "slower_pct": 100 * max(slower, held_up),
                          "cause": "data wait" if held_up >= slower else "step time"})
    return sorted(named, key=lambda s: -s["slower_pct"])


def summary_line(stragglers: list[dict[str, Any]]) -> str | None:
    """One log line naming the window's stragglers (None when there are none)."""
    if not stragglers:
        return None
    return "Stragglers: " + ", ".join(f"rank {s['rank']} ({s['host']} GPU {s['local_rank']}) "
                                      f"+{s['slower_pct']:.0f} % ({s['cause']})" for s in stragglers)
