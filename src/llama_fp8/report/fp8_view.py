"""The report's "Seeing FP8" section: per run, the MFU lines with their convention, the FP8 coverage line,
the all-gather bytes line, the --fp8_exclude asked/resolved; for a run with --fp8_stats, heatmaps (layers x
logged steps) of underflow share and quantization SNR and the five worst layers.

Reads only run folders (metrics.jsonl, fp8_stats.jsonl, config.yaml); every file may be half-written: bad
lines are skipped and fp8_stats.jsonl is read up to ``MAX_STATS_BYTES``.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from llama_fp8.report.runs import Run

MAX_STATS_BYTES = 256 * 2**20


def _jsonl(path: Path, limit: int = MAX_STATS_BYTES) -> list[dict]:
    if not path.is_file():
        return []
    with path.open("rb") as fh:
        data = fh.read(limit)
    out = []
    for line in data.decode(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short (killed job, or the read limit)
        if isinstance(rec, dict):
            out.append(rec)
    return out


def run_dir(run: Run) -> Path | None:
    src = Path(run.source)
    return src.parent if src.name == "metrics.jsonl" else None


def per_layer(stats: list[dict]) -> dict[str, dict[int, dict[str, float | None]]]:
    """{layer: {step: {"underflow": worst of its tensors, "snr_db": lowest of its tensors}}}."""
    table: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in stats:
        try:
            layer, step, under, snr = str(r["layer"]), int(r["step"]), float(r["underflow"]), r.get("snr_db")
        except (KeyError, TypeError, ValueError):
            continue
        cell = table[layer].setdefault(step, {"underflow": 0.0, "snr_db": None})
        cell["underflow"] = max(cell["underflow"], under)
        if isinstance(snr, (int, float)):
            cell["snr_db"] = snr if cell["snr_db"] is None else min(cell["snr_db"], snr)
    return table


def worst_layers(table: dict, k: int = 5) -> list[tuple[str, float, float | None]]:
    """(layer, mean underflow share, lowest SNR dB) of the k layers with the most underflow, then lowest SNR."""
    rows = []
    for layer, steps in table.items():
        under = sum(c["underflow"] for c in steps.values()) / len(steps)
        snrs = [c["snr_db"] for c in steps.values() if c["snr_db"] is not None]
        rows.append((layer, under, min(snrs) if snrs else None))
    rows.sort(key=lambda r: (-r[1], r[2] if r[2] is not None else math.inf))
    return rows[:k]


def heatmap(table: dict, key: str, title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = list(table)
    steps = sorted({s for cells in table.values() for s in cells})
    grid = np.full((len(layers), len(steps)), np.nan)
    for i, layer in enumerate(layers):
        for j, step in enumerate(steps):
            v = table[layer].get(step, {}).get(key)
            grid[i, j] = np.nan if v is None else v
    fig, ax = plt.subplots(figsize=(max(4, 0.4 * len(steps) + 3), max(3, 0.18 * len(layers) + 1.5)))
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis" if key == "snr_db" else "magma")
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
    ax.set_yticks(range(len(layers)), layers, fontsize=6)
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mfu_lines(run: Run) -> list[str]:
    m = run.meta
    if not m:
        return []
    peak = m.get("peak_source") or "not recorded"
    out = [f"- MFU(bf16 peak) is against the dense BF16 peak {m.get('peak_tflops_bf16') or 'n/a'} TFLOPS"
           + (f", MFU(fp8 peak) against the dense FP8 peak {m.get('peak_tflops_fp8') or 'n/a'} TFLOPS"
              if str(m.get("precision", "")).startswith("fp8") else "") + f" ({m.get('device_name', '?')}: {peak})"]
    if m.get("flops_convention"):
        out.append(f"- FLOPs: {m['flops_convention']}")
    return out


def run_section(run: Run, tag: str, out: Path) -> list[str]:
    from llama_fp8.report import settings

    folder = run_dir(run)
    ran = settings.settings(run)
    lines = [f"### {tag}: {run.label}", ""] + _mfu_lines(run) + [f"- as run: {settings.line(ran)}"]
    lines += [f"- warned at start: {note}" for note in ran["notes"]]
    if folder is None:
        return lines + ["- (a log file: no FP8 records)", ""]
    checks = [r for r in _jsonl(folder / "metrics.jsonl") if r.get("type") == "fp8_check"]
    asked = (run.config.get("asked") or {}).get("fp8_exclude")
    resolved = ((run.config.get("resolved") or {}).get("precision") or {}).get("exclude")
    if asked or resolved:
        lines.append(f"- --fp8_exclude asked: `{asked}`; resolved: {resolved}")
    if checks:
        from llama_fp8.precision import verify

        c = checks[-1]
        lines.append(f"- {verify.coverage_line(c)}")
        if c.get("all_gather_bytes"):
            lines.append(f"- {verify.all_gather_line(c['all_gather_bytes'])}")
        if c.get("gemm_kernels") is not None:
            lines.append(f"- {verify.evidence_line(c)}")
        lines += [f"- note: {n}" for n in c.get("notes") or []]
        lines.append(f"- FP8 check: {'; '.join(c['problems']) if c.get('problems') else 'FP8 is on as asked'}")
    table = per_layer(_jsonl(folder / "fp8_stats.jsonl"))
    if table:
        slug = "".join(ch if ch.isalnum() else "_" for ch in tag.lower())
        under = heatmap(table, "underflow", f"{run.label}: underflow share (worst tensor)", out / f"fp8_underflow_{slug}.png")
        snr = heatmap(table, "snr_db", f"{run.label}: quantization SNR dB (lowest tensor)", out / f"fp8_snr_{slug}.png")
        lines += ["", "| worst layers | mean underflow share | lowest SNR dB |", "|---|---|---|"]
        for layer, u, s in worst_layers(table):
            lines.append(f"| {layer} | {u:.2e} | {'n/a' if s is None else f'{s:.1f}'} |")
        lines += ["", f"![underflow]({under.name})", f"![snr]({snr.name})"]
    return lines + [""]


def markdown(runs: list[Run], out: Path) -> str:
    """The section text (plots written into ``out``)."""
    lines = ["## Seeing FP8", "", "MFU convention: always against the GPU's dense BF16 peak, and for FP8 runs also "
             "against its dense FP8 peak (datasheet figures without sparsity); causal attention FLOPs counted "
             "in full.", ""]
    for tag, run in zip("AB", runs, strict=False):
        lines += run_section(run, tag, out)
    return "\n".join(lines)
