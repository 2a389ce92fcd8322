"""R pairs of an A/B (pair i: BF16 and FP8 with the same seed s_i): the speed-up with confidence
intervals, peak memory, the measured loss noise band and the verdict that says what decided it.

- Noise band: the final-loss gap between the BF16 (A) runs of different seeds, ``max |(A_j - A_i) / A_i|``
  over pairs i < j, in percent: how far two runs that differ only by the seed land apart. Needs R >= 2;
  with R = 1 it is "not measured".
- FP8 gap: the mean over pairs of ``(B_i - A_i) / A_i`` (same seed, same data: the seed noise cancels).
- Verdict: the bar is ``max(tolerance, band)``: a gap inside the run-to-run noise cannot be told from it,
  and a gap inside the fixed tolerance is accepted by definition. Whichever is wider decided; the verdict
  line names it. Different training data in any pair fails the verdict.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from llama_fp8.report import stats

if TYPE_CHECKING:
    from llama_fp8.report.runs import Run

# (record key, label) of the rates given a B/A ratio with an interval
SPEED_METRICS = [("samples_per_sec", "speed-up (samples/s)"),
                 ("tokens_per_sec_per_device", "tokens/s/GPU"),
                 ("tflops_per_device", "TFLOPS/GPU"),
                 ("mfu_vs_bf16_peak", "MFU (vs BF16 peak)")]
GAP_KINDS = (("train", "train_gap_pct", "train_loss_a"), ("validation", "val_gap_pct", "val_loss_a"))
# Window rates a run is summarised by as work / time (stats.rate): every speed metric, and samples/s per device.
RATE_KEYS = frozenset(k for k, _ in SPEED_METRICS) | {"samples_per_sec_per_device", "mfu_vs_fp8_peak"}
HEADLINE = "samples_per_sec"  # the speed-up a report states as its result


def headline(speed_: dict[str, Any]) -> float | None:
    """The one speed-up of an A/B: B/A of samples/s (the point of ``speed``'s across-pair interval)."""
    overall = speed_[HEADLINE]["overall"]
    return overall["ratio"] if overall else None


def kept(run: Run, warmup: int, key: str) -> list[float]:
    """The window values of ``key`` after the excluded warm-up."""
    return [r[key] for r in run.train if r["step"] > warmup and r.get(key) is not None]


def speed(pairs: list[tuple[Run, Run]], warmups: list[tuple[int, int]]) -> dict[str, Any]:
    """Per metric: each arm's rate (all pairs' kept windows), per-pair ratio CIs and the across-pair CI."""
    out: dict[str, Any] = {}
    for key, label in SPEED_METRICS:
        data = [(kept(a, wa, key), kept(b, wb, key)) for (a, b), (wa, wb) in zip(pairs, warmups)]
        per_pair = [stats.ratio_ci([d], seed=i) for i, d in enumerate(data)]
        overall = stats.ratio_ci(data, seed=len(data)) if len(data) > 1 else per_pair[0]
        out[key] = {"label": label,
                    "rate_a": stats.rate([v for a, _ in data for v in a]),
                    "rate_b": stats.rate([v for _, b in data for v in b]),
                    "pairs": [ci and vars(ci) for ci in per_pair],
                    "overall": overall and vars(overall),
                    "text": overall.text() if overall else "n/a (not recorded by both arms)"}
    return out


def memory(pairs: list[tuple[Run, Run]]) -> dict[str, Any]:
    """Peak memory (high-water mark, GiB) per arm over all its runs, and B/A."""
    def peak(runs: list[Run]) -> float | None:
        vals = [float(r["mem_peak_gib"]) for run in runs for r in run.train
                if r.get("mem_peak_gib") is not None and math.isfinite(float(r["mem_peak_gib"]))]
        return max(vals) if vals else None
    a, b = peak([p[0] for p in pairs]), peak([p[1] for p in pairs])
    return {"peak_gib_a": a, "peak_gib_b": b, "ratio": b / a if a and b is not None else None}


def goodput(runs: list[Run]) -> dict[str, Any] | None:
    """One arm's wall time split over all its runs and attempts (telemetry/goodput.py); None when none recorded it."""
    from llama_fp8.telemetry.goodput import PARTS

    recs = [g for run in runs for g in run.goodput]
    if not recs:
        return None
    wall = sum(float(g["wall_s"]) for g in recs)
    parts = {k: sum(float(g.get(f"{k}_s") or 0.0) for g in recs) for k in PARTS}
    gaps = sorted(x for run in runs for x in run.restart_gaps)
    saves = sum(_saves(run) for run in runs)
    save_s = (parts["checkpoint_sync"] + parts["checkpoint_async"]) / saves if saves else None
    return {"attempts": len(recs), "runs": len(runs), "wall_s": wall, "parts_s": parts,
            "goodput": parts["productive"] / wall if wall > 0 else None, "restarts": len(gaps),
            "restart_gap_s": gaps, "save_s": save_s,
            "swaps": [{**w, "run": run.name} for run in runs for w in run.swaps]}


def _saves(run: Run) -> int:
    """Checkpoint saves a run made, redone ones included: the sum of its attempts' goodput records (``saves``);
    for records of an earlier version, the saves an uninterrupted run makes (every --checkpoint_freq steps and
    at the end; 0 when its config is unknown)."""
    from llama_fp8.report.runs import _find_key

    counts = [g.get("saves") for g in run.goodput]
    if counts and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        return sum(counts)
    freq, last = _find_key(run.config, "checkpoint_freq"), max((int(r["step"]) for r in run.train), default=0)
    return -(-last // freq) if isinstance(freq, int) and freq > 0 else 0


def noise_band(a_runs: list[Run], loss_summary) -> dict[str, Any]:
    """The BF16-vs-BF16 final-loss gaps across seeds (train and validation), and their max |gap|."""
    out: dict[str, Any] = {"measured": len(a_runs) > 1}
    for kind, gap_key, _ in GAP_KINDS:
        gaps = [loss_summary(a_runs[i], a_runs[j])[gap_key]
                for i in range(len(a_runs)) for j in range(i + 1, len(a_runs))]
        gaps = [g for g in gaps if g is not None]
        out[f"{kind}_gaps_pct"] = gaps
        out[f"{kind}_band_pct"] = max(abs(g) for g in gaps) if gaps and all(map(math.isfinite, gaps)) else None
    return out


def judge(pair_losses: list[dict[str, Any]], band: dict[str, Any], tolerance: float,
          data_checks: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdict from the pairs' loss gaps, the noise band and the tolerance; names what decided."""
    fails, lines = [], []
    for i, d in enumerate(data_checks, 1):
        if d["same"] is False:
            fails.append(f"pair {i} trained on different data (first differing window ends at step "
                         f"{d['first_different_step']}), so its losses are not comparable")
    gaps_out: dict[str, Any] = {}
    for kind, gap_key, _ in GAP_KINDS:
        gaps = [p[gap_key] for p in pair_losses if p[gap_key] is not None]
        if not gaps:
            continue
        if not all(map(math.isfinite, gaps)):
            fails.append(f"{kind} loss gap is not finite (a loss is nan/inf or zero)")
            continue
        gap, b = statistics.fmean(gaps), band.get(f"{kind}_band_pct")
        bar = tolerance if b is None else max(tolerance, b)
        by = ("the fixed tolerance (noise not measured)" if b is None else
              "the noise band (it is wider than the tolerance)" if b > tolerance else
              "the fixed tolerance (it is wider than the noise band)")
        within = abs(gap) <= bar
        gaps_out[kind] = {"gap_pct": gap, "band_pct": b, "bar_pct": bar, "decided_by": by, "within": within}
        band_txt = "noise not measured" if b is None else f"noise band {b:.3f} %"
        line = (f"{kind} loss gap {gap:+.3f} % (mean of {len(gaps)} pair{'s' if len(gaps) > 1 else ''}) "
                f"{'within' if within else 'exceeds'} +-{bar:.4g} % (tolerance {tolerance:g} %, {band_txt}): "
                f"decided by {by}")
        (lines if within else fails).append(line)
    ok = not fails
    return {"ok": ok, "gaps": gaps_out, "reasons": fails + lines,
            "line": ("PASS: " if ok else "FAIL: ") + "; ".join(fails if fails else lines)}


def markdown(ab: dict[str, Any], la: str, lb: str) -> list[str]:
    """The report's sections for repeats: speed-up with CIs, memory, noise band and verdict reasoning."""
    n = ab["pairs"]
    lines = ["## Speed-up with 95 % confidence intervals", "",
             f"{n} pair(s), pair i = {la} and {lb} with seed s_i; rates are the harmonic mean of the logging "
             "windows after warm-up (work / time); intervals by bootstrap (see Method).", "",
             f"| metric | {la} | {lb} | B/A (95 % CI) | per pair |", "|---|---|---|---|---|"]
    for m in ab["speed"].values():
        per = "; ".join(f"{p['ratio']:.3g} ({p['low']:.3g}-{p['high']:.3g})" if p else "n/a" for p in m["pairs"])
        lines.append(f"| {m['label']} | {_num(m['rate_a'])} | {_num(m['rate_b'])} | {m['text']} | {per} |")
    mem = ab["memory"]
    lines += ["", f"Peak memory (max over runs): {la} {_num(mem['peak_gib_a'])} GiB, {lb} "
              f"{_num(mem['peak_gib_b'])} GiB, B/A {_num(mem['ratio'])}x", "",
              "## Loss parity against run-to-run noise", "",
              "| pair | seed | train loss A | train loss B | train gap | val gap |", "|---|---|---|---|---|---|"]
    for i, (p, seed) in enumerate(zip(ab["pair_losses"], ab["seeds"]), 1):
        lines.append(f"| {i} | {seed if seed is not None else 'n/a'} | {_num(p['train_loss_a'], '.4f')} | "
                     f"{_num(p['train_loss_b'], '.4f')} | {_pct(p['train_gap_pct'])} | {_pct(p['val_gap_pct'])} |")
    nb = ab["noise"]
    if nb["measured"]:
        lines += ["", f"Noise band (BF16 vs BF16 across seeds, max |gap|): train {_pct(nb['train_band_pct'], 0)}, "
                  f"validation {_pct(nb['validation_band_pct'], 0)}"]
    else:
        lines += ["", "Noise band: **noise not measured** (one pair; run with --repeats 2 or more)"]
    lines += ["", "## Goodput (where the wall time went)", ""]
    ga, gb = ab["goodput"]
    if ga is None and gb is None:
        lines += ["not recorded (runs without goodput records: plain logs or an older version)"]
    else:
        lines += [f"| part (s, all runs and attempts) | {la} | {lb} |", "|---|---|---|"]
        from llama_fp8.telemetry.goodput import PARTS

        for k in PARTS:
            lines.append(f"| {k.replace('_', ' ')} | {_num(ga and ga['parts_s'][k], '.1f')} | "
                         f"{_num(gb and gb['parts_s'][k], '.1f')} |")
        lines += [f"| wall | {_num(ga and ga['wall_s'], '.1f')} | {_num(gb and gb['wall_s'], '.1f')} |",
                  f"| **goodput** (productive / wall) | {_pct_of(ga)} | {_pct_of(gb)} |"]
        lines += restart_lines(ga, gb, la, lb)
    lines += ["", "Verdict reasoning:", ""] + [f"- {r}" for r in ab["verdict"]["reasons"]] + [""]
    return lines


MTBF_HOURS = (1, 6, 24)
"""Mean times between failures the report's checkpoint-interval advice is given for."""


def restart_lines(ga: dict | None, gb: dict | None, la: str, lb: str) -> list[str]:
    """Time lost to restarts (the gap from the last step before a restart to the first after it: detection,
    restart, start-up and redone steps) and, from the measured save cost, the checkpoint interval that maximizes
    goodput for a few failure rates (Young/Daly) and what a failure then costs on average."""
    from llama_fp8.telemetry.goodput import checkpoint_interval, expected_loss_per_failure

    def gaps(g):
        if not g or not g["restarts"]:
            return "none" if g else "n/a"
        xs = g["restart_gap_s"]
        return f"{g['restarts']}: {sum(xs):.1f} s (median {xs[len(xs) // 2]:.1f}, max {xs[-1]:.1f})"
    def swapped(g):
        if not g or not g.get("swaps"):
            return "none" if g else "n/a"
        xs = sorted(w["failure_to_step_s"] for w in g["swaps"])
        return f"{len(xs)}: failure to next step median {xs[len(xs) // 2]:.1f} s, max {xs[-1]:.1f} s"
    out = [f"| restarts: time from the last step before to the first after | {gaps(ga)} | {gaps(gb)} |",
           f"| swaps to a spare node (no requeue) | {swapped(ga)} | {swapped(gb)} |", ""]
    from llama_fp8.telemetry.swaps import line

    out += [f"- {label}, run {w['run']}: {line(w)}" for label, g in ((la, ga), (lb, gb)) for w in (g or {}).get("swaps", [])
            if all(k in w for k in ("node_in", "step", "failure_to_step_s", "requeue_expected_s", "cluster",
                                    "requeue_basis"))]
    out += [""] if out[-1] else []
    for label, g in ((la, ga), (lb, gb)):
        if not g or not g["save_s"]:
            continue
        restart = g["restart_gap_s"][len(g["restart_gap_s"]) // 2] if g["restarts"] else 0.0
        best = [(h, checkpoint_interval(g["save_s"], h * 3600.0)) for h in MTBF_HOURS]
        out.append(f"Checkpoint interval for {label} (a save blocks training {g['save_s']:.2f} s; Young/Daly): "
                   + ", ".join(f"MTBF {h} h -> every {t / 60:.1f} min, {expected_loss_per_failure(t, restart) / 60:.1f}"
                               f" min lost per failure" for h, t in best) + ".")
    return out


def _num(x: float | None, spec: str = ".4g") -> str:
    return "n/a" if x is None else format(x, spec)


def _pct_of(g: dict[str, Any] | None) -> str:
    return "n/a" if not g or g["goodput"] is None else f"{100 * g['goodput']:.1f} %"


def _pct(x: float | None, sign: int = 1) -> str:
    return "n/a" if x is None else (f"{x:+.3f} %" if sign else f"{x:.3f} %")
