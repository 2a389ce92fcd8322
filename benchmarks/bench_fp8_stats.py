"""Cost of --fp8_stats: training step time with per-layer FP8 numerics every N steps against none.

Three copies of the same torchao-FP8 model (same seed, same batches; emulated FP8 on CPU, real FP8 on an
FP8 GPU) train in alternating rounds of ``--window`` steps each: stats off, ``--fp8_stats 50`` and
``--fp8_stats 1``. Each step does what the training loop does for the statistics: the runtime's hooks
collect on logged steps and ``fp8_stats.report`` writes fp8_stats.jsonl and the metrics summary.

Every step is timed. Two ratios per variant (1.00 = free):

- **per window**: the median time of a whole window with stats / without. This is what a run sees, but a
  window's total carries every hiccup of a shared machine (its spread is printed with it).
- **from step times** (the headline): a statistics pass costs ``c = median step with stats (N=1) - median step
  without (off)``, paired by batch; at every N the cost is one pass per N steps, so the ratio is
  ``1 + c / (N * median step without)``. Medians of single steps shrug off the hiccups that move a window.

Prints a table, then one JSON line ``{"bench": "fp8_stats", ...}``.

Run: ``python benchmarks/bench_fp8_stats.py`` (about 2 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llama_fp8 import config as C
from llama_fp8 import models
from llama_fp8.precision import fp8_stats
from llama_fp8.precision.torchao import TorchaoFp8
from llama_fp8.telemetry import sinks


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="model preset, default tiny")
    p.add_argument("--num_layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--seq_len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch_size", type=int, default=2, help="sequences per step")
    p.add_argument("--window", type=int, default=50, help="steps per variant per round (>= 50 so N=50 logs once)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (the order rotates each round)")
    args = p.parse_args(argv)
    for name in ("num_layers", "seq_len", "batch_size", "window", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def build(cfg, every: int, device: torch.device, run_dir: Path):
    torch.manual_seed(cfg.seed)
    with device:
        model = models.get("hf").build(cfg)
    runtime = TorchaoFp8("tensorwise", emulated=device.type != "cuda", all_gather=False, stats_every=every)
    runtime.convert(model)
    model.to(device=device)
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = sinks.MetricsWriter(run_dir, enabled=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"step": 0}

    def step(ids: torch.Tensor) -> None:
        state["step"] += 1
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if runtime.stats is not None:
            fp8_stats.report(runtime.stats, writer, state["step"])

    if runtime.stats is not None:
        runtime.stats.before_step(1)
    return step


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = C.parse_args(["--model", args.preset, "--num_layers", str(args.num_layers),
                        "--max_context_width", str(args.seq_len)])
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen).to(device)
               for _ in range(args.window)]
    variants = {"off": 0, "N=50": 50, "N=1": 1}
    times: dict[str, list[float]] = {k: [] for k in variants}  # per window
    step_times: dict[str, list[list[float]]] = {k: [] for k in variants}  # per round, per batch
    with tempfile.TemporaryDirectory() as tmp:
        steps = {k: build(cfg, n, device, Path(tmp) / k.replace("=", "")) for k, n in variants.items()}
        for s in steps.values():  # warm-up: first-step allocations and lazy imports
            s(batches[0])
        order = list(variants)
        for r in range(args.rounds):
            for name in order[r % 3:] + order[:r % 3]:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0, each = time.perf_counter(), []
                for ids in batches:
                    t = time.perf_counter()
                    steps[name](ids)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    each.append(time.perf_counter() - t)
                times[name].append(time.perf_counter() - t0)
                step_times[name].append(each)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {k: med[k] / med["off"] for k in variants}
    off_step = statistics.median(t for rnd in step_times["off"] for t in rnd)
    # the same batch, the same round: a stats step (N=1) against a plain one (off)
    cost = statistics.median(a - b for ra, rb in zip(step_times["N=1"], step_times["off"]) for a, b in zip(ra, rb))
    derived = {k: 1.0 + cost / (n * off_step) if n else 1.0 for k, n in variants.items()}
    print(f"fp8_stats overhead: {args.preset} ({args.num_layers} layers), T={args.seq_len}, B={args.batch_size}, "
          f"{device.type}{' (emulated FP8)' if device.type != 'cuda' else ''}, {args.rounds} rounds x "
          f"{args.window} steps")
    print(f"{'variant':8s} {'median s/window':>16s} {'min - max':>15s} {'ratio (windows)':>16s} "
          f"{'ratio (step times)':>19s}")
    for k in variants:
        print(f"{k:8s} {med[k]:16.3f} {min(times[k]):7.3f}-{max(times[k]):<7.3f} {ratio[k]:16.3f} {derived[k]:19.4f}")
    print(f"a statistics pass costs {cost:.4f} s (median over paired steps) against a {off_step:.4f} s step: "
          f"{cost / off_step:.3f} of a step; at N=50 that is {derived['N=50'] - 1:.2%} of step time (goal <= 3 %)")
    print(json.dumps({"bench": "fp8_stats", "preset": args.preset, "num_layers": args.num_layers,
                      "seq_len": args.seq_len, "batch_size": args.batch_size, "device": device.type,
                      "window": args.window, "rounds": args.rounds,
                      "median_s_per_step": {k: round(med[k] / args.window, 5) for k in variants},
                      "stats_pass_s": round(cost, 5), "plain_step_s": round(off_step, 5),
                      "ratio": round(derived["N=50"], 4), "ratio_n50": round(derived["N=50"], 4),
                      "ratio_n1": round(derived["N=1"], 4), "window_ratio_n50": round(ratio["N=50"], 4),
                      "window_ratio_n1": round(ratio["N=1"], 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
