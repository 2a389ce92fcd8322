"""The A/B report's "at equal quality" figures for R pairs of runs: the iso-loss speed-up (train, and validation
where both arms evaluated) and the iso-time loss gap, each with its 95 % interval over pairs (isoloss.py has the
definitions), their report section and the headline that puts them beside the raw speed-up and the verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from llama_fp8.report import isocurves, isoloss, stats

if TYPE_CHECKING:
    from llama_fp8.report.runs import Run

KINDS = ("train", "validation")


def _pair(a: Run, b: Run, warm: tuple[int, int], axis: str, k: int, seed: int, n_boot: int
          ) -> dict[str, tuple[dict, dict]]:
    """{kind: (point figures, draws)} of one pair; a kind is missing where the runs cannot give it."""
    ba, bb = isocurves.batch_of(a), isocurves.batch_of(b)
    batch = (ba, bb) if ba and bb else (None, None)
    ca, cb = (isocurves.train_curve(r, w, axis, x) for r, w, x in zip((a, b), warm, batch))
    rng = np.random.default_rng(seed)
    draws = [(isoloss.draw_losses(c, k, rng, n_boot), isoloss.draw_per_step(c, rng, n_boot)) for c in (ca, cb)]
    point = [(c.loss[None, :], c.per_step[None, :]) for c in (ca, cb)]
    out = {}
    for kind in KINDS:
        val = None
        if kind == "validation":
            val = [isocurves.val_points(r, c) for r, c in ((a, ca), (b, cb))]
            if min(len(v[0]) for v in val) < 2:
                continue
        hold = 1 if val else k
        res = []
        for (la, sa), (lb, sb) in (point, draws):
            sides = [isoloss.sides(c, k, lo, ps, v) for c, lo, ps, v in
                     zip((ca, cb), (la, lb), (sa, sb), val or (None, None))]
            res.append(isoloss.figures(*sides, hold))
        out[kind] = (res[0], res[1])
    out["seconds"] = ca.seconds and cb.seconds
    return out


def summarize(pairs: list[tuple[Run, Run]], warm: list[tuple[int, int]], window: int | None, axis: str,
              default_window, n_boot: int = stats.N_BOOT) -> dict[str, Any]:
    """summary.json's ``equal_quality``: per kind the pairs' figures, the across-pair speed-up and iso-time gap
    with their intervals and texts; ``available: False`` with the reason when the runs cannot give them."""
    k = window or default_window(len(pairs[0][0].train))
    base = {"time_axis": axis, "window": k, "hold": k, "pairs": len(pairs)}
    try:
        per_pair = [_pair(a, b, w, axis, k, i, n_boot) for i, ((a, b), w) in enumerate(zip(pairs, warm))]
    except isocurves.Unavailable as e:
        return {**base, "available": False, "why": str(e)}
    base.update(available=True, seconds=all(p["seconds"] for p in per_pair))
    for kind in KINDS:
        got = [p[kind] for p in per_pair if kind in p]
        if len(got) < len(per_pair):
            base[kind] = {"available": False, "why": "not every run of every pair evaluated twice or more"
                          if kind == "validation" else "no train losses"}
            continue
        base[kind] = _kind_summary(got, base["seconds"], len(pairs))
    return base


def _kind_summary(got: list[tuple[dict, dict]], seconds: bool, n: int) -> dict[str, Any]:
    rows = []
    for point, _ in got:
        row = {key: float(v[0]) for key, v in point.items()}
        reached = row["log_ratio"] > isoloss.NOT_REACHED / 2
        row["speedup"] = float(np.exp(row.pop("log_ratio"))) if reached else None
        row["reached"] = bool(reached)
        rows.append(row)
    ratio = isoloss.combine_ratio([r["speedup"] for r in rows], [d["log_ratio"] for _, d in got], seed=n)
    gap = isoloss.combine_mean([r["iso_gap_pct"] for r in rows], [d["iso_gap_pct"] for _, d in got], seed=n + 1)
    return {"available": True, "pairs": rows, "speedup": vars(ratio), "iso_gap": vars(gap),
            "text": ratio_text(ratio, rows, n, seconds), "iso_gap_text": gap_text(gap, rows, seconds)}


def _when(t: float, seconds: bool) -> str:
    return f"{t:.4g} s" if seconds else f"time {t:.4g} (per sample: no global batch size recorded)"


def ratio_text(r: isoloss.Interval, rows: list[dict], n: int, seconds: bool) -> str:
    """``1.21x, 95 % CI 1.15-1.27, 2 pairs`` or ``not reached (pair 1: +0.84 % above the target at 812 s)``."""
    unit = f"{n} pair" + ("s" if n != 1 else "")
    if r.point is None:
        missed = "; ".join(f"pair {i}: {row['gap_at_end_pct']:+.3f} % above the target at "
                           f"{_when(row['gap_at'], seconds)}" for i, row in enumerate(rows, 1) if not row["reached"])
        return f"not reached ({missed})"
    if r.low is None:
        high = "not reached" if r.high is None else f"{r.high:.3g}"
        return f"{r.point:.3g}x, 95 % CI up to {high} (the target missed in {100 * r.missed:.1f} % of draws), {unit}"
    return f"{r.point:.3g}x, 95 % CI {r.low:.3g}-{r.high:.3g}, {unit}"


def gap_text(g: isoloss.Interval, rows: list[dict], seconds: bool) -> str:
    at = min(row["iso_time"] for row in rows)
    return f"{g.point:+.3f} %, 95 % CI {g.low:+.3f} to {g.high:+.3f} % (at {_when(at, seconds)}, the shorter arm's end)"


def text(eq: dict[str, Any], kind: str) -> str:
    """The iso-loss speed-up line of one kind, or why it is not there."""
    if not eq.get("available"):
        return f"n/a ({eq.get('why')})"
    part = eq.get(kind) or {}
    return part["text"] if part.get("available") else f"n/a ({part.get('why', 'not computed')})"


def headline(raw: str, eq: dict[str, Any], verdict: dict[str, Any], emulated: bool) -> str:
    """Raw speed-up, iso-loss speed-up and the verdict, each with its interval (the verdict's: the gap and its bar)."""
    gaps = "; ".join(f"{k} gap {g['gap_pct']:+.3f} % within +-{g['bar_pct']:.3g} %" if g["within"] else
                     f"{k} gap {g['gap_pct']:+.3f} % beyond +-{g['bar_pct']:.3g} %" for k, g in verdict["gaps"].items())
    line = (f"raw speed-up {raw} | iso-loss speed-up {text(eq, 'train')} | verdict "
            f"{'PASS' if verdict['ok'] else 'FAIL'} ({gaps or 'no loss gap'})")
    if emulated:
        line += (" | FP8 emulated on a CPU (no FP8 tensor cores): both speed-ups are emulation's cost, below 1 by "
                 "construction; only the loss comparison means something here")
    return line


def _matched(verdict: dict[str, Any] | None, kind: str) -> str:
    """``; matched-step gap +0.07 % (the verdict's)``, or nothing without one."""
    g = (verdict or {}).get("gaps", {}).get(kind)
    return f"; matched-step gap {g['gap_pct']:+.3f} % (the verdict's, mean over pairs)" if g else ""


def markdown(eq: dict[str, Any], la: str, lb: str, verdict: dict[str, Any] | None = None) -> list[str]:
    """The report's section (``verdict``: the A/B's, for the matched-step gap beside the iso-time one)."""
    lines = ["## At equal quality: iso-loss speed-up and iso-time loss gap", ""]
    if not eq.get("available"):
        return lines + [f"Not computed: {eq.get('why')}.", ""]
    axis = {"productive": "productive training time (start-up left out; warm-up windows at the run's steady rate)",
            "measured": "training time as measured after start-up (warm-up windows included)",
            "elapsed": "elapsed time since the training loop started (evaluation and saves included)"}[eq["time_axis"]]
    lines += [f"Time: {axis}. Smoothing: the mean of {eq['window']} consecutive logged train losses; a crossing "
              f"counts when the next {eq['hold']} smoothed points stay at or below the target (validation: not "
              f"smoothed, the next evaluation stays below). Intervals: bootstrap over pairs, loss noise and window "
              f"times (docs/report.md).", ""]
    for kind in KINDS:
        part = eq[kind]
        if not part.get("available"):
            lines += [f"**{kind.capitalize()}**: n/a ({part['why']})", ""]
            continue
        lines += [f"**{kind.capitalize()} iso-loss speed-up B/A: {part['text']}**; iso-time gap (B-A)/A: "
                  f"{part['iso_gap_text']}{_matched(verdict, kind)}", "",
                  f"| pair | target: {la} final loss | {la} reaches it | {lb} reaches it | iso-loss speed-up | "
                  f"iso-time | loss {la} | loss {lb} | iso-time gap |", "|---|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(part["pairs"], 1):
            tb = f"{r['t_b']:.4g}" if r["reached"] else f"not reached ({r['gap_at_end_pct']:+.3f} % at {r['gap_at']:.4g})"
            sp = f"{r['speedup']:.3g}x" if r["reached"] else "not reached"
            lines.append(f"| {i} | {r['target']:.4f} | {r['t_a']:.4g} | {tb} | {sp} | {r['iso_time']:.4g} | "
                         f"{r['iso_loss_a']:.4f} | {r['iso_loss_b']:.4f} | {r['iso_gap_pct']:+.3f} % |")
        lines.append("")
    if not eq["seconds"]:
        lines += ["Times are per sample (a run without its global batch size: a plain log); the ratios stand.", ""]
    return lines


def add_to(summary: dict[str, Any], pairs: list[tuple[Run, Run]], warm: list[tuple[int, int]], window: int | None,
           axis: str, default_window) -> None:
    """compare's summary gets ``equal_quality``, ``headline`` (the raw speed-up, the iso-loss speed-up and the verdict
    with their intervals; the emulation note when either arm emulated FP8) and ``prediction`` (the candidate's
    predicted speed-up from published figures, prediction_view.py)."""
    eq = summarize(pairs, warm, window, axis, default_window)
    summary["equal_quality"] = eq
    emulated = summary["run_a"]["fp8_emulated"] or summary["run_b"]["fp8_emulated"]
    summary["headline"] = headline(summary["ab"]["speed"]["samples_per_sec"]["text"], eq, summary["ab"]["verdict"],
                                   emulated)
    from llama_fp8.report import prediction_view

    summary["prediction"] = prediction_view.predicted(pairs[0][1])


def cli_lines(summary: dict[str, Any]) -> list[str]:
    """compare's last lines: the iso-loss figures, then the headline (the A/B job's log ends with them)."""
    eq = summary["equal_quality"]
    why = (" (FP8 emulated on a CPU: slower than BF16 by construction, so below 1; on FP8 hardware it measures what FP8 "
           "buys at equal quality)" if summary["run_a"]["fp8_emulated"] or summary["run_b"]["fp8_emulated"] else "")
    lines = [f"iso-loss speed-up B/A (train): {text(eq, 'train')}{why}",
             f"iso-loss speed-up B/A (validation): {text(eq, 'validation')}"]
    if eq.get("available") and eq["train"].get("available"):
        lines.append(f"iso-time loss gap (B-A)/A (train): {eq['train']['iso_gap_text']}"
                     f"{_matched(summary['ab']['verdict'], 'train')}")
    return lines + [f"headline: {summary['headline']}"]
