"""Forward+backward TFLOPS of a linear layer: BF16 nn.Linear, TE FP8 Linear, torchao Float8Linear.

GEMM shapes are the projections of Llama 3.1 8B and 70B (q/k/v fused as TE would, o, gate, up,
down); ``--tokens`` is batch * sequence length per GPU. FLOPs per iteration = 6 * tokens * in * out
(forward, input gradient, weight gradient). Prints a table and one JSON line (``"type":
"bench_linear"``). GPU only: on a machine without CUDA it says so and exits 0 (nothing measured).

    python benchmarks/bench_linear.py --tokens 8192 --te_recipe current --torchao_recipe tensorwise
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
from torch import nn

# (model, name, in_features, out_features)
SHAPES = [  # (preset, GEMM, in features k, out features n): the presets' own projection shapes
    ("llama3.2-1b", "qkv", 2048, 2048 + 2 * 8 * 64),
    ("llama3.2-1b", "o", 2048, 2048),
    ("llama3.2-1b", "gate/up", 2048, 8192),
    ("llama3.2-1b", "down", 8192, 2048),
    ("llama3.2-3b", "qkv", 3072, 3072 + 2 * 8 * 128),
    ("llama3.2-3b", "o", 3072, 3072),
    ("llama3.2-3b", "gate/up", 3072, 8192),
    ("llama3.2-3b", "down", 8192, 3072),
    ("llama2-7b", "qkv", 4096, 3 * 4096),
    ("llama2-7b", "o", 4096, 4096),
    ("llama2-7b", "gate/up", 4096, 11008),
    ("llama2-7b", "down", 11008, 4096),
    ("llama3.1-8b", "qkv", 4096, 4096 + 2 * 8 * 128),
    ("llama3.1-8b", "o", 4096, 4096),
    ("llama3.1-8b", "gate/up", 4096, 14336),
    ("llama3.1-8b", "down", 14336, 4096),
    ("llama3.1-70b", "qkv", 8192, 8192 + 2 * 8 * 128),
    ("llama3.1-70b", "o", 8192, 8192),
    ("llama3.1-70b", "gate/up", 8192, 28672),
    ("llama3.1-70b", "down", 28672, 8192),
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="rows of the input (batch * seq)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--te_recipe", default="current", help="delayed|current|mxfp8|block")
    p.add_argument("--torchao_recipe", default="tensorwise", help="tensorwise|rowwise|...")
    p.add_argument(
        "--torchao_compile",
        type=int,
        default=1,
        choices=(0, 1),
        help="torch.compile the torchao layer (its intended use)",
    )
    p.add_argument("--models", default="llama3.1-8b,llama3.1-70b")
    return p.parse_args(argv)


def time_fwd_bwd(step: Callable[[], None], warmup: int, iters: int) -> float:
    """Mean seconds per call over ``iters`` calls (CUDA events), after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000.0 / iters


def make_step(layer: nn.Module, x: torch.Tensor, n: int, ctx: Callable) -> Callable[[], None]:
    """One forward (under ``ctx``) and backward of ``layer`` on ``x`` (M, K) -> (M, n)."""
    grad = torch.randn(x.shape[0], n, device=x.device, dtype=x.dtype)

    def step() -> None:
        with ctx():
            y = layer(x)
        y.backward(grad)  # backward outside the autocast, as TE recommends
        x.grad = None

    return step


def build_backends(args: argparse.Namespace) -> dict[str, Callable[[int, int], tuple]]:
    """backend name -> factory(in, out) returning (layer, context factory). Missing ones skipped."""
    import contextlib

    backends: dict[str, Callable[[int, int], tuple]] = {
        "bf16": lambda k, n: (
            nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16),
            contextlib.nullcontext,
        )
    }
    try:
        from llama_fp8.models.te.fp8 import recipes as te_recipes

        te = te_recipes.te_import()
        recipe = te_recipes.make_recipe(args.te_recipe)
        backends[f"te-{args.te_recipe}"] = lambda k, n: (
            te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda"),
            lambda: te_recipes.autocast(True, recipe, None),
        )
    except ImportError as e:
        print(f"[bench_linear] skipping TE: {e}", file=sys.stderr)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(args.torchao_recipe)

        def torchao_layer(k: int, n: int) -> tuple:
            seq = nn.Sequential(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
            layer = convert_to_float8_training(seq, config=config)[0]
            if args.torchao_compile:
                layer = torch.compile(layer)
            return layer, contextlib.nullcontext

        backends[f"torchao-{args.torchao_recipe}"] = torchao_layer
    except ImportError as e:
        print(f"[bench_linear] skipping torchao: {e}", file=sys.stderr)
    return backends


def run(args: argparse.Namespace) -> list[dict]:
    backends = build_backends(args)
    wanted = set(args.models.split(","))
    results = []
    for model, name, k, n in SHAPES:
        if model not in wanted:
            continue
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        row = {"model": model, "gemm": name, "m": args.tokens, "k": k, "n": n}
        for backend, factory in backends.items():
            layer, ctx = factory(k, n)
            seconds = time_fwd_bwd(make_step(layer, x, n, ctx), args.warmup, args.iters)
            row[backend] = 6 * args.tokens * k * n / seconds / 1e12
            del layer
        results.append(row)
    return results


def print_table(results: list[dict]) -> None:
    backends = [k for k in results[0] if k not in ("model", "gemm", "m", "k", "n")]
    print(f"{'model':<13} {'gemm':<8} {'M':>6} {'K':>6} {'N':>6} " + " ".join(f"{b:>20}" for b in backends))
    for r in results:
        cells = " ".join(f"{r[b]:>20.1f}" for b in backends)
        print(f"{r['model']:<13} {r['gemm']:<8} {r['m']:>6} {r['k']:>6} {r['n']:>6} {cells}")
    print("(TFLOPS, forward+backward = 6*M*K*N per iteration)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print(
            "bench_linear: no CUDA GPU visible; this benchmark measures GPU GEMMs only "
            "(run it on a GPU node, e.g. via scripts/gpu_selftest.sbatch). Nothing measured."
        )
        return 0
    results = run(args)
    print_table(results)
    device = torch.cuda.get_device_name()
    print(json.dumps({"type": "bench_linear", "device": device, "tokens": args.tokens, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
