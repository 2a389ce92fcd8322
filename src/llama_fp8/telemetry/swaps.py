"""A training node replaced by a spare of the allocation (``SPARE_NODES``): what the run records about it.

The launchers pass the swaps since the workers' previous attempt in ``LLAMA_FP8_SWAPS`` (cluster/launch/spares.py:
the node that came in and the one left behind, why, and when the failure was seen). Rank 0 writes one ``swap``
record per swap to metrics.jsonl, and a log line, once the attempt's first step is done: how long it took from the
failure to that step, and what a requeue would have cost instead (``REQUEUE``: per cluster, with its source). The
A/B report lists them (report/repeats.py) and says which runs ran on other hardware (report/hardware.py).
"""

from __future__ import annotations

import json
import math
import os
import time

ENV = "LLAMA_FP8_SWAPS"
CLUSTER_ENV = "LLAMA_FP8_CLUSTER_KIND"
MAX_BYTES = 1 << 16
TEXT = 400

# What a requeue costs instead of a swap: (seconds at least, seconds at most or None, where the figure comes from).
REQUEUE: dict[str, tuple[float, float | None, str]] = {
    "hyperpod": (1200.0, 1800.0, "HyperPod replaces the node and auto-resume starts the job again: a node "
                 "replacement takes 20-30 min (awsome-distributed-training's HyperPod notes)"),
    "parallelcluster": (120.0, 1800.0, "the requeued job waits for a replacement static node: clustermgtd launches a "
                        "new instance that must boot and configure itself within ComputeNodeBootstrapTimeout (1800 s "
                        "by default); at least Slurm's hold of a requeued job (120 s); not measured here"),
    "slurm": (136.0, None, "Slurm holds a requeued job for AuthInfo cred_expire (120 s by default) before it may "
              "start again, then the job's start-up: 16 s from the requeue to its next step on the local cluster "
              "(benchmarks/bench_goodput.py, the hold shortened), plus any wait in the queue for nodes"),
}


def _text(value) -> str | None:
    return value[:TEXT] if isinstance(value, str) and value else None


def pending(env=None) -> list[dict]:
    """The swaps the launcher passed on (bounded, checked; a malformed value is ignored)."""
    raw = (os.environ if env is None else env).get(ENV, "")
    if not raw or len(raw) > MAX_BYTES:
        return []
    try:
        got = json.loads(raw)
    except ValueError:
        return []
    out = []
    for rec in got if isinstance(got, list) else []:
        when = rec.get("failed_at") if isinstance(rec, dict) else None
        if _text(rec.get("in") if isinstance(rec, dict) else None) and isinstance(when, (int, float)) \
                and not isinstance(when, bool) and math.isfinite(when):
            out.append({"node_in": _text(rec["in"]), "node_out": _text(rec.get("out")), "why": _text(rec.get("why")),
                        "failed_at": float(when)})
    return out


def record(swap: dict, step: int, now: float | None = None, env=None) -> dict:
    """metrics.jsonl's ``swap`` record for ``swap`` (``pending``), made when the attempt's first step ``step`` is
    done (``now``)."""
    now = time.time() if now is None else now
    kind = (os.environ if env is None else env).get(CLUSTER_ENV) or "slurm"
    kind = kind if kind in REQUEUE else "slurm"
    low, high, basis = REQUEUE[kind]
    return {"type": "swap", "step": step, "time": now, **swap, "failure_to_step_s": now - swap["failed_at"],
            "cluster": kind, "requeue_expected_s": [low, high], "requeue_basis": basis}


def line(rec: dict) -> str:
    """The log line of a ``swap`` record."""
    out = f"the place of {rec['node_out']}" if rec.get("node_out") else "the place of a node"
    low, high = rec["requeue_expected_s"]
    cost = f"{low / 60:.0f}-{high / 60:.0f} min" if high else f"at least {low / 60:.1f} min"
    return (f"swap: spare {rec['node_in']} took {out} ({rec.get('why') or 'no reason given'}); failure -> step "
            f"{rec['step']} in {rec['failure_to_step_s']:.1f} s, no requeue; a requeue would have cost {cost} "
            f"({rec['cluster']}: {rec['requeue_basis']})")
