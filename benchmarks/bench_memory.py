"""Per-GPU memory of a training step in every activation checkpointing mode, from the estimator (its tracked peak
equals a real CPU run's to the byte: tests/estimate/test_equality.py): Llama 3.1 8B on 1 node and 70B on 8 nodes of
8 H100s at their 8192-token sequence, 2 sequences per GPU, the Hugging Face model, BF16, FSDP over all GPUs.

For each: the tracked peak and where it is, its split by kind, what the GPU terms add, the allocator margin and the
verdict against an H100 80GB. Prints a table, then one JSON line ``{"bench": "memory", ...}`` (its ``ratio``: the
first preset's tracked peak in the last mode measured over the first, selective over none by default). The numbers of another
version of the package (a baseline) come from running this script with that version first on PYTHONPATH.

Run: ``nice python benchmarks/bench_memory.py [--presets llama3.1-8b:1,llama3.1-70b:8] [--modes none,full,selective]``
(about 1-3 minutes per estimate on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

GIB = 2**30


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="llama3.1-8b:1,llama3.1-70b:8", help="preset:nodes, comma-separated")
    p.add_argument("--modes", default="none,full,selective", help="activation checkpointing modes, comma-separated")
    p.add_argument("--gpu", default="H100", help="the GPU of the verdict")
    p.add_argument("--keeps", default="", help="instead of the modes: selective checkpointing keeping these matmul "
                   "outputs (parallel/activation_checkpointing.py MATMULS), sets separated by ';', e.g. "
                   "'q,k,v,o,gate,up,down;q,v,gate'")
    return p.parse_args(argv)


def measure(preset: str, nodes: int, mode: str, gpu: str) -> dict:
    """One estimate; ``mode`` is an activation checkpointing mode or ``keep:<matmuls>`` (selective, keeping those)."""
    from llama_fp8.parallel import activation_checkpointing

    if not mode.startswith("keep:"):
        return _measure(preset, nodes, mode, gpu)
    keeps = activation_checkpointing.SELECTIVE_KEEPS
    activation_checkpointing.SELECTIVE_KEEPS = tuple(mode[5:].split(","))
    try:
        return _measure(preset, nodes, "selective", gpu) | {"keeps": mode[5:].split(",")}
    finally:
        activation_checkpointing.SELECTIVE_KEEPS = keeps


def _measure(preset: str, nodes: int, mode: str, gpu: str) -> dict:
    from llama_fp8 import config
    from llama_fp8.estimate import assess
    from llama_fp8.estimate.flags import EstimateOptions

    cfg = config.parse_args(["--model", preset, "--model_impl", "hf", "--activation_checkpointing", mode])
    e = assess.estimate(cfg, EstimateOptions(nodes=nodes, gpus_per_node=8, gpu=gpu, suggest=False))
    m = e.measurement
    return {"preset": preset, "nodes": nodes, "mode": mode, "seq": cfg.max_context_width, "batch": cfg.train_batch_size,
            "tracked_gib": round(m.peak_bytes / GIB, 2), "needed_gib": round(e.verdict.needed / GIB, 2),
            "margin_gib": round(e.verdict.margin / GIB, 2), "verdict": e.verdict.status,
            "peak_at": m.where.text(m.micro_batches),
            "by_kind_gib": {k: round(v / GIB, 2) for k, v in m.by_kind.items() if v},
            "seconds": round(e.seconds)}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.ERROR)
    from llama_fp8 import __file__ as package
    from llama_fp8.estimate import report

    rows, t0 = [], time.perf_counter()
    for spec in args.presets.split(","):
        preset, nodes = spec.split(":")
        modes = [f"keep:{k}" for k in args.keeps.split(";")] if args.keeps else args.modes.split(",")
        for mode in modes:
            rows.append(measure(preset, int(nodes), mode, args.gpu))
            print(f"[{time.perf_counter() - t0:5.0f} s] {preset} {mode}: {rows[-1]['tracked_gib']} GiB",
                  file=sys.stderr, flush=True)
    print(f"per-GPU memory of a training step, {args.gpu} x 8 per node, the Hugging Face model, BF16, FSDP; package "
          f"{os.path.dirname(package)}; {', '.join(f'{k} {v}' for k, v in report.versions().items())}")
    print(f"{'preset':14s} {'nodes':>5s} {'mode (keeps)':30s} {'tracked':>8s} {'needed':>8s} {'margin':>7s}  verdict  "
          f"     the peak is in")
    for r in rows:
        mode = r["mode"] + (f" ({','.join(r['keeps'])})" if "keeps" in r else "")
        print(f"{r['preset']:14s} {r['nodes']:5d} {mode:30s} {r['tracked_gib']:8.2f} {r['needed_gib']:8.2f} "
              f"{r['margin_gib']:7.2f}  {r['verdict']:13s} {r['peak_at']}")
    first = {r["mode"]: r["tracked_gib"] for r in rows if r["preset"] == rows[0]["preset"]}
    # the headline: what the last mode measured holds against the first (selective against none by default)
    ratio = round(rows[len(first) - 1]["tracked_gib"] / max(rows[0]["tracked_gib"], 1e-9), 4)
    print(json.dumps({"bench": "memory", "gpu": args.gpu, "ratio": ratio, "rows": rows}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
