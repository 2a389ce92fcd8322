"""Rendering of the A/B compare report: the markdown tables and the PNG plots (both runs overlaid,
labelled by precision). runs.py loads, compare.py summarises; this file only presents.

Plots use ``matplotlib.figure.Figure`` directly (Agg canvas, no pyplot state), so it works headless on
compute nodes and never touches a display backend.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from llama_fp8.report import equal_quality, hardware, ranks, repeats, repro, stats

if TYPE_CHECKING:
    from llama_fp8.report.runs import Run

# (record key, table label, always shown). Rates are work / time over the kept windows (compare.summarize_run),
# memory the max, the data-wait share the median.
METRICS: list[tuple[str, str, bool]] = [
    ("samples_per_sec", "samples/s (global)", True),
    ("samples_per_sec_per_device", "samples/s/device", False),
    ("tokens_per_sec_per_device", "tokens/s/device", True),
    ("tflops_per_device", "TFLOPS/device", True),
    ("mfu_vs_bf16_peak", "MFU vs BF16 peak", True),
    ("mfu_vs_fp8_peak", "MFU vs FP8 peak", False),
    ("mem_peak_gib", "peak memory GiB (max)", True),
    ("data_wait_frac", "data-wait share", False),
]
COLORS = ("tab:blue", "tab:orange")
TAGS = ("A", "B")


# ----------------------------------------------------------------------------- markdown
def fmt(x: float | None, kind: str = "num") -> str:
    """Format a table cell; None -> 'n/a' (never a made-up value)."""
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return str(x)
    if kind == "pct":
        return f"{100 * x:.4g} %"
    if kind == "loss":
        return f"{x:.4f}"
    return f"{x:.1f}" if abs(x) >= 1000 else f"{x:.4g}"


def _gap(g: float | None) -> str:
    return "n/a" if g is None else f"{g:+.3f} %"


def same_data_text(data: dict[str, Any] | None) -> str:
    """One line on compare's same-data check (``summary["data"]``)."""
    if not data or data["same"] is None:
        return "not checked (a run has no data fingerprints in common with the other: a plain log, or no common window)"
    if data["same"]:
        return f"yes (rank 0's token fingerprints equal in all {data['windows_compared']} common logged windows)"
    return f"**NO**: the fingerprints differ from the window ending at step {data['first_different_step']}"


def render_report(summary: dict[str, Any], plots: dict[str, Path]) -> str:
    """The markdown report text (plots referenced by file name, next to report.md)."""
    sa, sb, ls = summary["run_a"], summary["run_b"], summary["loss"]
    la, lb = f"A: {sa['label']}", f"B: {sb['label']}"
    lines = [f"# A/B report: {sa['label']} (A) vs {sb['label']} (B)", ""]
    if summary.get("headline"):
        lines += [f"**Headline:** {summary['headline']}", ""]
    lines += ["| run | source | format | last step | steps excluded (<=) | records used |",
             "|---|---|---|---|---|---|"]
    for tag, s in (("A", sa), ("B", sb)):
        lines.append(f"| {tag}: {s['label']} | `{s['source']}` | {s['kind']} | {s['last_step']} "
                     f"| {s['warmup_steps_excluded']} | {s['records_used']} |")
    lines += [""] + hardware.markdown(summary.get("environment"), sa["label"], sb["label"])
    for tag, s in (("A", sa), ("B", sb)):
        if s["fp8_emulated"]:
            lines += ["", f"> Run {tag} emulated FP8 on a CPU (or on a GPU without the format's tensor cores): "
                      "its speed numbers say nothing about FP8 hardware and its MFU is left blank; the loss "
                      "comparison stands."]
    ab = summary.get("ab")
    lines += ["", "## Throughput and memory", ""]
    if ab:  # the one speed-up: B's samples/s rate over A's (across pairs: their geometric mean, with a CI)
        lines += [f"**Speed-up B/A (samples/s): {ab['speed'][repeats.HEADLINE]['text']}**", ""]
    lines += [f"| metric | {la} | {lb} |", "|---|---|---|"]
    for key, label, always in METRICS:
        if always or sa[key] is not None or sb[key] is not None:
            kind = "pct" if key.startswith("mfu") or key == "data_wait_frac" else "num"
            lines.append(f"| {label} | {fmt(sa[key], kind)} | {fmt(sb[key], kind)} |")
    span = (f"steps {ls['train_steps'][0]}-{ls['train_steps'][1]}" if ls["train_steps"]
            else "each run's own last records: the runs share no logged step")
    vstep = f"step {ls['val_step']}" if ls["val_step"] is not None else "each run's last evaluation"
    lines += ["", "## Loss", "", f"| metric | {la} | {lb} | gap (B-A)/A |", "|---|---|---|---|",
              f"| final train loss (mean of last {ls['k']} logged, {span}) | {fmt(ls['train_loss_a'], 'loss')} "
              f"| {fmt(ls['train_loss_b'], 'loss')} | {_gap(ls['train_gap_pct'])} |",
              f"| final validation loss ({vstep}) | {fmt(ls['val_loss_a'], 'loss')} "
              f"| {fmt(ls['val_loss_b'], 'loss')} | {_gap(ls['val_gap_pct'])} |", ""]
    if summary.get("equal_quality"):
        lines += equal_quality.markdown(summary["equal_quality"], la, lb, ab and ab["verdict"])
    if summary.get("prediction") and ab:
        from llama_fp8.report import prediction_view

        lines += prediction_view.markdown(summary["prediction"], ab["speed"][repeats.HEADLINE]["text"])
    if ab:
        lines += repeats.markdown(ab, la, lb)
    if summary.get("ranks"):
        lines += ranks.markdown(summary["ranks"], la, lb)
    lines += [f"**Verdict: {summary['verdict_line']}** (tolerance {summary['loss_tolerance_pct']:g} %)", "",
              f"Same training data: {same_data_text(summary.get('data'))}", ""]
    if summary.get("repro"):
        lines += repro.markdown(summary["repro"])
    if plots:
        lines += ["## Plots", ""] + [f"![{k}]({p.name})" for k, p in plots.items()] + [""]
    lines += ["## Method", "",
              "- Throughput, TFLOPS and MFU: each run's rate over its logged windows after the excluded steps "
              "(default: 10 % of the last step, at least the first logged window): work / time, the harmonic "
              "mean of the window rates. Data-wait: median share. Peak memory: max.",
              "- Speed-up (the one stated above): B's samples/s rate over A's; across pairs the geometric mean "
              "of the pairs' ratios. The other rate rows of the speed-up table are the same ratio of their "
              "own metric.",
              "- MFU is shown as a percentage of the named dense peak: always the GPU's dense BF16 peak, "
              "and for FP8 runs also its dense FP8 peak (NVIDIA datasheets, sparsity figures halved); `n/a` "
              "means the run did not record it (CPU, an unknown or ambiguous GPU, a MIG slice) — nothing is "
              "estimated here.",
              "- FLOPs per token: `6*N + 12*layers*heads*head_dim*seq`, causal attention counted in full "
              "(not halved for the mask).",
              "- Final train loss: mean of the last k = max(5, 5 % of records) losses on steps both runs "
              "logged. Noise band: max |final-loss gap| between the baseline runs of different seeds. "
              "Verdict: PASS when the mean gap over pairs is within max(tolerance, noise band); the "
              "wider of the two decided.",
              "- Speed-up intervals: percentile bootstrap (4000 draws) of the B/A ratio of harmonic-mean "
              "window rates; within a pair the windows are resampled, across pairs the pairs and then "
              "their windows (geometric mean of the pair ratios).",
              "- Iso-loss speed-up: the time A needs to reach its own final smoothed train loss over the time B "
              "needs to reach it (a crossing counts when the smoothed loss stays at or below it); not reached: B's "
              "gap to it at A's time. Iso-time gap: both smoothed losses at the shorter arm's end. Intervals: "
              "bootstrap of the loss noise and the windows' times, across pairs the pairs too (docs/report.md).", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots
def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that carry a finite ``key``."""
    pts = [(r["step"], float(r[key])) for r in records
           if r.get(key) is not None and math.isfinite(float(r[key]))]
    return [s for s, _ in pts], [v for _, v in pts]


def _new_figure(rows: int = 1) -> tuple[Figure, list[Any]]:
    # Fixed margins: a layout engine measures every artist and doubles the time of a plot.
    fig = Figure(figsize=(8, 4.5 if rows == 1 else 6.5), dpi=110)
    fig.subplots_adjust(left=0.1, right=0.97, top=0.93, bottom=0.11 if rows == 1 else 0.08, hspace=0.08)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [3, 1.4][:rows]})[:, 0]
    return fig, list(axes)


def _style(ax: Any, ylabel: str, xlabel: str | None = "step") -> None:
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are integers
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)


def _metric_plot(runs: list[Run], warmups: list[int], key: str, ylabel: str, title: str,
                 path: Path) -> Path | None:
    """One metric vs step for both runs, with the excluded warm-up shaded and each run's rate (or median)."""
    fig, (ax,) = _new_figure()
    drawn = False
    for run, warm, color, tag in zip(runs, warmups, COLORS, TAGS):
        steps, vals = _series(run.train, key)
        if not steps:
            continue
        drawn = True
        ax.plot(steps, vals, color=color, marker="." if len(steps) <= 60 else None,
                lw=1.2, label=f"{tag}: {run.label}")
        kept = [v for s, v in zip(steps, vals) if s > warm]
        level = stats.rate(kept) if key in repeats.RATE_KEYS else (statistics.median(kept) if kept else None)
        if level is not None:
            name = "rate" if key in repeats.RATE_KEYS else "median"
            ax.axhline(level, color=color, ls="--", lw=0.9, alpha=0.8, label=f"{tag} {name} {level:.4g}")
    if not drawn:
        return None
    warm = max(warmups)
    if warm > 0:
        ax.axvspan(ax.get_xlim()[0], warm, color="grey", alpha=0.15, label="excluded warm-up")
    ax.set_title(title)
    _style(ax, ylabel)
    fig.savefig(path)
    return path


def _loss_plot(runs: list[Run], tolerance: float, path: Path) -> Path | None:
    """Train loss of both runs; below it the per-step gap (B-A)/A with the +-tolerance band."""
    series = [_series(r.train, "loss") for r in runs]
    common = sorted(set(series[0][0]) & set(series[1][0]))
    fig, axes = _new_figure(2 if common else 1)
    for run, (steps, vals), color, tag in zip(runs, series, COLORS, TAGS):
        if steps:
            axes[0].plot(steps, vals, color=color, lw=1.2, marker="." if len(steps) <= 60 else None,
                         label=f"{tag}: {run.label}")
    if not any(s for s, _ in series):
        return None
    axes[0].set_title("Training loss")
    _style(axes[0], "train loss", None if common else "step")
    if common:
        la, lb = (dict(zip(*s)) for s in series)
        gaps = [(lb[s] - la[s]) / la[s] * 100 for s in common if la[s] != 0]
        steps = [s for s in common if la[s] != 0]
        axes[1].axhspan(-tolerance, tolerance, color="green", alpha=0.12, label=f"+-{tolerance:g} %")
        axes[1].axhline(0, color="black", lw=0.6)
        axes[1].plot(steps, gaps, color="tab:red", lw=1.0, label="(B-A)/A per step")
        _style(axes[1], "loss gap %")
    fig.savefig(path)
    return path


def _val_plot(runs: list[Run], path: Path) -> Path | None:
    """Validation loss of both runs (only written when at least one run evaluated)."""
    if not any(r.val for r in runs):
        return None
    fig, (ax,) = _new_figure()
    for run, color, tag in zip(runs, COLORS, TAGS):
        steps, vals = _series(run.val, "val_loss")
        if steps:
            ax.plot(steps, vals, color=color, marker="o", lw=1.2, label=f"{tag}: {run.label}")
    ax.set_title("Validation loss")
    _style(ax, "validation loss")
    fig.savefig(path)
    return path


def plot_all(runs: list[Run], warmups: list[int], out_dir: Path, tolerance: float) -> dict[str, Path]:
    """Write every plot that has data; returns {name: path} in report order."""
    candidates = {
        "throughput": _metric_plot(runs, warmups, "samples_per_sec", "samples/s (global)",
                                   "Throughput", out_dir / "throughput.png"),
        "tflops": _metric_plot(runs, warmups, "tflops_per_device", "TFLOPS/device",
                               "Achieved TFLOPS per device", out_dir / "tflops.png"),
        "train_loss": _loss_plot(runs, tolerance, out_dir / "train_loss.png"),
        "val_loss": _val_plot(runs, out_dir / "val_loss.png"),
    }
    for name, path in candidates.items():  # drop a stale plot left by an earlier compare here
        stale = out_dir / f"{name}.png"
        if path is None and stale.exists():
            stale.unlink()
    return {name: path for name, path in candidates.items() if path is not None}
