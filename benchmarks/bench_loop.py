"""Loop overhead: our training step against a minimal hand-written FSDP2 loop, same model, batch and world.

Both run in the same processes (2 ranks by default, gloo on CPU), on the same batches, in alternating
rounds (ours then bare, bare then ours, ...) so that load from other processes on a shared machine hits
both alike. Timed per step; the step time of a step is the slowest rank's.

- ours: ``train.state.start`` (the plan, then meta -> fully_shard per block + root -> to_empty -> sharded
  init, mixed precision as configured, and the optimizer), and per step what ``train.loop.loop`` does on a
  non-logging step apart from producing data: ``train.loop.train_step`` (forward in ``prec.autocast()``,
  loss, backward, clip, NaN bookkeeping, AdamW, ``prec.post_step``), the LR scheduler step and the
  preemption-signal check (one tiny all-reduce).
- bare: ``LlamaForCausalLM`` from the same config on meta, ``fully_shard`` per decoder layer and the
  root with the same ``MixedPrecisionPolicy``, ``to_empty``, weights copied from ours (so both start
  identical), ``torch.optim.AdamW``; per step: forward, cross entropy, backward, clip, step, zero_grad.

Ratio = bare median step time / ours median step time (throughput of ours relative to bare;
target >= 0.97). Prints a table, then one JSON line ``{"bench": "loop", ...}``.

Run: ``python benchmarks/bench_loop.py`` (relaunches itself under torch.distributed.run with --nproc
ranks unless it is already running under torchrun).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

TARGET_RATIO = 0.97


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="model preset (configs/<name>.yaml), default tiny")
    p.add_argument("--seq_len", type=int, default=256, help="tokens per sequence (--max_context_width)")
    p.add_argument("--batch_size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--num_layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--bf16", type=int, choices=(0, 1), default=1,
                   help="1: BF16 params for compute, FP32 reduction (MixedPrecisionPolicy); 0: FP32")
    p.add_argument("--activation_checkpointing", choices=("none", "full", "selective"), default="none",
                   help="ours' mode (the bare loop never checkpoints: its time is the yardstick of every mode)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds (ours/bare order flips each round)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before the first round")
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    args = p.parse_args(argv)
    for name in ("seq_len", "batch_size", "steps", "rounds", "nproc"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run this script under torch.distributed.run with nproc ranks (gloo on CPU); rank 0 prints."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__), *argv]
    return subprocess.run(cmd, env=env).returncode


def train_flags(args: argparse.Namespace, run_dir: str) -> list[str]:
    """The training flags both variants are built from (constant LR: the scheduler still runs)."""
    flags = ["--run_dir", run_dir,
             "--model", args.preset, "--device", "cpu", "--max_context_width", str(args.seq_len),
             "--train_batch_size", str(args.batch_size), "--bf16", str(args.bf16), "--fp8", "0",
             "--model_impl", "hf", "--seed", "0", "--warmup", "0", "--lr_decay_style", "constant",
             "--activation_checkpointing", args.activation_checkpointing,
             "--max_steps", str(args.warmup + args.steps * args.rounds)]
    if args.num_layers:
        flags += ["--num_layers", str(args.num_layers)]
    return flags


def build_ours(cfg, env):
    """Our real build and our per-step loop body (minus data fetch and logging)."""
    from llama_fp8.train import loop, state

    s = state.start(cfg, env)
    s.model.train()

    def step(batch: dict, n: int) -> torch.Tensor:
        # train_step draws its (--grad_accum_steps, here 1) micro-batches from an iterator.
        loss = loop.train_step(s, iter([batch]), n)[0]
        s.scheduler.step()
        s.watch.requested()
        return loss

    return s.model, step, s.watch


def build_bare(cfg, ours: nn.Module, device: torch.device):
    """The minimal FSDP2 loop a user would write, on the same architecture, with ours' initial weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    from llama_fp8.models.common import hf_config

    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config(cfg))
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16
          else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    copy_state(ours, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  weight_decay=cfg.weight_decay)
    model.train()

    def step(batch: dict, n: int) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"].to(device)).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].to(device).flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return model, step


@torch.no_grad()
def copy_state(src: nn.Module, dst: nn.Module) -> None:
    """Copy parameters (local shards: same mesh, same dim-0 sharding) and buffers by name (ours' without the
    activation checkpoint wrapper's prefix)."""
    from llama_fp8.models.common import canonical_name

    src_params = {canonical_name(n): p for n, p in src.named_parameters()}
    for name, p in dst.named_parameters():
        q = src_params[name]
        (p.to_local() if hasattr(p, "to_local") else p).copy_(q.to_local() if hasattr(q, "to_local") else q)
    src_bufs = {canonical_name(n): b for n, b in src.named_buffers()}
    for name, b in dst.named_buffers():
        b.copy_(src_bufs[name])


def timed_block(step: Callable[[dict, int], torch.Tensor], batches: list[dict], first: int,
                n: int) -> tuple[list[float], list[float]]:
    """n steps (step numbers first.. on batches[k % len]); per step this rank's wall and CPU seconds."""
    dist.barrier()
    wall, cpu = [], []
    for k in range(first, first + n):
        t0, c0 = time.perf_counter(), time.process_time()
        step(batches[k % len(batches)], k + 1)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


Rounds = dict[str, list[list[float]]]
"""Per variant, per round, per step: seconds."""


def run_rounds(args, steps: dict[str, Callable], batches: list[dict]) -> tuple[Rounds, Rounds]:
    """Warm up each variant, then alternate: per round, ``args.steps`` steps of each, order flipped every
    round. Returns this rank's (wall, cpu) seconds per variant, round and step."""
    names = list(steps)
    for name in names:
        timed_block(steps[name], batches, 0, args.warmup)
    wall: Rounds = {name: [] for name in names}
    cpu: Rounds = {name: [] for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            gc.collect()
            w, c = timed_block(steps[name], batches, args.warmup + r * args.steps, args.steps)
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu


def across_ranks(times: Rounds, combine: Callable[[list[float]], float]) -> Rounds:
    """Combine each step's per-rank seconds: max for wall time (a step is done when its slowest rank
    is), sum for CPU time (CPU seconds the whole job spent on the step)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return {name: [[combine([g[name][r][i] for g in gathered]) for i in range(len(rnd))]
                   for r, rnd in enumerate(rounds)] for name, rounds in times.items()}


def summarize(wall: Rounds, cpu: Rounds) -> dict:
    """Median step time of each, the throughput ratio bare/ours (overall and per round), and the same
    ratio on CPU seconds (less sensitive to other load on a shared machine)."""
    flat = {name: sorted(t for rnd in rounds for t in rnd) for name, rounds in wall.items()}
    med = {name: statistics.median(v) for name, v in flat.items()}
    cpu_med = {name: statistics.median([t for rnd in rounds for t in rnd]) for name, rounds in cpu.items()}
    per_round = [statistics.median(b) / statistics.median(o) for o, b in zip(wall["ours"], wall["bare"])]
    return {"median": med, "p10": {n: v[len(v) // 10] for n, v in flat.items()},
            "p90": {n: v[min(len(v) - 1, (9 * len(v)) // 10)] for n, v in flat.items()}, "cpu": cpu_med,
            "ratio": med["bare"] / med["ours"], "ratio_cpu": cpu_med["bare"] / cpu_med["ours"],
            "ratio_per_round_median": statistics.median(per_round),
            "ratio_per_round_min": min(per_round), "ratio_per_round_max": max(per_round)}


def report(args, cfg, world: int, s: dict, first_loss: dict[str, float]) -> None:
    """The table, then one JSON line."""
    tokens = args.batch_size * args.seq_len * world
    load = os.getloadavg()[0]
    precision = "bf16" if args.bf16 else "fp32"
    print(f"loop overhead: preset {args.preset} ({cfg.num_layers} layers, hidden {cfg.hidden_width}), T={args.seq_len}, "
          f"B={args.batch_size}/rank, activation checkpointing {args.activation_checkpointing} (ours), {world} ranks (gloo, CPU, {os.environ.get('OMP_NUM_THREADS', '?')} threads/rank), "
          f"{precision}, {args.rounds} alternating rounds x {args.steps} steps, {os.cpu_count()} CPUs, "
          f"load avg {load:.2f}")
    print(f"first-step loss (same weights, same batch): ours {first_loss['ours']:.5f}, bare {first_loss['bare']:.5f}")
    print(f"{'variant':8s} {'median s/step':>13s} {'p10':>8s} {'p90':>8s} {'tokens/s':>10s} {'CPU s/step':>10s}")
    for name in ("ours", "bare"):
        m = s["median"][name]
        print(f"{name:8s} {m:13.4f} {s['p10'][name]:8.4f} {s['p90'][name]:8.4f} {tokens / m:10,.0f} "
              f"{s['cpu'][name]:10.4f}")
    print(f"throughput ratio ours/bare (bare time / ours time): {s['ratio']:.3f} (target >= {TARGET_RATIO}); "
          f"per round: median {s['ratio_per_round_median']:.3f}, range {s['ratio_per_round_min']:.3f}-"
          f"{s['ratio_per_round_max']:.3f}; on CPU seconds (all ranks): {s['ratio_cpu']:.3f}")
    print(json.dumps({
        "bench": "loop", "preset": args.preset, "num_layers": cfg.num_layers, "seq_len": args.seq_len,
        "batch_size_per_rank": args.batch_size, "world_size": world, "precision": precision,
        "activation_checkpointing": args.activation_checkpointing,
        "rounds": args.rounds, "steps_per_round": args.steps, "cpus": os.cpu_count(),
        "load_avg_1min": round(load, 2), "ours_median_s": round(s["median"]["ours"], 5),
        "bare_median_s": round(s["median"]["bare"], 5), "ratio": round(s["ratio"], 4),
        "ratio_per_round_median": round(s["ratio_per_round_median"], 4), "target": TARGET_RATIO,
        "ours_cpu_s": round(s["cpu"]["ours"], 5), "bare_cpu_s": round(s["cpu"]["bare"], 5),
        "ratio_cpu": round(s["ratio_cpu"], 4),
        "first_loss_ours": round(first_loss["ours"], 5), "first_loss_bare": round(first_loss["bare"], 5)}),
        flush=True)


def rank_main(args: argparse.Namespace) -> int:
    """Build both, time them in alternating rounds, report from rank 0."""
    from llama_fp8 import config, parallel
    from llama_fp8.train import build

    run_dir = tempfile.TemporaryDirectory(prefix="llama-fp8-bench-")  # the run's folder goes with the rank
    cfg = config.parse_args(train_flags(args, run_dir.name))
    env = parallel.init_distributed(cfg)
    watch = None
    try:
        torch.manual_seed(cfg.seed)
        ours, ours_step, watch = build_ours(cfg, env)
        _, bare_step = build_bare(cfg, ours, env.device)
        loader = iter(build.build_loaders(cfg, env)[0])
        batches = [next(loader) for _ in range(4)]
        first_loss = {"ours": ours_step(batches[0], 0).item(), "bare": bare_step(batches[0], 0).item()}
        wall, cpu = run_rounds(args, {"ours": ours_step, "bare": bare_step}, batches)
        wall, cpu = across_ranks(wall, max), across_ranks(cpu, sum)
        if env.is_main:
            report(args, cfg, env.world_size, summarize(wall, cpu), first_loss)
    finally:
        if watch is not None:
            watch.close()
        parallel.destroy_distributed()
        run_dir.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if "RANK" not in os.environ:
        return relaunch(args.nproc, argv)
    return rank_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
