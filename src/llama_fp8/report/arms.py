"""The report of an A/B with more than two arms (``compare --arms N``): BF16 and N-1 candidates, every candidate
compared with the BF16 run of the same repeat (same seed, same data), R repeats.

Each candidate gets the full two-arm report against BF16 (``compare.compare``, in ``vs_<arm>/``: speed-up and iso-loss
speed-up with their intervals, loss parity against the BF16-vs-BF16 noise band, ranks, FP8 numerics); a candidate that
ran on another model implementation than the first arm is compared with the BF16 arm of its own implementation when
the job has one (the shoot-out's ``bf16_<impl>``), and with the first arm too (``vs_<arm>/vs_<first>/``). This page
puts them side by side in one table (speed-up and iso-loss speed-up with intervals, loss verdict, MFU against the arm's
own format's peak, and compile, FP8 all-gather and activation checkpointing as each arm ran), ranks every arm by its
iso-loss speed-up over the first arm (report/shootout.py: which wins at equal quality, or that the intervals cannot
tell) and draws one plot (speed-up with its interval per arm beside the arms' training losses). The A/B passes when
every candidate's loss verdict passes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from llama_fp8.report import equal_quality, plots, repeats, settings, shootout, stats
from llama_fp8.report.runs import CompareError, Run, load_run

MAX_ARMS = 8


def groups(args: argparse.Namespace) -> list[list[str]]:
    """The run paths per repeat: the baseline, then the candidates (``--arms`` runs each)."""
    n = args.arms
    if not 2 <= n <= MAX_ARMS:
        raise CompareError(f"--arms {n}: between 2 and {MAX_ARMS} runs per repeat (the baseline and its candidates)")
    if len(args.runs) % n:
        raise CompareError(f"--arms {n}: runs come in groups of {n} (the baseline then {n - 1} candidates per "
                           f"repeat), got {len(args.runs)} path(s)")
    return [args.runs[i:i + n] for i in range(0, len(args.runs), n)]


def arm_name(path: str) -> str:
    """The arm a run folder stands for: its folder's name (``pair1/mxfp8`` -> ``mxfp8``)."""
    p = Path(path)
    return (p.parent.name if p.name == "metrics.jsonl" else p.stem if p.is_file() else p.name) or str(p)


def compare_arms(args: argparse.Namespace, compare_pairs) -> dict[str, Any]:
    """Every candidate's two-arm report (``compare_pairs(namespace)``, compare.compare) in ``vs_<arm>/``, then this
    page. Returns the summary (also written as summary.json)."""
    grouped = groups(args)
    parents = [str(Path(p).resolve().parent) for g in grouped for p in g]
    out = Path(args.out) if args.out else Path(os.path.commonpath(parents)) / "compare_arms"
    out.mkdir(parents=True, exist_ok=True)
    names = [arm_name(p) for p in grouped[0]]
    first = [load_run(p, f"arm {n}") for p, n in zip(grouped[0], names)]
    rows, subs, ranked = [], [], [shootout.entry(names[0], first[0].label, None)]
    for k in range(1, args.arms):
        slug, j = re.sub(r"[^A-Za-z0-9._-]+", "_", names[k]), own_baseline(first, k)
        summary = _two_arms(compare_pairs, args, grouped, j, k, out / f"vs_{slug}")
        subs.append(summary)
        # the ranking is against the first arm; a candidate with a BF16 run of its own implementation gets that one too
        vs_first = summary if j == 0 else _two_arms(compare_pairs, args, grouped, 0, k,
                                                     out / f"vs_{slug}" / f"vs_{names[0]}")
        ranked.append(shootout.entry(names[k], first[k].label, vs_first["equal_quality"]))
        rows.append({**row(names[k], summary, first[k]), "against": names[j]})
    baseline = first[0]
    base_row = row(names[0], None, baseline, subs[0]["run_a"]["warmup_steps_excluded"])
    plot = plot_arms([base_row, *rows], [baseline, *(load_run(g, n) for g, n in zip(grouped[0][1:], names[1:]))],
                     out / "arms.png")
    ok = all(s["verdict"] == "PASS" for s in subs)
    summary = {"arms": [base_row, *rows], "arms_per_repeat": args.arms, "repeats": len(grouped),
               "verdict": "PASS" if ok else "FAIL", "loss_tolerance_pct": args.loss_tolerance,
               "verdict_line": ("PASS: " if ok else "FAIL: ") + "; ".join(f"{r['arm']} {r['verdict']}" for r in rows),
               "noise": subs[0]["ab"]["noise"], "repro": _repro(subs, grouped), "plots": {"arms": plot},
               "ranking": shootout.rank(ranked)}
    summary["headline"] = [f"{r['arm']} vs {r['against']}: {r['headline']}" for r in rows] + [
        f"at equal quality: {summary['ranking']['line']}"]
    report = out / "report.md"
    report.write_text(render(summary, args))
    (out / "headline.txt").write_text("\n".join(summary["headline"]) + "\n")
    summary["report"] = report
    (out / "summary.json").write_text(json.dumps(stats.json_safe(summary), indent=2) + "\n")
    return summary


def _two_arms(compare_pairs, args: argparse.Namespace, grouped: list[list[str]], base: int, k: int,
              out: Path) -> dict[str, Any]:
    """The two-arm report of arm ``k`` against arm ``base`` over every repeat, in ``out``."""
    runs = [p for g in grouped for p in (g[base], g[k])]
    return compare_pairs(argparse.Namespace(**{**vars(args), "runs": runs, "arms": 2, "out": str(out)}))


def cli_lines(summary: dict[str, Any]) -> list[str]:
    """compare's last lines for more arms: each candidate's raw and iso-loss speed-up and verdict, then the call."""
    return list(summary["headline"])


def row(name: str, summary: dict[str, Any] | None, run: Run, warmup: int | None = None) -> dict[str, Any]:
    """One arm of the table: its speed-up and loss verdict against BF16 (None for the baseline), its MFU against its
    format's peak, its settings as run."""
    warm = summary["run_b"]["warmup_steps_excluded"] if summary else warmup
    mfu, key = settings.format_mfu(run, warm or 0)
    ran = settings.settings(run)
    out = {"arm": name, "label": run.label, "mfu": mfu, "mfu_key": key, **ran}
    if summary is None:
        return {**out, "speedup": 1.0, "speedup_text": "1 (baseline)", "verdict": "baseline", "gap_text": "-",
            "iso_text": "1 (baseline)", "against": "-"}
    speed, gaps = summary["ab"]["speed"][repeats.HEADLINE], summary["ab"]["verdict"]["gaps"]
    gap = "; ".join(f"{k} {g['gap_pct']:+.3f} % (bar +-{g['bar_pct']:.3g} %)" for k, g in gaps.items()) or "n/a"
    return {**out, "speedup": summary["speedup"], "speedup_text": speed["text"], "interval": speed["overall"],
            "verdict": summary["verdict"], "gap_text": gap, "report": f"vs_{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}",
            "iso_text": equal_quality.text(summary["equal_quality"], "train"), "headline": summary["headline"]}


def own_baseline(first: list[Run], k: int) -> int:
    """The arm candidate ``k`` is compared with: a BF16 arm of its own model implementation when the first arm (the
    baseline) ran on another one and the job has one, else the first arm."""
    impl = first[k].meta.get("model_impl")
    if impl is None or impl == first[0].meta.get("model_impl"):
        return 0
    same = [j for j, r in enumerate(first) if j not in (0, k) and settings.run_format(r) == "bf16"
            and r.meta.get("model_impl") == impl]
    return same[0] if same else 0


def _repro(subs: list[dict[str, Any]], grouped: list[list[str]]) -> dict[str, Any]:
    """The runs in group order (baseline, candidates per repeat), from the candidates' own Reproduce blocks."""
    by_source = {i["source"]: i for s in subs for i in s["repro"]["runs"]}
    runs = []
    for g in grouped:
        for path in g:
            src = next((k for k in by_source if Path(k).resolve() in (Path(path).resolve(),
                                                                       Path(path).resolve() / "metrics.jsonl")), None)
            if src is not None:
                runs.append(by_source[src])
    return {**subs[0]["repro"], "runs": runs}


def render(summary: dict[str, Any], args: argparse.Namespace) -> str:
    rows = summary["arms"]
    lines = [f"# A/B report: {len(rows)} arms against {rows[0]['label']}", "",
             f"{summary['repeats']} repeat(s) of every arm, interleaved with the order reversed per repeat; each "
             f"candidate compared with the {rows[0]['label']} run of the same repeat (same seed, same data). "
             f"Each candidate's full report: its `vs_<arm>/report.md`.", "",
             f"**Verdict: {summary['verdict_line']}** (tolerance {summary['loss_tolerance_pct']:g} %)", "",
             "| arm | precision | against | speed-up (samples/s, 95 % CI) | iso-loss speed-up (95 % CI) | loss gap | "
             "loss verdict | MFU vs its format's peak | compile | FP8 all-gather | AC | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = ("n/a (emulated)" if r["emulated"] else "n/a") if r["mfu"] is None else \
            f"{100 * r['mfu']:.3g} % ({r['mfu_key'].removeprefix('mfu_vs_')})"
        notes = [x for x in (r["bf16_tail"], "emulated: speed not meaningful" if r["emulated"] else None,
                             "**warned at start** (below)" if r["notes"] else None) if x]
        link = f"[{r['arm']}]({r['report']}/report.md)" if r.get("report") else r["arm"]
        lines.append(f"| {link} | {r['label']} | {r.get('against', '-')} | {r['speedup_text']} | "
                     f"{r.get('iso_text', '-')} | {r['gap_text']} | {r['verdict']} | {mfu} | "
                     f"{settings.flag(r['compile'])} | {settings.flag(r['all_gather'])} | "
                     f"{settings.flag(r['activation_checkpointing'])} | {'; '.join(notes) or '-'} |")
    warned = [(r["arm"], n) for r in rows for n in r["notes"]]
    if warned:
        lines += ["", "Warned at start:", ""] + [f"- {arm}: {n}" for arm, n in warned]
    nb = summary["noise"]
    band = (f"train {plots.fmt(nb['train_band_pct'])} %, validation {plots.fmt(nb['validation_band_pct'])} %"
            if nb["measured"] else "not measured (one repeat; run with --repeats 2 or more)")
    lines += ["", f"Noise band (BF16 vs BF16 across seeds, max |gap|): {band}. A loss verdict passes when the mean "
              "gap over repeats is within max(tolerance, noise band).", ""]
    lines += shootout.markdown(summary["ranking"], rows[0]["arm"])
    lines += ["## Plot", "", f"![arms]({summary['plots']['arms'].name})", ""]
    return "\n".join(lines)


def plot_arms(rows: list[dict[str, Any]], runs: list[Run], path: Path) -> Path:
    """One figure: the speed-up of each arm over BF16 with its interval (left), every arm's training loss of the
    first repeat (right)."""
    fig = Figure(figsize=(11, 4.5), dpi=110)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.9, bottom=0.2, wspace=0.25)
    bar, loss = fig.subplots(1, 2)
    xs = range(len(rows))
    for x, r in zip(xs, rows):
        ci = r.get("interval")
        low, high = (ci["low"], ci["high"]) if ci else (r["speedup"], r["speedup"])
        value = r["speedup"] if r["speedup"] is not None else 0.0
        bar.bar(x, value, color="tab:gray" if x == 0 else "tab:blue", alpha=0.8)
        if ci:
            bar.errorbar(x, value, yerr=[[value - low], [high - value]], color="black", capsize=4)
        bar.text(x, value, f"{value:.3g}\n{r['verdict']}", ha="center", va="bottom", fontsize=8)
    tops = [r["interval"]["high"] if r.get("interval") else (r["speedup"] or 0.0) for r in rows]
    bar.set_ylim(0, max(tops + [1.0]) * 1.2)  # room for the labels above the bars
    bar.axhline(1.0, color="black", lw=0.6)
    bar.set_xticks(list(xs), [r["arm"] for r in rows], rotation=20)
    bar.set_ylabel("speed-up vs BF16 (samples/s)")
    bar.set_title("Speed-up (95 % CI) and loss verdict")
    for run, r in zip(runs, rows):
        steps = [t["step"] for t in run.train]
        loss.plot(steps, [t["loss"] for t in run.train], lw=1.1, label=f"{r['arm']}: {run.label}")
    loss.set_xlabel("step")
    loss.set_ylabel("train loss")
    loss.set_title("Training loss (repeat 1)")
    loss.grid(True, alpha=0.3)
    loss.legend(fontsize=8)
    fig.savefig(path)
    return path
