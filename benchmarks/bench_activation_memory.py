"""Peak host memory of training steps with --activation_checkpointing none / selective / full (CPU).

Each variant runs in a fresh process (one rank, gloo): the real build (FSDP2, BF16 mixed precision) and
a few real training steps; the process reports the growth of its peak RSS over the steps, i.e. what the
activations, gradients and optimizer states added. Activations dominate that growth at long context,
which is what checkpointing trades for recompute. Prints a table and one JSON line; ratios are relative
to --activation_checkpointing none in the same run.

    .venv/bin/python benchmarks/bench_activation_memory.py            # tiny shape, T=1024, B=4
    .venv/bin/python benchmarks/bench_activation_memory.py --seq_len 256 --steps 2   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "selective", "full")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args: argparse.Namespace) -> None:
    """One variant, in this process: build, then --steps training steps; print one JSON line."""


    from llama_fp8 import config, parallel
    from llama_fp8.train import loop, state

    run_dir = tempfile.TemporaryDirectory(prefix="llama-fp8-bench-")  # the run's folder goes with the worker
    cfg = config.parse_args(["--model", args.model, "--device", "cpu", "--num_layers", str(args.num_layers),
                             "--max_context_width", str(args.seq_len), "--train_batch_size", str(args.batch_size),
                             "--activation_checkpointing", args.mode, "--run_dir", run_dir.name])
    env = parallel.init_distributed(cfg)
    try:
        s = state.start(cfg, env)
        batches = iter(s.train_loader)
        before = _rss_mib()
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            loss, _, _ = loop.train_step(s, batches, step)
        elapsed = (time.perf_counter() - t0) / args.steps
        print(json.dumps({"mode": args.mode, "rss_before_mib": before, "rss_peak_mib": _rss_mib(),
                          "step_s": elapsed, "loss": float(loss)}))
    finally:
        parallel.destroy_distributed()
        run_dir.cleanup()


def run_variant(args: argparse.Namespace, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--model", args.model,
           "--num_layers", str(args.num_layers), "--seq_len", str(args.seq_len),
           "--batch_size", str(args.batch_size), "--steps", str(args.steps)]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"variant {mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default="tiny")
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mode", choices=MODES, default="none")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    results = {mode: run_variant(args, mode) for mode in MODES}  # one after the other, fresh processes
    base = results["none"]["rss_peak_mib"] - results["none"]["rss_before_mib"]
    print(f"activation memory: --model {args.model}, {args.num_layers} layers, T={args.seq_len}, "
          f"B={args.batch_size}, 1 rank (CPU), {args.steps} steps")
    print(f"{'activation_checkpointing':>24s} {'peak RSS MiB':>12s} {'growth MiB':>10s} {'vs none':>8s} "
          f"{'s/step':>7s} {'loss':>8s}")
    for mode, r in results.items():
        growth = r["rss_peak_mib"] - r["rss_before_mib"]
        print(f"{mode:>24s} {r['rss_peak_mib']:12.0f} {growth:10.0f} {growth / base:8.2f} {r['step_s']:7.2f} "
              f"{r['loss']:8.4f}")
    print(json.dumps({"bench": "activation_memory", "model": args.model, "num_layers": args.num_layers,
                      "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps,
                      "results": results,
                      "ratio": (results["full"]["rss_peak_mib"] - results["full"]["rss_before_mib"]) / base,
                      "ratio_full": (results["full"]["rss_peak_mib"] - results["full"]["rss_before_mib"]) / base,
                      "ratio_selective": (results["selective"]["rss_peak_mib"]
                                          - results["selective"]["rss_before_mib"]) / base}))


if __name__ == "__main__":
    main()
