"""Per-rank figures of every logging window: one small all-gather of each rank's step time, data wait
and GPU health (gpu_health.py), the ranks that held the others up, and the throttled nodes.

Each rank measures, over the window's steps, its mean step time without data wait (``step_s``), its
mean data wait (``data_wait_s``) and its mean time waiting in collectives (``comm_wait_s``). In synchronous
data-parallel training the collectives make every rank's step wall time nearly equal: a slow rank shows up as
the others waiting inside collectives, which host step timers cannot tell apart from work. So each rank's
``CommSampler`` looks at its training thread every ``SAMPLE_S`` and counts the looks that find it inside
torch.distributed (FSDP's all-gathers and reduce-scatters, our own agreements): the time it waited for the
others, and for the wire. A rank paused from outside (a noisy neighbour, SIGSTOP) or slower in its own work
spends less of its step there than the ranks that wait for it. A rank is named a straggler in a window when

- its own time per step (``step_s + data_wait_s``) is more than X % above the median rank's, or
- its data wait exceeds the median rank's by more than X % of the median time per step (its loader held
  every rank up), or
- its time in collectives is below the median rank's by more than X % of the median time per step (the
  others wait for it),

with X = ``--straggler_threshold_pct`` (default 10). On GPUs the NVML readings add the usual cause of a
slow rank: a throttled GPU (lower SM clock, thermal or power throttling), marked per node. (NCCL's
collectives do not block the host: there the host's time in collectives measures its syncs, not a GPU that
is slower than its peers; scoring ranks by their own kernel time, as NVIDIA's resiliency extension does with
CUPTI, is not done here.)
"""

from __future__ import annotations

import socket
import statistics
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

from llama_fp8.telemetry.gpu_health import FIELDS, GpuHealth, per_node

NAN = float("nan")
SAMPLE_S = 0.01
"""How often the sampler looks at the training thread (a look costs microseconds: well under 0.1 % of a core)."""
WAIT_CAUSE = "the others wait for it"


class CommSampler:
    """Counts, from a thread of its own, the looks that find ``thread`` (the training thread) inside
    torch.distributed: its time waiting in collectives, without touching the training code."""

    def __init__(self, thread: threading.Thread | None = None, interval: float = SAMPLE_S):
        self.ident = (thread or threading.main_thread()).ident
        self.interval, self.inside, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, name="llama-fp8-comm-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.inside += self._in_collective()

    def _in_collective(self) -> bool:
        """One look. No frame outlives it: a frame held until the next look would keep every caller's locals (the
        step's activations) alive past their last use."""
        frame = sys._current_frames().get(self.ident)
        try:
            while frame is not None:
                if "torch/distributed/" in frame.f_code.co_filename.replace("\\", "/"):
                    return True
                frame = frame.f_back
            return False
        finally:
            del frame

    def take(self) -> float:
        """Seconds found inside collectives since the last take."""
        n, self.inside = self.inside, 0
        return n * self.interval

    def close(self) -> None:
        """Stop and join the thread (a daemon thread still looking at frames while the interpreter shuts down can
        abort the process)."""
        self._stop.set()
        self._thread.join(timeout=1.0)


class RankMonitor:
    """Accumulates this rank's step times; ``window()`` (a collective: every rank calls it on logging
    steps) returns the record fields."""

    def __init__(self, device: torch.device, local_rank: int, threshold_pct: float, health: GpuHealth):
        self.device, self.threshold, self.health = device, threshold_pct / 100.0, health
        me = {"host": socket.gethostname(), "local_rank": local_rank}
        self.ranks = [me]
        self.sampler: CommSampler | None = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.ranks = [None] * dist.get_world_size()
            dist.all_gather_object(self.ranks, me)  # once: who is where
            self.sampler = CommSampler()
        self._reset()

    def _reset(self) -> None:
        self._steps, self._step_s, self._wait_s = 0, 0.0, 0.0

    def add_step(self, step_s: float, data_wait_s: float) -> None:
        self._steps += 1
        self._step_s += max(step_s - data_wait_s, 0.0)
        self._wait_s += data_wait_s

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()

    def window(self, mem_peak_gib: float | None = None, data_sum: int = 0) -> dict[str, Any]:
        """``mem_peak_gib``: this rank's memory high-water mark (the meter's), gathered with the rest so that the record
        holds every rank's. ``data_sum``: this rank's data fingerprint of the window (an integer below 2**32, exact in
        a float64), gathered with them: ``data_sums`` holds every rank's."""
        n = max(self._steps, 1)
        g = self.health.sample()
        comm = self.sampler.take() if self.sampler is not None else 0.0
        assert 0 <= data_sum < 2**32, data_sum
        mine = torch.tensor([self._step_s / n, self._wait_s / n, comm / n, NAN if mem_peak_gib is None else mem_peak_gib,
                             *(NAN if g[k] is None else g[k] for k in FIELDS), float(data_sum)], dtype=torch.float64)
        self._reset()
        if len(self.ranks) > 1:
            # NCCL gathers device tensors; gloo host ones. A dozen numbers per rank: no measurable cost.
            t = mine.to(self.device)
            out = [torch.empty_like(t) for _ in self.ranks]
            dist.all_gather(out, t)
            rows = [o.cpu().tolist() for o in out]
        else:
            rows = [mine.tolist()]
        ranks = [{"rank": i, **self.ranks[i], "step_s": r[0], "data_wait_s": r[1], "comm_wait_s": r[2],
                  "mem_peak_gib": None if r[3] != r[3] else r[3],
                  **{k: (None if v != v else v) for k, v in zip(FIELDS, r[4:-1])}}  # NaN -> None
                 for i, r in enumerate(rows)]
        nodes = per_node(ranks)
        return {"ranks": ranks, "data_sums": [int(r[-1]) for r in rows],
                "stragglers": find_stragglers(ranks, self.threshold),
                "gpu_health": self.health.status, "gpu_nodes": nodes,
                "throttled": any(v["throttle_thermal"] or v["throttle_power"] for v in nodes.values())}


def find_stragglers(ranks: list[dict[str, Any]], threshold: float) -> list[dict[str, Any]]:
    """The ranks named in one window (module docstring), slowest first, with how much slower they were."""
    if len(ranks) < 2:
        return []
    total = [r["step_s"] + r["data_wait_s"] for r in ranks]
    med_total, med_wait = statistics.median(total), statistics.median(r["data_wait_s"] for r in ranks)
    med_comm = statistics.median(r.get("comm_wait_s") or 0.0 for r in ranks)
    if med_total <= 0:
        return []
    named = []
    for r, t in zip(ranks, total):
        less_comm = med_comm - (r.get("comm_wait_s") or 0.0)
        causes = {"step time": (t - med_total) / med_total,
                  "data wait": (r["data_wait_s"] - med_wait) / med_total,
                  # a difference of a few samples is the sampler's own noise, whatever the step time
                  WAIT_CAUSE: less_comm / med_total if less_comm > 2 * SAMPLE_S else 0.0}
        cause, excess = max(causes.items(), key=lambda kv: kv[1])
        if causes["data wait"] > threshold:  # its own loader is why the others wait for it: the cause to name
            cause = "data wait"
        if excess > threshold:
            named.append({"rank": r["rank"], "host": r["host"], "local_rank": r["local_rank"],
                          "slower_pct": 100 * excess, "cause": cause})
    return sorted(named, key=lambda s: -s["slower_pct"])


def summary_line(stragglers: list[dict[str, Any]]) -> str | None:
    """One log line naming the window's stragglers (None when there are none)."""
    if not stragglers:
        return None
    return "Stragglers: " + ", ".join(f"rank {s['rank']} ({s['host']} GPU {s['local_rank']}) "
                                      f"+{s['slower_pct']:.0f} % ({s['cause']})" for s in stragglers)
