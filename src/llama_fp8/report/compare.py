"""A/B report of training runs: ``python -m llama_fp8 compare RUN_A RUN_B [RUN_A2 RUN_B2 ...]``.

Runs come in pairs, baseline first: R pairs (the same seed within a pair, a different one per pair) give
the speed-up with a 95 % confidence interval across pairs and the measured loss noise band (repeats.py).

Each run is a run directory (``metrics.jsonl`` + ``config.yaml``), a ``metrics.jsonl`` file, or
a plain Slurm log with ``Batch N Loss: x, Speed: y samples/sec, lr: z[, key: value ...]`` lines
(so logs of other recipes work too). Writes ``report.md``, ``summary.json`` and PNG plots; the
rendering lives in plots.py and loading in runs.py; this file summarises and judges.

Summary rules (also printed in the report):
- Throughput, TFLOPS and MFU are each run's rate over its logged windows with step
  ``> --warmup_steps_excluded``: work / time, the harmonic mean of the window rates (stats.rate). Default
  exclusion: ``max(ceil(10 % of the last step), first logged step)``, so the first logging window, which
  holds compilation and allocator warm-up, never counts. Data-wait is the median share; peak memory the max.
- The speed-up (one definition, one headline): B's samples/s rate over A's; across R pairs the geometric
  mean of the pairs' ratios, with a 95 % bootstrap interval (stats.ratio_ci). For one pair it is exactly
  the ratio of the two rates in the throughput table.
- Final train loss: mean of the last ``k = max(5, ceil(5 % of records))`` logged losses, taken on the
  steps both runs logged when they share any. Final validation loss: the last step both evaluated.
- Verdict: PASS when every available loss gap ``(B-A)/A`` (train, and validation when both runs
  have it; the mean over pairs) lies within ``max(--loss_tolerance, noise band)`` percent, else FAIL;
  the verdict says which of the two decided. The exit code stays 0 either way.
- At equal quality (equal_quality.py, isoloss.py): the iso-loss speed-up, how much sooner B reaches A's final
  smoothed loss, and the iso-time loss gap, each with its interval over pairs; the headline puts the raw speed-up,
  the iso-loss speed-up and the verdict side by side (the last line printed, ``headline.txt``).
- Same data: our runs log a fingerprint of every rank's tokens per logging window (``data_crc32``); when
  both runs have them, a differing window makes the verdict FAIL (the losses are not comparable).
  Plain logs have none: "not checked".
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from llama_fp8.report import equal_quality, fp8_view, hardware, isocurves, plots, ranks, repeats, repro, stats
from llama_fp8.report.plots import METRICS, render_report, same_data_text
from llama_fp8.report.runs import CompareError, Run, load_run, precision_label  # noqa: F401 - the CLI's API

DEFAULT_TOLERANCE_PCT = 1.0


# ----------------------------------------------------------------------------- summary
def default_warmup(run: Run) -> int:
    """Steps excluded by default: 10 % of the last step, at least the first logged window."""
    steps = [r["step"] for r in run.train]
    if len(steps) < 2:
        return -1  # a single record: keep it (nothing else to summarise)
    return max(math.ceil(0.1 * steps[-1]), steps[0])


def final_loss_k(n: int) -> int:
    """How many trailing logged losses are averaged for the final train loss."""
    return min(n, max(5, math.ceil(0.05 * n)))


def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def summarize_run(run: Run, warmup: int) -> dict[str, Any]:
    """Over records with step > warmup: the rate (work / time) of each rate metric, the median data-wait share,
    the max memory; None when a metric is absent."""
    kept = [r for r in run.train if r["step"] > warmup]
    out: dict[str, Any] = {"label": run.label, "name": run.name, "source": str(run.source),
                           "kind": run.kind, "warmup_steps_excluded": max(warmup, 0),
                           "records_used": len(kept), "last_step": run.train[-1]["step"],
                           "fp8_emulated": bool(run.meta.get("fp8_emulated"))}
    for key, _, _ in METRICS:
        pool = run.train if key == "mem_peak_gib" else kept
        vals = _finite([r.get(key) for r in pool])
        if key.startswith("mfu") and out["fp8_emulated"]:
            out[key] = None  # emulated FP8: no utilization of the GPU's FP8 (or BF16) peak to state
        elif key in repeats.RATE_KEYS:
            out[key] = stats.rate(vals)
        else:
            out[key] = (max(vals) if key == "mem_peak_gib" else statistics.median(vals)) if vals else None
    return out


def _gap_pct(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return (b - a) / a * 100 if a != 0 else math.nan


def loss_summary(a: Run, b: Run) -> dict[str, Any]:
    """Final train/val losses of both runs, on common steps when the runs share any."""
    common = sorted({r["step"] for r in a.train} & {r["step"] for r in b.train})
    res: dict[str, Any] = {"common_steps": bool(common)}
    if common:
        k = final_loss_k(len(common))
        steps = set(common[-k:])
        la = [r["loss"] for r in a.train if r["step"] in steps]
        lb = [r["loss"] for r in b.train if r["step"] in steps]
        res["train_steps"] = [common[-k], common[-1]]
    else:
        k = min(final_loss_k(len(a.train)), final_loss_k(len(b.train)))
        la, lb = [r["loss"] for r in a.train[-k:]], [r["loss"] for r in b.train[-k:]]
        res["train_steps"] = None
    res.update(k=k, train_loss_a=statistics.fmean(la), train_loss_b=statistics.fmean(lb))
    res["train_gap_pct"] = _gap_pct(res["train_loss_a"], res["train_loss_b"])
    va, vb = {r["step"]: r["val_loss"] for r in a.val}, {r["step"]: r["val_loss"] for r in b.val}
    both = sorted(set(va) & set(vb))
    res["val_step"] = both[-1] if both else None
    res["val_loss_a"] = va[both[-1]] if both else (a.val[-1]["val_loss"] if a.val else None)
    res["val_loss_b"] = vb[both[-1]] if both else (b.val[-1]["val_loss"] if b.val else None)
    res["val_gap_pct"] = _gap_pct(res["val_loss_a"], res["val_loss_b"])
    return res


def data_check(a: Run, b: Run) -> dict[str, Any]:
    """Did both runs train on the same tokens? Compares the data fingerprints (CRC32 of rank 0's
    input_ids per logged window; metrics.jsonl of our runs only) of the windows both runs logged."""
    fa, fb = ({(r.get("data_from_step"), r["step"]): r["data_crc32"] for r in run.train if "data_crc32" in r}
              for run in (a, b))
    common = sorted(set(fa) & set(fb), key=lambda k: k[1])
    differ = [k[1] for k in common if fa[k] != fb[k]]
    return {"windows_compared": len(common), "same": (not differ) if common else None,
            "first_different_step": differ[0] if differ else None}


# ----------------------------------------------------------------------------- report
_json_safe = stats.json_safe  # summary.json is strict JSON


def default_out_dir(a: Run, b: Run, arg_a: str, arg_b: str) -> Path:
    """``compare_<A>_vs_<B>`` in the runs' common parent directory, else the current directory."""
    def clean(s: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", s)
    locs = [Path(x).resolve() for x in (arg_a, arg_b)]
    locs = [p.parent if p.name == "metrics.jsonl" else p for p in locs]  # the run dir or the log file
    parent = locs[0].parent if locs[0].parent == locs[1].parent else Path.cwd()
    return parent / f"compare_{clean(a.name)}_vs_{clean(b.name)}"


# ----------------------------------------------------------------------------- CLI
def _nonneg_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def _nonneg_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return v


def _pos_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama_fp8 compare", allow_abbrev=False,
                                description="A/B report (markdown + PNG plots) of R pairs of training runs.",
                                epilog="docs: docs/report.md")
    p.add_argument("runs", metavar="RUN", nargs="+",
                   help="RUN_A RUN_B [RUN_A2 RUN_B2 ...]: pairs of baseline (e.g. BF16) and candidate (e.g. "
                        "FP8) runs, each a run dir, metrics.jsonl or Slurm log; pair i shares its seed")
    p.add_argument("--out", help="output dir (default: compare_<A>_vs_<B> next to the runs)")
    p.add_argument("--loss_tolerance", type=_nonneg_float, default=DEFAULT_TOLERANCE_PCT,
                   help="max |loss gap| in percent for PASS (default %(default)s)")
    p.add_argument("--warmup_steps_excluded", type=_nonneg_int, default=None,
                   help="leave steps <= N out of the medians (default: 10%% of the last step, "
                        "at least the first logged window)")
    p.add_argument("--arms", type=_nonneg_int, default=2,
                   help="runs per repeat: the baseline then N-1 candidates, each compared with the baseline of its "
                        "repeat (default 2: RUN_A RUN_B pairs); N > 2 writes one table and one plot of every arm "
                        "and each candidate's own report in vs_<arm>/")
    p.add_argument("--iso_loss_window", type=_pos_int, default=None,
                   help="logged train losses averaged for the iso-loss figures' smoothed curves (default: the final "
                        "train loss's k = max(5, 5%% of the records))")
    p.add_argument("--iso_loss_time", choices=isocurves.AXES, default="productive",
                   help="time axis of the iso-loss figures: productive (default: training time after start-up, "
                        "warm-up windows at the steady rate), measured (warm-up windows as measured) or elapsed "
                        "(the training loop's clock: evaluation and saves included)")
    p.add_argument("--repro", action="store_true",
                   help="print a bash script that re-runs this A/B (recorded commit, launcher command or each "
                        "run's training command) instead of writing the report")
    return p


def _pairs(args: argparse.Namespace) -> list[tuple[Run, Run]]:
    if len(args.runs) % 2:
        n = len(args.runs)
        arms = " or ".join(f"--arms {k}" for k in range(3, n + 1) if n % k == 0)  # runs per repeat that divide n
        raise CompareError(f"runs come in pairs (RUN_A RUN_B per pair, baseline first), got {n} path(s): the last "
                           f"RUN_B is missing; for more than two arms per repeat (a baseline, then its candidates), "
                           f"give {arms}")
    out = []
    for i in range(0, len(args.runs), 2):
        tag = "" if i == 0 else f" (pair {i // 2 + 1})"
        a, b = load_run(args.runs[i], "RUN_A" + tag), load_run(args.runs[i + 1], "RUN_B" + tag)
        if a.label == b.label:
            a.label, b.label = f"{a.label} [{a.name}]", f"{b.label} [{b.name}]"
        out.append((a, b))
    return out


def _warmups(pairs: list[tuple[Run, Run]], n: int | None) -> list[tuple[int, int]]:
    warm = []
    for i, pair in enumerate(pairs, 1):
        ws = tuple(default_warmup(r) if n is None else n for r in pair)
        for which, r, w in zip(("RUN_A", "RUN_B"), pair, ws):
            if not any(t["step"] > w for t in r.train):
                raise CompareError(f"--warmup_steps_excluded {w} leaves no step of {which} of pair {i} "
                                   f"({r.source}, last step {r.train[-1]['step']})")
        warm.append(ws)
    return warm


def summarize_pairs(pairs: list[tuple[Run, Run]], warm: list[tuple[int, int]], tolerance: float) -> dict[str, Any]:
    """The repeats: speed CIs, memory, per-pair losses, the noise band, the verdict (repeats.py)."""
    pair_losses = [loss_summary(a, b) for a, b in pairs]
    checks = [data_check(a, b) for a, b in pairs]
    noise = repeats.noise_band([a for a, _ in pairs], loss_summary)
    seeds = [runs_seed(a) for a, _ in pairs]
    return {"pairs": len(pairs), "seeds": seeds, "speed": repeats.speed(pairs, warm),
            "memory": repeats.memory(pairs), "goodput": [repeats.goodput([p[i] for p in pairs]) for i in (0, 1)],
            "pair_losses": pair_losses, "data_checks": checks,
            "noise": noise, "verdict": repeats.judge(pair_losses, noise, tolerance, checks)}


def rank_view(pairs: list[tuple[Run, Run]], out: Path) -> dict[str, Any]:
    """Stragglers and throttling per arm (ranks.py), and the heat strip of pair 1."""
    view: dict[str, Any] = {"a": ranks.arm_view([p[0] for p in pairs]), "b": ranks.arm_view([p[1] for p in pairs])}
    view["comparable"], view["comparable_line"] = ranks.comparability(view["a"], view["b"])
    plot = ranks.heat_strip(list(pairs[0]), ["A", "B"], out / "ranks.png")
    if plot is None and (out / "ranks.png").exists():
        (out / "ranks.png").unlink()  # a stale strip from an earlier compare here
    view["plot"] = plot
    return view


def runs_seed(run: Run) -> int | None:
    """The run's --seed from its config.yaml (the ask), None when unknown (a plain log)."""
    asked = run.config.get("asked") if isinstance(run.config.get("asked"), dict) else run.config
    seed = asked.get("seed") if isinstance(asked, dict) else None
    return seed if isinstance(seed, int) else None


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Load, summarise, plot and write; returns the summary dict (also written as JSON). Pair 1 gets the
    detailed tables and plots; all pairs feed the speed intervals, the noise band and the verdict."""
    pairs = _pairs(args)
    warm = _warmups(pairs, args.warmup_steps_excluded)
    (a, b), w1 = pairs[0], warm[0]
    out = Path(args.out) if args.out else default_out_dir(a, b, args.runs[0], args.runs[1])
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"run_a": summarize_run(a, w1[0]), "run_b": summarize_run(b, w1[1]),
                               "loss": loss_summary(a, b), "loss_tolerance_pct": args.loss_tolerance}
    summary["data"] = data_check(a, b)
    summary["environment"] = hardware.compare_environments(a.environments, b.environments)
    every = [(f"{r.name} ({'AB'[i]}, pair {n})", r.environments, r.swaps) for n, p in enumerate(pairs, 1)
             for i, r in enumerate(p)]
    summary["environment"].update(other_hardware=hardware.other_hardware(every), reference_run=every[0][0])
    summary["ab"] = summarize_pairs(pairs, warm, args.loss_tolerance)
    summary["speedup"] = repeats.headline(summary["ab"]["speed"])  # the one speed-up (module docstring)
    equal_quality.add_to(summary, pairs, warm, args.iso_loss_window, args.iso_loss_time, final_loss_k)
    summary["repro"] = repro.collect(pairs)
    summary["ranks"] = rank_view(pairs, out)
    ok, line = summary["ab"]["verdict"]["ok"], summary["ab"]["verdict"]["line"]
    if summary["ranks"]["comparable"] is False:  # the loss verdict stands; the speed-up does not
        line += f" | {summary['ranks']['comparable_line']}"
    summary.update(verdict="PASS" if ok else "FAIL", verdict_line=line)
    images = plots.plot_all([a, b], list(w1), out, args.loss_tolerance)
    report = out / "report.md"
    report.write_text(render_report(summary, images) + "\n" + fp8_view.markdown([a, b], out))
    summary.update(report=report, plots=images)
    (out / "headline.txt").write_text(summary["headline"] + "\n")
    (out / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2) + "\n")
    return summary


def repro_script(args: argparse.Namespace) -> str:
    """``--repro``: the re-run script of the runs given (nothing is written)."""
    if args.arms != 2:
        from llama_fp8.report import arms

        pairs = [tuple(load_run(p, f"run {p}") for p in g) for g in arms.groups(args)]
    else:
        pairs = _pairs(args)
    rest = [f"--loss_tolerance={args.loss_tolerance:g}"] + ([f"--arms={args.arms}"] if args.arms != 2 else [])
    if args.warmup_steps_excluded is not None:
        rest.append(f"--warmup_steps_excluded={args.warmup_steps_excluded}")
    rest += [f"--{k}={getattr(args, k)}" for k, default in (("iso_loss_window", None), ("iso_loss_time", "productive"))
             if getattr(args, k) != default]
    try:
        return repro.script(repro.collect(pairs), [*args.runs, *rest])
    except ValueError as e:
        raise CompareError(str(e)) from None


def goodput_text(arms: list[dict[str, Any] | None]) -> str:
    """``A 61.2 %, B 58.0 %`` (productive / wall over each arm's runs)."""
    def one(g: dict[str, Any] | None) -> str:
        return "n/a" if g is None or g["goodput"] is None else f"{100 * g['goodput']:.1f} %"
    return ", ".join(f"{tag} {one(g)}" for tag, g in zip("AB", arms))


def stragglers_text(view: dict[str, Any]) -> str:
    named = [f"{tag}: {', '.join(v['straggler_windows'])}" for tag, v in (("A", view["a"]), ("B", view["b"]))
             if v["straggler_windows"]]
    return "; ".join(named) if named else "none named"


def main(argv: list[str]) -> int:
    """CLI entry: returns 0 on success (either verdict), 2 on bad flags or inputs."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed the message naming the flag
        return int(e.code or 0)
    try:
        if args.repro:
            print(repro_script(args), end="")
            return 0
        if args.arms != 2:
            from llama_fp8.report import arms

            summary = arms.compare_arms(args, compare)
        else:
            summary = compare(args)
    except (CompareError, OSError) as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    if args.arms != 2:
        print(f"report: {summary['report']}")
        print(f"plot (arms): {summary['plots']['arms']}")
        for row in summary["arms"][1:]:
            print(f"{row['arm']}: speed-up {row['speedup_text']}; loss {row['verdict']} ({row['gap_text']})")
        print(f"verdict: {summary['verdict_line']}")
        print("\n".join(arms.cli_lines(summary)))
        return 0
    print(f"report: {summary['report']}")
    print(f"summary: {summary['report'].parent / 'summary.json'}")
    for name, path in summary["plots"].items():
        print(f"plot ({name}): {path}")
    if summary["ranks"]["plot"]:
        print(f"plot (ranks): {summary['ranks']['plot']}")
    print(f"speedup B/A: {summary['ab']['speed']['samples_per_sec']['text']}")
    print(f"same training data: {same_data_text(summary['data'])}")
    print(f"hardware: {hardware.one_line(summary['environment'])}")
    print(f"goodput: {goodput_text(summary['ab']['goodput'])}")
    print(f"stragglers: {stragglers_text(summary['ranks'])}; throttling: {summary['ranks']['comparable_line']}")
    print(f"verdict: {summary['verdict_line']}")
    print("\n".join(equal_quality.cli_lines(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
