"""Host memory of building and initializing a model under FSDP2: our sharded init against full-then-shard.

Peak RSS per rank (``resource.getrusage(RUSAGE_SELF).ru_maxrss``), each variant in fresh processes
(--nproc ranks under torch.distributed.run, gloo on CPU), the variants one after the other:

- ours: ``train.state.plan_and_build_model`` - the model on the meta device, ``fully_shard`` per decoder block and the root,
  ``to_empty`` (each rank allocates only its shard) and our sharded init (each rank draws only its rows),
  then the value check.
- baseline: what many FSDP scripts do - ``LlamaForCausalLM(config)`` with real weights (Hugging Face's
  init, FP32) on every rank, then ``fully_shard`` per decoder block and the root with the same mesh and
  ``MixedPrecisionPolicy``.

Both keep FP32 master weights, as training does. The RSS after imports and process-group set-up (before
any model exists) is reported too, so the model's own share can be read off. Ratio = ours' peak / the
baseline's peak, worst rank of each (target <= 0.6). Prints a table, then one JSON line
``{"bench": "init_memory", ...}``.

Run: ``python benchmarks/bench_init_memory.py`` (default --model llama3.2-1b: about 5 GB per full FP32
copy, so the baseline needs ~6 GB per rank; --model tiny for a quick check).
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

TARGET_RATIO = 0.6
VARIANTS = ("ours", "baseline")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3.2-1b", help="model preset (configs/<name>.yaml)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per variant")
    p.add_argument("--bf16", type=int, choices=(0, 1), default=1, help="MixedPrecisionPolicy as in training")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per variant")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # set for the ranks
    p.add_argument("--out_dir", help=argparse.SUPPRESS)  # where the ranks write their JSON
    args = p.parse_args(argv)
    if args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")
    return args


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_ours(cfg, env):
    """Our build: meta -> fully_shard -> to_empty -> sharded init -> value check."""
    from llama_fp8.train import state

    return state.plan_and_build_model(cfg, env)[3]


def build_baseline(cfg, env):
    """Full model with real weights on every rank (same seed everywhere), then fully_shard."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    from llama_fp8.models.common import hf_config

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(hf_config(cfg))
    mesh = init_device_mesh("cpu", (env.world_size,))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16
          else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def rank_main(args: argparse.Namespace) -> int:
    """One rank of one variant: build, then write this rank's numbers to out_dir/<variant>_rank<N>.json."""
    import torch.distributed as dist

    from llama_fp8 import config, parallel
    from llama_fp8.train.build import local_numel

    run_dir = tempfile.TemporaryDirectory(prefix="llama-fp8-bench-")  # the run's folder goes with the rank
    cfg = config.parse_args(["--model", args.model, "--device", "cpu", "--model_impl", "hf", "--fp8", "0",
                             "--bf16", str(args.bf16), "--run_dir", run_dir.name])
    env = parallel.init_distributed(cfg)
    from transformers import LlamaForCausalLM  # noqa: F401  (imported by both: not part of the model's share)

    try:
        before = peak_rss_mib()
        t0 = time.perf_counter()
        model = (build_ours if args.variant == "ours" else build_baseline)(cfg, env)
        dist.barrier()
        out = {"variant": args.variant, "rank": env.rank, "rss_before_mib": before, "peak_rss_mib": peak_rss_mib(),
               "build_s": time.perf_counter() - t0, "local_numel": local_numel(model),
               "num_params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())}
        Path(args.out_dir, f"{args.variant}_rank{env.rank}.json").write_text(json.dumps(out))
    finally:
        parallel.destroy_distributed()
        run_dir.cleanup()
    return 0


def launch(args: argparse.Namespace, variant: str, out_dir: Path) -> list[dict]:
    """Run one variant in fresh processes and collect every rank's numbers."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.abspath(__file__), "--model", args.model, "--bf16", str(args.bf16), "--variant", variant,
           "--out_dir", str(out_dir)]
    r = subprocess.run(cmd, env=env, timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"variant {variant} failed with exit code {r.returncode} (command: {' '.join(cmd)})")
    return [json.loads((out_dir / f"{variant}_rank{i}.json").read_text()) for i in range(args.nproc)]


def report(args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    """The table, then one JSON line (MiB; worst rank per variant)."""
    load = os.getloadavg()[0]
    print(f"init memory: --model {args.model}, {args.nproc} ranks (gloo, CPU), bf16={args.bf16}, FP32 master "
          f"weights, fresh processes per variant, {os.cpu_count()} CPUs, load avg {load:.2f}")
    print(f"{'variant':9s} {'rank':>4s} {'RSS before MiB':>14s} {'peak RSS MiB':>12s} {'model share MiB':>15s} "
          f"{'local params':>13s} {'build s':>8s}")
    for name in VARIANTS:
        for r in results[name]:
            print(f"{name:9s} {r['rank']:4d} {r['rss_before_mib']:14,.0f} {r['peak_rss_mib']:12,.0f} "
                  f"{r['peak_rss_mib'] - r['rss_before_mib']:15,.0f} {r['local_numel']:13,d} {r['build_s']:8.1f}")
    peak = {n: max(r["peak_rss_mib"] for r in results[n]) for n in VARIANTS}
    share = {n: max(r["peak_rss_mib"] - r["rss_before_mib"] for r in results[n]) for n in VARIANTS}
    ratio = peak["ours"] / peak["baseline"]
    print(f"peak RSS ratio ours/baseline (worst rank): {ratio:.3f} (target <= {TARGET_RATIO}); model share only: "
          f"{share['ours'] / share['baseline']:.3f}")
    print(json.dumps({
        "bench": "init_memory", "model": args.model, "world_size": args.nproc, "num_params":
        results["ours"][0]["num_params"], "cpus": os.cpu_count(), "load_avg_1min": round(load, 2),
        "ours_peak_rss_mib": round(peak["ours"]), "baseline_peak_rss_mib": round(peak["baseline"]),
        "ours_model_share_mib": round(share["ours"]), "baseline_model_share_mib": round(share["baseline"]),
        "ratio": round(ratio, 4), "ratio_model_share": round(share["ours"] / share["baseline"], 4),
        "target": TARGET_RATIO, "local_params": {n: results[n][0]["local_numel"] for n in VARIANTS},
        "build_s": {n: round(max(r["build_s"] for r in results[n]), 1) for n in VARIANTS}}), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.variant:
        if "RANK" not in os.environ:
            raise SystemExit("--variant is internal: it is set for the ranks this script launches")
        return rank_main(args)
    with tempfile.TemporaryDirectory(prefix="bench_init_memory_") as tmp:
        results = {v: launch(args, v, Path(tmp)) for v in VARIANTS}  # one after the other, never together
    report(args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
