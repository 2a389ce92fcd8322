"""``llama-fp8 fp8-bisect --config RUN.yaml --steps K``: which decoder layers must stay in BF16 for the FP8
loss to match BF16's?

It trains K steps in BF16 and in FP8 (same config, seed and data), then bisects over blocks of decoder
layers: each probe is a K-step FP8 run with ``--fp8_exclude model.layers.I.*`` for a set of layers, and
"good" means its loss is within ``--tolerance_pct`` of the BF16 loss. Halving the suspect set finds one
faulty layer in about 2*log2(L) runs; several faulty layers are found one half at a time (each half
searched with the other excluded). Prints the ``--fp8_exclude`` value and writes ``bisect.json`` and
``bisect.md`` in ``--out``. Runs are single-process, on this machine's device.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from collections.abc import Callable
from pathlib import Path

from llama_fp8.errors import EXIT_NONFINITE

log = logging.getLogger(__name__)


def layer_globs(layers: list[int]) -> str:
    return ",".join(f"model.layers.{i}.*" for i in sorted(layers))


def final_loss(run_dir: Path) -> float:
    """Mean of the last quarter (at least one) of a run's logged train losses."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    losses = [r["loss"] for r in recs if r.get("type") == "train"]
    if not losses:
        raise RuntimeError(f"{run_dir}: no train record in metrics.jsonl")
    return statistics.fmean(losses[-max(1, len(losses) // 4):])


def smallest_exclusion(layers: list[int], good: Callable[[list[int]], bool]) -> list[int]:
    """The layers that must be excluded, given that excluding all of ``layers`` is good. Splits the suspect
    set in halves: if excluding one half is enough, only that half is searched; if neither is, each half is
    searched with the other one excluded (two faults in different halves)."""
    return _search(list(layers), [], good)


def _search(suspects: list[int], fixed: list[int], good: Callable[[list[int]], bool]) -> list[int]:
    if len(suspects) <= 1:
        return suspects
    half = len(suspects) // 2
    a, b = suspects[:half], suspects[half:]
    if good(fixed + a):
        return _search(a, fixed, good)
    if good(fixed + b):
        return _search(b, fixed, good)
    found_a = _search(a, fixed + b, good)
    return found_a + _search(b, fixed + found_a, good)


class Prober:
    """Runs the K-step trainings and remembers each result (a set of layers is never trained twice)."""

    def __init__(self, config: str, steps: int, out: Path, tolerance_pct: float, extra: list[str]):
        self.config, self.steps, self.out, self.tol, self.extra = config, steps, out, tolerance_pct, extra
        self.runs: list[dict] = []
        self._cache: dict[tuple[int, ...], bool] = {}
        self.bf16 = self.train("bf16", ["--fp8", "0"])

    def train(self, name: str, flags: list[str]) -> float:
        from llama_fp8 import config, train

        run_dir = self.out / name
        cfg = config.parse_args(["--config", self.config, *self.extra, "--max_steps", str(self.steps), "--run_dir",
                            str(run_dir), "--resume_from_checkpoint", "none", "--checkpoint_freq", "0",
                            "--logging_freq", "1", *flags])
        rc = train.run(cfg)
        if rc == EXIT_NONFINITE and name != "bf16":  # FP8 diverged (a non-finite loss): as far off as can be
            return math.inf
        if rc != 0:
            raise RuntimeError(f"fp8-bisect: the {name} run failed (exit code {rc}); see {run_dir}")
        return final_loss(run_dir)

    def gap_pct(self, loss: float) -> float:
        return 100.0 * abs(loss - self.bf16) / abs(self.bf16) if math.isfinite(loss) else math.inf

    def good(self, excluded: list[int]) -> bool:
        key = tuple(sorted(excluded))
        if key not in self._cache:
            # --fp8_verify warn: a probe with every layer excluded is meant to have no FP8 layer
            flags = ["--fp8", "1", "--fp8_verify", "warn"] + (["--fp8_exclude", layer_globs(list(key))] if key else [])
            loss = self.train(f"fp8-{len(self.runs):02d}", flags)
            ok = self.gap_pct(loss) <= self.tol
            finite = math.isfinite(loss)  # JSON has no infinity: a diverged run is recorded as null
            self.runs.append({"excluded": list(key), "loss": loss if finite else None,
                              "gap_pct": self.gap_pct(loss) if finite else None, "good": ok})
            log.info("fp8-bisect: excluded %s -> loss %.5f (gap %.2f %%): %s", list(key) or "none", loss,
                     self.gap_pct(loss), "within tolerance" if ok else "off")
            self._cache[key] = ok
        return self._cache[key]


def bisect(config: str, steps: int, out: Path, tolerance_pct: float, extra: list[str] | None = None) -> dict:
    """The result: excluded layers, the --fp8_exclude value, every run made."""
    from llama_fp8 import config as train_config

    num_layers = train_config.parse_args(["--config", config, *(extra or [])]).num_layers
    p = Prober(config, steps, out, tolerance_pct, list(extra or []))
    everything = list(range(num_layers))
    if p.good([]):
        found = []
    elif not p.good(everything):
        raise RuntimeError(f"fp8-bisect: even with every decoder layer in BF16 the FP8 run's loss is off by "
                           f"{p.runs[-1]['gap_pct'] or math.inf:.2f} % (> {tolerance_pct} %): the gap is outside the decoder "
                           f"layers or the tolerance is too tight")
    else:
        found = smallest_exclusion(everything, p.good)
    result = {"bf16_loss": p.bf16, "tolerance_pct": tolerance_pct, "steps": steps, "num_layers": num_layers,
              "excluded_layers": found, "fp8_exclude": layer_globs(found), "fp8_runs": p.runs}
    (out / "bisect.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "bisect.md").write_text(report_md(result))
    return result


def report_md(r: dict) -> str:
    lines = ["# FP8 bisection", "", f"BF16 loss after {r['steps']} steps: {r['bf16_loss']:.5f}; tolerance "
             f"{r['tolerance_pct']:g} %; {r['num_layers']} decoder layers; {len(r['fp8_runs'])} FP8 runs.", "",
             "| run | layers in BF16 | loss | gap % | within tolerance |", "|---|---|---|---|---|"]
    for i, run in enumerate(r["fp8_runs"]):
        loss, gap = ("non-finite", "-") if run["loss"] is None else (f"{run['loss']:.5f}", f"{run['gap_pct']:.2f}")
        lines.append(f"| {i} | {run['excluded'] or 'none'} | {loss} | {gap} | "
                     f"{'yes' if run['good'] else 'no'} |")
    lines += ["", "A run whose loss went non-finite counts as infinitely far from BF16.", "", f"Use: `--fp8_exclude {r['fp8_exclude']}`" if r["fp8_exclude"] else "FP8 needs no exclusion.", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from llama_fp8.errors import EXIT_BAD_CONFIG, ConfigError

    p = argparse.ArgumentParser(prog="llama-fp8 fp8-bisect", description=__doc__.split("\n")[0],
                                epilog="docs: docs/fp8.md (Seeing FP8)")
    p.add_argument("--config", required=True, help="the run's config (a run dir's config.yaml or a YAML file)")
    p.add_argument("--steps", type=int, default=50, help="steps of each probe run (default 50)")
    p.add_argument("--tolerance_pct", type=float, default=1.0, help="loss gap to BF16 counted as good (default 1 %%)")
    p.add_argument("--out", default=None, help="folder for the probe runs and the report (default: "
                   "<config's folder>/fp8-bisect)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.tolerance_pct < 0:
        p.error("--steps must be >= 1 and --tolerance_pct >= 0")
    out = Path(args.out) if args.out else Path(args.config).resolve().parent / "fp8-bisect"
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = bisect(args.config, args.steps, out, args.tolerance_pct)
    except ConfigError as e:
        print(f"llama-fp8 fp8-bisect: {e}")
        return EXIT_BAD_CONFIG
    print(f"--fp8_exclude {result['fp8_exclude']}" if result["fp8_exclude"] else "FP8 needs no exclusion")
    print(f"report: {out / 'bisect.md'}")
    return 0
