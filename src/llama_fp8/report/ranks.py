"""The report's per-rank view: stragglers (a rank x window heat strip, repeat offenders) and GPU
throttling per arm, from the ``ranks``/``stragglers``/``throttled`` fields of the window records
(telemetry/stragglers.py). When the arms differ in throttling, their speeds are not comparable.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matplotlib.figure import Figure

if TYPE_CHECKING:
    from llama_fp8.report.runs import Run

THROTTLE_DIFF = 0.10  # arms whose shares of throttled windows differ by more than this are not comparable


def slowness(run: Run) -> tuple[list[int], list[list[float]]]:
    """(window steps, rows[rank][window]): each rank's time per step over the window's median rank, in %."""
    steps, cols = [], []
    for rec in run.train:
        ranks = rec.get("ranks")
        if not isinstance(ranks, list) or not ranks:
            continue
        totals = [float(r.get("step_s") or 0) + float(r.get("data_wait_s") or 0) for r in ranks]
        med = statistics.median(totals)
        steps.append(rec["step"])
        cols.append([100 * (t - med) / med if med > 0 else 0.0 for t in totals])
    width = max((len(c) for c in cols), default=0)
    rows = [[c[i] if i < len(c) else float("nan") for c in cols] for i in range(width)]
    return steps, rows


def arm_view(runs: list[Run]) -> dict[str, Any]:
    """Stragglers and throttling over all runs of one arm."""
    offenders: Counter[str] = Counter()
    windows = throttled = measured = 0
    statuses, nodes_throttled = set(), set()
    for run in runs:
        for rec in run.train:
            if "ranks" not in rec:
                continue
            windows += 1
            for s in rec.get("stragglers") or []:
                offenders[f"rank {s.get('rank')} ({s.get('host')} GPU {s.get('local_rank')})"] += 1
            statuses.add(str(rec.get("gpu_health")))
            if str(rec.get("gpu_health")) == "measured":
                measured += 1
                if rec.get("throttled"):
                    throttled += 1
                    nodes_throttled |= {h for h, v in (rec.get("gpu_nodes") or {}).items()
                                        if v.get("throttle_thermal") or v.get("throttle_power")}
    return {"windows": windows, "straggler_windows": dict(offenders.most_common()),
            "repeat_offenders": [k for k, n in offenders.most_common() if n >= 2],
            "gpu_measured_windows": measured, "throttled_windows": throttled,
            "throttled_nodes": sorted(nodes_throttled), "gpu_health": sorted(statuses)}


def comparability(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool | None, str]:
    """(comparable?, why): None when throttling was not measured on both arms."""
    if not a["gpu_measured_windows"] or not b["gpu_measured_windows"]:
        why = "; ".join(sorted(set(a["gpu_health"]) | set(b["gpu_health"]) - {"measured"}))
        return None, f"throttling {why or 'not measured (no per-rank records)'}"
    fa, fb = (x["throttled_windows"] / x["gpu_measured_windows"] for x in (a, b))
    if (fa > 0) != (fb > 0) or abs(fa - fb) > THROTTLE_DIFF:
        return False, (f"speed not comparable: throttled windows A {100 * fa:.0f} % vs B {100 * fb:.0f} % "
                       f"(nodes A {', '.join(a['throttled_nodes']) or '-'}; B {', '.join(b['throttled_nodes']) or '-'})")
    return True, f"throttling alike (throttled windows A {100 * fa:.0f} %, B {100 * fb:.0f} %)"


def heat_strip(runs: list[Run], labels: list[str], path: Path) -> Path | None:
    """Rank x window strips (one per run): how much slower each rank was than the median, in %."""
    data = [(label, *slowness(r)) for r, label in zip(runs, labels)]
    data = [d for d in data if d[1] and len(d[2]) > 1]
    if not data:
        return None
    fig = Figure(figsize=(8, 1.2 + 1.4 * len(data)), dpi=110)
    axes = fig.subplots(len(data), 1, squeeze=False)[:, 0]
    top = max(10.0, max(abs(v) for _, _, rows in data for row in rows for v in row if v == v))
    for ax, (label, steps, rows) in zip(axes, data):
        im = ax.imshow(rows, aspect="auto", cmap="coolwarm", vmin=-top, vmax=top, interpolation="nearest",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, len(rows) - 0.5, -0.5))
        ax.set_ylabel(f"{label}\nrank")
        ax.set_yticks(range(len(rows)))
    axes[-1].set_xlabel("logging window (last step)")
    fig.colorbar(im, ax=list(axes), label="% slower than the median rank")
    fig.savefig(path)
    return path


def markdown(view: dict[str, Any], la: str, lb: str) -> list[str]:
    a, b = view["a"], view["b"]
    lines = ["## Stragglers and throttling", "",
             f"| | {la} | {lb} |", "|---|---|---|",
             f"| windows with per-rank figures | {a['windows']} | {b['windows']} |",
             f"| ranks named (windows) | {_named(a)} | {_named(b)} |",
             f"| repeat offenders (named in >= 2 windows) | {', '.join(a['repeat_offenders']) or 'none'} "
             f"| {', '.join(b['repeat_offenders']) or 'none'} |",
             f"| GPU throttled windows | {_thr(a)} | {_thr(b)} |", "",
             f"Throttling: {view['comparable_line']}", ""]
    if view.get("plot"):
        lines += [f"![rank x window]({Path(view['plot']).name})", ""]
    return lines


def _named(x: dict[str, Any]) -> str:
    return ", ".join(f"{k} ({n})" for k, n in x["straggler_windows"].items()) or "none"


def _thr(x: dict[str, Any]) -> str:
    if not x["gpu_measured_windows"]:
        return "not measured"
    nodes = f" on {', '.join(x['throttled_nodes'])}" if x["throttled_nodes"] else ""
    return f"{x['throttled_windows']} of {x['gpu_measured_windows']}{nodes}"
